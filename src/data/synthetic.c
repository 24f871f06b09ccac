// synthetic.c: vlmoe's built-in image-caption dataset: coloured shapes on varied backgrounds,
// generated on the fly from (seed, split, index), with 20 zero-shot (colour, shape) classes,
// prompt templates and the word-level tokenizer of its vocabulary. Covered by tests/test_synthetic.c.
//
// Each sample seeds its own vlmoe_rng from a hash of (seed, split, index), so samples need no
// shared state (thread-safe), can be drawn in any order and are identical on every machine.
// Shape is part of the class so that a colour histogram alone cannot solve zero-shot
// classification; object size varies 2x so the object's pixel count does not give the shape away.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"

enum { NCOLOURS = 5, NSHAPES = 4, NCLASSES = NCOLOURS * NSHAPES, NBGS = 4 };
enum { SHAPE_CIRCLE, SHAPE_SQUARE, SHAPE_TRIANGLE, SHAPE_CROSS };
enum { BG_PLAIN, BG_GRADIENT, BG_STRIPED, BG_NOISY };

static const char *const colour_names[NCOLOURS] = {"red", "green", "blue", "yellow", "purple"};
static const char *const shape_names[NSHAPES] = {"circle", "square", "triangle", "cross"};
static const char *const bg_names[NBGS] = {"plain", "gradient", "striped", "noisy"};
static const char *const size_names[3] = {"small", "medium", "large"};
// 3x3 position buckets, row-major from the top left; two words except the middle so that
// "in the <pos>" always reads naturally.
static const char *const pos_names[9] = {"top left",    "top center",    "top right",
                                         "center left", "center",        "center right",
                                         "bottom left", "bottom center", "bottom right"};

// Saturated base colours in [0,1], far apart from each other and from the low-saturation
// backgrounds; each sample jitters them a little so a class is not one exact RGB value.
static const float colour_rgb[NCOLOURS][3] = {
    {0.88f, 0.16f, 0.14f}, // red
    {0.15f, 0.74f, 0.22f}, // green
    {0.16f, 0.32f, 0.92f}, // blue
    {0.93f, 0.85f, 0.15f}, // yellow
    {0.60f, 0.20f, 0.80f}, // purple
};

// Zero-shot prompts in the style of CLIP's ImageNet templates; "{}" is the class name.
static const char *const templates[] = {
    "a photo of a {}.", "a picture of a {}.",    "a drawing of a {}.",
    "an image of a {}.", "a {} on a background.", "a rendering of a {}.",
};
enum { NTEMPLATES = (int)(sizeof templates / sizeof templates[0]) };

// The vocabulary: every word a caption or template can produce, in a fixed order (ids from 4).
// The tokenizer splits on non-alphanumerics, so punctuation ("," ".") is dropped, not a token.
static const char *const vocab[] = {
    // colours, shapes
    "red", "green", "blue", "yellow", "purple", "circle", "square", "triangle", "cross",
    // sizes, positions, backgrounds
    "small", "medium", "large", "top", "bottom", "left", "right", "center", "plain", "gradient",
    "striped", "noisy", "background",
    // function words of the caption and prompt templates
    "a", "an", "the", "of", "in", "on", "near", "there", "is", "with", "and", "over", "photo",
    "picture", "drawing", "image", "rendering",
};
enum { NWORDS = (int)(sizeof vocab / sizeof vocab[0]), FIRST_WORD_ID = 4 };

struct vlmoe_synth {
    int image_size;
    uint64_t seed;
    char class_names[NCLASSES][24]; // "purple triangle" is the longest (15 chars)
};

vlmoe_synth_params vlmoe_synth_default_params(void) {
    vlmoe_synth_params p;
    memset(&p, 0, sizeof p);
    p.image_size = 32;
    p.seed = 0;
    return p;
}

