// test_soft_moe.c: the Soft MoE kernels of src/moe/soft.c (Soft MoE paper sec. 2, spec/MOE.md
// "Soft MoE"): a forward worked by hand, finite differences in double of every gradient, PyTorch
// parity of the float path (fixture from tests/ref/gen_soft_moe.py), thread-count invariance.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "moe/soft.h"
#include "test.h"
#include "vlmoe.h"

static vlmoe_rng rng;
static double *randv(size_t n, double scale) {
    double *v = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) v[i] = scale * vlmoe_rng_normal(&rng);
    return v;
}
static double *filled(size_t n, double c) {
    double *v = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) v[i] = c;
    return v;
}
static double dot(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

// ---- golden: S=2 tokens, D=2, E=2 experts, P=1 slot each, M=1, exact GELU.
// x0 = (1,0), x1 = (0,1); phi (D,E,P) = [[1,0],[0,1]] so slot 0 = (1,0), slot 1 = (0,1).
// Every vector has norm 1, so <xh_s, phih_n> = delta_sn / (1 + 1e-6); scale = ln 3 * (1 + 1e-6)
// cancels that, and the logits are exactly [[ln 3, 0], [0, ln 3]] (this also pins the eps
// inside the square root: a different placement would leave a ~1e-6 error).
// Dispatch (softmax over tokens, per slot): slot 0 (3/4, 1/4), slot 1 (1/4, 3/4).
// Combine (softmax over slots, per token): token 0 (3/4, 1/4), token 1 (1/4, 3/4).
// Xs0 = 3/4 x0 + 1/4 x1 = (3/4, 1/4); Xs1 = (1/4, 3/4).
// Expert 0: w1 = (0, 4), b1 = 0 -> h = 1; w2 = (1, -1)^T, b2 = (0, 0.5) -> Ys0 = (g, 0.5 - g)
// Expert 1: w1 = (4, 0), b1 = 0 -> h = 1; w2 = (2, 0)^T,  b2 = (0, 0)   -> Ys1 = (2g, 0)
// with g = gelu(1) = 0.5 (1 + erf(1/sqrt 2)) = 0.8413447460685429.
// out0 = 3/4 Ys0 + 1/4 Ys1 = (5/4 g, 3/8 - 3/4 g) = (1.0516809325856786, -0.2560085595514072)
// out1 = 1/4 Ys0 + 3/4 Ys1 = (7/4 g, 1/8 - 1/4 g) = (1.4723533056199501, -0.0853361865171357)
static void test_golden(void) {
    const soft_dims d = {2, 2, 2, 1, 1, VLMOE_ACT_GELU, 0, 0};
    const double x[4] = {1, 0, 0, 1}, phi[4] = {1, 0, 0, 1}, scale = log(3.0) * (1 + 1e-6);
    const double w1[4] = {0, 4, 4, 0}, b1[2] = {0, 0}, w2[4] = {1, -1, 2, 0};
    const double b2[4] = {0, 0.5, 0, 0};
    const double want[4] = {1.0516809325856786, -0.2560085595514072, 1.4723533056199501,
                            -0.0853361865171357};
    const soft_params_f64 p = {phi, &scale, w1, b1, w2, b2};
    double *acts = malloc(sizeof(double) * soft_moe_acts_floats(&d)), out[4], mm[4];
    soft_moe_forward_f64(out, acts, x, &p, &d);
    for (int i = 0; i < 4; i++) CHECK_CLOSE(out[i], want[i], 1e-12, 0, "soft golden out (f64)");
    double meanmax[2];
    soft_moe_stats_f64(acts + soft_moe_weights_at(&d), &d, mm, meanmax);
    // App. E's monitors: each slot's largest dispatch weight is 3/4, each token's largest
    // combine weight 3/4: both means 0.75
    CHECK_CLOSE(meanmax[0], 0.75, 1e-12, 0, "soft golden mean max dispatch");
    CHECK_CLOSE(meanmax[1], 0.75, 1e-12, 0, "soft golden mean max combine");
    CHECK_CLOSE(mm[0], 0.25, 1e-12, 0, "soft golden min dispatch");
    CHECK_CLOSE(mm[1], 0.75, 1e-12, 0, "soft golden max dispatch");
    CHECK_CLOSE(mm[2], 0.25, 1e-12, 0, "soft golden min combine");
    CHECK_CLOSE(mm[3], 0.75, 1e-12, 0, "soft golden max combine");
    free(acts);

    // the float path on the same example
    float xf[4], phif[4], w1f[4], b1f[2], w2f[4], b2f[4], sf = (float)scale, outf[4];
    for (int i = 0; i < 4; i++)
        xf[i] = (float)x[i], phif[i] = (float)phi[i], w1f[i] = (float)w1[i], w2f[i] = (float)w2[i],
        b2f[i] = (float)b2[i];
    b1f[0] = b1f[1] = 0;
    const soft_params_f32 pf = {phif, &sf, w1f, b1f, w2f, b2f};
    float *actsf = malloc(sizeof(float) * soft_moe_acts_floats(&d));
    soft_moe_forward_f32(outf, actsf, xf, &pf, &d);
    for (int i = 0; i < 4; i++) CHECK_CLOSE(outf[i], want[i], 1e-6, 0, "soft golden out (f32)");
    free(actsf);

    // a zero token is why eps sits inside the square root: xh = 0, its logits are 0 (uniform
    // against the other token), and everything stays finite
    const double x0[4] = {0, 0, 0, 1};
    acts = malloc(sizeof(double) * soft_moe_acts_floats(&d));
    soft_moe_forward_f64(out, acts, x0, &p, &d);
    int finite = 1;
    for (int i = 0; i < 4; i++) finite &= isfinite(out[i]) != 0;
    CHECK(finite, "soft zero token: out %g %g %g %g", out[0], out[1], out[2], out[3]);
    soft_moe_stats_f64(acts + soft_moe_weights_at(&d), &d, mm, meanmax); // slot 0 sees logits (0, 0): dispatch 1/2 each
    CHECK_CLOSE(mm[0], 0.25, 1e-12, 0, "soft zero token min dispatch");
    free(acts);
}

// ---- App. A's fixed baselines and App. E's un-normalised variant on test_golden's example
// (x0 = (1,0), x1 = (0,1), phi = I, expert 0: w1 (0,4), w2 (1,-1)^T, b2 (0, .5); expert 1:
// w1 (4,0), w2 (2,0)^T), g(h) = gelu(h) = h Phi(h):
//   uniform: Dw = 1/2, Cw = 1/2 -> Xs0 = Xs1 = (1/2, 1/2), both hidden 2: Ys0 = (g2, .5 - g2),
//     Ys1 = (2 g2, 0), out0 = out1 = (1.5 g2, .25 - .5 g2), g2 = gelu(2) = 1.9544997361036416
//   identity: Xs0 = x0, Xs1 = x1, hidden 0 for both: Ys0 = (0, .5), Ys1 = (0, 0); out = Ys
//   uniform_soft: Ys as uniform, combine soft (3/4, 1/4 as test_golden): out0 = (5/4 g2,
//     3/8 - 3/4 g2), out1 = (7/4 g2, 1/8 - 1/4 g2)
//   soft_uniform: Ys as test_golden (g1 = gelu(1)), combine 1/2: out = (1.5 g1, .25 - .5 g1)
//   raw with x = (2,0), (0,2) and scale log 3: logits (2 log 3, 0): weights (9/10, 1/10);
//     Xs0 = (1.8, .2), Xs1 = (.2, 1.8), hidden .8 for both: Ys0 = (g8, .5 - g8), Ys1 = (2 g8, 0);
//     out0 = (1.1 g8, .45 - .9 g8), out1 = (1.9 g8, .05 - .1 g8), g8 = gelu(.8). (Normalised,
//     the same x would give test_golden's 3/4 weights.)
static double gelu_exact(double h) { return 0.5 * h * (1 + erf(h / sqrt(2.0))); }
static void test_variants_golden(void) {
    const double g1 = gelu_exact(1), g2 = gelu_exact(2), g8 = gelu_exact(0.8);
    const double w1[4] = {0, 4, 4, 0}, b1[2] = {0, 0}, w2[4] = {1, -1, 2, 0}, b2[4] = {0, 0.5, 0, 0};
    const double phi[4] = {1, 0, 0, 1}, x[4] = {1, 0, 0, 1}, x2[4] = {2, 0, 0, 2};
    const double scale = log(3.0) * (1 + 1e-6), scale_raw = log(3.0);
    struct { int mix, raw; const double *x, *scale; double want[4]; const char *name; } c[] = {
        {VLMOE_SOFT_MIX_UNIFORM, 0, x, &scale, {1.5 * g2, .25 - .5 * g2, 1.5 * g2, .25 - .5 * g2}, "uniform"},
        {VLMOE_SOFT_MIX_IDENTITY, 0, x, &scale, {0, .5, 0, 0}, "identity"},
        {VLMOE_SOFT_MIX_UNIFORM_SOFT, 0, x, &scale, {1.25 * g2, .375 - .75 * g2, 1.75 * g2, .125 - .25 * g2},
         "uniform_soft"},
        {VLMOE_SOFT_MIX_SOFT_UNIFORM, 0, x, &scale, {1.5 * g1, .25 - .5 * g1, 1.5 * g1, .25 - .5 * g1}, "soft_uniform"},
        {VLMOE_SOFT_MIX_SOFT, 1, x2, &scale_raw, {1.1 * g8, .45 - .9 * g8, 1.9 * g8, .05 - .1 * g8}, "raw"},
    };
    CHECK_CLOSE(g2, 1.9544997361036416, 1e-15, 0, "gelu(2)");
    for (size_t k = 0; k < sizeof(c) / sizeof(c[0]); k++) {
        const soft_dims d = {2, 2, 2, 1, 1, VLMOE_ACT_GELU, c[k].mix, c[k].raw};
        const soft_params_f64 p = {phi, c[k].scale, w1, b1, w2, b2};
        double *acts = malloc(sizeof(double) * soft_moe_acts_floats(&d)), out[4];
        CHECK(soft_dims_check(&d) == VLMOE_OK, "%s: %s", c[k].name, vlmoe_last_error());
        soft_moe_forward_f64(out, acts, c[k].x, &p, &d);
        for (int i = 0; i < 4; i++) CHECK_CLOSE(out[i], c[k].want[i], 1e-9, 0, c[k].name);
        free(acts);
    }
}

// Fewer than one slot per expert is refused (it was accepted, and the statistics then read past
// the activations: ASan heap-buffer-overflow in soft_moe_stats with S=3, E=8, P=rint(3/8)=0);
// Identity needs as many slots as tokens.
static void test_slots_check(void) {
    soft_dims d = {3, 2, 8, 0, 2, VLMOE_ACT_GELU, 0, 0};
    CHECK(soft_dims_check(&d) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "0 slots per expert"),
          "P = 0: %s", vlmoe_last_error());
    double acts[1] = {0}, mm[4], meanmax[2]; // with no slot the statistics read nothing of acts
    CHECK(soft_moe_acts_floats(&d) == (size_t)3 * 2 + 3, "acts of an empty slot set: %zu", soft_moe_acts_floats(&d));
    soft_moe_stats_f64(acts + soft_moe_weights_at(&d), &d, mm, meanmax);
    CHECK(mm[0] == 0 && mm[3] == 0 && meanmax[0] == 0, "stats of no slots");
    d = (soft_dims){5, 2, 3, 2, 2, VLMOE_ACT_GELU, VLMOE_SOFT_MIX_IDENTITY, 0};
    CHECK(soft_dims_check(&d) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "identity"),
          "identity with 6 slots for 5 tokens: %s", vlmoe_last_error());
    d.S = 6;
    CHECK(soft_dims_check(&d) == VLMOE_OK, "identity with 6 slots for 6 tokens: %s", vlmoe_last_error());
    // the config refuses it too, naming the keys
    vlmoe_model_config c;
    CHECK(vlmoe_config_from_json("{\"base\": \"soft-tiny\", \"moe\": {\"num_experts\": 80, \"group_size\": 32, "
                                 "\"slots_per_expert\": 0}}", "s.json", &c) == VLMOE_ERR_CONFIG &&
              strstr(vlmoe_last_error(), "0 slots per expert") && strstr(vlmoe_last_error(), "s.json"),
          "config with rint(32/80) = 0 slots: %s", vlmoe_last_error());
    CHECK(vlmoe_config_from_json("{\"base\": \"soft-tiny\", \"moe\": {\"soft_dispatch\": \"uniform_soft\", "
                                 "\"soft_normalize\": false}}", "v.json", &c) == VLMOE_OK &&
              c.moe.soft_mix == VLMOE_SOFT_MIX_UNIFORM_SOFT && c.moe.soft_raw == 1, "variant keys: %s", vlmoe_last_error());
    CHECK(vlmoe_config_from_json("{\"base\": \"soft-tiny\", \"moe\": {\"soft_dispatch\": \"hard\"}}", "b.json", &c) ==
              VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "moe.soft_dispatch"), "bad soft_dispatch: %s", vlmoe_last_error());
}

