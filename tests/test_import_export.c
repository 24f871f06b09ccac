// test_import_export.c: CLIPs in and out as people have them (src/io/clip_folder.c,
// clip_export.c, python/vlmoe_torch.py). tests/ref/import_export.py builds small random CLIPs in
// PyTorch and saves them as an HF folder and an OpenCLIP folder; each imports with no flags and
// matches PyTorch's float64 embeddings within 1e-5; heads that contradict a config, a bare file
// of ambiguous width, a config that contradicts the tensors and PyTorch pickles get their errors;
// HF folder -> vlmoe -> HF folder gives identical tensors and an equivalent config.json (and
// transformers / open_clip load the exports where the machine has them, else the reason is
// printed); a trained limoe-tiny exported with --to torch gives, through vlmoe_torch.py, the
// embeddings of vlmoe (library and `vlmoe embed`) within 1e-5 and the same expert per token.
// Python: $VLMOE_TEST_PYTHON, else Debian's /usr/bin/python3 (python3-torch).
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "nn/model.h"
#include "test.h"
#include "tok/tok.h"
#include "vlmoe.h"

enum { N = 5, S = 32, T = 16, E = 48 };
static char dir[64], script[4096], out[16384];
static const char *bin, *python;

// Runs the PyTorch side: `python import_export.py ARGS`; its output in `out`; the exit status.
static int py(const char *fmt, const char *a, const char *b, const char *c) {
    char args[1800], cmd[3900];
    snprintf(args, sizeof(args), fmt, a, b, c);
    snprintf(cmd, sizeof(cmd), "%.1000s %.1000s %s", python, script, args);
    return test_run_in(dir, "", cmd, 1, out, sizeof(out));
}

static const char *at(const char *rel) { return test_path(dir, rel); }

static double rel_err(const float *a, const float *b, int n) {
    double e = 0, m = 1e-30;
    for (int i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i])), m = fmax(m, fabs((double)b[i]));
    return e / m;
}

typedef struct {
    float img[N * 3 * S * S], emb[2][2][N * E]; // [hf|oc][image|text]
    int32_t tok[N * T], lens[N];
} reference;

static int load_ref(reference *r) {
    vlmoe_st *f;
    if (vlmoe_st_open(at("ref.safetensors"), &f)) return 0;
    int ok = !vlmoe_st_read_f32(f, "input.images", r->img, N * 3 * S * S);
    const char *names[2][2] = {{"hf.image_embeds", "hf.text_embeds"}, {"oc.image_embeds", "oc.text_embeds"}};
    for (int k = 0; k < 4; k++) ok = ok && !vlmoe_st_read_f32(f, names[k / 2][k % 2], r->emb[k / 2][k % 2], N * E);
    vlmoe_tensor_info ti;
    ok = ok && !vlmoe_st_info(f, vlmoe_st_find(f, "input.tokens"), &ti) && ti.nbytes == sizeof(r->tok);
    if (ok) memcpy(r->tok, ti.data, sizeof(r->tok));
    ok = ok && !vlmoe_st_info(f, vlmoe_st_find(f, "input.lens"), &ti) && ti.nbytes == sizeof(r->lens);
    if (ok) memcpy(r->lens, ti.data, sizeof(r->lens));
    vlmoe_st_close(f);
    return ok;
}

