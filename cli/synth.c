// synth.c: `vlmoe synth export`: flags, printing and exit codes over src/data/synth_export.c,
// which writes samples of the built-in synthetic data (src/data/synthetic.c) as ordinary files:
// PNG images in class folders, captions.csv, texts.txt and match.tsv (layout in
// src/data/synth_export.h). Test: tests/test_synth_export.c.
#include <stdio.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "common.h"
#include "data/synth_export.h"

#define CMD "synth export"

static const char *USAGE =
    "usage: vlmoe synth export --out DIR [--n N] [--split train|val] [--image-size S] [--seed N]\n\n"
    "Writes N samples of the built-in synthetic data (coloured shapes with captions, the data\n"
    "`vlmoe train --dataset-type synthetic` draws on the fly) as ordinary files:\n"
    "  DIR/classes/<class>/NNNNNN.png  the images, one folder per (colour, shape) class: an image\n"
    "                                  folder for eval --zeroshot-data and finetune --task image-cls\n"
    "  DIR/captions.csv                OpenCLIP CSV, header filepath<TAB>title, paths relative to DIR:\n"
    "                                  for train --train-data and eval --val-data\n"
    "  DIR/texts.txt                   the captions, one per line (embed --texts)\n"
    "  DIR/match.tsv                   image<TAB>caption<TAB>yes|no: the image's own caption (yes) or one\n"
    "                                  of an image of another class (no), half each, drawn from --seed:\n"
    "                                  for finetune --task pair-cls\n"
    "NNNNNN is the sample's index in its split, the same sample the built-in data gives for\n"
    "--seed. --split val is the held-out stream (class-balanced: the class of sample i is i mod 20).\n"
    "Pixels are the synthetic [-1, 1] values as 8-bit RGB: mean and std 0.5 read them back, which a\n"
    "model trained on the synthetic data records (eval, classify, embed then need no flag); give\n"
    "--image-mean 0.5 --image-std 0.5 to train on them (the model then records it). DIR is created\n"
    "(with its parents) and must be empty unless --overwrite, which first removes the files of an\n"
    "earlier export there.\n\n"
    "examples:\n"
    "  vlmoe synth export --out shapes --n 5000\n"
    "  vlmoe synth export --out shapes_val --n 1000 --split val\n"
    "  vlmoe train --model limoe-tiny --train-data shapes/captions.csv --image-mean 0.5 --image-std 0.5\n"
    "  vlmoe eval --model M --val-data shapes_val/captions.csv --zeroshot-data shapes_val/classes\n"
    "  vlmoe finetune --model vlmoe.safetensors --task pair-cls --data shapes/match.tsv -o ft.safetensors";

static void on_progress(void *u, long done, long total) { cli_progress_show(u, done, total); }

