// test_dist.c: the process groups of src/dist. Alone, every collective on the world of one
// ("single", "mpi" as a singleton when MPI is built in, "nccl" where a GPU is present), the choice
// made by "auto", and the error paths. Under mpirun (tests/test_dist_mpi.sh runs it on 2 and 3
// ranks), every collective with rank-dependent values, checked exactly on every rank. The
// collective timeout's watchdog (src/dist/watchdog.c) with a fire function that records.
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "dist/dist.h"
#include "dist/impl.h"
#include "dist/watchdog.h"
#include "ops/backend.h"
#include "test.h"
#include "test_mpi.h"

static const vlmoe_dist_type TYPES[] = {VLMOE_DIST_F32, VLMOE_DIST_F64, VLMOE_DIST_I32, VLMOE_DIST_I64, VLMOE_DIST_U8};
static const char *type_name(vlmoe_dist_type t) {
    static const char *names[] = {"f32", "f64", "i32", "i64", "u8"};
    return names[t];
}

// Buffers of the group under test: host memory, or device memory through a backend table.
typedef struct {
    void *(*alloc)(void *ctx, size_t bytes);
    void (*up)(void *ctx, void *dev, const void *host, size_t bytes);
    void (*down)(void *ctx, void *host, const void *dev, size_t bytes);
    void (*release)(void *ctx, void *dev);
    void *ctx;
} mem;

