// synth_export.h: the built-in synthetic data (src/data/synthetic.c) written as ordinary files, so
// the file-based data paths (the threaded loader, eval --val-data and --zeroshot-data, finetune)
// can be tried on data known to be learnable. Implemented in src/data/synth_export.c; `vlmoe synth
// export` (cli/synth.c) is its command. Covered by tests/test_synth_export.c.
//
// Layout of dir (every path in a file is relative to dir, the folder of the file naming it):
//   classes/<colour>_<shape>/NNNNNN.png  the images, NNNNNN = the sample's index in its split; one
//                                        folder per class present, so dir/classes is an image folder
//                                        (`vlmoe eval --zeroshot-data`, `vlmoe finetune --task image-cls`)
//                                        with no second copy of the images
//   captions.csv                         OpenCLIP CSV, header filepath<SEP>title, one row per sample
//   texts.txt                            the captions, one per line, in sample order
//   match.tsv                            image<TAB>caption<TAB>yes|no (`vlmoe finetune --task pair-cls`)
// The PNGs are the synthetic [-1, 1] images mapped to 8-bit RGB: v = round((x + 1) * 127.5), so
// (v / 255 - 0.5) / 0.5 gives x back within 1/255. The captions tokenize to the same ids as the
// built-in stream (vlmoe_synth_tokenize), which models with a small vocabulary use for files too.
#ifndef VLMOE_DATA_SYNTH_EXPORT_H
#define VLMOE_DATA_SYNTH_EXPORT_H

#include <stdint.h>

#include "vlmoe.h"

enum { VLMOE_SYNTH_EXPORT_MAX_N = 10000000 };
#define VLMOE_SYNTH_EXPORT_MAX_FIRST 1000000000000L // far beyond any export, and first + n fits a long

typedef struct {
    const char *dir;        // created with its parents; must be empty unless overwrite
    int split;              // VLMOE_SPLIT_TRAIN or VLMOE_SPLIT_HELDOUT
    uint64_t first;         // index of the first sample in its split (<= VLMOE_SYNTH_EXPORT_MAX_FIRST)
    long n;                 // samples, 1..VLMOE_SYNTH_EXPORT_MAX_N
    char sep;               // captions.csv's field separator: not a quote or a line end
    uint64_t seed;          // of match.tsv's pairs
    int overwrite;          // dir may hold an earlier export (and nothing else), which is removed first
    // progress (may be NULL): samples written so far, of n
    void (*progress)(void *user, long done, long total);
    void *progress_user;
} vlmoe_synth_export_params;

// The folder checks, before anything is written: creates dir (mkdir -p); an existing one must be
// empty or, with overwrite, hold nothing but an earlier export (classes/<folder>/NNNNNN.png and
// the three files), which is then removed; a file is created and removed to see that dir takes
// writes. Errors are VLMOE_ERR_IO: "DIR: cannot create the folder: why", "DIR: cannot write into
// the folder: why", or, with nothing removed, "DIR: holds ENTRY, ..." with ENTRY (relative to dir,
// e.g. "notes.txt" or "classes/red_circle/x.jpg") also in foreign (cap bytes; 640 hold any).
int vlmoe_synth_export_prepare(const char *dir, int overwrite, char *foreign, size_t cap);

typedef struct {
    int classes;            // class folders written
    long n_yes;             // match.tsv rows answering "yes" (the others: "no")
    int one_class;          // set when all n > 1 samples were of one class: no "no" row can be
                            // drawn, and match.tsv is not written (the status is VLMOE_ERR_ARG)
} vlmoe_synth_export_result;

// Writes samples first .. first+n-1 of s's split (images of s's size) into p->dir, which
// vlmoe_synth_export_prepare has made ready. Images are generated and encoded in parallel; every
// file depends only on (s's seed, split, index, p->seed), never on the thread count. Errors name
// the file and the reason; the lowest failing sample of a block names an image error.
int vlmoe_synth_export(const vlmoe_synth *s, const vlmoe_synth_export_params *p, vlmoe_synth_export_result *r);

#endif
