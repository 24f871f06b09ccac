// act_avx2.c: the activations (GELU erf, GELU tanh, quick GELU) of the fused epilogues and of
// act_forward (src/ops/ops.c) in AVX2 and FMA, two 8-float vectors at a time with their
// operations interleaved. Compiled from the scalar form (`omp simd`), one vector's chain of some
// 40 dependent operations (the exponential's range reduction and polynomial, the division)
// filled the out-of-order window, so the loop ran at the chain's latency, not the vector units'
// rate: 1.9 ns an element on a Zen 3, 1.3 with two chains side by side. The chains are short
// as they can be: the polynomials' steps are fused multiply-adds, one instruction and one
// latency where a multiply and an add were two, and the sigmoid forms' e^x (vexp_sig) applies
// one power of two and restores no special values. On a Zen 3 (bench/bench_act, ns an element
// of a row in L1), against the multiply-and-add form with vexp: GELU tanh 1.58 -> 0.87 forward
// and 2.03 -> 1.26 with its gradient, quick GELU 1.40 -> 0.76 and 1.86 -> 1.04, GELU erf
// 2.91 -> 2.19 and 3.35 -> 2.81. Every operation is the scalar form's, in its order,
// each fmaf an FMA, so each element gets the bits of ops.c's gelu_erf1, act_sig1 and their
// gradients with vexp_fma, vexp_sig and verf (src/core/real.h); tests/test_ops.c compares them
// on every kind of float.
#include <immintrin.h>
#include <stddef.h>

#include "ops/act_avx2.h"
#include "vlmoe.h"

int act_avx2_supported(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

#define V __m256
#define F(x) _mm256_set1_ps(x)

// 2 sqrt(2/pi) and the cubic's coefficient, rounded to float as ops.c's (real) casts round them
#define GELU_C ((float)(2 * 0.7978845608028654))
#define GELU_K 0.044715f
#define GELU_K3 ((float)(3 * 0.044715))

// c(x), the sigmoid's argument: GELU tanh 2 sqrt(2/pi) (x + k x^3), quick GELU 1.702 x
__attribute__((target("avx2,fma"), always_inline)) static inline V arg(V x, int tanh_form) {
    if (!tanh_form) return _mm256_mul_ps(F(1.702f), x);
    const V x3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(F(GELU_K), x), x), x);
    return _mm256_mul_ps(F(GELU_C), _mm256_add_ps(x, x3));
}

