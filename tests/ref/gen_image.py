"""gen_image.py: PIL parity fixture for image decoding and preprocessing (src/data/image.c), read by
tests/test_image.c. torchvision is not installed, so its three formulas are written out here (they
are short): Resize(int) output size, CenterCrop offsets and ToTensor + Normalize in float32.

Writes into outdir image files made with numpy + PIL and image_ref.safetensors, whose tensors are
named "<file>|<op>" so the C test can loop over them:
  <file>|decode            U8 (h, w, 3)  Image.open(file).convert("RGB")
  <file>|short<S>          U8            resize shorter side to S: img.resize(torchvision size, BICUBIC)
  <file>|crop<S>           U8 (S, S, 3)  then torchvision CenterCrop(S)
  <file>|tensor<S>         F32 (3, S, S) then ToTensor + Normalize with CLIP's mean / std
  <file>|limoe<S>          F32 (3, S, S) the same with mean = std = 0.5 (LIMoE's [-1, 1])
  <file>|resize<W>x<H>     U8 (H, W, 3)  img.resize((W, H), BICUBIC)
  <file>|box<x>,<y>,<w>,<h>|<S>  U8 (S, S, 3)  img.crop(box).resize((S, S), BICUBIC), which is
                           torchvision's resized_crop (the train transform's resampling)
Images: two numpy gradient + sinusoid + hard-edged checkerboard + noise pictures, landscape 157x111
and portrait 90x203 (odd sizes: center crops land on half pixels), saved as PNG; the landscape one
also as JPEG (4:2:0 baseline, 4:4:4, progressive, greyscale, CMYK), as PNG with alpha, grey+alpha,
palette + transparency and 1 bit, and as lossless WebP.
"""
import os

import numpy as np
from PIL import Image

from st import save

BICUBIC = getattr(Image, "Resampling", Image).BICUBIC
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
HALF = np.array([0.5, 0.5, 0.5], np.float32)
SIZES = [32, 64, 100, 224]


