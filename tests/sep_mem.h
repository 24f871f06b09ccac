// sep_mem.h: "cpu-separate", the CPU table dressed as a device without host memory, for
// tests/test_model.c's whole-model checks of --device without a GPU. It records every allocation
// it makes, and each op, before it runs the CPU kernel, checks that every pointer argument (the
// ids, labels, lengths and dispatch indices inside the op's structs too) lies in one of them:
// a real GPU faults or reads garbage there (the auxiliary losses' modality and counts once
// reached the CUDA kernels as host arrays: NaN at step 0, while the plain CPU table read them
// happily). be_experts.off is host memory by contract (backend.h) and is not checked.
#ifndef VLMOE_TEST_SEP_MEM_H
#define VLMOE_TEST_SEP_MEM_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/backend.h"

static struct { const char *lo, *hi; } sep_blocks[4096];
static int sep_nblocks, sep_stray;
static char sep_first[160];   // the first stray pointer: which op, which argument
static const vlmoe_backend_f32 *sep_cpu;
typedef vlmoe_backend_f32 sep_be;
// Host/device traffic, as a GPU would see it: downloads (each a wait for the device), split into
// explicit ones by size and the scalars the double-returning ops read back; bytes uploaded.
static struct {
    long downloads, download_floats, small_downloads; // download calls; floats; calls of <= 16 floats
    long scalar_ops;   // contrastive_forward, xent_forward, aux_loss's forward, sumsq: one wait each
    long aux_ops;      // of which aux_loss (src/moe/layer.c, the routing)
    long upload_bytes; // upload, upload_bytes and pixels_stage
    long pixel_bytes;  // of which images staged as bytes
    long pageable_uploads; // upload / upload_bytes calls from host memory that is not host_alloc's
    long fixed_uploads;    // and from host_alloc's (what a captured graph can replay)
    long syncs;        // sync calls (each a wait for the device)
    long aux_dev;      // aux_loss_dev: values left in the table's memory (no wait)
} sep_traffic;

// the image staging (below): the table's for the process's life, as a device context's
static uint8_t *sep_pix[2];
static size_t sep_pix_cap;
static int sep_pix_next;

static void sep_check(const void *p, const char *op, const char *arg) {
    if (!p) return;
    for (int k = 0; k < 2; k++)
        if (sep_pix[k] && (const uint8_t *)p >= sep_pix[k] && (const uint8_t *)p < sep_pix[k] + sep_pix_cap) return;
    for (int i = 0; i < sep_nblocks; i++)
        if ((const char *)p >= sep_blocks[i].lo && (const char *)p < sep_blocks[i].hi) return;
    if (!sep_stray++) snprintf(sep_first, sizeof(sep_first), "%s got %s in host memory", op, arg);
}
#define SEP(p, op, arg) sep_check((p), op, arg)

static void *sep_alloc(const sep_be *be, size_t bytes, const char *what) {
    (void)be;
    void *p = sep_cpu->alloc(sep_cpu, bytes, what);
    if (p && sep_nblocks < (int)(sizeof(sep_blocks) / sizeof(sep_blocks[0])))
        sep_blocks[sep_nblocks].lo = p, sep_blocks[sep_nblocks++].hi = (const char *)p + bytes;
    return p;
}
static void sep_free(const sep_be *be, void *p) {
    (void)be;
    for (int i = 0; p && i < sep_nblocks; i++)
        if (sep_blocks[i].lo == p) sep_blocks[i] = sep_blocks[--sep_nblocks];
    sep_cpu->free(sep_cpu, p);
}

// the table's host memory (host_alloc), so uploads can be told apart by their source
static struct { const char *lo, *hi; } sep_hblocks[1024];
static int sep_nhblocks;
static void *sep_host_alloc(const sep_be *be, size_t bytes, const char *what) {
    (void)be;
    void *p = sep_cpu->host_alloc(sep_cpu, bytes, what);
    if (p && sep_nhblocks < (int)(sizeof(sep_hblocks) / sizeof(sep_hblocks[0])))
        sep_hblocks[sep_nhblocks].lo = p, sep_hblocks[sep_nhblocks++].hi = (const char *)p + bytes;
    return p;
}
static void sep_host_free(const sep_be *be, void *p) {
    (void)be;
    for (int i = 0; p && i < sep_nhblocks; i++)
        if (sep_hblocks[i].lo == p) sep_hblocks[i] = sep_hblocks[--sep_nhblocks];
    sep_cpu->host_free(sep_cpu, p);
}
static void sep_count_source(const void *host) {
    for (int i = 0; i < sep_nhblocks; i++)
        if ((const char *)host >= sep_hblocks[i].lo && (const char *)host < sep_hblocks[i].hi) {
            sep_traffic.fixed_uploads++;
            return;
        }
    sep_traffic.pageable_uploads++;
}

