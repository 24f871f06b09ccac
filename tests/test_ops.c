// test_ops.c: finite-difference gradient checks, in double precision on tiny shapes, for every
// op in src/ops and the contrastive loss; plus golden values for forward passes worked by hand.
// Each check builds loss = sum(out * r) for a fixed random r, runs the op's backward with
// dout = r, and compares every input gradient element with a central difference.
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/real.h" // float here: vexp is the float kernel's polynomial
#include "ops/act_avx2.h"
#include "ops/backend.h"
#include "ops/ops.h"
#include "test.h"

static vlmoe_rng rng;
static double *randv(size_t n, double scale) {
    double *v = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) v[i] = scale * vlmoe_rng_normal(&rng);
    return v;
}
static double *zeros(size_t n) { return calloc(n, sizeof(double)); }
static double dot(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

typedef double (*loss_fn)(void *ctx);

// Compares analytical gradient g of loss f with respect to x (n elements) with central
// differences; reports the worst element.
static void fd_check(const char *what, loss_fn f, void *ctx, double *x, const double *g, size_t n) {
    const double h = 1e-6;
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double keep = x[i];
        x[i] = keep + h;
        double lp = f(ctx);
        x[i] = keep - h;
        double lm = f(ctx);
        x[i] = keep;
        double fd = (lp - lm) / (2 * h);
        double err = fabs(fd - g[i]) / (1e-6 + fabs(fd) + fabs(g[i]));
        if (fabs(fd - g[i]) < 1e-8) err = 0; // both ~0
        if (err > worst) worst = err, at = i;
    }
    CHECK(worst < 1e-5, "%s: worst relative error %.3g at element %zu", what, worst, at);
}

// ---- linear
typedef struct { double *out, *inp, *w, *b, *r; int N, K, O; } lin_ctx;
static double lin_loss(void *p) {
    lin_ctx *c = p;
    linear_forward_f64(c->out, c->inp, c->w, c->b, c->N, c->K, c->O, 0);
    return dot(c->out, c->r, (size_t)c->N * c->O);
}
static void test_linear(void) {
    lin_ctx c = {0, 0, 0, 0, 0, 5, 4, 3};
    c.out = zeros(15), c.inp = randv(20, 1), c.w = randv(12, 1), c.b = randv(3, 1), c.r = randv(15, 1);
    double *di = zeros(20), *dw = zeros(12), *db = zeros(3);
    lin_loss(&c);
    linear_backward_f64(di, dw, db, c.r, c.inp, c.w, c.N, c.K, c.O);
    fd_check("linear dinp", lin_loss, &c, c.inp, di, 20);
    fd_check("linear dw", lin_loss, &c, c.w, dw, 12);
    fd_check("linear db", lin_loss, &c, c.b, db, 3);
    // golden: [1 2] . [[1 0],[0 1],[1 1]]^T + [0.5 0 -1] = [1.5 2 2]
    double x[2] = {1, 2}, w[6] = {1, 0, 0, 1, 1, 1}, b[3] = {0.5, 0, -1}, o[3];
    linear_forward_f64(o, x, w, b, 1, 2, 3, 0);
    CHECK(o[0] == 1.5 && o[1] == 2 && o[2] == 2, "linear golden: %g %g %g", o[0], o[1], o[2]);
    free(c.out), free(c.inp), free(c.w), free(c.b), free(c.r), free(di), free(dw), free(db);
}

// linear_backward_write: dinp filled with NaN first, so an accumulate (or beta*dinp) left in
// the write mode shows; its values must equal linear_backward's into zeros, and dw, db must
// accumulate the same bits. f64 (the reference table) and f32 (sgemm, and its 1-row path).
static void test_linear_write(void) {
    const int shapes[][3] = {{37, 29, 23}, {1, 40, 7}, {600, 40, 70}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        const int N = shapes[s][0], K = shapes[s][1], O = shapes[s][2];
        const size_t nx = (size_t)N * K, nw = (size_t)O * K, ng = (size_t)N * O;
        double *x = randv(nx, 1), *w = randv(nw, 1), *g = randv(ng, 1), *dw0 = randv(nw, 1), *db0 = randv(O, 1);
        double *da = zeros(nx), *dn = malloc(sizeof(double) * nx), *dwa = malloc(sizeof(double) * nw);
        double *dwn = malloc(sizeof(double) * nw), *dba = malloc(sizeof(double) * O), *dbn = malloc(sizeof(double) * O);
        for (size_t i = 0; i < nx; i++) dn[i] = NAN;
        memcpy(dwa, dw0, sizeof(double) * nw), memcpy(dwn, dw0, sizeof(double) * nw);
        memcpy(dba, db0, sizeof(double) * O), memcpy(dbn, db0, sizeof(double) * O);
        linear_backward_f64(da, dwa, dba, g, x, w, N, K, O);
        linear_backward_write_f64(dn, dwn, dbn, g, x, w, N, K, O);
        size_t bad = 0;
        for (size_t i = 0; i < nx; i++) bad += !(dn[i] == da[i]);
        CHECK(bad == 0, "linear_backward_write_f64 (%d,%d,%d): %zu of %zu dinp values differ from an accumulate into "
              "zeros (a NaN-filled dinp was read)", N, K, O, bad, nx);
        CHECK(!memcmp(dwa, dwn, sizeof(double) * nw) && !memcmp(dba, dbn, sizeof(double) * O),
              "linear_backward_write_f64 (%d,%d,%d): dw or db differ from linear_backward's", N, K, O);
        float *fx = malloc(sizeof(float) * nx), *fw = malloc(sizeof(float) * nw), *fg = malloc(sizeof(float) * ng);
        float *fa = calloc(nx, sizeof(float)), *fn = malloc(sizeof(float) * nx), *fwa = calloc(nw, sizeof(float));
        float *fwn = calloc(nw, sizeof(float)), *fba = calloc(O, sizeof(float)), *fbn = calloc(O, sizeof(float));
        for (size_t i = 0; i < nx; i++) fx[i] = (float)x[i], fn[i] = NAN;
        for (size_t i = 0; i < nw; i++) fw[i] = (float)w[i];
        for (size_t i = 0; i < ng; i++) fg[i] = (float)g[i];
        linear_backward_f32(fa, fwa, fba, fg, fx, fw, N, K, O);
        linear_backward_write_f32(fn, fwn, fbn, fg, fx, fw, N, K, O);
        bad = 0;
        for (size_t i = 0; i < nx; i++) bad += !(fn[i] == fa[i]);
        CHECK(bad == 0, "linear_backward_write_f32 (%d,%d,%d): %zu of %zu dinp values differ from an accumulate into "
              "zeros (a NaN-filled dinp was read)", N, K, O, bad, nx);
        CHECK(!memcmp(fwa, fwn, sizeof(float) * nw) && !memcmp(fba, fbn, sizeof(float) * O),
              "linear_backward_write_f32 (%d,%d,%d): dw or db differ from linear_backward's", N, K, O);
        free(x), free(w), free(g), free(dw0), free(db0), free(da), free(dn), free(dwa), free(dwn), free(dba), free(dbn);
        free(fx), free(fw), free(fg), free(fa), free(fn), free(fwa), free(fwn), free(fba), free(fbn);
    }
}

