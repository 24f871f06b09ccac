// test_mome.c: VL-MoE (arch mome). Finite differences in double over every parameter of a tiny
// MoME model with V-MoE and T-MoE layers, for each encoding and objective (MIM on images, MLM on
// texts, VLM on pairs), with the rule that a tensor's gradient is zero exactly when the encoding
// does not use it; the masked cross-entropy's golden value; MLM and MIM masking statistics over
// many seeded draws (binomial bounds); k-means on hand-made clusters and codebook files; the
// float path against the double one; the three encodings, save/load and a few training steps
// through the public API; bad input on purpose. Fine-tuning: the classification head on each
// encoding in the same finite-difference check, the pooling's golden values by hand, and
// freeze_moe keeping every router/expert tensor bit-identical while the rest trains.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "loss/masked.h"
#include "nn/mome.h"
#include "test.h"

// 8x8 images in 4x4 patches (Ti = 5), 5 text tokens of 11 ([MASK] = 10), width 8, 3 blocks, the
// top one with VL-FFN, V-MoE and T-MoE (3 experts) in blocks 0 and 1.
static vlmoe_model_config small(void) {
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    c.image_size = 8, c.patch_size = 4, c.vocab_size = 11, c.context_length = 5, c.mask_token = 10;
    c.encoder = (vlmoe_encoder_config){8, 3, 2, 16};
    c.vl_layers = 1;
    c.mim_vocab = 6;
    c.moe.layers = c.text_moe.layers = 3;
    c.moe.num_experts = c.text_moe.num_experts = 3;
    c.moe.capacity_factor = c.text_moe.capacity_factor = 1.5; // a few drops, most tokens kept
    // ample capacity in eval mode: an item's encoding then does not depend on its batch
    c.moe.eval_capacity_factor = c.text_moe.eval_capacity_factor = 3.0;
    return c;
}

typedef struct {
    model_layout L;
    mome_graph_f64 *g;
    double *p;
    mome_input_f64 in;
} fd_model;

static double loss_of(fd_model *m) {
    vlmoe_mome_stats s;
    int st = mome_graph_forward_f64(m->g, m->p, &m->in, &s);
    CHECK(st == VLMOE_OK, "forward: %s", vlmoe_last_error());
    return s.loss;
}
static double loss_cb(void *m) { return loss_of(m); }

// Whether the encoding reaches this tensor (Figure 1 of VL-MoE).
static int used(const char *name, int enc, int nl, int F, int cls) {
    if (strstr(name, "cls_head")) return cls != 0;
    int blk = -1;
    const char *b = strstr(name, "blocks.");
    if (b) blk = atoi(b + 7);
    const int top = blk >= nl - F;
    if (enc == VLMOE_ENC_IMAGE)
        return !strstr(name, "text.") && !strstr(name, "t_ffn") && !strstr(name, "vl_ffn") && !strstr(name, "mlm_head");
    if (enc == VLMOE_ENC_TEXT)
        return !strstr(name, "image.") && !strstr(name, "v_ffn") && !strstr(name, "vl_ffn") && !strstr(name, "mim_head");
    return !((strstr(name, "v_ffn") || strstr(name, "t_ffn")) && top);
}

// cls: also the classification head on the encoding's pooled feature, with class labels; cls 2:
// the NLVR2 head on two sequences per example (4 sequences, 2 examples).
// drop: stochastic depth rate (0: none) with the fixed mask DROP_KEEP (some branches of each
// sample dropped, the kept ones scaled by 1/(1-rate of their block)).
static const uint8_t DROP_KEEP[3 * 2 * 4] = {1, 0, 1, 1, 1, 1, 0, 1, /* block 0 */ 0, 1, 1, 0, 1, 1, 0, 1,
                                             /* block 1 */ 1, 1, 0, 1, 0, 1, 1, 0 /* block 2 */};
// mlp > 0: that MLP width instead of small()'s
static void fd_check_mlp(int enc, int cls, const char *label, double drop, int mlp) {
    vlmoe_model_config cfg = small();
    if (mlp > 0) cfg.encoder.mlp_dim = mlp;
    cfg.num_classes = cls ? 3 : 0;
    cfg.cls_sequences = cls == 2 ? 2 : 1;
    fd_model m;
    if (model_layout_build(&m.L, &cfg) != VLMOE_OK) {
        CHECK(0, "layout: %s", vlmoe_last_error());
        return;
    }
    const int B = cls == 2 ? 4 : 3, T = 5, np = 4;
    CHECK(mome_graph_create_f64(&m.g, &m.L, backend_cpu_f64(), B) == VLMOE_OK, "graph: %s", vlmoe_last_error());
    // training: noise drawn from a fixed seed every time. A finite difference across a routing
    // decision is no derivative: the seed is one whose draw keeps every test point's decisions
    // more than h from a tie (with position-keyed noise, seed 99 put a BPR near-tie in the pair
    // + classification case within h of the test point: rel err 1.9e-6 on one tensor)
    mome_graph_set_mode_f64(m.g, 1, 98);
    if (drop > 0) mome_graph_set_drop_path_f64(m.g, drop), mome_graph_set_drop_keep_f64(m.g, DROP_KEEP);
    float *pf = malloc(sizeof(float) * m.L.total);
    model_layout_init_params(&m.L, pf, 7);
    m.p = malloc(sizeof(double) * m.L.total);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 3);
    for (size_t i = 0; i < m.L.total; i++) m.p[i] = pf[i] + 0.1 * vlmoe_rng_normal(&r);
    double img[4 * 3 * 64];
    for (int i = 0; i < 4 * 3 * 64; i++) img[i] = vlmoe_rng_normal(&r);
    int32_t tok[20], lens[4] = {5, 4, 3, 4}, tl[20], pl[16];
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            tok[b * T + t] = t == 0 ? 1 : t == lens[b] - 1 ? 2 : t < lens[b] ? 4 + (int)vlmoe_rng_below(&r, 6) : 0;
            tl[b * T + t] = t > 0 && t < lens[b] - 1 && (b + t) % 2 ? 4 + (int)vlmoe_rng_below(&r, 6) : -1;
        }
    tok[1] = 10; // a [MASK] in the input
    for (int i = 0; i < B * np; i++) pl[i] = i % 3 == 1 ? (int)vlmoe_rng_below(&r, 6) : -1;
    const int32_t cl[3] = {2, 0, 2}; // the NLVR2 head reads the first two
    m.in = (mome_input_f64){enc, img, tok, lens, tl, pl, cls ? cl : NULL};
    double *g = calloc(m.L.total, sizeof(double)), *v = malloc(sizeof(double) * m.L.total);
    const double loss0 = loss_of(&m);
    mome_graph_backward_f64(m.g, m.p, g);
    if (drop > 0) { // the mask is the one given, the kept branches scaled by their block's rate
        const double *df = mome_graph_drop_factors_f64(m.g);
        int right = df != NULL;
        for (int i = 0; right && i < 3 * 2 * B; i++) {
            const double rate = drop * (i / (2 * B)) / 2.0;
            right = df[i] == (DROP_KEEP[i] ? 1.0 / (1.0 - rate) : 0.0);
        }
        CHECK(right, "%s: the drop-path factors follow the fixed mask and 1/(1-rate)", label);
    }
    const double h = 1e-5;
    int bad = 0, zero_rule = 0;
    double worst = 0;
    for (int k = 0; k < m.L.nparams; k++) {
        const vlmoe_param_info *pi = &m.L.table[k];
        double gmax = 0;
        for (size_t i = 0; i < pi->numel; i++) gmax = fmax(gmax, fabs(g[pi->offset + i]));
        const int u = used(pi->name, enc, cfg.encoder.layers, cfg.vl_layers, cls);
        if (u != (gmax > 0)) {
            zero_rule++;
            fprintf(stderr, "%s: %s: the encoding %s it, but its gradient is %s\n", label, pi->name,
                    u ? "uses" : "does not use", gmax > 0 ? "non-zero" : "all zero");
        }
        double fd, gv;
        const double err = test_fd_direction(m.p + pi->offset, g + pi->offset, v, pi->numel, h, loss_cb, &m, &r, &fd, &gv);
        worst = fmax(worst, err);
        if (err > 1e-6 && fabs(fd - gv) > test_fd_noise(loss0, h)) {
            bad++;
            fprintf(stderr, "%s: %s: directional derivative %.10g, gradient says %.10g (rel err %.2g)\n", label,
                    pi->name, fd, gv, err);
        }
    }
    CHECK(bad == 0, "%s: %d of %d parameter tensors fail the finite-difference check", label, bad, m.L.nparams);
    CHECK(zero_rule == 0, "%s: %d tensors break the used <=> non-zero gradient rule", label, zero_rule);
    for (int d = 0; d < 2; d++) { // all parameters at once
        double fd, gv;
        test_fd_direction(m.p, g, v, m.L.total, h, loss_cb, &m, &r, &fd, &gv);
        CHECK(fabs(fd - gv) <= 1e-6 * (fabs(fd) + fabs(gv)), "%s: all-parameter direction %d: fd %.10g grad %.10g",
              label, d, fd, gv);
    }
    vlmoe_mome_stats s;
    mome_graph_forward_f64(m.g, m.p, &m.in, &s);
    printf("%s: %d tensors, worst relative finite-difference error %.2g; loss %.4f = text %.4f (%d) + image "
           "%.4f (%d) + cls %.4f (%d) + aux %.5f\n", label, m.L.nparams, worst, s.loss, s.text, s.text_count, s.image,
           s.image_count, s.cls, s.cls_count, s.aux);
    CHECK(cls ? s.cls > 0 && s.cls_count == B / cfg.cls_sequences : s.cls_count == 0, "%s: classification loss %g over %d", label, s.cls,
          s.cls_count);
    CHECK(s.aux > 0, "%s: the MoE auxiliary losses are part of the loss", label);
    free(pf), free(m.p), free(g), free(v);
    mome_graph_free_f64(m.g);
    model_layout_free(&m.L);
}

