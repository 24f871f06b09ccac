// test_tokenizer.c: CLIP's byte-level BPE tokenizer (src/tok/bpe.c, spec MODEL.md "Tokenizer"):
// ids equal to tests/ref/clip_bpe_ref.py's (fixture tokenizer_bpe.json from gen_tokenizer.py),
// CLIP .txt/.txt.gz and HF tokenizer.json loading, training, round trips, and bad input on purpose.
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "test.h"
#include "tok/tok.h"

// The merges list of gen_tokenizer.py's MERGES_A (byte-level symbols: "Ã ©</w>" is the two bytes
// of "é"); the fixture holds its own copy and the test checks they agree.
static const char *MERGES_A[] = {
    "t h", "th e</w>", "a n", "an d</w>", "o f</w>", "p h", "o t", "ph ot", "phot o</w>", "c a",
    "ca t</w>", "i t", "' s</w>", "' t</w>", "d o", "do n", "i s", "is n", "a f", "c af",
    "Ã ©</w>", "caf Ã©</w>", "n a", "Ã ¯", "na Ã¯", "v e</w>", "naÃ¯ ve</w>", "b an", "ban an",
    "banan a</w>", "a a", "aa a</w>", "aa aa", "h e", "he l", "hel l", "hell o</w>", "ä ¸",
    "ä¸ Ń", "ð Ł", "ðŁ ĺ", "2 0", "s t", "st o", "sto p</w>", "e s</w>", "r e", "x y",
};
#define N_MERGES_A ((int)(sizeof(MERGES_A) / sizeof(MERGES_A[0])))

static const char *CAPTIONS[] = {
    "a photo of a cat.", "Don't stop! It's 2023, isn't it?", "café naïve résumé CAFÉ NAÏVE",
    "emoji 😀👍🏽 and ❤️", "中文字符 日本語のテキスト", "   extra   \t whitespace \n\n here   ",
    "Tom &amp; Jerry &lt;3 &quot;q&quot; &#39;s&#39; &#233;t&#xE9;", "", "<|startoftext|>hi<|endoftext|>",
    "aaaaa banana bananas", "İstanbul ΑΘΗΝΑ Москва", "rock'n'roll ''", "3.14159 1,000,000 ½ ٣",
};
#define N_CAPTIONS ((int)(sizeof(CAPTIONS) / sizeof(CAPTIONS[0])))

// A small caption corpus for training (words separated by spaces only, so decode(encode(x)) is
// exactly the normalised caption).
static const char *CORPUS[] = {
    "a photo of a red circle", "a photo of a blue square", "A PHOTO OF A GREEN TRIANGLE",
    "a red circle on a blue background", "two red circles and a square", "the square is blue",
    "a small green triangle and a big red circle", "circles squares and triangles",
    "a photo of a cat", "a   photo of   the cat", "Caf&eacute; na&iuml;ve r&eacute;sum&eacute;",
    "photo of twelve cats", "banana bananas bandana", "aaaa aaaaa aaa", "hello world hello",
    "a photo of a dog", "a photo of the dog ball", "red red red blue blue", "circle circle square",
    "ÀÉÎÕÜ çñ ß ÿ", "x y z x y z xyz xyz",
};
#define N_CORPUS ((int)(sizeof(CORPUS) / sizeof(CORPUS[0])))

static char dir[256];
static char *made[64];
static int nmade;

static const char *tmp_path(const char *name) {
    static char buf[16][512];
    static int k;
    char *p = buf[k++ % 16];
    snprintf(p, 512, "%s/%s", dir, name);
    int seen = 0;
    for (int i = 0; i < nmade; i++) seen |= !strcmp(made[i], p);
    if (!seen && nmade < 64) made[nmade++] = strdup(p);
    return p;
}

static void write_bytes(const char *path, const char *s, size_t n) { test_write_file(path, s, n); }

static void write_text(const char *path, const char *s) { write_bytes(path, s, strlen(s)); }

static void write_gz(const char *path, const char *s) {
    gzFile f = gzopen(path, "wb9");
    gzwrite(f, s, (unsigned)strlen(s));
    gzclose(f);
}

static char *read_all(const char *path, size_t *n) { return test_read_file(path, n); }

// "#version: 0.2\n" + one merge per line.
static char *merges_text(const char *const *m, int n) {
    size_t cap = 32;
    for (int i = 0; i < n; i++) cap += strlen(m[i]) + 1;
    char *s = malloc(cap), *p = s;
    p += sprintf(p, "#version: 0.2\n");
    for (int i = 0; i < n; i++) p += sprintf(p, "%s\n", m[i]);
    return s;
}

static int same_ids(const int32_t *a, const int32_t *b, int n) { return !memcmp(a, b, sizeof(int32_t) * (size_t)n); }

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}

static vlmoe_tokenizer *load_a(const char *name, int gz) {
    char *txt = merges_text(MERGES_A, N_MERGES_A);
    const char *p = tmp_path(name);
    if (gz) write_gz(p, txt);
    else write_text(p, txt);
    free(txt);
    vlmoe_tokenizer *t = NULL;
    int st = vlmoe_tokenizer_load_clip(&t, p);
    CHECK(st == VLMOE_OK && t, "load %s: %s", p, vlmoe_last_error());
    return t;
}

// Strips every ' ' (decode's word separators) for comparisons that ignore spacing.
static void squeeze(char *s) {
    char *o = s;
    for (; *s; s++)
        if (*s != ' ') *o++ = *s;
    *o = 0;
}

// ---------------------------------------------------------------------------------------------

