// fuzz_tar.c: libFuzzer target for the webdataset shard reader (src/data/readers.c over
// libarchive): the input is one shard (tar, maybe compressed); every sample is read, then the
// reader seeks back to a position it reported and rewinds.
#include "data/readers.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file("shard.tar", data, size);
    if (!path) return 0;
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.type = VLMOE_DATASET_WEBDATASET;
    p.path = path;
    vlmoe_dataset *ds = NULL;
    if (vlmoe_dataset_open(&p, &ds)) return 0;
    vlmoe_sample s;
    vlmoe_dataset_pos first = {0, 0};
    int n = 0;
    while (vlmoe_dataset_next(ds, &s) == 1) {
        if (s.image_len == 0 || !s.caption[0] || !s.image_ext) abort();   // the reader's promises
        if (n++ == 0) first = vlmoe_dataset_position(ds);
    }
    if (vlmoe_dataset_seek(ds, first) == VLMOE_OK)
        while (vlmoe_dataset_next(ds, &s) == 1) {}
    vlmoe_dataset_rewind(ds);
    vlmoe_dataset_next(ds, &s);
    vlmoe_dataset_free(ds);
    return 0;
}
