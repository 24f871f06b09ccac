// ops.h: the CPU kernels of vlmoe, each a forward/backward pair (llm.c style: outputs first,
// a shape comment on every pointer). Backward functions ACCUMULATE (+=) into every gradient they
// produce; the caller zeroes. Pure functions: no allocation, no I/O. Compiled for float (_f32)
// and double (_f64), see src/core/real.h. Covered by tests/test_ops.c (finite differences in
// double) and tests/test_parity.c (PyTorch fixtures from tests/ref/gen_ops.py).
#ifndef VLMOE_OPS_H
#define VLMOE_OPS_H
#include <stddef.h>
#include <stdint.h>
#include "vlmoe.h"




// One run of same-length sequences inside a token buffer: attention stays inside a sequence.
// lens (nseq) gives each sequence's valid length (keys at positions >= len are masked); NULL
// means every position is valid. causal with a prefix is UniLM's / BEiT-3's captioning mask: the
// first `prefix` positions (the image of an image-text pair) attend to each other both ways,
// every later position to the whole prefix and causally to the positions after it up to itself.
typedef struct {
    size_t tok_off;      // first token of the segment in the (Ntok, ...) buffer
    int nseq, seqlen;
    int causal;
    const int32_t *lens;
    int prefix;          // causal only: positions [0, prefix) see all of [0, prefix) (0: plain causal)
} attn_segment;

