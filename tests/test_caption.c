// test_caption.c: captioning as BEiT-3 does it (VL-MoE's COCO captions). The caption encoding's
// attention (VLMOE_ENC_CAPTION): image features do not depend on the text, a text position does
// not depend on later text, and an ordinary pair differs (so the checks can fail); BEiT-3's
// caption masks; greedy decoding's output shape. Then the shown run: `vlmoe synth export` writes
// images and captions, `vlmoe finetune --task caption` fine-tunes a vlmoe-tiny model for 300
// steps, and held-out CIDEr-D after must beat CIDEr-D before. Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "vlmoe.h"

static const char *bin;
static char dir[64], out[65536];

// Largest |a - b| over positions [p0, p1) of sequence s of (n, seq, D) hidden states.
static double diff(const float *a, const float *b, int seq, int D, int s, int p0, int p1) {
    double m = 0;
    for (int p = p0; p < p1; p++)
        for (int k = 0; k < D; k++) {
            const size_t i = ((size_t)s * seq + p) * D + k;
            m = fmax(m, fabs((double)a[i] - b[i]));
        }
    return m;
}

static void test_attention_mask(void) {
    vlmoe_model_config c;
    vlmoe_config_named("mome-tiny", &c); // dense: no routing couples the tokens of a stream
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &c, 5) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!m) return;
    const int T = c.context_length, Ti = vlmoe_mome_seq_len(&c, VLMOE_ENC_IMAGE), seq = Ti + T, D = c.encoder.width;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * 2), *h[2] = {NULL, NULL}, *hp[2] = {NULL, NULL};
    int32_t tok[2 * 16] = {0}, len[2] = {9, 9};
    for (size_t i = 0; i < isz; i++) img[i] = img[isz + i] = (float)sin(0.37 * (double)i); // one image twice
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 9; t++) tok[s * T + t] = t == 0 ? VLMOE_TOK_SOT : t == 8 ? VLMOE_TOK_EOT : 10 + t;
    tok[T + 5] = 77; // the second text differs at position 5 only
    for (int k = 0; k < 2; k++) {
        h[k] = malloc(sizeof(float) * 2 * seq * D);
        hp[k] = malloc(sizeof(float) * 2 * seq * D);
    }
    CHECK(vlmoe_mome_encode(m, VLMOE_ENC_CAPTION, img, tok, len, 2, h[0]) == VLMOE_OK &&
              vlmoe_mome_encode(m, VLMOE_ENC_PAIR, img, tok, len, 2, hp[0]) == VLMOE_OK,
          "encode: %s", vlmoe_last_error());
    // sequence 0 vs 1: the same image, texts differing at position 5
    const double img_c = diff(h[0], h[0] + (size_t)seq * D, seq, D, 0, 0, Ti);
    const double before_c = diff(h[0], h[0] + (size_t)seq * D, seq, D, 0, Ti, Ti + 5);
    const double at_c = diff(h[0], h[0] + (size_t)seq * D, seq, D, 0, Ti + 5, Ti + 9);
    const double img_p = diff(hp[0], hp[0] + (size_t)seq * D, seq, D, 0, 0, Ti);
    const double before_p = diff(hp[0], hp[0] + (size_t)seq * D, seq, D, 0, Ti, Ti + 5);
    printf("caption mask: image features move %.3g, text before the change %.3g, from it on %.3g; a plain pair: "
           "%.3g and %.3g\n", img_c, before_c, at_c, img_p, before_p);
    CHECK(img_c < 1e-6 && before_c < 1e-6, "caption encoding leaks later text: image %g, earlier text %g", img_c, before_c);
    CHECK(at_c > 1e-3, "the changed token and later ones must move: %g", at_c);
    CHECK(img_p > 1e-3 && before_p > 1e-3, "a plain pair attends both ways (the check can fail): %g %g", img_p, before_p);
    // greedy decoding: [T_CLS] first, [T_SEP] last, within the context, the same twice
    int32_t dt[2][2 * 16], dl[2][2];
    const vlmoe_caption_params cp = {.bos = VLMOE_TOK_SOT, .eos = VLMOE_TOK_EOT, .max_len = 6};
    for (int r = 0; r < 2; r++)
        CHECK(vlmoe_mome_caption(m, img, 2, &cp, dt[r], dl[r]) == VLMOE_OK, "caption: %s", vlmoe_last_error());
    int ok = 1;
    for (int s = 0; s < 2; s++) {
        ok &= dl[0][s] >= 2 && dl[0][s] <= 6 && dt[0][s * T] == VLMOE_TOK_SOT && dt[0][s * T + dl[0][s] - 1] == VLMOE_TOK_EOT;
        for (int t = 1; t < dl[0][s] - 1; t++) ok &= dt[0][s * T + t] != VLMOE_TOK_EOT && dt[0][s * T + t] != c.mask_token;
        for (int t = dl[0][s]; t < T; t++) ok &= dt[0][s * T + t] == 0;
    }
    CHECK(ok && !memcmp(dt[0], dt[1], sizeof(dt[0])), "decoded captions: lengths %d %d", dl[0][0], dl[0][1]);
    const vlmoe_caption_params bad = {.bos = VLMOE_TOK_SOT, .eos = VLMOE_TOK_EOT, .max_len = T + 1};
    CHECK(vlmoe_mome_caption(m, img, 2, &bad, dt[0], dl[0]) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "max_len"),
          "max_len beyond the context: %s", vlmoe_last_error());
    for (int k = 0; k < 2; k++) free(h[k]), free(hp[k]);
    free(img);
    vlmoe_model_free(m);
}

