// image.h: image decoding (JPEG, PNG, WebP, detected by magic bytes) and the preprocessing that
// writes the model's (3, S, S) float input (MODEL.md "Data": resize shorter side bicubic + center
// crop, or random resized crop; CLIP / LIMoE normalisation). Implemented in src/data/image.c,
// covered by tests/test_image.c (PIL parity fixture from tests/ref/gen_image.py).
//
// Everything up to "internal" below is meant for include/vlmoe.h; vlmoe_rng (src/core/core.h)
// would have to become public with it, since the train transform draws from one.
#ifndef VLMOE_DATA_IMAGE_H
#define VLMOE_DATA_IMAGE_H

#include <stddef.h>
#include <stdint.h>
#include "core/core.h"

// Limits checked on the header, before any pixel memory is allocated.
#define VLMOE_IMAGE_MAX_SIDE 16384
#define VLMOE_IMAGE_MAX_PIXELS ((size_t)1 << 28)
// The decode cap unless raised (vlmoe_image.max_pixels, vlmoe_image_params.max_pixels): PIL's
// MAX_IMAGE_PIXELS, 2^30 / 4 / 3 (a 1.5 GB decompression bomb then costs a skip, not gigabytes)
#define VLMOE_IMAGE_DEFAULT_PIXELS ((size_t)89478485)
#define VLMOE_IMAGE_MAX_FILE ((size_t)1 << 30)   // vlmoe_image_load refuses bigger files

typedef enum {
    VLMOE_IMAGE_UNKNOWN = 0, VLMOE_IMAGE_JPEG = 1, VLMOE_IMAGE_PNG = 2, VLMOE_IMAGE_WEBP = 3,
} vlmoe_image_format;

// An 8-bit RGB image, rows top to bottom, pixels interleaved: rgb (h, w, 3).
// The buffer can be reused: a decode or resize into an image whose `cap` is large enough
// writes into `rgb` in place (a loader thread decodes every image into the same buffer), else
// it allocates a new buffer (releasing the old one only if `owned`). A caller-provided buffer
// is set up as {.rgb = buf, .cap = bytes, .owned = 0} and is never freed by vlmoe. A zeroed
// struct is an empty image. After a failure, w = h = 0 and the buffer is kept for reuse.
typedef struct {
    int w, h;
    uint8_t *rgb;
    size_t cap;     // bytes available at rgb
    int owned;      // 1: rgb was allocated by vlmoe and vlmoe_image_free releases it
    size_t max_pixels; // decoding: an image declaring more pixels is refused before its pixels are
                       // allocated (a decompression bomb); 0: VLMOE_IMAGE_DEFAULT_PIXELS
} vlmoe_image;

// Makes img a w x h image (contents undefined), reusing its buffer when large enough.
int vlmoe_image_alloc(vlmoe_image *img, int w, int h);
void vlmoe_image_free(vlmoe_image *img);   // releases an owned buffer, zeroes img; NULL is safe

vlmoe_image_format vlmoe_image_detect(const void *data, size_t n);
const char *vlmoe_image_format_name(vlmoe_image_format f);   // "JPEG", "PNG", "WebP", "unknown"

// Decodes a JPEG, PNG or WebP held in memory into 8-bit RGB, like PIL's
// Image.open(f).convert("RGB"):
//   JPEG: libjpeg-turbo, islow DCT, fancy upsampling (PIL's settings, so pixels match PIL);
//         greyscale replicated; CMYK/YCCK converted with PIL's formula, which assumes Adobe's
//         inverted CMYK for every CMYK JPEG (as Photoshop writes them).
//   PNG:  palette expanded, greyscale replicated, 16-bit reduced to the high byte, alpha and
//         tRNS dropped (not composited), exactly as PIL's convert("RGB") does. One difference:
//         PIL opens 16-bit greyscale as mode "I" and convert("RGB") clips it to 0..255 (most of
//         the image turns white); vlmoe takes the high byte as for every other 16-bit PNG.
//   WebP: libwebp, still images only (animated WebP is an error); alpha dropped.
// `name` (a path or a webdataset key; NULL for "<memory>") starts every error message, followed
// by the library's own message. Corrupt or truncated data is VLMOE_ERR_FORMAT, never a partial
// image: libjpeg's corrupt-data warnings ("Premature end of JPEG file", "Corrupt JPEG data: ...")
// count as errors; only warnings about metadata (unknown JFIF revision or Adobe transform, bad
// ICC marker, extraneous bytes between header segments) are tolerated. Dimensions above
// VLMOE_IMAGE_MAX_SIDE per side or VLMOE_IMAGE_MAX_PIXELS are rejected before allocation.
int vlmoe_image_decode(const void *data, size_t n, const char *name, vlmoe_image *img);
// Reads a whole file and decodes it; messages name the path.
int vlmoe_image_load(const char *path, vlmoe_image *img);

