// bench_step.c: one whole training step (forward + backward + AdamW) of a model config, the
// vlmoe half of bench/speed.py (bench/torch_step.py is the PyTorch half and uses the same
// inputs). Prints one JSON line: median/min/max step seconds after warm-up, embedding
// throughput at the same batch, peak RSS and the step's analytic matrix-product FLOPs.
// Usage: bench_step MODEL.json [--batch 64] [--steps 10] [--warmup 2] [--threads 2]
// [--precision fp32|bf16|int8] [--device cpu|cuda[:N]] [--embed N] [--recompute-attention auto|on|off]
// (bf16 with cuda: the cuda-bf16 table, named in the "matmul" field, src/cuda/bf16_cuda.cu;
// --recompute-attention: vlmoe_model_set_attention_recompute, auto by default as in `vlmoe train`,
// the choice made named in the "attention" field). --embed N: inference only (int8
// allowed), no training step; the throughputs are medians of N timed encodes per modality.
// Built with -DVLMOE_PROFILE (build/rel/bench/bench_step_prof, with the library's kernels
// compiled the same way) it also prints, to stderr, where a step's time goes (src/core/prof.h).
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "bench.h"
#include "core/prof.h"
#include "nn/model.h"
#include "ops/gemm_bf16.h"
#include "ops/gemm_f32.h"

#include "vlmoe.h"

// Matrix-product FLOPs of one training step (forward, and backward at twice the forward),
// counted from the shapes: patch embedding, q/k/v, attention scores and mixing, output
// projection, MLP or active expert MLP (K experts per token), routers, projections, logits.
static double step_flops(const vlmoe_model_config *c, int B) {
    const vlmoe_encoder_config *e = &c->encoder;
    const double D = e->width, M = e->mlp_dim, P = c->image_size / c->patch_size;
    const double Ti = P * P + (c->image_class_token ? 1 : 0), Tt = c->context_length;
    const double n = B * (Ti + Tt), pd = c->channels * c->patch_size * c->patch_size;
    double f = 2 * B * P * P * pd * D;
    for (int l = 0; l < e->layers; l++) {
        const int moe = c->moe.router != VLMOE_ROUTER_NONE && (c->moe.layers >> l & 1);
        f += 2 * n * D * 3 * D + 2 * n * D * D;
        f += 2 * 2 * B * (Ti * Ti + Tt * Tt) * D;
        f += 2 * 2 * n * D * M * (moe ? c->moe.top_k : 1);
        if (moe) f += 2 * n * D * c->moe.num_experts;
    }
    f += 2 * 2 * B * D * c->embed_dim + 2 * (double)B * B * c->embed_dim;
    return 3 * f;
}

