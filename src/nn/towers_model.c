// towers_model.c: the towers architectures (one_tower: ViT/LIMoE, one encoder for images and
// texts; two_tower: CLIP/CLIP-UP, an encoder each) behind the model object: their parameter
// table, and the model_arch entry points (plan, contrastive forward/backward, encoders, routing
// statistics) over the graph of src/nn/graph.c. Covered by tests/test_model.c and tests/test_train.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"
#include "nn/model.h"
#include "nn/routing.h"

static size_t add(table_builder *tb, const char *name, int decay, int ndim, int64_t d0, int64_t d1) {
    return layout_add(tb, name, decay, ndim, d0, d1, 0);
}

static void add_encoder(table_builder *tb, encoder_layout *E, const char *prefix) {
    char n[96];
    const int D = E->width;
    for (int l = 0; l < E->layers; l++) {
        block_layout *b = &E->blocks[l];
        snprintf(n, sizeof(n), "%s.blocks.%d", prefix, l);
        layout_add_attention(tb, b, D, n);
        snprintf(n, sizeof(n), "%s.blocks.%d.ln2.weight", prefix, l);
        b->ln2_w = add(tb, n, 0, 1, D, 0);
        snprintf(n, sizeof(n), "%s.blocks.%d.ln2.bias", prefix, l);
        b->ln2_b = add(tb, n, 0, 1, D, 0);
        snprintf(n, sizeof(n), "%s.blocks.%d", prefix, l);
        layout_add_ffn(tb, &b->ffn, E->moe, l, D, E->mlp, n);
    }
    snprintf(n, sizeof(n), "%s.ln_final.weight", prefix);
    E->lnf_w = add(tb, n, 0, 1, D, 0);
    snprintf(n, sizeof(n), "%s.ln_final.bias", prefix);
    E->lnf_b = add(tb, n, 0, 1, D, 0);
}

// The parameter table of a one_tower or two_tower config (L zeroed but for L->arch, cfg valid).
static int towers_layout_build(model_layout *L, const vlmoe_model_config *cfg) {
    L->cfg = *cfg;
    L->nenc = cfg->arch == VLMOE_ARCH_TWO_TOWER ? 2 : 1;
    for (int e = 0; e < L->nenc; e++) {
        const vlmoe_encoder_config *ec = e ? &cfg->text_encoder : &cfg->encoder;
        L->enc[e] = (encoder_layout){ec->width, ec->layers, ec->heads, ec->mlp_dim, NULL, 0, 0,
                                     e ? &L->cfg.text_moe : &L->cfg.moe};
        L->enc[e].blocks = calloc((size_t)(ec->layers ? ec->layers : 1), sizeof(block_layout));
        if (!L->enc[e].blocks) return model_layout_free(L), vlmoe_fail(VLMOE_ERR_NOMEM, "layout");
    }
    table_builder tb = {L, 0, 0};
    const int np = (cfg->image_size / cfg->patch_size) * (cfg->image_size / cfg->patch_size);
    const int pd = cfg->channels * cfg->patch_size * cfg->patch_size;
    modality_layout *mi = &L->mod[MOD_IMAGE], *mt = &L->mod[MOD_TEXT];
    const int Di = L->enc[0].width, Dt = L->enc[L->nenc - 1].width;
    mi->enc = 0;
    mi->has_cls = cfg->image_class_token;
    mi->has_ln_pre = cfg->image_ln_pre;
    mi->pool = cfg->image_pool;
    mi->seq = np + mi->has_cls;
    mi->embed_w = add(&tb, "image.patch_embed.weight", 1, 2, Di, pd);
    mi->embed_b = cfg->patch_bias ? add(&tb, "image.patch_embed.bias", 0, 1, Di, 0) : NO_PARAM;
    mi->cls = mi->has_cls ? add(&tb, "image.class_token", 0, 1, Di, 0) : NO_PARAM;
    mi->pos = add(&tb, "image.pos_embed", 0, 2, mi->seq, Di);
    mi->ln_pre_w = mi->has_ln_pre ? add(&tb, "image.ln_pre.weight", 0, 1, Di, 0) : NO_PARAM;
    mi->ln_pre_b = mi->has_ln_pre ? add(&tb, "image.ln_pre.bias", 0, 1, Di, 0) : NO_PARAM;
    mt->enc = L->nenc - 1;
    mt->seq = cfg->context_length;
    mt->has_cls = 0;
    mt->has_ln_pre = 0;
    mt->pool = cfg->text_pool;
    mt->causal = cfg->text_causal;
    mt->embed_w = add(&tb, "text.token_embed", 0, 2, cfg->vocab_size, Dt);
    mt->embed_b = mt->cls = mt->ln_pre_w = mt->ln_pre_b = NO_PARAM;
    mt->pos = add(&tb, "text.pos_embed", 0, 2, mt->seq, Dt);
    if (L->nenc == 1) {
        add_encoder(&tb, &L->enc[0], "encoder");
    } else {
        add_encoder(&tb, &L->enc[0], "image");
        add_encoder(&tb, &L->enc[1], "text");
    }
    mi->proj = add(&tb, "image.proj", 1, 2, cfg->embed_dim, Di);
    mt->proj = add(&tb, "text.proj", 1, 2, cfg->embed_dim, Dt);
    L->logit_scale = add(&tb, "logit_scale", 0, 0, 0, 0);
    if (!L->table || tb.off == 0) return model_layout_free(L), vlmoe_fail(VLMOE_ERR_NOMEM, "layout");
    for (int i = 0; i < L->nparams; i++)
        if (L->table[i].offset == NO_PARAM) return model_layout_free(L), vlmoe_fail(VLMOE_ERR_NOMEM, "layout");
    L->total = tb.off;
    return VLMOE_OK;
}