// ---------------------------------------------------------------------------------------------
// Preprocessing. Thread-safe (no global state); each call allocates its scratch (a few times
// 3 x source rows x S bytes). Resampling is PIL's Image.resize(size, Image.BICUBIC) bit for
// bit: separable convolution (a = -0.5), support scaled by the downscale factor (antialiased
// when shrinking), coefficients normalised per output pixel and quantised to 22-bit fixed
// point, horizontal pass then vertical pass with the intermediate rounded and clipped to uint8
// (PIL 9.x's 8-bit path). Crops are torchvision's. The float output is torchvision's ToTensor +
// Normalize in float32: (v / 255 - mean[c]) / std[c], laid out (3, S, S).
typedef struct {
    int size;               // S, the square output side (224)
    float mean[3], std[3];  // CLIP (0.48145466, 0.4578275, 0.40821073) / (0.26862954,
                            // 0.26130258, 0.27577711); LIMoE's [-1, 1] is 0.5 / 0.5
    double scale_min, scale_max;  // train: crop area as a fraction of the image (0.9, 1.0)
    double ratio_min, ratio_max;  // train: crop aspect w/h, sampled log-uniformly (3/4, 4/3)
    double flip_prob;       // train: horizontal flip probability (0: OpenCLIP does not flip)
    double color_jitter;    // train: brightness, contrast and saturation strength S of timm's /
                            // BEiT's --color-jitter (0: none; VL-MoE / BEiT pre-train with 0.4)
    long max_pixels;        // decoding: images declaring more pixels are skipped before their pixels
                            // are allocated (VLMOE_IMAGE_DEFAULT_PIXELS; at most VLMOE_IMAGE_MAX_PIXELS)
} vlmoe_image_params;
vlmoe_image_params vlmoe_image_default_params(void);   // CLIP's, S = 224

typedef struct { int x, y, w, h; } vlmoe_image_box;    // a region: left, top, width, height

// torchvision Resize(size) with an int size: the shorter side becomes `size`, the longer
// int(size * long / short) (truncated).
void vlmoe_image_shorter_side_dims(int w, int h, int size, int *out_w, int *out_h);
// torchvision CenterCrop offsets: top = round((h - ch) / 2), left = round((w - cw) / 2) with
// Python's round (half to even). Needs cw <= w and ch <= h (no padding).
vlmoe_image_box vlmoe_image_center_box(int w, int h, int cw, int ch);
// torchvision RandomResizedCrop.get_params with draws from rng: up to 10 tries of an area in
// [scale_min, scale_max] x w x h and a log-uniform aspect in [ratio_min, ratio_max] that fits,
// else the center crop of the whole image clamped to the ratio range.
int vlmoe_image_random_resized_box(int w, int h, const vlmoe_image_params *p, vlmoe_rng *rng,
                                   vlmoe_image_box *box);

// PIL-exact bicubic resize of region `box` of src (NULL: all of it, i.e. crop then resize) to
// out_w x out_h into dst (dst must not be src).
int vlmoe_image_resize(const vlmoe_image *src, const vlmoe_image_box *box, int out_w, int out_h,
                       vlmoe_image *dst);
int vlmoe_image_crop(const vlmoe_image *src, const vlmoe_image_box *box, vlmoe_image *dst);
// out (3, h, w): (v / 255 - mean[c]) / std[c], mirrored left-right if flip.
int vlmoe_image_to_tensor(const vlmoe_image *src, const vlmoe_image_params *p, int flip,
                          float *out);

// torchvision's ColorJitter on a PIL image, with its draws given: the adjustments order[0..2]
// (0 brightness, 1 contrast, 2 saturation) in that order, adjustment k by factor[k]. Each is
// PIL's ImageEnhance: a blend out = deg + f * (v - deg), in float, clipped to [0, 255] and
// truncated, with the image and a degenerate one: black (brightness), the grey of the image's
// mean luminance rounded (contrast), each pixel's own luminance (saturation); luminance is PIL's
// L = (19595 R + 38470 G + 7471 B + 2^15) >> 16. In place on rgb (w*h*3).
void vlmoe_image_color_jitter(uint8_t *rgb, int w, int h, const double factor[3], const int order[3]);

// Eval transform (OpenCLIP's): resize shorter side to S (bicubic), center crop S x S, normalise
// into out (3, S, S). Only the pixels inside the crop are resampled; they equal PIL's.
int vlmoe_image_preprocess_eval(const vlmoe_image *img, const vlmoe_image_params *p, float *out);
// Train transform: random resized crop to S x S (bicubic) and, with flip_prob, a horizontal
// flip, then with color_jitter S timm's ColorJitter(S, S, S) (brightness, contrast, saturation,
// each factor uniform in [max(0, 1-S), 1+S], applied in a random order), normalised into out
// (3, S, S). Deterministic given the rng state; draws the box first, then one uniform for the
// flip only when flip_prob > 0, then only when color_jitter > 0 the order (two draws) and the
// three factors.
int vlmoe_image_preprocess_train(const vlmoe_image *img, const vlmoe_image_params *p,
                                 vlmoe_rng *rng, float *out);
// The same two transforms stopped before the normalisation: out (S, S, 3) bytes, the flip (train)
// applied, the same draws. The model's backend table normalises them (src/ops/backend.h
// pixels_normalize, the float expression above), so a device receives a quarter of the bytes.
int vlmoe_image_preprocess_eval_u8(const vlmoe_image *img, const vlmoe_image_params *p, uint8_t *out);
int vlmoe_image_preprocess_train_u8(const vlmoe_image *img, const vlmoe_image_params *p,
                                    vlmoe_rng *rng, uint8_t *out);

// ---------------------------------------------------------------------------------------------
// internal
int vlmoe_image_params_check(const vlmoe_image_params *p);

// The image files of args: a folder stands for every .jpg/.jpeg/.png/.webp under it (depth first,
// name order, hidden entries left out; a folder without any is an error), a file for itself.
// *out: n malloc'd paths (vlmoe_free_strings).
int vlmoe_list_images(const char *const *args, int nargs, char ***out, int *n);

#endif