// Both folders import with no flags: heads (3 and 2, of width 32), act, tokenizer and
// normalisation from their configs; embeddings within 1e-5 of PyTorch's.
// Measured: see the printed lines (max |err| / max |ref|).
static void test_folders(const reference *r, vlmoe_model **hf) {
    const char *dirs[2] = {"hf", "oc"};
    const int act[2] = {VLMOE_ACT_GELU_TANH, VLMOE_ACT_GELU};
    const float mean[2][3] = {{0.5f, 0.4f, 0.3f}, {0.1f, 0.2f, 0.3f}};
    for (int k = 0; k < 2; k++) {
        vlmoe_model *m = NULL;
        CHECK(vlmoe_clip_import_path(&m, at(dirs[k]), NULL) == VLMOE_OK, "%s: %s", dirs[k], vlmoe_last_error());
        if (!m) continue;
        const vlmoe_model_config *c = vlmoe_model_get_config(m);
        CHECK(c->encoder.heads == 3 && c->text_encoder.heads == 2 && c->act == act[k] && c->encoder.width == 96 &&
                  c->encoder.mlp_dim == (k ? 384 : 160) && c->vocab_size == 600 && c->embed_dim == E,
              "%s: config heads %d/%d act %d", dirs[k], c->encoder.heads, c->text_encoder.heads, c->act);
        const model_inputs *in = model_get_inputs(m);
        CHECK(in->has_norm && fabsf(in->mean[0] - mean[k][0]) < 1e-7f && fabsf(in->mean[1] - mean[k][1]) < 1e-7f,
              "%s: recorded normalisation", dirs[k]);
        CHECK((in->text == MODEL_TEXT_BPE) == (k == 0), "%s: tokenizer recorded %d", dirs[k], in->text);
        float emb[2][N * E];
        CHECK(!vlmoe_model_encode_images(m, r->img, N, emb[0]) && !vlmoe_model_encode_texts(m, r->tok, r->lens, N, emb[1]),
              "%s: encode: %s", dirs[k], vlmoe_last_error());
        const double ei = rel_err(emb[0], r->emb[k][0], N * E), et = rel_err(emb[1], r->emb[k][1], N * E);
        CHECK(ei < 1e-5 && et < 1e-5, "%s: relative errors image %.3g text %.3g", dirs[k], ei, et);
        printf("import %s folder: max relative error image %.2g, text %.2g\n", dirs[k], ei, et);
        if (k == 0) *hf = m;
        else vlmoe_model_free(m);
    }
}

static cJSON *json_file(const char *path);

// The HF folder with tokenizer.json gives the same ids as with vocab.json + merges.txt, and its
// export the same vocab.json.
static void test_tokenizer_json(vlmoe_model *hf) {
    vlmoe_model *m = NULL;
    vlmoe_tokenizer *a = NULL, *b = NULL;
    CHECK(vlmoe_clip_import_path(&m, at("hf_tj"), NULL) == VLMOE_OK, "hf_tj: %s", vlmoe_last_error());
    if (!m) return;
    const char *text = "A photo of a red cat, a small dog and a Bird!";
    int32_t x[T], y[T];
    int lx = 0, ly = 0;
    CHECK(!model_tokenizer(m, NULL, &a) && a && !model_tokenizer(hf, NULL, &b) && b &&
              !vlmoe_tokenizer_encode(a, text, x, T, &lx) && !vlmoe_tokenizer_encode(b, text, y, T, &ly) && lx == ly &&
              !memcmp(x, y, sizeof(x)) && lx > 8,
          "tokenizer.json and vocab.json + merges.txt give different ids (%d, %d tokens)", lx, ly);
    vlmoe_tokenizer_free(a), vlmoe_tokenizer_free(b);
    vlmoe_export_params p = vlmoe_export_default_params();
    CHECK(vlmoe_model_export_dir(m, at("rt_tj"), &p) == VLMOE_OK, "export: %s", vlmoe_last_error());
    // ids in CLIP's layout are kept as CLIP's merges (src/tok/tok.h): the export's vocab.json is
    // the slow tokenizer's of the other folder
    cJSON *u = json_file(at("hf/vocab.json")), *v = json_file(at("rt_tj/vocab.json"));
    CHECK(u && v && cJSON_Compare(u, v, 1), "the export of the tokenizer.json folder has another vocab.json");
    cJSON_Delete(u), cJSON_Delete(v);
    vlmoe_model_free(m);
}

static void expect_fail(const char *path, const vlmoe_clip_import_params *p, int status, const char *needle) {
    vlmoe_model *m = NULL;
    const int st = vlmoe_clip_import_path(&m, path, p);
    CHECK(st == status && strstr(vlmoe_last_error(), needle) && !m, "import %s: status %d (want %d), message \"%s\" "
          "lacks \"%s\"", path, st, status, vlmoe_last_error(), needle);
    vlmoe_model_free(m);
}

