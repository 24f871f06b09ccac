// buckets.c: the gradient sum of data parallelism in buckets (src/train/buckets.h), as PyTorch's
// DDP does it: the flat gradient is cut into runs of whole parameters; the backward reports each
// parameter whose gradient it finished, and a bucket whose every gradient is final is summed over
// the processes with a non-blocking all-reduce while the backward goes on with earlier blocks.
// Buckets are contiguous in the flat buffer (no copies) and start in one fixed order, the last
// bucket first, on every process whatever its backward did: MPI matches collectives by the order
// they start in, so a process whose forward failed (it starts them all at the end) still matches.
// The sums are elementwise and in rank order (src/dist/mpi.c), so cutting the buffer into pieces
// leaves every bit as one all-reduce of the whole. Covered by tests/test_train_dist.c.
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "train/buckets.h"

typedef struct {
    size_t off, n;          // floats of the flat gradient
    size_t need, got;       // floats whose gradient is final, of n
    vlmoe_dist_req *req;
    int started, done;
} bucket;

struct train_buckets {
    const vlmoe_param_info *tab;
    int nparams;
    int *bucket_of;         // (nparams) the bucket of each parameter
    unsigned char *ready;   // (nparams) reported final this step
    bucket *b;
    int nb;
    int next;               // the next bucket to start: nb-1 down to 0, -1 when all started
    int oldest;             // the oldest started bucket not known done (progress)
    float *grads;
    vlmoe_dist *d;
    int st;                 // the step's first error
    int early;
    double finish_s;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int buckets_init(train_buckets **out, const vlmoe_param_info *tab, int n, size_t total, float *grads, double cap_mb) {
    *out = NULL;
    size_t at = 0;
    for (int i = 0; i < n; at += tab[i].numel, i++)
        if (tab[i].offset != at) // the layout is built this way (layout_add); a bucket relies on it
            return vlmoe_fail(VLMOE_ERR_ARG, "gradient buckets: parameter '%s' starts at float %zu, expected %zu "
                              "(the parameter table must cover the flat buffer in order)", tab[i].name, tab[i].offset, at);
    if (at != total)
        return vlmoe_fail(VLMOE_ERR_ARG, "gradient buckets: the parameters cover %zu floats of %zu", at, total);
    train_buckets *b = calloc(1, sizeof *b);
    if (b) b->bucket_of = malloc(sizeof(int) * (size_t)(n ? n : 1)), b->ready = calloc((size_t)(n ? n : 1), 1),
           b->b = calloc((size_t)(n ? n : 1), sizeof(bucket));
    if (!b || !b->bucket_of || !b->ready || !b->b)
        return buckets_free(b), vlmoe_fail(VLMOE_ERR_NOMEM, "gradient buckets for %d parameters", n);
    // cap in floats; at least one float, so a tiny cap gives one parameter per bucket
    const double capf = cap_mb > 0 ? cap_mb * 1e6 / sizeof(float) : (double)total + 1;
    for (int i = 0; i < n; i++) {
        bucket *k = b->nb ? &b->b[b->nb - 1] : NULL;
        if (!k || (double)(k->n + tab[i].numel) > capf) k = &b->b[b->nb++], k->off = tab[i].offset;
        k->n += tab[i].numel;
        b->bucket_of[i] = b->nb - 1;
    }
    b->tab = tab, b->nparams = n, b->grads = grads;
    *out = b;
    return VLMOE_OK;
}

void buckets_free(train_buckets *b) {
    if (!b) return;
    free(b->bucket_of), free(b->ready), free(b->b);
    free(b);
}

void buckets_begin(train_buckets *b, vlmoe_dist *d) {
    b->d = d, b->st = VLMOE_OK, b->early = 0, b->finish_s = 0;
    memset(b->ready, 0, (size_t)b->nparams);
    for (int i = 0; i < b->nb; i++) b->b[i].got = 0, b->b[i].need = b->b[i].n, b->b[i].req = NULL,
                                    b->b[i].started = b->b[i].done = 0;
    b->next = b->oldest = b->nb - 1;
}

static void start(train_buckets *b, bucket *k) {
    k->started = 1;
    if (b->st) { // the group is broken: start nothing more, buckets_finish reports it
        k->done = 1;
        return;
    }
    b->st = vlmoe_dist_iallreduce_sum(b->d, b->grads + k->off, k->n, VLMOE_DIST_F32, &k->req);
    if (b->st) vlmoe_error_prefix("gradient bucket of floats [%zu, %zu)", k->off, k->off + k->n);
    k->done = !k->req;
}

// Starts the complete buckets that are next in order (`all`: every one left).
static void start_ready(train_buckets *b, int all) {
    for (; b->next >= 0 && (all || b->b[b->next].got == b->b[b->next].need); b->next--) start(b, &b->b[b->next]);
}

// MPI moves a non-blocking collective along only inside MPI calls (Open MPI has no progress
// thread by default): test the buckets in flight, oldest first, between the backward's blocks.
static void progress(train_buckets *b) {
    for (; !b->st && b->oldest > b->next; b->oldest--) {
        bucket *k = &b->b[b->oldest];
        if (!k->done && (b->st = vlmoe_dist_test(b->d, k->req, &k->done))) return;
        if (!k->done) return;
    }
}

static int find(const train_buckets *b, size_t offset) {
    int lo = 0, hi = b->nparams - 1;
    while (lo <= hi) {
        const int mid = lo + (hi - lo) / 2;
        if (b->tab[mid].offset == offset) return mid;
        if (b->tab[mid].offset < offset) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

void buckets_ready(void *user, size_t offset) {
    train_buckets *b = user;
    const int i = find(b, offset);
    if (i < 0 || b->ready[i]) return; // not a parameter's start (cannot happen), or told twice
    b->ready[i] = 1;
    bucket *k = &b->b[b->bucket_of[i]];
    if (!k->started) k->got += b->tab[i].numel;
    const int before = b->next;
    start_ready(b, 0);
    b->early += before - b->next;
    progress(b);
}

int buckets_finish(train_buckets *b) {
    const double t0 = now_s();
    start_ready(b, 1);
    int st = b->st;
    // wait for every request, even after an error (each owns memory MPI may still write), in the
    // order they started on every process (dist.h: the waits' order must be the same everywhere)
    for (int i = b->nb - 1; i >= 0; i--) {
        int e = vlmoe_dist_wait(b->d, b->b[i].req);
        b->b[i].req = NULL, b->b[i].done = 1;
        if (e && !st) {
            vlmoe_error_prefix("gradient bucket of floats [%zu, %zu)", b->b[i].off, b->b[i].off + b->b[i].n);
            st = e;
        }
    }
    b->finish_s = now_s() - t0;
    return st;
}

buckets_info buckets_get_info(const train_buckets *b) {
    buckets_info r = {b ? b->nb : 0, b ? b->early : 0, b ? b->finish_s : 0, 0};
    for (int i = 0; b && i < b->nb; i++)
        if (b->b[i].n > r.largest) r.largest = b->b[i].n;
    return r;
}