// ---- finite differences in double, loss = sum(out * r)
typedef struct {
    soft_dims d;
    double *x, *phi, *scale, *w1, *b1, *w2, *b2, *out, *acts, *r;
} fd_ctx;

static double soft_loss(fd_ctx *c) {
    const soft_params_f64 p = {c->phi, c->scale, c->w1, c->b1, c->w2, c->b2};
    soft_moe_forward_f64(c->out, c->acts, c->x, &p, &c->d);
    return dot(c->out, c->r, (size_t)c->d.S * c->d.D);
}

// g holds the analytical gradient plus `base` (backward must accumulate onto what was there).
static void fd_check(const char *what, fd_ctx *c, double *v, const double *g, double base,
                     size_t n) {
    const double h = 1e-6;
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const double keep = v[i];
        v[i] = keep + h;
        const double lp = soft_loss(c);
        v[i] = keep - h;
        const double lm = soft_loss(c);
        v[i] = keep;
        const double fd = (lp - lm) / (2 * h), an = g[i] - base;
        double err = fabs(fd - an) / (1e-6 + fabs(fd) + fabs(an));
        if (fabs(fd - an) < 1e-8) err = 0; // both ~0
        if (err > worst) worst = err, at = i;
    }
    CHECK(worst < 1e-5, "%s: worst relative error %.3g at element %zu", what, worst, at);
}

