// fuzz_safetensors.c: libFuzzer target for the safetensors reader (src/io/safetensors.c): the
// input is the file; whatever opens is listed, looked up and read back as float32.
#include "fuzz.h"
#include "vlmoe.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file("x.safetensors", data, size);
    vlmoe_st *st = NULL;
    if (!path || vlmoe_st_open(path, &st)) return 0;
    vlmoe_st_metadata(st, "vlmoe.config");
    for (int i = 0; i < vlmoe_st_count(st); i++) {
        vlmoe_tensor_info info;
        if (vlmoe_st_info(st, i, &info) || vlmoe_st_find(st, info.name) != i) abort();   // names are unique
        if (info.nbytes > size) abort();   // data lies inside the file
        float *dst = malloc(sizeof(float) * (info.numel ? info.numel : 1));
        if (dst && info.numel <= size) vlmoe_st_read_f32(st, info.name, dst, info.numel);
        free(dst);
    }
    vlmoe_st_close(st);
    return 0;
}
