// prune_sweep.c: `vlmoe prune --sweep K1,K2,...`: zero-shot accuracy against the experts kept per
// MoE layer (LIMoE appendix E.4's pruning, router_pred and router_drop), one JSON line per point
// appended to RUN/prune_sweep.jsonl, which `vlmoe report` plots. Covered by tests/test_report.c.
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "common.h"
#include "data/readers.h"
#include "eval/run_eval.h"
#include "prune_sweep.h"

static const char *CMD = "prune";

int cli_sweep_list(const char *v, int E, int *keep, int *n) {
    *n = 0;
    for (const char *p = v; *p;) {
        char *end;
        errno = 0;
        const long k = strtol(p, &end, 10);
        if (end == p || errno || (*end && *end != ',') || k < 1 || k > E || *n == 64)
            return cli_error(CMD, "--sweep '%s': expected up to 64 comma-separated counts of experts kept, each in [1, %d] "
                             "(the experts of a layer), e.g. 1,2,4", v, E);
        for (int i = 0; i < *n; i++)
            if (keep[i] == k) return cli_error(CMD, "--sweep '%s': %ld is given twice", v, k);
        keep[(*n)++] = (int)k;
        p = *end ? end + 1 : end;
        if (*end && !*p) return cli_error(CMD, "--sweep '%s': ends with a comma", v);
    }
    if (!*n) return cli_error(CMD, "--sweep: empty; give counts of experts kept, e.g. 1,2,4");
    return 0;
}

void cli_sweep_default_out(const char *model, char *out, size_t cap) {
    // LOGS/NAME/checkpoints/step_N.safetensors -> LOGS/NAME/prune_sweep.jsonl, where vlmoe report
    // finds it; any other model file -> MODEL.prune_sweep.jsonl beside it
    char dir[1024], metrics[1100];
    snprintf(dir, sizeof dir, "%s", model);
    char *s = strrchr(dir, '/');
    if (s) *s = 0;
    else snprintf(dir, sizeof dir, ".");
    const char *base = strrchr(dir, '/');
    snprintf(metrics, sizeof metrics, "%.*s/metrics.jsonl", base ? (int)(base - dir) : 1, base ? dir : ".");
    struct stat sb;
    if (!strcmp(base ? base + 1 : dir, "checkpoints") && !stat(metrics, &sb)) {
        snprintf(out, cap, "%.*s/prune_sweep.jsonl", base ? (int)(base - dir) : 1, base ? dir : ".");
        return;
    }
    const size_t k = strlen(model);
    const int ext = k > 12 && !strcmp(model + k - 12, ".safetensors");
    snprintf(out, cap, "%.*s.prune_sweep.jsonl", (int)(ext ? k - 12 : k), model);
}

// An existing output must be a sweep file already (its lines are appended to, never rewritten):
// a file of the user's that is anything else is refused.
static int check_existing(const char *out) {
    FILE *f = fopen(out, "r");
    if (!f) return errno == ENOENT ? 0 : cli_error(CMD, "-o %s: %s", out, strerror(errno));
    char line[4096];
    const int empty = !fgets(line, sizeof line, f);
    fclose(f);
    if (empty) return 0;
    cJSON *j = cJSON_Parse(line);
    const cJSON *k = cJSON_GetObjectItemCaseSensitive(j, "kind");
    const int ours = cJSON_IsString(k) && !strcmp(k->valuestring, "prune_sweep");
    cJSON_Delete(j);
    return ours ? 0 : cli_error(CMD, "-o %s: the file exists and is not a pruning sweep (JSON lines of vlmoe prune "
                                "--sweep); it is left as it is: name another file", out);
}

// Zero-shot of model m on what p names: the synthetic held-out split or an image folder.
typedef struct {
    vlmoe_synth *synth;
    cli_text text;
    vlmoe_image_params ip;
    vlmoe_image_folder folder;
    int has_folder;
} sweep_data;

static int zeroshot(vlmoe_model *m, sweep_data *d, const prune_sweep_params *p, vlmoe_eval_zeroshot *z) {
    vlmoe_eval_params ep = vlmoe_eval_default_params();
    ep.batch_size = p->batch, ep.shots = 0, ep.ip = &d->ip, ep.tokenize = cli_tokenize, ep.tokenize_user = &d->text;
    if (!p->zeroshot) {
        vlmoe_eval_synth_result r;
        if (vlmoe_eval_synthetic(m, d->synth, p->samples, &ep, &r)) return cli_error(CMD, "%s", vlmoe_last_error());
        *z = r.zeroshot;
        return 0;
    }
    const vlmoe_eval_folder_data fd = {.folder = &d->folder, .name = p->zeroshot,
                                       .classes = (const char *const *)d->folder.class_names,
                                       .templates = cli_templates, .n_templates = CLI_NUM_TEMPLATES};
    vlmoe_eval_folder_result r = {0};
    const int st = vlmoe_eval_folder_zeroshot(m, &fd, &ep, &r);
    if (!st) *z = r.zeroshot;
    vlmoe_eval_folder_result_free(&r);
    return st ? cli_error(CMD, "--zeroshot-data %s", vlmoe_last_error()) : 0;
}