static void fd_check(int enc, int cls, const char *label, double drop) { fd_check_mlp(enc, cls, label, drop, 0); }

// The retrieval head: an image forward and a text forward of the same 3 pairs, their [I_CLS] and
// [T_CLS] features projected, normalised and compared contrastively; the loss also holds both
// encodings' MoE losses. Every tensor's gradient against central differences.
typedef struct {
    model_layout L;
    mome_graph_f64 *g[2];
    mome_itc_f64 *c;
    double *p;
    mome_input_f64 in[2];
    double acc[2];
} itc_model;

static double itc_loss(void *ctx) {
    itc_model *m = ctx;
    double aux = 0;
    for (int k = 0; k < 2; k++) {
        vlmoe_mome_stats s;
        CHECK(mome_graph_forward_f64(m->g[k], m->p, &m->in[k], &s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
        aux += s.aux;
    }
    return mome_itc_forward_f64(m->c, m->g[0], m->g[1], m->p, m->acc) + aux;
}

static void fd_check_retrieval(void) {
    vlmoe_model_config cfg = small();
    cfg.retrieval_head = 1;
    cfg.embed_dim = 6;
    itc_model m;
    if (model_layout_build(&m.L, &cfg) != VLMOE_OK) {
        CHECK(0, "layout: %s", vlmoe_last_error());
        return;
    }
    const int B = 3, T = 5;
    for (int k = 0; k < 2; k++) {
        CHECK(mome_graph_create_f64(&m.g[k], &m.L, backend_cpu_f64(), B) == VLMOE_OK, "graph: %s", vlmoe_last_error());
        mome_graph_set_mode_f64(m.g[k], 1, 40 + (uint64_t)k);
    }
    CHECK(mome_itc_create_f64(&m.c, &m.L, backend_cpu_f64(), B) == VLMOE_OK, "itc: %s", vlmoe_last_error());
    float *pf = malloc(sizeof(float) * m.L.total);
    model_layout_init_params(&m.L, pf, 5);
    m.p = malloc(sizeof(double) * m.L.total);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 8);
    for (size_t i = 0; i < m.L.total; i++) m.p[i] = pf[i] + 0.1 * vlmoe_rng_normal(&r);
    m.p[m.L.logit_scale] = 1.2; // a temperature of e^1.2 keeps the softmax away from saturation
    double img[3 * 3 * 64];
    for (int i = 0; i < 3 * 3 * 64; i++) img[i] = vlmoe_rng_normal(&r);
    int32_t tok[15], lens[3] = {5, 4, 3};
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            tok[b * T + t] = t == 0 ? 1 : t == lens[b] - 1 ? 2 : t < lens[b] ? 4 + (int)vlmoe_rng_below(&r, 6) : 0;
    m.in[0] = (mome_input_f64){VLMOE_ENC_IMAGE, img, NULL, NULL, NULL, NULL, NULL};
    m.in[1] = (mome_input_f64){VLMOE_ENC_TEXT, NULL, tok, lens, NULL, NULL, NULL};
    double *g = calloc(m.L.total, sizeof(double)), *v = malloc(sizeof(double) * m.L.total);
    const double loss = itc_loss(&m);
    mome_itc_backward_f64(m.c, m.g[0], m.g[1], m.p, g);
    int bad = 0, zero_rule = 0;
    double worst = 0;
    for (int k = 0; k < m.L.nparams; k++) {
        const vlmoe_param_info *pi = &m.L.table[k];
        double gmax = 0, fd, gv;
        for (size_t i = 0; i < pi->numel; i++) gmax = fmax(gmax, fabs(g[pi->offset + i]));
        // used: everything of the image and text encodings but the VL experts and the MLM/MIM heads
        const int u = !strstr(pi->name, "vl_ffn") && !strstr(pi->name, "_head") && !strstr(pi->name, "mask_token");
        if (u != (gmax > 0)) {
            zero_rule++;
            fprintf(stderr, "retrieval: %s: %s, but its gradient is %s\n", pi->name, u ? "used" : "unused",
                    gmax > 0 ? "non-zero" : "all zero");
        }
        const double err = test_fd_direction(m.p + pi->offset, g + pi->offset, v, pi->numel, 1e-5, itc_loss, &m, &r, &fd, &gv);
        worst = fmax(worst, err);
        if (err > 1e-6 && fabs(fd - gv) > test_fd_noise(loss, 1e-5)) {
            bad++;
            fprintf(stderr, "retrieval: %s: directional derivative %.10g, gradient says %.10g (rel err %.2g)\n",
                    pi->name, fd, gv, err);
        }
    }
    CHECK(bad == 0, "retrieval: %d of %d parameter tensors fail the finite-difference check", bad, m.L.nparams);
    CHECK(zero_rule == 0, "retrieval: %d tensors break the used <=> non-zero gradient rule", zero_rule);
    CHECK(loss > 0 && isfinite(loss), "retrieval loss %g", loss);
    printf("retrieval (contrastive on [I_CLS]/[T_CLS]): %d tensors, worst relative finite-difference error %.2g; "
           "loss %.4f\n", m.L.nparams, worst, loss);
    free(pf), free(m.p), free(g), free(v);
    mome_itc_free_f64(m.c);
    mome_graph_free_f64(m.g[0]), mome_graph_free_f64(m.g[1]);
    model_layout_free(&m.L);
}

static void test_xent(void) {
    double logits[6] = {1, 2, 3, 0.5, 0.5, -1}, probs[6], d[6] = {0};
    int32_t lab[2] = {2, 1};
    int right;
    double l = xent_forward_f64(probs, logits, lab, 2, 3, &right);
    // log(e + e^2 + e^3) - 3 and log(2 e^0.5 + e^-1) - 0.5, by hand
    const double want = (log(exp(1) + exp(2) + exp(3)) - 3) + (log(2 * exp(0.5) + exp(-1)) - 0.5);
    CHECK(fabs(l - want) < 1e-12, "xent %.15g, expected %.15g", l, want);
    CHECK(right == 1, "argmax ties go to the lower class: %d right", right);
    xent_backward_f64(d, probs, lab, 2, 3, 0.5);
    CHECK(fabs(d[2] - 0.5 * (probs[2] - 1)) < 1e-15 && fabs(d[0] - 0.5 * probs[0]) < 1e-15, "xent gradient");
}

// |x - p n| within 5 binomial standard deviations
static int binom_ok(long x, long n, double p) { return fabs(x - p * n) <= 5 * sqrt(n * p * (1 - p)) + 1; }

static void test_mlm_mask(void) {
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    vlmoe_mlm_params p = vlmoe_mlm_default_params(&c);
    CHECK(p.prob == 0.15 && p.mask_frac == 0.8 && p.random_frac == 0.1 && p.mask_id == 255, "MLM defaults");
    enum { B = 4000, T = 16 };
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *in = malloc(sizeof(int32_t) * B * T);
    int32_t *lab = malloc(sizeof(int32_t) * B * T), *in2 = malloc(sizeof(int32_t) * B * T);
    int32_t *lab2 = malloc(sizeof(int32_t) * B * T), lens[B];
    long *hist = calloc(256, sizeof(long));
    for (double prob = 0.15; prob < 0.6; prob += 0.35) { // MLM and VLM's 50%
        p.prob = prob;
        for (int b = 0; b < B; b++) {
            lens[b] = 3 + b % (T - 2); // 3..16
            for (int t = 0; t < T; t++)
                tok[b * T + t] = t == 0 ? 1 : t == lens[b] - 1 ? 2 : t < lens[b] ? 3 : 0; // UNK: never a random pick
        }
        CHECK(vlmoe_mlm_mask(&p, 42, tok, lens, B, T, in, lab) == VLMOE_OK, "mlm mask: %s", vlmoe_last_error());
        long cand = 0, chosen = 0, nmask = 0, nrand = 0, nkeep = 0, wrong = 0;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const int i = b * T + t, inner = t > 0 && t < lens[b] - 1;
                cand += inner;
                if (lab[i] < 0) {
                    wrong += in[i] != tok[i];
                    continue;
                }
                wrong += !inner || lab[i] != tok[i];
                chosen++;
                if (in[i] == 255) nmask++;
                else if (in[i] == tok[i]) nkeep++;
                else {
                    nrand++;
                    wrong += in[i] < 4 || in[i] >= 255;
                    hist[in[i]]++;
                }
            }
        CHECK(wrong == 0, "MLM: %ld labels/inputs outside the rule (specials, padding, labels = originals)", wrong);
        CHECK(binom_ok(chosen, cand, prob), "MLM %.2f: %ld of %ld tokens chosen", prob, chosen, cand);
        CHECK(binom_ok(nmask, chosen, 0.8), "MLM: %ld of %ld chosen became [MASK] (80%%)", nmask, chosen);
        CHECK(binom_ok(nrand, chosen, 0.1), "MLM: %ld of %ld chosen became a random token (10%%)", nrand, chosen);
        CHECK(binom_ok(nkeep, chosen, 0.1), "MLM: %ld of %ld chosen were kept (10%%)", nkeep, chosen);
        printf("MLM %.2f over %ld tokens: chosen %.4f, of those [MASK] %.4f random %.4f kept %.4f\n", prob, cand,
               (double)chosen / cand, (double)nmask / chosen, (double)nrand / chosen, (double)nkeep / chosen);
    }
    long total = 0, worst_dev = 0;
    for (int id = 4; id < 255; id++) total += hist[id];
    for (int id = 4; id < 255; id++) // each random id about equally often (251 ids)
        if (!binom_ok(hist[id], total, 1.0 / 251)) worst_dev++;
    CHECK(worst_dev <= 2 && hist[255] == 0, "random tokens: %ld of 251 ids outside 5 sigma of uniform", worst_dev);
    // seeded and reproducible; another seed, other masks; a sequence's mask depends only on (seed, b)
    vlmoe_mlm_mask(&p, 42, tok, lens, B, T, in2, lab2);
    CHECK(!memcmp(in, in2, sizeof(int32_t) * B * T) && !memcmp(lab, lab2, sizeof(int32_t) * B * T), "same seed, same masks");
    vlmoe_mlm_mask(&p, 43, tok, lens, B, T, in2, lab2);
    CHECK(memcmp(lab, lab2, sizeof(int32_t) * B * T), "another seed, other masks");
    vlmoe_mlm_mask(&p, 42, tok, lens, 7, T, in2, lab2);
    CHECK(!memcmp(lab, lab2, sizeof(int32_t) * 7 * T), "the first sequences do not depend on the batch size");
    vlmoe_mlm_params badp = p;
    badp.mask_frac = 0.95;
    CHECK(vlmoe_mlm_mask(&badp, 1, tok, lens, B, T, in, lab) == VLMOE_ERR_ARG, "fractions above 1 refused");
    lens[0] = T + 1;
    CHECK(vlmoe_mlm_mask(&p, 1, tok, lens, B, T, in, lab) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "length"),
          "bad length: %s", vlmoe_last_error());
    free(tok), free(in), free(lab), free(in2), free(lab2), free(hist);
}

