// test_optim.c: tests src/optim/optim.c and src/optim/schedule.c: hand-worked AdamW and Adafactor
// steps (factored, batched, unfactored, update clipping, momentum + decay), clip_grad_norm, schedule
// golden values, state access and resume, bad parameters, thread-count independence, and parity
// with torch.optim.AdamW through the fixture made by tests/ref/gen_optim.py (when present).
#include <omp.h>
#include <stdint.h>

#include "test.h"
#include "optim/optim.h"
#include "vlmoe.h"

static vlmoe_param_info pinfo(const char *name, int ndim, const int64_t *shape, size_t offset,
                              int decay) {
    vlmoe_param_info p;
    memset(&p, 0, sizeof p);
    snprintf(p.name, sizeof p.name, "%s", name);
    p.ndim = ndim;
    p.numel = 1;
    for (int d = 0; d < ndim; d++) p.shape[d] = shape[d], p.numel *= (size_t)shape[d];
    p.offset = offset;
    p.decay = decay;
    return p;
}

static void check_vec(const float *got, const double *want, size_t n, double atol, double rtol,
                      const char *what) {
    char buf[128];
    for (size_t i = 0; i < n; i++) {
        snprintf(buf, sizeof buf, "%s[%zu]", what, i);
        CHECK_CLOSE(got[i], want[i], atol, rtol, buf);
    }
}

// Returns the state buffer called `name`, or NULL.
static float *state_named(vlmoe_optim *o, const char *name, size_t *n) {
    for (int i = 0; i < vlmoe_optim_state_count(o); i++) {
        const char *nm;
        float *d;
        if (vlmoe_optim_state_get(o, i, &nm, &d, n) == VLMOE_OK && strcmp(nm, name) == 0) return d;
    }
    return NULL;
}

// AdamW, lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.1, on w (3, decayed) and b (3, not).
//   w0 = [1, -2, 0.5], b0 = [0.1, 0.2, -0.3]
//   step 1 grads: w [0.5, -1, 0.25], b [1, -0.5, 0]
//   step 2 grads: w [0.25, -1, -0.5], b [1, 0.5, 2]
// Step 1 (t = 1): m = 0.1 g, v = 0.001 g^2, bc1 = 0.1, bc2 = 0.001, so m/bc1 = g and
// sqrt(v)/sqrt(bc2) = |g|: the update is lr * g / (|g| + 1e-8) = 0.1 sign(g) (0 where g = 0,
// since m = 0 there and the denominator is eps). w is first shrunk by 1 - lr*wd = 0.99:
//   w1 = 0.99 w0 - 0.1 sign(g) = [0.89, -1.88, 0.395];  b1 = [0.0, 0.3, -0.3]
// Step 2 (t = 2): m = 0.09 g1 + 0.1 g2, v = 0.000999 g1^2 + 0.001 g2^2, bc1 = 0.19,
// bc2 = 0.001999. For w[0]: m = 0.045 + 0.025 = 0.07, v = 0.00024975 + 0.0000625 = 0.00031225,
// sqrt(v/bc2) = 0.3952258, step = (0.1/0.19) * 0.07 / 0.3952258 = 0.0932180, so
// w2[0] = 0.99 * 0.89 - 0.0932180 = 0.7878820. The other elements the same way (numpy, float64).
static void test_adamw_hand(void) {
    const int64_t s3[1] = {3};
    vlmoe_param_info tab[2] = {pinfo("w", 1, s3, 0, 1), pinfo("b", 1, s3, 3, 0)};
    vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    p.weight_decay = 0.1f;
    vlmoe_optim *o = NULL;
    CHECK(vlmoe_optim_init(&o, &p, tab, 2, 6) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!o) return;
    float x[6] = {1, -2, 0.5f, 0.1f, 0.2f, -0.3f};
    const float g1[6] = {0.5f, -1, 0.25f, 1, -0.5f, 0}, g2[6] = {0.25f, -1, -0.5f, 1, 0.5f, 2};

    vlmoe_optim_step(o, x, g1, 0.1f);
    const double want1[6] = {0.89, -1.88, 0.395, 0.0, 0.3, -0.3};
    check_vec(x, want1, 6, 1e-6, 1e-6, "adamw step 1");
    CHECK(vlmoe_optim_get_step(o) == 1, "step count %ld", vlmoe_optim_get_step(o));
    size_t n = 0;
    float *m = state_named(o, "adamw.m", &n), *v = state_named(o, "adamw.v", &n);
    CHECK(m && v && n == 6, "adamw state buffers missing or sized %zu", n);
    for (int i = 0; i < 2; i++) { // laid out like the flat parameter vector
        int flat = -1, nd = -1;
        int64_t sh[4] = {0};
        CHECK(vlmoe_optim_state_layout(o, i, &flat, &nd, sh) == VLMOE_OK && flat == 1 && nd == 1 && sh[0] == 6,
              "adamw state %d: flat %d, %d dims, [%lld]", i, flat, nd, (long long)sh[0]);
    }
    if (m && v) {
        const double wm[6] = {0.05, -0.1, 0.025, 0.1, -0.05, 0};
        // v = (1 - beta2) g^2 with beta2 the float 0.999f = 0.99900001: 1 - beta2 is
        // 9.99987e-4, not 1e-3 (a 1.3e-5 relative difference that torch given 0.999f shares).
        const double ab2 = 1.0 - (double)0.999f;
        const double wv[6] = {ab2 * 0.25, ab2, ab2 * 0.0625, ab2, ab2 * 0.25, 0};
        check_vec(m, wm, 6, 1e-9, 1e-6, "adamw.m after 1");
        check_vec(v, wv, 6, 1e-12, 1e-6, "adamw.v after 1");
    }

    // Save the state after step 1 to check that a fresh optimizer resumed from it (as a
    // checkpoint does) takes the identical second step.
    float m1[6], v1[6], x1[6];
    if (m && v) memcpy(m1, m, sizeof m1), memcpy(v1, v, sizeof v1);
    memcpy(x1, x, sizeof x1);

    vlmoe_optim_step(o, x, g2, 0.1f);
    const double want2[6] = {0.7878820405, -1.761200002, 0.4276603557,
                             -0.099999998, 0.2947368402, -0.3744136818};
    check_vec(x, want2, 6, 1e-6, 1e-6, "adamw step 2");

    vlmoe_optim *r = NULL;
    CHECK(vlmoe_optim_init(&r, &p, tab, 2, 6) == VLMOE_OK, "init resume: %s", vlmoe_last_error());
    if (r && m && v) {
        size_t rn;
        memcpy(state_named(r, "adamw.m", &rn), m1, sizeof m1);
        memcpy(state_named(r, "adamw.v", &rn), v1, sizeof v1);
        vlmoe_optim_set_step(r, 1);
        vlmoe_optim_step(r, x1, g2, 0.1f);
        CHECK(memcmp(x1, x, sizeof x) == 0, "resumed AdamW step 2 differs from the original");
        CHECK(vlmoe_optim_get_step(r) == 2, "resumed step count %ld", vlmoe_optim_get_step(r));
    }
    vlmoe_optim_free(r);
    vlmoe_optim_free(o);
}

