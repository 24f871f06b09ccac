// test_itm.c: image-text matching with hard negatives for VL-MoE retrieval fine-tuning (VLMo's
// recipe, VL-MoE sec. 4.2). The mining distribution worked by hand on fixed similarities (softmax
// of a row / column with the positive left out), a seeded draw that repeats and whose frequencies
// over many keys follow those probabilities; the ITM head (src/nn/mome_itm.c) on a pair graph by
// finite differences in double over every parameter; the model-level step's ITM loss against the
// loss rebuilt from the mined negatives and the head's scores; PyTorch parity of the ITM loss and
// its gradients (tests/ref/gen_itm.py); save-then-resume draws the same negatives bit for bit;
// and `vlmoe finetune --task retrieval --itm` on `vlmoe synth export` data, whose held-out
// recall@1 must rise above the start. Runs $VLMOE_BIN (or $VLMOE_BIN_ASAN) for the CLI part.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "io/safetensors.h"
#include "nn/model.h"
#include "nn/mome.h"
#include "ops/backend.h"
#include "test.h"

// ---- mining: hand-worked probabilities
static void test_mining_golden(void) {
    const double L3 = log(3.0), L4 = log(4.0), e = exp(1.0);
    // row 0 (image 0): texts 1, 2 at 1 and 1 + ln 3: weights e, 3e -> 1/4, 3/4
    // row 1: texts 0, 2 at ln 4 and 0: 4, 1 -> 4/5, 1/5
    // row 2: texts 0, 1 at 0 and 0 -> 1/2, 1/2
    const float sim[9] = {5, 1, (float)(1 + L3), (float)L4, 9, 0, 0, 0, 7};
    // columns (text j's negative image): col 0 rows 1, 2 at ln 4, 0 -> 4/5, 1/5; col 1 rows 0, 2
    // at 1, 0 -> e/(e+1), 1/(e+1); col 2 rows 0, 1 at 1 + ln 3, 0 -> 3e/(3e+1), 1/(3e+1)
    const double want_t[9] = {0, 0.25, 0.75, 0.8, 0, 0.2, 0.5, 0.5, 0};
    const double want_i[9] = {0, 0.8, 0.2, e / (e + 1), 0, 1 / (e + 1), 3 * e / (3 * e + 1), 1 / (3 * e + 1), 0};
    double pt[9], pi[9];
    int32_t nt[3], ni[3];
    CHECK(vlmoe_itm_mine(sim, 3, 42, pt, pi, nt, ni) == VLMOE_OK, "mine: %s", vlmoe_last_error());
    double worst = 0;
    for (int k = 0; k < 9; k++) worst = fmax(worst, fmax(fabs(pt[k] - want_t[k]), fabs(pi[k] - want_i[k])));
    CHECK(worst < 1e-6, "mining probabilities off the hand-worked values by %.3g", worst); // sims are floats
    for (int i = 0; i < 3; i++)
        CHECK(nt[i] != i && ni[i] != i && nt[i] >= 0 && nt[i] < 3 && ni[i] >= 0 && ni[i] < 3,
              "row %d: negatives %d / %d must be another pair", i, nt[i], ni[i]);
    // the same key draws the same negatives; the draw of key 42 is pinned (a changed stream would
    // change every resumed run's negatives)
    int32_t nt2[3], ni2[3];
    vlmoe_itm_mine(sim, 3, 42, NULL, NULL, nt2, ni2);
    CHECK(!memcmp(nt, nt2, sizeof(nt)) && !memcmp(ni, ni2, sizeof(ni)), "the same key gives the same draw");
    printf("mining key 42: negative texts %d %d %d, negative images %d %d %d\n", nt[0], nt[1], nt[2], ni[0], ni[1],
           ni[2]);
    const int32_t pin_t[3] = {2, 0, 1}, pin_i[3] = {1, 0, 0};
    CHECK(!memcmp(nt, pin_t, sizeof(nt)) && !memcmp(ni, pin_i, sizeof(ni)),
          "the draw of key 42 changed: texts %d %d %d, images %d %d %d", nt[0], nt[1], nt[2], ni[0], ni[1], ni[2]);
    // frequencies over many keys follow the probabilities (5 sigma binomial bounds)
    enum { N = 20000 };
    long ct[9] = {0}, ci[9] = {0};
    for (uint64_t key = 0; key < N; key++) {
        vlmoe_itm_mine(sim, 3, vlmoe_itm_key(7, (long)key), NULL, NULL, nt, ni);
        for (int i = 0; i < 3; i++) ct[i * 3 + nt[i]]++, ci[i * 3 + ni[i]]++;
    }
    int off = 0;
    for (int k = 0; k < 9; k++) {
        const double st = 5 * sqrt(N * want_t[k] * (1 - want_t[k])) + 1, si = 5 * sqrt(N * want_i[k] * (1 - want_i[k])) + 1;
        off += fabs(ct[k] - N * want_t[k]) > st || fabs(ci[k] - N * want_i[k]) > si;
    }
    CHECK(off == 0, "%d of 18 draw frequencies outside 5 sigma of the mining probabilities", off);
    printf("mining: %d draws per row, e.g. image 0 -> text 2 %.4f (want 0.75), text 1 -> image 0 %.4f (want %.4f)\n", N,
           (double)ct[2] / N, (double)ci[3] / N, want_i[3]);
    // a positive far above the rest changes nothing: it is left out, not merely down-weighted
    const float sim2[9] = {80, 1, (float)(1 + L3), (float)L4, 80, 0, 0, 0, 80};
    vlmoe_itm_mine(sim2, 3, 1, pt, NULL, nt, ni);
    CHECK(fabs(pt[1] - 0.25) < 1e-6 && fabs(pt[2] - 0.75) < 1e-6 && pt[0] == 0, "positive excluded: %g %g %g", pt[0],
          pt[1], pt[2]);
    const float bad[4] = {1, NAN, 0, 1};
    CHECK(vlmoe_itm_mine(bad, 2, 1, NULL, NULL, nt, ni) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "(0, 1)"),
          "a NaN similarity is refused naming its place: %s", vlmoe_last_error());
    CHECK(vlmoe_itm_mine(sim, 1, 1, NULL, NULL, nt, ni) == VLMOE_ERR_ARG, "B = 1 has no negatives");
}

