// vlmoe_train.c: `vlmoe train --model <mome model> --codebook FILE` (the codebook of `vlmoe vq
// train`, cli/vq.c) pretrains with the three masked-modeling objectives of sec. 3.1 on three
// streams: images (MIM, 40% block masks), texts (MLM, 15%) and image-text pairs (VLM: 50% of the
// text plus MIM), in equal thirds of each step by default (--mix), their losses summed with the MoE auxiliary losses. The streams come
// from the synthetic data, or an image folder, a text file and a caption dataset read by the loader
// (src/data/loader.h). Every log step it reports the routing of each stream (eval-mode forwards);
// checkpoints resume bit for bit. Covered by tests/test_vlmoe_train.c (library parts: tests/test_mome.c).
#include <cjson/cJSON.h>
#include <errno.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "train/run.h"
#include "common.h"
#include "data/loader.h"
#include "tokenize.h"
#include "vlmoe_train.h"

// ---------------------------------------------------------------------------------------------
// vlmoe train (arch mome)

static const char *model_flag(int argc, char **argv) {
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) return argv[i + 1];
        if (!strncmp(argv[i], "--model=", 8)) return argv[i] + 8;
    }
    return NULL;
}

int cli_train_is_mome(int argc, char **argv) {
    const char *m = model_flag(argc, argv);
    vlmoe_model_config c;
    return m && vlmoe_config_load(m, &c) == VLMOE_OK && c.arch == VLMOE_ARCH_MOME;
}

static const char *CMD = "train";

enum { S_IMAGE = 0, S_TEXT = 1, S_PAIR = 2, NSTREAMS = 3 };
static const char *const STREAM_NAME[NSTREAMS] = {"image", "text", "pair"};
// Where a stream's samples come from.
enum { SRC_NONE = 0, SRC_SYNTH, SRC_LOADER, SRC_FOLDER, SRC_LINES };

typedef struct {
    const char *model, *codebook, *logs, *name, *mix, *image_data, *text_data, *resume, *scheduler;
    const char *dataset_type, *csv_separator, *tokenizer, *image_mean, *image_std;
    int batch, log_every, keep, workers, threads;
    long steps, warmup, seed, save_every;
    double lr, wd, max_bad;
    vlmoe_dataset_params data;   // --train-data and the CSV flags
} mome_args;

// One stream's samples of the current step, and their masked-modeling inputs and targets.
typedef struct {
    int src;                 // SRC_*; SRC_NONE: dropped (weight 0)
    int n;                   // samples per step
    float *img;              // (n, 3, S, S): image and pair streams
    int32_t *tok, *len;      // (n, T), (n): text and pair streams, as read
    int32_t *tin, *tl;       // (n, T): MLM input (after corruption) and labels
    int32_t *pl;             // (n, num_patches): MIM labels
} mome_stream;

// The order of a file-backed stream (an image folder, a text file) of n items: its sample i is
// item perm_e[i mod n] with e = i / n and perm_e drawn from (seed, stream, e), so every item comes
// once per epoch and the samples of any step follow from the step alone (nothing to checkpoint).
typedef struct {
    uint32_t *perm, n;
    int64_t epoch;           // whose permutation perm holds (-1: none yet)
    uint64_t seed;
} file_order;

// Everything a run holds; run_free releases whatever was set up.
typedef struct {
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_model_config cfg;
    mome_stream s[NSTREAMS];
    int chunk;                           // samples per forward (see chunking in cmd_train_mome)
    vlmoe_synth *synth;                  // synthetic streams: one vlmoe_synth_batch of n_synth
    int n_synth;
    float *syn_img;
    int32_t *syn_tok, *syn_len;
    vlmoe_loader *loader;                // --train-data streams: one loader batch of n_loader
    int n_loader;
    cli_text text;                       // tokenizer of --text-data and --train-data captions
    vlmoe_image_params ip;               // transform of --image-data and --train-data images
    char **images;                       // --image-data files, sorted
    int n_images;
    file_order img_order;
    int *slot_file;                      // (n) file of each image of the step
    char (*slot_msg)[VLMOE_BAD_MSG_LEN]; // (n) why a file was skipped
    cli_bad_log bad_images;              // the first distinct reasons to skip one
    long n_bad_images;
    char **lines;                        // --text-data sentences, with their line numbers
    long *lineno;
    size_t n_lines;
    file_order txt_order;
    float *cb;                           // codebook (K, C*P*P)
    int K;
    vlmoe_mlm_params mlm, vlm;           // text masking of MLM (15%) and VLM (50%)
    int nparts;                          // forwards per step: batch / chunk
    vlmoe_mome_batch *parts;             // (nparts)
    vlmoe_mome_stats *part_stats;        // (nparts)
    int *part_stream;                    // (nparts) the stream of each
    vlmoe_data_state resumed;            // the data state of the checkpoint resumed from
    uint64_t signature;                  // of the data setup, kept in the checkpoint (data_rng[3])
    FILE *metrics;
    char dir[512], ckdir[600];
} mome_run;

static void run_free(mome_run *r) {
    if (r->metrics) fclose(r->metrics);
    vlmoe_loader_free(r->loader);
    cli_text_free(&r->text);
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_synth_free(r->synth);
    free(r->syn_img), free(r->syn_tok), free(r->syn_len);
    for (int k = 0; k < NSTREAMS; k++) {
        mome_stream *s = &r->s[k];
        free(s->img), free(s->tok), free(s->len), free(s->tin), free(s->tl), free(s->pl);
    }
    vlmoe_free_strings(r->images, r->n_images);
    free(r->img_order.perm), free(r->slot_file), free(r->slot_msg);
    if (r->lines) cli_free_lines(r->lines, r->n_lines);
    free(r->lineno), free(r->txt_order.perm);
    free(r->cb);
    free(r->parts), free(r->part_stats), free(r->part_stream);
}

