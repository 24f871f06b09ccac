// safetensors.c: reader and atomic writer of the safetensors format (u64 little-endian header
// length, JSON header, raw little-endian data), plus the f16/bf16 conversions. The reader trusts
// no byte of the file: every size is range- and overflow-checked before use. The writer records a
// CRC-32 of every tensor's bytes in the metadata (CRC_KEY), which the reader verifies, so a damaged
// file is refused, not trained on; files without it (older ones, other tools') load unverified.
// Covered by tests/test_safetensors.c and tests/hostile/test_hostile_files.c.
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "core/core.h"

// Tensor bytes are memcpy'd straight between the file and host values.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host"
#endif

#define MAX_HEADER ((uint64_t)100000000)    // the same limit as the HF reference reader
#define MAX_EXACT ((uint64_t)1 << 53)         // larger JSON numbers are not exact integers
// Metadata key of the checksums: one CRC-32 (zlib's, the ISO-HDLC polynomial) per tensor in header
// order, 8 lower-case hex digits each, separated by spaces. In the metadata rather than beside each
// tensor so that every other safetensors reader still reads the file.
#define CRC_KEY "vlmoe.crc32"

// CRC-32 of n bytes; zlib takes an unsigned length, so long tensors go in pieces.
static uint32_t crc_bytes(uint32_t crc, const unsigned char *p, size_t n) {
    while (n) {
        const unsigned k = n > (1u << 30) ? 1u << 30 : (unsigned)n;
        crc = (uint32_t)crc32(crc, p, k);
        p += k, n -= k;
    }
    return crc;
}

// ---------------------------------------------------------------------------------------------
// Half and bfloat16 conversions

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float vlmoe_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); // Inf, NaN keeps payload
    if (exp != 0) return bits_f32(sign | ((exp + 112) << 23) | (man << 13)); // rebias 15 -> 127
    float f = (float)man * 0x1p-24f; // zero or subnormal: man x 2^-24 is exact in float
    return sign ? -f : f;
}

uint16_t vlmoe_f32_to_f16(float f) {
    uint32_t x = f32_bits(f), ax = x & 0x7fffffffu, sign = (x >> 16) & 0x8000u;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x1ffu)); // quiet NaN
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // >= 65520 ties up to Inf
    if (ax >= 0x38800000u) // normal half: rebias, round the 13 dropped bits to even (the carry
                           // may bump the exponent, which is the right answer)
        return (uint16_t)(sign | ((ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13));
    // Subnormal half: the result is round_even(|f| x 2^24) = m x 2^(e - 126).
    int shift = 126 - (int)(ax >> 23);
    if (shift > 24) return (uint16_t)sign; // |f| < 2^-25 (or exactly half of 2^-24): zero
    uint32_t m = (ax & 0x7fffffu) | 0x800000u, q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

float vlmoe_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t vlmoe_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    // Truncating a NaN whose payload sits in the low 16 bits would give Inf: force it quiet.
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------------------------
// Dtypes and shared helpers

static const struct { const char *name; size_t size; } dtypes[] = {
    [VLMOE_DT_F32] = {"F32", 4}, [VLMOE_DT_F16] = {"F16", 2}, [VLMOE_DT_BF16] = {"BF16", 2},
    [VLMOE_DT_F64] = {"F64", 8}, [VLMOE_DT_I64] = {"I64", 8}, [VLMOE_DT_I32] = {"I32", 4},
    [VLMOE_DT_U8] = {"U8", 1},   [VLMOE_DT_I8] = {"I8", 1},   [VLMOE_DT_BOOL] = {"BOOL", 1},
    [VLMOE_DT_U64] = {"U64", 8},
};
#define N_DTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

static int dtype_ok(vlmoe_dtype dt) { return (int)dt >= 0 && (int)dt < N_DTYPES; }
const char *vlmoe_dtype_name(vlmoe_dtype dt) { return dtype_ok(dt) ? dtypes[dt].name : "?"; }
size_t vlmoe_dtype_size(vlmoe_dtype dt) { return dtype_ok(dt) ? dtypes[dt].size : 0; }

// Element count and byte size of a shape; 1 on size_t overflow. A zero dim makes the tensor
// empty whatever the other dims are, so it is looked for before multiplying.
static int shape_bytes(int ndim, const int64_t *shape, vlmoe_dtype dt, size_t *numel,
                       size_t *nbytes) {
    size_t n = 1;
    for (int d = 0; d < ndim; d++)
        if (shape[d] == 0) n = 0;
    for (int d = 0; d < ndim && n; d++)
        if (vlmoe_mul_ok(n, (size_t)shape[d], &n)) return 1;
    *numel = n;
    return vlmoe_mul_ok(n, vlmoe_dtype_size(dt), nbytes);
}

static void fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t len = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && len < cap; d++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%" PRId64, d ? ", " : "", shape[d]);
    if (len < cap) snprintf(buf + len, cap - len, "]");
}

