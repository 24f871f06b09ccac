// report.c: `vlmoe report LOGS/NAME` (the self-contained HTML page of a run, or its TensorBoard
// event files with --to tensorboard) and the pieces `vlmoe routes` and `vlmoe train
// --report-every / --report-to` share: examples to route, their routing maps, the page. The
// writers are in src/report/. Covered by tests/test_report.c and tests/test_routemap.c.
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "args.h"
#include "cli.h"
#include "data/image.h"
#include "data/readers.h"
#include "nn/model.h"
#include "report.h"
#include "train/run.h"

void cli_examples_free(cli_examples *ex) {
    if (!ex) return;
    for (int i = 0; ex->captions && i < ex->n; i++) free(ex->captions[i]);
    free(ex->captions), free(ex->images), free(ex->tokens), free(ex->lengths);
    cli_text_free(&ex->text);
    memset(ex, 0, sizeof(*ex));
}

static int tokenize_captions(const char *cmd, const vlmoe_model_config *c, cli_examples *ex) {
    ex->tokens = calloc((size_t)ex->n * c->context_length, sizeof(int32_t));
    ex->lengths = calloc((size_t)ex->n, sizeof(int32_t));
    if (!ex->tokens || !ex->lengths) return cli_error(cmd, "out of memory for %d captions", ex->n);
    for (int i = 0; i < ex->n; i++) {
        const int len = cli_tokenize(&ex->text, ex->captions[i], ex->tokens + (size_t)i * c->context_length, c->context_length);
        if (len < 2) return cli_error(cmd, "cannot tokenize caption \"%s\": %s", ex->captions[i], vlmoe_last_error());
        ex->lengths[i] = len;
    }
    return 0;
}

// An OpenCLIP CSV/TSV (tab-separated; columns filepath and title): its first n readable rows,
// images with the model's eval transform, captions with its tokenizer.
static int csv_examples(const char *cmd, const vlmoe_model *m, const char *mpath, const char *path, int n,
                        cli_examples *ex) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const size_t img = (size_t)3 * ex->S * ex->S;
    vlmoe_dataset_params dp = vlmoe_dataset_default_params();
    dp.type = VLMOE_DATASET_CSV, dp.path = path;
    vlmoe_image_params ip;
    vlmoe_dataset *ds = NULL;
    if (cli_model_image_params(cmd, NULL, NULL, 0, m, mpath, &ip) || cli_model_text(cmd, NULL, 0, m, mpath, 1, &ex->text))
        return 1;
    if (vlmoe_dataset_open(&dp, &ds)) return cli_error(cmd, "--examples: %s", vlmoe_last_error());
    ex->images = malloc(sizeof(float) * img * n);
    ex->captions = calloc((size_t)n, sizeof(char *));
    int rc = !ex->images || !ex->captions ? cli_error(cmd, "out of memory for %d examples", n) : 0;
    memcpy(ex->mean, ip.mean, sizeof ex->mean), memcpy(ex->std, ip.std, sizeof ex->std);
    vlmoe_sample s;
    int got;
    while (!rc && ex->n < n && (got = vlmoe_dataset_next(ds, &s)) != 0) {
        if (got < 0) {
            rc = cli_error(cmd, "--examples: %s", vlmoe_last_error());
            break;
        }
        vlmoe_image im = {0};
        // an undecodable image is skipped, as the training loader does
        if (!vlmoe_image_decode(s.image, s.image_len, s.key, &im) &&
            !vlmoe_image_preprocess_eval(&im, &ip, ex->images + img * ex->n)) {
            if (!(ex->captions[ex->n] = strdup(s.caption))) rc = cli_error(cmd, "out of memory");
            else ex->n++;
        }
        vlmoe_image_free(&im);
    }
    vlmoe_dataset_free(ds);
    if (!rc && ex->n == 0) rc = cli_error(cmd, "--examples %s: no readable image-caption row", path);
    if (!rc) snprintf(ex->from, sizeof ex->from, "the first %d readable rows of %s", ex->n, path);
    return rc ? rc : tokenize_captions(cmd, c, ex);
}

