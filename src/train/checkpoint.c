// checkpoint.c: exact-resume checkpoints. The weights go to a vlmoe model file; the training
// state (every optimizer buffer, the step, the model's routing-noise RNG, the data position, the
// data RNG and the loader's epoch, index and shuffle block) to a second safetensors file. Every
// tensor of both carries a CRC-32 (src/io/safetensors.c), and both carry the same pairing keys
// (vlmoe.run_id, vlmoe.step, vlmoe.save_id), checked on load: weights of one save are never resumed
// with the state of another. Covered by tests/test_checkpoint.c and tests/hostile/test_hostile_files.c.
//
// The save sequence, safe against a kill at any instant (run_dir.c lists checkpoints by their
// weights files, and trusts a pair only when its keys agree):
//   1. both files written under temporary names (step_N...tmp.PID) and fsynced;
//   2. the state file renamed into place and its directory fsynced: a state without its weights
//      file is invisible to resume;
//   3. the weights file renamed into place: from here the pair is complete; the directory fsynced;
//   4. only then older checkpoints pruned (run.c).
// A kill before 3 leaves the previous complete pair as the newest one (the temporary files are
// removed by the next run, an orphan state too); a kill during a re-save of step N (after a resume
// that fell back past a damaged step N) leaves the old weights with the new state, whose save ids
// differ: that pair is skipped with a message and the one before it resumed. A kill before the
// first checkpoint is complete leaves none: `--resume latest` then starts the run again from step 0.
//
// The state file, version 2 (metadata "vlmoe.state_version" = "2", "optimizer" = the kind's number):
//   trainer.step I64 [1], model.rng U64 [2], data.position U64 [1], data.rng U64 [4], data.loader I64 [4]
//   optim.<buffer>.<param>  F32, the parameter's shape: a buffer laid out like the flat parameter
//                           vector, one tensor per parameter of the model's table (AdamW:
//                           optim.adamw.m.<param>, optim.adamw.v.<param>)
//   optim.adafactor.<k>.<param>  F32: Adafactor's own per-parameter buffers, for the parameters it
//                           updates; k = v or m: the parameter's shape; for a factored parameter of
//                           shape (lead..., rows, cols), k = vr: (lead..., rows), k = vc: (lead..., cols)
// Every tensor is keyed by the parameter's name and has its shape, so the file does not depend on
// how the flat buffer is laid out or split over processes (expert parallelism). Version 1 stored
// each buffer as one flat vector optim.<buffer> (optim.adamw.m over all parameters in table order,
// optim.adafactor.vr.<param> as a vector); it is still read, into the same in-memory buffers.
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "io/safetensors.h"
#include "nn/model.h"
#include "train/run.h"
#include "vlmoe.h"

#define STATE_VERSION "2" // 1: optimizer buffers as flat vectors, still read

// One tensor of the optimizer's state as a state file of some version stores it.
// key cannot be cut short: a state name is under 128 bytes and a parameter name under 96.
typedef struct {
    char key[256]; // "optim.adamw.m.<param>", "optim.adafactor.vr.<param>", v1 "optim.adamw.m"
    int ndim;
    int64_t shape[4];
    size_t n;
    float *data;   // the optimizer's own floats for it
} state_tensor;

