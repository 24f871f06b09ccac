// synth.c: `vlmoe synth export`: writes samples of the built-in synthetic data (src/data/synthetic.c)
// as ordinary files, so the file-based data paths (the threaded loader, eval --val-data and
// --zeroshot-data, finetune) can be tried on data known to be learnable. Test: tests/test_synth_export.c.
//
// Layout of DIR (every path in a file is relative to DIR, the folder of the file naming it):
//   classes/<colour>_<shape>/NNNNNN.png  the images, NNNNNN = the sample's index in its split; one
//                                        folder per class present, so DIR/classes is an image folder
//                                        (`vlmoe eval --zeroshot-data`, `vlmoe finetune --task image-cls`)
//                                        with no second copy of the images
//   captions.csv                         OpenCLIP CSV, header filepath<SEP>title, one row per sample
//   texts.txt                            the captions, one per line, in sample order
//   match.tsv                            image<TAB>caption<TAB>yes|no (`vlmoe finetune --task pair-cls`)
// The PNGs are the synthetic [-1, 1] images mapped to 8-bit RGB: v = round((x + 1) * 127.5), so
// (v / 255 - 0.5) / 0.5 gives x back within 1/255. The captions tokenize to the same ids as the
// built-in stream (vlmoe_synth_tokenize), which models with a small vocabulary use for files too.
//
// The library has no image writer (it only reads), so the PNG encoding lives here, through libpng's
// simplified API. Samples are generated and encoded in parallel; every file depends only on
// (seed, split, index), never on the thread count.
#include <dirent.h>
#include <errno.h>
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "common.h"

#define CMD "synth export"
enum { CAPTION_MAX = 192, BLOCK = 512, MAX_N = 10000000 };
#define MAX_FIRST 1000000000000L // --first: far beyond any export, and first + n fits a long

static const char *USAGE =
    "usage: vlmoe synth export --out DIR [--n N] [--split train|val] [--image-size S] [--seed N]\n\n"
    "Writes N samples of the built-in synthetic data (coloured shapes with captions, the data\n"
    "`vlmoe train --dataset-type synthetic` draws on the fly) as ordinary files:\n"
    "  DIR/classes/<class>/NNNNNN.png  the images, one folder per (colour, shape) class: an image\n"
    "                                  folder for eval --zeroshot-data and finetune --task image-cls\n"
    "  DIR/captions.csv                OpenCLIP CSV, header filepath<TAB>title, paths relative to DIR:\n"
    "                                  for train --train-data and eval --val-data\n"
    "  DIR/texts.txt                   the captions, one per line (embed --texts)\n"
    "  DIR/match.tsv                   image<TAB>caption<TAB>yes|no: the image's own caption (yes) or one\n"
    "                                  of an image of another class (no), half each, drawn from --seed:\n"
    "                                  for finetune --task pair-cls\n"
    "NNNNNN is the sample's index in its split, the same sample the built-in data gives for\n"
    "--seed. --split val is the held-out stream (class-balanced: the class of sample i is i mod 20).\n"
    "Pixels are the synthetic [-1, 1] values as 8-bit RGB, so give --image-mean 0.5 --image-std 0.5\n"
    "to the commands that read them (vlmoe finetune has no such flag: it normalises with CLIP's mean\n"
    "and std). DIR is created (with its parents) and must be empty unless --overwrite, which first\n"
    "removes the files of an earlier export there.\n\n"
    "examples:\n"
    "  vlmoe synth export --out shapes --n 5000\n"
    "  vlmoe synth export --out shapes_val --n 1000 --split val\n"
    "  vlmoe train --model limoe-tiny --train-data shapes/captions.csv --image-mean 0.5 --image-std 0.5\n"
    "  vlmoe eval --model M --val-data shapes_val/captions.csv --zeroshot-data shapes_val/classes \\\n"
    "      --image-mean 0.5 --image-std 0.5\n"
    "  vlmoe finetune --model vlmoe.safetensors --task pair-cls --data shapes/match.tsv -o ft.safetensors";

// The folder of class c: its name with ' ' -> '_' (the image-folder reader turns '_' back).
static void class_dir(const vlmoe_synth *s, int c, char *out, size_t cap) {
    snprintf(out, cap, "%s", vlmoe_synth_class_name(s, c));
    for (char *p = out; *p; p++)
        if (*p == ' ') *p = '_';
}

// mkdir -p
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

// --overwrite: removes an earlier export (find_foreign found nothing else in dir).
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

