// masking.c: the masks of VL-MoE's masked data modeling (sec. 3.1). MLM: BERT's corruption (15%
// of the tokens chosen; of those 80% [MASK], 10% a random token, 10% kept), also used by VLM with
// 50%. MIM: BEiT's block-wise masking of 40% of the patches (BEiT sec. 2.5, Algorithm 1, as its
// public masking_generator implements it), and the visual-token labels of the masked patches
// from a k-means codebook. Everything is seeded per sequence / image, so a sample's mask does not
// depend on the rest of the batch (sequence b draws from the stream of (seed, b)). Covered by
// tests/test_mome.c (statistics over many draws); the `_from` forms (src/data/masking.h) number
// the items from a global index, which tests/test_train_dist.c checks on several processes.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/masking.h"
#include "vlmoe.h"

// One stream per (seed, item): splitmix inside vlmoe_rng_seed decorrelates neighbouring seeds.
static void item_rng(vlmoe_rng *r, uint64_t seed, uint64_t item) {
    vlmoe_rng_seed(r, seed * 0xd1342543de82ef95ULL + 0x9e3779b97f4a7c15ULL * (item + 1));
}

vlmoe_mlm_params vlmoe_mlm_default_params(const vlmoe_model_config *c) {
    return (vlmoe_mlm_params){0.15, 0.8, 0.1, c->mask_token, VLMOE_TOK_UNK + 1, c->vocab_size};
}

int vlmoe_mlm_mask(const vlmoe_mlm_params *p, uint64_t seed, const int32_t *tokens,
                   const int32_t *lengths, int B, int T, int32_t *input, int32_t *labels) {
    return mlm_mask_from(p, seed, 0, tokens, lengths, B, T, input, labels);
}

int mlm_mask_from(const vlmoe_mlm_params *p, uint64_t seed, uint64_t first, const int32_t *tokens,
                  const int32_t *lengths, int B, int T, int32_t *input, int32_t *labels) {
    if (!(p->prob >= 0 && p->prob <= 1 && p->mask_frac >= 0 && p->random_frac >= 0 &&
          p->mask_frac + p->random_frac <= 1 + 1e-12))
        return vlmoe_fail(VLMOE_ERR_ARG, "MLM masking: need 0 <= prob <= 1 and mask_frac, random_frac >= 0 "
                          "summing to <= 1 (got %g, %g, %g)", p->prob, p->mask_frac, p->random_frac);
    const int in_range = p->mask_id >= p->random_lo && p->mask_id < p->random_hi;
    if (p->mask_id < 0 || p->random_lo < 0 || p->random_hi - p->random_lo - in_range < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "MLM masking: [MASK] id %d and random ids [%d, %d) must leave at "
                          "least one random token", p->mask_id, p->random_lo, p->random_hi);
    if (B < 1 || T < 1) return vlmoe_fail(VLMOE_ERR_ARG, "MLM masking: empty batch (%d x %d)", B, T);
    for (int b = 0; b < B; b++) {
        const int len = lengths[b];
        if (len < 0 || len > T) return vlmoe_fail(VLMOE_ERR_ARG, "MLM masking: text %d has length %d, not in [0, %d]", b, len, T);
        const int32_t *t = tokens + (size_t)b * T;
        int32_t *in = input + (size_t)b * T, *lab = labels + (size_t)b * T;
        vlmoe_rng r;
        item_rng(&r, seed, first + (uint64_t)b);
        for (int i = 0; i < T; i++) {
            in[i] = t[i];
            lab[i] = -1;
            if (i == 0 || i >= len - 1 || vlmoe_rng_uniform(&r) >= p->prob) continue; // [T_CLS], [T_SEP], padding
            lab[i] = t[i];
            const double v = vlmoe_rng_uniform(&r);
            if (v < p->mask_frac) {
                in[i] = p->mask_id;
            } else if (v < p->mask_frac + p->random_frac) {
                int32_t id = p->random_lo + (int32_t)vlmoe_rng_below(&r, (uint32_t)(p->random_hi - p->random_lo - in_range));
                in[i] = in_range && id >= p->mask_id ? id + 1 : id; // never [MASK] itself
            }
        }
    }
    return VLMOE_OK;
}

