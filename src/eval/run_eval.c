// run_eval.c: the evaluation `vlmoe eval` runs (run_eval.h): zero-shot top-1/top-5 with prompt
// ensembles, the K-shot linear probe (LIMoE's 10-shot protocol: ridge regression on frozen image
// embeddings, regularisation chosen on held-out samples), image<->text recall@1/5/10, in-batch
// contrastive loss and accuracy, and the routing of one batch, on the synthetic held-out split,
// an image folder or image-caption pairs. Covered by tests/test_eval_data.c and tests/test_cli.c.
#include "eval/run_eval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

static const double LAMBDAS[] = {1e-3, 1e-2, 1e-1, 1, 10, 100, 1000};
enum { NUM_LAMBDAS = (int)(sizeof(LAMBDAS) / sizeof(LAMBDAS[0])) };
const int vlmoe_eval_ks[VLMOE_EVAL_NUM_K] = {1, 5, 10};

void vlmoe_skip_log_add(vlmoe_skip_log *b, const char *msg) {
    if (b->n < 3) snprintf(b->first[b->n], sizeof(b->first[0]), "%s", msg);
    b->n++;
}

vlmoe_eval_params vlmoe_eval_default_params(void) {
    return (vlmoe_eval_params){.batch_size = 64, .shots = 10};
}

// The fields a section needs: images of files need ip, user texts tokenize.
static int check_params(const vlmoe_eval_params *p, int files, const char *fn) {
    if (p->batch_size < 2 || p->shots < 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: batch_size %d and shots %d, expected >= 2 and >= 0", fn, p->batch_size,
                          p->shots);
    if (files && (!p->ip || !p->tokenize))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: the params need the image transform (ip) and a tokenizer (tokenize)", fn);
    return VLMOE_OK;
}

static void progress(const vlmoe_eval_params *p, const char *what, long done, long total) {
    if (p->progress) p->progress(p->progress_user, what, done, total);
}

int vlmoe_encode_image_files(vlmoe_model *m, const char *const *paths, int n, const vlmoe_encode_files_params *p,
                             float *out, uint8_t *ok, vlmoe_skip_log *bad, int *n_ok) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, B = p->batch_size;
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    *n_ok = 0;
    // src/ops runs 1-row products as 2 rows, so the plan's batch does not change any row's bits
    const int plan = n < B ? n : B;
    int st = vlmoe_model_plan(m, plan > 1 ? plan : 1);
    if (st) return st;
    float *batch = malloc(sizeof(float) * isz * (size_t)B);
    if (!batch) return vlmoe_fail(VLMOE_ERR_NOMEM, "a batch of %d images", B);
    vlmoe_image img = {.max_pixels = p->ip ? (size_t)p->ip->max_pixels : 0};
    if (p->progress) p->progress(p->progress_user, p->what, 0, n);
    int done = 0, k = 0;
    for (int i = 0; i < n && !st; i++) {
        const int good = !vlmoe_image_load(paths[i], &img) && !vlmoe_image_preprocess_eval(&img, p->ip, batch + k * isz);
        if (ok) ok[i] = (uint8_t)good;
        if (good) k++;
        else vlmoe_skip_log_add(bad, vlmoe_last_error());
        if (k == B || (i == n - 1 && k)) {
            st = vlmoe_model_encode_images(m, batch, k, out + (size_t)done * E);
            if (!st && p->after_batch) p->after_batch(p->user, k);
            done += k, k = 0;
            if (p->progress) p->progress(p->progress_user, p->what, i + 1, n);
        }
    }
    vlmoe_image_free(&img);
    free(batch);
    *n_ok = done;
    return st;
}

// ---------------------------------------------------------------------------------------------
// Routing and contrastive batches

void vlmoe_eval_routing_free(vlmoe_eval_routing *r) {
    free(r->stats), free(r->values);
    memset(r, 0, sizeof(*r));
}

