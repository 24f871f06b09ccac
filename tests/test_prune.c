// test_prune.c: LIMoE expert pruning (appendix E.4) on a hand-built example. In limoe-tiny's MoE
// block the LayerNorm before the router is set to weight 0 and bias e_0, so every token reaches
// the router with the same input and the router's first column fixes the gates p. The experts
// output constants (fc1 = 0, gelu(0) = 0, fc2 bias = (e+1) u), so the MoE adds one known vector
// to every token. Expected, with expert 0 the router's favourite but pruned and expert 3 the
// best kept one: router_pred adds p_3 * 4u (softmax over all 8 experts), router_drop adds
// p_3 / sum(p_kept) * 4u (softmax over the kept ones). Each is compared with an unpruned model
// whose expert 0 outputs exactly that vector, so the test does not reuse the code it checks.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "train/run.h"
#include "vlmoe.h"

#define E 8
static const double P[E] = {0.40, 0.05, 0.10, 0.20, 0.10, 0.05, 0.05, 0.05};       // gates
static const double USE[E] = {0.01, 0.30, 0.20, 0.25, 0.05, 0.10, 0.04, 0.05};     // text shares
// keep 4: experts 1, 2, 3, 5 (the four largest shares); the best kept gate is expert 3's

static float *param(vlmoe_model *m, const char *name, size_t *n) {
    int cnt;
    const vlmoe_param_info *t = vlmoe_model_params(m, &cnt);
    for (int i = 0; i < cnt; i++)
        if (!strcmp(t[i].name, name)) {
            if (n) *n = t[i].numel;
            return vlmoe_model_param_data(m) + t[i].offset;
        }
    CHECK(0, "no tensor %s", name);
    return NULL;
}

// The hand-built MoE block; expert e outputs scale[e] * (e + 1) * u.
static void build(vlmoe_model *m, const double *scale) {
    const int D = vlmoe_model_get_config(m)->encoder.width, M = vlmoe_model_get_config(m)->encoder.mlp_dim;
    float *lw = param(m, "encoder.blocks.1.ln2.weight", NULL), *lb = param(m, "encoder.blocks.1.ln2.bias", NULL);
    float *r = param(m, "encoder.blocks.1.moe.router.weight", NULL);
    size_t n1, n2;
    float *w1 = param(m, "encoder.blocks.1.moe.experts.fc1.weight", &n1), *b1 = param(m, "encoder.blocks.1.moe.experts.fc1.bias", NULL);
    float *w2 = param(m, "encoder.blocks.1.moe.experts.fc2.weight", &n2), *b2 = param(m, "encoder.blocks.1.moe.experts.fc2.bias", NULL);
    for (int i = 0; i < D; i++) lw[i] = 0, lb[i] = i == 0;
    for (int e = 0; e < E; e++)
        for (int i = 0; i < D; i++) r[e * D + i] = i == 0 ? (float)log(P[e]) : 0;
    memset(w1, 0, sizeof(float) * n1), memset(b1, 0, sizeof(float) * (size_t)E * M);
    memset(w2, 0, sizeof(float) * n2);
    for (int e = 0; e < E; e++)
        for (int i = 0; i < D; i++) b2[e * D + i] = (float)(scale[e] * (e + 1) * 0.05 * sin(i + 1.0));
}

static vlmoe_model *tiny(void) {
    vlmoe_model_config c;
    vlmoe_config_named("limoe-tiny", &c);
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &c, 7) == VLMOE_OK && c.moe.num_experts == E && (c.moe.layers >> 1 & 1),
          "limoe-tiny: 8 experts in block 1");
    return m;
}

// Text embeddings of a few synthetic captions.
static void encode(vlmoe_model *m, float *out, int n) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int32_t tok[4 * 16], len[4];
    for (int b = 0; b < n; b++) {
        len[b] = 5 + b;
        for (int t = 0; t < c->context_length; t++) tok[b * c->context_length + t] = (3 + 7 * b + 5 * t) % c->vocab_size;
    }
    CHECK(vlmoe_model_encode_texts(m, tok, len, n, out) == VLMOE_OK, "encode: %s", vlmoe_last_error());
}

