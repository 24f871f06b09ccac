#!/bin/bash
# dist.sh: training on several processes against one (bench/bench_dist.c): the bench-s LIMoE step
# at a global batch of 32 on 1 process and on 2 (one process per core, data parallel, then with
# the experts split over both), with the seconds and megabytes per step of the gradient
# all-reduce, the embedding all-gathers and the experts' all-to-alls, and the scaling efficiency
# t(1 process) / (W x t(W processes)) at the same global batch. Prints a markdown table.
# Usage: bench/dist.sh [BENCHDIR] (default build/rel/bench)
set -e
bin=${1:-build/rel/bench}/bench_dist
model=${MODEL:-bench/models/bench-s.json}
steps=${STEPS:-6}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
one=$("$bin" "$model" --batch 32 --steps "$steps")
dp=$(mpirun -np 2 --bind-to core "$bin" "$model" --batch 16 --steps "$steps")
ep=$(mpirun -np 2 --bind-to core "$bin" "$model" --batch 16 --steps "$steps" --expert-parallel)
python3 - "$one" "$dp" "$ep" <<'PY'
import json, sys
rows = [json.loads(a) for a in sys.argv[1:]]
t1 = rows[0]["step_s"]
print("| layout | processes x batch | s/step | scaling efficiency | all-reduce s (MB) | all-gather s (MB) | all-to-all s (MB) |")
print("|---|---|---|---|---|---|---|")
for r, name in zip(rows, ("one process", "data parallel", "data + expert parallel")):
    eff = t1 / (r["world"] * r["step_s"])
    print(f"| {name} | {r['world']} x {r['batch_per_process']} | {r['step_s']:.3f} | {100 * eff:.0f}% | "
          f"{r['allreduce_s']:.4f} ({r['allreduce_mb']:.1f}) | {r['allgather_s']:.4f} ({r['allgather_mb']:.2f}) | "
          f"{r['alltoall_s']:.4f} ({r['alltoall_mb']:.2f}) |")
print(f"\n{rows[0]['model']}, global batch {rows[0]['global_batch']}, one thread per process, median of the steps; "
      "collective times are the slowest process's.")
PY
