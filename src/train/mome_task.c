// mome_task.c: VL-MoE pre-training (VL-MoE sec. 3.1) as a task of the loop in src/train/run.c:
// the image, text and pair streams of a step from the synthetic data, an image folder, a text file
// and a caption dataset read by the loader; their masks (seeded by the step); the step's forwards
// of equal size and the update; the train record's per-stream losses and routing (an eval-mode
// forward of each stream's first chunk); the data state with the signature of the data set-up.
// On W processes each forward is this process's block of the one-process forward (global_of).
// Covered by tests/test_vlmoe_train.c (the model's parts: tests/test_mome.c) and, on several
// processes, tests/test_train_dist.c and tests/test_dist_mpi.sh.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/masking.h"
#include "data/order.h"
#include "train/tasks.h"

enum { S_IMAGE = VLMOE_MOME_IMAGE, S_TEXT = VLMOE_MOME_TEXT, S_PAIR = VLMOE_MOME_PAIR, NSTREAMS = VLMOE_MOME_STREAMS };

const char *vlmoe_mome_stream_name(int k) {
    static const char *const name[NSTREAMS] = {"image", "text", "pair"};
    return k >= 0 && k < NSTREAMS ? name[k] : "?";
}

const char *vlmoe_mome_source_name(int src) {
    static const char *const name[] = {"none", "synthetic", "train-data", "image-data", "text-data"};
    return src >= 0 && src <= VLMOE_MOME_LINES ? name[src] : "?";
}

// One stream's samples of the current step, and their masked-modeling inputs and targets.
typedef struct {
    int src, n;              // VLMOE_MOME_* (NONE: dropped), samples per step
    float *img;              // (n, 3, S, S): image and pair streams
    int32_t *tok, *len;      // (n, T), (n): text and pair streams, as read
    int32_t *tin, *tl;       // (n, T): MLM input (after corruption) and labels
    int32_t *pl;             // (n, num_patches): MIM labels
} stream;

struct vlmoe_mome_run {
    vlmoe_mome_params p;
    vlmoe_model_config cfg;
    vlmoe_model *m;                      // from vlmoe_mome_start
    const float *cb;                     // its codebook (mim_vocab, C*P*P)
    stream s[NSTREAMS];
    int chunk, nparts;
    vlmoe_synth *synth;                  // synthetic streams: one vlmoe_synth_batch of n_synth
    int n_synth;
    float *syn_img;
    int32_t *syn_tok, *syn_len;
    vlmoe_loader *loader;                // --train-data streams: one loader batch of n_loader per
    int n_loader;                        // process (the loader reads world x n_loader, the global one)
    // The orders of the file-backed streams: sample i of a stream of n items is item perm_e[i mod
    // n] with perm_e drawn from (seed, stream, e = i / n), so every item comes once per epoch and
    // the samples of any step follow from the step alone (nothing to checkpoint).
    vlmoe_order img_order, txt_order;
    int *slot_file;                      // (n) file of each image of the step
    char (*slot_msg)[VLMOE_BAD_MSG_LEN]; // (n) why a file was skipped
    size_t *lines, n_lines;              // the non-blank lines of text_data
    vlmoe_mlm_params mlm, vlm;           // text masking of MLM (15%) and VLM (50%)
    vlmoe_mome_batch *parts;             // (nparts)
    vlmoe_mome_stats *part_stats;        // (nparts)
    int *part_stream;                    // (nparts) the stream of each
    vlmoe_mome_report rep;
};

// Data parallelism. Process `rank` of W at batch B runs the forwards of one process at batch W*B:
// the one-process run splits a stream of W*n samples into forwards of W*chunk, and this process
// takes block `rank` (chunk samples) of each. Its sample j of a stream is therefore sample
// global_of(j) of the one-process stream; the data, the masks and the routing noise follow from
// that index, and the losses are divided by the labelled positions of every process
// (src/nn/mome_model.c), so the gradients averaged over the processes are the one process's.
// W = 1: global_of(j) = j.
static uint64_t global_of(const vlmoe_mome_run *r, int j) {
    const uint64_t c = (uint64_t)r->chunk, W = (uint64_t)r->p.world;
    return (uint64_t)j / c * W * c + (uint64_t)r->p.rank * c + (uint64_t)j % c;
}

static int gcd(int a, int b) {
    while (b) {
        const int t = a % b;
        a = b, b = t;
    }
    return a;
}