// Keeps the routing statistics of the model's last forward, unless r holds some already or the
// model has no MoE layer; `what` says which forward it was.
static int capture_routing(vlmoe_model *m, vlmoe_eval_routing *r, const char *what) {
    int nm;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, &nm);
    if (!r || r->n || nm <= 0) return VLMOE_OK;
    size_t nv = 0;   // doubles of the routed/accepted arrays (layers may differ in their experts)
    for (int i = 0; i < nm; i++)
        for (int mo = 0; mo < 2; mo++)
            nv += (size_t)((ms[i].routed[mo] ? 1 : 0) + (ms[i].accepted[mo] ? 1 : 0)) * (size_t)ms[i].num_experts;
    vlmoe_moe_stats *s = malloc(sizeof(*s) * (size_t)nm);
    double *v = malloc(sizeof(double) * (nv ? nv : 1));
    if (!s || !v) return free(s), free(v), vlmoe_fail(VLMOE_ERR_NOMEM, "routing statistics of %d layers", nm);
    size_t o = 0;
    for (int i = 0; i < nm; i++) {
        s[i] = ms[i];
        for (int mo = 0; mo < 2; mo++) {
            double **arr[2] = {&s[i].routed[mo], &s[i].accepted[mo]};
            for (int a = 0; a < 2; a++) {
                if (!*arr[a]) continue;
                memcpy(v + o, *arr[a], sizeof(double) * (size_t)s[i].num_experts);
                *arr[a] = v + o;
                o += (size_t)s[i].num_experts;
            }
        }
    }
    r->n = nm, r->stats = s, r->values = v;
    snprintf(r->what, sizeof(r->what), "%s", what);
    return VLMOE_OK;
}

// Contrastive sums of batches; the means go to the result at the end.
typedef struct {
    double loss, acc;
    long pairs;
    int batches;
} contrastive_sum;

static int contrastive_batch(vlmoe_model *m, const vlmoe_batch *b, contrastive_sum *cs, const vlmoe_eval_params *p,
                             const char *what) {
    vlmoe_step_stats s;
    int st = vlmoe_model_evaluate(m, b, &s);
    if (st) return st;
    cs->loss += s.contrastive * b->batch_size;
    cs->acc += 0.5 * (s.acc_i2t + s.acc_t2i) * b->batch_size;
    cs->pairs += b->batch_size;
    cs->batches++;
    return capture_routing(m, p->routing, what);
}

static vlmoe_eval_contrastive contrastive_mean(const contrastive_sum *cs, int B) {
    return (vlmoe_eval_contrastive){
        .loss = cs->pairs ? cs->loss / cs->pairs : 0, .accuracy = cs->pairs ? cs->acc / cs->pairs : 0,
        .pairs = cs->pairs, .batches = cs->batches, .batch_size = B,
    };
}

// Rows idx (n) of features x (., E) and labels y, packed into ox and oy.
static void gather(const float *x, const int32_t *y, const int32_t *idx, int n, int E, float *ox, int32_t *oy) {
    for (int i = 0; i < n; i++) {
        memcpy(ox + (size_t)i * E, x + (size_t)idx[i] * E, sizeof(float) * E);
        oy[i] = y[idx[i]];
    }
}

// ---------------------------------------------------------------------------------------------
// The synthetic held-out split

// Image embeddings and labels of n held-out samples starting at `first`; img/tok/lens are scratch.
static int embed_synth(vlmoe_model *m, const vlmoe_synth *s, uint64_t first, int n, float *img, int32_t *tok,
                       int32_t *lens, float *out, int32_t *labels) {
    const int C = vlmoe_synth_num_classes(s);
    int st = vlmoe_synth_batch(s, VLMOE_SPLIT_HELDOUT, first, n, vlmoe_model_get_config(m)->context_length, img, tok,
                               lens);
    for (int i = 0; i < n; i++) labels[i] = (int32_t)((first + (uint64_t)i) % (uint64_t)C);
    return st ? st : vlmoe_model_encode_images(m, img, n, out);
}

