// tok.h: the byte-level BPE tokenizer of CLIP (OpenAI simple_tokenizer.py's algorithm), loading
// CLIP merges files or HF tokenizer.json, and training its own merges from captions.
// Spec: ../shared/spec/MODEL.md (Tokenizer). Implemented in src/tok/bpe.c; tests/test_tokenizer.c.
#ifndef VLMOE_TOK_H
#define VLMOE_TOK_H

#include <stddef.h>
#include <stdint.h>

#include "vlmoe.h"

// ---- public-to-be part (to move into include/vlmoe.h) ---------------------------------------
//
// Text -> ids follows CLIP's SimpleTokenizer.encode exactly, except for the steps noted:
//  1. html.unescape twice: numeric references (&#NNN; &#xHH;, with or without ';', Python's rules
//     for 0, 0x80-0x9F, surrogates, > 0x10FFFF and non-characters) and the named references of
//     HTML 4 plus &apos; (259 names; the 106 that HTML5 allows without ';' also work without it,
//     with Python's longest-prefix rule: "&amplifier" -> "&lifier"). Other HTML5 names stay as
//     they are (Python would replace e.g. &notin;). ftfy.fix_text is not applied (out of scope:
//     no mojibake repair, no NFC, quotes and full-width forms are kept as they are).
//  2. Runs of Unicode White_Space collapse to one space; ends are stripped (str.isspace set).
//  3. Lower-casing as Python's str.lower() code point by code point, through libutf8proc's
//     simple mapping (every script: Armenian, Cherokee, Georgian, Deseret ... as Python 3.11 /
//     Unicode 14; tests/ref/gen_lower.py checks all 0x110000 code points). str.lower's only
//     one-to-many mapping is kept as Python has it: U+0130 -> "i" U+0307. Final sigma follows
//     CPython's rule (U+03A3 after a cased letter and before none -> U+03C2), with Cased and
//     Case_Ignorable derived from utf8proc's categories and case mappings.
//     A tokenizer.json whose normalizer says NFC gets NFC (utf8proc) before step 1.
//  4. Pre-tokenization with CLIP's pattern (PCRE2, UTF + UCP + caseless, like regex.IGNORECASE):
//     <\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+
//     with \s written ' ' (all other White_Space is gone after step 2; PCRE2's \s would also
//     take U+180E, which Python's regex treats as a symbol) and U+0345 left out of the last class
//     (regex, case-insensitive, matches it with no alternative, so CLIP drops it). \p{L}/\p{N}
//     come from PCRE2's Unicode tables (10.42: Unicode 14); code points assigned later differ.
//  5. Each piece -> bytes -> GPT-2 bytes_to_unicode symbols, "</w>" on the last one, BPE merges
//     by rank, vocabulary lookup. A piece equal to "<|startoftext|>" / "<|endoftext|>" is the
//     special token itself, as in CLIP's cache.
// Invalid UTF-8 never fails: each byte that is not part of a well-formed sequence stays that byte
// (it pre-tokenizes as a symbol character, [^\s\p{L}\p{N}], and BPE starts from its byte symbol).
//
// Thread safety: a tokenizer is immutable after load/train; encode, decode and the getters may
// run concurrently on one tokenizer (each encode call allocates its own PCRE2 match data and
// scratch). There is no BPE cache and no global mutable state.
typedef struct vlmoe_tokenizer vlmoe_tokenizer;

