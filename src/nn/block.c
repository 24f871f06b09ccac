// block.c: forward and backward of the one transformer block (src/nn/block.h) through the
// backend table: the attention half, then each feed-forward part as LayerNorm + dense MLP (the
// expert bank of one expert) or MoE layer, added onto the residual. Compiled as float and double
// (src/core/real.h). Covered through the graphs by tests/test_model.c, tests/test_mome.c
// (finite differences) and tests/test_parity.c (PyTorch).
#include "core/real.h"
#include "core/core.h"
#include "nn/block.h"

void R(block_plan)(carver *c, R(block_acts) *a, size_t nmax, size_t natt, int D, int M, int dense) {
    a->ln1_m = carve(c, nmax);
    a->ln1_r = carve(c, nmax);
    a->qkv = carve(c, nmax * 3 * D);
    a->res1 = carve(c, nmax * D);
    a->ln2_m = carve(c, nmax);
    a->ln2_r = carve(c, nmax);
    a->h = dense ? carve(c, nmax * M) : NULL;
    a->res2 = carve(c, nmax * D);
    a->att = natt ? carve(c, natt) : NULL;
    a->atty = natt ? carve(c, nmax * D) : NULL;
}

// the attention half's scratch: its recompute (unless every block keeps its own) and gradients
static void attn_scratch(carver *c, R(block_pass) *p, size_t nmax, size_t natt, int D, int kept) {
    p->att = kept ? NULL : carve(c, natt);
    p->atty = kept ? NULL : carve(c, nmax * D);
    p->datty = carve(c, nmax * D);
    p->dqkv = carve(c, nmax * 3 * D);
    p->datt = carve(c, natt);
}

void R(block_plan_pass)(carver *c, R(block_pass) *p, size_t nmax, size_t natt, int D, int M, int gather,
                        int kept) {
    p->ln = carve(c, nmax * D);
    p->dres = carve(c, nmax * D);
    p->dln = carve(c, nmax * D);
    const size_t mlp_at = c->used;
    p->dh = carve(c, nmax * M);
    p->da = carve(c, nmax * M);
    // The attention half's scratch (its recompute, its gradients) and the feed-forward half's
    // (the MLP's act(h) and dh, which MoE layers share: moe_share_scratch) are never live at once:
    // a block's attention is done with before its feed-forward starts in the forward, and starts
    // after it ends in the backward. So the first lie inside the second (dh, then da, one run of
    // floats) where they fit: 5D + 2HT floats a token (3D + 2HT under checkpointing, whose
    // blocks hold their own attention) against 2M, as in bench-s (1800 or 1288 against 2048);
    // elsewhere (ViT-B/16: 8568 against 6144) they get their own.
    carver fit = {NULL, 0}, mlp = {p->dh, 0};   // p->dh: NULL while counting
    attn_scratch(&fit, p, nmax, natt, D, kept); // how much it takes
    attn_scratch(fit.used <= c->used - mlp_at ? &mlp : c, p, nmax, natt, D, kept);
    p->sx = gather ? carve(c, nmax * D) : NULL;
    p->sdy = gather ? carve(c, nmax * D) : NULL;
}

static int in_place(const R(block_ffn) *f) { return f->off == 0 && f->len == f->seqlen; }

// positions [off, off+len) of each of f's sequences (token buffer src) <-> its rows (dst)
static void gather(const R(block_pass) *p, const R(block_ffn) *f, real *rows, const real *tokens) {
    const size_t D = (size_t)p->D;
    for (int b = 0; b < f->nseq; b++)
        p->be->copy(p->be, rows + (f->row0 + (size_t)b * f->len) * D,
                    tokens + (p->t0 + (size_t)b * f->seqlen + f->off) * D, (size_t)f->len * D);
}
static void scatter(const R(block_pass) *p, const R(block_ffn) *f, real *tokens, const real *rows) {
    const size_t D = (size_t)p->D;
    for (int b = 0; b < f->nseq; b++)
        p->be->copy(p->be, tokens + (p->t0 + (size_t)b * f->seqlen + f->off) * D,
                    rows + (f->row0 + (size_t)b * f->len) * D, (size_t)f->len * D);
}

// Drop path: scales the nseq runs of len rows (D values each) of buf by the sequences' factors.
static void drop_scale(const R(block_pass) *p, real *buf, const double *factor, int nseq, int len) {
    const size_t run = (size_t)len * p->D;
    for (int b = 0; b < nseq; b++)
        if (factor[b] == 0) p->be->zero(p->be, buf + (size_t)b * run, run);
        else if (factor[b] != 1) p->be->scale(p->be, buf + (size_t)b * run, run, (float)factor[b]);
}

// linear_backward for dinp's first writer: the table writes dinp (its linear_backward_write),
// or, in a table without that mode, dinp is zeroed and accumulated into
static void lin_bwd_write(const R(vlmoe_backend) *be, real *dinp, real *dw, real *db, const real *dout,
                          const real *inp, const real *w, int N, int K, int O) {
    if (be->linear_backward_write) {
        be->linear_backward_write(be, dinp, dw, db, dout, inp, w, N, K, O);
        return;
    }
    be->zero(be, dinp, (size_t)N * K);
    be->linear_backward(be, dinp, dw, db, dout, inp, w, N, K, O);
}

