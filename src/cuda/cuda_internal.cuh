// cuda_internal.cuh: what the .cu files of the CUDA backend share: the table's context (stream,
// cuBLAS handle, a growable workspace), the checks that turn a failed CUDA or cuBLAS call into a
// vlmoe error naming the op, row-major GEMMs on cuBLAS, deterministic block reductions, and the
// kernels one op group borrows from another (linear, activation, softmax for the experts and
// Soft MoE). Every reduction sums in a fixed order (no float atomics): a run gives the same bits
// as the one before it. Covered by tests/test_backend_ops.c on a machine with a device.
#ifndef VLMOE_CUDA_INTERNAL_CUH
#define VLMOE_CUDA_INTERNAL_CUH
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "core/core.h"
#include "ops/backend.h"
}

// Internal to the library: hidden from libvlmoe.so's export list (tests/check_exports.sh).
#define CU_INTERNAL __attribute__((visibility("hidden")))

typedef vlmoe_backend_f32 backend;

#define NCHUNK 64

#define CUDA_CTX_MAGIC 0x43554441u // "CUDA": backend_cuda_bf16 tells its tables from others'
struct cuda_ctx {
    unsigned magic;
    int device;
    cudaStream_t stream;
    cublasHandle_t blas;
    double *partial;  // (NCHUNK) reduction partials and downloaded scalars on the device
    int *flag;        // (4) flags and counts on the device
    void *ws;         // workspace for ops that need scratch the table does not pass (grows)
    size_t ws_bytes;
    float *parts;     // cu_colsum's partial sums (grows; apart from ws, which its callers may hold)
    size_t parts_bytes;
    // `--precision bf16` (src/cuda/bf16_cuda.cu): the twin table, made on first request, its
    // cuBLAS handle (default math: tensor cores for bf16, still fp32 accumulation) and the
    // rounded operands of one product (grows, like ws)
    backend *f32, *bf16;
    cublasHandle_t blas16;
    uint16_t *ops16;
    size_t ops16_bytes;
    // images as bytes (src/cuda/pixels_cuda.cu): two pinned staging buffers and two device
    // buffers, filled in turn on a copy stream of their own; copied[k] orders the compute stream
    // after slot k's copy, consumed[k] the next copy into slot k after the kernel that read it
    cudaStream_t copy;
    uint8_t *pin[2], *pix[2];
    size_t pix_cap;
    cudaEvent_t copied[2], consumed[2];
    int pix_next, pix_used[2];
    // the route op's keys, values, counts and CUB temp storage (src/cuda/route_cuda.cu; grows
    // like ws, so a step stops allocating once its largest layer has routed)
    void *route_ws;
    size_t route_ws_bytes;
};

static inline cuda_ctx *ctx_of(const backend *be) { return (cuda_ctx *)be->ctx; }
static inline cudaStream_t stream_of(const backend *be) { return ctx_of(be)->stream; }

// Record a failed call as the thread's error naming op; return 1 when it failed.
CU_INTERNAL int cu_failed(cudaError_t e, const char *op, const char *call);
CU_INTERNAL int cublas_failed(cublasStatus_t s, const char *op, const char *call);
#define CK(op, call) cu_failed((call), (op), #call)
// after a kernel launch: a bad configuration is reported at once, naming the op
#define LAUNCHED(op) cu_failed(cudaGetLastError(), (op), "kernel launch")

// A buffer of the context that only grows, with a quarter to spare, at least `bytes` long (NULL
// with the error set, naming op and what). Growing waits for the stream (queued kernels may read
// the old one), so a training step stops allocating once its largest shape has come by.
CU_INTERNAL void *cu_grow(const backend *be, void **buf, size_t *cap, size_t bytes, const char *op,
                          const char *what);
// The workspace, at least `bytes` long (NULL with the error set when it cannot be had). One op
// takes it once and carves it: a second call may move it.
CU_INTERNAL void *cu_workspace(const backend *be, size_t bytes, const char *op);

// Row-major C (M,N) = alpha op(A) op(B) + beta C with leading dimensions (strided views are
// fine), fp32 on cuBLAS with no TF32. Returns 1 on failure (error set, naming op).
CU_INTERNAL int cu_gemm(const backend *be, const char *op, int ta, int tb, int M, int N, int K,
                        float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                        float *C, int ldc);
// The same product with op(A) and op(B) rounded to bf16 (nearest even, src/ops/gemm_bf16.c's
// rounding) into the context's operand buffer, then multiplied by cuBLAS with fp32 accumulation
// and output (alpha 1): the products of the cuda-bf16 table.
CU_INTERNAL int cu_gemm_bf16(const backend *be, const char *op, int ta, int tb, int M, int N, int K,
                             const float *A, int lda, const float *B, int ldb, float beta, float *C,
                             int ldc);