// ---- layernorm
typedef struct { double *out, *m, *rs, *inp, *w, *b, *r; int N, C; } ln_ctx;
static double ln_loss(void *p) {
    ln_ctx *c = p;
    layernorm_forward_f64(c->out, c->m, c->rs, c->inp, c->w, c->b, c->N, c->C, 1e-5);
    return dot(c->out, c->r, (size_t)c->N * c->C);
}
static void test_layernorm(void) {
    ln_ctx c = {zeros(12), zeros(3), zeros(3), randv(12, 1), randv(4, 1), randv(4, 1), randv(12, 1), 3, 4};
    double *di = zeros(12), *dw = zeros(4), *db = zeros(4);
    ln_loss(&c);
    layernorm_backward_f64(di, dw, db, c.r, c.inp, c.w, c.m, c.rs, 3, 4);
    fd_check("layernorm dinp", ln_loss, &c, c.inp, di, 12);
    fd_check("layernorm dw", ln_loss, &c, c.w, dw, 4);
    fd_check("layernorm db", ln_loss, &c, c.b, db, 4);
    // golden: x = [1 2 3 4] -> mean 2.5, var 1.25, (x-2.5)/sqrt(1.25+eps)
    double x[4] = {1, 2, 3, 4}, one[4] = {1, 1, 1, 1}, zero[4] = {0}, o[4], m, r;
    layernorm_forward_f64(o, &m, &r, x, one, zero, 1, 4, 0);
    CHECK_CLOSE(o[0], -1.5 / sqrt(1.25), 1e-12, 0, "layernorm golden[0]");
    CHECK_CLOSE(o[3], 1.5 / sqrt(1.25), 1e-12, 0, "layernorm golden[3]");
    free(c.out), free(c.m), free(c.rs), free(c.inp), free(c.w), free(c.b), free(c.r);
    free(di), free(dw), free(db);
}

// ---- activations and softmax
typedef struct { double *out, *inp, *r; int n, kind; } act_ctx;
static double act_loss(void *p) {
    act_ctx *c = p;
    act_forward_f64(c->out, c->inp, (size_t)c->n, c->kind);
    return dot(c->out, c->r, (size_t)c->n);
}
static double sm_loss(void *p) {
    act_ctx *c = p;
    softmax_forward_f64(c->out, c->inp, 3, c->n / 3);
    return dot(c->out, c->r, (size_t)c->n);
}
static void test_activations(void) {
    const char *names[3] = {"gelu", "gelu_tanh", "quick_gelu"};
    for (int k = 0; k < 3; k++) {
        act_ctx c = {zeros(12), randv(12, 2), randv(12, 1), 12, k};
        double *di = zeros(12);
        act_loss(&c);
        act_backward_f64(di, c.inp, c.r, 12, k);
        fd_check(names[k], act_loss, &c, c.inp, di, 12);
        free(c.out), free(c.inp), free(c.r), free(di);
    }
    // golden: gelu(1) = 0.5*(1+erf(1/sqrt2)) = 0.8413447460685429; gelu_tanh(1) = 0.8411919906082768;
    // quick_gelu(1) = 1/(1+e^-1.702) = 0.8457957659328212
    double x = 1, y;
    act_forward_f64(&y, &x, 1, VLMOE_ACT_GELU);
    CHECK_CLOSE(y, 0.8413447460685429, 1e-15, 0, "gelu(1)");
    act_forward_f64(&y, &x, 1, VLMOE_ACT_GELU_TANH);
    CHECK_CLOSE(y, 0.8411919906082768, 1e-15, 0, "gelu_tanh(1)");
    act_forward_f64(&y, &x, 1, VLMOE_ACT_QUICK_GELU);
    CHECK_CLOSE(y, 0.8457957659328212, 1e-15, 0, "quick_gelu(1)");
    act_ctx c = {zeros(12), randv(12, 2), randv(12, 1), 12, 0};
    double *di = zeros(12);
    sm_loss(&c);
    softmax_backward_f64(di, c.out, c.r, 3, 4);
    fd_check("softmax", sm_loss, &c, c.inp, di, 12);
    double s[3] = {0, log(2), log(5)}, so[3]; // -> 1/8, 2/8, 5/8
    softmax_forward_f64(so, s, 1, 3);
    CHECK_CLOSE(so[2], 0.625, 1e-15, 0, "softmax golden");
    free(c.out), free(c.inp), free(c.r), free(di);
}