static void test_fd(soft_dims d, const char *name) {
    const size_t S = (size_t)d.S, D = (size_t)d.D, E = (size_t)d.E, N = E * d.P, M = (size_t)d.M;
    fd_ctx c = {d, randv(S * D, 1), randv(D * N, 1), filled(1, 1.7), randv(E * M * D, 0.7),
                randv(E * M, 0.3), randv(E * D * M, 0.7), randv(E * D, 0.3), NULL, NULL,
                randv(S * D, 1)};
    c.out = malloc(sizeof(double) * S * D);
    c.acts = malloc(sizeof(double) * soft_moe_acts_floats(&d));
    double *scratch = malloc(sizeof(double) * soft_moe_scratch_floats(&d));
    // gradients start at 0.5: backward must add to them, not overwrite
    const double base = 0.5;
    double *dx = filled(S * D, base), *dphi = filled(D * N, base), *dscale = filled(1, base);
    double *dw1 = filled(E * M * D, base), *db1 = filled(E * M, base);
    double *dw2 = filled(E * D * M, base), *db2 = filled(E * D, base);
    const soft_params_f64 p = {c.phi, c.scale, c.w1, c.b1, c.w2, c.b2};
    const soft_grads_f64 g = {dphi, dscale, dw1, db1, dw2, db2};
    soft_loss(&c);
    soft_moe_backward_f64(dx, &g, c.r, c.acts, c.x, &p, &d, scratch);
    char what[64];
#define FD(v, gv, n)                                                                               \
    snprintf(what, sizeof(what), "%s d" #v, name), fd_check(what, &c, c.v, gv, base, n)
    FD(x, dx, S * D);
    FD(phi, dphi, D * N);
    FD(scale, dscale, 1);
    FD(w1, dw1, E * M * D);
    FD(b1, db1, E * M);
    FD(w2, dw2, E * D * M);
    FD(b2, db2, E * D);
#undef FD

    // dx = NULL skips only the input gradient: the parameter gradients are the same bits
    double *dphi2 = filled(D * N, base), *dscale2 = filled(1, base);
    double *dw12 = filled(E * M * D, base), *db12 = filled(E * M, base);
    double *dw22 = filled(E * D * M, base), *db22 = filled(E * D, base);
    const soft_grads_f64 g2 = {dphi2, dscale2, dw12, db12, dw22, db22};
    soft_loss(&c);
    soft_moe_backward_f64(NULL, &g2, c.r, c.acts, c.x, &p, &d, scratch);
    CHECK(!memcmp(dphi, dphi2, sizeof(double) * D * N) && *dscale == *dscale2 &&
              !memcmp(dw1, dw12, sizeof(double) * E * M * D) &&
              !memcmp(db2, db22, sizeof(double) * E * D),
          "%s: dx = NULL changed the parameter gradients", name);

    free(c.x), free(c.phi), free(c.scale), free(c.w1), free(c.b1), free(c.w2), free(c.b2);
    free(c.out), free(c.acts), free(c.r), free(scratch);
    free(dx), free(dphi), free(dscale), free(dw1), free(db1), free(dw2), free(db2);
    free(dphi2), free(dscale2), free(dw12), free(db12), free(dw22), free(db22);
}

// ---- PyTorch parity of the float path. Tolerance: max abs error over max |ref| per tensor.
static float *fixture_get(const vlmoe_st *f, const char *name, size_t n) {
    float *v = malloc(sizeof(float) * (n ? n : 1));
    if (vlmoe_st_read_f32(f, name, v, n) != VLMOE_OK) {
        CHECK(0, "fixture %s: %s", name, vlmoe_last_error());
        free(v);
        return NULL;
    }
    return v;
}

static void compare(const char *what, const float *a, const float *ref, size_t n, double tol) {
    double num = 0, den = 1e-30;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - ref[i]);
        if (e > num) num = e, at = i;
        den = fmax(den, fabs((double)ref[i]));
    }
    CHECK(num / den <= tol, "%s: max error %.3g of max |ref| at element %zu (tolerance %.1g)",
          what, num / den, at, tol);
}

