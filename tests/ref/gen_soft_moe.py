"""gen_soft_moe.py: PyTorch parity fixture for the Soft MoE kernels of src/moe/soft.c (Soft MoE
paper sec. 2 eqs. 1-2 with the sec. 2.3 normalisation; spec/MOE.md "Soft MoE"). Writes
soft_moe.safetensors: soft_moe.<input> (x, phi, scale, w1, b1, w2, b2), soft_moe.out,
soft_moe.r (loss = sum(out * r)), soft_moe.d<input> (autograd) and soft_moe.stats (min/max
dispatch, min/max combine weight); the shapes are in the metadata. Inputs are drawn in float32
and the reference runs in float64, so the float32 C path is compared with the exact answer.
The same for Soft MoE App. A's fixed dispatch/combine baselines and App. E's un-normalised
variant, one file each: soft_moe_<variant>.safetensors (identity, uniform, uniform_soft,
soft_uniform, raw), with soft_moe.meanmax (mean over slots of the largest dispatch weight, mean
over tokens of the largest combine weight; App. E's monitors) in every file.
Consumed by tests/test_soft_moe.c."""
import os

import torch

import st
from model_ref import ACTS

EPS = 1e-6  # inside the square root: x / sqrt(|x|^2 + 1e-6), as vmoe's soft router


def soft_moe(x, phi, scale, w1, b1, w2, b2, act, mix="soft", raw=False):
    """x (S,D); phi (D,E,P); w1 (E,M,D); b1 (E,M); w2 (E,D,M); b2 (E,D) -> out (S,D), Dw, Cw.
    mix: Soft MoE App. A's "identity" (D = C = I, S = E*P), "uniform" (D = 1/S, C = 1/(E*P)),
    "uniform_soft" (D uniform, C soft), "soft_uniform" (D soft, C uniform) or "soft"; raw: no
    normalisation of x and phi (App. E)."""
    S, D = x.shape
    _, E, P = phi.shape
    N = E * P
    xh = x if raw else x / torch.sqrt((x * x).sum(-1, keepdim=True) + EPS)
    ph = phi.reshape(D, N)  # column e*P+j is slot (e, j)
    if not raw:
        ph = ph / torch.sqrt((ph * ph).sum(0, keepdim=True) + EPS)
    logits = scale * (xh @ ph)               # (S, N)
    dw = torch.softmax(logits, dim=0)        # dispatch: over tokens, per slot
    cw = torch.softmax(logits, dim=1)        # combine: over all slots, per token
    eye = torch.eye(S, N, dtype=x.dtype)
    if mix in ("identity", "uniform", "uniform_soft"):  # constants: no gradient through them
        dw = eye if mix == "identity" else torch.full((S, N), 1.0 / S, dtype=x.dtype)
    if mix in ("identity", "uniform", "soft_uniform"):
        cw = eye if mix == "identity" else torch.full((S, N), 1.0 / N, dtype=x.dtype)
    xs = (dw.t() @ x).reshape(E, P, D)       # un-normalised x
    h = torch.einsum("epd,emd->epm", xs, w1) + b1[:, None, :]
    ys = torch.einsum("epm,edm->epd", act(h), w2) + b2[:, None, :]
    return cw @ ys.reshape(E * P, D), dw, cw


def generate(outdir):
    case(outdir, "soft_moe.safetensors", 10, "soft", False)
    # identity sends token i to slot i: as many tokens as slots (E*P = 6)
    case(outdir, "soft_moe_identity.safetensors", 6, "identity", False)
    for mix in ("uniform", "uniform_soft", "soft_uniform"):
        case(outdir, f"soft_moe_{mix}.safetensors", 10, mix, False)
    case(outdir, "soft_moe_raw.safetensors", 10, "soft", True)


def case(outdir, fname, S, mix, raw):
    torch.manual_seed(0)
    D, E, P, M, act = 8, 3, 2, 16, "gelu"
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
    out, dw, cw = soft_moe(**leaves, act=ACTS[act], mix=mix, raw=raw)
    r = torch.randn(S, D).double()
    (out * r).sum().backward()
    t = {"soft_moe.out": out.detach().float(), "soft_moe.r": r.float(),
         "soft_moe.stats": torch.stack([dw.min(), dw.max(), cw.min(), cw.max()]).detach().float(),
         "soft_moe.meanmax": torch.stack([dw.max(0).values.mean(), cw.max(1).values.mean()]).detach().float()}
    for k, v in leaves.items():
        t[f"soft_moe.{k}"] = f32[k]
        # phi and scale get no gradient when both weight matrices are fixed (App. A)
        t[f"soft_moe.d{k}"] = (v.grad if v.grad is not None else torch.zeros_like(v)).float()
    st.save(os.path.join(outdir, fname), t,
            {"S": S, "D": D, "E": E, "P": P, "M": M, "act": act, "mix": mix, "raw": int(raw)})
