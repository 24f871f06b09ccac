// test_parity.c: vlmoe against PyTorch on the same weights and inputs (fixtures written by
// tests/ref/gen_ops.py and gen_model.py with Debian's python3-torch): every op's output and
// input gradients, one transformer block (nn.MultiheadAttention with a padding mask), and whole
// tiny one_tower and two_tower models: loss, logits and every parameter gradient, then the
// losses and parameters after one and five AdamW steps with clipping and the logit-scale clamp;
// MoE layers (gen_moe_layer.py), and the VL-MoE (MoME) model of gen_mome.py, with and without its
// classification head: losses, hidden states, class scores and every parameter gradient; then its
// NLVR2 two-pair head (losses, hidden states, class scores, gradients) and its retrieval head (the
// contrastive loss of separate image and text forwards, both embeddings, every gradient).
// Tolerances are stated per comparison as the max abs error over the max abs reference value.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "moe/layer.h"
#include "nn/model.h"
#include "nn/mome.h"
#include "test.h"

static vlmoe_st *open_fixture(const char *name) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", fixture_dir(), name);
    vlmoe_st *f = NULL;
    if (vlmoe_st_open(path, &f) != VLMOE_OK) {
        CHECK(0, "cannot open fixture %s (run `make fixtures`): %s", path, vlmoe_last_error());
        return NULL;
    }
    return f;
}

// Reads a float tensor (any float dtype) into a new buffer; *n gets its element count.
static float *get(const vlmoe_st *f, const char *name, size_t *n) {
    vlmoe_tensor_info ti;
    int i = vlmoe_st_find(f, name);
    if (i < 0 || vlmoe_st_info(f, i, &ti)) {
        CHECK(0, "fixture tensor %s missing", name);
        return NULL;
    }
    float *v = malloc(sizeof(float) * (ti.numel ? ti.numel : 1));
    if (vlmoe_st_read_f32(f, name, v, ti.numel)) CHECK(0, "read %s: %s", name, vlmoe_last_error());
    if (n) *n = ti.numel;
    return v;
}

static int32_t *get_i32(const vlmoe_st *f, const char *name) {
    vlmoe_tensor_info ti;
    int i = vlmoe_st_find(f, name);
    if (i < 0 || vlmoe_st_info(f, i, &ti) || ti.dtype != VLMOE_DT_I32) {
        CHECK(0, "fixture int32 tensor %s missing", name);
        return NULL;
    }
    int32_t *v = malloc(ti.nbytes);
    memcpy(v, ti.data, ti.nbytes);
    return v;
}

// max |a - ref| / max |ref| over n elements
static double rel_err(const float *a, const float *ref, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        num = fmax(num, fabs((double)a[i] - ref[i]));
        den = fmax(den, fabs((double)ref[i]));
    }
    return num / den;
}

static void compare(const char *what, const float *a, const float *ref, size_t n, double tol) {
    double e = rel_err(a, ref, n);
    CHECK(e <= tol, "%s: max error %.3g of max |ref| (tolerance %.1g)", what, e, tol);
}

static void compare_fixture(const vlmoe_st *f, const char *name, const float *a, double tol) {
    size_t n;
    float *ref = get(f, name, &n);
    if (ref) compare(name, a, ref, n, tol);
    free(ref);
}

static float *zerosf(size_t n) { return calloc(n ? n : 1, sizeof(float)); }

