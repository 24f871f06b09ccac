// optim.c: AdamW (Loshchilov & Hutter 2019, Alg. 2, in torch.optim.AdamW's exact arithmetic),
// Adafactor (Shazeer & Stern 2018, Alg. 4 factored / Alg. 5 update clipping, as optax/big_vision
// use it for LIMoE) and global-norm gradient clipping, all over the one flat parameter buffer.
// Covered by tests/test_optim.c (hand-worked steps, PyTorch AdamW parity fixture).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/backend.h"
#include "optim/optim.h"

// Loops over at least this many elements run on OpenMP threads; below it the fork costs more
// than the work. Every loop is elementwise or owns its outputs, so results never depend on it.
#define PAR_MIN 32768

// Reductions (clip norm, Adafactor update RMS) sum a fixed number of equal chunks in parallel
// and then the chunk sums in order: the result is the same for any thread count.
#define NCHUNK 64

typedef struct {
    char name[128];  // "adamw.m", "adafactor.vr.<param>", ...
    float *data;     // into vlmoe_optim.pool
    size_t n;
    int flat;        // 1: laid out like the flat parameter vector (n = total), else one parameter's
    int ndim;        // the natural shape of a per-parameter buffer (see vlmoe_optim_state_layout)
    int64_t shape[4];
} optim_state;

// Adafactor's view of one parameter: factored over its last two dims (rows, cols) with the
// leading dims batched (lead), or a plain second moment v.
typedef struct {
    int factored;
    size_t lead, rows, cols;
    float *vr;   // (lead, rows): EMA of mean over cols of g^2 + eps1
    float *vc;   // (lead, cols): EMA of mean over rows of g^2 + eps1
    float *v;    // (numel): unfactored EMA of g^2 + eps1
    float *m;    // (numel): momentum of the clipped update, only when beta1 > 0
} adafactor_slot;

struct vlmoe_optim {
    vlmoe_optim_params p;
    vlmoe_param_info *table;  // copy of the caller's table
    int nparams;
    size_t total;
    long step;                // updates done so far
    float *pool;              // every state float, one zeroed allocation
    optim_state *states;
    int nstates;
    adafactor_slot *slots;    // Adafactor only, one per parameter
    float *row_mean;          // Adafactor scratch: mean(vr) per leading index, max lead floats
    const vlmoe_backend_f32 *be; // runs the update (the model's backend table)
};

vlmoe_optim_params vlmoe_optim_default_params(vlmoe_opt_kind kind) {
    vlmoe_optim_params p;
    memset(&p, 0, sizeof p);
    p.kind = kind;
    p.beta1 = 0.9f;
    p.beta2 = 0.999f;
    p.eps = 1e-8f;
    p.weight_decay = 0.0f;
    p.decay_rate = 0.8f;
    p.clip_threshold = 1.0f;
    p.min_dim_to_factor = 128;
    if (kind == VLMOE_OPT_ADAFACTOR) {
        p.beta1 = 0.0f;   // big_vision's LIMoE config runs Adafactor without momentum
        p.eps = 1e-30f;   // optax/big_vision eps1, added to squared gradients
    }
    return p;
}

static int check_params(const vlmoe_optim_params *p) {
    if (p->kind != VLMOE_OPT_ADAMW && p->kind != VLMOE_OPT_ADAFACTOR)
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: kind = %d is not VLMOE_OPT_ADAMW (0) or "
                          "VLMOE_OPT_ADAFACTOR (1)", (int)p->kind);
    // Written as !(in range) so NaN fails too.
    if (!(p->beta1 >= 0.0f && p->beta1 < 1.0f))
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: beta1 = %g must be in [0, 1)", (double)p->beta1);
    if (p->kind == VLMOE_OPT_ADAMW && !(p->beta2 >= 0.0f && p->beta2 < 1.0f))
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: beta2 = %g must be in [0, 1)", (double)p->beta2);
    if (!(p->eps > 0.0f && isfinite(p->eps)))
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: eps = %g must be finite and > 0", (double)p->eps);
    if (!(p->weight_decay >= 0.0f && isfinite(p->weight_decay)))
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: weight_decay = %g must be finite and >= 0",
                          (double)p->weight_decay);
    if (p->kind == VLMOE_OPT_ADAFACTOR) {
        if (!(p->decay_rate >= 0.0f && isfinite(p->decay_rate)))
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: decay_rate = %g must be finite and >= 0",
                              (double)p->decay_rate);
        if (!(p->clip_threshold >= 0.0f && isfinite(p->clip_threshold)))
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: clip_threshold = %g must be finite and >= 0 "
                              "(0 = off)", (double)p->clip_threshold);
        if (p->min_dim_to_factor < 1)
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: min_dim_to_factor = %d must be >= 1",
                              p->min_dim_to_factor);
    }
    return VLMOE_OK;
}