// Sources: --image-data / --text-data for their own modality, --train-data for pairs and for any
// modality not given otherwise, the synthetic data when no data is given.
int vlmoe_mome_split_batch(const vlmoe_mome_params *p, vlmoe_mome_split *out) {
    memset(out, 0, sizeof(*out));
    const int *w = p->mix;
    if (w[0] < 0 || w[1] < 0 || w[2] < 0 || w[0] + w[1] + w[2] < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "--mix %d,%d,%d: expected three non-negative weights, not all 0", w[0], w[1],
                          w[2]);
    const int W = w[0] + w[1] + w[2], unit = W / gcd(gcd(gcd(w[0], w[1]), w[2]), W);
    char procs[160] = ""; // on several processes the batch is per process, and each splits alike
    if (p->world > 1)
        snprintf(procs, sizeof(procs), " (per process: each of the %d processes splits its share of the global batch "
                 "of %lld the way one process splits it)", p->world, (long long)p->batch_size * p->world);
    if (p->batch_size < 1 || p->batch_size % unit)
        return vlmoe_fail(VLMOE_ERR_ARG, "--batch-size %d does not split %d:%d:%d (--mix %d,%d,%d) into whole samples%s: "
                          "use a positive multiple of %d", p->batch_size, w[0], w[1], w[2], w[0], w[1], w[2], procs, unit);
    const char *train = p->train_data.path;
    const int any = p->image_data || p->text_data || train;
    int *src = out->src;
    src[S_IMAGE] = p->image_data ? VLMOE_MOME_FOLDER : train ? VLMOE_MOME_LOADER : any ? VLMOE_MOME_NONE : VLMOE_MOME_SYNTH;
    src[S_TEXT] = p->text_data ? VLMOE_MOME_LINES : train ? VLMOE_MOME_LOADER : any ? VLMOE_MOME_NONE : VLMOE_MOME_SYNTH;
    src[S_PAIR] = train ? VLMOE_MOME_LOADER : any ? VLMOE_MOME_NONE : VLMOE_MOME_SYNTH;
    static const char *const hint[NSTREAMS] = {
        "images come from --image-data DIR or the images of --train-data",
        "texts come from --text-data FILE (one sentence per line) or the captions of --train-data",
        "pairs need --train-data (an OpenCLIP CSV/TSV or webdataset shards of image-caption pairs); --text-data "
        "and --image-data hold one modality each"};
    char msg[1024] = "";
    for (int k = 0; k < NSTREAMS; k++)
        if (w[k] && src[k] == VLMOE_MOME_NONE) {
            const size_t at = strlen(msg);
            snprintf(msg + at, sizeof(msg) - at, "%sthe %s stream has weight %d in --mix %d,%d,%d but no data: %s",
                     at ? "; " : "", vlmoe_mome_stream_name(k), w[k], w[0], w[1], w[2], hint[k]);
        }
    if (msg[0])
        return vlmoe_fail(VLMOE_ERR_ARG, "%s. Give the data, or drop the stream with a weight of 0 in --mix "
                          "IMAGES,TEXTS,PAIRS", msg);
    if (p->image_data && !w[S_IMAGE])
        return vlmoe_fail(VLMOE_ERR_ARG, "--image-data %s is unused: --mix %d,%d,%d gives images weight 0",
                          p->image_data, w[0], w[1], w[2]);
    if (p->text_data && !w[S_TEXT])
        return vlmoe_fail(VLMOE_ERR_ARG, "--text-data %s is unused: --mix %d,%d,%d gives texts weight 0", p->text_data,
                          w[0], w[1], w[2]);
    int uses_train = 0;
    for (int k = 0; k < NSTREAMS; k++) {
        if (!w[k]) src[k] = VLMOE_MOME_NONE;
        uses_train |= src[k] == VLMOE_MOME_LOADER;
        out->n[k] = (int)((long)p->batch_size * w[k] / W);
        if (out->n[k]) out->chunk = gcd(out->chunk, out->n[k]);
    }
    if (train && !uses_train)
        return vlmoe_fail(VLMOE_ERR_ARG, "--train-data %s is unused: --mix %d,%d,%d gives pairs weight 0 and the other "
                          "streams have their own data", train, w[0], w[1], w[2]);
    out->nparts = p->batch_size / out->chunk;
    return VLMOE_OK;
}

void vlmoe_mome_free(vlmoe_mome_run *r) {
    if (!r) return;
    vlmoe_loader_free(r->loader);
    vlmoe_synth_free(r->synth);
    free(r->syn_img), free(r->syn_tok), free(r->syn_len);
    for (int k = 0; k < NSTREAMS; k++) {
        stream *s = &r->s[k];
        free(s->img), free(s->tok), free(s->len), free(s->tin), free(s->tl), free(s->pl);
    }
    vlmoe_order_free(&r->img_order), vlmoe_order_free(&r->txt_order);
    free(r->slot_file), free(r->slot_msg), free(r->lines);
    free(r->parts), free(r->part_stats), free(r->part_stream);
    free(r);
}

