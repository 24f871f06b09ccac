// eval.c: zero-shot classification accuracy (top-1/top-5), matched-pair retrieval accuracy and
// prompt-ensembled class embeddings (CLIP's recipe: embed every template filled with the class
// name, average, re-normalise), for any class names or the synthetic classes. Covered by
// tests/test_train.c and tests/test_eval_data.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "vlmoe.h"

static double dotf(const float *a, const float *b, int E) {
    double s = 0;
    for (int c = 0; c < E; c++) s += (double)a[c] * b[c];
    return s;
}

void vlmoe_zeroshot_accuracy(const float *img, int n, const float *classes, int C, int E,
                             const int32_t *labels, double *top1, double *top5) {
    int h1 = 0, h5 = 0;
    for (int i = 0; i < n; i++) {
        const float *x = img + (size_t)i * E;
        double own = dotf(x, classes + (size_t)labels[i] * E, E);
        // rank of the true class: classes scoring higher, or equal with a lower index
        int rank = 0;
        for (int c = 0; c < C; c++) {
            double s = dotf(x, classes + (size_t)c * E, E);
            if (s > own || (s == own && c < labels[i])) rank++;
        }
        h1 += rank < 1;
        h5 += rank < 5;
    }
    *top1 = n ? (double)h1 / n : 0;
    *top5 = n ? (double)h5 / n : 0;
}

void vlmoe_pair_accuracy(const float *img, const float *txt, int n, int E, int chunk,
                         double *i2t, double *t2i) {
    int a = 0, b = 0;
    for (int c0 = 0; c0 < n; c0 += chunk) {
        const int k = n - c0 < chunk ? n - c0 : chunk;
        for (int i = 0; i < k; i++) {
            double own = dotf(img + (size_t)(c0 + i) * E, txt + (size_t)(c0 + i) * E, E);
            int best_i = 1, best_t = 1; // does the true partner beat every other candidate?
            for (int j = 0; j < k && (best_i || best_t); j++) {
                if (j == i) continue;
                if (dotf(img + (size_t)(c0 + i) * E, txt + (size_t)(c0 + j) * E, E) >= own) best_i = 0;
                if (dotf(img + (size_t)(c0 + j) * E, txt + (size_t)(c0 + i) * E, E) >= own) best_t = 0;
            }
            a += best_i;
            b += best_t;
        }
    }
    *i2t = n ? (double)a / n : 0;
    *t2i = n ? (double)b / n : 0;
}

// Prompts of `cb` classes starting at c0, tokenized into tok (cb*nt, T) and lens (cb*nt).
static int class_prompts(const char *const *classes, int c0, int cb, const char *const *templates,
                         int nt, vlmoe_tokenize_fn tokenize, void *user, int T, int32_t *tok,
                         int32_t *lens) {
    char *prompt = NULL;
    size_t cap = 0;
    int st = VLMOE_OK;
    for (int c = c0; c < c0 + cb && !st; c++)
        for (int t = 0; t < nt && !st; t++) {
            const char *tpl = templates[t], *hole = strstr(tpl, "{}");
            const size_t need = strlen(tpl) + strlen(classes[c]) + 1;
            if (need > cap) {
                char *np = realloc(prompt, need);
                if (!np) {
                    st = vlmoe_fail(VLMOE_ERR_NOMEM, "class prompt of %zu bytes", need);
                    break;
                }
                prompt = np, cap = need;
            }
            snprintf(prompt, cap, "%.*s%s%s", (int)(hole - tpl), tpl, classes[c], hole + 2);
            const size_t k = (size_t)(c - c0) * nt + t;
            const int len = tokenize(user, prompt, tok + k * T, T);
            if (len < 2) {
                vlmoe_error_prefix("class prompt '%s'", prompt);
                st = VLMOE_ERR_ARG;
            } else {
                lens[k] = len;
            }
        }
    free(prompt);
    return st;
}

int vlmoe_class_embeddings(vlmoe_model *m, const char *const *classes, int C,
                           const char *const *templates, int nt, vlmoe_tokenize_fn tokenize,
                           void *user, float *out) {
    if (!m || !classes || !templates || !tokenize || !out || C < 1 || nt < 1)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_class_embeddings: NULL argument, C = %d or nt = %d < 1", C, nt);
    for (int t = 0; t < nt; t++)
        if (!templates[t] || !strstr(templates[t], "{}"))
            return vlmoe_fail(VLMOE_ERR_ARG, "prompt template %d ('%s') has no {} for the class name", t + 1,
                              templates[t] ? templates[t] : "(null)");
    const vlmoe_model_config *cfg = vlmoe_model_get_config(m);
    const int T = cfg->context_length, E = cfg->embed_dim;
    // classes go through in chunks of about 2048 prompts: ImageNet's 1000 x 80 stay small
    const int cb = nt >= 2048 ? 1 : (2048 / nt < C ? 2048 / nt : C);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)cb * nt * (T + 1));
    float *emb = malloc(sizeof(float) * (size_t)cb * nt * E);
    if (!tok || !emb) {
        free(tok), free(emb);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "class prompts");
    }
    int32_t *lens = tok + (size_t)cb * nt * T;
    int st = VLMOE_OK;
    for (int c0 = 0; c0 < C && !st; c0 += cb) {
        const int k = C - c0 < cb ? C - c0 : cb;
        st = class_prompts(classes, c0, k, templates, nt, tokenize, user, T, tok, lens);
        if (!st) st = vlmoe_model_encode_texts(m, tok, lens, k * nt, emb);
        for (int c = 0; c < k && !st; c++) {
            float *o = out + (size_t)(c0 + c) * E;
            double norm = 0;
            for (int e = 0; e < E; e++) {
                double v = 0;
                for (int t = 0; t < nt; t++) v += emb[(size_t)(c * nt + t) * E + e];
                o[e] = (float)v;
                norm += v * v;
            }
            norm = sqrt(norm) > 1e-12 ? sqrt(norm) : 1e-12;
            for (int e = 0; e < E; e++) o[e] = (float)(o[e] / norm);
        }
    }
    free(tok), free(emb);
    return st;
}

static int synth_tokenize(void *s, const char *text, int32_t *ids, int ctx) {
    return vlmoe_synth_tokenize(s, text, ids, ctx);
}

int vlmoe_synth_class_embeddings(vlmoe_model *m, const vlmoe_synth *s, float *out) {
    const int C = vlmoe_synth_num_classes(s), nt = vlmoe_synth_num_templates(s);
    const char *names[64], *tpl[64];
    if (C > 64 || nt > 64) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_synth_class_embeddings: %d classes, %d templates", C, nt);
    for (int c = 0; c < C; c++) names[c] = vlmoe_synth_class_name(s, c);
    for (int t = 0; t < nt; t++) tpl[t] = vlmoe_synth_template(s, t);
    return vlmoe_class_embeddings(m, names, C, tpl, nt, synth_tokenize, (void *)s, out);
}
