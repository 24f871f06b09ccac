// mome_model.c: VL-MoE (arch mome, VL-MoE sec. 3.2) in the model object: the parameter table
// (shared attention, per-modality experts V-FFN / T-FFN / VL-FFN each with its own LayerNorm,
// [I_CLS], the image mask token, MLM and MIM heads, the optional classification head) and the
// float entry points: forward and backward of one encoding, the three encodings' hidden states
// and class scores, a copy of a model with a fresh classification head. Save/load go through model.c.
// Covered by tests/test_mome.c and tests/test_parity.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"
#include "nn/mome.h"
#include "nn/routing.h"

// What a VL-MoE model holds besides its parameters (vlmoe_model.mome).
struct mome_model {
    mome_graph_f32 *mg;         // the graph planned for planned_B (the image side for retrieval)
    mome_graph_f32 *mg_text;    // retrieval: the text side's graph
    mome_itc_f32 *itc;          // the retrieval head's buffers, for batches of itc_B
    int itc_B, text_B;          // batch sizes itc and mg_text are planned for
    int have_itc;               // a training retrieval forward awaits its backward
    // ITM with hard negatives (vlmoe_mome_forward_retrieval_itm): the pair graph of the 3B
    // pairs, its head, their inputs; itm_eval: the head for eval chunks of planned_B pairs
    mome_graph_f32 *mg_pair;
    mome_itm_f32 *itm, *itm_eval;
    int pair_B, eval_B, have_itm;
    float *pimg, *sim;          // (3B,C,H,W) pair images, (B,B) mining similarities
    int32_t *ptok, *plen, *plab, *neg; // (3B,ctx), (3B), (3B), (2B)
    float *emb_h;               // (2,B,embed_dim) the embeddings as the host reads them (mining)
    float *codebook;            // the MIM targets' codebook (mim_vocab, patch values) or NULL;
                                // saved with the weights as a codebook file's tensor
    double drop_path;           // stochastic depth of training forwards (vlmoe_model_set_drop_path)
};

static int with_config(vlmoe_model **out, const vlmoe_model *m, int num_classes, int cls_sequences,
                       int retrieval_head, int itm_head, uint64_t seed);

// On a table without host memory (src/nn/device.c) a forward reads the table's copy of the
// parameters, uploaded from the host master copy first (model_params_for_graph); its backward
// reads that copy (fwd_params) and writes the table's gradients, which come back to the master
// copy by download; the host reads results through host_view. On the host's memory all three are
// the master copies and the graph's own buffers, as they always were.
static const float *fwd_params(const vlmoe_model *m) { return m->d_params ? m->d_params : m->params; }

// The gradients a backward writes: the master copy, zeroed unless accumulating, or the table's,
// holding the master copy's values when accumulating (uploaded: the sum so far is the host's).
static float *grads_begin(vlmoe_model *m, int accumulate) {
    if (!m->d_grads) {
        if (!accumulate) memset(m->grads, 0, sizeof(float) * m->L.total);
        return m->grads;
    }
    if (accumulate) m->be->upload(m->be, m->d_grads, m->grads, m->L.total);
    else m->be->zero(m->be, m->d_grads, m->L.total);
    return m->d_grads;
}

// After the backward: the table's gradients into the master copy.
static void grads_end(vlmoe_model *m) {
    if (!m->d_grads) return;
    m->be->download(m->be, m->grads, m->d_grads, m->L.total);
    m->be->sync(m->be);
}

// n floats of the table's memory as the host reads them: src itself on the host's memory, else
// downloaded into host.
static const float *host_view(const vlmoe_model *m, float *host, const float *src, size_t n) {
    if (m->be->host_memory) return src;
    m->be->download(m->be, host, src, n);
    m->be->sync(m->be);
    return host;
}

int vlmoe_mome_seq_len(const vlmoe_model_config *c, vlmoe_encoding enc) {
    const int g = c->image_size / c->patch_size, Ti = 1 + g * g;
    return enc == VLMOE_ENC_IMAGE ? Ti : enc == VLMOE_ENC_TEXT ? c->context_length : Ti + c->context_length;
}

