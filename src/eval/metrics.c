// metrics.c: retrieval recall@K over images with several captions (CLIP / OpenCLIP's COCO and
// Flickr protocol) and the few-shot linear probe of LIMoE (closed-form ridge regression on frozen
// features, after big_vision's fewshot evaluator) with its K-shot sampler. Covered by tests/test_eval.c.
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

// ---------------------------------------------------------------------------------------------
// Shared argument checks

static int check_finite(const float *x, int n, int dim, const char *fn, const char *what) {
    for (size_t i = 0; i < (size_t)n * (size_t)dim; i++)
        if (!isfinite(x[i]))
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: %s[%zu][%zu] is %g, expected a finite value", fn,
                              what, i / (size_t)dim, i % (size_t)dim, (double)x[i]);
    return VLMOE_OK;
}

static int check_labels(const int32_t *y, int n, int classes, const char *fn, const char *what) {
    for (int i = 0; i < n; i++)
        if (y[i] < 0 || y[i] >= classes)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: %s[%d] = %d, expected a class in [0, %d)", fn,
                              what, i, (int)y[i], classes);
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// Retrieval recall@K

// Score blocks hold at most this many query rows and floats (1024 x 25k COCO captions = 100 MB).
enum { RECALL_BLOCK_ROWS = 1024, RECALL_BLOCK_FLOATS = 1 << 25 };

// Which candidates are positives for a query. Images own captions (owner[j], text j's image);
// captions with the same group are one text, so a caption's text is a positive for every image
// owning a caption of its group. grp_img (CSR over groups: grp_off (G+1), grp_list) lists each
// group's images, without repeats; group[j] is text j's group.
typedef struct {
    const int32_t *group, *grp_off, *grp_list;
} dup_index;

static int group_has_image(const dup_index *d, int32_t g, int32_t img) {
    for (int32_t k = d->grp_off[g]; k < d->grp_off[g + 1]; k++)
        if (d->grp_list[k] == img) return 1;
    return 0;
}

// rank[i] for every query row i of q (nq, E) against the candidates c (nc, E): the number of
// negative candidates scoring >= the best positive, i.e. the 0-based position of the first
// positive when ties put negatives first. Positives: i2t (query = image i) every text j whose
// group has image i; t2i (query = text i) every image of text i's group. A NaN score (only from
// float overflow, the inputs are finite) also counts as ahead, so it can only lower recall.
//
// Each direction runs its own GEMM so that the true score and every score it is compared with
// come out of the same row of one product: a tie between equal embeddings stays an exact tie.
static int recall_ranks(const float *q, int nq, const float *c, int nc, int E,
                        const dup_index *d, int i2t, int32_t *rank) {
    int rows = RECALL_BLOCK_ROWS;
    if ((size_t)rows * (size_t)nc > RECALL_BLOCK_FLOATS) rows = RECALL_BLOCK_FLOATS / nc;
    if (rows < 1) rows = 1;
    if (rows > nq) rows = nq;
    float *S = vlmoe_alloc(sizeof(float) * (size_t)rows * (size_t)nc, "retrieval score block");
    if (!S) return VLMOE_ERR_NOMEM;
    for (int r0 = 0; r0 < nq; r0 += rows) {
        const int m = nq - r0 < rows ? nq - r0 : rows;
        // S (m, nc) = q[r0:r0+m] (m, E) . c^T (E, nc)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nc, E, 1.0f, q + (size_t)r0 * E,
                    E, c, E, 0.0f, S, nc);
        #pragma omp parallel for schedule(static)
        for (int r = 0; r < m; r++) {
            const int qi = r0 + r;
            const float *s = S + (size_t)r * nc;
            float best = -INFINITY;
            for (int j = 0; j < nc; j++) {
                const int pos = i2t ? group_has_image(d, d->group[j], qi) : group_has_image(d, d->group[qi], j);
                if (pos && s[j] > best) best = s[j];
            }
            int32_t ahead = 0;
            for (int j = 0; j < nc; j++) {
                const int pos = i2t ? group_has_image(d, d->group[j], qi) : group_has_image(d, d->group[qi], j);
                if (!pos && !(s[j] < best)) ahead++;
            }
            rank[qi] = ahead;
        }
    }
    vlmoe_free_mem(S);
    return VLMOE_OK;
}

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

