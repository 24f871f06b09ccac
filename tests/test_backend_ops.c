// test_backend_ops.c: every op of the backend table (src/ops/backend.h), in the manner of ggml's
// test-backend-ops: random inputs, the op run on each built backend in float (the CPU table, and
// the CUDA table when this build has one and a device is present) and compared with the CPU
// table in double, the reference. Floats must agree to NMSE <= 1e-7; integer outputs exactly.
// Then the bf16 products (`--precision bf16`): the cuda-bf16 table against the cpu-bf16 table
// within a bound of fp32 accumulation order (tests/test_backend_bf16.h).
// Prints a line per op and backend, then "N passed, N failed, N skipped".
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/backend.h"
#include "test.h"
#include "test_backend_bf16.h"

#define NMSE_MAX 1e-7
#define MAXBUF 64

typedef struct {
    const vlmoe_backend_f32 *be;
    const vlmoe_backend_f64 *ref;
    vlmoe_rng r;
    int pass, fail, skip;
    int op_fail;
    double worst;
    void *dev[MAXBUF];
    int ndev;
    void *host[MAXBUF];
    int nhost;
} ctx;

static void *keep_host(ctx *c, void *p) {
    if (c->nhost < MAXBUF) c->host[c->nhost++] = p;
    return p;
}

// n doubles uniform in [-scale, scale]
static double *rnd(ctx *c, size_t n, double scale) {
    double *p = keep_host(c, calloc(n + 1, sizeof(double)));
    for (size_t i = 0; i < n; i++) p[i] = scale * (2 * vlmoe_rng_uniform(&c->r) - 1);
    return p;
}
static double *zeros(ctx *c, size_t n) { return keep_host(c, calloc(n + 1, sizeof(double))); }

// the tested backend's float copy of a double array
static float *up(ctx *c, const double *h, size_t n) {
    float *tmp = malloc(sizeof(float) * (n + 1));
    for (size_t i = 0; i < n; i++) tmp[i] = (float)h[i];
    float *d = c->be->alloc(c->be, sizeof(float) * (n + 1), "test buffer");
    c->be->upload(c->be, d, tmp, n);
    free(tmp);
    if (c->ndev < MAXBUF) c->dev[c->ndev++] = d;
    return d;
}
static void *upb(ctx *c, const void *h, size_t bytes) {
    void *d = c->be->alloc(c->be, bytes + 8, "test buffer");
    c->be->upload_bytes(c->be, d, h, bytes);
    if (c->ndev < MAXBUF) c->dev[c->ndev++] = d;
    return d;
}

static void release(ctx *c) {
    for (int i = 0; i < c->ndev; i++) c->be->free(c->be, c->dev[i]);
    for (int i = 0; i < c->nhost; i++) free(c->host[i]);
    c->ndev = c->nhost = 0;
}

// NMSE of the backend's output (device, n floats) against the reference
static void cmp(ctx *c, const char *what, const float *dev, const double *ref, size_t n) {
    float *h = malloc(sizeof(float) * (n + 1));
    c->be->sync(c->be);
    c->be->download(c->be, h, dev, n);
    double num = 0, den = 0;
    int finite = 1;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)h[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
        finite &= isfinite(h[i]) && isfinite(ref[i]);
    }
    free(h);
    const double nmse = den > 0 ? num / den : num;
    if (!finite || !(nmse <= NMSE_MAX)) {
        c->op_fail = 1;
        fprintf(stderr, "    %s: NMSE %.3g > %.0e%s\n", what, nmse, NMSE_MAX, finite ? "" : " (non-finite)");
    }
    if (nmse > c->worst) c->worst = nmse;
}
static void cmp_scalar(ctx *c, const char *what, double got, double ref) {
    const double nmse = ref != 0 ? (got - ref) * (got - ref) / (ref * ref) : (got - ref) * (got - ref);
    if (!(nmse <= NMSE_MAX)) {
        c->op_fail = 1;
        fprintf(stderr, "    %s: %.9g vs %.9g (NMSE %.3g)\n", what, got, ref, nmse);
    }
    if (nmse > c->worst) c->worst = nmse;
}

// ---- the cases: each runs the reference (double, host) and the tested backend (float, its memory)

static void linear_shape(ctx *c, int N, int K, int O) {
    double *x = rnd(c, (size_t)N * K, 1), *w = rnd(c, (size_t)O * K, 0.5), *b = rnd(c, O, 0.5);
    double *out = rnd(c, (size_t)N * O, 1), *dout = rnd(c, (size_t)N * O, 1);
    float *fx = up(c, x, (size_t)N * K), *fw = up(c, w, (size_t)O * K), *fb = up(c, b, O), *fo = up(c, out, (size_t)N * O);
    float *fdo = up(c, dout, (size_t)N * O);
    c->ref->linear_forward(c->ref, out, x, w, b, N, K, O, 1); // beta 1: adds onto the output
    c->be->linear_forward(c->be, fo, fx, fw, fb, N, K, O, 1);
    cmp(c, "out", fo, out, (size_t)N * O);
    double *dx = zeros(c, (size_t)N * K), *dw = rnd(c, (size_t)O * K, 1), *db = rnd(c, O, 1);
    float *fdx = up(c, dx, (size_t)N * K), *fdw = up(c, dw, (size_t)O * K), *fdb = up(c, db, O);
    c->ref->linear_backward(c->ref, dx, dw, db, dout, x, w, N, K, O);
    c->be->linear_backward(c->be, fdx, fdw, fdb, fdo, fx, fw, N, K, O);
    cmp(c, "dinp", fdx, dx, (size_t)N * K);
    cmp(c, "dw", fdw, dw, (size_t)O * K);
    cmp(c, "db", fdb, db, O);
    // the write mode, where the table has it: dinp holds NaN first (on both sides), so a
    // leftover accumulate or a beta*dinp fails the comparison as non-finite
    if (!c->be->linear_backward_write) return;
    double *gx = zeros(c, (size_t)N * K), *dw2 = rnd(c, (size_t)O * K, 1), *db2 = rnd(c, O, 1);
    for (size_t i = 0; i < (size_t)N * K; i++) gx[i] = NAN;
    float *fgx = up(c, gx, (size_t)N * K), *fdw2 = up(c, dw2, (size_t)O * K), *fdb2 = up(c, db2, O);
    c->ref->linear_backward_write(c->ref, gx, dw2, db2, dout, x, w, N, K, O);
    c->be->linear_backward_write(c->be, fgx, fdw2, fdb2, fdo, fx, fw, N, K, O);
    cmp(c, "dinp (write)", fgx, gx, (size_t)N * K);
    cmp(c, "dw (write)", fdw2, dw2, (size_t)O * K);
    cmp(c, "db (write)", fdb2, db2, O);
}
// 600 rows: the CUDA bias sums split them into chunks (src/cuda/backend_cuda.cu, cu_colsum)
static void case_linear(ctx *c) {
    linear_shape(c, 37, 29, 23);
    linear_shape(c, 600, 40, 70);
}

static void layernorm_shape(ctx *c, int N, int C) {
    double *x = rnd(c, (size_t)N * C, 2), *w = rnd(c, C, 1), *b = rnd(c, C, 1), *dout = rnd(c, (size_t)N * C, 1);
    double *out = zeros(c, (size_t)N * C), *mean = zeros(c, N), *rstd = zeros(c, N), *out2 = zeros(c, (size_t)N * C);
    float *fx = up(c, x, (size_t)N * C), *fw = up(c, w, C), *fb = up(c, b, C), *fdo = up(c, dout, (size_t)N * C);
    float *fo = up(c, out, (size_t)N * C), *fm = up(c, mean, N), *fr = up(c, rstd, N), *fo2 = up(c, out, (size_t)N * C);
    c->ref->layernorm_forward(c->ref, out, mean, rstd, x, w, b, N, C, 1e-5);
    c->be->layernorm_forward(c->be, fo, fm, fr, fx, fw, fb, N, C, 1e-5);
    cmp(c, "out", fo, out, (size_t)N * C);
    cmp(c, "mean", fm, mean, N);
    cmp(c, "rstd", fr, rstd, N);
    c->ref->layernorm_recompute(c->ref, out2, x, w, b, mean, rstd, N, C);
    c->be->layernorm_recompute(c->be, fo2, fx, fw, fb, fm, fr, N, C);
    cmp(c, "recompute", fo2, out2, (size_t)N * C);
    double *dx = rnd(c, (size_t)N * C, 1), *dw = zeros(c, C), *db = zeros(c, C);
    float *fdx = up(c, dx, (size_t)N * C), *fdw = up(c, dw, C), *fdb = up(c, db, C);
    c->ref->layernorm_backward(c->ref, dx, dw, db, dout, x, w, mean, rstd, N, C);
    c->be->layernorm_backward(c->be, fdx, fdw, fdb, fdo, fx, fw, fm, fr, N, C);
    cmp(c, "dinp", fdx, dx, (size_t)N * C);
    cmp(c, "dw", fdw, dw, C);
    cmp(c, "db", fdb, db, C);
}
static void case_layernorm(ctx *c) {
    layernorm_shape(c, 19, 48);
    layernorm_shape(c, 300, 48); // chunked column sums on CUDA
}

