// bpe.c: CLIP's byte-level BPE tokenizer (OpenAI simple_tokenizer.py's published algorithm): text
// cleaning, PCRE2 pre-tokenization, merges by rank; CLIP merges files, HF tokenizer.json, training.
// Spec: ../shared/spec/MODEL.md (Tokenizer); caveats in tok.h. Tests: tests/test_tokenizer.c.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tok/tok.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <utf8proc.h>
#include <zlib.h>

#include "core/core.h"
#include "tok/spm.h"

#define N_BASE 512                 // 256 byte symbols, then the same with "</w>"
#define CLIP_MERGES 48894          // simple_tokenizer.py: merges[1 : 49152-256-2+1]
#define CLIP_MAX_VOCAB (N_BASE + CLIP_MERGES + 2)
#define MAX_FILE_BYTES ((size_t)1 << 30)
#define MAX_HF_ID (1 << 21)        // ids of a tokenizer.json (CLIP: 49408)
#define RAW_BIT 0x80000000u        // a code point slot holding an invalid UTF-8 byte

static const char SOT_STR[] = "<|startoftext|>", EOT_STR[] = "<|endoftext|>", EOW[] = "</w>";
// CLIP's pattern with two changes that keep Python regex's results on cleaned text: \s is ' '
// (the only White_Space left after cleaning; PCRE2's \s would also take U+180E, which regex
// does not), and U+0345 is kept out of the symbol class (regex, case-insensitive, matches it with
// no alternative because it case-folds to a letter, so CLIP drops it).
static const char PATTERN[] = "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|"
                              "[\\p{L}]+|[\\p{N}]|[^ \\p{L}\\p{N}\\x{345}]+";

struct vlmoe_tokenizer {
    int n_vocab;
    char **piece;          // (n_vocab) NUL-terminated, NULL where a tokenizer.json skips an id
    struct smap *vocab;    // piece -> id; a repeated piece maps to its last id (CLIP's dict)
    int n_merges;
    int32_t *merge;        // (n_merges, 3): left id, right id, result id, by rank
    struct umap *ranks;    // left << 32 | right -> rank; a repeated pair keeps its last rank
    int32_t base[N_BASE];  // byte b -> id of its symbol; 256 + b -> id of its symbol + "</w>"
    int32_t sot, eot;
    int heap_ok, literal;
    int nfc;               // NFC before cleaning (a tokenizer.json whose normalizer says NFC)
    pcre2_code *re;
    vlmoe_spm *spm;        // a SentencePiece model instead of BPE (then only n_vocab/sot/eot above)
    char *spm_text;        // its text form (spm.h), what to_text returns
    size_t spm_len;
};

// ---------------------------------------------------------------------------------------------
// Small containers: growable arrays, string -> int32 and u64 -> int32 open-addressing maps.

// Returns p grown (realloc) to hold `need` elements of `elem` bytes, updating *cap; on failure
// returns p unchanged with *st set. Used through GROW, which assigns and yields the status.
static void *grow_buf(void *p, size_t *cap, size_t need, size_t elem, const char *what, int *st) {
    *st = VLMOE_OK;
    if (need <= *cap) return p;
    size_t nc = *cap ? *cap : 16, bytes;
    while (nc < need)
        if (vlmoe_mul_ok(nc, 2, &nc)) return *st = vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: %s: size overflow", what), p;
    if (vlmoe_mul_ok(nc, elem, &bytes)) return *st = vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: %s: size overflow", what), p;
    void *q = realloc(p, bytes);
    if (!q) return *st = vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: cannot allocate %zu bytes for %s", bytes, what), p;
    *cap = nc;
    return q;
}
#define GROW(ptr, cap, need, what, st) ((ptr) = grow_buf((ptr), &(cap), (need), sizeof(*(ptr)), (what), &(st)), (st))

static void *alloc_array(size_t n, size_t elem, const char *what) {
    size_t bytes;
    if (vlmoe_mul_ok(n ? n : 1, elem, &bytes)) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: %s: size overflow", what);
        return NULL;
    }
    void *p = calloc(1, bytes);
    if (!p) vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: cannot allocate %zu bytes for %s", bytes, what);
    return p;
}

static uint64_t hash_bytes(const void *s, size_t n) {
    const unsigned char *p = s;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

// Keys are not copied: they must outlive the map.
typedef struct smap {
    const char **key;
    size_t *len;
    int32_t *val;
    size_t cap, n; // cap: a power of two, 0 or at least twice n
} smap;

static void smap_free(smap *m) {
    if (!m) return;
    free(m->key), free(m->len), free(m->val);
    free(m);
}

static int32_t *smap_find(const smap *m, const char *s, size_t n) {
    if (!m->cap) return NULL;
    for (size_t i = hash_bytes(s, n) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (!m->key[i]) return NULL;
        if (m->len[i] == n && !memcmp(m->key[i], s, n)) return &m->val[i];
    }
}

static int smap_put(smap *m, const char *s, size_t n, int32_t val);

static int smap_rehash(smap *m, size_t cap) {
    smap nm = {alloc_array(cap, sizeof(char *), "vocabulary map"), alloc_array(cap, sizeof(size_t), "vocabulary map"),
               alloc_array(cap, sizeof(int32_t), "vocabulary map"), cap, 0};
    if (!nm.key || !nm.len || !nm.val) {
        free(nm.key), free(nm.len), free(nm.val);
        return VLMOE_ERR_NOMEM;
    }
    for (size_t i = 0; i < m->cap; i++)
        if (m->key[i]) smap_put(&nm, m->key[i], m->len[i], m->val[i]);
    free(m->key), free(m->len), free(m->val);
    *m = nm;
    return VLMOE_OK;
}

static int smap_put(smap *m, const char *s, size_t n, int32_t val) {
    int32_t *v = smap_find(m, s, n);
    if (v) {
        *v = val;
        return VLMOE_OK;
    }
    if ((m->n + 1) * 2 > m->cap) {
        size_t cap = m->cap ? m->cap : 64;
        while ((m->n + 1) * 2 > cap) cap *= 2;
        int st = smap_rehash(m, cap);
        if (st) return st;
    }
    size_t i = hash_bytes(s, n) & (m->cap - 1);
    while (m->key[i]) i = (i + 1) & (m->cap - 1);
    m->key[i] = s, m->len[i] = n, m->val[i] = val;
    m->n++;
    return VLMOE_OK;
}

typedef struct umap {
    uint64_t *key; // UINT64_MAX = empty (never a pair key: ids are < 2^31)
    int32_t *val;
    size_t cap, n;
} umap;

static void umap_free(umap *m) {
    if (!m) return;
    free(m->key), free(m->val);
    free(m);
}

static int32_t *umap_find(const umap *m, uint64_t k) {
    if (!m->cap) return NULL;
    for (size_t i = hash_u64(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->key[i] == UINT64_MAX) return NULL;
        if (m->key[i] == k) return &m->val[i];
    }
}

static int umap_put(umap *m, uint64_t k, int32_t val) {
    int32_t *v = umap_find(m, k);
    if (v) {
        *v = val;
        return VLMOE_OK;
    }
    if ((m->n + 1) * 2 > m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 64;
        umap nm = {alloc_array(cap, sizeof(uint64_t), "pair map"), alloc_array(cap, sizeof(int32_t), "pair map"), cap, 0};
        if (!nm.key || !nm.val) {
            free(nm.key), free(nm.val);
            return VLMOE_ERR_NOMEM;
        }
        memset(nm.key, 0xff, cap * sizeof(uint64_t));
        for (size_t i = 0; i < m->cap; i++)
            if (m->key[i] != UINT64_MAX) umap_put(&nm, m->key[i], m->val[i]);
        free(m->key), free(m->val);
        *m = nm;
    }
    size_t i = hash_u64(k) & (m->cap - 1);
    while (m->key[i] != UINT64_MAX) i = (i + 1) & (m->cap - 1);
    m->key[i] = k, m->val[i] = val;
    m->n++;
    return VLMOE_OK;
}

static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

// ---------------------------------------------------------------------------------------------
// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 bytes (controls,
// space, 0x7F-0xA0, 0xAD) for U+0100.. in byte order. CLIP's ids 0..255 list the symbols with the
// printable bytes first.

static int byte_printable(int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

static uint32_t byte_cp(int b) {
    if (byte_printable(b)) return (uint32_t)b;
    return 256u + (uint32_t)(b <= 0x20 ? b : b <= 0xA0 ? 33 + (b - 0x7F) : 67);
}

static int cp_byte(uint32_t cp) {
    if (cp < 256) return byte_printable((int)cp) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 67) return (int)(cp - 256 - 33 + 0x7F);
    return cp == 256 + 67 ? 0xAD : -1;
}

// Byte of CLIP's vocabulary position i (0..255): the printable bytes in order, then the rest.
static int clip_byte_at(int i) {
    int k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int b = 0; b < 256; b++)
            if (byte_printable(b) == !pass && k++ == i) return b;
    return -1;
}

static size_t utf8_put(uint32_t cp, char *o) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Length (1..4) of the well-formed UTF-8 sequence at s[0..n) (Unicode table 3-7), 0 if none.
static size_t utf8_get(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) return *cp = c, 1;
    size_t len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len || len > n) return 0;
    unsigned lo = 0x80, hi = 0xBF;
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    uint32_t v = c & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
    for (size_t i = 1; i < len; i++) v = v << 6 | (s[i] & 0x3F);
    *cp = v;
    return len;
}

// ---------------------------------------------------------------------------------------------
// Cleaning (CLIP's basic_clean without ftfy, whitespace_clean, lower) on code points; a byte that
// is not part of well-formed UTF-8 is kept as RAW_BIT | byte.

