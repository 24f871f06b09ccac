// nn_cuda.cu: the CUDA kernels of src/ops/ops.h (linear on cuBLAS, LayerNorm, the GELU family,
// softmax, attention with causal and length masks on cuBLAS strided-batched products, patchify,
// position add, class token, pooling, L2 normalisation), with the CPU kernels' semantics: the
// same shapes, the same outputs written or ACCUMULATED (+=), fp32 with no fused multiply-adds
// (-fmad=false). Reductions run in a fixed order, so a run repeats the previous one's bits.
// Covered by tests/test_backend_ops.c against the CPU table in double.
#include <math.h>

#include "cuda/cuda_internal.cuh"

#define SQRT_2_OVER_PI 0.7978845608028654
#define INV_SQRT_2 0.7071067811865476
#define INV_SQRT_2PI 0.3989422804014327
#define ROW_THREADS 128 // threads of the one-block-per-row kernels

// ---- linear: out (N,O) = inp (N,K) . w^T (w (O,K)) + b; beta 0 writes, 1 adds. The bf16 table
// (`--precision bf16`) differs from the fp32 one only in the products (lin_gemm).

// out (N,O) = b (beta 0) or out + b (beta 1), before the product adds into it (as the CPU does)
__global__ static void k_bias_rows(float *out, const float *b, size_t N, int O, int add) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= N * O) return;
    const float bj = b[i % O];
    out[i] = add ? __fadd_rn(out[i], bj) : bj;
}

// The products of linear and the expert bank: fp32 on the "cuda" table, bf16 operands with fp32
// accumulation on "cuda-bf16" (src/cuda/bf16_cuda.cu)
static int lin_gemm(const backend *be, int bf16, int ta, int tb, int M, int N, int K, const float *A, int lda,
                    const float *B, int ldb, float beta, float *C, int ldc) {
    return bf16 ? cu_gemm_bf16(be, "linear", ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc)
                : cu_gemm(be, "linear", ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}

void cu_linear_fwd(const backend *be, int bf16, float *out, const float *inp, const float *w, const float *b,
                   int N, int K, int O, int beta) {
    if (N <= 0 || O <= 0) return;
    if (b) {
        k_bias_rows<<<cu_blocks((size_t)N * O, 256), 256, 0, stream_of(be)>>>(out, b, (size_t)N, O, beta);
        if (LAUNCHED("linear")) return;
    }
    lin_gemm(be, bf16, 0, 1, N, O, K, inp, K, w, K, beta || b ? 1.0f : 0.0f, out, O);
}

// dinp (N,K) = dout.w + beta dinp (dinp may be NULL; beta 0: cuBLAS does not read it);
// dw (O,K) += dout^T.inp; db (O) += colsum(dout)
void cu_linear_bwd_beta(const backend *be, int bf16, float *dinp, float *dw, float *db, const float *dout,
                        const float *inp, const float *w, int N, int K, int O, float beta) {
    if (dinp && lin_gemm(be, bf16, 0, 0, N, K, O, dout, O, w, K, beta, dinp, K)) return;
    if (lin_gemm(be, bf16, 1, 0, O, K, N, dout, O, inp, K, 1.0f, dw, K)) return;
    if (db) cu_colsum(be, "linear", db, dout, NULL, NULL, NULL, N, O, 1);
}
void cu_linear_bwd(const backend *be, int bf16, float *dinp, float *dw, float *db, const float *dout,
                   const float *inp, const float *w, int N, int K, int O) {
    cu_linear_bwd_beta(be, bf16, dinp, dw, db, dout, inp, w, N, K, O, 1.0f);
}

static void cuda_linear_forward(const backend *be, float *out, const float *inp, const float *w, const float *b,
                                int N, int K, int O, int beta) {
    cu_linear_fwd(be, 0, out, inp, w, b, N, K, O, beta);
}
static void cuda_linear_backward(const backend *be, float *dinp, float *dw, float *db, const float *dout,
                                 const float *inp, const float *w, int N, int K, int O) {
    cu_linear_bwd(be, 0, dinp, dw, db, dout, inp, w, N, K, O);
}
static void cuda_linear_backward_write(const backend *be, float *dinp, float *dw, float *db, const float *dout,
                                       const float *inp, const float *w, int N, int K, int O) {
    cu_linear_bwd_beta(be, 0, dinp, dw, db, dout, inp, w, N, K, O, 0.0f);
}
static void bf16_linear_forward(const backend *be, float *out, const float *inp, const float *w, const float *b,
                                int N, int K, int O, int beta) {
    cu_linear_fwd(be, 1, out, inp, w, b, N, K, O, beta);
}
static void bf16_linear_backward(const backend *be, float *dinp, float *dw, float *db, const float *dout,
                                 const float *inp, const float *w, int N, int K, int O) {
    cu_linear_bwd(be, 1, dinp, dw, db, dout, inp, w, N, K, O);
}
static void bf16_linear_backward_write(const backend *be, float *dinp, float *dw, float *db, const float *dout,
                                       const float *inp, const float *w, int N, int K, int O) {
    cu_linear_bwd_beta(be, 1, dinp, dw, db, dout, inp, w, N, K, O, 0.0f);
}

// ---- LayerNorm: one block per row

__global__ static void k_ln_fwd(float *out, float *mean, float *rstd, const float *inp, const float *w,
                                const float *b, int C, double eps) {
    __shared__ float sh[ROW_THREADS];
    const size_t n = blockIdx.x;
    const float *x = inp + n * C;
    float s = 0;
    for (int i = threadIdx.x; i < C; i += blockDim.x) s = __fadd_rn(s, x[i]);
    const float m = __fdiv_rn(block_sum(s, sh), (float)C);
    float v = 0;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        const float d = __fsub_rn(x[i], m);
        v = __fadd_rn(v, __fmul_rn(d, d));
    }
    v = __fdiv_rn(block_sum(v, sh), (float)C);
    const float r = (float)(1.0 / sqrt((double)v + eps));
    for (int i = threadIdx.x; i < C; i += blockDim.x)
        out[n * C + i] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x[i], m), r), w[i]), b[i]);
    if (threadIdx.x == 0) mean[n] = m, rstd[n] = r;
}
static void cuda_layernorm_forward(const backend *be, float *out, float *mean, float *rstd, const float *inp,
                                   const float *w, const float *b, int N, int C, double eps) {
    if (N <= 0) return;
    k_ln_fwd<<<N, ROW_THREADS, 0, stream_of(be)>>>(out, mean, rstd, inp, w, b, C, eps);
    LAUNCHED("layernorm");
}

