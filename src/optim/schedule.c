// schedule.c: learning-rate schedules: linear warmup, then cosine decay (SGDR, Loshchilov & Hutter
// 2017, without restarts), big_vision's "rsqrt" with linear cooldown (LIMoE H/14, Zhai et al.
// 2022 ViT scaling), or constant. Covered by tests/test_optim.c (golden values at key steps).
#include <math.h>

#include "core/core.h"

// `step` counts updates from 0 and the value is the lr used for update number step+1, so warmup
// starts at base_lr/warmup rather than at 0 (a zero first update would waste a step).
//   warmup (all kinds), step < W:  lr = base_lr * (step+1) / W
//   COSINE: p = clamp((step - W) / max(1, T - W), 0, 1)
//           lr = end_lr + 0.5 * (base_lr - end_lr) * (1 + cos(pi * p))
//   RSQRT:  s = timescale > 0 ? timescale : W (1 if that is 0 too)
//           lr = base_lr * sqrt(s / max(step, s)), times the cooldown ramp
//           min(1, max(0, (T - step) / cooldown_steps)) when cooldown_steps > 0. The ramp also
//           multiplies warmup values, as in big_vision, so a cooldown longer than the run is
//           honoured. With s = W this equals big_vision's base / sqrt((step + s - W) / s).
//   CONST:  lr = base_lr
// An unknown kind or a NULL schedule gives 0, which makes a misconfigured run visibly stall.
double vlmoe_schedule_lr(const vlmoe_schedule *s, long step) {
    if (!s || (s->kind != VLMOE_SCHED_COSINE && s->kind != VLMOE_SCHED_RSQRT &&
               s->kind != VLMOE_SCHED_CONST))
        return 0.0;
    const long W = s->warmup_steps > 0 ? s->warmup_steps : 0, T = s->total_steps;
    const double x = step > 0 ? (double)step : 0.0;
    double lr;
    if (step < W) {
        lr = s->base_lr * (x + 1.0) / (double)W;
    } else {
        switch (s->kind) {
        case VLMOE_SCHED_COSINE: {
            const double span = T - W > 1 ? (double)(T - W) : 1.0;
            double p = (x - (double)W) / span;
            p = p < 0.0 ? 0.0 : p > 1.0 ? 1.0 : p;
            lr = s->end_lr + 0.5 * (s->base_lr - s->end_lr) * (1.0 + cos(3.14159265358979323846 * p));
            break;
        }
        case VLMOE_SCHED_RSQRT: {
            double ts = s->timescale > 0.0 ? s->timescale : (double)W;
            if (ts <= 0.0) ts = 1.0;
            lr = s->base_lr * sqrt(ts / (x > ts ? x : ts));
            break;
        }
        default: lr = s->base_lr; break;   // VLMOE_SCHED_CONST
        }
    }
    if (s->kind == VLMOE_SCHED_RSQRT && s->cooldown_steps > 0) {
        double f = ((double)T - x) / (double)s->cooldown_steps;
        f = f > 1.0 ? 1.0 : f < 0.0 ? 0.0 : f;
        lr *= f;
    }
    return lr;
}
