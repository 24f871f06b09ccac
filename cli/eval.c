// eval.c: `vlmoe eval`: a trained model on the synthetic held-out split, or on the user's data:
// zero-shot classification on an image folder (prompt-template ensembles, top-1/top-5) with a
// K-shot linear probe on its features (LIMoE's 10-shot protocol: ridge regression on frozen image
// embeddings, regularisation chosen on held-out samples), image<->text retrieval R@1/5/10 and
// contrastive accuracy and loss on an OpenCLIP CSV or webdataset caption file, and a routing
// report per MoE layer and modality. Human-readable, or --json. Tests: tests/test_cli.c,
// tests/test_eval_data.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "train/run.h"
#include "common.h"
#include "data/image.h"
#include "data/readers.h"
#include "tokenize.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe eval --model CHECKPOINT [options]\n\n"
    "Without data flags, evaluates on the held-out split of the synthetic data: zero-shot top-1/top-5\n"
    "over the 20 (colour, shape) classes with 6 prompt templates, retrieval recall@1/5/10 in both\n"
    "directions, in-batch contrastive accuracy and loss, a K-shot linear probe on the image\n"
    "embeddings and, for MoE models, the routing of one held-out batch.\n\n"
    "With --zeroshot-data DIR (DIR/<class>/*.jpg|png|webp): zero-shot top-1/top-5 with a prompt\n"
    "ensemble (class names from the folder names, '_' -> ' ', or --classnames; templates from\n"
    "--templates or 8 of OpenAI CLIP's ImageNet templates) and the K-shot probe on the folder's\n"
    "images. With --val-data (OpenCLIP CSV/TSV or webdataset shards): retrieval recall@1/5/10 (rows\n"
    "holding the same image file count as one image with several captions), contrastive loss and\n"
    "accuracy in batches, and the routing of the first batch. Texts are tokenized with --tokenizer;\n"
    "without it, a model whose vocabulary is too small for BPE (< 514 ids) gets the synthetic\n"
    "data's word tokenizer. Unreadable images are skipped, counted and reported.\n\n"
    "examples:\n"
    "  vlmoe eval --model logs/run1/checkpoints/step_3000.safetensors --json\n"
    "  vlmoe eval --model clip.safetensors --tokenizer bpe_simple_vocab_16e6.txt.gz \\\n"
    "      --zeroshot-data imagenet/val --val-data coco_val.csv --csv-separator , --csv-img-key file";

static const double LAMBDAS[] = {1e-3, 1e-2, 1e-1, 1, 10, 100, 1000};
static const int KS[3] = {1, 5, 10};

// The human-readable report, built up while the sections run.
typedef struct {
    char *s;
    size_t n, cap;
} text_buf;

