// cider.c: CIDEr-D (Vedantam et al. 2015, "CIDEr: Consensus-based Image Description
// Evaluation", sec. 3 and its CIDEr-D variant) as the COCO caption evaluation computes it: n-grams
// of 1..4 words, tf-idf with the document frequency counted over the reference sets of the
// evaluated images, per n the cosine of candidate and reference with the candidate's weights
// clipped by the reference's, a Gaussian length penalty (sigma 6), averaged over n and over the
// references, times 10. Covered by tests/test_cider.c (worked examples).
#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

enum { NMAX = 4 };

// Interns byte strings (words, and n-grams as their word ids) to dense ids: open addressing.
typedef struct {
    char *bytes;                 // every key, back to back
    size_t nbytes, cap_bytes;
    size_t *off;                 // (n+1) key i is bytes[off[i], off[i+1])
    int n, cap_ids;
    int *slot;                   // (nslot) id + 1, 0 empty
    size_t nslot;
} intern;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL; // FNV-1a
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h;
}

static void intern_free(intern *t) { free(t->bytes), free(t->off), free(t->slot); }

static int rehash(intern *t, size_t nslot) {
    int *s = calloc(nslot, sizeof(int));
    if (!s) return -1;
    for (int i = 0; i < t->n; i++) {
        size_t h = hash_bytes(t->bytes + t->off[i], t->off[i + 1] - t->off[i]) & (nslot - 1);
        while (s[h]) h = (h + 1) & (nslot - 1);
        s[h] = i + 1;
    }
    free(t->slot);
    t->slot = s, t->nslot = nslot;
    return 0;
}

// The id of key (added if new); -1 when out of memory.
static int intern_id(intern *t, const char *key, size_t len) {
    if ((size_t)t->n * 2 + 2 > t->nslot && rehash(t, t->nslot ? 2 * t->nslot : 1024)) return -1;
    size_t h = hash_bytes(key, len) & (t->nslot - 1);
    for (; t->slot[h]; h = (h + 1) & (t->nslot - 1)) {
        const int i = t->slot[h] - 1;
        if (t->off[i + 1] - t->off[i] == len && !memcmp(t->bytes + t->off[i], key, len)) return i;
    }
    if (t->n + 2 > t->cap_ids) {
        const int c = t->cap_ids ? 2 * t->cap_ids : 1024;
        size_t *o = realloc(t->off, sizeof(size_t) * (size_t)c);
        if (!o) return -1;
        t->off = o, t->cap_ids = c;
        if (!t->n) t->off[0] = 0;
    }
    if (t->nbytes + len > t->cap_bytes) {
        const size_t c = (t->cap_bytes ? 2 * t->cap_bytes : 4096) + len;
        char *b = realloc(t->bytes, c);
        if (!b) return -1;
        t->bytes = b, t->cap_bytes = c;
    }
    memcpy(t->bytes + t->nbytes, key, len);
    t->nbytes += len;
    t->off[++t->n] = t->nbytes;
    t->slot[h] = t->n;
    return t->n - 1;
}

// One caption: its distinct n-grams (ids ascending) with their counts, and its length as
// coco-caption measures it (the count of its bigrams, i.e. words - 1, 0 for one word or none).
typedef struct {
    int *gram, *tf;
    int ngram, len;
} caption;