// OpenCLIP's get_clip_metrics: mean_rank = mean(0-based rank) + 1, median_rank =
// floor(median(0-based rank)) + 1 (numpy's median: the mean of the middle two for even n).
static void rank_stats(const int32_t *rank, int n, int32_t *tmp, double *mean, double *median) {
    double sum = 0;
    for (int i = 0; i < n; i++) sum += rank[i], tmp[i] = rank[i];
    qsort(tmp, (size_t)n, sizeof(int32_t), cmp_i32);
    const double mid = n % 2 ? tmp[n / 2] : 0.5 * ((double)tmp[n / 2 - 1] + tmp[n / 2]);
    *mean = sum / n + 1;
    *median = floor(mid) + 1;
}

int vlmoe_retrieval_metrics(const vlmoe_retrieval_data *d, double *i2t, double *t2i, double mean_rank[2],
                            double median_rank[2]) {
    static const char fn[] = "vlmoe_retrieval_metrics";
    if (!d || !d->img || !d->txt || !d->txt_image || !d->ks || !i2t || !t2i)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: NULL pointer argument", fn);
    const int n_img = d->n_img, n_txt = d->n_txt, E = d->E, nk = d->nk;
    if (n_img < 1 || n_txt < 1 || E < 1 || nk < 1)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "%s: n_img = %d, n_txt = %d, E = %d, nk = %d, expected all >= 1", fn,
                          n_img, n_txt, E, nk);
    for (int q = 0; q < nk; q++)
        if (d->ks[q] < 1) return vlmoe_fail(VLMOE_ERR_ARG, "%s: ks[%d] = %d, expected >= 1", fn, q, d->ks[q]);
    int st = check_labels(d->txt_image, n_txt, n_img, fn, "txt_image");
    if (!st && d->txt_group) st = check_labels(d->txt_group, n_txt, n_txt, fn, "txt_group");
    if (!st) st = check_finite(d->img, n_img, E, fn, "img");
    if (!st) st = check_finite(d->txt, n_txt, E, fn, "txt");
    if (st) return st;

    // rank_i (n_img), rank_t (n_txt), group (n_txt), off (n_txt + 1), list (n_txt), tmp
    const size_t nw = 2 * (size_t)n_img + 4 * (size_t)n_txt + 1 + (size_t)(n_img > n_txt ? n_img : n_txt);
    int32_t *w = vlmoe_alloc(sizeof(int32_t) * nw, "retrieval ranks");
    if (!w) return VLMOE_ERR_NOMEM;
    int32_t *rank_i = w, *rank_t = rank_i + n_img, *group = rank_t + n_txt, *off = group + n_txt;
    int32_t *list = off + n_txt + 1, *tmp = list + n_txt, *seen = tmp; // seen: n_img, before tmp is used
    // An image without a caption would be a silent miss in every i2t recall (clip_benchmark
    // counts it so); it almost always means a broken txt_image, so it is refused instead.
    memset(rank_i, 0, sizeof(int32_t) * (size_t)n_img);
    for (int j = 0; j < n_txt; j++) rank_i[d->txt_image[j]] = 1;
    for (int i = 0; i < n_img; i++)
        if (!rank_i[i]) {
            vlmoe_free_mem(w);
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: image %d has no caption in txt_image, expected "
                              "every image to own at least one text", fn, i);
        }
    // each group's images (CSR), without repeats: counting sort of the texts by group
    for (int j = 0; j < n_txt; j++) group[j] = d->txt_group ? d->txt_group[j] : j;
    memset(off, 0, sizeof(int32_t) * ((size_t)n_txt + 1));
    for (int j = 0; j < n_txt; j++) off[group[j] + 1]++;
    for (int g = 0; g < n_txt; g++) off[g + 1] += off[g];
    {
        int32_t *fill = rank_t; // fill[g]: next free slot of group g (rank_t is free until the ranks)
        for (int g = 0; g < n_txt; g++) fill[g] = off[g];
        for (int i = 0; i < n_img; i++) seen[i] = -1;
        for (int j = 0; j < n_txt; j++) list[fill[group[j]]++] = d->txt_image[j];
        // drop repeated images inside each group, compacting the lists
        int32_t at = 0;
        for (int g = 0; g < n_txt; g++) {
            const int32_t lo = off[g], hi = off[g + 1];
            off[g] = at;
            for (int32_t k = lo; k < hi; k++)
                if (seen[list[k]] != g) seen[list[k]] = g, list[at++] = list[k];
        }
        off[n_txt] = at;
    }
    const dup_index di = {group, off, list};
    st = recall_ranks(d->img, n_img, d->txt, n_txt, E, &di, 1, rank_i);
    if (!st) st = recall_ranks(d->txt, n_txt, d->img, n_img, E, &di, 0, rank_t);
    if (!st) {
        for (int q = 0; q < nk; q++) {
            long a = 0, b = 0;
            for (int i = 0; i < n_img; i++) a += rank_i[i] < d->ks[q];
            for (int j = 0; j < n_txt; j++) b += rank_t[j] < d->ks[q];
            i2t[q] = (double)a / n_img;
            t2i[q] = (double)b / n_txt;
        }
        if (mean_rank && median_rank) {
            rank_stats(rank_i, n_img, tmp, &mean_rank[0], &median_rank[0]);
            rank_stats(rank_t, n_txt, tmp, &mean_rank[1], &median_rank[1]);
        }
    }
    vlmoe_free_mem(w);
    return st;
}

