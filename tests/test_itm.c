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
#include "nn/mome.h"
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

int main(int argc, char **argv) {
    test_mining_golden();
    test_itm_fd();
    return test_summary("test_itm");
}
