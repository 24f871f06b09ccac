// finetune_task.c: VL-MoE fine-tuning (VL-MoE sec. 4.2) as a task of the loop in src/train/run.c:
// the data of the four tasks (image folder, text TSV, image-question TSV or NLVR2's two images and
// a sentence, image-caption pairs), classes numbered in sorted label order, every holdout-th
// example held out, batches in the data order of src/data/order.c, a classification or a
// contrastive step (plus ITM with hard negatives when the model has itm_head), and the accuracy /
// recall report (optionally ITM re-ranked). The heads are vlmoe_mome_with_heads
// (src/nn/mome_model.c). Covered by tests/test_finetune.c.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/order.h"
#include "train/tasks.h"

struct vlmoe_ft_data {
    vlmoe_ft_kind kind;
    int n, per, classes, enc; // n examples of `per` sequences (2: NLVR2's two pairs of one sentence)
    char **label_of;    // (n) label text of each example (until classes are numbered); NULL: retrieval
    char **names;       // (classes) sorted distinct labels
    int32_t *labels;    // (n)
    char **paths;       // (n*per) image files, or NULL
    char **texts;       // (n*per) texts / questions, or NULL
    float *images;      // (n*per, C, S, S) or NULL
    int32_t *tokens, *lens; // (n*per, ctx), (n*per) or NULL
    size_t isz, T;      // floats per image, tokens per text
    int *idx, ntrain, nheld; // training examples, then the held-out ones
    long bad;
    char first_bad[320];
};