static char *dup_str(const char *s, const char *what) {
    size_t n = strlen(s) + 1;
    char *p = vlmoe_alloc(n, what);
    if (p) memcpy(p, s, n);
    return p;
}

// ---------------------------------------------------------------------------------------------
// Reader

typedef struct {
    const char *name;      // into st->strings
    vlmoe_dtype dtype;
    int ndim;
    int64_t shape[VLMOE_MAX_DIMS];
    size_t numel, nbytes;
    uint64_t begin, end;   // data_offsets, relative to the data area
} st_entry;

// A name (or metadata key) with what it maps to; kept sorted for bsearch and duplicate checks.
typedef struct { const char *key; const char *value; int index; } st_key;

struct vlmoe_st {
    char *path;
    unsigned char *buf;    // the whole file
    size_t size, data_pos; // the data area is buf[data_pos, size)
    st_entry *t;           // in header order
    st_key *names;         // n, sorted by name
    st_key *meta;          // nmeta, sorted by key
    int n, nmeta;
    char *strings;         // every name, metadata key and value, NUL-terminated
    int checksummed;       // CRC_KEY was present and every tensor matched it
};

static int key_cmp(const void *a, const void *b) {
    return strcmp(((const st_key *)a)->key, ((const st_key *)b)->key);
}

// Renders a JSON value for an error message (the message buffer truncates long ones).
static const char *show(const cJSON *v, char *buf, size_t cap) {
    if (!v) return "(missing)";
    char *s = cJSON_PrintUnformatted(v);
    snprintf(buf, cap, "%s", s ? s : "(unprintable)");
    cJSON_free(s);
    return buf;
}

// A JSON number that is an exact integer in [0, 2^53]; doubles beyond that are not exact.
static int get_u53(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= (double)MAX_EXACT) || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

static int read_file(vlmoe_st *st) {
    const char *why;
    FILE *f = vlmoe_fopen_regular(st->path, &why);
    if (!f) return vlmoe_fail(VLMOE_ERR_IO, "%s: cannot open: %s", st->path, why);
    struct stat sb;
    int rc = VLMOE_OK;
    if (fstat(fileno(f), &sb) != 0) {
        rc = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot stat: %s", st->path, strerror(errno));
    } else if (!S_ISREG(sb.st_mode)) {
        rc = vlmoe_fail(VLMOE_ERR_IO, "%s: not a regular file", st->path);
    } else {
        st->size = (size_t)sb.st_size;
        st->buf = vlmoe_alloc(st->size, "safetensors file");
        if (!st->buf) rc = VLMOE_ERR_NOMEM;
        else if (fread(st->buf, 1, st->size, f) != st->size)
            rc = vlmoe_fail(VLMOE_ERR_IO, "%s: short read of %zu bytes: %s", st->path, st->size,
                            ferror(f) ? strerror(errno) : "file shrank while reading");
    }
    fclose(f);
    return rc;
}

