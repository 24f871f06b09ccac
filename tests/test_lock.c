// test_lock.c: LiT-style locking (vlmoe_train_params.lock_*, src/train/trainer.c; OpenCLIP's
// --lock-image, --lock-image-unlocked-groups, --lock-text, --lock-text-unlocked-layers): after
// AdamW steps with weight decay every tensor of a locked tower keeps its bits and the rest trains;
// unlocked groups are the last ones in OpenCLIP's order (projection; last block + final norm;
// earlier blocks; stem); one_tower and VL-MoE models and stray group counts are errors; `vlmoe
// train` takes the flags, records them in params.json and refuses them on a one_tower model. A
// tower locked whole is skipped by the backward, every other gradient keeping its bits.
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "nn/model.h"
#include "test.h"
#include "vlmoe.h"

enum { B = 16, STEPS = 4 };

// Trains tiny-clip (two towers of 2 blocks) STEPS steps with tp's locks; changed[i] says
// whether parameter i's bits moved. Returns the table (valid until the model is freed).
static const vlmoe_param_info *train(vlmoe_train_params tp, vlmoe_model **mo, int *changed, int *np) {
    vlmoe_model_config c;
    vlmoe_config_named("tiny-clip", &c);
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_synth *data = NULL;
    tp.schedule.base_lr = 2e-3, tp.schedule.warmup_steps = 1, tp.schedule.total_steps = STEPS;
    tp.optim.weight_decay = 0.1f; // decay would move a frozen tensor that reached the optimizer
    CHECK(vlmoe_model_init(&m, &c, 3) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK, "trainer: %s", vlmoe_last_error());
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    CHECK(vlmoe_synth_init(&data, &sp) == VLMOE_OK, "synth: %s", vlmoe_last_error());
    *mo = m;
    const vlmoe_param_info *tab = vlmoe_model_params(m, np);
    const size_t n = vlmoe_model_num_floats(m);
    float *p0 = malloc(sizeof(float) * n);
    memcpy(p0, vlmoe_model_param_data(m), sizeof(float) * n);
    const int T = c.context_length;
    float *img = malloc(sizeof(float) * B * 3 * c.image_size * c.image_size);
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *lens = malloc(sizeof(int32_t) * B);
    for (int s = 0; s < STEPS && t && data; s++) {
        vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, (uint64_t)s * B, B, T, img, tok, lens);
        const vlmoe_batch b = {B, img, tok, lens};
        CHECK(vlmoe_trainer_step(t, &b, NULL) == VLMOE_OK, "step %d: %s", s, vlmoe_last_error());
    }
    const float *p = vlmoe_model_param_data(m);
    for (int i = 0; i < *np; i++)
        changed[i] = memcmp(p + tab[i].offset, p0 + tab[i].offset, sizeof(float) * tab[i].numel) != 0;
    free(p0), free(img), free(tok), free(lens);
    vlmoe_synth_free(data);
    vlmoe_trainer_free(t);
    return tab;
}

static int starts(const char *s, const char *prefix) { return !strncmp(s, prefix, strlen(prefix)); }

// Expectation for one parameter: 1 trains, 0 frozen.
typedef int (*expect_fn)(const char *name);
static int exp_lock_image(const char *n) { return !starts(n, "image."); }
static int exp_lock_text(const char *n) { return !starts(n, "text."); }
static int exp_image_groups1(const char *n) { return !starts(n, "image.") || !strcmp(n, "image.proj"); }
static int exp_image_groups2(const char *n) { // + the last block (1 of 2) and the final LayerNorm
    return exp_image_groups1(n) || starts(n, "image.blocks.1.") || starts(n, "image.ln_final.");
}
static int exp_text_layers3(const char *n) { // + block 0: all but the stem (token table, positions)
    return !starts(n, "text.") || (strcmp(n, "text.token_embed") && strcmp(n, "text.pos_embed"));
}

