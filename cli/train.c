// train.c: `vlmoe train`: contrastive training behind OpenCLIP-style flags, on the built-in
// synthetic data or on an OpenCLIP CSV / webdataset shards through the loader (src/data/loader.h).
// Writes the resolved model config and training params, metrics as JSON lines, a progress line,
// the checkpoints, and on synthetic data a held-out evaluation at the end. Covered by
// tests/test_cli.c, tests/test_checkpoint.c and tests/test_loader.c.
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "common.h"
#include "data/loader.h"
#include "vlmoe.h"

typedef struct {
    const char *model, *dataset_type, *logs, *name, *optimizer, *scheduler, *pretrained, *preset;
    const char *resume, *csv_separator, *tokenizer, *image_mean, *image_std;
    int batch_size, image_size, context_length, threads, log_every, eval_samples, keep, workers;
    long steps, warmup, seed, cooldown, save_every, zeroshot_every, epochs, num_samples;
    double lr, wd, beta1, beta2, eps, grad_clip, max_bad;
    vlmoe_dataset_params data;   // --train-data and the CSV flags (path NULL: synthetic data)
} train_args;

// Everything a run holds; run_free releases whatever was set up.
typedef struct {
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_synth *data;           // synthetic data, or
    vlmoe_loader *loader;        // --train-data through the loader,
    cli_text text;               // its captions' tokenizer
    vlmoe_data_state resumed;    // the data position of the checkpoint resumed from
    FILE *metrics;
    float *images;
    int32_t *tokens, *lens;
    char dir[512], ckdir[600];
} train_run;

static void run_free(train_run *r) {
    if (r->metrics) fclose(r->metrics);
    vlmoe_loader_free(r->loader);
    cli_text_free(&r->text);
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_synth_free(r->data);
    free(r->images), free(r->tokens), free(r->lens);
}

// A JSON number that reads back as exactly the same double (metrics are compared bit for bit
// between a resumed and an uninterrupted run).
static cJSON *exact(double v) {
    char b[40];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(b, sizeof(b), "%.*g", digits, v);
        if (strtod(b, NULL) == v) break;
    }
    return isfinite(v) ? cJSON_CreateRaw(b) : cJSON_CreateNull();
}

static void fmt_eta(char *buf, size_t n, double s) {
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

// Held-out evaluation on the synthetic data: zero-shot top-1/top-5 over `n` class-balanced
// held-out images, and matched-pair retrieval accuracy in chunks of the batch size.
int cli_eval_synthetic(vlmoe_model *m, const vlmoe_synth *s, int n, int chunk, cli_eval *out) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, T = c->context_length, C = vlmoe_synth_num_classes(s);
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    float *img = malloc(sizeof(float) * isz * n), *ie = malloc(sizeof(float) * (size_t)n * E);
    float *te = malloc(sizeof(float) * (size_t)n * E), *ce = malloc(sizeof(float) * (size_t)C * E);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n * T), *lens = malloc(sizeof(int32_t) * n);
    int32_t *labels = malloc(sizeof(int32_t) * n);
    int st = img && ie && te && ce && tok && lens && labels ? VLMOE_OK : VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_HELDOUT, 0, n, T, img, tok, lens);
    for (int i = 0; i < n; i++) labels[i] = i % C; // held-out class of sample i (synthetic.c)
    if (!st) st = vlmoe_model_encode_images(m, img, n, ie);
    if (!st) st = vlmoe_model_encode_texts(m, tok, lens, n, te);
    if (!st) st = vlmoe_synth_class_embeddings(m, s, ce);
    if (!st) {
        vlmoe_zeroshot_accuracy(ie, n, ce, C, E, labels, &out->top1, &out->top5);
        vlmoe_pair_accuracy(ie, te, n, E, chunk, &out->i2t, &out->t2i);
        out->classes = C;
        out->chunk = chunk;
    }
    free(img), free(ie), free(te), free(ce), free(tok), free(lens), free(labels);
    return st;
}

