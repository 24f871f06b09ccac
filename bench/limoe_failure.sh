#!/bin/sh
# limoe_failure.sh: LIMoE's failure mode (LIMoE sec. 2.2.1-2.2.3, Fig. 3 and 6), measured on the
# synthetic data over several seeds. A tiny one_tower MoE (8 experts, top-1, capacity factor 1.0 so
# that dropping shows at this scale) is trained in four settings:
#   classic     importance + load losses only, FIFO dispatch, image tokens ahead of text in the group
#   classic+bpr the same with Batch Priority Routing
#   limoe       the limoe preset: BPR, classic + per-modality local and global entropy losses
#   text-first  classic with the text tokens ahead of the images (LIMoE Fig. 6's other FIFO)
# and prints, per setting, the mean and the spread over seeds (std, min-max) of the image and text
# success rates (mean of the last 50 steps, lowest MoE layer), the experts used per modality and the
# held-out zero-shot top-1 at the end. Then LIMoE E.4's pruning curves: each seed's limoe model with
# its text experts pruned (`vlmoe prune --sweep`, shares from its training statistics), router_pred
# against router_drop, zero-shot top-1 per count of experts kept, as mean and spread over seeds.
# Usage: bench/limoe_failure.sh [steps] [seeds] [patch] (defaults 400, 3, 8); needs ./vlmoe.
# Seeds are 0..seeds-1 (`vlmoe train --seed`: initialisation, data, routing noise). The 32x32
# images of `tiny` give 16 patches at patch 8, as many tokens as the 16 of a caption; patch 4 gives
# 64, four times the text's, the imbalance LIMoE's failure mode comes from (its models see 3-17x).
set -e
steps=${1:-400}
seeds=${2:-3}
patch=${3:-8}
case "$steps$seeds$patch" in *[!0-9]*|'') echo "usage: $0 [steps] [seeds] [patch] (positive integers)" >&2; exit 2;; esac
if [ "$steps" -lt 50 ] || [ "$seeds" -lt 1 ]; then
    echo "$0: need steps >= 50 (the rates are over the last 50) and seeds >= 1" >&2
    exit 2
fi
[ -x ./vlmoe ] || { echo "$0: ./vlmoe not found: run it from the repository root after make" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
settings="classic classic+bpr limoe text-first"
# One config per setting. The classic weights are LIMoE's 0.04 averaged over the losses enabled
# (B.1), as the preset's 0.04/5 is over its five: only the entropy losses differ.
moe='"preset": "limoe", "layers": "every_2", "capacity_factor": 1.0'
classic='"aux": {"importance": 0.02, "load": 0.02}'
for s in $settings; do
    case $s in
        classic) extra="\"order\": \"fifo\", $classic";;
        classic+bpr) extra="\"order\": \"bpr\", $classic";;
        limoe) extra='"order": "bpr"';;
        text-first) extra="\"order\": \"fifo\", \"text_first\": true, $classic";;
    esac
    echo "{\"base\": \"tiny\", \"name\": \"fail-$s\", \"patch_size\": $patch, \"moe\": {$moe, $extra}}" > "$dir/$s.json"
done
# One job per seed (each runs its four settings, then its pruning sweep), one thread each unless
# OMP_NUM_THREADS says otherwise: results do not depend on the thread count, and on a shared or
# small machine the seeds overlap instead of queueing.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
one_seed() {
    for s in $settings; do
        ./vlmoe train --model "$dir/$s.json" --seed "$1" --steps "$steps" --log-every-n-steps 1 \
            --eval-samples 500 --logs "$dir" --name "$s-$1" > "$dir/$s-$1.log" 2>&1 ||
            { echo "$s seed $1: vlmoe train failed:" >&2; tail -5 "$dir/$s-$1.log" >&2; return 1; }
        echo "$s seed $1: $(grep 'held-out' "$dir/$s-$1.log" | tail -1)" >&2
    done
    run="$dir/limoe-$1"
    ./vlmoe prune --model "$run/checkpoints/step_$steps.safetensors" --modality text --sweep 1,2,4,6 \
        --stats "$run/metrics.jsonl" > "$dir/prune-$1.log" 2>&1 ||
        { echo "limoe seed $1: vlmoe prune --sweep failed:" >&2; cat "$dir/prune-$1.log" >&2; return 1; }
    touch "$dir/ok-$1"
}
seed=0
while [ "$seed" -lt "$seeds" ]; do
    one_seed "$seed" &
    seed=$((seed + 1))
