// train_flags.c: the flags both trainers share (see train_flags.h): epochs in steps, flags that
// do not apply, and the strict --resume check of a run's params.json. Covered by
// tests/test_train_flags.c and tests/test_vlmoe_train.c.
#include "train_flags.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "cli.h"
#include "dist/dist.h"
#include "train/run.h"

long cli_epoch_steps(long samples, long G) { return G > 0 ? (samples + G - 1) / G : 0; }

int cli_by_epoch(const cli_run_length *l) { return l->epochs > 0 || l->save_epochs > 0; }

int cli_run_length_set(const char *cmd, cli_run_length *l) {
    if (l->epochs > 0 && l->steps_given >= 0) return cli_error(cmd, "give --steps or --epochs, not both");
    if (l->save_epochs > 0 && l->save_steps > 0)
        return cli_error(cmd, "give --save-frequency (epochs) or --save-every-n-steps (steps), not both");
    if (l->epochs < 0 || l->save_epochs < 0 || l->save_steps < 0)
        return cli_error(cmd, "--epochs, --save-frequency and --save-every-n-steps must be >= 0 (0 saves at the end only)");
    if (cli_by_epoch(l) && l->samples < 1) return cli_error(cmd, "--train-num-samples must be >= 1");
    const long per_epoch = cli_epoch_steps(l->samples, l->per_step);
    if (l->steps_given >= 0) l->steps = l->steps_given;
    if (l->epochs > 0) l->steps = l->epochs * per_epoch;
    l->save_every = l->save_epochs > 0 ? l->save_epochs * per_epoch : l->save_steps;
    return l->steps < 1 ? cli_error(cmd, "--steps must be >= 1") : 0;
}

const char *cli_paper_of(const char *preset, const char *model) {
    if (preset) return preset;
    if (model && !strncmp(model, "limoe-", 6)) return "limoe";
    if (model && !strncmp(model, "clipup-", 7)) return "clipup";
    return NULL;
}

void cli_paper_optim(const char *paper, cli_optim_flags *o) {
    const int limoe = paper && !strcmp(paper, "limoe"), clipup = paper && !strcmp(paper, "clipup");
    const int vlmoe = paper && !strcmp(paper, "vlmoe");
    if (!o->optimizer) o->optimizer = limoe ? "adafactor" : "adamw";
    const int adafactor = !strcmp(o->optimizer, "adafactor");
    // CLIP-UP sec. 4: the upcycled model trains on with the learning rate and weight decay
    // reduced from the dense phase's 5e-4 / 0.2 to 5e-5 / 0.05
    if (isnan(o->lr)) o->lr = clipup ? 5e-5 : vlmoe ? 2e-3 : 1e-3;
    // Adafactor's decay is big_vision's: wd * p per step, times the schedule (LIMoE: 1e-5)
    if (isnan(o->wd)) o->wd = adafactor ? 1e-5 : clipup || vlmoe ? 0.05 : 0.1;
    // ViT-G's memory saving, which LIMoE's "modifications used for ViT-G" include
    // (not with --beta1 0: no momentum to keep, and --momentum-dtype would be an error nobody gave)
    if (!o->momentum_dtype && adafactor && limoe && !(o->beta1 == 0)) o->momentum_dtype = "bfloat16";
}

