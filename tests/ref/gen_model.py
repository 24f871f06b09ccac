"""gen_model.py: PyTorch parity fixtures for one transformer block and for whole tiny models
(one_tower and two_tower), written from tests/ref/model_ref.py. Consumed by tests/test_parity.c.

For each model NAME in (one_tower, two_tower):
  model_NAME.init.safetensors  a vlmoe checkpoint (parameters + config) the C side loads as is
  model_NAME.ref.safetensors   inputs, step-0 loss/logits/gradients, losses of 5 AdamW steps
                               (with clipping and the logit-scale clamp), params after 1 and 5
"""
import json
import math
import os

import numpy as np
import torch

import st
from model_ref import Block, Model, perturb_, vlmoe_array

ADAMW = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2)
CLIP_NORM = 0.5
STEPS = 5


def config(arch):
    c = {"name": f"parity-{arch}", "arch": arch, "image_size": 16, "patch_size": 4, "channels": 3,
         "vocab_size": 50, "context_length": 8, "embed_dim": 24,
         "encoder": {"width": 32, "layers": 2, "heads": 4, "mlp_dim": 64},
         "act": "gelu_tanh", "ln_eps": 1e-6, "patch_bias": True, "image_class_token": False,
         "image_ln_pre": False, "image_pool": "mean", "text_causal": False, "text_pool": "mean",
         "init_temperature": 10.0, "max_temperature": 100.0}
    if arch == "two_tower":
        c.update({"text_encoder": {"width": 24, "layers": 2, "heads": 2, "mlp_dim": 48},
                  "act": "quick_gelu", "ln_eps": 1e-5, "patch_bias": False,
                  "image_class_token": True, "image_ln_pre": True, "image_pool": "cls",
                  "text_causal": True, "text_pool": "eot", "init_temperature": 1 / 0.07})
    return c


def decays(name):
    # matrices of linear maps decay; biases, norms, embeddings and the temperature do not
    return name.endswith(("qkv.weight", "out.weight", "fc1.weight", "fc2.weight",
                          "patch_embed.weight", "proj"))


def gen_model(out, arch):
    torch.manual_seed(1 if arch == "one_tower" else 2)
    cfg = config(arch)
    m = Model(cfg)
    perturb_(m)
    names = m.to_vlmoe()
    st.save(os.path.join(out, f"model_{arch}.init.safetensors"),
            {k: vlmoe_array(k, v) for k, v in names.items()},
            {"vlmoe.config": json.dumps(cfg), "format": "pt"})
    b, t = 6, cfg["context_length"]
    images = torch.randn(b, 3, cfg["image_size"], cfg["image_size"])
    lens = torch.tensor([8, 5, 2, 7, 3, 8])
    tokens = torch.randint(0, cfg["vocab_size"], (b, t))
    tokens[torch.arange(t)[None, :] >= lens[:, None]] = 0
    decay = [p for k, p in names.items() if decays(k)]
    rest = [p for k, p in names.items() if not decays(k)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], **ADAMW)
    ref = {"input.images": images.numpy(), "input.tokens": tokens.int().numpy(),
           "input.lens": lens.int().numpy()}
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss, logits = m(images, tokens, lens)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            ref["step0.logits"] = logits.detach().numpy()
            for k, p in names.items():
                ref["grad." + k] = vlmoe_array(k, p.grad)
        torch.nn.utils.clip_grad_norm_(list(names.values()), CLIP_NORM)
        opt.step()
        with torch.no_grad():
            m.logit_scale.clamp_(0, math.log(cfg["max_temperature"]))
        if step in (0, STEPS - 1):
            for k, p in names.items():
                ref[f"after{step + 1}.{k}"] = vlmoe_array(k, p)
    ref["losses"] = np.array(losses, dtype=np.float32)
    st.save(os.path.join(out, f"model_{arch}.ref.safetensors"), ref,
            {"lr": ADAMW["lr"], "beta1": ADAMW["betas"][0], "beta2": ADAMW["betas"][1],
             "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"], "clip_norm": CLIP_NORM,
             "steps": STEPS})


def gen_block(out):
    """One block with a padding mask, its output and every gradient for dout = r."""
    torch.manual_seed(3)
    blk = Block(16, 4, 32, "gelu", 1e-6)
    perturb_(blk)
    x = torch.randn(2, 5, 16, requires_grad=True)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    y = blk(x, key_padding_mask=pad)
    r = torch.randn_like(y)
    (y * r).sum().backward()
    t = {"x": x.detach().numpy(), "y": y.detach().numpy(), "r": r.numpy(), "dx": x.grad.numpy(),
         "lens": np.array([5, 3], dtype=np.int32)}
    for k, p in blk.vlmoe_names("block").items():
        t[k] = p.detach().numpy()
        t["grad." + k] = p.grad.numpy()
    st.save(os.path.join(out, "block.safetensors"), t)


def generate(out):
    gen_block(out)
    for arch in ("one_tower", "two_tower"):
        gen_model(out, arch)