// A dense MLP is the expert bank of one expert over the part's rows.
typedef struct {
    int32_t off[2];
    be_experts ex;
    const real *w[4];
} dense_mlp;
static void dense_of(dense_mlp *d, const R(block_pass) *p, const ffn_layout *f, const real *P, int rows) {
    d->off[0] = 0;
    d->off[1] = rows;
    d->ex = (be_experts){1, p->D, p->M, p->act, d->off};
    d->w[0] = P + f->fc1_w, d->w[1] = P + f->fc1_b, d->w[2] = P + f->fc2_w, d->w[3] = P + f->fc2_b;
}

// out (rows of the part) = x + ffn(ln(x)); out may be x.
static int ffn_forward(const R(block_pass) *p, const R(block_acts) *a, const R(block_ffn) *f, const real *P,
                       const real *x, real *out, double *aux) {
    const R(vlmoe_backend) *be = p->be;
    const int D = p->D, M = p->M, ns = f->nseq * f->len;
    real *ln = p->ln + f->row0 * D;
    be->layernorm_forward(be, ln, a->ln2_m + f->row0, a->ln2_r + f->row0, x, P + f->ln_w, P + f->ln_b, ns, D, p->eps);
    if (out != x) be->copy(be, out, x, (size_t)ns * D);
    // with drop path the branch is summed apart, scaled per sequence, then added
    real *y = p->drop[1] ? p->dbuf + f->row0 * D : out;
    if (p->drop[1]) be->zero(be, y, (size_t)ns * D);
    int st = VLMOE_OK;
    if (f->f->kind == FFN_MOE) {
        moe_call c = f->call;
        c.n = ns;
        double a1 = 0;
        st = R(moe_forward)(f->moe, &c, P, ln, y, &a1, f->stats);
        *aux += a1;
    } else {
        dense_mlp d;
        dense_of(&d, p, f->f, P, ns);
        be->experts_forward(be, y, a->h + f->row0 * M, p->da + f->row0 * M, ln, d.w, &d.ex, 1);
    }
    if (!st && p->drop[1]) {
        drop_scale(p, y, p->drop[1], f->nseq, f->len);
        be->add(be, out, y, (size_t)ns * D);
    }
    return st;
}

// dy holds d(out) on entry and d(x) on return (the residual's identity plus the LayerNorm's).
static void ffn_backward(const R(block_pass) *p, const R(block_acts) *a, const R(block_ffn) *f, const real *P, real *G,
                         const real *x, real *dy) {
    const R(vlmoe_backend) *be = p->be;
    const int D = p->D, M = p->M, ns = f->nseq * f->len;
    real *ln = p->ln + f->row0 * D, *dln = p->dln + f->row0 * D;
    const real *m = a->ln2_m + f->row0, *r = a->ln2_r + f->row0;
    be->layernorm_recompute(be, ln, x, P + f->ln_w, P + f->ln_b, m, r, ns, D);
    // drop path: the branch sees d(out) times its sequence's factor; the residual d(out) itself
    const real *dyb = dy;
    if (p->drop[1]) {
        real *s = p->dbuf + f->row0 * D;
        be->copy(be, s, dy, (size_t)ns * D);
        drop_scale(p, s, p->drop[1], f->nseq, f->len);
        dyb = s;
    }
    if (f->f->kind == FFN_MOE) {
        // the MoE layer is dln's first writer (its router's part, then its experts')
        R(moe_backward_write)(f->moe, P, G, ln, dyb, dln, 1.0);
    } else {
        // the dense MLP (one expert over all ns rows) is dln's first and only writer
        dense_mlp d;
        dense_of(&d, p, f->f, P, ns);
        const ffn_layout *fl = f->f;
        real *const dw[4] = {G + fl->fc1_w, G + fl->fc1_b, G + fl->fc2_w, G + fl->fc2_b};
        real *h = a->h + f->row0 * M, *da = p->da + f->row0 * M, *dh = p->dh + f->row0 * M;
        if (be->experts_backward_write) {
            be->experts_backward_write(be, dln, dw, dyb, ln, h, d.w, da, dh, &d.ex);
        } else {
            be->zero(be, dln, (size_t)ns * D);
            be->experts_backward(be, dln, dw, dyb, ln, h, d.w, da, dh, &d.ex);
        }
    }
    be->layernorm_backward(be, dy, G + f->ln_w, G + f->ln_b, dln, x, P + f->ln_w, m, r, ns, D);
}

// The block's attention probabilities and output: its own kept ones, or the pass's scratch.
// Returns whether they are kept.
static int attention_of(const R(block_pass) *p, const R(block_acts) *a, real **att, real **atty) {
    *att = a->att ? a->att : p->att;
    *atty = a->atty ? a->atty : p->atty;
    return a->atty != NULL;
}

