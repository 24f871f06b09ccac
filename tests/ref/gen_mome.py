"""gen_mome.py: a PyTorch reference of VL-MoE's MoME transformer, written from the VL-MoE paper
(sec. 3.1-3.2, Figure 1, A.3) and ../shared/spec/MODEL.md + MOE.md, independently of src/nn/mome.c:
shared nn.MultiheadAttention per block, modality experts chosen by token type (V-FFN / T-FFN, and
VL-FFN for every token of a pair in the top F blocks), each expert a LayerNorm + MLP (VLMo's
per-modality norm2) or, in the chosen lower blocks, a top-1 MoE with its own router (noisy
gates with the noise given explicitly, ample capacity so nothing is dropped; V-MoE v-loss, T-MoE
load loss, ratio 0.01, from gen_moe_aux.py). A pair is [H^w; H^v] as the paper writes it: text
first, then [I_CLS] + patches (vlmoe puts the image first; the hidden states are compared after
reordering). Masked patches take a learned mask token (BEiT); MLM/MIM heads are linear; losses
are mean cross-entropies over the labelled positions, summed with the auxiliary losses.
The fine-tuning head (VL-MoE sec. 4.2; BEiT-3's recipes, as include/vlmoe.h words them) is a
linear classifier of NC classes on a pooled final feature: the mean over the patch tokens
([I_CLS] left out) of an image, the [T_CLS] (first text token) of a text, and of a pair the
fused [T_CLS], which is the pair's first token here; its mean cross-entropy over the class
labels joins the sum. NLVR2's head (cls_sequences = 2) reads two consecutive sequences as one
example: their pooled features side by side, (NC, 2*width), one label per two sequences. The
retrieval head (VLMo's contrastive fine-tuning) encodes images and texts separately: the final
[I_CLS] of an image-only and the final [T_CLS] of a text-only forward, each through its own
bias-free projection to embed_dim, L2-normalised; CLIP's symmetric cross-entropy of
exp(logit_scale) times the similarities, summed with both forwards' auxiliary losses.

Writes mome.init.safetensors (a vlmoe checkpoint without the head), mome_cls.init.safetensors
(the same weights plus cls_head, num_classes = NC) and mome.ref.safetensors: the inputs with
explicit masks and labels (input.class_labels too), and per encoding ENC in (image, text, pair):
the router noise of every MoE layer (ENC.noise.I), the losses without class labels (ENC.loss,
ENC.text, ENC.image, ENC.aux), the final hidden states in vlmoe's order (ENC.hidden), every
parameter gradient (ENC.grad.NAME, cls_head's zero), the class scores (ENC.cls.logits, which
class labels do not change), and with class labels the losses (ENC.cls.loss, the total, and
ENC.cls.cls) and every gradient (ENC.cls.grad.NAME).
Then, on the same weights with both new heads (mome_heads.init.safetensors: NLVR2's head of NC
classes on two pairs and the retrieval head), mome_heads.ref.safetensors: four image-text pairs
(heads.images, heads.tokens, heads.lens), drawn with the heads from their own generators so
that the files above stay byte for byte as they were; NLVR2 on the pair encoding of the four
(two examples, nlvr2.class_labels, no masking): the noise (nlvr2.noise.I), the losses
(nlvr2.loss, nlvr2.cls, nlvr2.aux), hidden states, class scores (nlvr2.logits) and every
gradient (nlvr2.grad.NAME); retrieval of the four: the noise of the image forward's V-MoE
layers (itc.image.noise.I) and the text forward's T-MoE layers (itc.text.noise.I), the losses
(itc.loss = itc.itc + itc.image.aux + itc.text.aux), both embeddings (itc.image.embed,
itc.text.embed) and every gradient (itc.grad.NAME). Consumed by tests/test_parity.c."""
import json
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import gen_moe_aux as ga
import st

CFG = {"name": "parity-mome", "arch": "mome", "image_size": 16, "patch_size": 4, "channels": 3,
       "vocab_size": 50, "context_length": 8, "embed_dim": 16,
       "encoder": {"width": 32, "layers": 3, "heads": 4, "mlp_dim": 64},
       "act": "gelu", "ln_eps": 1e-6, "patch_bias": True, "image_class_token": True,
       "image_ln_pre": False, "image_pool": "mean", "text_causal": False, "text_pool": "mean",
       "init_temperature": 10.0, "max_temperature": 100.0,
       "vl_layers": 1, "mim_vocab": 12, "mask_token": 49}
