// vlmoe_train.c: `vlmoe train` for VL-MoE (arch mome) models: pre-training by masked data modeling
// on image, text and pair streams (VL-MoE sec. 3.1). The flags become the task of
// src/train/mome_task.c and a run of the loop in src/train/run.c; this file lists the image files
// and reads the text file, sets up the model, prints and picks the exit code. Under mpirun every
// process trains its block of each global batch; rank 0 prints and writes. `vlmoe vq train`
// (the MIM codebook) is cli/vq.c; the set-up of a run is cli/vlmoe_train_setup.c. Covered by
// tests/test_vlmoe_train.c and tests/test_dist_mpi.sh.
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "common.h"
#include "nn/model.h"
#include "tokenize.h"
#include "train/tasks.h"
#include "train_flags.h"
#include "vlmoe_train.h"
#include "vlmoe_train_run.h"

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

// "I,T,P": three non-negative integer weights, not all zero.
static int parse_mix(const char *v, int w[3]) {
    char tail;
    if (sscanf(v, "%d,%d,%d%c", &w[0], &w[1], &w[2], &tail) != 3 || w[0] < 0 || w[1] < 0 || w[2] < 0 ||
        w[0] + w[1] + w[2] < 1)
        return cli_error(CMD, "--mix '%s': expected three non-negative integer weights IMAGES,TEXTS,PAIRS, not all 0 "
                         "(e.g. 1,1,1, the paper's equal thirds, or 0,1,0 for texts only)", v);
    return 0;
}

// --steps or --epochs, and --save-frequency (epochs) or --save-every-n-steps, as steps. An epoch
// is --train-num-samples samples of every stream together (10000 on the synthetic data): the
// streams' files have sizes of their own, none of which is the mixture's.
static int steps_epochs(mome_args *a, long steps_given) {
    cli_run_length len = {steps_given, a->epochs, a->save_epochs, a->save_every, a->num_samples, a->batch, a->steps, 0};
    if (cli_by_epoch(&len) && len.samples <= 0 && (a->image_data || a->text_data || a->data.path))
        return cli_error(CMD, "--%s counts epochs: give --train-num-samples N (the samples of all streams in an epoch; "
                         "or --save-every-n-steps)", a->epochs ? "epochs" : "save-frequency");
    if (len.samples <= 0) len.samples = cli_by_epoch(&len) ? 10000 : 0;
    if (cli_run_length_set(CMD, &len)) return 1;
    a->steps = len.steps, a->save_every = len.save_every, a->num_samples = len.samples;
    return 0;
}

static int synthetic(const vlmoe_mome_split *sp) {
    for (int k = 0; k < VLMOE_MOME_STREAMS; k++)
        if (sp->src[k] == VLMOE_MOME_SYNTH) return 1;
    return 0;
}

static void on_warn(void *u, const char *msg) { fprintf(stderr, "vlmoe train: %s\n", msg); }