// Adafactor, min_dim_to_factor 2, beta1 0, wd 0, lr 0.1, all parameters start at 0
// (beta2_t stays below the 0.999 cap on both steps):
//   W (2, 3) factored, E (2, 2, 2) factored with a batched leading dim, u (3,) unfactored.
//   step 1 grads: W [[1,-2,2],[2,1,-2]], E [[[1,2],[3,4]],[[0.5,-1],[1,-2]]], u [3,-4,0.5]
//   step 2 grads: W [[2,1,0.5],[-1,1,1]], E [[[1,-1],[2,2]],[[4,1],[-1,0.5]]], u [1,2,-1]
// Step 1: beta2_1 = 1 - 1^-0.8 = 0, so the moments are those of g^2 alone. For W, g^2 =
// [[1,4,4],[4,1,4]]: vr = row means [3, 3], vc = column means [2.5, 2.5, 4], mean(vr) = 3,
// v_hat = outer(vr, vc)/3 = [[2.5,2.5,4],[2.5,2.5,4]], u = g / sqrt(v_hat) =
// [[0.63246,-1.26491,1],[1.26491,0.63246,-1]], W1 = -0.1 u. For E's first block, g^2 =
// [[1,4],[9,16]]: vr = [2.5, 12.5], vc = [5, 10], mean 7.5, u = [0.7746, 1.0954, 1.0392, 0.9798];
// its second block has v_hat = g^2 exactly, u = sign(g). Unfactored u: v = g^2, u = sign(g).
// Step 2: beta2_2 = 1 - 2^-0.8 = 0.4256508, each moment = 0.4256508 old + 0.5743492 new; e.g.
// u's v[0] = 0.4256508*9 + 0.5743492*1 = 4.405207, u[0] = -0.1 - 0.1/sqrt(4.405207) = -0.1476449.
// The remaining values come from a float64 numpy transcription of the formulas in optim.c.
// With clip_threshold 1 nothing is clipped here (rms(u) <= 1 on both steps), so the same numbers
// hold with clipping on and off; the clipping case is test_adafactor_clip.
static void adafactor_fixture(vlmoe_param_info *tab, float *g1, float *g2) {
    const int64_t sw[2] = {2, 3}, se[3] = {2, 2, 2}, su[1] = {3};
    tab[0] = pinfo("W", 2, sw, 0, 1);
    tab[1] = pinfo("E", 3, se, 6, 0);
    tab[2] = pinfo("u", 1, su, 14, 0);
    const float a[17] = {1, -2, 2, 2, 1, -2, 1, 2, 3, 4, 0.5f, -1, 1, -2, 3, -4, 0.5f};
    const float b[17] = {2, 1, 0.5f, -1, 1, 1, 1, -1, 2, 2, 4, 1, -1, 0.5f, 1, 2, -1};
    memcpy(g1, a, sizeof a);
    memcpy(g2, b, sizeof b);
}

static void test_adafactor_hand(void) {
    for (int clip = 0; clip <= 1; clip++) {
        vlmoe_param_info tab[3];
        float g1[17], g2[17], x[17] = {0};
        adafactor_fixture(tab, g1, g2);
        vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
        p.min_dim_to_factor = 2;
        p.beta1 = 0.0f;
        p.clip_threshold = clip ? 1.0f : 0.0f;
        vlmoe_optim *o = NULL;
        CHECK(vlmoe_optim_init(&o, &p, tab, 3, 17) == VLMOE_OK, "init: %s", vlmoe_last_error());
        if (!o) return;

        // State layout: W vr, W vc, E vr, E vc, u v; no momentum buffers with beta1 = 0.
        const char *names[5] = {"adafactor.vr.W", "adafactor.vc.W", "adafactor.vr.E",
                                "adafactor.vc.E", "adafactor.v.u"};
        const size_t sizes[5] = {2, 3, 4, 4, 3};
        // Per-parameter shapes for checkpoints: vr drops the last dim, vc the second-to-last.
        const int ndims[5] = {1, 1, 2, 2, 1};
        const int64_t shapes[5][2] = {{2}, {3}, {2, 2}, {2, 2}, {3}};
        CHECK(vlmoe_optim_state_count(o) == 5, "state count %d", vlmoe_optim_state_count(o));
        for (int i = 0; i < 5 && i < vlmoe_optim_state_count(o); i++) {
            const char *nm = NULL;
            float *d = NULL;
            size_t n = 0;
            CHECK(vlmoe_optim_state_get(o, i, &nm, &d, &n) == VLMOE_OK, "state_get %d", i);
            CHECK(nm && strcmp(nm, names[i]) == 0 && n == sizes[i] && d,
                  "state %d: %s (%zu), expected %s (%zu)", i, nm ? nm : "(null)", n, names[i],
                  sizes[i]);
            int flat = -1, nd = -1;
            int64_t sh[4] = {0};
            CHECK(vlmoe_optim_state_layout(o, i, &flat, &nd, sh) == VLMOE_OK, "state_layout %d", i);
            CHECK(flat == 0 && nd == ndims[i] && sh[0] == shapes[i][0] && (nd < 2 || sh[1] == shapes[i][1]),
                  "state %s: flat %d, shape (%d dims) [%lld, %lld], expected [%lld, %lld]", names[i], flat, nd,
                  (long long)sh[0], (long long)sh[1], (long long)shapes[i][0], (long long)shapes[i][1]);
        }

        vlmoe_optim_step(o, x, g1, 0.1f);
        const double want1[17] = {
            -0.0632455532, 0.1264911064, -0.1, -0.1264911064, -0.0632455532, 0.1,
            -0.0774596669, -0.1095445115, -0.1039230485, -0.0979795897, -0.1, 0.1, -0.1, 0.1,
            -0.1, 0.1, -0.1};
        check_vec(x, want1, 17, 1e-6, 1e-5, clip ? "adafactor(clip 1) step 1" : "adafactor step 1");
        size_t n;
        float *vr = state_named(o, "adafactor.vr.W", &n), *vc = state_named(o, "adafactor.vc.W", &n);
        if (vr && vc) {
            const double wr[2] = {3, 3}, wc[3] = {2.5, 2.5, 4};
            check_vec(vr, wr, 2, 0, 1e-6, "vr.W after 1");
            check_vec(vc, wc, 3, 0, 1e-6, "vc.W after 1");
        }

        vlmoe_optim_step(o, x, g2, 0.1f);
        const double want2[17] = {
            -0.183619643, 0.0521459034, -0.1331393378, -0.059667749, -0.1457881682, 0.0264133397,
            -0.1664846574, -0.0391009122, -0.1864965324, -0.1633182478, -0.2408397837,
            0.0330319541, -0.0330319541, 0.0363145972,
            -0.1476449483, 0.0337290773, 0.0211999343};
        check_vec(x, want2, 17, 1e-6, 1e-5, clip ? "adafactor(clip 1) step 2" : "adafactor step 2");
        const double wer[4] = {1.6384762338, 7.6180319913, 5.1479997728, 1.4230952922};
        const double wec[4] = {3.5641270563, 5.6923811688, 5.1479997728, 1.4230952922};
        const double wv[3] = {4.40520658, 9.10780987, 0.6807618831};
        float *er = state_named(o, "adafactor.vr.E", &n), *ec = state_named(o, "adafactor.vc.E", &n);
        float *uv = state_named(o, "adafactor.v.u", &n);
        if (er && ec && uv) {
            check_vec(er, wer, 4, 0, 1e-5, "vr.E after 2");
            check_vec(ec, wec, 4, 0, 1e-5, "vc.E after 2");
            check_vec(uv, wv, 3, 0, 1e-5, "v.u after 2");
        }
        vlmoe_optim_free(o);
    }
}

