// test_moe_route.c: the routing decision and the auxiliary losses (src/moe/route.c, aux.c,
// aux_api.c) against hand-worked values from ../shared/spec/MOE.md, finite differences in double
// for every loss gradient, and the PyTorch fixture of tests/ref/gen_moe_aux.py when present.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "moe/aux.h"
#include "test.h"
#include "vlmoe.h"

// ---------------------------------------------------------------------------------------------
// Capacity

static void test_capacity(void) {
    int C = -7;
    // 10 tokens, K=1, cf 1.05, 4 experts: 10*1*1.05 = 10.5, /4 = 2.625, ceil -> 3.
    CHECK(vlmoe_capacity(10, 4, 1, 1.05, 1, &C) == VLMOE_OK && C == 3, "C=%d, want 3", C);
    // Same with capacity_multiple 4: 3 rounds up to 4.
    CHECK(vlmoe_capacity(10, 4, 1, 1.05, 4, &C) == VLMOE_OK && C == 4, "C=%d, want 4", C);
    // Exact integers stay put: 8*2*1.0/4 = 4; 16*1*1.25/4 = 20/4 = 5; 16*1*1/4 = 4 (multiple 4).
    CHECK(vlmoe_capacity(8, 4, 2, 1.0, 1, &C) == VLMOE_OK && C == 4, "C=%d, want 4", C);
    CHECK(vlmoe_capacity(16, 4, 1, 1.25, 1, &C) == VLMOE_OK && C == 5, "C=%d, want 5", C);
    CHECK(vlmoe_capacity(16, 4, 1, 1.0, 4, &C) == VLMOE_OK && C == 4, "C=%d, want 4", C);
    // 17*1*1/4 = 4.25 -> 5 -> next multiple of 4 is 8.
    CHECK(vlmoe_capacity(17, 4, 1, 1.0, 4, &C) == VLMOE_OK && C == 8, "C=%d, want 8", C);
    // Double rounding as in the reference's Python `ceil(S * K * cf / E)`: 25*2 = 50, 50*1.1 =
    // 55.00000000000001 in double, /5 = 11.000000000000002, ceil -> 12 (exact arithmetic gives
    // 11). The spec says "computed in double", so we agree with the reference bit for bit.
    CHECK(vlmoe_capacity(25, 5, 2, 1.1, 1, &C) == VLMOE_OK && C == 12, "C=%d, want 12", C);
    // Experts choice uses K=1: 196 tokens, cf 2, 8 experts: 392/8 = 49.
    CHECK(vlmoe_capacity(196, 8, 1, 2.0, 1, &C) == VLMOE_OK && C == 49, "C=%d, want 49", C);
    // A huge finite factor (a hostile model file: issue 19) gives the most a group can use, S*K,
    // never a failure that a caller might paper over with a smaller buffer; so does +inf here
    // (the config readers refuse it before it gets this far).
    CHECK(vlmoe_capacity(16, 8, 2, 1e30, 1, &C) == VLMOE_OK && C == 32, "cf 1e30: C=%d, want 32", C);
    CHECK(vlmoe_capacity(16, 8, 2, 1e300, 4, &C) == VLMOE_OK && C == 32, "cf 1e300: C=%d, want 32", C);
    CHECK(vlmoe_capacity(16, 8, 2, INFINITY, 1, &C) == VLMOE_OK && C == 32, "cf inf: C=%d, want 32", C);
    // A tiny positive factor still gives ceil(1e-9) = 1: not an error.
    CHECK(vlmoe_capacity(4, 4, 1, 1e-9, 1, &C) == VLMOE_OK && C == 1, "C=%d, want 1", C);
    // C < 1: a factor of 0 or below (or NaN) is a config error with a message.
    C = -7;
    CHECK(vlmoe_capacity(10, 4, 1, 0.0, 1, &C) == VLMOE_ERR_CONFIG && C == -7, "cf 0 accepted");
    CHECK(strstr(vlmoe_last_error(), "capacity_factor") != NULL, "message: %s", vlmoe_last_error());
    CHECK(vlmoe_capacity(10, 4, 1, -1.0, 1, &C) == VLMOE_ERR_CONFIG, "cf -1 accepted");
    CHECK(vlmoe_capacity(10, 4, 1, NAN, 1, &C) == VLMOE_ERR_CONFIG, "cf NaN accepted");
    CHECK(vlmoe_capacity(0, 4, 1, 1.0, 1, &C) == VLMOE_ERR_ARG, "S=0 accepted");
    CHECK(vlmoe_capacity(10, 4, 1, 1.0, 0, &C) == VLMOE_ERR_ARG, "multiple 0 accepted");
    CHECK(vlmoe_capacity(10, 4, 1, 1.0, 1, NULL) == VLMOE_ERR_ARG, "NULL C accepted");
}

// ---------------------------------------------------------------------------------------------
// Tokens choice and experts choice

static int route(const float *g, int S, int E, int K, int C, int order, int bpr, int renorm,
                 uint64_t seed, vlmoe_routing *r) {
    int st = vlmoe_routing_alloc(r, S, E, K, C);
    CHECK(st == VLMOE_OK, "alloc: %s", vlmoe_last_error());
    if (st) return st;
    vlmoe_route_params p = {K, C, order, bpr, renorm, seed};
    st = vlmoe_route_tokens_choice(g, S, E, &p, r);
    CHECK(st == VLMOE_OK, "route: %s", vlmoe_last_error());
    return st;
}

static int ints_eq(const int32_t *a, const int32_t *b, int n) {
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}
static int bytes_eq(const uint8_t *a, const uint8_t *b, int n) { return !memcmp(a, b, (size_t)n); }