static void check_locks(const char *what, vlmoe_train_params tp, expect_fn expect) {
    vlmoe_model *m = NULL;
    int np = 0, *changed = calloc(512, sizeof(int));
    const vlmoe_param_info *tab = train(tp, &m, changed, &np);
    int frozen = 0, trained = 0, bad = 0;
    for (int i = 0; i < np && np <= 512; i++) {
        const int want = expect(tab[i].name);
        frozen += !want, trained += want;
        if (changed[i] != want && bad++ < 5)
            fprintf(stderr, "%s: %s %s\n", what, tab[i].name, changed[i] ? "changed" : "kept its bits");
    }
    CHECK(bad == 0 && frozen > 0 && trained > 0, "%s: %d tensors wrong (%d frozen, %d trained expected)", what, bad,
          frozen, trained);
    printf("%-32s %3d tensors kept their bits, %3d trained\n", what, frozen, trained);
    vlmoe_model_free(m);
    free(changed);
}

static void test_locks(void) {
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.lock_image = 1;
    check_locks("lock_image", tp, exp_lock_image);
    tp.lock_image_unlocked_groups = 1;
    check_locks("lock_image, unlocked groups 1", tp, exp_image_groups1);
    tp.lock_image_unlocked_groups = 2;
    check_locks("lock_image, unlocked groups 2", tp, exp_image_groups2);
    tp = vlmoe_train_default_params();
    tp.lock_text = 1;
    check_locks("lock_text", tp, exp_lock_text);
    tp.lock_text_unlocked_layers = 3;
    check_locks("lock_text, unlocked layers 3", tp, exp_text_layers3);
}

static void expect_error(const char *model, vlmoe_train_params tp, int code, const char *needle) {
    vlmoe_model_config c;
    vlmoe_config_named(model, &c);
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK, "%s", vlmoe_last_error());
    const int st = vlmoe_trainer_init(&t, m, &tp);
    CHECK(st == code && t == NULL && strstr(vlmoe_last_error(), needle), "%s: status %d (want %d): %s", model, st,
          code, vlmoe_last_error());
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
}

static void test_errors(void) {
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.lock_image = 1;
    expect_error("limoe-tiny", tp, VLMOE_ERR_CONFIG, "one_tower");
    expect_error("vlmoe-tiny", tp, VLMOE_ERR_CONFIG, "VL-MoE");
    tp = vlmoe_train_default_params();
    tp.lock_text = 1;
    expect_error("tiny", tp, VLMOE_ERR_CONFIG, "no separate text tower");
    tp = vlmoe_train_default_params();
    tp.lock_image_unlocked_groups = 2;
    expect_error("tiny-clip", tp, VLMOE_ERR_ARG, "needs --lock-image");
    tp.lock_image = 1, tp.lock_image_unlocked_groups = -1;
    expect_error("tiny-clip", tp, VLMOE_ERR_ARG, "must be >= 0");
}