// memory
static void sep_upload(const sep_be *be, float *dst, const float *host, size_t n) {
    (void)be, SEP(dst, "upload", "dst");
    sep_traffic.upload_bytes += (long)(sizeof(float) * n), sep_count_source(host);
    sep_cpu->upload(sep_cpu, dst, host, n);
}
static long sep_ndownload, sep_ndownload_bytes; // calls, so a test can see what a step fetches
static void sep_download(const sep_be *be, float *host, const float *src, size_t n) {
    (void)be, SEP(src, "download", "src"), sep_ndownload++;
    sep_traffic.downloads++, sep_traffic.download_floats += (long)n, sep_traffic.small_downloads += n <= 16;
    sep_cpu->download(sep_cpu, host, src, n);
}
static void sep_upload_bytes(const sep_be *be, void *dst, const void *host, size_t n) {
    (void)be, SEP(dst, "upload_bytes", "dst");
    sep_traffic.upload_bytes += (long)n, sep_count_source(host);
    sep_cpu->upload_bytes(sep_cpu, dst, host, n);
}
static void sep_zero(const sep_be *be, float *p, size_t n) {
    (void)be, SEP(p, "zero", "p");
    sep_cpu->zero(sep_cpu, p, n);
}
static void sep_copy(const sep_be *be, float *dst, const float *src, size_t n) {
    (void)be, SEP(dst, "copy", "dst"), SEP(src, "copy", "src");
    sep_cpu->copy(sep_cpu, dst, src, n);
}
static void sep_add(const sep_be *be, float *dst, const float *src, size_t n) {
    (void)be, SEP(dst, "add", "dst"), SEP(src, "add", "src");
    sep_cpu->add(sep_cpu, dst, src, n);
}
static void sep_scale(const sep_be *be, float *x, size_t n, float s) {
    (void)be, SEP(x, "scale", "x");
    sep_cpu->scale(sep_cpu, x, n, s);
}

