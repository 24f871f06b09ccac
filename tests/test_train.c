// test_train.c: training end to end through the library: a tiny dense one_tower model trained
// on the synthetic data learns (loss falls; held-out pair accuracy far above chance), the
// divergence guard stops a step with a non-finite gradient and names the tensor, training is
// deterministic for a seed and identical for 1 and 2 threads, and the evaluation metrics give
// hand-computed values on tiny embedding sets (ties included).
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "test.h"
#include "vlmoe.h"

typedef struct {
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_synth *data;
    float *img;
    int32_t *tok, *lens;
    int B, T;
} run;

static void run_init(run *r, int B, uint64_t seed) {
    vlmoe_model_config cfg;
    vlmoe_config_named("tiny", &cfg);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = cfg.image_size;
    CHECK(vlmoe_synth_init(&r->data, &sp) == VLMOE_OK, "synth: %s", vlmoe_last_error());
    CHECK(vlmoe_model_init(&r->m, &cfg, seed) == VLMOE_OK, "model: %s", vlmoe_last_error());
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule.base_lr = 2e-3;
    tp.schedule.warmup_steps = 20;
    tp.schedule.total_steps = 300;
    tp.optim.weight_decay = 0.1f;
    CHECK(vlmoe_trainer_init(&r->t, r->m, &tp) == VLMOE_OK, "trainer: %s", vlmoe_last_error());
    r->B = B, r->T = cfg.context_length;
    r->img = malloc(sizeof(float) * (size_t)B * 3 * cfg.image_size * cfg.image_size);
    r->tok = malloc(sizeof(int32_t) * (size_t)B * r->T);
    r->lens = malloc(sizeof(int32_t) * B);
}

static double run_step(run *r, long step) {
    vlmoe_synth_batch(r->data, VLMOE_SPLIT_TRAIN, (uint64_t)step * r->B, r->B, r->T, r->img, r->tok, r->lens);
    vlmoe_batch b = {r->B, r->img, r->tok, r->lens};
    vlmoe_step_stats s;
    int st = vlmoe_trainer_step(r->t, &b, &s);
    CHECK(st == VLMOE_OK, "step %ld: %s", step, vlmoe_last_error());
    return s.loss;
}

static void run_free(run *r) {
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_synth_free(r->data);
    free(r->img), free(r->tok), free(r->lens);
}

static void test_learns(void) {
    run r;
    run_init(&r, 64, 0);
    const int steps = 300;
    double first = 0, last = 0;
    for (long s = 0; s < steps; s++) {
        double l = run_step(&r, s);
        if (s < 20) first += l / 20;
        if (s >= steps - 20) last += l / 20;
    }
    CHECK(last < 0.6 * first, "loss did not fall: first 20 steps %.3f, last 20 %.3f", first, last);
    // held-out pairs, scored in chunks of 64 (chance 1/64 = 1.6%)
    const int n = 512, E = vlmoe_model_get_config(r.m)->embed_dim, sz = vlmoe_model_get_config(r.m)->image_size;
    float *img = malloc(sizeof(float) * (size_t)n * 3 * sz * sz), *ie = malloc(sizeof(float) * n * E), *te = malloc(sizeof(float) * n * E);
    int32_t *tok = malloc(sizeof(int32_t) * n * r.T), *lens = malloc(sizeof(int32_t) * n);
    vlmoe_synth_batch(r.data, VLMOE_SPLIT_HELDOUT, 0, n, r.T, img, tok, lens);
    vlmoe_model_encode_images(r.m, img, n, ie);
    vlmoe_model_encode_texts(r.m, tok, lens, n, te);
    double i2t, t2i;
    vlmoe_pair_accuracy(ie, te, n, E, 64, &i2t, &t2i);
    printf("tiny one_tower, %d steps: loss %.3f -> %.3f, held-out pair accuracy i2t %.3f t2i %.3f (chance 0.016)\n",
           steps, first, last, i2t, t2i);
    // Chance is 1/64; with 512 draws, P(binomial(512, 1/64) >= 77) is far below 1e-30.
    CHECK(i2t > 0.15 && t2i > 0.15, "held-out pair accuracy i2t %.3f t2i %.3f not clearly above chance", i2t, t2i);
    free(img), free(ie), free(te), free(tok), free(lens);
    run_free(&r);
}

