// test_model.c: whole-model checks. Finite differences in double over ALL parameters of tiny
// one_tower (LIMoE layout) and two_tower (OpenAI CLIP layout) models: a directional derivative
// along random directions, and one per parameter tensor so a failure names the tensor. Also:
// the encode / contrastive-step split matches the whole forward bit for bit, config parsing
// errors, named configs, save/load round trip, bad checkpoints, float forward
// matches double forward, and batch-of-one encodings equal batch-of-many. On a table without host
// memory (tests/sep_mem.h, every op's pointers checked): each MoE kind's towers and VL-MoE's
// pre-training, eval and fine-tuning paths equal the CPU table bit for bit.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "nn/model.h"
#include "sep_mem.h"
#include "test.h"
#include "train/run.h"
#include "train/tasks.h"

static vlmoe_model_config small(vlmoe_arch arch) {
    vlmoe_model_config c;
    vlmoe_config_named(arch == VLMOE_ARCH_ONE_TOWER ? "tiny" : "tiny-clip", &c);
    c.image_size = 8, c.patch_size = 4, c.vocab_size = 11, c.context_length = 5, c.embed_dim = 6;
    c.encoder = (vlmoe_encoder_config){8, 2, 2, 16};
    c.text_encoder = (vlmoe_encoder_config){6, 2, 3, 12};
    return c;
}

typedef struct {
    model_layout L;
    graph_f64 *g;
    double *p, *img;
    int32_t tok[15], lens[3];
} fd_model;

static double model_loss(fd_model *m) {
    graph_result r;
    graph_forward_f64(m->g, m->p, m->img, m->tok, m->lens, &r);
    return r.loss;
}
static double loss_cb(void *m) { return model_loss(m); }

// The seam a data-parallel run cuts at: graph_encode, then a contrastive step of its own on the
// embeddings, then graph_encode_backward from their gradients, gives graph_forward's loss and
// graph_backward's gradients (g) bit for bit.
static void check_split(fd_model *m, double loss, const double *g, const char *label) {
    const int B = 3, E = m->L.cfg.embed_dim;
    contrastive_step_f64 *c;
    CHECK(contrastive_step_create_f64(&c, backend_cpu_f64(), B, E) == VLMOE_OK, "%s: step: %s", label,
          vlmoe_last_error());
    double aux = -1, acc[2], *d = calloc((size_t)2 * B * E, sizeof(double)), *g2 = calloc(m->L.total, sizeof(double));
    CHECK(graph_encode_f64(m->g, m->p, m->img, m->tok, m->lens, &aux) == VLMOE_OK, "%s: encode: %s", label,
          vlmoe_last_error());
    const double l = contrastive_step_forward_f64(c, graph_embeddings_f64(m->g, MOD_IMAGE),
                                                  graph_embeddings_f64(m->g, MOD_TEXT), m->p + m->L.logit_scale, acc);
    contrastive_step_backward_f64(c, d, d + (size_t)B * E, g2 + m->L.logit_scale, 1.0);
    const double *const demb[NUM_MOD] = {d, d + (size_t)B * E};
    graph_encode_backward_f64(m->g, m->p, g2, demb);
    CHECK(l + aux == loss, "%s: encode + loss step gives %.17g, graph_forward %.17g", label, l + aux, loss);
    size_t k = 0;
    while (k < m->L.total && g[k] == g2[k]) k++;
    CHECK(k == m->L.total, "%s: split backward differs at parameter float %zu: %.17g vs %.17g", label, k,
          k < m->L.total ? g2[k] : 0.0, k < m->L.total ? g[k] : 0.0);
    contrastive_step_free_f64(c);
    free(d), free(g2);
}

// training: MoE layers run in training mode (noise drawn from a fixed seed, so every evaluation
// of the loss sees the same noise) with their auxiliary losses in the loss.
static void fd_model_check(const vlmoe_model_config *cfgp, const char *label, int training) {
    fd_model m;
    vlmoe_model_config cfg = *cfgp;
    if (model_layout_build(&m.L, &cfg) != VLMOE_OK) {
        CHECK(0, "%s: layout: %s", label, vlmoe_last_error());
        return;
    }
    const int B = 3;
    CHECK(graph_create_f64(&m.g, &m.L, backend_cpu_f64(), B) == VLMOE_OK, "graph: %s", vlmoe_last_error());
    graph_set_mode_f64(m.g, training, 1234);
    float *pf = malloc(sizeof(float) * m.L.total);
    model_layout_init_params(&m.L, pf, 7);
    m.p = malloc(sizeof(double) * m.L.total);
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 3);
    // perturb everything (LayerNorm weights, biases, zero-initialised tensors too) so no
    // gradient is trivially zero by symmetry
    for (size_t i = 0; i < m.L.total; i++) m.p[i] = pf[i] + 0.1 * vlmoe_rng_normal(&r);
    m.img = malloc(sizeof(double) * B * 3 * 64);
    for (int i = 0; i < B * 3 * 64; i++) m.img[i] = vlmoe_rng_normal(&r);
    const int T = cfg.context_length; // <= 5
    int lens[3] = {T, 3, 2};
    for (int b = 0; b < B; b++) {
        m.lens[b] = lens[b];
        for (int t = 0; t < T; t++) m.tok[b * T + t] = t < lens[b] ? (int)vlmoe_rng_below(&r, 11) : 0;
    }
    double *g = calloc(m.L.total, sizeof(double)), *v = malloc(sizeof(double) * m.L.total);
    const double loss0 = model_loss(&m);
    graph_backward_f64(m.g, m.p, g);
    check_split(&m, loss0, g, label);
    // unit-length directions with a step of 1e-5: truncation error ~1e-10, round-off ~1e-11
    const double h = 1e-5;
    // one direction per parameter tensor: names the tensor whose gradient is wrong
    int bad = 0;
    for (int k = 0; k < m.L.nparams; k++) {
        const vlmoe_param_info *pi = &m.L.table[k];
        double fd, gv;
        const double err = test_fd_direction(m.p + pi->offset, g + pi->offset, v, pi->numel, h, loss_cb, &m, &r, &fd, &gv);
        if (err > 1e-6) {
            bad++;
            fprintf(stderr, "%s: %s: directional derivative %.10g, gradient says %.10g (rel err %.2g)\n",
                    label, pi->name, fd, gv, err);
        }
        CHECK(fabs(gv) > 1e-9, "%s: %s has an all-zero gradient", label, pi->name);
    }
    CHECK(bad == 0, "%s: %d of %d parameter tensors fail the finite-difference check", label, bad, m.L.nparams);
    // and all parameters at once, three random directions
    for (int d = 0; d < 3; d++) {
        double fd, gv;
        test_fd_direction(m.p, g, v, m.L.total, h, loss_cb, &m, &r, &fd, &gv);
        CHECK(fabs(fd - gv) <= 1e-6 * (fabs(fd) + fabs(gv)), "%s: all-parameter direction %d: fd %.10g "
              "grad %.10g", label, d, fd, gv);
    }
    free(pf), free(m.p), free(m.img), free(g), free(v);
    graph_free_f64(m.g);
    model_layout_free(&m.L);
}

