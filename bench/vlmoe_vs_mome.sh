#!/bin/bash
# vlmoe_vs_mome.sh: VL-MoE's comparison of a sparse model with its dense twin at the same steps and
# active parameters per token (VL-MoE sec. 4, Table 1: VL-MoE against the dense BEiT-3 it is built
# on), at toy scale. Learns one k-means codebook (`vlmoe vq train`), pretrains the sparse
# `vlmoe-tiny` (V-MoE and T-MoE, 4 experts, top-1, in block 1) and the dense `mome-tiny` for the
# same number of steps on the built-in synthetic data (`vlmoe train --codebook`: MIM + MLM + VLM),
# then fine-tunes each with `vlmoe finetune --task pair-cls` on an image-caption matching set
# exported by `vlmoe synth export` (match.tsv: does this caption describe this image? half yes,
# half another class's caption; train split, seed 1, so no image of it was seen in pretraining),
# with routers and experts frozen as the paper does. "no pretraining" rows fine-tune the same
# initialisation the pretraining runs start from (a 1-step run at learning rate 0, which leaves the
# weights as initialised), training every weight. Prints one Markdown table on stdout; progress on
# stderr. Uses only ./vlmoe (or $VLMOE), /usr/bin/time and standard shell tools.
#
# The built-in data is in [-1, 1], so every command that reads exported image files gets
# --image-mean 0.5 --image-std 0.5 and sees the images as pretraining did. PRETRAIN_DATA=files
# pretrains instead on an export of the same synthetic stream (PRETRAIN_FILES samples through
# --train-data and the loader; the codebook from 256 of its images). Fine-tuned accuracies are of
# FINETUNE_SEEDS seeds each (head initialisation and data order): the table gives their mean and
# range, since one seed's accuracy moves by several points.
#
# Usage: bench/vlmoe_vs_mome.sh    (about 10 minutes on 2 cores with the defaults)
# Environment: PRETRAIN_STEPS (3000), FINETUNE_STEPS (300), FINETUNE_PAIRS (2000 rows of match.tsv;
# every 4th held out), FINETUNE_BATCH (32), FINETUNE_SEEDS (3), PRETRAIN_DATA (synthetic | files), PRETRAIN_FILES
# (20000), VLMOE (./vlmoe), KEEP=DIR (keep the runs there).
set -euo pipefail
pre=${PRETRAIN_STEPS:-3000}
data=${PRETRAIN_DATA:-synthetic}
nfiles=${PRETRAIN_FILES:-20000}
ft=${FINETUNE_STEPS:-300}
pairs=${FINETUNE_PAIRS:-2000}
fb=${FINETUNE_BATCH:-32}
seeds=${FINETUNE_SEEDS:-3}
vlmoe=${VLMOE:-./vlmoe}
[ -x "$vlmoe" ] || { echo "vlmoe_vs_mome.sh: $vlmoe not found: run make first, or set VLMOE" >&2; exit 1; }
if [ -n "${KEEP:-}" ]; then
    dir=$KEEP
    mkdir -p "$dir"
else
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
fi
t0=$(date +%s)

# seconds of a command (its output into $1.log): timed <name> <command...>
timed() {
    local name=$1
    shift
    /usr/bin/time -f %e -o "$dir/$name.sec" "$@" > "$dir/$name.log" 2>&1 ||
        { echo "vlmoe_vs_mome.sh: '$*' failed:" >&2; tail -n 20 "$dir/$name.log" >&2; exit 1; }
}
# the value of "key": in one line of JSON
field() { grep -o "\"$2\": *[-0-9.eE+]*" <<< "$1" | head -n 1 | sed 's/.*: *//'; }
# mean of "key" over the last 10 lines of a metrics.jsonl
mean_last() {
    tail -n 10 "$1" | grep -o "\"$2\": *[-0-9.eE+]*" | sed 's/.*: *//' |
        awk '{ s += $1; n++ } END { if (n) printf "%.3f", s / n; else printf "?" }'
}

norm=(--image-mean 0.5 --image-std 0.5)
pre_data=()
case $data in
synthetic) "$vlmoe" vq train --model vlmoe-tiny --size 1024 -o "$dir/cb.safetensors" > "$dir/vq.log" ;;
files)
    "$vlmoe" synth export --out "$dir/pretrain" --n "$nfiles" --split train --seed 0 > "$dir/export_pre.log"
    "$vlmoe" vq train --model vlmoe-tiny --size 1024 --image-data "$dir/pretrain/classes" --images 256 \
        "${norm[@]}" -o "$dir/cb.safetensors" > "$dir/vq.log"
    pre_data=(--train-data "$dir/pretrain/captions.csv" "${norm[@]}")
    ;;
