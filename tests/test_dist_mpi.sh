#!/bin/sh
# test_dist_mpi.sh: tests/test_dist and tests/test_train_dist under mpirun, on 2 ranks and on 3
# (oversubscribed on a small machine): every collective of src/dist/mpi.c with rank-dependent
# values, checked on every rank, and data-parallel training against one process at the global
# batch; then `vlmoe train` itself on 2 processes against one (the same losses to 1e-5), its
# validation (--val-data) on rank 0; VL-MoE pre-training likewise, and its checkpoints across
# process counts; and what happens when a process is killed, hangs (the collective timeout) or
# fails.
# Run by tests/run.sh on the optimised build only (Open MPI's own allocations look like leaks to
# LeakSanitizer); skipped, saying why, when mpirun is absent or the build has no MPI. Closes with
# "test_dist_mpi: N passed, N failed" (the ranks' checks summed). Usage: test_dist_mpi.sh RELDIR
rel=${1:-build/rel}
bin=$rel/tests/test_dist
name=test_dist_mpi
if ! command -v mpirun >/dev/null 2>&1; then
    echo "$name: skipped: mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    echo "$name: 0 passed, 0 failed"; exit 0
fi
[ -x "$bin" ] || { echo "$name: $bin not found (make $bin)"; echo "$name: 0 passed, 1 failed"; exit 1; }
if ! nm "$bin" 2>/dev/null | grep -q " MPI_Init_thread$"; then
    echo "$name: skipped: $bin was built without MPI (MPI=0 or no mpicc when it was built)"
    echo "$name: 0 passed, 0 failed"; exit 0