int vlmoe_eval_synthetic(vlmoe_model *m, const vlmoe_synth *s, int n, const vlmoe_eval_params *p,
                         vlmoe_eval_synth_result *r) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, T = c->context_length, C = vlmoe_synth_num_classes(s);
    const int shots = p->shots, B = p->batch_size, pool = shots ? 3 * shots * C : 0, nval = shots ? 5 * C : 0;
    const int nmax = n > pool + nval ? n : pool + nval, ntr = n > shots * C ? n : shots * C;
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    memset(r, 0, sizeof(*r));
    r->samples = n;
    if (check_params(p, 0, "vlmoe_eval_synthetic")) return VLMOE_ERR_ARG;
    if (n < 2) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_eval_synthetic: %d samples, expected >= 2", n);
    float *img = malloc(sizeof(float) * isz * nmax), *ce = malloc(sizeof(float) * (size_t)C * E);
    float *ie = malloc(sizeof(float) * (size_t)(n + pool + nval) * E), *te = malloc(sizeof(float) * (size_t)ntr * E);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)nmax * T), *lens = malloc(sizeof(int32_t) * nmax);
    int32_t *labels = malloc(sizeof(int32_t) * (size_t)(n + pool + nval)), *txt_image = malloc(sizeof(int32_t) * ntr);
    int st = img && ce && ie && te && tok && lens && labels && txt_image
                 ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "evaluation buffers");
    if (!st && vlmoe_synth_vocab_size(s) > c->vocab_size)
        st = vlmoe_fail(VLMOE_ERR_ARG, "the model's vocabulary is too small for the synthetic data");
    // zero-shot and retrieval on held-out samples [0, n) (class-balanced: class = index % C)
    for (int i = 0; i < n && !st; i++) txt_image[i] = i;
    if (!st) st = embed_synth(m, s, 0, n, img, tok, lens, ie, labels);
    if (!st) st = vlmoe_model_encode_texts(m, tok, lens, n, te);
    if (!st) st = vlmoe_synth_class_embeddings(m, s, ce);
    if (!st) {
        vlmoe_eval_zeroshot *z = &r->zeroshot;
        vlmoe_zeroshot_accuracy(ie, n, ce, C, E, labels, &z->top1, &z->top5);
        z->classes = C, z->templates = vlmoe_synth_num_templates(s), z->images = n;
        r->retrieval.images = r->retrieval.captions = n;
        st = vlmoe_retrieval_recall(ie, n, te, n, txt_image, E, vlmoe_eval_ks, VLMOE_EVAL_NUM_K, r->retrieval.i2t,
                                    r->retrieval.t2i);
        vlmoe_pair_accuracy(ie, te, n, E, B, &r->pair_i2t, &r->pair_t2i);
    }
    // contrastive loss and accuracy in batches of B, the routing of the first batch
    contrastive_sum cs = {0};
    char what[64];
    snprintf(what, sizeof(what), "one held-out batch of %d pairs", B);
    for (int k = 0; k < n / B && !st; k++) {
        // the held-out pairs again, seen as training sees them: both modalities in one pass
        st = vlmoe_synth_batch(s, VLMOE_SPLIT_HELDOUT, (uint64_t)k * B, B, T, img, tok, lens);
        const vlmoe_batch bt = {B, img, tok, lens};
        if (!st) st = contrastive_batch(m, &bt, &cs, p, what);
    }
    r->contrastive = contrastive_mean(&cs, B);
    // K-shot probe: train pool and validation from held-out indices far from the test set [0, n)
    if (shots > 0 && !st) {
        float *px = ie + (size_t)n * E, *vx = px + (size_t)pool * E, *tx = te;   // te is free again
        int32_t *py = labels + n, *vy = py + pool, *idx = txt_image, *ty = tok;
        r->fewshot.shots = shots;
        st = embed_synth(m, s, 1000000, pool, img, tok, lens, px, py);
        if (!st) st = embed_synth(m, s, 2000000, nval, img, tok, lens, vx, vy);
        if (!st) st = vlmoe_fewshot_sample(py, pool, C, shots, p->seed, idx);
        if (!st) {
            gather(px, py, idx, shots * C, E, tx, ty);
            st = vlmoe_fewshot_ridge(tx, ty, shots * C, ie, labels, n, E, C, LAMBDAS, NUM_LAMBDAS, vx, vy, nval,
                                     &r->fewshot.accuracy, &r->fewshot.lambda);
        }
        if (st) vlmoe_error_prefix("few-shot");
    }
    free(img), free(ce), free(ie), free(te), free(tok), free(lens), free(labels), free(txt_image);
    return st;
}

