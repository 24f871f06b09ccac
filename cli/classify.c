// classify.c: `vlmoe classify`: zero-shot classification of image files with labels the user
// names: CLIP's prompt ensemble per label, then per image softmax(exp(logit_scale) * cosine)
// over the labels (the probabilities CLIP's model card shows), top N sorted. Images are encoded
// in batches. Test: tests/test_classify_embed.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "nn/model.h"
#include "common.h"
#include "data/readers.h"
#include "tokenize.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe classify --model CHECKPOINT --image FILE [--image FILE ...] --labels \"cat,dog,car\"\n"
    "                      [options]\n\n"
    "Zero-shot classification: each label is put into every prompt template (--templates, or 8 of\n"
    "OpenAI CLIP's ImageNet templates), the prompts' text embeddings are averaged per label, and each\n"
    "image gets softmax(temperature x cosine similarity) over the labels, with the model's own learned\n"
    "temperature (exp(logit_scale)). Prints the top N labels of each image, most probable first.\n"
    "--image takes several files and folders (searched recursively for .jpg .jpeg .png .webp);\n"
    "images go through the model in batches. An unreadable image is skipped with a warning (an error\n"
    "when it is the only one). Labels come from --labels (comma-separated) or --labels-file (one per\n"
    "line). Texts and images are read as the model file records (its tokenizer and normalisation);\n"
    "for a file that records none, --tokenizer, or below 514 ids the synthetic word tokenizer.\n\n"
    "examples:\n"
    "  vlmoe classify --model logs/demo/checkpoints/step_3000.safetensors --image shape.png \\\n"
    "      --labels \"red circle,blue square,green triangle\"\n"
    "  vlmoe classify --model clip.safetensors --tokenizer bpe_simple_vocab_16e6.txt.gz \\\n"
    "      --image photos/ --labels-file imagenet_classes.txt --templates templates.txt --top 3 --json";

// exp(logit_scale): the temperature the model was trained with.
static int temperature(vlmoe_model *m, const char *path, double *out) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, "logit_scale")) {
            *out = exp(vlmoe_model_param_data(m)[t[i].offset]);
            return 0;
        }
    return cli_error("classify", "%s: the model has no logit_scale (a VL-MoE model is not a contrastive "
                     "image-text model)", path);
}

// "cat, dog,car" -> "cat" "dog" "car" (spaces around each trimmed) in place; empty labels are errors.
static int split_labels(char *s, char ***out, size_t *n) {
    size_t k = 1;
    for (const char *p = s; *p; p++) k += *p == ',';
    char **v = malloc(sizeof(char *) * k);
    if (!v) return cli_error("classify", "out of memory");
    char *p = s;
    for (size_t i = 0; i < k; i++) {
        char *end = strchr(p, ',');
        if (end) *end = 0;
        while (*p == ' ' || *p == '\t') p++;
        size_t len = strlen(p);
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t')) p[--len] = 0;
        if (!len) {
            free(v);
            return cli_error("classify", "--labels: label %zu of %zu is empty", i + 1, k);
        }
        v[i] = p;
        p = end ? end + 1 : p + len;
    }
    *out = v, *n = k;
    return 0;
}

typedef struct {
    double p;
    int c;
} scored;

static int by_prob(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->c - y->c;
}

// softmax(scale * <img, ce_c>) over the C labels, computed in double, sorted (ties: lower label).
static void probabilities(const float *img, const float *ce, int C, int E, double scale, scored *out) {
    double mx = -INFINITY, sum = 0;
    for (int c = 0; c < C; c++) {
        double s = 0;
        for (int e = 0; e < E; e++) s += (double)img[e] * ce[(size_t)c * E + e];
        out[c] = (scored){scale * s, c};
        mx = fmax(mx, out[c].p);
    }
    for (int c = 0; c < C; c++) sum += out[c].p = exp(out[c].p - mx);
    for (int c = 0; c < C; c++) out[c].p /= sum;
    qsort(out, (size_t)C, sizeof(scored), by_prob);
}