// Update clipping with clip_threshold 0.5 on step 1 of the fixture above: u = g / sqrt(v_hat)
// as worked there, rms(u) per parameter:
//   W: u^2 = [0.4, 1.6, 1, 1.6, 0.4, 1], mean 1           -> divide by max(1, 1/0.5) = 2
//   E: u^2 = [0.6, 1.2, 1.08, 0.96, 1, 1, 1, 1], mean 0.98 -> rms 0.98995, divide by 1.97990
//   u: sign(g), rms 1                                      -> divide by 2
// so W1 = -0.05 * u_W, E1 = -0.1 * u_E / 1.97990 (e.g. -0.0774597/1.97990 = -0.0391230),
// u1 = -0.05 sign(g). A threshold of 2 leaves every update alone (checked against step 1 above).
static void test_adafactor_clip(void) {
    vlmoe_param_info tab[3];
    float g1[17], g2[17], x[17] = {0}, y[17] = {0};
    adafactor_fixture(tab, g1, g2);
    vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    p.min_dim_to_factor = 2;
    p.beta1 = 0.0f;
    p.clip_threshold = 0.5f;
    vlmoe_optim *o = NULL, *q = NULL;
    CHECK(vlmoe_optim_init(&o, &p, tab, 3, 17) == VLMOE_OK, "init: %s", vlmoe_last_error());
    p.clip_threshold = 2.0f;
    CHECK(vlmoe_optim_init(&q, &p, tab, 3, 17) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!o || !q) goto done;
    vlmoe_optim_step(o, x, g1, 0.1f);
    const double want[17] = {
        -0.0316227766, 0.0632455532, -0.05, -0.0632455532, -0.0316227766, 0.05,
        -0.0391230398, -0.0553283335, -0.0524890659, -0.0494871659, -0.0505076272, 0.0505076272,
        -0.0505076272, 0.0505076272, -0.05, 0.05, -0.05};
    check_vec(x, want, 17, 1e-6, 1e-5, "adafactor clip 0.5");
    vlmoe_optim_step(q, y, g1, 0.1f);
    CHECK_CLOSE(y[0], -0.0632455532, 1e-6, 1e-5, "adafactor clip 2 leaves W alone");
    CHECK_CLOSE(y[6], -0.0774596669, 1e-6, 1e-5, "adafactor clip 2 leaves E alone");
done:
    vlmoe_optim_free(o);
    vlmoe_optim_free(q);
}

// Momentum and decoupled weight decay: x (3,) decayed, x0 = [1, -1, 2], g = [0.5, -0.5, 1] on
// both steps, beta1 0.5, wd 0.1, lr 0.1, clipping off.
//   step 1: v = g^2, u = sign(g) = [1,-1,1]; m = 0.5 u = [0.5,-0.5,0.5]; u = m + 0.1 x0 =
//           [0.6,-0.6,0.7]; x1 = x0 - 0.1 u = [0.94, -0.94, 1.93]
//   step 2: v = g^2 again, u = sign(g); m = 0.5*0.5 + 0.5*1 = 0.75 (signed); u = m + 0.1 x1 =
//           [0.844, -0.844, 0.943]; x2 = [0.8556, -0.8556, 1.8357]
static void test_adafactor_momentum(void) {
    const int64_t s3[1] = {3};
    vlmoe_param_info tab[1] = {pinfo("x", 1, s3, 0, 1)};
    vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    p.beta1 = 0.5f;
    p.weight_decay = 0.1f;
    p.clip_threshold = 0.0f;
    vlmoe_optim *o = NULL;
    CHECK(vlmoe_optim_init(&o, &p, tab, 1, 3) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!o) return;
    CHECK(vlmoe_optim_state_count(o) == 2, "state count %d", vlmoe_optim_state_count(o));
    float x[3] = {1, -1, 2};
    const float g[3] = {0.5f, -0.5f, 1};
    vlmoe_optim_step(o, x, g, 0.1f);
    const double w1[3] = {0.94, -0.94, 1.93}, w2[3] = {0.8556, -0.8556, 1.8357};
    check_vec(x, w1, 3, 1e-6, 1e-6, "adafactor momentum step 1");
    vlmoe_optim_step(o, x, g, 0.1f);
    check_vec(x, w2, 3, 1e-6, 1e-6, "adafactor momentum step 2");
    size_t n = 0;
    float *m = state_named(o, "adafactor.m.x", &n);
    CHECK(m && n == 3, "adafactor.m.x missing or sized %zu", n);
    if (m) {
        const double wm[3] = {0.75, -0.75, 0.75};
        check_vec(m, wm, 3, 1e-7, 1e-6, "adafactor.m.x after 2");
    }
    vlmoe_optim_free(o);
}

