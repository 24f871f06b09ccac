// test_hostile_input.c: the numbers and special files of issue 19 as an attacker or a careless
// user gives them: model files whose capacity factors are huge or not finite, a model whose config
// declares more than its tensors hold, nonsense numeric flags of every command, FIFOs given as
// model, config and data files, a symbolic link loop in an image folder and a tar shard cut at a
// member boundary. Every case checks the exit status and the message, and that no input file
// changed (checksums before and after); under build/asan any memory error fails the exit status.
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "../test.h"
#include "../test_jpeg.h"
#include "../test_tar.h"

static const char *bin;
static char dir[64], out[16384];

// FNV-1a over a file's bytes (0 for a missing file): "the input did not change".
static uint64_t sum_file(const char *rel) {
    size_t n;
    char *b = test_read_file(test_path(dir, rel), &n);
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; b && i < n; i++) h = (h ^ (uint8_t)b[i]) * 1099511628211ULL;
    free(b);
    return b ? h : 0;
}

// The inputs every case may read; their checksums are taken before and compared after each case.
static const char *const INPUTS[] = {"m.safetensors", "huge.safetensors", "inf.safetensors", "neg.safetensors",
                                     "big.safetensors", "huge.json", "inf.json", "cut.tar"};
#define NIN (int)(sizeof(INPUTS) / sizeof(INPUTS[0]))

static void expect(const char *args, int status, const char *needle) {
    uint64_t before[NIN];
    for (int i = 0; i < NIN; i++) before[i] = sum_file(INPUTS[i]);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s", args);
    // a hang (a FIFO opened blocking) must fail the case, not the suite: timeout ends it (124)
    char full[2200];
    snprintf(full, sizeof(full), "timeout 120 %s %s", bin, cmd);
    const int st = test_run_in(dir, "", full, 1, out, sizeof(out));
    CHECK(st == status && strstr(out, needle), "`vlmoe %s`: exit %d (want %d), output lacks \"%s\":\n%s", args, st,
          status, needle, out);
    for (int i = 0; i < NIN; i++)
        CHECK(sum_file(INPUTS[i]) == before[i], "`vlmoe %s` changed the input %s", args, INPUTS[i]);
}

