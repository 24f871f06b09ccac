// dist.h: the process group a training run works in: rank, world, and the collectives data and
// expert parallelism need (all-reduce, all-gather and its backward, all-to-all with variable
// counts, broadcast, barrier). Implementations, chosen at run time by vlmoe_dist_open: "single"
// (a world of one, no MPI needed: src/dist/single.c), "mpi" (src/dist/mpi.c, built when libmpi is
// present) and "nccl" (GPU buffers over an MPI bootstrap, built with CUDA=1). Covered by
// tests/test_dist.c (and, under mpirun, tests/test_dist_mpi.sh).
#ifndef VLMOE_DIST_H
#define VLMOE_DIST_H
#include <stddef.h>

typedef enum {
    VLMOE_DIST_F32,
    VLMOE_DIST_F64,
    VLMOE_DIST_I32,
    VLMOE_DIST_I64,
    VLMOE_DIST_U8,
} vlmoe_dist_type;

size_t vlmoe_dist_type_size(vlmoe_dist_type t);

// Every collective is called by every rank of the world in the same order with matching counts,
// returns VLMOE_OK or a status with the message set (vlmoe_last_error), and is in place where it
// says so. Buffers are host memory for "single" and "mpi", device memory for "nccl". Counts are
// in elements of `t`.
typedef struct vlmoe_dist vlmoe_dist;
typedef struct vlmoe_dist_req vlmoe_dist_req; // a non-blocking collective in flight
struct vlmoe_dist {
    const char *name;       // "single", "mpi", "nccl"
    int rank, world;        // this process and the number of processes
    int local_rank, local_world; // on this node (picks the GPU)
    void *ctx;
    // buf (n) = sum over ranks of buf (n), in place; every rank gets the same bits. "single" and
    // "mpi" add in rank order, ((rank 0 + rank 1) + rank 2) + ..., whatever MPI's own algorithm;
    // "nccl" in NCCL's order (ring, tree, ...), the same on every rank (docs/DISTRIBUTED.md)
    int (*allreduce_sum)(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t);
    // buf (n) = max over ranks of buf (n), in place (flags, divergence checks); exact, but which
    // value wins against a NaN is the engine's choice: turn NaNs into a flag first
    int (*allreduce_max)(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t);
    // recv (world, n) = every rank's send (n), in rank order; in place when send is this rank's
    // row of recv
    int (*allgather)(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t);
    // the backward of allgather: recv (n) = sum over ranks r of send (world, n)[this rank], so the
    // gradient of a gathered tensor reaches the rank that owns each slice; summed like allreduce_sum
    int (*reduce_scatter_sum)(vlmoe_dist *d, void *recv, const void *send, size_t n, vlmoe_dist_type t);
    // rank r sends scount[j] elements at send + sdispl[j] to rank j, and receives rcount[j]
    // elements from rank j at recv + rdispl[j]; counts and displacements in elements
    int (*alltoallv)(vlmoe_dist *d, void *recv, const size_t *rcount, const size_t *rdispl,
                     const void *send, const size_t *scount, const size_t *sdispl, vlmoe_dist_type t);
    // buf (n) on every rank = buf (n) of rank `root`
    int (*broadcast)(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, int root);
    int (*barrier)(vlmoe_dist *d);
    // the processes with the same color, ranked by key, as a group of their own (vlmoe_dist_split)
    int (*split)(vlmoe_dist *d, int color, int key, vlmoe_dist **out);
    void (*close)(vlmoe_dist *d);
    // (vlmoe_dist_set_timeout) the longest one collective of this process may wait, 0: none
    int (*set_timeout)(vlmoe_dist *d, double seconds);
    // (vlmoe_dist_abort) ends every process of the run; returns only in a world of one
    void (*abort)(vlmoe_dist *d, int code);
    // Non-blocking allreduce_sum (NULL: the group has none, vlmoe_dist_iallreduce_sum blocks):
    // starts buf (n) = the rank-order sum and sets *req (NULL when it finished at the call); buf
    // must not be touched until vlmoe_dist_wait. Same bits as allreduce_sum, and every rank
    // starts its non-blocking and blocking collectives in the same order (MPI matches them so).
    int (*iallreduce_sum)(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, vlmoe_dist_req **req);
    // lets req progress without blocking (MPI moves a collective along only inside its calls);
    // *done 1 once it finished (req stays valid until wait)
    int (*test)(vlmoe_dist *d, vlmoe_dist_req *req, int *done);
    // blocks until req finished, under the collective timeout, and frees it (NULL: nothing).
    // Every rank waits for its sums in the order it started them: a sum's second half starts
    // inside this rank's test or wait of it, so waits in orders that differ between ranks could
    // each wait for a half the other has not started (src/dist/mpi.c)
    int (*wait)(vlmoe_dist *d, vlmoe_dist_req *req);
};

