// route_op.c: the route entry of the CPU tables (be_route, src/ops/backend.h): the decision of
// each group is src/moe/route.c itself (no second algorithm on the CPU), on the gates the layer
// masks for pruning and disjoint pools, then the packed (or fixed-capacity) row layout the
// dispatch reads. The CUDA
// route (src/cuda/route_cuda.cu) must match it bit for bit; the MoE layer runs it on downloaded
// gates where a table cannot route (random dispatch order on a device). Compiled as float and
// double. Covered by tests/test_route_op.c and tests/test_backend_ops.c.
#include <string.h>

#include "core/real.h"
#include "core/core.h"
#include "moe/route_op.h"

int R(route_host)(const real *gates, const be_route *r, const be_route_out *o) {
    const int S = r->S, E = r->E, K = r->K, C = r->C, G = r->G, n = r->n;
    if (S < 1 || G < 1 || (long)S * G != n || K < 1 || C < 1 || E < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "route: need n = G*S tokens, S, G, E, K, C >= 1 (got n=%d S=%d G=%d "
                          "E=%d K=%d C=%d)", n, S, G, E, K, C);
    if (r->pools && !r->mod)
        return vlmoe_fail(VLMOE_ERR_ARG, "route: disjoint pools route by modality, and none was given");
    float *gf = o->work;                                       // (S,E) one group's gates
    int32_t *work = (int32_t *)(gf + (size_t)S * E);           // (2S) route.c's scratch
    const vlmoe_route_params rp0 = {K, C, r->order, r->bpr_score, r->gate_renorm, 0};
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < S; i++) {
            const int p = g * S + i, row = r->pos_row ? r->pos_row[p] : p;
            const real *q = gates + (size_t)row * E;
            int e0 = 0, ne = E;
            if (r->pools) e0 = r->pool[r->mod[p] ? 1 : 0][0], ne = r->pool[r->mod[p] ? 1 : 0][1];
            // pruned experts and those outside the pool get -1: never among the top K, since
            // every softmax gate is >= 0 (a pool gate may underflow to 0 itself)
            for (int e = 0; e < E; e++)
                gf[(size_t)i * E + e] = (r->pruned >> (e & 63) & 1 && e < 64) || e < e0 || e >= e0 + ne
                                            ? -1.0f : (float)q[e];
        }
        vlmoe_routing v = {S, E, K, C, o->expert + (size_t)g * S * K, o->slot + (size_t)g * S * K,
                           o->token + (size_t)g * E * C, o->weight + (size_t)g * E * C, o->count + (size_t)g * E,
                           o->wanted + (size_t)g * 3 * E, o->dropped + (size_t)g * S, work};
        vlmoe_route_params rp = rp0;
        rp.seed = r->seed + 0x9e3779b97f4a7c15ULL * (uint64_t)(g + 1);
        const int st = r->experts_choice ? vlmoe_route_experts_choice(gf, S, E, C, &v)
                                         : vlmoe_route_tokens_choice(gf, S, E, &rp, &v);
        if (st) return st;
        // each modality's assignments before capacity (the switch loss per modality)
        int32_t *wm = o->wanted + (size_t)g * 3 * E + E;
        memset(wm, 0, sizeof(int32_t) * 2 * (size_t)E);
        for (int i = 0; !r->experts_choice && i < S; i++)
            for (int k = 0; k < K; k++)
                wm[(r->mod && r->mod[g * S + i] ? E : 0) + v.expert[(size_t)i * K + k]]++;
    }
    // the packed layout: rows ordered by expert, then group, then slot; the fixed one keeps
    // every slot, empty ones as padding rows (row_token -1)
    int32_t *off = o->expert_off;
    off[0] = 0;
    for (int e = 0; e < E; e++) {
        long c = off[e];
        for (int g = 0; g < G; g++) c += r->fixed ? C : o->count[(size_t)g * E + e];
        if (c > o->rows_max)
            return vlmoe_fail(VLMOE_ERR_ARG, "route: %ld %s rows exceed the %d the layer planned", c,
                              r->fixed ? "fixed-capacity" : "packed", o->rows_max);
        off[e + 1] = (int32_t)c;
    }
    const int rows = off[E];
    for (int e = 0; e < E; e++) {
        int row = off[e];
        for (int g = 0; g < G; g++) {
            const int cnt = o->count[(size_t)g * E + e];
            for (int k = 0; k < (r->fixed ? C : cnt); k++, row++) {
                const int p = k < cnt ? g * S + o->token[((size_t)g * E + e) * C + k] : -1;
                o->row_token[row] = p < 0 ? -1 : r->pos_row ? r->pos_row[p] : p;
                o->row_expert[row] = e;
            }
        }
    }
    // each token's rows in row order: the combine sums a token's rows in a fixed order
    int32_t *to = o->tok_off;
    memset(to, 0, sizeof(int32_t) * ((size_t)n + 1));
    for (int q = 0; q < rows; q++)
        if (o->row_token[q] >= 0) to[o->row_token[q] + 1]++;
    for (int t = 0; t < n; t++) to[t + 1] += to[t];
    for (int q = 0; q < rows; q++)
        if (o->row_token[q] >= 0) o->tok_rows[to[o->row_token[q]]++] = q;
    for (int t = n; t > 0; t--) to[t] = to[t - 1];
    to[0] = 0;
    return VLMOE_OK;
}
