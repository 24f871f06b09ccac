// masked.h: the cross-entropy of masked data modeling (VL-MoE sec. 3.1: MLM, MIM, VLM predict
// the ids of masked text tokens and the visual tokens of masked patches). Compiled for float and
// double (src/loss/masked.c). Covered by tests/test_mome.c (finite differences, golden values).
#ifndef VLMOE_LOSS_MASKED_H
#define VLMOE_LOSS_MASKED_H
#include <stdint.h>

#define XENT_DECL(T, S)                                                                          \
    /* probs (n,C) = softmax(logits (n,C)) row-wise (probs may alias logits); returns the SUM */ \
    /* over rows of -log probs[label]; *correct counts rows whose argmax (ties: lower) is the */  \
    /* label. labels in [0, C). */                                                               \
    double xent_forward_##S(T *probs, const T *logits, const int32_t *labels, int n, int C,      \
                            int *correct);                                                       \
    /* dlogits (n,C) += scale * (probs - onehot(label)): the gradient of scale * that sum */     \
    void xent_backward_##S(T *dlogits, const T *probs, const int32_t *labels, int n, int C,       \
                           double scale);

XENT_DECL(float, f32)
XENT_DECL(double, f64)

#endif