// The tokenizer's ids: with BPE, [MASK] must be an id the tokenizer never writes, and MLM's random
// replacements are drawn from its ordinary tokens.
static int setup_masks(vlmoe_mome_run *r) {
    const vlmoe_mome_params *p = &r->p;
    r->mlm = vlmoe_mlm_default_params(&r->cfg);
    if (p->text_vocab > 0) {
        const int V = p->text_vocab;
        if (r->cfg.mask_token < V)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "--tokenizer %s has %d ids and the model's [MASK] (mask_token %d) is one "
                              "of them: the model needs vocab_size > %d and mask_token >= %d",
                              p->tokenizer ? p->tokenizer : "", V, r->cfg.mask_token, V, V);
        r->mlm.random_lo = 0, r->mlm.random_hi = V - 2; // below <|startoftext|> and <|endoftext|>
    }
    r->vlm = r->mlm;
    r->vlm.prob = 0.5; // VLM masks half of the text (VL-MoE sec. 3.1)
    return VLMOE_OK;
}

// The data sources of the streams.
static int setup_data(vlmoe_mome_run *r) {
    const vlmoe_mome_params *p = &r->p;
    const vlmoe_model_config *c = &r->cfg;
    int st;
    for (int k = 0; k < NSTREAMS; k++) {
        if (r->s[k].src == VLMOE_MOME_SYNTH) r->n_synth += r->s[k].n;
        if (r->s[k].src == VLMOE_MOME_LOADER) r->n_loader += r->s[k].n;
    }
    if (r->n_synth) {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        sp.seed = p->seed;
        if ((st = vlmoe_synth_init(&r->synth, &sp))) return vlmoe_error_prefix("synthetic data"), st;
        if (vlmoe_synth_vocab_size(r->synth) > c->vocab_size || c->channels != 3)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "model %s: the synthetic data needs channels 3 and vocab_size >= %d",
                              c->name, vlmoe_synth_vocab_size(r->synth));
    }
    if (!r->n_synth && c->channels != 3)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model %s has %d image channels; images are RGB", c->name, c->channels);
    const int texts = r->s[S_TEXT].src == VLMOE_MOME_LINES || r->s[S_TEXT].src == VLMOE_MOME_LOADER ||
                      r->s[S_PAIR].src == VLMOE_MOME_LOADER;
    if (texts && !p->tokenize)
        return vlmoe_fail(VLMOE_ERR_ARG, "VL-MoE pre-training: texts of files need a tokenizer");
    if (r->s[S_TEXT].src == VLMOE_MOME_LINES) {
        if (!(r->lines = malloc(sizeof(size_t) * (p->n_text_lines ? p->n_text_lines : 1))))
            return vlmoe_fail(VLMOE_ERR_NOMEM, "--text-data %s", p->text_data);
        for (size_t i = 0; i < p->n_text_lines; i++) // lines of white space only are blank too
            if (p->text_lines[i][strspn(p->text_lines[i], " \t\f\v")]) r->lines[r->n_lines++] = i;
        if (!r->n_lines) return vlmoe_fail(VLMOE_ERR_ARG, "--text-data %s: no sentences (the file is empty or blank)", p->text_data);
        if (r->n_lines > UINT32_MAX) return vlmoe_fail(VLMOE_ERR_ARG, "--text-data %s: more than 2^32 sentences", p->text_data);
        if ((st = vlmoe_order_init(&r->txt_order, r->n_lines, p->seed, 0x766c6d6f65ull + S_TEXT, 0, 1))) return st;
        r->rep.n_sentences = r->n_lines;
    }
    if (r->s[S_IMAGE].src == VLMOE_MOME_FOLDER) {
        if (p->n_image_files < 1) return vlmoe_fail(VLMOE_ERR_ARG, "--image-data %s: no image files", p->image_data);
        const size_t n = (size_t)r->s[S_IMAGE].n;
        r->slot_file = malloc(sizeof(int) * n);
        r->slot_msg = malloc(sizeof(*r->slot_msg) * n);
        if (!r->slot_file || !r->slot_msg) return vlmoe_fail(VLMOE_ERR_NOMEM, "a batch of %zu images", n);
        if ((st = vlmoe_order_init(&r->img_order, (size_t)p->n_image_files, p->seed, 0x766c6d6f65ull + S_IMAGE, 0, 1)))
            return st;
    }
    if (r->n_loader) {
        vlmoe_loader_params lp = vlmoe_loader_default_params();
        lp.data = p->train_data;
        lp.image = p->image;
        lp.seed = p->seed;
        // each process decodes only its blocks of the global batch (chunks dealt in turn, as
        // global_of takes them), agreeing with the others on the bad samples
        lp.batch_size = r->n_loader;
        lp.rank = r->p.world > 1 ? r->p.rank : 0, lp.world = r->p.world > 1 ? r->p.world : 1;
        lp.chunk = r->chunk, lp.agree = p->agree, lp.agree_user = p->agree_user;
        lp.context_length = c->context_length;
        if (r->s[S_TEXT].src == VLMOE_MOME_LOADER || r->s[S_PAIR].src == VLMOE_MOME_LOADER) // else no captions needed
            lp.tokenize = p->tokenize, lp.tokenize_user = p->tokenize_user;
        lp.workers = p->workers;
        lp.max_bad_fraction = p->max_bad_fraction;
        lp.resampled = p->resampled, lp.upsampling = p->upsampling;
        if ((st = vlmoe_loader_open(&lp, &r->loader))) return vlmoe_error_prefix("--train-data"), st;
        r->rep.n_loader = r->n_loader;
        r->rep.loader_rows = vlmoe_loader_epoch_size(r->loader);
        r->rep.loader_stats = vlmoe_loader_stats(r->loader);
    }
    return VLMOE_OK;
}