static void test_mim_mask(void) {
    enum { G = 14, N = 2000 };
    uint8_t m[G * G], m2[G * G];
    const int target = 78; // rint(0.4 * 196)
    long sum = 0, below = 0, over = 0, masked = 0, with_neighbour = 0, pos[G * G] = {0};
    for (int s = 0; s < N; s++) {
        CHECK(vlmoe_mim_block_mask(G, G, 0.4, (uint64_t)s, m) == VLMOE_OK, "block mask");
        int cnt = 0;
        for (int i = 0; i < G * G; i++) {
            cnt += m[i];
            pos[i] += m[i];
            if (!m[i]) continue;
            const int y = i / G, x = i % G;
            masked++;
            with_neighbour += (y > 0 && m[i - G]) || (y < G - 1 && m[i + G]) || (x > 0 && m[i - 1]) || (x < G - 1 && m[i + 1]);
        }
        sum += cnt;
        over += cnt > target;
        below += cnt < target;
    }
    const double mean = (double)sum / N, blocky = (double)with_neighbour / masked;
    long pmin = N, pmax = 0;
    for (int i = 0; i < G * G; i++) pmin = pos[i] < pmin ? pos[i] : pmin, pmax = pos[i] > pmax ? pos[i] : pmax;
    printf("MIM 14x14, 40%%: mean %.2f of target %d patches masked, %ld of %d masks short of it; %.4f of masked "
           "patches have a masked neighbour; per-patch frequency %.3f..%.3f\n", mean, target, below, N, blocky,
           (double)pmin / N, (double)pmax / N);
    CHECK(over == 0, "%ld masks exceed the 40%% target", over);
    CHECK(mean >= 0.97 * target, "mean masked %.2f, target %d", mean, target);
    CHECK(blocky > 0.97, "masks are blocks: only %.3f of masked patches have a masked neighbour", blocky);
    CHECK(pmin > 0.01 * N && pmax < 0.9 * N, "every position is masked sometimes, none nearly always");
    vlmoe_mim_block_mask(G, G, 0.4, 7, m);
    vlmoe_mim_block_mask(G, G, 0.4, 7, m2);
    CHECK(!memcmp(m, m2, sizeof(m)), "same seed, same block mask");
    vlmoe_mim_block_mask(G, G, 0.4, 8, m2);
    CHECK(memcmp(m, m2, sizeof(m)), "another seed, another block mask");
    long small = 0;
    for (int s = 0; s < 500; s++) { // the tiny models' 4x4 grid: 6 patches
        vlmoe_mim_block_mask(4, 4, 0.4, (uint64_t)s, m);
        int cnt = 0;
        for (int i = 0; i < 16; i++) cnt += m[i];
        CHECK(cnt >= 1 && cnt <= 6, "4x4 mask of %d patches", cnt);
        small += cnt;
    }
    printf("MIM 4x4, 40%%: mean %.2f of 6 patches masked\n", small / 500.0);
    CHECK(vlmoe_mim_block_mask(0, 4, 0.4, 1, m) == VLMOE_ERR_ARG, "empty grid refused");
}

static void test_kmeans(void) {
    // three hand-made clusters of four points: means (0.5, 0.5), (10.5, 10.5), (0.5, 20.5), every
    // point at squared distance 0.5 from its mean
    const float pts[24] = {0, 0, 1, 0, 0, 1, 1, 1, 10, 10, 11, 10, 10, 11, 11, 11, 0, 20, 1, 20, 0, 21, 1, 21};
    const float means[6] = {0.5f, 0.5f, 10.5f, 10.5f, 0.5f, 20.5f};
    float c[6];
    double inertia = -1;
    int32_t ids[12];
    CHECK(vlmoe_kmeans(pts, 12, 2, 3, 20, 5, c, &inertia) == VLMOE_OK, "kmeans: %s", vlmoe_last_error());
    vlmoe_kmeans_assign(c, 3, 2, pts, 12, ids);
    int found = 0;
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < 3; j++) found += c[2 * k] == means[2 * j] && c[2 * k + 1] == means[2 * j + 1];
    CHECK(found == 3, "centroids are the cluster means: (%g %g) (%g %g) (%g %g)", c[0], c[1], c[2], c[3], c[4], c[5]);
    CHECK(fabs(inertia - 0.5) < 1e-6, "inertia %g, by hand 0.5", inertia);
    for (int i = 0; i < 12; i++) CHECK(ids[i] == ids[i / 4 * 4] && ids[i] != ids[(i / 4 * 4 + 4) % 12], "assignment %d", i);
    const float two[4] = {0, 0, 2, 0}, mid[2] = {1, 0};
    vlmoe_kmeans_assign(two, 2, 2, mid, 1, ids);
    CHECK(ids[0] == 0, "a tie goes to the lower id");
    // 16 clusters of 40 noisy points in 12 dimensions: every point with its own cluster
    enum { K = 16, P = 40, DIM = 12 };
    float *x = malloc(sizeof(float) * K * P * DIM), centres[K * DIM], *cb = malloc(sizeof(float) * K * DIM);
    int32_t *id = malloc(sizeof(int32_t) * K * P);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 11);
    for (int i = 0; i < K * DIM; i++) centres[i] = (float)(4 * vlmoe_rng_normal(&r));
    for (int i = 0; i < K * P; i++)
        for (int d = 0; d < DIM; d++) x[i * DIM + d] = centres[(i % K) * DIM + d] + (float)(0.1 * vlmoe_rng_normal(&r));
    CHECK(vlmoe_kmeans(x, K * P, DIM, K, 50, 1, cb, &inertia) == VLMOE_OK, "kmeans 16");
    vlmoe_kmeans_assign(cb, K, DIM, x, K * P, id);
    int pure = 1;
    for (int i = K; i < K * P; i++) pure &= id[i] == id[i % K];
    int distinct = 1;
    for (int a = 0; a < K; a++)
        for (int b = a + 1; b < K; b++) distinct &= id[a] != id[b];
    CHECK(pure && distinct, "16 clusters: assignment accuracy below 100%%");
    CHECK(inertia < 0.2, "16 clusters: mean squared distance %g (noise 0.12)", inertia);
    // codebook files
    char dir[] = "/tmp/vlmoe_test_mome_XXXXXX", path[256];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof(path), "%s/cb.safetensors", dir);
    CHECK(vlmoe_codebook_save(path, cb, K, DIM) == VLMOE_OK, "save codebook: %s", vlmoe_last_error());
    float *back = NULL;
    int k2, d2;
    CHECK(vlmoe_codebook_load(path, K, DIM, &back, &k2, &d2) == VLMOE_OK && back && k2 == K && d2 == DIM &&
              !memcmp(back, cb, sizeof(float) * K * DIM), "codebook round trip: %s", vlmoe_last_error());
    free(back);
    back = NULL;
    CHECK(vlmoe_codebook_load(path, 1024, DIM, &back, &k2, &d2) == VLMOE_ERR_CONFIG && !back &&
              strstr(vlmoe_last_error(), "mim_vocab") && strstr(vlmoe_last_error(), "16 x 12"),
          "size mismatch: %s", vlmoe_last_error());
    vlmoe_model *m;
    vlmoe_model_config cfg = small();
    vlmoe_model_init(&m, &cfg, 1);
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    vlmoe_model_save(m, path);
    CHECK(vlmoe_codebook_load(path, 0, 0, &back, &k2, &d2) == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "vq train"),
          "a model file without a codebook is not a codebook: %s", vlmoe_last_error());
    // the codebook travels with the model: saved, loaded, kept by with_heads, readable as a codebook file
    const int pd = cfg.channels * cfg.patch_size * cfg.patch_size;
    float *mcb = malloc(sizeof(float) * (size_t)cfg.mim_vocab * pd);
    for (int i = 0; i < cfg.mim_vocab * pd; i++) mcb[i] = (float)vlmoe_rng_normal(&r);
    CHECK(vlmoe_mome_set_codebook(m, mcb, K, DIM) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "mim_vocab"),
          "a codebook of the wrong size is refused: %s", vlmoe_last_error());
    CHECK(vlmoe_mome_set_codebook(m, mcb, cfg.mim_vocab, pd) == VLMOE_OK && vlmoe_model_save(m, path) == VLMOE_OK,
          "attach and save: %s", vlmoe_last_error());
    vlmoe_model *loaded = NULL, *headed = NULL;
    CHECK(vlmoe_model_load(&loaded, path) == VLMOE_OK && vlmoe_mome_codebook(loaded) &&
              !memcmp(vlmoe_mome_codebook(loaded), mcb, sizeof(float) * (size_t)cfg.mim_vocab * pd),
          "the loaded model carries the codebook: %s", vlmoe_last_error());
    CHECK(loaded && vlmoe_mome_with_heads(&headed, loaded, 2, 1, 1, 3) == VLMOE_OK && vlmoe_mome_codebook(headed) &&
              !memcmp(vlmoe_mome_codebook(headed), mcb, sizeof(float) * (size_t)cfg.mim_vocab * pd),
          "with_heads keeps the codebook");
    CHECK(vlmoe_codebook_load(path, cfg.mim_vocab, pd, &back, &k2, &d2) == VLMOE_OK && back &&
              !memcmp(back, mcb, sizeof(float) * (size_t)cfg.mim_vocab * pd), "the model file is a codebook file: %s",
          vlmoe_last_error());
    free(back), free(mcb);
    vlmoe_model_free(loaded), vlmoe_model_free(headed);
    vlmoe_model_free(m);
    unlink(path);
    snprintf(path, sizeof(path), "%s/cb.safetensors", dir);
    unlink(path);
    rmdir(dir);
    CHECK(vlmoe_kmeans(x, 3, DIM, K, 5, 1, cb, NULL) == VLMOE_ERR_ARG, "fewer points than clusters refused");
    free(x), free(cb), free(id);
}

