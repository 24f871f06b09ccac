// vlmoe.h: the public C API of vlmoe, a library that trains, evaluates and runs sparse
// Mixture-of-Experts vision-language models (LIMoE, CLIP-UP, Soft MoE, VL-MoE).
//
// Conventions: every fallible function returns an int status (VLMOE_OK == 0) and records a
// message naming the file, tensor or field at fault, readable with vlmoe_last_error() on the
// same thread. The library never exits, aborts or prints on bad input. Handles are opaque,
// `_free(NULL)` is safe, `*_default_params()` returns a struct by value. Enums are append-only.
#ifndef VLMOE_H
#define VLMOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VLMOE_VERSION "0.1.0"

// VLMOE_API marks every function of this header, the only ones libvlmoe.so exports: the library
// is compiled with -fvisibility=hidden, so its kernels and internal helpers stay private to it
// (tests/check_exports.sh checks that the exports are exactly the functions declared here).
#if defined(__GNUC__) || defined(__clang__)
#define VLMOE_API __attribute__((visibility("default")))
#else
#define VLMOE_API
#endif

// ---------------------------------------------------------------------------------------------
// Status and errors
enum {
    VLMOE_OK = 0,
    VLMOE_ERR_ARG = 1,     // a caller passed an invalid argument
    VLMOE_ERR_NOMEM = 2,   // an allocation failed
    VLMOE_ERR_IO = 3,      // open/read/write/rename failed
    VLMOE_ERR_FORMAT = 4,  // a file is malformed (safetensors header, checkpoint, ...)
    VLMOE_ERR_CONFIG = 5,  // a config is missing a key, has a wrong type or an invalid value
    VLMOE_ERR_NUMERIC = 6, // a non-finite loss or gradient
};
VLMOE_API const char *vlmoe_last_error(void);   // message of the last failure on this thread
VLMOE_API void vlmoe_clear_error(void);
VLMOE_API const char *vlmoe_status_name(int status);

// ---------------------------------------------------------------------------------------------
// safetensors (src/io/safetensors.c): the format HF uses. 8-byte little-endian header length,
// a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the data.
// The reader validates every byte it trusts: header length within the file, JSON well-formed,
// dtype known, shape dims non-negative, numel x dtype size == data_offsets span (overflow-checked),
// offsets inside the data area, tensors not overlapping, names unique.
typedef enum {
    VLMOE_DT_F32 = 0, VLMOE_DT_F16 = 1, VLMOE_DT_BF16 = 2, VLMOE_DT_F64 = 3,
    VLMOE_DT_I64 = 4, VLMOE_DT_I32 = 5, VLMOE_DT_U8 = 6, VLMOE_DT_I8 = 7,
    VLMOE_DT_BOOL = 8, VLMOE_DT_U64 = 9,
} vlmoe_dtype;
VLMOE_API const char *vlmoe_dtype_name(vlmoe_dtype dt);   // "F32", "BF16", ...
VLMOE_API size_t vlmoe_dtype_size(vlmoe_dtype dt);

#define VLMOE_MAX_DIMS 8
typedef struct {
    const char *name;           // owned by the file handle
    vlmoe_dtype dtype;
    int ndim;
    int64_t shape[VLMOE_MAX_DIMS];
    size_t numel;
    size_t nbytes;
    const void *data;           // raw little-endian bytes inside the loaded file
} vlmoe_tensor_info;

typedef struct vlmoe_st vlmoe_st;
VLMOE_API int vlmoe_st_open(const char *path, vlmoe_st **out);
VLMOE_API void vlmoe_st_close(vlmoe_st *st);
VLMOE_API int vlmoe_st_count(const vlmoe_st *st);
VLMOE_API int vlmoe_st_find(const vlmoe_st *st, const char *name);        // index or -1
VLMOE_API int vlmoe_st_info(const vlmoe_st *st, int index, vlmoe_tensor_info *info);
// Copies tensor `name` into dst as float32, converting F16/BF16/F64; fails unless its element
// count is exactly n (message names the file, tensor, expected and found shapes).
VLMOE_API int vlmoe_st_read_f32(const vlmoe_st *st, const char *name, float *dst, size_t n);
VLMOE_API const char *vlmoe_st_metadata(const vlmoe_st *st, const char *key); // NULL if absent
VLMOE_API const char *vlmoe_st_path(const vlmoe_st *st);

typedef struct vlmoe_st_writer vlmoe_st_writer;
VLMOE_API int vlmoe_st_writer_init(vlmoe_st_writer **out);
VLMOE_API void vlmoe_st_writer_free(vlmoe_st_writer *w);
// Adds a float32 tensor stored as `dtype` (F32, F16 or BF16, round-to-nearest-even). The data
// pointer is read at write time: keep it alive until vlmoe_st_writer_write returns.
VLMOE_API int vlmoe_st_writer_add_f32(vlmoe_st_writer *w, const char *name, vlmoe_dtype dtype, int ndim,
                                      const int64_t *shape, const float *data);
// Adds raw little-endian bytes of any dtype (integers, RNG state, ...), same lifetime rule.
VLMOE_API int vlmoe_st_writer_add_raw(vlmoe_st_writer *w, const char *name, vlmoe_dtype dtype, int ndim,
                                      const int64_t *shape, const void *data);
VLMOE_API int vlmoe_st_writer_meta(vlmoe_st_writer *w, const char *key, const char *value);
// Writes atomically: PATH.tmp.<pid>, fflush + fsync, rename over PATH, fsync of the directory.
VLMOE_API int vlmoe_st_writer_write(vlmoe_st_writer *w, const char *path);

// ---------------------------------------------------------------------------------------------
// Parameter table: one flat float buffer, described by named views (src/nn/model.c).
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[4];
    size_t offset;   // in floats, into the flat buffer
    size_t numel;
    int decay;       // 1 if weight decay applies (matrices); 0 for biases, norms, embeddings,
                     // temperature
    // expert parallelism (docs/DISTRIBUTED.md "Sharding the expert parameters"): an (E, ...)
    // expert bank of which this process holds experts [expert0, expert0 + experts_local) only;
    // shape stays the whole bank's, numel is what is held. Both 0 for a tensor held whole.
    int expert0, experts_local;
} vlmoe_param_info;

// ---------------------------------------------------------------------------------------------
// Optimizers, clipping, schedules (src/optim/)
typedef enum { VLMOE_OPT_ADAMW = 0, VLMOE_OPT_ADAFACTOR = 1 } vlmoe_opt_kind;
typedef struct {
    vlmoe_opt_kind kind;
    float beta1;          // AdamW 0.9; Adafactor momentum (default 0.9 as big_vision's; 0 = none)
    float beta2;          // AdamW 0.999; unused by Adafactor (it uses decay_rate)
    float eps;            // AdamW 1e-8; Adafactor eps1 1e-30 (added to squared grads)
    float weight_decay;   // decoupled, only where param_info.decay: p -= lr * wd * p, or with
                          // wd_lr_base > 0 p -= (lr / wd_lr_base) * wd * p
    float decay_rate;     // Adafactor: beta2_t = min(beta2_cap, 1 - t^(-decay_rate)), default 0.8
    float clip_threshold; // Adafactor update clipping d (default 0 = off, as big_vision; 1.0: the paper's)
    int min_dim_to_factor;// Adafactor: factor the two largest dims if both are >= this (default 32)
    float beta2_cap;      // Adafactor: upper bound of beta2_t (default 0.999, ViT-G; 1 = none)
    int decay_offset;     // Adafactor: the beta2 schedule counts t from this step (optax step_offset)
    int momentum_bf16;    // Adafactor: keep the momentum rounded to bfloat16 (ViT-G's memory saving)
    float wd_lr_base;     // > 0: weight decay follows the schedule lr / wd_lr_base, not lr itself
                          // (big_vision: wd times the schedule); 0: times lr (torch's AdamW)
} vlmoe_optim_params;
VLMOE_API vlmoe_optim_params vlmoe_optim_default_params(vlmoe_opt_kind kind);

typedef struct vlmoe_optim vlmoe_optim;
VLMOE_API int vlmoe_optim_init(vlmoe_optim **out, const vlmoe_optim_params *p,
                               const vlmoe_param_info *table, int nparams, size_t total);
VLMOE_API void vlmoe_optim_free(vlmoe_optim *o);
// One update of params (total floats) from grads at learning rate lr; increments the step count.
VLMOE_API void vlmoe_optim_step(vlmoe_optim *o, float *params, const float *grads, float lr);
VLMOE_API long vlmoe_optim_get_step(const vlmoe_optim *o);
VLMOE_API void vlmoe_optim_set_step(vlmoe_optim *o, long step);
// The optimizer's state as named float buffers (for checkpoints): "adamw.m", "adamw.v", or per
// factored parameter "adafactor.vr.<param>", "adafactor.vc.<param>", "adafactor.v.<param>", ...
VLMOE_API int vlmoe_optim_state_count(const vlmoe_optim *o);
VLMOE_API int vlmoe_optim_state_get(vlmoe_optim *o, int i, const char **name, float **data, size_t *n);
// How state buffer i is laid out, so checkpoints can store it per parameter: *flat = 1 when it is
// laid out like the flat parameter vector (AdamW's m and v: `total` floats, parameter k's at
// table[k].offset; *ndim = 1, shape = {total}), 0 when it belongs to one parameter; then
// *ndim/shape give its natural shape (at most 4 dims): the parameter's own for Adafactor's v and
// m, the leading dims then rows for vr, the leading dims then cols for vc.
VLMOE_API int vlmoe_optim_state_layout(const vlmoe_optim *o, int i, int *flat, int *ndim, int64_t shape[4]);