done
wait
seed=0
while [ "$seed" -lt "$seeds" ]; do
    [ -e "$dir/ok-$seed" ] || { echo "$0: seed $seed failed (above)" >&2; exit 1; }
    seed=$((seed + 1))
done
python3 - "$dir" "$steps" "$seeds" "$patch" "$settings" <<'PY'
import json, math, os, statistics, sys
d, steps, seeds, patch, settings = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split()

def spread(xs, pct=False):
    """mean, std over seeds and min-max, as one cell"""
    f = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.3f}")
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{f(statistics.mean(xs))} ± {f(sd)} ({f(min(xs))}-{f(max(xs))})"

def run_numbers(path):
    rows = [json.loads(l) for l in open(path)]
    train = [r for r in rows if r.get("kind") == "train" and "moe" in r]
    last = train[-50:]
    def mean(key, mod):
        vals = [min(layer[mod][key] for layer in r["moe"]) for r in last]
        if any(not math.isfinite(v) for v in vals):
            sys.exit(f"{path}: non-finite {mod} {key}")
        return sum(vals) / len(vals)
    ev = [r for r in rows if r.get("kind") == "eval"]
    return {"si": mean("success", "image"), "st": mean("success", "text"),
            "ui": mean("experts_used", "image"), "ut": mean("experts_used", "text"),
            "zs": ev[-1]["eval_zeroshot_top1"]}

tok_i = (32 // patch) ** 2
print(f"Success rates, mean ± std (min-max) over seeds 0-{seeds - 1}: tiny one_tower, 8 experts top-1, cf 1.0, "
      f"{tok_i} image + 16 text tokens a pair, {steps} steps; rates over the last 50 steps, lowest MoE layer\n")
print("| setting | success image | success text | experts used image / text | zero-shot top-1 % |")
print("|---|---|---|---|---|")
for s in settings:
    n = [run_numbers(os.path.join(d, f"{s}-{k}", "metrics.jsonl")) for k in range(seeds)]
    print(f"| {s} | {spread([x['si'] for x in n])} | {spread([x['st'] for x in n])} | "
          f"{statistics.mean(x['ui'] for x in n):.2f} / {statistics.mean(x['ut'] for x in n):.2f} | "
          f"{spread([x['zs'] for x in n], pct=True)} |")
print("\nPer seed (image / text success):")
for s in settings:
    n = [run_numbers(os.path.join(d, f"{s}-{k}", "metrics.jsonl")) for k in range(seeds)]
    print(f"  {s:12s} " + "  ".join(f"{x['si']:.3f}/{x['st']:.3f}" for x in n))

# pruning: zero-shot top-1 of each seed's limoe model, text experts pruned
pts = {}
for k in range(seeds):
    for line in open(os.path.join(d, f"limoe-{k}", "prune_sweep.jsonl")):
        r = json.loads(line)
        pts.setdefault((r["mode"], r["kept"]), []).append(r["zeroshot"]["top1"])
kept = sorted({kp for (m, kp) in pts if m != "unpruned"})
full = pts[("unpruned", 8)]
print(f"\nPruning the limoe models' text experts (vlmoe prune --sweep, shares from the last 50 training steps), "
      f"zero-shot top-1 % on 512 held-out pairs, mean ± std (min-max) over seeds; unpruned {spread(full, pct=True)}\n")
print("| experts kept | router_pred | router_drop | pred - drop, mean (min-max) |")
print("|---|---|---|---|")
for kp in kept:
    p, q = pts[("router_pred", kp)], pts[("router_drop", kp)]
    diff = [a - b for a, b in zip(p, q)]
    print(f"| {kp} of 8 | {spread(p, pct=True)} | {spread(q, pct=True)} | "
          f"{100 * statistics.mean(diff):+.1f} ({100 * min(diff):+.1f} to {100 * max(diff):+.1f}) |")
PY