// the ops of src/ops/ops.h
static void sep_linear_f(const sep_be *be, float *out, const float *inp, const float *w, const float *b, int N, int K,
                         int O, int beta) {
    (void)be, SEP(out, "linear_forward", "out"), SEP(inp, "linear_forward", "inp"), SEP(w, "linear_forward", "w");
    SEP(b, "linear_forward", "b");
    sep_cpu->linear_forward(sep_cpu, out, inp, w, b, N, K, O, beta);
}
static void sep_linear_b(const sep_be *be, float *dinp, float *dw, float *db, const float *dout, const float *inp,
                         const float *w, int N, int K, int O) {
    (void)be, SEP(dinp, "linear_backward", "dinp"), SEP(dw, "linear_backward", "dw"), SEP(db, "linear_backward", "db");
    SEP(dout, "linear_backward", "dout"), SEP(inp, "linear_backward", "inp"), SEP(w, "linear_backward", "w");
    sep_cpu->linear_backward(sep_cpu, dinp, dw, db, dout, inp, w, N, K, O);
}
static void sep_linear_bw(const sep_be *be, float *dinp, float *dw, float *db, const float *dout, const float *inp,
                          const float *w, int N, int K, int O) {
    (void)be, SEP(dinp, "linear_backward_write", "dinp"), SEP(dw, "linear_backward_write", "dw");
    SEP(db, "linear_backward_write", "db"), SEP(dout, "linear_backward_write", "dout");
    SEP(inp, "linear_backward_write", "inp"), SEP(w, "linear_backward_write", "w");
    sep_cpu->linear_backward_write(sep_cpu, dinp, dw, db, dout, inp, w, N, K, O);
}
static void sep_ln_f(const sep_be *be, float *out, float *mean, float *rstd, const float *inp, const float *w,
                     const float *b, int N, int C, double eps) {
    (void)be, SEP(out, "layernorm_forward", "out"), SEP(mean, "layernorm_forward", "mean");
    SEP(rstd, "layernorm_forward", "rstd"), SEP(inp, "layernorm_forward", "inp"), SEP(w, "layernorm_forward", "w");
    SEP(b, "layernorm_forward", "b");
    sep_cpu->layernorm_forward(sep_cpu, out, mean, rstd, inp, w, b, N, C, eps);
}
static void sep_ln_r(const sep_be *be, float *out, const float *inp, const float *w, const float *b, const float *mean,
                     const float *rstd, int N, int C) {
    (void)be, SEP(out, "layernorm_recompute", "out"), SEP(inp, "layernorm_recompute", "inp");
    SEP(w, "layernorm_recompute", "w"), SEP(b, "layernorm_recompute", "b"), SEP(mean, "layernorm_recompute", "mean");
    SEP(rstd, "layernorm_recompute", "rstd");
    sep_cpu->layernorm_recompute(sep_cpu, out, inp, w, b, mean, rstd, N, C);
}
static void sep_ln_b(const sep_be *be, float *dinp, float *dw, float *db, const float *dout, const float *inp,
                     const float *w, const float *mean, const float *rstd, int N, int C) {
    (void)be, SEP(dinp, "layernorm_backward", "dinp"), SEP(dw, "layernorm_backward", "dw");
    SEP(db, "layernorm_backward", "db"), SEP(dout, "layernorm_backward", "dout"), SEP(inp, "layernorm_backward", "inp");
    SEP(w, "layernorm_backward", "w"), SEP(mean, "layernorm_backward", "mean"), SEP(rstd, "layernorm_backward", "rstd");
    sep_cpu->layernorm_backward(sep_cpu, dinp, dw, db, dout, inp, w, mean, rstd, N, C);
}
static void sep_act_f(const sep_be *be, float *out, const float *inp, size_t n, int kind) {
    (void)be, SEP(out, "act_forward", "out"), SEP(inp, "act_forward", "inp");
    sep_cpu->act_forward(sep_cpu, out, inp, n, kind);
}
static void sep_act_b(const sep_be *be, float *dinp, const float *inp, const float *dout, size_t n, int kind) {
    (void)be, SEP(dinp, "act_backward", "dinp"), SEP(inp, "act_backward", "inp"), SEP(dout, "act_backward", "dout");
    sep_cpu->act_backward(sep_cpu, dinp, inp, dout, n, kind);
}
static void sep_softmax_f(const sep_be *be, float *out, const float *inp, int N, int C) {
    (void)be, SEP(out, "softmax_forward", "out"), SEP(inp, "softmax_forward", "inp");
    sep_cpu->softmax_forward(sep_cpu, out, inp, N, C);
}
static void sep_softmax_b(const sep_be *be, float *dinp, const float *out, const float *dout, int N, int C) {
    (void)be, SEP(dinp, "softmax_backward", "dinp"), SEP(out, "softmax_backward", "out");
    SEP(dout, "softmax_backward", "dout");
    sep_cpu->softmax_backward(sep_cpu, dinp, out, dout, N, C);
}
static void sep_attn_f(const sep_be *be, float *out, float *att, const float *qkv, const attn_segment *seg, int D,
                       int H) {
    (void)be, SEP(out, "attention_forward", "out"), SEP(att, "attention_forward", "att");
    SEP(qkv, "attention_forward", "qkv"), SEP(seg->lens, "attention_forward", "the segment's lens");
    sep_cpu->attention_forward(sep_cpu, out, att, qkv, seg, D, H);
}
static void sep_attn_b(const sep_be *be, float *dqkv, float *datt, const float *dout, const float *qkv,
                       const float *att, const attn_segment *seg, int D, int H) {
    (void)be, SEP(dqkv, "attention_backward", "dqkv"), SEP(datt, "attention_backward", "datt");
    SEP(dout, "attention_backward", "dout"), SEP(qkv, "attention_backward", "qkv"), SEP(att, "attention_backward", "att");
    SEP(seg->lens, "attention_backward", "the segment's lens");
    sep_cpu->attention_backward(sep_cpu, dqkv, datt, dout, qkv, att, seg, D, H);
}
static void sep_patch_f(const sep_be *be, float *patches, const float *images, int B, int C, int HW, int P) {
    (void)be, SEP(patches, "patchify_forward", "patches"), SEP(images, "patchify_forward", "images");
    sep_cpu->patchify_forward(sep_cpu, patches, images, B, C, HW, P);
}
static void sep_patch_b(const sep_be *be, float *dimages, const float *dpatches, int B, int C, int HW, int P) {
    (void)be, SEP(dimages, "patchify_backward", "dimages"), SEP(dpatches, "patchify_backward", "dpatches");
    sep_cpu->patchify_backward(sep_cpu, dimages, dpatches, B, C, HW, P);
}
static void sep_embed_f(const sep_be *be, float *out, const int32_t *ids, const float *wte, int BT, int D) {
    (void)be, SEP(out, "embed_forward", "out"), SEP(ids, "embed_forward", "ids"), SEP(wte, "embed_forward", "wte");
    sep_cpu->embed_forward(sep_cpu, out, ids, wte, BT, D);
}
static void sep_embed_b(const sep_be *be, float *dwte, const float *dout, const int32_t *ids, int BT, int D) {
    (void)be, SEP(dwte, "embed_backward", "dwte"), SEP(dout, "embed_backward", "dout"), SEP(ids, "embed_backward", "ids");
    sep_cpu->embed_backward(sep_cpu, dwte, dout, ids, BT, D);
}
static void sep_posadd_f(const sep_be *be, float *out, const float *pos, int B, int T, int D) {
    (void)be, SEP(out, "posadd_forward", "out"), SEP(pos, "posadd_forward", "pos");
    sep_cpu->posadd_forward(sep_cpu, out, pos, B, T, D);
}
static void sep_posadd_b(const sep_be *be, float *dpos, const float *dout, int B, int T, int D) {
    (void)be, SEP(dpos, "posadd_backward", "dpos"), SEP(dout, "posadd_backward", "dout");
    sep_cpu->posadd_backward(sep_cpu, dpos, dout, B, T, D);
}
static void sep_cls_f(const sep_be *be, float *out, const float *cls, const float *x, int B, int N, int D) {
    (void)be, SEP(out, "cls_forward", "out"), SEP(cls, "cls_forward", "cls"), SEP(x, "cls_forward", "x");
    sep_cpu->cls_forward(sep_cpu, out, cls, x, B, N, D);
}
static void sep_cls_b(const sep_be *be, float *dcls, float *dx, const float *dout, int B, int N, int D) {
    (void)be, SEP(dcls, "cls_backward", "dcls"), SEP(dx, "cls_backward", "dx"), SEP(dout, "cls_backward", "dout");
    sep_cpu->cls_backward(sep_cpu, dcls, dx, dout, B, N, D);
}
static void sep_pool_f(const sep_be *be, float *out, const float *x, const int32_t *lens, int B, int T, int D,
                       int kind) {
    (void)be, SEP(out, "pool_forward", "out"), SEP(x, "pool_forward", "x"), SEP(lens, "pool_forward", "lens");
    sep_cpu->pool_forward(sep_cpu, out, x, lens, B, T, D, kind);
}
static void sep_pool_b(const sep_be *be, float *dx, const float *dout, const int32_t *lens, int B, int T, int D,
                       int kind) {
    (void)be, SEP(dx, "pool_backward", "dx"), SEP(dout, "pool_backward", "dout"), SEP(lens, "pool_backward", "lens");
    sep_cpu->pool_backward(sep_cpu, dx, dout, lens, B, T, D, kind);
}
static void sep_l2_f(const sep_be *be, float *out, float *norm, const float *x, int N, int C) {
    (void)be, SEP(out, "l2norm_forward", "out"), SEP(norm, "l2norm_forward", "norm"), SEP(x, "l2norm_forward", "x");
    sep_cpu->l2norm_forward(sep_cpu, out, norm, x, N, C);
}
static void sep_l2_b(const sep_be *be, float *dx, const float *dout, const float *out, const float *norm, int N,
                     int C) {
    (void)be, SEP(dx, "l2norm_backward", "dx"), SEP(dout, "l2norm_backward", "dout"), SEP(out, "l2norm_backward", "out");
    SEP(norm, "l2norm_backward", "norm");
    sep_cpu->l2norm_backward(sep_cpu, dx, dout, out, norm, N, C);
}
static double sep_con_f(const sep_be *be, float *logits, float *prow, float *pcol, const float *img, const float *txt,
                        float scale, int B, int E, double *acc) {
    (void)be, SEP(logits, "contrastive_forward", "logits"), SEP(prow, "contrastive_forward", "prow");
    SEP(pcol, "contrastive_forward", "pcol"), SEP(img, "contrastive_forward", "img");
    SEP(txt, "contrastive_forward", "txt");
    sep_traffic.scalar_ops++;
    return sep_cpu->contrastive_forward(sep_cpu, logits, prow, pcol, img, txt, scale, B, E, acc);
}
static void sep_con_b(const sep_be *be, float *dimg, float *dtxt, float *dscale, const float *logits,
                      const float *prow, const float *pcol, const float *img, const float *txt, float scale, int B,
                      int E, double dloss) {
    (void)be, SEP(dimg, "contrastive_backward", "dimg"), SEP(dtxt, "contrastive_backward", "dtxt");
    SEP(dscale, "contrastive_backward", "dscale"), SEP(logits, "contrastive_backward", "logits");
    SEP(prow, "contrastive_backward", "prow"), SEP(pcol, "contrastive_backward", "pcol");
    SEP(img, "contrastive_backward", "img"), SEP(txt, "contrastive_backward", "txt");
    sep_cpu->contrastive_backward(sep_cpu, dimg, dtxt, dscale, logits, prow, pcol, img, txt, scale, B, E, dloss);
}
static double sep_xent_f(const sep_be *be, float *probs, const float *logits, const int32_t *labels, int n, int C,
                         int *correct) {
    (void)be, SEP(probs, "xent_forward", "probs"), SEP(logits, "xent_forward", "logits");
    SEP(labels, "xent_forward", "labels");
    sep_traffic.scalar_ops++;
    return sep_cpu->xent_forward(sep_cpu, probs, logits, labels, n, C, correct);
}
static void sep_xent_b(const sep_be *be, float *dlogits, const float *probs, const int32_t *labels, int n, int C,
                       double scale) {
    (void)be, SEP(dlogits, "xent_backward", "dlogits"), SEP(probs, "xent_backward", "probs");
    SEP(labels, "xent_backward", "labels");
    sep_cpu->xent_backward(sep_cpu, dlogits, probs, labels, n, C, scale);
}

