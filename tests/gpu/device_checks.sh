#!/bin/bash
# device_checks.sh [BINDIR] [OUT]: issue 16's GPU checks in one go, for a machine with a GPU: the
# card, test_backend_ops (every op on CPU and CUDA, and the cuda-bf16 products against the
# cpu-bf16 ones), the whole-model parity in fp32 and bf16 (tests/gpu/parity.sh), a
# LIMoE-B/16-shaped step in fp32 and bf16 against PyTorch eager on the same card (bench_step /
# bench/torch_step.py), test_dist (the NCCL rows) and the demo's training on the GPU; then a
# table: one row per part with its exit status, time and result.
# BINDIR holds vlmoe, test_backend_ops, test_dist and bench_step built with `make CUDA=1`
# (default: this checkout's build outputs), and may hold libs.tar.xz (tests/gpu/bundle.sh).
# Each part has its own time limit; OUT gets the logs. PARTS (environment) picks parts by name,
# in this order; the default set's limits add up to 535 s, inside ten minutes.
# b16_torch_compile_bf16 (torch.compile, about 2 minutes), profile_bf16 (ncu's time per
# kernel of the B/16-shaped bf16 step, about 1 minute) and cpu_speed (bench/speed.py on the host
# CPU against the machine's PyTorch, bench-s at 2 and 1 threads, 3 rounds of 3 steps, about 7
# minutes; needs BINDIR/cpu from bundle.sh's CPUBENCH) run only when named.
BIN=${1:-.}
OUT=${2:-/tmp/vlmoe-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
b16=bench/models/bench-b16.json
PARTS=${PARTS:-"backend_ops parity b16_vlmoe_bf16 b16_vlmoe_fp32 b16_torch_bf16 b16_torch_fp32 dist demo_gpu"}
SUMMARY="$OUT/summary.tsv"
: >"$SUMMARY"

# Libraries this machine lacks: CUDA's NCCL from PyTorch's wheels where the toolkit has none,
# the rest from a bundle made by tests/gpu/bundle.sh (another distribution's oneDNN, cJSON, ...)
# (absent ones, and ones too old for a symbol version the binaries need: "LIB: version ... not found")
missing() {
    ldd "$BIN"/* "$BIN"/cpu/* 2>&1 | awk '/=> not found/ { print $1 }
        / version .* not found/ { sub(/:$/, "", $2); n = split($2, p, "/"); print p[n] }' | sort -u
}
if [ -n "$(missing)" ]; then # only the wheels' folders that hold a missing one, after the rest
    wheels='import nvidia, os; print(" ".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p)))'
    for d in $("$PY" -c "$wheels" 2>/dev/null); do
        for f in $(missing); do
            [ -f "$d/$f" ] && LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d && break
        done
    done
    export LD_LIBRARY_PATH
fi
if [ -n "$(missing)" ] && [ -f "$BIN/libs.tar.xz" ]; then
    L=$(mktemp -d)
    trap 'rm -rf "$L"' EXIT
    mkdir -p "$L/all" "$L/use" && tar -xJf "$BIN/libs.tar.xz" -C "$L/all"
    export LD_LIBRARY_PATH="$L/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    for i in 1 2 3 4; do # a library found may need another one the machine lacks
        for f in $(missing); do [ -f "$L/all/$f" ] && ln -sf "$L/all/$f" "$L/use/$f"; done
    done
    echo "from $BIN/libs.tar.xz: $(ls "$L/use" | tr '\n' ' ')"
fi
[ -n "$(missing)" ] && echo "still missing: $(missing | tr '\n' ' ')"

# the one-line result of a part, from its log
result_of() {
    f="$OUT/$1.txt"
    case $1 in
    backend_ops) grep -E "^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped" "$f" | tail -1 ;;
    parity) # from the comparisons' own lines, so that a run stopped before its table still counts
        echo "$(grep -c '^ok .*tolerance' "$f") gated ok, $(grep -c '^FAIL .*tolerance' "$f") gated FAIL," \
            "$(grep -c '^FAIL' "$f") FAIL lines" ;;
    profile_*) head -1 "$f" ;;
    cpu_speed) # each thread count's row of the training table (not of the fp32 targets' table under
        # it, whose rows also start with the model): the fp32 and bf16 steps' ratios to PyTorch's
        awk '/^bench-s +[0-9]/ && $11 ~ /x$/ { printf "%st fp32 %s bf16 %s; ", $2, $11, $12 }' "$f" ;;
    b16_*) grep -o '"\(precision\|matmul\|step_s\|image_per_s\)": "\?[^,"]*' "$f" | tr -d '"' | tr '\n' ' ' ;;
    *) tail -1 "$f" | cut -c1-100 ;;
    esac
}
part() {  # part NAME SECONDS CMD...: runs CMD with a limit, output to OUT/NAME.txt, a summary row
    name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    t0=$EPOCHREALTIME
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    dt=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $t0 }")
    printf '== %s: exit %d in %s s\n' "$name" $rc "$dt"
    tail -n "${TAILN:-6}" "$OUT/$name.txt" | cut -c1-600
    [ $rc = 124 ] && echo "   (stopped at its limit of $limit s)"
    printf '%s\t%s\t%s\t%s\n' "$name" $rc "$dt" "$(result_of "$name")" >>"$SUMMARY"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
TAILN=3 part backend_ops 50 "$BIN/test_backend_ops"
[ -f "$OUT/backend_ops.txt" ] && grep -E "FAIL|skip|bf16|route" "$OUT/backend_ops.txt" | head -20
TAILN=19 part parity 250 env PYTHON="$PY" sh tests/gpu/parity.sh "$BIN/vlmoe" /tmp/vlmoe-parity
for p in bf16 fp32; do
    TAILN=1 part "b16_vlmoe_$p" 40 "$BIN/bench_step" $b16 --device cuda --precision $p --batch 64 --steps 5 --warmup 2
done
for p in bf16 fp32; do
    TAILN=1 part "b16_torch_$p" 40 $PY bench/torch_step.py $b16 --device cuda --precision $p --batch 64 --steps 5 \
        --warmup 2
done
TAILN=8 part dist 30 "$BIN/test_dist"
TAILN=2 part demo_gpu 45 "$BIN/vlmoe" train --model limoe-mini --dataset-type synthetic --steps 3000 --lr 1e-3 \
    --warmup 150 --optimizer adamw --wd 0.1 --log-every-n-steps 500 --zeroshot-frequency 500 --eval-samples 500 \
    --logs /tmp/vlmoe-demo --name demo --device cuda
# Nsight Compute's time per kernel over a warm-up step and one step, as a table by kernel
# (tests/gpu/kernel_table.py); its raw log beside it
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
TAILN=16 part profile_bf16 150 sh -c "'$NCU' --metrics gpu__time_duration.sum --print-summary per-kernel \
    '$BIN/bench_step' $b16 --device cuda --precision bf16 --batch 64 --steps 1 --warmup 1 >'$OUT/profile_bf16.ncu' 2>&1 &&
    '$PY' tests/gpu/kernel_table.py '$OUT/profile_bf16.ncu' --steps 2 --top 20"
TAILN=18 part cpu_speed 480 "$PY" bench/speed.py --python "$PY" --bin "$BIN/cpu" --rounds 3 --steps 3 --no-embed \
    --models bench-s --threads 2,1
TAILN=1 part b16_torch_compile_bf16 150 $PY bench/torch_step.py $b16 --device cuda --precision bf16 --batch 64 \
    --steps 5 --warmup 3 --compile
echo
echo "== summary ($OUT/summary.tsv; logs in $OUT)"
printf '%-24s %-5s %-8s %s\n' part exit seconds result
awk -F'\t' '{ printf "%-24s %-5s %-8s %s\n", $1, $2, $3, $4 }' "$SUMMARY"