void vlmoe_ft_data_free(vlmoe_ft_data *d) {
    if (!d) return;
    const int ns = d->n * d->per;
    vlmoe_free_strings(d->label_of, d->label_of ? d->n : 0);
    vlmoe_free_strings(d->paths, d->paths ? ns : 0);
    vlmoe_free_strings(d->texts, d->texts ? ns : 0);
    free(d->names);
    free(d->labels), free(d->images), free(d->tokens), free(d->lens), free(d->idx);
    free(d);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// Numbers the classes: names = sorted distinct label_of, labels = their indices.
static int number_classes(vlmoe_ft_data *d) {
    d->names = malloc(sizeof(char *) * (size_t)d->n);
    d->labels = malloc(sizeof(int32_t) * (size_t)d->n);
    if (!d->names || !d->labels) return vlmoe_fail(VLMOE_ERR_NOMEM, "class labels");
    memcpy(d->names, d->label_of, sizeof(char *) * (size_t)d->n);
    qsort(d->names, (size_t)d->n, sizeof(char *), cmp_str);
    int k = 0;
    for (int i = 0; i < d->n; i++)
        if (!k || strcmp(d->names[k - 1], d->names[i])) d->names[k++] = d->names[i];
    d->classes = k;
    for (int i = 0; i < d->n; i++) {
        char **hit = bsearch(&d->label_of[i], d->names, (size_t)k, sizeof(char *), cmp_str);
        d->labels[i] = (int32_t)(hit - d->names);
    }
    if (k < 2)
        return vlmoe_fail(VLMOE_ERR_ARG, "the data holds %d class%s: fine-tuning a classifier needs at least 2", k,
                          k == 1 ? "" : "es");
    return VLMOE_OK;
}

static int grow(vlmoe_ft_data *d, int *cap, int images) {
    if (d->n < *cap) return VLMOE_OK;
    *cap = *cap ? 2 * *cap : 64;
    const size_t ns = (size_t)*cap * d->per;
    char **l = realloc(d->label_of, sizeof(char *) * (size_t)*cap), **p = NULL, **t = NULL;
    if (l) d->label_of = l;
    if (l && images && (p = realloc(d->paths, sizeof(char *) * ns))) d->paths = p;
    if (l && (t = realloc(d->texts, sizeof(char *) * ns))) d->texts = t;
    return !l || !t || (images && !p) ? vlmoe_fail(VLMOE_ERR_NOMEM, "examples") : VLMOE_OK;
}

// Splits a line at its tabs into at most 4 columns; returns how many columns the line has.
static int split_tabs(char *line, char **col) {
    int k = 1;
    col[0] = line;
    for (char *c = line; *c; c++)
        if (*c == '\t') {
            *c = 0;
            if (k < 4) col[k] = c + 1;
            k++;
        }
    return k;
}

static const char *tsv_columns(int cols) {
    return cols == 2 ? "text, label" : cols == 3 ? "image path, question, answer"
                                                 : "image 1, image 2, sentence, label";
}

// A TSV of text<TAB>label (text-cls), image<TAB>question<TAB>answer (pair-cls, VQA) or
// image1<TAB>image2<TAB>sentence<TAB>label (pair-cls, NLVR2: the first line decides); image paths
// relative to the TSV's folder; empty lines skipped.
static int read_tsv(const char *path, int text_only, vlmoe_ft_data *d) {
    const char *why = NULL;
    FILE *f = vlmoe_fopen_regular(path, &why);
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open the data file: %s", path, why);
    const char *slash = strrchr(path, '/');
    const int dirlen = slash ? (int)(slash - path) + 1 : 0;
    char *line = NULL;
    size_t cap = 0;
    int st = VLMOE_OK, lineno = 0, n_cap = 0, cols = text_only ? 2 : 0;
    while (!st && getline(&line, &cap, f) >= 0) {
        lineno++;
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0]) continue;
        char *col[4] = {NULL};
        const int k = split_tabs(line, col);
        if (!cols) {
            if (k != 3 && k != 4) {
                st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s:%d: expected 3 tab-separated columns (%s) or 4 (NLVR2: %s), found %d",
                                path, lineno, tsv_columns(3), tsv_columns(4), k);
                break;
            }
            cols = k, d->per = k == 4 ? 2 : 1;
        }
        int empty = 0;
        for (int j = 0; j < cols && k == cols; j++) empty += !col[j][0];
        if (k != cols || empty)
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s:%d: expected %d non-empty tab-separated columns (%s), found %d%s", path,
                            lineno, cols, tsv_columns(cols), k, empty ? " with an empty one" : "");
        else
            st = grow(d, &n_cap, cols > 2);
        if (st) break;
        const size_t s0 = (size_t)d->n * d->per;
        d->label_of[d->n] = strdup(col[cols - 1]);
        int oom = !d->label_of[d->n];
        for (int j = 0; j < d->per; j++) {
            d->texts[s0 + j] = strdup(col[cols - 2]); // NLVR2: the sentence goes with both images
            oom |= !d->texts[s0 + j];
            if (cols == 2) continue;
            const size_t len = strlen(col[j]) + (size_t)dirlen + 1;
            char *img = malloc(len);
            if (img) snprintf(img, len, "%.*s%s", col[j][0] == '/' ? 0 : dirlen, path, col[j]);
            d->paths[s0 + j] = img;
            oom |= !img;
        }
        d->n++;
        if (oom) st = vlmoe_fail(VLMOE_ERR_NOMEM, "examples of %s", path);
    }
    free(line);
    fclose(f);
    if (!st && !d->n) st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no examples", path);
    return st;
}

// An image folder: the class of an image is the first folder below `dir` holding it.
static int read_folder(const char *dir, vlmoe_ft_data *d) {
    const char *args[1] = {dir};
    int st = vlmoe_list_images(args, 1, &d->paths, &d->n);
    if (st) return st;
    d->label_of = calloc((size_t)d->n, sizeof(char *));
    if (!d->label_of) return vlmoe_fail(VLMOE_ERR_NOMEM, "examples of %s", dir);
    const size_t dl = strlen(dir);
    for (int i = 0; i < d->n; i++) {
        const char *rel = d->paths[i] + dl;
        while (*rel == '/') rel++;
        const char *end = strchr(rel, '/');
        if (strncmp(d->paths[i], dir, dl) || !end)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: image not inside a class folder of %s (expected %s/CLASS/FILE)",
                              d->paths[i], dir, dir);
        if (!(d->label_of[i] = strndup(rel, (size_t)(end - rel)))) return vlmoe_fail(VLMOE_ERR_NOMEM, "class names");
    }
    return VLMOE_OK;
}

