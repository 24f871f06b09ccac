// trainer.c: one optimisation step of a contrastive model (over one batch, or accumulated over
// micro-batches: src/nn/towers_accum.c), or of a VL-MoE model over several
// masked-modeling batches whose gradients add up: forward, backward, the divergence guard (a
// non-finite loss or gradient stops the step before any parameter changes), global-norm
// clipping, the learning-rate schedule, the optimizer update and CLIP's temperature clamp. With
// data parallelism, the gradient's sum over the processes in buckets (src/train/buckets.c).
// Covered by tests/test_train.c, tests/test_mome.c, tests/test_accum.c and, against PyTorch,
// tests/test_parity.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"
#include "nn/model.h"
#include "optim/optim.h"
#include "train/buckets.h"
#include "vlmoe.h"

struct vlmoe_trainer {
    vlmoe_model *m;
    vlmoe_optim *opt;
    vlmoe_train_params p;
    vlmoe_param_info *frozen;   // freeze_moe, lock_*: tensors left out of the optimizer
    int nfrozen;
    vlmoe_dist *dist;           // data parallelism: the processes whose gradients are averaged
    train_buckets *bk;          // and the buckets their sum goes in (made at the first step)
};

void vlmoe_trainer_set_dist(vlmoe_trainer *t, vlmoe_dist *d, vlmoe_dist *experts) {
    t->dist = d && d->world > 1 ? d : NULL;
    model_set_dist(t->m, t->dist, experts);
    model_set_grad_ready(t->m, NULL, NULL);
}

// Data parallelism: a step starts with no bucket of the gradient final; the towers' backward
// reports each parameter it finishes (model_set_grad_ready), other backwards none.
static int begin_step(vlmoe_trainer *t) {
    if (!t->dist) return VLMOE_OK;
    if (!t->bk) {
        int n, st;
        const vlmoe_param_info *tab = vlmoe_model_params(t->m, &n);
        if ((st = buckets_init(&t->bk, tab, n, vlmoe_model_num_floats(t->m), vlmoe_model_grad_data(t->m),
                               t->p.bucket_cap_mb)))
            return st;
    }
    buckets_begin(t->bk, t->dist);
    model_set_grad_ready(t->m, buckets_ready, t->bk);
    return VLMOE_OK;
}

// Data parallelism: the gradient becomes its mean over the processes, as in DDP: its buckets'
// sums, started during the backward (src/train/buckets.c), are finished (summed in rank order,
// so every process holds the same bits and takes the same update, whatever the buckets); then
// every process agrees whether the step diverged (one flag, its maximum). The finite check reads
// the summed gradient (a non-finite gradient on any process makes the sum non-finite on all), as
// the buffer is MPI's until the sums finish. The step's statistics become their means too.
static int reduce_step(vlmoe_trainer *t, int st, long step, vlmoe_step_stats *s) {
    vlmoe_dist *d = t->dist;
    int e = buckets_finish(t->bk);
    model_set_grad_ready(t->m, NULL, NULL);
    if (e) return vlmoe_error_prefix("step %ld: gradient all-reduce", step), e;
    if (!st && (st = vlmoe_model_check_finite(t->m, 1))) vlmoe_error_prefix("step %ld", step);
    int32_t bad = st != VLMOE_OK;
    if ((e = d->allreduce_max(d, &bad, 1, VLMOE_DIST_I32))) return vlmoe_error_prefix("step %ld", step), e;
    if (st) return st;
    if (bad) return vlmoe_fail(VLMOE_ERR_NUMERIC, "step %ld: the loss or a gradient of another process is not finite", step);
    float *g = vlmoe_model_grad_data(t->m);
    const size_t n = vlmoe_model_num_floats(t->m);
    double v[5] = {s->loss, s->contrastive, s->aux, s->acc_i2t, s->acc_t2i};
    if ((e = d->allreduce_sum(d, v, 5, VLMOE_DIST_F64))) return vlmoe_error_prefix("step %ld: statistics all-reduce", step), e;
    const vlmoe_backend_f32 *hb = model_host_backend(t->m); // the gradients' master copy
    hb->scale(hb, g, n, (float)(1.0 / d->world));
    s->loss = v[0] / d->world, s->contrastive = v[1] / d->world, s->aux = v[2] / d->world;
    s->acc_i2t = v[3] / d->world, s->acc_t2i = v[4] / d->world;
    return VLMOE_OK;
}

