// test_loader.c: the training data loader (src/data/loader.c, MODEL.md "Data") on JPEG images,
// an OpenCLIP CSV and webdataset shards made here: batches identical for 0, 1, 2 and 4 workers;
// a seeded order that visits every sample once per epoch; resume mid-epoch (and mid shuffle
// block) continuing with exactly the next samples; bad samples skipped and counted; too many bad
// samples, an epoch without a usable one and missing files are errors. Then `vlmoe train` on a
// CSV and on tar shards (with a vocabulary it trains itself), stopped and resumed, logs the
// losses of an uninterrupted run. Runs $VLMOE_BIN(_ASAN) for that part, as tests/run.sh sets it.
#include <pthread.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data/loader.h"
#include "ops/backend.h"
#include "test.h"
#include "test_jpeg.h"
#include "test_tar.h"

enum { NIMG = 30, BS = 4, MAXB = 24, KL = 160 };
static char dir[64];

static const char *P(const char *rel) { return test_path(dir, rel); }
static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }

// Image i: a gradient with a colour of its own, sizes varying so that crops differ.
static uint8_t *jpeg_of(int i, size_t *n) {
    const int w = 36 + 4 * (i % 4), h = 28 + 2 * (i % 3);
    uint8_t *px = malloc((size_t)w * h * 3);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < 3; c++) px[(y * w + x) * 3 + c] = (uint8_t)(37 * i + 60 * c + 3 * x + 5 * y);
    uint8_t *jpg = enc_jpeg(px, w, h, 3, 90, 0, n);
    free(px);
    return jpg;
}

static const char *CORRUPT = "\xff\xd8\xff\xe0 not really a JPEG";

// data.csv: NIMG good rows, a missing image (row 11), a corrupt one (row 21), an empty caption.
// shards/s-{0..2}.tar: 10 good samples each; shard 1 also a corrupt image, shard 2 an image
// without its caption.
static void make_data(void) {
    mkdir(P("img"), 0755);
    mkdir(P("shards"), 0755);
    char csv[8192] = "filepath,title\n", name[64];
    member m[32];
    char caps[NIMG][48];
    uint8_t *jpg[NIMG];
    size_t len[NIMG];
    for (int i = 0; i < NIMG; i++) {
        jpg[i] = jpeg_of(i, &len[i]);
        snprintf(name, sizeof name, "img/i%02d.jpg", i);
        test_write_file(P(name), jpg[i], len[i]);
        snprintf(caps[i], sizeof caps[i], "photo number %d", i);
        size_t k = strlen(csv);
        snprintf(csv + k, sizeof csv - k, "%s,%s\n", name, caps[i]);
        if (i == 10) strcat(csv, "img/missing.jpg,a missing file\n");
        if (i == 20) strcat(csv, "img/corrupt.jpg,corrupt bytes\n");
        if (i == 25) strcat(csv, "img/i05.jpg,   \n");
    }
    test_write_file(P("img/corrupt.jpg"), CORRUPT, strlen(CORRUPT));
    put("data.csv", csv);
    static char names[NIMG][2][32];
    for (int s = 0; s < 3; s++) {
        int n = 0;
        for (int i = 10 * s; i < 10 * s + 10; i++) {
            snprintf(names[i][0], 32, "%d_%02d.jpg", s, i);
            snprintf(names[i][1], 32, "%d_%02d.txt", s, i);
            m[n++] = (member){names[i][0], (const char *)jpg[i], len[i]};
            m[n++] = (member){names[i][1], caps[i], strlen(caps[i])};
            if (s == 1 && i == 14) {
                m[n++] = (member){"bad.jpg", CORRUPT, strlen(CORRUPT)};
                m[n++] = (member)M("bad.txt", "a corrupt image");
            }
        }
        if (s == 2) m[n++] = (member)M("lonely.jpg", "\xff\xd8 no caption");
        snprintf(name, sizeof name, "shards/s-%d.tar", s);
        write_tar(P(name), 0, m, n);
    }
    for (int i = 0; i < NIMG; i++) free(jpg[i]);
}

// The captions' bytes as ids: [1] bytes [2] then 0 (a stand-in for a tokenizer).
static int tok_bytes(void *user, const char *text, int32_t *ids, int ctx) {
    int n = 0;
    ids[n++] = 1;
    for (const char *p = text; *p && n < ctx - 1; p++) ids[n++] = (unsigned char)*p;
    ids[n++] = 2;
    for (int i = n; i < ctx; i++) ids[i] = 0;
    (void)user;
    return n;
}

static int g_resampled;   // params() draws shards with replacement

static vlmoe_loader_params params(const char *path, int workers) {
    vlmoe_loader_params p = vlmoe_loader_default_params();
    p.data.path = strncmp(path, "pipe:", 5) && path[0] != '/' ? P(path) : path;   // a command names its files itself
    p.resampled = g_resampled;
    p.data.separator = ',';
    p.image.size = 16;
    p.image.flip_prob = 0.5;
    p.image.scale_min = 0.3;
    p.batch_size = BS;
    p.context_length = 12;
    p.tokenize = tok_bytes;
    p.shuffle_block = 8;
    p.seed = 7;
    p.workers = workers;
    p.max_bad_fraction = 0.5;
    return p;
}

typedef struct {
    int n, st;                   // batches read; status of the call that stopped (0: all read)
    uint64_t hash[MAXB];         // of each batch's images, tokens and lengths
    char keys[MAXB * BS][KL];
    vlmoe_data_state pos[MAXB];  // after each batch
    vlmoe_dataset_stats stats;
} run_out;

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return h;
}

// nb batches of a loader opened with p, from `from` (NULL: the start).
static void run(const vlmoe_loader_params *p, const vlmoe_data_state *from, int nb, run_out *o) {
    memset(o, 0, sizeof *o);
    vlmoe_loader *ld = NULL;
    o->st = vlmoe_loader_open(p, &ld);
    if (!o->st && from) o->st = vlmoe_loader_seek(ld, from);
    for (; !o->st && o->n < nb; o->n++) {
        vlmoe_batch b;
        const char *const *keys;
        if ((o->st = vlmoe_loader_next(ld, &b, &keys))) break;
        const size_t S = (size_t)p->image.size;
        uint64_t h = fnv(1469598103934665603ull, b.images, sizeof(float) * 3 * S * S * BS);
        h = fnv(h, b.tokens, sizeof(int32_t) * (size_t)p->context_length * BS);
        o->hash[o->n] = fnv(h, b.lengths, sizeof(int32_t) * BS);
        for (int i = 0; i < BS; i++) snprintf(o->keys[o->n * BS + i], KL, "%s", strrchr(keys[i], '/') + 1);
        vlmoe_loader_position(ld, &o->pos[o->n]);
    }
    if (ld) o->stats = *vlmoe_loader_stats(ld);
    vlmoe_loader_free(ld);
}

