// graph.c: forward and backward of a whole model (one_tower LIMoE layout or two_tower CLIP
// layout) over one activation arena planned for a batch size: nothing is allocated per step.
// An encoder runs all the sequences assigned to it as one token buffer (image segment first,
// then text): attention stays inside each sequence, every other layer sees all tokens at once,
// which is where a one_tower MoE layer shares routing groups across modalities. Every block is
// the one block of src/nn/block.c with a single feed-forward part over all active tokens.
// Gradient checkpointing (graph_create_ckpt): each block keeps only its output (the next block's
// input); its other activations live in one set shared by the blocks of the encoder, which the
// backward refills by running the block's forward again just before the block's backward; that
// set holds the attention probabilities and output too, so the block's backward uses the ones
// its forward just made. Without checkpointing, the blocks' backward recomputes the attention's
// probabilities and output from the kept qkv (Megatron's selective recomputation), or, with
// keep_attn, each block keeps its own from the forward: B H T^2 + B T D more floats a block for
// one attention forward less in each block's backward (-1: where that adds at most a quarter to
// the activation arena, as in bench-s, 18%, or limoe-S/16, 23%, and not where the attention's
// probabilities weigh more, as in B/16, 26%, or limoe-L/16, 41%). The bits are the same either
// way.
// Compiled as float and double (src/core/real.h). Covered by tests/test_model.c (finite
// differences over all parameters) and tests/test_parity.c (PyTorch, one and five AdamW steps).
#include <math.h>
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "moe/layer.h"
#include "nn/block.h"
#include "nn/model.h"
#include "nn/routing.h"
#include "ops/backend.h"

typedef struct {
    R(block_acts) a;
    struct R(moe_state) *moe; // the MoE layer's own buffers, when this block has one
    moe_spec spec;
} layer_acts;

typedef struct {
    const encoder_layout *E;
    size_t ntok;                 // tokens of all segments
    attn_segment seg[NUM_MOD];
    size_t att_off[NUM_MOD];     // offset of each segment's attention probabilities
    size_t natt;                 // attention probabilities of all segments
    int mod_of_seg[NUM_MOD], nseg;
    attn_segment live[NUM_MOD];  // the segments present in this forward, and their offsets
    size_t live_off[NUM_MOD];
    R(block_pass) pass;          // the blocks' shared scratch and this forward's token range
    real *x0, *lnf, *lnf_m, *lnf_r, *dlnf;
    layer_acts *layers;
    uint8_t *modality;           // (ntok) VLMOE_MOD_* of every token
    uint64_t *keys;              // (ntok) every token's routing-noise key (moe_token_key)
    moe_examples ex;             // both modalities (one_tower): routing groups hold whole examples
} enc_state;

typedef struct {
    int present;
    int seg;                     // segment index inside its encoder
    real *patches, *pemb, *pre, *pre_m, *pre_r; // image stem
    real *images;                // (B,C,H,W) the forward's images: uploaded (device memory), or
                                 // normalised from bytes (graph_set_pixels)
    real *pooled, *proj, *emb, *norm;
    real *dpre, *dpemb, *dpooled, *dproj, *demb;
    int32_t *tokens, *lens;      // text: copies kept for backward
} mod_state;

struct R(graph) {
    const model_layout *L;
    const R(vlmoe_backend) *be;  // every kernel, and the arena's memory
    int B;
    enc_state enc[2];
    mod_state mod[NUM_MOD];
    struct R(contrastive_step) *loss; // graph_forward's loss step over this graph's B pairs
    int have_loss;
    real *arena;
    size_t arena_n, ints_n;
    int32_t *ints;
    int training;
    uint64_t seed;
    double aux;
    vlmoe_moe_stats *stats;      // (L->nmoe)
    uint64_t sample_base;        // global index of this batch's first sample (noise keys)
    int ckpt;                    // gradient checkpointing: blocks recomputed in the backward
    int keep_attn;               // blocks keep their attention for the backward (no checkpointing)
    real *kept;                  // their storage (kept_n floats), made by the first training forward
    size_t kept_n;
    int frozen[NUM_MOD];         // graph_set_frozen: the backward skips the modality's tower
    vlmoe_moe_stats recomputed;  // where a recomputed MoE layer writes its statistics, so the
                                 // forward's are the only ones the model reports
    void (*ready)(void *user, size_t offset); // graph_set_grad_ready
    void *ready_user;
    const uint8_t *pix;          // graph_set_pixels: the next encode's images as host bytes
    be_pixels pixp;
    double *scal;                // graph_set_step_scalars: the next forward's loss and accuracies
                                 // stay in the table's memory (the logit scale read there too)
    moe_aux_sink sink;           // and its auxiliary losses' values (the MoE layers write there)
};

void R(graph_set_step_scalars)(struct R(graph) *g, double *out, double *aux_slots, int aux_cap) {
    g->scal = out;
    g->sink.slots = aux_slots, g->sink.cap = aux_slots ? aux_cap : 0;
}

int R(graph_aux_slots)(const struct R(graph) *g, int *need) {
    if (need) *need = g->sink.need;
    return g->sink.used;
}

double R(graph_take_aux)(struct R(graph) *g, const double *slots) {
    g->sink.mode = MOE_AUX_OFF;
    return moe_aux_sink_take(&g->sink, slots);
}

void R(graph_set_pixels)(struct R(graph) *g, const uint8_t *pix, const be_pixels *p) {
    g->pix = pix;
    if (p) g->pixp = *p;
}

