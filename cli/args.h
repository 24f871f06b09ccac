// args.h: table-driven flag parsing for the vlmoe subcommands (OpenCLIP-style `--flag value`
// or `--flag=value`), with help text generated from the same table so --help never goes stale.
#ifndef VLMOE_CLI_ARGS_H
#define VLMOE_CLI_ARGS_H

typedef enum { ARG_INT, ARG_LONG, ARG_DOUBLE, ARG_STRING, ARG_FLAG } arg_kind;
typedef struct {
    const char *name;    // without the leading "--"
    arg_kind kind;
    void *dest;          // int*, long*, double*, const char**, int* (flag: set to 1)
    const char *meta;    // value placeholder in --help, e.g. "N"
    const char *help;
} arg_spec;

// Parses argv[first..argc); returns 0, or 1 for --help (printed), or 2 on a bad flag (message
// printed to stderr naming the flag).
int args_parse(const char *cmd, const arg_spec *specs, int n, int argc, char **argv, int first,
               const char *usage);
// The same for commands with positional arguments: those not starting with "--" go to pos (more
// than maxpos is a bad-argument error). In both, "-o FILE" means "--output FILE" where there is
// an "output" flag.
int args_parse_pos(const char *cmd, const arg_spec *specs, int n, int argc, char **argv, int first,
                   const char *usage, char **pos, int maxpos, int *npos);
void args_help(const char *cmd, const arg_spec *specs, int n, const char *usage);
// Text --help prints after the options (NULL: none), for a command whose help is longer than one
// string literal may be (C's 4095 characters).
void args_set_epilogue(const char *text);

#endif
