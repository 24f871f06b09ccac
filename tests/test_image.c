// test_image.c: tests of src/data/image.c (decoding, MODEL.md "Data" preprocessing). Fixtures
// are written at test time with the encoder side of libjpeg / libpng / libwebp into a mkdtemp
// folder (solid colours, gradients, alpha, palette, greyscale, 16-bit, damaged files); PIL
// parity comes from tests/ref/gen_image.py (image_ref.safetensors in the fixture folder).
#include <dirent.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jpeglib.h>
#include <png.h>
#include <webp/decode.h>
#include <webp/encode.h>
#include <zlib.h>

#include "core/core.h"
#include "data/image.h"
#include "test.h"
#include "test_jpeg.h"

static char tmpdir[256];

static const char *tpath(const char *name) {
    static char buf[8][512];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) { test_write_file(path, data, n); }

static uint8_t *read_bytes(const char *path, size_t *n) { return (uint8_t *)test_read_file(path, n); }

// ---------------------------------------------------------------------------------------------
// Encoders (test side; JPEG in test_jpeg.h)

typedef struct {
    int w, h, depth, ctype, interlace;
    const uint8_t *rows;          // packed rows in PNG byte order (16-bit big-endian)
    const png_color *palette;
    int npal;
    const uint8_t *trns;          // palette alpha
    int ntrns;
    const png_color_16 *trans;    // tRNS colour of grey / RGB images
} png_spec;

static int enc_png(const char *path, const png_spec *s) {
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    png_bytep *rows = malloc((size_t)s->h * sizeof *rows);
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_write_struct(&png, &info);
        free(rows);
        fclose(f);
        return 1;
    }
    png_init_io(png, f);
    png_set_IHDR(png, info, (png_uint_32)s->w, (png_uint_32)s->h, s->depth, s->ctype,
                 s->interlace, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    if (s->palette) png_set_PLTE(png, info, s->palette, s->npal);
    if (s->trns || s->trans) png_set_tRNS(png, info, s->trns, s->ntrns, s->trans);
    png_write_info(png, info);
    size_t rb = png_get_rowbytes(png, info);
    for (int y = 0; y < s->h; y++) rows[y] = (png_bytep)(s->rows + (size_t)y * rb);
    png_write_image(png, rows);
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    free(rows);
    fclose(f);
    return 0;
}

// Known content: a gradient with a pattern, distinct in every channel.
static uint8_t grad(int x, int y, int c) {
    return (uint8_t)((x * 7 + y * 3 + c * 85 + (x * y) % 13) & 255);
}

static void fill_grad(uint8_t *px, int w, int h, int ch) {
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < ch; c++) px[((size_t)y * w + x) * ch + c] = grad(x, y, c);
}

static int load_ok(const char *path, vlmoe_image *img) {
    int rc = vlmoe_image_load(path, img);
    CHECK(rc == VLMOE_OK, "load %s: %s", path, vlmoe_last_error());
    return rc == VLMOE_OK;
}

// Max |a - b| over n bytes; *where gets the first index at that maximum.
static int max_diff_u8(const uint8_t *a, const uint8_t *b, size_t n, size_t *where) {
    int m = 0;
    *where = 0;
    for (size_t i = 0; i < n; i++) {
        int d = abs((int)a[i] - (int)b[i]);
        if (d > m) m = d, *where = i;
    }
    return m;
}

// ---------------------------------------------------------------------------------------------

static void test_detect(void) {
    CHECK(vlmoe_image_detect("\xff\xd8\xff\xe0", 4) == VLMOE_IMAGE_JPEG, "jpeg magic");
    CHECK(vlmoe_image_detect("\x89PNG\r\n\x1a\n", 8) == VLMOE_IMAGE_PNG, "png magic");
    CHECK(vlmoe_image_detect("RIFF\0\0\0\0WEBPVP8 ", 16) == VLMOE_IMAGE_WEBP, "webp magic");
    CHECK(vlmoe_image_detect("RIFF\0\0\0\0WAVEfmt ", 16) == VLMOE_IMAGE_UNKNOWN, "wav is not webp");
    CHECK(vlmoe_image_detect("\xff\xd8", 2) == VLMOE_IMAGE_UNKNOWN, "short jpeg magic");
    CHECK(vlmoe_image_detect("GIF89a", 6) == VLMOE_IMAGE_UNKNOWN, "gif");
    CHECK(vlmoe_image_detect(NULL, 0) == VLMOE_IMAGE_UNKNOWN, "NULL");
    CHECK(!strcmp(vlmoe_image_format_name(VLMOE_IMAGE_WEBP), "WebP"), "format name");
}

