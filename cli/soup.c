// soup.c: `vlmoe soup`: checkpoint souping (Wortsman et al. 2022; LIMoE A.3 averages checkpoints
// of one run). Uniform: the mean of all ingredients. Greedy: ingredients ranked by zero-shot top-1
// (on the user's --zeroshot-data, or the synthetic held-out split for models of the synthetic
// data), each added if the soup does not get worse; --reuse: LIMoE-H/14's variant, where an
// ingredient may be added again (a weighted average). Covered by tests/test_cli.c and
// tests/test_own_data.c.
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "common.h"
#include "nn/model.h"
#include "tokenize.h"
#include "train/tasks.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe soup A.safetensors B.safetensors [...] -o OUT.safetensors [--greedy [--reuse]]\n\n"
    "Averages the weights of checkpoints of one model (same config). Without --greedy all are\n"
    "averaged uniformly. The zero-shot data that scores a greedy soup: --zeroshot-data DIR (an image\n"
    "folder, one sub-folder per class; --classnames FILE, one per line in sorted folder order;\n"
    "--zeroshot-templates FILE, default CLIP's smaller set of 8 prompts, as LIMoE's soup used), read\n"
    "with the tokenizer and normalisation the checkpoints carry, or for models of the synthetic data\n"
    "its held-out split (--eval-samples).";

static const char *EPILOGUE =
    "\nGreedy soup (Wortsman et al. 2022's GreedySoup): score every ingredient alone and rank them, best\n"
    "first (ties in command-line order); the soup starts as the best one; each next ingredient in\n"
    "rank order is added if the average with it scores at least as well as the soup, else left out.\n"
    "Each ingredient is tried once.\n\n"
    "--reuse (LIMoE A.3: \"greedily selected checkpoints to maximize zero-shot accuracy ... Checkpoints\n"
    "could be reused multiple times\"): the soup starts as the best ingredient; each round tries\n"
    "adding every ingredient, those already in the soup included, and keeps the one whose average\n"
    "scores best, if it scores strictly better than the soup; it stops when no addition helps or the\n"
    "soup holds --max-ingredients (default 16). An ingredient added k times weighs k times in the\n"
    "average. Every trial soup is scored on the same data, so the soup fits that data: keep a\n"
    "separate split to report on.\n";
// A folder to score greedy soups on, read as the models were trained (their recorded inputs).
typedef struct {
    vlmoe_image_folder folder;
    char **names;
    size_t n_names;
    vlmoe_image_params ip;
    cli_text text;
    vlmoe_eval_folder_data data;
    vlmoe_eval_params p;
    char **tpl;                  // --zeroshot-templates (NULL: CLIP's smaller set)
    size_t n_tpl;
} soup_folder;

static void folder_free(soup_folder *f) {
    vlmoe_image_folder_free(&f->folder);
    cli_free_lines(f->names, f->n_names);
    cli_free_lines(f->tpl, f->n_tpl);
    cli_text_free(&f->text);
}

// Opens DIR for model m (path: its file); the error is printed (exit status 1).
static int folder_open(soup_folder *f, const char *dir, const char *names, const char *templates, vlmoe_model *m,
                       const char *path) {
    memset(f, 0, sizeof(*f));
    if (templates && cli_read_texts("soup", "--zeroshot-templates", templates, NULL, 1, &f->tpl, &f->n_tpl)) return 1;
    if (vlmoe_image_folder_load(dir, &f->folder)) return cli_error("soup", "--zeroshot-data: %s", vlmoe_last_error());
    if (names && cli_read_lines("soup", names, &f->names, &f->n_names)) return 1;
    if (names && f->n_names != (size_t)f->folder.n_classes)
        return cli_error("soup", "--classnames %s has %zu names, %s has %d class folders", names, f->n_names, dir,
                         f->folder.n_classes);
    if (cli_model_image_params("soup", NULL, NULL, 0, m, path, &f->ip) || cli_model_text("soup", NULL, 0, m, path, 1, &f->text))
        return 1;
    f->data = (vlmoe_eval_folder_data){.folder = &f->folder, .name = dir,
                                       .templates = f->tpl ? (const char *const *)f->tpl : cli_templates,
                                       .n_templates = f->tpl ? (int)f->n_tpl : CLI_NUM_TEMPLATES,
                                       .classes = (const char *const *)(f->names ? f->names : f->folder.class_names)};
    f->p = vlmoe_eval_default_params();
    f->p.shots = 0, f->p.ip = &f->ip, f->p.tokenize = cli_tokenize, f->p.tokenize_user = &f->text;
    return 0;
}

