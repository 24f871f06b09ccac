// test_tokenizer_spm.c: SentencePiece tokenizers (src/tok/sentencepiece.c over the libsentencepiece
// shim src/tok/spm.cc): small unigram and BPE models trained here with spm_train (Debian's
// sentencepiece; no model hub is reachable) on a corpus in several scripts; ids equal
// libsentencepiece's own encoder (spm_encode) line by line, BOS/EOS/padding/truncation follow
// tok.h, the base64 text form round-trips through a model file, and bad text forms are refused.
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nn/model.h"
#include "test.h"
#include "tok/spm.h"
#include "tok/tok.h"
#include "vlmoe.h"

static char dir[256];
static const char *P(const char *rel) { return test_path(dir, rel); }

// Several scripts, with repeated words so the models learn pieces longer than characters.
static const char *const LINES[] = {
    "a photo of a cat on the mat", "the quick brown fox jumps over the lazy dog", "Hello World, hello world!",
    "фотография кошки на ковре", "быстрая коричневая лиса прыгает", "Москва и Санкт-Петербург",
    "μια φωτογραφία μιας γάτας", "η γρήγορη καφέ αλεπού", "Αθήνα και Θεσσαλονίκη",
    "Հայաստանի մայրաքաղաքը Երևանն է", "կատու գորգի վրա", "նկար կատվի",
    "猫の写真です", "一只猫在垫子上", "北京和上海是大城市", "고양이 사진",
    "صورة قطة على السجادة", "الثعلب البني السريع", "القاهرة والإسكندرية",
    "emoji 😀👍🏽 and ❤️ 😀😀 🐱🐈", "café naïve résumé CAFÉ ＡＢＣ ﬁ", "3.14159 1,000,000 ½ ² ٣",
};
enum { NL = sizeof(LINES) / sizeof(LINES[0]) };
// encoded but not trained on: unseen characters become <unk>, mixed scripts in one line
static const char *const UNSEEN[] = {"ქართული ენა", "a 猫 and a кошка and a γάτα 😀 صورة", "   spaced    out   ", "", "Ω K Å"};
enum { NU = sizeof(UNSEEN) / sizeof(UNSEEN[0]) };

static int sh(const char *cmd) {
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char *read_all(const char *path) { return test_read_file(path, NULL); }

// ids spm_encode gives each line of input.txt, one int list per line.
static int spm_ids(const char *model, int32_t ids[][256], int *n, int nlines) {
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "spm_encode --model=%s --output_format=id < %s > %s 2>/dev/null", P(model), P("input.txt"),
             P("ids.txt"));
    if (sh(cmd)) return -1;
    char *t = read_all(P("ids.txt")), *s = t;
    for (int l = 0; t && l < nlines; l++) {
        n[l] = 0;
        while (*s && *s != '\n') {
            long v = strtol(s, &s, 10);
            if (n[l] < 256) ids[l][n[l]++] = (int32_t)v;
            while (*s == ' ') s++;
        }
        if (*s == '\n') s++;
    }
    free(t);
    return t ? 0 : -1;
}