static uint64_t mix64(uint64_t a, uint64_t b) { // splitmix64's finaliser of a combined with b
    uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int order_init(file_order *o, size_t n, uint64_t seed, int stream) {
    o->n = (uint32_t)n, o->epoch = -1, o->seed = mix64(seed, 0x766c6d6f65ull + (uint64_t)stream);
    o->perm = malloc(sizeof(uint32_t) * (n ? n : 1));
    return o->perm ? 0 : cli_error(CMD, "out of memory");
}

static uint32_t order_at(file_order *o, uint64_t i) {
    const int64_t e = (int64_t)(i / o->n);
    if (e != o->epoch) { // Fisher-Yates from (seed, stream, epoch)
        vlmoe_rng r;
        vlmoe_rng_seed(&r, mix64(o->seed, (uint64_t)e));
        for (uint32_t k = 0; k < o->n; k++) o->perm[k] = k;
        for (uint32_t k = o->n; k > 1; k--) {
            const uint32_t j = vlmoe_rng_below(&r, k), t = o->perm[k - 1];
            o->perm[k - 1] = o->perm[j], o->perm[j] = t;
        }
        o->epoch = e;
    }
    return o->perm[i % o->n];
}

// "I,T,P": three non-negative integer weights, not all zero.
static int parse_mix(const char *v, int w[NSTREAMS]) {
    char tail;
    if (sscanf(v, "%d,%d,%d%c", &w[0], &w[1], &w[2], &tail) != 3 || w[0] < 0 || w[1] < 0 || w[2] < 0 ||
        w[0] + w[1] + w[2] < 1)
        return cli_error(CMD, "--mix '%s': expected three non-negative integer weights IMAGES,TEXTS,PAIRS, not all 0 "
                         "(e.g. 1,1,1, the paper's equal thirds, or 0,1,0 for texts only)", v);
    return 0;
}

static int gcd(int a, int b) {
    while (b) {
        const int t = a % b;
        a = b, b = t;
    }
    return a;
}

// Sources of the three streams: --image-data / --text-data for their own modality, --train-data for
// pairs and for any modality not given otherwise, the synthetic data when no data flag is given.
// A stream with a weight but no source, and a data flag no stream uses, are errors.
static int choose_sources(const mome_args *a, const int w[NSTREAMS], mome_run *r) {
    const int any = a->image_data || a->text_data || a->data.path;
    const char *train = a->data.path;
    r->s[S_IMAGE].src = a->image_data ? SRC_FOLDER : train ? SRC_LOADER : any ? SRC_NONE : SRC_SYNTH;
    r->s[S_TEXT].src = a->text_data ? SRC_LINES : train ? SRC_LOADER : any ? SRC_NONE : SRC_SYNTH;
    r->s[S_PAIR].src = train ? SRC_LOADER : any ? SRC_NONE : SRC_SYNTH;
    static const char *const hint[NSTREAMS] = {
        "images come from --image-data DIR or the images of --train-data",
        "texts come from --text-data FILE (one sentence per line) or the captions of --train-data",
        "pairs need --train-data (an OpenCLIP CSV/TSV or webdataset shards of image-caption pairs); --text-data "
        "and --image-data hold one modality each"};
    char msg[1024] = "";
    for (int k = 0; k < NSTREAMS; k++)
        if (w[k] && r->s[k].src == SRC_NONE) {
            const size_t at = strlen(msg);
            snprintf(msg + at, sizeof(msg) - at, "%sthe %s stream has weight %d in --mix %s but no data: %s",
                     at ? "; " : "", STREAM_NAME[k], w[k], a->mix, hint[k]);
        }
    if (msg[0])
        return cli_error(CMD, "%s. Give the data, or drop the stream with a weight of 0 in --mix IMAGES,TEXTS,PAIRS", msg);
    if (a->image_data && !w[S_IMAGE])
        return cli_error(CMD, "--image-data %s is unused: --mix %s gives images weight 0", a->image_data, a->mix);
    if (a->text_data && !w[S_TEXT])
        return cli_error(CMD, "--text-data %s is unused: --mix %s gives texts weight 0", a->text_data, a->mix);
    int uses_train = 0;
    for (int k = 0; k < NSTREAMS; k++) {
        if (!w[k]) r->s[k].src = SRC_NONE;
        uses_train |= r->s[k].src == SRC_LOADER;
    }
    if (train && !uses_train)
        return cli_error(CMD, "--train-data %s is unused: --mix %s gives pairs weight 0 and the other streams have their "
                         "own data", train, a->mix);
    return 0;
}

// Exit status of a failed step of the set-up, with the library's message.
static int lib_error(const char *what) { return cli_error(CMD, "%s%s%s", what, what[0] ? ": " : "", vlmoe_last_error()); }

// The tokenizer of the texts a run reads (--text-data, --train-data captions): --tokenizer, or the
// synthetic word tokenizer for a model too small for BPE. With BPE, [MASK] must be an id the
// tokenizer never writes, and MLM's random replacements are drawn from its ordinary tokens.
static int setup_text(const mome_args *a, mome_run *r) {
    if (cli_text_init(CMD, a->tokenizer, &r->cfg, 1, &r->text)) return 1;
    if (!r->text.bpe) {
        fprintf(stderr, "vlmoe train: texts are tokenized with the synthetic data's word tokenizer (the model's %d ids "
                "are too few for BPE; --tokenizer FILE for another)\n", r->cfg.vocab_size);
        return 0;
    }
    const int V = vlmoe_tokenizer_vocab_size(r->text.bpe);
    if (r->cfg.mask_token < V)
        return cli_error(CMD, "--tokenizer %s has %d ids and the model's [MASK] (mask_token %d) is one of them: the "
                         "model needs vocab_size > %d and mask_token >= %d", a->tokenizer, V, r->cfg.mask_token, V, V);
    r->mlm.random_lo = 0, r->mlm.random_hi = V - 2; // below <|startoftext|> and <|endoftext|>
    return 0;
}

// Opens the data sources of the streams (before anything is written, so that a missing or empty
// file stops the run at once).
static int setup_data(const mome_args *a, mome_run *r) {
    const vlmoe_model_config *c = &r->cfg;
    const int need_text = r->s[S_TEXT].src == SRC_LINES || r->s[S_TEXT].src == SRC_LOADER || r->s[S_PAIR].src == SRC_LOADER;
    const int synth = r->s[S_IMAGE].src == SRC_SYNTH || r->s[S_TEXT].src == SRC_SYNTH || r->s[S_PAIR].src == SRC_SYNTH;
    if (synth && a->tokenizer) return cli_error(CMD, "--tokenizer: the synthetic data has its own word tokenizer");
    if (synth && (a->image_mean || a->image_std)) return cli_error(CMD, "--image-mean/--image-std apply to image files");
    if (!synth && c->channels != 3)
        return cli_error(CMD, "model %s has %d image channels; images are RGB", c->name, c->channels);
    if (!synth && cli_image_params(CMD, a->image_mean, a->image_std, c, &r->ip)) return 1;
    if (need_text && setup_text(a, r)) return 1;
    if (synth) {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        sp.seed = (uint64_t)a->seed;
        if (vlmoe_synth_init(&r->synth, &sp)) return lib_error("synthetic data");
        if (vlmoe_synth_vocab_size(r->synth) > c->vocab_size || c->channels != 3)
            return cli_error(CMD, "model %s: the synthetic data needs channels 3 and vocab_size >= %d", c->name,
                             vlmoe_synth_vocab_size(r->synth));
    }
    if (r->s[S_TEXT].src == SRC_LINES) {
        if (cli_read_lines_numbered(CMD, a->text_data, &r->lines, &r->lineno, &r->n_lines)) return 1;
        size_t keep = 0; // lines of white space only are blank too
        for (size_t i = 0; i < r->n_lines; i++) {
            if (!r->lines[i][strspn(r->lines[i], " \t\f\v")]) {
                free(r->lines[i]);
                continue;
            }
            r->lines[keep] = r->lines[i], r->lineno[keep++] = r->lineno[i];
        }
        r->n_lines = keep;
        if (!r->n_lines) return cli_error(CMD, "--text-data %s: no sentences (the file is empty or blank)", a->text_data);
        if (r->n_lines > UINT32_MAX) return cli_error(CMD, "--text-data %s: more than 2^32 sentences", a->text_data);
        if (order_init(&r->txt_order, r->n_lines, (uint64_t)a->seed, S_TEXT)) return 1;
        fprintf(stderr, "vlmoe train: texts: %zu sentences of %s\n", r->n_lines, a->text_data);
    }
    if (r->s[S_IMAGE].src == SRC_FOLDER) {
        struct stat sb;
        if (stat(a->image_data, &sb)) return cli_error(CMD, "--image-data %s: %s", a->image_data, strerror(errno));
        if (!S_ISDIR(sb.st_mode)) return cli_error(CMD, "--image-data %s: not a folder", a->image_data);
        if (cli_list_images(CMD, &a->image_data, 1, &r->images, &r->n_images)) return 1;
        const int n = r->s[S_IMAGE].n;
        r->slot_file = malloc(sizeof(int) * (size_t)n);
        r->slot_msg = malloc(sizeof(*r->slot_msg) * (size_t)n);
        if (!r->slot_file || !r->slot_msg || order_init(&r->img_order, (size_t)r->n_images, (uint64_t)a->seed, S_IMAGE))
            return cli_error(CMD, "out of memory");
        fprintf(stderr, "vlmoe train: images: %d files under %s\n", r->n_images, a->image_data);
    }
    for (int k = 0; k < NSTREAMS; k++) {
        if (r->s[k].src == SRC_SYNTH) r->n_synth += r->s[k].n;
        if (r->s[k].src == SRC_LOADER) r->n_loader += r->s[k].n;
    }
    if (r->n_loader) {
        vlmoe_loader_params lp = vlmoe_loader_default_params();
        lp.data = a->data;
        lp.image = r->ip;
        lp.seed = (uint64_t)a->seed;
        lp.batch_size = r->n_loader;
        lp.context_length = c->context_length;
        if (r->s[S_TEXT].src == SRC_LOADER || r->s[S_PAIR].src == SRC_LOADER) // else the captions are not needed
            lp.tokenize = cli_tokenize, lp.tokenize_user = &r->text;
        lp.workers = a->workers;
        lp.max_bad_fraction = a->max_bad;
        if (vlmoe_loader_open(&lp, &r->loader)) return lib_error("--train-data");
        const int64_t rows = vlmoe_loader_epoch_size(r->loader);
        char what[64] = "webdataset shards";
        if (rows >= 0) snprintf(what, sizeof(what), "%lld usable rows", (long long)rows);
        fprintf(stderr, "vlmoe train: data %s (%s): %d of each step's samples, %d loader workers\n", a->data.path, what,
                r->n_loader, a->workers);
    }
    return 0;
}

static int alloc_buffers(mome_run *r) {
    const vlmoe_model_config *c = &r->cfg;
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    const size_t np = (size_t)(c->image_size / c->patch_size) * (size_t)(c->image_size / c->patch_size);
    int ok = 1;
    for (int k = 0; k < NSTREAMS; k++) {
        mome_stream *s = &r->s[k];
        const size_t n = (size_t)s->n;
        if (s->src == SRC_NONE) continue;
        if (k != S_TEXT) ok &= (s->img = malloc(sizeof(float) * isz * n)) && (s->pl = malloc(sizeof(int32_t) * np * n));
        if (k != S_IMAGE)
            ok &= (s->tok = malloc(sizeof(int32_t) * T * n)) && (s->len = malloc(sizeof(int32_t) * n)) &&
                  (s->tin = malloc(sizeof(int32_t) * T * n)) && (s->tl = malloc(sizeof(int32_t) * T * n));
    }
    if (r->n_synth) {
        const size_t n = (size_t)r->n_synth;
        ok &= (r->syn_img = malloc(sizeof(float) * isz * n)) && (r->syn_tok = malloc(sizeof(int32_t) * T * n)) &&
              (r->syn_len = malloc(sizeof(int32_t) * n));
    }
    const size_t np_ = (size_t)r->nparts;
    ok &= (r->parts = malloc(sizeof(*r->parts) * np_)) && (r->part_stats = malloc(sizeof(*r->part_stats) * np_)) &&
          (r->part_stream = malloc(sizeof(int) * np_));
    return ok ? 0 : cli_error(CMD, "out of memory for a batch");
}

// Copies samples [at, at + n) of batch b into stream k (what the stream uses: images, tokens).
static void take(mome_run *r, int k, const vlmoe_batch *b, int at) {
    const vlmoe_model_config *c = &r->cfg;
    mome_stream *s = &r->s[k];
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    if (k != S_TEXT) memcpy(s->img, b->images + (size_t)at * isz, sizeof(float) * isz * (size_t)s->n);
    if (k != S_IMAGE) {
        memcpy(s->tok, b->tokens + (size_t)at * T, sizeof(int32_t) * T * (size_t)s->n);
        memcpy(s->len, b->lengths + at, sizeof(int32_t) * (size_t)s->n);
    }
}

// The images of step `step` from --image-data, decoded and randomly cropped in parallel (the result
// does not depend on the thread count). A file that cannot be read is skipped: the next file of the
// folder takes its place, so the samples still follow from the step alone.
static int fill_folder(mome_run *r, long step, const char *dir) {
    mome_stream *s = &r->s[S_IMAGE];
    const int n = s->n, N = r->n_images;
    const size_t isz = (size_t)3 * r->cfg.image_size * r->cfg.image_size;
    const uint64_t first = (uint64_t)step * (uint64_t)n;
    for (int j = 0; j < n; j++) r->slot_file[j] = (int)order_at(&r->img_order, first + (uint64_t)j), r->slot_msg[j][0] = 0;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : failed)
    for (int j = 0; j < n; j++) {
        vlmoe_image im = {0};
        vlmoe_rng g;
        int st = 1;
        for (int k = 0; k < N && st; k++) {
            vlmoe_rng_seed(&g, mix64(mix64(r->img_order.seed, 0x696d67ull), first + (uint64_t)j));
            st = vlmoe_image_load(r->images[(r->slot_file[j] + k) % N], &im);
            if (!st) st = vlmoe_image_preprocess_train(&im, &r->ip, &g, s->img + (size_t)j * isz);
            if (st && !r->slot_msg[j][0]) snprintf(r->slot_msg[j], sizeof(r->slot_msg[j]), "%s", vlmoe_last_error());
        }
        vlmoe_image_free(&im);
        failed += st != 0;
    }
    cli_bad_log *bad = &r->bad_images; // distinct messages; n_bad_images counts every skip
    for (int j = 0; j < n; j++) {
        int seen = !r->slot_msg[j][0];
        for (long i = 0; i < bad->n && i < 3 && !seen; i++) seen = !strcmp(bad->first[i], r->slot_msg[j]);
        if (!seen) cli_bad_add(bad, r->slot_msg[j]);
        r->n_bad_images += r->slot_msg[j][0] != 0;
    }
    return failed ? cli_error(CMD, "--image-data %s: no image could be read; first: %s", dir, bad->first[0]) : 0;
}

