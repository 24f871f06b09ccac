// core.h: internal helpers shared by every module: status + last-error message, checked size
// arithmetic, the seeded RNG, aligned allocation. Not part of the public API (include/vlmoe.h).
// Covered by tests/test_core.c.
#ifndef VLMOE_CORE_H
#define VLMOE_CORE_H

#include <stddef.h>
#include <stdint.h>
#include "vlmoe.h"

// Records a printf-style message as the calling thread's last error and returns `st`, so a
// failing function can `return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor %s: ...", path, name);`.
int vlmoe_fail(int st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Prefixes the current last-error message with `prefix: ` (used to add file or context names
// as an error travels up the stack).
void vlmoe_error_prefix(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

// Opens path for reading ("rb") only if it is a regular file: the open does not block (O_NONBLOCK:
// a FIFO with no writer would hang a plain open), fstat decides, and only then is the descriptor
// made blocking again. NULL: *why (static text) says why: strerror(errno), or "not a regular
// file (a FIFO)" and the like. Every data, model and config file is opened through it.
#include <stdio.h>
FILE *vlmoe_fopen_regular(const char *path, const char **why);

// Checked size arithmetic: return 0 on success, 1 on overflow (result untouched).
int vlmoe_mul_ok(size_t a, size_t b, size_t *out);
int vlmoe_add_ok(size_t a, size_t b, size_t *out);

// bytes rounded up to whole 64-byte cache lines (less than bytes where that wraps around)
static inline size_t vlmoe_line_bytes(size_t bytes) { return (bytes + 63) & ~(size_t)63; }
// Allocation with 64-byte alignment; returns NULL and sets VLMOE_ERR_NOMEM message on failure.
void *vlmoe_alloc(size_t bytes, const char *what);
// The same allocation (bytes rounded up to whole 64-byte lines, free with free), NULL with no
// message set when memory runs out: for buffers whose callers go on without them (a kept copy,
// scratch with a slower way around).
void *vlmoe_alloc_line(size_t bytes);
void *vlmoe_calloc(size_t bytes, const char *what);
void vlmoe_free_mem(void *p);
// A kept buffer (*buf, *cap bytes) grown to hold at least bytes, on a 64-byte line; what it held
// is not kept. Returns *buf, or NULL (leaving both as they were, no message set) when memory
// runs out: for scratch whose callers have a way around a failure.
void *vlmoe_scratch_grow(void **buf, size_t *cap, size_t bytes);

// Splitmix64-seeded xoshiro256** generator: small, fast and its whole state (4 words) goes into
// the training-state file so resume is exact.
typedef struct { uint64_t s[4]; } vlmoe_rng;
void vlmoe_rng_seed(vlmoe_rng *r, uint64_t seed);
uint64_t vlmoe_rng_u64(vlmoe_rng *r);
double vlmoe_rng_uniform(vlmoe_rng *r);   // [0, 1)
double vlmoe_rng_normal(vlmoe_rng *r);    // N(0, 1), Box-Muller (one draw per call, no cache)
uint32_t vlmoe_rng_below(vlmoe_rng *r, uint32_t n); // uniform in [0, n), unbiased

// Counter-based draws: a pure function of (key, counter), so a value depends on what it is for
// (a token, an expert) and never on how many draws came before. vlmoe_mix64 is splitmix64's
// finaliser; vlmoe_normal_at is N(0,1) by Box-Muller from two mixed words of (key, counter).
uint64_t vlmoe_mix64(uint64_t x);
double vlmoe_normal_at(uint64_t key, uint64_t counter);

#endif