// PNG colour types and depths against the content written; expected values follow PIL's
// convert("RGB") (alpha and tRNS dropped), except 16-bit grey (high byte; see image.h).
static void test_png(void) {
    enum { W = 37, H = 23 };
    static uint8_t buf[W * H * 8], exp[W * H * 3];
    vlmoe_image img = {0};
    size_t where;
    struct { const char *name; int ctype, depth, interlace; } cases[] = {
        {"rgb8.png", PNG_COLOR_TYPE_RGB, 8, 0},       {"rgba8.png", PNG_COLOR_TYPE_RGBA, 8, 0},
        {"grey8.png", PNG_COLOR_TYPE_GRAY, 8, 0},     {"ga8.png", PNG_COLOR_TYPE_GRAY_ALPHA, 8, 0},
        {"rgb16.png", PNG_COLOR_TYPE_RGB, 16, 0},     {"rgba16.png", PNG_COLOR_TYPE_RGBA, 16, 0},
        {"grey16.png", PNG_COLOR_TYPE_GRAY, 16, 0},   {"rgb8_adam7.png", PNG_COLOR_TYPE_RGB, 8, 1},
        {"ga16_adam7.png", PNG_COLOR_TYPE_GRAY_ALPHA, 16, 1},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        int ct = cases[ci].ctype, bytes = cases[ci].depth / 8;
        int ch = ct == PNG_COLOR_TYPE_RGB ? 3 : ct == PNG_COLOR_TYPE_RGBA ? 4
               : ct == PNG_COLOR_TYPE_GRAY ? 1 : 2;
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                uint8_t *p = buf + ((size_t)y * W + x) * ch * bytes;
                for (int c = 0; c < ch; c++) {
                    uint8_t v = grad(x, y, c);
                    p[c * bytes] = v;
                    if (bytes == 2) p[c * bytes + 1] = (uint8_t)(255 - v);   // low byte
                }
                for (int c = 0; c < 3; c++)
                    exp[((size_t)y * W + x) * 3 + c] = grad(x, y, ch >= 3 ? c : 0);
            }
        png_spec s = {W, H, cases[ci].depth, ct,
                      cases[ci].interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, buf,
                      NULL, 0, NULL, 0, NULL};
        const char *path = tpath(cases[ci].name);
        CHECK(enc_png(path, &s) == 0, "write %s", path);
        if (!load_ok(path, &img)) continue;
        CHECK(img.w == W && img.h == H, "%s: size %dx%d", path, img.w, img.h);
        int d = max_diff_u8(img.rgb, exp, sizeof exp, &where);
        CHECK(d == 0, "%s: max diff %d at byte %zu", path, d, where);
    }

    // Palette (4-bit, 16 entries) with tRNS: colours from the palette, transparency dropped.
    png_color pal[16];
    uint8_t trns[16];
    for (int i = 0; i < 16; i++) {
        pal[i] = (png_color){(uint8_t)(i * 16), (uint8_t)(255 - i * 10), (uint8_t)(i * i)};
        trns[i] = (uint8_t)(i * 17);
    }
    size_t rb = (W + 1) / 2;
    memset(buf, 0, sizeof buf);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            int idx = (x + 3 * y) % 16;
            buf[y * rb + x / 2] |= (uint8_t)(x % 2 ? idx : idx << 4);
            exp[(y * W + x) * 3 + 0] = pal[idx].red;
            exp[(y * W + x) * 3 + 1] = pal[idx].green;
            exp[(y * W + x) * 3 + 2] = pal[idx].blue;
        }
    png_spec sp = {W, H, 4, PNG_COLOR_TYPE_PALETTE, 0, buf, pal, 16, trns, 16, NULL};
    const char *path = tpath("pal4_trns.png");
    CHECK(enc_png(path, &sp) == 0, "write %s", path);
    if (load_ok(path, &img)) {
        int d = max_diff_u8(img.rgb, exp, sizeof exp, &where);
        CHECK(d == 0, "%s: max diff %d at byte %zu", path, d, where);
    }

    // Greyscale 1 and 2 bits: scaled to 0..255 (x255, x85) like PIL's "1" / "L;2".
    for (int depth = 1; depth <= 2; depth++) {
        int per = 8 / depth, maxv = (1 << depth) - 1;
        rb = (size_t)(W + per - 1) / per;
        memset(buf, 0, sizeof buf);
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                int v = (x + y) % (maxv + 1);
                buf[y * rb + x / per] |= (uint8_t)(v << (8 - depth * (x % per + 1)));
                for (int c = 0; c < 3; c++) exp[(y * W + x) * 3 + c] = (uint8_t)(v * 255 / maxv);
            }
        png_spec sg = {W, H, depth, PNG_COLOR_TYPE_GRAY, 0, buf, NULL, 0, NULL, 0, NULL};
        path = tpath(depth == 1 ? "grey1.png" : "grey2.png");
        CHECK(enc_png(path, &sg) == 0, "write %s", path);
        if (load_ok(path, &img)) {
            int d = max_diff_u8(img.rgb, exp, sizeof exp, &where);
            CHECK(d == 0, "%s: max diff %d at byte %zu", path, d, where);
        }
    }

    // RGB and grey with a tRNS colour: the colour key is ignored, pixels unchanged.
    fill_grad(buf, W, H, 3);
    png_color_16 key = {0, grad(0, 0, 0), grad(0, 0, 1), grad(0, 0, 2), 0};
    png_spec sk = {W, H, 8, PNG_COLOR_TYPE_RGB, 0, buf, NULL, 0, NULL, 0, &key};
    path = tpath("rgb8_trns.png");
    CHECK(enc_png(path, &sk) == 0, "write %s", path);
    if (load_ok(path, &img)) {
        int d = max_diff_u8(img.rgb, buf, (size_t)W * H * 3, &where);
        CHECK(d == 0, "%s: max diff %d at byte %zu", path, d, where);
    }
    fill_grad(buf, W, H, 1);
    png_color_16 gkey = {0, 0, 0, 0, grad(1, 1, 0)};
    png_spec sgk = {W, H, 8, PNG_COLOR_TYPE_GRAY, 0, buf, NULL, 0, NULL, 0, &gkey};
    path = tpath("grey8_trns.png");
    CHECK(enc_png(path, &sgk) == 0, "write %s", path);
    if (load_ok(path, &img)) {
        int bad = 0;
        for (int i = 0; i < W * H; i++)
            for (int c = 0; c < 3; c++) bad += img.rgb[i * 3 + c] != buf[i];
        CHECK(bad == 0, "%s: %d wrong values", path, bad);
    }
    vlmoe_image_free(&img);
}

static void check_solid(const vlmoe_image *img, const uint8_t rgb[3], int tol, const char *what) {
    int m = 0;
    for (size_t i = 0; i < (size_t)img->w * img->h; i++)
        for (int c = 0; c < 3; c++) {
            int d = abs((int)img->rgb[i * 3 + c] - rgb[c]);
            if (d > m) m = d;
        }
    CHECK(m <= tol, "%s: solid (%d,%d,%d) decoded with max error %d > %d", what, rgb[0], rgb[1],
          rgb[2], m, tol);
}