static void test_clip_file(void) {
    vlmoe_tokenizer *t = load_a("a.txt", 0), *g = load_a("a.txt.gz", 1);
    if (!t || !g) {
        vlmoe_tokenizer_free(t), vlmoe_tokenizer_free(g);
        return;
    }
    CHECK(vlmoe_tokenizer_vocab_size(t) == 512 + N_MERGES_A + 2, "vocab size %d", vlmoe_tokenizer_vocab_size(t));
    CHECK(vlmoe_tokenizer_num_merges(t) == N_MERGES_A, "merges %d", vlmoe_tokenizer_num_merges(t));
    CHECK(vlmoe_tokenizer_sot(t) == 512 + N_MERGES_A && vlmoe_tokenizer_eot(t) == 513 + N_MERGES_A, "sot %d eot %d",
          vlmoe_tokenizer_sot(t), vlmoe_tokenizer_eot(t));
    CHECK(!strcmp(vlmoe_tokenizer_piece(t, 0), "!") && !strcmp(vlmoe_tokenizer_piece(t, 256), "!</w>"), "byte pieces");
    CHECK(!strcmp(vlmoe_tokenizer_piece(t, 188), "Ā"), "byte 0 is U+0100 at id 188: %s", vlmoe_tokenizer_piece(t, 188));
    CHECK(!strcmp(vlmoe_tokenizer_piece(t, 512 + 1), "the</w>"), "merge piece %s", vlmoe_tokenizer_piece(t, 513));
    CHECK(!strcmp(vlmoe_tokenizer_piece(t, vlmoe_tokenizer_eot(t)), "<|endoftext|>"), "eot piece");
    CHECK(!vlmoe_tokenizer_piece(t, -1) && !vlmoe_tokenizer_piece(t, 562) && !vlmoe_tokenizer_piece(NULL, 0), "bad ids");
    CHECK(vlmoe_tokenizer_force_literal_bpe(t, 0) == 1, "MERGES_A is well formed: heap BPE");

    // Hand-checked: a</w>=256+64, photo</w>=512+8, of</w>=512+4, cat</w>=512+10, .</w>=256+13.
    int32_t ids[77], ids2[77], exp[] = {560, 320, 520, 516, 320, 522, 269, 561};
    int len = -1;
    CHECK(vlmoe_tokenizer_encode(t, "a photo of a cat.", ids, 77, &len) == VLMOE_OK, "%s", vlmoe_last_error());
    CHECK(len == 8 && same_ids(ids, exp, 8) && ids[8] == 0 && ids[76] == 0, "a photo of a cat.: len %d ids %d %d %d", len,
          ids[0], ids[1], ids[2]);
    char out[256];
    CHECK(vlmoe_tokenizer_decode(t, ids, len, out, sizeof(out)) == VLMOE_OK && !strcmp(out, "a photo of a cat ."),
          "decode '%s'", out);
    for (int i = 0; i < N_CAPTIONS; i++) {
        int l1, l2;
        int s1 = vlmoe_tokenizer_encode(t, CAPTIONS[i], ids, 77, &l1), s2 = vlmoe_tokenizer_encode(g, CAPTIONS[i], ids2, 77, &l2);
        CHECK(!s1 && !s2 && l1 == l2 && same_ids(ids, ids2, 77), "plain vs gz differ on '%s'", CAPTIONS[i]);
    }
    // Truncation keeps EOT last; the empty text is [SOT, EOT]; ctx 2 leaves no room.
    char longtext[4000] = "";
    for (int i = 0; i < 200; i++) strcat(longtext, "the cat ");
    CHECK(vlmoe_tokenizer_encode(t, longtext, ids, 77, &len) == 0 && len == 77 && ids[0] == 560 && ids[76] == 561 &&
          ids[75] == 513, "truncation: len %d last %d", len, ids[76]);
    CHECK(vlmoe_tokenizer_encode(t, longtext, ids, 16, &len) == 0 && len == 16 && ids[15] == 561, "ctx 16");
    CHECK(vlmoe_tokenizer_encode(t, longtext, ids, 2, &len) == 0 && len == 2 && ids[0] == 560 && ids[1] == 561, "ctx 2");
    CHECK(vlmoe_tokenizer_encode(t, "", ids, 77, &len) == 0 && len == 2 && ids[1] == 561 && ids[2] == 0, "empty");
    CHECK(vlmoe_tokenizer_encode(t, " \t\n ", ids, 5, NULL) == 0 && ids[1] == 561 && ids[4] == 0, "blank, len NULL");
    // Literal special tokens in the text are the special tokens (CLIP's cache), case-insensitively.
    CHECK(vlmoe_tokenizer_encode(t, "<|STARTOFTEXT|>x<|endoftext|>", ids, 77, &len) == 0 && len == 5 && ids[1] == 560 &&
          ids[3] == 561, "specials in text: len %d", len);
    // Decode skips SOT/EOT, strips; id 0 is "!".
    int32_t some[] = {560, 0, 256, 523, 561};
    CHECK(vlmoe_tokenizer_decode(t, some, 5, out, sizeof(out)) == 0 && !strcmp(out, "!! it"), "decode '%s'", out);
    vlmoe_tokenizer_free(t);
    vlmoe_tokenizer_free(g);
}

// The file has more merges than CLIP reads: only the first 48894 are used.
static void test_clip_count(void) {
    const int n = 48900;
    char *txt = malloc((size_t)n * 16 + 32), *p = txt;
    vlmoe_tokenizer *t = NULL;
    if (!(t = load_a("tmp_for_pieces.txt", 0))) {
        free(txt);
        return;
    }
    p += sprintf(p, "#version: 0.2\n");
    for (int k = 0; k < n; k++) // (byte symbol x, byte symbol y or y</w>): all distinct
        p += sprintf(p, "%s %s\n", vlmoe_tokenizer_piece(t, k / 512), vlmoe_tokenizer_piece(t, k % 512));
    vlmoe_tokenizer_free(t);
    const char *path = tmp_path("big.txt");
    write_text(path, txt);
    free(txt);
    t = NULL;
    CHECK(vlmoe_tokenizer_load_clip(&t, path) == 0, "%s", vlmoe_last_error());
    if (!t) return;
    CHECK(vlmoe_tokenizer_vocab_size(t) == 49408 && vlmoe_tokenizer_num_merges(t) == 48894 && vlmoe_tokenizer_eot(t) == 49407,
          "CLIP sizes: vocab %d merges %d", vlmoe_tokenizer_vocab_size(t), vlmoe_tokenizer_num_merges(t));
    int32_t ids[16];
    int len;
    CHECK(vlmoe_tokenizer_encode(t, "hello", ids, 16, &len) == 0 && len >= 3, "encode with the big vocabulary");
    const char *again = tmp_path("big_again.txt");
    vlmoe_tokenizer *r = NULL;
    CHECK(vlmoe_tokenizer_save_clip(t, again) == 0 && vlmoe_tokenizer_load_clip(&r, again) == 0 &&
          vlmoe_tokenizer_vocab_size(r) == 49408, "save/reload: %s", vlmoe_last_error());
    vlmoe_tokenizer_free(r);
    vlmoe_tokenizer_free(t);
}