// ---- the ITM head by finite differences (double)
static vlmoe_model_config small(void) {
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    c.image_size = 8, c.patch_size = 4, c.vocab_size = 11, c.context_length = 5, c.mask_token = 10;
    c.encoder = (vlmoe_encoder_config){8, 3, 2, 16};
    c.vl_layers = 1;
    c.mim_vocab = 6;
    c.moe.layers = c.text_moe.layers = 3;
    c.moe.num_experts = c.text_moe.num_experts = 3;
    c.moe.capacity_factor = c.text_moe.capacity_factor = 1.5;
    c.moe.eval_capacity_factor = c.text_moe.eval_capacity_factor = 3.0;
    c.retrieval_head = c.itm_head = 1;
    c.embed_dim = 6;
    return c;
}

typedef struct {
    model_layout L;
    mome_graph_f64 *g;
    mome_itm_f64 *c;
    double *p;
    mome_input_f64 in;
    const int32_t *lab;
    double acc;
} itm_model;

static double itm_loss(void *ctx) {
    itm_model *m = ctx;
    vlmoe_mome_stats s;
    CHECK(mome_graph_forward_f64(m->g, m->p, &m->in, &s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
    return mome_itm_forward_f64(m->c, m->g, m->p, m->lab, &m->acc) + s.aux;
}

static void test_itm_fd(void) {
    vlmoe_model_config cfg = small();
    itm_model m;
    if (model_layout_build(&m.L, &cfg) != VLMOE_OK) {
        CHECK(0, "layout: %s", vlmoe_last_error());
        return;
    }
    const int n = 6, T = 5; // B = 2: 2 true pairs and 4 negatives, as one step would make them
    CHECK(mome_graph_create_f64(&m.g, &m.L, backend_cpu_f64(), n) == VLMOE_OK, "graph: %s", vlmoe_last_error());
    CHECK(mome_itm_create_f64(&m.c, &m.L, backend_cpu_f64(), n) == VLMOE_OK, "itm: %s", vlmoe_last_error());
    mome_graph_set_mode_f64(m.g, 1, 98);
    float *pf = malloc(sizeof(float) * m.L.total);
    model_layout_init_params(&m.L, pf, 5);
    m.p = malloc(sizeof(double) * m.L.total);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 8);
    for (size_t i = 0; i < m.L.total; i++) m.p[i] = pf[i] + 0.1 * vlmoe_rng_normal(&r);
    double img[6 * 3 * 64];
    for (int i = 0; i < 6 * 3 * 64; i++) img[i] = vlmoe_rng_normal(&r);
    int32_t tok[30], lens[6] = {5, 4, 3, 5, 4, 3};
    for (int b = 0; b < n; b++)
        for (int t = 0; t < T; t++)
            tok[b * T + t] = t == 0 ? 1 : t == lens[b] - 1 ? 2 : t < lens[b] ? 4 + (int)vlmoe_rng_below(&r, 6) : 0;
    const int32_t lab[6] = {1, 1, 0, 0, 0, 0};
    m.lab = lab;
    m.in = (mome_input_f64){VLMOE_ENC_PAIR, img, tok, lens, NULL, NULL, NULL};
    double *g = calloc(m.L.total, sizeof(double)), *v = malloc(sizeof(double) * m.L.total);
    const double loss = itm_loss(&m);
    mome_itm_backward_f64(m.c, m.g, m.p, g);
    int bad = 0, zero_rule = 0;
    double worst = 0;
    for (int k = 0; k < m.L.nparams; k++) {
        const vlmoe_param_info *pi = &m.L.table[k];
        double gmax = 0, fd, gv;
        for (size_t i = 0; i < pi->numel; i++) gmax = fmax(gmax, fabs(g[pi->offset + i]));
        // the pair encoding reaches all but the MLM/MIM heads, the mask token, the contrastive
        // head and the V/T experts of the top (VL) block
        const char *b = strstr(pi->name, "blocks.");
        const int top = b && atoi(b + 7) >= cfg.encoder.layers - cfg.vl_layers;
        const int u = !strstr(pi->name, "mlm_head") && !strstr(pi->name, "mim_head") && !strstr(pi->name, "mask_token") &&
                      !strstr(pi->name, "itc.") && strcmp(pi->name, "logit_scale") &&
                      !(top && (strstr(pi->name, "v_ffn") || strstr(pi->name, "t_ffn")));
        if (u != (gmax > 0)) {
            zero_rule++;
            fprintf(stderr, "itm: %s: %s, but its gradient is %s\n", pi->name, u ? "used" : "unused",
                    gmax > 0 ? "non-zero" : "all zero");
        }
        const double err = test_fd_direction(m.p + pi->offset, g + pi->offset, v, pi->numel, 1e-5, itm_loss, &m, &r, &fd, &gv);
        worst = fmax(worst, err);
        if (err > 1e-6) {
            bad++;
            fprintf(stderr, "itm: %s: directional derivative %.10g, gradient says %.10g (rel err %.2g)\n", pi->name, fd,
                    gv, err);
        }
    }
    CHECK(bad == 0, "itm: %d of %d parameter tensors fail the finite-difference check", bad, m.L.nparams);
    CHECK(zero_rule == 0, "itm: %d tensors break the used <=> non-zero gradient rule", zero_rule);
    // the loss by hand from the head's logits: mean of -log softmax at the label
    vlmoe_mome_stats s;
    mome_graph_forward_f64(m.g, m.p, &m.in, &s);
    const double itm = mome_itm_forward_f64(m.c, m.g, m.p, lab, NULL);
    const double *lg = mome_itm_logits_f64(m.c);
    double want = 0;
    for (int i = 0; i < n; i++) {
        const double a = lg[2 * i], b2 = lg[2 * i + 1], mx = fmax(a, b2);
        want += mx + log(exp(a - mx) + exp(b2 - mx)) - (lab[i] ? b2 : a);
    }
    CHECK(fabs(itm - want / n) < 1e-12, "ITM loss %.12g, by hand %.12g", itm, want / n);
    printf("itm head (fused [T_CLS] of 6 pairs): %d tensors, worst relative finite-difference error %.2g; loss %.4f "
           "(itm %.4f + aux)\n", m.L.nparams, worst, loss, itm);
    free(pf), free(m.p), free(g), free(v);
    mome_itm_free_f64(m.c);
    mome_graph_free_f64(m.g);
    model_layout_free(&m.L);
}


// ---- the config key: itm_head needs the retrieval head; JSON round trip
static void test_config(void) {
    vlmoe_model_config c;
    CHECK(vlmoe_config_from_json("{\"base\": \"vlmoe-tiny\", \"itm_head\": 1}", "cfg.json", &c) == VLMOE_ERR_CONFIG &&
              strstr(vlmoe_last_error(), "itm_head: 1: need 0, or 1 with retrieval_head 1"),
          "itm_head without the retrieval head: %s", vlmoe_last_error());
    CHECK(vlmoe_config_from_json("{\"base\": \"vlmoe-tiny\", \"retrieval_head\": 1, \"itm_head\": 2}", "cfg.json", &c) ==
              VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "itm_head: 2"), "itm_head 2: %s", vlmoe_last_error());
    CHECK(vlmoe_config_from_json("{\"base\": \"vlmoe-tiny\", \"retrieval_head\": 1, \"itm_head\": 1}", "cfg.json", &c) ==
              VLMOE_OK && c.itm_head == 1, "itm_head 1: %s", vlmoe_last_error());
    char *j = vlmoe_config_to_json(&c);
    vlmoe_model_config back;
    CHECK(j && strstr(j, "\"itm_head\"") && vlmoe_config_from_json(j, "round trip", &back) == VLMOE_OK &&
              back.itm_head == 1, "itm_head survives the JSON round trip: %s", j ? j : "(null)");
    free(j);
    vlmoe_config_named("vlmoe-tiny", &c);
    j = vlmoe_config_to_json(&c);
    CHECK(j && !strstr(j, "itm_head"), "a model without the head writes no itm_head key");
    free(j);
}

