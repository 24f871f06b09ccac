// prune.c: `vlmoe prune`: LIMoE's expert pruning for one-modality inference (appendix E.4).
// The experts' shares of a modality's tokens come from the run's metrics.jsonl (the mean over
// the last logged steps, as LIMoE ranks experts by what they processed during training) or, for
// from the user's images or texts run through the model (--images, --texts), or for models of the
// built-in synthetic data from its held-out split.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "prune_sweep.h"
#include "common.h"
#include "nn/model.h"
#include "tokenize.h"
#include "train/run.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe prune --model M.safetensors --modality text|image --keep N -o OUT.safetensors\n"
    "                   [--mode router_pred|router_drop] [--stats RUN/metrics.jsonl [--last N]]\n"
    "                   [--images DIR|FILE] [--texts FILE]\n"
    "       vlmoe prune --model M.safetensors --modality text|image --sweep 1,2,4 [--mode router_pred,router_drop]\n"
    "                   [--zeroshot-data DIR] [--samples N] [-o SWEEP.jsonl]\n\n"
    "Keeps, in every MoE layer serving the modality, the N experts that took the largest share of\n"
    "its tokens, for inference on that modality alone. router_pred (LIMoE's choice) keeps the\n"
    "router's softmax over all experts and only stops pruned ones from being picked; router_drop\n"
    "removes them, router rows included (a smaller file; the gates renormalise over the kept).\n"
    "Shares come from --stats (mean over the last logged steps of training), from data of the\n"
    "modality run through the model (--images: a folder or file, --modality image; --texts: one\n"
    "text per line, --modality text; read with the tokenizer and normalisation the model carries),\n"
    "or for models trained on the synthetic data from its held-out split.\n\n"
    "--sweep K1,K2,...: no model is written; instead the zero-shot accuracy of the unpruned model and of\n"
    "each pruned one (every --mode, default both, at every count kept) on the synthetic held-out split\n"
    "(--samples, default 512) or on --zeroshot-data DIR/<class>/*.jpg, one JSON line per point appended\n"
    "to -o (default: RUN/prune_sweep.jsonl for a checkpoint of a run folder, where vlmoe report plots\n"
    "zero-shot against experts kept; else MODEL.prune_sweep.jsonl). A file that is no sweep is refused.\n\n"
    "example:\n"
    "  vlmoe prune --model logs/demo/checkpoints/step_3000.safetensors --modality text --keep 4 \\\n"
    "      --stats logs/demo/metrics.jsonl -o text4.safetensors\n"
    "  vlmoe prune --model logs/demo/checkpoints/step_3000.safetensors --modality text --sweep 1,2,4,8\n\n"
    "LIMoE E.4 (Fig. 15), both modalities pruned independently and evaluated together, nothing written:\n"
    "  vlmoe prune --model M.safetensors --keep-image 1,2,4,all --keep-text 1,2,4,all --stats RUN/metrics.jsonl\n"
    "      [--zeroshot-data DIR [--classnames FILE]]\n"
    "prints zero-shot top-1 for every pair: images encoded by the model pruned for images, class\n"
    "prompts by the one pruned for texts.";

// The tower serving `mod`: its MoE config and its encoder index in the statistics.
static const vlmoe_moe_config *tower(const vlmoe_model_config *c, int mod, int *enc) {
    const int two = c->arch == VLMOE_ARCH_TWO_TOWER;
    *enc = two && mod == VLMOE_MOD_TEXT;
    return two && mod == VLMOE_MOD_TEXT ? &c->text_moe : &c->moe;
}

// Mean "accepted" shares of the last `last` records of metrics.jsonl, layer by layer.
static int usage_from_metrics(const char *path, const vlmoe_model_config *c, int mod, int last, double *u,
                              int nl, int E) {
    int enc, seen;
    tower(c, mod, &enc);
    if (vlmoe_metrics_expert_shares(path, enc, mod, last, nl, E, u, &seen)) return cli_error("prune", "%s", vlmoe_last_error());
    fprintf(stderr, "vlmoe prune: %s shares: mean of the last %d of %d logged steps in %s\n",
            mod == VLMOE_MOD_TEXT ? "text" : "image", seen < last ? seen : last, seen, path);
    return 0;
}

