// test_synthetic.c: tests src/data/synthetic.c: parameter validation, class list and templates,
// determinism and thread-safety of samples, pixel range, split separation and held-out balance,
// captions naming their class, the word tokenizer (round trip, padding, truncation, UNK), and
// that a colour-histogram classifier cannot solve the zero-shot classes.
#include <omp.h>
#include <stdint.h>

#include "test.h"
#include "vlmoe.h"

enum { CAP = 200, CTX = 32 };

static const char *const colours[5] = {"red", "green", "blue", "yellow", "purple"};
static const char *const shapes[4] = {"circle", "square", "triangle", "cross"};

static vlmoe_synth *make(int size, uint64_t seed) {
    vlmoe_synth_params p = vlmoe_synth_default_params();
    p.image_size = size;
    p.seed = seed;
    vlmoe_synth *s = NULL;
    int st = vlmoe_synth_init(&s, &p);
    CHECK(st == VLMOE_OK && s, "init size %d: %s", size, vlmoe_last_error());
    return s;
}

static void test_params(void) {
    vlmoe_synth_params p = vlmoe_synth_default_params();
    CHECK(p.image_size == 32 && p.seed == 0, "defaults: size %d seed %llu", p.image_size,
          (unsigned long long)p.seed);
    int bad[] = {0, 15, 1025, -3};
    for (int i = 0; i < 4; i++) {
        vlmoe_synth *s = (vlmoe_synth *)&p; // must be reset to NULL on failure
        p.image_size = bad[i];
        vlmoe_clear_error();
        int st = vlmoe_synth_init(&s, &p);
        CHECK(st == VLMOE_ERR_ARG && s == NULL, "image_size %d: status %d", bad[i], st);
        CHECK(strstr(vlmoe_last_error(), "image_size") != NULL, "message: '%s'", vlmoe_last_error());
    }
    CHECK(vlmoe_synth_init(NULL, &p) == VLMOE_ERR_ARG, "NULL out");
    vlmoe_synth_free(NULL);
}

static void test_classes_templates(void) {
    vlmoe_synth *s = make(32, 0);
    CHECK(vlmoe_synth_num_classes(s) == 20, "classes %d", vlmoe_synth_num_classes(s));
    for (int c = 0; c < 20; c++) {
        char want[32];
        snprintf(want, sizeof want, "%s %s", colours[c / 4], shapes[c % 4]);
        const char *got = vlmoe_synth_class_name(s, c);
        CHECK(got && strcmp(got, want) == 0, "class %d: '%s' expected '%s'", c, got ? got : "(null)", want);
    }
    CHECK(vlmoe_synth_class_name(s, -1) == NULL && vlmoe_synth_class_name(s, 20) == NULL, "range");
    int nt = vlmoe_synth_num_templates(s);
    CHECK(nt >= 6, "templates %d", nt);
    for (int t = 0; t < nt; t++) {
        const char *tp = vlmoe_synth_template(s, t);
        CHECK(tp && strstr(tp, "{}"), "template %d has no {}", t);
    }
    CHECK(vlmoe_synth_template(s, nt) == NULL, "template range");
    vlmoe_synth_free(s);
}

