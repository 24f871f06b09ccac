#!/bin/sh
# limoe_failure.sh: LIMoE's failure mode (LIMoE sec. 2.2), measured on the synthetic data.
# A tiny one_tower MoE trained with the classic losses only (importance + load) and FIFO dispatch
# with image tokens ahead of text in the group, against the limoe preset (BPR, per-modality local
# and global entropy losses). Prints the success rates of image and text tokens per run, averaged
# over the last 50 steps. Usage: bench/limoe_failure.sh [steps] (default 400); needs ./vlmoe.
set -e
steps=${1:-400}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/classic.json" <<JSON
{"base": "tiny", "name": "classic-fifo",
 "moe": {"preset": "limoe", "layers": "every_2", "order": "fifo",
         "aux": {"importance": 0.02, "load": 0.02}}}
JSON
cat > "$dir/limoe.json" <<JSON
{"base": "tiny", "name": "limoe-bpr", "moe": {"preset": "limoe", "layers": "every_2"}}
JSON
# Capacity factor 1.0 in both runs makes dropping visible at this scale.
for run in classic limoe; do
    sed -i 's/"layers": "every_2"/"layers": "every_2", "capacity_factor": 1.0/' "$dir/$run.json"
    ./vlmoe train --model "$dir/$run.json" --steps "$steps" --log-every-n-steps 1 --eval-samples 500 \
        --logs "$dir" --name "$run" 2>/dev/null | sed "s/^/$run: /"
    python3 - "$dir/$run/metrics.jsonl" "$run" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"moe"' in l]
last = rows[-50:]
def mean(key, mod):
    return sum(min(layer[mod][key] for layer in r["moe"]) for r in last) / len(last)
print(f"{sys.argv[2]}: success rate image {mean('success', 'image'):.3f} text {mean('success', 'text'):.3f}"
      f" (last 50 of {len(rows)} steps, lowest MoE layer); experts used image "
      f"{mean('experts_used', 'image'):.2f} text {mean('experts_used', 'text'):.2f}")
PY
done
