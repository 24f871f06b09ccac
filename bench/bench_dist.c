// bench_dist.c: a data-parallel (optionally expert-parallel) contrastive training step on the
// processes mpirun started, with the time spent in each collective. Every process trains its
// block of the global batch on the synthetic data; the process group is wrapped so that every
// all-reduce, all-gather and all-to-all is timed and its bytes counted. Rank 0 prints one JSON
// line: world, expert parallelism, median step seconds, and per step the seconds and bytes of
// the gradient all-reduce, the embedding all-gathers and the experts' all-to-alls. bench/dist.sh
// runs it at world 1 and 2 and prints the table of the README.
// With --bucket-cap-mb MB the gradient is summed in buckets during the backward (src/train/buckets.c;
// default 25, 0: one sum after it) and the all-reduce seconds are those spent inside its calls.
// Usage: [mpirun -np W] bench_dist MODEL.json [--batch B] [--steps N] [--warmup N] [--expert-parallel]
//        [--bucket-cap-mb MB]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "dist/dist.h"
#include "train/buckets.h"
#include "train/run.h"
#include "train/tasks.h"

enum { AR, AG, A2A, NKIND };
static vlmoe_dist *inner;
static double t_in[NKIND], bytes_in[NKIND];

static int w_allreduce_sum(vlmoe_dist *d, void *b, size_t n, vlmoe_dist_type t) {
    const double t0 = bench_now();
    int st = inner->allreduce_sum(inner, b, n, t);
    t_in[AR] += bench_now() - t0, bytes_in[AR] += (double)n * vlmoe_dist_type_size(t);
    return st;
}
static int w_allreduce_max(vlmoe_dist *d, void *b, size_t n, vlmoe_dist_type t) {
    return inner->allreduce_max(inner, b, n, t);
}
static int w_allgather(vlmoe_dist *d, void *r, const void *s, size_t n, vlmoe_dist_type t) {
    const double t0 = bench_now();
    int st = inner->allgather(inner, r, s, n, t);
    t_in[AG] += bench_now() - t0, bytes_in[AG] += (double)n * inner->world * vlmoe_dist_type_size(t);
    return st;
}
static int w_reduce_scatter(vlmoe_dist *d, void *r, const void *s, size_t n, vlmoe_dist_type t) {
    return inner->reduce_scatter_sum(inner, r, s, n, t);
}
static int w_alltoallv(vlmoe_dist *d, void *r, const size_t *rc, const size_t *rd, const void *s, const size_t *sc,
                       const size_t *sd, vlmoe_dist_type t) {
    const double t0 = bench_now();
    int st = inner->alltoallv(inner, r, rc, rd, s, sc, sd, t);
    t_in[A2A] += bench_now() - t0;
    for (int j = 0; j < inner->world; j++) bytes_in[A2A] += (double)sc[j] * vlmoe_dist_type_size(t);
    return st;
}
static int w_broadcast(vlmoe_dist *d, void *b, size_t n, vlmoe_dist_type t, int root) {
    return inner->broadcast(inner, b, n, t, root);
}
static int w_barrier(vlmoe_dist *d) { return inner->barrier(inner); }
static int w_split(vlmoe_dist *d, int color, int key, vlmoe_dist **out) { return inner->split(inner, color, key, out); }
static void w_close(vlmoe_dist *d) {}
static int w_set_timeout(vlmoe_dist *d, double s) { return inner->set_timeout(inner, s); }
static void w_abort(vlmoe_dist *d, int code) { inner->abort(inner, code); }
// The gradient buckets' sums: only the time spent inside the calls counts (start, test, wait),
// the part the backward does not hide: the all-reduce time exposed.
static int w_iallreduce_sum(vlmoe_dist *d, void *b, size_t n, vlmoe_dist_type t, vlmoe_dist_req **req) {
    const double t0 = bench_now();
    int st = vlmoe_dist_iallreduce_sum(inner, b, n, t, req);
    t_in[AR] += bench_now() - t0, bytes_in[AR] += (double)n * vlmoe_dist_type_size(t);
    return st;
}
static int w_test(vlmoe_dist *d, vlmoe_dist_req *req, int *done) {
    const double t0 = bench_now();
    int st = vlmoe_dist_test(inner, req, done);
    t_in[AR] += bench_now() - t0;
    return st;
}
static int w_wait(vlmoe_dist *d, vlmoe_dist_req *req) {
    const double t0 = bench_now();
    int st = vlmoe_dist_wait(inner, req);
    t_in[AR] += bench_now() - t0;
    return st;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_dist MODEL.json [--batch B] [--steps N] [--warmup N] [--expert-parallel]\n");
        return 2;
    }
    int B = 32, steps = 6, warmup = 1, ep = 0;
    double cap = 25;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--expert-parallel")) ep = 1;
        else if (!strcmp(argv[i], "--bucket-cap-mb") && i + 1 < argc) cap = atof(argv[++i]);
        else return fprintf(stderr, "bench_dist: unknown argument %s\n", argv[i]), 2;
    }
    if (vlmoe_dist_open(&inner, "auto")) return fprintf(stderr, "bench_dist: %s\n", vlmoe_last_error()), 1;
    vlmoe_dist timed = {"timed", inner->rank, inner->world, inner->local_rank, inner->local_world, NULL,
                        w_allreduce_sum, w_allreduce_max, w_allgather, w_reduce_scatter, w_alltoallv,
                        w_broadcast, w_barrier, w_split, w_close, w_set_timeout, w_abort,
                        w_iallreduce_sum, w_test, w_wait};
    vlmoe_model_config c;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_synth *s = NULL;
    vlmoe_contrastive *task = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.bucket_cap_mb = cap;
    int st = vlmoe_config_load(argv[1], &c);
    sp.image_size = c.image_size;
    if (!st) st = vlmoe_model_init(&m, &c, 1);
    if (!st) st = vlmoe_model_plan(m, B);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    if (!st) st = vlmoe_synth_init(&s, &sp);
    const vlmoe_contrastive_params cp = {.model = m, .batch_size = B, .synth = s, .rank = timed.rank, .world = timed.world,
                                         .accum_freq = 1};
    if (!st) st = vlmoe_contrastive_init(&task, &cp);
    if (st) return fprintf(stderr, "bench_dist: %s\n", vlmoe_last_error()), 1;
    const vlmoe_run_task rt = vlmoe_contrastive_task(task);
    vlmoe_trainer_set_dist(t, &timed, ep ? &timed : NULL);
    double *ts = malloc(sizeof(double) * (size_t)steps), loss = 0;
    for (int i = 0; i < warmup + steps && !st; i++) {
        if (i == warmup) memset(t_in, 0, sizeof(t_in)), memset(bytes_in, 0, sizeof(bytes_in));
        vlmoe_step_stats ss;
        inner->barrier(inner);
        const double t0 = bench_now();
        st = rt.fill(rt.user, i);
        if (!st) st = rt.step(rt.user, t, i, &ss);
        if (i >= warmup) ts[i - warmup] = bench_now() - t0;
        loss = ss.loss;
    }
    if (st) return fprintf(stderr, "bench_dist: %s\n", vlmoe_last_error()), 1;
    qsort(ts, (size_t)steps, sizeof(double), bench_cmp);
    // the slowest process's collective times: a collective waits for the last process to arrive
    double tmax[NKIND];
    memcpy(tmax, t_in, sizeof(tmax));
    inner->allreduce_max(inner, tmax, NKIND, VLMOE_DIST_F64);
    const buckets_info bi = trainer_buckets_info(t);
    if (inner->rank == 0)
        printf("{\"model\": \"%s\", \"world\": %d, \"expert_parallel\": %d, \"batch_per_process\": %d, \"global_batch\": "
               "%d, \"step_s\": %.5f, \"allreduce_s\": %.5f, \"allreduce_mb\": %.2f, \"allgather_s\": %.5f, "
               "\"allgather_mb\": %.3f, \"alltoall_s\": %.5f, \"alltoall_mb\": %.3f, \"loss\": %.6f, "
               "\"bucket_cap_mb\": %g, \"buckets\": %d, \"buckets_started_in_backward\": %d}\n",
               c.name, inner->world, ep, B, B * inner->world, ts[steps / 2], tmax[AR] / steps,
               bytes_in[AR] / steps / 1e6, tmax[AG] / steps, bytes_in[AG] / steps / 1e6, tmax[A2A] / steps,
               bytes_in[A2A] / steps / 1e6, loss, cap, bi.count, bi.started_early);
    vlmoe_trainer_set_dist(t, NULL, NULL);
    vlmoe_contrastive_free(task), vlmoe_synth_free(s), vlmoe_trainer_free(t), vlmoe_model_free(m), free(ts);
    vlmoe_dist_close(inner);
    return 0;
}
