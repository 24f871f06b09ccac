// test_devopt.c: AdamW with the model resident on a device table (issue 16; src/train/trainer.c
// to_device, src/nn/device.c model_go_resident, src/optim/optim.c optim_to_device), checked on
// tests/sep_mem.h's table that claims separate memory and fails any host pointer an op is handed.
// limoe-tiny and clipup-tiny train with clipping on the host table and on separate memory: the
// losses, parameters, both moments and the bytes of a checkpoint written mid-run are the host's,
// bit for bit, and so is a run resumed from that checkpoint on separate memory. Each step's
// host/device traffic is counted: no upload of the parameters and no download of the gradient.
// Controls: the raw host mirror after device steps is stale (a checkpoint written from it without
// a sync differs from the host's), and a host write through vlmoe_model_param_data reaches the
// device before the next step.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "nn/model.h"
#include "sep_mem.h"
#include "train/run.h"
#include "test.h"

// Whole-buffer transfers, by size: the parameters (or gradient) are `total` floats, AdamW's
// moments 2 x total in one piece.
static size_t big_total;
static long up_params, up_moments, down_big;
static void count_upload(const sep_be *be, float *dst, const float *host, size_t n) {
    up_params += n == big_total, up_moments += n == 2 * big_total;
    sep_upload(be, dst, host, n);
}
static void count_download(const sep_be *be, float *host, const float *src, size_t n) {
    down_big += n >= big_total;
    sep_download(be, host, src, n);
}
static void count_reset(void) {
    up_params = up_moments = down_big = 0;
    memset(&sep_traffic, 0, sizeof(sep_traffic));
}

static long file_bytes(const char *path, unsigned char **out) {
    FILE *f = fopen(path, "rb");
    *out = NULL;
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc(n > 0 ? (size_t)n : 1);
    const long got = *out ? (long)fread(*out, 1, (size_t)n, f) : -1;
    fclose(f);
    return got == n ? n : -1;
}

// Whether two checkpoint files hold the same bytes once the save's random pairing id (the one
// field that differs between any two saves) is replaced by the first file's.
static int same_file(const char *a, const char *b) {
    unsigned char *x, *y;
    const long nx = file_bytes(a, &x), ny = file_bytes(b, &y);
    int same = nx > 0 && nx == ny;
    vlmoe_st *fa = NULL, *fb = NULL;
    if (same && !vlmoe_st_open(a, &fa) && !vlmoe_st_open(b, &fb)) {
        const char *ia = vlmoe_st_metadata(fa, "vlmoe.save_id"), *ib = vlmoe_st_metadata(fb, "vlmoe.save_id");
        const size_t k = ia && ib ? strlen(ia) : 0;
        long at = -1; // in the JSON header, after the 8 bytes of its length
        for (long i = 8; k && k == strlen(ib) && at < 0 && i + (long)k <= ny; i++)
            if (!memcmp(y + i, ib, k)) at = i;
        if (at >= 0) memcpy(y + at, ia, k);
        same = (at >= 0 || (!ia && !ib)) && !memcmp(x, y, (size_t)nx); // a model file has no save id
    } else {
        same = 0;
    }
    vlmoe_st_close(fa), vlmoe_st_close(fb);
    free(x), free(y);
    return same;
}

static int same_moments(vlmoe_trainer *a, vlmoe_trainer *b, size_t total) {
    int same = 1;
    for (int i = 0; i < 2; i++) {
        float *x, *y;
        size_t nx, ny;
        vlmoe_optim_state_get(vlmoe_trainer_optim(a), i, NULL, &x, &nx);
        vlmoe_optim_state_get(vlmoe_trainer_optim(b), i, NULL, &y, &ny);
        same &= nx == total && ny == total && !memcmp(x, y, sizeof(float) * total);
    }
    return same;
}

enum { B = 6, STEPS = 5, SAVE_AFTER = 2 };

