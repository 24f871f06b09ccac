"""vlmoe_torch.py: a vlmoe model in plain PyTorch, for people who want its embeddings without vlmoe.

Loads what `vlmoe export --to torch DIR` writes (DIR/config.json + DIR/model.safetensors; any
vlmoe model file works too, its config being in the safetensors metadata) and computes the same
L2-normalised embeddings as `vlmoe embed`: one_tower (LIMoE layout) and two_tower (CLIP,
CLIP-UP) models, dense or with MoE layers: tokens choice (top-K, fifo or BPR priority, capacity
at the eval capacity factor, router_pred pruning), experts choice and Soft MoE, routed in the
groups vlmoe forms (shared/spec/MOE.md). VL-MoE (arch mome) is not covered.

Needs only torch and numpy. Usage:
    import vlmoe_torch
    m = vlmoe_torch.load("DIR")                  # or a .safetensors model file
    img = m.encode_images(images)                # (N, C, H, W) float, already normalised
    txt = m.encode_texts(tokens, lengths)        # (N, context_length) ids, lengths with SOT/EOT
    m.routing                                    # per MoE layer of the last call: each token's first
                                                 # expert (-1: dropped; Soft MoE: -1, no such choice)

Like vlmoe, inputs are encoded in batches of `batch_size` (default 64, vlmoe embed's) and a
short last batch is filled up with copies of its last input, because routing groups, capacity
and BPR priority depend on the batch. `no_drop=True` gives every expert room for every token.
Tested by tests/test_import_export.c (embeddings within 1e-5 of vlmoe's, the same routing).
"""
import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn.functional as F

