// test_finetune.c: `vlmoe finetune` (cli/finetune.c) on data this test writes: an image folder of
// solid-colour PNGs in three class folders (image-cls; routers and experts are frozen by default,
// so those of the written model equal the pretrained ones bit for bit, and OUT.params.json says
// so), a TSV of sentences labelled by their colour word (text-cls, with --no-freeze-moe: some
// router or expert tensor trains) and a TSV of image/question/answer rows whose answer needs both
// (pair-cls); each must reach a training accuracy above chance. Bad input on purpose: missing
// columns, a non-mome model, an unknown task, contradicting flags. Runs $VLMOE_BIN (or
// $VLMOE_BIN_ASAN).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "test_jpeg.h"
#include "vlmoe.h"

static const char *bin;
static char dir[64], out[16384];
#define P(rel) test_path(dir, rel)

static int run(const char *args) { return test_run_in(dir, bin, args, 1, out, sizeof(out)); }

static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }

static const uint8_t RGB[3][3] = {{220, 30, 30}, {30, 200, 40}, {40, 50, 230}};
static const char *const COLOUR[3] = {"red", "green", "blue"};

// A solid-colour PNG, brightness varied by `shade` so the examples of a class differ a little.
static void write_png(const char *rel, int colour, int shade) {
    const int w = 32 + 4 * shade, h = 32;
    uint8_t *px = malloc((size_t)w * h * 3);
    for (int k = 0; k < w * h; k++)
        for (int c = 0; c < 3; c++) px[3 * k + c] = (uint8_t)(RGB[colour][c] - 8 * shade);
    CHECK(test_write_rgb(P(rel), px, w, h, 0), "write %s", rel);
    free(px);
}

static void make_data(void) {
    char rel[128];
    mkdir(P("imgs"), 0755);
    for (int c = 0; c < 3; c++) {
        snprintf(rel, sizeof(rel), "imgs/%s", COLOUR[c]);
        mkdir(P(rel), 0755);
        for (int s = 0; s < 4; s++) {
            snprintf(rel, sizeof(rel), "imgs/%s/%d.png", COLOUR[c], s);
            write_png(rel, c, s);
        }
    }
    // text-cls: the label is the sentence's colour word
    static const char *const tpl[4] = {"a photo of a %s circle", "the %s square", "a large %s triangle on a plain background",
                                       "there is a small %s cross"};
    char tsv[8192] = "", line[256];
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < 3; c++) {
            char text[128];
            snprintf(text, sizeof(text), tpl[t], COLOUR[c]);
            snprintf(line, sizeof(line), "%s\t%s\n", text, COLOUR[c]);
            strcat(tsv, line);
        }
    put("texts.tsv", tsv);
    // pair-cls: "is it red" on a red/green/blue image: yes or no, which needs image and question
    tsv[0] = 0;
    for (int s = 0; s < 2; s++)
        for (int c = 0; c < 3; c++)
            for (int q = 0; q < 3; q++) {
                snprintf(line, sizeof(line), "imgs/%s/%d.png\tis there a %s square\t%s\n", COLOUR[c], s, COLOUR[q],
                         c == q ? "yes" : "no");
                strcat(tsv, line);
            }
    put("pairs.tsv", tsv);
    put("bad_pairs.tsv", "imgs/red/0.png\tis there a red square\tyes\nimgs/red/1.png\tno answer here\n");
    // pair-cls with 4 columns (NLVR2): "there is a <colour> square", true when either image of the
    // example shows it: each pair's fused feature can tell whether its image matches the sentence,
    // and the head must combine the two
    tsv[0] = 0;
    for (int s = 0; s < 2; s++)
        for (int c1 = 0; c1 < 3; c1++)
            for (int c2 = 0; c2 < 3; c2++)
                for (int q = 0; q < 3; q++) {
                    snprintf(line, sizeof(line), "imgs/%s/%d.png\timgs/%s/%d.png\tthere is a %s square\t%s\n",
                             COLOUR[c1], s, COLOUR[c2], (s + c1 + c2) % 4, COLOUR[q], c1 == q || c2 == q ? "true" : "false");
                    strcat(tsv, line);
                }
    put("nlvr2.tsv", tsv);
    put("bad_nlvr2.tsv", "imgs/red/0.png\timgs/red/1.png\tthe same colour\ttrue\nimgs/red/1.png\tthe same colour\tfalse\n");
    // retrieval: an OpenCLIP CSV (tab-separated) of images and captions naming their colour
    static const char *const shape[4] = {"circle", "square", "triangle", "cross"};
    strcpy(tsv, "filepath\ttitle\n");
    for (int s = 0; s < 4; s++)
        for (int c = 0; c < 3; c++) {
            snprintf(line, sizeof(line), "imgs/%s/%d.png\ta %s %s\n", COLOUR[c], s, COLOUR[c], shape[s]);
            strcat(tsv, line);
        }
    put("captions.tsv", tsv);
}

static double field(const char *key) {
    const char *p = strstr(out, key);
    return p ? atof(p + strlen(key)) : -1;
}

