// train.c: `vlmoe train`: contrastive training behind OpenCLIP-style flags. Writes the resolved
// model config and training params, metrics as JSON lines, a progress line, the final
// checkpoint, and a held-out evaluation at the end.
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "vlmoe.h"

typedef struct {
    const char *model, *dataset_type, *train_data, *logs, *name, *optimizer, *scheduler, *pretrained;
    int batch_size, image_size, context_length, threads, log_every, eval_samples;
    long steps, warmup, seed, cooldown;
    double lr, wd, beta1, beta2, eps, grad_clip;
} train_args;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int mkdir_p(const char *path) {
    char tmp[1024];
    snprintf(tmp, sizeof(tmp), "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(tmp, 0755) && errno != EEXIST) return -1;
            *p = '/';
        }
    return mkdir(tmp, 0755) && errno != EEXIST ? -1 : 0;
}

static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static void fmt_eta(char *buf, size_t n, double s) {
    long t = (long)(s + 0.5);
    snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
}

// Held-out evaluation on the synthetic data: zero-shot top-1/top-5 over `n` class-balanced
// held-out images, and matched-pair retrieval accuracy in chunks of the batch size.
int cli_eval_synthetic(vlmoe_model *m, const vlmoe_synth *s, int n, int chunk, cli_eval *out) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim, T = c->context_length, C = vlmoe_synth_num_classes(s);
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    float *img = malloc(sizeof(float) * isz * n), *ie = malloc(sizeof(float) * (size_t)n * E);
    float *te = malloc(sizeof(float) * (size_t)n * E), *ce = malloc(sizeof(float) * (size_t)C * E);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n * T), *lens = malloc(sizeof(int32_t) * n);
    int32_t *labels = malloc(sizeof(int32_t) * n);
    int st = img && ie && te && ce && tok && lens && labels ? VLMOE_OK : VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_synth_batch(s, VLMOE_SPLIT_HELDOUT, 0, n, T, img, tok, lens);
    for (int i = 0; i < n; i++) labels[i] = i % C; // held-out class of sample i (synthetic.c)
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

