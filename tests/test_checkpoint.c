// test_checkpoint.c: exact resume. (1) Library: a trainer restored from a checkpoint taken at
// step 4 (into a model initialised differently) continues with bit-identical losses, for a
// LIMoE model whose routing noise must resume too; the state holds the optimizer's buffers per
// parameter (optim.adamw.m.<param>, Adafactor's vr/vc/v/m with their own shapes), and a version 1
// state (flat buffers, written here the old way) resumes bit for bit too, with AdamW and Adafactor;
// bad state files (truncated, a moment misshapen, missing, NaN or for an unknown parameter) are
// refused, naming the tensor, without touching the trainer. (2) The command: a run killed with
// SIGKILL again and again (some kills land while a checkpoint is being written) and resumed each
// time with --resume latest logs exactly the losses of an uninterrupted run. (3) A corrupted newest checkpoint is reported and the previous
// one is used.
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "test.h"
#include "vlmoe.h"

static char dir[64];

typedef struct {
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_synth *data;
    float img[16 * 3 * 32 * 32];
    int32_t tok[16 * 16], lens[16];
} lrun;

// A limoe-tiny trainer; tp NULL: the default AdamW parameters.
static void lrun_init(lrun *r, uint64_t seed, const vlmoe_train_params *tp) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_model_init(&r->m, &c, seed);
    vlmoe_train_params dp = vlmoe_train_default_params();
    if (!tp) tp = &dp;
    dp.schedule.warmup_steps = 3;
    dp.schedule.total_steps = 8;
    CHECK(vlmoe_trainer_init(&r->t, r->m, tp) == VLMOE_OK, "trainer: %s", vlmoe_last_error());
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    vlmoe_synth_init(&r->data, &sp);
}

static double lrun_step(lrun *r, long step) {
    vlmoe_synth_batch(r->data, VLMOE_SPLIT_TRAIN, (uint64_t)step * 16, 16, 16, r->img, r->tok, r->lens);
    vlmoe_batch b = {16, r->img, r->tok, r->lens};
    vlmoe_step_stats s;
    CHECK(vlmoe_trainer_step(r->t, &b, &s) == VLMOE_OK, "step %ld: %s", step, vlmoe_last_error());
    return s.loss;
}

static void lrun_free(lrun *r) {
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_synth_free(r->data);
}

// Every float of the trainer's optimizer state, its buffers concatenated in state order (malloc'd).
static float *optim_snapshot(vlmoe_trainer *t, size_t *total) {
    vlmoe_optim *o = vlmoe_trainer_optim(t);
    size_t n = 0, k;
    for (int i = 0; i < vlmoe_optim_state_count(o); i++) vlmoe_optim_state_get(o, i, NULL, NULL, &k), n += k;
    float *all = malloc(sizeof(float) * (n + 1)), *d;
    n = 0;
    for (int i = 0; all && i < vlmoe_optim_state_count(o); i++) {
        vlmoe_optim_state_get(o, i, NULL, &d, &k);
        memcpy(all + n, d, sizeof(float) * k);
        n += k;
    }
    *total = n;
    return all;
}

// Whether the trainer's optimizer state is bit for bit `snap` (from optim_snapshot).
static int optim_same(vlmoe_trainer *t, const float *snap, size_t n) {
    size_t k;
    float *now = optim_snapshot(t, &k);
    const int same = now && snap && k == n && !memcmp(now, snap, sizeof(float) * n);
    free(now);
    return same;
}