static void *host_alloc(void *ctx, size_t bytes) { return calloc(bytes ? bytes : 1, 1); }
static void host_copy(void *ctx, void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void host_release(void *ctx, void *p) { free(p); }
static const mem HOST = {host_alloc, host_copy, host_copy, host_release, NULL};

// the backend moves floats: byte buffers are rounded up to whole floats
static void *dev_alloc(void *ctx, size_t bytes) {
    vlmoe_backend_f32 *be = ctx;
    return be->alloc(be, (bytes + 3) / 4 * 4 + 4, "test_dist");
}
static void dev_up(void *ctx, void *dev, const void *host, size_t bytes) {
    vlmoe_backend_f32 *be = ctx;
    be->upload_bytes(be, dev, host, bytes);
    be->sync(be);
}
static void dev_down(void *ctx, void *host, const void *dev, size_t bytes) {
    vlmoe_backend_f32 *be = ctx;
    float *tmp = malloc((bytes + 3) / 4 * 4 + 4);
    be->download(be, tmp, dev, (bytes + 3) / 4);
    be->sync(be);
    memcpy(host, tmp, bytes);
    free(tmp);
}
static void dev_release(void *ctx, void *p) {
    vlmoe_backend_f32 *be = ctx;
    be->free(be, p);
}

// Element i of what rank r holds for a given purpose (salt): non-trivial floats (their sums
// round), and integers that overflow when added, so order and wraparound both show.
static void fill(void *h, vlmoe_dist_type t, size_t n, int r, uint64_t salt, size_t first) {
    for (size_t k = 0; k < n; k++) {
        const size_t i = first + k;
        const uint64_t key = salt * 7919 + (uint64_t)r;
        const uint64_t u = vlmoe_mix64(key * 1000003 + i);
        switch (t) {
        case VLMOE_DIST_F32: ((float *)h)[k] = (float)(vlmoe_normal_at(key, i) * 3.0); break;
        case VLMOE_DIST_F64: ((double *)h)[k] = vlmoe_normal_at(key, i) * 3.0; break;
        case VLMOE_DIST_I32: ((int32_t *)h)[k] = (int32_t)(uint32_t)u; break;
        case VLMOE_DIST_I64: ((int64_t *)h)[k] = (int64_t)u; break;
        case VLMOE_DIST_U8: ((uint8_t *)h)[k] = (uint8_t)u; break;
        }
    }
}

// acc (n) += x (n) or acc = max(acc, x), in type t (integers wrap)
static void combine(void *acc, const void *x, vlmoe_dist_type t, size_t n, int is_max) {
#define COMBINE(T)                                                               \
    for (size_t i = 0; i < n; i++) {                                             \
        T a = ((T *)acc)[i], b = ((const T *)x)[i];                              \
        ((T *)acc)[i] = is_max ? (b > a ? b : a) : (T)(a + b);                   \
    }
    switch (t) {
    case VLMOE_DIST_F32: { COMBINE(float) break; }
    case VLMOE_DIST_F64: { COMBINE(double) break; }
    case VLMOE_DIST_I32:
        if (is_max) { COMBINE(int32_t) } else { COMBINE(uint32_t) }
        break;
    case VLMOE_DIST_I64:
        if (is_max) { COMBINE(int64_t) } else { COMBINE(uint64_t) }
        break;
    case VLMOE_DIST_U8: { COMBINE(uint8_t) break; }
    }
#undef COMBINE
}

static double elem(const void *h, vlmoe_dist_type t, size_t i) {
    switch (t) {
    case VLMOE_DIST_F32: return ((const float *)h)[i];
    case VLMOE_DIST_F64: return ((const double *)h)[i];
    case VLMOE_DIST_I32: return ((const int32_t *)h)[i];
    case VLMOE_DIST_I64: return (double)((const int64_t *)h)[i];
    case VLMOE_DIST_U8: return ((const uint8_t *)h)[i];
    }
    return 0;
}

// got == want bit for bit, or a failed check naming the first element that differs
static void check_bits(const vlmoe_dist *d, const void *got, const void *want, vlmoe_dist_type t, size_t n,
                       const char *what) {
    const size_t es = vlmoe_dist_type_size(t);
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (memcmp((const char *)got + i * es, (const char *)want + i * es, es)) bad = i;
    CHECK(bad == n, "%s rank %d of %d: %s %s n=%zu: element %zu is %.17g, want %.17g", d->name, d->rank,
          d->world, what, type_name(t), n, bad, bad < n ? elem(got, t, bad) : 0, bad < n ? elem(want, t, bad) : 0);
}

// The sum of every rank's buffer in rank order: what "single" and "mpi" give bit for bit. NCCL
// sums in its own order: with it the floats are compared to a tolerance, and every rank must hold
// the same bits (gathered and compared).
static void check_allreduce(vlmoe_dist *d, const mem *m, vlmoe_dist_type t, size_t n, int is_max) {
    const size_t es = vlmoe_dist_type_size(t), bytes = n * es;
    const int exact = strcmp(d->name, "nccl") != 0 || is_max || t >= VLMOE_DIST_I32;
    char *h = malloc(bytes + 1), *want = malloc(bytes + 1), *row = malloc(bytes + 1);
    void *buf = m->alloc(m->ctx, bytes);
    fill(want, t, n, 0, 1 + is_max, 0);
    for (int r = 1; r < d->world; r++) fill(row, t, n, r, 1 + is_max, 0), combine(want, row, t, n, is_max);
    fill(h, t, n, d->rank, 1 + is_max, 0);
    m->up(m->ctx, buf, h, bytes);
    int st = is_max ? d->allreduce_max(d, buf, n, t) : d->allreduce_sum(d, buf, n, t);
    CHECK(st == VLMOE_OK, "%s allreduce_%s %s n=%zu: %s", d->name, is_max ? "max" : "sum", type_name(t), n,
          vlmoe_last_error());
    m->down(m->ctx, h, buf, bytes);
    if (exact) {
        check_bits(d, h, want, t, n, is_max ? "allreduce_max" : "allreduce_sum");
    } else {
        double worst = 0;
        for (size_t i = 0; i < n; i++) {
            const double e = fabs(elem(h, t, i) - elem(want, t, i)) / (1 + fabs(elem(want, t, i)));
            worst = e > worst ? e : worst;
        }
        CHECK(worst < 1e-5, "%s allreduce_sum %s n=%zu: relative error %g", d->name, type_name(t), n, worst);
        void *all = m->alloc(m->ctx, bytes * (size_t)d->world);
        char *hall = malloc(bytes * (size_t)d->world + 1);
        CHECK(d->allgather(d, all, buf, n, t) == VLMOE_OK, "allgather: %s", vlmoe_last_error());
        m->down(m->ctx, hall, all, bytes * (size_t)d->world);
        for (int r = 1; r < d->world; r++) check_bits(d, hall + r * bytes, hall, t, n, "allreduce_sum on every rank");
        m->release(m->ctx, all);
        free(hall);
    }
    m->release(m->ctx, buf);
    free(h), free(want), free(row);
}

// The non-blocking sum (data parallelism's gradient buckets): several in flight at once, a
// blocking collective between their starts, progress tested and waited for in an order that
// differs between ranks (the last rank late), waited for in the order they started (dist.h), and
// each must equal the rank-order sum bit for bit.
// Host memory only ("nccl" has none: vlmoe_dist_iallreduce_sum blocks, checked as allreduce).
static void check_iallreduce(vlmoe_dist *d) {
    enum { K = 6 };
    static const vlmoe_dist_type ts[K] = {VLMOE_DIST_F32, VLMOE_DIST_F32, VLMOE_DIST_F32, VLMOE_DIST_F32,
                                          VLMOE_DIST_F64, VLMOE_DIST_I64};
    static const size_t ns[K] = {1000, 0, 1, 7, 33, 9};
    void *buf[K], *want[K];
    vlmoe_dist_req *req[K];
    for (int k = 0; k < K; k++) {
        const size_t bytes = ns[k] * vlmoe_dist_type_size(ts[k]) + 1;
        char *row = malloc(bytes);
        buf[k] = malloc(bytes), want[k] = malloc(bytes);
        fill(want[k], ts[k], ns[k], 0, 40 + k, 0);
        for (int r = 1; r < d->world; r++) fill(row, ts[k], ns[k], r, 40 + k, 0), combine(want[k], row, ts[k], ns[k], 0);
        fill(buf[k], ts[k], ns[k], d->rank, 40 + k, 0);
        free(row);
        int st = vlmoe_dist_iallreduce_sum(d, buf[k], ns[k], ts[k], &req[k]);
        CHECK(st == VLMOE_OK, "%s iallreduce_sum %d: %s", d->name, k, vlmoe_last_error());
        if (st) req[k] = NULL;
        CHECK(d->world > 1 || !req[k], "%s: a world of one's sum finishes at the call", d->name);
        if (k == 2) { // a blocking collective among the non-blocking ones
            int32_t one = d->rank;
            CHECK(d->allreduce_max(d, &one, 1, VLMOE_DIST_I32) == VLMOE_OK && one == d->world - 1,
                  "%s allreduce_max among non-blocking sums", d->name);
        }
    }
    if (d->rank == d->world - 1 && d->world > 1) nanosleep(&(struct timespec){0, 50000000}, NULL);
    for (int i = 0; i < K; i++) { // odd ranks test from the last sum, even ones from the first
        int done = 0, k = d->rank % 2 ? K - 1 - i : i;
        CHECK(vlmoe_dist_test(d, req[k], &done) == VLMOE_OK, "%s test %d: %s", d->name, k, vlmoe_last_error());
    }
    for (int k = 0; k < K; k++) // waits in the order of the starts, as the contract says
        CHECK(vlmoe_dist_wait(d, req[k]) == VLMOE_OK, "%s wait %d: %s", d->name, k, vlmoe_last_error());
    for (int k = 0; k < K; k++) {
        check_bits(d, buf[k], want[k], ts[k], ns[k], "iallreduce_sum");
        free(buf[k]), free(want[k]);
    }
}

// recv (world, n) holds every rank's row in rank order; in place when send is this rank's row
static void check_allgather(vlmoe_dist *d, const mem *m, vlmoe_dist_type t, size_t n, int in_place) {
    const size_t es = vlmoe_dist_type_size(t), bytes = n * es, W = (size_t)d->world;
    char *h = malloc(bytes * W + 1), *want = malloc(bytes * W + 1);
    for (int r = 0; r < d->world; r++) fill(want + r * bytes, t, n, r, 3, 0);
    void *recv = m->alloc(m->ctx, bytes * W), *send = in_place ? (char *)recv + d->rank * bytes : m->alloc(m->ctx, bytes);
    m->up(m->ctx, send, want + d->rank * bytes, bytes);
    CHECK(d->allgather(d, recv, send, n, t) == VLMOE_OK, "%s allgather: %s", d->name, vlmoe_last_error());
    m->down(m->ctx, h, recv, bytes * W);
    check_bits(d, h, want, t, n * W, in_place ? "allgather in place" : "allgather");
    if (!in_place) m->release(m->ctx, send);
    m->release(m->ctx, recv);
    free(h), free(want);
}

// recv (n) = sum over ranks, in rank order, of their send (world, n) row for this rank
static void check_reduce_scatter(vlmoe_dist *d, const mem *m, vlmoe_dist_type t, size_t n) {
    const size_t es = vlmoe_dist_type_size(t), bytes = n * es, W = (size_t)d->world;
    const int exact = strcmp(d->name, "nccl") != 0 || t >= VLMOE_DIST_I32;
    char *h = malloc(bytes * W + 1), *want = malloc(bytes + 1), *row = malloc(bytes + 1);
    fill(want, t, n, 0, 4, d->rank * n);
    for (int r = 1; r < d->world; r++) fill(row, t, n, r, 4, d->rank * n), combine(want, row, t, n, 0);
    fill(h, t, n * W, d->rank, 4, 0);
    void *send = m->alloc(m->ctx, bytes * W), *recv = m->alloc(m->ctx, bytes);
    m->up(m->ctx, send, h, bytes * W);
    CHECK(d->reduce_scatter_sum(d, recv, send, n, t) == VLMOE_OK, "%s reduce_scatter_sum: %s", d->name,
          vlmoe_last_error());
    m->down(m->ctx, h, recv, bytes);
    if (exact) check_bits(d, h, want, t, n, "reduce_scatter_sum");
    else
        for (size_t i = 0; i < n; i++)
            CHECK_CLOSE(elem(h, t, i), elem(want, t, i), 1e-5, 1e-5, "reduce_scatter_sum");
    m->release(m->ctx, send), m->release(m->ctx, recv);
    free(h), free(want), free(row);
}

// reduce_scatter_sum is allgather's adjoint: sum over ranks of <allgather(x), y_r> equals the sum
// over ranks of <x_r, reduce_scatter_sum(y)_r>. Small integers in doubles keep both sides exact.
static void check_adjoint(vlmoe_dist *d, const mem *m, size_t n) {
    const size_t W = (size_t)d->world, bytes = n * sizeof(double);
    double *x = malloc(bytes), *y = malloc(bytes * W), *hx = malloc(bytes * W), *hy = malloc(bytes);
    for (size_t i = 0; i < n; i++) x[i] = (double)((vlmoe_mix64(d->rank * 131 + i) % 17) - 8.0);
    for (size_t i = 0; i < n * W; i++) y[i] = (double)((vlmoe_mix64(d->rank * 977 + i + 5) % 13) - 6.0);
    void *gx = m->alloc(m->ctx, bytes * W), *dx = m->alloc(m->ctx, bytes), *dy = m->alloc(m->ctx, bytes * W),
         *ry = m->alloc(m->ctx, bytes);
    m->up(m->ctx, dx, x, bytes), m->up(m->ctx, dy, y, bytes * W);
    CHECK(d->allgather(d, gx, dx, n, VLMOE_DIST_F64) == VLMOE_OK, "allgather: %s", vlmoe_last_error());
    CHECK(d->reduce_scatter_sum(d, ry, dy, n, VLMOE_DIST_F64) == VLMOE_OK, "reduce_scatter: %s", vlmoe_last_error());
    m->down(m->ctx, hx, gx, bytes * W), m->down(m->ctx, hy, ry, bytes);
    double dots[2] = {0, 0};
    for (size_t i = 0; i < n * W; i++) dots[0] += hx[i] * y[i];
    for (size_t i = 0; i < n; i++) dots[1] += x[i] * hy[i];
    void *dd = m->alloc(m->ctx, sizeof dots);
    m->up(m->ctx, dd, dots, sizeof dots);
    CHECK(d->allreduce_sum(d, dd, 2, VLMOE_DIST_F64) == VLMOE_OK, "allreduce_sum: %s", vlmoe_last_error());
    m->down(m->ctx, dots, dd, sizeof dots);
    CHECK(dots[0] == dots[1], "%s rank %d: <allgather(x), y> = %.17g but <x, reduce_scatter_sum(y)> = %.17g",
          d->name, d->rank, dots[0], dots[1]);
    m->release(m->ctx, gx), m->release(m->ctx, dx), m->release(m->ctx, dy), m->release(m->ctx, ry);
    m->release(m->ctx, dd);
    free(x), free(y), free(hx), free(hy);
}

// Rank r sends (r + 2j + 1) % 4 elements to rank j (zero for some pairs, uneven everywhere),
// with a gap of one element between blocks, and receives its blocks in reverse rank order: the
// displacements are used, and the gaps (-1) stay untouched.
static size_t a2a_count(int from, int to) { return (size_t)((from + 2 * to + 1) % 4); }
static double a2a_value(int from, int to, size_t e) { return from * 10000.0 + to * 100.0 + (double)e; }

static void check_alltoallv(vlmoe_dist *d, const mem *m) {
    const int W = d->world, me = d->rank;
    size_t *sc = calloc((size_t)W * 4, sizeof *sc), *sd = sc + W, *rc = sd + W, *rd = rc + W;
    size_t stot = 0, rtot = 0;
    for (int j = 0; j < W; j++) sc[j] = a2a_count(me, j), sd[j] = stot, stot += sc[j] + 1;
    for (int j = W - 1; j >= 0; j--) rc[j] = a2a_count(j, me), rd[j] = rtot, rtot += rc[j] + 1;
    double *hs = malloc(stot * sizeof *hs), *hr = malloc(rtot * sizeof *hr), *want = malloc(rtot * sizeof *want);
    for (size_t i = 0; i < stot; i++) hs[i] = -1;
    for (size_t i = 0; i < rtot; i++) hr[i] = want[i] = -1;
    for (int j = 0; j < W; j++) {
        for (size_t e = 0; e < sc[j]; e++) hs[sd[j] + e] = a2a_value(me, j, e);
        for (size_t e = 0; e < rc[j]; e++) want[rd[j] + e] = a2a_value(j, me, e);
    }
    void *send = m->alloc(m->ctx, stot * sizeof *hs), *recv = m->alloc(m->ctx, rtot * sizeof *hr);
    m->up(m->ctx, send, hs, stot * sizeof *hs), m->up(m->ctx, recv, hr, rtot * sizeof *hr);
    CHECK(d->alltoallv(d, recv, rc, rd, send, sc, sd, VLMOE_DIST_F64) == VLMOE_OK, "%s alltoallv: %s", d->name,
          vlmoe_last_error());
    m->down(m->ctx, hr, recv, rtot * sizeof *hr);
    check_bits(d, hr, want, VLMOE_DIST_F64, rtot, "alltoallv");
    m->release(m->ctx, send), m->release(m->ctx, recv);
    free(hs), free(hr), free(want), free(sc);
}

// every rank ends with the root's buffer; the root is the last rank (not 0 when world > 1)
static void check_broadcast(vlmoe_dist *d, const mem *m, vlmoe_dist_type t, size_t n) {
    const size_t bytes = n * vlmoe_dist_type_size(t);
    const int root = d->world - 1;
    char *h = malloc(bytes + 1), *want = malloc(bytes + 1);
    fill(want, t, n, root, 5, 0), fill(h, t, n, d->rank, 5, 0);
    void *buf = m->alloc(m->ctx, bytes);
    m->up(m->ctx, buf, h, bytes);
    CHECK(d->broadcast(d, buf, n, t, root) == VLMOE_OK, "%s broadcast: %s", d->name, vlmoe_last_error());
    m->down(m->ctx, h, buf, bytes);
    check_bits(d, h, want, t, n, "broadcast");
    m->release(m->ctx, buf);
    free(h), free(want);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Errors every rank detects alike before any message moves, so no rank is left waiting.
static void check_errors(vlmoe_dist *d, const mem *m) {
    void *buf = m->alloc(m->ctx, 64);
    int st = d->broadcast(d, buf, 4, VLMOE_DIST_F32, d->world);
    CHECK(st == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "broadcast from rank"), "%s broadcast from rank %d: "
          "status %d, %s", d->name, d->world, st, vlmoe_last_error());
    st = d->broadcast(d, buf, 4, VLMOE_DIST_F32, -1);
    CHECK(st == VLMOE_ERR_ARG, "%s broadcast from rank -1: status %d", d->name, st);
    st = d->allreduce_sum(d, buf, 4, (vlmoe_dist_type)99);
    CHECK(st == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "type"), "%s allreduce_sum of type 99: status %d, %s",
          d->name, st, vlmoe_last_error());
    if (!strcmp(d->name, "mpi")) {
        // counts past MPI's int
        size_t *c = calloc((size_t)d->world * 4, sizeof *c);
        c[0] = (size_t)INT32_MAX + 1;
        st = d->alltoallv(d, buf, c + 2 * d->world, c + 3 * d->world, buf, c, c + d->world, VLMOE_DIST_F32);
        CHECK(st == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "scount[0]"), "alltoallv of 2^31 elements: "
              "status %d, %s", st, vlmoe_last_error());
        st = d->allgather(d, buf, buf, (size_t)INT32_MAX / (size_t)d->world + 1, VLMOE_DIST_F32);
        CHECK(st == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "split the call"), "allgather past int counts: "
              "status %d, %s", st, vlmoe_last_error());
        free(c);
    }
    m->release(m->ctx, buf);
}

