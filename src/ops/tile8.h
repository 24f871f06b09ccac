// tile8.h: an 8x8 float transpose through AVX registers, shared by the attention kernels'
// copies of K (src/ops/attn_cpu.c, ops.c) and the packing of vlmoe's own product
// (src/ops/gemm_f32.c). Compiled for AVX whatever the build's flags; callers run it only on CPUs
// that have AVX (a -march=native build, or after a run-time check).
#ifndef VLMOE_OPS_TILE8_H
#define VLMOE_OPS_TILE8_H
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <stddef.h>
// An 8x8 float tile transposed through registers: dst[c][r] = src[r][c] for the first nrows rows
// of src, zeros for the rest (a head's last, partial tile), each row of dst stored whole. A
// transpose one element at a time was 1.6% of a 1-thread bench-s step. A copy: the same bits.
__attribute__((target("avx"))) static inline void tile8_transpose(float *dst, size_t ldd, const float *src, size_t lds, int nrows) {
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
#endif
