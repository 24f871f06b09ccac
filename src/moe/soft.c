// soft.c: Soft MoE forward/backward over one routing group (Puigcerver et al. 2023, sec. 2
// eqs. 1-2 with the normalisation of sec. 2.3 / appendix E; spec/MOE.md "Soft MoE"). Compiled
// as float and double (src/core/real.h). Covered by tests/test_soft_moe.c (hand-worked golden,
// finite differences in double, PyTorch parity from tests/ref/gen_soft_moe.py).
//
// Every matrix product goes through the ops.h kernels so the thread split, and hence every
// result, is independent of the thread count. Those kernels offer A.B^T (linear_forward) and
// A^T.B (the dw of linear_backward) but no plain A.B, so the dispatch and combine weights are
// kept in both layouts: (S,N) and its transpose (N,S). Transposes are S*N, the products S*N*D.
#include <math.h>
#include <omp.h>
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "moe/soft.h"
#include "ops/ops.h"
#include "vlmoe.h"

// The normalisation epsilon of MOE.md: x / sqrt(|x|^2 + 1e-6), inside the square root as in
// the reference implementation (vmoe soft_router `normalize`), so a zero token maps to zero.
#define SOFT_EPS 1e-6

// Offsets (in elements) of the saved activations inside `acts`.
typedef struct {
    size_t xh;   // (S,D) normalised tokens
    size_t nx;   // (S)   sqrt(|x_s|^2 + eps)
    size_t phih; // (N,D) normalised slot vectors, one row per slot (phi's columns, transposed)
    size_t nphi; // (N)   sqrt(|phi_n|^2 + eps)
    size_t sim;  // (S,N) <xh_s, phih_n>, before the scale: dscale needs it even when scale = 0
    size_t dw;   // (S,N) dispatch weights (each column sums to 1)
    size_t dwt;  // (N,S) the same, transposed (each row sums to 1)
    size_t cw;   // (S,N) combine weights (each row sums to 1)
    size_t cwt;  // (N,S) the same, transposed
    size_t xs;   // (N,D) slot inputs
    size_t hpre; // (N,M) expert hidden before the activation
    size_t hact; // (N,M) after it
    size_t ys;   // (N,D) slot outputs
    size_t total;
} acts_layout;

// Offsets of backward's scratch.
typedef struct {
    size_t dcw, dlg;   // (S,N) grad of the combine weights; grad of the logits (both softmaxes)
    size_t ddwt, dlgt; // (N,S) grad of the dispatch weights and of their logits, transposed
    size_t dys, dxs;   // (N,D) grad of the slot outputs and inputs
    size_t da, dh;     // (N,M) grad of the expert hidden after / before the activation
    size_t dxh;        // (S,D) grad of xh
    size_t dphih;      // (N,D) grad of phih
    size_t total;
} scratch_layout;

static acts_layout acts_layout_of(const soft_dims *d) {
    const size_t S = (size_t)d->S, D = (size_t)d->D, N = (size_t)d->E * d->P, M = (size_t)d->M;
    acts_layout L;
    size_t o = 0;
    L.xh = o, o += S * D;
    L.nx = o, o += S;
    L.phih = o, o += N * D;
    L.nphi = o, o += N;
    L.sim = o, o += S * N;
    L.dw = o, o += S * N;
    L.dwt = o, o += N * S;
    L.cw = o, o += S * N;
    L.cwt = o, o += N * S;
    L.xs = o, o += N * D;
    L.hpre = o, o += N * M;
    L.hact = o, o += N * M;
    L.ys = o, o += N * D;
    L.total = o;
    return L;
}

static scratch_layout scratch_layout_of(const soft_dims *d) {
    const size_t S = (size_t)d->S, D = (size_t)d->D, N = (size_t)d->E * d->P, M = (size_t)d->M;
    scratch_layout L;
    size_t o = 0;
    L.dcw = o, o += S * N;
    L.dlg = o, o += S * N;
    L.ddwt = o, o += N * S;
    L.dlgt = o, o += N * S;
    L.dys = o, o += N * D;
    L.dxs = o, o += N * D;
    L.da = o, o += N * M;
    L.dh = o, o += N * M;
    L.dxh = o, o += S * D;
    L.dphih = o, o += N * D;
    L.total = o;
    return L;
}

// The sizes do not depend on the scalar type: defined in the float pass only, so the two
// objects of this file do not both export them.
#ifndef VLMOE_REAL_F64
size_t soft_moe_acts_floats(const soft_dims *d) { return acts_layout_of(d).total; }
size_t soft_moe_weights_at(const soft_dims *d) { return acts_layout_of(d).dwt; }
size_t soft_moe_scratch_floats(const soft_dims *d) { return scratch_layout_of(d).total; }
#endif

