// soft.h: the Soft MoE layer (Puigcerver et al., "From Sparse to Soft Mixtures of Experts",
// sec. 2 eqs. 1-2, normalisation of sec. 2.3 / appendix E; spec/MOE.md "Soft MoE") as pure
// forward/backward kernels over one routing group. Covered by tests/test_soft_moe.c.
//
// One group: x (S,D) tokens; E experts with P slots each, N = E*P slots; expert MLP hidden M.
//   xh = x / sqrt(|x|^2 + 1e-6) per token, phih = phi / sqrt(|phi_col|^2 + 1e-6) per slot column
//   logits (S,N) = scale * xh . phih            (phi (D,E,P): column (e,j) is slot n = e*P+j)
//   Dw = softmax over tokens s (per slot n)     Cw = softmax over all N slots (per token s)
//   Xs (N,D) = Dw^T x (un-normalised x); rows e*P .. e*P+P-1 go through expert e:
//   Ys = w2_e act(w1_e Xs + b1_e) + b2_e;       out (S,D) = Cw Ys
// Soft MoE App. A's fixed baselines replace Dw and/or Cw by constants (no gradient flows into
// them): Identity (Dw = Cw = I, S = N), Uniform (Dw = 1/S, Cw = 1/N), Uniform/Soft (Dw = 1/S),
// Soft/Uniform (Cw = 1/N). raw = 1 drops the normalisation: xh = x, phih = phi.
// Weights use PyTorch's Linear layout (out,in), experts stacked: w1 (E,M,D), b1 (E,M),
// w2 (E,D,M), b2 (E,D). scale is one scalar (init 1.0). act is a VLMOE_ACT_* of vlmoe.h.
//
// The kernels never allocate: the caller gives `acts` (soft_moe_acts_floats elements of the
// variant's type, written by forward, read by backward and stats) and `scratch`
// (soft_moe_scratch_floats elements, backward only, contents undefined afterwards). Both sizes
// only grow with each dimension, so buffers sized for the largest S serve any smaller group.
// Parameters and their gradients travel in structs (STYLE: no more than ~6 positional
// parameters); every pointer in them is required.
// Compiled for float (_f32) and double (_f64), see src/core/real.h.
#ifndef VLMOE_MOE_SOFT_H
#define VLMOE_MOE_SOFT_H
#include <stddef.h>

typedef struct {
    int S, D, E, P, M, act; // all > 0; act = VLMOE_ACT_*
    int mix;                // VLMOE_SOFT_MIX_*: learned (soft) or fixed dispatch/combine (App. A)
    int raw;                // 1: no normalisation of x and phi (App. E's collapse); 0 the default
} soft_dims;
// soft_dims_check: VLMOE_ERR_CONFIG naming the problem when the group cannot be processed:
// fewer than one slot per expert, or Identity mixing with E*P != S (App. A: token i to slot i).
int soft_dims_check(const soft_dims *d);

// Elements (of the variant's type, float or double) of the forward's saved activations: xh,
// the norms, phih, the raw similarities, both softmaxes (and their transposes), Xs, the expert
// hidden pre/post activation and Ys.
size_t soft_moe_acts_floats(const soft_dims *d);
// Elements of scratch the backward needs.
size_t soft_moe_scratch_floats(const soft_dims *d);

#define SOFT_DECL(T, S)                                                                            \
    typedef struct {                                                                               \
        const T *phi;   /* (D,E,P) slot parameters */                                              \
        const T *scale; /* (1) */                                                                  \
        const T *w1;    /* (E,M,D) */                                                              \
        const T *b1;    /* (E,M) */                                                                \
        const T *w2;    /* (E,D,M) */                                                              \
        const T *b2;    /* (E,D) */                                                                \
    } soft_params_##S;                                                                             \
    /* same shapes as soft_params; every one ACCUMULATES (+=), the caller zeroes */               \
    typedef struct {                                                                               \
        T *dphi, *dscale, *dw1, *db1, *dw2, *db2;                                                  \
    } soft_grads_##S;                                                                              \
    /* out (S,D) is WRITTEN; acts (soft_moe_acts_floats) saved for backward; x (S,D) */            \
    void soft_moe_forward_##S(T *out, T *acts, const T *x, const soft_params_##S *p,              \
                              const soft_dims *d);                                                 \
    /* An inference table's own experts: Ys (N,D) = the experts of Xs (N,D), expert e on rows */   \
    /* e*P .. e*P+P-1; 0 when done, nonzero (ys as it was) for the forward's own products. */      \
    typedef int (*soft_experts_fn_##S)(void *ctx, T *ys, const T *xs, const soft_params_##S *p,    \
                                       const soft_dims *d);                                        \
    /* soft_moe_forward with the experts run by experts(ctx, ...) where it takes them: the */       \
    /* experts' hidden activations in acts are then left as they were (no backward follows) */      \
    void soft_moe_forward_with_##S(T *out, T *acts, const T *x, const soft_params_##S *p,         \
                                   const soft_dims *d, soft_experts_fn_##S experts, void *ctx);    \
    /* dx (S,D) and every gradient in g ACCUMULATE (+=); dx may be NULL; dout (S,D); acts from  */ \
    /* the forward on the same x and p; scratch (soft_moe_scratch_floats) */                       \
    void soft_moe_backward_##S(T *dx, const soft_grads_##S *g, const T *dout, const T *acts,       \
                               const T *x, const soft_params_##S *p, const soft_dims *d,          \
                               T *scratch);                                                        \
    /* from a forward's weights w = acts + soft_moe_weights_at(d) (host memory): minmax =    */    \
    /* {min, max dispatch weight, min, max combine weight}; meanmax = {mean over slots of the */    \
    /* largest dispatch weight, mean over tokens of the largest combine weight} (the collapse */    \
    /* monitors of Soft MoE App. E, Fig. 13)                                                  */    \
    void soft_moe_stats_##S(const T *w, const soft_dims *d, double minmax[4], double meanmax[2]);

// Where a forward's acts hold the dispatch weights (N,S) followed by the combine weights (S,N):
// soft_moe_weights_at(d) elements in, 2*S*N elements long (what soft_moe_stats reads, and what a
// caller on device memory downloads for it).
size_t soft_moe_weights_at(const soft_dims *d);

SOFT_DECL(float, f32)
SOFT_DECL(double, f64)

#endif
