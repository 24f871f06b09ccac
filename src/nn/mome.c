// mome.c: forward and backward of VL-MoE's MoME transformer (VL-MoE sec. 3.2, Figure 1) for one
// encoding of B sequences: image only ([I_CLS] + patches), text only ([T_CLS] text [T_SEP]) or
// image-text pair (both concatenated into one sequence). Every block: x + attn(ln1(x)) with the
// attention shared by all tokens of a sequence, then each token's modality expert: image tokens
// through V-FFN, text tokens through T-FFN, and in the top vl_layers blocks of a pair every token
// through VL-FFN; an expert is its own LayerNorm + a dense MLP or an MoE layer (src/moe/layer.c).
// The tokens of one expert ("stream") are gathered into a contiguous buffer, so an MoE layer
// routes all image (or text) tokens of the batch as one group set; a block is the one block of
// src/nn/block.c with each stream's expert as a feed-forward part. Final LayerNorm, then the MLM
// head over labelled text positions and the MIM head over masked patches, each a mean softmax
// cross-entropy (src/loss/masked.c); with a fine-tuning head (num_classes > 0) a linear classifier
// on the pooled feature (mean of the image patches, or the [T_CLS] of a text or pair) and its mean
// cross-entropy over the batch's class labels (NLVR2: two consecutive sequences per example, their
// pooled features side by side). The retrieval head (mome_itc_*, at the end) couples an image
// graph and a text graph: their [I_CLS]/[T_CLS] features, projected and normalised, under the
// contrastive loss, whose feature gradients each graph's backward takes in. Activations come
// from one arena planned for B sequences of the longest (pair) encoding. Compiled as float and double (src/core/real.h); covered by
// tests/test_mome.c (finite differences) and tests/test_parity.c (PyTorch, tests/ref/gen_mome.py).
// On a table without host memory (--device) each forward uploads its images and integer inputs
// first and every kernel reads the table's memory only; the host keeps its copies of the rows,
// labels and masks to choose what runs (tests/test_model.c, a table that checks every pointer).
//
// A pair is laid out image first, then text. VL-MoE writes [H^w; H^v], but position embeddings
// are added per modality before the concatenation and attention is permutation-equivariant, so
// the order changes nothing computed; image first lets the text padding sit at the end of the
// sequence, where attention's key-length mask expresses it.
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "loss/masked.h"
#include "moe/layer.h"
#include "nn/block.h"
#include "nn/mome.h"
#include "nn/routing.h"
#include "ops/backend.h"

typedef struct {
    R(block_acts) a;                  // the block's activations; its experts' rows are stream-major
    struct R(moe_state) *moe[2];      // V-MoE and T-MoE of this block (NULL where dense)
    moe_spec spec[2];
} mome_acts;

// The tokens one expert sees: positions [off, off+len) of every sequence, stored in the stream
// buffers from row row0 on.
typedef struct {
    int which, off, len;
    size_t row0;
} stream;

enum { HEAD_TEXT = 0, HEAD_IMAGE = 1 };

struct R(mome_graph) {
    const model_layout *L;
    const R(vlmoe_backend) *be;      // every kernel, and the arena's memory
    const mome_layout *X;
    int B, D, H, M;
    // the current forward
    int enc, T, n, text_off, training, have_forward;
    int causal;                      // VLMOE_ENC_CAPTION: a pair under BEiT-3's captioning mask
    uint64_t seed;
    uint64_t sample_base;            // global index of sequence 0: keys the routing noise
    double norm[2];                  // the heads' divisors (0: their own labelled count)
    double aux;
    // stem
    real *patches, *pemb, *ximg, *xtxt, *dpemb, *dximg, *dxtxt, *x0;
    mome_acts *layers;
    R(block_pass) pass;              // the blocks' scratch; every forward runs all B*T tokens
    attn_segment seg;                // this forward's attention: B sequences of T
    real *lnf, *lnf_m, *lnf_r;
    // heads: 0 text (MLM), 1 image (MIM)
    real *hsel[2], *probs[2], *dlog, *dhsel;
    int32_t *rows[2], *labels[2];
    int count[2];
    // classification head (fine-tuning): pooled feature, scores, their softmax; labels (B)
    real *pooled, *clogits, *cprobs, *dpooled;
    int32_t *clabels;
    int32_t *plens;              // (B) X->np each: the image mean pool over the patch tokens
    int have_cls;
    const real *dfeat;               // (B,D) an outside loss's gradient at the retrieval feature
    real *dlnf;
    int32_t *tokens, *lens, *seqlens;
    uint8_t *masked;                 // (B,np) patch replaced by the mask token
    uint8_t *mods[2];                // all VLMOE_MOD_IMAGE / all VLMOE_MOD_TEXT
    uint64_t *keys;                  // (B*(Ti+Tt)) routing-noise keys of the stream rows
    const double **noise;            // (nmoe) test hook
    double drop_path;                // stochastic depth rate of the last block (0: none)
    double *dropf;                   // (layers, 2, B) this forward's drop-path factors
    const uint8_t *drop_keep;        // (layers, 2, B) test hook: the kept branches (NULL: draw)
    int drop_on;                     // the last forward dropped paths (backward follows it)
    vlmoe_moe_stats *stats;          // (nmoe)
    real *arena;
    int32_t *ints;
    // On a table without host memory the kernels read the copies in its memory: the images
    // (B,C,H,W) carved in the arena, and d_ints, all of ints uploaded after the inputs are taken
    // (tokens, lengths, labels, the pool's lengths). With host memory: images NULL, d_ints == ints.
    real *images;
    int32_t *d_ints;
    size_t nints;
};

// The table's copy of an array of g->ints.
static const int32_t *dev_ints(const struct R(mome_graph) *g, const int32_t *p) { return g->d_ints + (p - g->ints); }