int mome_layout_build(model_layout *L, const vlmoe_model_config *cfg) {
    L->cfg = *cfg;
    L->nenc = 1;
    const vlmoe_encoder_config *ec = &cfg->encoder;
    const int D = ec->width, M = ec->mlp_dim, nl = ec->layers;
    L->enc[0] = (encoder_layout){D, nl, ec->heads, M, NULL, 0, 0, &L->cfg.moe};
    L->enc[0].blocks = calloc((size_t)(nl ? nl : 1), sizeof(block_layout));
    L->mome = calloc(1, sizeof(mome_layout));
    mome_layout *X = L->mome;
    if (!L->enc[0].blocks || !X || !(X->ffn = calloc((size_t)(nl ? nl : 1) * MOME_NFFN, sizeof(mome_ffn))))
        return model_layout_free(L), vlmoe_fail(VLMOE_ERR_NOMEM, "layout");
    table_builder tb = {L, 0, 0};
    const int g = cfg->image_size / cfg->patch_size;
    X->np = g * g;
    X->pd = cfg->channels * cfg->patch_size * cfg->patch_size;
    X->Ti = 1 + X->np;
    X->Tt = cfg->context_length;
    modality_layout *mi = &L->mod[MOD_IMAGE], *mt = &L->mod[MOD_TEXT];
    *mi = (modality_layout){.seq = X->Ti, .has_cls = 1, .pool = VLMOE_POOL_CLS, .ln_pre_w = NO_PARAM,
                            .ln_pre_b = NO_PARAM, .proj = NO_PARAM};
    *mt = (modality_layout){.seq = X->Tt, .pool = VLMOE_POOL_CLS, .embed_b = NO_PARAM, .cls = NO_PARAM,
                            .ln_pre_w = NO_PARAM, .ln_pre_b = NO_PARAM, .proj = NO_PARAM};
    mi->embed_w = layout_add(&tb, "image.patch_embed.weight", 1, 2, D, X->pd, 0);
    mi->embed_b = cfg->patch_bias ? layout_add(&tb, "image.patch_embed.bias", 0, 1, D, 0, 0) : NO_PARAM;
    mi->cls = layout_add(&tb, "image.class_token", 0, 1, D, 0, 0); // [I_CLS]
    mi->pos = layout_add(&tb, "image.pos_embed", 0, 2, X->Ti, D, 0);
    X->mask_patch = layout_add(&tb, "image.mask_token", 0, 1, D, 0, 0);
    mt->embed_w = layout_add(&tb, "text.token_embed", 0, 2, cfg->vocab_size, D, 0);
    mt->pos = layout_add(&tb, "text.pos_embed", 0, 2, X->Tt, D, 0);
    static const char *const which[MOME_NFFN] = {"v_ffn", "t_ffn", "vl_ffn"};
    const vlmoe_moe_config *moe[MOME_NFFN] = {&L->cfg.moe, &L->cfg.text_moe, NULL};
    char n[128];
    for (int l = 0; l < nl; l++) {
        block_layout *b = &L->enc[0].blocks[l];
        snprintf(n, sizeof(n), "encoder.blocks.%d", l);
        layout_add_attention(&tb, b, D, n);
        b->ln2_w = b->ln2_b = NO_PARAM;
        for (int k = 0; k < MOME_NFFN; k++) {
            mome_ffn *f = &X->ffn[l * MOME_NFFN + k];
            f->ln_w = f->ln_b = NO_PARAM;
            if (k == MOME_VL && l < nl - cfg->vl_layers) continue; // VL-FFN: the top F blocks only
            snprintf(n, sizeof(n), "encoder.blocks.%d.%s.ln.weight", l, which[k]);
            f->ln_w = layout_add(&tb, n, 0, 1, D, 0, 0);
            snprintf(n, sizeof(n), "encoder.blocks.%d.%s.ln.bias", l, which[k]);
            f->ln_b = layout_add(&tb, n, 0, 1, D, 0, 0);
            snprintf(n, sizeof(n), "encoder.blocks.%d.%s", l, which[k]);
            layout_add_ffn(&tb, &f->ffn, moe[k], l, D, M, n);
            f->moe = f->ffn.kind == FFN_MOE ? moe[k] : NULL;
        }
    }
    L->enc[0].lnf_w = layout_add(&tb, "encoder.ln_final.weight", 0, 1, D, 0, 0);
    L->enc[0].lnf_b = layout_add(&tb, "encoder.ln_final.bias", 0, 1, D, 0, 0);
    X->mlm_w = layout_add(&tb, "mlm_head.weight", 1, 2, cfg->vocab_size, D, 0);
    X->mlm_b = layout_add(&tb, "mlm_head.bias", 0, 1, cfg->vocab_size, 0, 0);
    X->mim_w = layout_add(&tb, "mim_head.weight", 1, 2, cfg->mim_vocab, D, 0);
    X->mim_b = layout_add(&tb, "mim_head.bias", 0, 1, cfg->mim_vocab, 0, 0);
    X->cls_w = X->cls_b = NO_PARAM;
    X->cs = cfg->cls_sequences == 2 ? 2 : 1;
    if (cfg->num_classes > 0) {
        X->cls_w = layout_add(&tb, "cls_head.weight", 1, 2, cfg->num_classes, (int64_t)X->cs * D, 0);
        X->cls_b = layout_add(&tb, "cls_head.bias", 0, 1, cfg->num_classes, 0, 0);
    }
    X->itc_proj[0] = X->itc_proj[1] = L->logit_scale = NO_PARAM;
    if (cfg->retrieval_head) {
        X->itc_proj[0] = layout_add(&tb, "itc.image_proj.weight", 1, 2, cfg->embed_dim, D, 0);
        X->itc_proj[1] = layout_add(&tb, "itc.text_proj.weight", 1, 2, cfg->embed_dim, D, 0);
        L->logit_scale = layout_add(&tb, "logit_scale", 0, 0, 0, 0, 0);
    }
    X->itm_w = X->itm_b = NO_PARAM;
    if (cfg->itm_head) {
        X->itm_w = layout_add(&tb, "itm_head.weight", 1, 2, 2, D, 0);
        X->itm_b = layout_add(&tb, "itm_head.bias", 0, 1, 2, 0, 0);
    }
    if (!L->table || tb.off == 0) return model_layout_free(L), vlmoe_fail(VLMOE_ERR_NOMEM, "layout");
    for (int i = 0; i < L->nparams; i++)
        if (L->table[i].offset == NO_PARAM) return model_layout_free(L), vlmoe_fail(VLMOE_ERR_NOMEM, "layout");
    L->total = tb.off;
    return VLMOE_OK;
}