// cu_gemm_bf16 over `batch` products, the i-th at A + i sA, B + i sB, C + i sC, each operand
// packed (lda, ldb their stored widths, sA, sB their sizes): cublasGemmStridedBatchedEx
// (src/cuda/bf16_cuda.cu). Returns 1 (error set) on failure or on operands not so packed.
CU_INTERNAL int cu_gemm_bf16_batched(const backend *be, const char *op, int ta, int tb, int M, int N,
                                     int K, const float *A, int lda, long long sA, const float *B,
                                     int ldb, long long sB, float beta, float *C, int ldc,
                                     long long sC, int batch);
// The same over `batch` products, the i-th at A + i sA, B + i sB, C + i sC.
CU_INTERNAL int cu_gemm_batched(const backend *be, const char *op, int ta, int tb, int M, int N,
                                int K, float alpha, const float *A, int lda, long long sA,
                                const float *B, int ldb, long long sB, float beta, float *C,
                                int ldc, long long sC, int batch);

static inline unsigned cu_blocks(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

// out[g*C + c] += sum over rows r of group g (rows [g*rows, (g+1)*rows)) of in[r*C + c], the
// rows summed in order per column slice: the column sums of bias and LayerNorm gradients. When
// x is given (LayerNorm's weight gradient) the term is in (x - mean_r) rstd_r instead.
CU_INTERNAL void cu_colsum(const backend *be, const char *op, float *out, const float *in,
                           const float *x, const float *mean, const float *rstd, int rows, int C,
                           int groups);

// The ops other files run inside their own (same semantics as the table entries; bf16: the
// products of the cuda-bf16 table, cu_gemm_bf16).
CU_INTERNAL void cu_linear_fwd(const backend *be, int bf16, float *out, const float *inp, const float *w,
                               const float *b, int N, int K, int O, int beta);
CU_INTERNAL void cu_linear_bwd(const backend *be, int bf16, float *dinp, float *dw, float *db,
                               const float *dout, const float *inp, const float *w, int N, int K, int O);
// cu_linear_bwd with dinp = dout.w + beta dinp (beta 0: written, never read)
CU_INTERNAL void cu_linear_bwd_beta(const backend *be, int bf16, float *dinp, float *dw, float *db,
                                    const float *dout, const float *inp, const float *w, int N, int K, int O,
                                    float beta);
CU_INTERNAL void cu_act_forward(const backend *be, float *out, const float *inp, size_t n, int kind);
CU_INTERNAL void cu_act_backward(const backend *be, float *dinp, const float *inp, const float *dout,
                                 size_t n, int kind);
CU_INTERNAL void cu_softmax_forward(const backend *be, float *out, const float *inp, int N, int C);
CU_INTERNAL void cu_softmax_backward(const backend *be, float *dinp, const float *out,
                                     const float *dout, int N, int C);
// dst (C,R) = src (R,C)^T; with add, dst += src^T
CU_INTERNAL void cu_transpose(const backend *be, const char *op, float *dst, const float *src, int R,
                              int C, int add);
// *out (one double on the device) = the sum of in (n doubles) in a fixed order
CU_INTERNAL void cu_sum_doubles(const backend *be, const char *op, double *out, const double *in,
                                size_t n);

// Each file fills its part of the table.
CU_INTERNAL void cuda_fill_nn(backend *be);    // src/cuda/nn_cuda.cu
CU_INTERNAL void cuda_fill_embed(backend *be); // src/cuda/embed_cuda.cu
CU_INTERNAL void cuda_fill_loss(backend *be);  // src/cuda/loss_cuda.cu
CU_INTERNAL void cuda_fill_moe(backend *be);   // src/cuda/moe_cuda.cu
CU_INTERNAL void cuda_fill_route(backend *be); // src/cuda/route_cuda.cu
// the cuda-bf16 table: a copy of the fp32 one whose products these replace
CU_INTERNAL void cuda_fill_nn_bf16(backend *be);
CU_INTERNAL void cuda_fill_moe_bf16(backend *be);
CU_INTERNAL void cuda_bf16_release(cuda_ctx *c); // src/cuda/bf16_cuda.cu
CU_INTERNAL void cuda_fill_pixels(backend *be);     // src/cuda/pixels_cuda.cu
CU_INTERNAL void cuda_pixels_release(cuda_ctx *c);

// ---- device helpers (header-only: each .cu file gets its own copy)

// Sum of v over the block (blockDim.x a power of two <= 1024) in a fixed tree order; every
// thread gets the result. sh holds blockDim.x values of T.
template <typename T>
__device__ static inline T block_sum(T v, T *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) sh[threadIdx.x] = sh[threadIdx.x] + sh[threadIdx.x + k];
        __syncthreads();
    }
    T r = sh[0];
    __syncthreads();
    return r;
}

// Maximum of v over the block (same shape rules as block_sum).
__device__ static inline float block_max(float v, float *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k /= 2) {
        if (threadIdx.x < k) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + k]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

#endif
