// layer.c: the MoE feed-forward layer (MOE.md; V-MoE/LIMoE tokens choice with capacity and
// BPR, experts choice, Soft MoE). Tokens choice / experts choice: router logits x.Wr^T, optional
// training noise, softmax gates, a routing decision per group (src/moe/route.c), then the tokens
// of each expert gathered into one contiguous buffer (all groups), one matrix product per expert
// and layer, and a weighted scatter back; dropped tokens and empty slots cost nothing. Soft MoE
// runs src/moe/soft.c per group. Backward flows through the combine weights into the gates and
// router, plus the auxiliary losses (src/moe/aux.c). LIMoE appendix E.3: a router per modality
// and disjoint expert pools (router_forward, moe_aux_pools). Compiled as float and double;
// covered by tests/test_moe_layer.c (finite differences, upcycling identity),
// tests/test_moe_e3.c and tests/test_parity.c.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "dist/dist.h"
#include "moe/aux.h"
#include "moe/layer.h"
#include "moe/route_op.h"
#include "moe/soft.h"
#include "nn/model.h"
#include "ops/ops.h"

struct R(moe_state) {
    moe_spec sp;
    const R(vlmoe_backend) *be;
    int E, K, nmax, gmax, rows_max;
    int cmax;                       // the largest capacity per expert and group (train or eval)
    // device: router and dispatch (tokens/experts choice)
    real *logits, *noisy, *gates, *probs, *dgates, *dlogits, *zsum; // (nmax, E); zsum (nmax)
    real *combine, *dcombine;       // (rows_max)
    real *xp, *h, *y;               // packed input, fc1 output, expert output (rows_max rows)
    real *dy, *dxp, *da, *dh;       // scratch (da also holds forward's activation), maybe shared
    int own_dy, own_da;             // whether dy/dxp and da/dh are this layer's own allocations
    int own_acts;                   // whether xp/h/y are (moe_share_acts)
    real *aux_scratch;
    int32_t *d_rows;                // row_token, row_expert, tok_off, tok_rows on the device
    uint64_t *d_keys;               // (nmax) noise keys on the device
    be_dispatch dd;                 // the dispatch over the device arrays
    // host: the routing decision and what it is made from
    real *gates_h, *probs_h;        // (nmax, E) downloaded gates and clean probabilities
    float *gates_f;                 // (S, E) the routing decision's input
    vlmoe_routing *rt;              // (gmax)
    int32_t *row_token, *row_expert, *expert_off, *cnt; // (rows_max), (rows_max), (E+1), (E)
    int32_t *tok_off, *tok_rows;    // (nmax+1), (rows_max): each token's packed rows, in row order
    uint64_t *keys;                 // (nmax) the call's noise keys (row indices when it gives none)
    int have_keys;                  // whether the last call gave keys (sample, modality, position)
    // routing groups of whole examples (moe_call.examples, src/moe/groups.c): position p of the
    // group-major order reads row order[p]; routing, aux losses and statistics follow positions,
    // the dispatch and combine read and write rows
    int ordered;                    // 0: the order is the identity and none of this is used
    int32_t *order, *inv;           // (nmax) position -> row, row -> position
    uint8_t *mod_pos;               // (nmax) modality by position
    int32_t *d_perm;                // device: order (nmax), inv (nmax), 0..nmax (nmax+1)
    be_dispatch perm;               // position-ordered rows back onto tokens: token t <- row inv[t]
    real *lg, *ng, *dlg;            // (nmax, E) logits, noisy logits, their gradient by position
    real *xg, *yg, *dxg;            // Soft MoE (nmax, D): x, out (then dout) and dx by position
    // Soft MoE
    real *soft_acts, *soft_scratch, *soft_out; // per group
    size_t soft_acts_n;
    real *soft_w_h;                 // host: one group's dispatch and combine weights, for the stats
                                    // when the table's memory is not the host's
    // the last forward
    int n, S, G, C, rows, training, noisy_on;
    const uint8_t *modality;
    double *routed[2], *accepted[2], *pbar[2]; // statistics, (E) each
    int32_t *hits;                  // (nmax) accepted assignments per token
    int32_t *wanted_mod;            // (2,E) one group's assignments before capacity, per modality
    // device copies of what the auxiliary losses read besides the logits, when the table's memory
    // is not the host's: the modality by position (nmax), each group's wanted (E) and wanted_mod
    // (2,E) in a slot of its own (gmax * 3E)
    uint8_t *d_mod;
    int32_t *d_want;
    struct moe_ep *ep;              // expert parallelism (moe_set_expert_parallel), or NULL
    // LIMoE E.3 (router_per_modality, text_experts): the pass's runs of consecutive rows of one
    // modality, each through its modality's router and, with pools, a bias of -inf outside its
    // pool, so the softmax is the pool's and the other experts get gate 0 and gradient 0
    int nruns;
    int32_t *run_at;                // (nmax+1) first row of each run, then n
    uint8_t *run_mod;               // (nmax) the run's modality
    real *d_mask;                   // device (2,E): 0 in the modality's pool, -inf outside
    // the auxiliary losses of each modality over its own pool: the pool's logits of each
    // (group, modality) block packed into a (S_gm, E_m) matrix (in lg / ng / dlg), moved in
    // slices of pool_w = gcd(E, text_experts) logits by the table's gather_rows
    int pool_w, pool_rows;          // slice width, slices this pass
    int32_t *pool_idx, *pool_off, *pool_inv; // host: slice r of the packed matrices reads logit
                                    // slice pool_idx[r]; logit slice t's packed slices (0 or 1) are
                                    // pool_inv[pool_off[t] .. pool_off[t+1])
    int32_t *d_pool;                // device copies of the three
    be_dispatch pool_dd;            // the packed slices back onto the logits (backward)
    uint8_t *pool_mod;              // (nmax) modality of each packed token
    int32_t *pool_blk;              // (2 gmax + 1) first packed token of each (group, modality)
    // routing on the table (be->route, BE_OP_ROUTE): the decision and the packed layout are made
    // where the gates are; the host downloads the experts' row offsets (E+1 ints: the expert
    // bank's off[] is host memory) and, only when the statistics or the decision are read, the
    // rest (moe_stats_sync)
    int use_route;
    // the fixed-capacity layout (be_route.fixed) in training, where the table wants it: expert e
    // owns rows [e G C, (e+1) G C), so the bank's offsets are known here and a training step's
    // layer downloads nothing; evaluation (a larger capacity, more padding) and expert
    // parallelism (its exchange counts rows on the host) keep the packed layout
    int fixed_ok, fixed;
    be_route_out ro;                // the op's outputs: d_rows' layout, d_dec, d_want
    int32_t *d_dec;                 // device: expert, slot, token, count, expert_off, weight, dropped
    void *d_route_work;             // be_route_work_bytes(Smax, E)
    vlmoe_moe_stats *stats_at;      // the record the last forward's statistics are owed to
    int stats_owed;                 // 1 until moe_stats_sync fills it (device tables only)
    int load_kept;                  // aux_scratch holds the last forward's load terms (one group)
    uint8_t *mod_row;               // (nmax) the last forward's modality by row (its own copy: the
                                    // statistics may be filled after the caller's array changed)

    moe_aux_sink *sink;             // a device step's auxiliary values (moe_set_aux_sink), or NULL
    int aux_err;                    // its record could not be had (out of memory)
};

// The experts tokens of modality m may be routed to: [*e0, *e0 + *ne). Disjoint pools give text
// the last text_experts and images the rest, the order of VLMOE_MOD_* and of the token buffer
// (images first); without pools both see all E.
static void pool_of(const vlmoe_moe_config *c, int m, int *e0, int *ne) {
    const int E = c->num_experts, T = c->text_experts;
    *e0 = T && m == VLMOE_MOD_TEXT ? E - T : 0;
    *ne = !T ? E : m == VLMOE_MOD_TEXT ? T : E - T;
}

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

static int group_size(const moe_spec *sp, int n) {
    return sp->cfg->group_size > 0 ? sp->cfg->group_size : n;
}

// The activation row at position p of the group-major order.
static inline int row_of(const struct R(moe_state) *st, int p) {
    return st->ordered ? st->order[p] : p;
}

// The host arrays a step uploads: the table's own host memory where its memory is not the
// host's (fixed, page-locked on CUDA), else the heap.
static void *up_alloc(const R(vlmoe_backend) *be, size_t bytes, const char *what) {
    return !be->host_memory && be->host_alloc ? be->host_alloc(be, bytes, what) : vlmoe_calloc(bytes, what);
}
static void up_free(const R(vlmoe_backend) *be, void *p) {
    if (!be->host_memory && be->host_alloc) {
        if (p) be->host_free(be, p);
    } else {
        vlmoe_free_mem(p);
    }
}