// VL-MoE freezes routers and experts when fine-tuning: with freeze_moe every tensor of an MoE
// layer ("<block>.moe.*": router, experts, Soft MoE's phi and scale) is kept out of the optimizer's
// table, so neither AdamW's decay nor moments left from earlier steps can move it, and its
// gradient is zeroed before clipping so the global norm is that of the trained tensors.
static int is_moe_param(const vlmoe_param_info *p) { return strstr(p->name, ".moe.") != NULL; }

// LiT locks a tower the same way (OpenCLIP's lock_image_tower / lock_text_tower): every tensor of
// the tower is frozen but those of its last `unlocked` groups. The group of a tensor of tower
// "<prefix>." with L blocks, counted from the end: the projection 1, the final LayerNorm and the
// last block 2, block l < L-1 L+1-l, the stem L+2 (OpenCLIP's VisionTransformer.lock groups).
static int tower_group(const char *name, int L) {
    int l;
    if (!strcmp(name, "proj")) return 1;
    if (!strncmp(name, "ln_final.", 9)) return 2;
    if (sscanf(name, "blocks.%d.", &l) == 1) return l >= L - 1 ? 2 : L + 1 - l;
    return L + 2;
}

static int is_locked(const vlmoe_train_params *p, const vlmoe_model_config *c, const vlmoe_param_info *q) {
    if (p->lock_image && !strncmp(q->name, "image.", 6))
        return tower_group(q->name + 6, c->encoder.layers) > p->lock_image_unlocked_groups;
    if (p->lock_text && !strncmp(q->name, "text.", 5))
        return tower_group(q->name + 5, c->text_encoder.layers) > p->lock_text_unlocked_layers;
    return 0;
}

static int check_locks(const vlmoe_train_params *p, const vlmoe_model_config *c) {
    if (p->lock_image_unlocked_groups < 0 || p->lock_text_unlocked_layers < 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "lock: --lock-image-unlocked-groups %d / --lock-text-unlocked-layers %d must "
                          "be >= 0", p->lock_image_unlocked_groups, p->lock_text_unlocked_layers);
    if (p->lock_image_unlocked_groups && !p->lock_image)
        return vlmoe_fail(VLMOE_ERR_ARG, "lock: --lock-image-unlocked-groups %d needs --lock-image (it says how much of "
                          "the locked image tower stays trainable)", p->lock_image_unlocked_groups);
    if (p->lock_text_unlocked_layers && !p->lock_text)
        return vlmoe_fail(VLMOE_ERR_ARG, "lock: --lock-text-unlocked-layers %d needs --lock-text (it says how much of "
                          "the locked text tower stays trainable)", p->lock_text_unlocked_layers);
    const char *tower = p->lock_image ? "image" : "text";
    if ((p->lock_image || p->lock_text) && c->arch != VLMOE_ARCH_TWO_TOWER)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': --lock-%s locks one of two towers, but this model is %s: one "
                          "encoder runs both images and texts, so there is no separate %s tower to lock (LiT needs a "
                          "two_tower model such as tiny-clip, ViT-B-32 or ViT-B-16)", c->name, tower,
                          c->arch == VLMOE_ARCH_ONE_TOWER ? "one_tower (LIMoE)" : "VL-MoE (arch mome)", tower);
    return VLMOE_OK;
}

vlmoe_train_params vlmoe_train_default_params(void) {
    vlmoe_train_params p;
    p.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    p.optim.beta2 = 0.98f; // OpenCLIP's ViT default
    p.optim.eps = 1e-6f;
    p.optim.weight_decay = 0.2f;
    p.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 5e-4, 100, 1000, 0.0, 0, 0};
    p.grad_clip_norm = 1.0;
    p.freeze_moe = 0;
    p.lock_image = p.lock_image_unlocked_groups = 0;
    p.lock_text = p.lock_text_unlocked_layers = 0;
    p.bucket_cap_mb = 25; // DDP's
    return p;
}

