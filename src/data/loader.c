// loader.c: the parallel, deterministic, resumable training data loader (see loader.h for the
// order, the pipeline and the bad-sample rules). Spec: ../shared/spec/MODEL.md ("Data").
// Covered by tests/test_loader.c.
#include "data/loader.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "data/order.h"

#define MAX_WORKERS 256
#define MSG_LEN 640
#define STATE_TAG 0x6c6f61646572ull   // "loader": data_rng[1] of a loader's position

// SLOT_SKIP: a sample this process did not expect to keep, taken from the source but not decoded
// (its claim is held in case another process's bad sample shifts it into this process's block).
enum { SLOT_FREE, SLOT_BUSY, SLOT_GOOD, SLOT_BAD, SLOT_ERROR, SLOT_SKIP };
// A sample's state as the processes agree on it (the maximum over them; unknown: none decoded it).
enum { KNOWN_NONE, KNOWN_GOOD, KNOWN_UNREADABLE, KNOWN_UNDECODABLE, KNOWN_ERROR };
enum { STREAM_SAMPLE = 1, STREAM_ROWS, STREAM_SHARDS, STREAM_BLOCK, STREAM_RESAMPLE };
#define RESAMPLED_BIT (1ull << 63)   // in data_rng[2]: a resampled order, factors hashed in bits 32..62

// A sample's place in the order: epoch, index in the epoch and, for webdataset, where its shuffle
// block starts (position in the epoch's shard order, tar member).
typedef struct { int64_t epoch, index, shard, item; } coords;

// One webdataset sample of the current block, owned until a worker takes it.
typedef struct { uint8_t *image; size_t len; char *caption, *key; } raw;

// A sample handed from the source to a worker.
typedef struct {
    coords at, next;
    const char *path, *caption;  // CSV: the row, owned by the table
    int64_t line;
    raw r;                       // webdataset: taken from the block
} claim;

typedef struct {
    int state;                   // SLOT_*
    int bad;                     // SLOT_BAD: KNOWN_UNREADABLE or KNOWN_UNDECODABLE
    claim c;                     // SLOT_SKIP: the sample, to decode if it turns out to be kept
    coords at, next;             // this sample and the one after it
    float *image;                // (3, S, S); with p.pixels (S, S, 3) bytes
    int32_t *tokens;             // (context_length)
    int32_t len;
    char *key;
    vlmoe_dataset_stats delta;   // what consuming this sample adds to the stats
    int err;                     // SLOT_ERROR: status and message; else the CSV-folder note
    int csv_dir;                 // the image was read from the CSV's folder (msg: the note)
    char msg[MSG_LEN];
} slot;


struct vlmoe_loader {
    vlmoe_loader_params p;
    char *path;                  // p.data.path (and the keys) copied
    char *img_key, *caption_key, *upsampling;
    int csv;
    char *csv_dir;               // CSV: its folder, for image paths not in the working directory
    int noted;                   // the CSV-folder note was given
    size_t isz;                  // floats per image
    size_t ibytes;               // bytes per image: isz floats, or isz bytes with p.pixels
    // CSV: the usable rows, "path\0caption\0" each at text + off[i]
    char *text;
    size_t text_len, text_cap;
    size_t *off;
    int64_t *line;
    int64_t rows;
    size_t rows_cap;
    uint32_t *perm;              // this epoch's order (rows for CSV, shards for webdataset)
    int64_t perm_epoch;
    // webdataset
    char **shards;
    int n_shards;
    double *cum;                 // resampled with factors: cumulative shard weights (n_shards)
    uint64_t resample_id;        // resampled: RESAMPLED_BIT | hash of the factors; else 0
    vlmoe_dataset *rd;           // reader of shard perm[rd_at.shard] or NULL
    coords rd_at;                // its epoch, -, shard position and next member
    raw *block;
    uint32_t *bperm;
    int bn, bp, exhausted;       // samples in the block, next one to emit, epoch ends with it
    coords bstart, bend;         // where the block starts and where the next one starts
    vlmoe_dataset_stats pending; // reader counts not yet attached to a sample
    // the source (under mu)
    coords src;                  // the next sample the source emits
    int have_block;
    int src_err;
    char src_msg[MSG_LEN];
    // the ring
    slot *slots;
    int64_t R, claimed, cursor;  // slots; next stream index to claim; next to consume
    int64_t base;                // where the global batch being assembled starts (the workers'
                                 // guess of which samples this process keeps; see share_*)
    uint8_t *known;              // (G) KNOWN_* of a window of samples, agreed on by the processes
    pthread_mutex_t mu;
    pthread_cond_t space, done;
    pthread_t *threads;
    int nthreads, started, stop;
    vlmoe_image img;             // workers = 0: the caller's decode buffer
    // the consumer
    float *images;
    int32_t *tokens, *lens;
    char **keys;
    vlmoe_dataset_stats stats;
    coords pos;                  // the next sample to consume
    int64_t epoch, epoch_good;   // epoch of the samples being consumed; good ones so far
    int failed;
    char fail_msg[MSG_LEN];
};

vlmoe_loader_params vlmoe_loader_default_params(void) {
    vlmoe_loader_params p;
    memset(&p, 0, sizeof p);
    p.data = vlmoe_dataset_default_params();
    p.image = vlmoe_image_default_params();
    p.train = 1;
    p.shuffle = 1;
    p.shuffle_block = 1000;
    p.batch_size = 64;
    p.context_length = 77;
    p.workers = 2;
    p.prefetch = 2;
    p.max_bad_fraction = 0.1;
    p.bad_check_min = 1000;
    p.world = 1;
    return p;
}

// ---- seeded streams -------------------------------------------------------------------------
// The key of stream (stream, epoch, index) of the run's seed (src/data/order.c's mixing).
static uint64_t stream_key(uint64_t seed, int stream, int64_t epoch, int64_t index) {
    return vlmoe_order_mix(vlmoe_order_mix(vlmoe_order_mix(seed, (uint64_t)stream), (uint64_t)epoch), (uint64_t)index);
}

static void seed_rng(vlmoe_rng *r, uint64_t seed, int stream, int64_t epoch, int64_t index) {
    vlmoe_rng_seed(r, stream_key(seed, stream, epoch, index));
}

