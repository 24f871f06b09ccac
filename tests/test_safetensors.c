// test_safetensors.c: tests src/io/safetensors.c: f16/bf16 golden values, nearest-even checks
// against neighbours and exhaustive round trips; writer/reader round trip; a hand-made file;
// a battery of malicious headers; truncation at every byte; a bit-flip fuzz of the header.
#include <dirent.h>
#include <float.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/core.h"
#include "io/safetensors.h"
#include "test.h"

static char dir[64];
static volatile unsigned char sink; // keeps the fuzz loop's reads from being optimised away

static void path_of(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", dir, name);
}

static void write_bytes(const char *path, const void *p, size_t n) {
    // Checks only on failure: this runs thousands of times and is not what is under test.
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) CHECK(0, "cannot write %s", path);
    if (f) fclose(f);
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    *n = 0;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc(len > 0 ? (size_t)len : 1);
    if (p && fread(p, 1, (size_t)len, f) == (size_t)len) *n = (size_t)len;
    fclose(f);
    return p;
}

// A file of: the 8-byte length `hlen`, `hdr` verbatim, then `ndata` bytes of data.
static void make_file(const char *path, uint64_t hlen, const char *hdr, size_t hdr_bytes,
                      size_t ndata) {
    size_t n = 8 + hdr_bytes + ndata;
    unsigned char *p = malloc(n);
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(p + 8, hdr, hdr_bytes);
    for (size_t i = 0; i < ndata; i++) p[8 + hdr_bytes + i] = (unsigned char)(i * 37 + 11);
    write_bytes(path, p, n);
    free(p);
}

// Opens `path` expecting failure: nonzero status, NULL handle, a message naming the file (and
// containing `want` if given).
static void expect_bad_file(const char *label, const char *path, const char *want) {
    vlmoe_st *st = NULL;
    vlmoe_clear_error();
    int rc = vlmoe_st_open(path, &st);
    const char *msg = vlmoe_last_error();
    if (getenv("VLMOE_VERBOSE")) fprintf(stderr, "%-28s %s\n", label, msg);
    CHECK(rc != VLMOE_OK && st == NULL, "%s: a bad file opened", label);
    CHECK(strstr(msg, path) != NULL, "%s: message '%s' does not name the file", label, msg);
    if (want) CHECK(strstr(msg, want) != NULL, "%s: message '%s' lacks '%s'", label, msg, want);
    vlmoe_st_close(st);
}

static void bad_header(const char *label, const char *hdr, size_t ndata, const char *want) {
    char p[128];
    path_of(p, sizeof p, "bad.safetensors");
    make_file(p, strlen(hdr), hdr, strlen(hdr), ndata);
    expect_bad_file(label, p, want);
}

static void good_header(const char *label, const char *hdr, size_t ndata, int count) {
    char p[128];
    vlmoe_st *st = NULL;
    path_of(p, sizeof p, "good.safetensors");
    make_file(p, strlen(hdr), hdr, strlen(hdr), ndata);
    int rc = vlmoe_st_open(p, &st);
    CHECK(rc == VLMOE_OK, "%s: %s", label, vlmoe_last_error());
    CHECK(vlmoe_st_count(st) == count, "%s: %d tensors, expected %d", label, vlmoe_st_count(st),
          count);
    vlmoe_st_close(st);
}

// ---------------------------------------------------------------------------------------------

static uint16_t f16(float f) { return vlmoe_f32_to_f16(f); }
static uint16_t bf16(float f) { return vlmoe_f32_to_bf16(f); }
static float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// `h` must be the nearest code to finite x, ties to the even code. Codes grow with magnitude;
// the code after the largest finite one (Inf) stands for the value one ulp further, which is
// where round-to-nearest-even sends overflow.
static double code_mag(uint16_t mag, float (*dec)(uint16_t), uint16_t max_finite) {
    if (mag <= max_finite) return fabs((double)dec(mag));
    double m = dec(max_finite), prev = dec((uint16_t)(max_finite - 1));
    return 2 * m - prev;
}

static int is_nearest_even(float x, uint16_t h, float (*dec)(uint16_t), uint16_t max_finite) {
    uint16_t mag = h & 0x7fff;
    if (mag > max_finite + 1 || (h & 0x8000) != (signbit(x) ? 0x8000 : 0)) return 0;
    double ax = fabs((double)x), d = fabs(code_mag(mag, dec, max_finite) - ax);
    for (int step = -1; step <= 1; step += 2) {
        if ((mag == 0 && step < 0) || (mag == max_finite + 1 && step > 0)) continue;
        double dn = fabs(code_mag((uint16_t)(mag + step), dec, max_finite) - ax);
        if (dn < d || (dn == d && (mag & 1))) return 0;
    }
    return 1;
}