// the forward's expression, element by element: the same bits as that forward
__global__ static void k_ln_recompute(float *out, const float *inp, const float *w, const float *b,
                                      const float *mean, const float *rstd, size_t N, int C) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= N * C) return;
    const size_t n = i / C;
    const int c = (int)(i % C);
    out[i] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(inp[i], mean[n]), rstd[n]), w[c]), b[c]);
}
static void cuda_layernorm_recompute(const backend *be, float *out, const float *inp, const float *w,
                                     const float *b, const float *mean, const float *rstd, int N, int C) {
    if (N <= 0 || C <= 0) return;
    k_ln_recompute<<<cu_blocks((size_t)N * C, 256), 256, 0, stream_of(be)>>>(out, inp, w, b, mean, rstd,
                                                                               (size_t)N, C);
    LAUNCHED("layernorm");
}

// dinp (N,C) accumulates; dw, db (C) accumulate the column sums
__global__ static void k_ln_bwd(float *dinp, const float *dout, const float *inp, const float *w,
                                const float *mean, const float *rstd, int C) {
    __shared__ float sh[ROW_THREADS];
    const size_t n = blockIdx.x;
    const float *x = inp + n * C, *g = dout + n * C;
    const float m = mean[n], s = rstd[n];
    float a = 0, bsum = 0;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        const float dn = __fmul_rn(w[i], g[i]);
        a = __fadd_rn(a, dn);
        bsum = __fadd_rn(bsum, __fmul_rn(__fmul_rn(dn, __fsub_rn(x[i], m)), s));
    }
    const float dmean = __fdiv_rn(block_sum(a, sh), (float)C);
    const float dnorm = __fdiv_rn(block_sum(bsum, sh), (float)C);
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        const float dn = __fmul_rn(w[i], g[i]);
        const float t = __fsub_rn(__fsub_rn(dn, dmean), __fmul_rn(__fmul_rn(__fsub_rn(x[i], m), s), dnorm));
        dinp[n * C + i] = __fadd_rn(dinp[n * C + i], __fmul_rn(t, s));
    }
}
static void cuda_layernorm_backward(const backend *be, float *dinp, float *dw, float *db, const float *dout,
                                    const float *inp, const float *w, const float *mean, const float *rstd, int N,
                                    int C) {
    if (N <= 0) return;
    k_ln_bwd<<<N, ROW_THREADS, 0, stream_of(be)>>>(dinp, dout, inp, w, mean, rstd, C);
    if (LAUNCHED("layernorm")) return;
    cu_colsum(be, "layernorm", db, dout, NULL, NULL, NULL, N, C, 1);
    cu_colsum(be, "layernorm", dw, dout, inp, mean, rstd, N, C, 1);
}

