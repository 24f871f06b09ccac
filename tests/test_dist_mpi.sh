#!/bin/sh
# test_dist_mpi.sh: tests/test_dist under mpirun, on 2 ranks and on 3 (oversubscribed on a small
# machine): every collective of src/dist/mpi.c with rank-dependent values, checked on every rank.
# Run by tests/run.sh on the optimised build only (Open MPI's own allocations look like leaks to
# LeakSanitizer); skipped, saying why, when mpirun is absent or the build has no MPI. Closes with
# "test_dist_mpi: N passed, N failed" (the ranks' checks summed). Usage: test_dist_mpi.sh RELDIR
bin=${1:-build/rel}/tests/test_dist
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
for np in 2 3; do
    out=$(timeout 60 mpirun -np $np --oversubscribe "$bin" 2>&1); rc=$?
    p=0; f=0; ranks=0
    for line in $(printf '%s\n' "$out" | grep -E '^test_dist: [0-9]+ passed, [0-9]+ failed$' | sed -E 's/^test_dist: ([0-9]+) passed, ([0-9]+) failed$/\1:\2/'); do
        p=$((p + ${line%%:*})); f=$((f + ${line##*:})); ranks=$((ranks + 1))
    done
    if [ $rc -ne 0 ] || [ $ranks -ne $np ]; then
        printf '%s\n' "$out" | tail -n 40
        echo "FAILED: mpirun -np $np $bin (exit $rc, $ranks of $np ranks reported)"
        [ "$f" = 0 ] && f=1
    else
        echo "ok   mpirun -np $np $bin ($p checks on $np ranks)"
    fi
    pass=$((pass + p)); fail=$((fail + f))
done
echo "$name: $pass passed, $fail failed"
[ $fail -eq 0 ]
