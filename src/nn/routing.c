// routing.c: vlmoe_model_routing, the per-token decision of one MoE layer in the last forward
// pass (include/vlmoe.h): finds the layer behind a routing-statistics index in the model's graph
// (through the architecture's table, src/nn/model.h) and reads its decision (moe_routing_f32, src/moe/layer.c). Covered by tests/test_routing.c.
#include "core/core.h"
#include "moe/layer.h"
#include "nn/model.h"
#include "nn/routing.h"

int vlmoe_model_routing(const vlmoe_model *m, int moe_layer, vlmoe_token_route *out, int cap, int *n) {
    if (!m || !n) return vlmoe_fail(VLMOE_ERR_ARG, "routing: NULL model or count");
    *n = 0;
    if (cap < 0) return vlmoe_fail(VLMOE_ERR_ARG, "routing: cap %d < 0", cap);
    int count = 0;
    const vlmoe_moe_stats *stats = vlmoe_model_moe_stats(m, &count);
    const int nmoe = m->L.nmoe;
    if (moe_layer < 0 || moe_layer >= nmoe)
        return vlmoe_fail(VLMOE_ERR_ARG, "routing: MoE layer %d outside [0, %d) (the model has %d MoE "
                          "layers)", moe_layer, nmoe, nmoe);
    const moe_state_f32 *st = m->L.arch->moe_layer ? m->L.arch->moe_layer(m, moe_layer) : NULL;
    // a layer that routed nothing in the last forward still holds an older pass's decision
    if (!st || !stats || moe_layer >= count || stats[moe_layer].tokens[0] + stats[moe_layer].tokens[1] == 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "routing: MoE layer %d routed no tokens in the last forward pass "
                          "(none has run yet, or it did not reach this layer)", moe_layer);
    return moe_routing_f32(st, out, cap, n);
}
