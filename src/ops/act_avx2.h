// act_avx2.h: the activations (VLMOE_ACT_GELU, VLMOE_ACT_GELU_TANH, VLMOE_ACT_QUICK_GELU) in
// AVX2 and FMA or AVX-512, with the bits of ops.c's scalar forms (src/ops/act_avx2.c). Each does
// the first elements, a multiple of 16, and returns how many: the caller does the rest with the
// scalar form. The *_simd entries take AVX-512 (F and DQ) where the CPU has it, else AVX2 and
// FMA, else do nothing (return 0).
#ifndef VLMOE_OPS_ACT_AVX2_H
#define VLMOE_OPS_ACT_AVX2_H

#include <stddef.h>

// 1 when this CPU has AVX2 and FMA, which the *_avx2 functions need
int act_avx2_supported(void);

// For tests and benchmarks: on 0 the *_simd entries take the AVX2 kernels even where AVX-512 is
// there, on 1 AVX-512 again where it is there (the default). Returns 1 when this CPU has AVX-512
// F and DQ.
int act_simd_avx512(int on);

// h[j] += b[j], then a[j] = act(h[j])
int act_bias_simd(float *a, float *h, const float *b, int n, int kind);
int act_bias_avx2(float *a, float *h, const float *b, int n, int kind);

// a[j] = act(x[j]); a may be x
size_t act_simd(float *a, const float *x, size_t n, int kind);
size_t act_avx2(float *a, const float *x, size_t n, int kind);

// g[j] *= act'(h[j]) and a[j] = act(h[j])
int act_grad_simd(float *g, float *a, const float *h, int n, int kind);
int act_grad_avx2(float *g, float *a, const float *h, int n, int kind);

#endif