// Lists the tensors that hold o's state in a file of layout version `ver` (1 or 2), in the order
// the writer adds them; *out is allocated (vlmoe_free_mem) and *nfloats gets their total size.
static int list_state(vlmoe_optim *o, const vlmoe_model *m, int ver, state_tensor **out, int *count,
                      size_t *nfloats) {
    int nparams;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &nparams);
    const int ns = vlmoe_optim_state_count(o);
    int cap = 0;
    for (int i = 0; i < ns; i++) {
        int flat;
        vlmoe_optim_state_layout(o, i, &flat, NULL, NULL);
        cap += ver >= 2 && flat ? nparams : 1;
    }
    state_tensor *ts = vlmoe_calloc(sizeof(*ts) * (size_t)(cap + 1), "optimizer state list");
    if (!ts) return VLMOE_ERR_NOMEM;
    int k = 0, st = VLMOE_OK;
    size_t sum = 0;
    for (int i = 0; i < ns && !st; i++) {
        const char *name;
        float *d;
        size_t n;
        int flat, ndim;
        int64_t shape[4];
        vlmoe_optim_state_get(o, i, &name, &d, &n);
        vlmoe_optim_state_layout(o, i, &flat, &ndim, shape);
        if (ver < 2 || !flat) {
            state_tensor *t = &ts[k++];
            snprintf(t->key, sizeof(t->key), "optim.%s", name);
            t->ndim = ver < 2 ? 1 : ndim; // version 1 wrote every buffer as a vector
            if (ver < 2) t->shape[0] = (int64_t)n;
            else memcpy(t->shape, shape, sizeof(shape));
            t->n = n, t->data = d;
            sum += n;
            continue;
        }
        // A flat buffer spans the model's parameter vector (the optimizer may update only some of
        // it, e.g. with freeze_moe): split it by the model's table, whose views tile that vector.
        if (n != vlmoe_model_num_floats(m)) {
            st = vlmoe_fail(VLMOE_ERR_ARG, "optimizer state '%s' holds %zu floats, the model %zu", name, n,
                            vlmoe_model_num_floats(m));
            break;
        }
        for (int p = 0; p < nparams; p++) {
            state_tensor *t = &ts[k++];
            snprintf(t->key, sizeof(t->key), "optim.%s.%s", name, tab[p].name);
            t->ndim = tab[p].ndim;
            memcpy(t->shape, tab[p].shape, sizeof(t->shape));
            t->n = tab[p].numel, t->data = d + tab[p].offset;
            sum += t->n;
        }
    }
    if (st) return vlmoe_free_mem(ts), st;
    *out = ts, *count = k, *nfloats = sum;
    return VLMOE_OK;
}

static void fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    int len = snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && len > 0 && (size_t)len < cap; d++)
        len += snprintf(buf + len, cap - (size_t)len, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (len > 0 && (size_t)len < cap) snprintf(buf + len, cap - (size_t)len, "]");
}

// 16 hex digits of /dev/urandom (or, without it, of the clock and the process id): ids only need to
// differ between runs and between saves, not to be secret.
static void random_id(char *out, size_t cap) {
    uint64_t x = 0;
    const int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, &x, sizeof(x)) != (ssize_t)sizeof(x)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = vlmoe_mix64((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ (uint64_t)getpid();
    }
    if (fd >= 0) close(fd);
    snprintf(out, cap, "%016llx", (unsigned long long)x);
}

// The pairing keys of one save, written into both files.
typedef struct {
    char run[VLMOE_RUN_ID_LEN], step[24], save[24];
} pair_keys;

static int add_pair_keys(vlmoe_st_writer *w, const pair_keys *k) {
    int st = vlmoe_st_writer_meta(w, "vlmoe.run_id", k->run);
    if (!st) st = vlmoe_st_writer_meta(w, "vlmoe.step", k->step);
    if (!st) st = vlmoe_st_writer_meta(w, "vlmoe.save_id", k->save);
    return st;
}

// The state file's writer; the optimizer's tensors ts (nt) and the scalars in sc are read when it writes.
typedef struct {
    int64_t step;
    uint64_t model_rng[2], pos, rng[4];
    int64_t loader[4];
} state_scalars;

static int state_writer(const vlmoe_trainer *t, const state_tensor *ts, int nt, const state_scalars *sc,
                        vlmoe_st_writer **out) {
    vlmoe_st_writer *w = NULL;
    int st = vlmoe_st_writer_init(&w);
    const int64_t one[1] = {1}, two[1] = {2}, four[1] = {4};
    char kind[8];
    snprintf(kind, sizeof(kind), "%d", (int)vlmoe_trainer_params(t)->optim.kind);
    if (!st) st = vlmoe_st_writer_meta(w, "vlmoe.state_version", STATE_VERSION);
    if (!st) st = vlmoe_st_writer_meta(w, "optimizer", kind);
    if (!st) st = vlmoe_st_writer_add_raw(w, "trainer.step", VLMOE_DT_I64, 1, one, &sc->step);
    if (!st) st = vlmoe_st_writer_add_raw(w, "model.rng", VLMOE_DT_U64, 1, two, sc->model_rng);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.position", VLMOE_DT_U64, 1, one, &sc->pos);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.rng", VLMOE_DT_U64, 1, four, sc->rng);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.loader", VLMOE_DT_I64, 1, four, sc->loader);
    for (int i = 0; i < nt && !st; i++)
        st = vlmoe_st_writer_add_f32(w, ts[i].key, VLMOE_DT_F32, ts[i].ndim, ts[i].shape, ts[i].data);
    if (st) vlmoe_st_writer_free(w), w = NULL;
    *out = w;
    return st;
}

