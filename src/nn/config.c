// config.c: model configs: the named sizes (MODEL.md: tiny test sizes, ViT-style S/B sizes in
// the LIMoE one_tower layout, OpenAI CLIP's two_tower ViT-B), JSON parsing with strict checking
// (unknown, missing and wrong-typed keys are errors naming the key) and JSON serialisation.
// Covered by tests/test_model.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "nn/sizes.h"
#include "vlmoe.h"

static vlmoe_model_config one_tower(const char *name, int img, int patch, int w, int l, int h,
                                    int vocab, int ctx, int emb) {
    vlmoe_model_config c;
    memset(&c, 0, sizeof(c));
    snprintf(c.name, sizeof(c.name), "%s", name);
    c.arch = VLMOE_ARCH_ONE_TOWER;
    c.image_size = img;
    c.patch_size = patch;
    c.channels = 3;
    c.vocab_size = vocab;
    c.context_length = ctx;
    c.embed_dim = emb;
    c.encoder = (vlmoe_encoder_config){w, l, h, 4 * w};
    c.act = VLMOE_ACT_GELU;
    c.ln_eps = 1e-6;
    c.patch_bias = 1;
    c.image_pool = VLMOE_POOL_MEAN;
    c.text_pool = VLMOE_POOL_MEAN;
    c.init_temperature = 10.0; // LIMoE: learned temperature initialised at 10
    c.max_temperature = 100.0;
    return c;
}

// OpenAI CLIP layout: class token + ln_pre, class-token pooling, causal text pooled at the
// end-of-text token, quick_gelu, bias-free conv1, ln eps 1e-5, logit scale init 1/0.07.
static vlmoe_model_config clip(const char *name, int img, int patch, int vw, int vl, int vh,
                               int tw, int tl, int th, int emb) {
    vlmoe_model_config c = one_tower(name, img, patch, vw, vl, vh, 49408, 77, emb);
    c.arch = VLMOE_ARCH_TWO_TOWER;
    c.text_encoder = (vlmoe_encoder_config){tw, tl, th, 4 * tw};
    c.act = VLMOE_ACT_QUICK_GELU;
    c.ln_eps = 1e-5;
    c.patch_bias = 0;
    c.image_class_token = 1;
    c.image_ln_pre = 1;
    c.image_pool = VLMOE_POOL_CLS;
    c.text_causal = 1;
    c.text_pool = VLMOE_POOL_EOT;
    c.init_temperature = 1.0 / 0.07;
    return c;
}

static const char *NAMES = "tiny, mini, tiny-clip, S/32, B/32, B/16, ViT-B-32, ViT-B-16, limoe-tiny, "
                           "limoe-mini, limoe-S/32, limoe-B/16, clipup-tiny, clipup-ViT-B-16, ec-tiny, "
                           "soft-tiny, vlmoe-tiny, mome-tiny, limoe-permod-tiny, limoe-disjoint-tiny";

uint64_t vlmoe_moe_every(int n, int layers) {
    uint64_t m = 0;
    for (int l = n - 1; n > 0 && l < layers && l < 64; l += n) m |= 1ULL << l;
    return m;
}

int vlmoe_moe_preset(const char *name, vlmoe_moe_config *c) {
    uint64_t layers = c->layers;
    int e = c->num_experts ? c->num_experts : 8;
    memset(c, 0, sizeof(*c));
    c->layers = layers;
    c->num_experts = e;
    c->router = VLMOE_ROUTER_TOKENS;
    c->capacity_multiple = 1;
    if (!strcmp(name, "limoe")) {
        // LIMoE: top-1, BPR, noisy routing, classic importance + load losses and the per-modality
        // entropy losses, "averaged and weighted by 0.04" (LIMoE B.1) over the 5 enabled losses
        c->top_k = 1;
        // LIMoE (appendix, "C_R >= 1 is a slack factor") builds on V-MoE's training capacity
        // 1.05; it evaluates one-modality passes with C_R = 16 so that modality-specific experts
        // do not drop tokens (appendix D)
        c->capacity_factor = 1.05;
        c->eval_capacity_factor = 16.0;
        c->order = VLMOE_ORDER_BPR;
        c->bpr_score = VLMOE_BPR_MAX;
        c->noise_std = 1.0;
        const double w = 0.04 / 5;
        c->aux_weight[VLMOE_AUX_IMPORTANCE] = c->aux_weight[VLMOE_AUX_LOAD] = w;
        c->aux_weight[VLMOE_AUX_LOCAL_ENT_TEXT] = w;
        c->aux_weight[VLMOE_AUX_GLOBAL_ENT_TEXT] = c->aux_weight[VLMOE_AUX_GLOBAL_ENT_IMAGE] = w;
        // tau = log(S), S the soft minimum number of experts (LIMoE 2.2.2). With 32 experts the
        // paper's S_image = 20, S_text = 9; its 8-expert B/16 used S = 6 for both (App. F.1).
        // Other expert counts take 6/8 of E for both (at least 1), so that every preset's
        // threshold can be met: one at or above log(E) never switches its loss off.
        const double si = e >= 32 ? 20.0 : fmax(1.0, 0.75 * e), stx = e >= 32 ? 9.0 : fmax(1.0, 0.75 * e);
        c->global_tau[VLMOE_MOD_IMAGE] = log(si);
        c->global_tau[VLMOE_MOD_TEXT] = log(stx);
    } else if (!strcmp(name, "clipup")) {
        // CLIP-UP: top-2 "first-come-first-serve", capacity factor 2, switch load balance
        // (alpha 0.01) + router z-loss (beta 0.001) per tower
        c->top_k = 2;
        c->capacity_factor = c->eval_capacity_factor = 2.0;
        c->order = VLMOE_ORDER_FIFO;
        c->aux_weight[VLMOE_AUX_SWITCH] = 0.01;
        c->aux_weight[VLMOE_AUX_ZLOSS] = 0.001;
        c->capacity_per_token = 1; // B_e = (B_t/E) x C, no K (CLIP-UP sec. 3)
    } else if (!strcmp(name, "vlmoe-v") || !strcmp(name, "vlmoe-t")) {
        // VL-MoE (sec. 4.1, "MoE Setting"): top-1; V-MoE with BPR and the v-loss (importance and
        // load averaged), T-MoE with the load loss, ratio 0.01; capacity factor 1.05 in training
        // and 1.0 at inference (V-MoE); noisy routing, which the load loss needs
        const int vision = name[6] == 'v';
        c->top_k = 1;
        c->capacity_factor = 1.05;
        c->eval_capacity_factor = 1.0;
        c->order = vision ? VLMOE_ORDER_BPR : VLMOE_ORDER_FIFO;
        c->bpr_score = VLMOE_BPR_MAX;
        c->noise_std = 1.0;
        c->aux_weight[vision ? VLMOE_AUX_VLOSS : VLMOE_AUX_LOAD] = 0.01;
    } else {
        return vlmoe_fail(VLMOE_ERR_CONFIG, "unknown MoE preset '%s' (known: limoe, clipup, vlmoe-v, vlmoe-t)", name);
    }
    return VLMOE_OK;
}

