// spm.h: the C side of the SentencePiece shim (src/tok/spm.cc, C++ over Debian's libsentencepiece;
// src/tok/spm_stub.c when the build has no libsentencepiece-dev). tok.h's vlmoe_tokenizer wraps
// it, so callers see one tokenizer interface. Errors are written into err (cap bytes) and are
// prefixed by the caller with the file they concern. Tested by tests/test_tokenizer_spm.c.
#ifndef VLMOE_TOK_SPM_H
#define VLMOE_TOK_SPM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct vlmoe_spm vlmoe_spm;

// 1 when libsentencepiece was linked in, 0 for the stub.
int vlmoe_spm_available(void);
// A serialized ModelProto (the bytes of a .model file) -> processor. 0, or -1 with err set.
int vlmoe_spm_load(vlmoe_spm **out, const void *bytes, size_t n, char *err, size_t cap);
void vlmoe_spm_free(vlmoe_spm *s);
// SentencePiece's own Encode(text) ids (no BOS / EOS added), malloc'd into *ids (free).
int vlmoe_spm_encode(const vlmoe_spm *s, const char *text, int32_t **ids, size_t *n, char *err, size_t cap);
// Decode(ids) as malloc'd UTF-8 (free).
int vlmoe_spm_decode(const vlmoe_spm *s, const int32_t *ids, int n, char **out, char *err, size_t cap);
int vlmoe_spm_size(const vlmoe_spm *s);
const char *vlmoe_spm_piece(const vlmoe_spm *s, int id); // NULL outside [0, size)
// special ids, -1 where the model has none
int vlmoe_spm_bos(const vlmoe_spm *s);
int vlmoe_spm_eos(const vlmoe_spm *s);
int vlmoe_spm_pad(const vlmoe_spm *s);

// ---- the C glue bpe.c calls (src/tok/sentencepiece.c): errors through vlmoe_fail, naming `what`.
// A model file carries a SentencePiece tokenizer as text: SPM_TEXT_MAGIC, then the serialized
// model in base64 (RFC 4648, no line breaks), then '\n'.
#define SPM_TEXT_MAGIC_LINE "#vlmoe sentencepiece base64"
#define SPM_TEXT_MAGIC SPM_TEXT_MAGIC_LINE "\n"
int spm_text_is(const char *text, size_t len);
// The model's bytes -> processor and its text form (*text malloc'd, NUL-terminated).
int spm_from_bytes(vlmoe_spm **sp, char **text, size_t *tlen, const void *bytes, size_t n, const char *what);
// The text form (validated: magic, base64 alphabet and padding, a model libsentencepiece loads).
int spm_from_text(vlmoe_spm **sp, const char *text, size_t len, const char *what);
// tok.h's encode contract: [BOS if the model has one] pieces [EOS if it has one], then pad (the
// model's pad id, else 0) up to ctx; too long keeps the first pieces and EOS last.
int spm_tok_encode(const vlmoe_spm *sp, const char *text, int32_t *ids, int ctx, int *len);
// Decode(ids), BOS/EOS/pad skipped (SentencePiece skips control ids itself), into out (cap).
int spm_tok_decode(const vlmoe_spm *sp, const int32_t *ids, int n, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
