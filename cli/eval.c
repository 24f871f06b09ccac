// eval.c: `vlmoe eval`: flags, the human-readable report and exit codes over src/eval/run_eval.c,
// which evaluates a trained model on the synthetic held-out split, or on the user's data:
// zero-shot classification on an image folder (prompt-template ensembles, top-1/top-5) with a
// K-shot linear probe on its features, image<->text retrieval R@1/5/10 and contrastive accuracy
// and loss on an OpenCLIP CSV or webdataset caption file, and a routing report per MoE layer and
// modality. Human-readable, or --json (sections built by src/eval/report.c). Tests:
// tests/test_cli.c, tests/test_eval_data.c.
#include <cjson/cJSON.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "caption.h"
#include "cli.h"
#include "nn/model.h"
#include "common.h"
#include "eval/run_eval.h"
#include "tokenize.h"
#include "train/run.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe eval --model CHECKPOINT [options]\n\n"
    "Without data flags, evaluates on the held-out split of the synthetic data: zero-shot top-1/top-5\n"
    "over the 20 (colour, shape) classes with 6 prompt templates, retrieval recall@1/5/10 in both\n"
    "directions, in-batch contrastive accuracy and loss, a K-shot linear probe on the image\n"
    "embeddings and, for MoE models, the routing of one held-out batch.\n\n"
    "With --zeroshot-data DIR (DIR/<class>/*.jpg|png|webp): zero-shot top-1/top-5 with a prompt\n"
    "ensemble (class names from the folder names, '_' -> ' ', or --classnames; templates from\n"
    "--templates or 8 of OpenAI CLIP's ImageNet templates; both as text, one per line, or as\n"
    "CLIP_benchmark's JSON with --zeroshot-dataset NAME) and the K-shot probe on the folder's\n"
    "images. With --val-data (OpenCLIP CSV/TSV or webdataset shards): retrieval recall@1/5/10 (rows\n"
    "holding the same image file count as one image with several captions), contrastive loss and\n"
    "accuracy in batches, and the routing of the first batch. Texts and images are read as the model\n"
    "file records (its tokenizer and normalisation); for a file that records none, --tokenizer, or\n"
    "for a vocabulary too small for BPE (< 514 ids) the synthetic data's word tokenizer. Unreadable images are skipped, counted and reported.\n"
    "Retrieval counts a caption whose text (as tokenized) repeats under several images as correct for\n"
    "each of them, and reports OpenCLIP's mean and median rank. --output FILE writes CLIP_benchmark's\n"
    "results JSON for the one task run (--zeroshot-data: zeroshot_classification, acc5 null below 6\n"
    "classes; --val-data: zeroshot_retrieval); FILE must not exist yet.\n\n"
    "examples:\n"
    "  vlmoe eval --model logs/run1/checkpoints/step_3000.safetensors --json\n"
    "  vlmoe eval --model clip.safetensors --tokenizer bpe_simple_vocab_16e6.txt.gz \\\n"
    "      --zeroshot-data imagenet/val --val-data coco_val.csv --csv-separator , --csv-img-key file\n"
    "  vlmoe eval --model clip.safetensors --zeroshot-data cifar10/test --classnames en_classnames.json \\\n"
    "      --templates en_zeroshot_classification_templates.json --zeroshot-dataset cifar10 --output cifar10.json";

typedef struct {
    vlmoe_model *m;
    const vlmoe_model_config *c;
    vlmoe_image_params ip;
    cli_text text;              // text.synth also makes the synthetic held-out split
    vlmoe_eval_params p;
    vlmoe_eval_routing routing; // of the first batch that had MoE layers
    cli_progress pr;
    cJSON *out;
    FILE *txt;                  // the human-readable report, built up while the sections run
    char *txt_buf;
    size_t txt_len;
    vlmoe_eval_zeroshot zs;     // kept for --output
    vlmoe_eval_retrieval rt;
} eval_ctx;

static void say_contrastive(eval_ctx *e, const vlmoe_eval_contrastive *c, const char *where) {
    fprintf(e->txt, "contrastive%s%s (batches of %d): loss %.4f, accuracy %.1f%% (chance %.1f%%)\n",
            where ? " on " : "", where ? where : "", c->batch_size, c->loss, 100 * c->accuracy, 100.0 / c->batch_size);
}

