// model.h: the model's layout (offsets of every parameter in the flat buffer, derived once from
// the config), the towers' compute graph (encode over a planned activation arena, then the
// contrastive loss step), the per-architecture table (model_arch) and the model object. The
// graph is compiled for float and double (src/nn/graph.c); the layout is type-free. This header
// names no architecture's internals: VL-MoE's are in src/nn/mome.h, which includes this one.
// Covered by tests/test_model.c and tests/test_parity.c.
#ifndef VLMOE_MODEL_H
#define VLMOE_MODEL_H
#include "ops/backend.h"
#include "ops/ops.h"
#include "vlmoe.h"

enum { MOD_IMAGE = 0, MOD_TEXT = 1, NUM_MOD = 2 };
enum { FFN_MLP = 0, FFN_MOE = 1 };

// The feed-forward of one block: a dense MLP or an MoE layer (src/moe/layer.c).
typedef struct {
    int kind;                        // FFN_MLP or FFN_MOE
    size_t fc1_w, fc1_b, fc2_w, fc2_b; // MLP, or the experts' stacked (E, ...) weights
    size_t router_w;                 // (E, D), tokens/experts choice
    size_t phi, scale;               // Soft MoE slots (D, E, P) and scale
    int moe_index;                   // this MoE layer's row in the model's routing statistics
    unsigned split;                  // bit k: bank k (fc1_w, fc1_b, fc2_w, fc2_b) holds only the
                                     // layout's shard of the experts (model_shard), not all E
} ffn_layout;

typedef struct {
    size_t ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b;
    ffn_layout ffn;
} block_layout;

typedef struct {
    int width, layers, heads, mlp;
    block_layout *blocks;            // (layers)
    size_t lnf_w, lnf_b;             // final LayerNorm
    const vlmoe_moe_config *moe;     // points into the layout's config
} encoder_layout;

typedef struct {
    int enc;                         // which encoder runs this modality
    int seq;                         // tokens per sequence (image: patches + class token)
    int has_cls, has_ln_pre, pool, causal;
    size_t embed_w, embed_b;         // patch embedding (D, C*P*P) + bias, or token table (V, D)
    size_t cls, pos, ln_pre_w, ln_pre_b, proj;
} modality_layout;

#define NO_PARAM ((size_t)-1)

struct mome_layout; // src/nn/mome.h
struct model_arch;  // below

// Which experts a layout holds (expert parallelism, docs/DISTRIBUTED.md "Sharding the expert
// parameters"): process `rank` of a group of `size` holds experts [rank E/size, (rank+1) E/size)
// of every (E, ...) bank of the towers' token- and experts-choice MoE layers, but of the banks
// keep_whole (may be NULL) says to hold whole (Adafactor factored over the expert dimension).
// Each split bank takes E/size experts' floats in the flat buffer, so every offset after it
// shifts: the layout is per process. size 1: every bank whole, the one-process layout.
typedef struct {
    int rank, size;
    int (*keep_whole)(void *user, const vlmoe_param_info *bank); // the bank as held whole
    void *user;
} model_shard;

typedef struct {
    vlmoe_model_config cfg;
    int nenc;
    encoder_layout enc[2];
    modality_layout mod[NUM_MOD];
    size_t logit_scale;
    vlmoe_param_info *table;
    int nparams;
    size_t total;                    // floats in the flat buffer
    int nmoe;                        // MoE layers in the model
    struct mome_layout *mome;        // arch mome: the modality experts and heads (else NULL)
    const struct model_arch *arch;   // the architecture's entry points (model_layout_build)
    model_shard shard;               // the experts it holds (size 1: all)
    int nsplit;                      // banks held split (0: the whole model)
} model_layout;

// Builds the parameter table one named tensor at a time (model.c, and mome_model.c for mome).
typedef struct {
    model_layout *L;
    int cap;
    size_t off;
} table_builder;
// Appends one named parameter of shape (d0[, d1[, d2]]) and returns its offset (NO_PARAM when
// out of memory).
size_t layout_add(table_builder *tb, const char *name, int decay, int ndim, int64_t d0, int64_t d1,
                  int64_t d2);