static void test_errors(void) {
    vlmoe_clip_import_params p = vlmoe_clip_import_default_params();
    p.image_heads = 2;
    expect_fail(at("hf"), &p, VLMOE_ERR_ARG, "--image-heads 2 contradicts");
    p.image_heads = 3; // repeating the config is fine
    vlmoe_model *m = NULL;
    CHECK(vlmoe_clip_import_path(&m, at("hf"), &p) == VLMOE_OK, "heads as in the config: %s", vlmoe_last_error());
    vlmoe_model_free(m);
    p = vlmoe_clip_import_default_params();
    p.act = VLMOE_ACT_QUICK_GELU;
    expect_fail(at("oc"), &p, VLMOE_ERR_ARG, "--act quick_gelu contradicts");
    expect_fail(at("hf/model.safetensors"), NULL, VLMOE_ERR_CONFIG,
                "width 96 does not tell its attention heads: candidates 1 (head width 96), 2 (head width 48), 3 (head width 32)");
    expect_fail(at("model.pt"), NULL, VLMOE_ERR_FORMAT, "torch.save's zip archive holding data.pkl");
    expect_fail(at("model.pt"), NULL, VLMOE_ERR_FORMAT, "save_file(");
    expect_fail(at("legacy.bin"), NULL, VLMOE_ERR_FORMAT, "legacy format (a Python pickle stream)");
    expect_fail(at("hf_bin"), NULL, VLMOE_ERR_FORMAT, "hf_bin/model.safetensors'");
    // a config whose sizes are not the tensors', and a folder with no config
    size_t n;
    char *cfg = test_read_file(at("hf/config.json"), &n), *w = cfg ? strstr(cfg, "\"hidden_size\": 96") : NULL;
    CHECK(w != NULL, "hf/config.json has no \"hidden_size\": 96");
    CHECK(mkdir(at("bad"), 0777) == 0 && mkdir(at("empty"), 0777) == 0, "mkdir");
    if (w) {
        memcpy(w, "\"hidden_size\": 80", 17);
        test_write_file(at("bad/config.json"), cfg, n);
        CHECK(symlink(at("hf/model.safetensors"), at("bad/model.safetensors")) == 0, "symlink");
        expect_fail(at("bad"), NULL, VLMOE_ERR_CONFIG, "bad/config.json says image width 80, but");
    }
    free(cfg);
    // configs that are not what they claim: each error names the file and the field
    const struct { const char *json, *needle; int status; } bad[] = {
        {"[1, 2]", "bad/config.json: not a JSON object", VLMOE_ERR_FORMAT},
        {"{\"model_type\": \"clip\", \"text_config\": {\"num_attention_heads\": \"two\"}}",
         "text_config.num_attention_heads is not a whole number", VLMOE_ERR_CONFIG},
        {"{\"vision_config\": {\"hidden_act\": \"relu\"}}", "vision_config.hidden_act \"relu\" is not an activation vlmoe has",
         VLMOE_ERR_CONFIG},
        {"{\"model_type\": \"siglip\"}", "model_type \"siglip\": vlmoe imports CLIP", VLMOE_ERR_CONFIG},
    };
    for (int k = 0; k < 4; k++) {
        test_write_file(at("bad/config.json"), bad[k].json, strlen(bad[k].json));
        expect_fail(at("bad"), NULL, bad[k].status, bad[k].needle);
    }
    const struct { const char *json, *needle; } oc[] = {
        {"{\"model_cfg\": {\"vision_cfg\": {\"timm_model_name\": \"vit_base\"}, \"text_cfg\": {}}}",
         "model_cfg.vision_cfg.timm_model_name is set: not OpenAI CLIP's vision tower"},
        {"{\"model_cfg\": {\"vision_cfg\": {}, \"text_cfg\": {}}, \"preprocess_cfg\": {\"interpolation\": \"bilinear\"}}",
         "preprocess_cfg.interpolation \"bilinear\""},
        {"{\"model_cfg\": {\"vision_cfg\": {\"image_size\": 32}, \"text_cfg\": {}}, \"preprocess_cfg\": {\"size\": [32, 40]}}",
         "preprocess_cfg.size 32 x 40 differs from vision_cfg.image_size 32"},
    };
    for (int k = 0; k < 3; k++) {
        test_write_file(at("empty/open_clip_config.json"), oc[k].json, strlen(oc[k].json));
        expect_fail(at("empty"), NULL, VLMOE_ERR_CONFIG, oc[k].needle);
    }
    remove(at("empty/open_clip_config.json"));
    expect_fail(at("empty"), NULL, VLMOE_ERR_CONFIG, "without config.json (Hugging Face CLIP) or open_clip_config.json");
}

