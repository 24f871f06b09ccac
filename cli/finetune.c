// finetune.c: `vlmoe finetune`: fine-tunes a VL-MoE (arch mome) model with a classification head
// (VL-MoE sec. 4.2; the head and its pooling are vlmoe_mome_with_head in src/nn/mome_model.c):
// image-cls on an image folder (one subfolder per class), text-cls on a TSV of text<TAB>label,
// pair-cls on a TSV of image-path<TAB>question<TAB>answer (VQA as answer classification; image
// paths relative to the TSV's folder). Classes are the sorted distinct labels; every --holdout-th
// example is held out. Writes the model with its head and OUT.labels (one class per line, in
// class order). Covered by tests/test_finetune.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "common.h"
#include "data/readers.h"

#define CMD "finetune"

typedef struct {
    int n, per, classes, enc; // n examples of `per` sequences (2: NLVR2's two pairs of one sentence)
    char **label_of;    // (n) label text of each example (until classes are numbered); NULL: retrieval
    char **names;       // (classes) sorted distinct labels
    int32_t *labels;    // (n)
    char **paths;       // (n*per) image files, or NULL
    char **texts;       // (n*per) texts / questions, or NULL
    float *images;      // (n*per, C, S, S) or NULL
    int32_t *tokens, *lens; // (n*per, ctx), (n*per) or NULL
} ft_data;

static void ft_free(ft_data *d) {
    const int ns = d->n * d->per;
    vlmoe_free_strings(d->label_of, d->label_of ? d->n : 0);
    vlmoe_free_strings(d->paths, d->paths ? ns : 0);
    vlmoe_free_strings(d->texts, d->texts ? ns : 0);
    free(d->names);
    free(d->labels), free(d->images), free(d->tokens), free(d->lens);
    memset(d, 0, sizeof(*d));
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// Numbers the classes: names = sorted distinct label_of, labels = their indices.
static int number_classes(ft_data *d) {
    d->names = malloc(sizeof(char *) * (size_t)d->n);
    d->labels = malloc(sizeof(int32_t) * (size_t)d->n);
    if (!d->names || !d->labels) return cli_error(CMD, "out of memory");
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
    if (k < 2) return cli_error(CMD, "the data holds %d class%s: fine-tuning a classifier needs at least 2", k, k == 1 ? "" : "es");
    return 0;
}

static int grow(ft_data *d, int *cap, int images) {
    if (d->n < *cap) return 0;
    *cap = *cap ? 2 * *cap : 64;
    const size_t ns = (size_t)*cap * d->per;
    char **l = realloc(d->label_of, sizeof(char *) * (size_t)*cap), **p = NULL, **t = NULL;
    if (l) d->label_of = l;
    if (l && images && (p = realloc(d->paths, sizeof(char *) * ns))) d->paths = p;
    if (l && (t = realloc(d->texts, sizeof(char *) * ns))) d->texts = t;
    return !l || !t || (images && !p);
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
static int read_tsv(const char *path, int text_only, ft_data *d) {
    FILE *f = fopen(path, "rb");
    if (!f) return cli_error(CMD, "%s: cannot open the data file", path);
    const char *slash = strrchr(path, '/');
    const int dirlen = slash ? (int)(slash - path) + 1 : 0;
    char *line = NULL;
    size_t cap = 0;
    int rc = 0, lineno = 0, n_cap = 0, cols = text_only ? 2 : 0;
    while (!rc && getline(&line, &cap, f) >= 0) {
        lineno++;
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0]) continue;
        char *col[4] = {NULL};
        const int k = split_tabs(line, col);
        if (!cols) {
            if (k != 3 && k != 4) {
                rc = cli_error(CMD, "%s:%d: expected 3 tab-separated columns (%s) or 4 (NLVR2: %s), found %d", path,
                               lineno, tsv_columns(3), tsv_columns(4), k);
                break;
            }
            cols = k, d->per = k == 4 ? 2 : 1;
        }
        int empty = 0;
        for (int j = 0; j < cols && k == cols; j++) empty += !col[j][0];
        if (k != cols || empty)
            rc = cli_error(CMD, "%s:%d: expected %d non-empty tab-separated columns (%s), found %d%s", path, lineno,
                           cols, tsv_columns(cols), k, empty ? " with an empty one" : "");
        else if (grow(d, &n_cap, cols > 2))
            rc = cli_error(CMD, "out of memory");
        if (rc) break;
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
        if (oom) rc = cli_error(CMD, "out of memory");
    }
    free(line);
    fclose(f);
    if (!rc && !d->n) rc = cli_error(CMD, "%s: no examples", path);
    return rc;
}