static int alloc_buffers(vlmoe_mome_run *r) {
    const vlmoe_model_config *c = &r->cfg;
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    const size_t np = (size_t)(c->image_size / c->patch_size) * (size_t)(c->image_size / c->patch_size);
    int ok = 1;
    for (int k = 0; k < NSTREAMS; k++) {
        stream *s = &r->s[k];
        const size_t n = (size_t)s->n;
        if (s->src == VLMOE_MOME_NONE) continue;
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
    return ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "a batch of %d samples", r->p.batch_size);
}

int vlmoe_mome_init(vlmoe_mome_run **out, const vlmoe_mome_params *p) {
    *out = NULL;
    if (!p->config || p->config->arch != VLMOE_ARCH_MOME)
        return vlmoe_fail(VLMOE_ERR_ARG, "VL-MoE pre-training: the model must be a VL-MoE (arch mome) model");
    const int W = p->world > 1 ? p->world : 1;
    if (p->world < 0 || p->rank < 0 || p->rank >= W)
        return vlmoe_fail(VLMOE_ERR_ARG, "VL-MoE pre-training: process %d of a world of %d", p->rank, p->world);
    if ((int64_t)p->batch_size * W > 1 << 20)
        return vlmoe_fail(VLMOE_ERR_ARG, "--batch-size %d x %d processes is more than 2^20 samples a step", p->batch_size, W);
    vlmoe_mome_split split;
    int st = vlmoe_mome_split_batch(p, &split);
    if (st) return st;
    vlmoe_mome_run *r = calloc(1, sizeof(*r));
    if (!r) return vlmoe_fail(VLMOE_ERR_NOMEM, "VL-MoE run");
    r->p = *p;
    r->p.world = W;
    r->cfg = *p->config;
    r->p.config = &r->cfg;
    r->chunk = split.chunk, r->nparts = split.nparts;
    for (int k = 0; k < NSTREAMS; k++) r->s[k].src = split.src[k], r->s[k].n = split.n[k];
    r->rep.split = split;
    r->rep.loader_rows = -1;
    // the data set-up a checkpoint is bound to: a resumed run must draw the samples it was due.
    // The global sizes: a run on W processes at B resumes on W' at B*W/W' (any W alike at W = 1)
    const uint64_t uw = (uint64_t)W;
    uint64_t sig = vlmoe_order_mix(p->seed, uw * (uint64_t)r->chunk) | 1;
    for (int k = 0; k < NSTREAMS; k++)
        sig = vlmoe_order_mix(vlmoe_order_mix(sig, uw * (uint64_t)r->s[k].n), (uint64_t)r->s[k].src) | 1;
    r->rep.signature = sig;
    if ((st = setup_masks(r)) || (st = setup_data(r)) || (st = alloc_buffers(r))) {
        vlmoe_mome_free(r);
        return st;
    }
    *out = r;
    return VLMOE_OK;
}