// MoE dispatch
static void sep_dispatch(const be_dispatch *d, const char *op) {
    SEP(d->row_token, op, "row_token"), SEP(d->row_expert, op, "row_expert");
    SEP(d->tok_off, op, "tok_off"), SEP(d->tok_rows, op, "tok_rows");
}
static void sep_gather(const sep_be *be, float *dst, const float *src, const int32_t *idx, int rows, int D) {
    (void)be, SEP(dst, "gather_rows", "dst"), SEP(src, "gather_rows", "src"), SEP(idx, "gather_rows", "idx");
    sep_cpu->gather_rows(sep_cpu, dst, src, idx, rows, D);
}
static void sep_comb_f(const sep_be *be, float *out, const float *y, const float *w, const be_dispatch *d, int D) {
    (void)be, SEP(out, "combine_forward", "out"), SEP(y, "combine_forward", "y"), SEP(w, "combine_forward", "w");
    sep_dispatch(d, "combine_forward");
    sep_cpu->combine_forward(sep_cpu, out, y, w, d, D);
}
static void sep_comb_b(const sep_be *be, float *dy, float *dw, const float *dout, const float *y, const float *w,
                       const be_dispatch *d, int D) {
    (void)be, SEP(dy, "combine_backward", "dy"), SEP(dw, "combine_backward", "dw");
    SEP(dout, "combine_backward", "dout"), SEP(y, "combine_backward", "y"), SEP(w, "combine_backward", "w");
    sep_dispatch(d, "combine_backward");
    sep_cpu->combine_backward(sep_cpu, dy, dw, dout, y, w, d, D);
}
static void sep_gather_b(const sep_be *be, float *dx, const float *dxp, const be_dispatch *d, int D) {
    (void)be, SEP(dx, "gather_rows_backward", "dx"), SEP(dxp, "gather_rows_backward", "dxp");
    sep_dispatch(d, "gather_rows_backward");
    sep_cpu->gather_rows_backward(sep_cpu, dx, dxp, d, D);
}
static void sep_cw_f(const sep_be *be, float *w, float *zsum, const float *gates, const be_dispatch *d, int renorm) {
    (void)be, SEP(w, "combine_weights", "w"), SEP(zsum, "combine_weights", "zsum");
    SEP(gates, "combine_weights", "gates"), sep_dispatch(d, "combine_weights");
    sep_cpu->combine_weights(sep_cpu, w, zsum, gates, d, renorm);
}
static void sep_cw_b(const sep_be *be, float *dgates, const float *dw, const float *gates, const float *zsum,
                     const be_dispatch *d, int renorm) {
    (void)be, SEP(dgates, "combine_weights_backward", "dgates"), SEP(dw, "combine_weights_backward", "dw");
    SEP(gates, "combine_weights_backward", "gates"), SEP(zsum, "combine_weights_backward", "zsum");
    sep_dispatch(d, "combine_weights_backward");
    sep_cpu->combine_weights_backward(sep_cpu, dgates, dw, gates, zsum, d, renorm);
}
static void sep_noise(const sep_be *be, float *noisy, const float *logits, int n, int E, const be_noise *nz) {
    (void)be, SEP(noisy, "router_noise", "noisy"), SEP(logits, "router_noise", "logits");
    SEP(nz->key, "router_noise", "the noise keys");
    sep_cpu->router_noise(sep_cpu, noisy, logits, n, E, nz);
}
static double sep_aux(const sep_be *be, vlmoe_aux_kind kind, const aux_input_f32 *in, double weight, float *dlogits,
                      float *scratch) {
    (void)be, SEP(in->logits, "aux_loss", "logits"), SEP(in->noisy_logits, "aux_loss", "noisy_logits");
    SEP(in->modality, "aux_loss", "modality"), SEP(in->wanted, "aux_loss", "wanted");
    if (kind == VLMOE_AUX_SWITCH && in->modality) SEP(in->wanted_mod, "aux_loss", "wanted_mod");
    SEP(dlogits, "aux_loss", "dlogits"), SEP(scratch, "aux_loss", "scratch");
    if (!dlogits) sep_traffic.scalar_ops++, sep_traffic.aux_ops++; // the backward's value is not waited for
    return sep_cpu->aux_loss(sep_cpu, kind, in, weight, dlogits, scratch);
}
static void sep_aux_dev(const sep_be *be, vlmoe_aux_kind kind, const aux_input_f32 *in, float *scratch, double *out) {
    (void)be, SEP(in->logits, "aux_loss_dev", "logits"), SEP(in->noisy_logits, "aux_loss_dev", "noisy_logits");
    SEP(in->modality, "aux_loss_dev", "modality"), SEP(in->wanted, "aux_loss_dev", "wanted");
    if (kind == VLMOE_AUX_SWITCH && in->modality) SEP(in->wanted_mod, "aux_loss_dev", "wanted_mod");
    SEP(scratch, "aux_loss_dev", "scratch"), SEP(out, "aux_loss_dev", "out");
    sep_traffic.aux_dev++;
    sep_cpu->aux_loss_dev(sep_cpu, kind, in, scratch, out);
}
static int sep_sync(const sep_be *be) {
    (void)be, sep_traffic.syncs++;
    return sep_cpu->sync(sep_cpu);
}
static void sep_soft_params(const soft_params_f32 *p, const char *op) {
    SEP(p->phi, op, "phi"), SEP(p->scale, op, "scale"), SEP(p->w1, op, "w1"), SEP(p->b1, op, "b1");
    SEP(p->w2, op, "w2"), SEP(p->b2, op, "b2");
}
static void sep_soft_f(const sep_be *be, float *out, float *acts, const float *x, const soft_params_f32 *p,
                       const soft_dims *d) {
    (void)be, SEP(out, "soft_moe_forward", "out"), SEP(acts, "soft_moe_forward", "acts"), SEP(x, "soft_moe_forward", "x");
    sep_soft_params(p, "soft_moe_forward");
    sep_cpu->soft_moe_forward(sep_cpu, out, acts, x, p, d);
}
static void sep_soft_b(const sep_be *be, float *dx, const soft_grads_f32 *g, const float *dout, const float *acts,
                       const float *x, const soft_params_f32 *p, const soft_dims *d, float *scratch) {
    (void)be, SEP(dx, "soft_moe_backward", "dx"), SEP(dout, "soft_moe_backward", "dout");
    SEP(acts, "soft_moe_backward", "acts"), SEP(x, "soft_moe_backward", "x"), SEP(scratch, "soft_moe_backward", "scratch");
    SEP(g->dphi, "soft_moe_backward", "dphi"), SEP(g->dscale, "soft_moe_backward", "dscale");
    SEP(g->dw1, "soft_moe_backward", "dw1"), SEP(g->db1, "soft_moe_backward", "db1");
    SEP(g->dw2, "soft_moe_backward", "dw2"), SEP(g->db2, "soft_moe_backward", "db2");
    sep_soft_params(p, "soft_moe_backward");
    sep_cpu->soft_moe_backward(sep_cpu, dx, g, dout, acts, x, p, d, scratch);
}
static void sep_exp_f(const sep_be *be, float *y, float *h, float *a, const float *x, const float *const w[4],
                      const be_experts *ex, int beta) {
    (void)be, SEP(y, "experts_forward", "y"), SEP(h, "experts_forward", "h"), SEP(a, "experts_forward", "a");
    SEP(x, "experts_forward", "x");
    for (int k = 0; k < 4; k++) SEP(w[k], "experts_forward", "a weight");
    sep_cpu->experts_forward(sep_cpu, y, h, a, x, w, ex, beta);
}
static void sep_exp_b(const sep_be *be, float *dx, float *const dw[4], const float *dy, const float *x, const float *h,
                      const float *const w[4], float *da, float *dh, const be_experts *ex) {
    (void)be, SEP(dx, "experts_backward", "dx"), SEP(dy, "experts_backward", "dy"), SEP(x, "experts_backward", "x");
    SEP(h, "experts_backward", "h"), SEP(da, "experts_backward", "da"), SEP(dh, "experts_backward", "dh");
    for (int k = 0; k < 4; k++) SEP(w[k], "experts_backward", "a weight"), SEP(dw[k], "experts_backward", "a gradient");
    sep_cpu->experts_backward(sep_cpu, dx, dw, dy, x, h, w, da, dh, ex);
}
static void sep_exp_bw(const sep_be *be, float *dx, float *const dw[4], const float *dy, const float *x, const float *h,
                       const float *const w[4], float *da, float *dh, const be_experts *ex) {
    const char *op = "experts_backward_write";
    (void)be, SEP(dx, op, "dx"), SEP(dy, op, "dy"), SEP(x, op, "x"), SEP(h, op, "h"), SEP(da, op, "da"), SEP(dh, op, "dh");
    for (int k = 0; k < 4; k++) SEP(w[k], op, "a weight"), SEP(dw[k], op, "a gradient");
    sep_cpu->experts_backward_write(sep_cpu, dx, dw, dy, x, h, w, da, dh, ex);
}