// An image folder: the class of an image is the first folder below `dir` holding it.
static int read_folder(const char *dir, ft_data *d) {
    const char *args[1] = {dir};
    char **paths;
    int n;
    if (cli_list_images(CMD, args, 1, &paths, &n)) return 1;
    d->paths = paths;
    d->n = n;
    d->label_of = calloc((size_t)n, sizeof(char *));
    if (!d->label_of) return cli_error(CMD, "out of memory");
    const size_t dl = strlen(dir);
    for (int i = 0; i < n; i++) {
        const char *rel = paths[i] + dl;
        while (*rel == '/') rel++;
        const char *end = strchr(rel, '/');
        if (strncmp(paths[i], dir, dl) || !end)
            return cli_error(CMD, "%s: image not inside a class folder of %s (expected %s/CLASS/FILE)", paths[i], dir, dir);
        if (!(d->label_of[i] = strndup(rel, (size_t)(end - rel)))) return cli_error(CMD, "out of memory");
    }
    return 0;
}

// Image-caption pairs for retrieval (OpenCLIP CSV/TSV or webdataset shards), decoded and
// tokenized as they are read; bad images are skipped and reported.
static int read_pairs(const vlmoe_dataset_params *dp, const vlmoe_model_config *c, const char *tokenizer,
                      const char *const norm[2], ft_data *d) {
    vlmoe_dataset *ds = NULL;
    if (vlmoe_dataset_open(dp, &ds)) return cli_error(CMD, "--data: %s", vlmoe_last_error());
    vlmoe_image_params ip;
    cli_text t = {0};
    cli_bad_log bad = {0};
    vlmoe_image im = {0};
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    int rc = cli_image_params(CMD, norm[0], norm[1], c, &ip) || cli_text_init(CMD, tokenizer, c, 1, &t), cap = 0;
    cli_progress pr = cli_progress_start("image-caption pairs");
    while (!rc) {
        vlmoe_sample s;
        const int r = vlmoe_dataset_next(ds, &s);
        if (r < 0) rc = cli_error(CMD, "%s: %s", dp->path, vlmoe_last_error());
        if (r <= 0) break;
        if (d->n == cap) {
            cap = cap ? 2 * cap : 256;
            float *ni = realloc(d->images, sizeof(float) * isz * (size_t)cap);
            if (ni) d->images = ni;
            int32_t *nt = realloc(d->tokens, sizeof(int32_t) * T * (size_t)cap), *nl = nt ? realloc(d->lens, sizeof(int32_t) * (size_t)cap) : NULL;
            if (nt) d->tokens = nt;
            if (nl) d->lens = nl;
            if (!ni || !nt || !nl) {
                rc = cli_error(CMD, "out of memory");
                break;
            }
        }
        if (vlmoe_image_decode(s.image, s.image_len, s.key, &im) ||
            vlmoe_image_preprocess_eval(&im, &ip, d->images + isz * (size_t)d->n)) {
            cli_bad_add(&bad, vlmoe_last_error());
            continue;
        }
        if ((d->lens[d->n] = cli_tokenize(&t, s.caption, d->tokens + T * (size_t)d->n, (int)T)) < 2) {
            rc = cli_error(CMD, "%s: cannot tokenize the caption \"%s\": %s", s.key, s.caption, vlmoe_last_error());
            break;
        }
        cli_progress_show(&pr, ++d->n, -1);
    }
    cli_progress_end(&pr);
    cli_bad_warn(CMD, &bad, "images", dp->path);
    vlmoe_image_free(&im);
    cli_text_free(&t);
    vlmoe_dataset_free(ds);
    if (!rc && d->n < 2) rc = cli_error(CMD, "%s: %d usable image-caption pairs; retrieval needs at least 2", dp->path, d->n);
    return rc;
}

