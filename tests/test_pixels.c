// test_pixels.c: images as bytes (issue 16: uploaded as uint8, normalised by the model's table).
// The uint8 path must give what the float path gives, bit for bit, on the CPU: the train and eval
// transforms stopped before the normalisation and then normalised by the table's pixels op equal
// src/data/image.c's float output; a model trained on the bytes (model_set_pixels) has the same
// losses and parameters as one trained on the floats; swapped mean and std must not pass. On a
// table claiming separate memory (tests/sep_mem.h) the same steps count the step's host/device
// traffic: the image bytes uploaded (a quarter of the floats') and the waits for the device.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/image.h"
#include "nn/model.h"
#include "sep_mem.h"
#include "test.h"

static const float CLIP_MEAN[3] = {0.48145466f, 0.4578275f, 0.40821073f};
static const float CLIP_STD[3] = {0.26862954f, 0.26130258f, 0.27577711f};

static void random_image(vlmoe_image *im, vlmoe_rng *r, int w, int h) {
    vlmoe_image_alloc(im, w, h);
    for (size_t i = 0; i < (size_t)w * h * 3; i++) im->rgb[i] = (uint8_t)vlmoe_rng_below(r, 256);
}

// The CPU table's normalisation of one (S, S, 3) image.
static void normalise(float *out, const uint8_t *u8, int S, const float mean[3], const float std[3]) {
    be_pixels p = {.B = 1, .C = 3, .H = S, .W = S, .hwc = 1};
    memcpy(p.mean, mean, sizeof(float) * 3), memcpy(p.std, std, sizeof(float) * 3);
    const vlmoe_backend_f32 *be = backend_cpu_f32();
    be->pixels_normalize(be, out, be->pixels_stage(be, u8, (size_t)S * S * 3), &p);
}

// The train transform (crop, flip, jitter) and the eval transform, 24 images each.
static void transforms_check(void) {
    vlmoe_image_params p = vlmoe_image_default_params();
    p.size = 24, p.flip_prob = 0.5, p.color_jitter = 0.4;
    const size_t n = (size_t)3 * p.size * p.size;
    float *f = malloc(sizeof(float) * n), *g = malloc(sizeof(float) * n);
    uint8_t *u8 = malloc(n);
    vlmoe_image im = {0};
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 7);
    int same = 0, swapped_same = 0, after = 0, flips = 0;
    for (int k = 0; k < 24; k++) {
        random_image(&im, &r, 30 + k, 41 - k);
        vlmoe_rng ra, rb;
        vlmoe_rng_seed(&ra, 100 + (uint64_t)k), vlmoe_rng_seed(&rb, 100 + (uint64_t)k);
        int st = vlmoe_image_preprocess_train(&im, &p, &ra, f);
        if (!st) st = vlmoe_image_preprocess_train_u8(&im, &p, &rb, u8);
        CHECK(st == VLMOE_OK, "train transform %d: %s", k, vlmoe_last_error());
        normalise(g, u8, p.size, p.mean, p.std);
        same += !memcmp(f, g, sizeof(float) * n);
        after += vlmoe_rng_uniform(&ra) == vlmoe_rng_uniform(&rb); // the same draws were taken
        normalise(g, u8, p.size, p.std, p.mean);
        swapped_same += !memcmp(f, g, sizeof(float) * n);
        // the same draws with a flip probability that never flips: where the images differ, the
        // byte path's must be the other mirrored
        vlmoe_rng_seed(&ra, 100 + (uint64_t)k);
        vlmoe_image_params nf = p;
        nf.flip_prob = 1e-300;
        uint8_t *plain = malloc(n);
        vlmoe_image_preprocess_train_u8(&im, &nf, &ra, plain);
        if (memcmp(plain, u8, n)) {
            int mirrored = 1;
            for (int y = 0; y < p.size; y++)
                for (int x = 0; x < p.size; x++)
                    for (int ch = 0; ch < 3; ch++)
                        mirrored &= plain[((size_t)y * p.size + x) * 3 + ch] ==
                                    u8[((size_t)y * p.size + p.size - 1 - x) * 3 + ch];
            CHECK(mirrored, "image %d: the flipped bytes are not the unflipped ones mirrored", k);
            flips++;
        }
        free(plain);
        st = vlmoe_image_preprocess_eval(&im, &p, f);
        if (!st) st = vlmoe_image_preprocess_eval_u8(&im, &p, u8);
        CHECK(st == VLMOE_OK, "eval transform %d: %s", k, vlmoe_last_error());
        normalise(g, u8, p.size, p.mean, p.std);
        same += !memcmp(f, g, sizeof(float) * n);
    }
    CHECK(same == 48, "bytes then the table's normalisation equal the float transforms in %d of 48 images", same);
    CHECK(after == 24, "the byte transform took other draws than the float one in %d of 24 images", 24 - after);
    CHECK(swapped_same == 0, "swapped mean and std still equal the float transform in %d images", swapped_same);
    // both kinds must occur, or the mirroring would go untested
    CHECK(flips > 3 && flips < 21, "%d of 24 images flipped at flip_prob 0.5", flips);
    vlmoe_image_free(&im);
    free(f), free(g), free(u8);
}

