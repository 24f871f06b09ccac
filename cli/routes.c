// routes.c: `vlmoe routes --model M --image X.jpg [--text "..."] [--png OUT.png]`: one input's
// routing for a quick look without a report: per MoE layer, the expert of every image patch (a
// grid, '.' for dropped) and of every caption word; --png draws the routing map. Covered by
// tests/test_routemap.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "cli.h"
#include "report.h"

static const char *USAGE =
    "usage: vlmoe routes --model M.safetensors --image X.jpg [--text \"a caption\"] [--png OUT.png]\n\n"
    "The routing of one input in evaluation mode (no routing noise, the eval capacity factor): for every MoE\n"
    "layer (e<encoder>.b<block>), the expert that took each image patch, row by row ('.': dropped by\n"
    "capacity), and the expert of each word of --text. --png draws the image and one panel per layer with\n"
    "each patch in its expert's colour (grey: dropped), as the report's routing maps. Without --image, the\n"
    "synthetic data's held-out sample 0 (models trained on it).\n";

int cmd_routes(int argc, char **argv) {
    const char *model = NULL, *image = NULL, *text = NULL, *png = NULL;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "a vlmoe checkpoint (.safetensors)"},
        {"image", ARG_STRING, &image, "FILE", "the image (JPEG, PNG, WebP); default: synthetic held-out sample 0"},
        {"text", ARG_STRING, &text, "TEXT", "a caption routed with the image (default: the synthetic sample's, "
                                            "none with --image)"},
        {"png", ARG_STRING, &png, "FILE", "draw the routing map into this PNG (an existing file is not replaced)"},
    };
    int rc = args_parse("routes", specs, (int)(sizeof specs / sizeof specs[0]), argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : rc;
    if (!model) return cli_error("routes", "--model is required (a vlmoe checkpoint)");
    if (png && access(png, F_OK) == 0) return cli_error("routes", "--png %s: the file exists; choose another name", png);
    vlmoe_model *m = NULL;
    if (vlmoe_model_load(&m, model)) return cli_error("routes", "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    cli_examples ex;
    report_routes r = {0};
    rc = cli_examples_load("routes", m, model, image, 1, text, &ex, NULL, 0);
    if (!rc) rc = cli_examples_route("routes", m, &ex, &r);
    if (!rc) {
        printf("%s: %d MoE layer%s with a per-token decision, %d experts; patches %dx%d ('.': dropped)\n", model,
               r.layers, r.layers == 1 ? "" : "s", r.num_experts, r.grid, r.grid);
        for (int l = 0; l < r.layers; l++) {
            printf("layer %s\n", r.layer_name[l]);
            for (int y = 0; y < r.grid; y++) {
                fputs(" ", stdout);
                for (int x = 0; x < r.grid; x++) {
                    const int e = r.patch_expert[(size_t)l * r.npatch + y * r.grid + x];
                    if (e < 0) printf(" %3s", ".");
                    else printf(" %3d", e);
                }
                fputc('\n', stdout);
            }
        }
    }
    if (!rc && ex.captions) {
        char **words = NULL;
        int nw = 0;
        int32_t *we = NULL;
        if (cli_caption_words(ex.captions[0], &ex.text, c->context_length, &r, &words, &nw, &we))
            rc = cli_error("routes", "%s", vlmoe_last_error());
        for (int l = 0; !rc && l < r.layers; l++) {
            printf("text %s:", r.layer_name[l]);
            for (int w = 0; w < nw; w++) {
                const int e = we[(size_t)l * nw + w];
                if (e < 0) printf(" %s/.", words[w]);
                else printf(" %s/%d", words[w], e);
            }
            fputc('\n', stdout);
        }
        for (int w = 0; w < nw; w++) free(words[w]);
        free(words), free(we);
    }
    if (!rc && png) {
        uint8_t *rgb = NULL;
        int w, h;
        const int cell = 4 * c->patch_size < 24 ? 24 : 4 * c->patch_size > 32 ? 32 : 4 * c->patch_size;
        if (report_map_render(&r, ex.images, ex.S, ex.mean, ex.std, (report_map_params){.cell = cell, .gap = 8}, &rgb, &w,
                              &h) ||
            report_png_write(png, rgb, w, h))
            rc = cli_error("routes", "--png: %s", vlmoe_last_error());
        else printf("wrote %s (%d x %d: the input, then layers", png, w, h);
        for (int l = 0; !rc && l < r.layers; l++) printf(" %s", r.layer_name[l]);
        if (!rc) printf(")\n");
        free(rgb);
    }
    report_routes_free(&r);
    cli_examples_free(&ex);
    vlmoe_model_free(m);
    return rc;
}
