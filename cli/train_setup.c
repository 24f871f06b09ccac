// train_setup.c: the set-up of a contrastive `vlmoe train` run (cli/train.c): the model (fresh,
// --pretrained or resumed), its captions' tokenizer (never the synthetic words for captions: a BPE
// vocabulary trained on them when no --tokenizer is given, the token embedding sized to it), what
// the model file will record of its inputs, the data, and the validation on the user's data.
// Declared in cli/train_run.h; covered by tests/test_own_data.c, test_loader.c and test_val.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "nn/model.h"
#include "tokenize.h"
#include "train_run.h"

// Releases the run; the process group too, except after a failure on several processes, where
// cmd_train ends the job with it (the others may be waiting in a collective this one will never
// join).
void train_run_free(train_run *r, int rc) {
    if (r->dist && (!rc || r->dist->world == 1)) vlmoe_dist_close(r->dist);
    vlmoe_contrastive_free(r->task);
    vlmoe_image_folder_free(&r->zs);
    cli_free_lines(r->zs_names, r->n_names), cli_free_lines(r->zs_tpl, r->n_tpl);
    vlmoe_loader_free(r->loader);
    cli_text_free(&r->text);
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_synth_free(r->synth);
    cli_tb_close(&r->tb);
}

static void on_warn(void *u, const char *msg) { fprintf(stderr, "vlmoe train: %s\n", msg); }

// A BPE vocabulary for a run's captions when no --tokenizer is given: the one this run trained
// (LOGS/NAME/tokenizer.txt), else one of `size` ids trained on the first 10000 captions by rank 0
// and read by the others once it is written.
static int train_vocab(const train_args *a, train_run *r, int size) {
    char path[1024];
    snprintf(path, sizeof(path), "%s/tokenizer.txt", r->dir);
    size_t n;
    int ids, st = 0;
    if (r->lead && access(path, R_OK) == 0)
        fprintf(stderr, "vlmoe train: captions are tokenized with %s, the vocabulary this run trained\n", path);
    else if (r->lead && (st = vlmoe_train_vocabulary(&a->data, NULL, 0, size, 10000, path, &n, &ids)))
        return cli_error("train", "%s", vlmoe_last_error());
    else if (r->lead)
        fprintf(stderr, "vlmoe train: no --tokenizer: trained a BPE vocabulary of %d ids on the first %zu captions of "
                "%s (saved as %s; the checkpoints carry it)\n", ids, n, a->data.path, path);
    if (r->dist->barrier(r->dist)) return cli_error("train", "%s", vlmoe_last_error());
    return cli_load_tokenizer(path, &r->text.bpe) ? cli_error("train", "%s", vlmoe_last_error()) : 0;
}

// The captions' tokenizer of a fresh run on --train-data, chosen before the model is made so that
// a vocabulary the config leaves open (a named model's) is sized to it: --tokenizer, else a BPE
// vocabulary trained on the captions (the config's size, or CLI_BPE_IDS when the config's is too small
// for BPE). A config that fixes a vocabulary smaller than the tokenizer's is an error.
static int fresh_text(const train_args *a, train_run *r, int *vocab) {
    vlmoe_model_config c;
    if (vlmoe_config_load(a->model, &c)) return cli_error("train", "%s", vlmoe_last_error());
    const int fixed = config_sets_vocab(a->model);
    *vocab = 0;
    if (!a->tokenizer && c.vocab_size < CLI_BPE_MIN && fixed)
        return cli_error("train", "%s fixes vocab_size %d, too small for a BPE vocabulary of the captions of %s (at least "
                         "%d ids): raise vocab_size (e.g. %d), leave it out to size it to the captions, or give "
                         "--tokenizer FILE", a->model, c.vocab_size, a->data.path, CLI_BPE_MIN, CLI_BPE_IDS);
    if (!a->tokenizer && train_vocab(a, r, c.vocab_size < CLI_BPE_MIN ? CLI_BPE_IDS : c.vocab_size)) return 1;
    if (a->tokenizer && cli_load_tokenizer(a->tokenizer, &r->text.bpe))
        return cli_error("train", "--tokenizer: %s", vlmoe_last_error());
    const int ids = vlmoe_tokenizer_vocab_size(r->text.bpe);
    if (ids > c.vocab_size && fixed)
        return cli_error("train", "the tokenizer %s has %d ids, more than the %d of vocab_size in %s: raise vocab_size "
                         "to at least %d, or leave it out to size it to the tokenizer", a->tokenizer ? a->tokenizer :
                         "trained on the captions", ids, c.vocab_size, a->model, ids);
    if (ids != c.vocab_size && !fixed && (ids > c.vocab_size || c.vocab_size < CLI_BPE_MIN)) {
        *vocab = ids;
        if (r->lead)
            fprintf(stderr, "vlmoe train: the token embedding of %s is sized to the tokenizer: %d ids (the named "
                    "model has %d; a JSON config with \"vocab_size\" fixes it)\n", a->model, ids, c.vocab_size);
    }
    return 0;
}

