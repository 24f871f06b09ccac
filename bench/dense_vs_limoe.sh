#!/bin/sh
# dense_vs_limoe.sh: the README's results table. Trains the dense `mini` and the sparse
# `limoe-mini` (8 experts, top-1, MoE in every second block) on the built-in synthetic data with
# the demo's settings and the same number of steps, then evaluates both on the held-out split and
# prints one Markdown table: parameters (total and active per token), seconds per step, zero-shot
# top-1/top-5 over the 20 classes (chance 5%), retrieval R@1 both ways over 500 held-out pairs and
# 10-shot ridge accuracy. Usage: bench/dense_vs_limoe.sh [steps] (default 3000); needs ./vlmoe.
set -e
steps=${1:-3000}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for model in mini limoe-mini; do
    name=$(echo "$model" | tr '/' '_')
    ./vlmoe train --model "$model" --dataset-type synthetic --steps "$steps" --lr 1e-3 --warmup 150 \
        --log-every-n-steps 50 --eval-samples 500 --logs "$dir" --name "$name" > "$dir/$name.log" 2>&1
    ./vlmoe eval --model "$dir/$name/checkpoints/step_$steps.safetensors" --json > "$dir/$name.eval.json"
    echo "$model: trained and evaluated" >&2
done
python3 - "$dir" "$steps" <<'PY'
import json, math, os, statistics, struct, sys
d, steps = sys.argv[1], sys.argv[2]

def params(path):
    """Total parameters, and those one token uses: top_k of each layer's stacked experts."""
    with open(path, "rb") as f:
        head = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    cfg = json.loads(head["__metadata__"]["vlmoe.config"])
    k, e = cfg.get("moe", {}).get("top_k", 1), cfg.get("moe", {}).get("num_experts", 1)
    total = active = 0
    for name, t in head.items():
        if name == "__metadata__":
            continue
        n = math.prod(t["shape"])
        total += n
        active += n * k / e if ".moe.experts." in name else n
    return total, active

print(f"| model | params (active) | s/step | zero-shot top-1 | top-5 | R@1 i2t / t2i | 10-shot |")
print("|---|---|---|---|---|---|---|")
for model in ("mini", "limoe-mini"):
    ev = json.load(open(os.path.join(d, f"{model}.eval.json")))
    rows = [json.loads(l) for l in open(os.path.join(d, model, "metrics.jsonl")) if '"kind":"train"' in l]
    sps = statistics.median(r["time"]["s_per_step"] for r in rows)
    total, active = params(os.path.join(d, model, "checkpoints", f"step_{steps}.safetensors"))
    print(f"| {model} | {total / 1e6:.2f}M ({active / 1e6:.2f}M) | {sps:.3f} | "
          f"{100 * ev['zeroshot']['top1']:.1f}% | {100 * ev['zeroshot']['top5']:.1f}% | "
          f"{100 * ev['retrieval']['i2t_R@1']:.1f}% / {100 * ev['retrieval']['t2i_R@1']:.1f}% | "
          f"{100 * ev['fewshot']['accuracy']:.1f}% |")
print(f"\n{steps} steps of 64 pairs each, lr 1e-3, warmup 150, cosine; held-out split of the synthetic data.")
PY
