// tasks.h: the kinds of training that plug into the loop of src/train/run.h: contrastive training
// of LIMoE / CLIP models (src/train/contrastive_task.c), VL-MoE masked-modeling pre-training
// (src/train/mome_task.c) and VL-MoE fine-tuning (src/train/finetune_task.c); and what they
// share: setting up the model of a run. Covered by tests/test_cli.c, tests/test_checkpoint.c,
// tests/test_loader.c, tests/test_vlmoe_train.c and tests/test_finetune.c.
#ifndef VLMOE_TRAIN_TASKS_H
#define VLMOE_TRAIN_TASKS_H
#include "data/loader.h"
#include "eval/run_eval.h"
#include "train/run.h"
#include "vlmoe.h"

// ---- contrastive training (OpenCLIP's loop): a batch of image-text pairs per step
typedef struct {
    vlmoe_model *model;
    int batch_size;              // pairs per step and process
    vlmoe_synth *synth;          // the built-in data (sample step*B + j of the train split), or
    vlmoe_loader *loader;        // --train-data through the loader, opened for the global batch
                                 // (batch_size * accum_freq * world): this process takes its block
    int eval_samples;            // synthetic data: held-out samples per evaluation (0: none)
    int rank, world;             // this process's block of each global batch (src/data/order.h);
                                 // world 0 is a world of one
    int accum_freq;              // OpenCLIP's --accum-freq: micro-batches of batch_size per step
                                 // (0 or 1: none); the global batch is world x accum_freq x
                                 // batch_size, this process's block of it accum_freq micro-batches
    // Validation (src/eval/run_eval.h), each part every N steps (0: none before the end) and at
    // last_step; the loop calls the eval hook at least that often (a call with nothing due
    // writes no record).
    long last_step;
    long synth_every;            // the synthetic held-out evaluation (eval_samples > 0)
    const vlmoe_dataset_params *val; // image-caption pairs (NULL: none): loss, accuracy, recall@K
    long val_every;
    const vlmoe_eval_folder_data *zeroshot; // an image folder (NULL: none): zero-shot top-1/top-5
    long zeroshot_every;
    vlmoe_eval_params eval;      // of val and zeroshot: transform, tokenizer, batch, max_pairs
} vlmoe_contrastive_params;
typedef struct vlmoe_contrastive vlmoe_contrastive;
int vlmoe_contrastive_init(vlmoe_contrastive **out, const vlmoe_contrastive_params *p);
void vlmoe_contrastive_free(vlmoe_contrastive *c);
vlmoe_run_task vlmoe_contrastive_task(vlmoe_contrastive *c);

// The held-out evaluation on the synthetic data: zero-shot top-1/top-5 over n class-balanced
// held-out images, and matched-pair retrieval accuracy in chunks of `chunk`.
typedef struct {
    double top1, top5, i2t, t2i;
    int classes, chunk;
} vlmoe_synth_eval;
int vlmoe_synth_evaluate(vlmoe_model *m, const vlmoe_synth *s, int n, int chunk, vlmoe_synth_eval *out);

// The model a contrastive run starts from: a config (name or JSON file) with overrides, or
// pretrained weights; a routing preset ("clipup", "limoe") applied to its MoE layers.
typedef struct {
    const char *model;           // config name or JSON file (without pretrained)
    const char *pretrained;      // a vlmoe checkpoint whose weights start the run (may be NULL)
    const char *preset;          // may be NULL
    int image_size, context_length; // overrides of the config (0: keep)
    int vocab_size;              // override of a config's vocabulary (0: keep; not with pretrained)
    uint64_t seed;
    const char *soft_dispatch;   // Soft MoE layers: "soft", "identity", "uniform", "uniform_soft",
                                 // "soft_uniform" (App. A; NULL: keep the config's)
    int soft_raw;                // 1: Soft MoE layers without normalisation (App. E; 0: keep)
} vlmoe_model_source;
int vlmoe_model_from_source(vlmoe_model **out, const vlmoe_model_source *s);

// Opens --train-data as the loader will, so a missing file, bad header or shard pattern stops a
// run before anything is written; count (may be NULL) gets a CSV's usable rows.
int vlmoe_dataset_check(const vlmoe_dataset_params *dp, long *count);
// A BPE vocabulary of vocab_size ids trained on the first `max_texts` of texts[0..n_texts) and the
// first `max_texts` captions of the data dp (file order; dp may be NULL), saved at path in CLIP's
// merges format; *n gets the texts read and *ids the vocabulary's size (at most vocab_size).
int vlmoe_train_vocabulary(const vlmoe_dataset_params *dp, const char *const *texts, size_t n_texts, int vocab_size,
                           size_t max_texts, const char *path, size_t *n, int *ids);