// ---- PyTorch parity (tests/ref/gen_itm.py): the contrastive step, the mining distribution, and
// with torch's draws the 3B-pair ITM loss, its logits and every gradient, on the same weights
static float *fx_get(const vlmoe_st *f, const char *name, size_t *n) {
    vlmoe_tensor_info ti;
    const int i = vlmoe_st_find(f, name);
    if (i < 0 || vlmoe_st_info(f, i, &ti)) {
        CHECK(0, "fixture tensor %s missing", name);
        return NULL;
    }
    float *v = malloc(sizeof(float) * (ti.numel ? ti.numel : 1));
    if (vlmoe_st_read_f32(f, name, v, ti.numel)) CHECK(0, "read %s: %s", name, vlmoe_last_error());
    if (n) *n = ti.numel;
    return v;
}

static int32_t *fx_i32(const vlmoe_st *f, const char *name) {
    vlmoe_tensor_info ti;
    const int i = vlmoe_st_find(f, name);
    if (i < 0 || vlmoe_st_info(f, i, &ti) || ti.dtype != VLMOE_DT_I32) {
        CHECK(0, "fixture int32 tensor %s missing", name);
        return NULL;
    }
    int32_t *v = malloc(ti.nbytes);
    memcpy(v, ti.data, ti.nbytes);
    return v;
}

