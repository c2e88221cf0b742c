#!/usr/bin/env bash
# Runs the CPU attention benchmark (bench/cpu) and keeps its table and JSON.
# Usage: bench/run_cpu_bench.sh [BUILD_DIR] [extra benchmark flags...]
# Fails when the benchmark crashes, reports an error, or prints nothing.
set -euo pipefail
BUILD=${1:-build}
shift || true
exec bash "$(dirname "$0")/run_gbench.sh" "$BUILD" bench_cpu_attention bench/cpu \
  "BM_ReadPass BM_CpuDecode" "$@"
