#!/usr/bin/env bash
# Runs one Google Benchmark binary of a build and keeps its table and JSON; shared by
# bench/run_cpu_bench.sh and bench/run_server_bench.sh.
#   bench/run_gbench.sh BUILD_DIR TARGET SUBDIR "REQUIRED_CASE..." [benchmark flags...]
# Builds TARGET when BUILD_DIR/SUBDIR/TARGET is missing. Fails when the benchmark
# crashes, reports an error, or prints no row for one of the required cases.
set -euo pipefail
BUILD=$1 TARGET=$2 SUBDIR=$3
read -r -a REQUIRED <<<"$4"
shift 4
BIN="$BUILD/$SUBDIR/$TARGET"
if [[ ! -x "$BIN" ]]; then
  cmake --build "$BUILD" --target "$TARGET"
fi
TABLE="$BUILD/$TARGET.txt"
JSON="$BUILD/$TARGET.json"
echo "$TARGET: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$BIN" --benchmark_counters_tabular=true --benchmark_out="$JSON" \
  --benchmark_out_format=json "$@" | tee "$TABLE"
for case in "${REQUIRED[@]}"; do
  grep -q "^$case" "$TABLE" || { echo "$TARGET: no result for $case" >&2; exit 1; }
done
if grep -qi 'error_occurred\|ERROR OCCURRED' "$TABLE"; then
  echo "$TARGET: a benchmark reported an error" >&2
  exit 1
fi
echo "$TARGET: table in $TABLE, JSON in $JSON"