// The tensors of two safetensors files: the same names, dtypes, shapes and bytes.
static int same_tensors(const char *a, const char *b) {
    vlmoe_st *fa = NULL, *fb = NULL;
    int same = !vlmoe_st_open(a, &fa) && !vlmoe_st_open(b, &fb) && vlmoe_st_count(fa) == vlmoe_st_count(fb);
    for (int i = 0; same && i < vlmoe_st_count(fa); i++) {
        vlmoe_tensor_info x, y;
        vlmoe_st_info(fa, i, &x);
        const int j = vlmoe_st_find(fb, x.name);
        same = j >= 0 && !vlmoe_st_info(fb, j, &y) && x.dtype == y.dtype && x.ndim == y.ndim &&
               !memcmp(x.shape, y.shape, sizeof(int64_t) * (size_t)x.ndim) && x.nbytes == y.nbytes &&
               !memcmp(x.data, y.data, x.nbytes);
        if (!same) printf("tensor %s differs between %s and %s\n", x.name, a, b);
    }
    vlmoe_st_close(fa), vlmoe_st_close(fb);
    return same;
}

static cJSON *json_file(const char *path) {
    char *t = test_read_file(path, NULL);
    cJSON *o = t ? cJSON_Parse(t) : NULL;
    free(t);
    return o;
}

// Every key of the original's config (top level, text_config, vision_config) has the same value
// in the export's.
static int same_config(const cJSON *a, const cJSON *b, const char *where) {
    int ok = 1;
    for (const cJSON *k = a->child; k; k = k->next) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(b, k->string);
        if (cJSON_IsObject(k)) ok &= v && same_config(k, v, k->string);
        else if (!v || !cJSON_Compare(k, v, 1)) ok = 0, printf("config.json: %s.%s differs\n", where, k->string);
    }
    return ok;
}

static void test_round_trip(vlmoe_model *m) {
    vlmoe_export_params p = vlmoe_export_default_params();
    CHECK(vlmoe_model_export_dir(m, at("rt"), &p) == VLMOE_OK, "export hf: %s", vlmoe_last_error());
    CHECK(same_tensors(at("hf/model.safetensors"), at("rt/model.safetensors")), "round trip: tensors differ");
    cJSON *a = json_file(at("hf/config.json")), *b = json_file(at("rt/config.json"));
    CHECK(a && b && same_config(a, b, "config"), "round trip: config.json is not equivalent");
    cJSON_Delete(a), cJSON_Delete(b);
    a = json_file(at("hf/vocab.json")), b = json_file(at("rt/vocab.json"));
    CHECK(a && b && cJSON_Compare(a, b, 1), "round trip: vocab.json differs");
    cJSON_Delete(a), cJSON_Delete(b);
    char *x = test_read_file(at("hf/merges.txt"), NULL), *y = test_read_file(at("rt/merges.txt"), NULL);
    CHECK(x && y && !strcmp(x, y), "round trip: merges.txt differs");
    free(x), free(y);
    a = json_file(at("hf/preprocessor_config.json")), b = json_file(at("rt/preprocessor_config.json"));
    const char *keys[] = {"image_mean", "image_std", "resample", "size", "crop_size", "do_center_crop"};
    for (int k = 0; k < 6; k++)
        CHECK(a && b && cJSON_Compare(cJSON_GetObjectItem(a, keys[k]), cJSON_GetObjectItem(b, keys[k]), 1),
              "round trip: preprocessor_config.json %s differs", keys[k]);
    cJSON_Delete(a), cJSON_Delete(b);
    printf("round trip HF folder -> vlmoe -> HF folder: identical tensors, equivalent config.json\n");
    // never into someone's files; one_tower and MoE models have no CLIP names
    CHECK(vlmoe_model_export_dir(m, at("hf"), &p) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), "not empty"),
          "export into a non-empty folder: %s", vlmoe_last_error());
    p.to = "torch";
    CHECK(vlmoe_model_export_dir(m, at("t0"), &p) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "vlmoe_torch.py"),
          "torch without the module: %s", vlmoe_last_error());
    p.to = "onnx";
    CHECK(vlmoe_model_export_dir(m, at("t1"), &p) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "hf, open_clip or torch"),
          "--to onnx: %s", vlmoe_last_error());
}