// html.entities.html5 values of the HTML 4 names plus apos, sorted; legacy = also valid without
// ';' (HTML5's 106 legacy names). Generated from Python's html.entities.
typedef struct {
    const char *name;
    uint32_t cp;
    int legacy;
} entity;
static const entity ENTITIES[] = {
    {"AElig", 0xC6, 1}, {"AMP", 0x26, 1}, {"Aacute", 0xC1, 1}, {"Acirc", 0xC2, 1},
    {"Agrave", 0xC0, 1}, {"Alpha", 0x391, 0}, {"Aring", 0xC5, 1}, {"Atilde", 0xC3, 1},
    {"Auml", 0xC4, 1}, {"Beta", 0x392, 0}, {"COPY", 0xA9, 1}, {"Ccedil", 0xC7, 1},
    {"Chi", 0x3A7, 0}, {"Dagger", 0x2021, 0}, {"Delta", 0x394, 0}, {"ETH", 0xD0, 1},
    {"Eacute", 0xC9, 1}, {"Ecirc", 0xCA, 1}, {"Egrave", 0xC8, 1}, {"Epsilon", 0x395, 0},
    {"Eta", 0x397, 0}, {"Euml", 0xCB, 1}, {"GT", 0x3E, 1}, {"Gamma", 0x393, 0}, {"Iacute", 0xCD, 1},
    {"Icirc", 0xCE, 1}, {"Igrave", 0xCC, 1}, {"Iota", 0x399, 0}, {"Iuml", 0xCF, 1},
    {"Kappa", 0x39A, 0}, {"LT", 0x3C, 1}, {"Lambda", 0x39B, 0}, {"Mu", 0x39C, 0},
    {"Ntilde", 0xD1, 1}, {"Nu", 0x39D, 0}, {"OElig", 0x152, 0}, {"Oacute", 0xD3, 1},
    {"Ocirc", 0xD4, 1}, {"Ograve", 0xD2, 1}, {"Omega", 0x3A9, 0}, {"Omicron", 0x39F, 0},
    {"Oslash", 0xD8, 1}, {"Otilde", 0xD5, 1}, {"Ouml", 0xD6, 1}, {"Phi", 0x3A6, 0}, {"Pi", 0x3A0, 0},
    {"Prime", 0x2033, 0}, {"Psi", 0x3A8, 0}, {"QUOT", 0x22, 1}, {"REG", 0xAE, 1}, {"Rho", 0x3A1, 0},
    {"Scaron", 0x160, 0}, {"Sigma", 0x3A3, 0}, {"THORN", 0xDE, 1}, {"Tau", 0x3A4, 0},
    {"Theta", 0x398, 0}, {"Uacute", 0xDA, 1}, {"Ucirc", 0xDB, 1}, {"Ugrave", 0xD9, 1},
    {"Upsilon", 0x3A5, 0}, {"Uuml", 0xDC, 1}, {"Xi", 0x39E, 0}, {"Yacute", 0xDD, 1},
    {"Yuml", 0x178, 0}, {"Zeta", 0x396, 0}, {"aacute", 0xE1, 1}, {"acirc", 0xE2, 1},
    {"acute", 0xB4, 1}, {"aelig", 0xE6, 1}, {"agrave", 0xE0, 1}, {"alefsym", 0x2135, 0},
    {"alpha", 0x3B1, 0}, {"amp", 0x26, 1}, {"and", 0x2227, 0}, {"ang", 0x2220, 0},
    {"apos", 0x27, 0}, {"aring", 0xE5, 1}, {"asymp", 0x2248, 0}, {"atilde", 0xE3, 1},
    {"auml", 0xE4, 1}, {"bdquo", 0x201E, 0}, {"beta", 0x3B2, 0}, {"brvbar", 0xA6, 1},
    {"bull", 0x2022, 0}, {"cap", 0x2229, 0}, {"ccedil", 0xE7, 1}, {"cedil", 0xB8, 1},
    {"cent", 0xA2, 1}, {"chi", 0x3C7, 0}, {"circ", 0x2C6, 0}, {"clubs", 0x2663, 0},
    {"cong", 0x2245, 0}, {"copy", 0xA9, 1}, {"crarr", 0x21B5, 0}, {"cup", 0x222A, 0},
    {"curren", 0xA4, 1}, {"dArr", 0x21D3, 0}, {"dagger", 0x2020, 0}, {"darr", 0x2193, 0},
    {"deg", 0xB0, 1}, {"delta", 0x3B4, 0}, {"diams", 0x2666, 0}, {"divide", 0xF7, 1},
    {"eacute", 0xE9, 1}, {"ecirc", 0xEA, 1}, {"egrave", 0xE8, 1}, {"empty", 0x2205, 0},
    {"emsp", 0x2003, 0}, {"ensp", 0x2002, 0}, {"epsilon", 0x3B5, 0}, {"equiv", 0x2261, 0},
    {"eta", 0x3B7, 0}, {"eth", 0xF0, 1}, {"euml", 0xEB, 1}, {"euro", 0x20AC, 0},
    {"exist", 0x2203, 0}, {"fnof", 0x192, 0}, {"forall", 0x2200, 0}, {"frac12", 0xBD, 1},
    {"frac14", 0xBC, 1}, {"frac34", 0xBE, 1}, {"frasl", 0x2044, 0}, {"gamma", 0x3B3, 0},
    {"ge", 0x2265, 0}, {"gt", 0x3E, 1}, {"hArr", 0x21D4, 0}, {"harr", 0x2194, 0},
    {"hearts", 0x2665, 0}, {"hellip", 0x2026, 0}, {"iacute", 0xED, 1}, {"icirc", 0xEE, 1},
    {"iexcl", 0xA1, 1}, {"igrave", 0xEC, 1}, {"image", 0x2111, 0}, {"infin", 0x221E, 0},
    {"int", 0x222B, 0}, {"iota", 0x3B9, 0}, {"iquest", 0xBF, 1}, {"isin", 0x2208, 0},
    {"iuml", 0xEF, 1}, {"kappa", 0x3BA, 0}, {"lArr", 0x21D0, 0}, {"lambda", 0x3BB, 0},
    {"lang", 0x27E8, 0}, {"laquo", 0xAB, 1}, {"larr", 0x2190, 0}, {"lceil", 0x2308, 0},
    {"ldquo", 0x201C, 0}, {"le", 0x2264, 0}, {"lfloor", 0x230A, 0}, {"lowast", 0x2217, 0},
    {"loz", 0x25CA, 0}, {"lrm", 0x200E, 0}, {"lsaquo", 0x2039, 0}, {"lsquo", 0x2018, 0},
    {"lt", 0x3C, 1}, {"macr", 0xAF, 1}, {"mdash", 0x2014, 0}, {"micro", 0xB5, 1},
    {"middot", 0xB7, 1}, {"minus", 0x2212, 0}, {"mu", 0x3BC, 0}, {"nabla", 0x2207, 0},
    {"nbsp", 0xA0, 1}, {"ndash", 0x2013, 0}, {"ne", 0x2260, 0}, {"ni", 0x220B, 0}, {"not", 0xAC, 1},
    {"notin", 0x2209, 0}, {"nsub", 0x2284, 0}, {"ntilde", 0xF1, 1}, {"nu", 0x3BD, 0},
    {"oacute", 0xF3, 1}, {"ocirc", 0xF4, 1}, {"oelig", 0x153, 0}, {"ograve", 0xF2, 1},
    {"oline", 0x203E, 0}, {"omega", 0x3C9, 0}, {"omicron", 0x3BF, 0}, {"oplus", 0x2295, 0},
    {"or", 0x2228, 0}, {"ordf", 0xAA, 1}, {"ordm", 0xBA, 1}, {"oslash", 0xF8, 1},
    {"otilde", 0xF5, 1}, {"otimes", 0x2297, 0}, {"ouml", 0xF6, 1}, {"para", 0xB6, 1},
    {"part", 0x2202, 0}, {"permil", 0x2030, 0}, {"perp", 0x22A5, 0}, {"phi", 0x3C6, 0},
    {"pi", 0x3C0, 0}, {"piv", 0x3D6, 0}, {"plusmn", 0xB1, 1}, {"pound", 0xA3, 1},
    {"prime", 0x2032, 0}, {"prod", 0x220F, 0}, {"prop", 0x221D, 0}, {"psi", 0x3C8, 0},
    {"quot", 0x22, 1}, {"rArr", 0x21D2, 0}, {"radic", 0x221A, 0}, {"rang", 0x27E9, 0},
    {"raquo", 0xBB, 1}, {"rarr", 0x2192, 0}, {"rceil", 0x2309, 0}, {"rdquo", 0x201D, 0},
    {"real", 0x211C, 0}, {"reg", 0xAE, 1}, {"rfloor", 0x230B, 0}, {"rho", 0x3C1, 0},
    {"rlm", 0x200F, 0}, {"rsaquo", 0x203A, 0}, {"rsquo", 0x2019, 0}, {"sbquo", 0x201A, 0},
    {"scaron", 0x161, 0}, {"sdot", 0x22C5, 0}, {"sect", 0xA7, 1}, {"shy", 0xAD, 1},
    {"sigma", 0x3C3, 0}, {"sigmaf", 0x3C2, 0}, {"sim", 0x223C, 0}, {"spades", 0x2660, 0},
    {"sub", 0x2282, 0}, {"sube", 0x2286, 0}, {"sum", 0x2211, 0}, {"sup", 0x2283, 0},
    {"sup1", 0xB9, 1}, {"sup2", 0xB2, 1}, {"sup3", 0xB3, 1}, {"supe", 0x2287, 0},
    {"szlig", 0xDF, 1}, {"tau", 0x3C4, 0}, {"there4", 0x2234, 0}, {"theta", 0x3B8, 0},
    {"thetasym", 0x3D1, 0}, {"thinsp", 0x2009, 0}, {"thorn", 0xFE, 1}, {"tilde", 0x2DC, 0},
    {"times", 0xD7, 1}, {"trade", 0x2122, 0}, {"uArr", 0x21D1, 0}, {"uacute", 0xFA, 1},
    {"uarr", 0x2191, 0}, {"ucirc", 0xFB, 1}, {"ugrave", 0xF9, 1}, {"uml", 0xA8, 1},
    {"upsih", 0x3D2, 0}, {"upsilon", 0x3C5, 0}, {"uuml", 0xFC, 1}, {"weierp", 0x2118, 0},
    {"xi", 0x3BE, 0}, {"yacute", 0xFD, 1}, {"yen", 0xA5, 1}, {"yuml", 0xFF, 1}, {"zeta", 0x3B6, 0},
    {"zwj", 0x200D, 0}, {"zwnj", 0x200C, 0},
};

// Python's html._invalid_charrefs for 0x80..0x9F (windows-1252).
static const uint16_t CP1252[32] = {
    0x20AC, 0x81, 0x201A, 0x192, 0x201E, 0x2026, 0x2020, 0x2021, 0x2C6, 0x2030, 0x160,
    0x2039, 0x152, 0x8D, 0x17D, 0x8F, 0x90, 0x2018, 0x2019, 0x201C, 0x201D, 0x2022,
    0x2013, 0x2014, 0x2DC, 0x2122, 0x161, 0x203A, 0x153, 0x9D, 0x17E, 0x178,
};

