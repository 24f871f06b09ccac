// test_backend_bf16.h: the bf16 rows of tests/test_backend_ops.c (`--precision bf16 --device
// cuda`, src/cuda/bf16_cuda.cu): the cuda-bf16 table's linear and expert-bank products against
// the cpu-bf16 table's (src/ops/backend_cpu.c) on the same inputs, element by element.
//
// The bound. Both tables round every operand of a product to bf16 the same way (nearest even,
// once per product) and the product of two bf16 values is exact in fp32, so the two results are
// two fp32 summation orders of the same terms. Summing K terms onto an initial value in any
// order errs by at most about (K+1) u S (Higham, Accuracy and Stability of Numerical Algorithms,
// section 3.1), S the sum of the magnitudes of the terms and the initial value, u = 2^-24 with
// IEEE rounding; tensor cores truncate their fp32 sums (Fasi, Higham, Mikaitis, Pranesh, 2021),
// u = 2^-23 there. So |cuda - cpu| <= (K+2)(2^-23 + 2^-24) S; the check allows 8 (K+2) 2^-24 S,
// about twice that. Rounding any other way (not at all, truncating, ties away from even: every
// fifth input here is a tie) moves a term by up to 2^-8 of itself, far above; the negative
// control runs the fp32 tables through the same check and requires it to fail.
//
// The expert bank also rounds values it computes itself (a = act(h), and dh), which the two
// tables compute a few fp32 ulps apart; where one lies that close to the midpoint between two bf16
// neighbours the tables may round it apart, so the check adds one bf16 spacing of it times the
// other operand for such values (the allowance F), from the delta it may move by.
#include <fenv.h>

#include "nn/model.h"
#include "ops/gemm_bf16.h"

#define U24 (1.0 / 16777216.0)
#define ORDER 8.0                     // the bound: ORDER (K+2) 2^-24 S + F
#define ACT_SLOPE 1.2                 // |act'| < 1.13 over the GELU family
#define KERNEL_REL (1.0 / 1048576.0)  // 2^-20: two tables' fp32 kernels (exp, erf) a few ulps apart

typedef struct {
    const vlmoe_backend_f32 *be, *ref; // tested; the cpu-bf16 table
    vlmoe_rng r;
    int quiet;                         // the negative control: failures are expected, not printed
    int fail;
    double worst;                      // the largest |tested - ref| / bound
} bctx;

// n floats uniform in [-scale, scale]; every fifth is a tie of bf16 rounding (low half 0x8000),
// where nearest-even and nearest-away part
static float *frand(bctx *c, size_t n, double scale) {
    float *p = malloc(sizeof(float) * (n + 1));
    for (size_t i = 0; i < n; i++) {
        p[i] = (float)(scale * (2 * vlmoe_rng_uniform(&c->r) - 1));
        if (i % 5 == 2) {
            uint32_t u;
            memcpy(&u, p + i, 4);
            u = (u & 0xffff0000u) | 0x8000u;
            memcpy(p + i, &u, 4);
        }
    }
    return p;
}
static float *fdup(const float *v, size_t n) {
    float *p = malloc(sizeof(float) * (n + 1));
    memcpy(p, v, sizeof(float) * n);
    return p;
}
static double *dzeros(size_t n) { return calloc(n + 1, sizeof(double)); }

// v rounded by the library's rounding (bf16_pack), as floats
static float *rounded16(const float *v, size_t n) {
    uint16_t *h = malloc(sizeof(uint16_t) * (n + 1));
    float *r = malloc(sizeof(float) * (n + 1));
    if (n) bf16_pack(h, v, 1, (int)n, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        memcpy(r + i, &u, 4);
    }
    free(h);
    return r;
}
// the spacing of bf16 values at v (8 significant bits)
static double spacing16(double v) {
    int e;
    frexp(v, &e);
    return v == 0 ? 0 : ldexp(1.0, e - 8);
}

static float *to_be(const vlmoe_backend_f32 *be, const float *h, size_t n) {
    float *d = be->alloc(be, sizeof(float) * (n + 1), "test buffer");
    be->upload(be, d, h, n);
    return d;
}
static float *from_be(const vlmoe_backend_f32 *be, const float *d, size_t n) {
    float *h = malloc(sizeof(float) * (n + 1));
    be->sync(be);
    be->download(be, h, d, n);
    return h;
}

