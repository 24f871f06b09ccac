// attn_cpu.h: the fused float attention kernel of the CPU backend (src/ops/attn_cpu.c), which
// ops.c's attention_forward_f32 / attention_backward_f32 try before their reference loops.
// Covered by tests/test_attn_cpu.c (against plain loops in double) and the tests of ops.c.
#ifndef VLMOE_ATTN_CPU_H
#define VLMOE_ATTN_CPU_H
#include "ops/ops.h"

// The same contracts as attention_forward_f32 / attention_backward_f32 (ops.h). Each returns 1
// when it did the work, 0 (having touched nothing) when this build or these shapes need the
// reference loops: neither AVX-512 nor AVX2 with FMA, more than ATTN_FUSED_TMAX positions, or a
// head too wide for the stack tile. The choice depends on the shapes only, never on the thread
// count. The fused backward keeps its scratch on the stack: datt is left as it was.
#define ATTN_FUSED_TMAX 96
// ops.c's attention_backward_f32 takes the fused backward only up to this T. AVX-512: at T 65
// (bench-s's images, batch 64, inputs from L3 or memory) it measured 7% slower than the
// reference's sgemm calls on a loaded machine, though 17% faster with everything in L2, and on a
// quiet one the whole bench-s step was 1% slower with it (1 thread bf16, 2 threads fp32); at T
// 16 (texts) 1.2x faster. AVX2 (a Zen 3, where the reference runs vlmoe's own product): at T 65
// 9.6 against 11.4 ms at 1 thread, 6.0 against 6.8 at 2, best of 5 runs; at T 16 2.0x faster.
#if defined(__AVX512F__)
#define ATTN_FUSED_BWD_TMAX 32
#else
#define ATTN_FUSED_BWD_TMAX ATTN_FUSED_TMAX
#endif
// Number of keys query i may attend to within a sequence of valid length len: all of them, or
// causally those up to i, where a query inside the prefix sees the whole prefix (UniLM).
static inline int key_limit(int i, int len, int causal, int prefix) {
    const int k = i < prefix ? prefix : i + 1;
    return causal && k < len ? k : len;
}

#include "ops/tile8.h"

int attn_fused_forward(float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H);
int attn_fused_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, const attn_segment *seg, int D, int H);
#endif
