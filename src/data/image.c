// image.c: JPEG / PNG / WebP decoding to 8-bit RGB (libjpeg-turbo, libpng, libwebp) and the
// PIL/torchvision-exact preprocessing of MODEL.md "Data" (Preprocessing) into (3, S, S) floats.
// Covered by tests/test_image.c, with the PIL parity fixture from tests/ref/gen_image.py.
//
// Error handling: libjpeg and libpng report errors by calling a handler that must not return;
// ours record the library's message and longjmp back to a setjmp in a small *_run function. The
// decoder state lives in a struct owned by the caller of *_run, so nothing that the cleanup
// reads is an automatic variable of the function that called setjmp (C11 7.13.2.1: such
// variables are indeterminate after the longjmp unless volatile).
#include "data/image.h"

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>
#include <webp/decode.h>

// ---------------------------------------------------------------------------------------------
// Image buffers

// Makes sure img->rgb holds `bytes`, reusing it when large enough; leaves w, h to the caller.
static int image_reserve(vlmoe_image *img, size_t bytes) {
    if (img->rgb && img->cap >= bytes) return VLMOE_OK;
    uint8_t *p = vlmoe_alloc(bytes, "image pixels");
    if (!p) return VLMOE_ERR_NOMEM;
    if (img->owned) vlmoe_free_mem(img->rgb);
    img->rgb = p;
    img->cap = bytes;
    img->owned = 1;
    return VLMOE_OK;
}

static int dims_ok(long w, long h) {
    return w > 0 && h > 0 && w <= VLMOE_IMAGE_MAX_SIDE && h <= VLMOE_IMAGE_MAX_SIDE &&
           (size_t)w * (size_t)h <= VLMOE_IMAGE_MAX_PIXELS;
}

int vlmoe_image_alloc(vlmoe_image *img, int w, int h) {
    if (!img) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_alloc: img is NULL");
    img->w = img->h = 0;
    if (!dims_ok(w, h))
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_alloc: size %dx%d outside 1..%d per side "
                          "and %zu pixels", w, h, VLMOE_IMAGE_MAX_SIDE, VLMOE_IMAGE_MAX_PIXELS);
    int rc = image_reserve(img, (size_t)w * (size_t)h * 3);
    if (rc) return rc;
    img->w = w;
    img->h = h;
    return VLMOE_OK;
}

void vlmoe_image_free(vlmoe_image *img) {
    if (!img) return;
    if (img->owned) vlmoe_free_mem(img->rgb);
    memset(img, 0, sizeof *img);
}

// Dimension check on a header, before pixel memory is allocated.
static int check_dims(const char *name, const char *fmt, long w, long h, size_t cap) {
    if (w <= 0 || h <= 0)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: image size %ldx%ld is empty", name, fmt, w, h);
    if (!cap) cap = VLMOE_IMAGE_DEFAULT_PIXELS;
    if ((double)w * (double)h > (double)cap && (size_t)w * (size_t)h <= VLMOE_IMAGE_MAX_PIXELS &&
        w <= VLMOE_IMAGE_MAX_SIDE && h <= VLMOE_IMAGE_MAX_SIDE)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: image size %ldx%ld (%.0f pixels) is more than the %zu pixels "
                          "allowed (a decompression bomb? --max-image-pixels raises the limit)", name, fmt, w, h,
                          (double)w * (double)h, cap);
    if (!dims_ok(w, h))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: image size %ldx%ld exceeds the limit of %d "
                          "pixels per side and %zu pixels in all", name, fmt, w, h,
                          VLMOE_IMAGE_MAX_SIDE, VLMOE_IMAGE_MAX_PIXELS);
    return VLMOE_OK;
}

static int reserve_named(vlmoe_image *img, long w, long h, const char *name) {
    int rc = image_reserve(img, (size_t)w * (size_t)h * 3);
    if (rc) vlmoe_error_prefix("%s", name);
    return rc;
}

vlmoe_image_format vlmoe_image_detect(const void *data, size_t n) {
    const uint8_t *b = data;
    if (!b) return VLMOE_IMAGE_UNKNOWN;
    if (n >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return VLMOE_IMAGE_JPEG;
    if (n >= 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8)) return VLMOE_IMAGE_PNG;
    if (n >= 12 && !memcmp(b, "RIFF", 4) && !memcmp(b + 8, "WEBP", 4)) return VLMOE_IMAGE_WEBP;
    return VLMOE_IMAGE_UNKNOWN;
}

const char *vlmoe_image_format_name(vlmoe_image_format f) {
    switch (f) {
    case VLMOE_IMAGE_JPEG: return "JPEG";
    case VLMOE_IMAGE_PNG: return "PNG";
    case VLMOE_IMAGE_WEBP: return "WebP";
    default: return "unknown";
    }
}

// ---------------------------------------------------------------------------------------------
// JPEG (libjpeg API of libjpeg-turbo)

typedef struct {
    struct jpeg_error_mgr pub;   // first: libjpeg hands us &pub as cinfo->err
    jmp_buf jb;
    int in_scan;                 // 0 while reading the header segments
    char msg[JMSG_LENGTH_MAX];
} jpeg_err;

static void jpeg_on_error(j_common_ptr ci) {
    jpeg_err *e = (jpeg_err *)ci->err;
    e->pub.format_message(ci, e->msg);
    longjmp(e->jb, 1);
}