// Scales grads so their global L2 norm is at most max_norm (max_norm <= 0: no-op). Returns the
// norm before clipping (computed in double).
VLMOE_API double vlmoe_clip_grad_norm(float *grads, size_t n, double max_norm);

typedef enum { VLMOE_SCHED_COSINE = 0, VLMOE_SCHED_RSQRT = 1, VLMOE_SCHED_CONST = 2 } vlmoe_sched_kind;
typedef struct {
    vlmoe_sched_kind kind;
    double base_lr;
    long warmup_steps;   // linear warmup from 0 to base_lr over these steps
    long total_steps;
    double end_lr;       // cosine: value reached at total_steps (default 0)
    long cooldown_steps; // rsqrt: linear cooldown to 0 over the last cooldown_steps
    double timescale;    // rsqrt: lr = base_lr * sqrt(timescale / max(step, timescale)) after warmup
} vlmoe_schedule;
VLMOE_API double vlmoe_schedule_lr(const vlmoe_schedule *s, long step); // step counts from 0

// ---------------------------------------------------------------------------------------------
// Synthetic image-caption data (src/data/synthetic.c): coloured shapes on varied backgrounds,
// generated on the fly from (seed, split, index); a held-out split and zero-shot classes.
typedef struct {
    int image_size;     // square images, >= 16
    uint64_t seed;
} vlmoe_synth_params;
VLMOE_API vlmoe_synth_params vlmoe_synth_default_params(void);
typedef struct vlmoe_synth vlmoe_synth;
enum { VLMOE_SPLIT_TRAIN = 0, VLMOE_SPLIT_HELDOUT = 1 };
VLMOE_API int vlmoe_synth_init(vlmoe_synth **out, const vlmoe_synth_params *p);
VLMOE_API void vlmoe_synth_free(vlmoe_synth *s);
VLMOE_API int vlmoe_synth_num_classes(const vlmoe_synth *s);
VLMOE_API int vlmoe_synth_image_size(const vlmoe_synth *s);
VLMOE_API const char *vlmoe_synth_class_name(const vlmoe_synth *s, int c);   // e.g. "red circle"
VLMOE_API int vlmoe_synth_num_templates(const vlmoe_synth *s);
VLMOE_API const char *vlmoe_synth_template(const vlmoe_synth *s, int t);    // e.g. "a photo of a {}."
// Writes sample `index` of `split`: image (3, H, W) in [-1, 1] (channel-major), its caption
// (NUL-terminated, truncated to cap bytes) and its zero-shot class. Deterministic in
// (seed, split, index) and thread-safe.
VLMOE_API int vlmoe_synth_sample(const vlmoe_synth *s, int split, uint64_t index, float *image,
                                 char *caption, size_t cap, int *class_id);
// Word-level tokenizer of the synthetic vocabulary: ids[0] = SOT, words, EOT, then PAD (0) up
// to ctx; truncation keeps EOT last. Unknown words map to UNK. Returns the length with SOT/EOT.
enum { VLMOE_TOK_PAD = 0, VLMOE_TOK_SOT = 1, VLMOE_TOK_EOT = 2, VLMOE_TOK_UNK = 3 };
VLMOE_API int vlmoe_synth_vocab_size(const vlmoe_synth *s);
VLMOE_API int vlmoe_synth_tokenize(const vlmoe_synth *s, const char *text, int32_t *ids, int ctx);
// The inverse: the words of ids joined by spaces, PAD/SOT/EOT skipped, any other id outside the
// vocabulary (UNK, or an id only a bigger model has) as "<unk>". NUL-terminated in out (cap bytes).
VLMOE_API int vlmoe_synth_detokenize(const vlmoe_synth *s, const int32_t *ids, int n, char *out, size_t cap);

// ---------------------------------------------------------------------------------------------
// Models (src/nn/): config, parameters, forward/backward, save/load.
typedef enum { VLMOE_ARCH_ONE_TOWER = 0, VLMOE_ARCH_TWO_TOWER = 1, VLMOE_ARCH_MOME = 2 } vlmoe_arch;
enum { VLMOE_ACT_GELU = 0, VLMOE_ACT_GELU_TANH = 1, VLMOE_ACT_QUICK_GELU = 2 };
enum { VLMOE_POOL_MEAN = 0, VLMOE_POOL_CLS = 1, VLMOE_POOL_EOT = 2 };

typedef struct {
    int width, layers, heads, mlp_dim;
} vlmoe_encoder_config;

// ---------------------------------------------------------------------------------------------
// Mixture-of-Experts (src/moe/): the exact semantics are those of ../shared/spec/MOE.md.
typedef enum {
    VLMOE_ROUTER_NONE = 0,     // dense MLP
    VLMOE_ROUTER_TOKENS = 1,   // tokens choose their top-K experts (V-MoE, LIMoE, CLIP-UP)
    VLMOE_ROUTER_EXPERTS = 2,  // experts choose their top-C tokens
    VLMOE_ROUTER_SOFT = 3,     // Soft MoE: soft dispatch/combine over slots
} vlmoe_router_kind;
enum { VLMOE_ORDER_FIFO = 0, VLMOE_ORDER_BPR = 1, VLMOE_ORDER_RANDOM = 2 };
enum { VLMOE_BPR_MAX = 0, VLMOE_BPR_SUM = 1 };
enum { VLMOE_RENORM_NONE = 0, VLMOE_RENORM_AFTER_ROUTING = 1 };
enum { VLMOE_MOD_IMAGE = 0, VLMOE_MOD_TEXT = 1 };
// Soft MoE dispatch/combine (Soft MoE App. A): learned softmaxes, or the fixed baselines
enum { VLMOE_SOFT_MIX_SOFT = 0, VLMOE_SOFT_MIX_IDENTITY = 1, VLMOE_SOFT_MIX_UNIFORM = 2,
       VLMOE_SOFT_MIX_UNIFORM_SOFT = 3, VLMOE_SOFT_MIX_SOFT_UNIFORM = 4 };
// Auxiliary losses (MOE.md "Auxiliary losses"); per-modality LIMoE losses come in pairs.
typedef enum {
    VLMOE_AUX_IMPORTANCE = 0, VLMOE_AUX_LOAD, VLMOE_AUX_VLOSS, VLMOE_AUX_ZLOSS, VLMOE_AUX_SWITCH,
    VLMOE_AUX_LOCAL_ENT_IMAGE, VLMOE_AUX_LOCAL_ENT_TEXT, VLMOE_AUX_GLOBAL_ENT_IMAGE,
    VLMOE_AUX_GLOBAL_ENT_TEXT, VLMOE_AUX_MI, VLMOE_AUX_TARGET_ENT, VLMOE_AUX_MERGED_ENT,
    VLMOE_AUX_COUNT
} vlmoe_aux_kind;
VLMOE_API const char *vlmoe_aux_name(vlmoe_aux_kind k); // "importance", "load", ... "merged_entropy"

// The MoE layers of one encoder (tower).
typedef struct {
    vlmoe_router_kind router;
    uint64_t layers;             // bit l set: block l's feed-forward is an MoE layer
    int num_experts, top_k;
    double capacity_factor, eval_capacity_factor;
    int capacity_multiple;       // round C up to a multiple of this (default 1)
    int capacity_per_token;      // 1: C = ceil(cf*S/E) whatever top_k, CLIP-UP's B_e = (B_t/E) C
                                 // (the clipup preset); 0: ceil(cf*S*K/E) (V-MoE, LIMoE). JSON
                                 // "capacity_per_assignment": false / true (default)
    int order, bpr_score;        // VLMOE_ORDER_*, VLMOE_BPR_*
    int gate_renorm;             // VLMOE_RENORM_*
    double noise_std;            // training noise on router logits: l + (noise_std/E) N(0,1)
    int group_size;              // tokens per routing group, 0 = all tokens of the batch
    int slots_per_expert;        // Soft MoE, 0 = rint(S/E); fewer than one slot per expert is an error
    int soft_mix;                // Soft MoE: VLMOE_SOFT_MIX_* (JSON "soft_dispatch": "soft",
                                 // "identity", "uniform", "uniform_soft", "soft_uniform")
    int soft_raw;                // Soft MoE: 1 = no normalisation of x and phi before the
                                 // softmaxes (App. E; JSON "soft_normalize": false)
    double aux_weight[VLMOE_AUX_COUNT];
    double global_tau[2];        // global-entropy thresholds per modality: tau = log(S), S the soft
                                 // minimum number of experts (0 = log 1); JSON "global_entropy_tau"
    uint64_t pruned[64];         // router_pred pruning (LIMoE E.4): bit e of pruned[l] keeps expert e
                                 // of block l out of the top-K; the softmax still covers it
    int text_first;              // one_tower: a routing group visits its text tokens before its image
                                 // tokens (fifo positions, BPR ties); 0 = image first (LIMoE Fig. 6)
    // LIMoE appendix E.3 (one_tower only). router_per_modality: image and text tokens each get a
    // router of their own (parameter "moe.router.per_modality.weight", (2,E,D), image first).
    // text_experts T > 0: disjoint pools, text tokens routed only among experts [E-T, E), image
    // tokens among [0, E-T): softmax and top-K over the token's pool, the auxiliary losses per
    // modality over its pool (src/moe/layer.c). Tokens choice only; 0 = one shared pool.
    int router_per_modality;
    int text_experts;
} vlmoe_moe_config;

