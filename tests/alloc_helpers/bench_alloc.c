/* Measures what the allocation threshold trades off (run by hand, not in CI):
 *   cc -O2 bench_alloc.c -o bench_alloc
 *   ./bench_alloc                                  # glibc
 *   LD_PRELOAD=libstrata_alloc.so STRATA_ALLOC_THRESHOLD=4K ./bench_alloc   # everything pooled
 * For each size: a training-step-like pattern (8 live buffers of that size, each written once and
 * freed, repeated) timed per buffer, including first touch of every page. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  size_t sizes[] = {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
  printf("%10s %12s %12s\n", "size", "us/buffer", "alloc+free us");
  for (unsigned k = 0; k < sizeof(sizes) / sizeof(sizes[0]); ++k) {
    size_t n = sizes[k];
    int live = 8, steps = (int)(((size_t)256 << 20) / (n * live)) + 2;
    if (steps > 200) steps = 200;
    void* bufs[8];
    double best = 1e9, best_af = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      double t0 = now();
      for (int s = 0; s < steps; ++s) {
        for (int i = 0; i < live; ++i) {
          size_t m = n + (size_t)((s * 7 + i * 13) % 5) * 4096;  /* sizes vary a little, like XLA's */
          if (posix_memalign(&bufs[i], 64, m)) return 1;
          for (size_t j = 0; j < m; j += 4096) ((volatile char*)bufs[i])[j] = 1;
        }
        for (int i = 0; i < live; ++i) free(bufs[i]);
      }
      double t = (now() - t0) / (steps * live) * 1e6;
      if (t < best) best = t;
      t0 = now();
      for (int s = 0; s < 2000; ++s) {
        void* p;
        if (posix_memalign(&p, 64, n)) return 1;
        ((volatile char*)p)[0] = 1;
        free(p);
      }
      t = (now() - t0) / 2000 * 1e6;
      if (t < best_af) best_af = t;
    }
    printf("%10zu %12.2f %12.3f\n", n, best, best_af);
  }
  return 0;
}