static void check_model(const char *model) {
    vlmoe_tokenizer *t = NULL;
    CHECK(vlmoe_tokenizer_load_sentencepiece(&t, P(model)) == VLMOE_OK, "%s: %s", model, vlmoe_last_error());
    if (!t) return;
    CHECK(vlmoe_tokenizer_is_sentencepiece(t) && vlmoe_tokenizer_sot(t) == 1 && vlmoe_tokenizer_eot(t) == 2 &&
              vlmoe_tokenizer_num_merges(t) == 0, "%s: spm_train's defaults are unk 0, bos 1, eos 2", model);
    // every line, trained on or not, through both encoders
    const int nl = NL + NU;
    FILE *f = fopen(P("input.txt"), "w");
    for (int l = 0; f && l < nl; l++) fprintf(f, "%s\n", l < NL ? LINES[l] : UNSEEN[l - NL]);
    if (f) fclose(f);
    static int32_t want[NL + NU][256];
    int nw[NL + NU], bad = 0, total = 0, unk = 0;
    CHECK(spm_ids(model, want, nw, nl) == 0, "spm_encode failed on %s", model);
    for (int l = 0; l < nl; l++) {
        const char *text = l < NL ? LINES[l] : UNSEEN[l - NL];
        int32_t ids[300];
        int len = 0;
        CHECK(vlmoe_tokenizer_encode(t, text, ids, 300, &len) == VLMOE_OK, "%s", vlmoe_last_error());
        int same = len == nw[l] + 2 && ids[0] == 1 && ids[len - 1] == 2;
        for (int i = 0; same && i < nw[l]; i++) same = ids[1 + i] == want[l][i];
        for (int i = len; same && i < 300; i++) same = ids[i] == 0; // pad_id -1 in the model: 0
        for (int i = 0; i < nw[l]; i++) unk += want[l][i] == 0;
        if (!same && bad++ < 4) fprintf(stderr, "  %s line %d '%s': %d ids vs spm_encode's %d + BOS/EOS\n", model, l, text,
                                        len, nw[l]);
        total += nw[l];
    }
    CHECK(bad == 0 && total > 150, "%s: %d of %d lines differ from spm_encode (%d ids)", model, bad, nl, total);
    CHECK(unk > 0, "%s: the unseen Georgian line should hold <unk> ids (0)", model);
    printf("test_tokenizer_spm: %s: %d lines, %d ids, %d <unk>, all equal to spm_encode's\n", model, nl, total, unk);

    // truncation keeps EOS last; decode gives the text back (Latin: no normalisation at work)
    int32_t ids[6];
    int len;
    CHECK(vlmoe_tokenizer_encode(t, LINES[1], ids, 6, &len) == VLMOE_OK && len == 6 && ids[0] == 1 && ids[5] == 2 &&
              ids[1] == want[1][0] && ids[4] == want[1][3], "truncation to 6: [BOS] 4 pieces [EOS]");
    int32_t full[64];
    char back[256];
    CHECK(vlmoe_tokenizer_encode(t, LINES[1], full, 64, &len) == VLMOE_OK &&
              vlmoe_tokenizer_decode(t, full, len, back, sizeof(back)) == VLMOE_OK && !strcmp(back, LINES[1]),
          "decode: '%s'", back);
    CHECK(vlmoe_tokenizer_decode(t, full, len, back, 4) == VLMOE_ERR_ARG, "decode into 4 bytes must fail");
    const int32_t oob = vlmoe_tokenizer_vocab_size(t);
    CHECK(vlmoe_tokenizer_decode(t, &oob, 1, back, sizeof(back)) == VLMOE_ERR_ARG && strstr(vlmoe_last_error(), "not in the vocabulary"),
          "decode of id %d: %s", (int)oob, vlmoe_last_error());
    CHECK(vlmoe_tokenizer_piece(t, 1) && !strcmp(vlmoe_tokenizer_piece(t, 1), "<s>"), "piece 1 is <s>");

    // the text form: from_text gives the same ids; a model file carries it as "sentencepiece"
    char *text = NULL;
    size_t tl = 0;
    vlmoe_tokenizer *r = NULL;
    CHECK(vlmoe_tokenizer_to_text(t, &text, &tl) == VLMOE_OK && spm_text_is(text, tl), "to_text");
    CHECK(text && vlmoe_tokenizer_from_text(&r, text, tl, "text") == VLMOE_OK, "from_text: %s", vlmoe_last_error());
    int32_t a[64], b[64];
    int la = 0, lb = -1;
    if (r) {
        vlmoe_tokenizer_encode(t, UNSEEN[1], a, 64, &la);
        vlmoe_tokenizer_encode(r, UNSEEN[1], b, 64, &lb);
        CHECK(la == lb && !memcmp(a, b, sizeof(a)), "from_text: other ids");
    }
    vlmoe_model_config cfg;
    vlmoe_model *m = NULL, *m2 = NULL;
    CHECK(vlmoe_config_named("tiny", &cfg) == VLMOE_OK, "%s", vlmoe_last_error());
    if (cfg.vocab_size < vlmoe_tokenizer_vocab_size(t)) cfg.vocab_size = vlmoe_tokenizer_vocab_size(t);
    CHECK(vlmoe_model_init(&m, &cfg, 1) == VLMOE_OK && model_set_tokenizer(m, t) == VLMOE_OK &&
              vlmoe_model_save(m, P("m.safetensors")) == VLMOE_OK, "model with a SentencePiece tokenizer: %s", vlmoe_last_error());
    vlmoe_st *st = NULL;
    CHECK(vlmoe_st_open(P("m.safetensors"), &st) == VLMOE_OK && vlmoe_st_metadata(st, "vlmoe.tokenizer") &&
              !strcmp(vlmoe_st_metadata(st, "vlmoe.tokenizer"), "sentencepiece"), "metadata vlmoe.tokenizer");
    vlmoe_st_close(st);
    vlmoe_tokenizer *mt = NULL;
    CHECK(vlmoe_model_load(&m2, P("m.safetensors")) == VLMOE_OK && model_tokenizer(m2, "m", &mt) == VLMOE_OK && mt,
          "reload: %s", vlmoe_last_error());
    if (mt) {
        vlmoe_tokenizer_encode(mt, UNSEEN[1], b, 64, &lb);
        CHECK(la == lb && !memcmp(a, b, sizeof(a)), "the model file's tokenizer gives other ids");
    }
    vlmoe_tokenizer_free(mt), vlmoe_model_free(m), vlmoe_model_free(m2);
    vlmoe_tokenizer_free(r), vlmoe_tokenizer_free(t);

    // bad text forms: a character outside base64, a cut, valid base64 of something else
    if (text && tl > 200) {
        char *cut = malloc(tl + 1);
        memcpy(cut, text, tl + 1);
        cut[100] = '*';
        CHECK(vlmoe_tokenizer_from_text(&r, cut, tl, "meta") == VLMOE_ERR_FORMAT &&
                  strstr(vlmoe_last_error(), "meta: base64 character"), "cut base64: %s", vlmoe_last_error());
        memcpy(cut, text, tl + 1);
        CHECK(vlmoe_tokenizer_from_text(&r, cut, tl - 3, "meta") == VLMOE_ERR_FORMAT &&
                  strstr(vlmoe_last_error(), "not a multiple of 4"), "cut base64: %s", vlmoe_last_error());
        const char junk[] = SPM_TEXT_MAGIC "aGVsbG8gd29ybGQh\n";
        CHECK(vlmoe_tokenizer_from_text(&r, junk, strlen(junk), "meta") == VLMOE_ERR_FORMAT &&
                  strstr(vlmoe_last_error(), "not a SentencePiece model"), "junk model: %s", vlmoe_last_error());
        free(cut);
    }
    free(text);
}