def make_source(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([255 * x / (w - 1), 255 * y / (h - 1),
                    127.5 + 127.5 * np.sin(x / 3.0) * np.cos(y / 5.0)], -1)
    board = ((x // 4 + y // 4) % 2 == 0) & (x > w / 2) & (y < h / 2)
    img[board] = [255, 0, 255]
    img[(~board) & (x > w / 2) & (y < h / 2)] = [0, 255, 0]
    noisy = (x < w / 3) & (y > h / 2)
    img[noisy] += rng.normal(0, 40, (int(noisy.sum()), 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def shorter_side_size(w, h, s):
    # torchvision.transforms.functional._compute_resized_output_size with an int size
    if w <= h:
        return s, int(s * h / w)
    return int(s * w / h), s


def center_crop(a, s):
    # torchvision.transforms.functional.center_crop (no padding needed here)
    h, w = a.shape[:2]
    top, left = int(round((h - s) / 2.0)), int(round((w - s) / 2.0))
    return a[top:top + s, left:left + s]


def to_tensor(a, mean, std):
    # ToTensor: float32 / 255, (C, H, W); Normalize: (t - mean) / std, all in float32
    t = a.astype(np.float32).transpose(2, 0, 1) / np.float32(255)
    return ((t - mean.reshape(3, 1, 1)) / std.reshape(3, 1, 1)).astype(np.float32)


def rgb_of(path):
    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


def generate(outdir):
    t = {}
    land = make_source(157, 111, 1)
    port = make_source(90, 203, 2)
    for name, a in (("image_land.png", land), ("image_port.png", port)):
        path = os.path.join(outdir, name)
        Image.fromarray(a).save(path)
        im = Image.open(path).convert("RGB")
        t[f"{name}|decode"] = np.array(im)
        for s in SIZES:
            r = np.array(im.resize(shorter_side_size(im.width, im.height, s), BICUBIC))
            c = center_crop(r, s)
            t[f"{name}|short{s}"] = r
            t[f"{name}|crop{s}"] = np.ascontiguousarray(c)
            t[f"{name}|tensor{s}"] = to_tensor(c, CLIP_MEAN, CLIP_STD)
        t[f"{name}|limoe224"] = to_tensor(
            center_crop(np.array(im.resize(shorter_side_size(im.width, im.height, 224), BICUBIC)),
                        224), HALF, HALF)
        w, h = im.size
        for rw, rh in ((50, 200), (w, 60), (300, h), (w, h), (1, 1), (7, 3), (400, 300)):
            t[f"{name}|resize{rw}x{rh}"] = np.array(im.resize((rw, rh), BICUBIC))
        for (bx, by, bw, bh), s in (((10, 5, 80, 60), 64), ((3, 7, 61, 90), 224),
                                    ((0, 0, w, h), 32), ((w - 40, h - 30, 40, 30), 40)):
            crop = im.crop((bx, by, bx + bw, by + bh)).resize((s, s), BICUBIC)
            t[f"{name}|box{bx},{by},{bw},{bh}|{s}"] = np.array(crop)

    src = Image.fromarray(land)
    jpegs = {
        "image_land.jpg": (src, dict(quality=90)),
        "image_land_444.jpg": (src, dict(quality=95, subsampling=0)),
        "image_land_prog.jpg": (src, dict(quality=75, progressive=True)),
        "image_land_grey.jpg": (src.convert("L"), dict(quality=90)),
        "image_land_cmyk.jpg": (src.convert("CMYK"), dict(quality=90)),
    }
    for name, (im, kw) in jpegs.items():
        path = os.path.join(outdir, name)
        im.save(path, "JPEG", **kw)
        t[f"{name}|decode"] = rgb_of(path)
    a = rgb_of(os.path.join(outdir, "image_land.jpg"))
    t["image_land.jpg|tensor224"] = to_tensor(
        center_crop(np.array(Image.fromarray(a).resize(shorter_side_size(157, 111, 224), BICUBIC)),
                    224), CLIP_MEAN, CLIP_STD)

    y, x = np.mgrid[0:111, 0:157]
    alpha = ((x * 3 + y * 5) % 256).astype(np.uint8)
    grey = np.array(src.convert("L"))
    pal = src.quantize(colors=50)
    others = {
        "image_land_rgba.png": Image.fromarray(np.dstack([land, alpha]), "RGBA"),
        "image_land_la.png": Image.fromarray(np.dstack([grey, alpha]), "LA"),
        "image_land_pal.png": pal,
        "image_land_1bit.png": src.convert("1"),
    }
    for name, im in others.items():
        path = os.path.join(outdir, name)
        if name.endswith("pal.png"):
            im.save(path, transparency=3)
        else:
            im.save(path)
        t[f"{name}|decode"] = rgb_of(path)
    path = os.path.join(outdir, "image_land_lossless.webp")
    src.save(path, "WEBP", lossless=True)
    t["image_land_lossless.webp|decode"] = rgb_of(path)
    # ColorJitter's adjustments as torchvision applies them to a PIL image (ImageEnhance
    # Brightness, Contrast, Color), factors in hundredths, in the order of the key's digits
    from PIL import ImageEnhance
    enh = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
    for f, order in (((120, 80, 35), (2, 0, 1)), ((60, 140, 130), (0, 1, 2)), ((137, 61, 0), (1, 2, 0)),
                     ((0, 0, 100), (0, 1, 2))):
        im = Image.fromarray(land)
        for k in order:
            im = enh[k](im).enhance(f[k] / 100.0)
        t[f"image_land.png|jitter{f[0]}_{f[1]}_{f[2]}_{order[0]}{order[1]}{order[2]}"] = np.array(im)
    save(os.path.join(outdir, "image_ref.safetensors"), t,
         {"generator": "tests/ref/gen_image.py", "pil": Image.__version__})