// libjpeg reports corrupt or truncated data as a warning (level -1) and carries on with
// made-up data (grey blocks, a fake EOI); for training data that is garbage returned as
// success, so every warning is an error except the ones about metadata that leave the pixels
// alone. Extraneous bytes count as metadata only before the first scan (padding between
// segments); after it they mean the entropy decoder stopped early on corrupt data.
static void jpeg_on_message(j_common_ptr ci, int level) {
    jpeg_err *e = (jpeg_err *)ci->err;
    if (level >= 0) return;   // trace messages
    int code = e->pub.msg_code;
    if (code == JWRN_JFIF_MAJOR || code == JWRN_ADOBE_XFORM || code == JWRN_BOGUS_ICC ||
        (code == JWRN_EXTRANEOUS_DATA && !e->in_scan)) {
        e->pub.num_warnings++;
        return;
    }
    e->pub.format_message(ci, e->msg);
    longjmp(e->jb, 1);
}

static void jpeg_no_output(j_common_ptr ci) { (void)ci; }

typedef struct {
    struct jpeg_decompress_struct ci;
    jpeg_err err;
    int created;
    uint8_t *row4;   // one CMYK scanline
} jpeg_state;

static inline uint8_t clip_u8(int v) { return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v; }

// PIL's cmyk2rgb (libImaging/Convert.c) after its "CMYK;I" unpacker: PIL assumes Adobe's
// inverted CMYK for every CMYK JPEG, so the stored values are inverted first.
static void cmyk_row_to_rgb(uint8_t *out, const uint8_t *in, int w) {
    for (int x = 0; x < w; x++, in += 4, out += 3) {
        int nk = in[3];   // 255 - (255 - stored k)
        for (int c = 0; c < 3; c++) {
            int t = (255 - in[c]) * nk + 128;   // MULDIV255(c, nk)
            out[c] = clip_u8(nk - (((t >> 8) + t) >> 8));
        }
    }
}

static int jpeg_run(jpeg_state *s, const uint8_t *data, size_t n, const char *name,
                    vlmoe_image *img, int *out_w, int *out_h) {
    s->ci.err = jpeg_std_error(&s->err.pub);
    s->err.pub.error_exit = jpeg_on_error;
    s->err.pub.emit_message = jpeg_on_message;
    s->err.pub.output_message = jpeg_no_output;
    if (setjmp(s->err.jb))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: JPEG: %s", name, s->err.msg);
    jpeg_create_decompress(&s->ci);
    s->created = 1;
    jpeg_mem_src(&s->ci, data, (unsigned long)n);
    jpeg_read_header(&s->ci, TRUE);
    int cmyk = s->ci.jpeg_color_space == JCS_CMYK || s->ci.jpeg_color_space == JCS_YCCK;
    s->ci.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;   // greyscale is replicated by libjpeg
    // PIL's decoder settings (libjpeg defaults): islow DCT, fancy upsampling, no scaling.
    s->ci.dct_method = JDCT_ISLOW;
    s->ci.do_fancy_upsampling = TRUE;
    long w = (long)s->ci.image_width, h = (long)s->ci.image_height;
    int rc = check_dims(name, "JPEG", w, h, img->max_pixels);
    if (!rc) rc = reserve_named(img, w, h, name);
    if (!rc && cmyk && !(s->row4 = vlmoe_alloc((size_t)w * 4, "CMYK scanline"))) {
        vlmoe_error_prefix("%s", name);
        rc = VLMOE_ERR_NOMEM;
    }
    if (rc) return rc;
    s->err.in_scan = 1;
    jpeg_start_decompress(&s->ci);
    if ((long)s->ci.output_width != w || (long)s->ci.output_height != h ||
        s->ci.output_components != (cmyk ? 4 : 3))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: JPEG: unexpected output layout %ux%u x %d "
                          "components", name, s->ci.output_width, s->ci.output_height,
                          s->ci.output_components);
    size_t stride = (size_t)w * 3;
    while (s->ci.output_scanline < s->ci.output_height) {
        JDIMENSION y = s->ci.output_scanline, got;
        JSAMPROW rows[4];
        if (cmyk) {
            rows[0] = s->row4;
            got = jpeg_read_scanlines(&s->ci, rows, 1);
            if (got == 1) cmyk_row_to_rgb(img->rgb + y * stride, s->row4, (int)w);
        } else {
            JDIMENSION k = s->ci.output_height - y < 4 ? s->ci.output_height - y : 4;
            for (JDIMENSION i = 0; i < k; i++) rows[i] = img->rgb + (y + i) * stride;
            got = jpeg_read_scanlines(&s->ci, rows, k);
        }
        if (got == 0)   // only a suspending data source returns 0; ours never suspends
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: JPEG: decoder stalled at row %u", name, y);
    }
    jpeg_finish_decompress(&s->ci);   // reads up to EOI: a file cut after the last scan fails
    *out_w = (int)w;
    *out_h = (int)h;
    return VLMOE_OK;
}

