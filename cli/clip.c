// clip.c: `vlmoe import` (a pretrained CLIP, an HF or OpenCLIP folder or one safetensors file ->
// a vlmoe model file) and `vlmoe export` (a folder transformers, OpenCLIP or vlmoe_torch.py load,
// or one safetensors file with CLIP names). Library in src/io/clip_import.c, clip_folder.c,
// clip_export.c; tests in tests/test_clip_import.c, test_import_export.c and test_cli.c.
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
    "usage: vlmoe import DIR|IN.safetensors -o OUT.safetensors [options]\n\n"
    "Converts a pretrained CLIP into a vlmoe two_tower model file that every command loads. DIR is a\n"
    "folder as people download it: Hugging Face (config.json, model.safetensors, tokenizer.json or\n"
    "vocab.json + merges.txt, preprocessor_config.json) or OpenCLIP (open_clip_config.json,\n"
    "open_clip_model.safetensors). Its config gives heads, activation (HF hidden_act quick_gelu, gelu,\n"
    "gelu_pytorch_tanh; OpenCLIP quick_gelu) and LayerNorm eps, every size it names is checked against\n"
    "the tensors, and its tokenizer and image normalisation go into the model file. A flag that\n"
    "contradicts the config is an error. One safetensors file (OpenAI/OpenCLIP names,\n"
    "visual.transformer.resblocks.N..., or HF CLIPModel names, vision_model.encoder.layers.N...; F32,\n"
    "F16 or BF16) has sizes in its shapes but not its heads: when the width allows several head counts\n"
    "the error lists them; give --image-heads / --text-heads (and --act: quick_gelu for OpenAI's\n"
    "models, gelu for most OpenCLIP-trained ones). PyTorch pickles (.pt, .bin) are refused with the\n"
    "command that converts them to safetensors: vlmoe never runs a pickle. --tokenizer (CLIP merges or\n"
    "tokenizer.json) and --image-mean/--image-std replace what the folder records (default: none, and\n"
    "OpenAI's mean and std).";

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
    const char *out = NULL, *act = NULL, *tokenizer = NULL, *mean = NULL, *std = NULL;
    const arg_spec specs[] = {
        {"from", ARG_STRING, &p.naming, "NAMING", "a file's names: openclip (OpenAI/OpenCLIP), hf (HF CLIPModel) or auto (default)"},
        {"output", ARG_STRING, &out, "FILE", "the vlmoe model file to write (also -o)"},
        {"image-heads", ARG_INT, &p.image_heads, "N", "attention heads of the image tower (default: the folder's config)"},
        {"text-heads", ARG_INT, &p.text_heads, "N", "attention heads of the text tower (default: the folder's config)"},
        {"act", ARG_STRING, &act, "ACT", "quick_gelu, gelu or gelu_tanh (default: the folder's config, else quick_gelu)"},
        {"name", ARG_STRING, &p.name, "NAME", "the model's name in its config (default clip)"},
        {"tokenizer", ARG_STRING, &tokenizer, "FILE", "the model's tokenizer (CLIP merges or tokenizer.json), kept in the file"},
        {"image-mean", ARG_STRING, &mean, "R,G,B", "its normalisation mean, kept in the file (with --image-std)"},
        {"image-std", ARG_STRING, &std, "R,G,B", "its normalisation std, kept in the file (with --image-mean)"},
    };
    char *pos[1];
    int npos, rc = args_parse_pos("import", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, IMPORT_USAGE,
                                  pos, 1, &npos);
    if (rc) return rc == 1 ? 0 : 2;
    if (npos != 1 || !out) return cli_error("import", "give DIR or IN.safetensors and -o OUT.safetensors (see vlmoe import --help)");
    for (int k = 0; act && k < 3; k++)
        if (!strcmp(act, ACTS[k])) p.act = k;
    if (act && p.act < 0) return cli_error("import", "--act %s: expected quick_gelu, gelu or gelu_tanh", act);
    if (p.image_heads < 0 || p.text_heads < 0) return cli_error("import", "--image-heads and --text-heads must be >= 1");
    if (!mean != !std) return cli_error("import", "give --image-mean and --image-std together (the model's preprocessing)");
    // a folder's files are inputs too: -o must not land on the weights or tokenizer it reads
    static const char *const FILES[] = {"model.safetensors", "open_clip_model.safetensors", "config.json",
                                        "open_clip_config.json", "preprocessor_config.json", "tokenizer.json",
                                        "merges.txt", "vocab.json"};
    enum { NF = sizeof(FILES) / sizeof(FILES[0]) };
    char paths[NF][4096];
    cli_input in[2 + NF] = {{"the input", pos[0]}, {"--tokenizer", tokenizer}};
    for (int k = 0; k < NF; k++) {
        if (snprintf(paths[k], sizeof paths[k], "%s/%s", pos[0], FILES[k]) >= (int)sizeof paths[k])
            return cli_error("import", "%s: name too long", pos[0]);
        in[2 + k] = (cli_input){"the input folder's", paths[k]};
    }
    if (cli_check_output("import", "-o", out, in, 2 + NF)) return 1;
    vlmoe_model *m;
    if (vlmoe_clip_import_path(&m, pos[0], &p)) return cli_error("import", "%s", vlmoe_last_error());
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
        const model_inputs *mi = model_get_inputs(m);
        printf("imported %s -> %s\n", pos[0], out);
        describe(m);
        printf("  tokenizer: %s; image normalisation: %s\n", mi->text == MODEL_TEXT_BPE ? "recorded" : "none recorded (give --tokenizer)",
               mi->has_norm ? "recorded" : "none recorded (OpenAI's unless --image-mean/--image-std)");
    }
    vlmoe_model_free(m);
    return rc ? 1 : 0;
}