#define OPS_DECL(T, S)                                                                             \
    /* out (N,O) = inp (N,K) . w^T (w: (O,K)) + b (O, may be NULL); beta 0 writes, 1 adds */     \
    void linear_forward_##S(T *out, const T *inp, const T *w, const T *b, int N, int K, int O,   \
                            int beta);                                                            \
    /* dinp (N,K) += dout.w (dinp may be NULL); dw += dout^T.inp; db += colsum(dout) */           \
    void linear_backward_##S(T *dinp, T *dw, T *db, const T *dout, const T *inp, const T *w,      \
                             int N, int K, int O);                                                \
    /* the same, but dinp (not NULL) = dout.w is written (beta 0): whatever dinp held, NaN   */   \
    /* included, is never read, so its first writer needs no zeroing; dw, db accumulate      */   \
    void linear_backward_write_##S(T *dinp, T *dw, T *db, const T *dout, const T *inp,           \
                                   const T *w, int N, int K, int O);                              \
    /* out (N,C) = (inp-mean)*rstd*w + b; mean, rstd (N) saved for backward */                     \
    void layernorm_forward_##S(T *out, T *mean, T *rstd, const T *inp, const T *w, const T *b,    \
                               int N, int C, double eps);                                         \
    /* out (N,C) again from the mean and rstd a forward saved: bit-identical to that forward */  \
    void layernorm_recompute_##S(T *out, const T *inp, const T *w, const T *b, const T *mean,     \
                                 const T *rstd, int N, int C);                                    \
    void layernorm_backward_##S(T *dinp, T *dw, T *db, const T *dout, const T *inp, const T *w,   \
                                const T *mean, const T *rstd, int N, int C);                      \
    void act_forward_##S(T *out, const T *inp, size_t n, int kind);                               \
    void act_backward_##S(T *dinp, const T *inp, const T *dout, size_t n, int kind);              \
    /* an MLP's first layer: h (N,O) = inp (N,K) . w^T + b (O) written, a (N,O) = act(h), the */  \
    /* bias and activation fused into the product's blocks (act_forward's bits for the same h) */ \
    void linear_act_forward_##S(T *h, T *a, const T *inp, const T *w, const T *b, int N, int K,   \
                                int O, int act);                                                  \
    /* the backward of linear(act(h)) with w (O,M): dh (N,M) = (dy.w) act'(h) WRITTEN; a (N,M) */ \
    /* = act(h) recomputed (scratch); dw (O,M) += dy^T.a; db (O, may be NULL) += colsum(dy) */    \
    void act_linear_backward_##S(T *dh, T *a, T *dw, T *db, const T *dy, const T *h, const T *w,  \
                                 int N, int M, int O, int act);                                   \
    /* row softmax: out (N,C) */                                                                   \
    void softmax_forward_##S(T *out, const T *inp, int N, int C);                                 \
    void softmax_backward_##S(T *dinp, const T *out, const T *dout, int N, int C);                \
    /* qkv (Ntok,3D) -> out (Ntok,D); att (nseq,H,T,T) probabilities of this segment; the       \
       backward WRITES the segment's rows of dqkv (no accumulation: no zeroing needed) */         \
    void attention_forward_##S(T *out, T *att, const T *qkv, const attn_segment *seg, int D,      \
                               int H);                                                            \
    void attention_backward_##S(T *dqkv, T *datt, const T *dout, const T *qkv, const T *att,      \
                                const attn_segment *seg, int D, int H);                           \
    /* the same by plain loops and sgemm: the fused float kernel's reference (attn_cpu.c) */     \
    void attention_forward_ref_##S(T *out, T *att, const T *qkv, const attn_segment *seg, int D,  \
                                   int H);                                                        \
    void attention_backward_ref_##S(T *dqkv, T *datt, const T *dout, const T *qkv, const T *att,  \
                                    const attn_segment *seg, int D, int H);                       \
    /* images (B,C,H,W) -> patches (B, (H/P)*(W/P), C*P*P), inner order (c, py, px) = conv */    \
    void patchify_forward_##S(T *patches, const T *images, int B, int C, int HW, int P);          \
    void patchify_backward_##S(T *dimages, const T *dpatches, int B, int C, int HW, int P);       \
    /* out (B,T,D) = wte[ids] (ids (B,T) in [0,V)) */                                              \
    void embed_forward_##S(T *out, const int32_t *ids, const T *wte, int BT, int D);              \
    void embed_backward_##S(T *dwte, const T *dout, const int32_t *ids, int BT, int D);           \
    /* out (B,T,D) += pos (T,D) */                                                                 \
    void posadd_forward_##S(T *out, const T *pos, int B, int T_, int D);                          \
    void posadd_backward_##S(T *dpos, const T *dout, int B, int T_, int D);                       \
    /* out (B,1+N,D) = [cls; x (B,N,D)] */                                                         \
    void cls_forward_##S(T *out, const T *cls, const T *x, int B, int N, int D);                  \
    void cls_backward_##S(T *dcls, T *dx, const T *dout, int B, int N, int D);                    \
    /* out (B,D) from x (B,T,D): mean over the first lens[b] tokens, token 0, or token lens[b]-1 */\
    void pool_forward_##S(T *out, const T *x, const int32_t *lens, int B, int T_, int D, int kind);\
    void pool_backward_##S(T *dx, const T *dout, const int32_t *lens, int B, int T_, int D,       \
                           int kind);                                                             \
    /* out (N,C) = x / max(|x|, 1e-12); norm (N) saved */                                          \
    void l2norm_forward_##S(T *out, T *norm, const T *x, int N, int C);                           \
    void l2norm_backward_##S(T *dx, const T *dout, const T *out, const T *norm, int N, int C);    \
    /* symmetric InfoNCE over logits = exp(scale) img.txt^T; logits/probs (B,B) saved. Returns */ \
    /* the loss; acc[0] image->text and acc[1] text->image top-1 accuracy */                       \
    double contrastive_forward_##S(T *logits, T *prow, T *pcol, const T *img, const T *txt,       \
                                   T scale, int B, int E, double *acc);                            \
    /* dimg, dtxt (B,E) and *dscale accumulate the gradient of loss*dloss */                       \
    void contrastive_backward_##S(T *dimg, T *dtxt, T *dscale, const T *logits, const T *prow,    \
                                  const T *pcol, const T *img, const T *txt, T scale, int B,       \
                                  int E, double dloss);

OPS_DECL(float, f32)
OPS_DECL(double, f64)

// linear_act_forward_f32 and act_linear_backward_f32 with the products in bf16 (`--precision
// bf16`, src/ops/gemm_bf16.h; the bias, activation and its derivative stay fp32). The backward
// rounds act(h) straight into dw's product (a, scratch, is then left unwritten).
void linear_act_forward_bf16(float *h, float *a, const float *inp, const float *w, const float *b, int N,
                             int K, int O, int act);
// y (N,D) = act(x.w1^T + b1).w2^T + b2 (w {w1, b1, w2, b2}; h as linear_act_forward's, a scratch,
// left unwritten unless the second product falls back; beta as linear_forward's): the two bf16
// products of an MLP, the second reading act(h) as the first's epilogue rounded it, never stored
// in fp32 (src/ops/ops.c); the bits of linear_act_forward_bf16 then linear_forward_bf16
void mlp_forward_bf16(float *y, float *h, float *a, const float *x, const float *const w[4], int N, int D, int M,
                      int act, int beta);
void act_linear_backward_bf16(float *dh, float *a, float *dw, float *db, const float *dy, const float *h,
                              const float *w, int N, int M, int O, int act);

#endif
