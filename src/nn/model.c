// model.c: the model object: the parameter table (one flat float buffer of named views, with
// gradients mirroring it) and its builders, seeded initialisation, finite checks, averaging, and
// safetensors save/load with the config in the metadata. The forward/backward, encoder and
// routing-statistics entry points go through the architecture's table (model_arch, chosen in
// model_layout_build): src/nn/towers_model.c or src/nn/mome_model.c. Covered by tests/test_model.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "moe/layer.h"
#include "nn/model.h"
#include "ops/gemm_bf16.h"

#define CONFIG_KEY "vlmoe.config"

size_t layout_add(table_builder *tb, const char *name, int decay, int ndim, int64_t d0, int64_t d1,
                  int64_t d2) {
    model_layout *L = tb->L;
    if (L->nparams == tb->cap) {
        int cap = tb->cap ? 2 * tb->cap : 64;
        vlmoe_param_info *t = realloc(L->table, sizeof(*t) * (size_t)cap);
        if (!t) return NO_PARAM;
        L->table = t;
        tb->cap = cap;
    }
    vlmoe_param_info *p = &L->table[L->nparams++];
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->shape[2] = d2;
    p->numel = ndim == 0 ? 1 : ndim == 1 ? (size_t)d0 : ndim == 2 ? (size_t)d0 * (size_t)d1
                                                                 : (size_t)d0 * (size_t)d1 * (size_t)d2;
    p->offset = tb->off;
    p->decay = decay;
    tb->off += p->numel;
    return p->offset;
}

static size_t add(table_builder *tb, const char *name, int decay, int ndim, int64_t d0, int64_t d1) {
    return layout_add(tb, name, decay, ndim, d0, d1, 0);
}

// An expert bank (X, d1[, d2]): held whole, or as the layout's shard of its experts (its shape
// stays the whole bank's, numel and the buffer shrink to X/size experts). Sets bit k of *split
// when split; split NULL: held whole.
static size_t add_bank(table_builder *tb, const char *name, int decay, int ndim, int64_t X, int64_t d1, int64_t d2,
                       unsigned *split, int k) {
    const model_shard *sh = &tb->L->shard;
    const size_t off = layout_add(tb, name, decay, ndim, X, d1, d2);
    if (off == NO_PARAM || sh->size < 2 || !split) return off;
    vlmoe_param_info *p = &tb->L->table[tb->L->nparams - 1];
    if (sh->keep_whole && sh->keep_whole(sh->user, p)) return off;
    const size_t per = p->numel / (size_t)X;
    p->experts_local = (int)(X / sh->size);
    p->expert0 = sh->rank * p->experts_local;
    p->numel = per * (size_t)p->experts_local;
    tb->off = p->offset + p->numel;
    tb->L->nsplit++;
    *split |= 1u << k;
    return off;
}

// The feed-forward of block l: a dense MLP, or an MoE layer whose experts are stored stacked
// (E, ...) so a checkpoint does not depend on how experts are split over processes.
void layout_add_ffn(table_builder *tb, ffn_layout *f, const vlmoe_moe_config *mc, int l, int D, int M,
                    const char *prefix) {
    char n[160];
#define NAME(s) (snprintf(n, sizeof(n), "%s.%s", prefix, s), n)
    f->router_w = f->phi = f->scale = NO_PARAM;
    if (!mc || mc->router == VLMOE_ROUTER_NONE || !(l < 64 && (mc->layers >> l & 1))) {
        f->kind = FFN_MLP;
        f->fc1_w = add(tb, NAME("mlp.fc1.weight"), 1, 2, M, D);
        f->fc1_b = add(tb, NAME("mlp.fc1.bias"), 0, 1, M, 0);
        f->fc2_w = add(tb, NAME("mlp.fc2.weight"), 1, 2, D, M);
        f->fc2_b = add(tb, NAME("mlp.fc2.bias"), 0, 1, D, 0);
        return;
    }
    const int X = mc->num_experts;
    f->kind = FFN_MOE;
    f->moe_index = tb->L->nmoe++;
    if (mc->router == VLMOE_ROUTER_SOFT) {
        int P = moe_slots_per_expert(mc);
        f->phi = layout_add(tb, NAME("moe.soft.phi"), 1, 3, D, X, P < 1 ? 1 : P);
        f->scale = add(tb, NAME("moe.soft.scale"), 0, 0, 0, 0);
    } else if (mc->router_per_modality) {
        // LIMoE E.3: the image router (E,D), then the text router (E,D); a name of its own so a
        // checkpoint of one kind never loads into the other
        f->router_w = layout_add(tb, NAME("moe.router.per_modality.weight"), 1, 3, 2, X, D);
    } else {
        f->router_w = add(tb, NAME("moe.router.weight"), 1, 2, X, D);
    }
    // the experts' banks: a shard of them under expert parallelism (model_shard); Soft MoE mixes
    // every token into every slot, so its experts are never split
    f->split = 0;
    unsigned *sp = mc->router == VLMOE_ROUTER_SOFT ? NULL : &f->split;
    f->fc1_w = add_bank(tb, NAME("moe.experts.fc1.weight"), 1, 3, X, M, D, sp, 0);
    f->fc1_b = add_bank(tb, NAME("moe.experts.fc1.bias"), 0, 2, X, M, 0, sp, 1);
    f->fc2_w = add_bank(tb, NAME("moe.experts.fc2.weight"), 1, 3, X, D, M, sp, 2);
    f->fc2_b = add_bank(tb, NAME("moe.experts.fc2.bias"), 0, 2, X, D, 0, sp, 3);
#undef NAME
}