static int meta_int(const vlmoe_st *f, const char *key) {
    const char *v = vlmoe_st_metadata(f, key);
    return v ? atoi(v) : 0;
}

static void test_parity(const char *file) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", fixture_dir(), file);
    vlmoe_st *f = NULL;
    if (vlmoe_st_open(path, &f) != VLMOE_OK) {
        fprintf(stderr, "test_soft_moe: no fixture %s, PyTorch parity skipped\n", path);
        return;
    }
    const char *act = vlmoe_st_metadata(f, "act");
    soft_dims d = {meta_int(f, "S"), meta_int(f, "D"), meta_int(f, "E"), meta_int(f, "P"),
                   meta_int(f, "M"), VLMOE_ACT_GELU, 0, meta_int(f, "raw")};
    const char *mix = vlmoe_st_metadata(f, "mix"), *mixes[] = {"soft", "identity", "uniform", "uniform_soft",
                                                               "soft_uniform"};
    for (int i = 0; mix && i < 5; i++)
        if (!strcmp(mix, mixes[i])) d.mix = i;
    if (act && !strcmp(act, "gelu_tanh")) d.act = VLMOE_ACT_GELU_TANH;
    if (act && !strcmp(act, "quick_gelu")) d.act = VLMOE_ACT_QUICK_GELU;
    CHECK(d.S > 0 && d.D > 0 && d.E > 0 && d.P > 0 && d.M > 0, "fixture %s: bad dims", path);
    if (!(d.S > 0 && d.D > 0 && d.E > 0 && d.P > 0 && d.M > 0)) {
        vlmoe_st_close(f);
        return;
    }
    const size_t S = (size_t)d.S, D = (size_t)d.D, E = (size_t)d.E, N = E * d.P, M = (size_t)d.M;
    const char *names[7] = {"x", "phi", "scale", "w1", "b1", "w2", "b2"};
    const size_t sizes[7] = {S * D, D * N, 1, E * M * D, E * M, E * D * M, E * D};
    float *in[7], *ref[7], *grad[7];
    int ok = 1;
    char name[64];
    for (int i = 0; i < 7; i++) {
        snprintf(name, sizeof(name), "soft_moe.%s", names[i]);
        in[i] = fixture_get(f, name, sizes[i]);
        snprintf(name, sizeof(name), "soft_moe.d%s", names[i]);
        ref[i] = fixture_get(f, name, sizes[i]);
        grad[i] = calloc(sizes[i], sizeof(float));
        ok &= in[i] && ref[i];
    }
    float *out_ref = fixture_get(f, "soft_moe.out", S * D);
    float *r = fixture_get(f, "soft_moe.r", S * D);
    float *stats_ref = fixture_get(f, "soft_moe.stats", 4);
    if (ok && out_ref && r && stats_ref) {
        float *out = malloc(sizeof(float) * S * D);
        float *acts = malloc(sizeof(float) * soft_moe_acts_floats(&d));
        float *scratch = malloc(sizeof(float) * soft_moe_scratch_floats(&d));
        const soft_params_f32 p = {in[1], in[2], in[3], in[4], in[5], in[6]};
        const soft_grads_f32 g = {grad[1], grad[2], grad[3], grad[4], grad[5], grad[6]};
        soft_moe_forward_f32(out, acts, in[0], &p, &d);
        soft_moe_backward_f32(grad[0], &g, r, acts, in[0], &p, &d, scratch);
        const double tol = 1e-5;
        compare("soft_moe.out", out, out_ref, S * D, tol);
        for (int i = 0; i < 7; i++) {
            snprintf(name, sizeof(name), "soft_moe.d%s", names[i]);
            compare(name, grad[i], ref[i], sizes[i], tol);
        }
        double mm[4];
        float mmf[4];
        double meanmax[2];
        soft_moe_stats_f32(acts + soft_moe_weights_at(&d), &d, mm, meanmax);
        for (int i = 0; i < 4; i++) mmf[i] = (float)mm[i];
        compare("soft_moe.stats", mmf, stats_ref, 4, tol);
        float *mm_ref = fixture_get(f, "soft_moe.meanmax", 2);
        if (mm_ref) {
            const float mmx[2] = {(float)meanmax[0], (float)meanmax[1]};
            compare("soft_moe.meanmax", mmx, mm_ref, 2, tol);
        }
        free(mm_ref);
        free(out), free(acts), free(scratch);
    }
    for (int i = 0; i < 7; i++) free(in[i]), free(ref[i]), free(grad[i]);
    free(out_ref), free(r), free(stats_ref);
    vlmoe_st_close(f);
}