// n = round(c / ln2) and p = e^(c - n ln2) for two vectors of clamped c: exp_frac's fused steps
// (src/core/real.h), each on both
__attribute__((target("avx2,fma"), always_inline)) static inline void frac2(V c0, V c1, V *n0, V *n1, V *p0, V *p1) {
    static const float poly[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    *n0 = _mm256_round_ps(_mm256_mul_ps(c0, F(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *n1 = _mm256_round_ps(_mm256_mul_ps(c1, F(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r0 = _mm256_fmadd_ps(*n0, F(2.12194440e-4f), _mm256_fnmadd_ps(*n0, F(0.693359375f), c0));
    const V r1 = _mm256_fmadd_ps(*n1, F(2.12194440e-4f), _mm256_fnmadd_ps(*n1, F(0.693359375f), c1));
    V q0 = F(1.9875691500e-4f), q1 = q0;
    for (int i = 0; i < 5; i++) {
        q0 = _mm256_fmadd_ps(q0, r0, F(poly[i]));
        q1 = _mm256_fmadd_ps(q1, r1, F(poly[i]));
    }
    *p0 = _mm256_add_ps(_mm256_fmadd_ps(q0, _mm256_mul_ps(r0, r0), r0), F(1.0f));
    *p1 = _mm256_add_ps(_mm256_fmadd_ps(q1, _mm256_mul_ps(r1, r1), r1), F(1.0f));
}

// e^y for two vectors: vexp_fma's steps (src/core/real.h) line by line, each on both. The clamp
// is min then max: the same value as vexp_fma's for every y but NaN, whose result is NaN either way.
__attribute__((target("avx2,fma"), always_inline)) static inline void exp2v(V y0, V y1, V *e0, V *e1) {
    const V hi = F(88.7228317f), lo = F(-104.0f);
    const V c0 = _mm256_max_ps(_mm256_min_ps(y0, hi), lo), c1 = _mm256_max_ps(_mm256_min_ps(y1, hi), lo);
    V n0, n1, p0, p1;
    frac2(c0, c1, &n0, &n1, &p0, &p1);
    // 2^n as 2^h 2^(n-h), h = floor(n / 2)
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(127);
    const __m256i i0 = _mm256_cvttps_epi32(n0), i1 = _mm256_cvttps_epi32(n1);
    const __m256i h0 = _mm256_srai_epi32(_mm256_sub_epi32(i0, _mm256_and_si256(i0, one)), 1);
    const __m256i h1 = _mm256_srai_epi32(_mm256_sub_epi32(i1, _mm256_and_si256(i1, one)), 1);
    const V sa0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h0, bias), 23));
    const V sa1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h1, bias), 23));
    const V sb0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(i0, h0), bias), 23));
    const V sb1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(i1, h1), bias), 23));
    V v0 = _mm256_mul_ps(_mm256_mul_ps(p0, sa0), sb0), v1 = _mm256_mul_ps(_mm256_mul_ps(p1, sa1), sb1);
    // NaN in, NaN out; above ln(FLT_MAX), +inf
    v0 = _mm256_blendv_ps(y0, v0, _mm256_cmp_ps(y0, y0, _CMP_EQ_OQ));
    v1 = _mm256_blendv_ps(y1, v1, _mm256_cmp_ps(y1, y1, _CMP_EQ_OQ));
    *e0 = _mm256_blendv_ps(v0, F(__builtin_inff()), _mm256_cmp_ps(y0, hi, _CMP_GT_OQ));
    *e1 = _mm256_blendv_ps(v1, F(__builtin_inff()), _mm256_cmp_ps(y1, hi, _CMP_GT_OQ));
}

// e^y for two vectors: vexp_sig's steps (src/core/real.h), exp2v's without its second power of
// two and special values; the clamp, max then min, takes a NaN to the low end as vexp_sig's does.
__attribute__((target("avx2,fma"), always_inline)) static inline void exps2(V y0, V y1, V *e0, V *e1) {
    const V lo = F(-87.33f), hi = F(88.37f);
    const V c0 = _mm256_min_ps(_mm256_max_ps(y0, lo), hi), c1 = _mm256_min_ps(_mm256_max_ps(y1, lo), hi);
    V n0, n1, p0, p1;
    frac2(c0, c1, &n0, &n1, &p0, &p1);
    const __m256i bias = _mm256_set1_epi32(127);
    const V s0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n0), bias), 23));
    const V s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n1), bias), 23));
    *e0 = _mm256_mul_ps(p0, s0), *e1 = _mm256_mul_ps(p1, s1);
}

// 1 + e^(-c(x)) for two vectors: act_sig1's and act_sig_grad1's denominator
__attribute__((target("avx2,fma"), always_inline)) static inline void den2(V x0, V x1, int tanh_form, V *d0, V *d1) {
    const V neg = F(-0.0f);
    V e0, e1;
    exps2(_mm256_xor_ps(arg(x0, tanh_form), neg), _mm256_xor_ps(arg(x1, tanh_form), neg), &e0, &e1);
    *d0 = _mm256_add_ps(F(1.0f), e0), *d1 = _mm256_add_ps(F(1.0f), e1);
}