int model_expert_banks(const vlmoe_model *m, model_bank *out, int cap) {
    const model_layout *L = &m->L;
    int n = 0;
    for (int e = 0; e < L->nenc && L->arch == &model_arch_towers; e++) {
        const encoder_layout *en = &L->enc[e];
        if (!en->moe || en->moe->router == VLMOE_ROUTER_SOFT) continue;
        const int E = en->moe->num_experts;
        for (int l = 0; l < en->layers; l++) {
            const ffn_layout *f = &en->blocks[l].ffn;
            if (f->kind != FFN_MOE) continue;
            const size_t M = (size_t)en->mlp, D = (size_t)en->width;
            const size_t off[4] = {f->fc1_w, f->fc1_b, f->fc2_w, f->fc2_b}, per[4] = {M * D, M, D * M, D};
            const int El = E / (L->shard.size > 0 ? L->shard.size : 1);
            for (int k = 0; k < 4; k++, n++) {
                const int split = f->split >> k & 1;
                if (n < cap)
                    out[n] = (model_bank){.offset = off[k], .per = per[k], .E = E, .e0 = split ? L->shard.rank * El : 0,
                                          .El = split ? El : E};
            }
        }
    }
    return n;
}

void layout_add_attention(table_builder *tb, block_layout *b, int D, const char *prefix) {
    char n[160];
#define NAME(s) (snprintf(n, sizeof(n), "%s.%s", prefix, s), n)
    b->ln1_w = add(tb, NAME("ln1.weight"), 0, 1, D, 0);
    b->ln1_b = add(tb, NAME("ln1.bias"), 0, 1, D, 0);
    b->qkv_w = add(tb, NAME("attn.qkv.weight"), 1, 2, 3 * D, D);
    b->qkv_b = add(tb, NAME("attn.qkv.bias"), 0, 1, 3 * D, 0);
    b->out_w = add(tb, NAME("attn.out.weight"), 1, 2, D, D);
    b->out_b = add(tb, NAME("attn.out.bias"), 0, 1, D, 0);
#undef NAME
}

int model_layout_build(model_layout *L, const vlmoe_model_config *cfg) {
    return model_layout_build_shard(L, cfg, NULL);
}

int model_layout_build_shard(model_layout *L, const vlmoe_model_config *cfg, const model_shard *sh) {
    memset(L, 0, sizeof(*L));
    L->shard = sh ? *sh : (model_shard){.rank = 0, .size = 1};
    int st = vlmoe_config_validate(cfg);
    if (st) return st;
    const int N = L->shard.size;
    if (N < 1 || L->shard.rank < 0 || L->shard.rank >= N)
        return vlmoe_fail(VLMOE_ERR_ARG, "model '%s': expert shard %d of %d", cfg->name, L->shard.rank, N);
    if (N > 1 && cfg->arch == VLMOE_ARCH_MOME)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': VL-MoE (arch mome) layers are not split over processes",
                          cfg->name);
    const vlmoe_moe_config *mc[2] = {&cfg->moe, &cfg->text_moe};
    for (int k = 0; k < (cfg->arch == VLMOE_ARCH_TWO_TOWER ? 2 : 1) && N > 1; k++)
        if (mc[k]->router != VLMOE_ROUTER_NONE && mc[k]->router != VLMOE_ROUTER_SOFT && mc[k]->num_experts % N)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': %d experts do not split over %d processes (the process "
                              "count must divide num_experts)", cfg->name, mc[k]->num_experts, N);
    // the one place the architecture is chosen: everything after goes through L->arch
    L->arch = cfg->arch == VLMOE_ARCH_MOME ? &model_arch_mome : &model_arch_towers;
    return L->arch->layout_build(L, cfg);
}