int R(moe_state_create)(struct R(moe_state) **out, const moe_spec *sp, const R(vlmoe_backend) *be,
                        int nmax) {
    *out = NULL;
    const vlmoe_moe_config *c = sp->cfg;
    // Soft MoE's App. A baselines and App. E's un-normalised variant: a backend says if it has them
    const int soft_variant = c->soft_mix != VLMOE_SOFT_MIX_SOFT || c->soft_raw;
    int stt = R(backend_require)(be, c->router == VLMOE_ROUTER_SOFT ? BE_OP_SOFT_MOE : BE_OP_EXPERTS,
                                 c->router == VLMOE_ROUTER_SOFT && soft_variant ? &soft_variant : NULL);
    if (!stt && c->router == VLMOE_ROUTER_TOKENS) stt = R(backend_require)(be, BE_OP_COMBINE, &c->order);
    if (stt) return stt;
    struct R(moe_state) *st = vlmoe_calloc(sizeof(*st), "moe layer");
    if (!st) return VLMOE_ERR_NOMEM;
    const int E = c->num_experts, D = sp->D, M = sp->M;
    const int K = c->router == VLMOE_ROUTER_TOKENS ? c->top_k : 1;
    const int Smax = group_size(sp, nmax) < nmax ? group_size(sp, nmax) : nmax;
    st->sp = *sp;
    st->be = be;
    st->E = E;
    st->K = K;
    st->nmax = nmax;
    st->gmax = (nmax + Smax - 1) / Smax;
    st->own_acts = 1;
    int ok = 1;
#define ALLOC(p, n) ok = ok && ((p) = vlmoe_calloc(sizeof(*(p)) * (size_t)(n) + 1, #p)) != NULL
#define DALLOC(p, n) ok = ok && ((p) = be->alloc(be, sizeof(*(p)) * (size_t)(n) + 1, #p)) != NULL
    // what the host writes and uploads every step (noise keys, modality, group permutation,
    // pools' slice plan): the table's host memory (backend.h host_alloc) at fixed addresses
#define HALLOC(p, n) ok = ok && ((p) = up_alloc(be, sizeof(*(p)) * (size_t)(n) + 1, #p)) != NULL
    for (int m = 0; m < 2; m++) {
        ALLOC(st->routed[m], E);
        ALLOC(st->accepted[m], E);
        ALLOC(st->pbar[m], E);
    }
    ALLOC(st->hits, nmax);
    ALLOC(st->wanted_mod, 2 * E);
    HALLOC(st->keys, nmax);
    HALLOC(st->order, nmax);
    HALLOC(st->inv, nmax);
    HALLOC(st->mod_pos, nmax);
    HALLOC(st->mod_row, nmax);
    DALLOC(st->d_perm, 3 * (size_t)nmax + 1);
    if (ok) { // the identity offsets of the permutation's dispatch: one row per token
        int32_t *h = vlmoe_alloc(sizeof(int32_t) * ((size_t)nmax + 1), "moe identity");
        ok = h != NULL;
        for (int i = 0; ok && i <= nmax; i++) h[i] = i;
        if (ok) be->upload_bytes(be, st->d_perm + 2 * (size_t)nmax, h, sizeof(int32_t) * ((size_t)nmax + 1));
        vlmoe_free_mem(h);
    }
    if (c->router == VLMOE_ROUTER_SOFT) {
        soft_dims d = {Smax, D, E, moe_slots_per_expert(c), M, sp->act, c->soft_mix, c->soft_raw};
        if ((stt = soft_dims_check(&d))) {
            R(moe_state_free)(st);
            return stt;
        }
        st->soft_acts_n = soft_moe_acts_floats(&d);
        DALLOC(st->soft_acts, st->soft_acts_n * (size_t)st->gmax);
        DALLOC(st->soft_scratch, soft_moe_scratch_floats(&d));
        DALLOC(st->soft_out, (size_t)Smax * D);
        if (!be->host_memory) ALLOC(st->soft_w_h, 2 * (size_t)Smax * d.E * d.P);
        DALLOC(st->xg, (size_t)nmax * D);
        DALLOC(st->yg, (size_t)nmax * D);
        DALLOC(st->dxg, (size_t)nmax * D);
    } else {
        // sized by the same function the forward uses (moe_capacity), for both factors: an error
        // here is the model's error, never a silent fallback to a smaller buffer
        int C = 1, Ce = 1;
        if ((stt = moe_capacity(c, Smax, 1, &C)) || (stt = moe_capacity(c, Smax, 0, &Ce))) {
            R(moe_state_free)(st);
            return stt;
        }
        const int Ct = C; // training's
        if (Ce > C) C = Ce;
        st->cmax = C;
        // the table routes unless it cannot with this configuration (random dispatch order on a
        // device: then the gates come to the host and route.c decides there, as it always did)
        const be_route rc = {.E = E, .K = K, .C = C, .experts_choice = c->router == VLMOE_ROUTER_EXPERTS,
                             .order = c->order, .bpr_score = c->bpr_score, .gate_renorm = c->gate_renorm};
        st->use_route = be->route && be->supports(be, BE_OP_ROUTE, &rc);
        be_route rf = rc;
        rf.C = Ct, rf.fixed = 1;
        st->fixed_ok = st->use_route && be->supports(be, BE_OP_ROUTE, &rf);
        // every accepted assignment is one packed row: at most C per expert and group, and with
        // tokens choice also at most K per token (experts choice may pick a token E times); the
        // fixed layout of a training pass has every slot, filled or not
        long rows = (long)nmax * K, cap = (long)st->gmax * E * C, fixed = (long)st->gmax * E * Ct;
        rows = c->router == VLMOE_ROUTER_TOKENS && rows < cap ? rows : cap;
        if (st->fixed_ok && fixed > rows) rows = fixed;
        if (rows > 0x7fffffffL) {
            R(moe_state_free)(st);
            return vlmoe_fail(VLMOE_ERR_CONFIG, "moe: %ld dispatch rows (%d groups x %d experts x capacity %d) are past "
                              "int32 row indices: lower capacity_factor or group_size", rows, st->gmax, E, C);
        }
        st->rows_max = (int)rows;
        const size_t ne = (size_t)nmax * E, rm = (size_t)st->rows_max;
        DALLOC(st->logits, ne);
        DALLOC(st->noisy, ne);
        DALLOC(st->gates, ne);
        DALLOC(st->probs, ne);
        DALLOC(st->dgates, ne);
        DALLOC(st->dlogits, ne);
        DALLOC(st->zsum, nmax);
        DALLOC(st->lg, ne);
        DALLOC(st->ng, ne);
        DALLOC(st->dlg, ne);
        DALLOC(st->combine, rm);
        DALLOC(st->dcombine, rm);
        DALLOC(st->xp, rm * D);
        DALLOC(st->y, rm * D);
        DALLOC(st->h, rm * M);
        DALLOC(st->dxp, rm * D);
        DALLOC(st->dy, rm * D);
        DALLOC(st->dh, rm * M);
        DALLOC(st->da, rm * M);
        st->own_dy = st->own_da = 1;
        DALLOC(st->aux_scratch, aux_scratch_floats(Smax, E));
        DALLOC(st->d_rows, 3 * rm + (size_t)nmax + 1);
        DALLOC(st->d_keys, nmax);
        if (!be->host_memory || st->use_route) DALLOC(st->d_want, (size_t)st->gmax * 3 * E);
        if (!be->host_memory) DALLOC(st->d_mod, nmax);
        if (st->use_route) {
            // int32: expert, slot (nmax K each), token (gmax E C), count (gmax E), expert_off (E+1);
            // then the float weights (gmax E C) and the dropped flags (nmax bytes)
            const size_t sk = (size_t)nmax * K, ec = (size_t)st->gmax * E * C;
            DALLOC(st->d_dec, 2 * sk + ec + (size_t)st->gmax * E + E + 1 + ec + (size_t)nmax / 4 + 1);
            ok = ok && (st->d_route_work = be->alloc(be, be_route_work_bytes(Smax, E), "route work")) != NULL;
            if (ok) {
                int32_t *d = st->d_dec;
                st->ro = (be_route_out){.expert = d, .slot = d + sk, .token = d + 2 * sk,
                                        .count = d + 2 * sk + ec, .expert_off = d + 2 * sk + ec + (size_t)st->gmax * E,
                                        .wanted = st->d_want, .row_token = st->d_rows, .row_expert = st->d_rows + rm,
                                        .tok_rows = st->d_rows + 2 * rm, .tok_off = st->d_rows + 3 * rm,
                                        .rows_max = st->rows_max, .work = st->d_route_work};
                st->ro.weight = (float *)(st->ro.expert_off + E + 1);
                st->ro.dropped = (uint8_t *)(st->ro.weight + ec);
            }
        }
        ALLOC(st->gates_h, ne);
        ALLOC(st->probs_h, ne);
        ALLOC(st->gates_f, (size_t)Smax * E);
        ALLOC(st->rt, st->gmax);
        for (int g = 0; ok && g < st->gmax; g++) ok = !vlmoe_routing_alloc(&st->rt[g], Smax, E, K, C);
        ALLOC(st->row_token, rm);
        ALLOC(st->row_expert, rm);
        ALLOC(st->expert_off, E + 1);
        ALLOC(st->cnt, E);
        ALLOC(st->tok_off, (size_t)nmax + 1);
        ALLOC(st->tok_rows, rm);
        if (c->router_per_modality || c->text_experts) {
            ALLOC(st->run_at, (size_t)nmax + 1);
            ALLOC(st->run_mod, nmax);
        }
        if (c->text_experts > 0 && c->text_experts < E) {
            st->pool_w = gcd(E, c->text_experts);
            const size_t pe = ne / (size_t)st->pool_w;
            DALLOC(st->d_mask, 2 * E);
            HALLOC(st->pool_idx, pe);
            HALLOC(st->pool_off, pe + 1);
            HALLOC(st->pool_inv, pe);
            DALLOC(st->d_pool, 3 * pe + 1);
            HALLOC(st->pool_mod, nmax);
            ALLOC(st->pool_blk, 2 * (size_t)st->gmax + 1);
            real *mask = ok ? vlmoe_alloc(sizeof(real) * 2 * (size_t)E, "moe pool mask") : NULL;
            ok = mask != NULL;
            for (int m = 0; ok && m < 2; m++) {
                int e0, nm;
                pool_of(c, m, &e0, &nm);
                for (int e = 0; e < E; e++) mask[m * E + e] = e >= e0 && e < e0 + nm ? 0 : -(real)INFINITY;
            }
            if (ok) be->upload(be, st->d_mask, mask, 2 * (size_t)E);
            vlmoe_free_mem(mask);
        }
    }
#undef ALLOC
#undef HALLOC
#undef DALLOC
    if (!ok) {
        R(moe_state_free)(st);
        return VLMOE_ERR_NOMEM;
    }
    *out = st;
    return VLMOE_OK;
}

static void ep_free(struct moe_ep *ep);