static void say_retrieval(eval_ctx *e, const vlmoe_eval_retrieval *r) {
    fprintf(e->txt, ": image->text R@1 %.1f%%  R@5 %.1f%%  R@10 %.1f%%; text->image R@1 %.1f%%  R@5 %.1f%%  "
            "R@10 %.1f%%\n", 100 * r->i2t[0], 100 * r->i2t[1], 100 * r->i2t[2], 100 * r->t2i[0], 100 * r->t2i[1],
            100 * r->t2i[2]);
}

static void say_fewshot(eval_ctx *e, const vlmoe_eval_fewshot *f, const char *where) {
    fprintf(e->txt, "%d-shot linear probe%s%s (ridge, lambda %g chosen on held-out %s): %.1f%%\n", f->shots,
            where ? " on " : "", where ? where : "", f->lambda, where ? "images" : "samples", 100 * f->accuracy);
}

// The routing report: per layer and modality, success, experts used, tokens per expert.
static void print_routing(const vlmoe_eval_routing *r) {
    printf("routing (%s, eval capacity):\n", r->what);
    for (int i = 0; i < r->n; i++) {
        const vlmoe_moe_stats *s = &r->stats[i];
        printf("  encoder %d block %d:", s->encoder, s->block);
        for (int mo = 0, any = 0; mo < 2; mo++) {
            if (!s->tokens[mo]) continue;
            printf(" %s%s success %.3f, experts used %.2f, tokens per expert [", any++ ? "| " : "",
                   mo ? "text" : "image", s->success[mo], s->experts_used[mo]);
            for (int x = 0; s->accepted[mo] && x < s->num_experts; x++)
                printf("%s%.0f", x ? " " : "", s->accepted[mo][x] * s->tokens[mo]);
            printf("]");
        }
        printf("\n");
    }
}

static int eval_synthetic(eval_ctx *e, int n) {
    vlmoe_eval_synth_result r;
    const int st = vlmoe_eval_synthetic(e->m, e->text.synth, n, &e->p, &r);
    if (st) return cli_error("eval", "%s", vlmoe_last_error());
    const vlmoe_eval_zeroshot *z = &r.zeroshot;
    cJSON_AddNumberToObject(e->out, "samples", n);
    cJSON_AddItemToObject(e->out, "zeroshot", vlmoe_eval_zeroshot_json(z, NULL));
    fprintf(e->txt, "zero-shot (%d classes, %d prompt templates): top-1 %.1f%%  top-5 %.1f%%  (chance %.1f%%)\n",
            z->classes, z->templates, 100 * z->top1, 100 * z->top5, 100.0 / z->classes);
    fprintf(e->txt, "retrieval (%d pairs)", n);
    say_retrieval(e, &r.retrieval);
    cJSON_AddItemToObject(e->out, "retrieval", vlmoe_eval_retrieval_json(&r.retrieval, NULL));
    cJSON *o = vlmoe_eval_contrastive_json(&r.contrastive);
    cJSON_AddNumberToObject(o, "pair_i2t", r.pair_i2t);
    cJSON_AddNumberToObject(o, "pair_t2i", r.pair_t2i);
    cJSON_AddItemToObject(e->out, "contrastive", o);
    say_contrastive(e, &r.contrastive, NULL);
    if (e->p.shots > 0) {
        cJSON_AddItemToObject(e->out, "fewshot", vlmoe_eval_fewshot_json(&r.fewshot));
        say_fewshot(e, &r.fewshot, NULL);
    }
    return 0;
}