static double maxdiff(const float *a, const float *b, int n) {
    double d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

static void check_mode(vlmoe_prune_mode mode, const char *what) {
    vlmoe_model *m = tiny(), *pruned = NULL, *want = tiny();
    const double one[E] = {1, 1, 1, 1, 1, 1, 1, 1};
    build(m, one);
    // the reference: unpruned, expert 0 (the router's choice, gate p_0) outputs the expected vector
    const double kept_sum = P[1] + P[2] + P[3] + P[5];
    const double g = mode == VLMOE_PRUNE_ROUTER_PRED ? P[3] : P[3] / kept_sum;
    double scale[E] = {g * 4 / (P[0] * 1), 1, 1, 1, 1, 1, 1, 1};
    build(want, scale);
    CHECK(vlmoe_model_prune(&pruned, m, VLMOE_MOD_TEXT, USE, 4, mode) == VLMOE_OK, "%s: %s", what, vlmoe_last_error());
    if (!pruned) return;
    const vlmoe_model_config *pc = vlmoe_model_get_config(pruned);
    if (mode == VLMOE_PRUNE_ROUTER_PRED)
        CHECK(pc->moe.num_experts == E && pc->moe.pruned[1] == ((1u << 0) | (1u << 4) | (1u << 6) | (1u << 7)),
              "%s: mask %#llx", what, (unsigned long long)pc->moe.pruned[1]);
    else
        CHECK(pc->moe.num_experts == 4 && pc->moe.pruned[1] == 0, "%s: %d experts", what, pc->moe.num_experts);
    float a[4 * 64], b[4 * 64], c[4 * 64];
    const int Ed = pc->embed_dim;
    encode(pruned, a, 4);
    encode(want, b, 4);
    encode(m, c, 4);
    CHECK(maxdiff(a, b, 4 * Ed) < 2e-6, "%s: pruned embeddings differ from the hand-worked ones by %g", what,
          maxdiff(a, b, 4 * Ed));
    CHECK(maxdiff(a, c, 4 * Ed) > 1e-3, "%s: pruning changed nothing", what);
    // the text-only pass used only kept experts
    int nl;
    const vlmoe_moe_stats *st = vlmoe_model_moe_stats(pruned, &nl);
    CHECK(nl == 1 && st[0].num_experts == pc->moe.num_experts, "%s: stats of %d layers", what, nl);
    if (mode == VLMOE_PRUNE_ROUTER_PRED && nl == 1)
        for (int e = 0; e < E; e++)
            CHECK((st[0].accepted[VLMOE_MOD_TEXT][e] > 0) == (e == 3), "%s: expert %d took %.3f of the text", what, e,
                  st[0].accepted[VLMOE_MOD_TEXT][e]);
    // saved and loaded, the pruning survives
    char path[] = "/tmp/vlmoe_prune_XXXXXX";
    int fd = mkstemp(path);
    vlmoe_model *back = NULL;
    CHECK(fd >= 0 && vlmoe_model_save(pruned, path) == VLMOE_OK && vlmoe_model_load(&back, path) == VLMOE_OK,
          "%s: save/load: %s", what, vlmoe_last_error());
    if (back) {
        encode(back, b, 4);
        CHECK(maxdiff(a, b, 4 * Ed) == 0, "%s: the reloaded model differs", what);
        CHECK(!memcmp(vlmoe_model_get_config(back)->moe.pruned, pc->moe.pruned, sizeof(pc->moe.pruned)),
              "%s: mask lost in the file", what);
    }
    if (fd >= 0) close(fd), remove(path);
    vlmoe_model_free(back), vlmoe_model_free(pruned), vlmoe_model_free(want), vlmoe_model_free(m);
}

static void test_errors(void) {
    vlmoe_model *m = tiny(), *p = NULL;
    CHECK(vlmoe_model_prune(&p, m, VLMOE_MOD_TEXT, USE, 9, VLMOE_PRUNE_ROUTER_PRED) == VLMOE_ERR_ARG && !p &&
              strstr(vlmoe_last_error(), "--keep 9"), "keeping more experts than exist: %s", vlmoe_last_error());
    CHECK(vlmoe_model_prune(&p, m, VLMOE_MOD_TEXT, USE, 0, VLMOE_PRUNE_ROUTER_DROP) == VLMOE_ERR_ARG && !p,
          "keeping fewer than top_k");
    vlmoe_model_config c;
    vlmoe_config_named("tiny", &c);
    vlmoe_model *dense = NULL;
    vlmoe_model_init(&dense, &c, 1);
    CHECK(vlmoe_model_prune(&p, dense, VLMOE_MOD_IMAGE, USE, 4, VLMOE_PRUNE_ROUTER_PRED) == VLMOE_ERR_CONFIG && !p,
          "a dense model: %s", vlmoe_last_error());
    const char *bad = "{\"base\": \"limoe-tiny\", \"moe\": {\"pruned\": {\"1\": [0, 1, 2, 3, 4, 5, 6, 7]}}}";
    vlmoe_model_config bc;
    CHECK(vlmoe_config_from_json(bad, "bad.json", &bc) != VLMOE_OK || vlmoe_config_validate(&bc) != VLMOE_OK,
          "a config pruning every expert must be refused");
    CHECK(strstr(vlmoe_last_error(), "keeps 0 experts") != NULL, "message: %s", vlmoe_last_error());
    vlmoe_model_free(dense), vlmoe_model_free(m);
}

// The shares `vlmoe prune --stats` ranks experts by: the mean "accepted" fractions of the last N
// train records of a metrics file (docs/METRICS.md), layer by layer, for one encoder and modality.
// Hand-made file: 2 layers of encoder 0 with 2 experts, plus an encoder-1 layer and an eval record
// that must be skipped; 3 train records, the last 2 averaged.
static void test_metrics_shares(void) {
    const char *path = "test_prune_metrics.jsonl";
    FILE *f = fopen(path, "w");
    for (int r = 0; f && r < 3; r++) {
        const double a = 0.1 * (r + 1), b = 0.2 * (r + 1);
        fprintf(f, "{\"step\":%d,\"kind\":\"train\",\"loss\":1,\"moe\":["
                   "{\"encoder\":0,\"block\":1,\"text\":{\"accepted\":[%g,%g]},\"image\":{\"accepted\":[9,9]}},"
                   "{\"encoder\":1,\"block\":1,\"text\":{\"accepted\":[7,7]}},"
                   "{\"encoder\":0,\"block\":3,\"text\":{\"accepted\":[%g,%g]}}]}\n", r + 1, a, 1 - a, b, 1 - b);
        fprintf(f, "{\"step\":%d,\"kind\":\"eval\",\"eval_zeroshot_top1\":0.5}\n", r + 1);
    }
    if (f) fclose(f);
    double u[4];
    int seen = 0;
    CHECK(vlmoe_metrics_expert_shares(path, 0, VLMOE_MOD_TEXT, 2, 2, 2, u, &seen) == VLMOE_OK, "%s", vlmoe_last_error());
    const double want[4] = {0.25, 0.75, 0.5, 0.5}; // (0.2+0.3)/2, (0.8+0.7)/2; (0.4+0.6)/2, (0.6+0.4)/2
    for (int i = 0; i < 4; i++) CHECK_CLOSE(u[i], want[i], 1e-12, 0, "share");
    CHECK(seen == 3, "records with routing: %d", seen);
    // the model has 3 layers: the file does not match it
    double v[6];
    CHECK(vlmoe_metrics_expert_shares(path, 0, VLMOE_MOD_TEXT, 2, 3, 2, v, NULL) == VLMOE_ERR_FORMAT &&
              strstr(vlmoe_last_error(), "test_prune_metrics.jsonl:1"), "layer count mismatch: %s", vlmoe_last_error());
    // a line that is not a record names the file and line
    f = fopen(path, "a");
    if (f) fputs("{\"step\":4,\"kind\":\"tr\n", f), fclose(f);
    CHECK(vlmoe_metrics_expert_shares(path, 0, VLMOE_MOD_TEXT, 2, 2, 2, u, NULL) == VLMOE_ERR_FORMAT &&
              strstr(vlmoe_last_error(), "test_prune_metrics.jsonl:7"), "truncated line: %s", vlmoe_last_error());
    remove(path);
    CHECK(vlmoe_metrics_expert_shares(path, 0, VLMOE_MOD_TEXT, 2, 2, 2, u, NULL) == VLMOE_ERR_IO, "missing file");
}

int main(void) {
    test_metrics_shares();
    check_mode(VLMOE_PRUNE_ROUTER_PRED, "router_pred");
    check_mode(VLMOE_PRUNE_ROUTER_DROP, "router_drop");
    test_errors();
    return test_summary("test_prune");
}