// The sentences of step `step` from --text-data, tokenized.
static int fill_lines(mome_run *r, long step, const char *path) {
    mome_stream *s = &r->s[S_TEXT];
    const int T = r->cfg.context_length;
    for (int j = 0; j < s->n; j++) {
        const uint32_t i = order_at(&r->txt_order, (uint64_t)step * (uint64_t)s->n + (uint64_t)j);
        const int len = cli_tokenize(&r->text, r->lines[i], s->tok + (size_t)j * T, T);
        if (len < 2) return cli_error(CMD, "--text-data %s:%ld: cannot tokenize: %s", path, r->lineno[i], vlmoe_last_error());
        s->len[j] = len;
    }
    return 0;
}

// Fills every stream with the samples of `step`: synthetic samples step*n_synth.. (images, then
// texts, then pairs, as the streams are ordered), the loader's next batch (the same layout), the
// folder's and the text file's samples of the step.
static int fill_streams(mome_run *r, const mome_args *a, long step) {
    const vlmoe_model_config *c = &r->cfg;
    if (r->n_synth && vlmoe_synth_batch(r->synth, VLMOE_SPLIT_TRAIN, (uint64_t)step * (uint64_t)r->n_synth, r->n_synth,
                                        c->context_length, r->syn_img, r->syn_tok, r->syn_len))
        return lib_error("synthetic data");
    const vlmoe_batch sb = {r->n_synth, r->syn_img, r->syn_tok, r->syn_len};
    vlmoe_batch lb = {0, NULL, NULL, NULL};
    if (r->n_loader && vlmoe_loader_next(r->loader, &lb, NULL)) return lib_error("--train-data");
    for (int k = 0, at_syn = 0, at_ld = 0; k < NSTREAMS; k++) {
        if (r->s[k].src == SRC_SYNTH) take(r, k, &sb, at_syn), at_syn += r->s[k].n;
        if (r->s[k].src == SRC_LOADER) take(r, k, &lb, at_ld), at_ld += r->s[k].n;
    }
    if (r->s[S_IMAGE].src == SRC_FOLDER && fill_folder(r, step, a->image_data)) return 1;
    if (r->s[S_TEXT].src == SRC_LINES && fill_lines(r, step, a->text_data)) return 1;
    return 0;
}