// The state file as version 1 wrote it, before optimizer state was stored per parameter: the same
// scalars and each optimizer buffer as one vector "optim.<buffer>" (AdamW's optim.adamw.m over all
// parameters). Kept here only to check that such files still resume.
static void write_v1_state(vlmoe_trainer *t, const char *path, const vlmoe_data_state *ds) {
    vlmoe_optim *o = vlmoe_trainer_optim(t);
    vlmoe_st_writer *w = NULL;
    int st = vlmoe_st_writer_init(&w);
    const int64_t one[1] = {1}, two[1] = {2}, four[1] = {4};
    const int64_t step = vlmoe_optim_get_step(o);
    uint64_t model_rng[2];
    vlmoe_model_get_rng(vlmoe_trainer_model(t), model_rng);
    const int64_t loader[4] = {ds->data_epoch, ds->data_index, ds->data_block[0], ds->data_block[1]};
    char kind[8];
    snprintf(kind, sizeof(kind), "%d", (int)vlmoe_trainer_params(t)->optim.kind);
    if (!st) st = vlmoe_st_writer_meta(w, "vlmoe.state_version", "1");
    if (!st) st = vlmoe_st_writer_meta(w, "optimizer", kind);
    if (!st) st = vlmoe_st_writer_add_raw(w, "trainer.step", VLMOE_DT_I64, 1, one, &step);
    if (!st) st = vlmoe_st_writer_add_raw(w, "model.rng", VLMOE_DT_U64, 1, two, model_rng);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.position", VLMOE_DT_U64, 1, one, &ds->data_position);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.rng", VLMOE_DT_U64, 1, four, ds->data_rng);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.loader", VLMOE_DT_I64, 1, four, loader);
    for (int i = 0; i < vlmoe_optim_state_count(o) && !st; i++) {
        const char *name;
        float *d;
        size_t n;
        vlmoe_optim_state_get(o, i, &name, &d, &n);
        const int64_t shape[1] = {(int64_t)n};
        char key[160];
        snprintf(key, sizeof(key), "optim.%s", name);
        st = vlmoe_st_writer_add_f32(w, key, VLMOE_DT_F32, 1, shape, d);
    }
    if (!st) st = vlmoe_st_writer_write(w, path);
    CHECK(st == VLMOE_OK, "writing a version 1 state: %s", vlmoe_last_error());
    vlmoe_st_writer_free(w);
}

// How copy_state changes one tensor of a state file.
typedef enum { EDIT_DROP, EDIT_SHAPE, EDIT_NAN, EDIT_ADD } state_edit;

// Copies state file src to dst tensor by tensor with one change to tensor `key`: dropped, given
// (ndim, shape), a NaN at element 1, or (EDIT_ADD) added as 2 zeros.
static void copy_state(const char *src, const char *dst, state_edit e, const char *key, int ndim, const int64_t *shape) {
    vlmoe_st *f = NULL;
    vlmoe_st_writer *w = NULL;
    int st = vlmoe_st_open(src, &f);
    if (!st) st = vlmoe_st_writer_init(&w);
    const char *meta[2] = {"vlmoe.state_version", "optimizer"};
    for (int i = 0; i < 2 && !st; i++) st = vlmoe_st_writer_meta(w, meta[i], vlmoe_st_metadata(f, meta[i]));
    float *nan_copy = NULL, zeros[2] = {0, 0};
    const int64_t two[1] = {2};
    int hit = 0;
    for (int i = 0; !st && i < vlmoe_st_count(f); i++) {
        vlmoe_tensor_info ti;
        if ((st = vlmoe_st_info(f, i, &ti))) break;
        const int mine = !strcmp(ti.name, key);
        hit |= mine;
        if (mine && e == EDIT_DROP) continue;
        if (mine && e == EDIT_SHAPE) {
            st = vlmoe_st_writer_add_raw(w, ti.name, ti.dtype, ndim, shape, ti.data);
        } else if (mine && e == EDIT_NAN) {
            nan_copy = malloc(ti.nbytes);
            memcpy(nan_copy, ti.data, ti.nbytes);
            nan_copy[1] = NAN;
            st = vlmoe_st_writer_add_raw(w, ti.name, ti.dtype, ti.ndim, ti.shape, nan_copy);
        } else {
            st = vlmoe_st_writer_add_raw(w, ti.name, ti.dtype, ti.ndim, ti.shape, ti.data);
        }
    }
    if (!st && e == EDIT_ADD) st = vlmoe_st_writer_add_f32(w, key, VLMOE_DT_F32, 1, two, zeros), hit = 1;
    if (!st) st = vlmoe_st_writer_write(w, dst);
    CHECK(st == VLMOE_OK && hit, "copying %s with '%s' changed: %s", src, key, hit ? vlmoe_last_error() : "no such tensor");
    vlmoe_st_writer_free(w);
    vlmoe_st_close(f);
    free(nan_copy);
}

// The first parameter with ndim dims whose name holds `part`.
static const vlmoe_param_info *find_param(const vlmoe_model *m, int ndim, const char *part) {
    int n;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (tab[i].ndim == ndim && strstr(tab[i].name, part)) return &tab[i];
    CHECK(0, "limoe-tiny has no %d-dim parameter named *%s*", ndim, part);
    return NULL;
}