static run_out ra, rb;   // big: static

// Images as bytes (p.pixels, issue 16): the same samples, crops, flips and order as the float
// batches, and the CPU table's normalisation of the bytes gives the float batch bit for bit.
static void test_pixels(const char *path) {
    vlmoe_loader_params pf = params(path, 2), pb = params(path, 2);
    pb.pixels = 1;
    vlmoe_loader *lf = NULL, *lb = NULL;
    int st = vlmoe_loader_open(&pf, &lf);
    if (!st) st = vlmoe_loader_open(&pb, &lb);
    const int S = pf.image.size;
    const size_t n = (size_t)3 * S * S * BS;
    float *g = malloc(sizeof(float) * n);
    const vlmoe_backend_f32 *cpu = backend_cpu_f32();
    be_pixels q = {.B = BS, .C = 3, .H = S, .W = S, .hwc = 1};
    memcpy(q.mean, pf.image.mean, sizeof(float) * 3), memcpy(q.std, pf.image.std, sizeof(float) * 3);
    int same = 0, nb = 6, null_images = 0;
    for (int k = 0; k < nb && !st; k++) {
        vlmoe_batch bf, bb;
        const char *const *kf, *const *kb;
        if ((st = vlmoe_loader_next(lf, &bf, &kf)) || (st = vlmoe_loader_next(lb, &bb, &kb))) break;
        null_images += bb.images == NULL && vlmoe_loader_pixels(lf) == NULL;
        const uint8_t *px = vlmoe_loader_pixels(lb);
        if (!px) break;
        cpu->pixels_normalize(cpu, g, px, &q);
        int keys = 1;
        for (int i = 0; i < BS; i++) keys &= !strcmp(kf[i], kb[i]);
        same += keys && !memcmp(g, bf.images, sizeof(float) * n) && !memcmp(bf.lengths, bb.lengths, sizeof(int32_t) * BS);
    }
    CHECK(st == VLMOE_OK, "%s as bytes: %s", path, vlmoe_last_error());
    CHECK(same == nb, "%s: %d of %d byte batches normalise to the float batches", path, same, nb);
    CHECK(null_images == nb, "%s: a byte loader returned float images too, or a float loader bytes", path);
    // swapped mean and std: the control, which must not match
    memcpy(q.mean, pf.image.std, sizeof(float) * 3), memcpy(q.std, pf.image.mean, sizeof(float) * 3);
    vlmoe_batch bf, bb;
    if (!st && !vlmoe_loader_next(lf, &bf, NULL) && !vlmoe_loader_next(lb, &bb, NULL)) {
        cpu->pixels_normalize(cpu, g, vlmoe_loader_pixels(lb), &q);
        CHECK(memcmp(g, bf.images, sizeof(float) * n) != 0, "%s: swapped mean and std still match", path);
    }
    free(g);
    vlmoe_loader_free(lf), vlmoe_loader_free(lb);
}

static void test_workers(const char *path) {
    vlmoe_loader_params p = params(path, 0);
    run(&p, NULL, 20, &ra);
    CHECK(ra.st == VLMOE_OK && ra.n == 20, "%s, 0 workers: %d batches: %s", path, ra.n, vlmoe_last_error());
    const int workers[] = {1, 2, 4};
    for (int w = 0; w < 3; w++) {
        p.workers = workers[w];
        p.prefetch = w + 1;
        run(&p, NULL, 20, &rb);
        int same = rb.n == 20;
        for (int i = 0; same && i < 20; i++) same = ra.hash[i] == rb.hash[i];
        for (int i = 0; same && i < 20 * BS; i++) same = !strcmp(ra.keys[i], rb.keys[i]);
        CHECK(same, "%s: %d workers (prefetch %d) give other batches than 0 workers", path, workers[w], w + 1);
    }
}

static int cmp_key(const void *a, const void *b) { return strcmp(a, b); }

// keys[0..n) sorted equal to want (sorted)?
static int same_set(char (*keys)[KL], int n, char (*want)[KL]) {
    static char tmp[MAXB * BS][KL];
    memcpy(tmp, keys, sizeof(tmp[0]) * (size_t)n);
    qsort(tmp, (size_t)n, KL, cmp_key);
    for (int i = 0; i < n; i++)
        if (strcmp(tmp[i], want[i])) return 0;
    return 1;
}

static void test_order(const char *path) {
    // file order: the good samples of epoch 0, which every shuffled epoch must permute
    static char file[MAXB * BS][KL];
    vlmoe_loader_params p = params(path, 2);
    p.shuffle = 0;
    run(&p, NULL, 20, &ra);
    CHECK(ra.st == VLMOE_OK, "%s: %s", path, vlmoe_last_error());
    CHECK(ra.pos[6].data_epoch == 0 && ra.pos[7].data_epoch == 1, "%s: epochs %lld, %lld after 28, 32 samples", path,
          (long long)ra.pos[6].data_epoch, (long long)ra.pos[7].data_epoch);
    memcpy(file, ra.keys, sizeof file);
    CHECK(!strcmp(file[0], !strcmp(path, "data.csv") ? "data.csv:2" : "s-0.tar:0_00") &&
          !strcmp(file[NIMG - 1], !strcmp(path, "data.csv") ? "data.csv:34" : "s-2.tar:2_29") &&
          !strcmp(file[NIMG], file[0]), "%s unshuffled: %s .. %s, then %s", path, file[0], file[NIMG - 1], file[NIMG]);
    qsort(file, NIMG, KL, cmp_key);
    p.shuffle = 1;
    run(&p, NULL, 20, &ra);
    CHECK(same_set(ra.keys, NIMG, file) && same_set(ra.keys + NIMG, NIMG, file),
          "%s: epochs 0 and 1 are not permutations of the samples", path);
    int moved = 0, differ = 0;
    for (int i = 0; i < NIMG; i++) moved += strcmp(ra.keys[i], file[i]) != 0, differ += strcmp(ra.keys[i], ra.keys[NIMG + i]) != 0;
    CHECK(moved > NIMG / 2 && differ > NIMG / 2, "%s: shuffle moved %d samples, epochs differ at %d places", path,
          moved, differ);
    p.seed = 8;
    run(&p, NULL, 8, &rb);
    int same = 0;
    for (int i = 0; i < NIMG; i++) same += !strcmp(ra.keys[i], rb.keys[i]);
    CHECK(same < NIMG / 2, "%s: seeds 7 and 8 agree on %d of %d places", path, same, NIMG);
}

