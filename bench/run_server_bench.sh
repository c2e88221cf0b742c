#!/usr/bin/env bash
# Runs the server request-path benchmark (bench/server) and keeps its table and JSON.
# Usage: bench/run_server_bench.sh [BUILD_DIR] [extra benchmark flags...]
# Fails when the benchmark crashes, reports an error, or misses a case.
set -euo pipefail
BUILD=${1:-build}
shift || true
BIN="$BUILD/bench/server/bench_request_path"
if [[ ! -x "$BIN" ]]; then
  cmake --build "$BUILD" --target bench_request_path
fi
TABLE="$BUILD/bench_request_path.txt"
JSON="$BUILD/bench_request_path.json"
echo "bench_request_path: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$BIN" --benchmark_counters_tabular=true --benchmark_out="$JSON" \
  --benchmark_out_format=json "$@" | tee "$TABLE"
for case in BM_CopyPass BM_TypedPath BM_RawPath; do
  grep -q "^$case" "$TABLE" || { echo "run_server_bench: no result for $case" >&2; exit 1; }
done
if grep -qi 'error_occurred\|ERROR OCCURRED' "$TABLE"; then
  echo "run_server_bench: a benchmark reported an error" >&2
  exit 1
fi
echo "run_server_bench: table in $TABLE, JSON in $JSON"