int cli_examples_load(const char *cmd, const vlmoe_model *m, const char *mpath, const char *examples, int n,
                      const char *text, cli_examples *ex, char *skip, size_t nskip) {
    memset(ex, 0, sizeof(*ex));
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (n < 1 || n > 64) return cli_error(cmd, "--num-examples: %d not in [1, 64]", n);
    ex->S = c->image_size;
    const size_t img = (size_t)3 * ex->S * ex->S;
    if (!examples) { // the synthetic held-out split: images in [-1, 1] and their captions
        if (model_get_inputs(m)->text == MODEL_TEXT_BPE) {
            if (skip) {
                snprintf(skip, nskip, "%s was trained on its own captions, not the synthetic data: give --examples "
                         "DIR (image files) to draw its routing", mpath);
                return 0;
            }
            return cli_synthetic_model(cmd, m, mpath, "--examples or --image");
        }
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        if (vlmoe_synth_init(&ex->text.synth, &sp)) return cli_error(cmd, "%s", vlmoe_last_error());
        ex->n = n;
        ex->images = malloc(sizeof(float) * img * n);
        ex->captions = calloc((size_t)n, sizeof(char *));
        if (!ex->images || !ex->captions) return cli_error(cmd, "out of memory for %d examples", n);
        for (int i = 0; i < n; i++) {
            char cap[512];
            int cls;
            if (vlmoe_synth_sample(ex->text.synth, VLMOE_SPLIT_HELDOUT, (uint64_t)i, ex->images + img * i, cap, sizeof cap,
                                   &cls) ||
                !(ex->captions[i] = strdup(text ? text : cap)))
                return cli_error(cmd, "synthetic sample %d: %s", i, vlmoe_last_error());
        }
        for (int k = 0; k < 3; k++) ex->mean[k] = 0.5f, ex->std[k] = 0.5f;
        snprintf(ex->from, sizeof ex->from, "the synthetic data's held-out split, samples 0..%d", n - 1);
        return tokenize_captions(cmd, c, ex);
    }
    const size_t L = strlen(examples);
    if (L > 4 && (!strcasecmp(examples + L - 4, ".csv") || !strcasecmp(examples + L - 4, ".tsv")))
        return csv_examples(cmd, m, mpath, examples, n, ex);
    // image files: a folder or a comma-separated list, with the model's eval transform
    char *list = strdup(examples);
    const char *args[64];
    int nargs = 0;
    for (char *save = NULL, *t = list ? strtok_r(list, ",", &save) : NULL; t && nargs < 64; t = strtok_r(NULL, ",", &save))
        args[nargs++] = t;
    char **paths = NULL;
    int np = 0;
    vlmoe_image_params ip;
    int rc = !list ? cli_error(cmd, "out of memory") : cli_list_images(cmd, args, nargs, &paths, &np);
    if (!rc) rc = cli_model_image_params(cmd, NULL, NULL, 0, m, mpath, &ip);
    if (!rc && text) rc = cli_model_text(cmd, NULL, 0, m, mpath, 1, &ex->text);
    if (!rc) {
        ex->n = np < n ? np : n;
        ex->images = malloc(sizeof(float) * img * ex->n);
        if (!ex->images) rc = cli_error(cmd, "out of memory for %d images", ex->n);
        memcpy(ex->mean, ip.mean, sizeof ex->mean), memcpy(ex->std, ip.std, sizeof ex->std);
    }
    for (int i = 0; !rc && i < ex->n; i++) {
        vlmoe_image im = {0};
        if (vlmoe_image_load(paths[i], &im) || vlmoe_image_preprocess_eval(&im, &ip, ex->images + img * i))
            rc = cli_error(cmd, "--examples: %s", vlmoe_last_error());
        vlmoe_image_free(&im);
    }
    if (!rc) snprintf(ex->from, sizeof ex->from, "%d image file%s of %s", ex->n, ex->n == 1 ? "" : "s", examples);
    if (!rc && text) {
        ex->captions = calloc((size_t)ex->n, sizeof(char *));
        for (int i = 0; ex->captions && i < ex->n; i++) ex->captions[i] = strdup(text);
        rc = ex->captions ? tokenize_captions(cmd, c, ex) : cli_error(cmd, "out of memory");
    }
    vlmoe_free_strings(paths, np);
    free(list);
    return rc;
}

int cli_examples_route(const char *cmd, vlmoe_model *m, const cli_examples *ex, report_routes *routes) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (c->arch == VLMOE_ARCH_MOME)
        return cli_error(cmd, "%s is a VL-MoE (arch mome) model: its routing maps are not drawn yet", c->name);
    if (vlmoe_model_plan(m, ex->n)) return cli_error(cmd, "%s", vlmoe_last_error());
    int st;
    if (ex->tokens) { // both modalities in one evaluation-mode forward (no noise, eval capacity)
        const vlmoe_batch b = {.batch_size = ex->n, .images = ex->images, .tokens = ex->tokens, .lengths = ex->lengths};
        vlmoe_step_stats s;
        st = vlmoe_model_evaluate(m, &b, &s);
    } else {
        float *emb = malloc(sizeof(float) * (size_t)ex->n * c->embed_dim);
        st = emb ? vlmoe_model_encode_images(m, ex->images, ex->n, emb) : vlmoe_fail(VLMOE_ERR_NOMEM, "embeddings");
        free(emb);
    }
    if (st) return cli_error(cmd, "routing the examples: %s", vlmoe_last_error());
    for (int i = 0; i < ex->n; i++)
        if (report_routes_from_model(m, i, &routes[i])) {
            for (int k = 0; k < i; k++) report_routes_free(&routes[k]);
            return cli_error(cmd, "%s", vlmoe_last_error());
        }
    return 0;
}