#ifdef VLMOE_PROFILE
// The fp32 products' shapes that took the most time (src/core/prof.h), per step: each call is
// single-threaded, so its rate is one thread's, against bench_peak's per-thread peak.
static void print_gemm_shapes(int steps) {
    prof_gemm_shape g[12];
    const int n = prof_gemm_read(g, 12);
    if (!n) return;
    fprintf(stderr, "fp32 products by shape (single-threaded calls; the %d taking the most time):\n"
            "  ta tb     M     N     K   lda   ldb  calls/step  ms/step  GFLOP/s a thread\n", n);
    for (int i = 0; i < n; i++)
        fprintf(stderr, "  %2d %2d %5d %5d %5d %5d %5d %11.1f %8.2f %8.1f\n", g[i].ta, g[i].tb, g[i].M, g[i].N,
                g[i].K, g[i].lda, g[i].ldb, (double)g[i].calls / steps, 1e3 * g[i].seconds / steps,
                2.0 * g[i].M * g[i].N * g[i].K * g[i].calls / g[i].seconds * 1e-9);
}
#endif

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_step MODEL.json [--batch N] [--steps N] [--warmup N] [--threads N] [--precision fp32|bf16|int8] [--device cpu|cuda[:N]] [--embed N] [--recompute-attention auto|on|off]\n");
        return 2;
    }
    int B = 64, steps = 10, warmup = 2, threads = 0, fell_back = 0, embed = 0;
    const char *precision = "fp32", *device = NULL, *recompute = "auto";
    for (int i = 2; i + 1 < argc; i += 2) {
        int v = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--precision")) precision = argv[i + 1];
        else if (!strcmp(argv[i], "--device")) device = argv[i + 1];
        else if (!strcmp(argv[i], "--batch")) B = v;
        else if (!strcmp(argv[i], "--steps")) steps = v;
        else if (!strcmp(argv[i], "--warmup")) warmup = v;
        else if (!strcmp(argv[i], "--threads")) threads = v;
        else if (!strcmp(argv[i], "--embed")) embed = v;
        else if (!strcmp(argv[i], "--recompute-attention")) recompute = argv[i + 1];
        else {
            fprintf(stderr, "bench_step: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    const int rmode = !strcmp(recompute, "on") ? 1 : !strcmp(recompute, "off") ? 0 : !strcmp(recompute, "auto") ? -1 : 2;
    if (rmode == 2) {
        fprintf(stderr, "bench_step: --recompute-attention '%s': expected auto, on or off\n", recompute);
        return 2;
    }
    if (threads > 0) omp_set_num_threads(threads);
    vlmoe_model_config cfg;
    vlmoe_model *m = NULL;
    vlmoe_trainer *tr = NULL;
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule.base_lr = 1e-4;
    if (vlmoe_config_load(argv[1], &cfg) || vlmoe_model_init(&m, &cfg, 1) ||
        (device && model_set_device(m, device)) || model_set_precision(m, precision, &fell_back) ||
        vlmoe_model_set_attention_recompute(m, rmode) || vlmoe_model_plan(m, B) ||
        (!embed && vlmoe_trainer_init(&tr, m, &tp))) {
        fprintf(stderr, "bench_step: %s\n", vlmoe_last_error());
        return 1;
    }
    // the same deterministic inputs as torch_step.py
    const int S = cfg.image_size, C = cfg.channels, T = cfg.context_length;
    float *img = malloc(sizeof(float) * (size_t)B * C * S * S), *emb = malloc(sizeof(float) * (size_t)B * cfg.embed_dim);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *len = malloc(sizeof(int32_t) * B);
    for (size_t i = 0; i < (size_t)B * C * S * S; i++) img[i] = (float)sin(0.001 * (double)i);
    for (int b = 0; b < B; b++) {
        len[b] = T / 2 + b % (T / 2 + 1);
        for (int t = 0; t < T; t++) tok[b * T + t] = t < len[b] ? (b * 131 + t * 17) % cfg.vocab_size : 0;
    }
    vlmoe_batch batch = {B, img, tok, len};
    if (embed) steps = 1, warmup = 0;
    double *dt = calloc((size_t)(steps > 0 ? steps : 1), sizeof(double));
    vlmoe_step_stats st = {0};
    double total = 0;
    gemm_bf16_counts c0 = gemm_bf16_get_counts();
    for (int i = 0; i < warmup + steps && !embed; i++) {
        if (i == warmup) prof_reset(), c0 = gemm_bf16_get_counts();
        double t0 = bench_now();
        if (vlmoe_trainer_step(tr, &batch, &st)) {
            fprintf(stderr, "bench_step: %s\n", vlmoe_last_error());
            return 1;
        }
        if (i >= warmup) total += dt[i - warmup] = bench_now() - t0;
    }
#ifdef VLMOE_PROFILE
    if (!embed) {
        double prof[PROF_COUNT], sum = 0;
        prof_read(prof);
        fprintf(stderr, "per-op profile of one %s step at %d threads (mean of %d steps, %.3f s):\n", cfg.name,
                omp_get_max_threads(), steps, total / steps);
        for (int c = 0; c < PROF_COUNT; c++) {
            sum += prof[c];
            fprintf(stderr, "  %-18s %8.1f ms %5.1f%%\n", prof_name(c), 1e3 * prof[c] / steps, 100 * prof[c] / total);
        }
        fprintf(stderr, "  %-18s %8.1f ms %5.1f%%\n", "outside the ops", 1e3 * (total - sum) / steps,
                100 * (total - sum) / total);
        print_gemm_shapes(steps);
    }
#endif
    // the bf16 products of the timed steps: how many, and how often plan found its primitives kept
    const gemm_bf16_counts c1 = gemm_bf16_get_counts();
    const long np = c1.products - c0.products, hits = c1.prim_hits - c0.prim_hits;
    const long looks = hits + c1.prim_misses - c0.prim_misses;
    qsort(dt, steps, sizeof(double), bench_cmp);
    // inference throughput: one modality per call, as an embedding job runs; after training the
    // best of 5, with --embed the median of N after one untimed call each
    const int reps = embed ? embed : 5;
    double *ri = malloc(sizeof(double) * reps), *rt = malloc(sizeof(double) * reps);
    for (int r = -(embed > 0); r < reps; r++) {
        if (r == 0) prof_reset();
        double t0 = bench_now();
        int e1 = vlmoe_model_encode_images(m, img, B, emb);
        double t1 = bench_now();
        int e2 = vlmoe_model_encode_texts(m, tok, len, B, emb);
        double t2 = bench_now();
        if (e1 || e2) {
            fprintf(stderr, "bench_step: %s\n", vlmoe_last_error());
            return 1;
        }
        if (r >= 0) ri[r] = t1 - t0, rt[r] = t2 - t1;
    }
    qsort(ri, reps, sizeof(double), bench_cmp);
    qsort(rt, reps, sizeof(double), bench_cmp);
    const double ti = embed ? ri[reps / 2] : ri[0], tt = embed ? rt[reps / 2] : rt[0];
#ifdef VLMOE_PROFILE
    if (embed) {
        double prof[PROF_COUNT], sum = 0, tot = 0;
        prof_read(prof);
        for (int r = 0; r < reps; r++) tot += ri[r] + rt[r];
        fprintf(stderr, "per-op profile of one %s encode (images + texts) at %d threads (mean of %d, %.1f ms):\n",
                cfg.name, omp_get_max_threads(), reps, 1e3 * tot / reps);
        for (int c = 0; c < PROF_COUNT; c++) {
            sum += prof[c];
            fprintf(stderr, "  %-18s %8.1f ms %5.1f%%\n", prof_name(c), 1e3 * prof[c] / reps, 100 * prof[c] / tot);
        }
        fprintf(stderr, "  %-18s %8.1f ms %5.1f%%\n", "outside the ops", 1e3 * (tot - sum) / reps, 100 * (tot - sum) / tot);
    }
#endif
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    if (fell_back) fprintf(stderr, "bench_step: no %s instructions on this CPU: fp32 instead\n", precision);
    printf("{\"impl\": \"vlmoe\", \"precision\": \"%s\", \"matmul\": \"%s\", \"model\": \"%s\", \"attention\": \"%s\", \"threads\": %d, \"batch\": %d, \"step_s\": %.5f, "
           "\"step_min_s\": %.5f, \"step_max_s\": %.5f, \"loss\": %.6f, \"gflop\": %.3f, "
           "\"image_per_s\": %.1f, \"text_per_s\": %.1f, \"image_per_s_lo\": %.1f, \"image_per_s_hi\": %.1f, "
           "\"text_per_s_lo\": %.1f, \"text_per_s_hi\": %.1f, \"peak_rss_mb\": %.1f, \"bf16_products_per_step\": %.0f, "
           "\"bf16_prim_hit_rate\": %.4f, \"bf16_shadow_mb\": %.1f, \"fp32_gemm\": \"%s\"}\n",
           fell_back ? "fp32" : precision, m->be->name, cfg.name,
           model_keeps_attention(m) ? "kept" : "recomputed", omp_get_max_threads(), B, dt[steps / 2], dt[0], dt[steps - 1], st.loss,
           step_flops(&cfg, B) * 1e-9, B / ti, B / tt, B / ri[reps - 1], B / ri[0], B / rt[reps - 1], B / rt[0],
           ru.ru_maxrss / 1024.0, (double)np / (steps > 0 ? steps : 1), looks ? (double)hits / looks : 1.0,
           c1.shadow_bytes / 1048576.0, gemm_f32_preferred() ? "vlmoe-avx2 (src/ops/gemm_f32.c)" : "oneDNN dnnl_sgemm");
    free(img), free(emb), free(tok), free(len), free(dt), free(ri), free(rt);
    vlmoe_trainer_free(tr);
    vlmoe_model_free(m);
    return 0;
}
