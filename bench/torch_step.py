"""torch_step.py: the PyTorch half of bench/speed.py: the same model as bench_step (a vlmoe
config file: one_tower LIMoE layout, MoE layers with tokens-choice top-K routing, capacity,
Batch Priority Routing, routing noise and the LIMoE auxiliary losses), the same inputs, one
training step = forward + backward + AdamW. Dispatch is vectorised: a one-hot cumulative sum
gives every token its slot, experts run as one batched matrix product over (E, C, D).
--precision bf16 runs the step under torch.autocast('cpu', dtype=torch.bfloat16) (PyTorch's oneDNN
bf16 path: matrix products in bf16, master weights and AdamW in fp32) and inference on a bf16
copy of the model. The JSON line also names the BLAS libraries PyTorch loaded and the core
OpenBLAS's kernels run (openblas_get_corename through ctypes; threadpoolctl's view when it is
installed). Prints one JSON line like bench_step.
--embed N: inference only (no training step), under torch.inference_mode; the throughputs are
the medians of N encodes per modality.
Usage: torch_step.py MODEL.json [--batch 64] [--steps 10] [--warmup 2] [--threads 2]
[--precision fp32|bf16] [--embed N]"""
import argparse
import contextlib
import copy
import ctypes
import json
import math
import os
import re
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ref"))
import gen_moe_aux as ga  # noqa: E402  (the auxiliary losses, written from MOE.md)

# what the vlmoe presets and JSON configs the benchmark uses resolve to
PRESETS = {
    "limoe-mini": {"top_k": 1, "capacity_factor": 1.05, "eval_capacity_factor": 16.0, "order": "bpr",
                   "noise_std": 1.0, "num_experts": 8,
                   "aux": {"importance": 0.008, "load": 0.008, "local_entropy_text": 0.008,
                           "global_entropy_image": 0.008, "global_entropy_text": 0.008},
                   "tau": [math.log(20.0), math.log(9.0)]},
    "limoe-B/16": None,  # same routing as limoe-mini, filled in below
}
PRESETS["limoe-B/16"] = PRESETS["limoe-mini"]
BASES = {"limoe-mini": None, "mini": None,
         "limoe-B/16": {"image_size": 224, "patch_size": 16, "vocab_size": 32000, "context_length": 16,
                        "embed_dim": 512, "encoder": {"width": 768, "layers": 12, "heads": 12,
                                                      "mlp_dim": 3072},
                        "moe_layers": list(range(1, 12, 2))}}


def load_config(path):
    cfg = json.load(open(path))
    base = cfg.get("base")
    if BASES.get(base):
        for k, v in BASES[base].items():
            cfg.setdefault(k, v)
    moe = cfg.get("moe")
    if base in PRESETS:
        m = dict(PRESETS[base])
        m["layers"] = (moe or {}).get("layers", cfg.get("moe_layers"))
        m.update({k: v for k, v in (moe or {}).items()})
        cfg["moe"] = m
    return cfg


ACT = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731