// Whether tensor `key` of f exists as F32 with shape (ndim, shape); prints what it found if not.
static int has_tensor(const vlmoe_st *f, const char *key, int ndim, const int64_t *shape, vlmoe_tensor_info *ti) {
    const int i = vlmoe_st_find(f, key);
    int same = i >= 0 && !vlmoe_st_info(f, i, ti) && ti->dtype == VLMOE_DT_F32 && ti->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = ti->shape[d] == shape[d];
    if (!same)
        fprintf(stderr, "tensor %s: %s, %d dims [%lld, ...], want %d dims [%lld, ...]\n", key, i < 0 ? "missing" : "found",
                i < 0 ? -1 : ti->ndim, i < 0 ? -1LL : (long long)ti->shape[0], ndim, (long long)shape[0]);
    return same;
}

// (a) A state written now holds AdamW's m and v per parameter: optim.adamw.{m,v}.<param>, with
// the parameter's shape and the optimizer's values at the time, and no flat optim.adamw.m.
static void test_per_param_layout(const char *state, vlmoe_model *m, const float *snap) {
    vlmoe_st *f = NULL;
    CHECK(vlmoe_st_open(state, &f) == VLMOE_OK, "open %s: %s", state, vlmoe_last_error());
    if (!f) return;
    const char *ver = vlmoe_st_metadata(f, "vlmoe.state_version");
    CHECK(ver && !strcmp(ver, "2"), "state version %s, want 2", ver ? ver : "(none)");
    CHECK(vlmoe_st_find(f, "optim.adamw.m") < 0 && vlmoe_st_find(f, "optim.adamw.v") < 0, "flat AdamW moments written");
    int n, nopt = 0, good = 0;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &n);
    const size_t total = vlmoe_model_num_floats(m);
    for (int i = 0; i < vlmoe_st_count(f); i++) {
        vlmoe_tensor_info ti;
        nopt += !vlmoe_st_info(f, i, &ti) && !strncmp(ti.name, "optim.", 6);
    }
    for (int p = 0; p < n; p++)
        for (int b = 0; b < 2; b++) {
            char key[160];
            snprintf(key, sizeof(key), "optim.adamw.%s.%s", b ? "v" : "m", tab[p].name);
            vlmoe_tensor_info ti;
            const int ok = has_tensor(f, key, tab[p].ndim, tab[p].shape, &ti) &&
                           !memcmp(ti.data, snap + b * total + tab[p].offset, sizeof(float) * tab[p].numel);
            CHECK(ok, "%s: missing, misshapen or not the optimizer's values", key);
            good += ok;
        }
    CHECK(nopt == 2 * n, "%d optim.* tensors for %d parameters", nopt, n);
    const vlmoe_param_info *bank = find_param(m, 3, ".moe.experts.fc1.weight");
    if (bank)
        printf("per-parameter state: %d of %d tensors hold the parameter's shape and values, e.g. optim.adamw.m.%s "
               "[%lld, %lld, %lld]\n", good, 2 * n, bank->name, (long long)bank->shape[0], (long long)bank->shape[1],
               (long long)bank->shape[2]);
    vlmoe_st_close(f);
}

