// run_eval.h: the evaluation of a trained model, as `vlmoe eval` runs it: on the synthetic held-out
// split, on an image folder (zero-shot classification with a prompt ensemble and LIMoE's K-shot
// linear probe on the frozen image embeddings) and on image-caption pairs (retrieval recall@1/5/10
// both ways, in-batch contrastive loss and accuracy), with the routing of one batch per MoE layer.
// Functions take a model and the data and fill result structs; report.c turns them into the
// report's JSON objects. Implemented in src/eval/run_eval.c and src/eval/report.c; cli/eval.c keeps
// flags, text and exit codes. Covered by tests/test_eval_data.c and tests/test_cli.c (through
// `vlmoe eval`).
#ifndef VLMOE_EVAL_RUN_EVAL_H
#define VLMOE_EVAL_RUN_EVAL_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "data/image.h"
#include "data/readers.h"
#include "vlmoe.h"

// Skipped inputs: how many, and the first few messages (for a warning).
typedef struct {
    long n;
    char first[3][320];
} vlmoe_skip_log;
void vlmoe_skip_log_add(vlmoe_skip_log *b, const char *msg);

// Progress of a long loop: `done` of `total` (total <= 0: unknown) items of the kind `what`
// ("zero-shot images"). Called with done = 0 when the loop starts, then after each batch.
typedef void (*vlmoe_progress_fn)(void *user, const char *what, long done, long total);

// Encodes image files in batches of batch_size (one model call per batch; m is planned for
// min(n, batch_size) rows, and every row's embedding has the same bits however the inputs are
// batched): every readable image's L2-normalised embedding goes to out (n, E), packed in file
// order, ok[i] (may be NULL) says which files were readable, the others are logged in bad and
// *n_ok counts the readable ones. after_batch (may be NULL) runs after each model call with the
// number of images it encoded.
typedef struct {
    const vlmoe_image_params *ip;
    int batch_size;
    const char *what;                  // progress label, e.g. "images"
    vlmoe_progress_fn progress;        // may be NULL
    void *progress_user;
    void (*after_batch)(void *user, int k);
    void *user;
} vlmoe_encode_files_params;
int vlmoe_encode_image_files(vlmoe_model *m, const char *const *paths, int n, const vlmoe_encode_files_params *p,
                             float *out, uint8_t *ok, vlmoe_skip_log *bad, int *n_ok);

// The routing of the first forward of an evaluation that had MoE layers: copies of the model's
// per-layer statistics (vlmoe_model_moe_stats) and which forward it was.
typedef struct {
    int n;                      // MoE layers (0: nothing captured yet)
    vlmoe_moe_stats *stats;     // (n); routed/accepted point into values
    double *values;
    char what[320];             // "one held-out batch of 64 pairs", "the first batch of 64 images of DIR", ...
} vlmoe_eval_routing;
void vlmoe_eval_routing_free(vlmoe_eval_routing *r);   // zeroes r

typedef struct {
    int batch_size;             // encoding and contrastive batches (>= 2)
    int shots;                  // shots per class of the linear probe (0: no probe)
    uint64_t seed;              // of the few-shot draw
    const vlmoe_image_params *ip;        // eval transform of image files and encoded images
    vlmoe_tokenize_fn tokenize;          // captions and class prompts of the user's data
    void *tokenize_user;
    vlmoe_eval_routing *routing;         // the first forward with MoE layers is kept here, unless
                                         // it already holds one (NULL: not wanted)
    vlmoe_progress_fn progress;          // may be NULL
    void *progress_user;
    long max_pairs;                      // image-caption pairs: the first N usable ones (0: all)
} vlmoe_eval_params;
vlmoe_eval_params vlmoe_eval_default_params(void);   // batch 64, 10 shots, seed 0

// Recall@K for K = 1, 5, 10, image->text (any of the image's captions) and text->image.
enum { VLMOE_EVAL_NUM_K = 3 };
extern const int vlmoe_eval_ks[VLMOE_EVAL_NUM_K];

typedef struct {
    double top1, top5;
    double mean_per_class_recall; // image folders: the mean over classes of top-1 recall (sklearn's balanced accuracy)
    int classes, templates, images;
    long bad_images;
} vlmoe_eval_zeroshot;
typedef struct {
    double i2t[VLMOE_EVAL_NUM_K], t2i[VLMOE_EVAL_NUM_K];
    int images, captions;
    long bad_samples;           // unreadable rows of the dataset and undecodable images
    // image-caption pairs only (has_ranks): OpenCLIP's ranks, [0] image->text, [1] text->image,
    // and the captions that repeat an earlier caption's text (correct for each image that has it)
    int has_ranks, duplicate_captions;
    double mean_rank[2], median_rank[2];
} vlmoe_eval_retrieval;
// In-batch contrastive loss and accuracy (both directions averaged) in evaluation mode, both
// modalities in one pass as training sees them: means over the pairs of the batches.
typedef struct {
    double loss, accuracy;
    long pairs;
    int batches, batch_size;
} vlmoe_eval_contrastive;
typedef struct {
    int shots;
    double accuracy, lambda;    // test accuracy; the ridge regularisation chosen on validation
    char skipped[512];          // non-empty: why the probe did not run (too few images in a class)
} vlmoe_eval_fewshot;