int cli_optim_params(const char *cmd, cli_optim_flags *o, long steps, double beta2_default, vlmoe_train_params *tp) {
    if (!o->optimizer) o->optimizer = "adamw";
    const int adafactor = !strcmp(o->optimizer, "adafactor");
    if (!adafactor && strcmp(o->optimizer, "adamw"))
        return cli_error(cmd, "--optimizer %s: expected adamw or adafactor", o->optimizer);
    if (adafactor && (!isnan(o->beta2) || !isnan(o->eps)))
        return cli_error(cmd, "--%s applies to --optimizer adamw (Adafactor has no such setting)",
                         isnan(o->beta2) ? "eps" : "beta2");
    const int sk = !strcmp(o->scheduler, "cosine") ? VLMOE_SCHED_COSINE : !strcmp(o->scheduler, "rsqrt") ? VLMOE_SCHED_RSQRT
                   : !strcmp(o->scheduler, "const") ? VLMOE_SCHED_CONST : -1;
    if (sk < 0) return cli_error(cmd, "--lr-scheduler %s: expected cosine, rsqrt or const", o->scheduler);
    if (o->cooldown && sk != VLMOE_SCHED_RSQRT) return cli_error(cmd, "--lr-cooldown-steps applies to --lr-scheduler rsqrt");
    if (isnan(o->lr)) o->lr = 1e-3;
    if (isnan(o->wd)) o->wd = adafactor ? 1e-5 : 0.1;
    if (!(o->lr > 0) || !(o->wd >= 0) || !(o->grad_clip >= 0) || o->warmup < 0 || o->cooldown < 0)
        return cli_error(cmd, "--lr must be > 0; --wd, --grad-clip-norm, --warmup and --lr-cooldown-steps >= 0");
    if (isnan(o->beta1)) o->beta1 = 0.9; // Adafactor too: big_vision's momentum 0.9
    if (!(o->beta1 >= 0 && o->beta1 < 1)) return cli_error(cmd, "--beta1 %g: expected a value in [0, 1)", o->beta1);
    if (isnan(o->beta2)) o->beta2 = adafactor ? 0 : beta2_default;
    if (isnan(o->eps)) o->eps = adafactor ? 0 : 1e-6;
    const char *md = o->momentum_dtype;
    if (md && (!adafactor || o->beta1 == 0))
        return cli_error(cmd, "--momentum-dtype applies to --optimizer adafactor with momentum (--beta1 > 0)");
    if (md && strcmp(md, "float32") && strcmp(md, "bfloat16"))
        return cli_error(cmd, "--momentum-dtype %s: expected float32 or bfloat16", md);
    if (adafactor && !md) o->momentum_dtype = "float32";
    tp->optim = vlmoe_optim_default_params(adafactor ? VLMOE_OPT_ADAFACTOR : VLMOE_OPT_ADAMW);
    tp->optim.beta1 = (float)o->beta1; // honoured for Adafactor too (0: no momentum)
    if (!adafactor) tp->optim.beta2 = (float)o->beta2, tp->optim.eps = (float)o->eps;
    tp->optim.weight_decay = (float)o->wd;
    if (adafactor) {
        // big_vision: p -= sched * (lr * m + wd * p); the trainer's lr is lr * sched
        tp->optim.wd_lr_base = (float)o->lr;
        tp->optim.momentum_bf16 = o->momentum_dtype && !strcmp(o->momentum_dtype, "bfloat16");
    }
    tp->grad_clip_norm = o->grad_clip;
    tp->schedule = (vlmoe_schedule){(vlmoe_sched_kind)sk, o->lr, o->warmup, steps, 0.0, o->cooldown, 0.0};
    return 0;
}

void cli_optim_json(cJSON *pj, const cli_optim_flags *o) {
    cJSON_AddStringToObject(pj, "optimizer", o->optimizer);
    cJSON_AddStringToObject(pj, "lr_scheduler", o->scheduler);
    const char *k[] = {"lr", "wd", "warmup", "lr_cooldown_steps", "beta1", "beta2", "eps", "grad_clip_norm"};
    const double v[] = {o->lr, o->wd, (double)o->warmup, (double)o->cooldown, o->beta1, o->beta2, o->eps, o->grad_clip};
    for (int i = 0; i < 8; i++) cJSON_AddNumberToObject(pj, k[i], v[i]);
    if (o->momentum_dtype) cJSON_AddStringToObject(pj, "momentum_dtype", o->momentum_dtype);
}