static void test_resume(const char *path) {
    vlmoe_loader_params p = params(path, 2);
    run(&p, NULL, 20, &ra);
    const int cuts[] = {1, 2, 3, 7, 8, 13};
    for (int c = 0; c < 6; c++) {
        const int k = cuts[c];
        p.workers = c % 3;
        run(&p, &ra.pos[k - 1], 20 - k, &rb);
        int same = rb.n == 20 - k;
        for (int i = 0; same && i < 20 - k; i++)
            same = rb.hash[i] == ra.hash[k + i] && rb.pos[i].data_position == ra.pos[k + i].data_position;
        for (int i = 0; same && i < (20 - k) * BS; i++) same = !strcmp(rb.keys[i], ra.keys[k * BS + i]);
        CHECK(same, "%s: resumed after batch %d (epoch %lld, sample %lld): next keys %s %s, want %s %s", path, k,
              (long long)ra.pos[k - 1].data_epoch, (long long)ra.pos[k - 1].data_index, rb.keys[0], rb.keys[1],
              ra.keys[k * BS], ra.keys[k * BS + 1]);
    }
    // positions of another seed, not a loader's, or after the first batch are refused
    vlmoe_loader *ld = NULL;
    vlmoe_data_state bad = ra.pos[3];
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_OK, "open");
    bad.data_rng[0] = 99;
    CHECK(vlmoe_loader_seek(ld, &bad) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "seed 99"), "%s",
          vlmoe_last_error());
    memset(&bad, 0, sizeof bad);
    CHECK(vlmoe_loader_seek(ld, &bad) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "not a loader's"), "%s",
          vlmoe_last_error());
    bad = ra.pos[3];
    bad.data_index = 1001;                       // CSV: past the rows; webdataset: past the (empty)
    bad.data_block[0] = 3, bad.data_block[1] = 0;  // block that starts after the last shard
    int st = vlmoe_loader_seek(ld, &bad);
    vlmoe_batch b;
    if (!st) st = vlmoe_loader_next(ld, &b, NULL);   // webdataset finds out when it reads the block
    CHECK(st == VLMOE_ERR_ARG, "%s: a position past the data: %d %s", path, st, vlmoe_last_error());
    vlmoe_loader_free(ld);
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_OK && vlmoe_loader_next(ld, &b, NULL) == VLMOE_OK, "open");
    CHECK(vlmoe_loader_seek(ld, &ra.pos[3]) == VLMOE_ERR_ARG, "seek after the first batch");
    vlmoe_loader_free(ld);
}

static void test_bad(void) {
    // file order, batches of 4: after 8 batches (32 good samples) all of epoch 0 was consumed
    vlmoe_loader_params p = params("data.csv", 2);
    p.shuffle = 0;
    run(&p, NULL, 8, &ra);
    const vlmoe_dataset_stats *s = &ra.stats;
    CHECK(ra.st == VLMOE_OK && s->total == 35 && s->bad[VLMOE_BAD_EMPTY_CAPTION] == 1 &&
          s->bad[VLMOE_BAD_UNREADABLE_IMAGE] == 1 && s->bad[VLMOE_BAD_UNDECODABLE_IMAGE] == 1 &&
          vlmoe_dataset_stats_bad(s) == 3, "csv: %lld samples, %lld bad", (long long)s->total,
          (long long)vlmoe_dataset_stats_bad(s));
    CHECK(s->n_msgs == 3 && strstr(s->msgs[0], "data.csv:30: empty caption") &&
          strstr(s->msgs[1], "data.csv:13: ") && strstr(s->msgs[1], "missing.jpg") &&
          strstr(s->msgs[2], "data.csv:24: ") && strstr(s->msgs[2], "corrupt.jpg"),
          "messages: %s | %s | %s", s->msgs[0], s->msgs[1], s->msgs[2]);
    p = params("shards/s-{0..2}.tar", 2);
    p.shuffle = 0;
    run(&p, NULL, 8, &ra);
    CHECK(ra.st == VLMOE_OK && s->total == 34 && s->bad[VLMOE_BAD_NO_PARTNER] == 1 &&
          s->bad[VLMOE_BAD_UNDECODABLE_IMAGE] == 1 && vlmoe_dataset_stats_bad(s) == 2 &&
          strstr(s->msgs[0], "s-1.tar:bad: ") && strstr(s->msgs[1], "s-2.tar:lonely: image without"),
          "shards: %lld samples, %lld bad: %s | %s", (long long)s->total, (long long)vlmoe_dataset_stats_bad(s),
          s->msgs[0], s->msgs[1]);
}

// Batches until an error (at most 40); returns the error.
static int read_until_error(const vlmoe_loader_params *p) {
    vlmoe_loader *ld = NULL;
    int st = vlmoe_loader_open(p, &ld);
    vlmoe_batch b;
    for (int i = 0; !st && i < 40; i++) st = vlmoe_loader_next(ld, &b, NULL);
    if (st && ld) {   // sticky
        char first[1024];
        snprintf(first, sizeof first, "%s", vlmoe_last_error());
        CHECK(vlmoe_loader_next(ld, &b, NULL) == st && !strcmp(vlmoe_last_error(), first), "not sticky: %s",
              vlmoe_last_error());
    }
    vlmoe_loader_free(ld);
    return st;
}

static void test_bad_fraction(void) {
    const char *paths[] = {"data.csv", "shards/s-{0..2}.tar"};
    for (int k = 0; k < 2; k++) {
        vlmoe_loader_params p = params(paths[k], 2);
        p.max_bad_fraction = 0.04;   // 3 of 33 CSV rows, 2 of 32 shard samples
        int st = read_until_error(&p);
        CHECK(st == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "too many bad samples") &&
              strstr(vlmoe_last_error(), k ? "s-{0..2}.tar" : "data.csv"), "%s: %d %s", paths[k], st, vlmoe_last_error());
        p.bad_check_min = 1;
        p.shuffle = 0;
        p.max_bad_fraction = 1.0 / 40;   // found before the end of the epoch once a bad one is counted
        CHECK(read_until_error(&p) == VLMOE_ERR_FORMAT, "%s with bad_check_min 1", paths[k]);
    }
    // rows rejected when the CSV is indexed: too many, or none left
    put("few.csv", "filepath,title\nimg/i00.jpg,ok\nimg/i01.jpg,\nimg/i02.jpg,\n");
    vlmoe_loader_params p = params("few.csv", 1);
    vlmoe_loader *ld = NULL;
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_ERR_FORMAT && !ld && strstr(vlmoe_last_error(), "few.csv") &&
          strstr(vlmoe_last_error(), "empty_caption 2"), "%s", vlmoe_last_error());
    put("none.csv", "filepath,title\nimg/i00.jpg,\n");
    p = params("none.csv", 1);
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "no usable rows"), "%s",
          vlmoe_last_error());
    // every image unreadable, even with every sample allowed to be bad: an error, not a hang
    put("gone.csv", "filepath,title\nimg/gone1.jpg,one\nimg/gone2.jpg,two\n");
    p = params("gone.csv", 2);
    p.max_bad_fraction = 1;
    CHECK(read_until_error(&p) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "no usable sample"), "%s",
          vlmoe_last_error());
    put("shards/empty.tar", "");
    p = params("shards/empty.tar", 2);
    p.max_bad_fraction = 1;
    CHECK(read_until_error(&p) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "no usable sample"), "%s",
          vlmoe_last_error());
    // missing data: errors at open naming the file
    p = params("nope.csv", 1);
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), "nope.csv"), "%s",
          vlmoe_last_error());
    p = params("shards/s-{0..3}.tar", 1);
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), "s-3.tar"), "%s",
          vlmoe_last_error());
    p = params("data.csv", 1);
    p.batch_size = 0;
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_ERR_ARG, "batch size 0");
}


