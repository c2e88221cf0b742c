#!/usr/bin/env bash
# The server's GPU run, on the GPU machine, from the repo root with ./gpu_bundle carried
# (made here by `bash scripts/gpu_bundle.sh --server build-e2e`):
#   1. the integration tests against the real decode_server with SDS_TEST_BACKEND=cuda;
#   2. the end-to-end bench (bench/e2e/run_e2e_bench.sh) of decode_server --backend=cuda
#      against echo_server in the same run, seed shape (and the small one).
# Logs, JSON and plots go into one tarball $OUT/gpu_server_run.tar.gz (plus
# $OUT/summary.txt); the short ratio table prints last. Exit 1 on any failed test,
# failed or empty bench run.
#   bash scripts/gpu_server_run.sh [--bench-backend=cuda|cpu] [--tests-only]
# Environment: OUT, SDS_TEST_BACKEND (cuda), SHAPES ("seed small"), DURATION_S (4),
#   GPU_BUNDLE (gpu_bundle); the bench's other knobs pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
B=$PWD/${GPU_BUNDLE:-gpu_bundle}
OUT=${OUT:-/tmp/gpu_server_run_out}
bench_backend=cuda
tests_only=0
for arg in "$@"; do
  case $arg in
    --bench-backend=cpu | --bench-backend=cuda) bench_backend=${arg#*=} ;;
    --tests-only) tests_only=1 ;;
    *) echo "usage: $0 [--bench-backend=cuda|cpu] [--tests-only]" >&2; exit 2 ;;
  esac
done
export SDS_TEST_BACKEND=${SDS_TEST_BACKEND:-cuda}
export SHAPES=${SHAPES:-"seed small"}
export DURATION_S=${DURATION_S:-4}
export LD_LIBRARY_PATH=$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SDS_DECODE_SERVER=$B/bin/decode_server
WORK=$(mktemp -d /tmp/gpu_server_run.XXXXXX)
LOGS=$WORK/gpu_server_run
mkdir -p "$OUT" "$LOGS" "$WORK/tools"
t() { echo "[t=$(($(date +%s) - START))s] $*"; }
pack() { tar -czf "$OUT/gpu_server_run.tar.gz" -C "$WORK" gpu_server_run || true; }
trap pack EXIT

for bin in decode_server echo_server decode_loadgen; do
  [[ -x $B/bin/$bin ]] || { echo "gpu_server_run: $B/bin/$bin missing (run scripts/gpu_bundle.sh --server)" >&2; exit 1; }
done
{
  date -u
  uname -a
  nproc
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  else
    echo "no nvidia-smi"
  fi
  echo "SDS_TEST_BACKEND=$SDS_TEST_BACKEND bench backend=$bench_backend SHAPES=$SHAPES"
} | tee "$LOGS/run_info.txt"

# promtool / prometheus travel xz-compressed; without them their tests skip, saying so.
for tool in promtool prometheus; do
  var=SDS_$(echo "$tool" | tr "[:lower:]" "[:upper:]")
  if [[ -s $B/bin/$tool.xz ]]; then
    xz -dc "$B/bin/$tool.xz" >"$WORK/tools/$tool" && chmod +x "$WORK/tools/$tool"
    export "$var=$WORK/tools/$tool"
  elif command -v "$tool" >/dev/null; then
    export "$var=$(command -v "$tool")"
  else
    export "$var="
  fi
done

summary=()
failed=0
for name in decode errors fork_release drain metrics; do
  t "integration: $name"
  log=$LOGS/itest_$name.log
  rc=0
  timeout 300 "$B/bin/itest_${name}_test" >"$log" 2>&1 || rc=$?
  passed=$(sed -nE 's/^\[  PASSED  \] ([0-9]+) tests?.*/\1/p' "$log" | tail -1)
  skipped=$(grep -E '^\[  SKIPPED \] [A-Za-z]' "$log" | sed 's/^\[  SKIPPED \] //' | tr '\n' ' ' || true)
  line="itest_$name: rc=$rc passed=${passed:-0}${skipped:+ skipped: $skipped}"
  if [[ $rc -ne 0 || ${passed:-0} -eq 0 ]]; then
    failed=1
    line+=" FAILED"
    grep -E '^\[  FAILED  \]|Failure|error' "$log" | head -20 || true
  fi
  grep -B1 -A2 -E '^\[  SKIPPED \]' "$log" | grep -vE '^\[ RUN|^--$' | head -10 || true
  summary+=("$line")
  echo "$line"
done

if [[ $tests_only -eq 1 ]]; then
  summary+=("e2e bench: not run (--tests-only)")
else
  t "e2e bench ($bench_backend vs echo, shapes: $SHAPES)"
  bench_rc=0
  BACKEND=$bench_backend OUT_DIR=$LOGS/e2e bash bench/e2e/run_e2e_bench.sh "$B/bin" \
    >"$LOGS/e2e_bench.log" 2>&1 || bench_rc=$?
  if [[ $bench_rc -ne 0 || ! -s $LOGS/e2e/summary.md ]]; then
    failed=1
    tail -n 40 "$LOGS/e2e_bench.log"
    summary+=("e2e bench: rc=$bench_rc FAILED")
  else
    summary+=("e2e bench: rc=0")
  fi
fi
t "done"

{
  echo "================ summary ================"
  printf '%s\n' "${summary[@]}"
  echo "overall: $([[ $failed -eq 0 ]] && echo PASS || echo FAIL) ($(($(date +%s) - START)) s)"
  if [[ -s $LOGS/e2e/summary.md ]]; then cat "$LOGS/e2e/summary.md"; fi
} | tee "$OUT/summary.txt"
exit "$failed"
