// mpi.c: the process group over MPI (src/dist/dist.h): a duplicate of MPI_COMM_WORLD whose errors
// come back as statuses, host buffers. Sums are formed in rank order by this file, not by the MPI
// library, so every rank gets the same bits whatever algorithm MPI picks (docs/DISTRIBUTED.md).
// Every collective is watched (src/dist/watchdog.h): one that waits past the timeout aborts the job.
// The non-blocking sum (the gradient buckets') is point-to-point, with the same bits.
// Covered by tests/test_dist.c, under mpirun by tests/test_dist_mpi.sh.
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "core/core.h"
#include "dist/impl.h"
#include "dist/watchdog.h"

// Sums go through a scratch of about this many elements at a time (32 MiB of doubles), however
// long the buffer: the memory stays bounded and every MPI count fits an int.
#define SUM_SEGMENT ((size_t)1 << 22)
// In-place max and broadcast are cut into pieces MPI counts (int) can hold.
#define INT_SEGMENT ((size_t)1 << 30)

typedef struct {
    MPI_Comm comm;
    int *cnt;              // (4, world): send counts, send displacements, receive counts, receive displacements
    void *scratch;         // the rows a rank-order sum adds up
    size_t scratch_bytes;
    int *others, n_others; // the other processes of the group, as ranks of MPI_COMM_WORLD (messages)
    unsigned iseq;         // non-blocking sums started so far: their message tags
} mpi_ctx;

// MPI is process-wide state: it is initialised once and cannot be again after MPI_Finalize. The
// process groups opened here count themselves, and the last to close finalizes MPI if one of
// them initialised it (a program that initialised MPI itself finalizes it itself).
static int g_open, g_we_initialised;
// One watchdog for the process, while a group is open: MPI is called from one thread, so at most
// one collective runs at a time. g_groups_mu keeps a group alive while the watchdog describes it.
static dist_watchdog *g_dog;
static pthread_mutex_t g_groups_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_world_rank;

int dist_mpi_built(void) { return 1; }

static int mpi_fail(const vlmoe_dist *d, int rc, const char *call, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "MPI error code %d", rc);
    if (d) return vlmoe_fail(VLMOE_ERR_IO, "%s (rank %d of %d): %s failed: %s", what, d->rank, d->world, call, msg);
    return vlmoe_fail(VLMOE_ERR_IO, "%s: %s failed: %s", what, call, msg);
}

static int mpi_type(vlmoe_dist_type t, MPI_Datatype *out, const char *what) {
    switch (t) {
    case VLMOE_DIST_F32: *out = MPI_FLOAT; return VLMOE_OK;
    case VLMOE_DIST_F64: *out = MPI_DOUBLE; return VLMOE_OK;
    case VLMOE_DIST_I32: *out = MPI_INT32_T; return VLMOE_OK;
    case VLMOE_DIST_I64: *out = MPI_INT64_T; return VLMOE_OK;
    case VLMOE_DIST_U8: *out = MPI_UINT8_T; return VLMOE_OK;
    }
    return vlmoe_fail(VLMOE_ERR_ARG, "%s: unknown element type %d", what, (int)t);
}

static int grow_scratch(mpi_ctx *c, size_t bytes) {
    if (bytes <= c->scratch_bytes) return VLMOE_OK;
    void *p = vlmoe_alloc(bytes, "MPI sum scratch");
    if (!p) return VLMOE_ERR_NOMEM;
    vlmoe_free_mem(c->scratch);
    c->scratch = p, c->scratch_bytes = bytes;
    return VLMOE_OK;
}

// dst (c) = rows (world, c) summed over the rows in order: ((row 0 + row 1) + row 2) + ...
// Integers add as unsigned, so an overflow wraps (as MPI_SUM does) instead of being undefined.
static void sum_rows(void *dst, const void *rows, int world, size_t c, vlmoe_dist_type t) {
    const size_t es = vlmoe_dist_type_size(t);
    if (dst != rows) memmove(dst, rows, c * es);
    for (int r = 1; r < world; r++) {
        const char *row = (const char *)rows + (size_t)r * c * es;
        switch (t) {
#define ADD_ROW(T)                                                      \
    do {                                                                \
        T *o = dst;                                                     \
        const T *x = (const T *)row;                                    \
        for (size_t i = 0; i < c; i++) o[i] += x[i];                    \
    } while (0)
        case VLMOE_DIST_F32: ADD_ROW(float); break;
        case VLMOE_DIST_F64: ADD_ROW(double); break;
        case VLMOE_DIST_I32: ADD_ROW(uint32_t); break;
        case VLMOE_DIST_I64: ADD_ROW(uint64_t); break;
        case VLMOE_DIST_U8: ADD_ROW(uint8_t); break;
#undef ADD_ROW
        }
    }
}