void R(graph_set_grad_ready)(struct R(graph) *g, void (*ready)(void *user, size_t offset), void *user) {
    g->ready = ready, g->ready_user = user;
}

// Tells the hook that the gradients of these n parameters (NO_PARAM: absent) are final.
static void report(const struct R(graph) *g, const size_t *offs, int n) {
    for (int i = 0; g->ready && i < n; i++)
        if (offs[i] != NO_PARAM) g->ready(g->ready_user, offs[i]);
}

static void report_block(const struct R(graph) *g, const block_layout *b) {
    const ffn_layout *f = &b->ffn;
    const size_t o[] = {b->ln1_w, b->ln1_b, b->qkv_w, b->qkv_b, b->out_w, b->out_b, b->ln2_w, b->ln2_b,
                        f->fc1_w, f->fc1_b, f->fc2_w, f->fc2_b, f->router_w, f->phi, f->scale};
    report(g, o, (int)(sizeof(o) / sizeof(o[0])));
}

// Every token's routing-noise key: its sample's global index (sample_base + row of the batch),
// modality and position, so a sample draws the same noise on whichever process holds it.
static void set_keys(struct R(graph) *g) {
    for (int e = 0; e < g->L->nenc; e++) {
        enc_state *s = &g->enc[e];
        for (int k = 0; k < s->nseg; k++) {
            const attn_segment *sg = &s->seg[k];
            const int mod = s->mod_of_seg[k] == MOD_TEXT ? VLMOE_MOD_TEXT : VLMOE_MOD_IMAGE;
            for (size_t i = 0; i < (size_t)sg->nseq * sg->seqlen; i++)
                s->keys[sg->tok_off + i] = moe_token_key(g->sample_base + i / (size_t)sg->seqlen, mod,
                                                         (int)(i % (size_t)sg->seqlen));
        }
    }
}

int R(graph_set_expert_parallel)(struct R(graph) *g, struct vlmoe_dist *d) {
    for (int e = 0; e < g->L->nenc; e++)
        for (int l = 0; l < g->L->enc[e].layers; l++) {
            int st = g->enc[e].layers[l].moe ? R(moe_set_expert_parallel)(g->enc[e].layers[l].moe, d) : VLMOE_OK;
            if (st) return vlmoe_error_prefix("encoder %d block %d", e, l), st;
        }
    return VLMOE_OK;
}

void R(graph_set_sample_base)(struct R(graph) *g, uint64_t base) {
    if (g->sample_base == base) return;
    g->sample_base = base;
    set_keys(g);
}

static void plan(struct R(graph) *g, carver *c) {
    const model_layout *L = g->L;
    const vlmoe_model_config *cfg = &L->cfg;
    const int B = g->B, E = cfg->embed_dim;
    for (int e = 0; e < L->nenc; e++) {
        enc_state *s = &g->enc[e];
        s->E = &L->enc[e];
        s->ntok = 0;
        s->nseg = 0;
        size_t natt = 0;
        const int D = s->E->width, H = s->E->heads, M = s->E->mlp;
        for (int m = 0; m < NUM_MOD; m++) {
            if (L->mod[m].enc != e) continue;
            const int T = L->mod[m].seq;
            attn_segment *sg = &s->seg[s->nseg];
            sg->tok_off = s->ntok;
            sg->nseq = B;
            sg->seqlen = T;
            sg->causal = L->mod[m].causal;
            sg->lens = NULL;
            sg->prefix = 0;
            s->att_off[s->nseg] = natt;
            s->mod_of_seg[s->nseg] = m;
            g->mod[m].seg = s->nseg++;
            s->ntok += (size_t)B * T;
            natt += (size_t)B * H * T * T;
        }
        const size_t n = s->ntok;
        s->natt = natt;
        s->x0 = carve(c, n * D);
        const int nl = s->E->layers, ckpt = g->ckpt && nl > 0;
        R(block_plan_pass)(c, &s->pass, n, natt, D, M, 0, ckpt);
        if (ckpt) {
            // one set of block activations for the encoder, the last block's after the forward
            // (its backward needs no recompute), and every other block's output
            int dense = 0;
            for (int l = 0; l < nl; l++) dense |= s->E->blocks[l].ffn.kind != FFN_MOE;
            R(block_acts) w;
            R(block_plan)(c, &w, n, natt, D, M, dense);
            for (int l = 0; l < nl; l++) {
                R(block_acts) *a = &s->layers[l].a;
                *a = w;
                if (s->E->blocks[l].ffn.kind == FFN_MOE) a->h = NULL;
                if (l < nl - 1) a->res2 = carve(c, n * D);
            }
        } else {
            for (int l = 0; l < nl; l++)
                R(block_plan)(c, &s->layers[l].a, n, 0, D, M, s->E->blocks[l].ffn.kind != FFN_MOE);
        }
        s->lnf = carve(c, n * D);
        s->lnf_m = carve(c, n);
        s->lnf_r = carve(c, n);
        s->dlnf = carve(c, n * D);
    }
    for (int m = 0; m < NUM_MOD; m++) {
        const modality_layout *ml = &L->mod[m];
        mod_state *ms = &g->mod[m];
        const int D = L->enc[ml->enc].width, T = ml->seq;
        if (m == MOD_IMAGE) {
            const int np = (cfg->image_size / cfg->patch_size) * (cfg->image_size / cfg->patch_size);
            const int pd = cfg->channels * cfg->patch_size * cfg->patch_size;
            // every table: the images normalised from bytes (graph_set_pixels) land here; a table
            // with host memory reads float images where they are
            ms->images = carve(c, (size_t)B * cfg->channels * cfg->image_size * cfg->image_size);
            ms->patches = carve(c, (size_t)B * np * pd);
            ms->pemb = carve(c, (size_t)B * np * D);
            ms->dpemb = carve(c, (size_t)B * np * D);
        }
        ms->pre = carve(c, (size_t)B * T * D);
        ms->pre_m = carve(c, (size_t)B * T);
        ms->pre_r = carve(c, (size_t)B * T);
        ms->dpre = carve(c, (size_t)B * T * D);
        ms->pooled = carve(c, (size_t)B * D);
        ms->proj = carve(c, (size_t)B * E);
        ms->emb = carve(c, (size_t)B * E);
        ms->norm = carve(c, (size_t)B);
        ms->dpooled = carve(c, (size_t)B * D);
        ms->dproj = carve(c, (size_t)B * E);
        ms->demb = carve(c, (size_t)B * E);
    }
}