void R(moe_state_free)(struct R(moe_state) *st) {
    if (!st) return;
    const R(vlmoe_backend) *be = st->be;
    ep_free(st->ep);
    if (st->rt)
        for (int g = 0; g < st->gmax; g++) vlmoe_routing_free(&st->rt[g]);
    if (st->own_dy) be->free(be, st->dy), be->free(be, st->dxp);
    if (st->own_da) be->free(be, st->da), be->free(be, st->dh);
    if (st->own_acts) be->free(be, st->xp), be->free(be, st->h), be->free(be, st->y);
    void *dev[] = {st->logits, st->noisy, st->gates, st->probs, st->dgates, st->dlogits, st->zsum,
                   st->combine, st->dcombine, st->aux_scratch, st->d_rows,
                   st->d_keys, st->soft_acts, st->soft_scratch, st->soft_out, st->d_perm, st->lg,
                   st->ng, st->dlg, st->xg, st->yg, st->dxg, st->d_mod, st->d_want, st->d_mask,
                   st->d_pool, st->d_dec, st->d_route_work};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++) be->free(be, dev[i]);
    void *host[] = {st->gates_h, st->probs_h, st->gates_f, st->rt, st->row_token, st->row_expert,
                    st->expert_off, st->cnt, st->tok_off, st->tok_rows,
                    st->routed[0], st->routed[1], st->accepted[0], st->accepted[1], st->pbar[0],
                    st->pbar[1], st->hits, st->wanted_mod, st->soft_w_h,
                    st->run_at, st->run_mod, st->pool_blk};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) vlmoe_free_mem(host[i]);
    void *up[] = {st->keys, st->order, st->inv, st->mod_pos, st->mod_row, st->pool_idx, st->pool_off, st->pool_inv,
                  st->pool_mod};
    for (size_t i = 0; i < sizeof(up) / sizeof(up[0]); i++) up_free(be, up[i]);
    vlmoe_free_mem(st);
}

void R(moe_share_scratch)(struct R(moe_state) **states, int n, real *da, real *dh, size_t floats) {
    struct R(moe_state) *owner = NULL;
    for (int i = 0; i < n; i++) {
        struct R(moe_state) *st = states[i];
        if (!st || !st->own_dy) continue; // Soft MoE layers have none
        const R(vlmoe_backend) *be = st->be;
        if (da && (size_t)st->rows_max * st->sp.M <= floats) {
            be->free(be, st->da), be->free(be, st->dh);
            st->da = da, st->dh = dh, st->own_da = 0;
        }
        if (!owner) {
            owner = st;
        } else if (st->rows_max == owner->rows_max && st->sp.D == owner->sp.D) {
            be->free(be, st->dy), be->free(be, st->dxp);
            st->dy = owner->dy, st->dxp = owner->dxp, st->own_dy = 0;
        }
    }
}