int vlmoe_mome_start(vlmoe_mome_run *r, vlmoe_model *m, const float *codebook, const vlmoe_data_state *resumed,
                     const char *ckpt) {
    const vlmoe_model_config *c = &r->cfg;
    const int pd = c->channels * c->patch_size * c->patch_size;
    int st;
    char *want = vlmoe_config_to_json(c), *have = vlmoe_config_to_json(vlmoe_model_get_config(m));
    const int same = want && have && !strcmp(want, have);
    free(want), free(have);
    if (!same)
        return vlmoe_fail(VLMOE_ERR_ARG, "--resume: %s holds another model than --model (%s); resume with the first "
                          "run's --model", ckpt ? ckpt : "the checkpoint", c->name);
    if (resumed && resumed->data_rng[3] != r->rep.signature)
        return vlmoe_fail(VLMOE_ERR_ARG, "--resume: %s was written with another data set-up (--mix, --batch-size, the "
                          "data flags or --seed): the run would not continue with the samples it was due; resume with "
                          "the first run's flags", ckpt ? ckpt : "the checkpoint");
    // the checkpoints carry the codebook: a resumed run without one takes its checkpoint's
    if (codebook && (st = vlmoe_mome_set_codebook(m, codebook, c->mim_vocab, pd))) return vlmoe_error_prefix("--codebook"), st;
    if (!(r->cb = vlmoe_mome_codebook(m)))
        return vlmoe_fail(VLMOE_ERR_ARG, "--resume %s: the checkpoint carries no codebook: give --codebook FILE",
                          ckpt ? ckpt : "");
    if (resumed && r->loader && (st = vlmoe_loader_seek(r->loader, resumed))) return vlmoe_error_prefix("--train-data"), st;
    r->m = m;
    return VLMOE_OK;
}

const vlmoe_mome_report *vlmoe_mome_get_report(const vlmoe_mome_run *r) { return &r->rep; }

// Fills stream k from batch b, whose samples from `at` on are the stream's: this process's n
// samples when !global, else the whole global stream of world x n (the loader's), whose blocks of
// this process (global_of) are taken. Copies what the stream uses: images, tokens.
static void take(vlmoe_mome_run *r, int k, const vlmoe_batch *b, int at, int global) {
    const vlmoe_model_config *c = &r->cfg;
    stream *s = &r->s[k];
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    const size_t n = (size_t)r->chunk;
    for (int j = 0; j < s->n; j += r->chunk) {
        const size_t from = global ? (size_t)at * (size_t)r->p.world + (size_t)global_of(r, j) : (size_t)(at + j);
        if (k != S_TEXT) memcpy(s->img + (size_t)j * isz, b->images + from * isz, sizeof(float) * isz * n);
        if (k != S_IMAGE) {
            memcpy(s->tok + (size_t)j * T, b->tokens + from * T, sizeof(int32_t) * T * n);
            memcpy(s->len + j, b->lengths + from, sizeof(int32_t) * n);
        }
    }
}

// Keeps a reason to skip an image file among the first three distinct ones.
static void bad_add(vlmoe_mome_report *rep, const char *msg) {
    if (rep->n_bad_first < 3) snprintf(rep->bad_first[rep->n_bad_first], sizeof(rep->bad_first[0]), "%s", msg);
    rep->n_bad_first++;
}

// The images of step `step` from the folder, decoded and randomly cropped in parallel (the result
// does not depend on the thread count). A file that cannot be read is skipped: the next file of the
// folder takes its place, so the samples still follow from the step alone.
static int fill_folder(vlmoe_mome_run *r, long step) {
    stream *s = &r->s[S_IMAGE];
    const int n = s->n, N = r->p.n_image_files;
    const size_t isz = (size_t)3 * r->cfg.image_size * r->cfg.image_size;
    const uint64_t first = (uint64_t)step * (uint64_t)n * (uint64_t)r->p.world; // the step's first global image
    for (int j = 0; j < n; j++)
        r->slot_file[j] = (int)vlmoe_order_at(&r->img_order, first + global_of(r, j)), r->slot_msg[j][0] = 0;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : failed)
    for (int j = 0; j < n; j++) {
        vlmoe_image im = {.max_pixels = (size_t)r->p.image.max_pixels}; // --max-image-pixels
        vlmoe_rng g;
        int st = 1;
        for (int k = 0; k < N && st; k++) {
            vlmoe_rng_seed(&g, vlmoe_order_mix(vlmoe_order_mix(r->img_order.seed, 0x696d67ull), first + global_of(r, j)));
            st = vlmoe_image_load(r->p.image_files[(r->slot_file[j] + k) % N], &im);
            if (!st) st = vlmoe_image_preprocess_train(&im, &r->p.image, &g, s->img + (size_t)j * isz);
            if (st && !r->slot_msg[j][0]) snprintf(r->slot_msg[j], sizeof(r->slot_msg[j]), "%s", vlmoe_last_error());
        }
        vlmoe_image_free(&im);
        failed += st != 0;
    }
    vlmoe_mome_report *rep = &r->rep; // distinct messages; bad_images counts every skip
    for (int j = 0; j < n; j++) {
        int seen = !r->slot_msg[j][0];
        for (long i = 0; i < rep->n_bad_first && i < 3 && !seen; i++) seen = !strcmp(rep->bad_first[i], r->slot_msg[j]);
        if (!seen) bad_add(rep, r->slot_msg[j]);
        rep->bad_images += r->slot_msg[j][0] != 0;
    }
    return failed ? vlmoe_fail(VLMOE_ERR_IO, "--image-data %s: no image could be read; first: %s", r->p.image_data,
                               rep->bad_first[0])
                  : VLMOE_OK;
}