int mome_model_plan(vlmoe_model *m, int B) {
    if (m->mome->mg && m->planned_B == B) return VLMOE_OK;
    mome_graph_free_f32(m->mome->mg);
    m->mome->mg = NULL;
    m->have_forward = m->mome->have_itc = m->mome->have_itm = 0;
    int st = mome_graph_create_f32(&m->mome->mg, &m->L, m->be, B);
    if (st) return st;
    m->planned_B = B;
    return VLMOE_OK;
}

mome_graph_f32 *mome_model_graph(vlmoe_model *m) { return m->mome ? m->mome->mg : NULL; }

static int need_mome(const vlmoe_model *m, const char *what) {
    return m->L.mome ? VLMOE_OK
                     : vlmoe_fail(VLMOE_ERR_ARG, "%s: model '%s' is not a VL-MoE (arch mome) model", what,
                                  m->L.cfg.name);
}

int vlmoe_model_set_drop_path(vlmoe_model *m, double rate) {
    if (!m->L.mome)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "drop path: model '%s' is not a VL-MoE (arch mome) model; stochastic depth "
                          "is implemented for VL-MoE pre-training", m->L.cfg.name);
    if (!(rate >= 0 && rate < 1)) return vlmoe_fail(VLMOE_ERR_ARG, "drop path rate %g: expected a rate in [0, 1)", rate);
    m->mome->drop_path = rate;
    return VLMOE_OK;
}

// A training forward's mode: its seed (the model's seed and its forward count) and drop path.
static void training_mode(vlmoe_model *m, mome_graph_f32 *g, int training) {
    mome_graph_set_drop_path_f32(g, m->mome->drop_path);
    mome_graph_set_mode_f32(g, training, training ? m->seed * 0x9e3779b97f4a7c15ULL + m->forwards++ : 0);
}

// Data parallelism (model_set_dist; a training forward of process r of W, whose batch of B is
// sequences r*B.. of the one-process batch of W*B): the routing noise is keyed by the global
// sequence index, and each head divides its summed cross-entropy by the labelled positions of
// all processes over W (one all-reduce of the two counts), so that the gradients averaged over
// the processes are those of the one-process mean. Anything else: the forward's own mean.
static int data_parallel(vlmoe_model *m, const vlmoe_mome_batch *b, int training) {
    mome_graph_f32 *g = m->mome->mg;
    vlmoe_dist *d = training ? m->dist : NULL;
    mome_graph_set_sample_base_f32(g, d ? (uint64_t)d->rank * (uint64_t)b->batch_size : 0);
    mome_graph_set_norm_f32(g, 0, 0);
    if (!d) return VLMOE_OK;
    const vlmoe_model_config *c = &m->L.cfg;
    const size_t nt = (size_t)b->batch_size * (size_t)c->context_length, np = (size_t)b->batch_size * m->L.mome->np;
    int64_t n[2] = {0, 0}; // labelled text tokens, masked patches (what the graph's heads count)
    if (b->encoding != VLMOE_ENC_IMAGE && b->text_labels)
        for (size_t i = 0; i < nt; i++) n[0] += b->text_labels[i] >= 0;
    if (b->encoding != VLMOE_ENC_TEXT && b->patch_labels)
        for (size_t i = 0; i < np; i++) n[1] += b->patch_labels[i] >= 0;
    int st = d->allreduce_sum(d, n, 2, VLMOE_DIST_I64);
    if (st) return vlmoe_error_prefix("mome forward: counting the labelled positions of %d processes", d->world), st;
    mome_graph_set_norm_f32(g, (double)n[0] / d->world, (double)n[1] / d->world);
    return VLMOE_OK;
}

int vlmoe_mome_forward(vlmoe_model *m, const vlmoe_mome_batch *b, int training, vlmoe_mome_stats *s) {
    int st = need_mome(m, "mome forward");
    if (st) return st;
    if (!b || b->batch_size < 1) return vlmoe_fail(VLMOE_ERR_ARG, "mome forward: empty batch");
    if ((st = mome_model_plan(m, b->batch_size))) return st;
    mome_input_f32 in = {b->encoding, b->images, b->tokens, b->lengths, b->text_labels, b->patch_labels,
                         b->class_labels};
    if ((st = data_parallel(m, b, training))) return st;
    training_mode(m, m->mome->mg, training);
    m->have_forward = m->mome->have_itc = m->mome->have_itm = 0;
    vlmoe_mome_stats r;
    if ((st = mome_graph_forward_f32(m->mome->mg, model_params_for_graph(m), &in, &r))) return st;
    if (s) *s = r;
    if (!isfinite(r.loss)) return vlmoe_fail(VLMOE_ERR_NUMERIC, "the masked-modeling loss is %g", r.loss);
    m->have_forward = training;
    return VLMOE_OK;
}

int vlmoe_mome_backward(vlmoe_model *m, int accumulate) {
    if (!m->mome || !m->mome->mg || !m->have_forward)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome backward called without a training forward pass");
    mome_graph_backward_f32(m->mome->mg, fwd_params(m), grads_begin(m, accumulate));
    grads_end(m);
    m->have_forward = 0; // each forward's loss is back-propagated once
    return VLMOE_OK;
}