// A feed-forward named "<prefix>.mlp.*" (dense), or "<prefix>.moe.*" when block l is one of mc's
// MoE layers (mc may be NULL: dense), experts stacked (E, ...).
// "<prefix>.ln1.*", "<prefix>.attn.qkv.*", "<prefix>.attn.out.*": a block's attention half.
void layout_add_attention(table_builder *tb, block_layout *b, int D, const char *prefix);
void layout_add_ffn(table_builder *tb, ffn_layout *f, const vlmoe_moe_config *mc, int l, int D, int M,
                    const char *prefix);

// Validates cfg, picks the architecture (L->arch) and builds its parameter table.
int model_layout_build(model_layout *L, const vlmoe_model_config *cfg);
// The same for a shard of the experts (sh NULL: the whole model). VLMOE_ERR_CONFIG when size does
// not divide a bank's E, or for VL-MoE (whose layers are not split).
int model_layout_build_shard(model_layout *L, const vlmoe_model_config *cfg, const model_shard *sh);
void model_layout_free(model_layout *L);
// Seeded initialisation of a flat buffer (float), ViT/CLIP-style (see model.c). A split bank gets
// its experts' slice of the whole bank's draws: every shard starts from the one-process values.
// VLMOE_ERR_NOMEM (a split bank's scratch) is the only failure.
int model_layout_init_params(const model_layout *L, float *params, uint64_t seed);

// Reads weights saved by vlmoe_model_save into an existing model of the same config; the model
// is unchanged unless every tensor reads back valid and finite.
typedef struct vlmoe_model vlmoe_model;
int model_load_into(vlmoe_model *m, const char *path);
// The same, with check(user, f) run on the open file before anything is read (a checkpoint's
// pairing with its state file, src/train/checkpoint.c); its error stops the load.
int model_load_into_checked(vlmoe_model *m, const char *path, int (*check)(void *user, const vlmoe_st *f),
                            void *user);
// A safetensors writer holding m as vlmoe_model_save writes it (config, parameters, inputs), for a
// caller that adds metadata or orders the file's rename itself; freed by the caller.
int model_writer(const vlmoe_model *m, vlmoe_st_writer **out);

// What one forward computes: contrastive stats, and which modalities are present.
typedef struct {
    double loss, acc[2];
    double aux;            // weighted MoE auxiliary losses (included in loss)
} graph_result;

struct vlmoe_dist; // src/dist/dist.h