// Zero-shot top-1 of m on the folder (-1 after an error, in vlmoe_last_error()).
static double score_folder(vlmoe_model *m, const soup_folder *f) {
    vlmoe_eval_folder_result r = {0};
    const int st = vlmoe_eval_folder_zeroshot(m, &f->data, &f->p, &r);
    const double top1 = st ? -1 : r.zeroshot.top1;
    vlmoe_eval_folder_result_free(&r);
    return top1;
}

static double score(vlmoe_model *m, int n) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c->image_size;
    vlmoe_synth *s;
    vlmoe_synth_eval ev;
    if (vlmoe_synth_init(&s, &sp)) return -1;
    int st = vlmoe_synth_evaluate(m, s, n, 64, &ev);
    vlmoe_synth_free(s);
    return st ? -1 : ev.top1;
}

// Whether two models read their inputs alike (the same recorded tokenizer and normalisation).
static int same_inputs(const model_inputs *a, const model_inputs *b) {
    if (a->text != b->text || a->has_norm != b->has_norm) return 0;
    if (a->text == MODEL_TEXT_BPE && strcmp(a->tokenizer, b->tokenizer)) return 0;
    return !a->has_norm || (!memcmp(a->mean, b->mean, sizeof(a->mean)) && !memcmp(a->std, b->std, sizeof(a->std)));
}

// The zero-shot top-1 of m on the folder f, or (f NULL) on n synthetic held-out samples; the
// error is in vlmoe_last_error().
static int rate(vlmoe_model *m, const soup_folder *f, int n, double *top1) {
    *top1 = f ? score_folder(m, f) : score(m, n);
    return *top1 < 0;
}

// Greedy soup into `soup` from ms ranked by `order` (scores sc); chosen gets the multiset of
// ingredients (each entry one share of the average), *nch its size. The progress goes to stderr.
typedef struct {
    vlmoe_model **ms;
    const char *const *inputs;
    const int *order;
    const double *sc;
    int n, reuse, max;
    const soup_folder *f;
    int eval_n;
} greedy_args;

static int greedy(const greedy_args *g, vlmoe_model *soup, vlmoe_model **chosen, int *nch) {
    int n = 0, rc = 0;
    chosen[n++] = g->ms[g->order[0]];
    double best = g->sc[g->order[0]];
    if (!g->reuse) {
        for (int i = 1; i < g->n; i++) {
            chosen[n++] = g->ms[g->order[i]];
            double s = 0;
            if ((rc = vlmoe_model_average(soup, chosen, n)) || (rc = rate(soup, g->f, g->eval_n, &s))) break;
            if (s >= best) {
                best = s;
                fprintf(stderr, "vlmoe soup: + %s -> %.2f%%\n", g->inputs[g->order[i]], 100 * s);
            } else {
                n--;
                fprintf(stderr, "vlmoe soup: - %s (soup would fall to %.2f%%)\n", g->inputs[g->order[i]], 100 * s);
            }
        }
    } else {
        while (n < g->max && !rc) {
            int pick = -1;
            double pick_s = best;
            for (int i = 0; i < g->n && !rc; i++) {
                chosen[n] = g->ms[g->order[i]];
                double s = 0;
                if ((rc = vlmoe_model_average(soup, chosen, n + 1)) || (rc = rate(soup, g->f, g->eval_n, &s))) break;
                if (s > pick_s) pick_s = s, pick = g->order[i];
            }
            if (rc) break;
            if (pick < 0) {
                fprintf(stderr, "vlmoe soup: no ingredient improves the soup of %d (%.2f%%): done\n", n, 100 * best);
                break;
            }
            chosen[n++] = g->ms[pick];
            best = pick_s;
            fprintf(stderr, "vlmoe soup: + %s -> %.2f%% (%d in the soup)\n", g->inputs[pick], 100 * best, n);
        }
    }
    *nch = n;
    if (!rc) rc = vlmoe_model_average(soup, chosen, n);
    return rc;
}