// Image-caption pairs for retrieval or captioning (OpenCLIP CSV/TSV or webdataset shards), decoded
// and tokenized as they are read (captioning keeps the caption too: CIDEr-D's reference); pairs
// whose image does not decode are skipped and counted.
static int read_pairs(const vlmoe_ft_data_params *p, vlmoe_ft_data *d) {
    vlmoe_dataset *ds = NULL;
    int st = vlmoe_dataset_open(&p->data, &ds), cap = 0;
    if (st) return vlmoe_error_prefix("--data"), st;
    vlmoe_image im = {.max_pixels = (size_t)p->image.max_pixels};
    while (!st) {
        vlmoe_sample s;
        const int r = vlmoe_dataset_next(ds, &s);
        if (r < 0) st = -r, vlmoe_error_prefix("%s", p->data.path);
        if (r <= 0) break;
        if (d->n == cap) {
            cap = cap ? 2 * cap : 256;
            float *ni = realloc(d->images, sizeof(float) * d->isz * (size_t)cap);
            if (ni) d->images = ni;
            int32_t *nt = realloc(d->tokens, sizeof(int32_t) * d->T * (size_t)cap);
            if (nt) d->tokens = nt;
            int32_t *nl = nt ? realloc(d->lens, sizeof(int32_t) * (size_t)cap) : NULL;
            if (nl) d->lens = nl;
            char **tx = p->kind == VLMOE_FT_CAPTION ? realloc(d->texts, sizeof(char *) * (size_t)cap) : d->texts;
            if (tx) d->texts = tx;
            if (!ni || !nt || !nl || (p->kind == VLMOE_FT_CAPTION && !tx)) {
                st = vlmoe_fail(VLMOE_ERR_NOMEM, "image-caption pairs");
                break;
            }
        }
        if (vlmoe_image_decode(s.image, s.image_len, s.key, &im) ||
            vlmoe_image_preprocess_eval(&im, &p->image, d->images + d->isz * (size_t)d->n)) {
            if (!d->bad++) snprintf(d->first_bad, sizeof(d->first_bad), "%s", vlmoe_last_error());
            continue;
        }
        if ((d->lens[d->n] = p->tokenize(p->tokenize_user, s.caption, d->tokens + d->T * (size_t)d->n, (int)d->T)) < 2) {
            st = vlmoe_fail(VLMOE_ERR_ARG, "%s: cannot tokenize the caption \"%s\": %s", s.key, s.caption,
                            vlmoe_last_error());
            break;
        }
        if (d->texts && !(d->texts[d->n] = strdup(s.caption))) {
            st = vlmoe_fail(VLMOE_ERR_NOMEM, "captions");
            break;
        }
        d->n++;
        if (p->progress) p->progress(p->progress_user, d->n);
    }
    vlmoe_image_free(&im);
    vlmoe_dataset_free(ds);
    if (!st && d->n < 2)
        st = vlmoe_fail(VLMOE_ERR_ARG, "%s: %d usable image-caption pairs; %s needs at least 2", p->data.path, d->n,
                        p->kind == VLMOE_FT_CAPTION ? "captioning" : "retrieval");
    return st;
}