int vlmoe_trainer_save(const vlmoe_trainer *tc, const char *weights_path, const char *state_path,
                       const vlmoe_data_state *data) {
    vlmoe_trainer *t = (vlmoe_trainer *)tc; // the optimizer's buffers are only read
    vlmoe_model *m = vlmoe_trainer_model(t);
    vlmoe_optim *o = vlmoe_trainer_optim(t);
    int st = vlmoe_model_check_finite(m, 0);
    if (st) return vlmoe_error_prefix("refusing to write %s", weights_path), st;
    state_tensor *ts;
    int nt;
    size_t nfloats;
    if ((st = list_state(o, m, 2, &ts, &nt, &nfloats)))
        return vlmoe_error_prefix("refusing to write %s", state_path), st;
    for (int i = 0; i < nt && !st; i++)
        for (size_t k = 0; k < ts[i].n && !st; k++)
            if (!isfinite(ts[i].data[k]))
                st = vlmoe_fail(VLMOE_ERR_NUMERIC, "refusing to write %s: optimizer state '%s' holds %g at element %zu",
                                state_path, ts[i].key, (double)ts[i].data[k], k);
    state_scalars sc = {.step = vlmoe_optim_get_step(o), .pos = data ? data->data_position : 0};
    vlmoe_model_get_rng(m, sc.model_rng);
    if (data) {
        memcpy(sc.rng, data->data_rng, sizeof(sc.rng));
        sc.loader[0] = data->data_epoch, sc.loader[1] = data->data_index;
        sc.loader[2] = data->data_block[0], sc.loader[3] = data->data_block[1];
    }
    char *run = vlmoe_trainer_run_id(t);
    if (!run[0]) random_id(run, VLMOE_RUN_ID_LEN);
    pair_keys keys;
    snprintf(keys.run, sizeof(keys.run), "%s", run);
    snprintf(keys.step, sizeof(keys.step), "%lld", (long long)sc.step);
    random_id(keys.save, sizeof(keys.save));
    vlmoe_st_writer *ww = NULL, *sw = NULL;
    if (!st) st = model_writer(m, &ww);
    if (!st) st = add_pair_keys(ww, &keys);
    if (!st) st = state_writer(t, ts, nt, &sc, &sw);
    if (!st) st = add_pair_keys(sw, &keys);
    // the sequence of the comment at the top of this file
    char wtmp[1100] = "", stmp[1100] = "";
    if (!st) st = vlmoe_st_writer_write_tmp(sw, state_path, stmp, sizeof(stmp));
    if (!st && (st = vlmoe_st_writer_write_tmp(ww, weights_path, wtmp, sizeof(wtmp)))) remove(stmp);
    if (!st && rename(stmp, state_path)) {
        st = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot rename %s to it: %s", state_path, stmp, strerror(errno));
        remove(stmp), remove(wtmp);
    }
    // the state's rename reaches the disk before the weights' (a power cut must not reorder them)
    if (!st && (st = vlmoe_sync_dir(state_path))) remove(wtmp);
    if (!st && rename(wtmp, weights_path)) {
        st = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot rename %s to it: %s", weights_path, wtmp, strerror(errno));
        remove(wtmp);
    }
    if (!st) st = vlmoe_sync_dir(weights_path);
    vlmoe_st_writer_free(ww);
    vlmoe_st_writer_free(sw);
    vlmoe_free_mem(ts);
    return st;
}

// Reads one little-endian integer scalar/array tensor of the expected dtype and length.
static int read_ints(const vlmoe_st *f, const char *name, vlmoe_dtype dt, size_t n, void *out) {
    int i = vlmoe_st_find(f, name);
    vlmoe_tensor_info ti;
    if (i < 0 || vlmoe_st_info(f, i, &ti) || ti.dtype != dt || ti.numel != n)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' missing or not %zu x %s", vlmoe_st_path(f), name, n,
                          vlmoe_dtype_name(dt));
    memcpy(out, ti.data, ti.nbytes);
    return VLMOE_OK;
}