static void plan(struct R(mome_graph) *g, carver *c) {
    const mome_layout *X = g->X;
    const size_t B = (size_t)g->B, D = (size_t)g->D, M = (size_t)g->M, H = (size_t)g->H;
    const size_t Tmax = (size_t)X->Ti + X->Tt, n = B * Tmax, np = (size_t)X->np;
    const size_t V = (size_t)g->L->cfg.vocab_size, K = (size_t)g->L->cfg.mim_vocab;
    g->patches = carve(c, B * np * X->pd);
    const vlmoe_model_config *cfg = &g->L->cfg;
    g->images = carve(c, g->be->host_memory ? 0 : B * cfg->channels * cfg->image_size * cfg->image_size);
    g->pemb = carve(c, B * np * D);
    g->dpemb = carve(c, B * np * D);
    g->ximg = carve(c, B * X->Ti * D);
    g->dximg = carve(c, B * X->Ti * D);
    g->xtxt = carve(c, B * X->Tt * D);
    g->dxtxt = carve(c, B * X->Tt * D);
    g->x0 = carve(c, n * D);
    for (int l = 0; l < g->L->enc[0].layers; l++) {
        int dense = 0; // a dense expert keeps its fc1 output
        for (int k = 0; k < MOME_NFFN; k++) {
            const mome_ffn *f = &X->ffn[l * MOME_NFFN + k];
            dense |= f->ln_w != NO_PARAM && f->ffn.kind != FFN_MOE;
        }
        R(block_plan)(c, &g->layers[l].a, n, 0, (int)D, (int)M, dense);
    }
    R(block_plan_pass)(c, &g->pass, n, B * H * Tmax * Tmax, (int)D, (int)M, 1, 0);
    g->pass.dbuf = carve(c, n * D);
    g->lnf = carve(c, n * D);
    g->lnf_m = carve(c, n);
    g->lnf_r = carve(c, n);
    g->hsel[HEAD_TEXT] = carve(c, B * X->Tt * D);
    g->probs[HEAD_TEXT] = carve(c, B * X->Tt * V);
    g->hsel[HEAD_IMAGE] = carve(c, B * np * D);
    g->probs[HEAD_IMAGE] = carve(c, B * np * K);
    const size_t NC = (size_t)g->L->cfg.num_classes;
    size_t ndlog = B * X->Tt * V > B * np * K ? B * X->Tt * V : B * np * K;
    ndlog = ndlog > B * NC ? ndlog : B * NC; // the classification head's scores too
    g->dlog = carve(c, ndlog);
    g->dhsel = carve(c, (B * X->Tt > B * np ? B * X->Tt : B * np) * D);
    g->pooled = carve(c, B * D);
    g->dpooled = carve(c, B * D);
    g->clogits = carve(c, B * NC);
    g->cprobs = carve(c, B * NC);
    g->dlnf = carve(c, n * D);
}

static const mome_ffn *ffn_of(const struct R(mome_graph) *g, int l, int which) {
    return &g->X->ffn[l * MOME_NFFN + which];
}

int R(mome_graph_create)(struct R(mome_graph) **out, const model_layout *L, const R(vlmoe_backend) *be,
                         int B) {
    *out = NULL;
    if (B < 1) return vlmoe_fail(VLMOE_ERR_ARG, "batch size must be >= 1, got %d", B);
    if (!L->mome) return vlmoe_fail(VLMOE_ERR_ARG, "mome graph: model '%s' is not arch mome", L->cfg.name);
    struct R(mome_graph) *g = vlmoe_calloc(sizeof(*g), "mome graph");
    if (!g) return VLMOE_ERR_NOMEM;
    const mome_layout *X = L->mome;
    const int nl = L->enc[0].layers, n = B * (X->Ti + X->Tt);
    g->L = L;
    g->be = be;
    g->X = X;
    g->B = B;
    g->D = L->enc[0].width;
    g->H = L->enc[0].heads;
    g->M = L->enc[0].mlp;
    g->layers = vlmoe_calloc(sizeof(mome_acts) * (size_t)(nl ? nl : 1), "mome layers");
    g->stats = vlmoe_calloc(sizeof(vlmoe_moe_stats) * (size_t)(L->nmoe + 1), "routing statistics");
    g->noise = vlmoe_calloc(sizeof(*g->noise) * (size_t)(L->nmoe + 1), "noise hooks");
    const size_t nints = (size_t)B * X->Tt * 3 + 4 * (size_t)B + (size_t)B * X->np * 2;
    g->ints = vlmoe_calloc(sizeof(int32_t) * nints, "token copies");
    g->nints = nints;
    g->d_ints = be->host_memory ? g->ints : be->alloc(be, sizeof(int32_t) * nints, "token copies on the device");
    g->masked = vlmoe_calloc((size_t)B * X->np, "patch mask");
    g->mods[0] = vlmoe_calloc((size_t)n, "modalities");
    g->mods[1] = vlmoe_alloc((size_t)n, "modalities");
    g->keys = vlmoe_alloc(sizeof(uint64_t) * (size_t)n, "token noise keys");
    g->dropf = vlmoe_alloc(sizeof(double) * (size_t)(nl ? nl : 1) * 2 * B, "drop-path factors");
    if (!g->layers || !g->stats || !g->noise || !g->ints || !g->d_ints || !g->masked || !g->mods[0] || !g->mods[1] ||
        !g->keys || !g->dropf)
        return R(mome_graph_free)(g), VLMOE_ERR_NOMEM;
    memset(g->mods[1], VLMOE_MOD_TEXT, (size_t)n);
    g->tokens = g->ints;
    g->lens = g->tokens + (size_t)B * X->Tt;
    g->seqlens = g->lens + B;
    g->rows[HEAD_TEXT] = g->seqlens + B;
    g->labels[HEAD_TEXT] = g->rows[HEAD_TEXT] + (size_t)B * X->Tt;
    g->rows[HEAD_IMAGE] = g->labels[HEAD_TEXT] + (size_t)B * X->Tt;
    g->labels[HEAD_IMAGE] = g->rows[HEAD_IMAGE] + (size_t)B * X->np;
    g->clabels = g->labels[HEAD_IMAGE] + (size_t)B * X->np;
    g->plens = g->clabels + B; // every image's patch count: the mean pool's lengths
    for (int b = 0; b < B; b++) g->plens[b] = X->np;
    carver c = {NULL, 0};
    plan(g, &c);
    g->arena = be->alloc(be, sizeof(real) * c.used, "activation arena");
    if (!g->arena) return R(mome_graph_free)(g), VLMOE_ERR_NOMEM;
    c = (carver){g->arena, 0};
    plan(g, &c);
    for (int l = 0; l < nl; l++)
        for (int k = MOME_V; k <= MOME_T; k++) {
            const mome_ffn *f = ffn_of(g, l, k);
            if (f->ffn.kind != FFN_MOE) continue;
            mome_acts *a = &g->layers[l];
            a->spec[k] = (moe_spec){.cfg = f->moe, .D = g->D, .M = g->M, .act = L->cfg.act,
                                    .router_w = f->ffn.router_w, .w1 = f->ffn.fc1_w, .b1 = f->ffn.fc1_b,
                                    .w2 = f->ffn.fc2_w, .b2 = f->ffn.fc2_b, .phi = f->ffn.phi,
                                    .scale = f->ffn.scale, .pruned = l < 64 ? f->moe->pruned[l] : 0};
            int st = R(moe_state_create)(&a->moe[k], &a->spec[k], be, B * (k == MOME_V ? X->Ti : X->Tt));
            if (st) return R(mome_graph_free)(g), st;
            g->stats[f->ffn.moe_index].encoder = 0;
            g->stats[f->ffn.moe_index].block = l;
        }
    *out = g;
    return VLMOE_OK;
}

