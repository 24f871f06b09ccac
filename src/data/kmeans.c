// kmeans.c: the k-means codebook that stands in for BEiT's image tokenizer in MIM (VL-MoE sec.
// 3.1 predicts discrete visual tokens of masked patches; no pretrained tokenizer can be fetched,
// so the visual token of a patch is its nearest centroid over raw patch vectors). k-means++
// seeding (greedy), Lloyd's iterations with distances from one matrix product per block of points, an
// empty cluster re-seeded from the point farthest from its centroid; save/load as safetensors.
// Covered by tests/test_mome.c (hand-made clusters, file round trip, bad files).
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"

enum { BLOCK = 512 };

// ids and squared distances of n points to their nearest centroid. d2 = |x|^2 - 2 x.c + |c|^2
// (the dot products from one sgemm per block of points); ties go to the lower id.
static void assign(const float *c, const double *cc, int K, int dim, const float *x, size_t n,
                   int32_t *ids, double *dist, float *scores) {
    for (size_t i0 = 0; i0 < n; i0 += BLOCK) {
        const int m = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, K, dim, 1.0f, x + i0 * dim, dim, c, dim,
                    0.0f, scores, K);
#pragma omp parallel for schedule(static)
        for (int i = 0; i < m; i++) {
            const float *s = scores + (size_t)i * K;
            double xx = 0, best = INFINITY;
            int arg = 0;
            for (int d = 0; d < dim; d++) xx += (double)x[(i0 + i) * dim + d] * x[(i0 + i) * dim + d];
            for (int k = 0; k < K; k++) {
                const double d2 = cc[k] - 2.0 * s[k];
                if (d2 < best) best = d2, arg = k;
            }
            ids[i0 + i] = arg;
            if (dist) dist[i0 + i] = fmax(0.0, best + xx);
        }
    }
}

static void norms(const float *c, int K, int dim, double *cc) {
    for (int k = 0; k < K; k++) {
        double s = 0;
        for (int d = 0; d < dim; d++) s += (double)c[(size_t)k * dim + d] * c[(size_t)k * dim + d];
        cc[k] = s;
    }
}

static double sqdist(const float *a, const float *b, int dim) {
    double s = 0;
    for (int d = 0; d < dim; d++) s += ((double)a[d] - b[d]) * ((double)a[d] - b[d]);
    return s;
}

// Greedy k-means++ (Arthur & Vassilvitskii; scikit-learn's default): each next centre is the best
// of 2 + ln K candidates drawn with probability proportional to the squared distance to the
// nearest centre so far, "best" meaning the smallest total of those distances afterwards. Plain
// k-means++ leaves two centres in one of several well-separated clusters about one time in ten
// (16 clusters), a local minimum Lloyd's iterations cannot leave. dist (n) ends as each point's
// squared distance to its nearest centre; cand (n) is scratch.
static void seed_plus_plus(const float *x, size_t n, int dim, int K, vlmoe_rng *r, float *c, double *dist,
                           double *cand) {
    const int trials = 2 + (int)log((double)K);
    const size_t first = (size_t)(vlmoe_rng_uniform(r) * (double)n);
    memcpy(c, x + first * dim, sizeof(float) * dim);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) dist[i] = sqdist(x + i * dim, c, dim);
    for (int k = 1; k < K; k++) {
        double total = 0, best_total = INFINITY;
        for (size_t i = 0; i < n; i++) total += dist[i];
        size_t best = 0;
        for (int t = 0; t < trials; t++) {
            size_t pick = (size_t)(vlmoe_rng_uniform(r) * (double)n); // all points on centres: any
            if (total > 0) {
                const double u = vlmoe_rng_uniform(r) * total;
                double acc = 0;
                for (pick = 0; pick < n - 1; pick++)
                    if ((acc += dist[pick]) > u) break;
            }
            double after = 0;
#pragma omp parallel for schedule(static) reduction(+ : after)
            for (size_t i = 0; i < n; i++) after += fmin(dist[i], sqdist(x + i * dim, x + pick * dim, dim));
            if (after < best_total) best_total = after, best = pick;
        }
        float *ck = c + (size_t)k * dim;
        memcpy(ck, x + best * dim, sizeof(float) * dim);
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) cand[i] = fmin(dist[i], sqdist(x + i * dim, ck, dim));
        memcpy(dist, cand, sizeof(double) * n);
    }
}