// trainer ops: the optimizer runs on the host master copy (model_host_backend), never here
static double sep_sumsq(const sep_be *be, const float *x, size_t n, int *nonfinite) {
    (void)be, SEP(x, "sumsq", "x");
    sep_traffic.scalar_ops++;
    return sep_cpu->sumsq(sep_cpu, x, n, nonfinite);
}
static void sep_adamw(const sep_be *be, float *p, float *m, float *v, const float *g, size_t n, const be_adamw *a) {
    (void)be, SEP(p, "adamw", "p"), SEP(m, "adamw", "m"), SEP(v, "adamw", "v"), SEP(g, "adamw", "g");
    sep_cpu->adamw(sep_cpu, p, m, v, g, n, a);
}
static void sep_clamp(const sep_be *be, float *x, size_t n, double lo, double hi) {
    (void)be, SEP(x, "clamp", "x");
    sep_cpu->clamp(sep_cpu, x, n, lo, hi);
}

// Images as bytes: staged into one of two buffers of the table's own, used in turn (the CUDA
// table's double buffering), which the normalisation must read. They live as long as the process
// (a CUDA context's live as long as the table), so the tests' count of unfreed blocks leaves them out.
static const uint8_t *sep_pixels_stage(const sep_be *be, const uint8_t *host, size_t n) {
    (void)be;
    if (n > sep_pix_cap) {
        for (int k = 0; k < 2; k++) {
            free(sep_pix[k]);
            if (!(sep_pix[k] = malloc(n))) return sep_pix_cap = 0, NULL;
        }
        sep_pix_cap = n;
    }
    if (!host) return sep_pix[0];
    uint8_t *d = sep_pix[sep_pix_next];
    sep_pix_next ^= 1;
    memcpy(d, host, n);
    sep_traffic.upload_bytes += (long)n, sep_traffic.pixel_bytes += (long)n;
    return d;
}
static void sep_pixels_normalize(const sep_be *be, float *out, const uint8_t *pix, const be_pixels *p) {
    (void)be, SEP(out, "pixels_normalize", "out"), SEP(pix, "pixels_normalize", "pix");
    sep_cpu->pixels_normalize(sep_cpu, out, pix, p);
}