static const vlmoe_param_info *param_named(const vlmoe_model *m, const char *name) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

// The head's pooling by hand. (1) ln_final weight 0, bias beta: every final feature is beta, the
// head W = rows e0, e1, e2 and bias (1, 2, 3), so every encoding's scores are beta[0..2] + (1, 2, 3)
// = (1.5, 1, 5). (2) With the model's own weights: image scores are the mean of the final
// features of patches 1..4 ([I_CLS] left out), text scores the [T_CLS] row, pair scores the row
// of the text's [T_CLS] in the fused sequence (position 5), each + bias.
static void test_pooling(void) {
    vlmoe_model_config cfg = small();
    vlmoe_model *base = NULL, *m = NULL;
    CHECK(vlmoe_model_init(&base, &cfg, 5) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!base) return;
    CHECK(vlmoe_mome_with_head(&m, base, 3, 1) == VLMOE_OK, "with head: %s", vlmoe_last_error());
    if (!m) {
        vlmoe_model_free(base);
        return;
    }
    const vlmoe_param_info *w = param_named(m, "cls_head.weight"), *b = param_named(m, "cls_head.bias"),
                           *lw = param_named(m, "encoder.ln_final.weight"), *lb = param_named(m, "encoder.ln_final.bias");
    CHECK(w && b && lw && lb && w->shape[0] == 3 && w->shape[1] == 8 && !param_named(base, "cls_head.bias"),
          "the head (3, 8) is in the table of the model with a head only");
    if (!w || !b || !lw || !lb) {
        vlmoe_model_free(base);
        vlmoe_model_free(m);
        return;
    }
    // the copy keeps every other tensor
    const vlmoe_param_info *q = param_named(base, "encoder.blocks.1.v_ffn.moe.router.weight"),
                           *q2 = param_named(m, "encoder.blocks.1.v_ffn.moe.router.weight");
    CHECK(q && q2 && !memcmp(vlmoe_model_param_data(base) + q->offset, vlmoe_model_param_data(m) + q2->offset,
                             sizeof(float) * q->numel), "with_head copies the router");
    float *P = vlmoe_model_param_data(m);
    memset(P + w->offset, 0, sizeof(float) * w->numel);
    for (int c = 0; c < 3; c++) P[w->offset + c * 8 + c] = 1, P[b->offset + c] = (float)(c + 1);
    float keep_w[8], keep_b[8];
    memcpy(keep_w, P + lw->offset, sizeof(keep_w));
    memcpy(keep_b, P + lb->offset, sizeof(keep_b));
    const float beta[8] = {0.5f, -1, 2, 7, 7, 7, 7, 7};
    memset(P + lw->offset, 0, sizeof(keep_w));
    memcpy(P + lb->offset, beta, sizeof(beta));
    const int B = 2;
    float img[2 * 3 * 64], logits[2 * 3], hid[2 * 10 * 8];
    int32_t tok[10] = {1, 5, 6, 2, 0, 1, 7, 2, 0, 0}, lens[2] = {4, 3};
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 4);
    for (int i = 0; i < 2 * 3 * 64; i++) img[i] = (float)vlmoe_rng_normal(&r);
    const float want[3] = {1.5f, 1, 5};
    for (int e = 0; e < 3; e++) {
        CHECK(vlmoe_mome_logits(m, (vlmoe_encoding)e, img, tok, lens, B, logits) == VLMOE_OK, "logits: %s",
              vlmoe_last_error());
        for (int i = 0; i < B * 3; i++) CHECK_CLOSE(logits[i], want[i % 3], 1e-6, 0, "constant features: score");
    }
    // the same head through the loss: label 2 of scores (1.5, 1, 5)
    int32_t cl[2] = {2, 0};
    vlmoe_mome_batch ib = {VLMOE_ENC_IMAGE, B, img, NULL, NULL, NULL, NULL, cl};
    vlmoe_mome_stats s;
    CHECK(vlmoe_mome_forward(m, &ib, 0, &s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
    const double lse = log(exp(1.5) + exp(1) + exp(5));
    CHECK_CLOSE(s.cls, ((lse - 5) + (lse - 1.5)) / 2, 1e-5, 0, "classification loss by hand");
    CHECK(s.cls_acc == 0.5 && s.cls_count == 2 && s.text_count == 0 && s.image_count == 0, "accuracy %g of %d",
          s.cls_acc, s.cls_count);
    memcpy(P + lw->offset, keep_w, sizeof(keep_w));
    memcpy(P + lb->offset, keep_b, sizeof(keep_b));
    double worst = 0;
    for (int e = 0; e < 3; e++) {
        const int S = vlmoe_mome_seq_len(&cfg, (vlmoe_encoding)e);
        CHECK(vlmoe_mome_encode(m, (vlmoe_encoding)e, img, tok, lens, B, hid) == VLMOE_OK, "encode");
        CHECK(vlmoe_mome_logits(m, (vlmoe_encoding)e, img, tok, lens, B, logits) == VLMOE_OK, "logits");
        for (int i = 0; i < B; i++)
            for (int c = 0; c < 3; c++) {
                const float *h = hid + (size_t)i * S * 8;
                double x = 0;
                if (e == VLMOE_ENC_IMAGE) x = (h[1 * 8 + c] + h[2 * 8 + c] + h[3 * 8 + c] + h[4 * 8 + c]) / 4.0;
                else x = h[(e == VLMOE_ENC_PAIR ? 5 : 0) * 8 + c];
                worst = fmax(worst, fabs(logits[i * 3 + c] - (x + c + 1)));
            }
    }
    CHECK(worst < 1e-5, "scores = pooled feature + bias: worst difference %g", worst);
    // bad input: labels without a head, out of range, a one-class head
    vlmoe_mome_batch bad = ib;
    CHECK(vlmoe_mome_forward(base, &bad, 1, &s) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "no classification head"),
          "labels without a head: %s", vlmoe_last_error());
    cl[1] = 3;
    CHECK(vlmoe_mome_forward(m, &bad, 1, &s) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "class label 3"),
          "label out of range: %s", vlmoe_last_error());
    vlmoe_model *one = NULL;
    CHECK(vlmoe_mome_with_head(&one, base, 1, 1) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "num_classes") && !one,
          "one class: %s", vlmoe_last_error());
    CHECK(vlmoe_mome_logits(base, VLMOE_ENC_IMAGE, img, NULL, NULL, 1, logits) == VLMOE_ERR_ARG, "logits without a head");
    // save/load keeps the head and num_classes
    char path[] = "/tmp/vlmoe_head_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) close(fd);
    vlmoe_model *back = NULL;
    CHECK(vlmoe_model_save(m, path) == VLMOE_OK && vlmoe_model_load(&back, path) == VLMOE_OK, "save/load: %s",
          vlmoe_last_error());
    if (back) {
        CHECK(vlmoe_model_get_config(back)->num_classes == 3 &&
                  !memcmp(vlmoe_model_param_data(back), P, sizeof(float) * vlmoe_model_num_floats(m)),
              "the head survives save/load");
        vlmoe_model_free(back);
    }
    unlink(path);
    printf("pooling: scores match the pooled features to %.2g\n", worst);
    vlmoe_model_free(base);
    vlmoe_model_free(m);
}