// perm = 0..n-1, shuffled by the stream (stream, epoch, index) when shuffling: the data order of
// src/data/order.c, keyed by the loader's own stream.
static void make_perm(const vlmoe_loader *ld, uint32_t *perm, uint32_t n, int stream, int64_t epoch,
                      int64_t index) {
    if (!ld->p.shuffle) {
        for (uint32_t i = 0; i < n; i++) perm[i] = i;
        return;
    }
    vlmoe_order_shuffle(perm, n, stream_key(ld->p.seed, stream, epoch, index));
}

static int grow(void *pp, size_t *cap, size_t need, size_t elem, const char *what) {
    if (need <= *cap) return VLMOE_OK;
    size_t nc = *cap ? *cap : 64, bytes;
    while (nc < need) nc *= 2;
    if (vlmoe_mul_ok(nc, elem, &bytes)) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: too large", what);
    void *q = realloc(*(void **)pp, bytes);
    if (!q) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate %zu bytes for %s", bytes, what);
    *(void **)pp = q, *cap = nc;
    return VLMOE_OK;
}

static char *dup_str(const char *s) {
    char *d = s ? malloc(strlen(s) + 1) : NULL;
    if (d) strcpy(d, s);
    else if (s) vlmoe_fail(VLMOE_ERR_NOMEM, "cannot copy a string");
    return d;
}

// ---- CSV: the row table ---------------------------------------------------------------------
static int csv_index(vlmoe_loader *ld, vlmoe_dataset *ds) {
    vlmoe_sample s;
    int r;
    while ((r = vlmoe_dataset_next(ds, &s)) == 1) {
        size_t lp = strlen(s.image_path) + 1, lc = strlen(s.caption) + 1, rows = (size_t)ld->rows;
        size_t cap_line = ld->rows_cap;   // off and line grow together
        int st = grow(&ld->text, &ld->text_cap, ld->text_len + lp + lc, 1, "the CSV rows");
        if (!st) st = grow(&ld->line, &cap_line, rows + 1, sizeof *ld->line, "the CSV rows");
        if (!st) st = grow(&ld->off, &ld->rows_cap, rows + 1, sizeof *ld->off, "the CSV rows");
        if (st) return st;
        ld->off[rows] = ld->text_len;
        // the key is "PATH:LINE" (readers.h): only the line is kept
        ld->line[rows] = strtoll(strrchr(s.key, ':') + 1, NULL, 10);
        memcpy(ld->text + ld->text_len, s.image_path, lp);
        memcpy(ld->text + ld->text_len + lp, s.caption, lc);
        ld->text_len += lp + lc;
        ld->rows++;
    }
    if (r < 0) return -r;
    // The rows indexed here are counted when their samples are consumed; the rejected ones now.
    ld->stats = *vlmoe_dataset_get_stats(ds);
    ld->stats.total -= ld->rows;
    if (ld->rows == 0) {
        char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
        vlmoe_dataset_stats_format(vlmoe_dataset_get_stats(ds), sum, sizeof sum);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no usable rows; %s", ld->path, sum);
    }
    if (ld->rows > UINT32_MAX) return vlmoe_fail(VLMOE_ERR_ARG, "%s: more than 2^32 rows", ld->path);
    int st = vlmoe_dataset_check_bad(vlmoe_dataset_get_stats(ds), ld->p.max_bad_fraction);
    if (st) return vlmoe_error_prefix("%s", ld->path), st;
    ld->perm = malloc(sizeof(uint32_t) * (size_t)ld->rows);
    return ld->perm ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate the row order");
}

static int csv_take(vlmoe_loader *ld, claim *c) {
    if (ld->perm_epoch != ld->src.epoch) {
        make_perm(ld, ld->perm, (uint32_t)ld->rows, STREAM_ROWS, ld->src.epoch, 0);
        ld->perm_epoch = ld->src.epoch;
    }
    const int64_t row = ld->perm[ld->src.index];
    c->path = ld->text + ld->off[row];
    c->caption = c->path + strlen(c->path) + 1;
    c->line = ld->line[row];
    c->at = ld->src;
    if (++ld->src.index == ld->rows) ld->src.epoch++, ld->src.index = 0;
    c->next = ld->src;
    return VLMOE_OK;
}

// ---- webdataset: shards, blocks ------------------------------------------------------------
static void raw_free(raw *r) {
    free(r->image), free(r->caption), free(r->key);
    memset(r, 0, sizeof *r);
}

static void block_clear(vlmoe_loader *ld) {
    for (int i = 0; i < ld->bn; i++) raw_free(&ld->block[i]);
    ld->bn = ld->bp = 0;
}

static void reader_close(vlmoe_loader *ld) {
    vlmoe_dataset_free(ld->rd);
    ld->rd = NULL;
}

// Counts what the reader rejected since the last call into `pending`, and the sample it returned
// (if any) out again: that one is counted when consumed.
static void reader_count(vlmoe_loader *ld, int got) {
    vlmoe_dataset_stats_merge(&ld->pending, vlmoe_dataset_get_stats(ld->rd));
    ld->pending.total -= got;
    vlmoe_dataset_reset_stats(ld->rd);
}

// The shard read at position k of epoch e: the epoch's permutation, or the k-th draw with
// replacement when resampling (a function of (seed, k) alone, so nothing but k is saved).
static int shard_at(vlmoe_loader *ld, int64_t e, int64_t k) {
    if (ld->resample_id) {
        vlmoe_rng r;
        seed_rng(&r, ld->p.seed, STREAM_RESAMPLE, 0, k);
        if (!ld->cum) return (int)vlmoe_rng_below(&r, (uint32_t)ld->n_shards);
        // the first shard whose cumulative weight exceeds u (zero-weight shards never do)
        const double u = vlmoe_rng_uniform(&r) * ld->cum[ld->n_shards - 1];
        int lo = 0, hi = ld->n_shards - 1;
        while (lo < hi) {
            const int mid = lo + (hi - lo) / 2;
            if (ld->cum[mid] > u) hi = mid;
            else lo = mid + 1;
        }
        return lo;
    }
    if (ld->perm_epoch != e) {
        make_perm(ld, ld->perm, (uint32_t)ld->n_shards, STREAM_SHARDS, e, 0);
        ld->perm_epoch = e;
    }
    return (int)ld->perm[k];
}