static void case_act(ctx *c) {
    const size_t n = 1000;
    for (int kind = VLMOE_ACT_GELU; kind <= VLMOE_ACT_QUICK_GELU; kind++) {
        double *x = rnd(c, n, 4), *dout = rnd(c, n, 1), *out = zeros(c, n), *dx = rnd(c, n, 1);
        float *fx = up(c, x, n), *fdo = up(c, dout, n), *fo = up(c, out, n), *fdx = up(c, dx, n);
        c->ref->act_forward(c->ref, out, x, n, kind);
        c->be->act_forward(c->be, fo, fx, n, kind);
        cmp(c, "out", fo, out, n);
        c->ref->act_backward(c->ref, dx, x, dout, n, kind);
        c->be->act_backward(c->be, fdx, fx, fdo, n, kind);
        cmp(c, "dinp", fdx, dx, n);
    }
}

static void case_softmax(ctx *c) {
    const int N = 13, C = 31;
    double *x = rnd(c, (size_t)N * C, 5), *dout = rnd(c, (size_t)N * C, 1), *out = zeros(c, (size_t)N * C);
    double *dx = rnd(c, (size_t)N * C, 1);
    float *fx = up(c, x, (size_t)N * C), *fo = up(c, out, (size_t)N * C), *fdo = up(c, dout, (size_t)N * C);
    float *fdx = up(c, dx, (size_t)N * C);
    c->ref->softmax_forward(c->ref, out, x, N, C);
    c->be->softmax_forward(c->be, fo, fx, N, C);
    cmp(c, "out", fo, out, (size_t)N * C);
    c->ref->softmax_backward(c->ref, dx, out, dout, N, C);
    c->be->softmax_backward(c->be, fdx, fo, fdo, N, C);
    cmp(c, "dinp", fdx, dx, (size_t)N * C);
}

static void case_attention(ctx *c) {
    const int nseq = 3, T = 7, D = 16, H = 2, n = nseq * T;
    for (int mode = 0; mode < 3; mode++) { // plain, causal, causal after a prefix of 3 (BEiT-3's captioning)
        const int32_t lens[3] = {7, 4, 1};
        const int32_t *dl = upb(c, lens, sizeof(lens));
        const int causal = mode > 0, prefix = mode == 2 ? 3 : 0;
        const attn_segment rs = {.nseq = nseq, .seqlen = T, .causal = causal, .lens = lens, .prefix = prefix},
                           fs = {.nseq = nseq, .seqlen = T, .causal = causal, .lens = dl, .prefix = prefix};
        const size_t na = (size_t)nseq * H * T * T;
        double *qkv = rnd(c, (size_t)n * 3 * D, 1), *out = zeros(c, (size_t)n * D), *att = zeros(c, na);
        double *dout = rnd(c, (size_t)n * D, 1), *dqkv = rnd(c, (size_t)n * 3 * D, 1), *datt = zeros(c, na);
        float *fq = up(c, qkv, (size_t)n * 3 * D), *fo = up(c, out, (size_t)n * D), *fa = up(c, att, na);
        float *fdo = up(c, dout, (size_t)n * D), *fdq = up(c, dqkv, (size_t)n * 3 * D), *fda = up(c, datt, na);
        c->ref->attention_forward(c->ref, out, att, qkv, &rs, D, H);
        c->be->attention_forward(c->be, fo, fa, fq, &fs, D, H);
        cmp(c, "out", fo, out, (size_t)n * D);
        cmp(c, "att", fa, att, na);
        c->ref->attention_backward(c->ref, dqkv, datt, dout, qkv, att, &rs, D, H);
        c->be->attention_backward(c->be, fdq, fda, fdo, fq, fa, &fs, D, H);
        cmp(c, "dqkv", fdq, dqkv, (size_t)n * 3 * D);
    }
}

static void case_patchify(ctx *c) {
    const int B = 2, C = 3, HW = 8, P = 4, np = (HW / P) * (HW / P), pd = C * P * P;
    const size_t ni = (size_t)B * C * HW * HW, npch = (size_t)B * np * pd;
    double *img = rnd(c, ni, 1), *pat = zeros(c, npch), *dpat = rnd(c, npch, 1), *dimg = rnd(c, ni, 1);
    float *fi = up(c, img, ni), *fp = up(c, pat, npch), *fdp = up(c, dpat, npch), *fdi = up(c, dimg, ni);
    c->ref->patchify_forward(c->ref, pat, img, B, C, HW, P);
    c->be->patchify_forward(c->be, fp, fi, B, C, HW, P);
    cmp(c, "patches", fp, pat, npch);
    c->ref->patchify_backward(c->ref, dimg, dpat, B, C, HW, P);
    c->be->patchify_backward(c->be, fdi, fdp, B, C, HW, P);
    cmp(c, "dimages", fdi, dimg, ni);
}

static void case_embed(ctx *c) {
    const int V = 11, D = 8, BT = 15;
    int32_t ids[15];
    for (int i = 0; i < BT; i++) ids[i] = (int32_t)vlmoe_rng_below(&c->r, V);
    ids[3] = ids[9]; // a repeated id accumulates twice
    const int32_t *di = upb(c, ids, sizeof(ids));
    double *wte = rnd(c, (size_t)V * D, 1), *out = zeros(c, (size_t)BT * D), *dout = rnd(c, (size_t)BT * D, 1);
    double *dwte = rnd(c, (size_t)V * D, 1);
    float *fw = up(c, wte, (size_t)V * D), *fo = up(c, out, (size_t)BT * D), *fdo = up(c, dout, (size_t)BT * D);
    float *fdw = up(c, dwte, (size_t)V * D);
    c->ref->embed_forward(c->ref, out, ids, wte, BT, D);
    c->be->embed_forward(c->be, fo, di, fw, BT, D);
    cmp(c, "out", fo, out, (size_t)BT * D);
    c->ref->embed_backward(c->ref, dwte, dout, ids, BT, D);
    c->be->embed_backward(c->be, fdw, fdo, di, BT, D);
    cmp(c, "dwte", fdw, dwte, (size_t)V * D);
}

static void case_posadd(ctx *c) {
    const int B = 3, T = 5, D = 20; // 100 positions: the CPU op's blocks of 64, one whole, one part
    double *out = rnd(c, (size_t)B * T * D, 1), *pos = rnd(c, (size_t)T * D, 1), *dpos = rnd(c, (size_t)T * D, 1);
    double *dout = rnd(c, (size_t)B * T * D, 1);
    float *fo = up(c, out, (size_t)B * T * D), *fp = up(c, pos, (size_t)T * D), *fdp = up(c, dpos, (size_t)T * D);
    float *fdo = up(c, dout, (size_t)B * T * D);
    c->ref->posadd_forward(c->ref, out, pos, B, T, D);
    c->be->posadd_forward(c->be, fo, fp, B, T, D);
    cmp(c, "out", fo, out, (size_t)B * T * D);
    c->ref->posadd_backward(c->ref, dpos, dout, B, T, D);
    c->be->posadd_backward(c->be, fdp, fdo, B, T, D);
    cmp(c, "dpos", fdp, dpos, (size_t)T * D);
}

