// watchdog.c: the collective timeout (src/dist/watchdog.h). The calling thread stamps the start of
// each collective into atomics and clears it after; a thread of our own wakes every poll period,
// and when one collective has been running longer than the timeout it calls the fire function
// once. Nothing on the collective's path waits, locks or allocates. Covered by tests/test_dist.c.
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "dist/dist.h"
#include "dist/watchdog.h"

struct dist_watchdog {
    // the collective: seq is odd while one runs (begin and end each add one), since_ns its start
    _Atomic uint64_t seq;
    _Atomic int64_t since_ns;
    _Atomic(const char *) what;
    _Atomic(const void *) group;
    _Atomic int64_t timeout_ns; // 0: none
    int64_t poll_ns;
    dist_watchdog_fire fire;
    void *user;
    pthread_t thread;
    pthread_mutex_t mu; // with cv: wakes the thread at stop instead of making close wait a poll
    pthread_cond_t cv;
    int stop;
};

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *watch(void *arg) {
    dist_watchdog *w = arg;
    uint64_t fired = 0; // the collective already reported (seq is odd, so 0 is none)
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        int64_t wake = mono_ns() + w->poll_ns;
        struct timespec ts = {(time_t)(wake / 1000000000), (long)(wake % 1000000000)};
        while (!w->stop && pthread_cond_timedwait(&w->cv, &w->mu, &ts) != ETIMEDOUT) {}
        if (w->stop) break;
        const uint64_t seq = atomic_load(&w->seq);
        const int64_t limit = atomic_load(&w->timeout_ns), since = atomic_load(&w->since_ns);
        const char *what = atomic_load(&w->what);
        const void *group = atomic_load(&w->group);
        // the fields belong to collective seq only if seq did not move while they were read
        if (!(seq & 1) || seq == fired || limit <= 0 || atomic_load(&w->seq) != seq) continue;
        const int64_t waited = mono_ns() - since;
        if (waited <= limit) continue;
        fired = seq;
        pthread_mutex_unlock(&w->mu); // the fire function may take a while (or never return)
        w->fire(w->user, seq, what, group, (double)waited * 1e-9);
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int dist_watchdog_start(dist_watchdog **out, double poll_s, dist_watchdog_fire fire, void *user) {
    *out = NULL;
    dist_watchdog *w = calloc(1, sizeof *w);
    if (!w) return vlmoe_fail(VLMOE_ERR_NOMEM, "collective watchdog: out of memory");
    w->poll_ns = (int64_t)(poll_s * 1e9);
    if (w->poll_ns < 1000000) w->poll_ns = 1000000;
    w->fire = fire, w->user = user;
    pthread_condattr_t ca;
    int e = pthread_condattr_init(&ca);
    if (!e) e = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!e) e = pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (e) {
        free(w);
        return vlmoe_fail(VLMOE_ERR_IO, "collective watchdog: pthread_cond_init failed: %s", strerror(e));
    }
    pthread_mutex_init(&w->mu, NULL);
    if ((e = pthread_create(&w->thread, NULL, watch, w))) {
        pthread_cond_destroy(&w->cv), pthread_mutex_destroy(&w->mu);
        free(w);
        return vlmoe_fail(VLMOE_ERR_IO, "collective watchdog: pthread_create failed: %s", strerror(e));
    }
    *out = w;
    return VLMOE_OK;
}

void dist_watchdog_set_timeout(dist_watchdog *w, double seconds) {
    if (w) atomic_store(&w->timeout_ns, seconds > 0 ? (int64_t)(seconds * 1e9) : 0);
}

double dist_watchdog_get_timeout(const dist_watchdog *w) {
    return w ? (double)atomic_load(&w->timeout_ns) * 1e-9 : 0;
}

void dist_watchdog_begin(dist_watchdog *w, const char *what, const void *group) {
    if (!w) return;
    atomic_store_explicit(&w->what, what, memory_order_relaxed);
    atomic_store_explicit(&w->group, group, memory_order_relaxed);
    atomic_store_explicit(&w->since_ns, mono_ns(), memory_order_relaxed);
    atomic_fetch_add_explicit(&w->seq, 1, memory_order_release); // odd: running
}

void dist_watchdog_end(dist_watchdog *w) {
    if (w) atomic_fetch_add_explicit(&w->seq, 1, memory_order_release); // even: done
}

int dist_watchdog_running(const dist_watchdog *w, uint64_t seq) {
    return w && atomic_load((_Atomic uint64_t *)&w->seq) == seq;
}

void dist_watchdog_stop(dist_watchdog *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv), pthread_mutex_destroy(&w->mu);
    free(w);
}

void dist_timeout_message(char *buf, size_t n, int rank, const char *what, double waited, const int *others,
                          int n_others) {
    char list[160] = "";
    size_t at = 0;
    for (int i = 0; i < n_others && at < sizeof list; i++) {
        // keep room for ", ..." so a long list still ends readably
        if (at > sizeof list - 24) {
            snprintf(list + at, sizeof list - at, ", ...");
            break;
        }
        at += (size_t)snprintf(list + at, sizeof list - at, "%s%d", i ? ", " : "", others[i]);
    }
    if (!n_others) snprintf(list, sizeof list, "another process");
    snprintf(buf, n, "rank %d: %s has waited %.0f s for the other processes (%s%s may have stopped or hung): "
             "aborting the job", rank, what, waited, n_others > 1 ? "one of ranks " : n_others ? "rank " : "", list);
}

// The handler of vlmoe_dist_on_timeout, read by a group's fire function on the watchdog thread.
static _Atomic(vlmoe_dist_timeout_fn) g_handler;
static void *_Atomic g_handler_user;

void vlmoe_dist_on_timeout(vlmoe_dist_timeout_fn fn, void *user) {
    atomic_store(&g_handler_user, user);
    atomic_store(&g_handler, fn);
}

void dist_timeout_report(const char *message) {
    const vlmoe_dist_timeout_fn fn = atomic_load(&g_handler);
    if (fn) fn(atomic_load(&g_handler_user), message);
}

int dist_timeout_parse(const char *s, double *out) {
    char *end = NULL;
    if (!s || !*s) return -1;
    errno = 0;
    const double v = strtod(s, &end);
    if (errno || *end || !isfinite(v) || v < 0) return -1;
    *out = v;
    return 0;
}