// Positions the reader at shard position at.shard, member at.item of epoch at.epoch (no reader
// past the last shard).
static int reader_at(vlmoe_loader *ld, coords at) {
    if (ld->rd && ld->rd_at.epoch == at.epoch && ld->rd_at.shard == at.shard && ld->rd_at.item == at.item)
        return VLMOE_OK;
    reader_close(ld);
    ld->rd_at = at;
    if (!ld->resample_id && at.shard >= ld->n_shards) return VLMOE_OK;
    vlmoe_dataset_params dp = ld->p.data;
    dp.type = VLMOE_DATASET_WEBDATASET;
    dp.path = ld->shards[shard_at(ld, at.epoch, at.shard)];
    int st = vlmoe_dataset_open(&dp, &ld->rd);
    vlmoe_dataset_pos pos = {0, at.item};
    if (!st && at.item) st = vlmoe_dataset_seek(ld->rd, pos);
    if (st) reader_close(ld);
    return st;
}

// Reads the block that starts at ld->src's block (index rounded down to a block boundary).
static int block_fill(vlmoe_loader *ld) {
    block_clear(ld);
    const int K = ld->p.shuffle_block;
    coords at = ld->src;
    at.index -= at.index % K;
    ld->bstart = at;
    ld->exhausted = 0;
    int st = reader_at(ld, at);
    // resampled data never ends: shards drawn in a row without a usable sample stop it instead
    const int64_t max_dry = 100 + 10 * (int64_t)ld->n_shards;
    int64_t dry = 0;
    while (!st && ld->bn < K) {
        if (ld->resample_id && dry > max_dry) {
            char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
            vlmoe_dataset_stats_format(&ld->pending, sum, sizeof sum);
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%lld shards drawn in a row gave no usable sample; %s",
                            (long long)dry, sum);
            break;
        }
        if (!ld->rd) {
            if (!ld->resample_id && at.shard >= ld->n_shards) {
                ld->exhausted = 1;
                break;
            }
            if ((st = reader_at(ld, at))) break;
            continue;
        }
        vlmoe_sample s;
        int r = vlmoe_dataset_next(ld->rd, &s);
        if (r < 0) {
            st = -r;
            break;
        }
        reader_count(ld, r);
        if (r == 1) {
            raw *e = &ld->block[ld->bn];
            e->image = malloc(s.image_len);
            e->caption = dup_str(s.caption), e->key = dup_str(s.key);
            if (!e->image || !e->caption || !e->key) {
                raw_free(e);
                st = vlmoe_fail(VLMOE_ERR_NOMEM, "%s: cannot hold a sample of %zu bytes", s.key, s.image_len);
                break;
            }
            memcpy(e->image, s.image, s.image_len);
            e->len = s.image_len;
            ld->bn++;
            dry = 0;
            vlmoe_dataset_pos p = vlmoe_dataset_position(ld->rd);
            at.item = p.item;
            if (p.shard == 0) {
                ld->rd_at = at;
                continue;
            }
        }
        reader_close(ld);   // the shard is done
        at.shard++, at.item = 0;
        dry++;
    }
    if (st) return vlmoe_error_prefix("%s", ld->path), st;
    ld->bend = at;
    ld->bp = (int)(ld->src.index - ld->bstart.index);
    if (ld->bp > 0) memset(&ld->pending, 0, sizeof ld->pending);   // counted before the resume
    if (ld->bp > 0 && ld->bp >= ld->bn)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: position (epoch %lld, sample %lld) is past the end of its "
                          "shuffle block (%d samples): the data or --seed changed", ld->path,
                          (long long)ld->src.epoch, (long long)ld->src.index, ld->bn);
    make_perm(ld, ld->bperm, (uint32_t)ld->bn, STREAM_BLOCK, at.epoch, ld->bstart.index);
    ld->have_block = 1;
    return VLMOE_OK;
}

static int wds_take(vlmoe_loader *ld, claim *c, vlmoe_dataset_stats *delta) {
    while (!ld->have_block || ld->bp == ld->bn) {
        if (ld->have_block && ld->exhausted) {   // the epoch ended exactly at a block boundary
            if (ld->src.index == 0) {
                char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
                vlmoe_dataset_stats_format(&ld->pending, sum, sizeof sum);
                return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: an epoch gave no usable sample; %s", ld->path, sum);
            }
            ld->src = (coords){ld->src.epoch + 1, 0, 0, 0};
        }
        int st = block_fill(ld);
        if (st) return st;
    }
    if (ld->bp == 0) {   // the block's reader counts go with its first sample
        vlmoe_dataset_stats_merge(delta, &ld->pending);
        memset(&ld->pending, 0, sizeof ld->pending);
    }
    c->r = ld->block[ld->bperm[ld->bp]];
    memset(&ld->block[ld->bperm[ld->bp]], 0, sizeof(raw));
    c->at = ld->src;
    ld->bp++;
    if (ld->bp < ld->bn) ld->src.index++;
    else if (ld->exhausted) ld->src = (coords){ld->src.epoch + 1, 0, 0, 0};
    else ld->src = (coords){ld->src.epoch, ld->bstart.index + ld->bn, ld->bend.shard, ld->bend.item};
    if (ld->bp == ld->bn && ld->exhausted) ld->have_block = 0;   // the next epoch starts afresh
    c->next = ld->src;
    return VLMOE_OK;
}

// ---- the share of one process ---------------------------------------------------------------
// Global sample g (the g-th good sample of a global batch of batch_size x world) is this process's
// row, or -1: the global batch is dealt in pieces of `chunk` to the processes in turn, so with the
// default chunk (the whole batch_size) process r takes rows r x batch_size ... (src/data/order.h).
static int share_row(const vlmoe_loader *ld, int64_t g) {
    const int64_t c = ld->p.chunk ? ld->p.chunk : ld->p.batch_size, W = ld->p.world;
    return (g / c) % W == ld->p.rank ? (int)(g / (c * W) * c + g % c) : -1;
}