// Decodes and preprocesses the images, tokenizes the texts (retrieval data arrives ready).
static int prepare(ft_data *d, const vlmoe_model_config *c, const char *tokenizer, const char *const norm[2]) {
    const int ns = d->n * d->per;
    if (d->paths && !d->images) {
        vlmoe_image_params ip;
        if (cli_image_params(CMD, norm[0], norm[1], c, &ip)) return 1;
        const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
        if (!(d->images = malloc(sizeof(float) * isz * (size_t)ns))) return cli_error(CMD, "out of memory");
        for (int i = 0; i < ns; i++) {
            vlmoe_image im = {0};
            int st = vlmoe_image_load(d->paths[i], &im);
            if (!st) st = vlmoe_image_preprocess_eval(&im, &ip, d->images + isz * (size_t)i);
            vlmoe_image_free(&im);
            if (st) return cli_error(CMD, "%s", vlmoe_last_error());
        }
    }
    if (d->texts && !d->tokens) {
        cli_text t = {0};
        if (cli_text_init(CMD, tokenizer, c, 1, &t)) return 1;
        const int T = c->context_length;
        d->tokens = malloc(sizeof(int32_t) * (size_t)T * (size_t)ns);
        d->lens = malloc(sizeof(int32_t) * (size_t)ns);
        int rc = d->tokens && d->lens ? 0 : cli_error(CMD, "out of memory");
        for (int i = 0; i < ns && !rc; i++)
            if ((d->lens[i] = cli_tokenize(&t, d->texts[i], d->tokens + (size_t)i * T, T)) < 2)
                rc = cli_error(CMD, "cannot tokenize \"%s\": %s", d->texts[i], vlmoe_last_error());
        cli_text_free(&t);
        if (rc) return rc;
    }
    return 0;
}

// Batch buffers for B examples: images (B*per, C,S,S), tokens (B*per, ctx) and lens, labels (B).
typedef struct {
    float *img;
    int32_t *tok, *lens, *lab;
} ft_batch;

static int batch_alloc(ft_batch *b, const ft_data *d, const vlmoe_model_config *c, int B) {
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    const size_t ns = (size_t)B * d->per;
    memset(b, 0, sizeof(*b));
    b->img = d->images ? malloc(sizeof(float) * isz * ns) : NULL;
    b->tok = d->tokens ? malloc(sizeof(int32_t) * T * ns) : NULL;
    b->lens = d->tokens ? malloc(sizeof(int32_t) * ns) : NULL;
    b->lab = malloc(sizeof(int32_t) * (size_t)B);
    return (d->images && !b->img) || (d->tokens && (!b->tok || !b->lens)) || !b->lab ? cli_error(CMD, "out of memory") : 0;
}

static void batch_free(ft_batch *b) { free(b->img), free(b->tok), free(b->lens), free(b->lab); }

// Copies example idx[j] of d (its per sequences) into slot j of the batch.
static void gather_batch(const ft_data *d, const vlmoe_model_config *c, const int *idx, int B, ft_batch *b) {
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    for (int j = 0; j < B; j++)
        for (int h = 0; h < d->per; h++) {
            const size_t i = (size_t)idx[j] * d->per + h, o = (size_t)j * d->per + h;
            if (b->img) memcpy(b->img + isz * o, d->images + isz * i, sizeof(float) * isz);
            if (b->tok) memcpy(b->tok + T * o, d->tokens + T * i, sizeof(int32_t) * T), b->lens[o] = d->lens[i];
            b->lab[j] = d->labels ? d->labels[idx[j]] : 0;
        }
}