static int parse_entry(vlmoe_st *st, const cJSON *it, st_entry *e) {
    const char *path = st->path, *name = e->name;
    char a[128], b[192];
    if (!cJSON_IsObject(it))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': expected an object with dtype, "
                          "shape and data_offsets, found %s", path, name, show(it, a, sizeof a));
    const cJSON *dt = NULL, *sh = NULL, *off = NULL;
    for (const cJSON *c = it->child; c; c = c->next) {
        const cJSON **slot = !strcmp(c->string, "dtype") ? &dt
                           : !strcmp(c->string, "shape") ? &sh
                           : !strcmp(c->string, "data_offsets") ? &off : NULL;
        if (slot && *slot)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': key \"%s\" appears twice",
                              path, name, c->string);
        if (slot) *slot = c;
    }
    if (!cJSON_IsString(dt))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': \"dtype\" must be a string, found %s",
                          path, name, show(dt, a, sizeof a));
    int dtype = -1;
    for (int i = 0; i < N_DTYPES; i++)
        if (!strcmp(dt->valuestring, dtypes[i].name)) dtype = i;
    e->dtype = (vlmoe_dtype)dtype;
    if (dtype < 0)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': unknown dtype %s (expected F32, F16, "
                          "BF16, F64, I64, I32, U8, I8, BOOL or U64)", path, name,
                          show(dt, a, sizeof a));
    if (!cJSON_IsArray(sh))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': \"shape\" must be an array, found %s",
                          path, name, show(sh, a, sizeof a));
    e->ndim = 0;
    for (const cJSON *c = sh->child; c; c = c->next, e->ndim++) {
        uint64_t v;
        if (e->ndim == VLMOE_MAX_DIMS)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': shape %s has more than %d dims",
                              path, name, show(sh, b, sizeof b), VLMOE_MAX_DIMS);
        if (!get_u53(c, &v))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': shape[%d] must be an integer in "
                              "[0, 2^53], found %s", path, name, e->ndim, show(c, a, sizeof a));
        e->shape[e->ndim] = (int64_t)v;
    }
    fmt_shape(b, sizeof b, e->ndim, e->shape);
    if (shape_bytes(e->ndim, e->shape, e->dtype, &e->numel, &e->nbytes))
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': shape %s x %s overflows the address "
                          "space", path, name, b, dtypes[e->dtype].name);
    const cJSON *o0 = cJSON_IsArray(off) ? off->child : NULL, *o1 = o0 ? o0->next : NULL;
    if (!o1 || o1->next || !get_u53(o0, &e->begin) || !get_u53(o1, &e->end) || e->begin > e->end)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': \"data_offsets\" must be [begin, end] "
                          "with integers 0 <= begin <= end, found %s", path, name,
                          show(off, a, sizeof a));
    if (e->end > st->size - st->data_pos)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                          "] end beyond the %zu-byte data area", path, name, e->begin, e->end,
                          st->size - st->data_pos);
    if (e->end - e->begin != e->nbytes)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                          "] span %" PRIu64 " bytes but shape %s x %s needs %zu", path, name,
                          e->begin, e->end, e->end - e->begin, b, dtypes[e->dtype].name, e->nbytes);
    return VLMOE_OK;
}

typedef struct { uint64_t begin, end; int index; } st_span;

static int span_cmp(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

// Tensors sorted by begin must each start at or after the previous end (zero-size ones too).
static int check_overlap(vlmoe_st *st) {
    st_span *sp = vlmoe_alloc((size_t)st->n * sizeof *sp, "safetensors spans");
    if (!sp) return VLMOE_ERR_NOMEM;
    for (int i = 0; i < st->n; i++) sp[i] = (st_span){st->t[i].begin, st->t[i].end, i};
    qsort(sp, (size_t)st->n, sizeof *sp, span_cmp);
    int rc = VLMOE_OK;
    for (int i = 1; i < st->n && !rc; i++)
        if (sp[i].begin < sp[i - 1].end)
            rc = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensors '%s' [%" PRIu64 ", %" PRIu64 "] and '%s' "
                            "[%" PRIu64 ", %" PRIu64 "] overlap", st->path,
                            st->t[sp[i - 1].index].name, sp[i - 1].begin, sp[i - 1].end,
                            st->t[sp[i].index].name, sp[i].begin, sp[i].end);
    vlmoe_free_mem(sp);
    return rc;
}

// Copies src to *s and advances *s past its NUL (the strings block was sized beforehand).
static const char *put_str(char **s, const char *src) {
    size_t n = strlen(src) + 1;
    char *p = memcpy(*s, src, n);
    *s += n;
    return p;
}

