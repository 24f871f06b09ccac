// test_clip_import.c: CLIP weight import/export (src/io/clip_import.c) against an OpenAI-CLIP
// model in PyTorch (tests/ref/gen_clip.py): embeddings and logits of the imported OpenAI/OpenCLIP,
// HF and HF-F16 files match PyTorch's (float64 reference); import -> export gives the file's
// tensors back bit for bit; BF16 input; bad files (not a CLIP, a missing tensor, a wrong shape,
// an unknown tensor, NaN, truncated bytes) fail naming the file; and upcycling an imported CLIP
// (src/nn/upcycle.c): K=1 with renormalised gates and ample capacity reproduces it, K=2 at
// capacity factor 2 (CLIP-UP) stays close (cosine similarity printed).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/safetensors.h"
#include "test.h"
#include "vlmoe.h"

static char path_buf[4][512], tmpdir[64];

static const char *fixture(int slot, const char *name) {
    snprintf(path_buf[slot], sizeof(path_buf[slot]), "%s/%s", fixture_dir(), name);
    return path_buf[slot];
}

static const char *tmp(int slot, const char *name) {
    snprintf(path_buf[slot], sizeof(path_buf[slot]), "%s/%s", tmpdir, name);
    return path_buf[slot];
}

// Reference inputs and outputs of gen_clip.py.
typedef struct {
    float img[5 * 3 * 32 * 32], emb[2][2][5 * 32], logits[2][25]; // [ref|f16][image|text]
    int32_t tok[5 * 16], lens[5];
} reference;

static int load_reference(reference *r) {
    vlmoe_st *f;
    if (vlmoe_st_open(fixture(0, "clip_ref.safetensors"), &f)) return 0;
    int ok = !vlmoe_st_read_f32(f, "input.images", r->img, sizeof(r->img) / sizeof(float));
    const char *tag[2] = {"ref", "f16"};
    for (int t = 0; t < 2; t++) {
        char n[64];
        snprintf(n, sizeof(n), "%s.image_embeds", tag[t]);
        ok = ok && !vlmoe_st_read_f32(f, n, r->emb[t][0], 5 * 32);
        snprintf(n, sizeof(n), "%s.text_embeds", tag[t]);
        ok = ok && !vlmoe_st_read_f32(f, n, r->emb[t][1], 5 * 32);
        snprintf(n, sizeof(n), "%s.logits", tag[t]);
        ok = ok && !vlmoe_st_read_f32(f, n, r->logits[t], 25);
    }
    vlmoe_tensor_info ti;
    ok = ok && !vlmoe_st_info(f, vlmoe_st_find(f, "input.tokens"), &ti) && ti.nbytes == sizeof(r->tok);
    if (ok) memcpy(r->tok, ti.data, sizeof(r->tok));
    ok = ok && !vlmoe_st_info(f, vlmoe_st_find(f, "input.lens"), &ti) && ti.nbytes == sizeof(r->lens);
    if (ok) memcpy(r->lens, ti.data, sizeof(r->lens));
    vlmoe_st_close(f);
    return ok;
}

// max |a - b| / max |b|
static double rel_err(const float *a, const float *b, int n) {
    double e = 0, m = 1e-30;
    for (int i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i])), m = fmax(m, fabs((double)b[i]));
    return e / m;
}

// Image and text embeddings (5, 32) each, and the logits exp(logit_scale) img txt^T (5, 5).
static int embed(vlmoe_model *m, const reference *r, float emb[2][5 * 32], float logits[25]) {
    if (vlmoe_model_encode_images(m, r->img, 5, emb[0]) || vlmoe_model_encode_texts(m, r->tok, r->lens, 5, emb[1]))
        return 0;
    int np;
    const vlmoe_param_info *t = vlmoe_model_params(m, &np);
    const double scale = exp(vlmoe_model_param_data(m)[t[np - 1].offset]); // logit_scale comes last
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 5; j++) {
            double s = 0;
            for (int k = 0; k < 32; k++) s += (double)emb[0][i * 32 + k] * emb[1][j * 32 + k];
            logits[i * 5 + j] = (float)(scale * s);
        }
    return 1;
}