void R(mome_graph_free)(struct R(mome_graph) *g) {
    if (!g) return;
    for (int l = 0; g->layers && l < g->L->enc[0].layers; l++)
        for (int k = 0; k < 2; k++) R(moe_state_free)(g->layers[l].moe[k]);
    if (g->d_ints != g->ints) g->be->free(g->be, g->d_ints);
    void *all[] = {g->layers, g->stats, g->noise, g->ints, g->masked, g->mods[0], g->mods[1], g->keys, g->dropf};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) vlmoe_free_mem(all[i]);
    g->be->free(g->be, g->arena);
    vlmoe_free_mem(g);
}

void R(mome_graph_set_mode)(struct R(mome_graph) *g, int training, uint64_t seed) {
    g->training = training;
    g->seed = seed;
}

void R(mome_graph_set_sample_base)(struct R(mome_graph) *g, uint64_t base) { g->sample_base = base; }

void R(mome_graph_set_norm)(struct R(mome_graph) *g, double text, double image) {
    g->norm[HEAD_TEXT] = text, g->norm[HEAD_IMAGE] = image;
}

// The divisor of head h's summed cross-entropy: the forward's own labelled count, or the one set.
static double head_norm(const struct R(mome_graph) *g, int h) { return g->norm[h] > 0 ? g->norm[h] : g->count[h]; }

void R(mome_graph_set_noise)(struct R(mome_graph) *g, int index, const double *noise) {
    if (index >= 0 && index < g->L->nmoe) g->noise[index] = noise;
}

void R(mome_graph_set_drop_path)(struct R(mome_graph) *g, double rate) { g->drop_path = rate; }

void R(mome_graph_set_drop_keep)(struct R(mome_graph) *g, const uint8_t *keep) { g->drop_keep = keep; }

const double *R(mome_graph_drop_factors)(const struct R(mome_graph) *g) { return g->drop_on ? g->dropf : NULL; }

// Stochastic depth as BEiT and timm draw it: block l's rate is drop_path * l / (layers - 1)
// (linspace(0, rate, depth)), each residual branch of each sample kept with probability 1 - rate
// and then scaled by 1 / (1 - rate). A draw is keyed by the forward's seed (the model's seed and
// its forward count, i.e. the step), the global sample index, the block and the branch, so a
// sample's draw does not depend on the process or the batch it lands in (docs/DISTRIBUTED.md).
static void draw_drop_path(struct R(mome_graph) *g) {
    const int nl = g->L->enc[0].layers, B = g->B;
    for (int l = 0; l < nl; l++)
        for (int k = 0; k < 2; k++)
            for (int b = 0; b < B; b++) {
                const double rate = nl > 1 ? g->drop_path * l / (nl - 1) : 0;
                const size_t i = ((size_t)l * 2 + k) * B + b;
                const uint64_t key = vlmoe_mix64(g->seed ^ 0x64726f7070617468ULL) ^ (g->sample_base + (uint64_t)b);
                const double u = (double)(vlmoe_mix64(vlmoe_mix64(key) + (uint64_t)(l * 2 + k)) >> 11) * 0x1p-53;
                const int keep = g->drop_keep ? g->drop_keep[i] != 0 : u >= rate;
                g->dropf[i] = keep ? 1.0 / (1.0 - rate) : 0.0;
            }
}

// The pass's drop-path factors for block l (none when the forward drops no path).
static void set_drop(struct R(mome_graph) *g, int l) {
    R(block_pass) *p = &g->pass;
    const double *f = g->dropf + (size_t)l * 2 * g->B;
    p->drop[0] = g->drop_on ? f : NULL;
    p->drop[1] = g->drop_on ? f + g->B : NULL;
    p->drop_nseq = g->B;
}

const real *R(mome_graph_hidden)(const struct R(mome_graph) *g, int *seq) {
    if (seq) *seq = g->T;
    return g->lnf;
}

const real *R(mome_graph_text_probs)(const struct R(mome_graph) *g, int *count) {
    if (count) *count = g->count[HEAD_TEXT];
    return g->probs[HEAD_TEXT];
}

const real *R(mome_graph_logits)(const struct R(mome_graph) *g) {
    return g->X->cls_w == NO_PARAM ? NULL : g->clogits;
}

