// layer.c: the MoE feed-forward layer (MOE.md; V-MoE/LIMoE tokens choice with capacity and
// BPR, experts choice, Soft MoE). Tokens choice / experts choice: router logits x.Wr^T, optional
// training noise, softmax gates, a routing decision per group (src/moe/route.c), then the tokens
// of each expert gathered into one contiguous buffer (all groups), one matrix product per expert
// and layer, and a weighted scatter back; dropped tokens and empty slots cost nothing. Soft MoE
// runs src/moe/soft.c per group. Backward flows through the combine weights into the gates and
// router, plus the auxiliary losses (src/moe/aux.c). Compiled as float and double; covered by
// tests/test_moe_layer.c (finite differences, upcycling identity) and tests/test_parity.c.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "moe/aux.h"
#include "moe/layer.h"
#include "moe/soft.h"
#include "nn/model.h"
#include "ops/ops.h"

struct R(moe_state) {
    moe_spec sp;
    int E, K, nmax, gmax, rows_max;
    // tokens/experts choice
    real *logits, *noisy, *gates, *probs, *dgates, *dlogits, *zsum; // (nmax, E); zsum (nmax)
    float *gates_f;                 // (S, E) the routing decision's input
    vlmoe_routing *rt;              // (gmax)
    int32_t *row_token, *row_expert, *expert_off, *cnt; // (rows_max), (rows_max), (E+1), (E)
    int32_t *tok_off, *tok_rows;    // (nmax+1), (rows_max): each token's packed rows, in row order
    real *combine, *dcombine;       // (rows_max)
    real *xp, *h, *y;               // packed input, fc1 output, expert output (rows_max rows)
    real *dy, *dxp, *da, *dh;       // scratch (da also holds forward's activation), maybe shared
    int own_dy, own_da;             // whether dy/dxp and da/dh are this layer's own allocations
    real *aux_scratch;
    // Soft MoE
    real *soft_acts, *soft_scratch, *soft_out; // per group
    size_t soft_acts_n;
    // the last forward
    int n, S, G, C, rows, training, noisy_on;
    const uint8_t *modality;
    double *routed[2], *accepted[2], *pbar[2]; // statistics, (E) each
    int32_t *hits;                  // (nmax) accepted assignments per token
};

static int group_size(const moe_spec *sp, int n) {
    return sp->cfg->group_size > 0 ? sp->cfg->group_size : n;
}

