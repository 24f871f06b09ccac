#!/bin/sh
# run.sh: runs each libFuzzer target for SECONDS on its corpus (build/fuzz/corpus/<target>, kept
# between runs) and seeds (build/fuzz/seeds/<target>, from fuzz/seeds.c). A finding leaves its
# input in build/fuzz/artifacts/ and fails the run; reproduce with `build/fuzz/<target> FILE`.
# Usage: fuzz/run.sh SECONDS TARGET...
secs=$1; shift
root=$(dirname "$0")/../build/fuzz
mkdir -p "$root/artifacts"
status=0
for t in "$@"; do
    name=$(basename "$t")
    mkdir -p "$root/corpus/$name"
    log="$root/$name.log"
    if "$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$root/artifacts/$name-" "$root/corpus/$name" "$root/seeds/$name" >"$log" 2>&1; then
        runs=$(grep -E '^stat::number_of_executed_units' "$log" | sed -E 's/.*: *//')
        echo "ok   $name: ${runs:-?} inputs in ${secs}s, corpus $(ls "$root/corpus/$name" | wc -l) files"
    else
        tail -n 40 "$log"
        echo "FAILED: $name (log $log; the input is in $root/artifacts/)"
        status=1
    fi
done
exit $status