// Shares measured on held-out synthetic data of the modality (512 samples, eval capacity).
static int usage_from_synthetic(vlmoe_model *m, int mod, double *u, int nl, int E) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    vlmoe_synth_params sp = vlmoe_synth_default_params();
    sp.image_size = c->image_size;
    vlmoe_synth *s = NULL;
    if (vlmoe_synth_init(&s, &sp)) return cli_error("prune", "%s", vlmoe_last_error());
    if (c->vocab_size < vlmoe_synth_vocab_size(s)) {
        vlmoe_synth_free(s);
        return cli_error("prune", "model '%s' was not trained on the synthetic data: give --stats RUN/metrics.jsonl", c->name);
    }
    const int B = 64, T = c->context_length, batches = 8;
    float *img = malloc(sizeof(float) * (size_t)B * c->channels * c->image_size * c->image_size);
    float *emb = malloc(sizeof(float) * (size_t)B * c->embed_dim);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * T), *len = malloc(sizeof(int32_t) * B);
    int rc = !img || !emb || !tok || !len ? cli_error("prune", "out of memory") : 0;
    memset(u, 0, sizeof(double) * (size_t)nl * E);
    int enc;
    tower(c, mod, &enc);
    for (int b = 0; b < batches && !rc; b++) {
        int st = vlmoe_synth_batch(s, VLMOE_SPLIT_HELDOUT, (uint64_t)b * B, B, T, img, tok, len);
        if (!st) st = mod == VLMOE_MOD_TEXT ? vlmoe_model_encode_texts(m, tok, len, B, emb) : vlmoe_model_encode_images(m, img, B, emb);
        if (st) {
            rc = cli_error("prune", "%s", vlmoe_last_error());
            break;
        }
        int n, l = 0;
        const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(m, &n);
        for (int i = 0; i < n; i++)
            if (ms[i].encoder == enc && l < nl) {
                for (int e = 0; e < E; e++) u[(size_t)l * E + e] += ms[i].accepted[mod][e] / batches;
                l++;
            }
    }
    if (!rc) fprintf(stderr, "vlmoe prune: %s shares measured on %d held-out synthetic samples\n",
                     mod == VLMOE_MOD_TEXT ? "text" : "image", batches * B);
    free(img), free(emb), free(tok), free(len);
    vlmoe_synth_free(s);
    return rc;
}

// The shares of the last batch's tokens of the modality, added with weight k / total into u.
typedef struct {
    vlmoe_model *m;
    int mod, enc, nl, E;
    double *u;
    long total;
} share_sum;

static void add_shares(void *user, int k) {
    share_sum *a = user;
    int n, l = 0;
    const vlmoe_moe_stats *ms = vlmoe_model_moe_stats(a->m, &n);
    for (int i = 0; i < n; i++)
        if (ms[i].encoder == a->enc && l < a->nl) {
            for (int e = 0; e < a->E; e++) a->u[(size_t)l * a->E + e] += ms[i].accepted[a->mod][e] * k / a->total;
            l++;
        }
}