// One block (BEiT masking_generator._mask): up to 10 draws of a rectangle whose new patches are
// between 1 and max_new; returns how many patches it masked.
static int mask_block(vlmoe_rng *r, uint8_t *mask, int h, int w, int min_area, int max_new) {
    const double la = log(0.3), lb = log(1 / 0.3);
    for (int attempt = 0; attempt < 10; attempt++) {
        const double lo = min_area, hi = max_new;
        const double area = lo + (hi - lo) * vlmoe_rng_uniform(r); // random.uniform(lo, hi), either order
        const double aspect = exp(la + (lb - la) * vlmoe_rng_uniform(r));
        const int bh = (int)rint(sqrt(area * aspect)), bw = (int)rint(sqrt(area / aspect));
        int delta = 0;
        // BEiT's generator wants the block strictly inside the grid (w < width); on the small
        // grids of test models that leaves masks empty, so a block may span the whole grid
        if (bw >= 1 && bh >= 1 && bw <= w && bh <= h) {
            const int top = (int)vlmoe_rng_below(r, (uint32_t)(h - bh + 1));
            const int left = (int)vlmoe_rng_below(r, (uint32_t)(w - bw + 1));
            int already = 0;
            for (int i = top; i < top + bh; i++)
                for (int j = left; j < left + bw; j++) already += mask[i * w + j];
            const int fresh = bh * bw - already;
            if (fresh > 0 && fresh <= max_new)
                for (int i = top; i < top + bh; i++)
                    for (int j = left; j < left + bw; j++)
                        if (!mask[i * w + j]) mask[i * w + j] = 1, delta++;
        }
        if (delta > 0) return delta;
    }
    return 0;
}

int vlmoe_mim_block_mask(int h, int w, double ratio, uint64_t seed, uint8_t *mask) {
    if (h < 1 || w < 1 || h > 4096 || w > 4096 || !(ratio >= 0 && ratio <= 1))
        return vlmoe_fail(VLMOE_ERR_ARG, "MIM masking: grid %d x %d, ratio %g: need 1..4096 and a ratio in [0, 1]",
                          h, w, ratio);
    memset(mask, 0, (size_t)h * w);
    const int target = (int)rint(ratio * h * w);
    // BEiT: blocks of at least 16 patches on its 14 x 14 grid; smaller grids keep the target
    const int min_area = target < 16 ? (target > 0 ? target : 1) : 16;
    vlmoe_rng r;
    item_rng(&r, seed, 0);
    for (int count = 0; count < target;) {
        const int delta = mask_block(&r, mask, h, w, min_area, target - count);
        if (!delta) break;
        count += delta;
    }
    return VLMOE_OK;
}

int vlmoe_mim_labels(const vlmoe_model_config *c, const float *codebook, int K, const float *images,
                     int B, double ratio, uint64_t seed, int32_t *labels) {
    return mim_labels_from(c, codebook, K, images, B, ratio, seed, 0, labels);
}