E = 4
MOE_BLOCKS = [0, 1]
CF = 4.0  # capacity = every token of the group: nothing is dropped, the order does not matter
NC = 3  # classes of the fine-tuning head
V_AUX = {"vloss": 0.01}
T_AUX = {"load": 0.01}


def moe_cfg(order, aux):
    return {"router": "tokens_choice", "layers": MOE_BLOCKS, "num_experts": E, "top_k": 1,
            "capacity_factor": CF, "eval_capacity_factor": CF, "order": order, "noise_std": 1.0,
            "aux": aux}


class Expert(nn.Module):
    """LayerNorm + MLP, or LayerNorm + top-1 MoE of E such MLPs with a bias-free router."""

    def __init__(self, d, m, moe, aux):
        super().__init__()
        self.ln = nn.LayerNorm(d, eps=CFG["ln_eps"])
        self.moe, self.aux = moe, aux
        if moe:
            self.router = nn.Parameter(0.3 * torch.randn(E, d))
            self.w1 = nn.Parameter(torch.randn(E, m, d) / math.sqrt(d))
            self.b1 = nn.Parameter(0.1 * torch.randn(E, m))
            self.w2 = nn.Parameter(torch.randn(E, d, m) / math.sqrt(m))
            self.b2 = nn.Parameter(0.1 * torch.randn(E, d))
        else:
            self.fc1, self.fc2 = nn.Linear(d, m), nn.Linear(m, d)

    def forward(self, x, noise, modality):
        """x (n, D) -> (n, D), aux loss."""
        h = self.ln(x)
        if not self.moe:
            return self.fc2(F.gelu(self.fc1(h))), torch.zeros(())
        logits = h @ self.router.t()
        noisy = logits + noise.float()
        gates = noisy.softmax(-1)
        top = F.one_hot(gates.argmax(-1), E).float()  # ample capacity: every first choice is kept
        ys = torch.einsum("nd,emd->enm", h, self.w1) + self.b1[:, None, :]
        ys = torch.einsum("enm,edm->end", F.gelu(ys), self.w2) + self.b2[:, None, :]
        y = torch.einsum("ne,end->nd", gates * top, ys)
        ga.S, ga.E, ga.K, ga.NOISE_STD = x.shape[0], E, 1, 1.0
        mod = torch.full((x.shape[0],), modality)
        wanted = top.sum(0)
        ls = ga.losses(logits, noisy, mod, wanted, [1.0, 1.0])
        return y, sum(w * ls[k] for k, w in self.aux.items())

    def names(self, p):
        out = {f"{p}.ln.weight": self.ln.weight, f"{p}.ln.bias": self.ln.bias}
        if self.moe:
            out.update({f"{p}.moe.router.weight": self.router, f"{p}.moe.experts.fc1.weight": self.w1,
                        f"{p}.moe.experts.fc1.bias": self.b1, f"{p}.moe.experts.fc2.weight": self.w2,
                        f"{p}.moe.experts.fc2.bias": self.b2})
        else:
            out.update({f"{p}.mlp.fc1.weight": self.fc1.weight, f"{p}.mlp.fc1.bias": self.fc1.bias,
                        f"{p}.mlp.fc2.weight": self.fc2.weight, f"{p}.mlp.fc2.bias": self.fc2.bias})
        return out