static void test_configs(void) {
    vlmoe_model_config c;
    const char *names[] = {"tiny", "tiny-clip", "S/32", "B/32", "B/16", "ViT-B-32", "ViT-B-16"};
    for (int i = 0; i < 7; i++) {
        CHECK(vlmoe_config_named(names[i], &c) == VLMOE_OK, "named %s", names[i]);
        char *js = vlmoe_config_to_json(&c);
        vlmoe_model_config back;
        CHECK(vlmoe_config_from_json(js, "roundtrip", &back) == VLMOE_OK, "json round trip %s: %s",
              names[i], vlmoe_last_error());
        CHECK(!memcmp(&back, &c, sizeof(c)), "json round trip of %s differs", names[i]);
        free(js);
    }
    CHECK(vlmoe_config_named("B/17", &c) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "B/17"),
          "unknown name message: %s", vlmoe_last_error());
    { // found by fuzz_config: each "limoe-" prefix recursed once, thousands overflowed the stack
        static char deep[6 * 5000 + 8];
        for (int i = 0; i < 5000; i++) memcpy(deep + 6 * i, "limoe-", 6);
        memcpy(deep + 6 * 5000, "tiny", 5);
        CHECK(vlmoe_config_named(deep, &c) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "not another MoE name"),
              "limoe-limoe-...: %s", vlmoe_last_error());
        CHECK(vlmoe_config_named("clipup-limoe-tiny", &c) == VLMOE_ERR_CONFIG, "clipup-limoe-tiny accepted");
        CHECK(vlmoe_config_named("limoe-tiny", &c) == VLMOE_OK, "limoe-tiny: %s", vlmoe_last_error());
    }
    // ViT-B-16 must be OpenAI CLIP exactly: 149.6M parameters
    vlmoe_model *m;
    vlmoe_config_named("ViT-B-16", &c);
    model_layout L;
    CHECK(model_layout_build(&L, &c) == VLMOE_OK, "ViT-B-16 layout");
    CHECK(L.total == 149620737, "ViT-B-16 has %zu parameters, OpenAI's has 149620737", L.total);
    model_layout_free(&L);
    struct { const char *json, *expect; } bad[] = {
        {"{\"base\": \"tiny\", \"image_size\": \"32\"}", "\"image_size\" must be an integer"},
        {"{\"base\": \"tiny\", \"imagesize\": 32}", "unknown key \"imagesize\""},
        {"{\"base\": \"tiny\", \"act\": \"relu\"}", "\"act\" must be"},
        {"{\"base\": \"tiny\", \"image_size\": 30}", "not a multiple of patch_size"},
        {"{\"base\": \"tiny\", \"encoder\": {\"width\": 64, \"heads\": 3}}", "must divide width"},
        {"{\"arch\": \"one_tower\", \"image_size\": 32}", "missing key"},
        {"[1, 2]", "not a JSON object"},
        {"{\"base\": \"tiny\", ", "not a JSON object"},
        {"{\"base\": \"tiny\", \"patch_bias\": 1}", "must be true or false"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int st = vlmoe_config_from_json(bad[i].json, "cfg.json", &c);
        CHECK(st == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), bad[i].expect) &&
                  strstr(vlmoe_last_error(), "cfg.json"),
              "bad config %zu: status %d, message '%s', expected '%s'", i, st, vlmoe_last_error(), bad[i].expect);
    }
    CHECK(vlmoe_config_from_json("{\"base\": \"tiny\", \"image_size\": 64}", "x", &c) == VLMOE_OK &&
              c.image_size == 64 && c.encoder.width == 64, "override of a named base");
    (void)m;
}