_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    """-> ({name: numpy array}, metadata dict). BF16 is widened to float32."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file")
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, d in header.items():
        a, b = d["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if d["dtype"] == "BF16":
            x = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            out[name] = x.view(np.float32).reshape(d["shape"])
        elif d["dtype"] in _DTYPES:
            out[name] = np.frombuffer(buf, dtype=np.dtype(_DTYPES[d["dtype"]]).newbyteorder("<")).reshape(d["shape"])
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {d['dtype']}, not a float type vlmoe writes")
    return out, meta


def _act(name):
    if name == "gelu":
        return lambda x: F.gelu(x)
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"config: act '{name}' is not gelu, gelu_tanh or quick_gelu")


def capacity(S, E, K, cf, multiple):
    """MOE.md "Capacity": ceil(cf*S*K/E) in double, rounded up to a multiple."""
    c = math.ceil(S * K * cf / E)
    if c < 1:
        raise ValueError(f"capacity_factor {cf} gives expert capacity {c} < 1 for {S} tokens, {E} experts")
    return int(math.ceil(c / multiple) * multiple)


class Model:
    def __init__(self, cfg, tensors, dtype=torch.float32, batch_size=64, no_drop=False):
        if cfg.get("arch") not in ("one_tower", "two_tower"):
            raise ValueError(f"config: arch '{cfg.get('arch')}': vlmoe_torch covers one_tower and two_tower")
        self.cfg, self.dtype, self.batch_size, self.no_drop = cfg, dtype, batch_size, no_drop
        self.p = {k: torch.from_numpy(np.array(v, dtype=np.float64)).to(dtype) for k, v in tensors.items()}
        self.act = _act(cfg["act"])
        self.used = set()
        self.routing = []
        one = cfg["arch"] == "one_tower"
        # encoder prefix, its config and its MoE config, per modality
        self.enc = {"image": ("encoder" if one else "image", cfg["encoder"], cfg.get("moe")),
                    "text": ("encoder", cfg["encoder"], cfg.get("moe")) if one else
                            ("text", cfg["text_encoder"], cfg.get("text_moe"))}
        self._check_names()

    def _w(self, name):
        if name not in self.p:
            raise KeyError(f"model: missing tensor '{name}'")
        self.used.add(name)
        return self.p[name]

    def _check_names(self):
        # one encoding of each kind touches every tensor but logit_scale: anything left is unknown
        B = 1
        c = self.cfg
        img = torch.zeros(B, c["channels"], c["image_size"], c["image_size"], dtype=self.dtype)
        tok = torch.zeros(B, c["context_length"], dtype=torch.long)
        try:
            self._encode_batch("image", img, None)
            self._encode_batch("text", tok, torch.tensor([c["context_length"]]))
        except ValueError:  # routing groups larger than one example: the names are checked at use
            self.used = set(self.p)
        left = set(self.p) - self.used - {"logit_scale"}
        if left:
            raise KeyError(f"model: tensors vlmoe_torch does not know: {sorted(left)[:5]}")
        self.routing = []

    # ---- blocks
    def _ln(self, x, pre):
        return F.layer_norm(x, x.shape[-1:], self._w(pre + ".weight"), self._w(pre + ".bias"), self.cfg["ln_eps"])

    def _attention(self, x, pre, heads, causal, pad):
        B, T, D = x.shape
        qkv = F.linear(x, self._w(pre + ".qkv.weight"), self._w(pre + ".qkv.bias"))
        q, k, v = qkv.view(B, T, 3, heads, D // heads).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D // heads)
        mask = torch.zeros(B, 1, T, T, dtype=torch.bool)
        if causal:
            mask |= torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        if pad is not None:
            mask |= pad[:, None, None, :]
        s = s.masked_fill(mask, float("-inf"))
        y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, D)
        return F.linear(y, self._w(pre + ".out.weight"), self._w(pre + ".out.bias"))

    def _experts(self, x, pre, e):
        h = self.act(F.linear(x, self._w(pre + ".fc1.weight")[e], self._w(pre + ".fc1.bias")[e]))
        return F.linear(h, self._w(pre + ".fc2.weight")[e], self._w(pre + ".fc2.bias")[e])

    def _route_tokens(self, g, mc, experts_choice, pruned):
        """One group's gates (S, E) -> [(token, expert, weight, rank)] of the accepted assignments."""
        S, E = g.shape
        sel = g.clone()
        if pruned:  # router_pred: a pruned expert is never chosen; the softmax still covers it
            for e in range(E):
                if pruned >> e & 1:
                    sel[:, e] = -1
        K = 1 if experts_choice else mc["top_k"]
        cf = mc["eval_capacity_factor"]
        # CLIP-UP's B_e = (B_t/E) x C counts no K (capacity_per_assignment false); never above S
        KC = K if mc.get("capacity_per_assignment", True) else 1
        C = S if self.no_drop else min(S, capacity(S, E, KC, cf, max(1, mc.get("capacity_multiple", 1))))
        out = []
        if experts_choice:  # each expert takes its top-C tokens (ties: lower token index)
            for e in range(E):
                idx = torch.sort(g[:, e], descending=True, stable=True).indices[:min(C, S)]
                out += [(int(s), e, g[s, e], 0) for s in idx]
            return out
        choice = torch.sort(sel, dim=1, descending=True, stable=True).indices[:, :K]  # ties: lower expert
        order = torch.arange(S)
        if mc["order"] == "bpr":
            score = g.gather(1, choice[:, :1])[:, 0] if mc["bpr_score"] == "max" else g.gather(1, choice).sum(1)
            order = torch.sort(score, descending=True, stable=True).indices
        elif mc["order"] != "fifo":
            raise ValueError(f"config: moe order '{mc['order']}' is not reproduced by vlmoe_torch (fifo, bpr)")
        count = [0] * E
        kept = {}
        for k in range(K):  # all first choices before any second choice
            for s in order.tolist():
                e = int(choice[s, k])
                if count[e] < C:
                    count[e] += 1
                    kept.setdefault(s, []).append((e, k))
        for s, lst in kept.items():
            w = [g[s, e] for e, _ in lst]
            if mc.get("gate_renorm") == "after_routing":
                tot = sum(float(v) for v in w)
                w = [v / tot for v in w] if tot > 0 else w
            out += [(s, e, wv, k) for (e, k), wv in zip(lst, w)]
        return out

    def _moe(self, x, pre, mc, block, rows_order, S):
        """x (N, D) in the pass's row order; rows_order lists the rows group by group (S each)."""
        y = torch.zeros_like(x)
        E = mc["num_experts"]
        kind = mc["router"]
        record = torch.full((x.shape[0],), -1, dtype=torch.long)
        pruned = 0
        for e in (mc.get("pruned") or {}).get(str(block), []):
            pruned |= 1 << e
        for g0 in range(0, len(rows_order), S):
            rows = rows_order[g0:g0 + S]
            xg = x[rows]
            if kind == "soft":
                y[rows] = self._soft(xg, pre, E, mc)
                continue
            gates = torch.softmax(F.linear(xg, self._w(pre + ".router.weight")), -1)
            per = [([], []) for _ in range(E)]
            for s, e, w, k in self._route_tokens(gates, mc, kind == "experts_choice", pruned):
                per[e][0].append(s), per[e][1].append(w)
                if k == 0 and record[rows[s]] < 0:  # experts choice: the lowest expert that took it
                    record[rows[s]] = e
            yg = torch.zeros_like(xg)
            for e, (idx, w) in enumerate(per):
                if idx:
                    idx = torch.tensor(idx)
                    yg.index_add_(0, idx, torch.stack(w)[:, None] * self._experts(xg[idx], pre + ".experts", e))
            y[rows] = yg
        self.routing.append(record)
        return y

    def _soft(self, x, pre, E, mc=None):
        if mc is not None and (mc.get("soft_dispatch", "soft") != "soft" or not mc.get("soft_normalize", True)):
            raise ValueError("config: Soft MoE's fixed-dispatch baselines and soft_normalize false are not "
                             "reproduced by vlmoe_torch")
        phi = self._w(pre + ".soft.phi")  # (D, E, P)
        D, _, P = phi.shape
        slots = phi.reshape(D, E * P).t()  # slot n = e * P + j
        xh = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        ph = slots / torch.sqrt((slots * slots).sum(-1, keepdim=True) + 1e-6)
        logits = self._w(pre + ".soft.scale") * (xh @ ph.t())  # (S, N)
        dw, cw = torch.softmax(logits, 0), torch.softmax(logits, 1)
        xs = dw.t() @ x  # (N, D) slot inputs
        ys = torch.cat([self._experts(xs[e * P:(e + 1) * P], pre + ".experts", e) for e in range(E)])
        return cw @ ys

    def _groups(self, mc, B, T, modality):
        """The rows of a one-modality pass of B sequences of T tokens, group by group, and S."""
        one = self.cfg["arch"] == "one_tower"
        gs = mc.get("group_size", 0)
        if one:  # groups of whole examples (MOE.md "Notation"): group_size counts both modalities
            full = self._tokens("image") + self.cfg["context_length"]
            k = gs // full if gs > 0 else B
            if gs > 0 and (gs % full or k > B or B % k):
                raise ValueError(f"moe: group_size {gs} does not split {B} examples into groups of whole examples")
            return list(range(B * T)), k * T
        n = B * T
        gs = gs if gs > 0 else n
        if n % gs:
            raise ValueError(f"moe: group_size {gs} does not divide the {n} tokens of this pass")
        return list(range(n)), gs

    def _tokens(self, modality):
        c = self.cfg
        return (c["image_size"] // c["patch_size"]) ** 2 + (1 if c["image_class_token"] else 0)

    def _encoder(self, x, modality, causal, pad):
        prefix, ec, mc = self.enc[modality]
        B, T, D = x.shape
        layers = set(mc["layers"]) if mc and mc.get("router", "none") != "none" else set()
        for l in range(ec["layers"]):
            pre = f"{prefix}.blocks.{l}"
            x = x + self._attention(self._ln(x, pre + ".ln1"), pre + ".attn", ec["heads"], causal, pad)
            h = self._ln(x, pre + ".ln2")
            if l in layers:
                rows, S = self._groups(mc, B, T, modality)
                x = x + self._moe(h.reshape(B * T, D), pre + ".moe", mc, l, rows, S).view(B, T, D)
            else:
                x = x + F.linear(self.act(F.linear(h, self._w(pre + ".mlp.fc1.weight"), self._w(pre + ".mlp.fc1.bias"))),
                                 self._w(pre + ".mlp.fc2.weight"), self._w(pre + ".mlp.fc2.bias"))
        return self._ln(x, prefix + ".ln_final")

    def _encode_batch(self, modality, x, lens):
        c = self.cfg
        if modality == "image":
            P = c["patch_size"]
            w = self._w("image.patch_embed.weight").view(-1, c["channels"], P, P)
            bias = self._w("image.patch_embed.bias") if c["patch_bias"] else None
            h = F.conv2d(x.to(self.dtype), w, bias, stride=P).flatten(2).transpose(1, 2)
            if c["image_class_token"]:
                h = torch.cat([self._w("image.class_token").expand(h.shape[0], 1, -1), h], 1)
            h = h + self._w("image.pos_embed")
            if c["image_ln_pre"]:
                h = self._ln(h, "image.ln_pre")
            h = self._encoder(h, "image", False, None)
            pooled = h[:, 0] if c["image_pool"] == "cls" else h.mean(1)
        else:
            T = c["context_length"]
            h = self._w("text.token_embed")[x] + self._w("text.pos_embed")
            pad = torch.arange(T)[None, :] >= lens[:, None]
            h = self._encoder(h, "text", bool(c["text_causal"]), pad)
            if c["text_pool"] == "eot":
                pooled = h[torch.arange(h.shape[0]), lens - 1]
            else:
                pooled = (h * (~pad)[..., None]).sum(1) / lens[:, None].to(h.dtype)
        return F.normalize(F.linear(pooled, self._w(modality + ".proj")), dim=-1)

    def _encode(self, modality, x, lens):
        n, B = x.shape[0], self.batch_size
        outs, routes = [], []
        for i0 in range(0, n, B):
            xb = x[i0:i0 + B]
            lb = None if lens is None else lens[i0:i0 + B]
            k = xb.shape[0]
            if k < B:  # vlmoe fills a short batch with copies of its last input
                xb = torch.cat([xb, xb[-1:].expand(B - k, *xb.shape[1:])])
                lb = None if lb is None else torch.cat([lb, lb[-1:].expand(B - k)])
            self.routing = []
            outs.append(self._encode_batch(modality, xb, lb)[:k])
            routes.append([r.view(B, -1)[:k] for r in self.routing])
        self.routing = [torch.cat([r[i] for r in routes]) for i in range(len(routes[0]))] if routes else []
        return outs and torch.cat(outs)

    @torch.no_grad()
    def encode_images(self, images):
        """images (N, C, H, W), normalised as the model's preprocessing says -> (N, embed_dim)."""
        return self._encode("image", torch.as_tensor(images), None)

    @torch.no_grad()
    def encode_texts(self, tokens, lengths):
        """tokens (N, context_length) ids, lengths (N) counting SOT..EOT -> (N, embed_dim)."""
        tokens, lengths = torch.as_tensor(tokens).long(), torch.as_tensor(lengths).long()
        if tokens.dim() != 2 or tokens.shape[1] != self.cfg["context_length"]:
            raise ValueError(f"tokens: expected (N, {self.cfg['context_length']}), got {tuple(tokens.shape)}")
        return self._encode("text", tokens, lengths)

    def logit_scale(self):
        return float(self.p["logit_scale"])


def load(path, dtype=torch.float32, batch_size=64, no_drop=False):
    """DIR written by `vlmoe export --to torch`, or a vlmoe model file (.safetensors)."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        tensors, _ = read_safetensors(os.path.join(path, "model.safetensors"))
        cfg = cfg.get("model", cfg)
    else:
        tensors, meta = read_safetensors(path)
        if "vlmoe.config" not in meta:
            raise ValueError(f"{path}: no vlmoe.config in the metadata: not a vlmoe model file")
        cfg = json.loads(meta["vlmoe.config"])
    return Model(cfg, tensors, dtype, batch_size, no_drop)