static int parse_entries(vlmoe_st *st, const cJSON *root) {
    const char *path = st->path;
    char a[128];
    size_t nt = 0, nm = 0, strbytes = 0;
    const cJSON *meta = NULL;
    // First pass: validate __metadata__ and size everything, so each array is allocated once.
    // Sums cannot overflow: every string came out of a header of at most 100 MB.
    for (const cJSON *it = root->child; it; it = it->next) {
        if (strcmp(it->string, "__metadata__")) {
            nt++;
            strbytes += strlen(it->string) + 1;
            continue;
        }
        if (meta) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: \"__metadata__\" appears twice", path);
        if (!cJSON_IsObject(it))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: \"__metadata__\" must be an object of strings, "
                              "found %s", path, show(it, a, sizeof a));
        meta = it;
        for (const cJSON *m = it->child; m; m = m->next, nm++) {
            if (!cJSON_IsString(m))
                return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: __metadata__ key '%s' must map to a "
                                  "string, found %s", path, m->string, show(m, a, sizeof a));
            strbytes += strlen(m->string) + strlen(m->valuestring) + 2;
        }
    }
    st->t = vlmoe_calloc(nt * sizeof *st->t, "safetensors entries");
    st->names = vlmoe_alloc(nt * sizeof *st->names, "safetensors names");
    st->meta = vlmoe_alloc(nm * sizeof *st->meta, "safetensors metadata");
    st->strings = vlmoe_alloc(strbytes, "safetensors strings");
    if (!st->t || !st->names || !st->meta || !st->strings) return VLMOE_ERR_NOMEM;
    char *s = st->strings;
    for (const cJSON *it = root->child; it; it = it->next) {
        if (it == meta) {
            for (const cJSON *m = it->child; m; m = m->next) {
                st_key *k = &st->meta[st->nmeta++];
                k->key = put_str(&s, m->string);
                k->value = put_str(&s, m->valuestring);
            }
            continue;
        }
        st_entry *e = &st->t[st->n];
        e->name = put_str(&s, it->string);
        st->names[st->n] = (st_key){e->name, NULL, st->n};
        st->n++;
        int rc = parse_entry(st, it, e);
        if (rc) return rc;
    }
    // cJSON keeps duplicate keys; sorting brings them next to each other.
    qsort(st->names, (size_t)st->n, sizeof *st->names, key_cmp);
    qsort(st->meta, (size_t)st->nmeta, sizeof *st->meta, key_cmp);
    for (int i = 1; i < st->n; i++)
        if (!strcmp(st->names[i].key, st->names[i - 1].key))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", path,
                              st->names[i].key);
    for (int i = 1; i < st->nmeta; i++)
        if (!strcmp(st->meta[i].key, st->meta[i - 1].key))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: __metadata__ key '%s' appears twice", path,
                              st->meta[i].key);
    return check_overlap(st);
}

static int parse_header(vlmoe_st *st) {
    const char *path = st->path;
    if (st->size < 8)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: file is %zu bytes, expected at least the 8-byte "
                          "header length", path, st->size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | st->buf[i];
    if (hlen > st->size - 8)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the %zu bytes "
                          "after the length field", path, hlen, st->size - 8);
    if (hlen > MAX_HEADER)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the %" PRIu64
                          "-byte limit", path, hlen, MAX_HEADER);
    st->data_pos = 8 + (size_t)hlen;
    // cJSON wants a NUL-terminated string and data follows the header: parse a copy.
    char *text = vlmoe_alloc((size_t)hlen + 1, "safetensors header");
    if (!text) return VLMOE_ERR_NOMEM;
    memcpy(text, st->buf + 8, (size_t)hlen);
    text[hlen] = 0;
    const char *end = text;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 0);
    int rc = VLMOE_OK;
    if (!root) {
        rc = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: header is not valid JSON (error near byte %td of "
                        "%" PRIu64 ")", path, end - text, hlen);
    } else if (!cJSON_IsObject(root)) {
        rc = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: header must be a JSON object", path);
    } else {
        // Only space padding (or other JSON whitespace) may follow the object; a NUL stops
        // cJSON early and is caught here too.
        for (const char *p = end; p < text + hlen && !rc; p++)
            if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
                rc = vlmoe_fail(VLMOE_ERR_FORMAT, "%s: unexpected byte 0x%02x at header byte %td "
                                "after the JSON object (expected space padding)", path,
                                (unsigned char)*p, p - text);
        if (!rc) rc = parse_entries(st, root);
    }
    cJSON_Delete(root);
    vlmoe_free_mem(text);
    return rc;
}

// Verifies the tensors' bytes against CRC_KEY, when the file has it.
static int verify_crc(vlmoe_st *st) {
    const char *list = vlmoe_st_metadata(st, CRC_KEY), *p = list;
    if (!list) return VLMOE_OK;
    for (int i = 0; i < st->n; i++) {
        const st_entry *e = &st->t[i];
        while (*p == ' ') p++;
        unsigned long want = 0;
        int k = 0;
        for (; k < 8 && p[k]; k++) {
            const char c = p[k];
            const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (d < 0) break;
            want = want << 4 | (unsigned long)d;
        }
        if (k != 8 || (p[8] && p[8] != ' '))
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: __metadata__ \"%s\" lists %d checksum%s, the file has %d "
                              "tensors: the header is damaged", st->path, CRC_KEY, i, i == 1 ? "" : "s", st->n);
        p += 8;
        const uint32_t got = crc_bytes((uint32_t)crc32(0, Z_NULL, 0), st->buf + st->data_pos + e->begin, e->nbytes);
        if (got != (uint32_t)want)
            return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': checksum mismatch (CRC-32 %08" PRIx32 ", recorded "
                              "%08lx): the file is damaged", st->path, e->name, got, want);
    }
    while (*p == ' ') p++;
    if (*p)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: __metadata__ \"%s\" lists more checksums than the %d tensors: the "
                          "header is damaged", st->path, CRC_KEY, st->n);
    st->checksummed = 1;
    return VLMOE_OK;
}