// A named base model turned sparse with a preset: MoE in every second block of each tower.
static int moe_named(const char *base, const char *preset, vlmoe_model_config *out) {
    int st = vlmoe_config_named(base, out);
    if (st) return st;
    out->moe.layers = vlmoe_moe_every(2, out->encoder.layers);
    if ((st = vlmoe_moe_preset(preset, &out->moe))) return st;
    if (out->arch == VLMOE_ARCH_TWO_TOWER) {
        out->text_moe.layers = vlmoe_moe_every(2, out->text_encoder.layers);
        st = vlmoe_moe_preset(preset, &out->text_moe);
    }
    return st;
}

const char *vlmoe_config_names(void) { return NAMES; }

int vlmoe_config_named(const char *name, vlmoe_model_config *out) {
    if (!strcmp(name, "tiny")) {
        *out = one_tower(name, 32, 8, 64, 2, 2, 256, 16, 64);
        out->act = VLMOE_ACT_GELU_TANH;
    } else if (!strcmp(name, "mini")) {
        // the demo size: width 128 is the smallest shared encoder that learned shape as well as
        // colour on the synthetic data (width 64 stays near 36% zero-shot)
        *out = one_tower(name, 32, 8, 128, 2, 4, 256, 16, 64);
        out->act = VLMOE_ACT_GELU_TANH;
    } else if (!strcmp(name, "tiny-clip")) {
        *out = clip(name, 32, 8, 64, 2, 2, 48, 2, 2, 32);
        out->vocab_size = 256;
        out->context_length = 16;
    } else if (!strcmp(name, "S/32")) {
        *out = one_tower(name, 224, 32, 384, 12, 6, 32000, 16, 384);
    } else if (!strcmp(name, "B/32")) {
        *out = one_tower(name, 224, 32, 768, 12, 12, 32000, 16, 512);
    } else if (!strcmp(name, "B/16")) {
        *out = one_tower(name, 224, 16, 768, 12, 12, 32000, 16, 512);
    } else if (!strcmp(name, "ViT-B-32")) {
        *out = clip(name, 224, 32, 768, 12, 12, 512, 12, 8, 512);
    } else if (!strcmp(name, "ViT-B-16")) {
        *out = clip(name, 224, 16, 768, 12, 12, 512, 12, 8, 512);
    } else if (!sizes_named(name, out)) {
        // the papers' sizes (src/nn/sizes.c)
    } else if (!strcmp(name, "limoe-permod-tiny") || !strcmp(name, "limoe-disjoint-tiny")) {
        // LIMoE appendix E.3 at test size: limoe-tiny (8 experts) with a router per modality;
        // "disjoint" also splits the experts, 6 for images and 2 for text (the paper: 27 / 5 of
        // 32). Its pools balance by design, so it keeps only the classic importance + load
        // losses per pool (E.3: "did not need entropy regularisation"), 0.04 averaged over the
        // two; capacity factor 2: with 16 patches and 16 text tokens per pair, each of the 2
        // text experts expects S/4 tokens of a group, the capacity ceil(2 S/8) = S/4 (the
        // paper's B/16 gives its 5 text experts fewer than an even share, 16/5 < 1.05 212/32)
        int st = moe_named("tiny", "limoe", out);
        if (st) return st;
        vlmoe_moe_config *m = &out->moe;
        m->router_per_modality = 1;
        if (name[6] == 'd') {
            m->text_experts = 2;
            memset(m->aux_weight, 0, sizeof(m->aux_weight));
            m->aux_weight[VLMOE_AUX_IMPORTANCE] = m->aux_weight[VLMOE_AUX_LOAD] = 0.04 / 2;
            m->capacity_factor = 2.0;
        }
    } else if (!strncmp(name, "limoe-", 6) || !strncmp(name, "clipup-", 7)) {
        int lim = name[0] == 'l';
        const char *base = name + (lim ? 6 : 7);
        // the base is a dense model: "limoe-limoe-..." would recurse once per prefix (a fuzzed
        // name of thousands of them overflowed the stack)
        if (!strncmp(base, "limoe-", 6) || !strncmp(base, "clipup-", 7))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%.80s': the base of a limoe-/clipup- name is a dense model, "
                              "not another MoE name", name);
        int st = moe_named(base, lim ? "limoe" : "clipup", out);
        if (st) return st;
    } else if (!strcmp(name, "vlmoe-tiny") || !strcmp(name, "mome-tiny")) {
        // VL-MoE at test size: 4 blocks, VL-FFN in the last one, V-MoE and T-MoE (4 experts) in
        // every second of the first three (block 1); mome-tiny is its dense MoME twin
        *out = one_tower(name, 32, 8, 64, 4, 2, 256, 16, 64);
        out->arch = VLMOE_ARCH_MOME;
        out->image_class_token = 1;   // [I_CLS]
        out->vl_layers = 1;
        out->mim_vocab = 1024;
        out->mask_token = 255;        // the last id is reserved for [MASK]
        if (name[0] == 'v') {
            out->moe.num_experts = out->text_moe.num_experts = 4;
            out->moe.layers = out->text_moe.layers = vlmoe_moe_every(2, 3);
            vlmoe_moe_preset("vlmoe-v", &out->moe);
            vlmoe_moe_preset("vlmoe-t", &out->text_moe);
        }
    } else if (!strcmp(name, "ec-tiny") || !strcmp(name, "soft-tiny")) {
        // V-MoE-style experts choice and Soft MoE variants of the tiny LIMoE layout
        int st = moe_named("tiny", "limoe", out);
        if (st) return st;
        vlmoe_moe_config *m = &out->moe;
        memset(m->aux_weight, 0, sizeof(m->aux_weight)); // neither router uses auxiliary losses
        m->noise_std = 0;
        if (name[0] == 'e') {
            m->router = VLMOE_ROUTER_EXPERTS;
        } else {
            m->router = VLMOE_ROUTER_SOFT;
            m->group_size = 32; // one routing group per example: its 16 patches and 16 text tokens
            m->slots_per_expert = 2;
        }
    } else {
        return vlmoe_fail(VLMOE_ERR_CONFIG, "unknown model '%s' (known: %s, %s, or a .json config file)",
                          name, NAMES, SIZES_NAMES);
    }
    snprintf(out->name, sizeof(out->name), "%s", name);
    return VLMOE_OK;
}

