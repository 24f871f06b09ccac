// synth_export.c: the synthetic data written as files (PNG images in class folders, captions.csv,
// texts.txt, match.tsv) and the folder checks that never overwrite a user's files; layout and
// pixel mapping in synth_export.h. The PNG encoding is the library's only image writer, through
// libpng's simplified API. Covered by tests/test_synth_export.c (through `vlmoe synth export`).
#include "data/synth_export.h"

#include <dirent.h>
#include <errno.h>
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"

enum { CAPTION_MAX = 192, BLOCK = 512 };

// The folder of class c: its name with ' ' -> '_' (the image-folder reader turns '_' back).
static void class_dir(const vlmoe_synth *s, int c, char *out, size_t cap) {
    snprintf(out, cap, "%s", vlmoe_synth_class_name(s, c));
    for (char *p = out; *p; p++)
        if (*p == ' ') *p = '_';
}

// mkdir -p; errno says why on -1
static int make_dirs(const char *path) {
    char buf[4096];
    const size_t n = strlen(path);
    if (n == 0 || n >= sizeof(buf)) return errno = ENAMETOOLONG, -1;
    memcpy(buf, path, n + 1);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, 0755) && errno != EEXIST) return -1;
    struct stat st;
    if (stat(buf, &st)) return -1;
    return S_ISDIR(st.st_mode) ? 0 : (errno = ENOTDIR, -1);
}

// NNNNNN.png: digits, then ".png"
static int is_export_png(const char *name) {
    const char *p = name;
    while (*p >= '0' && *p <= '9') p++;
    return p > name && !strcmp(p, ".png");
}

static const char *const export_files[] = {"captions.csv", "texts.txt", "match.tsv"};

// Looks through dir for an entry an export does not write (anything with export_only = 0): its
// path goes to what (empty if there is none). Only classes/<folder>/NNNNNN.png and the three
// files are an export's.
static void find_foreign(const char *dir, int export_only, char *what, size_t cap) {
    char sub[4096 + 512];
    what[0] = 0;
    DIR *d = opendir(dir);
    for (struct dirent *e; d && !what[0] && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        int ours = 0;
        for (int i = 0; i < 3; i++) ours |= export_only && !strcmp(e->d_name, export_files[i]);
        if (export_only && !strcmp(e->d_name, "classes")) {
            ours = 1;
            snprintf(sub, sizeof(sub), "%s/classes", dir);
            DIR *c = opendir(sub);
            for (struct dirent *f; c && !what[0] && (f = readdir(c));) {
                if (!strcmp(f->d_name, ".") || !strcmp(f->d_name, "..")) continue;
                char cls[4096 + 1024];
                snprintf(cls, sizeof(cls), "%s/%s", sub, f->d_name);
                DIR *g = opendir(cls);
                if (!g) snprintf(what, cap, "classes/%s", f->d_name);
                for (struct dirent *h; g && !what[0] && (h = readdir(g));)
                    if (strcmp(h->d_name, ".") && strcmp(h->d_name, "..") && !is_export_png(h->d_name))
                        snprintf(what, cap, "classes/%s/%s", f->d_name, h->d_name);
                if (g) closedir(g);
            }
            if (c) closedir(c);
        }
        if (!ours) snprintf(what, cap, "%s", e->d_name);
    }
    if (d) closedir(d);
}

// Removes an earlier export (find_foreign found nothing else in dir).
static void remove_export(const char *dir) {
    char path[4096], sub[4096 + 512];
    snprintf(path, sizeof(path), "%s/classes", dir);
    DIR *d = opendir(path);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name);
        DIR *c = opendir(sub);
        for (struct dirent *f; c && (f = readdir(c));) {
            char file[4096 + 1024];
            snprintf(file, sizeof(file), "%s/%s", sub, f->d_name);
            if (is_export_png(f->d_name)) unlink(file);
        }
        if (c) closedir(c);
        rmdir(sub);
    }
    if (d) closedir(d);
    rmdir(path);
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, export_files[i]);
        unlink(path);
    }
}