// Creates dir; an existing one must be empty, or with overwrite hold nothing but an earlier
// export, which is then removed. Returns an exit status.
static int prepare_dir(const char *dir, int overwrite) {
    if (make_dirs(dir)) return cli_error(CMD, "--out %s: cannot create the folder: %s", dir, strerror(errno));
    char what[640]; // "classes/" + two names of up to 255 bytes
    find_foreign(dir, overwrite, what, sizeof(what));
    if (what[0] && overwrite)
        return cli_error(CMD, "--out %s: %s is not a file of an export: --overwrite only replaces an earlier export "
                         "(nothing was removed)", dir, what);
    if (what[0])
        return cli_error(CMD, "--out %s: the folder is not empty (it holds %s): export into a new or empty folder, or "
                         "add --overwrite to replace an earlier export", dir, what);
    if (overwrite) remove_export(dir);
    char probe[4096 + 32];
    snprintf(probe, sizeof(probe), "%s/.vlmoe_write_test", dir);
    FILE *f = fopen(probe, "wb");
    if (!f) return cli_error(CMD, "--out %s: cannot write into the folder: %s", dir, strerror(errno));
    fclose(f);
    unlink(probe);
    return 0;
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
    const char *dir;
    const vlmoe_synth *s;
    int split, S, width;   // width: digits of the file names
    uint64_t first;
    long n;
    char sep;
    uint8_t *cls;          // (n) class of each sample
} export_job;

// classes/<class>/NNNNNN.png of sample i (relative to dir)
static void rel_path(const export_job *j, long i, char *out, size_t cap) {
    char cd[64];
    class_dir(j->s, j->cls[i], cd, sizeof(cd));
    snprintf(out, cap, "classes/%s/%0*llu.png", cd, j->width, (unsigned long long)(j->first + (uint64_t)i));
}

// The images (in parallel, a block at a time), captions.csv and texts.txt.
static int write_samples(export_job *j) {
    const size_t isz = (size_t)3 * j->S * j->S;
    char path[4096], rel[128];
    int rc = 0;
    snprintf(path, sizeof(path), "%s/captions.csv", j->dir);
    FILE *csv = fopen(path, "w"), *txt = NULL;
    if (!csv) rc = cli_error(CMD, "%s: cannot create: %s", path, strerror(errno));
    snprintf(path, sizeof(path), "%s/texts.txt", j->dir);
    if (!rc && !(txt = fopen(path, "w"))) rc = cli_error(CMD, "%s: cannot create: %s", path, strerror(errno));
    char *caps = malloc((size_t)BLOCK * CAPTION_MAX);
    if (!rc && !caps) rc = cli_error(CMD, "out of memory");
    snprintf(path, sizeof(path), "%s/classes", j->dir);
    if (!rc && mkdir(path, 0755)) rc = cli_error(CMD, "%s: cannot create the folder: %s", path, strerror(errno));
    if (!rc) fprintf(csv, "filepath%ctitle\n", j->sep);
    char err[4600] = "";
    cli_progress pr = cli_progress_start("images");
    for (long b0 = 0; b0 < j->n && !rc; b0 += BLOCK) {
        const long nb = j->n - b0 < BLOCK ? j->n - b0 : BLOCK;
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
                if (!bad && vlmoe_synth_sample(j->s, j->split, j->first + (uint64_t)i, img, caps + (size_t)k * CAPTION_MAX,
                                               CAPTION_MAX, &cls))
                    bad = 1, snprintf(msg, sizeof(msg), "%s", vlmoe_last_error());
                if (!bad) {
                    j->cls[i] = (uint8_t)cls;
                    rel_path(j, i, prel, sizeof(prel));
                    snprintf(file, sizeof(file), "%s/%s", j->dir, prel);
                    // the class folder is made when its first image comes (an empty one would be an error
                    // for the image-folder reader)
                    snprintf(folder, sizeof(folder), "%.*s", (int)(strrchr(file, '/') - file), file);
                    if (mkdir(folder, 0755) && errno != EEXIST)
                        bad = 1, snprintf(msg, sizeof(msg), "%s: cannot create the folder: %s", folder, strerror(errno));
                }
                if (!bad) bad = write_png(file, img, j->S, rgb, msg, sizeof(msg)) != 0;
                if (bad) {
#pragma omp critical(synth_export_err)
                    if (k < first_bad) first_bad = k, snprintf(err, sizeof(err), "%s", msg);
                }
            }
            free(img), free(rgb);
        }
        if (first_bad < nb) {
            rc = cli_error(CMD, "%s", err);
            break;
        }
        for (long k = 0; k < nb; k++) {
            const char *cap = caps + (size_t)k * CAPTION_MAX;
            rel_path(j, b0 + k, rel, sizeof(rel));
            csv_field(csv, rel, j->sep);
            fputc(j->sep, csv);
            csv_field(csv, cap, j->sep);
            fputc('\n', csv);
            fprintf(txt, "%s\n", cap);
        }
        cli_progress_show(&pr, b0 + nb, j->n);
    }
    cli_progress_end(&pr);
    if (csv && fclose(csv) && !rc) rc = cli_error(CMD, "%s/captions.csv: cannot write: %s", j->dir, strerror(errno));
    if (txt && fclose(txt) && !rc) rc = cli_error(CMD, "%s/texts.txt: cannot write: %s", j->dir, strerror(errno));
    free(caps);
    return rc;
}