// the step's scalars left in the table's memory: no wait until they are downloaded
static void sep_con_f_dev(const sep_be *be, float *logits, float *prow, float *pcol, const float *img,
                          const float *txt, float scale, int B, int E, double *out) {
    (void)be, SEP(logits, "contrastive_forward_dev", "logits"), SEP(prow, "contrastive_forward_dev", "prow");
    SEP(pcol, "contrastive_forward_dev", "pcol"), SEP(img, "contrastive_forward_dev", "img");
    SEP(txt, "contrastive_forward_dev", "txt"), SEP(out, "contrastive_forward_dev", "out");
    sep_cpu->contrastive_forward_dev(sep_cpu, logits, prow, pcol, img, txt, scale, B, E, out);
}
static void sep_sumsq_dev(const sep_be *be, const float *x, size_t n, double *out) {
    (void)be, SEP(x, "sumsq_dev", "x"), SEP(out, "sumsq_dev", "out");
    sep_cpu->sumsq_dev(sep_cpu, x, n, out);
}

// the routing decision (be_route): its inputs and every output array are table memory
static void sep_download_bytes(const sep_be *be, void *host, const void *src, size_t n) {
    (void)be, SEP(src, "download_bytes", "src"), sep_ndownload_bytes++;
    sep_cpu->download_bytes(sep_cpu, host, src, n);
}
static int sep_route(const sep_be *be, const float *gates, const be_route *r, const be_route_out *o) {
    (void)be, SEP(gates, "route", "gates"), SEP(r->pos_row, "route", "pos_row"), SEP(r->mod, "route", "mod");
    const void *outs[] = {o->expert, o->slot, o->token, o->weight, o->count, o->wanted, o->dropped, o->row_token,
                          o->row_expert, o->tok_rows, o->tok_off, o->expert_off, o->work};
    for (size_t i = 0; i < sizeof(outs) / sizeof(outs[0]); i++) SEP(outs[i], "route", "an output array");
    return sep_cpu->route(sep_cpu, gates, r, o);
}
// sep_no_route 1: the table says it cannot route, so the MoE layer takes its host path (the
// gates downloaded, route.c on the host, the layout uploaded): the reference the route op must equal
static int sep_no_route;
// sep_fixed 1: the table wants the fixed-capacity layout in training (be_route.fixed), as the
// CUDA table does; the CPU table under it writes that layout when asked
static int sep_fixed;
static int sep_supports(const sep_be *be, be_op op, const void *cfg) {
    if (op == BE_OP_ROUTE && sep_no_route) return 0;
    if (op == BE_OP_ROUTE && cfg && ((const be_route *)cfg)->fixed) return sep_fixed;
    return sep_cpu->supports(sep_cpu, op, cfg);
}

