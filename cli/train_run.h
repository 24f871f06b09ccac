// train_run.h: what `vlmoe train` (contrastive) holds: its flags (train_args) and its run
// (train_run), shared by cli/train.c (the flags, params.json, the loop) and cli/train_setup.c
// (the model, its captions' tokenizer, the data and the validation the flags ask for).
#ifndef VLMOE_CLI_TRAIN_RUN_H
#define VLMOE_CLI_TRAIN_RUN_H

#include "common.h"
#include "report.h"
#include "train/tasks.h"
#include "train_flags.h"
#include "vlmoe.h"

typedef struct {
    const char *model, *dataset_type, *logs, *name, *pretrained, *preset;
    const char *resume, *csv_separator, *tokenizer, *image_mean, *image_std, *device;
    const char *precision;       // --precision fp32|bf16 (cli/precision.c)
    const char *upsampling;      // --train-data-upsampling-factors
    const char *soft_dispatch;   // --soft-dispatch (Soft MoE App. A baselines; NULL: the model's)
    int soft_raw;                // --no-soft-normalize (Soft MoE App. E)
    int resampled;               // --dataset-resampled
    int batch_size, image_size, context_length, threads, log_every, eval_samples, keep, workers;
    int expert_parallel;         // under mpirun: every MoE layer's experts split over groups of N
    const char *dist_timeout;    // --dist-timeout seconds (NULL: VLMOE_DIST_TIMEOUT, else 600)
    double bucket_cap_mb;        // --bucket-cap-mb (data parallelism's gradient buckets; 0: one sum)
    int accum_freq;              // micro-batches of --batch-size per step (OpenCLIP's --accum-freq)
    int override;                // --override-inputs: flags replace what a checkpoint records
    int allow_changes;           // --resume-allow-changes
    int grad_ckpt;               // --grad-checkpointing
    const char *recompute_attn;  // --recompute-attention auto|on|off (NULL: auto)
    int lock_image, lock_image_groups, lock_text, lock_text_layers; // LiT (vlmoe_train_params)
    long steps, warmup, seed, cooldown, save_every, zeroshot_every, epochs, num_samples;
    long save_epochs, save_steps;  // --save-frequency (epochs), --save-every-n-steps
    double max_bad;
    cli_optim_flags o;           // --optimizer, --lr, --lr-scheduler, ...
    vlmoe_dataset_params data;   // --train-data and the CSV flags (path NULL: synthetic data)
    // validation while training: --val-data pairs, --zeroshot-data folder; cadences in epochs
    // (OpenCLIP's --val-frequency, --zeroshot-frequency) or steps (--*-every-n-steps)
    const char *val_data, *zs_data, *zs_names, *zs_templates, *zs_dataset;
    long val_freq, val_steps, val_num, zs_freq, zs_steps, val_every;
    long report_every;           // --report-every: LOGS/NAME/report.html every N steps (0: none)
    const char *report_to;       // --report-to tensorboard (OpenCLIP's flag)
} train_args;

// Everything a run holds; run_free releases whatever was set up.
typedef struct {
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_synth *synth;          // synthetic data, or
    vlmoe_loader *loader;        // --train-data through the loader,
    cli_text text;               // its captions' tokenizer
    vlmoe_contrastive *task;
    vlmoe_dataset_params val;    // --val-data with the CSV flags
    vlmoe_image_params val_ip;   // the eval transform of --val-data and --zeroshot-data
    vlmoe_image_folder zs;       // --zeroshot-data, its class names and prompt templates
    char **zs_names, **zs_tpl;
    size_t n_names, n_tpl;
    vlmoe_eval_folder_data zs_data;
    vlmoe_data_state resumed;    // the data position of the checkpoint resumed from
    vlmoe_dist *dist;            // the processes of the run (mpirun); rank 0 prints and writes
    int lead;
    int tty, open_line;          // progress redrawn in place on a terminal
    char dir[512], ckdir[600];
    long report_every, next_report; // --report-every, and the step of the next report
    cli_tb tb;                   // --report-to tensorboard (tb.tb NULL: off)
} train_run;

// Releases the run; the process group too, except after a failure on several processes, where
// cmd_train ends the job with it (the others may be waiting in a collective this one will never
// join).
void train_run_free(train_run *r, int rc);
// The model: a resumed run's (newest usable checkpoint first), or one from --model/--pretrained,
// with the tokenizer of its captions (r->text) and what the model file will record about them.
int train_setup_model(const train_args *a, const vlmoe_train_params *tp, train_run *r);
// The data: the synthetic pairs, or the loader over --train-data (at the checkpoint's position
// when resuming), normalised as the model records or as the flags say (then recorded).
int train_setup_data(const train_args *a, train_run *r);
// --val-data / --zeroshot-data into cp (opened now, so a missing file stops the run early).
int train_setup_validation(const train_args *a, train_run *r, vlmoe_contrastive_params *cp);
// The loop calls the evaluation hook every this many steps (0: at the end only).
long train_eval_cadence(const train_args *a);

#endif