int vlmoe_synth_export_prepare(const char *dir, int overwrite, char *foreign, size_t cap) {
    if (cap) foreign[0] = 0;
    if (make_dirs(dir)) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create the folder: %s", dir, strerror(errno));
    char what[640]; // "classes/" + two names of up to 255 bytes
    find_foreign(dir, overwrite, what, sizeof(what));
    if (what[0]) {
        if (cap) snprintf(foreign, cap, "%s", what);
        return overwrite ? vlmoe_fail(VLMOE_ERR_IO, "%s: holds %s, which is not a file of an export (nothing was "
                                      "removed)", dir, what)
                         : vlmoe_fail(VLMOE_ERR_IO, "%s: the folder is not empty (it holds %s)", dir, what);
    }
    if (overwrite) remove_export(dir);
    char probe[4096 + 32];
    snprintf(probe, sizeof(probe), "%s/.vlmoe_write_test", dir);
    FILE *f = fopen(probe, "wb");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write into the folder: %s", dir, strerror(errno));
    fclose(f);
    unlink(probe);
    return VLMOE_OK;
}

// Writes the (3, S, S) image in [-1, 1] as an 8-bit RGB PNG; 0, or -1 with msg set.
static int write_png(const char *path, const float *img, int S, uint8_t *rgb, char *msg, size_t cap) {
    const size_t plane = (size_t)S * S;
    for (size_t i = 0; i < plane; i++)
        for (int k = 0; k < 3; k++) {
            const float v = (img[k * plane + i] + 1.f) * 127.5f + 0.5f;
            rgb[3 * i + k] = (uint8_t)(v <= 0.f ? 0 : v >= 255.f ? 255 : (int)v);
        }
    FILE *f = fopen(path, "wb");
    if (!f) return snprintf(msg, cap, "%s: cannot create: %s", path, strerror(errno)), -1;
    png_image im;
    memset(&im, 0, sizeof(im));
    im.version = PNG_IMAGE_VERSION, im.width = (png_uint_32)S, im.height = (png_uint_32)S;
    im.format = PNG_FORMAT_RGB;
    const int ok = png_image_write_to_stdio(&im, f, 0, rgb, 0, NULL) != 0;
    if (!ok) snprintf(msg, cap, "%s: PNG: %s", path, im.message);
    const int closed = fclose(f) == 0;
    if (ok && !closed) snprintf(msg, cap, "%s: cannot write: %s", path, strerror(errno));
    png_image_free(&im);
    return ok && closed ? 0 : -1;
}

