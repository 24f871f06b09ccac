// common.c: helpers of the inference subcommands (eval, classify, embed): image flags, image
// folders, the progress line of batched image encoding (the encoding is src/eval/run_eval.c's),
// the tokenizer choice, progress lines, skipped inputs. See common.h; covered through tests/test_eval_data.c and tests/test_classify_embed.c.
#include "common.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "data/loader.h"
#include "dist/dist.h"
#include "nn/model.h"
#include "data/readers.h"
#include "tokenize.h"

const char *const cli_templates[CLI_NUM_TEMPLATES] = {
    "a photo of a {}.", "itap of a {}.", "a bad photo of the {}.", "a origami {}.",
    "a photo of the large {}.", "a {} in a video game.", "art of the {}.", "a photo of the small {}.",
};

// "R,G,B" or one value for all three channels (OpenCLIP's "R G B" arrives here joined by
// cli_join_norm_flags as "R,G,B").
static int parse3(const char *cmd, const char *flag, const char *v, float out[3]) {
    char tail;
    if (sscanf(v, "%f,%f,%f%c", &out[0], &out[1], &out[2], &tail) == 3) return 0;
    if (sscanf(v, "%f%c", &out[0], &tail) == 1) return out[1] = out[2] = out[0], 0;
    return cli_error(cmd, "--%s expects R,G,B (or three values R G B, or one value for all three), got '%s'", flag, v);
}

// A value of --image-mean/--image-std: a number, negative ones included ("-0.5" is not a flag);
// an image path or the next flag is not.
static int is_number(const char *s) {
    char *end;
    const char *d = s + (*s == '-' || *s == '+');
    if (!((*d >= '0' && *d <= '9') || (*d == '.' && d[1] >= '0' && d[1] <= '9'))) return 0;
    strtod(s, &end);
    return end != s && !*end;
}

int cli_join_norm_flags(int argc, char **argv, char (*buf)[CLI_NORM_LEN], int nbuf) {
    int out = 0, used = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const int flag = !strcmp(a, "--image-mean") || !strcmp(a, "--image-std");
        const int eq = !strncmp(a, "--image-mean=", 13) || !strncmp(a, "--image-std=", 12);
        int k = 0; // numbers after the flag (and its =value), at most 3 in all
        while (i + 1 + k < argc && k < 3 - eq && is_number(argv[i + 1 + k])) k++;
        if ((!flag && !eq) || k + eq < 2 || used == nbuf) { // nothing to join: as it was
            argv[out++] = argv[i];
            continue;
        }
        char *b = buf[used++];
        int at = snprintf(b, CLI_NORM_LEN, "%.*s=%s", (int)strcspn(a, "="), a, eq ? strchr(a, '=') + 1 : "");
        for (int j = 0; j < k && at < CLI_NORM_LEN; j++)
            at += snprintf(b + at, CLI_NORM_LEN - (size_t)at, "%s%s", eq || j ? "," : "", argv[i + 1 + j]);
        argv[out++] = b;
        i += k;
    }
    if (out < argc) argv[out] = NULL; // argv stays NULL-terminated
    return out;
}

// --max-image-pixels of this process's command (0: the library's default). One value per
// process, set by the command right after its flags are parsed, before any image parameters are
// made; kept here so the one funnel below applies it for every image a command decodes.
static long max_image_pixels;
void cli_set_max_image_pixels(long n) { max_image_pixels = n; }

int cli_image_params(const char *cmd, const char *mean, const char *std, const vlmoe_model_config *c,
                     vlmoe_image_params *out) {
    *out = vlmoe_image_default_params();
    if (max_image_pixels) out->max_pixels = max_image_pixels;
    out->size = c->image_size;
    if ((mean && parse3(cmd, "image-mean", mean, out->mean)) || (std && parse3(cmd, "image-std", std, out->std)))
        return 1;
    return vlmoe_image_params_check(out) ? cli_error(cmd, "%s", vlmoe_last_error()) : 0;
}