// Where the ecosystem's packages are installed, they load the exports; otherwise the reason.
static void test_ecosystem(void) {
    char args[1100];
    snprintf(args, sizeof(args), "import %s -o hf.vlmoe.safetensors", at("hf"));
    CHECK(test_run_in(dir, bin, args, 1, out, sizeof(out)) == 0, "vlmoe %s:\n%s", args, out);
    snprintf(args, sizeof(args), "import %s -o oc.vlmoe.safetensors", at("oc"));
    CHECK(test_run_in(dir, bin, args, 1, out, sizeof(out)) == 0, "vlmoe %s:\n%s", args, out);
    CHECK(test_run_in(dir, bin, "export --model hf.vlmoe.safetensors --to hf hf_out", 1, out, sizeof(out)) == 0, "%s", out);
    CHECK(test_run_in(dir, bin, "export --model oc.vlmoe.safetensors --to open_clip oc_out", 1, out, sizeof(out)) == 0, "%s", out);
    test_expect_in(dir, bin, "export --model hf.vlmoe.safetensors --to hf hf_out", 1, "not empty", out, sizeof(out));
    test_write_file(at("hf_out/notes.txt"), "mine", 4);
    test_expect_in(dir, bin, "export --model hf.vlmoe.safetensors --to hf hf_out --force", 0, "exported", out, sizeof(out));
    char *notes = test_read_file(at("hf_out/notes.txt"), NULL);
    CHECK(notes && !strcmp(notes, "mine"), "--force touched a file export does not write");
    free(notes);
    test_expect_in(dir, bin, "export --model hf.vlmoe.safetensors --to open_clip x_out", 1, "gelu_tanh", out, sizeof(out));
    const char *what[2][2] = {{"transformers", "hf_out"}, {"open_clip", "oc_out"}};
    for (int k = 0; k < 2; k++) {
        const int st = py("%s %s %s", what[k][0], at(what[k][1]), at("ref.safetensors"));
        if (st == 77) {
            printf("%s check skipped: %s", what[k][0], strstr(out, "SKIP") ? strstr(out, "SKIP") : out);
            continue;
        }
        CHECK(st == 0, "%s could not load the export or differs:\n%s", what[k][0], out);
        printf("%s", out);
        if (k == 0) { // CLIPProcessor's tokenizer gives vlmoe's ids
            vlmoe_model *m = NULL;
            vlmoe_tokenizer *tok = NULL;
            int32_t ids[T], len = 0;
            char want[256] = "ids [";
            CHECK(!vlmoe_model_load(&m, at("hf.vlmoe.safetensors")) && !model_tokenizer(m, NULL, &tok) && tok &&
                      !vlmoe_tokenizer_encode(tok, "a photo of a cat", ids, T, &len), "tokenizer: %s", vlmoe_last_error());
            for (int i = 0; i < len; i++)
                snprintf(want + strlen(want), sizeof(want) - strlen(want), "%s%d", i ? ", " : "", ids[i]);
            strcat(want, "]");
            CHECK(len > 2 && strstr(out, want), "CLIPProcessor's ids differ from vlmoe's %s:\n%s", want, out);
            vlmoe_tokenizer_free(tok);
            vlmoe_model_free(m);
        }
    }
}

// Reads tensor `name` of file path (n floats) into dst; 0 if it cannot.
static int read_f32(const char *path, const char *name, float *dst, size_t n) {
    vlmoe_st *f;
    if (vlmoe_st_open(path, &f)) return 0;
    const int ok = !vlmoe_st_read_f32(f, name, dst, n);
    vlmoe_st_close(f);
    return ok;
}