// The blocks' kept attention (keep_attn without checkpointing), carved from kept (NULL: counted
// only): each block's probabilities and output, in the arena's layout. An encoder whose
// modalities are all frozen has no backward: its blocks keep none (their pointers stay NULL, so
// a backward after unfreezing recomputes).
static size_t plan_kept(struct R(graph) *g, real *kept) {
    carver c = {kept, 0};
    for (int e = 0; e < g->L->nenc; e++) {
        enc_state *s = &g->enc[e];
        int frozen = 1;
        for (int m = 0; m < NUM_MOD; m++) frozen &= g->L->mod[m].enc != e || g->frozen[m];
        for (int l = 0; l < s->E->layers && !frozen; l++) {
            s->layers[l].a.att = carve(&c, s->natt);
            s->layers[l].a.atty = carve(&c, s->ntok * (size_t)s->E->width);
        }
    }
    return c.used;
}

// The first training forward makes the kept storage: inference never runs a backward, so a
// graph that only encodes holds none. Where it cannot be had, the backward recomputes (the
// same bits).
static void make_kept(struct R(graph) *g) {
    if (!g->keep_attn || g->kept || !g->training) return;
    const size_t n = plan_kept(g, NULL); // kept_n less the frozen encoders'
    g->kept = n ? g->be->alloc(g->be, sizeof(real) * n, "the blocks' kept attention") : NULL;
    if (g->kept) plan_kept(g, g->kept);
    else g->keep_attn = 0; // none to keep, or no memory for it: recomputed, the same bits
}

int R(graph_create)(struct R(graph) **out, const model_layout *L, const R(vlmoe_backend) *be, int B) {
    return R(graph_create_ckpt)(out, L, be, B, 0, 0);
}

