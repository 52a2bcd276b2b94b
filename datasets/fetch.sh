#!/bin/sh
# datasets/fetch.sh — download the raw corpora ulysses trains on from Debian packages.
#
#   datasets/fetch.sh NAME...      NAME: kjv gcide ecoli chrx lambda, or all
#
# Each package is fetched with `apt-get download` into data/cache/ (no installation, skipped when
# the .deb is already there), the one file needed is extracted into data/raw/, and its provenance
# (package, version, path inside the package, sha256 of the raw file) is written next to it as
# data/raw/NAME.provenance. Set ULY_DATA to use another folder than <repository>/data.
# datasets/prepare.sh turns the raw files into HDF5 token files (datasets/README.md).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
data=${ULY_DATA:-$root/data}
cache=$data/cache
raw=$data/raw
ALL="kjv gcide ecoli chrx lambda"

die() { echo "fetch.sh: $*" >&2; exit 1; }

usage() {
  echo "usage: datasets/fetch.sh NAME...   (NAME: $ALL, or all)" >&2
  exit 2
}

# deb_of PKG: path of the cached .deb of PKG (empty when none)
deb_of() {
  for f in "$cache/$1"_*.deb; do
    [ -f "$f" ] && { echo "$f"; return 0; }
  done
  echo ""
}

# download PKG: make sure data/cache holds PKG's .deb; prints its path
download() {
  pkg=$1
  deb=$(deb_of "$pkg")
  if [ -z "$deb" ]; then
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found: these corpora come from Debian packages (see datasets/README.md)"
    mkdir -p "$cache"
    # as root apt drops to the _apt user, which cannot write here: keep root for the download
    sandbox=""
    [ "$(id -u)" = 0 ] && sandbox="-o APT::Sandbox::User=root"
    echo "fetch.sh: apt-get download $pkg" >&2
    # shellcheck disable=SC2086
    if ! log=$(cd "$cache" && apt-get $sandbox -q download "$pkg" 2>&1); then
      echo "$log" | tail -5 >&2
      die "could not download the Debian package '$pkg' with apt-get download. Either this machine cannot reach
  a Debian mirror (no network or proxy), or the package lists are missing or stale (run 'apt-get update'),
  or '$pkg' is not in this release ('apt-cache policy $pkg' shows a candidate version when it is)."
    fi
    deb=$(deb_of "$pkg")
    [ -n "$deb" ] || die "apt-get download $pkg reported success but no ${pkg}_*.deb appeared in $cache"
  fi
  echo "$deb"
}

# provenance NAME RAWFILE PKG DEB PATH [NOTE]: write data/raw/NAME.provenance
provenance() {
  name=$1 file=$2 pkg=$3 deb=$4 path=$5 note=${6:-}
  sum=$(sha256sum "$file" | cut -d' ' -f1)
  {
    echo "name=$name"
    echo "package=$pkg"
    echo "version=$(dpkg-deb -f "$deb" Version)"
    echo "deb_sha256=$(sha256sum "$deb" | cut -d' ' -f1)"
    echo "path=$path"
    [ -n "$note" ] && echo "note=$note"
    echo "file=$(basename "$file")"
    echo "bytes=$(wc -c < "$file" | tr -d ' ')"
    echo "sha256=$sum"
    echo "fetched=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } > "$raw/$name.provenance.tmp"
  mv "$raw/$name.provenance.tmp" "$raw/$name.provenance"
}

# extract NAME PKG PATH OUTFILE: one file of a package into data/raw (skipped when done before)
extract() {
  name=$1 pkg=$2 path=$3 out=$raw/$4
  if [ -s "$out" ] && [ -s "$raw/$name.provenance" ]; then
    echo "fetch.sh: $name: $out already there" >&2
    return 0
  fi
  deb=$(download "$pkg")
  mkdir -p "$raw"
  dpkg-deb --fsys-tarfile "$deb" | tar -xO "./$path" > "$out.tmp" ||
    die "could not extract ./$path from $deb (list its files with: dpkg -c $deb)"
  [ -s "$out.tmp" ] || die "./$path extracted from $deb is empty"
  mv "$out.tmp" "$out"
  provenance "$name" "$out" "$pkg" "$deb" "$path"
  echo "fetch.sh: $name: $out ($(wc -c < "$out" | tr -d ' ') bytes)" >&2
}

# the King James Bible: run the package's own reader over every verse, then strip the
# verse references ("Ge1:1 ", "1Chr12:3 ", "Rev22:21 ") from the line starts
fetch_kjv() {
  out=$raw/kjv.txt
  if [ -s "$out" ] && [ -s "$raw/kjv.provenance" ]; then
    echo "fetch.sh: kjv: $out already there" >&2
    return 0
  fi
  prog=$(download bible-kjv)
  text=$(download bible-kjv-text)
  mkdir -p "$raw"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  dpkg -x "$prog" "$tmp"
  dpkg -x "$text" "$tmp"
  [ -f "$tmp/usr/lib/bible.data" ] || die "bible-kjv-text has no usr/lib/bible.data (dpkg -c $text)"
  "$tmp/usr/bin/bible" -p "$tmp/usr/lib" -f "gen1:1-rev22:21" > "$tmp/verses.txt" ||
    die "running the bible reader from $prog failed (it needs libc and libreadline8)"
  lines=$(wc -l < "$tmp/verses.txt" | tr -d ' ')
  refs=$(grep -Ec '^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ ' "$tmp/verses.txt" || true)
  [ "$lines" = 31102 ] && [ "$refs" = 31102 ] ||
    die "expected 31102 verses each starting with a reference like 'Ge1:1 ', got $lines lines, $refs references"
  sed -E 's/^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ //' "$tmp/verses.txt" > "$out.tmp"
  mv "$out.tmp" "$out"
  sum=$(sha256sum "$text" | cut -d' ' -f1)
  provenance kjv "$out" bible-kjv-text "$text" usr/lib/bible.data \
    "text printed by bible-kjv $(dpkg-deb -f "$prog" Version) 'bible -f gen1:1-rev22:21', verse references stripped; bible-kjv-text deb sha256 $sum"
  rm -rf "$tmp"
  trap - EXIT
  echo "fetch.sh: kjv: $out ($(wc -c < "$out" | tr -d ' ') bytes, $lines verses)" >&2
}

fetch_one() {
  case $1 in
    kjv)    fetch_kjv ;;
    gcide)  extract gcide dict-gcide usr/share/dictd/gcide.dict.dz gcide.dict.dz ;;
    ecoli)  extract ecoli ragout-examples usr/share/doc/ragout/examples/E.Coli/references/MG1655-K12.fasta.gz ecoli.fasta.gz ;;
    chrx)   extract chrx smalt-examples usr/share/doc/smalt/test/data/hs37chrXtrunc.fa.gz chrx.fa.gz ;;
    lambda) extract lambda bowtie2-examples usr/share/doc/bowtie2/examples/reference/lambda_virus.fa.gz lambda.fa.gz ;;
    *) echo "fetch.sh: unknown dataset '$1'" >&2; usage ;;
  esac
}

[ $# -gt 0 ] || usage
for arg in "$@"; do
  case $arg in
    -h|--help) usage ;;
    all) for n in $ALL; do fetch_one "$n"; done ;;
    *) fetch_one "$arg" ;;
  esac
done
