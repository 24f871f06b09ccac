// test_eval.c: tests of src/eval/metrics.c: retrieval recall@K (hand-ranked tiny sets with ties
// and several captions per image, an integer reference across score blocks, bad arguments), the
// ridge probe (closed forms solved by hand, optimality conditions, lambda choice, singular
// systems) and the K-shot sampler.
#include <stdint.h>

#include "test.h"
#include "vlmoe.h"

static uint64_t lcg_state = 42;
static double lcg_uniform(void) { // [0, 1)
    lcg_state = lcg_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(lcg_state >> 11) / 9007199254740992.0;
}
static int lcg_int(int lo, int hi) { return lo + (int)(lcg_uniform() * (hi - lo + 1)); }

static int error_mentions(const char *s) { return strstr(vlmoe_last_error(), s) != NULL; }

// ---------------------------------------------------------------------------------------------
// Recall

// Three images on the axes, so every score is exactly one coordinate of a caption (or its
// negative) and equal scores are exact float ties. Captions, two per image:
//   T0 ( .6, .8) img0   T1 (0, -1) img0   T2 (.6, .8) img1 (same text as T0)
//   T3 (-.6, .8) img1   T4 (-.8, .6) img2 T5 (.8, -.6) img2
// Scores S[i][j]:       T0   T1   T2   T3   T4   T5
//   I0 ( 1, 0)          .6   0    .6  -.6  -.8   .8
//   I1 ( 0, 1)          .8  -1    .8   .8   .6  -.6
//   I2 (-1, 0)         -.6   0   -.6   .6   .8  -.8
// image->text, best positive and the negatives scoring >= it (ties count ahead):
//   I0: best .6 (T0); T2 .6 (tie), T5 .8 -> rank 2 (rank 1 if ties were optimistic)
//   I1: best .8 (T2, T3); T0 .8 (tie) -> rank 1 (0 if optimistic)
//   I2: best .8 (T4); none -> rank 0
//   R@1 = 1/3, R@2 = 2/3, R@3 = 1
// text->image, own score and the other images scoring >= it:
//   T0: .6; I1 .8 -> 1     T1: 0; I2 0 (tie) -> 1     T2: .8 -> 0
//   T3: .8 -> 0            T4: .8 -> 0                T5: -.8; I0 .8, I1 -.6 -> 2
//   R@1 = 3/6, R@2 = 5/6, R@3 = 1
static void test_recall_tiny(void) {
    const float img[] = {1, 0, 0, 1, -1, 0};
    const float txt[] = {.6f, .8f, 0, -1, .6f, .8f, -.6f, .8f, -.8f, .6f, .8f, -.6f};
    const int32_t owner[] = {0, 0, 1, 1, 2, 2};
    const int ks[] = {1, 2, 3, 6, 1000};
    double i2t[5] = {0}, t2i[5] = {0};
    int st = vlmoe_retrieval_recall(img, 3, txt, 6, owner, 2, ks, 5, i2t, t2i);
    CHECK(st == VLMOE_OK, "status %d: %s", st, vlmoe_last_error());
    const double want_i[] = {1.0 / 3, 2.0 / 3, 1, 1, 1}, want_t[] = {0.5, 5.0 / 6, 1, 1, 1};
    for (int q = 0; q < 5; q++) {
        char what[64];
        snprintf(what, sizeof(what), "i2t R@%d", ks[q]);
        CHECK_CLOSE(i2t[q], want_i[q], 1e-12, 0, what);
        snprintf(what, sizeof(what), "t2i R@%d", ks[q]);
        CHECK_CLOSE(t2i[q], want_t[q], 1e-12, 0, what);
    }

    // One caption per image, identical embeddings: every score is 1, all tied. Pessimistic ties
    // put both wrong candidates ahead, so R@1 = R@2 = 0 and only R@3 = 1.
    const float same[] = {1, 0, 1, 0, 1, 0};
    const int32_t diag[] = {0, 1, 2};
    const int k3[] = {1, 2, 3};
    st = vlmoe_retrieval_recall(same, 3, same, 3, diag, 2, k3, 3, i2t, t2i);
    CHECK(st == VLMOE_OK, "status %d", st);
    CHECK(i2t[0] == 0 && i2t[1] == 0 && i2t[2] == 1, "all ties i2t %g %g %g", i2t[0], i2t[1], i2t[2]);
    CHECK(t2i[0] == 0 && t2i[1] == 0 && t2i[2] == 1, "all ties t2i %g %g %g", t2i[0], t2i[1], t2i[2]);
}