void model_layout_free(model_layout *L) {
    for (int e = 0; e < 2; e++) free(L->enc[e].blocks);
    if (L->arch && L->arch->layout_free) L->arch->layout_free(L);
    free(L->table);
    memset(L, 0, sizeof(*L));
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

// BEiT's initialisation (Bao et al. 2022, sec. 2.5), which VL-MoE uses ("We randomly initialize
// the model parameters using the method described in BEiT"): every weight matrix, embedding and
// token is drawn from N(0, 0.02) (BEiT's code calls timm's trunc_normal_ with std 0.02 and its
// default bounds of +-2, a hundred standard deviations away: a plain normal); then the output matrix of
// each sub-layer of block l (1-based: the attention's output projection and the second linear of
// every FFN or expert in it) is divided by sqrt(2l). The patch embedding keeps its LeCun normal
// (BEiT leaves its convolution to PyTorch's default) and the routers their N(0, 0.02).
static int beit_init(const vlmoe_param_info *p, float *w, vlmoe_rng *r) {
    int block = -1, off = 0;
    if (strstr(p->name, "patch_embed") || strstr(p->name, "router")) return 0;
    for (size_t k = 0; k < p->numel; k++) w[k] = (float)(0.02 * vlmoe_rng_normal(r));
    if (sscanf(p->name, "encoder.blocks.%d.%n", &block, &off) == 1 && off > 0 &&
        (ends_with(p->name, "attn.out.weight") || ends_with(p->name, "fc2.weight"))) {
        const float s = (float)(1.0 / sqrt(2.0 * (block + 1)));
        for (size_t k = 0; k < p->numel; k++) w[k] *= s;
    }
    return 1;
}

// ViT/CLIP-style init: LayerNorm (1, 0), biases 0, matrices Xavier-uniform (qkv as three square
// blocks), patch embedding LeCun-normal, embeddings N(0, 0.02), projections N(0, width^-1/2),
// logit_scale = log(init_temperature); a config with beit_init takes BEiT's (the VL-MoE paper
// sizes do; the tiny VL-MoE models keep this one, under which they learn in the tests' few steps). Each
// tensor draws from its own seeded stream so adding a tensor does not change the others; a split
// expert bank draws the whole bank's stream into a scratch and keeps its experts' slice.
int model_layout_init_params(const model_layout *L, float *params, uint64_t seed) {
    for (int i = 0; i < L->nparams; i++) {
        vlmoe_param_info whole = L->table[i];
        const vlmoe_param_info *p = &whole;
        float *w = params + p->offset, *bank = NULL;
        if (p->experts_local) {
            whole.numel = p->numel / (size_t)p->experts_local * (size_t)p->shape[0];
            if (!(bank = w = vlmoe_alloc(sizeof(float) * whole.numel, "an expert bank's initial values")))
                return VLMOE_ERR_NOMEM;
        }
        vlmoe_rng r;
        vlmoe_rng_seed(&r, seed * 1000003ULL + (uint64_t)i);
        if (!strcmp(p->name, "logit_scale")) {
            w[0] = (float)log(L->cfg.init_temperature);
        } else if (ends_with(p->name, "soft.scale")) {
            w[0] = 1; // Soft MoE's learned scale starts at 1 (MOE.md)
        } else if (ends_with(p->name, "ln1.weight") || ends_with(p->name, "ln2.weight") ||
                   ends_with(p->name, "ffn.ln.weight") ||
                   strstr(p->name, "ln_final.weight") || strstr(p->name, "ln_pre.weight")) {
            for (size_t k = 0; k < p->numel; k++) w[k] = 1;
        } else if (ends_with(p->name, ".bias")) {
            memset(w, 0, sizeof(float) * p->numel);
        } else if (L->cfg.beit_init && beit_init(p, w, &r)) {
            // drawn
        } else {
            double std;
            int xavier = 0;
            if (strstr(p->name, "patch_embed") || ends_with(p->name, ".proj") || strstr(p->name, "soft.phi"))
                std = 1.0 / sqrt((double)(p->ndim == 3 ? p->shape[0] : p->shape[1])); // LeCun normal
            else if (strstr(p->name, "router")) std = 0.02;
            else if (p->decay) xavier = 1, std = 0;
            else std = 0.02;
            // fan-out x fan-in of one matrix: (out, in), or (E, out, in) for stacked experts
            int64_t rows = p->ndim == 3 ? p->shape[1] : p->ndim == 2 ? p->shape[0] : 1;
            int64_t cols = p->ndim == 3 ? p->shape[2] : p->ndim == 2 ? p->shape[1] : (int64_t)p->numel;
            if (xavier && strstr(p->name, "qkv")) rows /= 3; // three (D, D) blocks
            double lim = sqrt(6.0 / (double)(rows + cols));
            for (size_t k = 0; k < p->numel; k++)
                w[k] = xavier ? (float)((2 * vlmoe_rng_uniform(&r) - 1) * lim) : (float)(std * vlmoe_rng_normal(&r));
        }
        if (bank) {
            const size_t per = whole.numel / (size_t)p->shape[0];
            memcpy(params + p->offset, bank + (size_t)p->expert0 * per, sizeof(float) * L->table[i].numel);
            vlmoe_free_mem(bank);
        }
    }
    return VLMOE_OK;
}

// The floats of table entry p (of its layout), an expert bank held whole or split, that hold
// experts [a, b) of it: [*first, *first + *n) of p's own floats.
static void held_range(const vlmoe_param_info *p, int a, int b, size_t *first, size_t *n) {
    const int e0 = p->experts_local ? p->expert0 : 0, held = p->experts_local ? p->experts_local : (int)p->shape[0];
    const size_t per = p->numel / (size_t)held;
    *first = (size_t)(a - e0) * per, *n = (size_t)(b - a) * per;
}

int model_reshard(vlmoe_model *m, const model_shard *sh) {
    if (m->L.arch != &model_arch_towers || m->d_params || m->int8)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': only a one_tower or two_tower model on the host's memory "
                          "splits its experts over processes", m->L.cfg.name);
    model_layout L;
    int st = model_layout_build_shard(&L, &m->L.cfg, sh);
    if (st) return st;
    // the gradients are not carried over: their memory goes back before the new parameters take
    // theirs (zero pages in their place until then)
    float *fresh = calloc(m->L.total ? m->L.total : 1, sizeof(float));
    if (fresh) vlmoe_free_mem(m->grads), m->grads = fresh;
    float *params = vlmoe_calloc(sizeof(float) * L.total, "parameters");
    // calloc's zero pages, mapped only when written: rank 0 made whole to write a checkpoint never
    // runs a backward, and its whole gradients cost no memory
    float *grads = params ? calloc(L.total ? L.total : 1, sizeof(float)) : NULL;
    if (params && !grads) vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu floats for the gradients", L.total);
    if (!grads) return vlmoe_free_mem(params), model_layout_free(&L), VLMOE_ERR_NOMEM;
    // the same tensors in the same order: copy the experts both layouts hold
    for (int i = 0; i < L.nparams; i++) {
        const vlmoe_param_info *to = &L.table[i], *from = &m->L.table[i];
        const int E = (int)to->shape[0];
        const int a0 = to->experts_local ? to->expert0 : 0, a1 = to->experts_local ? a0 + to->experts_local : E;
        const int b0 = from->experts_local ? from->expert0 : 0, b1 = from->experts_local ? b0 + from->experts_local : E;
        const int lo = a0 > b0 ? a0 : b0, hi = a1 < b1 ? a1 : b1;
        if (!to->experts_local && !from->experts_local) {
            memcpy(params + to->offset, m->params + from->offset, sizeof(float) * to->numel);
        } else if (lo < hi) {
            size_t ft, fn, tt, tn;
            held_range(from, lo, hi, &ft, &fn);
            held_range(to, lo, hi, &tt, &tn);
            memcpy(params + to->offset + tt, m->params + from->offset + ft, sizeof(float) * fn);
        }
    }
    const int B = m->planned_B;
    m->L.arch->drop_graphs(m);
    m->planned_B = 0, m->have_forward = 0;
    vlmoe_free_mem(m->params), vlmoe_free_mem(m->grads);
    model_layout_free(&m->L);
    m->L = L; // (the layout's encoders point into its own config: fix the copy's pointers)
    for (int e = 0; e < m->L.nenc; e++) m->L.enc[e].moe = e ? &m->L.cfg.text_moe : &m->L.cfg.moe;
    m->params = params, m->grads = grads;
    model_weights_changed(m);
    return B > 0 ? m->L.arch->plan(m, B) : VLMOE_OK;
}

