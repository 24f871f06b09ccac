// mome_itm.c: VL-MoE's image-text matching head for retrieval fine-tuning (VL-MoE sec. 4.2, "as
// in VLMo"): a linear 2-way classifier "itm_head" (class 1 = matched) on the fused [T_CLS]
// feature of each pair of a pair-encoding graph (src/nn/mome.c), trained with the mean softmax
// cross-entropy over the pairs; its feature gradient enters the graph's backward through
// mome_graph_set_feature_grad, as the contrastive head's does. VLMo puts a tanh pooler before
// the classifier; here the head reads the final-LayerNorm feature directly, like this model's
// other heads. Compiled as float and double; covered by tests/test_itm.c (finite differences,
// PyTorch parity against tests/ref/gen_itm.py).
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "nn/block.h"
#include "nn/mome.h"
#include "ops/backend.h"

struct R(mome_itm) {
    const model_layout *L;
    const R(vlmoe_backend) *be;
    int n, D;
    real *feat, *logits, *probs, *dlog, *dfeat; // (n,D), (n,2), (n,2), (n,2), (n,D)
    int32_t *labels;                            // (n) of the last forward with labels (table memory)
    int have_loss;
    real *arena;
};

static void itm_plan(struct R(mome_itm) *c, carver *k) {
    const size_t n = (size_t)c->n, D = (size_t)c->D;
    c->feat = carve(k, n * D);
    c->logits = carve(k, n * 2);
    c->probs = carve(k, n * 2);
    c->dlog = carve(k, n * 2);
    c->dfeat = carve(k, n * D);
}

int R(mome_itm_create)(struct R(mome_itm) **out, const model_layout *L, const R(vlmoe_backend) *be, int n) {
    *out = NULL;
    if (!L->mome || L->mome->itm_w == NO_PARAM)
        return vlmoe_fail(VLMOE_ERR_ARG, "model '%s' has no image-text matching head (itm_head = 0)", L->cfg.name);
    if (n < 1) return vlmoe_fail(VLMOE_ERR_ARG, "ITM head: need >= 1 pair, got %d", n);
    struct R(mome_itm) *c = vlmoe_calloc(sizeof(*c), "ITM head");
    if (!c) return VLMOE_ERR_NOMEM;
    *c = (struct R(mome_itm)){.L = L, .be = be, .n = n, .D = L->enc[0].width};
    carver k = {NULL, 0};
    itm_plan(c, &k);
    c->arena = be->alloc(be, sizeof(real) * k.used, "ITM head");
    c->labels = be->alloc(be, sizeof(int32_t) * (size_t)n, "ITM labels");
    if (!c->arena || !c->labels) return R(mome_itm_free)(c), VLMOE_ERR_NOMEM;
    k = (carver){c->arena, 0};
    itm_plan(c, &k);
    *out = c;
    return VLMOE_OK;
}

void R(mome_itm_free)(struct R(mome_itm) *c) {
    if (!c) return;
    if (c->arena) c->be->free(c->be, c->arena);
    if (c->labels) c->be->free(c->be, c->labels);
    vlmoe_free_mem(c);
}

double R(mome_itm_forward)(struct R(mome_itm) *c, const struct R(mome_graph) *g, const real *P, const int32_t *labels,
                           double *acc) {
    const R(vlmoe_backend) *be = c->be;
    const int n = c->n, D = c->D;
    const mome_layout *X = c->L->mome;
    for (int b = 0; b < n; b++) be->copy(be, c->feat + (size_t)b * D, R(mome_graph_feature)(g, b), D);
    be->linear_forward(be, c->logits, c->feat, P + X->itm_w, P + X->itm_b, n, D, 2, 0);
    c->have_loss = labels != NULL;
    if (!labels) return 0;
    be->upload_bytes(be, c->labels, labels, sizeof(int32_t) * (size_t)n);
    int right = 0;
    const double loss = be->xent_forward(be, c->probs, c->logits, c->labels, n, 2, &right) / n;
    if (acc) *acc = (double)right / n;
    return loss;
}

const real *R(mome_itm_logits)(const struct R(mome_itm) *c) { return c->logits; }

void R(mome_itm_backward)(struct R(mome_itm) *c, struct R(mome_graph) *g, const real *P, real *G) {
    const R(vlmoe_backend) *be = c->be;
    const int n = c->n, D = c->D;
    const mome_layout *X = c->L->mome;
    be->zero(be, c->dfeat, (size_t)n * D);
    if (c->have_loss) {
        be->zero(be, c->dlog, (size_t)n * 2);
        be->xent_backward(be, c->dlog, c->probs, c->labels, n, 2, 1.0 / n);
        be->linear_backward(be, c->dfeat, G + X->itm_w, G + X->itm_b, c->dlog, c->feat, P + X->itm_w, n, D, 2);
    }
    R(mome_graph_set_feature_grad)(g, c->dfeat);
    R(mome_graph_backward)(g, P, G);
    R(mome_graph_set_feature_grad)(g, NULL);
}