// Integer embeddings make every score an exact small integer, so an integer reference of the
// pessimistic rule must agree exactly; 2100 images and 4200 captions span several row blocks
// in both directions, with 1, 2 or 3 captions per image and many ties.
static void test_recall_blocks(void) {
    enum { NI = 2100, E = 4 };
    int nt = 0;
    for (int i = 0; i < NI; i++) nt += 1 + i % 3;
    float *img = malloc(sizeof(float) * NI * E), *txt = malloc(sizeof(float) * nt * E);
    int32_t *owner = malloc(sizeof(int32_t) * nt);
    int *S = malloc(sizeof(int) * (size_t)NI * nt);
    lcg_state = 7;
    for (int i = 0; i < NI * E; i++) img[i] = (float)lcg_int(-2, 2);
    for (int i = 0, j = 0; i < NI; i++)
        for (int c = 0; c <= i % 3; c++, j++) {
            owner[j] = i;
            for (int e = 0; e < E; e++) // a noisy copy of the image, so positives tend to win
                txt[j * E + e] = img[i * E + e] + (float)lcg_int(-1, 1);
        }
    for (int i = 0; i < NI; i++)
        for (int j = 0; j < nt; j++) {
            int s = 0;
            for (int e = 0; e < E; e++) s += (int)img[i * E + e] * (int)txt[j * E + e];
            S[(size_t)i * nt + j] = s;
        }
    const int ks[] = {1, 5, 10, 50, 1000, 5000};
    enum { NK = 6 };
    long hi[NK] = {0}, ht[NK] = {0};
    for (int i = 0; i < NI; i++) {
        int best = -1000000, rank = 0;
        for (int j = 0; j < nt; j++)
            if (owner[j] == i && S[(size_t)i * nt + j] > best) best = S[(size_t)i * nt + j];
        for (int j = 0; j < nt; j++) rank += owner[j] != i && S[(size_t)i * nt + j] >= best;
        for (int q = 0; q < NK; q++) hi[q] += rank < ks[q];
    }
    for (int j = 0; j < nt; j++) {
        int rank = 0;
        const int own = S[(size_t)owner[j] * nt + j];
        for (int i = 0; i < NI; i++) rank += i != owner[j] && S[(size_t)i * nt + j] >= own;
        for (int q = 0; q < NK; q++) ht[q] += rank < ks[q];
    }
    double i2t[NK], t2i[NK];
    int st = vlmoe_retrieval_recall(img, NI, txt, nt, owner, E, ks, NK, i2t, t2i);
    CHECK(st == VLMOE_OK, "status %d: %s", st, vlmoe_last_error());
    for (int q = 0; q < NK; q++) {
        CHECK(i2t[q] == (double)hi[q] / NI, "blocks i2t R@%d: got %.9g expected %.9g", ks[q],
              i2t[q], (double)hi[q] / NI);
        CHECK(t2i[q] == (double)ht[q] / nt, "blocks t2i R@%d: got %.9g expected %.9g", ks[q],
              t2i[q], (double)ht[q] / nt);
    }
    CHECK(i2t[NK - 1] == 1 && t2i[NK - 1] == 1, "R@5000 >= n must be 1: %g %g", i2t[NK - 1],
          t2i[NK - 1]);
    CHECK(hi[0] > 0 && hi[0] < NI && ht[0] > 0 && ht[0] < nt, "reference R@1 is trivial");
    free(img), free(txt), free(owner), free(S);
}