static void test_ops(void) {
    vlmoe_st *f = open_fixture("ops.safetensors");
    if (!f) return;
    const double tol = 2e-6;
    size_t n;
    { // linear (6,7) -> (6,5)
        float *x = get(f, "linear.inp", NULL), *w = get(f, "linear.w", NULL), *b = get(f, "linear.b", NULL);
        float *r = get(f, "linear.r", NULL), *o = zerosf(30), *dx = zerosf(42), *dw = zerosf(35), *db = zerosf(5);
        linear_forward_f32(o, x, w, b, 6, 7, 5, 0);
        linear_backward_f32(dx, dw, db, r, x, w, 6, 7, 5);
        compare_fixture(f, "linear.out", o, tol);
        compare_fixture(f, "linear.dinp", dx, tol);
        compare_fixture(f, "linear.dw", dw, tol);
        compare_fixture(f, "linear.db", db, tol);
        free(x), free(w), free(b), free(r), free(o), free(dx), free(dw), free(db);
    }
    { // layernorm (4,9), eps 1e-5
        float *x = get(f, "layernorm.inp", NULL), *w = get(f, "layernorm.w", NULL), *b = get(f, "layernorm.b", NULL);
        float *r = get(f, "layernorm.r", NULL), *o = zerosf(36), m[4], s[4], *dx = zerosf(36), *dw = zerosf(9), *db = zerosf(9);
        layernorm_forward_f32(o, m, s, x, w, b, 4, 9, 1e-5);
        layernorm_backward_f32(dx, dw, db, r, x, w, m, s, 4, 9);
        compare_fixture(f, "layernorm.out", o, tol);
        compare_fixture(f, "layernorm.dinp", dx, 1e-5);
        compare_fixture(f, "layernorm.dw", dw, tol);
        compare_fixture(f, "layernorm.db", db, tol);
        free(x), free(w), free(b), free(r), free(o), free(dx), free(dw), free(db);
    }
    const char *acts[3] = {"gelu", "gelu_tanh", "quick_gelu"};
    for (int k = 0; k < 3; k++) {
        char nm[64];
        snprintf(nm, sizeof(nm), "%s.inp", acts[k]);
        float *x = get(f, nm, NULL), o[64], *dx = zerosf(64);
        snprintf(nm, sizeof(nm), "%s.r", acts[k]);
        float *r = get(f, nm, NULL);
        act_forward_f32(o, x, 64, k);
        act_backward_f32(dx, x, r, 64, k);
        snprintf(nm, sizeof(nm), "%s.out", acts[k]);
        compare_fixture(f, nm, o, tol);
        snprintf(nm, sizeof(nm), "%s.dinp", acts[k]);
        compare_fixture(f, nm, dx, tol);
        free(x), free(r), free(dx);
    }
    { // softmax (3,7)
        float *x = get(f, "softmax.inp", NULL), *r = get(f, "softmax.r", NULL), o[21], *dx = zerosf(21);
        softmax_forward_f32(o, x, 3, 7);
        softmax_backward_f32(dx, o, r, 3, 7);
        compare_fixture(f, "softmax.out", o, tol);
        compare_fixture(f, "softmax.dinp", dx, tol);
        free(x), free(r), free(dx);
    }
    int32_t *lens = get_i32(f, "attention.lens");
    for (int causal = 0; causal < 2 && lens; causal++) { // (2, 6, 24), 2 heads, padding lens 6 and 3
        char nm[64];
        snprintf(nm, sizeof(nm), "attention%d.qkv", causal);
        float *qkv = get(f, nm, NULL);
        snprintf(nm, sizeof(nm), "attention%d.r", causal);
        float *r = get(f, nm, NULL), *o = zerosf(96), *att = zerosf(144), *datt = zerosf(144), *dq = zerosf(288);
        attn_segment seg = {.nseq = 2, .seqlen = 6, .causal = causal, .lens = lens};
        attention_forward_f32(o, att, qkv, &seg, 8, 2);
        attention_backward_f32(dq, datt, r, qkv, att, &seg, 8, 2);
        snprintf(nm, sizeof(nm), "attention%d.out", causal);
        compare_fixture(f, nm, o, tol);
        snprintf(nm, sizeof(nm), "attention%d.dqkv", causal);
        compare_fixture(f, nm, dq, 1e-5);
        free(qkv), free(r), free(o), free(att), free(datt), free(dq);
    }
    free(lens);
    { // BEiT-3's captioning mask: causal after a prefix of 3 (the image), lengths 6 and 4
        const int32_t plens[2] = {6, 4};
        float *qkv = get(f, "attention_prefix.qkv", NULL), *r = get(f, "attention_prefix.r", NULL);
        float *o = zerosf(96), *att = zerosf(144), *datt = zerosf(144), *dq = zerosf(288);
        attn_segment seg = {.nseq = 2, .seqlen = 6, .causal = 1, .lens = plens, .prefix = 3};
        if (qkv && r) {
            attention_forward_f32(o, att, qkv, &seg, 8, 2);
            attention_backward_f32(dq, datt, r, qkv, att, &seg, 8, 2);
            compare_fixture(f, "attention_prefix.out", o, tol);
            compare_fixture(f, "attention_prefix.dqkv", dq, 1e-5);
        }
        free(qkv), free(r), free(o), free(att), free(datt), free(dq);
    }
    { // patch embedding: conv (8,3,4,4) stride 4 on (2,3,8,8) = patchify + linear
        float *img = get(f, "patch.images", NULL), *w = get(f, "patch.w", NULL), *b = get(f, "patch.b", NULL);
        float *r = get(f, "patch.r", NULL), *pt = zerosf(2 * 4 * 48), *o = zerosf(64), *dw = zerosf(384), *db = zerosf(8);
        patchify_forward_f32(pt, img, 2, 3, 8, 4);
        linear_forward_f32(o, pt, w, b, 8, 48, 8, 0);
        linear_backward_f32(NULL, dw, db, r, pt, w, 8, 48, 8);
        compare_fixture(f, "patch.out", o, tol);
        compare_fixture(f, "patch.dw", dw, tol);
        compare_fixture(f, "patch.db", db, tol);
        free(img), free(w), free(b), free(r), free(pt), free(o), free(dw), free(db);
    }
    { // token + position embedding, ids (2,4) into (10,4)
        float *wte = get(f, "embed.wte", NULL), *pos = get(f, "embed.pos", NULL), *r = get(f, "embed.r", NULL);
        int32_t *ids = get_i32(f, "embed.ids");
        float o[32], *dwte = zerosf(40), *dpos = zerosf(16);
        if (ids) {
            embed_forward_f32(o, ids, wte, 8, 4);
            posadd_forward_f32(o, pos, 2, 4, 4);
            posadd_backward_f32(dpos, r, 2, 4, 4);
            embed_backward_f32(dwte, r, ids, 8, 4);
            compare_fixture(f, "embed.out", o, tol);
            compare_fixture(f, "embed.dwte", dwte, tol);
            compare_fixture(f, "embed.dpos", dpos, tol);
        }
        free(wte), free(pos), free(r), free(ids), free(dwte), free(dpos);
    }
    { // class token
        float *cls = get(f, "cls.cls", NULL), *x = get(f, "cls.x", NULL), *r = get(f, "cls.r", NULL);
        float o[32], *dc = zerosf(4), *dx = zerosf(24);
        cls_forward_f32(o, cls, x, 2, 3, 4);
        cls_backward_f32(dc, dx, r, 2, 3, 4);
        compare_fixture(f, "cls.out", o, tol);
        compare_fixture(f, "cls.dcls", dc, tol);
        compare_fixture(f, "cls.dx", dx, tol);
        free(cls), free(x), free(r), free(dc), free(dx);
    }
    int32_t *plens = get_i32(f, "pool.lens");
    const char *pools[3] = {"mean", "cls", "eot"};
    for (int k = 0; k < 3 && plens; k++) {
        char nm[64];
        snprintf(nm, sizeof(nm), "pool_%s.x", pools[k]);
        float *x = get(f, nm, NULL), o[6], *dx = zerosf(24);
        snprintf(nm, sizeof(nm), "pool_%s.r", pools[k]);
        float *r = get(f, nm, NULL);
        pool_forward_f32(o, x, plens, 2, 4, 3, k);
        pool_backward_f32(dx, r, plens, 2, 4, 3, k);
        snprintf(nm, sizeof(nm), "pool_%s.out", pools[k]);
        compare_fixture(f, nm, o, tol);
        snprintf(nm, sizeof(nm), "pool_%s.dx", pools[k]);
        compare_fixture(f, nm, dx, tol);
        free(x), free(r), free(dx);
    }
    free(plens);
    { // l2 normalisation (3,5)
        float *x = get(f, "l2norm.x", NULL), *r = get(f, "l2norm.r", NULL), o[15], nr[3], *dx = zerosf(15);
        l2norm_forward_f32(o, nr, x, 3, 5);
        l2norm_backward_f32(dx, r, o, nr, 3, 5);
        compare_fixture(f, "l2norm.out", o, tol);
        compare_fixture(f, "l2norm.dx", dx, tol);
        free(x), free(r), free(dx);
    }
    { // contrastive loss, B=5, E=6
        float *img = get(f, "contrastive.img", NULL), *txt = get(f, "contrastive.txt", NULL);
        float *sc = get(f, "contrastive.scale", &n), *ref = get(f, "contrastive.loss", NULL);
        float lg[25], pr[25], pc[25], *di = zerosf(30), *dt = zerosf(30), ds = 0;
        double loss = contrastive_forward_f32(lg, pr, pc, img, txt, sc[0], 5, 6, NULL);
        contrastive_backward_f32(di, dt, &ds, lg, pr, pc, img, txt, sc[0], 5, 6, 1.0);
        CHECK(fabs(loss - ref[0]) <= 1e-6 * fabs(ref[0]), "contrastive loss %.9g vs torch %.9g", loss, ref[0]);
        compare_fixture(f, "contrastive.logits", lg, tol);
        compare_fixture(f, "contrastive.dimg", di, 1e-5);
        compare_fixture(f, "contrastive.dtxt", dt, 1e-5);
        compare_fixture(f, "contrastive.dscale", &ds, 1e-5);
        free(img), free(txt), free(sc), free(ref), free(di), free(dt);
    }
    vlmoe_st_close(f);
}