// Every collective of d with buffers from m, at sizes that cover empty, tiny, uneven splits over
// the ranks and (host memory) a sum longer than mpi.c's segment.
static void check_group(vlmoe_dist *d, const mem *m, int big) {
    const size_t sizes[] = {0, 1, 7, 1000};
    for (size_t ti = 0; ti < sizeof TYPES / sizeof TYPES[0]; ti++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
            check_allreduce(d, m, TYPES[ti], sizes[si], 0);
            check_allreduce(d, m, TYPES[ti], sizes[si], 1);
            check_allgather(d, m, TYPES[ti], sizes[si], 0);
            check_reduce_scatter(d, m, TYPES[ti], sizes[si]);
            check_broadcast(d, m, TYPES[ti], sizes[si]);
        }
    check_allgather(d, m, VLMOE_DIST_F32, 33, 1);
    if (m == &HOST) check_iallreduce(d);
    if (big) check_allreduce(d, m, VLMOE_DIST_F32, ((size_t)1 << 22) + 5 * (size_t)d->world + 1, 0);
    check_adjoint(d, m, 50);
    check_alltoallv(d, m);
    check_errors(d, m);
    // barrier: the last rank arrives late; nobody may leave before it arrives
    const double t0 = now_s();
    if (d->rank == d->world - 1 && d->world > 1) nanosleep(&(struct timespec){0, 200000000}, NULL);
    CHECK(d->barrier(d) == VLMOE_OK, "%s barrier: %s", d->name, vlmoe_last_error());
    if (d->world > 1) CHECK(now_s() - t0 > 0.15, "%s rank %d left the barrier after %.3f s, before the last rank "
                            "arrived", d->name, d->rank, now_s() - t0);
}