static int towers_plan(vlmoe_model *m, int batch_size) {
    if (m->g && m->planned_B == batch_size) return VLMOE_OK;
    graph_free_f32(m->g);
    m->g = NULL;
    m->have_forward = 0;
    int st = graph_create_ckpt_f32(&m->g, &m->L, m->be, batch_size, m->grad_ckpt, model_keep_request(m));
    if (st) return st;
    for (int k = 0; k < NUM_MOD; k++) graph_set_frozen_f32(m->g, k, m->frozen[k]);
    m->planned_B = batch_size;
    return VLMOE_OK;
}

// ---- data parallelism: every process encodes its block of the global batch; the embeddings
// are gathered in rank order (the one-process batch, row for row) and every process computes
// the same loss over all G = W*B pairs (OpenCLIP's gather with gradient, without local loss).
// Backward: this process's rows of d(loss)/d(embeddings), times W, go into its towers, so that
// the trainer's mean of the processes' gradients is the gradient of the global loss; the logit
// scale's gradient is the same on every process and the mean keeps it.
enum { FWD_GATHERED = 2 }; // have_forward: the last training forward took the gathered loss

struct towers_dp {
    int G, E;
    contrastive_step_f32 *loss;
    float *img, *txt, *dimg, *dtxt; // (G, E) gathered embeddings and their gradients
};

static void dp_free(struct towers_dp *d) {
    if (!d) return;
    contrastive_step_free_f32(d->loss);
    vlmoe_free_mem(d->img), vlmoe_free_mem(d->txt), vlmoe_free_mem(d->dimg), vlmoe_free_mem(d->dtxt);
    free(d);
}