// The sum in rank order, for any MPI: each rank owns a contiguous slice of every segment, receives
// that slice from every rank (all-to-all), adds the copies in rank order, and the owners' sums are
// gathered back to everyone. The data moved is that of a ring all-reduce; the bits are those of a
// sequential loop over the ranks, on every rank, for any MPI library and algorithm.
static int raw_allreduce_sum(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    int st = mpi_type(t, &dt, "allreduce_sum");
    if (st || d->world == 1 || n == 0) return st;
    const size_t es = vlmoe_dist_type_size(t), W = (size_t)d->world, me = (size_t)d->rank;
    // owned slices of a segment of m elements: [m*j/W, m*(j+1)/W); the largest is ceil(m/W)
    const size_t seg_max = n < SUM_SEGMENT ? n : SUM_SEGMENT;
    if ((st = grow_scratch(c, (seg_max / W + 1) * W * es))) return st;
    int *scnt = c->cnt, *sdis = scnt + W, *rcnt = sdis + W, *rdis = rcnt + W;
    for (size_t off = 0; off < n; off += seg_max) {
        const size_t m = n - off < seg_max ? n - off : seg_max;
        char *seg = (char *)buf + off * es;
        const size_t lo = m * me / W, mine = m * (me + 1) / W - lo;
        for (size_t j = 0; j < W; j++) {
            scnt[j] = (int)(m * (j + 1) / W - m * j / W), sdis[j] = (int)(m * j / W);
            rcnt[j] = (int)mine, rdis[j] = (int)(j * mine);
        }
        int rc = MPI_Alltoallv(seg, scnt, sdis, dt, c->scratch, rcnt, rdis, dt, c->comm);
        if (rc != MPI_SUCCESS) return mpi_fail(d, rc, "MPI_Alltoallv", "allreduce_sum");
        sum_rows(seg + lo * es, c->scratch, d->world, mine, t);
        rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, seg, scnt, sdis, dt, c->comm);
        if (rc != MPI_SUCCESS) return mpi_fail(d, rc, "MPI_Allgatherv", "allreduce_sum");
    }
    return VLMOE_OK;
}

// The same sum without blocking, by point-to-point messages: each rank sends every owner its
// slice, adds the copies of its own slice in rank order once they arrived, and sends the sum to
// every rank. Not MPI's non-blocking collectives: MPI matches those by the order they start in,
// and the second half of one would start when the first half finished, which is a matter of
// timing, not the same on every rank. Messages match by tag instead: the sums of a group take
// tags in the order they start (the same on every rank), so any number may be in flight, in any
// order of progress, among the group's blocking collectives (whose own tags MPI keeps apart).
// A request owns its scratch: MPI writes it until the request completes.
#define IREQ_TAGS 16384 // sums in flight at once per group, at most (two tags each, under MPI_TAG_UB >= 32767)
struct vlmoe_dist_req {
    MPI_Datatype dt;
    vlmoe_dist_type t;
    char *buf;
    size_t n;
    int tag;            // 2 k and 2 k + 1: the two halves of sum number k of the group
    int phase;          // 0: the slices travel to their owners, 1: the sums back, 2: done
    int nr;             // requests in mr
    MPI_Request *mr;    // (2 (world - 1))
    void *scratch;      // (world, this rank's slice)
};

static void req_free(vlmoe_dist_req *q) {
    if (!q) return;
    free(q->mr);
    vlmoe_free_mem(q->scratch);
    free(q);
}

// Slice j of n elements over W ranks: [n j / W, n (j + 1) / W), as the blocking sum's.
static size_t slice_lo(size_t n, size_t W, size_t j) { return n * j / W; }