// Top-1 accuracy over the n examples idx (argmax of the scores, ties to the lower class).
static int accuracy(vlmoe_model *m, const ft_data *d, const int *idx, int n, double *acc) {
    *acc = 0;
    if (n < 1) return 0;
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    ft_batch b;
    float *s = malloc(sizeof(float) * (size_t)n * d->classes);
    int rc = batch_alloc(&b, d, c, n) || (!s && cli_error(CMD, "out of memory"));
    if (!rc) {
        gather_batch(d, c, idx, n, &b);
        if (vlmoe_mome_logits(m, (vlmoe_encoding)d->enc, b.img, b.tok, b.lens, n * d->per, s))
            rc = cli_error(CMD, "%s", vlmoe_last_error());
    }
    int right = 0;
    for (int i = 0; i < n && !rc; i++) {
        int arg = 0;
        for (int k = 1; k < d->classes; k++)
            if (s[(size_t)i * d->classes + k] > s[(size_t)i * d->classes + arg]) arg = k;
        right += arg == b.lab[i];
    }
    *acc = (double)right / n;
    free(s);
    batch_free(&b);
    return rc;
}

// Retrieval recall@1/5/10 both ways over the n pairs idx (each row its own image).
static int recall(vlmoe_model *m, const ft_data *d, const int *idx, int n, double *i2t, double *t2i) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, ks[3] = {1, 5, 10};
    ft_batch b;
    float *ie = malloc(sizeof(float) * (size_t)n * E), *te = malloc(sizeof(float) * (size_t)n * E);
    int32_t *own = malloc(sizeof(int32_t) * (size_t)n);
    int rc = batch_alloc(&b, d, c, n) || ((!ie || !te || !own) && cli_error(CMD, "out of memory"));
    for (int i = 0; !rc && i < n; i++) own[i] = i;
    if (!rc) gather_batch(d, c, idx, n, &b);
    if (!rc && (vlmoe_mome_embed(m, VLMOE_ENC_IMAGE, b.img, NULL, NULL, n, ie) ||
                vlmoe_mome_embed(m, VLMOE_ENC_TEXT, NULL, b.tok, b.lens, n, te) ||
                vlmoe_retrieval_recall(ie, n, te, n, own, E, ks, 3, i2t, t2i)))
        rc = cli_error(CMD, "%s", vlmoe_last_error());
    free(ie), free(te), free(own);
    batch_free(&b);
    return rc;
}

static int write_labels(const char *output, const ft_data *d) {
    char path[4096];
    snprintf(path, sizeof(path), "%s.labels", output);
    FILE *f = fopen(path, "w");
    if (!f) return cli_error(CMD, "%s: cannot write the class names", path);
    for (int k = 0; k < d->classes; k++) fprintf(f, "%s\n", d->names[k]);
    return fclose(f) ? cli_error(CMD, "%s: cannot write the class names", path) : 0;
}

enum { TASK_RETRIEVAL = 3 };

// The held-out report: accuracy (classification) or recall@1/5/10 (retrieval) of the n examples idx.
static int report(vlmoe_model *m, const ft_data *d, int task, const int *idx, int n, const char *what) {
    if (n < (task == TASK_RETRIEVAL ? 2 : 1)) return 0;
    if (task != TASK_RETRIEVAL) {
        double acc;
        int rc = accuracy(m, d, idx, n, &acc);
        if (!rc) printf("%s accuracy %.4f (%d examples)\n", what, acc, n);
        return rc;
    }
    double i2t[3], t2i[3];
    int rc = recall(m, d, idx, n, i2t, t2i);
    if (!rc)
        printf("%s retrieval (%d pairs): image->text R@1 %.4f R@5 %.4f R@10 %.4f; text->image R@1 %.4f R@5 %.4f "
               "R@10 %.4f\n", what, n, i2t[0], i2t[1], i2t[2], t2i[0], t2i[1], t2i[2]);
    return rc;
}

