// backend_cuda.cu: the CUDA backend table (src/ops/backend.h), built by `make CUDA=1` in place of
// src/cuda/cuda_stub.c. This file holds what the other .cu files share (context, checks, cuBLAS
// GEMMs in fp32 without TF32, the workspace, fixed-order reductions), device memory (cudaMalloc,
// copies on one stream), the trainer's flat-buffer ops (scale, clamp, AdamW, the sum of squares
// with its finite check) and the MoE row gather, combine and their backward; the model kernels
// live in nn_cuda.cu, embed_cuda.cu, loss_cuda.cu and moe_cuda.cu. Every CUDA and cuBLAS status
// is checked and turned into a vlmoe error naming the op (the library never exits). Covered by
// tests/test_backend_ops.c, whose CUDA rows run only on a machine with a device.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.cuh"

int cu_failed(cudaError_t e, const char *op, const char *call) {
    if (e == cudaSuccess) return 0;
    vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op %s: %s: %s (%s)", op, call, cudaGetErrorString(e),
               cudaGetErrorName(e));
    return 1;
}

int cublas_failed(cublasStatus_t s, const char *op, const char *call) {
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op %s: %s: %s (%s)", op, call, cublasGetStatusString(s),
               cublasGetStatusName(s));
    return 1;
}
#define BK(op, call) cublas_failed((call), (op), #call)

void *cu_grow(const backend *be, void **buf, size_t *cap, size_t bytes, const char *op, const char *what) {
    cuda_ctx *c = ctx_of(be);
    if (bytes <= *cap) return *buf;
    // kernels queued earlier may still read the old buffer
    if (CK(op, cudaStreamSynchronize(c->stream))) return NULL;
    if (*buf && CK(op, cudaFree(*buf))) return NULL;
    *buf = NULL;
    *cap = 0;
    const size_t want = (bytes + (bytes >> 2) + 4095) & ~(size_t)4095; // room to grow a little
    cudaError_t e = cudaMalloc(buf, want);
    if (e != cudaSuccess) {
        *buf = NULL;
        vlmoe_fail(VLMOE_ERR_NOMEM, "CUDA backend, op %s: out of memory for %zu bytes of %s (%s)", op, want, what,
                   cudaGetErrorString(e));
        return NULL;
    }
    *cap = want;
    return *buf;
}