#define GRAPH_DECL(T, S)                                                                       \
    typedef struct graph_##S graph_##S;                                                          \
    int graph_create_##S(graph_##S **out, const model_layout *L, const vlmoe_backend_##S *be,   \
                         int B);                                                                 \
    void graph_free_##S(graph_##S *g);                                                           \
    /* checkpoint: gradient checkpointing; keep_attn: without it, every block keeps its     */  \
    /* attention for the backward (1), recomputes it (0), or keeps it where that adds at most */  \
    /* a quarter to the activation arena (-1) (graph.c); graph_create is 0, 0                 */  \
    int graph_create_ckpt_##S(graph_##S **out, const model_layout *L, const vlmoe_backend_##S *be, \
                              int B, int checkpoint, int keep_attn);                             \
    /* a frozen modality's tower gets no backward (two_tower LiT: every tensor of its head, */  \
    /* encoder and stem is frozen, and their gradients stay as they are); 0 at creation */       \
    void graph_set_frozen_##S(graph_##S *g, int modality, int frozen);                           \
    /* bytes of the activation arena planned at creation (MoE layers' own buffers apart) */     \
    size_t graph_activation_bytes_##S(const graph_##S *g);                                       \
    /* whether its blocks keep their attention for the backward (keep_attn, as decided) */       \
    int graph_keeps_attention_##S(const graph_##S *g);                                           \
    /* The towers: images (B,C,H,W) or NULL, tokens (B,T)+lens or NULL -> the normalised */      \
    /* embeddings of each given modality (graph_embeddings); *aux (may be NULL) gets the pass's */ \
    /* weighted MoE auxiliary losses */                                                         \
    int graph_encode_##S(graph_##S *g, const T *params, const T *images, const int32_t *tokens,  \
                         const int32_t *lens, double *aux);                                     \
    /* backward of the last encode: demb[m] (B, embed_dim) d(loss)/d(embeddings) of each */      \
    /* modality it encoded; the MoE auxiliary losses' gradients included; grads accumulate */    \
    void graph_encode_backward_##S(graph_##S *g, const T *params, T *grads,                      \
                                   const T *const demb[NUM_MOD]);                                \
    /* encode, then the contrastive loss (its own step, below) when both modalities are given */ \
    int graph_forward_##S(graph_##S *g, const T *params, const T *images, const int32_t *tokens, \
                          const int32_t *lens, graph_result *res);                              \
    /* accumulates d(loss)/d(params) of the last graph_forward's loss into grads (caller zeroes) */ \
    void graph_backward_##S(graph_##S *g, const T *params, T *grads);                            \
    /* (B, embed_dim) normalised embeddings of the last forward, per modality */                 \
    const T *graph_embeddings_##S(const graph_##S *g, int modality);                            \
    /* the global index of the batch's first sample (data parallelism: rank x batch), which */  \
    /* keys each token's routing noise; 0 at creation */                                        \
    void graph_set_sample_base_##S(graph_##S *g, uint64_t base);                                 \
    /* the backward calls ready(user, offset) with the offset of every parameter whose gradient */ \
    /* it has finished, as soon as it has (a block's after the block): data parallelism starts */ \
    /* the gradient buckets' sums from it (src/train/buckets.c). NULL: none, as at creation */    \
    void graph_set_grad_ready_##S(graph_##S *g, void (*ready)(void *user, size_t offset), void *user); \
    /* expert parallelism of every MoE layer over d's processes (NULL: off) */                  \
    int graph_set_expert_parallel_##S(graph_##S *g, struct vlmoe_dist *d);                       \
    /* training: noise and the train capacity factor; seed draws the routing noise */           \
    void graph_set_mode_##S(graph_##S *g, int training, uint64_t seed);                          \
    /* the next encode's images as bytes (host memory, p's shape: B, channels, image_size), */   \
    /* which the table stages and normalises (backend.h pixels_*); its images must be NULL */    \
    void graph_set_pixels_##S(graph_##S *g, const uint8_t *pix, const be_pixels *p);              \
    /* the next graph_forward leaves its loss, accuracies and logit scale in out (4 doubles of */ \
    /* the table's memory: contrastive_forward_dsc, which reads the scale from the parameters */ \
    /* there) and returns NaN for them; the MoE layers' auxiliary values go to aux_slots     */  \
    /* (aux_cap doubles of the table's memory, moe_aux_sink in src/moe/layer.h) */               \
    void graph_set_step_scalars_##S(graph_##S *g, double *out, double *aux_slots, int aux_cap);  \
    /* the slots the last forward filled (to download), and in *need the slots it wanted */      \
    int graph_aux_slots_##S(const graph_##S *g, int *need);                                      \
    /* the auxiliary losses' total of the last deferred forward from the host copy of its */     \
    /* slots, its MoE statistics' aux[] filled (moe_aux_sink_take) */                            \
    double graph_take_aux_##S(graph_##S *g, const double *slots);                                \
    const vlmoe_moe_stats *graph_moe_stats_##S(const graph_##S *g, int *count);                 \
    /* The symmetric contrastive loss over B pairs of normalised embeddings, a step of its own */ \
    /* so it can run on embeddings gathered from elsewhere (src/loss/contrastive.c kernels). */   \
    typedef struct contrastive_step_##S contrastive_step_##S;                                    \
    int contrastive_step_create_##S(contrastive_step_##S **out, const vlmoe_backend_##S *be,     \
                                    int B, int E);                                               \
    void contrastive_step_free_##S(contrastive_step_##S *c);                                     \
    /* loss of img (B,E) against txt (B,E) at logit scale exp(*scale) (scale: one element of */  \
    /* the backend's memory); acc: i2t and t2i top-1. img and txt stay unchanged until backward */\
    double contrastive_step_forward_##S(contrastive_step_##S *c, const T *img, const T *txt,     \
                                        const T *scale, double *acc);                            \
    /* the same with the values and the scale read left in out (backend.h */                    \
    /* contrastive_forward_dsc); its backward reads the scale there too */                       \
    void contrastive_step_forward_dev_##S(contrastive_step_##S *c, const T *img, const T *txt,   \
                                          const T *scale, double *out);                          \
    /* dimg, dtxt (B,E) and *dscale ACCUMULATE dloss times the last forward's gradients */       \
    void contrastive_step_backward_##S(contrastive_step_##S *c, T *dimg, T *dtxt, T *dscale,    \
                                       double dloss);