// Measured (float32 against PyTorch in float64, max |err| / max |ref|): image embeddings 2.3e-7,
// text embeddings 2.5e-7, logits 5.0e-7 for the F32 files; 2.4e-7, 2.1e-7, 4.4e-7 for the F16 one
// (against the F16-rounded weights); at most 6e-7 in the ASan build.
static void test_parity(const reference *r) {
    const struct { const char *file, *naming; int ref; } cases[] = {
        {"clip_openclip.safetensors", "openclip", 0},
        {"clip_hf.safetensors", "auto", 0},
        {"clip_hf_f16.safetensors", "hf", 1},
    };
    for (int c = 0; c < 3; c++) {
        vlmoe_clip_import_params p = vlmoe_clip_import_default_params();
        p.naming = cases[c].naming;
        vlmoe_model *m = NULL;
        CHECK(vlmoe_clip_import(&m, fixture(0, cases[c].file), &p) == VLMOE_OK, "%s: %s", cases[c].file, vlmoe_last_error());
        if (!m) continue;
        const vlmoe_model_config *g = vlmoe_model_get_config(m);
        CHECK(g->arch == VLMOE_ARCH_TWO_TOWER && g->image_size == 32 && g->patch_size == 8 && g->channels == 3 &&
                  g->vocab_size == 100 && g->context_length == 16 && g->embed_dim == 32 &&
                  g->encoder.width == 128 && g->encoder.layers == 2 && g->encoder.heads == 2 && g->encoder.mlp_dim == 512 &&
                  g->text_encoder.width == 64 && g->text_encoder.layers == 3 && g->text_encoder.heads == 1 &&
                  g->text_encoder.mlp_dim == 256 && g->act == VLMOE_ACT_QUICK_GELU,
              "%s: inferred config is off", cases[c].file);
        float emb[2][5 * 32], logits[25];
        CHECK(embed(m, r, emb, logits), "%s: encode: %s", cases[c].file, vlmoe_last_error());
        const double ei = rel_err(emb[0], r->emb[cases[c].ref][0], 5 * 32);
        const double et = rel_err(emb[1], r->emb[cases[c].ref][1], 5 * 32);
        const double el = rel_err(logits, r->logits[cases[c].ref], 25);
        CHECK(ei < 1e-5 && et < 1e-5 && el < 1e-5, "%s: relative errors image %.3g text %.3g logits %.3g",
              cases[c].file, ei, et, el);
        printf("parity %s: max relative error image %.2g, text %.2g, logits %.2g\n", cases[c].file, ei, et, el);
        vlmoe_model_free(m);
    }
}

// How rewrite() changes a file: dtype < 0 copies the bytes as they are.
typedef struct {
    int dtype;
    const char *drop;     // a tensor to leave out
    const char *prefix;   // put before every name
    const char *add;      // a float tensor to add, with its shape and data
    int ndim;
    const int64_t *shape;
    const float *data;
} edit;

static int rewrite(const char *src, const char *dst, const edit *e) {
    vlmoe_st *f;
    vlmoe_st_writer *w;
    if (vlmoe_st_open(src, &f)) return 0;
    int ok = !vlmoe_st_writer_init(&w), n = vlmoe_st_count(f);
    float **bufs = calloc((size_t)n, sizeof(float *));
    char (*names)[256] = calloc((size_t)n, sizeof(*names));
    for (int i = 0; i < n && ok; i++) {
        vlmoe_tensor_info ti;
        vlmoe_st_info(f, i, &ti);
        if (e->drop && !strcmp(ti.name, e->drop)) continue;
        snprintf(names[i], sizeof(names[i]), "%s%s", e->prefix ? e->prefix : "", ti.name);
        if (e->dtype < 0 || ti.dtype == VLMOE_DT_I64) {
            ok = !vlmoe_st_writer_add_raw(w, names[i], ti.dtype, ti.ndim, ti.shape, ti.data);
        } else {
            bufs[i] = malloc(sizeof(float) * (ti.numel ? ti.numel : 1));
            ok = !vlmoe_st_read_f32(f, ti.name, bufs[i], ti.numel) &&
                 !vlmoe_st_writer_add_f32(w, names[i], (vlmoe_dtype)e->dtype, ti.ndim, ti.shape, bufs[i]);
        }
    }
    if (ok && e->add) ok = !vlmoe_st_writer_add_f32(w, e->add, VLMOE_DT_F32, e->ndim, e->shape, e->data);
    if (ok) ok = !vlmoe_st_writer_write(w, dst);
    for (int i = 0; i < n; i++) free(bufs[i]);
    free(bufs);
    free(names);
    vlmoe_st_writer_free(w);
    vlmoe_st_close(f);
    return ok;
}

// The two models have bit-identical parameters, or the number that differ.
static size_t params_differ(vlmoe_model *a, vlmoe_model *b, int bf16) {
    size_t bad = 0;
    const float *pa = vlmoe_model_param_data(a), *pb = vlmoe_model_param_data(b);
    for (size_t k = 0; k < vlmoe_model_num_floats(a); k++)
        bad += (bf16 ? vlmoe_bf16_to_f32(vlmoe_f32_to_bf16(pa[k])) : pa[k]) != pb[k];
    return bad;
}

