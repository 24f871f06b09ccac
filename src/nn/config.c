// config.c: model configs: the named sizes (MODEL.md: tiny test sizes, ViT-style S/B sizes in
// the LIMoE one_tower layout, OpenAI CLIP's two_tower ViT-B), JSON parsing with strict checking
// (unknown, missing and wrong-typed keys are errors naming the key) and JSON serialisation.
// Covered by tests/test_model.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

static vlmoe_model_config one_tower(const char *name, int img, int patch, int w, int l, int h,
                                    int vocab, int ctx, int emb) {
    vlmoe_model_config c;
    memset(&c, 0, sizeof(c));
    snprintf(c.name, sizeof(c.name), "%s", name);
    c.arch = VLMOE_ARCH_ONE_TOWER;
    c.image_size = img;
    c.patch_size = patch;
    c.channels = 3;
    c.vocab_size = vocab;
    c.context_length = ctx;
    c.embed_dim = emb;
    c.encoder = (vlmoe_encoder_config){w, l, h, 4 * w};
    c.act = VLMOE_ACT_GELU;
    c.ln_eps = 1e-6;
    c.patch_bias = 1;
    c.image_pool = VLMOE_POOL_MEAN;
    c.text_pool = VLMOE_POOL_MEAN;
    c.init_temperature = 10.0; // LIMoE: learned temperature initialised at 10
    c.max_temperature = 100.0;
    return c;
}

// OpenAI CLIP layout: class token + ln_pre, class-token pooling, causal text pooled at the
// end-of-text token, quick_gelu, bias-free conv1, ln eps 1e-5, logit scale init 1/0.07.
static vlmoe_model_config clip(const char *name, int img, int patch, int vw, int vl, int vh,
                               int tw, int tl, int th, int emb) {
    vlmoe_model_config c = one_tower(name, img, patch, vw, vl, vh, 49408, 77, emb);
    c.arch = VLMOE_ARCH_TWO_TOWER;
    c.text_encoder = (vlmoe_encoder_config){tw, tl, th, 4 * tw};
    c.act = VLMOE_ACT_QUICK_GELU;
    c.ln_eps = 1e-5;
    c.patch_bias = 0;
    c.image_class_token = 1;
    c.image_ln_pre = 1;
    c.image_pool = VLMOE_POOL_CLS;
    c.text_causal = 1;
    c.text_pool = VLMOE_POOL_EOT;
    c.init_temperature = 1.0 / 0.07;
    return c;
}

static const char *NAMES = "tiny, tiny-clip, S/32, B/32, B/16, ViT-B-32, ViT-B-16";

const char *vlmoe_config_names(void) { return NAMES; }

int vlmoe_config_named(const char *name, vlmoe_model_config *out) {
    if (!strcmp(name, "tiny")) {
        *out = one_tower(name, 32, 8, 64, 2, 2, 256, 16, 64);
        out->act = VLMOE_ACT_GELU_TANH;
    } else if (!strcmp(name, "tiny-clip")) {
        *out = clip(name, 32, 8, 64, 2, 2, 48, 2, 2, 32);
        out->vocab_size = 256;
        out->context_length = 16;
    } else if (!strcmp(name, "S/32")) {
        *out = one_tower(name, 224, 32, 384, 12, 6, 32000, 16, 384);
    } else if (!strcmp(name, "B/32")) {
        *out = one_tower(name, 224, 32, 768, 12, 12, 32000, 16, 512);
    } else if (!strcmp(name, "B/16")) {
        *out = one_tower(name, 224, 16, 768, 12, 12, 32000, 16, 512);
    } else if (!strcmp(name, "ViT-B-32")) {
        *out = clip(name, 224, 32, 768, 12, 12, 512, 12, 8, 512);
    } else if (!strcmp(name, "ViT-B-16")) {
        *out = clip(name, 224, 16, 768, 12, 12, 512, 12, 8, 512);
    } else {
        return vlmoe_fail(VLMOE_ERR_CONFIG, "unknown model '%s' (known: %s, or a .json config file)",
                          name, NAMES);
    }
    return VLMOE_OK;
}

