// fuzz_config.c: libFuzzer target for the model config parser (src/nn/config.c) on both of its
// ways in: a JSON config file, and the "vlmoe.config" metadata entry of a model file (a
// safetensors file built around the input, read back through src/io/safetensors.c). The first
// byte picks the way. A config that parses must validate, print and parse back to the same text.
#include <cjson/cJSON.h>

#include "fuzz.h"
#include "vlmoe.h"

// A config that parsed: its JSON parses again, to a config that prints the same.
static void round_trip(const vlmoe_model_config *c) {
    if (vlmoe_config_validate(c)) abort(); // parsed means validated
    char *a = vlmoe_config_to_json(c);
    if (!a) return;
    vlmoe_model_config d;
    if (vlmoe_config_from_json(a, "round trip", &d)) abort();
    char *b = vlmoe_config_to_json(&d);
    if (b && strcmp(a, b)) abort();
    free(a), free(b);
}

// A model file whose metadata holds text as "vlmoe.config", and one small tensor.
static const char *model_file(const char *text, size_t n) {
    cJSON *h = cJSON_CreateObject(), *md = cJSON_AddObjectToObject(h, "__metadata__");
    char *s = malloc(n + 1);
    if (!h || !md || !s) return cJSON_Delete(h), free(s), NULL;
    memcpy(s, text, n);
    s[n] = 0;
    cJSON_AddStringToObject(md, "vlmoe.config", s);
    cJSON_AddStringToObject(md, "format", "pt");
    cJSON *t = cJSON_AddObjectToObject(h, "logit_scale");
    cJSON_AddStringToObject(t, "dtype", "F32");
    cJSON_AddItemToObject(t, "shape", cJSON_CreateIntArray((const int[]){1}, 1));
    cJSON_AddItemToObject(t, "data_offsets", cJSON_CreateIntArray((const int[]){0, 4}, 2));
    char *hj = cJSON_PrintUnformatted(h);
    cJSON_Delete(h), free(s);
    if (!hj) return NULL;
    size_t hl = strlen(hj), pad = (8 - hl % 8) % 8, total = 8 + hl + pad + 4;
    uint8_t *b = malloc(total);
    const char *path = NULL;
    if (b) {
        for (int i = 0; i < 8; i++) b[i] = (uint8_t)((hl + pad) >> (8 * i));
        memcpy(b + 8, hj, hl);
        memset(b + 8 + hl, ' ', pad);
        memset(b + 8 + hl + pad, 0, 4);
        path = fuzz_file("model.safetensors", b, total);
    }
    free(b), free(hj);
    return path;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > (1 << 16)) return 0;
    const char *text = (const char *)data + 1;
    const size_t n = size - 1;
    vlmoe_model_config c;
    if (data[0] & 1) { // the metadata of a model file
        const char *path = model_file(text, strnlen(text, n));
        vlmoe_st *st = NULL;
        if (!path || vlmoe_st_open(path, &st)) return 0;
        const char *json = vlmoe_st_metadata(st, "vlmoe.config");
        if (json && !vlmoe_config_from_json(json, path, &c)) round_trip(&c);
        vlmoe_st_close(st);
    } else { // a JSON config file, as vlmoe_config_load reads it
        const char *path = fuzz_file("config.json", (const uint8_t *)text, n);
        if (path && !vlmoe_config_load(path, &c)) round_trip(&c);
    }
    return 0;
}