// Reads tensor t of the state file into dst (t->n floats) once it is known to exist with t's shape;
// refuses values that are not finite.
static int read_state_tensor(const vlmoe_st *f, const state_tensor *t, float *dst) {
    const int idx = vlmoe_st_find(f, t->key);
    if (idx < 0) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: missing tensor '%s'", vlmoe_st_path(f), t->key);
    vlmoe_tensor_info ti;
    int st = vlmoe_st_info(f, idx, &ti);
    if (st) return st;
    int same = ti.ndim == t->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = ti.shape[d] == t->shape[d];
    if (!same) {
        char got[128], want[128];
        fmt_shape(got, sizeof(got), ti.ndim, ti.shape);
        fmt_shape(want, sizeof(want), t->ndim, t->shape);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' has shape %s, this run needs %s", vlmoe_st_path(f),
                          t->key, got, want);
    }
    if ((st = vlmoe_st_read_f32(f, t->key, dst, t->n))) return st;
    for (size_t k = 0; k < t->n; k++)
        if (!isfinite(dst[k]))
            return vlmoe_fail(VLMOE_ERR_NUMERIC, "%s: tensor '%s' holds %g at element %zu", vlmoe_st_path(f), t->key,
                              (double)dst[k], k);
    return VLMOE_OK;
}

// Refuses optimizer tensors beyond the listed ones, which were all found: one for a parameter the
// model does not have means the state belongs to another model, and silently dropping it would
// hide that.
static int check_no_extra(const vlmoe_st *f, const vlmoe_model *m, const state_tensor *ts, int nt) {
    const int n = vlmoe_st_count(f);
    int nopt = 0;
    vlmoe_tensor_info ti;
    for (int i = 0; i < n; i++) nopt += !vlmoe_st_info(f, i, &ti) && !strncmp(ti.name, "optim.", 6);
    if (nopt == nt) return VLMOE_OK; // names in a file are unique
    for (int i = 0; i < n; i++) {
        if (vlmoe_st_info(f, i, &ti) || strncmp(ti.name, "optim.", 6)) continue;
        int known = 0;
        for (int k = 0; k < nt && !known; k++) known = !strcmp(ts[k].key, ti.name);
        if (known) continue;
        // keys are optim.<optimizer>.<buffer>.<param>: the parameter's name follows the third dot
        const char *param = ti.name;
        for (int dots = 0; param && dots < 3; dots++)
            if ((param = strchr(param, '.'))) param++;
        int nparams, have = 0;
        const vlmoe_param_info *tab = vlmoe_model_params(m, &nparams);
        for (int p = 0; param && p < nparams && !have; p++) have = !strcmp(tab[p].name, param);
        if (param && !have)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' is optimizer state of parameter '%s', which this "
                              "model does not have", vlmoe_st_path(f), ti.name, param);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' is not part of this run's optimizer state",
                          vlmoe_st_path(f), ti.name);
    }
    return VLMOE_OK;
}

// The state file's pairing keys, compared with the weights file's when it is opened.
typedef struct {
    const char *state_path;
    const char *key[3]; // run_id, step, save_id of the state file (NULL: absent, an older file)
    int verified;       // both files carried checksums
} pair_check;

static const char *const pair_names[3] = {"vlmoe.run_id", "vlmoe.step", "vlmoe.save_id"};

static int check_pair(void *u, const vlmoe_st *f) {
    pair_check *c = u;
    c->verified = c->verified && vlmoe_st_checksummed(f);
    if (!c->key[0] && !c->key[1] && !c->key[2]) return VLMOE_OK; // a state older than the keys: cannot be paired
    for (int i = 0; i < 3; i++) {
        const char *w = vlmoe_st_metadata(f, pair_names[i]), *s = c->key[i];
        if (!w || !s || strcmp(w, s))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s (run %s, step %s, save %s) and %s (run %s, step %s, save %s) are not "
                              "one checkpoint: the weights and the state come from different saves",
                              vlmoe_st_path(f), vlmoe_st_metadata(f, pair_names[0]) ? vlmoe_st_metadata(f, pair_names[0]) : "?",
                              vlmoe_st_metadata(f, pair_names[1]) ? vlmoe_st_metadata(f, pair_names[1]) : "?",
                              vlmoe_st_metadata(f, pair_names[2]) ? vlmoe_st_metadata(f, pair_names[2]) : "?",
                              c->state_path, c->key[0] ? c->key[0] : "?", c->key[1] ? c->key[1] : "?",
                              c->key[2] ? c->key[2] : "?");
    }
    return VLMOE_OK;
}

int vlmoe_trainer_load(vlmoe_trainer *t, const char *weights_path, const char *state_path, vlmoe_data_state *data) {
    return vlmoe_trainer_load_checked(t, weights_path, state_path, data, NULL);
}