int vlmoe_config_validate(const vlmoe_model_config *c) {
#define NEED(cond, ...) \
    if (!(cond)) return vlmoe_fail(VLMOE_ERR_CONFIG, __VA_ARGS__)
    NEED(c->arch == VLMOE_ARCH_ONE_TOWER || c->arch == VLMOE_ARCH_TWO_TOWER, "arch: unknown value %d",
         (int)c->arch);
    NEED(c->channels >= 1 && c->channels <= 4, "channels: %d not in [1, 4]", c->channels);
    NEED(c->patch_size >= 1 && c->image_size >= c->patch_size && c->image_size <= 4096,
         "image_size %d / patch_size %d: need 1 <= patch_size <= image_size <= 4096", c->image_size,
         c->patch_size);
    NEED(c->image_size % c->patch_size == 0, "image_size %d is not a multiple of patch_size %d",
         c->image_size, c->patch_size);
    NEED(c->vocab_size >= 4 && c->vocab_size <= 10000000, "vocab_size: %d not in [4, 1e7]", c->vocab_size);
    NEED(c->context_length >= 2 && c->context_length <= 4096, "context_length: %d not in [2, 4096]",
         c->context_length);
    NEED(c->embed_dim >= 1 && c->embed_dim <= 65536, "embed_dim: %d not in [1, 65536]", c->embed_dim);
    for (int t = 0; t < (c->arch == VLMOE_ARCH_TWO_TOWER ? 2 : 1); t++) {
        const vlmoe_encoder_config *e = t ? &c->text_encoder : &c->encoder;
        const char *nm = t ? "text_encoder" : "encoder";
        NEED(e->width >= 1 && e->width <= 65536, "%s.width: %d not in [1, 65536]", nm, e->width);
        NEED(e->layers >= 0 && e->layers <= 1024, "%s.layers: %d not in [0, 1024]", nm, e->layers);
        NEED(e->heads >= 1 && e->width % e->heads == 0, "%s.heads: %d must divide width %d", nm,
             e->heads, e->width);
        NEED(e->mlp_dim >= 1 && e->mlp_dim <= 1 << 20, "%s.mlp_dim: %d not in [1, 2^20]", nm, e->mlp_dim);
    }
    NEED(c->act >= VLMOE_ACT_GELU && c->act <= VLMOE_ACT_QUICK_GELU, "act: unknown value %d", c->act);
    NEED(c->ln_eps > 0 && c->ln_eps < 1, "ln_eps: %g not in (0, 1)", c->ln_eps);
    NEED(c->image_pool == VLMOE_POOL_MEAN || (c->image_pool == VLMOE_POOL_CLS && c->image_class_token),
         "image_pool: must be \"mean\", or \"cls\" with image_class_token true");
    NEED(c->text_pool == VLMOE_POOL_MEAN || c->text_pool == VLMOE_POOL_EOT,
         "text_pool: must be \"mean\" or \"eot\"");
    NEED(c->init_temperature > 0 && c->max_temperature >= 1 && c->init_temperature <= c->max_temperature,
         "temperature: need 0 < init_temperature (%g) <= max_temperature (%g), max >= 1",
         c->init_temperature, c->max_temperature);
#undef NEED
    return VLMOE_OK;
}

static const char *ACT_NAMES[] = {"gelu", "gelu_tanh", "quick_gelu"};
static const char *POOL_NAMES[] = {"mean", "cls", "eot"};

static int enum_index(const char *s, const char **names, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

// Reads one key of a JSON object into the config; returns a status naming the key on error.
typedef enum { K_INT, K_DOUBLE, K_BOOL, K_ACT, K_POOL, K_ARCH, K_STRING } key_kind;
typedef struct { const char *key; key_kind kind; size_t off; } key_spec;
#define KEY(k, kind, field) {k, kind, offsetof(vlmoe_model_config, field)}
static const key_spec KEYS[] = {
    KEY("name", K_STRING, name), KEY("arch", K_ARCH, arch),
    KEY("image_size", K_INT, image_size), KEY("patch_size", K_INT, patch_size),
    KEY("channels", K_INT, channels), KEY("vocab_size", K_INT, vocab_size),
    KEY("context_length", K_INT, context_length), KEY("embed_dim", K_INT, embed_dim),
    KEY("act", K_ACT, act), KEY("ln_eps", K_DOUBLE, ln_eps), KEY("patch_bias", K_BOOL, patch_bias),
    KEY("image_class_token", K_BOOL, image_class_token), KEY("image_ln_pre", K_BOOL, image_ln_pre),
    KEY("image_pool", K_POOL, image_pool), KEY("text_causal", K_BOOL, text_causal),
    KEY("text_pool", K_POOL, text_pool), KEY("init_temperature", K_DOUBLE, init_temperature),
    KEY("max_temperature", K_DOUBLE, max_temperature),
};
#define NKEYS (int)(sizeof(KEYS) / sizeof(KEYS[0]))
static const char *ENC_KEYS[] = {"width", "layers", "heads", "mlp_dim"};

static int read_int(const cJSON *v, const char *what, const char *key, int *out) {
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) > 2e9)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an integer", what, key);
    *out = (int)v->valuedouble;
    return VLMOE_OK;
}