// The retrieval head's buffers for batches of B (once; again only if B changes).
static int itc_plan(vlmoe_model *m, int B) {
    if (m->mome->itc && m->mome->itc_B == B) return VLMOE_OK;
    mome_itc_free_f32(m->mome->itc);
    m->mome->itc = NULL;
    int st = mome_itc_create_f32(&m->mome->itc, &m->L, m->be, B);
    if (!st) m->mome->itc_B = B;
    return st;
}

enum { OUT_HIDDEN, OUT_LOGITS, OUT_EMBED, OUT_ITM };

// The ITM head's eval buffers for chunks of B pairs (once; again only if B changes).
static int itm_eval_plan(vlmoe_model *m, int B) {
    if (m->mome->itm_eval && m->mome->eval_B == B) return VLMOE_OK;
    mome_itm_free_f32(m->mome->itm_eval);
    m->mome->itm_eval = NULL;
    int st = mome_itm_create_f32(&m->mome->itm_eval, &m->L, m->be, B);
    if (!st) m->mome->eval_B = B;
    return st;
}

// ITM scores of the first k pairs of the last eval forward into out: logit(matched) -
// logit(unmatched). scratch: 2k floats where the table's memory is not the host's.
static void itm_eval_scores(vlmoe_model *m, const float *P, int k, float *scratch, float *out) {
    mome_itm_forward_f32(m->mome->itm_eval, m->mome->mg, P, NULL, NULL);
    const float *lg = host_view(m, scratch, mome_itm_logits_f32(m->mome->itm_eval), 2 * (size_t)k);
    for (int b = 0; b < k; b++) out[b] = lg[2 * b + 1] - lg[2 * b];
}

// Eval-mode forwards of n inputs in chunks of the planned batch size; writes per item either the
// final hidden states (seq_len, width), the retrieval embedding (embed_dim), or per example (cs
// items) the class scores (num_classes).
static int run_chunks(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                      const int32_t *lengths, int n, float *out, int kind) {
    static const char *what[] = {"mome encode", "mome logits", "mome embed", "mome ITM scores"};
    int st = need_mome(m, what[kind]);
    if (st) return st;
    const vlmoe_model_config *c = &m->L.cfg;
    const int cs = kind == OUT_LOGITS ? m->L.mome->cs : 1;
    if (kind == OUT_LOGITS && c->num_classes < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome logits: model '%s' has no classification head (num_classes = 0)", c->name);
    if (kind == OUT_EMBED && !c->retrieval_head)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome embed: model '%s' has no retrieval head (retrieval_head = 0)", c->name);
    if (kind == OUT_ITM && !c->itm_head)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome ITM scores: model '%s' has no image-text matching head (itm_head = 0)",
                          c->name);
    if (kind == OUT_EMBED && (enc == VLMOE_ENC_PAIR || enc == VLMOE_ENC_CAPTION))
        return vlmoe_fail(VLMOE_ERR_ARG, "mome embed: retrieval embeds images and texts separately, not pairs");
    if (enc < VLMOE_ENC_IMAGE || enc > VLMOE_ENC_CAPTION) return vlmoe_fail(VLMOE_ERR_ARG, "unknown encoding %d", (int)enc);
    if (n % cs)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome logits: the head takes %d sequences per example, %d is not a multiple",
                          cs, n);
    if (n < 1) return VLMOE_OK;
    if ((!m->mome->mg || m->planned_B % cs) && (st = mome_model_plan(m, n < 64 ? n : 64))) return st; // n % cs == 0
    const int B = m->planned_B, T = c->context_length, D = c->encoder.width;
    if (kind == OUT_EMBED && (st = itc_plan(m, B))) return st;
    if (kind == OUT_ITM && (st = itm_eval_plan(m, B))) return st;
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
    const size_t per = kind == OUT_LOGITS ? (size_t)c->num_classes
                     : kind == OUT_EMBED  ? (size_t)c->embed_dim
                     : kind == OUT_ITM    ? 1 : (size_t)vlmoe_mome_seq_len(c, enc) * D;
    const int img = enc != VLMOE_ENC_TEXT, txt = enc != VLMOE_ENC_IMAGE;
    // the last chunk is padded by repeating its final item, whose outputs are discarded
    float *pimg = img ? vlmoe_alloc(sizeof(float) * isz * B, "padded batch") : NULL;
    int32_t *ptok = txt ? vlmoe_alloc(sizeof(int32_t) * ((size_t)T + 1) * B, "padded batch") : NULL;
    const int scratch = kind == OUT_ITM && !m->be->host_memory; // the logits as the host reads them
    float *hs = scratch ? vlmoe_alloc(sizeof(float) * 2 * (size_t)B, "ITM logits") : NULL;
    if ((img && !pimg) || (txt && !ptok) || (scratch && !hs)) st = VLMOE_ERR_NOMEM;
    const float *P = model_params_for_graph(m); // uploaded once for every chunk
    mome_graph_set_mode_f32(m->mome->mg, 0, 0);
    for (int i0 = 0; i0 < n && !st; i0 += B) {
        const int k = n - i0 < B ? n - i0 : B;
        for (int j = 0; j < B; j++) {
            const size_t s = (size_t)i0 + (size_t)(j < k ? j : k - 1);
            if (img) memcpy(pimg + j * isz, images + s * isz, sizeof(float) * isz);
            if (txt) memcpy(ptok + (size_t)j * T, tokens + s * T, sizeof(int32_t) * T), ptok[(size_t)B * T + j] = lengths[s];
        }
        mome_input_f32 in = {enc, pimg, ptok, ptok ? ptok + (size_t)B * T : NULL, NULL, NULL, NULL};
        st = mome_graph_forward_f32(m->mome->mg, P, &in, NULL);
        if (st) break;
        float *o = out + (size_t)i0 / cs * per;
        if (kind == OUT_ITM) {
            itm_eval_scores(m, P, k, hs, o);
            continue;
        }
        const float *res = kind == OUT_LOGITS ? mome_graph_logits_f32(m->mome->mg)
                         : kind == OUT_EMBED ? mome_itc_embed_f32(m->mome->itc, m->mome->mg, P, enc == VLMOE_ENC_TEXT)
                         : mome_graph_hidden_f32(m->mome->mg, NULL);
        const size_t nout = per * (size_t)(k / cs);
        if (m->be->host_memory) {
            memcpy(o, res, sizeof(float) * nout);
        } else { // the outputs come back from the table's memory
            m->be->download(m->be, o, res, nout);
            m->be->sync(m->be);
        }
    }
    vlmoe_free_mem(pimg);
    vlmoe_free_mem(ptok);
    vlmoe_free_mem(hs);
    m->have_forward = m->mome->have_itc = m->mome->have_itm = 0;
    return st;
}