// An image folder: zero-shot classification and the K-shot probe. routing: the folder's first
// batch may give the routing report (--val-data gives it otherwise).
static int eval_folder(eval_ctx *e, const char *dir, const char *names_path, const char *tpl_path, const char *key,
                       int routing) {
    vlmoe_image_folder f;
    if (vlmoe_image_folder_load(dir, &f)) return cli_error("eval", "--zeroshot-data: %s", vlmoe_last_error());
    char **names_v = NULL, **tpl_v = NULL;
    size_t nn = 0, ntv = 0;
    const int C = f.n_classes;
    int rc = 0;
    if (names_path && !(rc = cli_read_texts("eval", "--classnames", names_path, key, 0, &names_v, &nn)) &&
        nn != (size_t)C)
        rc = cli_error("eval", "--classnames %s has %zu names, %s has %d class folders", names_path, nn, dir, C);
    if (!rc && tpl_path) rc = cli_read_texts("eval", "--templates", tpl_path, key, 1, &tpl_v, &ntv);
    const vlmoe_eval_folder_data d = {
        .folder = &f, .name = dir,
        .classes = names_v ? (const char *const *)names_v : (const char *const *)f.class_names,
        .templates = tpl_v ? (const char *const *)tpl_v : cli_templates, .n_templates = tpl_v ? (int)ntv : CLI_NUM_TEMPLATES,
    };
    vlmoe_eval_params p = e->p;
    if (!routing) p.routing = NULL;
    vlmoe_eval_folder_result r = {0};
    const int st = rc ? 0 : vlmoe_eval_folder_zeroshot(e->m, &d, &p, &r);
    cli_progress_end(&e->pr);
    if (st && r.bad.n == f.n) cli_bad_warn("eval", &r.bad, "unreadable image", dir);   // none could be read
    if (st) rc = cli_error("eval", "--zeroshot-data %s", vlmoe_last_error());          // "DIR: why"
    if (!rc) {
        const vlmoe_eval_zeroshot *z = &r.zeroshot;
        cJSON_AddItemToObject(e->out, "zeroshot", vlmoe_eval_zeroshot_json(z, dir));
        fprintf(e->txt, "zero-shot on %s (%d classes, %d prompt templates, %d images", dir, C, z->templates, z->images);
        if (r.bad.n) fprintf(e->txt, "; %ld unreadable skipped", r.bad.n);
        fprintf(e->txt, "): top-1 %.1f%%", 100 * z->top1);
        if (C >= 6) fprintf(e->txt, "  top-5 %.1f%%", 100 * z->top5); // trivially 100% below 6 classes
        fprintf(e->txt, "  mean per-class recall %.1f%%  (chance %.1f%%)\n", 100 * z->mean_per_class_recall, 100.0 / C);
        e->zs = *z;
        cli_bad_warn("eval", &r.bad, "unreadable image", dir);
    }
    if (!rc && e->p.shots) {
        vlmoe_eval_fewshot fs;
        if (vlmoe_eval_folder_fewshot(e->m, &d, &r, &p, &fs)) {
            rc = cli_error("eval", "few-shot on %s", vlmoe_last_error());   // "DIR: why"
        } else {
            cJSON_AddItemToObject(e->out, "fewshot", vlmoe_eval_fewshot_json(&fs));
            if (fs.skipped[0]) fprintf(e->txt, "%d-shot linear probe on %s: skipped, %s\n", fs.shots, dir, fs.skipped);
            else say_fewshot(e, &fs, dir);
        }
    }
    vlmoe_eval_folder_result_free(&r);
    cli_free_lines(names_v, nn), cli_free_lines(tpl_v, ntv);
    vlmoe_image_folder_free(&f);
    return rc;
}

