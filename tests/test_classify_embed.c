// test_classify_embed.c: `vlmoe classify` (cli/classify.c) and `vlmoe embed` (cli/embed.c) on
// solid-colour PNG and JPEG images written here, against the library's own outputs: embedding one
// image alone gives the same row as embedding it among a folder; classify's probabilities sum to
// 1 and equal softmax(exp(logit_scale) * cosine) computed here with vlmoe_model_encode_images and
// vlmoe_class_embeddings; embed --texts equals vlmoe_model_encode_texts; bad inputs exit non-zero
// naming the file. Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN for the sanitizer build).
#include <cjson/cJSON.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data/image.h"
#include "test.h"
#include "test_jpeg.h"
#include "tok/tok.h"
#include "vlmoe.h"

enum { NIMG = 7 };
// Sorted as `vlmoe embed` lists them: a folder's entries by name, sub-folders in place.
static const char *const FILES[NIMG] = {"imgs/a_red.png",   "imgs/b_green.jpg", "imgs/c_blue.png", "imgs/d_grey.jpg",
                                        "imgs/sub/e_yellow.png", "imgs/sub/f_cyan.jpg", "imgs/z_dark.PNG"};
static const uint8_t RGB[NIMG][3] = {{230, 20, 25}, {20, 210, 40}, {25, 30, 220}, {128, 128, 128},
                                     {220, 210, 30}, {30, 200, 210}, {15, 10, 20}};
static const char *bin;
static char dir[64], out[1 << 17];

static const char *P(const char *rel) { return test_path(dir, rel); }
static void put(const char *rel, const char *text) { test_write_file(P(rel), text, strlen(text)); }

// Runs `vlmoe ARGS` in dir; stdout in `out`, stderr appended when fold; the exit status.
static int run(const char *args, int fold) { return test_run_in(dir, bin, args, fold, out, sizeof(out)); }

static void expect(const char *args, int status, const char *needle) {
    test_expect_in(dir, bin, args, status, needle, out, sizeof(out));
}

// Image i: solid colour, sizes differing (so the resize and crop differ); PNG or JPEG by name.
static void write_image(int i) {
    const int w = 30 + 7 * i, h = 26 + 3 * (i % 4);
    uint8_t *px = malloc((size_t)w * h * 3);
    for (int k = 0; k < w * h; k++) memcpy(px + 3 * k, RGB[i], 3);
    CHECK(test_write_rgb(P(FILES[i]), px, w, h, strstr(FILES[i], ".jpg") != NULL), "write %s", FILES[i]);
    free(px);
}

static void make_data(void) {
    mkdir(P("imgs"), 0755);
    mkdir(P("imgs/sub"), 0755);
    mkdir(P("empty"), 0755);
    for (int i = 0; i < NIMG; i++) write_image(i);
    put("imgs/c_broken.jpg", "\xff\xd8\xff\xe0 not really a JPEG");   // sorts between b and c
    put("imgs/notes.txt", "not an image: not listed");
    put("texts.txt", "a red circle\nblue square on a table\n\ngreen triangle\r\nred\n");
    put("tpl.txt", "a photo of a {}.\n{} on a table\na blurry {}\n");
    put("nohole.txt", "a photo\n");
}

static float *param(vlmoe_model *m, const char *name) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return vlmoe_model_param_data(m) + t[i].offset;
    CHECK(0, "no parameter %s", name);
    return NULL;
}

