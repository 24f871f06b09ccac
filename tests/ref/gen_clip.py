"""gen_clip.py: fixtures for CLIP weight import/export (src/io/clip_import.c, tests/test_clip_import.c).
A tiny CLIP written after OpenAI's model.py (VisionTransformer + text Transformer, LND layout,
nn.MultiheadAttention, QuickGELU, ln_pre / ln_post, x @ proj, pooling at argmax of the token
ids), so its state_dict() carries OpenAI/OpenCLIP names as is; HF CLIPModel names are mapped from
them the way transformers' convert_clip_original_pytorch_to_hf.py does (q/k/v split, projections
as Linear weights). Heads follow OpenCLIP's width / 64. Writes:
  clip_openclip.safetensors  OpenAI/OpenCLIP names, F32
  clip_hf.safetensors        HF names, F32, with the int64 position_ids buffers older files carry
  clip_hf_f16.safetensors    HF names, F16
  clip_ref.safetensors       inputs, and the normalised image/text embeddings and logits computed
                             in float64 from the F32 weights (ref.*) and from the F16 ones (f16.*)
"""
import math
import os
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import st

IMAGE = dict(width=128, layers=2, patch=8, size=32)
TEXT = dict(width=64, layers=3, ctx=16, vocab=100)
EMBED = 32
B = 5


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d, heads, attn_mask=None):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads)
        self.ln_1 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(d, 4 * d)), ("gelu", QuickGELU()),
                                              ("c_proj", nn.Linear(4 * d, d))]))
        self.ln_2 = nn.LayerNorm(d)
        self.attn_mask = attn_mask

    def forward(self, x):  # (L, N, D)
        h = self.ln_1(x)
        m = None if self.attn_mask is None else self.attn_mask.to(x.dtype)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=m)[0]
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, d, layers, heads, attn_mask=None):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(d, heads, attn_mask) for _ in range(layers)])

    def forward(self, x):
        return self.resblocks(x)


