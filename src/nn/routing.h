// routing.h: the MoE layer behind a routing-statistics index, for vlmoe_model_routing
// (src/nn/routing.c). graph_moe_layer_* is in src/nn/graph.c, mome_graph_moe_layer_* in
// src/nn/mome.c. Covered by tests/test_routing.c.
#ifndef VLMOE_NN_ROUTING_H
#define VLMOE_NN_ROUTING_H

#define ROUTING_DECL(S)                                                                          \
    struct moe_state_##S;                                                                        \
    struct graph_##S;                                                                            \
    struct mome_graph_##S;                                                                       \
    /* the layer whose statistics are at `index` of the graph's list; NULL if none */           \
    const struct moe_state_##S *graph_moe_layer_##S(const struct graph_##S *g, int index);       \
    const struct moe_state_##S *mome_graph_moe_layer_##S(const struct mome_graph_##S *g, int index);

ROUTING_DECL(f32)
ROUTING_DECL(f64)

#endif