// ---- resampled shards, pipe: shards, CSV image paths ---------------------------------------
// Samples per shard of `nb` batches of `bs` (key "s-K.tar:..."), for the draw statistics.
static int count_shards(vlmoe_loader_params *p, int nb, int bs, long n[3]) {
    vlmoe_loader *ld = NULL;
    p->batch_size = bs;
    int st = vlmoe_loader_open(p, &ld);
    n[0] = n[1] = n[2] = 0;
    for (int i = 0; !st && i < nb; i++) {
        vlmoe_batch b;
        const char *const *keys;
        if ((st = vlmoe_loader_next(ld, &b, &keys))) break;
        for (int j = 0; j < bs; j++) {
            const char *k = strstr(keys[j], "/s-");
            if (k && k[3] >= '0' && k[3] <= '2') n[k[3] - '0']++;
        }
    }
    vlmoe_loader_free(ld);
    p->batch_size = BS;
    return st;
}

// Pearson's chi-square of the shard draws (each draw of these shards gives 10 good samples, so
// samples / 10 counts the draws) against probabilities w / sum(w).
static double chi2(const long n[3], const double w[3]) {
    const double draws = (double)(n[0] + n[1] + n[2]) / 10, tw = w[0] + w[1] + w[2];
    double x = 0;
    for (int i = 0; i < 3; i++) {
        const double e = draws * w[i] / tw, d = (double)n[i] / 10 - e;
        x += e > 0 ? d * d / e : (n[i] ? 1e9 : 0);
    }
    return x;
}

static void test_resampled(void) {
    const char *path = "shards/s-{0..2}.tar";
    g_resampled = 1;
    test_workers(path);   // the same batches for 0, 1, 2 and 4 workers
    vlmoe_loader_params p = params(path, 2);
    run(&p, NULL, 20, &ra);   // 80 samples of 30: no epoch end
    CHECK(ra.st == VLMOE_OK && ra.n == 20 && ra.pos[19].data_epoch == 0 && ra.pos[19].data_position >= 80,
          "resampled: %d batches, epoch %lld, position %llu: %s", ra.n, (long long)ra.pos[19].data_epoch,
          (unsigned long long)ra.pos[19].data_position, vlmoe_last_error());
    p.epoch_samples = 16;     // OpenCLIP's --train-num-samples "epochs", for the position only
    run(&p, NULL, 20, &rb);
    int same = rb.n == 20;
    for (int i = 0; same && i < 20; i++)
        same = rb.hash[i] == ra.hash[i] && rb.pos[i].data_epoch == (int64_t)(rb.pos[i].data_position / 16);
    CHECK(same && rb.pos[19].data_epoch == 5, "epoch_samples 16: epoch %lld", (long long)rb.pos[19].data_epoch);
    // seeded: again the same, another seed other samples
    run(&p, NULL, 20, &rb);
    same = rb.n == 20;
    for (int i = 0; same && i < 20 * BS; i++) same = !strcmp(ra.keys[i], rb.keys[i]);
    CHECK(same, "resampled twice with seed 7: other samples");
    p.seed = 8;
    run(&p, NULL, 20, &rb);
    int agree = 0;
    for (int i = 0; i < 20 * BS; i++) agree += !strcmp(ra.keys[i], rb.keys[i]);
    CHECK(rb.st == VLMOE_OK && agree < 20 * BS / 2, "seeds 7 and 8 agree on %d of %d samples", agree, 20 * BS);
    // resume at any batch (mid-block, mid-shard) continues with the next samples
    p.seed = 7;
    const int cuts[] = {1, 3, 5, 9, 14};
    for (int c = 0; c < 5; c++) {
        const int k = cuts[c];
        p.workers = c % 3;
        run(&p, &ra.pos[k - 1], 20 - k, &rb);
        same = rb.n == 20 - k;
        for (int i = 0; same && i < 20 - k; i++) same = rb.hash[i] == ra.hash[k + i];
        CHECK(same, "resampled, resumed after batch %d (sample %lld, draw %lld member %lld): %s", k,
              (long long)ra.pos[k - 1].data_index, (long long)ra.pos[k - 1].data_block[0],
              (long long)ra.pos[k - 1].data_block[1], vlmoe_last_error());
    }
    // a position of the unresampled order, or of other factors, is refused
    vlmoe_loader *ld = NULL;
    g_resampled = 0;
    vlmoe_loader_params q = params(path, 0);
    run(&q, NULL, 2, &rb);
    CHECK(vlmoe_loader_open(&p, &ld) == VLMOE_OK && vlmoe_loader_seek(ld, &rb.pos[1]) == VLMOE_ERR_ARG &&
          strstr(vlmoe_last_error(), "not resampled"), "%s", vlmoe_last_error());
    vlmoe_loader_free(ld);
    static char two[300];   // two sources
    snprintf(two, sizeof two, "%s/shards/s-0.tar::%s/shards/s-{1..2}.tar", dir, dir);
    q = params(two, 0);
    q.resampled = 1, q.upsampling = "1::3";
    run(&q, NULL, 2, &rb);
    q.upsampling = "1::2";
    CHECK(vlmoe_loader_open(&q, &ld) == VLMOE_OK && vlmoe_loader_seek(ld, &rb.pos[1]) == VLMOE_ERR_ARG &&
          strstr(vlmoe_last_error(), "other shard weights"), "%s", vlmoe_last_error());
    vlmoe_loader_free(ld);

    // The draws follow the weights: 300 draws (3000 samples) of sources "s-0 :: s-1, s-2" with
    // factors 1::3 (shard probabilities 1/7, 3/7, 3/7), without factors (1/3 each) and 0::1 (s-0
    // never). Pearson's chi-square of the draw counts (2 degrees of freedom) must stay under 13.8
    // (p = 0.001); the seed is fixed, so the check is deterministic, and it fails by far if the
    // weights are ignored (these draws score 48.9 against uniform probabilities).
    long n[3];
    const double w13[3] = {1, 3, 3}, w11[3] = {1, 1, 1};
    q.upsampling = "1::3";
    int st = count_shards(&q, 75, 40, n);
    double x = chi2(n, w13);
    printf("resampled draws, factors 1::3: samples per shard %ld %ld %ld, chi-square %.2f against 1/7 3/7 3/7 "
           "(%.1f against uniform)\n", n[0], n[1], n[2], x, chi2(n, w11));
    CHECK(!st && n[0] + n[1] + n[2] == 3000 && x < 13.8 && chi2(n, w11) > 13.8, "factors 1::3: %ld %ld %ld, "
          "chi-square %.2f: %s", n[0], n[1], n[2], x, vlmoe_last_error());
    q.upsampling = NULL;
    st = count_shards(&q, 75, 40, n);
    x = chi2(n, w11);
    printf("resampled draws, no factors: samples per shard %ld %ld %ld, chi-square %.2f against 1/3 each\n", n[0],
           n[1], n[2], x);
    CHECK(!st && x < 13.8, "uniform: %ld %ld %ld, chi-square %.2f", n[0], n[1], n[2], x);
    q.upsampling = "0::1";
    st = count_shards(&q, 20, 40, n);
    CHECK(!st && n[0] == 0 && n[1] > 0 && n[2] > 0, "0::1: %ld %ld %ld", n[0], n[1], n[2]);

    // errors at open: factors without resampling, resampling a CSV, factors not one per source
    // or not numbers, nothing but dry shards
    q.upsampling = "1::2::3";
    CHECK(vlmoe_loader_open(&q, &ld) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "3 factors") &&
          strstr(vlmoe_last_error(), "2 sources"), "%s", vlmoe_last_error());
    q.upsampling = "1::x";
    CHECK(vlmoe_loader_open(&q, &ld) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "factor 2"), "%s", vlmoe_last_error());
    q.upsampling = "0::0";
    CHECK(vlmoe_loader_open(&q, &ld) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "every factor is 0"), "%s",
          vlmoe_last_error());
    q.upsampling = "1::2", q.resampled = 0;
    CHECK(vlmoe_loader_open(&q, &ld) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "--dataset-resampled"), "%s",
          vlmoe_last_error());
    q = params("data.csv", 0);
    q.resampled = 1;
    CHECK(vlmoe_loader_open(&q, &ld) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "a CSV is read once per epoch"),
          "%s", vlmoe_last_error());
    CHECK(vlmoe_loader_check_order(&q) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "data.csv"), "%s", vlmoe_last_error());
    put("shards/dry.tar", "");
    q = params("shards/dry.tar", 1);
    q.resampled = 1, q.max_bad_fraction = 1;
    CHECK(read_until_error(&q) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "shards drawn in a row gave no usable"),
          "%s", vlmoe_last_error());
    g_resampled = 0;
}

