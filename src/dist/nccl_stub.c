// nccl_stub.c: the NCCL process group of a build without CUDA=1 or without MPI (the Makefile
// compiles this file in place of src/dist/nccl.c). It only says how to get the real one.
// Covered by tests/test_dist.c.
#include "core/core.h"
#include "dist/impl.h"

int dist_nccl_open(vlmoe_dist **out) {
    *out = NULL;
    return vlmoe_fail(VLMOE_ERR_CONFIG, "distributed backend \"nccl\": this vlmoe was built without "
                      "it; rebuild with `make clean && make CUDA=1` (needs the CUDA toolkit's nvcc "
                      "and NCCL, and Open MPI for the bootstrap: libopenmpi-dev)");
}