int vlmoe_config_warnings(const vlmoe_model_config *c, char *buf, size_t cap) {
    int n = 0;
    size_t u = 0;
    if (buf && cap) buf[0] = 0;
    for (int t = 0; c && t < (c->arch == VLMOE_ARCH_ONE_TOWER ? 1 : 2); t++) {
        const vlmoe_moe_config *m = t ? &c->text_moe : &c->moe;
        const int aux[2] = {VLMOE_AUX_GLOBAL_ENT_IMAGE, VLMOE_AUX_GLOBAL_ENT_TEXT};
        if (m->router != VLMOE_ROUTER_TOKENS || m->num_experts < 1) continue;
        for (int k = 0; k < 2; k++) {
            // H(mean p) <= log E, so tau >= log E keeps max(0, tau - H) > 0 except at exact uniform;
            // with disjoint pools (LIMoE E.3) E is the modality's pool
            const int T = m->text_experts, pool = T > 0 && T < m->num_experts;
            const int E = pool ? (k ? T : m->num_experts - T) : m->num_experts;
            if (m->aux_weight[aux[k]] == 0 || m->global_tau[k] < log((double)E)) continue;
            n++;
            if (buf && u < cap)
                u += (size_t)snprintf(buf + u, cap - u, "%s%s.global_entropy_tau[%s] = %g = log(%.3g) is at or above "
                                      "log(%s = %d) = %g: no routing over %d experts meets it, so the "
                                      "%s loss never switches off (tau = log(S), S the soft minimum number of "
                                      "experts)", n > 1 ? "\n" : "", t ? "text_moe" : "moe", k ? "text" : "image",
                                      m->global_tau[k], exp(m->global_tau[k]),
                                      pool ? (k ? "text_experts" : "image experts, num_experts - text_experts")
                                           : "num_experts",
                                      E, log((double)E), E, vlmoe_aux_name((vlmoe_aux_kind)aux[k]));
        }
    }
    return n;
}