// One operand of a product: v stored (rows, cols) row-major, read transposed with t; delta (or
// NULL for an input both tables share) how far the tables' copies of v may be apart.
typedef struct {
    const float *v;
    int t;
    const double *delta;
} opnd;

// S (M,N) += sum_k |op(A)[m,k] op(B)[k,n]| over the rounded operands (A (M,K), B (K,N) after
// op); F (M,N) += the allowance of the computed operands that may round apart.
static void add_bounds(double *S, double *F, int M, int N, int K, opnd a, opnd b) {
    const size_t na = (size_t)M * K, nb = (size_t)K * N;
    float *ra = rounded16(a.v, na), *rb = rounded16(b.v, nb);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0, f = 0;
            for (int k = 0; k < K; k++) {
                const size_t ia = a.t ? (size_t)k * M + m : (size_t)m * K + k;
                const size_t ib = b.t ? (size_t)n * K + k : (size_t)k * N + n;
                const double x = fabs(ra[ia]), y = fabs(rb[ib]);
                s += x * y;
                // near the midpoint of its bf16 neighbours: the other table may round it apart
                if (a.delta && fabs(fabs((double)a.v[ia] - ra[ia]) - spacing16(a.v[ia]) / 2) <= a.delta[ia])
                    f += spacing16(a.v[ia]) * y;
                if (b.delta && fabs(fabs((double)b.v[ib] - rb[ib]) - spacing16(b.v[ib]) / 2) <= b.delta[ib])
                    f += x * spacing16(b.v[ib]);
            }
            S[(size_t)m * N + n] += s;
            if (F) F[(size_t)m * N + n] += f;
        }
    free(ra), free(rb);
}
// S (rows, cols) += |v| (v (rows, cols), or a row (cols) broadcast with bcast)
static void add_abs(double *S, const float *v, int rows, int cols, int bcast) {
    for (size_t i = 0; i < (size_t)rows * cols; i++) S[i] += fabs(v[bcast ? i % cols : i]);
}
// S (cols) += sum over rows of |v|; F (cols) += the sum of delta (the summands' own drift)
static void add_colsum(double *S, double *F, const float *v, const double *delta, int rows, int cols) {
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < cols; k++) {
            S[k] += fabs(v[(size_t)r * cols + k]);
            if (delta) F[k] += delta[(size_t)r * cols + k];
        }
}

// got (the tested table's output, on its side) against ref (the cpu-bf16 table's, host)
static void check16(bctx *c, const char *what, const float *got, const float *ref, const double *S,
                    const double *F, int K, size_t n) {
    float *h = from_be(c->be, got, n);
    int reported = 0; // the first element out of bound of each output
    for (size_t i = 0; i < n; i++) {
        const double bound = ORDER * (K + 2) * U24 * S[i] + (F ? F[i] : 0), d = fabs((double)h[i] - ref[i]);
        const double ratio = bound > 0 ? d / bound : d > 0 ? INFINITY : 0;
        if (!(ratio <= 1)) {
            if (!c->quiet && !reported++)
                fprintf(stderr, "    %s[%zu]: %.9g vs cpu-bf16 %.9g: |diff| %.3g > bound %.3g\n", what, i, h[i], ref[i],
                        d, bound);
            c->fail = 1;
        }
        if (ratio > c->worst) c->worst = ratio;
    }
    free(h);
}

