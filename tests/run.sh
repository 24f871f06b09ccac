#!/bin/sh
# run.sh: runs every test binary of the optimised build, then of the sanitizer build, and totals
# them into one closing line "N passed, N failed"; with FUZZDIR, each libFuzzer target in it then
# runs for $FUZZ_TIME seconds (fuzz/run.sh) and counts as one check. tests/check_exports.sh (the
# shared library $VLMOE_SO, default libvlmoe.so, exports exactly include/vlmoe.h) counts as one too,
# tests/test_dist_mpi.sh (test_dist under mpirun) adds the checks of its ranks, and the Python tests
# of the benchmark scripts (tests/py/test_*.py, Debian's python3) theirs.
# Usage: run.sh RELDIR ASANDIR VLMOE ASANVLMOE [FUZZDIR]
rel=$1; asan=$2; fuzz=$5; export VLMOE_BIN=$3 VLMOE_BIN_ASAN=$4
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# tiny tests with busy-waiting OpenMP threads slow down a hundredfold when another process holds a core
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
pass=0; fail=0; bad=""
# tally NAME RC: adds the "NAME: N passed, N failed" line of $out to the totals (a non-zero exit
# with no failure counted counts as one)
tally() {
    line=$(printf '%s\n' "$out" | grep -E '^[a-z_0-9]+: [0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    p=$(printf '%s' "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/'); p=${p:-0}
    f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed/\1/'); f=${f:-0}
    if [ "$2" -ne 0 ] && [ "$f" = 0 ]; then f=1; fi
    pass=$((pass + p)); fail=$((fail + f))
    if [ "$2" -ne 0 ]; then
        bad="$bad $1"; printf '%s\n' "$out" | tail -n 40
        echo "FAILED: $1 (exit $2)"
    else
        echo "ok   $1 ($p checks)"
    fi
}
# CUDADIR (set by make test when nvcc is present): tests linked against the CUDA backend
for dir in "$rel" "$asan" ${CUDADIR:+"$CUDADIR"}; do
    for t in "$dir"/tests/test_* "$dir"/tests/hostile/test_*; do
        [ -x "$t" ] || continue
        out=$("$t" 2>&1); tally "$t" $?
    done
done
# the Python tests of the benchmark scripts (Debian's python3)
for t in tests/py/test_*.py; do
    out=$(/usr/bin/python3 "$t" 2>&1); tally "$t" $?
done
if out=$(./tests/check_exports.sh "${VLMOE_SO:-libvlmoe.so}" include/vlmoe.h 2>&1); then
    pass=$((pass + 1)); printf '%s\n' "$out" | tail -n 1 | sed 's/^check_exports: /ok   /'
else
    fail=$((fail + 1)); bad="$bad tests/check_exports.sh"; printf '%s\n' "$out"
    echo "FAILED: tests/check_exports.sh"
fi
# the process groups under mpirun (2 and 3 ranks), optimised build only: Open MPI's allocations
# look like leaks to LeakSanitizer (the ASan test_dist covers the MPI world of one, suppressed)
out=$(./tests/test_dist_mpi.sh "$rel" 2>&1); rc=$?
line=$(printf '%s\n' "$out" | grep -E '^test_dist_mpi: [0-9]+ passed, [0-9]+ failed$' | tail -n 1)
p=$(printf '%s' "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/'); p=${p:-0}
f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed/\1/'); f=${f:-0}
if [ $rc -ne 0 ] && [ "$f" = 0 ]; then f=1; fi
pass=$((pass + p)); fail=$((fail + f))
printf '%s\n' "$out" | grep -v '^test_dist_mpi: [0-9]'
[ $rc -ne 0 ] && { bad="$bad tests/test_dist_mpi.sh"; echo "FAILED: tests/test_dist_mpi.sh"; }
for t in ${fuzz:+"$fuzz"/fuzz_*}; do
    [ -x "$t" ] || continue
    if ./fuzz/run.sh "${FUZZ_TIME:-15}" "$t"; then pass=$((pass + 1)); else fail=$((fail + 1)); bad="$bad $t"; fi
done
echo "$pass passed, $fail failed"
[ -z "$bad" ]
