#!/usr/bin/env bash
# scripts/setup.sh — one-time setup: installs the Debian packages ulysses needs (idempotent;
# as root, or through sudo) and builds build/libulysses.so in Release mode.
# Usage: scripts/setup.sh            (then: bin/ulysses train.lua)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  gcc g++ make cmake pkg-config
  luajit libluajit-5.1-dev lua-busted libreadline8
  libopenblas-dev
  libopenmpi-dev openmpi-bin
  libhdf5-openmpi-dev libhdf5-dev hdf5-tools
  gzip xz-utils ca-certificates
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${ULY_CMAKE_ARGS:-} >/dev/null
cmake --build build -j"$jobs"
echo "setup: built $(pwd)/build/libulysses.so"