// ---- attention: causal and padding masks
typedef struct { double *out, *att, *qkv, *r; attn_segment seg; int D, H; size_t n; } att_ctx;
static double att_loss(void *p) {
    att_ctx *c = p;
    attention_forward_f64(c->out, c->att, c->qkv, &c->seg, c->D, c->H);
    return dot(c->out, c->r, c->n);
}
// modes: bit 0 causal, bit 1 padded, bit 2 causal with a prefix of 2 (BEiT-3's captioning mask:
// an image of 2 tokens seen both ways, then text seeing the image and causally itself)
static void test_attention(void) {
    const int B = 2, T = 4, D = 6, H = 2;
    int32_t lens[2] = {4, 3};
    for (int mode = 0; mode < 8; mode++) {
        if ((mode & 5) == 5) continue; // the prefix implies causal
        const int causal = (mode & 1) || (mode & 4), padded = (mode >> 1) & 1, prefix = mode & 4 ? 2 : 0;
        att_ctx c;
        c.D = D, c.H = H, c.n = (size_t)B * T * D;
        c.seg = (attn_segment){.nseq = B, .seqlen = T, .causal = causal, .lens = padded ? lens : NULL, .prefix = prefix};
        c.out = zeros(c.n), c.att = zeros((size_t)B * H * T * T), c.qkv = randv(c.n * 3, 1);
        c.r = randv(c.n, 1);
        double *dq = zeros(c.n * 3), *da = zeros((size_t)B * H * T * T);
        att_loss(&c);
        attention_backward_f64(dq, da, c.r, c.qkv, c.att, &c.seg, D, H);
        char what[64];
        snprintf(what, sizeof(what), "attention causal=%d padded=%d prefix=%d", causal, padded, prefix);
        fd_check(what, att_loss, &c, c.qkv, dq, c.n * 3);
        // masked probabilities are exactly zero, the allowed ones are not, and rows sum to one
        int ok = 1;
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < T; i++) {
                    double s = 0;
                    const int len = padded ? lens[b] : T, k = i < prefix ? prefix : i + 1;
                    const int nk = causal && k < len ? k : len;
                    for (int j = 0; j < T; j++) {
                        double pr = c.att[(((size_t)b * H + h) * T + i) * T + j];
                        if ((j < nk) != (pr != 0)) ok = 0;
                        s += pr;
                    }
                    if (fabs(s - 1) > 1e-12) ok = 0;
                }
        CHECK(ok, "%s: masked probabilities not zero or rows not normalised", what);
        // the prefix mask by hand: query 0 (image) sees keys 0-1, query 2 (text) keys 0-2
        if (prefix && !padded) {
            const double *a = c.att;
            CHECK(a[1] != 0 && a[2] == 0 && a[2 * T + 2] != 0 && a[2 * T + 3] == 0, "prefix mask rows 0 and 2");
        }
        free(c.out), free(c.att), free(c.qkv), free(c.r), free(dq), free(da);
    }
}

// ---- embeddings, class token, pooling, L2 normalisation, patchify
typedef struct { double *out, *a, *b, *r; const int32_t *ids; int which; size_t n; } emb_ctx;
static double emb_loss(void *p) {
    emb_ctx *c = p;
    switch (c->which) {
    case 0: embed_forward_f64(c->out, c->ids, c->a, 6, 3); break;      // wte (5,3), 6 tokens
    case 1: memset(c->out, 0, sizeof(double) * c->n); posadd_forward_f64(c->out, c->a, 2, 3, 3); break;
    case 2: cls_forward_f64(c->out, c->a, c->b, 2, 2, 3); break;        // cls (3), x (2,2,3)
    case 3: patchify_forward_f64(c->out, c->a, 1, 2, 4, 2); break;      // (1,2,4,4) -> (1,4,8)
    }
    return dot(c->out, c->r, c->n);
}
static void test_embeddings(void) {
    int32_t ids[6] = {0, 3, 3, 1, 4, 3}; // repeated ids accumulate
    emb_ctx c = {zeros(18), randv(15, 1), NULL, randv(18, 1), ids, 0, 18};
    double *d = zeros(15);
    emb_loss(&c);
    embed_backward_f64(d, c.r, ids, 6, 3);
    fd_check("token embedding", emb_loss, &c, c.a, d, 15);
    free(c.a), free(d);
    c.which = 1, c.a = randv(9, 1), d = zeros(9);
    emb_loss(&c);
    posadd_backward_f64(d, c.r, 2, 3, 3);
    fd_check("position embedding", emb_loss, &c, c.a, d, 9);
    free(c.a), free(d);
    c.which = 2, c.a = randv(3, 1), c.b = randv(12, 1);
    double *dc = zeros(3), *dx = zeros(12);
    emb_loss(&c);
    cls_backward_f64(dc, dx, c.r, 2, 2, 3);
    fd_check("class token dcls", emb_loss, &c, c.a, dc, 3);
    fd_check("class token dx", emb_loss, &c, c.b, dx, 12);
    free(c.a), free(c.b), free(dc), free(dx), free(c.out), free(c.r);
    emb_ctx p = {zeros(32), randv(32, 1), NULL, randv(32, 1), NULL, 3, 32};
    double *dimg = zeros(32);
    emb_loss(&p);
    patchify_backward_f64(dimg, p.r, 1, 2, 4, 2);
    fd_check("patchify", emb_loss, &p, p.a, dimg, 32);
    // golden: patch 1 (top-right) of channel 0 starts at pixel (0,2), then (0,3), (1,2), (1,3)
    double img[32], pat[32];
    for (int i = 0; i < 32; i++) img[i] = i;
    patchify_forward_f64(pat, img, 1, 2, 4, 2);
    CHECK(pat[8] == 2 && pat[9] == 3 && pat[10] == 6 && pat[11] == 7 && pat[12] == 18,
          "patchify golden: %g %g %g %g %g", pat[8], pat[9], pat[10], pat[11], pat[12]);
    free(p.out), free(p.a), free(p.r), free(dimg);
}

