// vlmoe_train_setup.c: the set-up of a VL-MoE pre-training run (cli/vlmoe_train.c): the texts'
// tokenizer, the image files and text lines the streams read, the model (fresh or resumed) and
// what its checkpoints record of their inputs. Declared in cli/vlmoe_train_run.h; covered by
// tests/test_vlmoe_train.c and tests/test_dist_mpi.sh.
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "nn/model.h"
#include "tokenize.h"
#include "vlmoe_train_run.h"

static const char *CMD = "train";

// Releases the run; the process group too, except after a failure on several processes, where
// this process leaves without finalising MPI so that mpirun stops the others (they may be waiting
// in a collective this one will never join).
void mome_run_free(mome_cli *r, int rc) {
    if (r->dist && (!rc || r->dist->world == 1)) vlmoe_dist_close(r->dist);
    cli_tb_close(&r->tb);
    vlmoe_mome_free(r->task);
    cli_text_free(&r->text);
    vlmoe_trainer_free(r->t);
    vlmoe_model_free(r->m);
    vlmoe_free_strings(r->images, r->n_images);
    if (r->lines) cli_free_lines(r->lines, r->n_lines);
    free(r->lineno), free(r->cb);
}

// Exit status of a failed step of the set-up, with the library's message.
int mome_lib_error(const char *what) { return cli_error(CMD, "%s%s%s", what, what[0] ? ": " : "", vlmoe_last_error()); }

// The texts' tokenizer: --tokenizer, else the vocabulary this run trained (LOGS/NAME/tokenizer.txt),
// else a BPE vocabulary trained now on the first 10000 sentences of --text-data and captions of
// --train-data (captions: whether the loader gives texts). Never the synthetic words for files.
// A vocabulary the config leaves open (no "vocab_size" in a JSON config) is sized to the
// tokenizer, with [MASK] the id after its last.
// On several processes rank 0 decides and trains; the others read the file once it is written.
static int open_text(const mome_args *a, int captions, mome_cli *r) {
    const int fixed = config_sets_vocab(a->model);
    snprintf(r->tokenizer_path, sizeof(r->tokenizer_path), "%s/tokenizer.txt", r->dir);
    if (a->tokenizer) {
        snprintf(r->tokenizer_path, sizeof(r->tokenizer_path), "%s", a->tokenizer);
    } else if (!r->lead) {
        // rank 0 trains it, or finds it, before the barrier below
    } else if (access(r->tokenizer_path, R_OK) == 0) {
        fprintf(stderr, "vlmoe train: texts are tokenized with %s, the vocabulary this run trained\n", r->tokenizer_path);
    } else {
        if (fixed && r->cfg.vocab_size < CLI_BPE_MIN + 1)
            return cli_error(CMD, "%s fixes vocab_size %d, too small for a BPE vocabulary of the texts (at least %d ids "
                             "and [MASK]): raise vocab_size (e.g. %d), leave it out to size it to the texts, or give "
                             "--tokenizer FILE", a->model, r->cfg.vocab_size, CLI_BPE_MIN, CLI_BPE_IDS + 1);
        const int size = r->cfg.vocab_size > CLI_BPE_MIN ? r->cfg.vocab_size - 1 : CLI_BPE_IDS;
        size_t n;
        int ids;
        if (vlmoe_train_vocabulary(captions ? &a->data : NULL, (const char *const *)r->lines, r->n_lines, size, 10000,
                                   r->tokenizer_path, &n, &ids))
            return mome_lib_error("");
        fprintf(stderr, "vlmoe train: no --tokenizer: trained a BPE vocabulary of %d ids on %zu texts (saved as %s; the "
                "checkpoints carry it)\n", ids, n, r->tokenizer_path);
    }
    if (!a->tokenizer && r->dist->barrier(r->dist)) return mome_lib_error("");
    if (cli_load_tokenizer(r->tokenizer_path, &r->text.bpe)) return mome_lib_error("--tokenizer");
    const int ids = vlmoe_tokenizer_vocab_size(r->text.bpe);
    if (!fixed && (r->cfg.vocab_size <= ids || r->cfg.vocab_size < CLI_BPE_MIN)) {
        if (r->lead) fprintf(stderr, "vlmoe train: the token embedding of %s is sized to the tokenizer: %d ids and [MASK] = %d (a JSON "
                "config's \"vocab_size\" and \"mask_token\" fix them)\n", a->model, ids, ids);
        r->cfg.vocab_size = ids + 1, r->cfg.mask_token = ids;
    }
    return 0;
}

