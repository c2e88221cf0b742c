#!/usr/bin/env bash
# The whole GPU run, on the GPU machine, from the repo root with ./gpu_bundle carried:
# GPU tests, the same tests under compute-sanitizer memcheck (zero errors required),
# racecheck of the decode with fused warps, PV warps and QK ahead (zero hazards
# required), the benchmark table, and ncu dram__bytes_read.sum of the seed case. Logs
# under $OUT.
#   bash scripts/gpu_run.sh [--quick]   (--quick: skip memcheck and racecheck)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_run_out}
mkdir -p "$OUT"
B=${GPU_BUNDLE:-gpu_bundle}
export LD_LIBRARY_PATH=$PWD/$B/lib:${LD_LIBRARY_PATH:-}
quick=0
[[ ${1:-} == --quick ]] && quick=1
status=0
summary=()

date -u | tee "$OUT/run_info.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv |
  tee -a "$OUT/run_info.txt"

echo "== GPU tests"
$B/bin/sds_gpu_tests --gtest_brief=1 >"$OUT/gpu_tests.log" 2>&1
rc=$?
tail -n 30 "$OUT/gpu_tests.log"
passed=$(sed -nE 's/^\[  PASSED  \] ([0-9]+) tests?\.$/\1/p' "$OUT/gpu_tests.log" | tail -1)
summary+=("gpu tests: rc=$rc, ${passed:-no} tests passed")
[[ $rc -eq 0 ]] || status=1

if [[ $quick -eq 0 ]]; then
  # memcheck slows the suite ~10x: run it as MEMCHECK_SHARDS gtest shards in parallel
  # (one GPU, separate processes), each must exit 0 with an ERROR SUMMARY of 0 errors.
  shards=${MEMCHECK_SHARDS:-6}
  echo "== compute-sanitizer memcheck ($shards shards)"
  pids=()
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "${MEMCHECK_TIMEOUT_S:-420}" \
      compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
      $B/bin/sds_gpu_tests --gtest_brief=1 >"$OUT/memcheck_$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < shards; ++i)); do
    rc=0
    wait "${pids[$i]}" || rc=$?
    tail -n 3 "$OUT/memcheck_$i.log"
    errors=$(grep -E 'ERROR SUMMARY' "$OUT/memcheck_$i.log" | tail -1)
    summary+=("memcheck shard $i/$shards: rc=$rc, ${errors:-no ERROR SUMMARY line}")
    [[ $rc -eq 0 && -n $errors ]] || status=1
  done
fi

if [[ $quick -eq 0 ]]; then
  # racecheck of the v1 decode on three shapes (D 128, 64, 256), with fused warps, PV
  # warps and PV warps with QK ahead (the launch picks by grid size; SDS_DECODE_PV_WARP
  # forces one): zero hazards required.
  echo "== compute-sanitizer racecheck (v1 decode, fused, PV warps, QK ahead)"
  shapes='Shapes/DecodeVsReference.EveryElementWithinTwoUlps/v1_Hq32_Hkv8_D128_P16_tensor_shared'
  shapes+=':Shapes/DecodeVsReference.EveryElementWithinTwoUlps/v1_Hq8_Hkv2_D64_P16_tokenhead_shared'
  shapes+=':Shapes/DecodeVsReference.EveryElementWithinTwoUlps/v1_Hq8_Hkv1_D256_P64_tensor_shared'
  race_pids=()
  for pv in 0 1 2; do
    SDS_DECODE_PV_WARP=$pv timeout "${RACECHECK_TIMEOUT_S:-300}" compute-sanitizer \
      --tool racecheck --racecheck-report all --error-exitcode 3 --print-limit 20 \
      "$B/bin/sds_gpu_tests" --gtest_brief=1 --gtest_filter="$shapes" >"$OUT/racecheck_pv$pv.log" 2>&1 &
    race_pids+=($!)
  done
  for pv in 0 1 2; do
    wait "${race_pids[$pv]}" || status=1
    hazards=$(grep -E 'RACECHECK SUMMARY' "$OUT/racecheck_pv$pv.log" | tail -1)
    summary+=("racecheck SDS_DECODE_PV_WARP=$pv: ${hazards:-no RACECHECK SUMMARY line}")
    [[ $hazards == *"(0 errors"* ]] || status=1
  done
fi

echo "== benchmark"
$B/bin/sds_gpu_bench >"$OUT/bench.log" 2>&1
rc=$?
[[ $rc -eq 0 ]] || status=1
summary+=("bench: rc=$rc")

echo "== ncu seed case"
# Column 7 of the bench table is min_MB (case v1_us v2_us floor_us v1_rat v2_rat min_MB).
min_mb=$(awk '$1=="seed" && NF >= 7 {print $7}' "$OUT/bench.log" | head -1)
ncu --clock-control none --metrics dram__bytes_read.sum,gpu__time_duration.sum \
  -k regex:SparseDecode --launch-skip 3 --launch-count 1 \
  $B/bin/sds_gpu_bench --case seed --iters 1 >"$OUT/ncu_seed.log" 2>&1
rc=$?
grep -E 'dram__bytes_read.sum|gpu__time_duration' "$OUT/ncu_seed.log"
bytes=$(awk '/dram__bytes_read.sum/{u=$2; v=$3; gsub(",","",v); if(u=="Gbyte")v*=1e3; if(u=="Kbyte")v/=1e3; if(u=="byte")v/=1e6; print v}' "$OUT/ncu_seed.log" | head -1)
if [[ -n $bytes && -n $min_mb ]]; then
  summary+=("ncu seed: dram read ${bytes} MB vs minimum ${min_mb} MB = $(awk -v a="$bytes" -v b="$min_mb" 'BEGIN{printf "%.3f", a/b}')x")
else
  summary+=("ncu seed: rc=$rc (no reading)")
fi

echo
echo "================ summary ================"
grep -A20 '^case ' "$OUT/bench.log"
printf '%s\n' "${summary[@]}"
echo "overall status: $status"
exit $status