static void test_jpeg(void) {
    enum { W = 64, H = 48 };
    static uint8_t px[W * H * 4];
    static const uint8_t colours[][3] = {{255, 0, 0}, {0, 255, 0},   {0, 0, 255},  {255, 255, 255},
                                         {0, 0, 0},   {128, 128, 128}, {30, 200, 90}};
    vlmoe_image img = {0};
    size_t n;
    char name[64];
    // Solid colours, 4:2:0 (libjpeg's default), quality 95: YCbCr rounding costs a few levels.
    for (size_t k = 0; k < sizeof colours / 3; k++) {
        for (int i = 0; i < W * H; i++) memcpy(px + i * 3, colours[k], 3);
        uint8_t *j = enc_jpeg(px, W, H, 3, 95, (int)(k & 1), &n);
        snprintf(name, sizeof name, "solid%zu.jpg", k);
        const char *path = tpath(name);
        write_bytes(path, j, n);
        free(j);
        if (load_ok(path, &img)) {
            CHECK(img.w == W && img.h == H, "%s: size %dx%d", path, img.w, img.h);
            check_solid(&img, colours[k], 3, path);
        }
    }
    // Greyscale JPEG: replicated into three equal channels.
    memset(px, 77, W * H);
    uint8_t *j = enc_jpeg(px, W, H, 1, 95, 0, &n);
    write_bytes(tpath("grey.jpg"), j, n);
    free(j);
    if (load_ok(tpath("grey.jpg"), &img)) check_solid(&img, (const uint8_t[3]){77, 77, 77}, 1, "grey.jpg");
    // CMYK JPEG stored with Adobe's inverted convention (libjpeg writes the Adobe marker): ink
    // (c, m, y, k) converts as PIL does, r = (255 - k) - round(c (255 - k) / 255), ...
    static const uint8_t inks[][4] = {{0, 255, 255, 0}, {50, 100, 150, 30}};
    static const uint8_t want[][3] = {{255, 0, 0}, {181, 137, 93}};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < W * H; i++)
            for (int c = 0; c < 4; c++) px[i * 4 + c] = (uint8_t)(255 - inks[k][c]);
        j = enc_jpeg(px, W, H, 4, 95, 0, &n);
        snprintf(name, sizeof name, "cmyk%d.jpg", k);
        write_bytes(tpath(name), j, n);
        free(j);
        if (load_ok(tpath(name), &img)) check_solid(&img, want[k], 2, tpath(name));
    }
    // A smooth gradient, progressive: close to the source everywhere.
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            px[(y * W + x) * 3 + 0] = (uint8_t)(x * 4);
            px[(y * W + x) * 3 + 1] = (uint8_t)(y * 5);
            px[(y * W + x) * 3 + 2] = (uint8_t)(128 + x - y);
        }
    j = enc_jpeg(px, W, H, 3, 95, 1, &n);
    write_bytes(tpath("grad_prog.jpg"), j, n);
    free(j);
    if (load_ok(tpath("grad_prog.jpg"), &img)) {
        size_t where;
        int d = max_diff_u8(img.rgb, px, (size_t)W * H * 3, &where);
        CHECK(d <= 12, "grad_prog.jpg: max error %d at byte %zu", d, where);
    }
    vlmoe_image_free(&img);
}

static void test_webp(void) {
    enum { W = 41, H = 29 };
    static uint8_t px[W * H * 4];
    vlmoe_image img = {0};
    uint8_t *out = NULL;
    size_t n, where;
    fill_grad(px, W, H, 3);
    n = WebPEncodeLosslessRGB(px, W, H, W * 3, &out);
    CHECK(n > 0, "WebPEncodeLosslessRGB failed");
    write_bytes(tpath("lossless.webp"), out, n);
    WebPFree(out);
    if (load_ok(tpath("lossless.webp"), &img)) {
        CHECK(img.w == W && img.h == H, "lossless.webp size %dx%d", img.w, img.h);
        int d = max_diff_u8(img.rgb, px, (size_t)W * H * 3, &where);
        CHECK(d == 0, "lossless.webp: max diff %d at byte %zu", d, where);
    }
    // With alpha (never 0, so the encoder keeps the colours exactly): alpha dropped.
    fill_grad(px, W, H, 4);
    for (int i = 0; i < W * H; i++) px[i * 4 + 3] = (uint8_t)(1 + i % 255);
    n = WebPEncodeLosslessRGBA(px, W, H, W * 4, &out);
    write_bytes(tpath("alpha.webp"), out, n);
    WebPFree(out);
    if (load_ok(tpath("alpha.webp"), &img)) {
        int bad = 0;
        for (int i = 0; i < W * H; i++)
            for (int c = 0; c < 3; c++) bad += img.rgb[i * 3 + c] != px[i * 4 + c];
        CHECK(bad == 0, "alpha.webp: %d values differ from the RGB written", bad);
    }
    // Lossy solid colour.
    for (int i = 0; i < W * H; i++) px[i * 3] = 200, px[i * 3 + 1] = 40, px[i * 3 + 2] = 90;
    n = WebPEncodeRGB(px, W, H, W * 3, 95, &out);
    write_bytes(tpath("lossy.webp"), out, n);
    WebPFree(out);
    if (load_ok(tpath("lossy.webp"), &img)) check_solid(&img, (const uint8_t[3]){200, 40, 90}, 4, "lossy.webp");
    vlmoe_image_free(&img);
}

// Offset of the first chunk of `type` in a PNG, or 0.
static size_t png_chunk(const uint8_t *b, size_t n, const char *type) {
    for (size_t off = 8; off + 12 <= n;) {
        size_t len = (size_t)b[off] << 24 | (size_t)b[off + 1] << 16 | (size_t)b[off + 2] << 8 | b[off + 3];
        if (!memcmp(b + off + 4, type, 4)) return off;
        off += 12 + len;
    }
    return 0;
}

static void expect_fail(const char *path, vlmoe_image *img, const char *needle) {
    int rc = vlmoe_image_load(path, img);
    const char *msg = vlmoe_last_error();
    CHECK(rc != VLMOE_OK, "%s decoded as a %dx%d image", path, img->w, img->h);
    CHECK(strstr(msg, path) != NULL, "message does not name the file: %s", msg);
    if (needle) CHECK(strstr(msg, needle) != NULL, "%s: message lacks \"%s\": %s", path, needle, msg);
    CHECK(img->w == 0 && img->h == 0, "%s: failed decode left size %dx%d", path, img->w, img->h);
}

