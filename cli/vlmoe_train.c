// vlmoe_train.c: `vlmoe train` for VL-MoE (arch mome) models: pre-training by masked data modeling
// on image, text and pair streams (VL-MoE sec. 3.1). The flags become the task of
// src/train/mome_task.c and a run of the loop in src/train/run.c; this file lists the image files
// and reads the text file, sets up the model, prints and picks the exit code. `vlmoe vq train`
// (the MIM codebook) is cli/vq.c. Covered by tests/test_vlmoe_train.c.
#include <cjson/cJSON.h>
#include <errno.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "args.h"
#include "cli.h"
#include "common.h"
#include "tokenize.h"
#include "train/tasks.h"
#include "vlmoe_train.h"

static const char *CMD = "train";

static const char *model_flag(int argc, char **argv) {
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) return argv[i + 1];
        if (!strncmp(argv[i], "--model=", 8)) return argv[i] + 8;
    }
    return NULL;
}

int cli_train_is_mome(int argc, char **argv) {
    const char *m = model_flag(argc, argv);
    vlmoe_model_config c;
    return m && vlmoe_config_load(m, &c) == VLMOE_OK && c.arch == VLMOE_ARCH_MOME;
}

typedef struct {
    const char *model, *codebook, *logs, *name, *mix, *image_data, *text_data, *resume, *scheduler;
    const char *dataset_type, *csv_separator, *tokenizer, *image_mean, *image_std;
    int batch, log_every, keep, workers, threads;
    int grad_ckpt, lock[4];      // OpenCLIP's flags the VL-MoE trainer refuses (one set of flags)
    long steps, warmup, seed, save_every;
    double lr, wd, max_bad;
    vlmoe_dataset_params data;   // --train-data and the CSV flags
} mome_args;

// Everything a run holds; run_free releases whatever was set up.
typedef struct {
    vlmoe_model_config cfg;
    vlmoe_model *m;
    vlmoe_trainer *t;
    vlmoe_mome_run *task;
    cli_text text;                       // tokenizer of --text-data and --train-data captions
    char **images;                       // --image-data files, sorted
    int n_images;
    char **lines;                        // --text-data lines, with their numbers
    long *lineno;
    size_t n_lines;
    float *cb;                           // --codebook
    vlmoe_data_state resumed;            // the data state of the checkpoint resumed from
    char dir[512], ckdir[600];
} mome_cli;

static void run_free(mome_cli *r) {
    vlmoe_mome_free(r->task);
    cli_text_free(&r->text);
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_free_strings(r->images, r->n_images);
    if (r->lines) cli_free_lines(r->lines, r->n_lines);
    free(r->lineno), free(r->cb);
}

// Exit status of a failed step of the set-up, with the library's message.
static int lib_error(const char *what) { return cli_error(CMD, "%s%s%s", what, what[0] ? ": " : "", vlmoe_last_error()); }

// "I,T,P": three non-negative integer weights, not all zero.
static int parse_mix(const char *v, int w[3]) {
    char tail;
    if (sscanf(v, "%d,%d,%d%c", &w[0], &w[1], &w[2], &tail) != 3 || w[0] < 0 || w[1] < 0 || w[2] < 0 ||
        w[0] + w[1] + w[2] < 1)
        return cli_error(CMD, "--mix '%s': expected three non-negative integer weights IMAGES,TEXTS,PAIRS, not all 0 "
                         "(e.g. 1,1,1, the paper's equal thirds, or 0,1,0 for texts only)", v);
    return 0;
}

