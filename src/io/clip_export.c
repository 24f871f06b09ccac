// clip_export.c: `vlmoe export --to hf|open_clip|torch DIR`: a model as a folder other tools load.
// hf: config.json + model.safetensors (CLIPModel names) + tokenizer files + preprocessor_config.json
// for transformers' CLIPModel / CLIPProcessor.from_pretrained(DIR); open_clip: open_clip_config.json
// + open_clip_model.safetensors for open_clip.create_model_and_transforms('local-dir:DIR'); torch
// (any one_tower or two_tower model, MoE included): vlmoe's own model file, a JSON config and a copy
// of python/vlmoe_torch.py that computes its embeddings. Tests: tests/test_import_export.c.
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "io/clip.h"
#include "nn/model.h"
#include "tok/tok.h"
#include "vlmoe.h"

vlmoe_export_params vlmoe_export_default_params(void) {
    return (vlmoe_export_params){.to = "hf", .dtype = VLMOE_DT_F32};
}

// A new folder, an empty one, or (force) any: never someone's files behind their back.
static int prepare_dir(const char *dir, int force) {
    struct stat s;
    if (stat(dir, &s)) {
        if (errno == ENOENT && !mkdir(dir, 0777)) return VLMOE_OK;
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create the folder: %s", dir, strerror(errno));
    }
    if (!S_ISDIR(s.st_mode)) return vlmoe_fail(VLMOE_ERR_IO, "%s: exists and is not a folder", dir);
    DIR *d = opendir(dir);
    if (!d) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot read the folder: %s", dir, strerror(errno));
    char first[256] = "";
    for (struct dirent *e; (e = readdir(d)) && !first[0];)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) snprintf(first, sizeof(first), "%s", e->d_name);
    closedir(d);
    if (first[0] && !force)
        return vlmoe_fail(VLMOE_ERR_IO, "%s: the folder is not empty (it holds '%s'); export writes into a new or empty "
                          "folder, or over the files it writes with --force", dir, first);
    return VLMOE_OK;
}

// DIR/name <- data, atomically (a temporary file renamed over it).
static int write_file(const char *dir, const char *name, const char *data, size_t len) {
    char path[1200], tmp[1300];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    int ok = f && fwrite(data, 1, len, f) == len;
    ok = f && !fclose(f) && ok;
    if (ok && !rename(tmp, path)) return VLMOE_OK;
    remove(tmp);
    return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write: %s", path, strerror(errno));
}

static int write_json(const char *dir, const char *name, cJSON *o) {
    char *s = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    if (!s) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s/%s: JSON text", dir, name);
    size_t n = strlen(s);
    char *t = realloc(s, n + 2); // files end with a newline
    if (t) s = t, s[n++] = '\n', s[n] = 0;
    int st = write_file(dir, name, s, n);
    free(s);
    return st;
}

// Three floats as the shortest decimals that give them back (0.4f is written 0.4, as the config
// it came from said, not 0.4000000059604645).
static cJSON *array3(const float v[3]) {
    double d[3];
    for (int i = 0; i < 3; i++) {
        char b[32];
        for (int prec = 6; prec <= 9; prec++) {
            snprintf(b, sizeof(b), "%.*g", prec, (double)v[i]);
            if ((float)strtod(b, NULL) == v[i]) break;
        }
        d[i] = strtod(b, NULL);
    }
    return cJSON_CreateDoubleArray(d, 3);
}

// The normalisation the model records, else the one vlmoe would use (OpenAI CLIP's).
static void image_norm(const vlmoe_model *m, float mean[3], float std[3]) {
    const model_inputs *in = model_get_inputs(m);
    const float om[3] = {0.48145466f, 0.4578275f, 0.40821073f}, os[3] = {0.26862954f, 0.26130258f, 0.27577711f};
    memcpy(mean, in->has_norm ? in->mean : om, sizeof(om));
    memcpy(std, in->has_norm ? in->std : os, sizeof(os));
}