const struct R(moe_state) *R(mome_graph_moe_layer)(const struct R(mome_graph) *g, int index) {
    for (int l = 0; l < g->L->enc[0].layers; l++)
        for (int k = MOME_V; k <= MOME_T; k++)
            if (g->layers[l].moe[k] && ffn_of(g, l, k)->ffn.moe_index == index) return g->layers[l].moe[k];
    return NULL;
}

const vlmoe_moe_stats *R(mome_graph_moe_stats)(const struct R(mome_graph) *g, int *count) {
    if (count) *count = g->L->nmoe;
    // a device table's routing statistics come to the host when read (src/moe/layer.c)
    for (int l = 0; l < g->L->enc[0].layers; l++)
        for (int k = MOME_V; k <= MOME_T; k++) R(moe_stats_sync)(g->layers[l].moe[k]);
    return g->L->nmoe ? g->stats : NULL;
}

// text_off is 0 for images and texts, so the row is [I_CLS] or [T_CLS] (fused, for pairs).
const real *R(mome_graph_feature)(const struct R(mome_graph) *g, int b) {
    return g->lnf + ((size_t)b * g->T + g->text_off) * g->D;
}

void R(mome_graph_set_feature_grad)(struct R(mome_graph) *g, const real *dfeat) { g->dfeat = dfeat; }

// rows [off, off+len) of each of B sequences of T tokens <-> a contiguous (B*len, D) buffer
static void gather(const R(vlmoe_backend) *be, real *dst, const real *src, int B, int T, int off, int len, int D) {
    for (int b = 0; b < B; b++)
        be->copy(be, dst + (size_t)b * len * D, src + ((size_t)b * T + off) * D, (size_t)len * D);
}
static void scatter(const R(vlmoe_backend) *be, real *dst, const real *src, int B, int T, int off, int len, int D) {
    for (int b = 0; b < B; b++)
        be->copy(be, dst + ((size_t)b * T + off) * D, src + (size_t)b * len * D, (size_t)len * D);
}

// The experts block l runs in this encoding (Figure 1): V and/or T, or VL for a pair's top blocks.
static int streams_of(const struct R(mome_graph) *g, int l, stream *s) {
    const mome_layout *X = g->X;
    if (g->enc == VLMOE_ENC_PAIR && l >= g->L->enc[0].layers - g->L->cfg.vl_layers) {
        s[0] = (stream){MOME_VL, 0, g->T, 0};
        return 1;
    }
    int k = 0;
    if (g->enc != VLMOE_ENC_TEXT) s[k++] = (stream){MOME_V, 0, X->Ti, 0};
    if (g->enc != VLMOE_ENC_IMAGE) {
        s[k] = (stream){MOME_T, g->text_off, X->Tt, k ? (size_t)g->B * X->Ti : 0};
        k++;
    }
    return k;
}

// Block l of this forward: the shared attention, then each stream's expert as one feed-forward
// part (its own LayerNorm, dense MLP or MoE layer). forward: also writes the MoE streams' noise
// keys, each row's sequence, modality and position in the sequence.
static R(block) block_of(struct R(mome_graph) *g, int l, R(block_ffn) *f, int forward) {
    mome_acts *a = &g->layers[l];
    stream s[2];
    const int ns = streams_of(g, l, s);
    for (int k = 0; k < ns; k++) {
        const mome_ffn *mf = ffn_of(g, l, s[k].which);
        f[k] = (R(block_ffn)){.ln_w = mf->ln_w, .ln_b = mf->ln_b, .f = &mf->ffn, .nseq = g->B, .seqlen = g->T,
                              .off = s[k].off, .len = s[k].len, .row0 = s[k].row0};
        if (mf->ffn.kind != FFN_MOE) continue;
        const int idx = mf->ffn.moe_index, mod = s[k].which == MOME_V ? VLMOE_MOD_IMAGE : VLMOE_MOD_TEXT;
        uint64_t *keys = g->keys + s[k].row0;
        if (forward)
            for (int b = 0; b < g->B; b++)
                for (int i = 0; i < s[k].len; i++)
                    keys[(size_t)b * s[k].len + i] = moe_token_key(g->sample_base + (uint64_t)b, mod, s[k].off + i);
        f[k].moe = a->moe[s[k].which];
        // the seed differs per layer and per call, so every layer draws its own noise
        f[k].call = (moe_call){g->B * s[k].len, g->training, g->seed * 0x100000001b3ULL + (uint64_t)idx + 1,
                               g->mods[s[k].which], g->noise[idx], keys, NULL};
        f[k].stats = &g->stats[idx];
    }
    return (R(block)){&g->L->enc[0].blocks[l], &a->a, f, ns};
}

// The blocks' pass of this forward: all B*T tokens, one attention segment of B sequences of T.
static void set_pass(struct R(mome_graph) *g) {
    static const size_t att_off[1] = {0};
    const int32_t *lens = g->enc == VLMOE_ENC_IMAGE ? NULL
                        : dev_ints(g, g->enc == VLMOE_ENC_TEXT ? g->lens : g->seqlens);
    R(block_pass) *p = &g->pass;
    // a caption pair: the image (the first text_off tokens) both ways, the text causally after it
    g->seg = (attn_segment){.nseq = g->B, .seqlen = g->T, .causal = g->causal, .lens = lens,
                            .prefix = g->causal ? g->text_off : 0};
    p->be = g->be;
    p->D = g->D, p->H = g->H, p->M = g->M, p->act = g->L->cfg.act;
    p->eps = g->L->cfg.ln_eps;
    p->t0 = 0;
    p->n = g->n;
    p->seg = &g->seg;
    p->att_off = att_off;
    p->nseg = 1;
}

static const char *ENC_NAMES[] = {"image", "text", "pair", "caption pair"};