int cli_text_init(const char *cmd, const char *path, const vlmoe_model_config *c, int need, cli_text *t) {
    if (path && cli_load_tokenizer(path, &t->bpe)) return cli_error(cmd, "%s", vlmoe_last_error());
    if (t->bpe && vlmoe_tokenizer_vocab_size(t->bpe) > c->vocab_size)
        return cli_error(cmd, "--tokenizer %s has %d ids, more than the model's vocabulary of %d", path,
                         vlmoe_tokenizer_vocab_size(t->bpe), c->vocab_size);
    if (t->bpe || !need) return 0;
    if (c->vocab_size >= CLI_BPE_MIN)
        return cli_error(cmd, "--tokenizer is needed: the model's vocabulary of %d ids is not the synthetic data's "
                         "(those models have fewer than 514)", c->vocab_size);
    if (!t->synth) {
        const vlmoe_synth_params sp = vlmoe_synth_default_params();
        if (vlmoe_synth_init(&t->synth, &sp)) return cli_error(cmd, "%s", vlmoe_last_error());
    }
    if (vlmoe_synth_vocab_size(t->synth) > c->vocab_size)
        return cli_error(cmd, "the model's vocabulary of %d ids is smaller than the synthetic data's %d: give "
                         "--tokenizer", c->vocab_size, vlmoe_synth_vocab_size(t->synth));
    return 0;
}

// "R, G, B" of three floats, for messages.
static void show3(const float v[3], char *out, size_t cap) { snprintf(out, cap, "%g,%g,%g", v[0], v[1], v[2]); }

int cli_model_image_params(const char *cmd, const char *mean, const char *std, int override, const vlmoe_model *m,
                           const char *path, vlmoe_image_params *out) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (cli_image_params(cmd, mean, std, c, out)) return 1;
    const model_inputs *in = model_get_inputs(m);
    if (!in->has_norm) return 0;
    const char *flag[2] = {"image-mean", "image-std"};
    const float *rec[2] = {in->mean, in->std};
    float *use[2] = {out->mean, out->std};
    for (int k = 0; k < 2; k++) {
        const int given = k ? std != NULL : mean != NULL;
        char a[64], b[64];
        show3(use[k], a, sizeof(a)), show3(rec[k], b, sizeof(b));
        if (given && memcmp(use[k], rec[k], sizeof(float) * 3) && !override)
            return cli_error(cmd, "--%s %s contradicts the %s %s records in %s: leave the flag out (the model's is used), "
                             "or add --override-inputs", flag[k], a, k ? "std" : "mean", b, path);
        if (given && memcmp(use[k], rec[k], sizeof(float) * 3))
            fprintf(stderr, "vlmoe %s: --override-inputs: normalising with --%s %s instead of %s's %s\n", cmd, flag[k],
                    a, path, b);
        else
            memcpy(use[k], rec[k], sizeof(float) * 3);
    }
    return 0;
}

// Whether the tokenizer file at path is the one m records (an unreadable file: no).
static int same_tokenizer(const char *path, const vlmoe_model *m) {
    vlmoe_tokenizer *tok = NULL;
    const int same = !cli_load_tokenizer(path, &tok) && model_same_tokenizer(m, tok);
    vlmoe_tokenizer_free(tok);
    return same;
}

int cli_model_text(const char *cmd, const char *tokenizer, int override, const vlmoe_model *m, const char *path,
                   int need, cli_text *t) {
    const model_inputs *in = model_get_inputs(m);
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (in->text == MODEL_TEXT_UNKNOWN) return cli_text_init(cmd, tokenizer, c, need, t); // a file that does not say
    if (tokenizer && same_tokenizer(tokenizer, m)) // typed again: no contradiction
        return cli_text_init(cmd, tokenizer, c, need, t);
    if (tokenizer && !override)
        return cli_error(cmd, "--tokenizer %s: %s carries its own tokenizer (%s), which every command uses; leave the "
                         "flag out, or add --override-inputs to tokenize with yours", tokenizer, path,
                         in->text == MODEL_TEXT_BPE ? "BPE" : "the synthetic data's words");
    if (tokenizer) {
        fprintf(stderr, "vlmoe %s: --override-inputs: tokenizing with %s instead of the tokenizer %s carries\n", cmd,
                tokenizer, path);
        return cli_text_init(cmd, tokenizer, c, need, t);
    }
    if (in->text == MODEL_TEXT_BPE)
        return model_tokenizer(m, path, &t->bpe) ? cli_error(cmd, "%s", vlmoe_last_error()) : 0;
    return cli_text_init(cmd, NULL, c, need, t);
}

