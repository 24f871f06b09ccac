// test_bf16.c: `--precision bf16` on the CPU (src/ops/gemm_bf16.c, the cpu-bf16 table of
// src/ops/backend_cpu.c, model_set_precision in src/nn/device.c).
// 1. The bf16 products: linear forward and backward (every transpose the block split makes,
//    beta 0 and 1, shapes that are no multiple of any tile) equal the double product of the
//    operands rounded to bf16, to fp32 accumulation error; the bits do not depend on the thread
//    count, also between processes that made their oneDNN primitives under 1 and 2 threads
//    (`--probe FILE`: this binary writes the products of a few shapes, see check_threads).
// 2. The whole one_tower parity model (tests/ref/gen_model.py) in bf16 against fp32: loss,
//    embeddings and gradients move by no more than twice what PyTorch's own CPU bf16 autocast
//    moves the same model (tests/ref/gen_bf16.py measures it). Twice, because vlmoe rounds a
//    subset of what autocast rounds (the products' inputs; autocast also stores their outputs
//    and the activations between them in bf16), so its difference should be the smaller one, and
//    one model's difference is a single draw of rounding noise. They must also differ from fp32
//    at all: that shows the bf16 path ran.
// On a CPU without bf16 instructions, part 1 and 2 are skipped and the fall-back is checked.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nn/model.h"
#include "ops/backend.h"
#include "ops/gemm_bf16.h"
#include "ops/ops.h"
#include "train/run.h"
#include "test.h"

// v rounded to bf16 by bf16_pack, as floats (the references multiply these in double)
static float *rounded(const float *v, size_t n) {
    uint16_t *h = malloc(sizeof(uint16_t) * n);
    float *r = malloc(sizeof(float) * n);
    bf16_pack(h, v, 1, (int)n, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        memcpy(r + i, &u, sizeof(float));
    }
    free(h);
    return r;
}

static float *randf(size_t n, vlmoe_rng *r) {
    float *v = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) v[i] = (float)vlmoe_rng_normal(r);
    return v;
}

// max |a - b| / max |b|
static double relerr(const float *a, const double *b, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) num = fmax(num, fabs(a[i] - b[i])), den = fmax(den, fabs(b[i]));
    return num / den;
}

