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
#define GEMM cblas_dgemm
#define REXP exp
#define RLOG log
#define RSQRT sqrt
#define RTANH tanh
#define RERF erf
#define RFABS fabs
#else
typedef float real;
#define R(name) name##_f32
#define GEMM cblas_sgemm
#define REXP expf
#define RLOG logf
#define RSQRT sqrtf
#define RTANH tanhf
#define RERF erff
#define RFABS fabsf
#endif

#endif
