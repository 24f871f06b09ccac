"""gen_ops.py: PyTorch parity fixtures for every op of src/ops and the contrastive loss, in float32.
For op NAME the file ops.safetensors holds NAME.<input>, NAME.out, NAME.r (the upstream gradient,
loss = sum(out * r)) and NAME.d<input> (gradients from autograd). Consumed by tests/test_parity.c."""
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import st
from model_ref import ACTS


def leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape)).requires_grad_(True)


def record(t, name, out, inputs):
    r = torch.randn_like(out)
    (out * r).sum().backward()
    t[f"{name}.out"], t[f"{name}.r"] = out.detach().numpy(), r.numpy()
    for k, v in inputs.items():
        t[f"{name}.{k}"] = v.detach().numpy()
        if v.grad is not None:
            t[f"{name}.d{k}"] = v.grad.numpy()


def attention(qkv, heads, lens, causal, prefix=0):
    b, t, d3 = qkv.shape
    d = d3 // 3
    q, k, v = (z.reshape(b, t, heads, d // heads).transpose(1, 2) for z in qkv.split(d, dim=-1))
    s = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
    mask = torch.arange(t)[None, None, None, :] >= lens[:, None, None, None]
    if causal:
        # BEiT-3's captioning mask with a prefix: the prefix (image) block is seen both ways
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        future[:prefix, :prefix] = False
        mask = mask | future
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return (p @ v).transpose(1, 2).reshape(b, t, d)


def generate(out):
    torch.manual_seed(0)
    t = {}
    lin = nn.Linear(7, 5)
    x = leaf(6, 7)
    record(t, "linear", lin(x), {"inp": x, "w": lin.weight, "b": lin.bias})
    ln = nn.LayerNorm(9, eps=1e-5)
    with torch.no_grad():
        ln.weight.add_(0.3 * torch.randn(9))
        ln.bias.add_(0.3 * torch.randn(9))
    x = leaf(4, 9, scale=2.0)
    record(t, "layernorm", ln(x), {"inp": x, "w": ln.weight, "b": ln.bias})
    for name, f in ACTS.items():
        x = leaf(64, scale=3.0)
        record(t, name, f(x), {"inp": x})
    x = leaf(3, 7, scale=2.0)
    record(t, "softmax", x.softmax(-1), {"inp": x})
    lens = torch.tensor([6, 3])
    for causal in (0, 1):
        qkv = leaf(2, 6, 3 * 8)
        record(t, f"attention{causal}", attention(qkv, 2, lens, causal), {"qkv": qkv})
    t["attention.lens"] = lens.int().numpy()
    conv = nn.Conv2d(3, 8, 4, stride=4)
    img = torch.randn(2, 3, 8, 8)
    y = conv(img).flatten(2).transpose(1, 2)
    record(t, "patch", y, {"w": conv.weight, "b": conv.bias})
    t["patch.images"] = img.numpy()
    t["patch.w"] = t["patch.w"].reshape(8, -1)
    t["patch.dw"] = t["patch.dw"].reshape(8, -1)
    emb = nn.Embedding(10, 4)
    ids = torch.tensor([[1, 3, 3, 0], [9, 3, 2, 2]])
    pos = leaf(4, 4)
    record(t, "embed", emb(ids) + pos, {"wte": emb.weight, "pos": pos})
    t["embed.ids"] = ids.int().numpy()
    cls, xs = leaf(4), leaf(2, 3, 4)
    record(t, "cls", torch.cat([cls.expand(2, 1, 4), xs], 1), {"cls": cls, "x": xs})
    plens = torch.tensor([4, 2])
    for kind in ("mean", "cls", "eot"):
        x = leaf(2, 4, 3)
        if kind == "mean":
            valid = (torch.arange(4)[None, :] < plens[:, None]).float()
            y = (x * valid[..., None]).sum(1) / plens[:, None]
        elif kind == "cls":
            y = x[:, 0]
        else:
            y = x[torch.arange(2), plens - 1]
        record(t, f"pool_{kind}", y, {"x": x})
    t["pool.lens"] = plens.int().numpy()
    x = leaf(3, 5)
    record(t, "l2norm", F.normalize(x, dim=-1), {"x": x})
    img, txt = leaf(5, 6), leaf(5, 6)
    scale = torch.tensor(math.log(7.0), requires_grad=True)
    a, b = F.normalize(img, dim=-1).detach().requires_grad_(True), F.normalize(txt, dim=-1).detach().requires_grad_(True)
    logits = scale.exp() * a @ b.t()
    target = torch.arange(5)
    loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
    loss.backward()
    t.update({"contrastive.img": a.detach().numpy(), "contrastive.txt": b.detach().numpy(),
              "contrastive.scale": np.array([scale.item()], dtype=np.float32),
              "contrastive.loss": np.array([loss.item()], dtype=np.float32),
              "contrastive.logits": logits.detach().numpy(), "contrastive.dimg": a.grad.numpy(),
              "contrastive.dtxt": b.grad.numpy(),
              "contrastive.dscale": np.array([scale.grad.item()], dtype=np.float32)})
    # last, so the fixtures above keep their random draws: causal attention after a prefix of 3
    # (image tokens seen both ways), lengths 6 and 4
    qkv = leaf(2, 6, 3 * 8)
    record(t, "attention_prefix", attention(qkv, 2, torch.tensor([6, 4]), 1, prefix=3), {"qkv": qkv})
    st.save(os.path.join(out, "ops.safetensors"), t)
