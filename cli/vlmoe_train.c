// vlmoe_train.c: the VL-MoE commands. `vlmoe vq train` learns the k-means codebook of raw patch
// vectors that MIM predicts (VL-MoE sec. 3.1 with a k-means tokenizer in place of BEiT v2's);
// `vlmoe train --model <mome model> --codebook FILE` pretrains with the three masked-modeling
// objectives on the synthetic data: every step one third images (MIM, 40% block masks), one
// third captions (MLM, 15%) and one third image-caption pairs (VLM: 50% of the text plus MIM),
// their losses summed with the MoE auxiliary losses. The library parts are covered by
// tests/test_mome.c; these commands have no automated test yet.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "args.h"
#include "cli.h"
#include "vlmoe_train.h"

// Synthetic training images, their patches and the codebook learned over them.
int cmd_vq(int argc, char **argv) {
    const char *model = "vlmoe-tiny", *output = NULL;
    int size = 8192, images = 0, iters = 20;
    long seed = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "NAME|FILE", "model whose image and patch size the codebook serves (vlmoe-tiny)"},
        {"size", ARG_INT, &size, "K", "codebook entries = visual tokens (8192; the model's mim_vocab must match)"},
        {"images", ARG_INT, &images, "N", "synthetic training images to learn from (default: 4 patches per entry)"},
        {"iters", ARG_INT, &iters, "N", "Lloyd iterations at most (20)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the k-means++ seeding (0)"},
        {"output", ARG_STRING, &output, "FILE", "codebook file to write (safetensors), also -o"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    const char *usage = "usage: vlmoe vq train --size K -o codebook.safetensors [options]\n\n"
                        "Learns the k-means codebook of raw patch vectors whose ids MIM predicts.";
    if (argc < 3 || strcmp(argv[2], "train")) {
        if (argc >= 3 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) return args_help("vq train", specs, ns, usage), 0;
        return cli_error("vq", "expected `vlmoe vq train ...` (see vlmoe vq train --help)");
    }
    int rc = args_parse_pos("vq train", specs, ns, argc, argv, 3, usage, NULL, 0, NULL);
    if (rc) return rc == 1 ? 0 : 2;
    if (!output) return cli_error("vq train", "--output (-o) FILE is required");
    vlmoe_model_config cfg;
    if (vlmoe_config_load(model, &cfg)) return cli_error("vq train", "%s", vlmoe_last_error());
    const int g = cfg.image_size / cfg.patch_size, np = g * g, pd = cfg.channels * cfg.patch_size * cfg.patch_size;
    if (size < 2 || iters < 0) return cli_error("vq train", "--size must be >= 2 and --iters >= 0");
    if (!images) images = (4 * size + np - 1) / np;
    if ((long)images * np < size)
        return cli_error("vq train", "%d images give %d patches, fewer than --size %d", images, images * np, size);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = cfg.image_size;
    vlmoe_synth *data = NULL;
    float *img = malloc(sizeof(float) * 3 * cfg.image_size * cfg.image_size * (size_t)images);
    float *patches = malloc(sizeof(float) * (size_t)images * np * pd), *cb = malloc(sizeof(float) * (size_t)size * pd);
    double inertia = 0;
    int st = img && patches && cb ? VLMOE_OK : VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_synth_init(&data, &sp);
    if (!st) st = vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, 0, images, 2, img, NULL, NULL);
    if (!st) st = vlmoe_patchify(&cfg, img, images, patches);
    if (!st) st = vlmoe_kmeans(patches, (size_t)images * np, pd, size, iters, (uint64_t)seed, cb, &inertia);
    if (!st) st = vlmoe_codebook_save(output, cb, size, pd);
    if (!st) printf("codebook %s: %d visual tokens of %d values from %d patches of %d synthetic images; mean squared "
                    "distance to the nearest entry %.5f\n", output, size, pd, images * np, images, inertia);
    free(img), free(patches), free(cb);
    vlmoe_synth_free(data);
    return st ? cli_error("vq train", "%s", vlmoe_last_error()) : 0;
}

static const char *model_flag(int argc, char **argv) {
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) return argv[i + 1];
        if (!strncmp(argv[i], "--model=", 8)) return argv[i] + 8;
    }
    return NULL;
}