static void resident_check(const char *name, const char *dir) {
    vlmoe_model_config c;
    vlmoe_config_named(name, &c);
    vlmoe_backend_f32 dev = sep_table();
    dev.upload = count_upload, dev.download = count_download;
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.grad_clip_norm = 0.05; // below the tiny models' norms: every step clips
    const int T = c.context_length;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * B * STEPS);
    int32_t *tok = malloc(sizeof(int32_t) * B * T * STEPS), *len = malloc(sizeof(int32_t) * B * STEPS);
    // 0: the host table; 1: separate memory; 2: separate memory resumed from 1's checkpoint
    vlmoe_model *m[3] = {NULL};
    vlmoe_trainer *t[3] = {NULL};
    int st = vlmoe_synth_init(&s, &sp);
    for (int i = 0; i < STEPS && !st; i++)
        st = vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, (uint64_t)i * B, B, T, img + isz * B * i, tok + (size_t)B * T * i,
                               len + B * i);
    for (int k = 0; k < 3 && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 9);
        if (!st && k) st = model_set_backend(m[k], &dev, NULL);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    CHECK(st == VLMOE_OK, "%s: %s", name, vlmoe_last_error());
    if (st) goto done;
    big_total = m[0]->L.total;
    const size_t total = m[0]->L.total;
    char w[2][600], sf[2][600], raw[600];
    for (int k = 0; k < 2; k++) {
        snprintf(w[k], sizeof(w[k]), "%s/%s_w%d.safetensors", dir, name, k);
        snprintf(sf[k], sizeof(sf[k]), "%s/%s_s%d.safetensors", dir, name, k);
    }
    snprintf(raw, sizeof(raw), "%s/%s_raw.safetensors", dir, name);
    double loss[3][STEPS] = {{0}}, norm[2][STEPS] = {{0}};
    long ups[STEPS][2] = {{0}}, downs[STEPS] = {0}, bigdown[STEPS] = {0}, small[STEPS] = {0}, waits[STEPS] = {0};
    int logged_same = 0, clipped = 0;
    for (int i = 0; i < STEPS && !st; i++) {
        const vlmoe_batch b = {B, img + isz * B * i, tok + (size_t)B * T * i, len + B * i};
        vlmoe_step_stats ss[2];
        for (int k = 0; k < 2 && !st; k++) {
            if (k) count_reset();
            st = vlmoe_trainer_step(t[k], &b, &ss[k]);
            loss[k][i] = ss[k].loss, norm[k][i] = ss[k].grad_norm;
        }
        ups[i][0] = up_params, ups[i][1] = up_moments, downs[i] = sep_traffic.downloads;
        bigdown[i] = down_big, small[i] = sep_traffic.small_downloads;
        waits[i] = sep_traffic.scalar_ops + sep_traffic.syncs;
        logged_same += !st && !memcmp(&ss[0], &ss[1], sizeof(ss[0]));
        clipped += ss[0].grad_norm > tp.grad_clip_norm;
        if (st || i + 1 != SAVE_AFTER) continue;
        // the raw mirror: what a checkpoint that forgot model_sync_host would write
        CHECK(memcmp(m[0]->params, m[1]->params, sizeof(float) * total) != 0,
              "%s control: the host mirror after %d device steps already equals the host table's (no device step?)",
              name, SAVE_AFTER);
        vlmoe_st_writer *rw = NULL;
        int e = vlmoe_st_writer_init(&rw);
        for (int p = 0; p < m[1]->L.nparams && !e; p++) {
            const vlmoe_param_info *q = &m[1]->L.table[p];
            e = vlmoe_st_writer_add_f32(rw, q->name, VLMOE_DT_F32, q->ndim, q->shape, m[1]->params + q->offset);
        }
        if (!e) e = vlmoe_st_writer_write(rw, raw);
        vlmoe_st_writer_free(rw);
        if (!e) e = vlmoe_model_save(m[0], w[0]); // the host's weights, to compare the raw file with
        CHECK(!e && !same_file(raw, w[0]) && m[1]->host_stale,
              "%s control: weights written from the unsynced mirror equal the host table's (%s)", name,
              e ? vlmoe_last_error() : "no error");
        // vlmoe_model_save of the resident model, nothing having synced its mirror before
        if (!e) e = vlmoe_model_save(m[1], w[1]);
        CHECK(!e && same_file(w[0], w[1]), "%s: vlmoe_model_save on separate memory differs from the host's (%s)",
              name, e ? vlmoe_last_error() : "no error");
        vlmoe_data_state ds = {.data_position = (uint64_t)SAVE_AFTER * B};
        st = vlmoe_trainer_save(t[0], w[0], sf[0], &ds);
        // the run's random id, as the host's (the files must differ in the save's id alone)
        if (!st) memcpy(vlmoe_trainer_run_id(t[1]), vlmoe_trainer_run_id(t[0]), VLMOE_RUN_ID_LEN);
        if (!st) st = vlmoe_trainer_save(t[1], w[1], sf[1], &ds);
        CHECK(!st, "%s: checkpoint after step %d: %s", name, SAVE_AFTER, vlmoe_last_error());
        CHECK(!st && same_file(w[0], w[1]), "%s: checkpoint weights of separate memory differ from the host's", name);
        CHECK(!st && same_file(sf[0], sf[1]), "%s: checkpoint state of separate memory differs from the host's", name);
        if (!st) st = vlmoe_trainer_load(t[2], w[1], sf[1], NULL);
        CHECK(!st, "%s: resume on separate memory: %s", name, vlmoe_last_error());
    }
    CHECK(st == VLMOE_OK, "%s steps: %s", name, vlmoe_last_error());
    // the resumed run: the steps after the checkpoint, on separate memory
    for (int i = SAVE_AFTER; i < STEPS && !st; i++) {
        const vlmoe_batch b = {B, img + isz * B * i, tok + (size_t)B * T * i, len + B * i};
        vlmoe_step_stats ss;
        st = vlmoe_trainer_step(t[2], &b, &ss);
        loss[2][i] = ss.loss;
    }
    CHECK(st == VLMOE_OK, "%s resumed steps: %s", name, vlmoe_last_error());
    CHECK(clipped == STEPS, "%s: %d of %d steps clipped at %g (the test must clip)", name, clipped, STEPS,
          tp.grad_clip_norm);
    CHECK(logged_same == STEPS, "%s: step statistics equal in %d of %d steps", name, logged_same, STEPS);
    for (int i = 0; i < STEPS; i++) {
        CHECK(loss[1][i] == loss[0][i] && norm[1][i] == norm[0][i],
              "%s step %d: loss %.17g norm %.17g on separate memory, %.17g %.17g on the host", name, i + 1, loss[1][i],
              norm[1][i], loss[0][i], norm[0][i]);
        if (i >= SAVE_AFTER)
            CHECK(loss[2][i] == loss[0][i], "%s step %d: resumed loss %.17g, host %.17g", name, i + 1, loss[2][i],
                  loss[0][i]);
    }
    for (int k = 1; k < 3 && !st; k++) {
        CHECK(!memcmp(vlmoe_model_param_data(m[k]), m[0]->params, sizeof(float) * total),
              "%s: parameters of model %d after %d steps differ from the host table's", name, k, STEPS);
        CHECK(same_moments(t[k], t[0], total), "%s: AdamW moments of model %d differ from the host table's", name, k);
    }
    // traffic: the first step uploads the parameters and zero moments once; a step after a
    // checkpoint uploads the moments again (vlmoe_optim_state_get hands out writable buffers);
    // every other step moves neither, and none downloads anything whole. One download a step:
    // the step's scalars with the auxiliary losses' values behind them (the clamped logit scale
    // stays on the device). No op's value is waited for and nothing syncs.
    for (int i = 0; i < STEPS; i++) {
        const long want_p = i == 0, want_m = i == 0 || i == SAVE_AFTER;
        CHECK(ups[i][0] == want_p && ups[i][1] == want_m,
              "%s step %d: %ld parameter uploads, %ld moment uploads (expected %ld, %ld)", name, i + 1, ups[i][0],
              ups[i][1], want_p, want_m);
        CHECK(bigdown[i] == 0, "%s step %d: %ld whole downloads (gradient or parameters)", name, i + 1, bigdown[i]);
        CHECK(downs[i] == 1 && waits[i] == 0, "%s step %d: %ld downloads, %ld waits for values or syncs, expected 1 "
              "and 0", name, i + 1, downs[i], waits[i]);
    }
    printf("%s on separate memory: per step %ld downloads (%ld small, %ld whole), %ld parameter uploads after the "
           "first step\n", name, downs[STEPS - 1], small[STEPS - 1], bigdown[STEPS - 1], ups[STEPS - 1][0]);
    // a host write reaches the device: the same change on both models gives the same next step
    if (!st) {
        const vlmoe_batch b = {B, img, tok, len};
        vlmoe_step_stats ss[2];
        for (int k = 0; k < 2 && !st; k++) {
            float *p = vlmoe_model_param_data(m[k]);
            for (size_t j = 0; j < total; j += 7) p[j] *= 0.5f;
            st = vlmoe_trainer_step(t[k], &b, &ss[k]);
        }
        CHECK(!st && ss[0].loss == ss[1].loss && !memcmp(vlmoe_model_param_data(m[1]), m[0]->params, sizeof(float) * total),
              "%s: after a host write: loss %.17g on separate memory, %.17g on the host (%s)", name, ss[1].loss,
              ss[0].loss, st ? vlmoe_last_error() : "");
    }
    CHECK(sep_stray == 0, "%s: %d host pointers handed to separate memory; first: %s", name, sep_stray, sep_first);
    for (int k = 0; k < 2; k++) remove(w[k]), remove(sf[k]);
    remove(raw);