int mim_labels_from(const vlmoe_model_config *c, const float *codebook, int K, const float *images,
                    int B, double ratio, uint64_t seed, uint64_t first, int32_t *labels) {
    if (c->arch != VLMOE_ARCH_MOME || K != c->mim_vocab)
        return vlmoe_fail(VLMOE_ERR_ARG, "MIM labels: the codebook has %d entries, model '%s' predicts %d "
                          "visual tokens (mim_vocab)", K, c->name, c->arch == VLMOE_ARCH_MOME ? c->mim_vocab : 0);
    const int g = c->image_size / c->patch_size, np = g * g, pd = c->channels * c->patch_size * c->patch_size;
    float *patches = vlmoe_alloc(sizeof(float) * (size_t)B * np * pd, "patches");
    uint8_t *mask = vlmoe_alloc((size_t)np, "patch mask");
    int st = patches && mask ? vlmoe_patchify(c, images, B, patches) : VLMOE_ERR_NOMEM;
    if (!st) vlmoe_kmeans_assign(codebook, K, pd, patches, (size_t)B * np, labels);
    for (int b = 0; b < B && !st; b++) {
        // image b's mask draws from its own stream, like vlmoe_mlm_mask's sequences
        if ((st = vlmoe_mim_block_mask(g, g, ratio, seed * 0xd1342543de82ef95ULL + first + (uint64_t)b, mask))) break;
        for (int p = 0; p < np; p++)
            if (!mask[p]) labels[(size_t)b * np + p] = -1;
    }
    vlmoe_free_mem(patches);
    vlmoe_free_mem(mask);
    return st;
}

// BEiT-3's captioning masks (its captioning data set's _masking_on_text_tokens): an exact count of
// distinct positions drawn uniformly from [1, len), the end token among them.
int vlmoe_caption_mask(const vlmoe_mlm_params *p, uint64_t seed, const int32_t *tokens, const int32_t *lengths,
                       int B, int T, int32_t *input, int32_t *labels) {
    if (!(p->prob > 0 && p->prob <= 1 && p->mask_frac >= 0 && p->random_frac >= 0 &&
          p->mask_frac + p->random_frac <= 1 + 1e-12))
        return vlmoe_fail(VLMOE_ERR_ARG, "caption masking: need 0 < prob <= 1 and mask_frac, random_frac >= 0 "
                          "summing to <= 1 (got %g, %g, %g)", p->prob, p->mask_frac, p->random_frac);
    const int in_range = p->mask_id >= p->random_lo && p->mask_id < p->random_hi;
    if (p->mask_id < 0 || p->random_lo < 0 || p->random_hi - p->random_lo - in_range < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "caption masking: [MASK] id %d and random ids [%d, %d) must leave at "
                          "least one random token", p->mask_id, p->random_lo, p->random_hi);
    if (B < 1 || T < 1) return vlmoe_fail(VLMOE_ERR_ARG, "caption masking: empty batch (%d x %d)", B, T);
    for (int b = 0; b < B; b++) {
        const int len = lengths[b];
        if (len < 2 || len > T)
            return vlmoe_fail(VLMOE_ERR_ARG, "caption masking: caption %d has length %d, not in [2, %d] (a caption is "
                              "[T_CLS] words [T_SEP])", b, len, T);
        const int32_t *t = tokens + (size_t)b * T;
        int32_t *in = input + (size_t)b * T, *lab = labels + (size_t)b * T;
        vlmoe_rng r;
        item_rng(&r, seed ^ 0x63617074696f6eULL /* "caption" */, (uint64_t)b);
        for (int i = 0; i < T; i++) in[i] = t[i], lab[i] = -1;
        int want = (int)(len * p->prob + 0.5);
        want = want > len - 1 ? len - 1 : want < 1 ? 1 : want;
        for (int done = 0; done < want;) {
            const int i = 1 + (int)vlmoe_rng_below(&r, (uint32_t)(len - 1));
            if (lab[i] >= 0) continue;
            lab[i] = t[i], done++;
            const double v = vlmoe_rng_uniform(&r);
            if (v < p->mask_frac) {
                in[i] = p->mask_id;
            } else if (v < p->mask_frac + p->random_frac) {
                int32_t id = p->random_lo + (int32_t)vlmoe_rng_below(&r, (uint32_t)(p->random_hi - p->random_lo - in_range));
                in[i] = in_range && id >= p->mask_id ? id + 1 : id;
            }
        }
    }
    return VLMOE_OK;
}
