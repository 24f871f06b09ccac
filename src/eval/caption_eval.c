// caption_eval.c: captioning evaluation on image-caption pairs, as the COCO caption benchmark
// scores a captioner: rows with the same image bytes are one image whose captions are all its
// references (COCO: 5), each distinct image is captioned greedily by the VL-MoE model
// (vlmoe_mome_caption, BEiT-3's decoding) and the captions are scored by CIDEr-D (cider.c).
// `vlmoe eval --caption-data` and `vlmoe caption --data` run it. Covered by tests/test_caption.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "eval/run_eval.h"

// image identity: (FNV-1a of the bytes, length) -> image index, open addressing
typedef struct {
    uint64_t *h;
    size_t *len;
    int *img;          // -1: empty
    size_t cap;
} image_map;

static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static int map_grow(image_map *m) {
    const size_t cap = m->cap ? 2 * m->cap : 1024;
    image_map g = {malloc(sizeof(uint64_t) * cap), malloc(sizeof(size_t) * cap), malloc(sizeof(int) * cap), cap};
    if (!g.h || !g.len || !g.img) return free(g.h), free(g.len), free(g.img), -1;
    for (size_t i = 0; i < cap; i++) g.img[i] = -1;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->img[i] < 0) continue;
        size_t j = m->h[i] & (cap - 1);
        while (g.img[j] >= 0) j = (j + 1) & (cap - 1);
        g.h[j] = m->h[i], g.len[j] = m->len[i], g.img[j] = m->img[i];
    }
    free(m->h), free(m->len), free(m->img);
    *m = g;
    return 0;
}

// The slot of (h, len): its image, or an empty slot (img -1) to fill.
static size_t map_slot(const image_map *m, uint64_t h, size_t len) {
    size_t j = h & (m->cap - 1);
    while (m->img[j] >= 0 && (m->h[j] != h || m->len[j] != len)) j = (j + 1) & (m->cap - 1);
    return j;
}

static int grow_to(void **p, size_t *cap, size_t need, size_t each) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * each);
    if (!q) return -1;
    *p = q, *cap = c;
    return 0;
}

void vlmoe_eval_captions_free(vlmoe_eval_captions *r) {
    for (int i = 0; i < r->images; i++) {
        if (r->keys) free(r->keys[i]);
        if (r->captions) free(r->captions[i]);
    }
    free(r->keys), free(r->captions);
    memset(r, 0, sizeof(*r));
}

