"""model_ref.py: vlmoe's dense models written with torch.nn (nn.MultiheadAttention, nn.LayerNorm,
nn.Conv2d patch embedding, nn.Embedding), from MODEL.md, independently of the C code. Used by the
fixture generators gen_model.py (parity of blocks and whole models) and by bench/ later.
to_vlmoe() maps the module's state dict onto vlmoe's parameter names and layouts."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d, heads, mlp, act, eps):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.fc1 = nn.Linear(d, mlp)
        self.fc2 = nn.Linear(mlp, d)
        self.act = ACTS[act]

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=attn_mask,
                          key_padding_mask=key_padding_mask)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))

    def vlmoe_names(self, prefix):
        return {f"{prefix}.ln1.weight": self.ln1.weight, f"{prefix}.ln1.bias": self.ln1.bias,
                f"{prefix}.attn.qkv.weight": self.attn.in_proj_weight,
                f"{prefix}.attn.qkv.bias": self.attn.in_proj_bias,
                f"{prefix}.attn.out.weight": self.attn.out_proj.weight,
                f"{prefix}.attn.out.bias": self.attn.out_proj.bias,
                f"{prefix}.ln2.weight": self.ln2.weight, f"{prefix}.ln2.bias": self.ln2.bias,
                f"{prefix}.mlp.fc1.weight": self.fc1.weight, f"{prefix}.mlp.fc1.bias": self.fc1.bias,
                f"{prefix}.mlp.fc2.weight": self.fc2.weight, f"{prefix}.mlp.fc2.bias": self.fc2.bias}


class Encoder(nn.Module):
    def __init__(self, e, act, eps):
        super().__init__()
        self.blocks = nn.ModuleList([Block(e["width"], e["heads"], e["mlp_dim"], act, eps)
                                     for _ in range(e["layers"])])
        self.ln_final = nn.LayerNorm(e["width"], eps=eps)

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        for b in self.blocks:
            x = b(x, attn_mask, key_padding_mask)
        return self.ln_final(x)


class Model(nn.Module):
    """one_tower (LIMoE layout: shared encoder) or two_tower (OpenAI CLIP layout)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        one = cfg["arch"] == "one_tower"
        ei = cfg["encoder"]
        et = ei if one else cfg["text_encoder"]
        di, dt, eps, p = ei["width"], et["width"], cfg["ln_eps"], cfg["patch_size"]
        n_patch = (cfg["image_size"] // p) ** 2
        self.patch = nn.Conv2d(cfg["channels"], di, p, stride=p, bias=cfg["patch_bias"])
        self.cls = nn.Parameter(0.02 * torch.randn(di)) if cfg["image_class_token"] else None
        self.ipos = nn.Parameter(0.02 * torch.randn(n_patch + (1 if self.cls is not None else 0), di))
        self.ln_pre = nn.LayerNorm(di, eps=eps) if cfg["image_ln_pre"] else None
        self.tok = nn.Embedding(cfg["vocab_size"], dt)
        self.tpos = nn.Parameter(0.02 * torch.randn(cfg["context_length"], dt))
        self.enc_i = Encoder(ei, cfg["act"], eps)
        self.enc_t = self.enc_i if one else Encoder(et, cfg["act"], eps)
        self.iproj = nn.Linear(di, cfg["embed_dim"], bias=False)
        self.tproj = nn.Linear(dt, cfg["embed_dim"], bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(cfg["init_temperature"])))

    def encode_image(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.ipos
        if self.ln_pre is not None:
            x = self.ln_pre(x)
        x = self.enc_i(x)
        x = x[:, 0] if self.cfg["image_pool"] == "cls" else x.mean(dim=1)
        return F.normalize(self.iproj(x), dim=-1)

    def encode_text(self, tokens, lens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.tpos
        pad = torch.arange(t)[None, :] >= lens[:, None]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1) if self.cfg["text_causal"] else None
        x = self.enc_t(x, attn_mask=causal, key_padding_mask=pad)
        if self.cfg["text_pool"] == "eot":
            x = x[torch.arange(x.shape[0]), lens - 1]
        else:
            x = (x * (~pad)[..., None]).sum(1) / lens[:, None]
        return F.normalize(self.tproj(x), dim=-1)

    def forward(self, images, tokens, lens):
        img, txt = self.encode_image(images), self.encode_text(tokens, lens)
        logits = self.logit_scale.exp() * img @ txt.t()
        target = torch.arange(logits.shape[0])
        loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
        return loss, logits

    def to_vlmoe(self):
        """name -> Parameter in vlmoe's layout (the patch conv flattened to (D, C*P*P))."""
        one = self.cfg["arch"] == "one_tower"
        out = {"image.patch_embed.weight": self.patch.weight}
        if self.patch.bias is not None:
            out["image.patch_embed.bias"] = self.patch.bias
        if self.cls is not None:
            out["image.class_token"] = self.cls
        out["image.pos_embed"] = self.ipos
        if self.ln_pre is not None:
            out["image.ln_pre.weight"], out["image.ln_pre.bias"] = self.ln_pre.weight, self.ln_pre.bias
        out["text.token_embed"], out["text.pos_embed"] = self.tok.weight, self.tpos
        encs = [("encoder", self.enc_i)] if one else [("image", self.enc_i), ("text", self.enc_t)]
        for prefix, enc in encs:
            for i, b in enumerate(enc.blocks):
                out.update(b.vlmoe_names(f"{prefix}.blocks.{i}"))
            out[f"{prefix}.ln_final.weight"] = enc.ln_final.weight
            out[f"{prefix}.ln_final.bias"] = enc.ln_final.bias
        out["image.proj"], out["text.proj"] = self.iproj.weight, self.tproj.weight
        out["logit_scale"] = self.logit_scale
        return out


def vlmoe_array(name, t):
    """A parameter (or its gradient) as vlmoe stores it."""
    a = t.detach().float().cpu().numpy().copy()  # a copy: the optimizer updates in place
    if name == "image.patch_embed.weight":
        a = a.reshape(a.shape[0], -1)
    return a


def perturb_(model, scale=0.1):
    """Random LayerNorm affine and biases too, so no gradient is trivially structured."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "cls" not in name:
                p.add_(scale * torch.randn_like(p))
