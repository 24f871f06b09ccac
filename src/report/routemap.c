// routemap.c: routing maps like LIMoE Fig. 2: an input image next to one panel per MoE layer in
// which every patch is filled with the colour of the expert that took it (grey: dropped by
// capacity), from the per-token decision of vlmoe_model_routing; written as PNG with libpng.
// Covered by tests/test_routemap.c (a hand-built router, colours checked in the PNG).
#include <errno.h>
#include <math.h>
#include <png.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "report/report.h"

// Tableau-like colours, far from grey and from each other; experts past 20 get hues spread by
// the golden angle (a 32-expert layer stays readable, if less so).
static const uint8_t PALETTE[20][3] = {
    {31, 119, 180}, {255, 127, 14}, {44, 160, 44},  {214, 39, 40},  {148, 103, 189}, {140, 86, 75},  {227, 119, 194},
    {188, 189, 34}, {23, 190, 207}, {174, 199, 232}, {255, 187, 120}, {152, 223, 138}, {255, 152, 150}, {197, 176, 213},
    {196, 156, 148}, {247, 182, 210}, {219, 219, 141}, {158, 218, 229}, {57, 59, 121},  {99, 121, 57}};

void report_expert_rgb(int expert, uint8_t rgb[3]) {
    if (expert < 0) {
        rgb[0] = rgb[1] = rgb[2] = REPORT_DROPPED_RGB;
        return;
    }
    if (expert < 20) {
        memcpy(rgb, PALETTE[expert], 3);
        return;
    }
    const double h = fmod((expert - 20) * 137.508, 360.0) / 60.0, s = 0.65, v = 0.85;
    const int i = (int)h;
    const double f = h - i, p = v * (1 - s), q = v * (1 - s * f), t = v * (1 - s * (1 - f));
    const double c[6][3] = {{v, t, p}, {q, v, p}, {p, v, t}, {p, q, v}, {t, p, v}, {v, p, q}};
    for (int k = 0; k < 3; k++) rgb[k] = (uint8_t)(255 * c[i % 6][k] + 0.5);
}

void report_routes_free(report_routes *r) {
    if (!r) return;
    free(r->layer_name), free(r->patch_expert), free(r->text_expert);
    memset(r, 0, sizeof(*r));
}

int report_routes_from_model(const vlmoe_model *m, int ex, report_routes *out) {
    memset(out, 0, sizeof(*out));
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int nl = 0;
    const vlmoe_moe_stats *st = vlmoe_model_moe_stats(m, &nl);
    if (!st || nl == 0) return vlmoe_fail(VLMOE_ERR_ARG, "model %s has no MoE layers: no routing to draw", c->name);
    out->grid = c->image_size / c->patch_size;
    out->npatch = out->grid * out->grid;
    out->ntext = c->context_length;
    out->layer_name = calloc((size_t)nl, sizeof(*out->layer_name));
    out->patch_expert = malloc(sizeof(int32_t) * (size_t)nl * out->npatch);
    out->text_expert = malloc(sizeof(int32_t) * (size_t)nl * out->ntext);
    if (!out->layer_name || !out->patch_expert || !out->text_expert) {
        report_routes_free(out);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "routing map of %d layers", nl);
    }
    vlmoe_token_route *r = NULL;
    float *best = malloc(sizeof(float) * (size_t)(out->npatch + out->ntext));
    int rc = best ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "routing map");
    const int cls = c->image_class_token ? 1 : 0;
    for (int l = 0; l < nl && !rc; l++) {
        int32_t *pe = out->patch_expert + (size_t)out->layers * out->npatch;
        int32_t *te = out->text_expert + (size_t)out->layers * out->ntext;
        for (int i = 0; i < out->npatch; i++) pe[i] = -1;
        for (int i = 0; i < out->ntext; i++) te[i] = -1;
        for (int i = 0; i < out->npatch + out->ntext; i++) best[i] = -1;
        int n = 0;
        if (vlmoe_model_routing(m, l, NULL, 0, &n) || n == 0) continue; // Soft MoE, or a layer that saw nothing
        vlmoe_token_route *r2 = realloc(r, sizeof(*r) * (size_t)n);
        if (!r2) { rc = vlmoe_fail(VLMOE_ERR_NOMEM, "routing of %d entries", n); break; }
        r = r2;
        if ((rc = vlmoe_model_routing(m, l, r, n, &n))) break;
        int seen = 0;
        for (int i = 0; i < n; i++) {
            const vlmoe_token_route *e = &r[i];
            if (e->example != ex) continue;
            seen = 1;
            int slot;
            int32_t *dst;
            if (e->modality == VLMOE_MOD_IMAGE) {
                const int p = e->position - cls;
                if (p < 0 || p >= out->npatch) continue;
                slot = p, dst = pe;
            } else {
                if (e->position < 0 || e->position >= out->ntext) continue;
                slot = out->npatch + e->position, dst = te;
            }
            // the expert that took it: of the accepted assignments, the largest combine weight
            if (e->dropped || e->expert < 0 || e->weight <= best[slot]) continue;
            best[slot] = e->weight;
            dst[slot >= out->npatch ? slot - out->npatch : slot] = e->expert;
        }
        if (!seen) continue;
        snprintf(out->layer_name[out->layers], sizeof out->layer_name[0], "e%d.b%d", st[l].encoder, st[l].block);
        if (st[l].num_experts > out->num_experts) out->num_experts = st[l].num_experts;
        out->layers++;
    }
    free(r), free(best);
    if (!rc && out->layers == 0)
        rc = vlmoe_fail(VLMOE_ERR_ARG, "model %s: no MoE layer has a per-token decision for example %d (Soft MoE "
                        "layers have none)", c->name, ex);
    if (rc) report_routes_free(out);
    return rc;
}

