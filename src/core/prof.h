// prof.h: the per-op profile of a training step (issue 22): wall time split by kind of work
// (matrix products, attention, routing, dispatch/combine, LayerNorm, GELU, ...). The hooks are
// compiled in only with -DVLMOE_PROFILE (the Makefile builds build/rel/bench/bench_step_prof
// so); otherwise `PROF_SCOPE(c) stmt` is just `stmt` and costs nothing. Time is exclusive: a
// scope inside another (the GEMMs inside an expert MLP) is taken out of the outer one. The same
// build also times the fp32 products one call at a time by shape (PROF_GEMM, below).
#ifndef VLMOE_CORE_PROF_H
#define VLMOE_CORE_PROF_H

typedef enum {
    PROF_MATMUL, PROF_ATTENTION, PROF_ROUTING, PROF_DISPATCH, PROF_LAYERNORM, PROF_GELU,
    PROF_OPTIMIZER, PROF_DATA, PROF_LOSS, PROF_MEMORY, PROF_OTHER, PROF_COUNT
} prof_cat;

const char *prof_name(prof_cat c);
// Seconds spent in each category since the last prof_reset (out: PROF_COUNT entries).
void prof_read(double *out);
void prof_reset(void);
// Open and close a scope. A scope opened inside an OpenMP parallel region is ignored: its
// threads' time belongs to the scope the region runs in.
int prof_enter(prof_cat c);
void prof_leave(int prev);

// The single-threaded fp32 products (ops.c's gemm1) by shape: which shapes the matrix-product
// time goes to, and at what rate each runs (issue 22's "say which shapes and show the
// library's rate"). Summed over calls; a thread's call counts its own wall time, so at T threads
// the totals add up to about T times the products' share of the step. prof_reset clears it.
typedef struct {
    int ta, tb, M, N, K, lda, ldb;
    long calls;
    double seconds;
} prof_gemm_shape;
void prof_gemm_add(int ta, int tb, int M, int N, int K, int lda, int ldb, double seconds);
// Up to max shapes into out, the largest total time first; returns how many.
int prof_gemm_read(prof_gemm_shape *out, int max);
double prof_now(void);

#ifdef VLMOE_PROFILE
// stmt timed and counted as one call of the product (ta, tb, M, N, K, lda, ldb)
#define PROF_GEMM(ta, tb, M, N, K, lda, ldb, stmt)                          \
    do {                                                                    \
        const double prof_gemm_t0_ = prof_now();                            \
        stmt;                                                               \
        prof_gemm_add(ta, tb, M, N, K, lda, ldb, prof_now() - prof_gemm_t0_); \
    } while (0)
#else
#define PROF_GEMM(ta, tb, M, N, K, lda, ldb, stmt) \
    do {                                           \
        stmt;                                      \
    } while (0)
#endif

#ifdef VLMOE_PROFILE
// names made unique by line, so scopes nest without shadowing each other
#define PROF_CAT2(a, b) a##b
#define PROF_CAT(a, b) PROF_CAT2(a, b)
#define PROF_SCOPE(c)                                                                             \
    for (int PROF_CAT(prof_prev_, __LINE__) = prof_enter(c), PROF_CAT(prof_once_, __LINE__) = 1; \
         PROF_CAT(prof_once_, __LINE__);                                                          \
         PROF_CAT(prof_once_, __LINE__) = 0, prof_leave(PROF_CAT(prof_prev_, __LINE__)))
#else
#define PROF_SCOPE(c)
#endif
#endif
