// test_gradckpt.c: gradient checkpointing (vlmoe_model_set_grad_checkpointing, src/nn/graph.c):
// a checkpointed model and a plain one from the same seed take the same AdamW steps on the same
// synthetic batches with bit-identical losses, auxiliary losses, routing statistics, gradients
// and parameters, for dense, LIMoE (top-K + BPR + noise keyed by position), CLIP-UP, experts
// choice, Soft MoE and a two_tower MoE; the planned activation arena is smaller; VL-MoE refuses;
// `vlmoe train --grad-checkpointing` (fresh and resumed) writes the same checkpoint bytes. Also the
// attention kept from the forward against recomputed (vlmoe_model_set_attention_recompute,
// --recompute-attention): the same bits, in fp32 and bf16.
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "ops/gemm_bf16.h"
#include "test.h"
#include "vlmoe.h"

enum { STEPS = 3 };

// A two_tower CLIP with CLIP-UP MoE layers in every second block of both towers.
static void clip_moe(vlmoe_model_config *c) {
    vlmoe_config_named("tiny-clip", c);
    c->moe.layers = vlmoe_moe_every(2, c->encoder.layers);
    c->text_moe.layers = vlmoe_moe_every(2, c->text_encoder.layers);
    vlmoe_moe_preset("clipup", &c->moe);
    vlmoe_moe_preset("clipup", &c->text_moe);
    snprintf(c->name, sizeof(c->name), "tiny-clip+clipup");
}

// How the second model of a pair is made: checkpointed, or with its attention kept or recomputed
// (vlmoe_model_set_attention_recompute's mode; -1: the default), in fp32 or bf16.
typedef struct {
    int ckpt, recompute;
    const char *precision;
    int lock_image; // two_tower LiT: the image tower frozen (it keeps no attention)
} variant;

static int make(vlmoe_model **m, vlmoe_trainer **t, const vlmoe_model_config *c, int B, variant v) {
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule.base_lr = 2e-3;
    tp.schedule.warmup_steps = 1;
    tp.schedule.total_steps = STEPS;
    tp.optim.weight_decay = 0.1f;
    tp.lock_image = v.lock_image;
    int st = vlmoe_model_init(m, c, 7), fell_back = 0;
    if (!st && v.precision) st = model_set_precision(*m, v.precision, &fell_back); // plans again: first
    if (!st) st = vlmoe_model_plan(*m, B);
    if (!st && v.recompute >= 0) st = vlmoe_model_set_attention_recompute(*m, v.recompute);
    if (!st && v.ckpt) st = vlmoe_model_set_grad_checkpointing(*m, 1);
    if (!st) st = vlmoe_trainer_init(t, *m, &tp);
    return st;
}

// The first index where two float buffers differ in their bits, or -1.
static long first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof(float))) return (long)i;
    return -1;
}

// Whether two layers' routing statistics hold the same bits (the per-expert arrays compared
// through their pointers, which point into each model's own buffers).
static int same_stats(const vlmoe_moe_stats *a, const vlmoe_moe_stats *b) {
    vlmoe_moe_stats x = *a, y = *b;
    for (int m = 0; m < 2; m++) {
        const size_t E = (size_t)a->num_experts;
        if ((a->routed[m] && memcmp(a->routed[m], b->routed[m], sizeof(double) * E)) ||
            (a->accepted[m] && memcmp(a->accepted[m], b->accepted[m], sizeof(double) * E)))
            return 0;
        x.routed[m] = y.routed[m] = x.accepted[m] = y.accepted[m] = NULL;
    }
    return !memcmp(&x, &y, sizeof(x));
}