// Validates and copies the inputs of one forward; fills the heads' row lists.
static int take_inputs(struct R(mome_graph) *g, const R(mome_input) *in) {
    // a caption pair is a pair with another attention mask: everything else is the pair's
    const int enc = in->encoding == VLMOE_ENC_CAPTION ? VLMOE_ENC_PAIR : in->encoding;
    const int32_t *tokens = in->tokens, *lens = in->lens, *tl = in->text_labels, *pl = in->patch_labels;
    const mome_layout *X = g->X;
    const vlmoe_model_config *c = &g->L->cfg;
    const int B = g->B;
    if (enc < VLMOE_ENC_IMAGE || enc > VLMOE_ENC_PAIR) return vlmoe_fail(VLMOE_ERR_ARG, "unknown encoding %d", enc);
    const int named = in->encoding; // the name in messages
    const int img = enc != VLMOE_ENC_TEXT, txt = enc != VLMOE_ENC_IMAGE;
    if (img && !in->images)
        return vlmoe_fail(VLMOE_ERR_ARG, "the %s encoding needs images%s", ENC_NAMES[named],
                          enc == VLMOE_ENC_PAIR ? " and texts: text-only data cannot stand in for image-text pairs" : "");
    if (txt && (!tokens || !lens))
        return vlmoe_fail(VLMOE_ERR_ARG, "the %s encoding needs texts (tokens and lengths)%s", ENC_NAMES[named],
                          enc == VLMOE_ENC_PAIR ? ": image-only data cannot stand in for image-text pairs" : "");
    g->enc = enc;
    g->causal = in->encoding == VLMOE_ENC_CAPTION;
    g->text_off = enc == VLMOE_ENC_PAIR ? X->Ti : 0;
    g->T = enc == VLMOE_ENC_IMAGE ? X->Ti : enc == VLMOE_ENC_TEXT ? X->Tt : X->Ti + X->Tt;
    g->n = B * g->T;
    g->count[HEAD_TEXT] = g->count[HEAD_IMAGE] = 0;
    if (txt) {
        for (int b = 0; b < B; b++) {
            if (lens[b] < 1 || lens[b] > X->Tt)
                return vlmoe_fail(VLMOE_ERR_ARG, "text %d: length %d outside [1, %d]", b, lens[b], X->Tt);
            for (int t = 0; t < X->Tt; t++) {
                const int32_t id = tokens[(size_t)b * X->Tt + t], y = tl ? tl[(size_t)b * X->Tt + t] : -1;
                if (id < 0 || id >= c->vocab_size)
                    return vlmoe_fail(VLMOE_ERR_ARG, "text %d: token %d at position %d outside the vocabulary [0, %d)",
                                      b, id, t, c->vocab_size);
                if (y < -1 || y >= c->vocab_size || (y >= 0 && t >= lens[b]))
                    return vlmoe_fail(VLMOE_ERR_ARG, "text %d: label %d at position %d: need -1, or an id in "
                                      "[0, %d) inside the text (length %d)", b, y, t, c->vocab_size, lens[b]);
                if (y >= 0) {
                    const int i = g->count[HEAD_TEXT]++;
                    g->rows[HEAD_TEXT][i] = b * g->T + g->text_off + t;
                    g->labels[HEAD_TEXT][i] = y;
                }
            }
            g->seqlens[b] = g->text_off + lens[b];
        }
        memcpy(g->tokens, tokens, sizeof(int32_t) * (size_t)B * X->Tt);
        memcpy(g->lens, lens, sizeof(int32_t) * (size_t)B);
    }
    g->have_cls = in->class_labels != NULL;
    if (in->class_labels && B % X->cs)
        return vlmoe_fail(VLMOE_ERR_ARG, "the classification head takes %d sequences per example (NLVR2: two "
                          "image-text pairs), but the batch holds %d", X->cs, B);
    if (in->class_labels) {
        if (X->cls_w == NO_PARAM)
            return vlmoe_fail(VLMOE_ERR_ARG, "class labels given, but model '%s' has no classification head "
                              "(num_classes = 0)", c->name);
        for (int b = 0; b < B / X->cs; b++)
            if (in->class_labels[b] < 0 || in->class_labels[b] >= c->num_classes)
                return vlmoe_fail(VLMOE_ERR_ARG, "example %d: class label %d outside [0, num_classes = %d)", b,
                                  in->class_labels[b], c->num_classes);
        memcpy(g->clabels, in->class_labels, sizeof(int32_t) * (size_t)(B / X->cs));
    }
    memset(g->masked, 0, (size_t)B * X->np);
    if (img && pl)
        for (int b = 0; b < B; b++)
            for (int p = 0; p < X->np; p++) {
                const int32_t y = pl[(size_t)b * X->np + p];
                if (y < -1 || y >= c->mim_vocab)
                    return vlmoe_fail(VLMOE_ERR_ARG, "image %d: patch %d has label %d: need -1 or a visual token "
                                      "in [0, mim_vocab = %d)", b, p, y, c->mim_vocab);
                if (y < 0) continue;
                const int i = g->count[HEAD_IMAGE]++;
                g->masked[(size_t)b * X->np + p] = 1;
                g->rows[HEAD_IMAGE][i] = b * g->T + 1 + p; // after [I_CLS]
                g->labels[HEAD_IMAGE][i] = y;
            }
    // every MoE layer must be able to split its stream into routing groups
    for (int l = 0; l < g->L->enc[0].layers; l++)
        for (int k = MOME_V; k <= MOME_T; k++) {
            const mome_acts *a = &g->layers[l];
            if (!a->moe[k] || (k == MOME_V ? !img : !txt)) continue;
            int st = moe_check_groups(&a->spec[k], B * (k == MOME_V ? X->Ti : X->Tt), g->training);
            if (st) {
                vlmoe_error_prefix("block %d %s", l, k == MOME_V ? "V-MoE" : "T-MoE");
                return st;
            }
        }
    return VLMOE_OK;
}

