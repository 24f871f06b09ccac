// real.h: the scalar type of the compute kernels. Files listed in the Makefile's REAL_SRCS are
// compiled twice: as float (names end in _f32: the library's training path) and, with
// VLMOE_REAL_F64, as double (names end in _f64: the finite-difference gradient checks in
// tests/ need double precision to be meaningful). R(name) gives the suffixed symbol.
#ifndef VLMOE_REAL_H
#define VLMOE_REAL_H
#include <cblas.h>

#ifdef VLMOE_REAL_F64
typedef double real;
#define R(name) name##_f64
#define REXP exp
#define RLOG log
#define RSQRT sqrt
#define RTANH tanh
#define RERF erf
#define RFABS fabs
#else
typedef float real;
#define R(name) name##_f32
#define REXP expf
#define RLOG logf
#define RSQRT sqrtf
#define RTANH tanhf
#define RERF erff
#define RFABS fabsf
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef VLMOE_REAL_F64
// a b + c, rounded once (C99's fmaf) when fused, else as a multiply and an add: the two roundings
// of the exponential's steps below, picked by a constant, so each call site compiles to one form
#define EXP_MADD(fused, a, b, c) ((fused) ? fmaf(a, b, c) : (a) * (b) + (c))

// e^(x - n ln2) for |x - n ln2| <= ln2/2: the reduction in two parts of ln2 and Cephes' degree-6
// polynomial, with fused or with separate multiply-adds
static inline float exp_frac(float x, float n, int fused) {
    const float r = EXP_MADD(fused, n, 2.12194440e-4f, EXP_MADD(fused, -n, 0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = EXP_MADD(fused, p, r, 1.3981999507e-3f);
    p = EXP_MADD(fused, p, r, 8.3334519073e-3f);
    p = EXP_MADD(fused, p, r, 4.1665795894e-2f);
    p = EXP_MADD(fused, p, r, 1.6666665459e-1f);
    p = EXP_MADD(fused, p, r, 5.0000001201e-1f);
    return EXP_MADD(fused, p, r * r, r) + 1.0f;
}
#undef EXP_MADD

// vexp's whole recipe (below), its multiply-adds fused or not
static inline float exp_whole(float x, int fused) {
    const float hi = 88.7228317f; // the largest float whose e^x is finite
    const float xc = x > -104.0f ? (x < hi ? x : hi) : -104.0f; // NaN -> -104
    const float n = rintf(xc * 1.44269504088896341f);           // [-150, 128]
    const float p = exp_frac(xc, n, fused);
    // h = floor(n / 2) in integers: floorf would keep GCC from vectorising the loops that call
    // this (it may raise "inexact", which -ftrapping-math, the default, must preserve)
    const int32_t ni = (int32_t)n, h = (ni - (ni & 1)) / 2; // [-75, 64]
    uint32_t b1 = (uint32_t)(h + 127) << 23, b2 = (uint32_t)(ni - h + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof(s1));
    memcpy(&s2, &b2, sizeof(s2));
    return x > hi ? (float)INFINITY : x == x ? p * s1 * s2 : x; // (p s1) is exact: one rounding
}
#endif

// e^x for the elementwise kernels (the reference attention's softmax; GELU's loops take
// vexp_fma and vexp_sig, below, the same recipe with fused multiply-adds). In float a branch-free
// polynomial that loops marked `omp simd` vectorise (libm's expf is a call per element):
// x = n ln2 + r with |r| <= ln2/2, e^r from Cephes' degree-6 minimax polynomial, 2^n from the
// exponent bits. It follows expf over the whole line (tests/test_ops.c): within 2 ulp where
// the result is normal, the same denormals (2^n is applied as two halves 2^h 2^(n-h), each a
// normal float, so n down to -150 needs no exponent below the format's), 0 below about -103.97
// and -inf, +inf above ln(FLT_MAX) and for +inf, NaN in, NaN out. Every integer the exponent
// bits come from lies in [52, 191]: the clamp to [-104, 88.72] runs first (a NaN becomes
// -104), so no input reaches a negative shift or an out-of-range float-to-int conversion.
// In double, libm's exp: the gradient checks need it exact.
#pragma omp declare simd
static inline real vexp(real x) {
#ifdef VLMOE_REAL_F64
    return exp(x);
#else
    return exp_whole(x, 0);
#endif
}

// vexp with each multiply-add rounded once (C99's fmaf): the same reduction, polynomial, clamps
// and special values, as accurate (tests/test_ops.c holds it to the same bounds), and what the
// AVX2 kernels compute with FMA instructions: attn_cpu.c's exp8 and act_avx2.c's GELU get these
// bits. GELU (erf)'s gradient uses it (ops.c): an FMA is one step of the dependent chain where a
// multiply and an add were two, and the GELU loops run at that chain's latency
// (src/ops/act_avx2.c). Where the compiler targets no FMA (NATIVE=0 builds) fmaf is a libm
// call, so the loops that need speed there (softmax) keep vexp. In double, libm's exp.
#pragma omp declare simd
static inline real vexp_fma(real x) {
#ifdef VLMOE_REAL_F64
    return exp(x);
#else
    return exp_whole(x, 1);
#endif
}

// e^x for a sigmoid's denominator 1 + e^x (GELU tanh, quick GELU), and for verf's e^(-x^2) with
// x^2 <= 16: vexp_fma's steps on x clamped to [-87.33, 88.37] (a NaN to the low end), where n
// runs from -126 to 127 and one power of two 2^n applies it: vexp_fma's bits in that range.
// Below it 1 + e^x is 1 either way; above it e^x stays finite (2.4e38 at most) where vexp_fma
// reaches +inf at 88.72, so x / (1 + e^x) is a tiny number of x's sign where it was -0, and -inf
// at x = -inf where it was NaN. With no special values to restore, the sigmoid forms' loops are
// some 20% shorter. In double, exp.
#pragma omp declare simd
static inline real vexp_sig(real x) {
#ifdef VLMOE_REAL_F64
    return exp(x);
#else
    const float lo = -87.33f, hi = 88.37f;
    const float xc = x > lo ? (x < hi ? x : hi) : lo; // NaN -> lo
    const float n = rintf(xc * 1.44269504088896341f);
    const float p = exp_frac(xc, n, 1);
    const uint32_t b = (uint32_t)((int32_t)n + 127) << 23; // [1, 254]
    float s;
    memcpy(&s, &b, sizeof(s));
    return p * s;
#endif
}

// erf(x) for the GELU loops, as vexp for e^x: libm's erff is a call per element, so in float a
// branch-free form the `omp simd` loops vectorise. |x| < 1: x + x P(x^2); 1 <= |x| < 4:
// 1 - e^(-x^2) Q(|x| - 1), Q fitting erfc(x) e^(x^2); |x| >= 4: +-1 (erff's float value there too).
// P (degree 7) and Q (degree 11) are least-squares fits on Chebyshev nodes against mpmath's erf,
// evaluated with fused multiply-adds and e^(-x^2) by vexp_sig (vexp_fma's bits at x^2 <= 16,
// by a shorter chain), as act_avx2.c's vectors do.
// It follows erf within about 1 ulp (tests/test_ops.c measures it against erf in double, next to
// erff's own error); NaN in, NaN out. In double, libm's erf.
#pragma omp declare simd
static inline real verf(real x) {
#ifdef VLMOE_REAL_F64
    return erf(x);
#else
    const float ax0 = x < 0 ? -x : x, ax = ax0 < 4.0f ? ax0 : 4.0f, t = ax * ax; // NaN -> 4
    float p = -9.752990991e-06f;
    p = fmaf(p, t, 1.128969961e-04f);
    p = fmaf(p, t, -8.486291626e-04f);
    p = fmaf(p, t, 5.221094005e-03f);
    p = fmaf(p, t, -2.686541341e-02f);
    p = fmaf(p, t, 1.128378138e-01f);
    p = fmaf(p, t, -3.761263788e-01f);
    p = fmaf(p, t, 1.283791661e-01f); // 2/sqrt(pi) - 1: x itself carries the leading 1
    const float u = ax - 1.0f;
    float q = -3.835798736e-07f;
    q = fmaf(q, u, 7.987910067e-06f);
    q = fmaf(q, u, -7.635998190e-05f);
    q = fmaf(q, u, 4.501156800e-04f);
    q = fmaf(q, u, -1.869457890e-03f);
    q = fmaf(q, u, 5.986477714e-03f);
    q = fmaf(q, u, -1.591115445e-02f);
    q = fmaf(q, u, 3.719371557e-02f);
    q = fmaf(q, u, -7.911061496e-02f);
    q = fmaf(q, u, 1.543525457e-01f);
    q = fmaf(q, u, -2.732107639e-01f);
    q = fmaf(q, u, 4.275835752e-01f);
    const float r = ax < 1.0f ? fmaf(ax, p, ax) : fmaf(-vexp_sig(-t), q, 1.0f); // -t in [-16, 0]
    return x == x ? (x < 0 ? -r : r) : x;
#endif
}

#endif