int vlmoe_model_init(vlmoe_model **out, const vlmoe_model_config *cfg, uint64_t seed) {
    *out = NULL;
    vlmoe_model *m = calloc(1, sizeof(*m));
    if (!m) return vlmoe_fail(VLMOE_ERR_NOMEM, "model");
    m->be = backend_cpu_f32();
    m->attn_recompute = -1;
    int st = model_layout_build(&m->L, cfg);
    if (st) return free(m), st;
    m->params = vlmoe_alloc(sizeof(float) * m->L.total, "parameters");
    // calloc's zero pages, mapped when the first backward writes them: a model that trains its
    // experts sharded (src/train/trainer.c) gives its whole gradients back before that
    m->grads = calloc(m->L.total ? m->L.total : 1, sizeof(float));
    if (m->params && !m->grads) vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu floats for the gradients", m->L.total);
    if (!m->params || !m->grads) return vlmoe_model_free(m), VLMOE_ERR_NOMEM;
    if ((st = model_layout_init_params(&m->L, m->params, seed))) return vlmoe_model_free(m), st;
    model_weights_changed(m);
    m->seed = seed;
    if (m->L.arch->init && (st = m->L.arch->init(m))) return vlmoe_model_free(m), st;
    *out = m;
    return VLMOE_OK;
}