class MoE(nn.Module):
    def __init__(self, d, m, c):
        super().__init__()
        self.c, e = c, c["num_experts"]
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, d, m) * d ** -0.5)
        self.b1 = nn.Parameter(torch.zeros(e, 1, m))
        self.w2 = nn.Parameter(torch.randn(e, m, d) * m ** -0.5)
        self.b2 = nn.Parameter(torch.zeros(e, 1, d))

    def forward(self, x, mod):
        c, (S, D), E, K = self.c, x.shape, self.c["num_experts"], self.c["top_k"]
        logits = self.router(x).float()  # under bf16 autocast the routing still decides in fp32
        noisy = logits + (c["noise_std"] / E) * torch.randn_like(logits) if self.training else logits
        gates = noisy.softmax(-1)
        topv, topi = gates.topk(K, dim=-1)
        if not self.training:  # ample capacity: every assignment is kept, experts run on their tokens
            out = torch.zeros_like(x)
            for k in range(K):
                for e in range(E):
                    idx = (topi[:, k] == e).nonzero().squeeze(1)
                    h = ACT(x[idx] @ self.w1[e] + self.b1[e])
                    out.index_add_(0, idx, (topv[idx, k, None] * (h @ self.w2[e] + self.b2[e])).to(x.dtype))
            return out, 0.0
        cap = math.ceil(c["capacity_factor"] * S * K / E)
        prio = torch.sort(-topv[:, 0], stable=True).indices if c["order"] == "bpr" else torch.arange(S, device=x.device)
        used = torch.zeros(E, dtype=torch.long, device=x.device)
        slot_tok, slot_idx, slot_gate = [], [], []
        for k in range(K):  # every first choice before any second choice
            onehot = F.one_hot(topi[prio, k], E)
            pos = (used + onehot.cumsum(0) - onehot)[torch.arange(S, device=x.device), topi[prio, k]]
            keep = pos < cap
            slot_tok.append(prio[keep])
            slot_idx.append(topi[prio, k][keep] * cap + pos[keep])
            slot_gate.append(topv[prio, k][keep])
            used = used + onehot.sum(0)
        tok, idx, gate = torch.cat(slot_tok), torch.cat(slot_idx), torch.cat(slot_gate)
        xin = x.new_zeros(E * cap, D).index_copy(0, idx, x[tok]).view(E, cap, D)
        y = torch.baddbmm(self.b2, ACT(torch.baddbmm(self.b1, xin, self.w1)), self.w2).view(E * cap, D)
        out = x.new_zeros(S, D).index_add(0, tok, (gate[:, None] * y[idx]).to(x.dtype))
        ga.E, ga.K, ga.NOISE_STD = E, K, c["noise_std"]
        wanted = F.one_hot(topi, E).sum((0, 1)).float()
        wanted_mod = torch.stack([F.one_hot(topi[mod == m], E).sum((0, 1)).float() for m in (0, 1)])
        ls = ga.losses(logits, noisy, mod, wanted, c["tau"], wanted_mod)
        return out, sum(w * ls[name] for name, w in c["aux"].items())