static void test_fifo_vs_bpr(void) {
    // K=1, C=1, three experts. Rank-0 choices (ties to the lower index) and max gates:
    //   t0 [.5 .3 .2] -> e0 (.5);  t1 [.7 .2 .1] -> e0 (.7);  t2 [.2 .6 .2] -> e1 (.6);
    //   t3 [.4 .4 .2] -> e0 (tie between e0 and e1 -> e0; score .4).
    const float g[] = {.5f, .3f, .2f, .7f, .2f, .1f, .2f, .6f, .2f, .4f, .4f, .2f};
    vlmoe_routing r;
    // FIFO (0,1,2,3): e0 takes t0, drops t1 and t3; e1 takes t2.
    if (!route(g, 4, 3, 1, 1, VLMOE_ORDER_FIFO, 0, 0, 0, &r)) {
        const int32_t ex[] = {0, 0, 1, 0}, sl[] = {0, -1, 0, -1}, tok[] = {0, 2, -1};
        const int32_t cnt[] = {1, 1, 0}, want[] = {3, 1, 0};
        const uint8_t dr[] = {0, 1, 0, 1};
        CHECK(ints_eq(r.expert, ex, 4), "fifo experts %d %d %d %d", r.expert[0], r.expert[1],
              r.expert[2], r.expert[3]);
        CHECK(ints_eq(r.slot, sl, 4), "fifo slots");
        CHECK(ints_eq(r.token, tok, 3), "fifo tokens %d %d %d", r.token[0], r.token[1], r.token[2]);
        CHECK(ints_eq(r.count, cnt, 3) && ints_eq(r.wanted, want, 3), "fifo counts");
        CHECK(bytes_eq(r.dropped, dr, 4), "fifo dropped");
        CHECK(r.weight[0] == .5f && r.weight[1] == .6f && r.weight[2] == 0, "fifo weights");
    }
    vlmoe_routing_free(&r);
    // BPR max: scores .5 .7 .6 .4 -> order t1, t2, t0, t3: e0 takes t1 (weight .7), e1 takes t2,
    // t0 and t3 are dropped.
    if (!route(g, 4, 3, 1, 1, VLMOE_ORDER_BPR, VLMOE_BPR_MAX, 0, 0, &r)) {
        const int32_t sl[] = {-1, 0, 0, -1}, tok[] = {1, 2, -1}, want[] = {3, 1, 0};
        const uint8_t dr[] = {1, 0, 0, 1};
        CHECK(ints_eq(r.slot, sl, 4) && ints_eq(r.token, tok, 3), "bpr tokens %d %d %d",
              r.token[0], r.token[1], r.token[2]);
        CHECK(bytes_eq(r.dropped, dr, 4) && ints_eq(r.wanted, want, 3), "bpr dropped/wanted");
        CHECK(r.weight[0] == .7f, "bpr weight %g", r.weight[0]);
    }
    vlmoe_routing_free(&r);

    // BPR ties keep the lower position. K=1, C=2, two experts:
    //   t0 [.3 .7] -> e1 (.7); t1 [.6 .4] -> e0 (.6); t2 [.6 .4] -> e0 (.6); t3 [.8 .2] -> e0 (.8).
    // Order t3, t0, t1, t2 (t1 before t2: equal scores). e0 takes t3 (slot 0), t1 (slot 1) and
    // drops t2; e1 takes t0. A sort that swapped the tie would keep t2 instead.
    const float g2[] = {.3f, .7f, .6f, .4f, .6f, .4f, .8f, .2f};
    if (!route(g2, 4, 2, 1, 2, VLMOE_ORDER_BPR, VLMOE_BPR_MAX, 0, 0, &r)) {
        const int32_t tok[] = {3, 1, 0, -1}, sl[] = {0, 1, -1, 0};
        const uint8_t dr[] = {0, 0, 1, 0};
        CHECK(ints_eq(r.token, tok, 4), "bpr tie tokens %d %d %d %d", r.token[0], r.token[1],
              r.token[2], r.token[3]);
        CHECK(ints_eq(r.slot, sl, 4) && bytes_eq(r.dropped, dr, 4), "bpr tie slots/dropped");
    }
    vlmoe_routing_free(&r);
}