static void test_recall_errors(void) {
    const float img[] = {1, 0, 0, 1};
    const float txt[] = {1, 0, 0, 1, .6f, .8f};
    const int32_t owner[] = {0, 1, 1};
    const int ks[] = {1, 0};
    double a[2], b[2];
    vlmoe_clear_error();
    CHECK(vlmoe_retrieval_recall(img, 2, txt, 3, owner, 2, ks, 2, a, b) == VLMOE_ERR_ARG, "k = 0");
    CHECK(error_mentions("ks[1] = 0"), "message: %s", vlmoe_last_error());
    const int32_t out_of_range[] = {0, 2, 1}, negative[] = {0, -1, 1}, orphan[] = {0, 0, 0};
    CHECK(vlmoe_retrieval_recall(img, 2, txt, 3, out_of_range, 2, ks, 1, a, b) == VLMOE_ERR_ARG,
          "txt_image = n_img");
    CHECK(error_mentions("txt_image[1] = 2"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_retrieval_recall(img, 2, txt, 3, negative, 2, ks, 1, a, b) == VLMOE_ERR_ARG,
          "txt_image = -1");
    CHECK(vlmoe_retrieval_recall(img, 2, txt, 3, orphan, 2, ks, 1, a, b) == VLMOE_ERR_ARG,
          "image without caption");
    CHECK(error_mentions("image 1 has no caption"), "message: %s", vlmoe_last_error());
    const float nan_txt[] = {1, 0, 0, NAN, .6f, .8f};
    CHECK(vlmoe_retrieval_recall(img, 2, nan_txt, 3, owner, 2, ks, 1, a, b) == VLMOE_ERR_ARG,
          "NaN embedding");
    CHECK(error_mentions("txt[1][1]"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_retrieval_recall(img, 0, txt, 3, owner, 2, ks, 1, a, b) == VLMOE_ERR_ARG, "n_img 0");
    CHECK(vlmoe_retrieval_recall(img, 2, txt, 3, owner, 2, ks, 0, a, b) == VLMOE_ERR_ARG, "nk 0");
    CHECK(vlmoe_retrieval_recall(img, 2, txt, 3, owner, 2, ks, 1, NULL, b) == VLMOE_ERR_ARG, "NULL");
}

// ---------------------------------------------------------------------------------------------
// Ridge

// 1-D, two classes: x = 1, 2, 3, 6 with labels 0, 0, 1, 1. mean 3, xc = -2, -1, 0, 3,
// Xc^T Xc = 4 + 1 + 0 + 9 = 14. Targets (+-1): class 0 column (1, 1, -1, -1), class 1 its negative,
// so Xc^T Y = (-2 - 1 - 0 - 3, +6) = (-6, 6) and ybar = (0, 0).
//   w = (-6, 6) / (14 + lambda),  b = ybar - mean w = (18, -18) / (14 + lambda)
// lambda 0: w = (-3/7, 3/7), b = (9/7, -9/7); lambda 1: w = (-.4, .4), b = (1.2, -1.2).
// 2-D: x = (0,0), (1,0), (0,1), (3,3), labels 0, 0, 1, 1. mean (1, 1),
// xc = (-1,-1), (0,-1), (-1,0), (2,2); Xc^T Xc = [[6, 5], [5, 6]];
// Xc^T Y class 0 = (-1,-1) + (0,-1) - (-1,0) - (2,2) = (-2, -4), class 1 = (2, 4); ybar = 0.
//   lambda 1: A = [[7,5],[5,7]], det 24, A^-1 = [[7,-5],[-5,7]]/24
//     w class 0 = (-14 + 20, 10 - 28)/24 = (.25, -.75), class 1 = (-.25, .75)
//     b = -mean w = (-(.25 - .75), ...) = (.5, -.5)
//   lambda 0: A^-1 = [[6,-5],[-5,6]]/11, w class 0 = (-12 + 20, 10 - 24)/11 = (8/11, -14/11),
//     b class 0 = -(8 - 14)/11 = 6/11
static void test_ridge_closed_form(void) {
    const float x1[] = {1, 2, 3, 6};
    const int32_t y1[] = {0, 0, 1, 1};
    double w[4], b[2];
    for (int l = 0; l <= 1; l++) {
        int st = vlmoe_ridge_fit(x1, y1, 4, 1, 2, l, w, b);
        CHECK(st == VLMOE_OK, "1-D lambda %d: %s", l, vlmoe_last_error());
        CHECK_CLOSE(w[0], -6.0 / (14 + l), 1e-14, 1e-12, "1-D w class 0");
        CHECK_CLOSE(w[1], 6.0 / (14 + l), 1e-14, 1e-12, "1-D w class 1");
        CHECK_CLOSE(b[0], 18.0 / (14 + l), 1e-14, 1e-12, "1-D b class 0");
        CHECK_CLOSE(b[1], -18.0 / (14 + l), 1e-14, 1e-12, "1-D b class 1");
    }
    const float x2[] = {0, 0, 1, 0, 0, 1, 3, 3};
    int st = vlmoe_ridge_fit(x2, y1, 4, 2, 2, 1.0, w, b);
    CHECK(st == VLMOE_OK, "2-D: %s", vlmoe_last_error());
    const double w1[] = {.25, -.25, -.75, .75}; // (dim, classes)
    for (int i = 0; i < 4; i++) CHECK_CLOSE(w[i], w1[i], 1e-14, 1e-12, "2-D lambda 1 w");
    CHECK_CLOSE(b[0], .5, 1e-14, 1e-12, "2-D lambda 1 b0");
    CHECK_CLOSE(b[1], -.5, 1e-14, 1e-12, "2-D lambda 1 b1");
    st = vlmoe_ridge_fit(x2, y1, 4, 2, 2, 0.0, w, b);
    CHECK(st == VLMOE_OK, "2-D lambda 0: %s", vlmoe_last_error());
    CHECK_CLOSE(w[0], 8.0 / 11, 1e-14, 1e-12, "2-D lambda 0 w[0][0]");
    CHECK_CLOSE(w[2], -14.0 / 11, 1e-14, 1e-12, "2-D lambda 0 w[1][0]");
    CHECK_CLOSE(b[0], 6.0 / 11, 1e-14, 1e-12, "2-D lambda 0 b0");

    // Predictions of the 1-D probe: class 1 iff x > 3; at x = 3 both scores are exactly 0 and
    // the tie goes to class 0. All five test points are right, so accuracy is 1.
    const float xt[] = {0, 2.9f, 3, 3.1f, 10};
    const int32_t yt[] = {0, 0, 0, 1, 1};
    const double lam[] = {1};
    double acc = -1, chosen = -1;
    st = vlmoe_fewshot_ridge(x1, y1, 4, xt, yt, 5, 1, 2, lam, 1, NULL, NULL, 0, &acc, &chosen);
    CHECK(st == VLMOE_OK, "1-D probe: %s", vlmoe_last_error());
    CHECK(acc == 1 && chosen == 1, "1-D probe accuracy %g lambda %g", acc, chosen);
}

// At the ridge optimum the gradient of sum_i |x_i w + b - y_i|^2 + lambda |w|^2 vanishes:
// sum_i r_ic = 0 (unregularised bias) and sum_i r_ic x_id + lambda w_dc = 0, r = residuals.
// dim 150 > 128 also runs the threaded rows of the Cholesky.
static void test_ridge_optimality(void) {
    enum { N = 400, D = 150, C = 4 };
    float *x = malloc(sizeof(float) * N * D);
    int32_t y[N];
    double *w = malloc(sizeof(double) * D * C), b[C], *r = malloc(sizeof(double) * N * C);
    lcg_state = 11;
    for (int i = 0; i < N; i++) {
        y[i] = lcg_int(0, C - 1);
        for (int d = 0; d < D; d++) x[i * D + d] = (float)(lcg_uniform() * 2 - 1 + 0.3 * y[i] + 2);
    }
    const double lams[] = {0.0, 0.5, 30.0};
    for (int l = 0; l < 3; l++) {
        const double lam = lams[l];
        int st = vlmoe_ridge_fit(x, y, N, D, C, lam, w, b);
        CHECK(st == VLMOE_OK, "lambda %g: %s", lam, vlmoe_last_error());
        if (st) continue;
        for (int i = 0; i < N; i++)
            for (int c = 0; c < C; c++) {
                double s = b[c];
                for (int d = 0; d < D; d++) s += x[i * D + d] * w[d * C + c];
                r[i * C + c] = s - (y[i] == c ? 1.0 : -1.0);
            }
        double worst = 0;
        for (int c = 0; c < C; c++) {
            double g = 0;
            for (int i = 0; i < N; i++) g += r[i * C + c];
            worst = fmax(worst, fabs(g));
            for (int d = 0; d < D; d++) {
                g = lam * w[d * C + c];
                for (int i = 0; i < N; i++) g += r[i * C + c] * x[i * D + d];
                worst = fmax(worst, fabs(g));
            }
        }
        CHECK(worst < 1e-7, "lambda %g: largest gradient entry %.3g", lam, worst);
    }
    free(x), free(w), free(r);
}

// Three well separated clusters (centres 5 e_c, noise in [-.5, .5]) are classified perfectly,
// here with a 10-shot train set drawn by vlmoe_fewshot_sample from a pool.
static void test_ridge_separable(void) {
    enum { C = 3, D = 4, POOL = 60, SHOTS = 10, NV = 15, NT = 60 };
    float pool[POOL * D], xv[NV * D], xt[NT * D], xs[C * SHOTS * D];
    int32_t ypool[POOL], yv[NV], yt[NT], ys[C * SHOTS], idx[C * SHOTS];
    lcg_state = 3;
    float *sets[] = {pool, xv, xt};
    int32_t *labs[] = {ypool, yv, yt};
    const int ns[] = {POOL, NV, NT};
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < ns[s]; i++) {
            labs[s][i] = i % C;
            for (int d = 0; d < D; d++)
                sets[s][i * D + d] = (float)((d == i % C ? 5 : 0) + lcg_uniform() - 0.5);
        }
    int st = vlmoe_fewshot_sample(ypool, POOL, C, SHOTS, 1, idx);
    CHECK(st == VLMOE_OK, "sample: %s", vlmoe_last_error());
    for (int i = 0; i < C * SHOTS; i++) {
        ys[i] = ypool[idx[i]];
        memcpy(xs + i * D, pool + idx[i] * D, sizeof(float) * D);
    }
    const double lams[] = {0.01, 1, 100};
    double acc = -1, chosen = -1;
    st = vlmoe_fewshot_ridge(xs, ys, C * SHOTS, xt, yt, NT, D, C, lams, 3, xv, yv, NV, &acc, &chosen);
    CHECK(st == VLMOE_OK, "separable: %s", vlmoe_last_error());
    CHECK(acc == 1, "separable accuracy %g", acc);
    CHECK(chosen == 100, "all lambdas are perfect on val, the largest wins the tie: %g", chosen);
}

// Large lambda hurts: train is 1-D with four class-0 samples (x = -.1, 0, .1, .2) and two class-1
// samples (x = 1, 1.1), so ybar = (2*4/6 - 1, 2*2/6 - 1) = (1/3, -1/3). As lambda grows w -> 0
// and every prediction becomes class 0, the train majority: at lambda = 1e6 the gap is
// 2 (x - mean) w_1 - 2/3 with w_1 = 2.67/(1.39 + 1e6) ~ 2.7e-6, negative for any x here, so val
// (x = 1, 1.05, .95 of class 1 and .05 of class 0) scores 1/4. At lambda = .01 (~ least squares:
// mean .383, w_1 = 2.667/1.388 = 1.92) the boundary is x* = .383 + (1/3)/1.92 = .56, so val scores
// 4/4 and lambda .01 is chosen whatever the order of the list.
static void test_ridge_lambda_choice(void) {
    const float xtr[] = {-.1f, 0, .1f, .2f, 1, 1.1f}, xv[] = {1, 1.05f, .95f, .05f}, xt[] = {0, 1};
    const int32_t ytr[] = {0, 0, 0, 0, 1, 1}, yv[] = {1, 1, 1, 0}, yt[] = {0, 1};
    const double a[] = {1e6, 0.01}, bb[] = {0.01, 1e6};
    double acc = -1, chosen = -1;
    int st = vlmoe_fewshot_ridge(xtr, ytr, 6, xt, yt, 2, 1, 2, a, 2, xv, yv, 4, &acc, &chosen);
    CHECK(st == VLMOE_OK && chosen == 0.01 && acc == 1, "st %d chosen %g acc %g", st, chosen, acc);
    st = vlmoe_fewshot_ridge(xtr, ytr, 6, xt, yt, 2, 1, 2, bb, 2, xv, yv, 4, &acc, &chosen);
    CHECK(st == VLMOE_OK && chosen == 0.01 && acc == 1, "reversed: chosen %g acc %g", chosen, acc);
    // The big lambda alone: the majority class everywhere, test accuracy 1/2.
    st = vlmoe_fewshot_ridge(xtr, ytr, 6, xt, yt, 2, 1, 2, a, 1, NULL, NULL, 0, &acc, &chosen);
    CHECK(st == VLMOE_OK && chosen == 1e6 && acc == 0.5, "lambda 1e6: chosen %g acc %g", chosen, acc);
    // Two lambdas with the same val accuracy: the larger one.
    const double tie[] = {0.02, 0.01};
    st = vlmoe_fewshot_ridge(xtr, ytr, 6, xt, yt, 2, 1, 2, tie + 1, 1, xv, yv, 4, &acc, &chosen);
    CHECK(st == VLMOE_OK && chosen == 0.01, "single lambda: %g", chosen);
    const double tie2[] = {0.01, 0.02};
    st = vlmoe_fewshot_ridge(xtr, ytr, 6, xt, yt, 2, 1, 2, tie2, 2, xv, yv, 4, &acc, &chosen);
    CHECK(st == VLMOE_OK && chosen == 0.02, "tie -> larger lambda: %g", chosen);
    st = vlmoe_fewshot_ridge(xtr, ytr, 6, xt, yt, 2, 1, 2, tie, 2, xv, yv, 4, &acc, &chosen);
    CHECK(st == VLMOE_OK && chosen == 0.02, "tie -> larger lambda, reversed: %g", chosen);
}

// Collinear features x2 = 2 x1: centred Xc^T Xc = [[2, 4], [4, 8]] is singular. With lambda 0
// the second pivot is 8 - (4/sqrt 2)^2 = 0 and the fit is refused, naming lambda; any lambda > 0
// makes it positive definite. n_train <= dim (3 samples, 5 features) is singular the same way.
static void test_ridge_singular(void) {
    const float x[] = {1, 2, 2, 4, 3, 6};
    const int32_t y[] = {0, 1, 1};
    double w[4], b[2];
    vlmoe_clear_error();
    CHECK(vlmoe_ridge_fit(x, y, 3, 2, 2, 0.0, w, b) == VLMOE_ERR_ARG, "singular lambda 0");
    CHECK(error_mentions("not positive definite at lambda = 0"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_ridge_fit(x, y, 3, 2, 2, 1e-3, w, b) == VLMOE_OK, "lambda 1e-3: %s", vlmoe_last_error());
    // The minimum-norm direction: w is along (1, 2) (the only direction the data spans).
    CHECK_CLOSE(w[2], 2 * w[0], 1e-12, 1e-9, "w along (1, 2)");

    const float wide[15] = {1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0};
    const double lams[] = {1, 0};
    double acc, chosen;
    CHECK(vlmoe_fewshot_ridge(wide, y, 3, wide, y, 3, 5, 2, lams, 2, wide, y, 3, &acc, &chosen) ==
              VLMOE_ERR_ARG, "n <= dim with lambda 0 in the sweep");
    CHECK(error_mentions("n_train = 3, dim = 5"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_ridge(wide, y, 3, wide, y, 3, 5, 2, lams, 1, NULL, NULL, 0, &acc, &chosen) ==
              VLMOE_OK, "n <= dim with lambda 1: %s", vlmoe_last_error());
    CHECK(acc == 1, "wide train accuracy %g", acc);
}

static void test_ridge_errors(void) {
    const float x[] = {0, 1, 2, 3};
    const int32_t y[] = {0, 1, 0, 1}, bad[] = {0, 2, 0, 1};
    const double two[] = {1, 2}, neg[] = {-1};
    double acc, chosen, w[2], b[2];
    CHECK(vlmoe_fewshot_ridge(x, y, 4, x, y, 4, 1, 2, two, 2, NULL, NULL, 0, &acc, &chosen) ==
              VLMOE_ERR_ARG, "two lambdas, no val");
    CHECK(error_mentions("no validation"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_ridge(x, y, 4, x, y, 4, 1, 2, neg, 1, NULL, NULL, 0, &acc, &chosen) ==
              VLMOE_ERR_ARG, "negative lambda");
    CHECK(error_mentions("lambdas[0] = -1"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_ridge(x, y, 4, x, bad, 4, 1, 2, two, 1, NULL, NULL, 0, &acc, &chosen) ==
              VLMOE_ERR_ARG, "test label out of range");
    CHECK(error_mentions("test_y[1] = 2"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_ridge(x, y, 4, x, y, 0, 1, 2, two, 1, NULL, NULL, 0, &acc, &chosen) ==
              VLMOE_ERR_ARG, "no test samples");
    const float nan_x[] = {0, NAN, 2, 3};
    CHECK(vlmoe_ridge_fit(nan_x, y, 4, 1, 2, 1.0, w, b) == VLMOE_ERR_ARG, "NaN feature");
    CHECK(error_mentions("x[1][0]"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_ridge_fit(x, y, 4, 1, 2, INFINITY, w, b) == VLMOE_ERR_ARG, "infinite lambda");
}

// ---------------------------------------------------------------------------------------------
// K-shot sampling

static void test_fewshot_sample(void) {
    enum { N = 30, C = 3 };
    int32_t labels[N];
    // class 0: 11 samples, class 1: 11, class 2: 8, partly interleaved
    for (int i = 0; i < N; i++) labels[i] = i < 24 ? i % 3 : (i < 27 ? 0 : 1);
    int have[C] = {0};
    for (int i = 0; i < N; i++) have[labels[i]]++;
    CHECK(have[0] == 11 && have[1] == 11 && have[2] == 8, "setup %d %d %d", have[0], have[1], have[2]);

    int32_t a[C * 8], b[C * 8], c5[C * 5];
    CHECK(vlmoe_fewshot_sample(labels, N, C, 5, 123, c5) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_sample(labels, N, C, 8, 123, a) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_sample(labels, N, C, 8, 123, b) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(memcmp(a, b, sizeof(a)) == 0, "same seed, different picks");
    int ok = 1;
    for (int c = 0; c < C; c++)
        for (int s = 0; s < 8; s++) {
            const int32_t v = a[c * 8 + s];
            ok &= v >= 0 && v < N && labels[v] == c;          // right class
            ok &= s == 0 || v > a[c * 8 + s - 1];              // increasing, so distinct
        }
    CHECK(ok, "each block of 8 holds distinct indices of its class, increasing");
    // Class 2 has exactly 8 samples: all of them.
    for (int s = 0, k = 0; s < N; s++)
        if (labels[s] == 2) CHECK(a[2 * 8 + k++] == s, "class 2 pick %d", k - 1);
    // 5-shot picks are a subset of the 8-shot ones for the same seed.
    int nested = 1;
    for (int c = 0; c < C; c++)
        for (int s = 0; s < 5; s++) {
            int found = 0;
            for (int t = 0; t < 8; t++) found |= c5[c * 5 + s] == a[c * 8 + t];
            nested &= found;
        }
    CHECK(nested, "5-shot set not inside the 8-shot set");
    int differs = 0;
    for (uint64_t seed = 1; seed <= 4 && !differs; seed++) {
        CHECK(vlmoe_fewshot_sample(labels, N, C, 8, seed, b) == VLMOE_OK, "%s", vlmoe_last_error());
        differs = memcmp(a, b, sizeof(a)) != 0;
    }
    CHECK(differs, "other seeds give the same picks");

    vlmoe_clear_error();
    CHECK(vlmoe_fewshot_sample(labels, N, C, 9, 1, a) == VLMOE_ERR_ARG, "class 2 has only 8");
    CHECK(error_mentions("class 2 has 8 samples"), "message: %s", vlmoe_last_error());
    CHECK(vlmoe_fewshot_sample(labels, N, 2, 1, 1, a) == VLMOE_ERR_ARG, "label out of range");
    CHECK(vlmoe_fewshot_sample(labels, N, 4, 1, 1, a) == VLMOE_ERR_ARG, "empty class 3");
    CHECK(vlmoe_fewshot_sample(labels, N, C, 0, 1, a) == VLMOE_ERR_ARG, "0 shots");
}

// Duplicate captions and OpenCLIP's ranks, worked by hand. Images I0 = (1, 0), I1 = (0, 1),
// I2 = (-1, 0); captions t0 "a dog" (I0) = (1, 0), t1 "a cat" (I1) = (0, 1), t2 "a dog" (I1, the
// same text as t0, so the same embedding) = (1, 0), t3 "a car" (I2) = (0.6, -0.8).
// Without groups (t2 is another text): i2t ranks [1 (t2 ties t0), 0, 1 (t1: 0 > -0.6)] -> R@1 1/3,
// mean rank 5/3, median 2; t2i ranks [0, 0, 1 (I0 scores t2 above I1), 1 (I0: 0.6 > -0.6)] ->
// R@1 1/2, mean 1.5, median floor(0.5) + 1 = 1. With groups {t0, t2}: I0's positives are t0 and t2,
// I1's t0 t1 t2: i2t ranks [0, 0, 1] -> R@1 2/3, mean 4/3, median 1; t2 is right for I0 or I1:
// t2i ranks [0, 0, 0, 1] -> R@1 3/4, R@5 1, mean 1.25, median 1.
static void test_retrieval_duplicates(void) {
    const float img[6] = {1, 0, 0, 1, -1, 0}, txt[8] = {1, 0, 0, 1, 1, 0, 0.6f, -0.8f};
    const int32_t owner[4] = {0, 1, 1, 2}, groups[4] = {0, 1, 0, 3};
    const int ks[2] = {1, 5};
    double i2t[2], t2i[2], mean[2], median[2], o_i2t[2], o_t2i[2];
    vlmoe_retrieval_data d = {.img = img, .n_img = 3, .txt = txt, .n_txt = 4, .E = 2, .txt_image = owner,
                              .txt_group = NULL, .ks = ks, .nk = 2};
    CHECK(vlmoe_retrieval_metrics(&d, i2t, t2i, mean, median) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK_CLOSE(i2t[0], 1.0 / 3, 0, 1e-12, "no groups: i2t R@1");
    CHECK_CLOSE(t2i[0], 0.5, 0, 1e-12, "no groups: t2i R@1");
    CHECK_CLOSE(mean[0], 5.0 / 3, 0, 1e-12, "no groups: image_to_text_mean_rank");
    CHECK_CLOSE(median[0], 2, 0, 0, "no groups: image_to_text_median_rank");
    CHECK_CLOSE(mean[1], 1.5, 0, 1e-12, "no groups: text_to_image_mean_rank");
    CHECK_CLOSE(median[1], 1, 0, 0, "no groups: text_to_image_median_rank (floor of 0.5, + 1)");
    CHECK(vlmoe_retrieval_recall(img, 3, txt, 4, owner, 2, ks, 2, o_i2t, o_t2i) == VLMOE_OK &&
              o_i2t[0] == i2t[0] && o_t2i[0] == t2i[0] && o_i2t[1] == i2t[1] && o_t2i[1] == t2i[1],
          "vlmoe_retrieval_recall is the no-group case");
    d.txt_group = groups;
    CHECK(vlmoe_retrieval_metrics(&d, i2t, t2i, mean, median) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK_CLOSE(i2t[0], 2.0 / 3, 0, 1e-12, "groups: i2t R@1");
    CHECK_CLOSE(i2t[1], 1, 0, 1e-12, "groups: i2t R@5");
    CHECK_CLOSE(t2i[0], 0.75, 0, 1e-12, "groups: t2i R@1");
    CHECK_CLOSE(t2i[1], 1, 0, 1e-12, "groups: t2i R@5");
    CHECK_CLOSE(mean[0], 4.0 / 3, 0, 1e-12, "groups: image_to_text_mean_rank");
    CHECK_CLOSE(median[0], 1, 0, 0, "groups: image_to_text_median_rank");
    CHECK_CLOSE(mean[1], 1.25, 0, 1e-12, "groups: text_to_image_mean_rank");
    CHECK_CLOSE(median[1], 1, 0, 0, "groups: text_to_image_median_rank");
    const int32_t bad_groups[4] = {0, 1, 4, 3};
    d.txt_group = bad_groups;
    vlmoe_clear_error();
    CHECK(vlmoe_retrieval_metrics(&d, i2t, t2i, mean, median) == VLMOE_ERR_ARG &&
              error_mentions("txt_group[2] = 4"), "a group out of range: %s", vlmoe_last_error());
}

int main(void) {
    test_recall_tiny();
    test_retrieval_duplicates();
    test_recall_blocks();
    test_recall_errors();
    test_ridge_closed_form();
    test_ridge_optimality();
    test_ridge_separable();
    test_ridge_lambda_choice();
    test_ridge_singular();
    test_ridge_errors();
    test_fewshot_sample();
    return test_summary("test_eval");
}