// tokenizer.json with the same vocabulary: ids_in_vocab puts SOT/EOT into model.vocab too;
// array_merges writes merges as [["a", "b"], ...] (newer files); swap exchanges two ids.
static char *hf_json(const vlmoe_tokenizer *t, const char *const *merges, int nm, int ids_in_vocab, int array_merges,
                     int swap) {
    cJSON *root = cJSON_CreateObject(), *model = cJSON_CreateObject(), *vocab = cJSON_CreateObject();
    cJSON *added = cJSON_CreateArray(), *ml = cJSON_CreateArray();
    cJSON_AddStringToObject(root, "version", "1.0");
    int sot = vlmoe_tokenizer_sot(t), eot = vlmoe_tokenizer_eot(t);
    for (int id = 0; id < vlmoe_tokenizer_vocab_size(t); id++) {
        int v = swap && id == 520 ? 521 : swap && id == 521 ? 520 : id;
        if (ids_in_vocab || (id != sot && id != eot)) cJSON_AddNumberToObject(vocab, vlmoe_tokenizer_piece(t, id), v);
    }
    for (int s = 0; s < 2; s++) {
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", s ? eot : sot);
        cJSON_AddStringToObject(a, "content", s ? "<|endoftext|>" : "<|startoftext|>");
        cJSON_AddBoolToObject(a, "special", 1);
        cJSON_AddItemToArray(added, a);
    }
    for (int k = 0; k < nm; k++) {
        if (!array_merges) {
            cJSON_AddItemToArray(ml, cJSON_CreateString(merges[k]));
            continue;
        }
        char a[64], b[64];
        sscanf(merges[k], "%63s %63s", a, b);
        cJSON *pair = cJSON_CreateArray();
        cJSON_AddItemToArray(pair, cJSON_CreateString(a));
        cJSON_AddItemToArray(pair, cJSON_CreateString(b));
        cJSON_AddItemToArray(ml, pair);
    }
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddStringToObject(model, "end_of_word_suffix", "</w>");
    cJSON_AddItemToObject(model, "vocab", vocab);
    cJSON_AddItemToObject(model, "merges", ml);
    cJSON_AddItemToObject(root, "added_tokens", added);
    cJSON_AddItemToObject(root, "model", model);
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

static void test_hf(void) {
    vlmoe_tokenizer *a = load_a("a_hf_src.txt", 0);
    if (!a) return;
    for (int variant = 0; variant < 3; variant++) {
        char *js = hf_json(a, MERGES_A, N_MERGES_A, variant != 1, variant == 1, variant == 2);
        const char *path = tmp_path(variant == 0 ? "tokenizer.json" : variant == 1 ? "tokenizer_arr.json" : "tokenizer_swap.json");
        write_text(path, js);
        free(js);
        vlmoe_tokenizer *h = NULL;
        CHECK(vlmoe_tokenizer_load_hf(&h, path) == 0, "variant %d: %s", variant, vlmoe_last_error());
        if (!h) continue;
        CHECK(vlmoe_tokenizer_vocab_size(h) == vlmoe_tokenizer_vocab_size(a) && vlmoe_tokenizer_sot(h) == vlmoe_tokenizer_sot(a) &&
              vlmoe_tokenizer_eot(h) == vlmoe_tokenizer_eot(a), "variant %d: sizes", variant);
        for (int i = 0; i < N_CAPTIONS; i++) {
            int32_t x[77], y[77];
            int lx, ly;
            vlmoe_tokenizer_encode(a, CAPTIONS[i], x, 77, &lx);
            CHECK(vlmoe_tokenizer_encode(h, CAPTIONS[i], y, 77, &ly) == 0 && lx == ly, "variant %d '%s'", variant, CAPTIONS[i]);
            if (variant == 2) // ids 520/521 (photo</w>, ca) trade places
                for (int k = 0; k < 77; k++) y[k] = y[k] == 520 ? 521 : y[k] == 521 ? 520 : y[k];
            CHECK(same_ids(x, y, 77), "variant %d: ids differ on '%s'", variant, CAPTIONS[i]);
        }
        // the text a model file carries: a merges file, or tokenizer.json for the renumbered one;
        // read back, it gives the same ids
        char *text = NULL;
        size_t tl = 0;
        vlmoe_tokenizer *back = NULL;
        CHECK(vlmoe_tokenizer_to_text(h, &text, &tl) == 0 && text && tl == strlen(text) &&
              text[0] == (variant < 2 ? '#' : '{'), "variant %d: to_text: %s", variant, vlmoe_last_error());
        CHECK(text && vlmoe_tokenizer_from_text(&back, text, tl, "model: tokenizer") == 0 &&
              vlmoe_tokenizer_vocab_size(back) == vlmoe_tokenizer_vocab_size(h) &&
              vlmoe_tokenizer_sot(back) == vlmoe_tokenizer_sot(h) && vlmoe_tokenizer_eot(back) == vlmoe_tokenizer_eot(h),
              "variant %d: from_text: %s", variant, vlmoe_last_error());
        for (int i = 0; back && i < N_CAPTIONS; i++) {
            int32_t x[77], y[77];
            vlmoe_tokenizer_encode(h, CAPTIONS[i], x, 77, NULL);
            CHECK(vlmoe_tokenizer_encode(back, CAPTIONS[i], y, 77, NULL) == 0 && same_ids(x, y, 77),
                  "variant %d: the text read back tokenizes '%s' alike", variant, CAPTIONS[i]);
        }
        vlmoe_tokenizer_free(back), free(text);
        back = NULL;
        CHECK(vlmoe_tokenizer_from_text(&back, "#version: 0.2\na b c\n", 20, "m.safetensors: tokenizer") ==
                  VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), "m.safetensors: tokenizer: line 2"),
              "a corrupt text names where it came from: %s", vlmoe_last_error());
        const char *saved = tmp_path("from_hf.txt");
        int st = vlmoe_tokenizer_save_clip(h, saved);
        if (variant < 2) {
            vlmoe_tokenizer *r = NULL;
            size_t n1, n2;
            char *f1 = read_all(saved, &n1), *txt = merges_text(MERGES_A, N_MERGES_A);
            n2 = strlen(txt);
            CHECK(st == 0 && f1 && n1 == n2 && !memcmp(f1, txt, n1), "HF -> CLIP merges file: %s", vlmoe_last_error());
            CHECK(vlmoe_tokenizer_load_clip(&r, saved) == 0, "%s", vlmoe_last_error());
            vlmoe_tokenizer_free(r);
            free(f1), free(txt);
        } else {
            CHECK(st == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "layout"), "renumbered vocabulary cannot be saved: %s",
                  vlmoe_last_error());
        }
        vlmoe_tokenizer_free(h);
    }
    vlmoe_tokenizer_free(a);
}