static int decode_jpeg(const uint8_t *data, size_t n, const char *name, vlmoe_image *img,
                       int *w, int *h) {
    jpeg_state s;
    memset(&s, 0, sizeof s);
    int rc = jpeg_run(&s, data, n, name, img, w, h);
    if (s.created) jpeg_destroy_decompress(&s.ci);
    vlmoe_free_mem(s.row4);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// PNG (libpng 1.6)

typedef struct {
    const uint8_t *p;
    size_t n, pos;
    char msg[256];
    char warning[256];   // the last warning: libpng often explains an error in one just before
} png_src;

typedef struct {
    png_structp png;
    png_infop info;
    png_src src;
} png_state;

static void png_on_read(png_structp png, png_bytep buf, size_t len) {
    png_src *s = png_get_io_ptr(png);
    if (len > s->n - s->pos) png_error(png, "unexpected end of file (truncated)");
    memcpy(buf, s->p + s->pos, len);
    s->pos += len;
}

static void png_on_error(png_structp png, png_const_charp msg) {
    png_src *s = png_get_error_ptr(png);
    snprintf(s->msg, sizeof s->msg, "%s", msg);
    png_longjmp(png, 1);
}

// Warnings (a bad CRC on an ancillary chunk, an incorrect sRGB profile, ...) concern chunks
// libpng then ignores; the pixels are intact. The last one is kept for the error message
// (libpng reports "Image width exceeds user limit in IHDR" as a warning, then fails with
// "Invalid IHDR data").
static void png_on_warning(png_structp png, png_const_charp msg) {
    png_src *s = png_get_error_ptr(png);
    snprintf(s->warning, sizeof s->warning, "%s", msg);
}

static int png_run(png_state *s, const char *name, vlmoe_image *img, int *out_w, int *out_h) {
    s->png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &s->src, png_on_error, png_on_warning);
    if (!s->png) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: PNG: cannot create a libpng decoder", name);
    s->info = png_create_info_struct(s->png);
    if (!s->info) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: PNG: cannot create a libpng info", name);
    if (setjmp(png_jmpbuf(s->png)))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: PNG: %s%s%s%s", name, s->src.msg,
                          s->src.warning[0] ? " (after warning: " : "", s->src.warning,
                          s->src.warning[0] ? ")" : "");
    png_set_read_fn(s->png, &s->src, png_on_read);
    png_set_user_limits(s->png, VLMOE_IMAGE_MAX_SIDE, VLMOE_IMAGE_MAX_SIDE);
    png_read_info(s->png, s->info);
    png_uint_32 w, h;
    int depth, ctype, interlace;
    png_get_IHDR(s->png, s->info, &w, &h, &depth, &ctype, &interlace, NULL, NULL);
    int rc = check_dims(name, "PNG", (long)w, (long)h, img->max_pixels);
    if (rc) return rc;
    // PIL's convert("RGB"): palette looked up, grey replicated, alpha and tRNS dropped.
    if (ctype == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(s->png);
    if (ctype == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(s->png);
    if (depth == 16) png_set_strip_16(s->png);   // high byte, like PIL's "RGB;16B" unpacker
    if ((ctype & PNG_COLOR_MASK_ALPHA) || png_get_valid(s->png, s->info, PNG_INFO_tRNS))
        png_set_strip_alpha(s->png);
    if (ctype == PNG_COLOR_TYPE_GRAY || ctype == PNG_COLOR_TYPE_GRAY_ALPHA)
        png_set_gray_to_rgb(s->png);
    int passes = png_set_interlace_handling(s->png);
    png_read_update_info(s->png, s->info);
    if (png_get_channels(s->png, s->info) != 3 || png_get_bit_depth(s->png, s->info) != 8 ||
        png_get_rowbytes(s->png, s->info) != (size_t)w * 3)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: PNG: colour type %d, bit depth %d did not "
                          "convert to 8-bit RGB", name, ctype, depth);
    rc = reserve_named(img, (long)w, (long)h, name);
    if (rc) return rc;
    // Rows are read into the final buffer; for Adam7 each pass fills in more of every row.
    for (int pass = 0; pass < passes; pass++)
        for (png_uint_32 y = 0; y < h; y++)
            png_read_row(s->png, img->rgb + (size_t)y * w * 3, NULL);
    png_read_end(s->png, NULL);   // checks the remaining chunks up to IEND
    *out_w = (int)w;
    *out_h = (int)h;
    return VLMOE_OK;
}

static int decode_png(const uint8_t *data, size_t n, const char *name, vlmoe_image *img,
                      int *w, int *h) {
    png_state s;
    memset(&s, 0, sizeof s);
    s.src.p = data;
    s.src.n = n;
    int rc = png_run(&s, name, img, w, h);
    if (s.png) png_destroy_read_struct(&s.png, s.info ? &s.info : NULL, NULL);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// WebP (libwebp)

static const char *webp_status(VP8StatusCode st) {
    switch (st) {
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "bitstream error (corrupt data)";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "decoding suspended";
    case VP8_STATUS_USER_ABORT: return "decoding aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "not enough data (truncated file)";
    default: return "unknown libwebp status";
    }
}

static int decode_webp(const uint8_t *data, size_t n, const char *name, vlmoe_image *img,
                       int *out_w, int *out_h) {
    WebPDecoderConfig cfg;
    if (!WebPInitDecoderConfig(&cfg))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: WebP: libwebp version mismatch", name);
    VP8StatusCode st = WebPGetFeatures(data, n, &cfg.input);
    if (st != VP8_STATUS_OK)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: WebP: %s (status %d)", name, webp_status(st),
                          (int)st);
    if (cfg.input.has_animation)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: WebP: animated WebP is not supported", name);
    long w = cfg.input.width, h = cfg.input.height;
    int rc = check_dims(name, "WebP", w, h, img->max_pixels);
    if (!rc) rc = reserve_named(img, w, h, name);
    if (rc) return rc;
    cfg.output.colorspace = MODE_RGB;   // alpha, if any, is dropped (not composited)
    cfg.output.is_external_memory = 1;
    cfg.output.u.RGBA.rgba = img->rgb;
    cfg.output.u.RGBA.stride = (int)(w * 3);
    cfg.output.u.RGBA.size = (size_t)w * (size_t)h * 3;
    st = WebPDecode(data, n, &cfg);
    WebPFreeDecBuffer(&cfg.output);
    if (st != VP8_STATUS_OK)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: WebP: %s (status %d)", name, webp_status(st),
                          (int)st);
    *out_w = (int)w;
    *out_h = (int)h;
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// Decoding entry points

