// device.c: where a model runs (the --device flag): "cpu", the default, or "cuda[:N]". A CUDA
// build opens the device's backend table (src/cuda/) and a build without CUDA=1 says how to make
// one (src/cuda/cuda_stub.c). On a table without host memory the parameters keep their master
// copy on the host (optimizer, checkpoints) and the graphs read a device copy uploaded before each
// forward; gradients come back by download. Both architectures: the towers and VL-MoE (arch
// mome). The trainer's one-process AdamW steps make the towers' device copies the masters
// instead (model_go_resident; docs/GPU.md "AdamW on the device"; tests/test_devopt.c). Covered by tests/test_model.c (a CPU table with its own memory that checks every pointer
// an op is handed) and tests/test_cli.c. --precision bf16 picks the CPU's bf16 table
// (src/ops/backend_cpu.c) where the CPU has bf16 instructions (tests/test_bf16.c), and on a CUDA
// device that table's bf16 twin (src/cuda/bf16_cuda.cu; tests/test_backend_ops.c on a GPU).
// --precision int8 (inference) quantizes the model's MLP and expert weights once and runs them on
// a cpu-int8 table of the model's own where the CPU has VNNI or AVX2, the attention's linears in bf16
// where the CPU has bf16 (int8-attn: in int8 too); tests/test_int8.c.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "ops/backend.h"
#include "ops/gemm_bf16.h"
#include "ops/gemm_int8.h"

int model_set_device(vlmoe_model *m, const char *name) {
    const vlmoe_backend_f32 *be = NULL;
    vlmoe_backend_f32 *owned = NULL;
    int st = backend_by_name(&be, &owned, name);
    if (st) return vlmoe_error_prefix("--device"), st;
    if (be == m->be) return VLMOE_OK;
    if ((st = model_set_backend(m, be, owned))) return vlmoe_error_prefix("--device %s", name), st;
    return VLMOE_OK;
}

// --precision int8: the int8 copies of the weights and the table that reads them.
struct model_int8 {
    vlmoe_backend_f32 table;
    int8_weights w;
};

static void int8_free(struct model_int8 *q) {
    if (!q) return;
    int8_weights_free(&q->w);
    free(q);
}

static int ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

// Quantizes what the expert banks read (be_experts): the dense MLPs' and every MoE layer's fc1
// and fc2 weights (tokens- and experts-choice, one router or one per modality, and Soft MoE,
// whose experts the table runs through soft_moe_forward_with). The attention's linears (a third of a block's products: the
// MLP's hidden width is 4x) run in bf16 where the CPU has it, or with attn8 (int8-attn) in int8:
// the attention logits multiply the errors of two products, so that is the user's choice, with
// its accuracy measured in docs/SPEED.md. The stems and heads stay fp32.
static int int8_build(const vlmoe_model *m, int attn8, struct model_int8 **out) {
    static const char *const banks[] = {"mlp.fc1.weight", "mlp.fc2.weight", "moe.experts.fc1.weight",
                                        "moe.experts.fc2.weight", "attn.qkv.weight", "attn.out.weight"};
    const int attn_kind = attn8 ? INT8_Q8 : gemm_bf16_native() ? INT8_BF16 : -1;
    struct model_int8 *q = calloc(1, sizeof(*q));
    if (!q) return vlmoe_fail(VLMOE_ERR_NOMEM, "--precision int8: the int8 weights");
    const model_layout *L = &m->L;
    for (int i = 0; i < L->nparams; i++) {
        const vlmoe_param_info *p = &L->table[i];
        int bank = -1;
        for (int k = 0; k < 6 && bank < 0; k++) bank = ends_with(p->name, banks[k]) ? k : -1;
        if (bank < 0 || p->ndim < 2 || (bank >= 4 && attn_kind < 0)) continue;
        // one matrix of O rows per expert (or the one matrix)
        const int K = (int)p->shape[p->ndim - 1], O = (int)p->shape[p->ndim - 2];
        const int st = int8_weights_add(&q->w, m->params + p->offset, p->numel / (size_t)K, K, O,
                                        bank >= 4 ? attn_kind : INT8_Q8);
        if (st) return int8_free(q), vlmoe_error_prefix("--precision int8: %s", p->name), st;
    }
    backend_cpu_int8(&q->table, &q->w);
    *out = q;
    return VLMOE_OK;
}

int model_int8_covers(const vlmoe_model *m, const float *w) {
    size_t row;
    return m->int8 && int8_weights_find(&m->int8->w, w, &row) != NULL;
}

