#!/usr/bin/env python3
"""compare_runs.py A B [--tol T | --relative-to C D [--factor F] | --info] [--table FILE]: two `vlmoe train`
runs of the same flags on different devices or precisions (tests/gpu/parity.sh). Prints the largest
per-step loss difference (metrics.jsonl, train records) and the largest parameter difference in the
newest checkpoint, absolute and relative to the tensor's largest magnitude; exits 1 when either is over
the tolerance: T (default 1e-5), or F (default 2) times the same differences between runs C and D (and
then also when either is under a quarter of those: A must differ from B as C does from D), or never
with --info. --table appends a tab-separated row (model, pair, loss, params, tolerance, result).
numpy only: the safetensors header is read by hand."""
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


def diffs(a, b):
    """(max |loss diff|, losses of a, max |param diff|, its tensor, relative to its magnitude, #tensors), or a
    string saying why the runs cannot be compared."""
    la, lb = losses(a), losses(b)
    if not la or set(la) != set(lb):
        return "logged steps differ: %s / %s" % (sorted(la), sorted(lb))
    dl = max(abs(la[s] - lb[s]) for s in la)
    pa, ta = tensors(a)
    pb, tb = tensors(b)
    if set(ta) != set(tb):
        return "parameter names differ in %s and %s" % (pa, pb)
    worst, wname, wrel = 0.0, "", 0.0
    for k in ta:
        d = float(np.max(np.abs(ta[k].astype(np.float64) - tb[k]))) if ta[k].size else 0.0
        if d > worst:
            worst, wname = d, k
            wrel = d / max(float(np.max(np.abs(ta[k]))), 1e-30)
    return dl, [la[s] for s in sorted(la)], worst, wname, wrel, len(ta)


def arg(name, n=1):
    if name not in sys.argv:
        return None
    i = sys.argv.index(name)
    return sys.argv[i + 1:i + 1 + n]


def main():
    a, b = sys.argv[1], sys.argv[2]
    tol = float(arg("--tol")[0]) if arg("--tol") else 1e-5
    tol_loss = tol_param = tol
    how = "tolerance %g" % tol
    d = diffs(a, b)
    if isinstance(d, str):
        print("FAIL %s vs %s: %s" % (a, b, d))
        return 1
    dl, ls, worst, wname, wrel, nt = d
    rel = arg("--relative-to", 2)
    if rel:
        # the gate is a multiple of what another pair of runs of the same model moves (parity.sh: the CPU's
        # own bf16 against fp32): the bf16 difference a correct implementation is expected to show
        factor = float(arg("--factor")[0]) if arg("--factor") else 2.0
        r = diffs(rel[0], rel[1])
        if isinstance(r, str):
            print("FAIL %s vs %s: the reference pair: %s" % (a, b, r))
            return 1
        if r[0] == 0 and r[2] == 0:
            print("FAIL %s vs %s: the reference pair %s vs %s does not differ at all (did the CPU fall back to "
                  "fp32?)" % (a, b, os.path.basename(rel[0]), os.path.basename(rel[1])))
            return 1
        tol_loss, tol_param = factor * r[0], factor * r[2]
        how = "tolerance %g x (%s vs %s) = loss %.3g, params %.3g" % (
            factor, os.path.basename(rel[0]), os.path.basename(rel[1]), tol_loss, tol_param)
        # and at least a quarter of that pair's move: A took the path under test at all (a bf16 run that
        # silently computed in fp32 would sit at 0)
        if dl < r[0] / 4 or worst < r[2] / 4:
            print("FAIL %s vs %s: moved less than a quarter of what %s vs %s moves (loss %.3g of %.3g, params "
                  "%.3g of %.3g): did it run in fp32?" % (os.path.basename(a), os.path.basename(b),
                                                         os.path.basename(rel[0]), os.path.basename(rel[1]), dl,
                                                         r[0], worst, r[2]))
            tol_loss = tol_param = -1.0
    ok = dl <= tol_loss and worst <= tol_param
    if arg("--info"):
        ok, how = True, "not gated"
    print("%s %s vs %s: %d steps, max |loss diff| %.3g (losses %s); %d tensors, max |param diff| %.3g in %s "
          "(%.3g of its largest magnitude); %s" %
          ("ok  " if ok else "FAIL", os.path.basename(a), os.path.basename(b), len(ls), dl,
           " ".join("%.6f" % v for v in ls), nt, worst, wname, wrel, how))
    table = arg("--table")
    if table:
        with open(table[0], "a") as f:
            f.write("%s\t%s vs %s\t%.3g\t%.3g\t%s\t%s\n" % (
                os.path.basename(a).rsplit("-", 1)[0], os.path.basename(a).rsplit("-", 1)[1],
                os.path.basename(b).rsplit("-", 1)[1], dl, worst,
                "-" if arg("--info") else "%.3g / %.3g" % (tol_loss, tol_param), "ok" if ok and not arg("--info")
                else "info" if arg("--info") else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