static void stem_forward(struct R(mome_graph) *g, const real *P, const real *images) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const mome_layout *X = g->X;
    const vlmoe_model_config *c = &L->cfg;
    const modality_layout *mi = &L->mod[MOD_IMAGE], *mt = &L->mod[MOD_TEXT];
    const int B = g->B, D = g->D;
    if (g->enc != VLMOE_ENC_TEXT) {
        if (!be->host_memory) {
            be->upload(be, g->images, images, (size_t)B * c->channels * c->image_size * c->image_size);
            images = g->images;
        }
        be->patchify_forward(be, g->patches, images, B, c->channels, c->image_size, c->patch_size);
        be->linear_forward(be, g->pemb, g->patches, P + mi->embed_w, mi->embed_b == NO_PARAM ? NULL : P + mi->embed_b,
                          B * X->np, X->pd, D, 0);
        for (size_t i = 0; i < (size_t)B * X->np; i++) // BEiT: a masked patch becomes the mask token
            if (g->masked[i]) be->copy(be, g->pemb + i * D, P + X->mask_patch, D);
        be->cls_forward(be, g->ximg, P + mi->cls, g->pemb, B, X->np, D);
        be->posadd_forward(be, g->ximg, P + mi->pos, B, X->Ti, D);
        scatter(be, g->x0, g->ximg, B, g->T, 0, X->Ti, D);
    }
    if (g->enc != VLMOE_ENC_IMAGE) {
        be->embed_forward(be, g->xtxt, dev_ints(g, g->tokens), P + mt->embed_w, B * X->Tt, D);
        be->posadd_forward(be, g->xtxt, P + mt->pos, B, X->Tt, D);
        scatter(be, g->x0, g->xtxt, B, g->T, g->text_off, X->Tt, D);
    }
}

static void stem_backward(struct R(mome_graph) *g, const real *P, real *G) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const mome_layout *X = g->X;
    const modality_layout *mi = &L->mod[MOD_IMAGE], *mt = &L->mod[MOD_TEXT];
    const int B = g->B, D = g->D;
    if (g->enc != VLMOE_ENC_TEXT) {
        gather(be, g->dximg, g->pass.dres, B, g->T, 0, X->Ti, D);
        be->posadd_backward(be, G + mi->pos, g->dximg, B, X->Ti, D);
        be->zero(be, g->dpemb, (size_t)B * X->np * D);
        be->cls_backward(be, G + mi->cls, g->dpemb, g->dximg, B, X->np, D);
        for (size_t i = 0; i < (size_t)B * X->np; i++) {
            if (!g->masked[i]) continue;
            real *d = g->dpemb + i * D;
            be->add(be, G + X->mask_patch, d, D);
            be->zero(be, d, D); // the patch's own embedding did not reach the output
        }
        be->linear_backward(be, NULL, G + mi->embed_w, mi->embed_b == NO_PARAM ? NULL : G + mi->embed_b, g->dpemb,
                           g->patches, P + mi->embed_w, B * X->np, X->pd, D);
    }
    if (g->enc != VLMOE_ENC_IMAGE) {
        gather(be, g->dxtxt, g->pass.dres, B, g->T, g->text_off, X->Tt, D);
        be->posadd_backward(be, G + mt->pos, g->dxtxt, B, X->Tt, D);
        be->embed_backward(be, G + mt->embed_w, g->dxtxt, dev_ints(g, g->tokens), B * X->Tt, D);
    }
}

static void head_params(const struct R(mome_graph) *g, int h, size_t *w, size_t *b, int *C) {
    const mome_layout *X = g->X;
    *w = h == HEAD_TEXT ? X->mlm_w : X->mim_w;
    *b = h == HEAD_TEXT ? X->mlm_b : X->mim_b;
    *C = h == HEAD_TEXT ? g->L->cfg.vocab_size : g->L->cfg.mim_vocab;
}

// The classification head's input (VL-MoE sec. 4.2): the mean of the final features of the
// image's patch tokens ([I_CLS] left out, as BEiT pools: rows 1..np of each sequence) for images;
// the [T_CLS] feature for texts and, fused, for pairs (the first text token, at text_off).
// pooled (B,D) from lnf (B,T,D), both through the backend's pool ops on the offset sequences.
static void pool_forward(struct R(mome_graph) *g) {
    const R(vlmoe_backend) *be = g->be;
    const int B = g->B, D = g->D;
    if (g->enc == VLMOE_ENC_IMAGE)
        be->pool_forward(be, g->pooled, g->lnf + D, dev_ints(g, g->plens), B, g->T, D, VLMOE_POOL_MEAN);
    else
        be->pool_forward(be, g->pooled, g->lnf + (size_t)g->text_off * D, NULL, B, g->T, D, VLMOE_POOL_CLS);
}

// Accumulates d(pooled) (B,D) into dlnf (B,T,D).
static void pool_backward(struct R(mome_graph) *g) {
    const R(vlmoe_backend) *be = g->be;
    const int B = g->B, D = g->D;
    if (g->enc == VLMOE_ENC_IMAGE)
        be->pool_backward(be, g->dlnf + D, g->dpooled, dev_ints(g, g->plens), B, g->T, D, VLMOE_POOL_MEAN);
    else
        be->pool_backward(be, g->dlnf + (size_t)g->text_off * D, g->dpooled, NULL, B, g->T, D, VLMOE_POOL_CLS);
}

