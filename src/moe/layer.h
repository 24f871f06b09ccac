// layer.h: the MoE feed-forward layer as the model graph uses it: router, routing decision,
// per-expert matrix products over packed token buffers, combine, auxiliary losses, routing
// statistics, and the backward of all of it. Compiled for float and double (src/moe/layer.c).
// Covered by tests/test_moe_layer.c.
#ifndef VLMOE_MOE_LAYER_H
#define VLMOE_MOE_LAYER_H
#include <stddef.h>
#include <stdint.h>

#include "ops/backend.h"
#include "vlmoe.h"

// Where one MoE layer's parameters live in the flat buffer, and its shapes.
typedef struct {
    const vlmoe_moe_config *cfg;
    int D, M, act;
    size_t router_w, w1, b1, w2, b2, phi, scale; // offsets (NO_PARAM where absent)
    uint64_t pruned;         // router_pred pruning: experts never picked (vlmoe_moe_config.pruned)
    // expert parallelism with a sharded layout (src/nn/model.h model_shard): bit k of split says
    // bank k (w1, b1, w2, b2) holds only experts [shard_rank E/shard_size, ...) of the E; such a
    // layer runs expert-parallel over a group of shard_size, as process shard_rank, or not at all
    unsigned split;
    int shard_rank, shard_size;
} moe_spec;

// The examples of a one-tower encoder's token buffer (MOE.md "Notation"): B image-text pairs laid
// out as all B examples' image tokens, then all B examples' text tokens (src/nn/graph.c). With it
// a routing group holds whole examples (LIMoE E.5): group_size must be a multiple of
// tokens[0] + tokens[1], and the group's rows are visited image tokens first (text first with
// vlmoe_moe_config.text_first). A pass with one modality only groups the same number of
// consecutive examples of that modality.
typedef struct {
    int B;                   // examples in the buffer
    int tokens[2];           // tokens per example of each modality (VLMOE_MOD_*)
} moe_examples;

// One forward call over the n tokens of the active range.
typedef struct {
    int n;
    int training;            // training: noise, train capacity factor; else eval factor
    uint64_t seed;           // noise and random dispatch order of this call
    const uint8_t *modality; // (n) VLMOE_MOD_* of each token
    const double *noise;     // (n,E) the additive logit noise to use instead of drawing it (tests
                             // that pin the noise); NULL: draw (noise_std/E) N(0,1) from seed
    const uint64_t *keys;    // (n) what each token is (sample, modality, position: see
                             // moe_token_key), so its noise is the same wherever it is routed;
                             // NULL: the token's row index
    const moe_examples *examples; // one-tower encoders: groups hold whole examples (the
                             // modalities present are read off modality[0] and modality[n-1]);
                             // NULL: groups of group_size consecutive rows
} moe_call;

// The noise key of one token: its global sample index, modality and position in the sequence.
static inline uint64_t moe_token_key(uint64_t sample, int modality, int pos) {
    return sample << 21 | (uint64_t)modality << 20 | (uint64_t)pos;
}

struct vlmoe_dist; // src/dist/dist.h

// The auxiliary losses' forward values of one device training step, left in the table's memory
// so that the step waits once (docs/GPU.md "Host synchronisations left"): while a sink records,
// every MoE layer's forward writes each (loss, group) value into the next slot with
// aux_loss_dev, instead of waiting for aux_loss, and keeps a record of where; once the step's one
// download has brought the slots down, moe_aux_sink_take adds them up in moe_aux's order, so the
// sums, the stats' aux[] and the total have the CPU's bits. A loss whose slots would not fit is
// waited for as before (its sum kept in the record) and `need` says how many slots to plan.
enum { MOE_AUX_OFF, MOE_AUX_RECORD, MOE_AUX_SKIP }; // SKIP: a recomputation's values go unused
typedef struct {
    vlmoe_moe_stats *s;              // the record the forward filled (may be NULL)
    int G;                           // its groups: each loss is the mean of its group values
    int at[VLMOE_AUX_COUNT], n[VLMOE_AUX_COUNT]; // slots of each loss; at -1: its sum is in host
    double host[VLMOE_AUX_COUNT], w[VLMOE_AUX_COUNT]; // w 0: the loss is off (moe_aux skips it)
} moe_aux_rec;
typedef struct {
    double *slots;                   // cap doubles of the table's memory
    int cap, used, need, mode;
    moe_aux_rec *rec;                // one per recorded forward call, in call order
    int nrec, rec_cap;
} moe_aux_sink;
// The weighted total of the recorded calls (what their forwards would have returned, summed in
// call order), their stats' aux[] filled; slots: the host copy of the first `used` slots. Empties
// the records; the mode stays.
double moe_aux_sink_take(moe_aux_sink *k, const double *slots);
void moe_aux_sink_free(moe_aux_sink *k);