int vlmoe_retrieval_recall(const float *img, int n_img, const float *txt, int n_txt,
                           const int32_t *txt_image, int E, const int *ks, int nk, double *i2t,
                           double *t2i) {
    const vlmoe_retrieval_data d = {.img = img, .n_img = n_img, .txt = txt, .n_txt = n_txt, .E = E,
                                    .txt_image = txt_image, .txt_group = NULL, .ks = ks, .nk = nk};
    return vlmoe_retrieval_metrics(&d, i2t, t2i, NULL, NULL);
}

// ---------------------------------------------------------------------------------------------
// Ridge regression probe

// A squared pivot of the Cholesky factor smaller than this fraction of its diagonal entry means that
// X^T X + lambda I is singular to working precision (condition number beyond ~1e12).
#define RIDGE_PIVOT_RTOL 1e-12
enum { RIDGE_BLOCK_ROWS = 256 };

// The normal equations of one train set, shared by every lambda.
typedef struct {
    int n, dim, classes;
    double *mu;    // (dim) train feature mean
    double *G;     // (dim, dim) lower triangle of Xc^T Xc, Xc = X - mu
    double *B;     // (dim, classes) Xc^T Y with Y = 2 onehot - 1
    double *ybar;  // (classes) column means of Y: the bias of the centred problem
    double *A;     // (dim, dim) workspace: the Cholesky factor (LAPACK's, column-major upper)
    double *X;     // (classes, dim) workspace: right-hand sides / solution, column-major (dim, classes)
} ridge_sys;

static void ridge_sys_free(ridge_sys *r) {
    vlmoe_free_mem(r->mu), vlmoe_free_mem(r->G), vlmoe_free_mem(r->B);
    vlmoe_free_mem(r->ybar), vlmoe_free_mem(r->A), vlmoe_free_mem(r->X);
    memset(r, 0, sizeof(*r));
}

static int ridge_prepare(ridge_sys *r, const float *x, const int32_t *y, int n, int dim, int classes) {
    memset(r, 0, sizeof(*r));
    r->n = n, r->dim = dim, r->classes = classes;
    size_t dd, dc, nd;
    if (vlmoe_mul_ok((size_t)dim, (size_t)dim, &dd) || vlmoe_mul_ok((size_t)dim, (size_t)classes, &dc) ||
        vlmoe_mul_ok((size_t)n, (size_t)dim, &nd) || vlmoe_mul_ok(dd, sizeof(double), &dd) ||
        vlmoe_mul_ok(dc, sizeof(double), &dc) || vlmoe_mul_ok(nd, sizeof(double), &nd))
        return vlmoe_fail(VLMOE_ERR_ARG, "ridge: dim = %d, classes = %d, n = %d overflow size_t",
                          dim, classes, n);
    r->mu = vlmoe_calloc(sizeof(double) * (size_t)dim, "ridge mean");
    r->G = vlmoe_alloc(dd, "ridge X^T X");
    r->A = vlmoe_alloc(dd, "ridge Cholesky factor");
    r->B = vlmoe_calloc(dc, "ridge X^T Y");
    r->X = vlmoe_alloc(dc, "ridge solution");
    r->ybar = vlmoe_calloc(sizeof(double) * (size_t)classes, "ridge target mean");
    double *xc = vlmoe_alloc(nd, "ridge centred features");
    double *tot = vlmoe_calloc(sizeof(double) * (size_t)dim, "ridge column sums");
    if (!r->mu || !r->G || !r->A || !r->B || !r->X || !r->ybar || !xc || !tot) {
        vlmoe_free_mem(xc), vlmoe_free_mem(tot), ridge_sys_free(r);
        return VLMOE_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++)
        for (int d = 0; d < dim; d++) r->mu[d] += x[(size_t)i * dim + d];
    for (int d = 0; d < dim; d++) r->mu[d] /= n;
    for (int i = 0; i < n; i++) {
        double *row = xc + (size_t)i * dim;
        double *bc = r->B + y[i];
        for (int d = 0; d < dim; d++) {
            row[d] = x[(size_t)i * dim + d] - r->mu[d];
            tot[d] += row[d];
            bc[(size_t)d * classes] += 2.0 * row[d];
        }
        r->ybar[y[i]] += 2.0;
    }
    // Xc^T Y[d][c] = sum_i xc[i][d] (2 [y_i = c] - 1) = 2 (class-c sum)[d] - (total sum)[d];
    // the total is 0 up to rounding, it is kept so that B is exactly Xc^T Y.
    for (int d = 0; d < dim; d++)
        for (int c = 0; c < classes; c++) r->B[(size_t)d * classes + c] -= tot[d];
    for (int c = 0; c < classes; c++) r->ybar[c] = r->ybar[c] / n - 1.0;
    cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, dim, n, 1.0, xc, dim, 0.0, r->G, dim);
    vlmoe_free_mem(xc), vlmoe_free_mem(tot);
    return VLMOE_OK;
}