// What the streams read from files: the tokenizer (--tokenizer, or the synthetic word tokenizer for
// a model too small for BPE), the image transform, the image files and the text file's lines.
static int open_data(const mome_args *a, const vlmoe_mome_split *sp, vlmoe_mome_params *p, mome_cli *r) {
    const int *src = sp->src;
    const int synth = src[0] == VLMOE_MOME_SYNTH || src[1] == VLMOE_MOME_SYNTH || src[2] == VLMOE_MOME_SYNTH;
    if (synth && a->tokenizer) return cli_error(CMD, "--tokenizer: the synthetic data has its own word tokenizer");
    if (synth && (a->image_mean || a->image_std)) return cli_error(CMD, "--image-mean/--image-std apply to image files");
    if (synth) return 0;
    if (r->cfg.channels != 3)
        return cli_error(CMD, "model %s has %d image channels; images are RGB", r->cfg.name, r->cfg.channels);
    if (cli_image_params(CMD, a->image_mean, a->image_std, &r->cfg, &p->image)) return 1;
    if (src[1] == VLMOE_MOME_LINES || src[1] == VLMOE_MOME_LOADER || src[2] == VLMOE_MOME_LOADER) {
        if (cli_text_init(CMD, a->tokenizer, &r->cfg, 1, &r->text)) return 1;
        if (!r->text.bpe)
            fprintf(stderr, "vlmoe train: texts are tokenized with the synthetic data's word tokenizer (the model's %d "
                    "ids are too few for BPE; --tokenizer FILE for another)\n", r->cfg.vocab_size);
        p->tokenize = cli_tokenize, p->tokenize_user = &r->text, p->tokenizer = a->tokenizer;
        p->text_vocab = r->text.bpe ? vlmoe_tokenizer_vocab_size(r->text.bpe) : 0;
    }
    if (src[1] == VLMOE_MOME_LINES) {
        if (cli_read_lines_numbered(CMD, a->text_data, &r->lines, &r->lineno, &r->n_lines)) return 1;
        p->text_lines = (const char *const *)r->lines, p->text_lineno = r->lineno, p->n_text_lines = r->n_lines;
    }
    if (src[0] == VLMOE_MOME_FOLDER) {
        struct stat sb;
        const int e = stat(a->image_data, &sb) ? errno : 0;
        if (e || !S_ISDIR(sb.st_mode))
            return cli_error(CMD, "--image-data %s: %s", a->image_data, e ? strerror(e) : "not a folder");
        if (cli_list_images(CMD, &a->image_data, 1, &r->images, &r->n_images)) return 1;
        p->image_files = (const char *const *)r->images, p->n_image_files = r->n_images;
    }
    return 0;
}

static void on_warn(void *u, const char *msg) { fprintf(stderr, "vlmoe train: %s\n", msg); }

// A fresh model from --model, or the newest usable checkpoint (--resume latest, falling back to
// older ones) or the one named (--resume FILE); then the task starts on it.
static int setup_model(const mome_args *a, const vlmoe_train_params *tp, mome_cli *r) {
    if (!a->resume) {
        if (vlmoe_model_init(&r->m, &r->cfg, (uint64_t)a->seed) || vlmoe_trainer_init(&r->t, r->m, tp) ||
            vlmoe_mome_start(r->task, r->m, r->cb, NULL, NULL))
            return lib_error("");
        return 0;
    }
    char w[1024];
    if (vlmoe_ckpt_resume(r->ckdir, a->resume, tp, 0, &r->m, &r->t, &r->resumed, w, sizeof(w), on_warn, NULL))
        return lib_error("");
    if (vlmoe_mome_start(r->task, r->m, r->cb, &r->resumed, w)) return lib_error("");
    fprintf(stderr, "vlmoe train: resuming from %s (step %ld)\n", w, vlmoe_trainer_get_step(r->t));
    return 0;
}