// One block through the model graph's own code path is covered by the whole-model tests; this
// checks the block arithmetic alone against nn.MultiheadAttention + nn.LayerNorm + nn.Linear.
static void test_block(void) {
    vlmoe_st *f = open_fixture("block.safetensors");
    if (!f) return;
    const int B = 2, T = 5, D = 16, H = 4, M = 32, N = B * T;
    float *x = get(f, "x", NULL), *r = get(f, "r", NULL);
    int32_t *lens = get_i32(f, "lens");
#define W(s) get(f, "block." s, NULL)
    float *l1w = W("ln1.weight"), *l1b = W("ln1.bias"), *qw = W("attn.qkv.weight"), *qb = W("attn.qkv.bias");
    float *ow = W("attn.out.weight"), *ob = W("attn.out.bias"), *l2w = W("ln2.weight"), *l2b = W("ln2.bias");
    float *f1w = W("mlp.fc1.weight"), *f1b = W("mlp.fc1.bias"), *f2w = W("mlp.fc2.weight"), *f2b = W("mlp.fc2.bias");
#undef W
    float *ln1 = zerosf(N * D), m1[10], s1[10], *qkv = zerosf(N * 3 * D), *att = zerosf(B * H * T * T);
    float *atty = zerosf(N * D), *res1 = zerosf(N * D), *ln2 = zerosf(N * D), m2[10], s2[10];
    float *h = zerosf(N * M), *a = zerosf(N * M), *y = zerosf(N * D);
    attn_segment seg = {.nseq = B, .seqlen = T, .lens = lens};
    layernorm_forward_f32(ln1, m1, s1, x, l1w, l1b, N, D, 1e-6);
    linear_forward_f32(qkv, ln1, qw, qb, N, D, 3 * D, 0);
    attention_forward_f32(atty, att, qkv, &seg, D, H);
    memcpy(res1, x, sizeof(float) * N * D);
    linear_forward_f32(res1, atty, ow, ob, N, D, D, 1);
    layernorm_forward_f32(ln2, m2, s2, res1, l2w, l2b, N, D, 1e-6);
    linear_forward_f32(h, ln2, f1w, f1b, N, D, M, 0);
    act_forward_f32(a, h, (size_t)N * M, VLMOE_ACT_GELU);
    memcpy(y, res1, sizeof(float) * N * D);
    linear_forward_f32(y, a, f2w, f2b, N, M, D, 1);
    compare_fixture(f, "y", y, 2e-6);
    // backward
    float *g[12];
    const size_t sz[12] = {D, D, 3 * D * D, 3 * D, D * D, D, D, D, M * D, M, D * M, D};
    for (int i = 0; i < 12; i++) g[i] = zerosf(sz[i]);
    float *dres = zerosf(N * D), *da = zerosf(N * M), *dh = zerosf(N * M), *dln = zerosf(N * D);
    float *datty = zerosf(N * D), *dqkv = zerosf(N * 3 * D), *datt = zerosf(B * H * T * T);
    memcpy(dres, r, sizeof(float) * N * D);
    linear_backward_f32(da, g[10], g[11], dres, a, f2w, N, M, D);
    act_backward_f32(dh, h, da, (size_t)N * M, VLMOE_ACT_GELU);
    linear_backward_f32(dln, g[8], g[9], dh, ln2, f1w, N, D, M);
    layernorm_backward_f32(dres, g[6], g[7], dln, res1, l2w, m2, s2, N, D);
    linear_backward_f32(datty, g[4], g[5], dres, atty, ow, N, D, D);
    attention_backward_f32(dqkv, datt, datty, qkv, att, &seg, D, H);
    memset(dln, 0, sizeof(float) * N * D);
    linear_backward_f32(dln, g[2], g[3], dqkv, ln1, qw, N, D, 3 * D);
    layernorm_backward_f32(dres, g[0], g[1], dln, x, l1w, m1, s1, N, D);
    compare_fixture(f, "dx", dres, 1e-5);
    const char *names[12] = {"ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.out.weight",
                             "attn.out.bias", "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                             "mlp.fc2.weight", "mlp.fc2.bias"};
    for (int i = 0; i < 12; i++) {
        char nm[96];
        snprintf(nm, sizeof(nm), "grad.block.%s", names[i]);
        compare_fixture(f, nm, g[i], 1e-5);
        free(g[i]);
    }
    float *all[] = {x, r, l1w, l1b, qw, qb, ow, ob, l2w, l2b, f1w, f1b, f2w, f2b, ln1, qkv, att, atty,
                    res1, ln2, h, a, y, dres, da, dh, dln, datty, dqkv, datt};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) free(all[i]);
    free(lens);
    vlmoe_st_close(f);
}

static double meta_num(const vlmoe_st *f, const char *key) {
    const char *s = vlmoe_st_metadata(f, key);
    CHECK(s != NULL, "fixture metadata %s missing", key);
    return s ? atof(s) : 0;
}

static void test_model(const char *arch) {
    char path[512], name[128];
    snprintf(name, sizeof(name), "model_%s.ref.safetensors", arch);
    vlmoe_st *f = open_fixture(name);
    if (!f) return;
    snprintf(path, sizeof(path), "%s/model_%s.init.safetensors", fixture_dir(), arch);
    vlmoe_model *m;
    if (vlmoe_model_load(&m, path) != VLMOE_OK) {
        CHECK(0, "load %s: %s", path, vlmoe_last_error());
        vlmoe_st_close(f);
        return;
    }
    const vlmoe_model_config *cfg = vlmoe_model_get_config(m);
    size_t nimg;
    float *images = get(f, "input.images", &nimg);
    int32_t *tokens = get_i32(f, "input.tokens"), *lens = get_i32(f, "input.lens");
    const int B = (int)(nimg / (3 * (size_t)cfg->image_size * cfg->image_size)), E = cfg->embed_dim;
    float *losses = get(f, "losses", NULL);
    vlmoe_batch batch = {B, images, tokens, lens};
    vlmoe_step_stats s;
    int np;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &np);
    float *P = vlmoe_model_param_data(m), *G = vlmoe_model_grad_data(m);
    vlmoe_optim_params op = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    op.beta1 = (float)meta_num(f, "beta1");
    op.beta2 = (float)meta_num(f, "beta2");
    op.eps = (float)meta_num(f, "eps");
    op.weight_decay = (float)meta_num(f, "weight_decay");
    const float lr = (float)meta_num(f, "lr");
    const double clip = meta_num(f, "clip_norm");
    const int steps = (int)meta_num(f, "steps");
    vlmoe_optim *opt = NULL;
    CHECK(vlmoe_optim_init(&opt, &op, tab, np, vlmoe_model_num_floats(m)) == VLMOE_OK, "optim: %s", vlmoe_last_error());
    for (int step = 0; step < steps && opt; step++) {
        CHECK(vlmoe_model_forward(m, &batch, &s) == VLMOE_OK, "%s forward: %s", arch, vlmoe_last_error());
        vlmoe_model_backward(m);
        CHECK(fabs(s.loss - losses[step]) <= 2e-6 * fabs(losses[step]) + 1e-6,
              "%s: loss at step %d is %.9g, torch says %.9g", arch, step, s.loss, losses[step]);
        if (step == 0) {
            float *ie = zerosf((size_t)B * E), *te = zerosf((size_t)B * E), *lg = zerosf((size_t)B * B);
            vlmoe_model_encode_images(m, images, B, ie);
            vlmoe_model_encode_texts(m, tokens, lens, B, te);
            for (int i = 0; i < B; i++)
                for (int j = 0; j < B; j++) {
                    double d = 0;
                    for (int c = 0; c < E; c++) d += (double)ie[i * E + c] * te[j * E + c];
                    lg[i * B + j] = (float)(s.temperature * d);
                }
            snprintf(name, sizeof(name), "%s step0.logits", arch);
            float *ref = get(f, "step0.logits", NULL);
            if (ref) compare(name, lg, ref, (size_t)B * B, 2e-6);
            free(ref), free(ie), free(te), free(lg);
            vlmoe_model_forward(m, &batch, &s); // restore the training forward for backward
            vlmoe_model_backward(m);
            double worst = 0;
            const char *wname = "";
            for (int k = 0; k < np; k++) {
                snprintf(name, sizeof(name), "grad.%s", tab[k].name);
                float *ref2 = get(f, name, NULL);
                if (!ref2) continue;
                double e = rel_err(G + tab[k].offset, ref2, tab[k].numel);
                if (e > worst) worst = e, wname = tab[k].name;
                CHECK(e <= 2e-5, "%s: gradient of %s: max error %.3g of max |ref|", arch, tab[k].name, e);
                free(ref2);
            }
            printf("%s: %d parameter gradients match torch, worst %.2g (%s)\n", arch, np, worst, wname);
        }
        vlmoe_clip_grad_norm(G, vlmoe_model_num_floats(m), clip);
        vlmoe_optim_step(opt, P, G, lr);
        vlmoe_model_clamp(m);
        if (step == 0 || step == steps - 1) {
            double worst = 0;
            for (int k = 0; k < np; k++) {
                snprintf(name, sizeof(name), "after%d.%s", step + 1, tab[k].name);
                float *ref2 = get(f, name, NULL);
                if (!ref2) continue;
                // parameters move by ~lr per step: compare the update, not the value
                for (size_t i = 0; i < tab[k].numel; i++)
                    worst = fmax(worst, fabs((double)P[tab[k].offset + i] - ref2[i]));
                free(ref2);
            }
            CHECK(worst <= 0.005 * lr * (step + 1), "%s: after %d AdamW steps a parameter differs from "
                  "torch by %.3g (lr %g)", arch, step + 1, worst, lr);
            printf("%s: after %d AdamW steps max |param - torch| = %.2g (lr %g)\n", arch, step + 1, worst, lr);
        }
    }
    vlmoe_optim_free(opt);
    free(images), free(tokens), free(lens), free(losses);
    vlmoe_model_free(m);
    vlmoe_st_close(f);
}