GRAPH_DECL(float, f32)
GRAPH_DECL(double, f64)

// The codebook as tensor "codebook" + its metadata key, as in a codebook file (src/data/kmeans.c).
int codebook_add(vlmoe_st_writer *w, const float *centroids, int K, int dim);
int codebook_present(const vlmoe_st *f);

struct mome_model; // src/nn/mome_model.c

// One architecture behind the model object, chosen once by model_layout_build: the towers
// (one_tower, two_tower: src/nn/towers_model.c) or VL-MoE (arch mome: src/nn/mome_model.c).
// model.c reaches an architecture only through this table.
typedef struct model_arch {
    const char *name;
    // the parameter table of cfg (valid; L zeroed but for arch); model_layout_free on failure
    int (*layout_build)(model_layout *L, const vlmoe_model_config *cfg);
    void (*layout_free)(model_layout *L);    // what layout_build added (NULL: nothing)
    int (*init)(vlmoe_model *m);              // the model's own state once the parameters exist
                                              // (NULL: none)
    void (*free)(vlmoe_model *m);             // graphs and state (init may have failed halfway)
    // the graphs planned on the model's table, its own state kept: what a new table, a new
    // layout or another arena (src/nn/device.c, model.c) plans again
    void (*drop_graphs)(vlmoe_model *m);
    int (*plan)(vlmoe_model *m, int B);       // vlmoe_model_plan
    // vlmoe_model_forward (training 1) and vlmoe_model_evaluate (0), vlmoe_model_backward
    int (*forward)(vlmoe_model *m, const vlmoe_batch *b, vlmoe_step_stats *stats, int training);
    int (*backward)(vlmoe_model *m);
    // vlmoe_model_encode_images (MOD_IMAGE) and _texts (MOD_TEXT)
    int (*encode)(vlmoe_model *m, int modality, const float *images, const int32_t *tokens,
                  const int32_t *lens, int n, float *out);
    const vlmoe_moe_stats *(*moe_stats)(const vlmoe_model *m, int *count);
    // the MoE layer behind routing-statistics index `index` in the last planned graph (NULL: none)
    const struct moe_state_f32 *(*moe_layer)(const vlmoe_model *m, int index);
    // tensors a model file carries besides the parameter table (NULL: none)
    int (*save)(const vlmoe_model *m, vlmoe_st_writer *w);
    int (*load)(vlmoe_model *m, const vlmoe_st *f, const char *path);
} model_arch;

extern const model_arch model_arch_towers; // src/nn/towers_model.c
extern const model_arch model_arch_mome;   // src/nn/mome_model.c

// The model object behind the public handle (model.c; the architectures' parts in their files).
// Whether the config a --model argument names fixes the vocabulary size: a JSON file that gives
// "vocab_size" (or is complete, without "base"); a named model's vocabulary is a default.
int config_sets_vocab(const char *path);

// What a model file says about its inputs (src/nn/inputs.c, the metadata keys listed there):
// its tokenizer, or the synthetic data's word tokenizer, and its image normalisation. Commands
// read data the way the model was trained on it unless told otherwise; a model from a config, an
// import or an older file says nothing (text MODEL_TEXT_UNKNOWN, has_norm 0).
enum { MODEL_TEXT_UNKNOWN, MODEL_TEXT_SYNTH, MODEL_TEXT_BPE };
typedef struct {
    int text;                // MODEL_TEXT_*
    char *tokenizer;         // MODEL_TEXT_BPE: vlmoe_tokenizer_to_text's text (malloc'd)
    size_t tokenizer_len;
    int has_norm;            // mean and std were recorded
    float mean[3], std[3];
} model_inputs;