static void finetune(const char *task, const char *data, const char *extra, double chance, double want) {
    char args[1024];
    snprintf(args, sizeof(args), "finetune --model pre.safetensors --task %s --data %s -o %s.safetensors %s", task, data,
             task, extra);
    const int st = run(args);
    const double acc = field("train accuracy ");
    printf("%s: train accuracy %.3f (chance %.3f), held-out %.3f\n", task, acc, chance, field("held-out accuracy "));
    CHECK(st == 0 && acc >= want, "`vlmoe %s`: exit %d, train accuracy %.3f, want >= %.3f (chance %.3f):\n%s", args, st,
          acc, want, chance, out);
}

static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

// Whether every ".moe." tensor of a equals b's bit for bit; *others_changed counts the rest that differ.
static int moe_identical(vlmoe_model *a, vlmoe_model *b, int *others_changed) {
    int n, same = 1;
    const vlmoe_param_info *t = vlmoe_model_params(a, &n);
    const float *pa = vlmoe_model_param_data(a), *pb = vlmoe_model_param_data(b);
    *others_changed = 0;
    int nb;
    const vlmoe_param_info *tb = vlmoe_model_params(b, &nb);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < nb; j++) {
            if (strcmp(t[i].name, tb[j].name)) continue;
            const int eq = !memcmp(pa + t[i].offset, pb + tb[j].offset, sizeof(float) * t[i].numel);
            if (strstr(t[i].name, ".moe.")) same &= eq;
            else *others_changed += !eq;
        }
    return same;
}