*) echo "vlmoe_vs_mome.sh: PRETRAIN_DATA=$data: expected synthetic or files" >&2; exit 1 ;;
esac
"$vlmoe" synth export --out "$dir/match" --n "$pairs" --split train --seed 1 > "$dir/export.log"
echo "vlmoe_vs_mome.sh: codebook ($data) and $pairs matching pairs written" >&2

rows=()
for model in vlmoe-tiny mome-tiny; do
    timed "$model.pre" "$vlmoe" train --model "$model" --codebook "$dir/cb.safetensors" --steps "$pre" \
        --log-every-n-steps 10 --logs "$dir/logs" --name "$model" ${pre_data[@]+"${pre_data[@]}"}
    timed "$model.init" "$vlmoe" train --model "$model" --codebook "$dir/cb.safetensors" --steps 1 --lr 0 \
        --logs "$dir/logs" --name "$model-init"
    echo "vlmoe_vs_mome.sh: $model pretrained for $pre steps in $(cat "$dir/$model.pre.sec") s" >&2
    params=$(sed -n 's/.*(\([0-9]*\) parameters).*/\1/p' "$dir/$model.pre.log" | head -n 1)
    m="$dir/logs/$model/metrics.jsonl"
    losses="$(mean_last "$m" loss) | $(mean_last "$m" mim) | $(mean_last "$m" mlm) | $(mean_last "$m" vlm_text) + $(mean_last "$m" vlm_image)"
    for run in pre init; do
        ckpt=$dir/logs/$model/checkpoints/step_$pre.safetensors flags=--freeze-moe
        [ $run = init ] && ckpt=$dir/logs/$model-init/checkpoints/step_1.safetensors flags=
        accs=()
        for ((seed = 0; seed < seeds; seed++)); do
            name=$model.$run.ft$seed
            timed "$name" "$vlmoe" finetune --model "$ckpt" --task pair-cls --data "$dir/match/match.tsv" \
                -o "$dir/$name.safetensors" --steps "$ft" --batch-size "$fb" --log-every 50 --seed "$seed" \
                "${norm[@]}" $flags
            train=$(sed -n 's/^train accuracy \([0-9.]*\).*/\1/p' "$dir/$name.log")
            held=$(sed -n 's/^held-out accuracy \([0-9.]*\) (\([0-9]*\) examples).*/\1/p' "$dir/$name.log")
            accs+=("$train $held $(cat "$dir/$name.sec")")
            echo "vlmoe_vs_mome.sh: $model ($run, seed $seed) fine-tuned: held-out accuracy $held" >&2
        done
        # mean train accuracy | mean held-out accuracy (min-max) | mean seconds
        acc=$(printf '%s\n' "${accs[@]}" | awk '{ t += $1; h += $2; s += $3; n++
            if (n == 1 || $2 < lo) lo = $2; if (n == 1 || $2 > hi) hi = $2 }
            END { printf "%.1f | %.1f%% | %.1f%% (%.1f-%.1f)", s / n, 100 * t / n, 100 * h / n, 100 * lo, 100 * hi }')
        if [ $run = pre ]; then
            rows+=("| $model | $params | $pre | $(cat "$dir/$model.pre.sec") | $losses | $acc |")
        else
            rows+=("| $model, no pretraining | $params | 0 | - | - | - | - | - | $acc |")
        fi
    done
done
held_n=$(sed -n 's/^held-out accuracy [0-9.]* (\([0-9]*\) examples).*/\1/p' "$dir/vlmoe-tiny.pre.ft0.log")

echo "| model | params | pretrain steps | pretrain s | loss | MIM | MLM | VLM text + image | fine-tune s | train acc | held-out acc (range) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
if [ "$data" = files ]; then
    what="$nfiles exported synthetic samples (--train-data)"
else
    what="the built-in synthetic data"
fi
echo "Pretraining on $what: batches of 48 (16 images, 16 captions, 16 pairs), lr 1e-3, warmup 30, cosine;"
echo "losses are the means of the last 10 logged steps (every 10th). Fine-tuning: pair-cls on match.tsv ($pairs rows, train split,"
echo "seed 1; $held_n held out, chance 50%), $ft steps of $fb, lr 1e-3, cosine; pretrained rows with --freeze-moe;"
echo "means over $seeds fine-tuning seeds, the held-out range in brackets."
echo "Seconds are wall-clock on this machine; whole script $(( $(date +%s) - t0 )) s."
