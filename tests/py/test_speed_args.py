"""test_speed_args.py: bench/speed.py refuses a --python that cannot run PyTorch (a missing
interpreter, one that cannot import torch) and a --bin without bench_step before it runs anything,
naming the path and why, with argparse's exit status 2; torch_version reads the version of an
interpreter that can. Prints one line
"test_speed_args: N passed, N failed" and exits non-zero on a failure.
Usage: /usr/bin/python3 tests/py/test_speed_args.py"""
import os
import subprocess
import sys

from checks import check, done  # first: it puts bench/ on the path
import speed

SPEED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "speed.py")

for py, why in (("/nonexistent/python3", "cannot run it"), ("/bin/false", "cannot import torch")):
    p = subprocess.run([sys.executable, SPEED, "--python", py, "--bin", "/nonexistent"], capture_output=True,
                       text=True, timeout=60)
    check(f"{py}: exit status 2", p.returncode == 2, f"exit {p.returncode}, stderr {p.stderr[-300:]!r}")
    check(f"{py}: message names it and why", f"--python {py}: {why}" in p.stderr, repr(p.stderr[-300:]))
    check(f"{py}: nothing ran", "CPU:" not in p.stdout, repr(p.stdout[-300:]))

p = subprocess.run([sys.executable, SPEED, "--bin", "/nonexistent"], capture_output=True, text=True, timeout=120)
check("a --bin without bench_step: exit status 2", p.returncode == 2, f"exit {p.returncode}, {p.stderr[-300:]!r}")
check("a --bin without bench_step: named", "--bin /nonexistent: no bench_step" in p.stderr, repr(p.stderr[-300:]))

v, why = speed.torch_version(sys.executable)  # Debian's python3 has PyTorch (scripts/deps.sh)
check("a working interpreter's version", v is not None and v[:1].isdigit(), repr((v, why)))
done("test_speed_args")
