#!/usr/bin/env bash
# End-to-end benchmark: decode_loadgen against decode_server (cpu backend) and against
# echo_server (gRPC alone, no compute: the ceiling), at the seed shape (32/8 heads,
# D 128, top-K 512): 1, 16 and 256 concurrent streams, and DecodeBatch of 64 and 256.
# Prints throughput and p99 as ratios to the echo ceiling; fails on an empty or crashed run.
#
#   bash bench/e2e/run_e2e_bench.sh [BUILD_DIR]
# Knobs (environment): LAYERS (2), PREFILL (576), DURATION_S (5), WARMUP_S (1),
#   CPU_THREADS (0 = all), STREAMS ("1 16 256"), BATCHES ("64 256"), OUT_DIR, TIMEOUT_MS.
set -euo pipefail

BUILD=${1:-build}
LAYERS=${LAYERS:-2}
PREFILL=${PREFILL:-576}
DURATION_S=${DURATION_S:-5}
WARMUP_S=${WARMUP_S:-1}
CPU_THREADS=${CPU_THREADS:-0}
STREAMS=${STREAMS:-"1 16 256"}
BATCHES=${BATCHES:-"64 256"}
TIMEOUT_MS=${TIMEOUT_MS:-10000}
OUT_DIR=${OUT_DIR:-$BUILD/e2e_bench}
HQ=32 HKV=8 D=128 TOPK=512

LOADGEN=$BUILD/client/loadgen/decode_loadgen
ECHO=$BUILD/bench/e2e/echo_server
SERVER=$BUILD/server/decode_server
for bin in "$LOADGEN" "$ECHO" "$SERVER"; do
  [[ -x $bin ]] || { echo "run_e2e_bench: $bin not built" >&2; exit 1; }
done
mkdir -p "$OUT_DIR"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_port() {  # pid port name
  for _ in $(seq 1 150); do
    kill -0 "$1" 2>/dev/null || { echo "run_e2e_bench: $3 died at start-up" >&2; cat "$OUT_DIR/$3.log" >&2; exit 1; }
    if python3 -c "import socket,sys; socket.create_connection(('127.0.0.1',$2),1)" 2>/dev/null; then return; fi
    sleep 0.2
  done
  echo "run_e2e_bench: $3 not listening on $2" >&2; exit 1
}

SHAPE=(--num_layers="$LAYERS" --num_q_heads=$HQ --num_kv_heads=$HKV --head_dim=$D)
ECHO_PORT=$(free_port)
"$ECHO" --listen=127.0.0.1:$ECHO_PORT "${SHAPE[@]}" --max_batch_size=256 >"$OUT_DIR/echo_server.log" 2>&1 &
ECHO_PID=$!; PIDS+=("$ECHO_PID")
SERVER_PORT=$(free_port)
# Cache for the largest run: 256 sequences x (prefill + 256 new + 1) tokens, K+V FP8, all layers, 2x slack.
CACHE_BYTES=$(( 256 * (PREFILL + 257) * HKV * D * 2 * LAYERS * 2 ))
"$SERVER" --listen=127.0.0.1:$SERVER_PORT --metrics_listen=127.0.0.1:$(free_port) --backend=cpu \
  "${SHAPE[@]}" --page_size=64 --cache_bytes=$CACHE_BYTES --max_batch_size=256 \
  --max_queue_delay_us=200 --cpu_threads="$CPU_THREADS" >"$OUT_DIR/decode_server.log" 2>&1 &
SERVER_PID=$!; PIDS+=("$SERVER_PID")
wait_port "$ECHO_PID" "$ECHO_PORT" echo_server
wait_port "$SERVER_PID" "$SERVER_PORT" decode_server

run() {  # name target pid extra-flags...
  local name=$1 target=$2 pid=$3; shift 3
  echo "== $name" >&2
  if ! "$LOADGEN" --target="$target" --prefill_len="$PREFILL" --topk=$TOPK \
      --duration_s="$DURATION_S" --warmup_s="$WARMUP_S" --timeout_ms="$TIMEOUT_MS" \
      --label="$name" --json_out="$OUT_DIR/$name.json" --plot_prefix="$OUT_DIR/$name" "$@" \
      >"$OUT_DIR/$name.txt" 2>&1; then
    cat "$OUT_DIR/$name.txt" >&2
    echo "run_e2e_bench: FAILED: $name (empty run or errors)" >&2; exit 1
  fi
  kill -0 "$pid" 2>/dev/null || { echo "run_e2e_bench: FAILED: server died during $name" >&2; exit 1; }
  sed -n '1,20p' "$OUT_DIR/$name.txt" >&2
}

CASES=()
for n in $STREAMS; do CASES+=("stream$n:--mode=stream --concurrency=$n"); done
for b in $BATCHES; do CASES+=("batch$b:--mode=batch --batch_size=$b --concurrency=1"); done
for c in "${CASES[@]}"; do
  name=${c%%:*}; read -r -a flags <<<"${c#*:}"
  run "echo_$name" 127.0.0.1:$ECHO_PORT "$ECHO_PID" "${flags[@]}"
  run "server_$name" 127.0.0.1:$SERVER_PORT "$SERVER_PID" "${flags[@]}"
done

python3 - "$OUT_DIR" "${CASES[@]%%:*}" <<'PY' | tee "$OUT_DIR/summary.md"
import json, sys
out, names = sys.argv[1], sys.argv[2:]
print("| case | echo tok-layers/s | server tok-layers/s | throughput / echo | echo p99 us | server p99 us | p99 / echo | server queue p99 us | server compute p99 us |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for n in names:
    e = json.load(open(f"{out}/echo_{n}.json"))
    s = json.load(open(f"{out}/server_{n}.json"))
    for r in (e, s):
        if r["calls_ok"] == 0 or r["errors_total"]:
            sys.exit(f"empty or failing run: {r['label']}")
    print(f"| {n} | {e['token_layers_per_s']:.0f} | {s['token_layers_per_s']:.0f} | "
          f"{s['token_layers_per_s'] / e['token_layers_per_s']:.3f} | {e['latency_us']['p99']} | "
          f"{s['latency_us']['p99']} | {s['latency_us']['p99'] / max(e['latency_us']['p99'], 1):.1f} | "
          f"{s['server_queue_us']['p99']} | {s['server_compute_us']['p99']} |")
PY
echo "run_e2e_bench: results in $OUT_DIR (JSON, tables, PNG plots)" >&2
