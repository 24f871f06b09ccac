// checkpoint.c: exact-resume checkpoints. The weights go to a vlmoe model file; the training
// state (every optimizer buffer, the step, the model's routing-noise RNG, the data position, the
// data RNG and the loader's epoch, index and shuffle block) to a second safetensors file. Both are
// written atomically by the safetensors writer (temporary file, fsync, rename), weights first, so
// a crash at any moment leaves the previous complete pair loadable. Covered by tests/test_checkpoint.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "vlmoe.h"

#define STATE_VERSION "1"

int vlmoe_trainer_save(const vlmoe_trainer *tc, const char *weights_path, const char *state_path,
                       const vlmoe_data_state *data) {
    vlmoe_trainer *t = (vlmoe_trainer *)tc; // the optimizer's buffers are only read
    vlmoe_model *m = vlmoe_trainer_model(t);
    vlmoe_optim *o = vlmoe_trainer_optim(t);
    int st = vlmoe_model_check_finite(m, 0);
    if (st) return vlmoe_error_prefix("refusing to write %s", weights_path), st;
    const int ns = vlmoe_optim_state_count(o);
    for (int i = 0; i < ns; i++) {
        const char *name;
        float *d;
        size_t n;
        vlmoe_optim_state_get(o, i, &name, &d, &n);
        for (size_t k = 0; k < n; k++)
            if (!isfinite(d[k]))
                return vlmoe_fail(VLMOE_ERR_NUMERIC, "refusing to write %s: optimizer state '%s' holds %g",
                                  state_path, name, (double)d[k]);
    }
    if ((st = vlmoe_model_save(m, weights_path))) return st;
    vlmoe_st_writer *w;
    if ((st = vlmoe_st_writer_init(&w))) return st;
    const int64_t one[1] = {1}, four[1] = {4};
    const int64_t step = vlmoe_optim_get_step(o);
    const int64_t two[1] = {2};
    uint64_t model_rng[2];
    vlmoe_model_get_rng(m, model_rng);
    const uint64_t pos = data ? data->data_position : 0;
    uint64_t rng[4] = {0, 0, 0, 0};
    int64_t loader[4] = {0, 0, 0, 0};
    if (data) {
        memcpy(rng, data->data_rng, sizeof(rng));
        loader[0] = data->data_epoch, loader[1] = data->data_index;
        loader[2] = data->data_block[0], loader[3] = data->data_block[1];
    }
    char kind[8];
    snprintf(kind, sizeof(kind), "%d", (int)vlmoe_trainer_params(t)->optim.kind);
    st = vlmoe_st_writer_meta(w, "vlmoe.state_version", STATE_VERSION);
    if (!st) st = vlmoe_st_writer_meta(w, "optimizer", kind);
    if (!st) st = vlmoe_st_writer_add_raw(w, "trainer.step", VLMOE_DT_I64, 1, one, &step);
    if (!st) st = vlmoe_st_writer_add_raw(w, "model.rng", VLMOE_DT_U64, 1, two, model_rng);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.position", VLMOE_DT_U64, 1, one, &pos);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.rng", VLMOE_DT_U64, 1, four, rng);
    if (!st) st = vlmoe_st_writer_add_raw(w, "data.loader", VLMOE_DT_I64, 1, four, loader);
    for (int i = 0; i < ns && !st; i++) {
        const char *name;
        float *d;
        size_t n;
        vlmoe_optim_state_get(o, i, &name, &d, &n);
        const int64_t shape[1] = {(int64_t)n};
        char key[160];
        snprintf(key, sizeof(key), "optim.%s", name);
        st = vlmoe_st_writer_add_f32(w, key, VLMOE_DT_F32, 1, shape, d);
    }
    if (!st) st = vlmoe_st_writer_write(w, state_path);
    vlmoe_st_writer_free(w);
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

int vlmoe_trainer_load(vlmoe_trainer *t, const char *weights_path, const char *state_path,
                       vlmoe_data_state *data) {
    vlmoe_model *m = vlmoe_trainer_model(t);
    vlmoe_optim *o = vlmoe_trainer_optim(t);
    vlmoe_st *f;
    int st = vlmoe_st_open(state_path, &f);
    if (st) return st;
    const char *ver = vlmoe_st_metadata(f, "vlmoe.state_version"), *kind = vlmoe_st_metadata(f, "optimizer");
    int64_t step = 0;
    uint64_t model_rng[2] = {0, 0};
    vlmoe_data_state ds;
    memset(&ds, 0, sizeof(ds));
    if (!ver || strcmp(ver, STATE_VERSION))
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not a vlmoe training state (version %s)", state_path, ver ? ver : "missing");
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
    // read every optimizer buffer into scratch first: nothing changes unless all are valid
    const int ns = vlmoe_optim_state_count(o);
    size_t total = 0;
    for (int i = 0; i < ns; i++) {
        size_t n;
        vlmoe_optim_state_get(o, i, NULL, NULL, &n);
        total += n;
    }
    float *tmp = st ? NULL : vlmoe_alloc(sizeof(float) * (total + 1), "optimizer state");
    if (!st && !tmp) st = VLMOE_ERR_NOMEM;
    for (int i = 0, off = 0; i < ns && !st; i++) {
        const char *name;
        size_t n;
        vlmoe_optim_state_get(o, i, &name, NULL, &n);
        char key[160];
        snprintf(key, sizeof(key), "optim.%s", name);
        st = vlmoe_st_read_f32(f, key, tmp + off, n);
        for (size_t k = 0; !st && k < n; k++)
            if (!isfinite(tmp[off + k])) st = vlmoe_fail(VLMOE_ERR_NUMERIC, "%s: '%s' is not finite", state_path, key);
        off += (int)n;
    }
    vlmoe_st_close(f);
    if (!st) st = model_load_into(m, weights_path); // validates before it changes the model
    if (!st) {
        for (int i = 0, off = 0; i < ns; i++) {
            float *d;
            size_t n;
            vlmoe_optim_state_get(o, i, NULL, &d, &n);
            memcpy(d, tmp + off, sizeof(float) * n);
            off += (int)n;
        }
        vlmoe_optim_set_step(o, (long)step);
        vlmoe_model_set_rng(m, model_rng);
        if (data) *data = ds;
    }
    vlmoe_free_mem(tmp);
    return st;
}
