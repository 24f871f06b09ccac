"""kernel_table.py NCU_LOG [--steps N] [--top K]: the GPU time of a training step by kernel, from
the per-kernel summary that `ncu --metrics gpu__time_duration.sum --print-summary per-kernel`
prints (tests/gpu/device_checks.sh, part profile_bf16). Kernels of the same name (its launch
shapes apart) are added up; N is the number of steps the profiled run made (warm-up included),
so the table reads per step. The times are ncu's: it serialises the kernels and fixes the clocks,
so their sum exceeds the step's own time; the shares are what to read."""
import argparse
import re
import sys

UNIT_MS = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def parse(text):
    """(kernel name, invocations, mean ms) for every summary block of the log"""
    rows = []
    head = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\).*Invocations (\d+)\s*$")
    metric = re.compile(r"^\s+gpu__time_duration\.sum\s+(\S+)\s+\S+\s+\S+\s+([\d.,]+)\s*$")
    name = None
    for line in text.splitlines():
        m = head.match(line)
        if m:
            name, calls = m.group(1), int(m.group(2))
            continue
        m = metric.match(line)
        if m and name is not None:
            unit = m.group(1)
            if unit not in UNIT_MS:
                sys.exit(f"kernel_table.py: unknown time unit {unit!r} in: {line.strip()}")
            rows.append((name, calls, float(m.group(2).replace(",", "")) * UNIT_MS[unit]))
            name = None
    return rows


def without_arguments(name):
    """the kernel's name less its trailing argument list, '(anonymous namespace)::' and templates kept"""
    if not name.endswith(")"):
        return name.strip()
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i].strip() or name.strip()
    return name.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--steps", type=int, default=1, help="steps the profiled run made (default 1)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.log, errors="replace") as f:
        rows = parse(f.read())
    if not rows:
        sys.exit(f"kernel_table.py: {a.log}: no per-kernel summary with gpu__time_duration.sum in it")
    by = {}
    for name, calls, ms in rows:
        base = without_arguments(name)
        t = by.setdefault(base, [0.0, 0])
        t[0] += calls * ms
        t[1] += calls
    total = sum(t[0] for t in by.values())
    n = max(a.steps, 1)
    print(f"{total / n:.1f} ms of kernel time a step ({len(rows)} kernel shapes, {len(by)} kernels, {n} step(s))")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>7}  kernel")
    for base, (ms, calls) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"{ms / n:9.2f} {100 * ms / total:5.1f}% {calls / n:7.0f}  {base[:90]}")


if __name__ == "__main__":
    main()