done:
    for (int k = 0; k < 3; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
    vlmoe_synth_free(s);
    free(img), free(tok), free(len);
}

// Adafactor stays on the host's path on separate memory (its state is not moved): the same
// losses and parameters as the host table, and the gradient still comes down each step.
static void adafactor_check(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_backend_f32 dev = sep_table();
    dev.upload = count_upload, dev.download = count_download;
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    const int T = c.context_length;
    float *img = malloc(sizeof(float) * 3 * c.image_size * c.image_size * B);
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *len = malloc(sizeof(int32_t) * B);
    vlmoe_model *m[2] = {NULL};
    vlmoe_trainer *t[2] = {NULL};
    int st = vlmoe_synth_init(&s, &sp);
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, 0, B, T, img, tok, len);
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 4);
        if (!st && k) st = model_set_backend(m[k], &dev, NULL);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    double loss[2] = {0};
    if (!st) big_total = m[0]->L.total, count_reset();
    for (int k = 0; k < 2 && !st; k++) {
        const vlmoe_batch b = {B, img, tok, len};
        vlmoe_step_stats ss;
        st = vlmoe_trainer_step(t[k], &b, &ss);
        loss[k] = ss.loss;
    }
    CHECK(!st && loss[0] == loss[1] && !memcmp(m[0]->params, m[1]->params, sizeof(float) * m[0]->L.total),
          "Adafactor on separate memory: loss %.17g, host %.17g (%s)", loss[1], loss[0], st ? vlmoe_last_error() : "");
    CHECK(!st && !m[1]->resident && down_big == 1, "Adafactor on separate memory: resident %d, %ld whole downloads "
          "(expected the host's path: 0 and 1)", !st && m[1]->resident, down_big);
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
    vlmoe_synth_free(s);
    free(img), free(tok), free(len);
}

int main(void) {
    char dir[] = "/tmp/vlmoe_devopt_XXXXXX";
    if (!mkdtemp(dir)) return fprintf(stderr, "test_devopt: cannot create a temporary directory\n"), 1;
    resident_check("limoe-tiny", dir);
    resident_check("clipup-tiny", dir);
    adafactor_check();
    rmdir(dir);
    return test_summary("test_devopt");
}