// Entity whose name is exactly s[0..n) (legacy_only: one of those valid without ';'), or NULL.
static const entity *find_entity(const uint32_t *s, size_t n, int legacy_only) {
    size_t lo = 0, hi = sizeof(ENTITIES) / sizeof(ENTITIES[0]);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2, i = 0;
        const char *name = ENTITIES[mid].name;
        while (i < n && name[i] && s[i] == (unsigned char)name[i]) i++;
        int c = i == n ? (name[i] ? -1 : 0) : !name[i] ? 1 : s[i] < (unsigned char)name[i] ? -1 : 1;
        if (!c) return !legacy_only || ENTITIES[mid].legacy ? &ENTITIES[mid] : NULL;
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

// Python's html._replace_charref for a numeric reference (v saturated above 0x10FFFF): writes
// 0 or 1 code points.
static size_t numeric_ref(uint64_t v, uint32_t *o) {
    if (v == 0) return o[0] = 0xFFFD, 1;
    if (v == 0x0D) return o[0] = 0x0D, 1;
    if (v >= 0x80 && v <= 0x9F) return o[0] = CP1252[v - 0x80], 1;
    if ((v >= 0xD800 && v <= 0xDFFF) || v > 0x10FFFF) return o[0] = 0xFFFD, 1;
    if ((v >= 1 && v <= 8) || v == 0x0B || (v >= 0x0E && v <= 0x1F) || (v >= 0x7F && v <= 0x9F) ||
        (v >= 0xFDD0 && v <= 0xFDEF) || (v & 0xFFFE) == 0xFFFE)
        return 0;
    return o[0] = (uint32_t)v, 1;
}

static int is_digit(uint32_t c) { return c >= '0' && c <= '9'; }
static int hex_val(uint32_t c) {
    return is_digit(c) ? (int)(c - '0') : c >= 'a' && c <= 'f' ? (int)(c - 'a' + 10) : c >= 'A' && c <= 'F' ? (int)(c - 'A' + 10) : -1;
}

// Python's html.unescape: in[0..n) -> out (never longer than the input); returns the length.
static size_t html_unescape(const uint32_t *in, size_t n, uint32_t *out) {
    size_t o = 0, i = 0;
    while (i < n) {
        if (in[i] != '&') {
            out[o++] = in[i++];
            continue;
        }
        size_t j = i + 1, k;
        if (j < n && in[j] == '#') { // &#[0-9]+;?  or  &#[xX][0-9a-fA-F]+;?
            int hex = j + 2 < n && (in[j + 1] == 'x' || in[j + 1] == 'X') && hex_val(in[j + 2]) >= 0;
            if (!hex && !(j + 1 < n && is_digit(in[j + 1]))) {
                out[o++] = in[i++];
                continue;
            }
            uint64_t v = 0;
            for (k = j + 1 + hex; k < n && (hex ? hex_val(in[k]) >= 0 : is_digit(in[k])); k++) {
                v = v * (hex ? 16 : 10) + (uint64_t)(hex ? hex_val(in[k]) : (int)(in[k] - '0'));
                if (v > 0x10FFFF) v = 0x110000;
            }
            if (k < n && in[k] == ';') k++;
            o += numeric_ref(v, out + o);
            i = k;
            continue;
        }
        // &[^\t\n\f <&#;]{1,32};?
        for (k = j; k < n && k - j < 32; k++) {
            uint32_t c = in[k];
            if (c == '\t' || c == '\n' || c == '\f' || c == ' ' || c == '<' || c == '&' || c == '#' || c == ';') break;
        }
        if (k == j) {
            out[o++] = in[i++];
            continue;
        }
        size_t name = k - j, semi = k < n && in[k] == ';';
        k += semi;
        const entity *e = find_entity(in + j, name, !semi);
        size_t rest = k; // what follows the replaced name
        for (size_t len = name + semi - 1; !e && len >= 2; len--) // longest legacy prefix
            if ((e = find_entity(in + j, len, 1))) rest = j + len;
        if (e) {
            out[o++] = e->cp;
            for (size_t r = rest; r < k; r++) out[o++] = in[r];
        } else {
            for (size_t r = i; r < k; r++) out[o++] = in[r];
        }
        i = k;
    }
    return o;
}

// Unicode White_Space (what regex's \s matches in whitespace_clean).
static int is_white(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
// Python's str.isspace (what str.strip removes): White_Space plus U+001C..U+001F.
static int is_pyspace(uint32_t c) { return is_white(c) || (c >= 0x1C && c <= 0x1F); }

// Python's str.lower() of one code point, through utf8proc's simple lower-case mapping (Unicode
// 15 in Debian's libutf8proc 2.8; tests/ref/gen_lower.py checks every code point against CPython).
// str.lower uses the full mapping: the one code point whose full lower case is two code points is
// U+0130 (I with dot above -> "i" U+0307), kept as Python has it; writes 1 or 2 code points. The
// context-dependent final sigma is clean_text's (final_sigma below).
static size_t lower_cp(uint32_t c, uint32_t *o) {
    if (c == 0x130) return o[0] = 'i', o[1] = 0x307, 2;
    o[0] = (c & RAW_BIT) || c > 0x10FFFF ? c : (uint32_t)utf8proc_tolower((utf8proc_int32_t)c);
    return 1;
}

size_t vlmoe_tokenizer_lower_cp(uint32_t c, uint32_t out[2]) { return lower_cp(c & ~RAW_BIT, out); }

// NFC (utf8proc_map with COMPOSE | STABLE) of each run of well-formed UTF-8 in text; bytes that
// are not well formed stay where they are. *out is malloc'd and NUL-terminated.
static int nfc_text(const char *text, char **out) {
    const unsigned char *s = (const unsigned char *)text;
    size_t n = strlen(text), cap = n + 1, len = 0;
    char *o = malloc(cap);
    if (!o) return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory for NFC");
    for (size_t i = 0; i < n;) {
        size_t j = i;
        uint32_t c;
        for (size_t k; j < n && (k = utf8_get(s + j, n - j, &c)); j += k) {}
        if (j > i) {
            utf8proc_uint8_t *m = NULL;
            const utf8proc_ssize_t r = utf8proc_map(s + i, (utf8proc_ssize_t)(j - i), &m, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
            if (r < 0) {
                free(o);
                return vlmoe_fail(VLMOE_ERR_ARG, "tokenizer: NFC failed: %s", utf8proc_errmsg(r));
            }
            if (len + (size_t)r + (n - j) + 1 > cap) {
                cap = len + (size_t)r + (n - j) + 1;
                char *g = realloc(o, cap);
                if (!g) return free(o), free(m), vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory for NFC");
                o = g;
            }
            memcpy(o + len, m, (size_t)r), len += (size_t)r;
            free(m);
            i = j;
        } else {
            o[len++] = (char)s[i++];
        }
    }
    o[len] = 0;
    *out = o;
    return VLMOE_OK;
}

// Unicode's Case_Ignorable (what CPython's final-sigma rule skips), from utf8proc's categories
// (Mn Me Cf Lm Sk) plus Word_Break MidLetter / MidNumLet / Single_Quote, which utf8proc does not
// expose and are listed here.
static int case_ignorable(uint32_t c) {
    static const uint32_t MID[] = {0x27, 0x2E, 0x3A, 0xB7, 0x387, 0x55F, 0x5F4, 0x2018, 0x2019, 0x2024,
                                   0x2027, 0xFE13, 0xFE52, 0xFE55, 0xFF07, 0xFF0E, 0xFF1A};
    if (c & RAW_BIT) return 0;
    for (size_t i = 0; i < sizeof(MID) / sizeof(MID[0]); i++)
        if (c == MID[i]) return 1;
    const utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_ME || k == UTF8PROC_CATEGORY_CF ||
           k == UTF8PROC_CATEGORY_LM || k == UTF8PROC_CATEGORY_SK;
}

// Cased (Lu, Ll, Lt, or anything with a case mapping; Other_Lowercase/Uppercase symbols such as
// circled letters have one).
static int cased(uint32_t c) {
    if (c & RAW_BIT) return 0;
    const utf8proc_int32_t x = (utf8proc_int32_t)c;
    const utf8proc_category_t k = utf8proc_category(x);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT ||
           utf8proc_tolower(x) != x || utf8proc_toupper(x) != x;
}

// CPython's Final_Sigma for U+03A3 at s[i] of s[lo, hi): a cased letter before it and none after
// it, skipping case-ignorable code points both ways; then str.lower gives U+03C2, not U+03C3.
static int final_sigma(const uint32_t *s, size_t lo, size_t hi, size_t i) {
    size_t j = i;
    while (j > lo && case_ignorable(s[j - 1])) j--;
    if (j == lo || !cased(s[j - 1])) return 0;
    for (j = i + 1; j < hi && case_ignorable(s[j]); j++) {}
    return !(j < hi && cased(s[j]));
}

// text -> cleaned, lower-cased code points (*cp owned by the caller).
static int clean_text(const char *text, uint32_t **cp, size_t *ncp) {
    const unsigned char *s = (const unsigned char *)text;
    size_t n = strlen(text), m = 0, cap;
    *cp = NULL, *ncp = 0;
    if (vlmoe_mul_ok(n + 1, 2, &cap)) return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: text too long");
    uint32_t *a = alloc_array(cap, sizeof(uint32_t), "text"), *b = alloc_array(cap, sizeof(uint32_t), "text");
    if (!a || !b) return free(a), free(b), VLMOE_ERR_NOMEM;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        size_t len = utf8_get(s + i, n - i, &c);
        if (!len) a[m++] = RAW_BIT | s[i++];
        else a[m++] = c, i += len;
    }
    m = html_unescape(a, m, b);
    m = html_unescape(b, m, a);
    size_t k = 0; // collapse White_Space runs to one space
    for (size_t i = 0; i < m; i++) {
        if (!is_white(a[i])) b[k++] = a[i];
        else if (!k || !is_white(a[i - 1])) b[k++] = ' ';
    }
    size_t lo = 0, hi = k;
    while (lo < hi && is_pyspace(b[lo])) lo++;
    while (hi > lo && is_pyspace(b[hi - 1])) hi--;
    m = 0;
    for (size_t i = lo; i < hi; i++) // at most 2 per input: fits cap
        if (b[i] == 0x3A3 && final_sigma(b, lo, hi, i)) a[m++] = 0x3C2;
        else m += lower_cp(b[i], a + m);
    free(b);
    *cp = a, *ncp = m;
    return VLMOE_OK;
}

// Writes text into out (cap bytes with the NUL): truncated + VLMOE_ERR_ARG if it does not fit.
static int put_text(const char *s, size_t n, char *out, size_t cap, const char *what) {
    if (cap) {
        size_t k = n < cap ? n : cap - 1;
        memcpy(out, s, k);
        out[k] = 0;
    }
    if (n >= cap)
        return vlmoe_fail(VLMOE_ERR_ARG, "tokenizer %s: output needs %zu bytes, buffer has %zu", what, n + 1, cap);
    return VLMOE_OK;
}

int vlmoe_tokenizer_normalize(const char *text, char *out, size_t cap) {
    if (!text || (!out && cap)) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_normalize: NULL argument");
    uint32_t *cp;
    size_t n, len = 0;
    int st = clean_text(text, &cp, &n);
    if (st) return st;
    char *buf = alloc_array(n + 1, 4, "normalized text");
    if (!buf) return free(cp), VLMOE_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) {
        if (cp[i] & RAW_BIT) buf[len++] = (char)(cp[i] & 0xFF);
        else len += utf8_put(cp[i], buf + len);
    }
    st = put_text(buf, len, out, cap, "normalize");
    free(cp), free(buf);
    return st;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenization: the cleaned text as valid UTF-8 for PCRE2 (each raw byte stands as U+FFFD,
// a symbol character, remembered in mark[] so that its piece gets the byte back), then CLIP's
// pattern findall-style.

static int compile_pattern(pcre2_code **re) {
    int err;
    PCRE2_SIZE off;
    *re = pcre2_compile((PCRE2_SPTR)PATTERN, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP | PCRE2_CASELESS,
                        &err, &off, NULL);
    if (!*re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        return vlmoe_fail(VLMOE_ERR_CONFIG, "tokenizer: PCRE2 cannot compile CLIP's pattern (offset %zu): %s",
                          (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(*re, PCRE2_JIT_COMPLETE); // optional: PCRE2 interprets if JIT is unavailable
    return VLMOE_OK;
}

typedef struct {
    char *subj;
    size_t slen, off;
    int16_t *mark;           // (slen) raw byte at a U+FFFD placeholder's first byte, else -1
    pcre2_match_data *md;
    unsigned char *piece;    // the current piece's bytes
    size_t plen, pcap;
} pretok;

static void pretok_free(pretok *p) {
    free(p->subj), free(p->mark), free(p->piece);
    pcre2_match_data_free(p->md);
    memset(p, 0, sizeof(*p));
}

static int pretok_init(pretok *p, const pcre2_code *re, const char *text, int nfc) {
    memset(p, 0, sizeof(*p));
    uint32_t *cp;
    size_t n;
    char *composed = NULL;
    int st = nfc ? nfc_text(text, &composed) : VLMOE_OK;
    if (!st) st = clean_text(composed ? composed : text, &cp, &n);
    free(composed);
    if (st) return st;
    p->subj = alloc_array(n + 1, 4, "pre-tokenizer text");
    p->mark = alloc_array(n + 1, 4 * sizeof(int16_t), "pre-tokenizer text");
    p->md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!p->subj || !p->mark || !p->md) {
        free(cp), pretok_free(p);
        return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory for a text of %zu code points", n);
    }
    for (size_t i = 0; i < n; i++) {
        size_t at = p->slen;
        p->slen += utf8_put(cp[i] & RAW_BIT ? 0xFFFD : cp[i], p->subj + at);
        for (size_t j = at; j < p->slen; j++) p->mark[j] = -1;
        if (cp[i] & RAW_BIT) p->mark[at] = (int16_t)(cp[i] & 0xFF);
    }
    free(cp);
    return VLMOE_OK;
}

// Next piece into p->piece/plen (*got = 1), or *got = 0 at the end.
static int pretok_next(pretok *p, const pcre2_code *re, int *got) {
    *got = 0;
    if (p->off >= p->slen) return VLMOE_OK;
    int rc = pcre2_match(re, (PCRE2_SPTR)p->subj, p->slen, p->off, PCRE2_NO_UTF_CHECK, p->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) {
        p->off = p->slen;
        return VLMOE_OK;
    }
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        return vlmoe_fail(VLMOE_ERR_ARG, "tokenizer: PCRE2 match failed at byte %zu: %s", p->off, (const char *)msg);
    }
    const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(p->md);
    size_t s = ov[0], e = ov[1];
    int st;
    if (GROW(p->piece, p->pcap, e - s + 1, "piece", st)) return st;
    p->plen = 0;
    for (size_t i = s; i < e;) {
        if (p->mark[i] >= 0) {
            p->piece[p->plen++] = (unsigned char)p->mark[i];
            i += 3;
        } else {
            p->piece[p->plen++] = (unsigned char)p->subj[i++];
        }
    }
    p->off = e > s ? e : s + 1; // the pattern never matches empty; guard anyway
    *got = 1;
    return VLMOE_OK;
}

static int piece_is(const pretok *p, const char *s) {
    size_t n = strlen(s);
    return p->plen == n && !memcmp(p->piece, s, n);
}

// ---------------------------------------------------------------------------------------------
// BPE of one word.

static int32_t rank_of(const vlmoe_tokenizer *t, int32_t a, int32_t b) {
    const int32_t *r = umap_find(t->ranks, pair_key(a, b));
    return r ? *r : -1;
}

typedef struct {
    int32_t rank, pos;
} bpe_ent;

typedef struct {
    int32_t *buf, *sym, *nxt, *prv, *tmp; // sym..tmp: (cap) slices of buf
    bpe_ent *heap;                         // (3 cap): n-1 pairs + 2 per merge at most
    size_t cap, nheap;
} bpe_scratch;

static void bpe_scratch_free(bpe_scratch *s) {
    free(s->buf), free(s->heap);
    memset(s, 0, sizeof(*s));
}

static int ent_less(bpe_ent a, bpe_ent b) { return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos); }

static void heap_push(bpe_scratch *s, bpe_ent e) {
    size_t i = s->nheap++;
    while (i && ent_less(e, s->heap[(i - 1) / 2])) {
        s->heap[i] = s->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    s->heap[i] = e;
}

static bpe_ent heap_pop(bpe_scratch *s) {
    bpe_ent top = s->heap[0], last = s->heap[--s->nheap];
    size_t i = 0, n = s->nheap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && ent_less(s->heap[c + 1], s->heap[c])) c++;
        if (!ent_less(s->heap[c], last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

// CLIP's loop: while some adjacent pair has a rank, merge every occurrence of the lowest-ranked
// pair left to right. O(n) per round.
static size_t bpe_literal(const vlmoe_tokenizer *t, int32_t *sym, size_t n, int32_t *tmp) {
    while (n > 1) {
        int32_t best = -1;
        for (size_t i = 0; i + 1 < n; i++) {
            int32_t r = rank_of(t, sym[i], sym[i + 1]);
            if (r >= 0 && (best < 0 || r < best)) best = r;
        }
        if (best < 0) break;
        const int32_t a = t->merge[3 * best], b = t->merge[3 * best + 1], c = t->merge[3 * best + 2];
        size_t m = 0;
        for (size_t i = 0; i < n;) {
            if (sym[i] == a && i + 1 < n && sym[i + 1] == b) tmp[m++] = c, i += 2;
            else tmp[m++] = sym[i++];
        }
        memcpy(sym, tmp, m * sizeof(int32_t));
        n = m;
    }
    return n;
}

// Same result for well-formed merges: every new pair contains the symbol just made, whose merge
// ranks after the one that made it, so popping (rank, position) visits CLIP's rounds in order and
// each round's occurrences left to right. O(n log n).
static size_t bpe_heap(const vlmoe_tokenizer *t, bpe_scratch *s, size_t n) {
    int32_t *sym = s->sym, *nxt = s->nxt, *prv = s->prv;
    s->nheap = 0;
    for (size_t i = 0; i < n; i++) {
        prv[i] = (int32_t)i - 1;
        nxt[i] = i + 1 < n ? (int32_t)i + 1 : -1;
        int32_t r = i + 1 < n ? rank_of(t, sym[i], sym[i + 1]) : -1;
        if (r >= 0) heap_push(s, (bpe_ent){r, (int32_t)i});
    }
    while (s->nheap) {
        bpe_ent e = heap_pop(s);
        int32_t p = e.pos, q = nxt[p];
        if (sym[p] < 0 || q < 0 || rank_of(t, sym[p], sym[q]) != e.rank) continue;
        sym[p] = t->merge[3 * e.rank + 2];
        sym[q] = -1;
        nxt[p] = nxt[q];
        if (nxt[q] >= 0) prv[nxt[q]] = p;
        int32_t r;
        if (prv[p] >= 0 && (r = rank_of(t, sym[prv[p]], sym[p])) >= 0) heap_push(s, (bpe_ent){r, prv[p]});
        if (nxt[p] >= 0 && (r = rank_of(t, sym[p], sym[nxt[p]])) >= 0) heap_push(s, (bpe_ent){r, p});
    }
    size_t m = 0;
    for (int32_t i = 0; i >= 0; i = nxt[i]) sym[m++] = sym[i];
    return m;
}

// Token ids of one pre-token's bytes into s->sym[0..*n).
static int bpe_word(const vlmoe_tokenizer *t, const unsigned char *b, size_t n, bpe_scratch *s, size_t *nout) {
    if (n > s->cap) {
        bpe_scratch_free(s);
        s->buf = alloc_array(n, 4 * sizeof(int32_t), "BPE word");
        s->heap = alloc_array(n, 3 * sizeof(bpe_ent), "BPE heap");
        if (!s->buf || !s->heap) return bpe_scratch_free(s), VLMOE_ERR_NOMEM;
        s->cap = n;
        s->sym = s->buf, s->nxt = s->buf + n, s->prv = s->buf + 2 * n, s->tmp = s->buf + 3 * n;
    }
    for (size_t i = 0; i < n; i++) s->sym[i] = t->base[i + 1 < n ? b[i] : 256 + b[i]];
    if (!n) return *nout = 0, VLMOE_OK;
    *nout = t->heap_ok && !t->literal ? bpe_heap(t, s, n) : bpe_literal(t, s->sym, n, s->tmp);
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// Encode / decode / getters.

int vlmoe_tokenizer_encode(const vlmoe_tokenizer *tok, const char *text, int32_t *ids, int ctx, int *len) {
    if (len) *len = 0;
    if (!tok || !text || !ids) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_encode: NULL argument");
    if (ctx < 2) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_encode: context length %d: must be >= 2 (SOT and EOT)", ctx);
    pretok p;
    bpe_scratch s = {0};
    if (tok->spm) return spm_tok_encode(tok->spm, text, ids, ctx, len);
    int st = pretok_init(&p, tok->re, text, tok->nfc), got = 1, count = 0;
    ids[count++] = tok->sot;
    while (!st && count < ctx - 1) { // the last slot is EOT's
        st = pretok_next(&p, tok->re, &got);
        if (st || !got) break;
        if (piece_is(&p, SOT_STR) || piece_is(&p, EOT_STR)) {
            ids[count++] = piece_is(&p, SOT_STR) ? tok->sot : tok->eot;
            continue;
        }
        size_t m;
        st = bpe_word(tok, p.piece, p.plen, &s, &m);
        for (size_t i = 0; !st && i < m && count < ctx - 1; i++) ids[count++] = s.sym[i];
    }
    pretok_free(&p);
    bpe_scratch_free(&s);
    if (st) return st;
    ids[count++] = tok->eot;
    for (int i = count; i < ctx; i++) ids[i] = 0;
    if (len) *len = count;
    return VLMOE_OK;
}

int vlmoe_tokenizer_decode(const vlmoe_tokenizer *tok, const int32_t *ids, int n, char *out, size_t cap) {
    if (!tok || (!ids && n > 0) || n < 0 || (!out && cap)) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_decode: bad argument");
    if (tok->spm) return spm_tok_decode(tok->spm, ids, n, out, cap);
    size_t total = 1, len = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->n_vocab || !tok->piece[ids[i]])
            return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_decode: ids[%d] = %d is not in the vocabulary (size %d)",
                              i, (int)ids[i], tok->n_vocab);
        if (vlmoe_add_ok(total, strlen(tok->piece[ids[i]]) + 1, &total))
            return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_decode: size overflow");
    }
    char *buf = alloc_array(total, 1, "decoded text");
    if (!buf) return VLMOE_ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        if (ids[i] == tok->sot || ids[i] == tok->eot) continue;
        const unsigned char *s = (const unsigned char *)tok->piece[ids[i]];
        size_t m = strlen((const char *)s), eow = m >= 4 && !memcmp(s + m - 4, EOW, 4);
        if (eow) m -= 4;
        for (size_t j = 0; j < m;) {
            uint32_t c;
            size_t k = utf8_get(s + j, m - j, &c);
            int b = k ? cp_byte(c) : -1;
            if (b >= 0) buf[len++] = (char)b, j += k;
            else if (k) memcpy(buf + len, s + j, k), len += k, j += k; // not a byte symbol: as is
            else buf[len++] = (char)s[j++];
        }
        if (eow) buf[len++] = ' ';
    }
    size_t lo = 0;
    while (lo < len && (buf[lo] == ' ' || (buf[lo] >= '\t' && buf[lo] <= '\r'))) lo++;
    while (len > lo && (buf[len - 1] == ' ' || (buf[len - 1] >= '\t' && buf[len - 1] <= '\r'))) len--;
    int st = put_text(buf + lo, len - lo, out, cap, "decode");
    free(buf);
    return st;
}

const char *vlmoe_tokenizer_piece(const vlmoe_tokenizer *tok, int32_t id) {
    if (tok && tok->spm) return vlmoe_spm_piece(tok->spm, id);
    return tok && id >= 0 && id < tok->n_vocab ? tok->piece[id] : NULL;
}
int vlmoe_tokenizer_is_sentencepiece(const vlmoe_tokenizer *tok) { return tok && tok->spm; }
int vlmoe_tokenizer_vocab_size(const vlmoe_tokenizer *tok) { return tok ? tok->n_vocab : 0; }
int vlmoe_tokenizer_num_merges(const vlmoe_tokenizer *tok) { return tok ? tok->n_merges : 0; }
int32_t vlmoe_tokenizer_sot(const vlmoe_tokenizer *tok) { return tok ? tok->sot : -1; }
int32_t vlmoe_tokenizer_eot(const vlmoe_tokenizer *tok) { return tok ? tok->eot : -1; }

int vlmoe_tokenizer_force_literal_bpe(vlmoe_tokenizer *tok, int literal) {
    if (!tok) return 0;
    tok->literal = literal != 0;
    return tok->heap_ok;
}

void vlmoe_tokenizer_free(vlmoe_tokenizer *tok) {
    if (!tok) return;
    if (tok->piece)
        for (int i = 0; i < tok->n_vocab; i++) free(tok->piece[i]);
    free(tok->piece);
    free(tok->merge);
    smap_free(tok->vocab);
    umap_free(tok->ranks);
    pcre2_code_free(tok->re);
    vlmoe_spm_free(tok->spm);
    free(tok->spm_text);
    free(tok);
}

// ---------------------------------------------------------------------------------------------
// Construction shared by the loaders and the trainer.

static char *str_dup(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory for a vocabulary entry");
        return NULL;
    }
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

static char *str_cat(const char *a, size_t na, const char *b, size_t nb) {
    char *p = malloc(na + nb + 1);
    if (!p) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory for a vocabulary entry");
        return NULL;
    }
    memcpy(p, a, na);
    memcpy(p + na, b, nb);
    p[na + nb] = 0;
    return p;
}

// The UTF-8 string of byte b's symbol (4 bytes + NUL at most) with "</w>" if eow.
static size_t byte_symbol(int b, int eow, char *o) {
    size_t n = utf8_put(byte_cp(b), o);
    if (eow) memcpy(o + n, EOW, 4), n += 4;
    o[n] = 0;
    return n;
}

static int tok_alloc(vlmoe_tokenizer **out, int n_vocab, int n_merges) {
    vlmoe_tokenizer *t = calloc(1, sizeof(*t));
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory");
    *out = t;
    t->n_vocab = n_vocab;
    t->n_merges = n_merges;
    t->piece = alloc_array((size_t)n_vocab, sizeof(char *), "vocabulary");
    t->merge = alloc_array((size_t)n_merges, 3 * sizeof(int32_t), "merges");
    t->vocab = calloc(1, sizeof(smap));
    t->ranks = calloc(1, sizeof(umap));
    if (!t->piece || !t->merge || !t->vocab || !t->ranks) return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory");
    return compile_pattern(&t->re);
}

// Byte symbols, SOT/EOT and whether the heap BPE applies; `what` names the source in messages.
static int tok_finish(vlmoe_tokenizer *t, const char *what, const char *field) {
    char sym[16];
    for (int i = 0; i < N_BASE; i++) {
        size_t n = byte_symbol(i & 255, i >= 256, sym);
        const int32_t *id = smap_find(t->vocab, sym, n);
        if (!id)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: byte symbol '%s' (byte 0x%02X%s) is missing: not a CLIP "
                              "byte-level BPE vocabulary", what, field, sym, i & 255, i >= 256 ? " + </w>" : "");
        t->base[i] = *id;
    }
    const int32_t *sot = smap_find(t->vocab, SOT_STR, strlen(SOT_STR)), *eot = smap_find(t->vocab, EOT_STR, strlen(EOT_STR));
    if (!sot || !eot)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: no '%s' token", what, field, !sot ? SOT_STR : EOT_STR);
    t->sot = *sot, t->eot = *eot;
    // Well formed: each merge uses symbols made before it (bytes or earlier merges) and makes a
    // symbol nothing made before.
    int32_t *made = alloc_array((size_t)t->n_vocab, sizeof(int32_t), "merge check");
    if (!made) return VLMOE_ERR_NOMEM;
    for (int i = 0; i < t->n_vocab; i++) made[i] = INT32_MAX;
    for (int i = 0; i < N_BASE; i++) made[t->base[i]] = -1;
    t->heap_ok = 1;
    for (int k = 0; k < t->n_merges && t->heap_ok; k++) {
        const int32_t *m = t->merge + 3 * k;
        if (made[m[0]] >= k || made[m[1]] >= k || made[m[2]] != INT32_MAX) t->heap_ok = 0;
        made[m[2]] = k;
    }
    free(made);
    return VLMOE_OK;
}

typedef struct {
    const char *a, *b;
    size_t na, nb;
    long line; // in the file, 1-based (0: not from a file)
} merge_src;

// The CLIP layout: byte symbols, the same with "</w>", each merge's concatenation, SOT, EOT.
static int build_clip(vlmoe_tokenizer **out, const merge_src *m, int n, const char *what) {
    *out = NULL;
    vlmoe_tokenizer *t = NULL;
    int st = tok_alloc(&t, N_BASE + n + 2, n);
    if (st) return vlmoe_tokenizer_free(t), st;
    char sym[16];
    for (int i = 0; i < N_BASE && !st; i++) {
        size_t k = byte_symbol(clip_byte_at(i & 255), i >= 256, sym);
        if (!(t->piece[i] = str_dup(sym, k))) st = VLMOE_ERR_NOMEM;
    }
    for (int k = 0; k < n && !st; k++)
        if (!(t->piece[N_BASE + k] = str_cat(m[k].a, m[k].na, m[k].b, m[k].nb))) st = VLMOE_ERR_NOMEM;
    if (!st && (!(t->piece[N_BASE + n] = str_dup(SOT_STR, strlen(SOT_STR))) ||
                !(t->piece[N_BASE + n + 1] = str_dup(EOT_STR, strlen(EOT_STR)))))
        st = VLMOE_ERR_NOMEM;
    for (int i = 0; i < t->n_vocab && !st; i++) st = smap_put(t->vocab, t->piece[i], strlen(t->piece[i]), i);
    for (int k = 0; k < n && !st; k++) {
        const int32_t *a = smap_find(t->vocab, m[k].a, m[k].na), *b = smap_find(t->vocab, m[k].b, m[k].nb);
        if (!a || !b) {
            const char *u = !a ? m[k].a : m[k].b;
            int nu = (int)(!a ? m[k].na : m[k].nb);
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: line %ld: merge '%.*s %.*s': symbol '%.*s' is neither a byte symbol "
                            "nor made by any merge", what, m[k].line, (int)m[k].na, m[k].a, (int)m[k].nb, m[k].b, nu, u);
            break;
        }
        const int32_t *c = smap_find(t->vocab, t->piece[N_BASE + k], m[k].na + m[k].nb);
        t->merge[3 * k] = *a, t->merge[3 * k + 1] = *b, t->merge[3 * k + 2] = *c;
        st = umap_put(t->ranks, pair_key(*a, *b), k);
    }
    if (!st) st = tok_finish(t, what, "merges");
    if (st) return vlmoe_tokenizer_free(t), st;
    *out = t;
    return VLMOE_OK;
}

