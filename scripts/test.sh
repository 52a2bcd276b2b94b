#!/usr/bin/env bash
# scripts/test.sh — the whole test suite, the one command the README and CI run.
#  1. builds the Release library (build/) and a Debug + AddressSanitizer/UBSan/LeakSanitizer one
#     (build-asan/);
#  2. runs every busted spec (spec/*_spec.lua, under LuaJIT) against the Release build, then the
#     #mpi specs under mpirun with 1, 2 and 4 ranks (Release build only), then the CUDA backend's
#     kernels on the CPU emulator (spec/device_spec.lua and the #mpi device cases, over host
#     staging and over the emulator's NCCL; the fused attention once more with warps run one at a
#     time, and the TMA kernels with loads landing at issue), then the plain specs and the
#     emulated CUDA kernels (warps one at a time, stream work as late as its waits allow) against
#     the sanitizer build;
#  3. ends with one line "N passed, N failed" over all runs; exits non-zero on any failure,
#     error or crash.
# ULY_SEED=<n> replays the random inputs of a run (the seed is printed first).
set -uo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
export ULY_SEED="${ULY_SEED:-$(( $(date +%s) % 100000 ))}"
# the specs run the built-in attention kernels: a tuned choice in the user's cache
# (tools/tune_attention.lua) would change what the device specs compare (their own spec sets it)
export ULY_CUDA_TUNED=0
echo "test: seed $ULY_SEED (replay with ULY_SEED=$ULY_SEED scripts/test.sh)"

summary=$(mktemp)
trap 'rm -f "$summary"' EXIT
export ULY_SUMMARY_FILE="$summary"
crashed=0

build() { # dir, cmake args...
  local dir=$1; shift
  cmake -S . -B "$dir" "$@" >/dev/null && cmake --build "$dir" -j"$jobs" >/dev/null
}

# one busted run; a run that dies before its closing line counts as one failure
# (SPEC_ARGS, when set, are extra busted arguments: spec files, --filter, --run)
run_specs() { # label, env...
  local label=$1; shift
  echo "== specs: $label"
  local before after
  before=$(wc -l <"$summary")
  env "$@" luajit /usr/bin/busted ${SPEC_ARGS:-}
  local rc=$?
  after=$(wc -l <"$summary")
  if [ "$after" -eq "$before" ] || { [ $rc -ne 0 ] && ! tail -1 "$summary" | grep -q ' [1-9]'; }; then
    echo "test: the $label run ended abnormally (exit code $rc)"
    crashed=$((crashed + 1))
  fi
}

# The #mpi specs (`busted --run=mpi`, see .busted) under mpirun: every rank runs them, rank 0
# prints the closing line and writes the summary, the other ranks print only their failures,
# and a failure on any rank makes mpirun exit non-zero, which counts as a failure here. Run
# against the Release build only: Open MPI under AddressSanitizer reports its own allocations
# and the noise would hide real findings (the plain specs cover core/comm*.c as a world of one rank).
mpi_env=(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
         OMPI_MCA_hwloc_base_binding_policy=none OMPI_MCA_mpi_yield_when_idle=1
         OMPI_MCA_btl_base_warn_component_unused=0)
