#!/usr/bin/env bash
# scripts/gpu-check.sh — the one-script GPU check (issue 6), for a machine with an NVIDIA GPU:
#  1. prints nvidia-smi and checks the tools the build and specs need (nvcc, cmake, a C compiler,
#     OpenBLAS headers, luajit, busted); .deb files carried in $ULY_GPU_DEBS (default .gpu-debs/,
#     collected here with scripts/gpu-debs.sh) are unpacked first, for images that lack them;
#  2. builds build-gpu/ with -DULY_CUDA=ON (libulysses.so + libulysses_cuda.so);
#  3. runs the #gpu specs (`busted --run=gpu`, see .busted) against that build, then the device
#     suite against the real CUDA backend (spec/device_spec.lua with ULY_TEST_DEVICE=cuda: every
#     op's values and gradients vs the CPU, GPT and Llama training steps, pool, checkpoints) and a
#     2-rank Ulysses step sharing the one GPU (host-staged exchanges), the bf16 attention kernels
#     under compute-sanitizer (racecheck, memcheck; scripts/gpu-sanitize.lua), then bench/gpu.lua;
#  4. writes a report (date, device, driver/runtime versions, build time, spec summaries, the
#     benchmark table) to $1, else $OUT/gpu-report.txt, else build-gpu/gpu-report.txt, as it
#     goes (a run cut short by a time limit keeps its report up to there).
# Exits non-zero when a tool is missing, the build fails or any #gpu spec fails.
# ULY_GPU_CHECK_EMULATE=1 runs the same script on a machine without a GPU against the CUDA
# emulator (build-gpu/libulysses_cuemu.so, bench/gpu.lua --quick): a rehearsal of the script.
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-${OUT:+$OUT/gpu-report.txt}}
report=${report:-build-gpu/gpu-report.txt}
mkdir -p "$(dirname "$report")" build-gpu
jobs=$(nproc 2>/dev/null || echo 2)
# the report is written as the check goes, so a run stopped by a time limit still leaves what it did
log=$report
check_start=$(date +%s)
emulate=${ULY_GPU_CHECK_EMULATE:-0}
# the sources' stamp names what was checked even where the copy's git metadata is not current
echo "ulysses GPU check, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
  "sources $(scripts/source-stamp.sh 2>/dev/null || echo '?')" >"$log"
say() { echo "$*" | tee -a "$log"; }
finish() { # status line, exit code
  say "gpu-check: $1 ($(date -u '+%H:%M:%S UTC'))"
  echo "gpu-check: report written to $report"
  exit "$2"
}

