// contrastive_task.c: contrastive training (LIMoE one_tower, CLIP two_tower, dense or MoE) as a
// task of the loop in src/train/run.c: a batch of pairs from the synthetic data or the loader,
// one trainer step, the train record's losses, accuracies and routing statistics, and the
// evaluations while training: the synthetic held-out split, and the user's image-caption pairs
// (--val-data) and image folder (--zeroshot-data) through src/eval/run_eval.h. Also the model a
// run starts from and the vocabulary a run trains. Covered by tests/test_cli.c,
// tests/test_checkpoint.c, tests/test_loader.c and tests/test_val.c.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "tok/tok.h"
#include "train/tasks.h"

struct vlmoe_contrastive {
    vlmoe_contrastive_params p;
    int T, N;                    // N: micro-batches per step (accum_freq)
    float *images;               // synthetic data: the N micro-batches, one after another
    int32_t *tokens, *lens;
    vlmoe_batch *batch;          // (N) this step's micro-batches
    const uint8_t *pixels;       // the loader's images as bytes (N = 1), for the model's table to
                                 // normalise (model_set_pixels); NULL: float images
};

int vlmoe_contrastive_init(vlmoe_contrastive **out, const vlmoe_contrastive_params *p) {
    *out = NULL;
    const int N = p->accum_freq > 1 ? p->accum_freq : 1;
    if (p->accum_freq < 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "contrastive run: accumulation over %d micro-batches", p->accum_freq);
    if (!p->model || p->batch_size < 1 || (int64_t)p->batch_size * N * (p->world > 1 ? p->world : 1) < 2 ||
        (int64_t)p->batch_size * N > 1 << 20 || !p->synth == !p->loader)
        return vlmoe_fail(VLMOE_ERR_ARG, "contrastive run: a model, a global batch of >= 2 pairs and one data source");
    const vlmoe_model_config *c = vlmoe_model_get_config(p->model);
    if (p->world < 0 || p->rank < 0 || p->rank >= (p->world ? p->world : 1))
        return vlmoe_fail(VLMOE_ERR_ARG, "contrastive run: rank %d of a world of %d", p->rank, p->world);
    vlmoe_contrastive *r = calloc(1, sizeof(*r));
    if (!r) return vlmoe_fail(VLMOE_ERR_NOMEM, "contrastive run");
    r->p = *p;
    if (!r->p.world) r->p.world = 1;
    r->T = c->context_length;
    r->N = N;
    if (!(r->batch = calloc((size_t)N, sizeof(*r->batch)))) return free(r), vlmoe_fail(VLMOE_ERR_NOMEM, "contrastive run");
    if (p->synth) {
        if (vlmoe_synth_vocab_size(p->synth) > c->vocab_size || c->channels != 3) {
            vlmoe_contrastive_free(r);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "model %s: the synthetic data needs channels 3 and vocab_size >= %d",
                              c->name, vlmoe_synth_vocab_size(p->synth));
        }
        const size_t B = (size_t)p->batch_size * N, isz = (size_t)3 * c->image_size * c->image_size;
        r->images = malloc(sizeof(float) * isz * B);
        r->tokens = malloc(sizeof(int32_t) * B * (size_t)r->T);
        r->lens = malloc(sizeof(int32_t) * B);
        if (!r->images || !r->tokens || !r->lens) {
            vlmoe_contrastive_free(r);
            return vlmoe_fail(VLMOE_ERR_NOMEM, "a batch of %d pairs", p->batch_size);
        }
    }
    *out = r;
    return VLMOE_OK;
}

void vlmoe_contrastive_free(vlmoe_contrastive *c) {
    if (!c) return;
    free(c->images), free(c->tokens), free(c->lens), free(c->batch);
    free(c);
}