// Every tensor of `want` other than position_ids is in `got` with the same dtype, shape and bytes,
// and `got` has nothing else.
static void same_tensors(const char *got, const char *want) {
    vlmoe_st *g, *f;
    CHECK(!vlmoe_st_open(got, &g) && !vlmoe_st_open(want, &f), "open %s / %s: %s", got, want, vlmoe_last_error());
    int n = 0, bad = 0;
    for (int i = 0; i < vlmoe_st_count(f); i++) {
        vlmoe_tensor_info a, b;
        vlmoe_st_info(f, i, &a);
        if (strstr(a.name, "position_ids")) continue;
        n++;
        int j = vlmoe_st_find(g, a.name);
        int same = j >= 0 && !vlmoe_st_info(g, j, &b) && a.dtype == b.dtype && a.ndim == b.ndim && a.nbytes == b.nbytes &&
                   !memcmp(a.shape, b.shape, sizeof(int64_t) * (size_t)a.ndim) && !memcmp(a.data, b.data, a.nbytes);
        if (!same && bad++ < 3) CHECK(0, "%s: tensor '%s' missing or different from %s's", got, a.name, want);
    }
    CHECK(bad == 0 && vlmoe_st_count(g) == n, "%s: %d of %d tensors differ; %d tensors, expected %d", got, bad, n,
          vlmoe_st_count(g), n);
    vlmoe_st_close(g);
    vlmoe_st_close(f);
}

static void test_round_trip(void) {
    const char *names[2] = {"openclip", "hf"}, *files[2] = {"clip_openclip.safetensors", "clip_hf.safetensors"};
    for (int from = 0; from < 2; from++) {
        vlmoe_clip_import_params p = vlmoe_clip_import_default_params();
        vlmoe_model *m = NULL;
        CHECK(vlmoe_clip_import(&m, fixture(0, files[from]), &p) == VLMOE_OK, "import: %s", vlmoe_last_error());
        if (!m) continue;
        for (int to = 0; to < 2; to++) { // the fixtures hold the same weights: crossing over is exact too
            CHECK(vlmoe_clip_export(m, tmp(1, "export.safetensors"), names[to], VLMOE_DT_F32) == VLMOE_OK, "export: %s",
                  vlmoe_last_error());
            same_tensors(tmp(1, "export.safetensors"), fixture(2, files[to]));
        }
        vlmoe_model_free(m);
    }
    // BF16 input: the same parameters as the F32 file's, rounded to BF16; keys with a common
    // prefix (a DDP checkpoint's "module.") give the same model
    const char *oc = fixture(0, "clip_openclip.safetensors");
    vlmoe_model *a = NULL, *b = NULL, *c = NULL;
    CHECK(rewrite(oc, tmp(1, "bf16.safetensors"), &(edit){.dtype = VLMOE_DT_BF16}) &&
              rewrite(oc, tmp(2, "module.safetensors"), &(edit){.dtype = -1, .prefix = "module."}), "rewrite: %s",
          vlmoe_last_error());
    CHECK(vlmoe_clip_import(&a, oc, NULL) == VLMOE_OK && vlmoe_clip_import(&b, path_buf[1], NULL) == VLMOE_OK &&
              vlmoe_clip_import(&c, path_buf[2], NULL) == VLMOE_OK, "import: %s", vlmoe_last_error());
    if (a && b && c) {
        size_t bad = params_differ(a, b, 1);
        CHECK(bad == 0, "bf16 import: %zu parameters are not the F32 ones rounded to BF16", bad);
        bad = params_differ(a, c, 0);
        CHECK(bad == 0, "prefixed import: %zu parameters differ", bad);
    }
    vlmoe_model_free(a);
    vlmoe_model_free(b);
    vlmoe_model_free(c);
}

// Import of `file` fails with status st (any if st < 0) and a message holding the file's path
// and `needle`.
static void expect_fail(const char *file, const vlmoe_clip_import_params *p, int st, const char *needle) {
    vlmoe_model *m = (vlmoe_model *)1;
    int got = vlmoe_clip_import(&m, file, p);
    const char *e = vlmoe_last_error();
    CHECK((st < 0 ? got != 0 : got == st) && m == NULL && strstr(e, file) && strstr(e, needle),
          "import %s: status %d (want %d), message '%s' lacks the path or '%s'", file, got, st, e, needle);
}

