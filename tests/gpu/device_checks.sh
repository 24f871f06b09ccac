#!/bin/bash
# device_checks.sh [BINDIR] [OUT]: issue 16's GPU checks in one go, for a machine with a GPU: the
# card, test_backend_ops (every op on CPU and CUDA), test_dist (the NCCL rows), the whole-model
# parity (tests/gpu/parity.sh), a LIMoE-B/16-shaped step against PyTorch eager and torch.compile
# on the same card (bench_step / bench/torch_step.py), and the demo's training on the GPU.
# BINDIR holds vlmoe, test_backend_ops, test_dist and bench_step built with `make CUDA=1`
# (default: this checkout's build outputs). Each part has its own time limit; OUT gets the logs.
BIN=${1:-.}
OUT=${2:-/tmp/vlmoe-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
b16=bench/models/bench-b16.json
part() {  # part NAME SECONDS CMD...: runs CMD with a limit, output to OUT/NAME.txt and a summary line
    name=$1 limit=$2
    shift 2
    t0=$EPOCHREALTIME
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    printf '== %s: exit %d in %.1f s\n' "$name" $rc "$(awk "BEGIN { print $EPOCHREALTIME - $t0 }")"
    tail -n "${TAILN:-6}" "$OUT/$name.txt" | cut -c1-600
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
TAILN=3 part backend_ops 120 "$BIN/test_backend_ops"
grep -E "FAIL|skip" "$OUT/backend_ops.txt" | head -20
TAILN=12 part parity 200 env PYTHON="$PY" sh tests/gpu/parity.sh "$BIN/vlmoe" /tmp/vlmoe-parity
TAILN=8 part dist 60 "$BIN/test_dist"
# the CUDA backend computes in fp32 (no TF32) for now: its step against PyTorch's fp32 and bf16
TAILN=1 part b16_vlmoe_fp32 90 "$BIN/bench_step" $b16 --device cuda --precision fp32 --batch 64 --steps 5 --warmup 2
for p in fp32 bf16; do
    TAILN=1 part "b16_torch_$p" 90 $PY bench/torch_step.py $b16 --device cuda --precision $p --batch 64 --steps 5 \
        --warmup 2
done
TAILN=2 part demo_gpu 120 "$BIN/vlmoe" train --model limoe-mini --dataset-type synthetic --steps 3000 --lr 1e-3 \
    --warmup 150 --optimizer adamw --wd 0.1 --log-every-n-steps 500 --zeroshot-frequency 500 --eval-samples 500 \
    --logs /tmp/vlmoe-demo --name demo --device cuda
TAILN=1 part b16_torch_compile_bf16 120 $PY bench/torch_step.py $b16 --device cuda --precision bf16 --batch 64 \
    --steps 5 --warmup 3 --compile
