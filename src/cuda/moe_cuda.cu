// moe_cuda.cu: the MoE entries of the backend table on the device: combine weights (plain and
// renormalised) and their backward (src/ops/backend_cpu.c), the counter-based router noise
// (vlmoe_mix64 / vlmoe_normal_at of src/core/core.c as device functions), the expert bank (one
// cuBLAS GEMM pair per expert over its packed rows, or one strided-batched product when every
// expert has the same rows: the fixed-capacity layout) and Soft MoE (src/moe/soft.c, the experts
// as strided-batched GEMMs). Semantics as the CPU's: what is written, what ACCUMULATES.
// Reductions run in a fixed order. Covered by tests/test_backend_ops.c.
#include <math.h>

#include "cuda/cuda_internal.cuh"

#define ROW_THREADS 128

// ---- combine weights: w[r] = gates[token, expert] (renorm: / zsum[t], the token's accepted
// gates summed in row order)

__global__ static void k_zsum(float *zsum, const float *gates, be_dispatch d) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= d.n) return;
    float z = 0;
    for (int j = d.tok_off[t]; j < d.tok_off[t + 1]; j++)
        z = __fadd_rn(z, gates[(size_t)t * d.E + d.row_expert[d.tok_rows[j]]]);
    zsum[t] = z;
}
__global__ static void k_combine_weights(float *w, const float *zsum, const float *gates, be_dispatch d, int renorm) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= d.rows) return;
    const int t = d.row_token[r];
    if (t < 0) { // a padding row of the fixed layout
        w[r] = 0.0f;
        return;
    }
    const float g = gates[(size_t)t * d.E + d.row_expert[r]];
    w[r] = renorm ? __fdiv_rn(g, zsum[t]) : g;
}
static void cuda_combine_weights(const backend *be, float *w, float *zsum, const float *gates, const be_dispatch *d,
                                 int renorm) {
    cudaStream_t st = stream_of(be);
    if (renorm && d->n > 0) {
        k_zsum<<<cu_blocks((size_t)d->n, 128), 128, 0, st>>>(zsum, gates, *d);
        if (LAUNCHED("combine_weights")) return;
    }
    if (d->rows <= 0) return;
    k_combine_weights<<<cu_blocks((size_t)d->rows, 128), 128, 0, st>>>(w, zsum, gates, *d, renorm);
    LAUNCHED("combine_weights");
}

// dgates (n,E) accumulates; one thread per token visits its rows in row order, as the CPU does
__global__ static void k_combine_weights_bwd(float *dgates, const float *dw, const float *gates, const float *zsum,
                                             be_dispatch d, int renorm) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= d.n) return;
    const int E = d.E;
    for (int j = d.tok_off[t]; j < d.tok_off[t + 1]; j++) {
        const int r = d.tok_rows[j], e = d.row_expert[r];
        if (!renorm) {
            dgates[(size_t)t * E + e] = __fadd_rn(dgates[(size_t)t * E + e], dw[r]);
            continue;
        }
        const float z = zsum[t], ge = gates[(size_t)t * E + e];
        for (int j2 = d.tok_off[t]; j2 < d.tok_off[t + 1]; j2++) {
            const int e2 = d.row_expert[d.tok_rows[j2]];
            const float f = __fsub_rn(e2 == e ? __fdiv_rn(1.0f, z) : 0.0f, __fdiv_rn(ge, __fmul_rn(z, z)));
            dgates[(size_t)t * E + e2] = __fadd_rn(dgates[(size_t)t * E + e2], __fmul_rn(dw[r], f));
        }
    }
}
static void cuda_combine_weights_backward(const backend *be, float *dgates, const float *dw, const float *gates,
                                          const float *zsum, const be_dispatch *d, int renorm) {
    if (d->n <= 0) return;
    k_combine_weights_bwd<<<cu_blocks((size_t)d->n, 128), 128, 0, stream_of(be)>>>(dgates, dw, gates, zsum, *d,
                                                                                   renorm);
    LAUNCHED("combine_weights");
}

// ---- router noise: noisy (n,E) = logits + sigma N(0,1), N from (seed, key[t], e) alone

