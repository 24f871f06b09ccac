"""gen_itm.py: PyTorch reference of VL-MoE's retrieval fine-tuning with image-text matching and
hard negatives (VL-MoE sec. 4.2: "image-text contrastive and image-text matching with hard
negative mining objectives as in VLMo"), written from that description and VLMo's recipe,
independently of src/nn/mome_itm.c and src/loss/itm.c, on gen_mome.py's MoME reference.

Four image-text pairs: the contrastive step (image and text encoded apart, [I_CLS]/[T_CLS]
projected and normalised, CLIP's symmetric cross-entropy of exp(logit_scale) x similarities);
then, without gradient, the mining distributions: image i's negative text j != i with probability
softmax(sim[i])[j] renormalised with the positive's weight set to zero, text j's negative image
likewise over column j; one draw of each (torch.multinomial; vlmoe draws from its own stream, so
the test takes these indices). The 3B pairs in VLMo's order, (image i, text i) matched,
(negative image of text j, text j) and (image i, its negative text) unmatched, go through one
pair forward; the ITM head "itm_head" (2, width) + bias reads the fused [T_CLS]; ITM is the mean
2-way cross-entropy. Loss = itc + itm + the three forwards' MoE losses, equal weights as VLMo's.

Writes itm.init.safetensors (gen_mome's weights with the retrieval and ITM heads, config
retrieval_head = itm_head = 1) and itm.ref.safetensors: the inputs (itm.images, itm.tokens,
itm.lens), the router noise of the image, text and pair forwards (itm.image.noise.I,
itm.text.noise.I, itm.pair.noise.I), the mining similarities (itm.sim), probabilities
(itm.p_text, itm.p_image), the draws (itm.neg_text, itm.neg_image), the losses (itm.itc,
itm.itm, itm.aux, itm.loss), the head's logits (itm.logits) and every gradient (itm.grad.NAME).
Consumed by tests/test_itm.c."""
import json
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import gen_mome as gm
import st


def generate(out):
    torch.manual_seed(8)  # gen_mome.generate's weights
    cfg = dict(gm.CFG, moe=gm.moe_cfg("bpr", gm.V_AUX), text_moe=gm.moe_cfg("fifo", gm.T_AUX))
    m = gm.MoME()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1 and "cls" not in name and "mask_token" not in name:
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(31)
    m.add_itc(g)
    d = gm.CFG["encoder"]["width"]
    itm_w = nn.Parameter(torch.randn(2, d, generator=g) / math.sqrt(d))
    itm_b = nn.Parameter(0.1 * torch.randn(2, generator=g))
    names = m.to_vlmoe()
    names.update({"itm_head.weight": itm_w, "itm_head.bias": itm_b})
    st.save(os.path.join(out, "itm.init.safetensors"), {k: gm.arr(k, v) for k, v in names.items()},
            {"vlmoe.config": json.dumps(dict(cfg, retrieval_head=1, itm_head=1)), "format": "pt"})

    g = torch.Generator().manual_seed(32)
    b, tt = 4, gm.CFG["context_length"]
    images = torch.randn(b, 3, gm.CFG["image_size"], gm.CFG["image_size"], generator=g)
    lens = torch.tensor([7, 4, 8, 5])
    tokens = torch.randint(4, 49, (b, tt), generator=g)
    tokens[:, 0] = 1  # [T_CLS]
    tokens[torch.arange(b), lens - 1] = 2  # [T_SEP]
    tokens[torch.arange(tt)[None, :] >= lens[:, None]] = 0
    ref = {"itm.images": images.numpy(), "itm.tokens": tokens.int().numpy(), "itm.lens": lens.int().numpy()}
    noise_i, noise_t = gm.draw_noise(m, g, b, ("v",)), gm.draw_noise(m, g, b, ("t",))
    noise_p = gm.draw_noise(m, g, 3 * b, ("v", "t"))
    for side, nz in (("image", noise_i), ("text", noise_t), ("pair", noise_p)):
        for i, v in nz.items():
            ref[f"itm.{side}.noise.{i}"] = v.numpy()

    m.zero_grad(set_to_none=True)
    _, itc, aux_i, aux_t, zi, zt = m.retrieval(images, tokens, lens, noise_i, noise_t)
    with torch.no_grad():  # mining: a copy of the logits, no gradient through the choice
        sim = m.logit_scale.exp() * zi @ zt.t()
        w_t = F.softmax(sim.double(), dim=1)
        w_t.fill_diagonal_(0)
        p_text = w_t / w_t.sum(1, keepdim=True)
        w_i = F.softmax(sim.t().double(), dim=1)
        w_i.fill_diagonal_(0)
        p_image = w_i / w_i.sum(1, keepdim=True)
        gd = torch.Generator().manual_seed(33)
        neg_text = torch.stack([torch.multinomial(p_text[i], 1, generator=gd)[0] for i in range(b)])
        neg_image = torch.stack([torch.multinomial(p_image[j], 1, generator=gd)[0] for j in range(b)])
    idx = torch.arange(b)
    pimg = torch.cat([images, images[neg_image], images])
    ptok = torch.cat([tokens, tokens, tokens[neg_text]])
    plen = torch.cat([lens, lens, lens[neg_text]])
    labels = torch.cat([torch.ones(b), torch.zeros(2 * b)]).long()
    _, _, _, aux_p, h, _, _ = m("pair", pimg, ptok, plen, None, None, noise_p)
    feat = h[:, m.np + 1]  # vlmoe's order (image first): the fused [T_CLS] follows [I_CLS] + patches
    logits = F.linear(feat, itm_w, itm_b)
    itm = F.cross_entropy(logits, labels)
    aux = aux_i + aux_t + aux_p
    loss = itc + itm + aux
    loss.backward()
    ref.update({"itm.sim": sim.numpy(), "itm.p_text": p_text.numpy(), "itm.p_image": p_image.numpy(),
                "itm.neg_text": neg_text.int().numpy(), "itm.neg_image": neg_image.int().numpy(),
                "itm.logits": logits.detach().numpy()})
    for k, v in (("itc", itc), ("itm", itm), ("aux", aux), ("loss", loss), ("pair.aux", aux_p)):
        ref[f"itm.{k}"] = np.array([v.item()], dtype=np.float64)
    gm.grads(ref, "itm", names)
    assert (neg_text != idx).all() and (neg_image != idx).all()
    st.save(os.path.join(out, "itm.ref.safetensors"), ref, {"generator": "tests/ref/gen_itm.py"})
