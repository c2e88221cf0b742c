#!/usr/bin/env bash
# scripts/ncu_source_summary.py on a two-launch export made here: samples are summed over
# the launches per instruction, offsets count from the kernel's first instruction, the
# ranges split where asked, and an export without samples fails (exit 1).
set -euo pipefail
script=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
header='"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_long_sb"'
{
  for launch in 1 2; do
    echo '"Kernel Name","void K()",'
    echo "$header"
    echo '"0x7f0000001000","LDC R1, c[0x0][0x28]","1","8","0","1"'
    echo '"0x7f0000001010","LDG.E R2, desc[UR4][R2.64]","10","8","0","10"'
    echo '"0x7f0000001020","BAR.SYNC 0x0","5","8","5","0"'
  done
} >"$dir/export.csv"
out=$(python3 "$script" "$dir/export.csv" --top 2 --split 0x20)
echo "$out"
grep -q '^2 launches, 3 instructions, 32 warp samples$' <<<"$out"
grep -qE '^  long_sb +22 +68\.8 %$' <<<"$out"
grep -qE '^  \[0x0, 0x20\) +22 +68\.8 %$' <<<"$out"
grep -qE '^  \[0x20, end\) +10 +31\.2 %$' <<<"$out"
grep -qE '^  0x00010 +20 +16  LDG' <<<"$out"
# Instructions without a sample (a profile that sampled nothing): must fail.
{
  echo '"Kernel Name","void K()",'
  echo "$header"
  echo '"0x7f0000001000","LDC R1, c[0x0][0x28]","0","8","0","0"'
} >"$dir/empty.csv"
if python3 "$script" "$dir/empty.csv" >/dev/null 2>&1; then
  echo "ncu_source_summary accepted an export without samples" >&2
  exit 1
fi
echo "ncu_source_summary_test: ok"