int vlmoe_trainer_load_checked(vlmoe_trainer *t, const char *weights_path, const char *state_path,
                               vlmoe_data_state *data, int *verified) {
    vlmoe_model *m = vlmoe_trainer_model(t);
    vlmoe_optim *o = vlmoe_trainer_optim(t);
    vlmoe_st *f;
    int st = vlmoe_st_open(state_path, &f);
    if (st) return st;
    const char *ver = vlmoe_st_metadata(f, "vlmoe.state_version"), *kind = vlmoe_st_metadata(f, "optimizer");
    const int version = !ver ? 0 : !strcmp(ver, "1") ? 1 : !strcmp(ver, STATE_VERSION) ? 2 : 0;
    int64_t step = 0;
    uint64_t model_rng[2] = {0, 0};
    vlmoe_data_state ds;
    memset(&ds, 0, sizeof(ds));
    if (!version)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not a vlmoe training state of version 1 or " STATE_VERSION
                        " (version %s)", state_path, ver ? ver : "missing");
    else if (!kind || atoi(kind) != (int)vlmoe_trainer_params(t)->optim.kind)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: saved with another optimizer than this run's", state_path);
    if (!st) st = read_ints(f, "trainer.step", VLMOE_DT_I64, 1, &step);
    if (!st) st = read_ints(f, "model.rng", VLMOE_DT_U64, 2, model_rng);
    if (!st) st = read_ints(f, "data.position", VLMOE_DT_U64, 1, &ds.data_position);
    if (!st) st = read_ints(f, "data.rng", VLMOE_DT_U64, 4, ds.data_rng);
    int64_t loader[4] = {0, 0, 0, 0}; // absent from states written before the loader existed
    if (!st && vlmoe_st_find(f, "data.loader") >= 0) st = read_ints(f, "data.loader", VLMOE_DT_I64, 4, loader);
    ds.data_epoch = loader[0], ds.data_index = loader[1], ds.data_block[0] = loader[2], ds.data_block[1] = loader[3];
    if (!st && step < 0) st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: negative step %lld", state_path, (long long)step);
    pair_check pc = {.state_path = state_path, .verified = vlmoe_st_checksummed(f)};
    char keys[3][VLMOE_RUN_ID_LEN] = {"", "", ""}; // copies (f is closed before the weights are opened); longer
                                                   // ones are cut and then fail the comparison
    for (int i = 0; i < 3; i++) {
        const char *v = vlmoe_st_metadata(f, pair_names[i]);
        if (v) snprintf(keys[i], sizeof(keys[i]), "%s", v), pc.key[i] = keys[i];
    }
    char stepstr[24];
    snprintf(stepstr, sizeof(stepstr), "%lld", (long long)step);
    if (!st && pc.key[1] && strcmp(pc.key[1], stepstr))
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata says step %s, its trainer.step is %lld: the file is damaged",
                        state_path, pc.key[1], (long long)step);
    // read every optimizer tensor into scratch first: nothing changes unless all are valid
    state_tensor *ts = NULL;
    int nt = 0;
    size_t nfloats = 0;
    if (!st && (st = list_state(o, m, version, &ts, &nt, &nfloats))) vlmoe_error_prefix("%s", state_path);
    float *tmp = st ? NULL : vlmoe_alloc(sizeof(float) * (nfloats + 1), "optimizer state");
    if (!st && !tmp) st = VLMOE_ERR_NOMEM;
    size_t off = 0;
    for (int i = 0; i < nt && !st; off += ts[i++].n) st = read_state_tensor(f, &ts[i], tmp + off);
    if (!st) st = check_no_extra(f, m, ts, nt);
    vlmoe_st_close(f);
    if (!st) st = model_load_into_checked(m, weights_path, check_pair, &pc); // validates before it changes m
    if (!st) {
        off = 0;
        for (int i = 0; i < nt; off += ts[i++].n) memcpy(ts[i].data, tmp + off, sizeof(float) * ts[i].n);
        vlmoe_optim_set_step(o, (long)step);
        vlmoe_model_set_rng(m, model_rng);
        if (data) *data = ds;
        snprintf(vlmoe_trainer_run_id(t), VLMOE_RUN_ID_LEN, "%s", keys[0]); // the run goes on under its id
        if (verified) *verified = pc.verified;
    }
    vlmoe_free_mem(tmp);
    vlmoe_free_mem(ts);
    return st;
}