// ---- workers --------------------------------------------------------------------------------
// Decodes, preprocesses and tokenizes claim c into slot s; returns the slot's new state.
static int prepare(vlmoe_loader *ld, claim *c, slot *s, vlmoe_image *img) {
    free(s->key);
    s->csv_dir = 0;
    int st;
    if (ld->csv) {
        size_t n = strlen(ld->path) + 24, fn = strlen(c->path) + (ld->csv_dir ? strlen(ld->csv_dir) : 0) + 2;
        s->key = malloc(n);
        char *file = malloc(fn);
        if (s->key) snprintf(s->key, n, "%s:%lld", ld->path, (long long)c->line);
        const int alt = file ? vlmoe_csv_image_path(ld->csv_dir, c->path, file, fn) : -1;
        st = !s->key || !file ? vlmoe_fail(VLMOE_ERR_NOMEM, "a sample key") : alt < 0 ? VLMOE_ERR_ARG
             : vlmoe_image_load(file, img);
        if (st == VLMOE_ERR_IO && !alt && ld->csv_dir && c->path[0] != '/') {   // looked in both places
            char why[MSG_LEN];
            snprintf(why, sizeof why, "%s", vlmoe_last_error());
            vlmoe_fail(st, "%s (nor in the CSV's folder %s/)", why, ld->csv_dir);
        }
        if (alt == 1) {
            s->csv_dir = 1;
            snprintf(s->msg, sizeof s->msg, "%s: note: image paths are read relative to the CSV file's folder "
                     "%s/: %s is not in the working directory (where OpenCLIP looks) but %s is; so is every "
                     "path found only there", ld->path, ld->csv_dir, c->path, file);
        }
        free(file);
    } else {
        s->key = c->r.key, c->r.key = NULL;
        st = vlmoe_image_decode(c->r.image, c->r.len, s->key, img);
    }
    const char *caption = ld->csv ? c->caption : c->r.caption;
    if (st && st != VLMOE_ERR_NOMEM) {
        // a CSV image's message names its path, a shard member's its key already
        s->bad = st == VLMOE_ERR_IO ? KNOWN_UNREADABLE : KNOWN_UNDECODABLE;
        vlmoe_dataset_stats_add_bad(&s->delta, st == VLMOE_ERR_IO ? VLMOE_BAD_UNREADABLE_IMAGE
                                    : VLMOE_BAD_UNDECODABLE_IMAGE, "%s%s%s", ld->csv ? s->key : "",
                                    ld->csv ? ": " : "", vlmoe_last_error());
        raw_free(&c->r);
        return SLOT_BAD;
    }
    if (!st) {
        vlmoe_rng r;
        seed_rng(&r, ld->p.seed, STREAM_SAMPLE, c->at.epoch, c->at.index);
        if (ld->p.pixels)
            st = ld->p.train ? vlmoe_image_preprocess_train_u8(img, &ld->p.image, &r, (uint8_t *)s->image)
                             : vlmoe_image_preprocess_eval_u8(img, &ld->p.image, (uint8_t *)s->image);
        else
            st = ld->p.train ? vlmoe_image_preprocess_train(img, &ld->p.image, &r, s->image)
                             : vlmoe_image_preprocess_eval(img, &ld->p.image, s->image);
    }
    if (!st && ld->p.tokenize) {
        s->len = ld->p.tokenize(ld->p.tokenize_user, caption, s->tokens, ld->p.context_length);
        if (s->len < 2) st = VLMOE_ERR_ARG;
    }
    raw_free(&c->r);
    if (st) {
        s->err = st;
        snprintf(s->msg, sizeof s->msg, "%s: %s", s->key ? s->key : ld->path, vlmoe_last_error());
        return SLOT_ERROR;
    }
    s->delta.total++;
    return SLOT_GOOD;
}

// Takes the stream's next sample into its slot and prepares it (waiting for a free slot). Returns 1
// when the loader is stopping.
static int produce(vlmoe_loader *ld, vlmoe_image *img) {
    pthread_mutex_lock(&ld->mu);
    while (!ld->stop && ld->claimed >= ld->cursor + ld->R) pthread_cond_wait(&ld->space, &ld->mu);
    if (ld->stop) {
        pthread_mutex_unlock(&ld->mu);
        return 1;
    }
    const int64_t i = ld->claimed++;
    slot *s = &ld->slots[i % ld->R];
    // decode only what this process expects to keep, if no sample from `base` on is bad
    const int64_t G = (int64_t)ld->p.batch_size * ld->p.world;
    const int mine = ld->p.world == 1 || share_row(ld, (i - ld->base) % G) >= 0;
    claim c;
    memset(&c, 0, sizeof c);
    memset(&s->delta, 0, sizeof s->delta);
    s->state = SLOT_BUSY;
    int st = ld->src_err;
    if (!st) {
        st = ld->csv ? csv_take(ld, &c) : wds_take(ld, &c, &s->delta);
        if (st) ld->src_err = st, snprintf(ld->src_msg, sizeof ld->src_msg, "%s", vlmoe_last_error());
    }
    if (st) s->err = st, memcpy(s->msg, ld->src_msg, sizeof s->msg);
    pthread_mutex_unlock(&ld->mu);
    s->at = c.at, s->next = c.next;
    s->csv_dir = 0;
    int state = SLOT_SKIP;
    if (st) state = SLOT_ERROR;
    else if (mine) state = prepare(ld, &c, s, img);
    else s->c = c;   // the raw sample moves into the slot
    pthread_mutex_lock(&ld->mu);
    s->state = state;
    pthread_cond_signal(&ld->done);
    pthread_mutex_unlock(&ld->mu);
    return 0;
}

static void *worker_main(void *arg) {
    vlmoe_loader *ld = arg;
    vlmoe_image img = {.max_pixels = (size_t)ld->p.image.max_pixels};
    while (!produce(ld, &img)) {}
    vlmoe_image_free(&img);
    return NULL;
}