int R(moe_state_create)(struct R(moe_state) **out, const moe_spec *sp, int nmax) {
    *out = NULL;
    struct R(moe_state) *st = vlmoe_calloc(sizeof(*st), "moe layer");
    if (!st) return VLMOE_ERR_NOMEM;
    const vlmoe_moe_config *c = sp->cfg;
    const int E = c->num_experts, D = sp->D, M = sp->M;
    const int K = c->router == VLMOE_ROUTER_TOKENS ? c->top_k : 1;
    const int Smax = group_size(sp, nmax) < nmax ? group_size(sp, nmax) : nmax;
    st->sp = *sp;
    st->E = E;
    st->K = K;
    st->nmax = nmax;
    st->gmax = (nmax + Smax - 1) / Smax;
    int ok = 1;
#define ALLOC(p, n) ok = ok && ((p) = vlmoe_calloc(sizeof(*(p)) * (size_t)(n) + 1, #p)) != NULL
    for (int m = 0; m < 2; m++) {
        ALLOC(st->routed[m], E);
        ALLOC(st->accepted[m], E);
        ALLOC(st->pbar[m], E);
    }
    ALLOC(st->hits, nmax);
    if (c->router == VLMOE_ROUTER_SOFT) {
        soft_dims d = {Smax, D, E, moe_slots_per_expert(c), M, sp->act};
        st->soft_acts_n = soft_moe_acts_floats(&d);
        ALLOC(st->soft_acts, st->soft_acts_n * (size_t)st->gmax);
        ALLOC(st->soft_scratch, soft_moe_scratch_floats(&d));
        ALLOC(st->soft_out, (size_t)Smax * D);
    } else {
        double cf = c->capacity_factor > c->eval_capacity_factor ? c->capacity_factor : c->eval_capacity_factor;
        int C = 1;
        if (vlmoe_capacity(Smax, E, K, cf, c->capacity_multiple > 0 ? c->capacity_multiple : 1, &C)) C = 1;
        if (C > Smax) C = Smax; // an expert never holds more than every token of its group
        // every accepted assignment is one packed row: at most C per expert and group, and with
        // tokens choice also at most K per token (experts choice may pick a token E times)
        long rows = (long)nmax * K, cap = (long)st->gmax * E * C;
        st->rows_max = (int)(c->router == VLMOE_ROUTER_TOKENS && rows < cap ? rows : cap);
        const size_t ne = (size_t)nmax * E, rm = (size_t)st->rows_max;
        ALLOC(st->logits, ne);
        ALLOC(st->noisy, ne);
        ALLOC(st->gates, ne);
        ALLOC(st->probs, ne);
        ALLOC(st->dgates, ne);
        ALLOC(st->dlogits, ne);
        ALLOC(st->zsum, nmax);
        ALLOC(st->gates_f, (size_t)Smax * E);
        ALLOC(st->rt, st->gmax);
        for (int g = 0; ok && g < st->gmax; g++) ok = !vlmoe_routing_alloc(&st->rt[g], Smax, E, K, C);
        ALLOC(st->row_token, rm);
        ALLOC(st->row_expert, rm);
        ALLOC(st->expert_off, E + 1);
        ALLOC(st->cnt, E);
        ALLOC(st->combine, rm);
        ALLOC(st->dcombine, rm);
        ALLOC(st->tok_off, (size_t)nmax + 1);
        ALLOC(st->tok_rows, rm);
        ALLOC(st->xp, rm * D);
        ALLOC(st->y, rm * D);
        ALLOC(st->h, rm * M);
        ALLOC(st->dxp, rm * D);
        ALLOC(st->dy, rm * D);
        ALLOC(st->dh, rm * M);
        ALLOC(st->da, rm * M);
        st->own_dy = st->own_da = 1;
        ALLOC(st->aux_scratch, aux_scratch_floats(Smax, E));
    }
#undef ALLOC
    if (!ok) {
        R(moe_state_free)(st);
        return VLMOE_ERR_NOMEM;
    }
    *out = st;
    return VLMOE_OK;
}

void R(moe_state_free)(struct R(moe_state) *st) {
    if (!st) return;
    if (st->rt)
        for (int g = 0; g < st->gmax; g++) vlmoe_routing_free(&st->rt[g]);
    if (st->own_dy) vlmoe_free_mem(st->dy), vlmoe_free_mem(st->dxp);
    if (st->own_da) vlmoe_free_mem(st->da), vlmoe_free_mem(st->dh);
    void *all[] = {st->logits, st->noisy, st->gates, st->probs, st->dgates, st->dlogits, st->zsum,
                   st->gates_f, st->rt, st->row_token, st->row_expert, st->expert_off, st->cnt,
                   st->tok_off, st->tok_rows, st->combine, st->dcombine, st->xp, st->h, st->y,
                   st->aux_scratch, st->soft_acts, st->soft_scratch, st->soft_out,
                   st->routed[0], st->routed[1], st->accepted[0], st->accepted[1], st->pbar[0],
                   st->pbar[1], st->hits};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) vlmoe_free_mem(all[i]);
    vlmoe_free_mem(st);
}

