// bench_loader_dist.c: what each process of a data-parallel run spends preparing its data
// (src/data/loader.c): decoding, preprocessing and tokenizing only its block of the global batch,
// and agreeing with the others on the bad samples. Run it alone and under mpirun at the same
// global batch; docs/DISTRIBUTED.md reports the numbers. Not part of `make bench` (it wants a
// data set): vlmoe synth export --out shapes --n 2000 --image-size 224, then
//   build/rel/bench/bench_loader_dist shapes/captions.csv 64 10
//   mpirun -np 2 --oversubscribe build/rel/bench/bench_loader_dist shapes/captions.csv 64 10
// The loader runs with no worker thread, so every sample it prepares is prepared inside
// vlmoe_loader_next on the caller's thread: the time there is the data time of a step.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "data/loader.h"
#include "dist/dist.h"

static int agree(void *u, uint8_t *k, size_t n) {
    vlmoe_dist *d = u;
    return d->allreduce_max(d, k, n, VLMOE_DIST_U8);
}

// A byte tokenizer that counts its calls: one per sample prepared (decoded and kept).
static long tokenized;
static int tok(void *user, const char *text, int32_t *ids, int ctx) {
    int n = 0;
    ids[n++] = 1;
    for (const char *p = text; *p && n < ctx - 1; p++) ids[n++] = (unsigned char)*p;
    ids[n++] = 2;
    for (int i = n; i < ctx; i++) ids[i] = 0;
    (void)user;
    tokenized++;
    return n;
}

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s DATA(.csv|.tar) GLOBAL_BATCH STEPS [IMAGE_SIZE]\n", argv[0]);
        return 2;
    }
    const int G = atoi(argv[2]), steps = atoi(argv[3]), S = argc > 4 ? atoi(argv[4]) : 224;
    vlmoe_dist *d = NULL;
    if (vlmoe_dist_open(&d, NULL)) return fprintf(stderr, "bench_loader_dist: %s\n", vlmoe_last_error()), 1;
    if (G < 1 || steps < 1 || steps > 1000 || G % d->world) {
        fprintf(stderr, "bench_loader_dist: the global batch %d must split over %d processes; steps 1..1000\n", G, d->world);
        vlmoe_dist_close(d);
        return 2;
    }
    vlmoe_loader_params p = vlmoe_loader_default_params();
    p.data.path = argv[1];
    p.image.size = S;
    p.batch_size = G / d->world;
    p.rank = d->rank, p.world = d->world, p.agree = agree, p.agree_user = d;
    p.tokenize = tok;
    p.workers = 0;
    p.seed = 1;
    vlmoe_loader *ld = NULL;
    int st = vlmoe_loader_open(&p, &ld);
    double wall[1000], cpu[1000];
    long made = 0;
    for (int s = 0; !st && s < steps; s++) {
        vlmoe_batch b;
        const long t0 = tokenized;
        const double w0 = bench_now(), c0 = cpu_now();
        st = vlmoe_loader_next(ld, &b, NULL);
        wall[s] = bench_now() - w0, cpu[s] = cpu_now() - c0;
        made += tokenized - t0;
    }
    if (st) fprintf(stderr, "bench_loader_dist: rank %d: %s\n", d->rank, vlmoe_last_error());
    vlmoe_loader_free(ld);
    qsort(wall, (size_t)steps, sizeof(double), bench_cmp);
    qsort(cpu, (size_t)steps, sizeof(double), bench_cmp);
    if (!st)
        printf("rank %d of %d: global batch %d, %d per process, %dx%d: median %.4f s wall, %.4f s CPU per step in "
               "the loader; %.1f samples prepared per step\n", d->rank, d->world, G, G / d->world, S, S,
               wall[steps / 2], cpu[steps / 2], (double)made / steps);
    vlmoe_dist_close(d);
    return st ? 1 : 0;
}