static void case_cls(ctx *c) {
    const int B = 2, N = 4, D = 8;
    const size_t no = (size_t)B * (N + 1) * D, nx = (size_t)B * N * D;
    double *cls = rnd(c, D, 1), *x = rnd(c, nx, 1), *out = zeros(c, no), *dout = rnd(c, no, 1);
    double *dcls = rnd(c, D, 1), *dx = rnd(c, nx, 1);
    float *fc = up(c, cls, D), *fx = up(c, x, nx), *fo = up(c, out, no), *fdo = up(c, dout, no);
    float *fdc = up(c, dcls, D), *fdx = up(c, dx, nx);
    c->ref->cls_forward(c->ref, out, cls, x, B, N, D);
    c->be->cls_forward(c->be, fo, fc, fx, B, N, D);
    cmp(c, "out", fo, out, no);
    c->ref->cls_backward(c->ref, dcls, dx, dout, B, N, D);
    c->be->cls_backward(c->be, fdc, fdx, fdo, B, N, D);
    cmp(c, "dcls", fdc, dcls, D);
    cmp(c, "dx", fdx, dx, nx);
}

static void case_pool(ctx *c) {
    const int B = 3, T = 6, D = 8;
    const int32_t lens[3] = {6, 2, 4};
    const int32_t *dl = upb(c, lens, sizeof(lens));
    for (int kind = VLMOE_POOL_MEAN; kind <= VLMOE_POOL_EOT; kind++) {
        const size_t nx = (size_t)B * T * D;
        double *x = rnd(c, nx, 1), *out = zeros(c, (size_t)B * D), *dout = rnd(c, (size_t)B * D, 1), *dx = rnd(c, nx, 1);
        float *fx = up(c, x, nx), *fo = up(c, out, (size_t)B * D), *fdo = up(c, dout, (size_t)B * D), *fdx = up(c, dx, nx);
        c->ref->pool_forward(c->ref, out, x, lens, B, T, D, kind);
        c->be->pool_forward(c->be, fo, fx, dl, B, T, D, kind);
        cmp(c, "out", fo, out, (size_t)B * D);
        c->ref->pool_backward(c->ref, dx, dout, lens, B, T, D, kind);
        c->be->pool_backward(c->be, fdx, fdo, dl, B, T, D, kind);
        cmp(c, "dx", fdx, dx, nx);
    }
}

static void case_l2norm(ctx *c) {
    const int N = 9, C = 16;
    const size_t n = (size_t)N * C;
    double *x = rnd(c, n, 1), *out = zeros(c, n), *norm = zeros(c, N), *dout = rnd(c, n, 1), *dx = rnd(c, n, 1);
    float *fx = up(c, x, n), *fo = up(c, out, n), *fn = up(c, norm, N), *fdo = up(c, dout, n), *fdx = up(c, dx, n);
    c->ref->l2norm_forward(c->ref, out, norm, x, N, C);
    c->be->l2norm_forward(c->be, fo, fn, fx, N, C);
    cmp(c, "out", fo, out, n);
    cmp(c, "norm", fn, norm, N);
    c->ref->l2norm_backward(c->ref, dx, dout, out, norm, N, C);
    c->be->l2norm_backward(c->be, fdx, fdo, fo, fn, N, C);
    cmp(c, "dx", fdx, dx, n);
}

static void case_contrastive(ctx *c) {
    const int B = 7, E = 12;
    const size_t n = (size_t)B * E, bb = (size_t)B * B;
    double *img = rnd(c, n, 0.3), *txt = rnd(c, n, 0.3), *lg = zeros(c, bb), *pr = zeros(c, bb), *pc = zeros(c, bb);
    double *di = rnd(c, n, 1), *dt = rnd(c, n, 1), ds = 0.25, acc[2], facc[2];
    float *fi = up(c, img, n), *ft = up(c, txt, n), *fl = up(c, lg, bb), *fpr = up(c, pr, bb), *fpc = up(c, pc, bb);
    float *fdi = up(c, di, n), *fdt = up(c, dt, n);
    const double sd = 2.3;
    double dsd[1] = {ds};
    float *fds = up(c, dsd, 1);
    const double l = c->ref->contrastive_forward(c->ref, lg, pr, pc, img, txt, sd, B, E, acc);
    const double fl2 = c->be->contrastive_forward(c->be, fl, fpr, fpc, fi, ft, (float)sd, B, E, facc);
    cmp_scalar(c, "loss", fl2, l);
    cmp(c, "logits", fl, lg, bb);
    c->ref->contrastive_backward(c->ref, di, dt, dsd, lg, pr, pc, img, txt, sd, B, E, 0.5);
    c->be->contrastive_backward(c->be, fdi, fdt, fds, fl, fpr, fpc, fi, ft, (float)sd, B, E, 0.5);
    cmp(c, "dimg", fdi, di, n);
    cmp(c, "dtxt", fdt, dt, n);
    cmp(c, "dscale", fds, dsd, 1);
}

static void case_xent(ctx *c) {
    const int n = 9, C = 13;
    int32_t labels[9];
    for (int i = 0; i < n; i++) labels[i] = (int32_t)vlmoe_rng_below(&c->r, C);
    const int32_t *dl = upb(c, labels, sizeof(labels));
    double *lg = rnd(c, (size_t)n * C, 3), *pr = zeros(c, (size_t)n * C), *dlg = rnd(c, (size_t)n * C, 1);
    float *flg = up(c, lg, (size_t)n * C), *fpr = up(c, pr, (size_t)n * C), *fdlg = up(c, dlg, (size_t)n * C);
    int right = 0, fright = 0;
    const double l = c->ref->xent_forward(c->ref, pr, lg, labels, n, C, &right);
    const double fl = c->be->xent_forward(c->be, fpr, flg, dl, n, C, &fright);
    cmp_scalar(c, "loss", fl, l);
    cmp(c, "probs", fpr, pr, (size_t)n * C);
    if (right != fright) c->op_fail = 1, fprintf(stderr, "    correct: %d vs %d\n", fright, right);
    c->ref->xent_backward(c->ref, dlg, pr, labels, n, C, 0.7);
    c->be->xent_backward(c->be, fdlg, fpr, dl, n, C, 0.7);
    cmp(c, "dlogits", fdlg, dlg, (size_t)n * C);
}

// A dispatch of n tokens to E experts with K = 2 distinct experts per token, some dropped; fixed:
// the fixed-capacity layout, every expert's 6 slots a row, the empty ones padding (token -1).
typedef struct {
    int n, rows, E;
    int32_t row_token[64], row_expert[64], tok_off[33], tok_rows[64], off[9];
} disp;
static void make_dispatch(ctx *c, disp *d, int fixed) {
    d->n = 32, d->E = 8, d->rows = 0;
    int cnt[8] = {0};
    int32_t pick[32][2];
    for (int t = 0; t < d->n; t++) {
        pick[t][0] = (int32_t)vlmoe_rng_below(&c->r, 8);
        pick[t][1] = (pick[t][0] + 1 + (int32_t)vlmoe_rng_below(&c->r, 7)) % 8;
    }
    for (int e = 0; e < 8; e++) {
        d->off[e] = d->rows;
        for (int t = 0; t < d->n; t++)
            for (int k = 0; k < 2; k++)
                if (pick[t][k] == e && cnt[e] < 6 && !(t % 11 == 3 && k == 1)) d->row_token[d->rows] = t, d->row_expert[d->rows++] = e, cnt[e]++;
        for (; fixed && cnt[e] < 6; cnt[e]++) d->row_token[d->rows] = -1, d->row_expert[d->rows++] = e;
    }
    d->off[8] = d->rows;
    memset(d->tok_off, 0, sizeof(d->tok_off));
    for (int r = 0; r < d->rows; r++)
        if (d->row_token[r] >= 0) d->tok_off[d->row_token[r] + 1]++;
    for (int t = 0; t < d->n; t++) d->tok_off[t + 1] += d->tok_off[t];
    int fill[33];
    memcpy(fill, d->tok_off, sizeof(fill));
    for (int r = 0; r < d->rows; r++)
        if (d->row_token[r] >= 0) d->tok_rows[fill[d->row_token[r]]++] = r;
}

// n floats of the tested backend, downloaded
static float *down(ctx *c, const float *dev, size_t n) {
    float *h = keep_host(c, malloc(sizeof(float) * (n + 1)));
    c->be->sync(c->be);
    c->be->download(c->be, h, dev, n);
    return h;
}

// The padding rows of a fixed layout hold exact zeros in what the backend wrote: the gathered
// inputs (over a buffer that held other values), the combine weights and the backward's dy, dw.
static void pad_zeros(ctx *c, const disp *h, const char *what, const float *dev, int width) {
    const float *v = down(c, dev, (size_t)h->rows * width);
    int bad = 0, pads = 0;
    for (int r = 0; r < h->rows; r++)
        for (int k = 0; h->row_token[r] < 0 && k < width; k++) bad += v[(size_t)r * width + k] != 0, pads += !k;
    if (bad || !pads) {
        c->op_fail = 1;
        fprintf(stderr, "    %s: %d non-zero values in %d padding rows\n", what, bad, pads);
    }
}

