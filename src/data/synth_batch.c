// synth_batch.c: batches of the synthetic dataset for training and evaluation: images, token ids
// and lengths of consecutive samples, generated in parallel (each sample is independent, so the
// result does not depend on the thread count). Covered by tests/test_train.c.
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

int vlmoe_synth_batch(const vlmoe_synth *s, int split, uint64_t first, int n, int ctx,
                      float *images, int32_t *tokens, int32_t *lengths) {
    if (!s || n < 1 || ctx < 2)
        return vlmoe_fail(VLMOE_ERR_ARG, "synthetic batch: need a dataset, n >= 1 and ctx >= 2");
    const int sz = vlmoe_synth_image_size(s);
    const size_t isz = (size_t)3 * sz * sz;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int i = 0; i < n; i++) {
        char caption[256];
        int cls;
        if (vlmoe_synth_sample(s, split, first + (uint64_t)i, images ? images + i * isz : NULL,
                               caption, sizeof(caption), &cls) != VLMOE_OK) {
            bad |= 1;
            continue;
        }
        if (tokens) {
            int len = vlmoe_synth_tokenize(s, caption, tokens + (size_t)i * ctx, ctx);
            if (len < 2) bad |= 1;
            else if (lengths) lengths[i] = len;
        }
    }
    return bad ? vlmoe_fail(VLMOE_ERR_ARG, "synthetic batch: a sample could not be generated") : VLMOE_OK;
}