// A safetensors file's tensor as floats (n_rows x E) and its metadata key, or NULL.
static float *read_rows(const char *rel, const char *name, int *rows, int E, const char *key, cJSON **meta) {
    vlmoe_st *st = NULL;
    *rows = 0;
    if (meta) *meta = NULL;
    CHECK(vlmoe_st_open(P(rel), &st) == VLMOE_OK, "open %s: %s", rel, vlmoe_last_error());
    if (!st) return NULL;
    vlmoe_tensor_info ti;
    const int idx = vlmoe_st_find(st, name);
    float *x = NULL;
    CHECK(idx >= 0, "%s lacks tensor %s", rel, name);
    if (idx >= 0 && vlmoe_st_info(st, idx, &ti) == VLMOE_OK) {
        CHECK(ti.dtype == VLMOE_DT_F32 && ti.ndim == 2 && ti.shape[1] == E, "%s: %s is not (N, %d) F32", rel, name, E);
        *rows = (int)ti.shape[0];
        x = malloc(sizeof(float) * ti.numel + 1);
        CHECK(vlmoe_st_read_f32(st, name, x, ti.numel) == VLMOE_OK, "read %s", name);
    }
    if (meta && key) {
        const char *m = vlmoe_st_metadata(st, key);
        CHECK(m != NULL, "%s: no metadata '%s'", rel, key);
        *meta = m ? cJSON_Parse(m) : NULL;
        CHECK(!m || cJSON_IsArray(*meta), "%s: metadata '%s' is not a JSON array: %s", rel, key, m);
    }
    vlmoe_st_close(st);
    return x;
}

static const char *meta_str(const char *rel, const char *key) {
    static char buf[4096];
    vlmoe_st *st = NULL;
    buf[0] = 0;
    if (vlmoe_st_open(P(rel), &st) == VLMOE_OK) {
        const char *m = vlmoe_st_metadata(st, key);
        snprintf(buf, sizeof(buf), "%s", m ? m : "");
    }
    vlmoe_st_close(st);
    return buf;
}

// Preprocessed images (n, 3, S, S) as the CLI makes them (CLIP normalisation).
static float *load_images(const char *const *rel, int n, int S) {
    vlmoe_image_params ip = vlmoe_image_default_params();
    ip.size = S;
    float *x = malloc(sizeof(float) * 3 * S * S * (size_t)n);
    vlmoe_image img = {0};
    for (int i = 0; i < n; i++)
        CHECK(vlmoe_image_load(P(rel[i]), &img) == VLMOE_OK &&
                  vlmoe_image_preprocess_eval(&img, &ip, x + (size_t)i * 3 * S * S) == VLMOE_OK,
              "%s", vlmoe_last_error());
    vlmoe_image_free(&img);
    return x;
}