// pipe: shards through the loader: the same batches as the files, and resumable inside a shard
// (the command is run again and its members skipped).
static void test_pipe(void) {
    static char pat[600];
    snprintf(pat, sizeof pat, "pipe:cat %s/shards/s-{0..2}.tar", dir);
    vlmoe_loader_params p = params("shards/s-{0..2}.tar", 2), q = params(pat, 2);
    run(&p, NULL, 20, &ra);
    run(&q, NULL, 20, &rb);
    int same = ra.n == 20 && rb.n == 20;
    for (int i = 0; same && i < 20; i++) same = ra.hash[i] == rb.hash[i];
    CHECK(same, "pipe: shards give other batches than the files: %s", vlmoe_last_error());
    test_workers(pat);
    test_order(pat);
    test_resume(pat);
    snprintf(pat, sizeof pat, "pipe:cat %s/shards/s-0.tar::pipe:exit 2", dir);
    q = params(pat, 1);
    run(&q, NULL, 20, &rb);
    CHECK(rb.st == VLMOE_OK && rb.stats.bad[VLMOE_BAD_FAILED_COMMAND] > 0 && strstr(rb.stats.msgs[0], "pipe:exit 2") &&
          strstr(rb.stats.msgs[0], "status 2"), "failing command: %s", rb.stats.msgs[0]);
    q.max_bad_fraction = 0.01, q.bad_check_min = 1;
    CHECK(read_until_error(&q) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "too many bad samples") &&
          strstr(vlmoe_last_error(), "pipe:exit 2: the command exited with status 2"), "%s", vlmoe_last_error());
}

static int notes;
static char note_msg[1024];
static void on_note(void *user, const char *msg) {
    notes++;
    snprintf(note_msg, sizeof note_msg, "%s", msg);
    (void)user;
}

// CSV image paths: relative to the working directory (OpenCLIP); else the CSV's folder, with one
// note as the first such sample is consumed.
static void test_csv_paths(void) {
    char old[4096];
    CHECK(getcwd(old, sizeof old) != NULL, "getcwd");
    vlmoe_loader_params p = params("data.csv", 2);
    p.data.note = on_note;
    p.shuffle = 0;
    notes = 0;
    run(&p, NULL, 8, &ra);   // from the test's folder: data.csv's paths exist in the CSV's folder only
    CHECK(ra.st == VLMOE_OK && notes == 1 && strstr(note_msg, "data.csv: note: image paths are read relative to the "
          "CSV file's folder") && strstr(note_msg, "img/i00.jpg"), "%d notes: %s", notes, note_msg);
    CHECK(strstr(ra.stats.msgs[1], "missing.jpg: cannot open") && strstr(ra.stats.msgs[1], "nor in the CSV's folder"),
          "%s", ra.stats.msgs[1]);
    CHECK(chdir(dir) == 0, "chdir");
    notes = 0;
    run(&p, NULL, 8, &rb);   // from the data's folder: the paths are the working directory's
    int same = rb.n == 8 && notes == 0;
    for (int i = 0; same && i < 8; i++) same = ra.hash[i] == rb.hash[i];
    CHECK(same, "cwd-relative: %d notes, batches %s", notes, same ? "same" : "differ");
    // a CSV in a subfolder whose paths are the working directory's: those files, not the ones of
    // the same name beside the CSV (corrupt here), and no note
    mkdir(P("sub"), 0755), mkdir(P("sub/img"), 0755);
    char csv[2048] = "filepath,title\n";
    for (int i = 0; i < 8; i++) {
        char rel[32];
        snprintf(rel, sizeof rel, "sub/img/i%02d.jpg", i);
        put(rel, CORRUPT);
        size_t k = strlen(csv);
        snprintf(csv + k, sizeof csv - k, "img/i%02d.jpg,photo number %d\n", i, i);
    }
    put("sub/pairs.csv", csv);
    p = params("sub/pairs.csv", 1);
    p.data.note = on_note;
    p.shuffle = 0;
    notes = 0;
    run(&p, NULL, 2, &rb);
    CHECK(rb.st == VLMOE_OK && notes == 0 && vlmoe_dataset_stats_bad(&rb.stats) == 0 && rb.hash[0] == ra.hash[0],
          "sub/pairs.csv from the working directory: %lld bad, %d notes: %s", (long long)vlmoe_dataset_stats_bad(&rb.stats),
          notes, vlmoe_last_error());
    CHECK(chdir(old) == 0, "chdir back");
}