int cli_caption_words(const char *caption, cli_text *text, int ctx, const report_routes *r, char ***words_out,
                      int *nwords, int32_t **we_out) {
    *words_out = NULL, *nwords = 0, *we_out = NULL;
    char *copy = strdup(caption);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)ctx);
    char **words = calloc(strlen(caption) / 2 + 2, sizeof(char *));
    int *first = calloc(strlen(caption) / 2 + 2, sizeof(int)), n = 0, pos = 1; // position 0: SOT
    if (!copy || !ids || !words || !first) {
        free(copy), free(ids), free(words), free(first);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "caption words");
    }
    // each word alone: its tokens are the caption's at the same place (neither tokenizer merges
    // across spaces), so a word's first token sits after the tokens of the words before it
    for (char *save = NULL, *w = strtok_r(copy, " \t\n", &save); w; w = strtok_r(NULL, " \t\n", &save)) {
        const int len = cli_tokenize(text, w, ids, ctx);
        if (pos >= ctx - 1) break; // truncated away
        words[n] = strdup(w), first[n] = pos;
        if (!words[n]) break;
        n++;
        pos += len > 2 ? len - 2 : 0;
    }
    int32_t *we = malloc(sizeof(int32_t) * (size_t)(r->layers * (n ? n : 1)));
    for (int l = 0; we && l < r->layers; l++)
        for (int w = 0; w < n; w++) we[(size_t)l * n + w] = first[w] < r->ntext ? r->text_expert[(size_t)l * r->ntext + first[w]] : -1;
    free(copy), free(ids), free(first);
    *words_out = words, *nwords = n, *we_out = we;
    return we ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "caption words");
}