// ---- API ------------------------------------------------------------------------------------
static int check_params(const vlmoe_loader_params *p) {
    if (!p->data.path) return vlmoe_fail(VLMOE_ERR_ARG, "loader: no data path");
    if (p->batch_size < 1 || p->prefetch < 1 || p->shuffle_block < 1 || p->workers < 0 ||
        p->workers > MAX_WORKERS || (p->tokenize && p->context_length < 2))
        return vlmoe_fail(VLMOE_ERR_ARG, "loader: batch_size %d, prefetch %d and shuffle_block %d must be "
                          ">= 1, workers %d in [0, %d], context_length %d >= 2", p->batch_size, p->prefetch,
                          p->shuffle_block, p->workers, MAX_WORKERS, p->context_length);
    if (!(p->max_bad_fraction >= 0 && p->max_bad_fraction <= 1))
        return vlmoe_fail(VLMOE_ERR_ARG, "loader: max_bad_fraction %g outside [0, 1]", p->max_bad_fraction);
    if (p->upsampling && !p->resampled)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: upsampling factors (--train-data-upsampling-factors) weight shards drawn "
                          "with replacement: they need --dataset-resampled, as in OpenCLIP", p->data.path);
    if (p->chunk < 0 || (p->chunk && p->batch_size % p->chunk))
        return vlmoe_fail(VLMOE_ERR_ARG, "loader: chunk %d does not divide batch_size %d", p->chunk, p->batch_size);
    if (p->world < 1 || p->rank < 0 || p->rank >= p->world || (p->world > 1 && !p->agree) ||
        (int64_t)p->batch_size * p->world > INT32_MAX / 2)
        return vlmoe_fail(VLMOE_ERR_ARG, "loader: rank %d of a world of %d (with an agree function when more than "
                          "one) at batch %d per process", p->rank, p->world, p->batch_size);
    if (p->epoch_samples < 0) return vlmoe_fail(VLMOE_ERR_ARG, "loader: epoch_samples %lld < 0", (long long)p->epoch_samples);
    return vlmoe_image_params_check(&p->image);
}

// Resampled: the cumulative weights of the shards from ld->p.upsampling, one factor per
// "::"-joined source of the path (OpenCLIP's expand_urls), and the order's identity.
static int resample_weights(vlmoe_loader *ld) {
    const char *f = ld->p.upsampling;
    uint64_t h = vlmoe_order_mix(0x7265736d706cull, (uint64_t)ld->n_shards);
    if (!f) return ld->resample_id = RESAMPLED_BIT | (h >> 33 << 32), VLMOE_OK;
    int sources = 1;
    for (const char *q = ld->path; (q = strstr(q, "::")); q += 2) sources++;
    int factors = 1;
    for (const char *q = f; (q = strstr(q, "::")); q += 2) factors++;
    if (factors != sources)
        return vlmoe_fail(VLMOE_ERR_ARG, "--train-data-upsampling-factors '%s' has %d factor%s, but --train-data '%s' "
                          "has %d source%s (patterns joined by '::'): give one factor per source", f, factors,
                          factors == 1 ? "" : "s", ld->path, sources, sources == 1 ? "" : "s");
    if (!(ld->cum = malloc(sizeof(double) * (size_t)ld->n_shards))) return vlmoe_fail(VLMOE_ERR_NOMEM, "shard weights");
    const char *src = ld->path;
    int at = 0;
    double total = 0;
    for (int i = 0; i < sources; i++) {
        // this source's shards: the pattern up to the next "::", expanded alone
        const char *end = strstr(src, "::");
        const size_t len = end ? (size_t)(end - src) : strlen(src);
        char *one = malloc(len + 1), **names = NULL, *stop;
        int n = 0;
        if (!one) return vlmoe_fail(VLMOE_ERR_NOMEM, "shard weights");
        memcpy(one, src, len), one[len] = 0;
        int st = vlmoe_expand_braces(one, &names, &n);
        free(one), vlmoe_free_strings(names, n);
        if (st) return st;
        errno = 0;
        const double w = strtod(f, &stop);
        if (stop == f || (*stop && strncmp(stop, "::", 2)) || !isfinite(w) || w < 0 || errno)
            return vlmoe_fail(VLMOE_ERR_ARG, "--train-data-upsampling-factors '%s': factor %d is not a finite number "
                              ">= 0", ld->p.upsampling, i + 1);
        for (int k = 0; k < n && at < ld->n_shards; k++) total += w, ld->cum[at++] = total;
        h = vlmoe_order_mix(h, (uint64_t)n);
        uint64_t wb;
        memcpy(&wb, &w, sizeof wb);
        h = vlmoe_order_mix(h, wb);
        f = *stop ? stop + 2 : stop;
        src = end ? end + 2 : src + len;
    }
    if (at != ld->n_shards || !(total > 0))
        return vlmoe_fail(VLMOE_ERR_ARG, "--train-data-upsampling-factors '%s': %s", ld->p.upsampling,
                          total > 0 ? "the sources do not add up to the shard list" : "every factor is 0: no shard can be drawn");
    ld->resample_id = RESAMPLED_BIT | (h >> 33 << 32);
    return VLMOE_OK;
}

int vlmoe_loader_check_order(const vlmoe_loader_params *p) {
    if (!p->resampled && !p->upsampling) return VLMOE_OK;
    int st = check_params(p);
    vlmoe_dataset_params dp = p->data;
    dp.defer_images = 1;
    vlmoe_dataset *ds = NULL;
    if (!st) st = vlmoe_dataset_open(&dp, &ds);
    if (!st && vlmoe_dataset_get_type(ds) == VLMOE_DATASET_CSV)
        st = vlmoe_fail(VLMOE_ERR_ARG, "%s: --dataset-resampled draws webdataset shards with replacement (as in "
                        "OpenCLIP); a CSV is read once per epoch in a shuffled order", p->data.path);
    vlmoe_dataset_free(ds);
    vlmoe_loader ld;   // the shard weights, on a loader that holds nothing else
    memset(&ld, 0, sizeof ld);
    ld.p = *p, ld.path = (char *)p->data.path;
    if (!st) st = vlmoe_expand_braces(ld.path, &ld.shards, &ld.n_shards);
    if (!st) st = resample_weights(&ld);
    vlmoe_free_strings(ld.shards, ld.n_shards);
    free(ld.cum);
    return st;
}

