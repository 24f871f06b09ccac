// precision.c: the --precision flag of train, embed, classify and eval: fp32 (the default) or
// bf16, whose linear and expert products run in bf16 on a CPU with AVX512_BF16 or AMX
// (src/nn/device.c), or, for inference only (train refuses it), int8, whose MLP and expert
// products run in int8 on a CPU with VNNI or AVX2 (its attention's linears in bf16 where the
// CPU has it), or int8-attn, the attention's linears in int8 too. Elsewhere the run goes on in
// fp32 after a one-line notice.
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "nn/model.h"

int cli_set_precision(const char *cmd, vlmoe_model *m, const char *precision) {
    int fell_back = 0;
    if (!precision) return 0;
    const int st = model_set_precision(m, precision, &fell_back);
    if (st) return st;
    if (fell_back && !strncmp(precision, "int8", 4))
        fprintf(stderr, "vlmoe %s: --precision %s: this CPU has neither VNNI (AVX512_VNNI, AVX-VNNI) nor "
                "AVX2 for int8 products; running in fp32\n", cmd, precision);
    else if (fell_back)
        fprintf(stderr, "vlmoe %s: --precision bf16: this CPU has no bf16 instructions (AVX512_BF16 or AMX); "
                "running in fp32\n", cmd);
    return 0;
}