static void test_determinism(void) {
    vlmoe_synth *a = make(32, 7), *b = make(32, 7), *c = make(32, 8);
    size_t n = 3 * 32 * 32;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    char ca[CAP], cb[CAP];
    int ka, kb;
    int same_idx_diff = 0, diff_idx_same = 0, diff_seed_same = 0, split_same = 0;
    for (uint64_t i = 0; i < 50; i++) {
        vlmoe_synth_sample(a, VLMOE_SPLIT_TRAIN, i, x, ca, CAP, &ka);
        vlmoe_synth_sample(b, VLMOE_SPLIT_TRAIN, i, y, cb, CAP, &kb);
        same_idx_diff += memcmp(x, y, n * sizeof *x) != 0 || strcmp(ca, cb) != 0 || ka != kb;
        vlmoe_synth_sample(b, VLMOE_SPLIT_TRAIN, i + 1, y, NULL, 0, NULL);
        diff_idx_same += memcmp(x, y, n * sizeof *x) == 0;
        vlmoe_synth_sample(c, VLMOE_SPLIT_TRAIN, i, y, NULL, 0, NULL);
        diff_seed_same += memcmp(x, y, n * sizeof *x) == 0;
        vlmoe_synth_sample(a, VLMOE_SPLIT_HELDOUT, i, y, NULL, 0, NULL);
        split_same += memcmp(x, y, n * sizeof *x) == 0;
        // Skipping the image must not change the caption or class.
        char cc[CAP];
        int kc;
        vlmoe_synth_sample(a, VLMOE_SPLIT_TRAIN, i, NULL, cc, CAP, &kc);
        CHECK(strcmp(cc, ca) == 0 && kc == ka, "index %llu: caption without image '%s' vs '%s'",
              (unsigned long long)i, cc, ca);
    }
    CHECK(same_idx_diff == 0, "%d samples differ for the same (seed, split, index)", same_idx_diff);
    CHECK(diff_idx_same == 0, "%d images equal for neighbouring indices", diff_idx_same);
    CHECK(diff_seed_same == 0, "%d images equal across seeds", diff_seed_same);
    CHECK(split_same == 0, "%d images equal across splits", split_same);

    // Thread-safety: generating in parallel gives the same bytes as in sequence.
    enum { N = 64 };
    float *ser = malloc(N * n * sizeof *ser), *par = malloc(N * n * sizeof *par);
    for (int i = 0; i < N; i++) vlmoe_synth_sample(a, VLMOE_SPLIT_TRAIN, (uint64_t)i, ser + i * n, NULL, 0, NULL);
#pragma omp parallel for num_threads(4)
    for (int i = 0; i < N; i++) vlmoe_synth_sample(a, VLMOE_SPLIT_TRAIN, (uint64_t)i, par + i * n, NULL, 0, NULL);
    CHECK(memcmp(ser, par, N * n * sizeof *ser) == 0, "parallel samples differ from serial ones");
    free(ser);
    free(par);
    free(x);
    free(y);
    vlmoe_synth_free(a);
    vlmoe_synth_free(b);
    vlmoe_synth_free(c);
}

static void test_range_and_sizes(void) {
    int sizes[] = {16, 17, 32, 64};
    for (int si = 0; si < 4; si++) {
        int S = sizes[si];
        vlmoe_synth *s = make(S, 1);
        CHECK(vlmoe_synth_image_size(s) == S, "image_size %d expected %d", vlmoe_synth_image_size(s), S);
        size_t n = 3 * (size_t)S * (size_t)S;
        float *x = malloc(n * sizeof *x);
        float lo = 1e9f, hi = -1e9f;
        int bad = 0;
        for (uint64_t i = 0; i < 200; i++) {
            vlmoe_synth_sample(s, (int)(i & 1), i, x, NULL, 0, NULL);
            for (size_t k = 0; k < n; k++) {
                if (!(x[k] >= -1.f && x[k] <= 1.f)) bad++;
                if (x[k] < lo) lo = x[k];
                if (x[k] > hi) hi = x[k];
            }
        }
        CHECK(bad == 0, "size %d: %d pixels outside [-1,1] (min %g max %g)", S, bad, lo, hi);
        CHECK(hi - lo > 1.0f, "size %d: suspiciously small pixel range [%g, %g]", S, lo, hi);
        free(x);
        vlmoe_synth_free(s);
    }
}

