// sizes.c: the papers' named sizes (LIMoE app. A and C.1 Table 4/5, CLIP-UP sec. 4, VL-MoE sec.
// 4.1); what a model costs is in cost.c. Covered by tests/test_sizes.c, which instantiates each and
// trains a step of the smallest of each family.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "nn/sizes.h"
#include "vlmoe.h"

// A LIMoE-style encoder (app. A: "architecture parameters follow those of ViT"): GELU, LayerNorm
// eps 1e-6, mean pooling, no class token, texts of 16 T5 SentencePiece tokens (vocabulary 32000),
// temperature initialised at 10. Widths and depths as ViT's (LIMoE Table 4).
static vlmoe_model_config vit(const char *name, int img, int patch, int w, int l, int h, int mlp, int emb) {
    vlmoe_model_config c;
    memset(&c, 0, sizeof(c));
    snprintf(c.name, sizeof(c.name), "%s", name);
    c.arch = VLMOE_ARCH_ONE_TOWER;
    c.image_size = img, c.patch_size = patch, c.channels = 3;
    c.vocab_size = 32000, c.context_length = 16;
    c.embed_dim = emb;
    c.encoder = (vlmoe_encoder_config){w, l, h, mlp};
    c.act = VLMOE_ACT_GELU;
    c.ln_eps = 1e-6;
    c.patch_bias = 1;
    c.image_pool = c.text_pool = VLMOE_POOL_MEAN;
    c.init_temperature = 10.0;
    c.max_temperature = 100.0;
    return c;
}

// LIMoE: 32 experts every second block unless listed (A.3), the limoe preset, the global-entropy
// thresholds of Table 5 (log S_text, log S_image).
static void limoe_moe(vlmoe_model_config *c, uint64_t layers, double s_text, double s_image) {
    c->moe.layers = layers ? layers : vlmoe_moe_every(2, c->encoder.layers);
    c->moe.num_experts = 32;
    vlmoe_moe_preset("limoe", &c->moe);
    c->moe.global_tau[VLMOE_MOD_TEXT] = log(s_text);
    c->moe.global_tau[VLMOE_MOD_IMAGE] = log(s_image);
}

// The blocks (1-based) of LIMoE-H/14's 12 MoE layers, app. A.3.
static const int H14_MOE[12] = {3, 7, 11, 15, 18, 21, 24, 26, 28, 30, 31, 32};

static int limoe_named(const char *size, vlmoe_model_config *out) {
    char name[64];
    snprintf(name, sizeof(name), "limoe-%s", size);
    if (!strcmp(size, "S/16")) {
        *out = vit(name, 224, 16, 512, 8, 8, 2048, 512);
        limoe_moe(out, 0, 9, 20);
    } else if (!strcmp(size, "B/32")) {
        *out = vit(name, 224, 32, 768, 12, 12, 3072, 512);
        limoe_moe(out, 0, 12, 17);
    } else if (!strcmp(size, "B/16")) {
        *out = vit(name, 224, 16, 768, 12, 12, 3072, 512);
        limoe_moe(out, 0, 9, 20);
    } else if (!strcmp(size, "L/32")) {
        *out = vit(name, 224, 32, 1024, 24, 16, 4096, 512);
        limoe_moe(out, 0, 20, 1);
    } else if (!strcmp(size, "L/16")) {
        *out = vit(name, 224, 16, 1024, 24, 16, 4096, 512);
        limoe_moe(out, 0, 28, 8);
    } else if (!strcmp(size, "H/14")) {
        // A.3 trains at resolution 288; a 14-pixel patchify (VALID, as big_vision's) of 288
        // pixels gives 20 x 20 patches and drops the last 8 rows and columns: the same tokens and
        // cost as 280, which is the size our patchify needs (a multiple of the patch). Its
        // output dimension is not 512 (app. A); 1280, the width, gives the 675M parameters per
        // token of Table 1 (see tests/test_sizes.c).
        *out = vit(name, 280, 14, 1280, 32, 16, 5120, 1280);
        uint64_t layers = 0;
        for (int i = 0; i < 12; i++) layers |= 1ULL << (H14_MOE[i] - 1);
        limoe_moe(out, layers, 4, 25);
    } else {
        return 1;
    }
    return 0;
}

