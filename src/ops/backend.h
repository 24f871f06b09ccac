// backend.h: the compute backend table (after ggml's backend interface). Every kernel the model
// code runs on activations, parameters and gradients goes through one of these tables: memory
// (alloc, free, upload, download, zero, copy, sync), every op of src/ops/ops.h, the masked and
// contrastive losses, the MoE dispatch (row gather, combine and their backward, router noise,
// combine weights), the Soft MoE group kernels and the trainer's flat-buffer ops (sum of squares
// with a finite check, scale, the AdamW update, clamp). Pointers given to a table are its own
// memory ("device pointers"); the host reads them only through download. `supports` lets a
// backend refuse an op, or one configuration of it, with an error naming the op.
//
// Tables: src/ops/backend_cpu.c (float and double, wrapping today's kernels; the double table is
// the reference build tests/test_backend_ops.c compares against) and src/cuda/ (built with
// `make CUDA=1`; a stub that says how to build it otherwise). Covered by tests/test_backend_ops.c.
#ifndef VLMOE_OPS_BACKEND_H
#define VLMOE_OPS_BACKEND_H
#include <stddef.h>
#include <stdint.h>

#include "moe/aux.h"
#include "moe/soft.h"
#include "ops/gemm_int8.h"
#include "ops/ops.h"

// Every entry of the table that computes, by name (append-only: the test prints these).
typedef enum {
    BE_OP_LINEAR, BE_OP_LAYERNORM, BE_OP_ACT, BE_OP_SOFTMAX, BE_OP_ATTENTION, BE_OP_PATCHIFY,
    BE_OP_EMBED, BE_OP_POSADD, BE_OP_CLS, BE_OP_POOL, BE_OP_L2NORM, BE_OP_CONTRASTIVE, BE_OP_XENT,
    BE_OP_GATHER_ROWS, BE_OP_COMBINE, BE_OP_COMBINE_WEIGHTS, BE_OP_ROUTER_NOISE, BE_OP_AUX_LOSS,
    BE_OP_SOFT_MOE, BE_OP_EXPERTS, BE_OP_SUMSQ, BE_OP_SCALE, BE_OP_ADAMW, BE_OP_CLAMP,
    BE_OP_PIXELS, BE_OP_STEP_SCALARS,
    BE_OP_ROUTE,
    BE_OP_COUNT
} be_op;
const char *be_op_name(be_op op);

// The scalars of one AdamW update (torch.optim.AdamW's order of operations, src/optim/optim.c).
typedef struct {
    float b1, b2, ab1, ab2;  // beta1, beta2, 1-beta1, 1-beta2 (as floats)
    float neg_step;          // -lr / (1 - beta1^t)
    float bc2_sqrt;          // sqrt(1 - beta2^t)
    float eps;
    float shrink;            // 1 - lr*weight_decay, applied when decay is set
    int decay;
    float gscale;            // the gradient read is g * gscale (clipping's factor; 1: g's bits)
} be_adamw;

// One MoE dispatch: rows ordered by expert; row r holds token row_token[r] for expert
// row_expert[r]; token t's rows are tok_rows[tok_off[t] .. tok_off[t+1]) in row order.
typedef struct {
    int n, rows, E;
    const int32_t *row_token, *row_expert, *tok_off, *tok_rows;
} be_dispatch;

// A bank of E two-layer MLPs (w1 (E,M,D), b1 (E,M), w2 (E,D,M), b2 (E,D): PyTorch's Linear
// layout, experts stacked) over rows packed by expert: expert e owns rows [off[e], off[e+1]).
// A dense MLP is the bank of one expert. off is host memory (the counts are known on the host
// after routing).
typedef struct {
    int E, D, M, act;
    const int32_t *off;      // (E+1)
} be_experts;

// Counter-based router noise: noise(key, e) = (sigma) N(0,1) from splitmix64 of
// (seed, key[t], e) through Box-Muller, so a token's noise depends only on who it is, never on
// the order the tokens are visited in (src/moe/layer.c builds the keys).
typedef struct {
    uint64_t seed;
    double sigma;
    const uint64_t *key;     // (n) one key per token
} be_noise;