// One MoE layer (24 tokens, width 8, 4 experts, hidden 16) against the PyTorch reference in
// tests/ref/gen_moe_layer.py: output, weighted auxiliary loss and every gradient, with the
// routing noise injected explicitly. LIMoE E.3's cases also give per_modality (a router per
// modality) and text_experts (disjoint pools).
static void test_moe_layer_case(const char *name) {
    char file[128];
    snprintf(file, sizeof(file), "moe_layer_%s.safetensors", name);
    vlmoe_st *f = open_fixture(file);
    if (!f) return;
    const int S = 24, D = 8, E = 4, M = 16;
    vlmoe_moe_config mc;
    memset(&mc, 0, sizeof(mc));
    mc.router = !strcmp(vlmoe_st_metadata(f, "router"), "tokens") ? VLMOE_ROUTER_TOKENS : VLMOE_ROUTER_EXPERTS;
    mc.layers = 1;
    mc.num_experts = E;
    mc.top_k = atoi(vlmoe_st_metadata(f, "top_k"));
    mc.capacity_factor = mc.eval_capacity_factor = atof(vlmoe_st_metadata(f, "capacity_factor"));
    mc.capacity_multiple = 1;
    mc.order = !strcmp(vlmoe_st_metadata(f, "order"), "bpr") ? VLMOE_ORDER_BPR : VLMOE_ORDER_FIFO;
    mc.gate_renorm = atoi(vlmoe_st_metadata(f, "renorm")) ? VLMOE_RENORM_AFTER_ROUTING : VLMOE_RENORM_NONE;
    mc.noise_std = atof(vlmoe_st_metadata(f, "noise_std"));
    mc.global_tau[0] = log(20.0), mc.global_tau[1] = log(9.0);
    const char *pm = vlmoe_st_metadata(f, "per_modality"), *te = vlmoe_st_metadata(f, "text_experts");
    mc.router_per_modality = pm ? atoi(pm) : 0;
    mc.text_experts = te ? atoi(te) : 0;
    char aux[512];
    snprintf(aux, sizeof(aux), "%s", vlmoe_st_metadata(f, "aux"));
    for (char *tok = strtok(aux, ","); tok; tok = strtok(NULL, ",")) {
        char *eq = strchr(tok, '=');
        *eq = 0;
        for (int k = 0; k < VLMOE_AUX_COUNT; k++)
            if (!strcmp(vlmoe_aux_name((vlmoe_aux_kind)k), tok)) mc.aux_weight[k] = atof(eq + 1);
    }
    moe_spec sp = {&mc, D, M, VLMOE_ACT_GELU_TANH, 0, 0, 0, 0, 0, (size_t)-1, (size_t)-1, 0, 0, 0, 0};
    size_t off = 0;
    sp.router_w = off, off += (size_t)(mc.router_per_modality ? 2 : 1) * E * D;
    sp.w1 = off, off += (size_t)E * M * D;
    sp.b1 = off, off += (size_t)E * M;
    sp.w2 = off, off += (size_t)E * D * M;
    sp.b2 = off, off += (size_t)E * D;
    float *P = zerosf(off), *G = zerosf(off);
    const char *pn[5] = {"router", "w1", "b1", "w2", "b2"};
    const size_t po[5] = {sp.router_w, sp.w1, sp.b1, sp.w2, sp.b2};
    for (int i = 0; i < 5; i++) {
        size_t n;
        float *v = get(f, pn[i], &n);
        if (v) memcpy(P + po[i], v, sizeof(float) * n);
        free(v);
    }
    float *x = get(f, "x", NULL), *r = get(f, "r", NULL), *noisef = get(f, "noise", NULL);
    double noise[24 * 4];
    for (int i = 0; i < S * E && noisef; i++) noise[i] = noisef[i];
    uint8_t mod[24];
    for (int i = 0; i < S; i++) mod[i] = i >= 16;
    moe_state_f32 *st = NULL;
    float *out = zerosf((size_t)S * D), *dx = zerosf((size_t)S * D);
    double auxv = 0;
    vlmoe_moe_stats stats;
    memset(&stats, 0, sizeof(stats));
    moe_call c = {S, 1, 0, mod, noise, NULL, NULL};
    CHECK(moe_state_create_f32(&st, &sp, backend_cpu_f32(), S) == VLMOE_OK, "moe state: %s", vlmoe_last_error());
    if (st && x && r && noisef) {
        CHECK(moe_forward_f32(st, &c, P, x, out, &auxv, &stats) == VLMOE_OK, "%s forward: %s", name, vlmoe_last_error());
        moe_backward_f32(st, P, G, x, r, dx, 1.0);
        char what[96];
        snprintf(what, sizeof(what), "moe %s out", name);
        compare_fixture(f, "out", out, 2e-6);
        float *ra = get(f, "aux", NULL);
        if (ra) CHECK(fabs(auxv - ra[0]) <= 1e-5 * fabs(ra[0]) + 1e-9, "moe %s aux %.9g vs torch %.9g", name, auxv, ra[0]);
        free(ra);
        compare_fixture(f, "dx", dx, 1e-5);
        const char *gn[5] = {"drouter", "dw1", "db1", "dw2", "db2"};
        for (int i = 0; i < 5; i++) compare_fixture(f, gn[i], G + po[i], 1e-5);
        printf("moe layer %s: success image %.3f text %.3f, aux %.6f: output and gradients match torch\n", name,
               stats.success[0], stats.success[1], auxv);
        // disjoint pools: every choice vlmoe made lies in the token's pool, and it accepted the
        // assignments the reference did
        if (mc.text_experts) {
            float *acc = get(f, "accepted", NULL);
            vlmoe_token_route rt[24 * 2];
            int n = 0, out_of_pool = 0, differ = 0;
            CHECK(moe_routing_f32(st, rt, 48, &n) == VLMOE_OK && n == S * mc.top_k, "moe %s routing: %s", name,
                  vlmoe_last_error());
            for (int i = 0; acc && i < n; i++) {
                out_of_pool += (rt[i].expert >= E - mc.text_experts) != (rt[i].modality == 1);
                differ += !rt[i].dropped != (acc[rt[i].token * E + rt[i].expert] != 0);
            }
            CHECK(acc && out_of_pool == 0 && differ == 0, "moe %s: %d of %d choices outside the token's pool, "
                  "%d accepted differently from torch", name, out_of_pool, n, differ);
            free(acc);
        }
        (void)what;
    }
    moe_state_free_f32(st);
    free(P), free(G), free(x), free(r), free(noisef), free(out), free(dx);
    vlmoe_st_close(f);
}