// One chunk of stream k as a model batch: samples [at, at + chunk).
static vlmoe_mome_batch part_of(const mome_run *r, int k, int at) {
    const mome_stream *s = &r->s[k];
    const vlmoe_model_config *c = &r->cfg;
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    const size_t np = (size_t)(c->image_size / c->patch_size) * (size_t)(c->image_size / c->patch_size);
    vlmoe_mome_batch b = {.encoding = k == S_IMAGE ? VLMOE_ENC_IMAGE : k == S_TEXT ? VLMOE_ENC_TEXT : VLMOE_ENC_PAIR,
                          .batch_size = r->chunk};
    if (k != S_TEXT) b.images = s->img + (size_t)at * isz, b.patch_labels = s->pl + (size_t)at * np;
    if (k != S_IMAGE) b.tokens = s->tin + (size_t)at * T, b.lengths = s->len + at, b.text_labels = s->tl + (size_t)at * T;
    return b;
}

// Routing of one stream: an eval-mode forward of its first chunk (the layers the encoding runs:
// V-MoE layers carry image tokens, T-MoE layers text tokens; the others report no tokens and are
// left out). Appends a compact summary to line.
static int stream_routing(mome_run *r, int k, cJSON *obj, char *line, size_t cap) {
    vlmoe_mome_batch b = part_of(r, k, 0);
    vlmoe_mome_stats es;
    if (vlmoe_mome_forward(r->m, &b, 0, &es)) return lib_error("routing statistics");
    int n, nk = 0;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(r->m, &n);
    vlmoe_moe_stats *keep = n ? malloc(sizeof(*keep) * (size_t)n) : NULL;
    if (n && !keep) return cli_error(CMD, "out of memory");
    for (int i = 0; i < n; i++)
        if ((k != S_TEXT && ms[i].tokens[VLMOE_MOD_IMAGE] > 0 && !ms[i].tokens[VLMOE_MOD_TEXT]) ||
            (k != S_IMAGE && ms[i].tokens[VLMOE_MOD_TEXT] > 0 && !ms[i].tokens[VLMOE_MOD_IMAGE]))
            keep[nk++] = ms[i];
    if (nk) cJSON_AddItemToObject(obj, STREAM_NAME[k], vlmoe_metrics_moe(keep, nk, NULL, NULL));
    size_t at = strlen(line);
    if (nk && at < cap) at += (size_t)snprintf(line + at, cap - at, "%s%s:", at ? " | " : "", STREAM_NAME[k]);
    for (int i = 0; i < nk && at < cap; i++) {
        const int mod = keep[i].tokens[VLMOE_MOD_IMAGE] ? VLMOE_MOD_IMAGE : VLMOE_MOD_TEXT;
        at += (size_t)snprintf(line + at, cap - at, "%s b%d %s success %.2f dropped %.2f experts %.2f", i ? "," : "",
                               keep[i].block, mod == VLMOE_MOD_IMAGE ? "V-MoE" : "T-MoE", keep[i].success[mod],
                               keep[i].dropped[mod], keep[i].experts_used[mod]);
    }
    free(keep);
    return 0;
}

static void on_warn(void *u, const char *msg) { fprintf(stderr, "vlmoe train: %s\n", msg); }

