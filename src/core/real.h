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
// exponent bits; within 2 ulp of expf over the clamped range [-87.3, 88.3] (tests/test_ops.c),
// 0 below and a finite value above it; NaN in, NaN out (the exponent bits are computed from a
// clamped copy, so a NaN never reaches the integer conversion, which would be undefined). In
// double, libm's exp: the gradient checks need it exact.
#pragma omp declare simd
static inline real vexp(real x) {
#ifdef VLMOE_REAL_F64
    return exp(x);
#else
    const float xc = x > -87.3f ? (x < 88.3f ? x : 88.3f) : -87.3f; // NaN -> -87.3
    float n = rintf(xc * 1.44269504088896341f);
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return x == x ? p * scale : x;
#endif
}

#endif