// The captions' tokenizer of a run that did not make it: what the model records (a resumed run's
// checkpoint, --pretrained), else for an older checkpoint the vocabulary the run trained. Never
// the synthetic words for captions.
static int model_text(const train_args *a, train_run *r, const char *path) {
    const model_inputs *in = model_get_inputs(r->m);
    const int vocab = vlmoe_model_get_config(r->m)->vocab_size;
    if (in->text == MODEL_TEXT_SYNTH && !(a->tokenizer && a->override))
        return cli_error("train", "%s was trained on the synthetic data, whose word tokenizer cannot read captions: "
                         "train from scratch on %s%s", path, a->data.path, vocab >= CLI_BPE_MIN ? ", or give --tokenizer "
                         "FILE --override-inputs to re-learn the text embedding with another vocabulary" :
                         " (its vocabulary is too small for any BPE tokenizer)");
    if (in->text != MODEL_TEXT_UNKNOWN) return cli_model_text("train", a->tokenizer, a->override, r->m, path, 1, &r->text);
    if (a->tokenizer) return cli_text_init("train", a->tokenizer, vlmoe_model_get_config(r->m), 1, &r->text);
    if (a->resume && vocab >= CLI_BPE_MIN) return train_vocab(a, r, vocab); // an older run: its tokenizer.txt
    return cli_error("train", "%s does not record its tokenizer (an import or an older file): give --tokenizer FILE, the "
                     "one it was trained with", path);
}

// The model: a resumed run's (newest usable checkpoint first), or one from --model/--pretrained,
// with the tokenizer of its captions (r->text) and what the model file will record about them.
int train_setup_model(const train_args *a, const vlmoe_train_params *tp, train_run *r) {
    const int captions = a->data.path != NULL;
    if (!captions && a->tokenizer) return cli_error("train", "--tokenizer: the synthetic data has its own word tokenizer");
    if (a->resume) {
        char w[1024];
        if (vlmoe_ckpt_resume(r->ckdir, a->resume, tp, a->batch_size, &r->m, &r->t, &r->resumed, w, sizeof(w),
                              on_warn, NULL))
            return cli_error("train", "%s", vlmoe_last_error());
        if (r->lead) fprintf(stderr, "vlmoe train: resuming from %s (step %ld)\n", w, vlmoe_trainer_get_step(r->t));
        if (captions && model_text(a, r, w)) return 1;
    } else {
        int vocab = 0;
        if (captions && !a->pretrained && fresh_text(a, r, &vocab)) return 1;
        const vlmoe_model_source src = {a->model, a->pretrained, a->preset, a->image_size, a->context_length, vocab,
                                        (uint64_t)a->seed, a->soft_dispatch, a->soft_raw};
        if (vlmoe_model_from_source(&r->m, &src) || vlmoe_model_plan(r->m, a->batch_size) ||
            vlmoe_trainer_init(&r->t, r->m, tp))
            return cli_error("train", "%s", vlmoe_last_error());
        if (captions && a->pretrained && model_text(a, r, a->pretrained)) return 1;
    }
    char warn[1024];
    if (vlmoe_config_warnings(vlmoe_model_get_config(r->m), warn, sizeof(warn)) && r->lead)
        fprintf(stderr, "vlmoe train: warning: %s\n", warn);
    if (!captions && model_get_inputs(r->m)->text == MODEL_TEXT_BPE)
        return cli_error("train", "%s carries a BPE tokenizer: it was trained on captions of its own, not the synthetic "
                         "data; give --train-data", a->resume ? "the run's checkpoint" : a->pretrained);
    if (captions && r->text.bpe && vlmoe_tokenizer_vocab_size(r->text.bpe) > vlmoe_model_get_config(r->m)->vocab_size)
        return cli_error("train", "the tokenizer has %d ids, more than the model's vocabulary of %d",
                         vlmoe_tokenizer_vocab_size(r->text.bpe), vlmoe_model_get_config(r->m)->vocab_size);
    // what the checkpoints will say: the tokenizer used (NULL: the synthetic words)
    return model_set_tokenizer(r->m, r->text.bpe) ? cli_error("train", "%s", vlmoe_last_error()) : 0;
}