// Starts half `phase` of q: 0 sends every rank its slice and receives this rank's slice from
// every rank, 1 sends this rank's sum to every rank and receives theirs in place.
static int req_post(vlmoe_dist *d, vlmoe_dist_req *q, int phase) {
    const mpi_ctx *c = d->ctx;
    const size_t W = (size_t)d->world, me = (size_t)d->rank, es = vlmoe_dist_type_size(q->t);
    const size_t lo = slice_lo(q->n, W, me), mine = slice_lo(q->n, W, me + 1) - lo;
    q->phase = phase, q->nr = 0;
    for (size_t j = 0; j < W; j++) {
        if (j == me) continue;
        const size_t jlo = slice_lo(q->n, W, j), jn = slice_lo(q->n, W, j + 1) - jlo;
        int rc;
        if (phase == 0) {
            rc = MPI_Irecv((char *)q->scratch + j * mine * es, (int)mine, q->dt, (int)j, q->tag, c->comm, &q->mr[q->nr++]);
            if (rc == MPI_SUCCESS)
                rc = MPI_Isend(q->buf + jlo * es, (int)jn, q->dt, (int)j, q->tag, c->comm, &q->mr[q->nr++]);
        } else {
            rc = MPI_Irecv(q->buf + jlo * es, (int)jn, q->dt, (int)j, q->tag + 1, c->comm, &q->mr[q->nr++]);
            if (rc == MPI_SUCCESS)
                rc = MPI_Isend(q->buf + lo * es, (int)mine, q->dt, (int)j, q->tag + 1, c->comm, &q->mr[q->nr++]);
        }
        if (rc != MPI_SUCCESS) return mpi_fail(d, rc, phase ? "MPI_Isend/MPI_Irecv (sums)" : "MPI_Isend/MPI_Irecv (slices)",
                                               "iallreduce_sum");
    }
    if (phase == 0) memcpy((char *)q->scratch + me * mine * es, q->buf + lo * es, mine * es); // this rank's row
    return VLMOE_OK;
}

// Moves q along as far as it goes: waiting for each half (block) or only testing it.
static int req_advance(vlmoe_dist *d, vlmoe_dist_req *q, int block) {
    const size_t W = (size_t)d->world, me = (size_t)d->rank, es = vlmoe_dist_type_size(q->t);
    while (q->phase != 2) {
        int flag = 1, rc = block ? MPI_Waitall(q->nr, q->mr, MPI_STATUSES_IGNORE)
                                 : MPI_Testall(q->nr, q->mr, &flag, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) return mpi_fail(d, rc, block ? "MPI_Waitall" : "MPI_Testall", "iallreduce_sum");
        if (!flag) return VLMOE_OK;
        if (q->phase == 1) {
            q->phase = 2;
            break;
        }
        // every copy of this rank's slice arrived: add them in rank order, send the sum
        const size_t lo = slice_lo(q->n, W, me), mine = slice_lo(q->n, W, me + 1) - lo;
        sum_rows(q->buf + lo * es, q->scratch, d->world, mine, q->t);
        int st = req_post(d, q, 1);
        if (st) return st;
    }
    return VLMOE_OK;
}

static int mpi_iallreduce_sum(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, vlmoe_dist_req **req) {
    *req = NULL;
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    int st = mpi_type(t, &dt, "iallreduce_sum");
    if (st || d->world == 1 || n == 0) return st;
    const size_t W = (size_t)d->world, es = vlmoe_dist_type_size(t), slice = n / W + 1;
    if (slice > (size_t)INT_MAX)
        return vlmoe_fail(VLMOE_ERR_ARG, "iallreduce_sum: %zu elements over %d ranks is more than MPI's int counts "
                          "hold per rank; use smaller buckets", n, d->world);
    vlmoe_dist_req *q = calloc(1, sizeof *q);
    if (q) q->mr = malloc(2 * W * sizeof *q->mr), q->scratch = vlmoe_alloc(slice * W * es, "MPI sum scratch");
    if (!q || !q->mr || !q->scratch) {
        req_free(q);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "iallreduce_sum (rank %d of %d): out of memory for %zu elements",
                          d->rank, d->world, n);
    }
    q->dt = dt, q->t = t, q->buf = buf, q->n = n;
    q->tag = 2 * (int)(c->iseq++ % IREQ_TAGS);
    if ((st = req_post(d, q, 0))) return req_free(q), st;
    *req = q;
    return VLMOE_OK;
}