// the table entry of the parameter called name, or NULL
static const vlmoe_param_info *param_named(vlmoe_model *m, const char *name) {
    int np;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &np);
    for (int i = 0; i < np; i++)
        if (!strcmp(tab[i].name, name)) return &tab[i];
    return NULL;
}

// A run of batch 16 after its first step; its parameters, to write through
static float *stepped_run(run *r) {
    run_init(r, 16, 5);
    run_step(r, 0);
    return vlmoe_model_param_data(r->m);
}

// One trainer step on the 16 training samples from `first`; its status
static int step_from(run *r, uint64_t first) {
    vlmoe_synth_batch(r->data, VLMOE_SPLIT_TRAIN, first, 16, r->T, r->img, r->tok, r->lens);
    vlmoe_batch bt = {16, r->img, r->tok, r->lens};
    vlmoe_step_stats s;
    return vlmoe_trainer_step(r->t, &bt, &s);
}

static void test_determinism_and_guard(void) {
    double a[4], b[4];
    int nt = omp_get_max_threads();
    for (int pass = 0; pass < 2; pass++) {
        omp_set_num_threads(pass == 0 ? 1 : 2);
        run r;
        run_init(&r, 16, 5);
        for (int s = 0; s < 4; s++) (pass ? b : a)[s] = run_step(&r, s);
        run_free(&r);
    }
    omp_set_num_threads(nt);
    CHECK(!memcmp(a, b, sizeof(a)), "1 thread and 2 threads differ: %.17g vs %.17g", a[3], b[3]);
    // divergence guard: a NaN weight makes the loss or a gradient non-finite; the step is refused
    run r;
    float *P = stepped_run(&r);
    const vlmoe_param_info *fc1 = param_named(r.m, "encoder.blocks.1.mlp.fc1.bias");
    CHECK(fc1 != NULL, "parameter encoder.blocks.1.mlp.fc1.bias exists");
    if (fc1) {
        P[fc1->offset] = INFINITY;
        float keep = P[0];
        long step = vlmoe_trainer_get_step(r.t);
        int st = step_from(&r, 0);
        CHECK(st == VLMOE_ERR_NUMERIC, "non-finite step returned %d: %s", st, vlmoe_last_error());
        CHECK(strstr(vlmoe_last_error(), "step 1") != NULL, "message names the step: %s", vlmoe_last_error());
        CHECK(vlmoe_trainer_get_step(r.t) == step && P[0] == keep, "a refused step changed the state");
    }
    run_free(&r);
    // a finite loss with a non-finite gradient: a logit scale of e^80 and text embeddings made 1e6
    // times shorter (the L2 norm undoes it in the forward; its backward divides by the norm)
    // overflow the text tower's gradients; the step is refused and the message names the tensor
    P = stepped_run(&r);
    const vlmoe_param_info *ls = param_named(r.m, "logit_scale"), *tp = param_named(r.m, "text.proj");
    CHECK(ls && tp, "parameters logit_scale and text.proj exist");
    if (ls) P[ls->offset] = 80;
    for (size_t k = 0; tp && k < tp->numel; k++) P[tp->offset + k] *= 1e-6f;
    float *before = malloc(sizeof(float) * vlmoe_model_num_floats(r.m));
    memcpy(before, P, sizeof(float) * vlmoe_model_num_floats(r.m));
    const int st = step_from(&r, 16);
    CHECK(st == VLMOE_ERR_NUMERIC && strstr(vlmoe_last_error(), "step 1: the gradient of 'text."),
          "a non-finite gradient under a finite loss: status %d, '%s' (want %d, naming the tensor)", st,
          vlmoe_last_error(), VLMOE_ERR_NUMERIC);
    CHECK(vlmoe_trainer_get_step(r.t) == 1 && !memcmp(before, P, sizeof(float) * vlmoe_model_num_floats(r.m)),
          "the refused step changed the state");
    free(before);
    run_free(&r);
}