void vlmoe_model_free(vlmoe_model *m) {
    if (!m) return;
    if (m->L.arch) m->L.arch->free(m);
    model_release_backend(m);
    model_inputs_free(&m->in);
    vlmoe_free_mem(m->params);
    vlmoe_free_mem(m->grads);
    model_layout_free(&m->L);
    free(m);
}

const vlmoe_model_config *vlmoe_model_get_config(const vlmoe_model *m) { return &m->L.cfg; }
const vlmoe_param_info *vlmoe_model_params(const vlmoe_model *m, int *count) {
    if (count) *count = m->L.nparams;
    return m->L.table;
}
size_t vlmoe_model_num_floats(const vlmoe_model *m) { return m->L.total; }
// Writable: on a resident device model the host's copy is brought up to date and uploaded again
// before the next forward (src/nn/device.c).
float *vlmoe_model_param_data(vlmoe_model *m) {
    model_host_written(m);
    model_weights_changed(m); // the caller may write through it
    return m->params;
}
uint64_t model_weights_version(const vlmoe_model *m) { return m->wver; }
void model_weights_changed(vlmoe_model *m) { m->wver = gemm_bf16_new_version(); }
float *vlmoe_model_grad_data(vlmoe_model *m) {
    model_sync_host(m);
    return m->grads;
}

int vlmoe_model_plan(vlmoe_model *m, int batch_size) { return m->L.arch->plan(m, batch_size); }

int model_set_frozen_towers(vlmoe_model *m, int image, int text) {
    if ((image || text) && (m->L.arch != &model_arch_towers || m->L.nenc != 2))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': only a two_tower model has a tower of its own per modality",
                          m->L.cfg.name);
    m->frozen[MOD_IMAGE] = image != 0, m->frozen[MOD_TEXT] = text != 0;
    if (m->g)
        for (int k = 0; k < NUM_MOD; k++) graph_set_frozen_f32(m->g, k, m->frozen[k]);
    return VLMOE_OK;
}

// After a change the activation arena's layout depends on: plans again, for the batch size
// planned before (if any).
static int plan_again(vlmoe_model *m) {
    const int B = m->planned_B;
    m->L.arch->drop_graphs(m);
    m->planned_B = 0, m->have_forward = 0;
    return B > 0 ? m->L.arch->plan(m, B) : VLMOE_OK;
}

