// fuzz_tokenizer.c: libFuzzer target for CLIP's BPE tokenizer (src/tok/bpe.c): arbitrary bytes
// (any UTF-8, broken or not, HTML entities, special tokens) through normalize, encode at two
// context lengths and decode, with a small vocabulary trained at start-up.
#include "fuzz.h"
#include "tok/tok.h"

static vlmoe_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    static const char *const texts[] = {
        "a photo of a cat", "two dogs playing in the snow", "A RED Circle on a striped background",
        "l'été à Paris, café & crème brûlée", "Ελληνικά και русский текст", "numbers 12345 and 3.14",
        "emoji \xf0\x9f\x98\x80 and <|endoftext|>", "&amp; &lt;tag&gt; &#x263a; &eacute;",
    };
    (void)argc, (void)argv;
    if (vlmoe_tokenizer_train(&tok, texts, sizeof(texts) / sizeof(texts[0]), 700)) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", vlmoe_last_error());
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1), norm[256], back[1024];
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = 0;
    int32_t ids[77];
    int len;
    vlmoe_tokenizer_normalize(text, norm, sizeof(norm));
    if (vlmoe_tokenizer_encode(tok, text, ids, 77, &len) == VLMOE_OK) {
        if (len < 2 || len > 77 || ids[0] != vlmoe_tokenizer_sot(tok) || ids[len - 1] != vlmoe_tokenizer_eot(tok))
            abort();
        for (int i = 0; i < len; i++)
            if (ids[i] < 0 || ids[i] >= vlmoe_tokenizer_vocab_size(tok) || !vlmoe_tokenizer_piece(tok, ids[i])) abort();
        vlmoe_tokenizer_decode(tok, ids, len, back, sizeof(back));
    }
    vlmoe_tokenizer_encode(tok, text, ids, 3, NULL);
    free(text);
    return 0;
}