// Shares measured on the user's images (--images) or texts (--texts), at eval capacity.
static int usage_from_files(vlmoe_model *m, const char *path, const char *images, const char *texts, int mod, double *u,
                            int nl, int E) {
    if ((images && mod != VLMOE_MOD_IMAGE) || (texts && mod != VLMOE_MOD_TEXT))
        return cli_error("prune", "--%s measures %s tokens: give --modality %s", images ? "images" : "texts",
                         images ? "image" : "text", images ? "image" : "text");
    share_sum a = {m, mod, 0, nl, E, u, 0};
    tower(vlmoe_model_get_config(m), mod, &a.enc);
    memset(u, 0, sizeof(double) * (size_t)nl * E);
    const int B = 64;
    int rc = 0, n = 0, n_ok = 0;
    if (images) {
        char **files = NULL;
        vlmoe_image_params ip;
        cli_bad_log bad = {0};
        float *emb = NULL;
        rc = cli_model_image_params("prune", NULL, NULL, 0, m, path, &ip) || cli_list_images("prune", &images, 1, &files, &n);
        a.total = n;
        if (!rc && !(emb = malloc(sizeof(float) * (size_t)n * vlmoe_model_get_config(m)->embed_dim)))
            rc = cli_error("prune", "out of memory");
        const cli_encode_params ep = {&ip, B, "images", add_shares, &a};
        if (!rc && (cli_plan(m, n, B) || cli_encode_images(m, (const char *const *)files, n, &ep, emb, NULL, &bad, &n_ok)))
            rc = n_ok ? cli_error("prune", "%s", vlmoe_last_error()) : cli_no_images("prune", &bad, n);
        else if (!rc && n > 0 && !n_ok) // every image skipped: no shares to rank the experts by
            rc = cli_no_images("prune", &bad, n);
        if (!rc && n_ok < n) { // the shares were weighted by all files: renormalise to the readable ones
            for (size_t i = 0; i < (size_t)nl * E; i++) u[i] *= (double)n / n_ok;
            cli_bad_warn("prune", &bad, "unreadable image", images);
        }
        free(emb);
        vlmoe_free_strings(files, n);
        n = n_ok;
    } else {
        char **lines = NULL;
        size_t nt = 0;
        cli_text text = {0};
        const vlmoe_model_config *c = vlmoe_model_get_config(m);
        const int T = c->context_length;
        int32_t *tok = NULL, *len = NULL;
        float *emb = NULL;
        rc = cli_model_text("prune", NULL, 0, m, path, 1, &text) || cli_read_lines("prune", texts, &lines, &nt);
        if (!rc && !nt) rc = cli_error("prune", "--texts %s: no texts", texts);
        a.total = (long)nt, n = (int)nt;
        if (!rc && (!(tok = malloc(sizeof(int32_t) * (size_t)B * T)) || !(len = malloc(sizeof(int32_t) * B)) ||
                    !(emb = malloc(sizeof(float) * (size_t)B * c->embed_dim))))
            rc = cli_error("prune", "out of memory");
        if (!rc && cli_plan(m, n, B)) rc = cli_error("prune", "%s", vlmoe_last_error());
        for (int i = 0; !rc && i < n; i += B) {
            const int k = n - i < B ? n - i : B;
            for (int j = 0; j < k && !rc; j++)
                if ((len[j] = cli_tokenize(&text, lines[i + j], tok + (size_t)j * T, T)) < 0)
                    rc = cli_error("prune", "--texts %s line %d: %s", texts, i + j + 1, vlmoe_last_error());
            if (!rc && vlmoe_model_encode_texts(m, tok, len, k, emb)) rc = cli_error("prune", "%s", vlmoe_last_error());
            if (!rc) add_shares(&a, k);
        }
        free(tok), free(len), free(emb);
        cli_free_lines(lines, nt);
        cli_text_free(&text);
    }
    if (!rc) fprintf(stderr, "vlmoe prune: %s shares measured on %d %s of %s\n", mod == VLMOE_MOD_TEXT ? "text" : "image",
                     n, images ? "images" : "texts", images ? images : texts);
    return rc;
}

// ---- LIMoE E.4 / Fig. 15: image and text experts pruned independently, evaluated together ----
// Images go through the model pruned for images (ki experts per layer), the class prompts
// through the one pruned for texts (kt): zero-shot top-1 for every (ki, kt) of the two lists.
// Image embeddings depend on ki alone and class embeddings on kt alone: each is computed once.
typedef struct {
    vlmoe_synth *s;              // the synthetic held-out split, or
    vlmoe_image_folder folder;   // the user's folder (--zeroshot-data)
    char **names;                // its class names (--classnames), else the folder's
    size_t n_names;
    cli_text text;
    vlmoe_image_params ip;
    int n, C;                    // images (synthetic: samples), classes
    int32_t *labels;             // (n) synthetic classes
} zs_src;

// "1,2,4" into out (at most 16 counts, each in [1, E]); "all" is E.
static int parse_counts(const char *flag, const char *list, int E, int *out, int *n) {
    *n = 0;
    for (const char *p = list; *p;) {
        char *end;
        long v = !strncmp(p, "all", 3) ? (end = (char *)p + 3, E) : strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || v < 1 || v > E || *n == 16)
            return cli_error("prune", "--%s %s: expected up to 16 comma-separated counts in [1, %d] (or all)", flag, list, E);
        out[(*n)++] = (int)v;
        p = *end ? end + 1 : end;
    }
    return *n ? 0 : cli_error("prune", "--%s: no counts", flag);
}

