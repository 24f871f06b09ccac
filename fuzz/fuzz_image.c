// fuzz_image.c: libFuzzer target for image decoding (JPEG, PNG, WebP; src/data/image.c) and both
// preprocessing transforms on whatever decodes. Images above a million pixels are decoded but
// not resampled, to keep each run fast.
#include "data/image.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    vlmoe_image img = {0};
    if (vlmoe_image_decode(data, size, "fuzz", &img) == VLMOE_OK) {
        if (img.w < 1 || img.h < 1 || !img.rgb) abort();   // success means a real image
        if ((size_t)img.w * img.h <= (1u << 20)) {
            vlmoe_image_params p = vlmoe_image_default_params();
            p.size = 24;
            float out[3 * 24 * 24];
            vlmoe_rng rng;
            vlmoe_rng_seed(&rng, size);
            p.flip_prob = 0.5;
            vlmoe_image_preprocess_eval(&img, &p, out);
            vlmoe_image_preprocess_train(&img, &p, &rng, out);
        }
    }
    vlmoe_image_free(&img);
    return 0;
}