int R(graph_create_ckpt)(struct R(graph) **out, const model_layout *L, const R(vlmoe_backend) *be, int B,
                         int checkpoint, int keep_attn) {
    *out = NULL;
    if (B < 1) return vlmoe_fail(VLMOE_ERR_ARG, "batch size must be >= 1, got %d", B);
    struct R(graph) *g = vlmoe_calloc(sizeof(*g), "graph");
    if (!g) return VLMOE_ERR_NOMEM;
    g->L = L;
    g->be = be;
    g->B = B;
    g->ckpt = checkpoint != 0;
    for (int e = 0; e < L->nenc; e++) {
        g->enc[e].layers = vlmoe_calloc(sizeof(layer_acts) * (size_t)L->enc[e].layers, "layer acts");
        if (!g->enc[e].layers) return R(graph_free)(g), VLMOE_ERR_NOMEM;
    }
    carver c = {NULL, 0};
    plan(g, &c);
    if (!g->ckpt && keep_attn) {
        g->kept_n = plan_kept(g, NULL);
        // -1: kept where that adds at most a quarter to the arena
        g->keep_attn = keep_attn > 0 || g->kept_n * 4 <= c.used;
    }
    g->arena_n = c.used;
    g->arena = be->alloc(be, sizeof(real) * c.used, "activation arena");
    const size_t T = (size_t)L->mod[MOD_TEXT].seq;
    g->ints = be->alloc(be, sizeof(int32_t) * ((size_t)B * T + (size_t)B), "token copies");
    if (!g->arena || !g->ints) return R(graph_free)(g), VLMOE_ERR_NOMEM;
    c = (carver){g->arena, 0};
    plan(g, &c);
    g->stats = vlmoe_calloc(sizeof(vlmoe_moe_stats) * (size_t)(L->nmoe + 1), "routing statistics");
    if (!g->stats) return R(graph_free)(g), VLMOE_ERR_NOMEM;
    int st = R(contrastive_step_create)(&g->loss, be, B, L->cfg.embed_dim);
    if (st) return R(graph_free)(g), st;
    // the image bytes' staging, planned once for the batch (a CUDA table's pinned buffers)
    if (L->mod[MOD_IMAGE].seq > 0 &&
        !be->pixels_stage(be, NULL, (size_t)B * L->cfg.channels * L->cfg.image_size * L->cfg.image_size))
        return R(graph_free)(g), vlmoe_error_prefix("image staging"), VLMOE_ERR_NOMEM;
    for (int e = 0; e < L->nenc; e++) {
        enc_state *s = &g->enc[e];
        s->modality = vlmoe_alloc(s->ntok + 1, "token modalities");
        s->keys = vlmoe_alloc(sizeof(uint64_t) * (s->ntok + 1), "token noise keys");
        if (!s->modality || !s->keys) return R(graph_free)(g), VLMOE_ERR_NOMEM;
        for (int k = 0; k < s->nseg; k++) {
            const attn_segment *sg = &s->seg[k];
            const int mod = s->mod_of_seg[k] == MOD_TEXT ? VLMOE_MOD_TEXT : VLMOE_MOD_IMAGE;
            memset(s->modality + sg->tok_off, mod, (size_t)sg->nseq * sg->seqlen);
            s->ex.tokens[mod] = sg->seqlen;
        }
        s->ex.B = s->nseg == NUM_MOD ? B : 0; // images then texts: groups of whole pairs (MOE.md)
        for (int l = 0; l < L->enc[e].layers; l++) {
            const ffn_layout *f = &L->enc[e].blocks[l].ffn;
            if (f->kind != FFN_MOE) continue;
            layer_acts *a = &s->layers[l];
            a->spec = (moe_spec){L->enc[e].moe, L->enc[e].width, L->enc[e].mlp, L->cfg.act,
                                 f->router_w, f->fc1_w, f->fc1_b, f->fc2_w, f->fc2_b, f->phi, f->scale,
                                 l < 64 ? L->enc[e].moe->pruned[l] : 0, f->split, L->shard.rank, L->shard.size};
            st = R(moe_state_create)(&a->moe, &a->spec, be, (int)s->ntok);
            if (st) return R(graph_free)(g), st;
            R(moe_set_aux_sink)(a->moe, &g->sink);
            g->stats[f->moe_index].encoder = e;
            g->stats[f->moe_index].block = l;
        }
    }
    set_keys(g);
    // backward visits one layer at a time: every MoE layer can use the same backward buffers
    struct R(moe_state) **all = vlmoe_alloc(sizeof(*all) * ((size_t)L->nmoe + 1), "MoE layer list");
    if (!all) return R(graph_free)(g), VLMOE_ERR_NOMEM;
    for (int e = 0; e < L->nenc; e++) {
        enc_state *s = &g->enc[e];
        int nm = 0;
        for (int l = 0; l < L->enc[e].layers; l++)
            if (s->layers[l].moe) all[nm++] = s->layers[l].moe;
        // the dense feed-forward's activation buffers serve the MoE layers too
        R(moe_share_scratch)(all, nm, s->pass.da, s->pass.dh, s->ntok * (size_t)L->enc[e].mlp);
        // checkpointed: every MoE layer but the encoder's last block runs again before its
        // backward, and that block ran last; not across encoders (the second's forward runs
        // between the first's forward and backward)
        if (g->ckpt) R(moe_share_acts)(all, nm);
    }
    vlmoe_free_mem(all);
    g->mod[MOD_TEXT].tokens = g->ints;
    g->mod[MOD_TEXT].lens = g->ints + (size_t)B * T;
    *out = g;
    return VLMOE_OK;
}

void R(graph_free)(struct R(graph) *g) {
    if (!g) return;
    for (int e = 0; e < 2; e++) {
        for (int l = 0; g->enc[e].layers && l < g->L->enc[e].layers; l++) R(moe_state_free)(g->enc[e].layers[l].moe);
        vlmoe_free_mem(g->enc[e].layers);
        vlmoe_free_mem(g->enc[e].modality);
        vlmoe_free_mem(g->enc[e].keys);
    }
    vlmoe_free_mem(g->stats);
    moe_aux_sink_free(&g->sink);
    R(contrastive_step_free)(g->loss);
    g->be->free(g->be, g->arena);
    if (g->kept) g->be->free(g->be, g->kept);
    g->be->free(g->be, g->ints);
    vlmoe_free_mem(g);
}

void R(graph_set_frozen)(struct R(graph) *g, int modality, int frozen) { g->frozen[modality] = frozen != 0; }

// Whether the backward has work in encoder e: a present modality of it that is not frozen.
static int encoder_trains(const struct R(graph) *g, int e) {
    for (int m = 0; m < NUM_MOD; m++)
        if (g->L->mod[m].enc == e && g->mod[m].present && !g->frozen[m]) return 1;
    return 0;
}

size_t R(graph_activation_bytes)(const struct R(graph) *g) {
    return sizeof(real) * (g->arena_n + (g->keep_attn ? g->kept_n : 0));
}

int R(graph_keeps_attention)(const struct R(graph) *g) { return g->keep_attn; }

const real *R(graph_embeddings)(const struct R(graph) *g, int modality) {
    return g->mod[modality].emb;
}

void R(graph_set_mode)(struct R(graph) *g, int training, uint64_t seed) {
    g->training = training;
    g->seed = seed;
}

const struct R(moe_state) *R(graph_moe_layer)(const struct R(graph) *g, int index) {
    for (int e = 0; e < g->L->nenc; e++)
        for (int l = 0; l < g->L->enc[e].layers; l++)
            if (g->enc[e].layers[l].moe && g->L->enc[e].blocks[l].ffn.moe_index == index) return g->enc[e].layers[l].moe;
    return NULL;
}

