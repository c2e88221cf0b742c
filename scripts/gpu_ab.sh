#!/usr/bin/env bash
# A/B/B/A comparison of two benchmark builds or flag sets, on the GPU machine, in one call:
# each bench case runs A, B, B, A (so drift shows as a spread, not as a difference), and
# the table prints v1 microseconds per run and a verdict: B faster / B slower when every
# B run is beyond every A run by more than the larger spread of two runs of the same
# code (|A1 - A2|, |B1 - B2|), else "within spread". Fails when a run fails or prints no
# figure.
#   A="gpu_bundle/bin/sds_gpu_bench --host_scalars off" \
#   B="gpu_bundle/bin/sds_gpu_bench" bash scripts/gpu_ab.sh CASE...
# CASE: a decode case name of sds_gpu_bench, or `append` (its v1 column is the append).
# Under $OUT (default /tmp/gpu_ab_out): ab_table.txt (the table) and ab_logs.tar.gz (every
# run's log), two files whatever the number of cases (the GPU machine returns only a few
# files per call). LD_LIBRARY_PATH gets $GPU_BUNDLE/lib.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_ab_out}
mkdir -p "$OUT/logs"
pack() { tar -czf "$OUT/ab_logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"; }
trap pack EXIT
export LD_LIBRARY_PATH=$PWD/${GPU_BUNDLE:-gpu_bundle}/lib:${LD_LIBRARY_PATH:-}
: "${A:?A: the first bench command}" "${B:?B: the second bench command}"
[[ $# -gt 0 ]] || { echo "gpu_ab: name at least one case" >&2; exit 2; }

# Prints the v1 microseconds of `case` from one run of the command in $1.
one() {
  local cmd=$1 name=$2 log
  log=$OUT/logs/$(printf '%s' "$name-$3" | tr -c 'A-Za-z0-9_.-' _).log
  read -r -a argv <<<"$cmd"
  "${argv[@]}" --case "$name" >"$log" 2>&1 || { echo "gpu_ab: '$cmd --case $name' failed" >&2; cat "$log" >&2; exit 1; }
  local row=$name
  [[ $name == append ]] && row=append_256tok
  local us
  us=$(awk -v r="$row" '$1==r{v=$2} END{print v}' "$log")
  [[ -n $us ]] || { echo "gpu_ab: no figure for $row in $log" >&2; exit 1; }
  echo "$us"
}

# The verdict of one case from its four figures (see the header; lower is better).
verdict() {
  awk -v a1="$1" -v b1="$2" -v b2="$3" -v a2="$4" -f scripts/ab_verdict.awk \
    -f <(echo 'BEGIN { printf "%s", ab_verdict(a1, b1, b2, a2, 0, "B faster", "B slower") }')
}

printf '%-18s %9s %9s %9s %9s  %s\n' case A1 B1 B2 A2 verdict | tee "$OUT/ab_table.txt"
for name in "$@"; do
  a1=$(one "$A" "$name" a1)
  b1=$(one "$B" "$name" b1)
  b2=$(one "$B" "$name" b2)
  a2=$(one "$A" "$name" a2)
  printf '%-18s %9s %9s %9s %9s  %s\n' "$name" "$a1" "$b1" "$b2" "$a2" \
    "$(verdict "$a1" "$b1" "$b2" "$a2")" | tee -a "$OUT/ab_table.txt"
done
