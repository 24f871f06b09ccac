#!/bin/sh
# deps.sh: installs the Debian packages vlmoe needs to build, test and benchmark, if missing.
# Called by `make` (once per machine; a stamp file in build/ remembers success). Needs root or
# sudo for apt-get; otherwise it prints the apt-get line to run.
set -e
PKGS="gcc make pkg-config libopenblas-openmp-dev libcjson-dev python3 python3-numpy python3-torch"
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