static void test_convert(void) {
    // f16 golden values
    CHECK(f16(1.0f) == 0x3c00, "1.0 -> %04x", f16(1.0f));
    CHECK(f16(-2.5f) == 0xc100, "-2.5 -> %04x", f16(-2.5f));
    CHECK(f16(65504.0f) == 0x7bff, "65504 -> %04x", f16(65504.0f));
    CHECK(f16(65519.0f) == 0x7bff, "65519 -> %04x", f16(65519.0f));
    CHECK(f16(65520.0f) == 0x7c00, "65520 ties to Inf -> %04x", f16(65520.0f));
    CHECK(f16(INFINITY) == 0x7c00 && f16(-INFINITY) == 0xfc00, "inf");
    CHECK((f16(NAN) & 0x7c00) == 0x7c00 && (f16(NAN) & 0x3ff), "nan -> %04x", f16(NAN));
    CHECK(f16(from_bits(0x7f800001u)) != 0x7c00, "low-payload NaN must stay NaN");
    CHECK(f16(-0.0f) == 0x8000, "-0");
    CHECK(f16(0x1p-24f) == 0x0001, "smallest subnormal");
    CHECK(f16(0x1p-25f) == 0x0000, "2^-25 ties to even 0 -> %04x", f16(0x1p-25f));
    CHECK(f16(0x1.000002p-25f) == 0x0001, "just above 2^-25");
    CHECK(f16(0x1.8p-24f) == 0x0002, "1.5 x 2^-24 ties to even 2 -> %04x", f16(0x1.8p-24f));
    CHECK(f16(0x1.4p-23f) == 0x0002, "2.5 x 2^-24 ties to even 2 -> %04x", f16(0x1.4p-23f));
    CHECK(f16(1023.0f * 0x1p-24f) == 0x03ff, "largest subnormal");
    CHECK(f16(1023.5f * 0x1p-24f) == 0x0400, "subnormal rounds up into the normals");
    CHECK(f16(1.0f + 0x1p-11f) == 0x3c00, "1 + half ulp ties to even 1.0");
    CHECK(f16(1.0f + 0x1.8p-10f) == 0x3c02, "1 + 1.5 ulp ties to even -> %04x",
          f16(1.0f + 0x1.8p-10f));
    CHECK(f16(1e-10f) == 0 && f16(from_bits(1)) == 0, "underflow to zero");
    CHECK(vlmoe_f16_to_f32(0x3c00) == 1.0f && vlmoe_f16_to_f32(0xc100) == -2.5f, "decode");
    CHECK(vlmoe_f16_to_f32(0x7bff) == 65504.0f, "decode max");
    CHECK(vlmoe_f16_to_f32(0x0001) == 0x1p-24f, "decode smallest subnormal");
    CHECK(vlmoe_f16_to_f32(0x03ff) == 1023.0f * 0x1p-24f, "decode largest subnormal");
    CHECK(isinf(vlmoe_f16_to_f32(0xfc00)) && vlmoe_f16_to_f32(0xfc00) < 0, "decode -inf");
    CHECK(isnan(vlmoe_f16_to_f32(0x7e00)) && isnan(vlmoe_f16_to_f32(0x7c01)), "decode nan");
    CHECK(signbit(vlmoe_f16_to_f32(0x8000)) && vlmoe_f16_to_f32(0x8000) == 0, "decode -0");

    // bf16 golden values
    CHECK(bf16(1.0f) == 0x3f80 && bf16(-2.5f) == 0xc020, "bf16 1.0, -2.5");
    CHECK(bf16(from_bits(0x3f808000u)) == 0x3f80, "bf16 tie down to even");
    CHECK(bf16(from_bits(0x3f818000u)) == 0x3f82, "bf16 tie up to even");
    CHECK(bf16(from_bits(0x3f808001u)) == 0x3f81, "bf16 above tie");
    CHECK(bf16(INFINITY) == 0x7f80 && bf16(-INFINITY) == 0xff80, "bf16 inf");
    CHECK(bf16(FLT_MAX) == 0x7f80, "bf16 FLT_MAX rounds to inf -> %04x", bf16(FLT_MAX));
    CHECK(isnan(vlmoe_bf16_to_f32(bf16(from_bits(0x7f800001u)))), "bf16 low-payload NaN");
    CHECK(isnan(vlmoe_bf16_to_f32(bf16(NAN))), "bf16 nan");
    CHECK(bf16(from_bits(1)) == 0x0000, "bf16 smallest float subnormal rounds to 0");
    CHECK(vlmoe_bf16_to_f32(0x0001) == from_bits(0x00010000u), "bf16 keeps subnormals");
    CHECK(vlmoe_bf16_to_f32(0xc020) == -2.5f, "bf16 decode");

    // Every 16-bit code decodes and encodes back to itself (NaNs stay NaN).
    int bad16 = 0, badbf = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = vlmoe_f16_to_f32((uint16_t)h), b = vlmoe_bf16_to_f32((uint16_t)h);
        if (isnan(a) ? !isnan(vlmoe_f16_to_f32(f16(a))) : f16(a) != h) bad16++;
        if (isnan(b) ? !isnan(vlmoe_bf16_to_f32(bf16(b))) : bf16(b) != h) badbf++;
    }
    CHECK(bad16 == 0, "%d f16 codes do not round trip", bad16);
    CHECK(badbf == 0, "%d bf16 codes do not round trip", badbf);

    // Random floats (all exponents) round to the nearest code, ties to even.
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 7);
    int not16 = 0, notbf = 0;
    for (int i = 0; i < 300000; i++) {
        uint32_t u = (uint32_t)vlmoe_rng_u64(&r);
        if (i & 1) u = (u & 0x807fffffu) | ((uint32_t)(100 + vlmoe_rng_below(&r, 45)) << 23);
        float x = from_bits(u);
        if (isnan(x) || isinf(x)) continue;
        if (!is_nearest_even(x, f16(x), vlmoe_f16_to_f32, 0x7bff) && not16++ < 5)
            fprintf(stderr, "f16(%a) = %04x not nearest\n", (double)x, f16(x));
        if (!is_nearest_even(x, bf16(x), vlmoe_bf16_to_f32, 0x7f7f) && notbf++ < 5)
            fprintf(stderr, "bf16(%a) = %04x not nearest\n", (double)x, bf16(x));
    }
    CHECK(not16 == 0 && notbf == 0, "%d f16 and %d bf16 results are not nearest-even", not16,
          notbf);

    CHECK(!strcmp(vlmoe_dtype_name(VLMOE_DT_BF16), "BF16") && vlmoe_dtype_size(VLMOE_DT_U64) == 8,
          "dtype table");
    CHECK(vlmoe_dtype_size((vlmoe_dtype)42) == 0, "unknown dtype size");
    size_t total = 0;
    for (int d = 0; d <= VLMOE_DT_U64; d++) total += vlmoe_dtype_size((vlmoe_dtype)d);
    CHECK(total == 4 + 2 + 2 + 8 + 8 + 4 + 1 + 1 + 1 + 8, "dtype sizes sum to %zu", total);
}