// The global-entropy threshold as the paper writes it (issue 20): tau = log(S), S the soft
// minimum number of experts. The presets' thresholds can be met with the model's experts; a
// threshold at or above log(E) is warned about; files written before the key was renamed keep
// their non-zero thresholds.
static void test_entropy_tau(void) {
    vlmoe_model_config c;
    const char *named[] = {"limoe-tiny", "limoe-mini", "limoe-S/32", "limoe-B/16"};
    for (size_t i = 0; i < sizeof(named) / sizeof(named[0]); i++) {
        CHECK(vlmoe_config_named(named[i], &c) == VLMOE_OK, "%s: %s", named[i], vlmoe_last_error());
        const double logE = log((double)c.moe.num_experts);
        CHECK(c.moe.global_tau[0] < logE && c.moe.global_tau[1] < logE,
              "%s: tau (%g, %g) not below log(E = %d) = %g", named[i], c.moe.global_tau[0], c.moe.global_tau[1],
              c.moe.num_experts, logE);
        char w[256];
        CHECK(vlmoe_config_warnings(&c, w, sizeof(w)) == 0, "%s warned: %s", named[i], w);
    }
    // E = 8: S = 6 for both (LIMoE F.1's 8-expert B/16); E = 32: the paper's log 20 / log 9
    vlmoe_moe_config m = {.num_experts = 8};
    CHECK(vlmoe_moe_preset("limoe", &m) == VLMOE_OK && fabs(m.global_tau[0] - log(6.0)) < 1e-15 &&
              fabs(m.global_tau[1] - log(6.0)) < 1e-15, "limoe preset, 8 experts: tau (%g, %g)", m.global_tau[0],
          m.global_tau[1]);
    m = (vlmoe_moe_config){.num_experts = 32};
    CHECK(vlmoe_moe_preset("limoe", &m) == VLMOE_OK && m.global_tau[0] == log(20.0) && m.global_tau[1] == log(9.0),
          "limoe preset, 32 experts: tau (%g, %g)", m.global_tau[0], m.global_tau[1]);
    // the new key, 0 = log 1, and its round trip
    CHECK(vlmoe_config_from_json("{\"base\": \"limoe-tiny\", \"moe\": {\"preset\": \"limoe\", "
                                 "\"global_entropy_tau\": [0, 0.5]}}", "t.json", &c) == VLMOE_OK &&
              c.moe.global_tau[0] == 0 && c.moe.global_tau[1] == 0.5, "global_entropy_tau: %s", vlmoe_last_error());
    char *js = vlmoe_config_to_json(&c);
    CHECK(js && strstr(js, "\"global_entropy_tau\"") && !strstr(js, "\"global_tau\""), "written key: %s", js);
    free(js);
    // a file of the older key: non-zero values read as they were written
    CHECK(vlmoe_config_from_json("{\"base\": \"limoe-tiny\", \"moe\": {\"preset\": \"limoe\", "
                                 "\"global_tau\": [1.25, 0]}}", "old.json", &c) == VLMOE_OK &&
              c.moe.global_tau[0] == 1.25 && c.moe.global_tau[1] == 0, "old global_tau: %s", vlmoe_last_error());
    // tau = log 9 with 8 experts cannot be met: one warning naming the key and modality
    c.moe.global_tau[1] = log(9.0);
    char w[512];
    CHECK(vlmoe_config_warnings(&c, w, sizeof(w)) == 1 && strstr(w, "moe.global_entropy_tau[text]") &&
              strstr(w, "log(num_experts = "), "warning for log 9: '%s'", w);
    c.moe.aux_weight[VLMOE_AUX_GLOBAL_ENT_TEXT] = 0; // the loss is off: nothing to warn about
    CHECK(vlmoe_config_warnings(&c, w, sizeof(w)) == 0, "warned about a disabled loss: '%s'", w);
    // negative and infinite thresholds are errors naming the key
    CHECK(vlmoe_config_from_json("{\"base\": \"limoe-tiny\", \"moe\": {\"preset\": \"limoe\", "
                                 "\"global_entropy_tau\": [-1, 0]}}", "n.json", &c) == VLMOE_ERR_CONFIG &&
              strstr(vlmoe_last_error(), "global_entropy_tau") && strstr(vlmoe_last_error(), "n.json"),
          "negative tau: %s", vlmoe_last_error());
}

// The float path computes what the double path computes, and encoders agree with the batch.
static void test_float_vs_double(void) {
    vlmoe_model_config cfg = small(VLMOE_ARCH_TWO_TOWER);
    vlmoe_model *m;
    CHECK(vlmoe_model_init(&m, &cfg, 5) == VLMOE_OK, "init: %s", vlmoe_last_error());
    const int B = 3, T = 5;
    float img[3 * 3 * 64];
    int32_t tok[15], lens[3] = {5, 4, 2};
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 9);
    for (int i = 0; i < 3 * 3 * 64; i++) img[i] = (float)vlmoe_rng_normal(&r);
    for (int i = 0; i < 15; i++) tok[i] = (int)vlmoe_rng_below(&r, 11);
    vlmoe_batch b = {B, img, tok, lens};
    vlmoe_step_stats s;
    CHECK(vlmoe_model_forward(m, &b, &s) == VLMOE_OK, "forward: %s", vlmoe_last_error());
    model_layout L;
    model_layout_build(&L, &cfg);
    graph_f64 *g;
    graph_create_f64(&g, &L, backend_cpu_f64(), B);
    double *p = malloc(sizeof(double) * L.total), img64[3 * 3 * 64];
    for (size_t i = 0; i < L.total; i++) p[i] = vlmoe_model_param_data(m)[i];
    for (int i = 0; i < 3 * 3 * 64; i++) img64[i] = img[i];
    graph_result rr;
    graph_forward_f64(g, p, img64, tok, lens, &rr);
    CHECK_CLOSE(s.contrastive, rr.loss, 1e-6, 1e-5, "float loss vs double loss");
    float one[6 * 3], many[6 * 3];
    CHECK(vlmoe_model_encode_texts(m, tok, lens, 3, many) == VLMOE_OK, "encode texts");
    for (int i = 0; i < 3; i++) vlmoe_model_encode_texts(m, tok + i * T, lens + i, 1, one + i * 6);
    double worst = 0;
    for (int i = 0; i < 18; i++) worst = fmax(worst, fabs(one[i] - many[i]));
    CHECK(worst < 1e-6, "text embeddings: batch of one vs batch of three differ by %g", worst);
    CHECK(vlmoe_model_encode_images(m, img, 3, many) == VLMOE_OK, "encode images");
    for (int i = 0; i < 3; i++) vlmoe_model_encode_images(m, img + i * 192, 1, one + i * 6);
    worst = 0;
    for (int i = 0; i < 18; i++) worst = fmax(worst, fabs(one[i] - many[i]));
    CHECK(worst < 1e-6, "image embeddings: batch of one vs batch of three differ by %g", worst);
    free(p);
    graph_free_f64(g);
    model_layout_free(&L);
    vlmoe_model_free(m);
}