void R(moe_share_scratch)(struct R(moe_state) **states, int n, real *da, real *dh, size_t floats) {
    struct R(moe_state) *owner = NULL;
    for (int i = 0; i < n; i++) {
        struct R(moe_state) *st = states[i];
        if (!st || !st->own_dy) continue; // Soft MoE layers have none
        if (da && (size_t)st->rows_max * st->sp.M <= floats) {
            vlmoe_free_mem(st->da), vlmoe_free_mem(st->dh);
            st->da = da, st->dh = dh, st->own_da = 0;
        }
        if (!owner) {
            owner = st;
        } else if (st->rows_max == owner->rows_max && st->sp.D == owner->sp.D) {
            vlmoe_free_mem(st->dy), vlmoe_free_mem(st->dxp);
            st->dy = owner->dy, st->dxp = owner->dxp, st->own_dy = 0;
        }
    }
}

// Routing statistics of the last forward (tokens/experts choice), per modality.
static void fill_stats(struct R(moe_state) *st, vlmoe_moe_stats *s) {
    const int E = st->E, K = st->K, tc = st->sp.cfg->router == VLMOE_ROUTER_TOKENS;
    double assign[2] = {0, 0}, drop[2] = {0, 0}, ok[2] = {0, 0}, maxg[2] = {0, 0}, hpre[2] = {0, 0};
    for (int m = 0; m < 2; m++) {
        memset(st->routed[m], 0, sizeof(double) * E);
        memset(st->accepted[m], 0, sizeof(double) * E);
        memset(st->pbar[m], 0, sizeof(double) * E);
        s->tokens[m] = 0;
    }
    memset(st->hits, 0, sizeof(int32_t) * (size_t)st->n);
    for (int r = 0; r < st->rows; r++) st->hits[st->row_token[r]]++;
    for (int g = 0; g < st->G; g++) {
        const vlmoe_routing *rt = &st->rt[g];
        for (int i = 0; i < st->S; i++) {
            const int t = g * st->S + i, m = st->modality ? st->modality[t] : 0;
            const real *p = st->probs + (size_t)t * E, *q = st->gates + (size_t)t * E;
            double mx = 0, h = 0;
            for (int e = 0; e < E; e++) {
                mx = q[e] > mx ? q[e] : mx;
                if (p[e] > 0) h -= p[e] * log((double)p[e]);
                st->pbar[m][e] += p[e];
            }
            s->tokens[m]++;
            maxg[m] += mx;
            hpre[m] += h;
            ok[m] += st->hits[t] > 0;
            for (int k = 0; tc && k < K; k++) { // before capacity: every choice of every token
                st->routed[m][rt->expert[i * K + k]] += 1;
                assign[m] += 1;
                drop[m] += rt->slot[i * K + k] < 0;
            }
        }
    }
    for (int r = 0; r < st->rows; r++) {
        const int t = st->row_token[r], m = st->modality ? st->modality[t] : 0;
        st->accepted[m][st->row_expert[r]] += 1;
        if (!tc) st->routed[m][st->row_expert[r]] += 1, assign[m] += 1;
    }
    for (int m = 0; m < 2; m++) {
        const double T = s->tokens[m] ? s->tokens[m] : 1;
        double acc = 0, ra = 0;
        for (int e = 0; e < E; e++) acc += st->accepted[m][e], ra += st->routed[m][e];
        // entropies of the accepted-assignment spread and of the mean gate (pbar)
        double hpost = 0, hbar = 0;
        for (int e = 0; e < E; e++) {
            double q = acc > 0 ? st->accepted[m][e] / acc : 0, pb = st->pbar[m][e] / T;
            if (q > 0) hpost -= q * log(q);
            if (pb > 0) hbar -= pb * log(pb);
            st->routed[m][e] = ra > 0 ? st->routed[m][e] / ra : 0;
            st->accepted[m][e] /= T;
        }
        s->entropy_post[m] = hpost;
        s->experts_used[m] = s->tokens[m] ? exp(hbar) : 0;
        s->success[m] = ok[m] / T;
        s->dropped[m] = assign[m] > 0 ? drop[m] / assign[m] : 0;
        s->mean_max_gate[m] = maxg[m] / T;
        s->entropy_pre[m] = hpre[m] / T;
        s->routed[m] = st->routed[m];
        s->accepted[m] = st->accepted[m];
    }
}

