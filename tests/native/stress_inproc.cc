// Stress test of the in-process fabric and the algorithms, run under AddressSanitizer/UBSan or
// ThreadSanitizer by tests/test_native_sanitizers.py. Threads play the ranks of several groups
// that call back-to-back collectives on fresh data; every result is checked exactly (ints).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "coll/collectives.h"
#include "fabric/inproc.h"

using namespace strata;

namespace {
constexpr int32_t kS32 = 4;  // xla::ffi::DataType::S32

int fail(const char* what, int rank, int iter) {
  std::fprintf(stderr, "FAILED %s rank %d iter %d\n", what, rank, iter);
  return 1;
}
}  // namespace

int main(int argc, char** argv) {
  const int n = 4, groups = 2, iters = argc > 1 ? std::atoi(argv[1]) : 200;
  settings().timeout_ms.store(20000);
  std::vector<int> errors(n * groups, 0);
  std::vector<std::thread> threads;
  for (int g = 0; g < groups; ++g) {
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, g, r] {
        std::mt19937 gen(1234 + g);         // same stream in every rank of a group: known inputs
        std::mt19937 mine(99 + g * n + r);  // differs per rank: algorithm proposals disagree
        for (int it = 0; it < iters; ++it) {
          const size_t count = 1 + gen() % 5000;
          std::vector<std::vector<int32_t>> all(n, std::vector<int32_t>(count));
          for (auto& v : all)
            for (auto& e : v) e = static_cast<int32_t>(gen() % 1000) - 500;
          std::vector<int32_t> in = all[r], out(count, 0), gathered(count * n, 0);
          Placement pl{g, r, n, g * n + r};
          {
            auto team = InProcFabric::instance().join(1, 7, pl, "psum");
            OpDesc d;
            d.kind = 1;
            d.dtype = kS32;
            d.in_bytes = d.out_bytes = count * 4;
            d.algo = static_cast<int32_t>(mine() % 2);
            std::string e = team->arrive(d, in.data(), out.data());
            if (e.empty())
              e = all_reduce(*team, kS32, ReduceOp::kSum, count, team->peer_desc(0).algo == 1);
            if (e.empty()) e = team->depart();
            if (!e.empty()) {
              std::fprintf(stderr, "%s\n", e.c_str());
              errors[g * n + r] = 1;
              return;
            }
          }
          for (size_t i = 0; i < count; ++i) {
            int32_t want = 0;
            for (int j = 0; j < n; ++j) want += all[j][i];
            if (out[i] != want) {
              errors[g * n + r] = fail("psum", r, it);
              return;
            }
          }
          {
            auto team = InProcFabric::instance().join(1, 8, pl, "all_gather");
            OpDesc d;
            d.kind = 3;
            d.dtype = kS32;
            d.in_bytes = count * 4;
            d.out_bytes = count * 4 * n;
            std::string e = team->arrive(d, in.data(), gathered.data());
            // Push on even iterations, pull on odd ones: both forms under the sanitizers.
            if (e.empty()) e = all_gather(*team, count * 4, it % 2 == 0);
            if (e.empty()) e = team->depart();
            if (!e.empty()) {
              errors[g * n + r] = 1;
              return;
            }
          }
          for (int j = 0; j < n; ++j)
            for (size_t i = 0; i < count; ++i)
              if (gathered[j * count + i] != all[j][i]) {
                errors[g * n + r] = fail("all_gather", r, it);
                return;
              }
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  int bad = 0;
  for (int e : errors) bad += e;
  std::printf(bad ? "stress: %d ranks failed\n" : "stress: ok (%d ranks failed)\n", bad);
  return bad ? 1 : 0;
}