static int check_table(const vlmoe_param_info *table, int nparams, size_t total) {
    for (int i = 0; i < nparams; i++) {
        const vlmoe_param_info *t = &table[i];
        size_t len = strnlen(t->name, sizeof t->name);
        if (len == 0 || len == sizeof t->name)
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d: name must be non-empty and "
                              "NUL-terminated within %zu bytes", i, sizeof t->name);
        if (t->ndim < 0 || t->ndim > 4)
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d (%s): ndim = %d must be in [0, 4]",
                              i, t->name, t->ndim);
        size_t prod = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0)
                return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d (%s): shape[%d] = %lld must "
                                  "be >= 0", i, t->name, d, (long long)t->shape[d]);
            if (vlmoe_mul_ok(prod, (size_t)t->shape[d], &prod))
                return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d (%s): shape overflows size_t",
                                  i, t->name);
        }
        if (prod != t->numel)
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d (%s): numel = %zu but the shape "
                              "holds %zu elements", i, t->name, t->numel, prod);
        size_t end;
        if (vlmoe_add_ok(t->offset, t->numel, &end) || end > total)
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d (%s): offset %zu + numel %zu "
                              "exceeds total %zu", i, t->name, t->offset, t->numel, total);
        // Quadratic, but tables hold hundreds of entries and this runs once. Overlap would make
        // an element take two updates per step; duplicate names would clash in Adafactor state.
        for (int j = 0; j < i; j++) {
            const vlmoe_param_info *u = &table[j];
            if (strcmp(u->name, t->name) == 0)
                return vlmoe_fail(VLMOE_ERR_ARG, "optim: params %d and %d share the name %s",
                                  j, i, t->name);
            if (t->numel && u->numel && t->offset < u->offset + u->numel &&
                u->offset < t->offset + t->numel)
                return vlmoe_fail(VLMOE_ERR_ARG, "optim: param %d (%s) [%zu, %zu) overlaps "
                                  "param %d (%s) [%zu, %zu)", i, t->name, t->offset, end, j,
                                  u->name, u->offset, u->offset + u->numel);
        }
    }
    return VLMOE_OK;
}

typedef struct { const char *kind; float **dst; size_t n; int ndim; int64_t shape[4]; } state_part;

// Fills o->slots and the state list for Adafactor; `pool` NULL only counts floats into *nfloats.
static int adafactor_layout(vlmoe_optim *o, float *pool, size_t *nfloats) {
    size_t used = 0;
    int ns = 0;
    const int factor_min = o->p.min_dim_to_factor;
    for (int i = 0; i < o->nparams; i++) {
        const vlmoe_param_info *t = &o->table[i];
        adafactor_slot s;
        memset(&s, 0, sizeof s);
        if (t->ndim >= 2 && t->shape[t->ndim - 2] >= factor_min &&
            t->shape[t->ndim - 1] >= factor_min) {
            s.factored = 1;
            s.rows = (size_t)t->shape[t->ndim - 2];
            s.cols = (size_t)t->shape[t->ndim - 1];
            s.lead = t->numel / (s.rows * s.cols);   // rows, cols >= 1 here
        }
        // Sizes are bounded by numel, which fit in `total`, so these sums cannot overflow
        // before the final check on the whole pool below.
        // Shapes for checkpoints: v and m are shaped like the parameter; vr drops its last dim
        // (lead..., rows) and vc its second-to-last (lead..., cols), as they average over them.
        state_part parts[3], whole = {"v", &s.v, t->numel, t->ndim, {0}};
        memcpy(whole.shape, t->shape, sizeof whole.shape);
        int np = 0;
        if (s.factored) {
            parts[np] = (state_part){"vr", &s.vr, s.lead * s.rows, t->ndim - 1, {0}};
            memcpy(parts[np++].shape, t->shape, sizeof(int64_t) * (size_t)(t->ndim - 1));
            parts[np] = (state_part){"vc", &s.vc, s.lead * s.cols, t->ndim - 1, {0}};
            memcpy(parts[np].shape, t->shape, sizeof(int64_t) * (size_t)(t->ndim - 2));
            parts[np++].shape[t->ndim - 2] = t->shape[t->ndim - 1];
        } else {
            parts[np++] = whole;
        }
        if (o->p.beta1 > 0.0f) {
            parts[np] = whole;
            parts[np].kind = "m";
            parts[np++].dst = &s.m;
        }
        for (int k = 0; k < np; k++) {
            if (vlmoe_add_ok(used, parts[k].n, &used))
                return vlmoe_fail(VLMOE_ERR_ARG, "optim: Adafactor state size overflows size_t");
            if (pool) {
                *parts[k].dst = pool + (used - parts[k].n);
                optim_state *st = &o->states[ns];
                snprintf(st->name, sizeof st->name, "adafactor.%s.%s", parts[k].kind, t->name);
                st->data = *parts[k].dst;
                st->n = parts[k].n;
                st->ndim = parts[k].ndim;
                memcpy(st->shape, parts[k].shape, sizeof st->shape);
            }
            ns++;
        }
        if (pool) o->slots[i] = s;
    }
    *nfloats = used;
    o->nstates = ns;
    return VLMOE_OK;
}