static int mpi_test(vlmoe_dist *d, vlmoe_dist_req *q, int *done) {
    int st = req_advance(d, q, 0);
    *done = q->phase == 2;
    return st;
}

// Max is exact and does not depend on the order it is taken in (a NaN aside: which rank's value
// wins against a NaN is MPI's choice, so turn NaNs into a flag before asking).
static int raw_allreduce_max(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    int st = mpi_type(t, &dt, "allreduce_max");
    if (st) return st;
    const size_t es = vlmoe_dist_type_size(t);
    for (size_t off = 0; off < n; off += INT_SEGMENT) {
        const size_t m = n - off < INT_SEGMENT ? n - off : INT_SEGMENT;
        int rc = MPI_Allreduce(MPI_IN_PLACE, (char *)buf + off * es, (int)m, dt, MPI_MAX, c->comm);
        if (rc != MPI_SUCCESS) return mpi_fail(d, rc, "MPI_Allreduce", "allreduce_max");
    }
    return VLMOE_OK;
}

// n elements per rank and n * world in all must be MPI counts (int): the (world, n) collectives
// are not cut into segments, since a segment of each rank's slice is not contiguous.
static int check_rows(const vlmoe_dist *d, size_t n, const char *what) {
    if (n > (size_t)INT_MAX / (size_t)d->world)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: %zu elements per rank on %d ranks is more than MPI's int "
                          "counts hold (%d in all); split the call", what, n, d->world, INT_MAX);
    return VLMOE_OK;
}

// In place when send is this rank's row of recv (MPI_IN_PLACE), as in the world of one.
static int raw_allgather(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    int st = mpi_type(t, &dt, "allgather");
    if (st || (st = check_rows(d, n, "allgather"))) return st;
    const size_t es = vlmoe_dist_type_size(t);
    const int in_place = send == (const char *)recv + (size_t)d->rank * n * es;
    int rc = MPI_Allgather(in_place ? MPI_IN_PLACE : send, (int)n, dt, recv, (int)n, dt, c->comm);
    return rc == MPI_SUCCESS ? VLMOE_OK : mpi_fail(d, rc, "MPI_Allgather", "allgather");
}

// Rank order again: every rank's row for this rank arrives by all-to-all and is added in order,
// so the gradient a rank keeps does not depend on MPI's reduction algorithm. recv may alias send.
static int raw_reduce_scatter_sum(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    int st = mpi_type(t, &dt, "reduce_scatter_sum");
    if (st || (st = check_rows(d, n, "reduce_scatter_sum"))) return st;
    if (n == 0) return VLMOE_OK;
    const size_t es = vlmoe_dist_type_size(t);
    if ((st = grow_scratch(c, n * (size_t)d->world * es))) return st;
    int rc = MPI_Alltoall(send, (int)n, dt, c->scratch, (int)n, dt, c->comm);
    if (rc != MPI_SUCCESS) return mpi_fail(d, rc, "MPI_Alltoall", "reduce_scatter_sum");
    sum_rows(recv, c->scratch, d->world, n, t);
    return VLMOE_OK;
}

// size_t counts and displacements become MPI's ints, or an error naming the one that does not fit.
static int to_int(int *out, const size_t *v, int world, const char *which) {
    for (int j = 0; j < world; j++) {
        if (v[j] > (size_t)INT_MAX)
            return vlmoe_fail(VLMOE_ERR_ARG, "alltoallv: %s[%d] = %zu is more than MPI's int counts "
                              "hold (%d); split the exchange", which, j, v[j], INT_MAX);
        out[j] = (int)v[j];
    }
    return VLMOE_OK;
}

