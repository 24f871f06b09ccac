// sizes.h: the papers' named sizes (src/nn/sizes.c), looked up by vlmoe_config_named.
#ifndef VLMOE_SIZES_H
#define VLMOE_SIZES_H
#include "vlmoe.h"

// The names sizes_named knows, comma-separated.
extern const char *const SIZES_NAMES;
// Fills *out with the paper's config of `name` and returns 0, or returns 1 (out untouched) when
// `name` is not one of SIZES_NAMES.
int sizes_named(const char *name, vlmoe_model_config *out);

#endif
