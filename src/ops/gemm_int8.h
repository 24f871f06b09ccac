// gemm_int8.h: int8 products for `--precision int8` (inference only) on the CPU: weights
// quantized once, symmetric per output channel; activations quantized per row as the product
// runs; s8 x s8 products through oneDNN's int8 matmul (VNNI) with int32 accumulation and fp32
// output, the weight scales applied by oneDNN and the row scales after it. Used by the expert
// banks of src/ops/backend_cpu.c's cpu-int8 table. Covered by tests/test_int8.c.
#ifndef VLMOE_OPS_GEMM_INT8_H
#define VLMOE_OPS_GEMM_INT8_H
#include <stddef.h>
#include <stdint.h>

// 1 when oneDNN runs int8 matmuls on VNNI instructions here (AVX512_VNNI or AVX-VNNI), else 0:
// without them the int8 products would be no faster than fp32, and the caller keeps fp32.
int gemm_int8_native(void);

// Symmetric quantization of rows (rows, K) with leading dimension ld: scale[i] = max_k |x[i,k]|
// / 127 and q[i,k] = round(x[i,k] / scale[i]) in [-127, 127], so |x - scale q| <= scale / 2.
// An all-zero row gets scale 0 (and q 0); a row holding NaN or infinity gets scale NaN, so its
// products come out NaN as they would in fp32. Threads split the rows.
void int8_quantize_rows(int8_t *q, float *scale, const float *x, int rows, int K, int ld);

// out (N,O) = (x quantized per row) . (wq (O,K) scaled per row by ws)^T + b, written (beta 0)
// or added (beta 1); x (N,K) fp32, b (O) or NULL. Element (n,o) is
// xs[n] * (ws[o] * sum_k xq[n,k] wq[o,k]) + b[o] with the sum exact in int32. Fixed blocks of
// rows or columns, one single-threaded matmul each: the bits do not depend on the thread count.
// Returns 0, or -1 when its scratch memory cannot be had or K > 65536 (out is untouched; the
// caller computes in fp32).
int linear_forward_int8(float *out, const float *x, const int8_t *wq, const float *ws, const float *b,
                        int N, int K, int O, int beta);

// The quantized copies of a model's weights (matrices (rows, K) of the flat parameter buffer),
// found by the address of their fp32 original: what a table's ctx points to.
typedef struct {
    const float *src;     // the fp32 weights (rows, K) this is a copy of
    size_t rows;
    int K;
    int8_t *q;            // (rows, K)
    float *scale;         // (rows)
} int8_tensor;

typedef struct {
    int count, cap;
    int8_tensor *t;
} int8_weights;

// Quantizes src (rows, K) into a new entry of w (VLMOE_OK, or an out-of-memory error).
int int8_weights_add(int8_weights *w, const float *src, size_t rows, int K);
void int8_weights_free(int8_weights *w);
// The entry holding p at the start of one of its rows (NULL if none): *row is that row.
const int8_tensor *int8_weights_find(const int8_weights *w, const float *p, size_t *row);
#endif
