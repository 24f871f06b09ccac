// ckpt.c: the checkpoint folder of a run: LOGS/NAME/checkpoints/step_N.safetensors (weights and
// config) + step_N.state.safetensors (training state). Lists the steps present, names the files
// and removes all but the newest K pairs.
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

void ckpt_paths(const char *dir, long step, char *weights, char *state, size_t cap) {
    snprintf(weights, cap, "%s/step_%ld.safetensors", dir, step);
    snprintf(state, cap, "%s/step_%ld.state.safetensors", dir, step);
}

static int desc(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x < y) - (x > y);
}

int ckpt_list(const char *dir, long *steps, int max) {
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

void ckpt_prune(const char *dir, int keep) {
    long steps[4096];
    int n = ckpt_list(dir, steps, 4096);
    for (int i = keep; i < n; i++) {
        char w[1024], s[1024];
        ckpt_paths(dir, steps[i], w, s, sizeof(w));
        unlink(s); // state first: a weights file without its state is never taken for complete
        unlink(w);
    }
}

void ckpt_clean_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[1024];
    // partial files of a writer that was killed before its rename: never loadable, never needed
    while ((e = readdir(d)))
        if (strstr(e->d_name, ".safetensors.tmp.")) {
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            unlink(path);
        }
    closedir(d);
}

int cli_mkdir_p(const char *path) {
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

int cli_write_text(const char *path, const char *text) {
    FILE *f = text ? fopen(path, "w") : NULL;
    if (!f) return -1;
    const int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    return fclose(f) == 0 && ok ? 0 : -1;
}

int ckpt_resume(const char *cmd, const char *ckdir, const char *resume, const vlmoe_train_params *tp, int plan_B,
                vlmoe_model **m, vlmoe_trainer **t, vlmoe_data_state *ds, char *w, size_t cap) {
    long steps[4096];
    int n = 0;
    if (!strcmp(resume, "latest") && !(n = ckpt_list(ckdir, steps, 4096)))
        return cli_error(cmd, "--resume latest: no checkpoint in %s", ckdir);
    for (int i = 0; i < (n ? n : 1); i++) {
        char s[1100];
        if (n) {
            ckpt_paths(ckdir, steps[i], w, s, cap < sizeof(s) ? cap : sizeof(s));
        } else { // an explicit weights file: its state file sits beside it
            snprintf(w, cap, "%s", resume);
            const size_t k = strlen(w);
            if (k < 12 || strcmp(w + k - 12, ".safetensors"))
                return cli_error(cmd, "--resume %s: expected latest or a step_N.safetensors file", resume);
            snprintf(s, sizeof(s), "%.*s.state.safetensors", (int)(k - 12), w);
        }
        int st = vlmoe_model_load(m, w);
        if (!st && plan_B) st = vlmoe_model_plan(*m, plan_B);
        if (!st) st = vlmoe_trainer_init(t, *m, tp);
        if (!st) st = vlmoe_trainer_load(*t, w, s, ds);
        if (!st) return 0;
        fprintf(stderr, "vlmoe %s: checkpoint %s is unusable: %s%s\n", cmd, w, vlmoe_last_error(),
                n && i + 1 < n ? "; trying the one before it" : "");
        vlmoe_trainer_free(*t);
        vlmoe_model_free(*m);
        *t = NULL, *m = NULL;
    }
    return cli_error(cmd, "--resume %s: no usable checkpoint", resume);
}