// This process's block of global batch `step`, as N micro-batches of B: samples
// (step*W + rank)*N*B ... of the synthetic data, or rows rank*N*B ... of the loader's global
// batch, which the loader returns alone (the processes agree on the bad samples, so skipped ones
// shift every process alike). Micro-batch j is rows j*B ... of the block: the block of a run at batch N*B, cut up.
static int c_fill(void *u, long step) {
    vlmoe_contrastive *r = u;
    const int B = r->p.batch_size, N = r->N;
    const uint64_t first = ((uint64_t)step * (uint64_t)r->p.world + (uint64_t)r->p.rank) * (uint64_t)N * B;
    const vlmoe_model_config *c = vlmoe_model_get_config(r->p.model);
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
    const float *img = r->images;
    const int32_t *tok = r->tokens, *len = r->lens;
    int st = VLMOE_OK;
    if (r->p.loader) {
        vlmoe_batch g;
        if (!(st = vlmoe_loader_next(r->p.loader, &g, NULL))) {
            if (g.batch_size != B * N)
                return vlmoe_fail(VLMOE_ERR_ARG, "data: the loader gives batches of %d, not %d micro-batches x %d "
                                  "(its share of a global batch of %d processes)", g.batch_size, N, B, r->p.world);
            img = g.images, tok = g.tokens, len = g.lengths;
            r->pixels = vlmoe_loader_pixels(r->p.loader);
            if (r->pixels && N > 1)
                return vlmoe_fail(VLMOE_ERR_ARG, "data: the loader gives image bytes, and %d micro-batches take "
                                  "float images", N);
        }
    } else {
        st = vlmoe_synth_batch(r->p.synth, VLMOE_SPLIT_TRAIN, first, N * B, r->T, r->images, r->tokens, r->lens);
    }
    if (st) return vlmoe_error_prefix("data"), st;
    for (int j = 0; j < N; j++) {
        const size_t o = (size_t)j * B;
        r->batch[j] = (vlmoe_batch){B, img ? img + o * isz : NULL, tok + o * (size_t)r->T, len + o};
    }
    return VLMOE_OK;
}

static int c_step(void *u, vlmoe_trainer *t, long step, vlmoe_step_stats *s) {
    vlmoe_contrastive *r = u;
    (void)step;
    if (r->pixels) {
        const vlmoe_image_params *ip = vlmoe_loader_image_params(r->p.loader);
        int st = model_set_pixels(r->p.model, r->pixels, 1, ip->mean, ip->std);
        if (st) return st;
    }
    const int st = r->N > 1 ? vlmoe_trainer_step_accum(t, r->batch, r->N, s) : vlmoe_trainer_step(t, &r->batch[0], s);
    model_set_pixels(r->p.model, NULL, 0, NULL, NULL); // a step that failed early leaves none behind
    return st;
}

static int c_log(void *u, long done, const vlmoe_step_stats *s, cJSON *rec, char *line, size_t cap) {
    vlmoe_contrastive *r = u;
    cJSON_AddItemToObject(rec, "contrastive_loss", vlmoe_metrics_exact(s->contrastive));
    cJSON_AddNumberToObject(rec, "acc_i2t", s->acc_i2t);
    cJSON_AddNumberToObject(rec, "acc_t2i", s->acc_t2i);
    cJSON_AddNumberToObject(rec, "temperature", s->temperature);
    if (r->p.loader) {
        vlmoe_data_state pos;
        vlmoe_loader_position(r->p.loader, &pos);
        cJSON_AddNumberToObject(rec, "epoch", (double)pos.data_epoch);
        cJSON_AddNumberToObject(rec, "bad_samples", (double)vlmoe_dataset_stats_bad(vlmoe_loader_stats(r->p.loader)));
    }
    double succ[2] = {1, 1};
    int nmoe;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(r->p.model, &nmoe);
    size_t at = 0;
    if (nmoe) {
        cJSON_AddItemToObject(rec, "moe", vlmoe_metrics_moe(ms, nmoe, NULL, succ));
        at = (size_t)snprintf(line, cap, "  aux %.4f  success %.2f/%.2f", s->aux, succ[0], succ[1]);
    }
    if (at < cap) snprintf(line + at, cap - at, "  acc %.2f/%.2f  T %.1f", s->acc_i2t, s->acc_t2i, s->temperature);
    return VLMOE_OK;
}