// Whole file, gzip-decoded when it is gzip (zlib reads plain files as they are); NUL-terminated.
static int read_file(const char *path, char **out, size_t *n) {
    *out = NULL, *n = 0;
    const char *why = NULL; // regular files only: a FIFO would block, a device never end
    FILE *rf = vlmoe_fopen_regular(path, &why);
    if (!rf) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open: %s", path, why);
    errno = 0;
    const int fd = dup(fileno(rf));
    fclose(rf);
    gzFile f = fd >= 0 ? gzdopen(fd, "rb") : NULL;
    if (!f) {
        if (fd >= 0) close(fd);
        return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open: %s", path, errno ? strerror(errno) : "out of memory");
    }
    char *buf = NULL;
    size_t cap = 0, len = 0;
    int st = VLMOE_OK;
    for (;;) {
        if (GROW(buf, cap, len + 65536 + 1, "file contents", st)) break;
        int r = gzread(f, buf + len, 65536);
        if (r < 0) {
            int e;
            const char *msg = gzerror(f, &e);
            st = vlmoe_fail(VLMOE_ERR_IO, "%s: read error: %s", path, e == Z_ERRNO ? strerror(errno) : msg);
            break;
        }
        if (r == 0) {
            int e;
            const char *msg = gzerror(f, &e);
            if (e != Z_OK) st = vlmoe_fail(VLMOE_ERR_IO, "%s: %s (truncated or corrupt gzip file?)", path, msg);
            break;
        }
        len += (size_t)r;
        if (len > MAX_FILE_BYTES) {
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: larger than %zu bytes: not a tokenizer file", path, MAX_FILE_BYTES);
            break;
        }
    }
    int c = gzclose_r(f);
    if (!st && c != Z_OK) st = vlmoe_fail(VLMOE_ERR_IO, "%s: truncated or corrupt gzip file (zlib error %d)", path, c);
    if (st) return free(buf), st;
    buf[len] = 0;
    *out = buf, *n = len;
    return VLMOE_OK;
}

