"""speed.py: vlmoe against PyTorch on the same training step (issue: CPU speed), one table.

For each thread count and model it alternates the two programs (build/rel/bench/bench_step and
bench/torch_step.py) for several rounds, so bursts of machine noise hit both, and reports the
median step time over all rounds with the spread (min-max of the per-round medians). Matrix
products are counted analytically (bench_step) and compared with the SGEMM rate of OpenBLAS and
of oneDNN on this machine at the model's shapes (bench_sgemm). Each side gets its best
settings: both wait passively at OpenMP barriers (OMP_WAIT_POLICY=PASSIVE, what the vlmoe
command sets for itself; spinning threads collapse under any background load), and PyTorch's
OpenBLAS pool is limited to the same thread count (else it spins a second pool against OpenMP's).

Usage: /usr/bin/python3 bench/speed.py [--rounds 3] [--steps 5] [--threads 2,1] [--b16]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd, threads, torch):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    if torch:
        env.update(OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(model, threads, batch, rounds, steps, bindir):
    """Alternating rounds of vlmoe and PyTorch; returns {impl: summary}."""
    common = [model, "--batch", str(batch), "--steps", str(steps), "--warmup", "2", "--threads", str(threads)]
    cmds = {"vlmoe": [os.path.join(bindir, "bench_step")] + common,
            "torch": ["/usr/bin/python3", os.path.join(HERE, "torch_step.py")] + common}
    res = {k: [] for k in cmds}
    for r in range(rounds):
        for impl in (("vlmoe", "torch") if r % 2 == 0 else ("torch", "vlmoe")):
            res[impl].append(run(cmds[impl], threads, impl == "torch"))
            print(f"  {os.path.basename(model)} {threads}t round {r + 1} {impl}: {res[impl][-1]['step_s']:.3f} s/step",
                  file=sys.stderr, flush=True)
    out = {}
    for impl, rs in res.items():
        meds = [x["step_s"] for x in rs]
        out[impl] = {"step_s": statistics.median(meds), "lo": min(meds), "hi": max(meds),
                     "rss": max(x["peak_rss_mb"] for x in rs),
                     "img": statistics.median(x["image_per_s"] for x in rs),
                     "txt": statistics.median(x["text_per_s"] for x in rs),
                     "gflop": rs[0].get("gflop")}
    out["torch"]["gflop"] = out["vlmoe"]["gflop"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--b16", action="store_true", help="also the B/16-sized model at batch 8")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "rel", "bench"))
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    models = [("bench-s", 64), ("bench-s-dense", 64)] + ([("bench-b16", 8)] if a.b16 else [])
    rows, all_res = [], {}
    for t in [int(x) for x in a.threads.split(",")]:
        peak = run([os.path.join(a.bin, "bench_sgemm"), "5120", "256", "1024", str(t), "5"], t, False)
        for name, batch in models:
            res = measure(os.path.join(HERE, "models", name + ".json"), t, batch, a.rounds, a.steps, a.bin)
            all_res[f"{name}/{t}"] = {"peak": peak, **res}
            rows.append((name, t, batch, peak, res))
    print(f"\nSGEMM peak at bench-s shapes: OpenBLAS ({rows[0][3]['openblas_core']} kernels) "
          + ", ".join(f"{r[3]['openblas_gflops']:.0f} GFLOP/s at {r[1]}t" for r in rows if r[0] == "bench-s")
          + "; oneDNN " + ", ".join(f"{r[3]['onednn_gflops']:.0f} at {r[1]}t" for r in rows if r[0] == "bench-s"))
    hdr = (f"{'model':14} {'thr':>3} {'vlmoe s/step':>17} {'torch s/step':>17} {'speedup':>7} {'GFLOP/s':>7} "
           f"{'%OpenBLAS':>9} {'%oneDNN':>7} {'RSS MB v/t':>11} {'img/s v/t':>11} {'txt/s v/t':>11}")
    print(hdr)
    print("-" * len(hdr))
    for name, t, batch, peak, res in rows:
        v, p = res["vlmoe"], res["torch"]
        gfs = v["gflop"] / v["step_s"]
        print(f"{name:14} {t:>3} {v['step_s']:7.3f} ({v['lo']:.2f}-{v['hi']:.2f}) {p['step_s']:7.3f} "
              f"({p['lo']:.2f}-{p['hi']:.2f}) {p['step_s'] / v['step_s']:6.2f}x {gfs:7.1f} "
              f"{100 * gfs / peak['openblas_gflops']:8.0f}% {100 * gfs / peak['onednn_gflops']:6.0f}% "
              f"{v['rss']:5.0f}/{p['rss']:<5.0f} {v['img']:5.0f}/{p['img']:<5.0f} {v['txt']:5.0f}/{p['txt']:<5.0f}")
    for t in sorted({r[1] for r in rows}, reverse=True):
        by = {r[0]: r[4] for r in rows if r[1] == t}
        if "bench-s" in by and "bench-s-dense" in by:
            print(f"MoE/dense step time at {t}t (equal active FLOPs): vlmoe "
                  f"{by['bench-s']['vlmoe']['step_s'] / by['bench-s-dense']['vlmoe']['step_s']:.3f}, torch "
                  f"{by['bench-s']['torch']['step_s'] / by['bench-s-dense']['torch']['step_s']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(all_res, f, indent=1)


if __name__ == "__main__":
    main()