// Whether an evaluation part that runs every `every` steps is due after step `done`.
static int due(long every, long done, long last) { return done == last || (every > 0 && done % every == 0); }

// Appends a line to the progress text (lines joined by newlines).
static void say(char *line, size_t cap, const char *fmt, ...) {
    const size_t at = strlen(line);
    if (at + 1 >= cap) return;
    if (at) line[at] = '\n', line[at + 1] = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + strlen(line), cap - strlen(line), fmt, ap);
    va_end(ap);
}

static int eval_synth(vlmoe_contrastive *r, long done, cJSON *rec, char *line, size_t cap) {
    vlmoe_synth_eval ev;
    // pair accuracy in chunks of this process's batch: the accumulated one with --accum-freq, so that
    // a run equal to one at batch N*B also reports the same numbers
    int st = vlmoe_synth_evaluate(r->p.model, r->p.synth, r->p.eval_samples, r->p.batch_size * r->N, &ev);
    if (st) return st;
    cJSON_AddNumberToObject(rec, "eval_zeroshot_top1", ev.top1);
    cJSON_AddNumberToObject(rec, "eval_zeroshot_top5", ev.top5);
    cJSON_AddNumberToObject(rec, "eval_pair_i2t", ev.i2t);
    cJSON_AddNumberToObject(rec, "eval_pair_t2i", ev.t2i);
    say(line, cap, "step %ld held-out: zero-shot top-1 %.1f%% top-5 %.1f%% (%d classes, chance %.1f%%); "
        "pair accuracy i2t %.1f%% t2i %.1f%% (in chunks of %d, chance %.1f%%)", done, 100 * ev.top1,
        100 * ev.top5, ev.classes, 100.0 / ev.classes, 100 * ev.i2t, 100 * ev.t2i, ev.chunk, 100.0 / ev.chunk);
    return VLMOE_OK;
}

// --val-data: the "retrieval" and "contrastive" objects of `vlmoe eval --json --val-data`, from
// the same code, so the record and an evaluation of the step's checkpoint agree.
static int eval_val(vlmoe_contrastive *r, long done, cJSON *rec, char *line, size_t cap) {
    const vlmoe_dataset_params *dp = r->p.val;
    vlmoe_dataset *ds = NULL;
    vlmoe_eval_pairs_result res;
    int st = vlmoe_dataset_open(dp, &ds);
    if (!st) st = vlmoe_eval_pairs(r->p.model, ds, dp->path, &r->p.eval, &res);
    vlmoe_dataset_free(ds);
    if (st) return vlmoe_error_prefix("--val-data"), st;
    const vlmoe_eval_retrieval *rt = &res.retrieval;
    const vlmoe_eval_contrastive *c = &res.contrastive;
    cJSON_AddItemToObject(rec, "retrieval", vlmoe_eval_retrieval_json(rt, dp->path));
    cJSON *o = vlmoe_eval_contrastive_json(c);
    cJSON_AddStringToObject(o, "data", dp->path);
    cJSON_AddItemToObject(rec, "contrastive", o);
    char bad[48] = "";
    if (rt->bad_samples) snprintf(bad, sizeof(bad), ", %ld bad samples skipped", rt->bad_samples);
    say(line, cap, "step %ld val %s (%d images, %d captions%s): loss %.4f, accuracy %.1f%% (batches of %d); "
        "image->text R@1/5/10 %.1f/%.1f/%.1f%%, text->image %.1f/%.1f/%.1f%%", done, dp->path, rt->images,
        rt->captions, bad, c->loss, 100 * c->accuracy, c->batch_size,
        100 * rt->i2t[0], 100 * rt->i2t[1], 100 * rt->i2t[2], 100 * rt->t2i[0], 100 * rt->t2i[1], 100 * rt->t2i[2]);
    return VLMOE_OK;
}

