// test_routemap.c: routing maps (src/report/routemap.c, `vlmoe routes`): a hand-built limoe-tiny
// whose router sends each image patch to an expert chosen here (patch and position embeddings
// make the MoE layer's input a one-hot of the target expert; the router reads it back), with
// expert 0 over capacity so FIFO drops two of its patches; the colours of those patches are
// checked in the rendered PNG, read back with libpng, from the library and from `vlmoe routes`.
#include <png.h>
#include <unistd.h>

#include "report/report.h"
#include "test.h"
#include "vlmoe.h"

static const char *bin;
static char dir[64], out[16384];

// patch p (row-major over the 4x4 grid) -> the expert it must go to; expert 0 gets 4 patches
// and a capacity of 2 (S 16, E 8, eval cf 1.0): the first two in FIFO order are taken
static const int TARGET[16] = {0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6};
static int want(int p) { return TARGET[p] == 0 && p >= 2 ? -1 : TARGET[p]; }

static float *param(vlmoe_model *m, const char *name, size_t *n) {
    int np = 0;
    const vlmoe_param_info *pi = vlmoe_model_params(m, &np);
    for (int i = 0; i < np; i++)
        if (!strcmp(pi[i].name, name)) return *n = pi[i].numel, vlmoe_model_param_data(m) + pi[i].offset;
    CHECK(0, "no parameter %s", name);
    return NULL;
}
static void zero(vlmoe_model *m, const char *name) {
    size_t n = 0;
    float *p = param(m, name, &n);
    if (p) memset(p, 0, sizeof(float) * n);
}

static vlmoe_model *hand_built(void) {
    vlmoe_model_config c;
    CHECK(vlmoe_config_named("limoe-tiny", &c) == VLMOE_OK, "config");
    c.moe.order = VLMOE_ORDER_FIFO, c.moe.eval_capacity_factor = 1.0;
    vlmoe_model *m = NULL;
    CHECK(vlmoe_model_init(&m, &c, 7) == VLMOE_OK, "init: %s", vlmoe_last_error());
    // the residual stream reaching block 1's MoE layer is the position embedding alone
    const char *zeros[] = {"image.patch_embed.weight", "image.patch_embed.bias", "encoder.blocks.0.attn.out.weight",
                           "encoder.blocks.0.attn.out.bias", "encoder.blocks.0.mlp.fc2.weight",
                           "encoder.blocks.0.mlp.fc2.bias", "encoder.blocks.1.attn.out.weight",
                           "encoder.blocks.1.attn.out.bias", "image.pos_embed", "encoder.blocks.1.moe.router.weight",
                           "encoder.blocks.1.ln2.bias"};
    for (size_t i = 0; i < sizeof zeros / sizeof zeros[0]; i++) zero(m, zeros[i]);
    size_t n;
    float *pos = param(m, "image.pos_embed", &n), *router = param(m, "encoder.blocks.1.moe.router.weight", &n),
          *ln = param(m, "encoder.blocks.1.ln2.weight", &n);
    for (size_t i = 0; ln && i < n; i++) ln[i] = 1;
    for (int p = 0; pos && p < 16; p++) pos[p * 64 + TARGET[p]] = 4.0f; // (16, 64)
    for (int e = 0; router && e < 8; e++) router[e * 64 + e] = 5.0f;     // (8, 64)
    return m;
}

static uint8_t *read_png(const char *path, int *w, int *h) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png_create_info_struct(png);
    uint8_t *rgb = NULL;
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_read_struct(&png, &info, NULL), fclose(f), free(rgb);
        return NULL;
    }
    png_init_io(png, f);
    png_read_info(png, info);
    *w = (int)png_get_image_width(png, info), *h = (int)png_get_image_height(png, info);
    CHECK(png_get_color_type(png, info) == PNG_COLOR_TYPE_RGB && png_get_bit_depth(png, info) == 8, "%s: RGB8", path);
    rgb = malloc((size_t)*w * *h * 3);
    for (int y = 0; y < *h; y++) png_read_row(png, rgb + (size_t)y * *w * 3, NULL);
    png_destroy_read_struct(&png, &info, NULL);
    fclose(f);
    return rgb;
}

// The centre pixel of every patch of panel 1 (the MoE layer) against its expert's colour.
static void check_colours(const char *what, const char *path, int cell, int gap) {
    int w = 0, h = 0;
    uint8_t *rgb = read_png(path, &w, &h);
    CHECK(rgb && w == 2 * 4 * cell + gap && h == 4 * cell, "%s: %s is %d x %d, want %d x %d", what, path, w, h,
          2 * 4 * cell + gap, 4 * cell);
    if (!rgb || h != 4 * cell) {
        free(rgb);
        return;
    }
    int bad = 0;
    for (int p = 0; p < 16; p++) {
        const int x = 4 * cell + gap + (p % 4) * cell + cell / 2, y = (p / 4) * cell + cell / 2;
        const uint8_t *px = rgb + ((size_t)y * w + x) * 3;
        uint8_t c[3];
        report_expert_rgb(want(p), c);
        if (memcmp(px, c, 3)) {
            bad++;
            fprintf(stderr, "%s: patch %d: pixel (%d,%d) is %d,%d,%d, want expert %d's %d,%d,%d\n", what, p, x, y, px[0],
                    px[1], px[2], want(p), c[0], c[1], c[2]);
        }
    }
    CHECK(bad == 0, "%s: %d of 16 patches have the wrong colour", what, bad);
    // the palette itself: expert 0 is blue, a dropped patch grey, and the 8 experts differ
    const uint8_t *p0 = rgb + ((size_t)(cell / 2) * w + 4 * cell + gap + cell / 2) * 3;
    const uint8_t *p2 = rgb + ((size_t)(cell / 2) * w + 4 * cell + gap + 2 * cell + cell / 2) * 3;
    CHECK(p0[0] == 31 && p0[1] == 119 && p0[2] == 180, "%s: expert 0 is not blue", what);
    CHECK(p2[0] == 128 && p2[1] == 128 && p2[2] == 128, "%s: a dropped patch is not grey", what);
    free(rgb);
}

