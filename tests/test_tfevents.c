// test_tfevents.c: TensorBoard event files (src/report/tfevents.c) parsed back here with their own
// reader: the TFRecord framing (length, masked CRC32C of the length, data, masked CRC32C of the
// data) and the Event / Summary / Value / Image protobufs; every scalar and step of a short run's
// metrics.jsonl (`vlmoe train --report-to tensorboard` and `vlmoe report --to tensorboard`) is
// found with its value; TensorBoard's own EventAccumulator loads them where Python's tensorboard
// package is installed ($VLMOE_TB_PYTHON, else python3).
#include <cjson/cJSON.h>
#include <dirent.h>
#include <unistd.h>

#include "report/report.h"
#include "test.h"

typedef struct {
    char tag[160];
    long step;
    float v;
    double wall;
    int image, found;
} ev;
static ev *evs;
static int nev, cap_ev, versions, bad_crc, bad_pb;

static uint64_t rd_varint(const uint8_t **p, const uint8_t *end, int *ok) {
    uint64_t v = 0;
    for (int s = 0; s < 64; s += 7) {
        if (*p >= end) return *ok = 0, 0;
        const uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7F) << s;
        if (!(b & 0x80)) return v;
    }
    return *ok = 0, 0;
}

// Calls fn(field, wire, varint value, bytes, n) for each field of a message; 0 if malformed.
typedef void (*field_fn)(void *u, int field, int wire, uint64_t v, const uint8_t *b, size_t n);
static int pb_walk(const uint8_t *p, size_t n, field_fn fn, void *u) {
    const uint8_t *end = p + n;
    int ok = 1;
    while (p < end && ok) {
        const uint64_t key = rd_varint(&p, end, &ok);
        const int field = (int)(key >> 3), wire = (int)(key & 7);
        if (!ok) break;
        if (wire == 0) fn(u, field, 0, rd_varint(&p, end, &ok), NULL, 0);
        else if (wire == 1 || wire == 5) {
            const size_t k = wire == 1 ? 8 : 4;
            if (p + k > end) return 0;
            fn(u, field, wire, 0, p, k), p += k;
        } else if (wire == 2) {
            const uint64_t k = rd_varint(&p, end, &ok);
            if (!ok || k > (uint64_t)(end - p)) return 0;
            fn(u, field, 2, 0, p, (size_t)k), p += k;
        } else return 0;
    }
    return ok;
}

typedef struct {
    char tag[160];
    float v;
    int has_v, image, w, h, png;
} value;
static void on_image(void *u, int f, int wire, uint64_t v, const uint8_t *b, size_t n) {
    value *x = u;
    if (f == 1 && wire == 0) x->h = (int)v;
    if (f == 2 && wire == 0) x->w = (int)v;
    if (f == 4 && wire == 2) x->png = n > 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8);
}
static void on_value(void *u, int f, int wire, uint64_t v, const uint8_t *b, size_t n) {
    value *x = u;
    if (f == 1 && wire == 2) snprintf(x->tag, sizeof x->tag, "%.*s", (int)n, (const char *)b);
    if (f == 2 && wire == 5) memcpy(&x->v, b, 4), x->has_v = 1;
    if (f == 4 && wire == 2) x->image = 1, bad_pb += !pb_walk(b, n, on_image, x);
}
typedef struct {
    long step;
    double wall;
} event;
static void on_summary(void *u, int f, int wire, uint64_t v, const uint8_t *b, size_t n) {
    event *e = u;
    if (f != 1 || wire != 2) return;
    value x;
    memset(&x, 0, sizeof x);
    bad_pb += !pb_walk(b, n, on_value, &x);
    if (nev == cap_ev) evs = realloc(evs, sizeof(ev) * (size_t)(cap_ev = cap_ev ? 2 * cap_ev : 256));
    ev *o = &evs[nev++];
    memset(o, 0, sizeof(*o));
    snprintf(o->tag, sizeof o->tag, "%s", x.tag);
    o->step = e->step, o->v = x.v, o->image = x.image, o->wall = e->wall;
    if (x.image) CHECK(x.png && x.w > 0 && x.h > 0, "image %s: %dx%d, PNG %d", x.tag, x.w, x.h, x.png);
    else CHECK(x.has_v, "value %s has no simple_value", x.tag);
}
static void on_event(void *u, int f, int wire, uint64_t v, const uint8_t *b, size_t n) {
    event *e = u;
    if (f == 1 && wire == 1) memcpy(&e->wall, b, 8);
    if (f == 2 && wire == 0) e->step = (long)v;
    if (f == 3 && wire == 2) versions += n == 13 && !memcmp(b, "brain.Event:2", 13);
    if (f == 5 && wire == 2) bad_pb += !pb_walk(b, n, on_summary, e);
}