// One record: the point (mode, experts kept) and its zero-shot numbers, appended and flushed.
static int record(FILE *f, const prune_sweep_params *p, const char *mode, int kept, int E, const vlmoe_eval_zeroshot *z) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "kind", "prune_sweep");
    cJSON_AddStringToObject(o, "model", p->model);
    cJSON_AddStringToObject(o, "modality", p->mod == VLMOE_MOD_TEXT ? "text" : "image");
    cJSON_AddStringToObject(o, "mode", mode);
    cJSON_AddNumberToObject(o, "kept", kept);
    cJSON_AddNumberToObject(o, "experts", E);
    cJSON_AddStringToObject(o, "shares", p->shares);
    cJSON_AddItemToObject(o, "zeroshot", vlmoe_eval_zeroshot_json(z, p->zeroshot));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    const int bad = !s || fprintf(f, "%s\n", s) < 0 || fflush(f);
    free(s);
    if (bad) return cli_error(CMD, "-o %s: cannot write: %s", p->out, strerror(errno));
    printf("%-12s %2d of %d experts kept: zero-shot top-1 %.1f%%  top-5 %.1f%%\n", mode, kept, E, 100 * z->top1,
           100 * z->top5);
    fflush(stdout);
    return 0;
}

int cli_prune_sweep(vlmoe_model *m, const double *usage, int E, const prune_sweep_params *p) {
    if (check_existing(p->out)) return 1;
    sweep_data d;
    memset(&d, 0, sizeof d);
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int rc = cli_model_image_params(CMD, NULL, NULL, 0, m, p->model, &d.ip);
    if (!rc && !p->zeroshot) {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        if (vlmoe_synth_init(&d.synth, &sp)) rc = cli_error(CMD, "%s", vlmoe_last_error());
    }
    if (!rc && p->zeroshot) {
        if (vlmoe_image_folder_load(p->zeroshot, &d.folder)) rc = cli_error(CMD, "--zeroshot-data: %s", vlmoe_last_error());
        else d.has_folder = 1;
        if (!rc) rc = cli_model_text(CMD, NULL, 0, m, p->model, 1, &d.text);
    }
    FILE *f = rc ? NULL : fopen(p->out, "a");
    if (!rc && !f) rc = cli_error(CMD, "-o %s: cannot open: %s", p->out, strerror(errno));
    vlmoe_eval_zeroshot z;
    // the unpruned model: the point every curve reaches at all experts kept
    if (!rc && !(rc = zeroshot(m, &d, p, &z))) rc = record(f, p, "unpruned", E, E, &z);
    for (int i = 0; !rc && i < p->nmodes; i++)
        for (int k = 0; !rc && k < p->nkeep; k++) {
            vlmoe_model *q = NULL;
            if (vlmoe_model_prune(&q, m, p->mod, usage, p->keep[k], (vlmoe_prune_mode)p->modes[i]))
                rc = cli_error(CMD, "%s: %s", p->model, vlmoe_last_error());
            if (!rc && !(rc = zeroshot(q, &d, p, &z)))
                rc = record(f, p, p->modes[i] == VLMOE_PRUNE_ROUTER_DROP ? "router_drop" : "router_pred", p->keep[k],
                            E, &z);
            vlmoe_model_free(q);
        }
    if (f && fclose(f) && !rc) rc = cli_error(CMD, "-o %s: cannot write: %s", p->out, strerror(errno));
    const size_t n = strlen(p->out), k = strlen("prune_sweep.jsonl");
    const int run = n >= k && !strcmp(p->out + n - k, "prune_sweep.jsonl") && (n == k || p->out[n - k - 1] == '/');
    if (!rc) printf("pruning sweep appended to %s%s\n", p->out,
                    run ? " (vlmoe report of its folder plots it)" : "");
    if (d.has_folder) vlmoe_image_folder_free(&d.folder);
    vlmoe_synth_free(d.synth);
    cli_text_free(&d.text);
    return rc;
}
