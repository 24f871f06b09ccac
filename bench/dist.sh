#!/bin/bash
# dist.sh: training on several processes against one (bench/bench_dist.c): the bench-s LIMoE step
# at a global batch of 32 on 1 process and on 2 (one process per core, data parallel, then with
# the experts split over both), with the seconds and megabytes per step of the gradient
# all-reduce, the embedding all-gathers and the experts' all-to-alls, and the scaling efficiency
# t(1 process) / (W x t(W processes)) at the same global batch. The gradient is summed once after
# the backward (--bucket-cap-mb 0) and in buckets started during it (25 MB, DDP's default, and
# BUCKET_MB, default 1): the all-reduce seconds are then those the backward did not hide (spent
# inside the sums' calls). Prints a markdown table.
# Usage: bench/dist.sh [BENCHDIR] (default build/rel/bench)
set -e
bin=${1:-build/rel/bench}/bench_dist
model=${MODEL:-bench/models/bench-s.json}
steps=${STEPS:-6}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
one=$("$bin" "$model" --batch 32 --steps "$steps")
small=${BUCKET_MB:-1}
run2() { mpirun -np 2 --bind-to core "$bin" "$model" --batch 16 --steps "$steps" "$@"; }
dp0=$(run2 --bucket-cap-mb 0)
dp=$(run2 --bucket-cap-mb 25)
dps=$(run2 --bucket-cap-mb "$small")
ep0=$(run2 --expert-parallel --bucket-cap-mb 0)
ep=$(run2 --expert-parallel --bucket-cap-mb "$small")
python3 - "$one" "$dp0" "$dp" "$dps" "$ep0" "$ep" <<'PY'
import json, sys
rows = [json.loads(a) for a in sys.argv[1:]]
t1 = rows[0]["step_s"]
print("| layout | processes x batch | gradient sum | s/step | scaling efficiency | all-reduce s exposed (MB) | all-gather s (MB) | all-to-all s (MB) |")
print("|---|---|---|---|---|---|---|---|")
names = ("one process", "data parallel", "data parallel", "data parallel", "data + expert parallel", "data + expert parallel")
for r, name in zip(rows, names):
    eff = t1 / (r["world"] * r["step_s"])
    how = "-" if r["world"] == 1 else ("1 sum after the backward" if r["bucket_cap_mb"] == 0 else
           f"{r['buckets']} buckets of <= {r['bucket_cap_mb']:g} MB, {r['buckets_started_in_backward']} started in the backward")
    print(f"| {name} | {r['world']} x {r['batch_per_process']} | {how} | {r['step_s']:.3f} | {100 * eff:.0f}% | "
          f"{r['allreduce_s']:.4f} ({r['allreduce_mb']:.1f}) | {r['allgather_s']:.4f} ({r['allgather_mb']:.2f}) | "
          f"{r['alltoall_s']:.4f} ({r['alltoall_mb']:.2f}) |")
print(f"\n{rows[0]['model']}, global batch {rows[0]['global_batch']}, one thread per process, median of the steps; "
      "collective times are the slowest process's.")
PY
