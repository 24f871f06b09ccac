// test_eval_data.c: `vlmoe eval --zeroshot-data DIR --val-data FILE.csv` (cli/eval.c) on data made
// here: an image folder of solid-colour PNG and JPEG images (one corrupt file) and an OpenCLIP
// CSV (two captions per image, a missing and a corrupt image). A hand-set model whose image and
// text embeddings are the colour must score 100% everywhere; a random model with a trained BPE
// vocabulary must give exactly the numbers computed here through the library on the same
// features; bad paths and a missing tokenizer fail with a message. Runs $VLMOE_BIN(_ASAN).
#include <cjson/cJSON.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "data/image.h"
#include "data/readers.h"
#include "test.h"
#include "test_jpeg.h"
#include "tok/tok.h"
#include "vlmoe.h"

enum { NCLS = 3, PER_CLASS = 12, BATCH = 64 };
static const char *const CLASS_DIRS[NCLS] = {"blue_triangle", "green_square", "red_circle"};   // sorted
static const uint8_t COLOURS[NCLS][3] = {{20, 30, 230}, {25, 220, 35}, {235, 15, 25}};
static const char *const CAPTIONS[NCLS][2] = {{"a blue triangle", "a photo of something blue"},
                                              {"a green square", "a green thing on a table"},
                                              {"a red circle", "red paint"}};
static const char *bin;
static char dir[64], out[1 << 16];

static const char *P(const char *rel) { return test_path(dir, rel); }
static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }

// Runs `vlmoe ARGS` in dir; stdout in `out`, stderr appended when fold; the exit status.
static int run(const char *args, int fold) { return test_run_in(dir, bin, args, fold, out, sizeof(out)); }

// Image i of class c: solid colour, a little different per image; PNG for even i, JPEG for odd.
static void image_path(int c, int i, char *buf, size_t cap) {
    snprintf(buf, cap, "zs/%s/%02d.%s", CLASS_DIRS[c], i, i % 2 ? "jpg" : "png");
}

static void write_image(int c, int i) {
    const int w = 24 + 4 * (i % 3), h = 20 + 2 * (i % 4);
    uint8_t *px = malloc((size_t)w * h * 3);
    for (int k = 0; k < w * h; k++)
        for (int ch = 0; ch < 3; ch++) {
            const int v = COLOURS[c][ch];
            px[3 * k + ch] = (uint8_t)(v > 128 ? v - 2 * i : v + 2 * i);
        }
    char rel[128];
    image_path(c, i, rel, sizeof(rel));
    CHECK(test_write_rgb(P(rel), px, w, h, i % 2), "write %s", rel);
    free(px);
}

static void make_data(void) {
    mkdir(P("zs"), 0755);
    for (int c = 0; c < NCLS; c++) {
        char rel[128];
        snprintf(rel, sizeof(rel), "zs/%s", CLASS_DIRS[c]);
        mkdir(P(rel), 0755);
        for (int i = 0; i < PER_CLASS; i++) write_image(c, i);
    }
    put("zs/green_square/99_bad.jpg", "\xff\xd8\xff\xe0 not really a JPEG");
    // two captions for image 0 of each class, then a missing and a corrupt image
    char csv[4096];
    size_t o = (size_t)snprintf(csv, sizeof(csv), "filepath,title\n");
    for (int c = 0; c < NCLS; c++)
        for (int k = 0; k < 2; k++) {
            char rel[128];
            image_path(c, 0, rel, sizeof(rel));
            o += (size_t)snprintf(csv + o, sizeof(csv) - o, "%s,%s\n", rel, CAPTIONS[c][k]);
        }
    snprintf(csv + o, sizeof(csv) - o, "zs/nowhere.png,a lost image\nzs/green_square/99_bad.jpg,a broken image\n");
    put("val.csv", csv);
}

static int32_t word_id(const char *w) {
    vlmoe_synth *s;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    int32_t ids[4] = {0};
    if (vlmoe_synth_init(&s, &sp) == VLMOE_OK) vlmoe_synth_tokenize(s, w, ids, 4);
    vlmoe_synth_free(s);
    return ids[1];
}