static void test_save_load(void) {
    char dir[] = "/tmp/vlmoe_test_model_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    char path[256], bad[256];
    snprintf(path, sizeof(path), "%s/m.safetensors", dir);
    snprintf(bad, sizeof(bad), "%s/bad.safetensors", dir);
    vlmoe_model_config cfg = small(VLMOE_ARCH_ONE_TOWER);
    vlmoe_model *m, *back = NULL;
    vlmoe_model_init(&m, &cfg, 11);
    CHECK(vlmoe_model_save(m, path) == VLMOE_OK, "save: %s", vlmoe_last_error());
    CHECK(vlmoe_model_load(&back, path) == VLMOE_OK, "load: %s", vlmoe_last_error());
    if (back) {
        CHECK(vlmoe_model_num_floats(back) == vlmoe_model_num_floats(m) &&
                  !memcmp(vlmoe_model_param_data(back), vlmoe_model_param_data(m),
                          sizeof(float) * vlmoe_model_num_floats(m)),
              "loaded parameters differ from saved ones");
        vlmoe_model_free(back);
    }
    // truncated copy: a clear error naming the file
    FILE *in = fopen(path, "rb"), *out = fopen(bad, "wb");
    char buf[1000];
    size_t n = fread(buf, 1, sizeof(buf), in);
    fwrite(buf, 1, n, out);
    fclose(in), fclose(out);
    back = NULL;
    CHECK(vlmoe_model_load(&back, bad) != VLMOE_OK && back == NULL && strstr(vlmoe_last_error(), bad),
          "truncated checkpoint: %s", vlmoe_last_error());
    // a NaN in the weights is refused
    vlmoe_model_param_data(m)[3] = NAN;
    vlmoe_model_save(m, bad);
    CHECK(vlmoe_model_load(&back, bad) == VLMOE_ERR_NUMERIC && strstr(vlmoe_last_error(), "patch_embed"),
          "NaN checkpoint: %s", vlmoe_last_error());
    CHECK(vlmoe_model_load(&back, "/nonexistent/x.safetensors") != VLMOE_OK, "missing file");
    unlink(path), unlink(bad), rmdir(dir);
    vlmoe_model_free(m);
}

// MoE variants of the small models: every router, top-2 with renormalisation, every loss.
static void fd_moe_checks(void) {
    vlmoe_model_config c = small(VLMOE_ARCH_ONE_TOWER);
    c.moe.layers = vlmoe_moe_every(2, c.encoder.layers);
    c.moe.num_experts = 4;
    vlmoe_moe_preset("limoe", &c.moe);
    c.moe.capacity_factor = 1.5; // some tokens are dropped, most are not
    fd_model_check(&c, "limoe", 1);
    vlmoe_model_config all = c; // every auxiliary loss at once, top-2, BPR by the sum of gates
    all.moe.top_k = 2;
    all.moe.bpr_score = VLMOE_BPR_SUM;
    for (int k = 0; k < VLMOE_AUX_COUNT; k++) all.moe.aux_weight[k] = 0.1;
    fd_model_check(&all, "all aux losses, K=2", 1);
    // routing groups of whole examples (MOE.md "Notation"): the aux losses and the decision see each
    // group's rows in group order, the combine writes the original rows
    vlmoe_model_config grp = all;
    grp.moe.group_size = 9; // one example per group: its 4 patches, then its 5 text tokens
    fd_model_check(&grp, "all aux losses, K=2, groups of one example", 1);
    grp.moe.group_size = 0; // one group of all 3 examples, text tokens first
    grp.moe.text_first = 1;
    fd_model_check(&grp, "all aux losses, K=2, text first", 1);
    // LIMoE E.3: a router per modality (over the shared pool), and disjoint pools, whose
    // losses are per modality over its pool: 3 image / 2 text experts (pool logits moved one at a
    // time, gcd(5, 2) = 1), then 4 / 2 with K = 2 (in pairs, gcd(6, 2) = 2), groups of one example
    vlmoe_model_config pm = all;
    pm.moe.router_per_modality = 1;
    fd_model_check(&pm, "per-modality routers, all aux losses, K=2", 1);
    vlmoe_model_config pool = pm;
    pool.moe.num_experts = 5, pool.moe.text_experts = 2, pool.moe.top_k = 1;
    fd_model_check(&pool, "disjoint pools 3/2, all aux losses", 1);
    pool.moe.num_experts = 6, pool.moe.top_k = 2, pool.moe.group_size = 9, pool.moe.router_per_modality = 0;
    fd_model_check(&pool, "disjoint pools 4/2, shared router, K=2, groups of one example", 1);
    vlmoe_model_config cu = small(VLMOE_ARCH_TWO_TOWER);
    cu.moe.layers = cu.text_moe.layers = vlmoe_moe_every(2, 2);
    cu.moe.num_experts = cu.text_moe.num_experts = 3;
    vlmoe_moe_preset("clipup", &cu.moe);
    vlmoe_moe_preset("clipup", &cu.text_moe);
    cu.moe.gate_renorm = VLMOE_RENORM_AFTER_ROUTING;
    fd_model_check(&cu, "clipup two_tower, renormalised", 1);
    vlmoe_model_config ec = c;
    ec.moe.router = VLMOE_ROUTER_EXPERTS;
    ec.moe.noise_std = 0;
    fd_model_check(&ec, "experts choice", 1);
    vlmoe_model_config soft = c;
    soft.moe.router = VLMOE_ROUTER_SOFT;
    soft.moe.group_size = 8; // one group per example: its 4 patches and 4 text tokens
    soft.context_length = 4;
    soft.moe.slots_per_expert = 2;
    fd_model_check(&soft, "soft moe", 1);
}