int main(void) {
    snprintf(dir, sizeof(dir), "%s/vlmoe_spm_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(dir)) return perror("mkdtemp"), 2;
    vlmoe_tokenizer *t = NULL;
    test_write_file(P("not.model"), "#version: 0.2\na b\n", 17);
    CHECK(vlmoe_tokenizer_load_sentencepiece(&t, P("not.model")) == VLMOE_ERR_FORMAT &&
              strstr(vlmoe_last_error(), P("not.model")), "a text file as .model: %s", vlmoe_last_error());
    if (!vlmoe_spm_available()) {
        CHECK(strstr(vlmoe_last_error(), "libsentencepiece-dev"), "the stub says how to enable it: %s", vlmoe_last_error());
        printf("test_tokenizer_spm: built without libsentencepiece-dev: skipping the SentencePiece checks\n");
    } else if (sh("command -v spm_train >/dev/null 2>&1 && command -v spm_encode >/dev/null 2>&1")) {
        printf("test_tokenizer_spm: spm_train / spm_encode not found (Debian package sentencepiece): skipping\n");
    } else {
        FILE *f = fopen(P("corpus.txt"), "w");
        for (int r = 0; f && r < 20; r++)
            for (int l = 0; l < NL; l++) fprintf(f, "%s\n", LINES[(l + r) % NL]);
        if (f) fclose(f);
        const char *types[2] = {"unigram", "bpe"};
        for (int k = 0; k < 2; k++) {
            char cmd[1024], name[32];
            snprintf(cmd, sizeof(cmd), "cd %s && spm_train --input=corpus.txt --model_prefix=%s --vocab_size=260 "
                     "--model_type=%s --character_coverage=1.0 --hard_vocab_limit=false --num_threads=1 >train_%s.log 2>&1",
                     dir, types[k], types[k], types[k]);
            CHECK(sh(cmd) == 0, "spm_train --model_type=%s failed (see %s/train_%s.log)", types[k], dir, types[k]);
            snprintf(name, sizeof(name), "%s.model", types[k]);
            check_model(name);
        }
    }
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (!t_fail) sh(cmd);
    return test_summary("test_tokenizer_spm");
}