int R(block_forward)(const R(block_pass) *p, const R(block) *b, const real *P, const real *x, double *aux) {
    const R(vlmoe_backend) *be = p->be;
    const block_layout *bl = b->bl;
    R(block_acts) *a = b->a;
    const int D = p->D, H = p->H, n = p->n;
    const size_t t0 = p->t0;
    be->layernorm_forward(be, p->ln + t0 * D, a->ln1_m + t0, a->ln1_r + t0, x + t0 * D, P + bl->ln1_w, P + bl->ln1_b,
                         n, D, p->eps);
    be->linear_forward(be, a->qkv + t0 * 3 * D, p->ln + t0 * D, P + bl->qkv_w, P + bl->qkv_b, n, D, 3 * D, 0);
    real *att, *atty;
    attention_of(p, a, &att, &atty);
    for (int k = 0; k < p->nseg; k++)
        be->attention_forward(be, atty, att + p->att_off[k], a->qkv, &p->seg[k], D, H);
    if (p->drop[0]) { // drop path: res1 = x + factor * out(atty), per sequence
        be->linear_forward(be, a->res1 + t0 * D, atty + t0 * D, P + bl->out_w, P + bl->out_b, n, D, D, 0);
        drop_scale(p, a->res1 + t0 * D, p->drop[0], p->drop_nseq, n / p->drop_nseq);
        be->add(be, a->res1 + t0 * D, x + t0 * D, (size_t)n * D);
    } else {
        be->copy(be, a->res1 + t0 * D, x + t0 * D, (size_t)n * D);
        be->linear_forward(be, a->res1 + t0 * D, atty + t0 * D, P + bl->out_w, P + bl->out_b, n, D, D, 1);
    }
    for (int k = 0; k < b->nffn; k++) {
        const R(block_ffn) *f = &b->ffn[k];
        int st;
        if (in_place(f)) {
            const size_t tok = t0 + (size_t)f->off;
            st = ffn_forward(p, a, f, P, a->res1 + tok * D, a->res2 + tok * D, aux);
        } else {
            real *xs = p->sx + f->row0 * D;
            gather(p, f, p->sx, a->res1);
            st = ffn_forward(p, a, f, P, xs, xs, aux);
            scatter(p, f, a->res2, p->sx);
        }
        if (st) return st;
    }
    return VLMOE_OK;
}

void R(block_backward)(const R(block_pass) *p, const R(block) *b, const real *P, real *G, const real *x) {
    const R(vlmoe_backend) *be = p->be;
    const block_layout *bl = b->bl;
    const R(block_acts) *a = b->a;
    const int D = p->D, H = p->H, n = p->n;
    const size_t t0 = p->t0;
    // dres holds d(block output): the feed-forward parts first
    for (int k = 0; k < b->nffn; k++) {
        const R(block_ffn) *f = &b->ffn[k];
        if (in_place(f)) {
            const size_t tok = t0 + (size_t)f->off;
            ffn_backward(p, a, f, P, G, a->res1 + tok * D, p->dres + tok * D);
        } else {
            gather(p, f, p->sdy, p->dres);
            gather(p, f, p->sx, a->res1);
            ffn_backward(p, a, f, P, G, p->sx + f->row0 * D, p->sdy + f->row0 * D);
            scatter(p, f, p->dres, p->sdy);
        }
    }
    // dres now holds d(res1): the attention half, its outputs kept or recomputed
    real *att, *atty;
    if (!attention_of(p, a, &att, &atty))
        for (int k = 0; k < p->nseg; k++)
            be->attention_forward(be, atty, att + p->att_off[k], a->qkv, &p->seg[k], D, H);
    const real *dbranch = p->dres + t0 * D;
    if (p->drop[0]) {
        be->copy(be, p->dbuf + t0 * D, p->dres + t0 * D, (size_t)n * D);
        drop_scale(p, p->dbuf + t0 * D, p->drop[0], p->drop_nseq, n / p->drop_nseq);
        dbranch = p->dbuf + t0 * D;
    }
    // the out projection and the qkv product are the first writers of datty and dln: no zeroing
    lin_bwd_write(be, p->datty + t0 * D, G + bl->out_w, G + bl->out_b, dbranch, atty + t0 * D, P + bl->out_w, n,
                  D, D);
    // attention_backward writes dqkv (no zeroing): the segments cover the pass's n tokens
    for (int k = 0; k < p->nseg; k++)
        be->attention_backward(be, p->dqkv, p->datt + p->att_off[k], p->datty, a->qkv, att + p->att_off[k],
                              &p->seg[k], D, H);
    be->layernorm_recompute(be, p->ln + t0 * D, x + t0 * D, P + bl->ln1_w, P + bl->ln1_b, a->ln1_m + t0,
                           a->ln1_r + t0, n, D);
    lin_bwd_write(be, p->dln + t0 * D, G + bl->qkv_w, G + bl->qkv_b, p->dqkv + t0 * 3 * D, p->ln + t0 * D,
                  P + bl->qkv_w, n, D, 3 * D);
    be->layernorm_backward(be, p->dres + t0 * D, G + bl->ln1_w, G + bl->ln1_b, p->dln + t0 * D, x + t0 * D,
                          P + bl->ln1_w, a->ln1_m + t0, a->ln1_r + t0, n, D);
}