// Image-caption pairs: retrieval, contrastive accuracy and loss.
static int eval_pairs(eval_ctx *e, const vlmoe_dataset_params *dp) {
    vlmoe_dataset *ds = NULL;
    if (vlmoe_dataset_open(dp, &ds)) return cli_error("eval", "--val-data: %s", vlmoe_last_error());
    vlmoe_eval_pairs_result r;
    const int st = vlmoe_eval_pairs(e->m, ds, dp->path, &e->p, &r);
    cli_progress_end(&e->pr);
    const int rc = st ? cli_error("eval", "--val-data %s", vlmoe_last_error()) : 0;   // "PATH: why"
    if (!rc) {
        const vlmoe_eval_retrieval *rt = &r.retrieval;
        fprintf(e->txt, "retrieval on %s (%d images, %d captions", dp->path, rt->images, rt->captions);
        if (rt->bad_samples) fprintf(e->txt, "; %ld bad samples skipped", rt->bad_samples);
        fprintf(e->txt, ")");
        say_retrieval(e, rt);
        fprintf(e->txt, "  mean / median rank: image->text %.2f / %.0f, text->image %.2f / %.0f", rt->mean_rank[0],
                rt->median_rank[0], rt->mean_rank[1], rt->median_rank[1]);
        if (rt->duplicate_captions)
            fprintf(e->txt, "; %d caption%s repeat%s an earlier one's text (correct for each image that has it)",
                    rt->duplicate_captions, rt->duplicate_captions == 1 ? "" : "s", rt->duplicate_captions == 1 ? "s" : "");
        fprintf(e->txt, "\n");
        e->rt = *rt;
        cJSON_AddItemToObject(e->out, "retrieval", vlmoe_eval_retrieval_json(rt, dp->path));
        cJSON *o = vlmoe_eval_contrastive_json(&r.contrastive);
        cJSON_AddStringToObject(o, "data", dp->path);
        cJSON_AddItemToObject(e->out, "contrastive", o);
        say_contrastive(e, &r.contrastive, dp->path);
    }
    const vlmoe_dataset_stats *dst = vlmoe_dataset_get_stats(ds);
    if (vlmoe_dataset_stats_bad(dst)) {
        char sum[2048];
        vlmoe_dataset_stats_format(dst, sum, sizeof(sum));
        fprintf(stderr, "vlmoe eval: warning: %s: %s\n", dp->path, sum);
    }
    cli_bad_warn("eval", &r.bad, "undecodable image", dp->path);
    vlmoe_dataset_free(ds);
    return rc;
}

// --caption-data: a VL-MoE captioner's greedy captions of the distinct images, CIDEr-D against
// each image's captions (cli/caption.c, src/eval/caption_eval.c).
static int eval_captions(eval_ctx *e, const vlmoe_dataset_params *dp0, const char *path) {
    vlmoe_dataset_params dp = *dp0;
    dp.path = path;
    vlmoe_eval_captions r;
    const int rc = cli_caption_eval("eval", e->m, &dp, &e->p, &e->text, 0, &r);
    if (!rc) {
        fprintf(e->txt, "captioning on %s (%d images, %d reference captions; greedy decoding): CIDEr-D %.4f\n", path,
                r.images, r.references, r.cider);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "data", path);
        cJSON_AddNumberToObject(o, "images", r.images);
        cJSON_AddNumberToObject(o, "references", r.references);
        cJSON_AddNumberToObject(o, "cider_d", r.cider);
        cJSON_AddItemToObject(e->out, "captioning", o);
    }
    vlmoe_eval_captions_free(&r);
    return rc;
}

// --output: CLIP_benchmark's results JSON, in a file that did not exist ("wx": never overwritten).
static int write_results(const eval_ctx *e, const char *path, const char *dataset, const char *model, int zeroshot) {
    cJSON *o = vlmoe_eval_clip_benchmark_json(dataset, e->c->name, model, zeroshot ? &e->zs : NULL, zeroshot ? NULL : &e->rt);
    char *txt = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    if (!txt) return cli_error("eval", "--output %s: out of memory", path);
    FILE *f = fopen(path, "wx");
    int ok = f && fputs(txt, f) >= 0 && fputc('\n', f) != EOF;
    if (f && fclose(f)) ok = 0;
    free(txt);
    if (!ok) {
        const int rc = cli_error("eval", "--output %s: cannot write%s", path, f ? "" : " (exists, or the folder is missing)");
        if (f) remove(path);
        return rc;
    }
    return 0;
}