// ||(3, 4, 0)|| = 5; clipping to 1 scales by 1/(5 + 1e-6), like torch's clip_grad_norm_.
static void test_clip(void) {
    float g[3] = {3, 4, 0};
    double norm = vlmoe_clip_grad_norm(g, 3, 1.0);
    CHECK_CLOSE(norm, 5.0, 0, 1e-12, "pre-clip norm");
    CHECK_CLOSE(g[0], 3.0 / (5.0 + 1e-6), 0, 1e-6, "clipped g[0]");
    CHECK_CLOSE(g[1], 4.0 / (5.0 + 1e-6), 0, 1e-6, "clipped g[1]");
    CHECK(g[2] == 0.0f, "clipped g[2] = %g", (double)g[2]);
    float h[3] = {3, 4, 0};
    CHECK_CLOSE(vlmoe_clip_grad_norm(h, 3, 10.0), 5.0, 0, 1e-12, "norm under max");
    CHECK(h[0] == 3 && h[1] == 4, "grads under max_norm changed");
    CHECK_CLOSE(vlmoe_clip_grad_norm(h, 3, 0.0), 5.0, 0, 1e-12, "norm with clipping off");
    CHECK(h[0] == 3 && h[1] == 4, "grads changed with max_norm 0");
}

// Threads: the clip norm and a large Adafactor/AdamW step (above the OpenMP threshold) must be
// bit-identical on 1 and 4 threads.
static void test_threads(void) {
    const size_t R = 256, C = 200, n = R * C + 70000;
    float *g = malloc(n * sizeof *g), *x1 = malloc(n * sizeof *x1), *x4 = malloc(n * sizeof *x4);
    float *c1 = malloc(n * sizeof *c1), *c4 = malloc(n * sizeof *c4);
    if (!g || !x1 || !x4 || !c1 || !c4) goto done;
    uint64_t s = 42;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        g[i] = (float)((double)(s >> 11) * 0x1.0p-53 - 0.5);
        x1[i] = x4[i] = g[i] * 0.1f;
    }
    memcpy(c1, g, n * sizeof *g);
    memcpy(c4, g, n * sizeof *g);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    const double n1 = vlmoe_clip_grad_norm(c1, n, 1.0);
    omp_set_num_threads(4);
    const double n4 = vlmoe_clip_grad_norm(c4, n, 1.0);
    CHECK(n1 == n4, "clip norm differs across thread counts: %.17g vs %.17g", n1, n4);
    CHECK(memcmp(c1, c4, n * sizeof *c1) == 0, "clipped grads differ across thread counts");

    const int64_t sw[2] = {(int64_t)R, (int64_t)C}, sv[1] = {70000};
    vlmoe_param_info tab[2] = {pinfo("W", 2, sw, 0, 1), pinfo("v", 1, sv, R * C, 0)};
    for (int kind = 0; kind <= 1; kind++) {
        vlmoe_optim_params p = vlmoe_optim_default_params((vlmoe_opt_kind)kind);
        p.weight_decay = 0.01f;
        vlmoe_optim *o1 = NULL, *o4 = NULL;
        CHECK(vlmoe_optim_init(&o1, &p, tab, 2, n) == VLMOE_OK, "init: %s", vlmoe_last_error());
        CHECK(vlmoe_optim_init(&o4, &p, tab, 2, n) == VLMOE_OK, "init: %s", vlmoe_last_error());
        if (o1 && o4) {
            for (int step = 0; step < 2; step++) {
                omp_set_num_threads(1);
                vlmoe_optim_step(o1, x1, g, 1e-3f);
                omp_set_num_threads(4);
                vlmoe_optim_step(o4, x4, g, 1e-3f);
            }
            CHECK(memcmp(x1, x4, n * sizeof *x1) == 0, "%s step differs across thread counts",
                  kind ? "Adafactor" : "AdamW");
        }
        vlmoe_optim_free(o1);
        vlmoe_optim_free(o4);
    }
    omp_set_num_threads(saved);
done:
    free(g), free(x1), free(x4), free(c1), free(c4);
}

// Cosine: base 1, warmup 10, total 110, end 0.1.
//   step 0: 1*(0+1)/10 = 0.1; step 9: 10/10 = 1; step 10: progress 0 -> 1;
//   step 35: progress 0.25 -> 0.1 + 0.45*(1 + cos(pi/4)) = 0.868198; step 60: progress 0.5 ->
//   0.1 + 0.45 = 0.55; step 109: progress 0.99 -> 0.1 + 0.45*(1 + cos(0.99 pi)) = 0.1002220;
//   step 500: clamped to end_lr 0.1.
// Rsqrt: base 1, warmup 100, total 1000, cooldown 200, timescale 0 (-> 100).
//   step 0: 0.01; step 99: 1; step 100: sqrt(100/100) = 1; step 400: sqrt(100/400) = 0.5;
//   step 800: sqrt(1/8) = 0.3535534 (cooldown factor min(1, 200/200) = 1); step 900:
//   sqrt(1/9) * 100/200 = 1/6; step 999: sqrt(100/999) * 1/200 = 0.00158193; step 1000: 0.
// With timescale 400 the lr holds at base until step 400: step 1600 -> sqrt(400/1600) = 0.5.
// Const: base 2, warmup 4: step 0 -> 0.5, step 3 -> 2, step 50 -> 2.
static void test_schedules(void) {
    vlmoe_schedule c = {VLMOE_SCHED_COSINE, 1.0, 10, 110, 0.1, 0, 0};
    const long cs[7] = {0, 9, 10, 35, 60, 109, 500};
    const double cw[7] = {0.1, 1.0, 1.0, 0.8681980515339464, 0.55, 0.10022204783542078, 0.1};
    for (int i = 0; i < 7; i++) {
        char what[64];
        snprintf(what, sizeof what, "cosine lr at step %ld", cs[i]);
        CHECK_CLOSE(vlmoe_schedule_lr(&c, cs[i]), cw[i], 1e-12, 1e-12, what);
    }
    vlmoe_schedule r = {VLMOE_SCHED_RSQRT, 1.0, 100, 1000, 0.0, 200, 0.0};
    const long rs[8] = {0, 99, 100, 400, 800, 900, 999, 1000};
    const double rw[8] = {0.01, 1.0, 1.0, 0.5, 0.3535533905932738, 1.0 / 6.0,
                          0.0015819299929208316, 0.0};
    for (int i = 0; i < 8; i++) {
        char what[64];
        snprintf(what, sizeof what, "rsqrt lr at step %ld", rs[i]);
        CHECK_CLOSE(vlmoe_schedule_lr(&r, rs[i]), rw[i], 1e-12, 1e-12, what);
    }
    vlmoe_schedule r2 = {VLMOE_SCHED_RSQRT, 1.0, 100, 100000, 0.0, 0, 400.0};
    CHECK_CLOSE(vlmoe_schedule_lr(&r2, 300), 1.0, 1e-12, 1e-12, "rsqrt timescale 400 at 300");
    CHECK_CLOSE(vlmoe_schedule_lr(&r2, 1600), 0.5, 1e-12, 1e-12, "rsqrt timescale 400 at 1600");
    vlmoe_schedule k = {VLMOE_SCHED_CONST, 2.0, 4, 100, 0.0, 0, 0.0};
    CHECK_CLOSE(vlmoe_schedule_lr(&k, 0), 0.5, 1e-12, 1e-12, "const lr at step 0");
    CHECK_CLOSE(vlmoe_schedule_lr(&k, 3), 2.0, 1e-12, 1e-12, "const lr at step 3");
    CHECK_CLOSE(vlmoe_schedule_lr(&k, 50), 2.0, 1e-12, 1e-12, "const lr at step 50");
    vlmoe_schedule nw = {VLMOE_SCHED_COSINE, 1.0, 0, 10, 0.0, 0, 0.0};
    CHECK_CLOSE(vlmoe_schedule_lr(&nw, 0), 1.0, 1e-12, 1e-12, "cosine without warmup at 0");
    CHECK(vlmoe_schedule_lr(NULL, 3) == 0.0, "NULL schedule gives 0");
}