int vlmoe_model_set_grad_checkpointing(vlmoe_model *m, int on) {
    if (m->L.arch != &model_arch_towers)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': gradient checkpointing (--grad-checkpointing) is implemented "
                          "for the one_tower and two_tower architectures, not for VL-MoE (arch mome)", m->L.cfg.name);
    on = on != 0;
    if (m->grad_ckpt == on) return VLMOE_OK;
    m->grad_ckpt = on;
    return plan_again(m);
}

int vlmoe_model_set_attention_recompute(vlmoe_model *m, int mode) {
    if (mode < -1 || mode > 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "attention recompute mode %d: expected -1 (by precision), 0 (keep) or "
                          "1 (recompute)", mode);
    if (m->L.arch != &model_arch_towers && mode >= 0)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': keeping or recomputing the attention (--recompute-attention) "
                          "is chosen for the one_tower and two_tower architectures; VL-MoE (arch mome) always "
                          "recomputes it", m->L.cfg.name);
    if (m->attn_recompute == mode) return VLMOE_OK;
    m->attn_recompute = mode;
    return plan_again(m);
}

int model_keep_request(const vlmoe_model *m) {
    if (m->attn_recompute >= 0) return !m->attn_recompute;
    return m->be == backend_cpu_bf16() ? -1 : 0; // fp32's activations stay lean (its RSS target)
}

int model_keeps_attention(const vlmoe_model *m) {
    return m->g && graph_keeps_attention_f32(m->g); // only the towers plan m->g
}

int vlmoe_model_forward(vlmoe_model *m, const vlmoe_batch *b, vlmoe_step_stats *stats) {
    if (m->int8) // its products are a snapshot of the weights, and have no backward of their own
        return vlmoe_fail(VLMOE_ERR_ARG, "--precision int8 is for inference (embed, classify, eval); train "
                          "with --precision fp32 or bf16");
    return m->L.arch->forward(m, b, stats, 1);
}

int vlmoe_model_evaluate(vlmoe_model *m, const vlmoe_batch *b, vlmoe_step_stats *stats) {
    return m->L.arch->forward(m, b, stats, 0);
}

int vlmoe_model_average(vlmoe_model *dst, vlmoe_model *const *models, int n) {
    if (n < 1) return vlmoe_fail(VLMOE_ERR_ARG, "average: no models");
    // the same shapes and routing under another name (a JSON config named after its file) average
    vlmoe_model_config c = dst->L.cfg;
    c.name[0] = 0;
    char *want = vlmoe_config_to_json(&c);
    int st = want ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "config json");
    for (int i = 0; i < n && !st; i++) {
        c = models[i]->L.cfg;
        c.name[0] = 0;
        char *got = vlmoe_config_to_json(&c);
        if (!got || strcmp(got, want))
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "average: model %d (%s) has another config than %s", i,
                            models[i]->L.cfg.name, dst->L.cfg.name);
        free(got);
    }
    free(want);
    if (st) return st;
    // sum in double, in a fixed order, one parameter element per iteration
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < dst->L.total; k++) {
        double s = 0;
        for (int i = 0; i < n; i++) s += models[i]->params[k];
        dst->params[k] = (float)(s / n);
    }
    return VLMOE_OK;
}

int vlmoe_model_backward(vlmoe_model *m) { return m->L.arch->backward(m); }

void vlmoe_model_clamp(vlmoe_model *m) {
    if (m->L.logit_scale == NO_PARAM) return; // no temperature (VL-MoE without a retrieval head)
    const float hi = (float)log(m->L.cfg.max_temperature);
    if (m->resident) { // on the device's master copy, no wait: the host's float is a mirror like
        // the rest (the deferred contrastive forward reads the scale on the device and its
        // download brings it down for the logged temperature)
        m->be->clamp(m->be, m->d_params + m->L.logit_scale, 1, 0.0, hi);
        m->host_stale = 1;
        return;
    }
    const vlmoe_backend_f32 *be = model_host_backend(m); // params is the host's master copy
    // (the weights' version stays: no product reads the temperature, and the update just
    // packed the shadows of this version)
    be->clamp(be, &m->params[m->L.logit_scale], 1, 0.0, hi);
}