static int read_encoder(const cJSON *o, const char *what, const char *key, vlmoe_encoder_config *e,
                        int complete) {
    if (!cJSON_IsObject(o))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be an object {width, layers, heads, "
                          "mlp_dim}", what, key);
    int *f[4] = {&e->width, &e->layers, &e->heads, &e->mlp_dim};
    for (const cJSON *it = o->child; it; it = it->next) {
        int k = enum_index(it->string, ENC_KEYS, 4);
        if (k < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: unknown key \"%s.%s\" (expected width, layers, "
                              "heads, mlp_dim)", what, key, it->string);
        char full[96];
        snprintf(full, sizeof(full), "%s.%s", key, it->string);
        int st = read_int(it, what, full, f[k]);
        if (st) return st;
    }
    for (int k = 0; complete && k < 4; k++)
        if (!cJSON_GetObjectItemCaseSensitive(o, ENC_KEYS[k]))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: missing key \"%s.%s\"", what, key, ENC_KEYS[k]);
    return VLMOE_OK;
}

static int read_key(const cJSON *v, const key_spec *k, const char *what, vlmoe_model_config *c) {
    char *field = (char *)c + k->off;
    int idx;
    switch (k->kind) {
    case K_INT: return read_int(v, what, k->key, (int *)field);
    case K_DOUBLE:
        if (!cJSON_IsNumber(v)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be a number", what, k->key);
        *(double *)field = v->valuedouble;
        return VLMOE_OK;
    case K_BOOL:
        if (!cJSON_IsBool(v)) return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be true or false", what, k->key);
        *(int *)field = cJSON_IsTrue(v);
        return VLMOE_OK;
    case K_STRING:
        if (!cJSON_IsString(v) || strlen(v->valuestring) >= sizeof(c->name))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be a string of < 64 bytes", what, k->key);
        snprintf(field, sizeof(c->name), "%s", v->valuestring);
        return VLMOE_OK;
    case K_ACT:
        if (!cJSON_IsString(v) || (idx = enum_index(v->valuestring, ACT_NAMES, 3)) < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"gelu\", \"gelu_tanh\" or "
                              "\"quick_gelu\"", what, k->key);
        *(int *)field = idx;
        return VLMOE_OK;
    case K_POOL:
        if (!cJSON_IsString(v) || (idx = enum_index(v->valuestring, POOL_NAMES, 3)) < 0)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"mean\", \"cls\" or \"eot\"",
                              what, k->key);
        *(int *)field = idx;
        return VLMOE_OK;
    case K_ARCH:
        if (!cJSON_IsString(v) || (strcmp(v->valuestring, "one_tower") && strcmp(v->valuestring, "two_tower")))
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"%s\" must be \"one_tower\" or \"two_tower\"",
                              what, k->key);
        *(vlmoe_arch *)field = strcmp(v->valuestring, "one_tower") ? VLMOE_ARCH_TWO_TOWER : VLMOE_ARCH_ONE_TOWER;
        return VLMOE_OK;
    }
    return VLMOE_ERR_CONFIG;
}

