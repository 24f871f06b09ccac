// clip_folder.c: `vlmoe import DIR|FILE`: a CLIP as people download it. A Hugging Face folder
// (config.json with text_config/vision_config, model.safetensors, tokenizer.json or vocab.json +
// merges.txt, preprocessor_config.json) or an OpenCLIP one (open_clip_config.json with model_cfg
// and preprocess_cfg, open_clip_model.safetensors): heads, activation and LayerNorm eps come from
// the config, every size in it is checked against the tensors, and the tokenizer and the image
// normalisation are recorded in the model (src/nn/inputs.c). PyTorch pickles are recognised by
// their first bytes and refused: vlmoe never runs one. Tests: tests/test_import_export.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/core.h"
#include "io/clip.h"
#include "nn/model.h"
#include "tok/tok.h"
#include "vlmoe.h"

#define CONVERT "python3 -c \"import torch; from safetensors.torch import save_file; " \
                "sd = torch.load('%s', map_location='cpu', weights_only=True); sd = sd.get('state_dict', sd); " \
                "save_file({k: v.contiguous() for k, v in sd.items()}, '%s.safetensors', {'format': 'pt'})\""

int clip_refuse_pickle(const char *path) {
    unsigned char head[4] = {0};
    FILE *f = fopen(path, "rb");
    if (!f) return VLMOE_OK;
    const size_t n = fread(head, 1, sizeof(head), f);
    const char *what = NULL;
    if (n >= 4 && !memcmp(head, "PK\x03\x04", 4)) {
        // torch.save's zip archive names its pickle ".../data.pkl" in the first local header
        char name[512] = {0};
        fseek(f, 30, SEEK_SET);
        const size_t k = fread(name, 1, sizeof(name) - 1, f);
        name[k] = 0;
        int pk = 0;
        for (size_t i = 0; i + 8 <= k && !pk; i++) pk = !memcmp(name + i, "data.pkl", 8);
        what = pk ? "a PyTorch checkpoint (torch.save's zip archive holding data.pkl, a Python pickle)"
                  : "a zip archive, not a safetensors file";
    } else if (n >= 2 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5) {
        what = "a PyTorch checkpoint in the legacy format (a Python pickle stream)";
    }
    fclose(f);
    if (!what) return VLMOE_OK;
    // the name a folder's loader looks for: pytorch_model.bin -> model.safetensors (HF),
    // open_clip_pytorch_model.bin -> open_clip_model.safetensors; else the same stem
    char stem[512];
    const char *dot = strrchr(path, '.'), *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    if (!strcmp(base, "pytorch_model.bin") || !strcmp(base, "open_clip_pytorch_model.bin"))
        snprintf(stem, sizeof(stem), "%.*s%s", (int)(base - path), path, base[0] == 'o' ? "open_clip_model" : "model");
    else
        snprintf(stem, sizeof(stem), "%.*s", (int)(dot && dot > base ? dot - path : (long)strlen(path)), path);
    return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s; vlmoe reads safetensors only and never runs pickles (they can "
                      "execute code). Convert it with: " CONVERT, path, what, path, stem);
}

static int is_dir(const char *p) {
    struct stat s;
    return !stat(p, &s) && S_ISDIR(s.st_mode);
}

static int exists(const char *p) {
    struct stat s;
    return !stat(p, &s);
}

// The JSON file DIR/name; VLMOE_OK with *out NULL when it is absent.
static int read_json(const char *dir, const char *name, cJSON **out, char *path, size_t cap) {
    *out = NULL;
    snprintf(path, cap, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) return VLMOE_OK;
    char *buf = NULL;
    long n = -1;
    if (!fseek(f, 0, SEEK_END) && (n = ftell(f)) >= 0 && n < (64L << 20) && !fseek(f, 0, SEEK_SET) &&
        (buf = malloc((size_t)n + 1)) && fread(buf, 1, (size_t)n, f) == (size_t)n) {
        buf[n] = 0;
        *out = cJSON_Parse(buf);
    }
    fclose(f);
    free(buf);
    if (*out && cJSON_IsObject(*out)) return VLMOE_OK;
    cJSON_Delete(*out);
    *out = NULL;
    return vlmoe_fail(n < 0 || n >= (64L << 20) ? VLMOE_ERR_IO : VLMOE_ERR_FORMAT, "%s: %s", path,
                      n >= (64L << 20) ? "larger than 64 MiB" : n < 0 ? "cannot be read" : "not a JSON object");
}