// A model on a table without host memory (what --device cuda gives) keeps its master parameters
// on the host and hands the graphs a device copy; gradients and embeddings come back by download.
// Checked here with the CPU kernels behind a table that claims separate memory (tests/sep_mem.h),
// so every upload and download is exercised: 3 training steps of each MoE kind and an encode must
// equal the plain CPU model's bit for bit (a missed upload or download would leave stale or zero
// buffers), and no op may be handed a pointer outside the table's allocations.
static void device_memory_check(const char *name) {
    vlmoe_backend_f32 dev = sep_table();
    vlmoe_model_config c;
    vlmoe_config_named(name, &c);
    vlmoe_model *m[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    vlmoe_synth *s = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_train_params tp = vlmoe_train_default_params();
    const int B = 6, T = c.context_length;
    const size_t isz = (size_t)3 * c.image_size * c.image_size;
    float *img = malloc(sizeof(float) * isz * B), *e[2] = {malloc(sizeof(float) * B * c.embed_dim),
                                                           malloc(sizeof(float) * B * c.embed_dim)};
    int32_t *tok = malloc(sizeof(int32_t) * B * T), *len = malloc(sizeof(int32_t) * B);
    int st = vlmoe_synth_init(&s, &sp);
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_model_init(&m[k], &c, 5);
        if (!st && k) st = model_set_backend(m[k], &dev, NULL);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
    }
    CHECK(st == VLMOE_OK && m[1]->d_params && m[1]->d_grads, "%s on separate memory: %s", name, vlmoe_last_error());
    double loss[2][3] = {{0}}, soft[2][3] = {{0}};
    for (int step = 0; step < 3 && !st; step++) {
        vlmoe_synth_batch(s, VLMOE_SPLIT_TRAIN, (uint64_t)step * B, B, T, img, tok, len);
        const vlmoe_batch b = {B, img, tok, len};
        for (int k = 0; k < 2 && !st; k++) {
            vlmoe_step_stats ss;
            st = vlmoe_trainer_step(t[k], &b, &ss);
            loss[k][step] = ss.loss;
            int nl = 0;
            const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m[k], &nl);
            for (int l = 0; l < nl; l++) soft[k][step] += ms[l].soft_mean_max[0] + ms[l].soft_mean_max[1] + ms[l].aux[0];
        }
    }
    CHECK(st == VLMOE_OK, "%s steps: %s", name, vlmoe_last_error());
    CHECK(sep_stray == 0, "%s: %d host pointers handed to a table without host memory; first: %s", name, sep_stray,
          sep_first);
    for (int step = 0; step < 3; step++) {
        CHECK(loss[0][step] == loss[1][step], "%s step %d: loss %.17g on the host table, %.17g on separate memory",
              name, step + 1, loss[0][step], loss[1][step]);
        CHECK(soft[0][step] == soft[1][step], "%s step %d: Soft MoE statistics %.17g on the host table, %.17g on "
              "separate memory", name, step + 1, soft[0][step], soft[1][step]);
    }
    // m[1]'s host copy is a mirror of the device's (resident AdamW steps): read through the API
    CHECK(!st && !memcmp(m[0]->params, vlmoe_model_param_data(m[1]), sizeof(float) * m[0]->L.total),
          "%s: parameters after 3 steps differ between the host table and separate memory", name);
    for (int k = 0; k < 2 && !st; k++) st = vlmoe_model_encode_images(m[k], img, B, e[k]);
    CHECK(!st && !memcmp(e[0], e[1], sizeof(float) * B * c.embed_dim), "%s: image embeddings differ: %s", name,
          vlmoe_last_error());
    for (int k = 0; k < 2; k++) vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]), free(e[k]);
    vlmoe_synth_free(s);
    free(img), free(tok), free(len);
    CHECK(sep_nblocks == 0, "%s: %d blocks of separate memory not freed", name, sep_nblocks);
}

