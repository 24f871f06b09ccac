// device.c: where a model runs (the --device flag): "cpu", the default, or "cuda[:N]". A CUDA
// build opens the device's backend table (src/cuda/) and a build without CUDA=1 says how to make
// one (src/cuda/cuda_stub.c). On a table without host memory the parameters keep their master
// copy on the host (optimizer, checkpoints) and the graphs read a device copy uploaded before each
// forward; gradients come back by download. Covered by tests/test_model.c (a CPU table with its
// own memory) and tests/test_cli.c. --precision bf16 picks the CPU's bf16 table
// (src/ops/backend_cpu.c) where the CPU has bf16 instructions (tests/test_bf16.c), and on a CUDA
// device that table's bf16 twin (src/cuda/bf16_cuda.cu; tests/test_backend_ops.c on a GPU).
#include <string.h>

#include "core/core.h"
#include "nn/model.h"
#include "ops/backend.h"
#include "ops/gemm_bf16.h"

int model_set_device(vlmoe_model *m, const char *name) {
    const vlmoe_backend_f32 *be = NULL;
    vlmoe_backend_f32 *owned = NULL;
    int st = backend_by_name(&be, &owned, name);
    if (st) return vlmoe_error_prefix("--device"), st;
    if (be == m->be) return VLMOE_OK;
    if ((st = model_set_backend(m, be, owned))) return vlmoe_error_prefix("--device %s", name), st;
    return VLMOE_OK;
}

int model_set_precision(vlmoe_model *m, const char *name, int *fell_back) {
    *fell_back = 0;
    const vlmoe_backend_f32 *cpu = backend_cpu_f32(), *bf16 = backend_cpu_bf16();
    const int want16 = name && !strcmp(name, "bf16");
    if (name && !want16 && strcmp(name, "fp32"))
        return vlmoe_fail(VLMOE_ERR_ARG, "--precision '%s': expected fp32 or bf16", name);
    // on a CUDA device (the model owns its table): the table's bf16 twin, or back to the table
    if (m->owned_be) {
        const vlmoe_backend_f32 *to = m->owned_be;
        int st = want16 ? backend_cuda_bf16(&to, m->owned_be) : VLMOE_OK;
        if (st) return st;
        return to == m->be ? VLMOE_OK : model_set_backend(m, to, m->owned_be);
    }
    if (!want16) return m->be == bf16 ? model_set_backend(m, cpu, NULL) : VLMOE_OK;
    if (m->be != cpu && m->be != bf16)
        return vlmoe_fail(VLMOE_ERR_ARG, "--precision bf16: the %s backend computes in fp32 only; use "
                          "--precision fp32 there", m->be->name);
    if (!gemm_bf16_native()) {
        *fell_back = 1;
        return VLMOE_OK;
    }
    return m->be == bf16 ? VLMOE_OK : model_set_backend(m, bf16, NULL);
}

static void drop_device(vlmoe_model *m) {
    if (m->d_params) m->be->free(m->be, m->d_params);
    if (m->d_grads) m->be->free(m->be, m->d_grads);
    m->d_params = m->d_grads = NULL;
}

int model_set_backend(vlmoe_model *m, const vlmoe_backend_f32 *be, vlmoe_backend_f32 *owned) {
    if (m->L.arch != &model_arch_towers && !be->host_memory) {
        if (owned != m->owned_be) backend_cuda_free(owned);
        return vlmoe_fail(VLMOE_ERR_CONFIG, "model '%s': VL-MoE models run on the CPU only for now (the %s backend "
                          "has no host memory)", m->L.cfg.name, be->name);
    }
    // the graphs were planned on the old table: plan again on the new one at the next forward
    m->L.arch->free(m);
    m->planned_B = 0, m->have_forward = 0;
    drop_device(m);
    vlmoe_backend_f32 *old = m->owned_be;
    m->be = be, m->owned_be = owned;
    if (old != owned) backend_cuda_free(old); // kept when be is old's bf16 twin (or old itself)
    if (!be->host_memory) {
        const size_t bytes = sizeof(float) * m->L.total;
        m->d_params = be->alloc(be, bytes, "parameters on the device");
        m->d_grads = be->alloc(be, bytes, "gradients on the device");
        if (!m->d_params || !m->d_grads) {
            drop_device(m);
            m->be = backend_cpu_f32(), m->owned_be = NULL;
            backend_cuda_free(owned);
            return vlmoe_fail(VLMOE_ERR_NOMEM, "%zu bytes of parameters and gradients on %s", 2 * bytes, be->name);
        }
    }
    return VLMOE_OK;
}

void model_release_backend(vlmoe_model *m) {
    drop_device(m);
    backend_cuda_free(m->owned_be);
    m->owned_be = NULL;
}

const float *model_params_for_graph(vlmoe_model *m) {
    if (!m->d_params) return m->params;
    m->be->upload(m->be, m->d_params, m->params, m->L.total);
    return m->d_params;
}

const vlmoe_backend_f32 *model_host_backend(const vlmoe_model *m) {
    return m->be->host_memory ? m->be : backend_cpu_f32();
}