static void test_k2(void) {
    vlmoe_routing r;
    // K=2, C=1, FIFO. Choices by rank:
    //   t0 [.5 .3 .2] -> e0, e1;  t1 [.2 .5 .3] -> e1, e2;  t2 [.3 .2 .5] -> e2, e0.
    // All first choices go first: e0<-t0, e1<-t1, e2<-t2 fill every expert, so every second
    // choice is dropped, t0's included although t0 comes before t1 (token-by-token placement
    // would have given e1 to t0's second choice and dropped t1).
    const float g[] = {.5f, .3f, .2f, .2f, .5f, .3f, .3f, .2f, .5f};
    if (!route(g, 3, 3, 2, 1, VLMOE_ORDER_FIFO, 0, 0, 0, &r)) {
        const int32_t ex[] = {0, 1, 1, 2, 2, 0}, sl[] = {0, -1, 0, -1, 0, -1};
        const int32_t tok[] = {0, 1, 2}, want[] = {2, 2, 2};
        const uint8_t dr[] = {0, 0, 0};
        CHECK(ints_eq(r.expert, ex, 6) && ints_eq(r.slot, sl, 6), "k2 rank order");
        CHECK(ints_eq(r.token, tok, 3) && ints_eq(r.wanted, want, 3), "k2 tokens");
        CHECK(bytes_eq(r.dropped, dr, 3), "k2 dropped");
    }
    vlmoe_routing_free(&r);

    // A token fully dropped. K=2, C=1, FIFO:
    //   t0 [.6 .3 .1] -> e0, e1;  t1 [.2 .7 .1] -> e1, e0;  t2 [.5 .4 .1] -> e0, e1.
    // Rank 0: e0<-t0, e1<-t1, t2's e0 is full. Rank 1: e1 (t0), e0 (t1), e1 (t2) all full.
    // t2 has nothing accepted: dropped. wanted = e0: t0, t2, t1 -> 3; e1: t1, t0, t2 -> 3; e2: 0.
    const float g2[] = {.6f, .3f, .1f, .2f, .7f, .1f, .5f, .4f, .1f};
    if (!route(g2, 3, 3, 2, 1, VLMOE_ORDER_FIFO, 0, 0, 0, &r)) {
        const uint8_t dr[] = {0, 0, 1};
        const int32_t want[] = {3, 3, 0}, cnt[] = {1, 1, 0}, sl[] = {0, -1, 0, -1, -1, -1};
        CHECK(bytes_eq(r.dropped, dr, 3), "full drop: dropped %d %d %d", r.dropped[0],
              r.dropped[1], r.dropped[2]);
        CHECK(ints_eq(r.wanted, want, 3) && ints_eq(r.count, cnt, 3), "full drop: counts");
        CHECK(ints_eq(r.slot, sl, 6), "full drop: slots");
    }
    vlmoe_routing_free(&r);
}

static void test_bpr_sum_and_renorm(void) {
    vlmoe_routing r;
    // K=2, C=1:  t0 [.50 .45 .05] -> e0, e1: max .50, sum .95
    //            t1 [.55 .10 .35] -> e0, e2: max .55, sum .90
    // BPR max: order t1, t0. Rank 0: e0<-t1, t0's e0 dropped. Rank 1: e1<-t0, e2<-t1.
    // BPR sum: order t0, t1. Rank 0: e0<-t0, t1's e0 dropped. Rank 1: e1<-t0, e2<-t1.
    const float g[] = {.50f, .45f, .05f, .55f, .10f, .35f};
    if (!route(g, 2, 3, 2, 1, VLMOE_ORDER_BPR, VLMOE_BPR_MAX, 0, 0, &r)) {
        CHECK(r.token[0] == 1 && r.token[1] == 0 && r.token[2] == 1, "bpr max tokens %d %d %d",
              r.token[0], r.token[1], r.token[2]);
        CHECK(r.weight[0] == .55f && r.weight[1] == .45f && r.weight[2] == .35f, "bpr max weights");
    }
    vlmoe_routing_free(&r);
    if (!route(g, 2, 3, 2, 1, VLMOE_ORDER_BPR, VLMOE_BPR_SUM, 0, 0, &r)) {
        CHECK(r.token[0] == 0 && r.token[1] == 0 && r.token[2] == 1, "bpr sum tokens %d %d %d",
              r.token[0], r.token[1], r.token[2]);
        CHECK(r.weight[0] == .50f, "bpr sum weight %g", r.weight[0]);
        CHECK(r.slot[2] == -1 && r.slot[3] == 0, "bpr sum: t1 keeps only its second choice");
    }
    vlmoe_routing_free(&r);
    // after_routing with BPR max: t1 kept e0 (.55) and e2 (.35): .55/.90 = 0.6111111, .35/.90 =
    // 0.3888889; t0 kept only e1 (.45): .45/.45 = 1.
    if (!route(g, 2, 3, 2, 1, VLMOE_ORDER_BPR, VLMOE_BPR_MAX, VLMOE_RENORM_AFTER_ROUTING, 0, &r)) {
        CHECK_CLOSE(r.weight[0], .55 / .90, 1e-6, 0, "renorm e0");
        CHECK_CLOSE(r.weight[1], 1.0, 1e-6, 0, "renorm e1");
        CHECK_CLOSE(r.weight[2], .35 / .90, 1e-6, 0, "renorm e2");
    }
    vlmoe_routing_free(&r);
}

static void test_random_order(void) {
    // With one expert, K=1 and C=S, the expert's slots list the tokens in dispatch order.
    enum { S = 50 };
    float g[S];
    for (int s = 0; s < S; s++) g[s] = 1.0f;
    vlmoe_routing a, b, c, f;
    int ok = !route(g, S, 1, 1, S, VLMOE_ORDER_RANDOM, 0, 0, 42, &a);
    ok &= !route(g, S, 1, 1, S, VLMOE_ORDER_RANDOM, 0, 0, 42, &b);
    ok &= !route(g, S, 1, 1, S, VLMOE_ORDER_RANDOM, 0, 0, 43, &c);
    ok &= !route(g, S, 1, 1, S, VLMOE_ORDER_FIFO, 0, 0, 0, &f);
    if (ok) {
        int seen[S] = {0}, perm = 1, ident = 1;
        for (int i = 0; i < S; i++) {
            int t = a.token[i];
            if (t < 0 || t >= S || seen[t]++) perm = 0;
            if (t != i) ident = 0;
        }
        CHECK(perm, "random order is not a permutation");
        CHECK(!ident, "random order is the identity");
        CHECK(ints_eq(a.token, b.token, S), "same seed, different order");
        CHECK(!ints_eq(a.token, c.token, S), "seeds 42 and 43 give the same order");
        for (int i = 0; i < S; i++) CHECK(f.token[i] == i, "fifo order at %d: %d", i, f.token[i]);
    }
    vlmoe_routing_free(&a), vlmoe_routing_free(&b), vlmoe_routing_free(&c), vlmoe_routing_free(&f);
}

