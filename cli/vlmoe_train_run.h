// vlmoe_train_run.h: what `vlmoe train` for VL-MoE models holds: its flags (mome_args) and its
// run (mome_cli), shared by cli/vlmoe_train.c (the flags, params.json, the loop) and
// cli/vlmoe_train_setup.c (the texts' tokenizer, the data files, the model and what it records).
#ifndef VLMOE_CLI_VLMOE_TRAIN_RUN_H
#define VLMOE_CLI_VLMOE_TRAIN_RUN_H

#include "common.h"
#include "report.h"
#include "train/tasks.h"
#include "train_flags.h"
#include "vlmoe.h"

typedef struct {
    const char *model, *codebook, *logs, *name, *mix, *image_data, *text_data, *resume;
    const char *dataset_type, *csv_separator, *tokenizer, *image_mean, *image_std;
    const char *upsampling;      // --train-data-upsampling-factors
    const char *device;          // --device cpu|cuda[:N] (NULL: cpu)
    int batch, log_every, keep, workers, threads, allow_changes, resampled;
    long steps, seed, save_every, save_epochs, epochs, num_samples;
    double max_bad;
    double drop_path;            // --drop-path: stochastic depth of the last block
    double hflip, color_jitter;  // --hflip, --color-jitter of image files (NAN: not given)
    long report_every;           // --report-every: LOGS/NAME/report.html every N steps (0: none)
    const char *report_to;       // --report-to tensorboard
    int grad_ckpt, lock[4];      // OpenCLIP's flags the VL-MoE trainer refuses (one set of flags)
    const char *recompute_attn;  // --recompute-attention: auto or on (what VL-MoE does), else refused
    cli_optim_flags o;           // --optimizer, --lr, --lr-scheduler, ...
    vlmoe_dataset_params data;   // --train-data and the CSV flags
} mome_args;

// Everything a run holds; run_free releases whatever was set up.
typedef struct {
    vlmoe_model_config cfg;
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_mome_run *task;
    cli_text text;                       // tokenizer of --text-data and --train-data captions
    char **images;                       // --image-data files, sorted
    int n_images;
    char **lines;                        // --text-data lines, with their numbers
    long *lineno;
    size_t n_lines;
    char tokenizer_path[1100];           // the texts' tokenizer file (open_text)
    float *cb;                           // --codebook
    vlmoe_data_state resumed;            // the data state of the checkpoint resumed from
    vlmoe_dist *dist;                    // the processes of the run (mpirun); rank 0 prints and writes
    int lead;
    char dir[512], ckdir[600];
    long report_every, next_report;      // --report-every, and the step of the next report
    cli_tb tb;                           // --report-to tensorboard (tb.tb NULL: off)
} mome_cli;

// Releases the run; the process group too, except after a failure on several processes (the
// others may be waiting in a collective this one will never join).
void mome_run_free(mome_cli *r, int rc);
// Exit status of a failed step of the set-up, with the library's message ("vlmoe train: what: ...").
int mome_lib_error(const char *what);
// What the streams read from files into p: the texts' tokenizer (never the synthetic words for
// files: --tokenizer, the run's tokenizer.txt, else BPE trained now, the vocabulary sized to it),
// the image transform, the image files and the text file's lines.
int mome_open_data(const mome_args *a, const vlmoe_mome_split *sp, vlmoe_mome_params *p, mome_cli *r);
// The model, fresh or resumed, with the task started on it and its inputs recorded.
int mome_setup_model(const mome_args *a, const vlmoe_train_params *tp, const vlmoe_mome_params *p, mome_cli *r);

#endif