// With the cpu-bf16 table the encoder's products keep the weights' packed bf16 copies from one
// call to the next while the weights' version stays (src/ops/gemm_bf16.h): an embedding job
// packs each weight once, not once per batch.
static int encode(vlmoe_model *m, int mod, const float *images, const int32_t *tokens, const int32_t *lengths,
                  int n, float *out) {
    const int shadows = m->be == backend_cpu_bf16();
    if (shadows) gemm_bf16_shadow_use(m->params, m->L.total, m->wver);
    const int st = m->L.arch->encode(m, mod, images, tokens, lengths, n, out);
    if (shadows) gemm_bf16_shadow_use(NULL, 0, 0);
    return st;
}

int vlmoe_model_encode_images(vlmoe_model *m, const float *images, int n, float *out) {
    return encode(m, MOD_IMAGE, images, NULL, NULL, n, out);
}

int vlmoe_model_encode_texts(vlmoe_model *m, const int32_t *tokens, const int32_t *lengths, int n,
                             float *out) {
    return encode(m, MOD_TEXT, NULL, tokens, lengths, n, out);
}

void vlmoe_model_get_rng(const vlmoe_model *m, uint64_t state[2]) {
    state[0] = m->seed;
    state[1] = m->forwards;
}

void vlmoe_model_set_rng(vlmoe_model *m, const uint64_t state[2]) {
    m->seed = state[0];
    m->forwards = state[1];
}

const vlmoe_moe_stats *vlmoe_model_moe_stats(const vlmoe_model *m, int *count) {
    return m->L.arch->moe_stats(m, count);
}

int vlmoe_model_check_finite(const vlmoe_model *m, int grads) {
    model_sync_host(m);
    const float *buf = grads ? m->grads : m->params;
    for (int i = 0; i < m->L.nparams; i++) {
        const vlmoe_param_info *p = &m->L.table[i];
        for (size_t k = 0; k < p->numel; k++)
            if (!isfinite(buf[p->offset + k]))
                return vlmoe_fail(VLMOE_ERR_NUMERIC, "%s of '%s' holds %g at element %zu",
                                  grads ? "the gradient" : "the value", p->name,
                                  (double)buf[p->offset + k], k);
    }
    return VLMOE_OK;
}

int model_writer(const vlmoe_model *m, vlmoe_st_writer **out) {
    vlmoe_st_writer *w;
    *out = NULL;
    int st = vlmoe_st_writer_init(&w);
    if (st) return st;
    char *json = vlmoe_config_to_json(&m->L.cfg);
    if (!json) st = vlmoe_fail(VLMOE_ERR_NOMEM, "config json");
    if (!st) st = vlmoe_st_writer_meta(w, CONFIG_KEY, json);
    if (!st) st = vlmoe_st_writer_meta(w, "format", "pt");
    if (!st && m->L.nsplit) // a file holds every expert: the trainer gathers them first
        st = vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': this process holds a shard of the experts only; a model file "
                        "needs them all", m->L.cfg.name);
    model_sync_host(m); // a resident model's parameters are the device's (src/nn/device.c)
    for (int i = 0; i < m->L.nparams && !st; i++) {
        const vlmoe_param_info *p = &m->L.table[i];
        st = vlmoe_st_writer_add_f32(w, p->name, VLMOE_DT_F32, p->ndim, p->shape, m->params + p->offset);
    }
    if (!st && m->L.arch->save) st = m->L.arch->save(m, w);
    if (!st) st = model_inputs_save(m, w);
    free(json);
    if (st) vlmoe_st_writer_free(w);
    else *out = w;
    return st;
}

int vlmoe_model_save(const vlmoe_model *m, const char *path) {
    vlmoe_st_writer *w;
    int st = model_writer(m, &w);
    if (!st) st = vlmoe_st_writer_write(w, path);
    vlmoe_st_writer_free(w);
    return st;
}

// Loads every parameter of the table from an open file (shapes must match exactly). params NULL:
// only the check that every tensor is there with its shape (the header's offsets were checked
// against the file's size when it was opened).
int model_read_params(const model_layout *L, const vlmoe_st *f, float *params) {
    if (L->nsplit)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: reading into a shard of the experts: load the whole model, then split "
                          "it", vlmoe_st_path(f));
    for (int i = 0; i < L->nparams; i++) {
        const vlmoe_param_info *p = &L->table[i];
        int idx = vlmoe_st_find(f, p->name);
        if (idx < 0)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: missing tensor '%s'", vlmoe_st_path(f), p->name);
        vlmoe_tensor_info ti;
        int st = vlmoe_st_info(f, idx, &ti);
        if (st) return st;
        int same = ti.ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = ti.shape[d] == p->shape[d];
        if (!same)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' has shape [%lld, %lld] (%d dims), "
                              "the config needs [%lld, %lld] (%d dims)", vlmoe_st_path(f), p->name,
                              (long long)(ti.ndim > 0 ? ti.shape[0] : 0), (long long)(ti.ndim > 1 ? ti.shape[1] : 0),
                              ti.ndim, (long long)p->shape[0], (long long)p->shape[1], p->ndim);
        if (params && (st = vlmoe_st_read_f32(f, p->name, params + p->offset, p->numel))) return st;
    }
    return VLMOE_OK;
}

