// report.h: `vlmoe report`, `vlmoe routes` and the report hooks of `vlmoe train`
// (--report-every, --report-to tensorboard): the pieces they share (cli/report.c).
#ifndef VLMOE_CLI_REPORT_H
#define VLMOE_CLI_REPORT_H
#include "common.h"
#include "report/report.h"
#include "vlmoe.h"

int cmd_report(int argc, char **argv);
int cmd_routes(int argc, char **argv);

// Inputs whose routing is drawn: synthetic held-out samples (with captions) or image files.
typedef struct {
    int n, S;
    float *images;              // (n, 3, S, S) as the model sees them
    int32_t *tokens, *lengths;  // (n, ctx), (n); NULL: images only
    char **captions;            // (n) or NULL
    cli_text text;              // the captions' tokenizer
    float mean[3], std[3];      // to draw the images back
    char from[600];             // where they came from, for the page
} cli_examples;
// examples: NULL for the synthetic held-out split, else a folder or image files (comma-separated);
// text: a caption for every example (NULL: none, or the synthetic ones). skip (may be NULL) gets
// the reason when there is nothing to draw without it being an error (returns 0, n = 0).
int cli_examples_load(const char *cmd, const vlmoe_model *m, const char *mpath, const char *examples, int n,
                      const char *text, cli_examples *ex, char *skip, size_t nskip);
void cli_examples_free(cli_examples *ex);
// The evaluation-mode forward of the examples and each one's routing (routes[n], freed by the
// caller with report_routes_free).
int cli_examples_route(const char *cmd, vlmoe_model *m, const cli_examples *ex, report_routes *routes);
// The words of caption and the expert of each word's first token per layer (layers x nwords).
int cli_caption_words(const char *caption, cli_text *text, int ctx, const report_routes *r, char ***words,
                      int *nwords, int32_t **word_expert);

typedef struct {
    const char *run_dir;        // LOGS/NAME
    const char *out;            // the HTML file (NULL: RUN_DIR/report.html)
    const char *examples;       // --examples (NULL: synthetic)
    const char *checkpoint;     // NULL: the newest of RUN_DIR/checkpoints
    const char *tokenizer;      // for captions of --examples (NULL: what the model records)
    int nexamples, max_points;
    int html;                   // write the page
    report_tb *tb;              // also the routing maps as TensorBoard images (NULL: no)
    int quiet;                  // no "wrote ..." line (training's periodic reports)
} cli_report_opts;
// Writes the report of a run; errors printed as "vlmoe CMD: ...", exit status returned.
int cli_report_write(const char *cmd, const cli_report_opts *o);

// The TensorBoard side of a training run: LOGS/NAME/tensorboard/ (OpenCLIP's layout).
typedef struct {
    report_tb *tb;
    long offset;                // bytes of metrics.jsonl converted
    char metrics[1100];
} cli_tb;
int cli_tb_open(const char *cmd, const char *run_dir, cli_tb *t);
int cli_tb_sync(const char *cmd, cli_tb *t);
void cli_tb_close(cli_tb *t);
#endif
