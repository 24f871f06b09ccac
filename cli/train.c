// train.c: `vlmoe train`: contrastive training behind OpenCLIP-style flags, on the built-in
// synthetic data or on an OpenCLIP CSV / webdataset shards through the loader (src/data/loader.h).
// The flags become a model source, a data source and a run (src/train/run.h, the contrastive task
// of src/train/tasks.h); this file prints and picks the exit code. Covered by tests/test_cli.c,
// tests/test_checkpoint.c and tests/test_loader.c. The set-up of a run is cli/train_setup.c.
#include <cjson/cJSON.h>
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
#include "outputs.h"
#include "common.h"
#include "dist/watchdog.h"
#include "nn/model.h"
#include "train_run.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe train [options]\n\n"
    "Trains a contrastive image-text model (LIMoE one_tower or CLIP two_tower, dense or MoE) and\n"
    "writes LOGS/NAME/{config.json, params.json, metrics.jsonl, checkpoints/step_N.safetensors}.\n"
    "A checkpoint is step_N.safetensors (weights + config, loadable by every command) plus\n"
    "step_N.state.safetensors (optimizer moments, step, RNG states, data position); --resume latest\n"
    "continues exactly where the newest complete checkpoint left off, with the next samples.\n\n"
    "Data: the built-in synthetic data, or --train-data: an OpenCLIP CSV/TSV (image paths relative to\n"
    "the working directory, as in OpenCLIP, else to the CSV's folder, with a note) or webdataset shards\n"
    "(000123.jpg + 000123.txt; 'pipe:COMMAND' reads a shard from a command's output, e.g.\n"
    "'pipe:aws s3 cp s3://bucket/shard-{000..099}.tar -'; --dataset-resampled draws shards with\n"
    "replacement, weighted by --train-data-upsampling-factors), read by --workers threads that\n"
    "decode, random-resized-crop to the model's image size, normalise (--image-mean/--image-std)\n"
    "and tokenize ahead of the step; shuffled per epoch from --seed, the same for any --workers.\n"
    "Bad samples are skipped and counted; more than --max-bad-fraction of them stops the run.\n"
    "--accum-freq N (OpenCLIP's): a step takes N micro-batches of --batch-size, caches their features,\n"
    "then runs each again with activations and backpropagates the loss over all N x batch-size pairs:\n"
    "the step of a batch N times larger (the same loss and gradient, to float rounding, when MoE\n"
    "routing groups split a micro-batch) in the activation memory of one micro-batch, for one more\n"
    "forward per sample. The global batch is processes x N x --batch-size; --steps, the schedule,\n"
    "the logs and checkpoints count optimizer steps of it.\n"
    "Without --tokenizer, a BPE vocabulary is trained on the first 10000 captions (LOGS/NAME/\n"
    "tokenizer.txt): of the model's size, or 1024 ids for a small named model, whose token embedding\n"
    "is then sized to it; a JSON config's \"vocab_size\" fixes the size. Checkpoints carry the\n"
    "tokenizer and the image normalisation, which every later command (and --pretrained, --resume)\n"
    "uses; flags that contradict them need --override-inputs.\n\n"
    "Validation (rank 0, at its cadence and after the last step; the eval record of metrics.jsonl\n"
    "holds the objects `vlmoe eval --json` prints for the same data, and a line goes to stdout):\n"
    "--val-data PATH: held-out pairs (an OpenCLIP CSV/TSV read with the --csv-* flags, or shards),\n"
    "images with the eval transform (resize, center crop, --image-mean/--image-std), captions with\n"
    "the run's tokenizer: contrastive loss and accuracy in batches of --batch-size, and recall@1/5/10\n"
    "both ways over all pairs (OpenCLIP's get_clip_metrics; R@1 is the top-1 accuracy).\n"
    "--zeroshot-data DIR: an image folder, one sub-folder per class: zero-shot top-1/top-5. On the\n"
    "synthetic data, its held-out split is evaluated too (--eval-samples). --val-frequency and\n"
    "--zeroshot-frequency count epochs as in OpenCLIP (an epoch: --train-num-samples, or the CSV's\n"
    "rows); --val-every-n-steps and --zeroshot-every-n-steps count steps.\n\n"
    "examples:\n"
    "  vlmoe train --model limoe-tiny --dataset-type synthetic --steps 300\n"
    "  vlmoe train --model limoe-S/32 --train-data cc3m.csv --csv-separator , --csv-img-key file \\\n"
    "              --csv-caption-key caption --tokenizer bpe_simple_vocab_16e6.txt.gz --workers 4\n"
    "  vlmoe train --model limoe-B/16 --train-data 'shards/train-{000000..000099}.tar' --steps 5000\n"
    "  vlmoe train --model my_config.json --batch-size 128 --lr 5e-4 --warmup 500 --steps 20000 \\\n"
    "              --save-every-n-steps 1000 --zeroshot-every-n-steps 1000 --name run1\n"
    "  vlmoe train --model limoe-S/32 --train-data train.csv --val-data val.csv --val-frequency 1 \\\n"
    "              --zeroshot-data imagenet/val --zeroshot-classnames en_classnames.json \\\n"
    "              --zeroshot-dataset imagenet1k --zeroshot-frequency 2 --epochs 10 --save-frequency 2\n"
    "  vlmoe train --name run1 --steps 40000 --resume latest      (same flags as the first run)";

