// args.h: table-driven flag parsing for the vlmoe subcommands (OpenCLIP-style `--flag value`
// or `--flag=value`), with help text generated from the same table so --help never goes stale.
#ifndef VLMOE_CLI_ARGS_H
#define VLMOE_CLI_ARGS_H

// Every number is checked by the parser, for every command, before the command sees it: no
// flag takes a negative value, NaN or an infinity (counts, sizes, rates, seeds, factors), and
// the kinds below narrow that further where 0 means nothing. An out-of-range value is a usage
// error (exit 2) naming the flag, the range and the value given.
typedef enum {
    ARG_INT,     // int >= 0
    ARG_LONG,    // long >= 0
    ARG_DOUBLE,  // finite double >= 0
    ARG_STRING,
    ARG_FLAG,
    ARG_INT1,    // int >= 1 (sizes, counts where 0 means nothing)
    ARG_LONG1,   // long >= 1
    ARG_POS,     // finite double > 0 (learning rates, epsilons, capacity factors)
    ARG_FRAC,    // double in [0, 1] (fractions)
    ARG_BETA,    // double in [0, 1) (Adam's betas: 1 never forgets, the bias correction divides by 0)
} arg_kind;
typedef struct {
    const char *name;    // without the leading "--"
    arg_kind kind;
    void *dest;          // int* (INT, INT1), long* (LONG, LONG1), double* (DOUBLE, POS, FRAC, BETA),
                         // const char**, int* (flag: set to 1)
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
