"""speed.py: vlmoe against PyTorch on the same training step (issue 22), one table.

For each thread count and model it alternates vlmoe (build/rel/bench/bench_step) in fp32 and
bf16 with PyTorch (bench/torch_step.py) in fp32 and under bf16 autocast, for several rounds
(the order rotates each round), so bursts of machine noise hit every program, and reports the
median step time over the rounds with the spread (min-max of the per-round medians). Matrix
products are counted analytically (bench_step) and compared with the machine's own peak,
measured by bench_peak (a register-only loop of FMAs on the widest registers the CPU has, and of
vdpbf16ps for bf16), and with the SGEMM rates of OpenBLAS, oneDNN and, on AVX2 CPUs, vlmoe's own
product at the model's shapes, and of OpenBLAS and oneDNN on one 2048^3 product, their best case
(bench_sgemm). A second table says what the two fp32 targets (75% of the FMA peak, 1.5x PyTorch's
fp32 step) leave for the rest of the step once the products take their time at the fastest of
those libraries' rates on the model's shapes (fp32_reach): below 0, no step whose products run
at that rate can meet the target. The inference table is followed by the int8 products'
rates at an encoder MLP's shapes (bench_int8): the AVX2 kernel step's register-only rate,
oneDNN's u8s8s32 gemm and vlmoe's int8 linear and MLP.

Each side gets its best settings. PyTorch runs without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
(some machines set them for old OpenBLAS builds: CORETYPE=Haswell forces AVX2 kernels on an
AVX-512 CPU); they are removed for its command only, never for tests. Both wait passively at
OpenMP barriers (OMP_WAIT_POLICY=PASSIVE, what the vlmoe command sets for itself; spinning
threads collapse under any background load), and PyTorch's OpenBLAS pool is limited to the same
thread count (else it spins a second pool against OpenMP's). Before the timings it prints which
kernels each side runs: OpenBLAS's core (openblas_get_corename), oneDNN's ISA, and the oneDNN
implementations of every matrix product of one step (ONEDNN_VERBOSE=1).

Inference (issue 22: embed/classify at >= 3x PyTorch's fp32 throughput): a second table times
embedding alone at the same batch, images and texts one modality per call, vlmoe in fp32, bf16,
int8 and int8-attn (bench_step --embed) against PyTorch in fp32 and on a bf16 copy of the model,
both under torch.inference_mode (torch_step.py --embed), alternating in a rotating order; each
cell is the median over rounds of each run's median of --embed-reps encodes, with the range of
the run medians. --base-bin DIR adds another build's bench_step (say main's) to the same
rotation, so a change is measured against its base under the same load.

--python (or PYTHON in the environment) names the interpreter that runs PyTorch (default
/usr/bin/python3, Debian's); a newer PyTorch may be faster (its wheels run fp32 products in
oneMKL), so give the reference the fastest one installed.

Usage: /usr/bin/python3 bench/speed.py [--python PY] [--rounds 5] [--steps 5] [--threads 2,1]
[--models bench-s,bench-s-dense] [--b16] [--json FILE] [--embed-only | --no-embed] [--embed-reps 7] [--base-bin DIR]
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_has_bf16():
    """AVX512_BF16 or AMX: the CPUs whose bf16 products run natively. Elsewhere vlmoe's
    --precision bf16 falls back to fp32 (one-line notice) and PyTorch's CPU autocast emulates
    bf16, one thread at a fraction of its fp32 speed (over 4 minutes a bench-s step on a Zen 3):
    the bf16 programs are left out and their cells read nan."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


BF16 = cpu_has_bf16()
IMPLS = ("vlmoe", "vlmoe-bf16", "torch", "torch-bf16") if BF16 else ("vlmoe", "torch")
NA = {k: float("nan") for k in ("step_s", "lo", "hi", "rss", "img", "txt", "gflop")}
UNSET_FOR_TORCH = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
TORCH_PY = os.environ.get("PYTHON", "/usr/bin/python3")  # the interpreter that has PyTorch


