// test_route_op.c: routing as an op of the backend table (be_route, src/moe/route_op.c). The MoE
// layer's path through the op on a table without host memory (tests/sep_mem.h) must equal its
// host path (gates downloaded, route.c on the host, the layout uploaded) bit for bit: losses,
// gradients, parameters, routing statistics and the per-token decision over 3 training steps of
// limoe-tiny, ec-tiny, clipup-tiny and variants (top-2 with renormalisation, BPR on the summed
// gates, FIFO, disjoint pools, gradient checkpointing), and a step on the op path must fetch no
// gates (only the experts' row offsets) until the statistics are read. The fixed-capacity layout
// (be_route.fixed, wanted by the table) against the packed one through the same op: a step
// downloads nothing, and losses, gradients and parameters agree within 2e-6 of each array's
// largest value (padding rows change the expert products' row counts, so the dW sums may add in
// another order). Then the op's packed and fixed layouts against ones rebuilt from its own
// decision, on shapes with ties and overflow, and a wrong padding row that the check catches.
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "moe/route_op.h"
#include "nn/model.h"
#include "sep_mem.h"
#include "test.h"

// every field of the statistics that routing decides, as doubles (routed/accepted: E each)
static size_t stats_flat(const vlmoe_moe_stats *ms, int nl, double *out) {
    size_t k = 0;
    for (int l = 0; l < nl; l++) {
        const vlmoe_moe_stats *s = &ms[l];
        for (int m = 0; m < 2; m++) {
            out[k++] = s->tokens[m], out[k++] = s->success[m], out[k++] = s->dropped[m];
            out[k++] = s->mean_max_gate[m], out[k++] = s->entropy_pre[m], out[k++] = s->entropy_post[m];
            out[k++] = s->experts_used[m], out[k++] = s->entropy_token[m];
            for (int c = 0; c < 3; c++) out[k++] = s->experts_cover[m][c];
            for (int e = 0; e < s->num_experts; e++)
                out[k++] = s->routed[m] ? s->routed[m][e] : -1, out[k++] = s->accepted[m] ? s->accepted[m][e] : -1;
        }
        for (int a = 0; a < VLMOE_AUX_COUNT; a++) out[k++] = s->aux[a];
        out[k++] = s->capacity;
    }
    return k;
}

static int same_route(const vlmoe_token_route *a, const vlmoe_token_route *b) {
    return a->token == b->token && a->example == b->example && a->position == b->position && a->group == b->group &&
           a->group_pos == b->group_pos && a->rank == b->rank && a->expert == b->expert && a->slot == b->slot &&
           !memcmp(&a->gate, &b->gate, sizeof(float)) && !memcmp(&a->weight, &b->weight, sizeof(float)) &&
           a->modality == b->modality && a->dropped == b->dropped;
}

// max |a - b| over max |a|: the gap between two runs relative to the array's scale
static double rel_gap(const float *a, const float *b, size_t n) {
    double d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fabs((double)a[i] - b[i]) > d ? fabs((double)a[i] - b[i]) : d;
        m = fabs((double)a[i]) > m ? fabs((double)a[i]) : m;
    }
    return m > 0 ? d / m : d;
}

// The bound of the fixed layout against the packed one (see the top), and the largest gap seen.
#define FIXED_REL 2e-6
static double fixed_worst;

