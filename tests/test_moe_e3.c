// test_moe_e3.c: LIMoE appendix E.3's router designs (src/moe/layer.c): a router per modality and
// disjoint expert pools. A hand-worked layer (softmax and top-K over the token's pool, the
// auxiliary losses per modality over its pool), a pool gate that underflows to 0 and still keeps
// the token in its pool, the config keys and their errors, a checkpoint round trip, and a short
// training run of limoe-disjoint-tiny on the synthetic data where both pools are used. Finite
// differences are in tests/test_model.c (fd_moe_checks), PyTorch parity in tests/test_parity.c.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "moe/layer.h"
#include "ops/backend.h"
#include "test.h"
#include "vlmoe.h"

// One MoE layer by hand: D = 2, E = 4, M = 1; experts return their output bias b2[e] (w1 = w2 = 0),
// so a token's output is gate * b2[expert]. Two pairs of one image and one text token: rows 0-1
// images x = (1,0), rows 2-3 texts x = (2,0). Pools: images {0,1}, text {2,3} (text_experts 2).
// Image router rows (1,0), (0,0), (5,0), (5,0): logits (1, 0, 5, 5), so the pool's softmax gives
// expert 0 the gate s = e/(e+1) although experts 2 and 3 have the larger logits. Text router
// rows (3,0), (3,0), (1,0), (0,0): logits (6, 6, 2, 0), pool gates a = e^2/(e^2+1) on expert 2
// and 1-a on 3. Ample capacity (eval factor 4).
static void golden_layer(int pools, int per_modality, double out[8], double *aux, vlmoe_moe_stats *s,
                         vlmoe_token_route rt[4], double accepted[2][4]) {
    vlmoe_moe_config mc;
    memset(&mc, 0, sizeof(mc));
    mc.router = VLMOE_ROUTER_TOKENS, mc.layers = 1, mc.num_experts = 4, mc.top_k = 1;
    mc.capacity_factor = mc.eval_capacity_factor = 4, mc.capacity_multiple = 1, mc.order = VLMOE_ORDER_FIFO;
    mc.text_experts = pools ? 2 : 0, mc.router_per_modality = per_modality;
    mc.aux_weight[VLMOE_AUX_IMPORTANCE] = 1, mc.aux_weight[VLMOE_AUX_LOCAL_ENT_TEXT] = 1;
    // parameters: router (2,4,2) or (4,2), w1 (4,1,2), b1 (4,1), w2 (4,2,1), b2 (4,2)
    const double wi[8] = {1, 0, 0, 0, 5, 0, 5, 0}, wt[8] = {3, 0, 3, 0, 1, 0, 0, 0};
    const double b2[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    double P[16 + 8 + 4 + 8 + 8] = {0};
    const size_t R = per_modality ? 16 : 8;
    memcpy(P, wi, sizeof(wi));
    if (per_modality) memcpy(P + 8, wt, sizeof(wt));
    const moe_spec sp = {&mc, 2, 1, VLMOE_ACT_GELU_TANH, 0, R, R + 8, R + 12, R + 20, (size_t)-1, (size_t)-1, 0, 0, 0, 0};
    memcpy(P + R + 20, b2, sizeof(b2));
    const double x[8] = {1, 0, 1, 0, 2, 0, 2, 0};
    const uint8_t mod[4] = {0, 0, 1, 1};
    const moe_examples ex = {2, {1, 1}};
    moe_call c = {4, 0, 1, mod, NULL, NULL, &ex};
    moe_state_f64 *st = NULL;
    memset(out, 0, sizeof(double) * 8);
    memset(s, 0, sizeof(*s));
    memset(rt, 0, sizeof(*rt) * 4);
    *aux = -1;
    int n = -1;
    CHECK(moe_state_create_f64(&st, &sp, backend_cpu_f64(), 4) == VLMOE_OK, "state: %s", vlmoe_last_error());
    if (!st) return;
    CHECK(moe_forward_f64(st, &c, P, x, out, aux, s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
    CHECK(moe_routing_f64(st, rt, 4, &n) == VLMOE_OK && n == 4, "routing: %d entries: %s", n, vlmoe_last_error());
    for (int m = 0; m < 2; m++) // the statistics' arrays live in the state
        for (int e = 0; e < 4; e++) accepted[m][e] = s->accepted[m][e];
    moe_state_free_f64(st);
}

static void test_golden(void) {
    const double s1 = exp(1) / (exp(1) + 1), a = exp(2) / (exp(2) + 1);
    const double ha = -(a * log(a) + (1 - a) * log(1 - a));
    double out[8], aux;
    vlmoe_moe_stats s;
    vlmoe_token_route rt[4];
    double acc[2][4];
    golden_layer(1, 1, out, &aux, &s, rt, acc);
    // images: expert 0 (b2 = (1,2)) with gate s; texts: expert 2 (b2 = (5,6)) with gate a
    for (int t = 0; t < 4; t++) {
        const double g = t < 2 ? s1 : a, b[2] = {t < 2 ? 1 : 5, t < 2 ? 2 : 6};
        const int e = t < 2 ? 0 : 2;
        CHECK(fabs(out[2 * t] - g * b[0]) < 1e-14 && fabs(out[2 * t + 1] - g * b[1]) < 1e-14,
              "pools: row %d output (%.17g, %.17g), expected %.17g x (%g, %g)", t, out[2 * t], out[2 * t + 1], g,
              b[0], b[1]);
        CHECK(rt[t].token == t && rt[t].expert == e && !rt[t].dropped && fabs(rt[t].gate - g) < 1e-7,
              "pools: row %d routed to expert %d gate %g (dropped %d), expected expert %d gate %g", t, rt[t].expert,
              rt[t].gate, rt[t].dropped, e, g);
    }
    // importance per modality over its pool: images (2s, 2(1-s)) over experts {0,1}, texts
    // (2a, 2(1-a)) over {2,3}; cv^2 of (2p, 2(1-p)) is (2p-1)^2. The text local entropy is H(a)
    // over the text pool (over all four experts it would include the 6, 6 logits)
    const double imp = (2 * s1 - 1) * (2 * s1 - 1) + (2 * a - 1) * (2 * a - 1);
    CHECK(fabs(s.aux[VLMOE_AUX_IMPORTANCE] - imp) < 1e-12, "pools: importance %.17g, expected %.17g",
          s.aux[VLMOE_AUX_IMPORTANCE], imp);
    CHECK(fabs(s.aux[VLMOE_AUX_LOCAL_ENT_TEXT] - ha) < 1e-12, "pools: text local entropy %.17g, expected %.17g",
          s.aux[VLMOE_AUX_LOCAL_ENT_TEXT], ha);
    CHECK(fabs(aux - imp - ha) < 1e-12, "pools: weighted aux %.17g, expected %.17g", aux, imp + ha);
    // the statistics: each modality's tokens all in its pool
    for (int e = 0; e < 4; e++)
        CHECK(acc[0][e] == (e == 0) && acc[1][e] == (e == 2), "pools: expert %d accepted image %g text %g", e,
              acc[0][e], acc[1][e]);

    // a router per modality over the shared pool: texts see logits (6, 6, 2, 0), first choice
    // expert 0 (ties: lower index) with gate e^6/(2e^6+e^2+1); images (1, 0, 5, 5): expert 2
    golden_layer(0, 1, out, &aux, &s, rt, acc);
    const double gt = exp(6) / (2 * exp(6) + exp(2) + 1), gi = exp(5) / (exp(1) + 1 + 2 * exp(5));
    CHECK(rt[0].expert == 2 && rt[2].expert == 0 && fabs(rt[0].gate - gi) < 1e-7 && fabs(rt[2].gate - gt) < 1e-7,
          "per-modality routers: image expert %d gate %g (expected 2, %g), text expert %d gate %g (expected 0, %g)",
          rt[0].expert, rt[0].gate, gi, rt[2].expert, rt[2].gate, gt);
    CHECK(fabs(out[4] - gt * 1) < 1e-14 && fabs(out[0] - gi * 5) < 1e-14, "per-modality routers: outputs %.17g %.17g",
          out[0], out[4]);
    // pools with one shared router (the image rows): texts see (2, 0, 10, 10), pool gates 1/2, 1/2
    golden_layer(1, 0, out, &aux, &s, rt, acc);
    CHECK(rt[2].expert == 2 && fabs(rt[2].gate - 0.5) < 1e-7 && fabs(out[4] - 0.5 * 5) < 1e-14,
          "pools, shared router: text expert %d gate %g output %.17g, expected 2, 0.5, 2.5", rt[2].expert,
          rt[2].gate, out[4]);
}

// A pool gate that underflows to 0 (logits 1000 apart) with K = 2 in a pool of 2: the second choice
// is the pool's other expert, never an expert of the other pool (whose gates are 0 as well and
// have lower indices, which win ties). Random tokens and routers, with noise: no choice leaves the
// pool.
static void test_pool_bounds(void) {
    vlmoe_moe_config mc;
    memset(&mc, 0, sizeof(mc));
    mc.router = VLMOE_ROUTER_TOKENS, mc.layers = 1, mc.num_experts = 8, mc.top_k = 2, mc.text_experts = 2;
    mc.capacity_factor = mc.eval_capacity_factor = 8, mc.capacity_multiple = 1, mc.order = VLMOE_ORDER_BPR;
    mc.noise_std = 1, mc.router_per_modality = 1;
    const int D = 3, E = 8, M = 2, n = 40;
    const size_t R = 2 * (size_t)E * D;
    const moe_spec sp = {&mc, D, M, VLMOE_ACT_GELU_TANH, 0, R, R + E * M * D, R + E * M * D + E * M,
                         R + 2 * E * M * D + E * M, (size_t)-1, (size_t)-1, 0, 0, 0, 0};
    const size_t np = R + 2 * (size_t)E * M * D + (size_t)E * M + (size_t)E * D;
    double *P = calloc(np, sizeof(double)), *x = calloc((size_t)n * D, sizeof(double));
    double *out = calloc((size_t)n * D, sizeof(double));
    uint8_t mod[40];
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 9);
    for (size_t i = 0; i < np; i++) P[i] = vlmoe_rng_normal(&r);
    for (int i = 0; i < n * D; i++) x[i] = vlmoe_rng_normal(&r);
    for (int t = 0; t < n; t++) mod[t] = t >= 24; // 24 image rows, then 16 text rows
    // text router: expert 6 gets 1000 x[0], expert 7 0, so with x[0] = 1 expert 7's gate is 0
    double *wt = P + (size_t)E * D;
    for (int e = 0; e < E; e++) wt[e * D] = e == 6 ? 1000 : 0, wt[e * D + 1] = wt[e * D + 2] = 0;
    x[24 * D] = 1;
    moe_call c = {n, 0, 1, mod, NULL, NULL, NULL};
    moe_state_f64 *st = NULL;
    vlmoe_moe_stats s;
    double aux;
    vlmoe_token_route rt[80];
    int cnt = 0;
    CHECK(moe_state_create_f64(&st, &sp, backend_cpu_f64(), n) == VLMOE_OK, "state: %s", vlmoe_last_error());
    for (int training = 0; st && training < 2; training++) {
        c.training = training;
        CHECK(moe_forward_f64(st, &c, P, x, out, &aux, &s) == VLMOE_OK && isfinite(aux), "forward: %s",
              vlmoe_last_error());
        CHECK(moe_routing_f64(st, rt, 80, &cnt) == VLMOE_OK && cnt == 2 * n, "routing: %s", vlmoe_last_error());
        int outside = 0;
        for (int i = 0; i < cnt; i++) outside += (rt[i].expert >= 6) != (rt[i].modality == 1);
        CHECK(outside == 0, "training %d: %d of %d choices outside the token's pool", training, outside, cnt);
        if (!training)
            CHECK(rt[48].expert == 6 && rt[49].expert == 7 && rt[49].gate == 0.0f,
                  "underflow: text row 24 chose experts %d (gate %g) and %d (gate %g), expected 6 and 7 (gate 0)",
                  rt[48].expert, rt[48].gate, rt[49].expert, rt[49].gate);
    }
    // a pass without modalities cannot be routed by modality
    c.modality = NULL;
    CHECK(st && moe_forward_f64(st, &c, P, x, out, &aux, &s) == VLMOE_ERR_ARG &&
              strstr(vlmoe_last_error(), "modality"), "no modality: %s", vlmoe_last_error());
    moe_state_free_f64(st);
    free(P), free(x), free(out);
}

static void test_config(void) {
    vlmoe_model_config c;
    CHECK(vlmoe_config_named("limoe-disjoint-tiny", &c) == VLMOE_OK && c.moe.text_experts == 2 &&
              c.moe.router_per_modality == 1 && c.moe.num_experts == 8, "limoe-disjoint-tiny: %s", vlmoe_last_error());
    CHECK(vlmoe_config_named("limoe-permod-tiny", &c) == VLMOE_OK && c.moe.text_experts == 0 &&
              c.moe.router_per_modality == 1, "limoe-permod-tiny: %s", vlmoe_last_error());
    // the keys survive the JSON round trip; files without them read as before
    vlmoe_config_named("limoe-disjoint-tiny", &c);
    char *js = vlmoe_config_to_json(&c);
    vlmoe_model_config back;
    CHECK(js && strstr(js, "\"text_experts\"") && vlmoe_config_from_json(js, "e3.json", &back) == VLMOE_OK &&
              back.moe.text_experts == 2 && back.moe.router_per_modality == 1, "json round trip: %s",
          vlmoe_last_error());
    free(js);
    vlmoe_config_named("limoe-tiny", &c);
    js = vlmoe_config_to_json(&c);
    CHECK(js && !strstr(js, "text_experts") && !strstr(js, "router_per_modality"), "limoe-tiny's JSON names E.3 keys");
    free(js);
    // global-entropy thresholds are the pool's: limoe's log 6 cannot be met by 2 text experts,
    // nor (exactly uniform aside) by 6 image experts; limoe-disjoint-tiny has no entropy losses
    char w[1024];
    vlmoe_config_named("limoe-disjoint-tiny", &c);
    CHECK(vlmoe_config_warnings(&c, w, sizeof(w)) == 0, "limoe-disjoint-tiny warned: %s", w);
    vlmoe_config_named("limoe-tiny", &c);
    c.moe.text_experts = 2;
    CHECK(vlmoe_config_warnings(&c, w, sizeof(w)) == 2 && strstr(w, "log(text_experts = 2)") &&
              strstr(w, "num_experts - text_experts = 6)"), "pool thresholds: '%s'", w);
    const char *bad[][2] = {
        {"{\"base\": \"tiny\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", \"text_experts\": 8}}", "text_experts: 8 leaves a pool"},
        {"{\"base\": \"tiny\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", \"text_experts\": -1}}", "text_experts: -1"},
        {"{\"base\": \"tiny\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", \"router_per_modality\": 1}}", "must be true or false"},
        {"{\"base\": \"tiny\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", \"router\": \"experts_choice\", \"text_experts\": 2}}",
         "need tokens-choice"},
        {"{\"base\": \"tiny-clip\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", \"router_per_modality\": true}}", "one_tower"},
        {"{\"base\": \"tiny\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", \"text_experts\": 2, \"pruned\": {\"1\": [0]}}}",
         "disjoint expert pools"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(vlmoe_config_from_json(bad[i][0], "e3.json", &c) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), bad[i][1]),
              "bad config %zu: %s", i, vlmoe_last_error());
}

static const vlmoe_param_info *find(const vlmoe_model *m, const char *name) {
    int n;
    const vlmoe_param_info *t = vlmoe_model_params(m, &n);
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

// Save and load: the per-modality router under its own name and shape, bit for bit, and the
// loaded model computes the same loss; limoe-tiny keeps its one router.
static void test_checkpoint(void) {
    char dir[] = "/tmp/vlmoe_test_e3_XXXXXX", path[256];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof(path), "%s/m.safetensors", dir);
    const char *names[] = {"limoe-disjoint-tiny", "limoe-tiny"};
    for (int k = 0; k < 2; k++) {
        vlmoe_model_config c;
        vlmoe_config_named(names[k], &c);
        vlmoe_model *m = NULL, *back = NULL;
        CHECK(vlmoe_model_init(&m, &c, 3) == VLMOE_OK, "%s: %s", names[k], vlmoe_last_error());
        if (!m) continue;
        const vlmoe_param_info *pm = find(m, "encoder.blocks.1.moe.router.per_modality.weight");
        const vlmoe_param_info *p1 = find(m, "encoder.blocks.1.moe.router.weight");
        if (k == 0)
            CHECK(pm && !p1 && pm->ndim == 3 && pm->shape[0] == 2 && pm->shape[1] == 8 && pm->shape[2] == 64,
                  "%s: the router is not (2, 8, 64) under its per-modality name", names[k]);
        else
            CHECK(p1 && !pm && p1->ndim == 2 && p1->shape[0] == 8, "%s: the router is not its one (8, 64)", names[k]);
        // different image and text routers after init (each drawn on its own)
        if (pm) {
            const float *w = vlmoe_model_param_data(m) + pm->offset;
            CHECK(memcmp(w, w + 8 * 64, sizeof(float) * 8 * 64) != 0, "the two routers start equal");
        }
        CHECK(vlmoe_model_save(m, path) == VLMOE_OK, "save: %s", vlmoe_last_error());
        CHECK(vlmoe_model_load(&back, path) == VLMOE_OK, "load: %s", vlmoe_last_error());
        if (back) {
            const vlmoe_model_config *bc = vlmoe_model_get_config(back);
            CHECK(bc->moe.text_experts == c.moe.text_experts && bc->moe.router_per_modality == c.moe.router_per_modality,
                  "%s: the loaded config lost the E.3 keys", names[k]);
            CHECK(vlmoe_model_num_floats(back) == vlmoe_model_num_floats(m) &&
                      !memcmp(vlmoe_model_param_data(back), vlmoe_model_param_data(m),
                              sizeof(float) * vlmoe_model_num_floats(m)),
                  "%s: loaded parameters differ", names[k]);
            vlmoe_synth *d = NULL;
            vlmoe_synth_params sp = vlmoe_synth_default_params();
            sp.image_size = c.image_size;
            vlmoe_synth_init(&d, &sp);
            const int B = 4, T = c.context_length;
            float *img = malloc(sizeof(float) * B * 3 * c.image_size * c.image_size);
            int32_t tok[4 * 16], len[4];
            vlmoe_synth_batch(d, VLMOE_SPLIT_TRAIN, 0, B, T, img, tok, len);
            // both encoders, so both routers (and, with pools, both pools) take part
            float e0[2][4 * 64], e1[2][4 * 64];
            CHECK(vlmoe_model_encode_images(m, img, B, e0[0]) == VLMOE_OK &&
                      vlmoe_model_encode_images(back, img, B, e1[0]) == VLMOE_OK &&
                      vlmoe_model_encode_texts(m, tok, len, B, e0[1]) == VLMOE_OK &&
                      vlmoe_model_encode_texts(back, tok, len, B, e1[1]) == VLMOE_OK &&
                      !memcmp(e0, e1, sizeof(float) * 2 * B * c.embed_dim),
                  "%s: embeddings differ after loading: %s", names[k], vlmoe_last_error());
            free(img);
            vlmoe_synth_free(d);
            vlmoe_model_free(back);
        }
        // LIMoE E.4's pruning would cut the routers' rows and pools: refused with a reason
        double usage[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        vlmoe_model *pr = NULL;
        if (k == 0)
            CHECK(vlmoe_model_prune(&pr, m, VLMOE_MOD_TEXT, usage, 2, VLMOE_PRUNE_ROUTER_DROP) == VLMOE_ERR_CONFIG &&
                      !pr && strstr(vlmoe_last_error(), "not supported"), "prune: %s", vlmoe_last_error());
        vlmoe_model_free(pr);
        vlmoe_model_free(m);
    }
    unlink(path), rmdir(dir);
}

// limoe-disjoint-tiny trains on the synthetic pairs: the loss falls, every token stays in its
// pool, both pools are used (each image expert and each text expert takes tokens) and most tokens
// find room.
static void test_trains(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-disjoint-tiny", &c);
    vlmoe_model *m = NULL;
    vlmoe_model_init(&m, &c, 0);
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule.base_lr = 2e-3;
    tp.schedule.warmup_steps = 20;
    tp.schedule.total_steps = 150;
    vlmoe_trainer *t = NULL;
    CHECK(m && vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK, "trainer: %s", vlmoe_last_error());
    if (!t) {
        vlmoe_model_free(m);
        return;
    }
    vlmoe_synth *d = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_synth_init(&d, &sp);
    const int B = 32, T = c.context_length;
    float *img = malloc(sizeof(float) * B * 3 * c.image_size * c.image_size);
    int32_t *tok = malloc(sizeof(int32_t) * B * T), len[32];
    double first = 0, last = 0, succ[2] = {0, 0}, used[2][8] = {{0}}, outside = 0;
    for (int step = 0; step < 150; step++) {
        vlmoe_synth_batch(d, VLMOE_SPLIT_TRAIN, (uint64_t)step * B, B, T, img, tok, len);
        vlmoe_batch b = {B, img, tok, len};
        vlmoe_step_stats s;
        if (vlmoe_trainer_step(t, &b, &s)) {
            CHECK(0, "step %d: %s", step, vlmoe_last_error());
            break;
        }
        const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, NULL);
        for (int mo = 0; mo < 2; mo++)
            for (int e = 0; e < 8; e++) {
                used[mo][e] += ms[0].accepted[mo][e] / 150;
                outside += (e >= 6) != mo ? ms[0].accepted[mo][e] : 0;
            }
        if (step < 20) first += s.contrastive / 20;
        if (step >= 130) {
            last += s.contrastive / 20;
            succ[0] += ms[0].success[0] / 20, succ[1] += ms[0].success[1] / 20;
        }
    }
    printf("limoe-disjoint-tiny, 150 steps: contrastive loss %.3f -> %.3f, success rate image %.3f text %.3f\n",
           first, last, succ[0], succ[1]);
    printf("  mean share of tokens per expert: image");
    for (int e = 0; e < 6; e++) printf(" %.3f", used[0][e]);
    printf(", text %.3f %.3f\n", used[1][6], used[1][7]);
    CHECK(last < 0.8 * first, "loss did not fall: %.3f -> %.3f", first, last);
    CHECK(outside == 0, "tokens accepted outside their pool (share %g)", outside);
    for (int e = 0; e < 8; e++)
        CHECK(used[e >= 6][e] > 0.02, "expert %d (%s pool) took a mean share of %.3f of its modality's tokens", e,
              e >= 6 ? "text" : "image", used[e >= 6][e]);
    CHECK(succ[0] > 0.85 && succ[1] > 0.85, "success rates image %.3f text %.3f, need > 0.85", succ[0], succ[1]);
    free(img), free(tok);
    vlmoe_synth_free(d);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
}

// Gradient checkpointing runs each MoE layer's forward again before its backward: the pool
// logits the losses read are packed again from the same decision, so 3 steps with and without it
// give the same losses and parameters bit for bit.
static void test_grad_checkpointing(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-disjoint-tiny", &c);
    vlmoe_synth *d = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_synth_init(&d, &sp);
    const int B = 8, T = c.context_length;
    float *img = malloc(sizeof(float) * B * 3 * c.image_size * c.image_size);
    int32_t tok[8 * 16], len[8];
    vlmoe_model *m[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    vlmoe_train_params tp = vlmoe_train_default_params();
    double loss[2][3] = {{0}};
    int st = 0;
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 2);
        if (!st) st = vlmoe_model_set_grad_checkpointing(m[k], k);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    for (int step = 0; step < 3 && !st; step++) {
        vlmoe_synth_batch(d, VLMOE_SPLIT_TRAIN, (uint64_t)step * B, B, T, img, tok, len);
        vlmoe_batch b = {B, img, tok, len};
        for (int k = 0; k < 2 && !st; k++) {
            vlmoe_step_stats s;
            st = vlmoe_trainer_step(t[k], &b, &s);
            loss[k][step] = s.loss;
        }
    }
    CHECK(!st && !memcmp(loss[0], loss[1], sizeof(loss[0])) &&
              !memcmp(vlmoe_model_param_data(m[0]), vlmoe_model_param_data(m[1]),
                      sizeof(float) * vlmoe_model_num_floats(m[0])),
          "gradient checkpointing: losses %.17g / %.17g after 3 steps (%s)", loss[0][2], loss[1][2],
          st ? vlmoe_last_error() : "parameters compared");
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
    free(img);
    vlmoe_synth_free(d);
}

// `vlmoe info` shows the E.3 setting; a bad text_experts in a config file is a clear error.
static void test_cli(const char *argv0) {
    char bin[4096], out[8192], dir[] = "/tmp/vlmoe_test_e3cli_XXXXXX";
    if (!test_vlmoe_bin(argv0, bin) || !mkdtemp(dir)) return;
    test_expect_in(dir, bin, "info --model limoe-disjoint-tiny", 0,
                   "expert pools         image experts 0-5, text experts 6-7 (disjoint)", out, sizeof(out));
    CHECK(strstr(out, "routers              one per modality (image, text)"), "info: no router line:\n%s", out);
    test_expect_in(dir, bin, "info --model limoe-permod-tiny --json", 0, "\"router_per_modality\"", out, sizeof(out));
    CHECK(!strstr(out, "text_experts"), "limoe-permod-tiny has no pools:\n%s", out);
    const char *js = "{\"base\": \"tiny\", \"moe\": {\"preset\": \"limoe\", \"layers\": \"every_2\", "
                     "\"text_experts\": 7, \"top_k\": 2}}";
    test_write_file(test_path(dir, "e3.json"), js, strlen(js));
    const int st = test_run_in(dir, bin, "info --model e3.json", 1, out, sizeof(out));
    CHECK(st != 0 && strstr(out, "e3.json") && strstr(out, "moe.text_experts: 7 leaves a pool smaller than top_k = 2"),
          "bad text_experts: exit %d:\n%s", st, out);
    unlink(test_path(dir, "e3.json")), rmdir(dir);
}

int main(int argc, char **argv) {
    (void)argc;
    test_cli(argv[0]);
    test_golden();
    test_pool_bounds();
    test_config();
    test_checkpoint();
    test_grad_checkpointing();
    test_trains();
    return test_summary("test_moe_e3");
}
