"""gen_moe_aux.py: PyTorch reference of every MoE auxiliary loss, written from
../shared/spec/MOE.md "Auxiliary losses" (LIMoE appendix B.1 / E.1 where the spec points there),
independently of src/moe/aux.c. On fixed random logits, noise and modalities (S=12, E=4, K=2) it
writes moe_aux.safetensors: the inputs, and for every loss NAME (vlmoe_aux_name) NAME.loss (1) and
NAME.dlogits (S,E) from autograd. Consumed by tests/test_moe_route.c."""
import math
import os

import numpy as np
import torch

import st

S, E, K = 12, 4, 2
NOISE_STD = 1.0
TINY = 1e-30


def cv2(x):
    # (population std / mean)^2, no epsilon
    return (x.std(unbiased=False) / x.mean()) ** 2


def H(p):
    # entropy of a mean distribution, 0 log 0 = 0 through the clamp
    return -(p * p.clamp_min(TINY).log()).sum(-1)


def losses(l, noisy, mod, wanted, tau, wanted_mod=None):
    """wanted_mod (2, E): wanted split by modality, needed by the switch loss of a group holding
    both modalities."""
    p = l.softmax(-1)
    logp = l.log_softmax(-1)
    h_tok = -(p * logp).sum(-1)  # per-token entropy
    out = {}
    out["importance"] = cv2(p.sum(0))
    sigma = NOISE_STD / E
    thr = noisy.topk(K, dim=-1).values[:, K - 1]  # K-th largest noisy logit; gradients flow
    P = 0.5 * torch.erfc((thr[:, None] - l) / sigma / math.sqrt(2.0))  # 1 - Phi(z)
    out["load"] = cv2(P.mean(0))
    out["vloss"] = 0.5 * out["importance"] + 0.5 * out["load"]
    # z-loss and switch per modality when the group holds both (CLIP-UP per tower): the sum of
    # each modality's loss over its own tokens and its own assignments
    lse2 = torch.logsumexp(l, -1).pow(2)
    present = [m for m in (0, 1) if int((mod == m).sum()) > 0]
    out["zloss"] = sum(lse2[mod == m].mean() for m in present)
    if len(present) == 2:
        out["switch"] = sum((E / (K * int((mod == m).sum())) * wanted_mod[m] * p[mod == m].mean(0)).sum()
                            for m in present)
    else:
        out["switch"] = (E / (K * S) * wanted * p.mean(0)).sum()
    pbar = {}
    for m, name in ((0, "image"), (1, "text")):
        sel = mod == m
        out[f"local_entropy_{name}"] = h_tok[sel].mean()
        pbar[m] = p[sel].mean(0)
        # tau = log(S), S the soft minimum number of experts (LIMoE 2.2.2); 0 = log 1
        out[f"global_entropy_{name}"] = torch.relu(tau[m] - H(pbar[m]))
    out["mutual_information"] = 0.5 * (H(pbar[0]) + H(pbar[1])) - H(0.5 * (pbar[0] + pbar[1]))
    # K > 1 (LIMoE E.1): both replace the text local entropy, over the text tokens only
    txt = mod == 1
    out["target_entropy"] = (math.log(K) - h_tok[txt].mean()) ** 2
    top = torch.zeros_like(p).scatter(-1, l.topk(K, dim=-1).indices, 1.0)
    q, r = (p * top).sum(-1), (p * (1 - top)).sum(-1)
    out["merged_entropy"] = (-(q * q.clamp_min(TINY).log() + r * r.clamp_min(TINY).log()))[txt].mean()
    return out


def generate(outdir):
    g = torch.Generator().manual_seed(1234)
    logits32 = (1.5 * torch.randn(S, E, generator=g)).float()
    noise32 = torch.randn(S, E, generator=g).float()
    noisy32 = (logits32 + (NOISE_STD / E) * noise32).float()  # what the C side receives
    mod = torch.tensor([0, 0, 1, 0, 1, 1, 0, 0, 1, 0, 0, 1])  # 7 image, 5 text tokens
    # assignments before capacity: top-K of the noisy logits, counted per expert (sum S*K)
    wanted = torch.zeros(E, dtype=torch.float64)
    wanted_mod = torch.zeros(2, E, dtype=torch.float64)  # the same, per modality
    for s, row in enumerate(noisy32.topk(K, dim=-1).indices.tolist()):
        for e in row:
            wanted[e] += 1
            wanted_mod[int(mod[s]), e] += 1
    tau = [2.0, 1.5]  # both above log 4 >= H: both losses active
    t = {"logits": logits32.numpy(), "noisy_logits": noisy32.numpy(),
         "modality": mod.float().numpy(), "wanted": wanted.float().numpy(),
         "wanted_mod": wanted_mod.float().numpy(),
         "global_tau": np.array(tau, dtype=np.float32),
         "noise_std": np.array([NOISE_STD], dtype=np.float32)}
    names = ["importance", "load", "vloss", "zloss", "switch", "local_entropy_image",
             "local_entropy_text", "global_entropy_image", "global_entropy_text",
             "mutual_information", "target_entropy", "merged_entropy"]
    for name in names:
        # float64 maths on the float32 inputs; the threshold moves with the logit it came from
        l = logits32.double().requires_grad_(True)
        noisy = l + (noisy32.double() - logits32.double())
        v = losses(l, noisy, mod, wanted, tau, wanted_mod)[name]
        v.backward()
        t[f"{name}.loss"] = np.array([v.item()], dtype=np.float32)
        t[f"{name}.dlogits"] = l.grad.float().numpy()
    st.save(os.path.join(outdir, "moe_aux.safetensors"), t,
            {"generator": "tests/ref/gen_moe_aux.py", "S": S, "E": E, "K": K})
