// tokenize.c: `vlmoe tokenize` (ids and pieces of texts with a CLIP merges file or an HF
// tokenizer.json) and `vlmoe tokenizer train` (learns a CLIP merges file from one caption per line).
// Spec: ../shared/spec/MODEL.md (Tokenizer); library in src/tok/bpe.c, tests/test_tokenizer.c.
#include "tokenize.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "args.h"
#include "cli.h"
#include "core/core.h"
#include "outputs.h"
#include "tok/tok.h"

// args_parse takes flags only: positional arguments (the texts) are moved out first. A flag that
// takes a value and has no '=' keeps the next argument as its value; "--" ends the flags.
static void split_args(const arg_spec *specs, int nspec, int argc, char **argv, int first, char **flags, int *nflags,
                      char **pos, int *npos) {
    *nflags = 0, *npos = 0;
    for (int i = 0; i < first; i++) flags[(*nflags)++] = argv[i];
    int only_pos = 0;
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (only_pos || (strncmp(a, "--", 2) && strcmp(a, "-h"))) {
            pos[(*npos)++] = argv[i];
            continue;
        }
        if (!strcmp(a, "--")) {
            only_pos = 1;
            continue;
        }
        flags[(*nflags)++] = argv[i];
        const char *name = a + 2;
        if (!strcmp(a, "-h") || strchr(name, '=')) continue;
        for (int k = 0; k < nspec; k++)
            if (!strcmp(specs[k].name, name) && specs[k].kind != ARG_FLAG && i + 1 < argc) {
                flags[(*nflags)++] = argv[++i];
                break;
            }
    }
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcasecmp(s + n - k, suffix);
}

int cli_load_tokenizer(const char *path, vlmoe_tokenizer **out) {
    if (ends_with(path, ".model")) return vlmoe_tokenizer_load_sentencepiece(out, path);
    return ends_with(path, ".json") ? vlmoe_tokenizer_load_hf(out, path) : vlmoe_tokenizer_load_clip(out, path);
}

static const char *NEED_VOCAB =
    "a vocabulary file is needed: --tokenizer FILE with OpenAI CLIP's merges file "
    "(bpe_simple_vocab_16e6.txt or .txt.gz), an HF tokenizer.json of a CLIP model, a SentencePiece .model "
    "(SigLIP, T5, LIMoE), or merges made by "
    "`vlmoe tokenizer train`; vlmoe ships none and downloads nothing";

static const char *TOKENIZE_USAGE =
    "usage: vlmoe tokenize --tokenizer FILE [--context-length N] [--padded] TEXT...\n\n"
    "Prints, for each TEXT, the token ids CLIP's tokenizer gives it ([SOT] ids [EOT], truncated with EOT\n"
    "kept last) and the vocabulary piece of each id. FILE: a CLIP merges file (.txt or .txt.gz) or an HF\n"
    "tokenizer.json (.json), or a SentencePiece model (.model: [BOS] ids [EOS] as the model defines them).\n\n"
    "examples:\n"
    "  vlmoe tokenize --tokenizer bpe_simple_vocab_16e6.txt.gz \"a photo of a cat\"\n"
    "  vlmoe tokenize --tokenizer tokenizer.json --context-length 16 \"Don't panic!\" \"two dogs\"";

int cmd_tokenize(int argc, char **argv) {
    const char *path = NULL;
    int ctx = 77, padded = 0;
    const arg_spec specs[] = {
        {"tokenizer", ARG_STRING, &path, "FILE", "vocabulary: CLIP merges .txt/.txt.gz, HF tokenizer.json or SentencePiece .model"},
        {"context-length", ARG_INT, &ctx, "N", "ids per text, SOT and EOT included (default 77; LIMoE: 16)"},
        {"padded", ARG_FLAG, &padded, NULL, "print all N ids, padding (0) included"},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    char **flags = malloc(sizeof(char *) * (size_t)(argc + 1)), **texts = malloc(sizeof(char *) * (size_t)(argc + 1));
    if (!flags || !texts) return free(flags), free(texts), cli_error("tokenize", "out of memory");
    int nflags, ntexts;
    split_args(specs, nspec, argc, argv, 2, flags, &nflags, texts, &ntexts);
    int r = args_parse("tokenize", specs, nspec, nflags, flags, 2, TOKENIZE_USAGE);
    free(flags);
    if (r) return free(texts), r == 1 ? 0 : 2;
    if (!path) return free(texts), cli_error("tokenize", "%s", NEED_VOCAB);
    if (!ntexts) return free(texts), cli_error("tokenize", "no text given (see vlmoe tokenize --help)");
    if (ctx < 2 || ctx > (1 << 20)) return free(texts), cli_error("tokenize", "--context-length %d: must be in [2, 1048576]", ctx);

    vlmoe_tokenizer *tok = NULL;
    int st = cli_load_tokenizer(path, &tok);
    if (st) return free(texts), cli_error("tokenize", "%s", vlmoe_last_error());
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx);
    if (!ids) st = cli_error("tokenize", "out of memory");
    for (int t = 0; t < ntexts && !st; t++) {
        int len;
        if (vlmoe_tokenizer_encode(tok, texts[t], ids, ctx, &len)) {
            st = cli_error("tokenize", "%s", vlmoe_last_error());
            break;
        }
        int shown = padded ? ctx : len;
        if (t) putchar('\n');
        printf("text:   %s\nids:   ", texts[t]);
        for (int i = 0; i < shown; i++) printf(" %d", (int)ids[i]);
        printf("   (%d tokens, 0-padded to %d)\npieces:", len, ctx);
        for (int i = 0; i < len; i++) printf(" %s", vlmoe_tokenizer_piece(tok, ids[i]));
        putchar('\n');
    }
    free(ids), free(texts);
    vlmoe_tokenizer_free(tok);
    return st;
}