static void dispatch_shape(ctx *c, int fixed) {
    disp h;
    make_dispatch(c, &h, fixed);
    const int D = 12, n = h.n, R = h.rows, E = h.E;
    const be_dispatch rd = {n, R, E, h.row_token, h.row_expert, h.tok_off, h.tok_rows};
    const be_dispatch fd = {n, R, E, upb(c, h.row_token, sizeof(h.row_token)), upb(c, h.row_expert, sizeof(h.row_expert)),
                            upb(c, h.tok_off, sizeof(h.tok_off)), upb(c, h.tok_rows, sizeof(h.tok_rows))};
    double *x = rnd(c, (size_t)n * D, 1), *xp = rnd(c, (size_t)R * D, 1);
    float *fx = up(c, x, (size_t)n * D), *fxp = up(c, xp, (size_t)R * D);
    c->ref->gather_rows(c->ref, xp, x, h.row_token, R, D);
    c->be->gather_rows(c->be, fxp, fx, fd.row_token, R, D);
    cmp(c, "gather_rows", fxp, xp, (size_t)R * D);
    if (fixed) pad_zeros(c, &h, "gather_rows", fxp, D);
    // combine weights from gates, plain and renormalised, and their backward
    double *gates = rnd(c, (size_t)n * E, 1);
    for (size_t i = 0; i < (size_t)n * E; i++) gates[i] = fabs(gates[i]) + 0.01;
    float *fg = up(c, gates, (size_t)n * E);
    for (int renorm = 0; renorm < 2; renorm++) {
        double *w = rnd(c, R, 1), *z = zeros(c, n), *dw = rnd(c, R, 1), *dg = rnd(c, (size_t)n * E, 1);
        float *fw = up(c, w, R), *fz = up(c, z, n), *fdw = up(c, dw, R), *fdg = up(c, dg, (size_t)n * E);
        c->ref->combine_weights(c->ref, w, z, gates, &rd, renorm);
        c->be->combine_weights(c->be, fw, fz, fg, &fd, renorm);
        cmp(c, "combine_weights", fw, w, R);
        if (fixed) pad_zeros(c, &h, "combine_weights", fw, 1);
        c->ref->combine_weights_backward(c->ref, dg, dw, gates, z, &rd, renorm);
        c->be->combine_weights_backward(c->be, fdg, fdw, fg, fz, &fd, renorm);
        cmp(c, "combine_weights_backward", fdg, dg, (size_t)n * E);
    }
    // combine and its backward, the backward of the gather
    double *y = rnd(c, (size_t)R * D, 1), *w = rnd(c, R, 1), *out = rnd(c, (size_t)n * D, 1), *dout = rnd(c, (size_t)n * D, 1);
    double *dy = rnd(c, (size_t)R * D, 1), *dw = rnd(c, R, 1), *dx = rnd(c, (size_t)n * D, 1);
    float *fy = up(c, y, (size_t)R * D), *fw = up(c, w, R), *fo = up(c, out, (size_t)n * D), *fdo = up(c, dout, (size_t)n * D);
    float *fdy = up(c, dy, (size_t)R * D), *fdw = up(c, dw, R), *fdx = up(c, dx, (size_t)n * D);
    c->ref->combine_forward(c->ref, out, y, w, &rd, D);
    c->be->combine_forward(c->be, fo, fy, fw, &fd, D);
    cmp(c, "combine", fo, out, (size_t)n * D);
    c->ref->combine_backward(c->ref, dy, dw, dout, y, w, &rd, D);
    c->be->combine_backward(c->be, fdy, fdw, fdo, fy, fw, &fd, D);
    cmp(c, "combine_backward dy", fdy, dy, (size_t)R * D);
    cmp(c, "combine_backward dw", fdw, dw, R);
    if (fixed) pad_zeros(c, &h, "combine_backward dy", fdy, D), pad_zeros(c, &h, "combine_backward dw", fdw, 1);
    c->ref->gather_rows_backward(c->ref, dx, y, &rd, D);
    c->be->gather_rows_backward(c->be, fdx, fy, &fd, D);
    cmp(c, "gather_rows_backward", fdx, dx, (size_t)n * D);
}
static void case_dispatch(ctx *c) { dispatch_shape(c, 0); }
// the fixed-capacity layout's padding rows (be_route.fixed)
static void case_dispatch_pad(ctx *c) { dispatch_shape(c, 1); }

static void case_noise(ctx *c) {
    const int n = 40, E = 6;
    uint64_t keys[40];
    for (int t = 0; t < n; t++) keys[t] = ((uint64_t)(t / 8) << 21) | (uint64_t)(t % 8);
    double *lg = rnd(c, (size_t)n * E, 2), *noisy = zeros(c, (size_t)n * E);
    float *flg = up(c, lg, (size_t)n * E), *fno = up(c, noisy, (size_t)n * E);
    const be_noise rn = {1234, 1.0 / E, keys}, fn = {1234, 1.0 / E, upb(c, keys, sizeof(keys))};
    c->ref->router_noise(c->ref, noisy, lg, n, E, &rn);
    c->be->router_noise(c->be, fno, flg, n, E, &fn);
    cmp(c, "noisy", fno, noisy, (size_t)n * E);
    // the noise of a token depends on its key alone: the same keys in reverse order give the
    // same rows reversed
    uint64_t rev[40];
    for (int t = 0; t < n; t++) rev[t] = keys[n - 1 - t];
    double *zero = zeros(c, (size_t)n * E), *a = zeros(c, (size_t)n * E), *b = zeros(c, (size_t)n * E);
    const be_noise ra = {1234, 1.0, keys}, rb = {1234, 1.0, rev};
    c->ref->router_noise(c->ref, a, zero, n, E, &ra);
    c->ref->router_noise(c->ref, b, zero, n, E, &rb);
    for (int t = 0; t < n; t++)
        for (int e = 0; e < E; e++)
            if (a[(size_t)t * E + e] != b[(size_t)(n - 1 - t) * E + e]) c->op_fail = 1;
}

static void case_aux(ctx *c) {
    const int S = 16, E = 4, K = 2;
    uint8_t mod[16];
    int32_t wanted[4] = {9, 7, 8, 8};
    for (int i = 0; i < S; i++) mod[i] = (uint8_t)(i % 3 == 0);
    const uint8_t *fmod = upb(c, mod, sizeof(mod));
    const int32_t *fwant = upb(c, wanted, sizeof(wanted));
    int32_t wanted_mod[8] = {6, 4, 5, 5, 3, 3, 3, 3}; // image row (11 tokens), text row (5 tokens)
    const int32_t *fwm = upb(c, wanted_mod, sizeof(wanted_mod));
    double *lg = rnd(c, (size_t)S * E, 2), *nz = rnd(c, (size_t)S * E, 2);
    float *flg = up(c, lg, (size_t)S * E), *fnz = up(c, nz, (size_t)S * E);
    double *scr = zeros(c, aux_scratch_floats(S, E));
    float *fscr = up(c, scr, aux_scratch_floats(S, E));
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
        // tau 1.5 < log 4: the global losses are active where the entropy is below it
        const aux_input_f64 ri = {S, E, K, lg, nz, 1.0, mod, wanted, {1.5, 1.2}, wanted_mod, 0};
        const aux_input_f32 fi = {S, E, K, flg, fnz, 1.0, fmod, fwant, {1.5, 1.2}, fwm, 0};
        double *dl = rnd(c, (size_t)S * E, 1);
        float *fdl = up(c, dl, (size_t)S * E);
        const double l = c->ref->aux_loss(c->ref, (vlmoe_aux_kind)k, &ri, 1.0, NULL, scr);
        const double fl = c->be->aux_loss(c->be, (vlmoe_aux_kind)k, &fi, 1.0, NULL, fscr);
        cmp_scalar(c, vlmoe_aux_name((vlmoe_aux_kind)k), fl, l);
        c->ref->aux_loss(c->ref, (vlmoe_aux_kind)k, &ri, 0.5, dl, scr);
        c->be->aux_loss(c->be, (vlmoe_aux_kind)k, &fi, 0.5, fdl, fscr);
        cmp(c, vlmoe_aux_name((vlmoe_aux_kind)k), fdl, dl, (size_t)S * E);
    }
}