void R(moe_share_acts)(struct R(moe_state) **states, int n) {
    struct R(moe_state) *owner = NULL;
    for (int i = 0; i < n; i++) {
        struct R(moe_state) *st = states[i];
        if (!st || !st->xp) continue; // Soft MoE keeps its activations per group elsewhere
        if (!owner) {
            owner = st;
        } else if (st->rows_max == owner->rows_max && st->sp.D == owner->sp.D && st->sp.M == owner->sp.M) {
            const R(vlmoe_backend) *be = st->be;
            be->free(be, st->xp), be->free(be, st->h), be->free(be, st->y);
            st->xp = owner->xp, st->h = owner->h, st->y = owner->y, st->own_acts = 0;
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
    for (int r = 0; r < st->rows; r++) // padding rows of the fixed layout (-1) hold no token
        if (st->row_token[r] >= 0) st->hits[st->row_token[r]]++;
    for (int g = 0; g < st->G; g++) {
        const vlmoe_routing *rt = &st->rt[g];
        for (int i = 0; i < st->S; i++) {
            const int t = row_of(st, g * st->S + i), m = st->modality ? st->modality[t] : 0;
            const real *p = st->probs_h + (size_t)t * E, *q = st->gates_h + (size_t)t * E;
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
        if (st->row_token[r] < 0) continue;
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
        s->entropy_pre[m] = s->tokens[m] ? hbar : 0; // the global H(mean p) LIMoE plots
        s->entropy_token[m] = hpre[m] / T;
        vlmoe_experts_cover(st->routed[m], E, s->experts_cover[m]);
        s->routed[m] = st->routed[m];
        s->accepted[m] = st->accepted[m];
    }
    s->capacity = st->C;
}

const double *R(moe_gate_sums)(const struct R(moe_state) *st, int modality) {
    return st->sp.cfg->router == VLMOE_ROUTER_SOFT ? NULL : st->pbar[modality ? 1 : 0];
}

static void soft_dims_of(const struct R(moe_state) *st, soft_dims *d) {
    const vlmoe_moe_config *c = st->sp.cfg;
    *d = (soft_dims){st->S, st->sp.D, c->num_experts, moe_slots_per_expert(c), st->sp.M, st->sp.act,
                     c->soft_mix, c->soft_raw};
}

static int soft_forward(struct R(moe_state) *st, const real *P, const real *x, real *out,
                        vlmoe_moe_stats *s) {
    const R(vlmoe_backend) *be = st->be;
    const moe_spec *sp = &st->sp;
    const int D = sp->D;
    soft_dims d;
    soft_dims_of(st, &d);
    int stt = soft_dims_check(&d); // this pass's group size (Identity needs S = E*P)
    if (stt) return stt;
    s->soft_minmax[0] = s->soft_minmax[2] = INFINITY;
    s->soft_minmax[1] = s->soft_minmax[3] = -INFINITY;
    s->soft_mean_max[0] = s->soft_mean_max[1] = 0;
    s->capacity = 0;
    // groups of whole examples: the rows in group order, and the outputs back onto their rows
    if (st->ordered) be->gather_rows(be, st->xg, x, st->perm.row_token, st->n, D);
    for (int g = 0; g < st->G; g++) {
        real *acts = st->soft_acts + st->soft_acts_n * (size_t)g;
        const size_t o = (size_t)g * st->S * D;
        const R(soft_params) sp2 = {P + sp->phi, P + sp->scale, P + sp->w1, P + sp->b1, P + sp->w2, P + sp->b2};
        if (st->ordered) {
            be->soft_moe_forward(be, st->yg + o, acts, st->xg + o, &sp2, &d);
        } else {
            be->soft_moe_forward(be, st->soft_out, acts, x + o, &sp2, &d);
            be->add(be, out + o, st->soft_out, (size_t)st->S * D);
        }
        double mm[4], mean_max[2];
        const real *w = acts + soft_moe_weights_at(&d); // the stats read the weights on the host
        if (st->soft_w_h) {
            be->download(be, st->soft_w_h, w, 2 * (size_t)d.S * d.E * d.P);
            w = st->soft_w_h;
        }
        R(soft_moe_stats)(w, &d, mm, mean_max);
        s->soft_mean_max[0] += mean_max[0] / st->G, s->soft_mean_max[1] += mean_max[1] / st->G;
        s->soft_minmax[0] = fmin(s->soft_minmax[0], mm[0]);
        s->soft_minmax[1] = fmax(s->soft_minmax[1], mm[1]);
        s->soft_minmax[2] = fmin(s->soft_minmax[2], mm[2]);
        s->soft_minmax[3] = fmax(s->soft_minmax[3], mm[3]);
    }
    if (st->ordered) be->gather_rows_backward(be, out, st->yg, &st->perm, D);
    for (int m = 0; m < 2; m++) s->tokens[m] = 0;
    for (int t = 0; t < st->n; t++) s->tokens[st->modality ? st->modality[t] : 0]++;
    for (int m = 0; m < 2; m++) s->success[m] = s->tokens[m] ? 1 : 0; // Soft MoE drops nothing
    return VLMOE_OK;
}
static int moe_ep_on(const struct R(moe_state) *st); // expert parallelism runs (below)

// ---- the phases of one forward: route (router on the device, the decision on the host),
// dispatch (tokens packed by expert), experts (one grouped call), combine.

// Where the router of the tokens of modality m starts in the parameters (LIMoE E.3).
static size_t router_at(const struct R(moe_state) *st, int m) {
    const moe_spec *sp = &st->sp;
    return sp->router_w + (sp->cfg->router_per_modality ? (size_t)m * st->E * sp->D : 0);
}

// logits (n,E) = x Wr^T: one product, or one per run of a modality's rows (LIMoE E.3), its
// pool's mask as the bias. In full precision even under --precision bf16: the decision rides on it.
static void router_forward(struct R(moe_state) *st, const real *P, const real *x) {
    const R(vlmoe_backend) *rbe = st->be->fp32 ? st->be->fp32 : st->be;
    const int E = st->E, D = st->sp.D;
    if (!st->run_at) {
        rbe->linear_forward(rbe, st->logits, x, P + st->sp.router_w, NULL, st->n, D, E, 0);
        return;
    }
    for (int i = 0; i < st->nruns; i++) {
        const int r0 = st->run_at[i], m = st->run_mod[i];
        rbe->linear_forward(rbe, st->logits + (size_t)r0 * E, x + (size_t)r0 * D, P + router_at(st, m),
                            st->d_mask ? st->d_mask + (size_t)m * E : NULL, st->run_at[i + 1] - r0, D, E, 0);
    }
}

// Backward of router_forward: dx and the router's gradient accumulate (the mask is a constant).
static void router_backward(struct R(moe_state) *st, const real *P, real *G, const real *x, real *dx, int write) {
    const R(vlmoe_backend) *rbe = st->be->fp32 ? st->be->fp32 : st->be;
    const int E = st->E, D = st->sp.D;
    for (int i = 0; i < (st->run_at ? st->nruns : 1); i++) {
        const int r0 = st->run_at ? st->run_at[i] : 0, m = st->run_at ? st->run_mod[i] : 0;
        const int len = st->run_at ? st->run_at[i + 1] - r0 : st->n;
        const size_t at = router_at(st, m); // the gradients have the parameters' layout
        (write ? rbe->linear_backward_write : rbe->linear_backward)(rbe, dx + (size_t)r0 * D, G + at, NULL,
                                                                    st->dlogits + (size_t)r0 * E,
                                                                    x + (size_t)r0 * D, P + at, len, D, E);
    }
}

// The runs of consecutive rows of one modality (router_per_modality, text_experts).
static int plan_runs(struct R(moe_state) *st, const uint8_t *modality) {
    if (!st->run_at) return VLMOE_OK;
    if (!modality && st->n > 0)
        return vlmoe_fail(VLMOE_ERR_ARG, "moe: router_per_modality / text_experts (LIMoE E.3) route by the "
                          "token's modality, and this pass gives none");
    st->nruns = 0;
    for (int t = 0; t < st->n; t++) {
        if (modality[t] > VLMOE_MOD_TEXT)
            return vlmoe_fail(VLMOE_ERR_ARG, "moe: token %d has modality %d, not image (0) or text (1)", t,
                              modality[t]);
        if (t == 0 || modality[t] != modality[t - 1]) {
            st->run_at[st->nruns] = t;
            st->run_mod[st->nruns++] = modality[t];
        }
    }
    st->run_at[st->nruns] = st->n;
    return VLMOE_OK;
}

// Disjoint pools: each (group, modality) block's pool logits packed for its auxiliary losses,
// and the inverse map their gradient takes back.
static void plan_pools(struct R(moe_state) *st) {
    const vlmoe_moe_config *cfg = st->sp.cfg;
    const R(vlmoe_backend) *be = st->be;
    const int E = st->E, w = st->pool_w;
    const size_t ns = (size_t)st->n * E / w, pe = (size_t)st->nmax * E / w;
    int tok = 0, r = 0;
    for (int g = 0; g < st->G; g++)
        for (int m = 0; m < 2; m++) {
            int e0, ne;
            pool_of(cfg, m, &e0, &ne);
            st->pool_blk[2 * g + m] = tok;
            for (int i = 0; i < st->S; i++) {
                const int t = row_of(st, g * st->S + i);
                if (st->modality[t] != m) continue;
                st->pool_mod[tok++] = (uint8_t)m;
                for (int j = 0; j < ne / w; j++) st->pool_idx[r++] = (int32_t)(((size_t)t * E + e0) / w + j);
            }
        }
    st->pool_blk[2 * st->G] = tok;
    st->pool_rows = r;
    memset(st->pool_off, 0, sizeof(int32_t) * (ns + 1));
    for (int k = 0; k < r; k++) st->pool_off[st->pool_idx[k] + 1] = 1;
    for (size_t t = 0; t < ns; t++) st->pool_off[t + 1] += st->pool_off[t];
    for (int k = 0; k < r; k++) st->pool_inv[st->pool_off[st->pool_idx[k]]] = k;
    int32_t *d = st->d_pool;
    be->upload_bytes(be, d, st->pool_idx, sizeof(int32_t) * (size_t)r);
    be->upload_bytes(be, d + pe, st->pool_off, sizeof(int32_t) * (ns + 1));
    be->upload_bytes(be, d + 2 * pe + 1, st->pool_inv, sizeof(int32_t) * (size_t)r);
    st->pool_dd = (be_dispatch){(int)ns, r, E, d, NULL, d + pe, d + 2 * pe + 1};
    be->gather_rows(be, st->lg, st->logits, d, r, w);
    if (st->noisy_on) be->gather_rows(be, st->ng, st->noisy, d, r, w);
}

// The decision of every group and the packed layout made by the table (be->route) where the gates
// are: only the experts' row offsets come to the host, for the expert bank.
// With the fixed layout the offsets are e G C: nothing comes to the host.
static int route_on_table(struct R(moe_state) *st, const moe_call *c, int C) {
    const R(vlmoe_backend) *be = st->be;
    const vlmoe_moe_config *cfg = st->sp.cfg;
    const int E = st->E, n = st->n;
    const uint8_t *mod = st->ordered ? st->mod_pos : st->modality;
    if (mod && st->d_mod) {
        be->upload_bytes(be, st->d_mod, mod, (size_t)n);
        mod = st->d_mod;
    }
    be_route r = {.n = n, .S = st->S, .G = st->G, .E = E, .K = st->K, .C = C,
                  .experts_choice = cfg->router != VLMOE_ROUTER_TOKENS, .order = cfg->order,
                  .bpr_score = cfg->bpr_score, .gate_renorm = cfg->gate_renorm, .seed = c->seed,
                  .pruned = st->sp.pruned, .pools = st->d_mask != NULL,
                  .pos_row = st->ordered ? st->perm.row_token : NULL, .mod = mod};
    for (int m = 0; r.pools && m < 2; m++) pool_of(cfg, m, &r.pool[m][0], &r.pool[m][1]);
    r.fixed = st->fixed;
    if (st->fixed && (long)st->G * E * C > st->rows_max) // create sized it for the largest pass
        return vlmoe_fail(VLMOE_ERR_ARG, "moe: %d groups x %d experts x capacity %d fixed-capacity rows exceed the "
                          "%d the layer was sized for", st->G, E, C, st->rows_max);
    int stt = be->route(be, st->gates, &r, &st->ro);
    if (stt) return stt;
    if (st->fixed) {
        for (int e = 0; e <= E; e++) st->expert_off[e] = e * st->G * C;
        for (int e = 0; e < E; e++) st->cnt[e] = st->G * C;
        st->rows = st->expert_off[E];
        return VLMOE_OK;
    }
    be->download_bytes(be, st->expert_off, st->ro.expert_off, sizeof(int32_t) * ((size_t)E + 1));
    for (int e = 0; e < E; e++) st->cnt[e] = st->expert_off[e + 1] - st->expert_off[e];
    st->rows = st->expert_off[E];
    if (st->rows < 0 || st->rows > st->rows_max) // a table's invariant: never trust a size blindly
        return vlmoe_fail(VLMOE_ERR_ARG, "moe: the %s table's routing gave %d packed rows, outside [0, %d]",
                          be->name, st->rows, st->rows_max);
    return VLMOE_OK;
}

// Everything the statistics and vlmoe_model_routing read on the host, from a table's routing:
// the gates, clean probabilities, each group's decision and the packed layout.
static void route_fetch(struct R(moe_state) *st) {
    const R(vlmoe_backend) *be = st->be;
    const int E = st->E, K = st->K, S = st->S, C = st->C, n = st->n;
    be->download(be, st->gates_h, st->gates, (size_t)n * E);
    be->download(be, st->probs_h, st->probs, (size_t)n * E);
    const be_route_out *o = &st->ro;
    for (int g = 0; g < st->G; g++) {
        vlmoe_routing *rt = &st->rt[g];
        rt->S = S, rt->C = C;
        const size_t sk = (size_t)S * K, ec = (size_t)E * C;
        be->download_bytes(be, rt->expert, o->expert + g * sk, sizeof(int32_t) * sk);
        be->download_bytes(be, rt->slot, o->slot + g * sk, sizeof(int32_t) * sk);
        be->download_bytes(be, rt->token, o->token + g * ec, sizeof(int32_t) * ec);
        be->download_bytes(be, rt->weight, o->weight + g * ec, sizeof(float) * ec);
        be->download_bytes(be, rt->count, o->count + (size_t)g * E, sizeof(int32_t) * (size_t)E);
        be->download_bytes(be, rt->wanted, o->wanted + (size_t)g * 3 * E, sizeof(int32_t) * (size_t)E);
        be->download_bytes(be, rt->dropped, o->dropped + (size_t)g * S, (size_t)S);
    }
    const size_t rb = sizeof(int32_t) * (size_t)st->rows;
    be->download_bytes(be, st->row_token, o->row_token, rb);
    be->download_bytes(be, st->row_expert, o->row_expert, rb);
    be->download_bytes(be, st->tok_rows, o->tok_rows, rb);
    be->download_bytes(be, st->tok_off, o->tok_off, sizeof(int32_t) * ((size_t)n + 1));
}

void R(moe_stats_sync)(struct R(moe_state) *st) {
    if (!st || !st->stats_owed) return;
    st->stats_owed = 0;
    route_fetch(st);
    fill_stats(st, st->stats_at);
}

void R(moe_stats_forget)(struct R(moe_state) *st) {
    if (st) st->stats_owed = 0;
}

void R(moe_set_aux_sink)(struct R(moe_state) *st, moe_aux_sink *k) {
    if (st) st->sink = k;
}

// Router logits, training noise and gates on the device; the decision of every group by the
// table where it can (route_on_table), else on the host from the downloaded gates, the packed
// row layout then uploaded for the later phases.
static int moe_route(struct R(moe_state) *st, const moe_call *c, const real *P, const real *x) {
    const R(vlmoe_backend) *be = st->be;
    const moe_spec *sp = &st->sp;
    const vlmoe_moe_config *cfg = sp->cfg;
    const int E = st->E, K = st->K, n = st->n;
    router_forward(st, P, x);
    be->softmax_forward(be, st->probs, st->logits, n, E);
    st->noisy_on = c->training && cfg->noise_std > 0;
    if (st->noisy_on && c->noise) { // a test pins the noise
        real *h = st->gates_h;
        be->download(be, h, st->logits, (size_t)n * E);
        for (size_t i = 0; i < (size_t)n * E; i++) h[i] += (real)c->noise[i];
        be->upload(be, st->noisy, h, (size_t)n * E);
    } else if (st->noisy_on) {
        // MOE.md: l + (noise_std/E) N(0,1), drawn per (call seed, token key, expert)
        be->upload_bytes(be, st->d_keys, st->keys, sizeof(uint64_t) * (size_t)n);
        const be_noise nz = {c->seed, cfg->noise_std / E, st->d_keys};
        be->router_noise(be, st->noisy, st->logits, n, E, &nz);
    }
    if (st->noisy_on)
        be->softmax_forward(be, st->gates, st->noisy, n, E);
    else
        be->copy(be, st->gates, st->probs, (size_t)n * E);
    if (st->ordered && !st->d_mask) { // the auxiliary losses see each group's rows together, in group order
        be->gather_rows(be, st->lg, st->logits, st->perm.row_token, n, E);
        if (st->noisy_on) be->gather_rows(be, st->ng, st->noisy, st->perm.row_token, n, E);
    }
    // the routing decision of each group
    int C, stt;
    if ((stt = moe_capacity(cfg, st->S, c->training, &C))) return stt;
    if (C > st->cmax) // moe_capacity is monotone in S and S <= the Smax create sized for
        return vlmoe_fail(VLMOE_ERR_ARG, "moe: capacity %d of a group of %d tokens exceeds the %d "
                          "the layer was sized for", C, st->S, st->cmax);
    st->C = C;
    const int renorm = cfg->router == VLMOE_ROUTER_TOKENS && cfg->gate_renorm == VLMOE_RENORM_AFTER_ROUTING;
    st->fixed = st->fixed_ok && c->training && !moe_ep_on(st);
    if (st->use_route) {
        if ((stt = route_on_table(st, c, C))) return stt;
        if (st->d_mask) plan_pools(st);
        int32_t *d = st->d_rows;
        const size_t rm = (size_t)st->rows_max;
        st->dd = (be_dispatch){n, st->rows, E, d, d + rm, d + 3 * rm, d + 2 * rm};
        be->combine_weights(be, st->combine, st->zsum, st->gates, &st->dd, renorm);
        return VLMOE_OK;
    }
    be->download(be, st->gates_h, st->gates, (size_t)n * E);
    be->download(be, st->probs_h, st->probs, (size_t)n * E);
    vlmoe_route_params rp = {K, C, cfg->order, cfg->bpr_score, cfg->gate_renorm, 0};
    for (int g = 0; g < st->G; g++) {
        for (int i = 0; i < st->S; i++) {
            const real *q = st->gates_h + (size_t)row_of(st, g * st->S + i) * E;
            for (int e = 0; e < E; e++) st->gates_f[(size_t)i * E + e] = (float)q[e];
        }
        // router_pred pruning: a pruned expert is never among the top K (every gate is >= 0);
        // the kept experts' gates stay those of the softmax over all experts
        if (sp->pruned)
            for (size_t i = 0; i < (size_t)st->S * E; i++)
                if (sp->pruned >> (i % E) & 1) st->gates_f[i] = -1;
        // disjoint pools: the experts outside a token's pool already have gate 0; -1 keeps them
        // out of its top K even where a pool gate underflows to 0 too
        for (int i = 0; st->d_mask && i < st->S; i++) {
            int e0, ne;
            pool_of(cfg, st->modality[row_of(st, g * st->S + i)], &e0, &ne);
            for (int e = 0; e < E; e++)
                if (e < e0 || e >= e0 + ne) st->gates_f[(size_t)i * E + e] = -1;
        }
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
    if (st->d_mask) plan_pools(st);
    // the packed layout: rows ordered by expert, then group, then slot
    memset(st->cnt, 0, sizeof(int32_t) * E);
    for (int g = 0; g < st->G; g++)
        for (int e = 0; e < E; e++) st->cnt[e] += st->rt[g].count[e];
    st->expert_off[0] = 0;
    for (int e = 0; e < E; e++) st->expert_off[e + 1] = st->expert_off[e] + st->cnt[e];
    st->rows = st->expert_off[E];
    for (int e = 0; e < E; e++) {
        int r = st->expert_off[e];
        for (int g = 0; g < st->G; g++)
            for (int k = 0; k < st->rt[g].count[e]; k++, r++) {
                st->row_token[r] = row_of(st, g * st->S + st->rt[g].token[e * st->rt[g].C + k]);
                st->row_expert[r] = e;
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
    const size_t rm = (size_t)st->rows_max;
    int32_t *d = st->d_rows;
    be->upload_bytes(be, d, st->row_token, sizeof(int32_t) * (size_t)st->rows);
    be->upload_bytes(be, d + rm, st->row_expert, sizeof(int32_t) * (size_t)st->rows);
    be->upload_bytes(be, d + 2 * rm, st->tok_rows, sizeof(int32_t) * (size_t)st->rows);
    be->upload_bytes(be, d + 3 * rm, st->tok_off, sizeof(int32_t) * ((size_t)n + 1));
    st->dd = (be_dispatch){n, st->rows, E, d, d + rm, d + 3 * rm, d + 2 * rm};
    be->combine_weights(be, st->combine, st->zsum, st->gates, &st->dd, renorm);
    return VLMOE_OK;
}

static be_experts experts_of(const struct R(moe_state) *st) {
    return (be_experts){st->E, st->sp.D, st->sp.M, st->sp.act, st->expert_off};
}

// This forward call's record in the step's sink while it records (moe_aux_sink), else NULL
// (st->aux_err set when the record could not be had).
static moe_aux_rec *aux_record(struct R(moe_state) *st, vlmoe_moe_stats *s) {
    moe_aux_sink *k = st->sink;
    if (!k || k->mode != MOE_AUX_RECORD) return NULL;
    if (k->nrec == k->rec_cap) { // the first steps only: the count of calls is the same each step
        const int cap = k->rec_cap ? 2 * k->rec_cap : 16;
        moe_aux_rec *r = vlmoe_calloc(sizeof(*r) * (size_t)cap, "the auxiliary losses' records");
        if (!r) return st->aux_err = 1, NULL;
        if (k->nrec) memcpy(r, k->rec, sizeof(*r) * (size_t)k->nrec);
        vlmoe_free_mem(k->rec);
        k->rec = r, k->rec_cap = cap;
    }
    moe_aux_rec *r = &k->rec[k->nrec++];
    memset(r, 0, sizeof(*r));
    r->s = s, r->G = st->G;
    return r;
}

// Loss a of a recorded call (weight w): 1 when its `slots` group values go to the sink's next
// slots, 0 when they do not fit (waited for, as without a sink; `need` plans the room).
static int aux_to_slots(moe_aux_sink *k, moe_aux_rec *r, int a, int slots, double w) {
    r->w[a] = w, r->n[a] = 0, r->host[a] = 0;
    k->need += slots;
    if (k->used + slots > k->cap) return r->at[a] = -1, 0;
    r->at[a] = k->used, k->used += slots;
    return 1;
}

// The auxiliary losses with disjoint pools (LIMoE E.3): each (group, modality) block is a MoE of
// its own over its pool: the losses see that modality's tokens and its pool's logits only
// (importance and load balance the pool's experts over its tokens, the switch loss counts its
// assignments with R_e = E_m/(K S_m) wanted_e, the entropies are the pool's), and the two
// modalities' losses add up, as two MoE layers' would; then the mean over groups as usual. The
// load loss keeps the routing's noise scale noise_std/E. Arguments as moe_aux.
static double moe_aux_pools(struct R(moe_state) *st, vlmoe_moe_stats *s, double daux, real *dlogits) {
    const R(vlmoe_backend) *be = st->be;
    const vlmoe_moe_config *cfg = st->sp.cfg;
    const int E = st->E;
    const int dev = st->d_mod != NULL; // the table's memory is not the host's
    if (!dlogits && st->sink && st->sink->mode == MOE_AUX_SKIP) return 0;
    moe_aux_rec *rec = dlogits ? NULL : aux_record(st, s);
    const uint8_t *kmod = st->pool_mod;
    if (dev) be->upload_bytes(be, st->d_mod, st->pool_mod, (size_t)st->n), kmod = st->d_mod;
    if (dlogits) be->zero(be, st->dlg, (size_t)st->pool_rows * st->pool_w);
    double total = 0;
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
        if (cfg->aux_weight[k] == 0) continue;
        double v = 0;
        // at most two blocks (the modalities) per group
        const int to_slots = rec && aux_to_slots(st->sink, rec, k, 2 * st->G, cfg->aux_weight[k]);
        size_t at = 0; // the block's first packed logit
        for (int g = 0; g < st->G; g++) {
            const int32_t *want = st->rt[g].wanted;
            if (st->use_route) { // the table's routing counted them there
                want = st->d_want + (size_t)g * 3 * E;
            } else if (dev) {
                int32_t *dw = st->d_want + (size_t)g * 3 * E;
                be->upload_bytes(be, dw, want, sizeof(int32_t) * (size_t)E);
                want = dw;
            }
            for (int m = 0; m < 2; m++) {
                const int b0 = st->pool_blk[2 * g + m], Sm = st->pool_blk[2 * g + m + 1] - b0;
                int e0, ne;
                pool_of(cfg, m, &e0, &ne);
                if (!Sm) continue;
                R(aux_input) in = {Sm, ne, st->K, st->lg + at, st->noisy_on ? st->ng + at : NULL,
                                   cfg->noise_std * ne / E, kmod + b0, want + e0,
                                   {cfg->global_tau[0], cfg->global_tau[1]}, NULL, 0};
                if (dlogits)
                    be->aux_loss(be, (vlmoe_aux_kind)k, &in, daux * cfg->aux_weight[k] / st->G, st->dlg + at,
                                 st->aux_scratch);
                else if (to_slots)
                    be->aux_loss_dev(be, (vlmoe_aux_kind)k, &in, st->aux_scratch,
                                     st->sink->slots + rec->at[k] + rec->n[k]++);
                else
                    v += be->aux_loss(be, (vlmoe_aux_kind)k, &in, 1.0, NULL, st->aux_scratch);
                at += (size_t)Sm * ne;
            }
        }
        if (rec) { // the sums wait for the step's download (moe_aux_sink_take)
            rec->host[k] = v;
            continue;
        }
        if (s) s->aux[k] = v / st->G;
        total += cfg->aux_weight[k] * (v / st->G);
    }
    if (dlogits) be->gather_rows_backward(be, dlogits, st->dlg, &st->pool_dd, st->pool_w);
    return total;
}

// The auxiliary losses (tokens choice only: experts choice needs none, MOE.md): their weighted
// sum, with each unweighted loss in s. With dlogits, accumulates daux times the weighted
// gradient into it instead.
static double moe_aux(struct R(moe_state) *st, vlmoe_moe_stats *s, double daux, real *dlogits) {
    const R(vlmoe_backend) *be = st->be;
    const vlmoe_moe_config *cfg = st->sp.cfg;
    const int E = st->E;
    double total = 0;
    if (cfg->router != VLMOE_ROUTER_TOKENS) return 0;
    if (st->d_mask) return moe_aux_pools(st, s, daux, dlogits);
    // groups of whole examples: the position-ordered copies, whose gradient goes back onto rows
    const real *lg = st->ordered ? st->lg : st->logits, *ng = st->ordered ? st->ng : st->noisy;
    const uint8_t *mod = st->ordered ? st->mod_pos : st->modality;
    real *dl = dlogits && st->ordered ? st->dlg : dlogits;
    // the load loss's erfc terms of a one-group forward serve its backward (the scratch is the
    // layer's own, and the other losses leave them alone)
    int load_kept = dlogits && st->load_kept && st->G == 1;
    st->load_kept = 0;
    if (!dlogits && st->sink && st->sink->mode == MOE_AUX_SKIP) return 0;
    moe_aux_rec *rec = dlogits ? NULL : aux_record(st, s);
    if (dl && dl != dlogits) be->zero(be, dl, (size_t)st->n * E);
    // the losses run where the table's memory is: what they read from the host goes there first
    const int dev = st->d_mod != NULL; // the table's memory is not the host's
    const uint8_t *kmod = dev && mod ? st->d_mod : mod;
    if (dev && mod) be->upload_bytes(be, st->d_mod, mod, (size_t)st->n);
    // Groups outside, losses inside: a group's losses share its softmax (kept), and the sums
    // over groups and the gradient's additions keep their order (per loss, groups in order; per
    // logit, losses in order), so the bits are those of one loss at a time.
    double v[VLMOE_AUX_COUNT] = {0};
    int to_slots[VLMOE_AUX_COUNT] = {0};
    for (int k = 0; k < VLMOE_AUX_COUNT; k++)
        if (cfg->aux_weight[k] != 0) to_slots[k] = rec && aux_to_slots(st->sink, rec, k, st->G, cfg->aux_weight[k]);
    const int sw = cfg->aux_weight[VLMOE_AUX_SWITCH] != 0;
    for (int g = 0; g < st->G; g++) {
        const size_t o = (size_t)g * st->S * E;
        const uint8_t *gm = mod ? mod + (size_t)g * st->S : NULL, *km = kmod ? kmod + (size_t)g * st->S : NULL;
        // the switch loss's counts (no other loss reads them), also per modality (CLIP-UP: per
        // tower; here per modality)
        const int32_t *want = NULL, *wmod = NULL;
        if (sw && st->use_route) { // the table's routing counted both where the losses run
            want = st->d_want + (size_t)g * 3 * E, wmod = want + E;
        } else if (sw) {
            want = st->rt[g].wanted, wmod = st->wanted_mod;
            memset(st->wanted_mod, 0, sizeof(int32_t) * 2 * E);
            for (int i = 0; i < st->S; i++)
                for (int r = 0; r < st->K; r++)
                    st->wanted_mod[(gm && gm[i] ? E : 0) + st->rt[g].expert[i * st->K + r]]++;
            if (dev) {
                int32_t *dw = st->d_want + (size_t)g * 3 * E;
                be->upload_bytes(be, dw, want, sizeof(int32_t) * (size_t)E);
                be->upload_bytes(be, dw + E, wmod, sizeof(int32_t) * 2 * (size_t)E);
                want = dw, wmod = dw + E;
            }
        }
        int kept = 0; // AUX_KEPT_P: the scratch holds this group's softmax
        for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
            if (cfg->aux_weight[k] == 0) continue;
            R(aux_input) in = {st->S, E, st->K, lg + o, st->noisy_on ? ng + o : NULL,
                               cfg->noise_std, km, want, {cfg->global_tau[0], cfg->global_tau[1]}, wmod,
                               kept | (load_kept ? AUX_KEPT_LOAD : 0)};
            const int is_load = k == VLMOE_AUX_LOAD || k == VLMOE_AUX_VLOSS;
            if (dl)
                be->aux_loss(be, (vlmoe_aux_kind)k, &in, daux * cfg->aux_weight[k] / st->G, dl + o,
                             st->aux_scratch);
            else if (to_slots[k])
                be->aux_loss_dev(be, (vlmoe_aux_kind)k, &in, st->aux_scratch,
                                 st->sink->slots + rec->at[k] + rec->n[k]++);
            else
                v[k] += be->aux_loss(be, (vlmoe_aux_kind)k, &in, 1.0, NULL, st->aux_scratch);
            if (k != VLMOE_AUX_LOAD) kept = AUX_KEPT_P; // the load loss computes no softmax
            if (is_load) load_kept = 0;                   // a backward's call uses its terms up
            if (is_load && !dl && st->G == 1 && st->noisy_on) st->load_kept = 1;
        }
    }
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
        if (cfg->aux_weight[k] == 0) continue;
        if (rec) { // the sums wait for the step's download (moe_aux_sink_take)
            rec->host[k] = v[k];
            continue;
        }
        if (s) s->aux[k] = v[k] / st->G;
        total += cfg->aux_weight[k] * (v[k] / st->G);
    }
    if (dl && dl != dlogits) be->gather_rows_backward(be, dlogits, dl, &st->perm, E);
    return total;
}

// ---- expert parallelism: process r of W computes experts [r*E/W, (r+1)*E/W) for the tokens of
// every process. Each process routes its own tokens (the decision is per group, and its groups
// are its own) and packs them by expert as usual; the rows of each owner's experts, contiguous
// in that order, go to the owner in one all-to-all (variable counts), which reorders what it
// receives from source-major to expert-major, runs its experts as one grouped call and sends
// the outputs back the same way; combine is unchanged. Backward runs the exchanges in reverse
// with the output gradients. A process writes the gradients of its own experts only: with the
// banks split (spec.split, src/nn/model.h model_shard) they are all it holds; with a bank held
// whole, the others' stay zero, so the trainer's mean over the processes is the gradient of the
// global loss (the sum of every process's tokens' contributions over W).
#ifndef VLMOE_MOE_EP_ONCE
#define VLMOE_MOE_EP_ONCE
struct moe_ep {
    vlmoe_dist *d;
    int W, El, e0;             // experts per process, this process's first
    int rows;                  // the most rows this process's experts can receive
    void *xe, *b1, *b2;        // (rows, D) expert-major inputs (kept for backward), scratch
    void *h, *a, *dh;          // (rows, M) the experts' hidden layer, activation and its gradient
    int32_t *cnt_send, *cnt_recv; // (W*El) rows per (process, local expert)
    int32_t *eoff;             // (El+1) expert-major offsets of the received rows
    size_t *sc, *sd, *rc, *rd; // (W) all-to-all counts and displacements, in elements
    size_t *cc, *cd;           // (W) the count exchange's: El each
};

static void ep_free(struct moe_ep *ep) {
    if (!ep) return;
    vlmoe_free_mem(ep->xe), vlmoe_free_mem(ep->b1), vlmoe_free_mem(ep->b2);
    vlmoe_free_mem(ep->h), vlmoe_free_mem(ep->a), vlmoe_free_mem(ep->dh);
    vlmoe_free_mem(ep->cnt_send), vlmoe_free_mem(ep->cnt_recv), vlmoe_free_mem(ep->eoff);
    vlmoe_free_mem(ep->sc), vlmoe_free_mem(ep->sd), vlmoe_free_mem(ep->rc), vlmoe_free_mem(ep->rd);
    vlmoe_free_mem(ep->cc), vlmoe_free_mem(ep->cd);
    vlmoe_free_mem(ep);
}
#endif

#define EP_TYPE (sizeof(real) == 4 ? VLMOE_DIST_F32 : VLMOE_DIST_F64)

static int moe_ep_on(const struct R(moe_state) *st) { return st->ep && st->ep->d; }

int R(moe_set_expert_parallel)(struct R(moe_state) *st, vlmoe_dist *d) {
    if (!d || d->world < 2) {
        if (st->ep) st->ep->d = NULL;
        return VLMOE_OK;
    }
    const vlmoe_moe_config *c = st->sp.cfg;
    const int E = st->E, W = d->world;
    if (c->router == VLMOE_ROUTER_SOFT)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "expert parallelism: Soft MoE layers mix every token into every slot; "
                          "they are not split across processes");
    if (E % W)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "expert parallelism: %d experts do not split over %d processes (the "
                          "process count must divide num_experts)", E, W);
    if (!st->be->host_memory)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "expert parallelism over MPI needs host memory (backend %s)", st->be->name);
    if (st->sp.split && (st->sp.shard_size != W || st->sp.shard_rank != d->rank))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "expert parallelism: this layer holds the experts of process %d of %d, not "
                          "those of process %d of %d", st->sp.shard_rank, st->sp.shard_size, d->rank, W);
    if (st->ep && st->ep->W == W && st->ep->e0 == d->rank * (E / W)) {
        st->ep->d = d;
        return VLMOE_OK;
    }
    ep_free(st->ep);
    struct moe_ep *ep = st->ep = vlmoe_calloc(sizeof(*ep), "expert parallelism");
    if (!ep) return VLMOE_ERR_NOMEM;
    ep->d = d, ep->W = W, ep->El = E / W, ep->e0 = d->rank * (E / W);
    // every process sends this one at most its rows_max rows, and at most capacity x groups for
    // each of its El experts: the bound is the same on every process, so no process can run out
    // where another does not (an error on one process alone would leave the others waiting)
    const long cap = (long)st->gmax * ep->El * st->cmax;
    const long per = cap < st->rows_max ? cap : st->rows_max;
    ep->rows = (int)(per * W);
    const size_t rows = (size_t)ep->rows * st->sp.D * sizeof(real) + 1, hid = (size_t)ep->rows * st->sp.M * sizeof(real) + 1;
    ep->xe = vlmoe_alloc(rows, "expert rows"), ep->b1 = vlmoe_alloc(rows, "expert rows");
    ep->b2 = vlmoe_alloc(rows, "expert rows");
    ep->h = vlmoe_alloc(hid, "expert rows"), ep->a = vlmoe_alloc(hid, "expert rows");
    ep->dh = vlmoe_alloc(hid, "expert rows");
    ep->cnt_send = vlmoe_alloc(sizeof(int32_t) * (size_t)E, "expert counts");
    ep->cnt_recv = vlmoe_alloc(sizeof(int32_t) * (size_t)E, "expert counts");
    ep->eoff = vlmoe_alloc(sizeof(int32_t) * ((size_t)ep->El + 1), "expert counts");
    ep->sc = vlmoe_alloc(sizeof(size_t) * W, "all-to-all counts"), ep->sd = vlmoe_alloc(sizeof(size_t) * W, "counts");
    ep->rc = vlmoe_alloc(sizeof(size_t) * W, "all-to-all counts"), ep->rd = vlmoe_alloc(sizeof(size_t) * W, "counts");
    ep->cc = vlmoe_alloc(sizeof(size_t) * W, "all-to-all counts"), ep->cd = vlmoe_alloc(sizeof(size_t) * W, "counts");
    if (!ep->xe || !ep->b1 || !ep->b2 || !ep->h || !ep->a || !ep->dh || !ep->cnt_send || !ep->cnt_recv || !ep->eoff || !ep->sc || !ep->sd ||
        !ep->rc || !ep->rd || !ep->cc || !ep->cd) {
        ep_free(ep), st->ep = NULL;
        return VLMOE_ERR_NOMEM;
    }
    return VLMOE_OK;
}