// Three AdamW steps of `name`: a model fed float images, one fed the same images as bytes, one fed
// bytes with mean and std swapped (must differ), and one fed bytes on the separate-memory table,
// whose traffic is counted.
static void model_check(const char *name) {
    vlmoe_model_config c;
    vlmoe_config_named(name, &c);
    enum { B = 6, STEPS = 3, NM = 4 };
    const int S = c.image_size, T = c.context_length;
    const size_t n = (size_t)3 * S * S;
    uint8_t *u8 = malloc(n * B);
    float *img = malloc(sizeof(float) * n * B);
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *len = malloc(sizeof(int32_t) * B);
    vlmoe_backend_f32 dev = sep_table();
    vlmoe_model *m[NM] = {NULL};
    vlmoe_trainer *t[NM] = {NULL};
    vlmoe_train_params tp = vlmoe_train_default_params();
    int st = VLMOE_OK;
    for (int k = 0; k < NM && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 11);
        if (!st && k == 3) st = model_set_backend(m[k], &dev, NULL);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    CHECK(st == VLMOE_OK, "%s: %s", name, vlmoe_last_error());
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 3);
    double loss[NM][STEPS] = {{0}};
    int logged_same = 0; // every number a train record logs, host table against separate memory
    long grads = 0, small = 0, scalar = 0, aux = 0, pix = 0, total_dl = 0;
    for (int step = 0; step < STEPS && !st; step++) {
        for (size_t i = 0; i < n * B; i++) u8[i] = (uint8_t)vlmoe_rng_below(&r, 256);
        for (int b = 0; b < B && !st; b++) { // the host path: src/data/image.c's normalisation
            vlmoe_image im = {.w = S, .h = S, .rgb = u8 + (size_t)b * n, .cap = n};
            vlmoe_image_params ip = vlmoe_image_default_params();
            memcpy(ip.mean, CLIP_MEAN, sizeof(ip.mean)), memcpy(ip.std, CLIP_STD, sizeof(ip.std));
            st = vlmoe_image_to_tensor(&im, &ip, 0, img + (size_t)b * n);
        }
        for (int b = 0; b < B; b++) {
            len[b] = 2 + (int)vlmoe_rng_below(&r, (uint32_t)T - 1);
            for (int i = 0; i < T; i++) tok[b * T + i] = i < len[b] ? (int)vlmoe_rng_below(&r, (uint32_t)c.vocab_size) : 0;
        }
        const vlmoe_batch fb = {B, img, tok, len}, ub = {B, NULL, tok, len};
        vlmoe_step_stats sk[NM];
        memset(sk, 0, sizeof(sk));
        for (int k = 0; k < NM && !st; k++) {
            if (k) st = model_set_pixels(m[k], u8, 1, k == 2 ? CLIP_STD : CLIP_MEAN, k == 2 ? CLIP_MEAN : CLIP_STD);
            if (k == 3) memset(&sep_traffic, 0, sizeof(sep_traffic));
            vlmoe_step_stats ss;
            if (!st) st = vlmoe_trainer_step(t[k], k ? &ub : &fb, &ss);
            loss[k][step] = ss.loss;
            sk[k] = ss;
        }
        logged_same += !memcmp(&sk[0], &sk[3], sizeof(sk[0]));
        pix += sep_traffic.pixel_bytes;
        total_dl += sep_traffic.downloads;
        grads += sep_traffic.download_floats >= (long)m[3]->L.total; // the gradient, whole
        small += sep_traffic.small_downloads;
        scalar += sep_traffic.scalar_ops;
        aux += sep_traffic.aux_ops;
    }
    CHECK(st == VLMOE_OK, "%s steps: %s", name, vlmoe_last_error());
    for (int s = 0; s < STEPS; s++) {
        CHECK(loss[1][s] == loss[0][s], "%s step %d: loss %.17g from bytes, %.17g from floats", name, s + 1, loss[1][s],
              loss[0][s]);
        CHECK(loss[3][s] == loss[0][s], "%s step %d: loss %.17g from bytes on separate memory, %.17g from floats",
              name, s + 1, loss[3][s], loss[0][s]);
    }
    CHECK(logged_same == STEPS, "%s: the step statistics (losses, accuracies, temperature, lr, gradient norm) of "
          "separate memory equal the host table's in %d of %d steps", name, logged_same, STEPS);
    CHECK(loss[2][0] != loss[0][0], "%s: swapped mean and std give the same loss %.17g", name, loss[2][0]);
    for (int k = 1; k < NM && !st; k++)
        if (k != 2)
            CHECK(!memcmp(vlmoe_model_param_data(m[k]), m[0]->params, sizeof(float) * m[0]->L.total),
                  "%s: parameters after %d steps from bytes (model %d) differ from the float path's", name, STEPS, k);
    CHECK(sep_stray == 0, "%s: %d host pointers handed to the separate-memory table; first: %s", name, sep_stray,
          sep_first);
    // the bus: B images of S x S x 3 bytes a step, a quarter of the floats' 4 bytes each
    CHECK(pix == (long)(STEPS * n * B), "%s: %ld image bytes staged in %d steps, expected %zu", name, pix, STEPS,
          STEPS * n * B);
    int nmoe = 0;
    vlmoe_model_moe_stats(m[3], &nmoe);
    printf("%s on separate memory, per step: %ld downloads (%.0f of the whole gradient, %.0f of <= 16 floats, "
           "%.0f routing), %.0f scalar reads by ops (%.0f outside the routing, %.0f auxiliary losses: %d MoE layers), "
           "%zu image bytes\n", name, total_dl / STEPS, (double)grads / STEPS, (double)small / STEPS,
           (double)(total_dl - grads - small) / STEPS, (double)scalar / STEPS, (double)(scalar - aux) / STEPS,
           (double)aux / STEPS, nmoe, n * B);
    // The step's one download: its scalars (loss, accuracies, logit scale, gradient sum of
    // squares, non-finite flag) with the auxiliary losses' values behind them (the routing and
    // the losses stay on the device, the clamped logit scale too). The gradient stays: AdamW runs
    // on the device's copies (tests/test_devopt.c). No scalar read by an op.
    CHECK(grads == 0, "%s: the whole gradient came down %ld times in %d steps", name, grads, STEPS);
    CHECK(total_dl == STEPS, "%s: %ld downloads in %d steps, expected one a step (the step's scalars)", name,
          total_dl, STEPS);
    CHECK(scalar == 0 && aux == 0, "%s: %ld scalar reads by ops (%ld auxiliary losses) in %d steps, expected none",
          name, scalar, aux, STEPS);
    for (int k = 0; k < NM; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
    free(u8), free(img), free(tok), free(len);
}