int vlmoe_st_checksummed(const vlmoe_st *st) { return st && st->checksummed; }

int vlmoe_st_open(const char *path, vlmoe_st **out) {
    if (!out || !path) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_open: NULL path or out");
    *out = NULL;
    vlmoe_st *st = vlmoe_calloc(sizeof *st, "safetensors handle");
    if (!st) return VLMOE_ERR_NOMEM;
    st->path = dup_str(path, "safetensors path");
    int rc = st->path ? read_file(st) : VLMOE_ERR_NOMEM;
    if (!rc) rc = parse_header(st);
    if (!rc) rc = verify_crc(st);
    if (rc == VLMOE_ERR_NOMEM) vlmoe_error_prefix("%s", path);
    if (rc) {
        vlmoe_st_close(st);
        return rc;
    }
    *out = st;
    return VLMOE_OK;
}

void vlmoe_st_close(vlmoe_st *st) {
    if (!st) return;
    vlmoe_free_mem(st->path);
    vlmoe_free_mem(st->buf);
    vlmoe_free_mem(st->t);
    vlmoe_free_mem(st->names);
    vlmoe_free_mem(st->meta);
    vlmoe_free_mem(st->strings);
    vlmoe_free_mem(st);
}

int vlmoe_st_count(const vlmoe_st *st) { return st ? st->n : 0; }
const char *vlmoe_st_path(const vlmoe_st *st) { return st ? st->path : NULL; }

int vlmoe_st_find(const vlmoe_st *st, const char *name) {
    if (!st || !name) return -1;
    st_key probe = {name, NULL, 0};
    const st_key *k = bsearch(&probe, st->names, (size_t)st->n, sizeof probe, key_cmp);
    return k ? k->index : -1;
}

const char *vlmoe_st_metadata(const vlmoe_st *st, const char *key) {
    if (!st || !key) return NULL;
    st_key probe = {key, NULL, 0};
    const st_key *k = bsearch(&probe, st->meta, (size_t)st->nmeta, sizeof probe, key_cmp);
    return k ? k->value : NULL;
}

int vlmoe_st_info(const vlmoe_st *st, int index, vlmoe_tensor_info *info) {
    if (!st || !info || index < 0 || index >= st->n)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor index %d outside [0, %d)",
                          st ? st->path : "vlmoe_st_info", index, st ? st->n : 0);
    const st_entry *e = &st->t[index];
    memset(info, 0, sizeof *info);
    info->name = e->name;
    info->dtype = e->dtype;
    info->ndim = e->ndim;
    memcpy(info->shape, e->shape, sizeof e->shape);
    info->numel = e->numel;
    info->nbytes = e->nbytes;
    info->data = st->buf + st->data_pos + e->begin;
    return VLMOE_OK;
}

int vlmoe_st_read_f32(const vlmoe_st *st, const char *name, float *dst, size_t n) {
    if (!st || !name || (!dst && n))
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_read_f32: NULL handle, name or destination");
    int i = vlmoe_st_find(st, name);
    if (i < 0) return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: no tensor '%s'", st->path, name);
    const st_entry *e = &st->t[i];
    char b[192];
    fmt_shape(b, sizeof b, e->ndim, e->shape);
    if (e->numel != n)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': expected %zu elements, found shape %s "
                          "(%zu elements)", st->path, name, n, b, e->numel);
    if (e->dtype != VLMOE_DT_F32 && e->dtype != VLMOE_DT_F16 && e->dtype != VLMOE_DT_BF16 &&
        e->dtype != VLMOE_DT_F64)
        return vlmoe_fail(VLMOE_ERR_FORMAT, "%s: tensor '%s': dtype %s cannot be read as float "
                          "(expected F32, F16, BF16 or F64)", st->path, name, dtypes[e->dtype].name);
    if (n == 0) return VLMOE_OK;
    // The data area may start at any byte offset: memcpy every element, never cast the pointer.
    const unsigned char *p = st->buf + st->data_pos + e->begin;
    if (e->dtype == VLMOE_DT_F32) {
        memcpy(dst, p, n * sizeof(float));
    } else if (e->dtype == VLMOE_DT_F64) {
        for (size_t j = 0; j < n; j++) {
            double d;
            memcpy(&d, p + 8 * j, 8);
            dst[j] = (float)d;
        }
    } else {
        for (size_t j = 0; j < n; j++) {
            uint16_t h;
            memcpy(&h, p + 2 * j, 2);
            dst[j] = e->dtype == VLMOE_DT_F16 ? vlmoe_f16_to_f32(h) : vlmoe_bf16_to_f32(h);
        }
    }
    return VLMOE_OK;
}