// BEiT-3's counts: round(0.6 * len) clamped to [1, len-1] positions in [1, len), [T_CLS] never.
static void test_caption_mask(void) {
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    vlmoe_mlm_params p = vlmoe_mlm_default_params(&c);
    p.prob = 0.6;
    enum { B = 4, T = 16 };
    int32_t tok[B * T], in[B * T], lab[B * T], len[B] = {2, 5, 10, 16};
    for (int i = 0; i < B * T; i++) tok[i] = 4 + i % 50;
    CHECK(vlmoe_caption_mask(&p, 3, tok, len, B, T, in, lab) == VLMOE_OK, "%s", vlmoe_last_error());
    const int want[B] = {1, 3, 6, 10};
    for (int b = 0; b < B; b++) {
        int n = 0, bad = lab[b * T] != -1;
        for (int t = 0; t < T; t++) {
            n += lab[b * T + t] >= 0;
            bad |= t >= len[b] && lab[b * T + t] != -1;
            bad |= lab[b * T + t] >= 0 && lab[b * T + t] != tok[b * T + t];
        }
        CHECK(n == want[b] && !bad, "caption %d (length %d): %d masked, want %d", b, len[b], n, want[b]);
    }
    int32_t one[1] = {1};
    CHECK(vlmoe_caption_mask(&p, 3, tok, one, 1, T, in, lab) == VLMOE_ERR_ARG, "a caption of one token is refused");
}

static double field(const char *key) {
    const char *p = strstr(out, key);
    return p ? atof(p + strlen(key)) : -1;
}