// VL-MoE pre-training on the separate table: 3 steps of the masked-modeling task as `vlmoe train`
// runs it (src/train/mome_task.c: image, text and pair streams of the synthetic data at --mix
// 2,1,1, their MIM and MLM masks, drop path 0.1, 4 forwards and one update a step) must equal the
// host table's bit for bit: losses, the train record (per-stream losses and accuracies, each
// stream's routing from an eval forward), the gradient norms and every parameter; then the eval
// paths: hidden states, a retrieval head's embeddings (vlmoe_model_encode_*), ITM scores (ITM
// recall), a retrieval + ITM step, class scores and captions, with no host pointer handed to an op.
static void mome_device_check(void) {
    vlmoe_backend_f32 dev = sep_table();
    vlmoe_model_config c;
    vlmoe_config_named("vlmoe-tiny", &c);
    const int pd = c.channels * c.patch_size * c.patch_size, T = c.context_length, B = 6;
    float *cb = malloc(sizeof(float) * (size_t)c.mim_vocab * pd); // a codebook: any fixed centroids
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 11);
    for (size_t i = 0; i < (size_t)c.mim_vocab * pd; i++) cb[i] = (float)(2 * vlmoe_rng_uniform(&r) - 1);
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 1e-3, 0, 3, 0.0, 0, 0};
    const vlmoe_mome_params mp = {.config = &c, .batch_size = 12, .mix = {2, 1, 1}, .seed = 5, .world = 1};
    vlmoe_model *m[2] = {NULL, NULL}, *h[2] = {NULL, NULL};
    vlmoe_trainer *t[2] = {NULL, NULL};
    vlmoe_mome_run *task[2] = {NULL, NULL};
    int st = VLMOE_OK;
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_mome_init(&task[k], &mp);
        if (!st) st = vlmoe_model_init(&m[k], &c, 7);
        if (!st) st = vlmoe_model_set_drop_path(m[k], 0.1);
        if (!st && k) st = model_set_backend(m[k], &dev, NULL);
        if (!st) st = vlmoe_trainer_init(&t[k], m[k], &tp);
        if (!st) st = vlmoe_mome_start(task[k], m[k], cb, NULL, NULL);
    }
    CHECK(st == VLMOE_OK && m[1]->d_params && m[1]->d_grads, "vlmoe-tiny on separate memory: %s", vlmoe_last_error());
    for (long step = 0; step < 3 && !st; step++) {
        vlmoe_step_stats ss[2];
        char *rec[2] = {NULL, NULL}, line[2][1024];
        for (int k = 0; k < 2 && !st; k++) {
            const vlmoe_run_task rt = vlmoe_mome_task(task[k]);
            st = rt.fill(rt.user, step);
            if (!st) st = rt.step(rt.user, t[k], step, &ss[k]);
            cJSON *j = st ? NULL : vlmoe_metrics_record(step + 1, "train");
            if (j) st = rt.log(rt.user, step + 1, &ss[k], j, line[k], sizeof(line[k]));
            rec[k] = j && !st ? cJSON_PrintUnformatted(j) : NULL;
            cJSON_Delete(j);
        }
        CHECK(!st, "vlmoe-tiny step %ld: %s", step + 1, vlmoe_last_error());
        if (st) break;
        CHECK(ss[0].loss == ss[1].loss && ss[0].aux == ss[1].aux && ss[0].grad_norm == ss[1].grad_norm,
              "vlmoe-tiny step %ld: loss %.17g aux %.17g grad norm %.17g on the host table, %.17g %.17g %.17g on "
              "separate memory", step + 1, ss[0].loss, ss[0].aux, ss[0].grad_norm, ss[1].loss, ss[1].aux,
              ss[1].grad_norm);
        CHECK(rec[0] && rec[1] && !strcmp(rec[0], rec[1]) && strstr(rec[0], "\"vlm_text\"") && strstr(rec[0], "\"moe\""),
              "vlmoe-tiny step %ld: the train records differ:\n  host     %s\n  separate %s", step + 1, rec[0], rec[1]);
        CHECK(!strcmp(line[0], line[1]), "vlmoe-tiny step %ld: progress '%s' vs '%s'", step + 1, line[0], line[1]);
        free(rec[0]), free(rec[1]);
    }
    CHECK(!st && !memcmp(m[0]->params, m[1]->params, sizeof(float) * m[0]->L.total) &&
              !memcmp(m[0]->grads, m[1]->grads, sizeof(float) * m[0]->L.total),
          "vlmoe-tiny: parameters or gradients after 3 steps differ between the host table and separate memory");
    // the eval paths: a pair's hidden states, then heads copied from the trained model
    float *img = malloc(sizeof(float) * 3 * c.image_size * c.image_size * B), *out[2] = {NULL, NULL};
    int32_t *tok = malloc(sizeof(int32_t) * T * B), len[6];
    vlmoe_synth *syn = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    if (!st) st = vlmoe_synth_init(&syn, &sp);
    if (!st) st = vlmoe_synth_batch(syn, VLMOE_SPLIT_HELDOUT, 0, B, T, img, tok, len);
    const size_t nh = (size_t)B * vlmoe_mome_seq_len(&c, VLMOE_ENC_PAIR) * c.encoder.width;
    for (int k = 0; k < 2; k++) out[k] = malloc(sizeof(float) * nh);
    for (int k = 0; k < 2 && !st; k++) st = vlmoe_mome_encode(m[k], VLMOE_ENC_PAIR, img, tok, len, B, out[k]);
    CHECK(!st && !memcmp(out[0], out[1], sizeof(float) * nh), "vlmoe-tiny: pair hidden states differ: %s",
          vlmoe_last_error());
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_mome_with_heads(&h[k], m[0], 0, 0, 1, 9);
        if (!st && k) st = model_set_backend(h[k], &dev, NULL);
        if (!st) st = vlmoe_model_encode_images(h[k], img, B - 1, out[k]); // a padded last chunk
        if (!st) st = vlmoe_model_encode_texts(h[k], tok, len, B, out[k] + (size_t)B * c.embed_dim);
    }
    CHECK(!st && !memcmp(out[0], out[1], sizeof(float) * (2 * B - 1) * c.embed_dim),
          "vlmoe-tiny: retrieval embeddings differ: %s", vlmoe_last_error());
    for (int k = 0; k < 2; k++) vlmoe_model_free(h[k]), h[k] = NULL;
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_mome_with_itm(&h[k], m[0], 9);
        if (!st && k) st = model_set_backend(h[k], &dev, NULL);
        if (!st) st = vlmoe_mome_itm_scores(h[k], img, tok, len, B, out[k]);
    }
    CHECK(!st && !memcmp(out[0], out[1], sizeof(float) * B), "vlmoe-tiny: ITM scores differ: %s", vlmoe_last_error());
    // the library's other paths: a retrieval + ITM fine-tuning step (the mining reads the
    // embeddings back), class scores, greedy captions
    vlmoe_mome_stats ms[2];
    vlmoe_step_stats ss[2];
    const vlmoe_mome_batch pb = {.encoding = VLMOE_ENC_PAIR, .batch_size = B, .images = img, .tokens = tok,
                                 .lengths = len};
    for (int k = 0; k < 2 && !st; k++) {
        vlmoe_trainer *ti = NULL;
        st = vlmoe_trainer_init(&ti, h[k], &tp);
        if (!st) st = vlmoe_trainer_step_mome_itm(ti, &pb, 5, &ms[k], &ss[k]);
        vlmoe_trainer_free(ti);
    }
    CHECK(!st && ms[0].itc == ms[1].itc && ms[0].itm == ms[1].itm && ss[0].grad_norm == ss[1].grad_norm &&
              !memcmp(h[0]->params, h[1]->params, sizeof(float) * h[0]->L.total),
          "vlmoe-tiny: a retrieval + ITM step differs (itc %.17g / %.17g, itm %.17g / %.17g): %s", ms[0].itc, ms[1].itc,
          ms[0].itm, ms[1].itm, vlmoe_last_error());
    for (int k = 0; k < 2; k++) vlmoe_model_free(h[k]), h[k] = NULL;
    for (int k = 0; k < 2 && !st; k++) {
        st = vlmoe_mome_with_head(&h[k], m[0], 3, 9);
        if (!st && k) st = model_set_backend(h[k], &dev, NULL);
        if (!st) st = vlmoe_mome_logits(h[k], VLMOE_ENC_IMAGE, img, NULL, NULL, B, out[k]);
    }
    CHECK(!st && !memcmp(out[0], out[1], sizeof(float) * 3 * B), "vlmoe-tiny: class scores differ: %s",
          vlmoe_last_error());
    int32_t cap[2][2 * 16 + 2];
    const vlmoe_caption_params cp = {.bos = 1, .eos = 2, .max_len = 5};
    for (int k = 0; k < 2 && !st; k++) st = vlmoe_mome_caption(m[k], img, 2, &cp, cap[k], cap[k] + 2 * T);
    CHECK(T <= 16 && !st && !memcmp(cap[0], cap[1], sizeof(int32_t) * (2 * T + 2)), "vlmoe-tiny: captions differ: %s",
          vlmoe_last_error());
    CHECK(sep_stray == 0, "vlmoe-tiny: %d host pointers handed to a table without host memory; first: %s", sep_stray,
          sep_first);
    for (int k = 0; k < 2; k++) {
        vlmoe_model_free(h[k]), vlmoe_mome_free(task[k]), vlmoe_trainer_free(t[k]), vlmoe_model_free(m[k]);
        free(out[k]);
    }
    vlmoe_synth_free(syn);
    free(cb), free(img), free(tok);
    CHECK(sep_nblocks == 0, "vlmoe-tiny: %d blocks of separate memory not freed", sep_nblocks);
}