// LAPACK's dposv from the linked OpenBLAS (Debian ships no LAPACK header with it, and OpenBLAS's
// LAPACKE is not exported, so the Fortran symbol is declared here). blasint is 32-bit in Debian's
// libopenblas0 (openblas_config.h: no OPENBLAS_USE64BITINT). The trailing length of the character
// argument is what gfortran-built LAPACKs expect; OpenBLAS's own C dposv ignores it.
extern void dposv_(const char *uplo, const int *n, const int *nrhs, double *a, const int *lda,
                   double *b, const int *ldb, int *info, size_t uplo_len);

// W (dim, classes) = (G + lambda I)^-1 B and b (classes) = ybar - mu^T W, so that the scores of
// an uncentred feature row x are x^T W + b. dposv factors A = U^T U (Cholesky) and solves; a
// factor is refused when a pivot is not positive (info > 0) or, because rounding can leave a tiny
// positive pivot on a singular system, when u_jj^2 <= RIDGE_PIVOT_RTOL x A_jj.
static int ridge_solve(ridge_sys *r, double lambda, double *W, double *b) {
    const int dim = r->dim, C = r->classes;
    // row-major lower triangle of G = column-major upper triangle: handed to LAPACK as "U"
    for (int i = 0; i < dim; i++) {
        memcpy(r->A + (size_t)i * dim, r->G + (size_t)i * dim, sizeof(double) * (size_t)(i + 1));
        r->A[(size_t)i * dim + i] += lambda;
    }
    // right-hand sides column-major (dim, C): the transpose of B's row-major layout
    for (int d = 0; d < dim; d++)
        for (int c = 0; c < C; c++) r->X[(size_t)c * dim + d] = r->B[(size_t)d * C + c];
    int info = 0;
    dposv_("U", &dim, &C, r->A, &dim, r->X, &dim, &info, 1);
    int bad = info > 0 ? info - 1 : -1;
    for (int j = 0; bad < 0 && info == 0 && j < dim; j++) {
        const double u = r->A[(size_t)j * dim + j], a = r->G[(size_t)j * dim + j] + lambda;
        if (!(u * u > RIDGE_PIVOT_RTOL * a)) bad = j;
    }
    if (info < 0) // an argument LAPACK rejected: a bug here, not bad data
        return vlmoe_fail(VLMOE_ERR_ARG, "ridge: LAPACK dposv rejected argument %d (dim = %d, classes = %d)", -info, dim, C);
    if (bad >= 0)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "ridge: X^T X + lambda I is not positive definite at lambda = %g "
                          "(LAPACK dposv, pivot %d of %d): the centred train features are "
                          "rank-deficient (n_train = %d, dim = %d); use lambda > 0",
                          lambda, bad, dim, r->n, dim);
    for (int d = 0; d < dim; d++)
        for (int c = 0; c < C; c++) W[(size_t)d * C + c] = r->X[(size_t)c * dim + d];
    for (int c = 0; c < C; c++) {
        double s = r->ybar[c];
        for (int d = 0; d < dim; d++) s -= r->mu[d] * W[(size_t)d * C + c];
        b[c] = s;
    }
    return VLMOE_OK;
}