class MoME(nn.Module):
    def __init__(self):
        super().__init__()
        c, e = CFG, CFG["encoder"]
        d, m, p = e["width"], e["mlp_dim"], c["patch_size"]
        self.L, self.F = e["layers"], c["vl_layers"]
        self.np = (c["image_size"] // p) ** 2
        self.patch = nn.Conv2d(c["channels"], d, p, stride=p)
        self.i_cls = nn.Parameter(0.1 * torch.randn(d))
        self.ipos = nn.Parameter(0.1 * torch.randn(self.np + 1, d))
        self.mask_token = nn.Parameter(0.1 * torch.randn(d))
        self.tok = nn.Embedding(c["vocab_size"], d)
        self.tpos = nn.Parameter(0.1 * torch.randn(c["context_length"], d))
        self.ln1 = nn.ModuleList([nn.LayerNorm(d, eps=c["ln_eps"]) for _ in range(self.L)])
        self.attn = nn.ModuleList([nn.MultiheadAttention(d, e["heads"], batch_first=True)
                                   for _ in range(self.L)])
        self.v = nn.ModuleList([Expert(d, m, l in MOE_BLOCKS, V_AUX) for l in range(self.L)])
        self.t = nn.ModuleList([Expert(d, m, l in MOE_BLOCKS, T_AUX) for l in range(self.L)])
        self.vl = nn.ModuleDict({str(l): Expert(d, m, False, {}) for l in range(self.L - self.F, self.L)})
        self.ln_f = nn.LayerNorm(d, eps=c["ln_eps"])
        self.mlm = nn.Linear(d, c["vocab_size"])
        self.mim = nn.Linear(d, c["mim_vocab"])
        self.head_w = self.head_b = None
        self.itc_w = self.logit_scale = None

    def add_head(self, g, cs=1):
        """The classification head on cs sequences per example, drawn from generator g alone: the
        global generator, and so the inputs and noise drawn after this, stay as they were."""
        k = cs * CFG["encoder"]["width"]
        self.head_w = nn.Parameter(torch.randn(NC, k, generator=g) / math.sqrt(k))
        self.head_b = nn.Parameter(0.1 * torch.randn(NC, generator=g))

    def add_itc(self, g):
        """The retrieval head from generator g: image and text projections, a logit scale."""
        d, e = CFG["encoder"]["width"], CFG["embed_dim"]
        self.itc_w = nn.ParameterList([nn.Parameter(torch.randn(e, d, generator=g) / math.sqrt(d))
                                       for _ in range(2)])
        self.logit_scale = nn.Parameter(torch.tensor(math.log(8.0)))

    def moe_order(self):
        """MoE layers in the order vlmoe numbers them: by block, V before T."""
        out = []
        for l in range(self.L):
            for name, ex in (("v", self.v[l]), ("t", self.t[l])):
                if ex.moe:
                    out.append((l, name))
        return out

    def forward(self, enc, images, tokens, lens, tlab, plab, noise, clab=None, drop=None, caption=False):
        """Returns loss, text loss, image loss, aux, the hidden states (vlmoe's order: image first
        in a pair), the class scores (None without a head) and the classification loss (zero
        without class labels clab). drop: stochastic depth as (rate, keep), keep (L, 2, B) the
        kept attention (0) and feed-forward (1) branches of each sample, block l's rate
        linspace(0, rate, L)[l] as timm's and BEiT's models space it. caption: a pair under BEiT-3's
        captioning mask (image queries see the image only, text queries the image and the text up
        to themselves)."""
        rates = torch.linspace(0, drop[0], self.L).tolist() if drop is not None else None

        def dp(y, l, k):  # timm's drop_path with the mask given: y / keep_prob * mask
            if drop is None:
                return y
            return y.div(1.0 - rates[l]) * drop[1][l, k].to(y.dtype).view(-1, *([1] * (y.dim() - 1)))
        parts, kinds = [], []
        b = images.shape[0] if images is not None else tokens.shape[0]
        if enc in ("text", "pair"):
            parts.append(self.tok(tokens) + self.tpos)
            kinds.append("t")
        if enc in ("image", "pair"):
            pe = self.patch(images).flatten(2).transpose(1, 2)  # (B, np, D)
            if plab is not None:
                pe = torch.where((plab >= 0)[..., None], self.mask_token.expand_as(pe), pe)
            parts.append(torch.cat([self.i_cls.expand(b, 1, -1), pe], 1) + self.ipos)
            kinds.append("v")
        x = torch.cat(parts, 1)  # pair: [H^w; H^v]
        tt = tokens.shape[1] if "t" in kinds else 0
        pad = torch.zeros(b, x.shape[1], dtype=torch.bool)
        if "t" in kinds:
            pad[:, :tt] = torch.arange(tt)[None, :] >= lens[:, None]
        cmask = None
        if caption:  # True = not attended; the text comes first here: [H^w; H^v]
            cmask = torch.zeros(x.shape[1], x.shape[1], dtype=torch.bool)
            cmask[:tt, :tt] = torch.triu(torch.ones(tt, tt, dtype=torch.bool), 1)
            cmask[tt:, :tt] = True
        aux = torch.zeros(())
        moe_ids = {k: i for i, k in enumerate(self.moe_order())}
        for l in range(self.L):
            h = self.ln1[l](x)
            x = x + dp(self.attn[l](h, h, h, need_weights=False, key_padding_mask=pad if pad.any() else None,
                                    attn_mask=cmask)[0], l, 0)
            d = x.shape[-1]
            if enc == "pair" and l >= self.L - self.F:
                y, a = self.vl[str(l)](x.reshape(-1, d), None, 0)
                x = x + dp(y.reshape(x.shape), l, 1)
                aux = aux + a
                continue
            outs, off = [], 0
            for kind in kinds:
                n = tt if kind == "t" else self.np + 1
                seg = x[:, off:off + n]
                ex = self.t[l] if kind == "t" else self.v[l]
                nz = noise.get(moe_ids.get((l, kind)))
                y, a = ex(seg.reshape(-1, d), nz, 1 if kind == "t" else 0)
                outs.append(seg + dp(y.reshape(seg.shape), l, 1))
                aux = aux + a
                off += n
            x = torch.cat(outs, 1)
        h = self.ln_f(x)
        losses = []
        for kind, head, lab in (("t", self.mlm, tlab), ("v", self.mim, plab)):
            if kind not in kinds or lab is None or not (lab >= 0).any():
                losses.append(torch.zeros(()))
                continue
            if kind == "t":
                rows = h[:, :tt][lab >= 0]
            else:
                off = tt if enc == "pair" else 0
                rows = h[:, off + 1:off + 1 + self.np][lab >= 0]
            losses.append(F.cross_entropy(head(rows), lab[lab >= 0].long()))
        logits, lc = None, torch.zeros(())
        if self.head_w is not None:
            # image: mean of the patch tokens, [I_CLS] left out; text and pair ([H^w; H^v]): [T_CLS]
            pooled = h[:, 1:1 + self.np].mean(1) if enc == "image" else h[:, 0]
            # NLVR2: sequences 2k and 2k+1 are one example, their pooled features side by side
            logits = F.linear(pooled.reshape(-1, self.head_w.shape[1]), self.head_w, self.head_b)
            if clab is not None:
                lc = F.cross_entropy(logits, clab.long())
        loss = losses[0] + losses[1] + lc + aux
        if enc == "pair":  # vlmoe's order: image first
            h = torch.cat([h[:, tt:], h[:, :tt]], 1)
        return loss, losses[0], losses[1], aux, h, logits, lc

    def retrieval(self, images, tokens, lens, noise_i, noise_t):
        """Contrastive loss of B matching pairs, image and text encoded apart (no labels): total,
        contrastive part, the two forwards' aux losses, the image and text embeddings (B, E)."""
        _, _, _, aux_i, hi, _, _ = self("image", images, None, None, None, None, noise_i)
        _, _, _, aux_t, ht, _, _ = self("text", None, tokens, lens, None, None, noise_t)
        zi = F.normalize(hi[:, 0] @ self.itc_w[0].t(), dim=-1)  # [I_CLS]
        zt = F.normalize(ht[:, 0] @ self.itc_w[1].t(), dim=-1)  # [T_CLS]
        logits = self.logit_scale.exp() * zi @ zt.t()
        tgt = torch.arange(logits.shape[0])
        itc = (F.cross_entropy(logits, tgt) + F.cross_entropy(logits.t(), tgt)) / 2
        return itc + aux_i + aux_t, itc, aux_i, aux_t, zi, zt

    def to_vlmoe(self):
        out = {"image.patch_embed.weight": self.patch.weight, "image.patch_embed.bias": self.patch.bias,
               "image.class_token": self.i_cls, "image.pos_embed": self.ipos,
               "image.mask_token": self.mask_token, "text.token_embed": self.tok.weight,
               "text.pos_embed": self.tpos}
        for l in range(self.L):
            p = f"encoder.blocks.{l}"
            out.update({f"{p}.ln1.weight": self.ln1[l].weight, f"{p}.ln1.bias": self.ln1[l].bias,
                        f"{p}.attn.qkv.weight": self.attn[l].in_proj_weight,
                        f"{p}.attn.qkv.bias": self.attn[l].in_proj_bias,
                        f"{p}.attn.out.weight": self.attn[l].out_proj.weight,
                        f"{p}.attn.out.bias": self.attn[l].out_proj.bias})
            out.update(self.v[l].names(f"{p}.v_ffn"))
            out.update(self.t[l].names(f"{p}.t_ffn"))
            if str(l) in self.vl:
                out.update(self.vl[str(l)].names(f"{p}.vl_ffn"))
        out.update({"encoder.ln_final.weight": self.ln_f.weight, "encoder.ln_final.bias": self.ln_f.bias,
                    "mlm_head.weight": self.mlm.weight, "mlm_head.bias": self.mlm.bias,
                    "mim_head.weight": self.mim.weight, "mim_head.bias": self.mim.bias})
        if self.head_w is not None:
            out.update({"cls_head.weight": self.head_w, "cls_head.bias": self.head_b})
        if self.itc_w is not None:
            out.update({"itc.image_proj.weight": self.itc_w[0], "itc.text_proj.weight": self.itc_w[1],
                        "logit_scale": self.logit_scale})
        return out


def arr(name, t):
    a = t.detach().float().numpy().copy()
    return a.reshape(a.shape[0], -1) if name == "image.patch_embed.weight" else a


def generate(out):
    torch.manual_seed(8)
    cfg = dict(CFG, moe=moe_cfg("bpr", V_AUX), text_moe=moe_cfg("fifo", T_AUX))
    m = MoME()
    with torch.no_grad():  # random LayerNorm affine and biases: no gradient trivially structured
        for name, p in m.named_parameters():
            if p.dim() == 1 and "cls" not in name and "mask_token" not in name:
                p.add_(0.1 * torch.randn_like(p))
    names = m.to_vlmoe()
    st.save(os.path.join(out, "mome.init.safetensors"), {k: arr(k, v) for k, v in names.items()},
            {"vlmoe.config": json.dumps(cfg), "format": "pt"})
    m.add_head(torch.Generator().manual_seed(10))  # its own generator: the weights above stay put
    names = m.to_vlmoe()
    st.save(os.path.join(out, "mome_cls.init.safetensors"), {k: arr(k, v) for k, v in names.items()},
            {"vlmoe.config": json.dumps(dict(cfg, num_classes=NC)), "format": "pt"})
    b, tt, np_ = 3, CFG["context_length"], m.np
    images = torch.randn(b, 3, CFG["image_size"], CFG["image_size"])
    lens = torch.tensor([8, 5, 3])
    tokens = torch.randint(4, 49, (b, tt))
    tokens[:, 0] = 1  # [T_CLS]
    tokens[torch.arange(b), lens - 1] = 2  # [T_SEP]
    tokens[torch.arange(tt)[None, :] >= lens[:, None]] = 0
    tlab = torch.full((b, tt), -1)
    for i, j in ((0, 1), (0, 4), (0, 6), (1, 2), (1, 3), (2, 1)):  # MLM positions, explicitly
        tlab[i, j] = tokens[i, j]
        tokens[i, j] = 49 if (i + j) % 3 else 7  # [MASK], or a random token
    plab = torch.full((b, np_), -1)
    for i, j in ((0, 0), (0, 1), (0, 4), (0, 5), (1, 10), (1, 11), (1, 14), (2, 7)):  # blocks
        plab[i, j] = (3 * i + j) % CFG["mim_vocab"]
    clab = torch.tensor([2, 0, 1])  # every class once
    ref = {"input.images": images.numpy(), "input.tokens": tokens.int().numpy(),
           "input.lens": lens.int().numpy(), "input.text_labels": tlab.int().numpy(),
           "input.patch_labels": plab.int().numpy(), "input.class_labels": clab.int().numpy()}
    g = torch.Generator().manual_seed(9)
    for enc in ("image", "text", "pair"):
        noise = {}
        for i, (l, kind) in enumerate(m.moe_order()):
            if (kind == "v" and enc == "text") or (kind == "t" and enc == "image"):
                continue
            n = b * (tt if kind == "t" else np_ + 1)
            noise[i] = (1.0 / E) * torch.randn(n, E, generator=g, dtype=torch.float64)
            ref[f"{enc}.noise.{i}"] = noise[i].numpy()
        for key, cl in ((enc, None), (f"{enc}.cls", clab)):  # without, then with class labels
            m.zero_grad(set_to_none=True)
            loss, lt, li, aux, h, logits, lc = m(enc, images if enc != "text" else None,
                                                 tokens if enc != "image" else None, lens,
                                                 tlab if enc != "image" else None,
                                                 plab if enc != "text" else None, noise, cl)
            loss.backward()
            if cl is None:
                for k, v in (("text", lt), ("image", li), ("aux", aux)):
                    ref[f"{enc}.{k}"] = np.array([v.item()], dtype=np.float64)
                ref[f"{enc}.hidden"] = h.detach().numpy()
                ref[f"{enc}.cls.logits"] = logits.detach().numpy()
            else:
                ref[f"{key}.cls"] = np.array([lc.item()], dtype=np.float64)
            ref[f"{key}.loss"] = np.array([loss.item()], dtype=np.float64)
            grads(ref, key, names)
    st.save(os.path.join(out, "mome.ref.safetensors"), ref, {"generator": "tests/ref/gen_mome.py"})
    generate_drop(out, m, names, images, tokens, lens, tlab, plab)
    generate_caption(out, m, names, images, tokens, lens, tlab)
    generate_heads(out, m, cfg)


def generate_drop(out, m, names, images, tokens, lens, tlab, plab):
    """mome_drop.ref.safetensors: the pair encoding of mome.ref's inputs on mome.init's weights
    with stochastic depth 0.5 and a fixed mask (drop.keep, (L, 2, B); block 0's rate is 0, so it
    keeps all): the noise (drop.noise.I, its own generator), the losses, hidden states and every
    gradient (drop.grad.NAME)."""
    rate, b = 0.5, images.shape[0]
    keep = torch.tensor([[[1, 1, 1], [1, 1, 1]], [[0, 1, 1], [1, 0, 1]], [[1, 0, 0], [0, 1, 1]]], dtype=torch.int32)
    noise = draw_noise(m, torch.Generator().manual_seed(12), b, ("v", "t"))
    ref = {"drop.rate": np.array([rate], dtype=np.float64), "drop.keep": keep.numpy()}
    for i, v in noise.items():
        ref[f"drop.noise.{i}"] = v.numpy()
    m.zero_grad(set_to_none=True)
    loss, lt, li, aux, h, _, _ = m("pair", images, tokens, lens, tlab, plab, noise, None, (rate, keep))
    loss.backward()
    for k, v in (("loss", loss), ("text", lt), ("image", li), ("aux", aux)):
        ref[f"drop.{k}"] = np.array([v.item()], dtype=np.float64)
    ref["drop.hidden"] = h.detach().numpy()
    grads(ref, "drop", names)
    st.save(os.path.join(out, "mome_drop.ref.safetensors"), ref, {"generator": "tests/ref/gen_mome.py"})


def generate_caption(out, m, names, images, tokens, lens, tlab):
    """mome_caption.ref.safetensors: the caption encoding (a pair under BEiT-3's captioning mask)
    of mome.ref's images and texts on mome.init's weights, with its MLM labels: the noise
    (caption.noise.I, its own generator), the losses, hidden states and every gradient."""
    b = images.shape[0]
    noise = draw_noise(m, torch.Generator().manual_seed(13), b, ("v", "t"))
    ref = {}
    for i, v in noise.items():
        ref[f"caption.noise.{i}"] = v.numpy()
    m.zero_grad(set_to_none=True)
    loss, lt, li, aux, h, _, _ = m("pair", images, tokens, lens, tlab, None, noise, None, None, caption=True)
    loss.backward()
    for k, v in (("loss", loss), ("text", lt), ("image", li), ("aux", aux)):
        ref[f"caption.{k}"] = np.array([v.item()], dtype=np.float64)
    ref["caption.hidden"] = h.detach().numpy()
    grads(ref, "caption", names)
    st.save(os.path.join(out, "mome_caption.ref.safetensors"), ref, {"generator": "tests/ref/gen_mome.py"})


def grads(ref, key, names):
    for k, p in names.items():
        ref[f"{key}.grad.{k}"] = arr(k, p.grad) if p.grad is not None else np.zeros_like(arr(k, p))


def draw_noise(m, g, b, kinds):
    """Router noise (n,E) of every MoE layer of the kinds ("v", "t") a forward of b runs."""
    noise = {}
    for i, (l, kind) in enumerate(m.moe_order()):
        if kind in kinds:
            n = b * (CFG["context_length"] if kind == "t" else m.np + 1)
            noise[i] = (1.0 / E) * torch.randn(n, E, generator=g, dtype=torch.float64)
    return noise


def generate_heads(out, m, cfg):
    """NLVR2's two-pair head and the retrieval head on m's weights, with inputs of their own."""
    g = torch.Generator().manual_seed(11)
    m.add_head(g, cs=2)
    m.add_itc(g)
    names = m.to_vlmoe()
    hcfg = dict(cfg, num_classes=NC, cls_sequences=2, retrieval_head=1)
    st.save(os.path.join(out, "mome_heads.init.safetensors"), {k: arr(k, v) for k, v in names.items()},
            {"vlmoe.config": json.dumps(hcfg), "format": "pt"})
    g = torch.Generator().manual_seed(12)
    b, tt = 4, CFG["context_length"]
    images = torch.randn(b, 3, CFG["image_size"], CFG["image_size"], generator=g)
    lens = torch.tensor([6, 8, 3, 5])
    tokens = torch.randint(4, 49, (b, tt), generator=g)
    tokens[:, 0] = 1  # [T_CLS]
    tokens[torch.arange(b), lens - 1] = 2  # [T_SEP]
    tokens[torch.arange(tt)[None, :] >= lens[:, None]] = 0
    clab = torch.tensor([2, 1])  # examples (pairs 0, 1) and (pairs 2, 3)
    ref = {"heads.images": images.numpy(), "heads.tokens": tokens.int().numpy(),
           "heads.lens": lens.int().numpy(), "nlvr2.class_labels": clab.int().numpy()}
    g = torch.Generator().manual_seed(13)
    # NLVR2: the pair encoding of the four, fine-tuning (no masking), two examples
    noise = draw_noise(m, g, b, ("v", "t"))
    for i, v in noise.items():
        ref[f"nlvr2.noise.{i}"] = v.numpy()
    m.zero_grad(set_to_none=True)
    loss, lt, li, aux, h, logits, lc = m("pair", images, tokens, lens, None, None, noise, clab)
    loss.backward()
    for k, v in (("loss", loss), ("cls", lc), ("aux", aux)):
        ref[f"nlvr2.{k}"] = np.array([v.item()], dtype=np.float64)
    ref["nlvr2.hidden"] = h.detach().numpy()
    ref["nlvr2.logits"] = logits.detach().numpy()
    grads(ref, "nlvr2", names)
    # retrieval: an image forward (V-MoE only) and a text forward (T-MoE only), each its own noise
    noise_i, noise_t = draw_noise(m, g, b, ("v",)), draw_noise(m, g, b, ("t",))
    for side, nz in (("image", noise_i), ("text", noise_t)):
        for i, v in nz.items():
            ref[f"itc.{side}.noise.{i}"] = v.numpy()
    m.zero_grad(set_to_none=True)
    loss, itc, aux_i, aux_t, zi, zt = m.retrieval(images, tokens, lens, noise_i, noise_t)
    loss.backward()
    for k, v in (("loss", loss), ("itc", itc), ("image.aux", aux_i), ("text.aux", aux_t)):
        ref[f"itc.{k}"] = np.array([v.item()], dtype=np.float64)
    ref["itc.image.embed"], ref["itc.text.embed"] = zi.detach().numpy(), zt.detach().numpy()
    grads(ref, "itc", names)
    st.save(os.path.join(out, "mome_heads.ref.safetensors"), ref, {"generator": "tests/ref/gen_mome.py"})