// The guard when only the gradient is non-finite (the loss is finite): one step's clipping sum
// finds it (src/train/trainer.c apply), and the message still names the tensor. A huge finite
// fc1 bias makes the next LayerNorm's float variance overflow: its output (the bias) and the loss
// stay finite, while its backward multiplies infinities by zeros.
static void test_guard_gradient(void) {
    run r;
    float *P = stepped_run(&r);
    const vlmoe_param_info *fc1 = param_named(r.m, "encoder.blocks.0.mlp.fc1.bias");
    CHECK(fc1 != NULL, "parameter encoder.blocks.0.mlp.fc1.bias exists");
    for (size_t k = 0; fc1 && k < fc1->numel; k++) P[fc1->offset + k] = 1e30f;
    float keep = P[0];
    int st = step_from(&r, 16);
    CHECK(st == VLMOE_ERR_NUMERIC && strstr(vlmoe_last_error(), "step 1: the gradient of '"),
          "a non-finite gradient: status %d, message '%s'", st, vlmoe_last_error());
    CHECK(vlmoe_trainer_get_step(r.t) == 1 && P[0] == keep, "a refused step changed the state");
    run_free(&r);
}

static void test_metrics(void) {
    // 3 images, 3 classes, E = 2. Class embeddings e0 = (1,0), e1 = (0,1), e2 = (0.6,0.8).
    float cls[6] = {1, 0, 0, 1, 0.6f, 0.8f};
    // image 0 = (1,0): scores 1, 0, 0.6 -> class 0 first. image 1 = (0,1): scores 0, 1, 0.8 ->
    // class 1 first. image 2 = (0.8,0.6): scores 0.8, 0.6, 0.96 -> class 2 first, then 0.
    float img[6] = {1, 0, 0, 1, 0.8f, 0.6f};
    int32_t lab_ok[3] = {0, 1, 2}, lab_2nd[3] = {2, 2, 0};
    double t1, t5;
    vlmoe_zeroshot_accuracy(img, 3, cls, 3, 2, lab_ok, &t1, &t5);
    CHECK(t1 == 1 && t5 == 1, "zero-shot all right: top1 %g top5 %g", t1, t5);
    // labels 2, 2, 0: image 0 ranks class 2 second, image 1 second, image 2 ranks class 0 second
    vlmoe_zeroshot_accuracy(img, 3, cls, 3, 2, lab_2nd, &t1, &t5);
    CHECK(t1 == 0 && t5 == 1, "zero-shot second: top1 %g top5 %g", t1, t5);
    // ties: two identical classes; the lower index wins, so label 1 is ranked second
    float tie[4] = {1, 0, 1, 0}, one[2] = {1, 0};
    int32_t l0[1] = {0}, l1[1] = {1};
    vlmoe_zeroshot_accuracy(one, 1, tie, 2, 2, l0, &t1, &t5);
    CHECK(t1 == 1, "tie goes to the lower index");
    vlmoe_zeroshot_accuracy(one, 1, tie, 2, 2, l1, &t1, &t5);
    CHECK(t1 == 0 && t5 == 1, "tie: the higher index is second");
    // pairs: img = txt for pairs 0,1; pair 2's text equals text 0 (a tie counts as a miss)
    float pi[6] = {1, 0, 0, 1, 1, 0}, pt[6] = {1, 0, 0, 1, 1, 0};
    double i2t, t2i;
    vlmoe_pair_accuracy(pi, pt, 3, 2, 3, &i2t, &t2i);
    CHECK(fabs(i2t - 1.0 / 3) < 1e-12 && fabs(t2i - 1.0 / 3) < 1e-12, "pair accuracy with ties: %g %g", i2t, t2i);
    vlmoe_pair_accuracy(pi, pt, 3, 2, 2, &i2t, &t2i); // chunks {0,1} and {2}: all right
    CHECK(i2t == 1 && t2i == 1, "pair accuracy in chunks: %g %g", i2t, t2i);
}

int main(void) {
    test_metrics();
    test_determinism_and_guard();
    test_guard_gradient();
    test_learns();
    return test_summary("test_train");
}
