// gemm_bf16.h: matrix products with bf16 inputs and fp32 accumulation and output, through
// oneDNN's matmul primitive (brgemm kernels on AVX512_BF16 and AMX CPUs): the products of
// `--precision bf16` on the CPU (src/ops/backend_cpu.c's "cpu-bf16" table). Everything else of
// that mode stays fp32: master weights, optimizer, router, softmax, LayerNorm, losses.
// Covered by tests/test_bf16.c.
#ifndef VLMOE_OPS_GEMM_BF16_H
#define VLMOE_OPS_GEMM_BF16_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// 1 when oneDNN runs bf16 matmuls natively on this CPU (AVX512_BF16 or AMX), else 0: then
// bf16 products would be emulated, slower than fp32, and the caller keeps fp32.
int gemm_bf16_native(void);

// f rounded to bf16 (nearest even; NaN stays a quiet NaN): the one rounding of every operand,
// so an operand rounded by its producer has the bits the product would give it
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); // quiet NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// dst (rows, cols) = src rounded to bf16 (nearest even; NaN stays NaN); src (rows, cols) with
// leading dimension ld, or, with trans, src (cols, rows) read transposed. Threads split the rows.
void bf16_pack(uint16_t *dst, const float *src, int rows, int cols, int ld, int trans);

// C (M,N) = op(A) op(B) + beta C (beta 0 or 1), row-major fp32 with leading dimensions, the
// operands rounded to bf16 and the sums in fp32; threads take fixed blocks of C's rows, so the
// result does not depend on their count. epi (may be NULL) runs on each block of C (rows
// [r0, r0+nr), columns [c0, c0+nc)) on the thread that computed it, right after, with ctx.
// Returns 0, or -1, with C untouched, when oneDNN refuses the shape or memory runs out (the
// caller then computes the product in fp32).
typedef void (*gemm_bf16_epi)(const void *ctx, float *C, int ldc, int r0, int nr, int c0, int nc);
int gemm_bf16(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B, int ldb,
              float beta, float *C, int ldc, gemm_bf16_epi epi, const void *ctx);

// gemm_bf16 (ta 0) with op(A) already rounded by its producer: ah (M,K) row-major bf16 holds
// bf16_of of A's values, so C gets the bits gemm_bf16 would give, without A's rounding pass.
// A (fp32) is read by a block that falls back to fp32; A NULL: such a block reads ah's values
// (the producer then need not write A at all). Returns as gemm_bf16.
int gemm_bf16_pre(int tb, int M, int N, int K, const uint16_t *ah, const float *A, int lda, const float *B, int ldb,
                  float beta, float *C, int ldc, gemm_bf16_epi epi, const void *ctx);
// A B operand (K,N) that its producer writes straight into the blocked bf16 layout the product
// reads, so that no pass reads B back in fp32 to pack it: column blocks of w columns, each kp/2
// rows of w pairs, a pair holding rows 2i (low half) and 2i+1 of one column, rounded by bf16_of.
// gemm_bf16_bpack_begin finds the layout of the product's B and writes its padding (zero pairs
// from row K on, zero columns past N) into this thread's buffer for it (kept until the next
// begin on this thread; the products use other buffers); the producer writes every row below K
// (gemm_bf16_bpack_rows, from any thread, each row once), then gemm_bf16_packed_b runs the
// product. begin returns 0, or -1 when the layout is not one of these or memory runs out: the
// caller then gives B in fp32 to gemm_bf16.
typedef struct { uint32_t *buf; int w, kp, K, N; } gemm_bf16_bpack;
int gemm_bf16_bpack_begin(gemm_bf16_bpack *pb, int M, int N, int K);
// B's columns [c, c+n) of rows k (even) and k+1 (r0, r1: n floats each), or, with r1 NULL,
// of row k alone (k even or odd: its pair's other row is written apart, or is padding)
void gemm_bf16_bpack_rows(const gemm_bf16_bpack *pb, int k, int c, int n, const float *r0, const float *r1);
// gemm_bf16 (ta 1, tb 0, no epilogue: C (M,N) = A^T B + beta C, A (K,M)) with B the producer's
// pb, begun with the same M, N, K: the bits gemm_bf16 gives for B with those values. Returns as
// gemm_bf16 (-1 also when pb is not this product's layout).
int gemm_bf16_packed_b(int M, int N, int K, const float *A, int lda, const gemm_bf16_bpack *pb, float beta, float *C,
                       int ldc);
// n bf16 values of this thread's buffer for such a pre-rounded operand, kept between calls (the
// products use other buffers, so it lives until the next call); NULL when memory runs out
uint16_t *gemm_bf16_side(size_t n);

// The two products of linear_backward_bf16: dinp (N,K) = dout (N,O) . w (O,K) + beta dinp
// (beta 1 accumulates, 0 writes without reading dinp; skipped when dinp is NULL) and dw (O,K) +=
// dout^T . inp (N,K), with dout rounded to bf16 once for both; with db and dinp both given, db
// (O) += colsum(dout) in fp32, summed while dout is rounded (db is left to the caller when dinp
// is NULL). Returns 0, or -1 with none touched (the caller then computes them in fp32).
int gemm_bf16_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                       int N, int K, int O, float beta);

// Weight shadows: packed bf16 copies of weights kept between products. While [lo, lo+n) is
// declared at a version (gemm_bf16_shadow_use), a product whose B lies in it packs B into a
// copy kept for that B and that layout, and later products with the same B and layout reuse
// it as long as the declared version is the one it was packed at. The caller vouches that the
// floats in the range are the same whenever it declares the same version (src/train/trainer.c
// declares the model's weights version during a step, src/nn/model.c changes it on every write
// it knows of). n 0 declares nothing: every product packs its own B again.
uint64_t gemm_bf16_new_version(void); // never returned before in this process, never 0
void gemm_bf16_shadow_use(const float *lo, size_t n, uint64_t version);
// Packs the shadows of B inside [p, p+n) again now, as they are after a write, and marks them
// packed at version: the optimizer calls it after updating a tensor, while it is in cache.
void gemm_bf16_shadow_refresh(const float *p, size_t n, uint64_t version);
// What the products did since the process started (counts, for tests and the benchmark).
typedef struct {
    long products, prim_hits, prim_misses; // primitive lookups of plan: kept or made
    long b_packed, b_reordered;             // B packed by pack_b_block or by oneDNN's reorder
    long shadow_reused, shadow_packed;      // products that read a kept shadow / packed one
    size_t shadow_bytes;                    // memory the shadows hold
} gemm_bf16_counts;
gemm_bf16_counts gemm_bf16_get_counts(void);

// linear_forward_f32 and linear_backward_f32 (src/ops/ops.h) with the products in bf16
// (src/ops/ops.c; same arguments, same accumulation rules).
void linear_forward_bf16(float *out, const float *inp, const float *w, const float *b, int N, int K,
                         int O, int beta);
void linear_backward_bf16(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                          const float *w, int N, int K, int O);
void linear_backward_write_bf16(float *dinp, float *dw, float *db, const float *dout, const float *inp,
                                const float *w, int N, int K, int O);
#endif