// ---- the command ----------------------------------------------------------------------------
static const char *bin;
static char out[1 << 16];

static int cmd(const char *args) {
    char c[4096];
    snprintf(c, sizeof c, "cd %s && %s %s 2>&1", dir, bin, args);
    FILE *f = popen(c, "r");
    size_t n = f ? fread(out, 1, sizeof out - 1, f) : 0;
    out[n] = 0;
    int st = f ? pclose(f) : -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// The "loss" of each step of run NAME's metrics (the last line of a step wins); the steps read.
static int losses(const char *name, char (*l)[40], int max) {
    char rel[128], line[16384];
    snprintf(rel, sizeof rel, "runs/%s/metrics.jsonl", name);
    FILE *f = fopen(P(rel), "r");
    int n = 0, step;
    while (f && fgets(line, sizeof line, f)) {
        const char *q = strstr(line, "\"loss\":");
        if (q && sscanf(line, "{\"step\":%d", &step) == 1 && step >= 1 && step <= max) {
            sscanf(q + 7, "%39[^,}]", l[step - 1]);
            if (step > n) n = step;
        }
    }
    if (f) fclose(f);
    return n;
}

// Trains NAME for `steps` in one go and, as NAME_r, for `steps / 2` then resumed to `steps`:
// both log the same losses.
static void train_and_resume(const char *name, const char *args, int steps, const char *say) {
    char a[2048], resumed[64], full[16][40], res[16][40];
    snprintf(a, sizeof a, "train %s --steps %d --name %s", args, steps, name);
    int st = cmd(a);
    CHECK(st == 0 && strstr(out, say), "`vlmoe %s`: exit %d, output lacks '%s':\n%s", a, st, say, out);
    snprintf(a, sizeof a, "train %s --steps %d --name %s_r --workers 1", args, steps / 2, name);
    st = cmd(a);
    CHECK(st == 0, "`vlmoe %s`: exit %d:\n%s", a, st, out);
    snprintf(a, sizeof a, "train %s --steps %d --name %s_r --workers 0 --resume latest", args, steps, name);
    st = cmd(a);
    CHECK(st == 0 && strstr(out, "resuming from"), "`vlmoe %s`: exit %d:\n%s", a, st, out);
    snprintf(resumed, sizeof resumed, "%s_r", name);
    int n = losses(name, full, 16), m = losses(resumed, res, 16), same = n == steps && m == steps;
    for (int i = 0; same && i < steps; i++) same = !strcmp(full[i], res[i]);
    CHECK(same, "%s: resumed run's losses differ (%d and %d steps; step %d: %s vs %s)", name, n, m, steps,
          full[steps - 1], res[steps - 1]);
}

static void test_cli(void) {
    // 48 pairs of the synthetic vocabulary's words; half of them in two shards too
    static const char *const colour[] = {"red", "green", "blue"}, *const shape[] = {"circle", "square"};
    mkdir(P("cli"), 0755);
    char csv[8192] = "filepath\tcaption\n", name[64], txt[48][64];
    static char names[48][2][16];
    member m[96];
    uint8_t *jpg[48];
    size_t len[48];
    for (int i = 0; i < 48; i++) {
        jpg[i] = jpeg_of(i, &len[i]);
        snprintf(name, sizeof name, "cli/%02d.jpg", i);
        test_write_file(P(name), jpg[i], len[i]);
        snprintf(txt[i], sizeof txt[i], "a photo of a %s %s", colour[i % 3], shape[i / 3 % 2]);
        size_t k = strlen(csv);
        snprintf(csv + k, sizeof csv - k, "%02d.jpg\t%s\n", i, txt[i]);
        snprintf(names[i][0], 16, "%02d.jpg", i);
        snprintf(names[i][1], 16, "%02d.txt", i);
        m[2 * i] = (member){names[i][0], (const char *)jpg[i], len[i]};
        m[2 * i + 1] = (member){names[i][1], txt[i], strlen(txt[i])};
    }
    put("cli/pairs.tsv", csv);
    write_tar(P("cli/part-0.tar"), 0, m, 48);
    write_tar(P("cli/part-1.tar"), 0, m + 48, 48);
    for (int i = 0; i < 48; i++) free(jpg[i]);
    put("vocab600.json", "{\"base\": \"tiny\", \"vocab_size\": 600}");
    const char *common = "--batch-size 8 --lr-scheduler const --warmup 0 --save-every-n-steps 2 --log-every-n-steps 1 "
                         "--logs runs --threads 2";
    char a[1024];
    snprintf(a, sizeof a, "--model tiny --train-data cli/pairs.tsv --csv-caption-key caption %s", common);
    train_and_resume("csv", a, 6, "trained a BPE vocabulary"); // never the synthetic words for captions
    CHECK(strstr(out, "data cli/pairs.tsv (48 usable rows)"), "%s", out);
    // the CSV's paths are relative to its folder, not the working directory: read, with a note
    CHECK(strstr(out, "cli/pairs.tsv: note: image paths are read relative to the CSV file's folder cli/"), "%s", out);
    snprintf(a, sizeof a, "--model vocab600.json --train-data 'cli/part-{0..1}.tar' --workers 3 %s", common);
    train_and_resume("wds", a, 4, "trained a BPE vocabulary");
    CHECK(!strstr(out, "trained a BPE vocabulary"), "the resumed run took the checkpoint's tokenizer:\n%s", out);
    CHECK(access(P("runs/wds/tokenizer.txt"), R_OK) == 0, "runs/wds/tokenizer.txt");
    // the checkpoint carries the vocabulary the run trained; typed again, it is the same one
    CHECK(cmd("eval --model runs/wds/checkpoints/step_4.safetensors --val-data 'cli/part-{0..1}.tar' "
              "--batch-size 16") == 0 && strstr(out, "retrieval on"), "%s", out);
    CHECK(cmd("eval --model runs/wds/checkpoints/step_4.safetensors --val-data 'cli/part-{0..1}.tar' "
              "--tokenizer runs/wds/tokenizer.txt --batch-size 16") == 0 && strstr(out, "retrieval on"), "%s", out);
    // errors before training, and a run stopped by bad samples
    CHECK(cmd("train --train-data cli/nope.csv --steps 2") == 1 && strstr(out, "cli/nope.csv") &&
          access(P("logs"), F_OK) != 0, "missing CSV:\n%s", out);
    CHECK(cmd("train --train-data 'cli/part-{0..2}.tar' --steps 2") == 1 && strstr(out, "part-2.tar: shard missing"),
          "missing shard:\n%s", out);
    CHECK(cmd("train --dataset-type csv --steps 2") == 1 && strstr(out, "needs --train-data"), "%s", out);
    CHECK(cmd("train --dataset-type parquet --train-data x --steps 2") == 1 && strstr(out, "expected synthetic"), "%s", out);
    // shards drawn with replacement, weighted per source, resumed bit for bit; in params.json
    snprintf(a, sizeof a, "--model tiny --train-data 'cli/part-0.tar::cli/part-1.tar' --dataset-resampled "
             "--train-data-upsampling-factors 1::3 --train-num-samples 16 %s", common);
    train_and_resume("resampled", a, 6, "webdataset shards");
    size_t pl = 0;
    char *pj = test_read_file(P("runs/resampled/params.json"), &pl);
    CHECK(pj && strstr(pj, "\"dataset_resampled\":\ttrue") && strstr(pj, "\"train_data_upsampling_factors\":\t\"1::3\""),
          "params.json: %s", pj ? pj : "(none)");
    free(pj);
    pj = test_read_file(P("runs/resampled/metrics.jsonl"), &pl);
    CHECK(pj && strstr(pj, "\"epoch\":2,"), "3 epochs of 16 samples in 48: %s", pj ? pj : "(none)");
    free(pj);
    // pipe: shards; a command that fails stops the run naming it
    CHECK(cmd("train --model tiny --train-data 'pipe:cat cli/part-{0..1}.tar' --steps 2 --batch-size 8 --logs runs "
              "--name piped --threads 2") == 0, "pipe: shards:\n%s", out);
    CHECK(cmd("train --model tiny --train-data 'pipe:cat cli/part-0.tar; exit 5' --steps 8 --batch-size 8 --logs runs "
              "--name piped_bad --threads 2 --max-bad-fraction 0") == 1 && strstr(out, "pipe:cat cli/part-0.tar; exit 5: "
              "the command exited with status 5"), "failing command:\n%s", out);
    // flags that do not apply are errors, in both trainers
    const char *bad[][2] = {
        {"train --train-data cli/pairs.tsv --csv-caption-key caption --dataset-resampled --steps 2", "a CSV is read once per epoch"},
        {"train --train-data 'cli/part-{0..1}.tar' --train-data-upsampling-factors 2 --steps 2", "needs --dataset-resampled"},
        {"train --train-data 'cli/part-0.tar::cli/part-1.tar' --dataset-resampled --train-data-upsampling-factors 1::2::3 "
         "--steps 2", "has 3 factors, but --train-data"},
        {"train --dataset-resampled --steps 2", "applies to webdataset shards given with --train-data"},
        {"train --model vlmoe-tiny --codebook cb.safetensors --train-data-upsampling-factors 2", "needs --dataset-resampled"},
        {"train --model vlmoe-tiny --codebook cb.safetensors --train-data cli/pairs.tsv --csv-caption-key caption "
         "--dataset-resampled", "a CSV is read once"},
    };
    for (int i = 0; i < 6; i++) CHECK(cmd(bad[i][0]) == 1 && strstr(out, bad[i][1]), "`%s`:\n%s", bad[i][0], out);
    CHECK(cmd("train --help") == 0 && strstr(out, "--dataset-resampled") && strstr(out, "--train-data-upsampling-factors") &&
          strstr(out, "pipe:COMMAND"), "%s", out);
    CHECK(cmd("train --model vlmoe-tiny --help") == 0 && strstr(out, "--dataset-resampled") &&
          strstr(out, "--train-data-upsampling-factors"), "%s", out);
    put("cli/holes.tsv", "filepath\ttitle\n00.jpg\ta red circle\nnone1.jpg\ta\nnone2.jpg\tb\n01.jpg\ta blue square\n");
    CHECK(cmd("train --model tiny --train-data cli/holes.tsv --steps 4 --batch-size 2 --logs runs --name holes") == 1 &&
          strstr(out, "too many bad samples") && strstr(out, "none1.jpg"), "bad samples:\n%s", out);
}


// ---- one global batch shared by several processes (threads here) --------------------------------
enum { SW = 3, SNB = 16 };
typedef struct {
    pthread_barrier_t bar;
    uint8_t in[SW][SW * BS];
    int world;
} agree_ctx;

typedef struct {
    agree_ctx *a;
    vlmoe_loader_params p;
    int rank, st, tokenized, agrees;
    float img[SNB][BS][3 * 16 * 16];
    int32_t tok[SNB][BS][12], len[SNB][BS];
    char keys[SNB][BS][KL];
    vlmoe_dataset_stats stats;
    const vlmoe_data_state *from;   // seek there first (NULL: the start)
} share_run;

// What the processes' collective does: the maximum over the ranks, every rank returning it.
static int share_agree_fn(void *u, uint8_t *k, size_t n) {
    share_run *r = u;
    agree_ctx *a = r->a;
    memcpy(a->in[r->rank], k, n);
    pthread_barrier_wait(&a->bar);
    for (int q = 0; q < a->world; q++)
        for (size_t i = 0; i < n; i++) k[i] = a->in[q][i] > k[i] ? a->in[q][i] : k[i];
    pthread_barrier_wait(&a->bar);   // nobody writes in[] before every rank has read it
    r->agrees++;
    return VLMOE_OK;
}

static int tok_count(void *user, const char *text, int32_t *ids, int ctx) {
    share_run *r = user;
    __atomic_fetch_add(&r->tokenized, 1, __ATOMIC_RELAXED);
    return tok_bytes(NULL, text, ids, ctx);
}

static void *share_main(void *u) {
    share_run *r = u;
    vlmoe_loader *ld = NULL;
    r->st = vlmoe_loader_open(&r->p, &ld);
    if (!r->st && r->from) r->st = vlmoe_loader_seek(ld, r->from);
    for (int n = 0; !r->st && n < SNB; n++) {
        vlmoe_batch b;
        const char *const *keys;
        if ((r->st = vlmoe_loader_next(ld, &b, &keys))) break;
        const int B = b.batch_size;
        for (int i = 0; i < B; i++) {
            memcpy(r->img[n][i], b.images + (size_t)i * 3 * 16 * 16, sizeof r->img[n][i]);
            memcpy(r->tok[n][i], b.tokens + (size_t)i * 12, sizeof r->tok[n][i]);
            r->len[n][i] = b.lengths[i];
            snprintf(r->keys[n][i], KL, "%s", strrchr(keys[i], '/') + 1);
        }
    }
    if (ld) r->stats = *vlmoe_loader_stats(ld);
    vlmoe_loader_free(ld);
    return NULL;
}

// W processes at batch BS against one at W x BS, on data with bad samples of every kind: the same
// rows in the same order, the same bad samples skipped and counted on every process, and each
// process decodes (and tokenizes) about its share only.
static void test_share(const char *path, int world, int workers, int chunk, int resume) {
    static share_run one, many[SW];
    agree_ctx a = {.world = world};
    pthread_barrier_init(&a.bar, NULL, (unsigned)world);
    memset(&one, 0, sizeof one);
    one.p = params(path, workers);
    one.p.batch_size = BS * world, one.p.tokenize = tok_count, one.p.tokenize_user = &one;
    // the reference reads SNB batches of BS x world: rows beyond BS go to the comparison below
    static float img1[SNB + 8][SW * BS][3 * 16 * 16];
    static int32_t tok1[SNB + 8][SW * BS][12];
    static char key1[SNB + 8][SW * BS][KL];
    static vlmoe_data_state pos1[SNB + 8];
    vlmoe_loader *ld = NULL;
    one.st = vlmoe_loader_open(&one.p, &ld);
    // resume: the processes start after batch `resume` of the reference, which reads on past SNB
    for (int n = 0; !one.st && n < SNB + resume; n++) {
        vlmoe_batch b;
        const char *const *keys;
        if ((one.st = vlmoe_loader_next(ld, &b, &keys))) break;
        vlmoe_loader_position(ld, &pos1[n]);
        memcpy(img1[n], b.images, sizeof(float) * 3 * 16 * 16 * (size_t)b.batch_size);
        memcpy(tok1[n], b.tokens, sizeof(int32_t) * 12 * (size_t)b.batch_size);
        for (int i = 0; i < b.batch_size; i++) snprintf(key1[n][i], KL, "%s", strrchr(keys[i], '/') + 1);
    }
    if (ld) one.stats = *vlmoe_loader_stats(ld);
    vlmoe_loader_free(ld);
    CHECK(one.st == VLMOE_OK, "%s at batch %d: %s", path, BS * world, vlmoe_last_error());
    pthread_t th[SW];
    for (int r = 0; r < world; r++) {
        memset(&many[r], 0, sizeof many[r]);
        many[r].a = &a, many[r].rank = r;
        many[r].p = params(path, workers);
        many[r].p.rank = r, many[r].p.world = world, many[r].p.chunk = chunk;
        many[r].from = resume ? &pos1[resume - 1] : NULL;
        many[r].p.agree = share_agree_fn, many[r].p.agree_user = &many[r];
        many[r].p.tokenize = tok_count, many[r].p.tokenize_user = &many[r];
        pthread_create(&th[r], NULL, share_main, &many[r]);
    }
    int total = 0;
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL), total += many[r].tokenized;
    pthread_barrier_destroy(&a.bar);
    for (int r = 0; r < world; r++) {
        const share_run *m = &many[r];
        int rows = 0, bad_row = -1;
        for (int n = 0; n < SNB && bad_row < 0; n++)
            for (int i = 0; i < BS && bad_row < 0; i++, rows++) {
                const int c = chunk ? chunk : BS, g = i / c * c * world + r * c + i % c;
                const int o = n + resume;
                if (memcmp(m->img[n][i], img1[o][g], sizeof m->img[n][i]) || memcmp(m->tok[n][i], tok1[o][g], sizeof m->tok[n][i]) ||
                    strcmp(m->keys[n][i], key1[o][g]))
                    bad_row = n * BS + i;
            }
        CHECK(m->st == VLMOE_OK && bad_row < 0, "%s, rank %d of %d, %d workers, chunk %d: %s; row %d is %s (batch "
              "starts with %s)", path, r, world, workers, chunk, m->st ? vlmoe_last_error() : "ok", bad_row,
              bad_row >= 0 ? m->keys[bad_row / BS][bad_row % BS] : "-",
              bad_row >= 0 ? key1[bad_row / BS + resume][0] : "-");
        int same = resume || m->stats.total == one.stats.total;
        for (int k = 0; !resume && k < VLMOE_BAD_N; k++) same &= m->stats.bad[k] == one.stats.bad[k];
        CHECK(same, "%s, rank %d of %d: %lld samples, %lld bad; one process: %lld, %lld", path, r, world,
              (long long)m->stats.total, (long long)vlmoe_dataset_stats_bad(&m->stats), (long long)one.stats.total,
              (long long)vlmoe_dataset_stats_bad(&one.stats));
        // its share of the decoded samples, give or take those a bad sample shifted: workers decode
        // up to `prefetch` global batches ahead of the last batch read, and a shift by one moves
        // every sample ahead to another process when the pieces are single samples (chunk 1), so
        // that case is bounded by what each process decoded before: the whole global batch
        const int ahead = workers ? 2 * BS * world : 0;
        const int most = workers && chunk ? one.tokenized - 1 : SNB * BS + 2 * SNB + ahead;
        CHECK(m->tokenized <= most && m->agrees >= SNB,
              "%s, rank %d of %d, %d workers: tokenized %d captions for %d rows (%d agreements)", path, r, world,
              workers, m->tokenized, SNB * BS, m->agrees);
    }
    if (!workers) printf("  %s, world %d, chunk %d: captions tokenized %d (one process: %d, for %d rows each)\n", path,
                         world, chunk, total, one.tokenized, SNB * BS * world);
    CHECK(one.stats.bad[VLMOE_BAD_UNREADABLE_IMAGE] + one.stats.bad[VLMOE_BAD_UNDECODABLE_IMAGE] >= 1,
          "%s: the data hold no bad image, so the test proves nothing", path);
}

int main(int argc, char **argv) {
    snprintf(dir, sizeof dir, "/tmp/vlmoe_loader_XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    make_data();
    const char *paths[] = {"data.csv", "shards/s-{0..2}.tar"};
    for (int k = 0; k < 2; k++) {
        test_workers(paths[k]);
        test_order(paths[k]);
        test_resume(paths[k]);
        test_pixels(paths[k]);
    }
    test_bad();
    for (int k = 0; k < 2; k++)
        for (int w = 2; w <= SW; w++) 
            for (int chunk = 0; chunk <= 1; chunk++)
                test_share(paths[k], w, 0, chunk, 0), test_share(paths[k], w, 2, chunk, 0), test_share(paths[k], w, 2, chunk, 5);
    test_bad_fraction();
    test_resampled();
    test_pipe();
    test_csv_paths();
    static char abs_bin[4096];
    if ((bin = test_vlmoe_bin(argv[0], abs_bin))) test_cli();
    char c[128];
    snprintf(c, sizeof c, "rm -rf '%s'", dir);
    if (system(c) != 0) fprintf(stderr, "could not remove %s\n", dir);
    (void)argc;
    return test_summary("test_loader");
}