// A file at path that is not a report of ours is the user's: never overwritten.
static int ours_or_absent(const char *cmd, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char head[128] = {0};
    const size_t k = fread(head, 1, sizeof head - 1, f);
    fclose(f);
    static const char SIG[] = "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>vlmoe report: ";
    if (k >= sizeof SIG - 1 && !memcmp(head, SIG, sizeof SIG - 1)) return 0;
    return cli_error(cmd, "-o %s: the file exists and is not a vlmoe report; choose another -o or move it away", path);
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *t = NULL;
    size_t n = 0;
    FILE *o = open_memstream(&t, &n);
    char buf[4096];
    size_t k;
    while (o && (k = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, k, o);
    if (o) fclose(o);
    fclose(f);
    return t;
}

int cli_report_write(const char *cmd, const cli_report_opts *o) {
    char path[1200], ck[1200], out[1200];
    struct stat sb;
    if (stat(o->run_dir, &sb) || !S_ISDIR(sb.st_mode))
        return cli_error(cmd, "%s: not a run folder (LOGS/NAME of `vlmoe train`): %s", o->run_dir,
                         stat(o->run_dir, &sb) ? strerror(errno) : "not a directory");
    snprintf(path, sizeof path, "%s/metrics.jsonl", o->run_dir);
    snprintf(out, sizeof out, "%s", o->out ? o->out : "");
    if (!o->out) snprintf(out, sizeof out, "%s/report.html", o->run_dir);
    if (o->html && ours_or_absent(cmd, out)) return 1;
    report_metrics m;
    if (report_metrics_read(&m, path)) return cli_error(cmd, "%s", vlmoe_last_error());
    // the checkpoint: the one named, or the newest of the run
    ck[0] = 0;
    if (o->checkpoint) snprintf(ck, sizeof ck, "%s", o->checkpoint);
    else {
        char ckdir[1100], state[1200];
        long steps[1];
        snprintf(ckdir, sizeof ckdir, "%s/checkpoints", o->run_dir);
        if (vlmoe_ckpt_list(ckdir, steps, 1) > 0) vlmoe_ckpt_paths(ckdir, steps[0], ck, state, sizeof ck);
    }
    vlmoe_model *model = NULL;
    int rc = 0;
    if (ck[0] && vlmoe_model_load(&model, ck)) rc = cli_error(cmd, "%s", vlmoe_last_error());
    cli_examples ex = {0};
    report_routes *routes = NULL;
    report_example *pex = NULL;
    char skip[1024] = "no checkpoint in the run folder yet";
    int layers = 0, E = 0;
    if (!rc && model) {
        skip[0] = 0;
        const vlmoe_model_config *c = vlmoe_model_get_config(model);
        int nl = 0;
        vlmoe_model_moe_stats(model, &nl);
        if (c->arch == VLMOE_ARCH_MOME) snprintf(skip, sizeof skip, "VL-MoE (arch mome) routing maps are not drawn yet");
        else if (c->moe.router == VLMOE_ROUTER_NONE && c->text_moe.router == VLMOE_ROUTER_NONE)
            snprintf(skip, sizeof skip, "%s is dense: no routing", c->name);
        else if (c->moe.router == VLMOE_ROUTER_SOFT)
            snprintf(skip, sizeof skip, "%s: Soft MoE mixes every token into every slot: no per-token expert to draw", c->name);
        else rc = cli_examples_load(cmd, model, ck, o->examples, o->nexamples, NULL, &ex, skip, sizeof skip);
    }
    if (!rc && ex.n) {
        routes = calloc((size_t)ex.n, sizeof(*routes));
        pex = calloc((size_t)ex.n, sizeof(*pex));
        rc = !routes || !pex ? cli_error(cmd, "out of memory") : cli_examples_route(cmd, model, &ex, routes);
        const vlmoe_model_config *c = vlmoe_model_get_config(model);
        for (int i = 0; !rc && i < ex.n; i++) {
            uint8_t *rgb = NULL, *png = NULL;
            int w, h;
            size_t np = 0;
            const int cell = 4 * c->patch_size < 24 ? 24 : 4 * c->patch_size > 32 ? 32 : 4 * c->patch_size;
            rc = report_map_render(&routes[i], ex.images + (size_t)3 * ex.S * ex.S * i, ex.S, ex.mean, ex.std,
                                   (report_map_params){.cell = cell, .gap = 8}, &rgb, &w, &h) ||
                 report_png_encode(rgb, w, h, &png, &np);
            if (!rc && o->tb) {
                char tag[64];
                snprintf(tag, sizeof tag, "routing_map/example_%d", i);
                rc = report_tb_image(o->tb, m.last_step, 0, tag, png, np, w, h);
            }
            if (!rc && !(pex[i].png_b64 = report_base64(png, np))) rc = vlmoe_fail(VLMOE_ERR_NOMEM, "routing map");
            if (!rc && ex.captions) {
                pex[i].caption = ex.captions[i];
                rc = cli_caption_words(ex.captions[i], &ex.text, c->context_length, &routes[i], &pex[i].words,
                                       &pex[i].nwords, &pex[i].word_expert);
            }
            free(rgb), free(png);
            if (rc) rc = cli_error(cmd, "%s", vlmoe_last_error());
        }
        if (!rc) layers = routes[0].layers, E = routes[0].num_experts;
    }
    char *chart = NULL, *params = NULL;
    if (!rc && o->html && report_chart_js(&chart)) rc = cli_error(cmd, "%s", vlmoe_last_error());
    if (!rc && o->html) {
        snprintf(path, sizeof path, "%s/params.json", o->run_dir);
        params = read_text(path);
        const char *slash = strrchr(o->run_dir, '/');
        char title[512];
        snprintf(title, sizeof title, "%s", slash && slash[1] ? slash + 1 : o->run_dir);
        const report_page pg = {.run_dir = o->run_dir, .title = title, .metrics = &m, .params_json = params,
                                .checkpoint = ck[0] ? ck : NULL, .model = model, .examples = pex,
                                .nexamples = routes ? ex.n : 0, .layers = layers, .num_experts = E,
                                .layer_name = routes ? routes[0].layer_name : NULL,
                                .examples_from = ex.n ? ex.from : skip, .chart_js = chart, .max_points = o->max_points};
        if (report_html_write(out, &pg)) rc = cli_error(cmd, "%s", vlmoe_last_error());
        else if (!o->quiet) printf("wrote %s (%ld records to step %ld%s%s)\n", out, m.records, m.last_step,
                                   ex.n ? ", routing maps of " : "", ex.n ? ex.from : "");
    }
    free(chart), free(params);
    for (int i = 0; pex && i < ex.n; i++) {
        free(pex[i].png_b64), free(pex[i].word_expert);
        for (int w = 0; w < pex[i].nwords; w++) free(pex[i].words[w]);
        free(pex[i].words);
    }
    for (int i = 0; routes && i < ex.n; i++) report_routes_free(&routes[i]);
    free(pex), free(routes);
    cli_examples_free(&ex);
    vlmoe_model_free(model);
    report_metrics_free(&m);
    return rc;
}

int cli_tb_open(const char *cmd, const char *run_dir, cli_tb *t) {
    memset(t, 0, sizeof(*t));
    char dir[1100];
    snprintf(dir, sizeof dir, "%s/tensorboard", run_dir);
    snprintf(t->metrics, sizeof t->metrics, "%s/metrics.jsonl", run_dir);
    if (report_tb_open(&t->tb, dir)) return cli_error(cmd, "--report-to tensorboard: %s", vlmoe_last_error());
    return 0;
}

int cli_tb_sync(const char *cmd, cli_tb *t) {
    if (report_tb_sync(t->tb, t->metrics, &t->offset)) return cli_error(cmd, "tensorboard: %s", vlmoe_last_error());
    return 0;
}

void cli_tb_close(cli_tb *t) {
    report_tb_close(t->tb);
    t->tb = NULL;
}

static const char *USAGE =
    "usage: vlmoe report LOGS/NAME [-o report.html] [--to html|tensorboard] [--examples DIR|CSV] [options]\n\n"
    "The report of a training run, from its metrics.jsonl, params.json and newest checkpoint: one self-contained\n"
    "HTML page (no network needed to view it: data, Chart.js and routing maps inline) with the losses, learning\n"
    "rate, temperature, gradient norm, throughput, evaluations, every routing statistic per MoE layer and\n"
    "modality, tokens per expert (heatmaps over steps; the last step against the capacity; the text share per\n"
    "expert), routing maps of held-out examples (each patch and word coloured by its expert, grey: dropped),\n"
    "the run's params.json and the model card. --to tensorboard writes the metrics and the routing maps as\n"
    "TensorBoard event files into LOGS/NAME/tensorboard/ instead (a new events file; open with\n"
    "`tensorboard --logdir LOGS`).\n";

int cmd_report(int argc, char **argv) {
    const char *out = NULL, *to = "html", *examples = NULL, *checkpoint = NULL;
    int nex = 4, maxp = 600;
    const arg_spec specs[] = {
        {"output", ARG_STRING, &out, "FILE", "the HTML file (default LOGS/NAME/report.html); an existing file that is "
                                             "not a vlmoe report is never overwritten"},
        {"to", ARG_STRING, &to, "html|tensorboard", "what to write (default html)"},
        {"examples", ARG_STRING, &examples, "DIR|FILES", "images whose routing is drawn: a folder or comma-separated "
                                                        "image files, or an OpenCLIP CSV/TSV (tab-separated, columns "
                                                        "filepath and title: images with captions); default: the "
                                                        "synthetic held-out split"},
        {"num-examples", ARG_INT, &nex, "N", "examples drawn (default 4, at most 64)"},
        {"checkpoint", ARG_STRING, &checkpoint, "FILE", "the model of the maps and the model card (default: the "
                                                       "run's newest checkpoint)"},
        {"max-points", ARG_INT, &maxp, "N", "points per plotted series; longer series are shown as means of "
                                           "consecutive records (default 600)"},
    };
    char *pos[2];
    int npos = 0;
    int rc = args_parse_pos("report", specs, (int)(sizeof specs / sizeof specs[0]), argc, argv, 2, USAGE, pos, 1, &npos);
    if (rc) return rc == 1 ? 0 : rc;
    if (npos != 1) return cli_error("report", "give the run folder: vlmoe report LOGS/NAME (see --help)");
    if (maxp < 10 || maxp > 100000) return cli_error("report", "--max-points: %d not in [10, 100000]", maxp);
    const int tb = !strcmp(to, "tensorboard");
    if (!tb && strcmp(to, "html")) return cli_error("report", "--to: unknown target '%s' (html or tensorboard)", to);
    if (tb && out) return cli_error("report", "-o applies to --to html (TensorBoard files go to LOGS/NAME/tensorboard/)");
    cli_report_opts o = {.run_dir = pos[0], .out = out, .examples = examples, .checkpoint = checkpoint,
                         .nexamples = nex, .max_points = maxp, .html = !tb};
    if (!tb) return cli_report_write("report", &o);
    cli_tb t;
    if (cli_tb_open("report", pos[0], &t)) return 1;
    o.tb = t.tb;
    rc = cli_tb_sync("report", &t);
    if (!rc) rc = cli_report_write("report", &o); // the routing maps as images
    if (!rc && report_tb_flush(t.tb)) rc = cli_error("report", "%s", vlmoe_last_error());
    if (!rc) printf("wrote %s\n", report_tb_path(t.tb));
    cli_tb_close(&t);
    return rc;
}