// ---------------------------------------------------------------------------------------------
// Writer

typedef struct {
    char *name;
    vlmoe_dtype dtype;
    int ndim;
    int64_t shape[VLMOE_MAX_DIMS];
    size_t nbytes;         // in the file
    const void *data;      // the caller's, read at write time
    int from_f32;          // data holds floats to convert to dtype
} w_entry;

struct vlmoe_st_writer {
    w_entry *t;
    char **meta;           // key, value, key, value, ...
    int n, cap, nmeta, meta_cap;
};

// Makes room for `need` elements, doubling; returns the (maybe moved) array or NULL.
static void *grow(void *arr, int *cap, int need, size_t elem, const char *what) {
    if (need <= *cap) return arr;
    size_t nc = *cap ? 2 * (size_t)*cap : 16, bytes;
    if (nc > 0x3fffffff || vlmoe_mul_ok(nc, elem, &bytes)) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "too many entries for %s", what);
        return NULL;
    }
    void *p = vlmoe_alloc(bytes, what);
    if (!p) return NULL;
    if (arr) memcpy(p, arr, (size_t)*cap * elem);
    vlmoe_free_mem(arr);
    *cap = (int)nc;
    return p;
}

int vlmoe_st_writer_init(vlmoe_st_writer **out) {
    if (!out) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_writer_init: out is NULL");
    *out = vlmoe_calloc(sizeof **out, "safetensors writer");
    return *out ? VLMOE_OK : VLMOE_ERR_NOMEM;
}

void vlmoe_st_writer_free(vlmoe_st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) vlmoe_free_mem(w->t[i].name);
    for (int i = 0; i < 2 * w->nmeta; i++) vlmoe_free_mem(w->meta[i]);
    vlmoe_free_mem(w->t);
    vlmoe_free_mem(w->meta);
    vlmoe_free_mem(w);
}

static int writer_add(vlmoe_st_writer *w, const char *name, vlmoe_dtype dtype, int ndim,
                      const int64_t *shape, const void *data, int from_f32) {
    const char *fn = from_f32 ? "vlmoe_st_writer_add_f32" : "vlmoe_st_writer_add_raw";
    if (!w || !name) return vlmoe_fail(VLMOE_ERR_ARG, "%s: NULL writer or name", fn);
    if (!dtype_ok(dtype))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': unknown dtype %d", fn, name, (int)dtype);
    if (from_f32 && dtype != VLMOE_DT_F32 && dtype != VLMOE_DT_F16 && dtype != VLMOE_DT_BF16)
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': cannot store float32 as %s (expected "
                          "F32, F16 or BF16)", fn, name, dtypes[dtype].name);
    if (ndim < 0 || ndim > VLMOE_MAX_DIMS || (ndim > 0 && !shape))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': ndim %d outside [0, %d] or NULL shape",
                          fn, name, ndim, VLMOE_MAX_DIMS);
    if (!strcmp(name, "__metadata__"))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: the name __metadata__ is reserved", fn);
    // A linear scan: add runs once per tensor and models have at most a few thousand.
    for (int i = 0; i < w->n; i++)
        if (!strcmp(w->t[i].name, name))
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s' added twice", fn, name);
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0 || shape[d] > (int64_t)MAX_EXACT)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': shape[%d] = %" PRId64 " outside "
                              "[0, 2^53]", fn, name, d, shape[d]);
    w_entry e = {.dtype = dtype, .ndim = ndim, .data = data, .from_f32 = from_f32};
    size_t numel;
    if (ndim) memcpy(e.shape, shape, (size_t)ndim * sizeof *shape);
    if (shape_bytes(ndim, e.shape, dtype, &numel, &e.nbytes))
        return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': shape overflows size_t", fn, name);
    if (!data && numel) return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': data is NULL", fn, name);
    w_entry *t = grow(w->t, &w->cap, w->n + 1, sizeof *t, "safetensors writer entries");
    if (!t) return VLMOE_ERR_NOMEM;
    w->t = t;
    if (!(e.name = dup_str(name, "safetensors tensor name"))) return VLMOE_ERR_NOMEM;
    w->t[w->n++] = e;
    return VLMOE_OK;
}

int vlmoe_st_writer_add_f32(vlmoe_st_writer *w, const char *name, vlmoe_dtype dtype, int ndim,
                            const int64_t *shape, const float *data) {
    return writer_add(w, name, dtype, ndim, shape, data, 1);
}