static int train_save(const char *const *texts, int n, int vocab, const char *name, vlmoe_tokenizer **out) {
    *out = NULL;
    int st = vlmoe_tokenizer_train(out, texts, (size_t)n, vocab);
    CHECK(st == 0 && *out, "train: %s", vlmoe_last_error());
    if (st) return st;
    st = vlmoe_tokenizer_save_clip(*out, tmp_path(name));
    CHECK(st == 0, "save: %s", vlmoe_last_error());
    return st;
}

static void test_train(void) {
    vlmoe_tokenizer *t1, *t2, *r = NULL;
    if (train_save(CORPUS, N_CORPUS, 700, "trained1.txt", &t1) || train_save(CORPUS, N_CORPUS, 700, "trained2.txt", &t2))
        return;
    size_t n1, n2;
    char *f1 = read_all(tmp_path("trained1.txt"), &n1), *f2 = read_all(tmp_path("trained2.txt"), &n2);
    CHECK(f1 && f2 && n1 == n2 && !memcmp(f1, f2, n1), "training is deterministic");
    CHECK(f1 && !strncmp(f1, "#version: 0.2\n", 14), "CLIP header");
    free(f1), free(f2);
    int V = vlmoe_tokenizer_vocab_size(t1);
    CHECK(V > 514 && V <= 700, "trained vocab %d", V);
    CHECK(vlmoe_tokenizer_load_clip(&r, tmp_path("trained1.txt")) == 0 && vlmoe_tokenizer_vocab_size(r) == V, "reload: %s",
          vlmoe_last_error());
    size_t bytes = 0, tokens = 0;
    for (int i = 0; r && i < N_CORPUS + N_CAPTIONS; i++) {
        const char *x = i < N_CORPUS ? CORPUS[i] : CAPTIONS[i - N_CORPUS];
        int32_t ids[256], ids2[256];
        int len, len2;
        char dec[1024], norm[1024];
        CHECK(vlmoe_tokenizer_encode(t1, x, ids, 256, &len) == 0 && vlmoe_tokenizer_encode(r, x, ids2, 256, &len2) == 0 &&
              len == len2 && same_ids(ids, ids2, 256), "reloaded vocabulary encodes '%s' the same", x);
        CHECK(vlmoe_tokenizer_decode(t1, ids, len, dec, sizeof(dec)) == 0 && vlmoe_tokenizer_normalize(x, norm, sizeof(norm)) == 0,
              "%s", vlmoe_last_error());
        if (i < N_CORPUS) {
            CHECK(!strcmp(dec, norm), "round trip '%s': '%s' vs '%s'", x, dec, norm);
            bytes += strlen(norm), tokens += (size_t)len - 2;
        }
        squeeze(dec), squeeze(norm);
        if (!strstr(x, "<|")) // literal special tokens become SOT/EOT, which decode skips
            CHECK(!strcmp(dec, norm), "round trip without spaces '%s': '%s' vs '%s'", x, dec, norm);
    }
    CHECK(tokens * 3 < bytes, "the corpus should be merged into words: %zu tokens for %zu bytes", tokens, bytes);
    vlmoe_tokenizer_free(r);
    vlmoe_tokenizer_free(t1);
    vlmoe_tokenizer_free(t2);

    // Runs out of pairs: "ab" alone gives one merge; no texts gives none.
    const char *ab[] = {"ab", "AB ab"};
    vlmoe_tokenizer *t = NULL;
    CHECK(vlmoe_tokenizer_train(&t, ab, 2, 600) == 0 && vlmoe_tokenizer_vocab_size(t) == 515 &&
          !strcmp(vlmoe_tokenizer_piece(t, 512), "ab</w>"), "one merge: %s", vlmoe_last_error());
    vlmoe_tokenizer_free(t), t = NULL;
    CHECK(vlmoe_tokenizer_train(&t, NULL, 0, 514) == 0 && vlmoe_tokenizer_vocab_size(t) == 514, "no texts");
    vlmoe_tokenizer_free(t), t = NULL;
    CHECK(vlmoe_tokenizer_train(&t, ab, 2, 513) == VLMOE_ERR_ARG && !t, "vocab too small");
    CHECK(vlmoe_tokenizer_train(&t, ab, 2, 49409) == VLMOE_ERR_ARG && !t, "vocab too large");
    const char *withnull[] = {"a", NULL};
    CHECK(vlmoe_tokenizer_train(&t, withnull, 2, 600) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "texts[1]"), "NULL text");
}

// Invalid UTF-8 and random bytes: never fails, and the bytes come back.
static void test_bytes(void) {
    vlmoe_tokenizer *t = load_a("a_bytes.txt", 0), *tr = NULL;
    CHECK(vlmoe_tokenizer_train(&tr, CORPUS, N_CORPUS, 650) == 0, "%s", vlmoe_last_error());
    if (!t || !tr) {
        vlmoe_tokenizer_free(t), vlmoe_tokenizer_free(tr);
        return;
    }
    const char *bad[] = {"\xff\xfe", "caf\xc3", "a\xc3\x28 b", "\xed\xa0\x80 surrogate", "\xf4\x90\x80\x80 big",
                         "\xc0\xaf overlong", "&\xff; &amp\xff", "\x80\x80\x80xyz\xe2\x82"};
    int32_t ids[1024];
    char dec[4096], norm[4096], text[300];
    for (int i = 0; i < 300; i++) {
        const char *x = text;
        if (i < 8) {
            x = bad[i];
        } else {
            int n = (int)(rnd() % 200);
            for (int k = 0; k < n; k++) {
                uint64_t r = rnd();
                text[k] = r % 4 == 0 ? "abc &;#'x <|>\t"[r / 4 % 14] : (char)(1 + r / 4 % 255);
            }
            text[n] = 0;
        }
        for (int w = 0; w < 2; w++) {
            vlmoe_tokenizer *tok = w ? tr : t;
            int len;
            int st = vlmoe_tokenizer_encode(tok, x, ids, 1024, &len);
            CHECK(st == 0 && len >= 2 && len < 1024, "random bytes %d: %s", i, vlmoe_last_error());
            if (st) continue;
            CHECK(vlmoe_tokenizer_decode(tok, ids, len, dec, sizeof(dec)) == 0 && vlmoe_tokenizer_normalize(x, norm, sizeof(norm)) == 0,
                  "%s", vlmoe_last_error());
            squeeze(dec), squeeze(norm);
            CHECK(!strcmp(dec, norm), "bytes case %d: decode(encode(x)) != normalize(x)", i);
            if (w == 0 && strcmp(dec, norm)) break;
        }
    }
    int len;
    CHECK(vlmoe_tokenizer_encode(t, "caf\xc3", ids, 77, &len) == 0 && len == 5 && ids[3] == 383,
          "raw 0xC3 -> its </w> byte token: len %d id %d", len, ids[3]);
    vlmoe_tokenizer_free(t);
    vlmoe_tokenizer_free(tr);
}