int model_set_precision(vlmoe_model *m, const char *name, int *fell_back) {
    *fell_back = 0;
    const vlmoe_backend_f32 *cpu = backend_cpu_f32(), *bf16 = backend_cpu_bf16();
    const int want16 = name && !strcmp(name, "bf16"), attn8 = name && !strcmp(name, "int8-attn");
    const int int8 = attn8 || (name && !strcmp(name, "int8"));
    if (name && !want16 && !int8 && strcmp(name, "fp32"))
        return vlmoe_fail(VLMOE_ERR_ARG, "--precision '%s': expected fp32, bf16 or int8 (int8-attn: the attention's "
                          "linears in int8 too)", name);
    // on a CUDA device (the model owns its table): the table's bf16 twin, or back to the table
    if (m->owned_be) {
        if (int8)
            return vlmoe_fail(VLMOE_ERR_ARG, "--precision %s: the %s backend has no int8 products; use "
                              "--precision fp32 or bf16 there", name, m->owned_be->name);
        const vlmoe_backend_f32 *to = m->owned_be;
        int st = want16 ? backend_cuda_bf16(&to, m->owned_be) : VLMOE_OK;
        if (st) return st;
        return to == m->be ? VLMOE_OK : model_set_backend(m, to, m->owned_be);
    }
    const int on_cpu = m->be == cpu || m->be == bf16 || m->int8;
    if (!want16 && !int8) return m->be != cpu && on_cpu ? model_set_backend(m, cpu, NULL) : VLMOE_OK;
    if (!on_cpu)
        return vlmoe_fail(VLMOE_ERR_ARG, "--precision %s: the %s backend computes in fp32 only; use "
                          "--precision fp32 there", name, m->be->name);
    if (want16) {
        if (!gemm_bf16_native()) {
            *fell_back = 1;
            return m->be == cpu ? VLMOE_OK : model_set_backend(m, cpu, NULL);
        }
        return m->be == bf16 ? VLMOE_OK : model_set_backend(m, bf16, NULL);
    }
    if (!gemm_int8_native()) {
        *fell_back = 1;
        return m->be == cpu ? VLMOE_OK : model_set_backend(m, cpu, NULL);
    }
    // quantized again each time: the weights may have changed since the last call
    struct model_int8 *q = NULL, *old = m->int8;
    int st = int8_build(m, attn8, &q);
    if (st) return st;
    m->int8 = q;
    if ((st = model_set_backend(m, &q->table, NULL))) {
        m->int8 = old;
        return int8_free(q), st;
    }
    int8_free(old);
    return VLMOE_OK;
}

// The step's scalars and aux_cap slots for the auxiliary losses' values after them, on the
// device and their host copy; on a failure none (the step then downloads each value).
static void scalars_plan(vlmoe_model *m, int aux_cap) {
    const vlmoe_backend_f32 *be = m->be;
    if (m->d_scalars) be->free(be, m->d_scalars);
    vlmoe_free_mem(m->h_scalars);
    const size_t n = (size_t)MODEL_SCALARS + (size_t)aux_cap;
    m->d_scalars = be->alloc(be, sizeof(double) * n, "the step's scalars on the device");
    m->h_scalars = vlmoe_calloc(sizeof(double) * n, "the step's scalars");
    m->aux_cap = aux_cap;
    if (!m->d_scalars || !m->h_scalars) {
        if (m->d_scalars) be->free(be, m->d_scalars);
        vlmoe_free_mem(m->h_scalars);
        m->d_scalars = m->h_scalars = NULL, m->aux_cap = 0;
    }
}

static void drop_device(vlmoe_model *m) {
    model_leave_resident(m); // the host's copy is all that stays
    if (m->d_params) m->be->free(m->be, m->d_params);
    if (m->d_grads) m->be->free(m->be, m->d_grads);
    if (m->d_scalars) m->be->free(m->be, m->d_scalars);
    vlmoe_free_mem(m->h_scalars);
    m->d_params = m->d_grads = NULL, m->d_scalars = m->h_scalars = NULL, m->aux_cap = 0;
    m->defer = m->deferred = 0;
}

int model_set_backend(vlmoe_model *m, const vlmoe_backend_f32 *be, vlmoe_backend_f32 *owned) {
    // the graphs were planned on the old table: plan again on the new one at the next forward
    m->L.arch->drop_graphs(m);
    m->planned_B = 0, m->have_forward = 0;
    drop_device(m);
    vlmoe_backend_f32 *old = m->owned_be;
    m->be = be, m->owned_be = owned;
    if (old != owned) backend_cuda_free(old); // kept when be is old's bf16 twin (or old itself)
    if (m->int8 && be != &m->int8->table) int8_free(m->int8), m->int8 = NULL;
    if (!be->host_memory) {
        const size_t bytes = sizeof(float) * m->L.total;
        m->d_params = be->alloc(be, bytes, "parameters on the device");
        m->d_grads = be->alloc(be, bytes, "gradients on the device");
        // a table without the step-scalar ops downloads each scalar as its op returns it
        if (be->supports(be, BE_OP_STEP_SCALARS, NULL)) scalars_plan(m, MODEL_AUX_SLOTS);
        if (!m->d_params || !m->d_grads || (be->supports(be, BE_OP_STEP_SCALARS, NULL) && !m->d_scalars)) {
            drop_device(m);
            m->be = backend_cpu_f32(), m->owned_be = NULL;
            backend_cuda_free(owned);
            return vlmoe_fail(VLMOE_ERR_NOMEM, "%zu bytes of parameters and gradients on %s", 2 * bytes, be->name);
        }
    }
    return VLMOE_OK;
}

