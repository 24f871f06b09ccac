// train_flags.h: what the two trainers of `vlmoe train` (cli/train.c, contrastive; cli/vlmoe_train.c,
// VL-MoE) share about their flags: epochs counted in steps (--epochs, --save-frequency as in
// OpenCLIP), the strict --resume check against the run's params.json, flags that do not apply.
// Implemented in cli/train_flags.c; covered by tests/test_train_flags.c and tests/test_vlmoe_train.c.
#ifndef VLMOE_CLI_TRAIN_FLAGS_H
#define VLMOE_CLI_TRAIN_FLAGS_H

#include <cjson/cJSON.h>

#include "vlmoe.h"

// The start of both trainers' --help explanation of the progress line (each adds its own fields).
#define CLI_PROGRESS_HELP                                                                                          \
    "The progress line, every --log-every-n-steps (redrawn in place on a terminal; the same\n"                     \
    "values, unrounded, in LOGS/NAME/metrics.jsonl, docs/METRICS.md):\n"                                          \
    "  step N/S                  steps done / --steps\n"                                                          \
    "  loss L (avg A)            this step's total loss (task + weighted MoE auxiliary losses); the\n"              \
    "                            mean over the steps since the previous line\n"

// The optimizer and schedule flags of both trainers. NAN (beta1, beta2, eps): not given.
typedef struct {
    const char *optimizer;       // --optimizer adamw | adafactor
    const char *scheduler;       // --lr-scheduler cosine | rsqrt | const
    double lr, wd, beta1, beta2, eps, grad_clip;
    long warmup, cooldown;       // --warmup, --lr-cooldown-steps (rsqrt only)
    const char *momentum_dtype;  // --momentum-dtype float32 | bfloat16 (Adafactor); NULL: not given
} cli_optim_flags;
// The paper whose training recipe a run's defaults follow: --preset NAME, else the family of
// --model NAME (limoe-*, clipup-*); NULL: none (the generic defaults).
const char *cli_paper_of(const char *preset, const char *model);
// Fills the optimizer flags not given (optimizer NULL, lr/wd NAN) from `paper` (limoe, clipup,
// vlmoe or NULL): LIMoE app. A: Adafactor as ViT-G (momentum 0.9 in bfloat16), lr 1e-3, decay 1e-5;
// CLIP-UP sec. 4: AdamW, lr 5e-5, wd 0.05; VL-MoE sec. 4.1: AdamW, lr 2e-3, wd 0.05; otherwise
// AdamW, lr 1e-3, wd 0.1 (Adafactor: 1e-5). Flags given are kept.
void cli_paper_optim(const char *paper, cli_optim_flags *o);
// tp's optimizer and schedule (over `steps` steps) from o; AdamW's beta2 defaults to beta2_default
// (the trainer's paper's), beta1 to 0.9 (Adafactor's momentum too, as big_vision's), eps to 1e-6;
// Adafactor's decay follows the schedule (lr / --lr times wd, big_vision's). o gets the
// values used, for params.json (0 for the settings Adafactor has not). A flag the optimizer or
// schedule has not is an error (printed; exit status 1).
int cli_optim_params(const char *cmd, cli_optim_flags *o, long steps, double beta2_default, vlmoe_train_params *tp);
// Adds o's settings to params.json's object pj.
void cli_optim_json(cJSON *pj, const cli_optim_flags *o);

// An epoch of `samples` samples at G samples per step lasts ceil(samples / G) steps: the data is a
// stream, so an epoch's last step is filled up with the next epoch's first samples, and epoch e
// ends at step e * cli_epoch_steps (OpenCLIP likewise gives every epoch the same number of steps).
long cli_epoch_steps(long samples, long G);

// The length of a run and its checkpoint cadence in steps, from --steps or --epochs and
// --save-frequency (epochs, as OpenCLIP) or --save-every-n-steps.
typedef struct {
    long steps_given;            // --steps (-1: not given)
    long epochs, save_epochs, save_steps; // --epochs, --save-frequency, --save-every-n-steps (0: not given)
    long samples;                // samples per epoch (needed with epochs or save_epochs)
    long per_step;               // samples per step (the global batch)
    long steps, save_every;      // in: the default --steps; out: the steps, the checkpoint cadence
} cli_run_length;
// Whether the epoch's size is needed (--epochs or --save-frequency).
int cli_by_epoch(const cli_run_length *l);
// Checks the flags (both of a pair is an error, negatives too) and sets steps and save_every.
// The error is printed (exit status 1).
int cli_run_length_set(const char *cmd, cli_run_length *l);