// One CSV field: as it is, or quoted (quotes doubled) when it holds the separator, a quote or a line end.
static void csv_field(FILE *f, const char *s, char sep) {
    if (!strchr(s, sep) && !strpbrk(s, "\"\r\n")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

typedef struct {
    const vlmoe_synth_export_params *p;
    const vlmoe_synth *s;
    int S, width;          // width: digits of the file names
    uint8_t *cls;          // (n) class of each sample
} export_job;

// classes/<class>/NNNNNN.png of sample i (relative to dir)
static void rel_path(const export_job *j, long i, char *out, size_t cap) {
    char cd[64];
    class_dir(j->s, j->cls[i], cd, sizeof(cd));
    snprintf(out, cap, "classes/%s/%0*llu.png", cd, j->width, (unsigned long long)(j->p->first + (uint64_t)i));
}

// The images (in parallel, a block at a time), captions.csv and texts.txt.
static int write_samples(export_job *j) {
    const vlmoe_synth_export_params *p = j->p;
    const size_t isz = (size_t)3 * j->S * j->S;
    char path[4096], rel[128];
    int st = VLMOE_OK;
    snprintf(path, sizeof(path), "%s/captions.csv", p->dir);
    FILE *csv = fopen(path, "w"), *txt = NULL;
    if (!csv) st = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    snprintf(path, sizeof(path), "%s/texts.txt", p->dir);
    if (!st && !(txt = fopen(path, "w"))) st = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    char *caps = malloc((size_t)BLOCK * CAPTION_MAX);
    if (!st && !caps) st = vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory");
    snprintf(path, sizeof(path), "%s/classes", p->dir);
    if (!st && mkdir(path, 0755))
        st = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create the folder: %s", path, strerror(errno));
    if (!st) fprintf(csv, "filepath%ctitle\n", p->sep);
    char err[4600] = "";
    for (long b0 = 0; b0 < p->n && !st; b0 += BLOCK) {
        const long nb = p->n - b0 < BLOCK ? p->n - b0 : BLOCK;
        long first_bad = nb; // the lowest failing sample of the block names the error
#pragma omp parallel
        {
            float *img = malloc(sizeof(float) * isz);
            uint8_t *rgb = malloc(3 * (size_t)j->S * j->S);
            char msg[4600], folder[4096 + 128], file[4096 + 128], prel[128];
#pragma omp for schedule(dynamic, 8)
            for (long k = 0; k < nb; k++) {
                int cls = 0, bad = 0;
                const long i = b0 + k;
                if (!img || !rgb) bad = 1, snprintf(msg, sizeof(msg), "out of memory");
                if (!bad && vlmoe_synth_sample(j->s, p->split, p->first + (uint64_t)i, img,
                                               caps + (size_t)k * CAPTION_MAX, CAPTION_MAX, &cls))
                    bad = 1, snprintf(msg, sizeof(msg), "%s", vlmoe_last_error());   // this thread's error
                if (!bad) {
                    j->cls[i] = (uint8_t)cls;
                    rel_path(j, i, prel, sizeof(prel));
                    snprintf(file, sizeof(file), "%s/%s", p->dir, prel);
                    // the class folder is made when its first image comes (an empty one would be an error
                    // for the image-folder reader)
                    snprintf(folder, sizeof(folder), "%.*s", (int)(strrchr(file, '/') - file), file);
                    if (mkdir(folder, 0755) && errno != EEXIST)
                        bad = 1, snprintf(msg, sizeof(msg), "%s: cannot create the folder: %s", folder, strerror(errno));
                }
                if (!bad) bad = write_png(file, img, j->S, rgb, msg, sizeof(msg)) != 0;
                if (bad) {
                    // unnamed: a named critical section's lock is a global symbol libvlmoe.so would export
#pragma omp critical
                    if (k < first_bad) first_bad = k, snprintf(err, sizeof(err), "%s", msg);
                }
            }
            free(img), free(rgb);
        }
        if (first_bad < nb) {
            st = vlmoe_fail(VLMOE_ERR_IO, "%s", err);
            break;
        }
        for (long k = 0; k < nb; k++) {
            const char *cap = caps + (size_t)k * CAPTION_MAX;
            rel_path(j, b0 + k, rel, sizeof(rel));
            csv_field(csv, rel, p->sep);
            fputc(p->sep, csv);
            csv_field(csv, cap, p->sep);
            fputc('\n', csv);
            fprintf(txt, "%s\n", cap);
        }
        if (p->progress) p->progress(p->progress_user, b0 + nb, p->n);
    }
    // ferror too: a write that failed while the buffer was flushed midway is not reported by fclose
    if (csv && (ferror(csv) | fclose(csv)) && !st)
        st = vlmoe_fail(VLMOE_ERR_IO, "%s/captions.csv: cannot write: %s", p->dir, strerror(errno));
    if (txt && (ferror(txt) | fclose(txt)) && !st)
        st = vlmoe_fail(VLMOE_ERR_IO, "%s/texts.txt: cannot write: %s", p->dir, strerror(errno));
    free(caps);
    return st;
}

// match.tsv: one row per image, in sample order. Exactly n/2 rows (rounded down) answer "no", at
// places drawn from the seed; a "no" row takes the caption of an exported image of another class,
// drawn uniformly among them (captions are regenerated: the caption never depends on the image).
static int write_match(const export_job *j, vlmoe_synth_export_result *r) {
    const vlmoe_synth_export_params *p = j->p;
    long count[256] = {0};
    for (long i = 0; i < p->n; i++) count[j->cls[i]]++;
    const int C = vlmoe_synth_num_classes(j->s);
    for (int c = 0; c < C; c++)
        if (count[c] == p->n && p->n > 1) {
            r->one_class = 1;
            return vlmoe_fail(VLMOE_ERR_ARG, "all %ld samples are of class '%s': match.tsv needs images of two "
                              "classes or more for its \"no\" rows", p->n, vlmoe_synth_class_name(j->s, c));
        }
    // byclass: sample indices grouped by class, start[c] .. start[c+1]
    long *start = calloc((size_t)C + 1, sizeof(long)), *byclass = malloc(sizeof(long) * (size_t)p->n);
    uint8_t *no = calloc((size_t)p->n, 1);
    long *perm = malloc(sizeof(long) * (size_t)p->n);
    if (!start || !byclass || !no || !perm) {
        free(start), free(byclass), free(no), free(perm);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory");
    }
    for (int c = 0; c < C; c++) start[c + 1] = start[c] + count[c];
    long fill[256];
    memcpy(fill, start, sizeof(long) * (size_t)C);
    for (long i = 0; i < p->n; i++) byclass[fill[j->cls[i]]++] = i;
    vlmoe_rng g;
    vlmoe_rng_seed(&g, (p->seed * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)p->split << 62) ^
                           (p->first * 0xd6e8feb86659fd93ULL) ^ 0x6d61746368747376ULL);
    // a uniform choice of n/2 rows: a partial Fisher-Yates shuffle of 0..n-1
    for (long i = 0; i < p->n; i++) perm[i] = i;
    for (long i = 0; i < p->n / 2; i++) {
        const long k = i + (long)vlmoe_rng_below(&g, (uint32_t)(p->n - i)), t = perm[i];
        perm[i] = perm[k], perm[k] = t;
        no[perm[i]] = 1;
    }
    free(perm);
    char path[4096], rel[128], cap[CAPTION_MAX];
    snprintf(path, sizeof(path), "%s/match.tsv", p->dir);
    FILE *f = fopen(path, "w");
    int st = f ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    r->n_yes = 0;
    for (long i = 0; i < p->n && !st; i++) {
        long src = i;
        if (no[i]) { // the k-th image outside class cls[i], in class order
            const int c = j->cls[i];
            const long k = (long)vlmoe_rng_below(&g, (uint32_t)(p->n - count[c]));
            src = k < start[c] ? byclass[k] : byclass[k + count[c]];
        }
        st = vlmoe_synth_sample(j->s, p->split, p->first + (uint64_t)src, NULL, cap, sizeof(cap), NULL);
        if (st) break;
        rel_path(j, i, rel, sizeof(rel));
        fprintf(f, "%s\t%s\t%s\n", rel, cap, no[i] ? "no" : "yes");
        r->n_yes += !no[i];
    }
    if (f && (ferror(f) | fclose(f)) && !st) st = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
    free(start), free(byclass), free(no);
    return st;
}

int vlmoe_synth_export(const vlmoe_synth *s, const vlmoe_synth_export_params *p, vlmoe_synth_export_result *r) {
    *r = (vlmoe_synth_export_result){0};
    if (p->n < 1 || p->n > VLMOE_SYNTH_EXPORT_MAX_N)
        return vlmoe_fail(VLMOE_ERR_ARG, "synthetic export: %ld samples, expected 1..%d", p->n,
                          VLMOE_SYNTH_EXPORT_MAX_N);
    if (p->first > (uint64_t)VLMOE_SYNTH_EXPORT_MAX_FIRST)
        return vlmoe_fail(VLMOE_ERR_ARG, "synthetic export: first index %llu, expected 0..%ld",
                          (unsigned long long)p->first, VLMOE_SYNTH_EXPORT_MAX_FIRST);
    if (p->split != VLMOE_SPLIT_TRAIN && p->split != VLMOE_SPLIT_HELDOUT)
        return vlmoe_fail(VLMOE_ERR_ARG, "synthetic export: split %d, expected VLMOE_SPLIT_TRAIN or "
                          "VLMOE_SPLIT_HELDOUT", p->split);
    if (!p->sep || strchr("\"\r\n", p->sep))
        return vlmoe_fail(VLMOE_ERR_ARG, "synthetic export: separator '%c', expected one character other than a "
                          "quote or a line end", p->sep ? p->sep : '0');
    int width = 6;
    for (unsigned long long last = p->first + (unsigned long long)p->n - 1, q = 1000000; last >= q; q *= 10)
        width++;
    export_job j = {.p = p, .s = s, .S = vlmoe_synth_image_size(s), .width = width, .cls = calloc((size_t)p->n, 1)};
    int st = j.cls ? write_samples(&j) : vlmoe_fail(VLMOE_ERR_NOMEM, "out of memory");
    if (!st) st = write_match(&j, r);
    if (!st) {
        long count[256] = {0};
        for (long i = 0; i < p->n; i++) r->classes += !count[j.cls[i]]++;
    }
    free(j.cls);
    return st;
}
