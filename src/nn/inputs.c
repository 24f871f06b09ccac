// inputs.c: what a model file says about its inputs, so that every command reads data the way the
// model was trained on it: the tokenizer (its text, or the synthetic data's word tokenizer) and
// the image preprocessing. Kept with the model (struct vlmoe_model's `in`), written into the
// safetensors metadata by vlmoe_model_save and read back by vlmoe_model_load:
//   "vlmoe.tokenizer"      "synthetic" | "bpe" | "sentencepiece" (absent: the file does not say)
//   "vlmoe.tokenizer.text" bpe: vlmoe_tokenizer_to_text's text (CLIP merges or tokenizer.json);
//                          sentencepiece: its text form, the .model file in base64 (tok/spm.h)
//   "vlmoe.preprocess"     {"image_size": S, "mean": [r, g, b], "std": [r, g, b],
//                           "resize": "shortest", "interpolation": "bicubic", "crop": "center"}
// The preprocessing names the one eval transform vlmoe has (OpenCLIP's: the shorter side resized
// to S with PIL's bicubic filter, then the center S x S crop); a file naming another is refused
// rather than read with the wrong transform. See model.h; tests/test_model.c, tests/test_cli.c.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "io/safetensors.h"
#include "nn/model.h"
#include "tok/spm.h"
#include "tok/tok.h"

#define KEY_TOK "vlmoe.tokenizer"
#define KEY_TOK_TEXT "vlmoe.tokenizer.text"
#define KEY_PRE "vlmoe.preprocess"

void model_inputs_free(model_inputs *in) {
    free(in->tokenizer);
    memset(in, 0, sizeof(*in));
}

int model_set_tokenizer(vlmoe_model *m, const vlmoe_tokenizer *tok) {
    char *text = NULL;
    size_t len = 0;
    const int st = tok ? vlmoe_tokenizer_to_text(tok, &text, &len) : VLMOE_OK;
    if (st) return st;
    free(m->in.tokenizer);
    m->in.tokenizer = text, m->in.tokenizer_len = len;
    m->in.text = tok ? MODEL_TEXT_BPE : MODEL_TEXT_SYNTH;
    return VLMOE_OK;
}

void model_set_image_norm(vlmoe_model *m, const float mean[3], const float std[3]) {
    memcpy(m->in.mean, mean, sizeof(m->in.mean));
    memcpy(m->in.std, std, sizeof(m->in.std));
    m->in.has_norm = 1;
}

const model_inputs *model_get_inputs(const vlmoe_model *m) { return &m->in; }

int model_copy_inputs(vlmoe_model *dst, const vlmoe_model *src) {
    if (dst == src) return VLMOE_OK;
    char *t = NULL;
    if (src->in.tokenizer && !(t = malloc(src->in.tokenizer_len + 1)))
        return vlmoe_fail(VLMOE_ERR_NOMEM, "the model's tokenizer");
    if (t) memcpy(t, src->in.tokenizer, src->in.tokenizer_len + 1);
    model_inputs_free(&dst->in);
    dst->in = src->in;
    dst->in.tokenizer = t;
    return VLMOE_OK;
}

int model_tokenizer(const vlmoe_model *m, const char *path, vlmoe_tokenizer **out) {
    *out = NULL;
    if (m->in.text != MODEL_TEXT_BPE) return VLMOE_OK;
    char what[1100];
    snprintf(what, sizeof(what), "%s: the tokenizer in the metadata (%s)", path ? path : "model", KEY_TOK_TEXT);
    return vlmoe_tokenizer_from_text(out, m->in.tokenizer, m->in.tokenizer_len, what);
}

int model_same_tokenizer(const vlmoe_model *m, const vlmoe_tokenizer *tok) {
    if (m->in.text != MODEL_TEXT_BPE || !tok) return 0;
    char *t = NULL;
    size_t n = 0;
    const int same = !vlmoe_tokenizer_to_text(tok, &t, &n) && n == m->in.tokenizer_len && !memcmp(t, m->in.tokenizer, n);
    free(t);
    return same;
}

int model_inputs_save(const vlmoe_model *m, vlmoe_st_writer *w) {
    const model_inputs *in = &m->in;
    int st = VLMOE_OK;
    const int spm = in->text == MODEL_TEXT_BPE && spm_text_is(in->tokenizer, in->tokenizer_len);
    if (in->text) st = vlmoe_st_writer_meta(w, KEY_TOK, spm ? "sentencepiece" : in->text == MODEL_TEXT_BPE ? "bpe" : "synthetic");
    if (!st && in->text == MODEL_TEXT_BPE) st = vlmoe_st_writer_meta(w, KEY_TOK_TEXT, in->tokenizer);
    if (st || !in->has_norm) return st;
    char json[512];
    snprintf(json, sizeof(json), "{\"image_size\": %d, \"mean\": [%.9g, %.9g, %.9g], \"std\": [%.9g, %.9g, %.9g], "
             "\"resize\": \"shortest\", \"interpolation\": \"bicubic\", \"crop\": \"center\"}", m->L.cfg.image_size,
             in->mean[0], in->mean[1], in->mean[2], in->std[0], in->std[1], in->std[2]);
    return vlmoe_st_writer_meta(w, KEY_PRE, json);
}

