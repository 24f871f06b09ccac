// test_synth_export.c: `vlmoe synth export` (cli/synth.c). Exports small sets and checks them
// against the library's synthetic data: the file counts and class folders, captions.csv read back
// through the dataset reader (tab and comma separators; header, N rows, paths that exist, the
// samples' captions), texts.txt, every PNG decoded by vlmoe_image_load equal to the synthetic
// image within 8-bit rounding, match.tsv half yes / half no with the images' own captions on the
// yes rows and another class's on the no rows, identical files for 1 and 2 threads, and that
// `vlmoe train --train-data`, `vlmoe eval --val-data/--zeroshot-data` and `vlmoe finetune --task
// pair-cls` run on the files. Bad flags and folders on purpose. Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN).
#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>

#include "data/image.h"
#include "data/readers.h"
#include "test.h"
#include "vlmoe.h"

enum { N = 40, S = 32, CAP = 192 };
static const char *bin;
static char dir[64], out[1 << 15];

static const char *P(const char *rel) { return test_path(dir, rel); }
static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

// Lines of a text file, split in place: *n lines (the last newline ends the last line).
static char **lines(char *text, int *n) {
    *n = 0;
    if (!text) return NULL;
    int cap = 16;
    char **v = malloc(sizeof(char *) * (size_t)cap);
    for (char *p = text; *p;) {
        char *e = strchr(p, '\n');
        if (*n == cap) v = realloc(v, sizeof(char *) * (size_t)(cap *= 2));
        v[(*n)++] = p;
        if (!e) break;
        *e = 0;
        p = e + 1;
    }
    return v;
}