int vlmoe_config_validate(const vlmoe_model_config *c) {
#define NEED(cond, ...) \
    if (!(cond)) return vlmoe_fail(VLMOE_ERR_CONFIG, __VA_ARGS__)
    NEED(c->arch == VLMOE_ARCH_ONE_TOWER || c->arch == VLMOE_ARCH_TWO_TOWER || c->arch == VLMOE_ARCH_MOME,
         "arch: unknown value %d", (int)c->arch);
    if (c->arch == VLMOE_ARCH_MOME) {
        NEED(c->vl_layers >= 0 && c->vl_layers <= c->encoder.layers, "vl_layers: %d not in [0, encoder.layers = %d]",
             c->vl_layers, c->encoder.layers);
        NEED(c->mim_vocab >= 2 && c->mim_vocab <= 1 << 20, "mim_vocab: %d not in [2, 2^20]", c->mim_vocab);
        NEED(c->mask_token >= 0 && c->mask_token < c->vocab_size, "mask_token: %d not in [0, vocab_size = %d)",
             c->mask_token, c->vocab_size);
        NEED(c->num_classes == 0 || (c->num_classes >= 2 && c->num_classes <= 1 << 20),
             "num_classes: %d: need 0 (no classification head) or [2, 2^20]", c->num_classes);
        NEED(c->cls_sequences >= 0 && c->cls_sequences <= 2, "cls_sequences: %d: need 1 (one sequence per "
             "example) or 2 (NLVR2: two image-text pairs)", c->cls_sequences);
        NEED(c->retrieval_head == 0 || c->retrieval_head == 1, "retrieval_head: %d: need 0 or 1", c->retrieval_head);
        NEED(c->itm_head == 0 || (c->itm_head == 1 && c->retrieval_head == 1), "itm_head: %d: need 0, or 1 with "
             "retrieval_head 1 (its contrastive similarities mine the hard negatives)", c->itm_head);
        NEED(c->beit_init == 0 || c->beit_init == 1, "beit_init: %d: need 0 or 1", c->beit_init);
        NEED(c->image_class_token && !c->image_ln_pre && !c->text_causal,
             "mome: needs image_class_token true ([I_CLS]), image_ln_pre and text_causal false");
    }
    NEED(!c->beit_init || c->arch == VLMOE_ARCH_MOME, "beit_init: only VL-MoE (arch mome) models take BEiT's "
         "initialisation");
    NEED(c->channels >= 1 && c->channels <= 4, "channels: %d not in [1, 4]", c->channels);
    NEED(c->patch_size >= 1 && c->image_size >= c->patch_size && c->image_size <= 4096,
         "image_size %d / patch_size %d: need 1 <= patch_size <= image_size <= 4096", c->image_size,
         c->patch_size);
    NEED(c->image_size % c->patch_size == 0, "image_size %d is not a multiple of patch_size %d",
         c->image_size, c->patch_size);
    NEED(c->vocab_size >= 4 && c->vocab_size <= 10000000, "vocab_size: %d not in [4, 1e7]", c->vocab_size);
    NEED(c->context_length >= 2 && c->context_length <= 4096, "context_length: %d not in [2, 4096]",
         c->context_length);
    NEED(c->embed_dim >= 1 && c->embed_dim <= 65536, "embed_dim: %d not in [1, 65536]", c->embed_dim);
    for (int t = 0; t < (c->arch == VLMOE_ARCH_TWO_TOWER ? 2 : 1); t++) {
        const vlmoe_encoder_config *e = t ? &c->text_encoder : &c->encoder;
        const char *nm = t ? "text_encoder" : "encoder";
        NEED(e->width >= 1 && e->width <= 65536, "%s.width: %d not in [1, 65536]", nm, e->width);
        NEED(e->layers >= 0 && e->layers <= 1024, "%s.layers: %d not in [0, 1024]", nm, e->layers);
        NEED(e->heads >= 1 && e->width % e->heads == 0, "%s.heads: %d must divide width %d", nm,
             e->heads, e->width);
        NEED(e->mlp_dim >= 1 && e->mlp_dim <= 1 << 20, "%s.mlp_dim: %d not in [1, 2^20]", nm, e->mlp_dim);
    }
    NEED(c->act >= VLMOE_ACT_GELU && c->act <= VLMOE_ACT_QUICK_GELU, "act: unknown value %d", c->act);
    NEED(c->ln_eps > 0 && c->ln_eps < 1, "ln_eps: %g not in (0, 1)", c->ln_eps);
    NEED(c->image_pool == VLMOE_POOL_MEAN || (c->image_pool == VLMOE_POOL_CLS && c->image_class_token),
         "image_pool: must be \"mean\", or \"cls\" with image_class_token true");
    NEED(c->text_pool == VLMOE_POOL_MEAN || c->text_pool == VLMOE_POOL_EOT,
         "text_pool: must be \"mean\" or \"eot\"");
    for (int t = 0; t < (c->arch == VLMOE_ARCH_ONE_TOWER ? 1 : 2); t++) {
        const vlmoe_moe_config *m = t ? &c->text_moe : &c->moe;
        const char *nm = t ? "text_moe" : "moe";
        // mome: MoE only below the VL blocks (VL-MoE sec. 3.2: "we only use MoE for V-FFN and
        // T-FFN in the first (L - F) layers")
        const int L = c->arch == VLMOE_ARCH_MOME ? c->encoder.layers - c->vl_layers
                      : t ? c->text_encoder.layers : c->encoder.layers;
        if (m->router == VLMOE_ROUTER_NONE) continue;
        NEED(m->router >= VLMOE_ROUTER_TOKENS && m->router <= VLMOE_ROUTER_SOFT, "%s.router: unknown value %d", nm, (int)m->router);
        NEED(m->layers != 0 && (L >= 64 || (m->layers >> L) == 0), "%s.layers: must name blocks in [0, %d)", nm, L);
        NEED(m->num_experts >= 1 && m->num_experts <= 4096, "%s.num_experts: %d not in [1, 4096]", nm, m->num_experts);
        NEED(m->router != VLMOE_ROUTER_TOKENS || (m->top_k >= 1 && m->top_k <= m->num_experts),
             "%s.top_k: %d not in [1, num_experts = %d]", nm, m->top_k, m->num_experts);
        NEED(m->router == VLMOE_ROUTER_SOFT || (m->capacity_factor > 0 && isfinite(m->capacity_factor)),
             "%s.capacity_factor: %g must be a finite number > 0", nm, m->capacity_factor);
        NEED(m->router == VLMOE_ROUTER_SOFT || (m->eval_capacity_factor > 0 && isfinite(m->eval_capacity_factor)),
             "%s.eval_capacity_factor: %g must be a finite number > 0", nm, m->eval_capacity_factor);
        NEED(m->capacity_multiple >= 0 && m->capacity_multiple <= 1 << 20,
             "%s.capacity_multiple: %d not in [1, 2^20] (0 means 1)", nm, m->capacity_multiple);
        NEED(m->order >= VLMOE_ORDER_FIFO && m->order <= VLMOE_ORDER_RANDOM, "%s.order: unknown value", nm);
        NEED(m->noise_std >= 0 && isfinite(m->noise_std), "%s.noise_std: %g must be a finite number >= 0", nm,
             m->noise_std);
        NEED(m->group_size >= 0, "%s.group_size must be >= 0 (0 = the whole batch)", nm);
        NEED(m->text_first == 0 || m->text_first == 1, "%s.text_first must be 0 or 1", nm);
        // LIMoE E.3: both options split the router by the token's modality, which only a shared
        // encoder mixes in one layer; Soft MoE has no router to split
        NEED(m->router_per_modality == 0 || m->router_per_modality == 1, "%s.router_per_modality must be "
             "true or false", nm);
        NEED((!m->router_per_modality && !m->text_experts) ||
                 (c->arch == VLMOE_ARCH_ONE_TOWER && m->router != VLMOE_ROUTER_SOFT),
             "%s: router_per_modality and text_experts (LIMoE E.3) need a shared one_tower encoder with a "
             "tokens- or experts-choice router", nm);
        // experts choice lets each expert pick any token: a pool could not be enforced
        NEED(m->text_experts == 0 || m->router == VLMOE_ROUTER_TOKENS, "%s.text_experts: disjoint expert "
             "pools need tokens-choice routing (router \"tokens\")", nm);
        NEED(m->text_experts == 0 || (m->text_experts >= m->top_k && m->num_experts - m->text_experts >= m->top_k),
             "%s.text_experts: %d leaves a pool smaller than top_k = %d (text experts are [E-T, E), image "
             "experts [0, E-T) of num_experts E = %d; 0 = one shared pool)", nm, m->text_experts, m->top_k,
             m->num_experts);
        NEED(m->router != VLMOE_ROUTER_SOFT || m->slots_per_expert > 0 || m->group_size > 0,
             "%s: Soft MoE needs slots_per_expert or group_size (the number of slots is a parameter shape)", nm);
        NEED(m->slots_per_expert >= 0, "%s.slots_per_expert: %d must be >= 1 (0: rint(group_size / num_experts))", nm,
             m->slots_per_expert);
        // fewer than one slot per expert leaves experts with nothing to process (Soft MoE sec. 2.1)
        NEED(m->router != VLMOE_ROUTER_SOFT || m->slots_per_expert > 0 ||
                 rint((double)m->group_size / m->num_experts) >= 1,
             "%s: Soft MoE with group_size %d and num_experts %d has rint(%d / %d) = 0 slots per expert: need at least "
             "one (set slots_per_expert, or a group_size >= num_experts / 2)", nm, m->group_size, m->num_experts,
             m->group_size, m->num_experts);
        NEED(m->soft_mix >= VLMOE_SOFT_MIX_SOFT && m->soft_mix <= VLMOE_SOFT_MIX_SOFT_UNIFORM,
             "%s.soft_dispatch: unknown value %d", nm, m->soft_mix);
        NEED(m->soft_raw == 0 || m->soft_raw == 1, "%s.soft_normalize: must be true or false", nm);
        NEED(m->global_tau[0] >= 0 && m->global_tau[1] >= 0 && !isinf(m->global_tau[0]) && !isinf(m->global_tau[1]),
             "%s.global_entropy_tau: [%g, %g] must be finite and >= 0 (tau = log(S), S >= 1 experts)", nm,
             m->global_tau[0], m->global_tau[1]);
        for (int k = 0; k < VLMOE_AUX_COUNT; k++)
            NEED(m->aux_weight[k] >= 0 && isfinite(m->aux_weight[k]), "%s.aux.%s: weight must be a finite "
                 "number >= 0", nm, vlmoe_aux_name(k));
        for (int l = 0; l < 64; l++) {
            if (!m->pruned[l]) continue;
            int kept = 0;
            for (int e = 0; e < m->num_experts && e < 64; e++) kept += !(m->pruned[l] >> e & 1);
            NEED(m->router == VLMOE_ROUTER_TOKENS && (m->layers >> l & 1),
                 "%s.pruned: block %d is not a tokens-choice MoE layer", nm, l);
            NEED(!m->text_experts, "%s.pruned: block %d: pruning a model with disjoint expert pools "
                 "(text_experts) is not supported; each pool is its modality's already", nm, l);
            NEED(m->num_experts <= 64 && (m->num_experts == 64 || !(m->pruned[l] >> m->num_experts)),
                 "%s.pruned: block %d names an expert beyond num_experts = %d", nm, l, m->num_experts);
            NEED(kept >= m->top_k, "%s.pruned: block %d keeps %d experts, fewer than top_k = %d", nm, l,
                 kept, m->top_k);
        }
    }
    NEED(c->init_temperature > 0 && c->max_temperature >= 1 && c->init_temperature <= c->max_temperature &&
         isfinite(c->max_temperature),
         "temperature: need 0 < init_temperature (%g) <= max_temperature (%g), max >= 1",
         c->init_temperature, c->max_temperature);
#undef NEED
    return VLMOE_OK;
}