// Presets (MOE.md): "limoe" (tokens choice, K=1, BPR, noise 1, cf 1.05 train / 16 eval, importance + load + text
// local entropy + image/text global entropy with tau log 20 / log 9, each 0.04/5) and "clipup"
// (tokens choice, K=2, FIFO, cf 2, switch balance 0.01 + z-loss 0.001). Sets routing and losses;
// keeps `layers` and sets num_experts to 8 if it is 0.
VLMOE_API int vlmoe_moe_preset(const char *name, vlmoe_moe_config *c);
// MoE in every n-th block (blocks n-1, 2n-1, ...: LIMoE's and CLIP-UP's "every second layer").
VLMOE_API uint64_t vlmoe_moe_every(int n, int layers);

// Capacity per expert per group (MOE.md "Capacity"): C = ceil(cf*S*K/E) for tokens choice,
// ceil(cf*S/E) for experts choice (K = 1), computed in double, rounded up to `multiple`.
// C < 1 (also a NaN factor) is VLMOE_ERR_CONFIG; C is at most S*K before the rounding (no group
// can use more), so a huge finite factor cannot size a buffer.
VLMOE_API int vlmoe_capacity(int S, int E, int K, double cf, int multiple, int *C);

// A routing decision for one group of S tokens, the explicit struct backward consumes.
typedef struct {
    int S, E, K, C;
    int32_t *expert;    // (S,K) tokens choice: expert of each choice by rank (rank 0 = top gate)
    int32_t *slot;      // (S,K) its position in that expert's buffer, -1 if dropped
    int32_t *token;     // (E,C) token held by each expert slot, -1 if empty
    float *weight;      // (E,C) combine weight of each filled slot (0 if empty)
    int32_t *count;     // (E) accepted assignments
    int32_t *wanted;    // (E) assignments routed to the expert before capacity
    uint8_t *dropped;   // (S) 1 if all of the token's assignments were dropped
    int32_t *work;      // internal scratch (2S), so that routing never allocates in a step
} vlmoe_routing;
VLMOE_API int vlmoe_routing_alloc(vlmoe_routing *r, int S, int E, int K, int C);
VLMOE_API void vlmoe_routing_free(vlmoe_routing *r);

typedef struct {
    int top_k;
    int capacity;               // C, from vlmoe_capacity
    int order, bpr_score, gate_renorm;
    uint64_t seed;              // for VLMOE_ORDER_RANDOM
} vlmoe_route_params;
// Tokens choice: gates (S,E) are the (noisy when training) softmax probabilities. Each token
// takes its top-K experts (ties: lower index); all first choices are placed before any second
// choice, tokens in the dispatch order; each expert accepts its first C assignments. Combine
// weights are the gates of accepted choices (renormalised over them with after_routing).
VLMOE_API int vlmoe_route_tokens_choice(const float *gates, int S, int E, const vlmoe_route_params *p,
                                        vlmoe_routing *out);
// Experts choice: each expert takes its top-C tokens by gate (ties: lower token index); combine
// weight = gate. out->expert/slot are unused (K = 0).
VLMOE_API int vlmoe_route_experts_choice(const float *gates, int S, int E, int C, vlmoe_routing *out);

// Routing statistics of one MoE layer for the last forward pass, per modality (VLMOE_MOD_*).
typedef struct {
    int encoder, block;         // where the layer sits
    int num_experts;
    int tokens[2];              // tokens of each modality routed
    double success[2];          // fraction of tokens with at least one accepted assignment
    double dropped[2];          // fraction of assignments dropped by capacity
    double mean_max_gate[2];    // mean over tokens of the largest dispatch gate
    double entropy_pre[2];      // pre-dispatch global entropy H(mean p) over the modality's tokens of
                                // the pass (LIMoE Fig. 9 "routing entropy"; log of experts_used)
    double entropy_post[2];     // entropy of the accepted assignments' spread over experts
    double experts_used[2];     // exp(H(mean p)): experts the modality effectively uses
    double *routed[2];          // (E) fraction of the modality's assignments sent to each expert
                                //     before capacity
    double *accepted[2];        // (E) fraction of the modality's tokens each expert processed
    double aux[VLMOE_AUX_COUNT];// unweighted auxiliary losses, mean over groups (0 if unused)
    double soft_minmax[4];      // Soft MoE: min/max dispatch weight, min/max combine weight
    double entropy_token[2];    // mean per-token router entropy mean_s H(p_s) (pre-dispatch)
    int capacity;               // C per expert per group of the last forward (0: Soft MoE)
    double experts_cover[2][3]; // experts needed to cover 50/80/90% of the modality's assignments
                                // (the most-routed experts first; LIMoE Fig. 10 / 13)
    double soft_mean_max[2];    // Soft MoE App. E monitors: mean over slots of the largest dispatch
                                // weight, mean over tokens of the largest combine weight
} vlmoe_moe_stats;
// The coverage levels of vlmoe_moe_stats.experts_cover.
#define VLMOE_COVER_LEVELS {0.5, 0.8, 0.9}
// experts_cover of one modality from its routed fractions (E, summing to 1): for each level X
// the fewest experts, most-routed first, whose fractions reach X (0 when nothing was routed).
VLMOE_API void vlmoe_experts_cover(const double *routed, int E, double cover[3]);

// Inputs of the auxiliary losses of one group.
typedef struct {
    int S, E, K;
    const float *logits;        // (S,E) clean router logits
    const float *noisy_logits;  // (S,E) logits with the training noise, NULL when no noise
    double noise_std;           // as in the config (the noise scale is noise_std/E)
    const uint8_t *modality;    // (S) VLMOE_MOD_* of each token; NULL = all image
    const int32_t *wanted;      // (E) assignments routed before capacity (switch loss)
    double global_tau[2];       // tau = log(S) per modality (0 = log 1: the loss is off)
    const int32_t *wanted_mod;  // (2,E) `wanted` split by modality, image row first: the switch loss
                                // of a group with both modalities is the sum of each one's (CLIP-UP
                                // per tower); NULL is allowed when the group has one modality
} vlmoe_aux_input;
// One auxiliary loss of one group; if dlogits (S,E) is given, accumulates weight * d(loss)/d(logits)
// (z-loss and switch are per modality when the group holds both, MOE.md)
// (through the softmax, the noisy threshold of the load loss, ...). Losses of a modality with no
// tokens in the group are 0. The load loss is 0 without noisy logits.
VLMOE_API double vlmoe_aux_loss(vlmoe_aux_kind kind, const vlmoe_aux_input *in, double weight, float *dlogits);

// Everything that decides a model's shape and computation. one_tower (LIMoE): one encoder shared
// by both modalities (`encoder`); two_tower (CLIP): `encoder` is the image tower and `text_encoder`
// the text tower. Serialised as JSON in every checkpoint's metadata (key "vlmoe.config").
typedef struct {
    char name[64];
    vlmoe_arch arch;
    int image_size, patch_size, channels;
    int vocab_size, context_length;
    int embed_dim;
    vlmoe_encoder_config encoder;
    vlmoe_encoder_config text_encoder;  // two_tower only
    int act;                 // VLMOE_ACT_*
    double ln_eps;           // 1e-6 (JAX/ViT) or 1e-5 (CLIP)
    int patch_bias;          // 0 for OpenAI CLIP's bias-free conv1
    int image_class_token;   // prepend a learned class token to the patches
    int image_ln_pre;        // CLIP's ln_pre before the image tower's blocks
    int image_pool;          // VLMOE_POOL_MEAN or VLMOE_POOL_CLS
    int text_causal;         // causal text attention (CLIP)
    int text_pool;           // VLMOE_POOL_MEAN or VLMOE_POOL_EOT
    double init_temperature; // exp(logit_scale) at init: LIMoE 10, CLIP 1/0.07
    double max_temperature;  // logit_scale is clamped to [0, log(max)] after each step (CLIP: 100)
    vlmoe_moe_config moe;      // MoE layers of `encoder` (dense when router is NONE)
    vlmoe_moe_config text_moe; // two_tower: MoE layers of `text_encoder`; mome: the T-MoE layers
                               // (`moe` holds the V-MoE layers)
    // mome (VL-MoE) only: JSON keys "vl_layers", "mim_vocab", "mask_token"
    int vl_layers;           // F: the top F blocks run image-text pairs through VL-FFN
    int mim_vocab;           // size of the visual-token codebook the MIM head predicts
    int mask_token;          // the [MASK] id of the text vocabulary ([T_CLS]/[T_SEP] are the
                             // tokenizer's start/end tokens, the first and last of each text)
    int num_classes;         // mome: classes of the fine-tuning head "cls_head" (JSON key
                             // "num_classes", written when > 0); 0 = no head
    int cls_sequences;       // mome: sequences pooled into one example of the head: 1 (0 reads as
                             // 1), or 2 for NLVR2 (two image-text pairs, their fused [T_CLS]
                             // features concatenated); JSON "cls_sequences", written when 2
    int retrieval_head;      // mome: 1 adds the contrastive retrieval head: projections of the
                             // [I_CLS] and [T_CLS] features to embed_dim and a logit_scale
                             // (JSON "retrieval_head", written when 1)
    int itm_head;            // mome: 1 adds the image-text matching head "itm_head" (2, width) +
                             // bias on the fused [T_CLS] of a pair (VLMo's ITM; needs
                             // retrieval_head, whose similarities mine its hard negatives);
                             // JSON "itm_head", written when 1
    int beit_init;           // mome: 1 initialises as BEiT (and VL-MoE) do: N(0, 0.02), each block's
                             // output matrices scaled by 1/sqrt(2l) (src/nn/model.c); 0 keeps
                             // the ViT init. The paper sizes (vlmoe-base, vlmoe-large) set it; JSON
                             // "beit_init", written when 1
} vlmoe_model_config;
// Warnings about a config that is valid but cannot do what it asks: a global-entropy threshold at
// or above log(num_experts) (LIMoE 2.2.2: no routing over E experts reaches it, so the loss never
// switches off). Writes one line per warning ("moe.global_entropy_tau[text] = ...") into buf
// (cap bytes, NUL-terminated, truncated if short) and returns how many there are.
VLMOE_API int vlmoe_config_warnings(const vlmoe_model_config *c, char *buf, size_t cap);

