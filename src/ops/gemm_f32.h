// gemm_f32.h: vlmoe's own single-threaded fp32 matrix product for CPUs with AVX2 and FMA3 but no
// AVX-512 (Zen 1-3, Intel client cores): packed operands and a 6x16 register-tile kernel. On such
// a CPU oneDNN's and OpenBLAS's sgemm reach 55-59% of the FMA peak at a training step's shapes
// (bench/bench_sgemm.c); this one reaches more. Covered by tests/test_gemm_f32.c.
#ifndef VLMOE_OPS_GEMM_F32_H
#define VLMOE_OPS_GEMM_F32_H

#include <stddef.h>

// 1 when gemm_f32 is the faster product on this CPU (AVX2 and FMA3, no AVX-512F), else 0: with
// AVX-512 oneDNN's kernels run at ~90% of the peak and stay.
int gemm_f32_preferred(void);

// 1 when this CPU can run gemm_f32 at all (AVX2 and FMA3): the tests run it wherever it can.
int gemm_f32_supported(void);

// C (M,N) = alpha op(A) op(B) + beta C, row-major with leading dimensions; op(A) is (M,K) and
// op(B) (K,N); with beta 0, C is only written (its old values, NaN included, are never read),
// and with alpha 0 (or K 0) neither A nor B is read, as in BLAS.
// Single-threaded. Every element of C is summed the same way whatever M, N and its position:
// K in chunks of 256, each chunk's products added in order, so a row gives the same bits alone
// or inside a larger product. Returns 0, or -1 with C untouched when the packing buffers cannot
// be allocated or the CPU lacks AVX2/FMA3 (the caller then uses another product).
int gemm_f32(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
             const float *B, int ldb, float beta, float *C, int ldc);

// An epilogue: called on a block of C, rows [r0, r0+nr) and columns [c0, c0+nc) of the C that
// gemm_f32_epi was given, once that block's products are all in.
typedef void (*gemm_f32_epi_fn)(const void *ctx, float *C, int ldc, int r0, int nr, int c0, int nc);

// gemm_f32, then epi (may be NULL) over all of C, in blocks of at most 144 rows and 64 columns,
// each run right after the kernel wrote it, while it is in L1 (a bias and activation applied
// this way read and write C once, not again from memory after the product). The blocks cover C
// once, in an order that depends on M, N and K only; on -1 epi has not run.
int gemm_f32_epi(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc, gemm_f32_epi_fn epi,
                 const void *ctx);

// op(B) packed once for several products with it (the row blocks of a product split across
// threads each packed all of it): gemm_f32_pack_b writes columns [j0, j1) of op(B) (K,N) into bp,
// gemm_f32_packed_b_floats(N, K) floats (64-byte aligned for speed), j0 a multiple of 16; threads
// may pack disjoint ranges at once. gemm_f32_epi_packed is gemm_f32_epi with op(B) read from bp:
// the same blocks and sums, so the same bits.
size_t gemm_f32_packed_b_floats(int N, int K);
void gemm_f32_pack_b(float *bp, int tb, const float *B, int ldb, int N, int K, int j0, int j1);
int gemm_f32_epi_packed(int ta, int M, int N, int K, float alpha, const float *A, int lda, const float *bp,
                        float beta, float *C, int ldc, gemm_f32_epi_fn epi, const void *ctx);

#endif