// A batch of 8-bit images and their normalisation (OpenCLIP's --image-mean/--image-std):
// pixels_normalize writes out (B,C,H,W) = ((float)v / 255 - mean[c]) / std[c], in float32 in
// that order, as torchvision's ToTensor + Normalize and src/data/image.c's host path do. The
// pixels are (B,H,W,C) when hwc (the loader's: its flip already applied), else (B,C,H,W).
#define BE_PIXELS_MAX_C 4
typedef struct {
    int B, C, H, W, hwc;
    float mean[BE_PIXELS_MAX_C], std[BE_PIXELS_MAX_C];
} be_pixels;

// One routing call: the decision of G groups of S tokens each (src/moe/route.c per group), then
// the packed row layout of be_dispatch, all where the table's memory is. Position p = g*S + i of
// the group-major order reads activation row pos_row[p] (NULL: row p). The gate route.c sees for
// (p, e) is (float)gates[row, e], or -1 where expert e is pruned (bit e of pruned) or outside the
// pool of the position's modality (pools set: mod[p] picks pool[mod][0] .. + pool[mod][1]),
// exactly as src/moe/layer.c masks them. This struct is also the `supports` cfg of BE_OP_ROUTE.
typedef struct {
    int n, S, G, E;
    int K;                   // top_k (tokens choice); the per-token arrays' width (experts choice: 1)
    int C;                   // capacity per expert and group (vlmoe_capacity)
    int experts_choice;      // 1: each expert takes its top-C tokens (vlmoe_route_experts_choice)
    int order, bpr_score, gate_renorm; // VLMOE_ORDER_*, VLMOE_BPR_*, VLMOE_RENORM_* (tokens choice)
    uint64_t seed;           // VLMOE_ORDER_RANDOM: group g uses seed + 0x9e3779b97f4a7c15 (g+1)
    uint64_t pruned;         // experts never picked (router_pred pruning)
    int pools;               // disjoint expert pools per modality (LIMoE E.3 text_experts)
    int pool[2][2];          // {first expert, experts} of the image and the text pool
    const int32_t *pos_row;  // (n) table memory, or NULL
    const uint8_t *mod;      // (n) modality by position (table memory), or NULL: all images
    // 1: the fixed-capacity layout instead of the packed one: expert e owns rows
    // [e G C, (e+1) G C), row e G C + g C + slot; an empty slot is a padding row (row_token -1,
    // row_expert e) that gather_rows zeroes and tok_rows never lists, so expert_off is e G C,
    // known on the host without a download. As the `supports` cfg: 1 when the table wants it in
    // training (the CUDA table: one strided-batched product per layer); the CPU tables write it
    // when asked but say no (padding rows cost CPU time).
    int fixed;
} be_route;

// What be_route writes (table memory). The per-group arrays are vlmoe_routing's, group g's at
// g times their size, with this call's S and C as strides. rows_max bounds the packed rows.
typedef struct {
    int32_t *expert, *slot;  // (G,S,K) each choice's expert and slot (-1: dropped; experts choice: -1)
    int32_t *token;          // (G,E,C) the token (in-group index) in each slot, -1 if empty
    float *weight;           // (G,E,C) combine weight of each filled slot, 0 if empty
    int32_t *count;          // (G,E) accepted assignments
    int32_t *wanted;         // (G,3,E) assignments before capacity: all, then the image and the
                             // text positions' (tokens choice; zeros with experts choice)
    uint8_t *dropped;        // (G,S) 1 when every assignment of the token was dropped
    int32_t *row_token, *row_expert, *tok_rows; // (rows_max) be_dispatch's arrays; rows ordered
                             // by expert, then group, then slot (be_route.fixed: G E C rows)
    int32_t *tok_off;        // (n+1) be_dispatch's, by activation row
    int32_t *expert_off;     // (E+1) expert e owns rows [expert_off[e], expert_off[e+1])
    int rows_max;
    void *work;              // be_route_work_bytes(S, E) of table memory: the CPU tables' scratch
                             // (a device table may keep its own and leave this unread)
} be_route_out;
static inline size_t be_route_work_bytes(int S, int E) {
    return sizeof(float) * (size_t)S * (size_t)E + 2 * sizeof(int32_t) * (size_t)S;
}