// ---- the GELU family: GELU (erf), GELU (tanh) and quick GELU as x sigmoid(c(x))

__device__ static inline float gelu_arg(float x, int kind) {
    return kind == VLMOE_ACT_GELU_TANH
               ? __fmul_rn((float)(2 * SQRT_2_OVER_PI), __fadd_rn(x, __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x)))
               : __fmul_rn(1.702f, x);
}

__global__ static void k_act_fwd(float *out, const float *inp, size_t n, int kind) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float x = inp[i];
    if (kind == VLMOE_ACT_GELU)
        out[i] = __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, erff(__fmul_rn(x, (float)INV_SQRT_2))));
    else
        out[i] = __fdiv_rn(x, __fadd_rn(1.0f, expf(-gelu_arg(x, kind))));
}
void cu_act_forward(const backend *be, float *out, const float *inp, size_t n, int kind) {
    if (!n) return;
    k_act_fwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(out, inp, n, kind);
    LAUNCHED("act");
}

// dinp accumulates
__global__ static void k_act_bwd(float *dinp, const float *inp, const float *dout, size_t n, int kind) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float x = inp[i];
    float d;
    if (kind == VLMOE_ACT_GELU) {
        const float cdf = __fmul_rn(0.5f, __fadd_rn(1.0f, erff(__fmul_rn(x, (float)INV_SQRT_2))));
        d = __fadd_rn(cdf, __fmul_rn(__fmul_rn(x, (float)INV_SQRT_2PI), expf(__fmul_rn(__fmul_rn(-0.5f, x), x))));
    } else {
        // d/dx [x s(c(x))] = s + x s (1 - s) c'(x)
        const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gelu_arg(x, kind))));
        const float dc = kind == VLMOE_ACT_GELU_TANH
                             ? __fmul_rn((float)(2 * SQRT_2_OVER_PI), __fadd_rn(1.0f, __fmul_rn(__fmul_rn((float)(3 * 0.044715), x), x)))
                             : 1.702f;
        d = __fadd_rn(s, __fmul_rn(__fmul_rn(__fmul_rn(x, s), __fsub_rn(1.0f, s)), dc));
    }
    dinp[i] = __fadd_rn(dinp[i], __fmul_rn(dout[i], d));
}
void cu_act_backward(const backend *be, float *dinp, const float *inp, const float *dout, size_t n, int kind) {
    if (!n) return;
    k_act_bwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(dinp, inp, dout, n, kind);
    LAUNCHED("act");
}

// ---- row softmax: one block per row

__global__ static void k_softmax_fwd(float *out, const float *inp, int C) {
    __shared__ float sh[ROW_THREADS];
    const size_t n = blockIdx.x;
    const float *x = inp + n * C;
    float *o = out + n * C;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < C; i += blockDim.x) mx = fmaxf(mx, x[i]);
    mx = block_max(mx, sh);
    float s = 0;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        const float e = expf(__fsub_rn(x[i], mx));
        o[i] = e;
        s = __fadd_rn(s, e);
    }
    s = block_sum(s, sh);
    for (int i = threadIdx.x; i < C; i += blockDim.x) o[i] = __fdiv_rn(o[i], s);
}
void cu_softmax_forward(const backend *be, float *out, const float *inp, int N, int C) {
    if (N <= 0 || C <= 0) return;
    k_softmax_fwd<<<N, ROW_THREADS, 0, stream_of(be)>>>(out, inp, C);
    LAUNCHED("softmax");
}