// Copies the received rows between source-major order (process i's rows, by its local expert)
// and expert-major order (each local expert's rows, by process): to_expert 1 or back.
static void ep_reorder(const struct R(moe_state) *st, real *dst, const real *src, int to_expert) {
    const struct moe_ep *ep = st->ep;
    const int D = st->sp.D, El = ep->El;
    for (int el = 0; el < El; el++) {
        size_t at_e = (size_t)ep->eoff[el];
        for (int i = 0; i < ep->W; i++) {
            size_t at_s = ep->rd[i] / (size_t)D;
            for (int k = 0; k < el; k++) at_s += (size_t)ep->cnt_recv[i * El + k];
            const size_t n = (size_t)ep->cnt_recv[i * El + el] * D;
            if (n) memcpy(to_expert ? dst + at_e * D : dst + at_s * D, to_expert ? src + at_s * D : src + at_e * D,
                          sizeof(real) * n);
            at_e += (size_t)ep->cnt_recv[i * El + el];
        }
    }
}

// The counts of this forward: rows per expert to every owner, rows per local expert from every
// process, and the all-to-all displacements.
static int ep_counts(struct R(moe_state) *st) {
    struct moe_ep *ep = st->ep;
    const int W = ep->W, El = ep->El, D = st->sp.D;
    for (int e = 0; e < st->E; e++) ep->cnt_send[e] = st->cnt[e];
    for (int j = 0; j < W; j++) ep->cc[j] = (size_t)El, ep->cd[j] = (size_t)j * El;
    int e = ep->d->alltoallv(ep->d, ep->cnt_recv, ep->cc, ep->cd, ep->cnt_send, ep->cc, ep->cd, VLMOE_DIST_I32);
    if (e) return vlmoe_error_prefix("expert parallelism: counts"), e;
    size_t at = 0;
    for (int i = 0; i < W; i++) {
        size_t n = 0;
        for (int el = 0; el < El; el++) n += (size_t)ep->cnt_recv[i * El + el];
        ep->rc[i] = n * D, ep->rd[i] = at * D, at += n;
        ep->sc[i] = (size_t)(st->expert_off[(i + 1) * El] - st->expert_off[i * El]) * D;
        ep->sd[i] = (size_t)st->expert_off[i * El] * D;
    }
    if (at > (size_t)ep->rows) // the processes' groups or capacities differ: a bug, not a user error
        return vlmoe_fail(VLMOE_ERR_ARG, "expert parallelism: %zu rows for this process's experts, more than the %d "
                          "planned", at, ep->rows);
    ep->eoff[0] = 0;
    for (int el = 0; el < El; el++) {
        int32_t n = 0;
        for (int i = 0; i < W; i++) n += ep->cnt_recv[i * El + el];
        ep->eoff[el + 1] = ep->eoff[el] + n;
    }
    return VLMOE_OK;
}