static double max_diff(const float *a, const float *b, size_t n) {
    double d = 0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

// embed --images: the folder's rows are the library's batch of the same images; each image embedded
// alone gives its folder row; the bad file is skipped, counted and listed.
static void test_embed_images(const char *model, const vlmoe_model_config *cfg) {
    const int E = cfg->embed_dim;
    char args[1024];
    snprintf(args, sizeof(args), "embed --model %s --images imgs -o all.safetensors", model);
    int st = run(args, 1);
    CHECK(st == 0 && strstr(out, "7 images -> all.safetensors: image_embeds (7, 64) F32; 1 unreadable image skipped") &&
              strstr(out, "imgs/c_broken.jpg"),
          "`vlmoe %s`: exit %d:\n%s", args, st, out);
    int rows;
    cJSON *inputs = NULL, *skipped = NULL;
    float *all = read_rows("all.safetensors", "image_embeds", &rows, E, "inputs", &inputs);
    CHECK(rows == NIMG, "rows %d", rows);
    for (int i = 0; inputs && i < NIMG; i++) {
        const cJSON *v = cJSON_GetArrayItem(inputs, i);
        CHECK(cJSON_IsString(v) && !strcmp(v->valuestring, FILES[i]), "inputs[%d] = %s, want %s", i,
              cJSON_IsString(v) ? v->valuestring : "?", FILES[i]);
    }
    CHECK(cJSON_GetArraySize(inputs) == NIMG, "inputs has %d entries", cJSON_GetArraySize(inputs));
    cJSON_Delete(inputs);
    free(read_rows("all.safetensors", "image_embeds", &rows, E, "skipped", &skipped));
    CHECK(skipped && cJSON_GetArraySize(skipped) == 1 &&
              !strcmp(cJSON_GetArrayItem(skipped, 0)->valuestring, "imgs/c_broken.jpg"),
          "skipped: %s", meta_str("all.safetensors", "skipped"));
    cJSON_Delete(skipped);
    if (!all || rows != NIMG) {
        free(all);
        return;
    }
    for (int i = 0; i < NIMG; i++) {
        double nrm = 0;
        for (int e = 0; e < E; e++) nrm += (double)all[i * E + e] * all[i * E + e];
        CHECK(fabs(sqrt(nrm) - 1) < 1e-5, "row %d norm %g", i, sqrt(nrm));
    }

    // the library on the same images in one batch of 7 (the CLI plans min(n, 64) too)
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_load(&m, P(model)) == VLMOE_OK, "%s", vlmoe_last_error());
    float *x = load_images(FILES, NIMG, cfg->image_size), lib[NIMG * 64];
    CHECK(m && vlmoe_model_encode_images(m, x, NIMG, lib) == VLMOE_OK, "encode: %s", vlmoe_last_error());
    CHECK(max_diff(all, lib, (size_t)NIMG * E) == 0, "embed --images folder vs library batch: max |diff| %g",
          max_diff(all, lib, (size_t)NIMG * E));

    // a batch of one: each image alone, and two files given as a list
    for (int i = 0; i < NIMG; i += 3) {
        snprintf(args, sizeof(args), "embed --model %s --images %s -o one.safetensors", model, FILES[i]);
        st = run(args, 1);
        CHECK(st == 0 && strstr(out, "1 image -> one.safetensors"), "`vlmoe %s`: exit %d:\n%s", args, st, out);
        float *one = read_rows("one.safetensors", "image_embeds", &rows, E, NULL, NULL);
        CHECK(rows == 1, "rows %d", rows);
        if (one && rows == 1)
            CHECK(max_diff(one, all + (size_t)i * E, E) == 0, "%s alone vs in the folder: max |diff| %g", FILES[i],
                  max_diff(one, all + (size_t)i * E, E));
        free(one);
    }
    snprintf(args, sizeof(args), "embed --model %s --batch-size 2 --images %s %s %s -o list.safetensors", model,
             FILES[6], FILES[1], FILES[4]);
    st = run(args, 1);
    CHECK(st == 0, "`vlmoe %s`: exit %d:\n%s", args, st, out);
    float *list = read_rows("list.safetensors", "image_embeds", &rows, E, NULL, NULL);
    const int want[3] = {6, 1, 4};
    for (int r = 0; list && r < 3 && rows == 3; r++)
        CHECK(max_diff(list + (size_t)r * E, all + (size_t)want[r] * E, E) == 0,
              "batches of 2: row %d vs the folder's row %d: max |diff| %g", r, want[r],
              max_diff(list + (size_t)r * E, all + (size_t)want[r] * E, E));
    CHECK(rows == 3 && !strcmp(meta_str("list.safetensors", "inputs"),
                               "[\"imgs/z_dark.PNG\",\"imgs/b_green.jpg\",\"imgs/sub/e_yellow.png\"]"),
          "list inputs: %s", meta_str("list.safetensors", "inputs"));
    free(list), free(all), free(x);
    vlmoe_model_free(m);
}