static int dp_plan(vlmoe_model *m, int G) {
    const int E = m->L.cfg.embed_dim;
    if (m->dp && m->dp->G == G) return VLMOE_OK;
    if (!m->be->host_memory)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "data parallelism over MPI needs host memory; the %s backend's "
                          "embeddings live on the device (use the nccl process group)", m->be->name);
    dp_free(m->dp);
    struct towers_dp *d = m->dp = calloc(1, sizeof(*d));
    if (!d) return vlmoe_fail(VLMOE_ERR_NOMEM, "data parallelism");
    d->G = G, d->E = E;
    const size_t bytes = sizeof(float) * (size_t)G * E;
    // host memory (dp_plan checked): the buffers MPI reads and writes
    d->img = vlmoe_alloc(bytes, "gathered embeddings"), d->txt = vlmoe_alloc(bytes, "gathered embeddings");
    d->dimg = vlmoe_alloc(bytes, "gathered embeddings"), d->dtxt = vlmoe_alloc(bytes, "gathered embeddings");
    int st = d->img && d->txt && d->dimg && d->dtxt ? contrastive_step_create_f32(&d->loss, m->be, G, E) : VLMOE_ERR_NOMEM;
    if (st) dp_free(d), m->dp = NULL;
    return st;
}

void model_set_grad_ready(vlmoe_model *m, void (*ready)(void *user, size_t offset), void *user) {
    m->grad_ready = ready, m->grad_ready_user = user;
}

void model_set_dist(vlmoe_model *m, struct vlmoe_dist *d, struct vlmoe_dist *experts) {
    m->dist = d && d->world > 1 ? d : NULL;
    m->experts = m->dist && experts && experts->world > 1 ? experts : NULL;
}

// The loss over the gathered embeddings of the last encode: r->loss (r->aux, the encode's, added)
// and r->acc.
static int dp_forward(vlmoe_model *m, int B, graph_result *r) {
    vlmoe_dist *d = m->dist;
    int st = dp_plan(m, B * d->world);
    if (st) return st;
    struct towers_dp *p = m->dp;
    const size_t n = (size_t)B * p->E, at = (size_t)d->rank * n;
    // in place: this process's rows of the gathered buffers are its own embeddings
    m->be->copy(m->be, p->img + at, graph_embeddings_f32(m->g, MOD_IMAGE), n);
    m->be->copy(m->be, p->txt + at, graph_embeddings_f32(m->g, MOD_TEXT), n);
    if ((st = d->allgather(d, p->img, p->img + at, n, VLMOE_DIST_F32)) ||
        (st = d->allgather(d, p->txt, p->txt + at, n, VLMOE_DIST_F32)))
        return vlmoe_error_prefix("gathering the embeddings"), st;
    r->loss = contrastive_step_forward_f32(p->loss, p->img, p->txt, m->params + m->L.logit_scale, r->acc) + r->aux;
    return VLMOE_OK;
}

static void dp_backward(vlmoe_model *m) {
    vlmoe_dist *d = m->dist;
    struct towers_dp *p = m->dp;
    const int B = p->G / d->world;
    const size_t n = (size_t)B * p->E, at = (size_t)d->rank * n;
    m->be->zero(m->be, p->dimg, (size_t)p->G * p->E);
    m->be->zero(m->be, p->dtxt, (size_t)p->G * p->E);
    contrastive_step_backward_f32(p->loss, p->dimg, p->dtxt, m->grads + m->L.logit_scale, 1.0);
    if (m->grad_ready) m->grad_ready(m->grad_ready_user, m->L.logit_scale);
    m->be->scale(m->be, p->dimg + at, n, (float)d->world);
    m->be->scale(m->be, p->dtxt + at, n, (float)d->world);
    const float *const demb[NUM_MOD] = {p->dimg + at, p->dtxt + at};
    graph_set_grad_ready_f32(m->g, m->grad_ready, m->grad_ready_user);
    graph_encode_backward_f32(m->g, m->params, m->grads, demb);
    graph_set_grad_ready_f32(m->g, NULL, NULL); // the accumulation's backwards are not final
}

