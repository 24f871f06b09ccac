// mome_caption.c: greedy caption decoding of a VL-MoE model as BEiT-3 decodes (its captioning
// inference; VL-MoE's COCO captions follow BEiT-3): the caption so far with [MASK] appended, one
// VLMOE_ENC_CAPTION forward (image both ways, text causal), the MLM head's argmax at the [MASK]
// becomes the next token. Every step recomputes the whole sequence (no key/value cache: the
// sequences are short and the forward is the training one). Covered by tests/test_caption.c.
#include <string.h>

#include "core/core.h"
#include "nn/mome.h"

enum { CHUNK = 64 };

int vlmoe_mome_caption(vlmoe_model *m, const float *images, int n, const vlmoe_caption_params *p, int32_t *tokens,
                       int32_t *lengths) {
    const vlmoe_model_config *c = &m->L.cfg;
    if (!m->L.mome) return vlmoe_fail(VLMOE_ERR_ARG, "caption: model '%s' is not a VL-MoE (arch mome) model", c->name);
    const int T = c->context_length, V = c->vocab_size, max_len = p->max_len ? p->max_len : T;
    if (n < 1 || !images || !tokens || !lengths) return vlmoe_fail(VLMOE_ERR_ARG, "caption: needs n >= 1 images (got %d)", n);
    if (max_len < 2 || max_len > T)
        return vlmoe_fail(VLMOE_ERR_ARG, "caption: max_len %d outside [2, context_length = %d]", max_len, T);
    if (p->bos < 0 || p->bos >= V || p->eos < 0 || p->eos >= V || p->bos == p->eos || p->bos == c->mask_token ||
        p->eos == c->mask_token)
        return vlmoe_fail(VLMOE_ERR_ARG, "caption: start id %d and end id %d must be distinct ids of the vocabulary "
                          "[0, %d) other than [MASK] (%d)", p->bos, p->eos, V, c->mask_token);
    const int B = n < CHUNK ? n : CHUNK;
    int st = mome_model_plan(m, B);
    if (st) return st;
    struct mome_graph_f32 *g = mome_model_graph(m);
    const size_t isz = (size_t)c->channels * c->image_size * c->image_size;
    float *img = vlmoe_alloc(sizeof(float) * isz * B, "caption batch");
    int32_t *tok = vlmoe_alloc(sizeof(int32_t) * (size_t)B * T * 2 + sizeof(int32_t) * B * 2, "caption batch");
    // the head's probabilities as the host reads them, where the table's memory is not the host's
    float *ph = m->be->host_memory ? NULL : vlmoe_alloc(sizeof(float) * (size_t)B * V, "caption probabilities");
    if (!img || !tok || (!m->be->host_memory && !ph)) {
        vlmoe_free_mem(img), vlmoe_free_mem(tok), vlmoe_free_mem(ph);
        return VLMOE_ERR_NOMEM;
    }
    const float *P = model_params_for_graph(m); // uploaded once for every step
    int32_t *lab = tok + (size_t)B * T, *len = lab + (size_t)B * T, *done = len + B;
    mome_graph_set_mode_f32(g, 0, 0);
    m->have_forward = 0;
    for (int i0 = 0; i0 < n && !st; i0 += B) {
        const int k = n - i0 < B ? n - i0 : B; // the last chunk repeats its final image
        for (int j = 0; j < B; j++)
            memcpy(img + (size_t)j * isz, images + (size_t)(i0 + (j < k ? j : k - 1)) * isz, sizeof(float) * isz);
        memset(tok, 0, sizeof(int32_t) * (size_t)B * T);
        for (size_t i = 0; i < (size_t)B * T; i++) lab[i] = -1;
        for (int j = 0; j < B; j++) tok[(size_t)j * T] = p->bos, done[j] = j >= k;
        int left = k;
        for (int t = 1; t < max_len && left && !st; t++) {
            for (int j = 0; j < B; j++) {
                tok[(size_t)j * T + t] = c->mask_token;
                lab[(size_t)j * T + t] = 0; // any id: the head's softmax at the [MASK] is what is read
                if (t > 1) lab[(size_t)j * T + t - 1] = -1;
                len[j] = t + 1;
            }
            const mome_input_f32 in = {VLMOE_ENC_CAPTION, img, tok, len, lab, NULL, NULL};
            if ((st = mome_graph_forward_f32(g, P, &in, NULL))) break;
            int cnt; // B: one [MASK] per caption
            const float *pr = mome_graph_text_probs_f32(g, &cnt);
            if (ph) {
                m->be->download(m->be, ph, pr, (size_t)cnt * V);
                m->be->sync(m->be);
                pr = ph;
            }
            for (int j = 0; j < B; j++) {
                const float *row = pr + (size_t)j * V;
                int best = -1;
                for (int v = 0; v < V; v++)
                    if (v != c->mask_token && v != p->bos && (best < 0 || row[v] > row[best])) best = v;
                // the limit ends a caption as the tokenizer truncates one: the end token last
                tok[(size_t)j * T + t] = t == max_len - 1 ? p->eos : best;
                if (done[j] || (best != p->eos && t < max_len - 1)) continue;
                done[j] = 1, left--;
                memcpy(tokens + (size_t)(i0 + j) * T, tok + (size_t)j * T, sizeof(int32_t) * (size_t)(t + 1));
                memset(tokens + (size_t)(i0 + j) * T + t + 1, 0, sizeof(int32_t) * (size_t)(T - t - 1));
                lengths[i0 + j] = t + 1;
            }
        }
    }
    vlmoe_free_mem(img);
    vlmoe_free_mem(tok);
    vlmoe_free_mem(ph);
    return st;
}