// Many threads encoding with one tokenizer get the serial results.
static void test_threads(void) {
    vlmoe_tokenizer *t = load_a("a_threads.txt", 0);
    if (!t) return;
    enum { N = 64, C = 77 };
    static int32_t ser[N][C], par[N][C];
    for (int i = 0; i < N; i++) vlmoe_tokenizer_encode(t, CAPTIONS[i % N_CAPTIONS], ser[i], C, NULL);
    int bad = 0;
#pragma omp parallel for num_threads(4) reduction(+ : bad)
    for (int i = 0; i < N; i++) {
        for (int rep = 0; rep < 5; rep++) {
            bad += vlmoe_tokenizer_encode(t, CAPTIONS[i % N_CAPTIONS], par[i], C, NULL) != 0;
            bad += !same_ids(par[i], ser[i], C);
        }
    }
    CHECK(bad == 0, "%d concurrent encodes differ", bad);
    vlmoe_tokenizer_free(t);
}

static void expect_fail(int st, int want, const char *what, const char *must1, const char *must2) {
    const char *e = vlmoe_last_error();
    CHECK(st == want && strstr(e, must1) && (!must2 || strstr(e, must2)), "%s: status %d (want %d), message '%s'", what, st,
          want, e);
}

static void test_bad_input(void) {
    vlmoe_tokenizer *t = (vlmoe_tokenizer *)1;
    const char *missing = tmp_path("no_such_file.txt");
    expect_fail(vlmoe_tokenizer_load_clip(&t, missing), VLMOE_ERR_IO, "missing file", missing, NULL);
    CHECK(t == NULL, "*out NULL after failure");
    expect_fail(vlmoe_tokenizer_load_hf(&t, missing), VLMOE_ERR_IO, "missing json", missing, NULL);

    char *txt = merges_text(MERGES_A, N_MERGES_A);
    const char *gz = tmp_path("full.txt.gz"), *cut = tmp_path("cut.txt.gz"), *flip = tmp_path("flip.txt.gz");
    write_gz(gz, txt);
    size_t n;
    char *bytes = read_all(gz, &n);
    write_bytes(cut, bytes, n / 2);
    expect_fail(vlmoe_tokenizer_load_clip(&t, cut), VLMOE_ERR_IO, "truncated gz", cut, "truncated");
    for (size_t i = n / 3; i < n / 3 + 8; i++) bytes[i] ^= 0x5A;
    write_bytes(flip, bytes, n);
    int st = vlmoe_tokenizer_load_clip(&t, flip);
    CHECK(st != 0 && strstr(vlmoe_last_error(), flip) && !t, "corrupt gz: %d %s", st, vlmoe_last_error());
    free(bytes), free(txt);

    const char *p = tmp_path("bad.txt");
    write_text(p, "");
    expect_fail(vlmoe_tokenizer_load_clip(&t, p), VLMOE_ERR_FORMAT, "empty", p, "empty");
    write_text(p, "#version: 0.2\nt h\nth e</w> x\n");
    expect_fail(vlmoe_tokenizer_load_clip(&t, p), VLMOE_ERR_FORMAT, "three symbols", p, "line 3");
    write_text(p, "#version: 0.2\nt h\n\nth e</w>\n");
    expect_fail(vlmoe_tokenizer_load_clip(&t, p), VLMOE_ERR_FORMAT, "blank line inside", p, "line 3");
    write_text(p, "#version: 0.2\nt h\nq zz\n");
    expect_fail(vlmoe_tokenizer_load_clip(&t, p), VLMOE_ERR_FORMAT, "unknown symbol", p, "'zz'");
    write_text(p, "#version: 0.2\nt h\r\nth e</w>\r\n\r\n\n"); // CRLF and trailing blank lines are fine
    st = vlmoe_tokenizer_load_clip(&t, p);
    CHECK(st == 0 && vlmoe_tokenizer_num_merges(t) == 2, "CRLF file: %s", vlmoe_last_error());
    vlmoe_tokenizer_free(t), t = NULL;
    write_text(p, "#version: 0.2"); // header only: bytes + specials
    st = vlmoe_tokenizer_load_clip(&t, p);
    CHECK(st == 0 && vlmoe_tokenizer_vocab_size(t) == 514, "header only: %s", vlmoe_last_error());
    if (t) {
        int32_t ids[8];
        CHECK(vlmoe_tokenizer_save_clip(t, "/nonexistent_dir/x.txt") == VLMOE_ERR_IO &&
              strstr(vlmoe_last_error(), "/nonexistent_dir/x.txt"), "save to a missing folder: %s", vlmoe_last_error());
        expect_fail(vlmoe_tokenizer_encode(t, "x", ids, 1, NULL), VLMOE_ERR_ARG, "ctx 1", "context length", NULL);
        expect_fail(vlmoe_tokenizer_encode(t, NULL, ids, 8, NULL), VLMOE_ERR_ARG, "NULL text", "NULL", NULL);
        int32_t bad_id = 514;
        char out[8];
        expect_fail(vlmoe_tokenizer_decode(t, &bad_id, 1, out, 8), VLMOE_ERR_ARG, "decode bad id", "ids[0] = 514", NULL);
        int len;
        vlmoe_tokenizer_encode(t, "abcdefghij", ids, 8, &len);
        expect_fail(vlmoe_tokenizer_decode(t, ids, len, out, 4), VLMOE_ERR_ARG, "decode small buffer", "needs", NULL);
        CHECK(!strcmp(out, "abc"), "truncated decode '%s'", out);
        expect_fail(vlmoe_tokenizer_normalize("ABCDEF", out, 3), VLMOE_ERR_ARG, "normalize small buffer", "needs", NULL);
        CHECK(!strcmp(out, "ab"), "truncated normalize '%s'", out);
        vlmoe_tokenizer_free(t), t = NULL;
    }

    // tokenizer.json
    const char *j = tmp_path("bad.json");
    struct {
        const char *json, *must, *what;
    } cases[] = {
        {"{\"model\": {\"type\": \"BPE\", \"merges\": []}}", "model.vocab", "missing model.vocab"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}}", "model.merges", "missing model.merges"},
        {"{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}, \"merges\": []}}", "model.type", "not BPE"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a zz\"]}}",
         "model.merges[0] 'a zz': symbol 'zz'", "unknown merge symbol"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}", "merged symbol 'ab'",
         "merge result not in vocab"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [3]}}", "model.merges[0]", "bad merge"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}}", "id 0", "repeated id"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}, \"merges\": []}}", "model.vocab", "negative id"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 1.5}, \"merges\": []}}", "model.vocab", "fractional id"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}, \"merges\": []}}", "model.vocab", "string id"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}", "byte symbol", "not byte-level"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [], \"end_of_word_suffix\": \"@@\"}}",
         "end_of_word_suffix", "other suffix"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"added_tokens\": [{\"id\": 1}]}",
         "added_tokens", "bad added token"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"added_tokens\": [{\"id\": 1, \"content\": \"a\"}]}",
         "added_tokens", "added token id conflicts"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a", "not valid JSON", "truncated JSON"},
        {"[1, 2]", "not a JSON object", "not an object"},
        {"{}", "'model'", "no model"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        write_text(j, cases[i].json);
        t = (vlmoe_tokenizer *)1;
        expect_fail(vlmoe_tokenizer_load_hf(&t, j), VLMOE_ERR_FORMAT, cases[i].what, j, cases[i].must);
        CHECK(!t, "%s: *out NULL", cases[i].what);
    }
    // A CLIP-layout vocabulary without SOT: every byte symbol present, no "<|startoftext|>".
    vlmoe_tokenizer *a = load_a("a_nosot.txt", 0);
    if (a) {
        char *js = hf_json(a, MERGES_A, N_MERGES_A, 1, 0, 0);
        char *q = strstr(js, "\"<|startoftext|>\"");
        while (q) { // rename every occurrence
            memcpy(q + 1, "<|startoftexx|>", 15);
            q = strstr(q + 1, "\"<|startoftext|>\"");
        }
        write_text(j, js);
        free(js);
        expect_fail(vlmoe_tokenizer_load_hf(&t, j), VLMOE_ERR_FORMAT, "no SOT", j, "<|startoftext|>");
        vlmoe_tokenizer_free(a);
    }
    expect_fail(vlmoe_tokenizer_load_clip(NULL, p), VLMOE_ERR_ARG, "NULL out", "NULL", NULL);
    vlmoe_tokenizer_free(NULL);
}