fi
# as root (CI containers) Open MPI wants both of these; the ranks talk over shared memory only,
# copying through it (containers often forbid the cross-process reads of its single-copy mode)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMP_NUM_THREADS=1
pass=0; fail=0
for t in test_dist test_train_dist; do
for np in 2 3 4; do
    b=$rel/tests/$t
    out=$(timeout 300 mpirun -np $np --oversubscribe "$b" 2>&1); rc=$?
    p=0; f=0; ranks=0
    for line in $(printf '%s\n' "$out" | grep -E "^$t: [0-9]+ passed, [0-9]+ failed\$" | sed -E "s/^$t: ([0-9]+) passed, ([0-9]+) failed\$/\\1:\\2/"); do
        p=$((p + ${line%%:*})); f=$((f + ${line##*:})); ranks=$((ranks + 1))
    done
    if [ $rc -ne 0 ] || [ $ranks -ne $np ]; then
        printf '%s\n' "$out" | tail -n 40
        echo "FAILED: mpirun -np $np $b (exit $rc, $ranks of $np ranks reported)"
        [ "$f" = 0 ] && f=1
    else
        printf '%s\n' "$out" | grep -E '^[a-z-]+( \(Adafactor\))?: [0-9]+ processes|, sharded vs replicated' | sed 's/^/     /'
        echo "ok   mpirun -np $np $b ($p checks on $np ranks)"
    fi
    pass=$((pass + p)); fail=$((fail + f))
done
done
# the command line: 2 processes x 4 pairs against 1 x 8, the losses of both logged steps
vl=${VLMOE_BIN:-./vlmoe}
tmp=$(mktemp -d)
# The worst relative difference between the "loss" of runs $1 and $2 (under $tmp), train record
# by train record, or "linesN" when they do not have $3 such records side by side.
loss_diff() {
    paste "$tmp/$1/metrics.jsonl" "$tmp/$2/metrics.jsonl" | grep '"kind":"train".*"kind":"train"' |
        sed -E 's/.*"loss":([-0-9.e+]*).*\t.*"loss":([-0-9.e+]*).*/\1 \2/' |
        awk -v want="$3" 'BEGIN { w = 0 } { d = ($1 - $2) / $2; if (d < 0) d = -d; if (d > w) w = d; n++ }
                          END { if (n != want) print "lines" n; else print w }'
}
# Whether every argument is a number no larger than 1e-5.
within() {
    for w; do awk -v w="$w" 'BEGIN { exit !(w + 0 == w && w <= 1e-5) }' || return 1; done
}
common="train --model tiny --steps 2 --log-every-n-steps 1 --eval-samples 0 --logs $tmp"
if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --batch-size 4 --name two > "$tmp/two.log" 2>&1 &&
   timeout 300 "$vl" $common --batch-size 8 --name one > "$tmp/one.log" 2>&1; then
    worst=$(loss_diff two one 2)
    if within "$worst"; then
        echo "ok   mpirun -np 2 vlmoe train --batch-size 4 = vlmoe train --batch-size 8 (losses within $worst)"
        pass=$((pass + 1))
    else
        echo "FAILED: mpirun -np 2 vlmoe train vs one process: loss difference $worst"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/two.log" "$tmp/one.log"; echo "FAILED: vlmoe train under mpirun"; fail=$((fail + 1))
fi
# --accum-freq under mpirun: 2 processes x 2 micro-batches x 2 pairs, the global batch of 8 again
if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --batch-size 2 --accum-freq 2 --name acc > "$tmp/acc.log" 2>&1; then
    worst=$(loss_diff acc one 2)
    if within "$worst"; then
        echo "ok   mpirun -np 2 vlmoe train --batch-size 2 --accum-freq 2 = vlmoe train --batch-size 8 (losses within $worst)"
        pass=$((pass + 1))
    else
        echo "FAILED: mpirun -np 2 vlmoe train --accum-freq 2 vs one process: loss difference $worst"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/acc.log"; echo "FAILED: vlmoe train --accum-freq under mpirun"; fail=$((fail + 1))
fi
# --expert-parallel: the same run with each process computing half of limoe-tiny's experts
common="train --model limoe-tiny --steps 2 --log-every-n-steps 1 --eval-samples 0 --logs $tmp --batch-size 4"
if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --name dp > "$tmp/dp.log" 2>&1 &&
   timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --name ep --expert-parallel 2 > "$tmp/ep.log" 2>&1; then
    worst=$(loss_diff ep dp 2)
    if within "$worst"; then
        echo "ok   mpirun -np 2 vlmoe train --expert-parallel = without it (losses within $worst)"
        pass=$((pass + 1))
    else
        echo "FAILED: --expert-parallel changes the losses by $worst"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/dp.log" "$tmp/ep.log"; echo "FAILED: vlmoe train --expert-parallel under mpirun"; fail=$((fail + 1))
fi
# --bucket-cap-mb: the gradient summed in buckets of 1 kB started during the backward, or once
# after it, logs the losses of the default (one 25 MB bucket for limoe-tiny) to the last digit
if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --name bk --bucket-cap-mb 0.001 > "$tmp/bk.log" 2>&1 &&
   timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --name bk0 --bucket-cap-mb 0 > "$tmp/bk0.log" 2>&1; then
    # (loss_diff prints nothing when every difference is 0: awk's w was never set)
    w1=$(loss_diff bk dp 2); w0=$(loss_diff bk0 dp 2); w1=${w1:-0}; w0=${w0:-0}
    if [ "$w1" = 0 ] && [ "$w0" = 0 ] && [ -s "$tmp/bk/metrics.jsonl" ]; then
        echo "ok   mpirun -np 2 vlmoe train --bucket-cap-mb 0.001 and 0 = the default (the same losses)"
        pass=$((pass + 1))
    else
        echo "FAILED: --bucket-cap-mb changes the losses: by $w1 (0.001 MB), $w0 (0)"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/bk.log" "$tmp/bk0.log"; echo "FAILED: vlmoe train --bucket-cap-mb under mpirun"; fail=$((fail + 1))
fi
if out=$(timeout 60 "$vl" train --model tiny --steps 1 --bucket-cap-mb -1 --logs "$tmp" 2>&1); then
    echo "FAILED: --bucket-cap-mb -1 was accepted"; fail=$((fail + 1))
elif printf '%s' "$out" | grep -q "^vlmoe train: --bucket-cap-mb must be >= 0 (a finite number), got '-1'"; then
    echo "ok   --bucket-cap-mb -1 is refused"; pass=$((pass + 1))
else
    printf '%s\n' "$out" | tail -n 5; echo "FAILED: --bucket-cap-mb -1: no clear message"; fail=$((fail + 1))
fi
# the checkpoint does not depend on the process layout: 4 processes with the experts split 4 ways
# train limoe-tiny (routing groups of 2 whole examples) 3 steps and save; 1 process and 2
# processes each resume it and train on to step 8; both log the losses of one process trained 8
# steps alone
printf '{"base": "limoe-tiny", "moe": {"group_size": 64}}\n' > "$tmp/lg.json"
common="train --model $tmp/lg.json --log-every-n-steps 1 --eval-samples 0 --logs $tmp --save-every-n-steps 3"
ck="$tmp/w4/checkpoints/step_3.safetensors"
if timeout 300 mpirun -np 4 --oversubscribe "$vl" $common --steps 3 --batch-size 2 --expert-parallel 4 --name w4 > "$tmp/w4.log" 2>&1 &&
   mkdir -p "$tmp/r1/checkpoints" "$tmp/r2/checkpoints" && cp "$tmp/w4/metrics.jsonl" "$tmp/w4/params.json" "$tmp/r1/" && cp "$tmp/w4/metrics.jsonl" "$tmp/w4/params.json" "$tmp/r2/" &&
   cp "$ck" "${ck%.safetensors}.state.safetensors" "$tmp/r1/checkpoints/" &&
   cp "$ck" "${ck%.safetensors}.state.safetensors" "$tmp/r2/checkpoints/" &&
   timeout 300 "$vl" $common --steps 8 --batch-size 8 --name r1 --resume latest > "$tmp/r1.log" 2>&1 &&
   timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --steps 8 --batch-size 4 --name r2 --resume latest > "$tmp/r2.log" 2>&1 &&
   timeout 300 "$vl" $common --steps 8 --batch-size 8 --name solo > "$tmp/solo.log" 2>&1; then
    w1=$(loss_diff r1 solo 8); w2=$(loss_diff r2 solo 8)
    if within "$w1" "$w2"; then
        echo "ok   saved by 4 processes (experts split 4 ways), resumed by 1 and by 2: the losses of one process (within $w1, $w2)"
        pass=$((pass + 1))
    else
        echo "FAILED: saved by 4 processes, resumed by 1 / 2: loss differences $w1 / $w2"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/w4.log" "$tmp/r1.log" "$tmp/r2.log" "$tmp/solo.log" 2>/dev/null
    echo "FAILED: resume across process layouts"; fail=$((fail + 1))
fi
# validation under mpirun: rank 0 alone evaluates --val-data (one line per evaluation) and its
# record equals vlmoe eval --json on the checkpoint of the step
"$vl" synth export --out "$tmp/sx" --n 24 --split val > "$tmp/sx.log" 2>&1
common="train --model tiny --steps 2 --log-every-n-steps 1 --eval-samples 0 --logs $tmp --batch-size 4 --image-mean 0.5"
common="$common --image-std 0.5 --val-data $tmp/sx/captions.csv --val-every-n-steps 1"
pick='s/.*("retrieval":\{[^}]*\},"contrastive":\{[^}]*\}).*/\1/'
if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --name val > "$tmp/val.log" 2>&1 &&
   "$vl" eval --model "$tmp/val/checkpoints/step_2.safetensors" --val-data "$tmp/sx/captions.csv" --image-mean 0.5 \
       --image-std 0.5 --batch-size 4 --few-shot 0 --json > "$tmp/val.json" 2>&1; then
    lines=$(grep -c "^step [12] val " "$tmp/val.log")
    rec=$(grep '"step":2,"kind":"eval"' "$tmp/val/metrics.jsonl" | sed -E "$pick")
    got=$(sed -E "$pick" "$tmp/val.json")
    if [ "$lines" = 2 ] && [ -n "$rec" ] && [ "$rec" = "$got" ]; then
        echo "ok   mpirun -np 2 vlmoe train --val-data: rank 0 evaluates, the record = vlmoe eval on the checkpoint"
        pass=$((pass + 1))
    else
        printf '%s\n%s\n' "$rec" "$got"; tail -n 10 "$tmp/val.log"
        echo "FAILED: --val-data under mpirun: $lines eval lines (want 2), record vs vlmoe eval above"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/sx.log" "$tmp/val.log" "$tmp/val.json"; echo "FAILED: vlmoe train --val-data under mpirun"
    fail=$((fail + 1))
fi
# sharded experts (src/train/trainer.c): 4 processes with limoe-tiny's experts split over pairs,
# so each expert's gradient is reduced between its 2 owners and only they update it. The state
# saved by the 4-way split above, resumed by pairs, trains on to step 8 (checkpoints at 6 and 8,
# after rank 0 gathers the experts) with the losses of one process; and rank 0's evaluation and
# checkpoint after step 1 hold every expert's current weights: the record = vlmoe eval on it, and
# so does the record of the same run without that checkpoint (rank 0 gathers for the evaluation).
ck3="$tmp/w4/checkpoints/step_3.safetensors"
# (AdamW here; Adafactor, limoe-tiny's own, is checked below)
ep2="--logs $tmp --log-every-n-steps 1 --eval-samples 0 --expert-parallel 2 --optimizer adamw"
if mkdir -p "$tmp/e2r/checkpoints" && cp "$tmp/w4/metrics.jsonl" "$tmp/w4/params.json" "$tmp/e2r/" &&
   cp "$ck3" "${ck3%.safetensors}.state.safetensors" "$tmp/e2r/checkpoints/" &&
   timeout 300 mpirun -np 4 --oversubscribe "$vl" train --model "$tmp/lg.json" $ep2 --save-every-n-steps 3 --steps 8 \
       --batch-size 2 --name e2r --resume latest > "$tmp/e2r.log" 2>&1 &&
   timeout 300 mpirun -np 4 --oversubscribe "$vl" train --model limoe-tiny $ep2 --steps 2 --batch-size 2 \
       --save-every-n-steps 1 --image-mean 0.5 --image-std 0.5 --val-data "$tmp/sx/captions.csv" \
       --val-every-n-steps 1 --name e2v > "$tmp/e2v.log" 2>&1 &&
   timeout 300 mpirun -np 4 --oversubscribe "$vl" train --model limoe-tiny $ep2 --steps 2 --batch-size 2 \
       --save-every-n-steps 2 --image-mean 0.5 --image-std 0.5 --val-data "$tmp/sx/captions.csv" \
       --val-every-n-steps 1 --name e2w > "$tmp/e2w.log" 2>&1 &&
   "$vl" eval --model "$tmp/e2v/checkpoints/step_1.safetensors" --val-data "$tmp/sx/captions.csv" --image-mean 0.5 \
       --image-std 0.5 --batch-size 2 --few-shot 0 --json > "$tmp/e2v.json" 2>&1; then
    w=$(loss_diff e2r solo 8)
    rec=$(grep '"step":1,"kind":"eval"' "$tmp/e2v/metrics.jsonl" | sed -E "$pick")
    got=$(sed -E "$pick" "$tmp/e2v.json")
    # the same run without a checkpoint at step 1: its evaluation alone makes rank 0 gather
    rew=$(grep '"step":1,"kind":"eval"' "$tmp/e2w/metrics.jsonl" | sed -E "$pick")
    if within "$w" && [ -n "$rec" ] && [ "$rec" = "$got" ] && [ "$rew" = "$got" ]; then
        echo "ok   sharded experts (4 processes, pairs): resumed from the 4-way split, the losses of one process (within $w); the step-1 evaluation, with and without a checkpoint there, = vlmoe eval on its checkpoint"
        pass=$((pass + 1))
    else
        printf '%s\n%s\n%s\n' "$rec" "$rew" "$got"; tail -n 5 "$tmp/e2r.log" "$tmp/e2v.log" "$tmp/e2w.log"
        echo "FAILED: sharded experts: loss difference $w to one process, or the step-1 record vs vlmoe eval above"
        fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/e2r.log" "$tmp/e2v.log" "$tmp/e2w.log" "$tmp/e2v.json" 2>/dev/null
    echo "FAILED: sharded experts under mpirun"
    fail=$((fail + 1))
fi
# sharded experts with Adafactor, LIMoE's optimizer (momentum in bfloat16), whose factored moments
# and momentum are per expert matrix: 4 processes with the experts split 4 ways and over pairs
# train 3 steps and save, with the losses of one process; each checkpoint (weights and state) holds,
# byte for byte, the tensors of the same run with the experts' state replicated
# (VLMOE_TEST_REPLICATE_EXPERTS, the path before sharding); the 4-way checkpoint resumed by 1
# process and by 4 split over pairs trains on to step 6 with the losses of one process alone.
# The tensors of a safetensors file: all that follows its header (which holds the run's ids).
st_data() {
    n=$(od -An -t u8 -N8 "$1" | tr -d ' ')
    tail -c +$((n + 9)) "$1"
}
af="train --model $tmp/lg.json --optimizer adafactor --momentum-dtype bfloat16 --log-every-n-steps 1 --eval-samples 0"
af="$af --logs $tmp --save-every-n-steps 3 --batch-size 2"
afs="train --model $tmp/lg.json --optimizer adafactor --momentum-dtype bfloat16 --log-every-n-steps 1 --eval-samples 0"
afs="$afs --logs $tmp --save-every-n-steps 3 --batch-size 8"
ok=1
for ep in 4 2; do
    if timeout 300 mpirun -np 4 --oversubscribe "$vl" $af --steps 3 --expert-parallel $ep --name af$ep > "$tmp/af$ep.log" 2>&1 &&
       env VLMOE_TEST_REPLICATE_EXPERTS=1 timeout 300 mpirun -np 4 --oversubscribe "$vl" $af --steps 3 \
           --expert-parallel $ep --name af${ep}r > "$tmp/af${ep}r.log" 2>&1; then
        same=0
        for f in step_3.safetensors step_3.state.safetensors; do
            st_data "$tmp/af$ep/checkpoints/$f" > "$tmp/a.bin"; st_data "$tmp/af${ep}r/checkpoints/$f" > "$tmp/b.bin"
            [ -s "$tmp/a.bin" ] && cmp -s "$tmp/a.bin" "$tmp/b.bin" && same=$((same + 1))
        done
        bytes=$(wc -c < "$tmp/a.bin")
        if [ "$same" = 2 ] && grep -qE '"optim\.adafactor\.m\.[^"]*moe\.experts\.fc1\.weight"' "$tmp/af$ep/checkpoints/step_3.state.safetensors"; then
            echo "ok   Adafactor, experts sharded $ep ways over 4 processes: the step-3 weights and state (its tensors: $bytes bytes) = the replicated run's, byte for byte"
            pass=$((pass + 1))
        else
            echo "FAILED: Adafactor, experts sharded $ep ways: $same of 2 checkpoint files hold the replicated run's tensors"
            fail=$((fail + 1))
        fi
    else
        tail -n 20 "$tmp/af$ep.log" "$tmp/af${ep}r.log"; echo "FAILED: Adafactor with --expert-parallel $ep under mpirun"
        fail=$((fail + 1)); ok=0
    fi
done
ck="$tmp/af4/checkpoints/step_3.safetensors"
if [ $ok = 1 ] && timeout 300 "$vl" $afs --steps 6 --name afsolo > "$tmp/afsolo.log" 2>&1 &&
   mkdir -p "$tmp/afr1/checkpoints" "$tmp/afr2/checkpoints" &&
   cp "$tmp/af4/metrics.jsonl" "$tmp/af4/params.json" "$tmp/afr1/" && cp "$tmp/af4/metrics.jsonl" "$tmp/af4/params.json" "$tmp/afr2/" &&
   cp "$ck" "${ck%.safetensors}.state.safetensors" "$tmp/afr1/checkpoints/" &&
   cp "$ck" "${ck%.safetensors}.state.safetensors" "$tmp/afr2/checkpoints/" &&
   timeout 300 "$vl" $afs --steps 6 --name afr1 --resume latest > "$tmp/afr1.log" 2>&1 &&
   timeout 300 mpirun -np 4 --oversubscribe "$vl" $af --steps 6 --expert-parallel 2 --name afr2 --resume latest \
       > "$tmp/afr2.log" 2>&1; then
    w4=$(loss_diff af4 afsolo 3); w2=$(loss_diff af2 afsolo 3); r1=$(loss_diff afr1 afsolo 6); r2=$(loss_diff afr2 afsolo 6)
    if within "$w4" "$w2" "$r1" "$r2"; then
        echo "ok   Adafactor, experts sharded 4 and 2 ways: the losses of one process (within $w4, $w2); the 4-way checkpoint resumed by 1 process and by 4 sharded 2 ways (within $r1, $r2)"
        pass=$((pass + 1))
    else
        echo "FAILED: Adafactor sharded: loss differences to one process $w4 (EP 4), $w2 (EP 2), resumed $r1 (1 process), $r2 (EP 2)"
        fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/afsolo.log" "$tmp/afr1.log" "$tmp/afr2.log" 2>/dev/null
    echo "FAILED: Adafactor checkpoints resumed across layouts"; fail=$((fail + 1))
fi
# a process killed mid-run (kill -9 one of 4) ends the job within 60 s with a message naming it,
# and leaves no half-written checkpoint
( timeout 120 mpirun -np 4 --oversubscribe "$vl" train --model tiny --steps 1000000 --batch-size 2 \
    --log-every-n-steps 1 --eval-samples 0 --save-every-n-steps 3 --logs "$tmp" --name kill > "$tmp/kill.log" 2>&1
  echo $? > "$tmp/kill.rc" ) &
job=$!
for i in $(seq 1 300); do
    [ -f "$tmp/kill/metrics.jsonl" ] && [ "$(wc -l < "$tmp/kill/metrics.jsonl")" -ge 4 ] && break
    sleep 0.1
done
victim=$(pgrep -f "^[^ ]*vlmoe train --model tiny --steps 1000000" | tail -n 1)
t0=$(date +%s)
[ -n "$victim" ] && kill -9 "$victim"
wait $job
took=$(( $(date +%s) - t0 ))
rc=$(cat "$tmp/kill.rc" 2>/dev/null)
half=$(ls "$tmp/kill/checkpoints" 2>/dev/null | grep -c '\.tmp\.')
lone=0
for w in "$tmp"/kill/checkpoints/step_*.safetensors; do
    case $w in *.state.safetensors) continue ;; esac
    [ -f "${w%.safetensors}.state.safetensors" ] || lone=$((lone + 1))
done
if [ -n "$victim" ] && [ "$rc" != 0 ] && [ "$took" -le 60 ] && [ "$half" = 0 ] && [ "$lone" = 0 ] &&
   grep -qiE "signal 9|killed" "$tmp/kill.log"; then
    echo "ok   kill -9 of one of 4 processes: the job ended in ${took} s (exit $rc), no half-written checkpoint"
    pass=$((pass + 1))
else
    tail -n 15 "$tmp/kill.log"
    echo "FAILED: kill -9 of one of 4 processes (victim '$victim', exit $rc after ${took} s, $half partial and $lone" \
         "incomplete checkpoints)"
    fail=$((fail + 1))
fi
# The failure behaviour (docs/DISTRIBUTED.md): `vlmoe train` on $1 processes with the environment
# $2 (a test hook "VAR=R@S" of src/train/run.c, and more VAR=VALUE) and flags $4..., run $3; sets rc, took (seconds), left (processes
# of the run still alive) and the log $tmp/$3.log.
fail_run() {
    np=$1 hook=$2 run=$3; shift 3
    t0=$(date +%s)
    env $hook timeout 120 mpirun -np "$np" --oversubscribe "$vl" train --model tiny --steps 1000 --batch-size 2 \
        --log-every-n-steps 1 --eval-samples 0 --save-every-n-steps 2 --logs "$tmp" --name "$run" "$@" \
        > "$tmp/$run.log" 2>&1
    rc=$?; took=$(( $(date +%s) - t0 ))
    left=$(pgrep -f "vlmoe train .*--name $run( |\$)" | wc -l)
}
# Whether run $1 left only whole checkpoints: no temporary file, every weights file with its state.
whole_checkpoints() {
    [ "$(ls "$tmp/$1/checkpoints" | grep -c '\.tmp\.')" = 0 ] || return 1
    for w in "$tmp/$1"/checkpoints/step_*.safetensors; do
        case $w in *.state.safetensors) continue ;; esac
        [ -s "$w" ] && [ -s "${w%.safetensors}.state.safetensors" ] || return 1
    done
}
# a process that hangs in step 3 (it stops answering, alive): with --dist-timeout 3 the others'
# watchdogs abort the job a few seconds later, naming the collective they waited in and the ranks
# that may have hung; no process is left and the step-2 checkpoint is whole
fail_run 4 VLMOE_TEST_HANG_RANK=1@3 hang --dist-timeout 3
pat='vlmoe: rank [023]: [a-z_]+ has waited [0-9]+ s for the other processes \(one of ranks [0-9, ]*1[0-9, ]* may have stopped or hung\): aborting the job'
if [ "$rc" != 0 ] && [ "$took" -le 20 ] && [ "$left" = 0 ] && grep -qE "$pat" "$tmp/hang.log" &&
   ! grep -q "^vlmoe: rank 1:" "$tmp/hang.log" && [ -f "$tmp/hang/checkpoints/step_2.safetensors" ] &&
   whole_checkpoints hang; then
    echo "ok   a process that hangs (1 of 4, --dist-timeout 3): the job ended in ${took} s (exit $rc): $(grep -m1 -oE "rank [0-9]: [a-z_]+ has waited [0-9]+ s" "$tmp/hang.log")"
    pass=$((pass + 1))
else
    tail -n 15 "$tmp/hang.log"
    echo "FAILED: a process that hangs, --dist-timeout 3: exit $rc after ${took} s, $left processes left, timeout message or whole checkpoint missing"
    fail=$((fail + 1))
fi
# the same through VLMOE_DIST_TIMEOUT, with rank 0 (the one that writes) hanging on 2 processes
fail_run 2 "VLMOE_TEST_HANG_RANK=0@2 VLMOE_DIST_TIMEOUT=2" hang0
if [ "$rc" != 0 ] && [ "$took" -le 20 ] && [ "$left" = 0 ] &&
   grep -qE 'vlmoe: rank 1: [a-z_]+ has waited [0-9]+ s for the other processes \(rank 0 may have stopped or hung\)' "$tmp/hang0.log"; then
    echo "ok   rank 0 of 2 hangs, VLMOE_DIST_TIMEOUT=2: the job ended in ${took} s (exit $rc)"
    pass=$((pass + 1))
else
    tail -n 15 "$tmp/hang0.log"
    echo "FAILED: rank 0 of 2 hangs, VLMOE_DIST_TIMEOUT=2: exit $rc after ${took} s, $left processes left"; fail=$((fail + 1))
fi
# a process that fails in step 4 (as on unreadable input) while the others wait for it in the step's
# collectives: it prints the cause with its rank and ends the job (MPI_Abort); the others stop
# within seconds, nothing is left half-written
fail_run 4 VLMOE_TEST_FAIL_RANK=2@4 bad
if [ "$rc" != 0 ] && [ "$took" -le 20 ] && [ "$left" = 0 ] &&
   grep -q "^vlmoe train: rank 2: step 4: VLMOE_TEST_FAIL_RANK=2 (a test hook): this process fails here as on unreadable input\$" "$tmp/bad.log" &&
   grep -q "^vlmoe train: rank 2 of 4 failed (the message above): ending every process of the run\$" "$tmp/bad.log" &&
   [ -f "$tmp/bad/checkpoints/step_2.safetensors" ] && [ ! -f "$tmp/bad/checkpoints/step_4.safetensors" ] &&
   whole_checkpoints bad; then
    echo "ok   a process that fails (2 of 4, step 4): the job ended in ${took} s (exit $rc), its message names rank 2 and the cause"
    pass=$((pass + 1))
else
    tail -n 15 "$tmp/bad.log"
    echo "FAILED: a process that fails: exit $rc after ${took} s, $left processes left, message or checkpoints wrong"
    fail=$((fail + 1))
fi
# a --dist-timeout that is no number of seconds is refused before any process trains
if out=$(timeout 60 mpirun -np 2 --oversubscribe "$vl" train --model tiny --steps 1 --dist-timeout 10s --logs "$tmp" 2>&1); then
    echo "FAILED: --dist-timeout 10s was accepted"; fail=$((fail + 1))
elif printf '%s' "$out" | grep -q "^vlmoe train: --dist-timeout 10s: expected the seconds"; then
    echo "ok   --dist-timeout 10s is refused"; pass=$((pass + 1))
else
    printf '%s\n' "$out" | tail -n 5; echo "FAILED: --dist-timeout 10s: no clear message"; fail=$((fail + 1))
fi
# Data files with bad images (a corrupt PNG, a missing file; in the tar a corrupt member): each
# process decodes only its block, they agree on which samples were bad, so 2 processes x 4 train
# as 1 x 8 and count the same bad samples (CSV and webdataset shards)
"$vl" synth export --out "$tmp/sd" --n 40 > "$tmp/sd.log" 2>&1
printf 'not a PNG at all' > "$tmp/sd/bad.png"
{ head -n 6 "$tmp/sd/captions.csv"; printf 'bad.png\ta corrupt image\nnone.png\ta missing image\n'
  tail -n +7 "$tmp/sd/captions.csv"; } > "$tmp/sd/bad.csv"
mkdir -p "$tmp/sdw"
tail -n +2 "$tmp/sd/bad.csv" | awk -F '\t' -v d="$tmp/sd" -v o="$tmp/sdw" '$1 != "none.png" {
    k = sprintf("s%03d", NR); system("cp \"" d "/" $1 "\" \"" o "/" k ".png\""); print $2 > (o "/" k ".txt") }'