static void test_device_memory(void) {
    const char *names[] = {"limoe-tiny", "clipup-tiny", "soft-tiny", "ec-tiny", "limoe-permod-tiny",
                           "limoe-disjoint-tiny"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) device_memory_check(names[i]);
    mome_device_check();
}

// Expert parallelism's sharded layout (src/nn/model.h model_shard): shard 1 of 1 is the whole
// layout, table and initial values bit for bit; shard r of 4 of limoe-tiny (8 experts) holds
// experts [2r, 2r + 2) of every bank: the table keeps each bank's whole shape with expert0 and
// experts_local, the buffer is shorter by 3/4 of the experts' floats, every tensor's initial
// values are the whole model's (a bank's: its slice); a bank keep_whole names stays whole.
// model_reshard moves a model between the layouts; a shard refuses files and the unsplit forward.
static int keep_fc1_bias(void *user, const vlmoe_param_info *bank) {
    (void)user;
    return strstr(bank->name, "fc1.bias") != NULL;
}

static void test_shard_layout(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    model_layout W, one, S;
    const model_shard sh1 = {.rank = 0, .size = 1};
    CHECK(model_layout_build(&W, &c) == VLMOE_OK && model_layout_build_shard(&one, &c, &sh1) == VLMOE_OK, "build: %s",
          vlmoe_last_error());
    CHECK(one.total == W.total && one.nparams == W.nparams && one.nsplit == 0 &&
              !memcmp(one.table, W.table, sizeof(*W.table) * (size_t)W.nparams),
          "shard 1 of 1: another table than the whole layout's");
    float *pw = malloc(sizeof(float) * W.total), *ps = malloc(sizeof(float) * W.total);
    CHECK(model_layout_init_params(&W, pw, 7) == VLMOE_OK, "init");
    size_t experts = 0;
    for (int i = 0; i < W.nparams; i++)
        if (strstr(W.table[i].name, ".moe.experts.")) experts += W.table[i].numel;
    CHECK(experts > 0 && c.moe.num_experts == 8, "limoe-tiny: %zu expert floats, %d experts", experts, c.moe.num_experts);
    for (int r = 0; r < 4; r++) {
        model_shard sh = {.rank = r, .size = 4};
        if (r == 3) sh.keep_whole = keep_fc1_bias;
        if (model_layout_build_shard(&S, &c, &sh)) {
            CHECK(0, "shard %d of 4: %s", r, vlmoe_last_error());
            continue;
        }
        CHECK(model_layout_init_params(&S, ps, 7) == VLMOE_OK, "init shard %d", r);
        long wrong = 0, split = 0;
        size_t kept = 0;
        for (int i = 0; i < S.nparams && S.nparams == W.nparams; i++) {
            const vlmoe_param_info *p = &S.table[i], *q = &W.table[i];
            wrong += strcmp(p->name, q->name) || memcmp(p->shape, q->shape, sizeof(p->shape));
            size_t from = 0;
            if (p->experts_local) {
                split++;
                wrong += p->experts_local != 2 || p->expert0 != 2 * r || p->numel * 4 != q->numel;
                from = q->numel / 8 * (size_t)p->expert0;
            } else {
                wrong += p->numel != q->numel;
                if (strstr(p->name, ".moe.experts.")) kept += p->numel;
            }
            wrong += memcmp(ps + p->offset, pw + q->offset + from, sizeof(float) * p->numel) != 0;
        }
        const size_t want = W.total - (experts - kept) / 4 * 3;
        CHECK(!wrong && split == S.nsplit && split > 0 && S.total == want && (r < 3 || kept > 0),
              "shard %d of 4: %ld tensors wrong, %ld split, %zu floats (want %zu)", r, wrong, split, S.total, want);
        model_layout_free(&S);
    }
    const model_shard bad = {.rank = 0, .size = 3};
    CHECK(model_layout_build_shard(&S, &c, &bad) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "do not split"),
          "8 experts over 3: %s", vlmoe_last_error());
    model_layout_free(&S);
    // a model: whole -> shard 2 of 4 -> whole keeps shard 2's experts, the others zero
    vlmoe_model *m = NULL;
    const model_shard s2 = {.rank = 2, .size = 4};
    int st = vlmoe_model_init(&m, &c, 7);
    if (!st) st = vlmoe_model_plan(m, 2);
    if (!st) st = model_reshard(m, &s2);
    CHECK(st == VLMOE_OK && vlmoe_model_num_floats(m) < W.total, "reshard: %s", vlmoe_last_error());
    if (!st) {
        float *img = calloc((size_t)2 * c.channels * c.image_size * c.image_size, sizeof(float));
        int32_t *tok = calloc((size_t)2 * c.context_length, sizeof(int32_t)), lens[2] = {3, 3};
        vlmoe_batch b = {.images = img, .tokens = tok, .lengths = lens, .batch_size = 2};
        CHECK(vlmoe_model_evaluate(m, &b, NULL) == VLMOE_ERR_CONFIG && strstr(vlmoe_last_error(), "expert-parallel"),
              "a shard's forward without its group: %s", vlmoe_last_error());
        free(img), free(tok);
        CHECK(vlmoe_model_save(m, "/nonexistent/never.safetensors") == VLMOE_ERR_CONFIG &&
                  strstr(vlmoe_last_error(), "shard of the experts"), "a shard's model file: %s", vlmoe_last_error());
        st = model_reshard(m, NULL);
        long wrong = 0;
        const float *x = vlmoe_model_param_data(m);
        for (int i = 0; !st && i < W.nparams; i++) {
            const vlmoe_param_info *q = &W.table[i];
            const int bank = strstr(q->name, ".moe.experts.") != NULL;
            for (size_t k = 0; k < q->numel; k++) {
                const int mine = !bank || k / (q->numel / 8) / 2 == 2;
                wrong += mine ? x[q->offset + k] != pw[q->offset + k] : x[q->offset + k] != 0.0f;
            }
        }
        CHECK(!st && vlmoe_model_num_floats(m) == W.total && !wrong, "back to whole: %s, %ld floats wrong",
              st ? vlmoe_last_error() : "ok", wrong);
    }
    vlmoe_model_free(m);
    model_layout_free(&W), model_layout_free(&one);
    free(pw), free(ps);
}