int vlmoe_mome_encode(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                      const int32_t *lengths, int n, float *out) {
    return run_chunks(m, enc, images, tokens, lengths, n, out, OUT_HIDDEN);
}

int vlmoe_mome_logits(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                      const int32_t *lengths, int n, float *out) {
    return run_chunks(m, enc, images, tokens, lengths, n, out, OUT_LOGITS);
}

int vlmoe_mome_embed(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                     const int32_t *lengths, int n, float *out) {
    return run_chunks(m, enc, images, tokens, lengths, n, out, OUT_EMBED);
}

int vlmoe_mome_forward_retrieval(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths,
                                 int B, int training, vlmoe_mome_stats *s) {
    int st = need_mome(m, "mome retrieval");
    if (st) return st;
    if (!m->L.cfg.retrieval_head)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome retrieval: model '%s' has no retrieval head (retrieval_head = 0)",
                          m->L.cfg.name);
    if (B < 2) return vlmoe_fail(VLMOE_ERR_ARG, "mome retrieval: the contrastive loss needs >= 2 pairs, got %d", B);
    if (!images || !tokens || !lengths)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome retrieval: needs B images and their B texts");
    if ((st = mome_model_plan(m, B)) || (st = itc_plan(m, B))) return st;
    if (!m->mome->mg_text || m->mome->text_B != B) {
        mome_graph_free_f32(m->mome->mg_text);
        m->mome->mg_text = NULL;
        if ((st = mome_graph_create_f32(&m->mome->mg_text, &m->L, m->be, B))) return st;
        m->mome->text_B = B;
    }
    m->have_forward = m->mome->have_itc = m->mome->have_itm = 0;
    const mome_input_f32 ii = {VLMOE_ENC_IMAGE, images, NULL, NULL, NULL, NULL, NULL},
                         it = {VLMOE_ENC_TEXT, NULL, tokens, lengths, NULL, NULL, NULL};
    vlmoe_mome_stats ri, rt;
    struct mome_graph_f32 *g[2] = {m->mome->mg, m->mome->mg_text};
    const mome_input_f32 *in[2] = {&ii, &it};
    vlmoe_mome_stats *r[2] = {&ri, &rt};
    const float *P = model_params_for_graph(m);
    for (int k = 0; k < 2; k++) {
        training_mode(m, g[k], training);
        if ((st = mome_graph_forward_f32(g[k], P, in[k], r[k]))) return st;
    }
    vlmoe_mome_stats res;
    memset(&res, 0, sizeof(res));
    res.itc = mome_itc_forward_f32(m->mome->itc, m->mome->mg, m->mome->mg_text, P, res.itc_acc);
    res.aux = ri.aux + rt.aux;
    res.loss = res.itc + res.aux;
    if (s) *s = res;
    if (!isfinite(res.loss)) return vlmoe_fail(VLMOE_ERR_NUMERIC, "the retrieval loss is %g", res.loss);
    m->mome->have_itc = training;
    return VLMOE_OK;
}

int vlmoe_mome_backward_retrieval(vlmoe_model *m, int accumulate) {
    if (!m->mome || !m->mome->have_itc || !m->mome->itc || !m->mome->mg_text || m->mome->itc_B != m->planned_B)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome retrieval backward called without a training retrieval forward");
    float *G = grads_begin(m, accumulate);
    mome_itc_backward_f32(m->mome->itc, m->mome->mg, m->mome->mg_text, fwd_params(m), G);
    if (m->mome->have_itm) mome_itm_backward_f32(m->mome->itm, m->mome->mg_pair, fwd_params(m), G);
    grads_end(m);
    m->mome->have_itc = m->mome->have_itm = 0;
    return VLMOE_OK;
}