// Layer l's rank-0 expert of every token of the last forward's first `keep` examples (-1 where
// dropped) against vlmoe_torch's rows first..first+keep of `name` (examples, tokens per example).
// -1 if the comparison cannot be made.
static int routing_mismatches(const vlmoe_model *m, int l, const char *path, const char *name, int first, int keep) {
    int n = 0, bad = 0, seen = 0;
    vlmoe_st *f = NULL;
    vlmoe_tensor_info ti;
    if (vlmoe_model_routing(m, l, NULL, 0, &n) || vlmoe_st_open(path, &f) || vlmoe_st_info(f, vlmoe_st_find(f, name), &ti) ||
        ti.dtype != VLMOE_DT_I32 || ti.ndim != 2) {
        vlmoe_st_close(f);
        return -1;
    }
    const int per = (int)ti.shape[1];
    vlmoe_token_route *r = malloc(sizeof(*r) * (size_t)n);
    vlmoe_model_routing(m, l, r, n, &n);
    const int32_t *want = ti.data;
    for (int i = 0; i < n; i++) {
        if (r[i].rank != 0 || r[i].example >= keep || r[i].position >= per) continue;
        seen++;
        bad += (r[i].dropped ? -1 : r[i].expert) != want[(size_t)(first + r[i].example) * per + r[i].position];
    }
    free(r);
    vlmoe_st_close(f);
    return seen == keep * per ? bad : -1;
}

// The MoE layers the last encoding ran, in order, against vlmoe_torch's `what`_routing.K; returns
// how many were compared (each a check).
static int compare_routing(const vlmoe_model *m, const char *model, const char *what, int first, int keep) {
    int layers = 0, k = 0;
    const vlmoe_moe_stats *stats = vlmoe_model_moe_stats(m, &layers);
    for (int l = 0; l < layers; l++) {
        if (stats[l].tokens[0] + stats[l].tokens[1] == 0) continue; // the other tower's layer
        char name[64];
        snprintf(name, sizeof(name), "%s_routing.%d", what, k++);
        const int bad = routing_mismatches(m, l, at("torch_out.safetensors"), name, first, keep);
        CHECK(bad == 0, "%s MoE layer %d: %d %s tokens routed to other experts than vlmoe's", model, l, bad, what);
    }
    return k;
}