int cli_reject_flags(const char *cmd, int argc, char **argv, const char *const *names, const char *why) {
    for (int i = 2; i < argc; i++) {
        if (strncmp(argv[i], "--", 2)) continue;
        const char *a = argv[i] + 2;
        const size_t n = strcspn(a, "=");
        for (int k = 0; names[k]; k++)
            if (strlen(names[k]) == n && !strncmp(a, names[k], n)) return cli_error(cmd, "--%s %s", names[k], why);
    }
    return 0;
}

// Keys of params.json a resume may change: the length of the run (the schedule is derived again
// from the new --steps, as OpenCLIP does from its flags), how often it logs, evaluates and saves,
// what it evaluates on, and how it is computed (threads, loader workers, device, processes,
// recomputed activations) but not what. Every other key is compared.
static const char *const FREE[] = {
    "steps", "epochs", "train_num_samples", "save_frequency", "save_every_n_steps", "keep_checkpoints",
    "zeroshot_frequency", "zeroshot_every_n_steps", "eval_samples", "val_data", "val_frequency", "val_every_n_steps",
    "val_num_samples", "zeroshot_data", "zeroshot_classnames", "zeroshot_templates", "zeroshot_dataset", "log_every_n_steps",
    "threads", "workers", "max_bad_fraction", "device", "world_size", "expert_parallel", "grad_checkpointing",
    "recompute_attention", "codebook", "override_inputs", "resumed_with_changes", NULL};
// What a contrastive checkpoint carries (src/nn/inputs.c): a resume without the flag uses the
// checkpoint's, which is no change; a flag that is given is compared.
static const char *const CARRIED[] = {"tokenizer", "image_mean", "image_std", NULL};

// Keys params.json gained after runs had been written without them, and what such a run did: a
// resume goes on that way when the flag is not given (cli_resumed_*), and a flag given now is
// compared against it, so that a run is never switched to a newer default from its resumed step.
static const struct {
    const char *key, *str; // str: a string value, else num
    double num;
} OLD[] = {
    {"drop_path", NULL, 0},           // VL-MoE before --drop-path: no stochastic depth
    {"hflip", NULL, 0},               // VL-MoE image files before --hflip: no flip
    {"color_jitter", NULL, 0},        // and before --color-jitter: no jitter
    {"precision", "fp32", 0},         // before --precision: fp32
    {"momentum_dtype", "float32", 0}, // before --momentum-dtype: Adafactor's momentum (if any) in float32
};

static int old_index(const char *key) {
    for (int i = 0; i < (int)(sizeof(OLD) / sizeof(OLD[0])); i++)
        if (!strcmp(OLD[i].key, key)) return i;
    return -1;
}

static int listed(const char *const *list, const char *key) {
    for (int k = 0; list[k]; k++)
        if (!strcmp(list[k], key)) return 1;
    return 0;
}

// The flag a key of params.json comes from: batch_size -> --batch-size.
static void flag_of(const char *key, char *out, size_t cap) {
    if (!strcmp(key, "global_batch_size")) {
        snprintf(out, cap, "the global batch (--batch-size x processes)");
        return;
    }
    if (!strcmp(key, "chunk")) {
        snprintf(out, cap, "the forward size (of --mix and --batch-size)");
        return;
    }
    if (!strcmp(key, "streams")) {
        snprintf(out, cap, "the streams (--mix, --batch-size and the data flags)");
        return;
    }
    int at = snprintf(out, cap, "--");
    for (const char *p = key; *p && at + 1 < (int)cap; p++) out[at++] = *p == '_' ? '-' : *p;
    out[at] = 0;
}

static void value_of(const cJSON *v, char *out, size_t cap) {
    if (!v || cJSON_IsNull(v)) {
        snprintf(out, cap, "(not given)");
    } else if (cJSON_IsString(v)) {
        snprintf(out, cap, "%s", v->valuestring);
    } else if (cJSON_IsNumber(v)) {
        snprintf(out, cap, "%.10g", v->valuedouble);
    } else {
        char *s = cJSON_PrintUnformatted(v);
        snprintf(out, cap, "%s", s ? s : "?");
        free(s);
    }
}

