"""gen_moe_layer.py: a PyTorch reference of the tokens-choice and experts-choice MoE layers,
written from ../shared/spec/MOE.md independently of src/moe/: router logits, explicit noise,
softmax gates, top-K with capacity and FIFO or BPR order (first choices before second ones),
combine by the gates (optionally renormalised after routing), stacked expert MLPs, and the
auxiliary losses of gen_moe_aux.py. Dispatch is vectorised (cumulative counts over one-hot
assignments). For each case NAME writes moe_layer_NAME.safetensors: inputs, parameters, noise,
output, auxiliary loss and autograd gradients of loss = sum(out * r) + weighted aux. LIMoE
appendix E.3 cases: a router per modality (router (2,E,D), image first) and disjoint pools (text
tokens see the last text_experts experts, images the rest): -inf logits outside the token's pool,
so softmax and top-K are the pool's, and each modality's auxiliary losses over its own tokens and
pool logits (a MoE of E_m experts with the layer's noise scale noise_std/E), summed.
Consumed by tests/test_parity.c."""
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

import gen_moe_aux as ga
import st

S, D, E, M = 24, 8, 4, 16
N_IMAGE = 16  # tokens 0..15 are image tokens, 16..23 text (one_tower: images first)


def route_tokens_choice(gates, k, cap, order):
    """Returns a (S, E) 0/1 mask of accepted assignments."""
    score = gates.max(-1).values
    prio = torch.arange(S) if order == "fifo" else torch.sort(-score, stable=True).indices
    topi = gates.topk(k, dim=-1).indices  # (S, K) by rank
    accepted = torch.zeros(S, E)
    used = torch.zeros(E)
    for rank in range(k):  # every first choice before any second choice
        onehot = F.one_hot(topi[prio, rank], E).float()  # in priority order
        pos = used + onehot.cumsum(0) - onehot  # arrival position at the expert
        ok = onehot * (pos < cap).float()
        accepted[prio] += ok
        used += onehot.sum(0)
    return accepted, topi


def experts(x, w1, b1, w2, b2, act):
    # every expert on every token; the mask picks (a reference, not a fast path)
    h = torch.einsum("sd,emd->esm", x, w1) + b1[:, None, :]
    return torch.einsum("esm,edm->esd", act(h), w2) + b2[:, None, :]