static void soft_dims_of(const struct R(moe_state) *st, soft_dims *d) {
    const vlmoe_moe_config *c = st->sp.cfg;
    *d = (soft_dims){st->S, st->sp.D, c->num_experts, moe_slots_per_expert(c), st->sp.M, st->sp.act};
}

static int soft_forward(struct R(moe_state) *st, const real *P, const real *x, real *out,
                        vlmoe_moe_stats *s) {
    const moe_spec *sp = &st->sp;
    const int D = sp->D;
    soft_dims d;
    soft_dims_of(st, &d);
    s->soft_minmax[0] = s->soft_minmax[2] = INFINITY;
    s->soft_minmax[1] = s->soft_minmax[3] = -INFINITY;
    for (int g = 0; g < st->G; g++) {
        real *acts = st->soft_acts + st->soft_acts_n * (size_t)g;
        const R(soft_params) sp2 = {P + sp->phi, P + sp->scale, P + sp->w1, P + sp->b1, P + sp->w2, P + sp->b2};
        R(soft_moe_forward)(st->soft_out, acts, x + (size_t)g * st->S * D, &sp2, &d);
        real *o = out + (size_t)g * st->S * D;
        for (size_t i = 0; i < (size_t)st->S * D; i++) o[i] += st->soft_out[i];
        double mm[4];
        R(soft_moe_stats)(acts, &d, mm);
        s->soft_minmax[0] = fmin(s->soft_minmax[0], mm[0]);
        s->soft_minmax[1] = fmax(s->soft_minmax[1], mm[1]);
        s->soft_minmax[2] = fmin(s->soft_minmax[2], mm[2]);
        s->soft_minmax[3] = fmax(s->soft_minmax[3], mm[3]);
    }
    for (int m = 0; m < 2; m++) s->tokens[m] = 0;
    for (int t = 0; t < st->n; t++) s->tokens[st->modality ? st->modality[t] : 0]++;
    for (int m = 0; m < 2; m++) s->success[m] = s->tokens[m] ? 1 : 0; // Soft MoE drops nothing
    return VLMOE_OK;
}

