// test.h: the tiny harness every tests/test_*.c uses. CHECK records a failure with file:line and
// a message and goes on; a test binary exits non-zero if anything failed and prints
// "name: N passed, N failed" so tests/run.sh can total the suite.
#ifndef VLMOE_TEST_H
#define VLMOE_TEST_H
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

// Fixture folder made by tests/ref/gen_all.py (build/fixtures unless VLMOE_FIXTURES is set).
static inline const char *fixture_dir(void) {
    const char *d = getenv("VLMOE_FIXTURES");
    return d ? d : "build/fixtures";
}
#endif
