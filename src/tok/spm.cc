// spm.cc: SentencePiece through Debian's libsentencepiece (the library's own normalizer and
// unigram / BPE segmentation, so ids equal spm_encode's), behind the C interface of spm.h. No C++
// exception or object crosses the boundary: every failure is a message in err.
#include "tok/spm.h"

#include <sentencepiece_processor.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

struct vlmoe_spm {
    sentencepiece::SentencePieceProcessor p;
};

static int fail(char *err, size_t cap, const std::string &msg) {
    if (cap) std::snprintf(err, cap, "%s", msg.c_str());
    return -1;
}

extern "C" int vlmoe_spm_available(void) { return 1; }

extern "C" int vlmoe_spm_load(vlmoe_spm **out, const void *bytes, size_t n, char *err, size_t cap) {
    *out = nullptr;
    vlmoe_spm *s = new (std::nothrow) vlmoe_spm;
    if (!s) return fail(err, cap, "out of memory");
    try {
        auto st = s->p.LoadFromSerializedProto(std::string(static_cast<const char *>(bytes), n));
        if (!st.ok()) {
            delete s;
            return fail(err, cap, "not a SentencePiece model (" + st.ToString() + ")");
        }
    } catch (const std::exception &e) {
        delete s;
        return fail(err, cap, std::string("not a SentencePiece model (") + e.what() + ")");
    }
    *out = s;
    return 0;
}

extern "C" void vlmoe_spm_free(vlmoe_spm *s) { delete s; }

extern "C" int vlmoe_spm_encode(const vlmoe_spm *s, const char *text, int32_t **ids, size_t *n, char *err,
                                size_t cap) {
    *ids = nullptr, *n = 0;
    try {
        std::vector<int> v;
        auto st = s->p.Encode(text, &v);
        if (!st.ok()) return fail(err, cap, "SentencePiece Encode: " + st.ToString());
        int32_t *o = static_cast<int32_t *>(std::malloc(sizeof(int32_t) * (v.size() ? v.size() : 1)));
        if (!o) return fail(err, cap, "out of memory");
        for (size_t i = 0; i < v.size(); i++) o[i] = v[i];
        *ids = o, *n = v.size();
        return 0;
    } catch (const std::exception &e) {
        return fail(err, cap, std::string("SentencePiece Encode: ") + e.what());
    }
}

extern "C" int vlmoe_spm_decode(const vlmoe_spm *s, const int32_t *ids, int n, char **out, char *err, size_t cap) {
    *out = nullptr;
    try {
        std::vector<int> v(ids, ids + n);
        std::string t;
        auto st = s->p.Decode(v, &t);
        if (!st.ok()) return fail(err, cap, "SentencePiece Decode: " + st.ToString());
        char *o = static_cast<char *>(std::malloc(t.size() + 1));
        if (!o) return fail(err, cap, "out of memory");
        std::memcpy(o, t.data(), t.size());
        o[t.size()] = 0;
        *out = o;
        return 0;
    } catch (const std::exception &e) {
        return fail(err, cap, std::string("SentencePiece Decode: ") + e.what());
    }
}

extern "C" int vlmoe_spm_size(const vlmoe_spm *s) { return s ? s->p.GetPieceSize() : 0; }
extern "C" const char *vlmoe_spm_piece(const vlmoe_spm *s, int id) {
    return s && id >= 0 && id < s->p.GetPieceSize() ? s->p.IdToPiece(id).c_str() : nullptr;
}
extern "C" int vlmoe_spm_bos(const vlmoe_spm *s) { return s->p.bos_id(); }
extern "C" int vlmoe_spm_eos(const vlmoe_spm *s) { return s->p.eos_id(); }
extern "C" int vlmoe_spm_pad(const vlmoe_spm *s) { return s->p.pad_id(); }