// Named configs: "tiny", "tiny-clip" (tests), "S/32", "B/32", "B/16" (one_tower, LIMoE layout),
// "ViT-B-32", "ViT-B-16" (two_tower, OpenAI CLIP exactly), and the papers' sizes (src/nn/sizes.c):
// limoe-S/16 ... limoe-H/14, clipup-B/16, clipup-L/14, vlmoe-base, vlmoe-large. Unknown name:
// VLMOE_ERR_CONFIG with the list of known names.
VLMOE_API int vlmoe_config_named(const char *name, vlmoe_model_config *out);
VLMOE_API const char *vlmoe_config_names(void); // comma-separated list
// JSON config: either complete, or {"base": "<name>", ...overrides}. Unknown keys, missing keys
// and wrong types are errors naming the key; `what` names the source (a file path) in messages.
VLMOE_API int vlmoe_config_from_json(const char *json, const char *what, vlmoe_model_config *out);
VLMOE_API int vlmoe_config_load(const char *path, vlmoe_model_config *out); // a file, or a named config
VLMOE_API char *vlmoe_config_to_json(const vlmoe_model_config *cfg);         // free() the result
VLMOE_API int vlmoe_config_validate(const vlmoe_model_config *cfg);
// What a config costs (src/nn/sizes.c), computed from its parameter table and shapes without
// allocating weights: parameters; those a token uses (all but the experts its router does not
// pick: E - K per tokens-choice MoE layer); forward GFLOP of one image, one text (each encoded
// alone, as for retrieval) and their sum, a pair (multiply-adds count 2; matrix products only).
typedef struct {
    double params, active_params, expert_params;
    double gflop_image, gflop_text, gflop_pair;
    int moe_layers, image_tokens, text_tokens;
} vlmoe_model_cost;
VLMOE_API int vlmoe_config_cost(const vlmoe_model_config *cfg, vlmoe_model_cost *out);

typedef struct vlmoe_model vlmoe_model;
// A batch of B image-text pairs: images (B, C, H, W) floats; tokens (B, context_length) with
// lengths (B) counting SOT..EOT (padding beyond). Either side may be NULL for one-modality use.
typedef struct {
    int batch_size;
    const float *images;
    const int32_t *tokens;
    const int32_t *lengths;
} vlmoe_batch;
typedef struct {
    double loss;          // total: contrastive + auxiliary
    double contrastive;
    double aux;
    double acc_i2t, acc_t2i; // in-batch top-1 retrieval accuracy
    double temperature;   // exp(logit_scale)
    double lr;            // learning rate of this step (trainer only)
    double grad_norm;     // global gradient norm before clipping (trainer only)
} vlmoe_step_stats;

VLMOE_API int vlmoe_model_init(vlmoe_model **out, const vlmoe_model_config *cfg, uint64_t seed);
VLMOE_API void vlmoe_model_free(vlmoe_model *m);
VLMOE_API const vlmoe_model_config *vlmoe_model_get_config(const vlmoe_model *m);
VLMOE_API const vlmoe_param_info *vlmoe_model_params(const vlmoe_model *m, int *count);
VLMOE_API size_t vlmoe_model_num_floats(const vlmoe_model *m);
// The host copy of every parameter (vlmoe_model_params gives each one's offset), brought up to
// date from a device first. The call counts as a write: the device copy is uploaded again and the
// packed bf16 copies of the weights (`--precision bf16` on a CPU) are made again before their next
// use. So write through the pointer before the next call into the library that runs the model; a
// write made after such a call is seen by the fp32 host path only, until this is called again.
VLMOE_API float *vlmoe_model_param_data(vlmoe_model *m);
// The host copy of the gradients of the last backward, in the same layout, to read.
VLMOE_API float *vlmoe_model_grad_data(vlmoe_model *m);
// Plans the activation arena for batch size B (done once; forward re-plans only if B changes).
VLMOE_API int vlmoe_model_plan(vlmoe_model *m, int batch_size);
// Gradient checkpointing (OpenCLIP's --grad-checkpointing): training forwards keep only each
// transformer block's input and the backward runs every block's forward again before its
// backward, the same bits and routing decisions, for less activation memory. One_tower and
// two_tower models; VL-MoE (arch mome) is VLMOE_ERR_CONFIG. A planned model is planned again.
VLMOE_API int vlmoe_model_set_grad_checkpointing(vlmoe_model *m, int on);
// Attention in the backward, without gradient checkpointing: 1 recomputes each block's attention
// probabilities and output from its kept qkv (Megatron's selective recomputation), 0 keeps them
// from the forward: B*H*T^2 + B*T*width more floats a block (bench-s at batch 64: 48 MB),
// allocated by the first training forward (a model that only encodes holds none), for one
// attention forward less a block in the backward (3% of a bench-s step in bf16). The same bits
// either way. -1 (the default): keep them where the products run in bf16 on the CPU
// (`--precision bf16`), whose step the recompute slows the most, and keeping adds at most a
// quarter to the activations (bench-s 18%, limoe-S/16 23%; not B/16, 26%, or limoe-L/16, 41%);
// recompute otherwise, and always in fp32, whose activations stay lean. With checkpointing the
// blocks are recomputed whole and share one set. One_tower and two_tower models; VL-MoE (arch
// mome) recomputes, and refuses 0 or 1 (VLMOE_ERR_CONFIG). A planned model is planned again.
VLMOE_API int vlmoe_model_set_attention_recompute(vlmoe_model *m, int mode);
// Stochastic depth (BEiT's drop path, VL-MoE pre-training) of a VL-MoE (arch mome) model's
// training forwards: the last block's rate, rising linearly from 0 at the first block; each
// sample's residual branches dropped by a draw keyed by the model's seed, the step and the
// sample's global index; evaluation drops nothing. 0 (the default): none. Other architectures:
// VLMOE_ERR_CONFIG; a rate outside [0, 1): VLMOE_ERR_ARG.
VLMOE_API int vlmoe_model_set_drop_path(vlmoe_model *m, double rate);
// Forward pass with both modalities and the contrastive loss. A VL-MoE (arch mome) model with a
// retrieval head takes this path too (and backward, evaluate, the encoders below, and with them
// `vlmoe eval`, `embed` and `classify`): vlmoe_mome_forward_retrieval / vlmoe_mome_embed.
VLMOE_API int vlmoe_model_forward(vlmoe_model *m, const vlmoe_batch *batch, vlmoe_step_stats *stats);
// The same forward in evaluation mode (no routing noise, the eval capacity factor): the loss,
// accuracies and routing statistics of a held-out batch. Backward is not allowed after it.
VLMOE_API int vlmoe_model_evaluate(vlmoe_model *m, const vlmoe_batch *batch, vlmoe_step_stats *stats);
// Weight averaging ("model soups", LIMoE H/14): dst's parameters become the mean of the n
// models' (every config must equal dst's; message names the first that differs).
VLMOE_API int vlmoe_model_average(vlmoe_model *dst, vlmoe_model *const *models, int n);
// Zeroes the gradient buffer and back-propagates the last forward's loss.
VLMOE_API int vlmoe_model_backward(vlmoe_model *m);
// Clamps logit_scale into [0, log(max_temperature)] (after an optimizer step, like CLIP).
VLMOE_API void vlmoe_model_clamp(vlmoe_model *m);
// L2-normalised embeddings (n, embed_dim), computed in chunks of the planned batch size.
VLMOE_API int vlmoe_model_encode_images(vlmoe_model *m, const float *images, int n, float *out);
VLMOE_API int vlmoe_model_encode_texts(vlmoe_model *m, const int32_t *tokens, const int32_t *lengths, int n,
                                       float *out);