static void test_splits_and_captions(void) {
    vlmoe_synth *s = make(32, 0);
    char cap[CAP];
    int k, wrong = 0, counts[20] = {0};
    for (uint64_t i = 0; i < 400; i++) {
        vlmoe_synth_sample(s, VLMOE_SPLIT_HELDOUT, i, NULL, NULL, 0, &k);
        wrong += k != (int)(i % 20);
    }
    CHECK(wrong == 0, "%d held-out samples break class = index %% 20", wrong);
    for (uint64_t i = 0; i < 2000; i++) {
        vlmoe_synth_sample(s, VLMOE_SPLIT_TRAIN, i, NULL, NULL, 0, &k);
        CHECK(k >= 0 && k < 20, "train class %d", k);
        if (k >= 0 && k < 20) counts[k]++;
    }
    for (int c = 0; c < 20; c++) CHECK(counts[c] > 60 && counts[c] < 140, "train class %d drawn %d/2000", c, counts[c]);

    // Captions name the class's colour and shape, and the main object comes first: the first
    // colour word and the first shape word of the caption are the class's.
    int distractors = 0;
    for (int split = 0; split < 2; split++) {
        for (uint64_t i = 0; i < 500; i++) {
            vlmoe_synth_sample(s, split, i, NULL, cap, CAP, &k);
            const char *col = colours[k / 4], *sh = shapes[k % 4];
            char main_obj[40];
            snprintf(main_obj, sizeof main_obj, "%s %s", col, sh);
            const char *at = strstr(cap, main_obj);
            int first_ok = at != NULL;
            for (int c = 0; c < 5 && at; c++) {
                const char *o = strstr(cap, colours[c]);
                if (o && o < at) first_ok = 0;
            }
            CHECK(first_ok, "split %d index %llu class '%s': caption '%s'", split,
                  (unsigned long long)i, main_obj, cap);
            distractors += strstr(cap, " and a small ") != NULL;
        }
    }
    CHECK(distractors > 50 && distractors < 400, "%d/1000 captions mention a distractor", distractors);

    // Bad arguments and caption truncation.
    float img[3 * 32 * 32];
    CHECK(vlmoe_synth_sample(s, 2, 0, img, cap, CAP, &k) == VLMOE_ERR_ARG, "split 2");
    CHECK(strstr(vlmoe_last_error(), "split") != NULL, "message: '%s'", vlmoe_last_error());
    CHECK(vlmoe_synth_sample(s, -1, 0, img, cap, CAP, &k) == VLMOE_ERR_ARG, "split -1");
    CHECK(vlmoe_synth_sample(NULL, 0, 0, img, cap, CAP, &k) == VLMOE_ERR_ARG, "NULL dataset");
    CHECK(vlmoe_synth_sample(s, 0, 0, img, cap, 0, &k) == VLMOE_ERR_ARG, "cap 0");
    CHECK(vlmoe_synth_sample(s, 0, 0, NULL, NULL, 0, NULL) == VLMOE_ERR_ARG, "nothing to write");
    char small[5];
    CHECK(vlmoe_synth_sample(s, 0, 3, NULL, small, sizeof small, NULL) == VLMOE_OK, "cap 5");
    vlmoe_synth_sample(s, 0, 3, NULL, cap, CAP, NULL);
    CHECK(strlen(small) == 4 && strncmp(small, cap, 4) == 0, "truncated caption '%s' of '%s'", small, cap);
    vlmoe_synth_free(s);
}