int vlmoe_image_decode(const void *data, size_t n, const char *name, vlmoe_image *img) {
    if (!name) name = "<memory>";
    if (!img) return vlmoe_fail(VLMOE_ERR_ARG, "%s: vlmoe_image_decode: img is NULL", name);
    img->w = img->h = 0;
    if (!data || n == 0)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: empty file (0 bytes), not an image", name);
    const uint8_t *b = data;
    int rc, w = 0, h = 0;
    switch (vlmoe_image_detect(data, n)) {
    case VLMOE_IMAGE_JPEG: rc = decode_jpeg(b, n, name, img, &w, &h); break;
    case VLMOE_IMAGE_PNG: rc = decode_png(b, n, name, img, &w, &h); break;
    case VLMOE_IMAGE_WEBP: rc = decode_webp(b, n, name, img, &w, &h); break;
    default: {
        char hex[3 * 8 + 1] = "";
        for (size_t i = 0; i < n && i < 8; i++) snprintf(hex + 3 * i, 4, " %02x", b[i]);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not a JPEG, PNG or WebP file (no known magic "
                          "bytes; starts with%s)", name, hex);
    }
    }
    if (rc) return rc;
    img->w = w;
    img->h = h;
    return VLMOE_OK;
}

int vlmoe_image_load(const char *path, vlmoe_image *img) {
    if (!path || !img) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_load: NULL path or image");
    img->w = img->h = 0;
    const char *why;
    FILE *f = vlmoe_fopen_regular(path, &why);
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open: %s", path, why);
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0) {
        int e = errno;
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: not a regular file", path);
    }
    if ((uintmax_t)sb.st_size > VLMOE_IMAGE_MAX_FILE) {
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %jd bytes, more than the %zu-byte limit for an "
                          "image file", path, (intmax_t)sb.st_size, VLMOE_IMAGE_MAX_FILE);
    }
    size_t n = (size_t)sb.st_size;
    uint8_t *buf = n ? vlmoe_alloc(n, "image file") : NULL;
    if (n && !buf) {
        fclose(f);
        vlmoe_error_prefix("%s", path);
        return VLMOE_ERR_NOMEM;
    }
    size_t got = n ? fread(buf, 1, n, f) : 0;
    int rd_err = ferror(f);
    fclose(f);
    int rc;
    if (got != n)
        rc = vlmoe_fail(VLMOE_ERR_IO, "%s: read %zu of %zu bytes%s", path, got, n,
                        rd_err ? " (read error)" : " (file shrank while reading)");
    else
        rc = vlmoe_image_decode(buf, n, path, img);
    vlmoe_free_mem(buf);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Preprocessing parameters and geometry (torchvision's rules)

vlmoe_image_params vlmoe_image_default_params(void) {
    vlmoe_image_params p = {
        .size = 224,
        .mean = {0.48145466f, 0.4578275f, 0.40821073f},
        .std = {0.26862954f, 0.26130258f, 0.27577711f},
        .scale_min = 0.9, .scale_max = 1.0,
        .ratio_min = 3.0 / 4.0, .ratio_max = 4.0 / 3.0,
        .flip_prob = 0.0,
        .color_jitter = 0.0,
        .max_pixels = (long)VLMOE_IMAGE_DEFAULT_PIXELS,
    };
    return p;
}

static int norm_ok(const vlmoe_image_params *p) {
    for (int c = 0; c < 3; c++)
        if (!isfinite(p->mean[c]) || !isfinite(p->std[c]) || !(p->std[c] > 0))
            return vlmoe_fail(VLMOE_ERR_ARG, "image params: mean[%d] = %g, std[%d] = %g (need "
                              "finite values and std > 0)", c, p->mean[c], c, p->std[c]);
    return VLMOE_OK;
}

int vlmoe_image_params_check(const vlmoe_image_params *p) {
    if (!p) return vlmoe_fail(VLMOE_ERR_ARG, "image params: NULL");
    if (p->size < 1 || p->size > VLMOE_IMAGE_MAX_SIDE)
        return vlmoe_fail(VLMOE_ERR_ARG, "image params: size %d outside 1..%d", p->size,
                          VLMOE_IMAGE_MAX_SIDE);
    int rc = norm_ok(p);
    if (rc) return rc;
    if (!(p->scale_min > 0) || !(p->scale_min <= p->scale_max) || !isfinite(p->scale_max))
        return vlmoe_fail(VLMOE_ERR_ARG, "image params: scale range (%g, %g) must satisfy "
                          "0 < min <= max", p->scale_min, p->scale_max);
    if (!(p->ratio_min > 0) || !(p->ratio_min <= p->ratio_max) || !isfinite(p->ratio_max))
        return vlmoe_fail(VLMOE_ERR_ARG, "image params: ratio range (%g, %g) must satisfy "
                          "0 < min <= max", p->ratio_min, p->ratio_max);
    if (p->max_pixels < 1 || (size_t)p->max_pixels > VLMOE_IMAGE_MAX_PIXELS)
        return vlmoe_fail(VLMOE_ERR_ARG, "image params: max_pixels %ld outside 1..%zu (--max-image-pixels)",
                          p->max_pixels, VLMOE_IMAGE_MAX_PIXELS);
    if (!(p->flip_prob >= 0 && p->flip_prob <= 1))
        return vlmoe_fail(VLMOE_ERR_ARG, "image params: flip_prob %g outside [0, 1]",
                          p->flip_prob);
    if (!(p->color_jitter >= 0 && p->color_jitter <= 100))
        return vlmoe_fail(VLMOE_ERR_ARG, "image params: color_jitter %g outside [0, 100]", p->color_jitter);
    return VLMOE_OK;
}

// An input image needs pixels and a valid size; `cap` is not required (a caller may wrap
// pixels it owns as {w, h, rgb}).
static int image_ok(const vlmoe_image *img, const char *fn) {
    if (!img || !img->rgb || !dims_ok(img->w, img->h))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: empty or invalid image (%dx%d)", fn,
                          img ? img->w : 0, img ? img->h : 0);
    return VLMOE_OK;
}

