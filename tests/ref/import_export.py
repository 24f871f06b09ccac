"""import_export.py: the PyTorch side of tests/test_import_export.c (run with Debian's python3).

  make OUT              a small random CLIP (written after OpenAI's model.py: nn.MultiheadAttention,
                        ln_pre/ln_post, class-token and end-of-text pooling) saved the way people
                        have them: OUT/hf (a Hugging Face folder: config.json, model.safetensors with
                        CLIPModel names, vocab.json + merges.txt, preprocessor_config.json) and OUT/oc
                        (an OpenCLIP folder: open_clip_config.json, open_clip_model.safetensors);
                        heads of width 32 (not OpenCLIP's 64) and activations gelu_pytorch_tanh (HF)
                        and gelu (OpenCLIP) so that only the configs can say them. Also OUT/ref.safetensors
                        (inputs and the float64 embeddings of both models), PyTorch pickles
                        (OUT/model.pt zip, OUT/legacy.bin), OUT/hf_bin (config.json + pytorch_model.bin)
                        and OUT/hf_tj (OUT/hf with tokenizer.json instead of vocab.json + merges.txt).
  transformers DIR REF  loads DIR with transformers' CLIPModel/CLIPProcessor and compares its
                        embeddings with REF's hf.* (exit 77 with the reason when transformers is absent)
  open_clip DIR REF     the same with open_clip.create_model_and_transforms('local-dir:DIR') and oc.*
  torch DIR IN OUT      python/vlmoe_torch.py as copied into DIR by `vlmoe export --to torch`:
                        embeddings and routing (expert of each token per MoE layer) of IN's inputs
"""
import json
import math
import os
import sys
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from clip_bpe_ref import bytes_to_unicode  # noqa: E402

IMAGE = dict(size=32, patch=8, width=96, layers=2, heads=3, mlp=160)
TEXT = dict(ctx=16, vocab=600, width=64, layers=2, heads=2, mlp=256)
EMBED, B = 48, 5
ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class Act(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.f = ACTS[name]

    def forward(self, x):
        return self.f(x)


class Block(nn.Module):
    def __init__(self, d, heads, mlp, act):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(d, mlp)), ("gelu", Act(act)), ("c_proj", nn.Linear(mlp, d))]))

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, d, layers, heads, mlp, act):
        super().__init__()
        self.resblocks = nn.ModuleList([Block(d, heads, mlp, act) for _ in range(layers)])

    def forward(self, x, mask=None):
        for b in self.resblocks:
            x = b(x, mask)
        return x


class Visual(nn.Module):
    def __init__(self, act, mlp):
        super().__init__()
        d, n = IMAGE["width"], (IMAGE["size"] // IMAGE["patch"]) ** 2
        self.conv1 = nn.Conv2d(3, d, IMAGE["patch"], stride=IMAGE["patch"], bias=False)
        self.class_embedding = nn.Parameter(d ** -0.5 * torch.randn(d))
        self.positional_embedding = nn.Parameter(d ** -0.5 * torch.randn(n + 1, d))
        self.ln_pre = nn.LayerNorm(d)
        self.transformer = Transformer(d, IMAGE["layers"], IMAGE["heads"], mlp, act)
        self.ln_post = nn.LayerNorm(d)
        self.proj = nn.Parameter(d ** -0.5 * torch.randn(d, EMBED))

    def forward(self, x):
        x = self.conv1(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], 1) + self.positional_embedding
        return self.ln_post(self.transformer(self.ln_pre(x))[:, 0]) @ self.proj


class CLIP(nn.Module):
    def __init__(self, act, image_mlp):
        super().__init__()
        w = TEXT["width"]
        self.visual = Visual(act, image_mlp)
        self.transformer = Transformer(w, TEXT["layers"], TEXT["heads"], TEXT["mlp"], act)
        self.token_embedding = nn.Embedding(TEXT["vocab"], w)
        self.positional_embedding = nn.Parameter(0.01 * torch.randn(TEXT["ctx"], w))
        self.ln_final = nn.LayerNorm(w)
        self.text_projection = nn.Parameter(w ** -0.5 * torch.randn(w, EMBED))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_text(self, t):
        mask = torch.triu(torch.full((TEXT["ctx"], TEXT["ctx"]), float("-inf"), dtype=self.positional_embedding.dtype), 1)
        x = self.ln_final(self.transformer(self.token_embedding(t) + self.positional_embedding, mask))
        return x[torch.arange(x.shape[0]), t.argmax(-1)] @ self.text_projection

    def embeds(self, images, tokens):
        return F.normalize(self.visual(images), dim=-1), F.normalize(self.encode_text(tokens), dim=-1)


