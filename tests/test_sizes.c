// test_sizes.c: the papers' named sizes (src/nn/sizes.c) and `vlmoe info` (cli/info.c): each
// size's shape, MoE blocks and experts; LIMoE-B/16's parameters, parameters per token and GFLOP
// per pair against the hand calculation below; LIMoE-H/14 against the paper's 5.6B / 675M; one
// training step of LIMoE-S/16, the smallest LIMoE (about 2.5 GB). One step of CLIP-UP B/16 and
// VL-MoE base, the smallest of theirs (0.6 and 0.8 billion parameters, 5 to 7 GB), runs when
// VLMOE_TEST_BIG=1. Nothing here allocates the large sizes: their cost comes from the config.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "vlmoe.h"

static const char *bin;
static char dir[64], out[16384];

static const char *NAMES[] = {"limoe-S/16", "limoe-B/32", "limoe-B/16", "limoe-L/32", "limoe-L/16", "limoe-H/14",
                              "clipup-B/16", "clipup-L/14", "vlmoe-base", "vlmoe-large"};
#define NNAMES ((int)(sizeof(NAMES) / sizeof(NAMES[0])))

static uint64_t blocks(const int *one_based, int n) {
    uint64_t m = 0;
    for (int i = 0; i < n; i++) m |= 1ULL << (one_based[i] - 1);
    return m;
}

// Every size: the paper's widths, depths, MoE blocks and experts; valid; a JSON round trip;
// its cost computed.
static void test_shapes(void) {
    for (int i = 0; i < NNAMES; i++) {
        vlmoe_model_config c, back;
        CHECK(vlmoe_config_named(NAMES[i], &c) == VLMOE_OK, "%s: %s", NAMES[i], vlmoe_last_error());
        CHECK(!strcmp(c.name, NAMES[i]), "%s: named %s", NAMES[i], c.name);
        CHECK(vlmoe_config_validate(&c) == VLMOE_OK, "%s: %s", NAMES[i], vlmoe_last_error());
        char *js = vlmoe_config_to_json(&c);
        CHECK(js && vlmoe_config_from_json(js, NAMES[i], &back) == VLMOE_OK && !memcmp(&back, &c, sizeof(c)),
              "%s: JSON round trip: %s", NAMES[i], vlmoe_last_error());
        free(js);
        vlmoe_model_cost k;
        CHECK(vlmoe_config_cost(&c, &k) == VLMOE_OK && k.params > 0 && k.active_params < k.params &&
                  k.gflop_pair > 0, "%s: cost: %s", NAMES[i], vlmoe_last_error());
    }
    vlmoe_model_config c;
    // LIMoE Table 4: S/16 is 8 blocks of width 512, MLP 2048, 8 heads; output 512; 32 experts
    // every second block (A: "experts placed every 2 layers"), Table 5's thresholds log 9 / log 20
    const int every2_8[4] = {2, 4, 6, 8}, every2_12[6] = {2, 4, 6, 8, 10, 12};
    vlmoe_config_named("limoe-S/16", &c);
    CHECK(c.arch == VLMOE_ARCH_ONE_TOWER && c.encoder.width == 512 && c.encoder.layers == 8 && c.encoder.heads == 8 &&
              c.encoder.mlp_dim == 2048 && c.embed_dim == 512 && c.patch_size == 16 && c.image_size == 224 &&
              c.context_length == 16 && c.vocab_size == 32000 && c.moe.num_experts == 32 && c.moe.top_k == 1 &&
              c.moe.layers == blocks(every2_8, 4) && fabs(c.moe.global_tau[VLMOE_MOD_TEXT] - log(9)) < 1e-12,
          "limoe-S/16 is not LIMoE's S/16");
    vlmoe_config_named("limoe-B/16", &c);
    CHECK(c.encoder.width == 768 && c.encoder.layers == 12 && c.encoder.mlp_dim == 3072 && c.moe.num_experts == 32 &&
              c.moe.layers == blocks(every2_12, 6), "limoe-B/16 is not LIMoE's B/16");
    vlmoe_config_named("limoe-L/16", &c);
    CHECK(c.encoder.width == 1024 && c.encoder.layers == 24 && c.encoder.heads == 16 && c.moe.layers == 0xAAAAAA &&
              fabs(c.moe.global_tau[VLMOE_MOD_TEXT] - log(28)) < 1e-12, "limoe-L/16 is not LIMoE's L/16");
    // A.3: MoE in blocks 3, 7, 11, 15, 18, 21, 24, 26, 28, 30, 31, 32; thresholds log 4 / log 25
    const int h14[12] = {3, 7, 11, 15, 18, 21, 24, 26, 28, 30, 31, 32};
    vlmoe_config_named("limoe-H/14", &c);
    CHECK(c.encoder.width == 1280 && c.encoder.layers == 32 && c.encoder.mlp_dim == 5120 && c.patch_size == 14 &&
              c.moe.layers == blocks(h14, 12) && c.moe.num_experts == 32 &&
              fabs(c.moe.global_tau[VLMOE_MOD_TEXT] - log(4)) < 1e-12 &&
              fabs(c.moe.global_tau[VLMOE_MOD_IMAGE] - log(25)) < 1e-12, "limoe-H/14 is not LIMoE's H/14");
    // CLIP-UP: both towers, MoE in every second block (6 of 12 in B/16), 8 experts, top-2
    vlmoe_config_named("clipup-B/16", &c);
    CHECK(c.arch == VLMOE_ARCH_TWO_TOWER && c.moe.layers == blocks(every2_12, 6) && c.text_moe.layers == c.moe.layers &&
              c.moe.num_experts == 8 && c.moe.top_k == 2 && c.text_moe.top_k == 2 && c.moe.capacity_factor == 2,
          "clipup-B/16 is not CLIP-UP's B/16");
    vlmoe_config_named("clipup-L/14", &c);
    CHECK(c.encoder.layers == 24 && c.encoder.width == 1024 && c.patch_size == 14 && c.moe.layers == 0xAAAAAA,
          "clipup-L/14 is not CLIP-UP's L/14");
    // VL-MoE base: 12 blocks of 768, VL-FFN from the 10th (F = 3), V-/T-MoE of 16 experts in every
    // second block below; large: 24 blocks of 1024, VL-FFN from the 20th (F = 5)
    const int below9[4] = {2, 4, 6, 8}, below19[9] = {2, 4, 6, 8, 10, 12, 14, 16, 18};
    vlmoe_config_named("vlmoe-base", &c);
    CHECK(c.arch == VLMOE_ARCH_MOME && c.encoder.layers == 12 && c.encoder.width == 768 && c.vl_layers == 3 &&
              c.moe.num_experts == 16 && c.text_moe.num_experts == 16 && c.moe.layers == blocks(below9, 4) &&
              c.text_moe.layers == c.moe.layers && c.moe.order == VLMOE_ORDER_BPR, "vlmoe-base is not VL-MoE base/16E");
    vlmoe_config_named("vlmoe-large", &c);
    CHECK(c.encoder.layers == 24 && c.encoder.width == 1024 && c.vl_layers == 5 && c.moe.layers == blocks(below19, 9),
          "vlmoe-large is not VL-MoE large/16E");
}

