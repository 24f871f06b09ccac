// test_vlmoe_train.c: VL-MoE pretraining from the command line (cli/vlmoe_train.c). (a) `vlmoe vq
// train` then `vlmoe train` on the synthetic data: MIM, MLM and both VLM losses fall from the first
// to the last logged step and every logged step holds the routing of each stream; (b) the same on an
// image folder, a text file and an OpenCLIP CSV written here (PNG files), and on the CSV alone; (c)
// a run of N steps equals a run of N/2 steps resumed to N (metrics records but for their "time"
// object, and checkpoint bytes), with an uneven --mix on that data, and with the cosine schedule
// from a mid-run checkpoint on synthetic data, and a run older than --drop-path/--hflip/--color-jitter
// resumed as it ran, and a resume with --device cpu; (d) bad input on purpose (--device gpu among
// them). Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "test_jpeg.h"

static const char *bin;
static char dir[64], out[65536];
#define P(rel) test_path(dir, rel)

// Runs `vlmoe ARGS` in the test folder, output in out; a sanitizer report is a failure.
static int run(const char *args) {
    const int st = test_run_in(dir, bin, args, 1, out, sizeof(out));
    CHECK(!strstr(out, "Sanitizer") && !strstr(out, "runtime error:"), "`vlmoe %s`:\n%s", args, out);
    return st;
}

static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }

static const char *const COLOUR[3] = {"red", "green", "blue"};
static const uint8_t RGB[3][3] = {{220, 30, 30}, {30, 200, 40}, {40, 50, 230}};

// A coloured square (colour c) at a place and size that vary with i, on a grey background.
static void write_png(const char *rel, int c, int i) {
    const int w = 40 + 4 * (i % 3), h = 36, s = 10 + 2 * (i % 4), x0 = (7 * i) % (w - s), y0 = (5 * i) % (h - s);
    uint8_t *px = malloc((size_t)w * h * 3);
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int k = 0; k < 3; k++) {
                const int in = x >= x0 && x < x0 + s && y >= y0 && y < y0 + s;
                px[3 * ((size_t)y * w + x) + k] = in ? RGB[c][k] : (uint8_t)(110 + 3 * (i % 5));
            }
    CHECK(test_write_rgb(P(rel), px, w, h, 0), "write %s", rel);
    free(px);
}

// imgs/<colour>/N.png (a folder of folders), texts.txt, pairs.csv over imgs/, empty and blank texts.
static void make_data(void) {
    char rel[128], csv[8192] = "filepath\ttitle\n", txt[8192] = "", line[256];
    static const char *const shape[4] = {"square", "circle", "triangle", "cross"};
    static const char *const size[3] = {"small", "medium", "large"};
    mkdir(P("imgs"), 0755);
    for (int c = 0; c < 3; c++) {
        snprintf(rel, sizeof(rel), "imgs/%s", COLOUR[c]);
        mkdir(P(rel), 0755);
        for (int i = 0; i < 8; i++) {
            snprintf(rel, sizeof(rel), "imgs/%s/%d.png", COLOUR[c], i);
            write_png(rel, c, 8 * c + i);
            snprintf(line, sizeof(line), "%s\ta photo of a %s %s square\n", rel, size[i % 3], COLOUR[c]);
            strcat(csv, line);
        }
    }
    for (int i = 0; i < 36; i++) {
        snprintf(line, sizeof(line), "there is a %s %s %s on the %s\n", size[i % 3], COLOUR[i / 3 % 3], shape[i / 9],
                 i % 2 ? "left" : "right");
        strcat(txt, line);
    }
    put("pairs.csv", csv);
    put("texts.txt", txt);
    put("empty.txt", "");
    put("blank.txt", "\n\n  \n");
    put("m.json", "{\"base\": \"vlmoe-tiny\", \"mim_vocab\": 64}");
    mkdir(P("some_bad"), 0755); // two PNGs and a file that is no image
    write_png("some_bad/a.png", 0, 1);
    write_png("some_bad/c.png", 2, 3);
    put("some_bad/b.png", "not a PNG");
    mkdir(P("all_bad"), 0755);
    put("all_bad/x.jpg", "not a JPEG either");
}