typedef struct { double *out, *norm, *x, *r; const int32_t *lens; int kind; } pool_ctx;
static double pool_loss(void *p) {
    pool_ctx *c = p;
    pool_forward_f64(c->out, c->x, c->lens, 2, 4, 3, c->kind);
    return dot(c->out, c->r, 6);
}
static double l2_loss(void *p) {
    pool_ctx *c = p;
    l2norm_forward_f64(c->out, c->norm, c->x, 2, 3);
    return dot(c->out, c->r, 6);
}
static void test_pool_l2(void) {
    int32_t lens[2] = {4, 2};
    const char *names[3] = {"mean pool", "cls pool", "eot pool"};
    for (int k = 0; k < 3; k++) {
        pool_ctx c = {zeros(6), NULL, randv(24, 1), randv(6, 1), lens, k};
        double *dx = zeros(24);
        pool_loss(&c);
        pool_backward_f64(dx, c.r, lens, 2, 4, 3, k);
        fd_check(names[k], pool_loss, &c, c.x, dx, 24);
        // masked positions (sequence 1, positions 2 and 3) get no gradient
        CHECK(dx[12 + 6] == 0 && dx[12 + 9] == 0, "%s: padding received gradient", names[k]);
        free(c.out), free(c.x), free(c.r), free(dx);
    }
    pool_ctx c = {zeros(6), zeros(2), randv(6, 1), randv(6, 1), NULL, 0};
    double *dx = zeros(6);
    l2_loss(&c);
    l2norm_backward_f64(dx, c.r, c.out, c.norm, 2, 3);
    fd_check("l2 normalise", l2_loss, &c, c.x, dx, 6);
    double v[3] = {3, 4, 0}, o[3], nr;
    l2norm_forward_f64(o, &nr, v, 1, 3);
    CHECK(o[0] == 0.6 && o[1] == 0.8 && nr == 5, "l2 golden: %g %g norm %g", o[0], o[1], nr);
    free(c.out), free(c.norm), free(c.x), free(c.r), free(dx);
}

// ---- contrastive loss
typedef struct { double *img, *txt, logits[9], prow[9], pcol[9], scale; } con_ctx;
static double con_loss(void *p) {
    con_ctx *c = p;
    return contrastive_forward_f64(c->logits, c->prow, c->pcol, c->img, c->txt, c->scale, 3, 4, NULL);
}
static void test_contrastive(void) {
    con_ctx c;
    c.img = randv(12, 1), c.txt = randv(12, 1), c.scale = log(3.0);
    double *di = zeros(12), *dt = zeros(12), ds = 0;
    con_loss(&c);
    contrastive_backward_f64(di, dt, &ds, c.logits, c.prow, c.pcol, c.img, c.txt, c.scale, 3, 4, 1.0);
    fd_check("contrastive dimg", con_loss, &c, c.img, di, 12);
    fd_check("contrastive dtxt", con_loss, &c, c.txt, dt, 12);
    fd_check("contrastive dscale", con_loss, &c, &c.scale, &ds, 1);
    // golden, B = 2, E = 1, img = txt = [1, -1], scale = 0: logits [[1,-1],[-1,1]]; every row and
    // column cross-entropy is -log(e/(e+e^-1)) = log(1 + e^-2) = 0.12692801104297263.
    double a[2] = {1, -1}, l[4], pr[4], pc[4], acc[2];
    double loss = contrastive_forward_f64(l, pr, pc, a, a, 0, 2, 1, acc);
    CHECK_CLOSE(loss, 0.12692801104297263, 1e-15, 0, "contrastive golden");
    CHECK(acc[0] == 1 && acc[1] == 1, "contrastive accuracy %g %g", acc[0], acc[1]);
    free(c.img), free(c.txt), free(di), free(dt);
}