// LIMoE-B/16 by hand (D 768, M 3072, 12 blocks, MoE in 6 of them with E 32, K 1; 196 patches of
// 16x16x3, 16 text tokens from a 32000 vocabulary, output 512; biases on every dense layer, none
// on the router, LayerNorm weight and bias, mean pooling):
//   attention half of a block: LN 2D + QKV D*3D + 3D + out D*D + D + LN 2D  = 2,365,440
//   an MLP: D*M + M + M*D + D                                                 = 4,722,432
//   dense block 7,087,872 (x6 = 42,527,232); MoE block 2,365,440 + 32 MLPs 151,117,824 + router
//   32*D 24,576 = 153,507,840 (x6 = 921,047,040)
//   stems: patch 768*768 + 768 = 590,592, image positions 196*768 = 150,528, token table
//   32000*768 = 24,576,000, text positions 16*768 = 12,288; final LN 2*768 = 1,536; projections
//   2*768*512 = 786,432; logit scale 1
//   total 989,691,649; per token all but 31 experts in each MoE layer: - 6*31*4,722,432 =
//   - 878,372,352, so 111,319,297
// GFLOP (multiply-add = 2): a block per token 8D^2 = 4,718,592 plus the MLP 4DM = 9,437,184, plus
// attention 4SD (S = 196: 602,112; S = 16: 49,152), plus the router 2*D*32 = 49,152 in 6 blocks:
//   image: 196 * (12 * (14,155,776 + 602,112) + 6 * 49,152) = 34,768,355,328, patch embedding
//          196 * 2*768*768 = 231,211,008, projection 2*768*512 = 786,432: 35.0003528 GFLOP
//   text:  16 * (12 * (14,155,776 + 49,152) + 6 * 49,152) = 2,732,064,768 + 786,432: 2.7328512
//   pair:  37.7332040 GFLOP
static void test_limoe_b16(void) {
    vlmoe_model_config c;
    vlmoe_model_cost k;
    vlmoe_config_named("limoe-B/16", &c);
    CHECK(vlmoe_config_cost(&c, &k) == VLMOE_OK, "cost: %s", vlmoe_last_error());
    CHECK(k.moe_layers == 6 && k.image_tokens == 196 && k.text_tokens == 16, "B/16: %d MoE layers, %d + %d tokens",
          k.moe_layers, k.image_tokens, k.text_tokens);
    const double dense = 6 * 7087872.0, moe = 6 * 153507840.0, stems = 590592 + 150528 + 24576000 + 12288;
    const double total = dense + moe + stems + 1536 + 786432 + 1;
    CHECK(total == 989691649.0 && k.params == total, "B/16: %.0f parameters, by hand %.0f", k.params, total);
    CHECK(k.active_params == total - 878372352.0, "B/16: %.0f per token, by hand %.0f", k.active_params,
          total - 878372352.0);
    CHECK_CLOSE(k.gflop_image, 35.0003528, 1e-6, 0, "B/16 GFLOP per image");
    CHECK_CLOSE(k.gflop_text, 2.7328512, 1e-6, 0, "B/16 GFLOP per text");
    CHECK_CLOSE(k.gflop_pair, 37.7332040, 1e-6, 0, "B/16 GFLOP per pair");
    printf("limoe-B/16: %.1fM parameters, %.1fM per token, %.2f GFLOP per pair (as by hand)\n", k.params / 1e6,
           k.active_params / 1e6, k.gflop_pair);
    // LIMoE-H/14: "a large 5.6B parameter LIMoE-H/14, which applies 675M parameters per token"
    vlmoe_config_named("limoe-H/14", &c);
    CHECK(vlmoe_config_cost(&c, &k) == VLMOE_OK, "cost: %s", vlmoe_last_error());
    CHECK(fabs(k.params / 5.6e9 - 1) < 0.01 && fabs(k.active_params / 675e6 - 1) < 0.005,
          "H/14: %.3gB parameters (paper 5.6B), %.1fM per token (paper 675M)", k.params / 1e9, k.active_params / 1e6);
    printf("limoe-H/14: %.2fB parameters (paper 5.6B), %.1fM per token (paper 675M)\n", k.params / 1e9,
           k.active_params / 1e6);
}