// The ITM step's pair graph and head for 3B pairs, and their inputs (once; again if B changes).
static int itm_plan(vlmoe_model *m, int B) {
    struct mome_model *X = m->mome;
    if (X->mg_pair && X->pair_B == B) return VLMOE_OK;
    mome_graph_free_f32(X->mg_pair);
    mome_itm_free_f32(X->itm);
    vlmoe_free_mem(X->pimg), vlmoe_free_mem(X->sim), vlmoe_free_mem(X->ptok);
    vlmoe_free_mem(X->plen), vlmoe_free_mem(X->plab), vlmoe_free_mem(X->neg), vlmoe_free_mem(X->emb_h);
    X->mg_pair = NULL, X->itm = NULL, X->pimg = X->sim = X->emb_h = NULL, X->ptok = X->plen = X->plab = X->neg = NULL;
    X->pair_B = 0;
    const vlmoe_model_config *c = &m->L.cfg;
    const size_t n = 3 * (size_t)B, isz = (size_t)c->channels * c->image_size * c->image_size;
    int st = mome_graph_create_f32(&X->mg_pair, &m->L, m->be, 3 * B);
    if (!st) st = mome_itm_create_f32(&X->itm, &m->L, m->be, 3 * B);
    if (st) return st;
    X->pimg = vlmoe_alloc(sizeof(float) * isz * n, "ITM pairs");
    X->sim = vlmoe_alloc(sizeof(float) * (size_t)B * B, "ITM similarities");
    X->ptok = vlmoe_alloc(sizeof(int32_t) * (size_t)c->context_length * n, "ITM pairs");
    X->plen = vlmoe_alloc(sizeof(int32_t) * n, "ITM pairs");
    X->plab = vlmoe_alloc(sizeof(int32_t) * n, "ITM pairs");
    X->neg = vlmoe_alloc(sizeof(int32_t) * 2 * (size_t)B, "ITM negatives");
    X->emb_h = vlmoe_alloc(sizeof(float) * 2 * (size_t)B * c->embed_dim, "ITM mining embeddings");
    if (!X->pimg || !X->sim || !X->ptok || !X->plen || !X->plab || !X->neg || !X->emb_h) return VLMOE_ERR_NOMEM;
    X->pair_B = B;
    return VLMOE_OK;
}

// Pair r of the ITM batch: image `img` of b with text `txt` of b, labelled `lab`.
static void put_pair(struct mome_model *X, const vlmoe_mome_batch *b, size_t isz, int T, int r, int img, int txt,
                     int lab) {
    memcpy(X->pimg + isz * r, b->images + isz * img, sizeof(float) * isz);
    memcpy(X->ptok + (size_t)T * r, b->tokens + (size_t)T * txt, sizeof(int32_t) * T);
    X->plen[r] = b->lengths[txt], X->plab[r] = lab;
}

int vlmoe_mome_forward_retrieval_itm(vlmoe_model *m, const vlmoe_mome_batch *b, uint64_t key, int training,
                                     vlmoe_mome_stats *s) {
    int st = need_mome(m, "mome retrieval ITM");
    if (st) return st;
    const vlmoe_model_config *c = &m->L.cfg;
    if (!c->itm_head)
        return vlmoe_fail(VLMOE_ERR_ARG, "mome retrieval ITM: model '%s' has no image-text matching head (itm_head = "
                          "0): fine-tune one with `vlmoe finetune --task retrieval --itm`", c->name);
    if (!b) return vlmoe_fail(VLMOE_ERR_ARG, "mome retrieval ITM: no batch");
    const int B = b->batch_size, T = c->context_length, E = c->embed_dim;
    vlmoe_mome_stats r;
    if ((st = vlmoe_mome_forward_retrieval(m, b->images, b->tokens, b->lengths, B, training, &r))) return st;
    const int have_itc = m->mome->have_itc;
    struct mome_model *X = m->mome;
    if ((st = itm_plan(m, B))) return m->mome->have_itc = 0, st;
    // the mining similarities: a copy of the contrastive logits, exp(logit_scale) * img . txt
    const size_t ne = (size_t)B * E;
    const float *ie = host_view(m, X->emb_h, mome_itc_embedding_f32(X->itc, 0), ne),
                *te = host_view(m, X->emb_h + ne, mome_itc_embedding_f32(X->itc, 1), ne);
    const double t = exp((double)m->params[m->L.logit_scale]);
    for (int i = 0; i < B; i++)
        for (int j = 0; j < B; j++) {
            double d = 0;
            for (int e = 0; e < E; e++) d += (double)ie[(size_t)i * E + e] * te[(size_t)j * E + e];
            X->sim[(size_t)i * B + j] = (float)(t * d);
        }
    int32_t *neg_text = X->neg, *neg_image = X->neg + B;
    if ((st = vlmoe_itm_mine(X->sim, B, key, NULL, NULL, neg_text, neg_image))) return m->mome->have_itc = 0, st;
    // VLMo's order: the true pairs, (negative image, text j), (image i, negative text)
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
    for (int i = 0; i < B; i++) {
        put_pair(X, b, isz, T, i, i, i, 1);
        put_pair(X, b, isz, T, B + i, neg_image[i], i, 0);
        put_pair(X, b, isz, T, 2 * B + i, i, neg_text[i], 0);
    }
    const mome_input_f32 in = {VLMOE_ENC_PAIR, X->pimg, X->ptok, X->plen, NULL, NULL, NULL};
    vlmoe_mome_stats rp;
    training_mode(m, X->mg_pair, training);
    mome_graph_set_sample_base_f32(X->mg_pair, 0);
    mome_graph_set_norm_f32(X->mg_pair, 0, 0);
    if ((st = mome_graph_forward_f32(X->mg_pair, fwd_params(m), &in, &rp))) return m->mome->have_itc = 0, st;
    r.itm = mome_itm_forward_f32(X->itm, X->mg_pair, fwd_params(m), X->plab, &r.itm_acc);
    r.aux += rp.aux;
    r.loss = r.itc + r.itm + r.aux;
    if (s) *s = r;
    if (!isfinite(r.loss)) return m->mome->have_itc = 0, vlmoe_fail(VLMOE_ERR_NUMERIC, "the retrieval + ITM loss is %g", r.loss);
    X->have_itm = have_itc;
    return VLMOE_OK;
}