// freeze_moe of TASK.safetensors.params.json: 1 true, 0 false, -1 missing or not a boolean.
static int freeze_recorded(const char *task) {
    char rel[128];
    size_t n;
    snprintf(rel, sizeof(rel), "%s.safetensors.params.json", task);
    char *text = test_read_file(P(rel), &n);
    const int v = !text ? -1 : strstr(text, "\"freeze_moe\":\ttrue") ? 1 : strstr(text, "\"freeze_moe\":\tfalse") ? 0 : -1;
    free(text);
    return v;
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_finetune");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_finetune_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    make_data();
    // a "pretrained" VL-MoE: vlmoe-tiny at random (V-MoE and T-MoE in block 1), and a CLIP model
    vlmoe_model_config cfg, clip;
    vlmoe_config_named("vlmoe-tiny", &cfg);
    vlmoe_config_named("tiny", &clip);
    vlmoe_model *pre = NULL, *c = NULL;
    CHECK(vlmoe_model_init(&pre, &cfg, 3) == VLMOE_OK && vlmoe_model_save(pre, P("pre.safetensors")) == VLMOE_OK &&
              vlmoe_model_init(&c, &clip, 3) == VLMOE_OK && vlmoe_model_save(c, P("clip.safetensors")) == VLMOE_OK,
          "models: %s", vlmoe_last_error());
    vlmoe_model_free(c);

    // no flag: routers and experts frozen, VL-MoE's default
    finetune("image-cls", "imgs", "--steps 40 --batch-size 9 --image-mean 0.5 --image-std 0.5", 1.0 / 3, 0.99);
    CHECK(strstr(out, "3 classes, 9 training and 3 held-out examples") && strstr(out, "frozen"), "split:\n%s", out);
    size_t n;
    char *labels = test_read_file(P("image-cls.safetensors.labels"), &n);
    CHECK(labels && !strcmp(labels, "blue\ngreen\nred\n"), "class names in class order: %s", labels ? labels : "(none)");
    free(labels);
    vlmoe_model *ft = NULL;
    CHECK(vlmoe_model_load(&ft, P("image-cls.safetensors")) == VLMOE_OK, "load: %s", vlmoe_last_error());
    if (ft && pre) {
        int changed;
        const int same = moe_identical(ft, pre, &changed);
        CHECK(same && changed > 0 && vlmoe_model_get_config(ft)->num_classes == 3,
              "default --freeze-moe: routers and experts unchanged (%d), %d other tensors trained", same, changed);
        printf("image-cls (frozen by default): MoE tensors bit-identical %d, %d other tensors changed\n", same, changed);
    }
    vlmoe_model_free(ft);
    CHECK(freeze_recorded("image-cls") == 1, "image-cls.safetensors.params.json records freeze_moe true");

    // --no-freeze-moe: the text experts and routers train too
    finetune("text-cls", "texts.tsv", "--steps 40 --batch-size 9 --no-freeze-moe", 1.0 / 3, 0.99);
    CHECK(!strstr(out, "frozen"), "--no-freeze-moe announces no frozen tensors:\n%s", out);
    CHECK(freeze_recorded("text-cls") == 0, "text-cls.safetensors.params.json records freeze_moe false");
    CHECK(vlmoe_model_load(&ft, P("text-cls.safetensors")) == VLMOE_OK, "load: %s", vlmoe_last_error());
    if (ft && pre) {
        int changed;
        const int same = moe_identical(ft, pre, &changed);
        CHECK(!same && changed > 0, "--no-freeze-moe: some router or expert tensor must train (identical %d)", same);
        printf("text-cls --no-freeze-moe: MoE tensors bit-identical %d, %d other tensors changed\n", same, changed);
    }
    vlmoe_model_free(ft);
    vlmoe_model_free(pre);
    finetune("pair-cls", "pairs.tsv", "--steps 60 --batch-size 12 --lr 2e-3 --holdout 0", 0.5, 0.75);
    finetune("pair-cls", "nlvr2.tsv", "--steps 80 --batch-size 18 --lr 2e-3 --holdout 0", 5.0 / 9, 0.85);
    CHECK(strstr(out, "NLVR2: two image-text pairs per example") && strstr(out, "2 classes, 54 training"),
          "NLVR2 read as 54 two-pair examples:\n%s", out);
    vlmoe_model *nl = NULL;
    CHECK(vlmoe_model_load(&nl, P("pair-cls.safetensors")) == VLMOE_OK && vlmoe_model_get_config(nl)->cls_sequences == 2,
          "the NLVR2 model keeps its two-pair head: %s", vlmoe_last_error());
    vlmoe_model_free(nl);
    // retrieval: images and captions learn to match by colour; 4 captions per colour, so R@5 and
    // not R@1 is what learning the colours buys (chance R@5 = 5/12)
    {
        const int st = run("finetune --model pre.safetensors --task retrieval --data captions.tsv -o ret.safetensors "
                           "--steps 60 --batch-size 12 --lr 2e-3 --holdout 0");
        const char *p = strstr(out, "train retrieval (12 pairs)");
        double i2t[3] = {-1, -1, -1}, t2i[3] = {-1, -1, -1};
        if (p)
            sscanf(p, "train retrieval (12 pairs): image->text R@1 %lf R@5 %lf R@10 %lf; text->image R@1 %lf R@5 %lf R@10 %lf",
                   &i2t[0], &i2t[1], &i2t[2], &t2i[0], &t2i[1], &t2i[2]);
        printf("retrieval: train R@5 image->text %.3f, text->image %.3f (chance 0.417)\n", i2t[1], t2i[1]);
        CHECK(st == 0 && i2t[1] >= 0.9 && t2i[1] >= 0.9, "retrieval fine-tuning: exit %d, R@5 %.3f / %.3f:\n%s", st,
              i2t[1], t2i[1], out);
        vlmoe_model *rm = NULL;
        CHECK(vlmoe_model_load(&rm, P("ret.safetensors")) == VLMOE_OK && vlmoe_model_get_config(rm)->retrieval_head == 1,
              "the retrieval model has its head: %s", vlmoe_last_error());
        vlmoe_model_free(rm);
    }
    // a model with a retrieval head serves the contrastive commands: eval --val-data, embed
    expect("eval --model ret.safetensors --val-data captions.tsv", 0, "retrieval on captions.tsv");
    expect("embed --model ret.safetensors --images imgs -o emb.safetensors", 0, "image_embeds (12, 64)");
    expect("embed --model pre.safetensors --images imgs -o emb.safetensors", 1, "without a retrieval head");

    expect("finetune --model pre.safetensors --task pair-cls --data bad_pairs.tsv -o x.safetensors", 1,
           "bad_pairs.tsv:2: expected 3 non-empty tab-separated columns (image path, question, answer), found 2");
    expect("finetune --model pre.safetensors --task pair-cls --data texts.tsv -o x.safetensors", 1, "texts.tsv:1: expected 3");
    // a FIFO as the table: refused at once (a blocking open would wait for a writer forever)
    char fifo[160];
    snprintf(fifo, sizeof(fifo), "%s/fifo.tsv", dir);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
    expect("finetune --model pre.safetensors --task text-cls --data fifo.tsv -o x.safetensors", 1,
           "fifo.tsv: cannot open the data file: not a regular file (a FIFO)");
    expect("finetune --model clip.safetensors --task text-cls --data texts.tsv -o x.safetensors", 1, "not a VL-MoE");
    expect("finetune --model pre.safetensors --task retrieval --data texts.tsv -o x.safetensors", 1, "filepath");
    expect("finetune --model pre.safetensors --task pair-cls --data bad_nlvr2.tsv -o x.safetensors", 1,
           "bad_nlvr2.tsv:2: expected 4 non-empty tab-separated columns (image 1, image 2, sentence, label), found 3");
    expect("finetune --model pre.safetensors --task captioning --data texts.tsv -o x.safetensors", 1,
           "expected image-cls, text-cls, pair-cls, retrieval or caption");
    expect("finetune --model pre.safetensors --task text-cls -o x.safetensors", 1, "required");
    expect("finetune --model pre.safetensors --task image-cls --data imgs --image-mean 0.5,0.5 -o x.safetensors", 1,
           "--image-mean expects R,G,B");
    expect("finetune --model pre.safetensors --task text-cls --data texts.tsv --freeze-moe --no-freeze-moe -o x.safetensors",
           1, "--freeze-moe and --no-freeze-moe contradict");
    put("one.tsv", "a red circle\tred\nthe red square\tred\n");
    expect("finetune --model pre.safetensors --task text-cls --data one.tsv -o x.safetensors", 1, "1 class");
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
    return test_summary("test_finetune");
}