static int write_run_files(const mome_args *a, const int w[3], mome_cli *r) {
    const vlmoe_mome_report *rep = vlmoe_mome_get_report(r->task);
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "model", a->model);
    cJSON_AddStringToObject(p, "codebook", a->codebook ? a->codebook : "(the checkpoint's)");
    cJSON *streams = cJSON_AddObjectToObject(p, "streams");
    for (int k = 0; k < VLMOE_MOME_STREAMS; k++) {
        cJSON *s = cJSON_AddObjectToObject(streams, vlmoe_mome_stream_name(k));
        cJSON_AddNumberToObject(s, "weight", w[k]);
        cJSON_AddNumberToObject(s, "per_step", rep->split.n[k]);
        cJSON_AddStringToObject(s, "source", vlmoe_mome_source_name(rep->split.src[k]));
    }
    const char *key[4] = {"image_data", "text_data", "train_data", "tokenizer"};
    const char *val[4] = {a->image_data, a->text_data, a->data.path, a->tokenizer};
    for (int i = 0; i < 4; i++)
        if (val[i]) cJSON_AddStringToObject(p, key[i], val[i]);
    const char *nk[] = {"batch_size", "chunk", "steps", "lr"};
    const double nv[] = {a->batch, rep->split.chunk, (double)a->steps, a->lr};
    for (int i = 0; i < 4; i++) cJSON_AddNumberToObject(p, nk[i], nv[i]);
    cJSON_AddStringToObject(p, "lr_scheduler", a->scheduler);
    const char *mk[] = {"warmup", "wd", "seed", "save_every_n_steps", "threads"};
    const double mv[] = {(double)a->warmup, a->wd, (double)a->seed, (double)a->save_every, omp_get_max_threads()};
    for (int i = 0; i < 5; i++) cJSON_AddNumberToObject(p, mk[i], mv[i]);
    return vlmoe_run_write_files(r->dir, &r->cfg, p) ? lib_error("") : 0;
}

// Step lines on stdout, each followed by the routing of the streams; checkpoints are not announced.
static void on_progress(void *u, int what, const char *line) {
    if (what != VLMOE_RUN_STEP) return;
    const vlmoe_mome_report *rep = vlmoe_mome_get_report(u);
    printf("%s\n", line);
    if (rep->routing[0]) printf("  routing  %s\n", rep->routing);
    fflush(stdout);
}

static const char *USAGE =
    "usage: vlmoe train --model vlmoe-tiny --codebook cb.safetensors [options]\n\n"
    "VL-MoE pretraining by masked data modeling: MIM on images, MLM on texts, VLM on image-text pairs\n"
    "(VL-MoE sec. 3.1), their losses summed with the MoE auxiliary losses. --mix IMAGES,TEXTS,PAIRS\n"
    "splits each step's --batch-size between the three streams (default 1,1,1: equal thirds; a weight\n"
    "of 0 drops a stream). A stream split into unequal parts runs as several forwards of the largest\n"
    "common size, each adding its mean loss, so a stream's share of the loss follows its share of the\n"
    "batch.\n\n"
    "Data: without a data flag, the built-in synthetic data. Otherwise images come from --image-data\n"
    "DIR (every .jpg/.jpeg/.png/.webp under it), texts from --text-data FILE (one sentence per line),\n"
    "pairs from --train-data (an OpenCLIP CSV/TSV or webdataset shards, read as vlmoe train reads them\n"
    "for CLIP models); --train-data also gives images and texts where --image-data / --text-data are\n"
    "not given. Folder images and sentences are visited once per epoch in an order drawn from --seed;\n"
    "images are random-resized-cropped and normalised (--image-mean/--image-std, CLIP's by default).\n"
    "Texts go through --tokenizer (CLIP merges or HF tokenizer.json; the model's mask_token must lie\n"
    "outside it), or the synthetic word tokenizer for a model with fewer than 514 ids.\n\n"
    "Every --log-every-n-steps: the losses, and the routing of each stream (an eval-mode forward of\n"
    "its batch: per MoE layer success rate, dropped assignments, experts used), printed and in\n"
    "LOGS/NAME/metrics.jsonl. Checkpoints (checkpoints/step_N.safetensors + step_N.state.safetensors,\n"
    "written atomically with the optimizer state) every --save-every-n-steps and at the end;\n"
    "--resume latest (or FILE) with the first run's flags continues bit for bit.\n\n"
    "examples:\n"
    "  vlmoe vq train --model vlmoe-tiny --size 1024 -o cb.safetensors\n"
    "  vlmoe train --model vlmoe-tiny --codebook cb.safetensors --steps 300 --save-every-n-steps 100\n"
    "  vlmoe train --model vlmoe-tiny --codebook cb.safetensors --steps 300 --save-every-n-steps 100 \\\n"
    "              --resume latest      (the same flags as the first run)\n"
    "  vlmoe vq train --model vlmoe-tiny --size 1024 --image-data photos/ -o photos_cb.safetensors\n"
    "  vlmoe train --model vlmoe-tiny --codebook photos_cb.safetensors --image-data photos/ --text-data \\\n"
    "              sentences.txt --train-data pairs.csv --csv-caption-key caption --mix 1,1,2 --batch-size 48";

