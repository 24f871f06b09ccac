// bench.h: what every benchmark in bench/ shares: a monotonic clock and a comparison for
// sorting timings (medians).
#ifndef VLMOE_BENCH_H
#define VLMOE_BENCH_H
#include <time.h>

static inline double bench_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static inline int bench_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
#endif