// The checking table; resets the stray count (the allocations are tracked across tables).
static vlmoe_backend_f32 sep_table(void) {
    sep_cpu = backend_cpu_f32();
    vlmoe_backend_f32 t = *sep_cpu;
    t.name = "cpu-separate", t.host_memory = 0;
    t.alloc = sep_alloc, t.free = sep_free, t.upload = sep_upload, t.download = sep_download;
    t.upload_bytes = sep_upload_bytes, t.zero = sep_zero, t.copy = sep_copy, t.add = sep_add, t.scale = sep_scale;
    t.linear_forward = sep_linear_f, t.linear_backward = sep_linear_b, t.linear_backward_write = sep_linear_bw;
    t.layernorm_forward = sep_ln_f, t.layernorm_recompute = sep_ln_r, t.layernorm_backward = sep_ln_b;
    t.act_forward = sep_act_f, t.act_backward = sep_act_b, t.softmax_forward = sep_softmax_f;
    t.softmax_backward = sep_softmax_b, t.attention_forward = sep_attn_f, t.attention_backward = sep_attn_b;
    t.patchify_forward = sep_patch_f, t.patchify_backward = sep_patch_b, t.embed_forward = sep_embed_f;
    t.embed_backward = sep_embed_b, t.posadd_forward = sep_posadd_f, t.posadd_backward = sep_posadd_b;
    t.cls_forward = sep_cls_f, t.cls_backward = sep_cls_b, t.pool_forward = sep_pool_f, t.pool_backward = sep_pool_b;
    t.l2norm_forward = sep_l2_f, t.l2norm_backward = sep_l2_b, t.contrastive_forward = sep_con_f;
    t.contrastive_backward = sep_con_b, t.xent_forward = sep_xent_f, t.xent_backward = sep_xent_b;
    t.gather_rows = sep_gather, t.combine_forward = sep_comb_f, t.combine_backward = sep_comb_b;
    t.gather_rows_backward = sep_gather_b, t.combine_weights = sep_cw_f, t.combine_weights_backward = sep_cw_b;
    t.router_noise = sep_noise, t.aux_loss = sep_aux, t.soft_moe_forward = sep_soft_f, t.soft_moe_backward = sep_soft_b;
    t.experts_forward = sep_exp_f, t.experts_backward = sep_exp_b, t.experts_backward_write = sep_exp_bw;
    t.sumsq = sep_sumsq, t.adamw = sep_adamw, t.clamp = sep_clamp;
    t.pixels_stage = sep_pixels_stage, t.pixels_normalize = sep_pixels_normalize;
    t.contrastive_forward_dev = sep_con_f_dev, t.sumsq_dev = sep_sumsq_dev;
    t.download_bytes = sep_download_bytes, t.route = sep_route, t.supports = sep_supports;
    t.aux_loss_dev = sep_aux_dev, t.sync = sep_sync, t.host_alloc = sep_host_alloc, t.host_free = sep_host_free;
    sep_stray = 0, sep_first[0] = 0;
    memset(&sep_traffic, 0, sizeof(sep_traffic));
    return t;
}

#endif