// Reads one events file; returns its records.
static int read_events(const char *path) {
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "open %s", path);
    if (!f) return 0;
    int records = 0;
    uint8_t head[12];
    while (fread(head, 1, 12, f) == 12) {
        uint64_t len;
        uint32_t c1, c2;
        memcpy(&len, head, 8), memcpy(&c1, head + 8, 4);
        if (c1 != report_masked_crc(head, 8) || len > (1u << 26)) { bad_crc++; break; }
        uint8_t *d = malloc(len ? len : 1);
        if (fread(d, 1, len, f) != len || fread(&c2, 1, 4, f) != 4 || c2 != report_masked_crc(d, len)) {
            bad_crc++, free(d);
            break;
        }
        event e = {0};
        bad_pb += !pb_walk(d, len, on_event, &e);
        free(d);
        records++;
    }
    fclose(f);
    return records;
}

// ---- what metrics.jsonl says, walked here on its own: "train/KEY", nested objects joined by '.',
// "moe/KEY/LAYER/MOD", arrays per expert, aux losses as "moe/aux.NAME/LAYER"
static int expected, missing;
static void expect_value(long step, const char *tag, double v) {
    expected++;
    for (int i = 0; i < nev; i++)
        if (evs[i].step == step && !strcmp(evs[i].tag, tag) && evs[i].v == (float)v && !evs[i].found) {
            evs[i].found = 1;
            return;
        }
    if (missing++ < 5) fprintf(stderr, "missing: step %ld %s = %g\n", step, tag, v);
}
static void expect_leaf(long step, const char *tag, const cJSON *x) {
    if (cJSON_IsNumber(x)) expect_value(step, tag, x->valuedouble);
    else if (cJSON_IsArray(x)) {
        int k = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, x) {
            char t[240];
            snprintf(t, sizeof t, "%.200s/expert_%d", tag, k++);
            if (cJSON_IsNumber(e)) expect_value(step, t, e->valuedouble);
        }
    }
}
static void expect_obj(long step, const char *prefix, const cJSON *o) {
    const cJSON *x;
    cJSON_ArrayForEach(x, o) {
        if (!strcmp(x->string, "step") || !strcmp(x->string, "moe")) continue;
        char t[200];
        snprintf(t, sizeof t, "%s%s", prefix, x->string);
        if (cJSON_IsObject(x)) {
            strcat(t, ".");
            expect_obj(step, t, x);
        } else if (cJSON_IsNumber(x)) expect_value(step, t, x->valuedouble);
    }
}
static void expect_file(const char *path) {
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "open %s", path);
    char line[1 << 16];
    while (f && fgets(line, sizeof line, f)) {
        cJSON *r = cJSON_Parse(line);
        const long step = (long)cJSON_GetObjectItem(r, "step")->valuedouble;
        char prefix[32];
        snprintf(prefix, sizeof prefix, "%s/", cJSON_GetObjectItem(r, "kind")->valuestring);
        expect_obj(step, prefix, r);
        const cJSON *L;
        cJSON_ArrayForEach(L, cJSON_GetObjectItem(r, "moe")) {
            char layer[64]; // VL-MoE layers log once per stream: "e0.b1.pair"
            const cJSON *stream = cJSON_GetObjectItem(L, "stream");
            snprintf(layer, sizeof layer, "e%d.b%d%s%s", cJSON_GetObjectItem(L, "encoder")->valueint,
                     cJSON_GetObjectItem(L, "block")->valueint, cJSON_IsString(stream) ? "." : "",
                     cJSON_IsString(stream) ? stream->valuestring : "");
            const cJSON *x, *y;
            cJSON_ArrayForEach(x, L) {
                if (!cJSON_IsObject(x)) { // a layer's own numbers, such as its capacity
                    if (strcmp(x->string, "encoder") && strcmp(x->string, "block") && !cJSON_IsString(x)) {
                        char t[200];
                        snprintf(t, sizeof t, "moe/%s/%s", x->string, layer);
                        expect_leaf(step, t, x);
                    }
                    continue;
                }
                const int mod = !strcmp(x->string, "image") || !strcmp(x->string, "text");
                cJSON_ArrayForEach(y, x) {
                    char t[200];
                    if (mod) snprintf(t, sizeof t, "moe/%s/%s/%s", y->string, layer, x->string);
                    else snprintf(t, sizeof t, "moe/%s.%s/%s", x->string, y->string, layer);
                    expect_leaf(step, t, y);
                }
            }
        }
        cJSON_Delete(r);
    }
    if (f) fclose(f);
}