static const char *ACT_NAMES[] = {"gelu", "gelu_tanh", "quick_gelu"};
static const char *POOL_NAMES[] = {"mean", "cls", "eot"};
static const char *ARCH_NAMES[] = {"one_tower", "two_tower", "mome"};
// mome's own keys: optional in the JSON (absent: 0), written only for mome configs
static const char *MOME_KEYS[] = {"vl_layers", "mim_vocab", "mask_token", "num_classes", "cls_sequences",
                                  "retrieval_head", "itm_head", "beit_init"};

static int enum_index(const char *s, const char **names, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

// Reads one key of a JSON object into the config; returns a status naming the key on error.
typedef enum { K_INT, K_DOUBLE, K_BOOL, K_ACT, K_POOL, K_ARCH, K_STRING } key_kind;
typedef struct { const char *key; key_kind kind; size_t off; } key_spec;
#define KEY(k, kind, field) {k, kind, offsetof(vlmoe_model_config, field)}
static const key_spec KEYS[] = {
    KEY("name", K_STRING, name), KEY("arch", K_ARCH, arch),
    KEY("image_size", K_INT, image_size), KEY("patch_size", K_INT, patch_size),
    KEY("channels", K_INT, channels), KEY("vocab_size", K_INT, vocab_size),
    KEY("context_length", K_INT, context_length), KEY("embed_dim", K_INT, embed_dim),
    KEY("act", K_ACT, act), KEY("ln_eps", K_DOUBLE, ln_eps), KEY("patch_bias", K_BOOL, patch_bias),
    KEY("image_class_token", K_BOOL, image_class_token), KEY("image_ln_pre", K_BOOL, image_ln_pre),
    KEY("image_pool", K_POOL, image_pool), KEY("text_causal", K_BOOL, text_causal),
    KEY("text_pool", K_POOL, text_pool), KEY("init_temperature", K_DOUBLE, init_temperature),
    KEY("max_temperature", K_DOUBLE, max_temperature),
};
#define NKEYS (int)(sizeof(KEYS) / sizeof(KEYS[0]))
static const char *ENC_KEYS[] = {"width", "layers", "heads", "mlp_dim"};

static int read_int(const cJSON *v, const char *what, const char *key, int *out) {
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) > 2e9)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an integer", what, key);
    *out = (int)v->valuedouble;
    return VLMOE_OK;
}

static int read_encoder(const cJSON *o, const char *what, const char *key, vlmoe_encoder_config *e,
                        int complete) {
    if (!cJSON_IsObject(o))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an object {width, layers, heads, "
                          "mlp_dim}", what, key);
    int *f[4] = {&e->width, &e->layers, &e->heads, &e->mlp_dim};
    for (const cJSON *it = o->child; it; it = it->next) {
        int k = enum_index(it->string, ENC_KEYS, 4);
        if (k < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: unknown key \"%s.%s\" (expected width, layers, "
                              "heads, mlp_dim)", what, key, it->string);
        char full[96];
        snprintf(full, sizeof(full), "%s.%s", key, it->string);
        int st = read_int(it, what, full, f[k]);
        if (st) return st;
    }
    for (int k = 0; complete && k < 4; k++)
        if (!cJSON_GetObjectItemCaseSensitive(o, ENC_KEYS[k]))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: missing key \"%s.%s\"", what, key, ENC_KEYS[k]);
    return VLMOE_OK;
}


// cJSON prints doubles with 15 significant digits when they compare "close enough"; configs must
// round-trip exactly (the temperature, thresholds like log 9), so numbers are written with
// the fewest digits that read back exactly.
static cJSON *num(double v) {
    char b[40];
    for (int digits = 15; digits <= 17; digits++) { // the shortest that reads back exactly
        snprintf(b, sizeof(b), "%.*g", digits, v);
        if (strtod(b, NULL) == v) break;
    }
    return cJSON_CreateRaw(b);
}

static void add_num(cJSON *o, const char *key, double v) { cJSON_AddItemToObject(o, key, num(v)); }

static const char *ROUTER_NAMES[] = {"none", "tokens_choice", "experts_choice", "soft"};
static const char *ORDER_NAMES[] = {"fifo", "bpr", "random"};
static const char *SOFT_MIX_NAMES[] = {"soft", "identity", "uniform", "uniform_soft", "soft_uniform"};
static const char *BPR_NAMES[] = {"max", "sum"};
static const char *RENORM_NAMES[] = {"none", "after_routing"};

static int read_enum(const cJSON *v, const char *what, const char *key, const char **names, int n, int *out) {
    int idx = cJSON_IsString(v) ? enum_index(v->valuestring, names, n) : -1;
    if (idx < 0) {
        char list[256] = "";
        for (int i = 0; i < n; i++)
            snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s\"%s\"", i ? ", " : "", names[i]);
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be one of %s", what, key, list);
    }
    *out = idx;
    return VLMOE_OK;
}

static int read_num(const cJSON *v, const char *what, const char *key, double *out) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) // 1e999 parses as inf
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be a finite number", what, key);
    *out = v->valuedouble;
    return VLMOE_OK;
}