// Model 0 routes on the host (the table says it cannot), model 1 through the table's route op.
// fixed: model 0 through the op in the packed layout, model 1 in the fixed-capacity layout.
static void paths_check(const char *label, const vlmoe_model_config *c, int ckpt, int fixed) {
    vlmoe_backend_f32 dev = sep_table();
    vlmoe_model *m[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c->image_size;
    vlmoe_train_params tp = vlmoe_train_default_params();
    const int B = 6, T = c->context_length;
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    float *img = malloc(sizeof(float) * isz * B), *e[2] = {malloc(sizeof(float) * B * c->embed_dim),
                                                           malloc(sizeof(float) * B * c->embed_dim)};
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *len = malloc(sizeof(int32_t) * B);
    double *fs[2] = {malloc(sizeof(double) * 100000), malloc(sizeof(double) * 100000)};
    int st = vlmoe_synth_init(&s, &sp);
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_model_init(&m[k], c, 5);
        if (!st) st = model_set_backend(m[k], &dev, NULL);
        if (!st && ckpt) st = vlmoe_model_set_grad_checkpointing(m[k], 1);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    CHECK(st == VLMOE_OK, "%s: %s", label, vlmoe_last_error());
    long fetched[2] = {0, 0}, fetched_bytes[2] = {0, 0};
    int nmoe = 0;
    for (int step = 0; step < 3 && !st; step++) {
        vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, (uint64_t)step * B, B, T, img, tok, len);
        const vlmoe_batch b = {B, img, tok, len};
        double loss[2] = {0, 0};
        size_t nf[2] = {0, 0};
        for (int k = 0; k < 2 && !st; k++) {
            sep_no_route = k == 0 && !fixed; // asked when the graph creates its MoE layers
            sep_fixed = k == 1 && fixed;
            vlmoe_step_stats ss;
            const long d0 = sep_ndownload, b0 = sep_ndownload_bytes;
            st = vlmoe_trainer_step(t[k], &b, &ss);
            fetched[k] = sep_ndownload - d0, fetched_bytes[k] = sep_ndownload_bytes - b0;
            loss[k] = ss.loss;
            const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m[k], &nmoe);
            nf[k] = stats_flat(ms, nmoe, fs[k]);
        }
        CHECK(st == VLMOE_OK, "%s step %d: %s", label, step + 1, vlmoe_last_error());
        if (st) break;
        if (fixed) {
            const double gl = fabs(loss[0] - loss[1]) / fabs(loss[0]);
            // resident on separate memory: the host copies are mirrors, read through the API
            const double gg = rel_gap(vlmoe_model_grad_data(m[0]), vlmoe_model_grad_data(m[1]), m[0]->L.total);
            const double gp = rel_gap(vlmoe_model_param_data(m[0]), vlmoe_model_param_data(m[1]), m[0]->L.total);
            printf("%s step %d: fixed vs packed layout: loss %.3g, gradients %.3g, parameters %.3g (relative)\n",
                   label, step + 1, gl, gg, gp);
            fixed_worst = gl > fixed_worst ? gl : fixed_worst, fixed_worst = gg > fixed_worst ? gg : fixed_worst;
            fixed_worst = gp > fixed_worst ? gp : fixed_worst;
            CHECK(gl <= FIXED_REL && gg <= FIXED_REL && gp <= FIXED_REL, "%s step %d: the fixed layout is %.3g, %.3g, "
                  "%.3g from the packed one in loss, gradients, parameters (bound %g)", label, step + 1, gl, gg, gp,
                  FIXED_REL);
            // a training step's MoE layers download nothing: no row offsets, and no more floats
            // than the packed op path (which fetches no gates)
            if (!ckpt)
                CHECK(fetched_bytes[0] == nmoe && fetched_bytes[1] == 0 && fetched[1] == fetched[0],
                      "%s step %d: packed %ld byte + %ld float downloads, fixed %ld + %ld (want %d + n, 0 + n)", label,
                      step + 1, fetched_bytes[0], fetched[0], fetched_bytes[1], fetched[1], nmoe);
            continue;
        }
        CHECK(!memcmp(&loss[0], &loss[1], sizeof(double)), "%s step %d: loss %.17g (host routing) vs %.17g (route op)",
              label, step + 1, loss[0], loss[1]);
        CHECK(!memcmp(m[0]->grads, m[1]->grads, sizeof(float) * m[0]->L.total),
              "%s step %d: gradients differ between host routing and the route op", label, step + 1);
        CHECK(nf[0] == nf[1] && !memcmp(fs[0], fs[1], sizeof(double) * nf[0]),
              "%s step %d: routing statistics differ between host routing and the route op", label, step + 1);
        // the op path fetched the row offsets of each MoE layer and no gates: the host path's two
        // gate downloads per layer (gates, clean probabilities) are gone
        if (!ckpt) {
            CHECK(fetched_bytes[0] == 0 && fetched_bytes[1] == nmoe,
                  "%s step %d: %ld and %ld byte downloads (want 0 on the host path, one per MoE layer = %d)", label,
                  step + 1, fetched_bytes[0], fetched_bytes[1], nmoe);
            CHECK(fetched[0] - fetched[1] == 2L * nmoe, "%s step %d: %ld float downloads on the host path, %ld through "
                  "the route op (want %d fewer)", label, step + 1, fetched[0], fetched[1], 2 * nmoe);
        }
    }
    // the per-token decision of every layer (the fixed layout's: its experts and slots, the
    // gates and weights within its bound)
    for (int l = 0; l < nmoe && !st && fixed; l++) {
        int n[2] = {0, 0}, same = 1;
        vlmoe_token_route *r[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++) {
            vlmoe_model_routing(m[k], l, NULL, 0, &n[k]);
            r[k] = calloc((size_t)n[k] + 1, sizeof(vlmoe_token_route));
            vlmoe_model_routing(m[k], l, r[k], n[k], &n[k]);
        }
        same = n[0] == n[1] && n[0] > 0;
        for (int i = 0; same && i < n[0]; i++)
            same = r[0][i].token == r[1][i].token && r[0][i].expert == r[1][i].expert && r[0][i].slot == r[1][i].slot &&
                   r[0][i].dropped == r[1][i].dropped && fabsf(r[0][i].gate - r[1][i].gate) <= 1e-5f &&
                   fabsf(r[0][i].weight - r[1][i].weight) <= 1e-5f;
        CHECK(same, "%s layer %d: the fixed layout's per-token decisions differ (%d and %d entries)", label, l, n[0], n[1]);
        free(r[0]), free(r[1]);
    }
    for (int l = 0; l < nmoe && !st && !fixed; l++) {
        int n[2] = {0, 0};
        vlmoe_token_route *r[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++) {
            vlmoe_model_routing(m[k], l, NULL, 0, &n[k]);
            r[k] = calloc((size_t)n[k] + 1, sizeof(vlmoe_token_route));
            vlmoe_model_routing(m[k], l, r[k], n[k], &n[k]);
        }
        int same = n[0] == n[1] && n[0] > 0;
        for (int i = 0; same && i < n[0]; i++) same = same_route(&r[0][i], &r[1][i]);
        CHECK(same, "%s layer %d: the per-token decisions differ (%d and %d entries)", label, l, n[0], n[1]);
        free(r[0]), free(r[1]);
    }
    // both run resident on separate memory: their host copies are mirrors, read through the API
    CHECK(fixed || (!st && !memcmp(vlmoe_model_param_data(m[0]), vlmoe_model_param_data(m[1]),
                                   sizeof(float) * m[0]->L.total)),
          "%s: parameters after 3 steps differ between host routing and the route op", label);
    for (int k = 0; k < 2 && !st; k++) sep_no_route = k == 0 && !fixed, st = vlmoe_model_encode_images(m[k], img, B, e[k]);
    const double ge = st ? 1 : rel_gap(e[0], e[1], (size_t)B * c->embed_dim);
    CHECK(!st && (fixed ? ge <= FIXED_REL : ge == 0), "%s: image embeddings (eval capacity) differ by %.3g: %s", label,
          ge, vlmoe_last_error());
    CHECK(sep_stray == 0, "%s: %d host pointers handed to the table; first: %s", label, sep_stray, sep_first);
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]), free(e[k]), free(fs[k]);
    vlmoe_synth_free(s);
    free(img), free(tok), free(len);
    sep_no_route = sep_fixed = 0;
    CHECK(sep_nblocks == 0, "%s: %d blocks of separate memory not freed", label, sep_nblocks);
}