// A fresh model from --model, or the newest usable checkpoint (--resume latest, falling back to
// older ones) or the one named (--resume FILE).
static int setup_model(const mome_args *a, const vlmoe_train_params *tp, mome_run *r) {
    if (!a->resume) {
        if (vlmoe_model_init(&r->m, &r->cfg, (uint64_t)a->seed) || vlmoe_trainer_init(&r->t, r->m, tp)) return lib_error("");
        return 0;
    }
    char w[1024];
    if (vlmoe_ckpt_resume(r->ckdir, a->resume, tp, 0, &r->m, &r->t, &r->resumed, w, sizeof(w), on_warn, NULL))
        return lib_error("");
    char *want = vlmoe_config_to_json(&r->cfg), *have = vlmoe_config_to_json(vlmoe_model_get_config(r->m));
    const int same = want && have && !strcmp(want, have);
    free(want), free(have);
    if (!same)
        return cli_error(CMD, "--resume: %s holds another model than --model %s; resume with the first run's --model", w,
                         a->model);
    if (r->resumed.data_rng[3] != r->signature)
        return cli_error(CMD, "--resume: %s was written with another data set-up (--mix, --batch-size, the data flags or "
                         "--seed): the run would not continue with the samples it was due; resume with the first run's "
                         "flags", w);
    fprintf(stderr, "vlmoe train: resuming from %s (step %ld)\n", w, vlmoe_trainer_get_step(r->t));
    return 0;
}

// Opens metrics.jsonl: a fresh file, or after a resume the lines of the steps up to `start` (a
// run stopped after its last checkpoint logged steps that are now trained again).
static int open_metrics(mome_run *r, long start) {
    char path[1024], tmp[1100];
    snprintf(path, sizeof(path), "%s/metrics.jsonl", r->dir);
    if (start > 0) {
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        FILE *in = fopen(path, "r"), *out = fopen(tmp, "w");
        char *line = NULL;
        size_t cap = 0;
        int ok = out != NULL;
        while (ok && in && getline(&line, &cap, in) >= 0) {
            long s;
            if (sscanf(line, "{\"step\":%ld", &s) == 1 && s <= start) ok = fputs(line, out) >= 0;
        }
        free(line);
        if (in) fclose(in);
        if (out && fclose(out)) ok = 0;
        if (!ok || rename(tmp, path)) return cli_error(CMD, "cannot rewrite %s: %s", path, strerror(errno));
    }
    r->metrics = fopen(path, start > 0 ? "a" : "w");
    return r->metrics ? 0 : cli_error(CMD, "cannot write %s: %s", path, strerror(errno));
}

static int write_run_files(const mome_args *a, const int w[NSTREAMS], mome_run *r) {
    static const char *const SRC_NAME[] = {"none", "synthetic", "train-data", "image-data", "text-data"};
    char path[1024];
    char *cj = vlmoe_config_to_json(&r->cfg);
    snprintf(path, sizeof(path), "%s/config.json", r->dir);
    int bad = vlmoe_write_text(path, cj);
    free(cj);
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "model", a->model);
    cJSON_AddStringToObject(p, "codebook", a->codebook ? a->codebook : "(the checkpoint's)");
    cJSON *streams = cJSON_AddObjectToObject(p, "streams");
    for (int k = 0; k < NSTREAMS; k++) {
        cJSON *s = cJSON_AddObjectToObject(streams, STREAM_NAME[k]);
        cJSON_AddNumberToObject(s, "weight", w[k]);
        cJSON_AddNumberToObject(s, "per_step", r->s[k].n);
        cJSON_AddStringToObject(s, "source", SRC_NAME[r->s[k].src]);
    }
    if (a->image_data) cJSON_AddStringToObject(p, "image_data", a->image_data);
    if (a->text_data) cJSON_AddStringToObject(p, "text_data", a->text_data);
    if (a->data.path) cJSON_AddStringToObject(p, "train_data", a->data.path);
    if (a->tokenizer) cJSON_AddStringToObject(p, "tokenizer", a->tokenizer);
    cJSON_AddNumberToObject(p, "batch_size", a->batch);
    cJSON_AddNumberToObject(p, "chunk", r->chunk);
    cJSON_AddNumberToObject(p, "steps", (double)a->steps);
    cJSON_AddNumberToObject(p, "lr", a->lr);
    cJSON_AddStringToObject(p, "lr_scheduler", a->scheduler);
    cJSON_AddNumberToObject(p, "warmup", (double)a->warmup);
    cJSON_AddNumberToObject(p, "wd", a->wd);
    cJSON_AddNumberToObject(p, "seed", (double)a->seed);
    cJSON_AddNumberToObject(p, "save_every_n_steps", (double)a->save_every);
    cJSON_AddNumberToObject(p, "threads", omp_get_max_threads());
    char *ps = cJSON_Print(p);
    cJSON_Delete(p);
    snprintf(path, sizeof(path), "%s/params.json", r->dir);
    bad |= vlmoe_write_text(path, ps);
    free(ps);
    return bad ? cli_error(CMD, "cannot write into %s: %s", r->dir, strerror(errno)) : 0;
}

static int save_checkpoint(mome_run *r, long step, int keep) {
    char w[1024], s[1024];
    vlmoe_ckpt_paths(r->ckdir, step, w, s, sizeof(w));
    vlmoe_data_state ds;
    memset(&ds, 0, sizeof(ds));
    if (r->loader) vlmoe_loader_position(r->loader, &ds); // seed and order in data_rng[0..2]
    else ds.data_position = (uint64_t)step * (uint64_t)r->n_synth;
    ds.data_rng[3] = r->signature;
    if (vlmoe_trainer_save(r->t, w, s, &ds)) return lib_error("checkpoint");
    if (keep > 0) vlmoe_ckpt_prune(r->ckdir, keep);
    return 0;
}

// Per-stream losses of a step: the chunks' means weighted by their labelled positions.
typedef struct {
    double text, image, text_acc, image_acc, tc, ic;
} stream_loss;

static void add_loss(stream_loss *l, const vlmoe_mome_stats *ps) {
    l->text += ps->text * ps->text_count, l->text_acc += ps->text_acc * ps->text_count, l->tc += ps->text_count;
    l->image += ps->image * ps->image_count, l->image_acc += ps->image_acc * ps->image_count, l->ic += ps->image_count;
}

static void end_loss(stream_loss *l) {
    if (l->tc > 0) l->text /= l->tc, l->text_acc /= l->tc;
    if (l->ic > 0) l->image /= l->ic, l->image_acc /= l->ic;
}

