// seeds.c: writes the small seed corpora of the fuzz targets into DIR/<target>/ (`make fuzz`
// runs it): CSV files with quoting, CRLF, a BOM and broken rows; webdataset shards (plain, gzip,
// cut short); JPEG, PNG and WebP images of several kinds; texts for the tokenizer; safetensors
// files; model configs (JSON and model-file metadata). Built with the system compiler against the encoders only, not against vlmoe.
#include <archive.h>
#include <archive_entry.h>
#include <png.h>
#include <sys/stat.h>
#include <webp/encode.h>

#include "../tests/test_jpeg.h"

static const char *out_dir;

static void put(const char *target, const char *name, const void *data, size_t n) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", out_dir, target);
    mkdir(path, 0755);
    snprintf(path, sizeof(path), "%s/%s/%s", out_dir, target, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

static void put_str(const char *target, const char *name, const char *s) { put(target, name, s, strlen(s)); }

static void csv_seeds(void) {
    // first byte: separator selector (0 ',', 1 tab, 2 ';', 3 '|'; +4: one column for path and caption)
    put_str("fuzz_csv", "plain", "\x00" "filepath,title\na.png,a cat\na.png,\"quoted, with \"\"quotes\"\"\"\n");
    put_str("fuzz_csv", "tsv", "\x01" "title\tfilepath\nmulti\nline\ta.png\n\tempty caption\n");
    put_str("fuzz_csv", "bom_crlf", "\x02" "\xEF\xBB\xBF" "filepath;title;x\r\na.png;crlf row;1\r\n\r\nmissing.png;gone;2\r\n");
    put_str("fuzz_csv", "open_quote", "\x00" "filepath,title\na.png,\"never closed\n");
    put_str("fuzz_csv", "short_rows", "\x03" "filepath|title\na.png\n|x\na.png|  \n/a.png|abs\n");
    put_str("fuzz_csv", "one_column", "\x04" "filepath\na.png\n");
}

static void tar_seed(const char *name, int gzip, int cut) {
    static const struct { const char *name, *data; } m[] = {
        {"000000.jpg", "\xff\xd8\xff\xe0 jpeg bytes"}, {"000000.txt", "a caption"},
        {"000001.png", "\x89PNG\r\n\x1a\n"}, {"000001.txt", " \n"},
        {"000002.txt", "caption without image"}, {"dir/000003.webp", "RIFF....WEBP"},
        {"dir/000003.txt", "in a folder"}, {"000004.seg.jpg", "x"}, {"000004.json", "{}"},
        {"000004.txt", "multi dot"},
    };
    struct archive *a = archive_write_new();
    archive_write_set_format_ustar(a);
    if (gzip) archive_write_add_filter_gzip(a);
    static char buf[1 << 16];
    size_t used = 0;
    archive_write_open_memory(a, buf, sizeof(buf), &used);
    for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++) {
        struct archive_entry *e = archive_entry_new();
        archive_entry_set_pathname(e, m[i].name);
        archive_entry_set_size(e, (la_int64_t)strlen(m[i].data));
        archive_entry_set_filetype(e, AE_IFREG);
        archive_entry_set_perm(e, 0644);
        archive_write_header(a, e);
        archive_write_data(a, m[i].data, strlen(m[i].data));
        archive_entry_free(e);
    }
    archive_write_close(a);
    archive_write_free(a);
    put("fuzz_tar", name, buf, cut ? used / 2 : used);
}

static void image_seeds(void) {
    enum { W = 13, H = 9 };
    uint8_t px[W * H * 4];
    for (int i = 0; i < W * H * 4; i++) px[i] = (uint8_t)(i * 37 + i / 7);
    size_t n;
    uint8_t *j = enc_jpeg(px, W, H, 3, 90, 0, &n);
    put("fuzz_image", "rgb.jpg", j, n), free(j);
    j = enc_jpeg(px, W, H, 1, 75, 1, &n);
    put("fuzz_image", "grey_progressive.jpg", j, n), free(j);
    j = enc_jpeg(px, W, H, 4, 80, 0, &n);
    put("fuzz_image", "cmyk.jpg", j, n), free(j);
    static const png_uint_32 formats[] = {PNG_FORMAT_RGB, PNG_FORMAT_RGBA, PNG_FORMAT_GRAY,
                                          PNG_FORMAT_RGB_COLORMAP, PNG_FORMAT_LINEAR_Y};
    for (size_t f = 0; f < sizeof(formats) / sizeof(formats[0]); f++) {
        png_image im;
        memset(&im, 0, sizeof(im));
        im.version = PNG_IMAGE_VERSION, im.width = W, im.height = H, im.format = formats[f];
        im.colormap_entries = formats[f] == PNG_FORMAT_RGB_COLORMAP ? 256 : 0;
        static uint8_t mem[1 << 14], cmap[256 * 4];
        for (int i = 0; i < 256 * 4; i++) cmap[i] = (uint8_t)i;
        png_alloc_size_t len = sizeof(mem);
        const void *src = px;
        uint16_t lin[W * H];
        if (formats[f] == PNG_FORMAT_LINEAR_Y) {   // 16-bit greyscale
            for (int i = 0; i < W * H; i++) lin[i] = (uint16_t)(px[i] * 257);
            src = lin;
        }
        if (png_image_write_to_memory(&im, mem, &len, 0, src, 0, formats[f] == PNG_FORMAT_RGB_COLORMAP ? cmap : NULL)) {
            char name[32];
            snprintf(name, sizeof(name), "format%zu.png", f);
            put("fuzz_image", name, mem, len);
        }
    }
    uint8_t *w;
    n = WebPEncodeRGB(px, W, H, W * 3, 70, &w);
    if (n) put("fuzz_image", "lossy.webp", w, n);
    WebPFree(w);
    n = WebPEncodeLosslessRGBA(px, W, H, W * 4, &w);
    if (n) put("fuzz_image", "lossless_alpha.webp", w, n);
    WebPFree(w);
}

