// eval.c: zero-shot classification accuracy (top-1/top-5), matched-pair retrieval accuracy and
// prompt-ensembled class embeddings for the synthetic classes (CLIP's recipe: embed every
// template filled with the class name, average, re-normalise). Covered by tests/test_train.c.
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

int vlmoe_synth_class_embeddings(vlmoe_model *m, const vlmoe_synth *s, float *out) {
    const vlmoe_model_config *cfg = vlmoe_model_get_config(m);
    const int C = vlmoe_synth_num_classes(s), nt = vlmoe_synth_num_templates(s);
    const int T = cfg->context_length, E = cfg->embed_dim;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)C * nt * (T + 1));
    float *emb = malloc(sizeof(float) * (size_t)C * nt * E);
    if (!tok || !emb) {
        free(tok), free(emb);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "class prompts");
    }
    int32_t *lens = tok + (size_t)C * nt * T;
    int st = VLMOE_OK;
    for (int c = 0; c < C && !st; c++)
        for (int t = 0; t < nt && !st; t++) {
            char prompt[256];
            const char *tpl = vlmoe_synth_template(s, t), *hole = strstr(tpl, "{}");
            snprintf(prompt, sizeof(prompt), "%.*s%s%s", (int)(hole - tpl), tpl,
                     vlmoe_synth_class_name(s, c), hole + 2);
            int len = vlmoe_synth_tokenize(s, prompt, tok + (size_t)(c * nt + t) * T, T);
            if (len < 2) st = VLMOE_ERR_ARG;
            else lens[c * nt + t] = len;
        }
    if (!st) st = vlmoe_model_encode_texts(m, tok, lens, C * nt, emb);
    for (int c = 0; c < C && !st; c++) {
        double norm = 0;
        for (int e = 0; e < E; e++) {
            double v = 0;
            for (int t = 0; t < nt; t++) v += emb[(size_t)(c * nt + t) * E + e];
            out[(size_t)c * E + e] = (float)v;
            norm += v * v;
        }
        norm = sqrt(norm) > 1e-12 ? sqrt(norm) : 1e-12;
        for (int e = 0; e < E; e++) out[(size_t)c * E + e] = (float)(out[(size_t)c * E + e] / norm);
    }
    free(tok), free(emb);
    return st;
}