// What the streams read from files: the tokenizer (open_text), the image transform, the image
// files and the text file's lines.
int mome_open_data(const mome_args *a, const vlmoe_mome_split *sp, vlmoe_mome_params *p, mome_cli *r) {
    const int *src = sp->src;
    const int synth = src[0] == VLMOE_MOME_SYNTH || src[1] == VLMOE_MOME_SYNTH || src[2] == VLMOE_MOME_SYNTH;
    if (synth && a->tokenizer) return cli_error(CMD, "--tokenizer: the synthetic data has its own word tokenizer");
    if (synth && (a->image_mean || a->image_std)) return cli_error(CMD, "--image-mean/--image-std apply to image files");
    if (synth && (!isnan(a->hflip) || !isnan(a->color_jitter)))
        return cli_error(CMD, "--hflip/--color-jitter augment image files (--image-data, --train-data); the synthetic "
                         "images have none");
    if (synth) return 0;
    if (r->cfg.channels != 3)
        return cli_error(CMD, "model %s has %d image channels; images are RGB", r->cfg.name, r->cfg.channels);
    if (cli_image_params(CMD, a->image_mean, a->image_std, &r->cfg, &p->image)) return 1;
    // BEiT's / VL-MoE's pre-training augmentations after the random resized crop, drawn from the
    // crop's generator (keyed by the sample's global index): the same on any number of processes
    p->image.flip_prob = isnan(a->hflip) ? 0.5 : a->hflip;
    p->image.color_jitter = isnan(a->color_jitter) ? 0.4 : a->color_jitter;
    if (src[1] == VLMOE_MOME_LINES) {
        if (cli_read_lines_numbered(CMD, a->text_data, &r->lines, &r->lineno, &r->n_lines)) return 1;
        p->text_lines = (const char *const *)r->lines, p->text_lineno = r->lineno, p->n_text_lines = r->n_lines;
    }
    if (src[1] == VLMOE_MOME_LINES || src[1] == VLMOE_MOME_LOADER || src[2] == VLMOE_MOME_LOADER) {
        if (open_text(a, src[1] == VLMOE_MOME_LOADER || src[2] == VLMOE_MOME_LOADER, r)) return 1;
        p->tokenize = cli_tokenize, p->tokenize_user = &r->text, p->tokenizer = r->tokenizer_path;
        p->text_vocab = vlmoe_tokenizer_vocab_size(r->text.bpe);
    }
    if (src[0] == VLMOE_MOME_FOLDER) {
        struct stat sb;
        const int e = stat(a->image_data, &sb) ? errno : 0;
        if (e || !S_ISDIR(sb.st_mode))
            return cli_error(CMD, "--image-data %s: %s", a->image_data, e ? strerror(e) : "not a folder");
        if (cli_list_images(CMD, &a->image_data, 1, &r->images, &r->n_images)) return 1;
        p->image_files = (const char *const *)r->images, p->n_image_files = r->n_images;
    }
    return 0;
}

static void on_warn(void *u, const char *msg) { fprintf(stderr, "vlmoe train: %s\n", msg); }

// What the checkpoints will record of the inputs: the texts' tokenizer (the synthetic words for
// the synthetic data) and the image files' normalisation. A resumed run must read them as its
// checkpoint says.
static int record_inputs(const vlmoe_mome_params *p, const char *ckpt, mome_cli *r) {
    const model_inputs *in = model_get_inputs(r->m);
    const int synth = p->tokenize == NULL && !p->image_files && !p->train_data.path;
    if (ckpt && in->text == MODEL_TEXT_BPE && r->text.bpe && !model_same_tokenizer(r->m, r->text.bpe))
        return cli_error(CMD, "%s: the texts' tokenizer %s is not the one the checkpoint carries", ckpt,
                         r->tokenizer_path);
    if (ckpt && in->has_norm && (p->image_files || p->train_data.path) &&
        (memcmp(in->mean, p->image.mean, sizeof(in->mean)) || memcmp(in->std, p->image.std, sizeof(in->std))))
        return cli_error(CMD, "%s: --image-mean/--image-std differ from the normalisation the checkpoint records", ckpt);
    if (p->tokenize || synth) // texts read (or the synthetic data's)
        if (model_set_tokenizer(r->m, r->text.bpe)) return mome_lib_error("");
    if (p->image_files || p->train_data.path) model_set_image_norm(r->m, p->image.mean, p->image.std);
    return 0;
}

// A fresh model from --model, or the newest usable checkpoint (--resume latest, falling back to
// older ones) or the one named (--resume FILE); then the task starts on it, and the model records
// the inputs it trains on.
int mome_setup_model(const mome_args *a, const vlmoe_train_params *tp, const vlmoe_mome_params *p, mome_cli *r) {
    if (!a->resume) {
        if (vlmoe_model_init(&r->m, &r->cfg, (uint64_t)a->seed) || vlmoe_model_set_drop_path(r->m, a->drop_path) ||
            (a->device && model_set_device(r->m, a->device)) || vlmoe_trainer_init(&r->t, r->m, tp) ||
            vlmoe_mome_start(r->task, r->m, r->cb, NULL, NULL))
            return mome_lib_error("");
        return record_inputs(p, NULL, r);
    }
    char w[1024];
    if (vlmoe_ckpt_resume(r->ckdir, a->resume, tp, 0, &r->m, &r->t, &r->resumed, w, sizeof(w), on_warn, NULL))
        return mome_lib_error("");
    if (vlmoe_model_set_drop_path(r->m, a->drop_path) || (a->device && model_set_device(r->m, a->device)) ||
        vlmoe_mome_start(r->task, r->m, r->cb, &r->resumed, w))
        return mome_lib_error("");
    if (r->lead) fprintf(stderr, "vlmoe train: resuming from %s (step %ld)\n", w, vlmoe_trainer_get_step(r->t));
    return record_inputs(p, w, r);
}