static float *param(vlmoe_model *m, const char *name) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return vlmoe_model_param_data(m) + t[i].offset;
    CHECK(0, "no parameter %s", name);
    return NULL;
}

// The "tiny" model with every block's output zeroed (the residual stream carries the embeddings
// through), patches embedded as their mean R, G, B in dims 0-2, the words red, green and blue
// embedded as dims 0, 1, 2, and both projections keeping dims 0-2: an image embedding points at
// its colour, a text embedding at the colour word it holds.
static void save_colour_model(const char *path) {
    vlmoe_model_config cfg;
    vlmoe_config_named("tiny", &cfg);
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &cfg, 0) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!m) return;
    memset(vlmoe_model_param_data(m), 0, sizeof(float) * vlmoe_model_num_floats(m));
    const int D = cfg.encoder.width, pp = cfg.patch_size * cfg.patch_size;
    float *lnf = param(m, "encoder.ln_final.weight"), *pe = param(m, "image.patch_embed.weight");
    float *te = param(m, "text.token_embed"), *ip = param(m, "image.proj"), *tp = param(m, "text.proj");
    if (!lnf || !pe || !te || !ip || !tp) {
        vlmoe_model_free(m);
        return;
    }
    for (int d = 0; d < D; d++) lnf[d] = 1;
    const char *words[3] = {"red", "green", "blue"};
    for (int ch = 0; ch < 3; ch++) {
        for (int k = 0; k < pp; k++) pe[(size_t)ch * 3 * pp + (size_t)ch * pp + k] = 1.0f / pp;   // (D, 3, P, P)
        te[(size_t)word_id(words[ch]) * D + ch] = 1;
        ip[(size_t)ch * D + ch] = tp[(size_t)ch * D + ch] = 1;
    }
    CHECK(vlmoe_model_save(m, P(path)) == VLMOE_OK, "save: %s", vlmoe_last_error());
    vlmoe_model_free(m);
}

static cJSON *read_json(const char *rel) {
    char *t = test_read_file(P(rel), NULL);
    cJSON *j = t ? cJSON_Parse(t) : NULL;
    CHECK(j != NULL, "%s: missing or not JSON", rel);
    free(t);
    return j;
}

static double num(const cJSON *o, const char *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(cJSON_GetObjectItem(o, obj), key);
    CHECK(cJSON_IsNumber(v), "JSON lacks %s.%s", obj, key);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

static cJSON *eval_json(const char *args) {
    int st = run(args, 0);
    CHECK(st == 0, "`vlmoe %s` exit %d:\n%s", args, st, out);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL, "output is not JSON:\n%s", out);
    static const char *const fields[][2] = {
        {"zeroshot", "top1"}, {"zeroshot", "top5"}, {"fewshot", "accuracy"}, {"retrieval", "i2t_R@1"},
        {"retrieval", "i2t_R@5"}, {"retrieval", "i2t_R@10"}, {"retrieval", "t2i_R@1"}, {"retrieval", "t2i_R@5"},
        {"retrieval", "t2i_R@10"}, {"contrastive", "accuracy"}};
    for (size_t i = 0; j && i < sizeof(fields) / sizeof(fields[0]); i++) {
        double v = num(j, fields[i][0], fields[i][1]);
        CHECK(v >= 0 && v <= 1, "%s.%s = %g not in [0, 1]", fields[i][0], fields[i][1], v);
    }
    if (j) {
        CHECK(num(j, "zeroshot", "images") == NCLS * PER_CLASS, "images %g", num(j, "zeroshot", "images"));
        CHECK(num(j, "zeroshot", "bad_images") == 1, "bad_images %g", num(j, "zeroshot", "bad_images"));
        CHECK(num(j, "retrieval", "images") == NCLS, "retrieval images %g (same file = one image)",
              num(j, "retrieval", "images"));
        CHECK(num(j, "retrieval", "captions") == 2 * NCLS, "captions %g", num(j, "retrieval", "captions"));
        CHECK(num(j, "retrieval", "bad_samples") == 2, "bad_samples %g", num(j, "retrieval", "bad_samples"));
    }
    return j;
}

