// open.c: picks the process group for a run (src/dist/dist.h): a world of one unless asked for,
// or started by, a multi-process launcher. Covered by tests/test_dist.c.
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "dist/dist.h"

int vlmoe_dist_open(vlmoe_dist **out, const char *kind) {
    *out = NULL;
    if (!kind || !strcmp(kind, "auto") || !strcmp(kind, "single")) {
        *out = vlmoe_dist_single();
        return VLMOE_OK;
    }
    if (!strcmp(kind, "mpi") || !strcmp(kind, "nccl"))
        return vlmoe_fail(VLMOE_ERR_CONFIG, "distributed backend \"%s\" is not built into this "
                          "vlmoe yet", kind);
    return vlmoe_fail(VLMOE_ERR_ARG, "unknown distributed backend \"%s\" (expected auto, single, "
                      "mpi or nccl)", kind);
}
