// clip_import.c: pretrained CLIP weights in and out of vlmoe's two_tower layout (MODEL.md
// "Weights"): OpenAI/OpenCLIP state-dict names (fused in_proj, visual.proj as width x embed) and HF
// CLIPModel names (split q/k/v, projections as Linear weights). One name table serves both ways,
// so export(import(f)) gives back f's tensors bit for bit. Covered by tests/test_clip_import.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "io/clip.h"
#include "vlmoe.h"

enum { OPENCLIP = 0, HF = 1 };
static const char *NAMING_DESC[2] = {"OpenAI/OpenCLIP", "HF CLIPModel"};
#define KEY_CAP 192

// Tensors outside the blocks; `transpose`: stored as (in, out) instead of vlmoe's (out, in).
static const struct {
    const char *ours, *name[2];
    int transpose[2];
} TOP[] = {
    {"image.patch_embed.weight", {"visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight"}, {0, 0}},
    {"image.class_token", {"visual.class_embedding", "vision_model.embeddings.class_embedding"}, {0, 0}},
    {"image.pos_embed", {"visual.positional_embedding", "vision_model.embeddings.position_embedding.weight"}, {0, 0}},
    {"image.ln_pre.weight", {"visual.ln_pre.weight", "vision_model.pre_layrnorm.weight"}, {0, 0}},
    {"image.ln_pre.bias", {"visual.ln_pre.bias", "vision_model.pre_layrnorm.bias"}, {0, 0}},
    {"image.ln_final.weight", {"visual.ln_post.weight", "vision_model.post_layernorm.weight"}, {0, 0}},
    {"image.ln_final.bias", {"visual.ln_post.bias", "vision_model.post_layernorm.bias"}, {0, 0}},
    {"image.proj", {"visual.proj", "visual_projection.weight"}, {1, 0}},
    {"text.token_embed", {"token_embedding.weight", "text_model.embeddings.token_embedding.weight"}, {0, 0}},
    {"text.pos_embed", {"positional_embedding", "text_model.embeddings.position_embedding.weight"}, {0, 0}},
    {"text.ln_final.weight", {"ln_final.weight", "text_model.final_layer_norm.weight"}, {0, 0}},
    {"text.ln_final.bias", {"ln_final.bias", "text_model.final_layer_norm.bias"}, {0, 0}},
    {"text.proj", {"text_projection", "text_projection.weight"}, {1, 0}},
    {"logit_scale", {"logit_scale", "logit_scale"}, {0, 0}},
};
// Block tensors, after "<tower prefix><l>."; '?' stands for q, k and v, stacked in that order
// along the rows of vlmoe's (and PyTorch's in_proj) (3D, D) qkv weight.
static const char *BLOCK_PREFIX[2][2] = {{"visual.transformer.resblocks.", "transformer.resblocks."},
                                         {"vision_model.encoder.layers.", "text_model.encoder.layers."}};
static const struct {
    const char *ours, *name[2];
} BLOCK[] = {
    {"ln1.weight", {"ln_1.weight", "layer_norm1.weight"}},
    {"ln1.bias", {"ln_1.bias", "layer_norm1.bias"}},
    {"attn.qkv.weight", {"attn.in_proj_weight", "self_attn.?_proj.weight"}},
    {"attn.qkv.bias", {"attn.in_proj_bias", "self_attn.?_proj.bias"}},
    {"attn.out.weight", {"attn.out_proj.weight", "self_attn.out_proj.weight"}},
    {"attn.out.bias", {"attn.out_proj.bias", "self_attn.out_proj.bias"}},
    {"ln2.weight", {"ln_2.weight", "layer_norm2.weight"}},
    {"ln2.bias", {"ln_2.bias", "layer_norm2.bias"}},
    {"mlp.fc1.weight", {"mlp.c_fc.weight", "mlp.fc1.weight"}},
    {"mlp.fc1.bias", {"mlp.c_fc.bias", "mlp.fc1.bias"}},
    {"mlp.fc2.weight", {"mlp.c_proj.weight", "mlp.fc2.weight"}},
    {"mlp.fc2.bias", {"mlp.c_proj.bias", "mlp.fc2.bias"}},
};
#define COUNT(a) (int)(sizeof(a) / sizeof(a[0]))