// Decodes and preprocesses the images, tokenizes the texts (retrieval data arrives ready).
static int prepare(const vlmoe_ft_data_params *p, vlmoe_ft_data *d) {
    const int ns = d->n * d->per;
    if (d->paths && !d->images) {
        if (!(d->images = malloc(sizeof(float) * d->isz * (size_t)ns))) return vlmoe_fail(VLMOE_ERR_NOMEM, "images");
        for (int i = 0; i < ns; i++) {
            vlmoe_image im = {.max_pixels = (size_t)p->image.max_pixels};
            int st = vlmoe_image_load(d->paths[i], &im);
            if (!st) st = vlmoe_image_preprocess_eval(&im, &p->image, d->images + d->isz * (size_t)i);
            vlmoe_image_free(&im);
            if (st) return st;
        }
    }
    if (d->texts && !d->tokens) {
        d->tokens = malloc(sizeof(int32_t) * d->T * (size_t)ns);
        d->lens = malloc(sizeof(int32_t) * (size_t)ns);
        if (!d->tokens || !d->lens) return vlmoe_fail(VLMOE_ERR_NOMEM, "texts");
        for (int i = 0; i < ns; i++)
            if ((d->lens[i] = p->tokenize(p->tokenize_user, d->texts[i], d->tokens + (size_t)i * d->T, (int)d->T)) < 2)
                return vlmoe_fail(VLMOE_ERR_ARG, "cannot tokenize \"%s\": %s", d->texts[i], vlmoe_last_error());
    }
    return VLMOE_OK;
}

int vlmoe_ft_data_load(vlmoe_ft_data **out, const vlmoe_ft_data_params *p, const vlmoe_model_config *c) {
    *out = NULL;
    if (!p->data.path || !p->tokenize || p->holdout < 0 || p->holdout == 1 || (int)p->kind < 0 || p->kind > VLMOE_FT_CAPTION)
        return vlmoe_fail(VLMOE_ERR_ARG, "fine-tuning data: a path, a tokenizer, holdout 0 or >= 2 and a known task");
    vlmoe_ft_data *d = calloc(1, sizeof(*d));
    if (!d) return vlmoe_fail(VLMOE_ERR_NOMEM, "fine-tuning data");
    d->kind = p->kind, d->per = 1;
    d->enc = p->kind == VLMOE_FT_RETRIEVAL ? VLMOE_ENC_IMAGE : (int)p->kind; // VLMOE_ENC_* of the head's input
    if (p->kind == VLMOE_FT_CAPTION) d->enc = VLMOE_ENC_CAPTION;
    const int pairs = p->kind == VLMOE_FT_RETRIEVAL || p->kind == VLMOE_FT_CAPTION;
    d->isz = (size_t)c->channels * c->image_size * c->image_size, d->T = (size_t)c->context_length;
    const char *path = p->data.path;
    int st = p->kind == VLMOE_FT_IMAGE_CLS ? read_folder(path, d)
           : pairs ? read_pairs(p, d)
                   : read_tsv(path, p->kind == VLMOE_FT_TEXT_CLS, d);
    if (!st && !pairs) st = number_classes(d);
    if (!st) st = prepare(p, d);
    // the split: training examples first, then the held-out ones
    if (!st && !(d->idx = malloc(sizeof(int) * (size_t)d->n))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "the split");
    for (int i = 0; !st && i < d->n; i++)
        if (!p->holdout || i % p->holdout != p->holdout - 1) d->idx[d->ntrain++] = i;
    for (int i = 0; !st && i < d->n; i++)
        if (p->holdout && i % p->holdout == p->holdout - 1) d->idx[d->ntrain + d->nheld++] = i;
    if (!st && d->ntrain < (pairs ? 2 : 1))
        st = vlmoe_fail(VLMOE_ERR_ARG, "%d training examples left after --holdout %d: too few", d->ntrain, p->holdout);
    if (st) return vlmoe_ft_data_free(d), st;
    *out = d;
    return VLMOE_OK;
}

void vlmoe_ft_data_info(const vlmoe_ft_data *d, vlmoe_ft_info *out) {
    memset(out, 0, sizeof(*out));
    out->examples = d->n, out->per = d->per, out->classes = d->classes;
    out->train = d->ntrain, out->held = d->nheld, out->bad_images = d->bad;
    snprintf(out->first_bad, sizeof(out->first_bad), "%s", d->first_bad);
}