// ---------------------------------------------------------------------------------------------
// An image folder: zero-shot classification and the K-shot probe

typedef struct {
    vlmoe_model *m;
    const vlmoe_eval_params *p;
    const char *name;
    int st;
} folder_batch;

// The routing of the folder's first batch.
static void folder_routing(void *u, int k) {
    folder_batch *fb = u;
    char what[320];
    snprintf(what, sizeof(what), "the first batch of %d images of %s", k, fb->name);
    if (!fb->st) fb->st = capture_routing(fb->m, fb->p->routing, what);
}

void vlmoe_eval_folder_result_free(vlmoe_eval_folder_result *r) {
    free(r->features), free(r->labels);
    r->features = NULL, r->labels = NULL;
}

double vlmoe_mean_per_class_recall(const float *img, int n, const float *classes, int C, int E, const int32_t *labels) {
    long *hit = calloc((size_t)C * 2, sizeof(long)), *cnt = hit ? hit + C : NULL;
    if (!hit) return NAN;
    for (int i = 0; i < n; i++) {
        const float *x = img + (size_t)i * E;
        int best = 0;
        double bs = -INFINITY;
        for (int c = 0; c < C; c++) { // argmax, ties to the lower class (as vlmoe_zeroshot_accuracy)
            double dot = 0;
            for (int e = 0; e < E; e++) dot += (double)x[e] * classes[(size_t)c * E + e];
            if (dot > bs) bs = dot, best = c;
        }
        cnt[labels[i]]++, hit[labels[i]] += best == labels[i];
    }
    double sum = 0;
    int present = 0;
    for (int c = 0; c < C; c++)
        if (cnt[c]) sum += (double)hit[c] / cnt[c], present++;
    free(hit);
    return present ? sum / present : 0;
}

int vlmoe_eval_folder_zeroshot(vlmoe_model *m, const vlmoe_eval_folder_data *d, const vlmoe_eval_params *p,
                               vlmoe_eval_folder_result *r) {
    const vlmoe_image_folder *f = d->folder;
    const int C = f->n_classes, E = vlmoe_model_get_config(m)->embed_dim;
    memset(r, 0, sizeof(*r));
    if (check_params(p, 1, "vlmoe_eval_folder_zeroshot")) return VLMOE_ERR_ARG;
    r->features = malloc(sizeof(float) * (size_t)(f->n ? f->n : 1) * E);
    r->labels = malloc(sizeof(int32_t) * (size_t)(f->n ? f->n : 1));
    float *ce = malloc(sizeof(float) * (size_t)C * E);
    uint8_t *ok = malloc((size_t)(f->n ? f->n : 1));
    int st = r->features && r->labels && ce && ok
                 ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory for %lld images", (long long)f->n);
    // image embeddings of every readable image, in batches
    folder_batch fb = {m, p, d->name, VLMOE_OK};
    const vlmoe_encode_files_params ep = {
        .ip = p->ip, .batch_size = p->batch_size, .what = "zero-shot images", .progress = p->progress,
        .progress_user = p->progress_user, .after_batch = p->routing ? folder_routing : NULL, .user = &fb,
    };
    int n = 0;
    if (!st) st = vlmoe_encode_image_files(m, (const char *const *)f->paths, (int)f->n, &ep, r->features, ok, &r->bad, &n);
    if (!st) st = fb.st;
    for (int64_t i = 0, k = 0; i < f->n && !st; i++)
        if (ok[i]) r->labels[k++] = f->labels[i];
    if (!st && !n)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "none of its %lld images could be read", (long long)f->n);
    if (!st) st = vlmoe_class_embeddings(m, d->classes, C, d->templates, d->n_templates, p->tokenize, p->tokenize_user, ce);
    if (!st) {
        vlmoe_eval_zeroshot *z = &r->zeroshot;
        vlmoe_zeroshot_accuracy(r->features, n, ce, C, E, r->labels, &z->top1, &z->top5);
        z->mean_per_class_recall = vlmoe_mean_per_class_recall(r->features, n, ce, C, E, r->labels);
        z->classes = C, z->templates = d->n_templates, z->images = n, z->bad_images = r->bad.n;
    }
    if (st) vlmoe_error_prefix("%s", d->name);
    free(ce), free(ok);
    return st;
}