// Rewrites the model file src into dst with its config's changes applied by edit (the tensors
// and the rest of the metadata unchanged): the file an attacker would publish.
static void edit_model(const char *src, const char *dst, void (*edit)(cJSON *cfg)) {
    size_t n;
    char *b = test_read_file(test_path(dir, src), &n);
    CHECK(b && n > 8, "read %s", src);
    if (!b || n <= 8) return;
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | (uint8_t)b[i];
    char *hj = malloc(hl + 1);
    memcpy(hj, b + 8, hl);
    hj[hl] = 0;
    cJSON *h = cJSON_Parse(hj), *md = cJSON_GetObjectItem(h, "__metadata__");
    cJSON *cs = cJSON_GetObjectItem(md, "vlmoe.config");
    cJSON *cfg = cJSON_Parse(cJSON_GetStringValue(cs));
    CHECK(cfg != NULL, "%s: vlmoe.config", src);
    edit(cfg);
    char *ct = cJSON_PrintUnformatted(cfg);
    cJSON_ReplaceItemInObject(md, "vlmoe.config", cJSON_CreateString(ct));
    char *nh = cJSON_PrintUnformatted(h);
    size_t nl = strlen(nh), pad = (8 - nl % 8) % 8;
    FILE *f = fopen(test_path(dir, dst), "wb");
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((nl + pad) >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(nh, 1, nl, f);
    for (size_t i = 0; i < pad; i++) fputc(' ', f);
    fwrite(b + 8 + hl, 1, n - 8 - hl, f);
    fclose(f);
    free(ct), free(nh), free(hj), free(b);
    cJSON_Delete(cfg), cJSON_Delete(h);
}

static void set_moe(cJSON *cfg, const char *key, cJSON *v) {
    cJSON_ReplaceItemInObject(cJSON_GetObjectItem(cfg, "moe"), key, v);
}
static void huge_cf(cJSON *cfg) { set_moe(cfg, "capacity_factor", cJSON_CreateNumber(1e30)); }
static void huge_ecf(cJSON *cfg) { set_moe(cfg, "eval_capacity_factor", cJSON_CreateNumber(1e30)); }
static void neg_cf(cJSON *cfg) { set_moe(cfg, "eval_capacity_factor", cJSON_CreateNumber(-2)); }
// cJSON prints an infinity as null: the raw 1e999 (a JSON number that parses to +inf) is spliced
static void inf_cf(cJSON *cfg) { set_moe(cfg, "capacity_factor", cJSON_CreateRaw("1e999")); }
// width 2048, mlp 8192, 6 blocks: about 300M parameters (1.2 GB of floats) in a few hundred bytes
static void big(cJSON *cfg) {
    cJSON *e = cJSON_GetObjectItem(cfg, "encoder");
    cJSON_ReplaceItemInObject(e, "width", cJSON_CreateNumber(2048));
    cJSON_ReplaceItemInObject(e, "mlp_dim", cJSON_CreateNumber(8192));
    cJSON_ReplaceItemInObject(e, "layers", cJSON_CreateNumber(6));
    cJSON_ReplaceItemInObject(e, "heads", cJSON_CreateNumber(16));
    set_moe(cfg, "layers", cJSON_CreateRaw("[1, 3, 5]"));
}

static void model_files(void) {
    expect("train --model limoe-tiny --steps 1 --batch-size 8 --eval-samples 0 --logs runs --name m", 0, "trained");
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "cp %s/runs/m/checkpoints/step_1.safetensors %s/m.safetensors", dir, dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    edit_model("m.safetensors", "huge.safetensors", huge_cf);
    edit_model("m.safetensors", "hugee.safetensors", huge_ecf);
    edit_model("m.safetensors", "inf.safetensors", inf_cf);
    edit_model("m.safetensors", "neg.safetensors", neg_cf);
    edit_model("m.safetensors", "big.safetensors", big);
    static const uint8_t px[16 * 16 * 3] = {0};
    CHECK(test_write_rgb(test_path(dir, "x.png"), px, 16, 16, 0), "x.png");

    // the heap overflow: buffers sized for one factor, routing with the other. Now one capacity
    // function sizes and routes, clamped to what a group can use: a huge factor just works.
    expect("eval --model huge.safetensors --samples 16 --batch-size 8", 0, "zero-shot");
    expect("eval --model hugee.safetensors --samples 16 --batch-size 8", 0, "zero-shot");
    expect("embed --model huge.safetensors --images x.png -o e1.safetensors", 0, "");
    expect("embed --model hugee.safetensors --images x.png -o e2.safetensors", 0, "");
    expect("classify --model hugee.safetensors --image x.png --labels a,b", 0, "");
    expect("prune --model hugee.safetensors --modality image --keep 4 -o p.safetensors", 0, "");
    expect("soup huge.safetensors huge.safetensors -o s.safetensors", 0, "");
    // not finite, or <= 0: refused where the file is read, naming the file and the key
    expect("eval --model inf.safetensors --samples 16", 1, "inf.safetensors: key \"moe.capacity_factor\" must be a finite number");
    expect("embed --model inf.safetensors --images x.png -o e3.safetensors", 1, "inf.safetensors: key \"moe.capacity_factor\"");
    expect("eval --model neg.safetensors --samples 16", 1,
           "neg.safetensors: moe.eval_capacity_factor: -2 must be a finite number > 0");
    // the JSON model and the upcycle flags, the other two ways in
    static const char HJ[] = "{\"base\": \"limoe-tiny\", \"moe\": {\"capacity_factor\": 1e30}}";
    static const char IJ[] = "{\"base\": \"limoe-tiny\", \"moe\": {\"capacity_factor\": 1e999}}";
    test_write_file(test_path(dir, "huge.json"), HJ, strlen(HJ));
    test_write_file(test_path(dir, "inf.json"), IJ, strlen(IJ));
    expect("train --model huge.json --steps 1 --batch-size 8 --eval-samples 16 --logs runs --name hj", 0, "trained");
    expect("train --model inf.json --steps 1 --logs runs --name ij", 1, "inf.json: key \"moe.capacity_factor\" must be a finite number");
    // the declared size is checked against the tensors before the model is allocated
    expect("eval --model big.safetensors --samples 16", 1, "big.safetensors: tensor");
}

// Numeric flags: NaN, infinities, negatives, zero where it means nothing, int overflow. Each is a
// usage error (exit 2) naming the flag, before the command reads anything.
static void flags(void) {
    static const char *const CASES[][2] = {
        {"train --steps -1", "--steps must be >= 0"},
        {"train --lr nan", "--lr must be > 0 (a finite number), got 'nan'"},
        {"train --lr -0.001", "--lr must be > 0"},
        {"train --lr 0", "--lr must be > 0"},
        {"train --lr inf", "--lr must be > 0"},
        {"train --lr 1e999", "--lr must be > 0"},
        {"train --wd -0.1", "--wd must be >= 0"},
        {"train --wd nan", "--wd must be >= 0"},
        {"train --warmup -5", "--warmup must be >= 0"},
        {"train --beta1 1", "--beta1 must be in [0, 1)"},
        {"train --beta2 -0.5", "--beta2 must be in [0, 1)"},
        {"train --beta2 nan", "--beta2 must be in [0, 1)"},
        {"train --eps 0", "--eps must be > 0"},
        {"train --grad-clip-norm nan", "--grad-clip-norm must be >= 0"},
        {"train --grad-clip-norm -1", "--grad-clip-norm must be >= 0"},
        {"train --batch-size 0", "--batch-size must be >= 1"},
        {"train --batch-size -8", "--batch-size must be >= 1"},
        {"train --batch-size 99999999999", "--batch-size must be >= 1 (an integer up to 2147483647)"},
        {"train --accum-freq 0", "--accum-freq must be >= 1"},
        {"train --epochs -1", "--epochs must be >= 0"},
        {"train --steps 99999999999999999999", "--steps must be >= 0 (an integer)"},
        {"train --train-num-samples -1", "--train-num-samples must be >= 0"},
        {"train --log-every-n-steps 0", "--log-every-n-steps must be >= 1"},
        {"train --save-every-n-steps -1", "--save-every-n-steps must be >= 0"},
        {"train --keep-checkpoints -1", "--keep-checkpoints must be >= 0"},
        {"train --eval-samples -5", "--eval-samples must be >= 0"},
        {"train --threads -2", "--threads must be >= 0"},
        {"train --workers -1", "--workers must be >= 0"},
        {"train --max-bad-fraction 1.5", "--max-bad-fraction must be in [0, 1]"},
        {"train --max-bad-fraction nan", "--max-bad-fraction must be in [0, 1]"},
        {"train --bucket-cap-mb inf", "--bucket-cap-mb must be >= 0"},
        {"train --lr-cooldown-steps -1", "--lr-cooldown-steps must be >= 0"},
        {"train --image-size -32", "--image-size must be >= 0"},
        {"train --context-length -1", "--context-length must be >= 0"},
        {"train --val-every-n-steps -3", "--val-every-n-steps must be >= 0"},
        {"train --zeroshot-every-n-steps -1", "--zeroshot-every-n-steps must be >= 0"},
        {"train --lock-image-unlocked-groups -1", "--lock-image-unlocked-groups must be >= 0"},
        {"train --expert-parallel 0", "--expert-parallel must be >= 1"},
        {"train --model vlmoe-tiny --lr nan", "--lr must be > 0"},
        {"train --model vlmoe-tiny --steps -1", "--steps must be >= 0"},
        {"train --model vlmoe-tiny --warmup -1", "--warmup must be >= 0"},
        {"upcycle m.safetensors -o u.safetensors --noise inf", "--noise must be >= 0"},
        {"upcycle m.safetensors -o u.safetensors --noise nan", "--noise must be >= 0"},
        {"upcycle m.safetensors -o u.safetensors --capacity-factor 1e999", "--capacity-factor must be > 0"},
        {"upcycle m.safetensors -o u.safetensors --eval-capacity-factor 0", "--eval-capacity-factor must be > 0"},
        {"upcycle m.safetensors -o u.safetensors --experts 0", "--experts must be >= 1"},
        {"upcycle m.safetensors -o u.safetensors --top-k -1", "--top-k must be >= 1"},
        {"eval --model m.safetensors --samples -1", "--samples must be >= 0"},
        {"eval --model m.safetensors --batch-size 0", "--batch-size must be >= 1"},
        {"eval --model m.safetensors --few-shot -1", "--few-shot must be >= 0"},
        {"embed --model m.safetensors --images x.png -o e.safetensors --batch-size 0", "--batch-size must be >= 1"},
        {"classify --model m.safetensors --image x.png --labels a,b --top -1", "--top must be >= 0"},
        {"prune --model m.safetensors --keep 0 -o p.safetensors", "--keep must be >= 1"},
        {"soup m.safetensors m.safetensors -o s.safetensors --greedy --eval-samples 0", "--eval-samples must be >= 1"},
        {"synth export --out d --image-size -1", "--image-size must be >= 0"},
    };
    const int n = (int)(sizeof(CASES) / sizeof(CASES[0]));
    for (int i = 0; i < n; i++) expect(CASES[i][0], 2, CASES[i][1]);
    printf("hostile flags: %d nonsense numbers, each a usage error naming its flag\n", n);
    // too many held-out samples: refused before the run (it wrote through NULL after the run)
    expect("train --steps 1 --batch-size 8 --eval-samples 2147483647 --logs runs --name es", 1,
           "--eval-samples 2147483647: at most 1048576");
}

// Special files: FIFOs where a model, a config or data is read (each a clean error, not a hang),
// a symbolic link loop in an image folder, a tar shard that ends exactly after a member.
static void special_files(void) {
    CHECK(mkfifo(test_path(dir, "fifo.safetensors"), 0600) == 0, "mkfifo");
    CHECK(mkfifo(test_path(dir, "fifo.json"), 0600) == 0, "mkfifo");
    CHECK(mkfifo(test_path(dir, "fifo.csv"), 0600) == 0, "mkfifo");
    CHECK(mkfifo(test_path(dir, "fifo.tar"), 0600) == 0, "mkfifo");
    CHECK(mkfifo(test_path(dir, "fifo.png"), 0600) == 0, "mkfifo");
    expect("eval --model fifo.safetensors", 1, "fifo.safetensors: cannot open: not a regular file (a FIFO)");
    expect("train --model fifo.json --steps 1 --logs runs --name f", 1, "fifo.json: cannot open config file: not a "
           "regular file (a FIFO)");
    expect("train --train-data fifo.csv --steps 1 --logs runs --name f", 1, "fifo.csv");
    expect("train --train-data fifo.tar --dataset-type webdataset --steps 1 --logs runs --name f", 1,
           "fifo.tar: shard missing (not a regular file (a FIFO))");
    expect("classify --model m.safetensors --image fifo.png --labels a,b", 1, "fifo.png: cannot open: not a regular file");
    // text inputs: tokenizer files, label and prompt lists (fine-tuning tables: test_finetune)
    CHECK(mkfifo(test_path(dir, "fifo.txt"), 0600) == 0, "mkfifo");
    expect("tokenize --tokenizer fifo.txt hello", 1, "fifo.txt: cannot open: not a regular file (a FIFO)");
    expect("classify --model m.safetensors --image fifo.png --labels-file fifo.txt", 1,
           "fifo.txt: not a regular file (a FIFO)");
    // a folder that links to itself twice: 2^64 listings before the depth bound
    CHECK(mkdir(test_path(dir, "loop"), 0700) == 0 && mkdir(test_path(dir, "loop/a"), 0700) == 0, "mkdir");
    CHECK(symlink("..", test_path(dir, "loop/a/up1")) == 0 && symlink("..", test_path(dir, "loop/a/up2")) == 0, "ln");
    static const uint8_t px[16 * 16 * 3] = {0};
    CHECK(test_write_rgb(test_path(dir, "loop/a/x.png"), px, 16, 16, 0), "png");
    expect("embed --model m.safetensors --images loop -o l.safetensors", 1, "a symbolic link loop");
    // a shard cut at a member boundary: valid members, no end-of-archive blocks
    size_t jn;
    uint8_t *jpg = enc_jpeg(px, 16, 16, 3, 90, 0, &jn);
    const member ms[] = {{"s0.jpg", (const char *)jpg, jn}, {"s0.txt", "a red square", 12}};
    write_tar(test_path(dir, "full.tar"), 0, ms, 2);
    const size_t cut = 512 + (jn + 511) / 512 * 512 + 512 + 512;
    size_t n;
    char *b = test_read_file(test_path(dir, "full.tar"), &n);
    CHECK(b && n >= cut + 1024, "full.tar: %zu bytes", n);
    if (b && n >= cut) test_write_file(test_path(dir, "cut.tar"), b, cut);
    free(b), free(jpg);
    expect("train --train-data cut.tar --dataset-type webdataset --steps 1 --batch-size 2 --logs runs --name t", 1,
           "cut.tar: truncated");
}

static void put_chunk(FILE *f, const char *type, const uint8_t *d, uint32_t n) {
    uint8_t be[4] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    fwrite(be, 1, 4, f);
    fwrite(type, 1, 4, f);
    if (n) fwrite(d, 1, n, f);
    uLong c = crc32(crc32(0, (const Bytef *)type, 4), d, n);
    uint8_t cb[4] = {(uint8_t)(c >> 24), (uint8_t)(c >> 16), (uint8_t)(c >> 8), (uint8_t)c};
    fwrite(cb, 1, 4, f);
}

// A decompression bomb: a PNG of a few hundred bytes that declares w x h RGB pixels (its IDAT a
// short zlib stream of zero rows: a decoder that allocates first pays w * h * 3 bytes).
static void write_bomb(const char *rel, uint32_t w, uint32_t h) {
    FILE *f = fopen(test_path(dir, rel), "wb");
    fwrite("\x89PNG\r\n\x1a\n", 1, 8, f);
    uint8_t ihdr[13] = {(uint8_t)(w >> 24), (uint8_t)(w >> 16), (uint8_t)(w >> 8), (uint8_t)w,
                        (uint8_t)(h >> 24), (uint8_t)(h >> 16), (uint8_t)(h >> 8), (uint8_t)h, 8, 2, 0, 0, 0};
    put_chunk(f, "IHDR", ihdr, 13);
    static uint8_t zeros[1 << 16], z[1 << 12];
    uLongf zn = sizeof(z);
    compress2(z, &zn, zeros, sizeof(zeros), 9);
    put_chunk(f, "IDAT", z, (uint32_t)zn);
    put_chunk(f, "IEND", NULL, 0);
    fclose(f);
}

// Images that declare more pixels than allowed: one is skipped with a message naming it, not
// decoded into gigabytes; --max-image-pixels raises (or, out of range, is refused).
static void bombs(void) {
    write_bomb("bomb.png", 10000, 10000); // 1e8 pixels > 89478485: 300 MB of RGB
    expect("classify --model m.safetensors --image bomb.png --image x.png --labels a,b", 0,
           "bomb.png: PNG: image size 10000x10000 (100000000 pixels) is more than the 89478485 pixels allowed");
    expect("embed --model m.safetensors --images bomb.png x.png -o b.safetensors", 0,
           "bomb.png: PNG: image size 10000x10000");
    expect("classify --model m.safetensors --image x.png --labels a,b --max-image-pixels 0", 2,
           "--max-image-pixels must be >= 1");
    expect("classify --model m.safetensors --image x.png --labels a,b --max-image-pixels 300000000", 1,
           "max_pixels 300000000 outside 1..268435456 (--max-image-pixels)");
    // the flag sets the limit (lowered here, so the check costs no big decode): 16x16 > 100
    expect("classify --model m.safetensors --image x.png --image bomb.png --labels a,b --max-image-pixels 100", 1,
           "x.png: PNG: image size 16x16 (256 pixels) is more than the 100 pixels allowed");
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_hostile_input");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_hostile_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    model_files();
    flags();
    special_files();
    bombs();
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (!t_fail && system(cmd)) {}
    return test_summary("test_hostile_input");
}
