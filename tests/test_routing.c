// test_routing.c: vlmoe_model_routing (include/vlmoe.h, src/nn/routing.c), the per-token routing
// decision of the last forward: it agrees with the routing statistics (tokens, success, drops,
// each expert's share), every expert's accepted slots are 0..count-1 in each group, one-tower
// groups hold whole examples (image tokens first, or text first), one-modality passes group
// consecutive examples, and the errors (no forward, bad index, small buffer, Soft MoE). The
// hand-worked decision of one layer is in tests/test_moe_layer.c (test_golden_groups).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "vlmoe.h"

typedef struct {
    vlmoe_synth *data;
    float *img;
    int32_t *tok, *lens;
} batchbuf;

static void batch_init(batchbuf *b, const vlmoe_model_config *c, int B) {
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c->image_size;
    vlmoe_synth_init(&b->data, &sp);
    b->img = malloc(sizeof(float) * (size_t)B * 3 * c->image_size * c->image_size);
    b->tok = malloc(sizeof(int32_t) * (size_t)B * c->context_length);
    b->lens = malloc(sizeof(int32_t) * B);
    vlmoe_synth_batch(b->data, VLMOE_SPLIT_TRAIN, 0, B, c->context_length, b->img, b->tok, b->lens);
}

static void batch_free(batchbuf *b) {
    vlmoe_synth_free(b->data);
    free(b->img), free(b->tok), free(b->lens);
}

// The entries of every MoE layer against its statistics; k examples per group, ti / tt image and
// text tokens per example in this pass (0: absent), B examples.
static void check_layers(vlmoe_model *m, const char *what, int B, int ti, int tt, int k, int text_first) {
    int nl = 0;
    const vlmoe_moe_stats *st = vlmoe_model_moe_stats(m, &nl);
    for (int l = 0; l < nl; l++) {
        const int E = st[l].num_experts;
        int n = -1;
        CHECK(vlmoe_model_routing(m, l, NULL, 0, &n) == VLMOE_OK && n > 0, "%s layer %d: count: %s", what, l,
              vlmoe_last_error());
        vlmoe_token_route *r = malloc(sizeof(*r) * (size_t)(n > 0 ? n : 1));
        int n2 = -1;
        CHECK(vlmoe_model_routing(m, l, r, n, &n2) == VLMOE_OK && n2 == n, "%s layer %d: %s", what, l, vlmoe_last_error());
        double tokens[2] = {0, 0}, ok[2] = {0, 0}, assign[2] = {0, 0}, drop[2] = {0, 0};
        double *acc = calloc((size_t)2 * E, sizeof(double)), *routed = calloc((size_t)2 * E, sizeof(double));
        int *slots = calloc((size_t)B * E * 64, sizeof(int)), bad = 0, badslot = 0;
        int last = -1, hit = 0;
        for (int i = 0; i < n; i++) {
            const vlmoe_token_route *e = &r[i];
            const int mo = e->modality;
            if (e->token != last) { // a new token: its first entry
                if (last >= 0) ok[r[i - 1].modality] += hit > 0;
                last = e->token, hit = 0;
                tokens[mo]++;
            }
            hit += !e->dropped;
            assign[mo]++, drop[mo] += e->dropped;
            if (e->expert >= 0) routed[mo * E + e->expert]++;
            if (!e->dropped) acc[mo * E + e->expert]++;
            // where the token sits: images then texts; its group holds k whole examples
            const int img = e->token < B * ti;
            const int ex = img ? e->token / ti : (e->token - B * ti) / tt;
            const int pos = img ? e->token % ti : (e->token - B * ti) % tt;
            const int first = img != text_first ? 0 : (text_first ? tt : ti) * k;
            const int gpos = first + (ex % k) * (img ? ti : tt) + pos;
            if (mo != !img || e->example != ex || e->position != pos || e->group != ex / k || e->group_pos != gpos)
                bad++;
            if (!e->dropped && (e->weight != e->gate || e->slot < 0 || e->slot >= 64)) bad++;
            if (!e->dropped && e->slot >= 0 && e->slot < 64) {
                int *sl = &slots[((size_t)e->group * E + e->expert) * 64 + e->slot];
                badslot += *sl, *sl = 1;
            }
        }
        if (last >= 0) ok[r[n - 1].modality] += hit > 0;
        CHECK(!bad, "%s layer %d: %d entries disagree with their example, group or weight", what, l, bad);
        CHECK(!badslot, "%s layer %d: %d slots taken twice", what, l, badslot);
        // each expert's slots in a group are 0..count-1
        for (int gx = 0; gx < B; gx++)
            for (int e = 0; e < E; e++) {
                int c = 0;
                while (c < 64 && slots[((size_t)gx * E + e) * 64 + c]) c++;
                for (int j = c; j < 64; j++) badslot += slots[((size_t)gx * E + e) * 64 + j];
            }
        CHECK(!badslot, "%s layer %d: an expert's slots have a gap", what, l);
        for (int mo = 0; mo < 2; mo++) {
            CHECK(tokens[mo] == st[l].tokens[mo], "%s layer %d: %g tokens of modality %d, stats %d", what, l,
                  tokens[mo], mo, st[l].tokens[mo]);
            if (!tokens[mo]) continue;
            CHECK(fabs(ok[mo] / tokens[mo] - st[l].success[mo]) < 1e-12, "%s layer %d: success %g vs stats %g", what,
                  l, ok[mo] / tokens[mo], st[l].success[mo]);
            CHECK(fabs(drop[mo] / assign[mo] - st[l].dropped[mo]) < 1e-12, "%s layer %d: dropped %g vs stats %g",
                  what, l, drop[mo] / assign[mo], st[l].dropped[mo]);
            double ra = 0;
            for (int e = 0; e < E; e++) ra += routed[mo * E + e];
            for (int e = 0; e < E; e++) {
                CHECK(fabs(acc[mo * E + e] / tokens[mo] - st[l].accepted[mo][e]) < 1e-12 &&
                          fabs(routed[mo * E + e] / ra - st[l].routed[mo][e]) < 1e-12,
                      "%s layer %d modality %d expert %d: accepted %g routed %g, stats %g %g", what, l, mo, e,
                      acc[mo * E + e] / tokens[mo], routed[mo * E + e] / ra, st[l].accepted[mo][e], st[l].routed[mo][e]);
            }
        }
        if (n > 1) { // a buffer one entry short is refused, nothing written
            r[0].token = -7;
            CHECK(vlmoe_model_routing(m, l, r, n - 1, &n2) == VLMOE_ERR_ARG && r[0].token == -7 &&
                      strstr(vlmoe_last_error(), "entries needed"), "%s layer %d: short buffer: %s", what, l,
                  vlmoe_last_error());
        }
        free(r), free(acc), free(routed), free(slots);
    }
}