// linear_forward_bf16 and linear_backward_bf16 on (N,K) x (O,K) against double sums of the
// bf16-rounded operands; the fp32 results pre-filled in out/dinp/dw check the accumulation.
static void check_linear(int N, int K, int O) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, (uint64_t)N * 131 + K * 7 + O);
    float *x = randf((size_t)N * K, &r), *w = randf((size_t)O * K, &r), *b = randf(O, &r);
    float *g = randf((size_t)N * O, &r), *out = randf((size_t)N * O, &r), *dinp = randf((size_t)N * K, &r);
    float *dw = randf((size_t)O * K, &r), *db = calloc(O, sizeof(float));
    double *ro = malloc(sizeof(double) * N * O), *rdi = malloc(sizeof(double) * N * K);
    double *rdw = malloc(sizeof(double) * O * K);
    float *xr = rounded(x, (size_t)N * K), *wr = rounded(w, (size_t)O * K), *gr = rounded(g, (size_t)N * O);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) {
            double s = out[(size_t)n * O + o] + b[o];
            for (int k = 0; k < K; k++) s += (double)xr[(size_t)n * K + k] * wr[(size_t)o * K + k];
            ro[(size_t)n * O + o] = s;
        }
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double s = dinp[(size_t)n * K + k];
            for (int o = 0; o < O; o++) s += (double)gr[(size_t)n * O + o] * wr[(size_t)o * K + k];
            rdi[(size_t)n * K + k] = s;
        }
    for (int o = 0; o < O; o++)
        for (int k = 0; k < K; k++) {
            double s = dw[(size_t)o * K + k];
            for (int n = 0; n < N; n++) s += (double)gr[(size_t)n * O + o] * xr[(size_t)n * K + k];
            rdw[(size_t)o * K + k] = s;
        }
    // beta 1: out += x.w^T + b
    linear_forward_bf16(out, x, w, b, N, K, O, 1);
    linear_backward_bf16(dinp, dw, db, g, x, w, N, K, O);
    // fp32 accumulation over at most a few thousand terms of unit size: a few 1e-6 of the largest
    const double tol = 2e-5;
    double e1 = relerr(out, ro, (size_t)N * O), e2 = relerr(dinp, rdi, (size_t)N * K), e3 = relerr(dw, rdw, (size_t)O * K);
    CHECK(e1 <= tol && e2 <= tol && e3 <= tol, "bf16 linear (%d,%d)x(%d,%d): errors out %.3g dinp %.3g dw %.3g of max "
          "|ref| (tolerance %.0g)", N, K, O, K, e1, e2, e3, tol);
    // db: the fp32 column sums of the unrounded g (summed by dinp's blocks as they round g)
    double *rdb = calloc(O, sizeof(double));
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) rdb[o] += g[(size_t)n * O + o];
    const double e4 = relerr(db, rdb, O);
    CHECK(e4 <= tol, "bf16 linear (%d,%d,%d): db error %.3g of max |ref| (tolerance %.0g)", N, K, O, e4, tol);
    free(rdb);
    // beta 0 (no bias) gives the plain product; and 1 thread gives the bits of 2
    float *o1 = malloc(sizeof(float) * N * O), *o2 = malloc(sizeof(float) * N * O);
    omp_set_num_threads(1);
    linear_forward_bf16(o1, x, w, NULL, N, K, O, 0);
    omp_set_num_threads(2);
    linear_forward_bf16(o2, x, w, NULL, N, K, O, 0);
    CHECK(!memcmp(o1, o2, sizeof(float) * N * O), "bf16 linear (%d,%d,%d): 1 and 2 threads differ", N, K, O);
    double worst = 0;
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)xr[(size_t)n * K + k] * wr[(size_t)o * K + k];
            worst = fmax(worst, fabs(o1[(size_t)n * O + o] - s) / sqrt((double)K));
        }
    CHECK(worst <= 1e-5, "bf16 linear (%d,%d,%d) beta 0: error %.3g (per sqrt(K))", N, K, O, worst);
    // the write mode: dinp full of NaN, which an accumulate or a sum post-op left in would read;
    // the values of an accumulate into zeros, and dw, db accumulated to the same bits
    float *da = calloc((size_t)N * K, sizeof(float)), *dn = malloc(sizeof(float) * N * K);
    float *dwa = calloc((size_t)O * K, sizeof(float)), *dwn = calloc((size_t)O * K, sizeof(float));
    float *dba = calloc(O, sizeof(float)), *dbn = calloc(O, sizeof(float));
    for (size_t i = 0; i < (size_t)N * K; i++) dn[i] = NAN;
    linear_backward_bf16(da, dwa, dba, g, x, w, N, K, O);
    linear_backward_write_bf16(dn, dwn, dbn, g, x, w, N, K, O);
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)N * K; i++) bad += !(dn[i] == da[i]);
    CHECK(bad == 0, "bf16 linear_backward_write (%d,%d,%d): %zu dinp values differ from an accumulate into zeros",
          N, K, O, bad);
    CHECK(!memcmp(dwa, dwn, sizeof(float) * O * K) && !memcmp(dba, dbn, sizeof(float) * O),
          "bf16 linear_backward_write (%d,%d,%d): dw or db differ from linear_backward_bf16's", N, K, O);
    free(da), free(dn), free(dwa), free(dwn), free(dba), free(dbn);
    free(x), free(w), free(b), free(g), free(out), free(dinp), free(dw), free(db), free(ro), free(rdi), free(rdw);
    free(o1), free(o2), free(xr), free(wr), free(gr);
}

// B packed from either of its stored forms, (N,K) read transposed (the forward's weights,
// pack_b_block's tile transposes) or (K,N) as it is, holds the same bf16 values, so the products
// must give the same bits: values that round to even and up, subnormals, signed zeros and
// large ones, at column counts past whole 16-column tiles and odd K (a half-padded last pair).
static void check_repack(int M, int N, int K) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, (uint64_t)M * 7919 + N * 31 + K);
    const int ld = K + 3; // a strided (N,K)
    float *a = randf((size_t)M * K, &r), *bt = malloc(sizeof(float) * (size_t)N * ld), *b = malloc(sizeof(float) * (size_t)K * N);
    float *c1 = malloc(sizeof(float) * (size_t)M * N), *c2 = malloc(sizeof(float) * (size_t)M * N);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < ld; k++) {
            const int kind = (n * 13 + k * 7) % 9;
            float v = (float)vlmoe_rng_normal(&r);
            if (kind == 1) v = 1.0f + 0x1p-8f;         // a tie: rounds to even (down)
            else if (kind == 2) v = -(1.0f + 3 * 0x1p-8f); // a tie that rounds up
            else if (kind == 3) v = 0x1p-130f * (1 + n % 5); // subnormal
            else if (kind == 4) v = -0.0f;
            else if (kind == 5) v = 3.0e38f * (k % 2 ? 1 : -1);
            bt[(size_t)n * ld + k] = v;
            if (k < K) b[(size_t)k * N + n] = v;
        }
    const gemm_bf16_counts k0 = gemm_bf16_get_counts();
    const int e1 = gemm_bf16(0, 1, M, N, K, a, K, bt, ld, 0, c1, N, NULL, NULL);
    const int e2 = gemm_bf16(0, 0, M, N, K, a, K, b, N, 0, c2, N, NULL, NULL);
    const gemm_bf16_counts k1 = gemm_bf16_get_counts();
    printf("repack (%d,%d,%d): B packed by pack_b_block %ld times, by a reorder %ld\n", M, N, K, k1.b_packed - k0.b_packed,
           k1.b_reordered - k0.b_reordered);
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)M * N; i++) bad += memcmp(c1 + i, c2 + i, sizeof(float)) != 0;
    CHECK(e1 == 0 && e2 == 0 && bad == 0, "bf16 B packed transposed and as stored (%d,%d,%d): %zu of %zu results differ "
          "(returns %d %d)", M, N, K, bad, (size_t)M * N, e1, e2);
    free(a), free(bt), free(b), free(c1), free(c2);
}