static int open_shards(vlmoe_loader *ld) {
    int st = vlmoe_expand_braces(ld->path, &ld->shards, &ld->n_shards);
    for (int i = 0; !st && i < ld->n_shards; i++)
        if (strpbrk(ld->shards[i], "{}") || strstr(ld->shards[i], "::"))
            st = vlmoe_fail(VLMOE_ERR_ARG, "%s: shard name '%s' holds '{', '}' or '::'; rename the shard",
                            ld->path, ld->shards[i]);
    if (!st && ld->p.resampled) st = resample_weights(ld);
    if (st) return st;
    const size_t K = (size_t)ld->p.shuffle_block;
    ld->perm = malloc(sizeof(uint32_t) * (size_t)ld->n_shards);
    ld->block = calloc(K, sizeof(raw));
    ld->bperm = malloc(sizeof(uint32_t) * K);
    return ld->perm && ld->block && ld->bperm ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "shuffle block");
}

int vlmoe_loader_open(const vlmoe_loader_params *p, vlmoe_loader **out) {
    if (!p || !out) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_loader_open: NULL argument");
    *out = NULL;
    int st = check_params(p);
    if (st) return st;
    vlmoe_loader *ld = calloc(1, sizeof *ld);
    if (!ld) return vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate a loader");
    ld->p = *p;
    ld->img.max_pixels = (size_t)p->image.max_pixels;
    pthread_mutex_init(&ld->mu, NULL);
    pthread_cond_init(&ld->space, NULL);
    pthread_cond_init(&ld->done, NULL);
    ld->path = dup_str(p->data.path);
    ld->img_key = dup_str(p->data.img_key);
    ld->caption_key = dup_str(p->data.caption_key);
    ld->upsampling = p->upsampling ? dup_str(p->upsampling) : NULL;
    ld->p.data.path = ld->path, ld->p.data.img_key = ld->img_key, ld->p.data.caption_key = ld->caption_key;
    ld->p.upsampling = ld->upsampling;
    ld->p.data.defer_images = 1;
    ld->perm_epoch = -1;
    ld->rd_at.epoch = -1;
    const int B = p->batch_size, S = p->image.size;
    ld->isz = (size_t)3 * S * S;
    ld->ibytes = p->pixels ? ld->isz : sizeof(float) * ld->isz;
    ld->R = (int64_t)p->prefetch * B * p->world;   // the ring holds the global batches
    ld->known = malloc((size_t)B * (size_t)p->world);
    st = ld->path && ld->known && ld->img_key && ld->caption_key && (ld->upsampling || !p->upsampling) ? VLMOE_OK : VLMOE_ERR_NOMEM;
    vlmoe_dataset *ds = NULL;
    if (!st) st = vlmoe_dataset_open(&ld->p.data, &ds);   // every hard error of the data
    if (!st) {
        ld->csv = vlmoe_dataset_get_type(ds) == VLMOE_DATASET_CSV;
        if (ld->csv && p->resampled)
            st = vlmoe_loader_check_order(p);
        else if (ld->csv && !(st = vlmoe_csv_dir(ld->path, &ld->csv_dir)))
            st = csv_index(ld, ds);
        else if (!ld->csv)
            st = open_shards(ld);
    }
    vlmoe_dataset_free(ds);
    const size_t ctx = p->tokenize ? (size_t)p->context_length : 1;
    if (!st) {
        ld->slots = calloc((size_t)ld->R, sizeof(slot));
        ld->images = vlmoe_alloc(ld->ibytes * B, "loader batch");
        ld->tokens = malloc(sizeof(int32_t) * ctx * B);
        ld->lens = malloc(sizeof(int32_t) * B);
        ld->keys = calloc((size_t)B, sizeof(char *));
        ld->threads = calloc((size_t)(p->workers ? p->workers : 1), sizeof(pthread_t));
        if (!ld->slots || !ld->images || !ld->tokens || !ld->lens || !ld->keys || !ld->threads)
            st = vlmoe_fail(VLMOE_ERR_NOMEM, "cannot allocate the loader's batch");
    }
    for (int64_t i = 0; !st && i < ld->R; i++) {
        ld->slots[i].image = vlmoe_alloc(ld->ibytes, "loader slot");
        ld->slots[i].tokens = malloc(sizeof(int32_t) * ctx);
        if (!ld->slots[i].image || !ld->slots[i].tokens) st = vlmoe_fail(VLMOE_ERR_NOMEM, "loader slots");
    }
    if (st) {
        vlmoe_loader_free(ld);
        return st;
    }
    *out = ld;
    return VLMOE_OK;
}

void vlmoe_loader_free(vlmoe_loader *ld) {
    if (!ld) return;
    pthread_mutex_lock(&ld->mu);
    ld->stop = 1;
    pthread_cond_broadcast(&ld->space);
    pthread_mutex_unlock(&ld->mu);
    for (int i = 0; i < ld->nthreads; i++) pthread_join(ld->threads[i], NULL);
    for (int64_t i = 0; ld->slots && i < ld->R; i++) {
        vlmoe_free_mem(ld->slots[i].image);
        free(ld->slots[i].tokens), free(ld->slots[i].key), raw_free(&ld->slots[i].c.r);
    }
    for (int i = 0; ld->keys && i < ld->p.batch_size; i++) free(ld->keys[i]);
    block_clear(ld);
    reader_close(ld);
    vlmoe_free_strings(ld->shards, ld->n_shards);
    vlmoe_image_free(&ld->img);
    pthread_mutex_destroy(&ld->mu);
    pthread_cond_destroy(&ld->space);
    pthread_cond_destroy(&ld->done);
    free(ld->path), free(ld->img_key), free(ld->caption_key), free(ld->text), free(ld->off), free(ld->line);
    free(ld->csv_dir), free(ld->upsampling), free(ld->cum), free(ld->known);
    free(ld->perm), free(ld->block), free(ld->bperm), free(ld->slots), free(ld->tokens), free(ld->lens);
    free(ld->keys), free(ld->threads);
    vlmoe_free_mem(ld->images);
    free(ld);
}

static int fail(vlmoe_loader *ld, int st, const char *msg) {
    ld->failed = st;
    snprintf(ld->fail_msg, sizeof ld->fail_msg, "%s", msg);
    return vlmoe_fail(st, "%s", ld->fail_msg);
}