// The tensor(s) that hold vlmoe parameter `ours` under naming nm: returns how many (1, or 3 for
// HF's q/k/v), 0 if the naming has no place for it (MoE tensors).
static int source_of(int nm, const char *ours, char src[3][KEY_CAP], int *transpose) {
    int l, at = 0;
    *transpose = 0;
    if (sscanf(ours, "%*[a-z].blocks.%d.%n", &l, &at) == 1 && at > 0) {
        const char *pre = BLOCK_PREFIX[nm][ours[0] == 't'];
        for (int r = 0; r < COUNT(BLOCK); r++) {
            if (strcmp(ours + at, BLOCK[r].ours)) continue;
            const char *pat = BLOCK[r].name[nm], *q = strchr(pat, '?');
            if (!q) return snprintf(src[0], KEY_CAP, "%s%d.%s", pre, l, pat), 1;
            for (int k = 0; k < 3; k++)
                snprintf(src[k], KEY_CAP, "%s%d.%.*s%c%s", pre, l, (int)(q - pat), pat, "qkv"[k], q + 1);
            return 3;
        }
        return 0;
    }
    for (int r = 0; r < COUNT(TOP); r++)
        if (!strcmp(ours, TOP[r].ours)) {
            *transpose = TOP[r].transpose[nm];
            return snprintf(src[0], KEY_CAP, "%s", TOP[r].name[nm]), 1;
        }
    return 0;
}

// The shape of each of the n source tensors of parameter p.
static int source_shape(const vlmoe_param_info *p, const vlmoe_model_config *c, int n, int transpose,
                        int64_t shape[4]) {
    memcpy(shape, p->shape, sizeof(p->shape));
    if (!strcmp(p->name, "image.patch_embed.weight")) { // a (D, C, P, P) convolution
        shape[1] = c->channels, shape[2] = shape[3] = c->patch_size;
        return 4;
    }
    if (transpose) shape[0] = p->shape[1], shape[1] = p->shape[0];
    shape[0] /= n;
    return p->ndim;
}

static void fmt_shape(char *b, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(b, cap, "[");
    for (int d = 0; d < ndim && k < cap; d++) k += (size_t)snprintf(b + k, cap - k, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (k < cap) snprintf(b + k, cap - k, "]");
}

static int naming_index(const char *naming, int allow_auto) {
    if (!naming || !strcmp(naming, "auto")) return allow_auto ? -1 : -2;
    return !strcmp(naming, "openclip") ? OPENCLIP : !strcmp(naming, "hf") ? HF : -2;
}

// An open checkpoint and the naming found in it; every key may carry a common prefix ("module.").
typedef struct {
    const vlmoe_st *f;
    const char *path;
    int nm;
    char prefix[64];
} clip_file;

static int key_index(const clip_file *cf, const char *name) {
    char k[KEY_CAP + 64];
    snprintf(k, sizeof(k), "%.63s%.191s", cf->prefix, name);
    return vlmoe_st_find(cf->f, k);
}

// Looks for naming t's patch embedding, "<prefix>visual.conv1.weight" or the HF one, and takes
// its naming and prefix.
static int find_anchor(clip_file *cf, int t) {
    const char *anchor = TOP[0].name[t];
    const size_t a = strlen(anchor);
    for (int i = 0; i < vlmoe_st_count(cf->f); i++) {
        vlmoe_tensor_info ti;
        vlmoe_st_info(cf->f, i, &ti);
        const size_t n = strlen(ti.name);
        if (n < a || strcmp(ti.name + n - a, anchor) || (n > a && ti.name[n - a - 1] != '.') ||
            n - a >= sizeof(cf->prefix))
            continue;
        cf->nm = t;
        snprintf(cf->prefix, sizeof(cf->prefix), "%.*s", (int)(n - a), ti.name);
        return 1;
    }
    return 0;
}

// Finds the naming of the file (nm < 0: either).
static int detect(clip_file *cf, int nm) {
    if (nm >= 0 ? find_anchor(cf, nm) : find_anchor(cf, OPENCLIP) || find_anchor(cf, HF)) return VLMOE_OK;
    if (vlmoe_st_metadata(cf->f, "vlmoe.config"))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: a vlmoe model file, not an OpenAI/OpenCLIP/HF CLIP "
                          "checkpoint: use it as it is", cf->path);
    if (nm >= 0 && find_anchor(cf, 1 - nm))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: has %s names, not %s ones (no tensor '%s')", cf->path,
                          NAMING_DESC[1 - nm], NAMING_DESC[nm], TOP[0].name[nm]);
    return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not a CLIP checkpoint: no tensor '%s' (OpenAI/OpenCLIP names) "
                      "or '%s' (HF CLIPModel names)", cf->path, TOP[0].name[OPENCLIP], TOP[0].name[HF]);
}