def case(out, name, router, k, cf, order, renorm, aux_weights, seed, per_modality=False, text_experts=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, D, generator=g, requires_grad=True)
    wr = (0.5 * torch.randn(*((2,) if per_modality else ()), E, D, generator=g)).requires_grad_(True)
    w1 = (0.3 * torch.randn(E, M, D, generator=g)).requires_grad_(True)
    b1 = (0.1 * torch.randn(E, M, generator=g)).requires_grad_(True)
    w2 = (0.3 * torch.randn(E, D, M, generator=g)).requires_grad_(True)
    b2 = (0.1 * torch.randn(E, D, generator=g)).requires_grad_(True)
    noise_std = 1.0 if router == "tokens" else 0.0
    noise = (noise_std / E) * torch.randn(S, E, generator=g, dtype=torch.float64)
    r = torch.randn(S, D, generator=g)
    mod = torch.tensor([0] * N_IMAGE + [1] * (S - N_IMAGE))
    if per_modality:
        logits = torch.where((mod == 1)[:, None], x @ wr[1].t(), x @ wr[0].t())
    else:
        logits = x @ wr.t()
    pool = torch.ones(2, E, dtype=torch.bool)  # pool[m, e]: modality m may use expert e
    if text_experts:
        pool[0, E - text_experts:] = False
        pool[1, :E - text_experts] = False
        logits = logits.masked_fill(~pool[mod], float("-inf"))
    noisy = logits + noise.float() if noise_std > 0 else logits
    gates = noisy.softmax(-1)
    if router == "tokens":
        cap = math.ceil(cf * S * k / E)
        acc, topi = route_tokens_choice(gates.detach(), k, cap, order)
        comb = gates * acc
        if renorm:
            comb = comb / comb.sum(-1, keepdim=True).clamp_min(1e-30)
        wanted = F.one_hot(topi, E).sum((0, 1)).float()
        wanted_mod = torch.stack([F.one_hot(topi[mod == m], E).sum((0, 1)).float() for m in (0, 1)])
    else:
        cap = min(math.ceil(cf * S / E), S)
        top = gates.detach().t().topk(cap, dim=-1).indices  # (E, C): each expert's tokens
        acc = torch.zeros(E, S).scatter(1, top, 1.0).t()
        comb = gates * acc
        wanted = acc.sum(0)
        wanted_mod = None
    y_all = experts(x, w1, b1, w2, b2, lambda h: F.gelu(h, approximate="tanh"))  # (E, S, D)
    y = torch.einsum("se,esd->sd", comb, y_all)
    aux = torch.zeros(())
    if aux_weights and text_experts:
        for m, other in ((0, "text"), (1, "image")):
            sel, cols = mod == m, pool[m]
            em = int(cols.sum())
            ga.S, ga.E, ga.K, ga.NOISE_STD = int(sel.sum()), em, k, noise_std * em / E
            ls = ga.losses(logits[sel][:, cols], noisy[sel][:, cols], mod[sel], wanted[cols],
                           [math.log(20.0), math.log(9.0)])
            for key, w in aux_weights.items():
                if not key.endswith(other):  # the other modality's losses have no tokens here
                    aux = aux + w * ls[key]
    elif aux_weights:
        ga.S, ga.E, ga.K, ga.NOISE_STD = S, E, k, noise_std
        ls = ga.losses(logits, noisy, mod, wanted, [math.log(20.0), math.log(9.0)], wanted_mod)
        for key, w in aux_weights.items():
            aux = aux + w * ls[key]
    loss = (y * r).sum() + aux
    loss.backward()
    t = {"x": x, "router": wr, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "r": r, "out": y,
         "aux": aux.reshape(1), "dx": x.grad, "drouter": wr.grad, "dw1": w1.grad, "db1": b1.grad,
         "dw2": w2.grad, "db2": b2.grad, "accepted": acc}
    t = {key: v.detach().float().numpy().copy() for key, v in t.items()}
    t["noise"] = noise.numpy()
    t["modality"] = mod.to(torch.uint8).numpy()
    meta = {"router": router, "top_k": k, "capacity_factor": cf, "order": order,
            "renorm": int(renorm), "noise_std": noise_std,
            "aux": ",".join(f"{key}={w}" for key, w in aux_weights.items()),
            "per_modality": int(per_modality), "text_experts": text_experts}
    st.save(os.path.join(out, f"moe_layer_{name}.safetensors"), t, meta)


def generate(out):
    limoe = {"importance": 0.05, "load": 0.05, "local_entropy_text": 0.05,
             "global_entropy_image": 0.05, "global_entropy_text": 0.05}
    case(out, "bpr_k1", "tokens", 1, 1.0, "bpr", False, limoe, 11)
    case(out, "fifo_k2_renorm", "tokens", 2, 0.75, "fifo", True,
         {"switch": 0.01, "zloss": 0.001}, 12)
    case(out, "experts_choice", "experts", 1, 1.0, "fifo", False, {}, 13)
    case(out, "per_modality", "tokens", 1, 1.0, "bpr", False, limoe, 14, per_modality=True)
    case(out, "pools_bpr_k1", "tokens", 1, 1.0, "bpr", False, limoe, 15, per_modality=True, text_experts=1)
    case(out, "pools_fifo_k2", "tokens", 2, 1.0, "fifo", False,
         {"importance": 0.05, "load": 0.05, "switch": 0.01, "zloss": 0.001}, 16, text_experts=2)