// embed to .npy (by name, and --format npy under another name): numpy.load (Debian's python3-numpy)
// reads '<f4', C order, shape (4, E), and its rows are the safetensors rows bit for bit (numpy
// writes them back raw with tofile, compared here). A bad --format is refused, naming it.
static void test_embed_npy(const char *model, const float *te, int rows, int E) {
    const char *outs[2][2] = {{"t.npy", ""}, {"t_npy.bin", "--format npy"}};
    for (int k = 0; k < 2; k++) {
        char args[512], cmd[1024];
        snprintf(args, sizeof(args), "embed --model %s --texts texts.txt %s -o %s", model, outs[k][1], outs[k][0]);
        int st = run(args, 1);
        CHECK(st == 0 && strstr(out, "4 texts -> ") && strstr(out, "npy (4, 64) <f4"), "`vlmoe %s`: exit %d:\n%s",
              args, st, out);
        snprintf(cmd, sizeof(cmd), "cd %s && /usr/bin/python3 -c \"import numpy as np; a = np.load('%s'); "
                 "assert a.dtype == np.dtype('<f4') and a.flags.c_contiguous and a.shape == (4, %d), (a.dtype, a.shape); "
                 "a.tofile('back.bin'); print('npy ok')\" 2>&1", dir, outs[k][0], E);
        FILE *p = popen(cmd, "r");
        char msg[1024] = {0};
        size_t got = p ? fread(msg, 1, sizeof(msg) - 1, p) : 0;
        msg[got] = 0;
        st = p ? pclose(p) : -1;
        CHECK(st == 0 && strstr(msg, "npy ok"), "numpy.load(%s): %s", outs[k][0], msg);
        size_t n = 0;
        char *back = test_read_file(P("back.bin"), &n);
        CHECK(back && te && rows == 4 && n == sizeof(float) * 4 * (size_t)E && !memcmp(back, te, n),
              "%s: numpy's rows differ from the safetensors rows (%zu bytes)", outs[k][0], n);
        free(back);
        remove(P("back.bin"));
    }
    char args[512];
    snprintf(args, sizeof(args), "embed --model %s --texts texts.txt --format csv -o t.csv", model);
    expect(args, 1, "--format csv: expected safetensors or npy");
}

// embed --texts: rows equal vlmoe_model_encode_texts of the synthetic word tokenizer's ids; the
// metadata lists the line numbers (the blank line 3 is skipped).
static void test_embed_texts(const char *model, const vlmoe_model_config *cfg) {
    const int E = cfg->embed_dim, T = cfg->context_length;
    char args[512];
    snprintf(args, sizeof(args), "embed --model %s --texts texts.txt --batch-size 3 -o t.safetensors", model);
    int st = run(args, 1);
    CHECK(st == 0 && strstr(out, "4 texts -> t.safetensors: text_embeds (4, 64) F32"), "`vlmoe %s`: exit %d:\n%s",
          args, st, out);
    CHECK(!strcmp(meta_str("t.safetensors", "inputs"), "[1,2,4,5]"), "text inputs: %s",
          meta_str("t.safetensors", "inputs"));
    int rows;
    float *te = read_rows("t.safetensors", "text_embeds", &rows, E, NULL, NULL);
    const char *texts[4] = {"a red circle", "blue square on a table", "green triangle", "red"};
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    vlmoe_model *m = NULL;
    CHECK(vlmoe_synth_init(&s, &sp) == VLMOE_OK && vlmoe_model_load(&m, P(model)) == VLMOE_OK, "%s",
          vlmoe_last_error());
    int32_t tok[4 * 64], lens[4];
    float lib[4 * 64];
    for (int i = 0; s && i < 4; i++) lens[i] = vlmoe_synth_tokenize(s, texts[i], tok + i * T, T);
    CHECK(m && s && T <= 64 && vlmoe_model_encode_texts(m, tok, lens, 4, lib) == VLMOE_OK, "%s", vlmoe_last_error());
    if (te && rows == 4 && m && s)
        CHECK(max_diff(te, lib, (size_t)4 * E) < 1e-6, "embed --texts vs vlmoe_model_encode_texts: max |diff| %g",
              max_diff(te, lib, (size_t)4 * E));
    test_embed_npy(model, te, rows, E);
    free(te);
    vlmoe_synth_free(s);
    vlmoe_model_free(m);
}

static int synth_tok(void *s, const char *text, int32_t *ids, int ctx) { return vlmoe_synth_tokenize(s, text, ids, ctx); }