// PNG files under root/<class>/, and how many class folders hold them.
static int count_pngs(const char *root, int *folders) {
    int n = 0;
    *folders = 0;
    DIR *d = opendir(root);
    for (struct dirent *e; d && (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char sub[512];
        snprintf(sub, sizeof(sub), "%s/%s", root, e->d_name);
        DIR *c = opendir(sub);
        int k = 0;
        for (struct dirent *f; c && (f = readdir(c));) k += strstr(f->d_name, ".png") != NULL;
        if (c) closedir(c);
        *folders += k > 0, n += k;
    }
    if (d) closedir(d);
    return n;
}

typedef struct {
    char caption[N][CAP];
    int cls[N];
    float *img; // (N, 3, S, S)
} truth;

// The library's samples first..first+N-1 of split, seed 0.
static void make_truth(vlmoe_synth *s, int split, truth *t) {
    t->img = malloc(sizeof(float) * 3 * S * S * N);
    for (int i = 0; i < N; i++)
        CHECK(vlmoe_synth_sample(s, split, (uint64_t)i, t->img + (size_t)i * 3 * S * S, t->caption[i], CAP, &t->cls[i]) ==
                  VLMOE_OK, "sample %d: %s", i, vlmoe_last_error());
}

// "classes/<class folder>/NNNNNN.png" of sample i
static void rel_of(vlmoe_synth *s, const truth *t, int i, char *buf, size_t cap) {
    char cd[32];
    snprintf(cd, sizeof(cd), "%s", vlmoe_synth_class_name(s, t->cls[i]));
    for (char *p = cd; *p; p++)
        if (*p == ' ') *p = '_';
    snprintf(buf, cap, "classes/%s/%06d.png", cd, i);
}

// captions.csv through the reader train and eval use: N samples, in order, whose paths are the
// exported images (joined to the CSV's folder) and whose captions are the samples'.
static void check_csv(const char *sub, char sep, vlmoe_synth *s, const truth *t) {
    char path[256], want[512];
    snprintf(path, sizeof(path), "%s/%s/captions.csv", dir, sub);
    size_t len;
    char *text = test_read_file(path, &len);
    char header[32];
    snprintf(header, sizeof(header), "filepath%ctitle\n", sep);
    CHECK(text && !strncmp(text, header, strlen(header)), "%s: header filepath%ctitle: %.40s", path, sep,
          text ? text : "(none)");
    free(text);
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.path = path, p.separator = sep, p.defer_images = 1;
    vlmoe_dataset *ds = NULL;
    CHECK(vlmoe_dataset_open(&p, &ds) == VLMOE_OK, "%s: %s", path, vlmoe_last_error());
    int n = 0, bad = 0;
    vlmoe_sample smp;
    while (ds && vlmoe_dataset_next(ds, &smp) == 1) {
        if (n < N) {
            char rel[96];
            rel_of(s, t, n, rel, sizeof(rel));
            snprintf(want, sizeof(want), "%s/%s/%s", dir, sub, rel);
            // deferred: the path as written, which the CSV's folder resolves (the working directory does not)
            char csv_dir[600], file[700];
            snprintf(csv_dir, sizeof(csv_dir), "%s/%s", dir, sub);
            struct stat st;
            const int ok = vlmoe_csv_image_path(csv_dir, smp.image_path, file, sizeof(file)) == 1 && !strcmp(file, want) &&
                           !stat(file, &st) && !strcmp(smp.caption, t->caption[n]);
            if (!ok && bad++ < 3)
                CHECK(0, "%s row %d: %s \"%s\", want %s \"%s\"", path, n, smp.image_path, smp.caption, want, t->caption[n]);
        }
        n++;
    }
    CHECK(n == N && !bad && ds && vlmoe_dataset_stats_bad(vlmoe_dataset_get_stats(ds)) == 0,
          "%s: %d good rows (want %d), %d wrong", path, n, N, bad);
    vlmoe_dataset_free(ds);
}

// Every exported image decodes to the synthetic one within 8-bit rounding: |v - (x + 1) 127.5| <= 0.5.
static void check_pixels(vlmoe_synth *s, const truth *t) {
    double worst = 0;
    int read = 0;
    for (int i = 0; i < N; i++) {
        char rel[96], path[128];
        rel_of(s, t, i, rel, sizeof(rel));
        snprintf(path, sizeof(path), "a/%s", rel);
        vlmoe_image im = {0};
        if (vlmoe_image_load(P(path), &im) == VLMOE_OK && im.w == S && im.h == S) {
            read++;
            const float *x = t->img + (size_t)i * 3 * S * S;
            for (int p = 0; p < S * S; p++)
                for (int k = 0; k < 3; k++) {
                    const double d = fabs(im.rgb[3 * p + k] - ((double)x[k * S * S + p] + 1) * 127.5);
                    if (d > worst) worst = d;
                }
        } else {
            CHECK(0, "%s: %s (%dx%d)", rel, vlmoe_last_error(), im.w, im.h);
        }
        vlmoe_image_free(&im);
    }
    printf("pixels: %d PNGs re-read, largest |v - (x+1)*127.5| = %.4f\n", read, worst);
    CHECK(read == N && worst <= 0.5 + 1e-4, "%d of %d images read, largest 8-bit difference %.4f (want <= 0.5)", read, N,
          worst);
}

// match.tsv: N rows in sample order, N/2 no; yes rows carry the image's caption, no rows the caption
// of an exported image of another class.
static void check_match(vlmoe_synth *s, const truth *t) {
    int n, yes = 0, no = 0, wrong = 0;
    char *text = test_read_file(P("a/match.tsv"), NULL);
    char **l = lines(text, &n);
    for (int i = 0; i < n && i < N; i++) {
        char *c1 = strchr(l[i], '\t'), *c2 = c1 ? strchr(c1 + 1, '\t') : NULL, rel[96];
        if (!c2) {
            wrong++;
            continue;
        }
        *c1++ = 0, *c2++ = 0;
        rel_of(s, t, i, rel, sizeof(rel));
        int from = -1; // the exported image whose caption this is
        for (int j = 0; j < N && from < 0; j++)
            if (!strcmp(c1, t->caption[j])) from = j;
        const int is_yes = !strcmp(c2, "yes"), ok_path = !strcmp(l[i], rel);
        yes += is_yes, no += !strcmp(c2, "no");
        const int ok = ok_path && (is_yes ? !strcmp(c1, t->caption[i]) : from >= 0 && t->cls[from] != t->cls[i]);
        if (!ok && wrong++ < 3)
            CHECK(0, "match.tsv row %d: %s | %s | %s (image %s, its caption \"%s\")", i, l[i], c1, c2, rel,
                  t->caption[i]);
    }
    printf("match.tsv: %d rows, %d yes, %d no\n", n, yes, no);
    CHECK(n == N && yes == N / 2 && no == N / 2 && !wrong, "match.tsv: %d rows, %d yes, %d no, %d wrong", n, yes, no, wrong);
    free(l), free(text);
}

static int same_file(const char *a, const char *b) {
    size_t na, nb;
    char *x = test_read_file(a, &na), *y = test_read_file(b, &nb);
    const int same = x && y && na == nb && !memcmp(x, y, na);
    free(x), free(y);
    return same;
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_synth_export");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_synth_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = S;
    vlmoe_synth *s = NULL;
    CHECK(vlmoe_synth_init(&s, &sp) == VLMOE_OK, "synth: %s", vlmoe_last_error());
    static truth tr, tv;
    make_truth(s, VLMOE_SPLIT_TRAIN, &tr);
    make_truth(s, VLMOE_SPLIT_HELDOUT, &tv);

    // the train split, tab-separated (the default), with 2 threads; again with 1 and with commas
    char args[512], rel[96];
    snprintf(args, sizeof(args), "synth export --out a --n %d", N);
    expect(args, 0, "exported 40 train samples");
    int folders, classes = 0, seen[64] = {0};
    for (int i = 0; i < N; i++) classes += !seen[tr.cls[i]]++;
    const int pngs = count_pngs(P("a/classes"), &folders);
    CHECK(pngs == N && folders == classes, "a/classes: %d PNGs in %d folders, want %d in %d", pngs, folders, N, classes);
    check_csv("a", '\t', s, &tr);
    check_pixels(s, &tr);
    check_match(s, &tr);
    int nl;
    char *texts = test_read_file(P("a/texts.txt"), NULL);
    char **tl = lines(texts, &nl);
    int tbad = nl != N;
    for (int i = 0; i < nl && i < N; i++) tbad += strcmp(tl[i], tr.caption[i]) != 0;
    CHECK(!tbad, "texts.txt: %d lines (want %d), %d differ from the captions", nl, N, tbad);
    // every caption word is in the synthetic vocabulary (no UNK): models with a small vocabulary
    // read the files with vlmoe_synth_tokenize, as the built-in data
    int unk = 0;
    for (int i = 0; i < nl && i < N; i++) {
        int32_t ids[64];
        const int len = vlmoe_synth_tokenize(s, tl[i], ids, 64);
        for (int k = 0; k < len; k++) unk += ids[k] == VLMOE_TOK_UNK;
    }
    CHECK(unk == 0, "%d unknown words in texts.txt", unk);
    free(tl), free(texts);

    char one[600];
    snprintf(one, sizeof(one), "OMP_NUM_THREADS=1 %s", bin);
    const char *two = bin;
    bin = one;
    snprintf(args, sizeof(args), "synth export --out b --n %d", N);
    expect(args, 0, "exported");
    bin = two;
    rel_of(s, &tr, N - 1, rel, sizeof(rel));
    char ra[128], rb[128];
    snprintf(ra, sizeof(ra), "a/%s", rel), snprintf(rb, sizeof(rb), "b/%s", rel);
    CHECK(same_file(P("a/captions.csv"), P("b/captions.csv")) && same_file(P("a/match.tsv"), P("b/match.tsv")) &&
              same_file(P(ra), P(rb)),
          "1 and 2 threads write the same files");
    snprintf(args, sizeof(args), "synth export --out c --n %d --csv-separator ,", N);
    expect(args, 0, "filepath,title");
    check_csv("c", ',', s, &tr);

    // the held-out split is class-balanced: sample i is of class i mod 20
    snprintf(args, sizeof(args), "synth export --out v --n %d --split val", N);
    expect(args, 0, "exported 40 val samples");
    CHECK(count_pngs(P("v/classes"), &folders) == N && folders == 20, "v/classes: %d folders, want 20", folders);
    check_csv("v", '\t', s, &tv);

    // the files work where files go: train --train-data, eval --val-data/--zeroshot-data, finetune
    vlmoe_model_config cfg;
    vlmoe_model *m = NULL;
    CHECK(vlmoe_config_named("limoe-tiny", &cfg) == VLMOE_OK && vlmoe_model_init(&m, &cfg, 1) == VLMOE_OK &&
              vlmoe_model_save(m, P("clip.safetensors")) == VLMOE_OK,
          "limoe-tiny: %s", vlmoe_last_error());
    vlmoe_model_free(m);
    m = NULL;
    CHECK(vlmoe_config_named("vlmoe-tiny", &cfg) == VLMOE_OK && vlmoe_model_init(&m, &cfg, 1) == VLMOE_OK &&
              vlmoe_model_save(m, P("pre.safetensors")) == VLMOE_OK,
          "vlmoe-tiny: %s", vlmoe_last_error());
    vlmoe_model_free(m);
    expect("train --model limoe-tiny --train-data a/captions.csv --image-mean 0.5 --image-std 0.5 --steps 2 "
           "--batch-size 8 --workers 1 --logs logs --name t",
           0, "trained to step 2");
    expect("eval --model clip.safetensors --val-data v/captions.csv --zeroshot-data v/classes --image-mean 0.5 "
           "--image-std 0.5 --few-shot 0",
           0, "retrieval on v/captions.csv (40 images, 40 captions)");
    CHECK(strstr(out, "zero-shot on v/classes (20 classes") != NULL, "eval --zeroshot-data:\n%s", out);
    expect("finetune --model pre.safetensors --task pair-cls --data a/match.tsv -o ft.safetensors --steps 3 "
           "--batch-size 6 --log-every 1",
           0, "2 classes, 30 training and 10 held-out examples");
    char *labels = test_read_file(P("ft.safetensors.labels"), NULL);
    CHECK(labels && !strcmp(labels, "no\nyes\n"), "finetune labels: %s", labels ? labels : "(none)");
    free(labels);

    // bad input
    expect("synth export --out d --n 0", 2, "--n must be >= 1 (an integer up to 2147483647), got '0'");
    expect("synth export --out d --n -5", 2, "--n must be >= 1 (an integer up to 2147483647), got '-5'");
    expect("synth export --out d --n many", 2, "--n expects an integer");
    expect("synth export --out d --bogus 1", 2, "unknown flag '--bogus'");
    expect("synth export --n 5", 1, "--out DIR is required");
    expect("synth export --out d --split test", 1, "--split test: expected train or val");
    expect("synth export --out d --image-size 8", 1, "image_size = 8");
    expect("synth export --out d --first -1", 2, "--first must be >= 0 (an integer), got '-1'");
    expect("synth export --out d --first 2000000000000", 1, "--first 2000000000000: expected an index in 0..");
    expect("synth export --out d --csv-separator ab", 1, "--csv-separator 'ab'");
    expect("synth", 1, "expected `vlmoe synth export");
    expect("synth export --help", 0, "match.tsv");
    test_write_file(P("plain"), "x", 1);
    expect("synth export --out plain/sub --n 2", 1, "--out plain/sub: cannot create the folder");
    expect("synth export --out a --n 5", 1, "not empty");
    // --overwrite replaces an earlier export (no stale images) but not a folder of other files
    expect("synth export --out a --n 5 --overwrite", 0, "exported 5 train samples");
    CHECK(count_pngs(P("a/classes"), &folders) == 5, "after --overwrite: %d PNGs, want 5", count_pngs(P("a/classes"), &folders));
    test_write_file(P("a/notes.txt"), "mine", 4);
    expect("synth export --out a --n 5 --overwrite", 1, "notes.txt");
    // two samples of one class leave match.tsv no caption to say "no" with
    int first = -1;
    for (int i = 0; i < 1000 && first < 0; i++) {
        int c0, c1;
        vlmoe_synth_sample(s, VLMOE_SPLIT_TRAIN, (uint64_t)i, NULL, NULL, 0, &c0);
        vlmoe_synth_sample(s, VLMOE_SPLIT_TRAIN, (uint64_t)i + 1, NULL, NULL, 0, &c1);
        if (c0 == c1) first = i;
    }
    snprintf(args, sizeof(args), "synth export --out e --n 2 --first %d", first);
    expect(args, 1, "match.tsv needs images of two classes");

    free(tr.img), free(tv.img);
    vlmoe_synth_free(s);
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (t_fail == 0 && system(cmd)) fprintf(stderr, "could not remove %s\n", dir); // kept to look at on failure
    return test_summary("test_synth_export");
}
