// cuda_stub.c: the CUDA backend of a build without CUDA=1 (the Makefile compiles this file in
// place of src/cuda/backend_cuda.cu). It only says how to get the real one.
#include "core/core.h"
#include "ops/backend.h"

int backend_cuda_init(vlmoe_backend_f32 **out, int device) {
    *out = NULL;
    return vlmoe_fail(VLMOE_ERR_ARG, "device cuda:%d: this vlmoe was built without CUDA=1; rebuild "
                      "with `make clean && make CUDA=1` (needs the CUDA toolkit's nvcc)", device);
}

void backend_cuda_free(vlmoe_backend_f32 *be) { (void)be; }

int backend_cuda_bf16(const vlmoe_backend_f32 **out, const vlmoe_backend_f32 *cuda) {
    *out = NULL;
    return vlmoe_fail(VLMOE_ERR_ARG, "--precision bf16: the %s backend is not a CUDA table (this vlmoe was "
                      "built without CUDA=1)", cuda ? cuda->name : "(none)");
}
