// device.c: where a model runs (the --device flag): "cpu", the default, or "cuda[:N]". A CUDA
// build opens the device's backend table (src/cuda/) and a build without CUDA=1 says how to make
// one (src/cuda/cuda_stub.c). Covered by tests/test_cli.c.
#include "core/core.h"
#include "nn/model.h"
#include "ops/backend.h"

int model_set_device(vlmoe_model *m, const char *name) {
    const vlmoe_backend_f32 *be = NULL;
    vlmoe_backend_f32 *owned = NULL;
    int st = backend_by_name(&be, &owned, name);
    if (st) return vlmoe_error_prefix("--device"), st;
    if (be == m->be) return VLMOE_OK;
    // the device's table runs every op (tests/test_backend_ops.c), but the model's parameters,
    // gradients and optimizer state are still host arrays that its graphs hand to the table
    const char *dev = be->name;
    backend_cuda_free(owned);
    return vlmoe_fail(VLMOE_ERR_CONFIG, "--device %s: the %s backend is built and its ops are checked by "
                      "test_backend_ops, but models do not keep their parameters on the device yet; run with "
                      "--device cpu", name, dev);
}