static void test_damaged(void) {
    enum { W = 64, H = 64 };
    static uint8_t px[W * H * 3];
    fill_grad(px, W, H, 3);
    vlmoe_image img = {0};
    size_t n, m;
    uint8_t *jpg = enc_jpeg(px, W, H, 3, 90, 0, &n);
    // A good decode first, so each failure must reset the size it left.
    write_bytes(tpath("good.jpg"), jpg, n);
    load_ok(tpath("good.jpg"), &img);
    // A JPEG named .png decodes: the format comes from the magic bytes.
    write_bytes(tpath("really_a_jpeg.png"), jpg, n);
    if (load_ok(tpath("really_a_jpeg.png"), &img)) CHECK(img.w == W, "jpeg-as-png size %d", img.w);

    write_bytes(tpath("trunc.jpg"), jpg, n * 6 / 10);
    expect_fail(tpath("trunc.jpg"), &img, "Premature end of JPEG file");
    write_bytes(tpath("trunc_header.jpg"), jpg, 20);
    expect_fail(tpath("trunc_header.jpg"), &img, "JPEG");
    write_bytes(tpath("no_eoi.jpg"), jpg, n - 2);
    expect_fail(tpath("no_eoi.jpg"), &img, "Premature end");
    // An EOI marker in the middle of the entropy-coded data.
    size_t sos = 0;
    for (size_t i = 2; i + 1 < n; i++)
        if (jpg[i] == 0xFF && jpg[i + 1] == 0xDA) { sos = i; break; }
    CHECK(sos > 0, "no SOS marker");
    uint8_t *bad = malloc(n);
    memcpy(bad, jpg, n);
    size_t mid = sos + (n - sos) / 2;
    bad[mid] = 0xFF, bad[mid + 1] = 0xD9;
    write_bytes(tpath("marker_in_scan.jpg"), bad, n);
    expect_fail(tpath("marker_in_scan.jpg"), &img, "Corrupt JPEG data");
    // Absurd SOF dimensions: rejected before allocating.
    memcpy(bad, jpg, n);
    for (size_t i = 2; i + 8 < n; i++)
        if (bad[i] == 0xFF && bad[i + 1] == 0xC0) {
            bad[i + 5] = 0x4E, bad[i + 6] = 0x20, bad[i + 7] = 0x4E, bad[i + 8] = 0x20;  // 20000
            break;
        }
    write_bytes(tpath("huge.jpg"), bad, n);
    expect_fail(tpath("huge.jpg"), &img, "exceeds the limit");
    free(bad);
    free(jpg);

    // PNG: a flipped byte inside IDAT (CRC mismatch), truncated, missing IEND, huge IHDR.
    png_spec s = {W, H, 8, PNG_COLOR_TYPE_RGB, 0, px, NULL, 0, NULL, 0, NULL};
    CHECK(enc_png(tpath("good.png"), &s) == 0, "write good.png");
    uint8_t *png = read_bytes(tpath("good.png"), &n);
    size_t idat = png ? png_chunk(png, n, "IDAT") : 0;
    CHECK(idat > 0, "no IDAT in good.png");
    if (png && idat) {
        // A flipped data byte (zlib notices first), then a flipped CRC byte.
        size_t len = (size_t)png[idat] << 24 | (size_t)png[idat + 1] << 16 |
                     (size_t)png[idat + 2] << 8 | png[idat + 3];
        png[idat + 8 + 10] ^= 0x55;
        write_bytes(tpath("baddata.png"), png, n);
        expect_fail(tpath("baddata.png"), &img, "PNG: IDAT");
        png[idat + 8 + 10] ^= 0x55;
        png[idat + 8 + len] ^= 0x01;
        write_bytes(tpath("badcrc.png"), png, n);
        expect_fail(tpath("badcrc.png"), &img, "CRC error");
        png[idat + 8 + len] ^= 0x01;
        write_bytes(tpath("trunc.png"), png, n / 2);
        expect_fail(tpath("trunc.png"), &img, "PNG");
        write_bytes(tpath("no_iend.png"), png, n - 12);
        expect_fail(tpath("no_iend.png"), &img, "PNG");
        // IHDR width 100000: libpng's user limit (set to VLMOE_IMAGE_MAX_SIDE) stops it.
        png[16] = 0x00, png[17] = 0x01, png[18] = 0x86, png[19] = 0xA0;
        uint32_t crc = (uint32_t)crc32(0, png + 12, 17);
        png[29] = (uint8_t)(crc >> 24), png[30] = (uint8_t)(crc >> 16);
        png[31] = (uint8_t)(crc >> 8), png[32] = (uint8_t)crc;
        write_bytes(tpath("huge.png"), png, n);
        expect_fail(tpath("huge.png"), &img, "exceeds user limit");
    }
    free(png);

    // WebP: truncated, and a RIFF/WEBP header followed by garbage.
    uint8_t *webp = NULL;
    m = WebPEncodeRGB(px, W, H, W * 3, 80, &webp);
    write_bytes(tpath("trunc.webp"), webp, m * 6 / 10);
    expect_fail(tpath("trunc.webp"), &img, "WebP");
    WebPFree(webp);
    uint8_t riff[64] = "RIFF\x38\0\0\0WEBPVP8 \x2c\0\0\0";
    for (int i = 20; i < 64; i++) riff[i] = (uint8_t)(i * 37);
    write_bytes(tpath("garbage.webp"), riff, sizeof riff);
    expect_fail(tpath("garbage.webp"), &img, "WebP");

    // Not images at all.
    write_bytes(tpath("empty.jpg"), "", 0);
    expect_fail(tpath("empty.jpg"), &img, "empty");
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 99);
    uint8_t noise[1000];
    for (size_t i = 0; i < sizeof noise; i++) noise[i] = (uint8_t)vlmoe_rng_u64(&r);
    noise[0] = 'x';
    write_bytes(tpath("random.jpg"), noise, sizeof noise);
    expect_fail(tpath("random.jpg"), &img, "not a JPEG, PNG or WebP");
    const char *text = "this is a caption, not a picture\n";
    write_bytes(tpath("text.jpg"), text, strlen(text));
    expect_fail(tpath("text.jpg"), &img, "not a JPEG, PNG or WebP");
    // Random bytes behind a valid JPEG / PNG signature.
    noise[0] = 0xFF, noise[1] = 0xD8, noise[2] = 0xFF;
    write_bytes(tpath("random_sig.jpg"), noise, sizeof noise);
    expect_fail(tpath("random_sig.jpg"), &img, "JPEG");
    memcpy(noise, "\x89PNG\r\n\x1a\n", 8);
    write_bytes(tpath("random_sig.png"), noise, sizeof noise);
    expect_fail(tpath("random_sig.png"), &img, "PNG");

    CHECK(vlmoe_image_load(tpath("does_not_exist.jpg"), &img) == VLMOE_ERR_IO, "missing file");
    CHECK(strstr(vlmoe_last_error(), "does_not_exist.jpg") != NULL, "msg: %s", vlmoe_last_error());
    CHECK(vlmoe_image_load(tmpdir, &img) == VLMOE_ERR_IO, "a directory loaded");
    CHECK(vlmoe_image_decode(NULL, 0, NULL, &img) == VLMOE_ERR_FORMAT, "NULL data");
    CHECK(strstr(vlmoe_last_error(), "<memory>") != NULL, "msg: %s", vlmoe_last_error());
    // The buffer survives failures and is reused by the next decode.
    CHECK(load_ok(tpath("good.jpg"), &img) && img.w == W, "decode after failures");
    vlmoe_image_free(&img);
    vlmoe_image_free(&img);
    vlmoe_image_free(NULL);
}