static const char *USAGE_MORE =
    "--resume checks the flags against the run's params.json: a changed model, batch size, data,\n"
    "tokenizer, normalisation, seed, schedule (--lr-scheduler, --lr, --warmup, --wd, cooldown) or\n"
    "optimizer (and its betas, eps, clipping) is an error naming the values, unless\n"
    "--resume-allow-changes (each change is then printed and logged in params_resumed.json).\n"
    "--steps/--epochs may be raised to train longer: the schedule is derived again from the new\n"
    "length, as OpenCLIP does (the cosine then decays over the longer run from the resumed step).\n\n"
    CLI_PROGRESS_HELP
    "  aux A  success I/T        MoE models: auxiliary losses; the lowest routing success rate\n"
    "                            (share of tokens placed with an expert) of image / text tokens\n"
    "  acc I/T  T t              in-batch accuracy image->text / text->image; the temperature\n"
    "  lr, samples/s, ETA        the learning rate, the global throughput, the time to --steps\n"
    "Evaluations (--val-*, --zeroshot-*) print their own line on stdout.\n"
    "VL-MoE (arch mome) models train by masked data modeling: vlmoe train --model vlmoe-tiny --help";


// Progress of the run: step lines on stderr (redrawn in place on a terminal), evaluations on stdout.
// --report-every and --report-to tensorboard, after a train record (rank 0): the events of the
// new records, and the page from the metrics so far and the newest checkpoint. A report that
// fails is a warning: the run goes on.
static void report_step(train_run *r, int last) {
    const long step = vlmoe_trainer_get_step(r->t);
    if (r->tb.tb && cli_tb_sync("train", &r->tb)) fprintf(stderr, "vlmoe train: warning: --report-to tensorboard stops\n"),
        cli_tb_close(&r->tb);
    if (!(r->report_every && (step >= r->next_report || last))) return;
    r->next_report = (step / r->report_every + 1) * r->report_every;
    const cli_report_opts o = {.run_dir = r->dir, .nexamples = 4, .max_points = 600, .html = 1, .tb = r->tb.tb,
                               .quiet = 1};
    if (r->open_line) fputc('\n', stderr), r->open_line = 0;
    if (cli_report_write("train", &o)) fprintf(stderr, "vlmoe train: warning: the report of step %ld failed\n", step);
}

static void on_progress(void *u, int what, const char *line) {
    train_run *r = u;
    if (what == VLMOE_RUN_STEP) {
        fprintf(stderr, "%s%s%s", r->tty ? "\r\033[K" : "", line, r->tty ? "" : "\n");
        r->open_line = r->tty;
        report_step(r, 0);
        return;
    }
    if (r->open_line) fputc('\n', stderr), r->open_line = 0;
    if (what == VLMOE_RUN_EVAL) printf("%s\n", line), fflush(stdout);
}

// params.json: every flag that shapes the run (the --resume check compares them), strings that
// were not given as null.
static cJSON *run_params(const train_args *a, int world) {
    cJSON *pj = cJSON_CreateObject();
    const char *sk[] = {"model", "pretrained", "preset", "dataset_type", "train_data", "csv_img_key",
                        "csv_caption_key", "tokenizer", "image_mean", "image_std"};
    const char *sv[] = {a->pretrained ? NULL : a->model, a->pretrained, a->preset, a->dataset_type, a->data.path,
                        a->data.path ? a->data.img_key : NULL, a->data.path ? a->data.caption_key : NULL, a->tokenizer,
                        a->image_mean, a->image_std};
    for (int i = 0; i < 10; i++)
        cJSON_AddItemToObject(pj, sk[i], sv[i] ? cJSON_CreateString(sv[i]) : cJSON_CreateNull());
    char sep[2] = {a->data.separator, 0};
    cJSON_AddItemToObject(pj, "csv_separator", a->data.path ? cJSON_CreateString(sep) : cJSON_CreateNull());
    const char *nk[] = {"batch_size", "accum_freq", "world_size", "global_batch_size", "steps", "epochs", "train_num_samples", "seed",
                        "image_size", "context_length", "save_frequency", "save_every_n_steps", "keep_checkpoints",
                        "zeroshot_every_n_steps", "eval_samples", "log_every_n_steps", "workers", "max_bad_fraction",
                        "expert_parallel", "threads"};
    const double nv[] = {a->batch_size, a->accum_freq, world, (double)a->batch_size * a->accum_freq * world, (double)a->steps, (double)a->epochs,
                         (double)a->num_samples, (double)a->seed, a->image_size, a->context_length,
                         (double)a->save_epochs, (double)a->save_every, a->keep, (double)a->zeroshot_every,
                         a->eval_samples, a->log_every, a->workers, a->max_bad, a->expert_parallel,
                         omp_get_max_threads()};
    for (int i = 0; i < 20; i++) cJSON_AddNumberToObject(pj, nk[i], nv[i]);
    cJSON_AddBoolToObject(pj, "override_inputs", a->override);
    cJSON_AddBoolToObject(pj, "dataset_resampled", a->resampled);
    cJSON_AddItemToObject(pj, "train_data_upsampling_factors", a->upsampling ? cJSON_CreateString(a->upsampling)
                                                                              : cJSON_CreateNull());
    // validation: what it reads and the step cadence it runs at (0: at the end only)
    const char *vk[] = {"val_data", "zeroshot_data", "zeroshot_classnames", "zeroshot_templates", "zeroshot_dataset"};
    const char *vv[] = {a->val_data, a->zs_data, a->zs_names, a->zs_templates, a->zs_dataset};
    for (int i = 0; i < 5; i++) cJSON_AddItemToObject(pj, vk[i], vv[i] ? cJSON_CreateString(vv[i]) : cJSON_CreateNull());
    cJSON_AddNumberToObject(pj, "val_every_n_steps", (double)a->val_every);
    cJSON_AddNumberToObject(pj, "val_num_samples", (double)a->val_num);
    cJSON_AddBoolToObject(pj, "grad_checkpointing", a->grad_ckpt);
    cJSON_AddStringToObject(pj, "recompute_attention", a->recompute_attn ? a->recompute_attn : "auto");
    cJSON_AddBoolToObject(pj, "lock_image", a->lock_image);
    cJSON_AddNumberToObject(pj, "lock_image_unlocked_groups", a->lock_image_groups);
    cJSON_AddBoolToObject(pj, "lock_text", a->lock_text);
    cJSON_AddNumberToObject(pj, "lock_text_unlocked_layers", a->lock_text_layers);
    cli_optim_json(pj, &a->o);
    cJSON_AddStringToObject(pj, "device", a->device ? a->device : "cpu");
    cJSON_AddStringToObject(pj, "precision", a->precision ? a->precision : "fp32");
    return pj;
}