// (d) Bad optimizer tensors are refused, naming the file and the tensor, and leave the trainer
// exactly as it was: a wrong shape (same element count), a missing tensor, a NaN, a tensor for a
// parameter the model does not have, a flat version 1 tensor in a version 2 file, and a version 1
// file whose flat buffer has the wrong length.
static void test_bad_state(lrun *r, const char *w, const char *good, const char *good_v1) {
    const vlmoe_param_info *bank = find_param(r->m, 3, ".moe.experts.fc1.weight");
    if (!bank) return;
    char bad[128], key_m[160], key_v[160];
    snprintf(bad, sizeof(bad), "%s/bad_optim.state.safetensors", dir);
    snprintf(key_m, sizeof(key_m), "optim.adamw.m.%s", bank->name);
    snprintf(key_v, sizeof(key_v), "optim.adamw.v.%s", bank->name);
    const int64_t swapped[3] = {bank->shape[0], bank->shape[2], bank->shape[1]}, wrong_len[1] = {17};
    struct {
        const char *src;
        state_edit e;
        const char *key;
        int ndim;
        const int64_t *shape;
        const char *why;
    } cases[] = {
        {good, EDIT_SHAPE, key_m, 3, swapped, "has shape"},
        {good, EDIT_DROP, key_v, 0, NULL, "missing tensor"},
        {good, EDIT_NAN, key_m, 0, NULL, "holds nan"},
        {good, EDIT_ADD, "optim.adamw.m.encoder.blocks.99.ln1.weight", 0, NULL, "which this model does not have"},
        {good, EDIT_ADD, "optim.adamw.m", 0, NULL, "not part of this run's optimizer state"},
        {good_v1, EDIT_SHAPE, "optim.adamw.v", 1, wrong_len, "has shape"},
    };
    size_t n;
    float *snap = optim_snapshot(r->t, &n);
    const size_t np = vlmoe_model_num_floats(r->m);
    float *params = malloc(sizeof(float) * np);
    memcpy(params, vlmoe_model_param_data(r->m), sizeof(float) * np);
    const long step = vlmoe_trainer_get_step(r->t);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        copy_state(cases[i].src, bad, cases[i].e, cases[i].key, cases[i].ndim, cases[i].shape);
        const int st = vlmoe_trainer_load(r->t, w, bad, NULL);
        const char *msg = vlmoe_last_error();
        char quoted[200];
        snprintf(quoted, sizeof(quoted), "'%s'", cases[i].key);
        CHECK(st != VLMOE_OK && strstr(msg, "bad_optim.state") && strstr(msg, quoted) && strstr(msg, cases[i].why),
              "case %zu (%s): status %d, message \"%s\"", i, cases[i].why, st, msg);
        CHECK(optim_same(r->t, snap, n) && vlmoe_trainer_get_step(r->t) == step &&
                  !memcmp(params, vlmoe_model_param_data(r->m), sizeof(float) * np),
              "case %zu (%s): a refused state changed the trainer", i, cases[i].why);
        if (i == 0) printf("bad optimizer state refused, e.g.: %s\n", msg);
    }
    free(params);
    free(snap);
}

// Runs r for 8 steps (losses into loss), saving after step 3 to weights w and state s (plus a
// version 1 state at s1); returns a copy of the optimizer state at the save (*n floats).
static float *run_saving_at_step4(lrun *r, double loss[8], const char *w, const char *s, const char *s1,
                                  size_t *n) {
    float *snap = NULL;
    for (long i = 0; i < 8; i++) {
        loss[i] = lrun_step(r, i);
        if (i == 3) {
            vlmoe_data_state ds = {4 * 16, {1, 2, 3, 4}, 5, 6, {7, 8}};
            CHECK(vlmoe_trainer_save(r->t, w, s, &ds) == VLMOE_OK, "save: %s", vlmoe_last_error());
            write_v1_state(r->t, s1, &ds);
            snap = optim_snapshot(r->t, n);
        }
    }
    return snap;
}

