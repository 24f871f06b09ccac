#!/bin/bash
# bundle.sh [DIR]: the binaries that tests/gpu/device_checks.sh runs, copied into DIR (default
# build/gpubin) after `make CUDA=1 ... vlmoe cuda-check build/rel/bench/bench_step`, with
# DIR/libs.tar.xz: the shared libraries they load from this machine's distribution (oneDNN,
# OpenBLAS, cJSON, libarchive, MPI, ...), for a GPU machine of another distribution. CUDA's own
# libraries (cuBLAS, the runtime, NCCL) and the C library are left out: the GPU machine's must
# match its driver. device_checks.sh unpacks the archive and uses from it only what the
# machine lacks.
# CPUBENCH (environment): a folder holding bench_step, bench_peak, bench_sgemm and bench_int8
# built for the GPU machine's host CPU (say `make NATIVE=0 CFLAGS=-march=x86-64-v4 ...` in another
# checkout), copied into DIR/cpu for device_checks.sh's cpu_speed part; their libraries go into
# the archive too.
set -e
D=${1:-build/gpubin}
BINS="vlmoe build/cuda/tests/test_backend_ops build/cuda/tests/test_dist build/rel/bench/bench_step"
CPUBINS=
[ -n "$CPUBENCH" ] && CPUBINS="$CPUBENCH/bench_step $CPUBENCH/bench_peak $CPUBENCH/bench_sgemm $CPUBENCH/bench_int8"
mkdir -p "$D"
cp $BINS "$D/"
[ -n "$CPUBINS" ] && mkdir -p "$D/cpu" && cp $CPUBINS "$D/cpu/"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# every library the binaries load, by path, less CUDA's (wherever installed) and the C library's
ldd $BINS $CPUBINS | awk '$3 ~ /^\// { print $3 }' | sort -u |
    grep -vE '/usr/local/cuda|/(libc|libm|libpthread|librt|libdl|ld-linux[^/]*)\.so[^/]*$' |
    grep -vE '/lib(cuda|nvidia-[^/]*|nccl|cublas|cublasLt|cudart)\.so[^/]*$' |
    while read -r f; do cp -L "$f" "$tmp/"; done
tar -C "$tmp" -cf - . | xz -T0 -6 >"$D/libs.tar.xz"
echo "$D: $(ls "$D" | tr '\n' ' ')($(ls "$tmp" | wc -l) libraries," \
    "$(du -h "$D/libs.tar.xz" | cut -f1) packed)"
