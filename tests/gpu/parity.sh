#!/bin/sh
# parity.sh [VLMOE] [OUTDIR]: whole-model parity of the CUDA backend with the CPU (issue 16's check).
# Each model (the four MoE kinds, and LIMoE E.3's per-modality routers and disjoint pools) trains
# 5 AdamW steps (lr 1e-3, no warmup, so every parameter moves) on the built-in synthetic data on
# the CPU in fp32 and bf16 and on the GPU in fp32 (no TF32) and bf16;
# compare_runs.py measures the per-step loss and final-parameter differences. Gates:
#   cuda32 vs cpu32 within 1e-5;
#   cuda16 vs cpu32 within 2x what cpu16 moves from cpu32 on the same model, loss and parameters
#   apart. cpu16 and cuda16 round the same operands the same way (tests/test_backend_ops.c checks
#   the products alone), so a correct cuda16 moves about as far as cpu16 does; 2x leaves room for
#   the summation orders compounding over the steps; it must also move at least a quarter as far
#   (a cuda16 run that silently computed in fp32 would sit at 0). A wrong rounding or a broken
#   twin shows as a larger move. On a CPU without bf16 instructions cpu16 falls back to fp32 and
#   the gate is 1e-2.
# cpu16 vs cpu32 and cuda16 vs cpu16 are printed for scale, not gated. Ends with a table of all rows.
# vlmoe-tiny (VL-MoE: masked data modeling on the synthetic image, text and pair streams, with a
# 64-entry codebook from `vlmoe vq train`) trains the same 5 steps on the CPU and the GPU in fp32
# only (its trainer has no --precision), gated at 1e-5.
# MODELS (environment) picks models by name (default: all seven, vlmoe-tiny among them).
# Needs a GPU and a vlmoe built with `make CUDA=1`; exits 1 when a gated comparison fails.
VLMOE=${1:-./vlmoe}
D=${2:-/tmp/vlmoe-parity}
HERE=$(dirname "$0")
PY=${PYTHON:-python3}
rm -rf "$D" && mkdir -p "$D" || exit 1
T="$D/table.tsv"
fail=0
cmp() { "$PY" "$HERE/compare_runs.py" "$@" --table "$T"; }
MODELS=${MODELS:-"limoe-tiny clipup-tiny soft-tiny ec-tiny limoe-permod-tiny limoe-disjoint-tiny vlmoe-tiny"}
for m in $MODELS; do
    [ $m = vlmoe-tiny ] && continue
    run() {
        tag=$1
        shift
        "$VLMOE" train --model $m --steps 5 --optimizer adamw --lr 1e-3 --warmup 0 --batch-size 32 \
            --log-every-n-steps 1 --save-every-n-steps 5 --eval-samples 64 --seed 3 --logs "$D" --name "$m-$tag" \
            "$@" >"$D/$m-$tag.log" 2>&1 || { echo "FAIL $m $*: $(tail -2 "$D/$m-$tag.log")"; return 1; }
    }
    run cpu32 --device cpu || { fail=1; continue; }
    if run cuda32 --device cuda --precision fp32; then
        cmp "$D/$m-cuda32" "$D/$m-cpu32" --tol 1e-5 || fail=1
    else
        fail=1
    fi
    run cpu16 --device cpu --precision bf16 && cmp "$D/$m-cpu16" "$D/$m-cpu32" --info
    if run cuda16 --device cuda --precision bf16; then
        if grep -q "running in fp32" "$D/$m-cpu16.log"; then
            cmp "$D/$m-cuda16" "$D/$m-cpu32" --tol 1e-2 || fail=1
        else
            cmp "$D/$m-cuda16" "$D/$m-cpu32" --relative-to "$D/$m-cpu16" "$D/$m-cpu32" --factor 2 || fail=1
        fi
        cmp "$D/$m-cuda16" "$D/$m-cpu16" --info
    else
        fail=1
    fi
done
m=vlmoe-tiny
case " $MODELS " in *" $m "*) ;; *) m= ;; esac
if [ -z "$m" ]; then
    :
elif printf '{"base": "vlmoe-tiny", "mim_vocab": 64}\n' >"$D/vm.json" &&
    "$VLMOE" vq train --model "$D/vm.json" --size 64 --images 16 -o "$D/cb.safetensors" >"$D/vq.log" 2>&1; then
    mome() {
        tag=$1
        shift
        "$VLMOE" train --model "$D/vm.json" --codebook "$D/cb.safetensors" --steps 5 --optimizer adamw --lr 1e-3 \
            --warmup 0 --batch-size 24 --log-every-n-steps 1 --save-every-n-steps 5 --seed 3 --logs "$D" \
            --name "$m-$tag" "$@" >"$D/$m-$tag.log" 2>&1 || { echo "FAIL $m $*: $(tail -2 "$D/$m-$tag.log")"; return 1; }
    }
    if mome cpu32 --device cpu && mome cuda32 --device cuda; then
        cmp "$D/$m-cuda32" "$D/$m-cpu32" --tol 1e-5 || fail=1
    else
        fail=1
    fi
else
    echo "FAIL $m: vq train: $(tail -2 "$D/vq.log")"
    fail=1
fi
echo
printf '%-12s %-16s %-10s %-10s %-21s %s\n' model pair "loss diff" "param diff" "tol (loss / param)" result
[ -f "$T" ] && awk -F'\t' '{ printf "%-12s %-16s %-10s %-10s %-21s %s\n", $1, $2, $3, $4, $5, $6 }' "$T"
exit $fail
