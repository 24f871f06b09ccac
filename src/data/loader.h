// loader.h: the training data loader. Samples of a vlmoe_dataset (OpenCLIP CSV/TSV or webdataset
// shards) are decoded, preprocessed and tokenized by worker threads ahead of the training step, in
// an order fixed by (seed, epoch, index) whatever the number of workers, and a run resumes at any
// sample. Spec: ../shared/spec/MODEL.md ("Data"). Implemented in src/data/loader.c;
// tests/test_loader.c. Meant for include/vlmoe.h together with readers.h, image.h and tok.h.
//
// Order. Sample `index` of epoch `epoch` is:
//   CSV: row perm_epoch[index] of the usable rows, perm_epoch a permutation drawn from (seed,
//     epoch) (file order without shuffle). The rows are indexed once at open: image paths and
//     captions are held in memory, as OpenCLIP's CsvDataset holds them; image files are opened by
//     the workers. Every usable row comes once per epoch.
//   webdataset: the shards are read in an order drawn from (seed, epoch); the samples they yield
//     are cut into blocks of `shuffle_block` consecutive samples and each block is emitted in a
//     permutation drawn from (seed, epoch, its first index). This is webdataset's shuffle buffer
//     in a form that resumes cheaply: the position of the next sample is (epoch, index, where its
//     block starts), so a resumed run re-reads one block, where a sliding buffer would have to
//     keep its whole contents (shuffle_block encoded images) in the checkpoint.
//   webdataset, resampled (OpenCLIP's --dataset-resampled, webdataset's ResampledShards): one
//     endless epoch; the k-th shard read is drawn with replacement from the shard list by an RNG
//     seeded by (seed, k), uniformly or with the weight of its source ("F1::F2", one factor per
//     "::"-joined pattern of the path, each of the source's shards weighing its factor, as
//     OpenCLIP's --train-data-upsampling-factors). Samples are shuffled in blocks as above and the
//     position is (index, draw k, tar member) where the block starts. OpenCLIP seeds each worker
//     process apart; here the draws form one stream cut into batches, the same for any number of
//     workers, and each process of a distributed run takes its block of each global batch.
// The train transform of sample (epoch, index) draws from an RNG seeded by (seed, epoch, index).
// CSV image paths: vlmoe_csv_image_path (readers.h); the first image read from the CSV's folder
// rather than the working directory is told to data.note, as the batch holding it is returned.
// "pipe:" shards are re-run from their start when a resumed run continues inside one.
//
// Pipeline. The samples form one stream over all epochs. Worker threads take the stream's next
// sample (reading a webdataset block under the loader's lock when one is drained; CSV images are
// read outside it), decode it, preprocess it and tokenize its caption into slot (stream index
// mod prefetch * batch_size) of a ring; the caller's thread assembles batches from the slots in
// stream order, skipping bad samples. A batch is therefore the same for any number of workers
// and any timing, and the ring bounds the work done ahead to `prefetch` batches.
//
// Processes (world > 1). Every process walks the same stream (a webdataset shard's members are
// read by all), but a worker decodes and tokenizes a sample only if this process would keep it
// were no sample from the current global batch's start on bad; the others are held undecoded.
// Which samples are bad is known only where they were decoded, so before taking a window of the
// stream the processes agree on it (the maximum of what each knows, through `agree`); a sample
// no process decoded is decoded by the one that would keep it, and a sample that a bad one
// shifted into this process's block is decoded late, on the caller's thread. Every process thus
// skips the same bad samples and returns the rows one process at the global batch returns.
//
// Bad samples. Rows and shard members the readers reject (readers.h) and images that do not
// decode (VLMOE_BAD_UNREADABLE_IMAGE if a CSV image cannot be read, else
// VLMOE_BAD_UNDECODABLE_IMAGE) are skipped and counted as the stream is consumed, so the counts
// too are independent of the workers. When the counted samples reach bad_check_min, and at the end
// of every epoch (a CSV file's rows at open), more than max_bad_fraction bad samples is an error
// (vlmoe_dataset_check_bad's message, which names the first bad samples).
#ifndef VLMOE_DATA_LOADER_H
#define VLMOE_DATA_LOADER_H

#include "data/image.h"
#include "data/readers.h"
#include "vlmoe.h"

