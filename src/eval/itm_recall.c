// itm_recall.c: retrieval recall@K re-ranked by image-text matching, VLMo's and ALBEF's inference:
// every query's candidates are ranked by the contrastive similarity of the separately encoded
// embeddings, and the top k of them re-scored by the ITM head on the fused pair
// (vlmoe_mome_itm_scores) and re-ordered by that score. Ties rank the true candidate last, so
// they never inflate recall (as vlmoe_retrieval_recall). Covered by tests/test_itm.c.
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

typedef struct {
    float s;
    int idx, own;
} cand;

// Best first; a tie puts the query's own candidate last, then lower indices first.
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    if (x->own != y->own) return x->own - y->own;
    return x->idx - y->idx;
}

// Pairs per ITM call: bounds the copied images.
enum { CHUNK = 256 };

// One direction: queries q (images when i2t, else texts) against the n candidates of the other
// side; rank[q] = 0-based position of q's own candidate after re-ranking.
static int ranks(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths,
                 const float *img, const float *txt, int n, int E, int k, int i2t, int *rank) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    const float *qe = i2t ? img : txt, *ce = i2t ? txt : img;
    cand *cs = malloc(sizeof(cand) * (size_t)n * k), *row = malloc(sizeof(cand) * (size_t)n);
    float *pi = malloc(sizeof(float) * isz * CHUNK), *sc = malloc(sizeof(float) * CHUNK);
    int32_t *pt = malloc(sizeof(int32_t) * T * CHUNK), *pl = malloc(sizeof(int32_t) * CHUNK);
    int st = cs && row && pi && sc && pt && pl ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "ITM re-ranking of %d pairs", n);
    for (int q = 0; q < n && !st; q++) {
        for (int j = 0; j < n; j++) {
            double d = 0;
            for (int e = 0; e < E; e++) d += (double)qe[(size_t)q * E + e] * ce[(size_t)j * E + e];
            row[j] = (cand){(float)d, j, j == q};
        }
        qsort(row, (size_t)n, sizeof(cand), cand_cmp);
        rank[q] = 0;
        while (row[rank[q]].idx != q) rank[q]++;
        memcpy(cs + (size_t)q * k, row, sizeof(cand) * k);
    }
    // the ITM scores of the n*k (query, candidate) pairs, CHUNK at a time
    const size_t total = (size_t)n * k;
    for (size_t p0 = 0; p0 < total && !st; p0 += CHUNK) {
        const int cnt = (int)(total - p0 < CHUNK ? total - p0 : CHUNK);
        for (int r = 0; r < cnt; r++) {
            const int q = (int)((p0 + r) / k), o = cs[p0 + r].idx, im = i2t ? q : o, tx = i2t ? o : q;
            memcpy(pi + isz * r, images + isz * im, sizeof(float) * isz);
            memcpy(pt + T * r, tokens + T * tx, sizeof(int32_t) * T);
            pl[r] = lengths[tx];
        }
        if ((st = vlmoe_mome_itm_scores(m, pi, pt, pl, cnt, sc))) break;
        for (int r = 0; r < cnt; r++) cs[p0 + r].s = sc[r];
    }
    for (int q = 0; q < n && !st; q++) {
        if (rank[q] >= k) continue; // outside the top k: its contrastive place stands
        cand *top = cs + (size_t)q * k;
        qsort(top, (size_t)k, sizeof(cand), cand_cmp);
        rank[q] = 0;
        while (top[rank[q]].idx != q) rank[q]++;
    }
    free(cs), free(row), free(pi), free(sc), free(pt), free(pl);
    return st;
}

int vlmoe_mome_itm_recall(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths,
                          const float *img, const float *txt, int n, int rerank, const int *ks, int nk, double *i2t,
                          double *t2i) {
    if (!m || !images || !tokens || !lengths || !img || !txt || n < 1 || rerank < 1 || !ks || nk < 1 || !i2t || !t2i)
        return vlmoe_fail(VLMOE_ERR_ARG, "ITM recall: needs n >= 1 pairs (got %d) with their embeddings, a re-ranking "
                          "depth >= 1 (got %d) and the K's", n, rerank);
    for (int q = 0; q < nk; q++)
        if (ks[q] < 1) return vlmoe_fail(VLMOE_ERR_ARG, "ITM recall: K = %d, need >= 1", ks[q]);
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (c->arch != VLMOE_ARCH_MOME || !c->itm_head)
        return vlmoe_fail(VLMOE_ERR_ARG, "ITM recall: model '%s' has no image-text matching head (itm_head = 0)", c->name);
    const int k = rerank < n ? rerank : n;
    int *rk = malloc(sizeof(int) * 2 * (size_t)n);
    if (!rk) return vlmoe_fail(VLMOE_ERR_NOMEM, "ITM recall ranks");
    int st = ranks(m, images, tokens, lengths, img, txt, n, c->embed_dim, k, 1, rk);
    if (!st) st = ranks(m, images, tokens, lengths, img, txt, n, c->embed_dim, k, 0, rk + n);
    for (int q = 0; q < nk && !st; q++) {
        int a = 0, b = 0;
        for (int i = 0; i < n; i++) a += rk[i] < ks[q], b += rk[n + i] < ks[q];
        i2t[q] = (double)a / n, t2i[q] = (double)b / n;
    }
    free(rk);
    return st;
}