static void test_buffers(void) {
    enum { W = 20, H = 10 };
    static uint8_t px[W * H * 3], mine[W * H * 3 + 16];
    fill_grad(px, W, H, 3);
    uint8_t *out = NULL;
    size_t n = WebPEncodeLosslessRGB(px, W, H, W * 3, &out);
    // Caller-provided buffer, large enough: used in place, never freed by vlmoe.
    vlmoe_image img = {.rgb = mine, .cap = sizeof mine, .owned = 0};
    CHECK(vlmoe_image_decode(out, n, "mem.webp", &img) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(img.rgb == mine && !img.owned && img.w == W, "caller buffer not used");
    CHECK(!memcmp(mine, px, sizeof px), "pixels in the caller buffer");
    // Too small: replaced by an owned allocation.
    vlmoe_image small = {.rgb = mine, .cap = 10, .owned = 0};
    CHECK(vlmoe_image_decode(out, n, "mem.webp", &small) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(small.rgb != mine && small.owned && small.cap >= sizeof px, "small buffer kept");
    vlmoe_image_free(&small);
    vlmoe_image_free(&img);
    CHECK(img.rgb == NULL && img.cap == 0, "free zeroes the struct");
    WebPFree(out);
    CHECK(vlmoe_image_alloc(&img, 0, 5) == VLMOE_ERR_ARG, "0 width");
    CHECK(vlmoe_image_alloc(&img, VLMOE_IMAGE_MAX_SIDE + 1, 5) == VLMOE_ERR_ARG, "too wide");
    CHECK(vlmoe_image_alloc(&img, 3, 2) == VLMOE_OK && img.owned && img.cap >= 18, "alloc");
    vlmoe_image_free(&img);
}

static void test_geometry(void) {
    int w, h;
    vlmoe_image_shorter_side_dims(500, 375, 224, &w, &h);
    CHECK(w == 298 && h == 224, "500x375 -> %dx%d", w, h);
    vlmoe_image_shorter_side_dims(375, 500, 224, &w, &h);
    CHECK(w == 224 && h == 298, "375x500 -> %dx%d", w, h);
    vlmoe_image_shorter_side_dims(224, 224, 224, &w, &h);
    CHECK(w == 224 && h == 224, "224x224 -> %dx%d", w, h);
    vlmoe_image_shorter_side_dims(157, 111, 100, &w, &h);
    CHECK(w == 141 && h == 100, "157x111 -> %dx%d (int(14.144...))", w, h);
    // CenterCrop: round((h - S) / 2) with Python's half to even.
    int d[][2] = {{0, 0}, {1, 0}, {2, 1}, {3, 2}, {5, 2}, {7, 4}, {74, 37}};
    for (int i = 0; i < 7; i++) {
        vlmoe_image_box b = vlmoe_image_center_box(224 + d[i][0], 224 + d[i][0], 224, 224);
        CHECK(b.x == d[i][1] && b.y == d[i][1] && b.w == 224, "excess %d: offset %d, want %d",
              d[i][0], b.x, d[i][1]);
    }
}

static vlmoe_image make_image(int w, int h, uint64_t seed) {
    vlmoe_image img = {0};
    if (vlmoe_image_alloc(&img, w, h)) return img;
    vlmoe_rng r;
    vlmoe_rng_seed(&r, seed);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < 3; c++)
                img.rgb[((size_t)y * w + x) * 3 + c] =
                    (uint8_t)((x * (c + 1) * 255 / w + y * 64 / h + (int)(vlmoe_rng_u64(&r) % 24)) & 255);
    return img;
}

// Colour jitter (timm's / BEiT's --color-jitter): PIL's ImageEnhance blends worked by hand on two
// pixels, then preprocess_train with jitter and flip against the plain crop of the same seed
// jittered with the draws the header documents (order by Fisher-Yates, then three factors).
static void test_color_jitter(void) {
    const uint8_t px0[6] = {100, 50, 200, 20, 240, 60};
    uint8_t px[6];
    // luminance (19595 R + 38470 G + 7471 B + 2^15) >> 16: 82 and 154
    memcpy(px, px0, 6);
    vlmoe_image_color_jitter(px, 2, 1, (const double[3]){1.5, 1, 1}, (const int[3]){0, 1, 2});
    CHECK(!memcmp(px, (const uint8_t[6]){150, 75, 255, 30, 255, 90}, 6), "brightness 1.5: %d %d %d %d %d %d",
          px[0], px[1], px[2], px[3], px[4], px[5]);
    memcpy(px, px0, 6);
    vlmoe_image_color_jitter(px, 2, 1, (const double[3]){1, 0.5, 1}, (const int[3]){1, 0, 2});
    // mean luminance 118 (rounded from 118.0): 118 + 0.5 (v - 118), truncated
    CHECK(!memcmp(px, (const uint8_t[6]){109, 84, 159, 69, 179, 89}, 6), "contrast 0.5: %d %d %d %d %d %d",
          px[0], px[1], px[2], px[3], px[4], px[5]);
    memcpy(px, px0, 6);
    // saturation 0 (greys 82, 154), brightness 1.5 (123, 231), contrast 0.5 about their mean's
    // rounding int(177 + 0.5) = 177: 150, 204
    vlmoe_image_color_jitter(px, 2, 1, (const double[3]){1.5, 0.5, 0}, (const int[3]){2, 0, 1});
    CHECK(!memcmp(px, (const uint8_t[6]){150, 150, 150, 204, 204, 204}, 6), "saturation, brightness, contrast: "
          "%d %d %d %d %d %d", px[0], px[1], px[2], px[3], px[4], px[5]);

    enum { S = 16 };
    vlmoe_image_params p = vlmoe_image_default_params();
    p.size = S, p.scale_min = 0.5;
    for (int c = 0; c < 3; c++) p.mean[c] = 0, p.std[c] = 1; // out = v / 255: the bytes come back
    vlmoe_image img = make_image(40, 30, 4);
    float *a = malloc(sizeof(float) * 3 * S * S), *b = malloc(sizeof(float) * 3 * S * S);
    uint8_t *u = malloc(3 * S * S);
    int bad = 0, changed = 0;
    for (uint64_t seed = 1; seed <= 50; seed++) {
        vlmoe_rng r, q;
        vlmoe_rng_seed(&r, seed);
        p.flip_prob = 0, p.color_jitter = 0;
        CHECK(vlmoe_image_preprocess_train(&img, &p, &r, a) == VLMOE_OK, "%s", vlmoe_last_error());
        // the same draws by hand: box, flip, order, factors
        vlmoe_rng_seed(&q, seed);
        vlmoe_image_box bx;
        vlmoe_image_random_resized_box(img.w, img.h, &p, &q, &bx);
        const int flip = vlmoe_rng_uniform(&q) < 0.5;
        int order[3] = {0, 1, 2};
        for (int k = 2; k > 0; k--) {
            const int j = (int)vlmoe_rng_below(&q, (uint32_t)k + 1), t = order[k];
            order[k] = order[j], order[j] = t;
        }
        double f[3];
        for (int k = 0; k < 3; k++) f[k] = 0.6 + 0.8 * vlmoe_rng_uniform(&q);
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++)
                for (int c = 0; c < 3; c++) u[(y * S + x) * 3 + c] = (uint8_t)lrintf(a[(c * S + y) * S + x] * 255.0f);
        vlmoe_image_color_jitter(u, S, S, f, order);
        vlmoe_rng_seed(&r, seed);
        p.flip_prob = 0.5, p.color_jitter = 0.4;
        CHECK(vlmoe_image_preprocess_train(&img, &p, &r, b) == VLMOE_OK, "%s", vlmoe_last_error());
        CHECK(!memcmp(&r, &q, sizeof(r)), "seed %d: preprocess_train drew other than box, flip, order, 3 factors",
              (int)seed);
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++)
                for (int c = 0; c < 3; c++) {
                    const float want = (float)u[(y * S + (flip ? S - 1 - x : x)) * 3 + c] / 255.0f;
                    bad += b[(c * S + y) * S + x] != want;
                }
        changed += memcmp(a, b, sizeof(float) * 3 * S * S) != 0;
    }
    printf("color jitter 0.4 + hflip 0.5: 50 seeds, %d values differ from the hand-drawn jitter, %d outputs "
           "changed\n", bad, changed);
    CHECK(bad == 0 && changed == 50, "jitter and flip: %d values differ, %d of 50 outputs changed", bad, changed);
    p.color_jitter = -0.1;
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 1);
    CHECK(vlmoe_image_preprocess_train(&img, &p, &r, b) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "color_jitter"),
          "a negative color_jitter is refused: %s", vlmoe_last_error());
    free(a), free(b), free(u);
    vlmoe_image_free(&img);
}

