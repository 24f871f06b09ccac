// fuzz_safetensors.c: libFuzzer target for the safetensors reader (src/io/safetensors.c): the
// input is a mode byte and the file; whatever opens is listed, looked up and read back as float32.
// Files carry a CRC-32 per tensor ("vlmoe.crc32") that the reader checks after parsing the header,
// so a mutation of the data or of an offset mostly ends at the checksum and the code behind it
// (lookups, conversions) sees few of them. With an odd mode byte the target first rewrites the
// checksums of the mutated file (adding the key where it is missing), as the writer would have;
// with an even one the file goes in as it is, reaching the checksum's own errors.
#include <cjson/cJSON.h>
#include <zlib.h>

#include "fuzz.h"
#include "vlmoe.h"

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

// The CRC-32 of each tensor's data in header order, as the reader lists them ("%08x" joined by
// spaces); a tensor whose offsets do not lie in the data gets 00000000 (the reader refuses it
// before the checksum). NULL when out of memory.
static char *checksums(const cJSON *root, const uint8_t *body, size_t body_len) {
    int n = 0;
    for (const cJSON *it = root->child; it; it = it->next) n += strcmp(it->string, "__metadata__") != 0;
    char *list = malloc((size_t)n * 9 + 1);
    if (!list) return NULL;
    size_t at = 0;
    list[0] = 0;
    for (const cJSON *it = root->child; it; it = it->next) {
        if (!strcmp(it->string, "__metadata__")) continue;
        const cJSON *off = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        const cJSON *b = cJSON_GetArrayItem(off, 0), *e = cJSON_GetArrayItem(off, 1);
        uLong crc = crc32(0, Z_NULL, 0);
        if (cJSON_IsNumber(b) && cJSON_IsNumber(e) && b->valuedouble >= 0 && b->valuedouble <= e->valuedouble &&
            e->valuedouble <= (double)body_len) {
            const size_t lo = (size_t)b->valuedouble, hi = (size_t)e->valuedouble;
            crc = crc32(crc, body + lo, (uInt)(hi - lo));
        } else {
            crc = 0;
        }
        at += (size_t)snprintf(list + at, 10, "%s%08lx", at ? " " : "", crc & 0xffffffffUL);
    }
    return list;
}

// The file with its "vlmoe.crc32" rewritten to match its tensors (malloc'd, *out_n its size), or
// NULL where the header is not one JSON object to rewrite (the file then goes in unchanged).
static uint8_t *fix_checksums(const uint8_t *data, size_t size, size_t *out_n) {
    if (size < 8) return NULL;
    uint64_t h = 0;
    for (int i = 0; i < 8; i++) h |= (uint64_t)data[i] << (8 * i);
    if (h > size - 8) return NULL;
    cJSON *root = cJSON_ParseWithLength((const char *)data + 8, (size_t)h);
    uint8_t *out = NULL;
    cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
    if (cJSON_IsObject(root) && !meta) cJSON_AddItemToObject(root, "__metadata__", meta = cJSON_CreateObject());
    char *list = cJSON_IsObject(meta) ? checksums(root, data + 8 + h, size - 8 - (size_t)h) : NULL;
    if (list) {
        cJSON_DeleteItemFromObjectCaseSensitive(meta, "vlmoe.crc32");
        cJSON_AddStringToObject(meta, "vlmoe.crc32", list);
        char *text = cJSON_PrintUnformatted(root);
        const size_t t = text ? strlen(text) : 0, rest = size - 8 - (size_t)h;
        if (text && (out = malloc(8 + t + rest + 1))) {
            put_u64(out, t);
            memcpy(out + 8, text, t);
            memcpy(out + 8 + t, data + 8 + h, rest);
            *out_n = 8 + t + rest;
        }
        free(text);
    }
    free(list);
    cJSON_Delete(root);
    return out;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    size_t n = size - 1;
    uint8_t *fixed = data[0] & 1 ? fix_checksums(data + 1, size - 1, &n) : NULL;
    const char *path = fuzz_file("x.safetensors", fixed ? fixed : data + 1, fixed ? n : size - 1);
    free(fixed);
    vlmoe_st *st = NULL;
    if (!path || vlmoe_st_open(path, &st)) return 0;
    vlmoe_st_metadata(st, "vlmoe.config");
    for (int i = 0; i < vlmoe_st_count(st); i++) {
        vlmoe_tensor_info info;
        if (vlmoe_st_info(st, i, &info) || vlmoe_st_find(st, info.name) != i) abort();   // names are unique
        if (info.nbytes > n) abort();   // data lies inside the file
        float *dst = malloc(sizeof(float) * (info.numel ? info.numel : 1));
        if (dst && info.numel <= n) vlmoe_st_read_f32(st, info.name, dst, info.numel);
        free(dst);
    }
    vlmoe_st_close(st);
    return 0;
}
