// sentencepiece.c: SentencePiece tokenizers behind tok.h (SigLIP, T5, LIMoE's 32k vocabulary): the
// model file's bytes kept as base64 text (what a vlmoe model file records), and tok.h's encode /
// decode contract over the libsentencepiece shim (spm.cc). Tests: tests/test_tokenizer_spm.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "tok/spm.h"
#include "vlmoe.h"

#define MAGIC_LEN (sizeof(SPM_TEXT_MAGIC) - 1)

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int b64_val(unsigned char c) {
    const char *p = c ? strchr(B64, c) : NULL;
    return p ? (int)(p - B64) : -1;
}

int spm_text_is(const char *text, size_t len) {
    return text && len >= MAGIC_LEN && !memcmp(text, SPM_TEXT_MAGIC, MAGIC_LEN);
}

static int load(vlmoe_spm **sp, const void *bytes, size_t n, const char *what) {
    char err[512];
    if (vlmoe_spm_load(sp, bytes, n, err, sizeof(err)))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s", what, err);
    if (vlmoe_spm_size(*sp) < 1) {
        vlmoe_spm_free(*sp), *sp = NULL;
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: a SentencePiece model with no pieces", what);
    }
    return VLMOE_OK;
}

int spm_from_bytes(vlmoe_spm **sp, char **text, size_t *tlen, const void *bytes, size_t n, const char *what) {
    *sp = NULL, *text = NULL, *tlen = 0;
    int st = load(sp, bytes, n, what);
    if (st) return st;
    const size_t len = MAGIC_LEN + (n + 2) / 3 * 4 + 1;
    char *t = malloc(len + 1);
    if (!t) {
        vlmoe_spm_free(*sp), *sp = NULL;
        return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: out of memory for the model's text", what);
    }
    memcpy(t, SPM_TEXT_MAGIC, MAGIC_LEN);
    const unsigned char *b = bytes;
    size_t o = MAGIC_LEN;
    for (size_t i = 0; i < n; i += 3) {
        const uint32_t v = (uint32_t)b[i] << 16 | (i + 1 < n ? (uint32_t)b[i + 1] << 8 : 0) | (i + 2 < n ? b[i + 2] : 0);
        t[o++] = B64[v >> 18], t[o++] = B64[v >> 12 & 63];
        t[o++] = i + 1 < n ? B64[v >> 6 & 63] : '=';
        t[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    t[o++] = '\n', t[o] = 0;
    *text = t, *tlen = o;
    return VLMOE_OK;
}

int spm_from_text(vlmoe_spm **sp, const char *text, size_t len, const char *what) {
    *sp = NULL;
    if (!spm_text_is(text, len))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: does not start with \"%.*s\"", what, (int)MAGIC_LEN - 1, SPM_TEXT_MAGIC);
    const char *s = text + MAGIC_LEN;
    size_t n = len - MAGIC_LEN;
    while (n && (s[n - 1] == '\n' || s[n - 1] == '\r')) n--;
    if (n % 4)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: base64 of %zu characters, not a multiple of 4 (truncated?)", what, n);
    unsigned char *b = malloc(n / 4 * 3 + 1);
    if (!b) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: out of memory", what);
    size_t m = 0;
    for (size_t i = 0; i < n; i += 4) {
        const int last = i + 4 == n;
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            const unsigned char c = (unsigned char)s[i + k];
            v[k] = c == '=' && last && k >= 2 ? (pad++, 0) : b64_val(c);
            if (v[k] < 0 || (pad && c != '=')) {
                free(b);
                return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: base64 character %zu is 0x%02X: not in RFC 4648's alphabet",
                                  what, MAGIC_LEN + i + k, c);
            }
        }
        const uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        b[m++] = (unsigned char)(w >> 16);
        if (pad < 2) b[m++] = (unsigned char)(w >> 8);
        if (pad < 1) b[m++] = (unsigned char)w;
    }
    const int st = load(sp, b, m, what);
    free(b);
    return st;
}

int spm_tok_encode(const vlmoe_spm *sp, const char *text, int32_t *ids, int ctx, int *len) {
    char err[512];
    int32_t *v;
    size_t n;
    if (vlmoe_spm_encode(sp, text, &v, &n, err, sizeof(err))) return vlmoe_fail(VLMOE_ERR_ARG, "tokenizer: %s", err);
    const int bos = vlmoe_spm_bos(sp), eos = vlmoe_spm_eos(sp), pad = vlmoe_spm_pad(sp);
    int count = 0;
    const int room = ctx - (eos >= 0); // the last slot is EOS's when there is one
    if (bos >= 0) ids[count++] = bos;
    for (size_t i = 0; i < n && count < room; i++) ids[count++] = v[i];
    if (eos >= 0) ids[count++] = eos;
    for (int i = count; i < ctx; i++) ids[i] = pad >= 0 ? pad : 0;
    free(v);
    if (len) *len = count;
    return VLMOE_OK;
}

int spm_tok_decode(const vlmoe_spm *sp, const int32_t *ids, int n, char *out, size_t cap) {
    const int size = vlmoe_spm_size(sp);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= size)
            return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_decode: ids[%d] = %d is not in the vocabulary (size %d)",
                              i, (int)ids[i], size);
    char err[512], *t;
    if (vlmoe_spm_decode(sp, ids, n, &t, err, sizeof(err))) return vlmoe_fail(VLMOE_ERR_ARG, "tokenizer: %s", err);
    const size_t m = strlen(t);
    if (cap) {
        const size_t k = m < cap ? m : cap - 1;
        memcpy(out, t, k);
        out[k] = 0;
    }
    free(t);
    if (m >= cap)
        return vlmoe_fail(VLMOE_ERR_ARG, "tokenizer decode: output needs %zu bytes, buffer has %zu", m + 1, cap);
    return VLMOE_OK;
}