// The float build's vexp and vexp_fma against libm's expf, in units in the last place, over
// the whole line: normal results, the denormal range (the ulp there is 2^-149), the underflow to
// 0 and the overflow to +inf, and the special values a diverged run or a hostile input brings.
static void vexp_case(const char *name, float (*f)(float)) {
    double worst = 0;
    float at = 0;
    for (float x = -106.0f; x < 90.0f; x += 0.00731f) {
        float want = expf(x), got = f(x);
        if (isinf(want) || isinf(got)) {
            CHECK(got == want, "%s(%.9g) = %g, expf %g", name, x, got, want);
            continue;
        }
        double ulp = fabs((double)got - want) / (nextafterf(want, INFINITY) - want);
        if (ulp > worst) worst = ulp, at = x;
    }
    printf("%s: worst %.2f ulp from expf on [-106, 90] (at %g)\n", name, worst, at);
    CHECK(worst <= 2.0, "%s within 2 ulp of expf on [-106, 90]: worst %.2f ulp at %g", name, worst, at);
    const float special[] = {-INFINITY, INFINITY, -1e30f, 1e30f, -1000.0f, 1000.0f, 0.0f, -0.0f,
                             88.7228317f, 88.7228394f, -87.3365479f /* e^x = FLT_MIN */,
                             -103.278931f /* 2^-149 */, -103.972084f, -104.0f, 1e-45f, -1e-45f};
    for (size_t i = 0; i < sizeof(special) / sizeof(special[0]); i++) {
        float x = special[i], want = expf(x), got = f(x);
        double d = isinf(want) || want == 0 ? (got == want ? 0 : 9)
                                            : fabs((double)got - want) / (nextafterf(want, INFINITY) - want);
        CHECK(d <= 1.0, "%s(%.9g) = %.9g, expf %.9g", name, x, got, want);
    }
    CHECK(isnan(f(NAN)) && isnan(f(-NAN)), "%s(NaN) %g: a NaN must come out a NaN", name, f(NAN));
}
static float vexp1(float x) { return vexp(x); }
static float vexp_fma1(float x) { return vexp_fma(x); }
static void test_vexp(void) {
    vexp_case("vexp", vexp1);
    vexp_case("vexp_fma", vexp_fma1);
    // the two differ only in their roundings: a fused multiply-add that fell back to a multiply
    // and an add (a compiler's or a libm's) would make them equal everywhere
    int differ = 0;
    for (float x = -20.0f; x < 20.0f; x += 0.0173f) differ += vexp(x) != vexp_fma(x);
    CHECK(differ > 0, "vexp_fma gave vexp's bits at every x in [-20, 20]: its multiply-adds are not fused");
    // vexp_sig: vexp_fma's bits on [-87.33, 88.37], clamped past its ends (NaN to the low one)
    int off = 0;
    for (float x = -87.33f; x <= 88.37f; x += 0.00913f) {
        const float e = vexp_sig(x), want = vexp_fma(x);
        off += memcmp(&e, &want, sizeof e) != 0;
    }
    CHECK(off == 0, "vexp_sig differs from vexp_fma at %d points of [-87.33, 88.37]", off);
    const float lo = vexp_sig(-87.33f), hi = vexp_sig(88.37f);
    CHECK(lo >= FLT_MIN && lo < 1.3e-38f && hi > 2.3e38f && hi < FLT_MAX, "vexp_sig at its ends: %g, %g", lo, hi);
    CHECK(vexp_sig(-1000) == lo && vexp_sig(-INFINITY) == lo && vexp_sig(NAN) == lo && vexp_sig(1000) == hi &&
              vexp_sig(INFINITY) == hi,
          "vexp_sig(-1000, -inf, NaN, 1000, inf) = %g %g %g %g %g: the clamped ends", vexp_sig(-1000),
          vexp_sig(-INFINITY), vexp_sig(NAN), vexp_sig(1000), vexp_sig(INFINITY));
}

// Attention in float against double at sizes on both sides of ATT_KT_MAX (src/ops/ops.c: heads
// of T hd <= 16384 floats take the scores from a transposed copy of k, larger ones read k
// transposed): out and dqkv within float rounding of the double kernels.
static void att_f32_case(int T, int D, int H, int causal) {
    const size_t nq = (size_t)2 * T * 3 * D, no = (size_t)2 * T * D, na = (size_t)2 * H * T * T;
    double *qkv = randv(nq, 1), *g = randv(no, 1), *out = zeros(no), *att = zeros(na), *da = zeros(na), *dq = zeros(nq);
    float *fq = malloc(sizeof(float) * nq), *fg = malloc(sizeof(float) * no), *fo = calloc(no, sizeof(float));
    float *fa = calloc(na, sizeof(float)), *fda = calloc(na, sizeof(float)), *fdq = calloc(nq, sizeof(float));
    for (size_t i = 0; i < nq; i++) fq[i] = (float)qkv[i];
    for (size_t i = 0; i < no; i++) fg[i] = (float)g[i];
    for (size_t i = 0; i < nq; i++) fdq[i] = 12345; // the backward writes dqkv: nothing may be left of this
    for (size_t i = 0; i < nq; i++) qkv[i] = fq[i];
    for (size_t i = 0; i < no; i++) g[i] = fg[i];
    const attn_segment seg = {.tok_off = 0, .nseq = 2, .seqlen = T, .causal = causal};
    attention_forward_f64(out, att, qkv, &seg, D, H);
    attention_forward_f32(fo, fa, fq, &seg, D, H);
    attention_backward_f64(dq, da, g, qkv, att, &seg, D, H);
    attention_backward_f32(fdq, fda, fg, fq, fa, &seg, D, H);
    double eo = 0, ed = 0;
    for (size_t i = 0; i < no; i++) eo = fmax(eo, fabs(fo[i] - out[i]) / (1 + fabs(out[i])));
    for (size_t i = 0; i < nq; i++) ed = fmax(ed, fabs(fdq[i] - dq[i]) / (1 + fabs(dq[i])));
    CHECK(eo < 1e-5 && ed < 1e-4, "attention T %d D %d H %d causal %d: float vs double out %.3g, dqkv %.3g", T, D, H,
          causal, eo, ed);
    free(qkv), free(g), free(out), free(att), free(da), free(dq), free(fq), free(fg), free(fo), free(fa), free(fda), free(fdq);
}
static void test_attention_f32(void) {
    att_f32_case(65, 256, 4, 0);  // bench-s's image heads: the transposed copy
    att_f32_case(16, 256, 4, 1);
    att_f32_case(13, 36, 3, 0);   // hd 12, T 13: the transpose's partial 8x8 tiles at both edges
    att_f32_case(300, 128, 2, 0); // T hd = 19200: k read transposed
    att_f32_case(300, 128, 2, 1);
}