// One training step: the streams' samples, their masks (seeded by the step, so a resumed run draws
// the same ones), the forwards of every chunk and the update.
static int train_step(mome_run *r, const mome_args *a, long step, vlmoe_step_stats *s) {
    if (fill_streams(r, a, step)) return 1;
    mome_stream *si = &r->s[S_IMAGE], *st = &r->s[S_TEXT], *sp = &r->s[S_PAIR];
    const vlmoe_model_config *c = &r->cfg;
    const int T = c->context_length;
    const uint64_t ms = (uint64_t)a->seed * 1000003ULL + (uint64_t)step;
    int e = VLMOE_OK;
    if (si->n) e = vlmoe_mim_labels(c, r->cb, r->K, si->img, si->n, 0.4, ms, si->pl);
    if (!e && st->n) e = vlmoe_mlm_mask(&r->mlm, ms, st->tok, st->len, st->n, T, st->tin, st->tl);
    if (!e && sp->n) e = vlmoe_mlm_mask(&r->vlm, ms ^ 0x5555ULL, sp->tok, sp->len, sp->n, T, sp->tin, sp->tl);
    if (!e && sp->n) e = vlmoe_mim_labels(c, r->cb, r->K, sp->img, sp->n, 0.4, ms ^ 0xaaaaULL, sp->pl);
    if (e) return lib_error("masking");
    int n = 0;
    for (int k = 0; k < NSTREAMS; k++)
        for (int at = 0; at < r->s[k].n; at += r->chunk) r->part_stream[n] = k, r->parts[n++] = part_of(r, k, at);
    if (vlmoe_trainer_step_mome(r->t, r->parts, r->nparts, r->part_stats, s))
        return cli_error(CMD, "diverged: %s. Nothing was written for this step; continue from the last checkpoint "
                         "with --resume latest (lower --lr or raise --warmup)", vlmoe_last_error());
    return 0;
}

// The progress line, the routing of every stream, and the metrics line of step `done` (which holds
// no timing: a resumed run must write exactly the same lines).
static int log_step(mome_run *r, const mome_args *a, long done, const vlmoe_step_stats *s, double per) {
    stream_loss l[NSTREAMS];
    memset(l, 0, sizeof(l));
    for (int i = 0; i < r->nparts; i++) add_loss(&l[r->part_stream[i]], &r->part_stats[i]);
    for (int k = 0; k < NSTREAMS; k++) end_loss(&l[k]);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", (double)done);
    cJSON_AddNumberToObject(o, "loss", s->loss);
    char text[512];
    size_t at = (size_t)snprintf(text, sizeof(text), "step %ld/%ld  loss %.4f", done, a->steps, s->loss);
    if (r->s[S_IMAGE].n) {
        cJSON_AddNumberToObject(o, "mim", l[S_IMAGE].image);
        cJSON_AddNumberToObject(o, "mim_acc", l[S_IMAGE].image_acc);
        at += (size_t)snprintf(text + at, sizeof(text) - at, "  MIM %.4f (acc %.3f)", l[S_IMAGE].image, l[S_IMAGE].image_acc);
    }
    if (r->s[S_TEXT].n) {
        cJSON_AddNumberToObject(o, "mlm", l[S_TEXT].text);
        cJSON_AddNumberToObject(o, "mlm_acc", l[S_TEXT].text_acc);
        at += (size_t)snprintf(text + at, sizeof(text) - at, "  MLM %.4f (acc %.3f)", l[S_TEXT].text, l[S_TEXT].text_acc);
    }
    if (r->s[S_PAIR].n) {
        cJSON_AddNumberToObject(o, "vlm_text", l[S_PAIR].text);
        cJSON_AddNumberToObject(o, "vlm_image", l[S_PAIR].image);
        cJSON_AddNumberToObject(o, "vlm_text_acc", l[S_PAIR].text_acc);
        cJSON_AddNumberToObject(o, "vlm_image_acc", l[S_PAIR].image_acc);
        at += (size_t)snprintf(text + at, sizeof(text) - at, "  VLM %.4f + %.4f (acc %.3f/%.3f)", l[S_PAIR].text,
                               l[S_PAIR].image, l[S_PAIR].text_acc, l[S_PAIR].image_acc);
    }
    cJSON_AddNumberToObject(o, "aux", s->aux);
    cJSON_AddNumberToObject(o, "lr", s->lr);
    cJSON_AddNumberToObject(o, "grad_norm", s->grad_norm);
    snprintf(text + at, sizeof(text) - at, "  aux %.4f  lr %.2e  %.0f samples/s", s->aux, s->lr, a->batch / per);
    char routing[2048] = "";
    cJSON *moe = cJSON_CreateObject();
    int rc = 0;
    for (int k = 0; k < NSTREAMS && !rc; k++)
        if (r->s[k].n) rc = stream_routing(r, k, moe, routing, sizeof(routing));
    if (cJSON_GetArraySize(moe)) cJSON_AddItemToObject(o, "moe", moe);
    else cJSON_Delete(moe);
    char *line = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!rc) {
        printf("%s\n", text);
        if (routing[0]) printf("  routing  %s\n", routing);
        fflush(stdout);
        if (!line || fprintf(r->metrics, "%s\n", line) < 0 || fflush(r->metrics))
            rc = cli_error(CMD, "cannot write %s/metrics.jsonl", r->dir);
    }
    free(line);
    return rc;
}

// LOGS/NAME (NAME: --name or the model's), or the run a --resume FILE belongs to
// (LOGS/NAME/checkpoints/step_N.safetensors); created with its checkpoint folder.
static int make_run_dir(const mome_args *a, mome_run *r) {
    if (a->resume && strcmp(a->resume, "latest")) {
        snprintf(r->dir, sizeof(r->dir), "%s", a->resume);
        for (int up = 0; up < 2; up++) {
            char *slash = strrchr(r->dir, '/');
            if (slash) *slash = 0;
            else snprintf(r->dir, sizeof(r->dir), ".");
        }
    } else {
        snprintf(r->dir, sizeof(r->dir), "%s/%s", a->logs, a->name ? a->name : r->cfg.name);
        for (char *p = r->dir + strlen(a->logs) + 1; *p; p++)
            if (*p == '/') *p = '_'; // model names like S/32
    }
    snprintf(r->ckdir, sizeof(r->ckdir), "%s/checkpoints", r->dir);
    if (vlmoe_mkdir_p(r->ckdir)) return lib_error("");
    vlmoe_ckpt_clean_tmp(r->ckdir);
    return 0;
}

