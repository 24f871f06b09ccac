"""gen_optim.py: PyTorch parity fixture for AdamW (src/optim/optim.c), read by tests/test_optim.c.

torch.optim.AdamW runs 5 steps on two small parameters, "w" (4, 3) with weight decay and "b" (5,)
without (a second param group with weight_decay=0, as the training code's decay flag does), with
random gradients and a per-step learning rate. Every hyperparameter is a float32 value so the C
side, which holds them as float, sees exactly the numbers torch used.

optim_adamw.safetensors holds:
  hparams   F64 (4,)       beta1, beta2, eps, weight_decay
  lrs       F32 (5,)       learning rate of each step
  w.init    F32 (4, 3)     b.init  F32 (5,)       parameters before the first step
  w.grads   F32 (5, 4, 3)  b.grads F32 (5, 5)     gradient of each step
  w.after   F32 (5, 4, 3)  b.after F32 (5, 5)     parameters after each step
"""
import os

import numpy as np
import torch

from st import save

STEPS = 5


def f32(x):
    return float(np.float32(x))


def generate(outdir):
    g = torch.Generator().manual_seed(1234)
    beta1, beta2, eps, wd = f32(0.9), f32(0.999), f32(1e-8), f32(0.1)
    lrs = [f32(x) for x in (1e-2, 2e-2, 3e-2, 2e-2, 1e-2)]
    w = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    b = torch.nn.Parameter(torch.randn(5, generator=g) * 0.1)
    out = {"w.init": w.detach().clone().numpy(), "b.init": b.detach().clone().numpy()}
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": wd},
                             {"params": [b], "weight_decay": 0.0}],
                            lr=lrs[0], betas=(beta1, beta2), eps=eps)
    wg, bg, wa, ba = [], [], [], []
    for s in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lrs[s]
        w.grad = torch.randn(4, 3, generator=g)
        b.grad = torch.randn(5, generator=g) * 0.5
        if s == 2:
            b.grad[1] = 0.0  # a zero gradient: the update is m / (sqrt(v) + eps), not 0/0
        wg.append(w.grad.clone())
        bg.append(b.grad.clone())
        opt.step()
        wa.append(w.detach().clone())
        ba.append(b.detach().clone())
    out["w.grads"] = torch.stack(wg).numpy()
    out["b.grads"] = torch.stack(bg).numpy()
    out["w.after"] = torch.stack(wa).numpy()
    out["b.after"] = torch.stack(ba).numpy()
    out["hparams"] = np.array([beta1, beta2, eps, wd], dtype=np.float64)
    out["lrs"] = np.array(lrs, dtype=np.float32)
    save(os.path.join(outdir, "optim_adamw.safetensors"), out,
         metadata={"torch": torch.__version__, "generator": "tests/ref/gen_optim.py"})