void *cu_workspace(const backend *be, size_t bytes, const char *op) {
    cuda_ctx *c = ctx_of(be);
    return cu_grow(be, &c->ws, &c->ws_bytes, bytes, op, "workspace");
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, the
// transpose flags stay.
int cu_gemm(const backend *be, const char *op, int ta, int tb, int M, int N, int K, float alpha,
            const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return 0;
    // an empty inner dimension (K = 0) reads nothing, but cuBLAS still wants leading dims >= 1
    lda = lda < 1 ? 1 : lda, ldb = ldb < 1 ? 1 : ldb;
    return BK(op, cublasSgemm(ctx_of(be)->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                              N, M, K, &alpha, B, ldb, A, lda, &beta, C, ldc));
}

int cu_gemm_batched(const backend *be, const char *op, int ta, int tb, int M, int N, int K, float alpha,
                    const float *A, int lda, long long sA, const float *B, int ldb, long long sB,
                    float beta, float *C, int ldc, long long sC, int batch) {
    if (M <= 0 || N <= 0 || batch <= 0) return 0;
    lda = lda < 1 ? 1 : lda, ldb = ldb < 1 ? 1 : ldb;
    return BK(op, cublasSgemmStridedBatched(ctx_of(be)->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                            ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, ldb, sB, A,
                                            lda, sA, &beta, C, ldc, sC, batch));
}

// Column sums. The rows split into fixed chunks (at least COLSUM_ROWS rows each, at most
// COLSUM_CHUNKS chunks: a B/16 bias gradient's 12608 rows make 50 chunks, 24 x 50 blocks for 768
// columns where one chunk gave 24 blocks), each a block of 32 columns x 8 row lanes; lane y sums
// rows y, y+8, ... of its chunk in order, the 8 lanes add in lane order, and k_colsum_fold adds the
// chunks' partials in chunk order. The grouping depends on the shape only: the same bits every
// run. A single chunk adds straight into out.
#define COLSUM_ROWS 256
#define COLSUM_CHUNKS 64
__global__ static void k_colsum(float *out, float *part, const float *in, const float *x, const float *mean,
                                const float *rstd, int rows, int C, int per) {
    __shared__ float sh[8][33];
    const int c = blockIdx.x * 32 + threadIdx.x, j = blockIdx.y, g = blockIdx.z;
    const size_t r0 = (size_t)g * rows;
    const int a = j * per, b = a + per < rows ? a + per : rows;
    float s = 0;
    if (c < C)
        for (int r = a + threadIdx.y; r < b; r += 8) {
            const size_t i = (r0 + r) * C + c;
            s = x ? __fadd_rn(s, __fmul_rn(__fmul_rn(in[i], __fsub_rn(x[i], mean[r0 + r])), rstd[r0 + r]))
                  : __fadd_rn(s, in[i]);
        }
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t = sh[0][threadIdx.x];
        for (int k = 1; k < 8; k++) t = __fadd_rn(t, sh[k][threadIdx.x]);
        if (part)
            part[((size_t)g * gridDim.y + j) * C + c] = t;
        else
            out[(size_t)g * C + c] += t;
    }
}
__global__ static void k_colsum_fold(float *out, const float *part, int C, int nchunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, g = blockIdx.y;
    if (c >= C) return;
    const float *p = part + (size_t)g * nchunk * C + c;
    float t = p[0];
    for (int j = 1; j < nchunk; j++) t = __fadd_rn(t, p[(size_t)j * C]);
    out[(size_t)g * C + c] = __fadd_rn(out[(size_t)g * C + c], t);
}
void cu_colsum(const backend *be, const char *op, float *out, const float *in, const float *x,
               const float *mean, const float *rstd, int rows, int C, int groups) {
    if (C <= 0 || groups <= 0 || rows <= 0) return;
    int nchunk = (rows + COLSUM_ROWS - 1) / COLSUM_ROWS;
    nchunk = nchunk > COLSUM_CHUNKS ? COLSUM_CHUNKS : nchunk;
    const int per = (rows + nchunk - 1) / nchunk;
    cuda_ctx *ctx = ctx_of(be);
    float *part = NULL;
    if (nchunk > 1 && !(part = (float *)cu_grow(be, (void **)&ctx->parts, &ctx->parts_bytes,
                                                sizeof(float) * (size_t)groups * nchunk * C, op, "column-sum partials")))
        return;
    cudaStream_t st = stream_of(be);
    k_colsum<<<dim3(cu_blocks((size_t)C, 32), nchunk, groups), dim3(32, 8), 0, st>>>(out, part, in, x, mean, rstd,
                                                                                   rows, C, per);
    if (LAUNCHED(op) || !part) return;
    k_colsum_fold<<<dim3(cu_blocks((size_t)C, 256), groups), 256, 0, st>>>(out, part, C, nchunk);
    LAUNCHED(op);
}

__global__ static void k_transpose(float *dst, const float *src, int R, int C, int add) {
    __shared__ float tile[32][33];
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int k = threadIdx.y; k < 32; k += 8) {
        const int r = r0 + k, c = c0 + threadIdx.x;
        if (r < R && c < C) tile[k][threadIdx.x] = src[(size_t)r * C + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += 8) {
        const int c = c0 + k, r = r0 + threadIdx.x;
        if (r < R && c < C) {
            const size_t i = (size_t)c * R + r;
            dst[i] = add ? __fadd_rn(dst[i], tile[threadIdx.x][k]) : tile[threadIdx.x][k];
        }
    }
}
void cu_transpose(const backend *be, const char *op, float *dst, const float *src, int R, int C, int add) {
    if (R <= 0 || C <= 0) return;
    k_transpose<<<dim3(cu_blocks((size_t)C, 32), cu_blocks((size_t)R, 32)), dim3(32, 8), 0, stream_of(be)>>>(
        dst, src, R, C, add);
    LAUNCHED(op);
}