// An integer field; absent: def. Errors name the file and the field path.
static int int_item(const char *path, const cJSON *v, const char *obj, const char *key, int def, int *out) {
    *out = def;
    if (!v || cJSON_IsNull(v)) return VLMOE_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 || v->valuedouble > 1e7)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: %s%s%s is not a whole number from 0 to 10000000", path, obj,
                          *obj ? "." : "", key);
    *out = (int)v->valuedouble;
    return VLMOE_OK;
}

static int get_int(const char *path, const cJSON *o, const char *obj, const char *key, int def, int *out) {
    return int_item(path, cJSON_GetObjectItemCaseSensitive(o, key), obj, key, def, out);
}

static const char *get_str(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int truthy(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return v && !cJSON_IsNull(v) && !cJSON_IsFalse(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0);
}

// What a folder's config says, in vlmoe's terms (0 / -1: it does not say).
typedef struct {
    const char *kind, *config; // "HF" / "OpenCLIP", the config file
    char config_path[1024], weights[1024];
    int naming;                // index into "openclip", "hf"
    int heads[2], width[2], layers[2], mlp[2], act;
    int embed, image_size, patch, vocab, context;
    double ln_eps;
    int has_norm;
    float mean[3], std[3];
} folder_cfg;

static const char *NAMINGS[2] = {"openclip", "hf"};

static int hf_act(const char *path, const char *field, const char *name, int *act) {
    static const struct { const char *hf; int act; } MAP[] = {
        {"quick_gelu", VLMOE_ACT_QUICK_GELU}, {"gelu", VLMOE_ACT_GELU}, {"gelu_pytorch_tanh", VLMOE_ACT_GELU_TANH},
        {"gelu_new", VLMOE_ACT_GELU_TANH}, // transformers' gelu_new is the same tanh approximation
    };
    for (size_t i = 0; name && i < sizeof(MAP) / sizeof(MAP[0]); i++)
        if (!strcmp(name, MAP[i].hf)) return *act = MAP[i].act, VLMOE_OK;
    return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: %s \"%s\" is not an activation vlmoe has (quick_gelu, gelu, "
                      "gelu_pytorch_tanh, gelu_new)", path, field, name ? name : "(not a string)");
}

static int read_hf(const char *dir, const cJSON *c, folder_cfg *f) {
    const char *path = f->config_path, *type = get_str(c, "model_type");
    if (type && strcmp(type, "clip"))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: model_type \"%s\": vlmoe imports CLIP (\"clip\") models only", path, type);
    const cJSON *tower[2] = {cJSON_GetObjectItemCaseSensitive(c, "vision_config"),
                             cJSON_GetObjectItemCaseSensitive(c, "text_config")};
    // transformers' defaults where a key is left out (CLIPVisionConfig / CLIPTextConfig)
    static const int DEF[2][4] = {{768, 3072, 12, 12}, {512, 2048, 8, 12}};
    static const char *OBJ[2] = {"vision_config", "text_config"};
    int st = get_int(path, c, "", "projection_dim", 512, &f->embed), act[2];
    for (int t = 0; t < 2 && !st; t++) {
        if (tower[t] && !cJSON_IsObject(tower[t]))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: %s is not an object", path, OBJ[t]);
        char field[64];
        snprintf(field, sizeof(field), "%s.hidden_act", OBJ[t]);
        const char *a = get_str(tower[t], "hidden_act");
        if (!(st = get_int(path, tower[t], OBJ[t], "hidden_size", DEF[t][0], &f->width[t])) &&
            !(st = get_int(path, tower[t], OBJ[t], "intermediate_size", DEF[t][1], &f->mlp[t])) &&
            !(st = get_int(path, tower[t], OBJ[t], "num_attention_heads", DEF[t][2], &f->heads[t])) &&
            !(st = get_int(path, tower[t], OBJ[t], "num_hidden_layers", DEF[t][3], &f->layers[t])))
            st = hf_act(path, field, a ? a : "quick_gelu", &act[t]);
        const cJSON *eps = cJSON_GetObjectItemCaseSensitive(tower[t], "layer_norm_eps");
        if (!st && eps && cJSON_IsNumber(eps)) {
            if (f->ln_eps > 0 && f->ln_eps != eps->valuedouble)
                return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: the towers' layer_norm_eps differ (%g, %g); vlmoe has one",
                                  path, f->ln_eps, eps->valuedouble);
            f->ln_eps = eps->valuedouble;
        }
    }
    if (!st && act[0] != act[1])
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: vision_config.hidden_act and text_config.hidden_act differ; "
                          "vlmoe models have one activation", path);
    f->act = act[0];
    if (!st) st = get_int(path, tower[0], OBJ[0], "image_size", 224, &f->image_size);
    if (!st) st = get_int(path, tower[0], OBJ[0], "patch_size", 32, &f->patch);
    if (!st) st = get_int(path, tower[1], OBJ[1], "vocab_size", 49408, &f->vocab);
    if (!st) st = get_int(path, tower[1], OBJ[1], "max_position_embeddings", 77, &f->context);
    snprintf(f->weights, sizeof(f->weights), "%s/model.safetensors", dir);
    if (!exists(f->weights)) snprintf(f->weights, sizeof(f->weights), "%s/pytorch_model.bin", dir);
    return st;
}