const vlmoe_moe_stats *R(graph_moe_stats)(const struct R(graph) *g, int *count) {
    if (count) *count = g->L->nmoe;
    // a device table's routing statistics come to the host when read (src/moe/layer.c)
    for (int e = 0; e < g->L->nenc; e++)
        for (int l = 0; l < g->L->enc[e].layers; l++) R(moe_stats_sync)(g->enc[e].layers[l].moe);
    return g->L->nmoe ? g->stats : NULL;
}

// Token range [t0, t0+n) of the segments present in this forward (they are contiguous: image
// first, then text).
static void active_range(const struct R(graph) *g, const enc_state *s, size_t *t0, size_t *n) {
    size_t lo = s->ntok, hi = 0;
    for (int k = 0; k < s->nseg; k++) {
        if (!g->mod[s->mod_of_seg[k]].present) continue;
        size_t a = s->seg[k].tok_off, b = a + (size_t)s->seg[k].nseq * s->seg[k].seqlen;
        lo = a < lo ? a : lo;
        hi = b > hi ? b : hi;
    }
    *t0 = lo;
    *n = hi > lo ? hi - lo : 0;
}

// Sets the pass of encoder s for this forward's active tokens and present segments; 0 when
// no token of s is present.
static int set_pass(const struct R(graph) *g, enc_state *s) {
    size_t t0, nn;
    active_range(g, s, &t0, &nn);
    R(block_pass) *p = &s->pass;
    p->be = g->be;
    p->D = s->E->width, p->H = s->E->heads, p->M = s->E->mlp, p->act = g->L->cfg.act;
    p->eps = g->L->cfg.ln_eps;
    p->t0 = t0;
    p->n = (int)nn;
    int k = 0;
    for (int j = 0; j < s->nseg; j++)
        if (g->mod[s->mod_of_seg[j]].present) s->live[k] = s->seg[j], s->live_off[k++] = s->att_off[j];
    p->seg = s->live;
    p->att_off = s->live_off;
    p->nseg = k;
    return nn > 0;
}

// Block l of encoder s: one feed-forward part over all active tokens (ln2 + dense MLP or MoE).
static R(block) block_of(struct R(graph) *g, enc_state *s, int l, R(block_ffn) *f) {
    const block_layout *bl = &s->E->blocks[l];
    layer_acts *la = &s->layers[l];
    const R(block_pass) *p = &s->pass;
    *f = (R(block_ffn)){.ln_w = bl->ln2_w, .ln_b = bl->ln2_b, .f = &bl->ffn, .moe = la->moe, .nseq = 1,
                        .seqlen = p->n, .off = 0, .len = p->n, .row0 = p->t0};
    if (bl->ffn.kind == FFN_MOE) {
        // the seed differs per layer and per call, so every layer draws its own noise
        f->call = (moe_call){p->n, g->training, g->seed * 0x100000001b3ULL + (uint64_t)bl->ffn.moe_index + 1,
                             s->modality + p->t0, NULL, s->keys + p->t0, s->ex.B ? &s->ex : NULL};
        f->stats = &g->stats[bl->ffn.moe_index];
    }
    return (R(block)){bl, &la->a, f, 1};
}

static int encoder_forward(struct R(graph) *g, enc_state *s, const real *P) {
    const R(vlmoe_backend) *be = g->be;
    const encoder_layout *E = s->E;
    if (!set_pass(g, s)) return VLMOE_OK;
    make_kept(g);
    const R(block_pass) *p = &s->pass;
    const int D = p->D, n = p->n;
    const size_t t0 = p->t0;
    const real *x = s->x0;
    for (int l = 0; l < E->layers; l++) {
        R(block_ffn) f;
        const R(block) b = block_of(g, s, l, &f);
        int st = R(block_forward)(p, &b, P, x, &g->aux);
        if (st) return vlmoe_error_prefix("block %d", l), st;
        x = b.a->res2;
    }
    be->layernorm_forward(be, s->lnf + t0 * D, s->lnf_m + t0, s->lnf_r + t0, x + t0 * D, P + E->lnf_w,
                         P + E->lnf_b, n, D, g->L->cfg.ln_eps);
    return VLMOE_OK;
}

static void encoder_backward(struct R(graph) *g, enc_state *s, const real *P, real *G) {
    const R(vlmoe_backend) *be = g->be;
    const encoder_layout *E = s->E;
    if (!set_pass(g, s)) return;
    const R(block_pass) *p = &s->pass;
    const int D = p->D, n = p->n;
    const size_t t0 = p->t0;
    const real *xL = E->layers ? s->layers[E->layers - 1].a.res2 : s->x0;
    be->zero(be, p->dres + t0 * D, (size_t)n * D);
    be->layernorm_backward(be, p->dres + t0 * D, G + E->lnf_w, G + E->lnf_b, s->dlnf + t0 * D,
                          xL + t0 * D, P + E->lnf_w, s->lnf_m + t0, s->lnf_r + t0, n, D);
    const size_t lnf[] = {E->lnf_w, E->lnf_b};
    report(g, lnf, 2);
    for (int l = E->layers - 1; l >= 0; l--) {
        R(block_ffn) f;
        const R(block) b = block_of(g, s, l, &f);
        const real *x = l ? s->layers[l - 1].a.res2 : s->x0;
        if (g->ckpt && l < E->layers - 1) {
            // the forward again, on the same input, parameters, noise seed and keys: the same
            // bits and routing decisions; its auxiliary losses and statistics were counted once
            // already. It rewrites the block's output with the bits it holds and touches none of
            // the backward's buffers (dres, the gradients).
            double aux = 0;
            if (f.stats) f.stats = &g->recomputed;
            if (R(block_forward)(p, &b, P, x, &aux) && be->host_memory) {
                // only an expert-parallel exchange (host memory only) can fail where the forward
                // did not (the MPI job is broken): NaN gradients stop the step, as in moe_backward
                const real nan = (real)NAN;
                for (size_t i = 0; i < (size_t)n * D; i++) p->dres[t0 * D + i] = nan;
            }
        }
        R(block_backward)(p, &b, P, G, x);
        report_block(g, &E->blocks[l]);
    }
}