(cd "$tmp/sdw" && tar cf ../sd.tar $(ls | sort))   # a sample's members side by side
for data in "$tmp/sd/bad.csv" "$tmp/sd.tar"; do
    common="train --model tiny --steps 4 --log-every-n-steps 1 --logs $tmp --train-data $data"
    common="$common --image-mean 0.5 --image-std 0.5 --max-bad-fraction 0.5"
    n=$(basename "$data" | tr . _)
    if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --batch-size 4 --name d2$n > "$tmp/d2$n.log" 2>&1 &&
       timeout 300 "$vl" $common --batch-size 8 --name d1$n > "$tmp/d1$n.log" 2>&1; then
        worst=$(loss_diff d2$n d1$n 4)
        b2=$(grep -o '"bad_samples":[0-9]*' "$tmp/d2$n/metrics.jsonl" | tr '\n' ' ')
        b1=$(grep -o '"bad_samples":[0-9]*' "$tmp/d1$n/metrics.jsonl" | tr '\n' ' ')
        if within "$worst" && [ "$b1" = "$b2" ] && printf '%s' "$b1" | grep -q '"bad_samples":[1-9]'; then
            echo "ok   $(basename "$data") with bad images: mpirun -np 2 vlmoe train --batch-size 4 = --batch-size 8 (losses within $worst, bad samples $b1)"
            pass=$((pass + 1))
        else
            echo "FAILED: $(basename "$data") on 2 processes vs one: loss difference $worst, bad samples '$b2' vs '$b1'"
            fail=$((fail + 1))
        fi
    else
        tail -n 20 "$tmp/d2$n.log" "$tmp/d1$n.log"; echo "FAILED: $(basename "$data") under mpirun"; fail=$((fail + 1))
    fi