// classify --json --top 0: per image, every label's probability, sorted, summing to 1, equal to
// the softmax computed here; --top 2 in text shows two lines per image.
static void test_classify(const char *model, const vlmoe_model_config *cfg) {
    const int E = cfg->embed_dim, C = 4, n = 3;
    const char *labels[4] = {"red", "green", "blue", "grey"}, *tpl[3] = {"a photo of a {}.", "{} on a table",
                                                                          "a blurry {}"};
    const char *files[3] = {FILES[0], FILES[2], FILES[5]};
    char args[1024];
    snprintf(args, sizeof(args), "classify --model %s --image %s --image %s %s --image imgs/c_broken.jpg "
             "--labels \"red, green,blue,grey\" --templates tpl.txt --top 0 --json", model, files[0], files[1], files[2]);
    int st = run(args, 0);
    CHECK(st == 0, "`vlmoe %s`: exit %d:\n%s", args, st, out);
    cJSON *j = cJSON_Parse(out), *imgs = cJSON_GetObjectItem(j, "images");
    CHECK(cJSON_GetArraySize(imgs) == n, "JSON images: %s", out);
    CHECK(!strcmp(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "skipped"), 0)->valuestring, "imgs/c_broken.jpg"),
          "skipped: %s", out);

    // the library, in the CLI's order: class embeddings, then the images in one call
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    vlmoe_model *m = NULL;
    CHECK(vlmoe_synth_init(&s, &sp) == VLMOE_OK && vlmoe_model_load(&m, P(model)) == VLMOE_OK, "%s",
          vlmoe_last_error());
    float ce[4 * 64], ie[3 * 64], *x = load_images(files, n, cfg->image_size), *ls = m ? param(m, "logit_scale") : NULL;
    CHECK(m && s && vlmoe_class_embeddings(m, labels, C, tpl, 3, synth_tok, s, ce) == VLMOE_OK, "%s",
          vlmoe_last_error());
    CHECK(m && vlmoe_model_encode_images(m, x, n, ie) == VLMOE_OK, "%s", vlmoe_last_error());
    const double scale = ls ? exp(*ls) : 1;
    CHECK_CLOSE(cJSON_GetObjectItem(j, "temperature")->valuedouble, scale, 0, 1e-12, "temperature");
    for (int i = 0; i < n && imgs && ls; i++) {
        double logit[4], mx = -1e30, z = 0;
        for (int c = 0; c < C; c++) {
            double d = 0;
            for (int e = 0; e < E; e++) d += (double)ie[i * E + e] * ce[c * E + e];
            mx = fmax(mx, logit[c] = scale * d);
        }
        for (int c = 0; c < C; c++) z += exp(logit[c] - mx);
        const cJSON *o = cJSON_GetArrayItem(imgs, i), *top = cJSON_GetObjectItem(o, "top");
        CHECK(!strcmp(cJSON_GetObjectItem(o, "image")->valuestring, files[i]), "image %d is %s", i,
              cJSON_GetObjectItem(o, "image")->valuestring);
        CHECK(cJSON_GetArraySize(top) == C, "--top 0: %d labels", cJSON_GetArraySize(top));
        double sum = 0, prev = 2;
        for (int r = 0; r < cJSON_GetArraySize(top); r++) {
            const cJSON *l = cJSON_GetArrayItem(top, r);
            const char *name = cJSON_GetObjectItem(l, "label")->valuestring;
            const double p = cJSON_GetObjectItem(l, "prob")->valuedouble;
            int c = 0;
            while (c < C && strcmp(labels[c], name)) c++;
            CHECK(c < C, "unknown label %s", name);
            if (c < C) CHECK_CLOSE(p, exp(logit[c] - mx) / z, 1e-9, 1e-6, "probability of a label");
            CHECK(p <= prev, "%s: not sorted (%g after %g)", files[i], p, prev);
            prev = p, sum += p;
        }
        CHECK(fabs(sum - 1) < 1e-9, "%s: probabilities sum to %.12g", files[i], sum);
    }
    cJSON_Delete(j);
    free(x);
    vlmoe_synth_free(s);
    vlmoe_model_free(m);

    // text output, top 2, built-in templates, labels from a file
    put("labels.txt", "red\ngreen\n\nblue\n");
    snprintf(args, sizeof(args), "classify --model %s --image %s --labels-file labels.txt --top 2", model, FILES[0]);
    st = run(args, 1);
    int lines = 0;
    for (const char *q = out; (q = strstr(q, "%  ")); q++) lines++;
    CHECK(st == 0 && strstr(out, "imgs/a_red.png:\n") && lines == 2, "`vlmoe %s`: exit %d, %d label lines:\n%s", args,
          st, lines, out);
}