static int towers_forward(vlmoe_model *m, const vlmoe_batch *b, vlmoe_step_stats *stats, int training) {
    const int defer = m->defer; // model_defer_scalars: for this forward only
    m->deferred = m->defer = 0;
    const uint8_t *pix = m->pix; // model_set_pixels: this forward's images, as bytes
    m->pix = NULL;
    if ((!b->images && !pix) || !b->tokens || !b->lengths)
        return vlmoe_fail(VLMOE_ERR_ARG, "forward needs images, tokens and lengths");
    if (pix && b->images) return vlmoe_fail(VLMOE_ERR_ARG, "forward given images both as bytes and as floats");
    int st = towers_plan(m, b->batch_size);
    if (st) return st;
    if (pix) {
        m->pixp.B = b->batch_size;
        graph_set_pixels_f32(m->g, pix, &m->pixp);
    }
    const int dp = training && m->dist;
    graph_set_sample_base_f32(m->g, dp ? (uint64_t)m->dist->rank * (uint64_t)b->batch_size : 0);
    // experts split over the processes in data-parallel training only (rank 0 evaluates alone)
    if ((st = graph_set_expert_parallel_f32(m->g, dp ? m->experts : NULL))) return st;
    graph_result r = {0, {0, 0}, 0};
    m->accum_stats = 0;
    graph_set_mode_f32(m->g, training, training ? m->seed * 0x9e3779b97f4a7c15ULL + m->forwards++ : 0);
    m->have_forward = 0;
    if (dp) { // the towers here, the loss over every process's embeddings
        st = graph_encode_f32(m->g, m->params, b->images, b->tokens, b->lengths, &r.aux);
        if (!st) st = dp_forward(m, b->batch_size, &r);
    } else {
        // a trainer step on the device: the loss stays there until the step's one download
        m->deferred = training && defer && m->d_scalars;
        if (m->deferred)
            graph_set_step_scalars_f32(m->g, m->d_scalars, m->d_scalars + MODEL_SCALARS, m->aux_cap);
        st = graph_forward_f32(m->g, model_params_for_graph(m), b->images, b->tokens, b->lengths, &r);
    }
    if (st) return m->deferred = 0, st;
    m->aux_deferred = r.aux;
    m->have_forward = dp ? FWD_GATHERED : training;
    if (stats) {
        memset(stats, 0, sizeof(*stats));
        stats->contrastive = r.loss - r.aux;
        stats->aux = r.aux;
        stats->loss = r.loss;
        stats->acc_i2t = r.acc[0];
        stats->acc_t2i = r.acc[1];
        // resident: the host's float is a mirror (vlmoe_model_clamp writes the device's), so a
        // deferred step reads the scale from its download (model_take_scalars), another forward here
        float ls = m->params[m->L.logit_scale];
        if (m->resident && m->host_stale && !m->deferred)
            m->be->download(m->be, &ls, m->d_params + m->L.logit_scale, 1);
        stats->temperature = m->deferred ? NAN : exp(ls);
    }
    // a deferred loss is checked when it comes down (the trainer, before any parameter changes)
    if (!m->deferred && !isfinite(r.loss)) return vlmoe_fail(VLMOE_ERR_NUMERIC, "the contrastive loss is %g", r.loss);
    return VLMOE_OK;
}

static int towers_backward(vlmoe_model *m) {
    if (!m->have_forward) return vlmoe_fail(VLMOE_ERR_ARG, "backward called without a forward pass");
    if (!m->resident) memset(m->grads, 0, sizeof(float) * m->L.total); // else a mirror, read later
    if (m->have_forward == FWD_GATHERED) {
        dp_backward(m);
    } else if (m->d_grads) { // on the device: its copy of the parameters is the forward's
        m->be->zero(m->be, m->d_grads, m->L.total);
        graph_backward_f32(m->g, m->d_params, m->d_grads);
        // the clipping norm and the divergence guard's flag join the deferred loss on the device
        if (m->deferred) m->be->sumsq_dev(m->be, m->d_grads, m->L.total, m->d_scalars + 4);
        if (m->resident) { // the trainer clips and updates there: the host's copy comes down when read
            m->grads_stale = 1;
        } else {
            m->be->download(m->be, m->grads, m->d_grads, m->L.total);
            m->be->sync(m->be);
        }
    } else {
        graph_backward_f32(m->g, m->params, m->grads);
    }
    return VLMOE_OK;
}

