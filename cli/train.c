// train.c: `vlmoe train`: contrastive training behind OpenCLIP-style flags, on the built-in
// synthetic data or on an OpenCLIP CSV / webdataset shards through the loader (src/data/loader.h).
// The flags become a model source, a data source and a run (src/train/run.h, the contrastive task
// of src/train/tasks.h); this file prints and picks the exit code. Covered by tests/test_cli.c,
// tests/test_checkpoint.c and tests/test_loader.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "common.h"
#include "nn/model.h"
#include "train/tasks.h"
#include "vlmoe.h"

typedef struct {
    const char *model, *dataset_type, *logs, *name, *optimizer, *scheduler, *pretrained, *preset;
    const char *resume, *csv_separator, *tokenizer, *image_mean, *image_std, *device;
    int batch_size, image_size, context_length, threads, log_every, eval_samples, keep, workers;
    int expert_parallel;         // under mpirun: every MoE layer's experts split over groups of N
    int grad_ckpt;               // --grad-checkpointing
    int lock_image, lock_image_groups, lock_text, lock_text_layers; // LiT (vlmoe_train_params)
    long steps, warmup, seed, cooldown, save_every, zeroshot_every, epochs, num_samples;
    double lr, wd, beta1, beta2, eps, grad_clip, max_bad;
    vlmoe_dataset_params data;   // --train-data and the CSV flags (path NULL: synthetic data)
} train_args;

// Everything a run holds; run_free releases whatever was set up.
typedef struct {
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_synth *synth;          // synthetic data, or
    vlmoe_loader *loader;        // --train-data through the loader,
    cli_text text;               // its captions' tokenizer
    vlmoe_contrastive *task;
    vlmoe_data_state resumed;    // the data position of the checkpoint resumed from
    vlmoe_dist *dist;            // the processes of the run (mpirun); rank 0 prints and writes
    int lead;
    int tty, open_line;          // progress redrawn in place on a terminal
    char dir[512], ckdir[600];
} train_run;

// Releases the run; the process group too, except after a failure on several processes, where
// this process leaves without finalising MPI so that mpirun stops the others (they may be
// waiting in a collective this one will never join).
static void run_free(train_run *r, int rc) {
    if (r->dist && (!rc || r->dist->world == 1)) vlmoe_dist_close(r->dist);
    vlmoe_contrastive_free(r->task);
    vlmoe_loader_free(r->loader);
    cli_text_free(&r->text);
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_synth_free(r->synth);
}

static const char *USAGE =
    "usage: vlmoe train [options]\n\n"
    "Trains a contrastive image-text model (LIMoE one_tower or CLIP two_tower, dense or MoE) and\n"
    "writes LOGS/NAME/{config.json, params.json, metrics.jsonl, checkpoints/step_N.safetensors}.\n"
    "A checkpoint is step_N.safetensors (weights + config, loadable by every command) plus\n"
    "step_N.state.safetensors (optimizer moments, step, RNG states, data position); --resume latest\n"
    "continues exactly where the newest complete checkpoint left off, with the next samples.\n\n"
    "Data: the built-in synthetic data, or --train-data: an OpenCLIP CSV/TSV (image paths relative to\n"
    "its folder) or webdataset shards (000123.jpg + 000123.txt), read by --workers threads that\n"
    "decode, random-resized-crop to the model's image size, normalise (--image-mean/--image-std)\n"
    "and tokenize ahead of the step; shuffled per epoch from --seed, the same for any --workers.\n"
    "Bad samples are skipped and counted; more than --max-bad-fraction of them stops the run.\n"
    "Without --tokenizer, a model with at least 514 ids gets a BPE vocabulary trained on the first\n"
    "10000 captions (saved as LOGS/NAME/tokenizer.txt, for vlmoe eval --tokenizer); a smaller one\n"
    "uses the synthetic data's word tokenizer.\n\n"
    "examples:\n"
    "  vlmoe train --model limoe-tiny --dataset-type synthetic --steps 300\n"
    "  vlmoe train --model limoe-S/32 --train-data cc3m.csv --csv-separator , --csv-img-key file \\\n"
    "              --csv-caption-key caption --tokenizer bpe_simple_vocab_16e6.txt.gz --workers 4\n"
    "  vlmoe train --model limoe-B/16 --train-data 'shards/train-{000000..000099}.tar' --steps 5000\n"
    "  vlmoe train --model my_config.json --batch-size 128 --lr 5e-4 --warmup 500 --steps 20000 \\\n"
    "              --save-frequency 1000 --zeroshot-frequency 1000 --name run1\n"
    "  vlmoe train --name run1 --steps 20000 --resume latest      (same flags as the first run)";