// The cpu-bf16 expert bank's forward reads act(h) as the first product's epilogue rounded it
// (mlp_forward_bf16): y and h must be the bits of the two products run apart, at 1 and 2
// threads, for experts of many rows, of a remainder block's rows, of no rows and of one row.
static void check_mlp_prerounded(void) {
    enum { E = 4, D = 96, M = 200, R = 1101 };
    const int32_t off[E + 1] = {0, 700, 700, 1100, R};
    const be_experts ex = {E, D, M, VLMOE_ACT_GELU, off};
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 99);
    float *w[4] = {randf((size_t)E * M * D, &r), randf((size_t)E * M, &r), randf((size_t)E * D * M, &r), randf((size_t)E * D, &r)};
    float *x = randf((size_t)R * D, &r), *y0 = randf((size_t)R * D, &r);
    float *y = malloc(sizeof(float) * R * D), *yr = malloc(sizeof(float) * R * D), *h = malloc(sizeof(float) * R * M);
    float *hr = malloc(sizeof(float) * R * M), *a = malloc(sizeof(float) * R * M), *ar = malloc(sizeof(float) * R * M);
    const float *const cw[4] = {w[0], w[1], w[2], w[3]};
    for (int thr = 1; thr <= 2; thr++) {
        omp_set_num_threads(thr);
        memcpy(y, y0, sizeof(float) * R * D), memcpy(yr, y0, sizeof(float) * R * D);
        backend_cpu_bf16()->experts_forward(backend_cpu_bf16(), y, h, a, x, cw, &ex, 1);
        for (int e = 0; e < E; e++) {
            const size_t o = (size_t)off[e];
            const int k = off[e + 1] - off[e];
            if (k <= 0) continue;
            linear_act_forward_bf16(hr + o * M, ar + o * M, x + o * D, w[0] + (size_t)e * M * D, w[1] + (size_t)e * M, k,
                                    D, M, VLMOE_ACT_GELU);
            linear_forward_bf16(yr + o * D, ar + o * M, w[2] + (size_t)e * D * M, w[3] + (size_t)e * D, k, M, D, 1);
        }
        // a is the bank's scratch: the fused forward only rounds act(h), for the second product
        CHECK(!memcmp(h, hr, sizeof(float) * R * M), "bf16 expert bank, %d threads: h differs from linear_act_forward_bf16's",
              thr);
        CHECK(!memcmp(y, yr, sizeof(float) * R * D),
              "bf16 expert bank, %d threads: y from the pre-rounded act(h) differs from the products run apart", thr);
    }
    for (int i = 0; i < 4; i++) free(w[i]);
    free(x), free(y0), free(y), free(yr), free(h), free(hr), free(a), free(ar);
}

// A product with op(A) = A^T (a weight gradient: K is the tokens) runs with K padded to 32 by
// zeros (gemm_bf16.c's product_of): it must give the bits of the same product with A stored
// transposed (op(A) = A, K as it is), accumulating (beta 1) as the gradients do, for K of no
// multiple of 32, and its primitives must be those of the padded K (the second K of a 32 makes none).
static void check_padded_k(int M, int N, int K) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, (uint64_t)M * 5 + N * 11 + K);
    float *a = randf((size_t)K * M, &r), *at = malloc(sizeof(float) * (size_t)M * K), *b = randf((size_t)K * N, &r);
    float *c1 = randf((size_t)M * N, &r), *c2 = malloc(sizeof(float) * (size_t)M * N);
    memcpy(c2, c1, sizeof(float) * (size_t)M * N);
    for (int k = 0; k < K; k++)
        for (int m = 0; m < M; m++) at[(size_t)m * K + k] = a[(size_t)k * M + m];
    const int e1 = gemm_bf16(1, 0, M, N, K, a, M, b, N, 1, c1, N, NULL, NULL);
    const int e2 = gemm_bf16(0, 0, M, N, K, at, K, b, N, 1, c2, N, NULL, NULL);
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)M * N; i++) bad += memcmp(c1 + i, c2 + i, sizeof(float)) != 0;
    CHECK(e1 == 0 && e2 == 0 && bad == 0, "bf16 A^T B with K %d padded (%d,%d): %zu of %zu results differ from A B's "
          "(returns %d %d)", K, M, N, bad, (size_t)M * N, e1, e2);
    // a K one less within the same 32 (K > 1) finds every primitive of the product made
    if (K % 32 != 1) {
        const gemm_bf16_counts k0 = gemm_bf16_get_counts();
        CHECK(gemm_bf16(1, 0, M, N, K - 1, a, M, b, N, 1, c1, N, NULL, NULL) == 0, "bf16 A^T B, K %d", K - 1);
        const gemm_bf16_counts k1 = gemm_bf16_get_counts();
        CHECK(k1.prim_misses == k0.prim_misses, "bf16 A^T B (%d,%d): K %d made %ld primitives after K %d", M, N, K - 1,
              k1.prim_misses - k0.prim_misses, K);
    }
    free(a), free(at), free(b), free(c1), free(c2);
}

