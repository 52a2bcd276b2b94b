#!/usr/bin/env bash
# scripts/source-stamp.sh — prints one hash of everything the C and CUDA libraries are built from
# (CMakeLists.txt, core/, kernels/), the same on any machine: gpu-check.sh compares it with the
# stamp that gpu-prebuild.sh left beside prebuilt libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
find CMakeLists.txt core kernels -type f | LC_ALL=C sort | while read -r f; do printf '%s\n' "$f"; cat "$f"; done | sha1sum | cut -c1-16
