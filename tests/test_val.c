// test_val.c: validation while training (`vlmoe train --val-data/--zeroshot-data`, cli/train.c and
// src/train/contrastive_task.c) on data made here: PNG/JPEG images of four colour classes, an
// OpenCLIP CSV for training and one for validation (with a missing and a corrupt image), the
// same pairs as a webdataset shard, an image folder with CLIP_benchmark-style JSON class names
// and templates. The eval records of
// metrics.jsonl come at each part's cadence (steps and epochs), hold values in range, and equal
// `vlmoe eval --json` on the checkpoint of the same step; every inapplicable flag is an error.
// Runs $VLMOE_BIN(_ASAN).
#include <cjson/cJSON.h>
#include <sys/stat.h>

#include "test.h"
#include "test_jpeg.h"
#include "test_tar.h"

enum { NCLS = 4, NTRAIN = 32, NVAL = 12, PER_CLASS = 4, BATCH = 8 };
static const char *const CLASS_DIRS[NCLS] = {"blue_triangle", "green_square", "red_circle", "yellow_star"}; // sorted
static const uint8_t COLOURS[NCLS][3] = {{20, 30, 230}, {25, 220, 35}, {235, 15, 25}, {230, 220, 20}};
static const char *const WORDS[NCLS] = {"blue triangle", "green square", "red circle", "yellow star"};
static const char *const PLACES[] = {"on a table", "in the grass", "under a lamp", "near the door", "at night"};
static const char *bin;
static char dir[64], out[1 << 16];

static const char *P(const char *rel) { return test_path(dir, rel); }
static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }
static int run(const char *args, int fold) { return test_run_in(dir, bin, args, fold, out, sizeof(out)); }
static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

// An image of class c, made distinct by a bar at a place given by i: PNG, or JPEG when jpeg.
static void write_image(const char *rel, int c, int i, int jpeg) {
    const int w = 24 + 4 * (i % 3), h = 20 + 2 * (i % 4);
    uint8_t *px = malloc((size_t)w * h * 3);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int ch = 0; ch < 3; ch++) {
                const int bar = x % 8 == i % 8, v = COLOURS[c][ch];
                px[3 * ((size_t)y * w + x) + ch] = (uint8_t)(bar ? 255 - v : v);
            }
    CHECK(test_write_rgb(P(rel), px, w, h, jpeg), "write %s", rel);
    free(px);
}

// rows pairs of images under folder sub/ (row i: class i % NCLS) and their captions as a CSV.
static void write_pairs(const char *csv_name, const char *sub, int rows, int first, const char *extra) {
    char *csv = malloc(1 << 16), rel[128];
    size_t o = (size_t)snprintf(csv, 1 << 16, "filepath,title\n");
    mkdir(P(sub), 0755);
    for (int i = 0; i < rows; i++) {
        const int c = i % NCLS;
        snprintf(rel, sizeof(rel), "%s/%03d.%s", sub, i, i % 3 ? "png" : "jpg");
        write_image(rel, c, first + i, i % 3 == 0);
        o += (size_t)snprintf(csv + o, (1 << 16) - o, "%s,a %s %s\n", rel, WORDS[c], PLACES[(first + i) % 5]);
    }
    snprintf(csv + o, (1 << 16) - o, "%s", extra);
    put(csv_name, csv);
    free(csv);
}