// act_linear_backward_bf16 rounds act(h) straight into the layout of dw's B (gemm_bf16_bpack):
// dw must get the bits of the product reading act(h) from fp32 (linear_backward_bf16 on
// act_forward's a), at 1 and 2 threads, for row counts that are odd (a half-padded last pair),
// below one 32-row block, and columns past whole 64-column blocks; dh the values of dy.w act'(h).
static void check_act_backward_packed(int N, int M, int O) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, (uint64_t)N * 17 + M * 3 + O);
    float *dy = randf((size_t)N * O, &r), *h = randf((size_t)N * M, &r), *w = randf((size_t)O * M, &r);
    float *dw0 = randf((size_t)O * M, &r), *dw = malloc(sizeof(float) * O * M), *dwr = malloc(sizeof(float) * O * M);
    float *dh = malloc(sizeof(float) * N * M), *dhr = calloc((size_t)N * M, sizeof(float)), *a = malloc(sizeof(float) * N * M);
    float *db = calloc(O, sizeof(float)), *dbr = calloc(O, sizeof(float)), *c = malloc(sizeof(float) * N * M);
    act_forward_f32(a, h, (size_t)N * M, VLMOE_ACT_GELU_TANH);
    memcpy(dwr, dw0, sizeof(float) * O * M);
    linear_backward_bf16(NULL, dwr, NULL, dy, a, w, N, M, O);
    CHECK(gemm_bf16(0, 0, N, M, O, dy, O, w, M, 0, c, M, NULL, NULL) == 0, "bf16 dy.w (%d,%d,%d)", N, M, O);
    act_backward_f32(dhr, h, c, (size_t)N * M, VLMOE_ACT_GELU_TANH);
    for (int j = 0; j < O; j++)
        for (int n = 0; n < N; n++) dbr[j] += dy[(size_t)n * O + j];
    for (int thr = 1; thr <= 2; thr++) {
        omp_set_num_threads(thr);
        memcpy(dw, dw0, sizeof(float) * O * M);
        memset(db, 0, sizeof(float) * O);
        act_linear_backward_bf16(dh, a, dw, db, dy, h, w, N, M, O, VLMOE_ACT_GELU_TANH);
        size_t bad = 0, badh = 0;
        for (size_t i = 0; i < (size_t)O * M; i++) bad += memcmp(dw + i, dwr + i, sizeof(float)) != 0;
        for (size_t i = 0; i < (size_t)N * M; i++) badh += !(dh[i] == dhr[i]);
        CHECK(bad == 0 && badh == 0, "bf16 act_linear_backward (%d,%d,%d), %d threads: %zu dw values differ from the "
              "product on fp32 act(h), %zu dh values from dy.w act'(h)", N, M, O, thr, bad, badh);
        double e = 0;
        for (int j = 0; j < O; j++) e = fmax(e, fabs(db[j] - dbr[j]) / (1 + fabs(dbr[j])));
        CHECK(e <= 1e-5, "bf16 act_linear_backward (%d,%d,%d): db off by %.3g of the fp32 column sums", N, M, O, e);
    }
    free(dy), free(h), free(w), free(dw0), free(dw), free(dwr), free(dh), free(dhr), free(a), free(db), free(dbr), free(c);
}

// The bf16 products of shapes that cut into several row blocks with a remainder, have few
// rows and a long sum (where a matmul made for 2 threads could split the sum), or are an
// expert's: written to path for check_threads. Returns the exit status.
static int probe(const char *path) {
    const int shapes[][3] = {{1030, 96, 200}, {4096, 64, 32}, {47, 256, 1024}, {300, 1024, 64}};
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        const int N = shapes[s][0], K = shapes[s][1], O = shapes[s][2];
        vlmoe_rng r;
        vlmoe_rng_seed(&r, 17 + s);
        float *x = randf((size_t)N * K, &r), *w = randf((size_t)O * K, &r), *b = randf(O, &r), *g = randf((size_t)N * O, &r);
        float *out = malloc(sizeof(float) * N * O), *dinp = calloc((size_t)N * K, sizeof(float));
        float *dw = calloc((size_t)O * K, sizeof(float)), *db = calloc(O, sizeof(float));
        linear_forward_bf16(out, x, w, b, N, K, O, 0);
        linear_backward_bf16(dinp, dw, db, g, x, w, N, K, O);
        fwrite(out, sizeof(float), (size_t)N * O, f), fwrite(dinp, sizeof(float), (size_t)N * K, f);
        fwrite(dw, sizeof(float), (size_t)O * K, f), fwrite(db, sizeof(float), (size_t)O, f);
        free(x), free(w), free(b), free(g), free(out), free(dinp), free(dw), free(db);
    }
    return fclose(f) != 0;
}