// --zeroshot-data: the "zeroshot" object of `vlmoe eval --json --zeroshot-data`.
static int eval_zeroshot(vlmoe_contrastive *r, long done, cJSON *rec, char *line, size_t cap) {
    const vlmoe_eval_folder_data *d = r->p.zeroshot;
    vlmoe_eval_folder_result res;
    int st = vlmoe_eval_folder_zeroshot(r->p.model, d, &r->p.eval, &res);
    if (st) return vlmoe_eval_folder_result_free(&res), vlmoe_error_prefix("--zeroshot-data"), st;
    const vlmoe_eval_zeroshot *z = &res.zeroshot;
    cJSON_AddItemToObject(rec, "zeroshot", vlmoe_eval_zeroshot_json(z, d->name));
    char bad[48] = "";
    if (z->bad_images) snprintf(bad, sizeof(bad), ", %ld unreadable skipped", z->bad_images);
    say(line, cap, "step %ld zero-shot %s (%d classes, %d images%s): top-1 %.1f%% top-5 %.1f%% (chance %.1f%%)", done,
        d->name, z->classes, z->images, bad, 100 * z->top1, 100 * z->top5,
        100.0 / z->classes);
    vlmoe_eval_folder_result_free(&res);
    return VLMOE_OK;
}

// The parts due after step `done`; none due leaves rec and line as they are.
static int c_eval(void *u, long done, cJSON *rec, char *line, size_t cap) {
    vlmoe_contrastive *r = u;
    const vlmoe_contrastive_params *p = &r->p;
    int st = VLMOE_OK;
    if (p->synth && p->eval_samples > 0 && due(p->synth_every, done, p->last_step))
        st = eval_synth(r, done, rec, line, cap);
    if (!st && p->val && due(p->val_every, done, p->last_step)) st = eval_val(r, done, rec, line, cap);
    if (!st && p->zeroshot && due(p->zeroshot_every, done, p->last_step)) st = eval_zeroshot(r, done, rec, line, cap);
    return st;
}

static void c_data_state(void *u, long done, vlmoe_data_state *ds) {
    vlmoe_contrastive *r = u;
    ds->data_position = (uint64_t)done * (uint64_t)r->p.batch_size * (uint64_t)r->N * (uint64_t)r->p.world;
    if (r->p.loader) vlmoe_loader_position(r->p.loader, ds);
}

vlmoe_run_task vlmoe_contrastive_task(vlmoe_contrastive *c) {
    vlmoe_run_task t = {c, c_fill, c_step, c_log, NULL, c_data_state};
    if ((c->p.synth && c->p.eval_samples > 0) || c->p.val || c->p.zeroshot) t.eval = c_eval;
    return t;
}

int vlmoe_synth_evaluate(vlmoe_model *m, const vlmoe_synth *s, int n, int chunk, vlmoe_synth_eval *out) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, T = c->context_length, C = vlmoe_synth_num_classes(s);
    if (n < 1 || chunk < 1) return vlmoe_fail(VLMOE_ERR_ARG, "held-out evaluation of %d samples in chunks of %d", n, chunk);
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    float *img = malloc(sizeof(float) * isz * n), *ie = malloc(sizeof(float) * (size_t)n * E);
    float *te = malloc(sizeof(float) * (size_t)n * E), *ce = malloc(sizeof(float) * (size_t)C * E);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n * T), *lens = malloc(sizeof(int32_t) * n);
    int32_t *labels = malloc(sizeof(int32_t) * n);
    int st = img && ie && te && ce && tok && lens && labels
                 ? VLMOE_OK
                 : vlmoe_fail(VLMOE_ERR_NOMEM, "held-out evaluation of %d samples: cannot allocate its %.3g GB "
                              "of images and embeddings (fewer samples: --eval-samples)", n,
                              ((double)isz + 2.0 * E + T + 2) * 4.0 * n / 1e9);
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_HELDOUT, 0, n, T, img, tok, lens);
    for (int i = 0; !st && i < n; i++) labels[i] = i % C; // held-out class of sample i (src/data/synthetic.c)
    if (!st) st = vlmoe_model_encode_images(m, img, n, ie);
    if (!st) st = vlmoe_model_encode_texts(m, tok, lens, n, te);
    if (!st) st = vlmoe_synth_class_embeddings(m, s, ce);
    if (!st) {
        vlmoe_zeroshot_accuracy(ie, n, ce, C, E, labels, &out->top1, &out->top5);
        vlmoe_pair_accuracy(ie, te, n, E, chunk, &out->i2t, &out->t2i);
        out->classes = C;
        out->chunk = chunk;
    }
    free(img), free(ie), free(te), free(ce), free(tok), free(lens), free(labels);
    return st;
}