// The recorded tokenizer as files: tokenizer.json as it was, or merges.txt + vocab.json (the
// CLIP layout, which CLIPTokenizer reads), plus the tokenizer_config.json naming CLIP's tokens.
// *tok gets the tokenizer (NULL: the model records none, or the synthetic words).
static int write_tokenizer(const vlmoe_model *m, const char *dir, vlmoe_tokenizer **tok, int hf) {
    const model_inputs *in = model_get_inputs(m);
    *tok = NULL;
    if (in->text != MODEL_TEXT_BPE) return VLMOE_OK;
    int st = model_tokenizer(m, NULL, tok);
    if (st) return st;
    const int json = in->tokenizer_len && in->tokenizer[0] == '{';
    st = write_file(dir, json ? "tokenizer.json" : "merges.txt", in->tokenizer, in->tokenizer_len);
    if (!st && !json) {
        cJSON *v = cJSON_CreateObject();
        for (int id = 0; v && id < vlmoe_tokenizer_vocab_size(*tok); id++) {
            const char *piece = vlmoe_tokenizer_piece(*tok, id);
            if (piece) cJSON_AddNumberToObject(v, piece, id);
        }
        st = write_json(dir, "vocab.json", v);
    }
    if (st || !hf) return st;
    const char *sot = vlmoe_tokenizer_piece(*tok, vlmoe_tokenizer_sot(*tok));
    const char *eot = vlmoe_tokenizer_piece(*tok, vlmoe_tokenizer_eot(*tok));
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "tokenizer_class", "CLIPTokenizer");
    cJSON_AddNumberToObject(c, "model_max_length", vlmoe_model_get_config(m)->context_length);
    cJSON_AddStringToObject(c, "bos_token", sot ? sot : "<|startoftext|>");
    cJSON_AddStringToObject(c, "eos_token", eot ? eot : "<|endoftext|>");
    cJSON_AddStringToObject(c, "unk_token", eot ? eot : "<|endoftext|>");
    cJSON_AddStringToObject(c, "pad_token", eot ? eot : "<|endoftext|>");
    cJSON_AddStringToObject(c, "errors", "replace");
    return write_json(dir, "tokenizer_config.json", c);
}

static const char *HF_ACT[] = {"gelu", "gelu_pytorch_tanh", "quick_gelu"}; // VLMOE_ACT_* order

static cJSON *hf_tower(const vlmoe_model_config *c, const vlmoe_encoder_config *e, int vision) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "hidden_size", e->width);
    cJSON_AddNumberToObject(o, "intermediate_size", e->mlp_dim);
    cJSON_AddNumberToObject(o, "num_attention_heads", e->heads);
    cJSON_AddNumberToObject(o, "num_hidden_layers", e->layers);
    cJSON_AddStringToObject(o, "hidden_act", HF_ACT[c->act]);
    cJSON_AddNumberToObject(o, "layer_norm_eps", c->ln_eps);
    cJSON_AddNumberToObject(o, "projection_dim", c->embed_dim);
    if (vision) {
        cJSON_AddNumberToObject(o, "image_size", c->image_size);
        cJSON_AddNumberToObject(o, "patch_size", c->patch_size);
        cJSON_AddNumberToObject(o, "num_channels", c->channels);
    } else {
        cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
        cJSON_AddNumberToObject(o, "max_position_embeddings", c->context_length);
    }
    return o;
}

