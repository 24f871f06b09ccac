#!/bin/sh
# parity.sh [VLMOE] [OUTDIR]: whole-model parity of the CUDA backend with the CPU (issue 16's check).
# Each model (the four MoE kinds, and LIMoE E.3's per-modality routers and disjoint pools) trains 5
# AdamW steps (lr 1e-3, no warmup, so every parameter moves) on the built-in synthetic data on the
# CPU in fp32, then on the GPU in fp32 (no TF32) and in bf16, and on the CPU in
# bf16; compare_runs.py prints the per-step loss and final-parameter differences. fp32 must agree
# within 1e-5; the bf16 rows are printed against the same CPU fp32 run for comparison (not gated).
# vlmoe-tiny (VL-MoE: masked data modeling on the synthetic image, text and pair streams, with a
# 64-entry codebook from `vlmoe vq train`) trains the same 5 steps on the CPU and the GPU in fp32
# (its trainer has no --precision). Needs a GPU and a vlmoe built with `make CUDA=1`; exits 1 when
# an fp32 comparison fails.
VLMOE=${1:-./vlmoe}
D=${2:-/tmp/vlmoe-parity}
HERE=$(dirname "$0")
rm -rf "$D" && mkdir -p "$D" || exit 1
fail=0
for m in limoe-tiny clipup-tiny soft-tiny ec-tiny limoe-permod-tiny limoe-disjoint-tiny; do
    run() {
        tag=$1
        shift
        "$VLMOE" train --model $m --steps 5 --optimizer adamw --lr 1e-3 --warmup 0 --batch-size 32 \
            --log-every-n-steps 1 --save-every-n-steps 5 --eval-samples 64 --seed 3 --logs "$D" --name "$m-$tag" \
            "$@" >"$D/$m-$tag.log" 2>&1 || { echo "FAIL $m $*: $(tail -2 "$D/$m-$tag.log")"; return 1; }
    }
    run cpu32 --device cpu || { fail=1; continue; }
    if run cuda32 --device cuda --precision fp32; then
        ${PYTHON:-python3} "$HERE/compare_runs.py" "$D/$m-cpu32" "$D/$m-cuda32" --tol 1e-5 || fail=1
    else
        fail=1
    fi
    run cuda16 --device cuda --precision bf16 && ${PYTHON:-python3} "$HERE/compare_runs.py" "$D/$m-cpu32" "$D/$m-cuda16" --tol 1e-2
    run cpu16 --device cpu --precision bf16 && ${PYTHON:-python3} "$HERE/compare_runs.py" "$D/$m-cpu32" "$D/$m-cpu16" --tol 1e-2
done
m=vlmoe-tiny
printf '{"base": "vlmoe-tiny", "mim_vocab": 64}\n' >"$D/vm.json"
if "$VLMOE" vq train --model "$D/vm.json" --size 64 --images 16 -o "$D/cb.safetensors" >"$D/vq.log" 2>&1; then
    mome() {
        tag=$1
        shift
        "$VLMOE" train --model "$D/vm.json" --codebook "$D/cb.safetensors" --steps 5 --optimizer adamw --lr 1e-3 \
            --warmup 0 --batch-size 24 --log-every-n-steps 1 --save-every-n-steps 5 --seed 3 --logs "$D" \
            --name "$m-$tag" "$@" >"$D/$m-$tag.log" 2>&1 || { echo "FAIL $m $*: $(tail -2 "$D/$m-$tag.log")"; return 1; }
    }
    if mome cpu32 --device cpu && mome cuda32 --device cuda; then
        ${PYTHON:-python3} "$HERE/compare_runs.py" "$D/$m-cpu32" "$D/$m-cuda32" --tol 1e-5 || fail=1
    else
        fail=1
    fi
else
    echo "FAIL $m: vq train: $(tail -2 "$D/vq.log")"
    fail=1
fi
exit $fail
