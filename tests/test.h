// test.h: the tiny harness every tests/test_*.c uses. CHECK records a failure with file:line and
// a message and goes on; a test binary exits non-zero if anything failed and prints
// "name: N passed, N failed" so tests/run.sh can total the suite.
#ifndef VLMOE_TEST_H
#define VLMOE_TEST_H
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "core/core.h"

static int t_pass, t_fail;

#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (cond) {                                                                       \
            t_pass++;                                                                     \
        } else {                                                                          \
            t_fail++;                                                                     \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);              \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fprintf(stderr, "\n");                                                        \
        }                                                                                 \
    } while (0)

// Relative-or-absolute closeness: |a-b| <= atol + rtol*|b|.
#define CHECK_CLOSE(a, b, atol, rtol, what)                                               \
    do {                                                                                  \
        double ca_ = (double)(a), cb_ = (double)(b);                                      \
        CHECK(fabs(ca_ - cb_) <= (atol) + (rtol)*fabs(cb_), "%s: got %.9g expected %.9g", \
              what, ca_, cb_);                                                            \
    } while (0)

static inline int test_summary(const char *name) {
    printf("%s: %d passed, %d failed\n", name, t_pass, t_fail);
    return t_fail ? 1 : 0;
}

// Central difference of loss(ctx) along a random unit direction v (n values, drawn from r) of
// the parameters x, against the analytic gradient g: *fd and *gv get both directional
// derivatives; returns their relative difference. x is restored.
typedef double (*test_loss_fn)(void *ctx);
static inline double test_fd_direction(double *x, const double *g, double *v, size_t n, double h,
                                       test_loss_fn loss, void *ctx, vlmoe_rng *r, double *fd, double *gv) {
    double vn = 0, dot = 0;
    for (size_t i = 0; i < n; i++) v[i] = vlmoe_rng_normal(r), vn += v[i] * v[i];
    for (size_t i = 0; i < n; i++) v[i] /= sqrt(vn), dot += v[i] * g[i];
    for (size_t i = 0; i < n; i++) x[i] += h * v[i];
    const double lp = loss(ctx);
    for (size_t i = 0; i < n; i++) x[i] -= 2 * h * v[i];
    const double lm = loss(ctx);
    for (size_t i = 0; i < n; i++) x[i] += h * v[i];
    *fd = (lp - lm) / (2 * h), *gv = dot;
    return fabs(*fd - dot) / (1e-7 + fabs(*fd) + fabs(dot));
}

// What test_fd_direction's central difference cannot resolve: the loss's last bits (its value
// rounded, and summed over many terms in an order the kernels choose) divided by 2h, times 8. A
// tensor whose directional derivative is tiny (an expert's bias the test batch barely reaches,
// ~3e-5) otherwise fails the relative check on rounding alone: on a Zen 3 the one fc1.bias of the
// image-text case measured 5.5e-7 in the optimised build and 1.3e-6 under ASan (-O1 sums in
// another order), an absolute difference of 8e-11 against this floor's 8.5e-10 (loss 4.76, h 1e-5).
static inline double test_fd_noise(double loss, double h) { return 8 * DBL_EPSILON * fabs(loss) / h; }

// The vlmoe binary a CLI test runs: $VLMOE_BIN, or $VLMOE_BIN_ASAN for a test built in
// build/asan, made absolute into abs (PATH_MAX bytes); NULL, and a failed check, if unset or missing.
static inline const char *test_vlmoe_bin(const char *argv0, char *abs) {
    const char *b = getenv(strstr(argv0, "/asan/") ? "VLMOE_BIN_ASAN" : "VLMOE_BIN");
    if (b && realpath(b, abs)) return abs;
    CHECK(0, "set VLMOE_BIN / VLMOE_BIN_ASAN to the vlmoe binary (make test does)");
    return NULL;
}

// Runs `BIN ARGS` in folder dir; its stdout (and stderr when fold) in out (NUL-terminated, at
// most cap - 1 bytes); returns the exit status (-1 if it did not exit normally).
static inline int test_run_in(const char *dir, const char *bin, const char *args, int fold, char *out, size_t cap) {
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "cd %s && %s %s %s", dir, bin, args, fold ? "2>&1" : "2>/dev/null");
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, cap - 1, p) : 0;
    out[n] = 0;
    char rest[4096]; // the output past cap is read and dropped, so the command never dies of SIGPIPE
    while (p && fread(rest, 1, sizeof(rest), p) > 0) {}
    int st = p ? pclose(p) : -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Runs `BIN ARGS` in dir with stderr folded into out; a failed check unless it exits with status
// and its output holds needle. Returns the exit status.
static inline int test_expect_in(const char *dir, const char *bin, const char *args, int status, const char *needle,
                                 char *out, size_t cap) {
    const int st = test_run_in(dir, bin, args, 1, out, cap);
    CHECK(st == status && strstr(out, needle), "`vlmoe %s`: exit %d (want %d), output lacks \"%s\":\n%s", args, st,
          status, needle, out);
    return st;
}

// Writes n bytes to path; a failure is a failed check.
// dir/rel, in one of a few rotating buffers (so a call can take several paths)
static inline const char *test_path(const char *dir, const char *rel) {
    static char bufs[8][512];
    static int k;
    char *b = bufs[k++ & 7];
    snprintf(b, 512, "%s/%s", dir, rel);
    return b;
}

static inline void test_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "cannot create %s", path);
    if (!f) return;
    if (n) CHECK(fwrite(data, 1, n, f) == n, "short write %s", path);
    fclose(f);
}

// The whole file, NUL-terminated (malloc'd; NULL if it cannot be read); *n gets its size.
static inline char *test_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (n) *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(len > 0 ? (size_t)len + 1 : 1);
    size_t got = b && len > 0 ? fread(b, 1, (size_t)len, f) : 0;
    fclose(f);
    if (b) b[got] = 0;
    if (n) *n = got;
    return b;
}

// Removes "key" from a params.json as vlmoe writes it (one key and value a line, not the first
// key), as a run written before the key existed would lack it; a failed check if it is not there.
static inline void test_json_drop_key(const char *path, const char *key) {
    char *j = test_read_file(path, NULL), pat[128];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    char *at = j ? strstr(j, pat) : NULL, *from = at, *to = at ? strchr(at, '\n') : NULL;
    CHECK(at && to && to > at, "%s: no key %s to remove", path, key);
    if (!at || !to || to <= at) {
        free(j);
        return;
    }
    if (to[-1] == ',') { // the line and its newline
        while (from > j && from[-1] != '\n') from--;
        to++;
    } else { // the last key: from the previous value's comma
        while (from > j && *from != ',') from--;
    }
    memmove(from, to, strlen(to) + 1);
    test_write_file(path, j, strlen(j));
    free(j);
}

// Fixture folder made by tests/ref/gen_all.py (build/fixtures unless VLMOE_FIXTURES is set).
static inline const char *fixture_dir(void) {
    const char *d = getenv("VLMOE_FIXTURES");
    return d ? d : "build/fixtures";
}
#endif