// "moe": {"preset": "limoe", "layers": "every_2" | [1, 3], "num_experts": 8, ...}. The preset is
// applied first, whatever its position; the other keys override it.
// "every_N" is resolved by the caller once the encoder's depth is known (*every = N).
static int read_moe(const cJSON *o, const char *what, const char *key, vlmoe_moe_config *m, int *every) {
    char k[128];
    if (!cJSON_IsObject(o)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an object", what, key);
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(o, "preset");
    if (pre) {
        if (!cJSON_IsString(pre)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s.preset\" must be a string", what, key);
        int e = m->num_experts;
        const cJSON *ne = cJSON_GetObjectItemCaseSensitive(o, "num_experts");
        if (cJSON_IsNumber(ne)) m->num_experts = (int)ne->valuedouble;
        if (vlmoe_moe_preset(pre->valuestring, m)) return vlmoe_error_prefix("%s: %s.preset", what, key), VLMOE_ERR_CONFIG;
        if (!ne) m->num_experts = e ? e : m->num_experts;
    }
    int st = VLMOE_OK;
    for (const cJSON *it = o->child; it && !st; it = it->next) {
        const char *n = it->string;
        snprintf(k, sizeof(k), "%s.%s", key, n);
        int iv;
        if (!strcmp(n, "preset")) continue;
        if (!strcmp(n, "router")) {
            if (!(st = read_enum(it, what, k, ROUTER_NAMES, 4, &iv))) m->router = (vlmoe_router_kind)iv;
        } else if (!strcmp(n, "layers")) {
            if (cJSON_IsString(it) && !strncmp(it->valuestring, "every_", 6) && atoi(it->valuestring + 6) > 0) {
                *every = atoi(it->valuestring + 6);
            } else if (cJSON_IsArray(it)) {
                m->layers = 0;
                *every = 0;
                for (const cJSON *x = it->child; x && !st; x = x->next) {
                    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < 0 || x->valuedouble > 63)
                        st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must list block indices in [0, 63]", what, k);
                    else
                        m->layers |= 1ULL << (int)x->valuedouble;
                }
            } else {
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"every_N\" or a list of block indices", what, k);
            }
        } else if (!strcmp(n, "num_experts")) st = read_int(it, what, k, &m->num_experts);
        else if (!strcmp(n, "top_k")) st = read_int(it, what, k, &m->top_k);
        else if (!strcmp(n, "capacity_factor")) st = read_num(it, what, k, &m->capacity_factor);
        else if (!strcmp(n, "eval_capacity_factor")) st = read_num(it, what, k, &m->eval_capacity_factor);
        else if (!strcmp(n, "capacity_multiple")) st = read_int(it, what, k, &m->capacity_multiple);
        else if (!strcmp(n, "capacity_per_assignment")) {
            if (!cJSON_IsBool(it)) st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be true (C = cf*S*K/E, V-MoE) "
                                                   "or false (C = cf*S/E, CLIP-UP)", what, k);
            else m->capacity_per_token = !cJSON_IsTrue(it);
        }
        else if (!strcmp(n, "order")) st = read_enum(it, what, k, ORDER_NAMES, 3, &m->order);
        else if (!strcmp(n, "bpr_score")) st = read_enum(it, what, k, BPR_NAMES, 2, &m->bpr_score);
        else if (!strcmp(n, "gate_renorm")) st = read_enum(it, what, k, RENORM_NAMES, 2, &m->gate_renorm);
        else if (!strcmp(n, "noise_std")) st = read_num(it, what, k, &m->noise_std);
        else if (!strcmp(n, "group_size")) st = read_int(it, what, k, &m->group_size);
        else if (!strcmp(n, "slots_per_expert")) st = read_int(it, what, k, &m->slots_per_expert);
        else if (!strcmp(n, "soft_dispatch")) st = read_enum(it, what, k, SOFT_MIX_NAMES, 5, &m->soft_mix);
        else if (!strcmp(n, "soft_normalize")) {
            if (!cJSON_IsBool(it)) st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be true or false", what, k);
            else m->soft_raw = !cJSON_IsTrue(it);
        }
        else if (!strcmp(n, "router_per_modality")) {
            if (!cJSON_IsBool(it)) st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be true or false", what, k);
            else m->router_per_modality = cJSON_IsTrue(it);
        }
        else if (!strcmp(n, "text_experts")) st = read_int(it, what, k, &m->text_experts);
        else if (!strcmp(n, "text_first")) {
            if (!cJSON_IsBool(it)) st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be true or false", what, k);
            else m->text_first = cJSON_IsTrue(it);
        }
        else if (!strcmp(n, "global_entropy_tau") || !strcmp(n, "global_tau")) {
            // global_entropy_tau: tau = log(S) per modality, S the soft minimum number of experts
            // (0 = log 1). global_tau is the key of files written before it, where 0 meant "log
            // of the modality's token count in the group", a rule the paper does not have:
            // their non-zero values read the same, and 0 reads as log 1 (MOE.md, LIMoE Table 5)
            if (!cJSON_IsArray(it) || cJSON_GetArraySize(it) != 2 || !cJSON_IsNumber(it->child) || !cJSON_IsNumber(it->child->next))
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be [image, text] numbers: tau = log(S), S the "
                                "soft minimum number of experts (0 = log 1)", what, k);
            else if (!(it->child->valuedouble >= 0) || !(it->child->next->valuedouble >= 0) ||
                     isinf(it->child->valuedouble) || isinf(it->child->next->valuedouble))
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be finite and >= 0 (tau = log(S), S >= 1 "
                                "experts; got [%g, %g])", what, k, it->child->valuedouble, it->child->next->valuedouble);
            else
                m->global_tau[0] = it->child->valuedouble, m->global_tau[1] = it->child->next->valuedouble;
        } else if (!strcmp(n, "pruned")) {
            // {"block": [expert, ...], ...}: experts router_pred pruning masks out of the top-K
            if (!cJSON_IsObject(it)) {
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an object {block: [experts]}", what, k);
                break;
            }
            memset(m->pruned, 0, sizeof(m->pruned));
            for (const cJSON *b = it->child; b && !st; b = b->next) {
                char *end;
                long l = strtol(b->string, &end, 10);
                if (*end || l < 0 || l > 63 || !cJSON_IsArray(b)) {
                    st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s.%s\" must be a block index in [0, 63] "
                                    "listing expert indices", what, k, b->string);
                    break;
                }
                for (const cJSON *x = b->child; x && !st; x = x->next) {
                    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) || x->valuedouble < 0 || x->valuedouble > 63)
                        st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s.%s\" must list expert indices in [0, 63]",
                                        what, k, b->string);
                    else
                        m->pruned[l] |= 1ULL << (int)x->valuedouble;
                }
            }
        } else if (!strcmp(n, "aux")) {
            if (!cJSON_IsObject(it)) {
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an object {loss name: weight}", what, k);
                break;
            }
            memset(m->aux_weight, 0, sizeof(m->aux_weight)); // an explicit list replaces the preset's
            for (const cJSON *a = it->child; a && !st; a = a->next) {
                int kind = 0;
                while (kind < VLMOE_AUX_COUNT && strcmp(vlmoe_aux_name((vlmoe_aux_kind)kind), a->string)) kind++;
                char ak[192];
                snprintf(ak, sizeof(ak), "%s.%s", k, a->string);
                if (kind == VLMOE_AUX_COUNT)
                    st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: unknown auxiliary loss \"%s\"", what, ak);
                else
                    st = read_num(a, what, ak, &m->aux_weight[kind]);
            }
        } else {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: unknown key \"%s\"", what, k);
        }
    }
    return st;
}