// max |a - ref| / max |ref|
static double fx_err(const float *a, const float *ref, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; ref && i < n; i++) num = fmax(num, fabs((double)a[i] - ref[i])), den = fmax(den, fabs((double)ref[i]));
    return ref ? num / den : 1;
}

// Sets the fixture noise "PREFIX.noise.I" of every MoE layer on g; noise[] keeps the buffers.
static void fx_noise(const vlmoe_st *f, const char *prefix, mome_graph_f32 *g, int nmoe, double **noise) {
    char name[96];
    for (int i = 0; i < nmoe && i < 16; i++) {
        snprintf(name, sizeof(name), "%s.noise.%d", prefix, i);
        if (vlmoe_st_find(f, name) < 0) continue;
        size_t n;
        float *v = fx_get(f, name, &n);
        noise[i] = malloc(sizeof(double) * n);
        for (size_t k = 0; k < n; k++) noise[i][k] = v[k];
        free(v);
        mome_graph_set_noise_f32(g, i, noise[i]);
    }
}

static double fx_scalar(const vlmoe_st *f, const char *name) {
    float *v = fx_get(f, name, NULL);
    const double r = v ? v[0] : NAN;
    free(v);
    return r;
}

static void test_parity(void) {
    char path[512];
    snprintf(path, sizeof(path), "%s/itm.ref.safetensors", fixture_dir());
    vlmoe_st *f = NULL;
    vlmoe_model *m = NULL;
    if (vlmoe_st_open(path, &f) != VLMOE_OK) {
        CHECK(0, "cannot open fixture %s (run `make fixtures`): %s", path, vlmoe_last_error());
        return;
    }
    snprintf(path, sizeof(path), "%s/itm.init.safetensors", fixture_dir());
    if (vlmoe_model_load(&m, path) != VLMOE_OK) {
        CHECK(0, "load %s: %s", path, vlmoe_last_error());
        vlmoe_st_close(f);
        return;
    }
    const model_layout *L = &m->L;
    const vlmoe_backend_f32 *be = backend_cpu_f32();
    const int B = 4, E = L->cfg.embed_dim, T = L->cfg.context_length;
    const size_t isz = (size_t)L->cfg.channels * L->cfg.image_size * L->cfg.image_size;
    mome_graph_f32 *gi = NULL, *gt = NULL, *gp = NULL;
    mome_itc_f32 *itc = NULL;
    mome_itm_f32 *itm = NULL;
    double *noise[3][16] = {{0}};
    float *img = fx_get(f, "itm.images", NULL), *G = calloc(L->total, sizeof(float));
    int32_t *tok = fx_i32(f, "itm.tokens"), *len = fx_i32(f, "itm.lens");
    int32_t *nt = fx_i32(f, "itm.neg_text"), *ni = fx_i32(f, "itm.neg_image");
    int ok = img && tok && len && nt && ni && L->cfg.itm_head == 1 && !mome_graph_create_f32(&gi, L, be, B) &&
             !mome_graph_create_f32(&gt, L, be, B) && !mome_graph_create_f32(&gp, L, be, 3 * B) &&
             !mome_itc_create_f32(&itc, L, be, B) && !mome_itm_create_f32(&itm, L, be, 3 * B);
    CHECK(ok, "itm parity setup: %s", vlmoe_last_error());
    vlmoe_mome_stats si, st2, sp;
    if (ok) {
        fx_noise(f, "itm.image", gi, L->nmoe, noise[0]);
        fx_noise(f, "itm.text", gt, L->nmoe, noise[1]);
        fx_noise(f, "itm.pair", gp, L->nmoe, noise[2]);
        mome_graph_set_mode_f32(gi, 1, 0), mome_graph_set_mode_f32(gt, 1, 0), mome_graph_set_mode_f32(gp, 1, 0);
        const mome_input_f32 ii = {VLMOE_ENC_IMAGE, img, NULL, NULL, NULL, NULL, NULL},
                             it = {VLMOE_ENC_TEXT, NULL, tok, len, NULL, NULL, NULL};
        ok = !mome_graph_forward_f32(gi, m->params, &ii, &si) && !mome_graph_forward_f32(gt, m->params, &it, &st2);
        CHECK(ok, "itm parity: forwards: %s", vlmoe_last_error());
    }
    for (int i = 0; i < B && ok; i++) ok = nt[i] >= 0 && nt[i] < B && ni[i] >= 0 && ni[i] < B;
    if (ok) {
        double acc[2];
        const double c = mome_itc_forward_f32(itc, gi, gt, m->params, acc);
        // the mining similarities and distributions from vlmoe's own logits
        const float *ie = mome_itc_embedding_f32(itc, 0), *te = mome_itc_embedding_f32(itc, 1);
        const double t = exp((double)m->params[L->logit_scale]);
        float sim[16], ptf[16], pif[16];
        for (int i = 0; i < B; i++)
            for (int j = 0; j < B; j++) {
                double d = 0;
                for (int e = 0; e < E; e++) d += (double)ie[i * E + e] * te[j * E + e];
                sim[i * B + j] = (float)(t * d);
            }
        double pt[16], pi[16];
        int32_t dt[4], di[4];
        vlmoe_itm_mine(sim, B, 1, pt, pi, dt, di);
        for (int k = 0; k < 16; k++) ptf[k] = (float)pt[k], pif[k] = (float)pi[k];
        float *rs = fx_get(f, "itm.sim", NULL), *rt = fx_get(f, "itm.p_text", NULL), *ri = fx_get(f, "itm.p_image", NULL);
        const double es = fx_err(sim, rs, 16), et = fx_err(ptf, rt, 16), ei = fx_err(pif, ri, 16);
        CHECK(es <= 2e-6 && et <= 1e-5 && ei <= 1e-5, "mining vs torch: similarities %.3g, p_text %.3g, p_image %.3g", es,
              et, ei);
        free(rs), free(rt), free(ri);
        // torch's draws -> the 3B pairs in VLMo's order
        float *pimg = malloc(sizeof(float) * isz * 3 * B);
        int32_t ptok[12 * 64], plen[12], lab[12];
        for (int r = 0; r < 3 * B; r++) {
            const int q = r % B, im = r < B ? q : r < 2 * B ? ni[q] : q, tx = r < 2 * B ? q : nt[q];
            memcpy(pimg + isz * r, img + isz * im, sizeof(float) * isz);
            memcpy(ptok + T * r, tok + T * tx, sizeof(int32_t) * T);
            plen[r] = len[tx], lab[r] = r < B;
        }
        const mome_input_f32 ip = {VLMOE_ENC_PAIR, pimg, ptok, plen, NULL, NULL, NULL};
        ok = T <= 64 && !mome_graph_forward_f32(gp, m->params, &ip, &sp);
        CHECK(ok, "itm parity: pair forward: %s", vlmoe_last_error());
        if (ok) {
            const double l = mome_itm_forward_f32(itm, gp, m->params, lab, NULL);
            const double aux = si.aux + st2.aux + sp.aux, tot = c + l + aux;
            const double want[4] = {fx_scalar(f, "itm.itc"), fx_scalar(f, "itm.itm"), fx_scalar(f, "itm.aux"),
                                    fx_scalar(f, "itm.loss")};
            const double got[4] = {c, l, aux, tot};
            double lerr = 0;
            for (int k = 0; k < 4; k++) lerr = fmax(lerr, fabs(got[k] - want[k]) / (fabs(want[k]) + 1e-30));
            CHECK(lerr <= 2e-6, "losses vs torch: itc %.9g/%.9g itm %.9g/%.9g aux %.9g/%.9g total %.9g/%.9g", c, want[0],
                  l, want[1], aux, want[2], tot, want[3]);
            float *rl = fx_get(f, "itm.logits", NULL);
            const double el = fx_err(mome_itm_logits_f32(itm), rl, 6 * B);
            CHECK(el <= 2e-6, "ITM logits vs torch: %.3g", el);
            free(rl);
            mome_itc_backward_f32(itc, gi, gt, m->params, G);
            mome_itm_backward_f32(itm, gp, m->params, G);
            double worst = 0, head = 0;
            const char *wn = "";
            char name[200];
            for (int k = 0; k < L->nparams; k++) {
                snprintf(name, sizeof(name), "itm.grad.%s", L->table[k].name);
                float *ref = fx_get(f, name, NULL);
                const double e = fx_err(G + L->table[k].offset, ref, L->table[k].numel);
                if (e > worst) worst = e, wn = L->table[k].name;
                if (!strncmp(L->table[k].name, "itm_head.", 9)) head = fmax(head, e);
                CHECK(e <= 2e-5, "gradient of %s vs torch: %.3g", L->table[k].name, e);
                free(ref);
            }
            printf("parity with torch (4 pairs, 12 ITM pairs): itc %.6f itm %.6f aux %.6f within %.2g; mining "
                   "similarities %.2g, probabilities %.2g / %.2g; ITM logits %.2g; %d gradients, worst %.2g (%s), "
                   "itm_head %.2g\n", c, l, aux, lerr, es, et, ei, el, L->nparams, worst, wn, head);
        }
        free(pimg);
    }
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 16; i++) free(noise[k][i]);
    free(img), free(G), free(tok), free(len), free(nt), free(ni);
    mome_itm_free_f32(itm), mome_itc_free_f32(itc);
    mome_graph_free_f32(gi), mome_graph_free_f32(gt), mome_graph_free_f32(gp);
    vlmoe_model_free(m);
    vlmoe_st_close(f);
}