int vlmoe_eval_folder_fewshot(vlmoe_model *m, const vlmoe_eval_folder_data *d, const vlmoe_eval_folder_result *zr,
                              const vlmoe_eval_params *p, vlmoe_eval_fewshot *out) {
    const float *x = zr->features;
    const int32_t *y = zr->labels;
    const int n = zr->zeroshot.images, C = d->folder->n_classes, E = vlmoe_model_get_config(m)->embed_dim, K = p->shots;
    memset(out, 0, sizeof(*out));
    out->shots = K;
    if (K < 1) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_eval_folder_fewshot: %d shots, expected >= 1", K);
    int32_t *cnt = calloc((size_t)C, sizeof(int32_t)), *idx = malloc(sizeof(int32_t) * (size_t)(n + K * C));
    float *fx = malloc(sizeof(float) * (size_t)n * E);
    int32_t *fy = malloc(sizeof(int32_t) * n);
    uint8_t *taken = calloc((size_t)n, 1);
    int st = cnt && idx && fx && fy && taken ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "few-shot buffers");
    for (int i = 0; i < n && !st; i++) cnt[y[i]]++;
    for (int c = 0; c < C && !st && !out->skipped[0]; c++)
        if (cnt[c] < K + 2)
            snprintf(out->skipped, sizeof(out->skipped), "class '%s' has %d readable images, the probe needs %d "
                     "(%d shots, 1 validation, 1 test)", d->classes[c], cnt[c], K + 2, K);
    if (!st && !out->skipped[0]) st = vlmoe_fewshot_sample(y, n, C, K, p->seed, idx);
    if (!st && !out->skipped[0]) {
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
        st = vlmoe_fewshot_ridge(tx, ty, K * C, sx, sy, nte, E, C, LAMBDAS, NUM_LAMBDAS, vx, vy, nva, &out->accuracy,
                                 &out->lambda);
    }
    if (st) vlmoe_error_prefix("%s", d->name);
    free(cnt), free(idx), free(fx), free(fy), free(taken);
    return st;
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

// Captions that are the same text after the tokenizer's normalisation, compared as their token ids
// (all the model sees of them; texts differing only past the context length count as the same):
// group[j] = the first row of j's text. ids (n, T), lens (n). A 64-bit hash collision between
// different ids would only leave them apart (pessimistic), never merge them.
static int caption_groups(const int32_t *ids, const int32_t *lens, int n, int T, int32_t *group) {
    image_key *k = malloc(sizeof(image_key) * (size_t)(n > 0 ? n : 1));
    if (!k) return vlmoe_fail(VLMOE_ERR_NOMEM, "caption groups");
    for (int j = 0; j < n; j++)
        k[j] = (image_key){fnv1a((const uint8_t *)(ids + (size_t)j * T), sizeof(int32_t) * (size_t)lens[j]),
                           (uint64_t)lens[j], j};
    qsort(k, (size_t)n, sizeof(image_key), cmp_key); // rows ascending within equal (hash, len)
    for (int i = 0, first = 0; i < n; i++) {
        if (i == 0 || k[i].hash != k[i - 1].hash || k[i].len != k[i - 1].len) first = i;
        const int32_t a = k[first].row, b = k[i].row;
        group[b] = !memcmp(ids + (size_t)a * T, ids + (size_t)b * T, sizeof(int32_t) * (size_t)lens[b]) ? a : b;
    }
    free(k);
    return VLMOE_OK;
}