// ---- the float path gives the same bits on 1 and 4 threads, for few experts (products
// parallel inside) and many (one expert per thread)
static void test_threads(soft_dims d) {
    const size_t S = (size_t)d.S, D = (size_t)d.D, E = (size_t)d.E, N = E * d.P, M = (size_t)d.M;
    const size_t sizes[7] = {S * D, D * N, 1, E * M * D, E * M, E * D * M, E * D};
    float *v[7], *gr[2][7], *out[2];
    for (int i = 0; i < 7; i++) {
        v[i] = malloc(sizeof(float) * sizes[i]);
        for (size_t j = 0; j < sizes[i]; j++) v[i][j] = (float)vlmoe_rng_normal(&rng);
    }
    v[2][0] = 1.f;
    float *acts = malloc(sizeof(float) * soft_moe_acts_floats(&d));
    float *scratch = malloc(sizeof(float) * soft_moe_scratch_floats(&d));
    float *r = malloc(sizeof(float) * S * D);
    for (size_t j = 0; j < S * D; j++) r[j] = (float)vlmoe_rng_normal(&rng);
    const soft_params_f32 p = {v[1], v[2], v[3], v[4], v[5], v[6]};
    const int saved = omp_get_max_threads();
    for (int pass = 0; pass < 2; pass++) {
        omp_set_num_threads(pass == 0 ? 1 : 4);
        out[pass] = malloc(sizeof(float) * S * D);
        for (int i = 0; i < 7; i++) gr[pass][i] = calloc(sizes[i], sizeof(float));
        const soft_grads_f32 g = {gr[pass][1], gr[pass][2], gr[pass][3],
                                  gr[pass][4], gr[pass][5], gr[pass][6]};
        soft_moe_forward_f32(out[pass], acts, v[0], &p, &d);
        soft_moe_backward_f32(gr[pass][0], &g, r, acts, v[0], &p, &d, scratch);
    }
    omp_set_num_threads(saved);
    int same = !memcmp(out[0], out[1], sizeof(float) * S * D);
    for (int i = 0; i < 7; i++) same &= !memcmp(gr[0][i], gr[1][i], sizeof(float) * sizes[i]);
    CHECK(same, "soft moe (E=%d): results differ between 1 and 4 threads", d.E);
    for (int i = 0; i < 7; i++) free(v[i]), free(gr[0][i]), free(gr[1][i]);
    free(out[0]), free(out[1]), free(acts), free(scratch), free(r);
}