int vlmoe_ft_write_labels(const vlmoe_ft_data *d, const char *output) {
    char path[4096];
    snprintf(path, sizeof(path), "%s.labels", output);
    FILE *f = fopen(path, "w");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write the class names: %s", path, strerror(errno));
    int ok = 1;
    for (int k = 0; k < d->classes && ok; k++) ok = fprintf(f, "%s\n", d->names[k]) >= 0;
    ok = fflush(f) == 0 && ok;
    const int e = errno;
    ok = fclose(f) == 0 && ok;
    return ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write the class names: %s", path, strerror(e ? e : EIO));
}

// Batch buffers for B examples: images (B*per, C,S,S), tokens (B*per, ctx) and lens, labels (B).
typedef struct {
    float *img;
    int32_t *tok, *lens, *lab;
} ft_batch;

static void batch_free(ft_batch *b) { free(b->img), free(b->tok), free(b->lens), free(b->lab); }

static int batch_alloc(ft_batch *b, const vlmoe_ft_data *d, int B) {
    const size_t ns = (size_t)B * d->per;
    memset(b, 0, sizeof(*b));
    b->img = d->images ? malloc(sizeof(float) * d->isz * ns) : NULL;
    b->tok = d->tokens ? malloc(sizeof(int32_t) * d->T * ns) : NULL;
    b->lens = d->tokens ? malloc(sizeof(int32_t) * ns) : NULL;
    b->lab = malloc(sizeof(int32_t) * (size_t)B);
    if ((d->images && !b->img) || (d->tokens && (!b->tok || !b->lens)) || !b->lab)
        return batch_free(b), vlmoe_fail(VLMOE_ERR_NOMEM, "a batch of %d examples", B);
    return VLMOE_OK;
}

// Copies example idx[j] of d (its per sequences) into slot j of the batch.
static void gather_batch(const vlmoe_ft_data *d, const int *idx, int B, ft_batch *b) {
    for (int j = 0; j < B; j++)
        for (int h = 0; h < d->per; h++) {
            const size_t i = (size_t)idx[j] * d->per + h, o = (size_t)j * d->per + h;
            if (b->img) memcpy(b->img + d->isz * o, d->images + d->isz * i, sizeof(float) * d->isz);
            if (b->tok) memcpy(b->tok + d->T * o, d->tokens + d->T * i, sizeof(int32_t) * d->T), b->lens[o] = d->lens[i];
            b->lab[j] = d->labels ? d->labels[idx[j]] : 0;
        }
}

// ---- the task
struct vlmoe_finetune {
    vlmoe_model *m;
    const vlmoe_ft_data *d;
    int B;
    vlmoe_order order;       // over the training examples
    int *pick;               // (B) this step's examples
    ft_batch b;
    vlmoe_mome_stats ps;     // of the last step
    int itm;                 // retrieval with the model's ITM head: hard negatives drawn from seed
    double caption_prob;     // captioning: the fraction of a caption's tokens masked
    int32_t *cin, *clab;     // captioning: (B, ctx) masked input and labels of the step
    uint64_t seed;
};

int vlmoe_finetune_init(vlmoe_finetune **out, vlmoe_model *m, const vlmoe_ft_data *d, int batch, uint64_t seed) {
    *out = NULL;
    if (batch < (d->kind == VLMOE_FT_RETRIEVAL ? 2 : 1))
        return vlmoe_fail(VLMOE_ERR_ARG, "--batch-size %d: the contrastive loss needs >= 2", batch);
    vlmoe_finetune *f = calloc(1, sizeof(*f));
    if (!f) return vlmoe_fail(VLMOE_ERR_NOMEM, "fine-tuning");
    f->m = m, f->d = d, f->B = batch < d->ntrain ? batch : d->ntrain;
    f->itm = d->kind == VLMOE_FT_RETRIEVAL && vlmoe_model_get_config(m)->itm_head, f->seed = seed;
    f->caption_prob = 0.6;
    int st = vlmoe_order_init(&f->order, (size_t)d->ntrain, seed, 0x66696e65ull /* "fine" */, 0, 1);
    if (!st && !(f->pick = malloc(sizeof(int) * (size_t)f->B))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "fine-tuning");
    if (!st) st = batch_alloc(&f->b, d, f->B);
    if (!st && d->kind == VLMOE_FT_CAPTION &&
        (!(f->cin = malloc(sizeof(int32_t) * d->T * (size_t)f->B)) || !(f->clab = malloc(sizeof(int32_t) * d->T * (size_t)f->B))))
        st = vlmoe_fail(VLMOE_ERR_NOMEM, "caption masks");
    if (st) return vlmoe_finetune_free(f), st;
    *out = f;
    return VLMOE_OK;
}