// Embeddings (n, E) of image files, preprocessed as vlmoe eval does (CLIP normalisation).
static void embed_files(vlmoe_model *m, char **paths, int n, float *emb) {
    const int S = vlmoe_model_get_config(m)->image_size;
    vlmoe_image_params ip = vlmoe_image_default_params();
    ip.size = S;
    float *x = malloc(sizeof(float) * 3 * S * S * (size_t)n);
    vlmoe_image img = {0};
    for (int i = 0; i < n; i++)
        CHECK(vlmoe_image_load(paths[i], &img) == VLMOE_OK &&
                  vlmoe_image_preprocess_eval(&img, &ip, x + (size_t)i * 3 * S * S) == VLMOE_OK,
              "%s", vlmoe_last_error());
    CHECK(vlmoe_model_encode_images(m, x, n, emb) == VLMOE_OK, "encode: %s", vlmoe_last_error());
    vlmoe_image_free(&img);
    free(x);
}

static double dot(const float *a, const float *b, int E) {
    double s = 0;
    for (int e = 0; e < E; e++) s += (double)a[e] * b[e];
    return s;
}

// Fraction of queries q whose positive (the first, or any, of pos(q)) beats every negative
// within the top k, ties counted against it: brute force, independent of vlmoe_retrieval_recall.
static double recall(const float *q, int nq, const float *c, int nc, int E, const int32_t *owner, int i2t, int k) {
    int hits = 0;
    for (int i = 0; i < nq; i++) {
        double best = -1e30;
        for (int j = 0; j < nc; j++)
            if (i2t ? owner[j] == i : j == owner[i]) best = fmax(best, dot(q + (size_t)i * E, c + (size_t)j * E, E));
        int ahead = 0;
        for (int j = 0; j < nc; j++)
            ahead += !(i2t ? owner[j] == i : j == owner[i]) && dot(q + (size_t)i * E, c + (size_t)j * E, E) >= best;
        hits += ahead < k;
    }
    return (double)hits / nq;
}

static int bpe(void *t, const char *text, int32_t *ids, int ctx) {
    int len;
    return vlmoe_tokenizer_encode(t, text, ids, ctx, &len) ? -1 : len;
}