// An error naming the first of the flags in names (NULL-terminated, without "--") that argv
// holds, with why ("applies to ..."); 0 when none is given. The error is printed (exit status 1).
int cli_reject_flags(const char *cmd, int argc, char **argv, const char *const *names, const char *why);

// --resume: compares params (what this invocation would write as params.json) with the run's
// record: DIR/params_resumed.json when an earlier resume went on with changes, else
// DIR/params.json (the first run's, never rewritten). Every key is compared except those a resume
// may change (--steps and --epochs to train longer, cadences, threads, workers, device) and, when
// not given now, what the checkpoint carries (tokenizer, normalisation). A key the
// record lacks (a run from an older vlmoe) is compared with the value that vlmoe used before the
// key existed, where one is known (cli_resumed_*: drop_path 0, hflip 0, color_jitter 0, precision
// fp32, momentum_dtype float32), else not compared; the batch per process is not compared
// when the number of processes changed (the global batch is). Each difference reads
// "--lr 0.002 differs from the run's 0.001 (params.json of logs/run1)"; with CLI_RESUME_ALLOW
// (--resume-allow-changes) each is printed as a warning and *changes gets them (a cJSON array of
// strings, NULL when nothing differs), else they are one error (exit status 1). Without
// CLI_RESUME_PRINT nothing is printed (the processes other than rank 0 under mpirun).
// CLI_RESUME_CARRIED: the trainer takes the tokenizer and normalisation from the checkpoint when
// their flags are not given, so leaving them out is no change.
enum { CLI_RESUME_ALLOW = 1, CLI_RESUME_PRINT = 2, CLI_RESUME_CARRIED = 4 };
int cli_resume_check(const char *cmd, const char *dir, const cJSON *params, int how, cJSON **changes);
// --resume latest of a run that was started (its folder dir existed before this command: existed)
// but killed before its first checkpoint was complete: nothing to resume, so the run starts again
// from step 0 (a note says so; *resume becomes NULL), as OpenCLIP does, and a job requeued with the
// same flags does not fail forever. A folder that did not exist (a mistyped --name) stays an error.
// print: this process prints the note.
void cli_resume_fresh(const char *cmd, const char *dir, int existed, const char **resume, int print);
// 1 (after printing why) when a run without --resume would write into dir, which already holds
// another run's checkpoints or metrics; 0 otherwise.
int cli_run_taken(const char *cmd, const char *dir, const char *resume);
// Claims the run folder dir (which must exist) for this job until the process ends: the lead
// process holds an exclusive lock on dir/.vlmoe.lock (flock: released when the process ends, even
// when killed), so that two runs started into one folder (the same --name, two unnamed runs in the
// same second, two resumes of one run) cannot write over each other's files. Every process of d
// (NULL: one process) learns whether the lead got it. 0, or 1 after printing why.
struct vlmoe_dist;
int cli_run_lock(const char *cmd, const char *dir, struct vlmoe_dist *d, int lead);

// What a resumed run takes for a flag that was not given, so that it goes on as the run it
// continues: rec is the run's record (cli_run_record: params_resumed.json, else params.json; NULL
// when there is none, for a fresh run), and a key the record lacks (written before the flag
// existed) means the behaviour of that older vlmoe, not today's default.
cJSON *cli_run_record(const char *dir);
// The record's number for key; the older vlmoe's value when rec lacks the key (fresh when that is
// not known); fresh without a record or when the record holds null (the flag did not apply).
double cli_resumed_num(const cJSON *rec, const char *key, double fresh);
// The optimizer settings not given (NULL / NAN in o) from the record, before cli_paper_optim
// fills the rest: a run started under an older paper recipe keeps its optimizer, lr, wd, betas,
// eps and momentum dtype. beta2 and eps are taken only for AdamW (Adafactor records them as 0).
// The trainers call it where a paper's recipe gives the defaults (contrastive: limoe-*, clipup-*,
// --preset; VL-MoE always), the defaults that changed under runs already started.
void cli_resumed_optim(const cJSON *rec, cli_optim_flags *o);

// After a resume that went on with changes: DIR/params_resumed.json, params with the list
// "resumed_with_changes" (the earlier resumes' entries and {"step": step, "changes": changes}).
// params and changes are freed here. The error is printed (exit status 1).
int cli_resume_record(const char *cmd, const char *dir, cJSON *params, cJSON *changes, long step);

#endif