// CLIP merges file (bpe_simple_vocab_16e6.txt, plain or gzip, detected by content): line 1 is a
// version header (skipped), then one merge "a b" per line. Like CLIP, merges lines 1..48894 are
// used; a file with fewer merges uses all of them (trailing empty lines ignored), which gives a
// vocabulary of 256 byte symbols + 256 "</w>" symbols + merges + <|startoftext|> <|endoftext|>.
// A line that is not two symbols, or a merge naming a symbol that no merge produces, is
// VLMOE_ERR_FORMAT naming the file and line; an unreadable or truncated file VLMOE_ERR_IO.
int vlmoe_tokenizer_load_clip(vlmoe_tokenizer **out, const char *merges_path);
// HF tokenizer.json of a CLIP tokenizer: model.type "BPE", model.vocab {token: id},
// model.merges ["a b", ...] or [["a", "b"], ...], added_tokens holding <|startoftext|> and
// <|endoftext|> (or model.vocab does). Every merge's symbols and result must be in model.vocab,
// as must the 512 byte symbols; errors name the file and the field. "normalizer" and
// "pre_tokenizer" are read where they decide ids: CLIP's (NFC, Replace \s+ -> " ", Strip,
// Lowercase; Split with CLIP's pattern, ByteLevel without prefix space or regex) are accepted,
// NFC switching NFC on; any other step (NFKC, StripAccents, Metaspace, a normalizer without
// Lowercase, ...) or BPE dropout is VLMOE_ERR_FORMAT naming the field. Absent: CLIP's defaults.
int vlmoe_tokenizer_load_hf(vlmoe_tokenizer **out, const char *tokenizer_json_path);
// Learns merges from texts with the same preprocessing: word frequencies after pre-tokenization,
// then repeatedly the most frequent adjacent pair (count weighted by word frequency; ties: the
// pair whose (left, right) symbol strings are smallest, comparing left first, bytewise) is merged
// everywhere, until 512 + merges + 2 == vocab_size or no pair remains. 514 <= vocab_size <= 49408
// (CLIP's file holds at most 48894 merges). Deterministic; the result is laid out as a CLIP
// merges file would load.
int vlmoe_tokenizer_train(vlmoe_tokenizer **out, const char *const *texts, size_t n, int vocab_size);
// Writes the merges in CLIP's format ("#version: 0.2" + one "a b" per line), atomically (PATH.tmp
// then rename). Fails with VLMOE_ERR_ARG if the ids do not follow the CLIP layout (a tokenizer.json
// numbered otherwise), since reloading would renumber them.
int vlmoe_tokenizer_save_clip(const vlmoe_tokenizer *tok, const char *path);
void vlmoe_tokenizer_free(vlmoe_tokenizer *tok);
// A SentencePiece .model file (SigLIP, T5, LIMoE's 32k vocabulary), read by Debian's
// libsentencepiece (src/tok/spm.cc): its normalizer and segmentation, so ids equal spm_encode's.
// encode gives [BOS if the model has one] pieces [EOS if it has one], padded with the model's pad
// id (0 if none); too long keeps the first pieces and EOS last. sot/eot are BOS/EOS (-1 if none);
// num_merges is 0. to_text gives SPM_TEXT_MAGIC + base64 of the file (what a model file carries).
// A build without libsentencepiece-dev fails with VLMOE_ERR_FORMAT saying how to enable it.
int vlmoe_tokenizer_load_sentencepiece(vlmoe_tokenizer **out, const char *model_path);
int vlmoe_tokenizer_is_sentencepiece(const vlmoe_tokenizer *tok);
// The tokenizer as text that vlmoe_tokenizer_from_text reads back with the same ids (a model file
// carries its tokenizer this way): CLIP's merges file when the ids follow CLIP's layout, else an
// HF tokenizer.json. *out is malloc'd (free) and NUL-terminated; *len excludes the NUL.
int vlmoe_tokenizer_to_text(const vlmoe_tokenizer *tok, char **out, size_t *len);
// Reads a CLIP merges file's text, an HF tokenizer.json's (a JSON object), or a SentencePiece
// tokenizer's text form (src/tok/spm.h: magic line + base64 model), held in memory;
// `what` starts every error message (e.g. "model.safetensors: tokenizer").
int vlmoe_tokenizer_from_text(vlmoe_tokenizer **out, const char *text, size_t len, const char *what);

// ids (ctx): [SOT] tokens... [EOT] then 0 up to ctx. Too long: [SOT] + the first ctx-2 tokens +
// [EOT] (OpenCLIP's truncation). *len (may be NULL) = tokens before the padding. ctx >= 2. Text
// past what fits is cleaned but not BPE-encoded.
int vlmoe_tokenizer_encode(const vlmoe_tokenizer *tok, const char *text, int32_t *ids, int ctx,
                           int *len);
// Inverse: pieces joined ("</w>" ending a piece -> space), byte symbols -> bytes, ends stripped of
// ASCII whitespace. Unlike CLIP's decode, SOT and EOT are skipped and a literal "</w>" inside the
// text is left alone; id 0 is "!" (not padding), so pass only the *len tokens encode reported.
// Bytes come out as they are (invalid UTF-8 in gives the same bytes back). An id outside the
// vocabulary is VLMOE_ERR_ARG; if the text needs more than cap bytes (with the NUL) it is
// truncated and VLMOE_ERR_ARG returned with the size needed in the message.
int vlmoe_tokenizer_decode(const vlmoe_tokenizer *tok, const int32_t *ids, int n, char *out,
                           size_t cap);
// Steps 1-3 above (what encode pre-tokenizes), as UTF-8 (invalid bytes kept). Same cap rule.
int vlmoe_tokenizer_normalize(const char *text, char *out, size_t cap);
const char *vlmoe_tokenizer_piece(const vlmoe_tokenizer *tok, int32_t id); // NULL if no such id
int vlmoe_tokenizer_vocab_size(const vlmoe_tokenizer *tok); // largest id + 1
int vlmoe_tokenizer_num_merges(const vlmoe_tokenizer *tok);
int32_t vlmoe_tokenizer_sot(const vlmoe_tokenizer *tok);
int32_t vlmoe_tokenizer_eot(const vlmoe_tokenizer *tok);

// ---- internal (tests) -------------------------------------------------------------------------
// BPE runs in O(n log n) per word with a heap when the merges are well formed (each symbol made
// by one merge, from symbols made by earlier merges), where it provably equals CLIP's loop
// (repeatedly merge every occurrence of the lowest-ranked pair); otherwise CLIP's loop itself.
// literal = 1 forces CLIP's loop (to test that both agree); returns whether the heap is usable.
int vlmoe_tokenizer_force_literal_bpe(vlmoe_tokenizer *tok, int literal);
// Step 3's lower case of code point c into out (1 or 2 code points); returns how many.
size_t vlmoe_tokenizer_lower_cp(uint32_t c, uint32_t out[2]);

#endif