static void case16_linear(bctx *c, int N, int K, int O) {
    const vlmoe_backend_f32 *be = c->be, *rf = c->ref;
    const size_t nx = (size_t)N * K, nw = (size_t)O * K, no = (size_t)N * O;
    float *x = frand(c, nx, 1), *w = frand(c, nw, 0.5), *b = frand(c, O, 0.5), *out = frand(c, no, 1);
    float *dout = frand(c, no, 1), *dinp = frand(c, nx, 1), *dw = frand(c, nw, 1), *db = frand(c, O, 1);
    float *tx = to_be(be, x, nx), *tw = to_be(be, w, nw), *tb = to_be(be, b, O), *to = to_be(be, out, no);
    float *tdo = to_be(be, dout, no), *tdi = to_be(be, dinp, nx), *tdw = to_be(be, dw, nw), *tdb = to_be(be, db, O);
    // the bounds, from the outputs' initial values (the ops accumulate into them)
    double *So = dzeros(no), *Sdi = dzeros(nx), *Sdw = dzeros(nw), *Sdb = dzeros(O);
    add_abs(So, out, N, O, 0), add_abs(So, b, N, O, 1);
    add_bounds(So, NULL, N, O, K, (opnd){x, 0, NULL}, (opnd){w, 1, NULL});           // out += x.w^T + b
    add_abs(Sdi, dinp, N, K, 0);
    add_bounds(Sdi, NULL, N, K, O, (opnd){dout, 0, NULL}, (opnd){w, 0, NULL});       // dinp += dout.w
    add_abs(Sdw, dw, O, K, 0);
    add_bounds(Sdw, NULL, O, K, N, (opnd){dout, 1, NULL}, (opnd){x, 0, NULL});       // dw += dout^T.x
    add_abs(Sdb, db, 1, O, 0);
    add_colsum(Sdb, NULL, dout, NULL, N, O);
    rf->linear_forward(rf, out, x, w, b, N, K, O, 1);
    rf->linear_backward(rf, dinp, dw, db, dout, x, w, N, K, O);
    be->linear_forward(be, to, tx, tw, tb, N, K, O, 1);
    be->linear_backward(be, tdi, tdw, tdb, tdo, tx, tw, N, K, O);
    check16(c, "out", to, out, So, NULL, K, no);
    check16(c, "dinp", tdi, dinp, Sdi, NULL, O, nx);
    check16(c, "dw", tdw, dw, Sdw, NULL, N, nw);
    check16(c, "db", tdb, db, Sdb, NULL, N, O);
    float *dev[] = {tx, tw, tb, to, tdo, tdi, tdw, tdb};
    for (int i = 0; i < 8; i++) be->free(be, dev[i]);
    // the write mode: dinp full of NaN on both sides (an accumulate left in reads it), dw and
    // db from zero, so the bounds are the products' and the sums' alone
    if (be->linear_backward_write && rf->linear_backward_write) {
        for (size_t i = 0; i < nx; i++) dinp[i] = NAN;
        memset(dw, 0, sizeof(float) * nw), memset(db, 0, sizeof(float) * O);
        tdi = to_be(be, dinp, nx), tdw = to_be(be, dw, nw), tdb = to_be(be, db, O), tdo = to_be(be, dout, no);
        tx = to_be(be, x, nx), tw = to_be(be, w, nw);
        memset(Sdi, 0, sizeof(double) * nx), memset(Sdw, 0, sizeof(double) * nw), memset(Sdb, 0, sizeof(double) * O);
        add_bounds(Sdi, NULL, N, K, O, (opnd){dout, 0, NULL}, (opnd){w, 0, NULL});
        add_bounds(Sdw, NULL, O, K, N, (opnd){dout, 1, NULL}, (opnd){x, 0, NULL});
        add_colsum(Sdb, NULL, dout, NULL, N, O);
        rf->linear_backward_write(rf, dinp, dw, db, dout, x, w, N, K, O);
        be->linear_backward_write(be, tdi, tdw, tdb, tdo, tx, tw, N, K, O);
        check16(c, "dinp (write)", tdi, dinp, Sdi, NULL, O, nx);
        check16(c, "dw (write)", tdw, dw, Sdw, NULL, N, nw);
        check16(c, "db (write)", tdb, db, Sdb, NULL, N, O);
        float *dev2[] = {tx, tw, tdo, tdi, tdw, tdb};
        for (int i = 0; i < 6; i++) be->free(be, dev2[i]);
    }
    free(x), free(w), free(b), free(out), free(dout), free(dinp), free(dw), free(db);
    free(So), free(Sdi), free(Sdw), free(Sdb);
}