int vlmoe_st_writer_add_raw(vlmoe_st_writer *w, const char *name, vlmoe_dtype dtype, int ndim,
                            const int64_t *shape, const void *data) {
    return writer_add(w, name, dtype, ndim, shape, data, 0);
}

int vlmoe_st_writer_meta(vlmoe_st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value)
        return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_writer_meta: NULL writer, key or value");
    for (int i = 0; i < w->nmeta; i++)
        if (!strcmp(w->meta[2 * i], key))
            return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_writer_meta: key '%s' set twice", key);
    char **m = grow(w->meta, &w->meta_cap, 2 * w->nmeta + 2, sizeof *m, "safetensors metadata");
    if (!m) return VLMOE_ERR_NOMEM;
    w->meta = m;
    char *k = dup_str(key, "metadata key"), *v = k ? dup_str(value, "metadata value") : NULL;
    if (!v) {
        vlmoe_free_mem(k);
        return VLMOE_ERR_NOMEM;
    }
    m[2 * w->nmeta] = k;
    m[2 * w->nmeta + 1] = v;
    w->nmeta++;
    return VLMOE_OK;
}

// A growable string for the header; `bad` latches an allocation failure so callers check once.
typedef struct { char *p; size_t len, cap; int bad; } sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->bad) return;
    if (n > b->cap - b->len) {
        size_t nc;
        char *p = vlmoe_add_ok(b->len, n, &nc) || vlmoe_add_ok(nc, b->cap + 256, &nc)
                      ? NULL : vlmoe_alloc(nc, "safetensors header");
        if (!p) {
            b->bad = 1;
            return;
        }
        if (b->len) memcpy(p, b->p, b->len);
        vlmoe_free_mem(b->p);
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

// A JSON string literal; bytes >= 0x80 pass through (names are expected to be UTF-8).
static void sb_json(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        char esc[8];
        if (*s == '"' || *s == '\\') {
            esc[0] = '\\', esc[1] = *s;
            sb_put(b, esc, 2);
        } else if ((unsigned char)*s < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", (unsigned)(unsigned char)*s);
            sb_put(b, esc, 6);
        } else {
            sb_put(b, s, 1);
        }
    }
    sb_put(b, "\"", 1);
}

// Converts floats src[0..n) to dtype's 16-bit values in dst (n at most 2048).
static void to_half(vlmoe_dtype dt, const float *src, size_t n, uint16_t *dst) {
    for (size_t j = 0; j < n; j++) dst[j] = dt == VLMOE_DT_F16 ? vlmoe_f32_to_f16(src[j]) : vlmoe_f32_to_bf16(src[j]);
}

// The CRC-32 of the bytes write_tensor writes for e.
static uint32_t tensor_crc(const w_entry *e) {
    uint32_t crc = (uint32_t)crc32(0, Z_NULL, 0);
    if (!e->from_f32 || e->dtype == VLMOE_DT_F32) return crc_bytes(crc, e->data, e->nbytes);
    uint16_t buf[2048];
    for (size_t i = 0, n = e->nbytes / 2; i < n; i += 2048) {
        const size_t k = n - i < 2048 ? n - i : 2048;
        to_half(e->dtype, (const float *)e->data + i, k, buf);
        crc = crc_bytes(crc, (const unsigned char *)buf, 2 * k);
    }
    return crc;
}

// Header JSON: "__metadata__" first (the caller's, then CRC_KEY), then tensors in insertion order
// with contiguous offsets, padded with spaces so the data area starts 8-byte aligned.
static int build_header(const vlmoe_st_writer *w, sbuf *b, const char *path) {
    char num[64];
    sb_str(b, "{\"__metadata__\":{");
    int first = 1;
    for (int i = 0; i < w->nmeta; i++) {
        if (!strcmp(w->meta[2 * i], CRC_KEY)) continue; // a copied file's: this file's own is written below
        if (!first) sb_put(b, ",", 1);
        first = 0;
        sb_json(b, w->meta[2 * i]);
        sb_put(b, ":", 1);
        sb_json(b, w->meta[2 * i + 1]);
    }
    if (!first) sb_put(b, ",", 1);
    sb_json(b, CRC_KEY);
    sb_str(b, ":\"");
    for (int i = 0; i < w->n; i++) {
        snprintf(num, sizeof num, "%s%08" PRIx32, i ? " " : "", tensor_crc(&w->t[i]));
        sb_str(b, num);
    }
    sb_str(b, "\"}");
    uint64_t off = 0;
    for (int i = 0; i < w->n; i++) {
        const w_entry *e = &w->t[i];
        if (e->nbytes > MAX_EXACT - off)
            return vlmoe_fail(VLMOE_ERR_ARG, "%s: tensor '%s': data exceeds 2^53 bytes", path,
                              e->name);
        sb_put(b, ",", 1);
        sb_json(b, e->name);
        sb_str(b, ":{\"dtype\":\"");
        sb_str(b, dtypes[e->dtype].name);
        sb_str(b, "\",\"shape\":[");
        for (int d = 0; d < e->ndim; d++) {
            snprintf(num, sizeof num, "%s%" PRId64, d ? "," : "", e->shape[d]);
            sb_str(b, num);
        }
        snprintf(num, sizeof num, "%" PRIu64 ",%" PRIu64, off, off + e->nbytes);
        sb_str(b, "],\"data_offsets\":[");
        sb_str(b, num);
        sb_str(b, "]}");
        off += e->nbytes;
    }
    sb_put(b, "}", 1);
    while (!b->bad && b->len % 8) sb_put(b, " ", 1);
    if (b->bad) vlmoe_error_prefix("%s", path);
    return b->bad ? VLMOE_ERR_NOMEM : VLMOE_OK;
}