// The run's record: params_resumed.json if an earlier resume wrote one, else params.json.
static cJSON *read_record(const char *dir, char *name, size_t cap) {
    static const char *const names[2] = {"params_resumed.json", "params.json"};
    for (int i = 0; i < 2; i++) {
        char path[1100];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        char *buf = NULL;
        long n = fseek(f, 0, SEEK_END) ? -1 : ftell(f);
        if (n >= 0 && n < (1 << 24) && !fseek(f, 0, SEEK_SET) && (buf = malloc((size_t)n + 1)) &&
            fread(buf, 1, (size_t)n, f) == (size_t)n)
            buf[n] = 0;
        else
            free(buf), buf = NULL;
        fclose(f);
        cJSON *j = buf ? cJSON_Parse(buf) : NULL;
        free(buf);
        snprintf(name, cap, "%s", names[i]);
        return j;
    }
    snprintf(name, cap, "params.json");
    return NULL;
}

int cli_resume_check(const char *cmd, const char *dir, const cJSON *params, int how, cJSON **changes) {
    const int allow = how & CLI_RESUME_ALLOW, print = how & CLI_RESUME_PRINT;
    *changes = NULL;
    char name[32];
    cJSON *rec = read_record(dir, name, sizeof(name));
    char ckdir[1100];
    long step;
    snprintf(ckdir, sizeof(ckdir), "%s/checkpoints", dir);
    if (!cJSON_IsObject(rec) && !vlmoe_ckpt_list(ckdir, &step, 1)) // nothing to resume: the resume says so
        return cJSON_Delete(rec), 0;
    if (!cJSON_IsObject(rec)) {
        cJSON_Delete(rec);
        if (!allow)
            return print ? cli_error(cmd, "--resume: %s/%s is missing or not JSON: the flags cannot be checked against "
                                     "the run's (--resume-allow-changes to continue without the check)", dir, name) : 1;
        if (print) fprintf(stderr, "vlmoe %s: warning: --resume: %s/%s is missing or not JSON; the flags are not "
                           "checked against the run's\n", cmd, dir, name);
        return 0;
    }
    // on another number of processes the batch per process changes with it; the global one may not
    const cJSON *w0 = cJSON_GetObjectItemCaseSensitive(params, "world_size");
    const cJSON *w1 = cJSON_GetObjectItemCaseSensitive(rec, "world_size");
    const int relaid = w0 && w1 && !cJSON_Compare(w0, w1, 1);
    cJSON *diffs = cJSON_CreateArray();
    for (const cJSON *now = params->child; now && diffs; now = now->next) {
        const cJSON *then = cJSON_GetObjectItemCaseSensitive(rec, now->string);
        const int o = then || cJSON_IsNull(now) ? -1 : old_index(now->string); // a key the record predates
        cJSON *was = o < 0 ? NULL : OLD[o].str ? cJSON_CreateString(OLD[o].str) : cJSON_CreateNumber(OLD[o].num);
        if (was) then = was;
        const int same = listed(FREE, now->string) || !then || cJSON_Compare(now, then, 1) ||
                         ((how & CLI_RESUME_CARRIED) && cJSON_IsNull(now) && listed(CARRIED, now->string)) ||
                         (relaid && !strcmp(now->string, "batch_size"));
        char flag[96], a[512], b[512], msg[2400];
        if (!same) {
            flag_of(now->string, flag, sizeof(flag));
            value_of(now, a, sizeof(a));
            value_of(then, b, sizeof(b));
            if (was)
                snprintf(msg, sizeof(msg), "%s %s differs from the run's %s (%s of %s has no %s: the run is older than "
                         "the flag and ran with %s)", flag, a, b, name, dir, now->string, b);
            else
                snprintf(msg, sizeof(msg), "%s %s differs from the run's %s (%s of %s)", flag, a, b, name, dir);
            cJSON_AddItemToArray(diffs, cJSON_CreateString(msg));
        }
        cJSON_Delete(was);
    }
    cJSON_Delete(rec);
    const int n = cJSON_GetArraySize(diffs);
    if (!n || !diffs) {
        cJSON_Delete(diffs);
        return diffs ? 0 : cli_error(cmd, "--resume: out of memory");
    }
    if (allow) {
        for (int i = 0; i < n && print; i++)
            fprintf(stderr, "vlmoe %s: warning: --resume-allow-changes: %s\n", cmd,
                    cJSON_GetArrayItem(diffs, i)->valuestring);
        *changes = diffs;
        return 0;
    }
    if (print) {
        fprintf(stderr, "vlmoe %s: --resume: the run was started with other flags: ", cmd);
        for (int i = 0; i < n; i++) fprintf(stderr, "%s%s", i ? "; " : "", cJSON_GetArrayItem(diffs, i)->valuestring);
        fprintf(stderr, ". Give the run's flags, or --resume-allow-changes to go on with these (the changes are "
                "logged in %s/params_resumed.json)\n", dir);
    }
    cJSON_Delete(diffs);
    return 1;
}