int report_map_render(const report_routes *r, const float *image, int S, const float mean[3], const float std[3],
                      report_map_params p, uint8_t **rgb, int *w, int *h) {
    const int side = r->grid * p.cell, panels = 1 + r->layers;
    *w = panels * side + (panels - 1) * p.gap, *h = side;
    *rgb = malloc((size_t)*w * *h * 3);
    if (!*rgb) return vlmoe_fail(VLMOE_ERR_NOMEM, "routing map of %d x %d pixels", *w, *h);
    memset(*rgb, 255, (size_t)*w * *h * 3);
    for (int y = 0; y < side; y++) // the input, nearest pixel, back to [0, 255]
        for (int x = 0; x < side; x++) {
            const int sy = (int)((long)y * S / side), sx = (int)((long)x * S / side);
            for (int k = 0; k < 3; k++) {
                const float v = (image[((size_t)k * S + sy) * S + sx] * std[k] + mean[k]) * 255.0f;
                (*rgb)[((size_t)y * *w + x) * 3 + k] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v + 0.5f);
            }
        }
    for (int l = 0; l < r->layers; l++) {
        const int x0 = (l + 1) * (side + p.gap);
        for (int y = 0; y < side; y++)
            for (int x = 0; x < side; x++) {
                uint8_t c[3];
                report_expert_rgb(r->patch_expert[(size_t)l * r->npatch + (y / p.cell) * r->grid + x / p.cell], c);
                // a thin darker line between patches keeps neighbours of one expert countable
                const int edge = p.cell >= 6 && (x % p.cell == 0 || y % p.cell == 0);
                for (int k = 0; k < 3; k++) (*rgb)[((size_t)y * *w + x0 + x) * 3 + k] = edge ? c[k] * 3 / 4 : c[k];
            }
    }
    return VLMOE_OK;
}

// ---- PNG
typedef struct {
    uint8_t *b;
    size_t n, cap;
    int oom;
} membuf;

static void mem_write(png_structp png, png_bytep data, png_size_t n) {
    membuf *m = png_get_io_ptr(png);
    if (m->oom) return;
    if (m->n + n > m->cap) {
        size_t c = m->cap ? m->cap : 4096;
        while (c < m->n + n) c *= 2;
        uint8_t *b = realloc(m->b, c);
        if (!b) { m->oom = 1; return; }
        m->b = b, m->cap = c;
    }
    memcpy(m->b + m->n, data, n);
    m->n += n;
}
static void mem_flush(png_structp png) { (void)png; }

// One PNG onto f (a file) or m (memory). setjmp is libpng's error path.
static int png_out(FILE *f, membuf *m, const uint8_t *rgb, int w, int h, const char *what) {
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info) {
        png_destroy_write_struct(&png, NULL);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: PNG writer", what);
    }
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_write_struct(&png, &info);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write the PNG", what);
    }
    if (f) png_init_io(png, f);
    else png_set_write_fn(png, m, mem_write, mem_flush);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (int y = 0; y < h; y++) png_write_row(png, (png_const_bytep)(rgb + (size_t)y * w * 3));
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    if (m && m->oom) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: PNG of %d x %d", what, w, h);
    return VLMOE_OK;
}

int report_png_write(const char *path, const uint8_t *rgb, int w, int h) {
    FILE *f = fopen(path, "wb");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    int st = png_out(f, NULL, rgb, w, h, path);
    if (fclose(f) && !st) st = vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    if (st) remove(path);
    return st;
}

int report_png_encode(const uint8_t *rgb, int w, int h, uint8_t **png, size_t *n) {
    membuf m = {0};
    const int st = png_out(NULL, &m, rgb, w, h, "routing map");
    if (st) free(m.b), m.b = NULL, m.n = 0;
    *png = m.b, *n = m.n;
    return st;
}
