// tokenize.h: the tokenizer subcommands (cli/tokenize.c) over src/tok/tok.h: `vlmoe tokenize` prints
// the ids and pieces of texts, `vlmoe tokenizer train` learns a CLIP merges file from captions.
// Spec: ../shared/spec/MODEL.md (Tokenizer). Covered through tests/test_tokenizer.c (library side).
#ifndef VLMOE_CLI_TOKENIZE_H
#define VLMOE_CLI_TOKENIZE_H

#include <stddef.h>

// argv[1] is "tokenize": vlmoe tokenize [--tokenizer FILE] [--context-length N] [--padded] TEXT...
int cmd_tokenize(int argc, char **argv);
// argv[1] is "tokenizer", argv[2] the action: vlmoe tokenizer train --captions FILE --vocab-size N -o OUT
int cmd_tokenizer(int argc, char **argv);

// Shared with `vlmoe eval`. A CLIP merges file (.txt, .txt.gz) or, by its .json name, an HF
// tokenizer.json; the message is in vlmoe_last_error().
struct vlmoe_tokenizer;
int cli_load_tokenizer(const char *path, struct vlmoe_tokenizer **out);
// The non-blank lines of a text file ('\n' or "\r\n" ends), malloc'd; errors are printed
// ("vlmoe CMD: PATH: why") and returned as exit status 1. Free with cli_free_lines.
int cli_read_lines(const char *cmd, const char *path, char ***out, size_t *n);
// The same with each line's number in the file (1-based, blank lines counted) in *lineno
// (malloc'd, n entries; NULL: not wanted).
int cli_read_lines_numbered(const char *cmd, const char *path, char ***out, long **lineno, size_t *n);
void cli_free_lines(char **v, size_t n);

#endif