int cli_train_is_mome(int argc, char **argv) {
    const char *m = model_flag(argc, argv);
    vlmoe_model_config c;
    return m && vlmoe_config_load(m, &c) == VLMOE_OK && c.arch == VLMOE_ARCH_MOME;
}

int cmd_train_mome(int argc, char **argv) {
    const char *model = NULL, *codebook = NULL, *logs = "logs", *name = NULL;
    int batch = 48, log_every = 10;
    long steps = 300, warmup = 30, seed = 0;
    double lr = 1e-3, wd = 0.05;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "NAME|FILE", "a VL-MoE (arch mome) model, e.g. vlmoe-tiny"},
        {"codebook", ARG_STRING, &codebook, "FILE", "MIM targets: a codebook from `vlmoe vq train` (mim_vocab entries)"},
        {"batch-size", ARG_INT, &batch, "N", "samples per step, a multiple of 3: images, captions, pairs (48)"},
        {"steps", ARG_LONG, &steps, "N", "training steps (300)"},
        {"lr", ARG_DOUBLE, &lr, "X", "peak learning rate, cosine decay (1e-3)"},
        {"warmup", ARG_LONG, &warmup, "N", "linear warmup steps (30)"},
        {"wd", ARG_DOUBLE, &wd, "X", "AdamW weight decay (0.05, VL-MoE sec. 4.1)"},
        {"seed", ARG_LONG, &seed, "N", "initialisation, masks and routing noise (0)"},
        {"logs", ARG_STRING, &logs, "DIR", "log folder (logs)"},
        {"name", ARG_STRING, &name, "NAME", "run name (default: the model name)"},
        {"log-every-n-steps", ARG_INT, &log_every, "N", "print and log every N steps (10)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    const char *usage = "usage: vlmoe train --model vlmoe-tiny --codebook cb.safetensors [options]\n\n"
                        "VL-MoE pretraining on the synthetic data: MIM on images, MLM on captions, VLM on pairs.";
    int rc = args_parse("train", specs, ns, argc, argv, 2, usage);
    if (rc) return rc == 1 ? 0 : 2;
    if (!model) return cli_error("train", "--model is required");
    if (!codebook) return cli_error("train", "--codebook FILE is required: the MIM targets (make one with `vlmoe vq train`)");
    if (batch < 3 || batch % 3) return cli_error("train", "--batch-size %d: need a positive multiple of 3 (images, captions, pairs)", batch);
    if (steps < 1 || log_every < 1) return cli_error("train", "--steps and --log-every-n-steps must be >= 1");
    vlmoe_model_config cfg;
    if (vlmoe_config_load(model, &cfg)) return cli_error("train", "%s", vlmoe_last_error());
    if (cfg.arch != VLMOE_ARCH_MOME) return cli_error("train", "model '%s' is not a VL-MoE (arch mome) model", model);
    const int B = batch / 3, T = cfg.context_length, g = cfg.image_size / cfg.patch_size, np = g * g;
    const int pd = cfg.channels * cfg.patch_size * cfg.patch_size;
    float *cb = NULL;
    int K, dim;
    if (vlmoe_codebook_load(codebook, cfg.mim_vocab, pd, &cb, &K, &dim)) return cli_error("train", "%s", vlmoe_last_error());
    char dir[512], path[700];
    snprintf(dir, sizeof(dir), "%s/%s", logs, name ? name : cfg.name);
    for (char *p = dir + strlen(logs) + 1; *p; p++)
        if (*p == '/') *p = '_';
    mkdir(logs, 0755);
    mkdir(dir, 0755);
    snprintf(path, sizeof(path), "%s/checkpoints", dir);
    mkdir(path, 0755);
    vlmoe_model *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_synth *data = NULL;
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = cfg.image_size;
    sp.seed = (uint64_t)seed;
    const size_t isz = (size_t)3 * cfg.image_size * cfg.image_size;
    float *img = malloc(sizeof(float) * isz * 3 * B);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T * 3 * B), *lens = malloc(sizeof(int32_t) * 3 * B);
    int32_t *tin = malloc(sizeof(int32_t) * (size_t)T * 2 * B), *tl = malloc(sizeof(int32_t) * (size_t)T * 2 * B);
    int32_t *pl = malloc(sizeof(int32_t) * (size_t)np * 2 * B);
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.optim.beta2 = 0.999f; // VL-MoE sec. 4.1: Adam (0.9, 0.999), weight decay 0.05
    tp.optim.weight_decay = (float)wd;
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, lr, warmup, steps, 0.0, 0, 0};
    int st = img && tok && lens && tin && tl && pl ? VLMOE_OK : VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_synth_init(&data, &sp);
    if (!st) st = vlmoe_model_init(&m, &cfg, (uint64_t)seed);
    if (!st) st = vlmoe_trainer_init(&t, m, &tp);
    snprintf(path, sizeof(path), "%s/metrics.jsonl", dir);
    FILE *metrics = st ? NULL : fopen(path, "w");
    if (!st && !metrics) {
        free(cb), free(img), free(tok), free(lens), free(tin), free(tl), free(pl);
        vlmoe_trainer_free(t), vlmoe_model_free(m), vlmoe_synth_free(data);
        return cli_error("train", "%s: cannot create", path);
    }
    vlmoe_mlm_params mlm = vlmoe_mlm_default_params(&cfg), vlm = mlm;
    vlm.prob = 0.5; // VLM masks half of the text (VL-MoE sec. 3.1)
    for (long step = 0; step < steps && !st; step++) {
        // samples 3B*step ..: the first B give images, the next B captions, the last B pairs
        st = vlmoe_synth_batch(data, VLMOE_SPLIT_TRAIN, (uint64_t)step * 3 * B, 3 * B, T, img, tok, lens);
        const uint64_t ms = (uint64_t)seed * 1000003ULL + (uint64_t)step;
        if (!st) st = vlmoe_mlm_mask(&mlm, ms, tok + (size_t)B * T, lens + B, B, T, tin, tl);
        if (!st) st = vlmoe_mlm_mask(&vlm, ms ^ 0x5555ULL, tok + (size_t)2 * B * T, lens + 2 * B, B, T, tin + (size_t)B * T, tl + (size_t)B * T);
        if (!st) st = vlmoe_mim_labels(&cfg, cb, K, img, B, 0.4, ms, pl);
        if (!st) st = vlmoe_mim_labels(&cfg, cb, K, img + 2 * B * isz, B, 0.4, ms ^ 0xaaaaULL, pl + (size_t)B * np);
        if (st) break;
        const vlmoe_mome_batch parts[3] = {
            {VLMOE_ENC_IMAGE, B, img, NULL, NULL, NULL, pl, NULL},
            {VLMOE_ENC_TEXT, B, NULL, tin, lens + B, tl, NULL, NULL},
            {VLMOE_ENC_PAIR, B, img + 2 * B * isz, tin + (size_t)B * T, lens + 2 * B, tl + (size_t)B * T, pl + (size_t)B * np, NULL}};
        vlmoe_mome_stats ps[3];
        vlmoe_step_stats s;
        if ((st = vlmoe_trainer_step_mome(t, parts, 3, ps, &s))) break;
        if ((step + 1) % log_every == 0 || step + 1 == steps) {
            printf("step %ld/%ld  loss %.4f  MIM %.4f (acc %.3f)  MLM %.4f (acc %.3f)  VLM %.4f + %.4f (acc %.3f/%.3f)  "
                   "aux %.4f  lr %.2e\n", step + 1, steps, s.loss, ps[0].image, ps[0].image_acc, ps[1].text,
                   ps[1].text_acc, ps[2].text, ps[2].image, ps[2].text_acc, ps[2].image_acc, s.aux, s.lr);
            fflush(stdout);
            fprintf(metrics, "{\"step\": %ld, \"loss\": %.9g, \"mim\": %.9g, \"mlm\": %.9g, \"vlm_text\": %.9g, "
                    "\"vlm_image\": %.9g, \"aux\": %.9g, \"lr\": %.9g, \"grad_norm\": %.9g}\n", step + 1, s.loss,
                    ps[0].image, ps[1].text, ps[2].text, ps[2].image, s.aux, s.lr, s.grad_norm);
        }
    }
    if (!st) {
        snprintf(path, sizeof(path), "%s/checkpoints/step_%ld.safetensors", dir, steps);
        st = vlmoe_model_save(m, path);
        if (!st) printf("trained to step %ld; weights in %s (MIM targets: %s)\n", steps, path, codebook);
    }
    if (metrics) fclose(metrics);
    free(cb), free(img), free(tok), free(lens), free(tin), free(tl), free(pl);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    vlmoe_synth_free(data);
    return st ? cli_error("train", "%s", vlmoe_last_error()) : 0;
}