int cli_read_lines_numbered(const char *cmd, const char *path, char ***out, long **lineno, size_t *n) {
    const char *why = NULL; // a FIFO or a device would block or never end: regular files only
    FILE *f = vlmoe_fopen_regular(path, &why);
    if (!f) return cli_error(cmd, "%s: %s", path, why);
    char *line = NULL, **v = NULL;
    long *num = NULL, at = 0;
    size_t cap = 0, nv = 0, capv = 0;
    ssize_t len;
    int st = 0;
    while (!st && (len = getline(&line, &cap, f)) >= 0) {
        at++;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (!len) continue;
        if (nv == capv) {
            capv = capv ? 2 * capv : 1024;
            char **nvv = realloc(v, sizeof(char *) * capv);
            long *nnum = nvv && lineno ? realloc(num, sizeof(long) * capv) : NULL;
            if (nvv) v = nvv;
            if (nnum) num = nnum;
            if (!nvv || (lineno && !nnum)) {
                st = cli_error(cmd, "out of memory reading %s", path);
                break;
            }
        }
        if (!(v[nv] = strdup(line))) {
            st = cli_error(cmd, "out of memory reading %s", path);
        } else {
            if (lineno) num[nv] = at;
            nv++;
        }
    }
    if (!st && ferror(f)) st = cli_error(cmd, "%s: read error", path);
    free(line);
    fclose(f);
    if (st) {
        cli_free_lines(v, nv);
        free(num);
        return st;
    }
    *out = v, *n = nv;
    if (lineno) *lineno = num;
    return 0;
}

int cli_read_lines(const char *cmd, const char *path, char ***out, size_t *n) {
    return cli_read_lines_numbered(cmd, path, out, NULL, n);
}

void cli_free_lines(char **v, size_t n) {
    for (size_t i = 0; i < n; i++) free(v[i]);
    free(v);
}

static const char *TOKENIZER_USAGE =
    "usage: vlmoe tokenizer train --captions FILE --vocab-size N -o MERGES.txt\n\n"
    "Learns a byte-level BPE vocabulary from captions (one per line) with CLIP's preprocessing and\n"
    "pre-tokenization, and writes it in CLIP's merges format (usable as vlmoe tokenize --tokenizer).\n"
    "The vocabulary holds 512 byte symbols, N-514 merges and <|startoftext|> <|endoftext|>; training stops\n"
    "early when no pair of symbols is left.\n\n"
    "examples:\n"
    "  vlmoe tokenizer train --captions captions.txt --vocab-size 8192 -o merges.txt";

int cmd_tokenizer(int argc, char **argv) {
    if (argc < 3 || !strcmp(argv[2], "-h") || !strcmp(argv[2], "--help")) {
        fprintf(argc < 3 ? stderr : stdout, "%s\n", TOKENIZER_USAGE);
        return argc < 3 ? 2 : 0;
    }
    if (strcmp(argv[2], "train"))
        return cli_error("tokenizer", "unknown action '%s' (expected: train; see vlmoe tokenizer --help)", argv[2]);
    const char *captions = NULL, *output = NULL;
    int vocab = 0;
    const arg_spec specs[] = {
        {"captions", ARG_STRING, &captions, "FILE", "training captions, one per line"},
        {"vocab-size", ARG_INT, &vocab, "N", "vocabulary size, 514..49408 (CLIP: 49408)"},
        {"output", ARG_STRING, &output, "FILE", "merges file to write (also -o FILE)"},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    char **args = malloc(sizeof(char *) * (size_t)(argc + 1));
    if (!args) return cli_error("tokenizer train", "out of memory");
    for (int i = 0; i < argc; i++) args[i] = !strcmp(argv[i], "-o") && i >= 3 ? "--output" : argv[i];
    int r = args_parse("tokenizer train", specs, nspec, argc, args, 3, TOKENIZER_USAGE);
    free(args);
    if (r) return r == 1 ? 0 : 2;
    if (!captions || !output || !vocab)
        return cli_error("tokenizer train", "--captions, --vocab-size and -o are required (see vlmoe tokenizer --help)");
    if (vocab < 514 || vocab > 49408) return cli_error("tokenizer train", "--vocab-size %d: must be in [514, 49408]", vocab);
    const cli_input in[] = {{"--captions", captions}};
    if (cli_check_output("tokenizer train", "-o", output, in, 1)) return 1;

    char **texts = NULL;
    size_t n = 0;
    if (cli_read_lines("tokenizer train", captions, &texts, &n)) return 1;
    vlmoe_tokenizer *tok = NULL;
    int st = 0;
    if (vlmoe_tokenizer_train(&tok, (const char *const *)texts, n, vocab) || vlmoe_tokenizer_save_clip(tok, output))
        st = cli_error("tokenizer train", "%s", vlmoe_last_error());
    else
        printf("vlmoe tokenizer train: %zu captions -> %d merges, vocabulary of %d%s -> %s\n", n,
               vlmoe_tokenizer_num_merges(tok), vlmoe_tokenizer_vocab_size(tok),
               vlmoe_tokenizer_vocab_size(tok) < vocab ? " (no pairs left)" : "", output);
    cli_free_lines(texts, n);
    vlmoe_tokenizer_free(tok);
    return st;
}