static void layer_paths(void) {
    vlmoe_model_config c;
    const char *names[] = {"limoe-tiny", "ec-tiny", "clipup-tiny"};
    for (int i = 0; i < 3; i++) {
        CHECK(vlmoe_config_named(names[i], &c) == VLMOE_OK, "%s: %s", names[i], vlmoe_last_error());
        paths_check(names[i], &c, 0, 0);
        char lab[80];
        snprintf(lab, sizeof(lab), "%s, fixed layout", names[i]);
        paths_check(lab, &c, 0, 1);
    }
    vlmoe_config_named("limoe-tiny", &c); // top-2, renormalised, BPR on the summed gates
    c.moe.top_k = 2, c.moe.gate_renorm = VLMOE_RENORM_AFTER_ROUTING, c.moe.bpr_score = VLMOE_BPR_SUM;
    c.moe.capacity_factor = 0.5; // overflow: tokens dropped
    paths_check("limoe-tiny top-2 renorm bpr-sum cf 0.5", &c, 0, 0);
    paths_check("limoe-tiny top-2 renorm bpr-sum cf 0.5, fixed layout", &c, 0, 1);
    vlmoe_config_named("limoe-tiny", &c);
    c.moe.order = VLMOE_ORDER_FIFO, c.moe.text_experts = 2, c.moe.router_per_modality = 1;
    paths_check("limoe-tiny fifo, disjoint pools", &c, 0, 0);
    paths_check("limoe-tiny fifo, disjoint pools, fixed layout", &c, 0, 1);
    vlmoe_config_named("clipup-tiny", &c);
    paths_check("clipup-tiny, gradient checkpointing", &c, 1, 0);
    paths_check("clipup-tiny, gradient checkpointing, fixed layout", &c, 1, 1);
    vlmoe_config_named("ec-tiny", &c);
    paths_check("ec-tiny, gradient checkpointing", &c, 1, 0);
    printf("fixed vs packed layout: largest relative gap %.3g (bound %g)\n", fixed_worst, FIXED_REL);
}