// Whether every ".moe." tensor of m equals the one of `before` bit for bit (*moe), and how many
// other tensors changed (*other_changed of *other).
static void compare_params(const vlmoe_model *m, const float *before, int *moe_same, int *moe, int *other_changed,
                           int *other) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    const float *p = vlmoe_model_param_data((vlmoe_model *)m);
    *moe_same = *moe = *other_changed = *other = 0;
    for (int i = 0; i < n; i++) {
        const int same = !memcmp(p + t[i].offset, before + t[i].offset, sizeof(float) * t[i].numel);
        if (strstr(t[i].name, ".moe.")) (*moe)++, *moe_same += same;
        else (*other)++, *other_changed += !same;
    }
}

// freeze_moe (VL-MoE fine-tuning): 30 AdamW steps with weight decay on image classification
// (+ MIM) leave every router and expert tensor bit-identical while the rest trains; without it they
// move. The image classes (by the sign of the mean pixel) are learnt on the training images.
static void test_freeze_moe(void) {
    vlmoe_model_config cfg = small();
    cfg.num_classes = 2;
    const int B = 4, np = 4;
    float img[4 * 3 * 64];
    int32_t cl[4] = {0, 1, 0, 1}, pl[16];
    for (int b = 0; b < B; b++)
        for (int i = 0; i < 3 * 64; i++) img[b * 192 + i] = (cl[b] ? 0.8f : -0.8f) + 0.1f * (float)((i * 7 + b) % 5 - 2);
    for (int i = 0; i < B * np; i++) pl[i] = i % 3 == 0 ? i % 6 : -1;
    const vlmoe_mome_batch batch = {VLMOE_ENC_IMAGE, B, img, NULL, NULL, NULL, pl, cl};
    for (int freeze = 1; freeze >= 0; freeze--) {
        vlmoe_model *m = NULL;
        CHECK(vlmoe_model_init(&m, &cfg, 11) == VLMOE_OK, "init: %s", vlmoe_last_error());
        if (!m) return;
        const size_t n = vlmoe_model_num_floats(m);
        float *before = malloc(sizeof(float) * n);
        memcpy(before, vlmoe_model_param_data(m), sizeof(float) * n);
        vlmoe_train_params tp = vlmoe_train_default_params();
        tp.schedule = (vlmoe_schedule){VLMOE_SCHED_CONST, 3e-3, 0, 30, 0, 0, 0};
        tp.optim.weight_decay = 0.1f;
        tp.freeze_moe = freeze;
        vlmoe_trainer *t = NULL;
        CHECK(vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK, "trainer: %s", vlmoe_last_error());
        vlmoe_mome_stats first, last;
        for (int step = 0; t && step < 30; step++) {
            int st = vlmoe_trainer_step_mome(t, &batch, 1, step ? &last : &first, NULL);
            CHECK(st == VLMOE_OK, "step %d: %s", step, vlmoe_last_error());
            if (st) break;
        }
        int moe_same, nmoe, changed, nother;
        compare_params(m, before, &moe_same, &nmoe, &changed, &nother);
        float logits[8];
        int right = 0;
        CHECK(vlmoe_mome_logits(m, VLMOE_ENC_IMAGE, img, NULL, NULL, B, logits) == VLMOE_OK, "logits");
        for (int b = 0; b < B; b++) right += (logits[2 * b + 1] > logits[2 * b]) == cl[b];
        printf("freeze_moe %d: %d of %d MoE tensors unchanged, %d of %d others changed; cls loss %.4f -> %.4f, "
               "train accuracy %d/%d\n", freeze, moe_same, nmoe, changed, nother, first.cls, last.cls, right, B);
        CHECK(nmoe == 20, "router + 4 expert tensors in the V-MoE and T-MoE of blocks 0 and 1: %d", nmoe);
        if (freeze) {
            CHECK(moe_same == nmoe, "freeze_moe: %d of %d MoE tensors moved", nmoe - moe_same, nmoe);
            const float *g = vlmoe_model_grad_data(m);
            int n2;
            const vlmoe_param_info *tab = vlmoe_model_params(m, &n2);
            double gm = 0;
            for (int i = 0; i < n2; i++)
                if (strstr(tab[i].name, ".moe."))
                    for (size_t k = 0; k < tab[i].numel; k++) gm = fmax(gm, fabs(g[tab[i].offset + k]));
            CHECK(gm == 0, "frozen gradients are zeroed: max %g", gm);
        } else {
            CHECK(moe_same < nmoe, "without freeze_moe the image-side MoE tensors train");
        }
        // image encoding: the text embeddings, T-FFN/T-MoE, VL-FFN and MLM head get no gradient, but
        // weight decay still moves their matrices; the image-side tensors train
        CHECK(changed >= nother / 2, "%d of %d other tensors changed", changed, nother);
        CHECK(last.cls < first.cls && right == B, "classification trains: %.4f -> %.4f, %d/%d right", first.cls, last.cls,
              right, B);
        free(before);
        vlmoe_trainer_free(t);
        vlmoe_model_free(m);
    }
}