cJSON *cli_run_record(const char *dir) {
    char name[32];
    cJSON *rec = read_record(dir, name, sizeof(name));
    if (!cJSON_IsObject(rec)) cJSON_Delete(rec), rec = NULL;
    return rec;
}

double cli_resumed_num(const cJSON *rec, const char *key, double fresh) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(rec, key);
    if (cJSON_IsNumber(v)) return v->valuedouble;
    const int o = old_index(key);
    return rec && !v && o >= 0 && !OLD[o].str ? OLD[o].num : fresh;
}

// A recorded string as one of the literals it may be (the record is freed before o is used).
static const char *recorded(const cJSON *rec, const char *key, const char *const *values) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(rec, key);
    for (int i = 0; cJSON_IsString(v) && values[i]; i++)
        if (!strcmp(v->valuestring, values[i])) return values[i];
    return NULL;
}

void cli_resumed_optim(const cJSON *rec, cli_optim_flags *o) {
    static const char *const opts[] = {"adamw", "adafactor", NULL}, *const dtypes[] = {"float32", "bfloat16", NULL};
    if (!rec) return;
    if (!o->optimizer) o->optimizer = recorded(rec, "optimizer", opts);
    if (isnan(o->lr)) o->lr = cli_resumed_num(rec, "lr", NAN);
    if (isnan(o->wd)) o->wd = cli_resumed_num(rec, "wd", NAN);
    if (isnan(o->beta1)) o->beta1 = cli_resumed_num(rec, "beta1", NAN);
    const int adamw = o->optimizer && !strcmp(o->optimizer, "adamw");
    if (adamw && isnan(o->beta2)) o->beta2 = cli_resumed_num(rec, "beta2", NAN);
    if (adamw && isnan(o->eps)) o->eps = cli_resumed_num(rec, "eps", NAN);
    const int momentum = o->optimizer && !strcmp(o->optimizer, "adafactor") && o->beta1 > 0;
    if (!o->momentum_dtype && momentum)
        o->momentum_dtype = cJSON_GetObjectItemCaseSensitive(rec, "momentum_dtype") ? recorded(rec, "momentum_dtype", dtypes)
                                                                                    : OLD[old_index("momentum_dtype")].str;
}

