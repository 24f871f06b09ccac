// test_core.c: the helpers every module uses (src/core/core.c) and the one data order
// (src/data/order.c). Golden values of the generators come from an independent Python
// implementation of splitmix64 and xoshiro256** (the values below, checked bit for bit); the
// counter-based normals must be a pure function of (key, counter) with the moments of N(0,1);
// checked size arithmetic must catch overflow; error messages compose with their prefixes; the
// data order must be a permutation per epoch and give each process its contiguous block; the
// profile's product-shape table (src/core/prof.c) must sum, order and reset.
#include <stdint.h>

#include "core/prof.h"
#include "data/order.h"
#include "test.h"

static void test_generators(void) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 42);
    const uint64_t want[3] = {0x15780b2e0c2ec716ull, 0x6104d9866d113a7eull, 0xae17533239e499a1ull};
    for (int i = 0; i < 3; i++) {
        const uint64_t got = vlmoe_rng_u64(&r);
        CHECK(got == want[i], "xoshiro256** output %d of seed 42: %016llx, want %016llx", i, (unsigned long long)got,
              (unsigned long long)want[i]);
    }
    CHECK(vlmoe_mix64(0) == 0xe220a8397b1dcdafull, "splitmix64(0) = %016llx", (unsigned long long)vlmoe_mix64(0));
    // the Python reference: -1.2299897245587617 and -0.6249173870469424
    CHECK(vlmoe_normal_at(12345, 7) == -1.2299897245587617, "normal_at(12345, 7) = %.17g", vlmoe_normal_at(12345, 7));
    CHECK(vlmoe_normal_at(0, 0) == -0.6249173870469424, "normal_at(0, 0) = %.17g", vlmoe_normal_at(0, 0));
    // a pure function: the same draw whatever came before; neighbours differ
    CHECK(vlmoe_normal_at(99, 3) == vlmoe_normal_at(99, 3) && vlmoe_normal_at(99, 3) != vlmoe_normal_at(99, 4) &&
              vlmoe_normal_at(99, 3) != vlmoe_normal_at(100, 3), "normal_at is keyed by (key, counter)");
    double s = 0, s2 = 0;
    const int n = 200000;
    for (int i = 0; i < n; i++) {
        const double x = vlmoe_normal_at((uint64_t)i * 7919u, (uint64_t)i % 13);
        s += x, s2 += x * x;
    }
    const double mean = s / n, var = s2 / n - mean * mean;
    CHECK(fabs(mean) < 0.01 && fabs(var - 1) < 0.02, "N(0,1) moments over %d draws: mean %.4f var %.4f", n, mean, var);
    // rng_below: in range and about uniform over 7 values
    long hist[7] = {0};
    vlmoe_rng_seed(&r, 7);
    for (int i = 0; i < 70000; i++) {
        const uint32_t v = vlmoe_rng_below(&r, 7);
        if (v < 7) hist[v]++;
        else CHECK(0, "rng_below(7) gave %u", v);
    }
    for (int v = 0; v < 7; v++) CHECK(labs(hist[v] - 10000) < 500, "value %d drawn %ld times of 70000", v, hist[v]);
}

