// gemm_int8.h: int8 products for `--precision int8` (inference only) on the CPU: weights
// quantized once, symmetric per output channel; activations quantized per row as the product
// runs; s8 x s8 products through oneDNN's int8 brgemm (VNNI) or our own u8 x s8 AVX2 kernel
// with 7-bit weights (no VNNI), with int32 accumulation and fp32 output, the weight scales and
// the row scales applied after it. Used by the expert banks (and linears) of
// src/ops/backend_cpu.c's cpu-int8 table. Covered by tests/test_int8.c.
#ifndef VLMOE_OPS_GEMM_INT8_H
#define VLMOE_OPS_GEMM_INT8_H
#include <stddef.h>
#include <stdint.h>

// How int8 is multiplied here: INT8_VNNI (AVX512_VNNI or AVX-VNNI: oneDNN's brgemm, one instruction
// per 4 products), INT8_AVX2 (no VNNI, our kernel: vpmaddubsw pairs into 16-bit sums, so the weights keep 7
// bits, int8_weight_max), or 0 (no AVX2: int8 would be no faster than fp32, and the caller
// keeps fp32). oneDNN's ISA cap (DNNL_MAX_CPU_ISA) counts.
enum { INT8_VNNI = 1, INT8_AVX2 = 2 };
int gemm_int8_native(void);
// The weights' quantization range [-w, w]: 127 with VNNI, 63 on AVX2 (a pair of u8 x s7
// products then fits a 16-bit sum).
int int8_weight_max(void);

// Symmetric quantization of rows (rows, K) with leading dimension ld (the activations; weights
// use int8_weight_max in place of 127): scale[i] = max_k |x[i,k]| / 127 and
// q[i,k] = round(x[i,k] / scale[i]) in [-127, 127], so |x - scale q| <= scale / 2.
// An all-zero row gets scale 0 (and q 0); a row holding NaN or infinity gets scale NaN, so its
// products come out NaN as they would in fp32. Threads split the rows.
void int8_quantize_rows(int8_t *q, float *scale, const float *x, int rows, int K, int ld);

// The quantized copies of a model's weights (matrices (rows, K) of the flat parameter buffer),
// found by the address of their fp32 original: what a table's ctx points to. A tensor stacks
// rows/O matrices of O rows each (an expert bank's experts; O = rows for a plain linear), and
// with VNNI each is also kept in the blocked layout oneDNN's int8 brgemm reads (packed once,
// when the weights are quantized: no product repacks its weights); on AVX2 in the panels of
// our kernel (md NULL: 16 rows at a time, four k at a time, zeros past O and K).
// kind INT8_BF16 marks a weight that is not quantized but runs its products in bf16
// (src/ops/gemm_bf16.h): q, scale, packed and wsum are NULL.
enum { INT8_Q8, INT8_BF16 };
typedef struct {
    const float *src;     // the fp32 weights (rows, K) this is a copy of
    size_t rows;
    int K, O, kind;       // O: rows of one matrix (one product's outputs)
    int8_t *q;            // (rows, K)
    float *scale;         // (rows)
    void *packed;         // rows/O matrices of pbytes each in the layout *md (AVX2: the panels), or NULL
    size_t pbytes;        // (the reference product on q)
    void *md;             // the layout (a dnnl_memory_desc_t; NULL for the AVX2 panels)
    int32_t *wsum;        // (rows) each row's sum of q, for the u8 shift (INT8_AVX2; else NULL)
} int8_tensor;

typedef struct {
    int count, cap;
    int8_tensor *t;
} int8_weights;

// Quantizes src (rows, K), rows/O matrices of O rows, into a new entry of w (kind INT8_Q8), or
// records it for bf16 products (INT8_BF16). VLMOE_OK, or an out-of-memory error.
int int8_weights_add(int8_weights *w, const float *src, size_t rows, int K, int O, int kind);
void int8_weights_free(int8_weights *w);
// The entry holding p at the start of one of its rows (NULL if none): *row is that row.
const int8_tensor *int8_weights_find(const int8_weights *w, const float *p, size_t *row);

// out (N,O) = (x quantized per row) . (the matrix of t at row `row`, O rows, scaled per row)^T
// + b, written (beta 0) or added (beta 1); x (N,K) fp32, b (O) or NULL. Element (n,o) is
// xs[n] * (ws[o] * sum_k xq[n,k] wq[o,k]) + b[o] with the sum exact in int32, so the values
// depend on no blocking and no thread count. Returns 0, or -1 when t does not hold an (O,K)
// matrix at row, its scratch memory cannot be had or K > 65536 (out is untouched; the caller
// computes in fp32).
int linear_forward_int8(float *out, const float *x, const int8_tensor *t, size_t row, const float *b, int N,
                        int K, int O, int beta);

// One expert's weights in a bank: fc1 (M,D) at row r1 of t1, fc2 (D,M) at row r2 of t2.
typedef struct {
    const int8_tensor *t1, *t2;
    size_t r1, r2;
    const float *b1, *b2;
} int8_expert;

// The inference forward of a bank of E experts over rows packed by expert (off (E+1)):
// y = act(x.W1^T + b1).W2^T + b2, written (beta 0) or added (beta 1). Each block of an expert's
// rows goes through both products on one thread (quantize, product, scales + bias + activation,
// quantize, product, scales + bias) with its hidden rows in cache, and nothing is kept for a
// backward. Row by row the values of linear_forward_int8, act_forward_f32, linear_forward_int8.
// Returns 0, or -1 as linear_forward_int8 (y untouched).
int experts_forward_int8(float *y, const float *x, const int8_expert *ex, const int32_t *off, int E, int D,
                         int M, int act, int beta);
#endif
