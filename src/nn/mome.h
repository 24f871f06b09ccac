// mome.h: VL-MoE's MoME transformer (VL-MoE sec. 3.2; VLMo's mixture-of-modality-experts):
// shared self-attention, a feed-forward chosen by modality (V-FFN, T-FFN, VL-FFN in the top
// vl_layers blocks for pairs), V-FFN/T-FFN of chosen lower blocks as MoE layers, the MLM and MIM
// heads. The layout and the model entry points are in mome_model.c, the float/double graph in
// mome.c. Covered by tests/test_mome.c (finite differences) and tests/test_parity.c (PyTorch).
#ifndef VLMOE_MOME_H
#define VLMOE_MOME_H
#include "nn/model.h"

enum { MOME_V = 0, MOME_T = 1, MOME_VL = 2, MOME_NFFN = 3 };

// One modality expert of a block: its own pre-LayerNorm (VLMo's norm2_imag/_text/_vl) and a
// dense MLP or an MoE layer.
typedef struct {
    size_t ln_w, ln_b;              // NO_PARAM: this block has no such expert (VL below the top F)
    ffn_layout ffn;
    const vlmoe_moe_config *moe;    // the MoE layer's config (points into the layout's config)
} mome_ffn;

// The shared parts live in the ordinary layout: L->enc[0] (attention of every block, final
// LayerNorm; ln2 and ffn unused), L->mod[MOD_IMAGE] (patch embedding, [I_CLS] as class token,
// position embeddings of 1 + patches), L->mod[MOD_TEXT] (token and position embeddings).
typedef struct mome_layout {
    mome_ffn *ffn;                  // (layers, MOME_NFFN)
    size_t mask_patch;              // (D) learned embedding of a masked patch (BEiT's mask token)
    size_t mlm_w, mlm_b;            // (vocab, D), (vocab)
    size_t mim_w, mim_b;            // (mim_vocab, D), (mim_vocab)
    size_t cls_w, cls_b;            // (num_classes, cs*D), (num_classes); NO_PARAM without a head
    int cs;                         // sequences per example of the head: 1, or 2 (NLVR2)
    size_t itc_proj[2];             // (embed_dim, D) projections of the image [I_CLS] and the text
                                    // [T_CLS] features (retrieval head; NO_PARAM without), and
                                    // model_layout.logit_scale
    size_t itm_w, itm_b;            // (2, D), (2) the ITM head on a pair's fused [T_CLS]
                                    // (class 1 = matched); NO_PARAM without
    int np, pd;                     // patches per image, values per patch
    int Ti, Tt;                     // image sequence (1 + np), text sequence (context_length)
} mome_layout;

int mome_layout_build(model_layout *L, const vlmoe_model_config *cfg);
// Plans the model's mome graph for batch size B (once; again only if B changes).
int mome_model_plan(vlmoe_model *m, int B);
// The graph mome_model_plan planned (src/nn/mome_caption.c decodes with it).
struct mome_graph_f32 *mome_model_graph(vlmoe_model *m);

