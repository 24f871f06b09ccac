// optim.c: AdamW (Loshchilov & Hutter 2019, Alg. 2, in torch.optim.AdamW's exact arithmetic),
// Adafactor (Shazeer & Stern 2018, Alg. 4 factored / Alg. 5 update clipping, with the ViT-G
// modifications of big_vision's scale_by_adafactor that LIMoE trained with: beta2 capped, momentum,
// decay by the schedule) and global-norm gradient clipping, all over the one flat parameter buffer.
// Covered by tests/test_optim.c (hand-worked steps, PyTorch AdamW and big_vision Adafactor parity).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/backend.h"
#include "ops/gemm_bf16.h"
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

// Adafactor's view of one parameter: factored over two of its dims a < b (optax: the two largest),
// the tensor seen as (A, NA, Bm, NB, C) with A, Bm, C the products of the dims before a, between
// a and b and after b; or a plain second moment v. A weight matrix (out, in) is A = Bm = C = 1.
typedef struct {
    int factored;
    int a;       // the first factored dim (a >= 1: dim 0, an expert bank's E, is one of the batched)
    size_t A, NA, Bm, NB, C;
    float *vr;   // (A, NA, Bm, C): EMA of mean over dim b of g^2 + eps1
    float *vc;   // (A, Bm, NB, C): EMA of mean over dim a of g^2 + eps1
    float *v;    // (numel): unfactored EMA of g^2 + eps1
    float *m;    // (numel): momentum of the (clipped) update, only when beta1 > 0
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
    float *row_mean;          // Adafactor scratch: mean of vr over dim a, (A, Bm, C) floats at most
    const vlmoe_backend_f32 *be; // runs the update (the model's backend table)
    uint64_t shadow_ver;      // nonzero: each tensor's bf16 shadows are packed again after its
                              // update, at this version (optim_set_shadow, src/ops/gemm_bf16.h)
    // AdamW's m and v resident on a device table (optim_to_device): pool stays their mirror
    float *d_pool;               // (2 total) on dbe, NULL: the host's pool is the state
    const vlmoe_backend_f32 *dbe;
    int dev_step;                // the update running now reads d_pool through dbe
    int host_stale, dev_stale;   // d_pool newer than pool / pool written since the upload
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
    if (kind == VLMOE_OPT_ADAFACTOR) {
        // big_vision's scale_by_adafactor, "the modifications used for ViT-G" that LIMoE names
        // (its appendix A): momentum 0.9, beta2 capped at 0.999, no update clipping, factoring
        // from dimension 32, eps1 1e-30 added to squared gradients
        p.beta1 = 0.9f;
        p.eps = 1e-30f;
        p.clip_threshold = 0.0f;
        p.min_dim_to_factor = 32;
        p.beta2_cap = 0.999f;
    } else {
        p.clip_threshold = 1.0f;
        p.min_dim_to_factor = 128;
        p.beta2_cap = 1.0f;
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
        if (!(p->beta2_cap > 0.0f && p->beta2_cap <= 1.0f))
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: beta2_cap = %g must be in (0, 1] (1 = no cap)",
                              (double)p->beta2_cap);
        if (p->decay_offset < 0)
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: decay_offset = %d must be >= 0", p->decay_offset);
    }
    if (p->momentum_bf16 && (p->kind != VLMOE_OPT_ADAFACTOR || p->beta1 == 0.0f))
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: momentum_bf16 applies to Adafactor with momentum (beta1 > 0)");
    if (!(p->wd_lr_base >= 0.0f && isfinite(p->wd_lr_base)))
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: wd_lr_base = %g must be finite and >= 0 (0: decay times lr)",
                          (double)p->wd_lr_base);
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

// optax's _factored_dims: the two largest dims (a stable argsort, as numpy's for so few, so of
// equal sizes the later dim counts as larger), factored when the smaller of them is >= min_dim.
static int factored_dims(const vlmoe_param_info *t, int min_dim, int *a, int *b) {
    if (t->ndim < 2) return 0;
    int idx[4];
    for (int d = 0; d < t->ndim; d++) {
        int k = d;
        for (; k > 0 && t->shape[idx[k - 1]] > t->shape[d]; k--) idx[k] = idx[k - 1];
        idx[k] = d;
    }
    const int d1 = idx[t->ndim - 2], d0 = idx[t->ndim - 1];
    if (t->shape[d1] < min_dim) return 0;
    *a = d1 < d0 ? d1 : d0, *b = d1 < d0 ? d0 : d1;
    return 1;
}