typedef struct {
    vlmoe_dataset_params data;   // what to read (defer_images is the loader's business)
    vlmoe_image_params image;    // output size, normalisation, crop scale and ratio, flip
    int train;                   // 1: random resized crop (+ flip), the default; 0: eval transform
    int pixels;                  // 1: images as bytes, not normalised (vlmoe_loader_pixels); 0: floats
    int shuffle;                 // 1 (default): the orders above; 0: file and shard order
    int shuffle_block;           // webdataset: samples per shuffle block (default 1000)
    int resampled;               // webdataset: draw shards with replacement (see above); default 0
    const char *upsampling;      // resampled: "F1::F2::..." weights of the path's sources (NULL: equal
                                 // weight per shard); each factor finite and >= 0, not all 0
    int64_t epoch_samples;       // resampled: samples per "epoch" in the reported position
                                 // (data_epoch = samples consumed / it; 0: data_epoch stays 0)
    uint64_t seed;
    int batch_size;              // >= 1
    int context_length;          // tokens per caption, >= 2
    vlmoe_tokenize_fn tokenize;  // NULL: captions are not tokenized (batch tokens/lengths NULL)
    void *tokenize_user;         // its first argument; tokenize must be thread-safe
    int workers;                 // threads preparing samples (default 2); 0: the caller's thread
    int prefetch;                // batches prepared ahead (default 2)
    double max_bad_fraction;     // default 0.1
    int64_t bad_check_min;       // counted samples before the fraction is checked (default 1000)
    // A run on several processes: the global batch is batch_size x world samples, and this process
    // decodes and returns only its share (rows rank x batch_size ..., as src/data/order.h cuts).
    // agree(user, k, n) replaces k (n bytes) by its maximum over the processes (a collective every
    // process calls alike; VLMOE_OK or a status with the message set). world 1 (default): no calls.
    // chunk (> 0, dividing batch_size): the global batch is dealt in pieces of chunk to the
    // processes in turn (VL-MoE's forwards); 0: one piece of batch_size each.
    int rank, world, chunk;
    int (*agree)(void *user, uint8_t *k, size_t n);
    void *agree_user;
} vlmoe_loader_params;
vlmoe_loader_params vlmoe_loader_default_params(void);

typedef struct vlmoe_loader vlmoe_loader;
// Opens the dataset (its hard errors: a missing CSV file or shard, a bad header or pattern,
// resampling asked of a CSV, factors without resampling or not one per source) and,
// for CSV, indexes its rows (an error if none is usable or too many are bad). Webdataset shard
// names must not contain '{', '}' or "::" (each shard is reopened by name).
int vlmoe_loader_open(const vlmoe_loader_params *p, vlmoe_loader **out);
void vlmoe_loader_free(vlmoe_loader *ld);   // stops the workers; NULL is safe
// The resampling errors of vlmoe_loader_open (resampled CSV, factors without resampling, not one
// per source, not numbers), found without reading samples, for a command to check its flags early.
int vlmoe_loader_check_order(const vlmoe_loader_params *p);
// The next batch: images (B, 3, S, S), tokens (B, context_length) and lengths (B) in *b and, if
// keys is not NULL, the samples' keys (readers.h: "file.csv:LINE", "shard.tar:KEY") in (*keys)[B];
// all owned by the loader and valid until the next call. Errors (I/O, too many bad samples, an
// epoch without a usable sample) are sticky: every later call returns the same.
int vlmoe_loader_next(vlmoe_loader *ld, vlmoe_batch *b, const char *const **keys);
// With p.pixels, the last batch's images (B, S, S, 3) as bytes, the flip applied and not normalised
// (the batch's images are then NULL; src/nn/model.h model_set_pixels hands them to a model), owned by
// the loader and valid until the next call; NULL otherwise.
const uint8_t *vlmoe_loader_pixels(const vlmoe_loader *ld);
// The loader's image parameters (their mean and std normalise the bytes).
const vlmoe_image_params *vlmoe_loader_image_params(const vlmoe_loader *ld);
// The position of the next sample (after the batches returned so far), for the training state.
void vlmoe_loader_position(const vlmoe_loader *ld, vlmoe_data_state *pos);
// Continues at a position from vlmoe_loader_position (of this or an earlier process, same data,
// seed and shuffle settings); only before the first vlmoe_loader_next. A position of another
// seed, not written by a loader, or outside the data is VLMOE_ERR_ARG.
int vlmoe_loader_seek(vlmoe_loader *ld, const vlmoe_data_state *pos);
// Samples counted so far (CSV: from the rows indexed at open too).
const vlmoe_dataset_stats *vlmoe_loader_stats(const vlmoe_loader *ld);
// Usable CSV rows (samples per epoch before image failures); -1 for webdataset (unknown).
int64_t vlmoe_loader_epoch_size(const vlmoe_loader *ld);

#endif
