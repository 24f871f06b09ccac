// itm.c: hard-negative mining for image-text matching (VL-MoE sec. 4.2, which fine-tunes retrieval
// "with image-text contrastive and image-text matching with hard negative mining objectives as in
// VLMo"; VLMo/ALBEF draw each negative from the in-batch softmax of the contrastive similarities,
// the positive's weight set to 0). A host computation on a copy of the logits, so the choice
// carries no gradient. Covered by tests/test_itm.c (hand-worked probabilities and draws).
#include <math.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

uint64_t vlmoe_itm_key(uint64_t seed, long step) {
    return vlmoe_mix64(vlmoe_mix64(seed ^ 0x69746d5f6e656773ull /* "itm_negs" */) ^ (uint64_t)step);
}

// One uniform in [0, 1) of the stream (key, row, side): 53 bits of a mixed word.
static double uniform_at(uint64_t key, int row, int side) {
    return (double)(vlmoe_mix64(key ^ vlmoe_mix64(2 * (uint64_t)row + (uint64_t)side + 1)) >> 11) * 0x1p-53;
}

// The B candidates of query q: s[j * stride] (j = 0..B-1) with q itself excluded. p (B) gets
// exp(s_j - max) / sum over j != q, p[q] = 0; returns the inverse-CDF draw of u (the last
// candidate with p > 0 when rounding leaves u beyond the total).
static int32_t draw(const float *s, size_t stride, int B, int q, double u, double *p) {
    double mx = -INFINITY, z = 0;
    for (int j = 0; j < B; j++)
        if (j != q && s[j * stride] > mx) mx = s[j * stride];
    for (int j = 0; j < B; j++) z += p[j] = j == q ? 0 : exp((double)s[j * stride] - mx);
    int32_t pick = -1;
    double c = 0;
    for (int j = 0; j < B; j++) {
        p[j] /= z;
        if (p[j] > 0 && pick < 0 && u < (c += p[j])) pick = j;
    }
    for (int j = B - 1; pick < 0 && j >= 0; j--)
        if (p[j] > 0) pick = j;
    return pick;
}

int vlmoe_itm_mine(const float *sim, int B, uint64_t key, double *p_text, double *p_image, int32_t *neg_text,
                   int32_t *neg_image) {
    if (!sim || !neg_text || !neg_image || B < 2)
        return vlmoe_fail(VLMOE_ERR_ARG, "ITM mining: needs a B x B similarity matrix with B >= 2 (got B = %d) and "
                          "room for 2B negatives", B);
    for (size_t i = 0; i < (size_t)B * B; i++)
        if (!isfinite(sim[i]))
            return vlmoe_fail(VLMOE_ERR_ARG, "ITM mining: similarity (%zu, %zu) is %g", i / B, i % B, sim[i]);
    double *tmp = vlmoe_alloc(sizeof(double) * (size_t)B, "ITM mining");
    if (!tmp) return VLMOE_ERR_NOMEM;
    for (int i = 0; i < B; i++) { // image i: a text of row i
        double *p = p_text ? p_text + (size_t)i * B : tmp;
        neg_text[i] = draw(sim + (size_t)i * B, 1, B, i, uniform_at(key, i, 0), p);
    }
    for (int j = 0; j < B; j++) { // text j: an image of column j
        double *p = p_image ? p_image + (size_t)j * B : tmp;
        neg_image[j] = draw(sim + j, (size_t)B, B, j, uniform_at(key, j, 1), p);
    }
    vlmoe_free_mem(tmp);
    return VLMOE_OK;
}