// vlmoe_mix64 of src/core/core.c
__device__ static inline uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}
// vlmoe_normal_at of src/core/core.c: the same integers and uniforms bit for bit; log and cos
// are CUDA's (within 1 ulp of glibc's), so the double may differ from the CPU's in its last bit
__device__ static inline double normal_at(uint64_t key, uint64_t counter) {
    const uint64_t a = mix64(key ^ mix64(2 * counter));
    const uint64_t b = mix64(key ^ mix64(2 * counter + 1));
    const double u1 = ((double)(a >> 11) + 1.0) * 0x1.0p-53; // (0, 1]: log stays finite
    const double u2 = (double)(b >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
__global__ static void k_router_noise(float *noisy, const float *logits, size_t total, int E, uint64_t base,
                                      double sigma, const uint64_t *key) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t t = i / E;
    const int e = (int)(i % E);
    const uint64_t h = mix64(base ^ key[t]);
    noisy[i] = __fadd_rn(logits[i], (float)(sigma * normal_at(h, (uint64_t)e)));
}
static void cuda_router_noise(const backend *be, float *noisy, const float *logits, int n, int E, const be_noise *nz) {
    const size_t total = (size_t)n * E;
    if (!total) return;
    k_router_noise<<<cu_blocks(total, 256), 256, 0, stream_of(be)>>>(noisy, logits, total, E, vlmoe_mix64(nz->seed),
                                                                     nz->sigma, nz->key);
    LAUNCHED("router_noise");
}

// ---- the expert bank: expert e owns rows [off[e], off[e+1]) (off on the host); the
// activations run once over all rows, the products one expert at a time, or, when every
// expert has the same R rows (the fixed-capacity layout of a training step, be_route.fixed),
// one strided-batched product over the (E, R, width) block per product: forward, dX and dW.

// out (E, R, O) = b_e (add 0) or out + b_e (add 1), b (E, O): the bias of every expert at once
__global__ static void k_bias_experts(float *out, const float *b, size_t R, int O, size_t total, int add) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t e = i / (R * O);
    const float bj = b[e * O + i % O];
    out[i] = add ? __fadd_rn(out[i], bj) : bj;
}

// C_e = op(A_e) op(B_e) + beta C_e for the E experts, each operand packed (leading dimension its
// width): the fp32 table's cublasSgemmStridedBatched, the bf16 twin's cublasGemmStridedBatchedEx
static int bank_gemm(const backend *be, int bf16, int ta, int tb, int M, int N, int K, const float *A, int lda,
                     long long sA, const float *B, int ldb, long long sB, float beta, float *C, int ldc, long long sC,
                     int E) {
    return bf16 ? cu_gemm_bf16_batched(be, "experts", ta, tb, M, N, K, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, E)
                : cu_gemm_batched(be, "experts", ta, tb, M, N, K, 1.0f, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, E);
}

// out_e (R,O) = inp_e (R,K) w_e^T + b_e (beta 1: added to out_e): cu_linear_fwd for every expert
static int bank_fwd(const backend *be, int bf16, float *out, const float *inp, const float *w, const float *b, int R,
                    int K, int O, int E, int beta) {
    const size_t total = (size_t)E * R * O;
    k_bias_experts<<<cu_blocks(total, 256), 256, 0, stream_of(be)>>>(out, b, (size_t)R, O, total, beta);
    if (LAUNCHED("experts")) return 1;
    return bank_gemm(be, bf16, 0, 1, R, O, K, inp, K, (long long)R * K, w, K, (long long)O * K, 1.0f, out, O,
                     (long long)R * O, E);
}

// dinp_e (R,K) = dout_e w_e + beta dinp_e; dw_e (O,K) += dout_e^T inp_e; db_e += colsum(dout_e):
// cu_linear_bwd_beta for every expert (the column sums per expert in the shape's fixed order)
static int bank_bwd(const backend *be, int bf16, float *dinp, float *dw, float *db, const float *dout,
                    const float *inp, const float *w, int R, int K, int O, int E, float beta) {
    if ((dinp && bank_gemm(be, bf16, 0, 0, R, K, O, dout, O, (long long)R * O, w, K, (long long)O * K, beta, dinp,
                           K, (long long)R * K, E)) ||
        bank_gemm(be, bf16, 1, 0, O, K, R, dout, O, (long long)R * O, inp, K, (long long)R * K, 1.0f, dw, K,
                  (long long)O * K, E))
        return 1;
    cu_colsum(be, "experts", db, dout, NULL, NULL, NULL, R, O, E);
    return 0;
}