// Splits like the tokenizer does and tokenizes each word alone, so a caption's ids can be
// checked word by word.
static int words_of(const char *text, char words[][32], int max) {
    int n = 0;
    const char *p = text;
    while (*p && n < max) {
        while (*p && !((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9'))) p++;
        if (!*p) break;
        int len = 0;
        while ((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9')) {
            if (len < 31) words[n][len++] = *p;
            p++;
        }
        words[n++][len] = 0;
    }
    return n;
}

static void test_tokenizer(void) {
    vlmoe_synth *s = make(32, 0);
    int V = vlmoe_synth_vocab_size(s);
    CHECK(V > 4 && V < 100, "vocab size %d", V);
    int32_t ids[CTX], wid[CTX];
    char cap[CAP], words[64][32];
    int unk = 0, badlen = 0, badid = 0, badpad = 0, maxlen = 0;
    for (int split = 0; split < 2; split++) {
        for (uint64_t i = 0; i < 250; i++) {
            vlmoe_synth_sample(s, split, i, NULL, cap, CAP, NULL);
            int len = vlmoe_synth_tokenize(s, cap, ids, CTX);
            int nw = words_of(cap, words, 64);
            if (len > maxlen) maxlen = len;
            badlen += len != nw + 2 || ids[0] != VLMOE_TOK_SOT || ids[len - 1] != VLMOE_TOK_EOT;
            for (int t = len; t < CTX; t++) badpad += ids[t] != VLMOE_TOK_PAD;
            for (int w = 0; w < nw && w + 1 < len - 1; w++) {
                int l1 = vlmoe_synth_tokenize(s, words[w], wid, 3);
                unk += ids[w + 1] == VLMOE_TOK_UNK;
                badid += l1 != 3 || wid[1] != ids[w + 1] || ids[w + 1] < 4 || ids[w + 1] >= V;
            }
        }
    }
    CHECK(unk == 0, "%d UNK tokens in captions", unk);
    CHECK(badlen == 0, "%d captions with wrong length or SOT/EOT placement", badlen);
    CHECK(badpad == 0, "%d non-PAD ids after EOT", badpad);
    CHECK(badid == 0, "%d word ids that do not match the word tokenized alone", badid);
    CHECK(maxlen <= CTX, "longest caption %d tokens", maxlen);

    // Distinct words get distinct ids; case and punctuation do not matter.
    int32_t a[8], b[8];
    int la = vlmoe_synth_tokenize(s, "red circle", a, 8);
    int lb = vlmoe_synth_tokenize(s, "  RED,Circle. ", b, 8);
    CHECK(la == 4 && lb == 4 && memcmp(a, b, sizeof a) == 0 && a[1] != a[2], "case/punctuation");
    la = vlmoe_synth_tokenize(s, "a zebra", a, 8);
    CHECK(la == 4 && a[2] == VLMOE_TOK_UNK && a[1] != VLMOE_TOK_UNK, "unknown word: %d %d", a[1], a[2]);
    la = vlmoe_synth_tokenize(s, "averyveryveryverylongwordthatisnotinthevocab red", a, 8);
    CHECK(la == 4 && a[1] == VLMOE_TOK_UNK && a[2] > 3, "long word");
    la = vlmoe_synth_tokenize(s, "", a, 8);
    CHECK(la == 2 && a[0] == VLMOE_TOK_SOT && a[1] == VLMOE_TOK_EOT && a[2] == VLMOE_TOK_PAD, "empty");

    // Truncation keeps SOT, the first words and EOT last.
    const char *longcap = "a large red circle in the top left on a striped background";
    int32_t full[CTX], tr[4];
    vlmoe_synth_tokenize(s, longcap, full, CTX);
    int lt = vlmoe_synth_tokenize(s, longcap, tr, 4);
    CHECK(lt == 4 && tr[0] == VLMOE_TOK_SOT && tr[1] == full[1] && tr[2] == full[2] &&
              tr[3] == VLMOE_TOK_EOT, "truncation: %d [%d %d %d %d]", lt, tr[0], tr[1], tr[2], tr[3]);
    lt = vlmoe_synth_tokenize(s, longcap, tr, 2);
    CHECK(lt == 2 && tr[0] == VLMOE_TOK_SOT && tr[1] == VLMOE_TOK_EOT, "ctx 2");
    CHECK(vlmoe_synth_tokenize(s, longcap, tr, 1) == VLMOE_ERR_ARG, "ctx 1 must fail");
    CHECK(strstr(vlmoe_last_error(), "ctx") != NULL, "message: '%s'", vlmoe_last_error());
    CHECK(vlmoe_synth_tokenize(s, NULL, tr, 4) == VLMOE_ERR_ARG, "NULL text");

    // Every zero-shot prompt tokenizes without UNK.
    int prompt_unk = 0;
    for (int t = 0; t < vlmoe_synth_num_templates(s); t++) {
        for (int c = 0; c < vlmoe_synth_num_classes(s); c++) {
            const char *tp = vlmoe_synth_template(s, t), *at = strstr(tp, "{}");
            char prompt[128];
            snprintf(prompt, sizeof prompt, "%.*s%s%s", (int)(at - tp), tp, vlmoe_synth_class_name(s, c), at + 2);
            int l = vlmoe_synth_tokenize(s, prompt, ids, CTX);
            for (int i = 1; i < l - 1; i++) prompt_unk += ids[i] == VLMOE_TOK_UNK;
            CHECK(l > 3 && l < CTX, "prompt '%s': %d tokens", prompt, l);
        }
    }
    CHECK(prompt_unk == 0, "%d UNK tokens in prompts", prompt_unk);
    vlmoe_synth_free(s);
}

// 8 bins per channel, normalised: what a pure colour classifier can see.
enum { NBIN = 512 };
static void histogram(const float *img, int S, double *h) {
    size_t plane = (size_t)S * (size_t)S;
    memset(h, 0, NBIN * sizeof *h);
    for (size_t i = 0; i < plane; i++) {
        int b[3];
        for (int k = 0; k < 3; k++) {
            int v = (int)((img[k * plane + i] + 1.f) * 4.f);
            b[k] = v < 0 ? 0 : (v > 7 ? 7 : v);
        }
        h[b[0] * 64 + b[1] * 8 + b[2]] += 1.0 / (double)plane;
    }
}

// Nearest-centroid accuracy over `ncls` labels, where label = class / div (div 1: the 20 zero-shot
// classes; div 4: colour only).
static double centroid_accuracy(const double *trh, const int *trc, int ntr, const double *teh,
                                const int *tec, int nte, int div) {
    int ncls = 20 / div;
    double *cent = calloc((size_t)ncls * NBIN, sizeof *cent);
    int cnt[20] = {0};
    for (int i = 0; i < ntr; i++) {
        int l = trc[i] / div;
        cnt[l]++;
        for (int j = 0; j < NBIN; j++) cent[l * NBIN + j] += trh[(size_t)i * NBIN + j];
    }
    for (int l = 0; l < ncls; l++)
        for (int j = 0; j < NBIN; j++) cent[l * NBIN + j] /= cnt[l] ? cnt[l] : 1;
    int correct = 0;
    for (int i = 0; i < nte; i++) {
        int best = 0;
        double bd = 1e300;
        for (int l = 0; l < ncls; l++) {
            double d = 0;
            for (int j = 0; j < NBIN; j++) {
                double e = teh[(size_t)i * NBIN + j] - cent[l * NBIN + j];
                d += e * e;
            }
            if (d < bd) bd = d, best = l;
        }
        correct += best == tec[i] / div;
    }
    free(cent);
    return (double)correct / nte;
}

static void test_not_colour_solvable(void) {
    enum { NTR = 2000, NTE = 1000, S = 32 };
    vlmoe_synth *s = make(S, 0);
    double *trh = malloc((size_t)NTR * NBIN * sizeof *trh), *teh = malloc((size_t)NTE * NBIN * sizeof *teh);
    int *trc = malloc(NTR * sizeof *trc), *tec = malloc(NTE * sizeof *tec);
    float img[3 * S * S];
    for (int i = 0; i < NTR; i++) {
        vlmoe_synth_sample(s, VLMOE_SPLIT_TRAIN, (uint64_t)i, img, NULL, 0, &trc[i]);
        histogram(img, S, trh + (size_t)i * NBIN);
    }
    for (int i = 0; i < NTE; i++) {
        vlmoe_synth_sample(s, VLMOE_SPLIT_HELDOUT, (uint64_t)i, img, NULL, 0, &tec[i]);
        histogram(img, S, teh + (size_t)i * NBIN);
    }
    double acc_class = centroid_accuracy(trh, trc, NTR, teh, tec, NTE, 1);
    double acc_colour = centroid_accuracy(trh, trc, NTR, teh, tec, NTE, 4);
    printf("colour-histogram nearest centroid: class accuracy %.3f (chance 0.05), colour accuracy "
           "%.3f (chance 0.2)\n", acc_class, acc_colour);
    CHECK(acc_class < 0.4, "a colour histogram solves the classes: accuracy %.3f", acc_class);
    CHECK(acc_colour > 0.35, "colour is not predictable from a colour histogram: %.3f", acc_colour);
    free(trh);
    free(teh);
    free(trc);
    free(tec);
    vlmoe_synth_free(s);
}

int main(void) {
    test_params();
    test_classes_templates();
    test_determinism();
    test_range_and_sizes();
    test_splits_and_captions();
    test_tokenizer();
    test_not_colour_solvable();
    return test_summary("test_synthetic");
}