static void say(text_buf *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void say(text_buf *t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    if (t->n + (size_t)k + 1 > t->cap) {
        size_t cap = 2 * (t->n + (size_t)k + 1);
        char *s = realloc(t->s, cap);
        if (!s) return;   // the report loses a line; the JSON and the exit status are unaffected
        t->s = s, t->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(t->s + t->n, t->cap - t->n, fmt, ap);
    va_end(ap);
    t->n += (size_t)k;
}

typedef struct {
    vlmoe_model *m;
    const vlmoe_model_config *c;
    int B, shots;
    int pairs_routing;      // the routing report will come from --val-data's first batch
    uint64_t seed;
    vlmoe_image_params ip;
    cli_text text;          // text.synth also makes the synthetic held-out split
    cJSON *out;
    text_buf txt;
    cJSON *routing;         // of the first batch that had MoE layers
    char routing_what[320], report[8192];
} eval_ctx;

// The routing report of the last forward: per layer and modality, success, experts used, tokens
// per expert. Kept from the first forward that had MoE layers; `what` says which.
static void capture_routing(eval_ctx *e, const char *what) {
    int nm;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(e->m, &nm);
    if (e->routing || !nm) return;
    e->routing = vlmoe_metrics_moe(ms, nm, NULL, NULL);
    snprintf(e->routing_what, sizeof(e->routing_what), "%s", what);
    char *buf = e->report;
    const size_t cap = sizeof(e->report);
    size_t o = 0;
#define P(...) (o += (size_t)snprintf(buf + o, o < cap ? cap - o : 0, __VA_ARGS__))
    for (int i = 0; i < nm; i++) {
        P("  encoder %d block %d:", ms[i].encoder, ms[i].block);
        for (int mo = 0, any = 0; mo < 2; mo++) {
            if (!ms[i].tokens[mo]) continue;
            P(" %s%s success %.3f, experts used %.2f, tokens per expert [", any++ ? "| " : "",
              mo ? "text" : "image", ms[i].success[mo], ms[i].experts_used[mo]);
            for (int x = 0; ms[i].accepted[mo] && x < ms[i].num_experts; x++)
                P("%s%.0f", x ? " " : "", ms[i].accepted[mo][x] * ms[i].tokens[mo]);
            P("]");
        }
        P("\n");
    }
#undef P
}

// Contrastive loss and accuracy of pairs in evaluation mode, as training sees them (both
// modalities in one pass), summed over batches.
typedef struct {
    double loss, acc;
    long pairs;
    int batches;
} contrastive_sum;

static int contrastive_batch(eval_ctx *e, const vlmoe_batch *b, contrastive_sum *cs, const char *what) {
    vlmoe_step_stats s;
    int st = vlmoe_model_evaluate(e->m, b, &s);
    if (st) return st;
    cs->loss += s.contrastive * b->batch_size;
    cs->acc += 0.5 * (s.acc_i2t + s.acc_t2i) * b->batch_size;
    cs->pairs += b->batch_size;
    cs->batches++;
    capture_routing(e, what);
    return VLMOE_OK;
}

static cJSON *contrastive_json(eval_ctx *e, const contrastive_sum *cs, const char *where) {
    const double loss = cs->pairs ? cs->loss / cs->pairs : 0, acc = cs->pairs ? cs->acc / cs->pairs : 0;
    cJSON *o = cJSON_AddObjectToObject(e->out, "contrastive");
    cJSON_AddNumberToObject(o, "batch_size", e->B);
    cJSON_AddNumberToObject(o, "batches", cs->batches);
    cJSON_AddNumberToObject(o, "loss", loss);
    cJSON_AddNumberToObject(o, "accuracy", acc);
    say(&e->txt, "contrastive%s%s (batches of %d): loss %.4f, accuracy %.1f%% (chance %.1f%%)\n",
        where ? " on " : "", where ? where : "", e->B, loss, 100 * acc, 100.0 / e->B);
    return o;
}

static cJSON *retrieval_json(eval_ctx *e, const double *i2t, const double *t2i) {
    cJSON *o = cJSON_AddObjectToObject(e->out, "retrieval");
    for (int q = 0; q < 3; q++) {
        char k1[16], k2[16];
        snprintf(k1, sizeof(k1), "i2t_R@%d", KS[q]);
        snprintf(k2, sizeof(k2), "t2i_R@%d", KS[q]);
        cJSON_AddNumberToObject(o, k1, i2t[q]);
        cJSON_AddNumberToObject(o, k2, t2i[q]);
    }
    say(&e->txt, ": image->text R@1 %.1f%%  R@5 %.1f%%  R@10 %.1f%%; text->image R@1 %.1f%%  R@5 %.1f%%  "
        "R@10 %.1f%%\n", 100 * i2t[0], 100 * i2t[1], 100 * i2t[2], 100 * t2i[0], 100 * t2i[1], 100 * t2i[2]);
    return o;
}

static void zeroshot_json(eval_ctx *e, double top1, double top5, int C) {
    cJSON *o = cJSON_AddObjectToObject(e->out, "zeroshot");
    cJSON_AddNumberToObject(o, "top1", top1);
    cJSON_AddNumberToObject(o, "top5", top5);
    cJSON_AddNumberToObject(o, "classes", C);
}

// Rows idx (n) of features x (., E) and labels y, packed into ox and oy.
static void gather(const float *x, const int32_t *y, const int32_t *idx, int n, int E, float *ox, int32_t *oy) {
    for (int i = 0; i < n; i++) {
        memcpy(ox + (size_t)i * E, x + (size_t)idx[i] * E, sizeof(float) * E);
        oy[i] = y[idx[i]];
    }
}

// The K-shot probe: ridge on `shots` rows per class (train), lambda chosen on val, accuracy on test.
static void fewshot_json(eval_ctx *e, double acc, double lambda, const char *where) {
    cJSON *o = cJSON_AddObjectToObject(e->out, "fewshot");
    cJSON_AddNumberToObject(o, "shots", e->shots);
    cJSON_AddNumberToObject(o, "accuracy", acc);
    cJSON_AddNumberToObject(o, "lambda", lambda);
    say(&e->txt, "%d-shot linear probe%s%s (ridge, lambda %g chosen on held-out %s): %.1f%%\n", e->shots,
        where ? " on " : "", where ? where : "", lambda, where ? "images" : "samples", 100 * acc);
}

// ---------------------------------------------------------------------------------------------
// The synthetic held-out split

// Image embeddings and labels of n held-out samples starting at `first`; img/tok/lens are scratch.
static int embed_synth(eval_ctx *e, uint64_t first, int n, float *img, int32_t *tok, int32_t *lens,
                       float *out, int32_t *labels) {
    const int C = vlmoe_synth_num_classes(e->text.synth);
    int st = vlmoe_synth_batch(e->text.synth, VLMOE_SPLIT_HELDOUT, first, n, e->c->context_length, img, tok, lens);
    for (int i = 0; i < n; i++) labels[i] = (int32_t)((first + (uint64_t)i) % (uint64_t)C);
    return st ? st : vlmoe_model_encode_images(e->m, img, n, out);
}

static int eval_synthetic(eval_ctx *e, int n) {
    const int E = e->c->embed_dim, T = e->c->context_length, C = vlmoe_synth_num_classes(e->text.synth);
    const int shots = e->shots, B = e->B, pool = shots ? 3 * shots * C : 0, nval = shots ? 5 * C : 0;
    const int nmax = n > pool + nval ? n : pool + nval, ntr = n > shots * C ? n : shots * C;
    const size_t isz = (size_t)3 * e->c->image_size * e->c->image_size;
    float *img = malloc(sizeof(float) * isz * nmax), *ce = malloc(sizeof(float) * (size_t)C * E);
    float *ie = malloc(sizeof(float) * (size_t)(n + pool + nval) * E), *te = malloc(sizeof(float) * (size_t)ntr * E);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)nmax * T), *lens = malloc(sizeof(int32_t) * nmax);
    int32_t *labels = malloc(sizeof(int32_t) * (size_t)(n + pool + nval)), *txt_image = malloc(sizeof(int32_t) * ntr);
    int st = img && ce && ie && te && tok && lens && labels && txt_image
                 ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "evaluation buffers");
    if (!st && vlmoe_synth_vocab_size(e->text.synth) > e->c->vocab_size)
        st = vlmoe_fail(VLMOE_ERR_ARG, "the model's vocabulary is too small for the synthetic data");
    cJSON_AddNumberToObject(e->out, "samples", n);
    // zero-shot and retrieval on held-out samples [0, n) (class-balanced: class = index % C)
    double top1 = 0, top5 = 0, i2t[3], t2i[3], pi = 0, pt = 0;
    for (int i = 0; i < n && !st; i++) txt_image[i] = i;
    if (!st) st = embed_synth(e, 0, n, img, tok, lens, ie, labels);
    if (!st) st = vlmoe_model_encode_texts(e->m, tok, lens, n, te);
    if (!st) st = vlmoe_synth_class_embeddings(e->m, e->text.synth, ce);
    if (!st) {
        vlmoe_zeroshot_accuracy(ie, n, ce, C, E, labels, &top1, &top5);
        st = vlmoe_retrieval_recall(ie, n, te, n, txt_image, E, KS, 3, i2t, t2i);
        vlmoe_pair_accuracy(ie, te, n, E, B, &pi, &pt);
    }
    if (!st) {
        zeroshot_json(e, top1, top5, C);
        say(&e->txt, "zero-shot (%d classes, %d prompt templates): top-1 %.1f%%  top-5 %.1f%%  (chance %.1f%%)\n",
            C, vlmoe_synth_num_templates(e->text.synth), 100 * top1, 100 * top5, 100.0 / C);
        say(&e->txt, "retrieval (%d pairs)", n);
        retrieval_json(e, i2t, t2i);
    }
    // contrastive loss and accuracy in batches of B, the routing of the first batch
    contrastive_sum cs = {0};
    char what[64];
    snprintf(what, sizeof(what), "one held-out batch of %d pairs", B);
    for (int k = 0; k < n / B && !st; k++) {
        // the held-out pairs again, seen as training sees them: both modalities in one pass
        st = vlmoe_synth_batch(e->text.synth, VLMOE_SPLIT_HELDOUT, (uint64_t)k * B, B, T, img, tok, lens);
        const vlmoe_batch bt = {B, img, tok, lens};
        if (!st) st = contrastive_batch(e, &bt, &cs, what);
    }
    if (!st) {
        cJSON *o = contrastive_json(e, &cs, NULL);
        cJSON_AddNumberToObject(o, "pair_i2t", pi);
        cJSON_AddNumberToObject(o, "pair_t2i", pt);
    }
    // K-shot probe: train pool and validation from held-out indices far from the test set [0, n)
    if (shots > 0 && !st) {
        float *px = ie + (size_t)n * E, *vx = px + (size_t)pool * E, *tx = te;   // te is free again
        int32_t *py = labels + n, *vy = py + pool, *idx = txt_image, *ty = tok;
        double acc = 0, lambda = 0;
        st = embed_synth(e, 1000000, pool, img, tok, lens, px, py);
        if (!st) st = embed_synth(e, 2000000, nval, img, tok, lens, vx, vy);
        if (!st) st = vlmoe_fewshot_sample(py, pool, C, shots, e->seed, idx);
        if (!st) {
            gather(px, py, idx, shots * C, E, tx, ty);
            st = vlmoe_fewshot_ridge(tx, ty, shots * C, ie, labels, n, E, C, LAMBDAS, 7, vx, vy, nval, &acc, &lambda);
        }
        if (st) vlmoe_error_prefix("few-shot");
        else fewshot_json(e, acc, lambda, NULL);
    }
    free(img), free(ce), free(ie), free(te), free(tok), free(lens), free(labels), free(txt_image);
    return st;
}