// Two fresh processes, 1 and 2 threads, give the same bits: every primitive is made anew in
// each, so this also covers what oneDNN decides at creation from the thread count it sees.
static void check_threads(const char *argv0) {
    char dir[] = "/tmp/vlmoe_test_bf16t_XXXXXX", cmd[8192], *bits[2] = {NULL, NULL};
    size_t n[2] = {0, 0};
    if (!mkdtemp(dir)) return;
    for (int t = 0; t < 2; t++) {
        char name[16];
        snprintf(name, sizeof(name), "t%d", t + 1);
        snprintf(cmd, sizeof(cmd), "OMP_NUM_THREADS=%d '%s' --probe '%s'", t + 1, argv0, test_path(dir, name));
        CHECK(system(cmd) == 0, "%s failed", cmd);
        bits[t] = test_read_file(test_path(dir, name), &n[t]);
    }
    CHECK(bits[0] && bits[1] && n[0] == n[1] && n[0] > 0 && !memcmp(bits[0], bits[1], n[0]),
          "bf16 products made in a 1-thread and a 2-thread process differ (%zu and %zu bytes)", n[0], n[1]);
    free(bits[0]), free(bits[1]);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "rm -rf %s", dir);
}

static float *fixture_f32(const vlmoe_st *f, const char *name, size_t *n) {
    vlmoe_tensor_info ti;
    int i = vlmoe_st_find(f, name);
    if (i < 0 || vlmoe_st_info(f, i, &ti)) {
        CHECK(0, "fixture tensor %s missing (run `make fixtures`)", name);
        return NULL;
    }
    size_t cnt = ti.numel ? ti.numel : 1;
    float *v = malloc(sizeof(float) * cnt);
    if (vlmoe_st_read_f32(f, name, v, cnt)) CHECK(0, "read %s: %s", name, vlmoe_last_error());
    if (n) *n = cnt;
    return v;
}

static int32_t *fixture_i32(const vlmoe_st *f, const char *name) {
    vlmoe_tensor_info ti;
    int i = vlmoe_st_find(f, name);
    if (i < 0 || vlmoe_st_info(f, i, &ti) || ti.dtype != VLMOE_DT_I32) {
        CHECK(0, "fixture int32 tensor %s missing", name);
        return NULL;
    }
    int32_t *v = malloc(ti.nbytes);
    memcpy(v, ti.data, ti.nbytes);
    return v;
}

typedef struct {
    double loss;
    float *emb, *grad;
} result;