struct vlmoe_model {
    model_layout L;                // L.arch: the architecture
    const vlmoe_backend_f32 *be;   // where the graphs run (the CPU table unless chosen otherwise)
    float *params, *grads;
    uint64_t wver;                 // the weights' version: changed by every write of params
                                   // the model knows of (model_weights_changed)
    graph_f32 *g;                  // towers: the graph planned for planned_B
    struct mome_model *mome;       // arch mome: its graphs, retrieval head and codebook
    int planned_B;
    int have_forward;
    int grad_ckpt;           // towers: gradient checkpointing (vlmoe_model_set_grad_checkpointing)
    int attn_recompute;      // towers: vlmoe_model_set_attention_recompute's mode (-1: by precision)
    int frozen[NUM_MOD];     // towers: model_set_frozen_towers
    uint64_t seed;           // the init seed: also seeds the routing noise
    uint64_t forwards;       // training forwards so far: the routing noise of the next one
    struct vlmoe_dist *dist; // data parallelism (model_set_dist): the loss over every process's batch
    struct vlmoe_dist *experts; // and the group of processes the MoE layers' experts are split over
    // data parallelism: told of each parameter whose gradient the backward finished (the towers'
    // data-parallel backward only; model_set_grad_ready)
    void (*grad_ready)(void *user, size_t offset);
    void *grad_ready_user;
    struct towers_dp *dp;    // towers: the gathered embeddings and the loss step over them
    struct towers_accum *accum; // towers: gradient accumulation's cached embeddings and statistics
    int accum_stats;         // the last training step was accumulated: its merged routing statistics
    // a backend without host memory (--device cuda): the parameters stay in params (the master
    // copy the optimizer, checkpoints and every host reader use) and are uploaded to d_params
    // before each forward; backward writes d_grads, downloaded into grads. Resident (below):
    // d_params and d_grads are the masters
    float *d_params, *d_grads;
    struct vlmoe_backend_f32 *owned_be; // a table opened for this model (backend_cuda_free)
    struct model_int8 *int8; // --precision int8: the quantized weights its table reads (device.c)
    model_inputs in;         // saved with the weights
    const uint8_t *pix;      // model_set_pixels: the next forward's images as bytes
    be_pixels pixp;
    // a device step's scalars (model_defer_scalars): MODEL_SCALARS doubles of the table's memory
    // (loss, acc_i2t, acc_t2i, logit scale, gradient sum of squares, non-finite flag), read in
    // one download
    double *d_scalars;
    int aux_cap;             // after them, slots for the auxiliary losses' values (moe_aux_sink)
    double *h_scalars;       // the host's copy (MODEL_SCALARS + aux_cap)
    int defer;               // the next training forward leaves its scalars on the device
    int deferred;            // the last one did: model_take_scalars reads them after the backward
    double aux_deferred;     // and its auxiliary losses (known on the host: the routing's)
    // resident (model_go_resident, one process's AdamW steps): d_params and d_grads are the
    // master copies and params, grads mirrors, downloaded when read (model_sync_host), the
    // logit scale's float too (a deferred step reads it on the device and downloads its value)
    int resident;
    int host_stale;          // d_params changed since params was downloaded
    int dev_stale;           // params written on the host since d_params was uploaded
    int grads_stale;         // d_grads holds a gradient grads has not seen
};
#define MODEL_SCALARS 6
// Slots for the auxiliary losses' values at first (a step that wants more waits for the rest
// and the next step plans room: model_defer_scalars).
#define MODEL_AUX_SLOTS 256

// The model's inputs (src/nn/inputs.c). set_tokenizer: tok's text, or the synthetic word
// tokenizer when tok is NULL. model_tokenizer: the recorded BPE tokenizer (*out NULL when the
// model records none: check model_get_inputs(m)->text); path names the file in errors.
// model_copy_inputs: dst says what src says (a pruned, souped or upcycled model).
struct vlmoe_tokenizer;
int model_set_tokenizer(vlmoe_model *m, const struct vlmoe_tokenizer *tok);
void model_set_image_norm(vlmoe_model *m, const float mean[3], const float std[3]);
const model_inputs *model_get_inputs(const vlmoe_model *m);
int model_copy_inputs(vlmoe_model *dst, const vlmoe_model *src);
int model_tokenizer(const vlmoe_model *m, const char *path, struct vlmoe_tokenizer **out);
void model_inputs_free(model_inputs *in);
// Whether m records a BPE tokenizer with the same text as tok (the same ids for every text).
int model_same_tokenizer(const vlmoe_model *m, const struct vlmoe_tokenizer *tok);
// The metadata entries of m's inputs, and reading them back (errors name path and the key).
int model_inputs_save(const vlmoe_model *m, vlmoe_st_writer *w);
int model_inputs_load(vlmoe_model *m, const vlmoe_st *f, const char *path);

