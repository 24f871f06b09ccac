// groups.c: checks that the tokens of a forward pass split into this MoE layer's routing groups
// (MOE.md "Grouped routing": the number of groups must divide the token count) and that the
// capacity per group is at least one. Covered by tests/test_moe_layer.c.
#include <math.h>

#include "core/core.h"
#include "moe/layer.h"

int moe_check_groups(const moe_spec *sp, int n, int training) {
    const vlmoe_moe_config *c = sp->cfg;
    const int S = c->group_size > 0 ? c->group_size : n;
    if (n < 1) return VLMOE_OK;
    if (S > n || n % S)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "moe: the %d tokens of this pass do not split into routing "
                          "groups of group_size %d (it must divide the token count: images x image "
                          "tokens + texts x context length share the encoder in one_tower)", n, S);
    if (c->router == VLMOE_ROUTER_SOFT) return VLMOE_OK;
    const int K = c->router == VLMOE_ROUTER_TOKENS ? c->top_k : 1;
    int C;
    int st = vlmoe_capacity(S, c->num_experts, K, training ? c->capacity_factor : c->eval_capacity_factor,
                            c->capacity_multiple > 0 ? c->capacity_multiple : 1, &C);
    if (st) vlmoe_error_prefix("moe (%d tokens per group, %d experts)", S, c->num_experts);
    return st;
}

int moe_slots_per_expert(const vlmoe_moe_config *c) {
    return c->slots_per_expert ? c->slots_per_expert : (int)rint((double)c->group_size / c->num_experts);
}