// Models ref and var train side by side; var's arena must be smaller than ref's
// (less > 0), larger (less < 0), or either.
static void same_training_as(const vlmoe_model_config *c, int B, variant ref, variant var, int less) {
    vlmoe_model *m[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    const variant v[2] = {ref, var};
    for (int k = 0; k < 2; k++) {
        int st = make(&m[k], &t[k], c, B, v[k]);
        CHECK(st == VLMOE_OK, "%s (checkpointing %d, recompute %d): %s", c->name, v[k].ckpt, v[k].recompute,
              vlmoe_last_error());
        if (st) goto out;
    }
    const size_t plain = graph_activation_bytes_f32(m[0]->g), other = graph_activation_bytes_f32(m[1]->g);
    CHECK(less > 0 ? other < plain : less < 0 ? other > plain : 1, "%s: arena %zu bytes against the reference's %zu",
          c->name, other, plain);
    printf("%-18s B=%d %s: activation arena %zu -> %zu bytes (%.0f%%)%s\n", c->name, B,
           var.ckpt ? "checkpointed" : model_keeps_attention(m[1]) ? "attention kept" : "attention recomputed", plain, other,
           100.0 * other / plain, var.precision ? " in bf16" : "");
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c->image_size;
    vlmoe_synth *data = NULL;
    CHECK(vlmoe_synth_init(&data, &sp) == VLMOE_OK, "synth: %s", vlmoe_last_error());
    const int T = c->context_length;
    float *img = malloc(sizeof(float) * (size_t)B * 3 * c->image_size * c->image_size);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *lens = malloc(sizeof(int32_t) * B);
    const size_t n = vlmoe_model_num_floats(m[0]);
    for (int s = 0; s < STEPS && data; s++) {
        vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, (uint64_t)s * B, B, T, img, tok, lens);
        const vlmoe_batch b = {B, img, tok, lens};
        vlmoe_step_stats ss[2];
        for (int k = 0; k < 2; k++)
            CHECK(vlmoe_trainer_step(t[k], &b, &ss[k]) == VLMOE_OK, "%s step %d: %s", c->name, s, vlmoe_last_error());
        CHECK(!memcmp(&ss[0].loss, &ss[1].loss, sizeof(double)) && !memcmp(&ss[0].aux, &ss[1].aux, sizeof(double)),
              "%s step %d: loss %.17g / %.17g, aux %.17g / %.17g", c->name, s, ss[0].loss, ss[1].loss, ss[0].aux,
              ss[1].aux);
        long dg = first_diff(vlmoe_model_grad_data(m[0]), vlmoe_model_grad_data(m[1]), n);
        long dp = first_diff(vlmoe_model_param_data(m[0]), vlmoe_model_param_data(m[1]), n);
        CHECK(dg < 0 && dp < 0, "%s step %d: gradients differ first at float %ld, parameters at %ld", c->name, s, dg, dp);
        int n0 = 0, n1 = 0;
        const vlmoe_moe_stats *s0 = vlmoe_model_moe_stats(m[0], &n0), *s1 = vlmoe_model_moe_stats(m[1], &n1);
        int same = n0 == n1;
        for (int l = 0; same && l < n0; l++) same = same_stats(&s0[l], &s1[l]);
        CHECK(same, "%s step %d: routing statistics differ (%d / %d layers)", c->name, s, n0, n1);
    }
    vlmoe_synth_free(data);
    free(img), free(tok), free(lens);
out:
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
}

// checkpointed against plain (the default: fp32 recomputes the attention)
static void same_training(const vlmoe_model_config *c, int B) {
    same_training_as(c, B, (variant){0, -1, NULL, 0}, (variant){1, -1, NULL, 0}, 1);
}

static void test_identical(void) {
    const char *names[] = {"tiny", "limoe-tiny", "clipup-tiny", "ec-tiny", "soft-tiny", "tiny-clip"};
    vlmoe_model_config c;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        CHECK(vlmoe_config_named(names[i], &c) == VLMOE_OK, "%s", vlmoe_last_error());
        same_training(&c, 32);
    }
    clip_moe(&c);
    same_training(&c, 32);
    // deeper: 4 blocks, so three are recomputed, MoE and dense among them
    vlmoe_config_named("limoe-tiny", &c);
    c.encoder.layers = 4;
    c.moe.layers = vlmoe_moe_every(2, 4);
    snprintf(c.name, sizeof(c.name), "limoe-tiny-4");
    same_training(&c, 32);
}