// The info of parameter `ours`'s first source tensor, which must have ndim dims.
static int need(const clip_file *cf, const char *ours, int ndim, vlmoe_tensor_info *ti, int *transpose) {
    char src[3][KEY_CAP];
    source_of(cf->nm, ours, src, transpose);
    int i = key_index(cf, src[0]);
    if (i < 0)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: missing tensor '%s%s' (%s names)", cf->path, cf->prefix,
                          src[0], NAMING_DESC[cf->nm]);
    vlmoe_st_info(cf->f, i, ti);
    if (ti->ndim != ndim)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' has %d dimensions, expected %d", cf->path,
                          ti->name, ti->ndim, ndim);
    for (int d = 0; d < ndim; d++) // sizes become ints of the config
        if (ti->shape[d] < 1 || ti->shape[d] > 10000000)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' has size %lld in dimension %d", cf->path,
                              ti->name, (long long)ti->shape[d], d);
    return VLMOE_OK;
}

// Blocks of a tower: one more than the largest block index among the keys.
static int count_layers(const clip_file *cf, int tower) {
    char pre[KEY_CAP];
    snprintf(pre, sizeof(pre), "%s%s", cf->prefix, BLOCK_PREFIX[cf->nm][tower]);
    const size_t k = strlen(pre);
    int layers = 0;
    for (int i = 0; i < vlmoe_st_count(cf->f); i++) {
        vlmoe_tensor_info ti;
        int l;
        if (!vlmoe_st_info(cf->f, i, &ti) && !strncmp(ti.name, pre, k) && sscanf(ti.name + k, "%d", &l) == 1 &&
            l >= 0 && l < 1024 && l + 1 > layers)
            layers = l + 1;
    }
    return layers;
}

// Heads are in no shape: the head counts of a tower of width D whose head width is one that CLIP
// models use (a multiple of 8 from 32 to 128) are its candidates; one candidate is taken, several
// are an error that lists them (a wrong guess would run, silently less accurate).
static int unique_heads(const char *path, const char *tower, int width, int *heads) {
    char list[256];
    size_t k = 0;
    int n = 0;
    list[0] = 0;
    for (int h = 1; h <= width; h++) {
        const int hw = width / h;
        if (width % h || hw < 32 || hw > 128 || hw % 8) continue;
        if (k < sizeof(list)) k += (size_t)snprintf(list + k, sizeof(list) - k, "%s%d (head width %d)", n ? ", " : "", h, hw);
        *heads = h, n++;
    }
    if (n == 1) return VLMOE_OK;
    return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: the %s tower's width %d does not tell its attention heads%s%s; "
                      "import the model's folder (its config.json or open_clip_config.json says) or give "
                      "--%s-heads", path, tower, width, n ? ": candidates " : " (no head width from 32 to 128 divides it)",
                      list, tower);
}