// VL-MoE's MoME model against tests/ref/gen_mome.py: the fixture's inputs (B = 3, the explicit
// masks and labels) and the router noise of every MoE layer of the encoding being run.
typedef struct {
    const vlmoe_st *f;
    float *images;                               // (B,C,H,W)
    int32_t *tokens, *lens, *tl, *pl, *cl;       // (B,Tt), (B), (B,Tt), (B,np), (B)
    double *const *noise;                        // [MoE layer] (n,E); NULL: not run by the encoding
} mome_fixture;

// One model of the test, its graph and its gradient buffer.
typedef struct {
    const char *what;  // printed name
    vlmoe_model *m;
    mome_graph_f32 *g;
    float *G;          // (total)
} mome_side;

static int mome_side_open(mome_side *sd, const char *what, const char *file, int B) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", fixture_dir(), file);
    *sd = (mome_side){what, NULL, NULL, NULL};
    if (vlmoe_model_load(&sd->m, path) != VLMOE_OK) {
        CHECK(0, "load %s: %s", path, vlmoe_last_error());
        return 0;
    }
    if (mome_graph_create_f32(&sd->g, &sd->m->L, backend_cpu_f32(), B) != VLMOE_OK) {
        CHECK(0, "mome graph of %s: %s", path, vlmoe_last_error());
        return 0;
    }
    sd->G = zerosf(sd->m->L.total);
    return 1;
}

static void mome_side_close(mome_side *sd) {
    mome_graph_free_f32(sd->g);
    vlmoe_model_free(sd->m);
    free(sd->G);
}

// Reads a fixture scalar into *v; 0 (and a failed check) if it is missing.
static int mome_scalar(const vlmoe_st *f, const char *name, double *v) {
    float *r = get(f, name, NULL);
    const int ok = r != NULL;
    if (ok) *v = r[0];
    free(r);
    return ok;
}

// Loads the router noise "PREFIX.noise.I" of every MoE layer I into noise[I] (doubles; NULL where
// the fixture has none: the forward does not run that layer), freeing what was there.
static void mome_noise(const vlmoe_st *f, const char *prefix, double **noise, int nmoe) {
    char name[160];
    for (int i = 0; i < nmoe && i < 64; i++) {
        free(noise[i]);
        noise[i] = NULL;
        snprintf(name, sizeof(name), "%s.noise.%d", prefix, i);
        if (vlmoe_st_find(f, name) < 0) continue;
        size_t n;
        float *v = get(f, name, &n);
        if (!v) continue;
        noise[i] = malloc(sizeof(double) * n);
        for (size_t k = 0; k < n; k++) noise[i][k] = v[k];
        free(v);
    }
}

// The worst gradient errors of one run: over all tensors, over cls_head.*, over the retrieval
// head (itc.*, logit_scale).
typedef struct {
    double worst, cls, itc;
    const char *wname;
} grad_report;

// Every parameter gradient G against the fixture's "KEYgrad.NAME" (max abs error over max |ref|,
// tolerance 2e-5); a tensor the run does not reach has an exactly zero gradient on both sides.
static grad_report mome_grads(const vlmoe_st *f, const model_layout *L, const float *G, const char *key,
                              const char *what) {
    grad_report r = {0, 0, 0, ""};
    char name[192];
    for (int k = 0; k < L->nparams; k++) {
        snprintf(name, sizeof(name), "%sgrad.%s", key, L->table[k].name);
        float *ref = get(f, name, NULL);
        if (!ref) continue;
        double err = 0, den = 1e-30;
        for (size_t i = 0; i < L->table[k].numel; i++) {
            err = fmax(err, fabs((double)G[L->table[k].offset + i] - ref[i]));
            den = fmax(den, fabs((double)ref[i]));
        }
        err = den > 1e-30 ? err / den : err;
        if (err > r.worst) r.worst = err, r.wname = L->table[k].name;
        if (!strncmp(L->table[k].name, "cls_head.", 9)) r.cls = fmax(r.cls, err);
        if (!strncmp(L->table[k].name, "itc.", 4) || !strcmp(L->table[k].name, "logit_scale")) r.itc = fmax(r.itc, err);
        CHECK(err <= 2e-5, "%s: gradient of %s: max error %.3g of max |ref|", what, L->table[k].name, err);
        free(ref);
    }
    return r;
}

// A loss against the fixture's scalar `name` (2e-6 relative + 1e-7); *lerr keeps the worst
// relative error over the nonzero ones.
static void mome_loss(const vlmoe_st *f, const char *name, double got, const char *what, double *lerr) {
    double ref = 0;
    if (!mome_scalar(f, name, &ref)) return;
    if (ref != 0) *lerr = fmax(*lerr, fabs(got - ref) / fabs(ref));
    CHECK(fabs(got - ref) <= 2e-6 * fabs(ref) + 1e-7, "%s: %s %.9g, torch %.9g", what, name, got, ref);
}