// The sentences of step `step` from the text file, tokenized.
static int fill_lines(vlmoe_mome_run *r, long step) {
    stream *s = &r->s[S_TEXT];
    const int T = r->cfg.context_length;
    for (int j = 0; j < s->n; j++) {
        const uint64_t first = (uint64_t)step * (uint64_t)s->n * (uint64_t)r->p.world;
        const size_t i = r->lines[vlmoe_order_at(&r->txt_order, first + global_of(r, j))];
        const int len = r->p.tokenize(r->p.tokenize_user, r->p.text_lines[i], s->tok + (size_t)j * T, T);
        if (len < 2)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "--text-data %s:%ld: cannot tokenize: %s", r->p.text_data,
                              r->p.text_lineno ? r->p.text_lineno[i] : (long)i + 1, vlmoe_last_error());
        s->len[j] = len;
    }
    return VLMOE_OK;
}

// The synthetic samples of this process in step `step`: one process takes samples
// step*n_synth.. (images, then texts, then pairs, as the streams are ordered), W processes the
// blocks of them that global_of names, a forward's block at a time.
static int fill_synth(vlmoe_mome_run *r, long step) {
    const vlmoe_model_config *c = &r->cfg;
    const uint64_t W = (uint64_t)r->p.world, first = (uint64_t)step * (uint64_t)r->n_synth * W;
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    for (int k = 0, at = 0; k < NSTREAMS; k++) {
        if (r->s[k].src != VLMOE_MOME_SYNTH) continue;
        for (int j = 0; j < r->s[k].n; j += r->chunk) {
            const size_t o = (size_t)(at + j);
            int st = vlmoe_synth_batch(r->synth, VLMOE_SPLIT_TRAIN, first + (uint64_t)at * W + global_of(r, j), r->chunk,
                                       c->context_length, r->syn_img + o * isz, r->syn_tok + o * T, r->syn_len + o);
            if (st) return vlmoe_error_prefix("synthetic data"), st;
        }
        at += r->s[k].n;
    }
    return VLMOE_OK;
}

// Fills every stream with the samples of `step` (the synthetic ones; the loader's next global
// batch in the same layout, streams one after another; the folder's and the text file's samples
// of the step) and masks them, seeded by the step and keyed by the global sample so that a
// resumed run, and a run on any number of processes, draws the same masks.
static int m_fill(void *u, long step) {
    vlmoe_mome_run *r = u;
    const vlmoe_model_config *c = &r->cfg;
    int st;
    if (r->n_synth && (st = fill_synth(r, step))) return st;
    const vlmoe_batch sb = {r->n_synth, r->syn_img, r->syn_tok, r->syn_len};
    vlmoe_batch lb = {0, NULL, NULL, NULL};
    if (r->n_loader && (st = vlmoe_loader_next(r->loader, &lb, NULL))) return vlmoe_error_prefix("--train-data"), st;
    if (r->n_loader && lb.batch_size != r->n_loader)
        return vlmoe_fail(VLMOE_ERR_ARG, "--train-data: the loader gives batches of %d, not %d", lb.batch_size,
                          r->n_loader);
    for (int k = 0, at_syn = 0, at_ld = 0; k < NSTREAMS; k++) {
        if (r->s[k].src == VLMOE_MOME_SYNTH) take(r, k, &sb, at_syn, 0), at_syn += r->s[k].n;
        if (r->s[k].src == VLMOE_MOME_LOADER) take(r, k, &lb, at_ld, 0), at_ld += r->s[k].n;
    }
    if (r->s[S_IMAGE].src == VLMOE_MOME_FOLDER && (st = fill_folder(r, step))) return st;
    if (r->s[S_TEXT].src == VLMOE_MOME_LINES && (st = fill_lines(r, step))) return st;
    stream *si = &r->s[S_IMAGE], *sx = &r->s[S_TEXT], *sp = &r->s[S_PAIR];
    const int T = c->context_length, K = c->mim_vocab, n = r->chunk;
    const size_t isz = (size_t)3 * c->image_size * c->image_size, Tz = (size_t)T;
    const size_t np = (size_t)(c->image_size / c->patch_size) * (size_t)(c->image_size / c->patch_size);
    const uint64_t ms = r->p.seed * 1000003ULL + (uint64_t)step;
    st = VLMOE_OK;
    // a forward's block at a time: its samples are consecutive global samples from global_of(j)
    for (int j = 0; j < si->n && !st; j += n)
        st = mim_labels_from(c, r->cb, K, si->img + (size_t)j * isz, n, 0.4, ms, global_of(r, j), si->pl + (size_t)j * np);
    for (int j = 0; j < sx->n && !st; j += n)
        st = mlm_mask_from(&r->mlm, ms, global_of(r, j), sx->tok + (size_t)j * Tz, sx->len + j, n, T,
                           sx->tin + (size_t)j * Tz, sx->tl + (size_t)j * Tz);
    for (int j = 0; j < sp->n && !st; j += n)
        st = mlm_mask_from(&r->vlm, ms ^ 0x5555ULL, global_of(r, j), sp->tok + (size_t)j * Tz, sp->len + j, n, T,
                           sp->tin + (size_t)j * Tz, sp->tl + (size_t)j * Tz);
    for (int j = 0; j < sp->n && !st; j += n)
        st = mim_labels_from(c, r->cb, K, sp->img + (size_t)j * isz, n, 0.4, ms ^ 0xaaaaULL, global_of(r, j),
                             sp->pl + (size_t)j * np);
    if (st) vlmoe_error_prefix("masking");
    return st;
}

