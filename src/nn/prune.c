// prune.c: LIMoE's expert pruning for one-modality inference (LIMoE appendix E.4, MOE.md "Expert
// pruning"). In every MoE layer of the tower that serves the modality, the experts that took the
// smallest share of the modality's tokens are pruned. router_pred keeps them in the softmax and
// only keeps them out of the top-K (a config mask, vlmoe_moe_config.pruned); router_drop removes
// them, router rows included, so the softmax covers the kept experts only. Covered by
// tests/test_prune.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "vlmoe.h"

// Block index of a tensor of the tower `prefix` ("encoder", "image", "text"), -1 if elsewhere.
static int block_of(const char *name, const char *prefix) {
    size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) || strncmp(name + n, ".blocks.", 8)) return -1;
    return atoi(name + n + 8);
}

int vlmoe_model_prune(vlmoe_model **out, const vlmoe_model *m, int modality, const double *usage,
                      int keep, vlmoe_prune_mode mode) {
    *out = NULL;
    vlmoe_model_config cfg = *vlmoe_model_get_config(m);
    const int two = cfg.arch == VLMOE_ARCH_TWO_TOWER, text = modality == VLMOE_MOD_TEXT;
    vlmoe_moe_config *mc = two && text ? &cfg.text_moe : &cfg.moe;
    const char *prefix = two ? (text ? "text" : "image") : "encoder";
    const int E = mc->num_experts;
    if (modality != VLMOE_MOD_IMAGE && modality != VLMOE_MOD_TEXT)
        return vlmoe_fail(VLMOE_ERR_ARG, "prune: unknown modality %d", modality);
    if (mode != VLMOE_PRUNE_ROUTER_PRED && mode != VLMOE_PRUNE_ROUTER_DROP)
        return vlmoe_fail(VLMOE_ERR_ARG, "prune: unknown mode %d", (int)mode);
    if (mc->router != VLMOE_ROUTER_TOKENS)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "prune: the %s tower of '%s' has no tokens-choice MoE layers",
                          prefix, cfg.name);
    if (mc->router_per_modality || mc->text_experts)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "prune: '%s' has per-modality routers or disjoint expert pools (LIMoE "
                          "E.3); pruning them is not supported", cfg.name);
    if (E > 64) return vlmoe_fail(VLMOE_ERR_CONFIG, "prune: %d experts per layer; at most 64 supported", E);
    if (keep < mc->top_k || keep > E)
        return vlmoe_fail(VLMOE_ERR_ARG, "prune: --keep %d must be between top_k = %d and the %d experts of each layer",
                          keep, mc->top_k, E);
    // the kept experts of each MoE block: the `keep` largest shares (ties: lower index)
    uint64_t kept[64] = {0};
    int row = 0;
    for (int l = 0; l < 64; l++) {
        if (!(mc->layers >> l & 1)) continue;
        const double *u = usage + (size_t)row++ * E;
        for (int k = 0; k < keep; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!(kept[l] >> e & 1) && (best < 0 || u[e] > u[best])) best = e;
            kept[l] |= 1ULL << best;
        }
        const uint64_t all = E == 64 ? ~0ULL : (1ULL << E) - 1;
        if (mode == VLMOE_PRUNE_ROUTER_PRED) mc->pruned[l] = all & ~kept[l];
    }
    if (mode == VLMOE_PRUNE_ROUTER_DROP) mc->num_experts = keep;
    snprintf(cfg.name + strlen(cfg.name), sizeof(cfg.name) - strlen(cfg.name), "-%s%d",
             text ? "text" : "image", keep);
    vlmoe_model *p;
    int st = vlmoe_model_init(&p, &cfg, 0);
    if (!st && (st = model_copy_inputs(p, m))) vlmoe_model_free(p);
    if (st) return st;
    int ns, np;
    const vlmoe_param_info *ts = vlmoe_model_params(m, &ns), *tp = vlmoe_model_params(p, &np);
    const float *src = vlmoe_model_param_data((vlmoe_model *)m);
    float *dst = vlmoe_model_param_data(p);
    for (int i = 0; i < np; i++) {
        const vlmoe_param_info *d = &tp[i], *s = &ts[i]; // same tensors in the same order
        const int l = block_of(d->name, prefix);
        if (strcmp(d->name, s->name)) {
            vlmoe_model_free(p);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "prune: tensor %d is %s, expected %s", i, d->name, s->name);
        }
        if (mode == VLMOE_PRUNE_ROUTER_PRED || l < 0 || !strstr(d->name, ".moe.") || d->numel == s->numel) {
            memcpy(dst + d->offset, src + s->offset, sizeof(float) * d->numel);
            continue;
        }
        // router rows and stacked expert tensors: the kept experts' slices, in expert order
        const size_t per = s->numel / (size_t)E;
        size_t o = 0;
        for (int e = 0; e < E; e++)
            if (kept[l] >> e & 1) memcpy(dst + d->offset + per * o++, src + s->offset + per * e, sizeof(float) * per);
    }
    *out = p;
    return VLMOE_OK;
}
