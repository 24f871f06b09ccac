// eval.c: `vlmoe eval`: a trained model on the synthetic held-out split: zero-shot
// classification (prompt-template ensembles, top-1/top-5), image<->text retrieval R@1/5/10,
// contrastive accuracy and loss in batches, a K-shot linear probe (LIMoE's 10-shot protocol:
// ridge regression on frozen image embeddings, regularisation chosen on held-out samples) and
// a routing report per MoE layer and modality. Human-readable, or --json.
#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe eval --model CHECKPOINT [options]\n\n"
    "Evaluates a model on the held-out split of the synthetic data: zero-shot top-1/top-5 over\n"
    "the 20 (colour, shape) classes with 6 prompt templates, retrieval recall@1/5/10 in both\n"
    "directions, in-batch contrastive accuracy and loss, a K-shot linear probe on the image\n"
    "embeddings and, for MoE models, the routing of one held-out batch.\n\n"
    "example:\n"
    "  vlmoe eval --model logs/run1/checkpoints/step_3000.safetensors --json";

typedef struct {
    vlmoe_model *m;
    vlmoe_synth *s;
    float *img, *ie, *te;
    int32_t *tok, *lens, *labels;
} eval_bufs;

static void bufs_free(eval_bufs *b) {
    vlmoe_model_free(b->m);
    vlmoe_synth_free(b->s);
    free(b->img), free(b->ie), free(b->te), free(b->tok), free(b->lens), free(b->labels);
}

// Image embeddings and labels of n held-out samples starting at `first`.
static int embed_images(eval_bufs *b, uint64_t first, int n, float *out, int32_t *labels) {
    const vlmoe_model_config *c = vlmoe_model_get_config(b->m);
    const int T = c->context_length, C = vlmoe_synth_num_classes(b->s);
    int st = vlmoe_synth_batch(b->s, VLMOE_SPLIT_HELDOUT, first, n, T, b->img, b->tok, b->lens);
    for (int i = 0; i < n; i++) labels[i] = (int32_t)((first + (uint64_t)i) % (uint64_t)C);
    return st ? st : vlmoe_model_encode_images(b->m, b->img, n, out);
}

// The routing report of one pass: per layer and modality, success, experts used, tokens per expert.
static void routing_text(char *buf, size_t cap, const vlmoe_moe_stats *ms, int nm) {
    size_t o = 0;
#define P(...) (o += (size_t)snprintf(buf + o, o < cap ? cap - o : 0, __VA_ARGS__))
    for (int i = 0; i < nm; i++) {
        P("  encoder %d block %d:", ms[i].encoder, ms[i].block);
        for (int mo = 0; mo < 2; mo++) {
            if (!ms[i].tokens[mo]) continue;
            P(" %s success %.3f, experts used %.2f, tokens per expert [", mo ? "| text" : "image", ms[i].success[mo],
              ms[i].experts_used[mo]);
            for (int e = 0; ms[i].accepted[mo] && e < ms[i].num_experts; e++)
                P("%s%.0f", e ? " " : "", ms[i].accepted[mo][e] * ms[i].tokens[mo]);
            P("]");
        }
        P("\n");
    }
#undef P
}

