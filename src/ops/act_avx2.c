// act_avx2.c: the activations (GELU erf, GELU tanh, quick GELU) of the fused epilogues and of
// act_forward (src/ops/ops.c) in AVX2 and FMA, two 8-float vectors at a time with their operations
// interleaved, and the same in AVX-512 (below). Compiled from the scalar form (`omp simd`), one
// vector's chain of some 40 dependent operations (the exponential's range reduction and polynomial,
// the division) filled the out-of-order window, so the loop ran at the chain's latency, not the
// vector units' rate: 1.9 ns an element on a Zen 3, 1.3 with two chains side by side. The chains
// are short as they can be: the polynomials' steps are fused multiply-adds, one instruction and one
// latency where a multiply and an add were two, and the sigmoid forms' e^x (vexp_sig) applies one
// power of two and restores no special values. On a Zen 3 (bench/bench_act, ns an element of a row
// in L1), against the multiply-and-add form with vexp: GELU tanh 1.58 -> 0.87 forward and
// 2.03 -> 1.26 with its gradient, quick GELU 1.40 -> 0.76 and 1.86 -> 1.04, GELU erf 2.91 -> 2.19
// and 3.35 -> 2.81. Every operation is the scalar form's, in its order, each fmaf an FMA, so each
// element gets the bits of ops.c's gelu_erf1, act_sig1 and their gradients with vexp_fma, vexp_sig
// and verf (src/core/real.h); tests/test_ops.c compares them on every kind of float. The kernels'
// body (src/ops/act_kernels.h) is compiled twice: for AVX2 and, where the CPU has it, AVX-512 (F
// and DQ), 16 floats a vector, which the *_simd entries below take. On the AMX Xeon
// (bench/bench_act, ns an element of a row in L1), AVX2 -> AVX-512: GELU tanh 0.54 -> 0.38 forward
// and 0.82 -> 0.58 with its gradient, quick GELU 0.43 -> 0.30 and 0.65 -> 0.51, GELU erf
// 1.02 -> 0.57 and 1.78 -> 0.92. The sigmoid forms gain least: their divisions (one a value, two
// with the gradient) take as long a float at either width.
#include <immintrin.h>
#include <stddef.h>

#include "ops/act_avx2.h"
#include "vlmoe.h"

int act_avx2_supported(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// act_simd_avx512(0): the AVX2 kernels even where AVX-512 is there (a test's switch, set while no
// kernel runs)
static int avx512_off;

static inline int has_avx512(void) { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"); }

int act_simd_avx512(int on) {
    avx512_off = !on;
    return has_avx512();
}

static inline int use_avx512(void) { return !avx512_off && has_avx512(); }

// 2 sqrt(2/pi) and the cubic's coefficient, rounded to float as ops.c's (real) casts round them
#define GELU_C ((float)(2 * 0.7978845608028654))
#define GELU_K 0.044715f
#define GELU_K3 ((float)(3 * 0.044715))

// 1/sqrt(2) and 1/sqrt(2 pi), rounded to float as ops.c's casts round them
#define INV_SQRT_2F ((float)0.7071067811865476)
#define INV_SQRT_2PIF ((float)0.3989422804014327)

#define TARGET "avx2,fma"
#define SUF(f) f##_avx2
#define L 8
#define V __m256
#define VI __m256i
#define M __m256
#define F(x) _mm256_set1_ps(x)
#define ADD _mm256_add_ps
#define SUB _mm256_sub_ps
#define MUL _mm256_mul_ps
#define DIV _mm256_div_ps
#define FMA _mm256_fmadd_ps
#define FNMA _mm256_fnmadd_ps
#define MIN _mm256_min_ps
#define MAX _mm256_max_ps
#define XOR _mm256_xor_ps
#define RND _mm256_round_ps
#define CVTT _mm256_cvttps_epi32
#define IADD _mm256_add_epi32
#define ISUB _mm256_sub_epi32
#define IAND _mm256_and_si256
#define ISRA _mm256_srai_epi32
#define ISLL _mm256_slli_epi32
#define ISET _mm256_set1_epi32
#define ASF _mm256_castsi256_ps
#define CMP _mm256_cmp_ps
#define SEL(m, a, b) _mm256_blendv_ps(a, b, m)
#define LD _mm256_loadu_ps
#define ST _mm256_storeu_ps
#define ZERO _mm256_setzero_ps
#define RND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#include "ops/act_kernels.h"
#undef TARGET
#undef SUF
#undef L
#undef V
#undef VI
#undef M
#undef F
#undef ADD
#undef SUB
#undef MUL
#undef DIV
#undef FMA
#undef FNMA
#undef MIN
#undef MAX
#undef XOR
#undef RND
#undef CVTT
#undef IADD
#undef ISUB
#undef IAND
#undef ISRA
#undef ISLL
#undef ISET
#undef ASF
#undef CMP
#undef SEL
#undef LD
#undef ST
#undef ZERO
#undef RND_NEAREST

// AVX-512: roundscale with scale 0 rounds as round_ps does; comparisons give masks
#define TARGET "avx512f,avx512dq"
#define SUF(f) f##_avx512
#define L 16
#define V __m512
#define VI __m512i
#define M __mmask16
#define F(x) _mm512_set1_ps(x)
#define ADD _mm512_add_ps
#define SUB _mm512_sub_ps
#define MUL _mm512_mul_ps
#define DIV _mm512_div_ps
#define FMA _mm512_fmadd_ps
#define FNMA _mm512_fnmadd_ps
#define MIN _mm512_min_ps
#define MAX _mm512_max_ps
#define XOR _mm512_xor_ps
#define RND _mm512_roundscale_ps
#define CVTT _mm512_cvttps_epi32
#define IADD _mm512_add_epi32
#define ISUB _mm512_sub_epi32
#define IAND _mm512_and_si512
#define ISRA _mm512_srai_epi32
#define ISLL _mm512_slli_epi32
#define ISET _mm512_set1_epi32
#define ASF _mm512_castsi512_ps
#define CMP _mm512_cmp_ps_mask
#define SEL(m, a, b) _mm512_mask_blend_ps(m, a, b)
#define LD _mm512_loadu_ps
#define ST _mm512_storeu_ps
#define ZERO _mm512_setzero_ps
#define RND_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#include "ops/act_kernels.h"

int act_bias_simd(float *a, float *h, const float *b, int n, int kind) {
    if (use_avx512()) return act_bias_avx512(a, h, b, n, kind);
    return act_avx2_supported() ? act_bias_avx2(a, h, b, n, kind) : 0;
}

size_t act_simd(float *a, const float *x, size_t n, int kind) {
    if (use_avx512()) return act_avx512(a, x, n, kind);
    return act_avx2_supported() ? act_avx2(a, x, n, kind) : 0;
}

int act_grad_simd(float *g, float *a, const float *h, int n, int kind) {
    if (use_avx512()) return act_grad_avx512(g, a, h, n, kind);
    return act_avx2_supported() ? act_grad_avx2(g, a, h, n, kind) : 0;
}