// A random model and a BPE vocabulary trained here: the CLI's numbers must equal the ones
// computed through the library in the order the CLI runs (folder, then the CSV in one batch).
static void test_random_model(void) {
    const char *texts[] = {"a photo of a crimson disc", "a lime box on a table", "navy wedge", "a blue triangle",
                           "a green square", "a red circle", "red paint", "a photo of something blue"};
    vlmoe_tokenizer *tok = NULL;
    CHECK(vlmoe_tokenizer_train(&tok, texts, 8, 600) == VLMOE_OK &&
              vlmoe_tokenizer_save_clip(tok, P("merges.txt")) == VLMOE_OK,
          "tokenizer: %s", vlmoe_last_error());
    vlmoe_model_config cfg;
    vlmoe_config_named("tiny", &cfg);
    cfg.vocab_size = 600;
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &cfg, 7) == VLMOE_OK && vlmoe_model_save(m, P("random.safetensors")) == VLMOE_OK,
          "model: %s", vlmoe_last_error());
    const char *names[NCLS] = {"crimson disc", "lime box", "navy wedge"};
    const char *tpl[3] = {"a photo of a {}.", "{} on a table", "a blurry {}"};
    put("names.txt", "crimson disc\nlime box\r\nnavy wedge\n");
    put("tpl.txt", "a photo of a {}.\n{} on a table\n\na blurry {}\n");
    cJSON *j = eval_json("eval --model random.safetensors --tokenizer merges.txt --zeroshot-data zs "
                         "--classnames names.txt --templates tpl.txt --val-data val.csv --csv-separator , --json");
    if (!m || !tok || !j) goto done;
    CHECK(num(j, "zeroshot", "templates") == 3, "templates");

    // zero-shot: the folder's readable images in the order the CLI reads them
    const int E = cfg.embed_dim, n = NCLS * PER_CLASS;
    CHECK(E == 64 && cfg.context_length == 16, "the arrays below assume tiny's sizes");
    vlmoe_image_folder f;
    CHECK(vlmoe_image_folder_load(P("zs"), &f) == VLMOE_OK && f.n == n + 1, "folder: %s", vlmoe_last_error());
    char **paths = malloc(sizeof(char *) * n);
    int32_t labels[NCLS * PER_CLASS];
    for (int i = 0, k = 0; i < f.n && k < n; i++)
        if (!strstr(f.paths[i], "bad")) paths[k] = f.paths[i], labels[k++] = f.labels[i];
    float *ie = malloc(sizeof(float) * (size_t)n * E), ce[NCLS * 64];
    embed_files(m, paths, n, ie);
    CHECK(vlmoe_class_embeddings(m, names, NCLS, tpl, 3, bpe, tok, ce) == VLMOE_OK, "%s", vlmoe_last_error());
    int top1 = 0, hit[NCLS] = {0}, cnt[NCLS] = {0};
    for (int i = 0; i < n; i++) {
        int best = 0;
        for (int c = 1; c < NCLS; c++)
            if (dot(ie + (size_t)i * E, ce + c * E, E) > dot(ie + (size_t)i * E, ce + best * E, E)) best = c;
        top1 += best == labels[i];
        hit[labels[i]] += best == labels[i], cnt[labels[i]]++;
    }
    // CLIP_benchmark's file: acc1, acc5 null (3 classes), mean_per_class_recall = mean of the
    // classes' recalls (11 or 12 images each: not the same as acc1 in general)
    double mpcr = 0;
    for (int c = 0; c < NCLS; c++) mpcr += (double)hit[c] / cnt[c] / NCLS;
    remove(P("rand_zs.json"));
    CHECK(run("eval --model random.safetensors --tokenizer merges.txt --zeroshot-data zs --classnames names.txt "
              "--templates tpl.txt --few-shot 0 --output rand_zs.json", 1) == 0, "eval --output: %s", out);
    cJSON *cb = read_json("rand_zs.json");
    const cJSON *met = cJSON_GetObjectItem(cb, "metrics");
    CHECK(met && fabs(cJSON_GetObjectItem(met, "acc1")->valuedouble - (double)top1 / n) < 1e-12 &&
              cJSON_IsNull(cJSON_GetObjectItem(met, "acc5")) &&
              fabs(cJSON_GetObjectItem(met, "mean_per_class_recall")->valuedouble - mpcr) < 1e-12,
          "rand_zs.json metrics vs acc1 %g, mean per-class recall %g", (double)top1 / n, mpcr);
    cJSON_Delete(cb);
    CHECK(fabs(num(j, "zeroshot", "top1") - (double)top1 / n) < 1e-12, "zero-shot top-1 %g, library %g",
          num(j, "zeroshot", "top1"), (double)top1 / n);
    CHECK(num(j, "zeroshot", "top5") == 1, "3 classes: top-5 is 1");

    // retrieval: one batch of the 6 good rows (the CLI plans it for its contrastive pass)
    char *rel[NCLS];
    int32_t owner[2 * NCLS], tk[2 * NCLS * 16], lens[2 * NCLS];
    float img_e[NCLS * 64], txt_e[2 * NCLS * 64];
    for (int c = 0; c < NCLS; c++) {
        char r0[128];
        image_path(c, 0, r0, sizeof(r0));
        rel[c] = strdup(P(r0));
        for (int k = 0; k < 2; k++) {
            owner[2 * c + k] = c;
            lens[2 * c + k] = bpe(tok, CAPTIONS[c][k], tk + (2 * c + k) * 16, 16);
            CHECK(lens[2 * c + k] >= 2, "encode %s", CAPTIONS[c][k]);
        }
    }
    CHECK(vlmoe_model_plan(m, 2 * NCLS) == VLMOE_OK, "plan");
    float rows[2 * NCLS * 64];
    char *row_paths[2 * NCLS];
    for (int r = 0; r < 2 * NCLS; r++) row_paths[r] = rel[r / 2];
    embed_files(m, row_paths, 2 * NCLS, rows);
    for (int c = 0; c < NCLS; c++) memcpy(img_e + c * E, rows + 2 * c * E, sizeof(float) * E);
    CHECK(vlmoe_model_encode_texts(m, tk, lens, 2 * NCLS, txt_e) == VLMOE_OK, "%s", vlmoe_last_error());
    const int ks[3] = {1, 5, 10};
    for (int q = 0; q < 3; q++) {
        char k1[16], k2[16];
        snprintf(k1, sizeof(k1), "i2t_R@%d", ks[q]);
        snprintf(k2, sizeof(k2), "t2i_R@%d", ks[q]);
        double a = recall(img_e, NCLS, txt_e, 2 * NCLS, E, owner, 1, ks[q]);
        double b = recall(txt_e, 2 * NCLS, img_e, NCLS, E, owner, 0, ks[q]);
        CHECK(fabs(num(j, "retrieval", k1) - a) < 1e-12, "%s: CLI %g, here %g", k1, num(j, "retrieval", k1), a);
        CHECK(fabs(num(j, "retrieval", k2) - b) < 1e-12, "%s: CLI %g, here %g", k2, num(j, "retrieval", k2), b);
    }
    for (int c = 0; c < NCLS; c++) free(rel[c]);
    free(paths), free(ie);
    vlmoe_image_folder_free(&f);