static void make_data(void) {
    write_pairs("train.csv", "tr", NTRAIN, 0, "");
    put("va_bad.jpg", "\xff\xd8\xff\xe0 not really a JPEG");
    write_pairs("val.csv", "va", NVAL, 100, "va/nowhere.png,a lost image\nva_bad.jpg,a broken image\n");
    mkdir(P("zs"), 0755);
    for (int c = 0; c < NCLS; c++) {
        char rel[128];
        snprintf(rel, sizeof(rel), "zs/%s", CLASS_DIRS[c]);
        mkdir(P(rel), 0755);
        for (int i = 0; i < PER_CLASS; i++) {
            snprintf(rel, sizeof(rel), "zs/%s/%02d.%s", CLASS_DIRS[c], i, i % 2 ? "jpg" : "png");
            write_image(rel, c, 200 + i, i % 2);
        }
    }
    put("zs/green_square/99_bad.jpg", "\xff\xd8\xff\xe0 not really a JPEG");
    // CLIP_benchmark's formats: lists by dataset, templates with {c}
    put("names.json", "{\"other\": [\"a\", \"b\"], \"mine\": [\"blue triangle\", \"green square\", \"red circle\", "
                      "\"yellow star\"]}");
    put("tpl.json", "{\"mine\": [\"a photo of a {c}.\", \"a {c} on a table.\"], \"other\": [\"{c}\"]}");
    put("names4.txt", "a\nb\nc\n");
    put("nohole.json", "[\"a photo\"]");
    put("m.json", "{\"base\": \"limoe-tiny\", \"vocab_size\": 600}");
}

// The records of a metrics file of kind `kind`, by step (at most 64 steps); returns the count.
static int records(const char *run, const char *kind, cJSON **by_step, int max_step) {
    char rel[256];
    snprintf(rel, sizeof(rel), "runs/%s/metrics.jsonl", run);
    char *text = test_read_file(P(rel), NULL), *save = NULL;
    CHECK(text != NULL, "no %s", rel);
    int n = 0;
    for (char *l = text ? strtok_r(text, "\n", &save) : NULL; l; l = strtok_r(NULL, "\n", &save)) {
        cJSON *j = cJSON_Parse(l);
        const cJSON *k = cJSON_GetObjectItem(j, "kind"), *s = cJSON_GetObjectItem(j, "step");
        CHECK(j && cJSON_IsString(k) && cJSON_IsNumber(s), "%s: bad line %s", rel, l);
        if (j && cJSON_IsString(k) && !strcmp(k->valuestring, kind) && cJSON_IsNumber(s) && s->valueint >= 0 &&
            s->valueint <= max_step && !by_step[s->valueint]) {
            by_step[s->valueint] = j, n++;
        } else {
            cJSON_Delete(j);
        }
    }
    free(text);
    return n;
}

static void free_records(cJSON **r, int n) {
    for (int i = 0; i < n; i++) cJSON_Delete(r[i]), r[i] = NULL;
}