void vlmoe_finetune_free(vlmoe_finetune *f) {
    if (!f) return;
    vlmoe_order_free(&f->order);
    batch_free(&f->b);
    free(f->pick), free(f->cin), free(f->clab);
    free(f);
}

int vlmoe_finetune_set_caption_mask(vlmoe_finetune *f, double prob) {
    if (!(prob > 0 && prob <= 1)) return vlmoe_fail(VLMOE_ERR_ARG, "caption mask fraction %g: expected (0, 1]", prob);
    f->caption_prob = prob;
    return VLMOE_OK;
}

// BEiT-3's captioning step: masked language modeling of the caption pairs under the captioning
// attention (the image both ways, the text causally), the masks drawn per step.
static int caption_step(vlmoe_finetune *f, vlmoe_trainer *t, long step, vlmoe_step_stats *s) {
    const vlmoe_model_config *c = vlmoe_model_get_config(f->m);
    vlmoe_mlm_params mp = vlmoe_mlm_default_params(c);
    mp.prob = f->caption_prob;
    int st = vlmoe_caption_mask(&mp, f->seed * 0x9e3779b97f4a7c15ULL + (uint64_t)step, f->b.tok, f->b.lens, f->B,
                                (int)f->d->T, f->cin, f->clab);
    if (st) return st;
    const vlmoe_mome_batch mb = {.encoding = VLMOE_ENC_CAPTION, .batch_size = f->B, .images = f->b.img,
                                 .tokens = f->cin, .lengths = f->b.lens, .text_labels = f->clab};
    return vlmoe_trainer_step_mome(t, &mb, 1, &f->ps, s);
}

static int f_fill(void *u, long step) {
    vlmoe_finetune *f = u;
    for (int j = 0; j < f->B; j++) f->pick[j] = f->d->idx[vlmoe_order_local(&f->order, (uint64_t)step, f->B, j)];
    gather_batch(f->d, f->pick, f->B, &f->b);
    return VLMOE_OK;
}

static int f_step(void *u, vlmoe_trainer *t, long step, vlmoe_step_stats *s) {
    vlmoe_finetune *f = u;
    if (f->itm) {
        const vlmoe_mome_batch rb = {.encoding = VLMOE_ENC_PAIR, .batch_size = f->B, .images = f->b.img,
                                     .tokens = f->b.tok, .lengths = f->b.lens};
        return vlmoe_trainer_step_mome_itm(t, &rb, f->seed, &f->ps, s);
    }
    if (f->d->kind == VLMOE_FT_CAPTION) return caption_step(f, t, step, s);
    if (f->d->kind == VLMOE_FT_RETRIEVAL)
        return vlmoe_trainer_step_mome_retrieval(t, f->b.img, f->b.tok, f->b.lens, f->B, &f->ps, s);
    const vlmoe_mome_batch mb = {(vlmoe_encoding)f->d->enc, f->B * f->d->per, f->b.img, f->b.tok, f->b.lens, NULL, NULL,
                                 f->b.lab};
    return vlmoe_trainer_step_mome(t, &mb, 1, &f->ps, s);
}