static int raw_alltoallv(vlmoe_dist *d, void *recv, const size_t *rcount, const size_t *rdispl,
                         const void *send, const size_t *scount, const size_t *sdispl, vlmoe_dist_type t) {
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    const int W = d->world;
    int *scnt = c->cnt, *sdis = scnt + W, *rcnt = sdis + W, *rdis = rcnt + W;
    int st = mpi_type(t, &dt, "alltoallv");
    if (st || (st = to_int(scnt, scount, W, "scount")) || (st = to_int(sdis, sdispl, W, "sdispl")) ||
        (st = to_int(rcnt, rcount, W, "rcount")) || (st = to_int(rdis, rdispl, W, "rdispl")))
        return st;
    int rc = MPI_Alltoallv(send, scnt, sdis, dt, recv, rcnt, rdis, dt, c->comm);
    return rc == MPI_SUCCESS ? VLMOE_OK : mpi_fail(d, rc, "MPI_Alltoallv", "alltoallv");
}

static int raw_broadcast(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, int root) {
    mpi_ctx *c = d->ctx;
    MPI_Datatype dt = MPI_DATATYPE_NULL;
    int st = mpi_type(t, &dt, "broadcast");
    if (st) return st;
    if (root < 0 || root >= d->world)
        return vlmoe_fail(VLMOE_ERR_ARG, "broadcast from rank %d in a world of %d", root, d->world);
    const size_t es = vlmoe_dist_type_size(t);
    for (size_t off = 0; off < n; off += INT_SEGMENT) {
        const size_t m = n - off < INT_SEGMENT ? n - off : INT_SEGMENT;
        int rc = MPI_Bcast((char *)buf + off * es, (int)m, dt, root, c->comm);
        if (rc != MPI_SUCCESS) return mpi_fail(d, rc, "MPI_Bcast", "broadcast");
    }
    return VLMOE_OK;
}

static int raw_barrier(vlmoe_dist *d) {
    mpi_ctx *c = d->ctx;
    int rc = MPI_Barrier(c->comm);
    return rc == MPI_SUCCESS ? VLMOE_OK : mpi_fail(d, rc, "MPI_Barrier", "barrier");
}

// A collective blocked in MPI cannot be cancelled: MPI has no call to withdraw from one, and
// MPI_ERRORS_RETURN only helps once MPI notices a failure, which a peer that hangs (or a
// network that drops it) never triggers. So when one has waited past the timeout, the watchdog
// thread hands the reason to the handler the command line installed (vlmoe_dist_on_timeout),
// which ends the job with vlmoe_dist_abort (MPI_Abort) rather than hang until someone kills it.
// MPI was started with MPI_THREAD_FUNNELED, under which only the main thread may call MPI;
// MPI_Abort from the watchdog thread is the exception taken (Open MPI and MPICH implement it as a
// message to the launcher and an exit, touching no state the blocked call holds).
static void on_timeout(void *user, uint64_t seq, const char *what, const void *group, double waited) {
    char msg[512], line[600];
    pthread_mutex_lock(&g_groups_mu);
    if (!dist_watchdog_running(g_dog, seq)) { // it ended meanwhile
        pthread_mutex_unlock(&g_groups_mu);
        return;
    }
    const mpi_ctx *c = group;
    dist_timeout_message(msg, sizeof msg, g_world_rank, what, waited, c->others, c->n_others);
    pthread_mutex_unlock(&g_groups_mu);
    snprintf(line, sizeof line, "%s (--dist-timeout %g s)", msg, dist_watchdog_get_timeout(g_dog));
    dist_timeout_report(line);
}

#define WATCHED(name, call)                                       \
    do {                                                          \
        dist_watchdog_begin(g_dog, name, d->ctx);                 \
        int st_ = call;                                           \
        dist_watchdog_end(g_dog);                                 \
        return st_;                                               \
    } while (0)
