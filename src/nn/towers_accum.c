// towers_accum.c: gradient accumulation for the towers, OpenCLIP's --accum-freq (train.py,
// train_one_epoch): one optimizer step over N micro-batches whose contrastive loss is the loss of
// their whole accumulated batch. A first pass encodes every micro-batch and keeps its embeddings
// only (the activation arena is the one micro-batch's); then each micro-batch runs again with
// activations, its fresh embeddings take the place of its cached ones, the loss over all of them
// is backpropagated into this micro-batch's towers (every other row a constant) and the gradients
// add up. Covered by tests/test_accum.c (against one step at N times the batch) and
// tests/test_train_dist.c (with data parallelism).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"
#include "moe/layer.h"
#include "nn/model.h"
#include "nn/routing.h"

// Running sums of one MoE layer's routing statistics over the micro-batches, as counts, so that
// the merged statistics are those of one forward of the accumulated batch.
typedef struct {
    double tokens[2], ok[2], assign[2], drop[2], maxg[2], hpre[2];
    double *routed[2], *accepted[2], *gate[2]; // (E) assignments, accepted tokens, gate sums
    double aux[VLMOE_AUX_COUNT], minmax[4];
    double soft_mean_max[2];   // summed over the micro-batches
    int capacity;
    int parts;
} layer_sums;

struct towers_accum {
    int G, B, E;                     // pairs of the accumulated (global) batch, of a micro-batch
    contrastive_step_f32 *loss;      // the loss over the G pairs
    float *img, *txt, *dimg, *dtxt;  // (G,E) the cached embeddings and the loss's gradients
    float *keep_img, *keep_txt;      // (B,E) the cached rows a micro-batch's fresh ones replace
    int nmoe;
    layer_sums *sums;                // (nmoe)
    vlmoe_moe_stats *stats;          // (nmoe) the merged statistics, their arrays in `arrays`
    double *arrays;
};

void towers_accum_free(vlmoe_model *m) {
    struct towers_accum *a = m->accum;
    if (!a) return;
    const vlmoe_backend_f32 *be = m->be;
    contrastive_step_free_f32(a->loss);
    be->free(be, a->img), be->free(be, a->txt), be->free(be, a->dimg), be->free(be, a->dtxt);
    be->free(be, a->keep_img), be->free(be, a->keep_txt);
    free(a->sums), free(a->stats), free(a->arrays);
    free(a);
    m->accum = NULL;
    m->accum_stats = 0;
}