// One optimizer step of a contrastive model (one_tower or two_tower) on 2 synthetic pairs.
static void step_contrastive(const char *name, vlmoe_opt_kind kind) {
    vlmoe_model_config c;
    vlmoe_config_named(name, &c);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c.image_size;
    vlmoe_synth *data = NULL;
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    const int B = 2, T = c.context_length;
    float *img = malloc(sizeof(float) * B * 3 * c.image_size * c.image_size);
    int32_t tok[2 * 16], lens[2];
    CHECK(T <= 16, "%s: context %d", name, T);
    int ok = img && T <= 16 && vlmoe_synth_init(&data, &sp) == VLMOE_OK && vlmoe_model_init(&m, &c, 1) == VLMOE_OK;
    vlmoe_train_params tp = vlmoe_train_default_params();
    // Adafactor without momentum keeps the optimizer's state small (factored second moments)
    tp.optim = vlmoe_optim_default_params(kind);
    tp.optim.beta1 = 0;
    ok = ok && vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK;
    CHECK(ok, "%s: %s", name, vlmoe_last_error());
    if (ok) {
        vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, 0, B, T, img, tok, lens);
        vlmoe_batch b = {B, img, tok, lens};
        vlmoe_step_stats s;
        const size_t n = vlmoe_model_num_floats(m);
        const float before = vlmoe_model_param_data(m)[n - 2];
        int st = vlmoe_trainer_step(t, &b, &s);
        CHECK(st == VLMOE_OK && isfinite(s.loss) && s.loss > 0 && vlmoe_model_param_data(m)[n - 2] != before,
              "%s: one step: %s (loss %g)", name, st ? vlmoe_last_error() : "", s.loss);
        printf("%s: one training step on %d pairs, loss %.4f\n", name, B, s.loss);
    }
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    vlmoe_synth_free(data);
    free(img);
}