int vlmoe_optim_init(vlmoe_optim **out, const vlmoe_optim_params *p,
                     const vlmoe_param_info *table, int nparams, size_t total) {
    return optim_init_backend(out, p, table, nparams, total, backend_cpu_f32());
}

int optim_init_backend(vlmoe_optim **out, const vlmoe_optim_params *p, const vlmoe_param_info *table, int nparams,
                       size_t total, const vlmoe_backend_f32 *be) {
    if (!out) return vlmoe_fail(VLMOE_ERR_ARG, "optim: out is NULL");
    *out = NULL;
    // the state lives in host memory and is written to checkpoints from there; a device table
    // runs the update once the state moves to the device with it (the CUDA backend's issue)
    if (!be || !be->host_memory)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "optim: the optimizer state cannot live on backend %s yet (host memory "
                          "only)", be ? be->name : "(none)");
    int rq = p && p->kind == VLMOE_OPT_ADAMW ? backend_require_f32(be, BE_OP_ADAMW, NULL) : VLMOE_OK;
    if (!rq) rq = backend_require_f32(be, BE_OP_SUMSQ, NULL);
    if (!rq) rq = backend_require_f32(be, BE_OP_SCALE, NULL);
    if (rq) return vlmoe_error_prefix("optim"), rq;
    if (!p) return vlmoe_fail(VLMOE_ERR_ARG, "optim: params is NULL");
    if (nparams < 1 || !table)
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: the parameter table must hold at least one "
                          "entry (nparams = %d, table %s)", nparams, table ? "set" : "NULL");
    int st = check_params(p);
    if (st) return st;
    if ((st = check_table(table, nparams, total))) return st;

    vlmoe_optim *o = vlmoe_calloc(sizeof *o, "optimizer");
    if (!o) return VLMOE_ERR_NOMEM;
    o->p = *p;
    o->be = be;
    o->nparams = nparams;
    o->total = total;
    o->table = vlmoe_alloc((size_t)nparams * sizeof *table, "optimizer parameter table");
    if (!o->table) goto nomem;
    memcpy(o->table, table, (size_t)nparams * sizeof *table);

    size_t nfloats = 0, bytes;
    if (p->kind == VLMOE_OPT_ADAMW) {
        o->nstates = 2;
        if (vlmoe_mul_ok(total, 2, &nfloats))
            st = vlmoe_fail(VLMOE_ERR_ARG, "optim: AdamW state size overflows size_t");
    } else {
        st = adafactor_layout(o, NULL, &nfloats);
    }
    if (st) goto fail;
    if (vlmoe_mul_ok(nfloats, sizeof(float), &bytes)) {
        st = vlmoe_fail(VLMOE_ERR_ARG, "optim: state of %zu floats overflows size_t", nfloats);
        goto fail;
    }
    // calloc, not vlmoe_calloc's memset: a large pool comes as zero pages the kernel maps only when
    // written, so with expert parallelism the moments of experts this process never updates
    // cost no memory (docs/DISTRIBUTED.md, "Sharded experts")
    o->pool = calloc(1, bytes ? bytes : 1);
    if (!o->pool) vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu bytes for optimizer state", bytes);
    o->states = vlmoe_calloc((size_t)o->nstates * sizeof *o->states, "optimizer state list");
    if (!o->pool || !o->states) goto nomem;
    if (p->kind == VLMOE_OPT_ADAMW) {
        snprintf(o->states[0].name, sizeof o->states[0].name, "adamw.m");
        snprintf(o->states[1].name, sizeof o->states[1].name, "adamw.v");
        o->states[0].data = o->pool;
        o->states[1].data = o->pool + total;
        for (int k = 0; k < 2; k++) {
            o->states[k].n = total;
            o->states[k].flat = 1;
            o->states[k].ndim = 1;
            o->states[k].shape[0] = (int64_t)total;
        }
    } else {
        size_t max_lead = 1;
        o->slots = vlmoe_calloc((size_t)nparams * sizeof *o->slots, "Adafactor slots");
        if (!o->slots) goto nomem;
        adafactor_layout(o, o->pool, &nfloats);
        for (int i = 0; i < nparams; i++)
            if (o->slots[i].factored && o->slots[i].lead > max_lead) max_lead = o->slots[i].lead;
        o->row_mean = vlmoe_alloc(max_lead * sizeof(float), "Adafactor row means");
        if (!o->row_mean) goto nomem;
    }
    *out = o;
    return VLMOE_OK;