int cmd_eval(int argc, char **argv) {
    const char *model = NULL, *dataset = "synthetic";
    int n = 1000, B = 64, shots = 10, json = 0, threads = 0;
    long seed = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "a vlmoe checkpoint (step_N.safetensors)"},
        {"dataset-type", ARG_STRING, &dataset, "TYPE", "evaluation data: synthetic (its held-out split)"},
        {"samples", ARG_INT, &n, "N", "held-out samples for zero-shot and retrieval (default 1000)"},
        {"batch-size", ARG_INT, &B, "N", "batch for contrastive accuracy and the routing report (default 64)"},
        {"few-shot", ARG_INT, &shots, "K", "shots per class of the linear probe (default 10, 0 = skip)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the data (as in training) and of the few-shot draw"},
        {"json", ARG_FLAG, &json, NULL, "print one JSON object instead of text"},
        {"threads", ARG_INT, &threads, "N", "worker threads"},
    };
    int rc = args_parse("eval", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (threads > 0) omp_set_num_threads(threads);
    if (!model) return cli_error("eval", "--model is required (see vlmoe eval --help)");
    if (strcmp(dataset, "synthetic")) return cli_error("eval", "--dataset-type %s: this build evaluates on 'synthetic'", dataset);
    if (n < 2 || B < 2 || shots < 0) return cli_error("eval", "--samples and --batch-size must be >= 2, --few-shot >= 0");
    eval_bufs b;
    memset(&b, 0, sizeof(b));
    if (vlmoe_model_load(&b.m, model)) return cli_error("eval", "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(b.m);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c->image_size;
    sp.seed = (uint64_t)seed;
    if (vlmoe_synth_init(&b.s, &sp)) return bufs_free(&b), cli_error("eval", "%s", vlmoe_last_error());
    const int E = c->embed_dim, T = c->context_length, C = vlmoe_synth_num_classes(b.s);
    const int pool = shots ? 3 * shots * C : 0, nmax = n > pool ? n : pool;
    const size_t isz = (size_t)3 * c->image_size * c->image_size;
    b.img = malloc(sizeof(float) * isz * nmax);
    b.ie = malloc(sizeof(float) * (size_t)nmax * E);
    b.te = malloc(sizeof(float) * (size_t)nmax * E);
    b.tok = malloc(sizeof(int32_t) * (size_t)nmax * T);
    b.lens = malloc(sizeof(int32_t) * nmax);
    b.labels = malloc(sizeof(int32_t) * nmax);
    if (!b.img || !b.ie || !b.te || !b.tok || !b.lens || !b.labels) return bufs_free(&b), cli_error("eval", "out of memory");
    if (vlmoe_synth_vocab_size(b.s) > c->vocab_size) return bufs_free(&b), cli_error("eval", "the model's vocabulary is too small for the synthetic data");

    cJSON *out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "model", model);
    cJSON_AddNumberToObject(out, "samples", n);
    // zero-shot and retrieval on held-out samples [0, n) (class-balanced: class = index % C)
    float *ce = malloc(sizeof(float) * (size_t)C * E);
    double top1 = 0, top5 = 0, i2t[3], t2i[3], pi = 0, pt = 0;
    const int ks[3] = {1, 5, 10};
    int32_t *txt_image = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) txt_image[i] = i;
    int st = ce && txt_image ? embed_images(&b, 0, n, b.ie, b.labels) : VLMOE_ERR_NOMEM;
    if (!st) st = vlmoe_model_encode_texts(b.m, b.tok, b.lens, n, b.te);
    if (!st) st = vlmoe_synth_class_embeddings(b.m, b.s, ce);
    if (!st) {
        vlmoe_zeroshot_accuracy(b.ie, n, ce, C, E, b.labels, &top1, &top5);
        st = vlmoe_retrieval_recall(b.ie, n, b.te, n, txt_image, E, ks, 3, i2t, t2i);
        vlmoe_pair_accuracy(b.ie, b.te, n, E, B, &pi, &pt);
    }
    free(ce), free(txt_image);
    if (st) return cJSON_Delete(out), bufs_free(&b), cli_error("eval", "%s", vlmoe_last_error());
    cJSON *zs = cJSON_AddObjectToObject(out, "zeroshot");
    cJSON_AddNumberToObject(zs, "top1", top1);
    cJSON_AddNumberToObject(zs, "top5", top5);
    cJSON_AddNumberToObject(zs, "classes", C);
    cJSON *rt = cJSON_AddObjectToObject(out, "retrieval");
    for (int q = 0; q < 3; q++) {
        char k1[16], k2[16];
        snprintf(k1, sizeof(k1), "i2t_R@%d", ks[q]);
        snprintf(k2, sizeof(k2), "t2i_R@%d", ks[q]);
        cJSON_AddNumberToObject(rt, k1, i2t[q]);
        cJSON_AddNumberToObject(rt, k2, t2i[q]);
    }
    // contrastive loss and accuracy in batches of B (eval mode), the routing of the first batch
    double loss = 0, acc = 0;
    int nb = n / B;
    cJSON *routing = NULL;
    char report[8192] = "";
    for (int k = 0; k < nb && !st; k++) {
        // the held-out pairs again, seen as training sees them: both modalities in one pass
        st = vlmoe_synth_batch(b.s, VLMOE_SPLIT_HELDOUT, (uint64_t)k * B, B, T, b.img, b.tok, b.lens);
        vlmoe_batch bt = {B, b.img, b.tok, b.lens};
        vlmoe_step_stats s;
        if (st) break;
        st = vlmoe_model_evaluate(b.m, &bt, &s);
        loss += s.contrastive / nb;
        acc += 0.5 * (s.acc_i2t + s.acc_t2i) / nb;
        int nm;
        const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(b.m, &nm);
        if (k == 0 && nm) {
            routing = cli_moe_json(ms, nm, NULL);
            routing_text(report, sizeof(report), ms, nm);
        }
    }
    if (st) return cJSON_Delete(out), bufs_free(&b), cli_error("eval", "%s", vlmoe_last_error());
    cJSON *ca = cJSON_AddObjectToObject(out, "contrastive");
    cJSON_AddNumberToObject(ca, "batch_size", B);
    cJSON_AddNumberToObject(ca, "batches", nb);
    cJSON_AddNumberToObject(ca, "loss", loss);
    cJSON_AddNumberToObject(ca, "accuracy", acc);
    cJSON_AddNumberToObject(ca, "pair_i2t", pi);
    cJSON_AddNumberToObject(ca, "pair_t2i", pt);
    // K-shot linear probe: train pool and validation from held-out indices far from the test set
    double fs_acc = 0, fs_lambda = 0;
    if (shots > 0) {
        const double lambdas[] = {1e-3, 1e-2, 1e-1, 1, 10, 100, 1000};
        const uint64_t pool0 = 1000000, val0 = 2000000;
        const int nval = 5 * C;
        float *px = malloc(sizeof(float) * (size_t)pool * E), *tx = malloc(sizeof(float) * (size_t)shots * C * E);
        float *vx = malloc(sizeof(float) * (size_t)nval * E), *testx = malloc(sizeof(float) * (size_t)n * E);
        int32_t *py = malloc(sizeof(int32_t) * pool), *ty = malloc(sizeof(int32_t) * shots * C);
        int32_t *vy = malloc(sizeof(int32_t) * nval), *testy = malloc(sizeof(int32_t) * n), *idx = malloc(sizeof(int32_t) * shots * C);
        st = px && tx && vx && testx && py && ty && vy && testy && idx ? VLMOE_OK : VLMOE_ERR_NOMEM;
        if (!st) st = embed_images(&b, 0, n, testx, testy);
        if (!st) st = embed_images(&b, pool0, pool, px, py);
        if (!st) st = vlmoe_fewshot_sample(py, pool, C, shots, (uint64_t)seed, idx);
        for (int i = 0; !st && i < shots * C; i++) {
            memcpy(tx + (size_t)i * E, px + (size_t)idx[i] * E, sizeof(float) * E);
            ty[i] = py[idx[i]];
        }
        if (!st) st = embed_images(&b, val0, nval, vx, vy);
        if (!st) st = vlmoe_fewshot_ridge(tx, ty, shots * C, testx, testy, n, E, C, lambdas, 7, vx, vy, nval, &fs_acc, &fs_lambda);
        free(px), free(tx), free(vx), free(testx), free(py), free(ty), free(vy), free(testy), free(idx);
        if (st) return cJSON_Delete(out), bufs_free(&b), cli_error("eval", "few-shot: %s", vlmoe_last_error());
        cJSON *fs = cJSON_AddObjectToObject(out, "fewshot");
        cJSON_AddNumberToObject(fs, "shots", shots);
        cJSON_AddNumberToObject(fs, "accuracy", fs_acc);
        cJSON_AddNumberToObject(fs, "lambda", fs_lambda);
    }
    if (routing) cJSON_AddItemToObject(out, "routing", routing);
    if (json) {
        char *txt = cJSON_PrintUnformatted(out);
        printf("%s\n", txt);
        free(txt);
    } else {
        printf("model %s: %s, %zu parameters; %d held-out synthetic samples\n", model, c->name,
               vlmoe_model_num_floats(b.m), n);
        printf("zero-shot (%d classes, %d prompt templates): top-1 %.1f%%  top-5 %.1f%%  (chance %.1f%%)\n", C,
               vlmoe_synth_num_templates(b.s), 100 * top1, 100 * top5, 100.0 / C);
        printf("retrieval (%d pairs): image->text R@1 %.1f%%  R@5 %.1f%%  R@10 %.1f%%; text->image R@1 %.1f%%  "
               "R@5 %.1f%%  R@10 %.1f%%\n", n, 100 * i2t[0], 100 * i2t[1], 100 * i2t[2], 100 * t2i[0], 100 * t2i[1],
               100 * t2i[2]);
        printf("contrastive (batches of %d): loss %.4f, accuracy %.1f%% (chance %.1f%%)\n", B, loss, 100 * acc, 100.0 / B);
        if (shots) printf("%d-shot linear probe (ridge, lambda %g chosen on held-out samples): %.1f%%\n", shots, fs_lambda, 100 * fs_acc);
        if (report[0]) printf("routing (one held-out batch of %d pairs, eval capacity):\n%s", B, report);
    }
    cJSON_Delete(out);
    bufs_free(&b);
    return 0;
}