// Progress of the run: step lines on stderr (redrawn in place on a terminal), evaluations on stdout.
static void on_progress(void *u, int what, const char *line) {
    train_run *r = u;
    if (what == VLMOE_RUN_STEP) {
        fprintf(stderr, "%s%s%s", r->tty ? "\r\033[K" : "", line, r->tty ? "" : "\n");
        r->open_line = r->tty;
        return;
    }
    if (r->open_line) fputc('\n', stderr), r->open_line = 0;
    if (what == VLMOE_RUN_EVAL) printf("%s\n", line), fflush(stdout);
}

static void on_warn(void *u, const char *msg) { fprintf(stderr, "vlmoe train: %s\n", msg); }

static int write_run_files(const train_args *a, train_run *r) {
    cJSON *pj = cJSON_CreateObject();
    cJSON_AddStringToObject(pj, "model", a->pretrained ? a->pretrained : a->model);
    cJSON_AddStringToObject(pj, "dataset_type", a->dataset_type);
    if (r->loader) {
        cJSON_AddStringToObject(pj, "train_data", a->data.path);
        cJSON_AddNumberToObject(pj, "workers", a->workers);
        cJSON_AddNumberToObject(pj, "max_bad_fraction", a->max_bad);
    }
    const char *nk[] = {"batch_size", "world_size", "global_batch_size", "steps", "lr", "wd", "warmup"};
    const double nv[] = {a->batch_size, r->dist->world, (double)a->batch_size * r->dist->world, (double)a->steps,
                         a->lr, a->wd, (double)a->warmup};
    for (int i = 0; i < 7; i++) cJSON_AddNumberToObject(pj, nk[i], nv[i]);
    cJSON_AddStringToObject(pj, "lr_scheduler", a->scheduler);
    cJSON_AddStringToObject(pj, "optimizer", a->optimizer);
    const char *mk[] = {"grad_clip_norm", "seed", "save_frequency", "threads"};
    const double mv[] = {a->grad_clip, (double)a->seed, (double)a->save_every, omp_get_max_threads()};
    for (int i = 0; i < 4; i++) cJSON_AddNumberToObject(pj, mk[i], mv[i]);
    cJSON_AddBoolToObject(pj, "grad_checkpointing", a->grad_ckpt);
    cJSON_AddBoolToObject(pj, "lock_image", a->lock_image);
    cJSON_AddNumberToObject(pj, "lock_image_unlocked_groups", a->lock_image_groups);
    cJSON_AddBoolToObject(pj, "lock_text", a->lock_text);
    cJSON_AddNumberToObject(pj, "lock_text_unlocked_layers", a->lock_text_layers);
    return vlmoe_run_write_files(r->dir, vlmoe_model_get_config(r->m), pj) ? cli_error("train", "%s", vlmoe_last_error()) : 0;
}

