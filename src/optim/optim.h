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
// The same clipping with the sum of squares already known (a device's, src/train/trainer.c).
double optim_clip_grad_norm_given(const vlmoe_backend_f32 *be, float *grads, size_t n, double max_norm,
                                  double sumsq);
// Clipping's factor for a gradient of this norm: max_norm / (norm + 1e-6) as a float when norm
// exceeds max_norm > 0, else 1 (the gradient as it is).
float optim_clip_factor(double norm, double max_norm);
// vlmoe_optim_step on the clipped gradient grads * gscale (its o->total floats): AdamW multiplies
// each gradient as it reads it, with the float multiply the scale op would do (the same bits, one
// pass over the gradient fewer); Adafactor scales grads first.
void optim_step_clipped(vlmoe_optim *o, float *params, float *grads, float lr, float gscale);

// Version nonzero: every step packs the bf16 shadows (src/ops/gemm_bf16.h) of each tensor it
// updates right after updating it, marked at this version (the trainer passes the model's
// weights version, once per step, with the cpu-bf16 table); 0: it does not.
void optim_set_shadow(vlmoe_optim *o, uint64_t version);

// The tensors the optimizer updates (a copy of its table).
const vlmoe_param_info *optim_table(const vlmoe_optim *o, int *n);

// The state buffers of the table's tensor at `offset` of shape (E, ...) (E: the experts it holds)
// with per floats per index of its leading dim, each laid out index after index: bufs[k] holds
// per_buf[k] floats per index. AdamW: its m and v at `offset` (2); Adafactor: the tensor's vr and
// vc or v, then m (up to 3); 0 when the optimizer has no state for it. For moving experts' state
// between processes (src/train/trainer.c vlmoe_trainer_gather_experts).
int optim_expert_states(const vlmoe_optim *o, size_t offset, int E, size_t per, float **bufs, size_t *per_buf);

// Whether an optimizer of params p keeps the state of tensor t (its whole shape) as one part per
// index of its leading dim, each computed from that index's gradient alone, so a process can hold
// and update a slice of its experts only (expert parallelism's sharded layout: src/nn/model.h
// model_shard): always for AdamW; for Adafactor when t is not factored over dim 0 and update
// clipping is off.
int optim_splits(const vlmoe_optim_params *p, const vlmoe_param_info *t);

// Moves o to another layout of the same tensors (expert parallelism: a process's shard of the
// expert banks, or the whole model again): table lists the same tensors in the same order, an
// expert bank with its local shape (shape[0] = experts_local) and expert0/experts_local set, or
// whole (both 0), in a flat buffer of `total` floats. The state of every expert both layouts hold
// is kept, that of experts only the new one holds is zero (the caller fills it: the trainer's
// gathers), the step is kept; keep 0: all of the new state is zero. o is unchanged on failure.
int optim_relayout(vlmoe_optim *o, const vlmoe_param_info *table, int n, size_t total, int keep);

// AdamW with the model resident on a device table (src/train/trainer.c): its m and v move to
// be's memory (*moved 1); Adafactor, or a table with host memory, stays (*moved 0, VLMOE_OK).
// optim_step_device is vlmoe_optim_step on device pointers (the table's adamw op). The host's
// state becomes a mirror: optim_sync_host downloads it when stale (will_write 1: the caller
// writes it, so the next device step uploads it); vlmoe_optim_step, vlmoe_optim_state_get,
// optim_expert_states and optim_relayout call it themselves. optim_leave_device: the state is
// the host's again.
int optim_to_device(vlmoe_optim *o, const vlmoe_backend_f32 *be, int *moved);
void optim_step_device(vlmoe_optim *o, float *d_params, const float *d_grads, float lr);
void optim_sync_host(vlmoe_optim *o, int will_write);
void optim_leave_device(vlmoe_optim *o);

#endif