// match.tsv: one row per image, in sample order. Exactly n/2 rows (rounded down) answer "no", at
// places drawn from the seed; a "no" row takes the caption of an exported image of another class,
// drawn uniformly among them (captions are regenerated: the caption never depends on the image).
static int write_match(const export_job *j, uint64_t seed, long *n_yes) {
    long count[256] = {0};
    for (long i = 0; i < j->n; i++) count[j->cls[i]]++;
    const int C = vlmoe_synth_num_classes(j->s);
    for (int c = 0; c < C; c++)
        if (count[c] == j->n && j->n > 1)
            return cli_error(CMD, "all %ld samples are of class '%s': match.tsv needs images of two classes or more "
                             "for its \"no\" rows (export more with --n, or use --split val, which cycles the classes)",
                             j->n, vlmoe_synth_class_name(j->s, c));
    // byclass: sample indices grouped by class, start[c] .. start[c+1]
    long *start = calloc((size_t)C + 1, sizeof(long)), *byclass = malloc(sizeof(long) * (size_t)j->n);
    uint8_t *no = calloc((size_t)j->n, 1);
    if (!start || !byclass || !no) return free(start), free(byclass), free(no), cli_error(CMD, "out of memory");
    for (int c = 0; c < C; c++) start[c + 1] = start[c] + count[c];
    long fill[256];
    memcpy(fill, start, sizeof(long) * (size_t)C);
    for (long i = 0; i < j->n; i++) byclass[fill[j->cls[i]]++] = i;
    vlmoe_rng r;
    vlmoe_rng_seed(&r, (seed * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)j->split << 62) ^ (j->first * 0xd6e8feb86659fd93ULL) ^
                           0x6d61746368747376ULL);
    // a uniform choice of n/2 rows: a partial Fisher-Yates shuffle of 0..n-1
    long *perm = malloc(sizeof(long) * (size_t)j->n);
    if (!perm) return free(start), free(byclass), free(no), cli_error(CMD, "out of memory");
    for (long i = 0; i < j->n; i++) perm[i] = i;
    for (long i = 0; i < j->n / 2; i++) {
        const long k = i + (long)vlmoe_rng_below(&r, (uint32_t)(j->n - i)), t = perm[i];
        perm[i] = perm[k], perm[k] = t;
        no[perm[i]] = 1;
    }
    free(perm);
    char path[4096], rel[128], cap[CAPTION_MAX];
    snprintf(path, sizeof(path), "%s/match.tsv", j->dir);
    FILE *f = fopen(path, "w");
    int rc = f ? 0 : cli_error(CMD, "%s: cannot create: %s", path, strerror(errno));
    *n_yes = 0;
    for (long i = 0; i < j->n && !rc; i++) {
        long src = i;
        if (no[i]) { // the r-th image outside class cls[i], in class order
            const int c = j->cls[i];
            const long k = (long)vlmoe_rng_below(&r, (uint32_t)(j->n - count[c]));
            src = k < start[c] ? byclass[k] : byclass[k + count[c]];
        }
        if (vlmoe_synth_sample(j->s, j->split, j->first + (uint64_t)src, NULL, cap, sizeof(cap), NULL)) {
            rc = cli_error(CMD, "%s", vlmoe_last_error());
            break;
        }
        rel_path(j, i, rel, sizeof(rel));
        fprintf(f, "%s\t%s\t%s\n", rel, cap, no[i] ? "no" : "yes");
        *n_yes += !no[i];
    }
    if (f && fclose(f) && !rc) rc = cli_error(CMD, "%s: cannot write: %s", path, strerror(errno));
    free(start), free(byclass), free(no);
    return rc;
}