done:
    cJSON_Delete(j);
    vlmoe_model_free(m);
    vlmoe_tokenizer_free(tok);
}

static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

static const char *str(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsString(v) ? v->valuestring : "(missing)";
}

// CLIP_benchmark's results files, worked by hand on the colour model. Retrieval: val_dup.csv has
// the blue images 00 and 01 both captioned "blue" (one text under two images), green 00 "green",
// red 00 "red". Counting the repeated caption for both blue images, every query's first result is
// right: all recalls 1, all mean and median ranks 1. (Before, each blue image's other "blue"
// caption tied with its own and was counted ahead: text_retrieval_recall@1 was 0.5.)
// CLIP_benchmark's names: image_retrieval = text queries, text_retrieval = image queries.
// Zero-shot: acc1 1, mean_per_class_recall 1, acc5 null (3 classes).
static void test_clip_benchmark_output(void) {
    put("val_dup.csv", "filepath,title\nzs/blue_triangle/00.png,blue\nzs/blue_triangle/01.jpg,blue\n"
                       "zs/green_square/00.png,green\nzs/red_circle/00.png,red\n");
    remove(P("rt.json")), remove(P("zs.json"));
    int st = run("eval --model colour.safetensors --val-data val_dup.csv --csv-separator , --output rt.json", 1);
    CHECK(st == 0 && strstr(out, "1 caption repeats an earlier one's text") && strstr(out, "image->text 1.00 / 1"),
          "eval --output rt.json: exit %d:\n%s", st, out);
    cJSON *j = read_json("rt.json");
    const cJSON *m = cJSON_GetObjectItem(j, "metrics");
    CHECK(!strcmp(str(j, "dataset"), "val_dup.csv") && !strcmp(str(j, "model"), "tiny") &&
              !strcmp(str(j, "pretrained"), "colour.safetensors") && !strcmp(str(j, "task"), "zeroshot_retrieval"),
          "rt.json header: dataset %s model %s pretrained %s task %s", str(j, "dataset"), str(j, "model"),
          str(j, "pretrained"), str(j, "task"));
    static const char *const keys[] = {
        "image_retrieval_recall@1", "image_retrieval_recall@5", "image_retrieval_recall@10", "text_retrieval_recall@1",
        "text_retrieval_recall@5", "text_retrieval_recall@10", "image_to_text_mean_rank", "image_to_text_median_rank",
        "text_to_image_mean_rank", "text_to_image_median_rank"};
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
        const cJSON *v = cJSON_GetObjectItem(m, keys[k]);
        CHECK(cJSON_IsNumber(v) && v->valuedouble == 1, "rt.json metrics.%s = %g, worked by hand: 1", keys[k],
              cJSON_IsNumber(v) ? v->valuedouble : -1);
    }
    CHECK(cJSON_GetArraySize(m) == 10, "rt.json: %d metrics, expected the 10 above", cJSON_GetArraySize(m));
    cJSON_Delete(j);

    st = run("eval --model colour.safetensors --zeroshot-data zs --few-shot 0 --output zs.json", 1);
    CHECK(st == 0 && !strstr(out, "top-5") && strstr(out, "mean per-class recall 100.0%"),
          "3 classes: no top-5 in the text, mean per-class recall: exit %d\n%s", st, out);
    j = read_json("zs.json");
    m = cJSON_GetObjectItem(j, "metrics");
    CHECK(!strcmp(str(j, "task"), "zeroshot_classification") && !strcmp(str(j, "dataset"), "zs") &&
              cJSON_IsNumber(cJSON_GetObjectItem(m, "acc1")) && cJSON_GetObjectItem(m, "acc1")->valuedouble == 1 &&
              cJSON_IsNull(cJSON_GetObjectItem(m, "acc5")) &&
              cJSON_GetObjectItem(m, "mean_per_class_recall")->valuedouble == 1,
          "zs.json: task %s, acc1/acc5/mean_per_class_recall", str(j, "task"));
    cJSON_Delete(j);

    // never overwritten; one task per file
    expect("eval --model colour.safetensors --zeroshot-data zs --output zs.json", 1, "--output zs.json exists");
    expect("eval --model colour.safetensors --zeroshot-data zs --val-data val.csv --csv-separator , --output x.json", 1,
           "run eval twice");
    expect("eval --model colour.safetensors --output x.json", 1, "--output x.json holds one CLIP_benchmark task");
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_eval_data");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_evaldata_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    make_data();

    // The colour model classifies, probes and retrieves perfectly; duplicate rows of one image
    // must count as one image (copies would tie and fail every R@1).
    save_colour_model("colour.safetensors");
    cJSON *j = eval_json("eval --model colour.safetensors --zeroshot-data zs --val-data val.csv --csv-separator , "
                         "--json");
    if (j) {
        CHECK(num(j, "zeroshot", "top1") == 1, "colour model: zero-shot top-1 %g", num(j, "zeroshot", "top1"));
        CHECK(num(j, "fewshot", "accuracy") == 1, "colour model: 10-shot %g", num(j, "fewshot", "accuracy"));
        CHECK(num(j, "retrieval", "i2t_R@1") == 1 && num(j, "retrieval", "t2i_R@1") == 1,
              "colour model: R@1 %g / %g", num(j, "retrieval", "i2t_R@1"), num(j, "retrieval", "t2i_R@1"));
        CHECK(num(j, "zeroshot", "templates") == 8, "built-in templates");
        cJSON_Delete(j);
    }
    expect("eval --model colour.safetensors --zeroshot-data zs --few-shot 0", 0,
           "zero-shot on zs (3 classes, 8 prompt templates, 36 images; 1 unreadable skipped): top-1 100.0%");
    expect("eval --model colour.safetensors --zeroshot-data zs --few-shot 12", 0,
           "skipped, class 'blue triangle' has 12");
    expect("eval --model colour.safetensors --zeroshot-data zs --few-shot 0", 0, "99_bad.jpg");
    test_random_model();
    test_clip_benchmark_output();

    expect("eval --model colour.safetensors --zeroshot-data nowhere", 1, "nowhere");
    expect("eval --model random.safetensors --zeroshot-data zs", 1, "--tokenizer is needed");
    expect("eval --model colour.safetensors --val-data val.csv", 1, "no column 'filepath' (--csv-img-key)");
    expect("eval --model colour.safetensors --val-data missing.csv", 1, "missing.csv");
    put("names4.txt", "a\nb\nc\nd\n");
    expect("eval --model colour.safetensors --zeroshot-data zs --classnames names4.txt", 1, "has 4 names");
    put("nohole.txt", "a photo\n");
    expect("eval --model colour.safetensors --zeroshot-data zs --templates nohole.txt", 1, "has no {}");
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_eval_data");
}