// Routing statistics of every MoE layer for the last forward pass (NULL, *count 0 if dense); a
// VL-MoE layer the last forward did not run (a V-MoE layer in a text encoding) has 0 tokens.
VLMOE_API const vlmoe_moe_stats *vlmoe_model_moe_stats(const vlmoe_model *m, int *count);
// One routing assignment of one token in the last forward pass (vlmoe_model_routing).
typedef struct {
    int32_t token;      // the token's row in the layer's pass: one_tower, all images' tokens then
                        // all texts' tokens of the modalities present; two_tower, the tower's;
                        // VL-MoE, the stream of the expert's modality
    int32_t example;    // its example: the sample index its routing noise is keyed by (the index
                        // in the batch)
    int32_t position;   // its position in its image or text sequence
    int32_t group;      // the routing group it was routed in (MOE.md "Grouped routing")
    int32_t group_pos;  // its position in the group: the fifo priority (one_tower groups hold
                        // whole examples, image tokens first unless moe.text_first)
    int32_t rank;       // which of the token's assignments: tokens choice, k-th largest gate
    int32_t expert;     // the expert; -1 for an experts-choice token that no expert took
    int32_t slot;       // its position in the expert's capacity buffer of the group, -1 if dropped
    float gate;         // the router's gate for this expert (noisy in training): what routing saw
    float weight;       // combine weight: the gate, renormalised with after_routing; 0 if dropped
    uint8_t modality;   // VLMOE_MOD_*
    uint8_t dropped;    // 1 if capacity dropped this assignment (or no expert took the token)
} vlmoe_token_route;
// The per-token routing decision of MoE layer `moe_layer` (indexed as vlmoe_model_moe_stats) in
// the last forward pass. Tokens choice: top_k entries per token, by token then rank (dropped ones
// included); experts choice: each token's accepted assignments by expert, or one entry with
// expert -1 if no expert took it. Sets *n to the number of entries; with out NULL only counts;
// cap < *n is VLMOE_ERR_ARG (nothing written). VLMOE_ERR_ARG also: moe_layer out of range, a
// Soft MoE layer (every token reaches every slot with a weight: no per-token decision; see
// vlmoe_moe_stats.soft_minmax), or a layer that routed no tokens in the last forward (no forward
// yet, or a VL-MoE layer the last encoding did not run). The entries agree with the layer's
// vlmoe_moe_stats (tokens, success, dropped, accepted).
VLMOE_API int vlmoe_model_routing(const vlmoe_model *m, int moe_layer, vlmoe_token_route *out, int cap,
                                  int *n);
// Sparse upcycling (CLIP-UP): a copy of dense model `dense` whose blocks named in moe->layers
// (and text_moe->layers for two_tower) become MoE layers: every expert a copy of the block's MLP
// (plus N(0, noise^2) if noise > 0), routers freshly initialised from seed, everything else
// copied. VLMOE_ERR_CONFIG if `dense` already has MoE layers.
VLMOE_API int vlmoe_model_upcycle(vlmoe_model **out, const vlmoe_model *dense, const vlmoe_moe_config *moe,
                                  const vlmoe_moe_config *text_moe, uint64_t seed, double noise);
// LIMoE expert pruning for one-modality inference (appendix E.4). usage holds, for each MoE
// layer of the tower serving `modality` (blocks in order), the share of that modality's tokens
// each expert processed (nmoe x E, e.g. vlmoe_moe_stats.accepted averaged over training); every
// layer keeps its `keep` most used experts. ROUTER_PRED (LIMoE's choice) keeps the softmax over
// all experts and masks the pruned ones out of the top-K; ROUTER_DROP removes them, router rows
// included, so the softmax renormalises over the kept ones and the model is smaller.
typedef enum { VLMOE_PRUNE_ROUTER_PRED = 0, VLMOE_PRUNE_ROUTER_DROP = 1 } vlmoe_prune_mode;
VLMOE_API int vlmoe_model_prune(vlmoe_model **out, const vlmoe_model *m, int modality, const double *usage,
                                int keep, vlmoe_prune_mode mode);
// Fails with VLMOE_ERR_NUMERIC naming the first parameter (or gradient) holding a NaN/Inf.
VLMOE_API int vlmoe_model_check_finite(const vlmoe_model *m, int grads);
// Weights + config in one safetensors file (atomic write); load validates names and shapes.
VLMOE_API int vlmoe_model_save(const vlmoe_model *m, const char *path);
VLMOE_API int vlmoe_model_load(vlmoe_model **out, const char *path);

// ---------------------------------------------------------------------------------------------
// VL-MoE (arch "mome", src/nn/mome.c; VL-MoE sec. 3, VLMo's MoME transformer): one transformer
// whose self-attention is shared and whose feed-forward is chosen by modality: V-FFN for image
// tokens, T-FFN for text tokens, and in the top vl_layers blocks VL-FFN for every token of an
// image-text pair. V-FFN/T-FFN of the blocks in `moe.layers` / `text_moe.layers` (only below the
// VL blocks) are sparse MoEs with their own routers (V-MoE: BPR, v-loss; T-MoE: load loss).
// Inputs: [I_CLS] + patch embeddings + image positions; [T_CLS] text [T_SEP] + text positions;
// a pair is the concatenation of both. Heads: MLM (width -> vocab) and MIM (width -> mim_vocab).
// VLMOE_ENC_CAPTION is a pair whose attention is BEiT-3's captioning mask: the image tokens
// attend to the image, each text token to the whole image and causally to the text up to itself.
typedef enum { VLMOE_ENC_IMAGE = 0, VLMOE_ENC_TEXT = 1, VLMOE_ENC_PAIR = 2, VLMOE_ENC_CAPTION = 3 } vlmoe_encoding;
// Tokens per sequence of an encoding: 1 + patches (image), context_length (text), their sum (pair).
VLMOE_API int vlmoe_mome_seq_len(const vlmoe_model_config *c, vlmoe_encoding enc);
// One encoding of B sequences with its masked-modeling targets.
typedef struct {
    vlmoe_encoding encoding;
    int batch_size;
    const float *images;         // (B,C,H,W): image and pair encodings
    const int32_t *tokens;       // (B,context_length) model input (after MLM corruption): text, pair
    const int32_t *lengths;      // (B) tokens before the padding, [T_CLS] and [T_SEP] included
    const int32_t *text_labels;  // (B,context_length) the id to predict, -1 where nothing is
                                 // predicted; NULL: no MLM loss
    const int32_t *patch_labels; // (B,num_patches) codebook id of each MASKED patch (its embedding
                                 // becomes the learned image mask token), -1 elsewhere; NULL: none
    const int32_t *class_labels; // (B) class in [0, num_classes) of each sequence for the
                                 // fine-tuning head; NULL: no classification loss
} vlmoe_mome_batch;
typedef struct {
    double loss;                 // text + image + aux
    double text, image;          // mean cross-entropy over the labelled text tokens / patches
    double aux;                  // weighted MoE auxiliary losses
    double text_acc, image_acc;  // top-1 accuracy of those predictions
    int text_count, image_count; // labelled positions
    double cls, cls_acc;         // classification head: mean cross-entropy, top-1 accuracy
    int cls_count;               // examples with a class label (B/cls_sequences, or 0)
    double itc, itc_acc[2];      // retrieval: contrastive loss, image->text and text->image top-1
    double itm, itm_acc;         // retrieval with the ITM head: mean matching cross-entropy over
                                 // the 3B pairs (B true, 2B hard negatives), its top-1 accuracy
} vlmoe_mome_stats;
// Forward of one encoding (training: routing noise and the train capacity factor). MLM is a text
// batch with text_labels, MIM an image batch with patch_labels, VLM a pair batch with both.
VLMOE_API int vlmoe_mome_forward(vlmoe_model *m, const vlmoe_mome_batch *b, int training, vlmoe_mome_stats *s);
// Back-propagates the last training forward's loss into the gradient buffer; accumulate = 0
// zeroes it first (the three objectives of a step accumulate into one buffer).
VLMOE_API int vlmoe_mome_backward(vlmoe_model *m, int accumulate);
// Final hidden states (after the last LayerNorm) of n inputs, out (n, seq_len, width), in eval
// mode; images (n,C,H,W) and/or tokens (n,ctx) + lengths as the encoding needs.
VLMOE_API int vlmoe_mome_encode(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                                const int32_t *lengths, int n, float *out);
// Fine-tuning heads (VL-MoE sec. 4.2, BEiT-3/VLMo's recipes): a linear head "cls_head" (num_classes,
// width) + bias, part of the model's parameter table when config.num_classes > 0, on a pooled final
// feature chosen by the encoding: image -> mean of the patch tokens' features ([I_CLS] excluded,
// BEiT's image classification), text -> the [T_CLS] feature (first token; MNLI-style sentence
// pairs are one text joined by [T_SEP]), pair -> the fused [T_CLS] of the pair (VQA as answer
// classification). The loss is the mean softmax cross-entropy over the batch's class_labels,
// added to the batch's other losses; vlmoe_trainer_step_mome trains it.
// With cls_sequences = 2 (NLVR2, VLMo/BEiT-3's recipe) an example is two consecutive sequences
// of the batch, typically the pairs (image 1, text) and (image 2, text): the head (num_classes,
// 2*width) sees their pooled features concatenated, and class_labels holds B/2 labels.
// A copy of mome model m with a freshly initialised head of num_classes (>= 2; seeded) and every
// other tensor copied; m may already have a head (it is replaced).
VLMOE_API int vlmoe_mome_with_head(vlmoe_model **out, const vlmoe_model *m, int num_classes, uint64_t seed);
// The same with every head chosen: num_classes 0 (none) or >= 2, cls_sequences 1 or 2, and
// retrieval_head 0/1 (below); all heads fresh, every other tensor copied.
VLMOE_API int vlmoe_mome_with_heads(vlmoe_model **out, const vlmoe_model *m, int num_classes, int cls_sequences,
                                    int retrieval_head, uint64_t seed);
