// single.c: the world of one, the default when the process was not started by mpirun: every
// collective is the identity (a copy where input and output differ), so the training loop calls
// the same collectives whether it runs on one process or many. Covered by tests/test_dist.c.
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"

size_t vlmoe_dist_type_size(vlmoe_dist_type t) {
    switch (t) {
    case VLMOE_DIST_F32: return 4;
    case VLMOE_DIST_F64: return 8;
    case VLMOE_DIST_I32: return 4;
    case VLMOE_DIST_I64: return 8;
    case VLMOE_DIST_U8: return 1;
    }
    return 0;
}

static int bad_type(vlmoe_dist_type t, const char *what) {
    return vlmoe_fail(VLMOE_ERR_ARG, "%s: unknown element type %d", what, (int)t);
}

static int single_inplace(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    return vlmoe_dist_type_size(t) ? VLMOE_OK : bad_type(t, "allreduce");
}

static int single_copy(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    const size_t es = vlmoe_dist_type_size(t);
    if (!es) return bad_type(t, "allgather/reduce_scatter_sum");
    if (recv != send && n) memmove(recv, send, n * es);
    return VLMOE_OK;
}

static int single_alltoallv(vlmoe_dist *d, void *recv, const size_t *rcount, const size_t *rdispl,
                            const void *send, const size_t *scount, const size_t *sdispl,
                            vlmoe_dist_type t) {
    const size_t es = vlmoe_dist_type_size(t);
    if (!es) return bad_type(t, "alltoallv");
    if (rcount[0] != scount[0])
        return vlmoe_fail(VLMOE_ERR_ARG, "alltoallv: rank 0 sends %zu elements to itself but "
                          "expects %zu", scount[0], rcount[0]);
    if (scount[0]) memmove((char *)recv + rdispl[0] * es, (const char *)send + sdispl[0] * es, scount[0] * es);
    return VLMOE_OK;
}

static int single_broadcast(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, int root) {
    if (!vlmoe_dist_type_size(t)) return bad_type(t, "broadcast");
    return root == 0 ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_ARG, "broadcast from rank %d in a world of 1", root);
}

static int single_barrier(vlmoe_dist *d) { return VLMOE_OK; }
static int single_split(vlmoe_dist *d, int color, int key, vlmoe_dist **out) { return *out = d, VLMOE_OK; }
static void single_close(vlmoe_dist *d) {}
static int single_set_timeout(vlmoe_dist *d, double seconds) { return VLMOE_OK; }
static void single_abort(vlmoe_dist *d, int code) {}

static vlmoe_dist g_single = {
    "single", 0, 1, 0, 1, NULL,
    single_inplace, single_inplace, single_copy, single_copy, single_alltoallv,
    single_broadcast, single_barrier, single_split, single_close, single_set_timeout, single_abort,
    NULL, NULL, NULL, // non-blocking: the world of one's sums finish at the call
};

vlmoe_dist *vlmoe_dist_single(void) { return &g_single; }

int vlmoe_dist_set_timeout(vlmoe_dist *d, double seconds) {
    if (!(seconds >= 0) || seconds > 1e9)
        return vlmoe_fail(VLMOE_ERR_ARG, "collective timeout: %g seconds; expected seconds >= 0 (0: none)", seconds);
    return d->set_timeout ? d->set_timeout(d, seconds) : VLMOE_OK;
}

void vlmoe_dist_abort(vlmoe_dist *d, int code) {
    if (d && d->abort) d->abort(d, code);
}

int vlmoe_dist_iallreduce_sum(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, vlmoe_dist_req **req) {
    *req = NULL;
    return d->iallreduce_sum ? d->iallreduce_sum(d, buf, n, t, req) : d->allreduce_sum(d, buf, n, t);
}

int vlmoe_dist_test(vlmoe_dist *d, vlmoe_dist_req *req, int *done) {
    *done = 1;
    return req && d->test ? d->test(d, req, done) : VLMOE_OK;
}

int vlmoe_dist_wait(vlmoe_dist *d, vlmoe_dist_req *req) {
    return req && d->wait ? d->wait(d, req) : VLMOE_OK;
}

void vlmoe_dist_close(vlmoe_dist *d) {
    if (d && d != &g_single && d->close) d->close(d);
}
