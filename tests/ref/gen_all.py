"""gen_all.py: runs every fixture generator tests/ref/gen_*.py (each defines generate(outdir))
and writes their safetensors fixtures into the folder given as argv[1]. Run by `make test`
with Debian's /usr/bin/python3 (python3-torch, python3-numpy)."""
import importlib.util
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.set_num_threads(1)
for fn in sorted(os.listdir(here)):
    if fn.startswith("gen_") and fn.endswith(".py") and fn != "gen_all.py":
        spec = importlib.util.spec_from_file_location(fn[:-3], os.path.join(here, fn))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.generate(out)
        print(f"fixtures: {fn} done")