// Each bad field is rejected with VLMOE_ERR_ARG, a message naming it, and *out left NULL.
static void expect_bad(const vlmoe_optim_params *p, const vlmoe_param_info *tab, int np,
                       size_t total, const char *field) {
    static char dummy;   // any non-NULL value: init must reset *out
    vlmoe_optim *o = (vlmoe_optim *)(void *)&dummy;
    vlmoe_clear_error();
    int st = vlmoe_optim_init(&o, p, tab, np, total);
    CHECK(st == VLMOE_ERR_ARG, "bad %s: status %d", field, st);
    CHECK(o == NULL, "bad %s: out not reset to NULL", field);
    CHECK(strstr(vlmoe_last_error(), field) != NULL, "bad %s: message \"%s\" does not name it",
          field, vlmoe_last_error());
    if (st == VLMOE_OK) vlmoe_optim_free(o);
}

static void test_invalid(void) {
    const int64_t s3[1] = {3}, s23[2] = {2, 3};
    vlmoe_param_info tab[2] = {pinfo("w", 1, s3, 0, 1), pinfo("b", 1, s3, 3, 0)};
    const vlmoe_optim_params good = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    vlmoe_optim_params p = good;
    p.beta1 = 1.0f;
    expect_bad(&p, tab, 2, 6, "beta1");
    p = good, p.beta2 = -0.1f;
    expect_bad(&p, tab, 2, 6, "beta2");
    p = good, p.eps = 0.0f;
    expect_bad(&p, tab, 2, 6, "eps");
    p = good, p.weight_decay = NAN;
    expect_bad(&p, tab, 2, 6, "weight_decay");
    p = good, p.kind = (vlmoe_opt_kind)7;
    expect_bad(&p, tab, 2, 6, "kind");
    p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR), p.min_dim_to_factor = 0;
    expect_bad(&p, tab, 2, 6, "min_dim_to_factor");
    p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR), p.decay_rate = -1.0f;
    expect_bad(&p, tab, 2, 6, "decay_rate");
    p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR), p.clip_threshold = -1.0f;
    expect_bad(&p, tab, 2, 6, "clip_threshold");

    expect_bad(&good, tab, 2, 5, "offset");               // b ends at 6 > total 5
    expect_bad(&good, tab, 0, 6, "nparams");
    vlmoe_param_info bad[2] = {tab[0], tab[1]};
    bad[1].numel = 4;                                      // shape (3,) holds 3
    expect_bad(&good, bad, 2, 7, "numel");
    bad[1] = tab[1], bad[1].offset = 2;                    // [2, 5) overlaps w's [0, 3)
    expect_bad(&good, bad, 2, 6, "overlaps");
    bad[1] = tab[1], snprintf(bad[1].name, sizeof bad[1].name, "w");
    expect_bad(&good, bad, 2, 6, "name");
    bad[1] = pinfo("m", 2, s23, 3, 1), bad[1].shape[1] = -3, bad[1].numel = 6;
    expect_bad(&good, bad, 2, 9, "shape");
    bad[1] = tab[1], bad[1].ndim = 5;
    expect_bad(&good, bad, 2, 6, "ndim");

    vlmoe_optim *o = NULL;
    CHECK(vlmoe_optim_init(&o, &good, tab, 2, 6) == VLMOE_OK, "good init: %s", vlmoe_last_error());
    const char *nm;
    float *d;
    size_t n;
    CHECK(vlmoe_optim_state_get(o, 2, &nm, &d, &n) == VLMOE_ERR_ARG, "state index 2 accepted");
    CHECK(vlmoe_optim_state_get(o, -1, &nm, &d, &n) == VLMOE_ERR_ARG, "state index -1 accepted");
    CHECK(vlmoe_optim_state_layout(o, 2, NULL, NULL, NULL) == VLMOE_ERR_ARG, "layout index 2 accepted");
    vlmoe_optim_free(o);
    vlmoe_optim_free(NULL);
}