static void test_experts_choice(void) {
    // S=4, E=2, C=2:  t0 [.5 .5]  t1 [.7 .3]  t2 [.5 .5]  t3 [.2 .8]
    // e0's column .5 .7 .5 .2: t1 (.7), then t0 (.5, tie with t2 -> lower index).
    // e1's column .5 .3 .5 .8: t3 (.8), then t0 (.5, tie with t2). t2 is taken by nobody.
    const float g[] = {.5f, .5f, .7f, .3f, .5f, .5f, .2f, .8f};
    vlmoe_routing r;
    CHECK(vlmoe_routing_alloc(&r, 4, 2, 0, 2) == VLMOE_OK, "alloc K=0");
    CHECK(vlmoe_route_experts_choice(g, 4, 2, 2, &r) == VLMOE_OK, "%s", vlmoe_last_error());
    const int32_t tok[] = {1, 0, 3, 0}, cnt[] = {2, 2};
    const uint8_t dr[] = {0, 0, 1, 0};
    CHECK(ints_eq(r.token, tok, 4), "ec tokens %d %d %d %d", r.token[0], r.token[1], r.token[2],
          r.token[3]);
    CHECK(r.weight[0] == .7f && r.weight[1] == .5f && r.weight[2] == .8f && r.weight[3] == .5f,
          "ec weights");
    CHECK(ints_eq(r.count, cnt, 2) && bytes_eq(r.dropped, dr, 4), "ec counts/dropped");
    vlmoe_routing_free(&r);
    // C=6 > S=4: each expert takes all 4 tokens by descending gate; slots 4, 5 stay empty.
    CHECK(vlmoe_routing_alloc(&r, 4, 2, 0, 6) == VLMOE_OK, "alloc C=6");
    CHECK(vlmoe_route_experts_choice(g, 4, 2, 6, &r) == VLMOE_OK, "%s", vlmoe_last_error());
    // e0: .7 (t1), .5 (t0), .5 (t2), .2 (t3); e1: .8 (t3), .5 (t0), .5 (t2), .3 (t1).
    const int32_t tok6[] = {1, 0, 2, 3, -1, -1, 3, 0, 2, 1, -1, -1};
    CHECK(ints_eq(r.token, tok6, 12), "ec C>S tokens");
    CHECK(r.count[0] == 4 && r.count[1] == 4 && r.weight[4] == 0 && r.weight[11] == 0,
          "ec C>S counts");
    vlmoe_routing_free(&r);
}

static void test_route_errors(void) {
    const float g[] = {.5f, .5f, .7f, .3f};
    vlmoe_routing r;
    CHECK(vlmoe_routing_alloc(&r, 2, 2, 3, 1) == VLMOE_ERR_ARG, "K > E allocated");
    CHECK(vlmoe_routing_alloc(&r, 2, 2, 1, 0) == VLMOE_ERR_ARG, "C = 0 allocated");
    vlmoe_routing_free(NULL);
    CHECK(vlmoe_routing_alloc(&r, 2, 2, 1, 1) == VLMOE_OK, "alloc");
    vlmoe_route_params p = {1, 1, VLMOE_ORDER_FIFO, 0, 0, 0};
    p.top_k = 0;
    CHECK(vlmoe_route_tokens_choice(g, 2, 2, &p, &r) == VLMOE_ERR_ARG, "K=0 routed");
    p.top_k = 3;
    CHECK(vlmoe_route_tokens_choice(g, 2, 2, &p, &r) == VLMOE_ERR_ARG, "K>E routed");
    p.top_k = 1, p.capacity = 2;
    CHECK(vlmoe_route_tokens_choice(g, 2, 2, &p, &r) == VLMOE_ERR_ARG, "C mismatch routed");
    CHECK(strstr(vlmoe_last_error(), "allocated for") != NULL, "msg: %s", vlmoe_last_error());
    p.capacity = 1, p.order = 7;
    CHECK(vlmoe_route_tokens_choice(g, 2, 2, &p, &r) == VLMOE_ERR_ARG, "order 7 routed");
    p.order = VLMOE_ORDER_FIFO;
    const float bad[] = {.5f, NAN, .7f, .3f};
    CHECK(vlmoe_route_tokens_choice(bad, 2, 2, &p, &r) == VLMOE_ERR_NUMERIC, "NaN gate routed");
    CHECK(vlmoe_route_experts_choice(g, 2, 2, 2, &r) == VLMOE_ERR_ARG, "ec C mismatch routed");
    vlmoe_routing_free(&r);
    vlmoe_routing_free(&r); // freeing twice is safe: the struct was zeroed
    CHECK(!strcmp(vlmoe_aux_name(VLMOE_AUX_MERGED_ENT), "merged_entropy") &&
          !strcmp(vlmoe_aux_name(VLMOE_AUX_IMPORTANCE), "importance") &&
          !strcmp(vlmoe_aux_name(VLMOE_AUX_COUNT), "unknown"), "aux names");
}

// ---------------------------------------------------------------------------------------------
// Auxiliary losses by hand

