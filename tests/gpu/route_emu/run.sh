#!/bin/sh
# run.sh: checks the logic of src/cuda/route_cuda.cu's kernels without a GPU: the file with its
# launches rewritten as loops over the grid (route_emu.h provides the rest), compiled for the
# host, against the CPU table's route.c on random shapes (main.cpp). Needs libvlmoe.a (`make`);
# run from the repository root. Exits non-zero on a difference.
set -e
out=${TMPDIR:-/tmp}/vlmoe-route-emu
mkdir -p "$out"
sed -e 's|#include <cub/cub.cuh>|#include "route_emu.h"|' -e 's|#include "cuda/cuda_internal.cuh"||' \
    -e 's/\([a-z_0-9]*\)<<<1, T, 0, st>>>(/emu_for(1, 1) \1(/' \
    -e 's/\([a-z_0-9]*\)<<<\(.*\), T, 0, st>>>(/emu_for(\2, T) \1(/' src/cuda/route_cuda.cu >"$out/route_cuda_emu.cpp"
if grep -q '<<<' "$out/route_cuda_emu.cpp"; then
    echo "run.sh: a launch in src/cuda/route_cuda.cu is not of the form k<<<blocks, T, 0, st>>>(...)" >&2
    exit 1
fi
LIBS=$(make -s --eval 'print-%: ; @echo $($*)' print-LIBS)
${CXX:-g++} -std=c++17 -O1 -Wall -Iinclude -Isrc -I/usr/include/x86_64-linux-gnu/openblas-openmp \
    -Itests/gpu/route_emu -I"$out" tests/gpu/route_emu/main.cpp -o "$out/route_emu" libvlmoe.a $LIBS
"$out/route_emu"