// ---------------------------------------------------------------------------------------------
// An image folder: zero-shot classification and the K-shot probe

// The K-shot probe on the folder's features: `shots` random images per class train the probe,
// the others alternate (per class, in file order) between test and validation. Returns 1 with
// the reason in `why` when a class has too few images.
static int folder_fewshot(eval_ctx *e, const float *x, const int32_t *y, int n, int C, const char *const *names,
                          char *why, size_t cap, double *acc, double *lambda) {
    const int E = e->c->embed_dim, K = e->shots;
    int32_t *cnt = calloc((size_t)C, sizeof(int32_t)), *idx = malloc(sizeof(int32_t) * (size_t)(n + K * C));
    float *fx = malloc(sizeof(float) * (size_t)n * E);
    int32_t *fy = malloc(sizeof(int32_t) * n);
    uint8_t *taken = calloc((size_t)n, 1);
    int st = cnt && idx && fx && fy && taken ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "few-shot buffers");
    for (int i = 0; i < n && !st; i++) cnt[y[i]]++;
    for (int c = 0; c < C && !st; c++)
        if (cnt[c] < K + 2) {
            snprintf(why, cap, "class '%s' has %d readable images, the probe needs %d (%d shots, 1 validation, "
                     "1 test)", names[c], cnt[c], K + 2, K);
            st = -1;
        }
    if (!st) st = vlmoe_fewshot_sample(y, n, C, K, e->seed, idx);
    if (!st) {
        int32_t *test = idx + K * C, nte = 0, nva = 0;
        for (int i = 0; i < K * C; i++) taken[idx[i]] = 1;
        memset(cnt, 0, sizeof(int32_t) * C);
        // test rows from the front of idx's tail, validation rows from its back
        for (int i = 0; i < n; i++)
            if (!taken[i]) {
                if (cnt[y[i]]++ % 2 == 0) test[nte++] = i;
                else test[n - K * C - 1 - nva++] = i;
            }
        float *tx = fx, *sx = tx + (size_t)K * C * E, *vx = sx + (size_t)nte * E;
        int32_t *ty = fy, *sy = ty + K * C, *vy = sy + nte;
        gather(x, y, idx, K * C, E, tx, ty);
        gather(x, y, test, nte, E, sx, sy);
        gather(x, y, test + nte, nva, E, vx, vy);
        st = vlmoe_fewshot_ridge(tx, ty, K * C, sx, sy, nte, E, C, LAMBDAS, 7, vx, vy, nva, acc, lambda);
    }
    free(cnt), free(idx), free(fx), free(fy), free(taken);
    return st < 0 ? 1 : st ? -1 : 0;
}

