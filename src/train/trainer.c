// trainer.c: one optimisation step of a contrastive model: forward, backward, the divergence
// guard (a non-finite loss or gradient stops the step before any parameter changes), global-norm
// clipping, the learning-rate schedule, the optimizer update and CLIP's temperature clamp.
// Covered by tests/test_train.c and, against PyTorch, tests/test_parity.c.
#include <math.h>
#include <stdlib.h>

#include "core/core.h"
#include "vlmoe.h"

struct vlmoe_trainer {
    vlmoe_model *m;
    vlmoe_optim *opt;
    vlmoe_train_params p;
};

vlmoe_train_params vlmoe_train_default_params(void) {
    vlmoe_train_params p;
    p.optim = vlmoe_optim_default_params(VLMOE_OPT_ADAMW);
    p.optim.beta2 = 0.98f; // OpenCLIP's ViT default
    p.optim.eps = 1e-6f;
    p.optim.weight_decay = 0.2f;
    p.schedule = (vlmoe_schedule){VLMOE_SCHED_COSINE, 5e-4, 100, 1000, 0.0, 0, 0};
    p.grad_clip_norm = 1.0;
    return p;
}

int vlmoe_trainer_init(vlmoe_trainer **out, vlmoe_model *m, const vlmoe_train_params *p) {
    *out = NULL;
    vlmoe_trainer *t = calloc(1, sizeof(*t));
    if (!t) return vlmoe_fail(VLMOE_ERR_NOMEM, "trainer");
    t->m = m;
    t->p = *p;
    int n;
    const vlmoe_param_info *tab = vlmoe_model_params(m, &n);
    int st = vlmoe_optim_init(&t->opt, &p->optim, tab, n, vlmoe_model_num_floats(m));
    if (st) return free(t), st;
    *out = t;
    return VLMOE_OK;
}

void vlmoe_trainer_free(vlmoe_trainer *t) {
    if (!t) return;
    vlmoe_optim_free(t->opt);
    free(t);
}

long vlmoe_trainer_get_step(const vlmoe_trainer *t) { return vlmoe_optim_get_step(t->opt); }
vlmoe_optim *vlmoe_trainer_optim(vlmoe_trainer *t) { return t->opt; }
vlmoe_model *vlmoe_trainer_model(vlmoe_trainer *t) { return t->m; }
const vlmoe_train_params *vlmoe_trainer_params(const vlmoe_trainer *t) { return &t->p; }

int vlmoe_trainer_step(vlmoe_trainer *t, const vlmoe_batch *b, vlmoe_step_stats *stats) {
    vlmoe_step_stats s;
    const long step = vlmoe_optim_get_step(t->opt);
    int st = vlmoe_model_forward(t->m, b, &s);
    if (st) {
        vlmoe_error_prefix("step %ld", step);
        return st;
    }
    if ((st = vlmoe_model_backward(t->m))) return st;
    if ((st = vlmoe_model_check_finite(t->m, 1))) {
        vlmoe_error_prefix("step %ld", step);
        return st;
    }
    float *g = vlmoe_model_grad_data(t->m);
    s.grad_norm = vlmoe_clip_grad_norm(g, vlmoe_model_num_floats(t->m), t->p.grad_clip_norm);
    s.lr = vlmoe_schedule_lr(&t->p.schedule, step);
    vlmoe_optim_step(t->opt, vlmoe_model_param_data(t->m), g, (float)s.lr);
    vlmoe_model_clamp(t->m);
    if (stats) *stats = s;
    return VLMOE_OK;
}