// Per-layer, per-modality routing statistics as JSON; succ gets the lowest success rate of each
// modality over the layers (for the progress line).
static cJSON *cli_moe_json(const vlmoe_moe_stats *ms, int n, double succ[2]) {
    static const char *mod[2] = {"image", "text"};
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; i < n; i++) {
        const vlmoe_moe_stats *x = &ms[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "encoder", x->encoder);
        cJSON_AddNumberToObject(o, "block", x->block);
        for (int m = 0; m < 2; m++) {
            if (!x->tokens[m]) continue;
            cJSON *t = cJSON_CreateObject();
            cJSON_AddNumberToObject(t, "tokens", x->tokens[m]);
            cJSON_AddNumberToObject(t, "success", x->success[m]);
            cJSON_AddNumberToObject(t, "dropped", x->dropped[m]);
            cJSON_AddNumberToObject(t, "mean_max_gate", x->mean_max_gate[m]);
            cJSON_AddNumberToObject(t, "entropy_pre", x->entropy_pre[m]);
            cJSON_AddNumberToObject(t, "entropy_post", x->entropy_post[m]);
            cJSON_AddNumberToObject(t, "experts_used", x->experts_used[m]);
            if (x->routed[m]) {
                cJSON_AddItemToObject(t, "routed", cJSON_CreateDoubleArray(x->routed[m], x->num_experts));
                cJSON_AddItemToObject(t, "accepted", cJSON_CreateDoubleArray(x->accepted[m], x->num_experts));
            }
            cJSON_AddItemToObject(o, mod[m], t);
            if (x->success[m] < succ[m]) succ[m] = x->success[m];
        }
        cJSON *aux = cJSON_CreateObject();
        for (int k = 0; k < VLMOE_AUX_COUNT; k++)
            if (x->aux[k] != 0) cJSON_AddNumberToObject(aux, vlmoe_aux_name((vlmoe_aux_kind)k), x->aux[k]);
        cJSON_AddItemToObject(o, "aux", aux);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static const char *USAGE =
    "usage: vlmoe train [options]\n\n"
    "Trains a contrastive image-text model (LIMoE one_tower or CLIP two_tower) and writes\n"
    "LOGS/NAME/{config.json, params.json, metrics.jsonl, checkpoints/step_N.safetensors}.\n\n"
    "examples:\n"
    "  vlmoe train --model tiny --dataset-type synthetic --steps 300\n"
    "  vlmoe train --model my_config.json --batch-size 128 --lr 5e-4 --warmup 500 --steps 20000";

int cmd_train(int argc, char **argv) {
    train_args a = {"tiny", "synthetic", NULL, "./logs", NULL, "adamw", "cosine", NULL,
                    64, 0, 0, 0, 10, 1000,
                    300, 30, 0, 0,
                    1e-3, 0.1, 0.9, 0.98, 1e-6, 1.0};
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "NAME|FILE.json", "model config: a name (tiny, S/32, B/16, ViT-B-16, ...) or a JSON file"},
        {"pretrained", ARG_STRING, &a.pretrained, "FILE", "start from a vlmoe checkpoint (its config replaces --model)"},
        {"dataset-type", ARG_STRING, &a.dataset_type, "TYPE", "training data: synthetic (built-in, the default)"},
        {"train-data", ARG_STRING, &a.train_data, "PATH", "training data location (not used by synthetic)"},
        {"batch-size", ARG_INT, &a.batch_size, "N", "image-text pairs per step (default 64)"},
        {"steps", ARG_LONG, &a.steps, "N", "optimisation steps (default 300)"},
        {"lr", ARG_DOUBLE, &a.lr, "LR", "peak learning rate (default 1e-3)"},
        {"wd", ARG_DOUBLE, &a.wd, "WD", "decoupled weight decay on weight matrices (default 0.1)"},
        {"beta1", ARG_DOUBLE, &a.beta1, "B1", "AdamW beta1 / Adafactor momentum (default 0.9)"},
        {"beta2", ARG_DOUBLE, &a.beta2, "B2", "AdamW beta2 (default 0.98)"},
        {"eps", ARG_DOUBLE, &a.eps, "EPS", "AdamW epsilon (default 1e-6)"},
        {"warmup", ARG_LONG, &a.warmup, "N", "linear warmup steps (default 30)"},
        {"lr-scheduler", ARG_STRING, &a.scheduler, "KIND", "cosine (default), rsqrt (with --lr-cooldown-steps), const"},
        {"lr-cooldown-steps", ARG_LONG, &a.cooldown, "N", "rsqrt: linear cooldown to 0 over the last N steps"},
        {"optimizer", ARG_STRING, &a.optimizer, "NAME", "adamw (default) or adafactor"},
        {"grad-clip-norm", ARG_DOUBLE, &a.grad_clip, "NORM", "clip the global gradient norm (default 1.0, 0 = off)"},
        {"seed", ARG_LONG, &a.seed, "N", "seed of the initialisation and the data order (default 0)"},
        {"image-size", ARG_INT, &a.image_size, "PX", "override the model's image size"},
        {"context-length", ARG_INT, &a.context_length, "N", "override the model's text context length"},
        {"logs", ARG_STRING, &a.logs, "DIR", "where runs are written (default ./logs)"},
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: date-time and model)"},
        {"log-every-n-steps", ARG_INT, &a.log_every, "N", "metrics and progress every N steps (default 10)"},
        {"eval-samples", ARG_INT, &a.eval_samples, "N", "held-out samples evaluated at the end (default 1000)"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    int r = args_parse("train", specs, nspec, argc, argv, 2, USAGE);
    if (r) return r == 1 ? 0 : 2;
    if (a.threads > 0) omp_set_num_threads(a.threads);
    if (strcmp(a.dataset_type, "synthetic"))
        return cli_error("train", "--dataset-type %s: this build reads only the built-in 'synthetic' data",
                         a.dataset_type);
    if (a.batch_size < 2) return cli_error("train", "--batch-size must be >= 2 for a contrastive loss");
    if (a.steps < 1) return cli_error("train", "--steps must be >= 1");
    if (a.log_every < 1) a.log_every = 1;

    vlmoe_model_config cfg;
    vlmoe_model *m = NULL;
    if (a.pretrained) {
        if (vlmoe_model_load(&m, a.pretrained)) return cli_error("train", "--pretrained: %s", vlmoe_last_error());
        cfg = *vlmoe_model_get_config(m);
        if ((a.image_size && a.image_size != cfg.image_size) ||
            (a.context_length && a.context_length != cfg.context_length)) {
            vlmoe_model_free(m);
            return cli_error("train", "--image-size/--context-length cannot change a pretrained model");
        }
    } else {
        if (vlmoe_config_load(a.model, &cfg)) return cli_error("train", "%s", vlmoe_last_error());
        if (a.image_size) cfg.image_size = a.image_size;
        if (a.context_length) cfg.context_length = a.context_length;
        if (vlmoe_config_validate(&cfg)) return cli_error("train", "%s", vlmoe_last_error());
    }

    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = cfg.image_size;
    sp.seed = (uint64_t)a.seed;
    vlmoe_synth *data;
    if (vlmoe_synth_init(&data, &sp)) return vlmoe_model_free(m), cli_error("train", "synthetic data: %s", vlmoe_last_error());
    if (vlmoe_synth_vocab_size(data) > cfg.vocab_size || cfg.channels != 3) {
        vlmoe_synth_free(data);
        vlmoe_model_free(m);
        return cli_error("train", "model %s: the synthetic data needs channels 3 and vocab_size >= %d",
                         cfg.name, vlmoe_synth_vocab_size(data));
    }

    vlmoe_train_params tp = vlmoe_train_default_params();
    if (!strcmp(a.optimizer, "adafactor")) tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    else if (strcmp(a.optimizer, "adamw")) return vlmoe_model_free(m), vlmoe_synth_free(data), cli_error("train", "--optimizer %s: expected adamw or adafactor", a.optimizer);
    tp.optim.beta1 = (float)a.beta1;
    if (tp.optim.kind == VLMOE_OPT_ADAMW) {
        tp.optim.beta2 = (float)a.beta2;
        tp.optim.eps = (float)a.eps;
    } else if (a.beta1 == 0.9) {
        tp.optim.beta1 = 0; // Adafactor: no momentum unless asked for
    }
    tp.optim.weight_decay = (float)a.wd;
    tp.grad_clip_norm = a.grad_clip;
    vlmoe_sched_kind sk = !strcmp(a.scheduler, "cosine") ? VLMOE_SCHED_COSINE
                          : !strcmp(a.scheduler, "rsqrt") ? VLMOE_SCHED_RSQRT
                          : !strcmp(a.scheduler, "const") ? VLMOE_SCHED_CONST : (vlmoe_sched_kind)-1;
    if ((int)sk < 0) return vlmoe_model_free(m), vlmoe_synth_free(data), cli_error("train", "--lr-scheduler %s: expected cosine, rsqrt or const", a.scheduler);
    tp.schedule = (vlmoe_schedule){sk, a.lr, a.warmup, a.steps, 0.0, a.cooldown, 0.0};

    char run[512], path[1024], ts[64];
    time_t t0 = time(NULL);
    strftime(ts, sizeof(ts), "%Y_%m_%d-%H_%M_%S", localtime(&t0));
    if (a.name) snprintf(run, sizeof(run), "%s/%s", a.logs, a.name);
    else snprintf(run, sizeof(run), "%s/%s-model_%s-lr_%g-b_%d", a.logs, ts, cfg.name, a.lr, a.batch_size);
    for (char *p = run + strlen(a.logs) + 1; *p; p++)
        if (*p == '/') *p = '-'; // model names like S/32
    snprintf(path, sizeof(path), "%s/checkpoints", run);
    if (mkdir_p(path)) return vlmoe_model_free(m), vlmoe_synth_free(data), cli_error("train", "cannot create %s: %s", path, strerror(errno));

    vlmoe_trainer *tr = NULL;
    if ((!m && vlmoe_model_init(&m, &cfg, (uint64_t)a.seed)) || vlmoe_model_plan(m, a.batch_size) ||
        vlmoe_trainer_init(&tr, m, &tp)) {
        cli_error("train", "%s", vlmoe_last_error());
        vlmoe_model_free(m);
        vlmoe_synth_free(data);
        return 1;
    }
    char *cj = vlmoe_config_to_json(&cfg);
    snprintf(path, sizeof(path), "%s/config.json", run);
    int wr = write_text(path, cj);
    free(cj);
    cJSON *pj = cJSON_CreateObject();
    cJSON_AddStringToObject(pj, "model", a.model);
    cJSON_AddStringToObject(pj, "dataset_type", a.dataset_type);
    cJSON_AddNumberToObject(pj, "batch_size", a.batch_size);
    cJSON_AddNumberToObject(pj, "steps", (double)a.steps);
    cJSON_AddNumberToObject(pj, "lr", a.lr);
    cJSON_AddNumberToObject(pj, "wd", a.wd);
    cJSON_AddNumberToObject(pj, "warmup", (double)a.warmup);
    cJSON_AddStringToObject(pj, "lr_scheduler", a.scheduler);
    cJSON_AddStringToObject(pj, "optimizer", a.optimizer);
    cJSON_AddNumberToObject(pj, "grad_clip_norm", a.grad_clip);
    cJSON_AddNumberToObject(pj, "seed", (double)a.seed);
    cJSON_AddNumberToObject(pj, "threads", omp_get_max_threads());
    char *ps = cJSON_Print(pj);
    cJSON_Delete(pj);
    snprintf(path, sizeof(path), "%s/params.json", run);
    wr |= write_text(path, ps);
    free(ps);
    snprintf(path, sizeof(path), "%s/metrics.jsonl", run);
    FILE *metrics = fopen(path, "w");
    if (wr || !metrics) {
        cli_error("train", "cannot write into %s", run);
        if (metrics) fclose(metrics);
        vlmoe_trainer_free(tr), vlmoe_model_free(m), vlmoe_synth_free(data);
        return 1;
    }

    const int B = a.batch_size, T = cfg.context_length;
    const size_t isz = (size_t)3 * cfg.image_size * cfg.image_size;
    float *images = malloc(sizeof(float) * isz * B);
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)B * T), *lens = malloc(sizeof(int32_t) * B);
    const int tty = isatty(fileno(stderr));
    int n;
    vlmoe_model_params(m, &n);
    fprintf(stderr, "vlmoe train: model %s (%zu parameters), %ld steps of %d pairs, %d threads, run %s\n",
            cfg.name, vlmoe_model_num_floats(m), a.steps, B, omp_get_max_threads(), run);
    int rc = 0;
    double t_start = now(), t_last = t_start, sum_loss = 0;
    long last_step = 0;
    for (long step = 0; step < a.steps; step++) {
        if (vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, (uint64_t)step * B, B, T, images, tokens, lens)) {
            rc = cli_error("train", "data: %s", vlmoe_last_error());
            break;
        }
        vlmoe_batch batch = {B, images, tokens, lens};
        vlmoe_step_stats s;
        if (vlmoe_trainer_step(tr, &batch, &s)) {
            rc = cli_error("train", "diverged: %s; the last checkpoint in %s/checkpoints is unaffected",
                           vlmoe_last_error(), run);
            break;
        }
        sum_loss += s.loss;
        if ((step + 1) % a.log_every == 0 || step + 1 == a.steps) {
            double t = now(), dt = t - t_last, per = dt / (double)(step + 1 - last_step);
            double ips = B / per;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "step", (double)(step + 1));
            cJSON_AddNumberToObject(o, "loss", s.loss);
            cJSON_AddNumberToObject(o, "contrastive_loss", s.contrastive);
            cJSON_AddNumberToObject(o, "aux_loss", s.aux);
            cJSON_AddNumberToObject(o, "loss_avg", sum_loss / (double)(step + 1 - last_step));
            cJSON_AddNumberToObject(o, "acc_i2t", s.acc_i2t);
            cJSON_AddNumberToObject(o, "acc_t2i", s.acc_t2i);
            cJSON_AddNumberToObject(o, "lr", s.lr);
            cJSON_AddNumberToObject(o, "temperature", s.temperature);
            cJSON_AddNumberToObject(o, "grad_norm", s.grad_norm);
            cJSON_AddNumberToObject(o, "images_per_s", ips);
            cJSON_AddNumberToObject(o, "s_per_step", per);
            double succ[2] = {1, 1};
            int nmoe;
            const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, &nmoe);
            if (nmoe) cJSON_AddItemToObject(o, "moe", cli_moe_json(ms, nmoe, succ));
            char *line = cJSON_PrintUnformatted(o);
            fprintf(metrics, "%s\n", line);
            fflush(metrics);
            free(line);
            cJSON_Delete(o);
            char eta[32];
            fmt_eta(eta, sizeof(eta), per * (double)(a.steps - step - 1));
            char moe[64] = "";
            if (nmoe) snprintf(moe, sizeof(moe), "  aux %.4f  success %.2f/%.2f", s.aux, succ[0], succ[1]);
            fprintf(stderr, "%sstep %ld/%ld  loss %.4f (avg %.4f)%s  acc %.2f/%.2f  T %.1f  lr %.2e  %.0f img/s  ETA %s%s",
                    tty ? "\r\033[K" : "", step + 1, a.steps, s.loss, sum_loss / (double)(step + 1 - last_step), moe,
                    s.acc_i2t, s.acc_t2i, s.temperature, s.lr, ips, eta, tty ? "" : "\n");
            t_last = t;
            last_step = step + 1;
            sum_loss = 0;
        }
    }
    if (tty) fputc('\n', stderr);
    if (!rc) {
        snprintf(path, sizeof(path), "%s/checkpoints/step_%ld.safetensors", run, a.steps);
        if (vlmoe_model_save(m, path)) rc = cli_error("train", "%s", vlmoe_last_error());
        else fprintf(stderr, "saved %s (%.1f s of training)\n", path, now() - t_start);
    }
    if (!rc && a.eval_samples > 0) {
        cli_eval ev;
        if (cli_eval_synthetic(m, data, a.eval_samples, B, &ev)) {
            rc = cli_error("train", "evaluation: %s", vlmoe_last_error());
        } else {
            printf("held-out: zero-shot top-1 %.1f%% top-5 %.1f%% (%d classes, chance %.1f%%); "
                   "pair accuracy i2t %.1f%% t2i %.1f%% (in chunks of %d, chance %.1f%%)\n",
                   100 * ev.top1, 100 * ev.top5, ev.classes, 100.0 / ev.classes, 100 * ev.i2t,
                   100 * ev.t2i, ev.chunk, 100.0 / ev.chunk);
            fprintf(metrics, "{\"step\":%ld,\"eval_zeroshot_top1\":%.6f,\"eval_zeroshot_top5\":%.6f,"
                    "\"eval_pair_i2t\":%.6f,\"eval_pair_t2i\":%.6f}\n", a.steps, ev.top1, ev.top5, ev.i2t, ev.t2i);
        }
    }
    fclose(metrics);
    free(images), free(tokens), free(lens);
    vlmoe_trainer_free(tr);
    vlmoe_model_free(m);
    vlmoe_synth_free(data);
    return rc;
}