static int export_hf(const vlmoe_model *m, const char *dir, vlmoe_dtype dtype) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    char path[1200];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    vlmoe_tokenizer *tok = NULL;
    int st = vlmoe_clip_export(m, path, "hf", dtype);
    if (!st) st = write_tokenizer(m, dir, &tok, 1);
    if (st) return vlmoe_tokenizer_free(tok), st;
    cJSON *o = cJSON_CreateObject(), *arch = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(arch, cJSON_CreateString("CLIPModel"));
    cJSON_AddStringToObject(o, "model_type", "clip");
    cJSON_AddNumberToObject(o, "projection_dim", c->embed_dim);
    cJSON_AddNumberToObject(o, "logit_scale_init_value", 2.6592); // transformers' default, log(1/0.07)
    cJSON_AddStringToObject(o, "torch_dtype", dtype == VLMOE_DT_F16 ? "float16" : dtype == VLMOE_DT_BF16 ? "bfloat16" : "float32");
    cJSON *t = hf_tower(c, &c->text_encoder, 0);
    // transformers pools the text at the first eos_token_id, or at the largest id when it is 2
    // (CLIP's argmax, right whenever the end-of-text id is the largest, as in every CLIP vocabulary)
    cJSON_AddNumberToObject(t, "bos_token_id", tok ? vlmoe_tokenizer_sot(tok) : 0);
    cJSON_AddNumberToObject(t, "eos_token_id", tok ? vlmoe_tokenizer_eot(tok) : 2);
    cJSON_AddNumberToObject(t, "pad_token_id", 1);
    cJSON_AddItemToObject(o, "text_config", t);
    cJSON_AddItemToObject(o, "vision_config", hf_tower(c, &c->encoder, 1));
    vlmoe_tokenizer_free(tok);
    st = write_json(dir, "config.json", o);
    if (st) return st;
    float mean[3], std[3];
    image_norm(m, mean, std);
    cJSON *p = cJSON_CreateObject(), *crop = cJSON_CreateObject(), *size = cJSON_CreateObject();
    cJSON_AddNumberToObject(crop, "height", c->image_size);
    cJSON_AddNumberToObject(crop, "width", c->image_size);
    cJSON_AddItemToObject(p, "crop_size", crop);
    cJSON_AddBoolToObject(p, "do_center_crop", 1);
    cJSON_AddBoolToObject(p, "do_convert_rgb", 1);
    cJSON_AddBoolToObject(p, "do_normalize", 1);
    cJSON_AddBoolToObject(p, "do_rescale", 1);
    cJSON_AddBoolToObject(p, "do_resize", 1);
    cJSON_AddItemToObject(p, "image_mean", array3(mean));
    cJSON_AddItemToObject(p, "image_std", array3(std));
    cJSON_AddStringToObject(p, "image_processor_type", "CLIPImageProcessor");
    cJSON_AddStringToObject(p, "processor_class", "CLIPProcessor");
    cJSON_AddNumberToObject(p, "resample", 3); // PIL's BICUBIC, vlmoe's resize
    cJSON_AddNumberToObject(p, "rescale_factor", 1.0 / 255);
    cJSON_AddNumberToObject(size, "shortest_edge", c->image_size);
    cJSON_AddItemToObject(p, "size", size);
    return write_json(dir, "preprocessor_config.json", p);
}

static int export_open_clip(const vlmoe_model *m, const char *dir, vlmoe_dtype dtype) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    // OpenCLIP builds MLPs of int(width * mlp_ratio): the ratio must give the size back
    const double ratio[2] = {(double)c->encoder.mlp_dim / c->encoder.width, (double)c->text_encoder.mlp_dim / c->text_encoder.width};
    const int mlp_ok = (int)(c->encoder.width * ratio[0]) == c->encoder.mlp_dim &&
                       (int)(c->text_encoder.width * ratio[1]) == c->text_encoder.mlp_dim;
    if (c->act == VLMOE_ACT_GELU_TANH || c->ln_eps != 1e-5 || !mlp_ok)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "cannot export model '%s' to %s for OpenCLIP: %s", c->name, dir,
                          c->act == VLMOE_ACT_GELU_TANH ? "its act is gelu_tanh (OpenCLIP's towers use GELU or QuickGELU)"
                          : c->ln_eps != 1e-5 ? "its LayerNorm eps is not OpenCLIP's 1e-5"
                                              : "an MLP size is no int(width * mlp_ratio) OpenCLIP can build");
    char path[1200];
    snprintf(path, sizeof(path), "%s/open_clip_model.safetensors", dir);
    vlmoe_tokenizer *tok = NULL;
    int st = vlmoe_clip_export(m, path, "openclip", dtype);
    if (!st) st = write_tokenizer(m, dir, &tok, 0);
    vlmoe_tokenizer_free(tok);
    if (st) return st;
    cJSON *o = cJSON_CreateObject(), *mc = cJSON_AddObjectToObject(o, "model_cfg");
    cJSON_AddNumberToObject(mc, "embed_dim", c->embed_dim);
    cJSON_AddBoolToObject(mc, "quick_gelu", c->act == VLMOE_ACT_QUICK_GELU);
    cJSON *v = cJSON_AddObjectToObject(mc, "vision_cfg"), *t = cJSON_AddObjectToObject(mc, "text_cfg");
    cJSON_AddNumberToObject(v, "image_size", c->image_size);
    cJSON_AddNumberToObject(v, "layers", c->encoder.layers);
    cJSON_AddNumberToObject(v, "width", c->encoder.width);
    cJSON_AddNumberToObject(v, "head_width", c->encoder.width / c->encoder.heads);
    cJSON_AddNumberToObject(v, "mlp_ratio", ratio[0]);
    cJSON_AddNumberToObject(v, "patch_size", c->patch_size);
    cJSON_AddNumberToObject(t, "context_length", c->context_length);
    cJSON_AddNumberToObject(t, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(t, "width", c->text_encoder.width);
    cJSON_AddNumberToObject(t, "heads", c->text_encoder.heads);
    cJSON_AddNumberToObject(t, "layers", c->text_encoder.layers);
    if (c->text_encoder.mlp_dim != 4 * c->text_encoder.width) cJSON_AddNumberToObject(t, "mlp_ratio", ratio[1]);
    float mean[3], std[3];
    image_norm(m, mean, std);
    cJSON *p = cJSON_AddObjectToObject(o, "preprocess_cfg");
    cJSON_AddItemToObject(p, "mean", array3(mean));
    cJSON_AddItemToObject(p, "std", array3(std));
    cJSON_AddStringToObject(p, "interpolation", "bicubic");
    cJSON_AddStringToObject(p, "resize_mode", "shortest");
    cJSON_AddNumberToObject(p, "size", c->image_size);
    return write_json(dir, "open_clip_config.json", o);
}