// dinp accumulates y (g - y.g)
__global__ static void k_softmax_bwd(float *dinp, const float *out, const float *dout, int C) {
    __shared__ float sh[ROW_THREADS];
    const size_t n = blockIdx.x;
    const float *y = out + n * C, *g = dout + n * C;
    float dot = 0;
    for (int i = threadIdx.x; i < C; i += blockDim.x) dot = __fadd_rn(dot, __fmul_rn(y[i], g[i]));
    dot = block_sum(dot, sh);
    for (int i = threadIdx.x; i < C; i += blockDim.x)
        dinp[n * C + i] = __fadd_rn(dinp[n * C + i], __fmul_rn(y[i], __fsub_rn(g[i], dot)));
}
void cu_softmax_backward(const backend *be, float *dinp, const float *out, const float *dout, int N, int C) {
    if (N <= 0 || C <= 0) return;
    k_softmax_bwd<<<N, ROW_THREADS, 0, stream_of(be)>>>(dinp, out, dout, C);
    LAUNCHED("softmax");
}

// ---- attention: per head, the products of all sequences of the segment in one strided-batched
// GEMM on the q/k/v columns of qkv; the masked softmax one block per score row

// Row (b,h,i) of att (nseq,H,T,T): softmax over the keys query i may see (key_limit of ops.c),
// exactly 0 beyond them.
__global__ static void k_attn_softmax(float *att, const int32_t *lens, int H, int T, int causal, int prefix) {
    __shared__ float sh[ROW_THREADS];
    const size_t row = blockIdx.x;
    const int b = (int)(row / ((size_t)H * T)), i = (int)(row % T);
    const int len = lens ? lens[b] : T;
    const int lim = i < prefix ? prefix : i + 1;
    int nk = causal && lim < len ? lim : len;
    nk = nk < 0 ? 0 : nk > T ? T : nk;
    float *a = att + row * T;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) mx = fmaxf(mx, a[j]);
    mx = block_max(mx, sh);
    float s = 0;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        const float e = expf(__fsub_rn(a[j], mx));
        a[j] = e;
        s = __fadd_rn(s, e);
    }
    s = block_sum(s, sh);
    const float inv = __fdiv_rn(1.0f, s);
    for (int j = threadIdx.x; j < T; j += blockDim.x) a[j] = j < nk ? __fmul_rn(a[j], inv) : 0.0f;
}

static void cuda_attention_forward(const backend *be, float *out, float *att, const float *qkv,
                                   const attn_segment *seg, int D, int H) {
    const int T = seg->seqlen, hd = D / H, ld = 3 * D, nb = seg->nseq;
    if (nb <= 0 || T <= 0) return;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const long long sq = (long long)T * ld, sa = (long long)H * T * T, so = (long long)T * D;
    const float *q0 = qkv + seg->tok_off * (size_t)ld;
    for (int h = 0; h < H; h++) {
        const float *q = q0 + h * hd;
        // scores (T,T) = scale q k^T
        if (cu_gemm_batched(be, "attention", 0, 1, T, T, hd, scale, q, ld, sq, q + D, ld, sq, 0.0f,
                            att + (size_t)h * T * T, T, sa, nb))
            return;
    }
    k_attn_softmax<<<(unsigned)((size_t)nb * H * T), ROW_THREADS, 0, stream_of(be)>>>(att, seg->lens, H, T,
                                                                                       seg->causal, seg->prefix);
    if (LAUNCHED("attention")) return;
    for (int h = 0; h < H; h++) {
        // out (T,hd) columns of head h = p v
        if (cu_gemm_batched(be, "attention", 0, 0, T, hd, T, 1.0f, att + (size_t)h * T * T, T, sa,
                            q0 + 2 * D + h * hd, ld, sq, 0.0f, out + seg->tok_off * (size_t)D + h * hd, D, so,
                            nb))
            return;
    }
}

// datt (full rows) = p (dp - rowsum(p dp)) scale, in place over dp
__global__ static void k_attn_softmax_bwd(float *datt, const float *att, int T, float scale) {
    __shared__ float sh[ROW_THREADS];
    const size_t row = blockIdx.x;
    const float *p = att + row * T;
    float *d = datt + row * T;
    float dot = 0;
    for (int j = threadIdx.x; j < T; j += blockDim.x) dot = __fadd_rn(dot, __fmul_rn(p[j], d[j]));
    dot = block_sum(dot, sh);
    for (int j = threadIdx.x; j < T; j += blockDim.x) d[j] = __fmul_rn(__fmul_rn(p[j], __fsub_rn(d[j], dot)), scale);
}

