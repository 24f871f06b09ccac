// clip.c: `vlmoe import` (a pretrained CLIP with OpenAI/OpenCLIP or HF names -> a vlmoe model
// file) and `vlmoe export` (back to those names). Library in src/io/clip_import.c; tests in
// tests/test_clip_import.c and tests/test_cli.c.
#include <stdio.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "common.h"
#include "nn/model.h"
#include "vlmoe.h"

static const char *ACTS[] = {"gelu", "gelu_tanh", "quick_gelu"}; // VLMOE_ACT_* order

static const char *IMPORT_USAGE =
    "usage: vlmoe import [--from openclip|hf] IN.safetensors -o OUT.safetensors\n\n"
    "Converts a pretrained CLIP (safetensors: F32, F16 or BF16) with OpenAI/OpenCLIP state-dict names\n"
    "(visual.transformer.resblocks.N..., open_clip_pytorch_model.safetensors) or HF CLIPModel names\n"
    "(vision_model.encoder.layers.N..., model.safetensors) into a vlmoe two_tower model file that every\n"
    "command loads. Widths, depths, patch and image size, context length, vocabulary and embedding size\n"
    "come from the shapes. Heads are not in any shape: width / 64 (OpenCLIP's head width) unless\n"
    "--image-heads / --text-heads say otherwise (ViT-H/14's image tower has 16 heads of 80). OpenAI's\n"
    "models use quick_gelu; most OpenCLIP models trained from scratch use gelu (--act gelu), HF's\n"
    "config.json names it hidden_act. --tokenizer (the model's bpe_simple_vocab_16e6.txt.gz or HF\n"
    "tokenizer.json) and --image-mean/--image-std (its preprocessing: OpenAI's mean and std unless\n"
    "its config says otherwise) go into the model file, so that no later command needs them.";

static void describe(const vlmoe_model *m) {
    const vlmoe_model_config *c = vlmoe_model_get_config(m);
    const vlmoe_encoder_config *i = &c->encoder, *t = &c->text_encoder;
    printf("  image tower: width %d, layers %d, heads %d, MLP %d, patch %d, image %d px\n"
           "  text tower: width %d, layers %d, heads %d, MLP %d, context %d, vocabulary %d\n"
           "  embedding %d, act %s, %zu parameters\n",
           i->width, i->layers, i->heads, i->mlp_dim, c->patch_size, c->image_size, t->width, t->layers,
           t->heads, t->mlp_dim, c->context_length, c->vocab_size, c->embed_dim, ACTS[c->act],
           vlmoe_model_num_floats(m));
}

