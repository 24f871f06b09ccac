#!/bin/bash
# ab_step.sh: two builds' bench-s training step compared on a noisy machine. Runs OLD's and NEW's
# bench_step in alternating pairs (old, new, old, new, ...) and prints each pair's step medians,
# the median of the pairs' old/new ratios and each side's best run. On a shared or virtual machine
# the step time moves by 10-40% between minutes, so the difference of two separate runs says
# little about a change of a few percent; a pair runs within seconds of itself, and the median of
# several pairs' ratios does not follow the machine's slow phases. Uses only bash and python3.
#
# Usage: bench/ab_step.sh OLD_BENCH_DIR NEW_BENCH_DIR [threads] [pairs] [model.json]
#   OLD_BENCH_DIR, NEW_BENCH_DIR: each a build's bench folder (build/rel/bench), for instance of a
#   `git worktree add /tmp/old <rev>` built with `make build/rel/bench/bench_step`
#   threads: OMP_NUM_THREADS and --threads (default 2); pairs: default 8;
#   model.json: default bench/models/bench-s.json (batch 64, 4 steps after 1 warm-up)
#   STEP_ARGS (environment): more bench_step flags for both sides, e.g. STEP_ARGS="--precision bf16"
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
old=$1/bench_step new=$2/bench_step threads=${3:-2} pairs=${4:-8}
model=${5:-$(dirname "$0")/models/bench-s.json}
for b in "$old" "$new"; do
    [ -x "$b" ] || { echo "ab_step.sh: $b: no bench_step there (make build/rel/bench/bench_step)" >&2; exit 1; }
done
[ -r "$model" ] || { echo "ab_step.sh: $model: cannot read the model file" >&2; exit 1; }
case "$threads,$pairs" in
*[!0-9,]* | ,* | *, | 0* | *,0*) echo "ab_step.sh: threads and pairs must be positive integers, got $threads and $pairs" >&2; exit 2 ;;
esac

step() { # prints step_s step_min_s loss of one run
    OMP_NUM_THREADS=$threads "$1" "$model" --batch 64 --steps 4 --warmup 1 --threads "$threads" ${STEP_ARGS:-} 2>/dev/null | tail -1 |
        python3 -c 'import json, sys; d = json.loads(sys.stdin.read()); print(d["step_s"], d["step_min_s"], d["loss"])'
}
for i in $(seq "$pairs"); do
    echo "old $(step "$old")"
    echo "new $(step "$new")"
    echo "pair $i of $pairs done" >&2
done | python3 -c '
import statistics as st, sys
rows = [l.split() for l in sys.stdin]
old = [r for r in rows if r[0] == "old"]
new = [r for r in rows if r[0] == "new"]
o = [float(r[1]) for r in old]
n = [float(r[1]) for r in new]
print("old step medians (s):", " ".join("%.3f" % x for x in o))
print("new step medians (s):", " ".join("%.3f" % x for x in n))
ratios = [a / b for a, b in zip(o, n)]
print("old/new: median of %d paired ratios %.3f (range %.3f-%.3f); best runs old %.3f s, new %.3f s"
      % (len(ratios), st.median(ratios), min(ratios), max(ratios),
         min(float(r[2]) for r in old), min(float(r[2]) for r in new)))
if {r[3] for r in old} != {r[3] for r in new}:
    print("note: the losses differ (old %s, new %s): the builds do not compute the same bits"
          % (sorted({r[3] for r in old}), sorted({r[3] for r in new})))
'