// ---------------------------------------------------------------------------------------------

static const float rt_a[6] = {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e-3f};
static const float rt_h[5] = {0.1f, 65504.0f, -1e-7f, 70000.0f, 1.0f};
static const float rt_b[4] = {0.1f, 3.0e38f, -1.5f, 1e-40f};
static const int64_t rt_ids[3] = {-1, (int64_t)1 << 40, 7};

static int write_round_trip(const char *path) {
    vlmoe_st_writer *w = NULL;
    int64_t sa[2] = {2, 3}, sh[1] = {5}, sb[2] = {2, 2}, si[1] = {3}, se[2] = {0, 3};
    float scalar = 42.0f;
    int rc = vlmoe_st_writer_init(&w);
    if (!rc) rc = vlmoe_st_writer_meta(w, "format", "pt");
    if (!rc) rc = vlmoe_st_writer_meta(w, "note", "quote \" backslash \\ newline \n tab \t");
    if (!rc) rc = vlmoe_st_writer_add_f32(w, "image.proj", VLMOE_DT_F32, 2, sa, rt_a);
    if (!rc) rc = vlmoe_st_writer_add_f32(w, "half", VLMOE_DT_F16, 1, sh, rt_h);
    if (!rc) rc = vlmoe_st_writer_add_f32(w, "brain", VLMOE_DT_BF16, 2, sb, rt_b);
    if (!rc) rc = vlmoe_st_writer_add_raw(w, "ids", VLMOE_DT_I64, 1, si, rt_ids);
    if (!rc) rc = vlmoe_st_writer_add_f32(w, "scalar", VLMOE_DT_F32, 0, NULL, &scalar);
    if (!rc) rc = vlmoe_st_writer_add_f32(w, "empty", VLMOE_DT_F16, 2, se, NULL);
    if (!rc) rc = vlmoe_st_writer_write(w, path);
    vlmoe_st_writer_free(w);
    return rc;
}