// This process's experts in banks w (w1, b1, w2, b2): a bank held whole starts at expert 0, so its
// first local expert is e0 in; a split one holds only this process's experts (spec.split).
static void ep_weights(const struct R(moe_state) *st, real *const w[4], real *out[4]) {
    const size_t D = (size_t)st->sp.D, M = (size_t)st->sp.M, e0 = (size_t)st->ep->e0;
    const size_t per[4] = {M * D, M, D * M, D};
    for (int k = 0; k < 4; k++) out[k] = w[k] + (st->sp.split >> k & 1 ? 0 : e0 * per[k]);
}

// Forward of this process's experts over every process's rows: st->xp (packed by expert) in,
// st->y (the same rows' outputs) back.
static int ep_forward(struct R(moe_state) *st, const real *const w[4]) {
    struct moe_ep *ep = st->ep;
    const moe_spec *sp = &st->sp;
    const int D = sp->D, M = sp->M;
    real *xe = ep->xe, *b1 = ep->b1, *b2 = ep->b2;
    int e = ep_counts(st);
    if (!e) e = ep->d->alltoallv(ep->d, b1, ep->rc, ep->rd, st->xp, ep->sc, ep->sd, EP_TYPE);
    if (e) return vlmoe_error_prefix("expert parallelism: dispatch"), e;
    ep_reorder(st, xe, b1, 1);
    real *wl[4];
    ep_weights(st, (real *const *)w, wl);
    const be_experts ex = {ep->El, D, M, sp->act, ep->eoff};
    st->be->experts_forward(st->be, b2, ep->h, ep->a, xe, (const real *const *)wl, &ex, 0);
    ep_reorder(st, b1, b2, 0);
    e = ep->d->alltoallv(ep->d, st->y, ep->sc, ep->sd, b1, ep->rc, ep->rd, EP_TYPE);
    return e ? (vlmoe_error_prefix("expert parallelism: combine"), e) : VLMOE_OK;
}

