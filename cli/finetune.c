// finetune.c: `vlmoe finetune`: fine-tunes a VL-MoE (arch mome) model with a classification or
// retrieval head (VL-MoE sec. 4.2): the data, the split, the steps and the report are the
// fine-tuning task of src/train/tasks.h run by the loop of src/train/run.h; this file reads the
// flags, prints and picks the exit code. Writes the model with its head and OUT.labels (one class
// per line, in class order). Covered by tests/test_finetune.c and, for --itm, tests/test_itm.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "common.h"
#include "train/tasks.h"

#define CMD "finetune"

static void on_step(void *u, int what, const char *line) {
    if (what == VLMOE_RUN_STEP) printf("%s\n", line);
}

static void on_read(void *u, long n) { cli_progress_show(u, n, -1); }

// Captioning's report: CIDEr-D of the greedy captions of the training or held-out images, and
// the first few held-out captions beside their references.
static int caption_report(vlmoe_model *m, const vlmoe_ft_data *d, cli_text *text, int held, const char *what) {
    const vlmoe_caption_params cp = cli_caption_params(text);
    vlmoe_ft_caption_score sc;
    char **caps = NULL;
    if (vlmoe_ft_caption_evaluate(m, d, held, &cp, cli_detokenize, text, &sc, held ? &caps : NULL))
        return cli_error(CMD, "%s", vlmoe_last_error());
    if (!sc.n) return 0;
    printf("%s CIDEr-D %.4f (%d images, greedy decoding)\n", what, sc.cider, sc.n);
    for (int i = 0; caps && i < sc.n; i++) {
        if (i < 3) printf("  caption %d: \"%s\"\n", i, caps[i]);
        free(caps[i]);
    }
    free(caps);
    return 0;
}

// The held-out report: accuracy (classification) or recall@1/5/10 (retrieval).
static int report(vlmoe_model *m, const vlmoe_ft_data *d, int held, const char *what) {
    vlmoe_ft_score sc;
    if (vlmoe_ft_evaluate(m, d, held, &sc)) return cli_error(CMD, "%s", vlmoe_last_error());
    if (!sc.n) return 0;
    vlmoe_ft_info info;
    vlmoe_ft_data_info(d, &info);
    if (!info.classes)
        printf("%s retrieval (%d pairs): image->text R@1 %.4f R@5 %.4f R@10 %.4f; text->image R@1 %.4f R@5 %.4f "
               "R@10 %.4f\n", what, sc.n, sc.i2t[0], sc.i2t[1], sc.i2t[2], sc.t2i[0], sc.t2i[1], sc.t2i[2]);
    else
        printf("%s accuracy %.4f (%d examples)\n", what, sc.accuracy, sc.n);
    return 0;
}

// The held-out retrieval report again with each query's top k candidates re-ranked by the ITM
// head (--itm-rerank k, VLMo's inference).
static int report_itm(vlmoe_model *m, const vlmoe_ft_data *d, int held, const char *what, int k) {
    vlmoe_ft_score sc;
    if (vlmoe_ft_evaluate_rerank(m, d, held, k, &sc)) return cli_error(CMD, "%s", vlmoe_last_error());
    if (sc.n)
        printf("%s retrieval, top %d re-ranked by ITM (%d pairs): image->text R@1 %.4f R@5 %.4f R@10 %.4f; "
               "text->image R@1 %.4f R@5 %.4f R@10 %.4f\n", what, k, sc.n, sc.i2t[0], sc.i2t[1], sc.i2t[2], sc.t2i[0],
               sc.t2i[1], sc.t2i[2]);
    return 0;
}

// OUT.params.json: the settings of the fine-tuning, so that a model says how it was made (whether
// its routers and experts are the pre-trained ones above all).
typedef struct {
    const char *model, *task, *data, *tokenizer;
    int steps, batch, holdout, freeze_moe;
    double lr, wd;
    long seed;
    int itm, itm_rerank;
} ft_settings;

static int write_params(const char *output, const ft_settings *s) {
    cJSON *p = cJSON_CreateObject();
    const char *key[] = {"model", "task", "data", "tokenizer"}, *val[] = {s->model, s->task, s->data, s->tokenizer};
    for (int i = 0; i < 4; i++) cJSON_AddItemToObject(p, key[i], val[i] ? cJSON_CreateString(val[i]) : cJSON_CreateNull());
    const char *nk[] = {"steps", "batch_size", "holdout", "lr", "wd", "seed"};
    const double nv[] = {s->steps, s->batch, s->holdout, s->lr, s->wd, (double)s->seed};
    for (int i = 0; i < 6; i++) cJSON_AddNumberToObject(p, nk[i], nv[i]);
    cJSON_AddBoolToObject(p, "freeze_moe", s->freeze_moe);
    cJSON_AddBoolToObject(p, "itm", s->itm);
    cJSON_AddNumberToObject(p, "itm_rerank", s->itm_rerank);
    char path[4096], *text = cJSON_Print(p);
    cJSON_Delete(p);
    snprintf(path, sizeof(path), "%s.params.json", output);
    FILE *f = text ? fopen(path, "w") : NULL;
    int bad = !f || fputs(text, f) < 0 || fputc('\n', f) < 0;
    if (f && fclose(f)) bad = 1;
    free(text);
    return bad ? cli_error(CMD, "%s: cannot write the fine-tuning settings", path) : 0;
}