static void test_sizes_and_errors(void) {
    size_t out = 5;
    CHECK(vlmoe_mul_ok(SIZE_MAX / 2 + 1, 2, &out) == 1 && out == 5, "a product past SIZE_MAX is refused, out untouched");
    CHECK(vlmoe_mul_ok(1u << 20, 1u << 20, &out) == 0 && out == (size_t)1 << 40, "2^20 x 2^20");
    CHECK(vlmoe_add_ok(SIZE_MAX, 1, &out) == 1 && vlmoe_add_ok(3, 4, &out) == 0 && out == 7, "checked sums");
    CHECK(vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor %s", "m.safetensors", "w") == VLMOE_ERR_FORMAT, "fail returns its status");
    vlmoe_error_prefix("layer %d", 3);
    CHECK(!strcmp(vlmoe_last_error(), "layer 3: m.safetensors: tensor w"), "prefixed message: %s", vlmoe_last_error());
}

// vlmoe_scratch_grow: on a 64-byte line, grown only when asked for more, and a size past
// SIZE_MAX once rounded up refused with the buffer kept (an allocation of 0 bytes else)
static void test_scratch(void) {
    void *buf = NULL;
    size_t cap = 0;
    char *p = vlmoe_scratch_grow(&buf, &cap, 100);
    CHECK(p && p == buf && cap == 128 && (uintptr_t)p % 64 == 0, "100 bytes: %p, capacity %zu", (void *)p, cap);
    CHECK(vlmoe_scratch_grow(&buf, &cap, 128) == p && cap == 128, "no more than it holds: the same buffer");
    memset(p, 7, 128);
    p = vlmoe_scratch_grow(&buf, &cap, 5000);
    CHECK(p && cap == 5056 && (uintptr_t)p % 64 == 0, "grown to 5000 bytes: %p, capacity %zu", (void *)p, cap);
    memset(p, 7, 5000); // (ASan: all of it can be written)
    CHECK(vlmoe_scratch_grow(&buf, &cap, SIZE_MAX - 3) == NULL && buf == p && cap == 5056,
          "a size past SIZE_MAX once rounded up is refused, the buffer kept");
    free(buf);
}

static void test_order(void) {
    vlmoe_order o;
    CHECK(vlmoe_order_init(&o, 10, 5, 1, 0, 1) == VLMOE_OK, "order of 10 items");
    int seen[3][10] = {{0}}, moved = 0;
    for (uint64_t i = 0; i < 30; i++) {
        const uint32_t it = vlmoe_order_at(&o, i);
        if (it < 10) seen[i / 10][it]++;
        moved += it != i % 10;
    }
    for (int e = 0; e < 3; e++)
        for (int k = 0; k < 10; k++) CHECK(seen[e][k] == 1, "epoch %d holds item %d %d times", e, k, seen[e][k]);
    CHECK(moved > 0, "the order is shuffled");
    vlmoe_order_free(&o);
    // process r of W takes the contiguous block r of each global batch: with W = 3 and batches of
    // 2 per process, step 1 of process 2 is global samples 10 and 11
    vlmoe_order all, p2;
    CHECK(vlmoe_order_init(&all, 50, 9, 2, 0, 1) == VLMOE_OK && vlmoe_order_init(&p2, 50, 9, 2, 2, 3) == VLMOE_OK,
          "orders");
    CHECK(vlmoe_order_local(&p2, 1, 2, 0) == vlmoe_order_at(&all, 10) &&
              vlmoe_order_local(&p2, 1, 2, 1) == vlmoe_order_at(&all, 11), "process 2's block of step 1");
    CHECK(vlmoe_order_local(&all, 3, 6, 4) == vlmoe_order_at(&all, 22), "one process: step x batch + j");
    vlmoe_order_free(&all), vlmoe_order_free(&p2);
    CHECK(vlmoe_order_init(&o, 10, 0, 0, 3, 3) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "rank 3"), "bad rank");
    CHECK(vlmoe_order_init(&o, 0, 0, 0, 0, 1) == VLMOE_ERR_ARG, "an empty order");
}

// The product-shape table behind bench_step_prof (src/core/prof.c): calls of one shape add up,
// another lda is another shape, the read gives the largest totals first and at most max of them,
// and a reset empties it.
static void test_prof_gemm(void) {
    prof_reset();
    const double t[5] = {0.5, 2.0, 0.25, 1.0, 3.0};
    for (int i = 0; i < 5; i++) prof_gemm_add(0, 1, 64 * (i + 1), 32, 16, 16, 16, t[i]);
    prof_gemm_add(0, 1, 64, 32, 16, 16, 16, 1.0); // shape 0 again: 1.5 s over 2 calls
    prof_gemm_add(0, 1, 64, 32, 16, 20, 16, 0.1); // another lda: a shape of its own
    prof_gemm_shape g[8];
    int n = prof_gemm_read(g, 8);
    CHECK(n == 6, "prof_gemm_read: %d shapes, want 6", n);
    const int want_m[6] = {320, 128, 64, 256, 192, 64};
    for (int i = 0; i < n && i < 6; i++)
        CHECK(g[i].M == want_m[i], "prof_gemm_read: shape %d has M %d, want %d (largest total first)", i, g[i].M,
              want_m[i]);
    CHECK(n >= 3 && g[2].calls == 2 && g[2].seconds == 1.5, "prof_gemm_read: M 64 has %ld calls, %g s; want 2, 1.5",
          n >= 3 ? g[2].calls : 0L, n >= 3 ? g[2].seconds : 0.0);
    CHECK(n == 6 && g[5].lda == 20, "prof_gemm_read: the last shape's lda is %d, want 20", n == 6 ? g[5].lda : 0);
    n = prof_gemm_read(g, 3);
    CHECK(n == 3 && g[0].M == 320 && g[1].M == 128 && g[2].M == 64, "prof_gemm_read(max 3): %d shapes, M %d %d %d", n,
          g[0].M, g[1].M, g[2].M);
    prof_reset();
    CHECK(prof_gemm_read(g, 8) == 0, "prof_gemm_read after prof_reset: shapes left");
}

int main(void) {
    test_generators();
    test_sizes_and_errors();
    test_scratch();
    test_order();
    test_prof_gemm();
    return test_summary("test_core");
}
