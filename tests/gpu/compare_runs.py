#!/usr/bin/env python3
"""compare_runs.py A B [--tol T]: two `vlmoe train` runs of the same flags on different devices or
precisions (tests/gpu/parity.sh). Prints the largest per-step loss difference (metrics.jsonl, train
records) and the largest parameter difference in the newest checkpoint, absolute and relative to the
tensor's largest magnitude; exits 1 when either is over the tolerance. numpy only: the safetensors
header is read by hand."""
import json
import os
import struct
import sys

import numpy as np


def losses(run):
    out = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train":
                out[r["step"]] = r["loss"]
    return out


def tensors(run):
    ck = os.path.join(run, "checkpoints")
    steps = [int(n[5:-12]) for n in os.listdir(ck) if n.startswith("step_") and n.endswith(".safetensors")
             and not n.endswith(".state.safetensors")]
    path = os.path.join(ck, "step_%d.safetensors" % max(steps))
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in head.items():
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(t["shape"])
    return path, out


def main():
    a, b = sys.argv[1], sys.argv[2]
    tol = float(sys.argv[sys.argv.index("--tol") + 1]) if "--tol" in sys.argv else 1e-5
    la, lb = losses(a), losses(b)
    if not la or set(la) != set(lb):
        print("FAIL %s vs %s: logged steps differ: %s / %s" % (a, b, sorted(la), sorted(lb)))
        return 1
    dl = max(abs(la[s] - lb[s]) for s in la)
    pa, ta = tensors(a)
    pb, tb = tensors(b)
    if set(ta) != set(tb):
        print("FAIL %s vs %s: parameter names differ" % (pa, pb))
        return 1
    worst, wname, wrel = 0.0, "", 0.0
    for k in ta:
        d = float(np.max(np.abs(ta[k].astype(np.float64) - tb[k]))) if ta[k].size else 0.0
        if d > worst:
            worst, wname = d, k
            wrel = d / max(float(np.max(np.abs(ta[k]))), 1e-30)
    ok = dl <= tol and worst <= tol
    print("%s %s vs %s: %d steps, max |loss diff| %.3g (losses %s); %d tensors, max |param diff| %.3g in %s "
          "(%.3g of its largest magnitude); tolerance %g" %
          ("ok  " if ok else "FAIL", os.path.basename(a), os.path.basename(b), len(la), dl,
           " ".join("%.6f" % la[s] for s in sorted(la)), len(ta), worst, wname, wrel, tol))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