// The data: the synthetic pairs, or the loader over --train-data (at the checkpoint's position
// when resuming), normalised as the model records (a resumed or pretrained one) or as the flags
// say, which the model then records.
int train_setup_data(const train_args *a, train_run *r) {
    const vlmoe_model_config *c = vlmoe_model_get_config(r->m);
    if (!a->data.path) {
        vlmoe_synth_params sp = vlmoe_synth_default_params();
        sp.image_size = c->image_size;
        sp.seed = (uint64_t)a->seed;
        // its pixels are in [-1, 1]: the normalisation that reads them back from image files
        // (vlmoe synth export) is mean 0.5, std 0.5
        const float half[3] = {0.5f, 0.5f, 0.5f};
        model_set_image_norm(r->m, half, half);
        return vlmoe_synth_init(&r->synth, &sp) ? cli_error("train", "synthetic data: %s", vlmoe_last_error()) : 0;
    }
    if (c->channels != 3) return cli_error("train", "model %s has %d image channels; images are RGB", c->name, c->channels);
    vlmoe_loader_params lp = vlmoe_loader_default_params();
    const char *from = a->resume ? "the run's checkpoint" : a->pretrained ? a->pretrained : a->model;
    if (cli_model_image_params("train", a->image_mean, a->image_std, a->override, r->m, from, &lp.image)) return 1;
    model_set_image_norm(r->m, lp.image.mean, lp.image.std);
    lp.data = a->data;
    lp.seed = (uint64_t)a->seed;
    // each process decodes only its block of accum_freq micro-batches; the processes agree on
    // which samples were bad (src/data/loader.h)
    lp.batch_size = a->batch_size * a->accum_freq;
    // one batch a step: its images as bytes, normalised by the model's table (a device gets a
    // quarter of the bytes); micro-batches keep float images
    lp.pixels = a->accum_freq <= 1;
    lp.rank = r->dist->rank, lp.world = r->dist->world;
    lp.agree = cli_loader_agree, lp.agree_user = r->dist;
    lp.context_length = c->context_length;
    lp.tokenize = cli_tokenize, lp.tokenize_user = &r->text;
    lp.workers = a->workers;
    lp.max_bad_fraction = a->max_bad;
    lp.resampled = a->resampled, lp.upsampling = a->upsampling, lp.epoch_samples = a->resampled ? a->num_samples : 0;
    lp.data.note = r->lead ? on_warn : NULL;
    if (vlmoe_loader_open(&lp, &r->loader) || (a->resume && vlmoe_loader_seek(r->loader, &r->resumed)))
        return cli_error("train", "--train-data: %s", vlmoe_last_error());
    const int64_t rows = vlmoe_loader_epoch_size(r->loader);
    char what[64];
    snprintf(what, sizeof(what), "webdataset shards%s", a->resampled ? " drawn with replacement" : "");
    if (rows >= 0) snprintf(what, sizeof(what), "%lld usable rows", (long long)rows);
    if (r->lead) fprintf(stderr, "vlmoe train: data %s (%s), %d loader workers\n", a->data.path, what, a->workers);
    return 0;
}