static double num(const cJSON *o, const char *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(cJSON_GetObjectItem(o, obj), key);
    CHECK(cJSON_IsNumber(v), "record lacks %s.%s", obj, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

// Values in range and the counts of the data made here.
static void check_val(const cJSON *rec, long step) {
    static const char *const rk[] = {"i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10"};
    for (int i = 0; i < 6; i++) {
        const double v = num(rec, "retrieval", rk[i]);
        CHECK(v >= 0 && v <= 1, "step %ld: retrieval.%s = %g", step, rk[i], v);
    }
    CHECK(num(rec, "retrieval", "i2t_R@1") <= num(rec, "retrieval", "i2t_R@5") &&
              num(rec, "retrieval", "i2t_R@5") <= num(rec, "retrieval", "i2t_R@10"),
          "step %ld: recall@K grows with K", step);
    CHECK(num(rec, "retrieval", "images") == NVAL && num(rec, "retrieval", "captions") == NVAL,
          "step %ld: %g images, %g captions", step, num(rec, "retrieval", "images"), num(rec, "retrieval", "captions"));
    CHECK(num(rec, "retrieval", "bad_samples") == 2, "step %ld: bad_samples %g (a missing and a corrupt image)", step,
          num(rec, "retrieval", "bad_samples"));
    const double loss = num(rec, "contrastive", "loss"), acc = num(rec, "contrastive", "accuracy");
    CHECK(loss > 0 && loss < 10, "step %ld: contrastive.loss %g", step, loss);
    CHECK(acc >= 0 && acc <= 1, "step %ld: contrastive.accuracy %g", step, acc);
    CHECK(num(rec, "contrastive", "batch_size") == BATCH && num(rec, "contrastive", "batches") == 2,
          "step %ld: batches of %g, %g of them", step, num(rec, "contrastive", "batch_size"),
          num(rec, "contrastive", "batches"));
}

static void check_zeroshot(const cJSON *rec, long step) {
    const double t1 = num(rec, "zeroshot", "top1"), t5 = num(rec, "zeroshot", "top5");
    CHECK(t1 >= 0 && t1 <= t5 && t5 == 1, "step %ld: zero-shot top-1 %g, top-5 %g (%d classes)", step, t1, t5, NCLS);
    CHECK(num(rec, "zeroshot", "classes") == NCLS && num(rec, "zeroshot", "templates") == 2 &&
              num(rec, "zeroshot", "images") == NCLS * PER_CLASS && num(rec, "zeroshot", "bad_images") == 1,
          "step %ld: zero-shot counts", step);
}

// Every field of the objects `names` of `vlmoe eval --json` equals the record's; returns the
// largest difference.
static double compare(const cJSON *eval, const cJSON *rec, const char *const *names, int n, long step, int *exact) {
    double worst = 0;
    for (int i = 0; i < n; i++) {
        const cJSON *e = cJSON_GetObjectItem(eval, names[i]), *r = cJSON_GetObjectItem(rec, names[i]);
        CHECK(e && r, "step %ld: %s in eval --json %d, in the record %d", step, names[i], e != NULL, r != NULL);
        for (const cJSON *f = e ? e->child : NULL; f && r; f = f->next) {
            const cJSON *g = cJSON_GetObjectItem(r, f->string);
            if (cJSON_IsString(f)) {
                CHECK(cJSON_IsString(g) && !strcmp(f->valuestring, g->valuestring), "step %ld: %s.%s", step, names[i],
                      f->string);
                continue;
            }
            CHECK(cJSON_IsNumber(g), "step %ld: the record lacks %s.%s", step, names[i], f->string);
            if (!cJSON_IsNumber(g)) continue;
            const double d = fabs(f->valuedouble - g->valuedouble);
            CHECK(d <= 1e-6, "step %ld: %s.%s: eval %.17g, record %.17g", step, names[i], f->string, f->valuedouble,
                  g->valuedouble);
            *exact += d == 0;
            if (d > worst) worst = d;
        }
    }
    return worst;
}

// The cadences in steps: val every 2, zero-shot every 3, both at the end (4); the records equal
// `vlmoe eval` on the checkpoints of steps 2 and 4.
static void test_steps(void) {
    const char *common = "--train-data train.csv --csv-separator , --image-mean 0.5 --image-std 0.5 --batch-size 8 "
                         "--lr-scheduler const --warmup 0 --workers 1 --log-every-n-steps 1 --logs runs";
    char args[1024];
    snprintf(args, sizeof(args), "train --model m.json %s --steps 4 --save-every-n-steps 2 --keep-checkpoints 0 --name v "
             "--val-data val.csv --val-every-n-steps 2 --zeroshot-data zs --zeroshot-classnames names.json "
             "--zeroshot-templates tpl.json --zeroshot-dataset mine --zeroshot-every-n-steps 3", common);
    int st = run(args, 1);
    CHECK(st == 0, "`vlmoe %s`: exit %d\n%s", args, st, out);
    CHECK(strstr(out, "step 2 val val.csv (12 images, 12 captions, 2 bad samples skipped): loss") &&
              strstr(out, "step 3 zero-shot zs (4 classes, 16 images, 1 unreadable skipped): top-1") &&
              strstr(out, "step 4 val val.csv") && strstr(out, "step 4 zero-shot zs"),
          "progress lines:\n%s", out);
    cJSON *ev[8] = {0};
    const int n = records("v", "eval", ev, 7);
    CHECK(n == 3 && ev[2] && ev[3] && ev[4], "eval records at steps 2, 3, 4: %d records", n);
    CHECK(ev[2] && cJSON_GetObjectItem(ev[2], "retrieval") && !cJSON_GetObjectItem(ev[2], "zeroshot"),
          "step 2: validation only");
    CHECK(ev[3] && cJSON_GetObjectItem(ev[3], "zeroshot") && !cJSON_GetObjectItem(ev[3], "retrieval"),
          "step 3: zero-shot only");
    if (ev[2]) check_val(ev[2], 2);
    if (ev[3]) check_zeroshot(ev[3], 3);
    if (ev[4]) check_val(ev[4], 4), check_zeroshot(ev[4], 4);
    // the same numbers from vlmoe eval on the step's checkpoint, with the run's tokenizer,
    // normalisation and batch size
    static const char *const objs[] = {"retrieval", "contrastive", "zeroshot"};
    int exact = 0, fields = 0;
    double worst = 0;
    for (int step = 2; step <= 4; step += 2) {
        snprintf(args, sizeof(args), "eval --model runs/v/checkpoints/step_%d.safetensors --tokenizer runs/v/tokenizer.txt "
                 "--image-mean 0.5 --image-std 0.5 --batch-size 8 --few-shot 0 --json --val-data val.csv "
                 "--csv-separator , --zeroshot-data zs --classnames names.json --templates tpl.json "
                 "--zeroshot-dataset mine", step);
        st = run(args, 0);
        CHECK(st == 0, "`vlmoe %s`: exit %d\n%s", args, st, out);
        cJSON *j = cJSON_Parse(out);
        CHECK(j != NULL, "eval output is not JSON:\n%s", out);
        if (j && ev[step]) {
            const int k = step == 2 ? 2 : 3;
            worst = fmax(worst, compare(j, ev[step], objs, k, step, &exact));
            for (int i = 0; i < k; i++)
                for (const cJSON *f = cJSON_GetObjectItem(j, objs[i])->child; f; f = f->next) fields += cJSON_IsNumber(f);
        }
        cJSON_Delete(j);
    }
    printf("eval records vs vlmoe eval --json on the checkpoints: %d of %d numbers identical, largest difference %g\n",
           exact, fields, worst);
    CHECK(fields >= 30, "compared %d numbers", fields);
    // stopped at step 2 and resumed: the evaluations of the uninterrupted run, bit for bit (the
    // first part also ran every evaluation at its end, step 2: its validation is compared)
    const char *val = "--val-data val.csv --val-every-n-steps 2 --zeroshot-data zs --zeroshot-classnames names.json "
                      "--zeroshot-templates tpl.json --zeroshot-dataset mine --zeroshot-every-n-steps 3";
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof(args), "train --model m.json %s --save-every-n-steps 2 --name r %s --steps %s", common, val,
                 k ? "4 --resume latest" : "2");
        st = run(args, 1);
        CHECK(st == 0, "`vlmoe %s`: exit %d\n%s", args, st, out);
    }
    cJSON *rv[8] = {0};
    CHECK(records("r", "eval", rv, 7) == 3, "resumed run: eval records at 2, 3, 4");
    if (rv[2]) cJSON_DeleteItemFromObject(rv[2], "zeroshot");
    for (int step = 2; step <= 4; step++) {
        char *a = ev[step] ? cJSON_PrintUnformatted(ev[step]) : NULL, *b = rv[step] ? cJSON_PrintUnformatted(rv[step]) : NULL;
        CHECK(a && b && !strcmp(a, b), "step %d: uninterrupted %s\nresumed %s", step, a ? a : "-", b ? b : "-");
        free(a), free(b);
    }
    free_records(rv, 8);
    free_records(ev, 8);
    // --val-num-samples: the first N usable pairs
    snprintf(args, sizeof(args), "train --model m.json %s --steps 1 --name n --val-data val.csv --val-num-samples 5",
             common);
    st = run(args, 1);
    CHECK(st == 0, "`vlmoe %s`: exit %d\n%s", args, st, out);
    if (records("n", "eval", ev, 7) == 1 && ev[1])
        CHECK(num(ev[1], "retrieval", "captions") == 5, "--val-num-samples 5: %g captions",
              num(ev[1], "retrieval", "captions"));
    else CHECK(0, "--val-num-samples: one eval record at step 1");
    free_records(ev, 8);
}

