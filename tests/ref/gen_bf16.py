"""gen_bf16.py: how far PyTorch's own CPU bf16 autocast moves the one_tower parity model
(gen_model.py's, same weights and inputs) from its fp32 result: the loss, both embeddings and
the parameter gradients. tests/test_bf16.c bounds vlmoe's `--precision bf16` by these numbers.

Writes bf16_one_tower.safetensors: scalars loss_rel (|L_bf16 - L_fp32| / |L_fp32|), emb_err (max
abs difference of the unit-norm image and text embeddings) and grad_rel (the L2 norm of the
gradient difference over all parameters over the L2 norm of the fp32 gradient)."""
import os

import numpy as np
import torch

import st
from gen_model import config
from model_ref import Model, perturb_


def run(m, images, tokens, lens, bf16):
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = m(images, tokens, lens)
        emb = torch.cat([m.encode_image(images), m.encode_text(tokens, lens)]).float()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in m.parameters()])
    return loss.item(), emb.detach(), grad.clone()


def generate(out):
    # gen_model.py's one_tower model and inputs, drawn in the same order from the same seed
    torch.manual_seed(1)
    cfg = config("one_tower")
    m = Model(cfg)
    perturb_(m)
    b, t = 6, cfg["context_length"]
    images = torch.randn(b, 3, cfg["image_size"], cfg["image_size"])
    lens = torch.tensor([8, 5, 2, 7, 3, 8])
    tokens = torch.randint(0, cfg["vocab_size"], (b, t))
    tokens[torch.arange(t)[None, :] >= lens[:, None]] = 0
    l32, e32, g32 = run(m, images, tokens, lens, False)
    l16, e16, g16 = run(m, images, tokens, lens, True)
    res = {"loss_rel": abs(l16 - l32) / abs(l32), "emb_err": (e16 - e32).abs().max().item(),
           "grad_rel": ((g16 - g32).norm() / g32.norm()).item()}
    st.save(os.path.join(out, "bf16_one_tower.safetensors"),
            {k: np.array(v, dtype=np.float64) for k, v in res.items()},
            {"what": "PyTorch CPU bf16 autocast against fp32 on model_one_tower"})
    print("fixtures: torch bf16 autocast vs fp32 on one_tower: " + ", ".join(f"{k} {v:.3g}" for k, v in res.items()))


if __name__ == "__main__":
    import sys
    generate(sys.argv[1])