static void test_round_trip(void) {
    char p[128], tmp[160];
    path_of(p, sizeof p, "rt.safetensors");
    int rc = write_round_trip(p);
    CHECK(rc == VLMOE_OK, "write: %s", vlmoe_last_error());
    rc = write_round_trip(p); // again, over the existing file
    CHECK(rc == VLMOE_OK, "overwrite: %s", vlmoe_last_error());
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", p, (long)getpid());
    CHECK(access(tmp, F_OK) != 0, "temporary file %s left behind", tmp);

    // The bytes: aligned header, metadata first, tensors in insertion order, exact size.
    size_t n;
    unsigned char *raw = slurp(p, &n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0 && n >= 8; i--) hlen = hlen << 8 | raw[i];
    CHECK(hlen % 8 == 0, "header length %llu not a multiple of 8", (unsigned long long)hlen);
    CHECK(n == 8 + hlen + 24 + 10 + 8 + 24 + 4, "file is %zu bytes", n);
    char *hdr = calloc(1, hlen + 1);
    if (n >= 8 + hlen) memcpy(hdr, raw + 8, hlen);
    CHECK(!strncmp(hdr, "{\"__metadata__\":{\"format\":\"pt\"", 30), "header starts %.40s", hdr);
    const char *order[] = {"\"image.proj\"", "\"half\"", "\"brain\"", "\"ids\"", "\"scalar\"",
                           "\"empty\""};
    const char *prev = hdr;
    for (int i = 0; i < 6; i++) {
        const char *at = strstr(hdr, order[i]);
        CHECK(at != NULL && at > prev, "%s out of insertion order in %s", order[i], hdr);
        if (at) prev = at;
    }
    free(hdr);
    free(raw);

    vlmoe_st *st = NULL;
    rc = vlmoe_st_open(p, &st);
    CHECK(rc == VLMOE_OK, "open: %s", vlmoe_last_error());
    if (rc) return;
    CHECK(vlmoe_st_count(st) == 6, "count %d", vlmoe_st_count(st));
    CHECK(!strcmp(vlmoe_st_path(st), p), "path");
    CHECK(vlmoe_st_metadata(st, "format") && !strcmp(vlmoe_st_metadata(st, "format"), "pt"),
          "metadata format");
    CHECK(vlmoe_st_metadata(st, "note") &&
              !strcmp(vlmoe_st_metadata(st, "note"), "quote \" backslash \\ newline \n tab \t"),
          "metadata escapes");
    CHECK(vlmoe_st_metadata(st, "absent") == NULL, "absent metadata");
    CHECK(vlmoe_st_find(st, "half") == 1 && vlmoe_st_find(st, "nope") == -1, "find");

    vlmoe_tensor_info info;
    CHECK(vlmoe_st_info(st, 0, &info) == VLMOE_OK && !strcmp(info.name, "image.proj") &&
              info.dtype == VLMOE_DT_F32 && info.ndim == 2 && info.shape[0] == 2 &&
              info.shape[1] == 3 && info.numel == 6 && info.nbytes == 24,
          "info image.proj");
    CHECK(vlmoe_st_info(st, 4, &info) == VLMOE_OK && info.ndim == 0 && info.numel == 1, "scalar");
    CHECK(vlmoe_st_info(st, 5, &info) == VLMOE_OK && info.numel == 0 && info.nbytes == 0, "empty");
    CHECK(vlmoe_st_info(st, 6, &info) == VLMOE_ERR_ARG, "index out of range");
    CHECK(vlmoe_st_info(st, 3, &info) == VLMOE_OK && info.dtype == VLMOE_DT_I64 &&
              info.nbytes == 24 && !memcmp(info.data, rt_ids, 24),
          "raw I64 bytes");

    float a[6], h[5], b[4], s;
    CHECK(vlmoe_st_read_f32(st, "image.proj", a, 6) == VLMOE_OK && !memcmp(a, rt_a, sizeof a),
          "F32 values");
    CHECK(vlmoe_st_read_f32(st, "half", h, 5) == VLMOE_OK, "read F16: %s", vlmoe_last_error());
    for (int i = 0; i < 5; i++)
        CHECK(h[i] == vlmoe_f16_to_f32(f16(rt_h[i])), "F16[%d] = %g", i, (double)h[i]);
    CHECK(isinf(h[3]) && h[1] == 65504.0f, "F16 overflow to inf, max kept");
    CHECK(vlmoe_st_read_f32(st, "brain", b, 4) == VLMOE_OK, "read BF16: %s", vlmoe_last_error());
    for (int i = 0; i < 4; i++)
        CHECK(b[i] == vlmoe_bf16_to_f32(bf16(rt_b[i])), "BF16[%d] = %g", i, (double)b[i]);
    CHECK(vlmoe_st_read_f32(st, "scalar", &s, 1) == VLMOE_OK && s == 42.0f, "scalar value");
    CHECK(vlmoe_st_read_f32(st, "empty", NULL, 0) == VLMOE_OK, "empty read");

    rc = vlmoe_st_read_f32(st, "half", h, 4);
    CHECK(rc == VLMOE_ERR_FORMAT && strstr(vlmoe_last_error(), p) &&
              strstr(vlmoe_last_error(), "'half'") && strstr(vlmoe_last_error(), "[5]") &&
              strstr(vlmoe_last_error(), "expected 4"),
          "count mismatch message: %s", vlmoe_last_error());
    rc = vlmoe_st_read_f32(st, "ids", a, 3);
    CHECK(rc != VLMOE_OK && strstr(vlmoe_last_error(), "I64"), "I64 as float: %s",
          vlmoe_last_error());
    rc = vlmoe_st_read_f32(st, "missing", a, 1);
    CHECK(rc != VLMOE_OK && strstr(vlmoe_last_error(), "'missing'"), "missing: %s",
          vlmoe_last_error());
    vlmoe_st_close(st);
}