// --val-frequency and --zeroshot-frequency count epochs as in OpenCLIP: 32 rows in batches of 8
// are 4 steps an epoch; the synthetic data's epoch is --train-num-samples.
static void test_epochs(void) {
    cJSON *ev[16] = {0};
    int st = run("train --model m.json --train-data train.csv --csv-separator , --image-mean 0.5 --image-std 0.5 "
                 "--batch-size 8 --workers 1 --logs runs --name e --steps 10 --val-data val.csv --val-frequency 1 "
                 "--zeroshot-data zs --zeroshot-frequency 2", 1);
    CHECK(st == 0, "--val-frequency 1: exit %d\n%s", st, out);
    int n = records("e", "eval", ev, 15);
    CHECK(n == 3 && ev[4] && ev[8] && ev[10], "val at steps 4, 8 and the end (10): %d records", n);
    CHECK(ev[4] && !cJSON_GetObjectItem(ev[4], "zeroshot") && ev[8] && cJSON_GetObjectItem(ev[8], "zeroshot") &&
              ev[10] && cJSON_GetObjectItem(ev[10], "zeroshot"),
          "zero-shot every 2 epochs (step 8) and at the end");
    free_records(ev, 16);
    // the synthetic held-out evaluation keeps its place: every 2 steps of 8 samples; --val-data
    // on a synthetic run at the end
    st = run("train --model tiny --steps 4 --batch-size 8 --eval-samples 40 --train-num-samples 16 "
             "--zeroshot-frequency 1 --logs runs --name s --val-data val.csv --csv-separator , --image-mean 0.5 "
             "--image-std 0.5", 1);
    CHECK(st == 0, "synthetic --zeroshot-frequency: exit %d\n%s", st, out);
    n = records("s", "eval", ev, 15);
    CHECK(n == 2 && ev[2] && ev[4] && cJSON_GetObjectItem(ev[2], "eval_zeroshot_top1") &&
              !cJSON_GetObjectItem(ev[2], "retrieval") && cJSON_GetObjectItem(ev[4], "eval_zeroshot_top1"),
          "synthetic held-out at steps 2 and 4: %d records", n);
    if (ev[4]) check_val(ev[4], 4);
    free_records(ev, 16);
}