static int is_hspace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

// Parses a CLIP merges file's text buf (len bytes, NUL-terminated, taken over and freed); path
// names it in errors.
static int parse_clip(vlmoe_tokenizer **out, char *buf, size_t len, const char *path) {
    int st = VLMOE_OK;
    if (!len) return free(buf), vlmoe_fail(VLMOE_ERR_FORMAT, "%s: empty file: expected a '#version' line and merges", path);
    if (memchr(buf, 0, len)) return free(buf), vlmoe_fail(VLMOE_ERR_FORMAT, "%s: contains NUL bytes: not a CLIP merges file", path);
    // Lines after the header, without the trailing blank ones.
    size_t nl = 0;
    for (size_t i = 0; i < len; i++) nl += buf[i] == '\n';
    char **line = alloc_array(nl + 1, sizeof(char *), "merges lines");
    merge_src *m = alloc_array(nl + 1, sizeof(merge_src), "merges");
    if (!line || !m) return free(buf), free(line), free(m), VLMOE_ERR_NOMEM;
    size_t n = 0;
    for (char *p = strchr(buf, '\n'); p; p = strchr(p, '\n')) *p++ = 0, line[n++] = p;
    while (n) {
        const char *s = line[n - 1];
        while (is_hspace(*s)) s++;
        if (*s) break;
        n--;
    }
    if (n > CLIP_MERGES) n = CLIP_MERGES;
    for (size_t k = 0; k < n; k++) {
        char *s = line[k], *f[3] = {0};
        size_t nf = 0, fl[3] = {0};
        while (*s && nf < 3) {
            while (is_hspace(*s)) s++;
            if (!*s) break;
            f[nf] = s;
            while (*s && !is_hspace(*s)) s++;
            fl[nf] = (size_t)(s - f[nf]);
            nf++;
        }
        if (nf != 2) {
            size_t shown = strlen(line[k]);
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: line %zu: expected a merge of two symbols 'a b', got '%.*s%s'", path,
                            k + 2, (int)(shown > 60 ? 60 : shown), line[k], shown > 60 ? "..." : "");
            break;
        }
        m[k] = (merge_src){f[0], f[1], fl[0], fl[1], (long)k + 2};
    }
    if (!st) st = build_clip(out, m, (int)n, path);
    free(line), free(m), free(buf);
    return st;
}