int main(void) {
    test_device_memory();
    vlmoe_model_config c1 = small(VLMOE_ARCH_ONE_TOWER), c2 = small(VLMOE_ARCH_TWO_TOWER);
    fd_model_check(&c1, "one_tower", 1);
    fd_model_check(&c2, "two_tower", 1);
    // MLPs wide enough (2M >= 5D + 2HT floats a token) that the attention's scratch lies inside
    // the MLP's (src/nn/block.c), dense and MoE (whose experts share that scratch)
    vlmoe_model_config w1 = c1, w2 = c2;
    w1.encoder.mlp_dim = w2.encoder.mlp_dim = w2.text_encoder.mlp_dim = 40;
    fd_model_check(&w1, "one_tower, attention scratch in the MLP's", 1);
    fd_model_check(&w2, "two_tower, attention scratch in the MLP's", 1);
    w1.moe.layers = vlmoe_moe_every(2, w1.encoder.layers);
    w1.moe.num_experts = 4;
    vlmoe_moe_preset("limoe", &w1.moe);
    fd_model_check(&w1, "limoe, attention scratch in the MLP's", 1);
    fd_moe_checks();
    test_configs();
    test_entropy_tau();
    test_float_vs_double();
    test_save_load();
    test_shard_layout();
    return test_summary("test_model");
}