static int cmp_int(const void *a, const void *b) {
    const int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

// coco-caption tokenises with the PTB tokenizer (Java) and drops punctuation; here: lowercase
// ASCII, every ASCII punctuation mark but the apostrophe and the hyphen a separator, and tokens
// made only of those two dropped. Fills words (at most cap) with word ids; returns the count.
static int words_of(const char *text, intern *W, int *words, int cap, int *oom) {
    int n = 0;
    char buf[256];
    for (const char *p = text; *p;) {
        while (*p && (isspace((unsigned char)*p) || (ispunct((unsigned char)*p) && *p != '\'' && *p != '-'))) p++;
        size_t k = 0;
        int letters = 0;
        for (; *p && !isspace((unsigned char)*p) && !(ispunct((unsigned char)*p) && *p != '\'' && *p != '-'); p++)
            if (k < sizeof(buf)) buf[k++] = (char)tolower((unsigned char)*p), letters += *p != '\'' && *p != '-';
        if (!k || !letters) continue;
        const int id = intern_id(W, buf, k);
        if (id < 0) return *oom = 1, 0;
        if (n < cap) words[n++] = id;
    }
    return n;
}

static int caption_build(caption *c, const char *text, intern *W, intern *G, int *scratch, int cap) {
    int oom = 0;
    const int nw = words_of(text ? text : "", W, scratch, cap, &oom);
    if (oom) return -1;
    int ng = 0;
    int *ids = scratch + cap; // room for NMAX * cap n-gram ids
    for (int n = 1; n <= NMAX; n++)
        for (int i = 0; i + n <= nw; i++) {
            int key[NMAX + 1] = {n};
            memcpy(key + 1, scratch + i, sizeof(int) * (size_t)n);
            const int id = intern_id(G, (const char *)key, sizeof(int) * (size_t)(n + 1));
            if (id < 0) return -1;
            ids[ng++] = id;
        }
    qsort(ids, (size_t)ng, sizeof(int), cmp_int);
    c->gram = malloc(sizeof(int) * (size_t)(ng ? ng : 1));
    c->tf = malloc(sizeof(int) * (size_t)(ng ? ng : 1));
    if (!c->gram || !c->tf) return -1;
    c->ngram = 0;
    for (int i = 0; i < ng; i++) {
        if (c->ngram && c->gram[c->ngram - 1] == ids[i]) {
            c->tf[c->ngram - 1]++;
            continue;
        }
        c->gram[c->ngram] = ids[i], c->tf[c->ngram++] = 1;
    }
    c->len = nw > 1 ? nw - 1 : 0;
    return 0;
}

// The order (1..4) of n-gram id g.
static int order_of(const intern *G, int g) { return (int)((G->off[g + 1] - G->off[g]) / sizeof(int)) - 1; }

// tf-idf weight of entry i of c: tf * (log(images) - log(max(1, df))).
static double weight(const caption *c, int i, const int *df, double logn) {
    return c->tf[i] * (logn - log(df[c->gram[i]] > 1 ? df[c->gram[i]] : 1));
}

// CIDEr-D of candidate h against reference r: mean over n of the clipped cosine, times the
// length penalty. norm: (NMAX) per caption, precomputed.
static double sim(const caption *h, const double *nh, const caption *r, const double *nr, const intern *G,
                  const int *df, double logn) {
    double val[NMAX] = {0};
    for (int i = 0, j = 0; i < h->ngram && j < r->ngram;) {
        if (h->gram[i] < r->gram[j]) { i++; continue; }
        if (h->gram[i] > r->gram[j]) { j++; continue; }
        const double vh = weight(h, i, df, logn), vr = weight(r, j, df, logn);
        val[order_of(G, h->gram[i]) - 1] += (vh < vr ? vh : vr) * vr;
        i++, j++;
    }
    const double delta = h->len - r->len, pen = exp(-delta * delta / (2.0 * 6.0 * 6.0));
    double s = 0;
    for (int n = 0; n < NMAX; n++) s += (nh[n] != 0 && nr[n] != 0 ? val[n] / (nh[n] * nr[n]) : 0) * pen;
    return s / NMAX;
}

int vlmoe_cider_d(const char *const *cands, int n, const char *const *refs, const int *ref_off, double *score,
                  double *per_image) {
    if (score) *score = 0;
    if (n < 1 || !cands || !refs || !ref_off || !score)
        return vlmoe_fail(VLMOE_ERR_ARG, "CIDEr-D: needs >= 1 candidate caption, their references and a result, got %d", n);
    if (ref_off[0] != 0) return vlmoe_fail(VLMOE_ERR_ARG, "CIDEr-D: the reference offsets must start at 0");
    for (int i = 0; i < n; i++)
        if (ref_off[i + 1] <= ref_off[i])
            return vlmoe_fail(VLMOE_ERR_ARG, "CIDEr-D: image %d has no reference caption", i);
    const size_t nref = (size_t)ref_off[n], total = (size_t)n + nref;
    size_t longest = 0;
    for (size_t i = 0; i < total; i++) {
        const char *t = i < (size_t)n ? cands[i] : refs[i - (size_t)n];
        const size_t l = t ? strlen(t) : 0;
        longest = l > longest ? l : longest;
    }
    const int cap = (int)(longest / 2 + 2); // words in a caption of `longest` bytes, at most
    intern W = {0}, G = {0};
    caption *c = calloc(total, sizeof(caption));
    double *norm = calloc(total * NMAX, sizeof(double));
    int *scratch = malloc(sizeof(int) * (size_t)cap * (NMAX + 1)), *df = NULL, *seen = NULL;
    int st = c && norm && scratch ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "CIDEr-D of %d captions", n);
    for (size_t i = 0; !st && i < total; i++)
        if (caption_build(&c[i], i < (size_t)n ? cands[i] : refs[i - (size_t)n], &W, &G, scratch, cap))
            st = vlmoe_fail(VLMOE_ERR_NOMEM, "CIDEr-D n-grams");
    if (!st && (!(df = calloc((size_t)G.n + 1, sizeof(int))) || !(seen = malloc(sizeof(int) * ((size_t)G.n + 1)))))
        st = vlmoe_fail(VLMOE_ERR_NOMEM, "CIDEr-D document frequencies");
    if (!st) {
        // document frequency: the images whose reference set holds the n-gram
        for (int g = 0; g < G.n; g++) seen[g] = -1;
        for (int i = 0; i < n; i++)
            for (int r = ref_off[i]; r < ref_off[i + 1]; r++) {
                const caption *rc = &c[n + r];
                for (int k = 0; k < rc->ngram; k++)
                    if (seen[rc->gram[k]] != i) seen[rc->gram[k]] = i, df[rc->gram[k]]++;
            }
        const double logn = log((double)n);
        for (size_t i = 0; i < total; i++) {
            for (int k = 0; k < c[i].ngram; k++) {
                const double w = weight(&c[i], k, df, logn);
                norm[i * NMAX + order_of(&G, c[i].gram[k]) - 1] += w * w;
            }
            for (int k = 0; k < NMAX; k++) norm[i * NMAX + k] = sqrt(norm[i * NMAX + k]);
        }
        double sum = 0;
        for (int i = 0; i < n; i++) {
            double s = 0;
            for (int r = ref_off[i]; r < ref_off[i + 1]; r++)
                s += sim(&c[i], norm + (size_t)i * NMAX, &c[n + r], norm + (size_t)(n + r) * NMAX, &G, df, logn);
            s = 10.0 * s / (ref_off[i + 1] - ref_off[i]);
            if (per_image) per_image[i] = s;
            sum += s;
        }
        *score = sum / n;
    }
    for (size_t i = 0; c && i < total; i++) free(c[i].gram), free(c[i].tf);
    free(c), free(norm), free(scratch), free(df), free(seen);
    intern_free(&W), intern_free(&G);
    return st;
}