int vlmoe_tokenizer_load_clip(vlmoe_tokenizer **out, const char *path) {
    if (!out || !path) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_load_clip: NULL argument");
    *out = NULL;
    char *buf;
    size_t len;
    int st = read_file(path, &buf, &len);
    return st ? st : parse_clip(out, buf, len, path);
}

// ---------------------------------------------------------------------------------------------
// HF tokenizer.json

static int hf_id_ok(double v) { return v == v && v >= 0 && v < MAX_HF_ID && v == (double)(int32_t)v; }

static int hf_add(vlmoe_tokenizer *t, const char *path, const char *field, const char *s, double idv) {
    int32_t id = (int32_t)idv;
    const int32_t *old = smap_find(t->vocab, s, strlen(s));
    if (old && *old != id)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: token '%s' has id %d but model.vocab gives it %d", path, field, s, id, *old);
    if (t->piece[id]) {
        if (strcmp(t->piece[id], s))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: %s: id %d is given to both '%s' and '%s'", path, field, id, t->piece[id], s);
        return VLMOE_OK;
    }
    if (!(t->piece[id] = str_dup(s, strlen(s)))) return VLMOE_ERR_NOMEM;
    return smap_put(t->vocab, t->piece[id], strlen(s), id);
}

// HF's Split pattern of CLIP's tokenizer.json (tokenizers' CLIP conversion).
static const char HF_CLIP_SPLIT[] = "<\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|"
                                    "[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+";

static const char *json_str(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

// The steps of a normalizer / pre_tokenizer: a "Sequence"'s list (under `list`), else the object
// itself as a list of one (*single = 1). 0 if a Sequence has no such array.
static int hf_steps(const cJSON *o, const char *list, const cJSON **first, int *single) {
    const char *type = json_str(o, "type");
    *single = !(type && !strcmp(type, "Sequence"));
    *first = *single ? o : cJSON_GetObjectItemCaseSensitive(o, list);
    return *single || cJSON_IsArray(*first);
}

// tokenizer.json's normalizer and pre_tokenizer, where they decide ids: what CLIP's tokenizer.json
// holds is accepted (NFC -> tok->nfc; Replace of \s+ by " ", Strip and Lowercase, which the
// cleaning always does; Split with CLIP's pattern then ByteLevel without prefix space or regex);
// anything else would give other ids and is refused, naming the field. Absent or null: CLIP's
// defaults (the cleaning of tok.h, no NFC).
static int hf_pipeline(vlmoe_tokenizer *t, const cJSON *root, const char *path) {
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer"), *e;
    if (norm && !cJSON_IsNull(norm)) {
        int single, lower = 0, i = 0;
        const cJSON *steps;
        if (!cJSON_IsObject(norm) || !hf_steps(norm, "normalizers", &steps, &single))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: normalizer: expected an object (or a Sequence with \"normalizers\")", path);
        for (e = single ? steps : steps->child; e; e = single ? NULL : e->next, i++) {
            char where[48] = "";
            if (!single) snprintf(where, sizeof(where), ".normalizers[%d]", i);
            const char *type = json_str(e, "type");
            const cJSON *pat = cJSON_GetObjectItemCaseSensitive(e, "pattern");
            const char *rx = json_str(pat, "Regex"), *lit = json_str(pat, "String"), *content = json_str(e, "content");
            if (type && !strcmp(type, "NFC")) t->nfc = 1;
            else if (type && !strcmp(type, "Lowercase")) lower = 1;
            else if (type && !strcmp(type, "Strip")) {}
            else if (type && !strcmp(type, "Replace") && content && !strcmp(content, " ") &&
                     ((rx && !strcmp(rx, "\\s+")) || (lit && !strcmp(lit, " ")))) {}
            else
                return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: normalizer%s: type \"%s\"%s is not what CLIP's tokenizer does "
                                  "(vlmoe implements NFC, Lowercase, Strip and Replace of \\s+ by \" \"): its ids would differ",
                                  path, where, type ? type : "(none)", type && !strcmp(type, "Replace") ? " with this pattern" : "");
        }
        if (!lower)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: normalizer: no Lowercase step, but CLIP's tokenizer (and vlmoe's) "
                              "lower-cases: its ids would differ", path);
    }
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    if (pre && !cJSON_IsNull(pre)) {
        int single, i = 0;
        const cJSON *steps;
        if (!cJSON_IsObject(pre) || !hf_steps(pre, "pretokenizers", &steps, &single))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: pre_tokenizer: expected an object (or a Sequence with \"pretokenizers\")", path);
        for (e = single ? steps : steps->child; e; e = single ? NULL : e->next, i++) {
            char where[48] = "";
            if (!single) snprintf(where, sizeof(where), ".pretokenizers[%d]", i);
            const char *type = json_str(e, "type"), *why = NULL;
            if (type && !strcmp(type, "Split")) {
                const char *rx = json_str(cJSON_GetObjectItemCaseSensitive(e, "pattern"), "Regex");
                const char *beh = json_str(e, "behavior");
                if (!rx || strcmp(rx, HF_CLIP_SPLIT)) why = "pattern is not CLIP's";
                else if (!beh || strcmp(beh, "Removed") || !cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "invert")))
                    why = "behavior is not \"Removed\" with invert true (CLIP keeps the matches)";
            } else if (type && !strcmp(type, "ByteLevel")) {
                if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "add_prefix_space"))) why = "add_prefix_space is true";
                else if (!cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(e, "use_regex"))) // HF's default: true
                    why = "use_regex is not false (GPT-2's pattern, not CLIP's)";
            } else {
                why = "is not one of CLIP's (Split with CLIP's pattern, ByteLevel)";
            }
            if (why)
                return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: pre_tokenizer%s: type \"%s\": %s: its ids would differ", path,
                                  where, type ? type : "(none)", why);
        }
    }
    const cJSON *drop = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "model"), "dropout");
    if (drop && !cJSON_IsNull(drop) && !(cJSON_IsNumber(drop) && drop->valuedouble == 0))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.dropout is set: BPE dropout makes ids random, CLIP has none", path);
    return VLMOE_OK;
}

static int hf_build(vlmoe_tokenizer **out, const cJSON *root, const char *path) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: missing object 'model'", path);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE"))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.type: expected \"BPE\", got %s%s%s", path, cJSON_IsString(type) ? "\"" : "",
                          cJSON_IsString(type) ? type->valuestring : type ? "a non-string" : "nothing",
                          cJSON_IsString(type) ? "\"" : "");
    const cJSON *eow = cJSON_GetObjectItemCaseSensitive(model, "end_of_word_suffix");
    if (cJSON_IsString(eow) && strcmp(eow->valuestring, EOW))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.end_of_word_suffix is \"%s\": CLIP's BPE uses \"</w>\"", path, eow->valuestring);
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab)) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.vocab: missing or not an object {token: id}", path);
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsArray(merges)) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.merges: missing or not an array", path);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: added_tokens: not an array", path);

    double max_id = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        if (!cJSON_IsNumber(e) || !hf_id_ok(e->valuedouble))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.vocab: token '%s': id is not an integer in [0, %d)", path,
                              e->string, MAX_HF_ID);
        if (e->valuedouble > max_id) max_id = e->valuedouble;
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id"), *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsNumber(id) || !cJSON_IsString(content) || !hf_id_ok(id->valuedouble))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: added_tokens: each entry needs an integer 'id' in [0, %d) and a string "
                              "'content'", path, MAX_HF_ID);
        if (id->valuedouble > max_id) max_id = id->valuedouble;
    }
    if (max_id < 0) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.vocab: empty", path);
    int n_merges = cJSON_GetArraySize(merges);
    vlmoe_tokenizer *t = NULL;
    int st = tok_alloc(&t, (int)max_id + 1, n_merges);
    cJSON_ArrayForEach(e, vocab) {
        if (st) break;
        st = hf_add(t, path, "model.vocab", e->string, e->valuedouble);
    }
    cJSON_ArrayForEach(e, added) {
        if (st) break;
        st = hf_add(t, path, "added_tokens", cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring,
                    cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble);
    }
    int k = 0;
    cJSON_ArrayForEach(e, merges) {
        if (st) break;
        const char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        if (cJSON_IsString(e)) {
            const char *sp = strchr(e->valuestring, ' ');
            if (sp && sp != e->valuestring && sp[1] && !strchr(sp + 1, ' '))
                a = e->valuestring, na = (size_t)(sp - a), b = sp + 1, nb = strlen(b);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next) && e->child->valuestring[0] && e->child->next->valuestring[0]) {
            a = e->child->valuestring, na = strlen(a), b = e->child->next->valuestring, nb = strlen(b);
        }
        if (!a) {
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.merges[%d]: expected \"a b\" or [\"a\", \"b\"]", path, k);
            break;
        }
        char *cat = str_cat(a, na, b, nb);
        if (!cat) {
            st = VLMOE_ERR_NOMEM;
            break;
        }
        const int32_t *ia = smap_find(t->vocab, a, na), *ib = smap_find(t->vocab, b, nb), *ic = smap_find(t->vocab, cat, na + nb);
        if (!ia || !ib || !ic) {
            const char *u = !ia ? a : !ib ? b : cat;
            int nu = (int)(!ia ? na : !ib ? nb : na + nb);
            st = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: model.merges[%d] '%.*s %.*s': %s '%.*s' is not in model.vocab", path, k,
                            (int)na, a, (int)nb, b, ia && ib ? "merged symbol" : "symbol", nu, u);
        } else {
            t->merge[3 * k] = *ia, t->merge[3 * k + 1] = *ib, t->merge[3 * k + 2] = *ic;
            st = umap_put(t->ranks, pair_key(*ia, *ib), k);
        }
        free(cat);
        k++;
    }
    if (!st) st = tok_finish(t, path, "model.vocab");
    if (!st) st = hf_pipeline(t, root, path);
    if (st) return vlmoe_tokenizer_free(t), st;
    *out = t;
    return VLMOE_OK;
}

static int parse_hf(vlmoe_tokenizer **out, char *buf, size_t len, const char *path);

int vlmoe_tokenizer_load_hf(vlmoe_tokenizer **out, const char *path) {
    if (!out || !path) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_load_hf: NULL argument");
    *out = NULL;
    char *buf;
    size_t len;
    int st = read_file(path, &buf, &len);
    return st ? st : parse_hf(out, buf, len, path);
}

// Parses an HF tokenizer.json's text buf (len bytes, taken over and freed); path names it in errors.
static int parse_hf(vlmoe_tokenizer **out, char *buf, size_t len, const char *path) {
    int st;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    if (!root) {
        long at = end ? (long)(end - buf) : -1;
        free(buf);
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not valid JSON (error near byte %ld)", path, at);
    }
    st = cJSON_IsObject(root) ? hf_build(out, root, path) : vlmoe_fail(VLMOE_ERR_FORMAT, "%s: not a JSON object", path);
    cJSON_Delete(root);
    free(buf);
    return st;
}