// Embeddings of the zero-shot images through mi: emb (n, E); ok[i] = 0 for an unreadable file.
static int zs_images(vlmoe_model *mi, zs_src *z, float *emb, uint8_t *ok) {
    const vlmoe_model_config *c = vlmoe_model_get_config(mi);
    if (z->s) {
        const int B = 64, px = c->channels * c->image_size * c->image_size;
        float *img = malloc(sizeof(float) * (size_t)B * px);
        if (!img) return cli_error("prune", "out of memory");
        int st = 0;
        for (int i = 0; i < z->n && !st; i += B) {
            const int k = z->n - i < B ? z->n - i : B;
            for (int j = 0; j < k && !st; j++) {
                int cls;
                st = vlmoe_synth_sample(z->s, VLMOE_SPLIT_HELDOUT, (uint64_t)(i + j), img + (size_t)j * px, NULL, 0, &cls);
                z->labels[i + j] = cls;
            }
            if (!st) st = vlmoe_model_encode_images(mi, img, k, emb + (size_t)i * c->embed_dim);
        }
        free(img);
        if (z->n > 0) memset(ok, 1, (size_t)z->n);
        return st ? cli_error("prune", "%s", vlmoe_last_error()) : 0;
    }
    cli_bad_log bad = {0};
    int n_ok = 0;
    const cli_encode_params ep = {&z->ip, 64, "images", NULL, NULL};
    if (cli_plan(mi, z->n, 64) || cli_encode_images(mi, (const char *const *)z->folder.paths, z->n, &ep, emb, ok, &bad, &n_ok))
        return n_ok ? cli_error("prune", "%s", vlmoe_last_error()) : cli_no_images("prune", &bad, z->n);
    return 0;
}

static int zs_classes(vlmoe_model *mt, zs_src *z, float *cls) {
    const char *const *names = (const char *const *)(z->names ? z->names : z->folder.class_names);
    const int st = z->s ? vlmoe_synth_class_embeddings(mt, z->s, cls)
                        : vlmoe_class_embeddings(mt, names, z->C, cli_templates, CLI_NUM_TEMPLATES, cli_tokenize, &z->text, cls);
    return st ? cli_error("prune", "%s", vlmoe_last_error()) : 0;
}

// The model pruned for `mod` keeping k experts a layer (m itself when k keeps them all).
static int pruned_for(vlmoe_model *m, int mod, const double *u, int k, int E, int pm, vlmoe_model **out) {
    *out = m;
    if (k == E) return 0;
    return vlmoe_model_prune(out, m, mod, u, k, (vlmoe_prune_mode)pm) ? cli_error("prune", "%s", vlmoe_last_error()) : 0;
}