// The one events file of dir whose name differs from skip (NULL: any); its path in out.
static int find_events(const char *dir, const char *skip, char *out, size_t n) {
    DIR *d = opendir(dir);
    int k = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (!strncmp(e->d_name, "events.out.tfevents.", 20) && (!skip || !strstr(skip, e->d_name)))
            snprintf(out, n, "%s/%s", dir, e->d_name), k++;
    if (d) closedir(d);
    return k;
}

static void reset(void) {
    free(evs);
    evs = NULL, nev = cap_ev = versions = bad_crc = bad_pb = expected = missing = 0;
}

// Every expected scalar found with its step, every scalar event expected, the file well formed.
static void check_run(const char *what, const char *events, const char *metrics, int images) {
    reset();
    const int records = read_events(events);
    CHECK(records > 1 && bad_crc == 0 && bad_pb == 0 && versions == 1, "%s: %d records, %d bad CRCs, %d bad protobufs, "
          "%d file_version events", what, records, bad_crc, bad_pb, versions);
    expect_file(metrics);
    int scalars = 0, imgs = 0;
    for (int i = 0; i < nev; i++) scalars += !evs[i].image, imgs += evs[i].image;
    CHECK(expected > 100 && missing == 0, "%s: %d of %d metrics values missing from the events", what, missing, expected);
    CHECK(scalars == expected, "%s: %d scalar events for %d metrics values", what, scalars, expected);
    CHECK(imgs >= images, "%s: %d routing map images, want at least %d", what, imgs, images);
}

static const char *bin;
static char dir[64], out[16384];