class VisionTransformer(nn.Module):
    def __init__(self, size, patch, d, layers, heads, out):
        super().__init__()
        s = d ** -0.5
        self.conv1 = nn.Conv2d(3, d, patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(s * torch.randn(d))
        self.positional_embedding = nn.Parameter(s * torch.randn((size // patch) ** 2 + 1, d))
        self.ln_pre = nn.LayerNorm(d)
        self.transformer = Transformer(d, layers, heads)
        self.ln_post = nn.LayerNorm(d)
        self.proj = nn.Parameter(s * torch.randn(d, out))

    def forward(self, x):
        x = self.conv1(x).flatten(2).permute(0, 2, 1)
        cls = self.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.ln_pre(x).permute(1, 0, 2)
        x = self.transformer(x).permute(1, 0, 2)
        return self.ln_post(x[:, 0, :]) @ self.proj


class CLIP(nn.Module):
    def __init__(self):
        super().__init__()
        w, ctx = TEXT["width"], TEXT["ctx"]
        self.visual = VisionTransformer(IMAGE["size"], IMAGE["patch"], IMAGE["width"], IMAGE["layers"],
                                        IMAGE["width"] // 64, EMBED)
        mask = torch.empty(ctx, ctx).fill_(float("-inf")).triu_(1)
        self.transformer = Transformer(w, TEXT["layers"], w // 64, mask)
        self.token_embedding = nn.Embedding(TEXT["vocab"], w)
        self.positional_embedding = nn.Parameter(0.01 * torch.randn(ctx, w))
        self.ln_final = nn.LayerNorm(w)
        self.text_projection = nn.Parameter(w ** -0.5 * torch.randn(w, EMBED))
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_image(self, image):
        return self.visual(image)

    def encode_text(self, text):
        x = (self.token_embedding(text) + self.positional_embedding).permute(1, 0, 2)
        x = self.ln_final(self.transformer(x).permute(1, 0, 2))
        return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection

    def forward(self, image, text):
        img = F.normalize(self.encode_image(image), dim=-1)
        txt = F.normalize(self.encode_text(text), dim=-1)
        return img, txt, self.logit_scale.exp() * img @ txt.t()


def to_hf(sd):
    """OpenAI/OpenCLIP names -> HF CLIPModel names."""
    out = {}
    towers = (("visual.transformer.resblocks.", "vision_model.encoder.layers.", IMAGE["layers"]),
              ("transformer.resblocks.", "text_model.encoder.layers.", TEXT["layers"]))
    for src, dst, layers in towers:
        for l in range(layers):
            s, d = f"{src}{l}.", f"{dst}{l}."
            for kind in ("weight", "bias"):
                for i, qkv in enumerate(sd[f"{s}attn.in_proj_{kind}"].chunk(3)):
                    out[f"{d}self_attn.{'qkv'[i]}_proj.{kind}"] = qkv
                out[f"{d}self_attn.out_proj.{kind}"] = sd[f"{s}attn.out_proj.{kind}"]
                out[f"{d}layer_norm1.{kind}"] = sd[f"{s}ln_1.{kind}"]
                out[f"{d}layer_norm2.{kind}"] = sd[f"{s}ln_2.{kind}"]
                out[f"{d}mlp.fc1.{kind}"] = sd[f"{s}mlp.c_fc.{kind}"]
                out[f"{d}mlp.fc2.{kind}"] = sd[f"{s}mlp.c_proj.{kind}"]
    v, t = "vision_model.", "text_model."
    out[v + "embeddings.patch_embedding.weight"] = sd["visual.conv1.weight"]
    out[v + "embeddings.class_embedding"] = sd["visual.class_embedding"]
    out[v + "embeddings.position_embedding.weight"] = sd["visual.positional_embedding"]
    for kind in ("weight", "bias"):
        out[f"{v}pre_layrnorm.{kind}"] = sd[f"visual.ln_pre.{kind}"]  # (sic), HF's spelling
        out[f"{v}post_layernorm.{kind}"] = sd[f"visual.ln_post.{kind}"]
        out[f"{t}final_layer_norm.{kind}"] = sd[f"ln_final.{kind}"]
    out["visual_projection.weight"] = sd["visual.proj"].t()
    out[t + "embeddings.token_embedding.weight"] = sd["token_embedding.weight"]
    out[t + "embeddings.position_embedding.weight"] = sd["positional_embedding"]
    out["text_projection.weight"] = sd["text_projection"].t()
    out["logit_scale"] = sd["logit_scale"]
    return out


def arrays(sd, dtype=np.float32):
    return {k: v.detach().numpy().astype(dtype) for k, v in sd.items()}


def generate(out):
    torch.manual_seed(7)
    m = CLIP()
    with torch.no_grad():  # random LayerNorm affines and biases so each tensor's place matters
        for name, p in m.named_parameters():
            if p.dim() == 1 and "class_embedding" not in name:
                p.add_(0.1 * torch.randn_like(p))
        m.logit_scale.fill_(math.log(20.0))
    sd = m.state_dict()
    st.save(os.path.join(out, "clip_openclip.safetensors"), arrays(sd), {"format": "pt"})
    hf = arrays(to_hf(sd))
    hf["vision_model.embeddings.position_ids"] = np.arange((IMAGE["size"] // IMAGE["patch"]) ** 2 + 1)[None]
    hf["text_model.embeddings.position_ids"] = np.arange(TEXT["ctx"])[None]
    st.save(os.path.join(out, "clip_hf.safetensors"), hf, {"format": "pt"})
    hf16 = arrays(to_hf(sd), np.float16)
    st.save(os.path.join(out, "clip_hf_f16.safetensors"), hf16, {"format": "pt"})

    images = torch.randn(B, 3, IMAGE["size"], IMAGE["size"])
    lens = torch.tensor([16, 2, 9, 5, 12])
    eot = TEXT["vocab"] - 1  # the largest id, as CLIP's <|endoftext|>: argmax finds it
    tokens = torch.randint(1, eot - 1, (B, TEXT["ctx"]))
    tokens[:, 0] = eot - 1
    tokens[torch.arange(TEXT["ctx"])[None, :] >= lens[:, None]] = 0
    tokens[torch.arange(B), lens - 1] = eot
    ref = {"input.images": images.numpy(), "input.tokens": tokens.int().numpy(),
           "input.lens": lens.int().numpy()}
    m = m.double()
    with torch.no_grad():
        for tag, half in (("ref", False), ("f16", True)):
            m.load_state_dict({k: (v.half() if half else v).double() for k, v in sd.items()})
            img, txt, logits = m(images.double(), tokens)
            ref[f"{tag}.image_embeds"] = img.float().numpy()
            ref[f"{tag}.text_embeds"] = txt.float().numpy()
            ref[f"{tag}.logits"] = logits.float().numpy()
    st.save(os.path.join(out, "clip_ref.safetensors"), ref)
