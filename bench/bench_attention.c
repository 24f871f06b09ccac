// bench_attention.c: float attention forward + backward on bench-s's shapes (batch 64; images:
// T 65, width 256, 4 heads; texts: T 16, causal, padded), ops.c's reference loops (sgemm per
// head) against the fused kernel (src/ops/attn_cpu.c, AVX-512 or AVX2), at 1 and 2 threads.
// Medians of 20 runs (wall clock: on a shared machine, compare ratios from the same run).
// Usage: bench_attention [batch]
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ops/attn_cpu.h"
#include "ops/ops.h"

typedef struct {
    float *qkv, *out, *att, *datt, *dqkv, *g;
} bufs;

static double time_pass(int fused, int bwd, const bufs *m, const attn_segment *s, int D, int H) {
    double t[20];
    for (int r = -2; r < 20; r++) { // two warm-up runs
        const double t0 = bench_now();
        // the fused kernels directly: ops.c's backward takes them only up to ATTN_FUSED_BWD_TMAX
        if (fused && bwd) attn_fused_backward(m->dqkv, m->datt, m->g, m->qkv, m->att, s, D, H);
        else if (bwd) attention_backward_ref_f32(m->dqkv, m->datt, m->g, m->qkv, m->att, s, D, H);
        else if (fused) attn_fused_forward(m->out, m->att, m->qkv, s, D, H);
        else attention_forward_ref_f32(m->out, m->att, m->qkv, s, D, H);
        if (r >= 0) t[r] = bench_now() - t0;
    }
    qsort(t, 20, sizeof(double), bench_cmp);
    return (t[9] + t[10]) / 2;
}

int main(int argc, char **argv) {
    const int B = argc > 1 ? atoi(argv[1]) : 64, D = 256, H = 4, Ts[2] = {65, 16};
    if (B < 1) {
        fprintf(stderr, "bench_attention: batch must be a positive integer, got \"%s\"\n", argv[1]);
        return 2;
    }
    int32_t *lens = malloc(sizeof(int32_t) * B);
    for (int b = 0; b < B; b++) lens[b] = 5 + b % 12; // texts of 5..16 tokens
    for (int k = 0; k < 2; k++) {
        const int T = Ts[k];
        const size_t nt = (size_t)B * T, na = (size_t)B * H * T * T;
        bufs m = {malloc(sizeof(float) * nt * 3 * D), malloc(sizeof(float) * nt * D), malloc(sizeof(float) * na),
                  malloc(sizeof(float) * na), malloc(sizeof(float) * nt * 3 * D), malloc(sizeof(float) * nt * D)};
        if (!m.qkv || !m.out || !m.att || !m.datt || !m.dqkv || !m.g) {
            fprintf(stderr, "bench_attention: out of memory\n");
            return 1;
        }
        srand(1);
        for (size_t i = 0; i < nt * 3 * D; i++) m.qkv[i] = (float)rand() / RAND_MAX - 0.5f;
        for (size_t i = 0; i < nt * D; i++) m.g[i] = (float)rand() / RAND_MAX - 0.5f;
        const attn_segment s = {.nseq = B, .seqlen = T, .causal = k == 1, .lens = k == 1 ? lens : NULL};
        // the fused kernels return 0, having done nothing, where this build has neither AVX-512 nor AVX2 and FMA
        const int have_fused = attn_fused_forward(m.out, m.att, m.qkv, &s, D, H);
        for (int th = 1; th <= 2; th++) {
            omp_set_num_threads(th);
            if (!have_fused) {
                printf("%s T %2d B %d threads %d: forward %.3f ms, backward %.3f ms (reference loops; the fused "
                       "kernel needs AVX-512 or AVX2 with FMA, which this build lacks)\n",
                       k ? "texts " : "images", T, B, th, 1e3 * time_pass(0, 0, &m, &s, D, H),
                       1e3 * time_pass(0, 1, &m, &s, D, H));
                continue;
            }
            double ms[2][2];
            for (int fused = 0; fused < 2; fused++)
                for (int bwd = 0; bwd < 2; bwd++) ms[fused][bwd] = 1e3 * time_pass(fused, bwd, &m, &s, D, H);
            printf("%s T %2d B %d threads %d: forward %.3f -> %.3f ms (%.2fx), backward %.3f -> %.3f ms (%.2fx)\n",
                   k ? "texts " : "images", T, B, th, ms[0][0], ms[1][0], ms[0][0] / ms[1][0], ms[0][1], ms[1][1],
                   ms[0][1] / ms[1][1]);
        }
        free(m.qkv), free(m.out), free(m.att), free(m.datt), free(m.dqkv), free(m.g);
    }
    free(lens);
    return 0;
}
