#!/usr/bin/env bash
# scripts/sass-check.sh — what ptxas makes of the fused attention kernels for Hopper (sm_90a), on a
# machine without a GPU: compiles kernels/cuda/attention_fused.cu to a cubin with -Xptxas -v and
# prints, per kernel, its registers, spilled bytes and (when a cuobjdump is found: the toolkit's,
# or $CUOBJDUMP) its SASS instruction count, its wgmmas and how many of them are issued after a
# wait for an earlier one (one per group that needs the last group's results is expected; one per
# wgmma is serialised). Fails (exit 1) when ptxas serialises any kernel's wgmmas (its C7520 note,
# seen on the dQ kernel: a 64-bit division, a subroutine call, in its loop; C7512, too few
# registers, seen on the warp-specialised dK/dV before its setmaxnreg took, and on the overlapped
# forward at D 128 while mbar_wait's trap was inline; C7518, a wait on a divergent path, seen on
# the ping-pong forward) or ignores a setmaxnreg (C7508), so CI catches it without a GPU.
# usage: scripts/sass-check.sh [--quiet]     (about 30 s)
set -uo pipefail
cd "$(dirname "$0")/.."
quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
command -v "$nvcc" >/dev/null 2>&1 || { echo "sass-check: no nvcc ($nvcc): nothing to check"; exit 0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$nvcc" -O3 -std=c++17 -Icore/include -cubin -arch=sm_90a -Xptxas -v kernels/cuda/attention_fused.cu \
    -o "$tmp/af.cubin" 2>"$tmp/ptxas.txt"; then
  cat "$tmp/ptxas.txt"
  echo "sass-check: nvcc failed"
  exit 1
fi
cuobjdump=${CUOBJDUMP:-$(dirname "$nvcc")/cuobjdump}
[ -x "$cuobjdump" ] && "$cuobjdump" -sass "$tmp/af.cubin" >"$tmp/af.sass" 2>/dev/null || : >"$tmp/af.sass"
demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }

# one line per kernel: registers, spill stores/loads (bytes), SASS instructions, wgmma issue
awk '
  /Compiling entry function/ { f = $0; sub(/.*entry function ./, "", f); sub(/. for .*/, "", f); order[++n] = f }
  /Used [0-9]+ registers/ { r = $0; sub(/.*Used /, "", r); sub(/ registers.*/, "", r); regs[f] = r }
  /bytes spill stores/ { s = $0; sub(/ bytes spill stores.*/, "", s); sub(/.*, /, "", s)
                         l = $0; sub(/ bytes spill loads.*/, "", l); sub(/.*stores, /, "", l); spill[f] = s "/" l }
  END { for (i = 1; i <= n; i++) print order[i], regs[order[i]], spill[order[i]] }
' "$tmp/ptxas.txt" | sort -u >"$tmp/kernels.txt"
awk '
  function hex(x,  i, n) { x = tolower(x); sub(/^0x/, "", x); n = 0
                           for (i = 1; i <= length(x); i++) n = n * 16 + index("0123456789abcdef", substr(x, i, 1)) - 1
                           return n }
  /Function : / { f = $3 }
  f != "" && /^ +\/\*[0-9a-f]+\*\/ / { count[f]++
      if ($0 ~ /HGMMA/) { hg[f]++; if (prev[f] == "depbar") waited[f]++; prev[f] = "hgmma" }
      else if ($0 ~ /WARPGROUP.DEPBAR/) { if (prev[f] == "hgmma") prev[f] = "depbar" }
      if ($0 ~ /USETMAXREG/) { grow[f] = 1; v = $0; sub(/.*, */, "", v); sub(/.*CTAPOOL */, "", v); sub(/ *;.*/, "", v)
                               if ($0 ~ /ALLOC/ && $0 !~ /DEALLOC/) alloc[f] = hex(v); else dealloc[f] = hex(v) }
      t = $0
      while (match(t, /[^A-Z_]R[0-9]+/)) { r = substr(t, RSTART + 2, RLENGTH - 2) + 0; if (r > hi[f]) hi[f] = r; t = substr(t, RSTART + RLENGTH) } }
  END { for (k in count) print k, count[k], hg[k] + 0, waited[k] + 0, grow[k] ? hi[k] + 1 : 0, alloc[k] + 0, dealloc[k] + 0 }
' "$tmp/af.sass" >"$tmp/sass.txt"

bad=0
if [ $quiet -eq 0 ]; then
  printf '%-8s %-8s %-8s %-22s %s\n' regs spill instr "wgmmas (after a wait)" kernel
  echo "(regs a>b: a kernel that moves registers with setmaxnreg; a: each thread's at launch, b: the most its code uses)"
fi
while read -r mangled regs spill; do
  instr=- wg=-
  line=$(grep -m1 "^$mangled " "$tmp/sass.txt" || true)
  if [ -n "$line" ]; then
    set -- $line
    instr=$2
    [ "$3" -gt 0 ] && wg="$3 ($4)"
    if [ "$5" -gt 0 ]; then
      # one producer warpgroup shrinks to $7, two consumers grow to $6: more than the three
      # warpgroups launched with and the consumers' setmaxnreg waits forever on a GPU
      if [ $(($7 + 2 * $6)) -gt $((3 * regs)) ]; then
        echo "sass-check: $(echo "$mangled" | demangle | sed 's/(.*//'): setmaxnreg asks $7 + 2 x $6 registers a" \
          "thread, the launch gives 3 x $regs (the consumers would wait forever)"
        bad=1
      fi
      regs="$regs>$5"
    fi
  fi
  name=$(echo "$mangled" | demangle | sed 's/(.*//')
  [ $quiet -eq 0 ] && printf '%-8s %-8s %-8s %-22s %s\n' "$regs" "${spill:-0/0}" "$instr" "$wg" "$name"
done <"$tmp/kernels.txt"
# C7520: a call in the loop; C7512: too few registers (seen when setmaxnreg did not take: C7508);
# C7518: a wait ptxas put on a divergent path (a predicated named-barrier arrive between the issue
# and the wait)
for code in C7520 C7512 C7518 C7508; do
  if grep -q $code "$tmp/ptxas.txt"; then
    case $code in
      C7508) echo "sass-check: ptxas ignores setmaxnreg (C7508) in:" ;;
      *) echo "sass-check: ptxas serialises the wgmmas ($code) of:" ;;
    esac
    grep $code "$tmp/ptxas.txt" | sed "s/.*function '//; s/'.*//" | demangle | sed 's/(.*//; s/^/  /'
    bad=1
  fi
done
[ -s "$tmp/af.sass" ] || echo "sass-check: no cuobjdump (set CUOBJDUMP): instruction counts not shown"
[ $bad -eq 0 ] && echo "sass-check: ok (no kernel's wgmmas serialised)"
exit $bad
