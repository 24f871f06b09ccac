"""gen_soft_moe.py: PyTorch parity fixture for the Soft MoE kernels of src/moe/soft.c (Soft MoE
paper sec. 2 eqs. 1-2 with the sec. 2.3 normalisation; spec/MOE.md "Soft MoE"). Writes
soft_moe.safetensors: soft_moe.<input> (x, phi, scale, w1, b1, w2, b2), soft_moe.out,
soft_moe.r (loss = sum(out * r)), soft_moe.d<input> (autograd) and soft_moe.stats (min/max
dispatch, min/max combine weight); the shapes are in the metadata. Inputs are drawn in float32
and the reference runs in float64, so the float32 C path is compared with the exact answer.
Consumed by tests/test_soft_moe.c."""
import os

import torch

import st
from model_ref import ACTS

EPS = 1e-6  # inside the square root: x / sqrt(|x|^2 + 1e-6), as vmoe's soft router


def soft_moe(x, phi, scale, w1, b1, w2, b2, act):
    """x (S,D); phi (D,E,P); w1 (E,M,D); b1 (E,M); w2 (E,D,M); b2 (E,D) -> out (S,D), Dw, Cw."""
    S, D = x.shape
    _, E, P = phi.shape
    xh = x / torch.sqrt((x * x).sum(-1, keepdim=True) + EPS)
    ph = phi.reshape(D, E * P)  # column e*P+j is slot (e, j)
    ph = ph / torch.sqrt((ph * ph).sum(0, keepdim=True) + EPS)
    logits = scale * (xh @ ph)               # (S, N)
    dw = torch.softmax(logits, dim=0)        # dispatch: over tokens, per slot
    cw = torch.softmax(logits, dim=1)        # combine: over all slots, per token
    xs = (dw.t() @ x).reshape(E, P, D)       # un-normalised x
    h = torch.einsum("epd,emd->epm", xs, w1) + b1[:, None, :]
    ys = torch.einsum("epm,edm->epd", act(h), w2) + b2[:, None, :]
    return cw @ ys.reshape(E * P, D), dw, cw


def generate(outdir):
    torch.manual_seed(0)
    S, D, E, P, M, act = 10, 8, 3, 2, 16, "gelu"
    f32 = {
        "x": 1.5 * torch.randn(S, D),
        "phi": torch.randn(D, E, P) / D ** 0.5,
        "scale": torch.tensor(1.3),  # not the init 1.0, so that dscale's factor shows
        "w1": torch.randn(E, M, D) / D ** 0.5,
        "b1": 0.1 * torch.randn(E, M),
        "w2": torch.randn(E, D, M) / M ** 0.5,
        "b2": 0.1 * torch.randn(E, D),
    }
    leaves = {k: v.double().requires_grad_(True) for k, v in f32.items()}
    out, dw, cw = soft_moe(**leaves, act=ACTS[act])
    r = torch.randn(S, D).double()
    (out * r).sum().backward()
    t = {"soft_moe.out": out.detach().float(), "soft_moe.r": r.float(),
         "soft_moe.stats": torch.stack([dw.min(), dw.max(), cw.min(), cw.max()]).detach().float()}
    for k, v in leaves.items():
        t[f"soft_moe.{k}"] = f32[k]
        t[f"soft_moe.d{k}"] = v.grad.float()
    st.save(os.path.join(outdir, "soft_moe.safetensors"), t,
            {"S": S, "D": D, "E": E, "P": P, "M": M, "act": act})