// OpenCLIP's CLIPVisionCfg / CLIPTextCfg options that change the computation away from OpenAI
// CLIP's, which is the one vlmoe implements: refused by name rather than imported wrongly.
static int openclip_unsupported(const char *path, const cJSON *v, const cJSON *t) {
    static const char *VKEYS[] = {"timm_model_name", "attentional_pool", "no_ln_pre", "final_ln_after_pool",
                                  "ls_init_value", "output_tokens"};
    static const char *TKEYS[] = {"hf_model_name", "embed_cls", "ls_init_value", "proj_bias", "no_causal_mask",
                                  "final_ln_after_pool"};
    for (size_t i = 0; i < sizeof(VKEYS) / sizeof(*VKEYS); i++)
        if (truthy(v, VKEYS[i]))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: model_cfg.vision_cfg.%s is set: not OpenAI CLIP's vision tower, "
                              "which is what vlmoe imports", path, VKEYS[i]);
    for (size_t i = 0; i < sizeof(TKEYS) / sizeof(*TKEYS); i++)
        if (truthy(t, TKEYS[i]))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: model_cfg.text_cfg.%s is set: not OpenAI CLIP's text tower, "
                              "which is what vlmoe imports", path, TKEYS[i]);
    const char *vp = get_str(v, "pool_type"), *tp = get_str(t, "pool_type");
    if ((vp && strcmp(vp, "tok")) || (tp && strcmp(tp, "argmax")))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: pool_type \"%s\": vlmoe pools at the class token (vision \"tok\") and "
                          "at the end-of-text token (text \"argmax\")", path, vp && strcmp(vp, "tok") ? vp : tp);
    return VLMOE_OK;
}

// Three numbers > lo (std: > 0) of a JSON array.
static int read3(const char *path, const cJSON *o, const char *obj, const char *key, int positive, float out[3]) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, key);
    int ok = cJSON_IsArray(a) && cJSON_GetArraySize(a) == 3;
    for (int i = 0; ok && i < 3; i++) {
        const cJSON *x = cJSON_GetArrayItem(a, i);
        ok = cJSON_IsNumber(x) && isfinite(x->valuedouble) && (!positive || x->valuedouble > 0);
        if (ok) out[i] = (float)x->valuedouble;
    }
    return ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_CONFIG, "%s: %s.%s must be 3 finite numbers%s", path, obj, key,
                                      positive ? " > 0" : "");
}