static const char *EXPORT_USAGE =
    "usage: vlmoe export --model M.safetensors --to hf|open_clip|torch DIR [--force] [--dtype f32|f16|bf16]\n"
    "       vlmoe export --model M.safetensors --to openclip|hf -o OUT.safetensors [--dtype ...]\n\n"
    "Writes the model into folder DIR so that others load it:\n"
    "  hf         config.json, model.safetensors (CLIPModel names), the tokenizer (tokenizer.json, or\n"
    "             vocab.json + merges.txt + tokenizer_config.json), preprocessor_config.json:\n"
    "             transformers' CLIPModel/CLIPProcessor.from_pretrained(DIR)\n"
    "  open_clip  open_clip_config.json and open_clip_model.safetensors:\n"
    "             open_clip.create_model_and_transforms('local-dir:DIR')\n"
    "  torch      model.safetensors (vlmoe's model file), config.json and vlmoe_torch.py, a small PyTorch\n"
    "             module that computes the model's embeddings: any one_tower or two_tower model, MoE\n"
    "             included (import vlmoe_torch; vlmoe_torch.load(DIR).encode_images(x))\n"
    "hf and open_clip take dense two_tower models in OpenAI CLIP's layout (an imported CLIP, or one\n"
    "trained from ViT-B-16 and the like). DIR is created; a folder that is not empty is refused unless\n"
    "--force, which writes over the files export writes and leaves the others. With -o, one\n"
    "safetensors file with CLIP names and no config (the loader's config gives heads and act).";

// python/vlmoe_torch.py, built into the program by the Makefile (build/gen/vlmoe_torch_py.c)
extern const unsigned char cli_vlmoe_torch_py[];
extern const unsigned long cli_vlmoe_torch_py_len;

int cmd_export(int argc, char **argv) {
    const char *model = NULL, *to = NULL, *out = NULL, *dt = "f32";
    int force = 0;
    const arg_spec specs[] = {
        {"model", ARG_STRING, &model, "FILE", "the vlmoe model to export"},
        {"to", ARG_STRING, &to, "FORMAT", "hf, open_clip or torch (a folder); with -o: openclip or hf names"},
        {"output", ARG_STRING, &out, "FILE", "one safetensors file with CLIP names instead of a folder (also -o)"},
        {"dtype", ARG_STRING, &dt, "TYPE", "f32 (default), f16 or bf16 (hf, open_clip)"},
        {"force", ARG_FLAG, &force, NULL, "write into a folder that is not empty"},
    };
    char *pos[1];
    int npos, rc = args_parse_pos("export", specs, (int)(sizeof(specs) / sizeof(specs[0])), argc, argv, 2, EXPORT_USAGE,
                                  pos, 1, &npos);
    if (rc) return rc == 1 ? 0 : 2;
    if (!model || !to || (!out) == (npos != 1))
        return cli_error("export", "give --model, --to and either a folder DIR or -o FILE (see vlmoe export --help)");
    const vlmoe_dtype dtype = !strcmp(dt, "f16") ? VLMOE_DT_F16 : !strcmp(dt, "bf16") ? VLMOE_DT_BF16 : VLMOE_DT_F32;
    if (dtype == VLMOE_DT_F32 && strcmp(dt, "f32")) return cli_error("export", "--dtype %s: expected f32, f16 or bf16", dt);
    if (!out && strcmp(to, "hf") && strcmp(to, "open_clip") && strcmp(to, "openclip") && strcmp(to, "torch"))
        return cli_error("export", "--to %s: expected hf, open_clip or torch", to);
    const cli_input in = {"--model", model};
    if (out && cli_check_output("export", "-o", out, &in, 1)) return 1;
    // a folder export (with --force) may replace these files: none of them may be the model read
    static const char *const FILES[] = {"model.safetensors", "open_clip_model.safetensors", "config.json",
                                        "open_clip_config.json", "preprocessor_config.json", "tokenizer.json",
                                        "tokenizer_config.json", "merges.txt", "vocab.json", "vlmoe_torch.py"};
    for (size_t k = 0; !out && k < sizeof(FILES) / sizeof(FILES[0]); k++) {
        char path[4096];
        if (snprintf(path, sizeof path, "%s/%s", pos[0], FILES[k]) >= (int)sizeof path)
            return cli_error("export", "%s: folder name too long", pos[0]);
        if (cli_check_output("export", "the folder's", path, &in, 1)) return 1;
    }
    vlmoe_model *m;
    if (vlmoe_model_load(&m, model)) return cli_error("export", "%s", vlmoe_last_error());
    vlmoe_export_params ep = vlmoe_export_default_params();
    ep.to = to, ep.force = force, ep.dtype = dtype;
    ep.torch_module = (const char *)cli_vlmoe_torch_py, ep.torch_module_len = cli_vlmoe_torch_py_len;
    rc = out ? vlmoe_clip_export(m, out, to, dtype) : vlmoe_model_export_dir(m, pos[0], &ep);
    if (rc) {
        cli_error("export", "%s", vlmoe_last_error());
    } else {
        printf("exported %s -> %s (%s, %s)\n", model, out ? out : pos[0], out ? (!strcmp(to, "hf") ? "hf names" : "openclip names") : to,
               vlmoe_dtype_name(!out && !strcmp(to, "torch") ? VLMOE_DT_F32 : dtype));
        describe(m);
        if (!out && model_get_inputs(m)->text != MODEL_TEXT_BPE)
            printf("  note: the model records no BPE tokenizer, so %s holds none\n", pos[0]);
    }
    vlmoe_model_free(m);
    return rc ? 1 : 0;
}