__global__ static void k_sum_doubles(double *out, const double *in, size_t n) {
    __shared__ double sh[256];
    double s = 0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) *out = s;
}
void cu_sum_doubles(const backend *be, const char *op, double *out, const double *in, size_t n) {
    k_sum_doubles<<<1, 256, 0, stream_of(be)>>>(out, in, n);
    LAUNCHED(op);
}

// An op is supported when every table entry it needs has a device kernel.
static int cuda_supports(const backend *be, be_op op, const void *cfg) {
    switch (op) {
    case BE_OP_LINEAR: return be->linear_forward && be->linear_backward;
    case BE_OP_LAYERNORM: return be->layernorm_forward && be->layernorm_recompute && be->layernorm_backward;
    case BE_OP_ACT: return be->act_forward && be->act_backward;
    case BE_OP_SOFTMAX: return be->softmax_forward && be->softmax_backward;
    case BE_OP_ATTENTION: return be->attention_forward && be->attention_backward;
    case BE_OP_PATCHIFY: return be->patchify_forward && be->patchify_backward;
    case BE_OP_EMBED: return be->embed_forward && be->embed_backward;
    case BE_OP_POSADD: return be->posadd_forward && be->posadd_backward;
    case BE_OP_CLS: return be->cls_forward && be->cls_backward;
    case BE_OP_POOL: return be->pool_forward && be->pool_backward;
    case BE_OP_L2NORM: return be->l2norm_forward && be->l2norm_backward;
    case BE_OP_CONTRASTIVE: return be->contrastive_forward && be->contrastive_backward;
    case BE_OP_XENT: return be->xent_forward && be->xent_backward;
    case BE_OP_GATHER_ROWS: return be->gather_rows && be->gather_rows_backward;
    // the test's dispatch case runs the whole dispatch family under this name
    case BE_OP_COMBINE:
        return be->gather_rows && be->combine_forward && be->combine_backward && be->gather_rows_backward &&
               be->combine_weights && be->combine_weights_backward;
    case BE_OP_COMBINE_WEIGHTS: return be->combine_weights && be->combine_weights_backward;
    case BE_OP_ROUTER_NOISE: return be->router_noise != NULL;
    case BE_OP_AUX_LOSS: return be->aux_loss != NULL;
    // cfg (int *): non-zero for Soft MoE's App. A / App. E variants, which only the CPU has
    case BE_OP_SOFT_MOE: return be->soft_moe_forward && be->soft_moe_backward && !(cfg && *(const int *)cfg);
    case BE_OP_EXPERTS: return be->experts_forward && be->experts_backward;
    case BE_OP_SUMSQ: return be->sumsq != NULL;
    case BE_OP_SCALE: return be->scale != NULL;
    case BE_OP_ADAMW: return be->adamw != NULL;
    case BE_OP_CLAMP: return be->clamp != NULL;
    case BE_OP_PIXELS: return be->pixels_stage && be->pixels_normalize;
    case BE_OP_STEP_SCALARS:
        return be->contrastive_forward_dsc && be->contrastive_backward_dsc && be->sumsq_dev && be->aux_loss_dev;
    // cfg (be_route *): tokens choice in random dispatch order stays on the host (the layer
    // downloads the gates); experts choice has no dispatch order. The fixed layout is wanted:
    // a training step's expert bank is then one strided-batched product, with no download
    case BE_OP_ROUTE: {
        const be_route *r = (const be_route *)cfg;
        return be->route && be->download_bytes && !(r && !r->experts_choice && r->order == VLMOE_ORDER_RANDOM);
    }
    default: return 0;
    }
}