int cmd_soup(int argc, char **argv) {
    const char *out = NULL, *zs = NULL, *names = NULL, *templates = NULL;
    int greedy_on = 0, reuse = 0, max = -1, n = -1;
    long max_pixels = 0;
    const arg_spec specs[] = {
        {"output", ARG_STRING, &out, "FILE", "where the soup is written (also -o; not one of the checkpoints)"},
        {"greedy", ARG_FLAG, &greedy_on, NULL, "greedy soup by zero-shot top-1 (the algorithm is below)"},
        {"reuse", ARG_FLAG, &reuse, NULL, "with --greedy: an ingredient may be added again (LIMoE A.3)"},
        {"max-ingredients", ARG_INT, &max, "N", "with --reuse: at most N shares in the soup (default 16)"},
        {"zeroshot-data", ARG_STRING, &zs, "DIR", "image folder DIR/<class>/*.jpg that scores a greedy soup"},
        {"classnames", ARG_STRING, &names, "FILE", "class names of --zeroshot-data, one per line in sorted folder order"},
        {"zeroshot-templates", ARG_STRING, &templates, "FILE", "prompt templates for --zeroshot-data ({} or {c}: the "
                                                               "class), one per line or CLIP_benchmark JSON"},
        {"eval-samples", ARG_INT1, &n, "N", "synthetic held-out samples that score a greedy soup (default 500)"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    const char *inputs[256];
    int nin = 0;
    // positional checkpoints and -o are taken out before the flag parser sees the rest
    char *rest[512];
    int nrest = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc) {
            out = argv[++i];
        } else if (strncmp(argv[i], "--", 2) && strcmp(argv[i], "-h")) {
            if (nin == 256) return cli_error("soup", "more than 256 checkpoints");
            inputs[nin++] = argv[i];
        } else if (nrest < 510) {
            rest[nrest++] = argv[i];
            // a flag with a separate value takes the next argument with it
            const int takes = strcmp(argv[i], "--greedy") && strcmp(argv[i], "--reuse") && strcmp(argv[i], "--help") &&
                              strcmp(argv[i], "-h") && !strchr(argv[i], '=');
            if (takes && i + 1 < argc) rest[nrest++] = argv[++i];
        }
    }
    args_set_epilogue(EPILOGUE);
    int rc = args_parse("soup", specs, (int)(sizeof(specs) / sizeof(specs[0])), nrest, rest, 0, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    cli_set_max_image_pixels(max_pixels); // --zeroshot-data
    if (nin < 1 || !out) return cli_error("soup", "give checkpoints and -o OUT (see vlmoe soup --help)");
    for (int i = 0; i < nin; i++)
        if (cli_check_output("soup", "-o", out, &(cli_input){"the checkpoint", inputs[i]}, 1)) return 1;
    if (cli_check_output("soup", "-o", out, &(cli_input){"--classnames", names}, 1)) return 1;
    if (cli_check_output("soup", "-o", out, &(cli_input){"--zeroshot-templates", templates}, 1)) return 1;
    if (!greedy_on && (zs || names || templates || n >= 0 || reuse))
        return cli_error("soup", "--zeroshot-data, --classnames, --zeroshot-templates, --eval-samples and --reuse shape a "
                         "greedy soup: add --greedy");
    if (max >= 0 && !reuse) return cli_error("soup", "--max-ingredients applies to --reuse");
    if (reuse && max == -1) max = 16;
    if (reuse && (max < 1 || max > 256)) return cli_error("soup", "--max-ingredients %d: expected 1 to 256", max);
    if (zs && n >= 0) return cli_error("soup", "--eval-samples sizes the synthetic data's split; --zeroshot-data scores on "
                                       "its own images");
    if ((names || templates) && !zs) return cli_error("soup", "--%s applies to --zeroshot-data DIR",
                                                      names ? "classnames" : "zeroshot-templates");
    if (n > CLI_EVAL_SAMPLES_MAX) // held in memory at once: images, tokens, embeddings
        return cli_error("soup", "--eval-samples %d: at most %d held-out samples", n, CLI_EVAL_SAMPLES_MAX);
    if (n < 0) n = 500;
    soup_folder folder, *f = NULL;
    vlmoe_model *ms[256];
    double sc[256];
    int order[256];
    for (int i = 0; i < nin; i++) {
        if (vlmoe_model_load(&ms[i], inputs[i])) {
            for (int k = 0; k < i; k++) vlmoe_model_free(ms[k]);
            if (f) folder_free(f);
            return cli_error("soup", "%s", vlmoe_last_error());
        }
        order[i] = i;
        rc = same_inputs(model_get_inputs(ms[0]), model_get_inputs(ms[i])) ? 0 : cli_error("soup", "%s and %s record different tokenizers or image normalisations: a soup "
                                  "averages models fine-tuned from one start, which read their inputs alike", inputs[0],
                                  inputs[i]);
        if (!rc && greedy_on && !zs) rc = cli_synthetic_model("soup", ms[i], inputs[i], "--zeroshot-data DIR to score the "
                                                              "greedy soup on (or no --greedy: a uniform soup)");
        if (!rc && greedy_on && zs && !f) {
            rc = folder_open(&folder, zs, names, templates, ms[0], inputs[0]);
            f = &folder; // freed below either way
        }
        sc[i] = 0;
        if (!rc && greedy_on && rate(ms[i], f, n, &sc[i]))
            rc = cli_error("soup", "scoring %s: %s", inputs[i], vlmoe_last_error());
        if (rc) {
            for (int k = 0; k <= i; k++) vlmoe_model_free(ms[k]);
            if (f) folder_free(f);
            return rc;
        }
        if (greedy_on) fprintf(stderr, "vlmoe soup: %s zero-shot top-1 %.2f%%\n", inputs[i], 100 * sc[i]);
    }
    for (int i = 1; i < nin; i++) // best first; ties keep the command-line order
        for (int k = i; k > 0 && sc[order[k]] > sc[order[k - 1]]; k--) {
            int t = order[k];
            order[k] = order[k - 1], order[k - 1] = t;
        }
    vlmoe_model *soup;
    vlmoe_model *chosen[256];
    int nch = 0;
    rc = vlmoe_model_load(&soup, inputs[order[0]]);
    if (!rc && !greedy_on) {
        for (int i = 0; i < nin; i++) chosen[nch++] = ms[i];
        rc = vlmoe_model_average(soup, chosen, nch);
    } else if (!rc) {
        const greedy_args g = {ms, inputs, order, sc, nin, reuse, max, f, n};
        rc = greedy(&g, soup, chosen, &nch);
    }
    if (!rc) rc = vlmoe_model_save(soup, out);
    if (rc) {
        cli_error("soup", "%s", vlmoe_last_error());
    } else {
        printf("soup of %d checkpoint%s written to %s", nch, nch > 1 ? "s" : "", out);
        for (int i = 0, shown = 0; reuse && i < nin; i++) { // the shares of each ingredient
            int k = 0;
            for (int j = 0; j < nch; j++) k += chosen[j] == ms[i];
            if (k) printf("%s %s x%d", shown++ ? "," : ":", inputs[i], k);
        }
        printf("\n");
    }
    vlmoe_model_free(soup);
    for (int i = 0; i < nin; i++) vlmoe_model_free(ms[i]);
    if (f) folder_free(f);
    return rc ? 1 : 0;
}