// The model: a resumed run's (newest usable checkpoint first), or one from --model/--pretrained.
static int setup_model(const train_args *a, const vlmoe_train_params *tp, train_run *r) {
    if (a->resume) {
        char w[1024];
        if (vlmoe_ckpt_resume(r->ckdir, a->resume, tp, a->batch_size, &r->m, &r->t, &r->resumed, w, sizeof(w),
                              on_warn, NULL))
            return cli_error("train", "%s", vlmoe_last_error());
        if (r->lead) fprintf(stderr, "vlmoe train: resuming from %s (step %ld)\n", w, vlmoe_trainer_get_step(r->t));
        return 0;
    }
    const vlmoe_model_source src = {a->model, a->pretrained, a->preset, a->image_size, a->context_length,
                                    (uint64_t)a->seed};
    if (vlmoe_model_from_source(&r->m, &src) || vlmoe_model_plan(r->m, a->batch_size) ||
        vlmoe_trainer_init(&r->t, r->m, tp))
        return cli_error("train", "%s", vlmoe_last_error());
    return 0;
}

// The captions' tokenizer: --tokenizer, else the vocabulary this run trained (on a first run, from
// the first 10000 captions), else for a model with too few ids for BPE the synthetic words.
static int setup_text(const train_args *a, const vlmoe_model_config *c, train_run *r) {
    char path[1024];
    const char *use = a->tokenizer;
    if (!use && c->vocab_size >= 514) {
        snprintf(path, sizeof(path), "%s/tokenizer.txt", r->dir);
        use = path;
        size_t n;
        int ids, st = 0; // rank 0 trains it; the others read it once it is written
        if (r->lead && access(path, R_OK) == 0)
            fprintf(stderr, "vlmoe train: captions are tokenized with %s, the vocabulary this run trained\n", path);
        else if (r->lead && (st = vlmoe_train_vocabulary(&a->data, c->vocab_size, 10000, path, &n, &ids)))
            return cli_error("train", "%s", vlmoe_last_error());
        else if (r->lead)
            fprintf(stderr, "vlmoe train: no --tokenizer: trained a BPE vocabulary of %d ids on the first %zu captions "
                    "of %s, saved as %s (give it to vlmoe eval as --tokenizer)\n", ids, n, a->data.path, path);
        if (r->dist->barrier(r->dist)) return cli_error("train", "%s", vlmoe_last_error());
    }
    if (cli_text_init("train", use, c, 1, &r->text)) return 1;
    if (!use && r->lead)
        fprintf(stderr, "vlmoe train: captions are tokenized with the synthetic data's word tokenizer (the model's "
                "%d ids are too few for BPE; --tokenizer FILE for another)\n", c->vocab_size);
    return 0;
}

// The data: the synthetic pairs, or the loader over --train-data (at the checkpoint's position
// when resuming).
static int setup_data(const train_args *a, train_run *r) {
    const vlmoe_model_config *c = vlmoe_model_get_config(r->m);
    if (!a->data.path) {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        sp.seed = (uint64_t)a->seed;
        return vlmoe_synth_init(&r->synth, &sp) ? cli_error("train", "synthetic data: %s", vlmoe_last_error()) : 0;
    }
    if (c->channels != 3) return cli_error("train", "model %s has %d image channels; images are RGB", c->name, c->channels);
    vlmoe_loader_params lp = vlmoe_loader_default_params();
    if (cli_image_params("train", a->image_mean, a->image_std, c, &lp.image) || setup_text(a, c, r)) return 1;
    lp.data = a->data;
    lp.seed = (uint64_t)a->seed;
    lp.batch_size = a->batch_size * r->dist->world; // every process reads the global batch, takes its block
    lp.context_length = c->context_length;
    lp.tokenize = cli_tokenize, lp.tokenize_user = &r->text;
    lp.workers = a->workers;
    lp.max_bad_fraction = a->max_bad;
    if (vlmoe_loader_open(&lp, &r->loader) || (a->resume && vlmoe_loader_seek(r->loader, &r->resumed)))
        return cli_error("train", "--train-data: %s", vlmoe_last_error());
    const int64_t rows = vlmoe_loader_epoch_size(r->loader);
    char what[64] = "webdataset shards";
    if (rows >= 0) snprintf(what, sizeof(what), "%lld usable rows", (long long)rows);
    if (r->lead) fprintf(stderr, "vlmoe train: data %s (%s), %d loader workers\n", a->data.path, what, a->workers);
    return 0;
}