// ---------------------------------------------------------------------------------------------
// Parity with the Python reference (fixture from tests/ref/gen_tokenizer.py).

static int json_strings(const cJSON *arr, const char ***out) {
    int n = cJSON_GetArraySize(arr);
    *out = calloc((size_t)n + 1, sizeof(char *));
    for (int i = 0; i < n; i++) (*out)[i] = cJSON_GetArrayItem(arr, i)->valuestring;
    return n;
}

static void test_fixture(void) {
    char path[512];
    snprintf(path, sizeof(path), "%s/tokenizer_bpe.json", fixture_dir());
    char *js = read_all(path, NULL);
    if (!js) {
        printf("test_tokenizer: %s not found: skipping the Python parity checks (tests/ref/gen_all.py makes it)\n", path);
        return;
    }
    cJSON *root = cJSON_Parse(js);
    free(js);
    CHECK(root != NULL, "%s: bad JSON", path);
    if (!root) return;
    const char **ma, **md, **corpus, **tm;
    int nma = json_strings(cJSON_GetObjectItem(root, "merges_a"), &ma), nmd = json_strings(cJSON_GetObjectItem(root, "merges_dup"), &md);
    const cJSON *train = cJSON_GetObjectItem(root, "train");
    int nc = json_strings(cJSON_GetObjectItem(train, "corpus"), &corpus), ntm = json_strings(cJSON_GetObjectItem(train, "merges"), &tm);
    int same = nma == N_MERGES_A;
    for (int i = 0; same && i < nma; i++) same = !strcmp(ma[i], MERGES_A[i]);
    CHECK(same, "MERGES_A differs from the fixture's merges_a (tests/ref/gen_tokenizer.py): keep them identical");

    vlmoe_tokenizer *tok[3] = {NULL, NULL, NULL}; // a, dup, trained
    const char *names[3] = {"a", "dup", "trained"};
    char *txt = merges_text(MERGES_A, N_MERGES_A);
    write_text(tmp_path("fx_a.txt"), txt);
    free(txt);
    txt = merges_text(md, nmd);
    write_text(tmp_path("fx_dup.txt"), txt);
    free(txt);
    CHECK(vlmoe_tokenizer_load_clip(&tok[0], tmp_path("fx_a.txt")) == 0, "%s", vlmoe_last_error());
    CHECK(vlmoe_tokenizer_load_clip(&tok[1], tmp_path("fx_dup.txt")) == 0, "%s", vlmoe_last_error());
    CHECK(tok[1] && vlmoe_tokenizer_force_literal_bpe(tok[1], 0) == 0, "merges_dup is not well formed: CLIP's loop");
    int vs = cJSON_GetObjectItem(train, "vocab_size")->valueint;
    CHECK(vlmoe_tokenizer_train(&tok[2], corpus, (size_t)nc, vs) == 0, "%s", vlmoe_last_error());
    if (tok[2]) { // the trained merges, saved, are the reference's lines
        const char *saved = tmp_path("fx_trained.txt");
        vlmoe_tokenizer_save_clip(tok[2], saved);
        txt = merges_text(tm, ntm);
        char *f = read_all(saved, NULL);
        size_t k = 0, line = 1;
        for (; f && f[k] && f[k] == txt[k]; k++) line += f[k] == '\n';
        CHECK(f && !f[k] && !txt[k], "trained merges differ from the reference's at line %zu (%d vs %d merges)", line,
              vlmoe_tokenizer_num_merges(tok[2]), ntm);
        free(f), free(txt);
    }

    const cJSON *c;
    int ncase = 0, bad = 0, badnorm = 0, badlit = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(root, "cases")) {
        const char *tn = cJSON_GetObjectItem(c, "tok")->valuestring, *text = cJSON_GetObjectItem(c, "text")->valuestring;
        int w = !strcmp(tn, names[0]) ? 0 : !strcmp(tn, names[1]) ? 1 : 2, ctx = cJSON_GetObjectItem(c, "ctx")->valueint;
        int elen = cJSON_GetObjectItem(c, "len")->valueint;
        const cJSON *eids = cJSON_GetObjectItem(c, "ids");
        if (!tok[w]) continue;
        int32_t *ids = calloc((size_t)ctx, sizeof(int32_t)), *lit = calloc((size_t)ctx, sizeof(int32_t));
        int len = -1, llen = -1, st = vlmoe_tokenizer_encode(tok[w], text, ids, ctx, &len);
        int ok = st == 0 && len == elen && cJSON_GetArraySize(eids) == ctx, at = -1;
        for (int i = 0; ok && i < ctx; i++)
            if (ids[i] != cJSON_GetArrayItem(eids, i)->valueint) ok = 0, at = i;
        if (!ok && bad++ < 5)
            fprintf(stderr, "  %s ctx %d '%.60s': len %d vs %d, first difference at %d: %d vs %d %s\n", tn, ctx, text, len,
                    elen, at, at >= 0 ? ids[at] : 0, at >= 0 ? cJSON_GetArrayItem(eids, at)->valueint : 0, st ? vlmoe_last_error() : "");
        vlmoe_tokenizer_force_literal_bpe(tok[w], 1);
        vlmoe_tokenizer_encode(tok[w], text, lit, ctx, &llen);
        vlmoe_tokenizer_force_literal_bpe(tok[w], 0);
        badlit += llen != len || !same_ids(lit, ids, ctx);
        const char *en = cJSON_GetObjectItem(c, "normalized")->valuestring;
        size_t cap = strlen(en) * 2 + 64;
        char *norm = malloc(cap);
        if (vlmoe_tokenizer_normalize(text, norm, cap) || strcmp(norm, en)) {
            if (badnorm++ < 3) {
                size_t k = 0;
                while (norm[k] && norm[k] == en[k]) k++;
                fprintf(stderr, "  normalize '%.40s': differs at byte %zu: '%.20s' vs '%.20s'\n", text, k, norm + k, en + k);
            }
        }
        free(norm), free(ids), free(lit);
        ncase++;
    }
    CHECK(ncase > 200 && bad == 0, "%d of %d cases differ from the Python reference", bad, ncase);
    CHECK(badnorm == 0, "%d normalised texts differ from the Python reference", badnorm);
    CHECK(badlit == 0, "%d cases differ between heap BPE and CLIP's loop", badlit);
    for (int i = 0; i < 3; i++) vlmoe_tokenizer_free(tok[i]);
    free(ma), free(md), free(corpus), free(tm);
    cJSON_Delete(root);
}

