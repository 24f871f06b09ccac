// test_gradckpt.c: gradient checkpointing (vlmoe_model_set_grad_checkpointing, src/nn/graph.c):
// a checkpointed model and a plain one from the same seed take the same AdamW steps on the same
// synthetic batches with bit-identical losses, auxiliary losses, routing statistics, gradients
// and parameters, for dense, LIMoE (top-K + BPR + noise keyed by position), CLIP-UP, experts
// choice, Soft MoE and a two_tower MoE; the planned activation arena is smaller; VL-MoE refuses;
// `vlmoe train --grad-checkpointing` (fresh and resumed) writes the same checkpoint bytes.
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
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

static int make(vlmoe_model **m, vlmoe_trainer **t, const vlmoe_model_config *c, int B, int ckpt) {
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule.base_lr = 2e-3;
    tp.schedule.warmup_steps = 1;
    tp.schedule.total_steps = STEPS;
    tp.optim.weight_decay = 0.1f;
    int st = vlmoe_model_init(m, c, 7);
    if (!st) st = vlmoe_model_plan(*m, B);
    if (!st && ckpt) st = vlmoe_model_set_grad_checkpointing(*m, 1);
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

static void same_training(const vlmoe_model_config *c, int B) {
    vlmoe_model *m[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        int st = make(&m[k], &t[k], c, B, k);
        CHECK(st == VLMOE_OK, "%s (checkpointing %d): %s", c->name, k, vlmoe_last_error());
        if (st) goto out;
    }
    const size_t plain = graph_activation_bytes_f32(m[0]->g), ckpt = graph_activation_bytes_f32(m[1]->g);
    CHECK(ckpt < plain, "%s: checkpointed arena %zu bytes, not below the plain %zu", c->name, ckpt, plain);
    printf("%-18s B=%d: activation arena %zu -> %zu bytes (%.0f%%)\n", c->name, B, plain, ckpt, 100.0 * ckpt / plain);
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

// Switching it on and off re-plans a planned model; VL-MoE keeps its activations and says so.
static void test_switch_and_refuse(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK && vlmoe_model_plan(m, 16) == VLMOE_OK, "%s", vlmoe_last_error());
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
// a plain run resumed with it continues bit for bit.
static void test_cli(const char *argv0) {
    static char abs[PATH_MAX];
    char dir[] = "/tmp/vlmoe_gradckpt_XXXXXX", out[8192], args[1024];
    if (!(bin = test_vlmoe_bin(argv0, abs)) || !mkdtemp(dir)) return;
    const char *common = "train --model limoe-tiny --batch-size 16 --eval-samples 0 --threads 1";
    const char *runs[][2] = {{"plain", "--steps 4"}, {"ckpt", "--steps 4 --grad-checkpointing"},
                             {"mixed", "--steps 2"}, {"mixed", "--steps 4 --grad-checkpointing --resume latest"}};
    for (int i = 0; i < 4; i++) {
        snprintf(args, sizeof(args), "%s --logs %s --name %s %s", common, dir, runs[i][0], runs[i][1]);
        test_expect_in(dir, bin, args, 0, "trained to step", out, sizeof(out));
        const int on = strstr(runs[i][1], "--grad-checkpointing") != NULL;
        CHECK(on == (strstr(out, "--grad-checkpointing: blocks recomputed in the backward; activation arena") != NULL),
              "`vlmoe %s`: whether it says checkpointing is on:\n%s", args, out);
    }
    // the tensors, bit for bit (the metadata differ: every save has its own run and save ids)
    vlmoe_st *f[3] = {NULL, NULL, NULL};
    const char *names[3] = {"plain", "ckpt", "mixed"};
    for (int i = 0; i < 3; i++) {
        char rel[64];
        snprintf(rel, sizeof(rel), "%s/checkpoints/step_4.safetensors", names[i]);
        CHECK(vlmoe_st_open(test_path(dir, rel), &f[i]) == VLMOE_OK, "%s", vlmoe_last_error());
    }
    for (int k = 1; k < 3 && f[0] && f[k]; k++) {
        int same = vlmoe_st_count(f[0]) == vlmoe_st_count(f[k]);
        for (int i = 0; same && i < vlmoe_st_count(f[0]); i++) {
            vlmoe_tensor_info p, q;
            same = !vlmoe_st_info(f[0], i, &p) && !vlmoe_st_info(f[k], i, &q) && !strcmp(p.name, q.name) &&
                   p.nbytes == q.nbytes && !memcmp(p.data, q.data, p.nbytes);
        }
        CHECK(same, "%s: step_4 differs", k == 1 ? "--grad-checkpointing" : "resumed with --grad-checkpointing");
    }
    for (int i = 0; i < 3; i++) vlmoe_st_close(f[i]);
    snprintf(args, sizeof(args), "rm -rf %s", dir);
    CHECK(system(args) == 0, "rm %s", dir);
}

int main(int argc, char **argv) {
    (void)argc;
    test_identical();
    test_switch_and_refuse();
    test_cli(argv[0]);
    return test_summary("test_gradckpt");
}