static void test_aux_values(void) {
    // S=4 tokens, E=3. Logits log(p) + c_s, so the gates are exactly these rows and
    // logsumexp_s = c_s = 0, 1, 2, -1. Tokens 0, 1 are image, 2, 3 text.
    const double p[4][3] = {{.5, .25, .25}, {.25, .5, .25}, {.8, .1, .1}, {.1, .1, .8}};
    const double shift[4] = {0, 1, 2, -1};
    float l[12];
    for (int s = 0; s < 4; s++)
        for (int e = 0; e < 3; e++) l[s * 3 + e] = (float)(log(p[s][e]) + shift[s]);
    const uint8_t mod[4] = {0, 0, 1, 1};
    const int32_t wanted[3] = {3, 1, 4};
    // top-2 of each token (ties: lower index): t0 {0,1}, t1 {1,0} (image); t2 {0,1}, t3 {2,0}
    // (text): per modality wanted = image (2, 2, 0), text (2, 1, 1)
    const int32_t wanted_mod[6] = {2, 2, 0, 2, 1, 1};
    vlmoe_aux_input in = {4, 3, 2, l, NULL, 1.0, mod, wanted, {0, 0}, wanted_mod};
    const double tol = 2e-6;
    // importance: imp = column sums = 1.65, .95, 1.4 (total 4, mean 4/3); population variance
    // = (1.65^2 + .95^2 + 1.4^2)/3 - 16/9 = 5.585/3 - 16/9 = .755/9; / (16/9) -> .755/16 = 0.0471875.
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_IMPORTANCE, &in, 1, NULL), 0.0471875, 0, tol, "importance");
    // load without noisy logits is 0; v-loss is then half the importance.
    CHECK(vlmoe_aux_loss(VLMOE_AUX_LOAD, &in, 1, NULL) == 0, "load without noise");
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_VLOSS, &in, 1, NULL), 0.5 * 0.0471875, 0, tol, "vloss");
    // z-loss per modality (CLIP-UP per tower, MOE.md): image mean c_s^2 = (0 + 1)/2 = .5, text
    // (4 + 1)/2 = 2.5; sum 3.0 (the whole-group mean, the old rule, was 1.5).
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_ZLOSS, &in, 1, NULL), 3.0, 1e-6, 0, "zloss per modality");
    // switch per modality: image R = E/(K n) wanted = 3/4 (2, 2, 0) = (1.5, 1.5, 0), P = mean of
    // t0, t1 = (.375, .375, .25): .5625 + .5625 = 1.125; text R = 3/4 (2, 1, 1) = (1.5, .75, .75),
    // P = (.45, .1, .45): .675 + .075 + .3375 = 1.0875; sum 2.2125.
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_SWITCH, &in, 1, NULL), 2.2125, 0, tol, "switch per modality");
    // one modality (NULL = all image): the whole group. R = E/(K S) wanted = 3/8 (3, 1, 4) =
    // (1.125, .375, 1.5); P = imp/4 = (.4125, .2375, .35); sum R P = .4640625 + .0890625 + .525
    // = 1.078125; z-loss mean c_s^2 = (0 + 1 + 4 + 1)/4 = 1.5.
    in.modality = NULL;
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_SWITCH, &in, 1, NULL), 1.078125, 0, tol, "switch");
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_ZLOSS, &in, 1, NULL), 1.5, 1e-6, 0, "zloss");
    in.modality = mod, in.wanted_mod = NULL;
    CHECK(isnan(vlmoe_aux_loss(VLMOE_AUX_SWITCH, &in, 1, NULL)), "switch of two modalities without wanted_mod");
    CHECK(strstr(vlmoe_last_error(), "wanted_mod") != NULL, "msg: %s", vlmoe_last_error());
    in.wanted_mod = wanted_mod;
    // local entropy, image: H(.5, .25, .25) = .5 ln 2 + 2 (.25 ln 4) = 1.5 ln 2 = 1.0397207708.
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_LOCAL_ENT_IMAGE, &in, 1, NULL), 1.5 * log(2.0), 0, tol,
                "local image");
    // local entropy, text: H(.8, .1, .1) = -.8 ln .8 - .2 ln .1 = 0.6390318597.
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_LOCAL_ENT_TEXT, &in, 1, NULL), 0.639031859650177, 0, tol,
                "local text");
    // global entropy, tau = 0 = log 1: image pbar = (.375, .375, .25), H = 1.0821955 > 0; text
    // pbar = (.45, .1, .45), H = 0.9489154 > 0: both inactive.
    CHECK(vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_IMAGE, &in, 1, NULL) == 0, "global image inactive");
    CHECK(vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_TEXT, &in, 1, NULL) == 0, "global text inactive");
    // tau = log 3 = 1.0986123: image 1.0986123 - 1.0821955 = 0.0164168, text 1.0986123 -
    // 0.9489154 = 0.1496969.
    in.global_tau[0] = in.global_tau[1] = log(3.0);
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_IMAGE, &in, 1, NULL), 0.016416758629342443, 0,
                1e-4, "global image");
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_TEXT, &in, 1, NULL), 0.14969685277271072, 0,
                1e-5, "global text");
    // mutual information, M=2: (H(img) + H(txt))/2 - H(mix), mix = (.4125, .2375, .35),
    // H(mix) = 1.0741414; (1.0821955 + 0.9489154)/2 - 1.0741414 = -0.0585859 (it is -MI <= 0).
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_MI, &in, 1, NULL), -0.05858594648852433, 0, 1e-5, "MI");
    // target entropy, K=2, over the text tokens (LIMoE E.1: it replaces the text local loss):
    // local = H(.8, .1, .1) = 0.6390319 for t2 and t3; (ln 2 - 0.6390319)^2 = 0.0029285 (over
    // all four tokens, the old rule, it was (ln 2 - 0.8393763)^2 = 0.0213830).
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_TARGET_ENT, &in, 1, NULL), 0.00292846795716721, 0, 1e-5,
                "target entropy");
    // merged entropy, K=2, over the text tokens: t2, t3 top-2 sum .9 -> H(.9, .1) = 0.3250830
    // each; mean 0.3250830 (over all tokens, with t0, t1's H(.75, .25), it was 0.4437091).
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_MERGED_ENT, &in, 1, NULL), 0.3250829733914482, 0, tol,
                "merged entropy");
    // A modality absent from the group: its losses are 0, and MI over one modality is 0.
    const uint8_t all_img[4] = {0, 0, 0, 0};
    in.modality = all_img;
    CHECK(vlmoe_aux_loss(VLMOE_AUX_LOCAL_ENT_TEXT, &in, 1, NULL) == 0, "local text, no text");
    CHECK(vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_TEXT, &in, 1, NULL) == 0, "global text, no text");
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_MI, &in, 1, NULL), 0, 1e-12, 0, "MI, one modality");
    in.modality = NULL; // NULL = all image
    CHECK(vlmoe_aux_loss(VLMOE_AUX_LOCAL_ENT_TEXT, &in, 1, NULL) == 0, "local text, NULL mod");
    // Bad input: NaN with the error set.
    const uint8_t bad[4] = {0, 2, 1, 1};
    in.modality = bad;
    CHECK(isnan(vlmoe_aux_loss(VLMOE_AUX_LOCAL_ENT_IMAGE, &in, 1, NULL)), "modality 2 accepted");
    CHECK(strstr(vlmoe_last_error(), "modality[1]") != NULL, "msg: %s", vlmoe_last_error());
    in.modality = NULL, in.wanted = NULL; // one modality: the group's counts are needed
    CHECK(isnan(vlmoe_aux_loss(VLMOE_AUX_SWITCH, &in, 1, NULL)), "switch without counts");
    in.modality = mod, in.wanted = wanted, in.K = 4;
    CHECK(isnan(vlmoe_aux_loss(VLMOE_AUX_IMPORTANCE, &in, 1, NULL)), "K > E accepted");

    // load, S=2, E=2, K=1, noise_std 2 -> sigma = 2/2 = 1, so z = thr - l.
    //   l = [[0, 0], [1, 0]], noisy = [[.5, -.5], [0, 1]] (thresholds: max noisy = .5 and 1).
    //   t0: z = .5, .5 -> P = 1 - Phi(.5) = 0.3085375 each.
    //   t1: z = 1 - 1 = 0 -> P = .5; z = 1 - 0 = 1 -> P = 1 - Phi(1) = 0.1586553.
    //   load = (0.4042688, 0.2335964), mean 0.3189326, population var = (0.0853362)^2;
    //   cv^2 = 0.0715927.
    // importance: p1 = (sigmoid(1), 1 - sigmoid(1)) = (.7310586, .2689414); imp = (1.2310586,
    //   .7689414), mean 1, cv^2 = .2310586^2 = 0.0533881. v-loss = (0.0533881 + 0.0715927)/2.
    const float l2[] = {0, 0, 1, 0}, n2[] = {.5f, -.5f, 0, 1};
    vlmoe_aux_input in2 = {2, 2, 1, l2, n2, 2.0, NULL, NULL, {0, 0}, NULL};
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_LOAD, &in2, 1, NULL), 0.07159269031380455, 0, tol, "load");
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_IMPORTANCE, &in2, 1, NULL), 0.053388066758518156, 0, tol,
                "importance 2x2");
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_VLOSS, &in2, 1, NULL), 0.06249037853616135, 0, tol,
                "vloss 2x2");
}

