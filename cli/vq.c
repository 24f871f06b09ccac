// vq.c: `vlmoe vq train`: learns the k-means codebook of raw patch vectors whose ids VL-MoE's MIM
// predicts (VL-MoE sec. 3.1 with a k-means tokenizer in place of BEiT v2's), from synthetic images
// or an image folder preprocessed as `vlmoe train` preprocesses it (src/data/kmeans.c does the
// clustering). Covered by tests/test_vlmoe_train.c.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "common.h"
#include "vlmoe_train.h"

// The images under folder `dir` (all of them, or `want` spread evenly over the sorted list) through
// the eval transform: *out (*n, 3, S, S), malloc'd. Unreadable images are skipped with a warning.
static int folder_images(const char *cmd, const char *dir, const vlmoe_image_params *ip, int want, float **out, int *n) {
    struct stat sb;
    if (stat(dir, &sb) || !S_ISDIR(sb.st_mode)) return cli_error(cmd, "--image-data %s: not a folder", dir);
    char **paths;
    int np;
    if (cli_list_images(cmd, &dir, 1, &paths, &np)) return 1;
    const int take = want > 0 && want < np ? want : np;
    const size_t isz = (size_t)3 * ip->size * ip->size;
    float *img = malloc(sizeof(float) * isz * (size_t)take);
    cli_bad_log bad = {0};
    vlmoe_image im = {.max_pixels = (size_t)ip->max_pixels};
    int k = 0;
    for (int i = 0; i < take && img; i++) {
        const char *p = paths[(size_t)i * (size_t)np / (size_t)take];
        if (vlmoe_image_load(p, &im) || vlmoe_image_preprocess_eval(&im, ip, img + k * isz))
            cli_bad_add(&bad, vlmoe_last_error());
        else
            k++;
    }
    vlmoe_image_free(&im);
    vlmoe_free_strings(paths, np);
    int rc = !img ? cli_error(cmd, "out of memory for %d images", take) : !k ? cli_no_images(cmd, &bad, take) : 0;
    if (!rc) cli_bad_warn(cmd, &bad, "unreadable image", dir);
    if (rc) free(img), img = NULL;
    *out = img, *n = k;
    return rc;
}

// Synthetic training images, or those of --image-data; their patches and the codebook learned over them.
int cmd_vq(int argc, char **argv) {
    const char *model = "vlmoe-tiny", *output = NULL, *image_data = NULL, *image_mean = NULL, *image_std = NULL;
    int size = 8192, images = 0, iters = 20;
    long seed = 0, max_pixels = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "NAME|FILE", "model whose image and patch size the codebook serves (vlmoe-tiny)"},
        {"size", ARG_INT1, &size, "K", "codebook entries = visual tokens (8192; the model's mim_vocab must match)"},
        {"image-data", ARG_STRING, &image_data, "DIR", "learn from the images under DIR (recursive; default: synthetic images)"},
        {"image-mean", ARG_STRING, &image_mean, "R,G,B", "normalisation mean of --image-data (default CLIP's; as in vlmoe train)"},
        {"image-std", ARG_STRING, &image_std, "R,G,B", "normalisation std of --image-data (default CLIP's)"},
        {"images", ARG_INT1, &images, "N", "images to learn from (synthetic: default 4 patches per entry; --image-data: all)"},
        {"iters", ARG_INT1, &iters, "N", "Lloyd iterations at most (20)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the k-means++ seeding (0)"},
        {"output", ARG_STRING, &output, "FILE", "codebook file to write (safetensors), also -o"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    const char *usage = "usage: vlmoe vq train --size K -o codebook.safetensors [--image-data DIR] [options]\n\n"
                        "Learns the k-means codebook of raw patch vectors whose ids MIM predicts, from synthetic\n"
                        "images or (--image-data) the images vlmoe train will see, preprocessed the same way.";
    if (argc < 3 || strcmp(argv[2], "train")) {
        if (argc >= 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) return args_help("vq train", specs, ns, usage), 0;
        return cli_error("vq", "expected `vlmoe vq train ...` (see vlmoe vq train --help)");
    }
    int rc = args_parse_pos("vq train", specs, ns, argc, argv, 3, usage, NULL, 0, NULL);
    if (rc) return rc == 1 ? 0 : 2;
    cli_set_max_image_pixels(max_pixels);
    if (!output) return cli_error("vq train", "--output (-o) FILE is required");
    if (cli_check_output("vq train", "-o", output, &(cli_input){"--model", model}, 1)) return 1;
    vlmoe_model_config cfg;
    if (vlmoe_config_load(model, &cfg)) return cli_error("vq train", "%s", vlmoe_last_error());
    const int g = cfg.image_size / cfg.patch_size, np = g * g, pd = cfg.channels * cfg.patch_size * cfg.patch_size;
    if (size < 2 || iters < 0 || images < 0) return cli_error("vq train", "--size must be >= 2, --iters and --images >= 0");
    if ((image_mean || image_std) && !image_data) return cli_error("vq train", "--image-mean/--image-std apply to --image-data");
    float *img = NULL;
    vlmoe_synth *data = NULL;
    int st = VLMOE_OK;
    if (image_data) {
        vlmoe_image_params ip;
        if (cfg.channels != 3)
            return cli_error("vq train", "model %s has %d image channels; images are RGB", cfg.name, cfg.channels);
        if (cli_image_params("vq train", image_mean, image_std, &cfg, &ip) ||
            folder_images("vq train", image_data, &ip, images, &img, &images))
            return 1;
    } else {
        if (!images) images = (4 * size + np - 1) / np;
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = cfg.image_size;
        img = malloc(sizeof(float) * 3 * cfg.image_size * cfg.image_size * (size_t)images);
        st = img ? vlmoe_synth_init(&data, &sp) : VLMOE_ERR_NOMEM;
        if (!st) st = vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, 0, images, 2, img, NULL, NULL);
    }
    if (!st && (long)images * np < size) {
        free(img), vlmoe_synth_free(data);
        return cli_error("vq train", "%d images give %d patches, fewer than --size %d", images, images * np, size);
    }
    float *patches = malloc(sizeof(float) * (size_t)images * np * pd), *cb = malloc(sizeof(float) * (size_t)size * pd);
    double inertia = 0;
    if (!st && !(patches && cb)) st = VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_patchify(&cfg, img, images, patches);
    if (!st) st = vlmoe_kmeans(patches, (size_t)images * np, pd, size, iters, (uint64_t)seed, cb, &inertia);
    if (!st) st = vlmoe_codebook_save(output, cb, size, pd);
    if (!st) printf("codebook %s: %d visual tokens of %d values from %d patches of %d %s%s; mean squared distance to "
                    "the nearest entry %.5f\n", output, size, pd, images * np, images,
                    image_data ? "images under " : "synthetic images", image_data ? image_data : "", inertia);
    free(img), free(patches), free(cb);
    vlmoe_synth_free(data);
    return st ? cli_error("vq train", "%s", st == VLMOE_ERR_NOMEM ? "out of memory" : vlmoe_last_error()) : 0;
}