int cmd_finetune(int argc, char **argv) {
    const char *model = NULL, *task = NULL, *data = NULL, *output = NULL, *tokenizer = NULL, *sep = "\t";
    const char *norm[2] = {NULL, NULL};
    int steps = 100, batch = 16, holdout = 4, freeze = 0, log_every = 10;
    double lr = 1e-3, wd = 0.05;
    long seed = 0;
    vlmoe_dataset_params dp = vlmoe_dataset_default_params();
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "pretrained VL-MoE (arch mome) model (safetensors)"},
        {"task", ARG_STRING, &task, "TASK", "image-cls | text-cls | pair-cls | retrieval"},
        {"data", ARG_STRING, &data, "PATH", "image-cls: a folder of class folders; text-cls: TSV text<TAB>label; "
                                            "pair-cls: TSV image<TAB>question<TAB>answer (VQA) or image1<TAB>image2"
                                            "<TAB>sentence<TAB>label (NLVR2); retrieval: OpenCLIP CSV/TSV or "
                                            "webdataset shards of image-caption pairs"},
        {"output", ARG_STRING, &output, "FILE", "fine-tuned model to write (also -o); class names go to FILE.labels"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "BPE tokenizer of the model (default: the synthetic words)"},
        {"image-mean", ARG_STRING, &norm[0], "R,G,B", "normalisation mean (default CLIP's; the synthetic data's and "
                                                      "LIMoE's [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &norm[1], "R,G,B", "normalisation std (default CLIP's; [-1, 1]: 0.5)"},
        {"csv-img-key", ARG_STRING, &dp.img_key, "NAME", "retrieval CSV: column of image paths (filepath)"},
        {"csv-caption-key", ARG_STRING, &dp.caption_key, "NAME", "retrieval CSV: column of captions (title)"},
        {"csv-separator", ARG_STRING, &sep, "C", "retrieval CSV: field separator (tab; \\t for tab)"},
        {"steps", ARG_INT, &steps, "N", "optimizer steps (100)"},
        {"batch-size", ARG_INT, &batch, "N", "examples per step (16, at most the training examples)"},
        {"lr", ARG_DOUBLE, &lr, "LR", "peak learning rate of the cosine schedule, 10% warmup (1e-3)"},
        {"wd", ARG_DOUBLE, &wd, "WD", "AdamW weight decay (0.05)"},
        {"holdout", ARG_INT, &holdout, "K", "every K-th example is held out for the accuracy report (4; 0 = none)"},
        {"freeze-moe", ARG_FLAG, &freeze, NULL, "keep every router and expert unchanged (VL-MoE's fine-tuning)"},
        {"log-every", ARG_INT, &log_every, "N", "progress line every N steps (10)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the head's initialisation and the data order (0)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    const char *usage =
        "usage: vlmoe finetune --model M.safetensors --task image-cls|text-cls|pair-cls|retrieval --data PATH -o OUT\n\n"
        "Fine-tunes a VL-MoE model (VL-MoE sec. 4.2). Classification: a linear head on the mean image\n"
        "feature (image-cls), the [T_CLS] feature (text-cls; MNLI-style sentence pairs are one text\n"
        "joined by the end token) or the fused [T_CLS] of an image-text pair (pair-cls, VQA as answer\n"
        "classification; with 4 columns NLVR2: both images are paired with the sentence and the head\n"
        "reads the two fused [T_CLS] features side by side). Retrieval: images and captions encoded\n"
        "separately, [I_CLS] and [T_CLS] projected to embed_dim and trained with the contrastive loss;\n"
        "held-out recall@1/5/10 is reported.\n\n"
        "example:\n"
        "  vlmoe finetune --model logs/vlmoe-tiny/checkpoints/step_300.safetensors --task pair-cls \\\n"
        "      --data match.tsv --steps 200 --freeze-moe -o match.safetensors";
    int rc = args_parse(CMD, specs, ns, argc, argv, 2, usage);
    if (rc) return rc == 1 ? 0 : 2;
    if (!model || !task || !data || !output) return cli_error(CMD, "--model, --task, --data and --output (-o) are required");
    const int tk = !strcmp(task, "image-cls") ? VLMOE_ENC_IMAGE : !strcmp(task, "text-cls") ? VLMOE_ENC_TEXT
                 : !strcmp(task, "pair-cls") ? VLMOE_ENC_PAIR : !strcmp(task, "retrieval") ? TASK_RETRIEVAL : -1;
    if (tk < 0) return cli_error(CMD, "--task %s: expected image-cls, text-cls, pair-cls or retrieval", task);
    if (steps < 1 || batch < 1 || batch > 4096 || holdout < 0 || holdout == 1 || log_every < 1 || !(lr > 0) || !(wd >= 0))
        return cli_error(CMD, "need --steps >= 1, --batch-size in [1, 4096], --holdout 0 or >= 2, --lr > 0, --wd >= 0");
    if (cli_separator(CMD, sep, &dp.separator)) return 1;
    dp.path = data;
    vlmoe_model *pre = NULL, *m = NULL;
    vlmoe_trainer *t = NULL;
    ft_data d = {.per = 1, .enc = tk == TASK_RETRIEVAL ? VLMOE_ENC_IMAGE : tk};
    int *idx = NULL;
    ft_batch b = {0};
    if (vlmoe_model_load(&pre, model)) return cli_error(CMD, "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(pre);
    if (c->arch != VLMOE_ARCH_MOME) rc = cli_error(CMD, "%s: model '%s' is not a VL-MoE (arch mome) model", model, c->name);
    if (!rc) rc = tk == VLMOE_ENC_IMAGE ? read_folder(data, &d)
                : tk == TASK_RETRIEVAL ? read_pairs(&dp, c, tokenizer, norm, &d) : read_tsv(data, tk == VLMOE_ENC_TEXT, &d);
    if (!rc && tk != TASK_RETRIEVAL) rc = number_classes(&d);
    if (!rc) rc = prepare(&d, c, tokenizer, norm);
    if (!rc && vlmoe_mome_with_heads(&m, pre, tk == TASK_RETRIEVAL ? 0 : d.classes, d.per, tk == TASK_RETRIEVAL,
                                     (uint64_t)seed))
        rc = cli_error(CMD, "%s", vlmoe_last_error());
    // split: train indices first, then the held-out ones
    int ntrain = 0, nheld = 0;
    if (!rc && !(idx = malloc(sizeof(int) * (size_t)d.n * 2))) rc = cli_error(CMD, "out of memory");
    for (int i = 0; !rc && i < d.n; i++)
        if (!holdout || i % holdout != holdout - 1) idx[ntrain++] = i;
    for (int i = 0; !rc && i < d.n; i++)
        if (holdout && i % holdout == holdout - 1) idx[ntrain + nheld++] = i;
    if (!rc && ntrain < (tk == TASK_RETRIEVAL ? 2 : 1))
        rc = cli_error(CMD, "%d training examples left after --holdout %d: too few", ntrain, holdout);
    if (!rc && tk == TASK_RETRIEVAL && batch < 2) rc = cli_error(CMD, "--batch-size %d: the contrastive loss needs >= 2", batch);
    const int B = batch < ntrain ? batch : ntrain;
    if (!rc) {
        c = vlmoe_model_get_config(m);
        rc = batch_alloc(&b, &d, c, B);
        if (tk == TASK_RETRIEVAL)
            printf("finetune retrieval: %d training and %d held-out image-caption pairs, embed_dim %d, batch %d, %d "
                   "steps%s\n", ntrain, nheld, c->embed_dim, B, steps, freeze ? ", routers and experts frozen" : "");
        else
            printf("finetune %s%s: %d classes, %d training and %d held-out examples, batch %d, %d steps%s\n", task,
                   d.per == 2 ? " (NLVR2: two image-text pairs per example)" : "", d.classes, ntrain, nheld, B, steps,
                   freeze ? ", routers and experts frozen" : "");
    }
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, lr, steps / 10, steps, 0, 0, 0};
    tp.optim.weight_decay = (float)wd;
    tp.freeze_moe = freeze;
    if (!rc && vlmoe_trainer_init(&t, m, &tp)) rc = cli_error(CMD, "%s", vlmoe_last_error());
    // the data order: a fresh shuffle of the training examples every epoch
    vlmoe_rng r;
    vlmoe_rng_seed(&r, (uint64_t)seed * 0x9e3779b97f4a7c15ULL + 1);
    int *order = idx ? idx + d.n : NULL, pos = ntrain;
    for (int step = 0; !rc && step < steps; step++) {
        int pick[4096];
        for (int j = 0; j < B; j++) {
            if (pos == ntrain) {
                memcpy(order, idx, sizeof(int) * (size_t)ntrain);
                for (int i = ntrain - 1; i > 0; i--) {
                    const int k = (int)vlmoe_rng_below(&r, (uint64_t)i + 1), s = order[i];
                    order[i] = order[k], order[k] = s;
                }
                pos = 0;
            }
            pick[j] = order[pos++];
        }
        gather_batch(&d, c, pick, B, &b);
        vlmoe_mome_stats ps;
        vlmoe_step_stats ss;
        int st;
        if (tk == TASK_RETRIEVAL) {
            st = vlmoe_trainer_step_mome_retrieval(t, b.img, b.tok, b.lens, B, &ps, &ss);
        } else {
            const vlmoe_mome_batch mb = {(vlmoe_encoding)tk, B * d.per, b.img, b.tok, b.lens, NULL, NULL, b.lab};
            st = vlmoe_trainer_step_mome(t, &mb, 1, &ps, &ss);
        }
        if (st) rc = cli_error(CMD, "%s", vlmoe_last_error());
        else if (((step + 1) % log_every == 0 || step + 1 == steps) && tk == TASK_RETRIEVAL)
            printf("step %d/%d  loss %.4f  contrastive %.4f  batch accuracy i2t %.3f t2i %.3f  lr %.2e\n", step + 1,
                   steps, ss.loss, ps.itc, ps.itc_acc[0], ps.itc_acc[1], ss.lr);
        else if ((step + 1) % log_every == 0 || step + 1 == steps)
            printf("step %d/%d  loss %.4f  cls %.4f  batch accuracy %.3f  lr %.2e\n", step + 1, steps, ss.loss, ps.cls,
                   ps.cls_acc, ss.lr);
    }
    if (!rc) rc = report(m, &d, tk, idx, ntrain, "train");
    if (!rc) rc = report(m, &d, tk, idx + ntrain, nheld, "held-out");
    if (!rc && tk != TASK_RETRIEVAL) printf("chance %.4f (%d classes)\n", 1.0 / d.classes, d.classes);
    if (!rc && vlmoe_model_save(m, output)) rc = cli_error(CMD, "%s", vlmoe_last_error());
    if (!rc && tk != TASK_RETRIEVAL) rc = write_labels(output, &d);
    if (!rc) printf(tk != TASK_RETRIEVAL ? "wrote %s and %s.labels\n" : "wrote %s\n", output, output);
    free(idx);
    batch_free(&b);
    ft_free(&d);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    vlmoe_model_free(pre);
    return rc;
}