static cJSON *moe_json(const vlmoe_moe_config *m) {
    cJSON *o = cJSON_CreateObject(), *layers = cJSON_CreateArray(), *aux = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "router", ROUTER_NAMES[m->router]);
    for (int l = 0; l < 64; l++)
        if (m->layers >> l & 1) cJSON_AddItemToArray(layers, num(l));
    cJSON_AddItemToObject(o, "layers", layers);
    add_num(o, "num_experts", m->num_experts);
    add_num(o, "top_k", m->top_k);
    add_num(o, "capacity_factor", m->capacity_factor);
    add_num(o, "eval_capacity_factor", m->eval_capacity_factor);
    add_num(o, "capacity_multiple", m->capacity_multiple);
    cJSON_AddStringToObject(o, "order", ORDER_NAMES[m->order]);
    cJSON_AddStringToObject(o, "bpr_score", BPR_NAMES[m->bpr_score]);
    cJSON_AddStringToObject(o, "gate_renorm", RENORM_NAMES[m->gate_renorm]);
    add_num(o, "noise_std", m->noise_std);
    add_num(o, "group_size", m->group_size);
    add_num(o, "slots_per_expert", m->slots_per_expert);
    if (m->text_first) cJSON_AddBoolToObject(o, "text_first", 1); // written when set: older files lack it
    if (m->capacity_per_token) cJSON_AddBoolToObject(o, "capacity_per_assignment", 0); // likewise
    if (m->router_per_modality) cJSON_AddBoolToObject(o, "router_per_modality", 1); // likewise
    if (m->text_experts) add_num(o, "text_experts", m->text_experts);
    if (m->soft_mix) cJSON_AddStringToObject(o, "soft_dispatch", SOFT_MIX_NAMES[m->soft_mix]);
    if (m->soft_raw) cJSON_AddBoolToObject(o, "soft_normalize", 0);
    for (int k = 0; k < VLMOE_AUX_COUNT; k++)
        if (m->aux_weight[k] != 0) add_num(aux, vlmoe_aux_name((vlmoe_aux_kind)k), m->aux_weight[k]);
    cJSON_AddItemToObject(o, "aux", aux);
    cJSON *tau = cJSON_CreateArray();
    cJSON_AddItemToArray(tau, num(m->global_tau[0]));
    cJSON_AddItemToArray(tau, num(m->global_tau[1]));
    cJSON_AddItemToObject(o, "global_entropy_tau", tau);
    cJSON *pruned = NULL;
    for (int l = 0; l < 64; l++) {
        if (!m->pruned[l]) continue;
        char key[16];
        snprintf(key, sizeof(key), "%d", l);
        cJSON *list = cJSON_CreateArray();
        for (int e = 0; e < 64; e++)
            if (m->pruned[l] >> e & 1) cJSON_AddItemToArray(list, num(e));
        if (!pruned) pruned = cJSON_AddObjectToObject(o, "pruned");
        cJSON_AddItemToObject(pruned, key, list);
    }
    return o;
}

static int read_key(const cJSON *v, const key_spec *k, const char *what, vlmoe_model_config *c) {
    char *field = (char *)c + k->off;
    int idx;
    switch (k->kind) {
    case K_INT: return read_int(v, what, k->key, (int *)field);
    case K_DOUBLE: return read_num(v, what, k->key, (double *)field);
    case K_BOOL:
        if (!cJSON_IsBool(v)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be true or false", what, k->key);
        *(int *)field = cJSON_IsTrue(v);
        return VLMOE_OK;
    case K_STRING:
        if (!cJSON_IsString(v) || strlen(v->valuestring) >= sizeof(c->name))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be a string of < 64 bytes", what, k->key);
        snprintf(field, sizeof(c->name), "%s", v->valuestring);
        return VLMOE_OK;
    case K_ACT:
        if (!cJSON_IsString(v) || (idx = enum_index(v->valuestring, ACT_NAMES, 3)) < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"gelu\", \"gelu_tanh\" or "
                              "\"quick_gelu\"", what, k->key);
        *(int *)field = idx;
        return VLMOE_OK;
    case K_POOL:
        if (!cJSON_IsString(v) || (idx = enum_index(v->valuestring, POOL_NAMES, 3)) < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"mean\", \"cls\" or \"eot\"",
                              what, k->key);
        *(int *)field = idx;
        return VLMOE_OK;
    case K_ARCH:
        if (!cJSON_IsString(v) || (idx = enum_index(v->valuestring, ARCH_NAMES, 3)) < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"one_tower\", \"two_tower\" or \"mome\"",
                              what, k->key);
        *(vlmoe_arch *)field = (vlmoe_arch)idx;
        return VLMOE_OK;
    }
    return VLMOE_ERR_CONFIG;
}

int vlmoe_config_from_json(const char *json, const char *what, vlmoe_model_config *out) {
    cJSON *root = cJSON_Parse(json);
    int st = VLMOE_OK;
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: not a JSON object", what);
    }
    vlmoe_model_config c;
    memset(&c, 0, sizeof(c));
    const cJSON *base = cJSON_GetObjectItemCaseSensitive(root, "base");
    const int complete = base == NULL;
    int every[2] = {0, 0};
    if (base) {
        if (!cJSON_IsString(base)) {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"base\" must be a model name", what);
            goto done;
        }
        if ((st = vlmoe_config_named(base->valuestring, &c))) {
            vlmoe_error_prefix("%s", what);
            goto done;
        }
    }
    for (const cJSON *it = root->child; it; it = it->next) {
        if (!strcmp(it->string, "base")) continue;
        if (!strcmp(it->string, "moe") || !strcmp(it->string, "text_moe")) {
            int t = it->string[0] != 'm';
            if ((st = read_moe(it, what, it->string, t ? &c.text_moe : &c.moe, &every[t]))) goto done;
            continue;
        }
        if (!strcmp(it->string, "encoder") || !strcmp(it->string, "text_encoder")) {
            vlmoe_encoder_config *e = it->string[0] == 'e' ? &c.encoder : &c.text_encoder;
            if ((st = read_encoder(it, what, it->string, e, complete))) goto done;
            continue;
        }
        const int mk = enum_index(it->string, MOME_KEYS, 8);
        if (mk >= 0) {
            int *f[8] = {&c.vl_layers, &c.mim_vocab, &c.mask_token, &c.num_classes, &c.cls_sequences, &c.retrieval_head,
                         &c.itm_head, &c.beit_init};
            if ((st = read_int(it, what, it->string, f[mk]))) goto done;
            continue;
        }
        int k = 0;
        while (k < NKEYS && strcmp(KEYS[k].key, it->string)) k++;
        if (k == NKEYS) {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: unknown key \"%s\"", what, it->string);
            goto done;
        }
        if ((st = read_key(it, &KEYS[k], what, &c))) goto done;
    }
    if (complete) {
        for (int k = 0; k < NKEYS; k++)
            if (strcmp(KEYS[k].key, "name") && !cJSON_GetObjectItemCaseSensitive(root, KEYS[k].key)) {
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: missing key \"%s\"", what, KEYS[k].key);
                goto done;
            }
        if (!cJSON_GetObjectItemCaseSensitive(root, "encoder") ||
            (c.arch == VLMOE_ARCH_TWO_TOWER && !cJSON_GetObjectItemCaseSensitive(root, "text_encoder"))) {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: missing key \"%s\"", what,
                            cJSON_GetObjectItemCaseSensitive(root, "encoder") ? "text_encoder" : "encoder");
            goto done;
        }
    }
    const int mome = c.arch == VLMOE_ARCH_MOME, below_vl = c.encoder.layers - c.vl_layers;
    if (every[0]) c.moe.layers = vlmoe_moe_every(every[0], mome ? below_vl : c.encoder.layers);
    if (every[1]) c.text_moe.layers = vlmoe_moe_every(every[1], mome ? below_vl : c.text_encoder.layers);
    if ((st = vlmoe_config_validate(&c))) {
        vlmoe_error_prefix("%s", what);
        goto done;
    }
    *out = c;