// The metrics lines of run NAME (under runs/), malloc'd; NULL if missing.
static char *metrics(const char *name) {
    char rel[128];
    snprintf(rel, sizeof(rel), "runs/%s/metrics.jsonl", name);
    return test_read_file(P(rel), NULL);
}

// The number after "KEY": in line, or NAN.
static double num(const char *line, const char *key) {
    char k[64];
    snprintf(k, sizeof(k), "\"%s\":", key);
    const char *p = strstr(line, k);
    return p ? atof(p + strlen(k)) : NAN;
}

// Checks that run NAME's metrics hold `steps` lines, each with the routing of every stream, and
// that the four masked-modeling losses fell from the first line to the last.
static void check_learned(const char *name, int steps) {
    char *m = metrics(name), *line[512];
    CHECK(m != NULL, "%s: no metrics.jsonl", name);
    if (!m) return;
    int n = 0, routed = 0;
    for (char *l = strtok(m, "\n"); l && n < 512; l = strtok(NULL, "\n")) {
        line[n++] = l;
        // "moe": one array of layer records, the image stream's first, each naming its stream
        const char *moe = strstr(l, "\"moe\":[{\"encoder\":0,\"block\":1,\"stream\":\"image\",\"image\":{\"tokens\":");
        const char *text = moe ? strstr(moe, "{\"encoder\":0,\"block\":1,\"stream\":\"text\",\"text\":{") : NULL;
        const char *pair = text ? strstr(text, "\"stream\":\"pair\",") : NULL;
        routed += pair && strstr(pair, "\"success\":") && strstr(pair, "\"dropped\":") &&
                  strstr(pair, "\"experts_used\":") && strstr(l, "\"kind\":\"train\"");
    }
    CHECK(n == steps && routed == steps, "%s: %d metrics lines (want %d), %d with routing of all three streams", name, n,
          steps, routed);
    static const char *const loss[4] = {"mim", "mlm", "vlm_text", "vlm_image"};
    for (int k = 0; k < 4 && n > 1; k++) {
        const double a = num(line[0], loss[k]), b = num(line[n - 1], loss[k]);
        printf("%s: %s %.3f -> %.3f\n", name, loss[k], a, b);
        CHECK(a > 0 && b > 0 && b < a - 0.3, "%s: %s went from %.4f (step 1) to %.4f (step %d)", name, loss[k], a, b, n);
    }
    free(m);
}

static void expect(const char *args, int status, const char *needle, const char *needle2) {
    const int st = run(args);
    CHECK(st == status && strstr(out, needle) && (!needle2 || strstr(out, needle2)),
          "`vlmoe %s`: exit %d (want %d), output lacks \"%s\"%s%s:\n%s", args, st, status, needle, needle2 ? " or " : "",
          needle2 ? needle2 : "", out);
}

// Whether two files have the same bytes (and exist).
// Two checkpoint files hold the same tensors, bit for bit (their metadata differ: every save has
// its own run and save ids, src/train/checkpoint.c).
static int same_file(const char *a, const char *b) {
    vlmoe_st *x = NULL, *y = NULL;
    int same = !vlmoe_st_open(P(a), &x) && !vlmoe_st_open(P(b), &y) && vlmoe_st_count(x) == vlmoe_st_count(y);
    for (int i = 0; same && i < vlmoe_st_count(x); i++) {
        vlmoe_tensor_info p, q;
        same = !vlmoe_st_info(x, i, &p) && !vlmoe_st_info(y, i, &q) && !strcmp(p.name, q.name) &&
               p.nbytes == q.nbytes && !memcmp(p.data, q.data, p.nbytes);
    }
    vlmoe_st_close(x), vlmoe_st_close(y);
    return same;
}

// The metrics lines of run NAME without their trailing "time" object (wall-clock fields, which
// differ between any two runs), malloc'd; NULL if missing.
static char *metrics_untimed(const char *name) {
    char *m = metrics(name), *w = m;
    for (const char *l = m; l && *l;) {
        const char *end = strchr(l, '\n'), *t = strstr(l, ",\"time\":");
        if (!end) end = l + strlen(l);
        const size_t n = (size_t)((t && t < end ? t : end) - l);
        memmove(w, l, n);
        w += n;
        *w++ = '\n';
        l = *end ? end + 1 : end;
    }
    if (w) *w = 0;
    return m;
}