// A deferred loss that is not finite stops the step before any parameter changes, as the
// forward's own check does on the host.
static void divergence_check(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_backend_f32 dev = sep_table();
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_train_params tp = vlmoe_train_default_params();
    int st = vlmoe_model_init(&m, &c, 2);
    if (!st) st = model_set_backend(m, &dev, NULL);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    CHECK(st == VLMOE_OK, "setup: %s", vlmoe_last_error());
    const int B = 4, T = c.context_length;
    const size_t n = (size_t)3 * c.image_size * c.image_size * B;
    float *img = calloc(n, sizeof(float)), *before = malloc(sizeof(float) * m->L.total);
    int32_t *tok = calloc((size_t)B * T, sizeof(int32_t)), len[4] = {2, 3, 4, 5};
    for (int b = 0; b < B; b++) tok[b * T + 1] = b + 1, img[(size_t)b * n / B] = (float)b;
    m->params[m->L.mod[MOD_IMAGE].proj] = NAN; // one weight of the image projection
    memcpy(before, m->params, sizeof(float) * m->L.total);
    const vlmoe_batch b = {B, img, tok, len};
    vlmoe_step_stats ss;
    st = vlmoe_trainer_step(t, &b, &ss);
    CHECK(st == VLMOE_ERR_NUMERIC && strstr(vlmoe_last_error(), "step 0: the contrastive loss is nan"),
          "a NaN weight on the device: %d %s", st, vlmoe_last_error());
    CHECK(!memcmp(before, m->params, sizeof(float) * m->L.total), "the diverged step changed parameters");
    vlmoe_trainer_free(t), vlmoe_model_free(m);
    free(img), free(before), free(tok);
}

// What does not fit is an error naming it.
static void errors_check(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &c, 1) == VLMOE_OK, "init: %s", vlmoe_last_error());
    const float bad[3] = {0.5f, 0.0f, 0.5f};
    uint8_t px[4] = {0};
    CHECK(model_set_pixels(m, px, 1, CLIP_MEAN, bad) != VLMOE_OK && strstr(vlmoe_last_error(), "std[1] = 0"),
          "a zero std: %s", vlmoe_last_error());
    const int B = 2, T = c.context_length;
    const size_t n = (size_t)3 * c.image_size * c.image_size * B;
    uint8_t *u8 = calloc(n, 1);
    float *img = calloc(n, sizeof(float));
    int32_t *tok = calloc((size_t)B * T, sizeof(int32_t)), len[2] = {2, 2};
    const vlmoe_batch both = {B, img, tok, len};
    CHECK(model_set_pixels(m, u8, 1, CLIP_MEAN, CLIP_STD) == VLMOE_OK, "set: %s", vlmoe_last_error());
    CHECK(vlmoe_model_forward(m, &both, NULL) != VLMOE_OK && strstr(vlmoe_last_error(), "both as bytes and as floats"),
          "bytes and floats: %s", vlmoe_last_error());
    const vlmoe_batch none = {B, NULL, tok, len};
    CHECK(vlmoe_model_forward(m, &none, NULL) != VLMOE_OK && strstr(vlmoe_last_error(), "images"),
          "the bytes serve one forward only: %s", vlmoe_last_error());
    vlmoe_model_free(m);
    free(u8), free(img), free(tok);
}

int main(void) {
    transforms_check();
    model_check("limoe-tiny");
    model_check("clipup-tiny");
    errors_check();
    divergence_check();
    return test_summary("test_pixels");
}