// Class scores (n/cls_sequences, num_classes) of n inputs of an encoding, eval mode, in chunks.
VLMOE_API int vlmoe_mome_logits(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                                const int32_t *lengths, int n, float *out);
// Retrieval head (config retrieval_head = 1; VL-MoE sec. 4.2 fine-tunes retrieval contrastively
// with image and text encoded separately, as VLMo): the final [I_CLS] of an image-only encoding
// and the final [T_CLS] of a text-only encoding, each through its own linear projection
// "itc.image_proj" / "itc.text_proj" (embed_dim, width) and L2-normalised; the loss is the
// symmetric contrastive loss of the B x B similarities times exp(logit_scale) (as CLIP's).
// Normalised embeddings (n, embed_dim) of n images (VLMOE_ENC_IMAGE) or texts (VLMOE_ENC_TEXT).
VLMOE_API int vlmoe_mome_embed(vlmoe_model *m, vlmoe_encoding enc, const float *images, const int32_t *tokens,
                               const int32_t *lengths, int n, float *out);
// The contrastive loss of B matching image-text pairs (training: routing noise, train capacity):
// s->itc, s->itc_acc, s->aux (both encodings' MoE losses), s->loss = itc + aux. Routing
// statistics (vlmoe_model_moe_stats) are then the image side's.
VLMOE_API int vlmoe_mome_forward_retrieval(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths,
                                           int B, int training, vlmoe_mome_stats *s);
// Back-propagates the last training retrieval forward (accumulate = 0 zeroes the gradients first).
VLMOE_API int vlmoe_mome_backward_retrieval(vlmoe_model *m, int accumulate);

// Image-text matching with hard negatives (VL-MoE sec. 4.2 fine-tunes retrieval "jointly with
// image-text contrastive and image-text matching with hard negative mining objectives as in
// VLMo"; VLMo/ALBEF's recipe), config itm_head = 1 (src/nn/mome_itm.c, src/loss/itm.c).
// Mining: sim (B,B) the contrastive logits of image i against text j (a copy: no gradient flows
// through the choice). Image i's negative text is j != i with probability
// exp(sim[i][j]) / sum_{k != i} exp(sim[i][k]) (softmax of its row, the positive left out), text
// j's negative image i != j likewise over column j. p_text (B,B) row i and p_image (B,B) row j
// get those probabilities (either may be NULL); neg_text[i] and neg_image[j] the draws, by
// inverse CDF of one uniform each from the counter-based stream (key, row, side): the same key
// gives the same negatives on any machine and after a resume, whatever was drawn before.
// B >= 2 and finite similarities, else VLMOE_ERR_ARG.
VLMOE_API int vlmoe_itm_mine(const float *sim, int B, uint64_t key, double *p_text, double *p_image,
                             int32_t *neg_text, int32_t *neg_image);
// The draw key of training step `step` of a run seeded by `seed`.
VLMOE_API uint64_t vlmoe_itm_key(uint64_t seed, long step);
// A copy of mome model m with fresh retrieval and ITM heads (retrieval_head = itm_head = 1; no
// classification head), every other tensor copied.
VLMOE_API int vlmoe_mome_with_itm(vlmoe_model **out, const vlmoe_model *m, uint64_t seed);
// The contrastive loss of the B pairs of b (images, tokens, lengths, batch_size; the rest
// unused) plus the ITM loss: hard negatives mined from the contrastive logits with `key`, then
// one pair forward of 3B sequences: (image i, text i) labelled matched, (image i, its negative
// text) and (text j's negative image, text j) unmatched; ITM is the mean 2-way cross-entropy of
// the head on their fused [T_CLS]. s->loss = itc + itm + aux (all three forwards' MoE losses),
// VLMo's equal weights. vlmoe_mome_backward_retrieval back-propagates both losses.
VLMOE_API int vlmoe_mome_forward_retrieval_itm(vlmoe_model *m, const vlmoe_mome_batch *b, uint64_t key, int training,
                                               vlmoe_mome_stats *s);
// ITM scores of n image-text pairs (eval mode, in chunks): out[i] = logit(matched) -
// logit(unmatched) of pair i (images (n,C,H,W), tokens (n,ctx), lengths (n)).
VLMOE_API int vlmoe_mome_itm_scores(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths,
                                    int n, float *out);
// Retrieval recall@K re-ranked by ITM (VLMo's / ALBEF's inference): pairs i = (images i, text i)
// of n, ranked first by the contrastive similarity of their embeddings (img, txt (n,E)
// L2-normalised), then each query's top `rerank` candidates re-ordered by the ITM score (ties to
// the contrastive order); candidates below the top `rerank` keep their contrastive order after
// them. i2t[q] / t2i[q]: fraction of queries whose own pair is among the top ks[q] (q < nk).
VLMOE_API int vlmoe_mome_itm_recall(vlmoe_model *m, const float *images, const int32_t *tokens, const int32_t *lengths,
                                    const float *img, const float *txt, int n, int rerank, const int *ks, int nk,
                                    double *i2t, double *t2i);

// Masking (src/data/masking.c), seeded: the same seed gives the same masks on any machine.
typedef struct {
    double prob;         // fraction of text tokens to predict: 0.15 (MLM), 0.5 (VLM)
    double mask_frac;    // of those, replaced by [MASK]: 0.8
    double random_frac;  // replaced by a random token from [random_lo, random_hi): 0.1 (rest kept)
    int32_t mask_id, random_lo, random_hi;
} vlmoe_mlm_params;
// BERT's defaults for a config: 0.15 / 0.8 / 0.1, its mask_token, random tokens among the ids
// >= 4 (after the synthetic tokenizer's PAD/SOT/EOT/UNK) other than [MASK].
VLMOE_API vlmoe_mlm_params vlmoe_mlm_default_params(const vlmoe_model_config *c);
// Each token strictly between [T_CLS] (position 0) and [T_SEP] (position len-1) is chosen with
// probability prob; a chosen token gets its label and is replaced by [MASK] (mask_frac), a random
// token (random_frac) or kept. input, labels (B,T): input ids and labels (-1 where not chosen).
// Sequence b draws from its own stream (seed, b).
VLMOE_API int vlmoe_mlm_mask(const vlmoe_mlm_params *p, uint64_t seed, const int32_t *tokens,
                             const int32_t *lengths, int B, int T, int32_t *input, int32_t *labels);
// Captioning (BEiT-3's recipe, which VL-MoE follows for COCO captions, VL-MoE appendix):
// fine-tuning is masked language modeling on VLMOE_ENC_CAPTION pairs (vlmoe_caption_mask picks the
// masked text tokens); decoding (src/nn/mome_caption.c) is autoregressive: the caption so far
// ([T_CLS] w1 .. wt-1) with [MASK] appended at position t, the MLM head's prediction at the
// [MASK] becomes wt, until [T_SEP] or max_len tokens. Greedy (argmax; never [MASK] or [T_CLS]).
typedef struct {
    int32_t bos, eos;    // the tokenizer's [T_CLS] (SOT) and [T_SEP] (EOT) ids
    int max_len;         // tokens of a caption with bos and eos, in [2, context_length]; 0: context_length
} vlmoe_caption_params;
// tokens (n, context_length): bos, the words, eos, then 0; lengths (n) with bos and eos.
VLMOE_API int vlmoe_mome_caption(vlmoe_model *m, const float *images, int n, const vlmoe_caption_params *p,
                                 int32_t *tokens, int32_t *lengths);
// BEiT-3's captioning masks: of a caption of len tokens, round(prob * len) clamped to [1, len-1]
// distinct positions in [1, len) ([T_SEP] included, so the model learns to stop; [T_CLS] never)
// get their label; a chosen token is replaced by [MASK] (mask_frac), a random token in
// [random_lo, random_hi) (random_frac) or kept. Sequence b draws from its own stream (seed, b).
// input, labels (B,T) as vlmoe_mlm_mask's.
VLMOE_API int vlmoe_caption_mask(const vlmoe_mlm_params *p, uint64_t seed, const int32_t *tokens,
                                 const int32_t *lengths, int B, int T, int32_t *input, int32_t *labels);
// CIDEr-D (src/eval/cider.c; Vedantam et al. 2015, as the COCO caption evaluation computes it) of n
// candidate captions against image i's references refs[ref_off[i] .. ref_off[i+1]) (ref_off (n+1),
// ref_off[0] = 0, every image >= 1 reference): n-grams of 1..4 lowercased words, tf-idf with the
// document frequencies over the n reference sets, per n the cosine with the candidate's weights
// clipped by the reference's, times exp(-(lc-lr)^2 / 72), averaged over n and references, times
// 10. *score: the mean over images; per_image (n) or NULL. One image scores 0 (log 1 idf).
VLMOE_API int vlmoe_cider_d(const char *const *cands, int n, const char *const *refs, const int *ref_off,
                            double *score, double *per_image);
// BEiT's block-wise masking (BEiT sec. 2.5, Algorithm 1, its masking_generator): rectangles of
// at least min(16, target) patches with log-uniform aspect ratio in [0.3, 1/0.3] are added until
// target = round(ratio * h * w) patches are masked (a block that would overshoot is redrawn; the
// loop ends when 10 draws in a row add nothing). mask (h*w): 1 = masked.
VLMOE_API int vlmoe_mim_block_mask(int h, int w, double ratio, uint64_t seed, uint8_t *mask);

