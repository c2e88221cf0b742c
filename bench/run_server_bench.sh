#!/usr/bin/env bash
# Runs the server request-path benchmark (bench/server) and keeps its table and JSON.
# Usage: bench/run_server_bench.sh [BUILD_DIR] [extra benchmark flags...]
# Fails when the benchmark crashes, reports an error, or misses a case.
set -euo pipefail
BUILD=${1:-build}
shift || true
exec bash "$(dirname "$0")/run_gbench.sh" "$BUILD" bench_request_path bench/server \
  "BM_CopyPass BM_TypedPath BM_RawPath BM_AnswerCopyPass BM_TypedAnswer BM_EncodedAnswer" "$@"