# link_alternatives DEB... — the links each package's postinst makes with update-alternatives
# (dpkg -x runs no scripts): /usr/bin/mpirun and mpicc, libopenblas.so, cblas.h, mpi.h's folder
link_alternatives() {
  local ctl; ctl=$(mktemp -d)
  for f in "$@"; do
    rm -rf "${ctl:?}"/*; dpkg -e "$f" "$ctl" 2>/dev/null && [ -f "$ctl/postinst" ] || continue
    # join continued lines, then read each `--install|--slave LINK NAME PATH`
    sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$ctl/postinst" |
      grep -o -E -- '--(install|slave)[[:space:]]+[^[:space:]]+[[:space:]]+[^[:space:]]+[[:space:]]+[^[:space:]]+' |
      while read -r _ link _ target; do
        [ -e "$link" ] || [ -L "$link" ] || [ ! -e "$target" ] || { mkdir -p "$(dirname "$link")" && ln -s "$target" "$link"; }
      done
  done
  rm -rf "$ctl"
}
debs=${ULY_GPU_DEBS:-.gpu-debs}
if compgen -G "$debs/*.deb" >/dev/null; then
  unpacked=()
  for f in "$debs"/*.deb; do
    # the image's own libgfortran5 (newer) is kept; the rest replaces what the image has: Open
    # MPI 4.1 crashes in mpirun on Ubuntu 24.04's PMIx 5 (seen on an H200 machine, 2026-12-04)
    pkg=$(dpkg-deb -f "$f" Package 2>/dev/null)
    case " ${ULY_GPU_DEBS_KEEP:-libgfortran5} " in *" $pkg "*)
      dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' && continue;; esac
    dpkg -x "$f" / || finish "cannot unpack $f" 1
    unpacked+=("$f")
  done
  [ ${#unpacked[@]} -eq 0 ] || link_alternatives "${unpacked[@]}"
  ldconfig 2>/dev/null
  say "unpacked ${#unpacked[@]} of $(ls "$debs"/*.deb | wc -l) packages from $debs/"
fi
export PATH="/usr/local/cuda/bin:$PATH"
export ULY_SEED="${ULY_SEED:-$(( $(date +%s) % 100000 ))}"

say "== nvidia-smi"
if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 | tee -a "$log"
  say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
else say "nvidia-smi: not found"; fi

missing=()
for tool in nvcc cmake cc luajit; do command -v "$tool" >/dev/null || missing+=("$tool"); done
[ -e /usr/bin/busted ] || missing+=("busted (/usr/bin/busted)")
compgen -G "/usr/include/*/openblas*/cblas.h" >/dev/null || [ -e /usr/include/cblas.h ] \
  || missing+=("OpenBLAS headers (libopenblas-dev)")
[ ${#missing[@]} -eq 0 ] || finish "missing: ${missing[*]} — carry them as .deb files in $debs/" 1
say "== nvcc: $(nvcc --version | tail -2 | head -1)"

say "== build (build-gpu/, ULY_CUDA=ON)"
start=$(date +%s)
# libraries built ahead on a machine without a GPU (scripts/gpu-prebuild.sh) are used when they
# were built from these very sources and load here; else (or in a rehearsal) the build runs here
prebuilt=${ULY_GPU_PREBUILT:-.gpu-prebuilt}
built=""
if [ "$emulate" != 1 ] && [ -f "$prebuilt/STAMP" ] && [ -f "$prebuilt/libulysses_cuda.so" ]; then
  if [ "$(cat "$prebuilt/STAMP")" != "$(scripts/source-stamp.sh)" ]; then
    say "$prebuilt/: built from other sources (stamp $(cat "$prebuilt/STAMP")): building here"
  else
    cp "$prebuilt/libulysses.so" "$prebuilt/libulysses_cuda.so" build-gpu/
    if ULY_LIB=build-gpu/libulysses.so ULY_CUDA_LIB=build-gpu/libulysses_cuda.so LUA_PATH='lua/?.lua;lua/?/init.lua;;' \
         luajit -e 'assert(require("ulysses").cuda.lib())' >build-gpu/build.log 2>&1; then
      built=prebuilt; say "build: the libraries in $prebuilt/ (stamp $(cat "$prebuilt/STAMP")) load here: not rebuilt"
    else
      say "$prebuilt/: the libraries do not load here ($(tail -1 build-gpu/build.log)): building here"
    fi
  fi
fi
if [ -z "$built" ] && ! { cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DULY_CUDA=ON >build-gpu/build.log 2>&1 &&
       cmake --build build-gpu -j"$jobs" >>build-gpu/build.log 2>&1; }; then
  tail -40 build-gpu/build.log | tee -a "$log"; finish "build failed (build-gpu/build.log)" 1
fi
say "build: $(( $(date +%s) - start )) s"

say "== devices and versions"
export ULY_LIB=build-gpu/libulysses.so ULY_CUDA_LIB=build-gpu/libulysses_cuda.so
test_device=cuda bench_args="" tune_args=""
# the tuned attention choice (tools/tune_attention.lua) lives beside the report; the specs run the
# built-in defaults (ULY_CUDA_TUNED=0), the benchmarks the tuned choice
export ULY_TUNE_CACHE="$(dirname "$report")/attention-tune.txt" ULY_CUDA_TUNED=0
rm -f "$ULY_TUNE_CACHE"
if [ "$emulate" = 1 ]; then
  export ULY_CUDA_LIB=build-gpu/libulysses_cuemu.so ULY_EMU_CC=9.0   # as an H200: the wgmma self-check runs
  test_device=emu bench_args="--quick" tune_args="--seq 128 --reps 1"
  say "(rehearsal: the CUDA emulator stands in for the GPU)"
fi
LUA_PATH='lua/?.lua;lua/?/init.lua;;' luajit -e '
  local cuda = require("ulysses").cuda
  print(("runtime %s, driver %s, devices %d%s"):format(cuda.version_string(cuda.runtime_version()),
    cuda.version_string(cuda.driver_version()), cuda.device_count(), cuda.why() and (" (" .. cuda.why() .. ")") or ""))
  for _, d in ipairs(cuda.devices()) do
    print(("device %d: %s, %.1f GiB total, %.1f GiB free"):format(d.index, d.name, d.total_memory / 2^30, d.free_memory / 2^30))
  end' 2>&1 | tee -a "$log"

# every stage runs under `timeout`, capped by what is left of the whole check's budget
# (ULY_GPU_CHECK_BUDGET seconds from the start, default 480: a device lease is short), most
# telling first: specs, device suite, benchmarks, the 2-rank step, then the sanitizer
# (a rehearsal on the emulator runs the device suite's kernels on the CPU, ~7 min on 2 cores: it
# gets 40 min and the suite 15)
budget=${ULY_GPU_CHECK_BUDGET:-$([ "$emulate" = 1 ] && echo 2400 || echo 480)}
suite_secs=$([ "$emulate" = 1 ] && echo 900 || echo 180)
cap() { # cap SECONDS: prints min(SECONDS, what is left less 10 s for the report), 0 when nothing is
  local left=$(( check_start + budget - $(date +%s) - 10 ))
  (( left < $1 )) && echo $(( left > 15 ? left : 0 )) || echo "$1"
}
run_stage() { # run_stage NAME SECONDS COMMAND...: appends to $failures when it fails or runs out of time
  local name=$1 secs; secs=$(cap "$2"); shift 2
  if [ "$secs" -eq 0 ]; then say "(skipped: the check's ${budget} s budget is spent)"; failures+="$name (not run: budget); "; return; fi
  local t0; t0=$(date +%s)
  timeout "$secs" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "($name: exit $rc, $(( $(date +%s) - t0 )) s${secs:+ of $secs})"
  [ "$rc" -eq 0 ] || failures+="$name (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out')); "
}
failures=""

say "== #gpu specs (seed $ULY_SEED)"
run_stage "#gpu specs" 120 luajit /usr/bin/busted --run=gpu
summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$log" | tail -1)

say "== device suite on the GPU (spec/device_spec.lua, ULY_TEST_DEVICE=$test_device)"
ULY_TEST_DEVICE=$test_device run_stage "device suite" "$suite_secs" luajit /usr/bin/busted spec/device_spec.lua

if [ -e bench/gpu.lua ] && [ -z "${ULY_GPU_CHECK_NO_BENCH:-}" ]; then   # ULY_GPU_CHECK_NO_BENCH=1: specs only
  # the fused attention kernels' variants measured here, the fastest kept in the report's folder
  # (each stage in child processes: a variant that faults costs only itself); the benchmarks'
  # training step runs on that choice, their tables on the variants as labelled
  # (--nondeterministic: the one-pass backward, dQ by atomics, may be chosen, as FlashAttention's
  # and cuDNN's backward add dQ: the benchmarks measure the fastest there is)
  say "== tuning the fused attention kernels (tools/tune_attention.lua)"
  run_stage "attention tuning" 90 bin/ulysses tools/tune_attention.lua --nondeterministic $tune_args
  say "== benchmarks (bench/gpu.lua)"
  ULY_CUDA_TUNED=1 run_stage "benchmarks" 260 bin/ulysses bench/gpu.lua $bench_args   # 69 s on the H200 (2026-12-04), before the variant and profiled steps
fi

if command -v mpirun >/dev/null; then
  # Open MPI 4.1 over PMIx 5 (Ubuntu 24.04's, as on the H200 image) crashes in mpirun before any
  # rank starts (pmix_preg_base_generate_ppn, seen 2026-12-04); PMIx's native regex component avoids it
  export PMIX_MCA_preg=${PMIX_MCA_preg:-native}
  say "== Ulysses, collectives, the overlapped gradient all-reduce and ZeroAdamW on 2 ranks sharing the GPU (host-staged)"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ULY_TEST_DEVICE=$test_device ULY_TEST_SP=2 run_stage "2-rank Ulysses step" 120 \
    mpirun --oversubscribe --bind-to none -x ULY_TEST_DEVICE -x ULY_TEST_SP -x ULY_LIB -x ULY_CUDA_LIB -np 2 \
    luajit /usr/bin/busted --run=mpi --filter=device spec/ulysses_spec.lua spec/dist_spec.lua spec/grad_sync_spec.lua spec/plan_spec.lua spec/zero_spec.lua
else
  say "mpirun: not found (carry openmpi-bin and its libraries in $debs/ for the 2-rank check)"
  failures+="2-rank Ulysses step (no mpirun); "
fi

# the bf16 attention kernels (fused and chunked) under compute-sanitizer: racecheck (shared-memory
# hazards: a missing __syncthreads or cp.async wait), memcheck (out-of-bounds, misaligned); small shapes
sanitizer=""
if [ "$emulate" != 1 ]; then
  sanitizer=$(command -v compute-sanitizer || true)
  [ -n "$sanitizer" ] || say "compute-sanitizer: not found (the fused kernels run once unchecked)"
fi
for tool in racecheck memcheck; do
  say "== attention kernels${sanitizer:+ under compute-sanitizer --tool $tool} (scripts/gpu-sanitize.lua)"
  run_stage "attention kernels${sanitizer:+ under $tool}" 120 ${sanitizer:+$sanitizer --tool $tool --print-limit 20 --error-exitcode 3} luajit scripts/gpu-sanitize.lua
  [ -n "$sanitizer" ] || break
done

[ -z "$failures" ] || finish "failed: $failures" 1
finish "ok: $summary, device suite and Ulysses passed" 0