// dqkv is WRITTEN (dq, dk, dv), as the CPU op's (src/ops/ops.c says why); datt is scratch (left
// holding the score gradients)
static void cuda_attention_backward(const backend *be, float *dqkv, float *datt, const float *dout, const float *qkv,
                                    const float *att, const attn_segment *seg, int D, int H) {
    const int T = seg->seqlen, hd = D / H, ld = 3 * D, nb = seg->nseq;
    if (nb <= 0 || T <= 0) return;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const long long sq = (long long)T * ld, sa = (long long)H * T * T, so = (long long)T * D;
    const float *q0 = qkv + seg->tok_off * (size_t)ld, *g0 = dout + seg->tok_off * (size_t)D;
    float *dq0 = dqkv + seg->tok_off * (size_t)ld;
    for (int h = 0; h < H; h++) {
        const float *q = q0 + h * hd, *g = g0 + h * hd, *a = att + (size_t)h * T * T;
        float *da = datt + (size_t)h * T * T, *dq = dq0 + h * hd;
        // dp (T,T) = dout v^T; dv = p^T dout
        if (cu_gemm_batched(be, "attention", 0, 1, T, T, hd, 1.0f, g, D, so, q + 2 * D, ld, sq, 0.0f, da, T, sa, nb) ||
            cu_gemm_batched(be, "attention", 1, 0, T, hd, T, 1.0f, a, T, sa, g, D, so, 0.0f, dq + 2 * D, ld, sq, nb))
            return;
    }
    k_attn_softmax_bwd<<<(unsigned)((size_t)nb * H * T), ROW_THREADS, 0, stream_of(be)>>>(datt, att, T, scale);
    if (LAUNCHED("attention")) return;
    for (int h = 0; h < H; h++) {
        const float *q = q0 + h * hd, *da = datt + (size_t)h * T * T;
        float *dq = dq0 + h * hd;
        // dq = ds k; dk = ds^T q
        if (cu_gemm_batched(be, "attention", 0, 0, T, hd, T, 1.0f, da, T, sa, q + D, ld, sq, 0.0f, dq, ld, sq, nb) ||
            cu_gemm_batched(be, "attention", 1, 0, T, hd, T, 1.0f, da, T, sa, q, ld, sq, 0.0f, dq + D, ld, sq, nb))
            return;
    }
}

// ---- patchify: images (B,C,HW,HW) <-> patches (B, g*g, C*P*P), inner order (c, py, px)

// the image element of patch element i
__device__ static inline size_t patch_src(size_t i, int C, int HW, int P) {
    const int g = HW / P, np = g * g, pd = C * P * P;
    const int k = (int)(i % pd);
    const size_t bp = i / pd;
    const int p = (int)(bp % np);
    const size_t b = bp / np;
    const int c = k / (P * P), y = (k / P) % P, x = k % P;
    const int py0 = (p / g) * P, px0 = (p % g) * P;
    return ((b * C + c) * HW + py0 + y) * HW + px0 + x;
}
__global__ static void k_patchify_fwd(float *patches, const float *images, size_t n, int C, int HW, int P) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) patches[i] = images[patch_src(i, C, HW, P)];
}
// each image element receives at most one patch element: no two threads write the same float
__global__ static void k_patchify_bwd(float *dimages, const float *dpatches, size_t n, int C, int HW, int P) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t j = patch_src(i, C, HW, P);
    dimages[j] = __fadd_rn(dimages[j], dpatches[i]);
}
static void cuda_patchify_forward(const backend *be, float *patches, const float *images, int B, int C, int HW,
                                  int P) {
    const size_t n = (size_t)B * (HW / P) * (HW / P) * C * P * P;
    if (!n) return;
    k_patchify_fwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(patches, images, n, C, HW, P);
    LAUNCHED("patchify");
}
static void cuda_patchify_backward(const backend *be, float *dimages, const float *dpatches, int B, int C, int HW,
                                   int P) {
    const size_t n = (size_t)B * (HW / P) * (HW / P) * C * P * P;
    if (!n) return;
    k_patchify_bwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(dimages, dpatches, n, C, HW, P);
    LAUNCHED("patchify");
}

// ---- position embeddings: out (B,T,D) += pos (T,D); dpos accumulates the sum over the batch