#ifndef VLMOE_REAL_F64
int soft_dims_check(const soft_dims *d) {
    if (d->P < 1)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "Soft MoE: %d slots per expert for a group of %d tokens and %d experts: "
                          "need at least one (slots_per_expert >= 1, or a group_size of at least num_experts / 2 "
                          "so that rint(group_size / num_experts) >= 1)", d->P, d->S, d->E);
    if (d->mix < VLMOE_SOFT_MIX_SOFT || d->mix > VLMOE_SOFT_MIX_SOFT_UNIFORM)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "Soft MoE: unknown soft_dispatch %d", d->mix);
    if (d->mix == VLMOE_SOFT_MIX_IDENTITY && (long)d->E * d->P != d->S)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "Soft MoE soft_dispatch \"identity\" sends token i to slot i (App. A): "
                          "it needs as many slots (num_experts %d x slots_per_expert %d = %ld) as tokens per group "
                          "(%d)", d->E, d->P, (long)d->E * d->P, d->S);
    return VLMOE_OK;
}
#endif

// App. A: which of the two weight matrices are fixed rather than softmaxes
static int dispatch_fixed(int mix) {
    return mix == VLMOE_SOFT_MIX_IDENTITY || mix == VLMOE_SOFT_MIX_UNIFORM || mix == VLMOE_SOFT_MIX_UNIFORM_SOFT;
}
static int combine_fixed(int mix) {
    return mix == VLMOE_SOFT_MIX_IDENTITY || mix == VLMOE_SOFT_MIX_UNIFORM || mix == VLMOE_SOFT_MIX_SOFT_UNIFORM;
}
// m (R,C) = identity (R = C) or the uniform 1/C in every entry (each row sums to 1)
static void fixed_weights(real *m, int R, int C, int identity) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) m[(size_t)r * C + c] = identity ? (real)(r == c) : (real)1 / C;
}

// dst (C,R) = src (R,C)^T; each thread owns rows of dst.
static void transpose(real *dst, const real *src, int R, int C) {
#pragma omp parallel for schedule(static)
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) dst[(size_t)c * R + r] = src[(size_t)r * C + c];
}

// Experts run one after another, each product parallel inside, unless there are at least as
// many experts as threads: then each thread takes whole experts (the kernels inside see a
// nested team of one). Both give the same bits, since the ops.h kernels split work by shape.
static int experts_in_parallel(int E) { return E >= omp_get_max_threads(); }

void R(soft_moe_forward)(real *out, real *acts, const real *x, const R(soft_params) *p,
                         const soft_dims *d) {
    R(soft_moe_forward_with)(out, acts, x, p, d, NULL, NULL);
}

void R(soft_moe_forward_with)(real *out, real *acts, const real *x, const R(soft_params) *p,
                              const soft_dims *d, R(soft_experts_fn) experts, void *ctx) {
    const int S = d->S, D = d->D, E = d->E, P = d->P, M = d->M, N = E * P;
    const acts_layout L = acts_layout_of(d);
    real *xh = acts + L.xh, *nx = acts + L.nx, *phih = acts + L.phih, *nphi = acts + L.nphi;
    real *sim = acts + L.sim, *dw = acts + L.dw, *dwt = acts + L.dwt, *cw = acts + L.cw;
    real *cwt = acts + L.cwt, *xs = acts + L.xs, *hpre = acts + L.hpre, *hact = acts + L.hact;
    real *ys = acts + L.ys;
    const real sc = *p->scale;

#pragma omp parallel for schedule(static)
    for (int s = 0; s < S; s++) {
        const real *xr = x + (size_t)s * D;
        real ss = 0;
        for (int i = 0; i < D; i++) ss += xr[i] * xr[i];
        const real n = d->raw ? 1 : RSQRT(ss + (real)SOFT_EPS);
        nx[s] = n;
        for (int i = 0; i < D; i++) xh[(size_t)s * D + i] = xr[i] / n;
    }
    // phi (D,N) row-major: slot n's vector is column n; phih keeps it as row n so that the
    // similarities are one A.B^T product
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        real ss = 0;
        for (int i = 0; i < D; i++) ss += p->phi[(size_t)i * N + n] * p->phi[(size_t)i * N + n];
        const real nn = d->raw ? 1 : RSQRT(ss + (real)SOFT_EPS);
        nphi[n] = nn;
        for (int i = 0; i < D; i++) phih[(size_t)n * D + i] = p->phi[(size_t)i * N + n] / nn;
    }
    R(linear_forward)(sim, xh, phih, NULL, S, D, N, 0);

    // The scaled logits are staged in the buffers of dw (as (S,N)) and cwt (as (N,S)), which the
    // transposes below overwrite once the row softmaxes have read them.
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < (size_t)S * N; i++) dw[i] = sc * sim[i];
    transpose(cwt, dw, S, N);
    R(softmax_forward)(cw, dw, S, N);   // combine: per token, over all N slots
    R(softmax_forward)(dwt, cwt, N, S); // dispatch: per slot, over the S tokens
    // App. A's fixed baselines: Dw^T (N,S) rows (slots) and Cw (S,N) rows (tokens) sum to 1
    if (dispatch_fixed(d->mix)) fixed_weights(dwt, N, S, d->mix == VLMOE_SOFT_MIX_IDENTITY);
    if (combine_fixed(d->mix)) fixed_weights(cw, S, N, d->mix == VLMOE_SOFT_MIX_IDENTITY);
    transpose(dw, dwt, N, S);
    transpose(cwt, cw, S, N);

    // Xs (N,D) = Dw^T x: the dw product of linear_backward (it accumulates: zero first)
    memset(xs, 0, sizeof(real) * (size_t)N * D);
    R(linear_backward)(NULL, xs, NULL, dw, x, NULL, S, D, N);

    if (!experts || experts(ctx, ys, xs, p, d)) {
#pragma omp parallel for schedule(static) if (experts_in_parallel(E))
        for (int e = 0; e < E; e++) {
            const size_t r0 = (size_t)e * P;
            R(linear_forward)(hpre + r0 * M, xs + r0 * D, p->w1 + (size_t)e * M * D,
                              p->b1 + (size_t)e * M, P, D, M, 0);
            R(act_forward)(hact + r0 * M, hpre + r0 * M, (size_t)P * M, d->act);
            R(linear_forward)(ys + r0 * D, hact + r0 * M, p->w2 + (size_t)e * D * M,
                              p->b2 + (size_t)e * D, P, M, D, 0);
        }
    }

    // out (S,D) = Cw Ys = (Cw^T)^T Ys, again the dw product of linear_backward
    memset(out, 0, sizeof(real) * (size_t)S * D);
    R(linear_backward)(NULL, out, NULL, cwt, ys, NULL, N, D, S);
}