int vlmoe_synth_init(vlmoe_synth **out, const vlmoe_synth_params *p) {
    if (!out || !p) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_init: out and params must not be NULL");
    *out = NULL;
    if (p->image_size < 16 || p->image_size > 1024)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_init: image_size = %d, expected 16..1024",
                          p->image_size);
    vlmoe_synth *s = vlmoe_calloc(sizeof *s, "synthetic dataset");
    if (!s) return VLMOE_ERR_NOMEM;
    s->image_size = p->image_size;
    s->seed = p->seed;
    // Colour-major order: class = colour * NSHAPES + shape.
    for (int c = 0; c < NCLASSES; c++)
        snprintf(s->class_names[c], sizeof s->class_names[c], "%s %s", colour_names[c / NSHAPES],
                 shape_names[c % NSHAPES]);
    *out = s;
    return VLMOE_OK;
}

void vlmoe_synth_free(vlmoe_synth *s) { vlmoe_free_mem(s); }

int vlmoe_synth_num_classes(const vlmoe_synth *s) { return s ? NCLASSES : 0; }

const char *vlmoe_synth_class_name(const vlmoe_synth *s, int c) {
    if (!s || c < 0 || c >= NCLASSES) return NULL;
    return s->class_names[c];
}

int vlmoe_synth_num_templates(const vlmoe_synth *s) { return s ? NTEMPLATES : 0; }

const char *vlmoe_synth_template(const vlmoe_synth *s, int t) {
    if (!s || t < 0 || t >= NTEMPLATES) return NULL;
    return templates[t];
}

// ---------------------------------------------------------------------------------------------
// Scene description: everything random is drawn into this struct first, then rendered, so the
// caption and class never depend on whether the caller asked for the image.

typedef struct {
    int shape;
    float cx, cy, r; // centre and half side, in pixels
    float rgb[3];
} synth_object;

typedef struct {
    int bg;          // BG_*
    int orient;      // gradient: 0 vertical, 1 horizontal; stripes: also 2 diagonal
    float period;    // stripes, pixels
    float c0[3], c1[3];
    uint64_t noise_seed;
    synth_object main, dis;
    int has_dis, dis_colour, mention_dis;
    int size_word, pos_bucket, caption_template;
} synth_scene;

// splitmix64 finaliser: a strong 64-bit mix, used to hash (seed, split, index) into a rng seed.
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static float uni(vlmoe_rng *r, float lo, float hi) {
    return lo + (hi - lo) * (float)vlmoe_rng_uniform(r);
}

static float clamp01(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }

// A muted background colour: grey level `g` with a small tint, so it has low saturation and
// never looks like one of the five object colours.
static void muted(vlmoe_rng *r, float g, float out[3]) {
    for (int k = 0; k < 3; k++) out[k] = clamp01(g + uni(r, -0.06f, 0.06f));
}

static void object_colour(vlmoe_rng *r, int colour, float out[3]) {
    float bright = uni(r, 0.85f, 1.08f);
    for (int k = 0; k < 3; k++) out[k] = clamp01((colour_rgb[colour][k] + uni(r, -0.05f, 0.05f)) * bright);
}