static void *cuda_alloc(const backend *be, size_t bytes, const char *what) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        vlmoe_fail(VLMOE_ERR_NOMEM, "CUDA out of memory for %s: asked %zu bytes, %zu of %zu free (%s)", what,
                   bytes, free_b, total_b, cudaGetErrorString(e));
        return NULL;
    }
    if (CK("alloc", cudaMemsetAsync(p, 0, bytes, stream_of(be)))) return cudaFree(p), (void *)NULL;
    return p;
}
static void cuda_free(const backend *be, void *p) {
    if (p) CK("free", cudaFree(p));
}
static void cuda_upload(const backend *be, float *dst, const float *src, size_t n) {
    if (n) CK("upload", cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyHostToDevice, stream_of(be)));
}
static void cuda_download(const backend *be, float *dst, const float *src, size_t n) {
    if (n && !CK("download", cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToHost, stream_of(be))))
        CK("download", cudaStreamSynchronize(stream_of(be)));
}
static void cuda_download_bytes(const backend *be, void *dst, const void *src, size_t n) {
    if (n && !CK("download_bytes", cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream_of(be))))
        CK("download_bytes", cudaStreamSynchronize(stream_of(be)));
}
// Page-locked host memory (backend.h host_alloc): copies from it are asynchronous DMA, and a
// captured graph may replay them.
static void *cuda_host_alloc(const backend *be, size_t bytes, const char *what) {
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "CUDA page-locked host memory for %s: %zu bytes (%s)", what, bytes,
                   cudaGetErrorString(e));
        return NULL;
    }
    memset(p, 0, bytes ? bytes : 1);
    return p;
}
static void cuda_host_free(const backend *be, void *p) {
    if (p) cudaFreeHost(p);
}
static void cuda_upload_bytes(const backend *be, void *dst, const void *src, size_t n) {
    if (n) CK("upload_bytes", cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_of(be)));
}
static void cuda_zero(const backend *be, float *p, size_t n) {
    if (n) CK("zero", cudaMemsetAsync(p, 0, sizeof(float) * n, stream_of(be)));
}
static void cuda_copy(const backend *be, float *dst, const float *src, size_t n) {
    if (n && dst != src)
        CK("copy", cudaMemcpyAsync(dst, src, sizeof(float) * n, cudaMemcpyDeviceToDevice, stream_of(be)));
}
static int cuda_sync(const backend *be) {
    return CK("sync", cudaStreamSynchronize(stream_of(be))) ? VLMOE_ERR_ARG : VLMOE_OK;
}

__global__ static void k_add(float *dst, const float *src, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __fadd_rn(dst[i], src[i]);
}
static void cuda_add(const backend *be, float *dst, const float *src, size_t n) {
    if (!n) return;
    k_add<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(dst, src, n);
    LAUNCHED("add");
}

__global__ static void k_scale(float *x, size_t n, float s) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(x[i], s);
}
static void cuda_scale(const backend *be, float *x, size_t n, float s) {
    if (!n) return;
    k_scale<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(x, n, s);
    LAUNCHED("scale");
}

__global__ static void k_clamp(float *x, size_t n, float lo, float hi) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] < lo ? lo : x[i] > hi ? hi : x[i];
}
static void cuda_clamp(const backend *be, float *x, size_t n, double lo, double hi) {
    if (!n) return;
    k_clamp<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(x, n, (float)lo, (float)hi);
    LAUNCHED("clamp");
}

// the same expression order as src/ops/backend_cpu.c (no fused multiply-adds: -fmad=false)
__global__ static void k_adamw(float *p, float *m, float *v, const float *g, size_t n, be_adamw a) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float pi = p[i];
    if (a.decay) pi = __fmul_rn(pi, a.shrink);
    const float gi = __fmul_rn(g[i], a.gscale);
    const float mi = __fadd_rn(__fmul_rn(a.b1, m[i]), __fmul_rn(a.ab1, gi));
    const float vi = __fadd_rn(__fmul_rn(a.b2, v[i]), __fmul_rn(__fmul_rn(a.ab2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bc2_sqrt), a.eps);
    p[i] = __fadd_rn(pi, __fdiv_rn(__fmul_rn(a.neg_step, mi), denom));
}
static void cuda_adamw(const backend *be, float *p, float *m, float *v, const float *g, size_t n,
                       const be_adamw *a) {
    if (!n) return;
    k_adamw<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(p, m, v, g, n, *a);
    LAUNCHED("adamw");
}

