// Stress test of the in-process fabric and the algorithms, run under AddressSanitizer/UBSan or
// ThreadSanitizer by tests/test_native_sanitizers.py. Threads play the ranks of several groups
// that call back-to-back collectives on fresh data; every result is checked exactly (ints):
// psum, all_gather (push and pull), all_to_all (by pairs as ranks arrive, and with a diverted
// block between two barriers) and psum_scatter (with and without a diverted block), the psum of
// several operands in one call (a pytree), and psum_scatter / all_gather over a non-leading
// dimension (strided rows).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "coll/collectives.h"
#include "common/ops.h"
#include "common/settings.h"
#include "fabric/inproc.h"

using namespace strata;

namespace {
constexpr int32_t kS8 = 2, kS32 = 4, kS64 = 5;  // xla::ffi::DataType

int fail(const char* what, int rank, int iter) {
  std::fprintf(stderr, "FAILED %s rank %d iter %d\n", what, rank, iter);
  return 1;
}

// A call's descriptor: its operator, element type and byte counts.
OpDesc desc(Op op, int32_t dtype, size_t in_bytes, size_t out_bytes) {
  OpDesc d;
  d.kind = static_cast<int32_t>(op);
  d.dtype = dtype;
  d.in_bytes = in_bytes;
  d.out_bytes = out_bytes;
  return d;
}

// One call on `team`: arrive with `in` and `out`, `algo` (its error, or empty), depart. The
// first error, or empty.
template <class Algo>
std::string call(InProcTeam& team, const OpDesc& d, const void* in, void* out, Algo algo) {
  std::string e = team.arrive(d, in, out);
  if (e.empty()) e = algo();
  if (e.empty()) e = team.depart();
  return e;
}

// A call that failed (`e` not empty): its error on stderr, this rank marked failed; true.
bool failed(const std::string& e, int* error) {
  if (e.empty()) return false;
  std::fprintf(stderr, "%s\n", e.c_str());
  *error = 1;
  return true;
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
            OpDesc d = desc(Op::psum, kS32, count * 4, count * 4);
            d.algo = static_cast<int32_t>(mine() % 2);
            const std::string e = call(*team, d, in.data(), out.data(), [&] {
              return all_reduce(*team, kS32, ReduceOp::kSum, count, team->peer_desc(0).algo == 1);
            });
            if (failed(e, &errors[g * n + r])) return;
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
            const OpDesc d = desc(Op::all_gather, kS32, count * 4, count * 4 * n);
            // Push on even iterations, pull on odd ones: both forms under the sanitizers.
            const std::string e = call(*team, d, in.data(), gathered.data(),
                                       [&] { return all_gather(*team, count * 4, it % 2 == 0); });
            if (failed(e, &errors[g * n + r])) return;
          }
          for (int j = 0; j < n; ++j)
            for (size_t i = 0; i < count; ++i)
              if (gathered[j * count + i] != all[j][i]) {
                errors[g * n + r] = fail("all_gather", r, it);
                return;
              }
          // all_to_all of a [3, 2, n*b] array split along axis 2 and concatenated along axis 0
          // (output [3n, 2, b]); on odd iterations index it/2 % 2 of axis 1 goes to a second
          // output (the two-fabric form), and every fourth iteration the output is written with
          // axis 1 moved to the front. Value of source j at [a, f, i]: j*100000 + a*20000 +
          // f*10000 + i.
          {
            const int64_t b = 1 + static_cast<int64_t>(count % 7);
            const std::vector<int64_t> shape{3, 2, n * b};
            std::vector<int32_t> src(6 * n * b), dst(6 * n * b, -1), side(3 * n * b, -1);
            for (int a = 0; a < 3; ++a)
              for (int f = 0; f < 2; ++f)
                for (int64_t i = 0; i < n * b; ++i)
                  src[(a * 2 + f) * n * b + i] =
                      static_cast<int32_t>(r * 100000 + a * 20000 + f * 10000 + i);
            const bool divert = it % 2 == 1, moved = divert && it % 4 == 3;
            const Divert dv{1, (it / 2) % 2, reinterpret_cast<char*>(side.data()), moved ? 0 : -1};
            auto team = InProcFabric::instance().join(1, 9, pl, "all_to_all");
            const OpDesc d = desc(Op::all_to_all, kS32, src.size() * 4, src.size() * 4);
            std::string e;
            if (!divert) {
              // One rendezvous, pairs of blocks copied by whichever rank arrives second
              // (InProcTeam::arrive_pairs): a peer's thread may run this rank's block copy.
              auto blk = [&](int j) { return all_to_all(*team, 4, shape, 2, 0, nullptr, j); };
              PairFn fn;
              fn.call = [](void* c, int j) { return (*static_cast<decltype(blk)*>(c))(j); };
              fn.ctx = &blk;
              e = team->arrive_pairs(d, src.data(), dst.data(), fn);
            } else {
              e = call(*team, d, src.data(), dst.data(),
                       [&] { return all_to_all(*team, 4, shape, 2, 0, &dv); });
            }
            if (failed(e, &errors[g * n + r])) return;
            for (int j = 0; j < n; ++j)
              for (int a = 0; a < 3; ++a)
                for (int f = 0; f < 2; ++f)
                  for (int64_t q = 0; q < b; ++q) {
                    const int32_t want =
                        static_cast<int32_t>(j * 100000 + a * 20000 + f * 10000 + r * b + q);
                    const int64_t row = j * 3 + a;  // output index along axis 0
                    const int64_t at = moved ? (f * 3 * n + row) * b + q : (row * 2 + f) * b + q;
                    const bool side_f = divert && f == dv.index;
                    const int32_t got = side_f ? side[row * b + q] : dst[at];
                    if (got != want || (side_f && dst[at] != -1)) {
                      errors[g * n + r] = fail("all_to_all", r, it);
                      return;
                    }
                  }
          }
          // psum_scatter in 2 sub-blocks per rank, on odd iterations with sub-block it/2 % 2
          // diverted to a second output (the two-fabric form).
          {
            const size_t sub = 1 + count % 300, out_count = 2 * sub;
            std::vector<int32_t> big(n * out_count), red(out_count, -1), side(sub, -1);
            for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(r * 7 + i);
            const bool divert = it % 2 == 1;
            const int part = divert ? (it / 2) % 2 : -1;
            auto team = InProcFabric::instance().join(1, 10, pl, "psum_scatter");
            const OpDesc d = desc(Op::psum_scatter, kS32, big.size() * 4, red.size() * 4);
            const std::string e = call(*team, d, big.data(), red.data(), [&] {
              return reduce_scatter(*team, kS32, ReduceOp::kSum, out_count, nullptr, 2, part,
                                    reinterpret_cast<char*>(side.data()));
            });
            if (failed(e, &errors[g * n + r])) return;
            for (int f = 0; f < 2; ++f)
              for (size_t q = 0; q < sub; ++q) {
                int32_t want = 0;  // sum over ranks j of j * 7 + (r * 2 + f) * sub + q
                for (int j = 0; j < n; ++j)
                  want += static_cast<int32_t>(j * 7 + (r * 2 + f) * sub + q);
                const bool side_f = f == part;
                const int32_t got = side_f ? side[q] : red[f * sub + q];
                if (got != want || (side_f && red[f * sub + q] != -1)) {
                  errors[g * n + r] = fail("psum_scatter", r, it);
                  return;
                }
              }
          }
          // psum of three operands in one call (a pytree: S32, S8 and S64 of different sizes,
          // the last one empty every fourth iteration), one-shot or two-shot by rank 0's
          // proposal (differing per rank).
          {
            const size_t c0 = count, c1 = count % 97, c2 = it % 4 == 0 ? 0 : 1 + count % 33;
            std::vector<int32_t> a(c0), ao(c0, -1);
            std::vector<int8_t> b(c1), bo(c1, -1);
            std::vector<int64_t> c(c2), co(c2, -1);
            for (size_t i = 0; i < c0; ++i) a[i] = static_cast<int32_t>(r * 3 + i);
            for (size_t i = 0; i < c1; ++i) b[i] = static_cast<int8_t>((r + i) % 7);
            for (size_t i = 0; i < c2; ++i) c[i] = r * 1000000007LL + static_cast<int64_t>(i);
            const OperandRef ops[3] = {{a.data(), ao.data(), c0 * 4, c0 * 4},
                                       {b.data(), bo.data(), c1, c1},
                                       {c.data(), co.data(), c2 * 8, c2 * 8}};
            const Operand meta[3] = {{kS32, c0}, {kS8, c1}, {kS64, c2}};
            auto team = InProcFabric::instance().join(1, 11, pl, "psum");
            const size_t bytes = c0 * 4 + c1 + c2 * 8;
            OpDesc d = desc(Op::psum, kS32, bytes, bytes);
            d.params.signature = c0 * 1000003 + c1 * 1009 + c2;
            d.algo = static_cast<int32_t>(mine() % 2);
            std::string e = team->arrive_list(d, ops, 3);
            if (e.empty())
              e = all_reduce_list(*team, ReduceOp::kSum, meta, 3, team->peer_desc(0).algo == 1);
            if (e.empty()) e = team->depart();
            if (failed(e, &errors[g * n + r])) return;
            bool ok = true;
            for (size_t i = 0; i < c0; ++i) {
              int32_t want = 0;
              for (int j = 0; j < n; ++j) want += static_cast<int32_t>(j * 3 + i);
              ok &= ao[i] == want;
            }
            for (size_t i = 0; i < c1; ++i) {
              int want = 0;
              for (int j = 0; j < n; ++j) want += static_cast<int>((j + i) % 7);
              ok &= bo[i] == static_cast<int8_t>(want);
            }
            for (size_t i = 0; i < c2; ++i) {
              int64_t want = 0;
              for (int j = 0; j < n; ++j) want += j * 1000000007LL + static_cast<int64_t>(i);
              ok &= co[i] == want;
            }
            if (!ok) {
              errors[g * n + r] = fail("psum of three operands", r, it);
              return;
            }
          }
          // psum_scatter over dimension 1 of a [rows, n * run] array, then its transpose,
          // all_gather over dimension 1, of the result: strided rows, in place.
          {
            const size_t rows = 1 + count % 5, run = 1 + count % 13;
            std::vector<int32_t> big(rows * n * run), red(rows * run, -1), gat(rows * n * run, -1);
            for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(r * 11 + i);
            auto sum_of = [&](size_t a, int blk, size_t q) {  // the reduced [a, blk*run + q]
              int32_t want = 0;
              for (int j = 0; j < n; ++j)
                want += static_cast<int32_t>(j * 11 + (a * n + blk) * run + q);
              return want;
            };
            std::string e;
            {
              auto team = InProcFabric::instance().join(1, 12, pl, "psum_scatter");
              OpDesc d = desc(Op::psum_scatter, kS32, big.size() * 4, red.size() * 4);
              d.params.dimension = 1;
              e = call(*team, d, big.data(), red.data(),
                       [&] { return reduce_scatter_rows(*team, kS32, ReduceOp::kSum, rows, run); });
            }
            if (e.empty()) {
              auto team = InProcFabric::instance().join(1, 13, pl, "all_gather");
              OpDesc d = desc(Op::all_gather, kS32, red.size() * 4, gat.size() * 4);
              d.params.dimension = 1;
              e = call(*team, d, red.data(), gat.data(),
                       [&] { return all_gather_rows(*team, rows, run * 4); });
            }
            if (failed(e, &errors[g * n + r])) return;
            for (size_t a = 0; a < rows; ++a)
              for (int blk = 0; blk < n; ++blk)
                for (size_t q = 0; q < run; ++q)
                  if ((blk == r && red[a * run + q] != sum_of(a, r, q)) ||
                      gat[(a * n + blk) * run + q] != sum_of(a, blk, q)) {
                    errors[g * n + r] = fail("psum_scatter/all_gather rows", r, it);
                    return;
                  }
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