nomem:
    st = VLMOE_ERR_NOMEM;   // vlmoe_alloc already wrote the message
fail:
    vlmoe_optim_free(o);
    return st;
}

void vlmoe_optim_free(vlmoe_optim *o) {
    if (!o) return;
    vlmoe_free_mem(o->table);
    vlmoe_free_mem(o->pool);
    vlmoe_free_mem(o->states);
    vlmoe_free_mem(o->slots);
    vlmoe_free_mem(o->row_mean);
    vlmoe_free_mem(o);
}

const vlmoe_param_info *optim_table(const vlmoe_optim *o, int *n) {
    *n = o->nparams;
    return o->table;
}

int optim_set_table(vlmoe_optim *o, const vlmoe_param_info *table, int n) {
    if (o->p.kind != VLMOE_OPT_ADAMW)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "optim: only AdamW's table can change after init (Adafactor's state is "
                          "shaped by its tensors)");
    if (n < 1 || !table) return vlmoe_fail(VLMOE_ERR_ARG, "optim: a new table needs at least one entry");
    int st = check_table(table, n, o->total);
    if (st) return st;
    vlmoe_param_info *t = vlmoe_alloc((size_t)n * sizeof *table, "optimizer parameter table");
    if (!t) return VLMOE_ERR_NOMEM;
    memcpy(t, table, (size_t)n * sizeof *table);
    vlmoe_free_mem(o->table);
    o->table = t, o->nparams = n;
    return VLMOE_OK;
}

long vlmoe_optim_get_step(const vlmoe_optim *o) { return o ? o->step : 0; }

void vlmoe_optim_set_step(vlmoe_optim *o, long step) {
    if (o) o->step = step < 0 ? 0 : step;
}

int vlmoe_optim_state_count(const vlmoe_optim *o) { return o ? o->nstates : 0; }

int vlmoe_optim_state_get(vlmoe_optim *o, int i, const char **name, float **data, size_t *n) {
    if (!o) return vlmoe_fail(VLMOE_ERR_ARG, "optim: state_get on a NULL optimizer");
    if (i < 0 || i >= o->nstates)
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: state index %d out of range [0, %d)", i,
                          o->nstates);
    if (name) *name = o->states[i].name;
    if (data) *data = o->states[i].data;
    if (n) *n = o->states[i].n;
    return VLMOE_OK;
}

