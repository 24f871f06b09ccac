// outputs.h: one check for every command that writes a file: the output must not be one of the
// command's inputs (the same device and inode, whatever the names: a link, "./x", "../d/x"), so a
// mistyped -o never destroys the model, captions or data it was about to read. Implemented in
// cli/outputs.c; covered by tests/hostile/test_hostile_files.c.
#ifndef VLMOE_CLI_OUTPUTS_H
#define VLMOE_CLI_OUTPUTS_H

// An input of a command: the flag that named it (for the message) and its path (NULL: not given).
typedef struct {
    const char *flag;
    const char *path;
} cli_input;

// 0 when the output `out` (given by `oflag`) is none of the n inputs; otherwise prints "vlmoe CMD:
// OFLAG OUT is the same file as FLAG PATH: ..." and returns 1. An existing output is compared by
// device and inode; one that does not exist yet by its folder's device and inode and its name,
// against inputs that do not exist either.
int cli_check_output(const char *cmd, const char *oflag, const char *out, const cli_input *in, int n);
// The same for the files a training run writes in its folder dir (config.json, params.json,
// params_resumed.json, metrics.jsonl, metrics.dropped.jsonl).
int cli_check_run_outputs(const char *cmd, const char *dir, const cli_input *in, int n);

#endif