int vlmoe_eval_pairs(vlmoe_model *m, vlmoe_dataset *ds, const char *name, const vlmoe_eval_params *p,
                     vlmoe_eval_pairs_result *r) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, T = c->context_length, S = c->image_size, B = p->batch_size;
    const size_t isz = (size_t)3 * S * S;
    memset(r, 0, sizeof(*r));
    if (check_params(p, 1, "vlmoe_eval_pairs")) return VLMOE_ERR_ARG;
    float *batch = malloc(sizeof(float) * isz * B), *ie = NULL, *te = NULL, *iu = NULL;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *lens = malloc(sizeof(int32_t) * B), *txt_image = NULL;
    int32_t *all_ids = NULL, *all_lens = NULL, *group = NULL; // every caption's ids, for duplicates
    image_key *keys = NULL;
    size_t cap_i = 0, cap_t = 0, cap_k = 0, cap_a = 0, cap_l = 0;
    vlmoe_image img = {.max_pixels = p->ip ? (size_t)p->ip->max_pixels : 0};
    contrastive_sum cs = {0};
    progress(p, "validation pairs", 0, -1);
    int st = batch && tok && lens ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "batch buffers");
    int n = 0, k = 0, done = 0;
    while (!st && !done) {
        vlmoe_sample s;
        // --val-num-samples: stop before reading pair max_pairs + 1
        const int got = p->max_pairs > 0 && n + k >= p->max_pairs ? 0 : vlmoe_dataset_next(ds, &s);
        if (got < 0) {
            st = got;
            break;
        }
        done = got == 0;
        if (!done) {
            if (vlmoe_image_decode(s.image, s.image_len, s.key, &img) ||
                vlmoe_image_preprocess_eval(&img, p->ip, batch + k * isz)) {
                vlmoe_skip_log_add(&r->bad, vlmoe_last_error());
                continue;
            }
            const int len = p->tokenize(p->tokenize_user, s.caption, tok + (size_t)k * T, T);
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
            snprintf(what, sizeof(what), "the first batch of %d pairs of %s", k, name);
            if (k >= 2) st = contrastive_batch(m, &bt, &cs, p, what);
            if (!st) st = grow(&ie, &cap_i, (size_t)n + k, sizeof(float) * E);
            if (!st) st = grow(&te, &cap_t, (size_t)n + k, sizeof(float) * E);
            if (!st) st = vlmoe_model_encode_images(m, batch, k, ie + (size_t)n * E);
            if (!st) st = vlmoe_model_encode_texts(m, tok, lens, k, te + (size_t)n * E);
            if (!st) st = grow(&all_ids, &cap_a, (size_t)n + k, sizeof(int32_t) * T);
            if (!st) st = grow(&all_lens, &cap_l, (size_t)n + k, sizeof(int32_t));
            if (!st) {
                memcpy(all_ids + (size_t)n * T, tok, sizeof(int32_t) * (size_t)k * T);
                memcpy(all_lens + n, lens, sizeof(int32_t) * (size_t)k);
            }
            n += k, k = 0;
            progress(p, "validation pairs", n, -1);
        }
    }
    if (!st && n < 2)
        st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %d usable image-caption pairs, expected at least 2", name, n);
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
    vlmoe_eval_retrieval *rt = &r->retrieval;
    group = malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    if (!st && !group) st = vlmoe_fail(VLMOE_ERR_NOMEM, "caption groups");
    if (!st) st = caption_groups(all_ids, all_lens, n, T, group);
    for (int j = 0; !st && j < n; j++) rt->duplicate_captions += group[j] != j;
    const vlmoe_retrieval_data rd = {.img = iu, .n_img = n_img, .txt = te, .n_txt = n, .E = E, .txt_image = txt_image,
                                     .txt_group = group, .ks = vlmoe_eval_ks, .nk = VLMOE_EVAL_NUM_K};
    if (!st) st = vlmoe_retrieval_metrics(&rd, rt->i2t, rt->t2i, rt->mean_rank, rt->median_rank);
    rt->has_ranks = !st;
    rt->images = n_img, rt->captions = n;
    rt->bad_samples = (long)vlmoe_dataset_stats_bad(vlmoe_dataset_get_stats(ds)) + r->bad.n;
    r->contrastive = contrastive_mean(&cs, B);
    if (st) vlmoe_error_prefix("%s", name);
    vlmoe_image_free(&img);
    free(batch), free(ie), free(te), free(iu), free(tok), free(lens), free(txt_image), free(keys);
    free(all_ids), free(all_lens), free(group);
    return st;
}