// ---- the op itself: its packed layout against one rebuilt from its own decision

typedef struct {
    int32_t expert[512], slot[512], token[2048], count[64], wanted[192], row_token[512], row_expert[512];
    int32_t tok_rows[512], tok_off[257], expert_off[17];
    float weight[2048];
    uint8_t dropped[256];
    char work[8192];
} route_bufs;

static be_route_out outs_of(route_bufs *b) {
    return (be_route_out){.expert = b->expert, .slot = b->slot, .token = b->token, .weight = b->weight,
                          .count = b->count, .wanted = b->wanted, .dropped = b->dropped, .row_token = b->row_token,
                          .row_expert = b->row_expert, .tok_rows = b->tok_rows, .tok_off = b->tok_off,
                          .expert_off = b->expert_off, .rows_max = 512, .work = b->work};
}

// What the layout must be given the decision (route.c's, per group), built the plain way.
static int layout_ok(const be_route *r, const route_bufs *b, char *why, size_t cap) {
    const int E = r->E, C = r->C, S = r->S, n = r->n;
    int row = 0;
    for (int e = 0; e < E; e++) {
        if (b->expert_off[e] != row) return snprintf(why, cap, "expert_off[%d] = %d, want %d", e, b->expert_off[e], row), 0;
        for (int g = 0; g < r->G; g++)
            for (int c = 0; c < b->count[g * E + e]; c++, row++) {
                const int p = g * S + b->token[(g * E + e) * C + c], want = r->pos_row ? r->pos_row[p] : p;
                if (b->row_token[row] != want || b->row_expert[row] != e)
                    return snprintf(why, cap, "row %d: token %d expert %d, want %d %d", row, b->row_token[row],
                                    b->row_expert[row], want, e), 0;
            }
    }
    if (b->expert_off[E] != row) return snprintf(why, cap, "expert_off[E] = %d, want %d", b->expert_off[E], row), 0;
    int j = 0;
    for (int t = 0; t < n; t++) {
        if (b->tok_off[t] != j) return snprintf(why, cap, "tok_off[%d] = %d, want %d", t, b->tok_off[t], j), 0;
        for (int q = 0; q < row; q++)
            if (b->row_token[q] == t && b->tok_rows[j++] != q)
                return snprintf(why, cap, "token %d: tok_rows[%d] = %d, want %d", t, j - 1, b->tok_rows[j - 1], q), 0;
    }
    if (b->tok_off[n] != row) return snprintf(why, cap, "tok_off[n] = %d, want %d", b->tok_off[n], row), 0;
    for (int g = 0; !r->experts_choice && g < r->G; g++)
        for (int e = 0; e < E; e++) {
            const int32_t *w = b->wanted + (size_t)g * 3 * E;
            if (w[E + e] + w[2 * E + e] != w[e])
                return snprintf(why, cap, "group %d expert %d: per-modality wanted %d + %d != %d", g, e, w[E + e],
                                w[2 * E + e], w[e]), 0;
        }
    return 1;
}

