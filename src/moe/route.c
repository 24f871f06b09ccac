// route.c: the routing decision of one group as a pure function: capacity, tokens choice (top-K,
// FIFO / Batch Priority Routing / random dispatch order, V-MoE sec. 4 and LIMoE appendix E.1)
// and experts choice, exactly as ../shared/spec/MOE.md. Covered by tests/test_moe_route.c.
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

const char *vlmoe_aux_name(vlmoe_aux_kind k) {
    // These strings are the keys of the "aux" object in JSON configs: append-only, never renamed.
    static const char *const names[VLMOE_AUX_COUNT] = {
        "importance", "load", "vloss", "zloss", "switch",
        "local_entropy_image", "local_entropy_text", "global_entropy_image",
        "global_entropy_text", "mutual_information", "target_entropy", "merged_entropy",
    };
    return ((int)k >= 0 && (int)k < VLMOE_AUX_COUNT) ? names[k] : "unknown";
}

int vlmoe_capacity(int S, int E, int K, double cf, int multiple, int *C) {
    if (!C) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_capacity: C is NULL");
    if (S < 1 || E < 1 || K < 1 || multiple < 1)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "vlmoe_capacity: need S >= 1, E >= 1, K >= 1 and capacity_multiple >= 1 "
                          "(got S=%d E=%d K=%d multiple=%d)", S, E, K, multiple);
    // The same expression and evaluation order as the reference implementation's Python
    // `ceil(num_tokens * k * capacity_factor / num_experts)`: S*K exactly, then *cf, then /E, all
    // in double. So 25*2*1.1/5 = 11.000000000000002 gives C = 12 there and here (pinned by a
    // test): every process and the reference agree on C bit for bit.
    double c = ceil((double)S * (double)K * cf / (double)E);
    if (!(c >= 1.0)) // also catches a NaN capacity factor
        return vlmoe_fail(VLMOE_ERR_CONFIG,
                          "capacity_factor %g gives expert capacity %g < 1 for a group of %d tokens, "
                          "%d experts and top_k %d: capacity_factor must be > 0", cf, c, S, E, K);
    // No group ever routes more than S*K assignments to one expert: a larger capacity (a huge but
    // finite factor from a model file) buys nothing, so it is clamped before it can size anything.
    if (c > (double)S * K) c = (double)S * K;
    c = ceil(c / multiple) * multiple;
    if (c > (double)INT_MAX)
        return vlmoe_fail(VLMOE_ERR_CONFIG,
                          "capacity_factor %g gives expert capacity %g, more than an int holds",
                          cf, c);
    *C = (int)c;
    return VLMOE_OK;
}

static int desc(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

void vlmoe_experts_cover(const double *routed, int E, double cover[3]) {
    const double level[3] = VLMOE_COVER_LEVELS;
    double v[4096]; // num_experts <= 4096 (vlmoe_config_validate)
    const int n = E < 4096 ? E : 4096;
    double total = 0;
    for (int e = 0; e < n; e++) total += v[e] = routed[e];
    qsort(v, (size_t)n, sizeof(double), desc);
    for (int k = 0; k < 3; k++) {
        double cum = 0;
        int c = 0;
        // relative to the total, so fractions that sum to 1 - 1e-16 still reach 90%
        while (total > 0 && c < n && cum < level[k] * total * (1 - 1e-12)) cum += v[c++];
        cover[k] = c;
    }
}

void vlmoe_routing_free(vlmoe_routing *r) {
    if (!r) return;
    vlmoe_free_mem(r->expert);
    vlmoe_free_mem(r->slot);
    vlmoe_free_mem(r->token);
    vlmoe_free_mem(r->weight);
    vlmoe_free_mem(r->count);
    vlmoe_free_mem(r->wanted);
    vlmoe_free_mem(r->dropped);
    vlmoe_free_mem(r->work);
    memset(r, 0, sizeof(*r));
}

// n elements of `size` bytes, overflow-checked; NULL (with the error set) on failure.
static void *alloc_n(size_t n, size_t size, const char *what) {
    size_t bytes;
    if (vlmoe_mul_ok(n, size, &bytes)) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "routing buffer %s: size overflows", what);
        return NULL;
    }
    return vlmoe_alloc(bytes, what);
}