static int synth_export(int argc, char **argv) {
    const char *out = NULL, *split = "train", *sep = "\t";
    int n = 1000, size = 32, overwrite = 0;
    long seed = 0, first = 0;
    const arg_spec specs[] = {
        {"out", ARG_STRING, &out, "DIR", "folder to write (created; must be empty unless --overwrite)"},
        {"n", ARG_INT1, &n, "N", "samples to write (1000)"},
        {"split", ARG_STRING, &split, "SPLIT", "train (the stream training draws from) or val (the held-out one) (train)"},
        {"first", ARG_LONG, &first, "I", "index of the first sample in its split (0): --first 5000 --n 1000 writes 5000..5999"},
        {"image-size", ARG_INT, &size, "S", "image side in pixels, 16..1024 (32, the tiny models' size)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the synthetic data (as `vlmoe train --seed`) and of match.tsv's pairs (0)"},
        {"csv-separator", ARG_STRING, &sep, "C", "captions.csv's field separator (tab, vlmoe's and OpenCLIP's default; "
                                                 "\\t for tab)"},
        {"overwrite", ARG_FLAG, &overwrite, NULL, "replace an earlier export in --out (its images and files)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    int rc = args_parse(CMD, specs, ns, argc, argv, 3, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (!out || !out[0]) return cli_error(CMD, "--out DIR is required (see vlmoe synth export --help)");
    if (n < 1 || n > VLMOE_SYNTH_EXPORT_MAX_N)
        return cli_error(CMD, "--n %d: expected 1..%d samples", n, VLMOE_SYNTH_EXPORT_MAX_N);
    if (first < 0 || first > VLMOE_SYNTH_EXPORT_MAX_FIRST)
        return cli_error(CMD, "--first %ld: expected an index in 0..%ld", first, VLMOE_SYNTH_EXPORT_MAX_FIRST);
    const int sp_id = !strcmp(split, "train") ? VLMOE_SPLIT_TRAIN : !strcmp(split, "val") ? VLMOE_SPLIT_HELDOUT : -1;
    if (sp_id < 0) return cli_error(CMD, "--split %s: expected train or val", split);
    if (!strcmp(sep, "\\t")) sep = "\t";
    if (strlen(sep) != 1 || strchr("\"\r\n", sep[0]))
        return cli_error(CMD, "--csv-separator '%s': expected one character other than a quote or a line end", sep);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = size;
    sp.seed = (uint64_t)seed;
    vlmoe_synth *s = NULL;
    if (vlmoe_synth_init(&s, &sp)) return cli_error(CMD, "--image-size %d: %s", size, vlmoe_last_error());
    vlmoe_synth_export_params ep = {
        .dir = out, .split = sp_id, .first = (uint64_t)first, .n = n, .sep = sep[0], .seed = (uint64_t)seed,
        .overwrite = overwrite, .progress = on_progress,
    };
    vlmoe_synth_export_result r = {0};
    char foreign[640];
    if (vlmoe_synth_export_prepare(out, overwrite, foreign, sizeof(foreign))) {
        if (foreign[0] && overwrite)
            rc = cli_error(CMD, "--out %s: %s is not a file of an export: --overwrite only replaces an earlier "
                           "export (nothing was removed)", out, foreign);
        else if (foreign[0])
            rc = cli_error(CMD, "--out %s: the folder is not empty (it holds %s): export into a new or empty folder, "
                           "or add --overwrite to replace an earlier export", out, foreign);
        else
            rc = cli_error(CMD, "--out %s", vlmoe_last_error());   // "DIR: cannot create the folder: why"
    } else {
        cli_progress pr = cli_progress_start("images");
        ep.progress_user = &pr;
        const int st = vlmoe_synth_export(s, &ep, &r);
        cli_progress_end(&pr);
        if (st && r.one_class)
            rc = cli_error(CMD, "%s (export more with --n, or use --split val, which cycles the classes)",
                           vlmoe_last_error());
        else if (st)
            rc = cli_error(CMD, "%s", vlmoe_last_error());
    }
    if (!rc) {
        const char *sname = sep[0] == '\t' ? "<TAB>" : sep[0] == ',' ? "," : sep;
        printf("exported %d %s samples (indices %ld..%ld, seed %ld, %dx%d) to %s:\n", n, split, first,
               first + n - 1, seed, size, size, out);
        printf("  classes/<class>/*.png  %d images in %d class folders   (eval --zeroshot-data %s/classes)\n", n,
               r.classes, out);
        printf("  captions.csv           %d rows filepath%stitle   (train --train-data, eval --val-data%s)\n", n, sname,
               sep[0] == '\t' ? "" : ": add --csv-separator");
        printf("  texts.txt              %d captions, one per line   (embed --texts)\n", n);
        printf("  match.tsv              %d image<TAB>caption<TAB>answer rows, %ld yes / %ld no   "
               "(finetune --task pair-cls)\n", n, r.n_yes, n - r.n_yes);
        printf("pixels are the synthetic [-1, 1] values as 8-bit RGB: give --image-mean 0.5 --image-std 0.5 to "
               "train on them (the model then records it for eval, classify and embed)\n");
    }
    vlmoe_synth_free(s);
    return rc;
}

int cmd_synth(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[2], "export")) return synth_export(argc, argv);
    if (argc >= 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
        printf("usage: vlmoe synth export --out DIR [options]   (vlmoe synth export --help)\n\n"
               "The built-in synthetic data as files.\n");
        return 0;
    }
    return cli_error("synth", "expected `vlmoe synth export ...` (see vlmoe synth export --help)");
}