int R(mome_graph_forward)(struct R(mome_graph) *g, const real *P, const R(mome_input) *in,
                          vlmoe_mome_stats *res) {
    const R(vlmoe_backend) *be = g->be;
    const model_layout *L = g->L;
    const encoder_layout *E = &L->enc[0];
    const int D = g->D;
    g->have_forward = 0;
    int st = take_inputs(g, in);
    if (st) return st;
    if (g->d_ints != g->ints) g->be->upload_bytes(g->be, g->d_ints, g->ints, sizeof(int32_t) * g->nints);
    const int n = g->n;
    g->aux = 0;
    // layers this encoding does not run (V-MoE for texts, T-MoE for images) report 0 tokens, not
    // the numbers of an earlier forward
    for (int l = 0; l < E->layers; l++) // nor what a device table still owed them (src/moe/layer.c)
        for (int k = MOME_V; k <= MOME_T; k++) R(moe_stats_forget)(g->layers[l].moe[k]);
    for (int i = 0; i < L->nmoe; i++) {
        vlmoe_moe_stats *s = &g->stats[i];
        const vlmoe_moe_stats keep = *s;
        memset(s, 0, sizeof(*s));
        s->encoder = keep.encoder, s->block = keep.block, s->num_experts = keep.num_experts;
        for (int m = 0; m < 2; m++) s->routed[m] = keep.routed[m], s->accepted[m] = keep.accepted[m];
    }
    stem_forward(g, P, in->images);
    set_pass(g);
    // drop path in training only (evaluation runs the whole network, as timm's DropPath does)
    g->drop_on = g->training && (g->drop_path > 0 || g->drop_keep);
    if (g->drop_on) draw_drop_path(g);
    const real *x = g->x0;
    for (int l = 0; l < E->layers; l++) {
        R(block_ffn) f[2];
        const R(block) b = block_of(g, l, f, 1);
        set_drop(g, l);
        if ((st = R(block_forward)(&g->pass, &b, P, x, &g->aux))) return vlmoe_error_prefix("block %d", l), st;
        x = b.a->res2;
    }
    be->layernorm_forward(be, g->lnf, g->lnf_m, g->lnf_r, x, P + E->lnf_w, P + E->lnf_b, n, D, L->cfg.ln_eps);
    double loss[2] = {0, 0}, acc[2] = {0, 0};
    for (int h = 0; h < 2; h++) {
        const int cnt = g->count[h];
        if (!cnt) continue;
        size_t w, b;
        int C, right = 0;
        head_params(g, h, &w, &b, &C);
        for (int i = 0; i < cnt; i++)
            be->copy(be, g->hsel[h] + (size_t)i * D, g->lnf + (size_t)g->rows[h][i] * D, D);
        be->linear_forward(be, g->probs[h], g->hsel[h], P + w, P + b, cnt, D, C, 0);
        loss[h] = be->xent_forward(be, g->probs[h], g->probs[h], dev_ints(g, g->labels[h]), cnt, C, &right) /
                  head_norm(g, h);
        acc[h] = (double)right / cnt;
    }
    double closs = 0, cacc = 0;
    const size_t cw = g->X->cls_w, cb = g->X->cls_b;
    const int NC = L->cfg.num_classes, cs = g->X->cs, ne = g->B / cs;
    if (cw != NO_PARAM) { // pooled (B,D) read as (B/cs, cs*D): NLVR2's two features side by side
        pool_forward(g);
        be->linear_forward(be, g->clogits, g->pooled, P + cw, P + cb, ne, cs * D, NC, 0);
        if (g->have_cls) {
            int right = 0;
            closs = be->xent_forward(be, g->cprobs, g->clogits, dev_ints(g, g->clabels), ne, NC, &right) / ne;
            cacc = (double)right / ne;
        }
    }
    g->have_forward = 1;
    if (res) {
        memset(res, 0, sizeof(*res));
        res->text = loss[HEAD_TEXT];
        res->image = loss[HEAD_IMAGE];
        res->text_acc = acc[HEAD_TEXT];
        res->image_acc = acc[HEAD_IMAGE];
        res->text_count = g->count[HEAD_TEXT];
        res->image_count = g->count[HEAD_IMAGE];
        res->aux = g->aux;
        res->cls = closs;
        res->cls_acc = cacc;
        res->cls_count = g->have_cls ? ne : 0;
        res->loss = res->text + res->image + res->cls + res->aux;
    }
    return VLMOE_OK;
}

void R(mome_graph_backward)(struct R(mome_graph) *g, const real *P, real *G) {
    const R(vlmoe_backend) *be = g->be;
    if (!g->have_forward) return;
    const model_layout *L = g->L;
    const encoder_layout *E = &L->enc[0];
    const int D = g->D, n = g->n;
    // heads: each a mean over its labelled positions
    be->zero(be, g->dlnf, (size_t)n * D);
    for (int h = 0; h < 2; h++) {
        const int cnt = g->count[h];
        if (!cnt) continue;
        size_t w, b;
        int C;
        head_params(g, h, &w, &b, &C);
        be->zero(be, g->dlog, (size_t)cnt * C);
        be->xent_backward(be, g->dlog, g->probs[h], dev_ints(g, g->labels[h]), cnt, C, 1.0 / head_norm(g, h));
        be->zero(be, g->dhsel, (size_t)cnt * D);
        be->linear_backward(be, g->dhsel, G + w, G + b, g->dlog, g->hsel[h], P + w, cnt, D, C);
        for (int i = 0; i < cnt; i++) be->add(be, g->dlnf + (size_t)g->rows[h][i] * D, g->dhsel + (size_t)i * D, D);
    }
    if (g->have_cls) { // the classification head: a mean over the B/cs examples
        const size_t cw = g->X->cls_w, cb = g->X->cls_b;
        const int NC = L->cfg.num_classes, cs = g->X->cs, ne = g->B / cs;
        be->zero(be, g->dlog, (size_t)ne * NC);
        be->xent_backward(be, g->dlog, g->cprobs, dev_ints(g, g->clabels), ne, NC, 1.0 / ne);
        be->zero(be, g->dpooled, (size_t)g->B * D);
        be->linear_backward(be, g->dpooled, G + cw, G + cb, g->dlog, g->pooled, P + cw, ne, cs * D, NC);
        pool_backward(g);
    }
    if (g->dfeat) // an outside loss on the retrieval features (mome_itc_backward)
        for (int b = 0; b < g->B; b++)
            be->add(be, g->dlnf + ((size_t)b * g->T + g->text_off) * D, g->dfeat + (size_t)b * D, D);
    const real *xL = E->layers ? g->layers[E->layers - 1].a.res2 : g->x0;
    real *dres = g->pass.dres;
    set_pass(g);
    be->zero(be, dres, (size_t)n * D);
    be->layernorm_backward(be, dres, G + E->lnf_w, G + E->lnf_b, g->dlnf, xL, P + E->lnf_w, g->lnf_m, g->lnf_r, n, D);
    for (int l = E->layers - 1; l >= 0; l--) {
        R(block_ffn) f[2];
        const R(block) b = block_of(g, l, f, 0);
        set_drop(g, l);
        R(block_backward)(&g->pass, &b, P, G, l ? g->layers[l - 1].a.res2 : g->x0);
    }
    stem_backward(g, P, G);
}