def openclip_names(m):
    """OpenCLIP's state-dict names: the module above, blocks under transformer.resblocks.N."""
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def hf_names(sd):
    """OpenCLIP names -> transformers' CLIPModel names (q/k/v split, projections as Linear weights)."""
    out = {}
    for src, dst, layers in (("visual.transformer.resblocks.", "vision_model.encoder.layers.", IMAGE["layers"]),
                             ("transformer.resblocks.", "text_model.encoder.layers.", TEXT["layers"])):
        for l in range(layers):
            s, d = f"{src}{l}.", f"{dst}{l}."
            for kind in ("weight", "bias"):
                for i, part in enumerate(sd[f"{s}attn.in_proj_{kind}"].chunk(3)):
                    out[f"{d}self_attn.{'qkv'[i]}_proj.{kind}"] = part
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
        out[f"{v}pre_layrnorm.{kind}"] = sd[f"visual.ln_pre.{kind}"]  # transformers' spelling
        out[f"{v}post_layernorm.{kind}"] = sd[f"visual.ln_post.{kind}"]
        out[f"{t}final_layer_norm.{kind}"] = sd[f"ln_final.{kind}"]
    out["visual_projection.weight"] = sd["visual.proj"].t()
    out[t + "embeddings.token_embedding.weight"] = sd["token_embedding.weight"]
    out[t + "embeddings.position_embedding.weight"] = sd["positional_embedding"]
    out["text_projection.weight"] = sd["text_projection"].t()
    out["logit_scale"] = sd["logit_scale"]
    return out