// One chunk of stream k as a model batch: samples [at, at + chunk).
static vlmoe_mome_batch part_of(const vlmoe_mome_run *r, int k, int at) {
    const stream *s = &r->s[k];
    const vlmoe_model_config *c = &r->cfg;
    const size_t isz = (size_t)3 * c->image_size * c->image_size, T = (size_t)c->context_length;
    const size_t np = (size_t)(c->image_size / c->patch_size) * (size_t)(c->image_size / c->patch_size);
    vlmoe_mome_batch b = {.encoding = k == S_IMAGE ? VLMOE_ENC_IMAGE : k == S_TEXT ? VLMOE_ENC_TEXT : VLMOE_ENC_PAIR,
                          .batch_size = r->chunk};
    if (k != S_TEXT) b.images = s->img + (size_t)at * isz, b.patch_labels = s->pl + (size_t)at * np;
    if (k != S_IMAGE) b.tokens = s->tin + (size_t)at * T, b.lengths = s->len + at, b.text_labels = s->tl + (size_t)at * T;
    return b;
}

// The forwards of every chunk of every stream, and the update.
static int m_step(void *u, vlmoe_trainer *t, long step, vlmoe_step_stats *s) {
    vlmoe_mome_run *r = u;
    (void)step;
    int n = 0;
    for (int k = 0; k < NSTREAMS; k++)
        for (int at = 0; at < r->s[k].n; at += r->chunk) r->part_stream[n] = k, r->parts[n++] = part_of(r, k, at);
    return vlmoe_trainer_step_mome(t, r->parts, r->nparts, r->part_stats, s);
}

// Routing of stream k: an eval-mode forward of its first chunk (the layers the encoding runs:
// V-MoE layers carry image tokens, T-MoE layers text tokens; the others report no tokens and are
// left out). Its layers go to the array moe and a compact summary to line.
static int stream_routing(vlmoe_mome_run *r, int k, cJSON *moe, char *line, size_t cap) {
    vlmoe_mome_batch b = part_of(r, k, 0);
    vlmoe_mome_stats es;
    int st = vlmoe_mome_forward(r->m, &b, 0, &es);
    if (st) return vlmoe_error_prefix("routing statistics"), st;
    int n, nk = 0;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(r->m, &n);
    vlmoe_moe_stats *keep = n ? malloc(sizeof(*keep) * (size_t)n) : NULL;
    if (n && !keep) return vlmoe_fail(VLMOE_ERR_NOMEM, "routing statistics");
    for (int i = 0; i < n; i++)
        if ((k != S_TEXT && ms[i].tokens[VLMOE_MOD_IMAGE] > 0 && !ms[i].tokens[VLMOE_MOD_TEXT]) ||
            (k != S_IMAGE && ms[i].tokens[VLMOE_MOD_TEXT] > 0 && !ms[i].tokens[VLMOE_MOD_IMAGE]))
            keep[nk++] = ms[i];
    cJSON *arr = nk ? vlmoe_metrics_moe(keep, nk, vlmoe_mome_stream_name(k), NULL) : NULL;
    while (arr && cJSON_GetArraySize(arr)) cJSON_AddItemToArray(moe, cJSON_DetachItemFromArray(arr, 0));
    cJSON_Delete(arr);
    size_t at = strlen(line);
    if (nk && at < cap) at += (size_t)snprintf(line + at, cap - at, "%s%s:", at ? " | " : "", vlmoe_mome_stream_name(k));
    for (int i = 0; i < nk && at < cap; i++) {
        const int mod = keep[i].tokens[VLMOE_MOD_IMAGE] ? VLMOE_MOD_IMAGE : VLMOE_MOD_TEXT;
        at += (size_t)snprintf(line + at, cap - at, "%s b%d %s success %.2f dropped %.2f experts %.2f", i ? "," : "",
                               keep[i].block, mod == VLMOE_MOD_IMAGE ? "V-MoE" : "T-MoE", keep[i].success[mod],
                               keep[i].dropped[mod], keep[i].experts_used[mod]);
    }
    free(keep);
    return VLMOE_OK;
}