static const char *USAGE =
    "usage: vlmoe train --model vlmoe-tiny --codebook cb.safetensors [options]\n\n"
    "VL-MoE pretraining by masked data modeling: MIM on images, MLM on texts, VLM on image-text pairs\n"
    "(VL-MoE sec. 3.1), their losses summed with the MoE auxiliary losses. --mix IMAGES,TEXTS,PAIRS\n"
    "splits each step's --batch-size between the three streams (default 1,1,1: equal thirds; a weight\n"
    "of 0 drops a stream). A stream split into unequal parts runs as several forwards of the largest\n"
    "common size, each adding its mean loss, so a stream's share of the loss follows its share of the\n"
    "batch.\n\n"
    "Data: without a data flag, the built-in synthetic data. Otherwise images come from --image-data\n"
    "DIR (every .jpg/.jpeg/.png/.webp under it), texts from --text-data FILE (one sentence per line),\n"
    "pairs from --train-data (an OpenCLIP CSV/TSV or webdataset shards, read as vlmoe train reads them\n"
    "for CLIP models); --train-data also gives images and texts where --image-data / --text-data are\n"
    "not given. Folder images and sentences are visited once per epoch in an order drawn from --seed;\n"
    "images are random-resized-cropped and normalised (--image-mean/--image-std, CLIP's by default).\n"
    "Texts go through --tokenizer (CLIP merges or HF tokenizer.json; the model's mask_token must lie\n"
    "outside it), or the synthetic word tokenizer for a model with fewer than 514 ids.\n\n"
    "Every --log-every-n-steps: the losses, and the routing of each stream (an eval-mode forward of\n"
    "its batch: per MoE layer success rate, dropped assignments, experts used), printed and in\n"
    "LOGS/NAME/metrics.jsonl. Checkpoints (checkpoints/step_N.safetensors + step_N.state.safetensors,\n"
    "written atomically with the optimizer state) every --save-every-n-steps and at the end;\n"
    "--resume latest (or FILE) with the first run's flags continues bit for bit.\n\n"
    "examples:\n"
    "  vlmoe vq train --model vlmoe-tiny --size 1024 -o cb.safetensors\n"
    "  vlmoe train --model vlmoe-tiny --codebook cb.safetensors --steps 300 --save-every-n-steps 100\n"
    "  vlmoe train --model vlmoe-tiny --codebook cb.safetensors --steps 300 --save-every-n-steps 100 \\\n"
    "              --resume latest      (the same flags as the first run)\n"
    "  vlmoe vq train --model vlmoe-tiny --size 1024 --image-data photos/ -o photos_cb.safetensors\n"
    "  vlmoe train --model vlmoe-tiny --codebook photos_cb.safetensors --image-data photos/ --text-data \\\n"
    "              sentences.txt --train-data pairs.csv --csv-caption-key caption --mix 1,1,2 --batch-size 48";

