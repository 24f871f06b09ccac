// tokenize.h: the tokenizer subcommands (cli/tokenize.c) over src/tok/tok.h: `vlmoe tokenize` prints
// the ids and pieces of texts, `vlmoe tokenizer train` learns a CLIP merges file from captions.
// Spec: ../shared/spec/MODEL.md (Tokenizer). Covered through tests/test_tokenizer.c (library side).
#ifndef VLMOE_CLI_TOKENIZE_H
#define VLMOE_CLI_TOKENIZE_H

// argv[1] is "tokenize": vlmoe tokenize [--tokenizer FILE] [--context-length N] [--padded] TEXT...
int cmd_tokenize(int argc, char **argv);
// argv[1] is "tokenizer", argv[2] the action: vlmoe tokenizer train --captions FILE --vocab-size N -o OUT
int cmd_tokenizer(int argc, char **argv);

#endif
