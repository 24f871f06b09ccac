// backend.c: what the backend tables share and that has no scalar type: the ops' names (for
// errors and tests/test_backend_ops.c) and picking a table by the name a user gives (`--device`).
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "ops/backend.h"

static const char *const op_names[BE_OP_COUNT] = {
    "linear", "layernorm", "act", "softmax", "attention", "patchify", "embed", "posadd", "cls",
    "pool", "l2norm", "contrastive", "xent", "gather_rows", "combine", "combine_weights",
    "router_noise", "aux_loss", "soft_moe", "experts", "sumsq", "scale", "adamw", "clamp",
    "pixels", "step_scalars",
    "route",
};

const char *be_op_name(be_op op) {
    return op >= 0 && op < BE_OP_COUNT ? op_names[op] : "unknown";
}

int backend_by_name(const vlmoe_backend_f32 **out, vlmoe_backend_f32 **owned, const char *name) {
    *out = NULL;
    *owned = NULL;
    if (!name || !strcmp(name, "cpu")) {
        *out = backend_cpu_f32();
        return VLMOE_OK;
    }
    if (!strncmp(name, "cuda", 4) && (name[4] == 0 || name[4] == ':')) {
        int dev = 0;
        if (name[4] == ':') {
            char *end;
            long v = strtol(name + 5, &end, 10);
            if (end == name + 5 || *end || v < 0 || v > 1024)
                return vlmoe_fail(VLMOE_ERR_ARG, "device '%s': expected cuda:N with N a device number", name);
            dev = (int)v;
        }
        int st = backend_cuda_init(owned, dev);
        if (!st) *out = *owned;
        return st;
    }
    return vlmoe_fail(VLMOE_ERR_ARG, "device '%s': expected cpu, cuda or cuda:N", name);
}