// The paper's threshold (issue 20): tau = log(S), S the soft minimum number of experts, and
// tau = 0 is log 1. Eight image tokens all routed to expert 0: logits (0, -50, -50, -50), so
// p = (1 - 3e-22, 1e-22 x3) and H(pbar) = 3 * 1e-22 * 50 < 1e-19, effectively 0.
//   tau = 0:     max(0, 0 - H) = 0. (The old code read 0 as log(number of tokens) = log 8 =
//                2.0794415 and gave 2.079 here.)
//   tau = log 2: log 2 - H = 0.6931472.
// K > 1 target entropy over the text tokens (LIMoE E.1), the audit's case: E=3, K=2, one image
// token with logits (0, -60, -60) (H = 0 to 1e-24) and one text token (0, 0, -60), p = (.5, .5,
// ~0), H = ln 2. Over the text token: (ln 2 - ln 2)^2 = 0. Over both (the old rule): local =
// (0 + ln 2)/2, (ln 2 - ln 2 / 2)^2 = (ln 2)^2 / 4 = 0.1201133.
static void test_aux_paper_values(void) {
    float l[8 * 4];
    for (int s = 0; s < 8; s++) l[s * 4] = 0, l[s * 4 + 1] = l[s * 4 + 2] = l[s * 4 + 3] = -50;
    vlmoe_aux_input in = {8, 4, 1, l, NULL, 1.0, NULL, NULL, {0, 0}, NULL};
    double g = vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_IMAGE, &in, 1, NULL);
    CHECK(g == 0, "tau = 0 = log 1: global entropy %.7g, want 0 (the old log(tokens) rule gave 2.079)", g);
    in.global_tau[0] = log(2.0);
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_GLOBAL_ENT_IMAGE, &in, 1, NULL), log(2.0), 1e-9, 0, "tau = log 2");
    const float l2[6] = {0, -60, -60, 0, 0, -60};
    const uint8_t mod[2] = {VLMOE_MOD_IMAGE, VLMOE_MOD_TEXT};
    vlmoe_aux_input in2 = {2, 3, 2, l2, NULL, 1.0, mod, NULL, {0, 0}, NULL};
    double t = vlmoe_aux_loss(VLMOE_AUX_TARGET_ENT, &in2, 1, NULL);
    CHECK(fabs(t) < 1e-12, "target entropy over the text tokens: %.7g, want 0 (the whole group gave 0.120)", t);
    // with the image token as text too, the old 0.1201133 is back: the loss does see both
    const uint8_t both_text[2] = {VLMOE_MOD_TEXT, VLMOE_MOD_TEXT};
    in2.modality = both_text;
    CHECK_CLOSE(vlmoe_aux_loss(VLMOE_AUX_TARGET_ENT, &in2, 1, NULL), 0.12011325347955035, 0, 1e-6,
                "target entropy, two text tokens");
    // no text token in the group: target and merged entropy are 0
    in2.modality = NULL;
    CHECK(vlmoe_aux_loss(VLMOE_AUX_TARGET_ENT, &in2, 1, NULL) == 0, "target entropy without text");
    CHECK(vlmoe_aux_loss(VLMOE_AUX_MERGED_ENT, &in2, 1, NULL) == 0, "merged entropy without text");
}

