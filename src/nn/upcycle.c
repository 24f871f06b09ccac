// upcycle.c: sparse upcycling (CLIP-UP sec. 3, MOE.md "Sparse upcycling"): a dense model's
// chosen MLPs become E experts, each a copy of the dense weights (optionally plus small noise),
// routers freshly initialised, every other tensor copied. With K=1, gate_renorm after_routing
// and ample capacity the result computes exactly what the dense model did (tests/test_moe_layer.c).
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "vlmoe.h"

// "X.blocks.L.moe.experts.fc1.weight" -> "X.blocks.L.mlp.fc1.weight" (0 if not an expert tensor)
static int dense_name(const char *moe_name, char *out, size_t n) {
    const char *p = strstr(moe_name, ".moe.experts.");
    if (!p) return 0;
    snprintf(out, n, "%.*s.mlp.%s", (int)(p - moe_name), moe_name, p + strlen(".moe.experts."));
    return 1;
}

int vlmoe_model_upcycle(vlmoe_model **out, const vlmoe_model *dense, const vlmoe_moe_config *moe,
                        const vlmoe_moe_config *text_moe, uint64_t seed, double noise) {
    *out = NULL;
    vlmoe_model_config cfg = *vlmoe_model_get_config(dense);
    if (cfg.moe.router != VLMOE_ROUTER_NONE || (cfg.arch == VLMOE_ARCH_TWO_TOWER && cfg.text_moe.router != VLMOE_ROUTER_NONE))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "upcycle: model '%s' already has MoE layers", cfg.name);
    cfg.moe = *moe;
    if (cfg.arch == VLMOE_ARCH_TWO_TOWER && text_moe) cfg.text_moe = *text_moe;
    vlmoe_model *m;
    int st = vlmoe_model_init(&m, &cfg, seed); // fresh routers (and Soft MoE slots) come from here
    if (!st && (st = model_copy_inputs(m, dense))) vlmoe_model_free(m);
    if (st) return st;
    int nd, nm;
    const vlmoe_param_info *td = vlmoe_model_params(dense, &nd), *tm = vlmoe_model_params(m, &nm);
    const float *pd = vlmoe_model_param_data((vlmoe_model *)dense);
    float *pm = vlmoe_model_param_data(m);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, seed ^ 0xa5a5a5a5ULL);
    for (int i = 0; i < nm; i++) {
        char src[128];
        const int expert = dense_name(tm[i].name, src, sizeof(src));
        const char *want = expert ? src : tm[i].name;
        int j = 0;
        while (j < nd && strcmp(td[j].name, want)) j++;
        if (j == nd) continue; // a router or Soft MoE slots: freshly initialised
        const size_t per = td[j].numel, copies = expert ? tm[i].numel / per : 1;
        if (per * copies != tm[i].numel) {
            vlmoe_model_free(m);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "upcycle: %s has %zu elements, not a multiple of %s's %zu",
                              tm[i].name, tm[i].numel, td[j].name, per);
        }
        for (size_t c = 0; c < copies; c++)
            for (size_t k = 0; k < per; k++)
                pm[tm[i].offset + c * per + k] = pd[td[j].offset + k] + (expert && noise > 0 ? (float)(noise * vlmoe_rng_normal(&r)) : 0.0f);
    }
    *out = m;
    return VLMOE_OK;
}