// One forward and backward of encoding e on side sd, without class labels or (labels) with the
// fixture's: every loss, the final hidden states, the class scores of a model with a head, and
// every parameter gradient against torch's. The fixture keys of a run with labels that differ
// from those without (the total loss, the gradients) carry the prefix "ENC.cls."; the class
// scores (ENC.cls.logits) do not depend on the labels.
static void mome_run(const mome_fixture *fx, mome_side *sd, int e, int labels) {
    static const char *const encs[3] = {"image", "text", "pair"};
    const model_layout *L = &sd->m->L;
    const int B = 3, D = L->enc[0].width, NC = L->cfg.num_classes;
    const char *run = labels ? "cls." : "";
    char name[192];
    for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(sd->g, i, fx->noise[i]);
    mome_input_f32 in = {e, e != VLMOE_ENC_TEXT ? fx->images : NULL, e != VLMOE_ENC_IMAGE ? fx->tokens : NULL,
                         fx->lens, e != VLMOE_ENC_IMAGE ? fx->tl : NULL, e != VLMOE_ENC_TEXT ? fx->pl : NULL,
                         labels ? fx->cl : NULL};
    vlmoe_mome_stats s;
    mome_graph_set_mode_f32(sd->g, 1, 0);
    if (mome_graph_forward_f32(sd->g, sd->m->params, &in, &s) != VLMOE_OK) {
        CHECK(0, "mome %s %s forward: %s", sd->what, encs[e], vlmoe_last_error());
        return;
    }
    // losses: the total and the classification loss depend on the labels, the others do not
    const double got[5] = {s.loss, s.text, s.image, s.aux, s.cls};
    const char *parts[5] = {"loss", "text", "image", "aux", "cls"};
    double lerr = 0; // the worst |loss - torch's| / |torch's| over the nonzero ones
    for (int k = 0; k < 5; k++) {
        double ref = 0;
        if (k == 4 && !labels) { // no class labels: no classification loss
            CHECK(got[k] == 0 && s.cls_count == 0, "mome %s %s: classification loss %.9g over %d sequences "
                  "without class labels", sd->what, encs[e], got[k], s.cls_count);
            continue;
        }
        snprintf(name, sizeof(name), "%s.%s%s", encs[e], k == 0 || k == 4 ? run : "", parts[k]);
        if (!mome_scalar(fx->f, name, &ref)) continue;
        if (ref != 0) lerr = fmax(lerr, fabs(got[k] - ref) / fabs(ref));
        CHECK(fabs(got[k] - ref) <= 2e-6 * fabs(ref) + 1e-7, "mome %s %s: %s %.9g, torch %.9g", sd->what,
              encs[e], parts[k], got[k], ref);
    }
    if (labels) CHECK(s.cls_count == B, "mome %s %s: %d sequences classified, want %d", sd->what, encs[e],
                      s.cls_count, B);
    int T;
    const float *hid = mome_graph_hidden_f32(sd->g, &T);
    snprintf(name, sizeof(name), "%s.hidden", encs[e]);
    float *href = get(fx->f, name, NULL);
    const double herr = href ? rel_err(hid, href, (size_t)B * T * D) : 1;
    CHECK(herr <= 2e-6, "mome %s %s: hidden states: max error %.3g of max |ref|", sd->what, encs[e], herr);
    free(href);
    // the class scores: the pooled feature (mean of the patches, or the [T_CLS]) through cls_head
    const float *logits = mome_graph_logits_f32(sd->g);
    double cerr = 0;
    if (NC > 0) {
        snprintf(name, sizeof(name), "%s.cls.logits", encs[e]);
        float *lref = get(fx->f, name, NULL);
        cerr = lref && logits ? rel_err(logits, lref, (size_t)B * NC) : 1;
        CHECK(cerr <= 2e-6, "mome %s %s: class scores: max error %.3g of max |ref|", sd->what, encs[e], cerr);
        free(lref);
    } else {
        CHECK(logits == NULL, "mome %s %s: class scores without a head", sd->what, encs[e]);
    }
    memset(sd->G, 0, sizeof(float) * L->total);
    mome_graph_backward_f32(sd->g, sd->m->params, sd->G);
    // a tensor the run does not reach (cls_head without labels) has a zero gradient on both sides
    char key[64], what[96];
    snprintf(key, sizeof(key), "%s.%s", encs[e], run);
    snprintf(what, sizeof(what), "mome %s %s", sd->what, encs[e]);
    const grad_report gr = mome_grads(fx->f, L, sd->G, key, what);
    printf("mome %s %s: loss %.6f (text %.6f, image %.6f, cls %.6f, aux %.6f) within %.2g, hidden states "
           "within %.2g", sd->what, encs[e], s.loss, s.text, s.image, s.cls, s.aux, lerr, herr);
    if (NC > 0) printf(", class scores within %.2g", cerr);
    printf(", %d parameter gradients match torch, worst %.2g (%s)", L->nparams, gr.worst, gr.wname);
    if (NC > 0) printf(", cls_head %.2g", gr.cls);
    printf("\n");
}

// For each encoding (image with MIM labels, text with MLM labels, pair with both), with the
// router noise of every MoE layer injected and ample capacity: the model without a head, then
// the same weights with a classification head of 3 classes (gen_mome.py's
// mome_cls.init.safetensors) without and with class labels.
static void test_mome(void) {
    vlmoe_st *f = open_fixture("mome.ref.safetensors");
    if (!f) return;
    const int B = 3;
    mome_side plain = {0}, head = {0}; // closing either is safe even if its open never ran
    const int ok = mome_side_open(&plain, "no head", "mome.init.safetensors", B) &&
                   mome_side_open(&head, "head", "mome_cls.init.safetensors", B);
    if (ok) CHECK(plain.m->L.nmoe == head.m->L.nmoe && head.m->L.cfg.num_classes == 3 &&
                  plain.m->L.cfg.num_classes == 0, "mome: the two fixture models differ beyond the head");
    double *noise[64] = {0};
    mome_fixture fx = {f, get(f, "input.images", NULL), get_i32(f, "input.tokens"), get_i32(f, "input.lens"),
                       get_i32(f, "input.text_labels"), get_i32(f, "input.patch_labels"),
                       get_i32(f, "input.class_labels"), noise};
    const char *encs[3] = {"image", "text", "pair"};
    for (int e = 0; e < 3 && ok && fx.images && fx.tokens && fx.lens && fx.tl && fx.pl && fx.cl; e++) {
        mome_noise(f, encs[e], noise, plain.m->L.nmoe);
        mome_run(&fx, &plain, e, 0);
        mome_run(&fx, &head, e, 0);
        mome_run(&fx, &head, e, 1);
    }
    for (int i = 0; i < 64; i++) free(noise[i]);
    free(fx.images), free(fx.tokens), free(fx.lens), free(fx.tl), free(fx.pl), free(fx.cl);
    mome_side_close(&plain);
    mome_side_close(&head);
    vlmoe_st_close(f);
}