int R(moe_forward)(struct R(moe_state) *st, const moe_call *c, const real *P, const real *x,
                   real *out, double *aux, vlmoe_moe_stats *s) {
    const moe_spec *sp = &st->sp;
    const vlmoe_moe_config *cfg = sp->cfg;
    const int E = st->E, K = st->K, D = sp->D, M = sp->M, n = c->n;
    int stt = moe_check_groups(sp, n, c->training);
    if (stt) return stt;
    st->n = n;
    st->S = group_size(sp, n) < n ? group_size(sp, n) : n;
    st->G = n / st->S;
    st->training = c->training;
    st->modality = c->modality;
    *aux = 0;
    memset(s->aux, 0, sizeof(s->aux));
    s->num_experts = E;
    if (cfg->router == VLMOE_ROUTER_SOFT) return soft_forward(st, P, x, out, s);

    // router logits, training noise, gates
    R(linear_forward)(st->logits, x, P + sp->router_w, NULL, n, D, E, 0);
    R(softmax_forward)(st->probs, st->logits, n, E);
    st->noisy_on = c->training && cfg->noise_std > 0;
    if (st->noisy_on) {
        vlmoe_rng r;
        vlmoe_rng_seed(&r, c->seed);
        const double sigma = cfg->noise_std / E; // MOE.md: l + (noise_std/E) N(0,1)
        for (size_t i = 0; i < (size_t)n * E; i++)
            st->noisy[i] = st->logits[i] + (real)(c->noise ? c->noise[i] : sigma * vlmoe_rng_normal(&r));
        R(softmax_forward)(st->gates, st->noisy, n, E);
    } else {
        memcpy(st->gates, st->probs, sizeof(real) * (size_t)n * E);
    }
    // the routing decision of each group
    const double cf = c->training ? cfg->capacity_factor : cfg->eval_capacity_factor;
    int C;
    if ((stt = vlmoe_capacity(st->S, E, K, cf, cfg->capacity_multiple > 0 ? cfg->capacity_multiple : 1, &C))) return stt;
    if (C > st->S) C = st->S;
    st->C = C;
    vlmoe_route_params rp = {K, C, cfg->order, cfg->bpr_score, cfg->gate_renorm, c->seed ^ 0x5bd1e995ULL};
    for (int g = 0; g < st->G; g++) {
        for (size_t i = 0; i < (size_t)st->S * E; i++) st->gates_f[i] = (float)st->gates[(size_t)g * st->S * E + i];
        // router_pred pruning: a pruned expert is never among the top K (every gate is >= 0);
        // the kept experts' gates stay those of the softmax over all experts
        if (sp->pruned)
            for (size_t i = 0; i < (size_t)st->S * E; i++)
                if (sp->pruned >> (i % E) & 1) st->gates_f[i] = -1;
        rp.seed = c->seed + 0x9e3779b97f4a7c15ULL * (uint64_t)(g + 1);
        // the arrays were sized for the largest group and capacity (create); this pass's
        // decision describes its own S and C
        st->rt[g].S = st->S;
        st->rt[g].C = C;
        stt = cfg->router == VLMOE_ROUTER_TOKENS
                  ? vlmoe_route_tokens_choice(st->gates_f, st->S, E, &rp, &st->rt[g])
                  : vlmoe_route_experts_choice(st->gates_f, st->S, E, C, &st->rt[g]);
        if (stt) return stt;
    }
    // renormalisation constants (after_routing): the sum of each token's accepted gates
    if (cfg->router == VLMOE_ROUTER_TOKENS && cfg->gate_renorm == VLMOE_RENORM_AFTER_ROUTING)
        for (int g = 0; g < st->G; g++)
            for (int i = 0; i < st->S; i++) {
                const int t = g * st->S + i;
                real z = 0;
                for (int k = 0; k < K; k++)
                    if (st->rt[g].slot[i * K + k] >= 0) z += st->gates[(size_t)t * E + st->rt[g].expert[i * K + k]];
                st->zsum[t] = z;
            }
    // pack: rows ordered by expert, then group, then slot
    memset(st->cnt, 0, sizeof(int32_t) * E);
    for (int g = 0; g < st->G; g++)
        for (int e = 0; e < E; e++) st->cnt[e] += st->rt[g].count[e];
    st->expert_off[0] = 0;
    for (int e = 0; e < E; e++) st->expert_off[e + 1] = st->expert_off[e] + st->cnt[e];
    st->rows = st->expert_off[E];
    const int renorm = cfg->router == VLMOE_ROUTER_TOKENS && cfg->gate_renorm == VLMOE_RENORM_AFTER_ROUTING;
    for (int e = 0; e < E; e++) {
        int r = st->expert_off[e];
        for (int g = 0; g < st->G; g++)
            for (int k = 0; k < st->rt[g].count[e]; k++, r++) {
                const int t = g * st->S + st->rt[g].token[e * st->rt[g].C + k];
                st->row_token[r] = t;
                st->row_expert[r] = e;
                real gate = st->gates[(size_t)t * E + e];
                st->combine[r] = renorm ? gate / st->zsum[t] : gate;
            }
    }
    // each token's rows in row order: the combine and its backward sum a token's rows in a
    // fixed order with one thread per token
    memset(st->tok_off, 0, sizeof(int32_t) * ((size_t)n + 1));
    for (int r = 0; r < st->rows; r++) st->tok_off[st->row_token[r] + 1]++;
    for (int t = 0; t < n; t++) st->tok_off[t + 1] += st->tok_off[t];
    for (int r = 0; r < st->rows; r++) st->tok_rows[st->tok_off[st->row_token[r]]++] = r;
    for (int t = n; t > 0; t--) st->tok_off[t] = st->tok_off[t - 1];
    st->tok_off[0] = 0;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < st->rows; r++)
        memcpy(st->xp + (size_t)r * D, x + (size_t)st->row_token[r] * D, sizeof(real) * D);
    // one matrix product per expert over all of its tokens; the activation goes to scratch
    // (backward recomputes it from h)
    for (int e = 0; e < E; e++) {
        const int o = st->expert_off[e], k = st->cnt[e];
        if (!k) continue;
        R(linear_forward)(st->h + (size_t)o * M, st->xp + (size_t)o * D, P + sp->w1 + (size_t)e * M * D,
                          P + sp->b1 + (size_t)e * M, k, D, M, 0);
        R(act_forward)(st->da + (size_t)o * M, st->h + (size_t)o * M, (size_t)k * M, sp->act);
        R(linear_forward)(st->y + (size_t)o * D, st->da + (size_t)o * M, P + sp->w2 + (size_t)e * D * M,
                          P + sp->b2 + (size_t)e * D, k, M, D, 0);
    }
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n; t++) {
        real *o = out + (size_t)t * D;
        for (int j = st->tok_off[t]; j < st->tok_off[t + 1]; j++) {
            const int r = st->tok_rows[j];
            const real w = st->combine[r], *y = st->y + (size_t)r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) o[d] += w * y[d];
        }
    }
    // auxiliary losses (tokens choice only: experts choice needs none, MOE.md)
    if (cfg->router == VLMOE_ROUTER_TOKENS)
        for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
            if (cfg->aux_weight[k] == 0) continue;
            double v = 0;
            for (int g = 0; g < st->G; g++) {
                R(aux_input) in = {st->S, E, K, st->logits + (size_t)g * st->S * E,
                                   st->noisy_on ? st->noisy + (size_t)g * st->S * E : NULL, cfg->noise_std,
                                   c->modality ? c->modality + (size_t)g * st->S : NULL, st->rt[g].wanted,
                                   {cfg->global_tau[0], cfg->global_tau[1]}};
                v += R(aux_loss)((vlmoe_aux_kind)k, &in, 1.0, NULL, st->aux_scratch);
            }
            s->aux[k] = v / st->G;
            *aux += cfg->aux_weight[k] * s->aux[k];
        }
    fill_stats(st, s);
    return VLMOE_OK;
}