// The public API: float forward = double forward, the three encodings, MIM labels, save/load,
// training steps that lower the loss, and bad input.
static void test_api(void) {
    vlmoe_model_config cfg = small();
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &cfg, 5) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!m) return;
    const int B = 4, T = 5, np = 4, D = 8;
    float img[4 * 3 * 64];
    int32_t tok[20], lens[4] = {5, 4, 3, 5}, tl[20], pl[16];
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 9);
    for (int i = 0; i < 4 * 3 * 64; i++) img[i] = (float)vlmoe_rng_normal(&r);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) tok[b * T + t] = t == 0 ? 1 : t == lens[b] - 1 ? 2 : t < lens[b] ? 4 + b + t : 0;
    vlmoe_mlm_params mp = vlmoe_mlm_default_params(&cfg);
    mp.prob = 0.5;
    int32_t in[20];
    CHECK(vlmoe_mlm_mask(&mp, 3, tok, lens, B, T, in, tl) == VLMOE_OK, "mlm");
    float cb[6 * 48];
    for (int i = 0; i < 6 * 48; i++) cb[i] = (float)vlmoe_rng_normal(&r);
    CHECK(vlmoe_mim_labels(&cfg, cb, 6, img, B, 0.4, 5, pl) == VLMOE_OK, "mim labels: %s", vlmoe_last_error());
    int nmasked = 0;
    for (int i = 0; i < B * np; i++) {
        nmasked += pl[i] >= 0;
        CHECK(pl[i] >= -1 && pl[i] < 6, "label %d", pl[i]);
    }
    CHECK(nmasked == B * 2, "4 patches at 40%%: 2 per image, got %d of %d", nmasked, B * np);
    CHECK(vlmoe_mim_labels(&cfg, cb, 5, img, B, 0.4, 5, pl) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "mim_vocab"),
          "codebook size mismatch: %s", vlmoe_last_error());
    // float vs double, pair encoding with both objectives, eval mode
    vlmoe_mome_batch pair = {VLMOE_ENC_PAIR, B, img, in, lens, tl, pl, NULL};
    vlmoe_mome_stats s;
    CHECK(vlmoe_mome_forward(m, &pair, 0, &s) == VLMOE_OK, "pair forward: %s", vlmoe_last_error());
    model_layout L;
    model_layout_build(&L, &cfg);
    mome_graph_f64 *g;
    mome_graph_create_f64(&g, &L, backend_cpu_f64(), B);
    double *p = malloc(sizeof(double) * L.total), img64[4 * 3 * 64];
    for (size_t i = 0; i < L.total; i++) p[i] = vlmoe_model_param_data(m)[i];
    for (int i = 0; i < 4 * 3 * 64; i++) img64[i] = img[i];
    mome_input_f64 in64 = {VLMOE_ENC_PAIR, img64, in, lens, tl, pl, NULL};
    vlmoe_mome_stats s64;
    mome_graph_set_mode_f64(g, 0, 0);
    mome_graph_forward_f64(g, p, &in64, &s64);
    CHECK(fabs(s.loss - s64.loss) <= 1e-5 * fabs(s64.loss), "float loss %.9g vs double %.9g", s.loss, s64.loss);
    CHECK(s.text_count > 0 && s.image_count == nmasked, "labelled positions %d text, %d image", s.text_count, s.image_count);
    // the three encodings: a batch of one equals the same item in a batch of four
    const vlmoe_encoding encs[3] = {VLMOE_ENC_IMAGE, VLMOE_ENC_TEXT, VLMOE_ENC_PAIR};
    for (int e = 0; e < 3; e++) {
        const int S = vlmoe_mome_seq_len(&cfg, encs[e]);
        CHECK(S == (e == 0 ? 5 : e == 1 ? 5 : 10), "sequence length %d", S);
        float *all = malloc(sizeof(float) * B * S * D), *one = malloc(sizeof(float) * S * D);
        CHECK(vlmoe_mome_encode(m, encs[e], img, tok, lens, B, all) == VLMOE_OK, "encode %d: %s", e, vlmoe_last_error());
        CHECK(vlmoe_mome_encode(m, encs[e], img + 2 * 192, tok + 2 * T, lens + 2, 1, one) == VLMOE_OK, "encode one");
        double worst = 0;
        for (int i = 0; i < S * D; i++) worst = fmax(worst, fabs(one[i] - all[2 * S * D + i]));
        CHECK(worst < 1e-5, "encoding %d: batch of one vs batch of four differ by %g", e, worst);
        free(all), free(one);
    }
    // bad input: pairs without texts (or images), labels out of range
    vlmoe_mome_batch bad = pair;
    bad.tokens = NULL;
    CHECK(vlmoe_mome_forward(m, &bad, 1, &s) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "pairs"),
          "pair without texts: %s", vlmoe_last_error());
    bad = pair;
    bad.images = NULL;
    CHECK(vlmoe_mome_forward(m, &bad, 1, &s) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "needs images"),
          "pair without images: %s", vlmoe_last_error());
    bad = pair;
    int32_t badpl[16];
    memcpy(badpl, pl, sizeof(badpl));
    badpl[3] = 6;
    bad.patch_labels = badpl;
    CHECK(vlmoe_mome_forward(m, &bad, 1, &s) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "mim_vocab"),
          "patch label beyond the codebook: %s", vlmoe_last_error());
    CHECK(vlmoe_mome_backward(m, 0) == VLMOE_ERR_ARG, "backward after a failed forward refused");
    vlmoe_batch contrastive = {B, img, tok, lens};
    CHECK(vlmoe_model_forward(m, &contrastive, NULL) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "mome"),
          "contrastive forward of a mome model: %s", vlmoe_last_error());
    // save / load
    char dir[] = "/tmp/vlmoe_test_mome_XXXXXX", path[256];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof(path), "%s/m.safetensors", dir);
    vlmoe_model *back = NULL;
    CHECK(vlmoe_model_save(m, path) == VLMOE_OK, "save: %s", vlmoe_last_error());
    CHECK(vlmoe_model_load(&back, path) == VLMOE_OK, "load: %s", vlmoe_last_error());
    if (back) {
        CHECK(vlmoe_model_get_config(back)->arch == VLMOE_ARCH_MOME && vlmoe_model_num_floats(back) == L.total &&
                  !memcmp(vlmoe_model_param_data(back), vlmoe_model_param_data(m), sizeof(float) * L.total),
              "loaded mome model differs");
        vlmoe_model_free(back);
    }
    unlink(path), rmdir(dir);
    // a few steps on the three objectives lower each loss
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_CONST, 3e-3, 0, 100, 0, 0, 0};
    tp.optim.weight_decay = 0;
    vlmoe_trainer *t;
    CHECK(vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK, "trainer");
    vlmoe_mome_batch parts[3] = {{VLMOE_ENC_TEXT, B, NULL, in, lens, tl, NULL, NULL},
                                 {VLMOE_ENC_IMAGE, B, img, NULL, NULL, NULL, pl, NULL},
                                 {VLMOE_ENC_PAIR, B, img, in, lens, tl, pl, NULL}};
    vlmoe_mome_stats first[3], last[3];
    vlmoe_step_stats ss;
    for (int step = 0; step < 40; step++) {
        int st = vlmoe_trainer_step_mome(t, parts, 3, step ? last : first, &ss);
        CHECK(st == VLMOE_OK, "step %d: %s", step, vlmoe_last_error());
        if (st) break;
    }
    for (int k = 0; k < 3; k++)
        CHECK(last[k].loss < 0.7 * first[k].loss, "objective %d: loss %.4f after 40 steps, %.4f at the first", k,
              last[k].loss, first[k].loss);
    printf("40 steps on one batch: MLM %.3f -> %.3f, MIM %.3f -> %.3f, VLM %.3f -> %.3f\n", first[0].loss,
           last[0].loss, first[1].loss, last[1].loss, first[2].loss, last[2].loss);
    int nst;
    const vlmoe_moe_stats *rs = vlmoe_model_moe_stats(m, &nst);
    CHECK(rs && nst == 4, "4 MoE layers (V and T in blocks 0, 1): %d", nst);
    vlmoe_trainer_free(t);
    free(p);
    mome_graph_free_f64(g);
    model_layout_free(&L);
    vlmoe_model_free(m);
}

