// block.h: the one pre-LayerNorm transformer block every architecture runs (ViT / CLIP / LIMoE
// towers in src/nn/graph.c, VL-MoE's MoME blocks in src/nn/mome.c): the attention half
// x + out(attn(qkv(ln1(x)))) over attention segments, then feed-forward parts, each
// out = x + ffn(ln(x)) over its own tokens with its own LayerNorm and a dense MLP (the expert
// bank of one expert) or an MoE layer (src/moe/layer.c). Forward and backward in src/nn/block.c;
// covered through the graphs by tests/test_model.c, tests/test_mome.c and tests/test_parity.c.
//
// Only for the files compiled twice: it is written against `real` (include core/real.h first),
// so R(block_forward) is block_forward_f32 or block_forward_f64.
#ifndef VLMOE_NN_BLOCK_H
#define VLMOE_NN_BLOCK_H
#ifndef VLMOE_REAL_H
#error "nn/block.h is written against real: include core/real.h first"
#endif
#include "moe/layer.h"
#include "nn/model.h"
#include "ops/backend.h"

// Carves an activation arena in two passes: first with base == NULL to count, then for real.
typedef struct {
    real *base;
    size_t used;
} carver;
static inline real *carve(carver *c, size_t n) {
    real *p = c->base ? c->base + c->used : NULL;
    c->used += (n + 15) & ~(size_t)15; // keep every buffer 64-byte aligned
    return p;
}

// What the blocks of one stack share in one pass: shapes, the active tokens, the attention
// segments and the scratch buffers. Buffers hold every token of the stack (nmax); token-indexed
// ones are addressed by token, row-indexed ones (the feed-forwards' LayerNorm output, their
// gradients, the MLP scratch) by feed-forward row (R(block_ffn).row0).
typedef struct {
    const R(vlmoe_backend) *be;
    int D, H, M, act;
    double eps;
    size_t t0;                   // the active tokens [t0, t0+n) of the token buffer
    int n;
    const attn_segment *seg;     // (nseg) attention segments (tok_off into the whole buffer)
    const size_t *att_off;       // (nseg) where each segment's probabilities start in att, datt
    int nseg;
    // scratch, reused by every block: forward uses each output right away and backward recomputes
    // it (LayerNorm from the saved mean and rstd, attention from qkv, unless the block keeps its
    // own: R(block_acts).att) with the same kernels
    real *ln;                    // (nmax,D) LayerNorm output of either half (rows for the FFN)
    real *att, *atty;            // attention probabilities, attention output (nmax,D); NULL
                                 // when every block keeps its own
    real *dres;                  // (nmax,D) d(block output) into backward, d(block input) out
    real *dln, *datty, *dqkv, *datt;
    real *da, *dh;               // (nmax,M) the MLP activation (forward) and its gradients
    real *sx, *sdy;              // (nmax,D) gathered rows of a feed-forward that does not run in
                                 // place (NULL when every feed-forward covers whole sequences)
    // stochastic depth (BEiT / timm's drop path): the factor of each sequence's attention
    // (drop[0]) and feed-forward (drop[1]) branch in the next block, 0 (dropped) or 1/(1-p);
    // drop[0] == NULL: none. The attention half's tokens are drop_nseq sequences of n/drop_nseq
    // tokens, a feed-forward part's are its nseq sequences. dbuf: (nmax,D) scratch for the branch.
    const double *drop[2];
    int drop_nseq;
    real *dbuf;
} R(block_pass);

// The activations one block keeps from forward to backward.
typedef struct {
    real *ln1_m, *ln1_r, *qkv, *res1; // attention half (ln1 and attention output recomputed)
    real *ln2_m, *ln2_r;              // (rows) the feed-forwards' LayerNorm statistics
    real *h;                          // (rows,M) dense fc1 outputs (NULL: no dense MLP)
    real *res2;                       // (nmax,D) block output
    // the attention probabilities and output, kept from the forward for the backward (the same
    // bits the backward would recompute from qkv), or NULL: recomputed into the pass's scratch
    real *att, *atty;
} R(block_acts);

// One feed-forward part of a block: its tokens are positions [off, off+len) of each of nseq
// sequences of seqlen tokens starting at the pass's t0. A part that covers whole sequences
// (off == 0, len == seqlen) runs in place on the token buffers; otherwise its tokens are
// gathered into rows [row0, row0 + nseq*len) of sx and scattered back.
typedef struct {
    size_t ln_w, ln_b;           // its pre-LayerNorm
    const ffn_layout *f;         // dense MLP or MoE layer
    struct R(moe_state) *moe;    // the MoE layer's state (f->kind == FFN_MOE)
    int nseq, seqlen, off, len;
    size_t row0;                 // its first row in the row-indexed buffers
    moe_call call;               // MoE: this pass's call (n, seed, modality, keys, ...)
    vlmoe_moe_stats *stats;      // MoE: its routing statistics
} R(block_ffn);

// One block of one pass: where its attention parameters live, its activations, its feed-forward
// parts (disjoint token sets that together cover the active tokens).
typedef struct {
    const block_layout *bl;      // ln1, qkv, out (ln2 and ffn are the parts' business)
    R(block_acts) *a;
    const R(block_ffn) *ffn;     // (nffn)
    int nffn;
} R(block);

// Carves one block's activations for nmax tokens; dense: some part is a dense MLP; natt > 0:
// the block keeps its natt attention probabilities and its attention output (att, atty).
void R(block_plan)(carver *c, R(block_acts) *a, size_t nmax, size_t natt, int D, int M, int dense);
// Carves a stack's scratch for nmax tokens and natt attention probabilities; gather: some part
// does not run in place; kept: every block keeps its attention (no recompute scratch).
void R(block_plan_pass)(carver *c, R(block_pass) *p, size_t nmax, size_t natt, int D, int M, int gather,
                        int kept);

// a->res2 = block(x) over the active tokens; the MoE layers' weighted auxiliary losses are added
// to *aux. Returns an MoE layer's error (the message names the block's MoE layer).
int R(block_forward)(const R(block_pass) *p, const R(block) *b, const real *P, const real *x, double *aux);
// p->dres holds d(block output) on entry and d(x) on return; G accumulates.
void R(block_backward)(const R(block_pass) *p, const R(block) *b, const real *P, real *G, const real *x);

#endif
