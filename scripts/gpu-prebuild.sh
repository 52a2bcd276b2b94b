#!/usr/bin/env bash
# scripts/gpu-prebuild.sh — builds, on this machine (nvcc, no GPU), the two libraries that
# scripts/gpu-check.sh would otherwise build on the GPU machine, where a lease's minutes are short
# (the fused attention alone takes nvcc a minute and more): libulysses.so without -march=native
# and without HDF5 (the GPU image has neither this CPU nor libhdf5), and libulysses_cuda.so, fat
# for sm_80 and sm_90. They go to .gpu-prebuilt/ (git-ignored) with a stamp of the sources they
# were built from; carry that folder to the GPU machine: gpu-check.sh uses them when the stamp
# matches its checkout and they load there, and builds otherwise.
# Usage: scripts/gpu-prebuild.sh [DIR]     (default .gpu-prebuilt/)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-prebuilt}
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build-gpu-prebuilt -DCMAKE_BUILD_TYPE=Release -DULY_CUDA=ON -DULY_HDF5=OFF -DULY_NATIVE=OFF \
  -DULY_CUDA_EMU=OFF >/dev/null
cmake --build build-gpu-prebuilt -j"$jobs"
mkdir -p "$dir"
cp build-gpu-prebuilt/libulysses.so build-gpu-prebuilt/libulysses_cuda.so "$dir"/
scripts/source-stamp.sh >"$dir/STAMP"
echo "gpu-prebuild: $(du -sh "$dir" | cut -f1) in $dir, sources $(cat "$dir/STAMP")"