static int f_log(void *u, long done, const vlmoe_step_stats *s, cJSON *rec, char *line, size_t cap) {
    vlmoe_finetune *f = u;
    if (f->d->kind == VLMOE_FT_CAPTION) {
        cJSON_AddNumberToObject(rec, "mlm_loss", f->ps.text);
        cJSON_AddNumberToObject(rec, "mlm_acc", f->ps.text_acc);
        snprintf(line, cap, "  caption MLM %.4f  masked-token accuracy %.3f", f->ps.text, f->ps.text_acc);
    } else if (f->d->kind == VLMOE_FT_RETRIEVAL) {
        cJSON_AddNumberToObject(rec, "contrastive_loss", f->ps.itc);
        cJSON_AddNumberToObject(rec, "acc_i2t", f->ps.itc_acc[0]);
        cJSON_AddNumberToObject(rec, "acc_t2i", f->ps.itc_acc[1]);
        snprintf(line, cap, "  contrastive %.4f  batch accuracy i2t %.3f t2i %.3f", f->ps.itc, f->ps.itc_acc[0],
                 f->ps.itc_acc[1]);
        if (f->itm) {
            cJSON_AddNumberToObject(rec, "itm_loss", f->ps.itm);
            cJSON_AddNumberToObject(rec, "itm_acc", f->ps.itm_acc);
            const size_t k = strlen(line);
            snprintf(line + k, cap - k, "  itm %.4f (accuracy %.3f)", f->ps.itm, f->ps.itm_acc);
        }
    } else {
        cJSON_AddNumberToObject(rec, "cls_loss", f->ps.cls);
        cJSON_AddNumberToObject(rec, "cls_acc", f->ps.cls_acc);
        snprintf(line, cap, "  cls %.4f  batch accuracy %.3f", f->ps.cls, f->ps.cls_acc);
    }
    return VLMOE_OK;
}

vlmoe_run_task vlmoe_finetune_task(vlmoe_finetune *f) {
    vlmoe_run_task t = {f, f_fill, f_step, f_log, NULL, NULL};
    return t;
}

// Top-1 accuracy over the n examples idx (argmax of the scores, ties to the lower class).
static int accuracy(vlmoe_model *m, const vlmoe_ft_data *d, const int *idx, int n, double *acc) {
    ft_batch b;
    float *s = malloc(sizeof(float) * (size_t)n * d->classes);
    int st = s ? batch_alloc(&b, d, n) : vlmoe_fail(VLMOE_ERR_NOMEM, "scores");
    if (st) return free(s), st;
    gather_batch(d, idx, n, &b);
    st = vlmoe_mome_logits(m, (vlmoe_encoding)d->enc, b.img, b.tok, b.lens, n * d->per, s);
    int right = 0;
    for (int i = 0; i < n && !st; i++) {
        int arg = 0;
        for (int k = 1; k < d->classes; k++)
            if (s[(size_t)i * d->classes + k] > s[(size_t)i * d->classes + arg]) arg = k;
        right += arg == b.lab[i];
    }
    *acc = (double)right / n;
    free(s);
    batch_free(&b);
    return st;
}

// Retrieval recall@1/5/10 both ways over the n pairs idx (each row its own image); rerank > 0:
// each query's top rerank candidates re-ordered by the ITM score (vlmoe_mome_itm_recall).
static int recall(vlmoe_model *m, const vlmoe_ft_data *d, const int *idx, int n, int rerank, double *i2t, double *t2i) {
    const int E = vlmoe_model_get_config(m)->embed_dim, ks[3] = {1, 5, 10};
    ft_batch b;
    float *ie = malloc(sizeof(float) * (size_t)n * E), *te = malloc(sizeof(float) * (size_t)n * E);
    int32_t *own = malloc(sizeof(int32_t) * (size_t)n);
    int st = ie && te && own ? batch_alloc(&b, d, n) : vlmoe_fail(VLMOE_ERR_NOMEM, "embeddings");
    if (!st) {
        for (int i = 0; i < n; i++) own[i] = i;
        gather_batch(d, idx, n, &b);
        st = vlmoe_mome_embed(m, VLMOE_ENC_IMAGE, b.img, NULL, NULL, n, ie);
        if (!st) st = vlmoe_mome_embed(m, VLMOE_ENC_TEXT, NULL, b.tok, b.lens, n, te);
        if (!st && rerank > 0)
            st = vlmoe_mome_itm_recall(m, b.img, b.tok, b.lens, ie, te, n, rerank, ks, 3, i2t, t2i);
        else if (!st)
            st = vlmoe_retrieval_recall(ie, n, te, n, own, E, ks, 3, i2t, t2i);
        batch_free(&b);
    }
    free(ie), free(te), free(own);
    return st;
}