int vlmoe_mome_itm_scores(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths, int n,
                          float *out) {
    if (n > 0 && (!images || !tokens || !lengths || !out))
        return vlmoe_fail(VLMOE_ERR_ARG, "mome ITM scores: needs n images, their texts and lengths, and room for n scores");
    return run_chunks(m, VLMOE_ENC_PAIR, images, tokens, lengths, n, out, OUT_ITM);
}

int vlmoe_mome_with_itm(vlmoe_model **out, const vlmoe_model *m, uint64_t seed) {
    return with_config(out, m, 0, 0, 1, 1, seed);
}

int vlmoe_mome_with_head(vlmoe_model **out, const vlmoe_model *m, int num_classes, uint64_t seed) {
    return vlmoe_mome_with_heads(out, m, num_classes, 1, 0, seed);
}

int vlmoe_mome_with_heads(vlmoe_model **out, const vlmoe_model *m, int num_classes, int cls_sequences,
                          int retrieval_head, uint64_t seed) {
    return with_config(out, m, num_classes, cls_sequences, retrieval_head, 0, seed);
}

static int with_config(vlmoe_model **out, const vlmoe_model *m, int num_classes, int cls_sequences,
                       int retrieval_head, int itm_head, uint64_t seed) {
    *out = NULL;
    int st = need_mome(m, "mome head");
    if (st) return st;
    vlmoe_model_config c = m->L.cfg;
    c.num_classes = num_classes;
    c.cls_sequences = num_classes ? cls_sequences : 0;
    c.retrieval_head = retrieval_head;
    c.itm_head = itm_head;
    vlmoe_model *h;
    if ((st = vlmoe_model_init(&h, &c, seed))) return st; // validates num_classes
    if ((st = model_copy_inputs(h, m))) return vlmoe_model_free(h), st;
    // every tensor but the head has the same name and shape in both tables
    for (int i = 0; i < h->L.nparams; i++) {
        const vlmoe_param_info *p = &h->L.table[i];
        if (!strncmp(p->name, "cls_head.", 9) || !strncmp(p->name, "itc.", 4) || !strcmp(p->name, "logit_scale") ||
            !strncmp(p->name, "itm_head.", 9))
            continue; // the fresh heads
        for (int j = 0; j < m->L.nparams; j++)
            if (!strcmp(m->L.table[j].name, p->name)) {
                memcpy(h->params + p->offset, m->params + m->L.table[j].offset, sizeof(float) * p->numel);
                model_weights_changed(h);
                break;
            }
    }
    vlmoe_model_set_rng(h, (const uint64_t[2]){m->seed, m->forwards});
    if (m->mome->codebook && (st = vlmoe_mome_set_codebook(h, m->mome->codebook, c.mim_vocab, m->L.mome->pd)))
        return vlmoe_model_free(h), st;
    *out = h;
    return VLMOE_OK;
}

int vlmoe_mome_set_codebook(vlmoe_model *m, const float *centroids, int K, int dim) {
    int st = need_mome(m, "mome codebook");
    if (st) return st;
    if (centroids && (K != m->L.cfg.mim_vocab || dim != m->L.mome->pd))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "the codebook is %d x %d, model '%s' needs %d visual tokens (mim_vocab) of "
                          "%d values (channels x patch_size^2)", K, dim, m->L.cfg.name, m->L.cfg.mim_vocab, m->L.mome->pd);
    float *c = centroids ? vlmoe_alloc(sizeof(float) * (size_t)K * dim, "codebook") : NULL;
    if (centroids && !c) return VLMOE_ERR_NOMEM;
    if (c) memcpy(c, centroids, sizeof(float) * (size_t)K * dim);
    vlmoe_free_mem(m->mome->codebook);
    m->mome->codebook = c;
    return VLMOE_OK;
}

const float *vlmoe_mome_codebook(const vlmoe_model *m) { return m->mome ? m->mome->codebook : NULL; }

int vlmoe_patchify(const vlmoe_model_config *c, const float *images, int B, float *patches) {
    if (B < 1 || c->channels < 1 || c->patch_size < 1 || c->image_size % c->patch_size)
        return vlmoe_fail(VLMOE_ERR_ARG, "patchify: %d images of %d px in patches of %d", B, c->image_size,
                          c->patch_size);
    patchify_forward_f32(patches, images, B, c->channels, c->image_size, c->patch_size);
    return VLMOE_OK;
}

// ---- the model object's entry points for arch mome (model_arch, src/nn/model.h)

static void arch_layout_free(model_layout *L) {
    if (L->mome) free(L->mome->ffn);
    free(L->mome);
    L->mome = NULL;
}