// Discrete visual tokens (src/data/kmeans.c): a k-means codebook over raw patch vectors stands in
// for BEiT's image tokenizer. x (n, dim) -> centroids (K, dim): k-means++ seeding, then Lloyd's
// iterations until no assignment changes or `iters`; an empty cluster takes the point farthest
// from its centroid. *inertia (may be NULL): the final mean squared distance.
VLMOE_API int vlmoe_kmeans(const float *x, size_t n, int dim, int K, int iters, uint64_t seed,
                           float *centroids, double *inertia);
// Nearest centroid (squared Euclidean, ties to the lower id) of each of n vectors.
VLMOE_API void vlmoe_kmeans_assign(const float *centroids, int K, int dim, const float *x, size_t n, int32_t *ids);
// A codebook file: safetensors with "codebook" (K, dim) F32 and metadata "vlmoe.codebook".
VLMOE_API int vlmoe_codebook_save(const char *path, const float *centroids, int K, int dim);
// Loads a codebook (malloc'd; free()); fails unless K and dim are as expected (> 0 to check).
// A VL-MoE model file that carries one (below) is a codebook file too.
VLMOE_API int vlmoe_codebook_load(const char *path, int want_K, int want_dim, float **centroids, int *K, int *dim);
// The codebook travels with a mome model: a copy attached here (NULL detaches; K must be
// mim_vocab and dim channels x patch_size^2) is saved with the weights, loaded back by
// vlmoe_model_load and kept by vlmoe_mome_with_heads. NULL when the model has none.
VLMOE_API int vlmoe_mome_set_codebook(vlmoe_model *m, const float *centroids, int K, int dim);
VLMOE_API const float *vlmoe_mome_codebook(const vlmoe_model *m);
// images (B,C,H,W) -> raw patch vectors (B, num_patches, C*P*P), the order the model embeds.
VLMOE_API int vlmoe_patchify(const vlmoe_model_config *c, const float *images, int B, float *patches);
// MIM labels of B images: block masks of `ratio` (seed, image b) and the codebook id of every
// masked patch; labels (B, num_patches), -1 where not masked. The codebook must have mim_vocab
// entries of dimension C*P*P.
VLMOE_API int vlmoe_mim_labels(const vlmoe_model_config *c, const float *codebook, int K, const float *images,
                               int B, double ratio, uint64_t seed, int32_t *labels);

// ---------------------------------------------------------------------------------------------
// Training (src/train/): one optimisation step = forward, backward, divergence guard, clipping,
// schedule, optimizer update, temperature clamp. Nothing is allocated inside a step.
typedef struct {
    vlmoe_optim_params optim;
    vlmoe_schedule schedule;  // base_lr, warmup, total steps, ...
    double grad_clip_norm;    // 0 = off
    int freeze_moe;           // fine-tuning (VL-MoE sec. 4.2): every router and expert tensor
                              // (names holding ".moe.") is left out of the optimizer and its
                              // gradient zeroed before clipping, so it stays bit-identical
                              // (weight decay and old moments do not move it either)
    // LiT-style locking (OpenCLIP's --lock-image / --lock-text), two_tower models only (the
    // one_tower encoder is both towers): a locked tower is frozen as freeze_moe freezes, but
    // for its last unlocked groups. Groups of a tower of L blocks, counted from the end as
    // OpenCLIP does: 1 the projection, 2 the last block with the final LayerNorm, then one per
    // block, L+2 the stem (patch/token embedding, class token, positions, ln_pre).
    int lock_image, lock_image_unlocked_groups;
    int lock_text, lock_text_unlocked_layers;
    // data parallelism (mpirun): the gradient is summed over the processes in buckets of at most
    // this many megabytes (10^6 bytes, whole parameters), each started as soon as the backward
    // has finished it, overlapped with the rest of the backward (PyTorch DDP's bucket_cap_mb,
    // default 25); 0: one sum of the whole gradient after the backward. The bits do not depend on it.
    double bucket_cap_mb;
} vlmoe_train_params;
VLMOE_API vlmoe_train_params vlmoe_train_default_params(void);

typedef struct vlmoe_trainer vlmoe_trainer;
VLMOE_API int vlmoe_trainer_init(vlmoe_trainer **out, vlmoe_model *m, const vlmoe_train_params *p);
VLMOE_API void vlmoe_trainer_free(vlmoe_trainer *t);
// One step on a batch. A non-finite loss or gradient returns VLMOE_ERR_NUMERIC naming the tensor
// and leaves the parameters untouched.
VLMOE_API int vlmoe_trainer_step(vlmoe_trainer *t, const vlmoe_batch *b, vlmoe_step_stats *stats);
// One VL-MoE step (arch mome): the forward and backward of every part (e.g. a text batch with
// MLM labels, an image batch with MIM labels, a pair batch with both: VL-MoE's equally weighted
// objectives), their gradients summed, then the same guard, clipping, schedule and update.
// part_stats (nparts, may be NULL) gets each part's losses; stats the totals.
VLMOE_API int vlmoe_trainer_step_mome(vlmoe_trainer *t, const vlmoe_mome_batch *parts, int nparts,
                                      vlmoe_mome_stats *part_stats, vlmoe_step_stats *stats);
// One retrieval fine-tuning step (vlmoe_mome_forward_retrieval, then the update).
VLMOE_API int vlmoe_trainer_step_mome_retrieval(vlmoe_trainer *t, const float *images, const int32_t *tokens,
                                                const int32_t *lengths, int B, vlmoe_mome_stats *s, vlmoe_step_stats *stats);
// One retrieval fine-tuning step with ITM and hard negatives (vlmoe_mome_forward_retrieval_itm
// with the key vlmoe_itm_key(seed, step), then the update): a resumed run draws the same negatives.
VLMOE_API int vlmoe_trainer_step_mome_itm(vlmoe_trainer *t, const vlmoe_mome_batch *b, uint64_t seed,
                                          vlmoe_mome_stats *s, vlmoe_step_stats *stats);
VLMOE_API long vlmoe_trainer_get_step(const vlmoe_trainer *t);
VLMOE_API vlmoe_optim *vlmoe_trainer_optim(vlmoe_trainer *t);
VLMOE_API vlmoe_model *vlmoe_trainer_model(vlmoe_trainer *t);
VLMOE_API const vlmoe_train_params *vlmoe_trainer_params(const vlmoe_trainer *t);

// Checkpoints (src/train/checkpoint.c). A checkpoint is two files, each written atomically
// (temporary file, fsync, rename): the weights (WEIGHTS, a vlmoe model file) and the training
// state (STATE: optimizer moments, step, the routing-noise counter, the data position, the
// data RNG). Parameters or moments holding a NaN/Inf are never written (VLMOE_ERR_NUMERIC). The
// optimizer state is stored per parameter tensor, keyed by the parameter's name and shaped like it
// (optim.adamw.m.<param>; layout in src/train/checkpoint.c), so it does not depend on how the
// parameters are laid out; state files of version 1 (one flat vector per buffer) are still read.
typedef struct {
    uint64_t data_position;  // index of the next training sample (over all epochs)
    uint64_t data_rng[4];    // state of the data order's RNG (shuffling), if any; the loader's
                             // order is a function of (seed, epoch, index): it keeps its seed here
    int64_t data_epoch;      // loader: epoch of the next sample
    int64_t data_index;      // loader: index of the next sample within its epoch
    int64_t data_block[2];   // loader, webdataset: (shard in the epoch's shard order, tar member)
                             // where the shuffle block holding the next sample starts
} vlmoe_data_state;
VLMOE_API int vlmoe_trainer_save(const vlmoe_trainer *t, const char *weights_path, const char *state_path,
                                 const vlmoe_data_state *data);
// Restores weights and state saved by vlmoe_trainer_save into a trainer whose model has the same
// config and whose optimizer is of the same kind; every tensor is validated before anything is
// changed, so a failed load leaves the trainer as it was.
VLMOE_API int vlmoe_trainer_load(vlmoe_trainer *t, const char *weights_path, const char *state_path,
                                 vlmoe_data_state *data);
// The model's routing-noise RNG: {seed, training forwards so far}; the next training forward
// draws its noise from both. Saved in the training state so a resumed run draws the same noise.
VLMOE_API void vlmoe_model_get_rng(const vlmoe_model *m, uint64_t state[2]);
VLMOE_API void vlmoe_model_set_rng(vlmoe_model *m, const uint64_t state[2]);

// Fills a batch of n samples of the synthetic data, indices first..first+n-1 of `split`:
// images (n, 3, H, W), tokens (n, ctx) and lengths (n). Samples are generated in parallel;
// the result does not depend on the thread count.
VLMOE_API int vlmoe_synth_batch(const vlmoe_synth *s, int split, uint64_t first, int n, int ctx,
                                float *images, int32_t *tokens, int32_t *lengths);

// ---------------------------------------------------------------------------------------------
// Evaluation (src/eval/)
// Zero-shot: image embeddings (n, E) against class embeddings (C, E), all L2-normalised.
// Counts top-1/top-5 hits against labels (ties broken toward the lower class index).
VLMOE_API void vlmoe_zeroshot_accuracy(const float *img, int n, const float *classes, int C, int E,
                                       const int32_t *labels, double *top1, double *top5);