static int box_ok(const vlmoe_image *img, const vlmoe_image_box *b, const char *fn) {
    if (b->w < 1 || b->h < 1 || b->x < 0 || b->y < 0 || b->x > img->w - b->w ||
        b->y > img->h - b->h)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: box (x %d, y %d, w %d, h %d) is not inside the "
                          "%dx%d image", fn, b->x, b->y, b->w, b->h, img->w, img->h);
    return VLMOE_OK;
}

void vlmoe_image_shorter_side_dims(int w, int h, int size, int *out_w, int *out_h) {
    // torchvision _compute_resized_output_size: new_long = int(size * long / short), where
    // size * long is an exact integer product and / a correctly rounded division.
    if (w <= h) {
        *out_w = size;
        *out_h = (int)((double)((int64_t)size * h) / w);
    } else {
        *out_h = size;
        *out_w = (int)((double)((int64_t)size * w) / h);
    }
}

// round(d / 2) for d >= 0 with Python's round half to even.
static int half_round_even(int d) {
    int q = d / 2;
    if ((d & 1) && (q & 1)) q++;
    return q;
}

vlmoe_image_box vlmoe_image_center_box(int w, int h, int cw, int ch) {
    vlmoe_image_box b = {half_round_even(w - cw), half_round_even(h - ch), cw, ch};
    return b;
}