// Keeping each block's attention from the forward instead of recomputing it in the backward: the
// same bits, in fp32 and in bf16 (whose default is to keep), with and without checkpointing.
static void test_attention_kept(void) {
    const char *names[] = {"tiny", "limoe-tiny", "tiny-clip"};
    vlmoe_model_config c;
    const variant recompute = {0, 1, NULL, 0}, keep = {0, 0, NULL, 0};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        vlmoe_config_named(names[i], &c);
        same_training_as(&c, 32, recompute, keep, -1);
    }
    clip_moe(&c);
    same_training_as(&c, 32, recompute, keep, -1);
    same_training_as(&c, 32, (variant){0, 1, NULL, 1}, (variant){0, 0, NULL, 1}, -1); // LiT
    vlmoe_config_named("limoe-tiny", &c);
    c.encoder.layers = 4;
    c.moe.layers = vlmoe_moe_every(2, 4);
    snprintf(c.name, sizeof(c.name), "limoe-tiny-4");
    same_training_as(&c, 32, keep, (variant){1, 0, NULL, 0}, 1); // checkpointed blocks share one set
    if (!gemm_bf16_native()) {
        printf("bf16 attention kept vs recomputed: skipped, this CPU has no bf16 products (oneDNN's ISA lacks "
               "avx512_core_bf16)\n");
        return;
    }
    same_training_as(&c, 32, (variant){0, 1, "bf16", 0}, (variant){0, -1, "bf16", 0}, -1);
    vlmoe_config_named("tiny-clip", &c);
    same_training_as(&c, 32, (variant){0, 1, "bf16", 0}, (variant){0, -1, "bf16", 0}, -1);
}

// A limoe-tiny model planned for batch 16, or NULL (a failed check).
static vlmoe_model *planned_limoe_tiny(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK && vlmoe_model_plan(m, 16) == VLMOE_OK, "%s", vlmoe_last_error());
    return m;
}

// The mode's default follows the precision; a change re-plans a planned model; VL-MoE recomputes
// and refuses an explicit choice; a mode out of range is an argument error.
static void test_attention_modes(void) {
    vlmoe_model_config c;
    vlmoe_model *m = planned_limoe_tiny();
    if (m) {
        const size_t plain = graph_activation_bytes_f32(m->g);
        CHECK(!model_keeps_attention(m), "fp32 keeps the attention by default");
        CHECK(vlmoe_model_set_attention_recompute(m, 0) == VLMOE_OK && model_keeps_attention(m) && m->g &&
                  m->planned_B == 16 && graph_activation_bytes_f32(m->g) > plain,
              "keeping it did not re-plan a larger arena for B=16: %s", vlmoe_last_error());
        CHECK(vlmoe_model_set_attention_recompute(m, -1) == VLMOE_OK && graph_activation_bytes_f32(m->g) == plain,
              "back to the default did not restore the plain arena");
        int fell_back = 0;
        if (gemm_bf16_native()) {
            CHECK(model_set_precision(m, "bf16", &fell_back) == VLMOE_OK && vlmoe_model_plan(m, 16) == VLMOE_OK &&
                      model_keeps_attention(m),
                  "bf16 does not keep the attention by default: %s", vlmoe_last_error());
            CHECK(vlmoe_model_set_attention_recompute(m, 1) == VLMOE_OK && !model_keeps_attention(m),
                  "bf16 with recompute 1 keeps it");
        }
        CHECK(vlmoe_model_set_attention_recompute(m, 2) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "mode 2"),
              "mode 2: %s", vlmoe_last_error());
    }
    vlmoe_model_free(m);
    m = NULL;
    vlmoe_config_named("vlmoe-tiny", &c);
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK, "%s", vlmoe_last_error());
    if (m) {
        CHECK(vlmoe_model_set_attention_recompute(m, -1) == VLMOE_OK, "VL-MoE, the default: %s", vlmoe_last_error());
        CHECK(vlmoe_model_set_attention_recompute(m, 0) == VLMOE_ERR_CONFIG &&
                  strstr(vlmoe_last_error(), "VL-MoE") && strstr(vlmoe_last_error(), "vlmoe-tiny"),
              "VL-MoE, keep: %s", vlmoe_last_error());
    }
    vlmoe_model_free(m);
}