// Lower-casing (step 3, libutf8proc) equals Python's str.lower on every code point: the fixture
// lists each one Python changes (lower_table.json, tests/ref/gen_lower.py); every other assigned
// code point must stay unchanged. Code points Python's Unicode calls unassigned are not compared
// (a newer libutf8proc may case them); their count of differences is printed.
static void test_lower_table(void) {
    char path[512];
    snprintf(path, sizeof(path), "%s/lower_table.json", fixture_dir());
    char *js = read_all(path, NULL);
    if (!js) {
        printf("test_tokenizer: %s not found: skipping the str.lower table (tests/ref/gen_all.py makes it)\n", path);
        return;
    }
    cJSON *root = cJSON_Parse(js);
    const cJSON *lower = cJSON_GetObjectItem(root, "lower"), *un = cJSON_GetObjectItem(root, "unassigned"), *e;
    uint8_t *skip = calloc(0x110000, 1);
    cJSON_ArrayForEach(e, un)
        for (int c = cJSON_GetArrayItem(e, 0)->valueint; c <= cJSON_GetArrayItem(e, 1)->valueint; c++) skip[c] = 1;
    uint32_t (*want)[3] = calloc(0x110000, sizeof(*want)); // [n, cp, cp]
    int listed = 0;
    cJSON_ArrayForEach(e, lower) {
        const int c = atoi(e->string), n = cJSON_GetArraySize(e);
        CHECK(c >= 0 && c < 0x110000 && n >= 1 && n <= 2, "lower_table.json: entry %s", e->string);
        if (c < 0 || c >= 0x110000 || n < 1 || n > 2) continue;
        want[c][0] = (uint32_t)n;
        for (int k = 0; k < n; k++) want[c][1 + k] = (uint32_t)cJSON_GetArrayItem(e, k)->valueint;
        listed++;
    }
    int bad = 0, compared = 0, newer = 0;
    for (uint32_t c = 0; c < 0x110000; c++) {
        if (c >= 0xD800 && c <= 0xDFFF) continue;
        uint32_t got[2];
        const size_t n = vlmoe_tokenizer_lower_cp(c, got);
        const int same = want[c][0] ? n == want[c][0] && got[0] == want[c][1] && (n == 1 || got[1] == want[c][2])
                                    : n == 1 && got[0] == c;
        if (skip[c]) {
            newer += !same;
            continue;
        }
        compared++;
        if (!same && bad++ < 8)
            fprintf(stderr, "  lower U+%04X: got %zu code point(s) U+%04X..., Python %u: U+%04X\n", c, n, got[0],
                    want[c][0] ? want[c][0] : 1, want[c][0] ? want[c][1] : c);
    }
    CHECK(listed > 1400 && compared > 250000, "lower_table.json: %d entries, %d code points compared", listed, compared);
    CHECK(bad == 0, "%d code points lower-case differently from Python's str.lower", bad);
    printf("test_tokenizer: str.lower table (Unicode %s): %d changed code points, %d compared, %d differ; %d code "
           "points Python leaves unassigned differ\n", cJSON_GetObjectItem(root, "unicode")->valuestring, listed, compared,
           bad, newer);
    free(skip), free(want), free(js);
    cJSON_Delete(root);
}

// tokenizer.json's normalizer and pre_tokenizer as HF writes CLIP's (transformers' CLIPTokenizerFast):
// NFC is applied (a decomposed "cafe\u0301" encodes as "café", which the merges file of the same
// vocabulary, without NFC, does not), to_text keeps it (as tokenizer.json), and each field that
// would change ids is refused, naming it.
static const char CLIP_NORM[] = "{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},{\"type\":\"Replace\","
                                "\"pattern\":{\"Regex\":\"\\\\s+\"},\"content\":\" \"},{\"type\":\"Lowercase\"}]}";