void model_release_backend(vlmoe_model *m) {
    drop_device(m);
    backend_cuda_free(m->owned_be);
    m->owned_be = NULL;
    int8_free(m->int8);
    m->int8 = NULL;
}

const float *model_params_for_graph(vlmoe_model *m) {
    if (!m->d_params) return m->params;
    if (!m->resident || m->dev_stale) m->be->upload(m->be, m->d_params, m->params, m->L.total);
    m->dev_stale = 0;
    return m->d_params;
}

int model_go_resident(vlmoe_model *m) {
    if (m->resident) return 1;
    // the deferred step's scalars carry the clipping norm and the non-finite flag: without them
    // the gradient would come down anyway
    if (!m->d_params || !m->d_scalars || m->L.arch != &model_arch_towers) return 0;
    m->resident = 1, m->dev_stale = 1, m->host_stale = 0, m->grads_stale = 0;
    return 1;
}

// The mirrors are a cache of the device's copy: bringing them up to date changes no value the
// model holds, so a const reader may.
void model_sync_host(const vlmoe_model *m) {
    vlmoe_model *w = (vlmoe_model *)m;
    if (!m->resident || (!m->host_stale && !m->grads_stale)) return;
    if (m->host_stale) m->be->download(m->be, w->params, m->d_params, m->L.total);
    if (m->grads_stale) m->be->download(m->be, w->grads, m->d_grads, m->L.total);
    m->be->sync(m->be);
    w->host_stale = w->grads_stale = 0;
}

void model_host_written(vlmoe_model *m) {
    if (!m->resident) return;
    model_sync_host(m); // a partial write keeps the rest: the mirror must be current first
    m->dev_stale = 1;
}

void model_params_changed(vlmoe_model *m) {
    if (m->resident) m->host_stale = 1;
    model_weights_changed(m); // whatever was made from the old weights is stale too
}

void model_leave_resident(vlmoe_model *m) {
    if (!m->resident) return;
    model_sync_host(m);
    m->resident = m->dev_stale = 0;
}

int model_set_pixels(vlmoe_model *m, const uint8_t *pix, int hwc, const float mean[3], const float std[3]) {
    m->pix = NULL;
    if (!pix) return VLMOE_OK;
    const vlmoe_model_config *c = &m->L.cfg;
    if (m->L.arch != &model_arch_towers)
        return vlmoe_fail(VLMOE_ERR_ARG, "images as bytes: model '%s' (arch %s) takes float images", c->name,
                          m->L.arch->name);
    if (c->channels < 1 || c->channels > 3)
        return vlmoe_fail(VLMOE_ERR_ARG, "images as bytes: model '%s' has %d channels (1 to 3 have a mean and std)",
                          c->name, c->channels);
    be_pixels p = {.C = c->channels, .H = c->image_size, .W = c->image_size, .hwc = hwc != 0};
    for (int k = 0; k < c->channels; k++) {
        if (!isfinite(mean[k]) || !isfinite(std[k]) || !(std[k] > 0))
            return vlmoe_fail(VLMOE_ERR_ARG, "images as bytes: mean[%d] = %g, std[%d] = %g (need finite values "
                              "and std > 0)", k, (double)mean[k], k, (double)std[k]);
        p.mean[k] = mean[k], p.std[k] = std[k];
    }
    m->pix = pix, m->pixp = p;
    return VLMOE_OK;
}

void model_defer_scalars(vlmoe_model *m) {
    // room for the auxiliary values the last step wanted (between steps: nothing is in flight)
    int need = 0;
    if (m->d_scalars && m->g) graph_aux_slots_f32(m->g, &need);
    if (need > m->aux_cap) scalars_plan(m, need);
    m->defer = m->d_scalars != NULL;
}

int model_take_scalars(vlmoe_model *m, vlmoe_step_stats *s, double *sumsq, int *nonfinite) {
    m->defer = 0;
    if (!m->deferred) return 0;
    m->deferred = 0;
    // the step's one small download: through the float entry, the doubles' bytes as they are,
    // with the auxiliary losses' values behind them
    double *v = m->h_scalars;
    const size_t n = (size_t)MODEL_SCALARS + (size_t)graph_aux_slots_f32(m->g, NULL);
    m->be->download(m->be, (float *)v, (const float *)m->d_scalars, 2 * n);
    // the forward's aux was 0 (+0.0: every value went to the slots), so this adds as it did
    const double aux = m->aux_deferred + graph_take_aux_f32(m->g, v + MODEL_SCALARS);
    m->aux_deferred = aux;
    s->loss = v[0] + aux; // the forward's own expressions (towers_model.c, graph.c)
    s->contrastive = s->loss - aux;
    s->aux = aux;
    s->acc_i2t = v[1], s->acc_t2i = v[2];
    s->temperature = exp((float)v[3]); // the forward's expression on the scale it read
    *sumsq = v[4];
    *nonfinite = v[5] != 0.0;
    return 1;
}

const vlmoe_backend_f32 *model_host_backend(const vlmoe_model *m) {
    return m->be->host_memory ? m->be : backend_cpu_f32();
}