int cli_synthetic_model(const char *cmd, const vlmoe_model *m, const char *path, const char *need) {
    if (model_get_inputs(m)->text != MODEL_TEXT_BPE) return 0;
    return cli_error(cmd, "%s was trained on its own captions (it carries a BPE tokenizer), not on the synthetic data, "
                     "so the synthetic data says nothing about it: give %s", path, need);
}

int cli_tokenize(void *u, const char *text, int32_t *ids, int ctx) {
    const cli_text *t = u;
    int len;
    if (!t->bpe) return vlmoe_synth_tokenize(t->synth, text, ids, ctx);
    return vlmoe_tokenizer_encode(t->bpe, text, ids, ctx, &len) ? -1 : len;
}

int cli_detokenize(void *u, const int32_t *ids, int n, char *out, size_t cap) {
    const cli_text *t = u;
    if (!t->bpe) return vlmoe_synth_detokenize(t->synth, ids, n, out, cap);
    // a model may have ids beyond its tokenizer's (its [MASK] and spares): a caption drops them
    int32_t keep[1024];
    const int32_t V = vlmoe_tokenizer_vocab_size(t->bpe);
    int k = 0;
    for (int i = 0; i < n && k < 1024; i++)
        if (ids[i] >= 0 && ids[i] < V) keep[k++] = ids[i];
    return vlmoe_tokenizer_decode(t->bpe, keep, k, out, cap);
}

vlmoe_caption_params cli_caption_params(const cli_text *t) {
    vlmoe_caption_params p = {.bos = VLMOE_TOK_SOT, .eos = VLMOE_TOK_EOT};
    if (t->bpe) p.bos = vlmoe_tokenizer_sot(t->bpe), p.eos = vlmoe_tokenizer_eot(t->bpe);
    return p;
}

void cli_text_free(cli_text *t) {
    vlmoe_tokenizer_free(t->bpe);
    vlmoe_synth_free(t->synth);
    t->bpe = NULL, t->synth = NULL;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

cli_progress cli_progress_start(const char *what) {
    cli_progress p = {what, isatty(2), 0, cli_now(), 0};
    p.last = p.t0;
    return p;
}

void cli_progress_show(cli_progress *p, long done, long total) {
    const double t = cli_now();
    if (t - p->last < (p->tty ? 0.25 : 30)) return;
    p->last = t, p->shown = 1;
    char of[32] = "";
    if (total > 0) snprintf(of, sizeof(of), "/%ld", total);
    fprintf(stderr, p->tty ? "\r%s: %ld%s (%.0f/s)  " : "%s: %ld%s (%.0f/s)\n", p->what, done, of,
            done / (t - p->t0));
}

void cli_progress_end(cli_progress *p) {
    if (p->tty && p->shown) fputs("\r\033[K", stderr);
    p->shown = 0;
}

void cli_progress_cb(void *u, const char *what, long done, long total) {
    cli_progress *p = u;
    if (!p->what || strcmp(p->what, what)) {
        cli_progress_end(p);
        *p = cli_progress_start(what);
    }
    cli_progress_show(p, done, total);
}

void cli_bad_add(cli_bad_log *b, const char *msg) { vlmoe_skip_log_add(b, msg); }

int cli_separator(const char *cmd, const char *sep, char *out) {
    if (!strcmp(sep, "\\t")) sep = "\t";
    if (strlen(sep) != 1) return cli_error(cmd, "--csv-separator expects one character, got '%s'", sep);
    *out = sep[0];
    return 0;
}

int cli_dataset_type(const char *cmd, const char *name, int synthetic_ok, vlmoe_dataset_type *out) {
    static const char *const names[3] = {"auto", "csv", "webdataset"};
    static const vlmoe_dataset_type types[3] = {VLMOE_DATASET_AUTO, VLMOE_DATASET_CSV, VLMOE_DATASET_WEBDATASET};
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, names[i])) return *out = types[i], 0;
    return cli_error(cmd, "--dataset-type %s: expected %sauto, csv or webdataset", name, synthetic_ok ? "synthetic, " : "");
}