// params.json: every flag that shapes the run (the --resume check compares them), strings that
// were not given as null.
// The streams' samples and the forward size are the global ones (the process count times this
// process's), so that a run resumed on another number of processes compares equal.
static cJSON *run_params(const mome_args *a, const int w[3], const vlmoe_mome_split *sp, int world) {
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "model", a->model);
    cJSON_AddStringToObject(p, "codebook", a->codebook ? a->codebook : "(the checkpoint's)");
    cJSON *streams = cJSON_AddObjectToObject(p, "streams");
    for (int k = 0; k < VLMOE_MOME_STREAMS; k++) {
        cJSON *s = cJSON_AddObjectToObject(streams, vlmoe_mome_stream_name(k));
        cJSON_AddNumberToObject(s, "weight", w[k]);
        cJSON_AddNumberToObject(s, "per_step", (double)sp->n[k] * world);
        cJSON_AddStringToObject(s, "source", vlmoe_mome_source_name(sp->src[k]));
    }
    const char sep[2] = {a->data.separator, 0};
    const char *key[] = {"image_data", "text_data", "train_data", "dataset_type", "csv_separator", "csv_img_key",
                         "csv_caption_key", "tokenizer", "image_mean", "image_std"};
    const char *val[] = {a->image_data, a->text_data, a->data.path, a->data.path ? a->dataset_type ? a->dataset_type : "auto" : NULL,
                         a->data.path ? sep : NULL, a->data.path ? a->data.img_key : NULL,
                         a->data.path ? a->data.caption_key : NULL, a->tokenizer, a->image_mean, a->image_std};
    for (int i = 0; i < 10; i++) cJSON_AddItemToObject(p, key[i], val[i] ? cJSON_CreateString(val[i]) : cJSON_CreateNull());
    cJSON_AddBoolToObject(p, "dataset_resampled", a->resampled);
    cJSON_AddItemToObject(p, "train_data_upsampling_factors", a->upsampling ? cJSON_CreateString(a->upsampling)
                                                                             : cJSON_CreateNull());
    const char *nk[] = {"batch_size", "world_size", "global_batch_size", "chunk", "steps", "epochs", "train_num_samples",
                        "seed", "save_frequency", "save_every_n_steps", "keep_checkpoints", "log_every_n_steps",
                        "workers", "max_bad_fraction", "threads"};
    const double nv[] = {a->batch, world, (double)a->batch * world, (double)sp->chunk * world, (double)a->steps,
                         (double)a->epochs, (double)a->num_samples, (double)a->seed, (double)a->save_epochs,
                         (double)a->save_every, a->keep, a->log_every, a->workers, a->max_bad, omp_get_max_threads()};
    for (int i = 0; i < 15; i++) cJSON_AddNumberToObject(p, nk[i], nv[i]);
    cJSON_AddNumberToObject(p, "drop_path", a->drop_path);
    cJSON_AddStringToObject(p, "device", a->device ? a->device : "cpu");
    // the augmentations of image files (null where a stream is synthetic: mome_open_data then
    // augments nothing)
    const int files = !synthetic(sp);
    cJSON_AddItemToObject(p, "hflip", files ? cJSON_CreateNumber(isnan(a->hflip) ? 0.5 : a->hflip) : cJSON_CreateNull());
    cJSON_AddItemToObject(p, "color_jitter", files ? cJSON_CreateNumber(isnan(a->color_jitter) ? 0.4 : a->color_jitter)
                                                   : cJSON_CreateNull());
    cli_optim_json(p, &a->o);
    return p;
}

// A fresh run writes config.json and params.json; a resumed one keeps them (the user's record)
// and, when it goes on with changed flags, logs them in params_resumed.json.
static int write_run_files(const mome_args *a, const int w[3], mome_cli *r, cJSON *changes) {
    cJSON *p = run_params(a, w, &vlmoe_mome_get_report(r->task)->split, r->dist->world);
    if (a->resume) return changes ? cli_resume_record(CMD, r->dir, p, changes, vlmoe_trainer_get_step(r->t))
                                  : (cJSON_Delete(p), 0);
    cJSON_Delete(changes); // a run started again from step 0 (cli_resume_fresh) writes its record anew
    return vlmoe_run_write_files(r->dir, &r->cfg, p) ? mome_lib_error("") : 0;
}

// --report-every and --report-to tensorboard after a logged step (rank 0), as `vlmoe train` does
// for contrastive runs (cli/train.c): the events of the new records, and the page from the
// metrics so far and the newest checkpoint. A report that fails is a warning: the run goes on.
static void report_step(mome_cli *r, int last) {
    const long step = vlmoe_trainer_get_step(r->t);
    if (r->tb.tb && cli_tb_sync(CMD, &r->tb)) fprintf(stderr, "vlmoe train: warning: --report-to tensorboard stops\n"),
        cli_tb_close(&r->tb);
    if (!(r->report_every && (step >= r->next_report || last))) return;
    r->next_report = (step / r->report_every + 1) * r->report_every;
    const cli_report_opts o = {.run_dir = r->dir, .nexamples = 4, .max_points = 600, .html = 1, .tb = r->tb.tb,
                               .quiet = 1};
    if (cli_report_write(CMD, &o)) fprintf(stderr, "vlmoe train: warning: the report of step %ld failed\n", step);
}