// ---- VL-MoE fine-tuning (VL-MoE sec. 4.2): a classification head or a retrieval head
typedef enum {
    VLMOE_FT_IMAGE_CLS = 0,      // an image folder, one subfolder per class
    VLMOE_FT_TEXT_CLS = 1,       // a TSV of text<TAB>label
    VLMOE_FT_PAIR_CLS = 2,       // a TSV of image<TAB>question<TAB>answer (VQA) or
                                 // image1<TAB>image2<TAB>sentence<TAB>label (NLVR2)
    VLMOE_FT_RETRIEVAL = 3,      // image-caption pairs: OpenCLIP CSV/TSV or webdataset shards
    VLMOE_FT_CAPTION = 4,        // the same pairs, captioning (BEiT-3's masked LM, causal text)
} vlmoe_ft_kind;

typedef struct {
    vlmoe_ft_kind kind;
    vlmoe_dataset_params data;   // data.path: the folder, TSV or pairs; the CSV flags for retrieval
    vlmoe_image_params image;    // the eval transform of every image
    vlmoe_tokenize_fn tokenize;  // texts, questions, captions
    void *tokenize_user;
    int holdout;                 // every holdout-th example is held out (0: none)
    void (*progress)(void *user, long read); // retrieval pairs read so far (may be NULL)
    void *progress_user;
} vlmoe_ft_data_params;

typedef struct {
    int examples, per, classes;  // per: sequences per example (2 for NLVR2)
    int train, held;             // the split
    long bad_images;             // retrieval: pairs skipped for an unreadable image
    char first_bad[320];         // the first one's message
} vlmoe_ft_info;

typedef struct vlmoe_ft_data vlmoe_ft_data;
// Reads, numbers the classes (sorted distinct labels), decodes and tokenizes the data for a model
// of config c, and splits it; errors name the file and line.
int vlmoe_ft_data_load(vlmoe_ft_data **out, const vlmoe_ft_data_params *p, const vlmoe_model_config *c);
void vlmoe_ft_data_free(vlmoe_ft_data *d);
void vlmoe_ft_data_info(const vlmoe_ft_data *d, vlmoe_ft_info *out);
// OUT.labels: the class names, one per line, in class order.
int vlmoe_ft_write_labels(const vlmoe_ft_data *d, const char *output);

// The fine-tuning task: batches of `batch` training examples in the data order of
// src/data/order.h drawn from seed, one trainer step each.
typedef struct vlmoe_finetune vlmoe_finetune;
int vlmoe_finetune_init(vlmoe_finetune **out, vlmoe_model *m, const vlmoe_ft_data *d, int batch, uint64_t seed);
void vlmoe_finetune_free(vlmoe_finetune *f);
vlmoe_run_task vlmoe_finetune_task(vlmoe_finetune *f);

// Accuracy (classification) or recall@1/5/10 both ways (retrieval) of the training or the held-out
// examples; n = 0 when there are too few to score.
typedef struct {
    int n;
    double accuracy;
    double i2t[3], t2i[3];
} vlmoe_ft_score;
int vlmoe_ft_evaluate(vlmoe_model *m, const vlmoe_ft_data *d, int held_out, vlmoe_ft_score *out);
// The same; retrieval with rerank > 0: each query's top rerank candidates by the contrastive
// similarity re-ordered by the model's ITM head (VLMo's inference; needs itm_head).
int vlmoe_ft_evaluate_rerank(vlmoe_model *m, const vlmoe_ft_data *d, int held_out, int rerank, vlmoe_ft_score *out);

// Captioning (VLMOE_FT_CAPTION): the fraction of each caption's tokens the training masks (BEiT-3's
// captioning_mask_prob; vlmoe_caption_mask), set before the run (default 0.6, BEiT-3's).
int vlmoe_finetune_set_caption_mask(vlmoe_finetune *f, double prob);
// Decodes the training or held-out images' captions greedily (vlmoe_mome_caption with cp) and
// scores them with CIDEr-D against each image's caption; detok turns ids into text. captions: NULL,
// or gets the n decoded captions (malloc'd; free each and the array), in the examples' order.
typedef int (*vlmoe_detokenize_fn)(void *user, const int32_t *ids, int n, char *out, size_t cap);
typedef struct {
    int n;                       // images scored (0: too few)
    double cider;                // CIDEr-D of the n captions
} vlmoe_ft_caption_score;
int vlmoe_ft_caption_evaluate(vlmoe_model *m, const vlmoe_ft_data *d, int held_out, const vlmoe_caption_params *cp,
                              vlmoe_detokenize_fn detok, void *user, vlmoe_ft_caption_score *out, char ***captions);

// ---- VL-MoE pre-training (src/train/mome_task.c; VL-MoE sec. 3.1): masked data modeling on three
// streams per step: images (MIM: 40% block masks, the codebook's visual tokens as targets), texts
// (MLM, 15%) and image-text pairs (VLM: 50% of the text plus MIM), their losses summed with the MoE
// auxiliary losses. Every sample and mask follows from (seed, step), or from the loader's position.
enum { VLMOE_MOME_IMAGE = 0, VLMOE_MOME_TEXT = 1, VLMOE_MOME_PAIR = 2, VLMOE_MOME_STREAMS = 3 };
// Where a stream's samples come from.
enum { VLMOE_MOME_NONE = 0, VLMOE_MOME_SYNTH, VLMOE_MOME_LOADER, VLMOE_MOME_FOLDER, VLMOE_MOME_LINES };
const char *vlmoe_mome_stream_name(int stream);   // "image", "text", "pair"
const char *vlmoe_mome_source_name(int source);   // "none", "synthetic", "train-data", "image-data", "text-data"