int vlmoe_model_from_source(vlmoe_model **out, const vlmoe_model_source *s) {
    *out = NULL;
    vlmoe_model_config cfg;
    vlmoe_model *pre = NULL;
    int st;
    if (s->pretrained) {
        if ((st = vlmoe_model_load(&pre, s->pretrained))) return vlmoe_error_prefix("--pretrained"), st;
        cfg = *vlmoe_model_get_config(pre);
        if ((s->image_size && s->image_size != cfg.image_size) ||
            (s->context_length && s->context_length != cfg.context_length)) {
            vlmoe_model_free(pre);
            return vlmoe_fail(VLMOE_ERR_ARG, "--image-size/--context-length cannot change a pretrained model");
        }
    } else {
        if ((st = vlmoe_config_load(s->model, &cfg))) return st;
        if (s->image_size) cfg.image_size = s->image_size;
        if (s->context_length) cfg.context_length = s->context_length;
        if (s->vocab_size) cfg.vocab_size = s->vocab_size;
    }
    if (s->preset) { // the preset's routing and losses on the model's own MoE layers
        const int two = cfg.arch == VLMOE_ARCH_TWO_TOWER;
        if (cfg.moe.router == VLMOE_ROUTER_NONE && !(two && cfg.text_moe.router != VLMOE_ROUTER_NONE)) {
            vlmoe_model_free(pre);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "--preset %s: model '%s' has no MoE layers (make some with vlmoe "
                              "upcycle)", s->preset, cfg.name);
        }
        st = cfg.moe.router != VLMOE_ROUTER_NONE ? vlmoe_moe_preset(s->preset, &cfg.moe) : VLMOE_OK;
        if (!st && two && cfg.text_moe.router != VLMOE_ROUTER_NONE) st = vlmoe_moe_preset(s->preset, &cfg.text_moe);
        if (st) return vlmoe_model_free(pre), vlmoe_error_prefix("--preset"), st;
    }
    if (s->soft_dispatch || s->soft_raw) { // Soft MoE's App. A / App. E variants: no new tensors
        static const char *mix[] = {"soft", "identity", "uniform", "uniform_soft", "soft_uniform"};
        int k = 0, any = 0;
        while (s->soft_dispatch && k < 5 && strcmp(s->soft_dispatch, mix[k])) k++;
        if (k == 5) {
            vlmoe_model_free(pre);
            return vlmoe_fail(VLMOE_ERR_ARG, "--soft-dispatch %s: must be soft, identity, uniform, uniform_soft or "
                              "soft_uniform (Soft MoE App. A)", s->soft_dispatch);
        }
        vlmoe_moe_config *mc[2] = {&cfg.moe, &cfg.text_moe};
        for (int t = 0; t < (cfg.arch == VLMOE_ARCH_TWO_TOWER ? 2 : 1); t++) {
            if (mc[t]->router != VLMOE_ROUTER_SOFT) continue;
            any = 1;
            if (s->soft_dispatch) mc[t]->soft_mix = k;
            if (s->soft_raw) mc[t]->soft_raw = 1;
        }
        if (!any) {
            vlmoe_model_free(pre);
            return vlmoe_fail(VLMOE_ERR_ARG, "--soft-dispatch/--no-soft-normalize: model '%s' has no Soft MoE layers "
                              "(router \"soft\", e.g. --model soft-tiny)", cfg.name);
        }
        if ((st = vlmoe_config_validate(&cfg))) return vlmoe_model_free(pre), vlmoe_error_prefix("--soft-dispatch"), st;
    }
    if (pre && !s->preset && !s->soft_dispatch && !s->soft_raw) {
        *out = pre;
        return VLMOE_OK;
    }
    vlmoe_model *m = NULL;
    if ((st = vlmoe_model_init(&m, &cfg, s->seed))) return vlmoe_model_free(pre), st;
    if (pre) { // the pretrained weights under the preset's config (same tensors)
        if (vlmoe_model_num_floats(m) != vlmoe_model_num_floats(pre)) {
            vlmoe_model_free(m), vlmoe_model_free(pre);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "--preset %s changes the shapes of %s's tensors", s->preset ? s->preset : "(none)",
                              s->pretrained);
        }
        memcpy(vlmoe_model_param_data(m), vlmoe_model_param_data(pre), sizeof(float) * vlmoe_model_num_floats(m));
        st = model_copy_inputs(m, pre);
        vlmoe_model_free(pre);
        if (st) return vlmoe_model_free(m), st;
    }
    *out = m;
    return VLMOE_OK;
}