int vlmoe_config_from_json(const char *json, const char *what, vlmoe_model_config *out) {
    cJSON *root = cJSON_Parse(json);
    int st = VLMOE_OK;
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: not a JSON object", what);
    }
    vlmoe_model_config c;
    memset(&c, 0, sizeof(c));
    const cJSON *base = cJSON_GetObjectItemCaseSensitive(root, "base");
    const int complete = base == NULL;
    if (base) {
        if (!cJSON_IsString(base)) {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: key \"base\" must be a model name", what);
            goto done;
        }
        if ((st = vlmoe_config_named(base->valuestring, &c))) {
            vlmoe_error_prefix("%s", what);
            goto done;
        }
    }
    for (const cJSON *it = root->child; it; it = it->next) {
        if (!strcmp(it->string, "base")) continue;
        if (!strcmp(it->string, "encoder") || !strcmp(it->string, "text_encoder")) {
            vlmoe_encoder_config *e = it->string[0] == 'e' ? &c.encoder : &c.text_encoder;
            if ((st = read_encoder(it, what, it->string, e, complete))) goto done;
            continue;
        }
        int k = 0;
        while (k < NKEYS && strcmp(KEYS[k].key, it->string)) k++;
        if (k == NKEYS) {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: unknown key \"%s\"", what, it->string);
            goto done;
        }
        if ((st = read_key(it, &KEYS[k], what, &c))) goto done;
    }
    if (complete) {
        for (int k = 0; k < NKEYS; k++)
            if (strcmp(KEYS[k].key, "name") && !cJSON_GetObjectItemCaseSensitive(root, KEYS[k].key)) {
                st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: missing key \"%s\"", what, KEYS[k].key);
                goto done;
            }
        if (!cJSON_GetObjectItemCaseSensitive(root, "encoder") ||
            (c.arch == VLMOE_ARCH_TWO_TOWER && !cJSON_GetObjectItemCaseSensitive(root, "text_encoder"))) {
            st = vlmoe_fail(VLMOE_ERR_CONFIG, "%s: missing key \"%s\"", what,
                            cJSON_GetObjectItemCaseSensitive(root, "encoder") ? "text_encoder" : "encoder");
            goto done;
        }
    }
    if ((st = vlmoe_config_validate(&c))) {
        vlmoe_error_prefix("%s", what);
        goto done;
    }
    *out = c;
done:
    cJSON_Delete(root);
    return st;
}

int vlmoe_config_load(const char *path, vlmoe_model_config *out) {
    size_t n = strlen(path);
    if (n < 5 || strcmp(path + n - 5, ".json")) return vlmoe_config_named(path, out);
    FILE *f = fopen(path, "rb");
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open config file", path);
    char *buf = NULL;
    long len = -1;
    if (fseek(f, 0, SEEK_END) == 0) len = ftell(f);
    if (len < 0 || len > (1 << 20) || fseek(f, 0, SEEK_SET)) {
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot read config file (or larger than 1 MiB)", path);
    }
    buf = malloc((size_t)len + 1);
    if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        fclose(f);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot read config file", path);
    }
    fclose(f);
    buf[len] = 0;
    int st = vlmoe_config_from_json(buf, path, out);
    free(buf);
    return st;
}

static cJSON *encoder_json(const vlmoe_encoder_config *e) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "width", e->width);
    cJSON_AddNumberToObject(o, "layers", e->layers);
    cJSON_AddNumberToObject(o, "heads", e->heads);
    cJSON_AddNumberToObject(o, "mlp_dim", e->mlp_dim);
    return o;
}

char *vlmoe_config_to_json(const vlmoe_model_config *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "name", c->name);
    cJSON_AddStringToObject(o, "arch", c->arch == VLMOE_ARCH_ONE_TOWER ? "one_tower" : "two_tower");
    cJSON_AddNumberToObject(o, "image_size", c->image_size);
    cJSON_AddNumberToObject(o, "patch_size", c->patch_size);
    cJSON_AddNumberToObject(o, "channels", c->channels);
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "context_length", c->context_length);
    cJSON_AddNumberToObject(o, "embed_dim", c->embed_dim);
    cJSON_AddItemToObject(o, "encoder", encoder_json(&c->encoder));
    if (c->arch == VLMOE_ARCH_TWO_TOWER) cJSON_AddItemToObject(o, "text_encoder", encoder_json(&c->text_encoder));
    cJSON_AddStringToObject(o, "act", ACT_NAMES[c->act]);
    cJSON_AddNumberToObject(o, "ln_eps", c->ln_eps);
    cJSON_AddBoolToObject(o, "patch_bias", c->patch_bias);
    cJSON_AddBoolToObject(o, "image_class_token", c->image_class_token);
    cJSON_AddBoolToObject(o, "image_ln_pre", c->image_ln_pre);
    cJSON_AddStringToObject(o, "image_pool", POOL_NAMES[c->image_pool]);
    cJSON_AddBoolToObject(o, "text_causal", c->text_causal);
    cJSON_AddStringToObject(o, "text_pool", POOL_NAMES[c->text_pool]);
    cJSON_AddNumberToObject(o, "init_temperature", c->init_temperature);
    cJSON_AddNumberToObject(o, "max_temperature", c->max_temperature);
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}
