// prof.c: the state behind src/core/prof.h. It is process-wide on purpose: a profile measures
// the process, the hooks sit inside kernels that have no context to carry it, and only the
// serial code between parallel regions touches it. Without -DVLMOE_PROFILE nothing calls
// prof_enter, so the totals stay zero.
#include <omp.h>
#include <time.h>

#include "core/prof.h"

static const char *const names[PROF_COUNT] = {
    "matrix products", "attention", "routing", "dispatch/combine", "LayerNorm", "GELU",
    "optimizer", "data/embedding", "losses", "zero/copy", "other ops",
};
static double total[PROF_COUNT], since;
static int current = -1; // the open scope, -1 outside every scope

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

double prof_now(void) { return now(); }

// the product shapes seen since the last reset; past GEMM_SHAPES of them, new ones go uncounted
enum { GEMM_SHAPES = 512 };
static prof_gemm_shape shapes[GEMM_SHAPES];
static int nshapes;

void prof_gemm_add(int ta, int tb, int M, int N, int K, int lda, int ldb, double seconds) {
    // called from inside the products' parallel regions: one thread at a time (unnamed: a named
    // critical section would be a global symbol of the shared library)
#pragma omp critical
    {
        int i = 0;
        while (i < nshapes && !(shapes[i].ta == ta && shapes[i].tb == tb && shapes[i].M == M && shapes[i].N == N &&
                                shapes[i].K == K && shapes[i].lda == lda && shapes[i].ldb == ldb))
            i++;
        if (i == nshapes && nshapes < GEMM_SHAPES)
            shapes[nshapes++] = (prof_gemm_shape){ta, tb, M, N, K, lda, ldb, 0, 0};
        if (i < nshapes) shapes[i].calls++, shapes[i].seconds += seconds;
    }
}

int prof_gemm_read(prof_gemm_shape *out, int max) {
    char taken[GEMM_SHAPES] = {0};
    int n = 0;
    for (; n < max && n < nshapes; n++) { // the largest total not yet taken, the first seen on a tie
        int b = -1;
        for (int i = 0; i < nshapes; i++)
            if (!taken[i] && (b < 0 || shapes[i].seconds > shapes[b].seconds)) b = i;
        taken[b] = 1, out[n] = shapes[b];
    }
    return n;
}

const char *prof_name(prof_cat c) { return c >= 0 && c < PROF_COUNT ? names[c] : "unknown"; }

void prof_read(double *out) {
    for (int i = 0; i < PROF_COUNT; i++) out[i] = total[i];
}

void prof_reset(void) {
    for (int i = 0; i < PROF_COUNT; i++) total[i] = 0;
    nshapes = 0;
}

// Moves the clock from the open scope to c; returns the scope to go back to (-2: ignored).
int prof_enter(prof_cat c) {
    if (omp_in_parallel()) return -2;
    const double t = now();
    if (current >= 0) total[current] += t - since;
    const int prev = current;
    current = c;
    since = t;
    return prev;
}

void prof_leave(int prev) {
    if (prev == -2) return;
    const double t = now();
    if (current >= 0) total[current] += t - since;
    current = prev;
    since = t;
}