// ---- the model-level step: its ITM loss rebuilt from the mined negatives and the head's scores
static const vlmoe_param_info *param_named(const vlmoe_model *m, const char *name) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

enum { MB = 4, MC = 3 * 8 * 8, MT = 5 };
static float m_img[MB * MC];
static int32_t m_tok[MB * MT], m_len[MB] = {5, 4, 3, 5};

static void make_batch(vlmoe_mome_batch *b) {
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 21);
    for (int i = 0; i < MB * MC; i++) m_img[i] = (float)vlmoe_rng_normal(&r);
    for (int b2 = 0; b2 < MB; b2++)
        for (int t = 0; t < MT; t++)
            m_tok[b2 * MT + t] = t == 0 ? 1 : t == m_len[b2] - 1 ? 2 : t < m_len[b2] ? 4 + (int)vlmoe_rng_below(&r, 6) : 0;
    *b = (vlmoe_mome_batch){.encoding = VLMOE_ENC_PAIR, .batch_size = MB, .images = m_img, .tokens = m_tok,
                            .lengths = m_len};
}

static double softplus(double x) { return x > 0 ? x + log1p(exp(-x)) : log1p(exp(x)); }

static void test_model_step(void) {
    vlmoe_model_config cfg = small();
    vlmoe_model *m = NULL;
    if (vlmoe_model_init(&m, &cfg, 3) != VLMOE_OK) {
        CHECK(0, "model: %s", vlmoe_last_error());
        return;
    }
    vlmoe_mome_batch b;
    make_batch(&b);
    const uint64_t key = vlmoe_itm_key(5, 0);
    vlmoe_mome_stats s, sc;
    CHECK(vlmoe_mome_forward_retrieval_itm(m, &b, key, 0, &s) == VLMOE_OK, "itm forward: %s", vlmoe_last_error());
    CHECK(vlmoe_mome_forward_retrieval(m, m_img, m_tok, m_len, MB, 0, &sc) == VLMOE_OK, "itc: %s", vlmoe_last_error());
    CHECK(s.itc == sc.itc, "the contrastive part %.9g is the contrastive step's %.9g", s.itc, sc.itc);
    CHECK(fabs(s.loss - (s.itc + s.itm + s.aux)) < 1e-9 && s.itm > 0, "loss %.9g = itc %.9g + itm %.9g + aux %.9g",
          s.loss, s.itc, s.itm, s.aux);
    // rebuild: embeddings -> similarities x exp(logit_scale) -> the same mining -> 3B pairs -> ITM
    const int E = cfg.embed_dim;
    float ie[MB * 6], te[MB * 6], sim[MB * MB];
    CHECK(vlmoe_mome_embed(m, VLMOE_ENC_IMAGE, m_img, NULL, NULL, MB, ie) == VLMOE_OK &&
              vlmoe_mome_embed(m, VLMOE_ENC_TEXT, NULL, m_tok, m_len, MB, te) == VLMOE_OK,
          "embed: %s", vlmoe_last_error());
    const vlmoe_param_info *ls = param_named(m, "logit_scale");
    const double t = exp(vlmoe_model_param_data(m)[ls->offset]);
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < MB; j++) {
            double d = 0;
            for (int e = 0; e < E; e++) d += (double)ie[i * E + e] * te[j * E + e];
            sim[i * MB + j] = (float)(t * d);
        }
    int32_t nt[MB], ni[MB];
    vlmoe_itm_mine(sim, MB, key, NULL, NULL, nt, ni);
    float pimg[3 * MB * MC], score[3 * MB];
    int32_t ptok[3 * MB * MT], plen[3 * MB];
    for (int r = 0; r < 3 * MB; r++) {
        const int q = r % MB, im = r < MB ? q : r < 2 * MB ? ni[q] : q, tx = r < 2 * MB ? q : nt[q];
        memcpy(pimg + r * MC, m_img + im * MC, sizeof(float) * MC);
        memcpy(ptok + r * MT, m_tok + tx * MT, sizeof(int32_t) * MT);
        plen[r] = m_len[tx];
    }
    CHECK(vlmoe_mome_itm_scores(m, pimg, ptok, plen, 3 * MB, score) == VLMOE_OK, "scores: %s", vlmoe_last_error());
    double want = 0;
    for (int r = 0; r < 3 * MB; r++) want += r < MB ? softplus(-score[r]) : softplus(score[r]);
    want /= 3 * MB;
    CHECK(fabs(s.itm - want) < 1e-5 * (1 + want), "ITM loss %.9g, rebuilt from the mined pairs %.9g", s.itm, want);
    printf("model step (B = %d): itc %.5f + itm %.5f (rebuilt %.5f) + aux %.5f; negatives texts %d %d %d %d, images "
           "%d %d %d %d\n", MB, s.itc, s.itm, want, s.aux, nt[0], nt[1], nt[2], nt[3], ni[0], ni[1], ni[2], ni[3]);
    // a model without the head says what to do
    vlmoe_model *plain = NULL;
    cfg.itm_head = 0;
    CHECK(vlmoe_model_init(&plain, &cfg, 3) == VLMOE_OK, "plain: %s", vlmoe_last_error());
    CHECK(plain && vlmoe_mome_forward_retrieval_itm(plain, &b, key, 1, &s) == VLMOE_ERR_ARG &&
              strstr(vlmoe_last_error(), "--itm"), "no ITM head: %s", vlmoe_last_error());
    CHECK(plain && vlmoe_mome_itm_scores(plain, pimg, ptok, plen, 3, score) == VLMOE_ERR_ARG &&
              strstr(vlmoe_last_error(), "itm_head"), "no ITM head, no scores: %s", vlmoe_last_error());
    // vlmoe_mome_with_itm: fresh heads on a copy, the rest copied; the config says itm_head 1
    vlmoe_model *w = NULL;
    CHECK(plain && vlmoe_mome_with_itm(&w, plain, 9) == VLMOE_OK && vlmoe_model_get_config(w)->itm_head == 1 &&
              param_named(w, "itm_head.weight") && !param_named(plain, "itm_head.weight"),
          "with_itm: %s", vlmoe_last_error());
    vlmoe_model_free(w);
    vlmoe_model_free(plain);
    vlmoe_model_free(m);
}