int cmd_train_mome(int argc, char **argv) {
    mome_args a = {.logs = "logs", .mix = "1,1,1", .scheduler = "cosine", .csv_separator = "\t", .batch = 48,
                   .log_every = 10, .keep = 3, .workers = 2, .steps = 300, .warmup = 30, .lr = 1e-3, .wd = 0.05,
                   .max_bad = 0.1};
    a.data = vlmoe_dataset_default_params();
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "NAME|FILE", "a VL-MoE (arch mome) model, e.g. vlmoe-tiny"},
        {"codebook", ARG_STRING, &a.codebook, "FILE", "MIM targets: a codebook from `vlmoe vq train` (mim_vocab entries)"},
        {"mix", ARG_STRING, &a.mix, "I,T,P", "weights of the image, text and pair streams in a step (1,1,1)"},
        {"image-data", ARG_STRING, &a.image_data, "DIR", "image-only data: the images under DIR, recursively"},
        {"text-data", ARG_STRING, &a.text_data, "FILE", "text-only data: one sentence per line"},
        {"train-data", ARG_STRING, &a.data.path, "PATH", "image-text pairs: an OpenCLIP CSV/TSV file or webdataset shards "
                                                       "('train-{000000..000099}.tar', lists joined by '::')"},
        {"dataset-type", ARG_STRING, &a.dataset_type, "TYPE", "of --train-data: csv, webdataset or auto (by the name; default)"},
        {"csv-separator", ARG_STRING, &a.csv_separator, "C", "CSV field separator (default tab; \\t for tab)"},
        {"csv-img-key", ARG_STRING, &a.data.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &a.data.caption_key, "NAME", "CSV column of captions (default title)"},
        {"workers", ARG_INT, &a.workers, "N", "threads reading --train-data ahead of the step (2; 0: the training thread)"},
        {"max-bad-fraction", ARG_DOUBLE, &a.max_bad, "F", "stop when more than this fraction of --train-data is bad (0.1)"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "texts' vocabulary: CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &a.image_mean, "R,G,B", "normalisation mean of image files (default CLIP's; [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &a.image_std, "R,G,B", "normalisation std of image files (default CLIP's; [-1, 1]: 0.5)"},
        {"batch-size", ARG_INT, &a.batch, "N", "samples per step, split by --mix (48)"},
        {"steps", ARG_LONG, &a.steps, "N", "training steps (300)"},
        {"lr", ARG_DOUBLE, &a.lr, "X", "peak learning rate (1e-3)"},
        {"lr-scheduler", ARG_STRING, &a.scheduler, "KIND", "cosine decay to 0 at --steps (default) or const"},
        {"warmup", ARG_LONG, &a.warmup, "N", "linear warmup steps (30)"},
        {"wd", ARG_DOUBLE, &a.wd, "X", "AdamW weight decay (0.05, VL-MoE sec. 4.1)"},
        {"seed", ARG_LONG, &a.seed, "N", "initialisation, data order, masks and routing noise (0)"},
        {"logs", ARG_STRING, &a.logs, "DIR", "log folder (logs)"},
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: the model name)"},
        {"log-every-n-steps", ARG_INT, &a.log_every, "N", "print and log losses and routing every N steps (10)"},
        {"save-every-n-steps", ARG_LONG, &a.save_every, "N", "checkpoint every N steps (default: at the end only)"},
        {"keep-checkpoints", ARG_INT, &a.keep, "K", "keep the newest K checkpoints (3, 0 = all)"},
        {"resume", ARG_STRING, &a.resume, "latest|FILE", "continue a run exactly: its newest usable checkpoint or step_N.safetensors"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    int rc = args_parse(CMD, specs, ns, argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (a.threads > 0) omp_set_num_threads(a.threads);
    if (!a.model) return cli_error(CMD, "--model is required");
    if (!a.codebook && !a.resume)
        return cli_error(CMD, "--codebook FILE is required: the MIM targets (make one with `vlmoe vq train`; a resumed "
                         "run takes its checkpoint's)");
    if (a.steps < 1 || a.log_every < 1 || a.save_every < 0 || a.keep < 0 || a.warmup < 0)
        return cli_error(CMD, "--steps and --log-every-n-steps must be >= 1, --save-every-n-steps, --keep-checkpoints "
                         "and --warmup >= 0");
    const int cosine = !strcmp(a.scheduler, "cosine");
    if (!cosine && strcmp(a.scheduler, "const"))
        return cli_error(CMD, "--lr-scheduler %s: expected cosine or const", a.scheduler);
    int w[NSTREAMS];
    if (parse_mix(a.mix, w)) return 1;
    const int W = w[0] + w[1] + w[2], unit = W / gcd(gcd(gcd(w[0], w[1]), w[2]), W);
    if (a.batch < 1 || a.batch % unit)
        return cli_error(CMD, "--batch-size %d does not split %d:%d:%d (--mix %s) into whole samples: use a positive "
                         "multiple of %d", a.batch, w[0], w[1], w[2], a.mix, unit);
    if (a.data.path) {
        if (cli_dataset_type(CMD, a.dataset_type ? a.dataset_type : "auto", 0, &a.data.type)) return 1;
        if (cli_separator(CMD, a.csv_separator, &a.data.separator)) return 1;
        if (a.workers < 0 || !(a.max_bad >= 0 && a.max_bad <= 1))
            return cli_error(CMD, "--workers must be >= 0 and --max-bad-fraction in [0, 1]");
    } else if (a.dataset_type) {
        return cli_error(CMD, "--dataset-type applies to --train-data");
    }
    mome_run r;
    memset(&r, 0, sizeof(r));
    if (vlmoe_config_load(a.model, &r.cfg)) return lib_error("");
    if (r.cfg.arch != VLMOE_ARCH_MOME) return cli_error(CMD, "model '%s' is not a VL-MoE (arch mome) model", a.model);
    if ((rc = choose_sources(&a, w, &r))) return rc;
    // Chunking: every forward of the step has the same batch size (the model plans its activations
    // for one size), the greatest common divisor of the streams' sizes.
    for (int k = 0; k < NSTREAMS; k++) {
        r.s[k].n = (int)((long)a.batch * w[k] / W);
        if (r.s[k].n) r.chunk = gcd(r.chunk, r.s[k].n);
    }
    r.signature = mix64((uint64_t)a.seed, (uint64_t)r.chunk) | 1;
    for (int k = 0; k < NSTREAMS; k++) r.signature = mix64(mix64(r.signature, (uint64_t)r.s[k].n), (uint64_t)r.s[k].src) | 1;
    const int pd = r.cfg.channels * r.cfg.patch_size * r.cfg.patch_size;
    int dim;
    if (a.codebook && vlmoe_codebook_load(a.codebook, r.cfg.mim_vocab, pd, &r.cb, &r.K, &dim)) return lib_error("--codebook");
    r.mlm = vlmoe_mlm_default_params(&r.cfg);
    r.nparts = a.batch / r.chunk;
    if ((rc = setup_data(&a, &r)) || (rc = alloc_buffers(&r))) {
        run_free(&r);
        return rc;
    }
    r.vlm = r.mlm;
    r.vlm.prob = 0.5; // VLM masks half of the text (VL-MoE sec. 3.1)
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.optim.beta2 = 0.999f; // VL-MoE sec. 4.1: Adam (0.9, 0.999), weight decay 0.05
    tp.optim.weight_decay = (float)a.wd;
    tp.schedule = (vlmoe_schedule){cosine ? VLMOE_SCHED_COSINE : VLMOE_SCHED_CONST, a.lr, a.warmup, a.steps, 0.0, 0, 0};
    long start = 0;
    if (!(rc = make_run_dir(&a, &r)) && !(rc = setup_model(&a, &tp, &r))) start = vlmoe_trainer_get_step(r.t);
    // the checkpoints carry the codebook: a resumed run without --codebook takes its checkpoint's
    if (!rc && !r.cb) {
        const float *c = vlmoe_mome_codebook(r.m);
        const size_t n = (size_t)r.cfg.mim_vocab * pd;
        if (!c) rc = cli_error(CMD, "--resume %s: the checkpoint carries no codebook: give --codebook FILE", a.resume);
        else if (!(r.cb = malloc(sizeof(float) * n))) rc = cli_error(CMD, "out of memory");
        else memcpy(r.cb, c, sizeof(float) * n), r.K = r.cfg.mim_vocab;
    }
    if (!rc && vlmoe_mome_set_codebook(r.m, r.cb, r.K, pd)) rc = lib_error("--codebook");
    if (!rc && r.loader && start > 0 && vlmoe_loader_seek(r.loader, &r.resumed)) rc = lib_error("--train-data");
    if (!rc && start >= a.steps) {
        printf("the run is at step %ld already, not before --steps %ld: nothing to train\n", start, a.steps);
        run_free(&r);
        return 0;
    }
    if (!rc) rc = write_run_files(&a, w, &r);
    if (!rc) rc = open_metrics(&r, start);
    if (rc) {
        run_free(&r);
        return rc;
    }
    fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d images + %d texts + %d pairs "
            "(forwards of %d), %d threads, run %s\n", r.cfg.name, vlmoe_model_num_floats(r.m), start, a.steps,
            r.s[S_IMAGE].n, r.s[S_TEXT].n, r.s[S_PAIR].n, r.chunk, omp_get_max_threads(), r.dir);
    double t_last = cli_now();
    long last = start;
    for (long step = start; step < a.steps && !rc; step++) {
        vlmoe_step_stats s;
        if ((rc = train_step(&r, &a, step, &s))) break;
        const long done = step + 1;
        if (done % a.log_every == 0 || done == a.steps) {
            rc = log_step(&r, &a, done, &s, (cli_now() - t_last) / (double)(done - last));
            t_last = cli_now(), last = done;
        }
        if (!rc && ((a.save_every > 0 && done % a.save_every == 0) || done == a.steps)) rc = save_checkpoint(&r, done, a.keep);
    }
    if (!rc) {
        char wp[1024], sp[1024];
        vlmoe_ckpt_paths(r.ckdir, a.steps, wp, sp, sizeof(wp));
        printf("trained to step %ld; weights and the MIM codebook in %s\n", a.steps, wp);
    }
    if (r.n_bad_images) {
        fprintf(stderr, "vlmoe train: warning: --image-data %s: skipped %ld unreadable images (the next file took each "
                "one's place); first:", a.image_data, r.n_bad_images);
        for (long i = 0; i < r.bad_images.n && i < 3; i++) fprintf(stderr, "%s %s", i ? ";" : "", r.bad_images.first[i]);
        fputc('\n', stderr);
    }
    if (r.loader && vlmoe_dataset_stats_bad(vlmoe_loader_stats(r.loader))) {
        char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
        vlmoe_dataset_stats_format(vlmoe_loader_stats(r.loader), sum, sizeof(sum));
        fprintf(stderr, "vlmoe train: warning: %s: %s\n", a.data.path, sum);
    }
    run_free(&r);
    return rc;
}