// Stochastic depth (gen_mome.py's mome_drop.ref): the pair encoding of mome.ref's inputs on
// mome.init's weights with drop path 0.5 and the fixture's mask (drop.keep, (layers, 2, B)), torch
// scaling the kept branches by 1/keep_prob as timm's drop_path does: the losses, the hidden states
// and every gradient.
static void test_mome_drop(void) {
    vlmoe_st *f = open_fixture("mome_drop.ref.safetensors"), *in = f ? open_fixture("mome.ref.safetensors") : NULL;
    if (!in) {
        vlmoe_st_close(f);
        return;
    }
    const int B = 3;
    mome_side sd = {0};
    double *noise[64] = {0}, rate = -1;
    int32_t *keep = get_i32(f, "drop.keep"), *tok = get_i32(in, "input.tokens"), *lens = get_i32(in, "input.lens");
    int32_t *tl = get_i32(in, "input.text_labels"), *pl = get_i32(in, "input.patch_labels");
    float *images = get(in, "input.images", NULL);
    if (mome_side_open(&sd, "drop path", "mome.init.safetensors", B) && keep && tok && lens && tl && pl && images &&
        mome_scalar(f, "drop.rate", &rate)) {
        const model_layout *L = &sd.m->L;
        const int nl = L->enc[0].layers, D = L->enc[0].width;
        uint8_t km[64 * 2 * 3];
        int dropped = 0;
        for (int i = 0; i < nl * 2 * B && i < 64 * 2 * 3; i++) km[i] = keep[i] != 0, dropped += !keep[i];
        mome_noise(f, "drop", noise, L->nmoe);
        for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(sd.g, i, noise[i]);
        mome_graph_set_drop_path_f32(sd.g, rate);
        mome_graph_set_drop_keep_f32(sd.g, km);
        mome_graph_set_mode_f32(sd.g, 1, 0);
        const mome_input_f32 mi = {VLMOE_ENC_PAIR, images, tok, lens, tl, pl, NULL};
        vlmoe_mome_stats s;
        if (mome_graph_forward_f32(sd.g, sd.m->params, &mi, &s) != VLMOE_OK) {
            CHECK(0, "mome drop path forward: %s", vlmoe_last_error());
        } else {
            double lerr = 0;
            const double got[4] = {s.loss, s.text, s.image, s.aux};
            const char *names[4] = {"drop.loss", "drop.text", "drop.image", "drop.aux"};
            for (int k = 0; k < 4; k++) mome_loss(f, names[k], got[k], "mome drop path", &lerr);
            int T;
            const float *hid = mome_graph_hidden_f32(sd.g, &T);
            float *href = get(f, "drop.hidden", NULL);
            const double herr = href ? rel_err(hid, href, (size_t)B * T * D) : 1;
            CHECK(herr <= 2e-6, "mome drop path: hidden states: max error %.3g of max |ref|", herr);
            free(href);
            memset(sd.G, 0, sizeof(float) * L->total);
            mome_graph_backward_f32(sd.g, sd.m->params, sd.G);
            const grad_report gr = mome_grads(f, L, sd.G, "drop.", "mome drop path");
            printf("mome drop path %.2f (%d of %d branches dropped): loss %.6f within %.2g, hidden states within "
                   "%.2g, %d parameter gradients match torch, worst %.2g (%s)\n", rate, dropped, nl * 2 * B, s.loss,
                   lerr, herr, L->nparams, gr.worst, gr.wname);
        }
    }
    for (int i = 0; i < 64; i++) free(noise[i]);
    free(keep), free(tok), free(lens), free(tl), free(pl), free(images);
    mome_side_close(&sd);
    vlmoe_st_close(in);
    vlmoe_st_close(f);
}

// BEiT-3's captioning attention (gen_mome.py's mome_caption.ref): mome.ref's images and texts as
// caption pairs (VLMOE_ENC_CAPTION: image tokens attend to the image, text tokens to the image and
// causally to the text) with its MLM labels, on mome.init's weights, torch expressing the mask as
// an attn_mask on its text-first order: the losses, the hidden states and every gradient.
static void test_mome_caption(void) {
    vlmoe_st *f = open_fixture("mome_caption.ref.safetensors"), *in = f ? open_fixture("mome.ref.safetensors") : NULL;
    if (!in) {
        vlmoe_st_close(f);
        return;
    }
    const int B = 3;
    mome_side sd = {0};
    double *noise[64] = {0};
    int32_t *tok = get_i32(in, "input.tokens"), *lens = get_i32(in, "input.lens"), *tl = get_i32(in, "input.text_labels");
    float *images = get(in, "input.images", NULL);
    if (mome_side_open(&sd, "caption", "mome.init.safetensors", B) && tok && lens && tl && images) {
        const model_layout *L = &sd.m->L;
        const int D = L->enc[0].width;
        mome_noise(f, "caption", noise, L->nmoe);
        for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(sd.g, i, noise[i]);
        mome_graph_set_mode_f32(sd.g, 1, 0);
        const mome_input_f32 mi = {VLMOE_ENC_CAPTION, images, tok, lens, tl, NULL, NULL};
        vlmoe_mome_stats s;
        if (mome_graph_forward_f32(sd.g, sd.m->params, &mi, &s) != VLMOE_OK) {
            CHECK(0, "mome caption forward: %s", vlmoe_last_error());
        } else {
            double lerr = 0;
            const double got[4] = {s.loss, s.text, s.image, s.aux};
            const char *names[4] = {"caption.loss", "caption.text", "caption.image", "caption.aux"};
            for (int k = 0; k < 4; k++) mome_loss(f, names[k], got[k], "mome caption", &lerr);
            int T;
            const float *hid = mome_graph_hidden_f32(sd.g, &T);
            float *href = get(f, "caption.hidden", NULL);
            const double herr = href ? rel_err(hid, href, (size_t)B * T * D) : 1;
            CHECK(herr <= 2e-6, "mome caption: hidden states: max error %.3g of max |ref|", herr);
            free(href);
            memset(sd.G, 0, sizeof(float) * L->total);
            mome_graph_backward_f32(sd.g, sd.m->params, sd.G);
            const grad_report gr = mome_grads(f, L, sd.G, "caption.", "mome caption");
            printf("mome caption (BEiT-3's captioning mask): loss %.6f (MLM %.6f) within %.2g, hidden states within "
                   "%.2g, %d parameter gradients match torch, worst %.2g (%s)\n", s.loss, s.text, lerr, herr,
                   L->nparams, gr.worst, gr.wname);
        }
    }
    for (int i = 0; i < 64; i++) free(noise[i]);
    free(tok), free(lens), free(tl), free(images);
    mome_side_close(&sd);
    vlmoe_st_close(in);
    vlmoe_st_close(f);
}

// NLVR2 (gen_mome.py's mome_heads.*): the pair encoding of 4 sequences, fixture noise in every
// MoE layer, 2 class labels, no masking; example k reads the fused [T_CLS] of pairs 2k and 2k+1
// side by side. The losses, hidden states, class scores (2, 3) and every gradient against torch.
static void mome_nlvr2(const vlmoe_st *f, mome_side *sd, const float *images, const int32_t *tokens,
                       const int32_t *lens) {
    const model_layout *L = &sd->m->L;
    const int B = 4, D = L->enc[0].width, NC = L->cfg.num_classes;
    double *noise[64] = {0};
    int32_t *cl = get_i32(f, "nlvr2.class_labels");
    mome_noise(f, "nlvr2", noise, L->nmoe);
    for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(sd->g, i, noise[i]);
    const mome_input_f32 in = {VLMOE_ENC_PAIR, images, tokens, lens, NULL, NULL, cl};
    vlmoe_mome_stats s;
    mome_graph_set_mode_f32(sd->g, 1, 0);
    if (!cl || mome_graph_forward_f32(sd->g, sd->m->params, &in, &s) != VLMOE_OK) {
        CHECK(0, "mome nlvr2 forward: %s", vlmoe_last_error());
    } else {
        double lerr = 0;
        mome_loss(f, "nlvr2.loss", s.loss, "mome nlvr2", &lerr);
        mome_loss(f, "nlvr2.cls", s.cls, "mome nlvr2", &lerr);
        mome_loss(f, "nlvr2.aux", s.aux, "mome nlvr2", &lerr);
        CHECK(s.text == 0 && s.image == 0 && s.cls_count == B / 2, "mome nlvr2: text %g, image %g without "
              "masking, %d examples classified (want %d)", s.text, s.image, s.cls_count, B / 2);
        int T;
        const float *hid = mome_graph_hidden_f32(sd->g, &T);
        float *href = get(f, "nlvr2.hidden", NULL), *lref = get(f, "nlvr2.logits", NULL);
        const float *logits = mome_graph_logits_f32(sd->g);
        const double herr = href ? rel_err(hid, href, (size_t)B * T * D) : 1;
        const double cerr = lref && logits ? rel_err(logits, lref, (size_t)(B / 2) * NC) : 1;
        CHECK(herr <= 2e-6, "mome nlvr2: hidden states: max error %.3g of max |ref|", herr);
        CHECK(cerr <= 2e-6, "mome nlvr2: class scores: max error %.3g of max |ref|", cerr);
        free(href), free(lref);
        memset(sd->G, 0, sizeof(float) * L->total);
        mome_graph_backward_f32(sd->g, sd->m->params, sd->G);
        const grad_report gr = mome_grads(f, L, sd->G, "nlvr2.", "mome nlvr2");
        printf("mome nlvr2 (4 pairs, 2 examples): loss %.6f (cls %.6f, aux %.6f) within %.2g, hidden states "
               "within %.2g, class scores within %.2g, %d parameter gradients match torch, worst %.2g (%s), "
               "cls_head %.2g\n", s.loss, s.cls, s.aux, lerr, herr, cerr, L->nparams, gr.worst, gr.wname, gr.cls);
    }
    for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(sd->g, i, NULL);
    for (int i = 0; i < 64; i++) free(noise[i]);
    free(cl);
}