// The routing of the folder's first batch, when --val-data gives none.
typedef struct {
    eval_ctx *e;
    const char *dir;
} folder_batch;

static void folder_routing(void *u, int k) {
    const folder_batch *fb = u;
    char what[320];
    snprintf(what, sizeof(what), "the first batch of %d images of %s", k, fb->dir);
    capture_routing(fb->e, what);
}

static int eval_folder(eval_ctx *e, const char *dir, const char *names_path, const char *tpl_path) {
    vlmoe_image_folder f;
    if (vlmoe_image_folder_load(dir, &f)) return cli_error("eval", "--zeroshot-data: %s", vlmoe_last_error());
    char **names_v = NULL, **tpl_v = NULL;
    size_t nn = 0, ntv = 0;
    const int C = f.n_classes, E = e->c->embed_dim;
    float *ie = malloc(sizeof(float) * (size_t)f.n * E), *ce = malloc(sizeof(float) * (size_t)C * E);
    int32_t *labels = malloc(sizeof(int32_t) * (size_t)f.n);
    uint8_t *ok = malloc((size_t)f.n);
    int rc = ie && ce && labels && ok ? 0 : cli_error("eval", "out of memory for %lld images", (long long)f.n);
    if (!rc && names_path && !(rc = cli_read_lines("eval", names_path, &names_v, &nn)) && nn != (size_t)C)
        rc = cli_error("eval", "--classnames %s has %zu names, %s has %d class folders", names_path, nn, dir, C);
    if (!rc && tpl_path && !(rc = cli_read_lines("eval", tpl_path, &tpl_v, &ntv)) && !ntv)
        rc = cli_error("eval", "--templates %s: no templates", tpl_path);
    const char *const *names = names_v ? (const char *const *)names_v : (const char *const *)f.class_names;
    const char *const *tpl = tpl_v ? (const char *const *)tpl_v : cli_templates;
    const int nt = tpl_v ? (int)ntv : CLI_NUM_TEMPLATES;
    // image embeddings of every readable image, in batches of B
    cli_bad_log bad = {0};
    folder_batch fb = {e, dir};
    const cli_encode_params ep = {&e->ip, e->B, "zero-shot images", e->pairs_routing ? NULL : folder_routing, &fb};
    int n = 0, st = rc ? -1 : cli_encode_images(e->m, (const char *const *)f.paths, (int)f.n, &ep, ie, ok, &bad, &n);
    for (int64_t i = 0, k = 0; i < f.n && !rc && !st; i++)
        if (ok[i]) labels[k++] = f.labels[i];
    if (!rc && !st && !n) {
        cli_bad_warn("eval", &bad, "unreadable image", dir);
        rc = cli_error("eval", "--zeroshot-data %s: none of its %lld images could be read", dir, (long long)f.n);
    }
    if (!rc && !st) st = vlmoe_class_embeddings(e->m, names, C, tpl, nt, cli_tokenize, &e->text, ce);
    if (!rc && st) rc = cli_error("eval", "--zeroshot-data %s: %s", dir, vlmoe_last_error());
    if (!rc) {
        double top1, top5;
        vlmoe_zeroshot_accuracy(ie, n, ce, C, E, labels, &top1, &top5);
        zeroshot_json(e, top1, top5, C);
        cJSON *o = cJSON_GetObjectItem(e->out, "zeroshot");
        cJSON_AddNumberToObject(o, "templates", nt);
        cJSON_AddNumberToObject(o, "images", n);
        cJSON_AddNumberToObject(o, "bad_images", (double)bad.n);
        cJSON_AddStringToObject(o, "data", dir);
        say(&e->txt, "zero-shot on %s (%d classes, %d prompt templates, %d images", dir, C, nt, n);
        if (bad.n) say(&e->txt, "; %ld unreadable skipped", bad.n);
        say(&e->txt, "): top-1 %.1f%%  top-5 %.1f%%  (chance %.1f%%)\n", 100 * top1, 100 * top5, 100.0 / C);
        cli_bad_warn("eval", &bad, "unreadable image", dir);
    }
    if (!rc && e->shots) {
        char why[512];
        double acc, lambda;
        const int r = folder_fewshot(e, ie, labels, n, C, names, why, sizeof(why), &acc, &lambda);
        if (r < 0) {
            rc = cli_error("eval", "few-shot on %s: %s", dir, vlmoe_last_error());
        } else if (r) {
            cJSON *o = cJSON_AddObjectToObject(e->out, "fewshot");
            cJSON_AddNumberToObject(o, "shots", e->shots);
            cJSON_AddStringToObject(o, "skipped", why);
            say(&e->txt, "%d-shot linear probe on %s: skipped, %s\n", e->shots, dir, why);
        } else {
            fewshot_json(e, acc, lambda, dir);
        }
    }
    free(ie), free(ce), free(labels), free(ok);
    cli_free_lines(names_v, nn), cli_free_lines(tpl_v, ntv);
    vlmoe_image_folder_free(&f);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Image-caption pairs: retrieval, contrastive accuracy

typedef struct {
    uint64_t hash, len;
    int32_t row;
} image_key;

static int cmp_key(const void *a, const void *b) {
    const image_key *x = a, *y = b;
    if (x->hash != y->hash) return x->hash < y->hash ? -1 : 1;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return (x->row > y->row) - (x->row < y->row);
}

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

// Grows *p (of *cap elements of `elem` bytes) to hold `need`; 0 or VLMOE_ERR_NOMEM.
static int grow(void *p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return VLMOE_OK;
    size_t c = *cap ? 2 * *cap : 1024;
    while (c < need) c *= 2;
    void *q = realloc(*(void **)p, c * elem);
    if (!q) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot grow the embeddings to %zu rows", c);
    *(void **)p = q, *cap = c;
    return VLMOE_OK;
}

static int eval_pairs(eval_ctx *e, const vlmoe_dataset_params *dp) {
    vlmoe_dataset *ds = NULL;
    if (vlmoe_dataset_open(dp, &ds)) return cli_error("eval", "--val-data: %s", vlmoe_last_error());
    const int E = e->c->embed_dim, T = e->c->context_length, S = e->c->image_size, B = e->B;
    const size_t isz = (size_t)3 * S * S;
    float *batch = malloc(sizeof(float) * isz * B), *ie = NULL, *te = NULL, *iu = NULL;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *lens = malloc(sizeof(int32_t) * B), *txt_image = NULL;
    image_key *keys = NULL;
    size_t cap_i = 0, cap_t = 0, cap_k = 0;
    vlmoe_image img = {0};
    cli_bad_log bad = {0};
    contrastive_sum cs = {0};
    cli_progress pr = cli_progress_start("validation pairs");
    int st = batch && tok && lens ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "batch buffers");
    int n = 0, k = 0, done = 0;
    while (!st && !done) {
        vlmoe_sample s;
        const int r = vlmoe_dataset_next(ds, &s);
        if (r < 0) {
            st = r;
            break;
        }
        done = r == 0;
        if (!done) {
            if (vlmoe_image_decode(s.image, s.image_len, s.key, &img) ||
                vlmoe_image_preprocess_eval(&img, &e->ip, batch + k * isz)) {
                cli_bad_add(&bad, vlmoe_last_error());
                continue;
            }
            const int len = cli_tokenize(&e->text, s.caption, tok + (size_t)k * T, T);
            if (len < 2) {
                vlmoe_error_prefix("%s: caption", s.key);
                st = VLMOE_ERR_ARG;
                break;
            }
            lens[k] = len;
            if ((st = grow(&keys, &cap_k, (size_t)n + k + 1, sizeof(image_key)))) break;
            keys[n + k] = (image_key){fnv1a(s.image, s.image_len), s.image_len, n + k};
            k++;
        }
        if (k == B || (done && k)) {
            const vlmoe_batch bt = {k, batch, tok, lens};
            char what[320];
            snprintf(what, sizeof(what), "the first batch of %d pairs of %s", k, dp->path);
            if (k >= 2) st = contrastive_batch(e, &bt, &cs, what);
            if (!st) st = grow(&ie, &cap_i, (size_t)n + k, sizeof(float) * E);
            if (!st) st = grow(&te, &cap_t, (size_t)n + k, sizeof(float) * E);
            if (!st) st = vlmoe_model_encode_images(e->m, batch, k, ie + (size_t)n * E);
            if (!st) st = vlmoe_model_encode_texts(e->m, tok, lens, k, te + (size_t)n * E);
            n += k, k = 0;
            cli_progress_show(&pr, n, -1);
        }
    }
    cli_progress_end(&pr);
    const vlmoe_dataset_stats *dst = vlmoe_dataset_get_stats(ds);
    const long skipped = (long)vlmoe_dataset_stats_bad(dst) + bad.n;
    if (!st && n < 2) st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %d usable image-caption pairs, expected at least 2",
                                      dp->path, n);
    // Rows with the same image bytes are one image with several captions (COCO's 5 per image):
    // separate copies would tie with each other and fail every recall@1.
    int n_img = 0;
    txt_image = malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    iu = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1) * E);
    if (!st && (!txt_image || !iu)) st = vlmoe_fail(VLMOE_ERR_NOMEM, "retrieval buffers");
    if (!st) {
        qsort(keys, (size_t)n, sizeof(image_key), cmp_key);
        for (int i = 0; i < n; i++) {
            if (i == 0 || keys[i].hash != keys[i - 1].hash || keys[i].len != keys[i - 1].len)
                memcpy(iu + (size_t)n_img++ * E, ie + (size_t)keys[i].row * E, sizeof(float) * E);
            txt_image[keys[i].row] = n_img - 1;
        }
    }
    double i2t[3], t2i[3];
    if (!st) st = vlmoe_retrieval_recall(iu, n_img, te, n, txt_image, E, KS, 3, i2t, t2i);
    int rc = st ? cli_error("eval", "--val-data %s: %s", dp->path, vlmoe_last_error()) : 0;
    if (!rc) {
        say(&e->txt, "retrieval on %s (%d images, %d captions", dp->path, n_img, n);
        if (skipped) say(&e->txt, "; %ld bad samples skipped", skipped);
        say(&e->txt, ")");
        cJSON *o = retrieval_json(e, i2t, t2i);
        cJSON_AddNumberToObject(o, "images", n_img);
        cJSON_AddNumberToObject(o, "captions", n);
        cJSON_AddNumberToObject(o, "bad_samples", (double)skipped);
        cJSON_AddStringToObject(o, "data", dp->path);
        cJSON_AddStringToObject(contrastive_json(e, &cs, dp->path), "data", dp->path);
    }
    if (vlmoe_dataset_stats_bad(dst)) {
        char sum[2048];
        vlmoe_dataset_stats_format(dst, sum, sizeof(sum));
        fprintf(stderr, "vlmoe eval: warning: %s: %s\n", dp->path, sum);
    }
    cli_bad_warn("eval", &bad, "undecodable image", dp->path);
    vlmoe_image_free(&img);
    vlmoe_dataset_free(ds);
    free(batch), free(ie), free(te), free(iu), free(tok), free(lens), free(txt_image), free(keys);
    return rc;
}