// verf (real.h) against erf in double, over the line and near 0 where its relative error
// matters most; erff's own error printed beside it. GELU (erf) in float computes with it.
static void test_verf(void) {
    double worst = 0, worst_libm = 0;
    float at = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (float x = pass ? 1e-30f : -7.0f; pass ? x < 1.0f : x < 7.0f; x = pass ? x * 1.013f : x + 0.000371f) {
            const double want = erf((double)x);
            const float fw = (float)want;
            const double ulp = fw == 0 ? 1e-45 : fabs((double)nextafterf(fw, INFINITY) - fw);
            const double e = fabs((double)verf(x) - want) / ulp, el = fabs((double)erff(x) - want) / ulp;
            if (e > worst) worst = e, at = x;
            if (el > worst_libm) worst_libm = el;
        }
    }
    printf("verf: worst %.2f ulp from erf on [-7, 7] and (1e-30, 1) (at %g); erff %.2f ulp\n", worst, at, worst_libm);
    CHECK(worst <= 1.5, "verf within 1.5 ulp of erf: worst %.2f ulp at %g", worst, at);
    CHECK(verf(INFINITY) == 1 && verf(-INFINITY) == -1 && verf(1e30f) == 1 && verf(-4.5f) == -1 && verf(0) == 0,
          "verf(+-inf, 1e30, -4.5, 0) = %g %g %g %g %g", verf(INFINITY), verf(-INFINITY), verf(1e30f), verf(-4.5f),
          verf(0));
    CHECK(isnan(verf(NAN)), "verf(NaN) = %g: a NaN must come out a NaN", verf(NAN));
}

// A row's linear output does not depend on how many rows go with it (batch-size invariance).
static void test_linear_rows(void) {
    enum { K = 37, O = 29, N = 6 };
    float x[N * K], w[O * K], b[O], all[N * O], one[O];
    for (int i = 0; i < N * K; i++) x[i] = (float)vlmoe_rng_normal(&rng);
    for (int i = 0; i < O * K; i++) w[i] = (float)vlmoe_rng_normal(&rng);
    for (int i = 0; i < O; i++) b[i] = (float)vlmoe_rng_normal(&rng);
    linear_forward_f32(all, x, w, b, N, K, O, 0);
    int same = 1;
    for (int n = 0; n < N; n++) {
        linear_forward_f32(one, x + n * K, w, b, 1, K, O, 0);
        same &= !memcmp(one, all + n * O, sizeof(one));
    }
    CHECK(same, "a row alone and the same row in a batch of %d differ", N);
}

// linear_backward_f32's dw += dout^T inp over N tokens (K inputs, O outputs) against a double
// sum to fp32 rounding, dw starting at 0.5 (so the add is checked, not just a write), and the
// same bits at 1 and 2 threads.
static void check_dw(int N, int K, int O) {
    float *x = malloc(sizeof(float) * N * K), *g = malloc(sizeof(float) * N * O), *w = malloc(sizeof(float) * O * K);
    float *dw[2] = {malloc(sizeof(float) * O * K), malloc(sizeof(float) * O * K)};
    float *di = calloc((size_t)N * K, sizeof(float)), *db = calloc(O, sizeof(float));
    for (int i = 0; i < N * K; i++) x[i] = (float)vlmoe_rng_normal(&rng);
    for (int i = 0; i < N * O; i++) g[i] = (float)vlmoe_rng_normal(&rng);
    for (int i = 0; i < O * K; i++) w[i] = (float)vlmoe_rng_normal(&rng), dw[0][i] = dw[1][i] = 0.5f;
    for (int t = 0; t < 2; t++) {
        omp_set_num_threads(t + 1);
        linear_backward_f32(di, dw[t], db, g, x, w, N, K, O);
    }
    omp_set_num_threads(2);
    int bad = 0;
    for (int o = 0; o < O; o++)
        for (int k = 0; k < K; k++) {
            double s = 0.5, mag = 0.5;
            for (int n = 0; n < N; n++) {
                const double p = (double)g[(size_t)n * O + o] * x[(size_t)n * K + k];
                s += p, mag += fabs(p);
            }
            bad += fabs(dw[0][o * K + k] - s) > (N + 2) * 6e-8 * mag;
        }
    CHECK(bad == 0, "linear_backward_f32 over %d tokens, %d in, %d out: %d of %d dw values beyond fp32 rounding of "
          "the double sum", N, K, O, bad, O * K);
    CHECK(!memcmp(dw[0], dw[1], sizeof(float) * O * K), "linear_backward_f32 over %d tokens, %d in, %d out: dw "
          "differs between 1 and 2 threads", N, K, O);
    free(x), free(g), free(w), free(dw[0]), free(dw[1]), free(di), free(db);
}

// A weight gradient summed over thousands of tokens (where, with vlmoe's own AVX2 product, the
// sum is cut in chunks of tokens added after: ops.c's gemm_ksplit), for token counts that give 2
// and 4 chunks, the last a short one.
static void test_linear_long_sum(void) {
    check_dw(4685, 20, 12);
    check_dw(9000, 20, 12);
}

// A weight gradient whose dout rows lie 4 KB apart (1024 outputs) and outnumber its inputs, which
// ops.c's gemm_tn_transposed computes as its transpose and adds back where oneDNN's sgemm runs
// the products (vlmoe's own AVX2 product sums it in chunks of tokens instead), with neither
// dimension a whole number of its 32 x 32 tiles.
static void test_linear_wide_dw(void) { check_dw(300, 37, 1024); }