static int export_torch(const vlmoe_model *m, const char *dir, const vlmoe_export_params *p) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    if (c->arch == VLMOE_ARCH_MOME)
        return vlmoe_fail(VLMOE_ERR_CONFIG, "cannot export model '%s' to %s for PyTorch: vlmoe_torch.py covers one_tower "
                          "and two_tower models, not VL-MoE (arch mome)", c->name, dir);
    if (!p->torch_module || !p->torch_module_len)
        return vlmoe_fail(VLMOE_ERR_ARG, "export --to torch: no text of vlmoe_torch.py to copy into %s", dir);
    char path[1200];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    vlmoe_tokenizer *tok = NULL;
    int st = vlmoe_model_save(m, path);
    if (!st) st = write_tokenizer(m, dir, &tok, 0);
    vlmoe_tokenizer_free(tok);
    if (!st) st = write_file(dir, "vlmoe_torch.py", p->torch_module, p->torch_module_len);
    if (st) return st;
    char *json = vlmoe_config_to_json(c);
    cJSON *o = cJSON_CreateObject(), *cfg = json ? cJSON_Parse(json) : NULL;
    free(json);
    if (!cfg) return cJSON_Delete(o), vlmoe_fail(VLMOE_ERR_NOMEM, "%s/config.json", dir);
    cJSON_AddStringToObject(o, "format", "vlmoe_torch");
    cJSON_AddStringToObject(o, "weights", "model.safetensors");
    cJSON_AddStringToObject(o, "module", "vlmoe_torch.py");
    const model_inputs *in = model_get_inputs(m);
    const int hf_json = in->text == MODEL_TEXT_BPE && in->tokenizer_len && in->tokenizer[0] == '{';
    cJSON_AddStringToObject(o, "tokenizer", in->text == MODEL_TEXT_BPE ? (hf_json ? "tokenizer.json" : "merges.txt")
                                            : in->text == MODEL_TEXT_SYNTH ? "synthetic" : "none");
    if (in->has_norm) {
        cJSON *n = cJSON_AddObjectToObject(o, "preprocess");
        cJSON_AddNumberToObject(n, "image_size", c->image_size);
        cJSON_AddItemToObject(n, "mean", array3(in->mean));
        cJSON_AddItemToObject(n, "std", array3(in->std));
    }
    cJSON_AddItemToObject(o, "model", cfg);
    return write_json(dir, "config.json", o);
}

int vlmoe_model_export_dir(const vlmoe_model *m, const char *dir, const vlmoe_export_params *p) {
    vlmoe_export_params dp = vlmoe_export_default_params();
    if (!p) p = &dp;
    const char *to = p->to ? p->to : "";
    const int kind = !strcmp(to, "hf") ? 0 : !strcmp(to, "open_clip") || !strcmp(to, "openclip") ? 1 : !strcmp(to, "torch") ? 2 : -1;
    if (kind < 0) return vlmoe_fail(VLMOE_ERR_ARG, "export: --to %s is not hf, open_clip or torch", to);
    if (!dir || !*dir) return vlmoe_fail(VLMOE_ERR_ARG, "export: no folder to write");
    int st = kind < 2 ? clip_check_exportable(vlmoe_model_get_config(m), dir) : VLMOE_OK;
    if (!st) st = prepare_dir(dir, p->force);
    if (st) return st;
    st = kind == 0 ? export_hf(m, dir, p->dtype) : kind == 1 ? export_open_clip(m, dir, p->dtype) : export_torch(m, dir, p);
    return st;
}