// Runs the model on backend table be (model_set_device opens it by name). A table without host
// memory gets device copies of the parameters and gradients; the graphs are planned again on it.
// owned: the model frees it (may be NULL). VL-MoE models stay on a table with host memory.
int model_set_backend(vlmoe_model *m, const vlmoe_backend_f32 *be, vlmoe_backend_f32 *owned);
// The parameters as the graphs read them: params, or d_params refreshed from params.
const float *model_params_for_graph(vlmoe_model *m);
// The next forward's (or trainer step's) images as bytes (B, S, S, C) (hwc) or (B, C, S, S), with
// the normalisation of vlmoe_image_params (src/data/loader.h vlmoe_loader_pixels): the model's
// table normalises them (backend.h pixels_normalize), a device receiving a quarter of the bytes.
// The batch's images must then be NULL. Towers models, one plain or data-parallel forward (not
// accumulated micro-batches); an error names what does not fit. pix NULL clears it.
int model_set_pixels(vlmoe_model *m, const uint8_t *pix, int hwc, const float mean[3], const float std[3]);
// A trainer step on a device (a table without host memory, towers, one plain batch): the next
// training forward leaves the loss and accuracies on the device and its stats' loss NaN, the
// backward adds the gradient's sum of squares and non-finite flag there, and model_take_scalars
// reads them in one download into *s (loss, contrastive, acc_i2t, acc_t2i), *sumsq and *nonfinite
// (over the whole gradient). 0 when the model took no such step (a host table: nothing deferred).
void model_defer_scalars(vlmoe_model *m);
int model_take_scalars(vlmoe_model *m, vlmoe_step_stats *s, double *sumsq, int *nonfinite);
// Resident parameters (src/nn/device.c; the trainer's one-process AdamW steps on a table without
// host memory, towers with the step's scalars on the device): 0 where that does not apply.
// After it the backward leaves the gradient on the device (no download), the trainer updates
// d_params there and calls model_params_changed; a forward uploads only after a host write.
// model_sync_host brings params and grads up to date (every host reader: vlmoe_model_param_data,
// _grad_data, check_finite, model_writer call it); model_host_written marks params written there
// (loading, vlmoe_model_param_data); model_leave_resident makes the host's copy the master again.
int model_go_resident(vlmoe_model *m);
void model_leave_resident(vlmoe_model *m);
void model_sync_host(const vlmoe_model *m);
void model_host_written(vlmoe_model *m);
void model_params_changed(vlmoe_model *m);
// The table that works on params and grads (the host's when the model runs on a device).
const vlmoe_backend_f32 *model_host_backend(const vlmoe_model *m);

// The weights' version (never 0), and its change, which every write of m->params calls; the
// public vlmoe_model_param_data counts as one (its caller may write). Whoever keeps something
// made from the weights (the bf16 shadows of src/ops/gemm_bf16.h) keeps it for one version.
uint64_t model_weights_version(const vlmoe_model *m);
void model_weights_changed(vlmoe_model *m);
// Frees the device copies and the table the model opened (vlmoe_model_free).
void model_release_backend(vlmoe_model *m);

// Data parallelism (src/train/trainer.c sets it for a run): training forwards of the towers take
// the contrastive loss over the embeddings of every process's batch (gathered in rank order) and
// key the routing noise by global sample index; NULL or a world of one: this process alone.
// experts (NULL: none): a group of d's processes (d itself, or a split of it) over which every MoE
// layer's experts are split: each process computes its share for the tokens of every process of
// its group (src/moe/layer.c).
void model_set_dist(vlmoe_model *m, struct vlmoe_dist *d, struct vlmoe_dist *experts);
// The hook graph_set_grad_ready describes, for the towers' data-parallel backward (the gathered
// loss's logit_scale first, then the graph's parameters); NULL: none. Other backwards (VL-MoE,
// accumulation, a world of one) never call it: their gradients are all final at their end.
void model_set_grad_ready(vlmoe_model *m, void (*ready)(void *user, size_t offset), void *user);