static void test_bad_inputs(void) {
    const char *oc = fixture(0, "clip_openclip.safetensors");
    float z[1000] = {0};
    const int64_t one[1] = {7}, wrong[2] = {500, 128}, conv[1] = {128};
    // a file with no CLIP tensor, and a vlmoe model file
    vlmoe_st_writer *w;
    vlmoe_st_writer_init(&w);
    vlmoe_st_writer_add_f32(w, "encoder.weight", VLMOE_DT_F32, 1, one, z);
    vlmoe_st_writer_write(w, tmp(1, "other.safetensors"));
    vlmoe_st_writer_free(w);
    expect_fail(path_buf[1], NULL, VLMOE_ERR_FORMAT, "not a CLIP checkpoint");
    vlmoe_model *m = NULL;
    vlmoe_clip_import(&m, oc, NULL);
    CHECK(m && vlmoe_model_save(m, tmp(1, "native.safetensors")) == VLMOE_OK, "save: %s", vlmoe_last_error());
    expect_fail(path_buf[1], NULL, VLMOE_ERR_FORMAT, "a vlmoe model file");
    vlmoe_clip_import_params p = vlmoe_clip_import_default_params();
    p.naming = "hf";
    expect_fail(oc, &p, VLMOE_ERR_FORMAT, "has OpenAI/OpenCLIP names, not HF CLIPModel ones");
    p.naming = "timm";
    vlmoe_model *m2 = NULL;
    CHECK(vlmoe_clip_import(&m2, oc, &p) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "timm"), "naming: %s",
          vlmoe_last_error());
    // a truncated tensor set
    CHECK(rewrite(oc, tmp(1, "missing.safetensors"), &(edit){.dtype = -1, .drop = "transformer.resblocks.2.ln_2.bias"}), "write");
    expect_fail(path_buf[1], NULL, VLMOE_ERR_FORMAT, "missing tensor 'transformer.resblocks.2.ln_2.bias'");
    CHECK(rewrite(oc, tmp(1, "missing.safetensors"), &(edit){.dtype = -1, .drop = "text_projection"}), "write");
    expect_fail(path_buf[1], NULL, VLMOE_ERR_FORMAT, "missing tensor 'text_projection'");
    // a wrong shape, an unknown tensor, a NaN
    const char *fc = "visual.transformer.resblocks.1.mlp.c_fc.weight";
    float *big = calloc(500 * 128, sizeof(float));
    CHECK(rewrite(oc, tmp(1, "shape.safetensors"), &(edit){-1, fc, NULL, fc, 2, wrong, big}), "write");
    expect_fail(path_buf[1], NULL, VLMOE_ERR_FORMAT, "'visual.transformer.resblocks.1.mlp.c_fc.weight' has shape [500, 128], expected [512, 128]");
    CHECK(rewrite(oc, tmp(1, "extra.safetensors"),
                  &(edit){-1, NULL, NULL, "visual.transformer.resblocks.0.ls_1.gamma", 1, conv, z}), "write");
    expect_fail(path_buf[1], NULL, VLMOE_ERR_FORMAT, "unexpected tensor 'visual.transformer.resblocks.0.ls_1.gamma'");
    z[3] = NAN;
    CHECK(rewrite(oc, tmp(1, "nan.safetensors"), &(edit){-1, "visual.ln_post.bias", NULL, "visual.ln_post.bias", 1, conv, z}), "write");
    expect_fail(path_buf[1], NULL, VLMOE_ERR_NUMERIC, "image.ln_final.bias");
    // truncated bytes
    size_t n;
    char *bytes = test_read_file(oc, &n);
    test_write_file(tmp(1, "cut.safetensors"), bytes, n / 2);
    expect_fail(path_buf[1], NULL, -1, "cut.safetensors");
    // heads: an override must divide the width
    p = vlmoe_clip_import_default_params();
    p.image_heads = 3;
    expect_fail(oc, &p, VLMOE_ERR_CONFIG, "heads");
    p.image_heads = 4;
    CHECK(vlmoe_clip_import(&m2, oc, &p) == VLMOE_OK && vlmoe_model_get_config(m2)->encoder.heads == 4, "heads 4: %s",
          vlmoe_last_error());
    vlmoe_model_free(m2);
    // export: only dense two_tower models have CLIP names
    vlmoe_model_config c;
    vlmoe_config_named("tiny", &c);
    CHECK(vlmoe_model_init(&m2, &c, 1) == VLMOE_OK, "init");
    CHECK(vlmoe_clip_export(m2, tmp(1, "x.safetensors"), "hf", VLMOE_DT_F32) == VLMOE_ERR_CONFIG &&
              strstr(vlmoe_last_error(), "one_tower"), "export one_tower: %s", vlmoe_last_error());
    CHECK(vlmoe_clip_export(m, tmp(1, "x.safetensors"), "auto", VLMOE_DT_F32) == VLMOE_ERR_ARG, "export auto");
    CHECK(access(path_buf[1], F_OK) != 0, "a failed export left %s behind", path_buf[1]);
    vlmoe_model_free(m2);
    vlmoe_model_free(m);
    free(bytes);
    free(big);
}