void vlmoe_kmeans_assign(const float *centroids, int K, int dim, const float *x, size_t n, int32_t *ids) {
    double *cc = malloc(sizeof(double) * (size_t)K);
    float *scores = malloc(sizeof(float) * (size_t)BLOCK * K);
    if (cc && scores) {
        norms(centroids, K, dim, cc);
        assign(centroids, cc, K, dim, x, n, ids, NULL, scores);
    } else { // no memory for the matrix products: the same rule, one distance at a time
        for (size_t i = 0; i < n; i++) {
            double best = INFINITY;
            for (int k = 0; k < K; k++) {
                double d2 = sqdist(x + i * dim, centroids + (size_t)k * dim, dim);
                if (d2 < best) best = d2, ids[i] = k;
            }
        }
    }
    free(cc), free(scores);
}

int vlmoe_kmeans(const float *x, size_t n, int dim, int K, int iters, uint64_t seed, float *centroids,
                 double *inertia) {
    if (K < 1 || dim < 1 || n < (size_t)K || iters < 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "k-means: %zu points cannot make %d clusters (dim %d, iters %d)", n, K,
                          dim, iters);
    int32_t *ids = vlmoe_alloc(sizeof(int32_t) * n, "k-means ids");
    double *dist = vlmoe_alloc(sizeof(double) * n, "k-means distances");
    double *cc = vlmoe_alloc(sizeof(double) * (size_t)K, "k-means norms");
    double *sum = vlmoe_alloc(sizeof(double) * (size_t)K * dim, "k-means sums");
    size_t *cnt = vlmoe_alloc(sizeof(size_t) * (size_t)K, "k-means counts");
    float *scores = vlmoe_alloc(sizeof(float) * (size_t)BLOCK * K, "k-means scores");
    double *cand = vlmoe_alloc(sizeof(double) * n, "k-means candidates");
    int st = ids && dist && cc && sum && cnt && scores && cand ? VLMOE_OK : VLMOE_ERR_NOMEM;
    vlmoe_rng r;
    vlmoe_rng_seed(&r, seed);
    if (!st) {
        seed_plus_plus(x, n, dim, K, &r, centroids, dist, cand);
        for (size_t i = 0; i < n; i++) ids[i] = -1;
    }
    for (int it = 0; !st && it <= iters; it++) {
        norms(centroids, K, dim, cc);
        size_t changed = 0;
        for (size_t i0 = 0; i0 < n; i0 += BLOCK) {
            const size_t m = n - i0 < BLOCK ? n - i0 : BLOCK;
            int32_t before[BLOCK];
            memcpy(before, ids + i0, sizeof(int32_t) * m);
            assign(centroids, cc, K, dim, x + i0 * dim, m, ids + i0, dist + i0, scores);
            for (size_t i = 0; i < m; i++) changed += before[i] != ids[i0 + i];
        }
        if (it == iters || (it > 0 && !changed)) break;
        // new centres: cluster means (in double); an empty cluster takes the farthest point
        memset(sum, 0, sizeof(double) * (size_t)K * dim);
        memset(cnt, 0, sizeof(size_t) * (size_t)K);
        for (size_t i = 0; i < n; i++) {
            cnt[ids[i]]++;
            for (int d = 0; d < dim; d++) sum[(size_t)ids[i] * dim + d] += x[i * dim + d];
        }
        for (int k = 0; k < K; k++) {
            if (cnt[k]) {
                for (int d = 0; d < dim; d++) centroids[(size_t)k * dim + d] = (float)(sum[(size_t)k * dim + d] / cnt[k]);
                continue;
            }
            size_t far = 0;
            for (size_t i = 1; i < n; i++)
                if (dist[i] > dist[far]) far = i;
            memcpy(centroids + (size_t)k * dim, x + far * dim, sizeof(float) * dim);
            dist[far] = 0; // taken: the next empty cluster picks another point
        }
    }
    if (!st && inertia) {
        double s = 0;
        for (size_t i = 0; i < n; i++) s += dist[i];
        *inertia = s / (double)n;
    }
    vlmoe_free_mem(ids), vlmoe_free_mem(dist), vlmoe_free_mem(cc), vlmoe_free_mem(sum), vlmoe_free_mem(cnt);
    vlmoe_free_mem(scores), vlmoe_free_mem(cand);
    return st;
}