// NCCL where a GPU is present: the same checks on device buffers
static void check_nccl(void) {
    vlmoe_backend_f32 *probe = NULL;
    if (backend_cuda_init(&probe, 0) != VLMOE_OK) {
        printf("test_dist: nccl skipped (no CUDA device or no CUDA build: %s)\n", vlmoe_last_error());
        return;
    }
    backend_cuda_free(probe);
    vlmoe_dist *d = NULL;
    int st = vlmoe_dist_open(&d, "nccl");
    if (st && strstr(vlmoe_last_error(), "built without")) {
        printf("test_dist: nccl skipped: %s\n", vlmoe_last_error());
        return;
    }
    CHECK(st == VLMOE_OK && !strcmp(d->name, "nccl"), "open nccl: %s", vlmoe_last_error());
    if (st) return;
    vlmoe_backend_f32 *be = NULL;
    if (backend_cuda_init(&be, d->local_rank) != VLMOE_OK) CHECK(backend_cuda_init(&be, 0) == VLMOE_OK, "%s", vlmoe_last_error());
    if (be) {
        const mem dev = {dev_alloc, dev_up, dev_down, dev_release, be};
        check_group(d, &dev, 0);
        backend_cuda_free(be);
    }
    vlmoe_dist_close(d);
}

// What the watchdog reported (its thread writes, the test's reads after a wait).
typedef struct {
    atomic_int fired;
    _Atomic(const char *) what;
    _Atomic(const void *) group;
    _Atomic double waited;
    _Atomic uint64_t seq;
} fired_log;

