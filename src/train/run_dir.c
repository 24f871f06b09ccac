// run_dir.c: the run folder of a training run: LOGS/NAME/checkpoints/step_N.safetensors (weights
// and config) + step_N.state.safetensors (training state); lists the steps present, names the
// files, removes all but the newest K pairs, and resumes from the newest usable one
// (src/train/run.h). Covered by tests/test_checkpoint.c.
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "train/run.h"

void vlmoe_ckpt_paths(const char *dir, long step, char *weights, char *state, size_t cap) {
    snprintf(weights, cap, "%s/step_%ld.safetensors", dir, step);
    snprintf(state, cap, "%s/step_%ld.state.safetensors", dir, step);
}

static int desc(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x < y) - (x > y);
}

int vlmoe_ckpt_list(const char *dir, long *steps, int max) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < max) {
        long s;
        char tail[32];
        // weights files only: "step_N.safetensors" (the state file has ".state" before it)
        if (sscanf(e->d_name, "step_%ld%31s", &s, tail) == 2 && !strcmp(tail, ".safetensors") && s >= 0) steps[n++] = s;
    }
    closedir(d);
    qsort(steps, (size_t)n, sizeof(long), desc);
    return n;
}

void vlmoe_ckpt_prune(const char *dir, int keep) {
    long steps[4096];
    int n = vlmoe_ckpt_list(dir, steps, 4096);
    for (int i = keep; i < n; i++) {
        char w[1024], s[1024];
        vlmoe_ckpt_paths(dir, steps[i], w, s, sizeof(w));
        unlink(s); // state first: a weights file without its state is never taken for complete
        unlink(w);
    }
}

void vlmoe_ckpt_clean_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[1024];
    // partial files of a writer that was killed before its rename: never loadable, never needed;
    // and a state file whose weights file was never renamed into place (checkpoint.c's sequence)
    while ((e = readdir(d))) {
        long step;
        char tail[32], w[1100], st[1100];
        struct stat sb;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (strstr(e->d_name, ".safetensors.tmp.")) {
            unlink(path);
        } else if (sscanf(e->d_name, "step_%ld%31s", &step, tail) == 2 && !strcmp(tail, ".state.safetensors")) {
            vlmoe_ckpt_paths(dir, step, w, st, sizeof(w));
            if (stat(w, &sb) && errno == ENOENT) unlink(path);
        }
    }
    closedir(d);
}

int vlmoe_mkdir_p(const char *path) {
    char tmp[1024];
    if (snprintf(tmp, sizeof(tmp), "%s", path) >= (int)sizeof(tmp))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: path too long", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(tmp, 0755) && errno != EEXIST) return vlmoe_fail(VLMOE_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
            *p = '/';
        }
    if (mkdir(tmp, 0755) && errno != EEXIST) return vlmoe_fail(VLMOE_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    return VLMOE_OK;
}

int vlmoe_write_text(const char *path, const char *text) {
    if (!text) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: no text to write", path);
    // through a temporary file and a rename: a full disk never leaves the run's record half written
    char tmp[1100];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) return vlmoe_fail(VLMOE_ERR_ARG, "%s: path too long", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    errno = 0;
    int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF && fflush(f) == 0 && fsync(fileno(f)) == 0;
    const int e = errno;
    ok = fclose(f) == 0 && ok;
    if (ok && rename(tmp, path)) ok = 0;
    if (ok) return VLMOE_OK;
    const int e2 = errno;
    remove(tmp);
    return vlmoe_fail(VLMOE_ERR_IO, "cannot write %s: %s", path, strerror(e ? e : e2 ? e2 : EIO));
}

void vlmoe_run_dir_of(const char *weights, char *dir, size_t cap) {
    snprintf(dir, cap, "%s", weights);
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, cap, ".");
    }
}

int vlmoe_ckpt_resume(const char *ckdir, const char *resume, const vlmoe_train_params *tp, int plan_B,
                      vlmoe_model **m, vlmoe_trainer **t, vlmoe_data_state *ds, char *w, size_t cap,
                      vlmoe_warn_fn warn, void *user) {
    long steps[4096];
    int n = 0;
    if (!strcmp(resume, "latest") && !(n = vlmoe_ckpt_list(ckdir, steps, 4096)))
        return vlmoe_fail(VLMOE_ERR_ARG, "--resume latest: no checkpoint in %s", ckdir);
    for (int i = 0; i < (n ? n : 1); i++) {
        char s[1100];
        if (n) {
            vlmoe_ckpt_paths(ckdir, steps[i], w, s, cap < sizeof(s) ? cap : sizeof(s));
        } else { // an explicit weights file: its state file sits beside it
            snprintf(w, cap, "%s", resume);
            const size_t k = strlen(w);
            if (k < 12 || strcmp(w + k - 12, ".safetensors"))
                return vlmoe_fail(VLMOE_ERR_ARG, "--resume %s: expected latest or a step_N.safetensors file", resume);
            snprintf(s, sizeof(s), "%.*s.state.safetensors", (int)(k - 12), w);
        }
        int st = vlmoe_model_load(m, w);
        if (!st && plan_B) st = vlmoe_model_plan(*m, plan_B);
        if (!st) st = vlmoe_trainer_init(t, *m, tp);
        int verified = 0;
        if (!st) st = vlmoe_trainer_load_checked(*t, w, s, ds, &verified);
        if (!st && !verified && warn) {
            char msg[2200];
            snprintf(msg, sizeof(msg), "note: %s and its state carry no checksums (written before vlmoe checked "
                     "them): resumed unverified; the next checkpoint will carry them", w);
            warn(user, msg);
        }
        if (!st) return VLMOE_OK;
        if (warn) {
            char msg[2048];
            snprintf(msg, sizeof(msg), "checkpoint %s is unusable: %s%s", w, vlmoe_last_error(),
                     n && i + 1 < n ? "; trying the one before it" : "");
            warn(user, msg);
        }
        vlmoe_trainer_free(*t);
        vlmoe_model_free(*m);
        *t = NULL, *m = NULL;
    }
    return vlmoe_fail(VLMOE_ERR_ARG, "--resume %s: no usable checkpoint", resume);
}

int vlmoe_run_write_files(const char *dir, const vlmoe_model_config *c, cJSON *params) {
    char path[1100];
    char *cj = vlmoe_config_to_json(c), *ps = params ? cJSON_Print(params) : NULL;
    cJSON_Delete(params);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    int st = vlmoe_write_text(path, cj);
    snprintf(path, sizeof(path), "%s/params.json", dir);
    if (!st) st = vlmoe_write_text(path, ps);
    free(cj), free(ps);
    return st;
}