static void draw_scene(vlmoe_rng *r, int size, int colour, int shape, synth_scene *sc) {
    float S = (float)size;
    memset(sc, 0, sizeof *sc);
    sc->bg = (int)vlmoe_rng_below(r, NBGS);
    sc->orient = (int)vlmoe_rng_below(r, sc->bg == BG_STRIPED ? 3 : 2);
    sc->period = uni(r, 3.f, 8.f) * S / 32.f;
    float g0 = uni(r, 0.12f, 0.58f);
    // The second tone differs from the first by at least 0.15 so stripes and gradients show.
    float g1 = g0 + (g0 < 0.35f ? 1.f : -1.f) * uni(r, 0.15f, 0.3f);
    muted(r, g0, sc->c0);
    muted(r, g1, sc->c1);
    sc->noise_seed = vlmoe_rng_u64(r);

    // Main object: side 35%..70% of the image, at most 15% of its half side outside the frame.
    float frac = uni(r, 0.35f, 0.70f);
    synth_object *m = &sc->main;
    m->shape = shape;
    m->r = frac * S * 0.5f;
    m->cx = uni(r, 0.85f * m->r, S - 0.85f * m->r);
    m->cy = uni(r, 0.85f * m->r, S - 0.85f * m->r);
    object_colour(r, colour, m->rgb);
    sc->size_word = frac < 0.4667f ? 0 : (frac < 0.5833f ? 1 : 2);
    int col = m->cx < S / 3.f ? 0 : (m->cx < 2.f * S / 3.f ? 1 : 2);
    int row = m->cy < S / 3.f ? 0 : (m->cy < 2.f * S / 3.f ? 1 : 2);
    sc->pos_bucket = row * 3 + col;

    // Distractor in ~30% of images: different colour and different shape, small, placed clear of
    // the main object's bounding box (dropped when no such spot is found in a few tries).
    if (vlmoe_rng_uniform(r) < 0.36) {
        synth_object *d = &sc->dis;
        sc->dis_colour = (colour + 1 + (int)vlmoe_rng_below(r, NCOLOURS - 1)) % NCOLOURS;
        d->shape = (shape + 1 + (int)vlmoe_rng_below(r, NSHAPES - 1)) % NSHAPES;
        d->r = uni(r, 0.18f, 0.26f) * S * 0.5f;
        object_colour(r, sc->dis_colour, d->rgb);
        for (int t = 0; t < 12 && !sc->has_dis; t++) {
            d->cx = uni(r, d->r, S - d->r);
            d->cy = uni(r, d->r, S - d->r);
            // Every shape lies inside its [-1,1]^2 box, so disjoint boxes mean no overlap.
            float gap = m->r + d->r + 1.f;
            if (fabsf(d->cx - m->cx) >= gap || fabsf(d->cy - m->cy) >= gap) sc->has_dis = 1;
        }
        sc->mention_dis = sc->has_dis && vlmoe_rng_uniform(r) < 0.5;
    }
    sc->caption_template = (int)vlmoe_rng_below(r, 8);
}

// Is (u, v), in the object's frame scaled so its bounding box is [-1,1]^2, inside the shape?
static int inside(int shape, float u, float v) {
    switch (shape) {
    case SHAPE_CIRCLE: return u * u + v * v <= 1.f;
    case SHAPE_SQUARE: return fabsf(u) <= 0.82f && fabsf(v) <= 0.82f;
    case SHAPE_TRIANGLE: // apex up, base at v = 0.85 (image y grows downwards)
        return v <= 0.85f && fabsf(u) <= (v + 0.95f) * (1.f / 1.8f);
    default: // SHAPE_CROSS: a plus sign with arms 0.6 thick
        return (fabsf(u) <= 0.3f && fabsf(v) <= 0.95f) || (fabsf(v) <= 0.3f && fabsf(u) <= 0.95f);
    }
}

// Blends one object into the [0,1] image over its bounding box with 2x2 supersampling.
static void draw_object(float *img, int size, const synth_object *o) {
    size_t plane = (size_t)size * (size_t)size;
    int x0 = (int)floorf(o->cx - o->r), x1 = (int)ceilf(o->cx + o->r);
    int y0 = (int)floorf(o->cy - o->r), y1 = (int)ceilf(o->cy + o->r);
    if (x0 < 0) x0 = 0;
    if (y0 < 0) y0 = 0;
    if (x1 > size - 1) x1 = size - 1;
    if (y1 > size - 1) y1 = size - 1;
    float inv = 1.f / o->r;
    for (int y = y0; y <= y1; y++) {
        for (int x = x0; x <= x1; x++) {
            int hits = 0;
            for (int sy = 0; sy < 2; sy++)
                for (int sx = 0; sx < 2; sx++) {
                    float u = ((float)x + 0.25f + 0.5f * (float)sx - o->cx) * inv;
                    float v = ((float)y + 0.25f + 0.5f * (float)sy - o->cy) * inv;
                    hits += inside(o->shape, u, v);
                }
            if (!hits) continue;
            float a = 0.25f * (float)hits;
            size_t i = (size_t)y * (size_t)size + (size_t)x;
            for (int k = 0; k < 3; k++) img[k * plane + i] += a * (o->rgb[k] - img[k * plane + i]);
        }
    }
}