static void test_library_resume(void) {
    char w[128], s[128], s1[128], bad[128];
    snprintf(w, sizeof(w), "%s/lib_step4.safetensors", dir);
    snprintf(s, sizeof(s), "%s/lib_step4.state.safetensors", dir);
    snprintf(bad, sizeof(bad), "%s/bad.state.safetensors", dir);
    snprintf(s1, sizeof(s1), "%s/lib_step4.v1.state.safetensors", dir);
    static lrun a, b, c1;
    double la[8], lb[8], lc[8];
    float *snap;
    size_t nsnap = 0;
    lrun_init(&a, 1, NULL);
    snap = run_saving_at_step4(&a, la, w, s, s1, &nsnap);
    test_per_param_layout(s, a.m, snap);
    lrun_init(&b, 99, NULL); // different weights until the checkpoint replaces them
    vlmoe_data_state got;
    CHECK(vlmoe_trainer_load(b.t, w, s, &got) == VLMOE_OK, "load: %s", vlmoe_last_error());
    CHECK(got.data_position == 64 && got.data_rng[3] == 4 && got.data_epoch == 5 && got.data_index == 6 &&
          got.data_block[0] == 7 && got.data_block[1] == 8, "data state %llu", (unsigned long long)got.data_position);
    CHECK(vlmoe_trainer_get_step(b.t) == 4, "step after load %ld", vlmoe_trainer_get_step(b.t));
    for (long i = 4; i < 8; i++) lb[i] = lrun_step(&b, i);
    CHECK(!memcmp(la + 4, lb + 4, 4 * sizeof(double)), "resumed losses differ: %.17g vs %.17g (step 7)", la[7], lb[7]);
    printf("library resume: steps 4..7 bit-identical (loss at step 7: %.17g)\n", lb[7]);
    // (b) a version 1 state (flat optim.adamw.m / .v) still resumes, to the same moments and losses
    lrun_init(&c1, 98, NULL);
    CHECK(vlmoe_trainer_load(c1.t, w, s1, &got) == VLMOE_OK, "load a version 1 state: %s", vlmoe_last_error());
    CHECK(optim_same(c1.t, snap, nsnap), "the version 1 state read back other moments than were saved");
    CHECK(vlmoe_trainer_get_step(c1.t) == 4 && got.data_index == 6, "version 1 state: step %ld, data index %lld",
          vlmoe_trainer_get_step(c1.t), (long long)got.data_index);
    for (long i = 4; i < 8; i++) lc[i] = lrun_step(&c1, i);
    CHECK(!memcmp(la + 4, lc + 4, 4 * sizeof(double)), "losses resumed from version 1 differ: %.17g vs %.17g (step 7)",
          la[7], lc[7]);
    printf("version 1 (flat) state: resumed, steps 4..7 bit-identical\n");
    lrun_free(&c1);
    test_bad_state(&b, w, s, s1);
    free(snap);
    // a truncated state file is refused and the trainer keeps its state
    FILE *in = fopen(s, "rb"), *out = fopen(bad, "wb");
    char buf[4096];
    size_t n = fread(buf, 1, sizeof(buf), in);
    fwrite(buf, 1, n / 2, out);
    fclose(in), fclose(out);
    long before = vlmoe_trainer_get_step(b.t);
    float p0 = vlmoe_model_param_data(b.m)[0];
    CHECK(vlmoe_trainer_load(b.t, w, bad, NULL) != VLMOE_OK && strstr(vlmoe_last_error(), "bad.state"),
          "truncated state: %s", vlmoe_last_error());
    CHECK(vlmoe_trainer_get_step(b.t) == before && vlmoe_model_param_data(b.m)[0] == p0, "a failed load changed the trainer");
    // weights of another model config are refused
    lrun c;
    vlmoe_model_config cfg;
    vlmoe_config_named("tiny", &cfg);
    vlmoe_model_init(&c.m, &cfg, 1);
    vlmoe_train_params tp = vlmoe_train_default_params();
    vlmoe_trainer_init(&c.t, c.m, &tp);
    CHECK(vlmoe_trainer_load(c.t, w, s, NULL) != VLMOE_OK && strstr(vlmoe_last_error(), "lib_step4"),
          "foreign checkpoint: %s", vlmoe_last_error());
    vlmoe_trainer_free(c.t);
    vlmoe_model_free(c.m);
    // never write NaNs
    vlmoe_model_param_data(b.m)[5] = NAN;
    CHECK(vlmoe_trainer_save(b.t, w, s, NULL) == VLMOE_ERR_NUMERIC, "NaN weights were written");
    lrun_free(&a);
    lrun_free(&b);
}