int vlmoe_optim_state_layout(const vlmoe_optim *o, int i, int *flat, int *ndim, int64_t shape[4]) {
    if (!o) return vlmoe_fail(VLMOE_ERR_ARG, "optim: state_layout on a NULL optimizer");
    if (i < 0 || i >= o->nstates)
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: state index %d out of range [0, %d)", i,
                          o->nstates);
    if (flat) *flat = o->states[i].flat;
    if (ndim) *ndim = o->states[i].ndim;
    if (shape) memcpy(shape, o->states[i].shape, sizeof o->states[i].shape);
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// AdamW. The arithmetic follows torch 1.13's _single_tensor_adamw operation by operation, with
// the same float/double split, so the parity fixture matches to the last bit or two:
//   p *= (float)(1 - lr*wd)                       (double scalar, only where decay is set)
//   m  = b1*m + (float)(1-b1) * g
//   v  = b2*v + ((float)(1-b2) * g) * g           (addcmul's order)
//   denom = sqrt(v) / (float)sqrt(1 - b2^t) + eps (bias corrections in double, t = step+1)
//   p += ((float)(-lr / (1 - b1^t)) * m) / denom  (addcdiv's order)
static void adamw_step(vlmoe_optim *o, float *params, const float *grads, float lr) {
    const double t = (double)o->step + 1.0;
    const double b1 = o->p.beta1, b2 = o->p.beta2;
    const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    // the update of each tensor is the backend's adamw op (src/ops/backend_cpu.c), whose
    // element-wise order of operations is the one written above
    be_adamw a = {(float)b1, (float)b2, (float)(1.0 - b1), (float)(1.0 - b2), (float)(-(double)lr / bc1),
                  (float)sqrt(bc2), o->p.eps, (float)(1.0 - (double)lr * (double)o->p.weight_decay), 0};
    const vlmoe_backend_f32 *be = o->be;
    float *m_all = o->states[0].data, *v_all = o->states[1].data;
    for (int k = 0; k < o->nparams; k++) {
        const vlmoe_param_info *info = &o->table[k];
        const size_t off = info->offset;
        // torch multiplies by exactly 1.0 when weight_decay is 0, so skipping is identical.
        a.decay = info->decay && o->p.weight_decay != 0.0f;
        be->adamw(be, params + off, m_all + off, v_all + off, grads + off, info->numel, &a);
    }
}

// ---------------------------------------------------------------------------------------------
// Adafactor (Shazeer & Stern 2018). Per parameter, with t = step+1 and g2 = g*g + eps1:
//   beta2_t = 1 - t^(-decay_rate)                                  (Alg. 4, hat-beta2_t)
//   factored (last two dims both >= min_dim_to_factor, leading dims batched):
//     vr = beta2_t*vr + (1-beta2_t)*mean_cols(g2),  vc = beta2_t*vc + (1-beta2_t)*mean_rows(g2)
//     u  = g / sqrt(outer(vr, vc) / mean(vr))
//   otherwise: v = beta2_t*v + (1-beta2_t)*g2,  u = g / sqrt(v)
//   u /= max(1, rms(u) / clip_threshold)                           (Alg. 5 update clipping)
//   if beta1 > 0: m = beta1*m + (1-beta1)*u, u = m                 (optax ema, no debiasing)
//   u += wd*p where the decay flag is set;  p -= lr*u
// As in big_vision's LIMoE recipe there is no relative step size and no parameter scaling
// (optax's multiply_by_parameter_scale=False): the schedule supplies lr. Unlike optax, which
// factors the two largest dims, we factor the last two: our matrices are (out, in) and expert
// banks (E, out, in), where the two agree. Update clipping needs rms(u) before any element is
// written, so u is computed twice (a sqrt per element) instead of storing a param-sized copy.

// Sum of u^2 over one parameter, as NCHUNK fixed chunks of its rows (factored) or elements.
static double adafactor_sumsq(const adafactor_slot *s, const float *g, const float *row_mean,
                              size_t numel) {
    double part[NCHUNK];
    const size_t units = s->factored ? s->lead * s->rows : numel;
    const size_t per = (units + NCHUNK - 1) / NCHUNK;
#pragma omp parallel for schedule(static) if (numel >= PAR_MIN)
    for (int k = 0; k < NCHUNK; k++) {
        const size_t a = (size_t)k * per < units ? (size_t)k * per : units;
        const size_t b = a + per < units ? a + per : units;
        double acc = 0;
        if (s->factored) {
            for (size_t r = a; r < b; r++) {
                const size_t l = r / s->rows;
                const float *gr = g + r * s->cols, *vc = s->vc + l * s->cols;
                const float vr = s->vr[r] / row_mean[l];
                for (size_t c = 0; c < s->cols; c++) {
                    const float u = gr[c] / sqrtf(vr * vc[c]);
                    acc += (double)u * u;
                }
            }
        } else {
            for (size_t i = a; i < b; i++) {
                const float u = g[i] / sqrtf(s->v[i]);
                acc += (double)u * u;
            }
        }
        part[k] = acc;
    }
    double sum = 0;
    for (int k = 0; k < NCHUNK; k++) sum += part[k];
    return sum;
}