// ---------------------------------------------------------------------------------------------
// Finite differences in double

enum { FS = 6, FE = 4, FK = 2 };

// K-th and (K+1)-th largest of x (n) are apart by more than `gap` (no top-k change under h).
static int kth_gap_ok(const double *x, int n, int k, double gap) {
    double a[8];
    memcpy(a, x, (size_t)n * sizeof(double));
    for (int i = 0; i < n; i++) // insertion sort, descending
        for (int j = i; j > 0 && a[j] > a[j - 1]; j--) {
            double t = a[j]; a[j] = a[j - 1]; a[j - 1] = t;
        }
    return a[k - 1] - a[k] > gap;
}

static void test_aux_fd(void) {
    double l[FS * FE], noise[FS * FE], nl[FS * FE];
    vlmoe_rng rng;
    vlmoe_rng_seed(&rng, 7);
    const double noise_std = 1.0;
    for (int i = 0; i < FS * FE; i++) {
        l[i] = 1.5 * vlmoe_rng_normal(&rng);
        noise[i] = noise_std / FE * vlmoe_rng_normal(&rng);
        nl[i] = l[i] + noise[i];
    }
    for (int s = 0; s < FS; s++) {
        CHECK(kth_gap_ok(l + s * FE, FE, FK, 1e-3), "FD input: top-k tie in clean logits, token %d", s);
        CHECK(kth_gap_ok(nl + s * FE, FE, FK, 1e-3), "FD input: top-k tie in noisy logits, token %d", s);
    }
    const uint8_t mod[FS] = {0, 1, 0, 0, 1, 1};
    const int32_t wanted[FE] = {4, 3, 3, 2};
    size_t nscr = aux_scratch_floats(FS, FE);
    double *scr = malloc(nscr * sizeof(double));
    float *scr32 = malloc(nscr * sizeof(float));
    // tau 1.5 > log 4 >= H(pbar): the global losses are active everywhere nearby.
    const int32_t wanted_mod[2 * FE] = {2, 2, 1, 1, 2, 1, 2, 1}; // image row, text row
    aux_input_f64 in = {FS, FE, FK, l, nl, noise_std, mod, wanted, {1.5, 1.5}, wanted_mod, 0};
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
        vlmoe_aux_kind kind = (vlmoe_aux_kind)k;
        const double w = 0.7;
        double g[FS * FE];
        for (int i = 0; i < FS * FE; i++) g[i] = 1.0; // accumulates onto what is there
        double L = aux_loss_f64(kind, &in, w, g, scr);
        CHECK(isfinite(L), "%s: loss %g", vlmoe_aux_name(kind), L);
        double maxerr = 0, maxg = 0;
        int worst = -1;
        for (int i = 0; i < FS * FE; i++) {
            const double h = 1e-5, l0 = l[i];
            // The noisy logit is l + fixed noise: it moves with l (the load threshold path).
            l[i] = l0 + h, nl[i] = l[i] + noise[i];
            double lp = aux_loss_f64(kind, &in, 1, NULL, scr);
            l[i] = l0 - h, nl[i] = l[i] + noise[i];
            double lm = aux_loss_f64(kind, &in, 1, NULL, scr);
            l[i] = l0, nl[i] = l0 + noise[i];
            double fd = w * (lp - lm) / (2 * h), an = g[i] - 1.0;
            double err = fabs(fd - an) / (1e-7 + fabs(fd));
            if (err > maxerr) maxerr = err, worst = i;
            if (fabs(an) > maxg) maxg = fabs(an);
        }
        CHECK(maxerr < 1e-5, "%s: finite differences differ, max rel err %.3g at logit %d",
              vlmoe_aux_name(kind), maxerr, worst);
        CHECK(maxg > 1e-4, "%s: gradient is (nearly) zero, max %g", vlmoe_aux_name(kind), maxg);
        // The float path agrees with the double one.
        float lf[FS * FE], nf[FS * FE], gf[FS * FE] = {0};
        for (int i = 0; i < FS * FE; i++) lf[i] = (float)l[i], nf[i] = (float)nl[i];
        aux_input_f32 in32 = {FS, FE, FK, lf, nf, noise_std, mod, wanted, {1.5, 1.5}, wanted_mod, 0};
        double L32 = aux_loss_f32(kind, &in32, w, gf, scr32);
        CHECK_CLOSE(L32, L, 1e-6, 1e-5, vlmoe_aux_name(kind));
        double ge = 0;
        for (int i = 0; i < FS * FE; i++) {
            double d = fabs(gf[i] - (g[i] - 1.0));
            if (d > ge) ge = d;
        }
        CHECK(ge < 1e-5 * (1 + maxg), "%s: float gradient differs by %g", vlmoe_aux_name(kind), ge);
    }
    // An inactive global entropy (tau below the entropy) contributes exactly nothing.
    in.global_tau[0] = in.global_tau[1] = 0.1;
    for (int k = VLMOE_AUX_GLOBAL_ENT_IMAGE; k <= VLMOE_AUX_GLOBAL_ENT_TEXT; k++) {
        double g[FS * FE] = {0}, L = aux_loss_f64((vlmoe_aux_kind)k, &in, 1, g, scr), mx = 0;
        for (int i = 0; i < FS * FE; i++) mx = fmax(mx, fabs(g[i]));
        CHECK(L == 0 && mx == 0, "inactive %s: loss %g, max grad %g", vlmoe_aux_name(k), L, mx);
    }
    free(scr), free(scr32);
}