static void test_writer_errors(void) {
    vlmoe_st_writer *w = NULL;
    int64_t s2[2] = {2, 2}, neg[1] = {-1}, s9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    int64_t huge[3] = {(int64_t)1 << 40, (int64_t)1 << 40, (int64_t)1 << 40};
    float x[4] = {1, 2, 3, 4};
    char p[128];
    CHECK(vlmoe_st_writer_init(&w) == VLMOE_OK, "init");
    CHECK(vlmoe_st_writer_add_f32(w, "x", VLMOE_DT_F32, 2, s2, x) == VLMOE_OK, "add");
    CHECK(vlmoe_st_writer_add_f32(w, "x", VLMOE_DT_F32, 2, s2, x) == VLMOE_ERR_ARG, "duplicate");
    CHECK(strstr(vlmoe_last_error(), "'x'") != NULL, "dup message: %s", vlmoe_last_error());
    CHECK(vlmoe_st_writer_add_raw(w, "__metadata__", VLMOE_DT_U8, 0, NULL, x) == VLMOE_ERR_ARG,
          "reserved name");
    CHECK(vlmoe_st_writer_add_f32(w, "i", VLMOE_DT_I64, 2, s2, x) == VLMOE_ERR_ARG, "f32 as I64");
    CHECK(vlmoe_st_writer_add_raw(w, "u", (vlmoe_dtype)42, 2, s2, x) == VLMOE_ERR_ARG, "dtype 42");
    CHECK(vlmoe_st_writer_add_f32(w, "n", VLMOE_DT_F32, 1, neg, x) == VLMOE_ERR_ARG, "neg dim");
    CHECK(vlmoe_st_writer_add_f32(w, "9", VLMOE_DT_F32, 9, s9, x) == VLMOE_ERR_ARG, "9 dims");
    CHECK(vlmoe_st_writer_add_f32(w, "-", VLMOE_DT_F32, -1, s2, x) == VLMOE_ERR_ARG, "ndim -1");
    CHECK(vlmoe_st_writer_add_f32(w, "o", VLMOE_DT_F32, 3, huge, x) == VLMOE_ERR_ARG, "overflow");
    CHECK(vlmoe_st_writer_add_f32(w, "z", VLMOE_DT_F32, 2, s2, NULL) == VLMOE_ERR_ARG, "NULL data");
    CHECK(vlmoe_st_writer_meta(w, "k", "v") == VLMOE_OK, "meta");
    CHECK(vlmoe_st_writer_meta(w, "k", "w") == VLMOE_ERR_ARG, "duplicate meta key");

    const char *nodir = "/nonexistent-vlmoe-dir/w.safetensors";
    CHECK(vlmoe_st_writer_write(w, nodir) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), nodir),
          "missing folder: %s", vlmoe_last_error());
    // Renaming over a folder fails after the data is written: the temporary must go away.
    char tmp[160];
    path_of(p, sizeof p, "subdir");
    mkdir(p, 0700);
    CHECK(vlmoe_st_writer_write(w, p) == VLMOE_ERR_IO && strstr(vlmoe_last_error(), p),
          "rename over a folder: %s", vlmoe_last_error());
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", p, (long)getpid());
    CHECK(access(tmp, F_OK) != 0, "temporary %s left after a failed write", tmp);
    rmdir(p);
    vlmoe_st_writer_free(w);
    vlmoe_st_writer_free(NULL);
    vlmoe_st_close(NULL);
    CHECK(vlmoe_st_count(NULL) == 0 && vlmoe_st_find(NULL, "x") == -1, "NULL handle");
}

