// bench_image.c: images/s of the eval input pipeline (src/data/image.c, MODEL.md "Data"):
// read + decode a JPEG + resize shorter side to 224 (bicubic) + center crop + normalise into
// (3, 224, 224) floats, over 64 generated 500x375 photo-like JPEGs, with 1 and 2 OpenMP threads
// (one image per iteration), then the same through the training data loader (src/data/loader.c:
// a CSV of the files, worker threads, batches of 64 assembled in order). Then runs
// bench/bench_image_pil.py on the same files for PIL's rate.
// Usage: bench_image [rounds]   (from the repository root; VLMOE_BENCH_NO_PIL=1 skips PIL)
#include <dirent.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jpeglib.h>

#include "core/core.h"
#include "data/image.h"
#include "data/loader.h"

enum { NIMG = 64, W = 500, H = 375, S = 224 };

static double clock_s(clockid_t id) {
    struct timespec t;
    clock_gettime(id, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// A photo-like picture: smooth colour gradients, a few soft blobs, sharp edges and noise, so
// the JPEG is about as costly to decode as a real photo of this size (q 90, 4:2:0).
static int write_jpeg(const char *path, uint64_t seed) {
    static uint8_t px[W * H * 3];
    vlmoe_rng r;
    vlmoe_rng_seed(&r, seed);
    double cx[4], cy[4], rad[4], col[4][3];
    for (int b = 0; b < 4; b++) {
        cx[b] = W * vlmoe_rng_uniform(&r), cy[b] = H * vlmoe_rng_uniform(&r);
        rad[b] = 30 + 90 * vlmoe_rng_uniform(&r);
        for (int c = 0; c < 3; c++) col[b][c] = 255 * vlmoe_rng_uniform(&r) - 128;
    }
    double g0 = 255 * vlmoe_rng_uniform(&r), g1 = 255 * vlmoe_rng_uniform(&r);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            for (int c = 0; c < 3; c++) {
                double v = (c == 0 ? g0 : c == 1 ? g1 : 128) * (0.5 + 0.5 * x / W) +
                           40.0 * y / H;
                for (int b = 0; b < 4; b++) {
                    double d2 = ((x - cx[b]) * (x - cx[b]) + (y - cy[b]) * (y - cy[b])) /
                                (rad[b] * rad[b]);
                    if (d2 < 1) v += col[b][c] * (1 - d2);
                }
                if (((x / 25) + (y / 25)) % 7 == 0) v = 255 - v;
                v += 24 * (vlmoe_rng_uniform(&r) - 0.5);
                px[((size_t)y * W + x) * 3 + c] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    struct jpeg_compress_struct ci;
    struct jpeg_error_mgr err;
    ci.err = jpeg_std_error(&err);
    jpeg_create_compress(&ci);
    jpeg_stdio_dest(&ci, f);
    ci.image_width = W;
    ci.image_height = H;
    ci.input_components = 3;
    ci.in_color_space = JCS_RGB;
    jpeg_set_defaults(&ci);
    jpeg_set_quality(&ci, 90, TRUE);
    jpeg_start_compress(&ci, TRUE);
    while (ci.next_scanline < ci.image_height) {
        JSAMPROW row = px + (size_t)ci.next_scanline * W * 3;
        jpeg_write_scanlines(&ci, &row, 1);
    }
    jpeg_finish_compress(&ci);
    jpeg_destroy_compress(&ci);
    return fclose(f) != 0;
}

typedef enum { FULL, DECODE, PREPROCESS, TRAIN } stage;

// One pass over the files with nt threads; returns images/s of wall time, or -1 on a failure,
// and in *cpu_rate images per second of process CPU time (all threads), which stays meaningful
// when other jobs share the machine.
static double pass(char paths[][512], vlmoe_image *decoded, int nt, stage what, double *sum,
                   double *cpu_rate) {
    const vlmoe_image_params p = vlmoe_image_default_params();
    int errors = 0;
    double s = 0, t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
#pragma omp parallel num_threads(nt) reduction(+ : errors, s)
    {
        vlmoe_image img = {0};
        float *out = malloc(sizeof(float) * 3 * S * S);
        vlmoe_rng r;
        vlmoe_rng_seed(&r, 1234 + (uint64_t)omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < NIMG; i++) {
            int rc = VLMOE_OK;
            if (what == FULL || what == DECODE) rc = vlmoe_image_load(paths[i], &img);
            if (!rc && what == FULL) rc = vlmoe_image_preprocess_eval(&img, &p, out);
            if (!rc && what == PREPROCESS) rc = vlmoe_image_preprocess_eval(&decoded[i], &p, out);
            if (!rc && what == TRAIN) rc = vlmoe_image_preprocess_train(&decoded[i], &p, &r, out);
            if (rc) {
                fprintf(stderr, "bench_image: %s\n", vlmoe_last_error());
                errors++;
            } else if (what != DECODE) {
                s += out[0] + out[3 * S * S - 1];
            }
        }
        free(out);
        vlmoe_image_free(&img);
    }
    double dt = clock_s(CLOCK_MONOTONIC) - t0, dc = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    *sum += s;
    *cpu_rate = NIMG / dc;
    return errors ? -1 : NIMG / dt;
}

typedef struct { double wall, cpu; } rate;

// Through the loader: `rounds` passes of 4 batches of NIMG images (one epoch each, file order)
// from csv with nw workers, eval or train transform, no tokenizer; the median images/s of wall
// and of process CPU time. Timed from the first batch request (the workers start there) to the
// last batch: what the workers do ahead of it is not counted as done.
static rate loader_rate(const char *csv, int nw, int train, int rounds, double *sum) {
    double w[64], c[64];
    if (rounds > 64) rounds = 64;
    vlmoe_loader_params p = vlmoe_loader_default_params();
    p.data.path = csv;
    p.data.separator = ',';
    p.image.size = S;
    p.train = train;
    p.shuffle = 0;
    p.batch_size = NIMG;
    p.workers = nw;
    for (int k = 0; k < rounds; k++) {
        vlmoe_loader *ld = NULL;
        vlmoe_batch b = {0, NULL, NULL, NULL};
        int st = vlmoe_loader_open(&p, &ld);
        double t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
        for (int i = 0; !st && i < 4; i++) {
            st = vlmoe_loader_next(ld, &b, NULL);
            if (!st) *sum += b.images[0] + b.images[(size_t)NIMG * 3 * S * S - 1];
        }
        w[k] = 4 * NIMG / (clock_s(CLOCK_MONOTONIC) - t0);
        c[k] = 4 * NIMG / (clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0);
        vlmoe_loader_free(ld);
        if (st) {
            fprintf(stderr, "bench_image: loader: %s\n", vlmoe_last_error());
            return (rate){-1, -1};
        }
    }
    qsort(w, (size_t)rounds, sizeof(double), cmp);
    qsort(c, (size_t)rounds, sizeof(double), cmp);
    return (rate){w[rounds / 2], c[rounds / 2]};
}

static rate median_rate(char paths[][512], vlmoe_image *decoded, int nt, stage what, int rounds,
                        double *sum) {
    double w[64], c[64];
    if (rounds > 64) rounds = 64;
    pass(paths, decoded, nt, what, sum, &c[0]);   // warm-up (page cache, allocator)
    for (int k = 0; k < rounds; k++) w[k] = pass(paths, decoded, nt, what, sum, &c[k]);
    qsort(w, (size_t)rounds, sizeof(double), cmp);
    qsort(c, (size_t)rounds, sizeof(double), cmp);
    return (rate){w[0] < 0 ? -1 : w[rounds / 2], c[rounds / 2]};
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 9;
    if (rounds < 1) rounds = 1;
    char dir[] = "/tmp/vlmoe_bench_image_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("bench_image: mkdtemp");
        return 1;
    }
    static char paths[NIMG][512];
    char csv[600];
    snprintf(csv, sizeof csv, "%s/files.csv", dir);
    FILE *fc = fopen(csv, "w");
    if (fc) fputs("filepath,title\n", fc);
    size_t bytes = 0;
    for (int i = 0; i < NIMG; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/img%02d.jpg", dir, i);
        if (write_jpeg(paths[i], 1000 + (uint64_t)i)) {
            fprintf(stderr, "bench_image: cannot write %s\n", paths[i]);
            return 1;
        }
        if (fc) fprintf(fc, "img%02d.jpg,image %d\n", i, i);
        FILE *f = fopen(paths[i], "rb");
        if (f) {
            fseek(f, 0, SEEK_END);
            bytes += (size_t)ftell(f);
            fclose(f);
        }
    }
    if (!fc || fclose(fc)) {
        fprintf(stderr, "bench_image: cannot write %s\n", csv);
        return 1;
    }
    vlmoe_image decoded[NIMG];
    memset(decoded, 0, sizeof decoded);
    for (int i = 0; i < NIMG; i++)
        if (vlmoe_image_load(paths[i], &decoded[i])) {
            fprintf(stderr, "bench_image: %s\n", vlmoe_last_error());
            return 1;
        }
    printf("bench_image: %d JPEGs %dx%d (q90 4:2:0, mean %.0f KB) in %s -> (3, %d, %d) float, "
           "median of %d passes\n", NIMG, W, H, bytes / 1024.0 / NIMG, dir, S, S, rounds);
    double sum = 0;
    rate full1 = median_rate(paths, decoded, 1, FULL, rounds, &sum);
    rate full2 = median_rate(paths, decoded, 2, FULL, rounds, &sum);
    rate dec1 = median_rate(paths, decoded, 1, DECODE, rounds, &sum);
    rate pre1 = median_rate(paths, decoded, 1, PREPROCESS, rounds, &sum);
    rate train1 = median_rate(paths, decoded, 1, TRAIN, rounds, &sum);
    rate ld1 = loader_rate(csv, 1, 0, rounds, &sum), ld2 = loader_rate(csv, 2, 0, rounds, &sum);
    rate ldt2 = loader_rate(csv, 2, 1, rounds, &sum);
    printf("  %-36s %9s %9s %14s\n", "", "images/s", "per CPU-s", "CPU ms/image");
    const char *fmt = "  %-36s %9.1f %9.1f %14.2f\n";
    printf(fmt, "vlmoe decode+eval, 1 thread", full1.wall, full1.cpu, 1e3 / full1.cpu);
    printf(fmt, "vlmoe decode+eval, 2 threads", full2.wall, full2.cpu, 1e3 / full2.cpu);
    printf(fmt, "vlmoe read+decode only, 1 thread", dec1.wall, dec1.cpu, 1e3 / dec1.cpu);
    printf(fmt, "vlmoe eval preprocess only, 1 thread", pre1.wall, pre1.cpu, 1e3 / pre1.cpu);
    printf(fmt, "vlmoe train preprocess (RRC), 1 thr.", train1.wall, train1.cpu, 1e3 / train1.cpu);
    printf(fmt, "vlmoe loader, eval, 1 worker", ld1.wall, ld1.cpu, 1e3 / ld1.cpu);
    printf(fmt, "vlmoe loader, eval, 2 workers", ld2.wall, ld2.cpu, 1e3 / ld2.cpu);
    printf(fmt, "vlmoe loader, train (RRC), 2 workers", ldt2.wall, ldt2.cpu, 1e3 / ldt2.cpu);
    printf("  (2 threads: x%.2f wall; checksum %.6g)\n", full2.wall / full1.wall, sum);
    fflush(stdout);
    for (int i = 0; i < NIMG; i++) vlmoe_image_free(&decoded[i]);

    int rc = 0;
    const char *skip = getenv("VLMOE_BENCH_NO_PIL");
    if (!(skip && *skip == '1')) {
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 bench/bench_image_pil.py %s %d", dir, rounds);
        if (access("bench/bench_image_pil.py", R_OK) == 0) {
            rc = system(cmd);
            if (rc) fprintf(stderr, "bench_image: '%s' failed (%d)\n", cmd, rc);
        } else {
            printf("  PIL comparison: run from the repository root: %s\n", cmd);
        }
    }
    for (int i = 0; i < NIMG; i++) unlink(paths[i]);
    unlink(csv);
    rmdir(dir);
    return full1.wall < 0 || full2.wall < 0 || dec1.wall < 0 || pre1.wall < 0 ||
           train1.wall < 0 || ld1.wall < 0 || ld2.wall < 0 || ldt2.wall < 0 || rc != 0;
}