static int check_bad(vlmoe_loader *ld) {
    int st = vlmoe_dataset_check_bad(&ld->stats, ld->p.max_bad_fraction);
    if (st) vlmoe_error_prefix("%s", ld->path);
    return st ? fail(ld, st, vlmoe_last_error()) : VLMOE_OK;
}

// Waits until slot `s` (the stream's next unconsumed samples) is prepared or skipped; with no
// worker threads the caller's thread produces it.
static void wait_slot(vlmoe_loader *ld, const slot *s) {
    pthread_mutex_lock(&ld->mu);
    while (s->state == SLOT_FREE || s->state == SLOT_BUSY) {
        if (ld->nthreads) {
            pthread_cond_wait(&ld->done, &ld->mu);
            continue;
        }
        pthread_mutex_unlock(&ld->mu);
        produce(ld, &ld->img);
        pthread_mutex_lock(&ld->mu);
    }
    pthread_mutex_unlock(&ld->mu);
}

static int known_of(const slot *s) {
    return s->state == SLOT_GOOD ? KNOWN_GOOD : s->state == SLOT_BAD ? s->bad
           : s->state == SLOT_ERROR ? KNOWN_ERROR : KNOWN_NONE;
}

// Decodes a skipped sample on the caller's thread (it is kept after all, or nobody decoded it).
static void decode_late(vlmoe_loader *ld, slot *s) {
    claim c = s->c;
    memset(&s->c, 0, sizeof s->c);
    s->state = prepare(ld, &c, s, &ld->img);
}

// Agreement on the next n samples (slots from the cursor on) of a run on several processes. Each
// process decoded only the samples it expected to keep, so it alone knows whether they were bad;
// the processes take the maximum of their KNOWN_* (a sample decoded twice decodes alike). A sample
// nobody decoded is then decoded by the process that keeps it if it is good (counting the unknown
// before it as good), and a second round spreads that: afterwards every process knows every
// sample of the window, so all skip the same bad samples and cut the same global batch. Without
// bad samples the window is decoded exactly once, by the processes that keep its samples.
static int share_agree(vlmoe_loader *ld, int64_t n, int64_t goods) {
    uint8_t *k = ld->known;
    for (int round = 0; round < 2; round++) {
        for (int64_t i = 0; i < n; i++) k[i] = (uint8_t)known_of(&ld->slots[(ld->cursor + i) % ld->R]);
        if (ld->p.agree(ld->p.agree_user, k, (size_t)n)) return VLMOE_ERR_IO;
        int unknown = 0;
        for (int64_t i = 0, g = goods; i < n; i++) {
            if (k[i] == KNOWN_NONE && share_row(ld, g) >= 0) decode_late(ld, &ld->slots[(ld->cursor + i) % ld->R]);
            unknown |= k[i] == KNOWN_NONE;
            g += k[i] == KNOWN_NONE || k[i] == KNOWN_GOOD;
        }
        if (!unknown) return VLMOE_OK;   // the same on every process: k is
    }
    return vlmoe_fail(VLMOE_ERR_ARG, "%s: the processes could not agree on which samples are bad", ld->path);
}

int vlmoe_loader_next(vlmoe_loader *ld, vlmoe_batch *b, const char *const **keys) {
    if (!ld || !b) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_loader_next: NULL argument");
    if (ld->failed) return vlmoe_fail(ld->failed, "%s", ld->fail_msg);
    if (!ld->started) {
        ld->started = 1;
        for (; ld->nthreads < ld->p.workers; ld->nthreads++)
            if (pthread_create(&ld->threads[ld->nthreads], NULL, worker_main, ld))
                return fail(ld, VLMOE_ERR_NOMEM, "loader: cannot start a worker thread");
    }
    const int B = ld->p.batch_size, T = ld->p.context_length, W = ld->p.world;
    const int64_t G = (int64_t)B * W;
    for (int64_t goods = 0; goods < G;) {
        // a window of the fewest samples that could complete the global batch
        const int64_t n = W > 1 ? G - goods : 1;
        for (int64_t i = 0; i < n; i++) wait_slot(ld, &ld->slots[(ld->cursor + i) % ld->R]);
        if (W > 1) {
            const int st = share_agree(ld, n, goods);
            if (st) return fail(ld, st, vlmoe_last_error());
        }
        for (int64_t i = 0; i < n; i++) {
            slot *s = &ld->slots[ld->cursor % ld->R];
            const int agreed = W > 1 ? ld->known[i] : known_of(s);
            const int row = agreed == KNOWN_GOOD ? share_row(ld, goods) : -1;
            if (s->state == SLOT_SKIP && row >= 0) decode_late(ld, s);   // the guess was wrong
            if (agreed == KNOWN_ERROR && s->state != SLOT_ERROR)
                return fail(ld, VLMOE_ERR_IO, "loader: a sample failed on another process (its message is there)");
            if (s->state == SLOT_ERROR) return fail(ld, s->err, s->msg);
            if (s->at.epoch != ld->epoch) {   // the epoch before this sample is complete
                if (ld->epoch_good == 0) {
                    char msg[MSG_LEN];
                    snprintf(msg, sizeof msg, "%s: epoch %lld gave no usable sample", ld->path, (long long)ld->epoch);
                    return fail(ld, VLMOE_ERR_FORMAT, msg);
                }
                int st = check_bad(ld);
                if (st) return st;
                ld->epoch = s->at.epoch, ld->epoch_good = 0;
            }
            if (s->state == SLOT_SKIP) {   // counted as the process that decoded it counted it
                if (agreed == KNOWN_GOOD) s->delta.total++;
                else if (ld->csv)
                    vlmoe_dataset_stats_add_bad(&s->delta, agreed == KNOWN_UNREADABLE ? VLMOE_BAD_UNREADABLE_IMAGE
                                                : VLMOE_BAD_UNDECODABLE_IMAGE,
                                                "%s:%lld: image %s %s (found by another process)", ld->path,
                                                (long long)s->c.line, s->c.path, agreed == KNOWN_UNREADABLE ?
                                                "cannot be read" : "does not decode");
                else
                    vlmoe_dataset_stats_add_bad(&s->delta, VLMOE_BAD_UNDECODABLE_IMAGE, "%s: image does not decode "
                                                "(found by another process)", s->c.r.key ? s->c.r.key : ld->path);
                raw_free(&s->c.r);
            } else if (known_of(s) != agreed) {
                return fail(ld, VLMOE_ERR_IO, "loader: a sample decoded differently on two processes");
            }
            vlmoe_dataset_stats_merge(&ld->stats, &s->delta);
            if (s->csv_dir && !ld->noted++ && ld->p.data.note) ld->p.data.note(ld->p.data.note_user, s->msg);
            if (agreed == KNOWN_GOOD) {
                if (row >= 0) {
                    memcpy((char *)ld->images + row * ld->ibytes, s->image, ld->ibytes);
                    if (ld->p.tokenize) memcpy(ld->tokens + (size_t)row * T, s->tokens, sizeof(int32_t) * T);
                    ld->lens[row] = s->len;
                    char *k = ld->keys[row];
                    ld->keys[row] = s->key, s->key = k;
                }
                goods++;
                ld->epoch_good++;
            }
            ld->pos = s->next;
            pthread_mutex_lock(&ld->mu);
            s->state = SLOT_FREE;
            ld->cursor++;
            if (goods == G) ld->base = ld->cursor;   // the next global batch starts here
            pthread_cond_signal(&ld->space);
            pthread_mutex_unlock(&ld->mu);
            if (ld->stats.total >= ld->p.bad_check_min) {
                int st = check_bad(ld);
                if (st) return st;
            }
        }
    }
    *b = (vlmoe_batch){B, ld->p.pixels ? NULL : ld->images, ld->p.tokenize ? ld->tokens : NULL, ld->p.tokenize ? ld->lens : NULL};
    if (keys) *keys = (const char *const *)ld->keys;
    return VLMOE_OK;
}