// The whole config from the tensor shapes; heads are not in any shape (OpenCLIP: width / 64).
static int infer_config(const clip_file *cf, const vlmoe_clip_import_params *p, const clip_file_opts *o,
                        vlmoe_model_config *c) {
    int st = vlmoe_config_named("ViT-B-16", c); // OpenAI CLIP's computation; the sizes follow
    if (st) return st;
    snprintf(c->name, sizeof(c->name), "%s", p->name ? p->name : "clip");
    c->act = p->act < 0 ? VLMOE_ACT_QUICK_GELU : p->act;
    if (o->ln_eps > 0) c->ln_eps = o->ln_eps;
    vlmoe_tensor_info conv, pos, tok, tpos, proj;
    int tr, proj_tr;
    if ((st = need(cf, "image.patch_embed.weight", 4, &conv, &tr)) || (st = need(cf, "image.pos_embed", 2, &pos, &tr)) ||
        (st = need(cf, "text.token_embed", 2, &tok, &tr)) || (st = need(cf, "text.pos_embed", 2, &tpos, &tr)) ||
        (st = need(cf, "text.proj", 2, &proj, &proj_tr)))
        return st;
    const int64_t grid = (int64_t)llround(sqrt((double)(pos.shape[0] - 1))); // pos.shape[0] >= 1
    if (conv.shape[2] != conv.shape[3] || grid * grid != pos.shape[0] - 1 || conv.shape[2] * grid > 4096)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: '%s' %lld x %lld patches and '%s' with %lld rows do not make "
                          "a square image (expected 1 + a square number of positions)", cf->path, conv.name,
                          (long long)conv.shape[2], (long long)conv.shape[3], pos.name, (long long)pos.shape[0]);
    c->channels = (int)conv.shape[1];
    c->patch_size = (int)conv.shape[2];
    c->image_size = (int)(grid * conv.shape[2]);
    c->vocab_size = (int)tok.shape[0];
    c->context_length = (int)tpos.shape[0];
    c->embed_dim = (int)proj.shape[proj_tr ? 1 : 0];
    const int64_t width[2] = {conv.shape[0], tok.shape[1]};
    const int heads[2] = {p->image_heads, p->text_heads};
    for (int t = 0; t < 2; t++) {
        vlmoe_encoder_config *e = t ? &c->text_encoder : &c->encoder;
        const char *tower = t ? "text" : "image";
        if (width[t] < 1 || width[t] > 65536)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: the %s tower's width %lld is out of range", cf->path, tower,
                              (long long)width[t]);
        e->width = (int)width[t];
        e->layers = count_layers(cf, t);
        e->mlp_dim = 4 * e->width;
        if (e->layers > 0) {
            char fc1[32];
            vlmoe_tensor_info ti;
            snprintf(fc1, sizeof(fc1), "%s.blocks.0.mlp.fc1.weight", tower);
            if ((st = need(cf, fc1, 2, &ti, &tr))) return st;
            e->mlp_dim = (int)ti.shape[0];
        }
        if (!heads[t] && o->strict_heads && (st = unique_heads(cf->path, tower, e->width, &e->heads))) return st;
        if (!heads[t] && !o->strict_heads && e->width % 64)
            return vlmoe_fail(VLMOE_ERR_CONFIG, "%s: the %s tower's width %d is not a multiple of 64, so its "
                              "heads cannot be taken as width / 64: give %s_heads", cf->path, tower, e->width, tower);
        if (heads[t]) e->heads = heads[t];
        else if (!o->strict_heads) e->heads = e->width / 64;
    }
    return VLMOE_OK;
}

vlmoe_clip_import_params vlmoe_clip_import_default_params(void) {
    vlmoe_clip_import_params p = {.naming = "auto", .act = -1};
    return p;
}

// Tensors a CLIP state dict may carry that are no weights: HF's position_ids, old attention masks.
static int ignorable(const char *name) {
    size_t n = strlen(name);
    return (n >= 12 && !strcmp(name + n - 12, "position_ids")) || (n >= 9 && !strcmp(name + n - 9, "attn_mask"));
}