__global__ static void k_posadd_fwd(float *out, const float *pos, size_t n, size_t td) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fadd_rn(out[i], pos[i % td]);
}
__global__ static void k_posadd_bwd(float *dpos, const float *dout, int B, size_t td) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= td) return;
    float s = 0;
    for (int b = 0; b < B; b++) s = __fadd_rn(s, dout[(size_t)b * td + i]);
    dpos[i] = __fadd_rn(dpos[i], s);
}
static void cuda_posadd_forward(const backend *be, float *out, const float *pos, int B, int T_, int D) {
    const size_t td = (size_t)T_ * D, n = (size_t)B * td;
    if (!n) return;
    k_posadd_fwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(out, pos, n, td);
    LAUNCHED("posadd");
}
static void cuda_posadd_backward(const backend *be, float *dpos, const float *dout, int B, int T_, int D) {
    const size_t td = (size_t)T_ * D;
    if (!td) return;
    k_posadd_bwd<<<cu_blocks(td, 256), 256, 0, stream_of(be)>>>(dpos, dout, B, td);
    LAUNCHED("posadd");
}

// ---- class token: out (B,1+N,D) = [cls; x (B,N,D)]

__global__ static void k_cls_fwd(float *out, const float *cls, const float *x, size_t n, int N, int D) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int c = (int)(i % D);
    const size_t bt = i / D, b = bt / (N + 1);
    const int t = (int)(bt % (N + 1));
    out[i] = t == 0 ? cls[c] : x[(b * N + t - 1) * D + c];
}
// dcls (D) accumulates over the batch in order; dx (B,N,D) accumulates (may be NULL)
__global__ static void k_cls_bwd_cls(float *dcls, const float *dout, int B, int N, int D) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    float v = dcls[c];
    for (int b = 0; b < B; b++) v = __fadd_rn(v, dout[(size_t)b * (N + 1) * D + c]);
    dcls[c] = v;
}
__global__ static void k_cls_bwd_x(float *dx, const float *dout, size_t n, int N, int D) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t nd = (size_t)N * D, b = i / nd;
    dx[i] = __fadd_rn(dx[i], dout[b * (nd + D) + D + i % nd]);
}
static void cuda_cls_forward(const backend *be, float *out, const float *cls, const float *x, int B, int N, int D) {
    const size_t n = (size_t)B * (N + 1) * D;
    if (!n) return;
    k_cls_fwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(out, cls, x, n, N, D);
    LAUNCHED("cls");
}
static void cuda_cls_backward(const backend *be, float *dcls, float *dx, const float *dout, int B, int N, int D) {
    if (B <= 0 || D <= 0) return;
    k_cls_bwd_cls<<<cu_blocks((size_t)D, 128), 128, 0, stream_of(be)>>>(dcls, dout, B, N, D);
    if (LAUNCHED("cls")) return;
    const size_t n = (size_t)B * N * D;
    if (!dx || !n) return;
    k_cls_bwd_x<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(dx, dout, n, N, D);
    LAUNCHED("cls");
}

// ---- pooling: out (B,D) from x (B,T,D): mean over the first lens[b] tokens, token 0, or token
// lens[b]-1 (lens NULL: every token)

// the token a CLS / EOT pool reads; -1 (nothing read) when the length leaves none
__device__ static inline int pool_token(const int32_t *lens, int b, int T_, int kind) {
    const int len = lens ? lens[b] : T_, t = kind == VLMOE_POOL_CLS ? 0 : len - 1;
    return t >= 0 && t < T_ ? t : -1;
}
__global__ static void k_pool_fwd(float *out, const float *x, const int32_t *lens, int B, int T_, int D, int kind) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)B * D) return;
    const int b = (int)(i / D), c = (int)(i % D);
    const float *xb = x + (size_t)b * T_ * D;
    if (kind == VLMOE_POOL_MEAN) {
        const int len = lens ? lens[b] : T_;
        float o = 0;
        for (int t = 0; t < len && t < T_; t++) o = __fadd_rn(o, xb[(size_t)t * D + c]);
        out[i] = __fdiv_rn(o, (float)len);
    } else {
        const int t = pool_token(lens, b, T_, kind);
        out[i] = t >= 0 ? xb[(size_t)t * D + c] : 0.0f;
    }
}
// dx (B,T,D) accumulates
__global__ static void k_pool_bwd(float *dx, const float *dout, const int32_t *lens, int B, int T_, int D, int kind) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)B * T_ * D) return;
    const int c = (int)(i % D);
    const size_t bt = i / D;
    const int b = (int)(bt / T_), t = (int)(bt % T_);
    const float g = dout[(size_t)b * D + c];
    if (kind == VLMOE_POOL_MEAN) {
        const int len = lens ? lens[b] : T_;
        if (t < len) dx[i] = __fadd_rn(dx[i], __fdiv_rn(g, (float)len));
    } else if (t == pool_token(lens, b, T_, kind)) {
        dx[i] = __fadd_rn(dx[i], g);
    }
}
static void cuda_pool_forward(const backend *be, float *out, const float *x, const int32_t *lens, int B, int T_, int D,
                              int kind) {
    const size_t n = (size_t)B * D;
    if (!n) return;
    k_pool_fwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(out, x, lens, B, T_, D, kind);
    LAUNCHED("pool");
}
static void cuda_pool_backward(const backend *be, float *dx, const float *dout, const int32_t *lens, int B, int T_,
                               int D, int kind) {
    const size_t n = (size_t)B * T_ * D;
    if (!n) return;
    k_pool_bwd<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(dx, dout, lens, B, T_, D, kind);
    LAUNCHED("pool");
}

