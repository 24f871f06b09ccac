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
    int n, classes, enc;
    char **label_of;    // (n) label text of each example (until classes are numbered)
    char **names;       // (classes) sorted distinct labels
    int32_t *labels;    // (n)
    char **paths;       // (n) image files, or NULL
    char **texts;       // (n) texts / questions, or NULL
    float *images;      // (n, C, S, S) or NULL
    int32_t *tokens, *lens; // (n, ctx), (n) or NULL
} ft_data;

static void ft_free(ft_data *d) {
    vlmoe_free_strings(d->label_of, d->n);
    vlmoe_free_strings(d->paths, d->paths ? d->n : 0);
    vlmoe_free_strings(d->texts, d->texts ? d->n : 0);
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

static int grow(ft_data *d, int *cap, int cols) {
    if (d->n < *cap) return 0;
    *cap = *cap ? 2 * *cap : 64;
    char **l = realloc(d->label_of, sizeof(char *) * (size_t)*cap), **p = NULL, **t = NULL;
    if (l) d->label_of = l;
    if (l && cols == 3 && (p = realloc(d->paths, sizeof(char *) * (size_t)*cap))) d->paths = p;
    if (l && (t = realloc(d->texts, sizeof(char *) * (size_t)*cap))) d->texts = t;
    return !l || !t || (cols == 3 && !p);
}

// A TSV of text<TAB>label (cols 2) or image<TAB>question<TAB>answer (cols 3); empty lines skipped.
static int read_tsv(const char *path, int cols, ft_data *d) {
    FILE *f = fopen(path, "rb");
    if (!f) return cli_error(CMD, "%s: cannot open the data file", path);
    const char *slash = strrchr(path, '/');
    const int dirlen = slash ? (int)(slash - path) + 1 : 0;
    char *line = NULL;
    size_t cap = 0;
    int rc = 0, lineno = 0, n_cap = 0;
    while (!rc && getline(&line, &cap, f) >= 0) {
        lineno++;
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0]) continue;
        char *col[3] = {line, NULL, NULL};
        int k = 1;
        for (char *c = line; *c && k <= cols; c++)
            if (*c == '\t') {
                *c = 0;
                if (k < cols) col[k] = c + 1;
                k++;
            }
        int empty = 0;
        for (int j = 0; j < cols && k == cols; j++) empty += !col[j][0];
        if (k != cols || empty)
            rc = cli_error(CMD, "%s:%d: expected %d non-empty tab-separated columns (%s), found %d%s", path, lineno,
                           cols, cols == 2 ? "text, label" : "image path, question, answer", k,
                           empty ? " with an empty one" : "");
        else if (grow(d, &n_cap, cols))
            rc = cli_error(CMD, "out of memory");
        if (rc) break;
        char *img = NULL;
        if (cols == 3) {
            const size_t len = strlen(col[0]) + (size_t)dirlen + 1;
            if ((img = malloc(len))) snprintf(img, len, "%.*s%s", col[0][0] == '/' ? 0 : dirlen, path, col[0]);
        }
        d->label_of[d->n] = strdup(col[cols - 1]);
        d->texts[d->n] = strdup(col[cols - 2]);
        if (cols == 3) d->paths[d->n] = img;
        d->n++;
        if (!d->label_of[d->n - 1] || !d->texts[d->n - 1] || (cols == 3 && !img)) rc = cli_error(CMD, "out of memory");
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

// Decodes and preprocesses the images, tokenizes the texts.
static int prepare(ft_data *d, const vlmoe_model_config *c, const char *tokenizer) {
    if (d->paths) {
        vlmoe_image_params ip;
        if (cli_image_params(CMD, NULL, NULL, c, &ip)) return 1;
        const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
        if (!(d->images = malloc(sizeof(float) * isz * (size_t)d->n))) return cli_error(CMD, "out of memory");
        for (int i = 0; i < d->n; i++) {
            vlmoe_image im = {0};
            int st = vlmoe_image_load(d->paths[i], &im);
            if (!st) st = vlmoe_image_preprocess_eval(&im, &ip, d->images + isz * (size_t)i);
            vlmoe_image_free(&im);
            if (st) return cli_error(CMD, "%s", vlmoe_last_error());
        }
    }
    if (d->texts) {
        cli_text t = {0};
        if (cli_text_init(CMD, tokenizer, c, 1, &t)) return 1;
        const int T = c->context_length;
        d->tokens = malloc(sizeof(int32_t) * (size_t)T * (size_t)d->n);
        d->lens = malloc(sizeof(int32_t) * (size_t)d->n);
        int rc = d->tokens && d->lens ? 0 : cli_error(CMD, "out of memory");
        for (int i = 0; i < d->n && !rc; i++)
            if ((d->lens[i] = cli_tokenize(&t, d->texts[i], d->tokens + (size_t)i * T, T)) < 2)
                rc = cli_error(CMD, "cannot tokenize \"%s\": %s", d->texts[i], vlmoe_last_error());
        cli_text_free(&t);
        if (rc) return rc;
    }
    return 0;
}

// Copies example idx[j] of d into slot j of the batch buffers.
static void gather_batch(const ft_data *d, const vlmoe_model_config *c, const int *idx, int B, float *img, int32_t *tok,
                         int32_t *lens, int32_t *lab) {
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    for (int j = 0; j < B; j++) {
        const int i = idx[j];
        if (img) memcpy(img + isz * (size_t)j, d->images + isz * (size_t)i, sizeof(float) * isz);
        if (tok) memcpy(tok + T * (size_t)j, d->tokens + T * (size_t)i, sizeof(int32_t) * T), lens[j] = d->lens[i];
        lab[j] = d->labels[i];
    }
}

// Top-1 accuracy over the n examples idx (argmax of the scores, ties to the lower class).
static int accuracy(vlmoe_model *m, const ft_data *d, const int *idx, int n, double *acc) {
    *acc = 0;
    if (n < 1) return 0;
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    float *img = d->images ? malloc(sizeof(float) * isz * (size_t)n) : NULL, *s = malloc(sizeof(float) * (size_t)n * d->classes);
    int32_t *tok = d->tokens ? malloc(sizeof(int32_t) * (T + 1) * (size_t)n) : NULL, *lab = malloc(sizeof(int32_t) * (size_t)n);
    int rc = s && lab && (!d->images || img) && (!d->tokens || tok) ? 0 : cli_error(CMD, "out of memory");
    if (!rc) {
        gather_batch(d, c, idx, n, img, tok, tok ? tok + T * (size_t)n : NULL, lab);
        if (vlmoe_mome_logits(m, (vlmoe_encoding)d->enc, img, tok, tok ? tok + T * (size_t)n : NULL, n, s))
            rc = cli_error(CMD, "%s", vlmoe_last_error());
    }
    int right = 0;
    for (int i = 0; i < n && !rc; i++) {
        int arg = 0;
        for (int k = 1; k < d->classes; k++)
            if (s[(size_t)i * d->classes + k] > s[(size_t)i * d->classes + arg]) arg = k;
        right += arg == lab[i];
    }
    *acc = (double)right / n;
    free(img), free(s), free(tok), free(lab);
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

int cmd_finetune(int argc, char **argv) {
    const char *model = NULL, *task = NULL, *data = NULL, *output = NULL, *tokenizer = NULL;
    int steps = 100, batch = 16, holdout = 4, freeze = 0, log_every = 10;
    double lr = 1e-3, wd = 0.05;
    long seed = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "pretrained VL-MoE (arch mome) model (safetensors)"},
        {"task", ARG_STRING, &task, "TASK", "image-cls | text-cls | pair-cls"},
        {"data", ARG_STRING, &data, "PATH", "image-cls: a folder of class folders; text-cls: TSV text<TAB>label; "
                                            "pair-cls: TSV image<TAB>question<TAB>answer"},
        {"output", ARG_STRING, &output, "FILE", "fine-tuned model to write (also -o); class names go to FILE.labels"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "BPE tokenizer of the model (default: the synthetic words)"},
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
    const char *usage = "usage: vlmoe finetune --model M.safetensors --task image-cls|text-cls|pair-cls --data PATH -o OUT\n\n"
                        "Fine-tunes a VL-MoE model with a linear classification head on the mean image feature\n"
                        "(image-cls), the [T_CLS] feature (text-cls) or the fused [T_CLS] of the pair (pair-cls).";
    int rc = args_parse(CMD, specs, ns, argc, argv, 2, usage);
    if (rc) return rc == 1 ? 0 : 2;
    if (!model || !task || !data || !output) return cli_error(CMD, "--model, --task, --data and --output (-o) are required");
    const int enc = !strcmp(task, "image-cls") ? VLMOE_ENC_IMAGE : !strcmp(task, "text-cls") ? VLMOE_ENC_TEXT
                  : !strcmp(task, "pair-cls") ? VLMOE_ENC_PAIR : -1;
    if (enc < 0) return cli_error(CMD, "--task %s: expected image-cls, text-cls or pair-cls", task);
    if (steps < 1 || batch < 1 || batch > 4096 || holdout < 0 || holdout == 1 || log_every < 1 || !(lr > 0) || !(wd >= 0))
        return cli_error(CMD, "need --steps >= 1, --batch-size in [1, 4096], --holdout 0 or >= 2, --lr > 0, --wd >= 0");
    vlmoe_model *pre = NULL, *m = NULL;
    vlmoe_trainer *t = NULL;
    ft_data d = {0};
    d.enc = enc;
    int *idx = NULL;
    float *bimg = NULL;
    int32_t *btok = NULL, *blab = NULL;
    if (vlmoe_model_load(&pre, model)) return cli_error(CMD, "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(pre);
    if (c->arch != VLMOE_ARCH_MOME) rc = cli_error(CMD, "%s: model '%s' is not a VL-MoE (arch mome) model", model, c->name);
    if (!rc) rc = enc == VLMOE_ENC_IMAGE ? read_folder(data, &d) : read_tsv(data, enc == VLMOE_ENC_TEXT ? 2 : 3, &d);
    if (!rc) rc = number_classes(&d);
    if (!rc) rc = prepare(&d, c, tokenizer);
    if (!rc && vlmoe_mome_with_head(&m, pre, d.classes, (uint64_t)seed)) rc = cli_error(CMD, "%s", vlmoe_last_error());
    // split: train indices first, then the held-out ones
    int ntrain = 0, nheld = 0;
    if (!rc && !(idx = malloc(sizeof(int) * (size_t)d.n * 2))) rc = cli_error(CMD, "out of memory");
    for (int i = 0; !rc && i < d.n; i++)
        if (!holdout || i % holdout != holdout - 1) idx[ntrain++] = i;
    for (int i = 0; !rc && i < d.n; i++)
        if (holdout && i % holdout == holdout - 1) idx[ntrain + nheld++] = i;
    if (!rc && ntrain < 1) rc = cli_error(CMD, "no training examples left after --holdout %d", holdout);
    const int B = batch < ntrain ? batch : ntrain;
    if (!rc) {
        c = vlmoe_model_get_config(m);
        const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
        bimg = d.images ? malloc(sizeof(float) * isz * (size_t)B) : NULL;
        btok = d.tokens ? malloc(sizeof(int32_t) * (T + 1) * (size_t)B) : NULL;
        blab = malloc(sizeof(int32_t) * (size_t)B);
        if ((d.images && !bimg) || (d.tokens && !btok) || !blab) rc = cli_error(CMD, "out of memory");
        printf("finetune %s: %d classes, %d training and %d held-out examples, batch %d, %d steps%s\n", task, d.classes,
               ntrain, nheld, B, steps, freeze ? ", routers and experts frozen" : "");
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
        const size_t T = (size_t)c->context_length;
        gather_batch(&d, c, pick, B, bimg, btok, btok ? btok + T * (size_t)B : NULL, blab);
        const vlmoe_mome_batch b = {(vlmoe_encoding)enc, B, bimg, btok, btok ? btok + T * (size_t)B : NULL,
                                    NULL, NULL, blab};
        vlmoe_mome_stats ps;
        vlmoe_step_stats ss;
        if (vlmoe_trainer_step_mome(t, &b, 1, &ps, &ss)) rc = cli_error(CMD, "%s", vlmoe_last_error());
        else if ((step + 1) % log_every == 0 || step + 1 == steps)
            printf("step %d/%d  loss %.4f  cls %.4f  batch accuracy %.3f  lr %.2e\n", step + 1, steps, ss.loss, ps.cls,
                   ps.cls_acc, ss.lr);
    }
    double acc_train = 0, acc_held = 0;
    if (!rc) rc = accuracy(m, &d, idx, ntrain, &acc_train);
    if (!rc) rc = accuracy(m, &d, idx + ntrain, nheld, &acc_held);
    if (!rc) {
        printf("train accuracy %.4f (%d examples)\n", acc_train, ntrain);
        if (nheld) printf("held-out accuracy %.4f (%d examples)\n", acc_held, nheld);
        printf("chance %.4f (%d classes)\n", 1.0 / d.classes, d.classes);
    }
    if (!rc && vlmoe_model_save(m, output)) rc = cli_error(CMD, "%s", vlmoe_last_error());
    if (!rc) rc = write_labels(output, &d);
    if (!rc) printf("wrote %s and %s.labels\n", output, output);
    free(idx), free(bimg), free(btok), free(blab);
    ft_free(&d);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    vlmoe_model_free(pre);
    return rc;
}