// The default's size rule (graph_create_ckpt's keep_attn -1): kept where that adds at most a
// quarter to the activation arena (bench-s: 18%), not where the probabilities weigh more (B/16,
// 197 tokens in 12 heads a block: 26%); never with checkpointing, whose blocks share one set.
static void test_attention_size_rule(void) {
    const char *names[2] = {"bench/models/bench-s.json", "B/16"};
    for (int i = 0; i < 2; i++) {
        vlmoe_model_config c;
        model_layout L;
        graph_f32 *g[3] = {NULL, NULL, NULL};
        const int st = i ? vlmoe_config_named(names[i], &c) : vlmoe_config_load(names[i], &c);
        CHECK(st == VLMOE_OK && model_layout_build(&L, &c) == VLMOE_OK, "%s: %s", names[i], vlmoe_last_error());
        if (st) continue;
        for (int k = 0; k < 3; k++)
            CHECK(graph_create_ckpt_f32(&g[k], &L, backend_cpu_f32(), 2, k == 2, k ? -1 : 1) == VLMOE_OK, "%s: %s",
                  names[i], vlmoe_last_error());
        if (g[0] && g[1] && g[2]) {
            CHECK(graph_keeps_attention_f32(g[0]) && graph_keeps_attention_f32(g[1]) == !i &&
                      !graph_keeps_attention_f32(g[2]),
                  "%s: kept %d, by the rule %d, checkpointed %d", names[i], graph_keeps_attention_f32(g[0]),
                  graph_keeps_attention_f32(g[1]), graph_keeps_attention_f32(g[2]));
            printf("%s: keeping the attention: activation arena %zu -> %zu bytes\n", names[i],
                   graph_activation_bytes_f32(g[1]), graph_activation_bytes_f32(g[0]));
        }
        for (int k = 0; k < 3; k++) graph_free_f32(g[k]);
        model_layout_free(&L);
    }
}

// Switching it on and off re-plans a planned model; VL-MoE keeps its activations and says so.
static void test_switch_and_refuse(void) {
    vlmoe_model_config c;
    vlmoe_model *m = planned_limoe_tiny();
    if (m) {
        const size_t plain = graph_activation_bytes_f32(m->g);
        CHECK(vlmoe_model_set_grad_checkpointing(m, 1) == VLMOE_OK, "%s", vlmoe_last_error());
        CHECK(m->g && m->planned_B == 16 && graph_activation_bytes_f32(m->g) < plain, "not re-planned for B=16");
        CHECK(vlmoe_model_set_grad_checkpointing(m, 0) == VLMOE_OK && graph_activation_bytes_f32(m->g) == plain,
              "switching it off did not restore the plain arena");
    }
    vlmoe_model_free(m);
    m = NULL;
    vlmoe_config_named("vlmoe-tiny", &c);
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK, "%s", vlmoe_last_error());
    if (m) {
        CHECK(vlmoe_model_set_grad_checkpointing(m, 1) == VLMOE_ERR_CONFIG &&
                  strstr(vlmoe_last_error(), "VL-MoE") && strstr(vlmoe_last_error(), "vlmoe-tiny"),
              "VL-MoE: %s", vlmoe_last_error());
    }
    vlmoe_model_free(m);
}

static const char *bin; // the vlmoe binary (test_vlmoe_bin)