done
# VL-MoE pre-training (vlmoe-tiny with routing groups of one sequence, so that a process holds
# whole groups; its default group_size 0 routes each process's share as one group, which the run
# notes): 2 processes x 12 samples = 1 x 24 on the synthetic streams and on files (an image
# folder, a text file and a CSV of pairs, with the BPE vocabulary trained by rank 0); then a
# checkpoint saved by 4 processes resumed by 1 and by 2 = one process trained alone
printf '{"base": "vlmoe-tiny", "mim_vocab": 64, "moe": {"group_size": 17}, "text_moe": {"group_size": 16}}\n' > "$tmp/vm.json"
"$vl" vq train --model "$tmp/vm.json" --size 64 --images 16 -o "$tmp/cb.safetensors" > "$tmp/vq.log" 2>&1
"$vl" synth export --out "$tmp/sh" --n 48 > "$tmp/sh.log" 2>&1
files="--image-data $tmp/sh/classes --text-data $tmp/sh/texts.txt --train-data $tmp/sh/captions.csv --image-mean 0.5 --image-std 0.5"
for how in synthetic files; do
    common="train --model $tmp/vm.json --codebook $tmp/cb.safetensors --steps 3 --log-every-n-steps 1 --logs $tmp --mix 2,1,1"
    [ $how = files ] && common="$common $files --mix 1,1,1"
    if timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --batch-size 12 --name m2$how > "$tmp/m2$how.log" 2>&1 &&
       timeout 300 "$vl" $common --batch-size 24 --name m1$how > "$tmp/m1$how.log" 2>&1; then
        worst=$(loss_diff m2$how m1$how 3)
        if within "$worst"; then
            echo "ok   VL-MoE ($how data): mpirun -np 2 vlmoe train --batch-size 12 = vlmoe train --batch-size 24 (losses within $worst)"
            pass=$((pass + 1))
        else
            echo "FAILED: VL-MoE ($how data) on 2 processes vs one: loss difference $worst"; fail=$((fail + 1))
        fi
    else
        tail -n 20 "$tmp/vq.log" "$tmp/m2$how.log" "$tmp/m1$how.log"; echo "FAILED: VL-MoE ($how data) under mpirun"
        fail=$((fail + 1))
    fi