// R when every expert owns R > 0 rows, else 0 (then one product pair per expert)
static int bank_rows(const be_experts *ex) {
    const int R = ex->off[1] - ex->off[0];
    for (int e = 1; e < ex->E; e++)
        if (ex->off[e + 1] - ex->off[e] != R) return 0;
    return R > 0 ? R : 0;
}

static void experts_fwd(const backend *be, int bf16, float *y, float *h, float *a, const float *x,
                                 const float *const w[4], const be_experts *ex, int beta) {
    const int D = ex->D, M = ex->M, E = ex->E;
    if (E <= 0) return;
    const size_t r0 = (size_t)ex->off[0], nr = (size_t)(ex->off[E] - ex->off[0]);
    if (!nr) return;
    const int R = bank_rows(ex);
    if (R) {
        if (bank_fwd(be, bf16, h + r0 * M, x + r0 * D, w[0], w[1], R, D, M, E, 0)) return;
        cu_act_forward(be, a + r0 * M, h + r0 * M, nr * M, ex->act);
        bank_fwd(be, bf16, y + r0 * D, a + r0 * M, w[2], w[3], R, M, D, E, beta);
        return;
    }
    for (int e = 0; e < E; e++) {
        const size_t o = (size_t)ex->off[e];
        const int k = ex->off[e + 1] - ex->off[e];
        if (k > 0) cu_linear_fwd(be, bf16, h + o * M, x + o * D, w[0] + (size_t)e * M * D, w[1] + (size_t)e * M, k, D, M, 0);
    }
    cu_act_forward(be, a + r0 * M, h + r0 * M, nr * M, ex->act);
    for (int e = 0; e < E; e++) {
        const size_t o = (size_t)ex->off[e];
        const int k = ex->off[e + 1] - ex->off[e];
        if (k > 0)
            cu_linear_fwd(be, bf16, y + o * D, a + o * M, w[2] + (size_t)e * D * M, w[3] + (size_t)e * D, k, M, D, beta);
    }
}

// dx and dw {dw1, db1, dw2, db2} ACCUMULATE (dx_beta 1) or dx's rows are written (dx_beta 0);
// da, dh scratch (the activation is recomputed in dh)
static void experts_bwd(const backend *be, int bf16, float *dx, float *const dw[4], const float *dy, const float *x,
                                  const float *h, const float *const w[4], float *da, float *dh,
                                  const be_experts *ex, float dx_beta) {
    const int D = ex->D, M = ex->M, E = ex->E;
    if (E <= 0) return;
    const size_t r0 = (size_t)ex->off[0], nr = (size_t)(ex->off[E] - ex->off[0]);
    if (!nr) return;
    const int R = bank_rows(ex);
    cudaStream_t st = stream_of(be);
    cu_act_forward(be, dh + r0 * M, h + r0 * M, nr * M, ex->act);
    if (CK("experts", cudaMemsetAsync(da + r0 * M, 0, sizeof(float) * nr * M, st))) return;
    if (R) {
        if (bank_bwd(be, bf16, da + r0 * M, dw[2], dw[3], dy + r0 * D, dh + r0 * M, w[2], R, M, D, E, 1.0f)) return;
    } else {
        for (int e = 0; e < E; e++) {
            const size_t o = (size_t)ex->off[e];
            const int k = ex->off[e + 1] - ex->off[e];
            if (k > 0)
                cu_linear_bwd(be, bf16, da + o * M, dw[2] + (size_t)e * D * M, dw[3] + (size_t)e * D, dy + o * D,
                              dh + o * M, w[2] + (size_t)e * D * M, k, M, D);
        }
    }
    if (CK("experts", cudaMemsetAsync(dh + r0 * M, 0, sizeof(float) * nr * M, st))) return;
    cu_act_backward(be, dh + r0 * M, h + r0 * M, da + r0 * M, nr * M, ex->act);
    if (R) {
        bank_bwd(be, bf16, dx + r0 * D, dw[0], dw[1], dh + r0 * M, x + r0 * D, w[0], R, D, M, E, dx_beta);
        return;
    }
    for (int e = 0; e < E; e++) {
        const size_t o = (size_t)ex->off[e];
        const int k = ex->off[e + 1] - ex->off[e];
        if (k > 0)
            cu_linear_bwd_beta(be, bf16, dx + o * D, dw[0] + (size_t)e * M * D, dw[1] + (size_t)e * M, dh + o * M,
                               x + o * D, w[0] + (size_t)e * M * D, k, D, M, dx_beta);
    }
}