// The non-blocking all-reduce of a group, or its blocking one (*req NULL) when it has none; test
// and wait are NULL-safe (a NULL req is done). Data parallelism overlaps the gradient buckets'
// sums with the backward this way (src/train/buckets.c).
int vlmoe_dist_iallreduce_sum(vlmoe_dist *d, void *buf, size_t n, vlmoe_dist_type t, vlmoe_dist_req **req);
int vlmoe_dist_test(vlmoe_dist *d, vlmoe_dist_req *req, int *done);
int vlmoe_dist_wait(vlmoe_dist *d, vlmoe_dist_req *req);

// kind: "single", "mpi", "nccl", or "auto" (NULL): "mpi" when the process was started by mpirun
// or srun and MPI is built in, else "single" (but an error when a launcher started several copies
// of a build without MPI: they would each train alone). Asking for a kind that is not built in is
// an error that says how to build it. The world of one needs nothing and cannot fail. MPI starts
// once per process: open "mpi" (or "nccl", which opens it) and keep it until the end of the run.
int vlmoe_dist_open(vlmoe_dist **out, const char *kind);
// Whether a multi-process launcher started this process, without starting MPI: 0 when none did,
// else the number of processes it started (-1 when it does not say); *by (may be NULL) names it.
long vlmoe_dist_launched(const char **by);
// The processes of d with the same color, ranked by key (every process of d calls it, in the same
// order as its collectives); closed with vlmoe_dist_close. A world of one splits into itself.
int vlmoe_dist_split(vlmoe_dist *d, int color, int key, vlmoe_dist **out);
// The collective timeout, like torch.distributed's: a collective of any group of this process
// that has waited longer than `seconds` for the others (one of them stopped or hung) makes a
// watchdog thread call the handler of vlmoe_dist_on_timeout with "rank R: <collective> has waited
// N s for the other processes (...): aborting the job (--dist-timeout S s)". A blocked collective
// cannot be cancelled, so the handler (the command line's) ends the job: vlmoe_dist_abort. The
// library itself never does. 0: no timeout. "mpi" starts with VLMOE_DIST_TIMEOUT's seconds, else 600; the world of one
// never waits and ignores it. An error for a negative or non-finite value.
int vlmoe_dist_set_timeout(vlmoe_dist *d, double seconds);
// The timeout's handler, for every group of this process (NULL: none; a timeout then goes
// unreported and the collective keeps waiting). It runs on the watchdog's thread, once per
// collective that times out; if it returns, the watchdog goes on watching.
typedef void (*vlmoe_dist_timeout_fn)(void *user, const char *message);
void vlmoe_dist_on_timeout(vlmoe_dist_timeout_fn fn, void *user);
// Ends every process of the run with exit status `code` (MPI_Abort), for the command line when
// this process failed (or a collective timed out) while the others may be waiting for it: the
// job's exit, as exit() is a process's. The caller prints why first. The library never calls it
// itself; in a world of one it returns and the caller exits as usual.
void vlmoe_dist_abort(vlmoe_dist *d, int code);
// a world of one, for callers that never go distributed (tests, the single-process paths)
vlmoe_dist *vlmoe_dist_single(void);
void vlmoe_dist_close(vlmoe_dist *d); // NULL-safe; the world of one is static and never freed

#endif