// Parity with torch.optim.AdamW (tests/ref/gen_optim.py): 5 steps on w (4, 3, decayed) and
// b (5, not decayed) with the fixture's gradients, lrs and hyperparameters.
static void test_adamw_torch(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/optim_adamw.safetensors", fixture_dir());
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "test_optim: %s not found, skipping the PyTorch AdamW parity test\n", path);
        return;
    }
    fclose(f);
    vlmoe_st *st = NULL;
    CHECK(vlmoe_st_open(path, &st) == VLMOE_OK, "open %s: %s", path, vlmoe_last_error());
    if (!st) return;
    enum { STEPS = 5, NW = 12, NB = 5, N = NW + NB };
    float hp[4], lrs[STEPS], x[N], wg[STEPS * NW], bg[STEPS * NB], wa[STEPS * NW],
        ba[STEPS * NB];
    int ok = vlmoe_st_read_f32(st, "hparams", hp, 4) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "lrs", lrs, STEPS) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "w.init", x, NW) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "b.init", x + NW, NB) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "w.grads", wg, STEPS * NW) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "b.grads", bg, STEPS * NB) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "w.after", wa, STEPS * NW) == VLMOE_OK &&
             vlmoe_st_read_f32(st, "b.after", ba, STEPS * NB) == VLMOE_OK;
    CHECK(ok, "reading %s: %s", path, vlmoe_last_error());
    vlmoe_st_close(st);
    if (!ok) return;

    const int64_t sw[2] = {4, 3}, sb[1] = {5};
    vlmoe_param_info tab[2] = {pinfo("w", 2, sw, 0, 1), pinfo("b", 1, sb, NW, 0)};
    vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    p.beta1 = hp[0], p.beta2 = hp[1], p.eps = hp[2], p.weight_decay = hp[3];
    vlmoe_optim *o = NULL;
    CHECK(vlmoe_optim_init(&o, &p, tab, 2, N) == VLMOE_OK, "init: %s", vlmoe_last_error());
    if (!o) return;
    for (int s = 0; s < STEPS; s++) {
        float g[N];
        memcpy(g, wg + s * NW, NW * sizeof(float));
        memcpy(g + NW, bg + s * NB, NB * sizeof(float));
        vlmoe_optim_step(o, x, g, lrs[s]);
        double max_abs = 0, max_rel = 0;
        int where = -1;
        for (int i = 0; i < N; i++) {
            const double want = i < NW ? wa[s * NW + i] : ba[s * NB + i - NW];
            const double err = fabs((double)x[i] - want);
            const double rel = err / (fabs(want) > 1e-30 ? fabs(want) : 1e-30);
            if (err > max_abs) max_abs = err;
            if (err > 1e-7 + 1e-6 * fabs(want) && rel > max_rel) max_rel = rel, where = i;
        }
        CHECK(where < 0, "AdamW vs torch, step %d: element %d (%s) off, max abs err %.3g, "
              "max rel err %.3g", s + 1, where, where < NW ? "w" : "b", max_abs, max_rel);
        if (s == STEPS - 1) printf("test_optim: AdamW vs torch after %d steps: max abs err %.3g\n",
                                   STEPS, max_abs);
    }
    vlmoe_optim_free(o);
}

// Parity with big_vision's Adafactor (tests/ref/gen_adafactor.py, a PyTorch transcription of
// scale_by_adafactor + lr + decoupled decay + schedule): 20 steps on six tensors covering every
// factoring case, in two settings (a: momentum in float32, no clipping; b: momentum kept in
// bfloat16, beta2 capped at 0.5, clipping at 1). lr = base_lr * sched, wd_lr_base = base_lr, so
// the decay follows the schedule alone. Every element within 1e-6 after every step.
static void test_adafactor_big_vision(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/optim_adafactor.safetensors", fixture_dir());
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "test_optim: %s not found, skipping the big_vision Adafactor parity test\n", path);
        return;
    }
    fclose(f);
    enum { STEPS = 20, NP = 6 };
    static const char *names[NP] = {"w", "e", "odd", "tie", "small", "b"};
    static const int64_t shapes[NP][3] = {{48, 40}, {4, 40, 36}, {40, 3, 36}, {36, 36, 5}, {20, 33}, {37}};
    static const int ndims[NP] = {2, 3, 3, 3, 2, 1};
    vlmoe_param_info tab[NP];
    size_t total = 0;
    for (int k = 0; k < NP; k++) {
        tab[k] = pinfo(names[k], ndims[k], shapes[k], total, k < NP - 1);
        total += tab[k].numel;
    }
    float *init = malloc(total * sizeof(float)), *x = malloc(total * sizeof(float));
    float *grads = malloc(STEPS * total * sizeof(float)), *after = malloc(STEPS * total * sizeof(float));
    float *g = malloc(total * sizeof(float)), sched[STEPS];
    vlmoe_st *st = NULL;
    int ok = init && x && grads && after && g && vlmoe_st_open(path, &st) == VLMOE_OK;
    ok = ok && vlmoe_st_read_f32(st, "sched", sched, STEPS) == VLMOE_OK;
    char key[64];
    for (int k = 0; k < NP && ok; k++) {
        const size_t n = tab[k].numel;
        snprintf(key, sizeof key, "%s.init", names[k]);
        ok = vlmoe_st_read_f32(st, key, init + tab[k].offset, n) == VLMOE_OK;
        float *tmp = malloc(STEPS * n * sizeof(float));
        snprintf(key, sizeof key, "%s.grads", names[k]);
        ok = ok && tmp && vlmoe_st_read_f32(st, key, tmp, STEPS * n) == VLMOE_OK;
        for (int s = 0; ok && s < STEPS; s++) memcpy(grads + s * total + tab[k].offset, tmp + s * n, n * sizeof(float));
        free(tmp);
    }
    CHECK(ok, "reading %s: %s", path, vlmoe_last_error());
    for (int set = 0; set < 2 && ok; set++) {
        const char sn = (char)('a' + set);
        double hp[8];
        float hpf[8];
        snprintf(key, sizeof key, "%c.hparams", sn);
        ok = vlmoe_st_read_f32(st, key, hpf, 8) == VLMOE_OK;
        for (int i = 0; i < 8; i++) hp[i] = hpf[i];
        for (int k = 0; k < NP && ok; k++) {
            const size_t n = tab[k].numel;
            float *tmp = malloc(STEPS * n * sizeof(float));
            snprintf(key, sizeof key, "%c.%s.after", sn, names[k]);
            ok = tmp && vlmoe_st_read_f32(st, key, tmp, STEPS * n) == VLMOE_OK;
            for (int s = 0; ok && s < STEPS; s++) memcpy(after + s * total + tab[k].offset, tmp + s * n, n * sizeof(float));
            free(tmp);
        }
        CHECK(ok, "reading %s setting %c: %s", path, sn, vlmoe_last_error());
        if (!ok) break;
        vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
        p.beta1 = (float)hp[0], p.decay_rate = (float)hp[1], p.beta2_cap = (float)hp[2];
        p.clip_threshold = (float)hp[3], p.weight_decay = (float)hp[4], p.wd_lr_base = (float)hp[5];
        p.momentum_bf16 = hp[6] != 0, p.eps = (float)hp[7];
        CHECK(p.min_dim_to_factor == 32, "big_vision factors from dimension 32, default is %d", p.min_dim_to_factor);
        vlmoe_optim *o = NULL;
        CHECK(vlmoe_optim_init(&o, &p, tab, NP, total) == VLMOE_OK, "init: %s", vlmoe_last_error());
        if (!o) break;
        memcpy(x, init, total * sizeof(float));
        double worst = 0;
        for (int s = 0; s < STEPS; s++) {
            memcpy(g, grads + s * total, total * sizeof(float));
            vlmoe_optim_step(o, x, g, (float)(hp[5] * sched[s]));
            double max_abs = 0, max_rest = 0;
            size_t where = 0, off = 0;
            for (size_t i = 0; i < total; i++) {
                const double err = fabs((double)x[i] - after[s * total + i]);
                if (err > 1e-6) off++;
                if (err > max_abs) max_abs = err, where = i;
                else if (err > max_rest) max_rest = err;
            }
            int k = 0;
            while (k + 1 < NP && where >= tab[k + 1].offset) k++;
            // Float32: every element within 1e-6. Momentum in bfloat16: a float32 momentum that
            // lands within rounding of a bfloat16 tie is rounded the other way by one side (their
            // float32 updates differ in the last bits), a change of 2^-8 |m| carried on by the
            // momentum; allow that in at most one element in a thousand, and bound it by
            // lr * 10 * 2^-8 |m| (1e-4 here); every other element within 1e-6 as above.
            if (p.momentum_bf16)
                CHECK(off <= total / 1000 && max_abs <= 1e-4,
                      "Adafactor vs big_vision (%c), step %d: %zu elements off by > 1e-6, the worst %s[%zu] by %.3g",
                      sn, s + 1, off, names[k], where - tab[k].offset, max_abs);
            else
                CHECK(max_abs <= 1e-6, "Adafactor vs big_vision (%c), step %d: %s[%zu] off by %.3g", sn, s + 1,
                      names[k], where - tab[k].offset, max_abs);
            if (max_abs > worst) worst = max_abs;
            if (s == STEPS - 1 && p.momentum_bf16)
                printf("test_optim: Adafactor vs big_vision (bf16 momentum): %zu of %zu elements off by > 1e-6 "
                       "(a bfloat16 tie rounded the other way), the rest within %.3g\n", off, total, max_rest);
        }
        // the factored tensors hold vr/vc (no v), the vector and the small matrix v, all m
        size_t n = 0;
        CHECK(state_named(o, "adafactor.vr.odd", &n) && n == 40 * 3 && state_named(o, "adafactor.vc.odd", &n) &&
                  n == 3 * 36 && state_named(o, "adafactor.v.small", &n) && n == 20 * 33 &&
                  state_named(o, "adafactor.m.b", &n) && n == 37 && !state_named(o, "adafactor.v.w", &n),
              "Adafactor (%c): state layout", sn);
        printf("test_optim: Adafactor vs big_vision (%s) after %d steps: max abs err %.3g\n",
               set ? "bf16 momentum, cap 0.5, clip 1" : "momentum 0.9, cap 0.999, no clipping", STEPS, worst);
        vlmoe_optim_free(o);
    }
    vlmoe_st_close(st);
    free(init), free(x), free(grads), free(after), free(g);
}

