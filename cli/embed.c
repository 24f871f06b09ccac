// embed.c: `vlmoe embed`: L2-normalised embeddings of image files or of texts (one per line),
// encoded in batches, written to a safetensors file ("image_embeds" or "text_embeds" (N, E) F32)
// whose metadata lists the inputs in row order and the images that were skipped, or to NumPy's
// .npy (OUT ending in .npy, or --format npy), which holds the rows only.
// Test: tests/test_classify_embed.c.
#include <cjson/cJSON.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "nn/model.h"
#include "common.h"
#include "data/readers.h"
#include "io/npy.h"
#include "tokenize.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe embed --model CHECKPOINT --images DIR|FILE... -o OUT.safetensors [options]\n"
    "       vlmoe embed --model CHECKPOINT --texts FILE -o OUT.safetensors [options]\n\n"
    "Writes the model's L2-normalised embeddings to OUT: tensor \"image_embeds\" (N, E) for images\n"
    "(files, and folders searched recursively for .jpg .jpeg .png .webp, in sorted order) or\n"
    "\"text_embeds\" (N, E) for the non-blank lines of a text file, F32, encoded in batches. Row i\n"
    "belongs to entry i of the metadata's \"inputs\", a JSON array of image paths or of line numbers\n"
    "(1-based). Unreadable images are skipped, counted, reported on stderr and listed in the\n"
    "metadata's \"skipped\" (an error when no image can be read). Images are preprocessed like vlmoe\n"
    "eval's (shorter side resized, center crop, --image-mean/--image-std); texts are tokenized with\n"
    "the tokenizer the model file records (else --tokenizer, or below 514 ids the synthetic words).\n"
    "Read OUT with safetensors' safe_open(OUT, \"np\"), .get_tensor(\"image_embeds\") and .metadata().\n"
    "OUT ending in .npy (or --format npy) is NumPy's format instead (1.0, '<f4', C order; numpy.load):\n"
    "the rows only, in the same order (skipped images are still reported on stderr).\n\n"
    "examples:\n"
    "  vlmoe embed --model logs/demo/checkpoints/step_3000.safetensors --images photos/ -o photos.safetensors\n"
    "  vlmoe embed --model clip.safetensors --images a.jpg b.png -o two.safetensors\n"
    "  vlmoe embed --model clip.safetensors --tokenizer bpe_simple_vocab_16e6.txt.gz \\\n"
    "      --texts captions.txt -o captions.safetensors\n"
    "  vlmoe embed --model clip.safetensors --images photos/ -o photos.npy";

// Embeddings of texts in batches of B; a text the tokenizer rejects is an error naming its line.
static int embed_texts(vlmoe_model *m, cli_text *text, char **texts, const long *lineno, int n, int B,
                       const char *path, float *out) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int T = c->context_length, E = c->embed_dim;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)B * (T + 1)), *lens = tok + (size_t)B * T;
    if (!tok) return cli_error("embed", "out of memory");
    cli_progress pr = cli_progress_start("texts");
    int rc = cli_plan(m, n, B) ? cli_error("embed", "%s", vlmoe_last_error()) : 0;
    for (int i0 = 0; i0 < n && !rc; i0 += B) {
        const int k = n - i0 < B ? n - i0 : B;
        for (int j = 0; j < k && !rc; j++)
            if ((lens[j] = cli_tokenize(text, texts[i0 + j], tok + (size_t)j * T, T)) < 2)
                rc = cli_error("embed", "%s:%ld: %s", path, lineno[i0 + j], vlmoe_last_error());
        if (!rc && vlmoe_model_encode_texts(m, tok, lens, k, out + (size_t)i0 * E))
            rc = cli_error("embed", "%s", vlmoe_last_error());
        cli_progress_show(&pr, i0 + k, n);
    }
    cli_progress_end(&pr);
    free(tok);
    return rc;
}

// Adds metadata `key`: arr as JSON text.
static int add_json(vlmoe_st_writer *w, const char *key, const cJSON *arr) {
    char *s = cJSON_PrintUnformatted(arr);
    int st = s ? vlmoe_st_writer_meta(w, key, s) : vlmoe_fail(VLMOE_ERR_NOMEM, "metadata %s", key);
    free(s);
    return st;
}