int main(int argc, char **argv) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_classify_embed");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_classify_XXXXXX");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
    make_data();

    // a random "tiny" model (vocabulary 256: the synthetic word tokenizer) and one with 600 ids
    vlmoe_model_config cfg, big;
    vlmoe_config_named("tiny", &cfg);
    big = cfg;
    big.vocab_size = 600;
    vlmoe_model *m = NULL, *mb = NULL;
    CHECK(vlmoe_model_init(&m, &cfg, 7) == VLMOE_OK && vlmoe_model_save(m, P("tiny.safetensors")) == VLMOE_OK &&
              vlmoe_model_init(&mb, &big, 7) == VLMOE_OK && vlmoe_model_save(mb, P("big.safetensors")) == VLMOE_OK,
          "models: %s", vlmoe_last_error());
    vlmoe_model_free(m), vlmoe_model_free(mb);
    CHECK(cfg.embed_dim == 64 && cfg.context_length <= 64, "the arrays here assume tiny's sizes");

    test_embed_images("tiny.safetensors", &cfg);
    test_embed_texts("tiny.safetensors", &cfg);
    test_classify("tiny.safetensors", &cfg);

    // help teaches; bad input exits non-zero and names the file or flag
    expect("classify --help", 0, "examples:");
    expect("embed --help", 0, "examples:");
    expect("classify --model nowhere.safetensors --image imgs/a_red.png --labels a,b", 1, "nowhere.safetensors");
    expect("embed --model nowhere.safetensors --images imgs -o x.safetensors", 1, "nowhere.safetensors");
    expect("classify --model tiny.safetensors --image imgs/a_red.png", 1, "--labels");
    expect("classify --model tiny.safetensors --image imgs/a_red.png --labels \"red,,blue\"", 1, "label 2 of 3 is empty");
    expect("classify --model tiny.safetensors --labels red,blue", 1, "no image");
    expect("classify --model tiny.safetensors --image imgs/c_broken.jpg --labels red,blue", 1, "imgs/c_broken.jpg");
    expect("classify --model tiny.safetensors --image missing.png --labels red,blue", 1, "missing.png");
    expect("classify --model tiny.safetensors --image missing.png imgs/c_broken.jpg --labels red,blue", 1,
           "none of the 2 images could be read");
    expect("classify --model tiny.safetensors --image imgs/a_red.png --labels red --frobnicate", 2, "--frobnicate");
    expect("classify --model tiny.safetensors --image imgs/a_red.png --labels red --templates nohole.txt", 1,
           "--templates nohole.txt: template 1 ('a photo') has no {}");
    expect("classify --model tiny.safetensors --image imgs/a_red.png --labels-file nolabels.txt", 1, "nolabels.txt");
    expect("classify --model big.safetensors --image imgs/a_red.png --labels red", 1, "--tokenizer is needed");
    expect("classify --model tiny.safetensors --image", 2, "--image needs a value");
    expect("embed --model tiny.safetensors --images imgs/c_broken.jpg -o bad.safetensors", 1, "imgs/c_broken.jpg");
    CHECK(access(P("bad.safetensors"), F_OK) != 0, "a failed embed wrote its output");
    expect("embed --model tiny.safetensors --images empty -o x.safetensors", 1, "empty: a folder without image files");
    expect("embed --model tiny.safetensors --images imgs", 1, "-o OUT.safetensors is required");
    expect("embed --model tiny.safetensors --images imgs --texts texts.txt -o x.safetensors", 1, "one of them");
    expect("embed --model tiny.safetensors --texts missing.txt -o x.safetensors", 1, "missing.txt");
    expect("embed --model big.safetensors --texts texts.txt -o x.safetensors", 1, "--tokenizer is needed");
    expect("embed --model tiny.safetensors --images imgs -o x.safetensors --dtype f16", 2, "--dtype");
    expect("embed --model tiny.safetensors --images imgs -o x.safetensors stray", 2, "stray");

    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_classify_embed");
}