static int synth_export(int argc, char **argv) {
    const char *out = NULL, *split = "train", *sep = "\t";
    int n = 1000, size = 32, overwrite = 0;
    long seed = 0, first = 0;
    const arg_spec specs[] = {
        {"out", ARG_STRING, &out, "DIR", "folder to write (created; must be empty unless --overwrite)"},
        {"n", ARG_INT, &n, "N", "samples to write (1000)"},
        {"split", ARG_STRING, &split, "SPLIT", "train (the stream training draws from) or val (the held-out one) (train)"},
        {"first", ARG_LONG, &first, "I", "index of the first sample in its split (0): --first 5000 --n 1000 writes 5000..5999"},
        {"image-size", ARG_INT, &size, "S", "image side in pixels, 16..1024 (32, the tiny models' size)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the synthetic data (as `vlmoe train --seed`) and of match.tsv's pairs (0)"},
        {"csv-separator", ARG_STRING, &sep, "C", "captions.csv's field separator (tab, vlmoe's and OpenCLIP's default; "
                                                 "\\t for tab)"},
        {"overwrite", ARG_FLAG, &overwrite, NULL, "replace an earlier export in --out (its images and files)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    int rc = args_parse(CMD, specs, ns, argc, argv, 3, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (!out || !out[0]) return cli_error(CMD, "--out DIR is required (see vlmoe synth export --help)");
    if (n < 1 || n > MAX_N) return cli_error(CMD, "--n %d: expected 1..%d samples", n, MAX_N);
    if (first < 0 || first > MAX_FIRST)
        return cli_error(CMD, "--first %ld: expected an index in 0..%ld", first, (long)MAX_FIRST);
    const int sp_id = !strcmp(split, "train") ? VLMOE_SPLIT_TRAIN : !strcmp(split, "val") ? VLMOE_SPLIT_HELDOUT : -1;
    if (sp_id < 0) return cli_error(CMD, "--split %s: expected train or val", split);
    if (!strcmp(sep, "\\t")) sep = "\t";
    if (strlen(sep) != 1 || strchr("\"\r\n", sep[0]))
        return cli_error(CMD, "--csv-separator '%s': expected one character other than a quote or a line end", sep);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = size;
    sp.seed = (uint64_t)seed;
    vlmoe_synth *s = NULL;
    if (vlmoe_synth_init(&s, &sp)) return cli_error(CMD, "--image-size %d: %s", size, vlmoe_last_error());
    int width = 6;
    for (unsigned long long last = (unsigned long long)first + (unsigned long long)n - 1, p = 1000000; last >= p; p *= 10)
        width++;
    export_job j = {out, s, sp_id, size, width, (uint64_t)first, n, sep[0], calloc((size_t)n, 1)};
    long n_yes = 0;
    rc = j.cls ? prepare_dir(out, overwrite) : cli_error(CMD, "out of memory");
    if (!rc) rc = write_samples(&j);
    if (!rc) rc = write_match(&j, (uint64_t)seed, &n_yes);
    if (!rc) {
        int classes = 0;
        long count[256] = {0};
        for (long i = 0; i < n; i++) classes += !count[j.cls[i]]++;
        const char *sname = sep[0] == '\t' ? "<TAB>" : sep[0] == ',' ? "," : sep;
        printf("exported %d %s samples (indices %ld..%ld, seed %ld, %dx%d) to %s:\n", n, split, first,
               first + n - 1, seed, size, size, out);
        printf("  classes/<class>/*.png  %d images in %d class folders   (eval --zeroshot-data %s/classes)\n", n,
               classes, out);
        printf("  captions.csv           %d rows filepath%stitle   (train --train-data, eval --val-data%s)\n", n, sname,
               sep[0] == '\t' ? "" : ": add --csv-separator");
        printf("  texts.txt              %d captions, one per line   (embed --texts)\n", n);
        printf("  match.tsv              %d image<TAB>caption<TAB>answer rows, %ld yes / %ld no   "
               "(finetune --task pair-cls)\n", n, n_yes, n - n_yes);
        printf("pixels are the synthetic [-1, 1] values as 8-bit RGB: give --image-mean 0.5 --image-std 0.5 to "
               "train, eval, classify and embed\n");
    }
    free(j.cls);
    vlmoe_synth_free(s);
    return rc;
}

int cmd_synth(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[2], "export")) return synth_export(argc, argv);
    if (argc >= 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
        printf("usage: vlmoe synth export --out DIR [options]   (vlmoe synth export --help)\n\n"
               "The built-in synthetic data as files.\n");
        return 0;
    }
    return cli_error("synth", "expected `vlmoe synth export ...` (see vlmoe synth export --help)");
}
