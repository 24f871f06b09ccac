// aux.h: the auxiliary losses of one routing group (MOE.md "Auxiliary losses"; V-MoE importance
// and load, ST-MoE z-loss and switch balance, LIMoE sec. 2.2.2 and appendices B.1 / E.1), as pure
// functions compiled for float (_f32, the training path) and double (_f64, the finite-difference
// checks). Implemented in src/moe/aux.c; covered by tests/test_moe_route.c.
#ifndef VLMOE_MOE_AUX_H
#define VLMOE_MOE_AUX_H
#include <stddef.h>
#include <stdint.h>

#include "vlmoe.h"

// Scratch the loss functions need, in elements of the caller's type (float or double). The
// functions keep double intermediates in it, so pass memory from malloc / vlmoe_alloc (any
// alignment of the element type is fine; the functions align it to double themselves).
size_t aux_scratch_floats(int S, int E);

// aux_input_<sfx> has the layout of vlmoe_aux_input with T-typed logits:
//   logits (S,E) clean router logits; noisy_logits (S,E) the same plus the training noise (NULL:
//   no noise, so the load loss is 0); noise_std as in the config (noise scale noise_std/E);
//   modality (S) VLMOE_MOD_* per token (NULL: all image); wanted (E) assignments routed to each
//   expert before capacity (switch loss only); global_tau per modality (tau = log(S), 0 = log 1);
//   wanted_mod (2,E) the same counts split by the token's modality, image row first (the switch
//   loss of a group holding both modalities, computed per modality; may be NULL otherwise);
//   kept (AUX_KEPT_* bits, 0: none) what the scratch still holds of these same inputs (S, E and
//   values), so the CPU computes it once, not once per loss (a table may ignore it):
//   AUX_KEPT_P: the previous call, of a kind other than load, left the clean softmax and
//   logsumexp; AUX_KEPT_LOAD: a forward's load (or v-loss) call left the load loss's per-token
//   terms, and no load call has run on this scratch since (a backward's load call uses them up).
// aux_loss_<sfx> returns the loss of `kind` on one group, computed in double. If dlogits (S,E) is
// given it ACCUMULATES weight * d(loss)/d(logits). Never allocates: scratch holds
// aux_scratch_floats(S,E) elements. Bad arguments (sizes, K outside [1,E], a modality value other
// than 0/1, a NULL pointer the loss needs) return NaN with the thread's error set (VLMOE_ERR_ARG)
// and leave dlogits untouched.
enum { AUX_KEPT_P = 1, AUX_KEPT_LOAD = 2 };

#define AUX_DECL(T, SFX)                                                                          \
    typedef struct {                                                                              \
        int S, E, K;                                                                              \
        const T *logits, *noisy_logits;                                                           \
        double noise_std;                                                                         \
        const uint8_t *modality;                                                                  \
        const int32_t *wanted;                                                                    \
        double global_tau[2];                                                                     \
        const int32_t *wanted_mod;                                                                \
        int kept;                                                                                 \
    } aux_input_##SFX;                                                                            \
    double aux_loss_##SFX(vlmoe_aux_kind kind, const aux_input_##SFX *in, double weight,          \
                          T *dlogits, T *scratch);

AUX_DECL(float, f32)
AUX_DECL(double, f64)

#endif
