#!/usr/bin/env bash
# Demo: start decode_server on the best backend, wait for health, prefill sequences,
# run a short decode load, print throughput, latency percentiles and some /metrics,
# then stop the server with SIGTERM (a graceful drain) and check it exited 0.
# Usage: scripts/demo.sh BUILD_DIR   (make demo builds first, then calls this)
set -euo pipefail

BUILD=${1:-build}
SERVER="$BUILD/server/decode_server"
DRIVER="$BUILD/server/decode_demo_driver"
LOADGEN="$BUILD/client/loadgen/decode_loadgen"
for bin in "$SERVER" "$DRIVER"; do
  [[ -x "$bin" ]] || { echo "demo: $bin not built (run make build)" >&2; exit 1; }
done

WORK=$(mktemp -d /tmp/sds_demo.XXXXXX)
LOG="$WORK/server.log"
SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# A small GQA model (Hq/Hkv = 4): fits a 2-core CPU run in about a minute.
"$SERVER" --backend=auto --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --num_layers=4 --num_q_heads=32 --num_kv_heads=8 --head_dim=128 --page_size=16 \
  --cache_bytes=$((256 << 20)) --k_scales=0.01 --v_scales=0.01 \
  --max_batch_size=64 --max_queue_delay_us=300 --drain_timeout_s=10 \
  >"$LOG" 2>&1 &
SERVER_PID=$!

# The server logs its bound ports once the self-test passed.
for _ in $(seq 1 600); do
  if grep -q "serving on" "$LOG"; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "demo: decode_server exited during start-up:" >&2
    cat "$LOG" >&2
    exit 1
  fi
  sleep 0.1
done
LINE=$(grep "serving on" "$LOG" || true)
[[ -n "$LINE" ]] || { echo "demo: decode_server did not start" >&2; cat "$LOG" >&2; exit 1; }
GRPC_PORT=$(sed -E 's/.*serving on [^ ]+ \(port ([0-9]+)\).*/\1/' <<<"$LINE")
METRICS_PORT=$(sed -E 's/.* metrics [^ ]+ \(port ([0-9]+)\).*/\1/' <<<"$LINE")
TARGET="127.0.0.1:$GRPC_PORT"
echo "== decode_server up: $LINE"

"$DRIVER" --mode=health --target="$TARGET" --wait_s=30
echo "== health: SERVING"

if [[ -x "$LOADGEN" ]]; then
  echo "== load: decode_loadgen (stream, 8 sequences, then unary), prefill 512 tokens"
  "$LOADGEN" --target="$TARGET" --mode=stream --concurrency=8 --prefill_len=512 \
    --topk=256 --max_new_tokens=128 --duration_s=15 --warmup_s=2
  "$LOADGEN" --target="$TARGET" --mode=unary --concurrency=8 --prefill_len=512 \
    --topk=256 --max_new_tokens=128 --duration_s=10 --warmup_s=1
else
  echo "== load: decode_demo_driver (unary, 8 sequences), prefill 512 tokens"
  "$DRIVER" --mode=load --target="$TARGET" --sequences=8 --prefill=512 --topk=256 \
    --duration_s=20
fi

echo "== /metrics (excerpt)"
curl -sf "http://127.0.0.1:$METRICS_PORT/metrics" |
  grep -E '^sds_(build_info|requests_total|batches_total|batch_size_(sum|count)|batch_compute_seconds_(sum|count)|tokens_appended_total|cache_pages|queue_depth)' |
  head -n 20

echo "== stopping (SIGTERM, graceful drain)"
kill -TERM "$SERVER_PID"
STATUS=0
wait "$SERVER_PID" || STATUS=$?
SERVER_PID=""
if [[ $STATUS -ne 0 ]]; then
  echo "demo: decode_server exited with $STATUS" >&2
  cat "$LOG" >&2
  exit 1
fi
tail -n 2 "$LOG"
echo "== demo done"
