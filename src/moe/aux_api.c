// aux_api.c: the public vlmoe_aux_loss (include/vlmoe.h): one auxiliary loss of one group in
// float, a thin wrapper over aux_loss_f32 (src/moe/aux.c, MOE.md "Auxiliary losses") that owns
// the scratch. Covered by tests/test_moe_route.c.
#include <math.h>

#include "core/core.h"
#include "moe/aux.h"
#include "vlmoe.h"

// Unlike aux_loss_f32, this allocates its scratch on every call: it is the convenience entry for
// library users and tests, not the training path (which keeps a planned scratch buffer). It
// returns NaN with the thread's error set (vlmoe_last_error) when the scratch cannot be
// allocated or the arguments are invalid; dlogits is then left untouched.
double vlmoe_aux_loss(vlmoe_aux_kind kind, const vlmoe_aux_input *in, double weight,
                      float *dlogits) {
    if (!in) {
        vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_aux_loss: input is NULL");
        return NAN;
    }
    if (in->S < 1 || in->E < 1) {
        vlmoe_fail(VLMOE_ERR_ARG, "vlmoe_aux_loss: need S >= 1 and E >= 1 (got S=%d E=%d)", in->S,
                   in->E);
        return NAN;
    }
    aux_input_f32 a = {in->S, in->E, in->K, in->logits, in->noisy_logits, in->noise_std,
                       in->modality, in->wanted, {in->global_tau[0], in->global_tau[1]}, in->wanted_mod, 0};
    size_t n = aux_scratch_floats(in->S, in->E), bytes;
    if (vlmoe_mul_ok(n, sizeof(float), &bytes)) {
        vlmoe_fail(VLMOE_ERR_NOMEM, "vlmoe_aux_loss: scratch for S=%d E=%d overflows", in->S, in->E);
        return NAN;
    }
    float *scratch = vlmoe_alloc(bytes, "aux loss scratch");
    if (!scratch) return NAN;
    double L = aux_loss_f32(kind, &a, weight, dlogits, scratch);
    vlmoe_free_mem(scratch);
    return L;
}