// --val-data as webdataset shards: the validation images and captions in a tar; --val-frequency
// on shards needs the epoch's size.
static void test_shards(void) {
    member m[2 * NVAL];
    char names[2 * NVAL][32], caps[NVAL][96], *bytes[NVAL];
    for (int i = 0; i < NVAL; i++) {
        char rel[64];
        const char *ext = i % 3 ? "png" : "jpg";
        snprintf(rel, sizeof(rel), "va/%03d.%s", i, ext);
        size_t n = 0;
        bytes[i] = test_read_file(P(rel), &n);
        snprintf(names[2 * i], 32, "%03d.%s", i, ext);
        snprintf(names[2 * i + 1], 32, "%03d.txt", i);
        snprintf(caps[i], sizeof(caps[i]), "a %s %s", WORDS[i % NCLS], PLACES[(100 + i) % 5]);
        m[2 * i] = (member){names[2 * i], bytes[i], n};
        m[2 * i + 1] = (member){names[2 * i + 1], caps[i], strlen(caps[i])};
    }
    write_tar(P("val-0.tar"), 0, m, 2 * NVAL);
    for (int i = 0; i < NVAL; i++) free(bytes[i]);
    int st = run("train --model m.json --train-data train.csv --csv-separator , --image-mean 0.5 --image-std 0.5 "
                 "--batch-size 8 --workers 1 --logs runs --name w --steps 1 --val-data 'val-{0..0}.tar'", 1);
    CHECK(st == 0, "--val-data shards: exit %d\n%s", st, out);
    cJSON *ev[4] = {0};
    if (records("w", "eval", ev, 3) == 1 && ev[1])
        CHECK(num(ev[1], "retrieval", "captions") == NVAL && num(ev[1], "retrieval", "bad_samples") == 0,
              "shards: %g captions", num(ev[1], "retrieval", "captions"));
    else CHECK(0, "--val-data shards: one eval record at step 1");
    free_records(ev, 4);
    expect("train --model m.json --train-data val-0.tar --val-data val.csv --csv-separator , --val-frequency 1 "
           "--steps 1 --batch-size 8 --logs runs", 1, "give --train-num-samples N, the samples of an epoch");
}

