// test_cider.c: CIDEr-D (src/eval/cider.c) against numbers worked by hand, its edge cases and its
// errors. tests/ref/cider_compare.py compares it with pycocoevalcap where that is installed.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "test.h"
#include "vlmoe.h"

// Two images, a perfect caption each. Documents: the 2 reference sets, so log N = log 2.
// df: "a" 2, "cat" "dog" "a cat" "a dog" 1. Weight tf * (log 2 - log df): "a" 0, the rest log 2
// =: L. Candidate = reference "a cat": unigrams {a 0, cat L}, norm L; bigram {a cat L}, norm L;
// no 3- or 4-grams (norm 0: that n adds 0). Cosines: n=1 L*L/(L*L) = 1, n=2 1, n=3,4 0; both have
// 1 bigram, so the length penalty is exp(0) = 1. Mean over n: 2/4; times 10: 5 for each image.
static void test_two_images(void) {
    const char *cand[] = {"a cat", "A dog."}, *refs[] = {"a cat", "a dog"};
    const int off[] = {0, 1, 2};
    double s = -1, per[2] = {-1, -1};
    CHECK(vlmoe_cider_d(cand, 2, refs, off, &s, per) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK_CLOSE(s, 5.0, 1e-12, 0, "two perfect two-word captions");
    CHECK_CLOSE(per[1], 5.0, 1e-12, 0, "case and punctuation are ignored");
}

// Three images, log N = log 3; every n-gram of the references has df 1 except "a" (df 3, weight
// 0), so every other weight is tf * L with L = log 3 (an n-gram in no reference: df 0 counts as
// 1). Length = bigram count; penalty p = exp(-(dl)^2 / 72).
// Image 1, candidate "red ball" (length 1; {red L, ball L} norm L*sqrt2; {red ball L} norm L):
//   ref "a red ball" (length 2): unigrams {a 0, red L, ball L} norm L*sqrt2 -> 2L^2/(2L^2) = 1;
//     bigrams {a red, red ball} norm L*sqrt2 -> L^2/(L*L*sqrt2) = 1/sqrt2; n=3,4: 0.
//   ref "the red ball" (length 2): unigrams norm L*sqrt3 -> 2L^2/(L*sqrt2*L*sqrt3) = 2/sqrt6;
//     bigrams {the red, red ball} -> 1/sqrt2.
//   score = 10 * p(1) * ((1 + 1/sqrt2) + (2/sqrt6 + 1/sqrt2)) / 4 / 2.
// Image 2, candidate "a blue blue cube" (length 3): unigrams {a 0, blue 2L, cube L} norm L*sqrt5,
//   bigrams {a blue, blue blue, blue cube} norm L*sqrt3; ref "a blue cube" (length 2):
//   unigrams norm L*sqrt2, bigrams norm L*sqrt2. n=1: blue's 2L is clipped to the reference's L:
//   (L*L + L*L)/(L*sqrt5*L*sqrt2) = 2/sqrt10; n=2: 2L^2/(L*sqrt3*L*sqrt2) = 2/sqrt6; n=3: no
//   shared trigram; score = 10 * p(1) * (2/sqrt10 + 2/sqrt6) / 4.
// Image 3, candidate "a red cone" vs "a green cone" (both length 2): only "cone" shared:
//   n=1: L^2/(L*sqrt2*L*sqrt2) = 1/2, the rest 0: score = 10 * 1/2 / 4 = 1.25.
static void test_three_images(void) {
    const char *cand[] = {"red ball", "a blue blue cube", "a red cone"};
    const char *refs[] = {"a red ball", "the red ball", "a blue cube", "a green cone"};
    const int off[] = {0, 2, 3, 4};
    const double p1 = exp(-1.0 / 72), r2 = sqrt(2), r6 = sqrt(6), r10 = sqrt(10);
    const double want[3] = {10 * p1 * ((1 + 1 / r2) + (2 / r6 + 1 / r2)) / 8, 10 * p1 * (2 / r10 + 2 / r6) / 4, 1.25};
    double s = -1, per[3];
    CHECK(vlmoe_cider_d(cand, 3, refs, off, &s, per) == VLMOE_OK, "%s", vlmoe_last_error());
    for (int i = 0; i < 3; i++) {
        char what[64];
        snprintf(what, sizeof(what), "image %d worked by hand", i + 1);
        CHECK_CLOSE(per[i], want[i], 1e-12, 0, what);
    }
    CHECK_CLOSE(s, (want[0] + want[1] + want[2]) / 3, 1e-12, 0, "the corpus score is the mean");
    printf("three images: %.6f %.6f %.6f, CIDEr-D %.6f\n", per[0], per[1], per[2], s);
}

static void test_edges(void) {
    // an empty candidate shares nothing: 0, and the other images keep their scores
    const char *cand[] = {"", "a dog"}, *refs[] = {"a cat", "a dog"};
    const int off[] = {0, 1, 2};
    double s = -1, per[2];
    CHECK(vlmoe_cider_d(cand, 2, refs, off, &s, per) == VLMOE_OK && per[0] == 0 && fabs(per[1] - 5) < 1e-12,
          "empty candidate: %g %g", per[0], per[1]);
    const char *punct[] = {" ,. ", "a dog"};
    CHECK(vlmoe_cider_d(punct, 2, refs, off, &s, per) == VLMOE_OK && per[0] == 0, "punctuation only: %g", per[0]);
    // one image: every idf is log 1 - log 1 = 0, so CIDEr-D is 0 even for the reference itself
    CHECK(vlmoe_cider_d(refs, 1, refs, off, &s, NULL) == VLMOE_OK && s == 0, "one image: %g", s);
    // a longer candidate is penalised by its length: "a dog dog" (2 bigrams vs 1)
    const char *longer[] = {"a cat", "a dog dog"};
    CHECK(vlmoe_cider_d(longer, 2, refs, off, &s, per) == VLMOE_OK && per[1] < 5 && per[1] > 0,
          "repeated word: %g", per[1]);
    // errors name the problem
    const int none[] = {0, 1, 1};
    CHECK(vlmoe_cider_d(cand, 2, refs, none, &s, NULL) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "image 1 has no reference"),
          "no references: %s", vlmoe_last_error());
    CHECK(vlmoe_cider_d(cand, 0, refs, off, &s, NULL) == VLMOE_ERR_ARG, "no candidates");
}

int main(void) {
    test_two_images();
    test_three_images();
    test_edges();
    return test_summary("test_cider");
}
