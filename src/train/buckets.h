// buckets.h: data parallelism's gradient sum in buckets, each started as soon as the backward has
// finished its last gradient and waited for before the optimizer step (PyTorch DDP's buckets,
// bucket_cap_mb). Internal to src/train (trainer.c); covered by tests/test_train_dist.c under
// mpirun (bucketed against one all-reduce, bit for bit) and measured by bench/dist.sh.
#ifndef VLMOE_TRAIN_BUCKETS_H
#define VLMOE_TRAIN_BUCKETS_H
#include <stddef.h>

#include "dist/dist.h"
#include "vlmoe.h"

typedef struct train_buckets train_buckets;

// Buckets over the flat gradient grads (total floats) of the parameter table tab (n, in offset
// order and covering [0, total) without gaps): runs of whole parameters in table order of at
// most cap_mb megabytes (10^6 bytes) each, one parameter alone when it is larger; cap_mb <= 0:
// one bucket, the whole buffer summed once after the backward.
int buckets_init(train_buckets **out, const vlmoe_param_info *tab, int n, size_t total, float *grads, double cap_mb);
void buckets_free(train_buckets *b); // NULL-safe; waits for nothing: call buckets_finish first
// A new step over group d: no gradient final yet, no bucket started.
void buckets_begin(train_buckets *b, vlmoe_dist *d);
// The backward's hook (model_set_grad_ready; user is the train_buckets): the gradient of the
// parameter at `offset` is final. Starts every bucket that is complete and next in the fixed
// order (last bucket first: the backward's order), and lets those in flight progress.
void buckets_ready(void *user, size_t offset);
// Starts the buckets not started yet (every one, when the backward failed or has no hook), in
// the same order, then waits for all: the gradient is the sum over the processes, bit for bit that
// of one allreduce_sum of the whole buffer. The first error of the step, if any.
int buckets_finish(train_buckets *b);

typedef struct {
    int count;              // buckets
    int started_early;      // of them, started by the hook during the last step's backward
    double finish_s;        // seconds the last step spent in buckets_finish (the exposed wait)
    size_t largest;         // floats in the largest bucket
} buckets_info;
buckets_info buckets_get_info(const train_buckets *b);
// The trainer's buckets (all zero before its first data-parallel step): tests and benches.
buckets_info trainer_buckets_info(const vlmoe_trainer *t);

#endif
