// upcycle.c: `vlmoe upcycle`: sparse upcycling (CLIP-UP sec. 3, MOE.md "Sparse upcycling") of a
// dense vlmoe model file: chosen MLPs become experts that start as copies, routers are new, and
// the MoE config goes into the output's config. Library in src/nn/upcycle.c; tests in
// tests/test_clip_import.c and tests/test_cli.c.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "outputs.h"
#include "vlmoe.h"

static const char *USAGE =
    "usage: vlmoe upcycle IN.safetensors -o OUT.safetensors [--experts 8] [--top-k 2]\n"
    "                     [--moe-layers every_2] [--towers image,text] [--noise 0] [--seed S]\n\n"
    "Turns a dense vlmoe model (from `vlmoe import` or `vlmoe train`) into a sparse one, as CLIP-UP\n"
    "does: the MLP of every chosen block becomes E experts, each a copy of it (plus N(0, noise^2)),\n"
    "with a freshly initialised router; every other weight is copied. Routing and auxiliary losses\n"
    "come from --preset (clipup: top-2, first come first served, capacity factor 2, switch balance\n"
    "0.01 + z-loss 0.001; limoe: top-1, BPR, noisy routing, the LIMoE losses) and the flags that\n"
    "override it. The result is a model file with its MoE config: train it with\n"
    "`vlmoe train --pretrained OUT.safetensors`. With --top-k 1, --gate-renorm after_routing and\n"
    "a capacity factor >= experts it computes exactly what the dense model did.";

// "every_N" or a comma-separated list of block indices, within a tower of `layers` blocks.
static int parse_layers(const char *s, int layers, uint64_t *out) {
    *out = 0;
    if (!strncmp(s, "every_", 6)) {
        char *end;
        long n = strtol(s + 6, &end, 10);
        if (*end || n < 1) return cli_error("upcycle", "--moe-layers %s: expected every_N with N >= 1", s);
        *out = vlmoe_moe_every((int)(n > layers ? layers + 1 : n), layers);
    } else {
        for (const char *p = s; *p;) {
            char *end;
            long l = strtol(p, &end, 10);
            if (end == p || (*end && *end != ',') || l < 0 || l >= layers || l >= 64)
                return cli_error("upcycle", "--moe-layers %s: expected every_N or block indices in [0, %d) "
                                 "separated by commas", s, layers < 64 ? layers : 64);
            *out |= 1ULL << l;
            p = *end ? end + 1 : end;
        }
    }
    return *out ? 0 : cli_error("upcycle", "--moe-layers %s selects no block of a %d-block tower", s, layers);
}

