// optim.h: the optimizer on a backend table (src/optim/optim.c): what the trainer uses, with the
// model's table, behind the public vlmoe_optim_init / vlmoe_clip_grad_norm (which take the CPU
// table). Covered by tests/test_optim.c and tests/test_train.c.
#ifndef VLMOE_OPTIM_H
#define VLMOE_OPTIM_H
#include "ops/backend.h"
#include "vlmoe.h"

// vlmoe_optim_init whose updates run on `be` (AdamW's update, the norm and scale of clipping);
// state off the host is VLMOE_ERR_CONFIG, a table lacking one of them
// VLMOE_ERR_ARG naming the backend and the op (backend_require_f32).
int optim_init_backend(vlmoe_optim **out, const vlmoe_optim_params *p, const vlmoe_param_info *table, int nparams,
                       size_t total, const vlmoe_backend_f32 *be);
// vlmoe_clip_grad_norm on `be`.
double optim_clip_grad_norm(const vlmoe_backend_f32 *be, float *grads, size_t n, double max_norm);

// The tensors the optimizer updates (a copy of its table), and replacing them by others of the
// same buffer (expert parallelism: an expert bank's entry narrowed to this process's experts, so
// the other experts' parameters and AdamW moments are neither updated nor touched). AdamW only:
// Adafactor's state is shaped by its table (VLMOE_ERR_CONFIG); the table is checked as at init.
const vlmoe_param_info *optim_table(const vlmoe_optim *o, int *n);
int optim_set_table(vlmoe_optim *o, const vlmoe_param_info *table, int n);

#endif