// Validation on the user's data (--val-data, --zeroshot-data): opened here so that a missing
// file stops the run before it trains; images get the eval transform with the run's
// normalisation, texts the run's tokenizer (a synthetic run's: the synthetic data's words).
int train_setup_validation(const train_args *a, train_run *r, vlmoe_contrastive_params *cp) {
    if (!a->val_data && !a->zs_data) return 0;
    const vlmoe_model_config *c = vlmoe_model_get_config(r->m);
    if (c->channels != 3)
        return cli_error("train", "--val-data/--zeroshot-data: model %s has %d image channels; images are RGB", c->name,
                         c->channels);
    if (cli_image_params("train", a->image_mean, a->image_std, c, &r->val_ip)) return 1;
    const model_inputs *in = model_get_inputs(r->m); // what setup_data trains with (a resumed run: its checkpoint's)
    if (in->has_norm) memcpy(r->val_ip.mean, in->mean, sizeof(in->mean)), memcpy(r->val_ip.std, in->std, sizeof(in->std));
    if (!r->loader) { // the words the synthetic captions are made of, as in training
        const vlmoe_synth_params sp = vlmoe_synth_default_params();
        if (vlmoe_synth_init(&r->text.synth, &sp)) return cli_error("train", "%s", vlmoe_last_error());
    }
    cp->eval = vlmoe_eval_default_params();
    cp->eval.batch_size = a->batch_size >= 2 ? a->batch_size : 2;
    cp->eval.shots = 0;
    cp->eval.ip = &r->val_ip;
    cp->eval.tokenize = cli_tokenize, cp->eval.tokenize_user = &r->text;
    cp->eval.max_pairs = a->val_num;
    if (a->val_data) {
        r->val = a->data; // the CSV flags of --train-data; the type by the name
        r->val.path = a->val_data;
        r->val.type = VLMOE_DATASET_AUTO;
        r->val.defer_images = 0;
        if (vlmoe_dataset_check(&r->val, NULL)) return cli_error("train", "--val-data: %s", vlmoe_last_error());
        cp->val = &r->val;
        cp->val_every = a->val_every;
    }
    if (!a->zs_data) return 0;
    if (vlmoe_image_folder_load(a->zs_data, &r->zs))
        return cli_error("train", "--zeroshot-data: %s", vlmoe_last_error());
    const int C = r->zs.n_classes;
    if (a->zs_names) {
        if (cli_read_texts("train", "--zeroshot-classnames", a->zs_names, a->zs_dataset, 0, &r->zs_names, &r->n_names))
            return 1;
        if (r->n_names != (size_t)C)
            return cli_error("train", "--zeroshot-classnames %s has %zu names, --zeroshot-data %s has %d class folders",
                             a->zs_names, r->n_names, a->zs_data, C);
    }
    if (a->zs_templates &&
        cli_read_texts("train", "--zeroshot-templates", a->zs_templates, a->zs_dataset, 1, &r->zs_tpl, &r->n_tpl))
        return 1;
    r->zs_data = (vlmoe_eval_folder_data){
        .folder = &r->zs, .name = a->zs_data,
        .classes = (const char *const *)(r->zs_names ? r->zs_names : r->zs.class_names),
        .templates = r->zs_tpl ? (const char *const *)r->zs_tpl : cli_templates,
        .n_templates = r->zs_tpl ? (int)r->n_tpl : CLI_NUM_TEMPLATES,
    };
    cp->zeroshot = &r->zs_data;
    cp->zeroshot_every = a->zeroshot_every;
    return 0;
}

static long gcd(long x, long y) { return y ? gcd(y, x % y) : x; }

// The loop calls the evaluation hook every this many steps (0: at the end only); each part runs
// on its own cadence (src/train/contrastive_task.c).
long train_eval_cadence(const train_args *a) {
    long g = a->data.path || a->eval_samples <= 0 ? 0 : a->zeroshot_every;
    if (a->val_data) g = gcd(g, a->val_every);
    if (a->zs_data) g = gcd(g, a->zeroshot_every);
    return g;
}