int vlmoe_image_random_resized_box(int w, int h, const vlmoe_image_params *p, vlmoe_rng *rng,
                                   vlmoe_image_box *box) {
    int rc = vlmoe_image_params_check(p);
    if (rc) return rc;
    if (!rng || !box || !dims_ok(w, h))
        return vlmoe_fail(VLMOE_ERR_ARG, "random resized crop: bad image size %dx%d or NULL "
                          "argument", w, h);
    double area = (double)w * h, lr0 = log(p->ratio_min), lr1 = log(p->ratio_max);
    for (int attempt = 0; attempt < 10; attempt++) {
        double target = area * (p->scale_min + (p->scale_max - p->scale_min) *
                                vlmoe_rng_uniform(rng));
        double ar = exp(lr0 + (lr1 - lr0) * vlmoe_rng_uniform(rng));
        // Python's round() is half to even, like nearbyint in the default rounding mode.
        double cw = nearbyint(sqrt(target * ar)), ch = nearbyint(sqrt(target / ar));
        if (cw >= 1 && cw <= w && ch >= 1 && ch <= h) {
            int iw = (int)cw, ih = (int)ch;
            int top = (int)vlmoe_rng_below(rng, (uint32_t)(h - ih + 1));
            int left = (int)vlmoe_rng_below(rng, (uint32_t)(w - iw + 1));
            *box = (vlmoe_image_box){left, top, iw, ih};
            return VLMOE_OK;
        }
    }
    // Fallback: the whole image, cut to the nearest allowed aspect ratio, centered (floor).
    double in_ratio = (double)w / h, cw = w, ch = h;
    if (in_ratio < p->ratio_min) ch = nearbyint(w / p->ratio_min);
    else if (in_ratio > p->ratio_max) cw = nearbyint(h * p->ratio_max);
    if (cw < 1) cw = 1;
    if (ch < 1) ch = 1;
    if (cw > w) cw = w;
    if (ch > h) ch = h;
    *box = (vlmoe_image_box){(w - (int)cw) / 2, (h - (int)ch) / 2, (int)cw, (int)ch};
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// PIL's bicubic resampling (libImaging/Resample.c, the 8-bit path), reproduced operation for
// operation so that the results are identical: the double-precision coefficient arithmetic
// below must not be reordered or contracted into FMAs (GCC's -std=c11 implies
// -ffp-contract=off; never build with -ffast-math), the fixed-point sums are exact integers.

#define PREC_BITS 22   // PIL's PRECISION_BITS = 32 - 8 - 2: 8 bits of result, 2 of headroom

static double bicubic(double x) {
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

static inline uint8_t clip_fixed(int32_t v) {
    if (v < 0) return 0;
    v >>= PREC_BITS;
    return v > 255 ? 255 : (uint8_t)v;
}

// Filter taps of output indices [o0, o0 + n) of a resize from in_size to out_size samples.
typedef struct {
    int ksize;
    int *first, *count;   // (n): first input sample, number of taps
    int32_t *k;           // (n, ksize) fixed-point weights
} taps;

static void taps_free(taps *t) {
    vlmoe_free_mem(t->first);
    vlmoe_free_mem(t->k);
    memset(t, 0, sizeof *t);
}

// PIL's precompute_coeffs + normalize_coeffs_8bpc with in0 = 0, in1 = in_size; only the taps
// of the requested output indices are computed (each one is independent of the others).
static int taps_init(taps *t, int in_size, int out_size, int o0, int n) {
    double scale = (double)in_size / out_size, filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 2.0 * filterscale, ss = 1.0 / filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    t->ksize = ksize;
    t->first = vlmoe_alloc((size_t)n * 2 * sizeof(int), "resample bounds");
    t->k = vlmoe_alloc((size_t)n * (size_t)ksize * sizeof(int32_t), "resample weights");
    double *pre = vlmoe_alloc((size_t)ksize * sizeof(double), "resample weights");
    if (!t->first || !t->k || !pre) {
        vlmoe_free_mem(pre);
        taps_free(t);
        return VLMOE_ERR_NOMEM;
    }
    t->count = t->first + n;
    for (int i = 0; i < n; i++) {
        int xx = o0 + i;
        double center = (xx + 0.5) * scale, ww = 0.0;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        if (xmax > ksize) xmax = ksize;   // cannot happen (PIL relies on it too)
        for (int x = 0; x < xmax; x++) {
            double w = bicubic((x + xmin - center + 0.5) * ss);
            pre[x] = w;
            ww += w;
        }
        int32_t *k = t->k + (size_t)i * ksize;
        for (int x = 0; x < xmax; x++) {
            double w = ww != 0.0 ? pre[x] / ww : pre[x];
            k[x] = w < 0 ? (int32_t)(-0.5 + w * (1 << PREC_BITS))
                         : (int32_t)(0.5 + w * (1 << PREC_BITS));
        }
        for (int x = xmax; x < ksize; x++) k[x] = 0;
        t->first[i] = xmin;
        t->count[i] = xmax;
    }
    vlmoe_free_mem(pre);
    return VLMOE_OK;
}

// One output line of a pass: out (len) = sum over `count` taps of the input lines in[y] (each
// `len` long, consecutive). Every value is summed over the taps in PIL's order (and integer
// sums are exact in any order anyway). `omp simd` because GCC's -O2 cost model will not
// vectorise the u8 -> i32 widening on its own (5x slower).
static void resample_line(uint8_t *restrict out, const uint8_t *restrict in, size_t len,
                          const int32_t *restrict k, int count, int32_t *restrict acc) {
    for (size_t i = 0; i < len; i++) acc[i] = 1 << (PREC_BITS - 1);
    for (int y = 0; y < count; y++) {
        const uint8_t *restrict line = in + (size_t)y * len;
        int32_t ky = k[y];
#pragma omp simd
        for (size_t i = 0; i < len; i++) acc[i] += line[i] * ky;
    }
#pragma omp simd
    for (size_t i = 0; i < len; i++) out[i] = clip_fixed(acc[i]);
}

// dst[c][r] = src[r][c] for 3-byte pixels, rows x cols of src (strides in bytes), in tiles.
static void transpose3(uint8_t *restrict dst, size_t dstride, const uint8_t *restrict src,
                       size_t sstride, int rows, int cols) {
    enum { TILE = 32 };
    for (int ra = 0; ra < rows; ra += TILE)
        for (int ca = 0; ca < cols; ca += TILE) {
            int rb = ra + TILE < rows ? ra + TILE : rows, cb = ca + TILE < cols ? ca + TILE : cols;
            for (int r = ra; r < rb; r++) {
                const uint8_t *s = src + (size_t)r * sstride;
                for (int c = ca; c < cb; c++) {
                    uint8_t *d = dst + (size_t)c * dstride + (size_t)r * 3;
                    d[0] = s[3 * c], d[1] = s[3 * c + 1], d[2] = s[3 * c + 2];
                }
            }
        }
}

// Resizes region `box` of src to out_w x out_h and writes the output pixels inside `win`
// (a region of the out_w x out_h result) to dst (win->h, win->w, 3). Like PIL, a pass whose
// size does not change is skipped (its taps would be the identity anyway). The horizontal
// pass runs on the transposed block of needed source pixels, so that both passes are the same
// contiguous multiply-accumulate over long lines (about 4x faster than a per-pixel tap loop
// over interleaved RGB).
static int resample(const vlmoe_image *src, const vlmoe_image_box *box, int out_w, int out_h,
                    const vlmoe_image_box *win, uint8_t *dst) {
    int need_h = out_w != box->w, need_v = out_h != box->h, rc = VLMOE_OK;
    taps th = {0}, tv = {0};
    uint8_t *tmp = NULL, *tsrc = NULL, *tout = NULL;
    int32_t *acc = NULL;
    size_t len = (size_t)win->w * 3, sstride = (size_t)src->w * 3;
    int r0 = win->y, r1 = win->y + win->h;   // rows of box that the vertical pass reads
    if (need_v) {
        if ((rc = taps_init(&tv, box->h, out_h, win->y, win->h))) goto done;
        r0 = tv.first[0];
        r1 = tv.first[win->h - 1] + tv.count[win->h - 1];
    }
    int rows = r1 - r0;
    size_t col_len = (size_t)rows * 3;   // a source column over the needed rows
    size_t acc_len = len > col_len ? len : col_len;
    if (!(acc = vlmoe_alloc(acc_len * sizeof(int32_t), "resample sums"))) goto nomem;
    if (need_v && !(tmp = vlmoe_alloc((size_t)rows * len, "resample rows"))) goto nomem;
    uint8_t *hout = need_v ? tmp : dst;   // (rows, win->w, 3)
    const uint8_t *block = src->rgb + (size_t)(box->y + r0) * sstride + (size_t)box->x * 3;
    if (need_h) {
        if ((rc = taps_init(&th, box->w, out_w, win->x, win->w))) goto done;
        int c0 = th.first[0], c1 = th.first[win->w - 1] + th.count[win->w - 1];
        tsrc = vlmoe_alloc((size_t)(c1 - c0) * col_len, "resample columns");
        tout = vlmoe_alloc((size_t)win->w * col_len, "resample columns");
        if (!tsrc || !tout) goto nomem;
        transpose3(tsrc, col_len, block + (size_t)c0 * 3, sstride, rows, c1 - c0);
        for (int xx = 0; xx < win->w; xx++)
            resample_line(tout + (size_t)xx * col_len, tsrc + (size_t)(th.first[xx] - c0) * col_len,
                          col_len, th.k + (size_t)xx * th.ksize, th.count[xx], acc);
        transpose3(hout, len, tout, col_len, win->w, rows);
    } else {
        for (int r = 0; r < rows; r++)
            memcpy(hout + (size_t)r * len, block + (size_t)r * sstride + (size_t)win->x * 3, len);
    }
    if (need_v)
        for (int yy = 0; yy < win->h; yy++)
            resample_line(dst + (size_t)yy * len, tmp + (size_t)(tv.first[yy] - r0) * len, len,
                          tv.k + (size_t)yy * tv.ksize, tv.count[yy], acc);
    goto done;
nomem:
    rc = VLMOE_ERR_NOMEM;
done:
    taps_free(&th);
    taps_free(&tv);
    vlmoe_free_mem(tmp);
    vlmoe_free_mem(tsrc);
    vlmoe_free_mem(tout);
    vlmoe_free_mem(acc);
    return rc;
}

int vlmoe_image_resize(const vlmoe_image *src, const vlmoe_image_box *box, int out_w, int out_h,
                       vlmoe_image *dst) {
    int rc = image_ok(src, "vlmoe_image_resize");
    if (rc) return rc;
    vlmoe_image_box full = {0, 0, src->w, src->h}, b = box ? *box : full;
    if ((rc = box_ok(src, &b, "vlmoe_image_resize"))) return rc;
    if (!dst || dst == src || (dst->rgb && dst->rgb == src->rgb))
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_resize: dst is NULL or shares src's pixels");
    if ((rc = vlmoe_image_alloc(dst, out_w, out_h))) return rc;
    vlmoe_image_box win = {0, 0, out_w, out_h};
    rc = resample(src, &b, out_w, out_h, &win, dst->rgb);
    if (rc) dst->w = dst->h = 0;
    return rc;
}

int vlmoe_image_crop(const vlmoe_image *src, const vlmoe_image_box *box, vlmoe_image *dst) {
    int rc = image_ok(src, "vlmoe_image_crop");
    if (rc) return rc;
    if (!box) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_crop: box is NULL");
    if ((rc = box_ok(src, box, "vlmoe_image_crop"))) return rc;
    if (!dst || dst == src || (dst->rgb && dst->rgb == src->rgb))
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_crop: dst is NULL or shares src's pixels");
    if ((rc = vlmoe_image_alloc(dst, box->w, box->h))) return rc;
    size_t len = (size_t)box->w * 3;
    for (int y = 0; y < box->h; y++)
        memcpy(dst->rgb + (size_t)y * len,
               src->rgb + ((size_t)(box->y + y) * src->w + box->x) * 3, len);
    return VLMOE_OK;
}

// torchvision ToTensor + Normalize in float32: (v / 255 - mean) / std, one table per channel.
static void tensor_from_u8(float *out, const uint8_t *rgb, int w, int h,
                           const vlmoe_image_params *p, int flip) {
    float lut[3][256];
    for (int c = 0; c < 3; c++)
        for (int v = 0; v < 256; v++) lut[c][v] = ((float)v / 255.0f - p->mean[c]) / p->std[c];
    size_t plane = (size_t)w * h;
    for (int y = 0; y < h; y++) {
        const uint8_t *row = rgb + (size_t)y * w * 3;
        float *o0 = out + (size_t)y * w, *o1 = o0 + plane, *o2 = o1 + plane;
        for (int x = 0; x < w; x++) {
            const uint8_t *px = row + (size_t)(flip ? w - 1 - x : x) * 3;
            o0[x] = lut[0][px[0]];
            o1[x] = lut[1][px[1]];
            o2[x] = lut[2][px[2]];
        }
    }
}

int vlmoe_image_to_tensor(const vlmoe_image *src, const vlmoe_image_params *p, int flip,
                          float *out) {
    int rc = image_ok(src, "vlmoe_image_to_tensor");
    if (rc) return rc;
    if (!p || !out) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_to_tensor: NULL argument");
    if ((rc = norm_ok(p))) return rc;
    tensor_from_u8(out, src->rgb, src->w, src->h, p, flip);
    return VLMOE_OK;
}

// Resize shorter side + center crop into u8 (S, S, 3): the eval transform before normalising.
static int eval_u8(const vlmoe_image *img, const vlmoe_image_params *p, uint8_t *u8) {
    int S = p->size, rw, rh;
    vlmoe_image_shorter_side_dims(img->w, img->h, S, &rw, &rh);
    vlmoe_image_box full = {0, 0, img->w, img->h}, win = vlmoe_image_center_box(rw, rh, S, S);
    return resample(img, &full, rw, rh, &win, u8);
}

int vlmoe_image_preprocess_eval(const vlmoe_image *img, const vlmoe_image_params *p, float *out) {
    int rc = image_ok(img, "vlmoe_image_preprocess_eval");
    if (rc) return rc;
    if ((rc = vlmoe_image_params_check(p))) return rc;
    if (!out) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_preprocess_eval: out is NULL");
    int S = p->size;
    uint8_t *u8 = vlmoe_alloc((size_t)S * S * 3, "preprocessed pixels");
    if (!u8) return VLMOE_ERR_NOMEM;
    rc = eval_u8(img, p, u8);
    if (!rc) tensor_from_u8(out, u8, S, S, p, 0);
    vlmoe_free_mem(u8);
    return rc;
}

int vlmoe_image_preprocess_eval_u8(const vlmoe_image *img, const vlmoe_image_params *p, uint8_t *out) {
    int rc = image_ok(img, "vlmoe_image_preprocess_eval_u8");
    if (rc) return rc;
    if ((rc = vlmoe_image_params_check(p))) return rc;
    if (!out) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_preprocess_eval_u8: out is NULL");
    return eval_u8(img, p, out);
}

static int luma(const uint8_t *px) { return (px[0] * 19595 + px[1] * 38470 + px[2] * 7471 + 0x8000) >> 16; }

// PIL's ImagingBlend of one value: float arithmetic, clipped, truncated.
static uint8_t blend_u8(int deg, int v, float f) {
    const float t = (float)deg + f * (float)(v - deg);
    return t <= 0.0f ? 0 : t >= 255.0f ? 255 : (uint8_t)t;
}

void vlmoe_image_color_jitter(uint8_t *rgb, int w, int h, const double factor[3], const int order[3]) {
    const size_t n = (size_t)w * h;
    for (int k = 0; k < 3; k++) {
        const int which = order[k];
        const float f = (float)factor[which];
        int grey = 0;
        if (which == 1) { // contrast: PIL's ImageStat mean of the L image, rounded
            uint64_t sum = 0;
            for (size_t i = 0; i < n; i++) sum += (uint64_t)luma(rgb + 3 * i);
            grey = (int)((double)sum / (double)n + 0.5);
        }
        for (size_t i = 0; i < n; i++) {
            uint8_t *px = rgb + 3 * i;
            const int deg = which == 0 ? 0 : which == 1 ? grey : luma(px);
            for (int c = 0; c < 3; c++) px[c] = blend_u8(deg, px[c], f);
        }
    }
}

// The colour jitter's draws: torchvision's randperm of the adjustments, then their factors.
static void draw_jitter(vlmoe_rng *rng, double s, double factor[3], int order[3]) {
    for (int k = 0; k < 3; k++) order[k] = k;
    for (int k = 2; k > 0; k--) { // Fisher-Yates
        const int j = (int)vlmoe_rng_below(rng, (uint32_t)k + 1), t = order[k];
        order[k] = order[j], order[j] = t;
    }
    const double lo = s < 1 ? 1 - s : 0, hi = 1 + s;
    for (int k = 0; k < 3; k++) factor[k] = lo + (hi - lo) * vlmoe_rng_uniform(rng);
}

// The train transform into u8 (S, S, 3) up to the flip, which *flip says to apply: the draws
// in the order of vlmoe_image_preprocess_train's comment.
static int train_u8(const vlmoe_image *img, const vlmoe_image_params *p, vlmoe_rng *rng, uint8_t *u8,
                    int *flip) {
    vlmoe_image_box box;
    int rc = vlmoe_image_random_resized_box(img->w, img->h, p, rng, &box);
    if (rc) return rc;
    *flip = p->flip_prob > 0 && vlmoe_rng_uniform(rng) < p->flip_prob;
    double factor[3];
    int order[3];
    if (p->color_jitter > 0) draw_jitter(rng, p->color_jitter, factor, order);
    int S = p->size;
    vlmoe_image_box win = {0, 0, S, S};
    rc = resample(img, &box, S, S, &win, u8);
    // the jitter acts on pixel values (contrast on their mean), so it commutes with the flip
    if (!rc && p->color_jitter > 0) vlmoe_image_color_jitter(u8, S, S, factor, order);
    return rc;
}

int vlmoe_image_preprocess_train(const vlmoe_image *img, const vlmoe_image_params *p,
                                 vlmoe_rng *rng, float *out) {
    int rc = image_ok(img, "vlmoe_image_preprocess_train");
    if (rc) return rc;
    if (!out || !rng)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_preprocess_train: out or rng is NULL");
    int S = p->size, flip = 0;
    uint8_t *u8 = vlmoe_alloc((size_t)S * S * 3, "preprocessed pixels");
    if (!u8) return VLMOE_ERR_NOMEM;
    rc = train_u8(img, p, rng, u8, &flip);
    if (!rc) tensor_from_u8(out, u8, S, S, p, flip);
    vlmoe_free_mem(u8);
    return rc;
}

int vlmoe_image_preprocess_train_u8(const vlmoe_image *img, const vlmoe_image_params *p,
                                    vlmoe_rng *rng, uint8_t *out) {
    int rc = image_ok(img, "vlmoe_image_preprocess_train_u8");
    if (rc) return rc;
    if (!out || !rng)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_image_preprocess_train_u8: out or rng is NULL");
    int flip = 0;
    if ((rc = train_u8(img, p, rng, out, &flip)) || !flip) return rc;
    const int S = p->size;
    for (int y = 0; y < S; y++) // mirrored in place: pixel x swaps with S - 1 - x
        for (int a = 0, b = S - 1; a < b; a++, b--)
            for (int c = 0; c < 3; c++) {
                uint8_t *pa = out + ((size_t)y * S + a) * 3 + c, *pb = out + ((size_t)y * S + b) * 3 + c, t = *pa;
                *pa = *pb, *pb = t;
            }
    return VLMOE_OK;
}
