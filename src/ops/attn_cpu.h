// attn_cpu.h: the fused float attention kernel of the CPU backend (src/ops/attn_cpu.c), which
// ops.c's attention_forward_f32 / attention_backward_f32 try before their reference loops.
// Covered by tests/test_attn_cpu.c (against plain loops in double) and the tests of ops.c.
#ifndef VLMOE_ATTN_CPU_H
#define VLMOE_ATTN_CPU_H
#include "ops/ops.h"

// The same contracts as attention_forward_f32 / attention_backward_f32 (ops.h). Each returns 1
// when it did the work, 0 (having touched nothing) when this build or these shapes need the
// reference loops: no AVX-512, more than ATTN_FUSED_TMAX positions, or a head too wide for the
// stack tile. The choice depends on the shapes only, never on the thread count. The fused
// backward keeps its scratch on the stack: datt is left as it was.
#define ATTN_FUSED_TMAX 96
// ops.c's attention_backward_f32 takes the fused backward only up to this T: at T 65 (bench-s's
// images, batch 64, inputs from L3 or memory) it measured 7% slower than the reference's sgemm
// calls on a loaded machine, though 17% faster with everything in L2, and on a quiet one the
// whole bench-s step was 1% slower with it (1 thread bf16, 2 threads fp32); at T 16 (texts)
// 1.2x faster.
#define ATTN_FUSED_BWD_TMAX 32
// Number of keys query i may attend to within a sequence of valid length len: all of them, or
// causally those up to i, where a query inside the prefix sees the whole prefix (UniLM).
static inline int key_limit(int i, int len, int causal, int prefix) {
    const int k = i < prefix ? prefix : i + 1;
    return causal && k < len ? k : len;
}

#if defined(__AVX__)
#include <immintrin.h>
#include <stddef.h>
// An 8x8 float tile transposed through registers: dst[c][r] = src[r][c] for the first nrows rows
// of src, zeros for the rest (a head's last, partial tile), each row of dst stored whole. A
// transpose one element at a time was 1.6% of a 1-thread bench-s step. A copy: the same bits.
static inline void tile8_transpose(float *dst, size_t ldd, const float *src, size_t lds, int nrows) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = i < nrows ? _mm256_loadu_ps(src + i * lds) : _mm256_setzero_ps();
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    // rows 0..3 hold columns 0,1,2,3 of source rows 0-3 (low lanes) and their columns 4-7 (high)
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#endif

int attn_fused_forward(float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H);
int attn_fused_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                        const float *att, const attn_segment *seg, int D, int H);
#endif
