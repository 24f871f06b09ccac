// cost.c: what a model costs: parameters, parameters a token uses, forward FLOPs of an image-text
// pair (vlmoe_config_cost, `vlmoe info`), apart from sizes.c's named sizes so that the config
// parser (and its fuzz target) does not pull in the model's layout. Covered by tests/test_sizes.c,
// which checks LIMoE-B/16's numbers against a hand calculation.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "nn/sizes.h"
#include "vlmoe.h"

// ---------------------------------------------------------------------------------------------
// Cost. FLOPs count a multiply-add as 2 and only the matrix products (LayerNorm, softmax, GELU
// and the routing decision are a few per element, under 1% here). Per token of a block of width
// D, MLP width M, in a sequence of S tokens:
//   attention: QKV 6D^2 + output 2D^2 + scores QK^T 2SD + weighted values 2SD
//   dense MLP 4DM; MoE: router 2DE + K experts 4DM (tokens choice); experts choice: on average
//   cf experts a token; Soft MoE: its E*slots slots over a group of n tokens, 4DM*E*slots/n, and
//   the dispatch/combine products 6D*E*slots (logits, dispatch, combine)
// plus the patch embedding 2*C*P^2*D per patch and the projection 2*D*embed per modality.

typedef struct { int D, M, L; const vlmoe_moe_config *mc; } tower;

// Forward FLOPs of one sequence of S tokens through tower t; layers >= first_vl use the dense
// FFN (VL-MoE's top blocks have no MoE).
static double tower_flops(const tower *t, double S) {
    const double D = t->D, M = t->M;
    double f = 0;
    for (int l = 0; l < t->L; l++) {
        f += S * (8 * D * D + 4 * S * D);
        const vlmoe_moe_config *mc = t->mc;
        if (!mc || mc->router == VLMOE_ROUTER_NONE || l >= 64 || !(mc->layers >> l & 1)) {
            f += S * 4 * D * M;
            continue;
        }
        const double E = mc->num_experts;
        if (mc->router == VLMOE_ROUTER_SOFT) {
            const double slots = E * (mc->slots_per_expert > 0 ? mc->slots_per_expert : 1);
            const double n = mc->group_size > 0 ? mc->group_size : S;
            f += S * (4 * D * M * slots / n + 6 * D * slots);
        } else {
            const double k = mc->router == VLMOE_ROUTER_EXPERTS ? mc->capacity_factor : mc->top_k;
            f += S * (2 * D * E + k * 4 * D * M);
        }
    }
    return f;
}

// Parameters of the experts a token does not use, in tower t.
static double idle_expert_params(const tower *t) {
    const vlmoe_moe_config *mc = t->mc;
    if (!mc || mc->router != VLMOE_ROUTER_TOKENS) return 0; // experts choice, Soft MoE: any expert may
    double n = 0;
    for (int l = 0; l < t->L && l < 64; l++)
        if (mc->layers >> l & 1) {
            n += (double)(mc->num_experts - mc->top_k) * (2.0 * t->D * t->M + t->M + t->D);
            n += mc->router_per_modality ? (double)mc->num_experts * t->D : 0; // the other modality's router
        }
    return n;
}

int vlmoe_config_cost(const vlmoe_model_config *c, vlmoe_model_cost *out) {
    if (!c || !out) return vlmoe_fail(VLMOE_ERR_ARG, "config_cost: NULL argument");
    memset(out, 0, sizeof(*out));
    model_layout L;
    memset(&L, 0, sizeof(L));
    int st = model_layout_build(&L, c); // the parameter table only: nothing is allocated for weights
    if (st) return st;
    out->params = (double)L.total;
    double experts = 0;
    for (int i = 0; i < L.nparams; i++)
        if (strstr(L.table[i].name, ".moe.experts.")) experts += (double)L.table[i].numel;
    out->moe_layers = L.nmoe;
    model_layout_free(&L);

    const int mome = c->arch == VLMOE_ARCH_MOME, two = c->arch == VLMOE_ARCH_TWO_TOWER;
    const int g = c->image_size / c->patch_size;
    const double S_img = (double)g * g + (c->image_class_token ? 1 : 0), S_txt = c->context_length;
    const tower img = {c->encoder.width, c->encoder.mlp_dim, c->encoder.layers, &c->moe};
    const tower txt = two ? (tower){c->text_encoder.width, c->text_encoder.mlp_dim, c->text_encoder.layers, &c->text_moe}
                          : (tower){c->encoder.width, c->encoder.mlp_dim, c->encoder.layers, mome ? &c->text_moe : &c->moe};
    // a one-tower model's image and text tokens share the encoder's experts: count them once
    out->active_params = out->params - idle_expert_params(&img) - (c->arch == VLMOE_ARCH_ONE_TOWER ? 0 : idle_expert_params(&txt));
    out->expert_params = experts;
    const double patch = 2.0 * c->channels * c->patch_size * c->patch_size * img.D * g * g;
    const double proj_i = c->embed_dim > 0 ? 2.0 * img.D * c->embed_dim : 0;
    const double proj_t = c->embed_dim > 0 ? 2.0 * txt.D * c->embed_dim : 0;
    out->gflop_image = (patch + tower_flops(&img, S_img) + proj_i) / 1e9;
    out->gflop_text = (tower_flops(&txt, S_txt) + proj_t) / 1e9;
    out->gflop_pair = out->gflop_image + out->gflop_text;
    out->image_tokens = (int)S_img, out->text_tokens = (int)S_txt;
    return VLMOE_OK;
}