// The buffers of an accumulated batch of G pairs in micro-batches of B, on the model's backend
// (so accumulation runs wherever the towers do), and the statistics of its MoE layers.
static int accum_plan(vlmoe_model *m, int B, int G) {
    if (m->accum && m->accum->G == G && m->accum->B == B) return VLMOE_OK;
    towers_accum_free(m);
    const vlmoe_backend_f32 *be = m->be;
    const int E = m->L.cfg.embed_dim;
    struct towers_accum *a = m->accum = calloc(1, sizeof(*a));
    if (!a) return vlmoe_fail(VLMOE_ERR_NOMEM, "gradient accumulation");
    a->G = G, a->B = B, a->E = E;
    const size_t big = sizeof(float) * (size_t)G * E, small = sizeof(float) * (size_t)B * E;
    const char *what = "the accumulated batch's embeddings";
    a->img = be->alloc(be, big, what), a->txt = be->alloc(be, big, what);
    a->dimg = be->alloc(be, big, what), a->dtxt = be->alloc(be, big, what);
    a->keep_img = be->alloc(be, small, what), a->keep_txt = be->alloc(be, small, what);
    int st = a->img && a->txt && a->dimg && a->dtxt && a->keep_img && a->keep_txt ? VLMOE_OK : VLMOE_ERR_NOMEM;
    if (!st) st = contrastive_step_create_f32(&a->loss, be, G, E);
    a->nmoe = st ? 0 : m->L.nmoe;
    if (a->nmoe) {
        a->sums = calloc((size_t)a->nmoe, sizeof(*a->sums));
        a->stats = calloc((size_t)a->nmoe, sizeof(*a->stats));
        size_t need = 0; // per layer and modality: 3 sums and 2 merged arrays of E
        for (int e = 0; e < m->L.nenc; e++)
            for (int l = 0; l < m->L.enc[e].layers; l++)
                if (m->L.enc[e].blocks[l].ffn.kind == FFN_MOE) need += (size_t)10 * m->L.enc[e].moe->num_experts;
        a->arrays = calloc(need ? need : 1, sizeof(double));
        if (!a->sums || !a->stats || !a->arrays) st = vlmoe_fail(VLMOE_ERR_NOMEM, "merged routing statistics");
        double *p = a->arrays;
        for (int e = 0; e < m->L.nenc && !st; e++)
            for (int l = 0; l < m->L.enc[e].layers; l++) {
                const ffn_layout *f = &m->L.enc[e].blocks[l].ffn;
                if (f->kind != FFN_MOE || f->moe_index < 0 || f->moe_index >= a->nmoe) continue;
                const int ne = m->L.enc[e].moe->num_experts;
                layer_sums *s = &a->sums[f->moe_index];
                vlmoe_moe_stats *o = &a->stats[f->moe_index];
                o->encoder = e, o->block = l, o->num_experts = ne;
                for (int k = 0; k < 2; k++) {
                    s->routed[k] = p, p += ne;
                    s->accepted[k] = p, p += ne;
                    s->gate[k] = p, p += ne;
                    o->routed[k] = p, p += ne;
                    o->accepted[k] = p, p += ne;
                    if (m->L.enc[e].moe->router == VLMOE_ROUTER_SOFT) // no shares per expert, as in layer.c
                        o->routed[k] = o->accepted[k] = NULL;
                }
            }
    }
    if (st) towers_accum_free(m);
    return st;
}

static void sums_reset(struct towers_accum *a) {
    for (int i = 0; i < a->nmoe; i++) {
        layer_sums *s = &a->sums[i];
        const int ne = a->stats[i].num_experts;
        double *arr[6] = {s->routed[0], s->routed[1], s->accepted[0], s->accepted[1], s->gate[0], s->gate[1]};
        for (int k = 0; k < 6; k++) memset(arr[k], 0, sizeof(double) * (size_t)ne);
        memset(s->tokens, 0, sizeof(s->tokens)), memset(s->ok, 0, sizeof(s->ok));
        memset(s->assign, 0, sizeof(s->assign)), memset(s->drop, 0, sizeof(s->drop));
        memset(s->maxg, 0, sizeof(s->maxg)), memset(s->hpre, 0, sizeof(s->hpre)), memset(s->aux, 0, sizeof(s->aux));
        s->minmax[0] = s->minmax[2] = INFINITY, s->minmax[1] = s->minmax[3] = -INFINITY;
        s->soft_mean_max[0] = s->soft_mean_max[1] = 0, s->capacity = 0;
        s->parts = 0;
    }
}