cJSON *cli_moe_json(const vlmoe_moe_stats *ms, int n, double succ[2]) {
    static const char *mod[2] = {"image", "text"};
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        const vlmoe_moe_stats *x = &ms[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "encoder", x->encoder);
        cJSON_AddNumberToObject(o, "block", x->block);
        for (int m = 0; m < 2; m++) {
            if (!x->tokens[m]) continue;
            cJSON *t = cJSON_CreateObject();
            cJSON_AddNumberToObject(t, "tokens", x->tokens[m]);
            cJSON_AddNumberToObject(t, "success", x->success[m]);
            cJSON_AddNumberToObject(t, "dropped", x->dropped[m]);
            cJSON_AddNumberToObject(t, "mean_max_gate", x->mean_max_gate[m]);
            cJSON_AddNumberToObject(t, "entropy_pre", x->entropy_pre[m]);
            cJSON_AddNumberToObject(t, "entropy_post", x->entropy_post[m]);
            cJSON_AddNumberToObject(t, "experts_used", x->experts_used[m]);
            if (x->routed[m]) {
                cJSON_AddItemToObject(t, "routed", cJSON_CreateDoubleArray(x->routed[m], x->num_experts));
                cJSON_AddItemToObject(t, "accepted", cJSON_CreateDoubleArray(x->accepted[m], x->num_experts));
            }
            cJSON_AddItemToObject(o, mod[m], t);
            if (succ && x->success[m] < succ[m]) succ[m] = x->success[m];
        }
        cJSON *aux = cJSON_CreateObject();
        for (int k = 0; k < VLMOE_AUX_COUNT; k++)
            if (x->aux[k] != 0) cJSON_AddNumberToObject(aux, vlmoe_aux_name((vlmoe_aux_kind)k), x->aux[k]);
        cJSON_AddItemToObject(o, "aux", aux);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static const char *USAGE =
    "usage: vlmoe train [options]\n\n"
    "Trains a contrastive image-text model (LIMoE one_tower or CLIP two_tower, dense or MoE) and\n"
    "writes LOGS/NAME/{config.json, params.json, metrics.jsonl, checkpoints/step_N.safetensors}.\n"
    "A checkpoint is step_N.safetensors (weights + config, loadable by every command) plus\n"
    "step_N.state.safetensors (optimizer moments, step, RNG states, data position); --resume latest\n"
    "continues exactly where the newest complete checkpoint left off, with the next samples.\n\n"
    "Data: the built-in synthetic data, or --train-data: an OpenCLIP CSV/TSV (image paths relative to\n"
    "its folder) or webdataset shards (000123.jpg + 000123.txt), read by --workers threads that\n"
    "decode, random-resized-crop to the model's image size, normalise (--image-mean/--image-std)\n"
    "and tokenize ahead of the step; shuffled per epoch from --seed, the same for any --workers.\n"
    "Bad samples are skipped and counted; more than --max-bad-fraction of them stops the run.\n"
    "Without --tokenizer, a model with at least 514 ids gets a BPE vocabulary trained on the first\n"
    "10000 captions (saved as LOGS/NAME/tokenizer.txt, for vlmoe eval --tokenizer); a smaller one\n"
    "uses the synthetic data's word tokenizer.\n\n"
    "examples:\n"
    "  vlmoe train --model limoe-tiny --dataset-type synthetic --steps 300\n"
    "  vlmoe train --model limoe-S/32 --train-data cc3m.csv --csv-separator , --csv-img-key file \\\n"
    "              --csv-caption-key caption --tokenizer bpe_simple_vocab_16e6.txt.gz --workers 4\n"
    "  vlmoe train --model limoe-B/16 --train-data 'shards/train-{000000..000099}.tar' --steps 5000\n"
    "  vlmoe train --model my_config.json --batch-size 128 --lr 5e-4 --warmup 500 --steps 20000 \\\n"
    "              --save-frequency 1000 --zeroshot-frequency 1000 --name run1\n"
    "  vlmoe train --name run1 --steps 20000 --resume latest      (same flags as the first run)";

// Sets up a fresh model, a --pretrained one, or a resumed run (newest complete checkpoint first,
// falling back to older ones when one is unreadable).
static int setup_model(const train_args *a, const vlmoe_train_params *tp, train_run *r) {
    const char *cmd = "train";
    if (a->resume) {
        char w[1024];
        if (ckpt_resume(cmd, r->ckdir, a->resume, tp, a->batch_size, &r->m, &r->t, &r->resumed, w, sizeof(w))) return 1;
        fprintf(stderr, "vlmoe train: resuming from %s (step %ld)\n", w, vlmoe_trainer_get_step(r->t));
        return 0;
    }
    vlmoe_model_config cfg;
    if (a->pretrained) {
        if (vlmoe_model_load(&r->m, a->pretrained)) return cli_error(cmd, "--pretrained: %s", vlmoe_last_error());
        cfg = *vlmoe_model_get_config(r->m);
        if ((a->image_size && a->image_size != cfg.image_size) || (a->context_length && a->context_length != cfg.context_length))
            return cli_error(cmd, "--image-size/--context-length cannot change a pretrained model");
    } else {
        if (vlmoe_config_load(a->model, &cfg)) return cli_error(cmd, "%s", vlmoe_last_error());
        if (a->image_size) cfg.image_size = a->image_size;
        if (a->context_length) cfg.context_length = a->context_length;
    }
    if (a->preset) { // the preset's routing and losses on the model's own MoE layers
        const int two = cfg.arch == VLMOE_ARCH_TWO_TOWER;
        if (cfg.moe.router == VLMOE_ROUTER_NONE && !(two && cfg.text_moe.router != VLMOE_ROUTER_NONE))
            return cli_error(cmd, "--preset %s: model '%s' has no MoE layers (make some with vlmoe upcycle)", a->preset, cfg.name);
        int st = cfg.moe.router != VLMOE_ROUTER_NONE ? vlmoe_moe_preset(a->preset, &cfg.moe) : VLMOE_OK;
        if (!st && two && cfg.text_moe.router != VLMOE_ROUTER_NONE) st = vlmoe_moe_preset(a->preset, &cfg.text_moe);
        if (st) return cli_error(cmd, "--preset: %s", vlmoe_last_error());
    }
    if (!a->pretrained || a->preset) {
        vlmoe_model *m = NULL;
        if (vlmoe_model_init(&m, &cfg, (uint64_t)a->seed)) return cli_error(cmd, "%s", vlmoe_last_error());
        if (r->m) { // the pretrained weights under the preset's config (same tensors)
            if (vlmoe_model_num_floats(m) != vlmoe_model_num_floats(r->m)) {
                vlmoe_model_free(m);
                return cli_error(cmd, "--preset %s changes the shapes of %s's tensors", a->preset, a->pretrained);
            }
            memcpy(vlmoe_model_param_data(m), vlmoe_model_param_data(r->m), sizeof(float) * vlmoe_model_num_floats(m));
            vlmoe_model_free(r->m);
        }
        r->m = m;
    }
    if (vlmoe_model_plan(r->m, a->batch_size) || vlmoe_trainer_init(&r->t, r->m, tp))
        return cli_error(cmd, "%s", vlmoe_last_error());
    return 0;
}

static int write_run_files(const train_args *a, train_run *r) {
    char path[1024];
    char *cj = vlmoe_config_to_json(vlmoe_model_get_config(r->m));
    snprintf(path, sizeof(path), "%s/config.json", r->dir);
    int wr = !cj || cli_write_text(path, cj);
    free(cj);
    cJSON *pj = cJSON_CreateObject();
    cJSON_AddStringToObject(pj, "model", a->pretrained ? a->pretrained : a->model);
    cJSON_AddStringToObject(pj, "dataset_type", a->dataset_type);
    if (r->loader) {
        cJSON_AddStringToObject(pj, "train_data", a->data.path);
        cJSON_AddNumberToObject(pj, "workers", a->workers);
        cJSON_AddNumberToObject(pj, "max_bad_fraction", a->max_bad);
    }
    cJSON_AddNumberToObject(pj, "batch_size", a->batch_size);
    cJSON_AddNumberToObject(pj, "steps", (double)a->steps);
    cJSON_AddNumberToObject(pj, "lr", a->lr);
    cJSON_AddNumberToObject(pj, "wd", a->wd);
    cJSON_AddNumberToObject(pj, "warmup", (double)a->warmup);
    cJSON_AddStringToObject(pj, "lr_scheduler", a->scheduler);
    cJSON_AddStringToObject(pj, "optimizer", a->optimizer);
    cJSON_AddNumberToObject(pj, "grad_clip_norm", a->grad_clip);
    cJSON_AddNumberToObject(pj, "seed", (double)a->seed);
    cJSON_AddNumberToObject(pj, "save_frequency", (double)a->save_every);
    cJSON_AddNumberToObject(pj, "threads", omp_get_max_threads());
    char *ps = cJSON_Print(pj);
    cJSON_Delete(pj);
    snprintf(path, sizeof(path), "%s/params.json", r->dir);
    wr |= !ps || cli_write_text(path, ps);
    free(ps);
    snprintf(path, sizeof(path), "%s/metrics.jsonl", r->dir);
    r->metrics = fopen(path, a->resume ? "a" : "w");
    return wr || !r->metrics ? cli_error("train", "cannot write into %s: %s", r->dir, strerror(errno)) : 0;
}

static int save_checkpoint(train_run *r, long step, int keep, int B) {
    char w[1024], s[1024];
    ckpt_paths(r->ckdir, step, w, s, sizeof(w));
    vlmoe_data_state ds;
    memset(&ds, 0, sizeof(ds));
    ds.data_position = (uint64_t)step * (uint64_t)B;
    if (r->loader) vlmoe_loader_position(r->loader, &ds);
    if (vlmoe_trainer_save(r->t, w, s, &ds)) return cli_error("train", "checkpoint: %s", vlmoe_last_error());
    if (keep > 0) ckpt_prune(r->ckdir, keep);
    return 0;
}

static void log_eval(train_run *r, long step, int n, int B) {
    cli_eval ev;
    if (cli_eval_synthetic(r->m, r->data, n, B, &ev)) {
        fprintf(stderr, "vlmoe train: evaluation failed: %s\n", vlmoe_last_error());
        return;
    }
    printf("step %ld held-out: zero-shot top-1 %.1f%% top-5 %.1f%% (%d classes, chance %.1f%%); "
           "pair accuracy i2t %.1f%% t2i %.1f%% (in chunks of %d, chance %.1f%%)\n",
           step, 100 * ev.top1, 100 * ev.top5, ev.classes, 100.0 / ev.classes, 100 * ev.i2t, 100 * ev.t2i,
           ev.chunk, 100.0 / ev.chunk);
    fflush(stdout);
    fprintf(r->metrics, "{\"step\":%ld,\"eval_zeroshot_top1\":%.6f,\"eval_zeroshot_top5\":%.6f,"
            "\"eval_pair_i2t\":%.6f,\"eval_pair_t2i\":%.6f}\n", step, ev.top1, ev.top5, ev.i2t, ev.t2i);
    fflush(r->metrics);
}

// Opens --train-data once before anything is written, so that a missing file or shard, a bad CSV
// header or shard pattern stops the run at once. count (may be NULL) gets a CSV's usable rows.
static int check_data(const vlmoe_dataset_params *dp, long *count) {
    vlmoe_dataset_params p = *dp;
    p.defer_images = 1;
    vlmoe_dataset *ds = NULL;
    int st = vlmoe_dataset_open(&p, &ds);
    if (!st && count && vlmoe_dataset_get_type(ds) != VLMOE_DATASET_CSV)
        st = vlmoe_fail(VLMOE_ERR_ARG, "%s: give --train-num-samples with --epochs (the samples in webdataset "
                        "shards are not known before reading them)", dp->path);
    if (count) *count = 0;
    vlmoe_sample s;
    int got = 0;
    while (!st && count && (got = vlmoe_dataset_next(ds, &s)) == 1) ++*count;
    if (got < 0) st = -got;
    vlmoe_dataset_free(ds);
    return st ? cli_error("train", "--train-data: %s", vlmoe_last_error()) : 0;
}

enum { VOCAB_CAPTIONS = 10000 };

// A BPE vocabulary for a model that has none: trained on the first captions of the data (file
// order) up to the model's vocabulary size and saved where a resumed run finds it.
static int train_vocabulary(const vlmoe_dataset_params *dp, int vocab_size, const char *path) {
    vlmoe_dataset_params p = *dp;
    p.defer_images = 1;
    vlmoe_dataset *ds = NULL;
    char **texts = calloc(VOCAB_CAPTIONS, sizeof(char *));
    size_t n = 0;
    int st = texts ? vlmoe_dataset_open(&p, &ds) : vlmoe_fail(VLMOE_ERR_NOMEM, "caption list"), got = 0;
    vlmoe_sample s;
    while (!st && n < VOCAB_CAPTIONS && (got = vlmoe_dataset_next(ds, &s)) == 1)
        if (!(texts[n++] = strdup(s.caption))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "caption list");
    if (!st && got < 0) st = -got;
    vlmoe_tokenizer *tok = NULL;
    if (!st) st = vlmoe_tokenizer_train(&tok, (const char *const *)texts, n, vocab_size);
    if (!st) st = vlmoe_tokenizer_save_clip(tok, path);
    if (!st)
        fprintf(stderr, "vlmoe train: no --tokenizer: trained a BPE vocabulary of %d ids on the first %zu captions "
                "of %s, saved as %s (give it to vlmoe eval as --tokenizer)\n", vlmoe_tokenizer_vocab_size(tok), n,
                dp->path, path);
    vlmoe_tokenizer_free(tok);
    vlmoe_dataset_free(ds);
    for (size_t i = 0; i < n; i++) free(texts[i]);
    free(texts);
    return st ? cli_error("train", "vocabulary for %s: %s", dp->path, vlmoe_last_error()) : 0;
}

// The tokenizer of the captions: --tokenizer, else the vocabulary this run trained (trained now on
// a first run), else for a model with too few ids for BPE the synthetic data's word tokenizer.
static int setup_text(const train_args *a, const vlmoe_model_config *c, train_run *r) {
    char path[1024];
    const char *use = a->tokenizer;
    if (!use && c->vocab_size >= 514) {
        snprintf(path, sizeof(path), "%s/tokenizer.txt", r->dir);
        use = path;
        if (access(path, R_OK) == 0)
            fprintf(stderr, "vlmoe train: captions are tokenized with %s, the vocabulary this run trained\n", path);
        else if (train_vocabulary(&a->data, c->vocab_size, path))
            return 1;
    }
    if (cli_text_init("train", use, c, 1, &r->text)) return 1;
    if (!use)
        fprintf(stderr, "vlmoe train: captions are tokenized with the synthetic data's word tokenizer (the model's "
                "%d ids are too few for BPE; --tokenizer FILE for another)\n", c->vocab_size);
    return 0;
}

// The loader over --train-data: the model's image size, --image-mean/--image-std, the tokenizer
// above; a resumed run continues at the checkpoint's data position.
static int setup_loader(const train_args *a, const vlmoe_model_config *c, train_run *r) {
    if (c->channels != 3) return cli_error("train", "model %s has %d image channels; images are RGB", c->name, c->channels);
    vlmoe_loader_params lp = vlmoe_loader_default_params();
    if (cli_image_params("train", a->image_mean, a->image_std, c, &lp.image) || setup_text(a, c, r)) return 1;
    lp.data = a->data;
    lp.seed = (uint64_t)a->seed;
    lp.batch_size = a->batch_size;
    lp.context_length = c->context_length;
    lp.tokenize = cli_tokenize, lp.tokenize_user = &r->text;
    lp.workers = a->workers;
    lp.max_bad_fraction = a->max_bad;
    if (vlmoe_loader_open(&lp, &r->loader) || (a->resume && vlmoe_loader_seek(r->loader, &r->resumed)))
        return cli_error("train", "--train-data: %s", vlmoe_last_error());
    const int64_t rows = vlmoe_loader_epoch_size(r->loader);
    char what[64] = "webdataset shards";
    if (rows >= 0) snprintf(what, sizeof(what), "%lld usable rows", (long long)rows);
    fprintf(stderr, "vlmoe train: data %s (%s), %d loader workers\n", a->data.path, what, a->workers);
    return 0;
}

// A warning with the bad-sample counts and the first messages, if there were any.
static void warn_bad(const train_run *r, const char *path) {
    const vlmoe_dataset_stats *st = r->loader ? vlmoe_loader_stats(r->loader) : NULL;
    if (!st || !vlmoe_dataset_stats_bad(st)) return;
    char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
    vlmoe_dataset_stats_format(st, sum, sizeof(sum));
    fprintf(stderr, "vlmoe train: warning: %s: %s\n", path, sum);
}

int cmd_train(int argc, char **argv) {
    train_args a = {.model = "tiny", .logs = "./logs", .optimizer = "adamw", .scheduler = "cosine",
                    .csv_separator = "\t", .batch_size = 64, .log_every = 10, .eval_samples = 1000, .keep = 3,
                    .workers = 2, .steps = 300, .warmup = 30, .lr = NAN, .wd = NAN, .beta1 = 0.9, .beta2 = 0.98,
                    .eps = 1e-6, .grad_clip = 1.0, .max_bad = 0.1};
    a.data = vlmoe_dataset_default_params();
    long steps_given = -1, epochs = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "NAME|FILE.json", "model config: a name (tiny, limoe-tiny, S/32, B/16, ViT-B-16, ...) or a JSON file"},
        {"pretrained", ARG_STRING, &a.pretrained, "FILE", "start from a vlmoe checkpoint (its config replaces --model)"},
        {"preset", ARG_STRING, &a.preset, "NAME", "routing and losses of the model's MoE layers: clipup (CLIP-UP; also lr 5e-5 "
                                                  "and wd 0.05, its upcycled phase, unless given) or limoe"},
        {"train-data", ARG_STRING, &a.data.path, "PATH", "image-text pairs: an OpenCLIP CSV/TSV file, or webdataset shards "
                                                       "('train-{000000..000099}.tar', lists joined by '::')"},
        {"dataset-type", ARG_STRING, &a.dataset_type, "TYPE", "synthetic (built-in; the default without --train-data), csv, "
                                                             "webdataset, auto (by the name; the default with it)"},
        {"csv-separator", ARG_STRING, &a.csv_separator, "C", "CSV field separator (default tab; \\t for tab)"},
        {"csv-img-key", ARG_STRING, &a.data.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &a.data.caption_key, "NAME", "CSV column of captions (default title)"},
        {"workers", ARG_INT, &a.workers, "N", "threads loading --train-data ahead of the step (default 2; 0: the training thread)"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "captions' vocabulary: CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &a.image_mean, "R,G,B", "normalisation mean of --train-data (default CLIP's; [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &a.image_std, "R,G,B", "normalisation std of --train-data (default CLIP's; [-1, 1]: 0.5)"},
        {"max-bad-fraction", ARG_DOUBLE, &a.max_bad, "F", "stop when more than this fraction of samples is bad (default 0.1)"},
        {"train-num-samples", ARG_LONG, &a.num_samples, "N", "samples per epoch for --epochs (synthetic: 10000; CSV: its rows)"},
        {"batch-size", ARG_INT, &a.batch_size, "N", "image-text pairs per step (default 64)"},
        {"steps", ARG_LONG, &steps_given, "N", "optimisation steps (default 300)"},
        {"epochs", ARG_LONG, &epochs, "N", "train for N epochs of --train-num-samples instead of --steps"},
        {"lr", ARG_DOUBLE, &a.lr, "LR", "peak learning rate (default 1e-3; --preset clipup: 5e-5)"},
        {"wd", ARG_DOUBLE, &a.wd, "WD", "decoupled weight decay on weight matrices (default 0.1; --preset clipup: 0.05)"},
        {"beta1", ARG_DOUBLE, &a.beta1, "B1", "AdamW beta1 / Adafactor momentum (default 0.9)"},
        {"beta2", ARG_DOUBLE, &a.beta2, "B2", "AdamW beta2 (default 0.98)"},
        {"eps", ARG_DOUBLE, &a.eps, "EPS", "AdamW epsilon (default 1e-6)"},
        {"warmup", ARG_LONG, &a.warmup, "N", "linear warmup steps (default 30)"},
        {"lr-scheduler", ARG_STRING, &a.scheduler, "KIND", "cosine (default), rsqrt (with --lr-cooldown-steps), const"},
        {"lr-cooldown-steps", ARG_LONG, &a.cooldown, "N", "rsqrt: linear cooldown to 0 over the last N steps"},
        {"optimizer", ARG_STRING, &a.optimizer, "NAME", "adamw (default) or adafactor"},
        {"grad-clip-norm", ARG_DOUBLE, &a.grad_clip, "NORM", "clip the global gradient norm (default 1.0, 0 = off)"},
        {"seed", ARG_LONG, &a.seed, "N", "seed of the initialisation and the data order (default 0)"},
        {"image-size", ARG_INT, &a.image_size, "PX", "override the model's image size"},
        {"context-length", ARG_INT, &a.context_length, "N", "override the model's text context length"},
        {"logs", ARG_STRING, &a.logs, "DIR", "where runs are written (default ./logs)"},
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: date-time and model; needed by --resume latest)"},
        {"save-frequency", ARG_LONG, &a.save_every, "N", "write a checkpoint every N steps (default: at the end only)"},
        {"keep-checkpoints", ARG_INT, &a.keep, "K", "keep the newest K checkpoints (default 3, 0 = all)"},
        {"resume", ARG_STRING, &a.resume, "latest|FILE", "continue a run exactly: its newest complete checkpoint, or step_N.safetensors"},
        {"zeroshot-frequency", ARG_LONG, &a.zeroshot_every, "N", "held-out zero-shot evaluation every N steps (default: at the end)"},
        {"eval-samples", ARG_INT, &a.eval_samples, "N", "held-out samples per evaluation (default 1000, 0 = none)"},
        {"log-every-n-steps", ARG_INT, &a.log_every, "N", "metrics and progress every N steps (default 10)"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    int rc = args_parse("train", specs, nspec, argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (a.threads > 0) omp_set_num_threads(a.threads);
    // CLIP-UP sec. 4: the upcycled model trains on with the learning rate and weight decay
    // reduced from the dense phase's 5e-4 / 0.2 to 5e-5 / 0.05
    const int clipup = a.preset && !strcmp(a.preset, "clipup");
    if (isnan(a.lr)) a.lr = clipup ? 5e-5 : 1e-3;
    if (isnan(a.wd)) a.wd = clipup ? 0.05 : 0.1;
    a.dataset_type = a.dataset_type ? a.dataset_type : a.data.path ? "auto" : "synthetic";
    const int synthetic = !strcmp(a.dataset_type, "synthetic");
    if (synthetic && a.data.path)
        return cli_error("train", "--train-data: --dataset-type synthetic trains on the built-in data (csv, webdataset or "
                         "auto read --train-data)");
    if (!synthetic) {
        if (cli_dataset_type("train", a.dataset_type, 1, &a.data.type)) return 1;
        if (!a.data.path) return cli_error("train", "--dataset-type %s needs --train-data PATH", a.dataset_type);
        if (cli_separator("train", a.csv_separator, &a.data.separator)) return 1;
        if (a.workers < 0 || !(a.max_bad >= 0 && a.max_bad <= 1))
            return cli_error("train", "--workers must be >= 0 and --max-bad-fraction in [0, 1]");
    }
    if (a.batch_size < 2) return cli_error("train", "--batch-size must be >= 2 for a contrastive loss");
    if (epochs > 0 && steps_given >= 0) return cli_error("train", "give --steps or --epochs, not both");
    if (!synthetic && (rc = check_data(&a.data, epochs > 0 && a.num_samples <= 0 ? &a.num_samples : NULL))) return rc;
    if (synthetic && a.num_samples <= 0) a.num_samples = 10000;
    if (epochs > 0) {
        if (a.num_samples < 1) return cli_error("train", "--train-num-samples must be >= 1");
        a.steps = (epochs * a.num_samples + a.batch_size - 1) / a.batch_size;
    } else if (steps_given >= 0) {
        a.steps = steps_given;
    }
    a.epochs = epochs;
    if (a.steps < 1) return cli_error("train", "--steps must be >= 1");
    if (a.log_every < 1) a.log_every = 1;
    if (a.resume && !strcmp(a.resume, "latest") && !a.name)
        return cli_error("train", "--resume latest needs --name (the run to continue)");

    vlmoe_train_params tp = vlmoe_train_default_params();
    if (!strcmp(a.optimizer, "adafactor")) tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    else if (strcmp(a.optimizer, "adamw")) return cli_error("train", "--optimizer %s: expected adamw or adafactor", a.optimizer);
    tp.optim.beta1 = (float)a.beta1;
    if (tp.optim.kind == VLMOE_OPT_ADAMW) {
        tp.optim.beta2 = (float)a.beta2;
        tp.optim.eps = (float)a.eps;
    } else if (a.beta1 == 0.9) {
        tp.optim.beta1 = 0; // Adafactor: no momentum unless asked for
    }
    tp.optim.weight_decay = (float)a.wd;
    tp.grad_clip_norm = a.grad_clip;
    int sk = !strcmp(a.scheduler, "cosine") ? VLMOE_SCHED_COSINE : !strcmp(a.scheduler, "rsqrt") ? VLMOE_SCHED_RSQRT
             : !strcmp(a.scheduler, "const") ? VLMOE_SCHED_CONST : -1;
    if (sk < 0) return cli_error("train", "--lr-scheduler %s: expected cosine, rsqrt or const", a.scheduler);
    tp.schedule = (vlmoe_schedule){(vlmoe_sched_kind)sk, a.lr, a.warmup, a.steps, 0.0, a.cooldown, 0.0};

    train_run r;
    memset(&r, 0, sizeof(r));
    if (a.resume && strcmp(a.resume, "latest")) { // LOGS/NAME/checkpoints/step_N.safetensors
        snprintf(r.dir, sizeof(r.dir), "%s", a.resume);
        for (int up = 0; up < 2; up++) {
            char *slash = strrchr(r.dir, '/');
            if (slash) *slash = 0;
            else snprintf(r.dir, sizeof(r.dir), ".");
        }
    } else if (a.name) {
        snprintf(r.dir, sizeof(r.dir), "%s/%s", a.logs, a.name);
    } else {
        char ts[64], model[64];
        time_t t0 = time(NULL);
        strftime(ts, sizeof(ts), "%Y_%m_%d-%H_%M_%S", localtime(&t0));
        snprintf(model, sizeof(model), "%s", a.pretrained ? "pretrained" : a.model);
        for (char *p = model; *p; p++)
            if (*p == '/') *p = '-'; // model names like S/32
        snprintf(r.dir, sizeof(r.dir), "%s/%s-model_%s-lr_%g-b_%d", a.logs, ts, model, a.lr, a.batch_size);
    }
    snprintf(r.ckdir, sizeof(r.ckdir), "%s/checkpoints", r.dir);
    if (cli_mkdir_p(r.ckdir)) return cli_error("train", "cannot create %s: %s", r.ckdir, strerror(errno));
    ckpt_clean_tmp(r.ckdir);
    if ((rc = setup_model(&a, &tp, &r))) {
        run_free(&r);
        return rc;
    }
    const vlmoe_model_config *cfg = vlmoe_model_get_config(r.m);
    const int B = a.batch_size, T = cfg->context_length;
    if (!synthetic) {
        rc = setup_loader(&a, cfg, &r);
    } else {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = cfg->image_size;
        sp.seed = (uint64_t)a.seed;
        if (vlmoe_synth_init(&r.data, &sp)) {
            rc = cli_error("train", "synthetic data: %s", vlmoe_last_error());
        } else if (vlmoe_synth_vocab_size(r.data) > cfg->vocab_size || cfg->channels != 3) {
            rc = cli_error("train", "model %s: the synthetic data needs channels 3 and vocab_size >= %d", cfg->name,
                           vlmoe_synth_vocab_size(r.data));
        }
        const size_t isz = (size_t)3 * cfg->image_size * cfg->image_size;
        r.images = malloc(sizeof(float) * isz * B);
        r.tokens = malloc(sizeof(int32_t) * (size_t)B * T);
        r.lens = malloc(sizeof(int32_t) * B);
        if (!rc && (!r.images || !r.tokens || !r.lens)) rc = cli_error("train", "out of memory");
    }
    if (!rc) rc = write_run_files(&a, &r);
    if (rc) {
        run_free(&r);
        return rc;
    }
    const long start = vlmoe_trainer_get_step(r.t);
    const int tty = isatty(fileno(stderr));
    fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d pairs, %d threads, run %s\n",
            cfg->name, vlmoe_model_num_floats(r.m), start, a.steps, B, omp_get_max_threads(), r.dir);
    double t_start = cli_now(), t_last = t_start, sum_loss = 0;
    long last_step = start;
    for (long step = start; step < a.steps && !rc; step++) {
        vlmoe_batch batch = {B, r.images, r.tokens, r.lens};
        if (r.loader ? vlmoe_loader_next(r.loader, &batch, NULL)
                     : vlmoe_synth_batch(r.data, VLMOE_SPLIT_TRAIN, (uint64_t)step * B, B, T, r.images, r.tokens, r.lens)) {
            rc = cli_error("train", "data: %s", vlmoe_last_error());
            break;
        }
        vlmoe_step_stats s;
        if (vlmoe_trainer_step(r.t, &batch, &s)) {
            rc = cli_error("train", "diverged: %s. Nothing was written for this step; continue from the last "
                           "checkpoint with --resume latest (lower --lr or raise --warmup)", vlmoe_last_error());
            break;
        }
        sum_loss += s.loss;
        const long done = step + 1;
        if (done % a.log_every == 0 || done == a.steps) {
            double t = cli_now(), per = (t - t_last) / (double)(done - last_step), ips = B / per;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "step", (double)done);
            cJSON_AddItemToObject(o, "loss", exact(s.loss));
            cJSON_AddItemToObject(o, "contrastive_loss", exact(s.contrastive));
            cJSON_AddItemToObject(o, "aux_loss", exact(s.aux));
            cJSON_AddNumberToObject(o, "loss_avg", sum_loss / (double)(done - last_step));
            cJSON_AddNumberToObject(o, "acc_i2t", s.acc_i2t);
            cJSON_AddNumberToObject(o, "acc_t2i", s.acc_t2i);
            cJSON_AddNumberToObject(o, "lr", s.lr);
            cJSON_AddNumberToObject(o, "temperature", s.temperature);
            cJSON_AddNumberToObject(o, "grad_norm", s.grad_norm);
            cJSON_AddNumberToObject(o, "images_per_s", ips);
            cJSON_AddNumberToObject(o, "s_per_step", per);
            if (r.loader) {
                vlmoe_data_state pos;
                vlmoe_loader_position(r.loader, &pos);
                cJSON_AddNumberToObject(o, "epoch", (double)pos.data_epoch);
                cJSON_AddNumberToObject(o, "bad_samples", (double)vlmoe_dataset_stats_bad(vlmoe_loader_stats(r.loader)));
            }
            double succ[2] = {1, 1};
            int nmoe;
            const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(r.m, &nmoe);
            if (nmoe) cJSON_AddItemToObject(o, "moe", cli_moe_json(ms, nmoe, succ));
            char *line = cJSON_PrintUnformatted(o);
            fprintf(r.metrics, "%s\n", line);
            fflush(r.metrics);
            free(line);
            cJSON_Delete(o);
            char eta[32], moe[64] = "";
            fmt_eta(eta, sizeof(eta), per * (double)(a.steps - done));
            if (nmoe) snprintf(moe, sizeof(moe), "  aux %.4f  success %.2f/%.2f", s.aux, succ[0], succ[1]);
            fprintf(stderr, "%sstep %ld/%ld  loss %.4f (avg %.4f)%s  acc %.2f/%.2f  T %.1f  lr %.2e  %.0f img/s  ETA %s%s",
                    tty ? "\r\033[K" : "", done, a.steps, s.loss, sum_loss / (double)(done - last_step), moe,
                    s.acc_i2t, s.acc_t2i, s.temperature, s.lr, ips, eta, tty ? "" : "\n");
            t_last = t;
            last_step = done;
            sum_loss = 0;
        }
        if ((a.save_every > 0 && done % a.save_every == 0) || done == a.steps) {
            if (tty) fputc('\n', stderr);
            rc = save_checkpoint(&r, done, a.keep, B);
        }
        if (!rc && synthetic && a.eval_samples > 0 && a.zeroshot_every > 0 && done % a.zeroshot_every == 0 &&
            done != a.steps) {
            if (tty) fputc('\n', stderr);
            log_eval(&r, done, a.eval_samples, B);
        }
    }
    if (!rc) {
        fprintf(stderr, "%strained to step %ld in %.1f s; checkpoints in %s\n", tty ? "\n" : "", a.steps,
                cli_now() - t_start, r.ckdir);
        if (synthetic && a.eval_samples > 0) log_eval(&r, a.steps, a.eval_samples, B);
    }
    if (!rc) warn_bad(&r, a.data.path);   // a run stopped by bad samples said so with the counts
    run_free(&r);
    return rc;
}