#define MOME_DECL(T, S)                                                                          \
    typedef struct mome_graph_##S mome_graph_##S;                                                 \
    typedef struct {                                                                              \
        int encoding;                /* VLMOE_ENC_* */                                            \
        const T *images;             /* (B,C,H,W) */                                              \
        const int32_t *tokens, *lens; /* (B,Tt), (B) */                                            \
        const int32_t *text_labels;  /* (B,Tt), -1: no prediction; NULL: none */                  \
        const int32_t *patch_labels; /* (B,np), >= 0: masked patch and its target; NULL: none */   \
        const int32_t *class_labels; /* (B) classes for the fine-tuning head; NULL: none */        \
    } mome_input_##S;                                                                             \
    int mome_graph_create_##S(mome_graph_##S **out, const model_layout *L,                       \
                              const vlmoe_backend_##S *be, int B);                               \
    void mome_graph_free_##S(mome_graph_##S *g);                                                  \
    void mome_graph_set_mode_##S(mome_graph_##S *g, int training, uint64_t seed);                 \
    /* data parallelism: the global index of the batch's first sequence, which keys every */     \
    /* token's routing noise (0 at creation) */                                                  \
    void mome_graph_set_sample_base_##S(mome_graph_##S *g, uint64_t base);                        \
    /* the divisors of the MLM and MIM heads' summed cross-entropy in the next forwards (0: */   \
    /* the forward's own labelled count, a mean): data parallelism divides by the global count */ \
    void mome_graph_set_norm_##S(mome_graph_##S *g, double text, double image);                   \
    /* tests: the additive router noise (n,E) of MoE layer `index` in the next forwards, in */    \
    /* place of drawing it (NULL: draw again) */                                                 \
    void mome_graph_set_noise_##S(mome_graph_##S *g, int index, const double *noise);             \
    /* stochastic depth (BEiT's drop path) of training forwards: rate of the last block, */       \
    /* rising linearly from 0 at the first (0: none) */                                          \
    void mome_graph_set_drop_path_##S(mome_graph_##S *g, double rate);                            \
    /* tests: (layers, 2, B) which attention (0) and feed-forward (1) branches of each sample */  \
    /* training forwards keep, in place of drawing (NULL: draw) */                               \
    void mome_graph_set_drop_keep_##S(mome_graph_##S *g, const uint8_t *keep);                    \
    /* (layers, 2, B) the last forward's branch factors, 0 or 1/(1-rate); NULL: none dropped */   \
    const double *mome_graph_drop_factors_##S(const mome_graph_##S *g);                           \
    int mome_graph_forward_##S(mome_graph_##S *g, const T *P, const mome_input_##S *in,          \
                               vlmoe_mome_stats *res);                                            \
    /* accumulates d(loss)/d(params) of the last forward into G (the caller zeroes) */           \
    void mome_graph_backward_##S(mome_graph_##S *g, const T *P, T *G);                            \
    /* (B, seq, D) final hidden states of the last forward; *seq gets the sequence length */     \
    const T *mome_graph_hidden_##S(const mome_graph_##S *g, int *seq);                            \
    /* (count, vocab) MLM softmax of the last forward's labelled text positions, in the order */ \
    /* of the positions (sequence, then position): what caption decoding reads */                \
    const T *mome_graph_text_probs_##S(const mome_graph_##S *g, int *count);                      \
    /* (B/cs, num_classes) class scores of the last forward (NULL without a head) */            \
    const T *mome_graph_logits_##S(const mome_graph_##S *g);                                      \
    const vlmoe_moe_stats *mome_graph_moe_stats_##S(const mome_graph_##S *g, int *count);         \
    /* The retrieval feature of sequence b of the last forward: the final [I_CLS] (image) or */   \
    /* [T_CLS] (text, pair) feature (D) */                                                       \
    const T *mome_graph_feature_##S(const mome_graph_##S *g, int b);                               \
    /* (B,D) d(loss)/d(feature) of an outside loss, added in the next backward (NULL: none) */    \
    void mome_graph_set_feature_grad_##S(mome_graph_##S *g, const T *dfeat);                      \
    /* The retrieval head (contrastive fine-tuning, VL-MoE sec. 4.2 / VLMo): the [I_CLS] of an */ \
    /* image forward and the [T_CLS] of a text forward of the same B, each projected to */        \
    /* embed_dim and L2-normalised; the symmetric contrastive loss of src/loss/contrastive.c. */  \
    typedef struct mome_itc_##S mome_itc_##S;                                                     \
    int mome_itc_create_##S(mome_itc_##S **out, const model_layout *L,                           \
                            const vlmoe_backend_##S *be, int B);                                 \
    void mome_itc_free_##S(mome_itc_##S *c);                                                      \
    /* (B, embed_dim) embeddings of g's last forward (which: 0 its [I_CLS], 1 its [T_CLS]) */     \
    const T *mome_itc_embed_##S(mome_itc_##S *c, const mome_graph_##S *g, const T *P, int which);  \
    /* the contrastive loss of gi (images) against gt (texts); acc: i2t and t2i top-1 */          \
    double mome_itc_forward_##S(mome_itc_##S *c, const mome_graph_##S *gi, const mome_graph_##S *gt, \
                                const T *P, double *acc);                                         \
    /* accumulates into G the gradient of the contrastive loss plus both graphs' own losses */   \
    void mome_itc_backward_##S(mome_itc_##S *c, mome_graph_##S *gi, mome_graph_##S *gt, const T *P, T *G);   \
    /* (B, embed_dim) the normalised embeddings of the last mome_itc_forward (0 images, 1 texts) */ \
    const T *mome_itc_embedding_##S(const mome_itc_##S *c, int which);                               \
    /* The ITM head (src/nn/mome_itm.c): a linear 2-way classifier on the fused [T_CLS] of each */  \
    /* of the n pairs of a pair graph, its mean softmax cross-entropy against labels (1 matched). */ \
    typedef struct mome_itm_##S mome_itm_##S;                                                     \
    int mome_itm_create_##S(mome_itm_##S **out, const model_layout *L, const vlmoe_backend_##S *be, int n); \
    void mome_itm_free_##S(mome_itm_##S *c);                                                      \
    /* the head's (n,2) logits of g's last pair forward; with labels (n) the loss (else 0), acc */ \
    /* its top-1 accuracy (may be NULL) */                                                       \
    double mome_itm_forward_##S(mome_itm_##S *c, const mome_graph_##S *g, const T *P, const int32_t *labels, \
                                double *acc);                                                     \
    const T *mome_itm_logits_##S(const mome_itm_##S *c);                                          \
    /* accumulates into G the gradient of the last forward's loss and g's own losses */           \
    void mome_itm_backward_##S(mome_itm_##S *c, mome_graph_##S *g, const T *P, T *G);

MOME_DECL(float, f32)
MOME_DECL(double, f64)

#endif