// erf(x) for two vectors: verf's steps (src/core/real.h), each on both
__attribute__((target("avx2,fma"), always_inline)) static inline void erf2v(V x0, V x1, V *e0, V *e1) {
    const V neg = F(-0.0f), zero = _mm256_setzero_ps(), four = F(4.0f), one = F(1.0f);
    const V lt0 = _mm256_cmp_ps(x0, zero, _CMP_LT_OQ), lt1 = _mm256_cmp_ps(x1, zero, _CMP_LT_OQ);
    // |x| as verf takes it (x < 0 ? -x : x keeps -0), then at most 4 (NaN -> 4)
    const V a0 = _mm256_min_ps(_mm256_blendv_ps(x0, _mm256_xor_ps(x0, neg), lt0), four);
    const V a1 = _mm256_min_ps(_mm256_blendv_ps(x1, _mm256_xor_ps(x1, neg), lt1), four);
    const V t0 = _mm256_mul_ps(a0, a0), t1 = _mm256_mul_ps(a1, a1);
    static const float P[] = {1.128969961e-04f, -8.486291626e-04f, 5.221094005e-03f, -2.686541341e-02f,
                              1.128378138e-01f, -3.761263788e-01f, 1.283791661e-01f};
    static const float Q[] = {7.987910067e-06f, -7.635998190e-05f, 4.501156800e-04f, -1.869457890e-03f,
                              5.986477714e-03f, -1.591115445e-02f, 3.719371557e-02f, -7.911061496e-02f,
                              1.543525457e-01f, -2.732107639e-01f, 4.275835752e-01f};
    V p0 = F(-9.752990991e-06f), p1 = p0;
    for (int i = 0; i < 7; i++) {
        p0 = _mm256_fmadd_ps(p0, t0, F(P[i]));
        p1 = _mm256_fmadd_ps(p1, t1, F(P[i]));
    }
    const V u0 = _mm256_sub_ps(a0, one), u1 = _mm256_sub_ps(a1, one);
    V q0 = F(-3.835798736e-07f), q1 = q0;
    for (int i = 0; i < 11; i++) {
        q0 = _mm256_fmadd_ps(q0, u0, F(Q[i]));
        q1 = _mm256_fmadd_ps(q1, u1, F(Q[i]));
    }
    V x0e, x1e; // e^-t, t in [0, 16]: exps2 gives vexp_fma's bits there
    exps2(_mm256_xor_ps(t0, neg), _mm256_xor_ps(t1, neg), &x0e, &x1e);
    const V small0 = _mm256_fmadd_ps(a0, p0, a0), small1 = _mm256_fmadd_ps(a1, p1, a1);
    const V big0 = _mm256_fnmadd_ps(x0e, q0, one), big1 = _mm256_fnmadd_ps(x1e, q1, one);
    V r0 = _mm256_blendv_ps(big0, small0, _mm256_cmp_ps(a0, one, _CMP_LT_OQ));
    V r1 = _mm256_blendv_ps(big1, small1, _mm256_cmp_ps(a1, one, _CMP_LT_OQ));
    r0 = _mm256_blendv_ps(r0, _mm256_xor_ps(r0, neg), lt0), r1 = _mm256_blendv_ps(r1, _mm256_xor_ps(r1, neg), lt1);
    *e0 = _mm256_blendv_ps(x0, r0, _mm256_cmp_ps(x0, x0, _CMP_EQ_OQ)); // NaN in, NaN out
    *e1 = _mm256_blendv_ps(x1, r1, _mm256_cmp_ps(x1, x1, _CMP_EQ_OQ));
}

// 1/sqrt(2) and 1/sqrt(2 pi), rounded to float as ops.c's casts round them
#define INV_SQRT_2F ((float)0.7071067811865476)
#define INV_SQRT_2PIF ((float)0.3989422804014327)

// act(x) for two vectors, any kind: gelu_erf1 or act_sig1
__attribute__((target("avx2,fma"), always_inline)) static inline void act2(V x0, V x1, int kind, V *a0, V *a1) {
    if (kind == VLMOE_ACT_GELU) {
        V e0, e1;
        erf2v(_mm256_mul_ps(x0, F(INV_SQRT_2F)), _mm256_mul_ps(x1, F(INV_SQRT_2F)), &e0, &e1);
        *a0 = _mm256_mul_ps(_mm256_mul_ps(F(0.5f), x0), _mm256_add_ps(F(1.0f), e0));
        *a1 = _mm256_mul_ps(_mm256_mul_ps(F(0.5f), x1), _mm256_add_ps(F(1.0f), e1));
        return;
    }
    V d0, d1;
    den2(x0, x1, kind == VLMOE_ACT_GELU_TANH, &d0, &d1);
    *a0 = _mm256_div_ps(x0, d0), *a1 = _mm256_div_ps(x1, d1);
}

