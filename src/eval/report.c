// report.c: the JSON objects of `vlmoe eval --json` (run_eval.h): zero-shot, retrieval,
// contrastive and few-shot sections, with the fields of user data when `data` names it. Covered
// by tests/test_eval_data.c and tests/test_cli.c (through `vlmoe eval --json`).
#include <stdio.h>

#include "eval/run_eval.h"

cJSON *vlmoe_eval_zeroshot_json(const vlmoe_eval_zeroshot *z, const char *data) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "top1", z->top1);
    cJSON_AddNumberToObject(o, "top5", z->top5);
    cJSON_AddNumberToObject(o, "classes", z->classes);
    if (data) {
        cJSON_AddNumberToObject(o, "mean_per_class_recall", z->mean_per_class_recall);
        cJSON_AddNumberToObject(o, "templates", z->templates);
        cJSON_AddNumberToObject(o, "images", z->images);
        cJSON_AddNumberToObject(o, "bad_images", (double)z->bad_images);
        cJSON_AddStringToObject(o, "data", data);
    }
    return o;
}

cJSON *vlmoe_eval_retrieval_json(const vlmoe_eval_retrieval *r, const char *data) {
    cJSON *o = cJSON_CreateObject();
    for (int q = 0; q < VLMOE_EVAL_NUM_K; q++) {
        char k1[16], k2[16];
        snprintf(k1, sizeof(k1), "i2t_R@%d", vlmoe_eval_ks[q]);
        snprintf(k2, sizeof(k2), "t2i_R@%d", vlmoe_eval_ks[q]);
        cJSON_AddNumberToObject(o, k1, r->i2t[q]);
        cJSON_AddNumberToObject(o, k2, r->t2i[q]);
    }
    if (data) {
        cJSON_AddNumberToObject(o, "images", r->images);
        cJSON_AddNumberToObject(o, "captions", r->captions);
        cJSON_AddNumberToObject(o, "bad_samples", (double)r->bad_samples);
        cJSON_AddStringToObject(o, "data", data);
    }
    if (r->has_ranks) {
        cJSON_AddNumberToObject(o, "image_to_text_mean_rank", r->mean_rank[0]);
        cJSON_AddNumberToObject(o, "image_to_text_median_rank", r->median_rank[0]);
        cJSON_AddNumberToObject(o, "text_to_image_mean_rank", r->mean_rank[1]);
        cJSON_AddNumberToObject(o, "text_to_image_median_rank", r->median_rank[1]);
        cJSON_AddNumberToObject(o, "duplicate_captions", r->duplicate_captions);
    }
    return o;
}

cJSON *vlmoe_eval_clip_benchmark_json(const char *dataset, const char *model, const char *pretrained,
                                      const vlmoe_eval_zeroshot *z, const vlmoe_eval_retrieval *r) {
    cJSON *o = cJSON_CreateObject(), *m = NULL;
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "dataset", dataset);
    cJSON_AddStringToObject(o, "model", model);
    cJSON_AddStringToObject(o, "pretrained", pretrained);
    cJSON_AddStringToObject(o, "task", z ? "zeroshot_classification" : "zeroshot_retrieval");
    if (!(m = cJSON_AddObjectToObject(o, "metrics"))) return cJSON_Delete(o), NULL;
    if (z) {
        cJSON_AddNumberToObject(m, "acc1", z->top1);
        if (z->classes >= 6) cJSON_AddNumberToObject(m, "acc5", z->top5);
        else cJSON_AddNullToObject(m, "acc5"); // trivially 1 with 5 classes or fewer
        cJSON_AddNumberToObject(m, "mean_per_class_recall", z->mean_per_class_recall);
    } else {
        for (int q = 0; q < VLMOE_EVAL_NUM_K; q++) { // CLIP_benchmark: image retrieval = text queries
            char k[48];
            snprintf(k, sizeof(k), "image_retrieval_recall@%d", vlmoe_eval_ks[q]);
            cJSON_AddNumberToObject(m, k, r->t2i[q]);
            snprintf(k, sizeof(k), "text_retrieval_recall@%d", vlmoe_eval_ks[q]);
            cJSON_AddNumberToObject(m, k, r->i2t[q]);
        }
        cJSON_AddNumberToObject(m, "image_to_text_mean_rank", r->mean_rank[0]);
        cJSON_AddNumberToObject(m, "image_to_text_median_rank", r->median_rank[0]);
        cJSON_AddNumberToObject(m, "text_to_image_mean_rank", r->mean_rank[1]);
        cJSON_AddNumberToObject(m, "text_to_image_median_rank", r->median_rank[1]);
    }
    return o;
}

cJSON *vlmoe_eval_contrastive_json(const vlmoe_eval_contrastive *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "batch_size", c->batch_size);
    cJSON_AddNumberToObject(o, "batches", c->batches);
    cJSON_AddNumberToObject(o, "loss", c->loss);
    cJSON_AddNumberToObject(o, "accuracy", c->accuracy);
    return o;
}

cJSON *vlmoe_eval_fewshot_json(const vlmoe_eval_fewshot *f) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "shots", f->shots);
    if (f->skipped[0]) {
        cJSON_AddStringToObject(o, "skipped", f->skipped);
    } else {
        cJSON_AddNumberToObject(o, "accuracy", f->accuracy);
        cJSON_AddNumberToObject(o, "lambda", f->lambda);
    }
    return o;
}