run_mpi_specs() {
  if ! command -v mpirun >/dev/null 2>&1; then echo "== #mpi specs skipped: no mpirun"; return; fi
  if ! LUA_PATH='lua/?.lua;lua/?/init.lua;;' luajit -e "os.exit(require('ulysses').has('mpi') and 0 or 1)"; then
    echo "== #mpi specs skipped: libulysses was built without MPI"; return
  fi
  local run np sp before after rc
  # ranks:sp — SP over 1, 2 and 4 ranks, then DP 2 x SP 2 (ULY_TEST_SP sets the grid of the specs)
  for run in 1:1 2:2 4:4 4:2; do
    np=${run%:*} sp=${run#*:}
    echo "== specs: #mpi on $np ranks, sequence-parallel groups of $sp"
    before=$(wc -l <"$summary")
    env "${mpi_env[@]}" ULY_TEST_SP="$sp" timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none \
      --mca mpi_yield_when_idle 1 -x ULY_TEST_SP -np "$np" luajit /usr/bin/busted --run=mpi
    rc=$?
    after=$(wc -l <"$summary")
    if [ "$after" -eq "$before" ] || { [ $rc -ne 0 ] && ! tail -1 "$summary" | grep -q ' [1-9]'; }; then
      echo "test: the #mpi run on $np ranks (sp $sp) failed on some rank or ended abnormally (exit code $rc)"
      crashed=$((crashed + 1))
    fi
  done
}

if ! build build -DCMAKE_BUILD_TYPE=Release -DULY_CUDA=AUTO; then echo "test: Release build failed"; echo "0 passed, 1 failed"; exit 1; fi
run_specs "Release"
run_mpi_specs

# The CUDA backend's own kernels (kernels/cuda/*.cu) on the CPU emulator (kernels/cuda/emu/,
# build/libulysses_cuemu.so): the device suite, then the device cases of the #mpi specs on 2 and
# 4 ranks, sharing one GPU (exchanges staged through host memory) and each with its own (NCCL)
if [ -e build/libulysses_cuemu.so ]; then
  SPEC_ARGS="spec/device_spec.lua" run_specs "CUDA kernels on the emulator" ULY_TEST_DEVICE=emu ULY_CUDA_ATTN_CHUNK=16 \
    ULY_CUDA_LIB=build/libulysses_cuemu.so
  # one warp at a time with cp.async landing at issue: a missing __syncthreads before a shared tile
  # is overwritten shows here (the sanitizer run below lands them at the wait, also warp by warp)
  SPEC_ARGS="--filter=fused spec/device_spec.lua" run_specs "fused attention, warps one at a time, eager cp.async" \
    ULY_TEST_DEVICE=emu ULY_EMU_ORDER=reverse ULY_EMU_ASYNC=eager ULY_CUDA_LIB=build/libulysses_cuemu.so
  # the fused kernels on Hopper's wgmma (every D = 64 / 128 forward, dQ and dK/dV), warps one at a time
  SPEC_ARGS="--filter=fused spec/device_spec.lua" run_specs "fused attention on wgmma, warps one at a time" \
    ULY_TEST_DEVICE=emu ULY_EMU_ORDER=reverse ULY_CUDA_ATTN_WGMMA=1 ULY_TEST_WGMMA=1 ULY_CUDA_LIB=build/libulysses_cuemu.so
  # the TMA kernels on wgmma with loads landing at issue: a stage given back to the producer before
  # the wgmma reading it was waited for is overwritten under it (a wgmma wait lets the others run)
  SPEC_ARGS="--filter=on.TMA spec/device_spec.lua" run_specs "TMA kernels on wgmma, loads landing at issue" \
    ULY_TEST_DEVICE=emu ULY_EMU_ASYNC=eager ULY_CUDA_ATTN_WGMMA=1 ULY_TEST_WGMMA=1 ULY_CUDA_LIB=build/libulysses_cuemu.so
  if command -v mpirun >/dev/null 2>&1; then
    # ranks:gpus — ranks sharing the one emulated GPU (exchanges staged through host memory), then
    # every rank its own emulated GPU (the NCCL path, over the emulator's NCCL) with lazy streams
    for run in 2:shared 4:shared 2:own 4:own; do
      np=${run%:*} gpus=${run#*:} streams=$([ "$gpus" = own ] && echo lazy || echo now)
      echo "== specs: #mpi device cases on $np ranks, CUDA kernels on the emulator, GPUs $gpus, streams $streams"
      before=$(wc -l <"$summary")
      env "${mpi_env[@]}" ULY_TEST_SP="$np" ULY_TEST_DEVICE=emu ULY_CUDA_LIB=build/libulysses_cuemu.so \
        ULY_EMU_GPUS="$gpus" ULY_EMU_STREAMS="$streams" timeout 300 \
        mpirun --allow-run-as-root --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -x ULY_TEST_SP \
        -x ULY_TEST_DEVICE -x ULY_CUDA_LIB -x ULY_EMU_GPUS -x ULY_EMU_STREAMS -np "$np" luajit /usr/bin/busted \
        --run=mpi --filter=device spec/ulysses_spec.lua spec/dist_spec.lua spec/grad_sync_spec.lua spec/plan_spec.lua \
        spec/zero_spec.lua
      rc=$?
      after=$(wc -l <"$summary")
      if [ "$after" -eq "$before" ] || { [ $rc -ne 0 ] && ! tail -1 "$summary" | grep -q ' [1-9]'; }; then
        echo "test: the emulated #mpi device run on $np ranks ($gpus GPUs) failed or ended abnormally (exit code $rc)"
        crashed=$((crashed + 1))
      fi
    done
  fi
else
  echo "== CUDA emulator specs skipped: no build/libulysses_cuemu.so (needs a C++ compiler)"
fi

if build build-asan -DCMAKE_BUILD_TYPE=Debug -DULY_SANITIZE=ON -DULY_CUDA=OFF; then
  asan=$(gcc -print-file-name=libasan.so)
  # #release_only specs check a whole benchmark process, the compiler's output or the planner's
  # numbers: once, above
  unsanitized=--exclude-tags=mpi,gpu,release_only
  SPEC_ARGS="$unsanitized" run_specs "Debug + sanitizers" ULY_LIB=build-asan/libulysses.so LD_PRELOAD="$asan" \
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1
  # the CUDA kernels on the emulator under the sanitizers: device memory is host memory there,
  # so an out-of-bounds access in a kernel is caught; warps run one at a time, the last first, so
  # a shared-memory read that lacks a __syncthreads (or a cp.async wait) after its write fails;
  # stream work runs only when waited for, so a host read or free without its wait fails too
  if [ -e build-asan/libulysses_cuemu.so ]; then
    SPEC_ARGS="$unsanitized spec/device_spec.lua" run_specs "CUDA kernels on the emulator + sanitizers, warps one at a time" \
      ULY_LIB=build-asan/libulysses.so LD_PRELOAD="$asan" ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
      UBSAN_OPTIONS=print_stacktrace=1 ULY_TEST_DEVICE=emu ULY_CUDA_LIB=build-asan/libulysses_cuemu.so \
      ULY_CUDA_ATTN_CHUNK=16 ULY_EMU_ORDER=reverse ULY_EMU_STREAMS=lazy
  fi
else
  echo "test: sanitizer build failed"; crashed=$((crashed + 1))
fi

read -r passed failed < <(awk '{p += $1; f += $2} END {print p + 0, f + 0}' "$summary")
failed=$((failed + crashed))
echo
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