// Embedding stem of one modality: writes the encoder input of its segment.
static void stem_forward(struct R(graph) *g, int m, const real *P, const real *images) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const modality_layout *ml = &L->mod[m];
    mod_state *ms = &g->mod[m];
    enc_state *s = &g->enc[ml->enc];
    const int B = g->B, D = L->enc[ml->enc].width, T = ml->seq;
    real *x0 = s->x0 + s->seg[ms->seg].tok_off * D;
    real *dst = ml->has_ln_pre ? ms->pre : x0;
    if (m == MOD_IMAGE) {
        const vlmoe_model_config *c = &L->cfg;
        const int np = (c->image_size / c->patch_size) * (c->image_size / c->patch_size);
        const int pd = c->channels * c->patch_size * c->patch_size;
        if (!be->host_memory && images != ms->images)
            be->upload(be, ms->images, images, (size_t)B * c->channels * c->image_size * c->image_size);
        be->patchify_forward(be, ms->patches, be->host_memory ? images : ms->images, B, c->channels, c->image_size, c->patch_size);
        be->linear_forward(be, ms->pemb, ms->patches, P + ml->embed_w,
                          ml->embed_b == NO_PARAM ? NULL : P + ml->embed_b, B * np, pd, D, 0);
        if (ml->has_cls)
            be->cls_forward(be, dst, P + ml->cls, ms->pemb, B, np, D);
        else
            be->copy(be, dst, ms->pemb, (size_t)B * np * D);
    } else {
        be->embed_forward(be, dst, ms->tokens, P + ml->embed_w, B * T, D);
    }
    be->posadd_forward(be, dst, P + ml->pos, B, T, D);
    if (ml->has_ln_pre)
        be->layernorm_forward(be, x0, ms->pre_m, ms->pre_r, ms->pre, P + ml->ln_pre_w, P + ml->ln_pre_b,
                             B * T, D, L->cfg.ln_eps);
}

static void stem_backward(struct R(graph) *g, int m, const real *P, real *G) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const modality_layout *ml = &L->mod[m];
    mod_state *ms = &g->mod[m];
    enc_state *s = &g->enc[ml->enc];
    const int B = g->B, D = L->enc[ml->enc].width, T = ml->seq;
    const real *dx0 = s->pass.dres + s->seg[ms->seg].tok_off * D;
    const real *d = dx0;
    if (ml->has_ln_pre) {
        be->zero(be, ms->dpre, (size_t)B * T * D);
        be->layernorm_backward(be, ms->dpre, G + ml->ln_pre_w, G + ml->ln_pre_b, dx0, ms->pre,
                              P + ml->ln_pre_w, ms->pre_m, ms->pre_r, B * T, D);
        d = ms->dpre;
    }
    be->posadd_backward(be, G + ml->pos, d, B, T, D);
    if (m == MOD_IMAGE) {
        const vlmoe_model_config *c = &L->cfg;
        const int np = (c->image_size / c->patch_size) * (c->image_size / c->patch_size);
        const int pd = c->channels * c->patch_size * c->patch_size;
        const real *dp = d;
        if (ml->has_cls) {
            be->zero(be, ms->dpemb, (size_t)B * np * D);
            be->cls_backward(be, G + ml->cls, ms->dpemb, d, B, np, D);
            dp = ms->dpemb;
        }
        be->linear_backward(be, NULL, G + ml->embed_w, ml->embed_b == NO_PARAM ? NULL : G + ml->embed_b,
                           dp, ms->patches, P + ml->embed_w, B * np, pd, D);
    } else {
        be->embed_backward(be, G + ml->embed_w, d, ms->tokens, B * T, D);
    }
}