// how far a computed value may move between the tables: its inputs' bound through the
// activation's slope, and the kernels' own last places
static double *drift(const double *S_in, int K, const float *v, size_t n) {
    double *d = dzeros(n);
    for (size_t i = 0; i < n; i++) d[i] = ACT_SLOPE * ORDER * (K + 2) * U24 * S_in[i] + KERNEL_REL * fabs(v[i]);
    return d;
}

// same_rows: every expert 10 rows (the fixed-capacity layout: one strided-batched product on CUDA)
static void case16_experts(bctx *c, int same_rows) {
    const vlmoe_backend_f32 *be = c->be, *rf = c->ref;
    enum { E = 3, D = 24, M = 40, R = 30 };
    const int32_t off_packed[E + 1] = {0, 9, 9, R}, off_same[E + 1] = {0, 10, 20, R}; // packed: expert 1 holds no rows
    const int32_t *off = same_rows ? off_same : off_packed;
    const be_experts ex = {E, D, M, VLMOE_ACT_QUICK_GELU, off};
    const size_t nw[4] = {(size_t)E * M * D, (size_t)E * M, (size_t)E * D * M, (size_t)E * D};
    const size_t nrd = (size_t)R * D, nrm = (size_t)R * M;
    float *w[4], *tw[4], *dw[4], *tdw[4], *x = frand(c, nrd, 1), *y = frand(c, nrd, 1), *dy = frand(c, nrd, 1);
    float *dx = frand(c, nrd, 1), *h = calloc(nrm + 1, 4), *a = calloc(nrm + 1, 4), *da = calloc(nrm + 1, 4);
    float *dh = calloc(nrm + 1, 4);
    for (int i = 0; i < 4; i++) w[i] = frand(c, nw[i], 0.4), dw[i] = frand(c, nw[i], 1);
    for (int i = 0; i < 4; i++) tw[i] = to_be(be, w[i], nw[i]), tdw[i] = to_be(be, dw[i], nw[i]);
    float *tx = to_be(be, x, nrd), *ty = to_be(be, y, nrd), *th = to_be(be, h, nrm), *ta = to_be(be, a, nrm);
    float *tdy = to_be(be, dy, nrd), *tdx = to_be(be, dx, nrd), *tda = to_be(be, da, nrm), *tdh = to_be(be, dh, nrm);
    const float *const cw[4] = {w[0], w[1], w[2], w[3]}, *const ctw[4] = {tw[0], tw[1], tw[2], tw[3]};
    float *y0 = fdup(y, nrd), *dx0 = fdup(dx, nrd), *dw0[4];
    for (int i = 0; i < 4; i++) dw0[i] = fdup(dw[i], nw[i]);

    // forward: h = x.w1^T + b1 (shared inputs), then y += act(h).w2^T + b2 (a computed operand)
    rf->experts_forward(rf, y, h, a, x, cw, &ex, 1);
    be->experts_forward(be, ty, th, ta, tx, ctw, &ex, 1);
    // a is the bank's scratch (backend.h; the cpu-bf16 bank only rounds act(h)): act(h) for the
    // bounds below, from the reference's h
    act_forward_f32(a, h, nrm, ex.act);
    double *Sh = dzeros(nrm), *Sy = dzeros(nrd), *Fy = dzeros(nrd);
    for (int e = 0; e < E; e++) {
        const int o = off[e], k = off[e + 1] - off[e];
        if (k <= 0) continue;
        add_abs(Sh + (size_t)o * M, w[1] + (size_t)e * M, k, M, 1);
        add_bounds(Sh + (size_t)o * M, NULL, k, M, D, (opnd){x + (size_t)o * D, 0, NULL},
                   (opnd){w[0] + (size_t)e * M * D, 1, NULL});
    }
    double *da_ = drift(Sh, D, a, nrm);
    add_abs(Sy, y0, R, D, 0);
    for (int e = 0; e < E; e++) {
        const int o = off[e], k = off[e + 1] - off[e];
        if (k <= 0) continue;
        add_abs(Sy + (size_t)o * D, w[3] + (size_t)e * D, k, D, 1);
        add_bounds(Sy + (size_t)o * D, Fy + (size_t)o * D, k, D, M, (opnd){a + (size_t)o * M, 0, da_ + (size_t)o * M},
                   (opnd){w[2] + (size_t)e * D * M, 1, NULL});
    }
    check16(c, "h", th, h, Sh, NULL, D, nrm);
    check16(c, "y", ty, y, Sy, Fy, M, nrd);

    // backward from the same h (the reference's), so the differences are the backward's own:
    // da = dy.w2 (shared inputs); dw2 += dy^T.act(h); dh = act'(h) da; dx += dh.w1; dw1 += dh^T.x
    be->upload(be, th, h, nrm);
    float *const rdw[4] = {dw[0], dw[1], dw[2], dw[3]}, *const rtdw[4] = {tdw[0], tdw[1], tdw[2], tdw[3]};
    rf->experts_backward(rf, dx, rdw, dy, x, h, cw, da, dh, &ex);
    be->experts_backward(be, tdx, rtdw, tdy, tx, th, ctw, tda, tdh, &ex);
    double *Sda = dzeros(nrm), *Sdx = dzeros(nrd), *Fdx = dzeros(nrd), *S[4], *F[4];
    for (int i = 0; i < 4; i++) S[i] = dzeros(nw[i]), F[i] = dzeros(nw[i]), add_abs(S[i], dw0[i], 1, (int)nw[i], 0);
    add_abs(Sdx, dx0, R, D, 0);
    double *dact = dzeros(nrm); // act(h) again, from the same h: only the kernels' last places
    for (size_t i = 0; i < nrm; i++) dact[i] = KERNEL_REL * fabs(a[i]);
    for (int e = 0; e < E; e++) {
        const int o = off[e], k = off[e + 1] - off[e];
        if (k > 0)
            add_bounds(Sda + (size_t)o * M, NULL, k, M, D, (opnd){dy + (size_t)o * D, 0, NULL},
                       (opnd){w[2] + (size_t)e * D * M, 0, NULL});
    }
    double *ddh = drift(Sda, D, dh, nrm);
    for (int e = 0; e < E; e++) {
        const int o = off[e], k = off[e + 1] - off[e];
        if (k <= 0) continue;
        const float *dye = dy + (size_t)o * D, *dhe = dh + (size_t)o * M, *xe = x + (size_t)o * D;
        add_bounds(S[2] + (size_t)e * D * M, F[2] + (size_t)e * D * M, D, M, k, (opnd){dye, 1, NULL},
                   (opnd){a + (size_t)o * M, 0, dact + (size_t)o * M});
        add_colsum(S[3] + (size_t)e * D, NULL, dye, NULL, k, D);
        add_bounds(Sdx + (size_t)o * D, Fdx + (size_t)o * D, k, D, M, (opnd){dhe, 0, ddh + (size_t)o * M},
                   (opnd){w[0] + (size_t)e * M * D, 0, NULL});
        add_bounds(S[0] + (size_t)e * M * D, F[0] + (size_t)e * M * D, M, D, k, (opnd){dhe, 1, ddh + (size_t)o * M},
                   (opnd){xe, 0, NULL});
        // db1 sums dh unrounded: its drift counts as it is
        add_colsum(S[1] + (size_t)e * M, F[1] + (size_t)e * M, dhe, ddh + (size_t)o * M, k, M);
    }
    // da and dh are the bank's scratch (backend.h): the CPU tables fuse act' into the da product and
    // leave act(h) in da, so neither is compared; dx and the weight gradients are the bank's results
    check16(c, "dx", tdx, dx, Sdx, Fdx, M, nrd);
    const char *names[4] = {"dw1", "db1", "dw2", "db2"};
    for (int i = 0; i < 4; i++) check16(c, names[i], tdw[i], dw[i], S[i], F[i], R, nw[i]);
    // the write mode: dx full of NaN on both sides (an accumulate left in reads it), its bound
    // the products' alone (the gradients accumulate again on both sides and are not compared)
    if (be->experts_backward_write && rf->experts_backward_write) {
        for (size_t i = 0; i < nrd; i++) dx[i] = NAN;
        be->upload(be, tdx, dx, nrd);
        rf->experts_backward_write(rf, dx, rdw, dy, x, h, cw, da, dh, &ex);
        be->experts_backward_write(be, tdx, rtdw, tdy, tx, th, ctw, tda, tdh, &ex);
        double *Sw = dzeros(nrd), *Fw = dzeros(nrd);
        for (int e = 0; e < E; e++) {
            const int o = off[e], k = off[e + 1] - off[e];
            if (k > 0)
                add_bounds(Sw + (size_t)o * D, Fw + (size_t)o * D, k, D, M,
                           (opnd){dh + (size_t)o * M, 0, ddh + (size_t)o * M}, (opnd){w[0] + (size_t)e * M * D, 0, NULL});
        }
        check16(c, "dx (write)", tdx, dx, Sw, Fw, M, nrd);
        free(Sw), free(Fw);
    }

    for (int i = 0; i < 4; i++) {
        be->free(be, tw[i]), be->free(be, tdw[i]);
        free(w[i]), free(dw[i]), free(dw0[i]), free(S[i]), free(F[i]);
    }
    float *dev[] = {tx, ty, th, ta, tdy, tdx, tda, tdh};
    for (int i = 0; i < 8; i++) be->free(be, dev[i]);
    free(x), free(y), free(dy), free(dx), free(h), free(a), free(da), free(dh), free(y0), free(dx0);
    free(Sh), free(Sy), free(Fy), free(da_), free(Sda), free(Sdx), free(Fdx), free(dact), free(ddh);
}