int cli_resume_record(const char *cmd, const char *dir, cJSON *params, cJSON *changes, long step) {
    char name[32];
    cJSON *rec = read_record(dir, name, sizeof(name));
    cJSON *list = cJSON_DetachItemFromObjectCaseSensitive(rec, "resumed_with_changes");
    cJSON_Delete(rec);
    if (!cJSON_IsArray(list)) cJSON_Delete(list), list = cJSON_CreateArray();
    cJSON *entry = cJSON_CreateObject();
    if (entry) {
        cJSON_AddNumberToObject(entry, "step", (double)step);
        cJSON_AddItemToObject(entry, "changes", changes), changes = NULL;
    }
    cJSON_AddItemToArray(list, entry);
    cJSON_DeleteItemFromObjectCaseSensitive(params, "resumed_with_changes");
    cJSON_AddItemToObject(params, "resumed_with_changes", list);
    char path[1100], *text = cJSON_Print(params);
    snprintf(path, sizeof(path), "%s/params_resumed.json", dir);
    const int st = vlmoe_write_text(path, text);
    free(text);
    cJSON_Delete(params), cJSON_Delete(changes);
    return st ? cli_error(cmd, "%s", vlmoe_last_error()) : 0;
}

void cli_resume_fresh(const char *cmd, const char *dir, int existed, const char **resume, int print) {
    char ckdir[1100];
    long step;
    snprintf(ckdir, sizeof(ckdir), "%s/checkpoints", dir);
    if (!existed || !*resume || strcmp(*resume, "latest") || vlmoe_ckpt_list(ckdir, &step, 1)) return;
    if (print)
        fprintf(stderr, "vlmoe %s: --resume latest: %s holds no complete checkpoint (the run stopped before its first "
                "one): starting it again from step 0\n", cmd, ckdir);
    *resume = NULL;
}

int cli_run_taken(const char *cmd, const char *dir, const char *resume) {
    if (resume) return 0;
    char ckdir[1100], metrics[1100];
    long step = 0;
    struct stat sb;
    snprintf(ckdir, sizeof(ckdir), "%s/checkpoints", dir);
    snprintf(metrics, sizeof(metrics), "%s/metrics.jsonl", dir);
    const int ckpts = vlmoe_ckpt_list(ckdir, &step, 1) > 0;
    if (!ckpts && (stat(metrics, &sb) || sb.st_size == 0)) return 0;
    // as OpenCLIP ("Experiment already exists"): a second run in the folder would mix its
    // checkpoints with the first's and --keep-checkpoints would delete the first run's
    if (ckpts)
        return cli_error(cmd, "%s already holds a run (checkpoints up to step %ld): give --resume latest to continue "
                         "it, or another --name", dir, step);
    return cli_error(cmd, "%s already holds a run's metrics (%s): give --resume latest to continue it, or another "
                     "--name", dir, metrics);
}

int cli_run_lock(const char *cmd, const char *dir, struct vlmoe_dist *d, int lead) {
    static int held = -1; // kept open for the life of the process: closing it would release the lock
    char path[1100], other[32] = "";
    uint8_t failed = 0;
    int err = 0;
    snprintf(path, sizeof(path), "%s/.vlmoe.lock", dir);
    if (lead && held < 0) {
        const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) {
            failed = 1, err = errno;
        } else if (flock(fd, LOCK_EX | LOCK_NB)) {
            failed = 2, err = errno;
            ssize_t n = pread(fd, other, sizeof(other) - 1, 0);
            other[n > 0 ? n : 0] = 0;
            other[strcspn(other, "\n")] = 0;
            close(fd);
        } else {
            char pid[32];
            const int n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
            if (ftruncate(fd, 0) || pwrite(fd, pid, (size_t)n, 0) != n) { /* the pid is only a hint */ }
            held = fd;
        }
    }
    if (d && d->world > 1 && d->allreduce_max(d, &failed, 1, VLMOE_DIST_U8))
        return cli_error(cmd, "%s: the processes could not agree on the run folder's lock: %s", dir,
                         vlmoe_last_error());
    if (failed && !lead) return 1; // the lead says why
    if (failed == 2 && err == EWOULDBLOCK)
        return cli_error(cmd, "%s is in use by another run (process %s, on this or another machine sharing the "
                         "folder): give another --name, or wait for it to end", dir, *other ? other : "?");
    if (failed) return cli_error(cmd, "cannot lock the run folder (%s): %s", path, strerror(err));
    return 0;
}