// One block per chunk of the CPU's chunking, summed in double in a fixed tree order: the bits do
// not depend on scheduling (they may differ from the CPU's sequential sum in the last places).
// Each thread keeps SUMSQ_ILP sums over interleaved elements, so that many loads are in flight:
// with one, 64 blocks read the gradients at about 50 GB/s (8 ms a step at B/16 on an H100).
#define SUMSQ_THREADS 1024
#define SUMSQ_ILP 4
__global__ static void k_sumsq(double *partial, int *flag, const float *x, size_t n, size_t per) {
    __shared__ double s[SUMSQ_THREADS];
    const size_t a = blockIdx.x * per < n ? blockIdx.x * per : n, b = a + per < n ? a + per : n;
    double acc[SUMSQ_ILP] = {0};
    const size_t step = (size_t)SUMSQ_ILP * blockDim.x;
    size_t i = a + threadIdx.x;
    for (; i + (SUMSQ_ILP - 1) * blockDim.x < b; i += step)
#pragma unroll
        for (int j = 0; j < SUMSQ_ILP; j++) {
            const double v = x[i + j * blockDim.x];
            acc[j] += v * v;
        }
    for (int j = 0; i < b; i += blockDim.x, j++) acc[j] += (double)x[i] * x[i];
    double sum = 0;
    for (int j = 0; j < SUMSQ_ILP; j++) sum += acc[j];
    sum = block_sum(sum, s);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = sum;
        if (!isfinite(sum)) *flag = 1;
    }
}
static double cuda_sumsq(const backend *be, const float *x, size_t n, int *nonfinite) {
    cuda_ctx *c = ctx_of(be);
    double part[NCHUNK];
    int flag = 0;
    const size_t per = (n + NCHUNK - 1) / NCHUNK;
    if (CK("sumsq", cudaMemsetAsync(c->flag, 0, sizeof(int), c->stream))) return NAN;
    if (n) {
        k_sumsq<<<NCHUNK, SUMSQ_THREADS, 0, c->stream>>>(c->partial, c->flag, x, n, per ? per : 1);
        if (LAUNCHED("sumsq")) return NAN;
    }
    if (CK("sumsq", cudaMemcpyAsync(part, c->partial, sizeof(part), cudaMemcpyDeviceToHost, c->stream)) ||
        CK("sumsq", cudaMemcpyAsync(&flag, c->flag, sizeof(int), cudaMemcpyDeviceToHost, c->stream)) ||
        CK("sumsq", cudaStreamSynchronize(c->stream)))
        return NAN;
    double sum = 0;
    for (int k = 0; k < NCHUNK && n; k++) sum += part[k];
    if (nonfinite) *nonfinite = flag;
    return sum;
}

// cuda_sumsq's host fold on the device: the chunks' partials added in chunk order, in double
__global__ static void k_sumsq_out(double *out, const double *partial, const int *flag, int nchunk) {
    double sum = 0;
    for (int k = 0; k < nchunk; k++) sum += partial[k];
    out[0] = sum;
    out[1] = *flag ? 1.0 : 0.0;
}
static void cuda_sumsq_dev(const backend *be, const float *x, size_t n, double *out) {
    cuda_ctx *c = ctx_of(be);
    const size_t per = (n + NCHUNK - 1) / NCHUNK;
    if (CK("sumsq", cudaMemsetAsync(c->flag, 0, sizeof(int), c->stream))) return;
    if (n) {
        k_sumsq<<<NCHUNK, SUMSQ_THREADS, 0, c->stream>>>(c->partial, c->flag, x, n, per ? per : 1);
        if (LAUNCHED("sumsq")) return;
    }
    k_sumsq_out<<<1, 1, 0, c->stream>>>(out, c->partial, c->flag, n ? NCHUNK : 0);
    LAUNCHED("sumsq");
}