// Writes (n, E) rows as `name` with the inputs and skipped arrays in the metadata.
static int write_out(const char *path, const char *model, const char *name, const float *x, int n, int E,
                     const cJSON *inputs, const cJSON *skipped) {
    vlmoe_st_writer *w = NULL;
    const int64_t shape[2] = {n, E};
    int st = vlmoe_st_writer_init(&w);
    if (!st) st = vlmoe_st_writer_add_f32(w, name, VLMOE_DT_F32, 2, shape, x);
    if (!st) st = vlmoe_st_writer_meta(w, "model", model);
    if (!st) st = add_json(w, "inputs", inputs);
    if (!st && skipped) st = add_json(w, "skipped", skipped);
    if (!st) st = vlmoe_st_writer_write(w, path);
    vlmoe_st_writer_free(w);
    return st ? cli_error("embed", "%s", vlmoe_last_error()) : 0;
}

int cmd_embed(int argc, char **argv) {
    const char *precision = NULL, *device = NULL, *model = NULL, *texts_path = NULL, *output = NULL, *tokenizer = NULL, *mean = NULL, *std = NULL;
    const char *unused = NULL, *format = NULL;
    int B = 64, threads = 0, override = 0;
    long max_pixels = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "a vlmoe checkpoint (.safetensors)"},
        {"device", ARG_STRING, &device, "cpu|cuda[:N]", "where the model runs (default cpu)"},
        {"precision", ARG_STRING, &precision, "fp32|bf16|int8|int8-attn", CLI_PRECISION_HELP},
        {"images", ARG_STRING, &unused, "DIR|FILE...", "image files and folders (searched recursively)"},
        {"texts", ARG_STRING, &texts_path, "FILE", "texts to embed, one per line (blank lines skipped)"},
        {"output", ARG_STRING, &output, "FILE", "the file to write (also -o FILE): .safetensors, or .npy"},
        {"format", ARG_STRING, &format, "safetensors|npy", "OUT's format (default: npy if OUT ends in .npy)"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "CLIP merges .txt/.txt.gz or HF tokenizer.json"},
        {"image-mean", ARG_STRING, &mean, "R,G,B", "normalisation mean (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"image-std", ARG_STRING, &std, "R,G,B", "normalisation std (default CLIP's; LIMoE's [-1, 1]: 0.5)"},
        {"override-inputs", ARG_FLAG, &override, NULL, CLI_OVERRIDE_HELP},
        {"batch-size", ARG_INT1, &B, "N", "inputs per model call (default 64)"},
        {"threads", ARG_INT, &threads, "N", "worker threads"},
        {"max-image-pixels", ARG_LONG1, &max_pixels, "N", CLI_MAX_PIXELS_HELP},
    };
    const int nspec = (int)(sizeof(specs) / sizeof(specs[0]));
    const char **args = malloc(sizeof(char *) * (size_t)argc);
    char **rest = malloc(sizeof(char *) * (size_t)argc);
    int nargs = 0, nrest = 0, rc = args && rest ? 0 : cli_error("embed", "out of memory");
    if (!rc) rc = cli_take_multi("embed", "images", argc, argv, 2, args, &nargs, rest, &nrest);
    char *no_pos[1];   // no positional arguments: they come after --images; args_parse_pos maps -o
    int npos = 0;
    if (!rc) rc = args_parse_pos("embed", specs, nspec, nrest, rest, 2, USAGE, no_pos, 0, &npos);
    free(rest);
    if (rc) return free(args), rc == 1 ? 0 : rc;
    if (threads > 0) omp_set_num_threads(threads);
    cli_set_max_image_pixels(max_pixels);
    if (!model) rc = cli_error("embed", "--model is required (see vlmoe embed --help)");
    else if (!nargs == !texts_path) rc = cli_error("embed", "give --images DIR|FILE... or --texts FILE (one of them)");
    else if (!output) rc = cli_error("embed", "-o OUT.safetensors is required");
    else if (B < 1) rc = cli_error("embed", "--batch-size must be >= 1");
    else if (format && strcmp(format, "safetensors") && strcmp(format, "npy"))
        rc = cli_error("embed", "--format %s: expected safetensors or npy", format);
    const cli_input in[] = {{"--model", model}, {"--texts", texts_path}, {"--tokenizer", tokenizer}};
    if (!rc) rc = cli_check_output("embed", "-o", output, in, 3);
    if (rc) return free(args), rc;

    vlmoe_model *m = NULL;
    if (vlmoe_model_load(&m, model)) return free(args), cli_error("embed", "%s", vlmoe_last_error());
    if ((device && model_set_device(m, device)) || cli_set_precision("embed", m, precision)) {
        vlmoe_model_free(m), free(args);
        return cli_error("embed", "%s", vlmoe_last_error());
    }
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const int E = c->embed_dim;
    cli_text text = {0};
    vlmoe_image_params ip;
    char **inputs = NULL;
    long *lineno = NULL;
    size_t nt = 0;
    int n = 0, n_ok = 0;
    float *x = NULL;
    uint8_t *ok = NULL;
    cli_bad_log bad = {0};
    cJSON *in_json = cJSON_CreateArray(), *skip_json = nargs ? cJSON_CreateArray() : NULL;
    rc = nargs ? cli_model_image_params("embed", mean, std, override, m, model, &ip)
               : cli_model_text("embed", tokenizer, override, m, model, 1, &text);
    if (!rc && nargs) rc = cli_list_images("embed", args, nargs, &inputs, &n);
    for (int i = 0; !rc && nargs && i < n; i++) rc = cli_check_output("embed", "-o", output, &(cli_input){"--images", inputs[i]}, 1);
    if (!rc && texts_path) {
        rc = cli_read_lines_numbered("embed", texts_path, &inputs, &lineno, &nt);
        n = (int)nt;
        if (!rc && !n) rc = cli_error("embed", "--texts %s: no texts (blank lines are skipped)", texts_path);
    }
    if (!rc) {
        x = malloc(sizeof(float) * (size_t)n * E), ok = malloc((size_t)n);
        if (!x || !ok || !in_json) rc = cli_error("embed", "out of memory for %d inputs", n);
    }
    if (!rc && nargs) {
        const cli_encode_params ep = {&ip, B, "images", NULL, NULL};
        if (cli_encode_images(m, (const char *const *)inputs, n, &ep, x, ok, &bad, &n_ok))
            rc = cli_error("embed", "%s", vlmoe_last_error());
        if (!rc && !n_ok) rc = cli_no_images("embed", &bad, n);
        for (int i = 0; i < n && !rc; i++)
            cJSON_AddItemToArray(ok[i] ? in_json : skip_json, cJSON_CreateString(inputs[i]));
    } else if (!rc) {
        rc = embed_texts(m, &text, inputs, lineno, n, B, texts_path, x);
        for (int i = 0; i < n && !rc; i++) cJSON_AddItemToArray(in_json, cJSON_CreateNumber((double)lineno[i]));
        n_ok = n;
    }
    const char *name = nargs ? "image_embeds" : "text_embeds";
    const size_t olen = strlen(output);
    const int npy = format ? !strcmp(format, "npy") : olen >= 4 && !strcmp(output + olen - 4, ".npy");
    if (!rc && npy && vlmoe_npy_write_f32(output, x, n_ok, E)) rc = cli_error("embed", "%s", vlmoe_last_error());
    if (!rc && !npy) rc = write_out(output, model, name, x, n_ok, E, in_json, skip_json);
    if (!rc) {
        printf("vlmoe embed: %d %s%s -> %s: %s (%d, %d) %s", n_ok, nargs ? "image" : "text", n_ok == 1 ? "" : "s",
               output, npy ? "npy" : name, n_ok, E, npy ? "<f4" : "F32");
        if (bad.n) printf("; %ld unreadable image%s skipped (metadata \"skipped\")", bad.n, bad.n == 1 ? "" : "s");
        printf("\n");
        char where[32];
        snprintf(where, sizeof(where), "%d files", n);
        cli_bad_warn("embed", &bad, "unreadable image", where);
    }
    cJSON_Delete(in_json), cJSON_Delete(skip_json);
    free(x), free(ok), free(lineno), free(args);
    if (nargs) vlmoe_free_strings(inputs, n);
    else cli_free_lines(inputs, nt);
    cli_text_free(&text);
    vlmoe_model_free(m);
    return rc;
}