// Retrieval on the same 4 pairs: an image forward on sd's graph (the fixture's noise in its V-MoE
// layers) and a text forward on a second graph (noise in its T-MoE layers), both training; the
// contrastive loss, both MoE losses, both embeddings and every gradient against torch.
static void mome_retrieval(const vlmoe_st *f, mome_side *sd, const float *images, const int32_t *tokens,
                           const int32_t *lens) {
    const model_layout *L = &sd->m->L;
    const int B = 4, E = L->cfg.embed_dim;
    mome_graph_f32 *gt = NULL;
    mome_itc_f32 *c = NULL;
    double *noise[2][64] = {{0}};
    if (mome_graph_create_f32(&gt, L, backend_cpu_f32(), B) != VLMOE_OK || mome_itc_create_f32(&c, L, backend_cpu_f32(), B) != VLMOE_OK) {
        CHECK(0, "mome retrieval: text graph and head: %s", vlmoe_last_error());
        mome_graph_free_f32(gt);
        return;
    }
    mome_graph_f32 *g[2] = {sd->g, gt};
    const mome_input_f32 in[2] = {{VLMOE_ENC_IMAGE, images, NULL, NULL, NULL, NULL, NULL},
                                  {VLMOE_ENC_TEXT, NULL, tokens, lens, NULL, NULL, NULL}};
    const char *side[2] = {"itc.image", "itc.text"};
    vlmoe_mome_stats s[2];
    int ok = 1;
    for (int k = 0; k < 2 && ok; k++) {
        mome_noise(f, side[k], noise[k], L->nmoe);
        for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(g[k], i, noise[k][i]);
        mome_graph_set_mode_f32(g[k], 1, 0);
        ok = mome_graph_forward_f32(g[k], sd->m->params, &in[k], &s[k]) == VLMOE_OK;
        CHECK(ok, "mome retrieval %s forward: %s", side[k], vlmoe_last_error());
    }
    if (ok) {
        double acc[2], lerr = 0, eerr[2] = {0, 0};
        const double itc = mome_itc_forward_f32(c, g[0], g[1], sd->m->params, acc);
        mome_loss(f, "itc.itc", itc, "mome retrieval", &lerr);
        mome_loss(f, "itc.image.aux", s[0].aux, "mome retrieval", &lerr);
        mome_loss(f, "itc.text.aux", s[1].aux, "mome retrieval", &lerr);
        mome_loss(f, "itc.loss", itc + s[0].aux + s[1].aux, "mome retrieval", &lerr);
        for (int k = 0; k < 2; k++) { // the normalised projections of [I_CLS] and [T_CLS]
            char name[64];
            snprintf(name, sizeof(name), "%s.embed", side[k]);
            float *ref = get(f, name, NULL);
            eerr[k] = ref ? rel_err(mome_itc_embed_f32(c, g[k], sd->m->params, k), ref, (size_t)B * E) : 1;
            CHECK(eerr[k] <= 2e-6, "mome retrieval: %s embeddings: max error %.3g of max |ref|", side[k], eerr[k]);
            free(ref);
        }
        memset(sd->G, 0, sizeof(float) * L->total);
        mome_itc_backward_f32(c, g[0], g[1], sd->m->params, sd->G);
        const grad_report gr = mome_grads(f, L, sd->G, "itc.", "mome retrieval");
        printf("mome retrieval (4 pairs): loss %.6f (contrastive %.6f, aux %.6f + %.6f) within %.2g, embeddings "
               "within %.2g / %.2g, %d parameter gradients match torch, worst %.2g (%s), itc.* and logit_scale "
               "%.2g\n", itc + s[0].aux + s[1].aux, itc, s[0].aux, s[1].aux, lerr, eerr[0], eerr[1], L->nparams,
               gr.worst, gr.wname, gr.itc);
    }
    for (int i = 0; i < L->nmoe && i < 64; i++) mome_graph_set_noise_f32(sd->g, i, NULL);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 64; i++) free(noise[k][i]);
    mome_itc_free_f32(c);
    mome_graph_free_f32(gt);
}

// The mome weights of test_mome with both new heads (gen_mome.py's mome_heads.init.safetensors:
// NLVR2's (3, 2 x width) cls_head and the retrieval head) on 4 image-text pairs of their own.
static void test_mome_heads(void) {
    vlmoe_st *f = open_fixture("mome_heads.ref.safetensors");
    if (!f) return;
    mome_side sd = {0};
    float *images = get(f, "heads.images", NULL);
    int32_t *tokens = get_i32(f, "heads.tokens"), *lens = get_i32(f, "heads.lens");
    if (mome_side_open(&sd, "heads", "mome_heads.init.safetensors", 4) && images && tokens && lens) {
        const model_layout *L = &sd.m->L;
        CHECK(L->cfg.num_classes == 3 && L->mome->cs == 2 && L->mome->itc_proj[0] != NO_PARAM &&
              L->mome->itc_proj[1] != NO_PARAM && L->logit_scale != NO_PARAM,
              "mome heads: the fixture model lacks the NLVR2 head of 3 classes or the retrieval head");
        mome_nlvr2(f, &sd, images, tokens, lens);
        mome_retrieval(f, &sd, images, tokens, lens);
    }
    free(images), free(tokens), free(lens);
    mome_side_close(&sd);
    vlmoe_st_close(f);
}

int main(void) {
    test_mome();
    test_mome_drop();
    test_mome_caption();
    test_mome_heads();
    test_ops();
    test_block();
    test_model("one_tower");
    test_model("two_tower");
    test_moe_layer_case("bpr_k1");
    test_moe_layer_case("fifo_k2_renorm");
    test_moe_layer_case("experts_choice");
    test_moe_layer_case("per_modality");
    test_moe_layer_case("pools_bpr_k1");
    test_moe_layer_case("pools_fifo_k2");
    return test_summary("test_parity");
}