// One optimizer step of VL-MoE on 2 image-text pairs, masked language modeling on the pair.
static void step_vlmoe(const char *name) {
    vlmoe_model_config c;
    vlmoe_config_named(name, &c);
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    const int B = 2, T = c.context_length, P = c.image_size;
    float *img = calloc((size_t)B * 3 * P * P, sizeof(float));
    int32_t *tok = calloc((size_t)B * T, sizeof(int32_t)), *lab = calloc((size_t)B * T, sizeof(int32_t)), lens[2] = {12, 20};
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAFACTOR);
    tp.optim.beta1 = 0;
    int ok = img && tok && lab && vlmoe_model_init(&m, &c, 1) == VLMOE_OK && vlmoe_trainer_init(&t, m, &tp) == VLMOE_OK;
    CHECK(ok, "%s: %s", name, vlmoe_last_error());
    if (ok) {
        for (int i = 0; i < B * 3 * P * P; i++) img[i] = (float)((i * 37 % 101) / 50.0 - 1);
        for (int i = 0; i < B * T; i++) tok[i] = 1 + i * 13 % 900, lab[i] = i % 5 == 2 && i % T < lens[i / T] ? tok[i] : -1;
        const vlmoe_mome_batch part = {.encoding = VLMOE_ENC_PAIR, .batch_size = B, .images = img, .tokens = tok,
                                       .lengths = lens, .text_labels = lab};
        vlmoe_mome_stats ps;
        vlmoe_step_stats s;
        int st = vlmoe_trainer_step_mome(t, &part, 1, &ps, &s);
        CHECK(st == VLMOE_OK && isfinite(s.loss), "%s: one step: %s", name, st ? vlmoe_last_error() : "");
        printf("%s: one training step on %d pairs, loss %.4f\n", name, B, s.loss);
    }
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    free(img), free(tok), free(lab);
}

// `vlmoe info`: the library's numbers, as text and JSON; bad input named.
static void test_info_cli(void) {
    test_expect_in(dir, bin, "info --model limoe-B/16", 0, "parameters           989.7M", out, sizeof(out));
    CHECK(strstr(out, "active per token     111.3M") && strstr(out, "GFLOP per pair       37.73"), "info:\n%s", out);
    test_expect_in(dir, bin, "info --model limoe-H/14 --json", 0, "\"active_params\":", out, sizeof(out));
    CHECK(strstr(out, "\"params\":\t5553") && strstr(out, "\"moe_layers\":\t12"), "info --json:\n%s", out);
    test_expect_in(dir, bin, "info", 1, "give --model NAME|FILE.json", out, sizeof(out));
    test_expect_in(dir, bin, "info --model limoe-Z/99", 1, "--model limoe-Z/99: unknown model", out,
                   sizeof(out));
    test_expect_in(dir, bin, "info --model vlmoe-base --bogus", 2, "--bogus", out, sizeof(out));
    test_expect_in(dir, bin, "--help", 0, "info       parameters", out, sizeof(out));
}

int main(int argc, char **argv) {
    static char abs[4096];
    test_shapes();
    test_limoe_b16();
    step_contrastive("limoe-S/16", VLMOE_OPT_ADAFACTOR);
    const char *big = getenv("VLMOE_TEST_BIG");
    if (big && (!strcmp(big, "1") || !strcmp(big, "vlmoe"))) { // "vlmoe": that one alone
        if (strcmp(big, "vlmoe")) step_contrastive("clipup-B/16", VLMOE_OPT_ADAFACTOR);
        step_vlmoe("vlmoe-base");
    } else {
        printf("test_sizes: VLMOE_TEST_BIG=1 also trains a step of clipup-B/16 and vlmoe-base (5-7 GB)\n");
    }
    if ((bin = test_vlmoe_bin(argv[0], abs))) {
        snprintf(dir, sizeof(dir), "/tmp/vlmoe_sizes_XXXXXX");
        CHECK(mkdtemp(dir) != NULL, "mkdtemp");
        test_info_cli();
        rmdir(dir);
    }
    return test_summary("test_sizes");
}
