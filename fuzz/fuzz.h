// fuzz.h: shared by the libFuzzer targets fuzz/fuzz_*.c (built and run by `make fuzz`): readers
// that only take a path get the input through a file in a private temporary folder (in /dev/shm
// when there is one), removed at exit. A target ignores what the library answers: only a crash,
// a sanitizer report, a leak or a timeout is a finding.
#ifndef VLMOE_FUZZ_H
#define VLMOE_FUZZ_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { FUZZ_MAX_FILES = 4 };
static char fuzz_dir[64], fuzz_names[FUZZ_MAX_FILES][192];
static int fuzz_nnames;

static void fuzz_cleanup(void) {
    for (int i = 0; i < fuzz_nnames; i++) unlink(fuzz_names[i]);
    rmdir(fuzz_dir);
}

// Writes data (n bytes) to fuzz_dir/name and returns that path (a static buffer per name; at
// most FUZZ_MAX_FILES names), or NULL if it cannot be written.
static inline const char *fuzz_file(const char *name, const uint8_t *data, size_t n) {
    if (!fuzz_dir[0]) {
        snprintf(fuzz_dir, sizeof(fuzz_dir), "%s/vlmoe_fuzz_XXXXXX", access("/dev/shm", W_OK) ? "/tmp" : "/dev/shm");
        if (!mkdtemp(fuzz_dir)) return fuzz_dir[0] = 0, NULL;
        atexit(fuzz_cleanup);
    }
    char path[192];
    snprintf(path, sizeof(path), "%s/%s", fuzz_dir, name);
    int k = 0;
    while (k < fuzz_nnames && strcmp(fuzz_names[k], path)) k++;
    if (k == FUZZ_MAX_FILES) return NULL;
    if (k == fuzz_nnames) memcpy(fuzz_names[fuzz_nnames++], path, sizeof(path));
    FILE *f = fopen(path, "wb");
    if (!f) return NULL;
    const size_t w = n ? fwrite(data, 1, n, f) : 0;
    return fclose(f) == 0 && w == n ? fuzz_names[k] : NULL;
}

#endif