// Runs one modality in chunks of the planned batch size (the last chunk padded by repeating
// its final item, whose outputs are discarded).
static int towers_encode(vlmoe_model *m, int modality, const float *images, const int32_t *tokens,
                         const int32_t *lens, int n, float *out) {
    if (!m->g) {
        int st = towers_plan(m, n < 64 ? (n > 0 ? n : 1) : 64);
        if (st) return st;
    }
    const vlmoe_model_config *c = &m->L.cfg;
    const int B = m->planned_B, E = c->embed_dim, T = c->context_length;
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
    const float *P = model_params_for_graph(m); // uploaded once for every chunk
    float *pad_img = NULL;
    int32_t *pad_tok = NULL;
    int st = VLMOE_OK;
    m->accum_stats = 0;
    for (int i0 = 0; i0 < n && !st; i0 += B) {
        const int k = n - i0 < B ? n - i0 : B;
        const float *im = images ? images + (size_t)i0 * isz : NULL;
        const int32_t *tk = tokens ? tokens + (size_t)i0 * T : NULL, *ln = lens ? lens + i0 : NULL;
        if (k < B) { // copy the tail into a full batch
            if (images) {
                pad_img = vlmoe_alloc(sizeof(float) * isz * B, "padded batch");
                if (!pad_img) return VLMOE_ERR_NOMEM;
                for (int j = 0; j < B; j++) memcpy(pad_img + j * isz, im + (j < k ? j : k - 1) * isz, sizeof(float) * isz);
                im = pad_img;
            } else {
                pad_tok = vlmoe_alloc(sizeof(int32_t) * ((size_t)T + 1) * B, "padded batch");
                if (!pad_tok) return VLMOE_ERR_NOMEM;
                for (int j = 0; j < B; j++) {
                    int s = j < k ? j : k - 1;
                    memcpy(pad_tok + (size_t)j * T, tk + (size_t)s * T, sizeof(int32_t) * T);
                    pad_tok[(size_t)B * T + j] = ln[s];
                }
                tk = pad_tok;
                ln = pad_tok + (size_t)B * T;
            }
        }
        graph_set_mode_f32(m->g, 0, 0);
        st = graph_forward_f32(m->g, P, im, tk, ln, NULL);
        if (!st && m->d_params) { // the embeddings come back from the device
            m->be->download(m->be, out + (size_t)i0 * E, graph_embeddings_f32(m->g, modality), (size_t)k * E);
            m->be->sync(m->be);
        } else if (!st) {
            memcpy(out + (size_t)i0 * E, graph_embeddings_f32(m->g, modality), sizeof(float) * (size_t)k * E);
        }
    }
    vlmoe_free_mem(pad_img);
    vlmoe_free_mem(pad_tok);
    m->have_forward = 0;
    return st;
}

static const vlmoe_moe_stats *towers_moe_stats(const vlmoe_model *m, int *count) {
    if (m->accum_stats) return towers_accum_stats(m, count);
    if (!m->g) {
        if (count) *count = 0;
        return NULL;
    }
    return graph_moe_stats_f32(m->g, count);
}

static const struct moe_state_f32 *towers_moe_layer(const vlmoe_model *m, int index) {
    return m->g ? graph_moe_layer_f32(m->g, index) : NULL;
}

static void towers_free(vlmoe_model *m) {
    graph_free_f32(m->g);
    m->g = NULL;
    dp_free(m->dp);
    m->dp = NULL;
    towers_accum_free(m);
}

const model_arch model_arch_towers = {
    .name = "towers",
    .layout_build = towers_layout_build,
    .free = towers_free,
    .drop_graphs = towers_free, // its state is only its graphs
    .plan = towers_plan,
    .forward = towers_forward,
    .backward = towers_backward,
    .encode = towers_encode,
    .moe_stats = towers_moe_stats,
    .moe_layer = towers_moe_layer,
};