def env_for(threads, torch, verbose=False):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    if torch:
        env.update(OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        for k in UNSET_FOR_TORCH:
            env.pop(k, None)
    if verbose:
        env.update(ONEDNN_VERBOSE="1", DNNL_VERBOSE="1", MKL_VERBOSE="1")
    return env


def run(cmd, threads, torch, verbose=False):
    p = subprocess.run(cmd, env=env_for(threads, torch, verbose), check=True, capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def commands(model, threads, batch, steps, bindir):
    common = [model, "--batch", str(batch), "--steps", str(steps), "--warmup", "2", "--threads", str(threads)]
    v = [os.path.join(bindir, "bench_step")] + common
    t = [TORCH_PY, os.path.join(HERE, "torch_step.py")] + common
    cmds = {"vlmoe": v, "vlmoe-bf16": v + ["--precision", "bf16"],
            "torch": t, "torch-bf16": t + ["--precision", "bf16"]}
    return {k: c for k, c in cmds.items() if k in IMPLS}


def kernels(model, threads, batch, bindir):
    """One step of each program with oneDNN's verbose log: {impl: {"kind:implementation": count}}."""
    out = {}
    for impl, cmd in commands(model, threads, batch, 1, bindir).items():
        cmd = [c if c != "2" or cmd[i - 1] != "--warmup" else "0" for i, c in enumerate(cmd)]
        js, lines = run(cmd, threads, impl.startswith("torch"), verbose=True)
        onednn, mkl, mkl_isa = verbose_counts(lines)
        out[impl] = {"onednn": onednn, "mkl": mkl, "mkl_isa": mkl_isa, "openblas_core": js.get("openblas_core"),
                     "torch_blas": js.get("torch_blas"), "matmul": js.get("matmul"), "fp32_gemm": js.get("fp32_gemm")}
    return out


def verbose_counts(lines):
    """The products in a run's verbose log: oneDNN's {"kind:implementation": count} (any release's
    layout: the engine, the primitive kind and its implementation follow the "exec" field, which
    newer releases put after a version or time field), oneMKL's {"FUNCTION": count} and the
    instruction set named by oneMKL's first line (PyTorch's wheels run their fp32 products in
    oneMKL, which oneDNN's log does not show)."""
    onednn, mkl, isa = collections.Counter(), collections.Counter(), None
    for ln in lines:
        if ln.startswith("MKL_VERBOSE"):
            w = ln.split()
            if len(w) > 1 and "(" in w[1]:
                mkl[w[1].split("(")[0]] += 1
            elif " architecture " in ln and isa is None:
                isa = ln.split(" architecture ", 1)[1].split(", Lnx")[0].strip()
            continue
        f = ln.split(",")
        if "exec" in f[:5]:
            i = f.index("exec")
            if len(f) > i + 3 and f[i + 2] in ("matmul", "inner_product", "convolution"):
                onednn[f"{f[i + 2]}:{f[i + 3]}"] += 1
    return dict(onednn), dict(mkl), isa


def measure(model, threads, batch, rounds, steps, bindir):
    """Alternating rounds of the four programs; returns {impl: summary}."""
    cmds = commands(model, threads, batch, steps, bindir)
    res = {k: [] for k in cmds}
    for r in range(rounds):
        order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
        for impl in order:
            res[impl].append(run(cmds[impl], threads, impl.startswith("torch"))[0])
            print(f"  {os.path.basename(model)} {threads}t round {r + 1} {impl}: {res[impl][-1]['step_s']:.3f} s/step",
                  file=sys.stderr, flush=True)
    out = {}
    for impl, rs in res.items():
        meds = [x["step_s"] for x in rs]
        out[impl] = {"step_s": statistics.median(meds), "lo": min(meds), "hi": max(meds),
                     "rss": max(x["peak_rss_mb"] for x in rs),
                     "img": statistics.median(x["image_per_s"] for x in rs),
                     "txt": statistics.median(x["text_per_s"] for x in rs),
                     "gflop": rs[0].get("gflop"), "loss": rs[0].get("loss")}
    for impl in out:
        out[impl]["gflop"] = out["vlmoe"]["gflop"]
    return out


EMBED_IMPLS = ("vlmoe", "vlmoe-bf16", "vlmoe-int8", "vlmoe-int8-attn", "torch", "torch-bf16")


def embed_commands(model, threads, batch, reps, bindir, base_bin):
    common = [model, "--batch", str(batch), "--threads", str(threads), "--embed", str(reps)]
    cmds = {}
    for name, d in (("vlmoe", bindir), ("base", base_bin)):
        if not d:
            continue
        v = [os.path.join(d, "bench_step")] + common
        cmds.update({name: v, name + "-bf16": v + ["--precision", "bf16"], name + "-int8": v + ["--precision", "int8"],
                     name + "-int8-attn": v + ["--precision", "int8-attn"]})
    t = [TORCH_PY, os.path.join(HERE, "torch_step.py")] + common
    cmds.update({"torch": t, "torch-bf16": t + ["--precision", "bf16"]})
    return {k: c for k, c in cmds.items() if BF16 or not k.endswith("-bf16")}


def measure_embed(model, threads, batch, rounds, reps, bindir, base_bin, programs=None):
    """Alternating rounds of inference alone; returns {impl: {"img": .., "img_lo": .., ...}}."""
    cmds = embed_commands(model, threads, batch, reps, bindir, base_bin)
    if programs:
        cmds = {k: v for k, v in cmds.items() if k in programs.split(",")}
    names = list(cmds)
    if not names:
        sys.exit(f"speed.py: none of --programs {programs} runs on this CPU (bf16 programs need AVX512_BF16 or AMX)")
    res = {k: [] for k in names}
    for r in range(rounds):
        for impl in names[r % len(names):] + names[:r % len(names)]:
            try:
                res[impl].append(run(cmds[impl], threads, impl.startswith("torch"))[0])
            except subprocess.CalledProcessError as e:  # an old base binary without int8-attn
                print(f"  {impl}: failed ({e.stderr.strip()[-200:]})", file=sys.stderr)
                continue
            print(f"  {os.path.basename(model)} {threads}t embed round {r + 1} {impl}: "
                  f"{res[impl][-1]['image_per_s']:.0f} img/s {res[impl][-1]['text_per_s']:.0f} txt/s",
                  file=sys.stderr, flush=True)
    out = {}
    for impl, rs in res.items():
        if rs:
            img, txt = [x["image_per_s"] for x in rs], [x["text_per_s"] for x in rs]
            out[impl] = {"img": statistics.median(img), "img_lo": min(img), "img_hi": max(img),
                         "txt": statistics.median(txt), "txt_lo": min(txt), "txt_hi": max(txt),
                         "precision": rs[0].get("precision"), "matmul": rs[0].get("matmul")}
    return out


def loadavg():
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def print_embed(rows, rounds, reps, loads, int8_rates=()):
    print(f"\nload average (1, 5, 15 min) before the inference runs {loads[0]}, after {loads[1]}")
    print(f"\nembedding alone (bench_step --embed / torch_step.py --embed, inference_mode), batch 64: medians over "
          f"{rounds} alternating rounds of each run's median of {reps} encodes (range of the run medians); "
          f"x: against PyTorch fp32")
    hdr = f"{'model':13} {'thr':>3} {'program':16} {'precision':10} {'img/s':>22} {'x':>6} {'txt/s':>24} {'x':>6}"
    print(hdr)
    print("-" * len(hdr))
    for name, t, res in rows:
        ref = res.get("torch")
        for impl, v in res.items():
            xi = f"{v['img'] / ref['img']:5.2f}x" if ref else "     -"
            xt = f"{v['txt'] / ref['txt']:5.2f}x" if ref else "     -"
            print(f"{name:13} {t:>3} {impl:16} {v['precision'] or '':10} {v['img']:7.0f} ({v['img_lo']:.0f}-{v['img_hi']:.0f}) "
                  f"{xi} {v['txt']:8.0f} ({v['txt_lo']:.0f}-{v['txt_hi']:.0f}) {xt}")
    for t, r in int8_rates:
        if "skipped" in r:
            print(f"int8 products at {t} thread(s): {r['skipped']}")
        else:
            print(f"int8 products at {t} thread(s), {r['tokens']} x {r['width']} x {r['mlp']} ({r['path']}; bench_int8, "
                  f"medians of {r['reps']}): the AVX2 kernel step's register-only rate {r['peak_gops']:.0f} GOP/s, "
                  f"oneDNN's u8s8s32 gemm {r['onednn_gops']:.0f}, vlmoe's int8 linear {r['vlmoe_gops']:.0f} "
                  f"(quantizing included), its int8 MLP {r['vlmoe_mlp_gops']:.0f}")


# bench_sgemm's rates at the model's shapes, by JSON key, and the product each names
SGEMM_RATES = (("openblas_gflops", "OpenBLAS"), ("onednn_gflops", "oneDNN"),
               ("vlmoe_avx2_gflops", "vlmoe's AVX2 product"))


def sgemm_rates(bindir, threads):
    """bench_sgemm's JSON at bench-s's shapes (5120 tokens, width 256, MLP 1024), 5 repetitions."""
    return run([os.path.join(bindir, "bench_sgemm"), "5120", "256", "1024", str(threads), "5"], threads, False)[0]


def own_rate(sg):
    """", vlmoe's AVX2 product N" where bench_sgemm measured it (CPUs with AVX2), else ""."""
    return f", vlmoe's AVX2 product {sg['vlmoe_avx2_gflops']:.0f}" if sg.get("vlmoe_avx2_gflops") else ""


def keep_higher(dst, src, keys):
    """dst[k] = the higher of dst's and src's k (0 where neither has it): two readings of a rate
    that the host's speed moves within minutes."""
    for k in keys:
        dst[k] = max(dst.get(k) or 0, src.get(k) or 0)


def fp32_reach(gflop, peak, sg, torch_s, share=0.75, ratio=1.5):
    """What issue 22's two fp32 targets leave for the rest of a step once its products take the
    time they take at the fastest rate a library reached on the model's shapes alone (sg, from
    bench_sgemm: one call of each block's products, caches warm, so an optimistic time for them):
    {"library", "gflops", "products_s", "peak_step_s" (a step at share of the FMA peak, peak
    GFLOP/s), "peak_left_s", "torch_step_s" (a step ratio times faster than PyTorch's torch_s),
    "torch_left_s"}. A left below 0 means no step whose products run at that rate meets the
    target, whatever the rest (attention, LayerNorm, routing, AdamW) costs. None without a rate."""
    rate, lib = max((sg.get(k) or 0, name) for k, name in SGEMM_RATES)
    if not rate > 0 or not gflop > 0:
        return None
    prod, at_peak, at_torch = gflop / rate, gflop / (share * peak) if peak > 0 else float("nan"), torch_s / ratio
    return {"library": lib, "gflops": rate, "products_s": prod, "peak_step_s": at_peak, "peak_left_s": at_peak - prod,
            "torch_step_s": at_torch, "torch_left_s": at_torch - prod}


def print_reach(rows, all_res):
    """One line a row of the training table: fp32_reach against its peak, its SGEMM rates (all_res's
    "MODEL/THREADS" entry, where the result goes too, as "reach") and PyTorch's fp32 step."""
    print("\nfp32 targets (75% of the FMA peak, 1.5x PyTorch's fp32) against the products alone at the fastest "
          "library's rate on the model's shapes (bench_sgemm, the higher of its runs before and after the rounds: "
          "caches warm, one call a block); \"left\": the time they leave for the rest of the step, below 0 out of "
          "reach of that library whatever the rest costs")
    hdr = (f"{'model':13} {'thr':>3} {'products at':31} {'alone s':>7} {'75%-peak step':>13} {'left s':>7} "
           f"{'1.5x-torch step':>15} {'left s':>7} {'vlmoe step':>10}")
    print(hdr)
    print("-" * len(hdr))
    for name, t, batch, peak, res in rows:
        r = fp32_reach(res["vlmoe"]["gflop"], peak["fp32_fma_gflops"], all_res[f"{name}/{t}"]["sgemm"],
                       res["torch"]["step_s"])
        if r is None:
            print(f"{name:13} {t:>3} no SGEMM rate measured")
            continue
        all_res[f"{name}/{t}"]["reach"] = r
        print(f"{name:13} {t:>3} {r['gflops']:5.0f} GF/s {r['library']:20} {r['products_s']:7.3f} "
              f"{r['peak_step_s']:13.3f} {r['peak_left_s']:7.3f} {r['torch_step_s']:15.3f} {r['torch_left_s']:7.3f} "
              f"{res['vlmoe']['step_s']:10.3f}")


def cpu_model():
    for ln in open("/proc/cpuinfo"):
        if ln.startswith("model name"):
            return ln.split(":", 1)[1].strip()
    return "unknown"


def torch_version(py):
    """(PyTorch's version as the interpreter py imports it, with the reference's environment, None),
    or (None, why it cannot: "cannot run it: ...", "cannot import torch: ...")."""
    try:
        p = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                           env=env_for(1, True))
    except OSError as e:
        return None, f"cannot run it: {e.strerror}"
    if p.returncode == 0 and p.stdout.strip():
        return p.stdout.strip(), None
    return None, "cannot import torch: " + (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]


def main():
    global TORCH_PY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--b16", action="store_true", help="also the B/16-sized model at batch 8")
    ap.add_argument("--models", default="bench-s,bench-s-dense", help="which of bench/models/*.json (batch 64)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "rel", "bench"))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--python", default=TORCH_PY, help="the interpreter that runs PyTorch (default: PYTHON from the "
                    "environment, else /usr/bin/python3); the newest PyTorch installed is usually the fastest")
    ap.add_argument("--embed-only", action="store_true", help="only the inference table")
    ap.add_argument("--no-embed", action="store_true", help="only the training table (half the run)")
    ap.add_argument("--embed-reps", type=int, default=7, help="encodes per run of the inference table")
    ap.add_argument("--base-bin", help="another build's bench dir, alternated with --bin in the inference table")
    ap.add_argument("--programs", help="only these programs of the inference table (say vlmoe-int8,base-int8,torch)")
    a = ap.parse_args()
    models = [(x, 64) for x in a.models.split(",")] + ([("bench-b16", 8)] if a.b16 else [])
    threads = [int(x) for x in a.threads.split(",")]
    TORCH_PY = a.python
    unset = [f"{k}={os.environ[k]}" for k in UNSET_FOR_TORCH if k in os.environ]
    version, why = torch_version(TORCH_PY)
    if why:  # before any run: else the first PyTorch run stops the benchmark
        ap.error(f"--python {TORCH_PY}: {why}")
    if not os.access(os.path.join(a.bin, "bench_step"), os.X_OK):
        ap.error(f"--bin {a.bin}: no bench_step program there (make bench builds it)")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; PyTorch {version} ({TORCH_PY}) runs with "
          + (("these removed: " + " ".join(unset)) if unset else "no OPENBLAS_CORETYPE/L2_SIZE set"))
    rows, all_res, erows, erows_int8 = [], {"torch_version": version, "torch_python": TORCH_PY}, [], []
    load0 = loadavg()
    if a.embed_only and a.no_embed:
        ap.error("--embed-only and --no-embed leave nothing to run")
    for t in threads if not a.no_embed else []:
        # the inference table: the first model only, unless it is all this run does
        for name, batch in (models if a.embed_only else models[:1]):
            path = os.path.join(HERE, "models", name + ".json")
            er = measure_embed(path, t, batch, a.rounds, a.embed_reps, a.bin, a.base_bin, a.programs)
            all_res[f"{name}/{t}/embed"] = er
            erows.append((name, t, er))
        # what bounds the int8 rows: the products' own rates at an encoder MLP's shapes
        i8 = run([os.path.join(a.bin, "bench_int8"), "4096", "256", "1024", str(t), "7"], t, False)[0]
        all_res[f"int8/{t}"] = i8
        erows_int8.append((t, i8))
    loads = (load0, loadavg())
    if a.embed_only:
        print_embed(erows, a.rounds, a.embed_reps, loads, erows_int8)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(all_res, f, indent=1)
        return
    for t in threads:
        peak = run([os.path.join(a.bin, "bench_peak"), str(t), "5"], t, False)[0]
        sg = sgemm_rates(a.bin, t)
        amx = f", AMX tdpbf16ps {peak['amx_bf16_gflops']:.0f}, tdpbssd {peak['amx_int8_gops']:.0f} GOP/s" \
            if peak.get("amx_bf16_gflops") else ""
        print(f"{t} thread(s): fp32 FMA peak ({peak.get('fp32_fma_isa', 'avx512f')}) {peak['fp32_fma_gflops']:.0f} GFLOP/s, "
              f"bf16 vdpbf16ps peak {peak['bf16_dot_gflops']:.0f}{amx}; SGEMM at bench-s shapes: OpenBLAS "
              f"({sg['openblas_core']}) {sg['openblas_gflops']:.0f}, oneDNN ({sg['onednn_isa']}) "
              f"{sg['onednn_gflops']:.0f}{own_rate(sg)}; at 2048^3, the libraries' best case: OpenBLAS "
              f"{sg['openblas_square_gflops']:.0f}, oneDNN {sg['onednn_square_gflops']:.0f} ("
              f"{100 * max(sg['openblas_square_gflops'], sg['onednn_square_gflops']) / peak['fp32_fma_gflops']:.0f}% "
              f"of the peak)")
        for name, batch in models:
            path = os.path.join(HERE, "models", name + ".json")
            if t == threads[0]:
                k = kernels(path, t, batch, a.bin)
                all_res[f"{name}/kernels"] = k
                for impl, v in k.items():
                    desc = ", ".join(f"{n}x {x}" for x, n in sorted(v["onednn"].items(), key=lambda z: -z[1]))
                    mkl = ", ".join(f"{n}x {x}" for x, n in sorted(v["mkl"].items(), key=lambda z: -z[1]))
                    if v["openblas_core"]:
                        blas = f"OpenBLAS core {v['openblas_core']}"
                    elif v.get("matmul"):
                        blas = f"backend {v['matmul']}" + ("" if v["matmul"] != "cpu" else
                                                           f": fp32 products {v['fp32_gemm']} (oneDNN ISA "
                                                           f"{sg['onednn_isa']}; dnnl_sgemm has no verbose log)")
                    else:
                        blas = f"PyTorch's BLAS {v.get('torch_blas')}"
                    if mkl:
                        blas += f"; oneMKL {mkl} ({v['mkl_isa'] or 'no ISA line'})"
                    print(f"  {name} {impl:10} kernels: {blas}{'; oneDNN ' + desc if desc else ''}")
            res = measure(path, t, batch, a.rounds, a.steps, a.bin)
            all_res[f"{name}/{t}"] = {"peak": peak, "sgemm": sg, **res}
            rows.append((name, t, batch, peak, res))
        # the peak again after the rounds, and the higher of the two kept (the rows hold this
        # dict): on a virtual machine a vCPU taken away for a second reads as half the 2-thread
        # peak (97 GFLOP/s against 186 once on a Zen 3, below the step's own product rate)
        again = run([os.path.join(a.bin, "bench_peak"), str(t), "5"], t, False)[0]
        amx = f", AMX {again['amx_bf16_gflops']:.0f}" if again.get("amx_bf16_gflops") else ""
        print(f"{t} thread(s): fp32 FMA peak again after the rounds {again['fp32_fma_gflops']:.0f} GFLOP/s, bf16 "
              f"{again['bf16_dot_gflops']:.0f}{amx} (the table uses the higher)")
        keep_higher(peak, again, ("fp32_fma_gflops", "bf16_dot_gflops", "amx_bf16_gflops", "amx_int8_gops"))
        # and the SGEMM rates, the higher kept for the fp32 targets' table: what is out of reach
        # there is out of reach at the libraries' better moment
        sg2 = sgemm_rates(a.bin, t)
        print(f"{t} thread(s): SGEMM at bench-s shapes again after the rounds: OpenBLAS {sg2['openblas_gflops']:.0f}, "
              f"oneDNN {sg2['onednn_gflops']:.0f}{own_rate(sg2)} (the fp32 targets' table uses the higher)")
        keep_higher(sg, sg2, [k for k, _ in SGEMM_RATES])
    # without bf16 products (no AVX512_BF16 or AMX) the bf16 columns would hold only nan: left out
    bf = lambda txt: txt if BF16 else ""  # noqa: E731
    hdr = (f"{'model':13} {'thr':>3} {'vlmoe fp32':>17} " + bf(f"{'vlmoe bf16':>17} ") + f"{'torch fp32':>17} "
           + bf(f"{'torch bf16':>17} ") + f"{'v/t fp32':>8} " + bf(f"{'vbf/tbf':>7} {'vbf/t32':>7} ")
           + f"{'fp32 GF/s':>9} {'%peak':>5} " + bf(f"{'bf16 GF/s':>9} {'%peak':>5} ")
           + f"{'RSS MB v/t':>11} {'img/s v/t':>11} {'txt/s v/t':>11}")
    print(f"\nbench/speed.py: {cpu_model()}, medians over {a.rounds} alternating rounds of {a.steps} steps "
          f"(range of the round medians); matrix-product FLOP/s against the measured FMA / "
          f"{'AMX tdpbf16ps' if any(r[3].get('amx_bf16_gflops') for r in rows) else 'vdpbf16ps'} peak")
    print(hdr)
    print("-" * len(hdr))
    for name, t, batch, peak, res in rows:
        v, vb, p, pb = res["vlmoe"], res.get("vlmoe-bf16", NA), res["torch"], res.get("torch-bf16", NA)
        g32, g16 = v["gflop"] / v["step_s"], vb["gflop"] / vb["step_s"]
        # bf16 products run on AMX's tiles where the CPU has them (oneDNN's brgemm picks them), so
        # that is their peak there; vdpbf16ps's elsewhere
        pk32 = peak["fp32_fma_gflops"] or float("nan")
        pk16 = peak.get("amx_bf16_gflops") or peak["bf16_dot_gflops"] or float("nan")
        cell = lambda x: f"{x['step_s']:6.3f} ({x['lo']:.2f}-{x['hi']:.2f})"  # noqa: E731
        print(f"{name:13} {t:>3} {cell(v)} " + bf(f"{cell(vb)} ") + f"{cell(p)} " + bf(f"{cell(pb)} ")
              + f"{p['step_s'] / v['step_s']:7.2f}x "
              + bf(f"{pb['step_s'] / vb['step_s']:6.2f}x {p['step_s'] / vb['step_s']:6.2f}x ")
              + f"{g32:9.1f} {100 * g32 / pk32:4.0f}% " + bf(f"{g16:9.1f} {100 * g16 / pk16:4.0f}% ")
              + f"{v['rss']:5.0f}/{p['rss']:<5.0f} {v['img']:5.0f}/{p['img']:<5.0f} {v['txt']:5.0f}/{p['txt']:<5.0f}")
    if not BF16:
        print("(img/s and txt/s: embedding at the same batch, fp32 for both; bf16: not run, this CPU has neither "
              "AVX512_BF16 nor AMX)")
    else:
        print("(img/s and txt/s: embedding at the same batch, fp32 for both; bf16: "
              + ", ".join(f"{r[0]} {r[1]}t vlmoe {r[4]['vlmoe-bf16']['img']:.0f}/{r[4]['vlmoe-bf16']['txt']:.0f} "
                          f"torch {r[4]['torch-bf16']['img']:.0f}/{r[4]['torch-bf16']['txt']:.0f}" for r in rows) + ")")
        print("(peak RSS MB in bf16, vlmoe/torch: "
              + ", ".join(f"{r[0]} {r[1]}t {r[4]['vlmoe-bf16']['rss']:.0f}/{r[4]['torch-bf16']['rss']:.0f} "
                          f"({r[4]['vlmoe-bf16']['rss'] / r[4]['torch-bf16']['rss']:.2f}x)" for r in rows) + ")")
    print_reach(rows, all_res)
    if erows:
        print_embed(erows, a.rounds, a.embed_reps, loads, erows_int8)
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