int R(graph_encode)(struct R(graph) *g, const real *P, const real *images, const int32_t *tokens,
                    const int32_t *lens, double *aux) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const vlmoe_model_config *cfg = &L->cfg;
    const int B = g->B, E = cfg->embed_dim;
    const uint8_t *pix = g->pix;
    g->pix = NULL; // for this encode only
    if (pix) {
        const be_pixels *q = &g->pixp;
        if (images || q->B != B || q->C != cfg->channels || q->H != cfg->image_size || q->W != cfg->image_size)
            return vlmoe_fail(VLMOE_ERR_ARG, "image bytes (%d, %d, %d, %d)%s: the model takes (%d, %d, %d, %d)", q->B,
                              q->C, q->H, q->W, images ? " and float images" : "", B, cfg->channels,
                              cfg->image_size, cfg->image_size);
        const uint8_t *d = be->pixels_stage(be, pix, (size_t)B * q->C * q->H * q->W);
        if (!d) return vlmoe_error_prefix("image bytes"), VLMOE_ERR_ARG;
        be->pixels_normalize(be, g->mod[MOD_IMAGE].images, d, q);
        images = g->mod[MOD_IMAGE].images;
    }
    g->mod[MOD_IMAGE].present = images != NULL;
    g->mod[MOD_TEXT].present = tokens != NULL;
    g->have_loss = 0;
    if (tokens) {
        const int T = L->mod[MOD_TEXT].seq;
        if (!lens) return vlmoe_fail(VLMOE_ERR_ARG, "text batch without lengths");
        for (int b = 0; b < B; b++) {
            if (lens[b] < 1 || lens[b] > T)
                return vlmoe_fail(VLMOE_ERR_ARG, "text %d: length %d outside [1, %d]", b, lens[b], T);
            for (int t = 0; t < T; t++)
                if (tokens[(size_t)b * T + t] < 0 || tokens[(size_t)b * T + t] >= cfg->vocab_size)
                    return vlmoe_fail(VLMOE_ERR_ARG, "text %d: token %d at position %d outside the "
                                      "vocabulary [0, %d)", b, tokens[(size_t)b * T + t], t,
                                      cfg->vocab_size);
        }
        be->upload_bytes(be, g->mod[MOD_TEXT].tokens, tokens, sizeof(int32_t) * (size_t)B * T);
        be->upload_bytes(be, g->mod[MOD_TEXT].lens, lens, sizeof(int32_t) * (size_t)B);
        g->enc[L->mod[MOD_TEXT].enc].seg[g->mod[MOD_TEXT].seg].lens = g->mod[MOD_TEXT].lens;
    }
    // every MoE layer must be able to split this pass's tokens into its routing groups
    for (int e = 0; e < L->nenc; e++) {
        size_t t0, nn;
        active_range(g, &g->enc[e], &t0, &nn);
        for (int l = 0; l < L->enc[e].layers; l++) {
            const layer_acts *a = &g->enc[e].layers[l];
            const moe_examples *ex = g->enc[e].ex.B ? &g->enc[e].ex : NULL;
            int st = a->moe ? moe_check_examples(&a->spec, (int)nn, g->training, ex, g->enc[e].modality + t0) : VLMOE_OK;
            if (st) {
                vlmoe_error_prefix("encoder %d block %d", e, l);
                return st;
            }
        }
    }
    g->aux = 0;
    for (int m = 0; m < NUM_MOD; m++)
        if (g->mod[m].present) stem_forward(g, m, P, images);
    for (int e = 0; e < L->nenc; e++) {
        int st = encoder_forward(g, &g->enc[e], P);
        if (st) return vlmoe_error_prefix("encoder %d", e), st;
    }
    for (int m = 0; m < NUM_MOD; m++) {
        mod_state *ms = &g->mod[m];
        if (!ms->present) continue;
        const modality_layout *ml = &L->mod[m];
        const enc_state *s = &g->enc[ml->enc];
        const int D = s->E->width;
        be->pool_forward(be, ms->pooled, s->lnf + s->seg[ms->seg].tok_off * D,
                        m == MOD_TEXT ? ms->lens : NULL, B, ml->seq, D, ml->pool);
        be->linear_forward(be, ms->proj, ms->pooled, P + ml->proj, NULL, B, D, E, 0);
        be->l2norm_forward(be, ms->emb, ms->norm, ms->proj, B, E);
    }
    if (aux) *aux = g->aux;
    return VLMOE_OK;
}

void R(graph_encode_backward)(struct R(graph) *g, const real *P, real *G, const real *const demb[NUM_MOD]) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const int B = g->B, E = L->cfg.embed_dim;
    for (int e = 0; e < L->nenc; e++)
        be->zero(be, g->enc[e].dlnf, g->enc[e].ntok * (size_t)g->enc[e].E->width);
    for (int m = 0; m < NUM_MOD; m++) {
        mod_state *ms = &g->mod[m];
        if (!ms->present || g->frozen[m]) continue;
        const modality_layout *ml = &L->mod[m];
        enc_state *s = &g->enc[ml->enc];
        const int D = s->E->width;
        be->zero(be, ms->dproj, (size_t)B * E);
        be->l2norm_backward(be, ms->dproj, demb[m], ms->emb, ms->norm, B, E);
        be->zero(be, ms->dpooled, (size_t)B * D);
        be->linear_backward(be, ms->dpooled, G + ml->proj, NULL, ms->dproj, ms->pooled, P + ml->proj, B,
                           D, E);
        be->pool_backward(be, s->dlnf + s->seg[ms->seg].tok_off * D, ms->dpooled,
                         m == MOD_TEXT ? ms->lens : NULL, B, ml->seq, D, ml->pool);
        report(g, &ml->proj, 1);
    }
    for (int e = 0; e < L->nenc; e++)
        if (encoder_trains(g, e)) encoder_backward(g, &g->enc[e], P, G);
    for (int m = 0; m < NUM_MOD; m++) {
        if (!g->mod[m].present || g->frozen[m]) continue;
        stem_backward(g, m, P, G);
        const modality_layout *ml = &L->mod[m];
        const size_t o[] = {ml->embed_w, ml->embed_b, ml->cls, ml->pos, ml->ln_pre_w, ml->ln_pre_b};
        report(g, o, 6);
    }
}

