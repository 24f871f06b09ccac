// masking.h: the masks of VL-MoE's masked data modeling (src/data/masking.c) with the items
// numbered from `first`: item b of the call draws the stream of item first + b, so a process
// holding samples first.. of a global batch draws the masks one process draws for them
// (vlmoe_mlm_mask and vlmoe_mim_labels are these with first 0). Covered by tests/test_mome.c and,
// on several processes, tests/test_train_dist.c.
#ifndef VLMOE_DATA_MASKING_H
#define VLMOE_DATA_MASKING_H
#include <stdint.h>

#include "vlmoe.h"

int mlm_mask_from(const vlmoe_mlm_params *p, uint64_t seed, uint64_t first, const int32_t *tokens,
                  const int32_t *lengths, int B, int T, int32_t *input, int32_t *labels);
int mim_labels_from(const vlmoe_model_config *c, const float *codebook, int K, const float *images,
                    int B, double ratio, uint64_t seed, uint64_t first, int32_t *labels);

#endif
