// fuzz_csv.c: libFuzzer target for the OpenCLIP CSV/TSV reader (src/data/readers.c): the first
// byte picks the separator, the rest is the file. Every sample is read, then the reader seeks
// back to a position it reported and rewinds. Image paths resolve next to the file, where
// "a.png" exists.
#include "data/readers.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char seps[4] = {',', '\t', ';', '|'};
    if (size < 1) return 0;
    if (!fuzz_file("a.png", (const uint8_t *)"\x89PNG\r\n\x1a\n", 8)) return 0;
    const char *path = fuzz_file("data.csv", data + 1, size - 1);
    if (!path) return 0;
    vlmoe_dataset_params p = vlmoe_dataset_default_params();
    p.type = VLMOE_DATASET_CSV;
    p.path = path;
    p.separator = seps[data[0] & 3];
    p.img_key = "filepath";
    p.caption_key = data[0] & 4 ? "filepath" : "title";   // one column for both, too
    vlmoe_dataset *ds = NULL;
    if (vlmoe_dataset_open(&p, &ds)) return 0;
    vlmoe_sample s;
    vlmoe_dataset_pos mid = {0, 0};
    int n = 0;
    while (vlmoe_dataset_next(ds, &s) == 1) {
        if (s.image_len == 0 || !s.caption[0] || strlen(s.key) == 0) abort();   // the reader's promises
        if (n++ == 1) mid = vlmoe_dataset_position(ds);
    }
    char sum[512];
    vlmoe_dataset_stats_format(vlmoe_dataset_get_stats(ds), sum, sizeof(sum));
    if (vlmoe_dataset_seek(ds, mid) == VLMOE_OK)
        while (vlmoe_dataset_next(ds, &s) == 1) {}
    vlmoe_dataset_rewind(ds);
    vlmoe_dataset_next(ds, &s);
    vlmoe_dataset_free(ds);
    return 0;
}