// What else decides the order besides the seed (CSV: shuffle_block plays no part): the shuffle
// settings in bits 0..31, resampling and its factors in 32..63 (0 without: older states match).
static uint64_t shuffle_id(const vlmoe_loader *ld) {
    return ld->resample_id | (uint64_t)(ld->csv ? 0 : ld->p.shuffle_block) << 1 | (uint64_t)(ld->p.shuffle != 0);
}

static const char *resample_name(uint64_t id) {
    return !(id & RESAMPLED_BIT) ? "not resampled" : "resampled";
}

void vlmoe_loader_position(const vlmoe_loader *ld, vlmoe_data_state *pos) {
    memset(pos, 0, sizeof *pos);
    pos->data_position = (uint64_t)ld->cursor;
    pos->data_rng[0] = ld->p.seed;
    pos->data_rng[1] = STATE_TAG;
    pos->data_rng[2] = shuffle_id(ld);
    pos->data_epoch = ld->pos.epoch, pos->data_index = ld->pos.index;
    if (ld->resample_id)   // one endless epoch: report OpenCLIP's --train-num-samples "epochs"
        pos->data_epoch = ld->p.epoch_samples ? ld->cursor / ld->p.epoch_samples : 0;
    pos->data_block[0] = ld->pos.shard, pos->data_block[1] = ld->pos.item;
}

int vlmoe_loader_seek(vlmoe_loader *ld, const vlmoe_data_state *pos) {
    if (!ld || !pos) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_loader_seek: NULL argument");
    if (ld->started) return vlmoe_fail(VLMOE_ERR_ARG, "%s: the loader can seek only before its first batch", ld->path);
    if (pos->data_rng[1] != STATE_TAG)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: the saved data position is not a loader's (a run on other data?)", ld->path);
    const uint64_t id = pos->data_rng[2];
    if ((id >> 32) != (shuffle_id(ld) >> 32))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: the saved data order is %s%s; this one is %s%s (--dataset-resampled, "
                          "--train-data-upsampling-factors and the shard list must be the run's)", ld->path,
                          resample_name(id), (id & RESAMPLED_BIT) && (ld->resample_id & RESAMPLED_BIT) ?
                          " with other shard weights" : "", resample_name(ld->resample_id),
                          (id & RESAMPLED_BIT) && (ld->resample_id & RESAMPLED_BIT) ? " with these" : "");
    if (pos->data_rng[0] != ld->p.seed || id != shuffle_id(ld))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: the saved data order is that of seed %llu, shuffle %llu, shuffle "
                          "block %llu; this one has seed %llu, shuffle %d, shuffle block %d", ld->path,
                          (unsigned long long)pos->data_rng[0], (unsigned long long)(id & 1),
                          (unsigned long long)((id & 0xffffffffull) >> 1), (unsigned long long)ld->p.seed,
                          ld->p.shuffle, ld->p.shuffle_block);
    // resampled: the reported epoch is for logging; the order has one epoch
    const coords at = {ld->resample_id ? 0 : pos->data_epoch, pos->data_index, pos->data_block[0], pos->data_block[1]};
    if (at.epoch < 0 || at.index < 0 || at.shard < 0 || at.item < 0 || (ld->csv && at.index >= ld->rows) ||
        (!ld->csv && !ld->resample_id && at.shard > ld->n_shards))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: saved data position (epoch %lld, sample %lld, block at %lld/%lld) is "
                          "outside the data", ld->path, (long long)at.epoch, (long long)at.index,
                          (long long)at.shard, (long long)at.item);
    ld->src = ld->pos = at;
    ld->base = ld->claimed = ld->cursor = (int64_t)pos->data_position;   // a global batch starts here
    ld->epoch = at.epoch;
    ld->epoch_good = at.index > 0;   // what came before in this epoch is not known here
    return VLMOE_OK;
}

const vlmoe_dataset_stats *vlmoe_loader_stats(const vlmoe_loader *ld) { return ld ? &ld->stats : NULL; }

int64_t vlmoe_loader_epoch_size(const vlmoe_loader *ld) { return ld && ld->csv ? ld->rows : -1; }

const uint8_t *vlmoe_loader_pixels(const vlmoe_loader *ld) {
    return ld && ld->p.pixels ? (const uint8_t *)ld->images : NULL;
}

const vlmoe_image_params *vlmoe_loader_image_params(const vlmoe_loader *ld) { return &ld->p.image; }
