// prune_sweep.h: `vlmoe prune --sweep` (cli/prune_sweep.c): zero-shot against the experts kept,
// for each pruning mode, as JSON lines that `vlmoe report` plots (tests/test_report.c).
#ifndef VLMOE_CLI_PRUNE_SWEEP_H
#define VLMOE_CLI_PRUNE_SWEEP_H
#include <stddef.h>

#include "vlmoe.h"

typedef struct {
    const char *model;          // the model file (messages, records, the inputs it records)
    const char *out;            // the JSON lines file; appended to (a file that is no sweep is refused)
    const char *zeroshot;       // --zeroshot-data DIR (DIR/<class>/*.jpg); NULL: the synthetic held-out split
    const char *shares;         // where the experts' shares came from, for the records
    int mod;                    // VLMOE_MOD_TEXT / VLMOE_MOD_IMAGE: the modality pruned for
    int samples, batch;         // held-out synthetic samples; encoding batch
    const int *keep;            // (nkeep) experts kept per layer
    int nkeep;
    const int *modes;           // (nmodes) vlmoe_prune_mode
    int nmodes;
} prune_sweep_params;

// "1,2,4" into keep (at most 64 counts, each in [1, E], no repeats); errors name --sweep.
int cli_sweep_list(const char *v, int E, int *keep, int *n);
// Where a sweep of model goes without -o: RUN/prune_sweep.jsonl for RUN/checkpoints/X of a run
// folder (one with metrics.jsonl), else MODEL.prune_sweep.jsonl beside the model.
void cli_sweep_default_out(const char *model, char *out, size_t cap);
// The unpruned model's zero-shot, then each mode x kept count's, one line each; usage as
// vlmoe_model_prune takes it (layers x E). Errors printed; exit status returned.
int cli_prune_sweep(vlmoe_model *m, const double *usage, int E, const prune_sweep_params *p);
#endif