int vlmoe_routing_alloc(vlmoe_routing *r, int S, int E, int K, int C) {
    if (!r) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_routing_alloc: r is NULL");
    memset(r, 0, sizeof(*r));
    // K = 0 is experts choice, which has no per-token choice arrays.
    if (S < 1 || E < 1 || K < 0 || K > E || C < 1)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "vlmoe_routing_alloc: need S >= 1, E >= 1, 0 <= K <= E, C >= 1 "
                          "(got S=%d E=%d K=%d C=%d)", S, E, K, C);
    r->S = S, r->E = E, r->K = K, r->C = C;
    size_t sk = (size_t)S * (size_t)K, ec = (size_t)E * (size_t)C; // products of two ints fit
    int ok = 1;
    if (K > 0) {
        ok &= (r->expert = alloc_n(sk, sizeof(int32_t), "routing.expert")) != NULL;
        ok &= ok && (r->slot = alloc_n(sk, sizeof(int32_t), "routing.slot")) != NULL;
    }
    ok &= ok && (r->token = alloc_n(ec, sizeof(int32_t), "routing.token")) != NULL;
    ok &= ok && (r->weight = alloc_n(ec, sizeof(float), "routing.weight")) != NULL;
    ok &= ok && (r->count = alloc_n((size_t)E, sizeof(int32_t), "routing.count")) != NULL;
    ok &= ok && (r->wanted = alloc_n((size_t)E, sizeof(int32_t), "routing.wanted")) != NULL;
    ok &= ok && (r->dropped = alloc_n((size_t)S, sizeof(uint8_t), "routing.dropped")) != NULL;
    ok &= ok && (r->work = alloc_n(2 * (size_t)S, sizeof(int32_t), "routing.work")) != NULL;
    if (!ok) {
        vlmoe_routing_free(r);
        return VLMOE_ERR_NOMEM;
    }
    return VLMOE_OK;
}

// ---- stable merge sort of an index array by a descending key (ties keep the input order)

typedef struct {
    const float *gates;
    int E, K;
    const int32_t *expert; // (S,K) tokens choice: chosen experts by rank
    int col;               // experts choice: the expert whose column is the key
    int kind;              // which key, see key_of
} sort_key;

enum { KEY_BPR_MAX, KEY_BPR_SUM, KEY_COLUMN };

static double key_of(const sort_key *k, int32_t s) {
    const float *g = k->gates + (size_t)s * k->E;
    switch (k->kind) {
    case KEY_BPR_MAX: return g[k->expert[(size_t)s * k->K]]; // rank 0 holds the max gate
    case KEY_BPR_SUM: {
        // Summed in rank order in double, so equal gate sets give bit-equal scores.
        double sum = 0;
        for (int j = 0; j < k->K; j++) sum += g[k->expert[(size_t)s * k->K + j]];
        return sum;
    }
    default: return g[k->col];
    }
}

// Sorts idx (n) by descending key; tmp (n) is scratch. Bottom-up merge sort: stable, no
// recursion, O(n log n) comparisons, and no allocation.
static void sort_desc(int32_t *idx, int32_t *tmp, int n, const sort_key *key) {
    int32_t *a = idx, *b = tmp;
    for (int w = 1; w < n; w *= 2) {
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int i = lo, j = mid, o = lo;
            while (i < mid && j < hi) {
                // Take from the right run only if strictly greater: stability = ties keep order.
                if (key_of(key, a[j]) > key_of(key, a[i])) b[o++] = a[j++];
                else b[o++] = a[i++];
            }
            while (i < mid) b[o++] = a[i++];
            while (j < hi) b[o++] = a[j++];
        }
        int32_t *t = a; a = b; b = t;
    }
    if (a != idx) memcpy(idx, a, (size_t)n * sizeof(int32_t));
}