int cmd_import(int argc, char **argv) {
    vlmoe_clip_import_params p = vlmoe_clip_import_default_params();
    const char *out = NULL, *act = "quick_gelu", *tokenizer = NULL, *mean = NULL, *std = NULL;
    const arg_spec specs[] = {
        {"from", ARG_STRING, &p.naming, "NAMING", "openclip (OpenAI/OpenCLIP names), hf (HF CLIPModel) or auto (default)"},
        {"output", ARG_STRING, &out, "FILE", "the vlmoe model file to write (also -o)"},
        {"image-heads", ARG_INT, &p.image_heads, "N", "attention heads of the image tower (default width / 64)"},
        {"text-heads", ARG_INT, &p.text_heads, "N", "attention heads of the text tower (default width / 64)"},
        {"act", ARG_STRING, &act, "ACT", "quick_gelu (OpenAI, the default), gelu or gelu_tanh"},
        {"name", ARG_STRING, &p.name, "NAME", "the model's name in its config (default clip)"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "the model's tokenizer (CLIP merges or tokenizer.json), kept in the file"},
        {"image-mean", ARG_STRING, &mean, "R,G,B", "its normalisation mean, kept in the file (with --image-std)"},
        {"image-std", ARG_STRING, &std, "R,G,B", "its normalisation std, kept in the file (with --image-mean)"},
    };
    char *pos[1];
    int npos, rc = args_parse_pos("import", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, IMPORT_USAGE,
                                  pos, 1, &npos);
    if (rc) return rc == 1 ? 0 : 2;
    if (npos != 1 || !out) return cli_error("import", "give IN.safetensors and -o OUT.safetensors (see vlmoe import --help)");
    p.act = -1;
    for (int k = 0; k < 3; k++)
        if (!strcmp(act, ACTS[k])) p.act = k;
    if (p.act < 0) return cli_error("import", "--act %s: expected quick_gelu, gelu or gelu_tanh", act);
    if (!mean != !std) return cli_error("import", "give --image-mean and --image-std together (the model's preprocessing)");
    const cli_input in[] = {{"the input", pos[0]}, {"--tokenizer", tokenizer}};
    if (cli_check_output("import", "-o", out, in, 2)) return 1;
    vlmoe_model *m;
    if (vlmoe_clip_import(&m, pos[0], &p)) return cli_error("import", "%s", vlmoe_last_error());
    cli_text text = {0};
    vlmoe_image_params ip;
    rc = tokenizer ? cli_text_init("import", tokenizer, vlmoe_model_get_config(m), 1, &text) : 0;
    if (!rc && text.bpe && model_set_tokenizer(m, text.bpe)) rc = cli_error("import", "%s", vlmoe_last_error());
    if (!rc && mean && !(rc = cli_image_params("import", mean, std, vlmoe_model_get_config(m), &ip)))
        model_set_image_norm(m, ip.mean, ip.std);
    cli_text_free(&text);
    if (rc) return vlmoe_model_free(m), rc;
    rc = vlmoe_model_save(m, out);
    if (rc) {
        cli_error("import", "%s", vlmoe_last_error());
    } else {
        printf("imported %s -> %s\n", pos[0], out);
        describe(m);
    }
    vlmoe_model_free(m);
    return rc ? 1 : 0;
}

static const char *EXPORT_USAGE =
    "usage: vlmoe export --model M.safetensors --to openclip|hf -o OUT.safetensors [--dtype f32|f16|bf16]\n\n"
    "Writes a dense two_tower model (OpenAI CLIP's layout: an imported CLIP, or one trained from\n"
    "ViT-B-16 and the like) with OpenAI/OpenCLIP state-dict names or HF CLIPModel names. The file\n"
    "holds tensors only: the loader's config must give the heads and the act printed here. MoE and\n"
    "one_tower models have no CLIP names.";

int cmd_export(int argc, char **argv) {
    const char *model = NULL, *to = NULL, *out = NULL, *dt = "f32";
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "the vlmoe model to export"},
        {"to", ARG_STRING, &to, "NAMING", "openclip (OpenAI/OpenCLIP names) or hf (HF CLIPModel names)"},
        {"output", ARG_STRING, &out, "FILE", "the safetensors file to write (also -o)"},
        {"dtype", ARG_STRING, &dt, "TYPE", "f32 (default), f16 or bf16"},
    };
    int rc = args_parse("export", specs, 4, argc, argv, 2, EXPORT_USAGE);
    if (rc) return rc == 1 ? 0 : 2;
    if (!model || !to || !out) return cli_error("export", "give --model, --to and -o (see vlmoe export --help)");
    const vlmoe_dtype dtype = !strcmp(dt, "f16") ? VLMOE_DT_F16 : !strcmp(dt, "bf16") ? VLMOE_DT_BF16 : VLMOE_DT_F32;
    if (dtype == VLMOE_DT_F32 && strcmp(dt, "f32")) return cli_error("export", "--dtype %s: expected f32, f16 or bf16", dt);
    if (cli_check_output("export", "-o", out, &(cli_input){"--model", model}, 1)) return 1;
    vlmoe_model *m;
    if (vlmoe_model_load(&m, model)) return cli_error("export", "%s", vlmoe_last_error());
    rc = vlmoe_clip_export(m, out, to, dtype);
    if (rc) {
        cli_error("export", "%s", vlmoe_last_error());
    } else {
        printf("exported %s -> %s (%s names, %s)\n", model, out, to, vlmoe_dtype_name(dtype));
        describe(m);
    }
    vlmoe_model_free(m);
    return rc ? 1 : 0;
}
