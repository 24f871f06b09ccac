// common.h: what the inference subcommands (eval, classify, embed) share: the image flags, the
// batched encoding of image files with a progress line, the text tokenizer choice from the flags,
// CLIP's default prompt templates (--templates), progress lines and the log of skipped inputs.
// These are flag and printing concerns; the evaluation itself is src/eval/run_eval.h.
// Implemented in cli/common.c; covered through tests/test_eval_data.c and tests/test_classify_embed.c.
#ifndef VLMOE_CLI_COMMON_H
#define VLMOE_CLI_COMMON_H

#include <stdint.h>

#include "data/image.h"
#include "data/readers.h"
#include "eval/run_eval.h"
#include "tok/tok.h"
#include "vlmoe.h"

// "a photo of a {}." and the 7 of OpenAI CLIP's 80 ImageNet templates that their prompt
// engineering notebook kept after a search over subsets.
enum { CLI_NUM_TEMPLATES = 8 };
extern const char *const cli_templates[CLI_NUM_TEMPLATES];

// The eval transform of model config c with --image-mean / --image-std ("R,G,B" or one value for
// all three; NULL keeps CLIP's). Errors are printed ("vlmoe CMD: ...") and returned as exit status 1.
// --max-image-pixels N (a decompression bomb is skipped, not decoded): the commands that read
// images give it; cli_image_params applies it.
#define CLI_MAX_PIXELS_HELP "decode images of at most N pixels, bigger ones are skipped (default 89478485, PIL's; at most 268435456)"
void cli_set_max_image_pixels(long n);
int cli_image_params(const char *cmd, const char *mean, const char *std, const vlmoe_model_config *c,
                     vlmoe_image_params *out);
// OpenCLIP's nargs syntax for every command: "--image-mean 0.48 0.45 0.41" (2 or 3 numbers after
// --image-mean or --image-std, negative ones included) is rewritten in argv as the one argument
// "--image-mean=0.48,0.45,0.41" (written into buf, nbuf entries); returns the new argc. A
// following argument that is not a number (a flag, an image path) is left alone.
enum { CLI_NORM_LEN = 96 };
int cli_join_norm_flags(int argc, char **argv, char (*buf)[CLI_NORM_LEN], int nbuf);

// The smallest vocabulary BPE can have (512 byte symbols, start and end; smaller ones are the
// synthetic data's word vocabularies), and the size trained for a small named model on captions.
enum { CLI_BPE_MIN = 514, CLI_BPE_IDS = 1024 };
// The most synthetic held-out samples one evaluation holds in memory (train, soup --eval-samples).
enum { CLI_EVAL_SAMPLES_MAX = 1 << 20 };

// Texts of the user's: --tokenizer PATH (NULL: none) or, without one, the synthetic data's word
// tokenizer, which only a model with fewer than 514 ids (too few for BPE) can have been trained
// with. With need = 0 only a given PATH is loaded. A synth already set by the caller is used
// for the fallback and freed by cli_text_free. Errors are printed and returned as exit status 1.
typedef struct {
    vlmoe_tokenizer *bpe;
    vlmoe_synth *synth;
} cli_text;
int cli_text_init(const char *cmd, const char *path, const vlmoe_model_config *c, int need, cli_text *t);
// The same for a loaded model m (file path), which may record its inputs (src/nn/inputs.c): what it
// records is used; a flag that contradicts it is an error, unless override (--override-inputs),
// then a note says which is used. A model that records nothing gets cli_image_params /
// cli_text_init's defaults.
int cli_model_image_params(const char *cmd, const char *mean, const char *std, int override, const vlmoe_model *m,
                           const char *path, vlmoe_image_params *out);
int cli_model_text(const char *cmd, const char *tokenizer, int override, const vlmoe_model *m, const char *path,
                   int need, cli_text *t);
// A command about to use the synthetic data on model m: an error (exit status 1) asking for `need`
// (e.g. "--val-data or --zeroshot-data") when m was trained on captions of its own.
int cli_synthetic_model(const char *cmd, const vlmoe_model *m, const char *path, const char *need);
// "override-inputs": the flag of the commands above.
#define CLI_OVERRIDE_HELP "let --tokenizer/--image-mean/--image-std replace what the model file records"
// A vlmoe_tokenize_fn over a cli_text.
int cli_tokenize(void *t, const char *text, int32_t *ids, int ctx);
// Its inverse (a vlmoe_detokenize_fn), and the start and end ids captions are decoded between.
int cli_detokenize(void *t, const int32_t *ids, int n, char *out, size_t cap);
vlmoe_caption_params cli_caption_params(const cli_text *t);
void cli_text_free(cli_text *t);

