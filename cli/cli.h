// cli.h: the subcommands of the vlmoe command and their shared helpers. cli/ is the only place
// that prints to the user or decides an exit status.
#ifndef VLMOE_CLI_H
#define VLMOE_CLI_H
#include "vlmoe.h"

int cmd_train(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_classify(int argc, char **argv);
int cmd_embed(int argc, char **argv);
int cmd_soup(int argc, char **argv);
int cmd_prune(int argc, char **argv);
int cmd_import(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_upcycle(int argc, char **argv);
int cmd_finetune(int argc, char **argv); // cli/finetune.c: VL-MoE classification heads
int cmd_synth(int argc, char **argv);    // cli/synth.c: `vlmoe synth export`, the synthetic data as files

// Prints "vlmoe CMD: message" to stderr and returns exit status 1.
int cli_error(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

typedef struct {
    double top1, top5, i2t, t2i;
    int classes, chunk;
} cli_eval;
int cli_eval_synthetic(vlmoe_model *m, const vlmoe_synth *s, int n, int chunk, cli_eval *out);

// Per-layer, per-modality routing statistics as JSON; succ (may be NULL) gets the lowest success
// rate of each modality over the layers.
struct cJSON;
struct cJSON *cli_moe_json(const vlmoe_moe_stats *ms, int n, double succ[2]);

// Checkpoint folder helpers (cli/ckpt.c). ckpt_list returns the steps with a weights file,
// newest first.
void ckpt_paths(const char *dir, long step, char *weights, char *state, size_t cap);
int ckpt_list(const char *dir, long *steps, int max);
void ckpt_prune(const char *dir, int keep);
// Removes temporary files left by a writer killed before its rename.
void ckpt_clean_tmp(const char *dir);
// --resume latest (the newest usable checkpoint of ckdir, falling back to older ones) or --resume
// FILE (step_N.safetensors with its state file beside it): the model (planned for plan_B unless
// 0), its trainer with tp and the saved state, the data state in *ds and the weights file in w
// (cap bytes). Non-zero after an error (printed).
int ckpt_resume(const char *cmd, const char *ckdir, const char *resume, const vlmoe_train_params *tp, int plan_B,
                vlmoe_model **m, vlmoe_trainer **t, vlmoe_data_state *ds, char *w, size_t cap);
// mkdir -p (0 or -1 with errno); writes text and a newline to path (0 or -1).
int cli_mkdir_p(const char *path);
int cli_write_text(const char *path, const char *text);
// Monotonic seconds.
double cli_now(void);

#endif
