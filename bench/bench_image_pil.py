"""bench_image_pil.py: PIL's rate for the same eval input pipeline as bench/bench_image.c (MODEL.md
"Data"), on the same files: Image.open + convert("RGB"), resize shorter side to 224 (BICUBIC, the
size torchvision's Resize computes), center crop (torchvision's offsets), to a float32 (3, 224, 224)
array normalised with CLIP's mean / std (what ToTensor + Normalize compute), with 1 and 2 threads
(a thread pool: PIL releases the GIL while decoding and resampling).
Usage: python3 bench/bench_image_pil.py DIR [rounds]   (bench_image runs it)."""
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

S = 224
BICUBIC = getattr(Image, "Resampling", Image).BICUBIC
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32).reshape(3, 1, 1)
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32).reshape(3, 1, 1)


def preprocess(path):
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        size = (S, int(S * h / w)) if w <= h else (int(S * w / h), S)
        im = im.resize(size, BICUBIC)
        top, left = int(round((size[1] - S) / 2.0)), int(round((size[0] - S) / 2.0))
        im = im.crop((left, top, left + S, top + S))
        a = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)
        return (a - MEAN) / STD


def rate(paths, threads, rounds):
    """Median images/s of wall time and per second of process CPU time (all threads)."""
    wall, cpu = [], []
    with ThreadPoolExecutor(threads) as pool:
        for k in range(rounds + 1):   # the first pass warms up
            t0, c0 = time.perf_counter(), time.process_time()
            if threads == 1:
                for p in paths:
                    preprocess(p)
            else:
                list(pool.map(preprocess, paths))
            if k:
                wall.append(len(paths) / (time.perf_counter() - t0))
                cpu.append(len(paths) / (time.process_time() - c0))
    return statistics.median(wall), statistics.median(cpu)


def main():
    d = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    paths = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".jpg"))
    fmt = "  %-36s %9.1f %9.1f %14.2f"
    for threads in (1, 2):
        w, c = rate(paths, threads, rounds)
        print(fmt % (f"PIL {Image.__version__} same pipeline, {threads} thr.", w, c, 1e3 / c))

if __name__ == "__main__":
    main()