static int check_out(const vlmoe_routing *out, const char *fn, int S, int E, int K, int C) {
    if (!out || !out->token || !out->weight || !out->count || !out->wanted || !out->dropped ||
        !out->work || (K > 0 && (!out->expert || !out->slot)))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: out was not allocated with vlmoe_routing_alloc", fn);
    if (out->S != S || out->E != E || (K > 0 && out->K != K) || out->C != C)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "%s: out was allocated for S=%d E=%d K=%d C=%d but the call has "
                          "S=%d E=%d K=%d C=%d", fn, out->S, out->E, out->K, out->C, S, E, K, C);
    return VLMOE_OK;
}

static int check_gates(const float *gates, int S, int E, const char *fn) {
    // A NaN compares false both ways and would break the top-K selection and the sorts.
    for (size_t i = 0; i < (size_t)S * E; i++)
        if (!isfinite(gates[i]))
            return vlmoe_fail(VLMOE_ERR_NUMERIC, "%s: gates[%zu, %zu] = %g is not finite", fn,
                              i / (size_t)E, i % (size_t)E, (double)gates[i]);
    return VLMOE_OK;
}

static void clear_slots(vlmoe_routing *out) {
    size_t ec = (size_t)out->E * out->C;
    for (size_t i = 0; i < ec; i++) out->token[i] = -1, out->weight[i] = 0.0f;
    memset(out->count, 0, (size_t)out->E * sizeof(int32_t));
    memset(out->wanted, 0, (size_t)out->E * sizeof(int32_t));
}

int vlmoe_route_tokens_choice(const float *gates, int S, int E, const vlmoe_route_params *p,
                              vlmoe_routing *out) {
    static const char fn[] = "vlmoe_route_tokens_choice";
    if (!gates || !p) return vlmoe_fail(VLMOE_ERR_ARG, "%s: gates and params must be given", fn);
    const int K = p->top_k, C = p->capacity;
    if (S < 1 || E < 1 || K < 1 || K > E || C < 1)
        return vlmoe_fail(VLMOE_ERR_ARG,
                          "%s: need S >= 1, E >= 1, 1 <= top_k <= E and capacity >= 1 "
                          "(got S=%d E=%d top_k=%d capacity=%d)", fn, S, E, K, C);
    if (p->order < VLMOE_ORDER_FIFO || p->order > VLMOE_ORDER_RANDOM)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: order %d is not fifo (0), bpr (1) or random (2)",
                          fn, p->order);
    if (p->bpr_score != VLMOE_BPR_MAX && p->bpr_score != VLMOE_BPR_SUM)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: bpr_score %d is not max (0) or sum (1)", fn,
                          p->bpr_score);
    if (p->gate_renorm != VLMOE_RENORM_NONE && p->gate_renorm != VLMOE_RENORM_AFTER_ROUTING)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: gate_renorm %d is not none (0) or after_routing (1)",
                          fn, p->gate_renorm);
    int st = check_out(out, fn, S, E, K, C);
    if (!st) st = check_gates(gates, S, E, fn);
    if (st) return st;

    // 1. Top-K per token. Experts are totally ordered by (gate descending, index ascending); rank
    // k takes the best expert strictly after rank k-1 in that order, so ties go to the lower index.
    for (int s = 0; s < S; s++) {
        const float *g = gates + (size_t)s * E;
        int prev = -1;
        for (int k = 0; k < K; k++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                if (prev >= 0 && !(g[e] < g[prev] || (g[e] == g[prev] && e > prev))) continue;
                if (best < 0 || g[e] > g[best]) best = e;
            }
            out->expert[(size_t)s * K + k] = best; // best >= 0: K <= E and gates are finite
            prev = best;
        }
    }

    // 2. Dispatch order over tokens.
    int32_t *order = out->work, *tmp = out->work + S;
    for (int s = 0; s < S; s++) order[s] = s;
    if (p->order == VLMOE_ORDER_BPR) {
        sort_key key = {gates, E, K, out->expert, 0,
                        p->bpr_score == VLMOE_BPR_SUM ? KEY_BPR_SUM : KEY_BPR_MAX};
        sort_desc(order, tmp, S, &key);
    } else if (p->order == VLMOE_ORDER_RANDOM) {
        vlmoe_rng rng;
        vlmoe_rng_seed(&rng, p->seed);
        for (int i = S - 1; i > 0; i--) { // Fisher-Yates: uniform over permutations
            int j = (int)vlmoe_rng_below(&rng, (uint32_t)i + 1);
            int32_t t = order[i]; order[i] = order[j]; order[j] = t;
        }
    }

    // 3-4. All rank-0 choices in dispatch order, then all rank-1 choices, ...; each expert
    // accepts the first C assignments it receives, in arrival order.
    clear_slots(out);
    for (int k = 0; k < K; k++) {
        for (int i = 0; i < S; i++) {
            int s = order[i];
            size_t sk = (size_t)s * K + k;
            int e = out->expert[sk];
            out->wanted[e]++;
            if (out->count[e] < C) {
                int c = out->count[e]++;
                out->token[(size_t)e * C + c] = s;
                out->weight[(size_t)e * C + c] = gates[(size_t)s * E + e];
                out->slot[sk] = c;
            } else {
                out->slot[sk] = -1;
            }
        }
    }

    // 5. Dropped tokens, and the optional renormalisation over accepted gates (CLIP-UP appendix).
    for (int s = 0; s < S; s++) {
        double sum = 0;
        int kept = 0;
        for (int k = 0; k < K; k++) {
            size_t sk = (size_t)s * K + k;
            if (out->slot[sk] < 0) continue;
            kept++;
            sum += out->weight[(size_t)out->expert[sk] * C + out->slot[sk]];
        }
        out->dropped[s] = kept == 0;
        // A zero sum (every accepted gate underflowed to 0) is left as zeros rather than 0/0.
        if (p->gate_renorm == VLMOE_RENORM_AFTER_ROUTING && kept && sum > 0) {
            for (int k = 0; k < K; k++) {
                size_t sk = (size_t)s * K + k;
                if (out->slot[sk] < 0) continue;
                float *w = &out->weight[(size_t)out->expert[sk] * C + out->slot[sk]];
                *w = (float)(*w / sum);
            }
        }
    }
    return VLMOE_OK;
}