// The expert banks that expert parallelism splits (src/train/trainer.c shards their gradient
// reduction and optimizer state): every (E, ...) tensor of the towers' token- and experts-choice
// MoE layers (Soft MoE layers are not split), from the layout: offset, floats per expert (one
// expert's slice is contiguous, experts being the leading dimension) and E. Writes at most cap
// and returns how many there are.
// offset and the experts held: [e0, e0 + El) of E (the whole bank, e0 0 and El E, unless the
// layout is a shard: model_shard).
typedef struct {
    size_t offset, per;
    int E;
    int e0, El;
} model_bank;
int model_expert_banks(const vlmoe_model *m, model_bank *out, int cap);
// Gives m the layout of shard sh (NULL: the whole model): the parameters are copied where both
// layouts hold them, experts only the new layout holds are zero (the caller fills them: the
// trainer's gathers), the gradients are new and zero, the graphs are planned again for the batch
// size planned before. Host memory only; the towers only. m is unchanged on failure.
int model_reshard(vlmoe_model *m, const model_shard *sh);

// Gradient accumulation (src/nn/towers_accum.c; OpenCLIP's --accum-freq): the gradient of one
// step over the n micro-batches mb (of one batch size B each) as one batch of n*B pairs, in order
// (with data parallelism, this process's block of the global batch of W*n*B pairs, gathered in
// rank order): the contrastive loss sees every pair of the accumulated batch, the MoE auxiliary
// losses are the mean of the micro-batches' (the mean over routing groups when groups hold whole
// examples and split every micro-batch), the routing noise is drawn once for the step and keyed
// by each sample's index in the accumulated batch. Leaves the gradients in m->grads (no backward
// to call); stats and vlmoe_model_moe_stats describe the accumulated batch (vlmoe_model_routing
// the last micro-batch's tokens). Only the embeddings of the accumulated batch are kept between
// the micro-batches, not their activations: each micro-batch runs forward twice. towers only:
// VLMOE_ERR_CONFIG for another architecture.
int model_accumulate(vlmoe_model *m, const vlmoe_batch *mb, int n, vlmoe_step_stats *stats);
// The merged routing statistics of the last accumulated step (NULL unless m->accum_stats), and
// the accumulation buffers' release (towers_free).
const vlmoe_moe_stats *towers_accum_stats(const vlmoe_model *m, int *count);
void towers_accum_free(vlmoe_model *m);
// Two_tower LiT (src/train/trainer.c): the backward skips the image / text tower, every tensor of
// which the trainer keeps frozen, so their gradients stay zero. One_tower models share one
// encoder between the modalities: VLMOE_ERR_CONFIG; VL-MoE too.
int model_set_frozen_towers(vlmoe_model *m, int image, int text);

// --device: "cpu" (the default) or "cuda[:N]" (src/nn/device.c); an error naming what is missing
// when the model cannot run there.
int model_set_device(vlmoe_model *m, const char *name);
// --precision: "fp32" (the default) or "bf16" (src/nn/device.c; after model_set_device). bf16
// runs the products of linear layers and experts in bf16 on a CPU that has it natively; on one
// that does not, the model stays fp32 and *fell_back is set to 1 (the caller says so). "int8"
// (inference: vlmoe_model_forward refuses to train) quantizes the MLP and expert weights as they
// are now and runs those products in int8 on a CPU with VNNI or AVX2 (else fp32, *fell_back 1), the
// attention's linears in bf16 where the CPU has it; "int8-attn" quantizes those too; weights
// changed later are not seen until it is set again.
// On a CUDA device bf16 picks the device table's cuda-bf16 twin (backend_cuda_bf16) and fp32
// goes back; int8 is refused there.
int model_set_precision(vlmoe_model *m, const char *name, int *fell_back);
// Whether --precision int8 holds an int8 copy of the weights at w (a parameter of m's).
int model_int8_covers(const vlmoe_model *m, const float *w);
// What the towers' graph is asked for (graph_create_ckpt's keep_attn) by
// vlmoe_model_set_attention_recompute's mode: keep (0), recompute (1), or by default keep where
// the products run in bf16 on the CPU and keeping adds at most a quarter to the activations.
int model_keep_request(const vlmoe_model *m);
// Whether the planned towers' blocks keep their attention for the backward (0 before a plan).
int model_keeps_attention(const vlmoe_model *m);

#endif