// No flag silently ignored: each of these failed, or was accepted and did nothing, before.
static void test_errors(void) {
    const char *csv = "--train-data train.csv --csv-separator , --steps 1 --batch-size 8 --logs runs";
    char a[1024];
    snprintf(a, sizeof(a), "train %s --zeroshot-frequency 1", csv);
    expect(a, 1, "no zero-shot evaluation to run: give --zeroshot-data DIR");
    snprintf(a, sizeof(a), "train %s --zeroshot-every-n-steps 1", csv);
    expect(a, 1, "--zeroshot-every-n-steps: there is no zero-shot evaluation");
    snprintf(a, sizeof(a), "train %s --eval-samples 100", csv);
    expect(a, 1, "--eval-samples sizes the synthetic held-out evaluation");
    expect("train --model tiny --steps 1 --eval-samples 0 --zeroshot-every-n-steps 1 --logs runs", 1,
           "or --eval-samples N > 0");
    snprintf(a, sizeof(a), "train %s --val-frequency 1", csv);
    expect(a, 1, "need --val-data PATH");
    expect("train --model tiny --steps 1 --val-every-n-steps 2 --logs runs", 1, "need --val-data PATH");
    snprintf(a, sizeof(a), "train %s --val-num-samples 4", csv);
    expect(a, 1, "need --val-data PATH");
    snprintf(a, sizeof(a), "train %s --val-data val.csv --val-frequency 1 --val-every-n-steps 2", csv);
    expect(a, 1, "give --val-frequency (epochs) or --val-every-n-steps, not both");
    snprintf(a, sizeof(a), "train %s --zeroshot-classnames names.json", csv);
    expect(a, 1, "need --zeroshot-data DIR");
    snprintf(a, sizeof(a), "train %s --val-data missing.csv", csv);
    expect(a, 1, "--val-data: missing.csv");
    snprintf(a, sizeof(a), "train %s --zeroshot-data nowhere", csv);
    expect(a, 1, "--zeroshot-data: nowhere");
    snprintf(a, sizeof(a), "train %s --zeroshot-data zs --zeroshot-classnames names.json", csv);
    expect(a, 1, "holds the lists of 2 datasets: pick one with --zeroshot-dataset NAME");
    snprintf(a, sizeof(a), "train %s --zeroshot-data zs --zeroshot-classnames names.json --zeroshot-dataset nosuch", csv);
    expect(a, 1, "has no dataset 'nosuch'");
    snprintf(a, sizeof(a), "train %s --zeroshot-data zs --zeroshot-classnames names4.txt", csv);
    expect(a, 1, "--zeroshot-classnames names4.txt has 3 names, --zeroshot-data zs has 4 class folders");
    snprintf(a, sizeof(a), "train %s --zeroshot-data zs --zeroshot-templates nohole.json", csv);
    expect(a, 1, "template 1 ('a photo') has no {}");
    snprintf(a, sizeof(a), "train %s --zeroshot-data zs --zeroshot-dataset mine", csv);
    expect(a, 1, "--zeroshot-dataset mine picks a list of a CLIP_benchmark .json file");
    expect("train --model vlmoe-tiny --steps 1 --val-data val.csv", 1, "--val-data: the VL-MoE trainer");
    expect("train --model vlmoe-tiny --steps 1 --zeroshot-frequency=2", 1, "--zeroshot-frequency: the VL-MoE trainer");
    expect("eval --model nosuch.safetensors --val-num-samples 3", 1, "--val-num-samples needs --val-data");
    expect("train --help", 0, "--val-every-n-steps");
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_val");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_val_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    make_data();
    test_errors();
    test_steps();
    test_epochs();
    test_shards();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_val");
}