int vlmoe_route_experts_choice(const float *gates, int S, int E, int C, vlmoe_routing *out) {
    static const char fn[] = "vlmoe_route_experts_choice";
    if (!gates) return vlmoe_fail(VLMOE_ERR_ARG, "%s: gates is NULL", fn);
    if (S < 1 || E < 1 || C < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: need S >= 1, E >= 1 and C >= 1 (got S=%d E=%d C=%d)",
                          fn, S, E, C);
    int st = check_out(out, fn, S, E, 0, C);
    if (!st) st = check_gates(gates, S, E, fn);
    if (st) return st;

    clear_slots(out);
    // Per-token choice arrays have no meaning here; mark them so stale tokens-choice data from a
    // reused struct cannot be mistaken for a decision.
    if (out->K > 0 && out->expert && out->slot)
        for (size_t i = 0; i < (size_t)S * out->K; i++) out->expert[i] = -1, out->slot[i] = -1;
    memset(out->dropped, 1, (size_t)S);
    // An expert cannot take more tokens than the group holds: with C > S the slots past S stay
    // empty (token -1, weight 0) and the (E,C) layout keeps its stride C.
    const int take = C < S ? C : S;
    int32_t *idx = out->work, *tmp = out->work + S;
    for (int e = 0; e < E; e++) {
        for (int s = 0; s < S; s++) idx[s] = s;
        sort_key key = {gates, E, 0, NULL, e, KEY_COLUMN};
        sort_desc(idx, tmp, S, &key); // stable: ties keep the lower token index
        for (int c = 0; c < take; c++) {
            int s = idx[c];
            out->token[(size_t)e * C + c] = s;
            out->weight[(size_t)e * C + c] = gates[(size_t)s * E + e];
            out->dropped[s] = 0;
        }
        // No capacity competition: every token an expert wanted, it got.
        out->count[e] = out->wanted[e] = take;
    }
    return VLMOE_OK;
}