static void record(void *user, uint64_t seq, const char *what, const void *group, double waited) {
    fired_log *f = user;
    atomic_store(&f->what, what), atomic_store(&f->group, group);
    atomic_store(&f->waited, waited), atomic_store(&f->seq, seq);
    atomic_fetch_add(&f->fired, 1);
}

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

// The timeout's logic with one process: a collective that runs past the timeout is reported once,
// with its name, group and wait; many short ones adding up to more are not; no timeout, none.
// Bounds are loose at the top: this machine is shared and a poll may come late.
static void check_watchdog(void) {
    fired_log f;
    memset(&f, 0, sizeof f);
    dist_watchdog *w = NULL;
    CHECK(dist_watchdog_start(&w, 0.02, record, &f) == VLMOE_OK && w, "watchdog start: %s", vlmoe_last_error());
    if (!w) return;
    CHECK(dist_watchdog_get_timeout(w) == 0, "a new watchdog has no timeout (%g)", dist_watchdog_get_timeout(w));
    dist_watchdog_begin(w, "allgather", NULL); // no timeout: never reported
    sleep_s(0.3);
    dist_watchdog_end(w);
    CHECK(atomic_load(&f.fired) == 0, "no timeout, 0.3 s collective: reported %d times", atomic_load(&f.fired));
    dist_watchdog_set_timeout(w, 0.2);
    CHECK(fabs(dist_watchdog_get_timeout(w) - 0.2) < 1e-9, "timeout 0.2 s reads back %g", dist_watchdog_get_timeout(w));
    for (int i = 0; i < 40; i++) { // 0.4 s of collectives of 10 ms: each is short
        dist_watchdog_begin(w, "allreduce_sum", NULL);
        sleep_s(0.01);
        dist_watchdog_end(w);
    }
    CHECK(atomic_load(&f.fired) == 0, "40 collectives of 10 ms under a 0.2 s timeout: reported %d times",
          atomic_load(&f.fired));
    int group = 7;
    const double t0 = now_s();
    dist_watchdog_begin(w, "barrier", &group);
    while (!atomic_load(&f.fired) && now_s() - t0 < 10) sleep_s(0.01);
    const double at = now_s() - t0;
    sleep_s(0.2); // still blocked: not reported again
    const uint64_t seq = atomic_load(&f.seq);
    CHECK(dist_watchdog_running(w, seq), "the reported collective is still running");
    dist_watchdog_end(w);
    CHECK(!dist_watchdog_running(w, seq), "after its end, the reported collective is not running");
    const char *what = atomic_load(&f.what);
    const double waited = atomic_load(&f.waited);
    CHECK(atomic_load(&f.fired) == 1 && what && !strcmp(what, "barrier") && atomic_load(&f.group) == &group,
          "a blocked barrier is reported once with its name and group (%d times, \"%s\")", atomic_load(&f.fired),
          what ? what : "(none)");
    CHECK(waited >= 0.2 && waited <= at + 0.05 && at < 2.0, "reported after %.3f s with waited %.3f s (timeout 0.2 s)",
          at, waited);
    dist_watchdog_set_timeout(w, 0); // 0: never
    dist_watchdog_begin(w, "broadcast", NULL);
    sleep_s(0.3);
    dist_watchdog_end(w);
    CHECK(atomic_load(&f.fired) == 1, "timeout 0 again: reported %d times in all (want 1)", atomic_load(&f.fired));
    dist_watchdog_stop(w);
    dist_watchdog_stop(NULL);
    // stopping wakes the thread rather than waiting out its poll
    CHECK(dist_watchdog_start(&w, 5.0, record, &f) == VLMOE_OK, "watchdog start: %s", vlmoe_last_error());
    const double t1 = now_s();
    dist_watchdog_stop(w);
    CHECK(now_s() - t1 < 1.0, "stopping a watchdog that polls every 5 s took %.3f s", now_s() - t1);

    char msg[512];
    const int three[] = {0, 2, 3}, one[] = {0};
    dist_timeout_message(msg, sizeof msg, 1, "allreduce_sum", 3.2, three, 3);
    CHECK(!strcmp(msg, "rank 1: allreduce_sum has waited 3 s for the other processes (one of ranks 0, 2, 3 may have "
                  "stopped or hung): aborting the job"), "message: %s", msg);
    dist_timeout_message(msg, sizeof msg, 1, "barrier", 10, one, 1);
    CHECK(strstr(msg, "(rank 0 may have stopped or hung)"), "message, one other: %s", msg);
    dist_timeout_message(msg, sizeof msg, 0, "barrier", 10, NULL, 0);
    CHECK(strstr(msg, "(another process may have stopped or hung)"), "message, none known: %s", msg);
    int many[200];
    for (int i = 0; i < 200; i++) many[i] = i + 1;
    dist_timeout_message(msg, sizeof msg, 0, "alltoallv", 601, many, 200);
    CHECK(strstr(msg, "(one of ranks 1, 2, 3, ") && strstr(msg, ", ... may have stopped") && strlen(msg) < 300,
          "message, 200 others: %s", msg);
    double v = -1;
    CHECK(!dist_timeout_parse("600", &v) && v == 600 && !dist_timeout_parse("2.5", &v) && v == 2.5 &&
          !dist_timeout_parse("0", &v) && v == 0, "timeouts 600, 2.5, 0 parse");
    const char *bad[] = {"", "-1", "abc", "5s", "inf", "nan", "1e999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(dist_timeout_parse(bad[i], &v) == -1, "timeout \"%s\" is refused", bad[i]);
    CHECK(dist_timeout_parse(NULL, &v) == -1, "no timeout string is refused");
    // the world of one never waits: any timeout is fine, a negative or NaN one is an error
    vlmoe_dist *w1 = vlmoe_dist_single();
    CHECK(vlmoe_dist_set_timeout(w1, 3) == VLMOE_OK && vlmoe_dist_set_timeout(w1, 0) == VLMOE_OK,
          "single: set timeout: %s", vlmoe_last_error());
    CHECK(vlmoe_dist_set_timeout(w1, -1) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "seconds >= 0") &&
          vlmoe_dist_set_timeout(w1, NAN) == VLMOE_ERR_ARG, "negative / NaN timeout: %s", vlmoe_last_error());
    vlmoe_dist_abort(w1, 1); // returns in a world of one
    vlmoe_dist_abort(NULL, 1);
}