// One training forward and backward and both embeddings of the batch.
static result run_model(vlmoe_model *m, const vlmoe_batch *b, int E) {
    result r = {0};
    vlmoe_step_stats s;
    const size_t nf = vlmoe_model_num_floats(m);
    memset(vlmoe_model_grad_data(m), 0, sizeof(float) * nf);
    CHECK(vlmoe_model_forward(m, b, &s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
    vlmoe_model_backward(m);
    r.loss = s.loss;
    r.grad = malloc(sizeof(float) * nf);
    memcpy(r.grad, vlmoe_model_grad_data(m), sizeof(float) * nf);
    r.emb = malloc(sizeof(float) * 2 * (size_t)b->batch_size * E);
    vlmoe_model_encode_images(m, b->images, b->batch_size, r.emb);
    vlmoe_model_encode_texts(m, b->tokens, b->lengths, b->batch_size, r.emb + (size_t)b->batch_size * E);
    return r;
}

// The weights' bf16 shadows (src/ops/gemm_bf16.h): a trainer's steps in bf16 of two
// micro-batches each, which reuse them, give the bits of steps that pack every weight afresh
// (run 1 drops every shadow before each step by declaring another range), also when the weights
// are written between steps (through vlmoe_model_param_data, which changes their version:
// without it run 0 would read the old copies); the steps after an update pack no weight at all;
// a plain step keeps none (it would read each once).
static void check_shadows(const char *init, const vlmoe_batch *b) {
    vlmoe_model *m[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    double loss[2][4] = {{0}};
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule.base_lr = 1e-3, tp.schedule.warmup_steps = 0;
    for (int k = 0; k < 2; k++) {
        int fb = -1;
        CHECK(vlmoe_model_load(&m[k], init) == VLMOE_OK && model_set_precision(m[k], "bf16", &fb) == VLMOE_OK &&
              vlmoe_trainer_init(&t[k], m[k], &tp) == VLMOE_OK, "shadows: %s", vlmoe_last_error());
        if (!t[k]) break;
        for (int step = 0; step < 4; step++) {
            const size_t nf = vlmoe_model_num_floats(m[k]);
            if (step == 2) {
                float *w = vlmoe_model_param_data(m[k]);
                for (size_t i = 0; i < nf; i++) w[i] *= 0.75f;
            }
            if (k == 1) {
                static const float other = 0;
                gemm_bf16_shadow_use(&other, 1, 1);
                gemm_bf16_shadow_use(NULL, 0, 0);
            }
            const gemm_bf16_counts c0 = gemm_bf16_get_counts();
            vlmoe_step_stats st;
            const vlmoe_batch micro[2] = {*b, *b};
            CHECK(vlmoe_trainer_step_accum(t[k], micro, 2, &st) == VLMOE_OK, "shadows: step %d: %s", step,
                  vlmoe_last_error());
            loss[k][step] = st.loss;
            const gemm_bf16_counts c1 = gemm_bf16_get_counts();
            const long reused = c1.shadow_reused - c0.shadow_reused, packed = c1.shadow_packed - c0.shadow_packed;
            if (k == 0 && (step == 1 || step == 3))
                CHECK(reused > 0 && packed == 0, "shadows: step %d after an update reused %ld and packed %ld "
                      "(expected all reused)", step, reused, packed);
            if (k == 0 && step == 2)
                CHECK(packed > 0, "shadows: the weights written before step 2 were not packed again");
        }
    }
    if (t[0]) {
        const gemm_bf16_counts c0 = gemm_bf16_get_counts();
        vlmoe_model *m2 = NULL;
        vlmoe_trainer *t2 = NULL;
        int fb = -1;
        CHECK(vlmoe_model_load(&m2, init) == VLMOE_OK && model_set_precision(m2, "bf16", &fb) == VLMOE_OK &&
              vlmoe_trainer_init(&t2, m2, &tp) == VLMOE_OK && vlmoe_trainer_step(t2, b, NULL) == VLMOE_OK,
              "shadows: plain step: %s", vlmoe_last_error());
        const gemm_bf16_counts c1 = gemm_bf16_get_counts();
        CHECK(c1.shadow_packed == c0.shadow_packed && c1.shadow_reused == c0.shadow_reused,
              "shadows: a plain step kept shadows");
        vlmoe_trainer_free(t2), vlmoe_model_free(m2);
    }
    if (t[0] && t[1]) {
        const size_t nf = vlmoe_model_num_floats(m[0]);
        CHECK(!memcmp(loss[0], loss[1], sizeof(loss[0])) &&
              !memcmp(vlmoe_model_param_data(m[0]), vlmoe_model_param_data(m[1]), sizeof(float) * nf),
              "shadows: 4 steps with kept shadows differ from 4 that pack afresh (losses %.9g %.9g %.9g %.9g "
              "against %.9g %.9g %.9g %.9g)", loss[0][0], loss[0][1], loss[0][2], loss[0][3], loss[1][0],
              loss[1][1], loss[1][2], loss[1][3]);
    }
    // encoding reuses them from one call to the next (the first packs m[0]'s: m[1]'s were kept),
    // with the bits of fresh packing
    const gemm_bf16_counts c0 = gemm_bf16_get_counts();
    const int B = b->batch_size, E = t[1] ? vlmoe_model_get_config(m[1])->embed_dim : 1;
    float *e[3] = {calloc((size_t)B * E, sizeof(float)), calloc((size_t)B * E, sizeof(float)),
                   calloc((size_t)B * E, sizeof(float))};
    if (t[0] && t[1]) {
        vlmoe_model_encode_images(m[0], b->images, B, e[0]);
        const gemm_bf16_counts c1 = gemm_bf16_get_counts();
        vlmoe_model_encode_images(m[0], b->images, B, e[1]);
        const gemm_bf16_counts c2 = gemm_bf16_get_counts();
        CHECK(c1.shadow_packed > c0.shadow_packed && c2.shadow_packed == c1.shadow_packed &&
              c2.shadow_reused > c1.shadow_reused, "shadows: a second encode packed %ld weights again",
              c2.shadow_packed - c1.shadow_packed);
        static const float other = 0;
        gemm_bf16_shadow_use(&other, 1, 1);
        gemm_bf16_shadow_use(NULL, 0, 0);
        vlmoe_model_encode_images(m[1], b->images, B, e[2]);
        CHECK(!memcmp(e[0], e[1], sizeof(float) * B * E) && !memcmp(e[0], e[2], sizeof(float) * B * E),
              "shadows: encodes with kept shadows differ from one that packs afresh");
    }
    free(e[0]), free(e[1]), free(e[2]);
    printf("shadows: %zu bytes of packed weights for the one_tower model\n", gemm_bf16_get_counts().shadow_bytes);
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
}

static void check_model(void) {
    char path[512];
    vlmoe_st *tf = NULL, *rf = NULL;
    snprintf(path, sizeof(path), "%s/bf16_one_tower.safetensors", fixture_dir());
    if (vlmoe_st_open(path, &tf)) {
        CHECK(0, "cannot open %s (run `make fixtures`): %s", path, vlmoe_last_error());
        return;
    }
    snprintf(path, sizeof(path), "%s/model_one_tower.ref.safetensors", fixture_dir());
    CHECK(vlmoe_st_open(path, &rf) == VLMOE_OK, "open %s: %s", path, vlmoe_last_error());
    vlmoe_model *m = NULL;
    snprintf(path, sizeof(path), "%s/model_one_tower.init.safetensors", fixture_dir());
    CHECK(vlmoe_model_load(&m, path) == VLMOE_OK, "load %s: %s", path, vlmoe_last_error());
    if (!rf || !m) {
        vlmoe_st_close(tf), vlmoe_st_close(rf), vlmoe_model_free(m);
        return;
    }
    float *t_loss = fixture_f32(tf, "loss_rel", NULL), *t_emb = fixture_f32(tf, "emb_err", NULL);
    float *t_grad = fixture_f32(tf, "grad_rel", NULL);
    size_t nimg;
    float *images = fixture_f32(rf, "input.images", &nimg);
    int32_t *tokens = fixture_i32(rf, "input.tokens"), *lens = fixture_i32(rf, "input.lens");
    const vlmoe_model_config *cfg = vlmoe_model_get_config(m);
    const int B = (int)(nimg / (3 * (size_t)cfg->image_size * cfg->image_size)), E = cfg->embed_dim;
    const vlmoe_batch batch = {B, images, tokens, lens};
    const size_t nf = vlmoe_model_num_floats(m), ne = 2 * (size_t)B * E;
    result f32 = run_model(m, &batch, E);
    int fell_back = -1;
    CHECK(model_set_precision(m, "bf16", &fell_back) == VLMOE_OK, "model_set_precision: %s", vlmoe_last_error());
    result b16 = run_model(m, &batch, E);
    double dl = fabs(b16.loss - f32.loss) / fabs(f32.loss), de = 0, gd = 0, gn = 0;
    for (size_t i = 0; i < ne; i++) de = fmax(de, fabs(b16.emb[i] - f32.emb[i]));
    for (size_t i = 0; i < nf; i++) gd += pow(b16.grad[i] - f32.grad[i], 2), gn += pow(f32.grad[i], 2);
    const double dg = sqrt(gd / gn);
    printf("one_tower bf16 against fp32: loss %.3g, embeddings %.3g, gradients %.3g (PyTorch's autocast: %.3g, %.3g, "
           "%.3g)\n", dl, de, dg, t_loss[0], t_emb[0], t_grad[0]);
    CHECK(dl <= 2 * t_loss[0] + 1e-6, "bf16 loss moved by %.3g, more than twice PyTorch's %.3g", dl, t_loss[0]);
    CHECK(de <= 2 * t_emb[0], "bf16 embeddings moved by %.3g, more than twice PyTorch's %.3g", de, t_emb[0]);
    CHECK(dg <= 2 * t_grad[0], "bf16 gradients moved by %.3g, more than twice PyTorch's %.3g", dg, t_grad[0]);
    CHECK(de > 0 && dg > 0, "bf16 gives fp32's bits: the bf16 products did not run");
    // back to fp32: the same bits as before
    CHECK(model_set_precision(m, "fp32", &fell_back) == VLMOE_OK, "back to fp32: %s", vlmoe_last_error());
    result again = run_model(m, &batch, E);
    CHECK(again.loss == f32.loss && !memcmp(again.grad, f32.grad, sizeof(float) * nf),
          "--precision fp32 after bf16 does not give fp32's bits again");
    snprintf(path, sizeof(path), "%s/model_one_tower.init.safetensors", fixture_dir());
    check_shadows(path, &batch);
    free(f32.emb), free(f32.grad), free(b16.emb), free(b16.grad), free(again.emb), free(again.grad);
    free(t_loss), free(t_emb), free(t_grad), free(images), free(tokens), free(lens);
    vlmoe_model_free(m);
    vlmoe_st_close(tf), vlmoe_st_close(rf);
}

// The products' per-thread buffers start on a cache line, also after they grow: brgemm's AMX
// tiles read a row across two lines otherwise, at half the speed (gemm_bf16.c's scratch).
static void check_aligned(void) {
    const size_t n[] = {1, 1000, 3, 100001, 7, 3000001};
    for (size_t i = 0; i < sizeof(n) / sizeof(n[0]); i++) {
        const uint16_t *p = gemm_bf16_side(n[i]);
        CHECK(p && (uintptr_t)p % 64 == 0, "gemm_bf16_side(%zu) gives %p, not on a 64-byte line", n[i], (const void *)p);
    }
}

// The command line: a bad value is refused before any file is made; bf16 trains and is recorded.
static void check_cli(const char *argv0) {
    char bin[4096], out[8192], dir[] = "/tmp/vlmoe_test_bf16_XXXXXX", args[1024];
    if (!test_vlmoe_bin(argv0, bin) || !mkdtemp(dir)) return;
    test_expect_in(dir, bin, "train --model limoe-mini --dataset-type synthetic --steps 1 --precision fp16 "
                   "--logs logs --name x", 1, "--precision 'fp16': expected fp32 or bf16", out, sizeof(out));
    CHECK(access(test_path(dir, "logs"), F_OK) != 0, "a refused --precision made %s", test_path(dir, "logs"));
    snprintf(args, sizeof(args), "train --model limoe-mini --dataset-type synthetic --steps 2 --batch-size 8 "
             "--eval-samples 16 --precision bf16 --logs logs --name b");
    test_expect_in(dir, bin, args, 0, "trained to step 2", out, sizeof(out));
    char *pj = test_read_file(test_path(dir, "logs/b/params.json"), NULL);
    const char *q = pj ? strstr(pj, "\"precision\":") : NULL;
    if (q) q += strspn(q + 12, " \t") + 12;
    CHECK(q && !strncmp(q, "\"bf16\"", 6), "params.json records the precision: %s", pj ? pj : "(missing)");
    free(pj);
    snprintf(args, sizeof(args), "rm -rf %s", dir);
    CHECK(system(args) == 0, "rm -rf %s", dir);
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--probe")) return probe(argv[2]);
    vlmoe_model *m = NULL;
    vlmoe_model_config cfg;
    CHECK(vlmoe_config_named("limoe-mini", &cfg) == VLMOE_OK, "preset: %s", vlmoe_last_error());
    CHECK(vlmoe_model_init(&m, &cfg, 1) == VLMOE_OK, "init: %s", vlmoe_last_error());
    int fell_back = -1;
    CHECK(model_set_precision(m, "bf17", &fell_back) != VLMOE_OK && strstr(vlmoe_last_error(), "--precision 'bf17'"),
          "a bad --precision is refused with its value named: %s", vlmoe_last_error());
    CHECK(model_set_precision(m, "bf16", &fell_back) == VLMOE_OK, "bf16: %s", vlmoe_last_error());
    if (!gemm_bf16_native()) {
        CHECK(fell_back == 1 && m->be == backend_cpu_f32(), "without bf16 instructions the model stays fp32, and says so");
        printf("this CPU has no bf16 instructions: the bf16 products are not tested here\n");
        if (argc > 0) check_cli(argv[0]);
        vlmoe_model_free(m);
        return test_summary("test_bf16");
    }
    CHECK(fell_back == 0 && m->be == backend_cpu_bf16(), "bf16 on a CPU with bf16 instructions picks the cpu-bf16 table");
    vlmoe_model_free(m);
    const int shapes[][3] = {{1, 7, 5}, {3, 33, 17}, {37, 64, 1100}, {700, 48, 96}, {1030, 96, 40}, {600, 520, 24}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) check_linear(shapes[i][0], shapes[i][1], shapes[i][2]);
    const int rp[][3] = {{5, 1, 1}, {33, 15, 2}, {40, 16, 31}, {7, 17, 33}, {64, 48, 64}, {35, 70, 77}, {96, 130, 256}, {64, 256, 1024}};
    for (size_t i = 0; i < sizeof(rp) / sizeof(rp[0]); i++) check_repack(rp[i][0], rp[i][1], rp[i][2]);
    check_mlp_prerounded();
    check_aligned();
    const int pk[][3] = {{40, 24, 1}, {96, 200, 31}, {256, 1024, 77}, {1024, 256, 333}, {64, 64, 700}};
    for (size_t i = 0; i < sizeof(pk) / sizeof(pk[0]); i++) check_padded_k(pk[i][0], pk[i][1], pk[i][2]);
    const int ab[][3] = {{1, 64, 16}, {31, 200, 96}, {33, 64, 40}, {700, 1024, 96}, {1101, 200, 64}};
    for (size_t i = 0; i < sizeof(ab) / sizeof(ab[0]); i++) check_act_backward_packed(ab[i][0], ab[i][1], ab[i][2]);
    if (argc > 0) check_threads(argv[0]);
    check_model();
    if (argc > 0) check_cli(argv[0]);
    return test_summary("test_bf16");
}
