// bench_moe_layer.c: cost of one MoE layer (tokens choice, top-1, E=8, capacity factor 1.0,
// BPR) forward + backward against the dense MLP with the same active FLOPs, at a realistic shape
// (4096 tokens, width 384, hidden 1536). Prints medians over repeated runs and the ratio.
// Usage: bench_moe_layer [tokens width hidden experts reps]
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#include "core/core.h"
#include "moe/layer.h"
#include "ops/ops.h"

static float *randf(size_t n, vlmoe_rng *r, double s) {
    float *v = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) v[i] = (float)(s * vlmoe_rng_normal(r));
    return v;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 4096, D = argc > 2 ? atoi(argv[2]) : 384;
    const int M = argc > 3 ? atoi(argv[3]) : 1536, E = argc > 4 ? atoi(argv[4]) : 8;
    const int reps = argc > 5 ? atoi(argv[5]) : 15;
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 1);
    float *x = randf((size_t)n * D, &r, 1), *dout = randf((size_t)n * D, &r, 1), *out = calloc((size_t)n * D, 4);
    float *dx = calloc((size_t)n * D, 4);
    // dense MLP
    float *w1 = randf((size_t)M * D, &r, 0.05), *b1 = randf(M, &r, 0.01), *w2 = randf((size_t)D * M, &r, 0.05), *b2 = randf(D, &r, 0.01);
    float *gw1 = calloc((size_t)M * D, 4), *gb1 = calloc(M, 4), *gw2 = calloc((size_t)D * M, 4), *gb2 = calloc(D, 4);
    float *h = malloc(sizeof(float) * n * M), *a = malloc(sizeof(float) * n * M), *da = malloc(sizeof(float) * n * M), *dh = malloc(sizeof(float) * n * M);
    // MoE: router (E,D) + stacked experts in one flat buffer
    vlmoe_moe_config mc;
    memset(&mc, 0, sizeof(mc));
    mc.router = VLMOE_ROUTER_TOKENS;
    mc.layers = 1;
    mc.num_experts = E;
    mc.top_k = 1;
    mc.capacity_factor = mc.eval_capacity_factor = 1.0;
    mc.capacity_multiple = 1;
    mc.order = VLMOE_ORDER_BPR;
    mc.noise_std = 1.0;
    mc.aux_weight[VLMOE_AUX_IMPORTANCE] = mc.aux_weight[VLMOE_AUX_LOAD] = 0.01;
    size_t off = 0;
    moe_spec sp = {&mc, D, M, VLMOE_ACT_GELU_TANH, 0, 0, 0, 0, 0, (size_t)-1, (size_t)-1, 0, 0, 0, 0};
    sp.router_w = off, off += (size_t)E * D;
    sp.w1 = off, off += (size_t)E * M * D;
    sp.b1 = off, off += (size_t)E * M;
    sp.w2 = off, off += (size_t)E * D * M;
    sp.b2 = off, off += (size_t)E * D;
    float *P = randf(off, &r, 0.05), *G = calloc(off, 4);
    moe_state_f32 *st;
    if (moe_state_create_f32(&st, &sp, backend_cpu_f32(), n)) {
        fprintf(stderr, "bench_moe_layer: %s\n", vlmoe_last_error());
        return 1;
    }
    uint8_t *mod = calloc(n, 1);
    double *td = malloc(sizeof(double) * reps), *tm = malloc(sizeof(double) * reps);
    for (int it = -2; it < reps; it++) { // two warm-up rounds, then alternate dense and MoE
        double t0 = bench_now();
        linear_forward_f32(h, x, w1, b1, n, D, M, 0);
        act_forward_f32(a, h, (size_t)n * M, VLMOE_ACT_GELU_TANH);
        linear_forward_f32(out, a, w2, b2, n, M, D, 0);
        memset(da, 0, sizeof(float) * n * M);
        memset(dh, 0, sizeof(float) * n * M);
        memset(dx, 0, sizeof(float) * n * D);
        linear_backward_f32(da, gw2, gb2, dout, a, w2, n, M, D);
        act_backward_f32(dh, h, da, (size_t)n * M, VLMOE_ACT_GELU_TANH);
        linear_backward_f32(dx, gw1, gb1, dh, x, w1, n, D, M);
        double t1 = bench_now();
        moe_call c = {n, 1, (uint64_t)it + 7, mod, NULL, NULL, NULL};
        double aux;
        vlmoe_moe_stats s;
        memset(&s, 0, sizeof(s));
        memset(out, 0, sizeof(float) * n * D);
        memset(dx, 0, sizeof(float) * n * D);
        if (moe_forward_f32(st, &c, P, x, out, &aux, &s)) {
            fprintf(stderr, "bench_moe_layer: %s\n", vlmoe_last_error());
            return 1;
        }
        moe_backward_f32(st, P, G, x, dout, dx, 1.0);
        double t2 = bench_now();
        if (it >= 0) td[it] = t1 - t0, tm[it] = t2 - t1;
        if (it == reps - 1)
            printf("last MoE pass: success rate %.3f, %d of %d tokens processed\n", s.success[0],
                   (int)lround(s.success[0] * n), n);
    }
    qsort(td, reps, sizeof(double), bench_cmp);
    qsort(tm, reps, sizeof(double), bench_cmp);
    const double flops = 6.0 * 2.0 * n * D * M; // fwd + bwd of two matmuls, active FLOPs
    printf("shape: %d tokens, width %d, hidden %d, %d experts, top-1, capacity factor 1.0, BPR\n", n, D, M, E);
    printf("dense MLP fwd+bwd: median %.2f ms (min %.2f, max %.2f), %.1f GFLOP/s\n", 1e3 * td[reps / 2],
           1e3 * td[0], 1e3 * td[reps - 1], flops / td[reps / 2] * 1e-9);
    printf("MoE layer fwd+bwd: median %.2f ms (min %.2f, max %.2f)\n", 1e3 * tm[reps / 2], 1e3 * tm[0],
           1e3 * tm[reps - 1]);
    printf("MoE / dense ratio: %.3f (target <= 1.15)\n", tm[reps / 2] / td[reps / 2]);
    moe_state_free_f32(st);
    free(x), free(dout), free(out), free(dx), free(w1), free(b1), free(w2), free(b2), free(gw1), free(gb1);
    free(gw2), free(gb2), free(h), free(a), free(da), free(dh), free(P), free(G), free(mod), free(td), free(tm);
    return 0;
}