int cmd_eval(int argc, char **argv) {
    const char *precision = NULL, *device = NULL, *model = NULL, *dataset = NULL, *zs_dir = NULL, *classnames = NULL, *templates = NULL;
    const char *capd = NULL, *val = NULL, *tokenizer = NULL, *sep = "\t", *mean = NULL, *std = NULL, *zs_key = NULL, *output = NULL;
    vlmoe_dataset_params dp = vlmoe_dataset_default_params();
    int n = 1000, B = 64, shots = 10, json = 0, threads = 0, override = 0;
    long max_pixels = 0;
    long seed = 0, val_num = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "a vlmoe checkpoint (step_N.safetensors)"},
        {"device", ARG_STRING, &device, "cpu|cuda[:N]", "where the model runs (default cpu)"},
        {"precision", ARG_STRING, &precision, "fp32|bf16|int8|int8-attn", CLI_PRECISION_HELP},
        {"zeroshot-data", ARG_STRING, &zs_dir, "DIR", "image folder DIR/<class>/*.jpg: zero-shot and few-shot"},
        {"classnames", ARG_STRING, &classnames, "FILE", "class names in sorted folder order: one per line, or JSON (a list, "
                                                        "or CLIP_benchmark's en_classnames.json)"},
        {"templates", ARG_STRING, &templates, "FILE", "prompt templates ({} or {c}: the class): one per line, or JSON "
                                                      "(CLIP_benchmark's)"},
        {"zeroshot-dataset", ARG_STRING, &zs_key, "NAME", "the list of a CLIP_benchmark JSON file (cifar10, ...)"},
        {"val-data", ARG_STRING, &val, "FILE", "image-caption pairs (CSV/TSV or webdataset shards): retrieval"},
        {"val-num-samples", ARG_LONG, &val_num, "N", "the first N usable pairs of --val-data (default: all)"},
        {"caption-data", ARG_STRING, &capd, "FILE", "image-caption pairs (CSV/TSV or webdataset): a VL-MoE captioner's "
                                                    "greedy captions of each image, CIDEr-D against its captions"},
        {"dataset-type", ARG_STRING, &dataset, "TYPE", "of --val-data: auto (default), csv, webdataset; "
                                                       "synthetic: the built-in held-out split"},
        {"csv-img-key", ARG_STRING, &dp.img_key, "NAME", "CSV column of image paths (default filepath)"},
        {"csv-caption-key", ARG_STRING, &dp.caption_key, "NAME", "CSV column of captions (default title)"},
        {"csv-separator", ARG_STRING, &sep, "C", "CSV field separator (default tab; \\t for tab)"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &mean, "R,G,B", "normalisation mean (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &std, "R,G,B", "normalisation std (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"override-inputs", ARG_FLAG, &override, NULL, CLI_OVERRIDE_HELP},
        {"samples", ARG_INT, &n, "N", "synthetic held-out samples for zero-shot and retrieval (default 1000)"},
        {"batch-size", ARG_INT1, &B, "N", "encoding and contrastive batch (default 64)"},
        {"few-shot", ARG_INT, &shots, "K", "shots per class of the linear probe (default 10, 0 = skip)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the synthetic data (as in training) and of the few-shot draw"},
        {"json", ARG_FLAG, &json, NULL, "print one JSON object instead of text"},
        {"output", ARG_STRING, &output, "FILE", "also write CLIP_benchmark's results JSON (one task; FILE must not exist)"},
        {"threads", ARG_INT, &threads, "N", "worker threads"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    int rc = args_parse("eval", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (threads > 0) omp_set_num_threads(threads);
    cli_set_max_image_pixels(max_pixels);
    if (!model) return cli_error("eval", "--model is required (see vlmoe eval --help)");
    const int user_data = zs_dir || val || capd;
    const int synthetic = dataset ? !strcmp(dataset, "synthetic") : !user_data;
    if (dataset && !synthetic && cli_dataset_type("eval", dataset, 1, &dp.type)) return 1;
    if (synthetic && user_data)
        return cli_error("eval", "--dataset-type synthetic evaluates on the built-in data; leave it out with "
                         "--zeroshot-data or --val-data");
    if (!synthetic && !val && !capd && dataset)
        return cli_error("eval", "--dataset-type %s needs --val-data or --caption-data", dataset);
    if ((classnames || templates || zs_key) && !zs_dir)
        return cli_error("eval", "--classnames, --templates and --zeroshot-dataset need --zeroshot-data");
    if (zs_key && !cli_is_json(classnames) && !cli_is_json(templates))
        return cli_error("eval", "--zeroshot-dataset %s picks a list of a CLIP_benchmark .json file: give --classnames or "
                         "--templates FILE.json", zs_key);
    if (val_num && !val) return cli_error("eval", "--val-num-samples needs --val-data");
    if (output && !zs_dir == !val)
        return cli_error("eval", "--output %s holds one CLIP_benchmark task: give --zeroshot-data DIR "
                         "(zeroshot_classification) or --val-data FILE (zeroshot_retrieval), not %s", output,
                         zs_dir ? "both (run eval twice)" : "neither");
    if (output && !access(output, F_OK))
        return cli_error("eval", "--output %s exists: vlmoe does not overwrite it (remove it or pick another name)", output);
    if (val_num < 0) return cli_error("eval", "--val-num-samples must be >= 0 (0: all)");
    if (n < 2 || B < 2 || shots < 0)
        return cli_error("eval", "--samples and --batch-size must be >= 2, --few-shot >= 0");
    if (cli_separator("eval", sep, &dp.separator)) return 1;
    dp.path = val;

    eval_ctx e = {.p = vlmoe_eval_default_params()};
    e.p.batch_size = B, e.p.shots = shots, e.p.seed = (uint64_t)seed, e.p.ip = &e.ip;
    e.p.tokenize = cli_tokenize, e.p.tokenize_user = &e.text, e.p.routing = &e.routing;
    e.p.progress = cli_progress_cb, e.p.progress_user = &e.pr, e.p.max_pairs = val_num;
    if (vlmoe_model_load(&e.m, model)) return cli_error("eval", "%s", vlmoe_last_error());
    if ((device && model_set_device(e.m, device)) || cli_set_precision("eval", e.m, precision)) {
        vlmoe_model_free(e.m);
        return cli_error("eval", "%s", vlmoe_last_error());
    }
    e.c = vlmoe_model_get_config(e.m);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = e.c->image_size;
    sp.seed = (uint64_t)seed;
    rc = synthetic ? cli_synthetic_model("eval", e.m, model, "--val-data FILE or --zeroshot-data DIR: the data to "
                                         "evaluate on") : 0;
    if (!rc) rc = cli_model_image_params("eval", mean, std, override, e.m, model, &e.ip);
    if (!rc && vlmoe_synth_init(&e.text.synth, &sp)) rc = cli_error("eval", "%s", vlmoe_last_error());
    if (!rc) rc = cli_model_text("eval", tokenizer, override, e.m, model, user_data, &e.text);
    if (!rc && !(e.txt = open_memstream(&e.txt_buf, &e.txt_len))) rc = cli_error("eval", "out of memory");
    e.out = cJSON_CreateObject();
    cJSON_AddStringToObject(e.out, "model", model);
    if (!rc && synthetic) rc = eval_synthetic(&e, n);
    if (!rc && zs_dir) rc = eval_folder(&e, zs_dir, classnames, templates, zs_key, val == NULL);
    if (!rc && val) rc = eval_pairs(&e, &dp);
    if (!rc && capd) rc = eval_captions(&e, &dp, capd);
    if (!rc && output) rc = write_results(&e, output, zs_key ? zs_key : zs_dir ? zs_dir : val, model, zs_dir != NULL);
    if (e.txt) fclose(e.txt);
    if (!rc && json) {
        if (e.routing.n) cJSON_AddItemToObject(e.out, "routing", vlmoe_metrics_moe(e.routing.stats, e.routing.n, NULL, NULL));
        char *txt = cJSON_PrintUnformatted(e.out);
        printf("%s\n", txt);
        free(txt);
    } else if (!rc) {
        printf("model %s: %s, %zu parameters", model, e.c->name, vlmoe_model_num_floats(e.m));
        if (synthetic) printf("; %d held-out synthetic samples", n);
        printf("\n%s", e.txt_buf ? e.txt_buf : "");
        if (e.routing.n) print_routing(&e.routing);
    }
    cJSON_Delete(e.out);
    free(e.txt_buf);
    vlmoe_eval_routing_free(&e.routing);
    cli_text_free(&e.text);
    vlmoe_model_free(e.m);
    return rc;
}