// A fresh run writes config.json and params.json; a resumed one keeps them (the user's record)
// and, when it goes on with changed flags, logs them in params_resumed.json.
static int write_run_files(const train_args *a, train_run *r, cJSON *changes) {
    cJSON *pj = run_params(a, r->dist->world);
    if (a->resume) return changes ? cli_resume_record("train", r->dir, pj, changes, vlmoe_trainer_get_step(r->t))
                                  : (cJSON_Delete(pj), 0);
    cJSON_Delete(changes); // a run started again from step 0 (cli_resume_fresh) writes its record anew
    return vlmoe_run_write_files(r->dir, vlmoe_model_get_config(r->m), pj) ? cli_error("train", "%s", vlmoe_last_error()) : 0;
}

// Flags that do not apply to this run are errors, never silently ignored.
static int check_applicable(const train_args *a, int argc, char **argv) {
    // (--tokenizer has its own message in setup_model)
    static const char *const loader[] = {"workers", "max-bad-fraction", NULL};
    static const char *const csv[] = {"csv-separator", "csv-img-key", "csv-caption-key", NULL};
    static const char *const norm[] = {"image-mean", "image-std", NULL};
    const char *why = "applies to --train-data (without it the run trains on the built-in synthetic data)";
    if (a->data.path) return 0;
    return cli_reject_flags("train", argc, argv, loader, why) ||
           (!a->val_data && cli_reject_flags("train", argc, argv, csv, "applies to --train-data and --val-data")) ||
           (!a->val_data && !a->zs_data &&
            cli_reject_flags("train", argc, argv, norm, "applies to image files: --train-data, --val-data, --zeroshot-data"));
}

// A choice the activation arena's layout depends on (--recompute-attention, --grad-checkpointing):
// made, the model planned for it now if it is not (a model moved to bf16's or a device's table
// has no plan until its first forward), and the arena said, with the one it replaces if the
// model had one.
static int set_arena_mode(train_run *r, int batch, const char *flag, const char *what,
                          int (*set)(vlmoe_model *, int), int mode) {
    const double mib = 1024.0 * 1024.0, was = r->m->g ? graph_activation_bytes_f32(r->m->g) / mib : 0;
    if (set(r->m, mode) || (!r->m->g && vlmoe_model_plan(r->m, batch)))
        return cli_error("train", "%s: %s", flag, vlmoe_last_error());
    if (!r->lead || !r->m->g) return 0;
    char instead[64] = "";
    if (was > 0) snprintf(instead, sizeof(instead), " instead of %.1f MiB", was);
    fprintf(stderr, "vlmoe train: %s: %sactivation arena %.1f MiB%s\n", flag, what,
            graph_activation_bytes_f32(r->m->g) / mib, instead);
    return 0;
}