// The values a device step leaves in the table's memory (issue 16): aux_loss_dev gives the bits
// aux_loss returns on the same table; contrastive_forward_dsc / _backward_dsc (the scale read
// from the table's memory) the reference's values, bit for bit the by-value entries' on a host
// table (CUDA's exp of the scale is the device's: within the tolerance), and out[3] the scale.
static void case_step_scalars(ctx *c) {
    const int S = 12, E = 4, K = 2;
    uint8_t mod[12];
    int32_t wanted[4] = {7, 5, 6, 6}, wanted_mod[8] = {5, 3, 4, 4, 2, 2, 2, 2};
    for (int i = 0; i < S; i++) mod[i] = (uint8_t)(i % 3 == 0);
    double *lg = rnd(c, (size_t)S * E, 2), *nz = rnd(c, (size_t)S * E, 2);
    const aux_input_f32 fi = {S, E, K, up(c, lg, (size_t)S * E), up(c, nz, (size_t)S * E), 1.0,
                              upb(c, mod, sizeof(mod)), upb(c, wanted, sizeof(wanted)), {1.5, 1.2},
                              upb(c, wanted_mod, sizeof(wanted_mod)), 0};
    const aux_input_f64 ri = {S, E, K, lg, nz, 1.0, mod, wanted, {1.5, 1.2}, wanted_mod, 0};
    double *scr = zeros(c, aux_scratch_floats(S, E));
    float *fscr = up(c, scr, aux_scratch_floats(S, E));
    double vals[VLMOE_AUX_COUNT], got[VLMOE_AUX_COUNT] = {0};
    double *dout = upb(c, got, sizeof(got));
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
        vals[k] = c->be->aux_loss(c->be, (vlmoe_aux_kind)k, &fi, 1.0, NULL, fscr);
        c->be->aux_loss_dev(c->be, (vlmoe_aux_kind)k, &fi, fscr, dout + k);
        cmp_scalar(c, vlmoe_aux_name((vlmoe_aux_kind)k), vals[k],
                   c->ref->aux_loss(c->ref, (vlmoe_aux_kind)k, &ri, 1.0, NULL, scr));
    }
    c->be->sync(c->be);
    c->be->download(c->be, (float *)got, (const float *)dout, 2 * VLMOE_AUX_COUNT);
    for (int k = 0; k < VLMOE_AUX_COUNT; k++)
        if (memcmp(&got[k], &vals[k], sizeof(double)))
            c->op_fail = 1, fprintf(stderr, "    aux_loss_dev %s: %.17g, aux_loss %.17g\n",
                                    vlmoe_aux_name((vlmoe_aux_kind)k), got[k], vals[k]);
    // the contrastive loss with the scale in the table's memory
    const int B = 7, D = 12;
    const size_t n = (size_t)B * D, bb = (size_t)B * B;
    double *img = rnd(c, n, 0.3), *txt = rnd(c, n, 0.3), *rl = zeros(c, bb), *rp = zeros(c, bb), *rc = zeros(c, bb);
    double *di = rnd(c, n, 1), *dt = rnd(c, n, 1), ds[1] = {0.25}, acc[2], sc[1] = {2.3};
    const float fsc = (float)sc[0];
    sc[0] = fsc; // the reference at the float's value
    float *fimg = up(c, img, n), *ftxt = up(c, txt, n), *fl = up(c, rl, bb), *fp = up(c, rp, bb), *fc = up(c, rc, bb);
    float *fdi = up(c, di, n), *fdt = up(c, dt, n), *fds = up(c, ds, 1), *dsc = up(c, sc, 1);
    const double none[4] = {0};
    double *o = upb(c, none, sizeof(none)), *o2 = upb(c, none, sizeof(none));
    const double l = c->ref->contrastive_forward(c->ref, rl, rp, rc, img, txt, sc[0], B, D, acc);
    c->be->contrastive_forward_dsc(c->be, fl, fp, fc, fimg, ftxt, dsc, B, D, o);
    double h[4], h2[4];
    c->be->sync(c->be);
    c->be->download(c->be, (float *)h, (const float *)o, 8);
    cmp_scalar(c, "loss (dsc)", h[0], l);
    cmp_scalar(c, "acc i2t (dsc)", h[1], acc[0]);
    cmp_scalar(c, "acc t2i (dsc)", h[2], acc[1]);
    if (h[3] != fsc) c->op_fail = 1, fprintf(stderr, "    contrastive_forward_dsc: scale %.9g, expected %.9g\n", h[3], fsc);
    cmp(c, "logits (dsc)", fl, rl, bb);
    c->ref->contrastive_backward(c->ref, di, dt, ds, rl, rp, rc, img, txt, sc[0], B, D, 0.5);
    c->be->contrastive_backward_dsc(c->be, fdi, fdt, fds, fl, fp, fc, fimg, ftxt, dsc, B, D, 0.5);
    cmp(c, "dimg (dsc)", fdi, di, n);
    cmp(c, "dtxt (dsc)", fdt, dt, n);
    cmp(c, "dscale (dsc)", fds, ds, 1);
    if (c->be->host_memory) { // the by-value entry's bits
        c->be->contrastive_forward_dev(c->be, fl, fp, fc, fimg, ftxt, fsc, B, D, o2);
        c->be->download(c->be, (float *)h2, (const float *)o2, 6);
        if (memcmp(h, h2, sizeof(double) * 3)) c->op_fail = 1, fprintf(stderr, "    dsc differs from the by-value entry\n");
    }
}

static void case_soft(ctx *c) {
    const soft_dims d = {10, 8, 3, 2, 12, VLMOE_ACT_GELU, 0, 0};
    const int S = d.S, D = d.D, E = d.E, P = d.P, M = d.M;
    const size_t nphi = (size_t)D * E * P, nw1 = (size_t)E * M * D, nw2 = (size_t)E * D * M;
    double *phi = rnd(c, nphi, 1), *sc = rnd(c, 1, 1), *w1 = rnd(c, nw1, 0.5), *b1 = rnd(c, (size_t)E * M, 0.5);
    double *w2 = rnd(c, nw2, 0.5), *b2 = rnd(c, (size_t)E * D, 0.5), *x = rnd(c, (size_t)S * D, 1);
    double *out = zeros(c, (size_t)S * D), *acts = zeros(c, soft_moe_acts_floats(&d)), *dout = rnd(c, (size_t)S * D, 1);
    sc[0] = 1.3;
    float *fphi = up(c, phi, nphi), *fsc = up(c, sc, 1), *fw1 = up(c, w1, nw1), *fb1 = up(c, b1, (size_t)E * M);
    float *fw2 = up(c, w2, nw2), *fb2 = up(c, b2, (size_t)E * D), *fx = up(c, x, (size_t)S * D);
    float *fo = up(c, out, (size_t)S * D), *fa = up(c, acts, soft_moe_acts_floats(&d)), *fdo = up(c, dout, (size_t)S * D);
    const soft_params_f64 rp = {phi, sc, w1, b1, w2, b2};
    const soft_params_f32 fp = {fphi, fsc, fw1, fb1, fw2, fb2};
    c->ref->soft_moe_forward(c->ref, out, acts, x, &rp, &d);
    c->be->soft_moe_forward(c->be, fo, fa, fx, &fp, &d);
    cmp(c, "out", fo, out, (size_t)S * D);
    double *g[7];
    float *fg[7];
    const size_t ng[7] = {nphi, 1, nw1, (size_t)E * M, nw2, (size_t)E * D, (size_t)S * D};
    for (int i = 0; i < 7; i++) g[i] = rnd(c, ng[i], 1), fg[i] = up(c, g[i], ng[i]);
    double *scr = zeros(c, soft_moe_scratch_floats(&d));
    float *fscr = up(c, scr, soft_moe_scratch_floats(&d));
    const soft_grads_f64 rg = {g[0], g[1], g[2], g[3], g[4], g[5]};
    const soft_grads_f32 fgr = {fg[0], fg[1], fg[2], fg[3], fg[4], fg[5]};
    c->ref->soft_moe_backward(c->ref, g[6], &rg, dout, acts, x, &rp, &d, scr);
    c->be->soft_moe_backward(c->be, fg[6], &fgr, fdo, fa, fx, &fp, &d, fscr);
    const char *names[7] = {"dphi", "dscale", "dw1", "db1", "dw2", "db2", "dx"};
    for (int i = 0; i < 7; i++) cmp(c, names[i], fg[i], g[i], ng[i]);
}