// Mean image->text and text->image top-1 accuracy of matched pairs (n, E), scored within
// consecutive chunks of `chunk` pairs (chance 1/chunk); the last partial chunk counts too.
VLMOE_API void vlmoe_pair_accuracy(const float *img, const float *txt, int n, int E, int chunk,
                                   double *i2t, double *t2i);
// A tokenizer for vlmoe_class_embeddings: writes text's ids (ctx, SOT .. EOT then padding) and
// returns how many precede the padding (>= 2), or a value < 2 with the message set on failure.
typedef int (*vlmoe_tokenize_fn)(void *user, const char *text, int32_t *ids, int ctx);
// Class embeddings by prompt ensembling (CLIP): each of the nt templates with its "{}" replaced by
// the class name, tokenized (context_length ids), encoded, averaged per class and re-normalised.
// out: (C, embed_dim). A template without "{}" is VLMOE_ERR_ARG naming it.
VLMOE_API int vlmoe_class_embeddings(vlmoe_model *m, const char *const *classes, int C,
                                     const char *const *templates, int nt, vlmoe_tokenize_fn tokenize,
                                     void *user, float *out);
// The same for the synthetic classes with their templates and tokenizer. out: (num_classes, embed_dim).
VLMOE_API int vlmoe_synth_class_embeddings(vlmoe_model *m, const vlmoe_synth *s, float *out);

// Retrieval recall@K, CLIP / OpenCLIP's COCO and Flickr protocol (src/eval/metrics.c). img
// (n_img, E) and txt (n_txt, E) are L2-normalised and scored by dot product; txt_image (n_txt)
// is the image caption j describes (COCO: 5 captions per image; every image needs at least one).
// i2t[q]: fraction of images with ANY of their captions among the top ks[q] texts; t2i[q]:
// fraction of captions whose image is among the top ks[q] images (q < nk). Ties are pessimistic:
// a wrong candidate scoring exactly as the (best) true one ranks ahead of it, so ties never
// inflate recall. ks[q] >= 1, txt_image in [0, n_img), finite embeddings, else VLMOE_ERR_ARG.
// Allocates score blocks of at most 1024 query rows (VLMOE_ERR_NOMEM if that fails).
VLMOE_API int vlmoe_retrieval_recall(const float *img, int n_img, const float *txt, int n_txt,
                                     const int32_t *txt_image, int E, const int *ks, int nk, double *i2t,
                                     double *t2i);
// vlmoe_retrieval_recall with duplicate captions and OpenCLIP's ranks. txt_group (n_txt, values in
// [0, n_txt); NULL: every caption its own text) marks captions that are the same text: a text
// query is then correct for every image owning a caption of its group, and an image query for
// every caption of such a group (CLIP_benchmark's positive pairs), so repeated captions ("a
// photo of a dog" under several images) no longer count as misses. mean_rank / median_rank (may
// be NULL): [0] image->text, [1] text->image, OpenCLIP's get_clip_metrics (1-based position of
// the first positive, ties pessimistic as above; median = floor(median) + 1).
typedef struct {
    const float *img;          // (n_img, E) L2-normalised
    int n_img;
    const float *txt;          // (n_txt, E) L2-normalised
    int n_txt, E;
    const int32_t *txt_image;  // (n_txt) the image caption j describes
    const int32_t *txt_group;  // (n_txt) or NULL
    const int *ks;             // (nk) the K of recall@K
    int nk;
} vlmoe_retrieval_data;
VLMOE_API int vlmoe_retrieval_metrics(const vlmoe_retrieval_data *d, double *i2t, double *t2i, double mean_rank[2],
                                      double median_rank[2]);
// Ridge regression on frozen features, as in big_vision's few-shot evaluator: targets are
// 2 onehot - 1 (+1 for the class, -1 elsewhere); features are centred by the train mean so the
// bias is unregularised; W = (Xc^T Xc + lambda I)^-1 Xc^T Y in double (LAPACK dposv), lambda >= 0.
// w (dim, classes), b (classes): the scores of a feature row x are x^T w + b. A matrix that is not
// numerically positive definite (lambda = 0 with rank-deficient centred features, e.g. whenever
// n <= dim) is VLMOE_ERR_ARG naming lambda: no jitter is added behind the caller's back.
VLMOE_API int vlmoe_ridge_fit(const float *x, const int32_t *y, int n, int dim, int classes, double lambda,
                              double *w, double *b);
// Few-shot linear evaluation (LIMoE's 10-shot protocol): fits the ridge probe on train for every
// lambda in lambdas (nl), keeps the one with the best accuracy on the held-out val set (ties:
// the larger lambda; val may be empty when nl == 1), and writes its test accuracy (argmax of
// the scores, ties to the lower class) and the lambda. Features (n, dim), labels in [0, classes).
VLMOE_API int vlmoe_fewshot_ridge(const float *train_x, const int32_t *train_y, int n_train,
                                  const float *test_x, const int32_t *test_y, int n_test, int dim,
                                  int classes, const double *lambdas, int nl, const float *val_x,
                                  const int32_t *val_y, int n_val, double *accuracy, double *chosen_lambda);
// K-shot subset: out_idx (classes, shots) gets `shots` distinct random indices of each class's
// samples, class-major, each class's in increasing order. Deterministic in seed; each class draws
// from its own stream, so for one seed a smaller `shots` picks a subset of a larger one.
// VLMOE_ERR_ARG if a class has fewer than `shots` samples.
VLMOE_API int vlmoe_fewshot_sample(const int32_t *labels, int n, int classes, int shots, uint64_t seed,
                                   int32_t *out_idx);

// ---------------------------------------------------------------------------------------------
// Pretrained CLIP weights (src/io/clip_import.c): OpenAI/OpenCLIP state-dict names
// ("visual.transformer.resblocks.N.attn.in_proj_weight", "visual.proj" stored width x embed, ...)
// or HF CLIPModel names ("vision_model.encoder.layers.N.self_attn.q_proj.weight",
// "visual_projection.weight", ...) <-> vlmoe's two_tower layout (OpenAI CLIP's computation).
typedef struct {
    const char *naming;          // "openclip", "hf" or "auto" (from the keys; NULL = auto)
    int image_heads, text_heads; // attention heads, not in any shape: 0 = width / 64 (OpenCLIP)
    int act;                     // VLMOE_ACT_*: quick_gelu (OpenAI), gelu (most OpenCLIP-trained);
                                 // -1 (the default): the folder's config, else quick_gelu
    const char *name;            // the config's name (NULL = "clip")
} vlmoe_clip_import_params;
VLMOE_API vlmoe_clip_import_params vlmoe_clip_import_default_params(void);
// Reads a CLIP checkpoint (F32, F16 or BF16; keys may share a prefix such as "module."), infers
// widths, depths, MLP sizes, patch and image size, context length, vocabulary and embedding size
// from the shapes. A missing tensor, a wrong shape, or a tensor that is not part of the
// architecture (other than position_ids / attn_mask buffers) is VLMOE_ERR_FORMAT naming the file
// and the tensor.
VLMOE_API int vlmoe_clip_import(vlmoe_model **out, const char *path, const vlmoe_clip_import_params *p);
// Writes a dense two_tower model with CLIP names ("openclip" or "hf") as F32, F16 or BF16;
// VLMOE_ERR_CONFIG for MoE or one_tower models. Importing the result gives the model back.
VLMOE_API int vlmoe_clip_export(const vlmoe_model *m, const char *path, const char *naming, vlmoe_dtype dtype);
// A CLIP as people download it (src/io/clip_folder.c): a Hugging Face folder (config.json,
// model.safetensors, tokenizer.json or vocab.json + merges.txt, preprocessor_config.json), an
// OpenCLIP folder (open_clip_config.json, open_clip_model.safetensors), or one safetensors file.
// A folder's config gives heads, act and LayerNorm eps (p's heads and act, when set, must agree
// with it: else VLMOE_ERR_ARG), every size it names is checked against the tensors, and its
// tokenizer and image normalisation are recorded in the model. A file gives no heads: with none
// in p, a width whose head count is ambiguous is VLMOE_ERR_CONFIG listing the candidates. PyTorch
// pickles (.pt, .bin) are VLMOE_ERR_FORMAT saying how to convert them; vlmoe never runs one.
VLMOE_API int vlmoe_clip_import_path(vlmoe_model **out, const char *path, const vlmoe_clip_import_params *p);
typedef struct {
    const char *to;            // "hf" (transformers' CLIPModel), "open_clip" or "torch" (vlmoe_torch.py)
    int force;                 // write into a folder that is not empty (over the files export writes)
    vlmoe_dtype dtype;         // hf / open_clip tensors: F32 (default), F16 or BF16
    const char *torch_module;  // "torch": the text of python/vlmoe_torch.py, copied into the folder
    size_t torch_module_len;
} vlmoe_export_params;
VLMOE_API vlmoe_export_params vlmoe_export_default_params(void);
// Writes m into folder dir (created if absent; a non-empty one only with force) for another
// library to load (src/io/clip_export.c). hf and open_clip need a dense two_tower CLIP
// (VLMOE_ERR_CONFIG otherwise, before anything is written); torch takes one_tower and two_tower
// models, MoE included.
VLMOE_API int vlmoe_model_export_dir(const vlmoe_model *m, const char *dir, const vlmoe_export_params *p);

#ifdef __cplusplus
}
#endif
#endif