// Adafactor keeps its own per-parameter buffers: a factored expert bank (E, M, D) is stored as
// optim.adafactor.vr.<bank> (E, M), .vc (E, D) and, with momentum, .m (E, M, D); an unfactored
// vector as .v with its shape. Both this layout and version 1's vectors resume bit for bit.
static void test_adafactor_resume(void) {
    char w[128], s[128], s1[128];
    snprintf(w, sizeof(w), "%s/af_step4.safetensors", dir);
    snprintf(s, sizeof(s), "%s/af_step4.state.safetensors", dir);
    snprintf(s1, sizeof(s1), "%s/af_step4.v1.state.safetensors", dir);
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    tp.optim.min_dim_to_factor = 4;
    tp.optim.beta1 = 0.9f;
    tp.schedule.warmup_steps = 3;
    tp.schedule.total_steps = 8;
    static lrun a, b;
    double la[8], lb[8];
    float *snap;
    size_t nsnap = 0;
    lrun_init(&a, 3, &tp);
    snap = run_saving_at_step4(&a, la, w, s, s1, &nsnap);
    const vlmoe_param_info *bank = find_param(a.m, 3, ".moe.experts.fc1.weight"), *vec = find_param(a.m, 1, "ln1.weight");
    vlmoe_st *f = NULL;
    CHECK(vlmoe_st_open(s, &f) == VLMOE_OK, "open %s: %s", s, vlmoe_last_error());
    if (f && bank && vec) {
        const int64_t rows[2] = {bank->shape[0], bank->shape[1]}, cols[2] = {bank->shape[0], bank->shape[2]};
        struct { const char *buf; const vlmoe_param_info *p; int ndim; const int64_t *shape; } want[] = {
            {"vr", bank, 2, rows}, {"vc", bank, 2, cols}, {"m", bank, 3, bank->shape},
            {"v", vec, 1, vec->shape}, {"m", vec, 1, vec->shape},
        };
        for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
            char key[160];
            snprintf(key, sizeof(key), "optim.adafactor.%s.%s", want[i].buf, want[i].p->name);
            vlmoe_tensor_info ti;
            CHECK(has_tensor(f, key, want[i].ndim, want[i].shape, &ti), "Adafactor state %s missing or misshapen", key);
        }
        printf("Adafactor state per parameter, e.g. optim.adafactor.vr.%s [%lld, %lld]\n", bank->name,
               (long long)rows[0], (long long)rows[1]);
    }
    vlmoe_st_close(f);
    const char *from[2] = {s, s1};
    for (int k = 0; k < 2; k++) {
        lrun_init(&b, 97, &tp);
        CHECK(vlmoe_trainer_load(b.t, w, from[k], NULL) == VLMOE_OK, "load %s: %s", from[k], vlmoe_last_error());
        CHECK(optim_same(b.t, snap, nsnap), "%s: Adafactor state read back differs", from[k]);
        for (long i = 4; i < 8; i++) lb[i] = lrun_step(&b, i);
        CHECK(!memcmp(la + 4, lb + 4, 4 * sizeof(double)), "%s: resumed losses differ: %.17g vs %.17g (step 7)",
              from[k], la[7], lb[7]);
        lrun_free(&b);
    }
    printf("Adafactor resume from version 2 and version 1 states: steps 4..7 bit-identical\n");
    free(snap);
    lrun_free(&a);
}

// ---- the command
static const char *bin;

#define NSTEPS 40
static const char *TRAIN_ARGS = "train --model limoe-tiny --steps 40 --batch-size 8 --warmup 3 --save-every-n-steps 1 "
                                "--keep-checkpoints 2 --log-every-n-steps 1 --eval-samples 0 --threads 2";

