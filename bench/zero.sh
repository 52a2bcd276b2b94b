#!/bin/sh
# bench/zero.sh — runs bench/zero.lua under mpirun, each way of reducing and stepping (adamw,
# adamw+overlap, zero, zero+overlap) in a fresh set of P processes, so their memory peaks compare.
# Arguments go on to bench/zero.lua, e.g. bench/zero.sh --layers 8 --dim 512.
# Environment: ULY_BENCH_P (ranks, default 2).
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
P=${ULY_BENCH_P:-2}
echo "\$ bench/zero.sh $*   (mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np $P, one run per way)"
header=1
for way in adamw adamw+overlap zero zero+overlap; do
  mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np "$P" bin/ulysses bench/zero.lua \
    --ways "$way" --header "$header" "$@"
  header=0
done
