// run.h: a training run in the library: the one loop every kind of training goes through
// (contrastive, VL-MoE pre-training, fine-tuning), the run folder with its checkpoints, and the
// metrics sink and reader of the one JSON-lines schema (docs/METRICS.md). The loop is
// src/train/run.c; the tasks that plug into it are src/train/contrastive_task.c,
// src/train/mome_task.c and src/train/finetune_task.c; cli/ parses flags, prints and picks exit
// codes. Covered by tests/test_cli.c, tests/test_checkpoint.c, tests/test_vlmoe_train.c and
// tests/test_finetune.c.
#ifndef VLMOE_TRAIN_RUN_H
#define VLMOE_TRAIN_RUN_H
#include <stdio.h>

#include <cjson/cJSON.h>

#include "dist/dist.h"
#include "vlmoe.h"

// ---- the run folder: LOGS/NAME/{config.json, params.json, metrics.jsonl, checkpoints/}
// A checkpoint is checkpoints/step_N.safetensors (weights + config) and step_N.state.safetensors
// (training state); a weights file without its state is incomplete.
void vlmoe_ckpt_paths(const char *dir, long step, char *weights, char *state, size_t cap);
// The steps with a weights file in dir, newest first (at most max).
int vlmoe_ckpt_list(const char *dir, long *steps, int max);
// Removes all but the newest `keep` checkpoints (state file first).
void vlmoe_ckpt_prune(const char *dir, int keep);
// Removes the temporary files of a writer killed before its rename.
void vlmoe_ckpt_clean_tmp(const char *dir);
// resume "latest" (the newest usable checkpoint of ckdir, falling back to older ones: each one
// skipped is reported through warn) or a step_N.safetensors file with its state beside it: the
// model (planned for plan_B unless 0), its trainer with tp and the saved state, the data state in
// *ds and the weights file used in w (cap bytes).
typedef void (*vlmoe_warn_fn)(void *user, const char *message);
int vlmoe_ckpt_resume(const char *ckdir, const char *resume, const vlmoe_train_params *tp, int plan_B,
                      vlmoe_model **m, vlmoe_trainer **t, vlmoe_data_state *ds, char *w, size_t cap,
                      vlmoe_warn_fn warn, void *user);
// The run id both files of a checkpoint carry (src/train/checkpoint.c): a buffer of
// VLMOE_RUN_ID_LEN bytes on the trainer, empty until its first save or resume.
enum { VLMOE_RUN_ID_LEN = 24 };
char *vlmoe_trainer_run_id(vlmoe_trainer *t);
// vlmoe_trainer_load that also says (*verified, may be NULL) whether both files carried checksums
// (files written before them load unverified).
int vlmoe_trainer_load_checked(vlmoe_trainer *t, const char *weights_path, const char *state_path,
                               vlmoe_data_state *data, int *verified);
// mkdir -p; writes text and a newline to path. Both return VLMOE_OK or VLMOE_ERR_IO with the
// path and the system's reason.
int vlmoe_mkdir_p(const char *path);
int vlmoe_write_text(const char *path, const char *text);
// config.json (the resolved model config) and params.json (the run's settings, freed here) in dir.
int vlmoe_run_write_files(const char *dir, const vlmoe_model_config *c, cJSON *params);
// The run folder a --resume FILE belongs to (LOGS/NAME of LOGS/NAME/checkpoints/step_N...).
void vlmoe_run_dir_of(const char *weights, char *dir, size_t cap);

// ---- metrics: one JSON object per line, "step" first, then "kind" (docs/METRICS.md)
typedef struct vlmoe_metrics vlmoe_metrics;
// Opens path for a run at step `start`: an existing file keeps the records of steps <= start (none
// when start is 0) and new records are appended, so no step is logged twice after a resume; the
// records it drops (a run stopped after its last checkpoint logged steps it now trains again) are
// appended to metrics.dropped.jsonl beside it, never lost.
int vlmoe_metrics_open(vlmoe_metrics **out, const char *path, long start);
void vlmoe_metrics_close(vlmoe_metrics *m);
// A new record {"step": step, "kind": kind}; the caller adds fields and writes it.
cJSON *vlmoe_metrics_record(long step, const char *kind);
// Writes one record as a line and flushes it; the record is freed.
int vlmoe_metrics_write(vlmoe_metrics *m, cJSON *rec);
// A JSON number that reads back as exactly the same double (resumed and uninterrupted runs are
// compared bit for bit); null for a non-finite value.
cJSON *vlmoe_metrics_exact(double v);
// The "moe" array of a record: one object per MoE layer and modality statistics; `stream`
// (may be NULL) names the VL-MoE stream the statistics come from. succ (may be NULL) gets the
// lowest success rate of each modality over the layers.
cJSON *vlmoe_metrics_moe(const vlmoe_moe_stats *ms, int n, const char *stream, double succ[2]);
// Reads a metrics file record by record: each(user, record, line number) for every line that is
// a JSON object with a numeric "step"; a line that is not is an error naming the file and line.
// A non-zero return of each stops the reading and is returned.
int vlmoe_metrics_read(const char *path, int (*each)(void *user, const cJSON *rec, long line), void *user);
// The experts' shares of one modality's tokens (VLMOE_MOD_*) in the nl MoE layers of one encoder:
// the mean of the "accepted" fractions over the last `last` train records, u (nl, E); *seen (may
// be NULL) gets the number of records with routing statistics.
int vlmoe_metrics_expert_shares(const char *path, int encoder, int modality, int last, int nl, int E, double *u,
                                int *seen);