class Block(nn.Module):
    def __init__(self, d, heads, m, moe):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.moe = MoE(d, m, moe) if moe else None
        if not moe:
            self.fc1, self.fc2 = nn.Linear(d, m), nn.Linear(m, d)

    def forward(self, xs, masks, mod):
        xs = [x + self.attn(h, h, h, need_weights=False, key_padding_mask=pm)[0]
              for x, pm in zip(xs, masks) for h in [self.ln1(x)]]
        flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])  # the MLP sees every token
        h = self.ln2(flat)
        y, aux = self.moe(h, mod) if self.moe else (self.fc2(ACT(self.fc1(h))), 0.0)
        flat = flat + y
        n0 = xs[0].numel() // xs[0].shape[-1] if len(xs) == 2 else flat.shape[0]
        parts = [flat[:n0], flat[n0:]] if len(xs) == 2 else [flat]
        return [p.view(x.shape) for p, x in zip(parts, xs)], aux


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, d, p = cfg["encoder"], cfg["encoder"]["width"], cfg["patch_size"]
        moe_layers = set(cfg["moe"]["layers"]) if cfg.get("moe") else set()
        self.patch = nn.Conv2d(3, d, p, stride=p)
        self.ipos = nn.Parameter(0.02 * torch.randn((cfg["image_size"] // p) ** 2, d))
        self.tok = nn.Embedding(cfg["vocab_size"], d)
        self.tpos = nn.Parameter(0.02 * torch.randn(cfg["context_length"], d))
        self.blocks = nn.ModuleList([Block(d, e["heads"], e["mlp_dim"], cfg["moe"] if l in moe_layers else None)
                                     for l in range(e["layers"])])
        self.lnf = nn.LayerNorm(d, eps=1e-6)
        self.iproj = nn.Linear(d, cfg["embed_dim"], bias=False)
        self.tproj = nn.Linear(d, cfg["embed_dim"], bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode(self, images=None, tokens=None, lens=None):
        xs, masks, mods = [], [], []
        if images is not None:
            xs.append(self.patch(images).flatten(2).transpose(1, 2) + self.ipos)
            masks.append(None)
            mods.append(torch.zeros(xs[-1].shape[0] * xs[-1].shape[1], dtype=torch.long, device=images.device))
        if tokens is not None:
            pad = torch.arange(tokens.shape[1], device=tokens.device)[None, :] >= lens[:, None]
            xs.append(self.tok(tokens) + self.tpos)
            masks.append(pad)
            mods.append(torch.ones(tokens.numel(), dtype=torch.long, device=tokens.device))
        mod, aux = torch.cat(mods), 0.0
        for b in self.blocks:
            xs, a = b(xs, masks, mod)
            aux = aux + a
        out = []
        for x, pm, proj in zip(xs, masks, [self.iproj, self.tproj] if images is not None else [self.tproj]):
            x = self.lnf(x)
            x = x.mean(1) if pm is None else (x * (~pm)[..., None]).sum(1) / (~pm).sum(1, keepdim=True)
            out.append(F.normalize(proj(x), dim=-1))
        return out, aux

    def forward(self, images, tokens, lens):
        (img, txt), aux = self.encode(images, tokens, lens)
        logits = self.logit_scale.exp() * img @ txt.t()
        target = torch.arange(logits.shape[0], device=logits.device)
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) + aux


def blas_report():
    """The BLAS libraries this process loaded and, for OpenBLAS, the core its kernels run."""
    libs = sorted({ln.split()[-1] for ln in open("/proc/self/maps")
                   if "blas" in ln.split()[-1].lower() and ".so" in ln})
    rep = {"blas_libs": libs}
    # the BLAS PyTorch was built with (mkl in the x86 wheels, linked in, so not among the libraries)
    m = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    rep["torch_blas"] = m.group(1) if m else None
    for lib in libs:
        try:
            f = ctypes.CDLL(lib).openblas_get_corename
        except (OSError, AttributeError):
            continue
        f.restype = ctypes.c_char_p
        rep["openblas_core"] = f().decode()
    try:
        import threadpoolctl
        rep["threadpoolctl"] = [{k: i.get(k) for k in ("internal_api", "version", "num_threads", "architecture")}
                                for i in threadpoolctl.threadpool_info()]
    except ImportError:
        pass
    return rep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (its default mode)")
    ap.add_argument("--embed", type=int, default=0, help="inference only: median of N timed encodes per modality")
    a = ap.parse_args()
    dev = torch.device(a.device)
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if a.precision == "bf16" else contextlib.nullcontext
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type != "cpu":  # every tensor the model makes inside a step, too (PyTorch >= 2.0)
        torch.set_default_device(dev)
    if dev.type == "cuda":  # fp32 means fp32 on both sides: no TF32 in the reference either
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    cfg = load_config(a.model)
    B, S, T, V = a.batch, cfg["image_size"], cfg["context_length"], cfg["vocab_size"]
    model = Model(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    fwd = torch.compile(model) if a.compile else model
    # the same deterministic inputs as bench_step.c
    images = torch.sin(0.001 * torch.arange(B * 3 * S * S, dtype=torch.float64)).float().view(B, 3, S, S)
    lens = torch.tensor([T // 2 + b % (T // 2 + 1) for b in range(B)])
    tokens = torch.tensor([[(b * 131 + t * 17) % V if t < lens[b] else 0 for t in range(T)] for b in range(B)])
    images, tokens, lens = images.to(dev), tokens.to(dev), lens.to(dev)
    times, loss = [], torch.zeros(())
    for i in range(0 if a.embed else a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp():
            loss = fwd(images, tokens, lens)
        loss.backward()
        opt.step()
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    times = sorted(times) or [0.0]
    model.eval()
    ri, rt = [], []
    if a.precision == "bf16":  # autocast misses the fused inference attention: a bf16 copy instead
        model, images = copy.deepcopy(model).to(torch.bfloat16), images.to(torch.bfloat16)
    # PyTorch's fastest inference: no autograd records at all (inference_mode), the fused
    # nn.MultiheadAttention fast path of eval mode; after training the best of 5, with --embed
    # the median of N after one untimed call
    reps = a.embed or 5
    with torch.inference_mode():
        for r in range(-1 if a.embed else 0, reps):
            sync()
            t0 = time.perf_counter()
            model.encode(images=images)
            sync()
            t1 = time.perf_counter()
            model.encode(tokens=tokens, lens=lens)
            sync()
            t2 = time.perf_counter()
            if r >= 0:
                ri.append(t1 - t0)
                rt.append(t2 - t1)
    ri.sort()
    rt.sort()
    ti, tt = (ri[reps // 2], rt[reps // 2]) if a.embed else (ri[0], rt[0])
    print(json.dumps({"impl": "torch" + ("-compile" if a.compile else ""), "device": str(dev), "precision": a.precision, **blas_report(), "model": cfg.get("name"), "threads": a.threads, "batch": B,
                      "step_s": times[len(times) // 2], "step_min_s": times[0], "step_max_s": times[-1],
                      "loss": loss.item(), "image_per_s": B / ti, "text_per_s": B / tt,
                      "image_per_s_lo": B / ri[-1], "image_per_s_hi": B / ri[0],
                      "text_per_s_lo": B / rt[-1], "text_per_s_hi": B / rt[0],
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