static void experts_shape(ctx *c, const int32_t off[4]) {
    const int E = 3, D = 8, M = 20;
    const int R = off[E];
    const be_experts ex = {E, D, M, VLMOE_ACT_QUICK_GELU, off};
    const size_t n1 = (size_t)E * M * D;
    double *w[4] = {rnd(c, n1, 0.4), rnd(c, (size_t)E * M, 0.4), rnd(c, n1, 0.4), rnd(c, (size_t)E * D, 0.4)};
    const size_t nw[4] = {n1, (size_t)E * M, n1, (size_t)E * D};
    float *fw[4];
    for (int i = 0; i < 4; i++) fw[i] = up(c, w[i], nw[i]);
    double *x = rnd(c, (size_t)R * D, 1), *y = rnd(c, (size_t)R * D, 1), *h = zeros(c, (size_t)R * M), *a = zeros(c, (size_t)R * M);
    float *fx = up(c, x, (size_t)R * D), *fy = up(c, y, (size_t)R * D), *fh = up(c, h, (size_t)R * M), *fa = up(c, a, (size_t)R * M);
    const double *const rw[4] = {w[0], w[1], w[2], w[3]};
    const float *const cfw[4] = {fw[0], fw[1], fw[2], fw[3]};
    c->ref->experts_forward(c->ref, y, h, a, x, rw, &ex, 1);
    c->be->experts_forward(c->be, fy, fh, fa, fx, cfw, &ex, 1);
    cmp(c, "y", fy, y, (size_t)R * D);
    cmp(c, "h", fh, h, (size_t)R * M);
    double *dy = rnd(c, (size_t)R * D, 1), *dx = rnd(c, (size_t)R * D, 1), *dw[4];
    float *fdy = up(c, dy, (size_t)R * D), *fdx = up(c, dx, (size_t)R * D), *fdw[4];
    for (int i = 0; i < 4; i++) dw[i] = rnd(c, nw[i], 1), fdw[i] = up(c, dw[i], nw[i]);
    double *da = zeros(c, (size_t)R * M), *dh = zeros(c, (size_t)R * M);
    float *fda = up(c, da, (size_t)R * M), *fdh = up(c, dh, (size_t)R * M);
    double *const rdw[4] = {dw[0], dw[1], dw[2], dw[3]};
    float *const cfdw[4] = {fdw[0], fdw[1], fdw[2], fdw[3]};
    c->ref->experts_backward(c->ref, dx, rdw, dy, x, h, rw, da, dh, &ex);
    c->be->experts_backward(c->be, fdx, cfdw, fdy, fx, fh, cfw, fda, fdh, &ex);
    cmp(c, "dx", fdx, dx, (size_t)R * D);
    const char *names[4] = {"dw1", "db1", "dw2", "db2"};
    for (int i = 0; i < 4; i++) cmp(c, names[i], fdw[i], dw[i], nw[i]);
    // the write mode: dx's rows hold NaN first on both sides, so an accumulate left in fails
    if (!c->be->experts_backward_write) return;
    double *gx = zeros(c, (size_t)R * D);
    for (size_t i = 0; i < (size_t)R * D; i++) gx[i] = i < (size_t)off[0] * D ? 0 : NAN;
    float *fgx = up(c, gx, (size_t)R * D);
    c->ref->experts_backward_write(c->ref, gx, rdw, dy, x, h, rw, da, dh, &ex);
    c->be->experts_backward_write(c->be, fgx, cfdw, fdy, fx, fh, cfw, fda, fdh, &ex);
    cmp(c, "dx (write)", fgx, gx, (size_t)R * D);
    for (int i = 0; i < 4; i++) cmp(c, names[i], fdw[i], dw[i], nw[i]);
}

static void case_experts(ctx *c) {
    const int32_t off[4] = {0, 5, 5, 12}; // expert 1 holds no rows
    experts_shape(c, off);
}
// every expert 7 rows, the first at row 2: CUDA's strided-batched path (the fixed layout)
static void case_experts_same(ctx *c) {
    const int32_t off[4] = {2, 9, 16, 23};
    experts_shape(c, off);
}

static void case_trainer(ctx *c) {
    const size_t n = 100000; // above the parallel threshold
    double *g = rnd(c, n, 1), *p = rnd(c, n, 1), *m = rnd(c, n, 0.1), *v = rnd(c, n, 0.1);
    for (size_t i = 0; i < n; i++) v[i] = fabs(v[i]);
    float *fg = up(c, g, n), *fp = up(c, p, n), *fm = up(c, m, n), *fv = up(c, v, n);
    int bad = 0, fbad = 0;
    cmp_scalar(c, "sumsq", c->be->sumsq(c->be, fg, n, &fbad), c->ref->sumsq(c->ref, g, n, &bad));
    if (bad || fbad) c->op_fail = 1;
    c->ref->scale(c->ref, g, n, 0.75f);
    c->be->scale(c->be, fg, n, 0.75f);
    cmp(c, "scale", fg, g, n);
    const be_adamw a = {.b1 = 0.9f, .b2 = 0.95f, .ab1 = 0.1f, .ab2 = 0.05f, .neg_step = -1e-3f / 0.19f,
                        .bc2_sqrt = sqrtf(1 - 0.95f * 0.95f), .eps = 1e-8f, .shrink = 1 - 1e-4f, .decay = 1,
                        .gscale = 1};
    c->ref->adamw(c->ref, p, m, v, g, n, &a);
    c->be->adamw(c->be, fp, fm, fv, fg, n, &a);
    cmp(c, "adamw p", fp, p, n);
    cmp(c, "adamw m", fm, m, n);
    cmp(c, "adamw v", fv, v, n);
    // clipping's factor read with the gradient (the trainer folds its scale pass into the update)
    be_adamw as = a;
    as.gscale = 0.6f;
    c->ref->adamw(c->ref, p, m, v, g, n, &as);
    c->be->adamw(c->be, fp, fm, fv, fg, n, &as);
    cmp(c, "adamw gscale p", fp, p, n);
    cmp(c, "adamw gscale m", fm, m, n);
    c->ref->clamp(c->ref, p, n, -0.5, 0.5);
    c->be->clamp(c->be, fp, n, -0.5, 0.5);
    cmp(c, "clamp", fp, p, n);
    // a NaN anywhere is reported
    double *q = rnd(c, 10, 1);
    q[7] = NAN;
    float *fq = up(c, q, 10);
    c->be->sumsq(c->be, fq, 10, &fbad);
    if (!fbad) c->op_fail = 1, fprintf(stderr, "    sumsq: a NaN went unreported\n");
}

// ---- routing: the tested table's decision and layout against the CPU table's (route.c), exactly

typedef struct {
    int G, S, E, K, C, ec, order, score, renorm, perm, pools;
    uint64_t pruned;
    int negzero, flat; // gates of -0.0 beside +0.0; every gate equal
    int sparse;        // gates 0.125 or (+/-)0: many tokens whose BPR key or column gate is +/-0
} route_shape;

// what be_route writes, n/G/E/C-sized, in one kind of memory: the tested table's (dev) or the host's
typedef struct {
    int32_t *expert, *slot, *token, *count, *wanted, *row_token, *row_expert, *tok_rows, *tok_off, *expert_off;
    float *weight;
    uint8_t *dropped;
} route_arrays;