// Correct argmax predictions (ties: lower class) of scores x W + b over rows of x (n, dim).
// xb (RIDGE_BLOCK_ROWS, dim) and sb (RIDGE_BLOCK_ROWS, classes) are caller workspace.
static long ridge_correct(const float *x, const int32_t *y, int n, int dim, int classes,
                          const double *W, const double *b, double *xb, double *sb) {
    long hits = 0;
    for (int r0 = 0; r0 < n; r0 += RIDGE_BLOCK_ROWS) {
        const int m = n - r0 < RIDGE_BLOCK_ROWS ? n - r0 : RIDGE_BLOCK_ROWS;
        for (size_t i = 0; i < (size_t)m * dim; i++) xb[i] = x[(size_t)r0 * dim + i];
        for (int i = 0; i < m; i++) memcpy(sb + (size_t)i * classes, b, sizeof(double) * classes);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, classes, dim, 1.0, xb, dim, W,
                    classes, 1.0, sb, classes);
        for (int i = 0; i < m; i++) {
            const double *s = sb + (size_t)i * classes;
            int best = 0;
            for (int c = 1; c < classes; c++)
                if (s[c] > s[best]) best = c;
            hits += best == y[r0 + i];
        }
    }
    return hits;
}

static int ridge_check_set(const float *x, const int32_t *y, int n, int dim, int classes,
                           const char *fn, const char *xs, const char *ys) {
    if (n > 0 && (!x || !y)) return vlmoe_fail(VLMOE_ERR_ARG, "%s: %s or %s is NULL", fn, xs, ys);
    int st = check_labels(y, n, classes, fn, ys);
    return st ? st : check_finite(x, n, dim, fn, xs);
}

int vlmoe_ridge_fit(const float *x, const int32_t *y, int n, int dim, int classes, double lambda,
                    double *w, double *b) {
    static const char fn[] = "vlmoe_ridge_fit";
    if (!w || !b) return vlmoe_fail(VLMOE_ERR_ARG, "%s: w or b is NULL", fn);
    if (n < 1 || dim < 1 || classes < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: n = %d, dim = %d, classes = %d, expected all >= 1",
                          fn, n, dim, classes);
    if (!(lambda >= 0) || !isfinite(lambda))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: lambda = %g, expected a finite value >= 0", fn, lambda);
    int st = ridge_check_set(x, y, n, dim, classes, fn, "x", "y");
    if (st) return st;
    ridge_sys r;
    if ((st = ridge_prepare(&r, x, y, n, dim, classes))) return st;
    st = ridge_solve(&r, lambda, w, b);
    ridge_sys_free(&r);
    return st;
}

int vlmoe_fewshot_ridge(const float *train_x, const int32_t *train_y, int n_train,
                        const float *test_x, const int32_t *test_y, int n_test, int dim, int classes,
                        const double *lambdas, int nl, const float *val_x, const int32_t *val_y,
                        int n_val, double *accuracy, double *chosen_lambda) {
    static const char fn[] = "vlmoe_fewshot_ridge";
    if (!lambdas || !accuracy || !chosen_lambda)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: lambdas, accuracy or chosen_lambda is NULL", fn);
    if (n_train < 1 || n_test < 1 || dim < 1 || classes < 1 || nl < 1 || n_val < 0)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "%s: n_train = %d, n_test = %d, dim = %d, classes = %d, nl = %d, "
                          "n_val = %d, expected n_val >= 0 and the others >= 1",
                          fn, n_train, n_test, dim, classes, nl, n_val);
    if (nl > 1 && n_val < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: %d lambdas to choose from but no validation "
                          "samples (n_val = 0)", fn, nl);
    for (int l = 0; l < nl; l++)
        if (!(lambdas[l] >= 0) || !isfinite(lambdas[l]))
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: lambdas[%d] = %g, expected a finite value >= 0",
                              fn, l, lambdas[l]);
    int st = ridge_check_set(train_x, train_y, n_train, dim, classes, fn, "train_x", "train_y");
    if (!st) st = ridge_check_set(test_x, test_y, n_test, dim, classes, fn, "test_x", "test_y");
    if (!st && nl > 1) st = ridge_check_set(val_x, val_y, n_val, dim, classes, fn, "val_x", "val_y");
    if (st) return st;

    ridge_sys r;
    if ((st = ridge_prepare(&r, train_x, train_y, n_train, dim, classes))) return st;
    const size_t wn = (size_t)dim * classes; // fits: ridge_prepare checked dim x classes x 8
    double *W = vlmoe_alloc(sizeof(double) * (2 * wn + 2 * (size_t)classes), "ridge weights");
    double *xb = vlmoe_alloc(sizeof(double) * RIDGE_BLOCK_ROWS * (size_t)dim, "ridge feature block");
    double *sb = vlmoe_alloc(sizeof(double) * RIDGE_BLOCK_ROWS * (size_t)classes, "ridge score block");
    if (!W || !xb || !sb) {
        st = VLMOE_ERR_NOMEM;
        goto done;
    }
    double *b = W + wn, *Wbest = b + classes, *bbest = Wbest + wn;
    long best_hits = -1;
    double best_lambda = 0;
    for (int l = 0; l < nl; l++) {
        if ((st = ridge_solve(&r, lambdas[l], W, b))) goto done;
        // Equal validation accuracy: keep the larger lambda (more regularisation is the safer
        // guess when the held-out set cannot tell them apart).
        const long hits = nl > 1 ? ridge_correct(val_x, val_y, n_val, dim, classes, W, b, xb, sb) : 0;
        if (hits > best_hits || (hits == best_hits && lambdas[l] > best_lambda)) {
            best_hits = hits, best_lambda = lambdas[l];
            memcpy(Wbest, W, sizeof(double) * (wn + (size_t)classes));
        }
    }
    *accuracy = (double)ridge_correct(test_x, test_y, n_test, dim, classes, Wbest, bbest, xb, sb) / n_test;
    *chosen_lambda = best_lambda;