void R(soft_moe_backward)(real *dx, const R(soft_grads) *g, const real *dout, const real *acts,
                          const real *x, const R(soft_params) *p, const soft_dims *d,
                          real *scratch) {
    const int S = d->S, D = d->D, E = d->E, P = d->P, M = d->M, N = E * P;
    const acts_layout L = acts_layout_of(d);
    const scratch_layout W = scratch_layout_of(d);
    const real *xh = acts + L.xh, *nx = acts + L.nx, *phih = acts + L.phih, *nphi = acts + L.nphi;
    const real *sim = acts + L.sim, *dwt = acts + L.dwt, *cw = acts + L.cw, *xs = acts + L.xs;
    const real *hpre = acts + L.hpre, *hact = acts + L.hact, *ys = acts + L.ys;
    real *dcw = scratch + W.dcw, *dlg = scratch + W.dlg, *ddwt = scratch + W.ddwt;
    real *dlgt = scratch + W.dlgt, *dys = scratch + W.dys, *dxs = scratch + W.dxs;
    real *da = scratch + W.da, *dh = scratch + W.dh, *dxh = scratch + W.dxh;
    real *dphih = scratch + W.dphih;
    const real sc = *p->scale;

    // combine: out = Cw Ys -> dCw (S,N) = dout Ys^T, dYs (N,D) = Cw^T dout
    R(linear_forward)(dcw, dout, ys, NULL, S, D, N, 0);
    memset(dys, 0, sizeof(real) * (size_t)N * D);
    R(linear_backward)(NULL, dys, NULL, cw, dout, NULL, S, D, N);

    // experts; the kernels accumulate, so their activation gradients start at zero
    memset(da, 0, sizeof(real) * (size_t)N * M);
    memset(dh, 0, sizeof(real) * (size_t)N * M);
    memset(dxs, 0, sizeof(real) * (size_t)N * D);
#pragma omp parallel for schedule(static) if (experts_in_parallel(E))
    for (int e = 0; e < E; e++) {
        const size_t r0 = (size_t)e * P;
        R(linear_backward)(da + r0 * M, g->dw2 + (size_t)e * D * M, g->db2 + (size_t)e * D,
                          dys + r0 * D, hact + r0 * M, p->w2 + (size_t)e * D * M, P, M, D);
        R(act_backward)(dh + r0 * M, hpre + r0 * M, da + r0 * M, (size_t)P * M, d->act);
        R(linear_backward)(dxs + r0 * D, g->dw1 + (size_t)e * M * D, g->db1 + (size_t)e * M,
                          dh + r0 * M, xs + r0 * D, p->w1 + (size_t)e * M * D, P, D, M);
    }

    // dispatch: Xs = Dw^T x -> dx += Dw dXs = (Dw^T)^T dXs; dDw^T (N,S) = dXs x^T
    if (dx) R(linear_backward)(NULL, dx, NULL, dwt, dxs, NULL, N, D, S);
    R(linear_forward)(ddwt, dxs, x, NULL, N, D, S, 0);

    // both softmaxes read the same logits: their gradients add up, in the (S,N) layout
    memset(dlg, 0, sizeof(real) * (size_t)S * N);
    memset(dlgt, 0, sizeof(real) * (size_t)N * S);
    // a fixed matrix (App. A) is a constant: nothing flows back through it
    if (!combine_fixed(d->mix)) R(softmax_backward)(dlg, cw, dcw, S, N);
    if (!dispatch_fixed(d->mix)) R(softmax_backward)(dlgt, dwt, ddwt, N, S);
#pragma omp parallel for schedule(static)
    for (int s = 0; s < S; s++)
        for (int n = 0; n < N; n++) dlg[(size_t)s * N + n] += dlgt[(size_t)n * S + s];

    // logits = scale * sim: one scalar, summed serially in a fixed order (double, as the sum
    // runs over all S*N entries)
    double ds = 0;
    for (size_t i = 0; i < (size_t)S * N; i++) ds += (double)dlg[i] * sim[i];
    *g->dscale += (real)ds;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < (size_t)S * N; i++) dlg[i] *= sc;

    // sim = xh phih^T -> dxh (S,D) = dsim phih, dphih (N,D) = dsim^T xh
    memset(dphih, 0, sizeof(real) * (size_t)N * D);
    if (dx) memset(dxh, 0, sizeof(real) * (size_t)S * D);
    R(linear_backward)(dx ? dxh : NULL, dphih, NULL, dlg, xh, phih, S, D, N);

    // through v / sqrt(|v|^2 + eps): d v = (d vh - vh <vh, d vh>) / sqrt(|v|^2 + eps); without
    // the normalisation (raw) vh = v and d v = d vh
    const real keep = d->raw ? 0 : 1;
    if (dx) {
#pragma omp parallel for schedule(static)
        for (int s = 0; s < S; s++) {
            const real *h = xh + (size_t)s * D, *gh = dxh + (size_t)s * D;
            real dot = 0;
            for (int i = 0; i < D; i++) dot += h[i] * gh[i];
            for (int i = 0; i < D; i++) dx[(size_t)s * D + i] += (gh[i] - keep * h[i] * dot) / nx[s];
        }
    }
    // each thread owns whole columns n of dphi (D,N)
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real *h = phih + (size_t)n * D, *gh = dphih + (size_t)n * D;
        real dot = 0;
        for (int i = 0; i < D; i++) dot += h[i] * gh[i];
        for (int i = 0; i < D; i++) g->dphi[(size_t)i * N + n] += (gh[i] - keep * h[i] * dot) / nphi[n];
    }
}