def tokenizer_files(d):
    """A CLIP-layout BPE vocabulary of TEXT['vocab'] ids: the 256 byte symbols, the same with
    </w>, merges spelling some words, <|startoftext|>, <|endoftext|>."""
    base = list(bytes_to_unicode().values())
    vocab = base + [b + "</w>" for b in base]
    merges, have = [], set(vocab)
    words = ("photo a of the cat dog car bird red blue green small large picture drawing painting "
             "sketch sculpture rendering toy plastic origami tattoo embroidered cartoon graffiti").split()
    for w in words:
        sym = w[0]
        for i, ch in enumerate(w[1:]):
            right = ch + ("</w>" if i == len(w) - 2 else "")
            new = sym + right
            if new not in have and len(vocab) < TEXT["vocab"] - 2:
                merges.append(f"{sym} {right}")
                vocab.append(new)
                have.add(new)
            sym = new
    letters = "abcdefghijklmnopqrstuvwxyz"
    for x in letters:  # filler merges "x y</w>" up to the vocabulary size
        for y in letters:
            if len(vocab) < TEXT["vocab"] - 2 and x + y + "</w>" not in have:
                merges.append(f"{x} {y}</w>")
                vocab.append(x + y + "</w>")
                have.add(x + y + "</w>")
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({s: i for i, s in enumerate(vocab)}, f, ensure_ascii=False)
    # the same vocabulary as a tokenizers-library tokenizer.json, in a copy of the folder
    tj = {"version": "1.0", "truncation": None, "padding": None,
          "added_tokens": [{"id": len(vocab) - 2 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i, t in enumerate(vocab[-2:])],
          "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
          "model": {"type": "BPE", "dropout": None, "unk_token": "<|endoftext|>", "continuing_subword_prefix": "",
                    "end_of_word_suffix": "</w>", "fuse_unk": False, "vocab": {t: i for i, t in enumerate(vocab)},
                    "merges": merges}}
    os.makedirs(d + "_tj", exist_ok=True)
    with open(os.path.join(d + "_tj", "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": TEXT["ctx"], "bos_token": "<|startoftext|>",
                   "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)


def model(seed, act, image_mlp):
    torch.manual_seed(seed)
    m = CLIP(act, image_mlp)
    with torch.no_grad():  # random LayerNorm affines and biases so each tensor's place matters
        for name, p in m.named_parameters():
            if p.dim() == 1 and "class_embedding" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def tower(w, mlp, heads, layers, act):
    return {"hidden_size": w, "intermediate_size": mlp, "num_attention_heads": heads, "num_hidden_layers": layers,
            "hidden_act": act, "layer_norm_eps": 1e-05, "projection_dim": EMBED}


def make(out):
    hf_dir, oc_dir, bin_dir = (os.path.join(out, d) for d in ("hf", "oc", "hf_bin"))
    for d in (hf_dir, oc_dir, bin_dir):
        os.makedirs(d, exist_ok=True)
    hf = model(11, "gelu_pytorch_tanh", IMAGE["mlp"])
    oc = model(12, "gelu", 4 * IMAGE["width"])
    sd_hf = {k: v.numpy().astype(np.float32) for k, v in hf_names(openclip_names(hf)).items()}
    st.save(os.path.join(hf_dir, "model.safetensors"), sd_hf, {"format": "pt"})
    vc = tower(IMAGE["width"], IMAGE["mlp"], IMAGE["heads"], IMAGE["layers"], "gelu_pytorch_tanh")
    vc.update(image_size=IMAGE["size"], patch_size=IMAGE["patch"], num_channels=3)
    tc = tower(TEXT["width"], TEXT["mlp"], TEXT["heads"], TEXT["layers"], "gelu_pytorch_tanh")
    tc.update(vocab_size=TEXT["vocab"], max_position_embeddings=TEXT["ctx"], bos_token_id=TEXT["vocab"] - 2,
              eos_token_id=TEXT["vocab"] - 1, pad_token_id=1)
    cfg = {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": EMBED,
           "logit_scale_init_value": 2.6592, "text_config": tc, "vision_config": vc}
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    pre = {"crop_size": {"height": IMAGE["size"], "width": IMAGE["size"]}, "do_center_crop": True, "do_normalize": True,
           "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3],
           "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": IMAGE["size"]},
           "image_processor_type": "CLIPImageProcessor", "processor_class": "CLIPProcessor"}
    with open(os.path.join(hf_dir, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)
    tokenizer_files(hf_dir)  # also hf_tj/tokenizer.json: the folder with tokenizer.json instead
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        with open(os.path.join(hf_dir, name), "rb") as src, open(os.path.join(hf_dir + "_tj", name), "wb") as dst:
            dst.write(src.read())
    st.save(os.path.join(oc_dir, "open_clip_model.safetensors"),
            {k: v.numpy().astype(np.float32) for k, v in openclip_names(oc).items()})
    occ = {"model_cfg": {"embed_dim": EMBED, "vision_cfg": {"image_size": IMAGE["size"], "layers": IMAGE["layers"],
                                                            "width": IMAGE["width"], "head_width": IMAGE["width"] // IMAGE["heads"],
                                                            "patch_size": IMAGE["patch"]},
                         "text_cfg": {"context_length": TEXT["ctx"], "vocab_size": TEXT["vocab"], "width": TEXT["width"],
                                      "heads": TEXT["heads"], "layers": TEXT["layers"]}},
           "preprocess_cfg": {"mean": [0.1, 0.2, 0.3], "std": [0.3, 0.2, 0.1], "interpolation": "bicubic",
                              "resize_mode": "shortest"}}
    with open(os.path.join(oc_dir, "open_clip_config.json"), "w") as f:
        json.dump(occ, f, indent=2)
    # pickles, as torch.save writes them
    torch.save(openclip_names(oc), os.path.join(out, "model.pt"))
    torch.save(openclip_names(oc), os.path.join(out, "legacy.bin"), _use_new_zipfile_serialization=False)
    torch.save(hf_names(openclip_names(hf)), os.path.join(bin_dir, "pytorch_model.bin"))
    with open(os.path.join(bin_dir, "config.json"), "w") as f:
        json.dump(cfg, f)

    images = torch.randn(B, 3, IMAGE["size"], IMAGE["size"])
    lens = torch.tensor([16, 2, 9, 5, 12])
    eot = TEXT["vocab"] - 1  # the largest id: argmax pooling finds it
    tokens = torch.randint(1, eot - 1, (B, TEXT["ctx"]))
    tokens[:, 0] = eot - 1
    tokens[torch.arange(TEXT["ctx"])[None, :] >= lens[:, None]] = 0
    tokens[torch.arange(B), lens - 1] = eot
    ref = {"input.images": images.numpy(), "input.tokens": tokens.int().numpy(), "input.lens": lens.int().numpy()}
    with torch.no_grad():
        for tag, m in (("hf", hf), ("oc", oc)):
            img, txt = m.double().embeds(images.double(), tokens)
            ref[f"{tag}.image_embeds"], ref[f"{tag}.text_embeds"] = img.float().numpy(), txt.float().numpy()
    st.save(os.path.join(out, "ref.safetensors"), ref)


def rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def check(tag, img, txt, ref):
    ei, et = rel_err(img, ref[f"{tag}.image_embeds"]), rel_err(txt, ref[f"{tag}.text_embeds"])
    print(f"{tag}: max relative error image {ei:.2g}, text {et:.2g}")
    return 0 if ei < 1e-5 and et < 1e-5 else 1


def run_transformers(d, ref_path):
    try:
        import transformers
        from transformers import CLIPModel, CLIPProcessor
    except Exception as e:  # noqa: BLE001 - any import failure means the check cannot run
        print(f"SKIP: transformers is not usable here ({type(e).__name__}: {e})")
        return 77
    ref, _ = st.load(ref_path)
    m = CLIPModel.from_pretrained(d).eval()
    proc = CLIPProcessor.from_pretrained(d)
    ids = proc.tokenizer("a photo of a cat")["input_ids"]
    pix = proc(images=[np.zeros((40, 50, 3), np.uint8)], return_tensors="pt")["pixel_values"]
    print(f"transformers {transformers.__version__}: CLIPProcessor ids {ids}, pixel_values {tuple(pix.shape)}")
    with torch.no_grad():
        img = F.normalize(m.get_image_features(pixel_values=torch.from_numpy(ref["input.images"].copy())), dim=-1)
        tok = torch.from_numpy(ref["input.tokens"].astype(np.int64))
        txt = F.normalize(m.get_text_features(input_ids=tok), dim=-1)
    return check("hf", img.numpy(), txt.numpy(), ref) or (0 if pix.shape[-1] == IMAGE["size"] else 1)


def run_open_clip(d, ref_path):
    try:
        import open_clip
    except Exception as e:  # noqa: BLE001
        print(f"SKIP: open_clip is not usable here ({type(e).__name__}: {e})")
        return 77
    ref, _ = st.load(ref_path)
    m, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + d)
    m.eval()
    with torch.no_grad():
        img = F.normalize(m.encode_image(torch.from_numpy(ref["input.images"].copy())), dim=-1)
        txt = F.normalize(m.encode_text(torch.from_numpy(ref["input.tokens"].astype(np.int64))), dim=-1)
    print(f"open_clip {open_clip.__version__}: loaded local-dir:{d}")
    return check("oc", img.numpy(), txt.numpy(), ref)


def run_torch(d, inp, out):
    sys.path.insert(0, d)
    import vlmoe_torch
    x, _ = st.load(inp)
    bs = int(x["batch_size"][0])
    m = vlmoe_torch.load(d, batch_size=bs)
    res = {"image_embeds": m.encode_images(torch.from_numpy(x["images"].copy())).numpy()}
    for i, r in enumerate(m.routing):
        res[f"image_routing.{i}"] = r.int().numpy()
    res["text_embeds"] = m.encode_texts(torch.from_numpy(x["tokens"].astype(np.int64)), torch.from_numpy(x["lens"].astype(np.int64))).numpy()
    for i, r in enumerate(m.routing):
        res[f"text_routing.{i}"] = r.int().numpy()
    st.save(out, res)
    print(f"vlmoe_torch: {len(m.routing)} MoE layers, embeddings {res['image_embeds'].shape}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2])
        sys.exit(0)
    sys.exit({"transformers": run_transformers, "open_clip": run_open_clip, "torch": run_torch}[cmd](*sys.argv[2:]))