static void test_preprocess(void) {
    vlmoe_image_params p = vlmoe_image_default_params();
    CHECK(p.size == 224 && p.mean[0] == 0.48145466f && p.std[2] == 0.27577711f, "defaults");
    CHECK(p.scale_min == 0.9 && p.scale_max == 1.0 && p.flip_prob == 0, "train defaults");
    enum { S = 32 };
    p.size = S;
    float *a = malloc(sizeof(float) * 3 * S * S), *b = malloc(sizeof(float) * 3 * S * S);
    vlmoe_image img = make_image(120, 90, 5), tmp = {0};
    vlmoe_rng r1, r2;

    // Same seed, same crop; output inside the normalised range of [0, 1].
    vlmoe_rng_seed(&r1, 7);
    vlmoe_rng_seed(&r2, 7);
    p.scale_min = 0.3;
    CHECK(vlmoe_image_preprocess_train(&img, &p, &r1, a) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(vlmoe_image_preprocess_train(&img, &p, &r2, b) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(!memcmp(a, b, sizeof(float) * 3 * S * S), "same seed, different output");
    CHECK(!memcmp(&r1, &r2, sizeof r1), "rng states diverged");
    int out_of_range = 0;
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < S * S; i++) {
            float v = a[c * S * S + i], lo = (0 - p.mean[c]) / p.std[c], hi = (1 - p.mean[c]) / p.std[c];
            out_of_range += !(v >= lo && v <= hi);
        }
    CHECK(out_of_range == 0, "%d values outside the normalised [0, 1] range", out_of_range);
    vlmoe_rng_seed(&r2, 8);
    CHECK(vlmoe_image_preprocess_train(&img, &p, &r2, b) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(memcmp(a, b, sizeof(float) * 3 * S * S) != 0, "seeds 7 and 8 gave the same crop");

    // Box statistics over many draws: inside, area and aspect within range (up to rounding).
    vlmoe_image_params q = vlmoe_image_default_params();
    vlmoe_rng_seed(&r1, 11);
    int bad = 0;
    for (int t = 0; t < 2000; t++) {
        vlmoe_image_box bx;
        CHECK(vlmoe_image_random_resized_box(500, 375, &q, &r1, &bx) == VLMOE_OK, "box");
        double area = (double)bx.w * bx.h / (500.0 * 375), ar = (double)bx.w / bx.h;
        bad += bx.x < 0 || bx.y < 0 || bx.x + bx.w > 500 || bx.y + bx.h > 375 || area < 0.89 ||
               area > 1.0 || ar < 0.74 || ar > 1.35;
    }
    CHECK(bad == 0, "%d of 2000 boxes outside the scale / ratio / image bounds", bad);
    // Fallbacks (torchvision): too wide -> height kept, width round(h * 4/3), centered (floor).
    vlmoe_image_box fb;
    vlmoe_image_random_resized_box(1000, 10, &q, &r1, &fb);
    CHECK(fb.x == 493 && fb.y == 0 && fb.w == 13 && fb.h == 10, "wide fallback %d,%d %dx%d",
          fb.x, fb.y, fb.w, fb.h);
    vlmoe_image_random_resized_box(10, 1000, &q, &r1, &fb);
    CHECK(fb.x == 0 && fb.y == 493 && fb.w == 10 && fb.h == 13, "tall fallback %d,%d %dx%d",
          fb.x, fb.y, fb.w, fb.h);

    // Flip: flip_prob 1 mirrors exactly what flip_prob 0 gives for the same seed.
    p.flip_prob = 0;
    vlmoe_rng_seed(&r1, 3);
    vlmoe_image_preprocess_train(&img, &p, &r1, a);
    p.flip_prob = 1;
    vlmoe_rng_seed(&r1, 3);
    vlmoe_image_preprocess_train(&img, &p, &r1, b);
    int mism = 0;
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < S; y++)
            for (int x = 0; x < S; x++)
                mism += a[(c * S + y) * S + x] != b[(c * S + y) * S + (S - 1 - x)];
    CHECK(mism == 0, "flip: %d values are not mirrored", mism);
    // flip_prob 0.5: about half of 400 seeds flip (the box draws are the same as with 0).
    int flips = 0;
    for (uint64_t seed = 100; seed < 500; seed++) {
        p.flip_prob = 0;
        vlmoe_rng_seed(&r1, seed);
        vlmoe_image_preprocess_train(&img, &p, &r1, a);
        p.flip_prob = 0.5;
        vlmoe_rng_seed(&r1, seed);
        vlmoe_image_preprocess_train(&img, &p, &r1, b);
        flips += memcmp(a, b, sizeof(float) * 3 * S * S) != 0;
    }
    CHECK(flips > 150 && flips < 250, "flip_prob 0.5 flipped %d of 400", flips);

    // scale (1, 1) and ratio w/h: the box is the whole image, output = resize to S x S.
    vlmoe_image sq = make_image(90, 60, 9);
    p.flip_prob = 0;
    p.scale_min = p.scale_max = 1.0;
    p.ratio_min = p.ratio_max = 1.5;
    vlmoe_rng_seed(&r1, 1);
    CHECK(vlmoe_image_preprocess_train(&sq, &p, &r1, a) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(vlmoe_image_resize(&sq, NULL, S, S, &tmp) == VLMOE_OK, "%s", vlmoe_last_error());
    vlmoe_image_to_tensor(&tmp, &p, 0, b);
    CHECK(!memcmp(a, b, sizeof(float) * 3 * S * S), "full-image train crop != resize");

    // Eval when the shorter side is already S: no resampling, just the center crop.
    vlmoe_image e = make_image(S + 9, S, 4);
    CHECK(vlmoe_image_preprocess_eval(&e, &p, a) == VLMOE_OK, "%s", vlmoe_last_error());
    vlmoe_image_box cb = {4, 0, S, S};   // round(4.5) = 4
    CHECK(vlmoe_image_crop(&e, &cb, &tmp) == VLMOE_OK, "%s", vlmoe_last_error());
    vlmoe_image_to_tensor(&tmp, &p, 0, b);
    CHECK(!memcmp(a, b, sizeof(float) * 3 * S * S), "eval of a %dx%d image != center crop", S + 9, S);
    // The eval path resamples only the crop window: it must equal the full resize + center crop,
    // for random sizes down to 1 pixel and extreme aspect ratios.
    vlmoe_rng_seed(&r1, 77);
    int window_bad = 0;
    for (int t = 0; t < 60; t++) {
        int iw = 1 + (int)vlmoe_rng_below(&r1, t < 10 ? 4 : 90);
        int ih = 1 + (int)vlmoe_rng_below(&r1, t % 3 ? 90 : 300);
        vlmoe_image_params q2 = vlmoe_image_default_params();
        q2.size = 1 + (int)vlmoe_rng_below(&r1, 40);
        int qs = q2.size, rw, rh;
        vlmoe_image src = make_image(iw, ih, (uint64_t)t), full = {0};
        float *x1 = malloc(sizeof(float) * 3 * qs * qs), *x2 = malloc(sizeof(float) * 3 * qs * qs);
        vlmoe_image_shorter_side_dims(iw, ih, qs, &rw, &rh);
        vlmoe_image_box cbox = vlmoe_image_center_box(rw, rh, qs, qs);
        int ok = vlmoe_image_preprocess_eval(&src, &q2, x1) == VLMOE_OK &&
                 vlmoe_image_resize(&src, NULL, rw, rh, &full) == VLMOE_OK &&
                 vlmoe_image_crop(&full, &cbox, &tmp) == VLMOE_OK &&
                 vlmoe_image_to_tensor(&tmp, &q2, 0, x2) == VLMOE_OK;
        CHECK(ok, "%dx%d -> %d: %s", iw, ih, qs, vlmoe_last_error());
        if (ok && memcmp(x1, x2, sizeof(float) * 3 * qs * qs)) {
            window_bad++;
            fprintf(stderr, "window mismatch: %dx%d image, S %d\n", iw, ih, qs);
        }
        free(x1);
        free(x2);
        vlmoe_image_free(&src);
        vlmoe_image_free(&full);
    }
    CHECK(window_bad == 0, "%d of 60 eval windows differ from resize + crop", window_bad);
    // Solid colour stays solid through any resize (weights sum to one).
    memset(e.rgb, 200, (size_t)e.w * e.h * 3);
    CHECK(vlmoe_image_resize(&e, NULL, 7, 100, &tmp) == VLMOE_OK, "%s", vlmoe_last_error());
    int off = 0;
    for (size_t i = 0; i < (size_t)7 * 100 * 3; i++) off += tmp.rgb[i] != 200;
    CHECK(off == 0, "solid resize: %d values changed", off);

    // Bad arguments.
    vlmoe_image_params z = vlmoe_image_default_params();
    z.size = 0;
    CHECK(vlmoe_image_preprocess_eval(&img, &z, a) == VLMOE_ERR_ARG, "size 0");
    z = vlmoe_image_default_params();
    z.std[1] = 0;
    CHECK(vlmoe_image_preprocess_eval(&img, &z, a) == VLMOE_ERR_ARG, "std 0");
    z = vlmoe_image_default_params();
    z.scale_min = 0.8, z.scale_max = 0.5;
    CHECK(vlmoe_image_preprocess_train(&img, &z, &r1, a) == VLMOE_ERR_ARG, "scale min > max");
    z = vlmoe_image_default_params();
    z.flip_prob = 1.5;
    CHECK(vlmoe_image_preprocess_train(&img, &z, &r1, a) == VLMOE_ERR_ARG, "flip_prob 1.5");
    vlmoe_image_box out_box = {100, 0, 30, 10};
    CHECK(vlmoe_image_resize(&img, &out_box, 8, 8, &tmp) == VLMOE_ERR_ARG, "box outside");
    CHECK(vlmoe_image_crop(&img, &out_box, &tmp) == VLMOE_ERR_ARG, "crop outside");
    CHECK(vlmoe_image_resize(&img, NULL, 8, 8, &img) == VLMOE_ERR_ARG, "dst == src");
    vlmoe_image empty = {0};
    CHECK(vlmoe_image_preprocess_eval(&empty, &p, a) == VLMOE_ERR_ARG, "empty image");

    vlmoe_image_free(&img);
    vlmoe_image_free(&sq);
    vlmoe_image_free(&e);
    vlmoe_image_free(&tmp);
    free(a);
    free(b);
}

// ---------------------------------------------------------------------------------------------
// PIL parity (tests/ref/gen_image.py). Tolerances: resampling, crops and PNG / WebP decoding
// are expected to be exact (the C code replays PIL's integer arithmetic, and its double
// coefficient arithmetic operation for operation); JPEG within 1 level (PIL uses the same
// libjpeg-turbo with the same settings, so in practice also exact); tensors within 1e-6 (same
// float32 operations, so in practice bit-identical).

typedef struct {
    char file[128];
    vlmoe_image img;
} cached_image;

static void parity_one(const vlmoe_st *st, int index, cached_image *cache, int *stats) {
    vlmoe_tensor_info ti;
    if (vlmoe_st_info(st, index, &ti) != VLMOE_OK) return;
    const char *bar = strchr(ti.name, '|');
    if (!bar || (size_t)(bar - ti.name) >= sizeof cache->file) return;
    char file[128], path[1024];
    memcpy(file, ti.name, (size_t)(bar - ti.name));
    file[bar - ti.name] = 0;
    const char *op = bar + 1;
    if (strcmp(cache->file, file)) {
        snprintf(path, sizeof path, "%s/%s", fixture_dir(), file);
        snprintf(cache->file, sizeof cache->file, "%s", file);
        if (vlmoe_image_load(path, &cache->img) != VLMOE_OK) {
            CHECK(0, "load %s: %s", path, vlmoe_last_error());
            cache->file[0] = 0;
            return;
        }
    }
    const vlmoe_image *src = &cache->img;
    vlmoe_image out = {0};
    vlmoe_image_params p = vlmoe_image_default_params();
    int S = 0, rc = VLMOE_OK, is_tensor = 0;
    float *t = NULL;
    int bx, by, bw, bh, rw, rh;
    if (!strcmp(op, "decode")) {
        rc = vlmoe_image_crop(src, &(vlmoe_image_box){0, 0, src->w, src->h}, &out);
    } else if (sscanf(op, "short%d", &S) == 1) {
        vlmoe_image_shorter_side_dims(src->w, src->h, S, &rw, &rh);
        rc = vlmoe_image_resize(src, NULL, rw, rh, &out);
    } else if (sscanf(op, "crop%d", &S) == 1) {
        vlmoe_image r = {0};
        vlmoe_image_shorter_side_dims(src->w, src->h, S, &rw, &rh);
        rc = vlmoe_image_resize(src, NULL, rw, rh, &r);
        vlmoe_image_box cb = vlmoe_image_center_box(rw, rh, S, S);
        if (!rc) rc = vlmoe_image_crop(&r, &cb, &out);
        vlmoe_image_free(&r);
    } else if (sscanf(op, "tensor%d", &S) == 1 || sscanf(op, "limoe%d", &S) == 1) {
        is_tensor = 1;
        if (op[0] == 'l')
            for (int c = 0; c < 3; c++) p.mean[c] = p.std[c] = 0.5f;
        p.size = S;
        t = malloc(sizeof(float) * 3 * S * S);
        rc = vlmoe_image_preprocess_eval(src, &p, t);
    } else if (sscanf(op, "resize%dx%d", &rw, &rh) == 2) {
        rc = vlmoe_image_resize(src, NULL, rw, rh, &out);
    } else if (sscanf(op, "box%d,%d,%d,%d|%d", &bx, &by, &bw, &bh, &S) == 5) {
        rc = vlmoe_image_resize(src, &(vlmoe_image_box){bx, by, bw, bh}, S, S, &out);
    } else if (sscanf(op, "jitter%d_%d_%d_%d", &bx, &by, &bw, &bh) == 4) {
        // ColorJitter's adjustments with factors in hundredths, applied in the order of bh's digits
        const double f[3] = {bx / 100.0, by / 100.0, bw / 100.0};
        const int order[3] = {bh / 100, bh / 10 % 10, bh % 10};
        rc = vlmoe_image_crop(src, &(vlmoe_image_box){0, 0, src->w, src->h}, &out);
        if (rc == VLMOE_OK) vlmoe_image_color_jitter(out.rgb, out.w, out.h, f, order);
    } else {
        CHECK(0, "unknown fixture op %s", ti.name);
        return;
    }
    CHECK(rc == VLMOE_OK, "%s: %s", ti.name, vlmoe_last_error());
    if (rc == VLMOE_OK && is_tensor) {
        size_t n = (size_t)3 * S * S;
        float *ref = malloc(sizeof(float) * n);
        CHECK(vlmoe_st_read_f32(st, ti.name, ref, n) == VLMOE_OK, "%s", vlmoe_last_error());
        double m = 0;
        size_t where = 0, differ = 0;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)t[i] - ref[i]);
            differ += t[i] != ref[i];
            if (d > m) m = d, where = i;
        }
        CHECK(m <= 1e-6, "%s: max abs diff %.3g at %zu", ti.name, m, where);
        stats[2] += differ != 0;
        free(ref);
    } else if (rc == VLMOE_OK) {
        int tol = strstr(file, ".jpg") ? 1 : 0;
        CHECK(ti.dtype == VLMOE_DT_U8 && ti.ndim == 3 && ti.shape[0] == out.h &&
              ti.shape[1] == out.w && ti.shape[2] == 3, "%s: reference shape %lldx%lld vs %dx%d",
              ti.name, (long long)ti.shape[0], (long long)ti.shape[1], out.h, out.w);
        if (ti.nbytes == (size_t)out.w * out.h * 3) {
            size_t where, differ = 0;
            const uint8_t *ref = ti.data;
            int d = max_diff_u8(out.rgb, ref, ti.nbytes, &where);
            for (size_t i = 0; i < ti.nbytes; i++) differ += out.rgb[i] != ref[i];
            CHECK(d <= tol, "%s: max diff %d > %d at byte %zu (%zu bytes differ)", ti.name, d, tol,
                  where, differ);
            stats[1] += differ != 0;
        }
    }
    stats[0]++;
    free(t);
    vlmoe_image_free(&out);
}