int cli_resampling(const char *cmd, const vlmoe_dataset_params *d, int resampled, const char *factors) {
    if (!resampled && !factors) return 0;
    if (!resampled)
        return cli_error(cmd, "--train-data-upsampling-factors needs --dataset-resampled: the factors weight shards "
                         "drawn with replacement (as in OpenCLIP)");
    if (!d->path) return cli_error(cmd, "--dataset-resampled applies to webdataset shards given with --train-data");
    vlmoe_loader_params lp = vlmoe_loader_default_params();
    lp.data = *d, lp.resampled = resampled, lp.upsampling = factors;
    return vlmoe_loader_check_order(&lp) ? cli_error(cmd, "--train-data: %s", vlmoe_last_error()) : 0;
}

void cli_bad_warn(const char *cmd, const cli_bad_log *b, const char *what, const char *where) {
    if (!b->n) return;
    fprintf(stderr, "vlmoe %s: warning: skipped %ld %s%s of %s; first:", cmd, b->n, what, b->n == 1 ? "" : "s",
            where);
    for (long i = 0; i < b->n && i < 3; i++) fprintf(stderr, "%s %s", i ? ";" : "", b->first[i]);
    fputc('\n', stderr);
}

// ---------------------------------------------------------------------------------------------
// Image files

int cli_list_images(const char *cmd, const char *const *args, int nargs, char ***out, int *n) {
    return vlmoe_list_images(args, nargs, out, n) ? cli_error(cmd, "%s", vlmoe_last_error()) : 0;
}

int cli_plan(vlmoe_model *m, int n, int B) {
    const int b = n < B ? n : B;
    return vlmoe_model_plan(m, b > 1 ? b : 1);
}

int cli_encode_images(vlmoe_model *m, const char *const *paths, int n, const cli_encode_params *p, float *out,
                      uint8_t *ok, cli_bad_log *bad, int *n_ok) {
    cli_progress pr = {0};
    const vlmoe_encode_files_params ep = {
        .ip = p->ip, .batch_size = p->batch_size, .what = p->progress, .progress = cli_progress_cb,
        .progress_user = &pr, .after_batch = p->after_batch, .user = p->user,
    };
    const int st = vlmoe_encode_image_files(m, paths, n, &ep, out, ok, bad, n_ok);
    cli_progress_end(&pr);
    return st;
}

int cli_no_images(const char *cmd, const cli_bad_log *bad, int n) {
    if (n == 1) return cli_error(cmd, "%s", bad->first[0]);
    return cli_error(cmd, "none of the %d images could be read; first: %s", n, bad->first[0]);
}

int cli_take_multi(const char *cmd, const char *name, int argc, char **argv, int first, const char **vals,
                   int *nvals, char **rest, int *nrest) {
    const size_t k = strlen(name);
    *nvals = 0, *nrest = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const int is = i >= first && !strncmp(a, "--", 2) && !strncmp(a + 2, name, k);
        if (is && a[2 + k] == '=') {
            vals[(*nvals)++] = a + 3 + k;
        } else if (is && !a[2 + k]) {
            if (i + 1 >= argc || argv[i + 1][0] == '-') {
                fprintf(stderr, "vlmoe %s: --%s needs a value (see vlmoe %s --help)\n", cmd, name, cmd);
                return 2;
            }
            vals[(*nvals)++] = argv[++i];
        } else {
            rest[(*nrest)++] = argv[i];
            continue;
        }
        while (i + 1 < argc && argv[i + 1][0] != '-') vals[(*nvals)++] = argv[++i];
    }
    return 0;
}

