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