static void test_pil_parity(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/image_ref.safetensors", fixture_dir());
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "test_image: %s not found, skipping the PIL parity tests\n", path);
        return;
    }
    fclose(f);
    vlmoe_st *st = NULL;
    CHECK(vlmoe_st_open(path, &st) == VLMOE_OK, "open %s: %s", path, vlmoe_last_error());
    if (!st) return;
    cached_image cache = {{0}, {0}};
    int stats[3] = {0, 0, 0};   // references compared, uint8 ones not exact, tensors not exact
    for (int i = 0; i < vlmoe_st_count(st); i++) parity_one(st, i, &cache, stats);
    CHECK(stats[0] >= 60, "only %d PIL references compared", stats[0]);
    fprintf(stderr, "test_image: %d PIL references compared; not bit-exact: %d images, %d "
            "tensors\n", stats[0], stats[1], stats[2]);
    vlmoe_image_free(&cache.img);
    vlmoe_st_close(st);
}

static void cleanup_tmpdir(void) {
    DIR *d = opendir(tmpdir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) unlink(tpath(e->d_name));
    closedir(d);
    rmdir(tmpdir);
}

int main(void) {
    test_color_jitter();
    snprintf(tmpdir, sizeof tmpdir, "/tmp/vlmoe_test_image_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_detect();
    test_png();
    test_jpeg();
    test_webp();
    test_damaged();
    test_buffers();
    test_geometry();
    test_preprocess();
    test_pil_parity();
    cleanup_tmpdir();
    return test_summary("test_image");
}
