// info.c: `vlmoe info --model NAME`: what a model costs before anything is allocated: parameters,
// the parameters a token uses, forward GFLOP per image-text pair (vlmoe_config_cost,
// src/nn/sizes.c), as text or --json. Covered by tests/test_sizes.c.
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "args.h"
#include "cli.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe info --model NAME|FILE.json [--json]\n\n"
    "What a model costs, from its config alone (nothing is allocated, so the largest sizes such as\n"
    "limoe-H/14 are fine): its parameters, the parameters a token uses (all but the experts its\n"
    "router does not pick: E - K of each tokens-choice MoE layer; experts-choice and Soft MoE layers\n"
    "count all), and the forward GFLOP of one image and one text, each encoded alone (a multiply-add\n"
    "counts 2; matrix products: attention projections and scores, MLPs and experts, routers, patch\n"
    "embedding, output projections). The papers' sizes: limoe-S/16, -B/32, -B/16, -L/32, -L/16, -H/14\n"
    "(LIMoE Table 4, 32 experts every second block; H/14 in blocks 3, 7, ..., 32), clipup-B/16,\n"
    "clipup-L/14 (8 experts, top-2, both towers), vlmoe-base, vlmoe-large (E = 16).";

static const char *arch_name(vlmoe_arch a) {
    return a == VLMOE_ARCH_ONE_TOWER ? "one_tower" : a == VLMOE_ARCH_TWO_TOWER ? "two_tower" : "mome";
}

int cmd_info(int argc, char **argv) {
    const char *model = NULL;
    int json = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "NAME|FILE.json", "a named config (vlmoe train --help lists them) or a JSON file"},
        {"json", ARG_FLAG, &json, NULL, "print one JSON object instead of text"},
    };
    int rc = args_parse("info", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (!model) return cli_error("info", "give --model NAME|FILE.json (see vlmoe info --help)");
    vlmoe_model_config c;
    if (vlmoe_config_load(model, &c)) return cli_error("info", "--model %s: %s", model, vlmoe_last_error());
    vlmoe_model_cost k;
    if (vlmoe_config_cost(&c, &k)) return cli_error("info", "--model %s: %s", model, vlmoe_last_error());
    const vlmoe_moe_config *mc = &c.moe;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", c.name);
        cJSON_AddStringToObject(o, "arch", arch_name(c.arch));
        const char *nk[] = {"params", "active_params", "expert_params", "gflop_pair", "gflop_image", "gflop_text",
                            "moe_layers", "image_tokens", "text_tokens"};
        const double nv[] = {k.params, k.active_params, k.expert_params, k.gflop_pair, k.gflop_image, k.gflop_text,
                             k.moe_layers, k.image_tokens, k.text_tokens};
        for (int i = 0; i < 9; i++) cJSON_AddNumberToObject(o, nk[i], nv[i]);
        if (mc->router_per_modality) cJSON_AddBoolToObject(o, "router_per_modality", 1);
        if (mc->text_experts) cJSON_AddNumberToObject(o, "text_experts", mc->text_experts);
        char *s = cJSON_Print(o);
        if (s) printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
        return s ? 0 : cli_error("info", "out of memory");
    }
    printf("model %s: %s, %d blocks of width %d (MLP %d), %d MoE layer%s", c.name, arch_name(c.arch), c.encoder.layers,
           c.encoder.width, c.encoder.mlp_dim, k.moe_layers, k.moe_layers == 1 ? "" : "s");
    if (k.moe_layers) printf(" of %d experts (top-%d)", mc->num_experts, mc->top_k);
    printf("\n");
    // LIMoE appendix E.3
    if (k.moe_layers && mc->router_per_modality) printf("routers              one per modality (image, text)\n");
    if (k.moe_layers && mc->text_experts)
        printf("expert pools         image experts 0-%d, text experts %d-%d (disjoint)\n",
               mc->num_experts - mc->text_experts - 1, mc->num_experts - mc->text_experts, mc->num_experts - 1);
    printf("parameters           %.1fM (experts %.1fM)\n", k.params / 1e6, k.expert_params / 1e6);
    printf("active per token     %.1fM\n", k.active_params / 1e6);
    printf("tokens               %d image + %d text\n", k.image_tokens, k.text_tokens);
    printf("GFLOP per pair       %.2f (image %.2f, text %.2f), forward\n", k.gflop_pair, k.gflop_image, k.gflop_text);
    return 0;
}