static int run_cmd(const char *extra) {
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s %s --logs %s %s > %s/out.txt 2>&1", bin, TRAIN_ARGS, dir, extra, dir);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Reads metrics.jsonl: for each step the raw text of its "loss" (the last line of a step wins,
// as after a resume the steps since the last checkpoint are logged again).
static int read_losses(const char *run, char (*losses)[40], int max) {
    char path[256], line[8192];
    snprintf(path, sizeof(path), "%s/%s/metrics.jsonl", dir, run);
    FILE *f = fopen(path, "r");
    int n = 0;
    while (f && fgets(line, sizeof(line), f)) {
        int step;
        char *p = strstr(line, "\"loss\":");
        if (!p || sscanf(line, "{\"step\":%d", &step) != 1 || step < 1 || step > max) continue;
        sscanf(p + 7, "%39[^,}]", losses[step - 1]);
        if (step > n) n = step;
    }
    if (f) fclose(f);
    return n;
}

static int count_tmp(const char *run) {
    char path[256];
    snprintf(path, sizeof(path), "%s/%s/checkpoints", dir, run);
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

// Whether run/checkpoints holds a complete checkpoint (weights and training state of one step).
static int have_checkpoint(const char *run) {
    char path[256], state[300];
    snprintf(path, sizeof(path), "%s/%s/checkpoints", dir, run);
    DIR *d = opendir(path);
    int have = 0;
    struct dirent *e;
    long step;
    while (d && (e = readdir(d)))
        if (!strstr(e->d_name, ".tmp.") && !strstr(e->d_name, ".state.") && sscanf(e->d_name, "step_%ld.safetensors", &step) == 1) {
            snprintf(state, sizeof(state), "%s/step_%ld.state.safetensors", path, step);
            have |= access(state, F_OK) == 0;
        }
    if (d) closedir(d);
    return have;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void test_kill_and_resume(void) {
    // kills land at random moments after the start-up (long under ASan, on a busy machine),
    // within a quarter of a run's length, so every run is cut several times
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s version > /dev/null 2>&1", bin);
    double t0 = now_ms();
    CHECK(system(cmd) == 0, "%s version failed", bin);
    double t1 = now_ms();
    CHECK(run_cmd("--name full") == 0, "uninterrupted run failed");
    const long start_ms = (long)(t1 - t0), window = (long)fmax(20, (now_ms() - t1 - (t1 - t0)) / 4);
    static char full[NSTEPS][40], killed[NSTEPS][40];
    CHECK(read_losses("full", full, NSTEPS) == NSTEPS, "uninterrupted run logged %d steps", read_losses("full", full, NSTEPS));
    int kills = 0, midwrite = 0, done = 0;
    long off = start_ms; // a kill's earliest moment after the fork
    srand(12345);
    for (int attempt = 0; attempt < 400 && !(done && midwrite); attempt++) {
        if (done) { // finished without a kill during a write: once more from scratch
            snprintf(cmd, sizeof(cmd), "rm -rf %s/killed", dir);
            CHECK(system(cmd) == 0, "cleanup");
            done = 0;
        }
        const int have = have_checkpoint("killed"); // resume once a checkpoint exists
        pid_t pid = fork();
        if (pid == 0) {
            snprintf(cmd, sizeof(cmd), "exec %s %s --logs %s --name killed %s > /dev/null 2>&1", bin, TRAIN_ARGS,
                     dir, have ? "--resume latest" : "");
            execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
            _exit(127);
        }
        const long ms = off + rand() % window;
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            done = WIFEXITED(status) && WEXITSTATUS(status) == 0;
            // the run ended before its kill: the start-up, timed once (perhaps while the machine
            // was busier), is shorter now, so the next kills come sooner (once 10 of 400
            // attempts were killed and none of them mid-write)
            off = off * 3 / 4;
            continue;
        }
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        kills++;
        midwrite += count_tmp("killed") > 0;
    }
    if (!done) CHECK(run_cmd("--name killed --resume latest") == 0, "final resume failed");
    int n = read_losses("killed", killed, NSTEPS);
    CHECK(n == NSTEPS, "killed run logged %d steps", n);
    int same = 1;
    for (int i = 0; i < NSTEPS; i++) same &= !strcmp(full[i], killed[i]) && full[i][0];
    CHECK(same, "losses after %d kills differ from the uninterrupted run", kills);
    CHECK(midwrite > 0, "no kill landed while a checkpoint was being written (%d kills)", kills);
    printf("kill test: %d SIGKILLs, %d while a checkpoint was being written; all %d losses bit-identical\n", kills,
           midwrite, NSTEPS);
}

static void test_corrupt_latest(void) {
    // "full" has checkpoints 39 and 40 (keep 2): corrupt 40, resume to 42 from 39
    char path[256];
    snprintf(path, sizeof(path), "%s/full/checkpoints/step_40.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL, "open %s", path);
    if (!f) return;
    fseek(f, 0, SEEK_SET);
    fputs("garbage!garbage!", f);
    fclose(f);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s train --model limoe-tiny --steps 42 --batch-size 8 --warmup 3 --log-every-n-steps 1 "
             "--eval-samples 0 --logs %s --name full --resume latest > %s/out.txt 2>&1", bin, dir, dir);
    int st = system(cmd);
    snprintf(path, sizeof(path), "%s/out.txt", dir);
    f = fopen(path, "r");
    char out[8192] = "";
    size_t n = f ? fread(out, 1, sizeof(out) - 1, f) : 0;
    out[n] = 0;
    if (f) fclose(f);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "resume after corruption failed:\n%s", out);
    CHECK(strstr(out, "step_40.safetensors is unusable") && strstr(out, "resuming from") && strstr(out, "step_39"),
          "the corrupt checkpoint was not reported and skipped:\n%s", out);
    // with every checkpoint corrupt, resume refuses clearly
    snprintf(cmd, sizeof(cmd), "for f in %s/full/checkpoints/*.safetensors; do printf xxxxxxxx > $f; done; "
             "%s train --model limoe-tiny --steps 44 --batch-size 8 --warmup 3 --logs %s --name full --resume latest "
             "> %s/out.txt 2>&1", dir, bin, dir, dir);
    st = system(cmd);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1, "resume with only corrupt checkpoints must fail");
}

int main(int argc, char **argv) {
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_ckpt_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    test_library_resume();
    test_adafactor_resume();
    static char abs[4096];
    if ((bin = test_vlmoe_bin(argv[0], abs))) {
        test_kill_and_resume();
        test_corrupt_latest();
    }
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    (void)argc;
    return test_summary("test_checkpoint");
}