static int read_openclip(const char *dir, const cJSON *c, folder_cfg *f) {
    const char *path = f->config_path;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(c, "model_cfg");
    if (!cJSON_IsObject(m)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: no model_cfg object", path);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(m, "vision_cfg"), *t = cJSON_GetObjectItemCaseSensitive(m, "text_cfg");
    if (!cJSON_IsObject(v) || !cJSON_IsObject(t))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: model_cfg needs vision_cfg and text_cfg objects", path);
    int st = openclip_unsupported(path, v, t), head_width = 64;
    double ratio[2] = {4.0, 4.0};
    for (int k = 0; k < 2; k++) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(k ? t : v, "mlp_ratio");
        if (cJSON_IsNumber(r)) ratio[k] = r->valuedouble;
    }
    // OpenCLIP's defaults: CLIPVisionCfg(width 768, layers 12, head_width 64, patch 16, image 224),
    // CLIPTextCfg(context 77, vocab 49408, width 512, heads 8, layers 12)
    if (!st) st = get_int(path, m, "model_cfg", "embed_dim", 512, &f->embed);
    if (!st) st = get_int(path, v, "model_cfg.vision_cfg", "width", 768, &f->width[0]);
    if (!st) st = get_int(path, v, "model_cfg.vision_cfg", "layers", 12, &f->layers[0]);
    if (!st) st = get_int(path, v, "model_cfg.vision_cfg", "head_width", 64, &head_width);
    if (!st) st = get_int(path, v, "model_cfg.vision_cfg", "patch_size", 16, &f->patch);
    if (!st) st = get_int(path, v, "model_cfg.vision_cfg", "image_size", 224, &f->image_size);
    if (!st) st = get_int(path, t, "model_cfg.text_cfg", "width", 512, &f->width[1]);
    if (!st) st = get_int(path, t, "model_cfg.text_cfg", "layers", 12, &f->layers[1]);
    if (!st) st = get_int(path, t, "model_cfg.text_cfg", "heads", 8, &f->heads[1]);
    if (!st) st = get_int(path, t, "model_cfg.text_cfg", "context_length", 77, &f->context);
    if (!st) st = get_int(path, t, "model_cfg.text_cfg", "vocab_size", 49408, &f->vocab);
    if (st) return st;
    if (head_width < 1 || f->width[0] % head_width)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: model_cfg.vision_cfg.head_width %d does not divide width %d", path,
                          head_width, f->width[0]);
    f->heads[0] = f->width[0] / head_width;
    f->mlp[0] = (int)(f->width[0] * ratio[0]), f->mlp[1] = (int)(f->width[1] * ratio[1]); // OpenCLIP's int(width * ratio)
    f->act = truthy(m, "quick_gelu") ? VLMOE_ACT_QUICK_GELU : VLMOE_ACT_GELU; // OpenCLIP: nn.GELU unless quick_gelu
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(m, "norm_kwargs"), *eps = cJSON_GetObjectItemCaseSensitive(norm, "eps");
    if (cJSON_IsNumber(eps)) f->ln_eps = eps->valuedouble;
    // preprocess_cfg: OpenCLIP's defaults are OpenAI's mean and std, bicubic, shortest-side resize
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(c, "preprocess_cfg");
    const float mean[3] = {0.48145466f, 0.4578275f, 0.40821073f}, sd[3] = {0.26862954f, 0.26130258f, 0.27577711f};
    memcpy(f->mean, mean, sizeof(mean)), memcpy(f->std, sd, sizeof(sd));
    f->has_norm = 1;
    if (pre && !cJSON_IsObject(pre)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: preprocess_cfg is not an object", path);
    if (cJSON_GetObjectItemCaseSensitive(pre, "mean") && (st = read3(path, pre, "preprocess_cfg", "mean", 0, f->mean))) return st;
    if (cJSON_GetObjectItemCaseSensitive(pre, "std") && (st = read3(path, pre, "preprocess_cfg", "std", 1, f->std))) return st;
    const char *interp = get_str(pre, "interpolation"), *mode = get_str(pre, "resize_mode");
    if ((interp && strcmp(interp, "bicubic")) || (mode && strcmp(mode, "shortest")))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: preprocess_cfg.%s \"%s\": vlmoe preprocesses with OpenCLIP's default "
                          "(shortest side, bicubic, center crop) only", path, interp && strcmp(interp, "bicubic") ?
                          "interpolation" : "resize_mode", interp && strcmp(interp, "bicubic") ? interp : mode);
    // size: one number or [height, width], each the image size (vlmoe crops squares)
    const cJSON *sz = cJSON_GetObjectItemCaseSensitive(pre, "size");
    int size[2] = {f->image_size, f->image_size};
    if (cJSON_IsArray(sz) && cJSON_GetArraySize(sz) == 2) {
        st = int_item(path, sz->child, "preprocess_cfg", "size[0]", f->image_size, &size[0]);
        if (!st) st = int_item(path, sz->child->next, "preprocess_cfg", "size[1]", f->image_size, &size[1]);
    } else {
        st = get_int(path, pre, "preprocess_cfg", "size", f->image_size, &size[0]);
        size[1] = size[0];
    }
    if (st) return st;
    if (size[0] != f->image_size || size[1] != f->image_size)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: preprocess_cfg.size %d x %d differs from vision_cfg.image_size %d", path,
                          size[0], size[1], f->image_size);
    snprintf(f->weights, sizeof(f->weights), "%s/open_clip_model.safetensors", dir);
    if (!exists(f->weights)) snprintf(f->weights, sizeof(f->weights), "%s/open_clip_pytorch_model.bin", dir);
    return VLMOE_OK;
}