// The optimizer runs on the table it is given, and refuses one that cannot hold its state or
// lacks one of its ops, naming the backend and the op.
static int no_adamw(const vlmoe_backend_f32 *be, be_op op, const void *cfg) { return op != BE_OP_ADAMW; }

static void test_backend_table(void) {
    vlmoe_param_info tab[1] = {{.name = "w", .ndim = 1, .shape = {4, 0, 0, 0}, .offset = 0, .numel = 4, .decay = 1}};
    vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    vlmoe_backend_f32 dev = *backend_cpu_f32(), lacking = *backend_cpu_f32();
    dev.name = "device", dev.host_memory = 0;
    lacking.name = "lacking", lacking.supports = no_adamw;
    vlmoe_optim *o = NULL;
    CHECK(optim_init_backend(&o, &p, tab, 1, 4, &dev) == VLMOE_ERR_CONFIG && !o &&
              strstr(vlmoe_last_error(), "device"), "state off the host: %s", vlmoe_last_error());
    CHECK(optim_init_backend(&o, &p, tab, 1, 4, &lacking) == VLMOE_ERR_ARG && !o &&
              strstr(vlmoe_last_error(), "lacking") && strstr(vlmoe_last_error(), "adamw"),
          "a table without adamw: %s", vlmoe_last_error());
    p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    CHECK(optim_init_backend(&o, &p, tab, 1, 4, &lacking) == VLMOE_OK, "Adafactor needs no adamw op: %s",
          vlmoe_last_error());
    vlmoe_optim_free(o);
}