int vlmoe_ft_evaluate(vlmoe_model *m, const vlmoe_ft_data *d, int held_out, vlmoe_ft_score *out) {
    return vlmoe_ft_evaluate_rerank(m, d, held_out, 0, out);
}

int vlmoe_ft_evaluate_rerank(vlmoe_model *m, const vlmoe_ft_data *d, int held_out, int rerank, vlmoe_ft_score *out) {
    memset(out, 0, sizeof(*out));
    if (d->kind == VLMOE_FT_CAPTION)
        return vlmoe_fail(VLMOE_ERR_ARG, "captioning is scored by vlmoe_ft_caption_evaluate (CIDEr-D)");
    const int *idx = held_out ? d->idx + d->ntrain : d->idx, n = held_out ? d->nheld : d->ntrain;
    if (n < (d->kind == VLMOE_FT_RETRIEVAL ? 2 : 1)) return VLMOE_OK;
    out->n = n;
    return d->kind == VLMOE_FT_RETRIEVAL ? recall(m, d, idx, n, rerank, out->i2t, out->t2i)
                                         : accuracy(m, d, idx, n, &out->accuracy);
}

// ---- captioning: greedy decoding scored by CIDEr-D against each image's own caption
int vlmoe_ft_caption_evaluate(vlmoe_model *m, const vlmoe_ft_data *d, int held_out, const vlmoe_caption_params *cp,
                              vlmoe_detokenize_fn detok, void *user, vlmoe_ft_caption_score *out, char ***captions) {
    memset(out, 0, sizeof(*out));
    if (captions) *captions = NULL;
    if (d->kind != VLMOE_FT_CAPTION || !d->texts)
        return vlmoe_fail(VLMOE_ERR_ARG, "caption evaluation: the data was not read for captioning");
    const int *idx = held_out ? d->idx + d->ntrain : d->idx, n = held_out ? d->nheld : d->ntrain;
    if (n < 2) return VLMOE_OK; // CIDEr-D's idf needs two images (one scores 0)
    const size_t T = d->T, cap = 64 * T + 64; // a BPE piece decodes to tens of bytes
    float *img = malloc(sizeof(float) * d->isz * (size_t)n);
    int32_t *tok = malloc(sizeof(int32_t) * T * (size_t)n), *len = malloc(sizeof(int32_t) * (size_t)n);
    int *off = malloc(sizeof(int) * ((size_t)n + 1));
    char **cand = calloc((size_t)n, sizeof(char *));
    const char **refs = malloc(sizeof(char *) * (size_t)n);
    int st = img && tok && len && off && cand && refs ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "caption evaluation");
    for (int i = 0; !st && i < n; i++) {
        memcpy(img + d->isz * (size_t)i, d->images + d->isz * (size_t)idx[i], sizeof(float) * d->isz);
        refs[i] = d->texts[idx[i]], off[i] = i;
    }
    if (!st) off[n] = n, st = vlmoe_mome_caption(m, img, n, cp, tok, len);
    for (int i = 0; !st && i < n; i++) {
        if (!(cand[i] = malloc(cap))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "captions");
        else st = detok(user, tok + T * (size_t)i, len[i], cand[i], cap);
    }
    if (!st) st = vlmoe_cider_d((const char *const *)cand, n, refs, off, &out->cider, NULL);
    if (!st) out->n = n;
    if (!st && captions) *captions = cand, cand = NULL;
    for (int i = 0; cand && i < n; i++) free(cand[i]);
    free(cand), free(img), free(tok), free(len), free(off), free(refs);
    return st;
}