// A tower locked whole gets no backward (model_set_frozen_towers): its gradients stay zero and
// every other gradient keeps its bits.
static void test_skip_backward(void) {
    vlmoe_model_config c;
    vlmoe_config_named("tiny-clip", &c);
    vlmoe_synth *data = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    CHECK(vlmoe_synth_init(&data, &sp) == VLMOE_OK, "synth: %s", vlmoe_last_error());
    const int T = c.context_length;
    float *img = malloc(sizeof(float) * B * 3 * c.image_size * c.image_size);
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *lens = malloc(sizeof(int32_t) * B);
    if (data) vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, 0, B, T, img, tok, lens);
    const vlmoe_batch b = {B, img, tok, lens};
    for (int frozen = 0; frozen < NUM_MOD && data; frozen++) {
        const char *tower = frozen == MOD_IMAGE ? "image." : "text.";
        vlmoe_model *m[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++) {
            int st = vlmoe_model_init(&m[k], &c, 5);
            if (!st && k) st = model_set_frozen_towers(m[k], frozen == MOD_IMAGE, frozen == MOD_TEXT);
            if (!st) st = vlmoe_model_forward(m[k], &b, NULL);
            if (!st) st = vlmoe_model_backward(m[k]);
            CHECK(st == VLMOE_OK, "%s frozen: %s", tower, vlmoe_last_error());
        }
        int np = 0, wrong = 0, zero = 0;
        const vlmoe_param_info *tab = vlmoe_model_params(m[0], &np);
        const float *g0 = vlmoe_model_grad_data(m[0]), *g1 = vlmoe_model_grad_data(m[1]);
        for (int i = 0; i < np; i++) {
            const float *a = g0 + tab[i].offset, *s1 = g1 + tab[i].offset;
            if (starts(tab[i].name, tower)) {
                int all0 = 1, any = 0;
                for (size_t j = 0; j < tab[i].numel; j++) all0 &= s1[j] == 0, any |= a[j] != 0;
                zero += all0 && any; // the full backward gives it a gradient; the skipped one none
                if (!all0 && wrong++ < 3) fprintf(stderr, "%s: gradient of a frozen tower\n", tab[i].name);
            } else if (memcmp(a, s1, sizeof(float) * tab[i].numel) && wrong++ < 3) {
                fprintf(stderr, "%s: gradient differs with the %s tower frozen\n", tab[i].name, tower);
            }
        }
        CHECK(wrong == 0 && zero > 20, "%s tower frozen: %d gradients wrong, %d tensors skipped", tower, wrong, zero);
        for (int k = 0; k < 2; k++) vlmoe_model_free(m[k]);
    }
    vlmoe_model *m = NULL;
    vlmoe_config_named("limoe-tiny", &c);
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(m && model_set_frozen_towers(m, 1, 0) == VLMOE_ERR_CONFIG, "one_tower: frozen image tower accepted");
    vlmoe_model_free(m);
    vlmoe_synth_free(data);
    free(img), free(tok), free(lens);
}

static const char *bin; // the vlmoe binary (test_vlmoe_bin)

// The flags of `vlmoe train`: params.json records them; a one_tower model is an error.
static void test_cli(const char *argv0) {
    static char abs[PATH_MAX];
    char dir[] = "/tmp/vlmoe_lock_XXXXXX", out[8192];
    if (!(bin = test_vlmoe_bin(argv0, abs)) || !mkdtemp(dir)) return;
    char args[1024];
    snprintf(args, sizeof(args), "train --model tiny-clip --steps 2 --batch-size 8 --eval-samples 0 --logs %s --name r "
             "--lock-image --lock-image-unlocked-groups 1 --lock-text --lock-text-unlocked-layers 2 "
             "--grad-checkpointing --threads 1", dir);
    test_expect_in(dir, bin, args, 0, "trained to step 2", out, sizeof(out));
    char *pj = test_read_file(test_path(dir, "r/params.json"), NULL);
    CHECK(pj && strstr(pj, "\"lock_image\":\ttrue") && strstr(pj, "\"lock_image_unlocked_groups\":\t1") &&
              strstr(pj, "\"lock_text\":\ttrue") && strstr(pj, "\"lock_text_unlocked_layers\":\t2") &&
              strstr(pj, "\"grad_checkpointing\":\ttrue"),
          "params.json lacks the locks:\n%s", pj ? pj : "(unreadable)");
    free(pj);
    // refusals: model, flags, what the message must say
    static const char *const bad[][3] = {
        {"limoe-tiny", "--lock-image", "no separate image tower"},
        {"tiny-clip", "--lock-text-unlocked-layers 1", "needs --lock-text"},
        {"vlmoe-tiny", "--grad-checkpointing", "not for VL-MoE"},
        {"vlmoe-tiny", "--lock-text", "VL-MoE (arch mome)"},
        {"vlmoe-tiny", "--recompute-attention off", "always recompute their attention"},
        {"limoe-tiny", "--recompute-attention sometimes", "--recompute-attention 'sometimes': expected auto, on or off"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(args, sizeof(args), "train --model %s --steps 1 --batch-size 8 --logs %s --name bad%zu %s", bad[i][0],
                 dir, i, bad[i][1]);
        test_expect_in(dir, bin, args, 1, bad[i][2], out, sizeof(out));
    }
    snprintf(args, sizeof(args), "rm -rf %s", dir);
    CHECK(system(args) == 0, "rm %s", dir);
}

int main(int argc, char **argv) {
    (void)argc;
    test_locks();
    test_errors();
    test_skip_backward();
    test_cli(argv[0]);
    return test_summary("test_lock");
}