// ---------------------------------------------------------------------------------------------

int cmd_eval(int argc, char **argv) {
    const char *model = NULL, *dataset = NULL, *zs_dir = NULL, *classnames = NULL, *templates = NULL;
    const char *val = NULL, *tokenizer = NULL, *sep = "\t", *mean = NULL, *std = NULL;
    vlmoe_dataset_params dp = vlmoe_dataset_default_params();
    int n = 1000, B = 64, shots = 10, json = 0, threads = 0;
    long seed = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "a vlmoe checkpoint (step_N.safetensors)"},
        {"zeroshot-data", ARG_STRING, &zs_dir, "DIR", "image folder DIR/<class>/*.jpg: zero-shot and few-shot"},
        {"classnames", ARG_STRING, &classnames, "FILE", "class names, one per line, in sorted folder order"},
        {"templates", ARG_STRING, &templates, "FILE", "prompt templates, one per line, {} = class name"},
        {"val-data", ARG_STRING, &val, "FILE", "image-caption pairs (CSV/TSV or webdataset shards): retrieval"},
        {"dataset-type", ARG_STRING, &dataset, "TYPE", "of --val-data: auto (default), csv, webdataset; "
                                                       "synthetic: the built-in held-out split"},
        {"csv-img-key", ARG_STRING, &dp.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &dp.caption_key, "NAME", "CSV column of captions (default title)"},
        {"csv-separator", ARG_STRING, &sep, "C", "CSV field separator (default tab; \\t for tab)"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &mean, "R,G,B", "normalisation mean (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &std, "R,G,B", "normalisation std (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"samples", ARG_INT, &n, "N", "synthetic held-out samples for zero-shot and retrieval (default 1000)"},
        {"batch-size", ARG_INT, &B, "N", "encoding and contrastive batch (default 64)"},
        {"few-shot", ARG_INT, &shots, "K", "shots per class of the linear probe (default 10, 0 = skip)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the synthetic data (as in training) and of the few-shot draw"},
        {"json", ARG_FLAG, &json, NULL, "print one JSON object instead of text"},
        {"threads", ARG_INT, &threads, "N", "worker threads"},
    };
    int rc = args_parse("eval", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (threads > 0) omp_set_num_threads(threads);
    if (!model) return cli_error("eval", "--model is required (see vlmoe eval --help)");
    const int user_data = zs_dir || val;
    const int synthetic = dataset ? !strcmp(dataset, "synthetic") : !user_data;
    if (dataset && !synthetic && cli_dataset_type("eval", dataset, 1, &dp.type)) return 1;
    if (synthetic && user_data)
        return cli_error("eval", "--dataset-type synthetic evaluates on the built-in data; leave it out with "
                         "--zeroshot-data or --val-data");
    if (!synthetic && !val && dataset) return cli_error("eval", "--dataset-type %s needs --val-data", dataset);
    if ((classnames || templates) && !zs_dir)
        return cli_error("eval", "--classnames and --templates need --zeroshot-data");
    if (n < 2 || B < 2 || shots < 0)
        return cli_error("eval", "--samples and --batch-size must be >= 2, --few-shot >= 0");
    if (cli_separator("eval", sep, &dp.separator)) return 1;
    dp.path = val;

    eval_ctx e;
    memset(&e, 0, sizeof(e));
    e.B = B, e.shots = shots, e.seed = (uint64_t)seed, e.pairs_routing = val != NULL;
    if (vlmoe_model_load(&e.m, model)) return cli_error("eval", "%s", vlmoe_last_error());
    e.c = vlmoe_model_get_config(e.m);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = e.c->image_size;
    sp.seed = (uint64_t)seed;
    rc = cli_image_params("eval", mean, std, e.c, &e.ip);
    if (!rc && vlmoe_synth_init(&e.text.synth, &sp)) rc = cli_error("eval", "%s", vlmoe_last_error());
    if (!rc) rc = cli_text_init("eval", tokenizer, e.c, user_data, &e.text);
    e.out = cJSON_CreateObject();
    cJSON_AddStringToObject(e.out, "model", model);
    if (!rc && synthetic && eval_synthetic(&e, n)) rc = cli_error("eval", "%s", vlmoe_last_error());
    if (!rc && zs_dir) rc = eval_folder(&e, zs_dir, classnames, templates);
    if (!rc && val) rc = eval_pairs(&e, &dp);
    if (e.routing) cJSON_AddItemToObject(e.out, "routing", e.routing);
    if (!rc && json) {
        char *txt = cJSON_PrintUnformatted(e.out);
        printf("%s\n", txt);
        free(txt);
    } else if (!rc) {
        printf("model %s: %s, %zu parameters", model, e.c->name, vlmoe_model_num_floats(e.m));
        if (synthetic) printf("; %d held-out synthetic samples", n);
        printf("\n%s", e.txt.s ? e.txt.s : "");
        if (e.report[0]) printf("routing (%s, eval capacity):\n%s", e.routing_what, e.report);
    }
    cJSON_Delete(e.out);
    free(e.txt.s);
    cli_text_free(&e.text);
    vlmoe_model_free(e.m);
    return rc;
}
