#!/bin/sh
# bench/ulysses.sh — runs bench/ulysses.lua under mpirun for P = 1, 2, 4 in turn (one SP group of P
# ranks each) and prints every table. Arguments are passed on to bench/ulysses.lua, e.g.
#   bench/ulysses.sh --exchange-n 4096,16384 --layer-n 2048
# With P > 1 each rank runs 1 BLAS/OpenMP thread; on a machine with fewer cores than ranks the
# ranks are oversubscribed (the bench says so in its header) and those timings are not meaningful.
# Environment: ULY_BENCH_PS (default "1 2 4"), ULY_LIB (the library to load), OPENBLAS_CORETYPE.
set -e
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
status=0
for P in ${ULY_BENCH_PS:-1 2 4}; do
  echo "\$ mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np $P bin/ulysses bench/ulysses.lua $*"
  start=$(date +%s)
  mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np "$P" bin/ulysses bench/ulysses.lua "$@" \
    || status=$?
  echo "(P = $P took $(( $(date +%s) - start )) s)"
  echo
done
exit $status