// CLIP-UP (sec. 4): separate towers (the upcycled "separated backbone"), each ViT-sized as the
// LIMoE B/16 it starts from (the text tower T-x "with the equivalent parameters of ViT-x", LIMoE
// Table 1), MoE in every second block of both, 8 experts, top-2, the clipup preset; 224 pixels.
static int clipup_named(const char *size, vlmoe_model_config *out) {
    char name[64];
    snprintf(name, sizeof(name), "clipup-%s", size);
    if (!strcmp(size, "B/16")) {
        *out = vit(name, 224, 16, 768, 12, 12, 3072, 512);
    } else if (!strcmp(size, "L/14")) {
        *out = vit(name, 224, 14, 1024, 24, 16, 4096, 512);
    } else {
        return 1;
    }
    out->arch = VLMOE_ARCH_TWO_TOWER;
    out->text_encoder = out->encoder;
    out->moe.layers = out->text_moe.layers = vlmoe_moe_every(2, out->encoder.layers);
    out->moe.num_experts = out->text_moe.num_experts = 8;
    vlmoe_moe_preset("clipup", &out->moe);
    vlmoe_moe_preset("clipup", &out->text_moe);
    return 0;
}

// VL-MoE (sec. 4.1): BEiT-3's MoME Transformer, 224 pixels in 16-pixel patches with [I_CLS],
// texts of up to 96 SentencePiece tokens (vocabulary 64000, the last id [MASK]), BEiT's 8192
// visual tokens; VL-FFN in the top F blocks; V-MoE and T-MoE of E = 16 experts in every second
// block below them. Base: 12 blocks of 768 (VL-FFN from the 10th, F = 3); large: 24 of 1024 (from
// the 20th, F = 5), with 16 heads: the paper's "24 attention heads" do not divide 1024, and
// VLMo/BEiT-3 large, which it follows, use 16.
static int vlmoe_named(const char *size, vlmoe_model_config *out) {
    char name[64];
    snprintf(name, sizeof(name), "vlmoe-%s", size);
    if (!strcmp(size, "base")) {
        *out = vit(name, 224, 16, 768, 12, 12, 3072, 768);
        out->vl_layers = 3;
    } else if (!strcmp(size, "large")) {
        *out = vit(name, 224, 16, 1024, 24, 16, 4096, 1024);
        out->vl_layers = 5;
    } else {
        return 1;
    }
    out->arch = VLMOE_ARCH_MOME;
    out->vocab_size = 64000;
    out->context_length = 96;
    out->image_class_token = 1;
    out->mim_vocab = 8192;
    out->mask_token = out->vocab_size - 1;
    out->moe.num_experts = out->text_moe.num_experts = 16;
    out->moe.layers = out->text_moe.layers = vlmoe_moe_every(2, out->encoder.layers - out->vl_layers);
    vlmoe_moe_preset("vlmoe-v", &out->moe);
    vlmoe_moe_preset("vlmoe-t", &out->text_moe);
    out->beit_init = 1; // sec. 4.1: "We randomly initialize the model parameters using the method described in BEiT"
    return 0;
}

const char *const SIZES_NAMES = "limoe-S/16, limoe-B/32, limoe-B/16, limoe-L/32, limoe-L/16, limoe-H/14, "
                                "clipup-B/16, clipup-L/14, vlmoe-base, vlmoe-large";

int sizes_named(const char *name, vlmoe_model_config *out) {
    if (!strncmp(name, "limoe-", 6)) return limoe_named(name + 6, out);
    if (!strncmp(name, "clipup-", 7)) return clipup_named(name + 7, out);
    if (!strncmp(name, "vlmoe-", 6)) return vlmoe_named(name + 6, out);
    return 1;
}