static void case16_all(bctx *c) {
    case16_linear(c, 37, 29, 23);   // no multiple of any tile
    case16_linear(c, 300, 256, 96); // tensor-core shapes; 300 rows: chunked bias sums on CUDA
    case16_experts(c, 0);
    case16_experts(c, 1);
}

// ---- the positive control: an emulated second table, so the bound is tried on this machine too.
// Its products round operands with the library's rounding, sum in the reverse order with every
// fp32 addition truncated (as tensor cores do), and its activations come out 3 ulps off the
// CPU's: each difference the bound and its allowances must absorb on a GPU.
static float *emu_round(const float *v, size_t n) { return rounded16(v, n); }
// C (M,N) += sum_k op(A)[m,k] op(B)[k,n], the sum truncated, in reverse k order
static void emu_gemm(int ta, int tb, int M, int N, int K, const float *A, const float *B, float *C) {
    float *ra = emu_round(A, (size_t)M * K), *rb = emu_round(B, (size_t)K * N);
    fesetround(FE_TOWARDZERO);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            volatile float acc = 0; // volatile: each addition at run time, in the mode set
            for (int k = K - 1; k >= 0; k--)
                acc = acc + ra[ta ? (size_t)k * M + m : (size_t)m * K + k] * rb[tb ? (size_t)n * K + k : (size_t)k * N + n];
            C[(size_t)m * N + n] = C[(size_t)m * N + n] + acc;
        }
    fesetround(FE_TONEAREST);
    free(ra), free(rb);
}
static void emu_linear_forward(const vlmoe_backend_f32 *be, float *out, const float *inp, const float *w,
                               const float *b, int N, int K, int O, int beta) {
    for (size_t i = 0; i < (size_t)N * O; i++) out[i] = (beta ? out[i] : 0) + (b ? b[i % O] : 0);
    emu_gemm(0, 1, N, O, K, inp, w, out);
}
static void emu_linear_backward(const vlmoe_backend_f32 *be, float *dinp, float *dw, float *db, const float *dout,
                                const float *inp, const float *w, int N, int K, int O) {
    if (dinp) emu_gemm(0, 0, N, K, O, dout, w, dinp);
    emu_gemm(1, 0, O, K, N, dout, inp, dw);
    for (int o = 0; o < O && db; o++)
        for (int n = N - 1; n >= 0; n--) db[o] += dout[(size_t)n * O + o];
}
static void emu_linear_backward_write(const vlmoe_backend_f32 *be, float *dinp, float *dw, float *db,
                                      const float *dout, const float *inp, const float *w, int N, int K, int O) {
    memset(dinp, 0, sizeof(float) * N * K);
    emu_linear_backward(be, dinp, dw, db, dout, inp, w, N, K, O);
}
static void emu_act(float *v, size_t n) {
    for (size_t i = 0; i < n; i++) v[i] *= 1 + 3 * U24 * 2; // 3 ulps (one ulp: 2^-23 of [1,2))
}
static void emu_experts_forward(const vlmoe_backend_f32 *be, float *y, float *h, float *a, const float *x,
                                const float *const w[4], const be_experts *ex, int beta) {
    const int D = ex->D, M = ex->M;
    for (int e = 0; e < ex->E; e++) {
        const size_t o = (size_t)ex->off[e];
        const int k = ex->off[e + 1] - ex->off[e];
        if (k <= 0) continue;
        emu_linear_forward(be, h + o * M, x + o * D, w[0] + (size_t)e * M * D, w[1] + (size_t)e * M, k, D, M, 0);
        act_forward_f32(a + o * M, h + o * M, (size_t)k * M, ex->act);
        emu_act(a + o * M, (size_t)k * M);
        emu_linear_forward(be, y + o * D, a + o * M, w[2] + (size_t)e * D * M, w[3] + (size_t)e * D, k, M, D, beta);
    }
}
static void emu_experts_backward(const vlmoe_backend_f32 *be, float *dx, float *const dw[4], const float *dy,
                                 const float *x, const float *h, const float *const w[4], float *da, float *dh,
                                 const be_experts *ex) {
    const int D = ex->D, M = ex->M;
    for (int e = 0; e < ex->E; e++) {
        const size_t o = (size_t)ex->off[e], km = (size_t)(ex->off[e + 1] - ex->off[e]) * M;
        const int k = ex->off[e + 1] - ex->off[e];
        if (k <= 0) continue;
        act_forward_f32(dh + o * M, h + o * M, km, ex->act);
        emu_act(dh + o * M, km);
        memset(da + o * M, 0, sizeof(float) * km);
        emu_linear_backward(be, da + o * M, dw[2] + (size_t)e * D * M, dw[3] + (size_t)e * D, dy + o * D, dh + o * M,
                            w[2] + (size_t)e * D * M, k, M, D);
        memset(dh + o * M, 0, sizeof(float) * km);
        act_backward_f32(dh + o * M, h + o * M, da + o * M, km, ex->act);
        emu_act(dh + o * M, km);
        emu_linear_backward(be, dx + o * D, dw[0] + (size_t)e * M * D, dw[1] + (size_t)e * M, dh + o * M, x + o * D,
                            w[0] + (size_t)e * M * D, k, D, M);
    }
}
static void emu_experts_backward_write(const vlmoe_backend_f32 *be, float *dx, float *const dw[4], const float *dy,
                                       const float *x, const float *h, const float *const w[4], float *da, float *dh,
                                       const be_experts *ex) {
    memset(dx + (size_t)ex->off[0] * ex->D, 0, sizeof(float) * (size_t)(ex->off[ex->E] - ex->off[0]) * ex->D);
    emu_experts_backward(be, dx, dw, dy, x, h, w, da, dh, ex);
}
static const vlmoe_backend_f32 *emulated_table(void) {
    static vlmoe_backend_f32 t;
    t = *backend_cpu_bf16();
    t.name = "emulated";
    t.linear_forward = emu_linear_forward, t.linear_backward = emu_linear_backward;
    t.linear_backward_write = emu_linear_backward_write;
    t.experts_forward = emu_experts_forward, t.experts_backward = emu_experts_backward;
    t.experts_backward_write = emu_experts_backward_write;
    return &t;
}

