// gemm_bf16.h: matrix products with bf16 inputs and fp32 accumulation and output, through
// oneDNN's matmul primitive (brgemm kernels on AVX512_BF16 and AMX CPUs): the products of
// `--precision bf16` on the CPU (src/ops/backend_cpu.c's "cpu-bf16" table). Everything else of
// that mode stays fp32: master weights, optimizer, router, softmax, LayerNorm, losses.
// Covered by tests/test_bf16.c.
#ifndef VLMOE_OPS_GEMM_BF16_H
#define VLMOE_OPS_GEMM_BF16_H
#include <stddef.h>
#include <stdint.h>

// 1 when oneDNN runs bf16 matmuls natively on this CPU (AVX512_BF16 or AMX), else 0: then
// bf16 products would be emulated, slower than fp32, and the caller keeps fp32.
int gemm_bf16_native(void);

// dst (rows, cols) = src rounded to bf16 (nearest even; NaN stays NaN); src (rows, cols) with
// leading dimension ld, or, with trans, src (cols, rows) read transposed. Threads split the rows.
void bf16_pack(uint16_t *dst, const float *src, int rows, int cols, int ld, int trans);

// C (M,N) = A (M,K) . B + beta C (beta 0 or 1) on one thread: A packed row-major bf16, B
// packed bf16 given by its strides (bs_k, bs_n) (a (K,N) view: (N,1), or (1,K) for a transposed
// (N,K) matrix); C fp32 with leading dimension ldc. Returns 0, or -1 when oneDNN refuses (the
// caller then computes the block in fp32).
int bf16_matmul(int M, int N, int K, const uint16_t *A, const uint16_t *B, long bs_k, long bs_n,
                float beta, float *C, int ldc);

// linear_forward_f32 and linear_backward_f32 (src/ops/ops.h) with the products in bf16
// (src/ops/ops.c; same arguments, same accumulation rules).
void linear_forward_bf16(float *out, const float *inp, const float *w, const float *b, int N, int K,
                         int O, int beta);
void linear_backward_bf16(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                          const float *w, int N, int K, int O);

// A per-thread buffer of n bf16 values, reused by later calls on the same thread (NULL when
// memory runs out).
uint16_t *bf16_scratch(size_t n, int slot);
#endif