static void *route_buf(ctx *c, size_t bytes, int dev) {
    void *h = keep_host(c, calloc(bytes + 8, 1));
    return dev ? upb(c, h, bytes) : h;
}
static be_route_out route_outs(ctx *c, const be_route *r, int rows_max, int dev, route_arrays *a) {
    const size_t nk = (size_t)r->n * r->K, gec = (size_t)r->G * r->E * r->C, ge = (size_t)r->G * r->E;
    a->expert = route_buf(c, 4 * nk, dev), a->slot = route_buf(c, 4 * nk, dev);
    a->token = route_buf(c, 4 * gec, dev), a->weight = route_buf(c, 4 * gec, dev);
    a->count = route_buf(c, 4 * ge, dev), a->wanted = route_buf(c, 12 * ge, dev);
    a->dropped = route_buf(c, (size_t)r->n, dev);
    a->row_token = route_buf(c, 4 * (size_t)rows_max, dev), a->row_expert = route_buf(c, 4 * (size_t)rows_max, dev);
    a->tok_rows = route_buf(c, 4 * (size_t)rows_max, dev), a->tok_off = route_buf(c, 4 * ((size_t)r->n + 1), dev);
    a->expert_off = route_buf(c, 4 * ((size_t)r->E + 1), dev);
    return (be_route_out){.expert = a->expert, .slot = a->slot, .token = a->token, .weight = a->weight,
                          .count = a->count, .wanted = a->wanted, .dropped = a->dropped, .row_token = a->row_token,
                          .row_expert = a->row_expert, .tok_rows = a->tok_rows, .tok_off = a->tok_off,
                          .expert_off = a->expert_off, .rows_max = rows_max,
                          .work = route_buf(c, be_route_work_bytes(r->S, r->E), dev)};
}

// one array of the tested table's output against the reference, byte for byte
static void route_cmp(ctx *c, int shape, const char *what, const void *dev, const void *ref, size_t bytes) {
    unsigned char *h = malloc(bytes + 1);
    c->be->download_bytes(c->be, h, dev, bytes);
    if (memcmp(h, ref, bytes)) {
        size_t i = 0;
        while (i < bytes && h[i] == ((const unsigned char *)ref)[i]) i++;
        c->op_fail = 1;
        fprintf(stderr, "    route shape %d: %s differs from the CPU's at byte %zu of %zu\n", shape, what, i, bytes);
    }
    free(h);
}

// Shapes with deliberate ties (coarse gates: equal gates within a token and equal BPR keys across
// tokens), K = 1 and 2, overflow, BPR on and off, max and summed scores, renormalisation,
// experts choice (C below and above S), several groups in a permuted order, disjoint pools,
// pruned experts, -0.0 beside +0.0, every gate equal.
static void case_route(ctx *c) {
    static const route_shape shapes[] = {
        {.G = 1, .S = 64, .E = 8, .K = 1, .C = 4, .order = VLMOE_ORDER_BPR},
        {.G = 3, .S = 40, .E = 8, .K = 2, .C = 6, .order = VLMOE_ORDER_BPR, .score = VLMOE_BPR_SUM, .renorm = 1, .perm = 1},
        {.G = 4, .S = 32, .E = 8, .K = 2, .C = 16, .order = VLMOE_ORDER_FIFO},
        {.G = 2, .S = 50, .E = 6, .K = 2, .C = 5, .order = VLMOE_ORDER_BPR, .perm = 1, .pools = 1},
        {.G = 3, .S = 24, .E = 8, .K = 1, .C = 4, .ec = 1, .perm = 1},
        {.G = 1, .S = 10, .E = 4, .K = 1, .C = 16, .ec = 1},
        {.G = 2, .S = 33, .E = 16, .K = 2, .C = 3, .order = VLMOE_ORDER_BPR, .pruned = 0x8001, .negzero = 1},
        {.G = 8, .S = 16, .E = 4, .K = 1, .C = 2, .order = VLMOE_ORDER_BPR, .score = VLMOE_BPR_SUM, .flat = 1},
        {.G = 2, .S = 300, .E = 32, .K = 2, .C = 20, .order = VLMOE_ORDER_BPR, .renorm = 1, .perm = 1},
        // -0.0 and +0.0 keys compare equal in route.c: ties in token order (checked to fail on a
        // host emulation of route_cuda.cu's kernels when -0.0 is not keyed as +0.0)
        {.G = 2, .S = 40, .E = 4, .K = 1, .C = 12, .order = VLMOE_ORDER_BPR, .negzero = 1, .sparse = 1},
        {.G = 2, .S = 40, .E = 4, .K = 2, .C = 5, .order = VLMOE_ORDER_BPR, .score = VLMOE_BPR_SUM, .perm = 1,
         .negzero = 1, .sparse = 1},
        {.G = 2, .S = 40, .E = 4, .K = 1, .C = 30, .ec = 1, .perm = 1, .negzero = 1, .sparse = 1},
    };
    const vlmoe_backend_f32 *cpu = backend_cpu_f32();
    for (int sh = 0; sh < (int)(sizeof(shapes) / sizeof(shapes[0])); sh++) {
        const route_shape *x = &shapes[sh];
        const int n = x->G * x->S, E = x->E;
        float *gates = keep_host(c, calloc((size_t)n * E + 1, sizeof(float)));
        int32_t *perm = keep_host(c, calloc((size_t)n + 1, sizeof(int32_t)));
        uint8_t *mod = keep_host(c, calloc((size_t)n + 1, 1));
        for (size_t i = 0; i < (size_t)n * E; i++) {
            gates[i] = x->flat     ? 0.25f
                       : x->sparse ? (vlmoe_rng_below(&c->r, 4) == 0 ? 0.125f : 0.0f)
                                   : (float)vlmoe_rng_below(&c->r, 4) / 8;
            if (x->negzero && gates[i] == 0 && vlmoe_rng_below(&c->r, 2)) gates[i] = -0.0f;
        }
        for (int i = 0; i < n; i++) perm[i] = i, mod[i] = (uint8_t)(i % x->S >= x->S / 2);
        for (int i = n - 1; x->perm && i > 0; i--) {
            const int k = (int)vlmoe_rng_below(&c->r, (uint32_t)i + 1), t = perm[i];
            perm[i] = perm[k], perm[k] = t;
        }
        be_route r = {.n = n, .S = x->S, .G = x->G, .E = E, .K = x->K, .C = x->C, .experts_choice = x->ec,
                      .order = x->order, .bpr_score = x->score, .gate_renorm = x->renorm, .pruned = x->pruned,
                      .pools = x->pools, .pool = {{0, E - 2}, {E - 2, 2}}, .pos_row = x->perm ? perm : NULL, .mod = mod};
        const long cap = (long)x->G * E * x->C, rows_max = x->ec || (long)n * x->K > cap ? cap : (long)n * x->K;
        route_arrays ra, da;
        const be_route_out ro = route_outs(c, &r, (int)rows_max, 0, &ra);
        const be_route_out dout = route_outs(c, &r, (int)rows_max, 1, &da);
        int st = cpu->route(cpu, gates, &r, &ro);
        if (st) {
            c->op_fail = 1;
            fprintf(stderr, "    route shape %d: the CPU table failed: %s\n", sh, vlmoe_last_error());
            release(c);
            continue;
        }
        be_route rd = r; // the tested table's copies of the inputs
        rd.pos_row = x->perm ? upb(c, perm, sizeof(int32_t) * (size_t)n) : NULL;
        rd.mod = upb(c, mod, (size_t)n);
        float *dg = upb(c, gates, sizeof(float) * (size_t)n * E);
        st = c->be->route(c->be, dg, &rd, &dout);
        c->be->sync(c->be);
        if (st) {
            c->op_fail = 1;
            fprintf(stderr, "    route shape %d: %s\n", sh, vlmoe_last_error());
            release(c);
            continue;
        }
        const size_t nk = (size_t)n * x->K, gec = (size_t)x->G * E * x->C, ge = (size_t)x->G * E;
        const int rows = ra.expert_off[E];
        route_cmp(c, sh, "expert", da.expert, ra.expert, 4 * nk);
        route_cmp(c, sh, "slot", da.slot, ra.slot, 4 * nk);
        route_cmp(c, sh, "token", da.token, ra.token, 4 * gec);
        route_cmp(c, sh, "weight", da.weight, ra.weight, 4 * gec);
        route_cmp(c, sh, "count", da.count, ra.count, 4 * ge);
        route_cmp(c, sh, "wanted", da.wanted, ra.wanted, 12 * ge);
        route_cmp(c, sh, "dropped", da.dropped, ra.dropped, (size_t)n);
        route_cmp(c, sh, "expert_off", da.expert_off, ra.expert_off, 4 * ((size_t)E + 1));
        route_cmp(c, sh, "row_token", da.row_token, ra.row_token, 4 * (size_t)rows);
        route_cmp(c, sh, "row_expert", da.row_expert, ra.row_expert, 4 * (size_t)rows);
        route_cmp(c, sh, "tok_rows", da.tok_rows, ra.tok_rows, 4 * (size_t)rows);
        route_cmp(c, sh, "tok_off", da.tok_off, ra.tok_off, 4 * ((size_t)n + 1));
        // the shapes must exercise what they claim: drops where C is small, ties in the gates
        int dropped = 0;
        for (size_t i = 0; i < nk; i++) dropped += !x->ec && ra.slot[i] < 0;
        if (sh == 0 && !dropped) c->op_fail = 1, fprintf(stderr, "    route shape 0 dropped nothing\n");
        release(c);
    }
}

