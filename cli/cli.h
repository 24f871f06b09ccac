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
int cmd_info(int argc, char **argv);     // cli/info.c: parameters and GFLOP of a config

// Prints "vlmoe CMD: message" to stderr and returns exit status 1.
int cli_error(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// A command that runs on the processes of d: under mpirun cli_error then prints "vlmoe CMD: rank R:
// message", and a collective that times out (vlmoe_dist_set_timeout) prints "vlmoe: <why>" and
// ends the job (vlmoe_dist_abort): the library reports the timeout, the command line exits.
struct vlmoe_dist;
void cli_set_dist(struct vlmoe_dist *d);

// --precision fp32|bf16 (cli/precision.c): sets the model's precision; a CPU without bf16
// instructions keeps fp32 after a one-line notice. 0, or the library's status (the message in
// vlmoe_last_error, for the caller's cli_error). NULL: no change.
int cli_set_precision(const char *cmd, vlmoe_model *m, const char *precision);
// --precision's help in embed, classify and eval (train's differs: it refuses int8)
#define CLI_PRECISION_HELP                                                                                      \
    "bf16: products in bf16 on a CPU with AVX512_BF16 or AMX; int8: MLP and expert products in int8 on a CPU " \
    "with VNNI or AVX2 (attention's in bf16 where the CPU has it; int8-attn: in int8 too) (default fp32)"

// Monotonic seconds.
double cli_now(void);

#endif