// ---- save, then resume: the negatives (keyed by seed and step) and so the weights match bit for bit
static int train_steps(vlmoe_model *m, vlmoe_trainer **t, int n, const char *load, const char *save) {
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 1e-3, 1, 6, 0, 0, 0};
    if (!*t && vlmoe_trainer_init(t, m, &tp)) return 1;
    char st[256];
    if (load) {
        snprintf(st, sizeof(st), "%s.state", load);
        if (vlmoe_trainer_load(*t, load, st, NULL)) return 1;
    }
    vlmoe_mome_batch b;
    make_batch(&b);
    for (int i = 0; i < n; i++)
        if (vlmoe_trainer_step_mome_itm(*t, &b, 5, NULL, NULL)) return 1;
    if (save) {
        snprintf(st, sizeof(st), "%s.state", save);
        vlmoe_data_state ds;
        memset(&ds, 0, sizeof(ds));
        if (vlmoe_trainer_save(*t, save, st, &ds)) return 1;
    }
    return 0;
}

static void test_resume(void) {
    vlmoe_model_config cfg = small();
    vlmoe_model *a = NULL, *b = NULL, *c = NULL;
    vlmoe_trainer *ta = NULL, *tb = NULL, *tc = NULL;
    char path[64];
    snprintf(path, sizeof(path), "/tmp/vlmoe_itm_resume_%d.safetensors", (int)getpid());
    int ok = !vlmoe_model_init(&a, &cfg, 3) && !vlmoe_model_init(&b, &cfg, 3) && !vlmoe_model_init(&c, &cfg, 4);
    ok = ok && !train_steps(a, &ta, 4, NULL, NULL);
    ok = ok && !train_steps(b, &tb, 2, NULL, path) && !train_steps(c, &tc, 2, path, NULL);
    CHECK(ok, "training / checkpoint: %s", vlmoe_last_error());
    if (ok) {
        const size_t n = vlmoe_model_num_floats(a);
        CHECK(!memcmp(vlmoe_model_param_data(a), vlmoe_model_param_data(c), sizeof(float) * n),
              "4 steps in one go and 2 + resume + 2 must give the same weights bit for bit");
        printf("resume: 4 steps = 2 steps, save, load into another model, 2 steps (bit for bit, %zu floats)\n", n);
    }
    char st[80];
    snprintf(st, sizeof(st), "%s.state", path);
    unlink(path), unlink(st);
    vlmoe_trainer_free(ta), vlmoe_trainer_free(tb), vlmoe_trainer_free(tc);
    vlmoe_model_free(a), vlmoe_model_free(b), vlmoe_model_free(c);
}

