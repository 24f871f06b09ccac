// nccl.c: the process group over NCCL (src/dist/dist.h), built with `make CUDA=1`: buffers are
// device memory on this rank's GPU, the communicator is bootstrapped over MPI (src/dist/mpi.c
// broadcasts rank 0's ncclUniqueId). Stream contract: a collective runs on this group's own
// stream and has finished when it returns, so the caller finishes writing its buffers first (its
// backend's sync) and may read them right after. Compiled in CI without a GPU; its checks in
// tests/test_dist.c run only where a device is present (docs/DISTRIBUTED.md).
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/core.h"
#include "dist/impl.h"
#include "dist/watchdog.h"

typedef struct {
    ncclComm_t comm;
    cudaStream_t stream;
    vlmoe_dist *boot;      // the MPI group that bootstrapped NCCL: rank, world, the barrier
    int device;
    double timeout;        // seconds a collective may wait for the others (finish), 0: none
} nccl_ctx;

static int nccl_type(vlmoe_dist_type t, ncclDataType_t *out, const char *what) {
    switch (t) {
    case VLMOE_DIST_F32: *out = ncclFloat32; return VLMOE_OK;
    case VLMOE_DIST_F64: *out = ncclFloat64; return VLMOE_OK;
    case VLMOE_DIST_I32: *out = ncclInt32; return VLMOE_OK;
    case VLMOE_DIST_I64: *out = ncclInt64; return VLMOE_OK;
    case VLMOE_DIST_U8: *out = ncclUint8; return VLMOE_OK;
    }
    return vlmoe_fail(VLMOE_ERR_ARG, "%s: unknown element type %d", what, (int)t);
}

static int nccl_fail(const vlmoe_dist *d, ncclResult_t r, const char *call, const char *what) {
    const nccl_ctx *c = d->ctx;
    const char *last = c && c->comm ? ncclGetLastError(c->comm) : NULL;
    return vlmoe_fail(VLMOE_ERR_IO, "%s (rank %d of %d, cuda:%d): %s failed: %s%s%s", what, d->rank,
                      d->world, c ? c->device : -1, call, ncclGetErrorString(r), last && *last ? ": " : "",
                      last ? last : "");
}