// act'(x) = s + x s (1 - s) c'(x), s = 1 / den, for one vector (after den2 the two chains are
// short and independent, so they need no interleaving by hand)
__attribute__((target("avx2,fma"), always_inline)) static inline V sig_grad1(V x, V den, int tanh_form, V *a) {
    const V s = _mm256_div_ps(F(1.0f), den);
    const V dc = tanh_form ? _mm256_mul_ps(F(GELU_C), _mm256_add_ps(F(1.0f), _mm256_mul_ps(_mm256_mul_ps(F(GELU_K3), x), x)))
                           : F(1.702f);
    *a = _mm256_div_ps(x, den);
    return _mm256_add_ps(s, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_sub_ps(F(1.0f), s)), dc));
}

// act(x) and act'(x) for two vectors: gelu_erf_grad1 or act_sig_grad1
__attribute__((target("avx2,fma"), always_inline)) static inline void grad2(V x0, V x1, int kind, V *a0, V *a1,
                                                                        V *q0, V *q1) {
    if (kind == VLMOE_ACT_GELU) {
        V e0, e1, g0, g1;
        erf2v(_mm256_mul_ps(x0, F(INV_SQRT_2F)), _mm256_mul_ps(x1, F(INV_SQRT_2F)), &e0, &e1);
        exp2v(_mm256_mul_ps(_mm256_mul_ps(F(-0.5f), x0), x0), _mm256_mul_ps(_mm256_mul_ps(F(-0.5f), x1), x1), &g0, &g1);
        const V h0 = _mm256_add_ps(F(1.0f), e0), h1 = _mm256_add_ps(F(1.0f), e1);
        *a0 = _mm256_mul_ps(_mm256_mul_ps(F(0.5f), x0), h0), *a1 = _mm256_mul_ps(_mm256_mul_ps(F(0.5f), x1), h1);
        *q0 = _mm256_add_ps(_mm256_mul_ps(F(0.5f), h0), _mm256_mul_ps(_mm256_mul_ps(x0, F(INV_SQRT_2PIF)), g0));
        *q1 = _mm256_add_ps(_mm256_mul_ps(F(0.5f), h1), _mm256_mul_ps(_mm256_mul_ps(x1, F(INV_SQRT_2PIF)), g1));
        return;
    }
    const int t = kind == VLMOE_ACT_GELU_TANH;
    V d0, d1;
    den2(x0, x1, t, &d0, &d1);
    *q0 = sig_grad1(x0, d0, t, a0), *q1 = sig_grad1(x1, d1, t, a1);
}

__attribute__((target("avx2,fma"))) int act_bias_avx2(float *a, float *h, const float *b, int n, int kind) {
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const V x0 = _mm256_add_ps(_mm256_loadu_ps(h + j), _mm256_loadu_ps(b + j));
        const V x1 = _mm256_add_ps(_mm256_loadu_ps(h + j + 8), _mm256_loadu_ps(b + j + 8));
        _mm256_storeu_ps(h + j, x0), _mm256_storeu_ps(h + j + 8, x1);
        V a0, a1;
        act2(x0, x1, kind, &a0, &a1);
        _mm256_storeu_ps(a + j, a0), _mm256_storeu_ps(a + j + 8, a1);
    }
    return j;
}

__attribute__((target("avx2,fma"))) size_t act_avx2(float *a, const float *x, size_t n, int kind) {
    size_t j = 0;
    for (; j + 16 <= n; j += 16) {
        V a0, a1;
        act2(_mm256_loadu_ps(x + j), _mm256_loadu_ps(x + j + 8), kind, &a0, &a1);
        _mm256_storeu_ps(a + j, a0), _mm256_storeu_ps(a + j + 8, a1);
    }
    return j;
}

__attribute__((target("avx2,fma"))) int act_grad_avx2(float *g, float *a, const float *h, int n, int kind) {
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        V a0, a1, q0, q1;
        grad2(_mm256_loadu_ps(h + j), _mm256_loadu_ps(h + j + 8), kind, &a0, &a1, &q0, &q1);
        _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_loadu_ps(g + j), q0));
        _mm256_storeu_ps(g + j + 8, _mm256_mul_ps(_mm256_loadu_ps(g + j + 8), q1));
        _mm256_storeu_ps(a + j, a0), _mm256_storeu_ps(a + j + 8, a1);
    }
    return j;
}