// The CPU table's expert bank (src/ops/backend_cpu.c) at 1 thread (one expert at a time, both
// threads in each product) and at 2 (from 4 experts with rows, whole experts side by side): the
// same bits for y, h, a, dx (accumulated and written), dw and db. Six experts of 1-300 rows,
// expert 2 empty, the largest last (the side-by-side order is by size).
static void test_experts_threads(void) {
    const int E = 6, D = 24, M = 80;
    const int32_t off[7] = {0, 37, 38, 38, 150, 170, 470};
    const int R = off[E];
    const be_experts ex = {E, D, M, VLMOE_ACT_GELU_TANH, off};
    const vlmoe_backend_f32 *be = backend_cpu_f32();
    const size_t nw[4] = {(size_t)E * M * D, (size_t)E * M, (size_t)E * D * M, (size_t)E * D};
    float *w[4], *out[2][10];
    for (int i = 0; i < 4; i++) {
        w[i] = malloc(sizeof(float) * nw[i]);
        for (size_t j = 0; j < nw[i]; j++) w[i][j] = (float)(0.2 * vlmoe_rng_normal(&rng));
    }
    float *x = malloc(sizeof(float) * R * D), *dy = malloc(sizeof(float) * R * D);
    for (int j = 0; j < R * D; j++) x[j] = (float)vlmoe_rng_normal(&rng), dy[j] = (float)vlmoe_rng_normal(&rng);
    const size_t n[10] = {(size_t)R * D, (size_t)R * M, (size_t)R * M, (size_t)R * D, nw[0], nw[1], nw[2], nw[3],
                          (size_t)R * M, (size_t)R * D}; // y h a dx dw1 db1 dw2 db2 dh dx(write)
    const float *const cw[4] = {w[0], w[1], w[2], w[3]};
    for (int t = 0; t < 2; t++) {
        omp_set_num_threads(t + 1);
        for (int i = 0; i < 10; i++) {
            out[t][i] = malloc(sizeof(float) * n[i]);
            for (size_t j = 0; j < n[i]; j++) out[t][i][j] = i < 8 && i != 1 && i != 2 ? 0.25f : 0.0f;
        }
        float *da = malloc(sizeof(float) * R * M);
        be->experts_forward(be, out[t][0], out[t][1], out[t][2], x, cw, &ex, 1);
        float *const dw[4] = {out[t][4], out[t][5], out[t][6], out[t][7]};
        be->experts_backward(be, out[t][3], dw, dy, x, out[t][1], cw, da, out[t][8], &ex);
        be->experts_backward_write(be, out[t][9], dw, dy, x, out[t][1], cw, da, out[t][8], &ex);
        free(da);
    }
    omp_set_num_threads(2);
    const char *names[10] = {"y", "h", "a", "dx", "dw1", "db1", "dw2", "db2", "dh", "dx (write)"};
    for (int i = 0; i < 10; i++) {
        CHECK(!memcmp(out[0][i], out[1][i], sizeof(float) * n[i]), "expert bank: %s differs between 1 and 2 threads",
              names[i]);
        free(out[0][i]), free(out[1][i]);
    }
    // and the values are the bank's: y's rows of expert 5 as one linear pair by hand
    float *h5 = malloc(sizeof(float) * 300 * M), *a5 = malloc(sizeof(float) * 300 * M), *y5 = malloc(sizeof(float) * 300 * D);
    linear_forward_f32(h5, x + 170 * D, w[0] + 5 * M * D, w[1] + 5 * M, 300, D, M, 0);
    act_forward_f32(a5, h5, (size_t)300 * M, VLMOE_ACT_GELU_TANH);
    linear_forward_f32(y5, a5, w[2] + 5 * D * M, w[3] + 5 * D, 300, M, D, 0);
    float *y = calloc((size_t)R * D, sizeof(float)), *h = malloc(sizeof(float) * R * M), *a = malloc(sizeof(float) * R * M);
    be->experts_forward(be, y, h, a, x, cw, &ex, 0);
    double worst = 0;
    for (int j = 0; j < 300 * D; j++) worst = fmax(worst, fabs(y[170 * D + j] - y5[j]) / (1 + fabs(y5[j])));
    CHECK(worst < 1e-5, "expert bank: expert 5's rows differ from its two linears by %.3g", worst);
    free(h5), free(a5), free(y5), free(y), free(h), free(a), free(x), free(dy);
    for (int i = 0; i < 4; i++) free(w[i]);
}

// The MLP's fused first layer against the unfused ops, in float: a = act(h) and dh = (dy.w)
// act'(h) to the bit for the same h, h within rounding of linear_forward (the bias goes in
// after the product instead of before), and the backward's dw, db as linear_backward's. Two
// shapes: products split into row blocks (N > O) and into column blocks (O > N), several of each.
// The same bits, or NaN on both sides (a NaN's sign and payload are not the expression's: they
// follow which operand x86 passes on, and the unfused backward adds where the fused multiplies;
// GCC may also compute -0.5 x as -(0.5 x) to share a product, which flips a NaN's sign; dw's
// sums carry such a NaN on).
static int same_or_nan(const float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(x + i, y + i, sizeof(float)) && !(isnan(x[i]) && isnan(y[i]))) return 0;
    return 1;
}