#define BACKEND_DECL(T, S)                                                                       \
    typedef struct vlmoe_backend_##S vlmoe_backend_##S;                                          \
    struct vlmoe_backend_##S {                                                                   \
        const char *name;                                                                        \
        void *ctx;                                                                               \
        /* 1 when the table's memory is the host's: callers may hand it host arrays as they are */ \
        int host_memory;                                                                         \
        /* the same table with every product in full precision, for what must stay so (the */  \
        /* router); NULL when this table is that already (src/ops/backend_cpu.c's cpu-bf16) */  \
        const struct vlmoe_backend_##S *fp32;                                                    \
        /* 1 when the backend can run op with this configuration (cfg: the op's own struct, */   \
        /* or NULL for "at all") */                                                              \
        int (*supports)(const vlmoe_backend_##S *be, be_op op, const void *cfg);                 \
        /* memory: alloc counts bytes (zeroed), the others elements of T; free(NULL) is safe */   \
        void *(*alloc)(const vlmoe_backend_##S *be, size_t bytes, const char *what);             \
        void (*free)(const vlmoe_backend_##S *be, void *p);                                      \
        void (*upload)(const vlmoe_backend_##S *be, T *dst, const T *host, size_t n);            \
        void (*download)(const vlmoe_backend_##S *be, T *host, const T *src, size_t n);          \
        void (*upload_bytes)(const vlmoe_backend_##S *be, void *dst, const void *host, size_t n); \
        void (*zero)(const vlmoe_backend_##S *be, T *p, size_t n);                               \
        void (*copy)(const vlmoe_backend_##S *be, T *dst, const T *src, size_t n);               \
        void (*add)(const vlmoe_backend_##S *be, T *dst, const T *src, size_t n); /* dst += src */\
        int (*sync)(const vlmoe_backend_##S *be);                                                \
        /* the ops of src/ops/ops.h, same arguments after be */                                  \
        void (*linear_forward)(const vlmoe_backend_##S *be, T *out, const T *inp, const T *w,    \
                               const T *b, int N, int K, int O, int beta);                       \
        void (*linear_backward)(const vlmoe_backend_##S *be, T *dinp, T *dw, T *db,              \
                                const T *dout, const T *inp, const T *w, int N, int K, int O);   \
        /* linear_backward writing dinp, never reading it (ops.h); NULL in a table that lacks  */ \
        /* it: the caller then zeroes dinp and accumulates (src/nn/block.c, lin_bwd_write)     */ \
        void (*linear_backward_write)(const vlmoe_backend_##S *be, T *dinp, T *dw, T *db,        \
                                      const T *dout, const T *inp, const T *w, int N, int K, int O); \
        void (*layernorm_forward)(const vlmoe_backend_##S *be, T *out, T *mean, T *rstd,         \
                                  const T *inp, const T *w, const T *b, int N, int C, double eps); \
        void (*layernorm_recompute)(const vlmoe_backend_##S *be, T *out, const T *inp,           \
                                    const T *w, const T *b, const T *mean, const T *rstd, int N,  \
                                    int C);                                                      \
        void (*layernorm_backward)(const vlmoe_backend_##S *be, T *dinp, T *dw, T *db,           \
                                   const T *dout, const T *inp, const T *w, const T *mean,        \
                                   const T *rstd, int N, int C);                                  \
        void (*act_forward)(const vlmoe_backend_##S *be, T *out, const T *inp, size_t n, int kind); \
        void (*act_backward)(const vlmoe_backend_##S *be, T *dinp, const T *inp, const T *dout,  \
                             size_t n, int kind);                                                \
        void (*softmax_forward)(const vlmoe_backend_##S *be, T *out, const T *inp, int N, int C); \
        void (*softmax_backward)(const vlmoe_backend_##S *be, T *dinp, const T *out,             \
                                 const T *dout, int N, int C);                                   \
        void (*attention_forward)(const vlmoe_backend_##S *be, T *out, T *att, const T *qkv,     \
                                  const attn_segment *seg, int D, int H);                        \
        void (*attention_backward)(const vlmoe_backend_##S *be, T *dqkv, T *datt, const T *dout, \
                                   const T *qkv, const T *att, const attn_segment *seg, int D,    \
                                   int H);                                                       \
        void (*patchify_forward)(const vlmoe_backend_##S *be, T *patches, const T *images, int B, \
                                 int C, int HW, int P);                                          \
        void (*patchify_backward)(const vlmoe_backend_##S *be, T *dimages, const T *dpatches,    \
                                  int B, int C, int HW, int P);                                  \
        void (*embed_forward)(const vlmoe_backend_##S *be, T *out, const int32_t *ids,           \
                              const T *wte, int BT, int D);                                      \
        void (*embed_backward)(const vlmoe_backend_##S *be, T *dwte, const T *dout,              \
                               const int32_t *ids, int BT, int D);                               \
        void (*posadd_forward)(const vlmoe_backend_##S *be, T *out, const T *pos, int B, int T_, \
                               int D);                                                           \
        void (*posadd_backward)(const vlmoe_backend_##S *be, T *dpos, const T *dout, int B,      \
                                int T_, int D);                                                  \
        void (*cls_forward)(const vlmoe_backend_##S *be, T *out, const T *cls, const T *x, int B, \
                            int N, int D);                                                       \
        void (*cls_backward)(const vlmoe_backend_##S *be, T *dcls, T *dx, const T *dout, int B,  \
                             int N, int D);                                                      \
        void (*pool_forward)(const vlmoe_backend_##S *be, T *out, const T *x,                    \
                             const int32_t *lens, int B, int T_, int D, int kind);               \
        void (*pool_backward)(const vlmoe_backend_##S *be, T *dx, const T *dout,                 \
                              const int32_t *lens, int B, int T_, int D, int kind);              \
        void (*l2norm_forward)(const vlmoe_backend_##S *be, T *out, T *norm, const T *x, int N,  \
                               int C);                                                           \
        void (*l2norm_backward)(const vlmoe_backend_##S *be, T *dx, const T *dout, const T *out, \
                                const T *norm, int N, int C);                                    \
        double (*contrastive_forward)(const vlmoe_backend_##S *be, T *logits, T *prow, T *pcol,  \
                                      const T *img, const T *txt, T scale, int B, int E,          \
                                      double *acc);                                              \
        void (*contrastive_backward)(const vlmoe_backend_##S *be, T *dimg, T *dtxt, T *dscale,   \
                                     const T *logits, const T *prow, const T *pcol, const T *img, \
                                     const T *txt, T scale, int B, int E, double dloss);         \
        /* masked modeling cross-entropy (src/loss/masked.h) */                                 \
        double (*xent_forward)(const vlmoe_backend_##S *be, T *probs, const T *logits,           \
                               const int32_t *labels, int n, int C, int *correct);               \
        void (*xent_backward)(const vlmoe_backend_##S *be, T *dlogits, const T *probs,           \
                              const int32_t *labels, int n, int C, double scale);                \
        /* MoE dispatch. gather_rows: dst (rows,D) row r = src row idx[r], zeros where idx[r] */ \
        /* is -1 (a padding row of the fixed layout, be_route.fixed). A padding row (row_token */ \
        /* -1) gets w 0 from combine_weights and dy 0, dw 0 from combine_backward; tok_rows */   \
        /* never lists one, so combine_forward and gather_rows_backward do not read it. */       \
        void (*gather_rows)(const vlmoe_backend_##S *be, T *dst, const T *src,                   \
                            const int32_t *idx, int rows, int D);                                \
        /* out (n,D) += sum over token t's rows of w[r] y[r] (rows in row order) */              \
        void (*combine_forward)(const vlmoe_backend_##S *be, T *out, const T *y, const T *w,     \
                                const be_dispatch *d, int D);                                    \
        /* dy (rows,D) = w[r] dout[token]; dw[r] = dout[token].y[r]; then, when dx is given, */ \
        /* dx[t] += the sum of dxp over token t's rows: the backward of gather_rows */           \
        void (*combine_backward)(const vlmoe_backend_##S *be, T *dy, T *dw, const T *dout,       \
                                 const T *y, const T *w, const be_dispatch *d, int D);           \
        void (*gather_rows_backward)(const vlmoe_backend_##S *be, T *dx, const T *dxp,           \
                                     const be_dispatch *d, int D);                               \
        /* w[r] = gates[token, expert] (renorm: divided by zsum[t], the sum of the token's */    \
        /* accepted gates, written to zsum) */                                                   \
        void (*combine_weights)(const vlmoe_backend_##S *be, T *w, T *zsum, const T *gates,      \
                                const be_dispatch *d, int renorm);                               \
        /* dgates (n,E) += the gradient of the combine weights dw (rows) */                     \
        void (*combine_weights_backward)(const vlmoe_backend_##S *be, T *dgates, const T *dw,    \
                                         const T *gates, const T *zsum, const be_dispatch *d,     \
                                         int renorm);                                            \
        /* noisy (n,E) = logits + noise (be_noise) */                                            \
        void (*router_noise)(const vlmoe_backend_##S *be, T *noisy, const T *logits, int n,      \
                             int E, const be_noise *nz);                                         \
        /* the auxiliary losses of one group (src/moe/aux.h). With dlogits (the backward) the */ \
        /* value goes unused (the forward computed it): a table may return 0 without waiting */  \
        double (*aux_loss)(const vlmoe_backend_##S *be, vlmoe_aux_kind kind,                     \
                           const aux_input_##S *in, double weight, T *dlogits, T *scratch);      \
        /* one Soft MoE group (src/moe/soft.h) */                                                \
        void (*soft_moe_forward)(const vlmoe_backend_##S *be, T *out, T *acts, const T *x,       \
                                 const soft_params_##S *p, const soft_dims *d);                  \
        void (*soft_moe_backward)(const vlmoe_backend_##S *be, T *dx, const soft_grads_##S *g,   \
                                  const T *dout, const T *acts, const T *x,                       \
                                  const soft_params_##S *p, const soft_dims *d, T *scratch);      \
        /* the expert bank (be_experts): h (rows,M) = x.w1^T + b1 (saved); a (rows,M) =      */ \
        /* act(h) (scratch); y (rows,D) = a.w2^T + b2, written (beta 0) or added (beta 1)     */ \
        void (*experts_forward)(const vlmoe_backend_##S *be, T *y, T *h, T *a, const T *x,       \
                                const T *const w[4], const be_experts *ex, int beta);            \
        /* dx (rows,D) and the gradients dw {dw1, db1, dw2, db2} ACCUMULATE; dy (rows,D); h and */\
        /* x from the forward; da, dh (rows,M) scratch */                                        \
        void (*experts_backward)(const vlmoe_backend_##S *be, T *dx, T *const dw[4],             \
                                 const T *dy, const T *x, const T *h, const T *const w[4],        \
                                 T *da, T *dh, const be_experts *ex);                            \
        /* the same, but dx's rows [off[0], off[E]) are written, never read (the experts'      */ \
        /* linear_backward_write), the others left alone: for dx's first writer (a dense MLP's */ \
        /* dln in src/nn/block.c). NULL in a table without it: the caller zeroes, accumulates */ \
        void (*experts_backward_write)(const vlmoe_backend_##S *be, T *dx, T *const dw[4],       \
                                       const T *dy, const T *x, const T *h, const T *const w[4],  \
                                       T *da, T *dh, const be_experts *ex);                      \
        /* trainer: sum of squares in a fixed chunk order (any thread count gives the same */    \
        /* bits); *nonfinite set to 1 when an element is NaN or infinite */                      \
        double (*sumsq)(const vlmoe_backend_##S *be, const T *x, size_t n, int *nonfinite);      \
        void (*scale)(const vlmoe_backend_##S *be, T *x, size_t n, float s);                     \
        void (*adamw)(const vlmoe_backend_##S *be, T *p, T *m, T *v, const T *g, size_t n,       \
                      const be_adamw *a);                                                        \
        void (*clamp)(const vlmoe_backend_##S *be, T *x, size_t n, double lo, double hi);        \
        /* images as bytes (be_pixels). pixels_stage hands the table a batch's n bytes from the */ \
        /* host and returns the table's memory holding them (a host table: host itself; CUDA: */  \
        /* pinned staging and a copy stream, double-buffered), NULL with the error set on a   */  \
        /* failure; host NULL plans room for n bytes without copying. The bytes stay valid    */  \
        /* for the next pixels_normalize and one stage more, so batch i+1 may be staged while */  \
        /* step i runs. pixels_normalize reads staged bytes (orders itself after their copy). */  \
        const uint8_t *(*pixels_stage)(const vlmoe_backend_##S *be, const uint8_t *host, size_t n); \
        void (*pixels_normalize)(const vlmoe_backend_##S *be, T *out, const uint8_t *pix,        \
                                 const be_pixels *p);                                            \
        /* The step's scalars left in the table's memory (out: doubles from alloc), so that a   */ \
        /* device step ends in one download (src/nn/towers_model.c): contrastive_forward's   */   \
        /* values as out[0] loss, out[1] acc_i2t, out[2] acc_t2i; sumsq's as out[0] the sum, */   \
        /* out[1] 1.0 when an element is not finite (else 0.0). The same bits as the returns. */ \
        void (*contrastive_forward_dev)(const vlmoe_backend_##S *be, T *logits, T *prow, T *pcol, \
                                        const T *img, const T *txt, T scale, int B, int E,       \
                                        double *out);                                            \
        void (*sumsq_dev)(const vlmoe_backend_##S *be, const T *x, size_t n, double *out);       \
        /* device -> host of n bytes (the routing decision's integers), waits like download */  \
        void (*download_bytes)(const vlmoe_backend_##S *be, void *host, const void *src, size_t n); \
        /* the routing decision and packed layout (be_route); VLMOE_OK, or an error such as   */ \
        /* route.c's for non-finite gates (a device table may report none: see docs/GPU.md) */  \
        int (*route)(const vlmoe_backend_##S *be, const T *gates, const be_route *r,             \
                     const be_route_out *o);                                                     \
        /* aux_loss's forward value (weight 1, no gradient) left in out (one double of the    */ \
        /* table's memory), the same bits as aux_loss returns, so a device step does not wait  */ \
        /* per MoE layer, loss and group (src/moe/layer.c). A modality that is neither image */   \
        /* nor text gives NaN there (aux_loss's error, found by the step's finite check). */       \
        void (*aux_loss_dev)(const vlmoe_backend_##S *be, vlmoe_aux_kind kind,                   \
                             const aux_input_##S *in, T *scratch, double *out);                  \
        /* contrastive_forward_dev and contrastive_backward with the logit scale read from the */ \
        /* table's memory (scale: one element, the parameter itself), so that a device step   */   \
        /* need not download it; out[3] = the scale read (the logged temperature's). The CPU  */   \
        /* tables: the same bits as the by-value entries. */                                      \
        void (*contrastive_forward_dsc)(const vlmoe_backend_##S *be, T *logits, T *prow, T *pcol, \
                                        const T *img, const T *txt, const T *scale, int B, int E, \
                                        double *out);                                            \
        void (*contrastive_backward_dsc)(const vlmoe_backend_##S *be, T *dimg, T *dtxt, T *dscale, \
                                         const T *logits, const T *prow, const T *pcol,          \
                                         const T *img, const T *txt, const T *scale, int B, int E, \
                                         double dloss);                                          \
        /* host memory the table copies from without staging (CUDA: page-locked), zeroed; NULL */ \
        /* with the error set. What a layer uploads every step lives there, at addresses fixed  */ \
        /* at creation, so that a captured CUDA graph's copies replay from the same pointers.  */  \
        /* Its contents must not change while an upload from it may be in flight: each step   */  \
        /* ends in a download that waits for the stream before the next step writes them.     */  \
        void *(*host_alloc)(const vlmoe_backend_##S *be, size_t bytes, const char *what);        \
        void (*host_free)(const vlmoe_backend_##S *be, void *p);                                  \
    };                                                                                           \
    /* the CPU table (process-wide constant) */                                                  \
    const vlmoe_backend_##S *backend_cpu_##S(void);                                              \
    /* VLMOE_OK when be supports op with cfg, else an error naming the backend and the op */     \
    int backend_require_##S(const vlmoe_backend_##S *be, be_op op, const void *cfg);

BACKEND_DECL(float, f32)
BACKEND_DECL(double, f64)

// The CPU table of `--precision bf16`: products in bf16 (src/ops/gemm_bf16.h), the rest fp32.
const vlmoe_backend_f32 *backend_cpu_bf16(void);
// The CPU table of `--precision int8` (inference): the expert banks' products in int8 from the
// quantized weights w (src/ops/gemm_int8.h), which must outlive the table; the rest fp32.
// Fills *table (a table per model: the weights are the model's).
void backend_cpu_int8(vlmoe_backend_f32 *table, const int8_weights *w);

// The CUDA table: VLMOE_OK and *out set on a machine with a device and a `make CUDA=1` build;
// otherwise an error saying why (src/cuda/). device: the CUDA ordinal. backend_cuda_free(NULL)
// is safe.
int backend_cuda_init(vlmoe_backend_f32 **out, int device);
void backend_cuda_free(vlmoe_backend_f32 *be);

// The bf16 twin of a CUDA table (`--precision bf16 --device cuda`, src/cuda/bf16_cuda.cu): the
// products of linear layers and experts in bf16 as the cpu-bf16 table does, everything else the
// fp32 table's; its fp32 field is that table. It shares cuda's context and memory and is freed
// with it (backend_cuda_free of either table frees both); *out = the twin when cuda is it already.
int backend_cuda_bf16(const vlmoe_backend_f32 **out, const vlmoe_backend_f32 *cuda);

// Picks a table by name: "cpu", "cuda" or "cuda:N".
int backend_by_name(const vlmoe_backend_f32 **out, vlmoe_backend_f32 **owned, const char *name);

#endif