int vlmoe_trainer_init(vlmoe_trainer **out, vlmoe_model *m, const vlmoe_train_params *p) {
    *out = NULL;
    vlmoe_trainer *t = calloc(1, sizeof(*t));
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "trainer");
    t->m = m;
    t->p = *p;
    int n;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &n);
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    vlmoe_param_info *train = NULL;
    int st = check_locks(p, c);
    if (st) return vlmoe_trainer_free(t), st;
    if (p->freeze_moe || p->lock_image || p->lock_text) {
        train = malloc(sizeof(*train) * (size_t)n);
        t->frozen = malloc(sizeof(*train) * (size_t)n);
        if (!train || !t->frozen) return free(train), vlmoe_trainer_free(t), vlmoe_fail(VLMOE_ERR_NOMEM, "trainer");
        int nt = 0;
        for (int i = 0; i < n; i++) {
            if ((p->freeze_moe && is_moe_param(&tab[i])) || is_locked(p, c, &tab[i])) t->frozen[t->nfrozen++] = tab[i];
            else train[nt++] = tab[i];
        }
        tab = train;
        n = nt;
    }
    st = optim_init_backend(&t->opt, &p->optim, tab, n, vlmoe_model_num_floats(m), model_host_backend(m));
    free(train);
    // a tower locked whole needs no backward at all: its gradients would be zeroed anyway
    if (!st && (p->lock_image || p->lock_text))
        st = model_set_frozen_towers(m, p->lock_image && !p->lock_image_unlocked_groups,
                                     p->lock_text && !p->lock_text_unlocked_layers);
    if (st) return vlmoe_trainer_free(t), st;
    *out = t;
    return VLMOE_OK;
}

void vlmoe_trainer_free(vlmoe_trainer *t) {
    if (!t) return;
    if (t->p.lock_image || t->p.lock_text) model_set_frozen_towers(t->m, 0, 0); // the model trains whole again
    vlmoe_optim_free(t->opt);
    buckets_free(t->bk);
    free(t->frozen);
    free(t);
}

buckets_info trainer_buckets_info(const vlmoe_trainer *t) { return buckets_get_info(t->bk); }
long vlmoe_trainer_get_step(const vlmoe_trainer *t) { return vlmoe_optim_get_step(t->opt); }
vlmoe_optim *vlmoe_trainer_optim(vlmoe_trainer *t) { return t->opt; }
vlmoe_model *vlmoe_trainer_model(vlmoe_trainer *t) { return t->m; }
const vlmoe_train_params *vlmoe_trainer_params(const vlmoe_trainer *t) { return &t->p; }

// The rest of a step once the gradients are in the model's buffer: the divergence guard,
// clipping, the schedule, the update and the temperature clamp.
static int apply(vlmoe_trainer *t, long step, vlmoe_step_stats *s) {
    int st = t->dist ? reduce_step(t, VLMOE_OK, step, s) : vlmoe_model_check_finite(t->m, 1);
    if (st && !t->dist) vlmoe_error_prefix("step %ld", step);
    if (st) return st;
    float *g = vlmoe_model_grad_data(t->m);
    for (int i = 0; i < t->nfrozen; i++) memset(g + t->frozen[i].offset, 0, sizeof(float) * t->frozen[i].numel);
    s->grad_norm = optim_clip_grad_norm(model_host_backend(t->m), g, vlmoe_model_num_floats(t->m), t->p.grad_clip_norm);
    s->lr = vlmoe_schedule_lr(&t->p.schedule, step);
    vlmoe_optim_step(t->opt, vlmoe_model_param_data(t->m), g, (float)s->lr);
    vlmoe_model_clamp(t->m);
    return VLMOE_OK;
}

// A step that failed before its update: with data parallelism the other processes still learn
// that it did (they wait in the divergence flag's all-reduce), so none is left hanging.
static int failed(vlmoe_trainer *t, int st, long step, vlmoe_step_stats *s) {
    return t->dist ? reduce_step(t, st, step, s) : st;
}

int vlmoe_trainer_step(vlmoe_trainer *t, const vlmoe_batch *b, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    int st = vlmoe_model_forward(t->m, b, &s);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return failed(t, st, step, &s);
    }
    if ((st = vlmoe_model_backward(t->m))) return failed(t, st, step, &s);
    if ((st = apply(t, step, &s))) return st;
    if (stats) *stats = s;
    return VLMOE_OK;
}

int vlmoe_trainer_step_accum(vlmoe_trainer *t, const vlmoe_batch *micro, int n, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    int st = model_accumulate(t->m, micro, n, &s);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return failed(t, st, step, &s);
    }
    if ((st = apply(t, step, &s))) return st;
    if (stats) *stats = s;
    return VLMOE_OK;
}