// MOE.md asks for the min/max dispatch and combine weights, taken here over every entry of the
// group (the caller folds groups and layers together); the paper's appendix E plots the mean
// over slots (tokens) of the max dispatch (combine) weight: both are reported.
void R(soft_moe_stats)(const real *w, const soft_dims *d, double minmax[4], double meanmax[2]) {
    const int S = d->S, N = d->E * d->P;
    const size_t n = (size_t)S * N;
    if (n == 0) { // no slot or no token (refused by soft_dims_check; kept safe here): nothing to read
        minmax[0] = minmax[1] = minmax[2] = minmax[3] = 0;
        meanmax[0] = meanmax[1] = 0;
        return;
    }
    const real *dw = w, *cw = w + n; // acts_layout: cw follows dwt
    // App. E's monitors: dw is (N,S), one slot per row; cw (S,N), one token per row
    double md = 0, mc = 0;
    for (int j = 0; j < N; j++) {
        real mx = dw[(size_t)j * S];
        for (int s = 1; s < S; s++) mx = dw[(size_t)j * S + s] > mx ? dw[(size_t)j * S + s] : mx;
        md += mx;
    }
    for (int s = 0; s < S; s++) {
        real mx = cw[(size_t)s * N];
        for (int j = 1; j < N; j++) mx = cw[(size_t)s * N + j] > mx ? cw[(size_t)s * N + j] : mx;
        mc += mx;
    }
    meanmax[0] = md / N, meanmax[1] = mc / S;
    minmax[0] = minmax[1] = dw[0];
    minmax[2] = minmax[3] = cw[0];
    for (size_t i = 1; i < n; i++) {
        if (dw[i] < minmax[0]) minmax[0] = dw[i];
        if (dw[i] > minmax[1]) minmax[1] = dw[i];
        if (cw[i] < minmax[2]) minmax[2] = cw[i];
        if (cw[i] > minmax[3]) minmax[3] = cw[i];
    }
}
