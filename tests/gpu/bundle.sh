#!/bin/bash
# bundle.sh [DIR]: the binaries that tests/gpu/device_checks.sh runs, copied into DIR (default
# build/gpubin) after `make CUDA=1 ... vlmoe cuda-check build/rel/bench/bench_step`, with
# DIR/libs.tar.xz: the shared libraries they load from this machine's distribution (oneDNN,
# OpenBLAS, cJSON, libarchive, MPI, ...), for a GPU machine of another distribution. CUDA's own
# libraries (cuBLAS, the runtime, NCCL) and the C library are left out: the GPU machine's must
# match its driver. device_checks.sh unpacks the archive and uses from it only what the
# machine lacks.
set -e
D=${1:-build/gpubin}
BINS="vlmoe build/cuda/tests/test_backend_ops build/cuda/tests/test_dist build/rel/bench/bench_step"
mkdir -p "$D"
cp $BINS "$D/"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# every library the binaries load, by path, less CUDA's (wherever installed) and the C library's
ldd $BINS | awk '$3 ~ /^\// { print $3 }' | sort -u |
    grep -vE '/usr/local/cuda|/(libc|libm|libpthread|librt|libdl|ld-linux[^/]*)\.so[^/]*$' |
    grep -vE '/lib(cuda|nvidia-[^/]*|nccl|cublas|cublasLt|cudart)\.so[^/]*$' |
    while read -r f; do cp -L "$f" "$tmp/"; done
tar -C "$tmp" -cf - . | xz -T0 -6 >"$D/libs.tar.xz"
echo "$D: $(ls "$D" | tr '\n' ' ')($(ls "$tmp" | wc -l) libraries, $(du -h "$D/libs.tar.xz" | cut -f1) packed)"