// A JSON array of strings into a malloc'd vector; non-zero (printed) when an element is not a string.
static int json_strings(const char *cmd, const char *flag, const char *path, const cJSON *a, char ***out, size_t *n) {
    const int k = cJSON_GetArraySize(a);
    char **v = calloc(k ? (size_t)k : 1, sizeof(char *));
    if (!v) return cli_error(cmd, "out of memory");
    for (int i = 0; i < k; i++) {
        const cJSON *e = cJSON_GetArrayItem(a, i);
        if (!cJSON_IsString(e)) {
            cli_free_lines(v, (size_t)i);
            return cli_error(cmd, "%s %s: element %d is not a string", flag, path, i);
        }
        if (!(v[i] = strdup(e->valuestring))) return cli_free_lines(v, (size_t)i), cli_error(cmd, "out of memory");
    }
    *out = v, *n = (size_t)k;
    return 0;
}

static int read_json(const char *cmd, const char *flag, const char *path, const char *key, char ***out, size_t *n) {
    const char *why = NULL;
    FILE *f = vlmoe_fopen_regular(path, &why);
    if (!f) return cli_error(cmd, "%s %s: cannot open: %s", flag, path, why);
    char *buf = NULL;
    size_t len = 0, cap = 0, got;
    do {
        if (len + 4096 > cap) {
            char *b = realloc(buf, cap = 2 * cap + 4096 + 1);
            if (!b) return free(buf), fclose(f), cli_error(cmd, "out of memory");
            buf = b;
        }
        got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
    } while (got);
    fclose(f);
    buf[len] = 0;
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    if (!j) return cli_error(cmd, "%s %s: not valid JSON", flag, path);
    const cJSON *a = j;
    int rc = 0;
    if (cJSON_IsObject(j)) { // CLIP_benchmark: {"cifar10": [...], "imagenet1k": [...]}
        const int k = cJSON_GetArraySize(j);
        if (key) a = cJSON_GetObjectItemCaseSensitive(j, key);
        else if (k == 1) a = j->child;
        else a = NULL;
        if (!a && key) rc = cli_error(cmd, "%s %s has no dataset '%s' (--zeroshot-dataset)", flag, path, key);
        else if (!a) rc = cli_error(cmd, "%s %s holds the lists of %d datasets: pick one with --zeroshot-dataset NAME", flag,
                                    path, k);
    } else if (key) {
        rc = cli_error(cmd, "--zeroshot-dataset %s: %s %s is a list, not CLIP_benchmark's object of lists by dataset", key,
                       flag, path);
    }
    if (!rc && !cJSON_IsArray(a))
        rc = cli_error(cmd, "%s %s: expected a list of strings or an object of such lists by dataset (CLIP_benchmark's "
                       "format)", flag, path);
    if (!rc) rc = json_strings(cmd, flag, path, a, out, n);
    cJSON_Delete(j);
    return rc;
}

int cli_is_json(const char *path) {
    const size_t pl = path ? strlen(path) : 0;
    return pl > 5 && !strcasecmp(path + pl - 5, ".json");
}

int cli_read_texts(const char *cmd, const char *flag, const char *path, const char *key, int templates, char ***out,
                   size_t *n) {
    *out = NULL, *n = 0;
    const int json = cli_is_json(path);
    int rc = json ? read_json(cmd, flag, path, key, out, n) : cli_read_lines(cmd, path, out, n); // key: JSON only
    if (!rc && !*n) rc = cli_error(cmd, "%s %s: no %s", flag, path, templates ? "templates" : "class names");
    for (size_t i = 0; !rc && templates && i < *n; i++) {
        char *c = strstr((*out)[i], "{c}"); // CLIP_benchmark's placeholder: "a photo of a {c}."
        if (c) memmove(c + 1, c + 2, strlen(c + 2) + 1);
        if (!strstr((*out)[i], "{}"))
            rc = cli_error(cmd, "%s %s: template %zu ('%s') has no {} (or {c}) for the class name", flag, path, i + 1,
                           (*out)[i]);
    }
    if (rc) cli_free_lines(*out, *n), *out = NULL, *n = 0;
    return rc;
}

int cli_loader_agree(void *dist, uint8_t *k, size_t n) {
    vlmoe_dist *d = dist;
    return d->allreduce_max(d, k, n, VLMOE_DIST_U8);
}