// A progress line on stderr: rewritten in place on a terminal, a plain line every 30 s otherwise.
typedef struct {
    const char *what;
    int tty, shown;
    double t0, last;
} cli_progress;
cli_progress cli_progress_start(const char *what);
void cli_progress_show(cli_progress *p, long done, long total);   // total <= 0: unknown
void cli_progress_end(cli_progress *p);
// A vlmoe_progress_fn over a cli_progress p (zeroed before the first call): a new `what` ends the
// previous line and starts its own. The caller ends the last with cli_progress_end.
void cli_progress_cb(void *p, const char *what, long done, long total);

// Skipped inputs: how many, and the first few messages for the warning (the library's log).
typedef vlmoe_skip_log cli_bad_log;
void cli_bad_add(cli_bad_log *b, const char *msg);
// "vlmoe CMD: warning: skipped N WHATs of WHERE; first: ..." on stderr, if any were skipped.
void cli_bad_warn(const char *cmd, const cli_bad_log *b, const char *what, const char *where);
// Zero-shot class names or prompt templates (templates = 1) of `flag`: a text file, one per line,
// or a .json file: a list of strings, or CLIP_benchmark's object of lists by dataset
// (en_classnames.json, en_zeroshot_classification_templates.json), of which key (NULL: the only
// one) is taken; key is not used for a text file. A template needs {} for the class name
// (CLIP_benchmark's {c} becomes {}). *out is freed with cli_free_lines; errors are printed and
// returned as exit status 1.
int cli_read_texts(const char *cmd, const char *flag, const char *path, const char *key, int templates, char ***out,
                   size_t *n);
int cli_is_json(const char *path);   // a .json file name (any case); NULL: no
// --csv-separator: one character, or the two characters \t for a tab; non-zero after an error.
int cli_separator(const char *cmd, const char *sep, char *out);
// --dataset-type of a file dataset: auto, csv or webdataset (the error also names "synthetic"
// where the command takes it, which the caller checks first); non-zero after an error.
int cli_dataset_type(const char *cmd, const char *name, int synthetic_ok, vlmoe_dataset_type *out);

// --dataset-resampled and --train-data-upsampling-factors (both trainers): the factors need the
// flag, which needs webdataset --train-data, and one factor per '::'-joined source; checked before
// any data is read. Non-zero after an error (printed).
int cli_resampling(const char *cmd, const vlmoe_dataset_params *d, int resampled, const char *factors);

// Image files from command-line arguments: a file is taken as it is, a folder for the image
// files (.jpg .jpeg .png .webp, any case) under it, recursively, sorted by path. *out gets
// malloc'd copies (free with vlmoe_free_strings). A folder that cannot be read or holds no image
// is printed and returned as exit status 1; a missing file is kept, to be counted as unreadable.
int cli_list_images(const char *cmd, const char *const *args, int nargs, char ***out, int *n);

// Takes every "--NAME V" and "--NAME=V" out of argv[first..argc) into vals, with the arguments
// that follow V up to the next one starting with '-' ("--images a.jpg b/ c.png"); the others go
// to rest (argv[0..first) first). vals and rest need argc entries. A --NAME without a value is
// printed and returned as exit status 2.
int cli_take_multi(const char *cmd, const char *name, int argc, char **argv, int first, const char **vals,
                   int *nvals, char **rest, int *nrest);

// Plans m for n inputs in batches of at most B: min(n, B) (at least 1). Every row's embedding has
// the same bits however the inputs are batched (src/ops runs 1-row products as 2 rows). The
// message is in vlmoe_last_error().
int cli_plan(vlmoe_model *m, int n, int B);

// vlmoe_encode_image_files (src/eval/run_eval.h) with a progress line: image files encoded in
// batches of batch_size, every readable image's L2-normalised embedding packed in file order into
// out (n, E), ok[i] (may be NULL) says which files were readable, the others are logged in bad.
// after_batch (may be NULL) runs after each model call with the number of images it encoded.
typedef struct {
    const vlmoe_image_params *ip;
    int batch_size;
    const char *progress;              // progress label, e.g. "images"
    void (*after_batch)(void *user, int k);
    void *user;
} cli_encode_params;
int cli_encode_images(vlmoe_model *m, const char *const *paths, int n, const cli_encode_params *p, float *out,
                      uint8_t *ok, cli_bad_log *bad, int *n_ok);
// The error when none of n image files could be read: the file's own message when n is 1.
// Returns exit status 1.
int cli_no_images(const char *cmd, const cli_bad_log *bad, int n);

// The data loader's agreement on bad samples over the processes of a run (src/data/loader.h):
// k (n) = its maximum over them; dist is the run's vlmoe_dist.
int cli_loader_agree(void *dist, uint8_t *k, size_t n);

#endif