__global__ static void k_gather_rows(float *dst, const float *src, const int32_t *idx, int rows, int D) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int i = idx[r]; // -1: a padding row of the fixed layout, zeros
    for (int k = threadIdx.x; k < D; k += blockDim.x) dst[(size_t)r * D + k] = i < 0 ? 0.0f : src[(size_t)i * D + k];
}
static void cuda_gather_rows(const backend *be, float *dst, const float *src, const int32_t *idx, int rows, int D) {
    if (rows <= 0) return;
    k_gather_rows<<<rows, 128, 0, stream_of(be)>>>(dst, src, idx, rows, D);
    LAUNCHED("gather_rows");
}

// one block per token: its rows in row order, so no atomics and the same sum every run
__global__ static void k_combine(float *out, const float *y, const float *w, be_dispatch d, int D) {
    const int t = blockIdx.x;
    if (t >= d.n) return;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        float o = out[(size_t)t * D + k];
        for (int j = d.tok_off[t]; j < d.tok_off[t + 1]; j++) {
            const int r = d.tok_rows[j];
            o = __fadd_rn(o, __fmul_rn(w[r], y[(size_t)r * D + k]));
        }
        out[(size_t)t * D + k] = o;
    }
}
static void cuda_combine_forward(const backend *be, float *out, const float *y, const float *w,
                                 const be_dispatch *d, int D) {
    if (d->n <= 0) return;
    k_combine<<<d->n, 128, 0, stream_of(be)>>>(out, y, w, *d, D);
    LAUNCHED("combine");
}

__global__ static void k_gather_back(float *dx, const float *dxp, be_dispatch d, int D) {
    const int t = blockIdx.x;
    if (t >= d.n) return;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        float o = dx[(size_t)t * D + k];
        for (int j = d.tok_off[t]; j < d.tok_off[t + 1]; j++) o = __fadd_rn(o, dxp[(size_t)d.tok_rows[j] * D + k]);
        dx[(size_t)t * D + k] = o;
    }
}
static void cuda_gather_rows_backward(const backend *be, float *dx, const float *dxp, const be_dispatch *d, int D) {
    if (d->n <= 0) return;
    k_gather_back<<<d->n, 128, 0, stream_of(be)>>>(dx, dxp, *d, D);
    LAUNCHED("gather_rows");
}

__global__ static void k_combine_back(float *dy, float *dw, const float *dout, const float *y, const float *w,
                                      be_dispatch d, int D) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= d.rows) return; // one thread per row: the dot product in CPU order
    if (d.row_token[r] < 0) { // a padding row: no token, so no gradient into its expert
        for (int k = 0; k < D; k++) dy[(size_t)r * D + k] = 0.0f;
        dw[r] = 0.0f;
        return;
    }
    const float *g = dout + (size_t)d.row_token[r] * D, *yr = y + (size_t)r * D;
    float dot = 0;
    for (int k = 0; k < D; k++) {
        dy[(size_t)r * D + k] = __fmul_rn(w[r], g[k]);
        dot = __fadd_rn(dot, __fmul_rn(g[k], yr[k]));
    }
    dw[r] = dot;
}
static void cuda_combine_backward(const backend *be, float *dy, float *dw, const float *dout, const float *y,
                                  const float *w, const be_dispatch *d, int D) {
    if (d->rows <= 0) return;
    k_combine_back<<<cu_blocks((size_t)d->rows, 128), 128, 0, stream_of(be)>>>(dy, dw, dout, y, w, *d, D);
    LAUNCHED("combine");
}

