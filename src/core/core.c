// core.c: last-error message, checked arithmetic, aligned allocation, the RNG.
// The last error is thread-local (like errno): every library call that fails sets it and returns
// a status, so callers on different threads never see each other's messages. Covered by
// tests/test_core.c.
#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ERR_CAP 1024
static _Thread_local char last_error[ERR_CAP];

const char *vlmoe_last_error(void) { return last_error; }

void vlmoe_clear_error(void) { last_error[0] = 0; }

int vlmoe_fail(int st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, ERR_CAP, fmt, ap);
    va_end(ap);
    return st;
}

void vlmoe_error_prefix(const char *fmt, ...) {
    char prefix[ERR_CAP], old[ERR_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, ERR_CAP, fmt, ap);
    va_end(ap);
    memcpy(old, last_error, ERR_CAP);
    size_t k = strlen(prefix), o = strlen(old);
    if (k > ERR_CAP - 3) k = ERR_CAP - 3;
    if (o > ERR_CAP - 3 - k) o = ERR_CAP - 3 - k;
    memcpy(last_error, prefix, k);
    memcpy(last_error + k, ": ", 2);
    memcpy(last_error + k + 2, old, o);
    last_error[k + 2 + o] = 0;
}

const char *vlmoe_status_name(int st) {
    switch (st) {
    case VLMOE_OK: return "ok";
    case VLMOE_ERR_ARG: return "invalid argument";
    case VLMOE_ERR_NOMEM: return "out of memory";
    case VLMOE_ERR_IO: return "i/o error";
    case VLMOE_ERR_FORMAT: return "bad file format";
    case VLMOE_ERR_CONFIG: return "bad config";
    case VLMOE_ERR_NUMERIC: return "non-finite value";
    default: return "unknown status";
    }
}

int vlmoe_mul_ok(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return 1;
    *out = a * b;
    return 0;
}

int vlmoe_add_ok(size_t a, size_t b, size_t *out) {
    if (b > SIZE_MAX - a) return 1;
    *out = a + b;
    return 0;
}

void *vlmoe_alloc_line(size_t bytes) {
    const size_t n = vlmoe_line_bytes(bytes);
    if (n < bytes) return NULL; // rounding up wrapped around: no such allocation exists
    return aligned_alloc(64, n ? n : 64);
}

void *vlmoe_alloc(size_t bytes, const char *what) {
    void *p = vlmoe_alloc_line(bytes);
    if (!p) vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu bytes for %s", bytes, what);
    return p;
}

void *vlmoe_calloc(size_t bytes, const char *what) {
    void *p = vlmoe_alloc(bytes, what);
    if (p) memset(p, 0, bytes);
    return p;
}

void vlmoe_free_mem(void *p) { free(p); }

void *vlmoe_scratch_grow(void **buf, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return *buf;
    void *p = vlmoe_alloc_line(bytes);
    if (!p) return NULL;
    free(*buf);
    *buf = p, *cap = vlmoe_line_bytes(bytes); // what vlmoe_alloc_line gave
    return p;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void vlmoe_rng_seed(vlmoe_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t vlmoe_rng_u64(vlmoe_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double vlmoe_rng_uniform(vlmoe_rng *r) { return (double)(vlmoe_rng_u64(r) >> 11) * 0x1.0p-53; }

double vlmoe_rng_normal(vlmoe_rng *r) {
    double u1 = vlmoe_rng_uniform(r), u2 = vlmoe_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t vlmoe_mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

double vlmoe_normal_at(uint64_t key, uint64_t counter) {
    const uint64_t a = vlmoe_mix64(key ^ vlmoe_mix64(2 * counter));
    const uint64_t b = vlmoe_mix64(key ^ vlmoe_mix64(2 * counter + 1));
    const double u1 = ((double)(a >> 11) + 1.0) * 0x1.0p-53; // (0, 1]: log stays finite
    const double u2 = (double)(b >> 11) * 0x1.0p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint32_t vlmoe_rng_below(vlmoe_rng *r, uint32_t n) {
    // Lemire's multiply-shift with rejection: unbiased for any n > 0.
    uint64_t m = (uint64_t)(uint32_t)(vlmoe_rng_u64(r) >> 32) * n;
    uint32_t lo = (uint32_t)m;
    if (lo < n) {
        uint32_t t = (uint32_t)(-n) % n;
        while (lo < t) {
            m = (uint64_t)(uint32_t)(vlmoe_rng_u64(r) >> 32) * n;
            lo = (uint32_t)m;
        }
    }
    return (uint32_t)(m >> 32);
}

FILE *vlmoe_fopen_regular(const char *path, const char **why) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return *why = strerror(errno), NULL;
    struct stat sb;
    const char *bad = NULL;
    if (fstat(fd, &sb) != 0) bad = strerror(errno);
    else if (!S_ISREG(sb.st_mode))
        bad = S_ISFIFO(sb.st_mode)  ? "not a regular file (a FIFO)"
              : S_ISDIR(sb.st_mode) ? "not a regular file (a directory)"
              : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "not a regular file (a device)"
              : S_ISSOCK(sb.st_mode) ? "not a regular file (a socket)" : "not a regular file";
    int fl = bad ? 0 : fcntl(fd, F_GETFL);
    if (!bad && (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0)) bad = strerror(errno);
    FILE *f = bad ? NULL : fdopen(fd, "rb");
    if (!f) {
        if (!bad) bad = strerror(errno);
        close(fd);
        *why = bad;
    }
    return f;
}
