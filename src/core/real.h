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

// e^x for the elementwise kernels (GELU, sigmoid, softmax). In float it is a branch-free
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
    const float hi = 88.7228317f; // the largest float whose e^x is finite
    const float xc = x > -104.0f ? (x < hi ? x : hi) : -104.0f; // NaN -> -104
    float n = rintf(xc * 1.44269504088896341f);                 // [-150, 128]
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // h = floor(n / 2) in integers: floorf would keep GCC from vectorising the loops that call
    // this (it may raise "inexact", which -ftrapping-math, the default, must preserve)
    const int32_t ni = (int32_t)n, h = (ni - (ni & 1)) / 2;    // [-75, 64]
    uint32_t b1 = (uint32_t)(h + 127) << 23, b2 = (uint32_t)(ni - h + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof(s1));
    memcpy(&s2, &b2, sizeof(s2));
    return x > hi ? (float)INFINITY : x == x ? p * s1 * s2 : x; // (p s1) is exact: one rounding
#endif
}

#endif