static void ctx_release(cuda_ctx *c) {
    if (!c) return;
    cuda_bf16_release(c);
    cuda_pixels_release(c);
    if (c->blas) cublasDestroy(c->blas);
    cudaFree(c->partial);
    cudaFree(c->flag);
    cudaFree(c->ws);
    cudaFree(c->parts);
    cudaFree(c->route_ws);
    if (c->stream) cudaStreamDestroy(c->stream);
}

extern "C" int backend_cuda_init(vlmoe_backend_f32 **out, int device) {
    *out = NULL;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess)
        return vlmoe_fail(VLMOE_ERR_ARG, "device cuda:%d: no usable CUDA device (%s)", device, cudaGetErrorString(e));
    if (device < 0 || device >= count)
        return vlmoe_fail(VLMOE_ERR_ARG, "device cuda:%d: this machine has %d CUDA device(s)", device, count);
    if (CK("init", cudaSetDevice(device))) return VLMOE_ERR_ARG;
    backend *be = (backend *)vlmoe_calloc(sizeof(backend), "CUDA backend");
    cuda_ctx *c = (cuda_ctx *)vlmoe_calloc(sizeof(cuda_ctx), "CUDA backend");
    if (!be || !c) return vlmoe_free_mem(be), vlmoe_free_mem(c), VLMOE_ERR_NOMEM;
    c->magic = CUDA_CTX_MAGIC;
    c->device = device;
    // fp32 products in fp32: the pedantic mode rules out TF32 and any reduced-precision path
    if (CK("init", cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) ||
        CK("init", cudaMalloc((void **)&c->partial, sizeof(double) * NCHUNK)) ||
        CK("init", cudaMalloc((void **)&c->flag, sizeof(int) * 4)) || BK("init", cublasCreate(&c->blas)) ||
        BK("init", cublasSetStream(c->blas, c->stream)) ||
        BK("init", cublasSetMathMode(c->blas, CUBLAS_PEDANTIC_MATH)) ||
        BK("init", cublasSetAtomicsMode(c->blas, CUBLAS_ATOMICS_NOT_ALLOWED)) ||
        BK("init", cublasSetPointerMode(c->blas, CUBLAS_POINTER_MODE_HOST))) {
        ctx_release(c);
        vlmoe_free_mem(be);
        vlmoe_free_mem(c);
        return VLMOE_ERR_ARG;
    }
    c->f32 = be;
    be->name = "cuda";
    be->host_memory = 0; // device memory: host arrays are uploaded
    be->ctx = c;
    be->supports = cuda_supports;
    be->alloc = cuda_alloc;
    be->free = cuda_free;
    be->upload = cuda_upload;
    be->download = cuda_download;
    be->upload_bytes = cuda_upload_bytes;
    be->host_alloc = cuda_host_alloc;
    be->host_free = cuda_host_free;
    be->download_bytes = cuda_download_bytes;
    be->zero = cuda_zero;
    be->copy = cuda_copy;
    be->add = cuda_add;
    be->sync = cuda_sync;
    be->gather_rows = cuda_gather_rows;
    be->combine_forward = cuda_combine_forward;
    be->combine_backward = cuda_combine_backward;
    be->gather_rows_backward = cuda_gather_rows_backward;
    be->sumsq = cuda_sumsq;
    be->sumsq_dev = cuda_sumsq_dev;
    be->scale = cuda_scale;
    be->adamw = cuda_adamw;
    be->clamp = cuda_clamp;
    cuda_fill_nn(be);
    cuda_fill_embed(be);
    cuda_fill_loss(be);
    cuda_fill_moe(be);
    cuda_fill_pixels(be);
    cuda_fill_route(be);
    *out = be;
    return VLMOE_OK;
}

// be: the fp32 table or its bf16 twin; both go, with the context they share
extern "C" void backend_cuda_free(vlmoe_backend_f32 *be) {
    if (!be) return;
    cuda_ctx *c = ctx_of(be);
    backend *f32 = c ? c->f32 : be;
    if (c) cudaStreamSynchronize(c->stream);
    ctx_release(c);
    vlmoe_free_mem(c);
    vlmoe_free_mem(f32);
}