// Per-stream losses of a step: the chunks' means weighted by their labelled positions.
typedef struct {
    double text, image, text_acc, image_acc, tc, ic;
} stream_loss;

// The per-stream losses and accuracies, and the routing of every stream ("moe": one array of
// layer records, each with its "stream"); the routing summary is kept in the report.
static int m_log(void *u, long done, const vlmoe_step_stats *s, cJSON *rec, char *line, size_t cap) {
    vlmoe_mome_run *r = u;
    (void)done;
    stream_loss l[NSTREAMS];
    memset(l, 0, sizeof(l));
    for (int i = 0; i < r->nparts; i++) {
        const vlmoe_mome_stats *ps = &r->part_stats[i];
        stream_loss *x = &l[r->part_stream[i]];
        x->text += ps->text * ps->text_count, x->text_acc += ps->text_acc * ps->text_count, x->tc += ps->text_count;
        x->image += ps->image * ps->image_count, x->image_acc += ps->image_acc * ps->image_count;
        x->ic += ps->image_count;
    }
    for (int k = 0; k < NSTREAMS; k++) {
        if (l[k].tc > 0) l[k].text /= l[k].tc, l[k].text_acc /= l[k].tc;
        if (l[k].ic > 0) l[k].image /= l[k].ic, l[k].image_acc /= l[k].ic;
    }
    size_t at = 0;
    if (r->s[S_IMAGE].n) {
        cJSON_AddNumberToObject(rec, "mim", l[S_IMAGE].image);
        cJSON_AddNumberToObject(rec, "mim_acc", l[S_IMAGE].image_acc);
        at += (size_t)snprintf(line + at, cap - at, "  MIM %.4f (acc %.3f)", l[S_IMAGE].image, l[S_IMAGE].image_acc);
    }
    if (r->s[S_TEXT].n && at < cap) {
        cJSON_AddNumberToObject(rec, "mlm", l[S_TEXT].text);
        cJSON_AddNumberToObject(rec, "mlm_acc", l[S_TEXT].text_acc);
        at += (size_t)snprintf(line + at, cap - at, "  MLM %.4f (acc %.3f)", l[S_TEXT].text, l[S_TEXT].text_acc);
    }
    if (r->s[S_PAIR].n && at < cap) {
        cJSON_AddNumberToObject(rec, "vlm_text", l[S_PAIR].text);
        cJSON_AddNumberToObject(rec, "vlm_image", l[S_PAIR].image);
        cJSON_AddNumberToObject(rec, "vlm_text_acc", l[S_PAIR].text_acc);
        cJSON_AddNumberToObject(rec, "vlm_image_acc", l[S_PAIR].image_acc);
        at += (size_t)snprintf(line + at, cap - at, "  VLM %.4f + %.4f (acc %.3f/%.3f)", l[S_PAIR].text,
                               l[S_PAIR].image, l[S_PAIR].text_acc, l[S_PAIR].image_acc);
    }
    if (at < cap) snprintf(line + at, cap - at, "  aux %.4f", s->aux);
    r->rep.routing[0] = 0;
    cJSON *moe = cJSON_CreateArray();
    if (!moe) return vlmoe_fail(VLMOE_ERR_NOMEM, "metrics record");
    int st = VLMOE_OK;
    for (int k = 0; k < NSTREAMS && !st; k++)
        if (r->s[k].n) st = stream_routing(r, k, moe, r->rep.routing, sizeof(r->rep.routing));
    if (!st && cJSON_GetArraySize(moe)) cJSON_AddItemToObject(rec, "moe", moe);
    else cJSON_Delete(moe);
    return st;
}

// The data position after step `done`: the loader's (its seed and order in data_rng[0..2]) or
// the synthetic samples used; data_rng[3] holds the signature of the data set-up.
static void m_data_state(void *u, long done, vlmoe_data_state *ds) {
    vlmoe_mome_run *r = u;
    if (r->loader) vlmoe_loader_position(r->loader, ds);
    else ds->data_position = (uint64_t)done * (uint64_t)r->n_synth * (uint64_t)r->p.world; // global samples
    ds->data_rng[3] = r->rep.signature;
}

vlmoe_run_task vlmoe_mome_task(vlmoe_mome_run *r) {
    const vlmoe_run_task t = {r, m_fill, m_step, m_log, NULL, m_data_state};
    return t;
}