done
common="train --model $tmp/vm.json --codebook $tmp/cb.safetensors --log-every-n-steps 1 --logs $tmp --mix 2,1,1 --save-every-n-steps 2"
ck="$tmp/mw4/checkpoints/step_2.safetensors"
if timeout 300 mpirun -np 4 --oversubscribe "$vl" $common --steps 2 --batch-size 4 --name mw4 > "$tmp/mw4.log" 2>&1 &&
   mkdir -p "$tmp/mr1/checkpoints" "$tmp/mr2/checkpoints" &&
   cp "$tmp/mw4/metrics.jsonl" "$tmp/mw4/params.json" "$tmp/mr1/" && cp "$tmp/mw4/metrics.jsonl" "$tmp/mw4/params.json" "$tmp/mr2/" &&
   cp "$ck" "${ck%.safetensors}.state.safetensors" "$tmp/mr1/checkpoints/" &&
   cp "$ck" "${ck%.safetensors}.state.safetensors" "$tmp/mr2/checkpoints/" &&
   timeout 300 "$vl" $common --steps 4 --batch-size 16 --name mr1 --resume latest > "$tmp/mr1.log" 2>&1 &&
   timeout 300 mpirun -np 2 --oversubscribe "$vl" $common --steps 4 --batch-size 8 --name mr2 --resume latest > "$tmp/mr2.log" 2>&1 &&
   timeout 300 "$vl" $common --steps 4 --batch-size 16 --name msolo > "$tmp/msolo.log" 2>&1; then
    w1=$(loss_diff mr1 msolo 4); w2=$(loss_diff mr2 msolo 4)
    if within "$w1" "$w2"; then
        echo "ok   VL-MoE saved by 4 processes, resumed by 1 and by 2: the losses of one process (within $w1, $w2)"
        pass=$((pass + 1))
    else
        echo "FAILED: VL-MoE saved by 4 processes, resumed by 1 / 2: loss differences $w1 / $w2"; fail=$((fail + 1))
    fi