// Backward of ep_forward: st->dy in, st->dxp out (overwritten); this process's experts'
// gradients accumulate into dw.
static int ep_backward(struct R(moe_state) *st, const real *const w[4], real *const dw[4]) {
    struct moe_ep *ep = st->ep;
    const moe_spec *sp = &st->sp;
    const int D = sp->D, M = sp->M;
    real *b1 = ep->b1, *b2 = ep->b2;
    int e = ep->d->alltoallv(ep->d, b1, ep->rc, ep->rd, st->dy, ep->sc, ep->sd, EP_TYPE);
    if (e) return vlmoe_error_prefix("expert parallelism: output gradients"), e;
    ep_reorder(st, b2, b1, 1);
    const size_t n = (size_t)ep->eoff[ep->El] * D;
    real *wl[4], *dwl[4];
    ep_weights(st, (real *const *)w, wl);
    ep_weights(st, dw, dwl);
    const be_experts ex = {ep->El, D, M, sp->act, ep->eoff};
    if (n) memset(b1, 0, sizeof(real) * n);
    st->be->experts_backward(st->be, b1, dwl, b2, ep->xe, ep->h, (const real *const *)wl, ep->a, ep->dh, &ex);
    ep_reorder(st, b2, b1, 0);
    e = ep->d->alltoallv(ep->d, st->dxp, ep->sc, ep->sd, b2, ep->rc, ep->rd, EP_TYPE);
    return e ? (vlmoe_error_prefix("expert parallelism: input gradients"), e) : VLMOE_OK;
}