static void render(const synth_scene *sc, int size, float *img) {
    size_t plane = (size_t)size * (size_t)size;
    float S = (float)size;
    vlmoe_rng nr;
    vlmoe_rng_seed(&nr, sc->noise_seed);
    for (int y = 0; y < size; y++) {
        for (int x = 0; x < size; x++) {
            float t = 0.f, n = 0.f;
            switch (sc->bg) {
            case BG_GRADIENT: t = ((float)(sc->orient ? x : y) + 0.5f) / S; break;
            case BG_STRIPED: {
                float q = sc->orient == 0 ? (float)x : (sc->orient == 1 ? (float)y : (float)(x + y) * 0.7071f);
                t = fmodf(q / sc->period, 1.f) < 0.5f ? 0.f : 1.f;
                break;
            }
            case BG_NOISY: n = uni(&nr, -0.09f, 0.09f); break;
            default: break;
            }
            size_t i = (size_t)y * (size_t)size + (size_t)x;
            for (int k = 0; k < 3; k++) img[k * plane + i] = clamp01(sc->c0[k] + t * (sc->c1[k] - sc->c0[k]) + n);
        }
    }
    if (sc->has_dis) draw_object(img, size, &sc->dis);
    draw_object(img, size, &sc->main);
    for (size_t i = 0; i < 3 * plane; i++) img[i] = 2.f * img[i] - 1.f; // LIMoE's [-1, 1]
}

// Writes the caption; the main object always comes first, the distractor (if mentioned) last.
static void caption_text(const synth_scene *sc, int colour, int shape, char *buf, size_t n) {
    const char *c = colour_names[colour], *sh = shape_names[shape], *sz = size_names[sc->size_word];
    const char *pos = pos_names[sc->pos_bucket], *bg = bg_names[sc->bg];
    int k = 0;
    switch (sc->caption_template) {
    case 0: k = snprintf(buf, n, "a %s %s %s in the %s on a %s background", sz, c, sh, pos, bg); break;
    case 1: k = snprintf(buf, n, "%s %s, %s, %s", c, sh, sz, pos); break;
    case 2: k = snprintf(buf, n, "a picture of a %s %s near the %s", c, sh, pos); break;
    case 3: k = snprintf(buf, n, "a %s %s on a %s background", c, sh, bg); break;
    case 4: k = snprintf(buf, n, "there is a %s %s %s in the %s", sz, c, sh, pos); break;
    case 5: k = snprintf(buf, n, "a %s %s %s over a %s background", sz, c, sh, bg); break;
    case 6: k = snprintf(buf, n, "%s %s %s", sz, c, sh); break;
    default: k = snprintf(buf, n, "a photo of a %s %s in the %s", c, sh, pos); break;
    }
    if (sc->mention_dis && k > 0 && (size_t)k < n)
        snprintf(buf + k, n - (size_t)k, " and a small %s %s", colour_names[sc->dis_colour],
                 shape_names[sc->dis.shape]);
}