int vlmoe_trainer_step_mome_retrieval(vlmoe_trainer *t, const float *images, const int32_t *tokens,
                                      const int32_t *lengths, int B, vlmoe_mome_stats *ms, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    vlmoe_mome_stats r;
    int st = vlmoe_mome_forward_retrieval(t->m, images, tokens, lengths, B, 1, &r);
    if (!st) st = vlmoe_mome_backward_retrieval(t->m, 0);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return failed(t, st, step, &s);
    }
    s.loss = r.loss;
    s.aux = r.aux;
    if ((st = apply(t, step, &s))) return st;
    if (ms) *ms = r;
    if (stats) *stats = s;
    return VLMOE_OK;
}

// Data parallelism: each part's statistics over every process's share of it (the one-process
// part): the losses, whose per-process values are shares scaled by W (src/nn/mome_model.c), and
// the auxiliary losses average; the accuracies weigh by the labelled positions, which add up.
static int reduce_parts(vlmoe_dist *d, vlmoe_mome_stats *ps, int n, long step) {
    enum { K = 8 };
    double *v = malloc(sizeof(double) * K * (size_t)n);
    if (!v) return vlmoe_fail(VLMOE_ERR_NOMEM, "step %ld: statistics of %d forwards", step, n);
    for (int i = 0; i < n; i++) {
        const vlmoe_mome_stats *p = &ps[i];
        const double x[K] = {p->loss, p->text, p->image, p->aux, p->text_acc * p->text_count,
                             p->image_acc * p->image_count, p->text_count, p->image_count};
        memcpy(v + (size_t)K * i, x, sizeof(x));
    }
    int st = d->allreduce_sum(d, v, (size_t)K * n, VLMOE_DIST_F64);
    for (int i = 0; i < n && !st; i++) {
        const double *x = v + (size_t)K * i;
        vlmoe_mome_stats *p = &ps[i];
        p->loss = x[0] / d->world, p->text = x[1] / d->world, p->image = x[2] / d->world, p->aux = x[3] / d->world;
        p->text_acc = x[6] > 0 ? x[4] / x[6] : 0, p->image_acc = x[7] > 0 ? x[5] / x[7] : 0;
        p->text_count = (int)x[6], p->image_count = (int)x[7];
    }
    free(v);
    return st ? (vlmoe_error_prefix("step %ld: statistics all-reduce", step), st) : VLMOE_OK;
}

int vlmoe_trainer_step_mome(vlmoe_trainer *t, const vlmoe_mome_batch *parts, int nparts,
                            vlmoe_mome_stats *part_stats, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    memset(&s, 0, sizeof(s));
    const long step = vlmoe_optim_get_step(t->opt);
    int bst = begin_step(t);
    if (bst) return vlmoe_error_prefix("step %ld", step), bst;
    if (nparts < 1) return failed(t, vlmoe_fail(VLMOE_ERR_ARG, "step %ld: no batches", step), step, &s);
    // Data parallelism: every forward all-reduces its label counts (src/nn/mome_model.c), so a
    // process whose forward failed (a non-finite loss, bad labels) still runs the others' forwards
    // to keep the collectives in step, and the first failure stops every process after the last.
    int bad = VLMOE_OK;
    char why[512] = "";
    for (int i = 0; i < nparts; i++) {
        vlmoe_mome_stats ps;
        int st = vlmoe_mome_forward(t->m, &parts[i], 1, &ps);
        if (!st && !bad) st = vlmoe_mome_backward(t->m, i > 0); // the objectives' gradients add up
        if (st && !bad) {
            vlmoe_error_prefix("step %ld, batch %d", step, i);
            if (!t->dist) return st;
            bad = st;
            snprintf(why, sizeof(why), "%s", vlmoe_last_error());
        }
        if (bad) continue;
        if (part_stats) part_stats[i] = ps;
        s.loss += ps.loss;
        s.aux += ps.aux;
    }
    if (bad) return failed(t, vlmoe_fail(bad, "%s", why), step, &s);
    int st = apply(t, step, &s);
    if (!st && t->dist && part_stats) st = reduce_parts(t->dist, part_stats, nparts, step);
    if (st) return st;
    if (stats) *stats = s;
    return VLMOE_OK;
}