// ---- the retrieval head: contrastive fine-tuning on separately encoded images and texts

struct R(mome_itc) {
    const model_layout *L;
    const R(vlmoe_backend) *be;
    int B, D, E;
    real *feat[2], *proj[2], *norm[2], *emb[2]; // per side: (B,D) features, (B,E) projections,
                                                // (B) norms, (B,E) normalised embeddings
    real *demb[2], *dproj[2], *dfeat[2];
    struct R(contrastive_step) *loss;
    real *arena;
};

static void itc_plan(struct R(mome_itc) *c, carver *k) {
    const size_t B = (size_t)c->B, D = (size_t)c->D, E = (size_t)c->E;
    for (int s = 0; s < 2; s++) {
        c->feat[s] = carve(k, B * D);
        c->proj[s] = carve(k, B * E);
        c->norm[s] = carve(k, B);
        c->emb[s] = carve(k, B * E);
        c->demb[s] = carve(k, B * E);
        c->dproj[s] = carve(k, B * E);
        c->dfeat[s] = carve(k, B * D);
    }
}

int R(mome_itc_create)(struct R(mome_itc) **out, const model_layout *L, const R(vlmoe_backend) *be, int B) {
    *out = NULL;
    if (!L->mome || L->mome->itc_proj[0] == NO_PARAM)
        return vlmoe_fail(VLMOE_ERR_ARG, "model '%s' has no retrieval head (retrieval_head = 0)", L->cfg.name);
    if (B < 1) return vlmoe_fail(VLMOE_ERR_ARG, "batch size must be >= 1, got %d", B);
    struct R(mome_itc) *c = vlmoe_calloc(sizeof(*c), "retrieval head");
    if (!c) return VLMOE_ERR_NOMEM;
    *c = (struct R(mome_itc)){.L = L, .be = be, .B = B, .D = L->enc[0].width, .E = L->cfg.embed_dim};
    carver k = {NULL, 0};
    itc_plan(c, &k);
    if (!(c->arena = be->alloc(be, sizeof(real) * k.used, "retrieval head"))) return R(mome_itc_free)(c), VLMOE_ERR_NOMEM;
    int st = R(contrastive_step_create)(&c->loss, be, B, c->E);
    if (st) return R(mome_itc_free)(c), st;
    k = (carver){c->arena, 0};
    itc_plan(c, &k);
    *out = c;
    return VLMOE_OK;
}

void R(mome_itc_free)(struct R(mome_itc) *c) {
    if (!c) return;
    R(contrastive_step_free)(c->loss);
    c->be->free(c->be, c->arena);
    vlmoe_free_mem(c);
}

const real *R(mome_itc_embed)(struct R(mome_itc) *c, const struct R(mome_graph) *g, const real *P, int which) {
    const R(vlmoe_backend) *be = g->be;
    const int D = c->D, E = c->E;
    for (int b = 0; b < c->B; b++) be->copy(be, c->feat[which] + (size_t)b * D, R(mome_graph_feature)(g, b), D);
    be->linear_forward(be, c->proj[which], c->feat[which], P + c->L->mome->itc_proj[which], NULL, c->B, D, E, 0);
    be->l2norm_forward(be, c->emb[which], c->norm[which], c->proj[which], c->B, E);
    return c->emb[which];
}

double R(mome_itc_forward)(struct R(mome_itc) *c, const struct R(mome_graph) *gi, const struct R(mome_graph) *gt,
                           const real *P, double *acc) {
    R(mome_itc_embed)(c, gi, P, 0);
    R(mome_itc_embed)(c, gt, P, 1);
    return R(contrastive_step_forward)(c->loss, c->emb[0], c->emb[1], P + c->L->logit_scale, acc);
}

void R(mome_itc_backward)(struct R(mome_itc) *c, struct R(mome_graph) *gi, struct R(mome_graph) *gt, const real *P,
                          real *G) {
    const R(vlmoe_backend) *be = c->be;
    const int B = c->B, D = c->D, E = c->E;
    const size_t ls = c->L->logit_scale;
    be->zero(be, c->demb[0], (size_t)B * E);
    be->zero(be, c->demb[1], (size_t)B * E);
    R(contrastive_step_backward)(c->loss, c->demb[0], c->demb[1], G + ls, 1.0);
    struct R(mome_graph) *g[2] = {gi, gt};
    for (int s = 0; s < 2; s++) {
        be->zero(be, c->dproj[s], (size_t)B * E);
        be->l2norm_backward(be, c->dproj[s], c->demb[s], c->emb[s], c->norm[s], B, E);
        be->zero(be, c->dfeat[s], (size_t)B * D);
        const size_t w = c->L->mome->itc_proj[s];
        be->linear_backward(be, c->dfeat[s], G + w, NULL, c->dproj[s], c->feat[s], P + w, B, D, E);
        R(mome_graph_set_feature_grad)(g[s], c->dfeat[s]);
        R(mome_graph_backward)(g[s], P, G);
        R(mome_graph_set_feature_grad)(g[s], NULL);
    }
}

const real *R(mome_itc_embedding)(const struct R(mome_itc) *c, int which) { return c->emb[which ? 1 : 0]; }