// Reads every parameter of m from its source tensor(s), checking shapes, then refuses tensors
// that nothing read (a CLIP variant vlmoe does not implement).
static int read_all(const clip_file *cf, vlmoe_model *m) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int np;
    const vlmoe_param_info *t = vlmoe_model_params(m, &np);
    float *params = vlmoe_model_param_data(m), *tmp = NULL;
    uint8_t *used = vlmoe_calloc((size_t)vlmoe_st_count(cf->f) + 1, "tensor flags");
    int st = used ? VLMOE_OK : VLMOE_ERR_NOMEM;
    for (int i = 0; i < np && !st; i++) {
        char src[3][KEY_CAP], a[96], b[96];
        int tr, n = source_of(cf->nm, t[i].name, src, &tr);
        int64_t want[4];
        const int wnd = source_shape(&t[i], c, n, tr, want);
        const size_t numel = t[i].numel / (size_t)n;
        for (int k = 0; k < n && !st; k++) {
            int idx = key_index(cf, src[k]);
            vlmoe_tensor_info ti;
            if (idx < 0 || vlmoe_st_info(cf->f, idx, &ti)) {
                st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: missing tensor '%s%s' (%s names)", cf->path, cf->prefix,
                                src[k], NAMING_DESC[cf->nm]);
                break;
            }
            int same = ti.ndim == wnd || (ti.numel == 1 && numel == 1); // a scalar may be stored as [1]
            for (int d = 0; same && ti.ndim == wnd && d < wnd; d++) same = ti.shape[d] == want[d];
            if (!same) {
                fmt_shape(a, sizeof(a), ti.ndim, ti.shape), fmt_shape(b, sizeof(b), wnd, want);
                st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", cf->path, ti.name, a, b);
                break;
            }
            used[idx] = 1;
            float *dst = params + t[i].offset + k * numel;
            if (!tr) {
                st = vlmoe_st_read_f32(cf->f, ti.name, dst, numel);
                continue;
            }
            const int64_t R = want[0], C = want[1]; // the file's (R, C) is our (C, R)
            if (!(tmp = vlmoe_alloc(sizeof(float) * numel, "transposed tensor"))) st = VLMOE_ERR_NOMEM;
            if (!st) st = vlmoe_st_read_f32(cf->f, ti.name, tmp, numel);
            for (int64_t r = 0; r < R && !st; r++)
                for (int64_t q = 0; q < C; q++) dst[q * R + r] = tmp[r * C + q];
            vlmoe_free_mem(tmp);
            tmp = NULL;
        }
    }
    for (int i = 0; i < vlmoe_st_count(cf->f) && !st; i++) {
        vlmoe_tensor_info ti;
        vlmoe_st_info(cf->f, i, &ti);
        if (!used[i] && !ignorable(ti.name))
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: unexpected tensor '%s': not part of the OpenAI CLIP "
                            "architecture (%s names) that vlmoe imports", cf->path, ti.name, NAMING_DESC[cf->nm]);
    }
    vlmoe_free_mem(used);
    return st;
}

int vlmoe_clip_import(vlmoe_model **out, const char *path, const vlmoe_clip_import_params *p) {
    const clip_file_opts o = {0};
    return clip_import_file(out, path, p, &o);
}

int clip_import_file(vlmoe_model **out, const char *path, const vlmoe_clip_import_params *p, const clip_file_opts *o) {
    *out = NULL;
    vlmoe_clip_import_params dp = vlmoe_clip_import_default_params();
    if (!p) p = &dp;
    const int nm = naming_index(p->naming, 1);
    if (nm == -2)
        return vlmoe_fail(VLMOE_ERR_ARG, "CLIP import: naming '%s' is not openclip, hf or auto", p->naming);
    vlmoe_st *f;
    int st = clip_refuse_pickle(path);
    if (!st) st = vlmoe_st_open(path, &f);
    if (st) return st;
    clip_file cf = {f, path, 0, ""};
    vlmoe_model_config cfg;
    vlmoe_model *m = NULL;
    if (!(st = detect(&cf, nm)) && !(st = infer_config(&cf, p, o, &cfg))) {
        st = vlmoe_model_init(&m, &cfg, 0);
        if (st) vlmoe_error_prefix("%s: the config inferred from its shapes", path);
    }
    if (!st) st = read_all(&cf, m);
    if (!st && (st = vlmoe_model_check_finite(m, 0))) vlmoe_error_prefix("%s", path);
    vlmoe_st_close(f);
    if (st) {
        vlmoe_model_free(m);
        return st;
    }
    *out = m;
    return VLMOE_OK;
}