// The fixed-capacity layout given the decision: row e G C + g C + c holds slot c of (g, e), -1
// where the slot is empty; each token's filled rows in row order, and no padding row listed.
static int layout_fixed_ok(const be_route *r, const route_bufs *b, char *why, size_t cap) {
    const int E = r->E, C = r->C, S = r->S, G = r->G, n = r->n, rows = G * E * C;
    for (int e = 0; e <= E; e++)
        if (b->expert_off[e] != e * G * C)
            return snprintf(why, cap, "expert_off[%d] = %d, want %d", e, b->expert_off[e], e * G * C), 0;
    for (int e = 0; e < E; e++)
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) {
                const int row = e * G * C + g * C + c, filled = c < b->count[g * E + e];
                const int p = filled ? g * S + b->token[(g * E + e) * C + c] : -1;
                const int want = !filled ? -1 : r->pos_row ? r->pos_row[p] : p;
                if (b->row_token[row] != want || b->row_expert[row] != e)
                    return snprintf(why, cap, "row %d: token %d expert %d, want %d %d", row, b->row_token[row],
                                    b->row_expert[row], want, e), 0;
            }
    int j = 0;
    for (int t = 0; t < n; t++) {
        if (b->tok_off[t] != j) return snprintf(why, cap, "tok_off[%d] = %d, want %d", t, b->tok_off[t], j), 0;
        for (int q = 0; q < rows; q++)
            if (b->row_token[q] == t && b->tok_rows[j++] != q)
                return snprintf(why, cap, "token %d: tok_rows[%d] = %d, want %d", t, j - 1, b->tok_rows[j - 1], q), 0;
    }
    if (b->tok_off[n] != j) return snprintf(why, cap, "tok_off[n] = %d, want %d", b->tok_off[n], j), 0;
    return 1;
}