static const char CLIP_PRE[] = "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
                               "\"<\\\\|startoftext\\\\|>|<\\\\|endoftext\\\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\\\p{L}]+|"
                               "[\\\\p{N}]|[^\\\\s\\\\p{L}\\\\p{N}]+\"},\"behavior\":\"Removed\",\"invert\":true},"
                               "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}";

// hf_json(a) with normalizer / pre_tokenizer / model.dropout set from JSON text (NULL: left out).
static vlmoe_tokenizer *hf_with(const vlmoe_tokenizer *a, const char *norm, const char *pre, const char *dropout,
                                int *st) {
    char *js = hf_json(a, MERGES_A, N_MERGES_A, 1, 0, 0);
    cJSON *root = cJSON_Parse(js);
    free(js);
    if (norm) cJSON_AddItemToObject(root, "normalizer", cJSON_Parse(norm));
    if (pre) cJSON_AddItemToObject(root, "pre_tokenizer", cJSON_Parse(pre));
    if (dropout) cJSON_AddItemToObject(cJSON_GetObjectItem(root, "model"), "dropout", cJSON_Parse(dropout));
    js = cJSON_Print(root);
    cJSON_Delete(root);
    const char *path = tmp_path("pipeline.json");
    write_text(path, js);
    free(js);
    vlmoe_tokenizer *t = NULL;
    *st = vlmoe_tokenizer_load_hf(&t, path);
    return t;
}

static void test_hf_pipeline(void) {
    vlmoe_tokenizer *a = load_a("a_pipe.txt", 0);
    if (!a) return;
    int st;
    vlmoe_tokenizer *t = hf_with(a, CLIP_NORM, CLIP_PRE, "null", &st);
    CHECK(st == VLMOE_OK && t, "CLIP's tokenizer.json fields: %s", vlmoe_last_error());
    int32_t x[16], y[16], z[16];
    int lx, ly, lz;
    const char *composed = "caf\xc3\xa9 na\xc3\xafve", *decomposed = "cafe\xcc\x81 nai\xcc\x88ve";
    if (t) {
        vlmoe_tokenizer_encode(t, composed, x, 16, &lx);
        vlmoe_tokenizer_encode(t, decomposed, y, 16, &ly);
        CHECK(lx == ly && same_ids(x, y, 16), "NFC: decomposed text gives other ids (%d vs %d tokens)", ly, lx);
        vlmoe_tokenizer_encode(a, decomposed, z, 16, &lz);
        CHECK(!(lz == lx && same_ids(x, z, 16)), "without NFC the decomposed text should differ (else this test is void)");
        char *text = NULL;
        size_t n = 0;
        vlmoe_tokenizer *r = NULL;
        CHECK(vlmoe_tokenizer_to_text(t, &text, &n) == VLMOE_OK && text && text[0] == '{' && strstr(text, "\"NFC\""),
              "to_text of an NFC tokenizer: tokenizer.json with NFC");
        CHECK(text && vlmoe_tokenizer_from_text(&r, text, n, "nfc") == VLMOE_OK, "%s", vlmoe_last_error());
        if (r) {
            vlmoe_tokenizer_encode(r, decomposed, z, 16, &lz);
            CHECK(lz == lx && same_ids(x, z, 16), "the text form lost NFC");
        }
        vlmoe_tokenizer_free(r), free(text);
    }
    vlmoe_tokenizer_free(t);
    // without NFC in the normalizer: as the merges file
    t = hf_with(a, "{\"type\":\"Lowercase\"}", "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}", NULL, &st);
    CHECK(st == VLMOE_OK && t, "Lowercase alone: %s", vlmoe_last_error());
    if (t) {
        vlmoe_tokenizer_encode(t, decomposed, y, 16, &ly);
        vlmoe_tokenizer_encode(a, decomposed, z, 16, &lz);
        CHECK(ly == lz && same_ids(y, z, 16), "no NFC step: ids as the merges file's");
    }
    vlmoe_tokenizer_free(t);
    static const struct {
        const char *norm, *pre, *dropout, *must1, *must2;
    } bad[] = {
        {"{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFKC\"},{\"type\":\"Lowercase\"}]}", NULL, NULL,
         "normalizer.normalizers[0]: type \"NFKC\"", "ids would differ"},
        {"{\"type\":\"NFC\"}", NULL, NULL, "normalizer: no Lowercase step", NULL},
        {"{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Lowercase\"},{\"type\":\"StripAccents\"}]}", NULL, NULL,
         "normalizer.normalizers[1]: type \"StripAccents\"", NULL},
        {"{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"a\"},\"content\":\"b\"},"
         "{\"type\":\"Lowercase\"}]}", NULL, NULL, "type \"Replace\" with this pattern", NULL},
        {NULL, "{\"type\":\"Whitespace\"}", NULL, "pre_tokenizer: type \"Whitespace\"", NULL},
        {NULL, "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\w+\"},"
               "\"behavior\":\"Removed\",\"invert\":true}]}", NULL, "pre_tokenizer.pretokenizers[0]: type \"Split\"",
         "not CLIP's"},
        {NULL, "{\"type\":\"ByteLevel\",\"add_prefix_space\":true}", NULL, "add_prefix_space is true", NULL},
        {NULL, "{\"type\":\"ByteLevel\",\"use_regex\":true}", NULL, "use_regex is not false", NULL},
        {NULL, "{\"type\":\"ByteLevel\"}", NULL, "use_regex is not false", NULL}, // HF's default is true
        {NULL, NULL, "0.1", "model.dropout", NULL},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        t = hf_with(a, bad[i].norm, bad[i].pre, bad[i].dropout, &st);
        expect_fail(st, VLMOE_ERR_FORMAT, bad[i].must1, bad[i].must1, bad[i].must2);
        CHECK(strstr(vlmoe_last_error(), "pipeline.json"), "the message names the file: %s", vlmoe_last_error());
        vlmoe_tokenizer_free(t);
    }
    vlmoe_tokenizer_free(a);
}

int main(void) {
    snprintf(dir, sizeof(dir), "%s/vlmoe_tok_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 2;
    }
    test_clip_file();
    test_clip_count();
    test_hf();
    test_hf_pipeline();
    test_train();
    test_bytes();
    test_threads();
    test_bad_input();
    test_fixture();
    test_lower_table();
    for (int i = 0; i < nmade; i++) {
        remove(made[i]);
        char tmp[600];
        snprintf(tmp, sizeof(tmp), "%s.tmp", made[i]);
        remove(tmp);
        free(made[i]);
    }
    rmdir(dir);
    return test_summary("test_tokenizer");
}