static void adafactor_step(vlmoe_optim *o, float *params, const float *grads, float lr) {
    const double t = (double)o->step + 1.0;
    const double keep = 1.0 - pow(t, -(double)o->p.decay_rate);   // beta2_t
    const float fkeep = (float)keep, fnew = (float)(1.0 - keep);
    const float eps1 = o->p.eps, wd = o->p.weight_decay, b1 = o->p.beta1;
    const float ab1 = (float)(1.0 - (double)b1);
    for (int k = 0; k < o->nparams; k++) {
        const vlmoe_param_info *info = &o->table[k];
        const adafactor_slot *s = &o->slots[k];
        const size_t n = info->numel;
        float *p = params + info->offset;
        const float *g = grads + info->offset;
        if (n == 0) continue;
        if (s->factored) {
            const size_t R = s->rows, C = s->cols, nrows = s->lead * R;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
            for (size_t r = 0; r < nrows; r++) {   // a thread owns whole rows of vr
                const float *gr = g + r * C;
                double acc = 0;
                for (size_t c = 0; c < C; c++) acc += (double)gr[c] * gr[c] + eps1;
                s->vr[r] = fkeep * s->vr[r] + fnew * (float)(acc / (double)C);
            }
            // Columns in blocks of 64 so each row read is contiguous; a thread owns its block.
            const size_t nblk = (C + 63) / 64, ntask = s->lead * nblk;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
            for (size_t task = 0; task < ntask; task++) {
                const size_t l = task / nblk, c0 = (task % nblk) * 64;
                const size_t c1 = c0 + 64 < C ? c0 + 64 : C;
                double acc[64] = {0};
                for (size_t r = 0; r < R; r++) {
                    const float *gr = g + (l * R + r) * C;
                    for (size_t c = c0; c < c1; c++) acc[c - c0] += (double)gr[c] * gr[c] + eps1;
                }
                float *vc = s->vc + l * C;
                for (size_t c = c0; c < c1; c++)
                    vc[c] = fkeep * vc[c] + fnew * (float)(acc[c - c0] / (double)R);
            }
            for (size_t l = 0; l < s->lead; l++) {
                double acc = 0;
                for (size_t r = 0; r < R; r++) acc += s->vr[l * R + r];
                o->row_mean[l] = (float)(acc / (double)R);
            }
        } else {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
            for (size_t i = 0; i < n; i++) s->v[i] = fkeep * s->v[i] + fnew * (g[i] * g[i] + eps1);
        }

        float scale = 1.0f;   // update clipping: 1 / max(1, rms(u) / d)
        if (o->p.clip_threshold > 0.0f) {
            const double rms = sqrt(adafactor_sumsq(s, g, o->row_mean, n) / (double)n);
            const double denom = rms / (double)o->p.clip_threshold;
            if (denom > 1.0) scale = (float)(1.0 / denom);
        }
        const int decay = info->decay && wd != 0.0f;
        const size_t C = s->factored ? s->cols : 1;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
        for (size_t i = 0; i < n; i++) {
            float u;
            if (s->factored) {
                const size_t r = i / C, l = r / s->rows;
                u = g[i] / sqrtf((s->vr[r] / o->row_mean[l]) * s->vc[l * C + i % C]);
            } else {
                u = g[i] / sqrtf(s->v[i]);
            }
            u *= scale;
            if (b1 > 0.0f) u = s->m[i] = b1 * s->m[i] + ab1 * u;
            if (decay) u += wd * p[i];
            p[i] -= lr * u;
        }
    }
}

void vlmoe_optim_step(vlmoe_optim *o, float *params, const float *grads, float lr) {
    if (!o || !params || !grads) return;
    if (o->p.kind == VLMOE_OPT_ADAMW)
        adamw_step(o, params, grads, lr);
    else
        adafactor_step(o, params, grads, lr);
    o->step++;
}

// ---------------------------------------------------------------------------------------------
// Global-norm clipping as torch.nn.utils.clip_grad_norm_: norm = ||g||_2 over every float (in
// double); if norm > max_norm, g *= max_norm / (norm + 1e-6). Returns the norm before clipping.
double vlmoe_clip_grad_norm(float *grads, size_t n, double max_norm) {
    return optim_clip_grad_norm(backend_cpu_f32(), grads, n, max_norm);
}

double optim_clip_grad_norm(const vlmoe_backend_f32 *be, float *grads, size_t n, double max_norm) {
    if (!grads || n == 0) return 0.0;
    // the sum in NCHUNK fixed chunks and the scaling are the backend's ops (src/ops/backend_cpu.c)
    const double norm = sqrt(be->sumsq(be, grads, n, NULL));
    // torch computes this coefficient as a float32 tensor before multiplying.
    if (max_norm > 0.0 && norm > max_norm) be->scale(be, grads, n, (float)(max_norm / (norm + 1e-6)));
    return norm;
}