// The strings and arrays are the caller's and must outlive the run. The messages name the flags
// of `vlmoe train` (--mix, --image-data, ...).
typedef struct {
    const vlmoe_model_config *config; // the VL-MoE (arch mome) model the run trains
    int batch_size;                   // samples per step, split between the streams by mix
    int mix[VLMOE_MOME_STREAMS];      // weights of the image, text and pair streams (>= 0, not all 0)
    uint64_t seed;                    // data orders, masks and the synthetic data
    // The data; without any of the three, the synthetic data for every stream.
    const char *image_data;           // images: a folder (NULL: none), with its image files, sorted
    const char *const *image_files;
    int n_image_files;
    const char *text_data;            // texts: a file (NULL: none), with its lines and their
    const char *const *text_lines;    // 1-based numbers in the file; blank lines are skipped
    const long *text_lineno;
    size_t n_text_lines;
    vlmoe_dataset_params train_data;  // pairs, and the images / texts without their own data (path
                                      // NULL: none)
    int workers;                      // loader threads (0: the training thread)
    int resampled;                    // the loader's resampled shards and their source weights
    const char *upsampling;           // (vlmoe_loader_params), from --dataset-resampled and
                                      // --train-data-upsampling-factors
    double max_bad_fraction;          // of the loader's samples
    vlmoe_image_params image;         // the train transform of image files
    vlmoe_tokenize_fn tokenize;       // texts of files (thread-safe); not needed for synthetic data
    void *tokenize_user;
    int text_vocab;                   // the ids tokenize writes (0: the synthetic word tokenizer):
    const char *tokenizer;            // [MASK] must lie outside them; the file, for messages
    int rank, world;                  // data parallelism (world 0 or 1: one process): batch_size is
                                      // per process, the global batch world x batch_size; each
                                      // forward of `chunk` samples is this process's block of the
                                      // one-process forward of world x chunk (mome_task.c)
    int (*agree)(void *user, uint8_t *k, size_t n); // world > 1 with --train-data: the loader's
    void *agree_user;                 // agreement on bad samples (src/data/loader.h)
} vlmoe_mome_params;

// How a step splits: each stream's source and samples, and the forwards of `chunk` samples (every
// forward of a step has one batch size, the greatest common divisor of the streams' sizes, as the
// model plans its activations for one size).
typedef struct {
    int src[VLMOE_MOME_STREAMS], n[VLMOE_MOME_STREAMS];
    int chunk, nparts;
} vlmoe_mome_split;
// VLMOE_ERR_ARG when the mix does not split batch_size into whole samples, a stream with a weight
// has no data, or data is given that no stream uses.
int vlmoe_mome_split_batch(const vlmoe_mome_params *p, vlmoe_mome_split *out);

// What a run reports for the caller to print: the split, the data found, the routing summary of
// the last logged step (per stream, per MoE layer: success, dropped, experts used) and the image
// files skipped so far (each replaced by the next file of the folder).
typedef struct {
    vlmoe_mome_split split;
    size_t n_sentences;               // text_data's non-blank lines
    int n_loader;                     // samples of each step from the loader
    int64_t loader_rows;              // a CSV's usable rows (-1: webdataset shards)
    const vlmoe_dataset_stats *loader_stats; // NULL without the loader
    uint64_t signature;               // of the data set-up, kept in the checkpoints (data_rng[3])
    char routing[2048];
    long bad_images, n_bad_first;     // skips, and distinct reasons (the first 3 kept)
    char bad_first[3][VLMOE_BAD_MSG_LEN];
} vlmoe_mome_report;

typedef struct vlmoe_mome_run vlmoe_mome_run;
// Opens the data of the streams (a missing or empty file stops the run before anything is
// written) and allocates the step's buffers.
int vlmoe_mome_init(vlmoe_mome_run **out, const vlmoe_mome_params *p);
void vlmoe_mome_free(vlmoe_mome_run *r);
// Binds the model the run trains (fresh or from checkpoint `ckpt`, for messages; its config must
// be p->config) and its MIM codebook: `codebook` (mim_vocab entries, attached to the model) or,
// when NULL, the one the checkpoint carried. After a resume (resumed: the checkpoint's data state)
// the data set-up must be the checkpoint's (else VLMOE_ERR_ARG) and the loader continues at its
// position.
int vlmoe_mome_start(vlmoe_mome_run *r, vlmoe_model *m, const float *codebook, const vlmoe_data_state *resumed,
                     const char *ckpt);
vlmoe_run_task vlmoe_mome_task(vlmoe_mome_run *r);
const vlmoe_mome_report *vlmoe_mome_get_report(const vlmoe_mome_run *r);

#endif
