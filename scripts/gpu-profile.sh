#!/usr/bin/env bash
# scripts/gpu-profile.sh — ncu on the kernels that set our GPU speed, for a device session after
# scripts/gpu-check.sh (it needs the build-gpu/ libraries that check built or took from
# .gpu-prebuilt): the fused attention's forward, dK/dV and dQ kernels at D 64 and 128 (N 4096; at
# D 64 also the 128-row / 128-key variants, the TMA forward and the warp-specialised kernels),
# and every kernel of one f32 and one bf16 4096^3 matmul, each the second of two runs
# (scripts/gpu-profile.lua opens a profiler range around it: --profile-from-start off, so warm-up,
# cuBLASLt's heuristic and the wgmma self-check stay out). Writes the ncu reports and a summary
# (duration, registers, occupancy, issue-slot use, stall reasons) to $1, else $OUT, else
# build-gpu/profile/. About a minute on an H200. Clocks are left alone (--clock-control none).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-build-gpu/profile}}
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
export ULY_LIB=${ULY_LIB:-build-gpu/libulysses.so} ULY_CUDA_LIB=${ULY_CUDA_LIB:-build-gpu/libulysses_cuda.so}
command -v ncu >/dev/null || { echo "gpu-profile: ncu not found"; exit 1; }
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats)
# and every stall reason's cycles per issued instruction (the section prints only the top one), and
# where the warps stall (SourceCounters: the sampled stalls by instruction; the fused attention is
# built with -lineinfo, so by source line too); a run that ncu refuses for these (names differ
# between versions) is repeated without them
stalls=(--metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' --section SourceCounters)
profile() { # profile NAME KERNEL-REGEX ENV... -- ARGS...
  local name=$1 kernels=$2; shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done   # (variants: 64-query dK/dV, 128-row forward and dQ)
  shift
  local extra rc
  for extra in with without; do
    local opts=("${sections[@]}")
    [ $extra = with ] && opts+=("${stalls[@]}")
    env "${envs[@]}" timeout 120 ncu --clock-control none --profile-from-start off -k "regex:$kernels" "${opts[@]}" \
      luajit scripts/gpu-profile.lua "$@" >"$out/ncu-$name.txt" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $extra = with ] && grep -q "ERROR" "$out/ncu-$name.txt" || break
  done
  echo "== $name (exit $rc${extra:+, stall metrics $extra})"
  grep -E "^  [a-z_]|^  void|Duration|Registers Per Thread|Theoretical Occupancy|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|issue_stalled" \
    "$out/ncu-$name.txt" | grep -vE "issue_stalled.* 0(\.0[0-9]*)?$" | sed -E 's/\(float \*.*$//; s/ +/ /g' | cut -c1-160
}
{
  profile attention-64 'fa_' -- attention 64
  profile attention-128 'fa_' -- attention 128
  profile attention-64-rows128 'fa_' ULY_CUDA_ATTN_DKV=rows128 ULY_CUDA_ATTN_DQ=rows128 ULY_CUDA_ATTN_FWD=rows128 -- attention 64   # 128-row forward and dQ, 128-key dK/dV
  profile attention-64-tma 'fa_forward_tma' ULY_CUDA_ATTN_FWD=tma -- attention 64   # the forward with TMA loads
  profile attention-64-ws '_ws' ULY_CUDA_ATTN_FWD=ws ULY_CUDA_ATTN_DKV=ws ULY_CUDA_ATTN_DQ=ws -- attention 64   # the warp-specialised kernels
  profile gemm-f32 '.' -- gemm f32
  profile gemm-bf16 '.' -- gemm bf16
} | tee "$out/profile-summary.txt"