#define CODEBOOK_KEY "vlmoe.codebook"

int codebook_add(vlmoe_st_writer *w, const float *centroids, int K, int dim) {
    const int64_t shape[2] = {K, dim};
    int st = vlmoe_st_writer_add_f32(w, "codebook", VLMOE_DT_F32, 2, shape, centroids);
    return st ? st : vlmoe_st_writer_meta(w, CODEBOOK_KEY, "kmeans over raw patch vectors");
}

int vlmoe_codebook_save(const char *path, const float *centroids, int K, int dim) {
    if (K < 1 || dim < 1) return vlmoe_fail(VLMOE_ERR_ARG, "%s: codebook of %d x %d", path, K, dim);
    vlmoe_st_writer *w;
    int st = vlmoe_st_writer_init(&w);
    if (st) return st;
    st = codebook_add(w, centroids, K, dim);
    if (!st) st = vlmoe_st_writer_write(w, path);
    vlmoe_st_writer_free(w);
    return st;
}

int codebook_present(const vlmoe_st *f) { return vlmoe_st_metadata(f, CODEBOOK_KEY) && vlmoe_st_find(f, "codebook") >= 0; }

int vlmoe_codebook_load(const char *path, int want_K, int want_dim, float **centroids, int *K, int *dim) {
    *centroids = NULL;
    vlmoe_st *f;
    int st = vlmoe_st_open(path, &f);
    if (st) return st;
    vlmoe_tensor_info ti;
    const int idx = vlmoe_st_find(f, "codebook");
    if (!vlmoe_st_metadata(f, CODEBOOK_KEY) || idx < 0)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not a vlmoe codebook (no \"codebook\" tensor with \"%s\" metadata; "
                        "make one with `vlmoe vq train`)", path, CODEBOOK_KEY);
    else if ((st = vlmoe_st_info(f, idx, &ti)) == VLMOE_OK && (ti.ndim != 2 || ti.shape[0] < 1 || ti.shape[1] < 1 ||
                                                                ti.shape[0] > (1 << 24) || ti.shape[1] > (1 << 24)))
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor \"codebook\" must be (K, dim) with K, dim >= 1", path);
    else if (!st && ((want_K > 0 && ti.shape[0] != want_K) || (want_dim > 0 && ti.shape[1] != want_dim)))
        st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: the codebook is %lld x %lld, the model needs %d visual tokens "
                        "(mim_vocab) of %d values (channels x patch_size^2)", path, (long long)ti.shape[0],
                        (long long)ti.shape[1], want_K, want_dim);
    float *c = st ? NULL : vlmoe_alloc(sizeof(float) * ti.numel, "codebook");
    if (!st && !c) st = VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_st_read_f32(f, "codebook", c, ti.numel);
    for (size_t i = 0; !st && i < ti.numel; i++)
        if (!isfinite(c[i])) st = vlmoe_fail(VLMOE_ERR_NUMERIC, "%s: codebook value %zu is %g", path, i, (double)c[i]);
    vlmoe_st_close(f);
    if (st) return vlmoe_free_mem(c), st;
    *centroids = c;
    *K = (int)ti.shape[0];
    *dim = (int)ti.shape[1];
    return VLMOE_OK;
}