// ---------------------------------------------------------------------------------------------
// Saving in CLIP's format.

static int clip_layout(const vlmoe_tokenizer *t) {
    if (t->n_vocab != N_BASE + t->n_merges + 2 || t->sot != t->n_vocab - 2 || t->eot != t->n_vocab - 1 ||
        strcmp(t->piece[t->sot], SOT_STR) || strcmp(t->piece[t->eot], EOT_STR))
        return 0;
    char sym[16];
    for (int i = 0; i < N_BASE; i++) {
        byte_symbol(clip_byte_at(i & 255), i >= 256, sym);
        if (!t->piece[i] || strcmp(t->piece[i], sym)) return 0;
    }
    for (int k = 0; k < t->n_merges; k++) {
        const char *a = t->piece[t->merge[3 * k]], *b = t->piece[t->merge[3 * k + 1]], *c = t->piece[N_BASE + k];
        size_t na = strlen(a);
        if (!c || strncmp(c, a, na) || strcmp(c + na, b)) return 0;
    }
    return 1;
}

// CLIP's merges file of tok ("#version: 0.2" + one "a b" per line), malloc'd and NUL-terminated;
// what names the destination in errors.
static int clip_text(const vlmoe_tokenizer *tok, const char *what, char **out, size_t *len) {
    *out = NULL, *len = 0;
    if (!clip_layout(tok))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: this vocabulary's ids do not follow CLIP's layout (bytes, bytes+</w>, merges, "
                          "SOT, EOT): a merges file would renumber them", what);
    if (tok->n_merges > CLIP_MERGES)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: %d merges: a CLIP merges file is read up to %d", what, tok->n_merges, CLIP_MERGES);
    static const char head[] = "#version: 0.2\n";
    size_t n = sizeof(head) - 1;
    for (int k = 0; k < tok->n_merges; k++)
        n += strlen(tok->piece[tok->merge[3 * k]]) + strlen(tok->piece[tok->merge[3 * k + 1]]) + 2;
    char *t = malloc(n + 1);
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: out of memory for the merges text", what);
    size_t at = (size_t)sprintf(t, "%s", head);
    for (int k = 0; k < tok->n_merges; k++)
        at += (size_t)sprintf(t + at, "%s %s\n", tok->piece[tok->merge[3 * k]], tok->piece[tok->merge[3 * k + 1]]);
    *out = t, *len = at;
    return VLMOE_OK;
}

int vlmoe_tokenizer_save_clip(const vlmoe_tokenizer *tok, const char *path) {
    if (!tok || !path) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_save_clip: NULL argument");
    if (tok->spm) return vlmoe_fail(VLMOE_ERR_ARG, "%s: a SentencePiece tokenizer has no CLIP merges to save", path);
    char *text;
    size_t len;
    int st = clip_text(tok, path, &text, &len);
    if (st) return st;
    size_t n = strlen(path);
    char *tmp = str_cat(path, n, ".tmp", 4);
    FILE *f = tmp ? fopen(tmp, "wb") : NULL;
    if (!f) {
        st = tmp ? vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno)) : VLMOE_ERR_NOMEM;
        return free(tmp), free(text), st;
    }
    int ok = fwrite(text, 1, len, f) == len;
    ok = fflush(f) == 0 && ok;
    int err = errno;
    ok = fclose(f) == 0 && ok;
    if (ok && rename(tmp, path)) ok = 0, err = errno;
    st = ok ? VLMOE_OK : vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write: %s", path, strerror(err ? err : EIO));
    if (!ok) remove(tmp);
    free(tmp), free(text);
    return st;
}

// The HF tokenizer.json of a vocabulary numbered otherwise: model.vocab, model.merges, and the
// start and end tokens as added_tokens (what hf_build reads back).
static int hf_text(const vlmoe_tokenizer *tok, char **out, size_t *len) {
    cJSON *root = cJSON_CreateObject(), *model = cJSON_AddObjectToObject(root, "model");
    cJSON *vocab = model ? cJSON_AddObjectToObject(model, "vocab") : NULL;
    cJSON *merges = model ? cJSON_AddArrayToObject(model, "merges") : NULL;
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    int ok = vocab && merges && added && cJSON_AddStringToObject(model, "type", "BPE") &&
             cJSON_AddStringToObject(model, "end_of_word_suffix", EOW);
    for (int i = 0; ok && i < tok->n_vocab; i++)
        if (tok->piece[i]) ok = cJSON_AddNumberToObject(vocab, tok->piece[i], i) != NULL;
    for (int k = 0; ok && k < tok->n_merges; k++) {
        const char *a = tok->piece[tok->merge[3 * k]], *b = tok->piece[tok->merge[3 * k + 1]];
        char *pair = str_cat(a, strlen(a), " ", 1), *both = pair ? str_cat(pair, strlen(pair), b, strlen(b)) : NULL;
        ok = both && cJSON_AddItemToArray(merges, cJSON_CreateString(both));
        free(pair), free(both);
    }
    // CLIP's pipeline, which hf_pipeline reads back (NFC only when this tokenizer has it)
    static const char norm_nfc[] = "{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},{\"type\":\"Replace\","
                                   "\"pattern\":{\"Regex\":\"\\\\s+\"},\"content\":\" \"},{\"type\":\"Lowercase\"}]}";
    static const char norm_plain[] = "{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Replace\","
                                     "\"pattern\":{\"Regex\":\"\\\\s+\"},\"content\":\" \"},{\"type\":\"Lowercase\"}]}";
    cJSON *norm = ok ? cJSON_Parse(tok->nfc ? norm_nfc : norm_plain) : NULL, *pre = cJSON_CreateObject(), *split = NULL;
    cJSON *pres = pre ? cJSON_AddArrayToObject(pre, "pretokenizers") : NULL;
    ok = ok && norm && pres && cJSON_AddStringToObject(pre, "type", "Sequence") && (split = cJSON_CreateObject()) &&
         cJSON_AddItemToArray(pres, split) && cJSON_AddStringToObject(split, "type", "Split") &&
         cJSON_AddStringToObject(cJSON_AddObjectToObject(split, "pattern"), "Regex", HF_CLIP_SPLIT) &&
         cJSON_AddStringToObject(split, "behavior", "Removed") && cJSON_AddTrueToObject(split, "invert");
    cJSON *bl = ok ? cJSON_CreateObject() : NULL;
    ok = ok && bl && cJSON_AddItemToArray(pres, bl) && cJSON_AddStringToObject(bl, "type", "ByteLevel") &&
         cJSON_AddFalseToObject(bl, "add_prefix_space") && cJSON_AddFalseToObject(bl, "use_regex");
    if (ok) cJSON_AddItemToObject(root, "normalizer", norm), cJSON_AddItemToObject(root, "pre_tokenizer", pre);
    else cJSON_Delete(norm), cJSON_Delete(pre);
    const int32_t special[2] = {tok->sot, tok->eot};
    for (int i = 0; ok && i < 2; i++) {
        cJSON *e = cJSON_CreateObject();
        ok = e && cJSON_AddNumberToObject(e, "id", special[i]) && cJSON_AddStringToObject(e, "content", tok->piece[special[i]]) &&
             cJSON_AddItemToArray(added, e);
    }
    char *t = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer.json text");
    *out = t, *len = strlen(t);
    return VLMOE_OK;
}

int vlmoe_tokenizer_to_text(const vlmoe_tokenizer *tok, char **out, size_t *len) {
    if (!tok || !out || !len) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_to_text: NULL argument");
    if (tok->spm) {
        if (!(*out = malloc(tok->spm_len + 1))) return vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer text");
        memcpy(*out, tok->spm_text, tok->spm_len + 1), *len = tok->spm_len;
        return VLMOE_OK;
    }
    // a merges file cannot say NFC: such a tokenizer goes out as tokenizer.json
    if (!tok->nfc && clip_layout(tok) && tok->n_merges <= CLIP_MERGES) return clip_text(tok, "tokenizer", out, len);
    return hf_text(tok, out, len);
}

// A tokenizer around a loaded SentencePiece model sp and its text (both taken over).
static int spm_wrap(vlmoe_tokenizer **out, vlmoe_spm *sp, char *text, size_t len) {
    vlmoe_tokenizer *t = calloc(1, sizeof(*t));
    if (!t) return vlmoe_spm_free(sp), free(text), vlmoe_fail(VLMOE_ERR_NOMEM, "tokenizer: out of memory");
    t->spm = sp, t->spm_text = text, t->spm_len = len;
    t->n_vocab = vlmoe_spm_size(sp);
    t->sot = vlmoe_spm_bos(sp), t->eot = vlmoe_spm_eos(sp);
    *out = t;
    return VLMOE_OK;
}

int vlmoe_tokenizer_load_sentencepiece(vlmoe_tokenizer **out, const char *path) {
    if (!out || !path) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_load_sentencepiece: NULL argument");
    *out = NULL;
    char *buf, *text;
    size_t len, tlen;
    vlmoe_spm *sp;
    int st = read_file(path, &buf, &len);
    if (st) return st;
    st = spm_from_bytes(&sp, &text, &tlen, buf, len, path);
    free(buf);
    return st ? st : spm_wrap(out, sp, text, tlen);
}

int vlmoe_tokenizer_from_text(vlmoe_tokenizer **out, const char *text, size_t len, const char *what) {
    if (!out || (!text && len) || !what) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_from_text: NULL argument");
    *out = NULL;
    if (len > MAX_FILE_BYTES)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: larger than %zu bytes: not a tokenizer", what, MAX_FILE_BYTES);
    char *buf = malloc(len + 1);
    if (!buf) return vlmoe_fail(VLMOE_ERR_NOMEM, "%s: out of memory", what);
    memcpy(buf, text, len);
    buf[len] = 0;
    size_t i = 0;
    if (spm_text_is(buf, len)) {
        vlmoe_spm *sp = NULL;
        int st = spm_from_text(&sp, buf, len, what);
        if (!st) st = spm_wrap(out, sp, buf, len);
        else free(buf);
        return st;
    }
    while (i < len && (buf[i] == ' ' || buf[i] == '\n' || buf[i] == '\r' || buf[i] == '\t')) i++;
    return i < len && buf[i] == '{' ? parse_hf(out, buf, len, what) : parse_clip(out, buf, len, what);
}

// ---------------------------------------------------------------------------------------------
// Training: word counts after pre-tokenization, then pair counts kept up to date incrementally
// (only words holding the merged pair are revisited) with a max-heap whose stale entries are
// re-checked when popped. Symbols are identified by their string, so a pair whose concatenation
// already exists reuses that symbol (and the merges file then repeats the string, like CLIP's).

typedef struct {
    int32_t *sym;
    int32_t n, stamp;
    int64_t freq;
} tr_word;

typedef struct {
    int32_t a, b, nwhere, stamp;
    size_t capwhere;
    int32_t *where; // words that held the pair when it appeared in them (may be stale or repeated)
    int64_t count;
} tr_pair;

typedef struct {
    int64_t count;
    int32_t a, b;
} tr_ent;