static void test_shown_run(void) {
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "synth export --out %s/shapes --n 320 --image-size 32 --seed 1", dir);
    CHECK(test_run_in(dir, bin, cmd, 1, out, sizeof(out)) == 0, "synth export:\n%s", out);
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    vlmoe_model *m = NULL;
    char pre[256];
    snprintf(pre, sizeof(pre), "%s/pre.safetensors", dir);
    CHECK(vlmoe_model_init(&m, &c, 3) == VLMOE_OK && vlmoe_model_save(m, pre) == VLMOE_OK, "model: %s", vlmoe_last_error());
    vlmoe_model_free(m);
    const char *args = "finetune --model pre.safetensors --task caption --data shapes/captions.csv -o cap.safetensors "
                       "--steps 300 --batch-size 32 --lr 2e-3 --holdout 5 --image-mean 0.5 --image-std 0.5 --log-every 100";
    const int st = test_run_in(dir, bin, args, 1, out, sizeof(out));
    const double before = field("before fine-tuning: held-out CIDEr-D "), after = field("\nheld-out CIDEr-D ");
    const double train = field("train CIDEr-D ");
    printf("shown run: vlmoe %s\n  held-out CIDEr-D before %.4f, after %.4f (train %.4f)\n", args, before, after, train);
    CHECK(st == 0 && before >= 0 && after > before + 0.5, "caption fine-tuning: exit %d, CIDEr-D %.4f -> %.4f:\n%s", st,
          before, after, out);
    const char *cap = strstr(out, "held-out CIDEr-D");
    if (cap) cap = strstr(cap + 1, "\nheld-out CIDEr-D");
    if (cap) printf("%.400s\n", cap + 1);
    // the captioner on held-out data: `vlmoe eval --caption-data` and `vlmoe caption --data` give one
    // CIDEr-D, above the untrained model's; image files are captioned one line each
    snprintf(cmd, sizeof(cmd), "synth export --out %s/val --n 40 --image-size 32 --split val", dir);
    CHECK(test_run_in(dir, bin, cmd, 1, out, sizeof(out)) == 0, "synth export val:\n%s", out);
    CHECK(test_run_in(dir, bin, "eval --model cap.safetensors --caption-data val/captions.csv", 1, out, sizeof(out)) == 0,
          "eval --caption-data:\n%s", out);
    const double ev = field("greedy decoding): CIDEr-D ");
    CHECK(test_run_in(dir, bin, "eval --model pre.safetensors --caption-data val/captions.csv --image-mean 0.5 "
                      "--image-std 0.5 --json", 1, out, sizeof(out)) == 0, "eval --json:\n%s", out);
    const double ev0 = field("\"cider_d\":");
    CHECK(test_run_in(dir, bin, "caption --model cap.safetensors --data val/captions.csv -o caps.tsv", 1, out,
                      sizeof(out)) == 0, "caption --data:\n%s", out);
    const double cv = field("CIDEr-D ");
    printf("held-out split (40 images): vlmoe eval --caption-data CIDEr-D %.4f (untrained model %.4f), vlmoe caption "
           "--data %.4f\n", ev, ev0, cv);
    CHECK(ev > ev0 + 0.5 && ev0 >= 0 && fabs(ev - cv) < 1e-4, "eval %g vs untrained %g vs caption %g", ev, ev0, cv);
    char path[256];
    snprintf(path, sizeof(path), "%s/caps.tsv", dir);
    size_t n = 0;
    char *tsv = test_read_file(path, &n);
    int lines = 0;
    for (size_t i = 0; tsv && i < n; i++) lines += tsv[i] == '\n';
    CHECK(lines == 40 && strstr(tsv, "val/classes/") && strchr(tsv, '\t'), "caps.tsv: %d lines", lines);
    free(tsv);
    test_expect_in(dir, bin, "caption --model cap.safetensors --data val/captions.csv -o caps.tsv", 1,
                   "-o caps.tsv: cannot create it", out, sizeof(out));
    tsv = test_read_file(path, &n);
    CHECK(tsv && n > 100, "an existing -o file is left as it was");
    free(tsv);
    CHECK(test_run_in(dir, bin, "caption --model cap.safetensors val/classes/red_circle", 1, out, sizeof(out)) == 0 &&
              strstr(out, "red_circle/") && strchr(out, '\t'), "caption IMAGE|DIR:\n%s", out);
    test_expect_in(dir, bin, "caption --model cap.safetensors", 1, "give --data PAIRS", out, sizeof(out));
    test_expect_in(dir, bin, "caption --model cap.safetensors --max-len 99 val/classes", 1, "--max-len 99", out,
                   sizeof(out));
    // bad input on purpose
    test_expect_in(dir, bin, "finetune --model pre.safetensors --task caption --data shapes/captions.csv -o x.safetensors "
                   "--caption-mask-prob 0", 1, "--caption-mask-prob 0: expected a fraction in (0, 1]", out, sizeof(out));
}

int main(int argc, char **argv) {
    test_attention_mask();
    test_caption_mask();
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_caption");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_caption_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    test_shown_run();
    snprintf(out, sizeof(out), "rm -rf %s", dir);
    if (system(out)) fprintf(stderr, "could not remove %s\n", dir);
    return test_summary("test_caption");
}