// Adds the routing of the last micro-batch. Fractions become counts again: a fraction of the
// tokens times the tokens, of the assignments (top_k per token with tokens choice; the accepted
// ones with experts choice, which drops nothing) times the assignments.
static void sums_add(struct towers_accum *a, const vlmoe_model *m) {
    int n = 0;
    const vlmoe_moe_stats *ms = graph_moe_stats_f32(m->g, &n);
    for (int i = 0; i < a->nmoe && i < n; i++) {
        const vlmoe_moe_stats *x = &ms[i];
        layer_sums *s = &a->sums[i];
        const vlmoe_moe_config *c = m->L.enc[x->encoder].moe;
        const int E = a->stats[i].num_experts, tc = c->router == VLMOE_ROUTER_TOKENS;
        const struct moe_state_f32 *layer = graph_moe_layer_f32(m->g, i);
        for (int k = 0; k < 2; k++) {
            const double T = x->tokens[k];
            s->tokens[k] += T, s->ok[k] += x->success[k] * T;
            s->maxg[k] += x->mean_max_gate[k] * T, s->hpre[k] += x->entropy_token[k] * T;
            const double *gs = layer ? moe_gate_sums_f32(layer, k) : NULL;
            if (!gs || !x->routed[k] || !x->accepted[k] || T == 0) continue; // Soft MoE: no assignments
            double acc = 0;
            for (int e = 0; e < E; e++) acc += x->accepted[k][e] * T;
            const double assign = tc ? T * c->top_k : acc;
            s->assign[k] += assign, s->drop[k] += x->dropped[k] * assign;
            for (int e = 0; e < E; e++) {
                s->routed[k][e] += x->routed[k][e] * assign;
                s->accepted[k][e] += x->accepted[k][e] * T;
                s->gate[k][e] += gs[e];
            }
        }
        for (int k = 0; k < VLMOE_AUX_COUNT; k++) s->aux[k] += x->aux[k];
        s->minmax[0] = fmin(s->minmax[0], x->soft_minmax[0]), s->minmax[1] = fmax(s->minmax[1], x->soft_minmax[1]);
        s->minmax[2] = fmin(s->minmax[2], x->soft_minmax[2]), s->minmax[3] = fmax(s->minmax[3], x->soft_minmax[3]);
        s->soft_mean_max[0] += x->soft_mean_max[0], s->soft_mean_max[1] += x->soft_mean_max[1];
        s->capacity = x->capacity > s->capacity ? x->capacity : s->capacity; // the same in every part
        s->parts++;
    }
}

// The statistics of the accumulated batch, as src/moe/layer.c's fill_stats computes them for one
// forward; the auxiliary losses, means over groups, are the means over the micro-batches (each
// holds the same number of groups).
static void sums_finish(struct towers_accum *a) {
    for (int i = 0; i < a->nmoe; i++) {
        const layer_sums *s = &a->sums[i];
        vlmoe_moe_stats *o = &a->stats[i];
        const int E = o->num_experts;
        for (int k = 0; k < 2; k++) {
            const double T = s->tokens[k] > 0 ? s->tokens[k] : 1;
            double acc = 0, hpost = 0, hbar = 0;
            for (int e = 0; e < E; e++) acc += s->accepted[k][e];
            for (int e = 0; e < E; e++) {
                const double q = acc > 0 ? s->accepted[k][e] / acc : 0, pb = s->gate[k][e] / T;
                if (q > 0) hpost -= q * log(q);
                if (pb > 0) hbar -= pb * log(pb);
                if (!o->routed[k]) continue; // Soft MoE
                o->routed[k][e] = s->assign[k] > 0 ? s->routed[k][e] / s->assign[k] : 0;
                o->accepted[k][e] = s->accepted[k][e] / T;
            }
            o->tokens[k] = (int)s->tokens[k];
            o->success[k] = s->ok[k] / T;
            o->dropped[k] = s->assign[k] > 0 ? s->drop[k] / s->assign[k] : 0;
            o->mean_max_gate[k] = s->maxg[k] / T;
            o->entropy_token[k] = s->hpre[k] / T;
            o->entropy_post[k] = hpost;
            o->experts_used[k] = s->tokens[k] > 0 && s->assign[k] > 0 ? exp(hbar) : 0;
            o->entropy_pre[k] = s->tokens[k] > 0 && s->assign[k] > 0 ? hbar : 0;
            if (o->routed[k]) vlmoe_experts_cover(o->routed[k], E, o->experts_cover[k]);
        }
        for (int k = 0; k < VLMOE_AUX_COUNT; k++) o->aux[k] = s->parts ? s->aux[k] / s->parts : 0;
        memcpy(o->soft_minmax, s->minmax, sizeof(o->soft_minmax));
        o->soft_mean_max[0] = s->parts ? s->soft_mean_max[0] / s->parts : 0;
        o->soft_mean_max[1] = s->parts ? s->soft_mean_max[1] / s->parts : 0;
        o->capacity = s->capacity;
    }
}