// The NLVR2 and retrieval heads through the public API: scores and embeddings recomputed by hand
// from the final hidden states, a model saved and loaded with both heads, retrieval fine-tuning
// that learns to match 4 pairs, and the errors of wrong batch shapes.
static void test_heads_api(void) {
    vlmoe_model_config cfg = small();
    cfg.embed_dim = 5;
    vlmoe_model *base = NULL, *m = NULL, *back = NULL;
    CHECK(vlmoe_model_init(&base, &cfg, 9) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!base) return;
    CHECK(vlmoe_mome_with_heads(&m, base, 3, 2, 1, 2) == VLMOE_OK, "with heads: %s", vlmoe_last_error());
    if (!m) {
        vlmoe_model_free(base);
        return;
    }
    const vlmoe_param_info *w = param_named(m, "cls_head.weight"), *bb = param_named(m, "cls_head.bias"),
                           *pi = param_named(m, "itc.image_proj.weight"), *pt = param_named(m, "itc.text_proj.weight");
    CHECK(w && bb && pi && pt && param_named(m, "logit_scale") && w->shape[1] == 16 && pi->shape[0] == 5 &&
              pi->shape[1] == 8, "NLVR2 head (3, 2x8), projections (5, 8) and logit_scale in the table");
    if (!w || !bb || !pi || !pt) {
        vlmoe_model_free(base), vlmoe_model_free(m);
        return;
    }
    const float *P = vlmoe_model_param_data(m);
    const int n = 4, Ti = 5, Tp = 10, D = 8;
    float img[4 * 3 * 64], hid[4 * 10 * 8], logits[4 * 3], emb[4 * 5];
    int32_t tok[20] = {1, 5, 6, 2, 0, 1, 7, 2, 0, 0, 1, 4, 9, 8, 2, 1, 3, 2, 0, 0}, lens[4] = {4, 3, 5, 3};
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 6);
    for (int i = 0; i < 4 * 3 * 64; i++) img[i] = (float)vlmoe_rng_normal(&r);
    // NLVR2: example k is the pairs 2k and 2k+1; its scores read both fused [T_CLS] features
    CHECK(vlmoe_mome_logits(m, VLMOE_ENC_PAIR, img, tok, lens, n, logits) == VLMOE_OK, "logits: %s", vlmoe_last_error());
    CHECK(vlmoe_mome_encode(m, VLMOE_ENC_PAIR, img, tok, lens, n, hid) == VLMOE_OK, "encode: %s", vlmoe_last_error());
    double err = 0;
    for (int k = 0; k < 2; k++)
        for (int c = 0; c < 3; c++) {
            double z = P[bb->offset + c];
            for (int h = 0; h < 2; h++)
                for (int d = 0; d < D; d++)
                    z += P[w->offset + (size_t)c * 16 + h * D + d] * hid[((size_t)(2 * k + h) * Tp + Ti) * D + d];
            err = fmax(err, fabs(z - logits[k * 3 + c]));
        }
    CHECK(err < 1e-5, "NLVR2 scores from the two fused [T_CLS] features: max error %g", err);
    CHECK(vlmoe_mome_logits(m, VLMOE_ENC_PAIR, img, tok, lens, 3, logits) == VLMOE_ERR_ARG &&
              strstr(vlmoe_last_error(), "multiple"), "3 pairs for a two-pair head: %s", vlmoe_last_error());
    int32_t cl[2] = {1, 2};
    vlmoe_mome_batch odd = {VLMOE_ENC_PAIR, 3, img, tok, lens, NULL, NULL, cl};
    CHECK(vlmoe_mome_forward(m, &odd, 1, NULL) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "two image-text pairs"),
          "odd batch: %s", vlmoe_last_error());
    // retrieval embeddings: the normalised projections of [I_CLS] and [T_CLS]
    for (int e = 0; e < 2; e++) {
        const int S = e ? 5 : Ti;
        CHECK(vlmoe_mome_embed(m, (vlmoe_encoding)e, img, tok, lens, n, emb) == VLMOE_OK, "embed: %s", vlmoe_last_error());
        CHECK(vlmoe_mome_encode(m, (vlmoe_encoding)e, img, tok, lens, n, hid) == VLMOE_OK, "encode: %s", vlmoe_last_error());
        const vlmoe_param_info *pw = e ? pt : pi;
        double eerr = 0;
        for (int i = 0; i < n; i++) {
            double z[5], nn = 0;
            for (int j = 0; j < 5; j++) {
                z[j] = 0;
                for (int d = 0; d < D; d++) z[j] += P[pw->offset + (size_t)j * D + d] * hid[(size_t)i * S * D + d];
                nn += z[j] * z[j];
            }
            for (int j = 0; j < 5; j++) eerr = fmax(eerr, fabs(z[j] / sqrt(nn) - emb[i * 5 + j]));
        }
        CHECK(eerr < 1e-5, "%s embeddings from the first token's feature: max error %g", e ? "text" : "image", eerr);
    }
    CHECK(vlmoe_mome_embed(m, VLMOE_ENC_PAIR, img, tok, lens, n, emb) == VLMOE_ERR_ARG, "pairs are not embedded");
    CHECK(vlmoe_mome_embed(base, VLMOE_ENC_IMAGE, img, tok, lens, n, emb) == VLMOE_ERR_ARG &&
              strstr(vlmoe_last_error(), "retrieval_head"), "no head: %s", vlmoe_last_error());
    // saved and loaded with both heads
    char path[] = "/tmp/vlmoe_heads_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) close(fd);
    CHECK(vlmoe_model_save(m, path) == VLMOE_OK && vlmoe_model_load(&back, path) == VLMOE_OK, "save/load: %s",
          vlmoe_last_error());
    if (back) {
        const vlmoe_model_config *bc = vlmoe_model_get_config(back);
        CHECK(bc->cls_sequences == 2 && bc->retrieval_head == 1 && bc->num_classes == 3 &&
                  !memcmp(vlmoe_model_param_data(back), P, sizeof(float) * vlmoe_model_num_floats(m)),
              "the loaded model has both heads and the same weights");
    }
    remove(path);
    // a retrieval forward of 2 pairs, then of 4: the second re-plans both encodings' graphs and
    // gives the loss of a model that only ever saw batches of 4
    vlmoe_model *twin = NULL;
    vlmoe_mome_stats s2, s4, want4;
    CHECK(vlmoe_mome_with_heads(&twin, base, 3, 2, 1, 2) == VLMOE_OK &&
              vlmoe_mome_forward_retrieval(twin, img, tok, lens, n, 0, &want4) == VLMOE_OK &&
              vlmoe_mome_forward_retrieval(m, img, tok, lens, 2, 0, &s2) == VLMOE_OK &&
              vlmoe_mome_forward_retrieval(m, img, tok, lens, n, 0, &s4) == VLMOE_OK && s4.itc == want4.itc,
          "retrieval loss of 4 pairs after a batch of 2: %.9g, want %.9g (%s)", s4.itc, want4.itc, vlmoe_last_error());
    vlmoe_model_free(twin);
    // retrieval fine-tuning learns to tell 4 pairs apart
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_CONST, 3e-3, 0, 60, 0, 0, 0};
    vlmoe_trainer *t = NULL;
    CHECK(vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK, "trainer: %s", vlmoe_last_error());
    vlmoe_mome_stats first = {0}, last = {0};
    for (int step = 0; t && step < 60; step++) {
        vlmoe_mome_stats s;
        if (vlmoe_trainer_step_mome_retrieval(t, img, tok, lens, n, &s, NULL) != VLMOE_OK) {
            CHECK(0, "retrieval step: %s", vlmoe_last_error());
            break;
        }
        if (!step) first = s;
        last = s;
    }
    vlmoe_mome_stats ev;
    CHECK(vlmoe_mome_forward_retrieval(m, img, tok, lens, n, 0, &ev) == VLMOE_OK, "eval: %s", vlmoe_last_error());
    printf("retrieval fine-tuning on 4 pairs: loss %.4f -> %.4f, eval accuracy i2t %.2f t2i %.2f\n", first.itc,
           last.itc, ev.itc_acc[0], ev.itc_acc[1]);
    CHECK(last.itc < 0.5 * first.itc && ev.itc_acc[0] == 1 && ev.itc_acc[1] == 1 && first.aux > 0,
          "retrieval trains: %.4f -> %.4f, accuracy %.2f/%.2f", first.itc, last.itc, ev.itc_acc[0], ev.itc_acc[1]);
    CHECK(vlmoe_mome_backward_retrieval(m, 0) == VLMOE_ERR_ARG, "backward after an eval forward is refused");
    // routing statistics describe the last forward only: after a text forward no layer has image
    // tokens (the V-MoE layers ran in the retrieval forward's image half before it)
    vlmoe_mome_batch tb = {VLMOE_ENC_TEXT, n, NULL, tok, lens, NULL, NULL, NULL};
    CHECK(vlmoe_mome_forward(m, &tb, 0, NULL) == VLMOE_OK, "text forward: %s", vlmoe_last_error());
    int nms, with_text = 0, with_image = 0;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, &nms);
    for (int i = 0; ms && i < nms; i++) with_text += ms[i].tokens[VLMOE_MOD_TEXT] > 0, with_image += ms[i].tokens[VLMOE_MOD_IMAGE] > 0;
    CHECK(nms == 4 && with_text == 2 && with_image == 0, "after a text forward: %d of %d layers with text tokens, %d with "
          "image tokens (want 2 and 0)", with_text, nms, with_image);
    vlmoe_trainer_free(t);
    vlmoe_model_free(back);
    vlmoe_model_free(m);
    vlmoe_model_free(base);
}