// A file as another writer lays it out: metadata last, no padding, so the data area starts at
// an odd offset and every read has to be unaligned.
static void test_handmade(void) {
    const char *hdr = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"b\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[8,16]},"
                      "\"c\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[16,20]},"
                      "\"d\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[20,24]},"
                      "\"__metadata__\":{\"k\":\"v\"}}";
    char h[512];
    snprintf(h, sizeof h, "%s%s", hdr, strlen(hdr) % 2 ? "" : " ");
    static const unsigned char data[24] = {
        0x00, 0x00, 0xc0, 0x3f, 0x00, 0x00, 0x40, 0xc0,             // a: 1.5, -3.0
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xd0, 0x3f,             // b: 0.25
        0x80, 0x3f, 0x00, 0xc0,                                     // c: 1.0, -2.0
        0x00, 0x3c, 0xff, 0x7b,                                     // d: 1.0, 65504
    };
    size_t hl = strlen(h), n = 8 + hl + sizeof data;
    unsigned char *file = malloc(n);
    for (int i = 0; i < 8; i++) file[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(file + 8, h, hl);
    memcpy(file + 8 + hl, data, sizeof data);
    char p[128];
    path_of(p, sizeof p, "hand.safetensors");
    write_bytes(p, file, n);
    free(file);

    vlmoe_st *st = NULL;
    int rc = vlmoe_st_open(p, &st);
    CHECK(rc == VLMOE_OK, "hand-made file: %s", vlmoe_last_error());
    if (rc) return;
    float a[2], b, c[2], d[2];
    CHECK(vlmoe_st_read_f32(st, "a", a, 2) == 0 && a[0] == 1.5f && a[1] == -3.0f, "a");
    CHECK(vlmoe_st_read_f32(st, "b", &b, 1) == 0 && b == 0.25f, "b (F64 scalar)");
    CHECK(vlmoe_st_read_f32(st, "c", c, 2) == 0 && c[0] == 1.0f && c[1] == -2.0f, "c (BF16)");
    CHECK(vlmoe_st_read_f32(st, "d", d, 2) == 0 && d[0] == 1.0f && d[1] == 65504.0f, "d (F16)");
    CHECK(vlmoe_st_metadata(st, "k") && !strcmp(vlmoe_st_metadata(st, "k"), "v"), "meta k");
    CHECK(vlmoe_st_count(st) == 4 && vlmoe_st_find(st, "__metadata__") == -1, "count");
    vlmoe_st_close(st);
}

// ---------------------------------------------------------------------------------------------

#define T(dt, shape, off) "{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":" off "}"

static void test_malicious(void) {
    char p[128];
    path_of(p, sizeof p, "bad.safetensors");
    write_bytes(p, "", 0);
    expect_bad_file("empty file", p, "8-byte");
    write_bytes(p, "\x02\0\0\0\0\0\0", 7);
    expect_bad_file("7-byte file", p, "8-byte");
    expect_bad_file("missing file", "/tmp/vlmoe-no-such-file.safetensors", "cannot open");
    expect_bad_file("a folder", dir, "regular");

    const char *ok = "{\"a\":" T("F32", "[2]", "[0,8]") "}";
    make_file(p, UINT64_MAX, ok, strlen(ok), 8);
    expect_bad_file("header length 2^64-1", p, "header length");
    make_file(p, (uint64_t)1 << 40, ok, strlen(ok), 8);
    expect_bad_file("header length 2^40", p, "header length");
    make_file(p, strlen(ok) + 9, ok, strlen(ok), 8);
    expect_bad_file("header length past the file", p, "header length");
    make_file(p, 0, ok, strlen(ok), 8);
    expect_bad_file("header length 0", p, "JSON");
    {   // the 100 MB limit holds even when the file is long enough (a sparse one here)
        const uint64_t big = 120000000;
        make_file(p, big, ok, strlen(ok), 0);
        CHECK(truncate(p, (off_t)(8 + big)) == 0, "truncate");
        expect_bad_file("header over 100 MB", p, "limit");
    }

    bad_header("overlap", "{\"a\":" T("F32", "[2]", "[0,8]") ",\"b\":" T("F32", "[2]", "[4,12]")
               "}", 16, "overlap");
    bad_header("zero-size inside another", "{\"a\":" T("F32", "[2]", "[0,8]") ",\"b\":"
               T("F32", "[0]", "[4,4]") "}", 8, "overlap");
    bad_header("same span twice", "{\"a\":" T("F32", "[2]", "[0,8]") ",\"b\":"
               T("F32", "[2]", "[0,8]") "}", 8, "overlap");
    bad_header("end past data", "{\"a\":" T("F32", "[2]", "[0,8]") "}", 4, "data area");
    bad_header("begin past data", "{\"a\":" T("F32", "[0]", "[100,100]") "}", 8, "data area");
    bad_header("shape/offset mismatch", "{\"image.proj\":" T("F32", "[4,8]", "[0,100]") "}", 100,
               "span 100 bytes but shape [4, 8] x F32 needs 128");
    bad_header("overflowing shape",
               "{\"a\":" T("F32", "[4294967296,4294967296,4294967296]", "[0,8]") "}", 8,
               "overflow");
    bad_header("2^53+2 dim", "{\"a\":" T("U8", "[9007199254740994]", "[0,8]") "}", 8, "shape[0]");
    bad_header("1e999 dim", "{\"a\":" T("U8", "[1e999]", "[0,8]") "}", 8, "shape[0]");
    bad_header("negative dim", "{\"a\":" T("F32", "[-1]", "[0,8]") "}", 8, "shape[0]");
    bad_header("non-integer dim", "{\"a\":" T("F32", "[1.5]", "[0,8]") "}", 8, "shape[0]");
    bad_header("string dim", "{\"a\":" T("F32", "[\"2\"]", "[0,8]") "}", 8, "shape[0]");
    bad_header("9 dims", "{\"a\":" T("U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 8, "dims");
    bad_header("shape not an array", "{\"a\":" T("F32", "2", "[0,8]") "}", 8, "shape");
    bad_header("unknown dtype", "{\"a\":" T("F8", "[2]", "[0,2]") "}", 8, "unknown dtype");
    bad_header("lowercase dtype", "{\"a\":" T("f32", "[2]", "[0,8]") "}", 8, "unknown dtype");
    bad_header("dtype not a string", "{\"a\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}",
               8, "dtype");
    bad_header("missing dtype", "{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "dtype");
    bad_header("missing shape", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "shape");
    bad_header("missing offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets");
    bad_header("repeated dtype key", "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F16\",\"shape\":[2],"
               "\"data_offsets\":[0,8]}}", 8, "twice");
    bad_header("offsets reversed", "{\"a\":" T("U8", "[0]", "[8,0]") "}", 8, "data_offsets");
    bad_header("one offset", "{\"a\":" T("U8", "[8]", "[8]") "}", 8, "data_offsets");
    bad_header("three offsets", "{\"a\":" T("U8", "[8]", "[0,8,8]") "}", 8, "data_offsets");
    bad_header("negative offset", "{\"a\":" T("U8", "[8]", "[-8,0]") "}", 8, "data_offsets");
    bad_header("fractional offset", "{\"a\":" T("U8", "[0]", "[0.5,0.5]") "}", 8, "data_offsets");
    bad_header("string offsets", "{\"a\":" T("U8", "[8]", "[\"0\",\"8\"]") "}", 8, "data_offsets");
    bad_header("offsets an object", "{\"a\":" T("U8", "[8]", "{}") "}", 8, "data_offsets");
    bad_header("duplicate tensor", "{\"a\":" T("U8", "[4]", "[0,4]") ",\"a\":"
               T("U8", "[4]", "[4,8]") "}", 8, "'a' appears twice");
    bad_header("names equal up to NUL", "{\"a\":" T("U8", "[4]", "[0,4]") ",\"a\\u0000b\":"
               T("U8", "[4]", "[4,8]") "}", 8, "twice");
    bad_header("JSON array", "[1,2]", 8, "object");
    bad_header("JSON string", "\"hello\"", 8, "object");
    bad_header("JSON number", "12345678", 8, "object");
    bad_header("JSON null", "null", 8, "object");
    bad_header("truncated JSON", "{\"a\":{\"dtype\":\"F32\"", 8, "JSON");
    bad_header("trailing garbage", "{}      x", 8, "after the JSON");
    bad_header("two objects", "{} {}", 8, "after the JSON");
    bad_header("entry a number", "{\"a\":1}", 8, "'a'");
    bad_header("entry an array", "{\"a\":[1]}", 8, "'a'");
    bad_header("metadata non-string", "{\"__metadata__\":{\"k\":1}}", 8, "'k'");
    bad_header("metadata nested", "{\"__metadata__\":{\"k\":{}}}", 8, "'k'");
    bad_header("metadata an array", "{\"__metadata__\":[\"k\"]}", 8, "__metadata__");
    bad_header("metadata a string", "{\"__metadata__\":\"k\"}", 8, "__metadata__");
    bad_header("metadata twice", "{\"__metadata__\":{},\"__metadata__\":{}}", 8, "twice");
    bad_header("metadata key twice", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 8, "twice");
    {
        char deep[4100];
        memset(deep, '[', 4000);
        deep[4000] = 0;
        bad_header("deep nesting", deep, 8, "JSON");
    }
    {
        static const char nul[] = "{\"a\":" T("U8", "[1]", "[0,1]") "}\0   ";
        make_file(p, sizeof nul - 1, nul, sizeof nul - 1, 8);
        expect_bad_file("NUL in header padding", p, "0x00");
        static const char nul2[] = "{\"a\0\":" T("U8", "[1]", "[0,1]") "}";
        make_file(p, sizeof nul2 - 1, nul2, sizeof nul2 - 1, 8);
        expect_bad_file("NUL inside a key", p, "JSON");
    }

    // Positive controls: the checks must not reject what the format allows.
    good_header("no tensors", "{}", 0, 0);
    good_header("only metadata", "{\"__metadata__\":{}}", 0, 0);
    good_header("padding and trailing data", "{\"a\":" T("U8", "[2]", "[0,2]") "}   \n", 64, 1);
    good_header("unknown extra key", "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2],"
                "\"x\":[]}}", 2, 1);
    good_header("zero-size tensors", "{\"a\":" T("F32", "[0,3]", "[0,0]") ",\"b\":"
                T("F32", "[0]", "[0,0]") ",\"c\":" T("U8", "[1]", "[0,1]") "}", 1, 3);
    good_header("zero dim beside huge ones", "{\"a\":"
                T("F64", "[9007199254740992,9007199254740992,0]", "[0,0]") "}", 0, 1);
    good_header("out of order offsets", "{\"a\":" T("U8", "[2]", "[2,4]") ",\"b\":"
                T("U8", "[2]", "[0,2]") "}", 4, 2);
    good_header("integer written as 2.0", "{\"a\":" T("U8", "[2.0]", "[0,2e0]") "}", 2, 1);
}

// Truncating the writer's exact file anywhere must fail: nothing in it is optional.
static void test_truncation(void) {
    char src[128], p[128];
    path_of(src, sizeof src, "rt.safetensors");
    path_of(p, sizeof p, "trunc.safetensors");
    size_t n;
    unsigned char *raw = slurp(src, &n);
    CHECK(raw && n > 100, "round-trip file missing");
    int bad = 0;
    for (size_t len = 0; raw && len < n; len++) {
        vlmoe_st *st = NULL;
        write_bytes(p, raw, len);
        vlmoe_clear_error();
        int rc = vlmoe_st_open(p, &st);
        if ((rc == VLMOE_OK || !strstr(vlmoe_last_error(), p)) && bad++ < 5)
            fprintf(stderr, "truncation to %zu bytes: rc %d, '%s'\n", len, rc, vlmoe_last_error());
        vlmoe_st_close(st);
    }
    CHECK(bad == 0, "%d truncations opened or failed without naming the file", bad);
    free(raw);
}

// Random single-byte corruptions of the length field and header: open or fail cleanly; when a
// corrupt file opens, every tensor must still be readable within bounds.
static void test_fuzz(void) {
    char src[128], p[128];
    path_of(src, sizeof src, "rt.safetensors");
    path_of(p, sizeof p, "fuzz.safetensors");
    size_t n;
    unsigned char *raw = slurp(src, &n), *buf = malloc(n ? n : 1);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0 && raw && n >= 8; i--) hlen = hlen << 8 | raw[i];
    vlmoe_rng r;
    vlmoe_rng_seed(&r, 2024);
    int opened = 0, bad = 0;
    for (int it = 0; raw && it < 2000; it++) {
        memcpy(buf, raw, n);
        uint32_t pos = vlmoe_rng_below(&r, (uint32_t)(8 + hlen));
        buf[pos] ^= (unsigned char)(1 + vlmoe_rng_below(&r, 255));
        write_bytes(p, buf, n);
        vlmoe_st *st = NULL;
        vlmoe_clear_error();
        if (vlmoe_st_open(p, &st) != VLMOE_OK) {
            if ((!vlmoe_last_error()[0] || !strstr(vlmoe_last_error(), p)) && bad++ < 5)
                fprintf(stderr, "fuzz %d: message '%s'\n", it, vlmoe_last_error());
            continue;
        }
        opened++;
        for (int i = 0; i < vlmoe_st_count(st); i++) {
            vlmoe_tensor_info info;
            if (vlmoe_st_info(st, i, &info) != VLMOE_OK || info.nbytes > n) {
                bad++;
                continue;
            }
            unsigned char sum = 0; // touch every byte so ASan checks the bounds
            for (size_t j = 0; j < info.nbytes; j++) sum ^= ((const unsigned char *)info.data)[j];
            sink ^= sum;
            float *f = malloc(info.numel ? info.numel * sizeof(float) : 1);
            vlmoe_st_read_f32(st, info.name, f, info.numel);
            free(f);
        }
        vlmoe_st_close(st);
    }
    CHECK(bad == 0, "%d corrupt files misbehaved", bad);
    if (getenv("VLMOE_VERBOSE")) fprintf(stderr, "fuzz: %d of 2000 corrupt files opened\n", opened);
    CHECK(opened < 2000, "every corruption opened (%d): the fuzz is not reaching the checks",
          opened);
    free(raw);
    free(buf);
}

static void remove_dir(void) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[512];
    while (d && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        CHECK(remove(p) == 0, "cannot remove %s", p);
    }
    if (d) closedir(d);
    CHECK(rmdir(dir) == 0, "cannot remove %s", dir);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/vlmoe_st_XXXXXX");
    if (!mkdtemp(dir)) {
        fprintf(stderr, "mkdtemp failed\n");
        return 1;
    }
    test_convert();
    test_round_trip();
    test_writer_errors();
    test_handmade();
    test_malicious();
    test_truncation();
    test_fuzz();
    remove_dir();
    return test_summary("test_safetensors");
}
