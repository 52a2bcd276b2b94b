#!/bin/sh
# datasets/prepare.sh — fetch and prepare the standard corpora: data/NAME.h5 for each NAME
# (kjv gcide ecoli chrx lambda, or all; default: all). Skips a corpus whose .h5 is newer than its
# raw file. VALID sets the validation fraction (default 0.05). Needs the library built (build/ or ULY_LIB).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
data=${ULY_DATA:-$root/data}
valid=${VALID:-0.05}
names=${*:-all}
[ "$names" = all ] && names="kjv gcide ecoli chrx lambda"

for name in $names; do
  case $name in
    kjv)    kind=text file=kjv.txt ;;
    gcide)  kind=text file=gcide.dict.dz ;;
    ecoli)  kind=dna  file=ecoli.fasta.gz ;;
    chrx)   kind=dna  file=chrx.fa.gz ;;
    lambda) kind=dna  file=lambda.fa.gz ;;
    *) echo "prepare.sh: unknown dataset '$name' (kjv gcide ecoli chrx lambda, or all)" >&2; exit 2 ;;
  esac
  "$root/datasets/fetch.sh" "$name"
  out=$data/$name.h5
  if [ -f "$out" ] && [ "$out" -nt "$data/raw/$file" ]; then
    echo "prepare.sh: $out is up to date" >&2
    continue
  fi
  luajit "$root/datasets/prepare.lua" --kind "$kind" --in "$data/raw/$file" --out "$out" --valid "$valid" --name "$name"
done