int cmd_classify(int argc, char **argv) {
    const char *precision = NULL, *device = NULL, *model = NULL, *labels = NULL, *labels_file = NULL, *templates = NULL, *tokenizer = NULL;
    const char *mean = NULL, *std = NULL, *unused = NULL;
    int top = 5, B = 64, json = 0, threads = 0, override = 0;
    long max_pixels = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "a vlmoe checkpoint (.safetensors)"},
        {"device", ARG_STRING, &device, "cpu|cuda[:N]", "where the model runs (default cpu)"},
        {"precision", ARG_STRING, &precision, "fp32|bf16|int8|int8-attn", CLI_PRECISION_HELP},
        {"image", ARG_STRING, &unused, "FILE|DIR...", "images to classify (repeatable; folders searched recursively)"},
        {"labels", ARG_STRING, &labels, "A,B,C", "the candidate labels, comma-separated"},
        {"labels-file", ARG_STRING, &labels_file, "FILE", "the candidate labels, one per line"},
        {"templates", ARG_STRING, &templates, "FILE", "prompt templates, one per line, {} = label"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &mean, "R,G,B", "normalisation mean (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &std, "R,G,B", "normalisation std (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"override-inputs", ARG_FLAG, &override, NULL, CLI_OVERRIDE_HELP},
        {"top", ARG_INT, &top, "N", "labels shown per image (default 5; 0 = all)"},
        {"batch-size", ARG_INT1, &B, "N", "images per model call (default 64)"},
        {"json", ARG_FLAG, &json, NULL, "print one JSON object instead of text"},
        {"threads", ARG_INT, &threads, "N", "worker threads"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    const char **args = malloc(sizeof(char *) * (size_t)argc);
    char **rest = malloc(sizeof(char *) * (size_t)argc);
    int nargs = 0, nrest = 0, rc = args && rest ? 0 : cli_error("classify", "out of memory");
    if (!rc) rc = cli_take_multi("classify", "image", argc, argv, 2, args, &nargs, rest, &nrest);
    if (!rc) rc = args_parse("classify", specs, nspec, nrest, rest, 2, USAGE);
    free(rest);
    if (rc) return free(args), rc == 1 ? 0 : rc;
    if (threads > 0) omp_set_num_threads(threads);
    cli_set_max_image_pixels(max_pixels);
    if (!model) rc = cli_error("classify", "--model is required (see vlmoe classify --help)");
    else if (!nargs) rc = cli_error("classify", "no image: give --image FILE (see vlmoe classify --help)");
    else if (!labels == !labels_file)
        rc = cli_error("classify", "give the labels with --labels \"cat,dog\" or --labels-file FILE (one of them)");
    else if (top < 0 || B < 1) rc = cli_error("classify", "--top must be >= 0 and --batch-size >= 1");
    if (rc) return free(args), rc;

    vlmoe_model *m = NULL;
    if (vlmoe_model_load(&m, model)) return free(args), cli_error("classify", "%s", vlmoe_last_error());
    if ((device && model_set_device(m, device)) || cli_set_precision("classify", m, precision)) {
        vlmoe_model_free(m), free(args);
        return cli_error("classify", "%s", vlmoe_last_error());
    }
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim;
    vlmoe_image_params ip;
    cli_text text = {0};
    char **lab_v = NULL, **tpl_v = NULL, **paths = NULL, *lab_s = labels ? strdup(labels) : NULL;
    size_t C = 0, nt = 0;
    int n = 0, n_ok = 0;
    double scale = 0;
    float *ce = NULL, *ie = NULL;
    uint8_t *ok = NULL;
    cli_bad_log bad = {0};
    rc = cli_model_image_params("classify", mean, std, override, m, model, &ip);
    if (!rc) rc = temperature(m, model, &scale);
    if (!rc) rc = cli_model_text("classify", tokenizer, override, m, model, 1, &text);
    if (!rc && labels) rc = lab_s ? split_labels(lab_s, &lab_v, &C) : cli_error("classify", "out of memory");
    if (!rc && labels_file && !(rc = cli_read_lines("classify", labels_file, &lab_v, &C)) && !C)
        rc = cli_error("classify", "--labels-file %s: no labels", labels_file);
    if (!rc && templates && !(rc = cli_read_lines("classify", templates, &tpl_v, &nt)) && !nt)
        rc = cli_error("classify", "--templates %s: no templates", templates);
    for (size_t t = 0; t < nt && !rc; t++)
        if (!strstr(tpl_v[t], "{}"))
            rc = cli_error("classify", "--templates %s: template %zu ('%s') has no {} for the label", templates, t + 1,
                           tpl_v[t]);
    if (!rc) rc = cli_list_images("classify", args, nargs, &paths, &n);
    if (!rc) {
        ce = malloc(sizeof(float) * C * E), ie = malloc(sizeof(float) * (size_t)n * E), ok = malloc((size_t)n);
        if (!ce || !ie || !ok) rc = cli_error("classify", "out of memory for %d images", n);
    }
    const char *const *tpl = tpl_v ? (const char *const *)tpl_v : cli_templates;
    if (!tpl_v) nt = CLI_NUM_TEMPLATES;
    if (!rc && cli_plan(m, (int)(C * nt), B)) rc = cli_error("classify", "%s", vlmoe_last_error());
    if (!rc && vlmoe_class_embeddings(m, (const char *const *)lab_v, (int)C, tpl, (int)nt, cli_tokenize, &text, ce))
        rc = cli_error("classify", "%s", vlmoe_last_error());
    const cli_encode_params ep = {&ip, B, "images", NULL, NULL};
    if (!rc && cli_encode_images(m, (const char *const *)paths, n, &ep, ie, ok, &bad, &n_ok))
        rc = cli_error("classify", "%s", vlmoe_last_error());
    if (!rc && !n_ok) rc = cli_no_images("classify", &bad, n);

    scored *sc = rc ? NULL : malloc(sizeof(scored) * C);
    if (!rc && !sc) rc = cli_error("classify", "out of memory");
    const int shown = top && (size_t)top < C ? top : (int)C;
    cJSON *out = json && !rc ? cJSON_CreateObject() : NULL, *res = NULL, *skipped = NULL;
    if (out) {
        cJSON_AddStringToObject(out, "model", model);
        cJSON_AddNumberToObject(out, "labels", (double)C);
        cJSON_AddNumberToObject(out, "templates", (double)nt);
        cJSON_AddNumberToObject(out, "temperature", scale);
        res = cJSON_AddArrayToObject(out, "images");
        skipped = cJSON_AddArrayToObject(out, "skipped");
    }
    for (int i = 0, k = 0; i < n && !rc; i++) {
        if (!ok[i]) {
            if (out) cJSON_AddItemToArray(skipped, cJSON_CreateString(paths[i]));
            continue;
        }
        probabilities(ie + (size_t)k++ * E, ce, (int)C, E, scale, sc);
        cJSON *o = out ? cJSON_CreateObject() : NULL, *arr = NULL;
        if (o) {
            cJSON_AddItemToArray(res, o);
            cJSON_AddStringToObject(o, "image", paths[i]);
            arr = cJSON_AddArrayToObject(o, "top");
        } else {
            printf("%s%s:\n", k > 1 ? "\n" : "", paths[i]);
        }
        for (int r = 0; r < shown; r++) {
            if (!o) {
                printf("  %6.2f%%  %s\n", 100 * sc[r].p, lab_v[sc[r].c]);
                continue;
            }
            cJSON *l = cJSON_CreateObject();
            cJSON_AddStringToObject(l, "label", lab_v[sc[r].c]);
            cJSON_AddNumberToObject(l, "prob", sc[r].p);
            cJSON_AddItemToArray(arr, l);
        }
    }
    if (out) {
        char *s = cJSON_PrintUnformatted(out);
        if (s) printf("%s\n", s);
        free(s);
        cJSON_Delete(out);
    }
    if (!rc) {
        char where[32];
        snprintf(where, sizeof(where), "%d files", n);
        cli_bad_warn("classify", &bad, "unreadable image", where);
    }
    free(sc), free(ce), free(ie), free(ok), free(args);
    if (labels) free(lab_v);
    else cli_free_lines(lab_v, C);
    free(lab_s);
    cli_free_lines(tpl_v, tpl_v ? nt : 0);
    vlmoe_free_strings(paths, n);
    cli_text_free(&text);
    vlmoe_model_free(m);
    return rc;
}