static int arch_init(vlmoe_model *m) {
    m->mome = vlmoe_calloc(sizeof(*m->mome), "VL-MoE model state");
    return m->mome ? VLMOE_OK : VLMOE_ERR_NOMEM;
}

// The graphs and heads hold the old table's memory; the codebook and drop path stay (a model moved
// by --device or --precision plans again at its next forward).
static void arch_drop_graphs(vlmoe_model *m) {
    struct mome_model *X = m->mome;
    if (!X) return;
    mome_graph_free_f32(X->mg);
    mome_graph_free_f32(X->mg_text);
    mome_itc_free_f32(X->itc);
    mome_graph_free_f32(X->mg_pair);
    mome_itm_free_f32(X->itm);
    mome_itm_free_f32(X->itm_eval);
    X->mg = X->mg_text = X->mg_pair = NULL, X->itc = NULL, X->itm = X->itm_eval = NULL;
    X->itc_B = X->text_B = X->pair_B = X->eval_B = 0;
    X->have_itc = X->have_itm = 0;
}

static void arch_free(vlmoe_model *m) {
    if (!m->mome) return;
    arch_drop_graphs(m);
    vlmoe_free_mem(m->mome->pimg), vlmoe_free_mem(m->mome->sim), vlmoe_free_mem(m->mome->ptok);
    vlmoe_free_mem(m->mome->plen), vlmoe_free_mem(m->mome->plab), vlmoe_free_mem(m->mome->neg);
    vlmoe_free_mem(m->mome->emb_h);
    vlmoe_free_mem(m->mome->codebook);
    vlmoe_free_mem(m->mome);
    m->mome = NULL;
}

// A mome model has no contrastive head: its losses are the masked-modeling ones (vlmoe_mome_*).
// A VL-MoE model takes the contrastive entry points only through its retrieval head.
static int need_retrieval(const vlmoe_model *m, const char *what) {
    return !m->L.cfg.retrieval_head
               ? vlmoe_fail(VLMOE_ERR_ARG, "%s: model '%s' is a VL-MoE (arch mome) model without a retrieval head: "
                            "fine-tune one with `vlmoe finetune --task retrieval`, or use vlmoe_mome_encode", what,
                            m->L.cfg.name)
               : VLMOE_OK;
}

static int arch_forward(vlmoe_model *m, const vlmoe_batch *b, vlmoe_step_stats *stats, int training) {
    if (need_retrieval(m, "contrastive forward")) return VLMOE_ERR_ARG;
    if (!b->images || !b->tokens || !b->lengths)
        return vlmoe_fail(VLMOE_ERR_ARG, "forward needs images, tokens and lengths");
    vlmoe_mome_stats r;
    int st = vlmoe_mome_forward_retrieval(m, b->images, b->tokens, b->lengths, b->batch_size, training, &r);
    if (!st && stats) {
        memset(stats, 0, sizeof(*stats));
        stats->contrastive = r.itc, stats->aux = r.aux, stats->loss = r.loss;
        stats->acc_i2t = r.itc_acc[0], stats->acc_t2i = r.itc_acc[1];
        stats->temperature = exp(m->params[m->L.logit_scale]);
    }
    return st;
}

static int arch_backward(vlmoe_model *m) { return vlmoe_mome_backward_retrieval(m, 0); }

static int arch_encode(vlmoe_model *m, int modality, const float *images, const int32_t *tokens, const int32_t *lens,
                       int n, float *out) {
    if (need_retrieval(m, modality == MOD_IMAGE ? "encode images" : "encode texts")) return VLMOE_ERR_ARG;
    return vlmoe_mome_embed(m, modality == MOD_IMAGE ? VLMOE_ENC_IMAGE : VLMOE_ENC_TEXT, images, tokens, lens, n, out);
}

static const vlmoe_moe_stats *arch_moe_stats(const vlmoe_model *m, int *count) {
    if (m->mome->mg) return mome_graph_moe_stats_f32(m->mome->mg, count);
    if (count) *count = 0;
    return NULL;
}

static const struct moe_state_f32 *arch_moe_layer(const vlmoe_model *m, int index) {
    return m->mome->mg ? mome_graph_moe_layer_f32(m->mome->mg, index) : NULL;
}

// A VL-MoE model file carries its MIM codebook, when it has one.
static int arch_save(const vlmoe_model *m, vlmoe_st_writer *w) {
    return m->mome->codebook ? codebook_add(w, m->mome->codebook, m->L.cfg.mim_vocab, m->L.mome->pd) : VLMOE_OK;
}

static int arch_load(vlmoe_model *m, const vlmoe_st *f, const char *path) {
    if (!codebook_present(f)) return VLMOE_OK;
    int K, dim;
    return vlmoe_codebook_load(path, m->L.cfg.mim_vocab, m->L.mome->pd, &m->mome->codebook, &K, &dim);
}

const model_arch model_arch_mome = {
    .name = "mome",
    .layout_build = mome_layout_build,
    .layout_free = arch_layout_free,
    .init = arch_init,
    .free = arch_free,
    .drop_graphs = arch_drop_graphs,
    .plan = mome_model_plan,
    .forward = arch_forward,
    .backward = arch_backward,
    .encode = arch_encode,
    .moe_stats = arch_moe_stats,
    .moe_layer = arch_moe_layer,
    .save = arch_save,
    .load = arch_load,
};