int vlmoe_dataset_check(const vlmoe_dataset_params *dp, long *count) {
    vlmoe_dataset_params p = *dp;
    p.defer_images = 1;
    vlmoe_dataset *ds = NULL;
    int st = vlmoe_dataset_open(&p, &ds);
    if (!st && count && vlmoe_dataset_get_type(ds) != VLMOE_DATASET_CSV)
        st = vlmoe_fail(VLMOE_ERR_ARG, "%s: give --train-num-samples N, the samples of an epoch (--epochs, "
                        "--val-frequency and --zeroshot-frequency count epochs; the samples in webdataset shards are "
                        "not known before reading them)", dp->path);
    if (count) *count = 0;
    vlmoe_sample s;
    int got = 0;
    while (!st && count && (got = vlmoe_dataset_next(ds, &s)) == 1) ++*count;
    if (got < 0) st = -got;
    vlmoe_dataset_free(ds);
    return st;
}

int vlmoe_train_vocabulary(const vlmoe_dataset_params *dp, const char *const *extra, size_t n_extra, int vocab_size,
                           size_t max_texts, const char *path, size_t *n_read, int *ids) {
    vlmoe_dataset *ds = NULL;
    const size_t k = n_extra < max_texts ? n_extra : max_texts;
    char **texts = calloc(k + max_texts + 1, sizeof(char *));
    size_t n = 0;
    int st = texts ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_NOMEM, "caption list"), got = 0;
    while (!st && n < k)
        if (!(texts[n] = strdup(extra[n]))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "caption list");
        else n++;
    if (!st && dp) {
        vlmoe_dataset_params p = *dp;
        p.defer_images = 1;
        st = vlmoe_dataset_open(&p, &ds);
    }
    vlmoe_sample s;
    while (!st && ds && n < k + max_texts && (got = vlmoe_dataset_next(ds, &s)) == 1)
        if (!(texts[n++] = strdup(s.caption))) st = vlmoe_fail(VLMOE_ERR_NOMEM, "caption list");
    if (!st && got < 0) st = -got;
    vlmoe_tokenizer *tok = NULL;
    if (!st) st = vlmoe_tokenizer_train(&tok, (const char *const *)texts, n, vocab_size);
    if (!st) st = vlmoe_tokenizer_save_clip(tok, path);
    if (!st && ids) *ids = vlmoe_tokenizer_vocab_size(tok);
    vlmoe_tokenizer_free(tok);
    vlmoe_dataset_free(ds);
    for (size_t i = 0; i < n; i++) free(texts[i]);
    free(texts);
    if (n_read) *n_read = n;
    if (st && dp) vlmoe_error_prefix("vocabulary for %s", dp->path);
    return st;
}