// One row: be against cpu-bf16. want_fail: the negative control (an fp32 table must be caught).
static void row16(const char *name, const vlmoe_backend_f32 *be, int want_fail, int *pass, int *fail) {
    bctx c = {.be = be, .ref = backend_cpu_bf16(), .quiet = want_fail};
    vlmoe_rng_seed(&c.r, 4242);
    case16_all(&c);
    const int ok = want_fail ? c.fail : !c.fail;
    printf("  %-13s %-9s %s (worst |diff| %.3g of the bound)%s\n", name, be->name, ok ? "OK" : "FAIL", c.worst,
           want_fail ? ok ? ": fp32 products caught" : ": fp32 products passed the bf16 bound" : "");
    if (ok) ++*pass; else ++*fail;
}

// --precision on a CUDA device (src/nn/device.c): bf16 takes the model to the twin, fp32 back to
// the table it opened, which it keeps owning throughout (freeing the model frees both).
static void check_model_twin(void) {
    vlmoe_model *m = NULL;
    vlmoe_model_config cfg;
    int fb = -1;
    if (vlmoe_config_named("limoe-tiny", &cfg) || vlmoe_model_init(&m, &cfg, 1) || model_set_device(m, "cuda")) {
        CHECK(0, "limoe-tiny on cuda: %s", vlmoe_last_error());
        vlmoe_model_free(m);
        return;
    }
    const vlmoe_backend_f32 *cuda = m->be, *twin = NULL;
    CHECK(model_set_precision(m, "bf16", &fb) == VLMOE_OK && fb == 0 && !strcmp(m->be->name, "cuda-bf16") &&
              m->be->fp32 == cuda && m->owned_be == cuda && m->d_params, "--precision bf16 on cuda: %s",
          vlmoe_last_error());
    twin = m->be;
    CHECK(model_set_precision(m, "fp32", &fb) == VLMOE_OK && m->be == cuda && m->owned_be == cuda && m->d_params,
          "--precision fp32 back on cuda: %s", vlmoe_last_error());
    CHECK(model_set_precision(m, "bf16", &fb) == VLMOE_OK && m->be == twin, "the same twin again: %s",
          vlmoe_last_error());
    vlmoe_model_free(m);
}