static int cuda_fail(const vlmoe_dist *d, cudaError_t e, const char *call, const char *what) {
    return vlmoe_fail(VLMOE_ERR_IO, "%s (rank %d of %d): %s failed: %s", what, d->rank, d->world, call,
                      cudaGetErrorString(e));
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Waits for the stream while watching the communicator: a peer that died or a network error
// shows up as an asynchronous NCCL error, and the communicator is aborted rather than the
// process hanging in cudaStreamSynchronize. The collective timeout is NCCL's watchdog in the
// same loop: this thread is the one waiting, so past the timeout it aborts the communicator
// (ncclCommAbort, which unblocks the kernels) and returns the error, and the caller ends the
// job (vlmoe_dist_abort). No thread of its own is needed, unlike MPI's blocking calls.
static int finish(vlmoe_dist *d, ncclResult_t r, const char *call, const char *what) {
    nccl_ctx *c = d->ctx;
    if (r != ncclSuccess) return nccl_fail(d, r, call, what);
    const double t0 = c->timeout > 0 ? mono_s() : 0;
    for (unsigned spins = 1;; spins++) {
        cudaError_t e = cudaStreamQuery(c->stream);
        if (e == cudaSuccess) return VLMOE_OK;
        if (e != cudaErrorNotReady) return cuda_fail(d, e, "cudaStreamQuery", what);
        ncclResult_t async = ncclSuccess;
        if ((r = ncclCommGetAsyncError(c->comm, &async)) != ncclSuccess) return nccl_fail(d, r, "ncclCommGetAsyncError", what);
        if (async != ncclSuccess) {
            int st = nccl_fail(d, async, call, what);
            ncclCommAbort(c->comm);
            c->comm = NULL;
            return st;
        }
        const double waited = c->timeout > 0 && spins % 1024 == 0 ? mono_s() - t0 : 0;
        if (waited > c->timeout && c->timeout > 0) {
            char msg[512];
            int *others = malloc((size_t)d->world * sizeof *others), n = 0;
            for (int j = 0; others && j < d->world; j++)
                if (j != d->rank) others[n++] = j;
            dist_timeout_message(msg, sizeof msg, d->rank, what, waited, others, n);
            free(others);
            ncclCommAbort(c->comm);
            c->comm = NULL;
            return vlmoe_fail(VLMOE_ERR_IO, "%s (cuda:%d, --dist-timeout %g s; the NCCL communicator was aborted)",
                              msg, c->device, c->timeout);
        }
        sched_yield();
    }
}

static int usable(vlmoe_dist *d, ncclDataType_t *dt, vlmoe_dist_type t, const char *what) {
    const nccl_ctx *c = d->ctx;
    if (!c->comm)
        return vlmoe_fail(VLMOE_ERR_IO, "%s (rank %d of %d): the NCCL communicator was aborted after an "
                          "earlier error", what, d->rank, d->world);
    return nccl_type(t, dt, what);
}

// NCCL reduces each element once and sends that result to every rank, so all ranks get the same
// bits; the order of the sum is NCCL's (ring, tree or NVLS by size and topology), not rank order.
static int nccl_allreduce_sum(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    nccl_ctx *c = d->ctx;
    ncclDataType_t dt = ncclFloat32;
    int st = usable(d, &dt, t, "allreduce_sum");
    if (st || n == 0) return st;
    return finish(d, ncclAllReduce(buf, buf, n, dt, ncclSum, c->comm, c->stream), "ncclAllReduce", "allreduce_sum");
}

static int nccl_allreduce_max(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t) {
    nccl_ctx *c = d->ctx;
    ncclDataType_t dt = ncclFloat32;
    int st = usable(d, &dt, t, "allreduce_max");
    if (st || n == 0) return st;
    return finish(d, ncclAllReduce(buf, buf, n, dt, ncclMax, c->comm, c->stream), "ncclAllReduce", "allreduce_max");
}

// in place when send is this rank's row of recv, which NCCL supports as such
static int nccl_allgather(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    nccl_ctx *c = d->ctx;
    ncclDataType_t dt = ncclFloat32;
    int st = usable(d, &dt, t, "allgather");
    if (st || n == 0) return st;
    return finish(d, ncclAllGather(send, recv, n, dt, c->comm, c->stream), "ncclAllGather", "allgather");
}

static int nccl_reduce_scatter_sum(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t) {
    nccl_ctx *c = d->ctx;
    ncclDataType_t dt = ncclFloat32;
    int st = usable(d, &dt, t, "reduce_scatter_sum");
    if (st || n == 0) return st;
    return finish(d, ncclReduceScatter(send, recv, n, dt, ncclSum, c->comm, c->stream), "ncclReduceScatter",
                  "reduce_scatter_sum");
}

// point-to-point pairs in one group, which NCCL runs together (a send to itself included)
static int nccl_alltoallv(vlmoe_dist *d, void *recv, const size_t *rcount, const size_t *rdispl,
                          const void *send, const size_t *scount, const size_t *sdispl, vlmoe_dist_type t) {
    nccl_ctx *c = d->ctx;
    ncclDataType_t dt = ncclFloat32;
    int st = usable(d, &dt, t, "alltoallv");
    if (st) return st;
    const size_t es = vlmoe_dist_type_size(t);
    ncclResult_t r = ncclGroupStart();
    const char *call = "ncclGroupStart";
    for (int j = 0; j < d->world && r == ncclSuccess; j++) {
        if (scount[j] && (r = ncclSend((const char *)send + sdispl[j] * es, scount[j], dt, j, c->comm, c->stream)))
            call = "ncclSend";
        if (r == ncclSuccess && rcount[j] &&
            (r = ncclRecv((char *)recv + rdispl[j] * es, rcount[j], dt, j, c->comm, c->stream)))
            call = "ncclRecv";
    }
    // a group once started is always ended, even after an error inside it
    ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end, call = "ncclGroupEnd";
    return finish(d, r, call, "alltoallv");
}

static int nccl_broadcast(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, int root) {
    nccl_ctx *c = d->ctx;
    ncclDataType_t dt = ncclFloat32;
    int st = usable(d, &dt, t, "broadcast");
    if (st) return st;
    if (root < 0 || root >= d->world)
        return vlmoe_fail(VLMOE_ERR_ARG, "broadcast from rank %d in a world of %d", root, d->world);
    if (n == 0) return VLMOE_OK;
    return finish(d, ncclBroadcast(buf, buf, n, dt, root, c->comm, c->stream), "ncclBroadcast", "broadcast");
}

// Every collective has finished on this GPU when it returns, so a host barrier is one for the
// GPU work too; NCCL has none of its own.
static int nccl_barrier(vlmoe_dist *d) {
    nccl_ctx *c = d->ctx;
    return c->boot->barrier(c->boot);
}

// Groups of NCCL processes would need communicators of their own (ncclCommSplit): not built.
static int nccl_split(vlmoe_dist *d, int color, int key, vlmoe_dist **out) {
    *out = NULL;
    return vlmoe_fail(VLMOE_ERR_CONFIG, "the nccl process group cannot be split into smaller groups yet");
}

static int nccl_set_timeout(vlmoe_dist *d, double seconds) {
    nccl_ctx *c = d->ctx;
    c->timeout = seconds;
    return c->boot->set_timeout(c->boot, seconds); // its barrier and the bootstrap's collectives
}

static void nccl_abort(vlmoe_dist *d, int code) {
    nccl_ctx *c = d->ctx;
    if (c->comm) ncclCommAbort(c->comm), c->comm = NULL;
    c->boot->abort(c->boot, code);
}

static void nccl_close(vlmoe_dist *d) {
    nccl_ctx *c = d->ctx;
    if (c) {
        if (c->comm) ncclCommFinalize(c->comm), ncclCommDestroy(c->comm);
        if (c->stream) cudaStreamDestroy(c->stream);
        vlmoe_dist_close(c->boot);
        free(c);
    }
    free(d);
}

int dist_nccl_open(vlmoe_dist **out) {
    *out = NULL;
    vlmoe_dist *boot = NULL;
    int st = dist_mpi_open(&boot);
    if (st) {
        vlmoe_error_prefix("distributed backend \"nccl\": its MPI bootstrap");
        return st;
    }
    vlmoe_dist *d = calloc(1, sizeof *d);
    nccl_ctx *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d), free(c);
        vlmoe_dist_close(boot);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "distributed backend \"nccl\": out of memory");
    }
    *d = (vlmoe_dist){"nccl", boot->rank, boot->world, boot->local_rank, boot->local_world, c,
                      nccl_allreduce_sum, nccl_allreduce_max, nccl_allgather, nccl_reduce_scatter_sum,
                      nccl_alltoallv, nccl_broadcast, nccl_barrier, nccl_split, nccl_close,
                      nccl_set_timeout, nccl_abort,
                      // the gradient buckets' sums: ncclAllReduce on the group's stream is already
                      // asynchronous to the host, but the buckets still wait for each (not overlapped)
                      NULL, NULL, NULL};
    c->boot = boot;
    const char *env = getenv("VLMOE_DIST_TIMEOUT"); // checked by the bootstrap's open
    if (!env || dist_timeout_parse(env, &c->timeout)) c->timeout = DIST_TIMEOUT_DEFAULT;
    const char *what = "distributed backend \"nccl\"";
    // One GPU per rank: the rank's place on its node picks it, or the one GPU a rank sees when
    // the launcher gave each rank its own (CUDA_VISIBLE_DEVICES).
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess) st = cuda_fail(d, e, "cudaGetDeviceCount", what);
    else if (ndev > 1 && ndev < d->local_world)
        st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s (rank %d of %d): %d ranks on this node but %d visible GPUs; "
                        "NCCL needs one GPU per rank", what, d->rank, d->world, d->local_world, ndev);
    else if ((e = cudaSetDevice(c->device = ndev == 1 ? 0 : d->local_rank)) != cudaSuccess)
        st = cuda_fail(d, e, "cudaSetDevice", what);
    else if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess)
        st = cuda_fail(d, e, "cudaStreamCreateWithFlags", what);
    // A rank that failed tells the others before NCCL's init, which would wait for it forever.
    int32_t failed = st != VLMOE_OK;
    const int st_all = boot->allreduce_max(boot, &failed, 1, VLMOE_DIST_I32);
    if (!st && !st_all && failed)
        st = vlmoe_fail(VLMOE_ERR_IO, "%s (rank %d of %d): another rank could not set up its GPU", what,
                        d->rank, d->world);
    if (st || st_all) {
        nccl_close(d);
        return st ? st : st_all;
    }
    // rank 0's unique id, and whether it could make one, to every rank
    struct { ncclUniqueId id; int32_t failed; } hello;
    memset(&hello, 0, sizeof hello);
    ncclResult_t r = ncclSuccess;
    if (d->rank == 0 && (r = ncclGetUniqueId(&hello.id)) != ncclSuccess) hello.failed = 1;
    if ((st = boot->broadcast(boot, &hello, sizeof hello, VLMOE_DIST_U8, 0)) ||
        (hello.failed && (st = d->rank == 0 ? nccl_fail(d, r, "ncclGetUniqueId", what)
                                            : vlmoe_fail(VLMOE_ERR_IO, "%s: rank 0 could not make NCCL's "
                                                         "unique id", what)))) {
        nccl_close(d);
        return st;
    }
    if ((r = ncclCommInitRank(&c->comm, d->world, hello.id, d->rank)) != ncclSuccess) {
        c->comm = NULL;
        st = nccl_fail(d, r, "ncclCommInitRank", what);
        nccl_close(d);
        return st;
    }
    *out = d;
    return VLMOE_OK;
}