static int mpi_allreduce_sum(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    WATCHED("allreduce_sum", raw_allreduce_sum(d, buf, n, t));
}
static int mpi_allreduce_max(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    WATCHED("allreduce_max", raw_allreduce_max(d, buf, n, t));
}
static int mpi_allgather(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    WATCHED("allgather", raw_allgather(d, recv, send, n, t));
}
static int mpi_reduce_scatter_sum(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    WATCHED("reduce_scatter_sum", raw_reduce_scatter_sum(d, recv, send, n, t));
}
static int mpi_alltoallv(vlmoe_dist *d, void *recv, const size_t *rcount, const size_t *rdispl,
                         const void *send, const size_t *scount, const size_t *sdispl, vlmoe_dist_type t) {
    WATCHED("alltoallv", raw_alltoallv(d, recv, rcount, rdispl, send, scount, sdispl, t));
}
static int mpi_broadcast(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, int root) {
    WATCHED("broadcast", raw_broadcast(d, buf, n, t, root));
}
static int mpi_barrier(vlmoe_dist *d) { WATCHED("barrier", raw_barrier(d)); }
#undef WATCHED

// Only the wait of a non-blocking sum is watched: until then this process computes, and waits
// for nobody. A peer that stopped leaves the wait (or the next blocking collective) hanging, and
// the timeout ends the job as for any other collective.
static int mpi_wait(vlmoe_dist *d, vlmoe_dist_req *q) {
    dist_watchdog_begin(g_dog, "allreduce_sum (a gradient bucket's non-blocking sum)", d->ctx);
    int st = req_advance(d, q, 1);
    dist_watchdog_end(g_dog);
    req_free(q);
    return st;
}

static int mpi_set_timeout(vlmoe_dist *d, double seconds) {
    dist_watchdog_set_timeout(g_dog, seconds);
    return VLMOE_OK;
}

static void mpi_abort(vlmoe_dist *d, int code) {
    MPI_Abort(MPI_COMM_WORLD, code ? code : 1); // every rank, not only this group's
    _exit(code ? code : 1);
}

// The other members of c's group as ranks of MPI_COMM_WORLD, for the timeout's message.
static int find_others(mpi_ctx *c, int size, int me) {
    MPI_Group g = MPI_GROUP_NULL, wg = MPI_GROUP_NULL;
    int *r = malloc(2 * (size_t)size * sizeof *r), rc = MPI_SUCCESS;
    if (!r) return MPI_ERR_NO_MEM;
    for (int i = 0; i < size; i++) r[i] = i;
    rc = MPI_Comm_group(c->comm, &g);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_group(MPI_COMM_WORLD, &wg);
    if (rc == MPI_SUCCESS) rc = MPI_Group_translate_ranks(g, size, r, wg, r + size);
    if (g != MPI_GROUP_NULL) MPI_Group_free(&g);
    if (wg != MPI_GROUP_NULL) MPI_Group_free(&wg);
    c->n_others = 0;
    for (int i = 0; rc == MPI_SUCCESS && i < size; i++)
        if (i != me) r[c->n_others++] = r[size + i];
    c->others = r;
    return rc;
}

static int mpi_split(vlmoe_dist *parent, int color, int key, vlmoe_dist **out);