static void cuda_experts_forward(const backend *be, float *y, float *h, float *a, const float *x,
                                 const float *const w[4], const be_experts *ex, int beta) {
    experts_fwd(be, 0, y, h, a, x, w, ex, beta);
}
static void cuda_experts_backward(const backend *be, float *dx, float *const dw[4], const float *dy, const float *x,
                                  const float *h, const float *const w[4], float *da, float *dh,
                                  const be_experts *ex) {
    experts_bwd(be, 0, dx, dw, dy, x, h, w, da, dh, ex, 1.0f);
}
static void cuda_experts_backward_write(const backend *be, float *dx, float *const dw[4], const float *dy,
                                        const float *x, const float *h, const float *const w[4], float *da,
                                        float *dh, const be_experts *ex) {
    experts_bwd(be, 0, dx, dw, dy, x, h, w, da, dh, ex, 0.0f);
}
static void bf16_experts_forward(const backend *be, float *y, float *h, float *a, const float *x,
                                 const float *const w[4], const be_experts *ex, int beta) {
    experts_fwd(be, 1, y, h, a, x, w, ex, beta);
}
static void bf16_experts_backward(const backend *be, float *dx, float *const dw[4], const float *dy, const float *x,
                                  const float *h, const float *const w[4], float *da, float *dh,
                                  const be_experts *ex) {
    experts_bwd(be, 1, dx, dw, dy, x, h, w, da, dh, ex, 1.0f);
}
static void bf16_experts_backward_write(const backend *be, float *dx, float *const dw[4], const float *dy,
                                        const float *x, const float *h, const float *const w[4], float *da,
                                        float *dh, const be_experts *ex) {
    experts_bwd(be, 1, dx, dw, dy, x, h, w, da, dh, ex, 0.0f);
}

// ---- Soft MoE over one group (src/moe/soft.h): the layouts of acts and scratch are soft.c's,
// restated here (soft.c keeps them private); soft_moe_acts_floats / soft_moe_scratch_floats
// size them, and the test allocates by those.

typedef struct {
    size_t xh, nx, phih, nphi, sim, dw, dwt, cw, cwt, xs, hpre, hact, ys, total;
} acts_layout;
typedef struct {
    size_t dcw, dlg, ddwt, dlgt, dys, dxs, da, dh, dxh, dphih, total;
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

#define SOFT_EPS 1e-6f

// Row r of v (R rows, D wide, element (r,i) at v[r*rs + i*is]) normalised: vh (R,D) = v / n_r,
// n_r = sqrt(|v_r|^2 + eps). Tokens are rows of x (rs D, is 1); slots are columns of phi (rs 1,
// is N).
__global__ static void k_soft_norm(float *vh, float *nv, const float *v, int D, size_t rs, size_t is) {
    __shared__ float sh[ROW_THREADS];
    const size_t r = blockIdx.x;
    float ss = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float a = v[r * rs + i * is];
        ss = __fadd_rn(ss, __fmul_rn(a, a));
    }
    const float n = __fsqrt_rn(__fadd_rn(block_sum(ss, sh), SOFT_EPS));
    for (int i = threadIdx.x; i < D; i += blockDim.x) vh[r * D + i] = __fdiv_rn(v[r * rs + i * is], n);
    if (threadIdx.x == 0) nv[r] = n;
}

// dst = (*scale) src (n), in place allowed
__global__ static void k_times_scalar(float *dst, const float *src, const float *scale, size_t n) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __fmul_rn(*scale, src[i]);
}