const vlmoe_moe_stats *towers_accum_stats(const vlmoe_model *m, int *count) {
    const int n = m->accum && m->accum_stats ? m->accum->nmoe : 0;
    if (count) *count = n;
    return n ? m->accum->stats : NULL;
}

// One training encode of micro-batch b: the step's noise, keyed by the samples' indices in the
// accumulated batch from `base` on.
static int encode(vlmoe_model *m, const float *P, const vlmoe_batch *b, uint64_t seed, uint64_t base, double *aux) {
    graph_set_sample_base_f32(m->g, base);
    graph_set_mode_f32(m->g, 1, seed);
    return graph_encode_f32(m->g, P, b->images, b->tokens, b->lengths, aux);
}

int model_accumulate(vlmoe_model *m, const vlmoe_batch *mb, int N, vlmoe_step_stats *stats) {
    if (m->L.arch != &model_arch_towers)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': gradient accumulation is for contrastive (one_tower, "
                          "two_tower) models; a VL-MoE step already adds the gradients of its streams' forwards",
                          m->L.cfg.name);
    if (N < 1 || !mb) return vlmoe_fail(VLMOE_ERR_ARG, "gradient accumulation over %d micro-batches", N);
    if (m->pix) return m->pix = NULL, vlmoe_fail(VLMOE_ERR_ARG, "gradient accumulation takes float images, not bytes");
    const int B = mb[0].batch_size;
    for (int j = 0; j < N; j++)
        if (mb[j].batch_size != B || B < 1 || !mb[j].images || !mb[j].tokens || !mb[j].lengths)
            return vlmoe_fail(VLMOE_ERR_ARG, "gradient accumulation: micro-batch %d has %d pairs%s, micro-batch 1 "
                              "has %d (every micro-batch needs images, tokens and lengths, at one batch size)",
                              j + 1, mb[j].batch_size, mb[j].images && mb[j].tokens && mb[j].lengths ? "" : " or misses data", B);
    vlmoe_dist *d = m->dist;
    const int W = d ? d->world : 1, rank = d ? d->rank : 0;
    const int64_t G64 = (int64_t)W * N * B;
    if (G64 < 2 || G64 > 1 << 20)
        return vlmoe_fail(VLMOE_ERR_ARG, "gradient accumulation: %d process%s x %d micro-batches x %d pairs = %lld "
                          "pairs (2 to 2^20)", W, W == 1 ? "" : "es", N, B, (long long)G64);
    if (d && !m->be->host_memory) // as dp_plan: MPI reads and writes host memory
        return vlmoe_fail(VLMOE_ERR_CONFIG, "gradient accumulation on several processes needs host memory; the %s "
                          "backend's embeddings live on the device", m->be->name);
    int st = m->L.arch->plan(m, B);
    if (!st) st = accum_plan(m, B, (int)G64);
    // experts split over the processes in data-parallel training only
    if (!st) st = graph_set_expert_parallel_f32(m->g, d ? m->experts : NULL);
    if (st) return st;
    struct towers_accum *a = m->accum;
    const vlmoe_backend_f32 *be = m->be;
    const int E = a->E;
    const size_t n = (size_t)B * E, own = (size_t)rank * N * B; // this process's first row
    const float *P = model_params_for_graph(m);
    float *grads = m->d_grads ? m->d_grads : m->grads;
    // one draw of routing noise for the step, as for one forward of the accumulated batch
    const uint64_t seed = m->seed * 0x9e3779b97f4a7c15ULL + m->forwards++;
    m->have_forward = 0, m->accum_stats = 0;
    for (int j = 0; j < N; j++) { // the embeddings of every micro-batch, without their activations
        if ((st = encode(m, P, &mb[j], seed, own + (size_t)j * B, NULL)))
            return vlmoe_error_prefix("micro-batch %d of %d", j + 1, N), st;
        be->copy(be, a->img + (own + (size_t)j * B) * E, graph_embeddings_f32(m->g, MOD_IMAGE), n);
        be->copy(be, a->txt + (own + (size_t)j * B) * E, graph_embeddings_f32(m->g, MOD_TEXT), n);
    }
    if (d && ((st = d->allgather(d, a->img, a->img + own * E, n * N, VLMOE_DIST_F32)) ||
              (st = d->allgather(d, a->txt, a->txt + own * E, n * N, VLMOE_DIST_F32))))
        return vlmoe_error_prefix("gathering the embeddings"), st;
    memset(m->grads, 0, sizeof(float) * m->L.total);
    if (m->d_grads) be->zero(be, m->d_grads, m->L.total);
    sums_reset(a);
    double loss = 0, aux = 0, acc[2] = {0, 0};
    for (int j = 0; j < N && !st; j++) {
        double aj = 0, accj[2];
        if ((st = encode(m, P, &mb[j], seed, own + (size_t)j * B, &aj))) {
            vlmoe_error_prefix("micro-batch %d of %d", j + 1, N);
            break;
        }
        aux += aj;
        float *ri = a->img + (own + (size_t)j * B) * E, *rt = a->txt + (own + (size_t)j * B) * E;
        be->copy(be, a->keep_img, ri, n), be->copy(be, a->keep_txt, rt, n);
        be->copy(be, ri, graph_embeddings_f32(m->g, MOD_IMAGE), n);
        be->copy(be, rt, graph_embeddings_f32(m->g, MOD_TEXT), n);
        const double l = contrastive_step_forward_f32(a->loss, a->img, a->txt, P + m->L.logit_scale, accj);
        if (!isfinite(l)) {
            st = vlmoe_fail(VLMOE_ERR_NUMERIC, "the contrastive loss of the accumulated batch is %g (re-running micro-batch "
                            "%d of %d)", l, j + 1, N);
            break;
        }
        if (j == 0) loss = l, acc[0] = accj[0], acc[1] = accj[1];
        be->zero(be, a->dimg, (size_t)a->G * E);
        be->zero(be, a->dtxt, (size_t)a->G * E);
        // every micro-batch's loss is the whole batch's, so its d/dlogit_scale is the whole
        // gradient each time: the 1/N below makes it count once (OpenCLIP sums it N times)
        contrastive_step_backward_f32(a->loss, a->dimg, a->dtxt, grads + m->L.logit_scale, 1.0);
        // times N for the 1/N below, which averages the auxiliary losses' gradients over the
        // micro-batches; times W for the trainer's mean over the processes (as dp_backward)
        be->scale(be, a->dimg + (ri - a->img), n, (float)((double)N * W));
        be->scale(be, a->dtxt + (rt - a->txt), n, (float)((double)N * W));
        const float *const demb[NUM_MOD] = {a->dimg + (ri - a->img), a->dtxt + (rt - a->txt)};
        graph_encode_backward_f32(m->g, P, grads, demb);
        be->copy(be, ri, a->keep_img, n), be->copy(be, rt, a->keep_txt, n); // OpenCLIP's cached rows
        sums_add(a, m);
    }
    if (st) return st;
    be->scale(be, grads, m->L.total, (float)(1.0 / N));
    if (m->d_grads) {
        be->download(be, m->grads, m->d_grads, m->L.total);
        be->sync(be);
    }
    sums_finish(a);
    m->accum_stats = a->nmoe > 0;
    if (stats) {
        memset(stats, 0, sizeof(*stats));
        stats->contrastive = loss;
        stats->aux = aux / N;
        stats->loss = loss + aux / N;
        stats->acc_i2t = acc[0], stats->acc_t2i = acc[1];
        stats->temperature = exp(m->params[m->L.logit_scale]);
    }
    return VLMOE_OK;
}
