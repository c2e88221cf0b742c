#!/usr/bin/env bash
# Runs the CPU attention benchmark (bench/cpu) and keeps its table and JSON.
# Usage: bench/run_cpu_bench.sh [BUILD_DIR] [extra benchmark flags...]
# Fails when the benchmark crashes, reports an error, or prints nothing.
set -euo pipefail
BUILD=${1:-build}
shift || true
BIN="$BUILD/bench/cpu/bench_cpu_attention"
if [[ ! -x "$BIN" ]]; then
  cmake --build "$BUILD" --target bench_cpu_attention
fi
TABLE="$BUILD/bench_cpu_attention.txt"
JSON="$BUILD/bench_cpu_attention.json"
echo "bench_cpu_attention: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$BIN" --benchmark_counters_tabular=true --benchmark_out="$JSON" \
  --benchmark_out_format=json "$@" | tee "$TABLE"
if ! grep -q 'BM_CpuDecode' "$TABLE" || ! grep -q 'BM_ReadPass' "$TABLE"; then
  echo "run_cpu_bench: benchmark printed no results" >&2
  exit 1
fi
if grep -qi 'error_occurred\|ERROR OCCURRED' "$TABLE"; then
  echo "run_cpu_bench: a benchmark reported an error" >&2
  exit 1
fi
echo "run_cpu_bench: table in $TABLE, JSON in $JSON"