static void mpi_close(vlmoe_dist *d) {
    mpi_ctx *c = d->ctx;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (c) {
        if (!finalized && c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
        pthread_mutex_lock(&g_groups_mu);
        free(c->others);
        free(c->cnt);
        vlmoe_free_mem(c->scratch);
        free(c);
        pthread_mutex_unlock(&g_groups_mu);
    }
    free(d);
    if (--g_open == 0) {
        dist_watchdog_stop(g_dog);
        g_dog = NULL;
        if (g_we_initialised && !finalized) {
            MPI_Finalize();
            g_we_initialised = 0;
        }
    }
}

int dist_mpi_open(vlmoe_dist **out) {
    *out = NULL;
    int inited = 0, finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "distributed backend \"mpi\": MPI was already finalized in "
                          "this process (it cannot start twice); keep one process group open");
    double timeout = DIST_TIMEOUT_DEFAULT;
    const char *env = getenv("VLMOE_DIST_TIMEOUT");
    if (env && dist_timeout_parse(env, &timeout))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "VLMOE_DIST_TIMEOUT=%s: expected the seconds a collective may wait for "
                          "the other processes, >= 0 (0: no timeout)", env);
    MPI_Initialized(&inited);
    if (!inited) {
        // the training loop calls MPI from its main thread only; OpenMP threads never do
        int provided = 0, rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) return mpi_fail(NULL, rc, "MPI_Init_thread", "distributed backend \"mpi\"");
        g_we_initialised = 1;
    }
    vlmoe_dist *d = calloc(1, sizeof *d);
    mpi_ctx *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d), free(c);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "distributed backend \"mpi\": out of memory");
    }
    if (!g_dog) { // the first group of the process starts the watchdog, at VLMOE_DIST_TIMEOUT or 600 s
        MPI_Comm_rank(MPI_COMM_WORLD, &g_world_rank); // the rank its messages name
        int st = dist_watchdog_start(&g_dog, 0.5, on_timeout, NULL);
        if (st) {
            free(d), free(c);
            return vlmoe_error_prefix("distributed backend \"mpi\""), st;
        }
        dist_watchdog_set_timeout(g_dog, timeout);
    }
    g_open++;
    c->comm = MPI_COMM_NULL;
    *d = (vlmoe_dist){"mpi", 0, 1, 0, 1, c, mpi_allreduce_sum, mpi_allreduce_max, mpi_allgather,
                      mpi_reduce_scatter_sum, mpi_alltoallv, mpi_broadcast, mpi_barrier, mpi_split, mpi_close,
                      mpi_set_timeout, mpi_abort, mpi_iallreduce_sum, mpi_test, mpi_wait};
    // A private communicator: our messages never match the program's own, and its error handler
    // returns codes instead of aborting the job.
    dist_watchdog_begin(g_dog, "the process group's set-up (MPI_Comm_dup)", c);
    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c->comm);
    const char *call = "MPI_Comm_dup";
    MPI_Comm node = MPI_COMM_NULL;
    if (rc == MPI_SUCCESS) call = "MPI_Comm_set_errhandler", rc = MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_rank", rc = MPI_Comm_rank(c->comm, &d->rank);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_size", rc = MPI_Comm_size(c->comm, &d->world);
    // the ranks sharing memory with this one are those on its node: local_rank picks the GPU
    if (rc == MPI_SUCCESS)
        call = "MPI_Comm_split_type", rc = MPI_Comm_split_type(c->comm, MPI_COMM_TYPE_SHARED, d->rank, MPI_INFO_NULL, &node);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_rank", rc = MPI_Comm_rank(node, &d->local_rank);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_size", rc = MPI_Comm_size(node, &d->local_world);
    if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_group", rc = find_others(c, d->world, d->rank);
    dist_watchdog_end(g_dog);
    if (rc != MPI_SUCCESS) {
        int st = mpi_fail(NULL, rc, call, "distributed backend \"mpi\"");
        mpi_close(d);
        return st;
    }
    if (!(c->cnt = malloc(4 * (size_t)d->world * sizeof *c->cnt))) {
        mpi_close(d);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "distributed backend \"mpi\": out of memory for %d ranks", d->world);
    }
    *out = d;
    return VLMOE_OK;
}

static int mpi_split(vlmoe_dist *parent, int color, int key, vlmoe_dist **out) {
    *out = NULL;
    mpi_ctx *pc = parent->ctx;
    vlmoe_dist *d = calloc(1, sizeof *d);
    mpi_ctx *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d), free(c);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "splitting the process group: out of memory");
    }
    g_open++;
    c->comm = MPI_COMM_NULL;
    *d = *parent;
    d->ctx = c;
    dist_watchdog_begin(g_dog, "split (MPI_Comm_split)", pc);
    int rc = MPI_Comm_split(pc->comm, color, key, &c->comm);
    dist_watchdog_end(g_dog);
    const char *call = "MPI_Comm_split";
    if (rc == MPI_SUCCESS) call = "MPI_Comm_set_errhandler", rc = MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_rank", rc = MPI_Comm_rank(c->comm, &d->rank);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_size", rc = MPI_Comm_size(c->comm, &d->world);
    if (rc == MPI_SUCCESS) call = "MPI_Comm_group", rc = find_others(c, d->world, d->rank);
    if (rc != MPI_SUCCESS) {
        int st = mpi_fail(parent, rc, call, "splitting the process group");
        mpi_close(d);
        return st;
    }
    if (!(c->cnt = malloc(4 * (size_t)d->world * sizeof *c->cnt))) {
        mpi_close(d);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "splitting the process group: out of memory");
    }
    *out = d;
    return VLMOE_OK;
}