// Expert parallelism (src/train/trainer.c): two processes each hold half of every expert bank in
// their own flat layout (src/nn/model.h model_shard: the bank (E/2, ...) with expert0 and
// experts_local, the offsets after it shifted) and update only those experts; each expert's
// parameters, factored moments (vr, vc), unfactored v and bf16 momentum must be those of the
// whole update bit for bit. optim_relayout moves a shard's state to the whole layout (its experts
// in place, the others zero) and back. A bank factored over its expert dim, or update clipping
// (its RMS spans the bank), cannot be split (optim_splits).
static void test_adafactor_split(void) {
    enum { E = 4, STEPS = 3 };
    const int64_t sw[2] = {40, 48}, sb[3] = {E, 64, 40}, ss[3] = {E, 8, 6};
    vlmoe_param_info tab[3] = {pinfo("w", 2, sw, 0, 1), pinfo("bank", 3, sb, 40 * 48, 1),
                               pinfo("small", 3, ss, 40 * 48 + E * 64 * 40, 0)};
    const size_t total = tab[2].offset + tab[2].numel;
    vlmoe_optim_params p = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    p.momentum_bf16 = 1, p.weight_decay = 1e-3f;
    float *init = malloc(sizeof(float) * total), *g = malloc(sizeof(float) * total * STEPS);
    float *pw = malloc(sizeof(float) * total), *pq[2] = {malloc(sizeof(float) * total), malloc(sizeof(float) * total)};
    float *gq = malloc(sizeof(float) * total);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 5);
    for (size_t i = 0; i < total; i++) init[i] = (float)(vlmoe_rng_uniform(&r) - 0.5);
    for (size_t i = 0; i < total * STEPS; i++) g[i] = (float)(vlmoe_rng_uniform(&r) - 0.5) * (i % 7 ? 1.0f : 1e-3f);
    vlmoe_optim *w = NULL, *q[2] = {NULL, NULL};
    vlmoe_param_info loc[2][3];
    size_t ltot[2];
    // copies the floats shard k holds of a whole-layout buffer x into its layout (or back: to_whole)
    #define SHARD_COPY(k, dst, src, to_whole)                                                          \
        for (int b_ = 0; b_ < 3; b_++) {                                                             \
            const size_t per_ = tab[b_].numel / (size_t)(b_ ? E : 1), n_ = loc[k][b_].numel;           \
            const size_t wo_ = tab[b_].offset + (b_ ? (size_t)loc[k][b_].expert0 * per_ : 0);         \
            if (to_whole) memcpy((dst) + wo_, (src) + loc[k][b_].offset, sizeof(float) * n_);          \
            else memcpy((dst) + loc[k][b_].offset, (src) + wo_, sizeof(float) * n_);                   \
        }
    int st = vlmoe_optim_init(&w, &p, tab, 3, total);
    for (int k = 0; k < 2 && !st; k++) {
        size_t at = 0;
        for (int b = 0; b < 3; b++) {
            loc[k][b] = tab[b];
            if (b) {
                const size_t per = tab[b].numel / E;
                loc[k][b].shape[0] = E / 2, loc[k][b].numel = per * (E / 2);
                loc[k][b].expert0 = k * (E / 2), loc[k][b].experts_local = E / 2;
            }
            loc[k][b].offset = at, at += loc[k][b].numel;
        }
        ltot[k] = at;
        st = vlmoe_optim_init(&q[k], &p, loc[k], 3, ltot[k]);
    }
    CHECK(st == VLMOE_OK, "split set-up: %s", vlmoe_last_error());
    if (st) goto done;
    memcpy(pw, init, sizeof(float) * total);
    for (int k = 0; k < 2; k++) SHARD_COPY(k, pq[k], init, 0);
    for (int s = 0; s < STEPS; s++) {
        vlmoe_optim_step(w, pw, g + total * s, 1e-2f);
        for (int k = 0; k < 2; k++) {
            SHARD_COPY(k, gq, g + total * s, 0);
            vlmoe_optim_step(q[k], pq[k], gq, 1e-2f);
        }
    }
    long same = 0, differ = 0;
    for (int k = 0; k < 2; k++) {
        differ += memcmp(pq[k], pw, sizeof(float) * tab[0].numel) != 0; // the dense tensor, whole on both
        for (int b = 1; b < 3; b++) {
            const size_t per = tab[b].numel / E;
            float *bw[5] = {pw + tab[b].offset}, *bq[5] = {pq[k] + loc[k][b].offset};
            size_t nw[5] = {per}, nq[5] = {per};
            const int n = 1 + optim_expert_states(w, tab[b].offset, E, per, bw + 1, nw + 1);
            CHECK(n == 1 + optim_expert_states(q[k], loc[k][b].offset, E / 2, per, bq + 1, nq + 1) && n == (b == 1 ? 4 : 3),
                  "%s: %d buffers", tab[b].name, n);
            for (int i = 0; i < n; i++)
                for (int e = 0; e < E / 2; e++) {
                    const float *x = bq[i] + (size_t)e * nq[i], *y = bw[i] + (size_t)(k * (E / 2) + e) * nw[i];
                    if (nq[i] != nw[i] || memcmp(x, y, sizeof(float) * nw[i])) differ++;
                    else same++;
                }
        }
    }
    printf("Adafactor over 2 x 2 of 4 experts: %ld expert slices (parameters, vr, vc, v, bf16 m) bit-identical to "
           "the whole update, %ld differ\n", same, differ);
    CHECK(same == 2 * 2 * (4 + 3) && differ == 0, "split Adafactor: %ld slices differ", differ);
    // shard 1 back to the whole layout: its experts' state in place, bit for bit the whole run's,
    // the others zero; then to shard 1 again, unchanged
    {
        long bad = 0, others = 0;
        int ok = optim_relayout(q[1], tab, 3, total, 1) == VLMOE_OK && vlmoe_optim_get_step(q[1]) == STEPS;
        for (int b = 1; b < 3 && ok; b++) {
            const size_t per = tab[b].numel / E;
            float *bw[4], *bq[4];
            size_t nw[4], nq[4];
            const int n = optim_expert_states(w, tab[b].offset, E, per, bw, nw);
            ok = n == optim_expert_states(q[1], tab[b].offset, E, per, bq, nq);
            for (int i = 0; i < n && ok; i++)
                for (size_t j = 0; j < (size_t)E * nw[i]; j++) {
                    if (j >= (size_t)(E / 2) * nw[i]) bad += bq[i][j] != bw[i][j];
                    else others += bq[i][j] != 0.0f;
                }
        }
        ok = ok && optim_relayout(q[1], loc[1], 3, ltot[1], 1) == VLMOE_OK;
        float *bq2[4];
        size_t nq2[4];
        float *bw2[4];
        size_t nw2[4];
        const int n2 = ok ? optim_expert_states(q[1], loc[1][1].offset, E / 2, tab[1].numel / E, bq2, nq2) : 0;
        optim_expert_states(w, tab[1].offset, E, tab[1].numel / E, bw2, nw2);
        for (int i = 0; i < n2; i++) bad += memcmp(bq2[i], bw2[i] + (E / 2) * nw2[i], sizeof(float) * (E / 2) * nq2[i]) != 0;
        CHECK(ok && !bad && !others, "optim_relayout: %s; %ld floats differ, %ld of the other experts' not zero",
              ok ? "ok" : vlmoe_last_error(), bad, others);
        vlmoe_param_info wrong[3] = {tab[0], tab[2], tab[1]};
        CHECK(optim_relayout(q[1], wrong, 3, total, 1) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "'small'"),
              "another table: %s", vlmoe_last_error());
    }
    #undef SHARD_COPY
    // what cannot split: a bank factored over its expert dim (64 experts of 40 x 8: dims 64 and 40
    // factored), and with update clipping every bank; AdamW always splits
    {
        const int64_t sx[3] = {64, 40, 8};
        const vlmoe_param_info wide = pinfo("wide", 3, sx, 0, 1);
        vlmoe_optim_params pc = p, pa = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
        pc.clip_threshold = 1.0f;
        CHECK(!optim_splits(&p, &wide) && optim_splits(&p, &tab[1]) && optim_splits(&p, &tab[2]) &&
                  !optim_splits(&pc, &tab[1]) && optim_splits(&pa, &wide),
              "optim_splits: a bank factored over its experts or clipped must not split, the others must");
    }
done:
    vlmoe_optim_free(w), vlmoe_optim_free(q[0]), vlmoe_optim_free(q[1]);
    free(init), free(g), free(gq), free(pw), free(pq[0]), free(pq[1]);
}

int main(void) {
    test_backend_table();
    test_adamw_hand();
    test_adafactor_hand();
    test_adafactor_clip();
    test_adafactor_momentum();
    test_adafactor_split();
    test_clip();
    test_threads();
    test_schedules();
    test_invalid();
    test_adamw_torch();
    test_adafactor_big_vision();
    return test_summary("test_optim");
}