static void op_layout(void) {
    const vlmoe_backend_f32 *cpu = backend_cpu_f32();
    vlmoe_rng rng;
    vlmoe_rng_seed(&rng, 7);
    route_bufs *b = calloc(1, sizeof(*b));
    float gates[256 * 8];
    int32_t perm[256];
    uint8_t mod[256];
    int npad = 0; // cases with a padding row (the control needs one)
    for (int cs = 0; cs < 6; cs++) {
        const int G = 4, S = 32, E = 8, n = G * S;
        // coarse gates: many exact ties between experts and between tokens' BPR keys
        for (int i = 0; i < n * E; i++) gates[i] = (float)vlmoe_rng_below(&rng, 4) / 8;
        for (int i = 0; i < n; i++) perm[i] = i, mod[i] = (uint8_t)(i % S >= 20);
        for (int i = n - 1; i > 0; i--) {
            int k = (int)vlmoe_rng_below(&rng, (uint32_t)i + 1), t = perm[i];
            perm[i] = perm[k], perm[k] = t;
        }
        be_route r = {.n = n, .S = S, .G = G, .E = E, .K = 1 + cs % 2, .C = cs < 2 ? 3 : 8,
                      .experts_choice = cs == 4, .order = cs == 3 ? VLMOE_ORDER_FIFO : VLMOE_ORDER_BPR,
                      .bpr_score = cs == 2 ? VLMOE_BPR_SUM : VLMOE_BPR_MAX, .gate_renorm = cs == 1,
                      .pruned = cs == 5 ? 0x21 : 0, .pools = cs == 3, .pool = {{0, 6}, {6, 2}},
                      .pos_row = cs >= 2 ? perm : NULL, .mod = mod};
        if (r.experts_choice) r.K = 1;
        const be_route_out o = outs_of(b);
        memset(b, 0x5a, sizeof(*b));
        int st = cpu->route(cpu, gates, &r, &o);
        CHECK(st == VLMOE_OK, "route case %d: %s", cs, vlmoe_last_error());
        char why[200] = "";
        CHECK(!st && layout_ok(&r, b, why, sizeof(why)), "route case %d: %s", cs, why);
        // route.c itself decided: group 1 again through route.c on the masked gates
        vlmoe_routing ref;
        vlmoe_routing_alloc(&ref, S, E, r.K, r.C);
        float gf[32 * 8];
        for (int i = 0; i < S; i++)
            for (int e = 0; e < E; e++) {
                const int p = S + i, row = r.pos_row ? r.pos_row[p] : p;
                const int lo = r.pools ? r.pool[mod[p]][0] : 0, hi = r.pools ? lo + r.pool[mod[p]][1] : E;
                gf[i * E + e] = (r.pruned >> e & 1) || e < lo || e >= hi ? -1.0f : gates[row * E + e];
            }
        vlmoe_route_params rp = {r.K, r.C, r.order, r.bpr_score, r.gate_renorm, 0};
        st = r.experts_choice ? vlmoe_route_experts_choice(gf, S, E, r.C, &ref) : vlmoe_route_tokens_choice(gf, S, E, &rp, &ref);
        CHECK(!st && !memcmp(ref.token, b->token + E * r.C, sizeof(int32_t) * E * r.C) &&
              !memcmp(ref.weight, b->weight + E * r.C, sizeof(float) * E * r.C) &&
              !memcmp(ref.count, b->count + E, sizeof(int32_t) * E) &&
              (r.experts_choice || !memcmp(ref.slot, b->slot + S * r.K, sizeof(int32_t) * S * r.K)),
              "route case %d: group 1 is not route.c's decision", cs);
        int masked = 0;
        for (int i = 0; !r.experts_choice && i < S * r.K; i++) {
            const int e = ref.expert[i];
            masked += (r.pruned >> e & 1) != 0;
        }
        CHECK(masked == 0, "route case %d: %d choices of pruned experts", cs, masked);
        vlmoe_routing_free(&ref);
        // the fixed-capacity layout of the same call: the same decision, every slot a row
        route_bufs *f = malloc(sizeof(*f));
        memset(f, 0x5a, sizeof(*f));
        const be_route_out of = outs_of(f);
        r.fixed = 1;
        st = cpu->route(cpu, gates, &r, &of);
        CHECK(st == VLMOE_OK, "route case %d, fixed layout: %s", cs, vlmoe_last_error());
        const size_t gec = (size_t)G * E * r.C;
        CHECK(!st && !memcmp(f->expert, b->expert, sizeof(int32_t) * n * r.K) &&
              !memcmp(f->slot, b->slot, sizeof(int32_t) * n * r.K) && !memcmp(f->token, b->token, sizeof(int32_t) * gec) &&
              !memcmp(f->weight, b->weight, sizeof(float) * gec) && !memcmp(f->count, b->count, sizeof(int32_t) * G * E) &&
              !memcmp(f->wanted, b->wanted, sizeof(int32_t) * 3 * G * E) && !memcmp(f->dropped, b->dropped, n),
              "route case %d: the fixed layout changed the decision", cs);
        CHECK(!st && layout_fixed_ok(&r, f, why, sizeof(why)), "route case %d, fixed layout: %s", cs, why);
        // the control: a padding row that names a token instead of -1 is caught
        int pad = -1;
        for (int q = 0; q < (int)gec && pad < 0; q++) pad = f->row_token[q] < 0 ? q : -1;
        if (pad >= 0) {
            f->row_token[pad] = 0;
            CHECK(!layout_fixed_ok(&r, f, why, sizeof(why)), "route case %d: a wrong padding row went unseen", cs);
            npad++;
        }
        free(f);
    }
    CHECK(npad >= 3, "only %d route cases had a padding row for the control", npad);
    // more rows than planned is an error naming the bound, never a write past it
    be_route r = {.n = 32, .S = 32, .G = 1, .E = 8, .K = 2, .C = 8, .order = VLMOE_ORDER_BPR};
    be_route_out o = outs_of(b);
    o.rows_max = 10;
    CHECK(cpu->route(cpu, gates, &r, &o) != VLMOE_OK && strstr(vlmoe_last_error(), "exceed the 10"),
          "rows past rows_max: %s", vlmoe_last_error());
    r.fixed = 1, o.rows_max = 63; // 1 x 8 x 8 fixed rows
    CHECK(cpu->route(cpu, gates, &r, &o) != VLMOE_OK && strstr(vlmoe_last_error(), "fixed-capacity rows exceed the 63"),
          "fixed rows past rows_max: %s", vlmoe_last_error());
    free(b);
}

int main(void) {
    op_layout();
    layer_paths();
    return test_summary("test_route_op");
}