int cmd_train_mome(int argc, char **argv) {
    mome_args a = {.logs = "logs", .mix = "1,1,1", .scheduler = "cosine", .csv_separator = "\t", .batch = 48,
                   .log_every = 10, .keep = 3, .workers = 2, .steps = 300, .warmup = 30, .lr = 1e-3, .wd = 0.05,
                   .max_bad = 0.1};
    a.data = vlmoe_dataset_default_params();
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "NAME|FILE", "a VL-MoE (arch mome) model, e.g. vlmoe-tiny"},
        {"codebook", ARG_STRING, &a.codebook, "FILE", "MIM targets: a codebook from `vlmoe vq train` (mim_vocab entries)"},
        {"mix", ARG_STRING, &a.mix, "I,T,P", "weights of the image, text and pair streams in a step (1,1,1)"},
        {"image-data", ARG_STRING, &a.image_data, "DIR", "image-only data: the images under DIR, recursively"},
        {"text-data", ARG_STRING, &a.text_data, "FILE", "text-only data: one sentence per line"},
        {"train-data", ARG_STRING, &a.data.path, "PATH", "image-text pairs: an OpenCLIP CSV/TSV file or webdataset shards "
                                                       "('train-{000000..000099}.tar', lists joined by '::')"},
        {"dataset-type", ARG_STRING, &a.dataset_type, "TYPE", "of --train-data: csv, webdataset or auto (by the name; default)"},
        {"csv-separator", ARG_STRING, &a.csv_separator, "C", "CSV field separator (default tab; \\t for tab)"},
        {"csv-img-key", ARG_STRING, &a.data.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &a.data.caption_key, "NAME", "CSV column of captions (default title)"},
        {"workers", ARG_INT, &a.workers, "N", "threads reading --train-data ahead of the step (2; 0: the training thread)"},
        {"max-bad-fraction", ARG_DOUBLE, &a.max_bad, "F", "stop when more than this fraction of --train-data is bad (0.1)"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "texts' vocabulary: CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &a.image_mean, "R,G,B", "normalisation mean of image files (default CLIP's; [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &a.image_std, "R,G,B", "normalisation std of image files (default CLIP's; [-1, 1]: 0.5)"},
        {"batch-size", ARG_INT, &a.batch, "N", "samples per step, split by --mix (48)"},
        {"steps", ARG_LONG, &a.steps, "N", "training steps (300)"},
        {"lr", ARG_DOUBLE, &a.lr, "X", "peak learning rate (1e-3)"},
        {"lr-scheduler", ARG_STRING, &a.scheduler, "KIND", "cosine decay to 0 at --steps (default) or const"},
        {"warmup", ARG_LONG, &a.warmup, "N", "linear warmup steps (30)"},
        {"wd", ARG_DOUBLE, &a.wd, "X", "AdamW weight decay (0.05, VL-MoE sec. 4.1)"},
        {"seed", ARG_LONG, &a.seed, "N", "initialisation, data order, masks and routing noise (0)"},
        {"logs", ARG_STRING, &a.logs, "DIR", "log folder (logs)"},
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: the model name)"},
        {"log-every-n-steps", ARG_INT, &a.log_every, "N", "print and log losses and routing every N steps (10)"},
        {"save-every-n-steps", ARG_LONG, &a.save_every, "N", "checkpoint every N steps (default: at the end only)"},
        {"keep-checkpoints", ARG_INT, &a.keep, "K", "keep the newest K checkpoints (3, 0 = all)"},
        {"resume", ARG_STRING, &a.resume, "latest|FILE", "continue a run exactly: its newest usable checkpoint or step_N.safetensors"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
        {"grad-checkpointing", ARG_FLAG, &a.grad_ckpt, NULL, "not for VL-MoE models (an error naming why)"},
        {"lock-image", ARG_FLAG, &a.lock[0], NULL, "two_tower models only: VL-MoE has no separate towers (an error)"},
        {"lock-image-unlocked-groups", ARG_INT, &a.lock[1], "N", "with --lock-image (an error here)"},
        {"lock-text", ARG_FLAG, &a.lock[2], NULL, "two_tower models only (an error here)"},
        {"lock-text-unlocked-layers", ARG_INT, &a.lock[3], "N", "with --lock-text (an error here)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    int rc = args_parse(CMD, specs, ns, argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (a.threads > 0) omp_set_num_threads(a.threads);
    if (!a.model) return cli_error(CMD, "--model is required");
    // before any data is read: what vlmoe_model_set_grad_checkpointing and vlmoe_trainer_init say
    if (a.grad_ckpt)
        return cli_error(CMD, "--grad-checkpointing: model '%s' is VL-MoE (arch mome): gradient checkpointing is "
                         "implemented for the one_tower and two_tower architectures, not for VL-MoE", a.model);
    if (a.lock[0] || a.lock[1] || a.lock[2] || a.lock[3])
        return cli_error(CMD, "--lock-%s: model '%s' is VL-MoE (arch mome): one transformer runs images and texts, so "
                         "there is no separate tower to lock (LiT needs a two_tower model such as tiny-clip, ViT-B-32 or "
                         "ViT-B-16)", a.lock[0] || a.lock[1] ? "image" : "text", a.model);
    if (!a.codebook && !a.resume)
        return cli_error(CMD, "--codebook FILE is required: the MIM targets (make one with `vlmoe vq train`; a resumed "
                         "run takes its checkpoint's)");
    if (a.steps < 1 || a.log_every < 1 || a.save_every < 0 || a.keep < 0 || a.warmup < 0)
        return cli_error(CMD, "--steps and --log-every-n-steps must be >= 1, --save-every-n-steps, --keep-checkpoints "
                         "and --warmup >= 0");
    const int cosine = !strcmp(a.scheduler, "cosine");
    if (!cosine && strcmp(a.scheduler, "const"))
        return cli_error(CMD, "--lr-scheduler %s: expected cosine or const", a.scheduler);
    int w[3];
    if (parse_mix(a.mix, w)) return 1;
    if (a.data.path) {
        if (cli_dataset_type(CMD, a.dataset_type ? a.dataset_type : "auto", 0, &a.data.type)) return 1;
        if (cli_separator(CMD, a.csv_separator, &a.data.separator)) return 1;
        if (a.workers < 0 || !(a.max_bad >= 0 && a.max_bad <= 1))
            return cli_error(CMD, "--workers must be >= 0 and --max-bad-fraction in [0, 1]");
    } else if (a.dataset_type) {
        return cli_error(CMD, "--dataset-type applies to --train-data");
    }
    mome_cli r;
    memset(&r, 0, sizeof(r));
    if (vlmoe_config_load(a.model, &r.cfg)) return lib_error("");
    if (r.cfg.arch != VLMOE_ARCH_MOME) return cli_error(CMD, "model '%s' is not a VL-MoE (arch mome) model", a.model);
    vlmoe_mome_params p = {.config = &r.cfg, .batch_size = a.batch, .mix = {w[0], w[1], w[2]}, .seed = (uint64_t)a.seed,
                           .image_data = a.image_data, .text_data = a.text_data, .train_data = a.data,
                           .workers = a.workers, .max_bad_fraction = a.max_bad};
    vlmoe_mome_split sp;
    if (vlmoe_mome_split_batch(&p, &sp)) return lib_error("");
    const int pd = r.cfg.channels * r.cfg.patch_size * r.cfg.patch_size;
    int K, dim;
    if (a.codebook && vlmoe_codebook_load(a.codebook, r.cfg.mim_vocab, pd, &r.cb, &K, &dim)) return lib_error("--codebook");
    if ((rc = open_data(&a, &sp, &p, &r)) || (vlmoe_mome_init(&r.task, &p) && (rc = lib_error(""))))
        return run_free(&r), rc;
    const vlmoe_mome_report *rep = vlmoe_mome_get_report(r.task);
    if (rep->n_sentences) fprintf(stderr, "vlmoe train: texts: %zu sentences of %s\n", rep->n_sentences, a.text_data);
    if (r.n_images) fprintf(stderr, "vlmoe train: images: %d files under %s\n", r.n_images, a.image_data);
    if (rep->n_loader) {
        char what[64] = "webdataset shards";
        if (rep->loader_rows >= 0) snprintf(what, sizeof(what), "%lld usable rows", (long long)rep->loader_rows);
        fprintf(stderr, "vlmoe train: data %s (%s): %d of each step's samples, %d loader workers\n", a.data.path, what,
                rep->n_loader, a.workers);
    }
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.optim.beta2 = 0.999f; // VL-MoE sec. 4.1: Adam (0.9, 0.999), weight decay 0.05
    tp.optim.weight_decay = (float)a.wd;
    tp.schedule = (vlmoe_schedule){cosine ? VLMOE_SCHED_COSINE : VLMOE_SCHED_CONST, a.lr, a.warmup, a.steps, 0.0, 0, 0};
    // LOGS/NAME (NAME: --name or the model's), or the run a --resume FILE belongs to
    if (a.resume && strcmp(a.resume, "latest")) {
        vlmoe_run_dir_of(a.resume, r.dir, sizeof(r.dir));
    } else {
        snprintf(r.dir, sizeof(r.dir), "%s/%s", a.logs, a.name ? a.name : r.cfg.name);
        for (char *c = r.dir + strlen(a.logs) + 1; *c; c++)
            if (*c == '/') *c = '_'; // model names like S/32
    }
    snprintf(r.ckdir, sizeof(r.ckdir), "%s/checkpoints", r.dir);
    if (vlmoe_mkdir_p(r.ckdir)) rc = lib_error("");
    else vlmoe_ckpt_clean_tmp(r.ckdir), rc = setup_model(&a, &tp, &r);
    const long start = rc ? 0 : vlmoe_trainer_get_step(r.t);
    if (!rc && start >= a.steps) // -1: nothing to do, and no error
        printf("the run is at step %ld already, not before --steps %ld: nothing to train\n", start, a.steps), rc = -1;
    if (!rc) rc = write_run_files(&a, w, &r);
    if (rc) return run_free(&r), rc < 0 ? 0 : rc;
    const vlmoe_mome_split *s = &rep->split;
    fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d images + %d texts + %d pairs "
            "(forwards of %d), %d threads, run %s\n", r.cfg.name, vlmoe_model_num_floats(r.m), start, a.steps,
            s->n[0], s->n[1], s->n[2], s->chunk, omp_get_max_threads(), r.dir);
    const vlmoe_run_task task = vlmoe_mome_task(r.task);
    const vlmoe_run_params rp = {r.dir, a.steps, a.log_every, a.save_every, a.keep, 0, 0, a.batch, NULL, on_progress,
                                 r.task, 0};
    const int st = vlmoe_run_train(r.t, &task, &rp);
    if (st == VLMOE_ERR_NUMERIC)
        rc = cli_error(CMD, "diverged: %s. Nothing was written for this step; continue from the last checkpoint with "
                       "--resume latest (lower --lr or raise --warmup)", vlmoe_last_error());
    else if (st)
        rc = lib_error("");
    char wp[1024], spath[1024];
    vlmoe_ckpt_paths(r.ckdir, a.steps, wp, spath, sizeof(wp));
    if (!rc) printf("trained to step %ld; weights and the MIM codebook in %s\n", a.steps, wp);
    if (rep->bad_images) {
        fprintf(stderr, "vlmoe train: warning: --image-data %s: skipped %ld unreadable images (the next file took each "
                "one's place); first:", a.image_data, rep->bad_images);
        for (long i = 0; i < rep->n_bad_first && i < 3; i++) fprintf(stderr, "%s %s", i ? ";" : "", rep->bad_first[i]);
        fputc('\n', stderr);
    }
    if (rep->loader_stats && vlmoe_dataset_stats_bad(rep->loader_stats)) {
        char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
        vlmoe_dataset_stats_format(rep->loader_stats, sum, sizeof(sum));
        fprintf(stderr, "vlmoe train: warning: %s: %s\n", a.data.path, sum);
    }
    run_free(&r);
    return rc;
}