int cmd_train(int argc, char **argv) {
    train_args a = {.model = "tiny", .logs = "./logs", .optimizer = "adamw", .scheduler = "cosine",
                    .csv_separator = "\t", .batch_size = 64, .log_every = 10, .eval_samples = 1000, .keep = 3,
                    .workers = 2, .steps = 300, .warmup = 30, .lr = NAN, .wd = NAN, .beta1 = 0.9, .beta2 = 0.98,
                    .eps = 1e-6, .grad_clip = 1.0, .max_bad = 0.1};
    a.data = vlmoe_dataset_default_params();
    long steps_given = -1, epochs = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "NAME|FILE.json", "model config: a name (tiny, limoe-tiny, S/32, B/16, ViT-B-16, ...) or a JSON file"},
        {"pretrained", ARG_STRING, &a.pretrained, "FILE", "start from a vlmoe checkpoint (its config replaces --model)"},
        {"preset", ARG_STRING, &a.preset, "NAME", "routing and losses of the model's MoE layers: clipup (CLIP-UP; also lr 5e-5 "
                                                  "and wd 0.05, its upcycled phase, unless given) or limoe"},
        {"train-data", ARG_STRING, &a.data.path, "PATH", "image-text pairs: an OpenCLIP CSV/TSV file, or webdataset shards "
                                                       "('train-{000000..000099}.tar', lists joined by '::')"},
        {"dataset-type", ARG_STRING, &a.dataset_type, "TYPE", "synthetic (built-in; the default without --train-data), csv, "
                                                             "webdataset, auto (by the name; the default with it)"},
        {"csv-separator", ARG_STRING, &a.csv_separator, "C", "CSV field separator (default tab; \\t for tab)"},
        {"csv-img-key", ARG_STRING, &a.data.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &a.data.caption_key, "NAME", "CSV column of captions (default title)"},
        {"workers", ARG_INT, &a.workers, "N", "threads loading --train-data ahead of the step (default 2; 0: the training thread)"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "captions' vocabulary: CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &a.image_mean, "R,G,B", "normalisation mean of --train-data (default CLIP's; [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &a.image_std, "R,G,B", "normalisation std of --train-data (default CLIP's; [-1, 1]: 0.5)"},
        {"max-bad-fraction", ARG_DOUBLE, &a.max_bad, "F", "stop when more than this fraction of samples is bad (default 0.1)"},
        {"train-num-samples", ARG_LONG, &a.num_samples, "N", "samples per epoch for --epochs (synthetic: 10000; CSV: its rows)"},
        {"expert-parallel", ARG_INT, &a.expert_parallel, "N", "under mpirun: split every MoE layer's experts over "
                                                               "groups of N processes (N divides the process count "
                                                               "and num_experts; default 1: not split)"},
        {"batch-size", ARG_INT, &a.batch_size, "N", "image-text pairs per step and process (default 64; under mpirun -np W the global batch is W times it)"},
        {"steps", ARG_LONG, &steps_given, "N", "optimisation steps (default 300)"},
        {"epochs", ARG_LONG, &epochs, "N", "train for N epochs of --train-num-samples instead of --steps"},
        {"lr", ARG_DOUBLE, &a.lr, "LR", "peak learning rate (default 1e-3; --preset clipup: 5e-5)"},
        {"wd", ARG_DOUBLE, &a.wd, "WD", "decoupled weight decay on weight matrices (default 0.1; --preset clipup: 0.05)"},
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
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: date-time and model; needed by --resume latest)"},
        {"save-frequency", ARG_LONG, &a.save_every, "N", "write a checkpoint every N steps (default: at the end only)"},
        {"keep-checkpoints", ARG_INT, &a.keep, "K", "keep the newest K checkpoints (default 3, 0 = all)"},
        {"resume", ARG_STRING, &a.resume, "latest|FILE", "continue a run exactly: its newest complete checkpoint, or step_N.safetensors"},
        {"zeroshot-frequency", ARG_LONG, &a.zeroshot_every, "N", "held-out zero-shot evaluation every N steps (default: at the end)"},
        {"eval-samples", ARG_INT, &a.eval_samples, "N", "held-out samples per evaluation (default 1000, 0 = none)"},
        {"log-every-n-steps", ARG_INT, &a.log_every, "N", "metrics and progress every N steps (default 10)"},
        {"grad-checkpointing", ARG_FLAG, &a.grad_ckpt, NULL, "keep only each block's input and recompute the block in the "
                                                             "backward: less activation memory, the same gradients"},
        {"lock-image", ARG_FLAG, &a.lock_image, NULL, "two_tower: freeze the image tower (LiT): no update, no weight decay"},
        {"lock-image-unlocked-groups", ARG_INT, &a.lock_image_groups, "N", "with --lock-image: leave its last N groups "
                                                                          "trainable (1: projection; 2: + last block and final norm; ...)"},
        {"lock-text", ARG_FLAG, &a.lock_text, NULL, "two_tower: freeze the text tower"},
        {"lock-text-unlocked-layers", ARG_INT, &a.lock_text_layers, "N", "with --lock-text: leave its last N groups "
                                                                        "trainable (counted as for the image tower)"},
        {"device", ARG_STRING, &a.device, "cpu|cuda[:N]", "where the model trains (default cpu)"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    int rc = args_parse("train", specs, nspec, argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (a.threads > 0) omp_set_num_threads(a.threads);
    // CLIP-UP sec. 4: the upcycled model trains on with the learning rate and weight decay
    // reduced from the dense phase's 5e-4 / 0.2 to 5e-5 / 0.05
    const int clipup = a.preset && !strcmp(a.preset, "clipup");
    if (isnan(a.lr)) a.lr = clipup ? 5e-5 : 1e-3;
    if (isnan(a.wd)) a.wd = clipup ? 0.05 : 0.1;
    a.dataset_type = a.dataset_type ? a.dataset_type : a.data.path ? "auto" : "synthetic";
    const int synthetic = !strcmp(a.dataset_type, "synthetic");
    if (synthetic && a.data.path)
        return cli_error("train", "--train-data: --dataset-type synthetic trains on the built-in data (csv, webdataset or "
                         "auto read --train-data)");
    if (!synthetic) {
        if (cli_dataset_type("train", a.dataset_type, 1, &a.data.type)) return 1;
        if (!a.data.path) return cli_error("train", "--dataset-type %s needs --train-data PATH", a.dataset_type);
        if (cli_separator("train", a.csv_separator, &a.data.separator)) return 1;
        if (a.workers < 0 || !(a.max_bad >= 0 && a.max_bad <= 1))
            return cli_error("train", "--workers must be >= 0 and --max-bad-fraction in [0, 1]");
    }
    vlmoe_dist *dist = NULL; // started by mpirun: this process's rank in the run
    if (vlmoe_dist_open(&dist, "auto")) return cli_error("train", "%s", vlmoe_last_error());
    if (a.batch_size * dist->world < 2)
        return cli_error("train", "--batch-size must be >= 2 for a contrastive loss (the global batch, per process x %d "
                         "processes)", dist->world);
    if (epochs > 0 && steps_given >= 0) return cli_error("train", "give --steps or --epochs, not both");
    if (!synthetic && vlmoe_dataset_check(&a.data, epochs > 0 && a.num_samples <= 0 ? &a.num_samples : NULL))
        return cli_error("train", "--train-data: %s", vlmoe_last_error());
    if (synthetic && a.num_samples <= 0) a.num_samples = 10000;
    if (epochs > 0) {
        if (a.num_samples < 1) return cli_error("train", "--train-num-samples must be >= 1");
        const long G = (long)a.batch_size * dist->world;
        a.steps = (epochs * a.num_samples + G - 1) / G;
    } else if (steps_given >= 0) {
        a.steps = steps_given;
    }
    a.epochs = epochs;
    if (a.steps < 1) return cli_error("train", "--steps must be >= 1");
    if (a.log_every < 1) a.log_every = 1;
    if (a.expert_parallel < 0) return cli_error("train", "--expert-parallel must be >= 1 (1: experts not split)");
    if (a.expert_parallel > 1 && dist->world % a.expert_parallel)
        return cli_error("train", "--expert-parallel %d does not divide the %d process%s into groups%s", a.expert_parallel,
                         dist->world, dist->world == 1 ? "" : "es",
                         dist->world == 1 ? " (start several with mpirun -np N)" : "");
    if (a.resume && !strcmp(a.resume, "latest") && !a.name)
        return cli_error("train", "--resume latest needs --name (the run to continue)");

    vlmoe_train_params tp = vlmoe_train_default_params();
    if (!strcmp(a.optimizer, "adafactor")) tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    else if (strcmp(a.optimizer, "adamw")) return cli_error("train", "--optimizer %s: expected adamw or adafactor", a.optimizer);
    tp.optim.beta1 = (float)a.beta1;
    if (tp.optim.kind == VLMOE_OPT_ADAMW) {
        tp.optim.beta2 = (float)a.beta2;
        tp.optim.eps = (float)a.eps;
    } else if (a.beta1 == 0.9) {
        tp.optim.beta1 = 0; // Adafactor: no momentum unless asked for
    }
    tp.optim.weight_decay = (float)a.wd;
    tp.grad_clip_norm = a.grad_clip;
    tp.lock_image = a.lock_image, tp.lock_image_unlocked_groups = a.lock_image_groups;
    tp.lock_text = a.lock_text, tp.lock_text_unlocked_layers = a.lock_text_layers;
    int sk = !strcmp(a.scheduler, "cosine") ? VLMOE_SCHED_COSINE : !strcmp(a.scheduler, "rsqrt") ? VLMOE_SCHED_RSQRT
             : !strcmp(a.scheduler, "const") ? VLMOE_SCHED_CONST : -1;
    if (sk < 0) return cli_error("train", "--lr-scheduler %s: expected cosine, rsqrt or const", a.scheduler);
    tp.schedule = (vlmoe_schedule){(vlmoe_sched_kind)sk, a.lr, a.warmup, a.steps, 0.0, a.cooldown, 0.0};

    train_run r;
    memset(&r, 0, sizeof(r));
    r.dist = dist, r.lead = dist->rank == 0;
    if (a.resume && strcmp(a.resume, "latest")) { // LOGS/NAME/checkpoints/step_N.safetensors
        vlmoe_run_dir_of(a.resume, r.dir, sizeof(r.dir));
    } else if (a.name) {
        snprintf(r.dir, sizeof(r.dir), "%s/%s", a.logs, a.name);
    } else {
        char ts[64], model[64];
        time_t t0 = time(NULL);
        strftime(ts, sizeof(ts), "%Y_%m_%d-%H_%M_%S", localtime(&t0));
        snprintf(model, sizeof(model), "%s", a.pretrained ? "pretrained" : a.model);
        for (char *p = model; *p; p++)
            if (*p == '/') *p = '-'; // model names like S/32
        snprintf(r.dir, sizeof(r.dir), "%s/%s-model_%s-lr_%g-b_%d", a.logs, ts, model, a.lr, a.batch_size);
    }
    snprintf(r.ckdir, sizeof(r.ckdir), "%s/checkpoints", r.dir);
    if (vlmoe_mkdir_p(r.ckdir)) return cli_error("train", "%s", vlmoe_last_error());
    if (r.lead) vlmoe_ckpt_clean_tmp(r.ckdir);
    if (!(rc = setup_model(&a, &tp, &r)) && a.device && model_set_device(r.m, a.device))
        rc = cli_error("train", "%s", vlmoe_last_error());
    if (!rc && a.grad_ckpt) { // the arena it plans instead, when the model is planned here already
        const double mib = 1024.0 * 1024.0, was = r.m->g ? graph_activation_bytes_f32(r.m->g) / mib : 0;
        if (vlmoe_model_set_grad_checkpointing(r.m, 1))
            rc = cli_error("train", "--grad-checkpointing: %s", vlmoe_last_error());
        else if (r.lead && was > 0 && r.m->g)
            fprintf(stderr, "vlmoe train: --grad-checkpointing: blocks recomputed in the backward; activation arena "
                    "%.1f MiB instead of %.1f MiB\n", graph_activation_bytes_f32(r.m->g) / mib, was);
    }
    if (!rc && !(rc = setup_data(&a, &r))) {
        const vlmoe_contrastive_params cp = {r.m, a.batch_size, r.synth, r.loader, a.eval_samples, r.dist->rank,
                                             r.dist->world};
        if (vlmoe_contrastive_init(&r.task, &cp)) rc = cli_error("train", "%s", vlmoe_last_error());
    }
    if (!rc && r.lead) rc = write_run_files(&a, &r);
    if (rc) {
        run_free(&r, rc);
        return rc;
    }
    const vlmoe_model_config *cfg = vlmoe_model_get_config(r.m);
    r.tty = isatty(fileno(stderr));
    const int W = r.dist->world;
    if (r.lead && W > 1)
        fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d pairs (%d processes x %d), %d "
                "threads each, run %s\n", cfg->name, vlmoe_model_num_floats(r.m), vlmoe_trainer_get_step(r.t), a.steps,
                a.batch_size * W, W, a.batch_size, omp_get_max_threads(), r.dir);
    else if (r.lead)
        fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d pairs, %d threads, run %s\n",
                cfg->name, vlmoe_model_num_floats(r.m), vlmoe_trainer_get_step(r.t), a.steps, a.batch_size,
                omp_get_max_threads(), r.dir);
    const vlmoe_run_task task = vlmoe_contrastive_task(r.task);
    const vlmoe_run_params rp = {r.dir, a.steps, a.log_every, a.save_every, a.keep, a.zeroshot_every, 1,
                                 (long)a.batch_size * W, r.dist, on_progress, &r, a.expert_parallel};
    const double t0 = cli_now();
    int st = vlmoe_run_train(r.t, &task, &rp);
    if (r.open_line) fputc('\n', stderr);
    if (st == VLMOE_ERR_NUMERIC)
        rc = cli_error("train", "diverged: %s. Nothing was written for this step; continue from the last checkpoint "
                       "with --resume latest (lower --lr or raise --warmup)", vlmoe_last_error());
    else if (st)
        rc = cli_error("train", "%s", vlmoe_last_error());
    else if (r.lead)
        fprintf(stderr, "trained to step %ld in %.1f s; checkpoints in %s\n", a.steps, cli_now() - t0, r.ckdir);
    const vlmoe_dataset_stats *bs = r.loader && r.lead ? vlmoe_loader_stats(r.loader) : NULL;
    if (bs && vlmoe_dataset_stats_bad(bs)) { // a run stopped by bad samples said so with the counts
        char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
        vlmoe_dataset_stats_format(bs, sum, sizeof(sum));
        fprintf(stderr, "vlmoe train: warning: %s: %s\n", a.data.path, sum);
    }
    run_free(&r, rc);
    return rc;
}