// ---------------------------------------------------------------------------------------------
// PyTorch fixture (tests/ref/gen_moe_aux.py)

enum { XS = 12, XE = 4, XK = 2 };

static int read_t(vlmoe_st *f, const char *name, float *dst, size_t n) {
    int st = vlmoe_st_read_f32(f, name, dst, n);
    CHECK(st == VLMOE_OK, "fixture %s: %s", name, vlmoe_last_error());
    return st;
}

static void test_aux_fixture(void) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/moe_aux.safetensors", fixture_dir());
    vlmoe_st *f = NULL;
    if (vlmoe_st_open(path, &f) != VLMOE_OK) {
        printf("test_moe_route: %s not found, PyTorch comparison skipped (make fixtures)\n", path);
        return;
    }
    float l[XS * XE], nl[XS * XE], modf[XS], wantf[XE], wmf[2 * XE], tau[2], nstd[1];
    if (read_t(f, "logits", l, XS * XE) || read_t(f, "noisy_logits", nl, XS * XE) ||
        read_t(f, "modality", modf, XS) || read_t(f, "wanted", wantf, XE) ||
        read_t(f, "wanted_mod", wmf, 2 * XE) ||
        read_t(f, "global_tau", tau, 2) || read_t(f, "noise_std", nstd, 1)) {
        vlmoe_st_close(f);
        return;
    }
    uint8_t mod[XS];
    int32_t wanted[XE], wanted_mod[2 * XE];
    for (int s = 0; s < XS; s++) mod[s] = (uint8_t)modf[s];
    for (int e = 0; e < XE; e++) wanted[e] = (int32_t)wantf[e];
    for (int e = 0; e < 2 * XE; e++) wanted_mod[e] = (int32_t)wmf[e];
    vlmoe_aux_input in = {XS, XE, XK, l, nl, nstd[0], mod, wanted, {tau[0], tau[1]}, wanted_mod};
    // The double path on the same float inputs, for a tighter comparison.
    double ld[XS * XE], nld[XS * XE];
    for (int i = 0; i < XS * XE; i++) ld[i] = l[i], nld[i] = nl[i];
    aux_input_f64 in64 = {XS, XE, XK, ld, nld, nstd[0], mod, wanted, {tau[0], tau[1]}, wanted_mod, 0};
    double *scr = malloc(aux_scratch_floats(XS, XE) * sizeof(double));
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) {
        const char *nm = vlmoe_aux_name((vlmoe_aux_kind)k);
        char key[128];
        float ref_l[1], ref_g[XS * XE], g[XS * XE] = {0};
        double g64[XS * XE] = {0};
        snprintf(key, sizeof(key), "%s.loss", nm);
        if (read_t(f, key, ref_l, 1)) continue;
        snprintf(key, sizeof(key), "%s.dlogits", nm);
        if (read_t(f, key, ref_g, XS * XE)) continue;
        double L = vlmoe_aux_loss((vlmoe_aux_kind)k, &in, 1, g);
        double L64 = aux_loss_f64((vlmoe_aux_kind)k, &in64, 1, g64, scr);
        CHECK_CLOSE(L, ref_l[0], 1e-7, 1e-5, nm);
        CHECK_CLOSE(L64, ref_l[0], 1e-7, 1e-6, nm);
        double gmax = 0, e32 = 0, e64 = 0;
        int w32 = 0;
        for (int i = 0; i < XS * XE; i++) gmax = fmax(gmax, fabs(ref_g[i]));
        for (int i = 0; i < XS * XE; i++) {
            double d32 = fabs(g[i] - ref_g[i]) / (1e-6 * gmax + fabs(ref_g[i]));
            double d64 = fabs(g64[i] - ref_g[i]) / (1e-6 * gmax + fabs(ref_g[i]));
            if (d32 > e32) e32 = d32, w32 = i;
            e64 = fmax(e64, d64);
        }
        CHECK(e32 < 1e-4 && e64 < 1e-5, "%s.dlogits vs torch: max rel err float %.3g (at %d: %g vs "
              "%g), double %.3g", nm, e32, w32, g[w32], ref_g[w32], e64);
    }
    free(scr);
    vlmoe_st_close(f);
}

int main(void) {
    test_capacity();
    test_fifo_vs_bpr();
    test_k2();
    test_bpr_sum_and_renorm();
    test_random_order();
    test_experts_choice();
    test_route_errors();
    test_aux_values();
    test_aux_paper_values();
    test_aux_fd();
    test_aux_fixture();
    return test_summary("test_moe_route");
}