void R(moe_backward)(struct R(moe_state) *st, const real *P, real *G, const real *x, const real *dout,
                     real *dx, double daux) {
    const moe_spec *sp = &st->sp;
    const vlmoe_moe_config *cfg = sp->cfg;
    const int E = st->E, K = st->K, D = sp->D, M = sp->M, n = st->n;
    if (cfg->router == VLMOE_ROUTER_SOFT) {
        soft_dims d;
        soft_dims_of(st, &d);
        const R(soft_params) p2 = {P + sp->phi, P + sp->scale, P + sp->w1, P + sp->b1, P + sp->w2, P + sp->b2};
        const R(soft_grads) g2 = {G + sp->phi, G + sp->scale, G + sp->w1, G + sp->b1, G + sp->w2, G + sp->b2};
        for (int g = 0; g < st->G; g++) {
            const size_t o = (size_t)g * st->S * D;
            R(soft_moe_backward)(dx + o, &g2, dout + o, st->soft_acts + st->soft_acts_n * (size_t)g, x + o, &p2,
                                 &d, st->soft_scratch);
        }
        return;
    }
    // through the combine: d(expert output) and d(combine weight) of every packed row
#pragma omp parallel for schedule(static)
    for (int r = 0; r < st->rows; r++) {
        const real *g = dout + (size_t)st->row_token[r] * D, *y = st->y + (size_t)r * D;
        real *dy = st->dy + (size_t)r * D, dot = 0;
        for (int d = 0; d < D; d++) {
            dy[d] = st->combine[r] * g[d];
            dot += g[d] * y[d];
        }
        st->dcombine[r] = dot;
    }
    const size_t rm = (size_t)st->rows;
    memset(st->da, 0, sizeof(real) * rm * M);
    memset(st->dxp, 0, sizeof(real) * rm * D);
    for (int e = 0; e < E; e++) {
        const int o = st->expert_off[e], k = st->cnt[e];
        if (!k) continue;
        real *h = st->h + (size_t)o * M, *da = st->da + (size_t)o * M, *dh = st->dh + (size_t)o * M;
        R(act_forward)(dh, h, (size_t)k * M, sp->act); // the activation again, in dh's space
        R(linear_backward)(da, G + sp->w2 + (size_t)e * D * M, G + sp->b2 + (size_t)e * D,
                           st->dy + (size_t)o * D, dh, P + sp->w2 + (size_t)e * D * M, k, M, D);
        memset(dh, 0, sizeof(real) * (size_t)k * M);
        R(act_backward)(dh, h, da, (size_t)k * M, sp->act);
        R(linear_backward)(st->dxp + (size_t)o * D, G + sp->w1 + (size_t)e * M * D, G + sp->b1 + (size_t)e * M,
                           dh, st->xp + (size_t)o * D, P + sp->w1 + (size_t)e * M * D, k, D, M);
    }
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n; t++) {
        real *o = dx + (size_t)t * D;
        for (int j = st->tok_off[t]; j < st->tok_off[t + 1]; j++) {
            const real *g = st->dxp + (size_t)st->tok_rows[j] * D;
#pragma omp simd
            for (int d = 0; d < D; d++) o[d] += g[d];
        }
    }
    // into the gates
    memset(st->dgates, 0, sizeof(real) * (size_t)n * E);
    const int renorm = cfg->router == VLMOE_ROUTER_TOKENS && cfg->gate_renorm == VLMOE_RENORM_AFTER_ROUTING;
    for (int r = 0; r < st->rows; r++) {
        const int t = st->row_token[r], e = st->row_expert[r];
        if (!renorm) {
            st->dgates[(size_t)t * E + e] += st->dcombine[r];
            continue;
        }
        // combine = g_e / Z with Z the sum of the token's accepted gates
        const int g = t / st->S, i = t % st->S;
        const real z = st->zsum[t], ge = st->gates[(size_t)t * E + e];
        for (int k = 0; k < K; k++) {
            if (st->rt[g].slot[i * K + k] < 0) continue;
            const int e2 = st->rt[g].expert[i * K + k];
            st->dgates[(size_t)t * E + e2] += st->dcombine[r] * ((e2 == e ? 1 / z : 0) - ge / (z * z));
        }
    }
    // gates = softmax(noisy or clean logits); the noise is an additive constant
    memset(st->dlogits, 0, sizeof(real) * (size_t)n * E);
    R(softmax_backward)(st->dlogits, st->gates, st->dgates, n, E);
    if (cfg->router == VLMOE_ROUTER_TOKENS)
        for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
            if (cfg->aux_weight[k] == 0) continue;
            for (int g = 0; g < st->G; g++) {
                R(aux_input) in = {st->S, E, K, st->logits + (size_t)g * st->S * E,
                                   st->noisy_on ? st->noisy + (size_t)g * st->S * E : NULL, cfg->noise_std,
                                   st->modality ? st->modality + (size_t)g * st->S : NULL, st->rt[g].wanted,
                                   {cfg->global_tau[0], cfg->global_tau[1]}};
                R(aux_loss)((vlmoe_aux_kind)k, &in, daux * cfg->aux_weight[k] / st->G,
                            st->dlogits + (size_t)g * st->S * E, st->aux_scratch);
            }
        }
    R(linear_backward)(dx, G + sp->router_w, NULL, st->dlogits, x, P + sp->router_w, n, D, E);
}
