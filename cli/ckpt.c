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
