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

const char *prof_name(prof_cat c) { return c >= 0 && c < PROF_COUNT ? names[c] : "unknown"; }

void prof_read(double *out) {
    for (int i = 0; i < PROF_COUNT; i++) out[i] = total[i];
}

void prof_reset(void) {
    for (int i = 0; i < PROF_COUNT; i++) total[i] = 0;
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