// Whether c computes exactly what the CLIP names describe (the act and LayerNorm eps are not in
// the tensors: a loader takes them from its own config).
int clip_check_exportable(const vlmoe_model_config *c, const char *path) {
    const char *bad = c->arch != VLMOE_ARCH_TWO_TOWER ? "it is one_tower (LIMoE layout; CLIP names describe two towers)"
                      : c->moe.router != VLMOE_ROUTER_NONE || c->text_moe.router != VLMOE_ROUTER_NONE
                          ? "it has MoE layers (CLIP names describe dense models)"
                      : c->patch_bias ? "its patch embedding has a bias (CLIP's conv1 has none)"
                      : !c->image_class_token || !c->image_ln_pre || c->image_pool != VLMOE_POOL_CLS
                          ? "its image tower lacks CLIP's class token, ln_pre or class-token pooling"
                      : !c->text_causal || c->text_pool != VLMOE_POOL_EOT
                          ? "its text tower is not causal with end-of-text pooling like CLIP's"
                          : NULL;
    return bad ? vlmoe_fail(VLMOE_ERR_CONFIG, "cannot export model '%s' to %s with CLIP names: %s", c->name, path, bad)
               : VLMOE_OK;
}

int vlmoe_clip_export(const vlmoe_model *m, const char *path, const char *naming, vlmoe_dtype dtype) {
    const int nm = naming_index(naming, 0);
    if (nm < 0) return vlmoe_fail(VLMOE_ERR_ARG, "CLIP export: naming '%s' is not openclip or hf", naming ? naming : "(null)");
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int st = clip_check_exportable(c, path), np;
    if (st) return st;
    const vlmoe_param_info *t = vlmoe_model_params(m, &np);
    const float *params = vlmoe_model_param_data((vlmoe_model *)m);
    size_t ntr = 0; // the transposed projections need their own buffer, kept until the write
    for (int i = 0; i < np; i++) {
        char src[3][KEY_CAP];
        int tr;
        source_of(nm, t[i].name, src, &tr);
        ntr += tr ? t[i].numel : 0;
    }
    float *scratch = vlmoe_alloc(sizeof(float) * (ntr ? ntr : 1), "transposed tensors"), *s = scratch;
    vlmoe_st_writer *w = NULL;
    st = scratch ? vlmoe_st_writer_init(&w) : VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_st_writer_meta(w, "format", "pt"); // transformers refuses files without it
    for (int i = 0; i < np && !st; i++) {
        char src[3][KEY_CAP];
        int tr, n = source_of(nm, t[i].name, src, &tr);
        int64_t shape[4];
        const int nd = source_shape(&t[i], c, n, tr, shape);
        const size_t numel = t[i].numel / (size_t)n;
        const float *data = params + t[i].offset;
        if (tr) {
            for (int64_t r = 0; r < shape[0]; r++)
                for (int64_t q = 0; q < shape[1]; q++) s[r * shape[1] + q] = data[q * shape[0] + r];
            data = s;
            s += numel;
        }
        for (int k = 0; k < n && !st; k++) st = vlmoe_st_writer_add_f32(w, src[k], dtype, nd, shape, data + k * numel);
    }
    if (!st) st = vlmoe_st_writer_write(w, path);
    vlmoe_st_writer_free(w);
    vlmoe_free_mem(scratch);
    return st;
}
