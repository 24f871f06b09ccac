// act_avx2.h: the fused epilogues' sigmoid-form activations (VLMOE_ACT_GELU_TANH,
// VLMOE_ACT_QUICK_GELU) in AVX2, with the bits of ops.c's scalar forms (src/ops/act_avx2.c).
#ifndef VLMOE_OPS_ACT_AVX2_H
#define VLMOE_OPS_ACT_AVX2_H

// 1 when this CPU has AVX2, which the two below need
int act_avx2_supported(void);

// h[j] += b[j], then a[j] = act(h[j]), for j below the returned count (n rounded down to 16):
// the caller does the rest
int act_sig_bias_avx2(float *a, float *h, const float *b, int n, int kind);

// g[j] *= act'(h[j]) and a[j] = act(h[j]), for j below the returned count, as above
int act_sig_grad_avx2(float *g, float *a, const float *h, int n, int kind);

#endif