// ---- L2 normalisation: out (N,C) = x / max(|x|, 1e-12), the norm summed in double as the CPU does

__global__ static void k_l2_fwd(float *out, float *norm, const float *x, int C) {
    __shared__ double sh[ROW_THREADS];
    const size_t n = blockIdx.x;
    const float *xr = x + n * C;
    double s = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += (double)xr[c] * xr[c];
    s = block_sum(s, sh);
    float nr = (float)sqrt(s);
    if (nr < 1e-12f) nr = 1e-12f; // torch.nn.functional.normalize's eps
    for (int c = threadIdx.x; c < C; c += blockDim.x) out[n * C + c] = __fdiv_rn(xr[c], nr);
    if (threadIdx.x == 0) norm[n] = nr;
}
// dx accumulates (g - y (y.g)) / norm
__global__ static void k_l2_bwd(float *dx, const float *dout, const float *out, const float *norm, int C) {
    __shared__ float sh[ROW_THREADS];
    const size_t n = blockIdx.x;
    const float *y = out + n * C, *g = dout + n * C;
    float dot = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot = __fadd_rn(dot, __fmul_rn(y[c], g[c]));
    dot = block_sum(dot, sh);
    const float nr = norm[n];
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        dx[n * C + c] = __fadd_rn(dx[n * C + c], __fdiv_rn(__fsub_rn(g[c], __fmul_rn(y[c], dot)), nr));
}
static void cuda_l2norm_forward(const backend *be, float *out, float *norm, const float *x, int N, int C) {
    if (N <= 0) return;
    k_l2_fwd<<<N, ROW_THREADS, 0, stream_of(be)>>>(out, norm, x, C);
    LAUNCHED("l2norm");
}
static void cuda_l2norm_backward(const backend *be, float *dx, const float *dout, const float *out, const float *norm,
                                 int N, int C) {
    if (N <= 0) return;
    k_l2_bwd<<<N, ROW_THREADS, 0, stream_of(be)>>>(dx, dout, out, norm, C);
    LAUNCHED("l2norm");
}

void cuda_fill_nn(backend *be) {
    be->linear_forward = cuda_linear_forward;
    be->linear_backward = cuda_linear_backward;
    be->linear_backward_write = cuda_linear_backward_write;
    be->layernorm_forward = cuda_layernorm_forward;
    be->layernorm_recompute = cuda_layernorm_recompute;
    be->layernorm_backward = cuda_layernorm_backward;
    be->act_forward = cu_act_forward;
    be->act_backward = cu_act_backward;
    be->softmax_forward = cu_softmax_forward;
    be->softmax_backward = cu_softmax_backward;
    be->attention_forward = cuda_attention_forward;
    be->attention_backward = cuda_attention_backward;
    be->patchify_forward = cuda_patchify_forward;
    be->patchify_backward = cuda_patchify_backward;
    be->posadd_forward = cuda_posadd_forward;
    be->posadd_backward = cuda_posadd_backward;
    be->cls_forward = cuda_cls_forward;
    be->cls_backward = cuda_cls_backward;
    be->pool_forward = cuda_pool_forward;
    be->pool_backward = cuda_pool_backward;
    be->l2norm_forward = cuda_l2norm_forward;
    be->l2norm_backward = cuda_l2norm_backward;
}

void cuda_fill_nn_bf16(backend *be) {
    be->linear_forward = bf16_linear_forward;
    be->linear_backward = bf16_linear_backward;
    be->linear_backward_write = bf16_linear_backward_write;
}