// out (G*rows, C): row r = b[(r / rows) C ..]: the biases of a bank of G experts, rows each
__global__ static void k_bias_grouped(float *out, const float *b, size_t total, int rows, int C) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t r = i / C;
    out[i] = b[(r / rows) * C + i % C];
}

static void soft_experts_forward(const backend *be, float *hpre, float *hact, float *ys, const float *xs,
                                 const soft_params_f32 *p, const soft_dims *d) {
    const int D = d->D, E = d->E, P = d->P, M = d->M, N = E * P;
    cudaStream_t st = stream_of(be);
    k_bias_grouped<<<cu_blocks((size_t)N * M, 256), 256, 0, st>>>(hpre, p->b1, (size_t)N * M, P, M);
    if (LAUNCHED("soft_moe") ||
        cu_gemm_batched(be, "soft_moe", 0, 1, P, M, D, 1.0f, xs, D, (long long)P * D, p->w1, D, (long long)M * D, 1.0f,
                        hpre, M, (long long)P * M, E))
        return;
    cu_act_forward(be, hact, hpre, (size_t)N * M, d->act);
    k_bias_grouped<<<cu_blocks((size_t)N * D, 256), 256, 0, st>>>(ys, p->b2, (size_t)N * D, P, D);
    if (LAUNCHED("soft_moe")) return;
    cu_gemm_batched(be, "soft_moe", 0, 1, P, D, M, 1.0f, hact, M, (long long)P * M, p->w2, M, (long long)D * M, 1.0f, ys,
                    D, (long long)P * D, E);
}

// out (S,D) is WRITTEN; acts saved for backward
static void cuda_soft_moe_forward(const backend *be, float *out, float *acts, const float *x, const soft_params_f32 *p,
                                  const soft_dims *d) {
    const int S = d->S, D = d->D, E = d->E, P = d->P, N = E * P;
    if (S <= 0 || N <= 0) return;
    cudaStream_t st = stream_of(be);
    const acts_layout L = acts_layout_of(d);
    float *xh = acts + L.xh, *nx = acts + L.nx, *phih = acts + L.phih, *nphi = acts + L.nphi;
    float *sim = acts + L.sim, *dw = acts + L.dw, *dwt = acts + L.dwt, *cw = acts + L.cw;
    float *cwt = acts + L.cwt, *xs = acts + L.xs;
    k_soft_norm<<<S, ROW_THREADS, 0, st>>>(xh, nx, x, D, (size_t)D, 1);
    k_soft_norm<<<N, ROW_THREADS, 0, st>>>(phih, nphi, p->phi, D, 1, (size_t)N);
    if (LAUNCHED("soft_moe")) return;
    if (cu_gemm(be, "soft_moe", 0, 1, S, N, D, 1.0f, xh, D, phih, D, 0.0f, sim, N)) return;
    // the scaled logits staged in dw (S,N) and cwt (N,S), overwritten once the softmaxes read them
    k_times_scalar<<<cu_blocks((size_t)S * N, 256), 256, 0, st>>>(dw, sim, p->scale, (size_t)S * N);
    if (LAUNCHED("soft_moe")) return;
    cu_transpose(be, "soft_moe", cwt, dw, S, N, 0);
    cu_softmax_forward(be, cw, dw, S, N);   // combine: per token, over all N slots
    cu_softmax_forward(be, dwt, cwt, N, S); // dispatch: per slot, over the S tokens
    cu_transpose(be, "soft_moe", dw, dwt, N, S, 0);
    cu_transpose(be, "soft_moe", cwt, cw, S, N, 0);
    // Xs (N,D) = Dw^T x
    if (cu_gemm(be, "soft_moe", 1, 0, N, D, S, 1.0f, dw, N, x, D, 0.0f, xs, D)) return;
    soft_experts_forward(be, acts + L.hpre, acts + L.hact, acts + L.ys, xs, p, d);
    // out (S,D) = Cw Ys
    cu_gemm(be, "soft_moe", 0, 0, S, D, N, 1.0f, cw, N, acts + L.ys, D, 0.0f, out, D);
}