done:
    vlmoe_free_mem(W), vlmoe_free_mem(xb), vlmoe_free_mem(sb);
    ridge_sys_free(&r);
    return st;
}

// ---------------------------------------------------------------------------------------------
// K-shot sampling

int vlmoe_fewshot_sample(const int32_t *labels, int n, int classes, int shots, uint64_t seed,
                         int32_t *out_idx) {
    static const char fn[] = "vlmoe_fewshot_sample";
    if (!labels || !out_idx) return vlmoe_fail(VLMOE_ERR_ARG, "%s: labels or out_idx is NULL", fn);
    if (n < 1 || classes < 1 || shots < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: n = %d, classes = %d, shots = %d, expected all >= 1",
                          fn, n, classes, shots);
    int st = check_labels(labels, n, classes, fn, "labels");
    if (st) return st;
    // start (classes + 1): offsets of each class's indices in idx (n), in increasing order
    int32_t *start = vlmoe_calloc(sizeof(int32_t) * ((size_t)classes + 1), "few-shot class offsets");
    int32_t *fill = vlmoe_alloc(sizeof(int32_t) * (size_t)classes, "few-shot class fill");
    int32_t *idx = vlmoe_alloc(sizeof(int32_t) * (size_t)n, "few-shot class indices");
    if (!start || !fill || !idx) {
        st = VLMOE_ERR_NOMEM;
        goto done;
    }
    for (int i = 0; i < n; i++) start[labels[i] + 1]++;
    for (int c = 0; c < classes; c++) {
        const int have = start[c + 1];
        if (have < shots) {
            st = vlmoe_fail(VLMOE_ERR_ARG, "%s: class %d has %d samples, fewer than the %d shots "
                            "asked for", fn, c, have, shots);
            goto done;
        }
        start[c + 1] += start[c];
        fill[c] = start[c];
    }
    for (int i = 0; i < n; i++) idx[fill[labels[i]]++] = i;
    for (int c = 0; c < classes; c++) {
        // Partial Fisher-Yates on the class's own stream: the first s picks do not depend on
        // `shots` or on the other classes, so for one seed the 5-shot set is inside the 10-shot set.
        vlmoe_rng rng;
        vlmoe_rng_seed(&rng, seed ^ (0x9e3779b97f4a7c15ULL * ((uint64_t)c + 1)));
        int32_t *v = idx + start[c];
        const uint32_t cnt = (uint32_t)(start[c + 1] - start[c]);
        for (int s = 0; s < shots; s++) {
            const uint32_t k = (uint32_t)s + vlmoe_rng_below(&rng, cnt - (uint32_t)s);
            const int32_t t = v[s];
            v[s] = v[k], v[k] = t;
        }
        int32_t *o = out_idx + (size_t)c * shots;
        memcpy(o, v, sizeof(int32_t) * (size_t)shots);
        qsort(o, (size_t)shots, sizeof(int32_t), cmp_i32);
    }
done:
    vlmoe_free_mem(start), vlmoe_free_mem(fill), vlmoe_free_mem(idx);
    return st;
}