int vlmoe_eval_captions_run(vlmoe_model *m, vlmoe_dataset *ds, const char *name, const vlmoe_eval_params *p,
                            const vlmoe_caption_params *cp, vlmoe_detokenize_cb detok, void *user,
                            vlmoe_eval_captions *r) {
    memset(r, 0, sizeof(*r));
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (c->arch != VLMOE_ARCH_MOME)
        return vlmoe_fail(VLMOE_ERR_ARG, "captioning: model '%s' is not a VL-MoE (arch mome) model", c->name);
    if (!p->ip || !detok) return vlmoe_fail(VLMOE_ERR_ARG, "captioning: needs image parameters and a detokenizer");
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    image_map map = {0};
    float *images = NULL;
    char **refs = NULL;
    int *ref_img = NULL, *off = NULL, *order = NULL;
    int32_t *tok = NULL, *len = NULL;
    size_t cap_img = 0, cap_ref = 0, cap_ri = 0, cap_key = 0;
    int nref = 0, st = map_grow(&map) ? vlmoe_fail(VLMOE_ERR_NOMEM, "captioning") : VLMOE_OK;
    vlmoe_image img = {.max_pixels = (size_t)p->ip->max_pixels};
    if (p->progress) p->progress(p->progress_user, "caption pairs", 0, -1);
    while (!st && !(p->max_pairs > 0 && nref >= p->max_pairs)) {
        vlmoe_sample s;
        const int got = vlmoe_dataset_next(ds, &s);
        if (got < 0) st = -got;
        if (got <= 0) break;
        const uint64_t h = fnv(s.image, s.image_len);
        size_t slot = map_slot(&map, h, s.image_len);
        int at = map.img[slot];
        if (at < 0) { // a new image: decode it now
            if (grow_to((void **)&images, &cap_img, (size_t)r->images + 1, sizeof(float) * isz) ||
                grow_to((void **)&r->keys, &cap_key, (size_t)r->images + 1, sizeof(char *))) {
                st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning: images");
                break;
            }
            if (vlmoe_image_decode(s.image, s.image_len, s.key, &img) ||
                vlmoe_image_preprocess_eval(&img, p->ip, images + isz * (size_t)r->images)) {
                vlmoe_skip_log_add(&r->bad, vlmoe_last_error());
                continue;
            }
            if (!(r->keys[r->images] = strdup(s.image_path ? s.image_path : s.key))) {
                st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning: images");
                break;
            }
            at = r->images++;
            map.h[slot] = h, map.len[slot] = s.image_len, map.img[slot] = at;
            if ((size_t)r->images * 2 > map.cap && map_grow(&map)) st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning");
        }
        if (!st && (grow_to((void **)&refs, &cap_ref, (size_t)nref + 1, sizeof(char *)) ||
                    grow_to((void **)&ref_img, &cap_ri, (size_t)nref + 1, sizeof(int)) ||
                    !(refs[nref] = strdup(s.caption))))
            st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning: references");
        if (!st) ref_img[nref++] = at;
        if (!st && p->progress && nref % 256 == 0) p->progress(p->progress_user, "caption pairs", nref, -1);
    }
    if (!st && r->images < 2)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%d distinct readable images: CIDEr-D needs at least 2 (its idf over one "
                        "image's references is 0)", r->images);
    // the references grouped by image (counting sort, file order kept within an image)
    const int n = r->images;
    if (!st && (!(off = calloc((size_t)n + 1, sizeof(int))) || !(order = malloc(sizeof(int) * (size_t)nref))))
        st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning");
    if (!st) {
        for (int j = 0; j < nref; j++) off[ref_img[j] + 1]++;
        for (int i = 0; i < n; i++) off[i + 1] += off[i];
        int *fill = malloc(sizeof(int) * (size_t)n);
        if (!fill) st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning");
        for (int i = 0; !st && i < n; i++) fill[i] = off[i];
        for (int j = 0; !st && j < nref; j++) order[fill[ref_img[j]]++] = j;
        free(fill);
    }
    const char **grouped = st ? NULL : malloc(sizeof(char *) * (size_t)(nref ? nref : 1));
    if (!st && !grouped) st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning");
    for (int j = 0; !st && j < nref; j++) grouped[j] = refs[order[j]];
    if (!st && (!(tok = malloc(sizeof(int32_t) * T * (size_t)n)) || !(len = malloc(sizeof(int32_t) * (size_t)n)) ||
                !(r->captions = calloc((size_t)n, sizeof(char *)))))
        st = vlmoe_fail(VLMOE_ERR_NOMEM, "captioning");
    if (!st && p->progress) p->progress(p->progress_user, "images captioned", 0, n);
    if (!st) st = vlmoe_mome_caption(m, images, n, cp, tok, len);
    const size_t ccap = 64 * T + 64; // a BPE piece decodes to tens of bytes
    for (int i = 0; !st && i < n; i++)
        if (!(r->captions[i] = malloc(ccap))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "captions");
        else st = detok(user, tok + T * (size_t)i, len[i], r->captions[i], ccap);
    if (!st) st = vlmoe_cider_d((const char *const *)r->captions, n, grouped, off, &r->cider, NULL);
    r->references = nref;
    if (st) vlmoe_error_prefix("%s", name);
    for (int j = 0; refs && j < nref; j++) free(refs[j]);
    free(refs), free(ref_img), free(off), free(order), free(grouped), free(tok), free(len), free(images);
    free(map.h), free(map.len), free(map.img);
    vlmoe_image_free(&img);
    return st;
}