// The run; *dist is the process group once it is open (left open when the run fails on several
// processes, for cmd_train to end the job with).
static int train_main(int argc, char **argv, vlmoe_dist **dist_out) {
    train_args a = {.model = "tiny", .logs = "./logs", .csv_separator = "\t", .batch_size = 64, .log_every = 10,
                    .eval_samples = -1, .keep = 3, .workers = 2, .steps = 300, .max_bad = 0.1, .accum_freq = 1,
                    .bucket_cap_mb = 25,
                    .o = {.optimizer = NULL, .scheduler = "cosine", .lr = NAN, .wd = NAN, .beta1 = NAN, .beta2 = NAN, .eps = NAN,
                          .grad_clip = 1.0, .warmup = 30, .cooldown = 0, .momentum_dtype = NULL}};
    a.data = vlmoe_dataset_default_params();
    long steps_given = -1, max_pixels = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &a.model, "NAME|FILE.json", "model config: a name (tiny, limoe-tiny, S/32, B/16, ViT-B-16, ...) or a JSON file"},
        {"pretrained", ARG_STRING, &a.pretrained, "FILE", "start from a vlmoe checkpoint (its config replaces --model)"},
        {"soft-dispatch", ARG_STRING, &a.soft_dispatch, "MIX", "Soft MoE layers' dispatch/combine weights: soft (the "
                                                              "paper's), or App. A's fixed identity, uniform, uniform_soft, soft_uniform"},
        {"no-soft-normalize", ARG_FLAG, &a.soft_raw, NULL, "Soft MoE layers without the normalisation of tokens and slot "
                                                       "vectors before the softmaxes (to reproduce App. E's collapse)"},
        {"preset", ARG_STRING, &a.preset, "NAME", "routing and losses of the model's MoE layers and the paper's training recipe where "
                                                  "flags do not say otherwise: limoe (Adafactor, lr 1e-3, wd 1e-5, images in [-1, 1]) or "
                                                  "clipup (AdamW, lr 5e-5, wd 0.05, its upcycled phase); the limoe-* and "
                                                  "clipup-* models imply theirs"},
        {"train-data", ARG_STRING, &a.data.path, "PATH", "image-text pairs: an OpenCLIP CSV/TSV file, or webdataset shards "
                                                       "('train-{000000..000099}.tar', lists joined by '::')"},
        {"dataset-type", ARG_STRING, &a.dataset_type, "TYPE", "synthetic (built-in; the default without --train-data), csv, "
                                                             "webdataset, auto (by the name; the default with it)"},
        {"csv-separator", ARG_STRING, &a.csv_separator, "C", "CSV field separator (default tab; \\t for tab)"},
        {"csv-img-key", ARG_STRING, &a.data.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &a.data.caption_key, "NAME", "CSV column of captions (default title)"},
        {"workers", ARG_INT, &a.workers, "N", "threads loading --train-data ahead of the step (default 2; 0: the training thread)"},
        {"dataset-resampled", ARG_FLAG, &a.resampled, NULL, "webdataset: draw shards with replacement from --seed (no epoch "
                                                             "end; --train-num-samples sets the logged epoch)"},
        {"train-data-upsampling-factors", ARG_STRING, &a.upsampling, "F1::F2", "with --dataset-resampled: sampling weight "
                                                                              "of each '::'-joined --train-data source's shards"},
        {"tokenizer", ARG_STRING, &a.tokenizer, "FILE", "captions' vocabulary: CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &a.image_mean, "R,G,B", "normalisation mean of --train-data (default CLIP's; [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &a.image_std, "R,G,B", "normalisation std of --train-data (default CLIP's; [-1, 1]: 0.5)"},
        {"override-inputs", ARG_FLAG, &a.override, NULL, "with --pretrained or --resume: " CLI_OVERRIDE_HELP},
        {"max-bad-fraction", ARG_FRAC, &a.max_bad, "F", "stop when more than this fraction of samples is bad (default 0.1)"},
        {"train-num-samples", ARG_LONG, &a.num_samples, "N", "samples per epoch for --epochs and --save-frequency (synthetic: 10000; CSV: its rows)"},
        {"expert-parallel", ARG_INT1, &a.expert_parallel, "N", "under mpirun: split every MoE layer's experts over "
                                                               "groups of N processes (N divides the process count "
                                                               "and num_experts; default 1: not split)"},
        {"dist-timeout", ARG_STRING, &a.dist_timeout, "S", "under mpirun: end the job when a collective has waited S "
                                                         "seconds for the other processes (one stopped or hung; "
                                                         "default $VLMOE_DIST_TIMEOUT, else 600; 0: never)"},
        {"bucket-cap-mb", ARG_DOUBLE, &a.bucket_cap_mb, "MB", "under mpirun: sum the gradient over the processes in "
                                                            "buckets of at most MB megabytes, each started as soon as "
                                                            "the backward finished it (DDP's bucket_cap_mb; default 25; "
                                                            "0: one sum after the backward; same results either way)"},
        {"batch-size", ARG_INT1, &a.batch_size, "N", "image-text pairs per step and process, or per micro-batch with "
                                                   "--accum-freq (default 64; the global batch is mpirun's -np x "
                                                   "--accum-freq x it)"},
        {"accum-freq", ARG_INT1, &a.accum_freq, "N", "gradient accumulation (OpenCLIP's): each step takes N micro-batches of "
                                                     "--batch-size and computes the contrastive loss over all N x "
                                                     "batch-size pairs, caching features, not activations: batch N x B "
                                                     "in the memory of B (default 1)"},
        {"steps", ARG_LONG, &steps_given, "N", "optimisation steps (default 300)"},
        {"epochs", ARG_LONG, &a.epochs, "N", "train for N epochs instead of --steps (an epoch: ceil(--train-num-samples / "
                                                   "global batch) steps)"},
        {"lr", ARG_POS, &a.o.lr, "LR", "peak learning rate (default 1e-3; --preset clipup: 5e-5)"},
        {"wd", ARG_DOUBLE, &a.o.wd, "WD", "decoupled weight decay on weight matrices: AdamW p -= lr*wd*p (default 0.1; "
                                          "--preset clipup: 0.05); Adafactor p -= (lr/--lr)*wd*p, the schedule times wd "
                                          "as big_vision (default 1e-5, LIMoE's)"},
        {"beta1", ARG_BETA, &a.o.beta1, "B1", "AdamW beta1 / Adafactor momentum (default 0.9; 0: none)"},
        {"momentum-dtype", ARG_STRING, &a.o.momentum_dtype, "T", "Adafactor: keep the momentum in float32 (default) or "
                                                                 "bfloat16 (ViT-G's; --preset limoe's default)"},
        {"beta2", ARG_BETA, &a.o.beta2, "B2", "AdamW beta2 (default 0.98)"},
        {"eps", ARG_POS, &a.o.eps, "EPS", "AdamW epsilon (default 1e-6)"},
        {"warmup", ARG_LONG, &a.o.warmup, "N", "linear warmup steps (default 30)"},
        {"lr-scheduler", ARG_STRING, &a.o.scheduler, "KIND", "cosine (default), rsqrt (with --lr-cooldown-steps), const"},
        {"lr-cooldown-steps", ARG_LONG, &a.o.cooldown, "N", "rsqrt: linear cooldown to 0 over the last N steps"},
        {"optimizer", ARG_STRING, &a.o.optimizer, "NAME", "adamw (default) or adafactor (big_vision's, as LIMoE: beta2 "
                                                        "1 - t^-0.8 capped at 0.999, factored from dimension 32, no "
                                                        "update clipping; --preset limoe's default)"},
        {"grad-clip-norm", ARG_DOUBLE, &a.o.grad_clip, "NORM", "clip the global gradient norm (default 1.0, 0 = off)"},
        {"seed", ARG_LONG, &a.seed, "N", "seed of the initialisation and the data order (default 0)"},
        {"image-size", ARG_INT, &a.image_size, "PX", "override the model's image size"},
        {"context-length", ARG_INT, &a.context_length, "N", "override the model's text context length"},
        {"logs", ARG_STRING, &a.logs, "DIR", "where runs are written (default ./logs)"},
        {"name", ARG_STRING, &a.name, "NAME", "run name (default: date-time and model; needed by --resume latest)"},
        {"save-frequency", ARG_LONG, &a.save_epochs, "N", "write a checkpoint every N epochs (as OpenCLIP; an epoch: "
                                                            "--train-num-samples, else the CSV's rows; default: at the end)"},
        {"save-every-n-steps", ARG_LONG, &a.save_steps, "N", "write a checkpoint every N steps (default: at the end only)"},
        {"keep-checkpoints", ARG_INT, &a.keep, "K", "keep the newest K checkpoints (default 3, 0 = all)"},
        {"resume", ARG_STRING, &a.resume, "latest|FILE", "continue a run exactly: its newest complete checkpoint, or step_N.safetensors"},
        {"resume-allow-changes", ARG_FLAG, &a.allow_changes, NULL, "--resume with flags that differ from the run's "
                                                                     "params.json (each logged; else an error)"},
        {"val-data", ARG_STRING, &a.val_data, "PATH", "validation pairs (OpenCLIP CSV/TSV with the --csv-* flags, or "
                                                    "webdataset shards): loss, accuracy, recall@1/5/10 (default: at the end)"},
        {"val-frequency", ARG_LONG, &a.val_freq, "N", "--val-data every N epochs, as OpenCLIP (an epoch: --train-num-samples "
                                                     "or the CSV's rows)"},
        {"val-every-n-steps", ARG_LONG, &a.val_steps, "N", "--val-data every N steps"},
        {"val-num-samples", ARG_LONG, &a.val_num, "N", "the first N usable pairs of --val-data (default: all)"},
        {"zeroshot-data", ARG_STRING, &a.zs_data, "DIR", "image folder DIR/<class>/*.jpg: zero-shot top-1/top-5 (default: "
                                                        "at the end)"},
        {"zeroshot-classnames", ARG_STRING, &a.zs_names, "FILE", "class names in sorted folder order: one per line, or "
                                                                "JSON (a list, or CLIP_benchmark's en_classnames.json)"},
        {"zeroshot-templates", ARG_STRING, &a.zs_templates, "FILE", "prompt templates ({} or {c}: the class): one per line, "
                                                                   "or JSON (CLIP_benchmark's)"},
        {"zeroshot-dataset", ARG_STRING, &a.zs_dataset, "NAME", "the list of a CLIP_benchmark JSON file (cifar10, "
                                                               "imagenet1k, ...)"},
        {"zeroshot-frequency", ARG_LONG, &a.zs_freq, "N", "zero-shot evaluation (--zeroshot-data, or the synthetic "
                                                         "held-out split) every N epochs, as OpenCLIP"},
        {"zeroshot-every-n-steps", ARG_LONG, &a.zs_steps, "N", "zero-shot evaluation every N steps (default: at the end)"},
        {"eval-samples", ARG_INT, &a.eval_samples, "N", "synthetic data: held-out samples per evaluation (default 1000, "
                                                       "0 = none)"},
        {"log-every-n-steps", ARG_INT1, &a.log_every, "N", "metrics and progress every N steps (default 10)"},
        {"report-every", ARG_LONG, &a.report_every, "N", "write LOGS/NAME/report.html (vlmoe report) at the first log "
                                                         "step of every N steps and at the end (default 0: never)"},
        {"report-to", ARG_STRING, &a.report_to, "tensorboard", "also write TensorBoard event files (metrics, and the "
                                                               "routing maps at each report) to LOGS/NAME/tensorboard/"},
        {"grad-checkpointing", ARG_FLAG, &a.grad_ckpt, NULL, "keep only each block's input and recompute the block in the "
                                                             "backward: less activation memory, the same gradients"},
        {"recompute-attention", ARG_STRING, &a.recompute_attn, "auto|on|off",
         "on: the backward recomputes each block's attention from its qkv; off: each block keeps it from the "
         "forward (more activation memory, one attention forward a block less, the same gradients); auto "
         "(default): off with --precision bf16 on a CPU where that adds at most a quarter to the activation "
         "arena, on otherwise"},
        {"lock-image", ARG_FLAG, &a.lock_image, NULL, "two_tower: freeze the image tower (LiT): no update, no weight decay"},
        {"lock-image-unlocked-groups", ARG_INT, &a.lock_image_groups, "N", "with --lock-image: leave its last N groups "
                                                                          "trainable (1: projection; 2: + last block and final norm; ...)"},
        {"lock-text", ARG_FLAG, &a.lock_text, NULL, "two_tower: freeze the text tower"},
        {"lock-text-unlocked-layers", ARG_INT, &a.lock_text_layers, "N", "with --lock-text: leave its last N groups "
                                                                        "trainable (counted as for the image tower)"},
        {"device", ARG_STRING, &a.device, "cpu|cuda[:N]", "where the model trains (default cpu)"},
        {"precision", ARG_STRING, &a.precision, "fp32|bf16", "bf16: linear and expert products in bf16 on a CPU "
                                                            "with AVX512_BF16 or AMX or on --device cuda; master weights, optimizer, "
                                                            "router, norms and losses stay fp32 (default fp32)"},
        {"threads", ARG_INT, &a.threads, "N", "worker threads (default: OMP_NUM_THREADS or all cores)"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    static const char *const mome[] = {"codebook", "mix", "image-data", "text-data", NULL};
    if (cli_reject_flags("train", argc, argv, mome, "applies to VL-MoE (arch mome) models, e.g. --model vlmoe-tiny"))
        return 1;
    args_set_epilogue(USAGE_MORE);
    int rc = args_parse("train", specs, nspec, argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (a.threads > 0) omp_set_num_threads(a.threads);
    cli_set_max_image_pixels(max_pixels);
    if (check_applicable(&a, argc, argv)) return 1;
    // the paper's recipe where no flag says otherwise (train_flags.h); LIMoE's images are in
    // [-1, 1] (its appendix A), for a model made here (one loaded records its own)
    const char *paper = cli_paper_of(a.preset, a.pretrained ? NULL : a.model);
    const cli_optim_flags optim_given = a.o; // a resume fills these from the run's record first
    cli_paper_optim(paper, &a.o);
    if (paper && !strcmp(paper, "limoe") && a.data.path && !a.pretrained && !a.resume && !a.image_mean && !a.image_std)
        a.image_mean = a.image_std = "0.5,0.5,0.5";
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
    // validation: no flag without the evaluation it shapes
    if (synthetic && a.val_data && cli_separator("train", a.csv_separator, &a.data.separator)) return 1;
    if (a.eval_samples >= 0 && a.data.path)
        return cli_error("train", "--eval-samples sizes the synthetic held-out evaluation; with --train-data give "
                         "--val-data PATH (--val-num-samples N) or --zeroshot-data DIR");
    if (a.eval_samples > CLI_EVAL_SAMPLES_MAX) // held in memory at once: images, tokens, embeddings
        return cli_error("train", "--eval-samples %d: at most %d held-out samples per evaluation", a.eval_samples,
                         CLI_EVAL_SAMPLES_MAX);
    if (a.eval_samples < 0) a.eval_samples = a.data.path ? 0 : 1000;
    if (!a.val_data && (a.val_freq || a.val_steps || a.val_num))
        return cli_error("train", "--val-frequency, --val-every-n-steps and --val-num-samples need --val-data PATH");
    if (!a.zs_data && (a.zs_names || a.zs_templates || a.zs_dataset))
        return cli_error("train", "--zeroshot-classnames, --zeroshot-templates and --zeroshot-dataset need "
                         "--zeroshot-data DIR");
    if ((a.zs_freq || a.zs_steps) && !a.zs_data && !(a.eval_samples > 0))
        return cli_error("train", "--zeroshot-%s: there is no zero-shot evaluation to run: give --zeroshot-data DIR (an "
                         "image folder, one sub-folder per class)%s", a.zs_freq ? "frequency" : "every-n-steps",
                         a.data.path ? "" : " or --eval-samples N > 0 (the synthetic held-out split)");
    if ((a.val_freq && a.val_steps) || (a.zs_freq && a.zs_steps))
        return cli_error("train", "give --%s-frequency (epochs) or --%s-every-n-steps, not both",
                         a.val_freq && a.val_steps ? "val" : "zeroshot", a.val_freq && a.val_steps ? "val" : "zeroshot");
    if (a.val_freq < 0 || a.val_steps < 0 || a.val_num < 0 || a.zs_freq < 0 || a.zs_steps < 0)
        return cli_error("train", "--val-frequency, --val-every-n-steps, --val-num-samples, --zeroshot-frequency and "
                         "--zeroshot-every-n-steps must be >= 0");
    if (a.zs_dataset && !cli_is_json(a.zs_names) && !cli_is_json(a.zs_templates))
        return cli_error("train", "--zeroshot-dataset %s picks a list of a CLIP_benchmark .json file: give "
                         "--zeroshot-classnames or --zeroshot-templates FILE.json", a.zs_dataset);
    double timeout = -1;
    if (a.dist_timeout && (dist_timeout_parse(a.dist_timeout, &timeout) || timeout > 1e9))
        return cli_error("train", "--dist-timeout %s: expected the seconds a collective may wait for the other "
                         "processes (>= 0; 0: never)", a.dist_timeout);
    vlmoe_dist *dist = NULL; // started by mpirun: this process's rank in the run
    if (vlmoe_dist_open(&dist, "auto")) return cli_error("train", "%s", vlmoe_last_error());
    *dist_out = dist;
    cli_set_dist(dist); // errors say which process met them; a collective timeout ends the job
    if (timeout >= 0 && vlmoe_dist_set_timeout(dist, timeout))
        return cli_error("train", "--dist-timeout: %s", vlmoe_last_error());
    if (!(a.bucket_cap_mb >= 0) || a.bucket_cap_mb > 1e6)
        return cli_error("train", "--bucket-cap-mb %g: expected the megabytes of one gradient bucket, >= 0 (0: the "
                         "whole gradient summed at once after the backward)", a.bucket_cap_mb);
    if (a.accum_freq < 1)
        return cli_error("train", "--accum-freq must be >= 1 (the micro-batches of --batch-size per step; 1: no "
                         "accumulation), got %d", a.accum_freq);
    if ((long)a.batch_size * a.accum_freq * dist->world < 2 || a.batch_size < 1)
        return cli_error("train", "--batch-size must be >= 2 for a contrastive loss (the global batch, per process x %d "
                         "processes x --accum-freq %d)", dist->world, a.accum_freq);
    if ((long)a.batch_size * a.accum_freq * dist->world > 1 << 20)
        return cli_error("train", "--batch-size %d x --accum-freq %d x %d processes is more than 2^20 pairs a step",
                         a.batch_size, a.accum_freq, dist->world);
    cli_run_length len = {steps_given, a.epochs, a.save_epochs, a.save_steps, a.num_samples,
                          (long)a.batch_size * a.accum_freq * dist->world, a.steps, 0};
    const int by_epoch = cli_by_epoch(&len) || a.val_freq > 0 || a.zs_freq > 0; // an epoch's size is needed
    if (!synthetic && vlmoe_dataset_check(&a.data, NULL)) return cli_error("train", "--train-data: %s", vlmoe_last_error());
    if (!synthetic && by_epoch && len.samples <= 0 && vlmoe_dataset_check(&a.data, &len.samples))
        return cli_error("train", "--train-data: %s (or count in steps: --save-every-n-steps, --val-every-n-steps, "
                         "--zeroshot-every-n-steps)", vlmoe_last_error());
    if (synthetic && len.samples <= 0) len.samples = 10000;
    if (cli_resampling("train", &a.data, a.resampled, a.upsampling)) return 1;
    if (cli_run_length_set("train", &len)) return 1;
    a.steps = len.steps, a.save_every = len.save_every, a.num_samples = len.samples;
    const long per_epoch = by_epoch ? (a.num_samples + len.per_step - 1) / len.per_step : 0;
    a.val_every = a.val_freq ? a.val_freq * per_epoch : a.val_steps;
    a.zeroshot_every = a.zs_freq ? a.zs_freq * per_epoch : a.zs_steps;
    if (a.log_every < 1) a.log_every = 1;
    if (a.report_to && strcmp(a.report_to, "tensorboard"))
        return cli_error("train", "--report-to: '%s' is not supported (tensorboard; wandb is not built in)", a.report_to);
    if (a.expert_parallel < 0) return cli_error("train", "--expert-parallel must be >= 1 (1: experts not split)");
    if (a.precision && !strncmp(a.precision, "int8", 4)) // before any file is made
        return cli_error("train", "--precision %s is for inference (embed, classify, eval): train with fp32 or bf16, "
                         "then run the model with --precision %s", a.precision, a.precision);
    if (a.precision && strcmp(a.precision, "fp32") && strcmp(a.precision, "bf16")) // before any file is made
        return cli_error("train", "--precision '%s': expected fp32 or bf16", a.precision);
    const char *const rmodes[3] = {"auto", "off", "on"}; // vlmoe_model_set_attention_recompute's -1, 0, 1
    int rmode = a.recompute_attn ? -2 : -1;
    for (int i = 0; i < 3 && rmode == -2; i++)
        if (!strcmp(a.recompute_attn, rmodes[i])) rmode = i - 1;
    if (rmode == -2) return cli_error("train", "--recompute-attention '%s': expected auto, on or off", a.recompute_attn);
    if (a.expert_parallel > 1 && dist->world % a.expert_parallel)
        return cli_error("train", "--expert-parallel %d does not divide the %d process%s into groups%s", a.expert_parallel,
                         dist->world, dist->world == 1 ? "" : "es",
                         dist->world == 1 ? " (start several with mpirun -np N)" : "");
    if (a.resume && !strcmp(a.resume, "latest") && !a.name)
        return cli_error("train", "--resume latest needs --name (the run to continue)");
    if (a.allow_changes && !a.resume) return cli_error("train", "--resume-allow-changes applies to --resume");

    vlmoe_train_params tp = vlmoe_train_default_params();
    if (cli_optim_params("train", &a.o, a.steps, 0.98, &tp)) return 1; // beta2: OpenCLIP's ViT default
    tp.lock_image = a.lock_image, tp.lock_image_unlocked_groups = a.lock_image_groups;
    tp.lock_text = a.lock_text, tp.lock_text_unlocked_layers = a.lock_text_layers;
    tp.bucket_cap_mb = a.bucket_cap_mb;

    train_run r;
    memset(&r, 0, sizeof(r));
    r.dist = dist, r.lead = dist->rank == 0;
    if (a.resume && strcmp(a.resume, "latest")) { // LOGS/NAME/checkpoints/step_N.safetensors
        vlmoe_run_dir_of(a.resume, r.dir, sizeof(r.dir));
    } else if (a.name) {
        snprintf(r.dir, sizeof(r.dir), "%s/%s", a.logs, a.name);
    } else {
        char ts[64], model[128];
        time_t t0 = time(NULL);
        strftime(ts, sizeof(ts), "%Y_%m_%d-%H_%M_%S", localtime(&t0));
        vlmoe_model_config mc; // a JSON config's own name, not its file's path
        snprintf(model, sizeof(model), "%s", a.pretrained ? "pretrained" : vlmoe_config_load(a.model, &mc) ? a.model : mc.name);
        for (char *p = model; *p; p++)
            if (*p == '/') *p = '-'; // model names like S/32
        snprintf(r.dir, sizeof(r.dir), "%s/%s-model_%s-lr_%g-b_%d", a.logs, ts, model, a.o.lr, a.batch_size);
    }
    snprintf(r.ckdir, sizeof(r.ckdir), "%s/checkpoints", r.dir);
    const cli_input in[] = {{"--train-data", a.data.path}, {"--val-data", a.val_data}, {"--tokenizer", a.tokenizer},
                            {"--pretrained", a.pretrained}, {"--model", a.model}, {"--zeroshot-classnames", a.zs_names},
                            {"--zeroshot-templates", a.zs_templates}};
    if (cli_check_run_outputs("train", r.dir, in, 7)) return 1;
    struct stat dir_sb; // a --resume latest of a run folder that exists but holds no checkpoint starts again
    const int existed = stat(r.dir, &dir_sb) == 0;
    if (vlmoe_mkdir_p(r.dir)) return cli_error("train", "%s", vlmoe_last_error());
    if (cli_run_lock("train", r.dir, dist, r.lead)) return 1; // before looking at what the folder holds
    if (existed && cli_run_taken("train", r.dir, a.resume)) return 1;
    if (vlmoe_mkdir_p(r.ckdir)) return cli_error("train", "%s", vlmoe_last_error());
    if (r.lead) vlmoe_ckpt_clean_tmp(r.ckdir);
    // a paper's recipe became the default of its models (limoe-*, clipup-*, --preset) after runs
    // had been started with AdamW's: a resume goes on with the optimizer the run recorded
    if (a.resume && paper) {
        cJSON *rec = cli_run_record(r.dir);
        a.o = optim_given;
        cli_resumed_optim(rec, &a.o);
        cJSON_Delete(rec);
        cli_paper_optim(paper, &a.o);
        if (cli_optim_params("train", &a.o, a.steps, 0.98, &tp)) return train_run_free(&r, 1), 1;
    }
    cJSON *changes = NULL, *now = a.resume ? run_params(&a, dist->world) : NULL;
    const int rhow = (a.allow_changes ? CLI_RESUME_ALLOW : 0) | (r.lead ? CLI_RESUME_PRINT : 0) | CLI_RESUME_CARRIED;
    rc = now && cli_resume_check("train", r.dir, now, rhow, &changes);
    cJSON_Delete(now);
    if (rc) return train_run_free(&r, rc), rc;
    cli_resume_fresh("train", r.dir, existed, &a.resume, r.lead);
    if (!(rc = train_setup_model(&a, &tp, &r)) && a.device && model_set_device(r.m, a.device))
        rc = cli_error("train", "%s", vlmoe_last_error());
    if (!rc && cli_set_precision("train", r.m, a.precision)) rc = cli_error("train", "%s", vlmoe_last_error());
    if (!rc && rmode >= 0) {
        char flag[64];
        snprintf(flag, sizeof(flag), "--recompute-attention %s", a.recompute_attn);
        rc = set_arena_mode(&r, a.batch_size, flag, "", vlmoe_model_set_attention_recompute, rmode);
    }
    if (!rc && a.grad_ckpt)
        rc = set_arena_mode(&r, a.batch_size, "--grad-checkpointing", "blocks recomputed in the backward; ",
                            vlmoe_model_set_grad_checkpointing, 1);
    if (!rc && !(rc = train_setup_data(&a, &r))) {
        vlmoe_contrastive_params cp = {.model = r.m, .batch_size = a.batch_size, .synth = r.synth, .loader = r.loader,
                                       .eval_samples = a.eval_samples, .rank = r.dist->rank, .world = r.dist->world,
                                       .last_step = a.steps, .synth_every = a.zeroshot_every,
                                       .accum_freq = a.accum_freq};
        if (!(rc = train_setup_validation(&a, &r, &cp)) && vlmoe_contrastive_init(&r.task, &cp))
            rc = cli_error("train", "%s", vlmoe_last_error());
    }
    if (!rc && r.lead) rc = write_run_files(&a, &r, changes), changes = NULL;
    cJSON_Delete(changes);
    if (rc) {
        train_run_free(&r, rc);
        return rc;
    }
    const vlmoe_model_config *cfg = vlmoe_model_get_config(r.m);
    r.tty = isatty(fileno(stderr));
    const int W = r.dist->world;
    const int N = a.accum_freq;
    char how[96] = "", procs[32] = "", micro[32] = ""; // the global batch's make-up
    if (W > 1) snprintf(procs, sizeof(procs), "%d processes x ", W);
    if (N > 1) snprintf(micro, sizeof(micro), "%d micro-batches x ", N);
    if (W > 1 || N > 1) snprintf(how, sizeof(how), " (%s%s%d)", procs, micro, a.batch_size);
    if (r.lead)
        fprintf(stderr, "vlmoe train: model %s (%zu parameters), steps %ld..%ld of %d pairs%s, %d threads%s, run %s\n",
                cfg->name, vlmoe_model_num_floats(r.m), vlmoe_trainer_get_step(r.t), a.steps, a.batch_size * N * W, how,
                omp_get_max_threads(), W > 1 ? " each" : "", r.dir);
    if (r.lead && N > 1) // routing over groups of the whole batch sees a micro-batch only
        for (int e = 0; e < (cfg->arch == VLMOE_ARCH_TWO_TOWER ? 2 : 1); e++) {
            const vlmoe_moe_config *mc = e ? &cfg->text_moe : &cfg->moe;
            if (mc->router != VLMOE_ROUTER_NONE && mc->group_size == 0)
                fprintf(stderr, "vlmoe train: note: --accum-freq %d: %s MoE layers route each micro-batch of %d as one "
                        "group (group_size 0), not the %d pairs of the step; a group_size of whole examples that "
                        "divides %d routes as one batch of %d would (JSON config)\n", N,
                        e ? "the text tower's" : "the", a.batch_size, a.batch_size * N, a.batch_size,
                        a.batch_size * N);
        }
    r.report_every = a.report_every, r.next_report = a.report_every;
    if (r.lead && a.report_to && cli_tb_open("train", r.dir, &r.tb)) return train_run_free(&r, 1), 1;
    const vlmoe_run_task task = vlmoe_contrastive_task(r.task);
    const vlmoe_run_params rp = {r.dir, a.steps, a.log_every, a.save_every, a.keep, train_eval_cadence(&a), 1,
                                 (long)a.batch_size * a.accum_freq * W, r.dist, on_progress, &r, a.expert_parallel};
    const double t0 = cli_now();
    int st = vlmoe_run_train(r.t, &task, &rp);
    if (r.open_line) fputc('\n', stderr);
    if (st == VLMOE_ERR_NUMERIC)
        rc = cli_error("train", "diverged: %s. Nothing was written for this step; continue from the last checkpoint "
                       "with --resume latest (lower --lr or raise --warmup)", vlmoe_last_error());
    else if (st)
        rc = cli_error("train", "%s", vlmoe_last_error());
    else if (r.lead) {
        fprintf(stderr, "trained to step %ld in %.1f s; checkpoints in %s\n", a.steps, cli_now() - t0, r.ckdir);
        if (r.report_every || r.tb.tb) report_step(&r, 1); // the last checkpoint is written by now
        if (r.report_every) fprintf(stderr, "report: %s/report.html\n", r.dir);
        if (r.tb.tb) fprintf(stderr, "tensorboard: %s\n", report_tb_path(r.tb.tb));
    }
    const vlmoe_dataset_stats *bs = r.loader && r.lead ? vlmoe_loader_stats(r.loader) : NULL;
    if (bs && vlmoe_dataset_stats_bad(bs)) { // a run stopped by bad samples said so with the counts
        char sum[1024 + VLMOE_BAD_MSGS * VLMOE_BAD_MSG_LEN];
        vlmoe_dataset_stats_format(bs, sum, sizeof(sum));
        fprintf(stderr, "vlmoe train: warning: %s: %s\n", a.data.path, sum);
    }
    train_run_free(&r, rc);
    return rc;
}

// A process that fails while the others train ends the whole job, after its message ("vlmoe train:
// rank R: ..."): the others may be waiting for it in a collective it will never join, and
// returning would leave them to the launcher's reaction to a process that exits without
// MPI_Finalize (Open MPI's mpirun stops the job then; other launchers may wait).
int cmd_train(int argc, char **argv) {
    vlmoe_dist *dist = NULL;
    const int rc = train_main(argc, argv, &dist);
    if (rc && dist && dist->world > 1) {
        fprintf(stderr, "vlmoe train: rank %d of %d failed (the message above): ending every process of the run\n",
                dist->rank, dist->world);
        vlmoe_dist_abort(dist, rc);
    }
    return rc;
}