// Data parallelism: the trainer's steps average their gradients (and statistics) over d's
// processes before clipping and the update (a world of one or NULL: no collective at all).
// experts (NULL: none): the group of d's processes the MoE layers' experts are split over (d, or
// one of the groups of vlmoe_dist_split; its size must divide every MoE layer's num_experts).
// vlmoe_run_train sets both from its params. With experts the model's expert banks are sharded
// (src/train/trainer.c): a process holds, reduces and updates its own experts only (the model's
// layout becomes its shard: vlmoe_model_num_floats and the parameter table say so), over the
// processes holding the same ones, until vlmoe_trainer_gather_experts. Collective over d when
// experts are set (a split); NULL, NULL undoes it (not collective; a model still sharded
// becomes whole with its own experts only, the others zero).
int vlmoe_trainer_set_dist(vlmoe_trainer *t, vlmoe_dist *d, vlmoe_dist *experts);
// Sharded experts: rank 0 becomes whole, every expert's current parameters and optimizer state
// brought from its owner (before rank 0 writes or evaluates; vlmoe_trainer_drop_experts after),
// or with every 1 (at the end of a run) every process becomes whole, the parameters gathered to
// every process and the state to rank 0 only. Collective over the world; a no-op without
// sharding.
int vlmoe_trainer_gather_experts(vlmoe_trainer *t, int every);
// Rank 0 goes back to its shard after vlmoe_trainer_gather_experts(t, 0). Not collective.
int vlmoe_trainer_drop_experts(vlmoe_trainer *t);
// Before a checkpoint on several processes: every process holds the same step and the same
// parameters, checked by checksums (with sharded experts: the dense ones over the world, each
// process's own experts over the processes that own the same ones; before the gather). Collective
// over d.
int vlmoe_trainer_check_replicas(vlmoe_trainer *t, vlmoe_dist *d);
// OpenCLIP's --accum-freq: one step (divergence guard, clipping, schedule, update) with the
// gradient of the n micro-batches as one batch of n times their pairs (model_accumulate in
// src/nn/model.h): the same step as vlmoe_trainer_step on that batch, to float rounding, when
// the MoE layers' routing groups split every micro-batch. Contrastive (towers) models only.
int vlmoe_trainer_step_accum(vlmoe_trainer *t, const vlmoe_batch *micro, int n, vlmoe_step_stats *stats);

// ---- the loop
// What one kind of training plugs into the loop. step is required; the others may be NULL.
typedef struct {
    void *user;
    // the samples of global step `step` (0-based) into the task's buffers
    int (*fill)(void *user, long step);
    // forward, backward and the optimizer update on them
    int (*step)(void *user, vlmoe_trainer *t, long step, vlmoe_step_stats *s);
    // the task's fields of the train record of step `done` (losses, routing) and its part of the
    // progress line (appended to line, cap bytes)
    int (*log)(void *user, long done, const vlmoe_step_stats *s, cJSON *rec, char *line, size_t cap);
    // the evaluation hook: fields of an "eval" record and its progress line; a call that adds no
    // field writes no record (the task's parts may have cadences of their own)
    int (*eval)(void *user, long done, cJSON *rec, char *line, size_t cap);
    // the data position after step `done`, kept in the checkpoint
    void (*data_state)(void *user, long done, vlmoe_data_state *ds);
} vlmoe_run_task;

enum { VLMOE_RUN_STEP = 0, VLMOE_RUN_EVAL = 1, VLMOE_RUN_CHECKPOINT = 2 };

typedef struct {
    const char *dir;          // the run folder (metrics.jsonl; checkpoints/ under it); NULL: no
                              // files (fine-tuning writes its model when the run is done)
    long steps;               // train until this step
    int log_every;            // a train record and a progress line every N steps and at the end
    long save_every;          // a checkpoint every N steps (0: at the end only)
    int keep;                 // newest checkpoints kept (0: all)
    long eval_every;          // the evaluation hook every N steps (0: none before the end)
    int eval_at_end;          // and after the last step
    long samples_per_step;    // the global batch, for samples/s
    vlmoe_dist *dist;         // NULL: a world of one; only rank 0 writes files
    // progress (may be NULL): a line about a step, an evaluation or a checkpoint
    void (*progress)(void *user, int what, const char *line);
    void *progress_user;
    int expert_parallel;      // N > 1: the experts are split over groups of N consecutive
                              // processes (N divides the process count); 0 or 1: not split
} vlmoe_run_params;

// Trains from the trainer's step to p->steps: fill, step, then on the cadences a train record and
// a progress line, a checkpoint, an evaluation. A failed step leaves the parameters as they were
// and returns its status (the message says what diverged). The metrics file is opened here.
int vlmoe_run_train(vlmoe_trainer *t, const vlmoe_run_task *task, const vlmoe_run_params *p);

#endif