// A trained MoE model through `vlmoe export --to torch` and vlmoe_torch.py: 7 inputs in batches of
// 4, so the last batch is filled up as vlmoe does; routing compared on that batch (not for Soft
// MoE, which has no per-token decision).
static void test_torch(const char *model, int soft) {
    enum { n = 7, B = 4 };
    char args[512], ckpt[128];
    snprintf(args, sizeof(args), "train --model %s --steps 3 --batch-size 8 --eval-samples 0 --logs runs --name %s", model, model);
    test_expect_in(dir, bin, args, 0, "trained to step 3", out, sizeof(out));
    snprintf(ckpt, sizeof(ckpt), "runs/%s/checkpoints/step_3.safetensors", model);
    snprintf(args, sizeof(args), "export --model %s --to torch tdir_%s", ckpt, model);
    test_expect_in(dir, bin, args, 0, "exported", out, sizeof(out));
    vlmoe_model *m = NULL;
    vlmoe_synth *s = NULL;
    const vlmoe_synth_params sp = vlmoe_synth_default_params();
    CHECK(!vlmoe_model_load(&m, at(ckpt)) && !vlmoe_synth_init(&s, &sp), "load: %s", vlmoe_last_error());
    if (!m || !s) {
        vlmoe_model_free(m), vlmoe_synth_free(s);
        return;
    }
    const int D = vlmoe_model_get_config(m)->embed_dim;
    static float img[n * 3 * 32 * 32], emb[2][n * 64], ref[2][n * 64], cli[n * 64];
    int32_t tok[n * T], lens[n], cls, bs = B;
    char caps[n][128], texts[n * 130] = "";
    for (int i = 0; i < n; i++) {
        vlmoe_synth_sample(s, 1, (uint64_t)i, img + (size_t)i * 3 * 32 * 32, caps[i], sizeof(caps[i]), &cls);
        lens[i] = vlmoe_synth_tokenize(s, caps[i], tok + i * T, T);
        strcat(strcat(texts, caps[i]), "\n");
    }
    vlmoe_synth_free(s);
    test_write_file(at("captions.txt"), texts, strlen(texts));
    vlmoe_st_writer *w;
    const int64_t si[4] = {n, 3, 32, 32}, st[2] = {n, T}, one = 1;
    CHECK(D <= 64 && !vlmoe_st_writer_init(&w) && !vlmoe_st_writer_add_f32(w, "images", VLMOE_DT_F32, 4, si, img) &&
              !vlmoe_st_writer_add_raw(w, "tokens", VLMOE_DT_I32, 2, st, tok) &&
              !vlmoe_st_writer_add_raw(w, "lens", VLMOE_DT_I32, 1, st, lens) &&
              !vlmoe_st_writer_add_raw(w, "batch_size", VLMOE_DT_I32, 1, &one, &bs) &&
              !vlmoe_st_writer_write(w, at("inputs.safetensors")),
          "inputs: %s", vlmoe_last_error());
    vlmoe_st_writer_free(w);
    snprintf(args, sizeof(args), "tdir_%s", model);
    CHECK(py("torch %s %s %s", at(args), at("inputs.safetensors"), at("torch_out.safetensors")) == 0,
          "%s: vlmoe_torch.py:\n%s", model, out);
    int compared = 0;
    CHECK(!vlmoe_model_plan(m, B) && !vlmoe_model_encode_images(m, img, n, emb[0]), "encode: %s", vlmoe_last_error());
    if (!soft) compared += compare_routing(m, model, "image", n - n % B, n % B);
    CHECK(!vlmoe_model_encode_texts(m, tok, lens, n, emb[1]), "encode texts: %s", vlmoe_last_error());
    if (!soft) compared += compare_routing(m, model, "text", n - n % B, n % B);
    CHECK(soft || compared >= 1, "%s: no MoE layer's routing compared", model);
    CHECK(read_f32(at("torch_out.safetensors"), "image_embeds", ref[0], (size_t)n * D) &&
              read_f32(at("torch_out.safetensors"), "text_embeds", ref[1], (size_t)n * D), "vlmoe_torch's output");
    snprintf(args, sizeof(args), "embed --model %s --texts captions.txt --batch-size 4 -o te.safetensors", ckpt);
    test_expect_in(dir, bin, args, 0, "", out, sizeof(out));
    CHECK(read_f32(at("te.safetensors"), "text_embeds", cli, (size_t)n * D), "vlmoe embed's text_embeds");
    const double ei = rel_err(ref[0], emb[0], n * D), et = rel_err(ref[1], emb[1], n * D), ec = rel_err(ref[1], cli, n * D);
    CHECK(ei < 1e-5 && et < 1e-5 && ec < 1e-5, "%s: vlmoe_torch vs vlmoe: image %.3g, text %.3g, vlmoe embed texts %.3g",
          model, ei, et, ec);
    printf("%s --to torch: vlmoe_torch.py vs vlmoe max relative error image %.2g, text %.2g (vlmoe embed %.2g); "
           "%d MoE layer passes with the same expert per token%s\n", model, ei, et, ec, compared,
           soft ? " (Soft MoE: no per-token choice to compare)" : "");
    vlmoe_model_free(m);
}

int main(int argc, char **argv) {
    static char abs[4096];
    static reference r;
    if (!(bin = test_vlmoe_bin(argv[0], abs))) return test_summary("test_import_export");
    python = getenv("VLMOE_TEST_PYTHON") ? getenv("VLMOE_TEST_PYTHON") : "/usr/bin/python3";
    CHECK(realpath("tests/ref/import_export.py", script) != NULL, "run from the repository root (tests/ref/import_export.py)");
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_ie_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    CHECK(py("make %s%s%s", dir, "", "") == 0, "tests/ref/import_export.py make:\n%s", out);
    CHECK(load_ref(&r), "ref.safetensors");
    vlmoe_model *hf = NULL;
    test_folders(&r, &hf);
    test_errors();
    if (hf) test_round_trip(hf);
    if (hf) test_tokenizer_json(hf);
    vlmoe_model_free(hf);
    test_ecosystem();
    test_torch("limoe-tiny", 0);
    test_torch("clipup-tiny", 0);
    test_torch("ec-tiny", 0);
    test_torch("soft-tiny", 1);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_import_export");
}
