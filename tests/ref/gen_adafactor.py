"""gen_adafactor.py: parity fixture for Adafactor as LIMoE trained with it (src/optim/optim.c), read
by tests/test_optim.c.

A float32 PyTorch transcription of big_vision's optimizer chain (big_vision/optax.py: make() and
scale_by_adafactor; optax's scale_by_factored_rms, clip_by_block_rms, ema, add_decayed_weights),
in the order big_vision chains them:
  u = factored_rms(g)            beta2_t = min(cap, 1 - (count + 1)^-decay_rate), eps1 on g^2,
                                 factored over the two largest dims when both are >= 32
  u = u / max(1, rms(u) / clip)  only when clip > 0 (big_vision's default: no clipping)
  m = (1 - b1) u + b1 m          ema without debiasing; the stored m cast to bfloat16 if asked
  u = lr * m + wd * p            config.lr, then the decayed weights (wd itself, not lr * wd)
  p = p - sched(step) * u        scale_by_schedule, scale(-1), apply_updates
Twenty steps on parameters that exercise every factoring case:
  w (48, 40)       factored, a matrix                       decayed
  e (4, 40, 36)    factored over the last two, batched by 4 decayed
  odd (40, 3, 36)  factored over dims 0 and 2 (not adjacent) decayed
  tie (36, 36, 5)  equal largest dims: numpy's stable argsort picks dims 0 and 1
  small (20, 33)   not factored (20 < 32)                   decayed
  b (37,)          a vector, not factored, not decayed (some zero gradients)
Two settings: "a" (big_vision's: momentum 0.9 in float32, cap 0.999, no clipping) and "b"
(momentum 0.9 kept in bfloat16, cap 0.5 so it binds from step 3, clipping at 1).

optim_adafactor.safetensors holds:
  <s>.hparams  F64 (8,)   beta1, decay_rate, beta2_cap, clip, wd, base_lr, momentum_bf16, eps1
  sched        F32 (20,)  the schedule's factor of each step (warmup then cosine)
  <p>.init     F32 shape  <p>.grads F32 (20, shape)  <s>.<p>.after F32 (20, shape)
"""
import os

import numpy as np
import torch

from st import save

STEPS = 20
SHAPES = {"w": (48, 40), "e": (4, 40, 36), "odd": (40, 3, 36), "tie": (36, 36, 5), "small": (20, 33), "b": (37,)}
DECAY = {"w": 1, "e": 1, "odd": 1, "tie": 1, "small": 1, "b": 0}
MIN_DIM = 32


def f32(x):
    return float(np.float32(x))


def factored_dims(shape):
    # optax _factored_dims: np.argsort (stable for so few entries), the two largest
    if len(shape) < 2:
        return None
    s = np.argsort(np.array(shape), kind="stable")
    if shape[s[-2]] < MIN_DIM:
        return None
    return int(s[-2]), int(s[-1])


def factored_rms(g, st, step, hp):
    t = torch.tensor(float(step) + 1.0, dtype=torch.float32)
    beta2 = torch.minimum(torch.tensor(hp["cap"], dtype=torch.float32), 1.0 - t ** (-hp["decay_rate"]))
    g2 = g * g + hp["eps"]
    fd = factored_dims(tuple(g.shape))
    if fd is not None:
        d1, d0 = fd
        st["row"] = beta2 * st["row"] + (1.0 - beta2) * g2.mean(dim=d0)
        st["col"] = beta2 * st["col"] + (1.0 - beta2) * g2.mean(dim=d1)
        rd1 = d1 - 1 if d1 > d0 else d1
        rcm = st["row"].mean(dim=rd1, keepdim=True)
        rf = (st["row"] / rcm) ** -0.5
        cf = st["col"] ** -0.5
        return g * rf.unsqueeze(d0) * cf.unsqueeze(d1)
    st["v"] = beta2 * st["v"] + (1.0 - beta2) * g2
    return g * st["v"] ** -0.5


def init_state(shape):
    fd = factored_dims(shape)
    st = {"m": torch.zeros(shape)}
    if fd is not None:
        d1, d0 = fd
        st["row"] = torch.zeros([n for i, n in enumerate(shape) if i != d0])
        st["col"] = torch.zeros([n for i, n in enumerate(shape) if i != d1])
    else:
        st["v"] = torch.zeros(shape)
    return st


def run(hp, init, grads, sched):
    params = {k: v.clone() for k, v in init.items()}
    states = {k: init_state(SHAPES[k]) for k in SHAPES}
    after = {k: [] for k in SHAPES}
    for s in range(STEPS):
        for k in SHAPES:
            p, st, g = params[k], states[k], grads[k][s]
            u = factored_rms(g, st, s, hp)
            if hp["clip"] > 0:
                u = u / torch.clamp(torch.sqrt(torch.mean(u * u)) / hp["clip"], min=1.0)
            m = (1.0 - hp["beta1"]) * u + hp["beta1"] * st["m"]
            st["m"] = m.to(torch.bfloat16).to(torch.float32) if hp["bf16"] else m
            u = hp["lr"] * m
            if DECAY[k]:
                u = u + hp["wd"] * p
            u = sched[s] * u
            params[k] = p + (-1.0) * u
            after[k].append(params[k].clone())
    return {k: torch.stack(v) for k, v in after.items()}


def generate(outdir):
    g = torch.Generator().manual_seed(2022)
    init = {k: torch.randn(*s, generator=g) * 0.5 for k, s in SHAPES.items()}
    grads = {}
    for k, s in SHAPES.items():
        # a different scale per row of the first dim, so the factored moments are not flat
        sc = torch.exp(torch.randn(s[0], generator=g)).reshape((s[0],) + (1,) * (len(s) - 1))
        gk = torch.randn((STEPS,) + s, generator=g) * sc
        if k == "b":
            gk[4, :5] = 0.0
        grads[k] = gk
    warm, base = 4, f32(1e-2)
    sched = []
    for s in range(STEPS):
        if s < warm:
            x = (s + 1) / warm
        else:
            x = 0.5 * (1 + np.cos(np.pi * (s - warm) / (STEPS - warm)))
        sched.append(f32(x))
    out = {"sched": np.array(sched, dtype=np.float32)}
    for k in SHAPES:
        out[k + ".init"] = init[k].numpy()
        out[k + ".grads"] = grads[k].numpy()
    settings = {
        "a": {"beta1": f32(0.9), "decay_rate": f32(0.8), "cap": f32(0.999), "clip": 0.0, "wd": f32(1e-3),
              "lr": base, "bf16": 0, "eps": f32(1e-30)},
        "b": {"beta1": f32(0.9), "decay_rate": f32(0.8), "cap": f32(0.5), "clip": 1.0, "wd": f32(1e-3),
              "lr": base, "bf16": 1, "eps": f32(1e-30)},
    }
    for name, hp in settings.items():
        after = run(hp, init, grads, sched)
        for k in SHAPES:
            out[f"{name}.{k}.after"] = after[k].numpy()
        out[name + ".hparams"] = np.array([hp["beta1"], hp["decay_rate"], hp["cap"], hp["clip"], hp["wd"],
                                           hp["lr"], hp["bf16"], hp["eps"]], dtype=np.float64)
    save(os.path.join(outdir, "optim_adafactor.safetensors"), out,
         metadata={"torch": torch.__version__, "generator": "tests/ref/gen_adafactor.py"})


if __name__ == "__main__":
    import sys
    generate(sys.argv[1] if len(sys.argv) > 1 else ".")