int vlmoe_synth_sample(const vlmoe_synth *s, int split, uint64_t index, float *image,
                       char *caption, size_t cap, int *class_id) {
    if (!s) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_sample: dataset is NULL");
    if (split != VLMOE_SPLIT_TRAIN && split != VLMOE_SPLIT_HELDOUT)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "vlmoe_synth_sample: split = %d, expected VLMOE_SPLIT_TRAIN (0) or "
                          "VLMOE_SPLIT_HELDOUT (1)", split);
    if (caption && cap == 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_sample: caption buffer given with cap = 0");
    if (!image && !caption && !class_id)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_sample: image, caption and class_id are all NULL");

    // Each split hashes in its own domain constant, so the two never share a random stream.
    static const uint64_t domain[2] = {0x747261696e5f7631ULL, 0x68656c646f757431ULL};
    uint64_t h = mix64(s->seed + 0x9e3779b97f4a7c15ULL);
    h = mix64(h ^ domain[split]);
    h = mix64(h ^ (index * 0xd6e8feb86659fd93ULL + 0x632be59bd9b4e019ULL));
    vlmoe_rng r;
    vlmoe_rng_seed(&r, h);

    // Held-out classes cycle so any prefix of 20*N samples is class-balanced.
    int cls = split == VLMOE_SPLIT_HELDOUT ? (int)(index % NCLASSES) : (int)vlmoe_rng_below(&r, NCLASSES);
    int colour = cls / NSHAPES, shape = cls % NSHAPES;
    synth_scene sc;
    draw_scene(&r, s->image_size, colour, shape, &sc);

    if (image) render(&sc, s->image_size, image);
    if (caption) {
        char buf[160];
        caption_text(&sc, colour, shape, buf, sizeof buf);
        snprintf(caption, cap, "%s", buf);
    }
    if (class_id) *class_id = cls;
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

int vlmoe_synth_vocab_size(const vlmoe_synth *s) { return s ? FIRST_WORD_ID + NWORDS : 0; }

static int32_t word_id(const char *w) {
    for (int i = 0; i < NWORDS; i++)
        if (strcmp(w, vocab[i]) == 0) return FIRST_WORD_ID + i;
    return VLMOE_TOK_UNK;
}

int vlmoe_synth_detokenize(const vlmoe_synth *s, const int32_t *ids, int n, char *out, size_t cap) {
    if (!s || (!ids && n > 0) || !out || !cap)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_detokenize: dataset, ids and a buffer must not be NULL");
    size_t k = 0;
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        const int32_t id = ids[i];
        if (id == VLMOE_TOK_PAD || id == VLMOE_TOK_SOT || id == VLMOE_TOK_EOT) continue;
        const char *w = id >= FIRST_WORD_ID && id < FIRST_WORD_ID + NWORDS ? vocab[id - FIRST_WORD_ID] : "<unk>";
        const int wrote = snprintf(out + k, cap - k, "%s%s", k ? " " : "", w);
        if (wrote < 0 || (size_t)wrote >= cap - k)
            return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_detokenize: the text needs more than %zu bytes", cap);
        k += (size_t)wrote;
    }
    return VLMOE_OK;
}

static int is_alnum(unsigned char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
}

int vlmoe_synth_tokenize(const vlmoe_synth *s, const char *text, int32_t *ids, int ctx) {
    if (!s || !text || !ids)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_tokenize: dataset, text and ids must not be NULL");
    if (ctx < 2)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_tokenize: ctx = %d, expected >= 2 (SOT and EOT)", ctx);
    int n = 0;
    ids[n++] = VLMOE_TOK_SOT;
    const unsigned char *p = (const unsigned char *)text;
    while (*p) {
        if (!is_alnum(*p)) { p++; continue; }
        // Words longer than any vocabulary word cannot match: they become UNK without a copy.
        char w[24];
        size_t len = 0;
        while (is_alnum(*p)) {
            if (len < sizeof w - 1) w[len] = (char)(*p >= 'A' && *p <= 'Z' ? *p - 'A' + 'a' : *p);
            len++;
            p++;
        }
        if (n >= ctx - 1) break; // truncated: keep the last slot for EOT
        w[len < sizeof w ? len : sizeof w - 1] = 0;
        ids[n++] = len < sizeof w ? word_id(w) : VLMOE_TOK_UNK;
    }
    ids[n++] = VLMOE_TOK_EOT;
    for (int i = n; i < ctx; i++) ids[i] = VLMOE_TOK_PAD;
    return n;
}

int vlmoe_synth_image_size(const vlmoe_synth *s) { return s ? s->image_size : 0; }