static int prune_pair(vlmoe_model *m, const char *path, const double *ui, const double *ut, int E, int pm,
                      const char *keep_image, const char *keep_text, zs_src *z) {
    int ki[16], kt[16], ni, nt;
    if (parse_counts("keep-image", keep_image, E, ki, &ni) || parse_counts("keep-text", keep_text, E, kt, &nt)) return 1;
    const int D = vlmoe_model_get_config(m)->embed_dim, C = z->C, n = z->n;
    float *img = malloc(sizeof(float) * (size_t)ni * n * D), *cls = malloc(sizeof(float) * (size_t)nt * C * D);
    uint8_t *ok = malloc((size_t)n + 1);
    int rc = !img || !cls || !ok ? cli_error("prune", "out of memory") : 0;
    for (int a = 0; a < ni && !rc; a++) {
        vlmoe_model *mi = NULL;
        rc = pruned_for(m, VLMOE_MOD_IMAGE, ui, ki[a], E, pm, &mi) || zs_images(mi, z, img + (size_t)a * n * D, ok);
        if (mi != m) vlmoe_model_free(mi);
    }
    for (int b = 0; b < nt && !rc; b++) {
        vlmoe_model *mt = NULL;
        rc = pruned_for(m, VLMOE_MOD_TEXT, ut, kt[b], E, pm, &mt) || zs_classes(mt, z, cls + (size_t)b * C * D);
        if (mt != m) vlmoe_model_free(mt);
    }
    if (!rc) {
        printf("zero-shot top-1 on %d %s of %s (%d classes), image tokens restricted to the image experts kept "
               "(rows), class prompts to the text experts kept (columns), %s:\nimage\\text", n, z->s ? "held-out samples" : "images",
               z->s ? "the synthetic data" : path, C, pm == VLMOE_PRUNE_ROUTER_PRED ? "router_pred" : "router_drop");
        for (int b = 0; b < nt; b++) printf(" %7d", kt[b]);
        printf("\n");
    }
    for (int a = 0; a < ni && !rc; a++) {
        printf("%10d", ki[a]);
        for (int b = 0; b < nt; b++) {
            int right = 0, total = 0;
            for (int i = 0; i < n; i++) {
                if (!ok[i]) continue;
                const float *x = img + ((size_t)a * n + i) * D;
                int best = 0;
                double bs = -1e30;
                for (int c = 0; c < C; c++) {
                    const float *w = cls + ((size_t)b * C + c) * D;
                    double d = 0;
                    for (int e = 0; e < D; e++) d += (double)x[e] * w[e];
                    if (d > bs) bs = d, best = c;
                }
                right += best == (z->s ? z->labels[i] : z->folder.labels[i]), total++;
            }
            printf(" %6.2f%%", total ? 100.0 * right / total : 0.0);
        }
        printf("\n");
    }
    free(img), free(cls), free(ok);
    return rc;
}