int main(int argc, char **argv) {
    long size = -1;
    const char *env = getenv("OMPI_COMM_WORLD_SIZE");
    if (env) size = strtol(env, NULL, 10);
    vlmoe_dist *d = NULL;
    if (size > 0 && !dist_mpi_built()) {
        // under mpirun, built without MPI: each copy refuses to train alone
        CHECK(vlmoe_dist_open(&d, NULL) == (size > 1 ? VLMOE_ERR_CONFIG : VLMOE_OK) &&
              (size == 1 || strstr(vlmoe_last_error(), "built without MPI")), "auto under mpirun without MPI: %s",
              vlmoe_last_error());
        return test_summary("test_dist");
    }
    if (size > 0) {
        // under mpirun: "auto" is MPI, with mpirun's rank and world
        CHECK(vlmoe_dist_open(&d, NULL) == VLMOE_OK, "open auto under mpirun: %s", vlmoe_last_error());
        if (!d) return test_summary("test_dist");
        CHECK(!strcmp(d->name, "mpi") && d->world == size && d->rank == atoi(getenv("OMPI_COMM_WORLD_RANK")),
              "under mpirun -np %ld: %s rank %d of %d", size, d->name, d->rank, d->world);
        CHECK(d->local_world == d->world && d->local_rank == d->rank, "one node: local rank %d of %d",
              d->local_rank, d->local_world);
        check_group(d, &HOST, 1);
        check_nccl();
        vlmoe_dist_close(d);
        return test_summary("test_dist");
    }

    // alone: the world of one, through every door
    check_watchdog();
    vlmoe_dist *one = vlmoe_dist_single();
    CHECK(one->rank == 0 && one->world == 1 && one->local_rank == 0 && one->local_world == 1, "world of one");
    check_group(one, &HOST, 0);
    CHECK(vlmoe_dist_open(&d, NULL) == VLMOE_OK && d == one, "auto without a launcher is the world of one: %s",
          vlmoe_last_error());
    CHECK(vlmoe_dist_open(&d, "single") == VLMOE_OK && d == one, "single: %s", vlmoe_last_error());
    vlmoe_dist_close(d);
    vlmoe_dist_close(NULL);
    CHECK(vlmoe_dist_open(&d, "gloo") == VLMOE_ERR_ARG && !d && strstr(vlmoe_last_error(), "\"gloo\"") &&
          strstr(vlmoe_last_error(), "auto, single, mpi or nccl"), "unknown kind: %s", vlmoe_last_error());
    // a Slurm batch script's own environment is no launch, whatever the allocation's task count
    setenv("SLURM_PROCID", "0", 1), setenv("SLURM_NTASKS", "4", 1);
    CHECK(vlmoe_dist_open(&d, "auto") == VLMOE_OK && d == one && vlmoe_dist_launched(NULL) == 0,
          "Slurm batch step: %s", vlmoe_last_error());
    // ... nor is an srun step of one task; a step of several is
    setenv("SLURM_STEP_NUM_TASKS", "1", 1);
    CHECK(vlmoe_dist_launched(NULL) == 0, "srun step of one task");
    setenv("SLURM_STEP_NUM_TASKS", "4", 1);
    CHECK(vlmoe_dist_launched(NULL) == 4, "srun step of 4 tasks: %ld", vlmoe_dist_launched(NULL));
    unsetenv("SLURM_STEP_NUM_TASKS");
    unsetenv("SLURM_PROCID"), unsetenv("SLURM_NTASKS");
    if (!dist_mpi_built()) {
        CHECK(vlmoe_dist_open(&d, "mpi") == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "libopenmpi-dev"),
              "mpi without MPI: %s", vlmoe_last_error());
        setenv("OMPI_COMM_WORLD_RANK", "0", 1), setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
        CHECK(vlmoe_dist_open(&d, NULL) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "4 processes"),
              "mpirun without MPI: %s", vlmoe_last_error());
        unsetenv("OMPI_COMM_WORLD_RANK"), unsetenv("OMPI_COMM_WORLD_SIZE");
    } else {
        // a bad VLMOE_DIST_TIMEOUT is refused before MPI starts
        setenv("VLMOE_DIST_TIMEOUT", "ten", 1);
        CHECK(vlmoe_dist_open(&d, "mpi") == VLMOE_ERR_CONFIG && !d && strstr(vlmoe_last_error(), "VLMOE_DIST_TIMEOUT=ten"),
              "bad VLMOE_DIST_TIMEOUT: %s", vlmoe_last_error());
        setenv("VLMOE_DIST_TIMEOUT", "30", 1);
        // an MPI build without mpirun: a singleton MPI world of one
        CHECK(vlmoe_dist_open(&d, "mpi") == VLMOE_OK && d && !strcmp(d->name, "mpi") && d->world == 1,
              "mpi alone: %s", vlmoe_last_error());
        unsetenv("VLMOE_DIST_TIMEOUT");
        CHECK(d && vlmoe_dist_set_timeout(d, 5) == VLMOE_OK, "mpi: set timeout: %s", vlmoe_last_error());
        if (d) check_group(d, &HOST, 1);
        check_nccl();
        vlmoe_dist_close(d);
        CHECK(vlmoe_dist_open(&d, "mpi") == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "finalized"),
              "mpi after MPI_Finalize: %s", vlmoe_last_error());
    }
    return test_summary("test_dist");
}