// ---- `vlmoe finetune --task retrieval --itm` on the synthetic data
static const char *bin;
static char dir[64], out[16384];

static int run(const char *args) { return test_run_in(dir, bin, args, 1, out, sizeof(out)); }

// held-out R@1 image->text and text->image of the last run's report line starting with `what`
static int held_r1(const char *what, double *i2t, double *t2i) {
    const char *p = strstr(out, what);
    return p && sscanf(p + strlen(what), " image->text R@1 %lf R@5 %*f R@10 %*f; text->image R@1 %lf", i2t, t2i) == 2;
}

static void test_cli(const char *argv0) {
    static char abs[4096];
    if (!(bin = test_vlmoe_bin(argv0, abs))) return;
    snprintf(dir, sizeof(dir), "/tmp/vlmoe_itm_XXXXXX");
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp %s", dir);
        return;
    }
    vlmoe_model_config cfg;
    vlmoe_config_named("vlmoe-tiny", &cfg);
    vlmoe_model *pre = NULL;
    CHECK(vlmoe_model_init(&pre, &cfg, 3) == VLMOE_OK && vlmoe_model_save(pre, test_path(dir, "pre.safetensors")) == VLMOE_OK,
          "pre: %s", vlmoe_last_error());
    vlmoe_model_free(pre);
    CHECK(run("synth export --out shapes --n 120") == 0, "synth export:\n%s", out);
    const char *common = "finetune --model pre.safetensors --task retrieval --itm --data shapes/captions.csv "
                         "--image-mean 0.5 --image-std 0.5 --batch-size 16";
    char args[1024];
    double s_i = -1, s_t = -1, f_i = -1, f_t = -1, r_i = -1, r_t = -1;
    snprintf(args, sizeof(args), "%s --steps 1 --lr 1e-9 -o start.safetensors", common); // the start, untrained
    CHECK(run(args) == 0 && held_r1("held-out retrieval (30 pairs):", &s_i, &s_t), "start run:\n%s", out);
    snprintf(args, sizeof(args), "%s --steps 100 --log-every 50 --itm-rerank 8 -o ft.safetensors", common);
    const int st = run(args);
    CHECK(st == 0 && strstr(out, "contrastive + ITM with hard negatives") && strstr(out, "  itm "),
          "ITM fine-tuning: exit %d:\n%s", st, out);
    CHECK(held_r1("held-out retrieval (30 pairs):", &f_i, &f_t) &&
              held_r1("held-out retrieval, top 8 re-ranked by ITM (30 pairs):", &r_i, &r_t), "report lines:\n%s", out);
    printf("finetune --itm (90 train / 30 held-out synthetic pairs, 100 steps): held-out R@1 image->text %.3f -> %.3f, "
           "text->image %.3f -> %.3f; top-8 re-ranked by ITM %.3f / %.3f\n", s_i, f_i, s_t, f_t, r_i, r_t);
    CHECK(f_i > s_i && f_t > s_t, "held-out recall@1 must improve over the start: %.3f -> %.3f, %.3f -> %.3f", s_i, f_i,
          s_t, f_t);
    vlmoe_model *ft = NULL;
    CHECK(vlmoe_model_load(&ft, test_path(dir, "ft.safetensors")) == VLMOE_OK && vlmoe_model_get_config(ft)->itm_head == 1,
          "the written model keeps its ITM head: %s", vlmoe_last_error());
    vlmoe_model_free(ft);
    char *pj = test_read_file(test_path(dir, "ft.safetensors.params.json"), NULL);
    CHECK(pj && strstr(pj, "\"itm\":\ttrue") && strstr(pj, "\"itm_rerank\":\t8"), "params.json records --itm: %s",
          pj ? pj : "(none)");
    free(pj);
    test_expect_in(dir, bin, "finetune --model pre.safetensors --task image-cls --itm --data shapes/classes -o x.safetensors",
                   1, "--itm: image-text matching is a retrieval objective", out, sizeof(out));
    test_expect_in(dir, bin, "finetune --model pre.safetensors --task retrieval --itm-rerank 4 --data shapes/captions.csv "
                   "-o x.safetensors", 1, "--itm-rerank 4", out, sizeof(out));
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "rm %s", dir);
}

int main(int argc, char **argv) {
    test_mining_golden();
    test_config();
    test_itm_fd();
    test_parity();
    test_model_step();
    test_resume();
    test_cli(argv[0]);
    return test_summary("test_itm");
}