// part[r] = sum_n (double) a[r,n] b[r,n]: one block per row
__global__ static void k_row_dot_d(double *part, const float *a, const float *b, int C) {
    __shared__ double sh[ROW_THREADS];
    const size_t r = blockIdx.x;
    double s = 0;
    for (int i = threadIdx.x; i < C; i += blockDim.x) s += (double)a[r * C + i] * b[r * C + i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) part[r] = s;
}
__global__ static void k_add_scalar(float *dst, const double *v) { *dst = __fadd_rn(*dst, (float)*v); }

// Through v / sqrt(|v|^2 + eps) for row r of the normalised vh (R,D): dv = (dvh - vh <vh, dvh>)
// / n_r, ACCUMULATED into element (r,i) at dv[r*rs + i*is] (tokens: rows of dx; slots: columns of
// dphi).
__global__ static void k_soft_norm_bwd(float *dv, const float *vh, const float *dvh, const float *nv, int D, size_t rs,
                                       size_t is) {
    __shared__ float sh[ROW_THREADS];
    const size_t r = blockIdx.x;
    const float *h = vh + r * D, *gh = dvh + r * D;
    float dot = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dot = __fadd_rn(dot, __fmul_rn(h[i], gh[i]));
    dot = block_sum(dot, sh);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const size_t j = r * rs + i * is;
        dv[j] = __fadd_rn(dv[j], __fdiv_rn(__fsub_rn(gh[i], __fmul_rn(h[i], dot)), nv[r]));
    }
}

