#!/usr/bin/env bash
# scripts/gpu-debs.sh — collects, on this machine (Debian 12, package registries reachable), the
# .deb files that scripts/gpu-check.sh unpacks on a GPU machine whose image lacks them (it has
# nvcc, CMake and a compiler, but no LuaJIT, busted, OpenBLAS or Open MPI, and no network):
# LuaJIT, busted and its Lua modules, OpenBLAS, and Open MPI with its libraries (~20 MB).
# Usage: scripts/gpu-debs.sh [DIR]      (default .gpu-debs/, git-ignored; pass it in the device
#        tool's `carry`, then run scripts/gpu-check.sh there)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-debs}
mkdir -p "$dir"
packages=(
  luajit libluajit-5.1-2 libluajit-5.1-common
  lua-busted lua-cliargs lua-dkjson lua-filesystem lua-luassert lua-mediator lua-penlight lua-say lua-system lua-term
  libopenblas0 libopenblas0-pthread libopenblas-dev libopenblas-pthread-dev libgfortran5
  openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1
  libhwloc15 libhwloc-plugins libibverbs1 libnl-3-200 libnl-route-3-200 libpmix2 libpsm-infinipath1 libpsm2-2
  libucx0 librdmacm1 libxnvctrl0 libmunge2
)
(cd "$dir" && apt-get download "${packages[@]}")
echo "gpu-debs: $(ls "$dir"/*.deb | wc -l) packages, $(du -sh "$dir" | cut -f1) in $dir"