// Writes one tensor's bytes, converting floats to F16/BF16 in stack-sized chunks. 0 on success.
static int write_tensor(FILE *f, const w_entry *e) {
    if (e->nbytes == 0) return 0;
    if (!e->from_f32 || e->dtype == VLMOE_DT_F32)
        return fwrite(e->data, 1, e->nbytes, f) == e->nbytes ? 0 : -1;
    const float *src = e->data;
    uint16_t buf[2048];
    for (size_t i = 0, n = e->nbytes / 2; i < n; i += 2048) {
        size_t k = n - i < 2048 ? n - i : 2048;
        to_half(e->dtype, src + i, k, buf);
        if (fwrite(buf, 2, k, f) != k) return -1;
    }
    return 0;
}

// Makes the rename durable. EINVAL means the filesystem cannot fsync directories: not an error.
int vlmoe_sync_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    size_t n = slash ? (slash == path ? 1 : (size_t)(slash - path)) : 1;
    char *dir = vlmoe_alloc(n + 1, "directory name");
    if (!dir) return VLMOE_ERR_NOMEM;
    memcpy(dir, slash ? path : ".", n);
    dir[n] = 0;
    int rc = VLMOE_OK, fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL))
        rc = vlmoe_fail(VLMOE_ERR_IO, "%s: written, but cannot fsync directory %s: %s", path, dir,
                        strerror(errno));
    if (fd >= 0) close(fd);
    vlmoe_free_mem(dir);
    return rc;
}

int vlmoe_st_writer_write_tmp(vlmoe_st_writer *w, const char *path, char *tmp, size_t cap) {
    if (!w || !path || !tmp) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_writer_write: NULL writer or path");
    sbuf hdr = {0};
    unsigned char len8[8];
    FILE *f = NULL;
    int rc = build_header(w, &hdr, path);
    if (rc) goto done;
    if (snprintf(tmp, cap, "%s.tmp.%ld", path, (long)getpid()) >= (int)cap) {
        rc = vlmoe_fail(VLMOE_ERR_ARG, "%s: path too long", path);
        goto done;
    }
    if (!(f = fopen(tmp, "wb"))) {
        rc = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot create %s: %s", path, tmp, strerror(errno));
        goto done;
    }
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hdr.len >> (8 * i));
    errno = 0;
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(hdr.p, 1, hdr.len, f) != hdr.len) goto io_error;
    for (int i = 0; i < w->n; i++)
        if (write_tensor(f, &w->t[i])) goto io_error;
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) goto io_error;
    if (fclose(f) != 0) {
        f = NULL;
        goto io_error;
    }
    goto done;
io_error:
    rc = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot write (via %s): %s", path, tmp,
                    strerror(errno ? errno : EIO));
    if (f) fclose(f);
    remove(tmp);
done:
    vlmoe_free_mem(hdr.p);
    return rc;
}

int vlmoe_st_writer_write(vlmoe_st_writer *w, const char *path) {
    if (!w || !path) return vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_st_writer_write: NULL writer or path");
    const size_t cap = strlen(path) + 32;
    char *tmp = vlmoe_alloc(cap, "temporary file name");
    if (!tmp) return VLMOE_ERR_NOMEM;
    int rc = vlmoe_st_writer_write_tmp(w, path, tmp, cap);
    if (!rc && rename(tmp, path) != 0) {
        rc = vlmoe_fail(VLMOE_ERR_IO, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
        remove(tmp);
    }
    if (!rc) rc = vlmoe_sync_dir(path);
    vlmoe_free_mem(tmp);
    return rc;
}