int R(graph_forward)(struct R(graph) *g, const real *P, const real *images, const int32_t *tokens,
                     const int32_t *lens, graph_result *res) {
    double aux = 0;
    // a deferred step's auxiliary values go to the sink (its take adds them up); a recomputation
    // under gradient checkpointing, in the backward, skips them: they would go unused
    moe_aux_sink *k = &g->sink;
    k->mode = g->scal && tokens ? MOE_AUX_RECORD : MOE_AUX_OFF;
    k->used = k->need = k->nrec = 0;
    int st = R(graph_encode)(g, P, images, tokens, lens, &aux);
    if (k->mode == MOE_AUX_RECORD) k->mode = MOE_AUX_SKIP;
    if (st) return k->mode = MOE_AUX_OFF, st;
    if (res) memset(res, 0, sizeof(*res));
    if (!g->mod[MOD_IMAGE].present || !tokens) return VLMOE_OK;
    double *scal = g->scal;
    g->scal = NULL; // for this forward only
    if (scal) { // the loss stays on the device: the caller reads it with the step's other scalars
        R(contrastive_step_forward_dev)(g->loss, g->mod[MOD_IMAGE].emb, g->mod[MOD_TEXT].emb, P + g->L->logit_scale,
                                        scal);
        g->have_loss = 1;
        if (res) res->loss = NAN, res->aux = aux, res->acc[0] = res->acc[1] = NAN;
        return VLMOE_OK;
    }
    double acc[2];
    const double loss = R(contrastive_step_forward)(g->loss, g->mod[MOD_IMAGE].emb, g->mod[MOD_TEXT].emb,
                                                    P + g->L->logit_scale, acc);
    g->have_loss = 1;
    if (res) {
        res->loss = loss + aux;
        res->aux = aux;
        res->acc[0] = acc[0], res->acc[1] = acc[1];
    }
    return VLMOE_OK;
}

void R(graph_backward)(struct R(graph) *g, const real *P, real *G) {
    const R(vlmoe_backend) *be = g->be;
    const size_t n = (size_t)g->B * g->L->cfg.embed_dim;
    if (!g->have_loss) return;
    mod_state *mi = &g->mod[MOD_IMAGE], *mt = &g->mod[MOD_TEXT];
    be->zero(be, mi->demb, n);
    be->zero(be, mt->demb, n);
    R(contrastive_step_backward)(g->loss, mi->demb, mt->demb, G + g->L->logit_scale, 1.0);
    const real *const demb[NUM_MOD] = {mi->demb, mt->demb};
    R(graph_encode_backward)(g, P, G, demb);
    if (g->sink.mode == MOE_AUX_SKIP) g->sink.mode = MOE_AUX_OFF; // its recomputations are done
}

// ---- the contrastive loss step, apart from the encoders that made its embeddings

struct R(contrastive_step) {
    const R(vlmoe_backend) *be;
    int B, E;
    real *logits, *prow, *pcol;  // (B,B) scores and their row / column softmax, for backward
    const real *img, *txt;       // the last forward's embeddings
    real scale;                  // and its logit scale
    const real *dscale;          // or where it lives (contrastive_step_forward_dev): the table's
};

int R(contrastive_step_create)(struct R(contrastive_step) **out, const R(vlmoe_backend) *be, int B, int E) {
    *out = NULL;
    if (B < 1 || E < 1) return vlmoe_fail(VLMOE_ERR_ARG, "contrastive loss over %d pairs of %d values", B, E);
    struct R(contrastive_step) *c = vlmoe_calloc(sizeof(*c), "contrastive loss");
    if (!c) return VLMOE_ERR_NOMEM;
    *c = (struct R(contrastive_step)){.be = be, .B = B, .E = E};
    const size_t bb = (size_t)B * B;
    c->logits = be->alloc(be, sizeof(real) * 3 * bb, "contrastive loss scores");
    if (!c->logits) return R(contrastive_step_free)(c), VLMOE_ERR_NOMEM;
    c->prow = c->logits + bb;
    c->pcol = c->prow + bb;
    *out = c;
    return VLMOE_OK;
}

void R(contrastive_step_free)(struct R(contrastive_step) *c) {
    if (!c) return;
    c->be->free(c->be, c->logits);
    vlmoe_free_mem(c);
}

double R(contrastive_step_forward)(struct R(contrastive_step) *c, const real *img, const real *txt,
                                   const real *scale, double *acc) {
    const R(vlmoe_backend) *be = c->be;
    // the kernels take the scale by value: one element read back from the table's memory
    be->download(be, &c->scale, scale, 1);
    c->dscale = NULL;
    c->img = img;
    c->txt = txt;
    return be->contrastive_forward(be, c->logits, c->prow, c->pcol, img, txt, c->scale, c->B, c->E, acc);
}

void R(contrastive_step_forward_dev)(struct R(contrastive_step) *c, const real *img, const real *txt,
                                     const real *scale, double *out) {
    const R(vlmoe_backend) *be = c->be;
    c->dscale = scale; // read where it is, by the forward and the backward: no download
    c->img = img;
    c->txt = txt;
    be->contrastive_forward_dsc(be, c->logits, c->prow, c->pcol, img, txt, scale, c->B, c->E, out);
}

void R(contrastive_step_backward)(struct R(contrastive_step) *c, real *dimg, real *dtxt, real *dscale, double dloss) {
    const R(vlmoe_backend) *be = c->be;
    if (c->dscale)
        be->contrastive_backward_dsc(be, dimg, dtxt, dscale, c->logits, c->prow, c->pcol, c->img, c->txt, c->dscale,
                                     c->B, c->E, dloss);
    else
        be->contrastive_backward(be, dimg, dtxt, dscale, c->logits, c->prow, c->pcol, c->img, c->txt, c->scale, c->B,
                                c->E, dloss);
}