// `vlmoe train --grad-checkpointing` writes the same checkpoint bytes as the run without it, and
// a plain run resumed with it continues bit for bit; so does a run with --recompute-attention off
// resumed without it (the flag may change on a resume: how the step is computed, not what).
static void test_cli(const char *argv0) {
    static char abs[PATH_MAX];
    char dir[] = "/tmp/vlmoe_gradckpt_XXXXXX", out[8192], args[1024];
    if (!(bin = test_vlmoe_bin(argv0, abs)) || !mkdtemp(dir)) return;
    const char *common = "train --model limoe-tiny --batch-size 16 --eval-samples 0 --threads 1";
    const char *runs[][2] = {{"plain", "--steps 4"}, {"ckpt", "--steps 4 --grad-checkpointing"},
                             {"mixed", "--steps 2"}, {"mixed", "--steps 4 --grad-checkpointing --resume latest"},
                             {"kept", "--steps 2 --recompute-attention off"}, {"kept", "--steps 4 --resume latest"},
                             {"bf16", "--steps 1 --precision bf16 --recompute-attention on"}};
    for (int i = 0; i < 7; i++) {
        snprintf(args, sizeof(args), "%s --logs %s --name %s %s", common, dir, runs[i][0], runs[i][1]);
        test_expect_in(dir, bin, args, 0, "trained to step", out, sizeof(out));
        const int on = strstr(runs[i][1], "--grad-checkpointing") != NULL;
        CHECK(on == (strstr(out, "--grad-checkpointing: blocks recomputed in the backward; activation arena") != NULL),
              "`vlmoe %s`: whether it says checkpointing is on:\n%s", args, out);
        CHECK(!strstr(runs[i][1], "--recompute-attention off") ==
                  !strstr(out, "--recompute-attention off: activation arena"),
              "`vlmoe %s`: whether it names the larger arena:\n%s", args, out);
        // bf16 moves the model to another table, which drops its plan: planned again to say it
        CHECK(!strstr(runs[i][1], "--recompute-attention on") ==
                  !strstr(out, "--recompute-attention on: activation arena"),
              "`vlmoe %s`: whether it names the arena under bf16:\n%s", args, out);
    }
    // the tensors, bit for bit (the metadata differ: every save has its own run and save ids)
    vlmoe_st *f[4] = {NULL, NULL, NULL, NULL};
    const char *names[4] = {"plain", "ckpt", "mixed", "kept"};
    for (int i = 0; i < 4; i++) {
        char rel[64];
        snprintf(rel, sizeof(rel), "%s/checkpoints/step_4.safetensors", names[i]);
        CHECK(vlmoe_st_open(test_path(dir, rel), &f[i]) == VLMOE_OK, "%s", vlmoe_last_error());
    }
    for (int k = 1; k < 4 && f[0] && f[k]; k++) {
        int same = vlmoe_st_count(f[0]) == vlmoe_st_count(f[k]);
        for (int i = 0; same && i < vlmoe_st_count(f[0]); i++) {
            vlmoe_tensor_info p, q;
            same = !vlmoe_st_info(f[0], i, &p) && !vlmoe_st_info(f[k], i, &q) && !strcmp(p.name, q.name) &&
                   p.nbytes == q.nbytes && !memcmp(p.data, q.data, p.nbytes);
        }
        const char *what[4] = {"", "--grad-checkpointing", "resumed with --grad-checkpointing",
                               "--recompute-attention off, resumed with the default"};
        CHECK(same, "%s: step_4 differs", what[k]);
    }
    for (int i = 0; i < 4; i++) vlmoe_st_close(f[i]);
    snprintf(args, sizeof(args), "rm -rf %s", dir);
    CHECK(system(args) == 0, "rm %s", dir);
}

int main(int argc, char **argv) {
    (void)argc;
    test_identical();
    test_attention_kept();
    test_attention_modes();
    test_attention_size_rule();
    test_switch_and_refuse();
    test_cli(argv[0]);
    return test_summary("test_gradckpt");
}