// small arrays, and ones the CPU table splits across its threads (from 65536 elements, in
// shares of whole 64-byte lines: sizes that leave a partial line and uneven shares)
static void case_memory(ctx *c) {
    const size_t sizes[] = {77, 65536 + 77, 3 * 65536 + 5};
    for (int k = 0; k < 3; k++) {
        const size_t n = sizes[k];
        double *a = rnd(c, n, 1), *b = rnd(c, n, 1), *sum = zeros(c, n);
        for (size_t i = 0; i < n; i++) sum[i] = a[i] + b[i];
        float *fa = up(c, a, n), *fb = up(c, b, n), *fc = up(c, b, n);
        c->be->add(c->be, fb, fa, n);
        cmp(c, "add", fb, sum, n);
        c->be->copy(c->be, fc, fa, n);
        cmp(c, "copy", fc, a, n);
        c->be->zero(c->be, fc, n);
        cmp(c, "zero", fc, zeros(c, n), n);
    }
}

// Images as bytes, normalised: every byte value in every channel, both layouts, two batches staged
// before either is normalised (the CUDA table's double buffering). Exact: the reference table
// widens the same float expression, so any other rounding (a fused or reciprocal division, a
// different order) shows; NMSE alone would hide it.
static void case_pixels(ctx *c) {
    enum { B = 2, C = 3, H = 16, W = 17 };
    const size_t n = (size_t)B * C * H * W;
    const be_pixels p[2] = {{.B = B, .C = C, .H = H, .W = W, .hwc = 1, .mean = {0.48145466f, 0.4578275f, 0.40821073f},
                             .std = {0.26862954f, 0.26130258f, 0.27577711f}},
                            {.B = B, .C = C, .H = H, .W = W, .hwc = 0, .mean = {0.5f, 0.25f, -0.125f},
                             .std = {0.5f, 3.0f, 0.1f}}};
    uint8_t *bytes[2];
    const uint8_t *staged[2];
    for (int k = 0; k < 2; k++) {
        bytes[k] = keep_host(c, malloc(n));
        for (size_t i = 0; i < n; i++) bytes[k][i] = (uint8_t)(i * 7 + (size_t)k * 91 + vlmoe_rng_below(&c->r, 2));
        staged[k] = c->be->pixels_stage(c->be, bytes[k], n);
        if (!staged[k]) c->op_fail = 1, fprintf(stderr, "    stage %d: %s\n", k, vlmoe_last_error());
    }
    for (int k = 0; k < 2 && staged[0] && staged[1]; k++) {
        double *ref = zeros(c, n);
        float *out = up(c, ref, n), *h = keep_host(c, malloc(sizeof(float) * n));
        c->ref->pixels_normalize(c->ref, ref, bytes[k], &p[k]);
        c->be->pixels_normalize(c->be, out, staged[k], &p[k]);
        c->be->sync(c->be);
        c->be->download(c->be, h, out, n);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < n; i++)
            if ((double)h[i] != ref[i] && !bad++) first = i;
        if (bad) {
            c->op_fail = 1;
            fprintf(stderr, "    %s: %zu of %zu values differ, first at %zu: %.9g vs %.9g\n", k ? "chw" : "hwc", bad, n,
                    first, h[first], ref[first]);
        }
        cmp(c, k ? "chw" : "hwc", out, ref, n);
    }
}

typedef struct {
    const char *name;
    be_op op;
    void (*fn)(ctx *);
} test_case;

static const test_case CASES[] = {
    {"linear", BE_OP_LINEAR, case_linear},         {"layernorm", BE_OP_LAYERNORM, case_layernorm},
    {"act", BE_OP_ACT, case_act},                  {"softmax", BE_OP_SOFTMAX, case_softmax},
    {"attention", BE_OP_ATTENTION, case_attention}, {"patchify", BE_OP_PATCHIFY, case_patchify},
    {"embed", BE_OP_EMBED, case_embed},            {"posadd", BE_OP_POSADD, case_posadd},
    {"cls", BE_OP_CLS, case_cls},                  {"pool", BE_OP_POOL, case_pool},
    {"l2norm", BE_OP_L2NORM, case_l2norm},         {"contrastive", BE_OP_CONTRASTIVE, case_contrastive},
    {"xent", BE_OP_XENT, case_xent},               {"dispatch", BE_OP_COMBINE, case_dispatch},
    {"router_noise", BE_OP_ROUTER_NOISE, case_noise}, {"aux_loss", BE_OP_AUX_LOSS, case_aux},
    {"soft_moe", BE_OP_SOFT_MOE, case_soft},       {"experts", BE_OP_EXPERTS, case_experts},
    {"trainer", BE_OP_ADAMW, case_trainer},        {"memory", BE_OP_COUNT, case_memory},
    {"pixels", BE_OP_PIXELS, case_pixels},
    {"route", BE_OP_ROUTE, case_route},
    {"dispatch_pad", BE_OP_COMBINE, case_dispatch_pad}, {"experts_same", BE_OP_EXPERTS, case_experts_same},
    {"step_scalars", BE_OP_STEP_SCALARS, case_step_scalars},
};
#define NCASES ((int)(sizeof(CASES) / sizeof(CASES[0])))

static void run_backend(const vlmoe_backend_f32 *be, int *pass, int *fail, int *skip) {
    for (int i = 0; i < NCASES; i++) {
        const test_case *tc = &CASES[i];
        if (tc->op != BE_OP_COUNT && !be->supports(be, tc->op, NULL)) {
            printf("  %-13s %-5s skipped: the backend does not support it\n", tc->name, be->name);
            ++*skip;
            continue;
        }
        ctx c = {.be = be, .ref = backend_cpu_f64()};
        vlmoe_rng_seed(&c.r, 1000 + (uint64_t)i);
        tc->fn(&c);
        release(&c);
        printf("  %-13s %-5s %s (worst NMSE %.2e)\n", tc->name, be->name, c.op_fail ? "FAIL" : "OK", c.worst);
        if (c.op_fail) ++*fail; else ++*pass;
    }
}

int main(void) {
    int pass = 0, fail = 0, skip = 0;
    printf("backend ops against the CPU table in double (NMSE <= %.0e):\n", NMSE_MAX);
    run_backend(backend_cpu_f32(), &pass, &fail, &skip);
    vlmoe_backend_f32 *cuda = NULL;
    char why[512] = "";
    if (backend_cuda_init(&cuda, 0) == VLMOE_OK) {
        run_backend(cuda, &pass, &fail, &skip);
    } else {
        snprintf(why, sizeof(why), "%s", vlmoe_last_error());
        printf("  cuda: %d ops skipped: %s\n", NCASES, why);
        skip += NCASES;
    }
    bf16_rows(cuda, why, &pass, &fail, &skip);
    backend_cuda_free(cuda);
    printf("%d passed, %d failed, %d skipped\n", pass, fail, skip);
    // every unsupported-op answer names the op
    CHECK(backend_require_f32(backend_cpu_f32(), BE_OP_LINEAR, NULL) == VLMOE_OK, "cpu refuses linear");
    CHECK(!strcmp(be_op_name(BE_OP_EXPERTS), "experts") && !strcmp(be_op_name(BE_OP_COUNT), "unknown"),
          "op names: %s", be_op_name(BE_OP_EXPERTS));
    const vlmoe_backend_f32 *pick = NULL;
    vlmoe_backend_f32 *owned = NULL;
    CHECK(backend_by_name(&pick, &owned, "cpu") == VLMOE_OK && pick == backend_cpu_f32(), "cpu by name");
    CHECK(backend_by_name(&pick, &owned, "tpu") != VLMOE_OK && strstr(vlmoe_last_error(), "tpu"),
          "unknown device: %s", vlmoe_last_error());
    CHECK(backend_by_name(&pick, &owned, "cuda:x") != VLMOE_OK && strstr(vlmoe_last_error(), "cuda:x"),
          "bad cuda ordinal: %s", vlmoe_last_error());
    t_pass += pass;
    t_fail += fail;
    return test_summary("test_backend_ops");
}