// dx (may be NULL) and every gradient of g ACCUMULATE; scratch (soft_moe_scratch_floats)
static void cuda_soft_moe_backward(const backend *be, float *dx, const soft_grads_f32 *g, const float *dout,
                                   const float *acts, const float *x, const soft_params_f32 *p, const soft_dims *d,
                                   float *scratch) {
    const int S = d->S, D = d->D, E = d->E, P = d->P, M = d->M, N = E * P;
    if (S <= 0 || N <= 0) return;
    cudaStream_t st = stream_of(be);
    const acts_layout L = acts_layout_of(d);
    const scratch_layout W = scratch_layout_of(d);
    const float *xh = acts + L.xh, *nx = acts + L.nx, *phih = acts + L.phih, *nphi = acts + L.nphi;
    const float *sim = acts + L.sim, *dwt = acts + L.dwt, *cw = acts + L.cw, *xs = acts + L.xs;
    const float *hpre = acts + L.hpre, *hact = acts + L.hact, *ys = acts + L.ys;
    float *dcw = scratch + W.dcw, *dlg = scratch + W.dlg, *ddwt = scratch + W.ddwt;
    float *dlgt = scratch + W.dlgt, *dys = scratch + W.dys, *dxs = scratch + W.dxs;
    float *da = scratch + W.da, *dh = scratch + W.dh, *dxh = scratch + W.dxh, *dphih = scratch + W.dphih;
    const char *op = "soft_moe";

    // combine: out = Cw Ys -> dCw (S,N) = dout Ys^T, dYs (N,D) = Cw^T dout
    if (cu_gemm(be, op, 0, 1, S, N, D, 1.0f, dout, D, ys, D, 0.0f, dcw, N) ||
        cu_gemm(be, op, 1, 0, N, D, S, 1.0f, cw, N, dout, D, 0.0f, dys, D))
        return;
    // experts, all E at once: da = dYs w2_e; dw2_e += dYs_e^T hact_e; db2_e += colsum(dYs_e)
    if (cu_gemm_batched(be, op, 0, 0, P, M, D, 1.0f, dys, D, (long long)P * D, p->w2, M, (long long)D * M, 0.0f, da, M,
                        (long long)P * M, E) ||
        cu_gemm_batched(be, op, 1, 0, D, M, P, 1.0f, dys, D, (long long)P * D, hact, M, (long long)P * M, 1.0f, g->dw2,
                        M, (long long)D * M, E))
        return;
    cu_colsum(be, op, g->db2, dys, NULL, NULL, NULL, P, D, E);
    if (CK(op, cudaMemsetAsync(dh, 0, sizeof(float) * (size_t)N * M, st))) return;
    cu_act_backward(be, dh, hpre, da, (size_t)N * M, d->act);
    // dXs_e = dh_e w1_e; dw1_e += dh_e^T Xs_e; db1_e += colsum(dh_e)
    if (cu_gemm_batched(be, op, 0, 0, P, D, M, 1.0f, dh, M, (long long)P * M, p->w1, D, (long long)M * D, 0.0f, dxs, D,
                        (long long)P * D, E) ||
        cu_gemm_batched(be, op, 1, 0, M, D, P, 1.0f, dh, M, (long long)P * M, xs, D, (long long)P * D, 1.0f, g->dw1, D,
                        (long long)M * D, E))
        return;
    cu_colsum(be, op, g->db1, dh, NULL, NULL, NULL, P, M, E);

    // dispatch: Xs = Dw^T x -> dx += Dw dXs = (Dw^T)^T dXs; dDw^T (N,S) = dXs x^T
    if (dx && cu_gemm(be, op, 1, 0, S, D, N, 1.0f, dwt, S, dxs, D, 1.0f, dx, D)) return;
    if (cu_gemm(be, op, 0, 1, N, S, D, 1.0f, dxs, D, x, D, 0.0f, ddwt, S)) return;

    // both softmaxes read the same logits: their gradients add up, in the (S,N) layout
    if (CK(op, cudaMemsetAsync(dlg, 0, sizeof(float) * (size_t)S * N, st)) ||
        CK(op, cudaMemsetAsync(dlgt, 0, sizeof(float) * (size_t)N * S, st)))
        return;
    cu_softmax_backward(be, dlg, cw, dcw, S, N);
    cu_softmax_backward(be, dlgt, dwt, ddwt, N, S);
    cu_transpose(be, op, dlg, dlgt, N, S, 1);

    // logits = scale * sim: dscale += sum dlg sim (in double, rows then their sums in order)
    double *part = (double *)cu_workspace(be, sizeof(double) * (size_t)S, op);
    if (!part) return;
    k_row_dot_d<<<S, ROW_THREADS, 0, st>>>(part, dlg, sim, N);
    if (LAUNCHED(op)) return;
    cu_sum_doubles(be, op, ctx_of(be)->partial, part, (size_t)S);
    k_add_scalar<<<1, 1, 0, st>>>(g->dscale, ctx_of(be)->partial);
    k_times_scalar<<<cu_blocks((size_t)S * N, 256), 256, 0, st>>>(dlg, dlg, p->scale, (size_t)S * N);
    if (LAUNCHED(op)) return;

    // sim = xh phih^T -> dxh (S,D) = dsim phih, dphih (N,D) = dsim^T xh
    if (cu_gemm(be, op, 1, 0, N, D, S, 1.0f, dlg, N, xh, D, 0.0f, dphih, D)) return;
    if (dx) {
        if (cu_gemm(be, op, 0, 0, S, D, N, 1.0f, dlg, N, phih, D, 0.0f, dxh, D)) return;
        k_soft_norm_bwd<<<S, ROW_THREADS, 0, st>>>(dx, xh, dxh, nx, D, (size_t)D, 1);
    }
    k_soft_norm_bwd<<<N, ROW_THREADS, 0, st>>>(g->dphi, phih, dphih, nphi, D, 1, (size_t)N);
    LAUNCHED(op);
}

void cuda_fill_moe(backend *be) {
    be->combine_weights = cuda_combine_weights;
    be->combine_weights_backward = cuda_combine_weights_backward;
    be->router_noise = cuda_router_noise;
    be->experts_forward = cuda_experts_forward;
    be->experts_backward = cuda_experts_backward;
    be->experts_backward_write = cuda_experts_backward_write;
    be->soft_moe_forward = cuda_soft_moe_forward;
    be->soft_moe_backward = cuda_soft_moe_backward;
}

// the cuda-bf16 table's expert bank: its products in bf16. Soft MoE keeps the fp32 table's
// kernels, as the cpu-bf16 table does (src/moe/soft.c multiplies in fp32 there).
void cuda_fill_moe_bf16(backend *be) {
    be->experts_forward = bf16_experts_forward;
    be->experts_backward = bf16_experts_backward;
    be->experts_backward_write = bf16_experts_backward_write;
}