static void test_config(void) {
    vlmoe_model_config c, back;
    const char *names[3] = {"vlmoe-tiny", "mome-tiny", "vlmoe-tiny"};
    for (int i = 0; i < 3; i++) {
        CHECK(vlmoe_config_named(names[i], &c) == VLMOE_OK, "named %s", names[i]);
        if (i == 2) c.num_classes = 2, c.cls_sequences = 2, c.retrieval_head = 1; // both heads
        char *js = vlmoe_config_to_json(&c);
        CHECK(js && strstr(js, "\"mome\"") && vlmoe_config_from_json(js, "rt", &back) == VLMOE_OK &&
                  !memcmp(&back, &c, sizeof(c)), "json round trip of %s: %s", names[i], vlmoe_last_error());
        free(js);
    }
    vlmoe_config_named("vlmoe-tiny", &c);
    CHECK(c.moe.layers == 2 && c.text_moe.layers == 2 && c.moe.order == VLMOE_ORDER_BPR &&
              c.text_moe.order == VLMOE_ORDER_FIFO && c.moe.aux_weight[VLMOE_AUX_VLOSS] == 0.01 &&
              c.text_moe.aux_weight[VLMOE_AUX_LOAD] == 0.01 && c.moe.capacity_factor == 1.05 &&
              c.moe.eval_capacity_factor == 1.0, "vlmoe-tiny: V-MoE / T-MoE as in VL-MoE sec. 4.1");
    CHECK(vlmoe_config_from_json("{\"base\": \"vlmoe-tiny\", \"vl_layers\": 2, \"moe\": {\"layers\": \"every_1\"}}",
                                 "x", &c) == VLMOE_OK && c.moe.layers == 3, "every_N counts the blocks below VL");
    struct { const char *json, *expect; } bad[] = {
        {"{\"base\": \"vlmoe-tiny\", \"moe\": {\"layers\": [3]}}", "moe.layers"},
        {"{\"base\": \"vlmoe-tiny\", \"vl_layers\": 5}", "vl_layers"},
        {"{\"base\": \"vlmoe-tiny\", \"mask_token\": 256}", "mask_token"},
        {"{\"base\": \"vlmoe-tiny\", \"mim_vocab\": \"8192\"}", "\"mim_vocab\" must be an integer"},
        {"{\"base\": \"tiny\", \"arch\": \"momo\"}", "\"mome\""},
        {"{\"base\": \"vlmoe-tiny\", \"cls_sequences\": 3}", "NLVR2"},
        {"{\"base\": \"vlmoe-tiny\", \"retrieval_head\": 2}", "retrieval_head"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(vlmoe_config_from_json(bad[i].json, "cfg.json", &c) == VLMOE_ERR_CONFIG &&
                  strstr(vlmoe_last_error(), bad[i].expect), "bad config %zu: %s", i, vlmoe_last_error());
    model_layout L;
    vlmoe_config_named("vlmoe-tiny", &c);
    CHECK(model_layout_build(&L, &c) == VLMOE_OK && L.nmoe == 2, "vlmoe-tiny layout");
    int have[4] = {0};
    for (int i = 0; i < L.nparams; i++) {
        have[0] |= !strcmp(L.table[i].name, "encoder.blocks.1.v_ffn.moe.router.weight");
        have[1] |= !strcmp(L.table[i].name, "encoder.blocks.1.t_ffn.moe.experts.fc1.weight");
        have[2] |= !strcmp(L.table[i].name, "encoder.blocks.3.vl_ffn.mlp.fc2.bias");
        have[3] |= strstr(L.table[i].name, "blocks.2.vl_ffn") != NULL;
    }
    CHECK(have[0] && have[1] && have[2] && !have[3], "parameter names: V-MoE, T-MoE in block 1, VL-FFN only in block 3");
    printf("vlmoe-tiny: %zu parameters\n", L.total);
    model_layout_free(&L);
}

// BEiT's initialisation (beit_init, set by the paper sizes vlmoe-base and vlmoe-large): every
// matrix and embedding N(0, 0.02), the attention output and every FFN/expert fc2 of block l
// (1-based) scaled by 1/sqrt(2l), LayerNorms (1, 0), biases 0, routers N(0, 0.02). Checked by the
// sample standard deviation of each tensor (n >= 4096: its relative standard error is under 1.2%,
// the bound is 5%); without the key the ViT init stays (Xavier: qkv of width 64 has std 0.072).
static double sample_std(const float *w, size_t n) {
    double s = 0, ss = 0;
    for (size_t i = 0; i < n; i++) s += w[i], ss += (double)w[i] * w[i];
    return sqrt(ss / n - (s / n) * (s / n));
}
static void test_beit_init(void) {
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-base", &c);
    CHECK(c.beit_init == 1, "vlmoe-base uses BEiT's initialisation (VL-MoE sec. 4.1)");
    vlmoe_config_named("vlmoe-tiny", &c);
    CHECK(c.beit_init == 0, "vlmoe-tiny keeps the ViT init");
    for (int beit = 0; beit < 2; beit++) {
        c.beit_init = beit;
        char *js = vlmoe_config_to_json(&c);
        vlmoe_model_config back;
        CHECK(js && (strstr(js, "\"beit_init\"") != NULL) == beit && vlmoe_config_from_json(js, "rt", &back) == VLMOE_OK &&
                  back.beit_init == beit, "beit_init %d: JSON round trip", beit);
        free(js);
        vlmoe_model *m = NULL;
        CHECK(vlmoe_model_init(&m, &c, 7) == VLMOE_OK, "init: %s", vlmoe_last_error());
        int n = 0, checked = 0;
        const vlmoe_param_info *t = vlmoe_model_params(m, &n);
        const float *P = vlmoe_model_param_data(m);
        for (int i = 0; m && i < n; i++) {
            const float *w = P + t[i].offset;
            const double sd = sample_std(w, t[i].numel);
            int l = -1;
            sscanf(t[i].name, "encoder.blocks.%d.", &l);
            const int out = l >= 0 && (strstr(t[i].name, "attn.out.weight") || strstr(t[i].name, "fc2.weight"));
            const int mat = t[i].numel >= 4096 && !strstr(t[i].name, "patch_embed") && !strstr(t[i].name, ".bias") &&
                            !strstr(t[i].name, "ln");
            if (!mat) continue;
            if (!beit) {
                if (strstr(t[i].name, "blocks.0.attn.qkv.weight")) {
                    CHECK(fabs(sd - sqrt(6.0 / 128) / sqrt(3.0)) < 0.05 * sd, "ViT init: qkv std %.4f", sd);
                    checked++;
                }
                continue;
            }
            const double want = out ? 0.02 / sqrt(2.0 * (l + 1)) : 0.02;
            CHECK(fabs(sd - want) <= 0.05 * want, "BEiT init: %s std %.5f, want %.5f", t[i].name, sd, want);
            checked++;
        }
        CHECK(checked >= (beit ? 20 : 1), "beit_init %d: %d tensors checked", beit, checked);
        vlmoe_model_free(m);
    }
    CHECK(vlmoe_config_from_json("{\"base\": \"tiny\", \"beit_init\": 1}", "cfg.json", &c) == VLMOE_ERR_CONFIG &&
              strstr(vlmoe_last_error(), "only VL-MoE"), "beit_init on a one_tower model: %s", vlmoe_last_error());
}

// Stochastic depth's draws: block l drops a branch with probability rate * l / (layers - 1)
// (binomial bounds over 400 seeded forwards of 3 samples), kept branches scale by 1/(1-rate);
// a sample draws the same wherever it is in the global batch (a process holding samples 2.. of
// a batch draws what one process holding them all draws); evaluation drops nothing.
static void test_drop_path_draws(void) {
    vlmoe_model_config cfg = small();
    model_layout L;
    if (model_layout_build(&L, &cfg) != VLMOE_OK) {
        CHECK(0, "layout: %s", vlmoe_last_error());
        return;
    }
    mome_graph_f64 *g = NULL, *g1 = NULL;
    CHECK(mome_graph_create_f64(&g, &L, backend_cpu_f64(), 3) == VLMOE_OK &&
              mome_graph_create_f64(&g1, &L, backend_cpu_f64(), 1) == VLMOE_OK, "graphs: %s", vlmoe_last_error());
    double *p = malloc(sizeof(double) * L.total), img[3 * 3 * 64];
    float *pf = malloc(sizeof(float) * L.total);
    model_layout_init_params(&L, pf, 5);
    for (size_t i = 0; i < L.total; i++) p[i] = pf[i];
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 11);
    for (int i = 0; i < 3 * 3 * 64; i++) img[i] = vlmoe_rng_normal(&r);
    const mome_input_f64 in = {VLMOE_ENC_IMAGE, img, NULL, NULL, NULL, NULL, NULL};
    const mome_input_f64 in1 = {VLMOE_ENC_IMAGE, img + 2 * 3 * 64, NULL, NULL, NULL, NULL, NULL};
    const double rate = 0.4;
    mome_graph_set_drop_path_f64(g, rate), mome_graph_set_drop_path_f64(g1, rate);
    mome_graph_set_sample_base_f64(g, 100), mome_graph_set_sample_base_f64(g1, 102);
    long dropped[3] = {0, 0, 0}, n = 0;
    int scaled = 1, same = 1;
    vlmoe_mome_stats s;
    for (uint64_t seed = 1; seed <= 400; seed++) {
        mome_graph_set_mode_f64(g, 1, seed), mome_graph_set_mode_f64(g1, 1, seed);
        mome_graph_forward_f64(g, p, &in, &s);
        mome_graph_forward_f64(g1, p, &in1, &s);
        const double *f = mome_graph_drop_factors_f64(g), *f1 = mome_graph_drop_factors_f64(g1);
        if (!f || !f1) {
            CHECK(0, "training forwards with rate %g report their factors", rate);
            break;
        }
        for (int l = 0; l < 3; l++)
            for (int k = 0; k < 2; k++) {
                const double rl = rate * l / 2;
                for (int b = 0; b < 3; b++) {
                    const double v = f[(l * 2 + k) * 3 + b];
                    dropped[l] += v == 0;
                    scaled &= v == 0 || v == 1.0 / (1.0 - rl);
                }
                same &= f[(l * 2 + k) * 3 + 2] == f1[l * 2 + k];
            }
        n += 6;
    }
    printf("drop path %.1f: dropped %ld, %ld, %ld of %ld branches in blocks 0, 1, 2 (expected 0, %.0f, %.0f)\n", rate,
           dropped[0], dropped[1], dropped[2], n, n * rate / 2, n * rate);
    CHECK(dropped[0] == 0 && binom_ok(dropped[1], n, rate / 2) && binom_ok(dropped[2], n, rate),
          "drop path rates rise linearly over depth: %ld %ld %ld of %ld", dropped[0], dropped[1], dropped[2], n);
    CHECK(scaled, "kept branches are scaled by 1/(1-rate of their block)");
    CHECK(same, "sample 102 draws the same in a batch from 100 as alone from 102");
    // evaluation: the whole network, the same loss as without drop path
    mome_graph_set_mode_f64(g, 0, 0);
    mome_graph_forward_f64(g, p, &in, &s);
    const double with = s.loss;
    CHECK(!mome_graph_drop_factors_f64(g), "evaluation drops no path");
    mome_graph_set_drop_path_f64(g, 0);
    mome_graph_forward_f64(g, p, &in, &s);
    CHECK(with == s.loss, "evaluation with drop path %.10g equals without %.10g", with, s.loss);
    free(p), free(pf);
    mome_graph_free_f64(g), mome_graph_free_f64(g1);
    model_layout_free(&L);
}

int main(void) {
    test_config();
    test_beit_init();
    test_xent();
    fd_check(VLMOE_ENC_IMAGE, 0, "MIM (image only)", 0);
    fd_check(VLMOE_ENC_TEXT, 0, "MLM (text only)", 0);
    fd_check(VLMOE_ENC_PAIR, 0, "VLM (image-text pair)", 0);
    fd_check(VLMOE_ENC_CAPTION, 0, "VLM under BEiT-3's captioning mask (caption pair)", 0);
    fd_check(VLMOE_ENC_IMAGE, 0, "MIM with drop path 0.5 (fixed mask)", 0.5);
    fd_check(VLMOE_ENC_PAIR, 0, "VLM with drop path 0.5 (fixed mask)", 0.5);
    fd_check(VLMOE_ENC_TEXT, 1, "MLM + text classification with drop path 0.5 (fixed mask)", 0.5);
    fd_check(VLMOE_ENC_IMAGE, 1, "MIM + image classification", 0);
    fd_check(VLMOE_ENC_TEXT, 1, "MLM + text classification", 0);
    fd_check(VLMOE_ENC_PAIR, 1, "VLM + pair classification", 0);
    fd_check(VLMOE_ENC_PAIR, 2, "VLM + NLVR2 classification (two pairs per example)", 0);
    // MLPs wide enough (2M >= 5D + 2HT floats a token) that the attention's scratch lies inside
    // the MLP's (src/nn/block.c), with the gathered feed-forward parts and drop path
    fd_check_mlp(VLMOE_ENC_PAIR, 0, "VLM, attention scratch in the MLP's", 0, 48);
    fd_check_mlp(VLMOE_ENC_PAIR, 1, "VLM + pair classification with drop path 0.5, attention scratch in the MLP's",
                 0.5, 48);
    test_drop_path_draws();
    fd_check_retrieval();
    test_heads_api();
    test_pooling();
    test_freeze_moe();
    test_mlm_mask();
    test_mim_mask();
    test_kmeans();
    test_api();
    return test_summary("test_mome");
}