done:
    cJSON_Delete(root);
    return st;
}

// The text of a JSON config file (at most 1 MiB), malloc'd.
static int read_config_file(const char *path, char **out) {
    const char *why;
    FILE *f = vlmoe_fopen_regular(path, &why);
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open config file: %s", path, why);
    char *buf = NULL;
    long len = -1;
    if (fseek(f, 0, SEEK_END) == 0) len = ftell(f);
    if (len < 0 || len > (1 << 20) || fseek(f, 0, SEEK_SET)) {
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot read config file (or larger than 1 MiB)", path);
    }
    buf = malloc((size_t)len + 1);
    if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot read config file", path);
    }
    fclose(f);
    buf[len] = 0;
    *out = buf;
    return VLMOE_OK;
}

static int is_json_path(const char *path) {
    const size_t n = strlen(path);
    return n >= 5 && !strcmp(path + n - 5, ".json");
}

int vlmoe_config_load(const char *path, vlmoe_model_config *out) {
    if (!is_json_path(path)) return vlmoe_config_named(path, out);
    char *buf;
    int st = read_config_file(path, &buf);
    if (st) return st;
    st = vlmoe_config_from_json(buf, path, out);
    // a file that changes a named model is a model of its own: it is named after the file
    // ("my" for configs/my.json), not its base, unless it has a "name" of its own
    cJSON *root = st ? NULL : cJSON_Parse(buf);
    if (root && !cJSON_GetObjectItemCaseSensitive(root, "name")) {
        const char *stem = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
        snprintf(out->name, sizeof(out->name), "%.*s", (int)strlen(stem) - 5, stem);
    }
    cJSON_Delete(root);
    free(buf);
    return st;
}

int config_sets_vocab(const char *path) {
    char *buf;
    if (!is_json_path(path) || read_config_file(path, &buf)) return 0;
    cJSON *root = cJSON_Parse(buf);
    const int set = cJSON_IsObject(root) && (cJSON_GetObjectItemCaseSensitive(root, "vocab_size") ||
                                             !cJSON_GetObjectItemCaseSensitive(root, "base"));
    cJSON_Delete(root);
    free(buf);
    return set;
}

static cJSON *encoder_json(const vlmoe_encoder_config *e) {
    cJSON *o = cJSON_CreateObject();
    add_num(o, "width", e->width);
    add_num(o, "layers", e->layers);
    add_num(o, "heads", e->heads);
    add_num(o, "mlp_dim", e->mlp_dim);
    return o;
}

char *vlmoe_config_to_json(const vlmoe_model_config *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "name", c->name);
    cJSON_AddStringToObject(o, "arch", ARCH_NAMES[c->arch]);
    add_num(o, "image_size", c->image_size);
    add_num(o, "patch_size", c->patch_size);
    add_num(o, "channels", c->channels);
    add_num(o, "vocab_size", c->vocab_size);
    add_num(o, "context_length", c->context_length);
    add_num(o, "embed_dim", c->embed_dim);
    cJSON_AddItemToObject(o, "encoder", encoder_json(&c->encoder));
    if (c->arch == VLMOE_ARCH_TWO_TOWER) cJSON_AddItemToObject(o, "text_encoder", encoder_json(&c->text_encoder));
    cJSON_AddStringToObject(o, "act", ACT_NAMES[c->act]);
    add_num(o, "ln_eps", c->ln_eps);
    cJSON_AddBoolToObject(o, "patch_bias", c->patch_bias);
    cJSON_AddBoolToObject(o, "image_class_token", c->image_class_token);
    cJSON_AddBoolToObject(o, "image_ln_pre", c->image_ln_pre);
    cJSON_AddStringToObject(o, "image_pool", POOL_NAMES[c->image_pool]);
    cJSON_AddBoolToObject(o, "text_causal", c->text_causal);
    cJSON_AddStringToObject(o, "text_pool", POOL_NAMES[c->text_pool]);
    add_num(o, "init_temperature", c->init_temperature);
    add_num(o, "max_temperature", c->max_temperature);
    if (c->moe.router != VLMOE_ROUTER_NONE) cJSON_AddItemToObject(o, "moe", moe_json(&c->moe));
    if (c->arch != VLMOE_ARCH_ONE_TOWER && c->text_moe.router != VLMOE_ROUTER_NONE)
        cJSON_AddItemToObject(o, "text_moe", moe_json(&c->text_moe));
    if (c->arch == VLMOE_ARCH_MOME) {
        add_num(o, "vl_layers", c->vl_layers);
        add_num(o, "mim_vocab", c->mim_vocab);
        add_num(o, "mask_token", c->mask_token);
        if (c->num_classes > 0) add_num(o, "num_classes", c->num_classes);
        if (c->cls_sequences == 2) add_num(o, "cls_sequences", 2);
        if (c->retrieval_head) add_num(o, "retrieval_head", 1);
        if (c->itm_head) add_num(o, "itm_head", 1);
        if (c->beit_init) add_num(o, "beit_init", 1);
    }
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}