// HF preprocessor_config.json: the normalisation, and a transform vlmoe implements.
static int read_hf_preprocess(const char *dir, folder_cfg *f) {
    char path[1100];
    cJSON *c;
    int st = read_json(dir, "preprocessor_config.json", &c, path, sizeof(path));
    if (st || !c) return st;
    if (!(st = read3(path, c, "preprocessor_config", "image_mean", 0, f->mean)) &&
        !(st = read3(path, c, "preprocessor_config", "image_std", 1, f->std))) {
        int resample = 3, size = f->image_size, crop = f->image_size;
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(c, "size"), *k = cJSON_GetObjectItemCaseSensitive(c, "crop_size");
        st = get_int(path, c, "", "resample", 3, &resample);
        if (!st) st = cJSON_IsObject(s) ? get_int(path, s, "size", "shortest_edge", size, &size) : get_int(path, c, "", "size", size, &size);
        if (!st) st = cJSON_IsObject(k) ? get_int(path, k, "crop_size", "height", crop, &crop) : get_int(path, c, "", "crop_size", crop, &crop);
        if (!st && resample != 3)
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: resample %d: vlmoe resizes with PIL's bicubic filter (3) only", path, resample);
        // absent, do_center_crop is transformers' default: true
        const int no_crop = cJSON_GetObjectItemCaseSensitive(c, "do_center_crop") && !truthy(c, "do_center_crop");
        if (!st && (size != f->image_size || crop != f->image_size || no_crop))
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: size %d, crop_size %d%s: vlmoe resizes the shorter side to the "
                            "model's image size %d and center-crops it", path, size, crop,
                            no_crop ? ", do_center_crop false" : "", f->image_size);
        f->has_norm = !st;
    }
    cJSON_Delete(c);
    return st;
}

// The folder's tokenizer: tokenizer.json, or vocab.json + merges.txt (whose ids must agree).
static int read_tokenizer(const char *dir, vlmoe_tokenizer **tok, char *used, size_t cap) {
    char path[1100], merges[1100];
    *tok = NULL;
    used[0] = 0;
    snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
    if (exists(path)) {
        snprintf(used, cap, "%s", path);
        return vlmoe_tokenizer_load_hf(tok, path);
    }
    snprintf(merges, sizeof(merges), "%s/merges.txt", dir);
    cJSON *vocab;
    int st = read_json(dir, "vocab.json", &vocab, path, sizeof(path));
    if (st || !vocab || !exists(merges)) {
        cJSON_Delete(vocab);
        return st;
    }
    snprintf(used, cap, "%s + merges.txt", path);
    if (!(st = vlmoe_tokenizer_load_clip(tok, merges))) {
        int n = 0;
        for (const cJSON *e = vocab->child; e && !st; e = e->next, n++) {
            const char *piece = cJSON_IsNumber(e) ? vlmoe_tokenizer_piece(*tok, (int32_t)e->valuedouble) : NULL;
            if (!piece || strcmp(piece, e->string))
                st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: \"%s\" has id %g, but %s gives that id to \"%s\"", path, e->string,
                                cJSON_IsNumber(e) ? e->valuedouble : -1.0, merges, piece ? piece : "nothing");
        }
        if (!st && n != vlmoe_tokenizer_vocab_size(*tok))
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %d entries, but %s makes a vocabulary of %d", path, n, merges,
                            vlmoe_tokenizer_vocab_size(*tok));
    }
    cJSON_Delete(vocab);
    if (st) vlmoe_tokenizer_free(*tok), *tok = NULL;
    return st;
}

// Every size the config names must be what the tensors have.
static int check_sizes(const folder_cfg *f, const vlmoe_model_config *c) {
    const struct { const char *what; int cfg, got; } k[] = {
        {"image width", f->width[0], c->encoder.width}, {"text width", f->width[1], c->text_encoder.width},
        {"image layers", f->layers[0], c->encoder.layers}, {"text layers", f->layers[1], c->text_encoder.layers},
        {"image MLP size", f->mlp[0], c->encoder.mlp_dim}, {"text MLP size", f->mlp[1], c->text_encoder.mlp_dim},
        {"embedding size", f->embed, c->embed_dim}, {"image size", f->image_size, c->image_size},
        {"patch size", f->patch, c->patch_size}, {"vocabulary", f->vocab, c->vocab_size},
        {"context length", f->context, c->context_length},
    };
    for (size_t i = 0; i < sizeof(k) / sizeof(*k); i++)
        if (k[i].cfg != k[i].got)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s says %s %d, but %s has %d", f->config_path, k[i].what, k[i].cfg,
                              f->weights, k[i].got);
    return VLMOE_OK;
}

