// soup.c: `vlmoe soup`: checkpoint souping (Wortsman et al. 2022; LIMoE-H/14 averages
// checkpoints of one run). Uniform: the mean of all ingredients. Greedy: ingredients sorted by
// held-out zero-shot top-1 on the synthetic data, each added if the soup does not get worse.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "common.h"
#include "nn/model.h"
#include "train/tasks.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe soup A.safetensors B.safetensors [...] -o OUT.safetensors [--greedy]\n\n"
    "Averages the weights of checkpoints of one model (same config). --greedy ranks them by\n"
    "held-out zero-shot top-1 on the synthetic data and keeps adding the next best while the\n"
    "soup does not get worse (greedy soup); otherwise all are averaged uniformly.";

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

int cmd_soup(int argc, char **argv) {
    const char *out = NULL;
    int greedy = 0, n = 500;
    const arg_spec specs[] = {
        {"output", ARG_STRING, &out, "FILE", "where the soup is written (also -o)"},
        {"greedy", ARG_FLAG, &greedy, NULL, "greedy soup by held-out zero-shot top-1"},
        {"eval-samples", ARG_INT, &n, "N", "held-out samples that score a greedy soup (default 500)"},
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
            if (nin < 256) inputs[nin++] = argv[i];
        } else if (nrest < 510) {
            rest[nrest++] = argv[i];
            // a flag with a separate value takes the next argument with it
            const int takes = strcmp(argv[i], "--greedy") && strcmp(argv[i], "--help") && strcmp(argv[i], "-h") &&
                              !strchr(argv[i], '=');
            if (takes && i + 1 < argc) rest[nrest++] = argv[++i];
        }
    }
    int rc = args_parse("soup", specs, 3, nrest, rest, 0, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (nin < 1 || !out) return cli_error("soup", "give checkpoints and -o OUT (see vlmoe soup --help)");
    vlmoe_model *ms[256];
    double sc[256];
    int order[256];
    for (int i = 0; i < nin; i++) {
        if (vlmoe_model_load(&ms[i], inputs[i])) {
            for (int k = 0; k < i; k++) vlmoe_model_free(ms[k]);
            return cli_error("soup", "%s", vlmoe_last_error());
        }
        order[i] = i;
        rc = same_inputs(model_get_inputs(ms[0]), model_get_inputs(ms[i])) ? 0 : cli_error("soup", "%s and %s record different tokenizers or image normalisations: a soup "
                                  "averages models fine-tuned from one start, which read their inputs alike", inputs[0],
                                  inputs[i]);
        if (!rc && greedy) rc = cli_synthetic_model("soup", ms[i], inputs[i], "no --greedy (a uniform soup): the greedy "
                                                    "soup scores on the synthetic data");
        if (rc) {
            for (int k = 0; k <= i; k++) vlmoe_model_free(ms[k]);
            return rc;
        }
        sc[i] = greedy ? score(ms[i], n) : 0;
        if (greedy) fprintf(stderr, "vlmoe soup: %s zero-shot top-1 %.2f%%\n", inputs[i], 100 * sc[i]);
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
    if (!rc && !greedy) {
        for (int i = 0; i < nin; i++) chosen[nch++] = ms[i];
        rc = vlmoe_model_average(soup, chosen, nch);
    } else if (!rc) {
        chosen[nch++] = ms[order[0]];
        double best = sc[order[0]];
        for (int i = 1; i < nin && !rc; i++) {
            chosen[nch++] = ms[order[i]];
            if ((rc = vlmoe_model_average(soup, chosen, nch))) break;
            double s = score(soup, n);
            if (s >= best) {
                best = s;
                fprintf(stderr, "vlmoe soup: + %s -> %.2f%%\n", inputs[order[i]], 100 * s);
            } else {
                nch--;
                fprintf(stderr, "vlmoe soup: - %s (soup would fall to %.2f%%)\n", inputs[order[i]], 100 * s);
            }
        }
        if (!rc) rc = vlmoe_model_average(soup, chosen, nch);
    }
    if (!rc) rc = vlmoe_model_save(soup, out);
    if (rc) cli_error("soup", "%s", vlmoe_last_error());
    else printf("soup of %d checkpoint%s written to %s\n", nch, nch > 1 ? "s" : "", out);
    vlmoe_model_free(soup);
    for (int i = 0; i < nin; i++) vlmoe_model_free(ms[i]);
    return rc ? 1 : 0;
}