// Opens a vlmoe model file and parses the config in its metadata.
static int open_model_file(const char *path, vlmoe_st **f, vlmoe_model_config *cfg) {
    int st = vlmoe_st_open(path, f);
    if (st) return st;
    const char *json = vlmoe_st_metadata(*f, CONFIG_KEY);
    if (!json)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no \"%s\" entry in the metadata: not a vlmoe model "
                        "(use `vlmoe import` for OpenCLIP/HF checkpoints)", path, CONFIG_KEY);
    else
        st = vlmoe_config_from_json(json, path, cfg);
    if (st) {
        vlmoe_st_close(*f);
        *f = NULL;
    }
    return st;
}

// Reads every parameter of m's layout from f into dst and refuses non-finite values.
static int read_weights(const vlmoe_model *m, const vlmoe_st *f, float *dst) {
    int st = model_read_params(&m->L, f, dst);
    for (int i = 0; !st && i < m->L.nparams; i++) {
        const vlmoe_param_info *p = &m->L.table[i];
        for (size_t k = 0; k < p->numel && !st; k++)
            if (!isfinite(dst[p->offset + k]))
                st = vlmoe_fail(VLMOE_ERR_NUMERIC, "%s: the value of '%s' holds %g at element %zu", vlmoe_st_path(f),
                                p->name, (double)dst[p->offset + k], k);
    }
    return st;
}

int model_load_into(vlmoe_model *m, const char *path) { return model_load_into_checked(m, path, NULL, NULL); }

int model_load_into_checked(vlmoe_model *m, const char *path, int (*check)(void *user, const vlmoe_st *f),
                            void *user) {
    vlmoe_st *f;
    vlmoe_model_config cfg;
    int st = open_model_file(path, &f, &cfg);
    if (st) return st;
    if (check && (st = check(user, f))) return vlmoe_st_close(f), st;
    char *a = vlmoe_config_to_json(&cfg), *b = vlmoe_config_to_json(&m->L.cfg);
    if (!a || !b || strcmp(a, b))
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: the checkpoint's model config differs from this run's", path);
    free(a), free(b);
    float *tmp = st ? NULL : vlmoe_alloc(sizeof(float) * m->L.total, "checkpoint weights");
    if (!st && !tmp) st = VLMOE_ERR_NOMEM;
    if (!st) st = read_weights(m, f, tmp); // into scratch: m changes only if all of it is valid
    if (!st) st = model_inputs_load(m, f, path);
    if (!st) model_host_written(m), memcpy(m->params, tmp, sizeof(float) * m->L.total), model_weights_changed(m);
    vlmoe_free_mem(tmp);
    vlmoe_st_close(f);
    return st;
}

int vlmoe_model_load(vlmoe_model **out, const char *path) {
    *out = NULL;
    vlmoe_st *f;
    vlmoe_model_config cfg;
    vlmoe_model *m = NULL;
    int st = open_model_file(path, &f, &cfg);
    if (st) return st;
    // The config in the metadata declares the model's size; the tensors in the file prove it.
    // Checked before anything of that size is allocated: a few bytes of metadata must not cost
    // gigabytes of parameters, gradients and activations.
    model_layout L;
    if (!(st = model_layout_build(&L, &cfg))) st = model_read_params(&L, f, NULL);
    model_layout_free(&L);
    if (!st) st = vlmoe_model_init(&m, &cfg, 0);
    if (!st) st = read_weights(m, f, m->params);
    if (m) model_weights_changed(m);
    if (!st && m->L.arch->load) st = m->L.arch->load(m, f, path);
    if (!st) st = model_inputs_load(m, f, path);
    vlmoe_st_close(f);
    if (st) {
        vlmoe_model_free(m);
        return st;
    }
    *out = m;
    return VLMOE_OK;
}
