// spm_stub.c: built instead of src/tok/spm.cc when libsentencepiece-dev was missing at build time:
// every SentencePiece load fails with the message that says how to enable it. See spm.h.
#include <stdio.h>

#include "tok/spm.h"

int vlmoe_spm_available(void) { return 0; }
int vlmoe_spm_load(vlmoe_spm **out, const void *bytes, size_t n, char *err, size_t cap) {
    (void)bytes, (void)n;
    *out = NULL;
    if (cap) snprintf(err, cap, "this vlmoe was built without SentencePiece: install libsentencepiece-dev "
                      "(scripts/deps.sh build does), then `make clean && make`");
    return -1;
}
void vlmoe_spm_free(vlmoe_spm *s) { (void)s; }
int vlmoe_spm_encode(const vlmoe_spm *s, const char *text, int32_t **ids, size_t *n, char *err, size_t cap) {
    (void)s, (void)text, *ids = NULL, *n = 0;
    if (cap) snprintf(err, cap, "SentencePiece is not built in");
    return -1;
}
int vlmoe_spm_decode(const vlmoe_spm *s, const int32_t *ids, int n, char **out, char *err, size_t cap) {
    (void)s, (void)ids, (void)n, *out = NULL;
    if (cap) snprintf(err, cap, "SentencePiece is not built in");
    return -1;
}
int vlmoe_spm_size(const vlmoe_spm *s) { return (void)s, 0; }
const char *vlmoe_spm_piece(const vlmoe_spm *s, int id) { return (void)s, (void)id, NULL; }
int vlmoe_spm_bos(const vlmoe_spm *s) { return (void)s, -1; }
int vlmoe_spm_eos(const vlmoe_spm *s) { return (void)s, -1; }
int vlmoe_spm_pad(const vlmoe_spm *s) { return (void)s, -1; }