int cmd_upcycle(int argc, char **argv) {
    const char *out = NULL, *layers = "every_2", *towers = NULL, *preset = "clipup", *renorm = NULL;
    int experts = 0, top_k = 0;
    double cf = 0, ecf = 0, noise = 0;
    long seed = 0;
    const arg_spec specs[] = {
        {"output", ARG_STRING, &out, "FILE", "the upcycled model file to write (also -o)"},
        {"preset", ARG_STRING, &preset, "NAME", "routing and auxiliary losses: clipup (default) or limoe"},
        {"experts", ARG_INT1, &experts, "E", "experts per MoE layer (default 8)"},
        {"top-k", ARG_INT1, &top_k, "K", "experts per token (default: the preset's, clipup 2)"},
        {"moe-layers", ARG_STRING, &layers, "every_N|L,L", "which blocks become MoE layers (default every_2: blocks 1, 3, ...)"},
        {"towers", ARG_STRING, &towers, "image,text", "two_tower: which towers get MoE layers (default both)"},
        {"capacity-factor", ARG_POS, &cf, "CF", "expert capacity factor in training and evaluation (default: the preset's)"},
        {"eval-capacity-factor", ARG_POS, &ecf, "CF", "expert capacity factor in evaluation (default: --capacity-factor)"},
        {"gate-renorm", ARG_STRING, &renorm, "KIND", "none or after_routing (renormalise the kept gates; default: the preset's)"},
        {"noise", ARG_DOUBLE, &noise, "STD", "std of the Gaussian noise added to each expert's copy (default 0)"},
        {"seed", ARG_LONG, &seed, "N", "seed of the router initialisation and the noise (default 0)"},
    };
    char *pos[1];
    int npos, rc = args_parse_pos("upcycle", specs, 11, argc, argv, 2, USAGE, pos, 1, &npos);
    if (rc) return rc == 1 ? 0 : 2;
    if (npos != 1 || !out) return cli_error("upcycle", "give IN.safetensors and -o OUT.safetensors (see vlmoe upcycle --help)");
    if (cli_check_output("upcycle", "-o", out, &(cli_input){"the input", pos[0]}, 1)) return 1;
    vlmoe_moe_config mc;
    memset(&mc, 0, sizeof(mc));
    mc.num_experts = experts;
    if (vlmoe_moe_preset(preset, &mc)) return cli_error("upcycle", "--preset: %s", vlmoe_last_error());
    if (top_k) mc.top_k = top_k;
    if (cf > 0) mc.capacity_factor = mc.eval_capacity_factor = cf;
    if (ecf > 0) mc.eval_capacity_factor = ecf;
    if (renorm && strcmp(renorm, "none") && strcmp(renorm, "after_routing"))
        return cli_error("upcycle", "--gate-renorm %s: expected none or after_routing", renorm);
    if (renorm) mc.gate_renorm = strcmp(renorm, "none") ? VLMOE_RENORM_AFTER_ROUTING : VLMOE_RENORM_NONE;
    vlmoe_model *dense, *m = NULL;
    if (vlmoe_model_load(&dense, pos[0])) return cli_error("upcycle", "%s", vlmoe_last_error());
    const vlmoe_model_config *c = vlmoe_model_get_config(dense);
    const int two = c->arch == VLMOE_ARCH_TWO_TOWER;
    const char *tw = towers ? towers : two ? "image,text" : "image";
    const int img = !strcmp(tw, "image") || !strcmp(tw, "image,text") || !strcmp(tw, "text,image");
    const int txt = !strcmp(tw, "text") || !strcmp(tw, "image,text") || !strcmp(tw, "text,image");
    vlmoe_moe_config moe[2] = {mc, mc};
    if (!img && !txt) rc = cli_error("upcycle", "--towers %s: expected image, text or image,text", tw);
    else if (txt && !two) rc = cli_error("upcycle", "--towers %s: %s is one_tower (one shared encoder): leave --towers out", tw, pos[0]);
    for (int t = 0; t < 2 && !rc; t++) {
        if (t ? !txt : !img) memset(&moe[t], 0, sizeof(moe[t])); // this tower stays dense
        else rc = parse_layers(layers, t ? c->text_encoder.layers : c->encoder.layers, &moe[t].layers);
    }
    if (!rc && vlmoe_model_upcycle(&m, dense, &moe[0], two ? &moe[1] : NULL, (uint64_t)seed, noise))
        rc = cli_error("upcycle", "%s: %s", pos[0], vlmoe_last_error());
    if (!rc && vlmoe_model_save(m, out)) rc = cli_error("upcycle", "%s", vlmoe_last_error());
    if (!rc) {
        printf("upcycled %s -> %s (%zu -> %zu parameters)\n", pos[0], out, vlmoe_model_num_floats(dense),
               vlmoe_model_num_floats(m));
        for (int t = 0; t < 2; t++) {
            if (!moe[t].layers) continue;
            printf("  %s blocks", two ? (t ? "text tower" : "image tower") : "encoder");
            for (int l = 0; l < 64; l++)
                if (moe[t].layers >> l & 1) printf(" %d", l);
            printf(": %d experts, top-%d, capacity factor %g (eval %g), gates %s, %s preset\n", mc.num_experts,
                   mc.top_k, mc.capacity_factor, mc.eval_capacity_factor,
                   mc.gate_renorm ? "renormalised after routing" : "as routed", preset);
        }
    }
    vlmoe_model_free(m);
    vlmoe_model_free(dense);
    return rc;
}