typedef struct {
    char **str;
    size_t *len, nsym, capsym, caplen;
    smap syms;
    tr_word *w;
    size_t nw, capw;
    tr_pair *p;
    size_t np, capp;
    umap pairs;
    tr_ent *heap;
    size_t nheap, capheap;
} trainer;

static int tr_sym(trainer *T, char *s, size_t n, int32_t *id) { // takes s
    const int32_t *old = smap_find(&T->syms, s, n);
    if (old) return free(s), *id = *old, VLMOE_OK;
    int st;
    if (GROW(T->str, T->capsym, T->nsym + 1, "training symbols", st) ||
        GROW(T->len, T->caplen, T->nsym + 1, "training symbols", st))
        return free(s), st;
    T->str[T->nsym] = s, T->len[T->nsym] = n;
    *id = (int32_t)T->nsym++;
    return smap_put(&T->syms, s, n, *id);
}

static int tr_better(const trainer *T, tr_ent x, tr_ent y) { // x pops before y
    if (x.count != y.count) return x.count > y.count;
    for (int side = 0; side < 2; side++) {
        int32_t i = side ? x.b : x.a, j = side ? y.b : y.a;
        if (i == j) continue;
        size_t ni = T->len[i], nj = T->len[j];
        int c = memcmp(T->str[i], T->str[j], ni < nj ? ni : nj);
        return c ? c < 0 : ni < nj;
    }
    return 0;
}

static int tr_push(trainer *T, tr_ent e) {
    int st;
    if (GROW(T->heap, T->capheap, T->nheap + 1, "training heap", st)) return st;
    size_t i = T->nheap++;
    while (i && tr_better(T, e, T->heap[(i - 1) / 2])) {
        T->heap[i] = T->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    T->heap[i] = e;
    return VLMOE_OK;
}

static tr_ent tr_pop(trainer *T) {
    tr_ent top = T->heap[0], last = T->heap[--T->nheap];
    size_t i = 0, n = T->nheap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && tr_better(T, T->heap[c + 1], T->heap[c])) c++;
        if (!tr_better(T, T->heap[c], last)) break;
        T->heap[i] = T->heap[c];
        i = c;
    }
    if (n) T->heap[i] = last;
    return top;
}

// count += delta for pair (a, b); word w is recorded in its list when `where` is set.
static int tr_count(trainer *T, int32_t a, int32_t b, int64_t delta, int32_t w, int where, int32_t *idx) {
    int32_t *pi = umap_find(&T->pairs, pair_key(a, b));
    int32_t i;
    if (pi) {
        i = *pi;
    } else {
        int st;
        if (GROW(T->p, T->capp, T->np + 1, "training pairs", st)) return st;
        i = (int32_t)T->np++;
        T->p[i] = (tr_pair){a, b, 0, -1, 0, NULL, 0};
        if ((st = umap_put(&T->pairs, pair_key(a, b), i))) return st;
    }
    tr_pair *p = &T->p[i];
    p->count += delta;
    if (where && (!p->nwhere || p->where[p->nwhere - 1] != w)) {
        int st;
        if (GROW(p->where, p->capwhere, (size_t)p->nwhere + 1, "training pair lists", st)) return st;
        p->where[p->nwhere++] = w;
    }
    if (idx) *idx = i;
    return VLMOE_OK;
}

static void tr_free(trainer *T) {
    for (size_t i = 0; i < T->nsym; i++) free(T->str[i]);
    for (size_t i = 0; i < T->nw; i++) free(T->w[i].sym);
    for (size_t i = 0; i < T->np; i++) free(T->p[i].where);
    free(T->str), free(T->len), free(T->w), free(T->p), free(T->heap);
    free(T->syms.key), free(T->syms.len), free(T->syms.val);
    free(T->pairs.key), free(T->pairs.val);
}

// Word frequencies of all texts: one tr_word per distinct pre-token (bytes -> byte symbols).
static int tr_words(trainer *T, const char *const *texts, size_t n) {
    pcre2_code *re;
    int st = compile_pattern(&re);
    if (st) return st;
    smap seen = {0};
    char **keys = NULL;
    size_t nkeys = 0, capkeys = 0;
    for (size_t i = 0; i < n && !st; i++) {
        if (!texts[i]) {
            st = vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_train: texts[%zu] is NULL", i);
            break;
        }
        pretok p;
        int got = 1;
        st = pretok_init(&p, re, texts[i], 0);
        while (!st) {
            if ((st = pretok_next(&p, re, &got)) || !got) break;
            if (!p.plen || piece_is(&p, SOT_STR) || piece_is(&p, EOT_STR)) continue;
            const int32_t *wi = smap_find(&seen, (const char *)p.piece, p.plen);
            if (wi) {
                T->w[*wi].freq++;
                continue;
            }
            char *key = str_dup((const char *)p.piece, p.plen);
            int32_t *sym = alloc_array(p.plen, sizeof(int32_t), "training word");
            if (!key || !sym || GROW(keys, capkeys, nkeys + 1, "training words", st) ||
                GROW(T->w, T->capw, T->nw + 1, "training words", st)) {
                free(key), free(sym);
                st = st ? st : VLMOE_ERR_NOMEM;
                break;
            }
            keys[nkeys++] = key;
            for (size_t j = 0; j < p.plen; j++) sym[j] = j + 1 < p.plen ? p.piece[j] : 256 + p.piece[j];
            T->w[T->nw] = (tr_word){sym, (int32_t)p.plen, -1, 1};
            st = smap_put(&seen, key, p.plen, (int32_t)T->nw++);
        }
        pretok_free(&p);
    }
    for (size_t i = 0; i < nkeys; i++) free(keys[i]);
    free(keys);
    free(seen.key), free(seen.len), free(seen.val);
    pcre2_code_free(re);
    return st;
}

// Merges every (a, b) of word w into c, keeping the pair counts; new pairs (with c) are stamped
// `stamp` and listed in touched.
static int tr_merge_word(trainer *T, int32_t wi, int32_t a, int32_t b, int32_t c, int32_t stamp, int32_t **touched,
                         size_t *ntouched, size_t *captouched) {
    tr_word *w = &T->w[wi];
    int has = 0;
    for (int32_t i = 0; i + 1 < w->n && !has; i++) has = w->sym[i] == a && w->sym[i + 1] == b;
    if (!has) return VLMOE_OK;
    int st = VLMOE_OK;
    for (int32_t i = 0; i + 1 < w->n && !st; i++) st = tr_count(T, w->sym[i], w->sym[i + 1], -w->freq, wi, 0, NULL);
    int32_t m = 0;
    for (int32_t i = 0; i < w->n;) {
        if (w->sym[i] == a && i + 1 < w->n && w->sym[i + 1] == b) w->sym[m++] = c, i += 2;
        else w->sym[m++] = w->sym[i++];
    }
    w->n = m;
    for (int32_t i = 0; i + 1 < w->n && !st; i++) {
        int fresh = w->sym[i] == c || w->sym[i + 1] == c;
        int32_t pi;
        st = tr_count(T, w->sym[i], w->sym[i + 1], w->freq, wi, fresh, &pi);
        if (!st && fresh && T->p[pi].stamp != stamp) {
            T->p[pi].stamp = stamp;
            if (!GROW(*touched, *captouched, *ntouched + 1, "training pairs", st)) (*touched)[(*ntouched)++] = pi;
        }
    }
    return st;
}

int vlmoe_tokenizer_train(vlmoe_tokenizer **out, const char *const *texts, size_t n, int vocab_size) {
    if (!out || (!texts && n)) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_train: NULL argument");
    *out = NULL;
    if (vocab_size < N_BASE + 2 || vocab_size > CLIP_MAX_VOCAB)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_tokenizer_train: vocab size %d: must be in [%d, %d] (512 byte symbols + "
                          "merges + SOT/EOT; a CLIP merges file holds at most %d merges)", vocab_size, N_BASE + 2,
                          CLIP_MAX_VOCAB, CLIP_MERGES);
    trainer T = {0};
    int st = VLMOE_OK;
    char sym[16];
    // Symbol i < 512 is byte i (i < 256) or byte i-256 + "</w>", so words are built from bytes.
    for (int i = 0; i < N_BASE && !st; i++) {
        size_t k = byte_symbol(i & 255, i >= 256, sym);
        char *s = str_dup(sym, k);
        int32_t id;
        st = s ? tr_sym(&T, s, k, &id) : VLMOE_ERR_NOMEM;
    }
    if (!st) st = tr_words(&T, texts, n);
    for (size_t wi = 0; wi < T.nw && !st; wi++)
        for (int32_t i = 0; i + 1 < T.w[wi].n && !st; i++)
            st = tr_count(&T, T.w[wi].sym[i], T.w[wi].sym[i + 1], T.w[wi].freq, (int32_t)wi, 1, NULL);
    for (size_t i = 0; i < T.np && !st; i++) st = tr_push(&T, (tr_ent){T.p[i].count, T.p[i].a, T.p[i].b});

    const int target = vocab_size - N_BASE - 2;
    int32_t *merges = alloc_array((size_t)target, 2 * sizeof(int32_t), "trained merges"), *touched = NULL;
    size_t ntouched = 0, captouched = 0;
    int nm = 0;
    if (!merges) st = VLMOE_ERR_NOMEM;
    while (!st && nm < target && T.nheap) {
        tr_ent e = tr_pop(&T);
        int32_t pi = *umap_find(&T.pairs, pair_key(e.a, e.b));
        int64_t cur = T.p[pi].count;
        if (cur != e.count) { // stale: re-queue a decreased count; an increased one was pushed
            if (cur > 0 && cur < e.count) st = tr_push(&T, (tr_ent){cur, e.a, e.b});
            continue;
        }
        char *s = str_cat(T.str[e.a], T.len[e.a], T.str[e.b], T.len[e.b]);
        int32_t c;
        st = s ? tr_sym(&T, s, T.len[e.a] + T.len[e.b], &c) : VLMOE_ERR_NOMEM;
        if (st) break;
        merges[2 * nm] = e.a, merges[2 * nm + 1] = e.b;
        nm++;
        ntouched = 0;
        const int32_t *where = T.p[pi].where, nwhere = T.p[pi].nwhere; // (a, b) gains no words now
        for (int32_t k = 0; k < nwhere && !st; k++) {
            tr_word *w = &T.w[where[k]];
            if (w->stamp == nm) continue;
            w->stamp = nm;
            st = tr_merge_word(&T, where[k], e.a, e.b, c, nm, &touched, &ntouched, &captouched);
        }
        for (size_t k = 0; k < ntouched && !st; k++)
            if (T.p[touched[k]].count > 0)
                st = tr_push(&T, (tr_ent){T.p[touched[k]].count, T.p[touched[k]].a, T.p[touched[k]].b});
    }
    free(touched);
    merge_src *ms = st ? NULL : alloc_array((size_t)nm, sizeof(merge_src), "trained merges");
    if (!st && !ms) st = VLMOE_ERR_NOMEM;
    for (int k = 0; !st && k < nm; k++)
        ms[k] = (merge_src){T.str[merges[2 * k]], T.str[merges[2 * k + 1]], T.len[merges[2 * k]], T.len[merges[2 * k + 1]], 0};
    if (!st) st = build_clip(out, ms, nm, "trained merges");
    free(ms), free(merges);
    tr_free(&T);
    return st;
}