else
    tail -n 20 "$tmp/mw4.log" "$tmp/mr1.log" "$tmp/mr2.log" "$tmp/msolo.log" 2>/dev/null
    echo "FAILED: VL-MoE resume across process counts"; fail=$((fail + 1))
fi
# a batch whose streams do not split on every process alike is refused, naming the numbers
if out=$(timeout 60 mpirun -np 4 --oversubscribe "$vl" train --model "$tmp/vm.json" --codebook "$tmp/cb.safetensors" \
         --mix 2,1,1 --batch-size 6 --steps 1 --logs "$tmp" --name mbad 2>&1); then
    echo "FAILED: VL-MoE --batch-size 6 --mix 2,1,1 on 4 processes ran"; fail=$((fail + 1))
elif printf '%s' "$out" | grep -q "batch-size 6 does not split 2:1:1.*4 processes.*global batch of 24"; then
    echo "ok   VL-MoE: --batch-size 6 with --mix 2,1,1 on 4 processes is refused, naming the numbers"; pass=$((pass + 1))
else
    printf '%s\n' "$out" | tail -n 5; echo "FAILED: VL-MoE bad split on 4 processes: no clear message"; fail=$((fail + 1))
fi
# a command that runs on one process refuses a launch of several, saying so
if out=$(timeout 60 mpirun -np 2 --oversubscribe "$vl" eval --model none.safetensors 2>&1); then
    echo "FAILED: mpirun -np 2 vlmoe eval succeeded"; fail=$((fail + 1))
