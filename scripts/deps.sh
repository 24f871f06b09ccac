#!/bin/sh
# deps.sh: installs the Debian packages vlmoe needs, if missing. `deps.sh build` (what `make`
# needs: compiler, Open MPI, OpenBLAS, oneDNN, cJSON, image and archive libraries, utf8proc,
# SentencePiece and g++ for its shim) or `deps.sh test` (plus what the tests' PyTorch/PIL reference
# generators and the fuzz targets need).
# Called by the Makefile, which remembers success in a stamp file. Needs root or sudo for apt-get;
# otherwise it prints the command.
set -e
# sentencepiece (test list): spm_train / spm_encode make and check the SentencePiece test models.
# Open MPI (mpirun and libmpi) is in the build list so src/dist/mpi.c is always built and tested
BUILD="gcc make pkg-config openmpi-bin libopenmpi-dev libopenblas-openmp-dev libdnnl-dev libcjson-dev zlib1g-dev libpcre2-dev libjpeg62-turbo-dev libpng-dev libwebp-dev libarchive-dev libutf8proc-dev libsentencepiece-dev g++ libjs-chart.js"
# libjs-chart.js: Chart.js, inlined into `vlmoe report`'s page (a single file, ~200 KB)
# clang and its compiler-rt (libFuzzer, sanitizer runtimes) build the fuzz targets (make fuzz);
# chromium renders the report page headless in tests/test_report.c
TEST="python3 python3-numpy python3-torch python3-pil python3-regex sentencepiece clang libclang-rt-dev chromium"
case "${1:-build}" in
    build) PKGS="$BUILD" ;;
    test) PKGS="$BUILD $TEST" ;;
    *) echo "usage: deps.sh build|test" >&2; exit 2 ;;
esac
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "vlmoe: installing missing Debian packages:$missing" >&2
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
        echo "vlmoe: run as root: apt-get install -y$missing" >&2; exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
