// caption.c: `vlmoe caption`: captions images with a VL-MoE model fine-tuned for captioning
// (`vlmoe finetune --task caption`), greedily as BEiT-3 decodes (src/nn/mome_caption.c); on
// image-caption pairs (--data) it also scores them with CIDEr-D against every caption of each image
// (src/eval/caption_eval.c), which `vlmoe eval --caption-data` reports too (cli_caption_eval).
// Flags, printing and exit codes only. Covered by tests/test_caption.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "caption.h"
#include "cli.h"
#include "common.h"
#include "outputs.h"

#define CMD "caption"

int cli_caption_eval(const char *cmd, vlmoe_model *m, const vlmoe_dataset_params *dp, const vlmoe_eval_params *p,
                     cli_text *text, int max_len, vlmoe_eval_captions *r) {
    vlmoe_dataset *ds = NULL;
    memset(r, 0, sizeof(*r));
    if (vlmoe_dataset_open(dp, &ds)) return cli_error(cmd, "%s", vlmoe_last_error());
    vlmoe_caption_params cp = cli_caption_params(text);
    cp.max_len = max_len;
    const int st = vlmoe_eval_captions_run(m, ds, dp->path, p, &cp, cli_detokenize, text, r);
    if (p->progress) cli_progress_end(p->progress_user);
    const int rc = st ? cli_error(cmd, "%s", vlmoe_last_error()) : 0;
    const vlmoe_dataset_stats *dst = vlmoe_dataset_get_stats(ds);
    if (vlmoe_dataset_stats_bad(dst)) {
        char sum[2048];
        vlmoe_dataset_stats_format(dst, sum, sizeof(sum));
        fprintf(stderr, "vlmoe %s: warning: %s: %s\n", cmd, dp->path, sum);
    }
    cli_bad_warn(cmd, &r->bad, "undecodable image", dp->path);
    vlmoe_dataset_free(ds);
    return rc;
}