#define MOE_LAYER_DECL(T, S)                                                                     \
    typedef struct moe_state_##S moe_state_##S;                                                  \
    /* plans buffers for up to nmax tokens; nothing is allocated later */                        \
    int moe_state_create_##S(moe_state_##S **out, const moe_spec *spec,                          \
                             const vlmoe_backend_##S *be, int nmax);                             \
    void moe_state_free_##S(moe_state_##S *st);                                                  \
    /* layers that run one after another share scratch: dy/dxp among equal layers, and each    \
       layer whose (rows_max, M) activations fit in `floats` takes da/dh (may be NULL) */        \
    void moe_share_scratch_##S(moe_state_##S **states, int n, T *da, T *dh, size_t floats);      \
    /* gradient checkpointing (every layer's forward runs again right before its backward):    \
       layers of equal shapes share the packed expert activations xp, h, y; the routing      \
       decision stays each layer's own, so vlmoe_model_routing still reads every layer */      \
    void moe_share_acts_##S(moe_state_##S **states, int n);                                      \
    /* out (n,D) += moe(x (n,D)); returns the weighted auxiliary loss; fills stats */           \
    int moe_forward_##S(moe_state_##S *st, const moe_call *c, const T *P, const T *x, T *out,    \
                        double *aux, vlmoe_moe_stats *stats);                                   \
    /* dx (n,D) and the parameter gradients G accumulate; dout (n,D); daux scales the aux loss */\
    void moe_backward_##S(moe_state_##S *st, const T *P, T *G, const T *x, const T *dout, T *dx,  \
                          double daux);                                                          \
    /* the same, but dx is written, never read (its first writer: no zeroing before it) */       \
    void moe_backward_write_##S(moe_state_##S *st, const T *P, T *G, const T *x, const T *dout,   \
                                T *dx, double daux);                                             \
    /* expert parallelism over d's processes (d NULL or a world of one: off); every process must \
       hold whole routing groups of its own tokens (src/moe/layer.c) */                         \
    int moe_set_expert_parallel_##S(moe_state_##S *st, struct vlmoe_dist *d);                  \
    /* the last forward's decision per token (vlmoe_model_routing's entries): sets *count; */   \
    /* writes them when out is given and cap >= *count; Soft MoE: VLMOE_ERR_ARG */               \
    int moe_routing_##S(const moe_state_##S *st, vlmoe_token_route *out, int cap, int *count);    \
    /* the last forward's router probabilities summed over the tokens of one modality (E), so */ \
    /* the statistics of several forwards merge (src/nn/towers_accum.c); NULL for Soft MoE */     \
    const double *moe_gate_sums_##S(const moe_state_##S *st, int modality);                   \
    /* on a table that routes where its memory is (be->route), the statistics, the decision */   \
    /* moe_routing reads and the gate sums are downloaded when read: whoever hands out the */    \
    /* stats record calls sync first; forget drops a debt whose record was reset (the layer */   \
    /* did not run in this pass). Both are no-ops otherwise */                                   \
    void moe_stats_sync_##S(moe_state_##S *st);                                                  \
    void moe_stats_forget_##S(moe_state_##S *st);                                                \
    /* the sink the forward's auxiliary values go to while it records (NULL: none) */           \
    void moe_set_aux_sink_##S(moe_state_##S *st, moe_aux_sink *k);

MOE_LAYER_DECL(float, f32)
MOE_LAYER_DECL(double, f64)

// Soft MoE slots per expert: slots_per_expert, or rint(group_size / E) (MOE.md; rint, not round).
int moe_slots_per_expert(const vlmoe_moe_config *c);
// The expert capacity of a group of S tokens (the train or the eval factor): vlmoe_capacity,
// then at most S. The one computation both the layer's buffers (create) and its routing use.
// Tokens choice counts its K assignments per token unless capacity_per_token (CLIP-UP's
// B_e = (B_t/E) x C), experts choice one (MOE.md "Capacity").
int moe_capacity(const vlmoe_moe_config *c, int S, int training, int *C);

// Validates that n tokens split into routing groups for this layer (group_size divides n, the
// capacity is >= 1). The message names the layer's config and the group sizes that would work.
int moe_check_groups(const moe_spec *spec, int n, int training);

// The routing groups of one pass (src/moe/groups.c): S tokens per group and, when order is not
// NULL, order (n): position p in group-major order -> the row it reads (group g holds positions
// [g S, (g+1) S)). *ordered is 0 when that order is the identity. With ex NULL this is
// moe_check_groups: groups of group_size consecutive rows. modality (n) is the pass's.
int moe_plan_groups(const moe_spec *spec, int n, int training, const moe_examples *ex,
                    const uint8_t *modality, int *S, int32_t *order, int *ordered);
// The same check for a call with examples (moe_call.examples, modality): NULL ex is moe_check_groups.
int moe_check_examples(const moe_spec *spec, int n, int training, const moe_examples *ex,
                       const uint8_t *modality);

#endif
