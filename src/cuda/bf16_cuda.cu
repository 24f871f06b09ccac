// bf16_cuda.cu: `--precision bf16 --device cuda`, the "cuda-bf16" table: the fp32 CUDA table with
// the products of linear layers and of the expert bank in bf16 (operands rounded once per
// product, fp32 accumulation and output), and its `fp32` field on the fp32 table for the router:
// the policy of the CPU's cpu-bf16 table (src/ops/backend_cpu.c, src/ops/gemm_bf16.c), with its
// rounding bit for bit, so the two differ only by the order of fp32 accumulation. Master
// weights, optimizer, router, softmax, LayerNorm, losses and Soft MoE stay fp32.
// Covered by tests/test_backend_ops.c (cuda-bf16 rows) and tests/gpu/parity.sh on a device.
#include <string.h>

#include "cuda/cuda_internal.cuh"

#define BK(op, call) cublas_failed((call), (op), #call)

// Nearest even, a NaN kept a quiet NaN: the expression of src/ops/gemm_bf16.c's to_bf16.
__device__ static inline uint16_t to_bf16(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// dst (rows, cols) packed = src (rows, cols) with leading dimension ld, rounded to bf16
__global__ static void k_round(uint16_t *dst, const float *src, size_t rows, size_t cols, size_t ld) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    dst[i] = to_bf16(ld == cols ? src[i] : src[(i / cols) * ld + i % cols]);
}

// The operand buffer, at least n bf16 values (cu_grow: it stops growing once a training step's
// largest product has come by).
static uint16_t *ops_buffer(const backend *be, size_t n, const char *op) {
    cuda_ctx *c = ctx_of(be);
    return (uint16_t *)cu_grow(be, (void **)&c->ops16, &c->ops16_bytes, n * sizeof(uint16_t), op, "bf16 operands");
}

static int round_operand(const backend *be, const char *op, uint16_t *dst, const float *src, int rows, int cols,
                         int ld) {
    const size_t n = (size_t)rows * cols;
    if (!n) return 0;
    k_round<<<cu_blocks(n, 256), 256, 0, stream_of(be)>>>(dst, src, (size_t)rows, (size_t)cols, (size_t)ld);
    return LAUNCHED(op);
}

// Row-major C (M,N) = op(A) op(B) + beta C as cu_gemm, with both operands rounded to bf16 first
// and packed (leading dimension = their stored width); B starts 256 bytes aligned after A, as
// the tensor-core kernels like.
int cu_gemm_bf16(const backend *be, const char *op, int ta, int tb, int M, int N, int K, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return 0;
    const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    const size_t na = ((size_t)ar * ac + 127) & ~(size_t)127, nb = (size_t)br * bc;
    uint16_t *a16 = ops_buffer(be, na + nb + 1, op);
    if (!a16) return 1;
    uint16_t *b16 = a16 + na;
    if (round_operand(be, op, a16, A, ar, ac, lda) || round_operand(be, op, b16, B, br, bc, ldb)) return 1;
    const float one = 1.0f;
    // column-major C^T = op(B)^T op(A)^T, as cu_gemm
    return BK(op, cublasGemmEx(ctx_of(be)->blas16, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                               M, K, &one, b16, CUDA_R_16BF, bc < 1 ? 1 : bc, a16, CUDA_R_16BF, ac < 1 ? 1 : ac,
                               &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The strided-batched twin for the expert bank's (E, R, width) blocks: each operand is packed
// and its batch contiguous, so the whole batch rounds in one launch (A's rounded batch padded to
// 128 values, as above) and cuBLAS multiplies all of it at once.
int cu_gemm_bf16_batched(const backend *be, const char *op, int ta, int tb, int M, int N, int K, const float *A,
                         int lda, long long sA, const float *B, int ldb, long long sB, float beta, float *C, int ldc,
                         long long sC, int batch) {
    if (M <= 0 || N <= 0 || batch <= 0) return 0;
    const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    if (lda != ac || ldb != bc || sA != (long long)ar * ac || sB != (long long)br * bc)
        return vlmoe_fail(VLMOE_ERR_ARG, "CUDA backend, op %s: a batched bf16 product needs packed operands "
                          "(lda %d for %d columns, batch stride %lld for %d x %d)", op, lda, ac, sA, ar, ac), 1;
    const size_t na = ((size_t)sA * batch + 127) & ~(size_t)127, nb = (size_t)sB * batch;
    uint16_t *a16 = ops_buffer(be, na + nb + 1, op);
    if (!a16) return 1;
    uint16_t *b16 = a16 + na;
    if (round_operand(be, op, a16, A, (int)((long long)ar * batch), ac, ac) ||
        round_operand(be, op, b16, B, (int)((long long)br * batch), bc, bc))
        return 1;
    const float one = 1.0f;
    return BK(op, cublasGemmStridedBatchedEx(ctx_of(be)->blas16, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                             ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &one, b16, CUDA_R_16BF,
                                             bc < 1 ? 1 : bc, sB, a16, CUDA_R_16BF, ac < 1 ? 1 : ac, sA, &beta, C,
                                             CUDA_R_32F, ldc, sC, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void cuda_bf16_release(cuda_ctx *c) {
    if (c->blas16) cublasDestroy(c->blas16);
    cudaFree(c->ops16);
    vlmoe_free_mem(c->bf16);
    c->blas16 = NULL, c->ops16 = NULL, c->ops16_bytes = 0, c->bf16 = NULL;
}

// The twin is made once per context and lives as long as it: a model switching precision back
// and forth keeps one table, one cuBLAS handle and one operand buffer.
extern "C" int backend_cuda_bf16(const vlmoe_backend_f32 **out, const vlmoe_backend_f32 *cuda) {
    *out = NULL;
    // a CUDA table by its name, then its context's mark (another table's ctx is another struct)
    cuda_ctx *c = cuda && !cuda->host_memory && !strncmp(cuda->name, "cuda", 4) ? ctx_of(cuda) : NULL;
    if (!c || c->magic != CUDA_CTX_MAGIC || !c->f32)
        return vlmoe_fail(VLMOE_ERR_ARG, "--precision bf16: the %s backend is not a CUDA table",
                          cuda ? cuda->name : "(none)");
    if (c->bf16) return *out = c->bf16, VLMOE_OK;
    // tensor cores for bf16 need the default math mode (the fp32 handle is pedantic: no TF32);
    // the compute type keeps the accumulation in fp32 and the atomics rule keeps runs identical
    if (BK("init bf16", cublasCreate(&c->blas16)) || BK("init bf16", cublasSetStream(c->blas16, c->stream)) ||
        BK("init bf16", cublasSetMathMode(c->blas16, CUBLAS_DEFAULT_MATH)) ||
        BK("init bf16", cublasSetAtomicsMode(c->blas16, CUBLAS_ATOMICS_NOT_ALLOWED)) ||
        BK("init bf16", cublasSetPointerMode(c->blas16, CUBLAS_POINTER_MODE_HOST))) {
        cuda_bf16_release(c);
        return VLMOE_ERR_ARG;
    }
    backend *t = (backend *)vlmoe_calloc(sizeof(backend), "CUDA bf16 backend");
    if (!t) return cuda_bf16_release(c), VLMOE_ERR_NOMEM;
    memcpy(t, c->f32, sizeof(backend));
    t->name = "cuda-bf16";
    t->fp32 = c->f32;
    cuda_fill_nn_bf16(t);
    cuda_fill_moe_bf16(t);
    c->bf16 = t;
    *out = t;
    return VLMOE_OK;
}