int cmd_finetune(int argc, char **argv) {
    const char *model = NULL, *task = NULL, *data = NULL, *output = NULL, *tokenizer = NULL, *sep = "\t";
    const char *norm[2] = {NULL, NULL};
    int steps = 100, batch = 16, holdout = 4, freeze = 0, no_freeze = 0, log_every = 10, override = 0;
    int itm = 0, itm_rerank = 0;
    double lr = 1e-3, wd = 0.05, cmask = 0.6;
    long seed = 0, max_pixels = 0;
    vlmoe_dataset_params dp = vlmoe_dataset_default_params();
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "pretrained VL-MoE (arch mome) model (safetensors)"},
        {"task", ARG_STRING, &task, "TASK", "image-cls | text-cls | pair-cls | retrieval | caption"},
        {"data", ARG_STRING, &data, "PATH", "image-cls: a folder of class folders; text-cls: TSV text<TAB>label; "
                                            "pair-cls: TSV image<TAB>question<TAB>answer (VQA) or image1<TAB>image2"
                                            "<TAB>sentence<TAB>label (NLVR2); retrieval: OpenCLIP CSV/TSV or "
                                            "webdataset shards of image-caption pairs (also caption)"},
        {"caption-mask-prob", ARG_DOUBLE, &cmask, "P", "caption: fraction of each caption's tokens masked and "
                                                       "predicted per step (0.6, BEiT-3's captioning_mask_prob)"},
        {"output", ARG_STRING, &output, "FILE", "fine-tuned model to write (also -o); class names go to FILE.labels"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "BPE tokenizer of the model (default: the synthetic words)"},
        {"image-mean", ARG_STRING, &norm[0], "R,G,B", "normalisation mean (default CLIP's; the synthetic data's and "
                                                      "LIMoE's [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &norm[1], "R,G,B", "normalisation std (default CLIP's; [-1, 1]: 0.5)"},
        {"override-inputs", ARG_FLAG, &override, NULL, CLI_OVERRIDE_HELP},
        {"csv-img-key", ARG_STRING, &dp.img_key, "NAME", "retrieval CSV: column of image paths (filepath)"},
        {"csv-caption-key", ARG_STRING, &dp.caption_key, "NAME", "retrieval CSV: column of captions (title)"},
        {"csv-separator", ARG_STRING, &sep, "C", "retrieval CSV: field separator (tab; \\t for tab)"},
        {"steps", ARG_INT, &steps, "N", "optimizer steps (100)"},
        {"batch-size", ARG_INT1, &batch, "N", "examples per step (16, at most the training examples)"},
        {"lr", ARG_POS, &lr, "LR", "peak learning rate of the cosine schedule, 10% warmup (1e-3)"},
        {"wd", ARG_DOUBLE, &wd, "WD", "AdamW weight decay (0.05)"},
        {"holdout", ARG_INT, &holdout, "K", "every K-th example is held out for the accuracy report (4; 0 = none)"},
        {"freeze-moe", ARG_FLAG, &freeze, NULL, "keep every router and expert unchanged, as VL-MoE fine-tunes (the "
                                                "default)"},
        {"no-freeze-moe", ARG_FLAG, &no_freeze, NULL, "train the routers and experts too"},
        {"log-every", ARG_INT1, &log_every, "N", "progress line every N steps (10)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the head's initialisation and the data order (0)"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
        {"itm", ARG_FLAG, &itm, NULL, "retrieval: add image-text matching with hard negatives (VLMo, VL-MoE sec. 4.2): "
                                      "a matched/unmatched head on the fused pair, each image's negative text and "
                                      "each text's negative image drawn from the in-batch softmax of the contrastive "
                                      "similarities; loss = contrastive + ITM"},
        {"itm-rerank", ARG_INT, &itm_rerank, "K", "retrieval with --itm: also report recall with each query's top K "
                                                  "candidates re-ranked by the ITM score (VLMo/ALBEF's k_test; 0 = "
                                                  "contrastive ranking only, the default)"},
    };
    const int ns = (int)(sizeof(specs) / sizeof(specs[0]));
    const char *usage =
        "usage: vlmoe finetune --model M.safetensors --task image-cls|text-cls|pair-cls|retrieval|caption --data PATH -o OUT\n\n"
        "Fine-tunes a VL-MoE model (VL-MoE sec. 4.2). Classification: a linear head on the mean image\n"
        "feature (image-cls), the [T_CLS] feature (text-cls; MNLI-style sentence pairs are one text\n"
        "joined by the end token) or the fused [T_CLS] of an image-text pair (pair-cls, VQA as answer\n"
        "classification; with 4 columns NLVR2: both images are paired with the sentence and the head\n"
        "reads the two fused [T_CLS] features side by side). Retrieval: images and captions encoded\n"
        "separately, [I_CLS] and [T_CLS] projected to embed_dim and trained with the contrastive loss;\n"
        "held-out recall@1/5/10 is reported. Captioning (caption, BEiT-3's recipe): the same pairs, each\n"
        "image and its caption one sequence whose image tokens attend to the image and whose text tokens\n"
        "attend to the image and causally to the text; a fraction of each caption is masked and predicted\n"
        "by the MLM head; held-out CIDEr-D of greedy captions is reported before and after. Routers and\n"
        "experts stay frozen as in the paper unless --no-freeze-moe is given. The settings go to\n"
        "OUT.params.json. With --itm (VLMo's recipe, which VL-MoE follows) retrieval also trains an\n"
        "image-text matching head on 3B fused pairs per batch of B: the true pairs and, for each image\n"
        "and each text, a hard negative drawn (seeded by --seed and the step) from the softmax of its\n"
        "contrastive similarities.\n\n"
        "example:\n"
        "  vlmoe finetune --model logs/vlmoe-tiny/checkpoints/step_300.safetensors --task pair-cls \\\n"
        "      --data match.tsv --steps 200 -o match.safetensors";
    int rc = args_parse(CMD, specs, ns, argc, argv, 2, usage);
    if (rc) return rc == 1 ? 0 : 2;
    cli_set_max_image_pixels(max_pixels);
    if (freeze && no_freeze) return cli_error(CMD, "--freeze-moe and --no-freeze-moe contradict each other: give one");
    // VL-MoE sec. 4.2 fine-tunes with the routers and experts frozen: that is the default
    freeze = !no_freeze;
    if (!model || !task || !data || !output) return cli_error(CMD, "--model, --task, --data and --output (-o) are required");
    static const char *const TASKS[5] = {"image-cls", "text-cls", "pair-cls", "retrieval", "caption"};
    int tk = 0;
    while (tk < 5 && strcmp(task, TASKS[tk])) tk++;
    if (tk == 5) return cli_error(CMD, "--task %s: expected image-cls, text-cls, pair-cls, retrieval or caption", task);
    if (!(cmask > 0 && cmask <= 1)) return cli_error(CMD, "--caption-mask-prob %g: expected a fraction in (0, 1]", cmask);
    if (itm && tk != 3) return cli_error(CMD, "--itm: image-text matching is a retrieval objective: use it with --task "
                                          "retrieval, not --task %s", task);
    if (itm_rerank < 0 || (itm_rerank && !itm))
        return cli_error(CMD, "--itm-rerank %d: need K >= 0, and --itm (the model needs the ITM head)", itm_rerank);
    if (steps < 1 || batch < 1 || batch > 4096 || holdout < 0 || holdout == 1 || log_every < 1 || !(lr > 0) || !(wd >= 0))
        return cli_error(CMD, "need --steps >= 1, --batch-size in [1, 4096], --holdout 0 or >= 2, --lr > 0, --wd >= 0");
    if (cli_separator(CMD, sep, &dp.separator)) return 1;
    dp.path = data;
    // the model and, for classification, OUT.labels: neither may be an input
    char labels[1100];
    snprintf(labels, sizeof(labels), "%s.labels", output);
    const cli_input in[] = {{"--model", model}, {"--data", data}, {"--tokenizer", tokenizer}};
    if (cli_check_output(CMD, "-o", output, in, 3) || cli_check_output(CMD, "-o (its .labels file)", labels, in, 3))
        return 1;
    vlmoe_model *pre = NULL, *m = NULL;
    vlmoe_trainer *t = NULL;
    vlmoe_ft_data *d = NULL;
    vlmoe_finetune *ft = NULL;
    cli_text text = {0};
    if (vlmoe_model_load(&pre, model)) return cli_error(CMD, "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(pre);
    vlmoe_ft_data_params fp = {(vlmoe_ft_kind)tk, dp, {0}, cli_tokenize, &text, holdout, on_read, NULL};
    if (c->arch != VLMOE_ARCH_MOME) rc = cli_error(CMD, "%s: model '%s' is not a VL-MoE (arch mome) model", model, c->name);
    if (!rc && tk != VLMOE_FT_TEXT_CLS) rc = cli_model_image_params(CMD, norm[0], norm[1], override, pre, model, &fp.image);
    if (!rc) rc = cli_model_text(CMD, tokenizer, override, pre, model, 1, &text);
    if (!rc) {
        cli_progress pr = cli_progress_start("image-caption pairs");
        fp.progress_user = &pr;
        if (vlmoe_ft_data_load(&d, &fp, c)) rc = cli_error(CMD, "%s", vlmoe_last_error());
        cli_progress_end(&pr);
    }
    vlmoe_ft_info info = {0};
    if (d) vlmoe_ft_data_info(d, &info);
    if (info.bad_images) {
        cli_bad_log bad = {info.bad_images, {""}};
        snprintf(bad.first[0], sizeof(bad.first[0]), "%s", info.first_bad);
        cli_bad_warn(CMD, &bad, "images", data);
    }
    const int ret = tk == VLMOE_FT_RETRIEVAL, cap = tk == VLMOE_FT_CAPTION;
    if (!rc && (itm ? vlmoe_mome_with_itm(&m, pre, (uint64_t)seed)
                    : vlmoe_mome_with_heads(&m, pre, ret ? 0 : info.classes, info.per, ret, (uint64_t)seed)))
        rc = cli_error(CMD, "%s", vlmoe_last_error());
    const int B = batch < info.train ? batch : info.train;
    vlmoe_train_params tp = vlmoe_train_default_params();
    tp.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, lr, steps / 10, steps, 0, 0, 0};
    tp.optim.weight_decay = (float)wd;
    tp.freeze_moe = freeze;
    if (!rc && (vlmoe_finetune_init(&ft, m, d, batch, (uint64_t)seed) || vlmoe_trainer_init(&t, m, &tp) ||
                (cap && vlmoe_finetune_set_caption_mask(ft, cmask))))
        rc = cli_error(CMD, "%s", vlmoe_last_error());
    if (!rc && cap) {
        printf("finetune caption: %d training and %d held-out image-caption pairs, %.0f%% of each caption masked "
               "(BEiT-3's captioning: image attended both ways, text causally), batch %d, %d steps%s\n", info.train,
               info.held, 100 * cmask, B, steps, freeze ? ", routers and experts frozen" : "");
        rc = caption_report(m, d, &text, 1, "before fine-tuning: held-out");
    }
    if (!rc && ret)
        printf("finetune retrieval: %d training and %d held-out image-caption pairs, embed_dim %d, batch %d, %d "
               "steps%s%s\n", info.train, info.held, vlmoe_model_get_config(m)->embed_dim, B, steps,
               freeze ? ", routers and experts frozen" : "", itm ? ", contrastive + ITM with hard negatives" : "");
    else if (!rc && !cap)
        printf("finetune %s%s: %d classes, %d training and %d held-out examples, batch %d, %d steps%s\n", task,
               info.per == 2 ? " (NLVR2: two image-text pairs per example)" : "", info.classes, info.train, info.held,
               B, steps, freeze ? ", routers and experts frozen" : "");
    if (!rc) {
        const vlmoe_run_task rt = vlmoe_finetune_task(ft);
        const vlmoe_run_params rp = {NULL, steps, log_every, 0, 0, 0, 0, B, NULL, on_step, NULL, 0};
        if (vlmoe_run_train(t, &rt, &rp)) rc = cli_error(CMD, "%s", vlmoe_last_error());
    }
    if (!rc && cap) rc = caption_report(m, d, &text, 0, "train");
    if (!rc && cap) rc = caption_report(m, d, &text, 1, "held-out");
    if (!rc && !cap) rc = report(m, d, 0, "train");
    if (!rc && !cap) rc = report(m, d, 1, "held-out");
    if (!rc && itm_rerank) rc = report_itm(m, d, 1, "held-out", itm_rerank);
    if (!rc && !ret && !cap) printf("chance %.4f (%d classes)\n", 1.0 / info.classes, info.classes);
    if (!rc && (vlmoe_model_save(m, output) || (!ret && !cap && vlmoe_ft_write_labels(d, output))))
        rc = cli_error(CMD, "%s", vlmoe_last_error());
    const ft_settings fs = {model, task, data, tokenizer, steps, batch, holdout, freeze, lr, wd, seed, itm, itm_rerank};
    if (!rc) rc = write_params(output, &fs);
    if (!rc && !ret && !cap) printf("wrote %s, %s.labels and %s.params.json\n", output, output, output);
    if (!rc && (ret || cap)) printf("wrote %s and %s.params.json\n", output, output);
    vlmoe_finetune_free(ft);
    vlmoe_ft_data_free(d);
    cli_text_free(&text);
    vlmoe_trainer_free(t);
    vlmoe_model_free(m);
    vlmoe_model_free(pre);
    return rc;
}