// Three finite numbers of a JSON array (std: also > 0) into out; the error names the file and key.
static int read3(const cJSON *o, const char *key, int positive, const char *path, float out[3]) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, key);
    int ok = cJSON_IsArray(a) && cJSON_GetArraySize(a) == 3;
    for (int i = 0; ok && i < 3; i++) {
        const cJSON *v = cJSON_GetArrayItem(a, i);
        ok = cJSON_IsNumber(v) && isfinite(v->valuedouble) && (!positive || v->valuedouble > 0);
        if (ok) out[i] = (float)v->valuedouble;
    }
    return ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s: \"%s\" must be 3 finite numbers%s", path,
                                      KEY_PRE, key, positive ? " > 0" : "");
}

// A string field of the preprocessing that must have the one value vlmoe implements.
static int read_mode(const cJSON *o, const char *key, const char *want, const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v) return VLMOE_OK;
    if (cJSON_IsString(v) && !strcmp(v->valuestring, want)) return VLMOE_OK;
    return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s: \"%s\" is %s%s%s; vlmoe implements \"%s\" only", path, KEY_PRE,
                      key, cJSON_IsString(v) ? "\"" : "", cJSON_IsString(v) ? v->valuestring : "not a string",
                      cJSON_IsString(v) ? "\"" : "", want);
}

int model_inputs_load(vlmoe_model *m, const vlmoe_st *f, const char *path) {
    model_inputs in = {0};
    const char *kind = vlmoe_st_metadata(f, KEY_TOK), *text = vlmoe_st_metadata(f, KEY_TOK_TEXT);
    const char *pre = vlmoe_st_metadata(f, KEY_PRE);
    if (kind && !strcmp(kind, "synthetic")) {
        in.text = MODEL_TEXT_SYNTH;
    } else if (kind && (!strcmp(kind, "bpe") || !strcmp(kind, "sentencepiece"))) {
        // MODEL_TEXT_BPE stands for "the file carries a tokenizer's text", whichever kind it is
        if (!text) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s is \"%s\" but %s is missing", path, KEY_TOK, kind, KEY_TOK_TEXT);
        if ((strcmp(kind, "sentencepiece") == 0) != spm_text_is(text, strlen(text)))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s is \"%s\" but %s %s", path, KEY_TOK, kind, KEY_TOK_TEXT,
                              !strcmp(kind, "bpe") ? "holds a SentencePiece model" : "does not start with the SentencePiece "
                              "text form's first line (" SPM_TEXT_MAGIC_LINE ")");
        in.text = MODEL_TEXT_BPE;
        in.tokenizer_len = strlen(text);
        if (!(in.tokenizer = malloc(in.tokenizer_len + 1))) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: tokenizer", path);
        memcpy(in.tokenizer, text, in.tokenizer_len + 1);
        // a tokenizer that does not parse, or has more ids than the model, is refused at load
        vlmoe_tokenizer *tok = NULL;
        vlmoe_model probe = {.in = in};
        int st = model_tokenizer(&probe, path, &tok);
        const int n = vlmoe_tokenizer_vocab_size(tok);
        vlmoe_tokenizer_free(tok);
        if (!st && n > m->L.cfg.vocab_size)
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: the tokenizer in the metadata has %d ids, more than the model's "
                            "vocabulary of %d", path, n, m->L.cfg.vocab_size);
        if (st) return model_inputs_free(&in), st;
    } else if (kind) {
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s is \"%s\": expected \"synthetic\", \"bpe\" or \"sentencepiece\"", path, KEY_TOK, kind);
    }
    if (pre) {
        cJSON *o = cJSON_Parse(pre);
        const cJSON *size = cJSON_GetObjectItemCaseSensitive(o, "image_size");
        int st = cJSON_IsObject(o) ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s is not a JSON object", path, KEY_PRE);
        if (!st && size && (!cJSON_IsNumber(size) || size->valuedouble != m->L.cfg.image_size))
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: metadata %s: image_size differs from the config's %d", path, KEY_PRE,
                            m->L.cfg.image_size);
        if (!st) st = read3(o, "mean", 0, path, in.mean);
        if (!st) st = read3(o, "std", 1, path, in.std);
        if (!st) st = read_mode(o, "resize", "shortest", path);
        if (!st) st = read_mode(o, "interpolation", "bicubic", path);
        if (!st) st = read_mode(o, "crop", "center", path);
        cJSON_Delete(o);
        if (st) return model_inputs_free(&in), st;
        in.has_norm = 1;
    }
    model_inputs_free(&m->in);
    m->in = in;
    return VLMOE_OK;
}