// --keep-image/--keep-text: both modalities' shares (from --stats, --images and --texts, or the
// synthetic held-out split), then the grid of prune_pair.
static int cmd_prune_pair(const char *model, const char *mode, const char *stats, int last, const char *images,
                          const char *texts, const char *keep_image, const char *keep_text, const char *zs_dir,
                          const char *zs_names, int zs_n, int single) {
    if (single) return cli_error("prune", "--keep-image/--keep-text evaluate the pruned pair and write nothing: leave out "
                                 "--modality, --keep and -o");
    if (!model || !keep_image || !keep_text)
        return cli_error("prune", "give --model, --keep-image N1,N2 and --keep-text N1,N2 together");
    const int pm = !strcmp(mode, "router_pred") ? VLMOE_PRUNE_ROUTER_PRED : !strcmp(mode, "router_drop") ? VLMOE_PRUNE_ROUTER_DROP : -1;
    if (pm < 0) return cli_error("prune", "--mode must be router_pred or router_drop, not '%s'", mode);
    if (stats && (images || texts)) return cli_error("prune", "give --stats, or --images and --texts, not both");
    if (!!images != !!texts) return cli_error("prune", "--keep-image/--keep-text measure both modalities: give --images and --texts");
    if (zs_dir && zs_n >= 0) return cli_error("prune", "--eval-samples sizes the synthetic split; --zeroshot-data has its images");
    if (zs_names && !zs_dir) return cli_error("prune", "--classnames names the classes of --zeroshot-data DIR");
    vlmoe_model *m = NULL;
    if (vlmoe_model_load(&m, model)) return cli_error("prune", "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int enc, nli = 0, nlt = 0;
    const vlmoe_moe_config *mi = tower(c, VLMOE_MOD_IMAGE, &enc), *mt = tower(c, VLMOE_MOD_TEXT, &enc);
    for (int l = 0; l < 64; l++) nli += mi->router != VLMOE_ROUTER_NONE && (mi->layers >> l & 1);
    for (int l = 0; l < 64; l++) nlt += mt->router != VLMOE_ROUTER_NONE && (mt->layers >> l & 1);
    const int E = mi->num_experts;
    zs_src z;
    memset(&z, 0, sizeof(z));
    double *ui = nli ? calloc((size_t)nli * E, sizeof(double)) : NULL, *ut = nlt ? calloc((size_t)nlt * mt->num_experts, sizeof(double)) : NULL;
    int rc = 0;
    if (!nli || !nlt) rc = cli_error("prune", "%s: model '%s' has no MoE layers serving %s", model, c->name, nli ? "text" : "images");
    else if (mt->num_experts != E) rc = cli_error("prune", "%s: the towers have %d and %d experts a layer", model, E, mt->num_experts);
    else if (!ui || !ut) rc = cli_error("prune", "out of memory");
    else if (!stats && !images && !zs_dir)
        rc = cli_synthetic_model("prune", m, model, "--stats RUN/metrics.jsonl or --images DIR --texts FILE, and "
                                 "--zeroshot-data DIR to evaluate on");
    if (!rc && stats) rc = usage_from_metrics(stats, c, VLMOE_MOD_IMAGE, last, ui, nli, E) ||
                           usage_from_metrics(stats, c, VLMOE_MOD_TEXT, last, ut, nlt, E);
    else if (!rc && images) rc = usage_from_files(m, model, images, NULL, VLMOE_MOD_IMAGE, ui, nli, E) ||
                                 usage_from_files(m, model, NULL, texts, VLMOE_MOD_TEXT, ut, nlt, E);
    else if (!rc) rc = usage_from_synthetic(m, VLMOE_MOD_IMAGE, ui, nli, E) || usage_from_synthetic(m, VLMOE_MOD_TEXT, ut, nlt, E);
    if (!rc && zs_dir) {
        if (vlmoe_image_folder_load(zs_dir, &z.folder)) rc = cli_error("prune", "--zeroshot-data: %s", vlmoe_last_error());
        if (!rc && zs_names && cli_read_lines("prune", zs_names, &z.names, &z.n_names)) rc = 1;
        if (!rc && zs_names && z.n_names != (size_t)z.folder.n_classes)
            rc = cli_error("prune", "--classnames %s has %zu names, %s has %d class folders", zs_names, z.n_names, zs_dir,
                           z.folder.n_classes);
        if (!rc) rc = cli_model_image_params("prune", NULL, NULL, 0, m, model, &z.ip) || cli_model_text("prune", NULL, 0, m, model, 1, &z.text);
        z.n = (int)z.folder.n, z.C = z.folder.n_classes;
    } else if (!rc) {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        if (vlmoe_synth_init(&z.s, &sp)) rc = cli_error("prune", "%s", vlmoe_last_error());
        z.n = zs_n >= 0 ? zs_n : 500;
        if (!rc) z.C = vlmoe_synth_num_classes(z.s);
        if (!rc && (z.n < 1 || !(z.labels = malloc(sizeof(int32_t) * (size_t)z.n))))
            rc = cli_error("prune", z.n < 1 ? "--eval-samples must be >= 1" : "out of memory");
    }
    if (!rc) rc = prune_pair(m, zs_dir, ui, ut, E, pm, keep_image, keep_text, &z);
    vlmoe_synth_free(z.s);
    vlmoe_image_folder_free(&z.folder);
    cli_free_lines(z.names, z.n_names);
    cli_text_free(&z.text);
    free(z.labels), free(ui), free(ut);
    vlmoe_model_free(m);
    return rc ? 1 : 0;
}

int cmd_prune(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *modality = NULL, *mode = NULL, *stats = NULL, *images = NULL;
    const char *texts = NULL, *keep_image = NULL, *keep_text = NULL, *zs_dir = NULL, *zs_names = NULL, *sweep = NULL;
    int keep = 0, last = 50, zs_n = -1, samples = 0;
    long max_pixels = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "the MoE model to prune"},
        {"modality", ARG_STRING, &modality, "M", "text or image: the modality the pruned model will serve"},
        {"keep", ARG_INT1, &keep, "N", "experts kept in each MoE layer of that modality's tower"},
        {"mode", ARG_STRING, &mode, "MODE", "router_pred (default: softmax over all, pruned masked) or router_drop"},
        {"stats", ARG_STRING, &stats, "FILE", "the run's metrics.jsonl: rank experts by their share during training"},
        {"last", ARG_INT, &last, "N", "logged steps of --stats to average (default 50)"},
        {"images", ARG_STRING, &images, "DIR|FILE", "image files (a folder, recursively) to measure the image shares on"},
        {"texts", ARG_STRING, &texts, "FILE", "texts, one per line, to measure the text shares on"},
        {"output", ARG_STRING, &out, "FILE", "where the pruned model (--sweep: the JSON lines) is written (also -o)"},
        {"sweep", ARG_STRING, &sweep, "K1,K2,..", "zero-shot at each count of experts kept, as JSON lines (no model written)"},
        {"samples", ARG_INT, &samples, "N", "with --sweep: held-out synthetic samples (default 512)"},
        {"keep-image", ARG_STRING, &keep_image, "N1,N2", "with --keep-text, instead of --modality/--keep/-o: evaluate "
                                                        "zero-shot with image and text experts pruned independently "
                                                        "(LIMoE E.4, Fig. 15), every pair of the counts (all: no pruning)"},
        {"keep-text", ARG_STRING, &keep_text, "N1,N2", "text experts kept a layer, with --keep-image"},
        {"zeroshot-data", ARG_STRING, &zs_dir, "DIR", "with --sweep or --keep-image/--keep-text: the image folder "
                                                      "DIR/<class>/* to evaluate on (default: the synthetic held-out split)"},
        {"classnames", ARG_STRING, &zs_names, "FILE", "class names of --zeroshot-data, one per line in folder order "
                                                      "(--keep-image/--keep-text)"},
        {"eval-samples", ARG_INT, &zs_n, "N", "synthetic held-out samples for --keep-image/--keep-text (default 500)"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    char *rest[64];
    int nrest = 0;
    for (int i = 2; i < argc && nrest < 62; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc) out = argv[++i];
        else rest[nrest++] = argv[i];
    }
    int rc = args_parse("prune", specs, sizeof(specs) / sizeof(specs[0]), nrest, rest, 0, USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    cli_set_max_image_pixels(max_pixels); // --images, --zeroshot-data
    if (keep_image || keep_text) {
        if (sweep || samples) return cli_error("prune", "--sweep/--samples and --keep-image/--keep-text: give one");
        return cmd_prune_pair(model, mode ? mode : "router_pred", stats, last, images, texts, keep_image, keep_text, zs_dir,
                              zs_names, zs_n, out || modality || keep);
    }
    if (zs_names || zs_n >= 0) return cli_error("prune", "--classnames and --eval-samples apply to --keep-image/--keep-text");
    if (sweep && keep) return cli_error("prune", "--keep and --sweep: give one (--sweep evaluates several counts kept)");
    if (!sweep && (zs_dir || samples))
        return cli_error("prune", "--%s applies to --sweep (the zero-shot of each count kept)", zs_dir ? "zeroshot-data" : "samples");
    if (!model || (!out && !sweep) || !modality || (keep < 1 && !sweep))
        return cli_error("prune", "give --model, --modality, --keep N >= 1 and -o, or --sweep K1,K2,... (see vlmoe prune --help)");
    if (zs_dir && samples) return cli_error("prune", "--samples counts synthetic samples; --zeroshot-data uses all its images");
    if (samples < 0 || samples == 1) return cli_error("prune", "--samples: %d; give at least 2", samples);
    char sweep_out[1200];
    if (sweep && !out) cli_sweep_default_out(model, sweep_out, sizeof sweep_out), out = sweep_out;
    const cli_input in[] = {{"--model", model}, {"--stats", stats}, {"--images", images}, {"--texts", texts},
                            {"--zeroshot-data", zs_dir}};
    if (cli_check_output("prune", "-o", out, in, 5)) return 1;
    const int mod = !strcmp(modality, "text") ? VLMOE_MOD_TEXT : !strcmp(modality, "image") ? VLMOE_MOD_IMAGE : -1;
    if (mod < 0) return cli_error("prune", "--modality must be text or image, not '%s'", modality);
    // the modes: one, or for a sweep a comma-separated list (default both)
    int modes[2], nmodes = 0;
    if (!mode) mode = sweep ? "router_pred,router_drop" : "router_pred";
    for (const char *q = mode; *q && nmodes < 3;) {
        const size_t k = strcspn(q, ",");
        const int pm = k == 11 && !strncmp(q, "router_pred", 11) ? VLMOE_PRUNE_ROUTER_PRED
                     : k == 11 && !strncmp(q, "router_drop", 11) ? VLMOE_PRUNE_ROUTER_DROP : -1;
        if (pm < 0 || nmodes == 2 || (nmodes && modes[0] == pm) || (!sweep && q[k]))
            return cli_error("prune", "--mode must be router_pred or router_drop%s, not '%s'",
                             sweep ? " (or both, comma-separated)" : "", mode);
        modes[nmodes++] = pm;
        q += k + (q[k] == ',');
    }
    const int pm = modes[0];
    if (last < 1) return cli_error("prune", "--last must be >= 1");
    if (!!stats + !!images + !!texts > 1) return cli_error("prune", "give one of --stats, --images and --texts");
    vlmoe_model *m = NULL, *p = NULL;
    if (vlmoe_model_load(&m, model)) return cli_error("prune", "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    int enc, nl = 0;
    const vlmoe_moe_config *mc = tower(c, mod, &enc);
    for (int l = 0; l < 64; l++) nl += mc->router != VLMOE_ROUTER_NONE && (mc->layers >> l & 1);
    const int E = mc->num_experts;
    int counts[64], ncounts = 0;
    if (nl && sweep && cli_sweep_list(sweep, E, counts, &ncounts)) return vlmoe_model_free(m), 1;
    double *u = nl ? calloc((size_t)nl * E, sizeof(double)) : NULL;
    if (!nl) rc = cli_error("prune", "%s: model '%s' has no MoE layers serving %s", model, c->name, modality);
    else if (!u) rc = cli_error("prune", "out of memory");
    else if (!stats && !images && !texts)
        rc = cli_synthetic_model("prune", m, model, "--stats RUN/metrics.jsonl (the experts' shares logged while it "
                                 "trained), or --images DIR / --texts FILE of its modality");
    if (!rc && stats) rc = usage_from_metrics(stats, c, mod, last, u, nl, E);
    else if (!rc && (images || texts)) rc = usage_from_files(m, model, images, texts, mod, u, nl, E);
    else if (!rc) rc = usage_from_synthetic(m, mod, u, nl, E);
    if (!rc && sweep && !zs_dir)
        rc = cli_synthetic_model("prune", m, model, "--zeroshot-data DIR (images in class folders) for the sweep's zero-shot");
    if (sweep) {
        const prune_sweep_params sp = {.model = model, .out = out, .zeroshot = zs_dir,
                                       .shares = stats ? stats : images ? images : texts ? texts : "synthetic held-out",
                                       .mod = mod, .samples = samples ? samples : 512, .batch = 64, .keep = counts,
                                       .nkeep = ncounts, .modes = modes, .nmodes = nmodes};
        if (!rc) rc = cli_prune_sweep(m, u, E, &sp);
        free(u);
        vlmoe_model_free(m);
        return rc ? 1 : 0;
    }
    if (!rc && vlmoe_model_prune(&p, m, mod, u, keep, (vlmoe_prune_mode)pm))
        rc = cli_error("prune", "%s: %s", model, vlmoe_last_error());
    if (!rc && vlmoe_model_save(p, out)) rc = cli_error("prune", "%s", vlmoe_last_error());
    for (int l = 0, b = 0; !rc && b < 64; b++) {
        if (!(mc->layers >> b & 1)) continue;
        // the kept experts are the `keep` largest shares; report their coverage
        const double *ul = u + (size_t)l++ * E;
        double cover = 0, tot = 0;
        char list[512] = "";
        int used[64] = {0};
        for (int k = 0; k < keep; k++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!used[e] && (best < 0 || ul[e] > ul[best])) best = e;
            used[best] = 1;
            cover += ul[best];
            snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%d", k ? "," : "", best);
        }
        for (int e = 0; e < E; e++) tot += ul[e];
        printf("encoder %d block %d: kept experts %s, %.1f%% of the %s tokens went to them\n", enc, b, list,
               tot > 0 ? 100 * cover / tot : 0, modality);
    }
    if (!rc) printf("pruned model (%s, %d of %d experts per layer) written to %s\n", mode, keep, E, out);
    free(u);
    vlmoe_model_free(p);
    vlmoe_model_free(m);
    return rc ? 1 : 0;
}