// Run `full` and run `other` (resumed) logged the same metrics records (but for their timing) and
// wrote the same step_N weights and training state.
static void check_same(const char *full, const char *other, int steps) {
    char *a = metrics_untimed(full), *b = metrics_untimed(other), wa[128], wb[128], sa[128], sb[128];
    int line = 1, at = 0;
    while (a && b && a[at] && a[at] == b[at]) line += a[at++] == '\n';
    CHECK(a && b && a[at] == b[at], "%s and %s: metrics differ from line %d on:\n%.300s\nvs\n%.300s", full, other, line,
          a ? a + at : "(none)", b ? b + at : "(none)");
    free(a), free(b);
    snprintf(wa, sizeof(wa), "runs/%s/checkpoints/step_%d.safetensors", full, steps);
    snprintf(wb, sizeof(wb), "runs/%s/checkpoints/step_%d.safetensors", other, steps);
    snprintf(sa, sizeof(sa), "runs/%s/checkpoints/step_%d.state.safetensors", full, steps);
    snprintf(sb, sizeof(sb), "runs/%s/checkpoints/step_%d.state.safetensors", other, steps);
    CHECK(same_file(wa, wb) && same_file(sa, sb), "%s and %s: step %d weights or training state differ", full, other, steps);
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_vlmoe_train");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_vltrain_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    make_data();
    const char *common = "--model m.json --logs runs --log-every-n-steps 1 --warmup 5 --lr 2e-3 --threads 2";
    char a[2048];

    // (a) synthetic data
    expect("vq train --model m.json --size 64 -o cb.safetensors", 0, "64 visual tokens of 192 values", "synthetic images");
    snprintf(a, sizeof(a), "train %s --codebook cb.safetensors --steps 40 --batch-size 24 --name syn", common);
    expect(a, 0, "routing  image: b1 V-MoE success", "| text: b1 T-MoE success");
    CHECK(strstr(out, "| pair: b1 V-MoE success") && strstr(out, "8 images + 8 texts + 8 pairs"), "%s", out);
    check_learned("syn", 40);
    // a run folder another run holds is refused, naming the holder (cli_run_lock, as vlmoe train)
    char lk[256];
    snprintf(lk, sizeof(lk), "%s/runs/syn/.vlmoe.lock", dir);
    const int lfd = open(lk, O_RDWR);
    CHECK(lfd >= 0 && flock(lfd, LOCK_EX | LOCK_NB) == 0 && pwrite(lfd, "4242\n", 5, 0) == 5, "hold %s", lk);
    snprintf(a, sizeof(a), "train %s --codebook cb.safetensors --steps 41 --batch-size 24 --name syn --resume latest",
             common);
    expect(a, 1, "runs/syn is in use by another run (process 4242", NULL);
    close(lfd);

    // (b) an image folder, a text file and a CSV of pairs; then the CSV alone for all three streams
    expect("vq train --model m.json --size 64 --image-data imgs -o cbf.safetensors", 0, "of 24 images under imgs", NULL);
    snprintf(a, sizeof(a), "train %s --codebook cbf.safetensors --steps 40 --batch-size 24 --image-data imgs "
             "--text-data texts.txt --train-data pairs.csv --workers 1 --name files", common);
    expect(a, 0, "images: 24 files under imgs", "texts: 36 sentences of texts.txt");
    CHECK(strstr(out, "data pairs.csv (24 usable rows): 8 of each step's samples"), "%s", out);
    // the texts never go through the synthetic words: a BPE vocabulary of the sentences and captions,
    // the embedding sized to it with [MASK] after it, and the checkpoint carries it (in the header,
    // after the file's 8-byte length)
    CHECK(strstr(out, "trained a BPE vocabulary of") && strstr(out, "is sized to the tokenizer") &&
          !strstr(out, "word tokenizer"), "%s", out);
    char *ck = test_read_file(P("runs/files/checkpoints/step_40.safetensors"), NULL);
    CHECK(ck && strstr(ck + 8, "\"vlmoe.tokenizer\":\"bpe\"") && strstr(ck + 8, "\"vlmoe.preprocess\""),
          "the VL-MoE checkpoint records its tokenizer and normalisation");
    free(ck);
    ck = test_read_file(P("runs/syn/checkpoints/step_40.safetensors"), NULL);
    CHECK(ck && strstr(ck + 8, "\"vlmoe.tokenizer\":\"synthetic\""), "a synthetic VL-MoE run records the synthetic words");
    free(ck);
    check_learned("files", 40);
    snprintf(a, sizeof(a), "train %s --codebook cbf.safetensors --steps 3 --batch-size 6 --train-data pairs.csv --name csv",
             common);
    expect(a, 0, "data pairs.csv (24 usable rows): 6 of each step's samples", "trained to step 3");
    char *params = test_read_file(P("runs/csv/params.json"), NULL);
    int sources = 0; // "source": "train-data" for each of the three streams
    for (const char *p = params; p && (p = strstr(p, "\"train-data\"")); p++) sources++;
    CHECK(sources == 3, "--train-data alone gives images and texts too:\n%s", params ? params : "(no params.json)");
    CHECK(params && strstr(params, "\"drop_path\":\t0.1"), "params.json records VL-MoE's stochastic depth 0.1 by default:\n%s",
          params ? params : "(no params.json)");
    CHECK(params && strstr(params, "\"device\":\t\"cpu\""), "params.json records the device, cpu by default:\n%s",
          params ? params : "(no params.json)");
    CHECK(params && strstr(params, "\"hflip\":\t0.5") && strstr(params, "\"color_jitter\":\t0.4"),
          "params.json records the image augmentations hflip 0.5 and color jitter 0.4 by default:\n%s",
          params ? params : "(no params.json)");
    free(params);

    // (c) exact resume: 8 steps against 4 + resume to 8, on the files with an uneven mix (forwards
    // of 3: 3 images, 3 texts, 6 pairs) and the const schedule, then with the cosine schedule from
    // the step-4 checkpoint of a copy of an 8-step synthetic run, without --codebook
    const char *files = "--codebook cbf.safetensors --batch-size 12 --mix 1,1,2 --lr-scheduler const --image-data imgs "
                        "--text-data texts.txt --train-data pairs.csv --save-every-n-steps 2";
    snprintf(a, sizeof(a), "train %s %s --steps 8 --name full", common, files);
    expect(a, 0, "3 images + 3 texts + 6 pairs (forwards of 3)", "trained to step 8");
    snprintf(a, sizeof(a), "train %s %s --steps 4 --name half --workers 0", common, files);
    expect(a, 0, "trained to step 4", NULL);
    // resumed with --device cpu (a key a resume may change): the same run
    snprintf(a, sizeof(a), "train %s %s --steps 8 --name half --workers 3 --resume latest --device cpu", common, files);
    expect(a, 0, "resuming from runs/half/checkpoints/step_4.safetensors (step 4)", "trained to step 8");
    check_same("full", "half", 8);
    // a changed --mix is refused by the flags' check, and with --resume-allow-changes by the
    // checkpoint's data state
    snprintf(a, sizeof(a), "train %s %s --mix 1,1,1 --steps 8 --name half --resume latest", common, files);
    expect(a, 1, "the streams (--mix, --batch-size and the data flags)", "differs from the run's");
    snprintf(a, sizeof(a), "train %s %s --mix 1,1,1 --steps 8 --name half --resume latest --resume-allow-changes", common,
             files);
    expect(a, 1, "written with another data set-up", NULL);

    snprintf(a, sizeof(a), "train %s --codebook cb.safetensors --batch-size 12 --steps 8 --save-every-n-steps 4 --name cos",
             common);
    expect(a, 0, "trained to step 8", NULL);
    snprintf(a, sizeof(a), "cp -r %s %s", P("runs/cos"), P("runs/cos2"));
    CHECK(system(a) == 0, "%s failed", a);
    // no --codebook: the checkpoint carries it
    snprintf(a, sizeof(a), "train %s --batch-size 12 --steps 8 --save-every-n-steps 4 "
             "--resume runs/cos2/checkpoints/step_4.safetensors", common);
    expect(a, 0, "resuming from runs/cos2/checkpoints/step_4.safetensors", "trained to step 8");
    check_same("cos", "cos2", 8);
    // the flags are checked against the run's params.json: a changed --lr is refused with both
    // values, and taken with --resume-allow-changes (logged in params_resumed.json)
    snprintf(a, sizeof(a), "train %s --codebook cb.safetensors --batch-size 12 --steps 10 --name cos --resume latest "
             "--lr 3e-3", common);
    expect(a, 1, "--lr 0.003 differs from the run's 0.002 (params.json of runs/cos)", NULL);
    snprintf(a, sizeof(a), "train %s --codebook cb.safetensors --batch-size 12 --steps 10 --name cos --resume latest "
             "--lr 3e-3 --wd 0.1 --resume-allow-changes", common);
    expect(a, 0, "warning: --resume-allow-changes: --lr 0.003 differs", "trained to step 10");
    params = test_read_file(P("runs/cos/params_resumed.json"), NULL);
    CHECK(params && strstr(params, "--wd 0.1 differs from the run's 0.05") && strstr(params, "\"step\":\t8"),
          "params_resumed.json:\n%s", params ? params : "(none)");
    free(params);
    // a run from before --drop-path, --hflip and --color-jitter (its params.json has none of them)
    // trained without stochastic depth, flips or jitter: resumed without the flags it goes on so,
    // bit for bit as the run that never stopped, not with today's 0.1 / 0.5 / 0.4; a flag given
    // is a change from what the run did
    const char *old = "--codebook cbf.safetensors --batch-size 6 --mix 1,0,0 --image-data imgs";
    snprintf(a, sizeof(a), "train %s %s --drop-path 0 --hflip 0 --color-jitter 0 --steps 4 --name augfull", common, old);
    expect(a, 0, "trained to step 4", NULL);
    snprintf(a, sizeof(a), "train %s %s --drop-path 0 --hflip 0 --color-jitter 0 --steps 2 --name aug", common, old);
    expect(a, 0, "trained to step 2", NULL);
    static const char *const newer[] = {"drop_path", "hflip", "color_jitter"};
    for (int i = 0; i < 3; i++) test_json_drop_key(P("runs/aug/params.json"), newer[i]);
    snprintf(a, sizeof(a), "train %s %s --steps 4 --name aug --resume latest --hflip 0.5", common, old);
    expect(a, 1, "--hflip 0.5 differs from the run's 0 (params.json of runs/aug has no hflip", NULL);
    snprintf(a, sizeof(a), "train %s %s --steps 4 --name aug --resume latest --drop-path 0.1", common, old);
    expect(a, 1, "--drop-path 0.1 differs from the run's 0 (params.json of runs/aug has no drop_path", NULL);
    snprintf(a, sizeof(a), "train %s %s --steps 4 --name aug --resume latest", common, old);
    expect(a, 0, "resuming from runs/aug/checkpoints/step_2.safetensors", "trained to step 4");
    check_same("augfull", "aug", 4);

    // --save-frequency counts epochs of --train-num-samples: 24 samples at 12 a step are 2 steps
    snprintf(a, sizeof(a), "train %s --codebook cb.safetensors --batch-size 12 --train-num-samples 24 --epochs 2 "
             "--save-frequency 1 --keep-checkpoints 0 --name ep", common);
    expect(a, 0, "trained to step 4", NULL);
    int at[4];
    for (int i = 0; i < 4; i++) {
        char rel[128];
        snprintf(rel, sizeof(rel), "runs/ep/checkpoints/step_%d.safetensors", i + 1);
        at[i] = access(P(rel), R_OK) == 0;
    }
    CHECK(!at[0] && at[1] && !at[2] && at[3], "--save-frequency 1: checkpoints at steps 1-4: %d%d%d%d, want 0101", at[0],
          at[1], at[2], at[3]);

    // (d) bad input
    expect("train --steps 2 --model m.json --codebook cbf.safetensors --text-data texts.txt", 1, "the pair stream has weight 1",
           "pairs need --train-data");
    expect("train --steps 2 --model m.json --codebook cbf.safetensors --text-data texts.txt --mix 1,1,0", 1,
           "the image stream has weight 1 in --mix 1,1,0 but no data", NULL);
    expect("train --steps 2 --model m.json --codebook cbf.safetensors --drop-path 1", 1,
           "--drop-path 1: expected a rate in [0, 1)", NULL);
    expect("train --steps 2 --model m.json --codebook cbf.safetensors --image-data imgs --hflip 1.5", 2,
           "--hflip must be in [0, 1], got '1.5'", NULL);
    expect("train --steps 2 --model m.json --codebook cbf.safetensors --image-data imgs --color-jitter -1", 2,
           "--color-jitter must be >= 0 (a finite number), got '-1'", NULL);
    expect("train --steps 2 --model m.json --codebook cbf.safetensors --color-jitter 0.4", 1,
           "--hflip/--color-jitter augment image files", NULL);
    expect("vq train --model m.json --size 32 -o cb32.safetensors", 0, "32 visual tokens", NULL);
    expect("train --model m.json --codebook cb32.safetensors --steps 1", 1, "cb32.safetensors: the codebook is 32 x 192",
           "needs 64 visual tokens (mim_vocab)");
    expect("train --steps 2 --model m.json --codebook cb.safetensors --text-data empty.txt --mix 0,1,0", 1,
           "--text-data empty.txt: no sentences", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --text-data blank.txt --mix 0,1,0", 1,
           "--text-data blank.txt: no sentences", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --mix 1,x,1", 1, "--mix '1,x,1': expected three", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --mix 1,1", 1, "--mix '1,1': expected three", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --mix 0,0,0", 1, "--mix '0,0,0'", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --mix 1,-1,1", 1, "--mix '1,-1,1'", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --mix 1,2,1 --batch-size 6", 1,
           "--batch-size 6 does not split 1:2:1", "multiple of 4");
    expect("train --steps 2 --model m.json --codebook cb.safetensors --frobnicate 3", 2, "unknown flag '--frobnicate'", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --image-data texts.txt --mix 1,0,0", 1,
           "--image-data texts.txt: not a folder", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --image-data imgs --mix 0,1,1 --train-data pairs.csv", 1,
           "--image-data imgs is unused", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --train-data missing.csv", 1, "missing.csv", NULL);
    // an unreadable file is skipped (the next one takes its place); a folder of them stops the run
    expect("train --steps 2 --model m.json --codebook cb.safetensors --image-data some_bad --mix 1,0,0 --batch-size 3 "
           "--logs runs --name some_bad", 0, "warning: --image-data some_bad: skipped", "; first: some_bad/b.png: not a JPEG");
    // --max-image-pixels 1500: a.png (44x36) is skipped as a decompression bomb would be, c.png (40x36) is read
    expect("train --steps 2 --model m.json --codebook cb.safetensors --image-data some_bad --mix 1,0,0 --batch-size 3 "
           "--max-image-pixels 1500 --logs runs --name capped", 0, "trained to step 2",
           "some_bad/a.png: PNG: image size 44x36 (1584 pixels) is more than the 1500 pixels allowed");
    CHECK(!strstr(out, "c.png"), "--max-image-pixels 1500 skipped c.png (1440 pixels) too:\n%s", out);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --image-data all_bad --mix 1,0,0 --batch-size 3", 1,
           "--image-data all_bad: no image could be read; first: all_bad/x.jpg", NULL);
    expect("train --steps 2 --model m.json --codebook nothere.safetensors", 1, "nothere.safetensors", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --name none --resume latest", 1,
           "no checkpoint in logs/none/checkpoints", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --image-data imgs --mix 1,0,0 --save-frequency 1", 1,
           "--save-frequency counts epochs: give --train-num-samples", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --workers 3", 1, "--workers applies to --train-data",
           NULL);
    // --device: a name that is no device stops the run before anything is written
    expect("train --steps 2 --model m.json --codebook cb.safetensors --device gpu --name nodev", 1,
           "--device: device 'gpu': expected cpu, cuda or cuda:N", NULL);
    expect("train --steps 2 --model m.json --codebook cb.safetensors --device cuda:x --name nodev", 1,
           "expected cuda:N with N a device number", NULL);
    struct stat nodev;
    CHECK(stat(P("logs/nodev"), &nodev) != 0, "a bad --device left a run folder logs/nodev");
    expect("train --steps 2 --model m.json --codebook cb.safetensors --optimizer adafactor --eps 1e-8", 1,
           "--eps applies to --optimizer adamw", NULL);

    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    return test_summary("test_vlmoe_train");
}
