// tasks.h: the kinds of training that plug into the loop of src/train/run.h: contrastive training
// of LIMoE / CLIP models (src/train/contrastive_task.c), VL-MoE masked-modeling pre-training
// (src/train/mome_task.c) and VL-MoE fine-tuning (src/train/finetune_task.c); and what they
// share: setting up the model of a run. Covered by tests/test_cli.c, tests/test_checkpoint.c,
// tests/test_loader.c, tests/test_vlmoe_train.c and tests/test_finetune.c.
#ifndef VLMOE_TRAIN_TASKS_H
#define VLMOE_TRAIN_TASKS_H
#include "data/loader.h"
#include "train/run.h"
#include "vlmoe.h"

// ---- contrastive training (OpenCLIP's loop): a batch of image-text pairs per step
typedef struct {
    vlmoe_model *model;
    int batch_size;              // pairs per step and process
    vlmoe_synth *synth;          // the built-in data (sample step*B + j of the train split), or
    vlmoe_loader *loader;        // --train-data through the loader, opened for the global batch
                                 // (batch_size * world): this process takes its block of it
    int eval_samples;            // synthetic data: held-out samples per evaluation (0: none)
    int rank, world;             // this process's block of each global batch (src/data/order.h);
                                 // world 0 is a world of one
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
    uint64_t seed;
} vlmoe_model_source;
int vlmoe_model_from_source(vlmoe_model **out, const vlmoe_model_source *s);

// Opens --train-data as the loader will, so a missing file, bad header or shard pattern stops a
// run before anything is written; count (may be NULL) gets a CSV's usable rows.
int vlmoe_dataset_check(const vlmoe_dataset_params *dp, long *count);
// A BPE vocabulary of vocab_size ids trained on the first `max_captions` captions of the data
// (file order), saved at path in CLIP's merges format; *n gets the captions read and *ids the
// vocabulary's size (at most vocab_size).
int vlmoe_train_vocabulary(const vlmoe_dataset_params *dp, int vocab_size, size_t max_captions,
                           const char *path, size_t *n, int *ids);

// ---- VL-MoE fine-tuning (VL-MoE sec. 4.2): a classification head or a retrieval head
typedef enum {
    VLMOE_FT_IMAGE_CLS = 0,      // an image folder, one subfolder per class
    VLMOE_FT_TEXT_CLS = 1,       // a TSV of text<TAB>label
    VLMOE_FT_PAIR_CLS = 2,       // a TSV of image<TAB>question<TAB>answer (VQA) or
                                 // image1<TAB>image2<TAB>sentence<TAB>label (NLVR2)
    VLMOE_FT_RETRIEVAL = 3,      // image-caption pairs: OpenCLIP CSV/TSV or webdataset shards
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

#endif