// ---- the synthetic held-out split (s also gives the texts and their tokenizer)
typedef struct {
    int samples;
    vlmoe_eval_zeroshot zeroshot;
    vlmoe_eval_retrieval retrieval;
    vlmoe_eval_contrastive contrastive;
    double pair_i2t, pair_t2i;  // matched-pair accuracy in chunks of batch_size
    vlmoe_eval_fewshot fewshot; // when p->shots > 0
} vlmoe_eval_synth_result;
// Zero-shot top-1/top-5 and retrieval on held-out samples [0, n) (class-balanced), contrastive
// loss in batches, the routing of the first batch, and the K-shot probe trained on held-out
// samples from index 1e6 (lambda chosen on samples from 2e6) and tested on [0, n).
int vlmoe_eval_synthetic(vlmoe_model *m, const vlmoe_synth *s, int n, const vlmoe_eval_params *p,
                         vlmoe_eval_synth_result *r);

// ---- an image folder: zero-shot classification, then the K-shot probe on its features
typedef struct {
    const vlmoe_image_folder *folder;
    const char *name;                   // the folder, for messages and the routing label
    const char *const *classes;         // (folder->n_classes) class names for the prompts
    const char *const *templates;       // prompt templates, "{}" = class name
    int n_templates;
} vlmoe_eval_folder_data;
typedef struct {
    vlmoe_eval_zeroshot zeroshot;
    vlmoe_skip_log bad;         // unreadable images
    float *features;            // (zeroshot.images, E) embeddings of the readable images
    int32_t *labels;            // (zeroshot.images)
} vlmoe_eval_folder_result;
// The mean over the classes present in labels of each class's top-1 recall (CLIP_benchmark's
// mean_per_class_recall, sklearn's balanced_accuracy_score); argmax ties go to the lower class.
double vlmoe_mean_per_class_recall(const float *img, int n, const float *classes, int C, int E, const int32_t *labels);
// Errors start with d->name ("DIR: none of its 12 images could be read").
int vlmoe_eval_folder_zeroshot(vlmoe_model *m, const vlmoe_eval_folder_data *d, const vlmoe_eval_params *p,
                               vlmoe_eval_folder_result *r);
// The probe on zr's features: p->shots random images per class train it, the others alternate
// (per class, in file order) between test and validation. A class with fewer than shots + 2
// readable images skips it (out->skipped says which). Errors start with d->name.
int vlmoe_eval_folder_fewshot(vlmoe_model *m, const vlmoe_eval_folder_data *d, const vlmoe_eval_folder_result *zr,
                              const vlmoe_eval_params *p, vlmoe_eval_fewshot *out);
void vlmoe_eval_folder_result_free(vlmoe_eval_folder_result *r);

// ---- image-caption pairs (an open CSV or webdataset; name is its path)
typedef struct {
    vlmoe_eval_retrieval retrieval;
    vlmoe_eval_contrastive contrastive;
    vlmoe_skip_log bad;         // undecodable images (the dataset's own skips are in its stats)
} vlmoe_eval_pairs_result;
// Reads ds to its end (or to p->max_pairs usable pairs) in batches: contrastive loss per batch
// (the routing of the first), then retrieval over all pairs, where rows with the same image bytes
// are one image with several captions. Errors start with name.
int vlmoe_eval_pairs(vlmoe_model *m, vlmoe_dataset *ds, const char *name, const vlmoe_eval_params *p,
                     vlmoe_eval_pairs_result *r);

// ---- the report's JSON objects (src/eval/report.c); `data` (may be NULL: the synthetic split)
// names the folder or file and adds the fields of user data.
cJSON *vlmoe_eval_zeroshot_json(const vlmoe_eval_zeroshot *z, const char *data);
cJSON *vlmoe_eval_retrieval_json(const vlmoe_eval_retrieval *r, const char *data);
cJSON *vlmoe_eval_contrastive_json(const vlmoe_eval_contrastive *c);
cJSON *vlmoe_eval_fewshot_json(const vlmoe_eval_fewshot *f);

// CLIP_benchmark's results file of one task (clip_benchmark eval --output): {"dataset", "model",
// "pretrained", "task", "metrics"}. Zero-shot classification (z): acc1, acc5 (null below 6
// classes, where it is trivially 1), mean_per_class_recall. Retrieval (z NULL, r): its
// image_retrieval_recall@K (text queries: t2i) and text_retrieval_recall@K (image queries: i2t),
// plus OpenCLIP's image_to_text_ / text_to_image_ mean_rank and median_rank. In report.c.
cJSON *vlmoe_eval_clip_benchmark_json(const char *dataset, const char *model, const char *pretrained,
                                      const vlmoe_eval_zeroshot *z, const vlmoe_eval_retrieval *r);
// ---- captioning (src/eval/caption_eval.c): image-caption pairs read from ds; rows with the same
// image bytes are one image whose captions are all its references; each distinct image captioned
// greedily (vlmoe_mome_caption with cp, detok turning ids into text) and scored by CIDEr-D.
// Uses p->ip, p->max_pairs (the first N rows; 0: all) and p->progress. name labels errors.
typedef int (*vlmoe_detokenize_cb)(void *user, const int32_t *ids, int n, char *out, size_t cap);
typedef struct {
    int images, references;     // distinct readable images, captions read as references
    double cider;               // CIDEr-D of the generated captions
    char **keys;                // (images) each image's file (CSV) or sample key (webdataset)
    char **captions;            // (images) its generated caption
    vlmoe_skip_log bad;         // undecodable images
} vlmoe_eval_captions;
int vlmoe_eval_captions_run(vlmoe_model *m, vlmoe_dataset *ds, const char *name, const vlmoe_eval_params *p,
                            const vlmoe_caption_params *cp, vlmoe_detokenize_cb detok, void *user,
                            vlmoe_eval_captions *r);
void vlmoe_eval_captions_free(vlmoe_eval_captions *r);   // zeroes r

#endif