int main(int argc, char **argv) {
    uint8_t cols[9][3];
    for (int e = -1; e < 8; e++) report_expert_rgb(e, cols[e + 1]);
    int distinct = 1;
    for (int a = 0; a < 9; a++)
        for (int b = 0; b < a; b++) distinct &= memcmp(cols[a], cols[b], 3) != 0;
    CHECK(distinct, "the colours of 8 experts and of a dropped token are not all different");

    snprintf(dir, sizeof dir, "/tmp/vlmoe_routemap_XXXXXX");
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    vlmoe_model *m = hand_built();
    // an input image: its content does not matter to this router
    float img[3 * 32 * 32];
    for (int i = 0; i < 3 * 32 * 32; i++) img[i] = (float)((i * 37) % 200) / 100.0f - 1.0f;
    float emb[64];
    CHECK(vlmoe_model_plan(m, 1) == VLMOE_OK && vlmoe_model_encode_images(m, img, 1, emb) == VLMOE_OK, "encode: %s",
          vlmoe_last_error());
    report_routes r;
    CHECK(report_routes_from_model(m, 0, &r) == VLMOE_OK, "routes: %s", vlmoe_last_error());
    CHECK(r.layers == 1 && r.grid == 4 && !strcmp(r.layer_name[0], "e0.b1"), "layers %d grid %d", r.layers, r.grid);
    for (int p = 0; r.layers && p < 16; p++)
        CHECK(r.patch_expert[p] == want(p), "patch %d went to expert %d, want %d", p, r.patch_expert[p], want(p));
    const float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.5f, 0.5f, 0.5f};
    uint8_t *rgb = NULL;
    int w = 0, h = 0;
    CHECK(report_map_render(&r, img, 32, mean, std, (report_map_params){.cell = 16, .gap = 6}, &rgb, &w, &h) == VLMOE_OK,
          "render");
    CHECK(report_png_write(test_path(dir, "lib.png"), rgb, w, h) == VLMOE_OK, "png: %s", vlmoe_last_error());
    check_colours("library", test_path(dir, "lib.png"), 16, 6);
    // the input panel is the image drawn back: pixel (0,0) of channel 0 is img[0] in [0, 255]
    CHECK(abs((int)rgb[0] - (int)((img[0] * 0.5f + 0.5f) * 255 + 0.5f)) <= 1, "input panel pixel %d", rgb[0]);
    free(rgb);
    report_routes_free(&r);

    // the same through `vlmoe routes`, from a file: the model saved, the image as a PNG
    static char abs_bin[4096];
    bin = test_vlmoe_bin(argv[0], abs_bin);
    CHECK(vlmoe_model_save(m, test_path(dir, "hand.safetensors")) == VLMOE_OK, "save: %s", vlmoe_last_error());
    uint8_t file[32 * 32 * 3];
    for (int i = 0; i < 32 * 32 * 3; i++) file[i] = (uint8_t)(i * 7);
    CHECK(report_png_write(test_path(dir, "in.png"), file, 32, 32) == VLMOE_OK, "input png");
    if (bin) {
        test_expect_in(dir, bin, "routes --model hand.safetensors --image in.png --png map.png", 0, "wrote map.png", out,
                       sizeof out);
        // the printed grid: row 0 is experts 0 0 and two drops
        CHECK(strstr(out, "layer e0.b1\n    0   0   .   .\n    1   1   2   2\n    3   3   4   4\n    5   5   6   6\n") != NULL,
              "routes grid:\n%s", out);
        check_colours("vlmoe routes", test_path(dir, "map.png"), 32, 8); // patch 8 -> cell 32
        test_expect_in(dir, bin, "routes --model hand.safetensors --image in.png --png map.png", 1, "map.png: the file exists",
                       out, sizeof out);
        test_expect_in(dir, bin, "routes --image in.png", 1, "--model is required", out, sizeof out);
        test_expect_in(dir, bin, "routes --model nosuch.safetensors", 1, "nosuch.safetensors", out, sizeof out);
        test_expect_in(dir, bin, "routes --model hand.safetensors --image missing.jpg", 1, "missing.jpg", out, sizeof out);
    }
    vlmoe_model_free(m);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    return test_summary("test_routemap");
}