int main(void) {
    vlmoe_rng_seed(&rng, 7);
    test_golden();
    test_fd((soft_dims){5, 4, 3, 2, 3, VLMOE_ACT_GELU, 0, 0}, "S5 D4 E3 P2 M3 gelu");
    test_fd((soft_dims){3, 3, 2, 1, 2, VLMOE_ACT_QUICK_GELU, 0, 0}, "S3 D3 E2 P1 M2 quick_gelu");
    test_fd((soft_dims){4, 2, 1, 3, 2, VLMOE_ACT_GELU_TANH, 0, 0}, "S4 D2 E1 P3 M2 gelu_tanh");
    // App. A's fixed baselines and App. E's un-normalised variant
    test_fd((soft_dims){6, 4, 3, 2, 3, VLMOE_ACT_GELU, VLMOE_SOFT_MIX_IDENTITY, 0}, "identity");
    test_fd((soft_dims){5, 4, 3, 2, 3, VLMOE_ACT_GELU, VLMOE_SOFT_MIX_UNIFORM, 0}, "uniform");
    test_fd((soft_dims){5, 4, 3, 2, 3, VLMOE_ACT_GELU, VLMOE_SOFT_MIX_UNIFORM_SOFT, 0}, "uniform_soft");
    test_fd((soft_dims){5, 4, 3, 2, 3, VLMOE_ACT_GELU, VLMOE_SOFT_MIX_SOFT_UNIFORM, 0}, "soft_uniform");
    test_fd((soft_dims){5, 4, 3, 2, 3, VLMOE_ACT_GELU, 0, 1}, "raw (no normalisation)");
    test_variants_golden();
    test_slots_check();
    const char *files[] = {"soft_moe.safetensors", "soft_moe_identity.safetensors", "soft_moe_uniform.safetensors",
                           "soft_moe_uniform_soft.safetensors", "soft_moe_soft_uniform.safetensors",
                           "soft_moe_raw.safetensors"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) test_parity(files[i]);
    test_threads((soft_dims){70, 130, 3, 24, 150, VLMOE_ACT_GELU, 0, 0});
    test_threads((soft_dims){40, 20, 16, 2, 30, VLMOE_ACT_GELU, 0, 0});
    return test_summary("test_soft_moe");
}