static void fused_case(int N, int K, int O, int act, int special) {
    const size_t nh = (size_t)N * O;
    float *x = malloc(sizeof(float) * N * K), *w = malloc(sizeof(float) * O * K), *b = malloc(sizeof(float) * O);
    float *h = malloc(sizeof(float) * nh), *a = malloc(sizeof(float) * nh), *h0 = malloc(sizeof(float) * nh);
    float *a0 = malloc(sizeof(float) * nh), *dy = malloc(sizeof(float) * N * K), *g = calloc(nh, sizeof(float));
    float *dh = malloc(sizeof(float) * nh), *dh0 = calloc(nh, sizeof(float)), *ar = malloc(sizeof(float) * nh);
    float *dw = calloc((size_t)K * O, sizeof(float)), *dw0 = calloc((size_t)K * O, sizeof(float));
    float *db = calloc((size_t)K, sizeof(float)), *db0 = calloc((size_t)K, sizeof(float));
    for (int i = 0; i < N * K; i++) x[i] = (float)vlmoe_rng_normal(&rng), dy[i] = (float)vlmoe_rng_normal(&rng);
    for (int i = 0; i < O * K; i++) w[i] = (float)(0.2 * vlmoe_rng_normal(&rng));
    for (int i = 0; i < O; i++) b[i] = (float)vlmoe_rng_normal(&rng);
    // special: biases that put whole columns of h where e^x saturates, flushes or breaks (NaN,
    // infinities, past exp's clamps at 88.7 and -104, GELU's tail), columns 16.. to cross a vector
    const float sp[] = {NAN, INFINITY, -INFINITY, 1000, -1000, 88.75f, -104.5f, 50, -50, -9, 9};
    for (int i = 0; special && i < (int)(sizeof(sp) / sizeof(sp[0])) && 16 + i < O; i++) b[16 + i] = sp[i];
    linear_act_forward_f32(h, a, x, w, b, N, K, O, act);
    linear_forward_f32(h0, x, w, b, N, K, O, 0);
    act_forward_f32(a0, h, nh, act);
    double herr = 0;
    for (size_t i = 0; i < nh; i++) herr = fmax(herr, fabs(h[i] - h0[i]) / (1 + fabs(h0[i])));
    CHECK(herr < 1e-5, "linear_act_forward %dx%dx%d act %d: h differs from linear_forward by %.3g", N, K, O, act, herr);
    CHECK(same_or_nan(a, a0, nh), "linear_act_forward %dx%dx%d act %d: a is not act_forward(h)", N, K, O, act);
    // backward through a second layer w2 (K,O): dy (N,K)
    act_linear_backward_f32(dh, ar, dw, db, dy, h, w, N, O, K, act);
    linear_backward_f32(g, dw0, db0, dy, a0, w, N, O, K);
    for (size_t i = 0; i < nh; i++) dh0[i] = -0.0f; // act_backward adds: -0 + y is y, signed zeros too
    act_backward_f32(dh0, h, g, nh, act);
    CHECK(same_or_nan(ar, a0, nh), "act_linear_backward %dx%dx%d act %d: a is not act(h)", N, K, O, act);
    CHECK(same_or_nan(dh, dh0, nh), "act_linear_backward %dx%dx%d act %d: dh differs from the unfused ops", N, K, O, act);
    CHECK(same_or_nan(dw, dw0, (size_t)K * O) && same_or_nan(db, db0, (size_t)K),
          "act_linear_backward %dx%dx%d act %d: dw or db differ from linear_backward", N, K, O, act);
    free(x), free(w), free(b), free(h), free(a), free(h0), free(a0), free(dy), free(g), free(dh), free(dh0), free(ar);
    free(dw), free(dw0), free(db), free(db0);
}

// The same in double against finite differences of the composition, and the shapes above.
typedef struct { double *h, *a, *x, *w, *b, *w2, *r; int N, K, O, act; } mlp_ctx;
static double mlp_loss(void *p) {
    mlp_ctx *c = p;
    double y[12];
    linear_act_forward_f64(c->h, c->a, c->x, c->w, c->b, c->N, c->K, c->O, c->act);
    linear_forward_f64(y, c->a, c->w2, NULL, c->N, c->O, c->K, 0);
    return dot(y, c->r, (size_t)c->N * c->K);
}
static void test_fused_mlp(void) {
    for (int act = 0; act < 3; act++) {
        // the activations' AVX2 kernels, then, where the CPU has it, their AVX-512 twins
        for (int wide = 0; wide < 2; wide++) {
            if (act_simd_avx512(wide) == 0 && wide) break;
            fused_case(1100, 9, 30, act, 0);
            fused_case(7, 11, 1100, act, 0);
            fused_case(300, 9, 45, act, 1);
        }
        act_simd_avx512(1);
        mlp_ctx c = {zeros(15), zeros(15), randv(12, 1), randv(20, 0.7), randv(5, 0.5), randv(20, 0.7), randv(12, 1),
                     3, 4, 5, act};
        mlp_loss(&c);
        double *dh = zeros(15), *ar = zeros(15), *dw2 = zeros(20), *dx = zeros(12), *dw = zeros(20), *db = zeros(5);
        act_linear_backward_f64(dh, ar, dw2, NULL, c.r, c.h, c.w2, 3, 5, 4, act);
        linear_backward_f64(dx, dw, db, dh, c.x, c.w, 3, 4, 5);
        fd_check("fused mlp dx", mlp_loss, &c, c.x, dx, 12);
        fd_check("fused mlp dw1", mlp_loss, &c, c.w, dw, 20);
        fd_check("fused mlp db1", mlp_loss, &c, c.b, db, 5);
        fd_check("fused mlp dw2", mlp_loss, &c, c.w2, dw2, 20);
        free(c.h), free(c.a), free(c.x), free(c.w), free(c.b), free(c.w2), free(c.r);
        free(dh), free(ar), free(dw2), free(dx), free(dw), free(db);
    }
}

int main(void) {
    vlmoe_rng_seed(&rng, 42);
    test_fused_mlp();
    test_vexp();
    test_verf();
    test_linear_rows();
    test_linear_long_sum();
    test_linear_wide_dw();
    test_experts_threads();
    test_linear();
    test_linear_write();
    test_layernorm();
    test_activations();
    test_attention();
    test_attention_f32();
    test_embeddings();
    test_pool_l2();
    test_contrastive();
    return test_summary("test_ops");
}