// --images: every image file named (folders searched), captioned in batches of 64.
static int caption_files(vlmoe_model *m, const vlmoe_image_params *ip, cli_text *text, int max_len, char **args,
                         int nargs, FILE *out) {
    char **paths = NULL;
    int n = 0;
    if (vlmoe_list_images((const char *const *)args, nargs, &paths, &n)) return cli_error(CMD, "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size, T = (size_t)c->context_length;
    enum { CHUNK = 64 };
    float *img = malloc(sizeof(float) * isz * CHUNK);
    int32_t *tok = malloc(sizeof(int32_t) * T * CHUNK), len[CHUNK];
    char *line = malloc(64 * T + 64);
    int rc = img && tok && line ? 0 : cli_error(CMD, "out of memory");
    vlmoe_caption_params cp = cli_caption_params(text);
    cp.max_len = max_len;
    for (int i0 = 0; !rc && i0 < n; i0 += CHUNK) {
        const int k = n - i0 < CHUNK ? n - i0 : CHUNK;
        for (int j = 0; !rc && j < k; j++) {
            vlmoe_image im = {.max_pixels = (size_t)ip->max_pixels};
            if (vlmoe_image_load(paths[i0 + j], &im) || vlmoe_image_preprocess_eval(&im, ip, img + isz * (size_t)j))
                rc = cli_error(CMD, "%s", vlmoe_last_error());
            vlmoe_image_free(&im);
        }
        if (!rc && vlmoe_mome_caption(m, img, k, &cp, tok, len)) rc = cli_error(CMD, "%s", vlmoe_last_error());
        for (int j = 0; !rc && j < k; j++) {
            if (cli_detokenize(text, tok + T * (size_t)j, len[j], line, 64 * T + 64))
                rc = cli_error(CMD, "%s", vlmoe_last_error());
            else if (fprintf(out, "%s\t%s\n", paths[i0 + j], line) < 0) rc = cli_error(CMD, "cannot write the captions");
        }
    }
    vlmoe_free_strings(paths, n);
    free(img), free(tok), free(line);
    return rc;
}

// The flags of one run.
typedef struct {
    const char *model, *data, *output, *tokenizer, *norm[2];
    int max_len, override;
    long limit;
    vlmoe_dataset_params dp;
    char **files;
    int nfiles;
} caption_args;

static int run(caption_args *a) {
    if (!a->model) return cli_error(CMD, "--model is required (see vlmoe caption --help)");
    if (!a->data == !a->nfiles)
        return cli_error(CMD, "give --data PAIRS (captions to score against) or image files and folders, not %s",
                         a->data ? "both" : "neither");
    if (a->max_len < 0 || a->limit < 0) return cli_error(CMD, "--max-len and --num-samples must be >= 0 (0: the default)");
    const cli_input in[] = {{"--model", a->model}, {"--data", a->data}, {"--tokenizer", a->tokenizer}};
    if (a->output && cli_check_output(CMD, "-o", a->output, in, 3)) return 1;
    vlmoe_model *m = NULL;
    if (vlmoe_model_load(&m, a->model)) return cli_error(CMD, "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    cli_text text = {0};
    vlmoe_image_params ip;
    int rc = 0;
    if (c->arch != VLMOE_ARCH_MOME) rc = cli_error(CMD, "%s: model '%s' is not a VL-MoE (arch mome) model", a->model, c->name);
    if (!rc && a->max_len > c->context_length)
        rc = cli_error(CMD, "--max-len %d: the model's context holds %d tokens", a->max_len, c->context_length);
    if (!rc) rc = cli_model_image_params(CMD, a->norm[0], a->norm[1], a->override, m, a->model, &ip);
    if (!rc) rc = cli_model_text(CMD, a->tokenizer, a->override, m, a->model, 1, &text);
    FILE *out = stdout;
    int created = 0; // only a file this run created is removed on failure
    if (!rc && a->output) {
        if ((out = fopen(a->output, "wx"))) created = 1;
        else rc = cli_error(CMD, "-o %s: cannot create it (it exists, or its folder is missing): vlmoe does not "
                            "overwrite files", a->output);
    }
    if (!rc && a->nfiles) rc = caption_files(m, &ip, &text, a->max_len, a->files, a->nfiles, out);
    if (!rc && a->data) {
        vlmoe_eval_params p = vlmoe_eval_default_params();
        p.ip = &ip, p.max_pairs = a->limit;
        vlmoe_eval_captions r;
        rc = cli_caption_eval(CMD, m, &a->dp, &p, &text, a->max_len, &r);
        for (int i = 0; !rc && i < r.images; i++)
            if (fprintf(out, "%s\t%s\n", r.keys[i], r.captions[i]) < 0) rc = cli_error(CMD, "cannot write the captions");
        if (!rc) // the score goes beside the captions: stdout when they go to a file
            fprintf(created ? stdout : stderr, "CIDEr-D %.4f on %s (%d images, %d reference captions; greedy "
                    "decoding)\n", r.cider, a->data, r.images, r.references);
        vlmoe_eval_captions_free(&r);
    }
    if (created && fclose(out) && !rc) rc = cli_error(CMD, "-o %s: cannot write it", a->output);
    if (created && rc) remove(a->output);
    cli_text_free(&text);
    vlmoe_model_free(m);
    return rc;
}

int cmd_caption(int argc, char **argv) {
    caption_args a = {.dp = vlmoe_dataset_default_params()};
    const char *sep = "\t";
    long max_pixels = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "FILE", "a VL-MoE model fine-tuned for captioning (finetune --task caption)"},
        {"data", ARG_STRING, &a.data, "PATH", "image-caption pairs (OpenCLIP CSV/TSV or webdataset shards): caption "
                                              "each distinct image and report CIDEr-D against its captions"},
        {"output", ARG_STRING, &a.output, "FILE", "write image<TAB>caption lines here (also -o; default stdout); must "
                                                  "not exist"},
        {"max-len", ARG_INT, &a.max_len, "N", "tokens of a caption with its start and end (default the context length)"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "BPE tokenizer of the model (default: what the model records)"},
        {"image-mean", ARG_STRING, &a.norm[0], "R,G,B", "normalisation mean (default: what the model records)"},
        {"image-std", ARG_STRING, &a.norm[1], "R,G,B", "normalisation std (default: what the model records)"},
        {"override-inputs", ARG_FLAG, &a.override, NULL, CLI_OVERRIDE_HELP},
        {"csv-img-key", ARG_STRING, &a.dp.img_key, "NAME", "--data CSV: column of image paths (filepath)"},
        {"csv-caption-key", ARG_STRING, &a.dp.caption_key, "NAME", "--data CSV: column of captions (title)"},
        {"csv-separator", ARG_STRING, &sep, "C", "--data CSV: field separator (tab; \\t for tab)"},
        {"num-samples", ARG_LONG, &a.limit, "N", "--data: the first N rows (default: all)"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    const char *usage =
        "usage: vlmoe caption --model M.safetensors (--data PAIRS | IMAGE|DIR ...) [-o OUT.tsv]\n\n"
        "Captions images with a VL-MoE model fine-tuned by `vlmoe finetune --task caption`, as BEiT-3\n"
        "decodes: the caption so far with [MASK] appended, the image attended both ways and the text\n"
        "causally, the masked-LM head's most likely token at the [MASK] taken (greedy), until the end\n"
        "token or --max-len. Image files and folders are captioned one line each (path<TAB>caption).\n"
        "With --data, rows holding the same image are one image whose captions are all references\n"
        "(COCO: 5), and the CIDEr-D of the captions against them is reported (COCO's: n-grams 1-4,\n"
        "idf over the images' references, sigma 6, times 10; punctuation dropped instead of the PTB\n"
        "tokenizer). `vlmoe eval --caption-data` reports the same number.\n\n"
        "examples:\n"
        "  vlmoe caption --model cap.safetensors shapes_val/classes\n"
        "  vlmoe caption --model cap.safetensors --data shapes_val/captions.csv -o captions.tsv";
    a.files = malloc(sizeof(char *) * (size_t)(argc > 0 ? argc : 1));
    if (!a.files) return cli_error(CMD, "out of memory");
    int rc = args_parse_pos(CMD, specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, usage, a.files, argc,
                            &a.nfiles);
    if (!rc) cli_set_max_image_pixels(max_pixels);
    if (!rc && cli_separator(CMD, sep, &a.dp.separator)) rc = 3;
    a.dp.path = a.data;
    rc = rc == 1 ? 0 : rc == 2 ? 2 : rc == 3 ? 1 : run(&a);
    free(a.files);
    return rc;
}