// Step lines on stdout, each followed by the routing of the streams; checkpoints are not announced.
// u is the run (mome_cli), not the task, so that the reports can reach its folder and trainer.
static void on_progress(void *u, int what, const char *line) {
    if (what != VLMOE_RUN_STEP) return;
    mome_cli *r = u;
    const vlmoe_mome_report *rep = vlmoe_mome_get_report(r->task);
    printf("%s\n", line);
    if (rep->routing[0]) printf("  routing  %s\n", rep->routing);
    fflush(stdout);
    if (r->lead) report_step(r, 0);
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
    "pairs from --train-data (an OpenCLIP CSV/TSV or webdataset shards, 'pipe:COMMAND' ones and\n"
    "--dataset-resampled too, read as vlmoe train reads them for CLIP models; CSV image paths are\n"
    "relative to the working directory, else the CSV's folder, with a note); --train-data also\n"
    "gives images and texts where --image-data / --text-data are\n"
    "not given. Folder images and sentences are visited once per epoch in an order drawn from --seed;\n"
    "images are random-resized-cropped and normalised (--image-mean/--image-std, CLIP's by default).\n"
    "Texts go through --tokenizer (CLIP merges or HF tokenizer.json; the model's mask_token must lie\n"
    "outside it), else a BPE vocabulary trained on the texts (LOGS/NAME/tokenizer.txt), to which a\n"
    "vocabulary the config leaves open is sized, [MASK] after it; checkpoints carry it.\n\n"
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
    "              sentences.txt --train-data pairs.csv --csv-caption-key caption --mix 1,1,2 --batch-size 48\n\n"
    "--resume checks the flags against the run's params.json (model, batch, streams, data, tokenizer,\n"
    "normalisation, seed, schedule, optimizer): a change is an error naming the values, unless\n"
    "--resume-allow-changes (each change is then printed and logged in params_resumed.json).\n"
    "--steps/--epochs may be raised to train longer (the schedule is derived again from them).\n\n"
    CLI_PROGRESS_HELP
    "  MIM L (acc A)             image stream: masked image modeling loss and accuracy\n"
    "  MLM L (acc A)             text stream: masked language modeling loss and accuracy\n"
    "  VLM T + I (acc a/b)       pair stream: its text and image masked losses and accuracies\n"
    "  aux A                     the weighted MoE auxiliary losses\n"
    "  lr, samples/s, ETA        the learning rate, the throughput, the time to --steps\n"
    "  routing  STREAM: bN V-MoE|T-MoE success S dropped D experts E, ...   the next line: per\n"
    "                            MoE block, the share of tokens placed with an expert, of\n"
    "                            assignments dropped, and the experts in use";

// After the options (--help): the usage above fills one string literal.
static const char *USAGE_MORE =
    "Several processes: `mpirun -np N vlmoe train ...` trains data-parallel. --batch-size is per\n"
    "process (the global batch is N times it, split by --mix on every process alike); each process\n"
    "takes its block of every forward, with the masks and routing noise of the samples' global\n"
    "indices, so N processes train the model one process trains at N x --batch-size (with routing\n"
    "groups of whole sequences: a group_size in a JSON config; docs/DISTRIBUTED.md). Rank 0 prints\n"
    "and writes; params.json records world_size and global_batch_size; a checkpoint resumes on any\n"
    "number of processes at the same global batch.\n";

int cmd_train_mome(int argc, char **argv) {
    mome_args a = {.logs = "logs", .mix = "1,1,1", .csv_separator = "\t", .batch = 48, .log_every = 10, .keep = 3,
                   .workers = 2, .steps = 300, .max_bad = 0.1, .drop_path = NAN, .hflip = NAN, .color_jitter = NAN,
                   .o = {.optimizer = NULL, .scheduler = "cosine", .lr = NAN, .wd = NAN, .beta1 = NAN, .beta2 = NAN,
                         .eps = NAN, .grad_clip = 1.0, .warmup = 30, .cooldown = 0, .momentum_dtype = NULL}};
    long steps_given = -1, max_pixels = 0;
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
        {"dataset-resampled", ARG_FLAG, &a.resampled, NULL, "webdataset --train-data: draw shards with replacement from "
                                                             "--seed (no epoch end)"},
        {"train-data-upsampling-factors", ARG_STRING, &a.upsampling, "F1::F2", "with --dataset-resampled: sampling weight "
                                                                              "of each '::'-joined --train-data source's shards"},
        {"max-bad-fraction", ARG_FRAC, &a.max_bad, "F", "stop when more than this fraction of --train-data is bad (0.1)"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "texts' vocabulary: CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &a.image_mean, "R,G,B", "normalisation mean of image files (default CLIP's; [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &a.image_std, "R,G,B", "normalisation std of image files (default CLIP's; [-1, 1]: 0.5)"},
        {"batch-size", ARG_INT1, &a.batch, "N", "samples per step and process, split by --mix (48)"},
        {"steps", ARG_LONG, &steps_given, "N", "training steps (300)"},
        {"epochs", ARG_LONG, &a.epochs, "N", "train for N epochs of --train-num-samples instead of --steps"},
        {"train-num-samples", ARG_LONG, &a.num_samples, "N", "samples (of all streams) per epoch for --epochs and "
                                                          "--save-frequency (synthetic data: 10000)"},
        {"lr", ARG_POS, &a.o.lr, "X", "peak learning rate (2e-3, VL-MoE sec. 4.1)"},
        {"lr-scheduler", ARG_STRING, &a.o.scheduler, "KIND", "cosine decay to 0 at --steps (default), rsqrt (with "
                                                             "--lr-cooldown-steps) or const"},
        {"lr-cooldown-steps", ARG_LONG, &a.o.cooldown, "N", "rsqrt: linear cooldown to 0 over the last N steps"},
        {"warmup", ARG_LONG, &a.o.warmup, "N", "linear warmup steps (30)"},
        {"wd", ARG_DOUBLE, &a.o.wd, "X", "decoupled weight decay (0.05, VL-MoE sec. 4.1; Adafactor: "
                                                        "1e-5 times the schedule, big_vision's)"},
        {"optimizer", ARG_STRING, &a.o.optimizer, "NAME", "adamw (default) or adafactor"},
        {"beta1", ARG_BETA, &a.o.beta1, "B1", "AdamW beta1 / Adafactor momentum (0.9; 0: none)"},
        {"momentum-dtype", ARG_STRING, &a.o.momentum_dtype, "T", "Adafactor: momentum in float32 (default) or bfloat16"},
        {"beta2", ARG_BETA, &a.o.beta2, "B2", "AdamW beta2 (0.999, VL-MoE sec. 4.1)"},
        {"eps", ARG_POS, &a.o.eps, "EPS", "AdamW epsilon (1e-6)"},
        {"grad-clip-norm", ARG_DOUBLE, &a.o.grad_clip, "NORM", "clip the global gradient norm (1.0, 0 = off)"},
        {"hflip", ARG_FRAC, &a.hflip, "P", "image files: horizontal flip probability (0.5, as BEiT / VL-MoE)"},
        {"color-jitter", ARG_DOUBLE, &a.color_jitter, "S", "image files: brightness, contrast and saturation jitter "
                                                           "(0.4, as BEiT / VL-MoE; 0: off)"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
        {"drop-path", ARG_DOUBLE, &a.drop_path, "RATE", "stochastic depth of the last block, rising linearly from 0 "
                                                        "at the first (0.1, VL-MoE / BEiT; 0: off)"},
        {"seed", ARG_LONG, &a.seed, "N", "initialisation, data order, masks, drop path and routing noise (0)"},
        {"logs", ARG_STRING, &a.logs, "DIR", "log folder (logs)"},
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: the model name)"},
        {"log-every-n-steps", ARG_INT1, &a.log_every, "N", "print and log losses and routing every N steps (10)"},
        {"save-frequency", ARG_LONG, &a.save_epochs, "N", "checkpoint every N epochs (as OpenCLIP; default: at the end only)"},
        {"save-every-n-steps", ARG_LONG, &a.save_every, "N", "checkpoint every N steps (default: at the end only)"},
        {"keep-checkpoints", ARG_INT, &a.keep, "K", "keep the newest K checkpoints (3, 0 = all)"},
        {"resume", ARG_STRING, &a.resume, "latest|FILE", "continue a run exactly: its newest usable checkpoint or step_N.safetensors"},
        {"resume-allow-changes", ARG_FLAG, &a.allow_changes, NULL, "--resume with flags that differ from the run's "
                                                                     "params.json (each logged; else an error)"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
        {"device", ARG_STRING, &a.device, "cpu|cuda[:N]", "where the model trains (default cpu; the optimizer and "
                                                          "checkpoints keep the host's copy)"},
        {"report-every", ARG_LONG, &a.report_every, "N", "write LOGS/NAME/report.html (vlmoe report) at the first log "
                                                         "step of every N steps and at the end (default 0: never)"},
        {"report-to", ARG_STRING, &a.report_to, "tensorboard", "also write TensorBoard event files of the metrics to "
                                                               "LOGS/NAME/tensorboard/"},
        {"grad-checkpointing", ARG_FLAG, &a.grad_ckpt, NULL, "not for VL-MoE models (an error naming why)"},
        {"recompute-attention", ARG_STRING, &a.recompute_attn, "auto", "VL-MoE recomputes each block's attention "
                                                                       "in the backward: auto or on (off is an error)"},
        {"lock-image", ARG_FLAG, &a.lock[0], NULL, "two_tower models only: VL-MoE has no separate towers (an error)"},
        {"lock-image-unlocked-groups", ARG_INT, &a.lock[1], "N", "with --lock-image (an error here)"},
        {"lock-text", ARG_FLAG, &a.lock[2], NULL, "two_tower models only (an error here)"},
        {"lock-text-unlocked-layers", ARG_INT, &a.lock[3], "N", "with --lock-text (an error here)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    // the contrastive trainer's validation flags: said so, rather than "unknown flag"
    static const char *const val_flags[] = {"--val-data", "--val-frequency", "--val-every-n-steps", "--val-num-samples",
                                            "--zeroshot-data", "--zeroshot-frequency", "--zeroshot-every-n-steps",
                                            "--zeroshot-classnames", "--zeroshot-templates", "--zeroshot-dataset",
                                            "--eval-samples"};
    for (int i = 2; i < argc; i++)
        for (size_t k = 0; k < sizeof(val_flags) / sizeof(val_flags[0]); k++) {
            const size_t n = strlen(val_flags[k]);
            if (!strncmp(argv[i], val_flags[k], n) && (argv[i][n] == 0 || argv[i][n] == '='))
                return cli_error(CMD, "%s: the VL-MoE trainer (arch mome models) has no validation while training; it "
                                 "is a flag of contrastive training (LIMoE, CLIP). Evaluate the checkpoints after the "
                                 "run instead", val_flags[k]);
        }
    static const char *const contrastive[] = {"pretrained", "preset", "zeroshot-frequency", "eval-samples",
                                              "expert-parallel", "image-size", "context-length", NULL};
    if (cli_reject_flags(CMD, argc, argv, contrastive, "applies to contrastive models (one_tower, two_tower), not "
                         "VL-MoE (arch mome) pre-training"))
        return 1;
    for (int i = 2; i < argc; i++) // contrastive training's flag, named rather than unknown here
        if (!strncmp(argv[i], "--accum-freq", 12) && (!argv[i][12] || argv[i][12] == '='))
            return cli_error(CMD, "--accum-freq is for contrastive models (one_tower, two_tower); a VL-MoE (arch mome) "
                             "step already sums the gradients of its streams' forwards: give a larger --batch-size");
    args_set_epilogue(USAGE_MORE);
    int rc = args_parse(CMD, specs, ns, argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    cli_set_max_image_pixels(max_pixels);
    if (a.threads > 0) omp_set_num_threads(a.threads);
    if (!a.model) return cli_error(CMD, "--model is required");
    // before any data is read: what vlmoe_model_set_grad_checkpointing and vlmoe_trainer_init say
    if (a.grad_ckpt)
        return cli_error(CMD, "--grad-checkpointing: model '%s' is VL-MoE (arch mome): gradient checkpointing is "
                         "implemented for the one_tower and two_tower architectures, not for VL-MoE", a.model);
    if (a.recompute_attn && strcmp(a.recompute_attn, "auto") && strcmp(a.recompute_attn, "on"))
        return cli_error(CMD, "--recompute-attention %s: model '%s' is VL-MoE (arch mome), whose blocks always recompute "
                         "their attention in the backward; keeping it is implemented for the one_tower and two_tower "
                         "architectures (expected auto or on)", a.recompute_attn, a.model);
    if (a.lock[0] || a.lock[1] || a.lock[2] || a.lock[3])
        return cli_error(CMD, "--lock-%s: model '%s' is VL-MoE (arch mome): one transformer runs images and texts, so "
                         "there is no separate tower to lock (LiT needs a two_tower model such as tiny-clip, ViT-B-32 or "
                         "ViT-B-16)", a.lock[0] || a.lock[1] ? "image" : "text", a.model);
    if (a.device) { // a device that cannot be opened stops the run before anything is read or written
        const vlmoe_backend_f32 *be;
        vlmoe_backend_f32 *owned = NULL;
        if (backend_by_name(&be, &owned, a.device)) return cli_error(CMD, "--device: %s", vlmoe_last_error());
        backend_cuda_free(owned);
    }
    if (!a.codebook && !a.resume)
        return cli_error(CMD, "--codebook FILE is required: the MIM targets (make one with `vlmoe vq train`; a resumed "
                         "run takes its checkpoint's)");
    if (steps_epochs(&a, steps_given)) return 1;
    if (a.steps < 1 || a.log_every < 1 || a.keep < 0)
        return cli_error(CMD, "--steps and --log-every-n-steps must be >= 1, --keep-checkpoints >= 0");
    if (a.allow_changes && !a.resume) return cli_error(CMD, "--resume-allow-changes applies to --resume");
    if (!isnan(a.drop_path) && !(a.drop_path >= 0 && a.drop_path < 1))
        return cli_error(CMD, "--drop-path %g: expected a rate in [0, 1)", a.drop_path);
    if (!isnan(a.hflip) && !(a.hflip >= 0 && a.hflip <= 1))
        return cli_error(CMD, "--hflip %g: expected a probability in [0, 1]", a.hflip);
    if (!isnan(a.color_jitter) && !(a.color_jitter >= 0 && a.color_jitter <= 100))
        return cli_error(CMD, "--color-jitter %g: expected a strength in [0, 100] (timm's 0.4)", a.color_jitter);
    if (a.report_to && strcmp(a.report_to, "tensorboard"))
        return cli_error(CMD, "--report-to: '%s' is not supported (tensorboard; wandb is not built in)", a.report_to);
    int w[3];
    if (parse_mix(a.mix, w)) return 1;
    if (a.data.path) {
        if (cli_dataset_type(CMD, a.dataset_type ? a.dataset_type : "auto", 0, &a.data.type)) return 1;
        if (cli_separator(CMD, a.csv_separator, &a.data.separator)) return 1;
        if (a.workers < 0 || !(a.max_bad >= 0 && a.max_bad <= 1))
            return cli_error(CMD, "--workers must be >= 0 and --max-bad-fraction in [0, 1]");
    } else {
        static const char *const file[] = {"dataset-type", "csv-separator", "csv-img-key", "csv-caption-key", "workers",
                                           "max-bad-fraction", NULL};
        if (cli_reject_flags(CMD, argc, argv, file, "applies to --train-data")) return 1;
    }
    if (cli_resampling(CMD, &a.data, a.resampled, a.upsampling)) return 1;
    vlmoe_dist *dist = NULL; // started by mpirun: this process's rank in the run
    if (vlmoe_dist_open(&dist, "auto")) return mome_lib_error("");
    cli_set_dist(dist); // errors say which process met them; a collective timeout ends the job
    a.data.note = dist->rank == 0 ? on_warn : NULL; // how CSV image paths were found, once
    mome_cli r;
    memset(&r, 0, sizeof(r));
    r.dist = dist, r.lead = dist->rank == 0;
    const int W = dist->world;
    if (vlmoe_config_load(a.model, &r.cfg)) return mome_lib_error("");
    if (r.cfg.arch != VLMOE_ARCH_MOME) return cli_error(CMD, "model '%s' is not a VL-MoE (arch mome) model", a.model);
    vlmoe_mome_params p = {.config = &r.cfg, .batch_size = a.batch, .mix = {w[0], w[1], w[2]}, .seed = (uint64_t)a.seed,
                           .image_data = a.image_data, .text_data = a.text_data, .train_data = a.data,
                           .workers = a.workers, .max_bad_fraction = a.max_bad, .resampled = a.resampled,
                           .upsampling = a.upsampling, .rank = dist->rank, .world = W,
                           .agree = cli_loader_agree, .agree_user = dist};
    vlmoe_mome_split sp;
    if (vlmoe_mome_split_batch(&p, &sp)) return mome_lib_error("");
    const int pd = r.cfg.channels * r.cfg.patch_size * r.cfg.patch_size;
    int K, dim;
    if (a.codebook && vlmoe_codebook_load(a.codebook, r.cfg.mim_vocab, pd, &r.cb, &K, &dim)) return mome_lib_error("--codebook");
    // LOGS/NAME (NAME: --name or the model's), or the run a --resume FILE belongs to
    if (a.resume && strcmp(a.resume, "latest")) {
        vlmoe_run_dir_of(a.resume, r.dir, sizeof(r.dir));
    } else {
        snprintf(r.dir, sizeof(r.dir), "%s/%s", a.logs, a.name ? a.name : r.cfg.name);
        for (char *c = r.dir + strlen(a.logs) + 1; *c; c++)
            if (*c == '/') *c = '_'; // model names like S/32
    }
    snprintf(r.ckdir, sizeof(r.ckdir), "%s/checkpoints", r.dir);
    const cli_input in[] = {{"--text-data", a.text_data}, {"--train-data", a.data.path}, {"--codebook", a.codebook},
                            {"--model", a.model}};
    if (cli_check_run_outputs(CMD, r.dir, in, 4)) return mome_run_free(&r, 1), 1;
    struct stat dir_sb; // a --resume latest of a run folder that exists but holds no checkpoint starts again
    const int existed = stat(r.dir, &dir_sb) == 0;
    if (vlmoe_mkdir_p(r.dir)) return rc = mome_lib_error(""), mome_run_free(&r, rc), rc;
    if (cli_run_lock(CMD, r.dir, dist, dist->rank == 0)) return mome_run_free(&r, 1), 1;
    if (existed && cli_run_taken(CMD, r.dir, a.resume)) return mome_run_free(&r, 1), 1;
    if (vlmoe_mkdir_p(r.ckdir)) return rc = mome_lib_error(""), mome_run_free(&r, rc), rc;
    vlmoe_train_params tp = vlmoe_train_default_params();
    if (a.resume) { // flags not given go on as the run had them, also where the run is older than the flag
        cJSON *rec = cli_run_record(r.dir);
        cli_resumed_optim(rec, &a.o);
        if (isnan(a.drop_path)) a.drop_path = cli_resumed_num(rec, "drop_path", NAN);
        if (!synthetic(&sp) && isnan(a.hflip)) a.hflip = cli_resumed_num(rec, "hflip", NAN);
        if (!synthetic(&sp) && isnan(a.color_jitter)) a.color_jitter = cli_resumed_num(rec, "color_jitter", NAN);
        cJSON_Delete(rec);
    }
    if (isnan(a.drop_path)) a.drop_path = 0.1; // VL-MoE pre-trains with stochastic depth 0.1
    // VL-MoE sec. 4.1: Adam (0.9, 0.999), weight decay 0.05
    cli_paper_optim("vlmoe", &a.o);
    if (cli_optim_params(CMD, &a.o, a.steps, 0.999, &tp)) return mome_run_free(&r, 1), 1;
    // --resume: the flags against the run's before anything is read or written
    cJSON *changes = NULL, *now = a.resume ? run_params(&a, w, &sp, W) : NULL;
    rc = now && cli_resume_check(CMD, r.dir, now, (r.lead ? CLI_RESUME_PRINT : 0) | (a.allow_changes ? CLI_RESUME_ALLOW : 0),
                                 &changes);
    cJSON_Delete(now);
    if (rc) return mome_run_free(&r, rc), rc;
    cli_resume_fresh(CMD, r.dir, existed, &a.resume, r.lead);
    if ((rc = mome_open_data(&a, &sp, &p, &r)) || (vlmoe_mome_init(&r.task, &p) && (rc = mome_lib_error(""))))
        return cJSON_Delete(changes), mome_run_free(&r, rc), rc;
    const vlmoe_mome_report *rep = vlmoe_mome_get_report(r.task);
    if (r.lead && rep->n_sentences) fprintf(stderr, "vlmoe train: texts: %zu sentences of %s\n", rep->n_sentences, a.text_data);
    if (r.lead && r.n_images) fprintf(stderr, "vlmoe train: images: %d files under %s\n", r.n_images, a.image_data);
    if (r.lead && rep->n_loader) {
        char what[64] = "webdataset shards";
        if (rep->loader_rows >= 0) snprintf(what, sizeof(what), "%lld usable rows", (long long)rep->loader_rows);
        fprintf(stderr, "vlmoe train: data %s (%s): %d of each step's samples%s, %d loader workers\n", a.data.path, what,
                rep->n_loader, W > 1 ? " per process (every process reads the global batch)" : "", a.workers);
    }
    if (r.lead) vlmoe_ckpt_clean_tmp(r.ckdir);
    rc = mome_setup_model(&a, &tp, &p, &r);
    const long start = rc ? 0 : vlmoe_trainer_get_step(r.t);
    if (!rc && start >= a.steps && !r.lead) rc = -1;
    if (!rc && start >= a.steps) // -1: nothing to do, and no error
        printf("the run is at step %ld already, not before --steps %ld: nothing to train\n", start, a.steps), rc = -1;
    if (!rc && r.lead) rc = write_run_files(&a, w, &r, changes), changes = NULL;
    cJSON_Delete(changes);
    if (rc) return mome_run_free(&r, rc < 0 ? 0 : rc), rc < 0 ? 0 : rc;
    const vlmoe_mome_split *s = &rep->split;
    char procs[96] = ""; // on several processes: the global batch's make-up
    if (W > 1)
        snprintf(procs, sizeof(procs), " (%d processes x %d: %d + %d + %d, forwards of %d each)", W, a.batch, s->n[0],
                 s->n[1], s->n[2], s->chunk);
    if (r.lead)
        fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d images + %d texts + %d pairs "
                "(forwards of %d)%s, %d threads%s, run %s\n", r.cfg.name, vlmoe_model_num_floats(r.m), start, a.steps,
                W * s->n[0], W * s->n[1], W * s->n[2], W * s->chunk, procs, omp_get_max_threads(), W > 1 ? " each" : "",
                r.dir);
    if (r.lead && W > 1) { // routing over groups of the whole forward sees this process's block only
        const vlmoe_moe_config *mc[2] = {&r.cfg.moe, &r.cfg.text_moe};
        const int g = r.cfg.image_size / r.cfg.patch_size, len[2] = {1 + g * g, r.cfg.context_length};
        for (int e = 0; e < 2; e++)
            if (mc[e]->router != VLMOE_ROUTER_NONE && mc[e]->group_size == 0)
                fprintf(stderr, "vlmoe train: note: on %d processes the %s MoE layers route each process's %d samples "
                        "of a forward as one group (group_size 0), not the %d of the one-process forward; a group_size "
                        "of whole sequences (a multiple of %d that divides %d x %d) routes as one process would (JSON "
                        "config)\n", W, e ? "T" : "V", s->chunk, W * s->chunk, len[e], s->chunk, len[e]);
    }
    const vlmoe_run_task task = vlmoe_mome_task(r.task);
    const vlmoe_run_params rp = {r.dir, a.steps, a.log_every, a.save_every, a.keep, 0, 0, (long)a.batch * W, dist,
                                 on_progress, &r, 0};
    r.report_every = a.report_every, r.next_report = a.report_every;
    if (r.lead && a.report_to && cli_tb_open(CMD, r.dir, &r.tb)) return mome_run_free(&r, 1), 1;
    const int st = vlmoe_run_train(r.t, &task, &rp);
    if (st == VLMOE_ERR_NUMERIC)
        rc = cli_error(CMD, "diverged: %s. Nothing was written for this step; continue from the last checkpoint with "
                       "--resume latest (lower --lr or raise --warmup)", vlmoe_last_error());
    else if (st)
        rc = mome_lib_error("");
    char wp[1024], spath[1024];
    vlmoe_ckpt_paths(r.ckdir, a.steps, wp, spath, sizeof(wp));
    if (!rc && r.lead) printf("trained to step %ld; weights and the MIM codebook in %s\n", a.steps, wp);
    if (!rc && r.lead && (r.report_every || r.tb.tb)) { // the last checkpoint is written by now
        report_step(&r, 1);
        if (r.report_every) printf("report: %s/report.html\n", r.dir);
        if (r.tb.tb) printf("tensorboard: %s\n", report_tb_path(r.tb.tb));
    }
    if (rep->bad_images) { // every process reports the images it skipped
        fprintf(stderr, "vlmoe train: warning: --image-data %s: skipped %ld unreadable images (the next file took each "
                "one's place); first:", a.image_data, rep->bad_images);
        for (long i = 0; i < rep->n_bad_first && i < 3; i++) fprintf(stderr, "%s %s", i ? ";" : "", rep->bad_first[i]);
        fputc('\n', stderr);
    }
    if (r.lead && rep->loader_stats && vlmoe_dataset_stats_bad(rep->loader_stats)) {
        char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
        vlmoe_dataset_stats_format(rep->loader_stats, sum, sizeof(sum));
        fprintf(stderr, "vlmoe train: warning: %s: %s\n", a.data.path, sum);
    }
    mome_run_free(&r, rc);
    return rc;
}