int main(int argc, char **argv) {
    // CRC32C's check value, and TFRecord's mask of it
    CHECK(report_crc32c((const uint8_t *)"123456789", 9) == 0xE3069283u, "crc32c(123456789) = %08x",
          report_crc32c((const uint8_t *)"123456789", 9));
    const uint32_t c = 0xE3069283u;
    CHECK(report_masked_crc((const uint8_t *)"123456789", 9) == ((c >> 15) | (c << 17)) + 0xa282ead8u, "mask");

    snprintf(dir, sizeof dir, "/tmp/vlmoe_tfevents_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    // the library alone: two scalars and an image, read back; a flipped byte is caught
    report_tb *t = NULL;
    CHECK(report_tb_open(&t, test_path(dir, "lib")) == VLMOE_OK, "open: %s", vlmoe_last_error());
    uint8_t rgb[4 * 3 * 3] = {255}, *png = NULL;
    size_t np = 0;
    CHECK(report_png_encode(rgb, 4, 3, &png, &np) == VLMOE_OK, "png");
    CHECK(report_tb_scalar(t, 7, 1.5, "a/b", 0.25f) == VLMOE_OK && report_tb_scalar(t, 300000, 2.5, "c", -3.0f) == VLMOE_OK &&
          report_tb_image(t, 9, 3.5, "img", png, np, 4, 3) == VLMOE_OK && report_tb_flush(t) == VLMOE_OK, "write");
    char path[1200];
    snprintf(path, sizeof path, "%s", report_tb_path(t));
    report_tb_close(t);
    free(png);
    reset();
    CHECK(read_events(path) == 4 && nev == 3 && bad_crc == 0 && bad_pb == 0 && versions == 1, "library file: %d events", nev);
    CHECK(nev == 3 && !strcmp(evs[0].tag, "a/b") && evs[0].step == 7 && evs[0].v == 0.25f && evs[1].step == 300000 &&
          evs[1].v == -3.0f && evs[2].image, "library values");
    FILE *f = fopen(path, "r+b");
    if (f) fseek(f, -6, SEEK_END), fputc('X', f), fclose(f);
    reset();
    read_events(path);
    CHECK(bad_crc == 1, "a flipped byte was not caught by the data CRC");

    static char abs_bin[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs_bin))) return test_summary("test_tfevents");
    test_expect_in(dir, bin, "train --model limoe-tiny --steps 12 --batch-size 8 --log-every-n-steps 3 --eval-samples 24 "
                   "--zeroshot-every-n-steps 6 --save-every-n-steps 6 --report-every 6 --report-to tensorboard --logs runs --name tb",
                   0, "tensorboard: ", out, sizeof out);
    char live[1200], conv[1200], tbdir[256];
    snprintf(tbdir, sizeof tbdir, "%s/runs/tb/tensorboard", dir);
    CHECK(find_events(tbdir, NULL, live, sizeof live) == 1, "one events file in %s", tbdir);
    check_run("train --report-to tensorboard", live, test_path(dir, "runs/tb/metrics.jsonl"), 4 * 2);
    // after the fact: a second file with the same scalars, the first left as it was
    test_expect_in(dir, bin, "report runs/tb --to tensorboard", 0, "wrote ", out, sizeof out);
    CHECK(find_events(tbdir, live, conv, sizeof conv) == 1, "the converted file beside the first");
    check_run("report --to tensorboard", conv, test_path(dir, "runs/tb/metrics.jsonl"), 4);
    test_expect_in(dir, bin, "report runs/tb --to wandb", 1, "--to: unknown target 'wandb'", out, sizeof out);
    test_expect_in(dir, bin, "train --steps 1 --report-to wandb --logs runs", 1, "--report-to: 'wandb'", out, sizeof out);
    test_expect_in(dir, bin, "report runs/nosuch --to tensorboard", 1, "runs/nosuch", out, sizeof out);

    // TensorBoard's own reader, where installed
    const char *py = getenv("VLMOE_TB_PYTHON");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s -c 'import tensorboard' >/dev/null 2>&1", py ? py : "python3");
    if (system(cmd) != 0) {
        printf("test_tfevents: skipped TensorBoard's reader: %s has no tensorboard package (pip install tensorboard; "
               "VLMOE_TB_PYTHON names another python)\n", py ? py : "python3");
    } else {
        snprintf(cmd, sizeof cmd,
                 "%s -c 'import sys\nfrom tensorboard.backend.event_processing.event_accumulator import EventAccumulator as A\n"
                 "a = A(sys.argv[1], size_guidance={\"scalars\": 0, \"images\": 0}); a.Reload()\n"
                 "print(\"scalars\", sum(len(a.Scalars(t)) for t in a.Tags()[\"scalars\"]), \"images\", "
                 "sum(len(a.Images(t)) for t in a.Tags()[\"images\"]), \"loss\", [e.step for e in a.Scalars(\"train/loss\")])' "
                 "%s 2>/dev/null",
                 py ? py : "python3", live);
        char res[4096] = "";
        FILE *p = popen(cmd, "r");
        size_t k = p ? fread(res, 1, sizeof res - 1, p) : 0;
        res[k] = 0;
        if (p) pclose(p);
        reset();
        read_events(live);
        expect_file(test_path(dir, "runs/tb/metrics.jsonl"));
        char want[256];
        snprintf(want, sizeof want, "scalars %d images 8 loss [3, 6, 9, 12]", expected);
        CHECK(strstr(res, want) != NULL, "EventAccumulator read \"%s\", want \"%s\"", res, want);
    }
    // VL-MoE pre-training (cli/vlmoe_train.c): the events of every logged step with the stream
    // of each layer's record, and the page; its routing maps are not drawn (no images)
    const char *mj = "{\"base\": \"vlmoe-tiny\", \"mim_vocab\": 64}";
    test_write_file(test_path(dir, "m.json"), mj, strlen(mj));
    test_expect_in(dir, bin, "vq train --model m.json --size 64 -o cb.safetensors", 0, "64 visual tokens", out, sizeof out);
    test_expect_in(dir, bin, "train --model m.json --codebook cb.safetensors --steps 6 --batch-size 12 --log-every-n-steps 2 "
                   "--save-every-n-steps 3 --report-every 3 --report-to tensorboard --logs runs --name vl --threads 2", 0,
                   "tensorboard: runs/vl/tensorboard/events.out.tfevents.", out, sizeof out);
    CHECK(strstr(out, "report: runs/vl/report.html") != NULL, "the VL-MoE run's report: %s", out);
    snprintf(tbdir, sizeof tbdir, "%s/runs/vl/tensorboard", dir);
    CHECK(find_events(tbdir, NULL, live, sizeof live) == 1, "one events file in %s", tbdir);
    check_run("VL-MoE train --report-to tensorboard", live, test_path(dir, "runs/vl/metrics.jsonl"), 0);
    int steps[3] = {0}, streams = 0;
    double wall[3] = {0};
    for (int i = 0; i < nev; i++) {
        if (!strcmp(evs[i].tag, "train/mim") && evs[i].step >= 2 && evs[i].step <= 6 && evs[i].step % 2 == 0)
            steps[evs[i].step / 2 - 1]++, wall[evs[i].step / 2 - 1] = evs[i].wall;
        streams += !strcmp(evs[i].tag, "moe/success/e0.b1.pair/image");
    }
    CHECK(steps[0] == 1 && steps[1] == 1 && steps[2] == 1 && streams == 3, "VL-MoE events: train/mim at steps 2/4/6 "
          "%d/%d/%d times, the pair stream's image success %d times", steps[0], steps[1], steps[2], streams);
    // written during the run: each logged step's events at its own time (a conversion at the end
    // would give them all one wall time)
    CHECK(wall[0] > 1e9 && wall[0] < wall[1] && wall[1] < wall[2], "VL-MoE events' wall times %.9f %.9f %.9f: not "
          "written step by step", wall[0], wall[1], wall[2]);
    test_expect_in(dir, bin, "train --model m.json --codebook cb.safetensors --steps 1 --report-to wandb --logs runs", 1,
                   "--report-to: 'wandb' is not supported", out, sizeof out);
    test_expect_in(dir, bin, "train --model m.json --codebook cb.safetensors --steps 1 --report-every -2 --logs runs", 2,
                   "--report-every must be >= 0", out, sizeof out);
    char *page = NULL;
    FILE *pf = fopen(test_path(dir, "runs/vl/report.html"), "r");
    if (pf) {
        page = calloc(1, 1 << 22);
        if (page) page[fread(page, 1, (1 << 22) - 1, pf)] = 0;
        fclose(pf);
    }
    CHECK(page && strstr(page, ": 3 records up to step 6") && strstr(page, "\"mim\"") && strstr(page, "e0.b1.pair image"),
          "the VL-MoE run's report.html: the records, the MIM loss and the pair stream's routing");
    free(page);
    reset();
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_tfevents");
}