static void drop_dim(int64_t out[4], const int64_t *shape, int ndim, int drop) {
    for (int d = 0, k = 0; d < ndim; d++)
        if (d != drop) out[k++] = shape[d];
}

// Fills o->slots and the state list for Adafactor; `pool` NULL only counts floats into *nfloats.
static int adafactor_layout(vlmoe_optim *o, float *pool, size_t *nfloats) {
    size_t used = 0;
    int ns = 0;
    const int factor_min = o->p.min_dim_to_factor;
    for (int i = 0; i < o->nparams; i++) {
        const vlmoe_param_info *t = &o->table[i];
        adafactor_slot s;
        memset(&s, 0, sizeof s);
        int a, b;
        if (factored_dims(t, factor_min, &a, &b)) {
            s.factored = 1;
            s.a = a;
            s.A = s.Bm = s.C = 1;
            for (int d = 0; d < a; d++) s.A *= (size_t)t->shape[d];
            for (int d = a + 1; d < b; d++) s.Bm *= (size_t)t->shape[d];
            for (int d = b + 1; d < t->ndim; d++) s.C *= (size_t)t->shape[d];
            s.NA = (size_t)t->shape[a];
            s.NB = (size_t)t->shape[b];
        }
        // Sizes are bounded by numel, which fit in `total`, so these sums cannot overflow
        // before the final check on the whole pool below.
        // Shapes for checkpoints: v and m are shaped like the parameter; vr drops dim b and vc
        // dim a, the dims they average over ((lead..., rows) and (lead..., cols) for a matrix).
        state_part parts[3], whole = {"v", &s.v, t->numel, t->ndim, {0}};
        memcpy(whole.shape, t->shape, sizeof whole.shape);
        int np = 0;
        if (s.factored) {
            parts[np] = (state_part){"vr", &s.vr, s.A * s.NA * s.Bm * s.C, t->ndim - 1, {0}};
            drop_dim(parts[np++].shape, t->shape, t->ndim, b);
            parts[np] = (state_part){"vc", &s.vc, s.A * s.Bm * s.NB * s.C, t->ndim - 1, {0}};
            drop_dim(parts[np++].shape, t->shape, t->ndim, a);
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
    // the state is made in host memory and written to checkpoints from there; AdamW's moves to a
    // device table afterwards (optim_to_device), the host's pool its mirror
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
    // written (state of frozen or untrained tensors costs no memory)
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
        for (int i = 0; i < nparams; i++) {
            const adafactor_slot *s = &o->slots[i];
            if (s->factored && s->A * s->Bm * s->C > max_lead) max_lead = s->A * s->Bm * s->C;
        }
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
    if (o->d_pool) o->dbe->free(o->dbe, o->d_pool);
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

int optim_expert_states(const vlmoe_optim *o, size_t offset, int E, size_t per, float **bufs, size_t *per_buf) {
    optim_sync_host((vlmoe_optim *)o, 1); // the pool is a mirror while the state is on a device
    if (o->p.kind == VLMOE_OPT_ADAMW) {
        for (int k = 0; k < 2; k++) bufs[k] = o->states[k].data + offset, per_buf[k] = per;
        return 2;
    }
    for (int j = 0; j < o->nparams; j++) {
        const adafactor_slot *s = &o->slots[j];
        if (o->table[j].offset != offset || o->table[j].numel != (size_t)E * per || !o->table[j].numel) continue;
        int n = 0;
        if (s->factored) {
            bufs[n] = s->vr, per_buf[n++] = s->A / (size_t)E * s->NA * s->Bm * s->C;
            bufs[n] = s->vc, per_buf[n++] = s->A / (size_t)E * s->Bm * s->NB * s->C;
        } else {
            bufs[n] = s->v, per_buf[n++] = per;
        }
        if (s->m) bufs[n] = s->m, per_buf[n++] = per;
        return n;
    }
    return 0;
}

int optim_splits(const vlmoe_optim_params *p, const vlmoe_param_info *t) {
    if (p->kind == VLMOE_OPT_ADAMW) return 1;
    int a = 0, b;
    const int factored = factored_dims(t, p->min_dim_to_factor, &a, &b);
    return p->clip_threshold == 0.0f && t->ndim >= 1 && t->shape[0] > 0 && (!factored || a >= 1);
}

// The experts tensor t holds: [*a0, *a1) of its leading dim (all of it unless t is a bank held
// split: vlmoe_param_info.experts_local).
static void held(const vlmoe_param_info *t, int *a0, int *a1) {
    *a0 = t->experts_local ? t->expert0 : 0;
    *a1 = t->experts_local ? t->expert0 + t->experts_local : (int)t->shape[0];
}

// Copies the parts of the experts both tensors hold from src (ns floats of tensor f, one equal
// part per expert it holds) into dst (of tensor t); a tensor held whole on both sides is copied.
static void copy_held(float *dst, const vlmoe_param_info *t, const float *src, const vlmoe_param_info *f, size_t ns) {
    if (!src || !dst) return;
    if (!t->experts_local && !f->experts_local) {
        memcpy(dst, src, sizeof(float) * ns);
        return;
    }
    int a0, a1, b0, b1;
    held(t, &a0, &a1), held(f, &b0, &b1);
    const int lo = a0 > b0 ? a0 : b0, hi = a1 < b1 ? a1 : b1;
    const size_t per = b1 > b0 ? ns / (size_t)(b1 - b0) : 0;
    if (lo < hi) memcpy(dst + (size_t)(lo - a0) * per, src + (size_t)(lo - b0) * per, sizeof(float) * (size_t)(hi - lo) * per);
}

int optim_relayout(vlmoe_optim *o, const vlmoe_param_info *table, int n, size_t total, int keep) {
    if (n != o->nparams)
        return vlmoe_fail(VLMOE_ERR_ARG, "optim: a new layout of %d tensors for an optimizer of %d", n, o->nparams);
    for (int i = 0; i < n; i++)
        if (strcmp(table[i].name, o->table[i].name))
            return vlmoe_fail(VLMOE_ERR_ARG, "optim: the new layout's tensor %d is '%s', the optimizer's '%s'", i,
                              table[i].name, o->table[i].name);
    vlmoe_optim *w;
    optim_leave_device(o); // the new layout starts on the host
    int st = optim_init_backend(&w, &o->p, table, n, total, o->be);
    if (st) return st;
    w->step = o->step;
    // before the first update every state float is zero: nothing to copy, and the new pool stays
    // zero pages (a run that starts sharded never holds the whole state)
    for (int i = 0; i < n && o->step > 0 && keep; i++) {
        const vlmoe_param_info *t = &w->table[i], *f = &o->table[i];
        if (o->p.kind == VLMOE_OPT_ADAMW) {
            for (int k = 0; k < 2; k++)
                copy_held(w->states[k].data + t->offset, t, o->states[k].data + f->offset, f, f->numel);
            continue;
        }
        const adafactor_slot *a = &w->slots[i], *b = &o->slots[i];
        copy_held(a->vr, t, b->vr, f, b->A * b->NA * b->Bm * b->C);
        copy_held(a->vc, t, b->vc, f, b->A * b->Bm * b->NB * b->C);
        copy_held(a->v, t, b->v, f, f->numel);
        copy_held(a->m, t, b->m, f, f->numel);
    }
    const vlmoe_optim old = *o;
    *o = *w, *w = old;
    vlmoe_optim_free(w);
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
    // the pointer is writable (a resume reads into it): the device's copy is uploaded again
    if (data) optim_sync_host(o, 1);
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
// AdamW's state on a device table (one process's steps with the model resident there,
// src/train/trainer.c): the update reads and writes d_pool; pool is brought up to date only when
// something reads it (a checkpoint, a host step), and uploaded again after a host write.
static void adamw_step(vlmoe_optim *o, float *params, const float *grads, float lr, float gscale);

int optim_to_device(vlmoe_optim *o, const vlmoe_backend_f32 *be, int *moved) {
    *moved = 0;
    if (o->p.kind != VLMOE_OPT_ADAMW || be->host_memory) return VLMOE_OK; // Adafactor: the host's
    if (o->d_pool && o->dbe == be) return *moved = 1, VLMOE_OK;
    optim_leave_device(o);
    int st = backend_require_f32(be, BE_OP_ADAMW, NULL);
    if (st) return vlmoe_error_prefix("optim"), st;
    o->d_pool = be->alloc(be, sizeof(float) * 2 * o->total, "AdamW's moments on the device");
    if (!o->d_pool)
        return vlmoe_fail(VLMOE_ERR_NOMEM, "optim: %zu bytes of AdamW moments on %s", sizeof(float) * 2 * o->total,
                          be->name);
    o->dbe = be, o->dev_stale = 1, o->host_stale = 0, *moved = 1;
    return VLMOE_OK;
}

void optim_sync_host(vlmoe_optim *o, int will_write) {
    if (!o || !o->d_pool) return;
    if (o->host_stale) o->dbe->download(o->dbe, o->pool, o->d_pool, 2 * o->total), o->dbe->sync(o->dbe);
    o->host_stale = 0;
    if (will_write) o->dev_stale = 1;
}

void optim_leave_device(vlmoe_optim *o) {
    if (!o || !o->d_pool) return;
    optim_sync_host(o, 0);
    o->dbe->free(o->dbe, o->d_pool);
    o->d_pool = NULL, o->dbe = NULL, o->dev_stale = 0;
}

void optim_step_device(vlmoe_optim *o, float *d_params, const float *d_grads, float lr) {
    if (o->dev_stale) o->dbe->upload(o->dbe, o->d_pool, o->pool, 2 * o->total);
    o->dev_stale = 0;
    o->dev_step = 1;
    adamw_step(o, d_params, d_grads, lr, 1.0f);
    o->dev_step = 0, o->host_stale = 1;
    o->step++;
}

// ---------------------------------------------------------------------------------------------
// AdamW. The arithmetic follows torch 1.13's _single_tensor_adamw operation by operation, with
// the same float/double split, so the parity fixture matches to the last bit or two:
//   p *= (float)(1 - lr*wd)                       (double scalar, only where decay is set)
//   m  = b1*m + (float)(1-b1) * g
//   v  = b2*v + ((float)(1-b2) * g) * g           (addcmul's order)
//   denom = sqrt(v) / (float)sqrt(1 - b2^t) + eps (bias corrections in double, t = step+1)
//   p += ((float)(-lr / (1 - b1^t)) * m) / denom  (addcdiv's order)
// gscale multiplies each gradient as it is read (clipping folded into the update, one pass fewer)
static void adamw_step(vlmoe_optim *o, float *params, const float *grads, float lr, float gscale) {
    const double t = (double)o->step + 1.0;
    const double b1 = o->p.beta1, b2 = o->p.beta2;
    const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    // the update of each tensor is the backend's adamw op (src/ops/backend_cpu.c), whose
    // element-wise order of operations is the one written above
    const double shrink = 1.0 - (o->p.wd_lr_base > 0.0f ? (double)lr / o->p.wd_lr_base : (double)lr) *
                                    (double)o->p.weight_decay;
    be_adamw a = {.b1 = (float)b1, .b2 = (float)b2, .ab1 = (float)(1.0 - b1), .ab2 = (float)(1.0 - b2),
                  .neg_step = (float)(-(double)lr / bc1), .bc2_sqrt = (float)sqrt(bc2), .eps = o->p.eps,
                  .shrink = (float)shrink, .decay = 0, .gscale = gscale};
    const vlmoe_backend_f32 *be = o->dev_step ? o->dbe : o->be;
    float *m_all = o->dev_step ? o->d_pool : o->states[0].data;
    float *v_all = o->dev_step ? o->d_pool + o->total : o->states[1].data;
    // One call per run of tensors that lie back to back with the same decay: the update is
    // elementwise, so the bits are the same, and a bench-s step opens some 85 parallel regions
    // fewer (each a thread wake-up).
    for (int k = 0; k < o->nparams;) {
        const vlmoe_param_info *info = &o->table[k];
        const size_t off = info->offset;
        // torch multiplies by exactly 1.0 when weight_decay is 0, so skipping is identical.
        a.decay = info->decay && o->p.weight_decay != 0.0f;
        size_t n = info->numel;
        // with bf16 shadows each tensor is packed again right after its update, while it is in
        // cache, so the run is that one tensor
        for (k++; !o->shadow_ver && k < o->nparams && o->table[k].offset == off + n &&
                  (o->table[k].decay && o->p.weight_decay != 0.0f) == a.decay;
             k++)
            n += o->table[k].numel;
        be->adamw(be, params + off, m_all + off, v_all + off, grads + off, n, &a);
        if (o->shadow_ver) gemm_bf16_shadow_refresh(params + off, n, o->shadow_ver);
    }
}

// ---------------------------------------------------------------------------------------------
// Adafactor as big_vision's scale_by_adafactor (optax scale_by_factored_rms, clip_by_block_rms,
// ema) followed by its lr, decoupled decay and schedule. Per parameter, with t = step+1-offset
// (at least 1) and g2 = g*g + eps1:
//   beta2_t = min(beta2_cap, 1 - t^(-decay_rate))                  (Alg. 4's hat-beta2_t, capped)
//   factored (the two largest dims a < b both >= min_dim_to_factor, the others batched):
//     vr = beta2_t*vr + (1-beta2_t)*mean_b(g2),  vc = beta2_t*vc + (1-beta2_t)*mean_a(g2)
//     u  = g / sqrt(vr / mean_a(vr) * vc)
//   otherwise: v = beta2_t*v + (1-beta2_t)*g2,  u = g / sqrt(v)
//   u /= max(1, rms(u) / clip_threshold)          (Alg. 5 update clipping; 0 = off, big_vision's)
//   if beta1 > 0: m = beta1*m + (1-beta1)*u, u = m  (optax ema without debiasing; with
//                 momentum_bf16 the stored m is rounded to bfloat16, u is the unrounded value)
//   p -= lr*u + f*wd*p where the decay flag is set, f = lr / wd_lr_base (big_vision: the decay
//        times the schedule only) or f = lr (wd_lr_base = 0)
// optax averages v_row over the largest dim and normalises it over the other; we average vr
// over b and normalise over a: the product is the same number either way. As in big_vision
// there is no relative step size and no parameter scaling (multiply_by_parameter_scale=False):
// the schedule supplies lr. Update clipping needs rms(u) before any element is written, so u is
// computed twice (a sqrt per element) instead of storing a param-sized copy.

// The indices of row r = (iA, ia, iB) of a factored parameter (its NB*C elements contiguous).
typedef struct { size_t vr, vc, rm; } af_row;
static af_row af_row_of(const adafactor_slot *s, size_t r) {
    const size_t q = (r / (s->Bm * s->NA)) * s->Bm + r % s->Bm;   // iA * Bm + iB
    return (af_row){r * s->C, q * s->NB * s->C, q * s->C};
}

// u of the element at column j = ib*C + iC of row w (factored), or of element i (not).
static inline float af_u_factored(const adafactor_slot *s, const float *rm, af_row w, const float *g, size_t j) {
    const size_t iC = j % s->C;
    return g[j] / sqrtf((s->vr[w.vr + iC] / rm[w.rm + iC]) * s->vc[w.vc + j]);
}

// Sum of u^2 over one parameter, as NCHUNK fixed chunks of its rows (factored) or elements.
static double adafactor_sumsq(const adafactor_slot *s, const float *g, const float *row_mean,
                              size_t numel) {
    double part[NCHUNK];
    const size_t len = s->factored ? s->NB * s->C : 1;
    const size_t units = numel / len;
    const size_t per = (units + NCHUNK - 1) / NCHUNK;
#pragma omp parallel for schedule(static) if (numel >= PAR_MIN)
    for (int k = 0; k < NCHUNK; k++) {
        const size_t a = (size_t)k * per < units ? (size_t)k * per : units;
        const size_t b = a + per < units ? a + per : units;
        double acc = 0;
        for (size_t r = a; r < b; r++) {
            if (s->factored) {
                const af_row w = af_row_of(s, r);
                for (size_t j = 0; j < len; j++) {
                    const float u = af_u_factored(s, row_mean, w, g + r * len, j);
                    acc += (double)u * u;
                }
            } else {
                const float u = g[r] / sqrtf(s->v[r]);
                acc += (double)u * u;
            }
        }
        part[k] = acc;
    }
    double sum = 0;
    for (int k = 0; k < NCHUNK; k++) sum += part[k];
    return sum;
}

// bfloat16 storage of a float: round to nearest even on the upper 16 bits (as a cast in JAX
// or torch), NaN kept a NaN.
static inline float round_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu)) {
        b |= 0x00400000u;
    } else {
        b += 0x7fffu + ((b >> 16) & 1u);
    }
    b &= 0xffff0000u;
    memcpy(&x, &b, sizeof x);
    return x;
}

// The second-moment statistics of a factored parameter: vr, vc, then mean_a(vr) into row_mean.
static void adafactor_factored_moments(const adafactor_slot *s, const float *g, float *row_mean, float fkeep,
                                       float fnew, float eps1, size_t n) {
    const size_t NB = s->NB, C = s->C, len = NB * C, nrows = n / len;
    // vr: each row's C entries, summed over ib; a thread owns whole rows
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (size_t r = 0; r < nrows; r++) {
        const float *gr = g + r * len;
        for (size_t iC = 0; iC < C; iC++) {
            double acc = 0;
            for (size_t ib = 0; ib < NB; ib++) acc += (double)gr[ib * C + iC] * gr[ib * C + iC] + eps1;
            s->vr[r * C + iC] = fkeep * s->vr[r * C + iC] + fnew * (float)(acc / (double)NB);
        }
    }
    // vc: per (iA, iB) a row of len entries summed over ia, in blocks of 64 entries so each
    // read is contiguous; a thread owns its block
    const size_t nblk = (len + 63) / 64, ntask = s->A * s->Bm * nblk, NA = s->NA, Bm = s->Bm;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (size_t task = 0; task < ntask; task++) {
        const size_t q = task / nblk, iA = q / Bm, iB = q % Bm, j0 = (task % nblk) * 64;
        const size_t j1 = j0 + 64 < len ? j0 + 64 : len;
        double acc[64] = {0};
        for (size_t ia = 0; ia < NA; ia++) {
            const float *gr = g + ((iA * NA + ia) * Bm + iB) * len;
            for (size_t j = j0; j < j1; j++) acc[j - j0] += (double)gr[j] * gr[j] + eps1;
        }
        float *vc = s->vc + q * len;
        for (size_t j = j0; j < j1; j++) vc[j] = fkeep * vc[j] + fnew * (float)(acc[j - j0] / (double)NA);
    }
    for (size_t q = 0; q < s->A * Bm; q++) {
        const size_t iA = q / Bm, iB = q % Bm;
        for (size_t iC = 0; iC < C; iC++) {
            double acc = 0;
            for (size_t ia = 0; ia < NA; ia++) acc += s->vr[((iA * NA + ia) * Bm + iB) * C + iC];
            row_mean[q * C + iC] = (float)(acc / (double)NA);
        }
    }
}

static void adafactor_step(vlmoe_optim *o, float *params, const float *grads, float lr) {
    double t = (double)o->step + 1.0 - (double)o->p.decay_offset;
    if (t < 1.0) t = 1.0;   // before the offset optax's power is undefined; restart the estimate
    double keep = 1.0 - pow(t, -(double)o->p.decay_rate);   // beta2_t
    if (keep > o->p.beta2_cap) keep = o->p.beta2_cap;
    const float fkeep = (float)keep, fnew = (float)(1.0 - keep);
    const float eps1 = o->p.eps, wd = o->p.weight_decay, b1 = o->p.beta1;
    const float ab1 = (float)(1.0 - (double)b1);
    const int bf16 = o->p.momentum_bf16;
    // the decay's step: lr * wd, or the schedule's factor lr / base times wd (big_vision)
    const float wd_step = o->p.wd_lr_base > 0.0f ? (float)((double)lr / o->p.wd_lr_base * wd) : lr * wd;
    for (int k = 0; k < o->nparams; k++) {
        const vlmoe_param_info *info = &o->table[k];
        const adafactor_slot *s = &o->slots[k];
        const size_t n = info->numel;
        float *p = params + info->offset;
        const float *g = grads + info->offset;
        if (n == 0) continue;
        if (s->factored) {
            adafactor_factored_moments(s, g, o->row_mean, fkeep, fnew, eps1, n);
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
        const size_t len = s->factored ? s->NB * s->C : 1, nrows = n / len;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
        for (size_t r = 0; r < nrows; r++) {   // a thread owns whole rows
            const af_row w = s->factored ? af_row_of(s, r) : (af_row){0, 0, 0};
            for (size_t j = 0; j < len; j++) {
                const size_t i = r * len + j;
                float u = s->factored ? af_u_factored(s, o->row_mean, w, g + r * len, j) : g[i] / sqrtf(s->v[i]);
                u *= scale;
                if (b1 > 0.0f) {
                    u = b1 * s->m[i] + ab1 * u;
                    s->m[i] = bf16 ? round_bf16(u) : u;
                }
                p[i] -= lr * u + (decay ? wd_step * p[i] : 0.0f);
            }
        }
        if (o->shadow_ver) gemm_bf16_shadow_refresh(p, n, o->shadow_ver);
    }
}

void optim_set_shadow(vlmoe_optim *o, uint64_t version) {
    if (o) o->shadow_ver = version;
}

static void optim_step(vlmoe_optim *o, float *params, const float *grads, float lr, float gscale) {
    if (!o || !params || !grads) return;
    optim_sync_host(o, 1); // a host step after device steps starts from their state
    if (o->p.kind == VLMOE_OPT_ADAMW)
        adamw_step(o, params, grads, lr, gscale);
    else
        adafactor_step(o, params, grads, lr);
    o->step++;
}

void vlmoe_optim_step(vlmoe_optim *o, float *params, const float *grads, float lr) {
    optim_step(o, params, grads, lr, 1.0f);
}

void optim_step_clipped(vlmoe_optim *o, float *params, float *grads, float lr, float gscale) {
    // Adafactor reads the gradient in several passes (its factored moments, the update's RMS):
    // there the scale stays a pass of its own
    if (o && grads && gscale != 1.0f && o->p.kind != VLMOE_OPT_ADAMW)
        o->be->scale(o->be, grads, o->total, gscale), gscale = 1.0f;
    optim_step(o, params, grads, lr, gscale);
}

// ---------------------------------------------------------------------------------------------
// Global-norm clipping as torch.nn.utils.clip_grad_norm_: norm = ||g||_2 over every float (in
// double); if norm > max_norm, g *= max_norm / (norm + 1e-6). Returns the norm before clipping.
double vlmoe_clip_grad_norm(float *grads, size_t n, double max_norm) {
    return optim_clip_grad_norm(backend_cpu_f32(), grads, n, max_norm);
}

float optim_clip_factor(double norm, double max_norm) {
    // torch computes this coefficient as a float32 tensor before multiplying.
    return max_norm > 0.0 && norm > max_norm ? (float)(max_norm / (norm + 1e-6)) : 1.0f;
}

double optim_clip_grad_norm_given(const vlmoe_backend_f32 *be, float *grads, size_t n, double max_norm,
                                  double sumsq) {
    const double norm = sqrt(sumsq);
    const float f = optim_clip_factor(norm, max_norm);
    if (grads && n && f != 1.0f) be->scale(be, grads, n, f);
    return norm;
}

double optim_clip_grad_norm(const vlmoe_backend_f32 *be, float *grads, size_t n, double max_norm) {
    if (!grads || n == 0) return 0.0;
    // the sum in NCHUNK fixed chunks and the scaling are the backend's ops (src/ops/backend_cpu.c)
    return optim_clip_grad_norm_given(be, grads, n, max_norm, be->sumsq(be, grads, n, NULL));
}