elif printf '%s' "$out" | grep -q "this command runs on one process"; then
    echo "ok   mpirun -np 2 vlmoe eval is refused"; pass=$((pass + 1))
else
    printf '%s\n' "$out" | tail -n 5; echo "FAILED: mpirun -np 2 vlmoe eval: no clear message"; fail=$((fail + 1))
fi
# srun without an MPI plugin (--mpi=none) starts tasks that each find an MPI world of one: refused,
# saying how to launch; a batch script's own environment (the allocation's SLURM_NTASKS, no step)
# is one process and runs
if out=$(env SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 timeout 60 "$vl" train --model tiny \
         --steps 1 --logs "$tmp" --name srun 2>&1); then
    echo "FAILED: a task of 'srun -n 2 --mpi=none' trained alone"; fail=$((fail + 1))
elif printf '%s' "$out" | grep -q "one of 2 started by srun.*srun --mpi=pmix" && [ ! -e "$tmp/srun" ]; then
    echo "ok   a task of srun -n 2 whose MPI world is one process is refused before it writes anything"; pass=$((pass + 1))
else
    printf '%s\n' "$out" | tail -n 5; echo "FAILED: srun without an MPI plugin: no clear message"; fail=$((fail + 1))
fi
if out=$(env SLURM_PROCID=0 SLURM_NTASKS=4 timeout 60 "$vl" train --model tiny --steps 1 --batch-size 8 \
         --logs "$tmp" --name sbatch 2>&1); then
    echo "ok   vlmoe train in a Slurm batch script (no srun step) runs as one process"; pass=$((pass + 1))
else
    printf '%s\n' "$out" | tail -n 5; echo "FAILED: vlmoe train in a Slurm batch script was refused"; fail=$((fail + 1))
fi
rm -rf "$tmp"
echo "$name: $pass passed, $fail failed"
[ $fail -eq 0 ]