int R(moe_forward)(struct R(moe_state) *st, const moe_call *c, const real *P, const real *x,
                   real *out, double *aux, vlmoe_moe_stats *s) {
    const R(vlmoe_backend) *be = st->be;
    const moe_spec *sp = &st->sp;
    const int D = sp->D, n = c->n;
    // statistics still owed to another record (a recomputation under gradient checkpointing
    // names a scratch one) are filled before this pass overwrites the decision they read
    if (st->stats_owed && st->stats_at != s) R(moe_stats_sync)(st);
    int S, stt = moe_plan_groups(sp, n, c->training, c->examples, c->modality, &S, st->order, &st->ordered);
    if (stt) return stt;
    st->n = n;
    st->S = S;
    st->G = S ? n / S : 0;
    st->training = c->training;
    st->modality = c->modality ? memcpy(st->mod_row, c->modality, (size_t)n) : NULL;
    st->have_keys = c->keys != NULL;
    for (int t = 0; t < n; t++) st->keys[t] = c->keys ? c->keys[t] : (uint64_t)t;
    if (st->ordered) {
        for (int p = 0; p < n; p++) {
            st->inv[st->order[p]] = p;
            st->mod_pos[p] = c->modality[st->order[p]];
        }
        const size_t nm = (size_t)st->nmax;
        be->upload_bytes(be, st->d_perm, st->order, sizeof(int32_t) * (size_t)n);
        be->upload_bytes(be, st->d_perm + nm, st->inv, sizeof(int32_t) * (size_t)n);
        st->perm = (be_dispatch){n, n, 1, st->d_perm, NULL, st->d_perm + 2 * nm, st->d_perm + nm};
    }
    *aux = 0;
    memset(s->aux, 0, sizeof(s->aux));
    s->num_experts = st->E;
    if ((stt = plan_runs(st, c->modality))) return stt;
    if (sp->cfg->router == VLMOE_ROUTER_SOFT) return soft_forward(st, P, x, out, s);
    if ((stt = moe_route(st, c, P, x))) return stt;
    be->gather_rows(be, st->xp, x, st->dd.row_token, st->rows, D);
    // the activation goes to scratch (backward recomputes it from h)
    const real *const w[4] = {P + sp->w1, P + sp->b1, P + sp->w2, P + sp->b2};
    const be_experts ex = experts_of(st);
    if (st->ep && st->ep->d) {
        if ((stt = ep_forward(st, w))) return stt;
    } else if (sp->split) { // the other experts are not here
        return vlmoe_fail(VLMOE_ERR_CONFIG, "MoE layer: this process holds the experts of process %d of %d only: the "
                          "layer runs expert-parallel over its group, or on the whole model", sp->shard_rank,
                          sp->shard_size);
    } else {
        be->experts_forward(be, st->y, st->h, st->da, st->xp, w, &ex, 0);
    }
    be->combine_forward(be, out, st->y, st->combine, &st->dd, D);
    *aux = moe_aux(st, s, 1.0, NULL);
    if (st->aux_err)
        return st->aux_err = 0, vlmoe_fail(VLMOE_ERR_NOMEM, "MoE layer: the auxiliary losses' records of a device step");
    if (st->use_route) { // the statistics download what they read: on a device, when read
        st->stats_at = s, st->stats_owed = 1;
        if (be->host_memory) R(moe_stats_sync)(st);
    } else {
        fill_stats(st, s);
    }
    return VLMOE_OK;
}

// write: dx is written. Where a token has at most one row (tokens choice, top-1), the router's
// product (over every row: the runs of router_per_modality cover them all) is then its first
// writer and the expert row is added after it: per element r + a instead of (0 + a) + r, the
// same sum, so no zeroing of dx (bench-s: 5 MB a layer). With more rows a token, (r + a1) + a2
// would not be ((0 + a1) + a2) + r: dx is zeroed and accumulated as without write.
static void backward(struct R(moe_state) *st, const real *P, real *G, const real *x, const real *dout, real *dx,
                     double daux, int write) {
    const R(vlmoe_backend) *be = st->be;
    const R(vlmoe_backend) *rbe = be->fp32 ? be->fp32 : be;
    const moe_spec *sp = &st->sp;
    const vlmoe_moe_config *cfg = sp->cfg;
    const int one_row = cfg->router == VLMOE_ROUTER_TOKENS && st->K == 1;
    if (write && (!one_row || !rbe->linear_backward_write)) {
        be->zero(be, dx, (size_t)st->n * st->sp.D); // then accumulate
        write = 0;
    }
    const int E = st->E, D = sp->D, n = st->n;
    if (cfg->router == VLMOE_ROUTER_SOFT) {
        soft_dims d;
        soft_dims_of(st, &d);
        const R(soft_params) p2 = {P + sp->phi, P + sp->scale, P + sp->w1, P + sp->b1, P + sp->w2, P + sp->b2};
        const R(soft_grads) g2 = {G + sp->phi, G + sp->scale, G + sp->w1, G + sp->b1, G + sp->w2, G + sp->b2};
        if (st->ordered) { // dout by position; dx by position, then back onto the rows
            be->gather_rows(be, st->yg, dout, st->perm.row_token, n, D);
            be->zero(be, st->dxg, (size_t)n * D);
        }
        for (int g = 0; g < st->G; g++) {
            const size_t o = (size_t)g * st->S * D;
            const real *acts = st->soft_acts + st->soft_acts_n * (size_t)g;
            if (st->ordered)
                be->soft_moe_backward(be, st->dxg + o, &g2, st->yg + o, acts, st->xg + o, &p2, &d, st->soft_scratch);
            else
                be->soft_moe_backward(be, dx + o, &g2, dout + o, acts, x + o, &p2, &d, st->soft_scratch);
        }
        if (st->ordered) be->gather_rows_backward(be, dx, st->dxg, &st->perm, D);
        return;
    }
    // combine, experts, dispatch: back to the tokens
    be->combine_backward(be, st->dy, st->dcombine, dout, st->y, st->combine, &st->dd, D);
    const size_t rm = (size_t)st->rows;
    const real *const w[4] = {P + sp->w1, P + sp->b1, P + sp->w2, P + sp->b2};
    real *const dw[4] = {G + sp->w1, G + sp->b1, G + sp->w2, G + sp->b2};
    const be_experts ex = experts_of(st);
    // the experts are dxp's first writers: with the write mode its rows need no zeroing (those
    // outside the experts' offsets are no token's, and gather_rows_backward never reads them)
    const int xwrite = !(st->ep && st->ep->d) && be->experts_backward_write;
    if (!xwrite) be->zero(be, st->dxp, rm * D);
    if (xwrite) {
        be->experts_backward_write(be, st->dxp, dw, st->dy, st->xp, st->h, w, st->da, st->dh, &ex);
    } else if (st->ep && st->ep->d) {
        // a failed exchange (the MPI job is broken) leaves NaN gradients, which stop the step
        if (ep_backward(st, w, dw)) {
            const real nan = (real)NAN;
            for (size_t i = 0; i < rm * D; i++) st->dxp[i] = nan;
        }
    } else {
        be->experts_backward(be, st->dxp, dw, st->dy, st->xp, st->h, w, st->da, st->dh, &ex);
    }
    if (!write) be->gather_rows_backward(be, dx, st->dxp, &st->dd, D);
    // route: into the gates, then the logits (the noise is an additive constant)
    const int renorm = cfg->router == VLMOE_ROUTER_TOKENS && cfg->gate_renorm == VLMOE_RENORM_AFTER_ROUTING;
    be->zero(be, st->dgates, (size_t)n * E);
    be->combine_weights_backward(be, st->dgates, st->dcombine, st->gates, st->zsum, &st->dd, renorm);
    be->zero(be, st->dlogits, (size_t)n * E);
    be->softmax_backward(be, st->dlogits, st->gates, st->dgates, n, E);
    moe_aux(st, NULL, daux, st->dlogits);
    router_backward(st, P, G, x, dx, write);
    if (write) be->gather_rows_backward(be, dx, st->dxp, &st->dd, D);
}

void R(moe_backward)(struct R(moe_state) *st, const real *P, real *G, const real *x, const real *dout,
                     real *dx, double daux) {
    backward(st, P, G, x, dout, dx, daux, 0);
}

void R(moe_backward_write)(struct R(moe_state) *st, const real *P, real *G, const real *x, const real *dout,
                           real *dx, double daux) {
    backward(st, P, G, x, dout, dx, daux, 1);
}

// The decision of the last forward, token by token (vlmoe_model_routing in include/vlmoe.h).
int R(moe_routing)(const struct R(moe_state) *st, vlmoe_token_route *out, int cap, int *count) {
    const vlmoe_moe_config *cfg = st->sp.cfg;
    const int E = st->E, K = st->K, n = st->n, tc = cfg->router == VLMOE_ROUTER_TOKENS;
    *count = 0;
    if (cfg->router == VLMOE_ROUTER_SOFT)
        return vlmoe_fail(VLMOE_ERR_ARG, "routing: a Soft MoE layer has no per-token decision (every token "
                          "reaches every slot with a weight; see the stats' soft_minmax)");
    int total = 0;
    for (int t = 0; t < n; t++) total += tc ? K : (st->hits[t] > 0 ? st->hits[t] : 1);
    if (out && cap < total)
        return vlmoe_fail(VLMOE_ERR_ARG, "routing: %d entries needed, room for %d", total, cap);
    *count = total;
    if (!out) return VLMOE_OK;
    vlmoe_token_route *o = out;
    for (int t = 0; t < n; t++) {
        const int p = st->ordered ? st->inv[t] : t, g = p / st->S, i = p % st->S;
        const vlmoe_routing *rt = &st->rt[g];
        const real *q = st->gates_h + (size_t)t * E;
        const vlmoe_token_route base = {t, st->have_keys ? (int32_t)(st->keys[t] >> 21) : -1,
                                        st->have_keys ? (int32_t)(st->keys[t] & 0xFFFFF) : -1, g, i, 0, -1, -1,
                                        0.0f, 0.0f, (uint8_t)(st->modality ? st->modality[t] : 0), 1};
        if (tc) {
            for (int k = 0; k < K; k++, o++) {
                const int e = rt->expert[i * K + k], slot = rt->slot[i * K + k];
                *o = base;
                o->rank = k, o->expert = e, o->slot = slot, o->gate = (float)q[e];
                o->weight = slot >= 0 ? rt->weight[e * rt->C + slot] : 0.0f;
                o->dropped = slot < 0;
            }
            continue;
        }
        if (st->tok_off[t] == st->tok_off[t + 1]) *o++ = base; // no expert took it
        for (int j = st->tok_off[t], k = 0; j < st->tok_off[t + 1]; j++, k++, o++) {
            const int e = st->row_expert[st->tok_rows[j]];
            int slot = 0;
            while (slot < rt->count[e] && rt->token[e * rt->C + slot] != i) slot++;
            *o = base;
            o->rank = k, o->expert = e, o->slot = slot, o->gate = (float)q[e];
            o->weight = rt->weight[e * rt->C + slot], o->dropped = 0;
        }
    }
    return VLMOE_OK;
}