// The bf16 rows: the negative control on the CPU's fp32 table (and the CUDA fp32 table when there
// is one), the positive control on the emulated table, the cuda-bf16 table's products, and the twin's wiring. cuda: NULL without a device
// (why_not says why).
static void bf16_rows(vlmoe_backend_f32 *cuda, const char *why_not, int *pass, int *fail, int *skip) {
    printf("bf16 products against the cpu-bf16 table (|diff| <= %g (K+2) 2^-24 S + F):\n", ORDER);
    const vlmoe_backend_f32 *t = NULL;
    CHECK(backend_cuda_bf16(&t, backend_cpu_f32()) != VLMOE_OK && strstr(vlmoe_last_error(), "cpu") && !t,
          "the bf16 twin of the cpu table: %s", vlmoe_last_error());
    if (!gemm_bf16_native()) {
        printf("  bf16 rows skipped: this CPU has no bf16 instructions, so the cpu-bf16 reference may "
               "compute in fp32\n");
        *skip += 4; // the two controls and the two cuda rows
        return;
    }
    row16("bf16-control", backend_cpu_f32(), 1, pass, fail);
    row16("bf16-control", emulated_table(), 0, pass, fail);
    if (!cuda) {
        printf("  cuda-bf16 rows skipped: %s\n", why_not);
        *skip += 2;
        return;
    }
    row16("bf16-control", cuda, 1, pass, fail);
    const vlmoe_backend_f32 *t2 = NULL;
    if (backend_cuda_bf16(&t, cuda) != VLMOE_OK || backend_cuda_bf16(&t2, t) != VLMOE_OK) {
        printf("  cuda-bf16 FAIL: %s\n", vlmoe_last_error());
        ++*fail;
        return;
    }
    // the twin: its own products, the fp32 table's everything else, the router on that table
    CHECK(t == t2 && t != cuda && !strcmp(t->name, "cuda-bf16") && t->fp32 == cuda && !t->host_memory &&
              t->ctx == cuda->ctx, "the cuda-bf16 twin's wiring");
    CHECK(t->linear_forward != cuda->linear_forward && t->experts_backward != cuda->experts_backward &&
              t->layernorm_forward == cuda->layernorm_forward && t->soft_moe_forward == cuda->soft_moe_forward &&
              t->adamw == cuda->adamw && t->alloc == cuda->alloc, "the cuda-bf16 twin's entries");
    CHECK(t->supports(t, BE_OP_LINEAR, NULL) && t->supports(t, BE_OP_EXPERTS, NULL), "cuda-bf16 supports");
    row16("bf16", t, 0, pass, fail);
    check_model_twin();
}