static void tokenizer_seeds(void) {
    static const char *const texts[] = {
        "a photo of a cat", "<|startoftext|>Hello, World!<|endoftext|>", "don't you're we'll I'd",
        "caf\xc3\xa9 na\xc3\xafve \xc4\xb0stanbul \xe1\xba\xa0", "&amp;&lt;&gt;&quot; &#65;&#x42;&#0; &notanentity; &amplifier",
        "  tabs\tand\nnewlines\xe2\x80\x83" "em space  ", "broken \xc3 utf8 \xff\xfe \xed\xa0\x80", "12345 3.14 \xd9\xa3",
        "\xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xef\xbc\xa1\xef\xbc\xa2", "\xcd\x85 ypogegrammeni",
    };
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        char name[16];
        snprintf(name, sizeof(name), "text%zu", i);
        put_str("fuzz_tokenizer", name, texts[i]);
    }
}

// fuzz_safetensors takes a mode byte before the file: each seed goes in as it is (0) and with its
// checksums rewritten by the target (1, NAME_crc).
static void safetensors_seed(const char *name, const char *header, size_t data_len) {
    static uint8_t buf[4096];
    size_t h = strlen(header), pad = (8 - h % 8) % 8;
    for (int i = 0; i < 8; i++) buf[1 + i] = (uint8_t)((h + pad) >> (8 * i));
    memcpy(buf + 9, header, h);
    memset(buf + 9 + h, ' ', pad);
    for (size_t i = 0; i < data_len; i++) buf[9 + h + pad + i] = (uint8_t)(i * 29 + 3);
    char crc_name[64];
    snprintf(crc_name, sizeof(crc_name), "%s_crc", name);
    buf[0] = 0;
    put("fuzz_safetensors", name, buf, 9 + h + pad + data_len);
    buf[0] = 1;
    put("fuzz_safetensors", crc_name, buf, 9 + h + pad + data_len);
}

// fuzz_config: byte 0 picks the way in (even: a JSON config file, odd: a model file's metadata)
static void config_seeds(void) {
    static const char *const CFG[] = {
        "{\"base\": \"tiny\", \"embed_dim\": 32}",
        "{\"base\": \"limoe-tiny\", \"moe\": {\"capacity_factor\": 1e30, \"eval_capacity_factor\": 2}}",
        "{\"base\": \"limoe-tiny\", \"moe\": {\"preset\": \"clipup\", \"layers\": \"every_2\", \"top_k\": 2}}",
        "{\"arch\": \"two_tower\", \"image_size\": 32, \"patch_size\": 8, \"channels\": 3, \"vocab_size\": 256, "
        "\"context_length\": 16, \"embed_dim\": 64, \"encoder\": {\"width\": 64, \"layers\": 2, \"heads\": 2, "
        "\"mlp_dim\": 256}, \"text_encoder\": {\"width\": 32, \"layers\": 1, \"heads\": 2, \"mlp_dim\": 64}, "
        "\"text_moe\": {\"router\": \"soft\", \"layers\": [0], \"num_experts\": 4, \"slots_per_expert\": 1}}",
        "{\"base\": \"vlmoe-tiny\", \"vl_layers\": 1}",
    };
    char buf[1024], name[32];
    for (int i = 0; i < (int)(sizeof(CFG) / sizeof(CFG[0])); i++)
        for (int way = 0; way < 2; way++) {
            buf[0] = (char)way;
            const size_t n = strlen(CFG[i]);
            memcpy(buf + 1, CFG[i], n);
            snprintf(name, sizeof(name), "cfg%d_%s", i, way ? "meta" : "json");
            put("fuzz_config", name, buf, n + 1);
        }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    mkdir(out_dir, 0755);
    csv_seeds();
    tar_seed("plain.tar", 0, 0);
    tar_seed("gzip.tar.gz", 1, 0);
    tar_seed("cut.tar", 0, 1);
    image_seeds();
    tokenizer_seeds();
    safetensors_seed("mixed", "{\"__metadata__\":{\"vlmoe.config\":\"{}\",\"format\":\"pt\"},"
                     "\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                     "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[16,22]},"
                     "\"c\":{\"dtype\":\"F16\",\"shape\":[1,1],\"data_offsets\":[22,24]},"
                     "\"d\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[24,32]},"
                     "\"e\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[32,32]}}", 32);
    safetensors_seed("empty", "{}", 0);
    // checksums as the writer records them (wrong here: mode 0 reaches the mismatch, mode 1 fixes them)
    safetensors_seed("checked", "{\"__metadata__\":{\"vlmoe.crc32\":\"00000000 00000000\"},"
                     "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                     "\"v\":{\"dtype\":\"BF16\",\"shape\":[2,1],\"data_offsets\":[8,12]}}", 12);
    config_seeds();
    safetensors_seed("scalar", "{\"s\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", 1);
    return 0;
}