static void test_limoe(int text_first) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    c.moe.group_size = 2 * 32; // two examples of 16 patches and 16 text tokens
    c.moe.text_first = text_first;
    c.moe.capacity_factor = 1.0; // some tokens are dropped
    vlmoe_model *m;
    CHECK(vlmoe_model_init(&m, &c, 5) == VLMOE_OK, "init: %s", vlmoe_last_error());
    int n = -1;
    CHECK(vlmoe_model_routing(m, 0, NULL, 0, &n) == VLMOE_ERR_ARG && n == 0 && strstr(vlmoe_last_error(), "no tokens"),
          "before any forward: %s", vlmoe_last_error());
    batchbuf b;
    batch_init(&b, &c, 8);
    vlmoe_batch bt = {8, b.img, b.tok, b.lens};
    vlmoe_step_stats s;
    CHECK(vlmoe_model_forward(m, &bt, &s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
    check_layers(m, text_first ? "limoe text first" : "limoe", 8, 16, 16, 2, text_first);
    int nl;
    vlmoe_model_moe_stats(m, &nl);
    CHECK(vlmoe_model_routing(m, nl, NULL, 0, &n) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "outside"),
          "bad layer index: %s", vlmoe_last_error());
    CHECK(vlmoe_model_routing(m, -1, NULL, 0, &n) == VLMOE_ERR_ARG, "negative layer index");
    // an image-only pass groups 2 consecutive images (32 tokens)
    float emb[8 * 64];
    CHECK(c.embed_dim <= 64 && vlmoe_model_encode_images(m, b.img, 8, emb) == VLMOE_OK, "encode: %s", vlmoe_last_error());
    check_layers(m, "limoe images only", 8, 16, 0, 2, text_first);
    batch_free(&b);
    vlmoe_model_free(m);
}

static void test_other_routers(void) {
    vlmoe_model_config c;
    vlmoe_config_named("ec-tiny", &c);
    vlmoe_model *m;
    vlmoe_model_init(&m, &c, 2);
    batchbuf b;
    batch_init(&b, &c, 4);
    vlmoe_batch bt = {4, b.img, b.tok, b.lens};
    vlmoe_step_stats s;
    CHECK(vlmoe_model_forward(m, &bt, &s) == VLMOE_OK, "ec forward: %s", vlmoe_last_error());
    // experts choice: one entry per accepted assignment, one dropped entry per untaken token
    const vlmoe_moe_stats *st = vlmoe_model_moe_stats(m, NULL);
    int n = 0;
    vlmoe_model_routing(m, 0, NULL, 0, &n);
    vlmoe_token_route *r = malloc(sizeof(*r) * (size_t)n);
    CHECK(vlmoe_model_routing(m, 0, r, n, &n) == VLMOE_OK, "ec routing: %s", vlmoe_last_error());
    double acc[2] = {0, 0}, want[2] = {0, 0};
    int order_ok = 1;
    for (int i = 0; i < n; i++) {
        if (!r[i].dropped) acc[r[i].modality]++;
        else if (r[i].expert != -1 || r[i].slot != -1) order_ok = 0;
        if (i && (r[i].token < r[i - 1].token || (r[i].token == r[i - 1].token && r[i].expert <= r[i - 1].expert)))
            order_ok = 0;
    }
    for (int mo = 0; mo < 2; mo++)
        for (int e = 0; e < st[0].num_experts; e++) want[mo] += st[0].accepted[mo][e] * st[0].tokens[mo];
    CHECK(order_ok, "ec: entries by token then expert, untaken tokens as expert -1");
    CHECK(fabs(acc[0] - want[0]) < 1e-9 && fabs(acc[1] - want[1]) < 1e-9, "ec: accepted %g %g, stats %g %g",
          acc[0], acc[1], want[0], want[1]);
    free(r);
    batch_free(&b);
    vlmoe_model_free(m);
    // Soft MoE has no per-token decision
    vlmoe_config_named("soft-tiny", &c);
    vlmoe_model_init(&m, &c, 2);
    batch_init(&b, &c, 4);
    bt = (vlmoe_batch){4, b.img, b.tok, b.lens};
    CHECK(vlmoe_model_forward(m, &bt, &s) == VLMOE_OK, "soft forward: %s", vlmoe_last_error());
    CHECK(vlmoe_model_routing(m, 0, NULL, 0, &n) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "Soft MoE"),
          "soft: %s", vlmoe_last_error());
    batch_free(&b);
    vlmoe_model_free(m);
}

int main(void) {
    test_limoe(0);
    test_limoe(1);
    test_other_routers();
    return test_summary("test_routing");
}