static double mean_cosine(const float *a, const float *b, int n, int d) {
    double s = 0;
    for (int i = 0; i < n; i++) {
        double ab = 0, aa = 0, bb = 0;
        for (int k = 0; k < d; k++) ab += (double)a[i * d + k] * b[i * d + k], aa += (double)a[i * d + k] * a[i * d + k],
                                    bb += (double)b[i * d + k] * b[i * d + k];
        s += ab / sqrt(aa * bb);
    }
    return s / n;
}

static void test_upcycle(const reference *r) {
    vlmoe_model *dense = NULL;
    CHECK(vlmoe_clip_import(&dense, fixture(0, "clip_openclip.safetensors"), NULL) == VLMOE_OK, "%s", vlmoe_last_error());
    if (!dense) return;
    float de[2][5 * 32], dl[25];
    embed(dense, r, de, dl);
    for (int k = 1; k <= 2; k++) {
        vlmoe_moe_config mc[2];
        memset(mc, 0, sizeof(mc));
        mc[0].num_experts = 4;
        vlmoe_moe_preset("clipup", &mc[0]);
        if (k == 1) { // the identity: every token keeps its one expert, whose gate renormalises to 1
            mc[0].top_k = 1;
            mc[0].gate_renorm = VLMOE_RENORM_AFTER_ROUTING;
            mc[0].capacity_factor = mc[0].eval_capacity_factor = 4; // C = S: nothing dropped
        }
        mc[1] = mc[0];
        mc[0].layers = vlmoe_moe_every(2, 2);
        mc[1].layers = vlmoe_moe_every(2, 3);
        vlmoe_model *up = NULL, *back = NULL;
        CHECK(vlmoe_model_upcycle(&up, dense, &mc[0], &mc[1], 5, 0) == VLMOE_OK, "upcycle: %s", vlmoe_last_error());
        if (!up) continue;
        // the MoE config travels with the file
        CHECK(vlmoe_model_save(up, tmp(1, "up.safetensors")) == VLMOE_OK && vlmoe_model_load(&back, path_buf[1]) == VLMOE_OK,
              "save/load: %s", vlmoe_last_error());
        CHECK(back && vlmoe_model_get_config(back)->text_moe.num_experts == 4 &&
                  vlmoe_model_get_config(back)->moe.top_k == k, "upcycled config lost its MoE layers");
        float ue[2][5 * 32], ul[25];
        CHECK(embed(back ? back : up, r, ue, ul), "encode: %s", vlmoe_last_error());
        const double di = rel_err(ue[0], de[0], 5 * 32), dt = rel_err(ue[1], de[1], 5 * 32);
        const double ci = mean_cosine(ue[0], de[0], 5, 32), ct = mean_cosine(ue[1], de[1], 5, 32);
        if (k == 1) CHECK(di < 1e-5 && dt < 1e-5, "K=1 upcycled embeddings differ from dense: image %.3g text %.3g", di, dt);
        else CHECK(ci > 0.5 && ct > 0.5, "K=2 upcycled embeddings far from dense: cosine image %.4f text %.4f", ci, ct);
        printf("upcycled (4 experts, top-%d%s): embeddings vs dense: max relative difference image %.2g text %.2g, "
               "mean cosine similarity image %.6f text %.6f\n", k, k == 1 ? ", renormalised, cf 4" : ", cf 2 (clipup)",
               di, dt, ci, ct);
        vlmoe_model_free(up);
        vlmoe_model_free(back);
    }
    vlmoe_model_free(dense);
}

int main(void) {
    static reference r;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/vlmoe_clip_XXXXXX");
    CHECK(mkdtemp(tmpdir) != NULL, "mkdtemp");
    if (!load_reference(&r)) {
        CHECK(0, "cannot read %s/clip_ref.safetensors (run tests/ref/gen_all.py): %s", fixture_dir(), vlmoe_last_error());
        return test_summary("test_clip_import");
    }
    test_parity(&r);
    test_round_trip();
    test_bad_inputs();
    test_upcycle(&r);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_clip_import");
}