static int import_folder(vlmoe_model **out, const char *dir, const vlmoe_clip_import_params *p) {
    folder_cfg f = {0};
    cJSON *c = NULL;
    int st = read_json(dir, "open_clip_config.json", &c, f.config_path, sizeof(f.config_path));
    if (!st && c) {
        f.kind = "OpenCLIP", f.naming = 0;
        st = read_openclip(dir, c, &f);
    } else if (!st && !(st = read_json(dir, "config.json", &c, f.config_path, sizeof(f.config_path))) && c) {
        f.kind = "HF", f.naming = 1;
        st = read_hf(dir, c, &f);
        if (!st) st = read_hf_preprocess(dir, &f);
    } else if (!st) {
        st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: a folder without config.json (Hugging Face CLIP) or "
                        "open_clip_config.json (OpenCLIP): import its .safetensors file instead", dir);
    }
    cJSON_Delete(c);
    if (st) return st;
    if (!exists(f.weights))
        return vlmoe_fail(VLMOE_ERR_IO, "%s: no %s (the %s weights beside %s)", dir,
                          f.naming ? "model.safetensors" : "open_clip_model.safetensors", f.kind, f.config_path);
    if ((st = clip_refuse_pickle(f.weights))) return st;
    // a flag may repeat the config, never contradict it
    static const char *ACT[] = {"gelu", "gelu_tanh", "quick_gelu"};
    const int given[2] = {p->image_heads, p->text_heads};
    for (int t = 0; t < 2; t++)
        if (given[t] && given[t] != f.heads[t])
            return vlmoe_fail(VLMOE_ERR_ARG, "--%s-heads %d contradicts %s, which gives the %s tower %d heads", t ? "text" : "image",
                              given[t], f.config_path, t ? "text" : "image", f.heads[t]);
    if (p->act >= 0 && p->act != f.act)
        return vlmoe_fail(VLMOE_ERR_ARG, "--act %s contradicts %s, which says %s", ACT[p->act % 3], f.config_path, ACT[f.act]);
    if (p->naming && strcmp(p->naming, "auto") && strcmp(p->naming, NAMINGS[f.naming]))
        return vlmoe_fail(VLMOE_ERR_ARG, "--from %s contradicts %s: an %s folder has %s names", p->naming, f.config_path,
                          f.kind, NAMINGS[f.naming]);
    vlmoe_clip_import_params q = *p;
    q.naming = NAMINGS[f.naming], q.image_heads = f.heads[0], q.text_heads = f.heads[1], q.act = f.act;
    const clip_file_opts o = {.strict_heads = 1, .ln_eps = f.ln_eps};
    vlmoe_model *m = NULL;
    if ((st = clip_import_file(&m, f.weights, &q, &o))) return st;
    const vlmoe_model_config *mc = vlmoe_model_get_config(m);
    vlmoe_tokenizer *tok = NULL;
    char used[1200];
    if (!(st = check_sizes(&f, mc)) && !(st = read_tokenizer(dir, &tok, used, sizeof(used))) && tok) {
        if (vlmoe_tokenizer_vocab_size(tok) > mc->vocab_size)
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %d ids, more than the model's vocabulary of %d", used,
                            vlmoe_tokenizer_vocab_size(tok), mc->vocab_size);
        if (!st) st = model_set_tokenizer(m, tok);
    }
    vlmoe_tokenizer_free(tok);
    if (!st && f.has_norm) model_set_image_norm(m, f.mean, f.std);
    if (st) return vlmoe_model_free(m), st;
    *out = m;
    return VLMOE_OK;
}

int vlmoe_clip_import_path(vlmoe_model **out, const char *path, const vlmoe_clip_import_params *p) {
    *out = NULL;
    vlmoe_clip_import_params dp = vlmoe_clip_import_default_params();
    if (!p) p = &dp;
    if (!path) return vlmoe_fail(VLMOE_ERR_ARG, "CLIP import: no path");
    if (is_dir(path)) return import_folder(out, path, p);
    const clip_file_opts o = {.strict_heads = 1};
    return clip_import_file(out, path, p, &o);
}
