#!/usr/bin/env bash
# Starts echo_server and decode_server (--allow_client_shm, one layer) of one shape and
# runs layer_bench.py against both: per-call latency and token-layers/s of each
# transport beside its ceilings, measured in the same run (layer_bench.py says which).
#   bench/layer/run_layer_bench.sh BIN_DIR [OUT_DIR]
# BIN_DIR holds decode_server and echo_server (a build's server/ and bench/e2e/ are
# found too). Environment: BACKEND (cpu | cuda), SHAPE (small: 8/2 heads, D 64, top-K 64;
# seed: 32/8, D 128, top-K 512), TRANSPORTS (bytes,shm; add cuda on a GPU), BATCHES
# (1,8,64,256), IN_FLIGHT (1,4), SECONDS_PER_CASE (3), CPU_THREADS (0 = all),
# SERVER_FLAGS (decode_server flags beyond the end-to-end bench's for BACKEND:
# e2e_default_flags in bench/e2e/e2e_setup.sh), TAG (names the output files), PYTHON (python3).
# The Python client must be importable (PYTHONPATH). Exits non-zero when a server does
# not start or dies, or when layer_bench.py reports a missing or failed case.
set -euo pipefail
bin=${1:?usage: run_layer_bench.sh BIN_DIR [OUT_DIR]}
out=${2:-layer_bench_out}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
find_bin() {
  local name=$1 p
  for p in "$bin/$name" "$bin/server/$name" "$bin/bench/e2e/$name"; do
    [[ -x $p ]] && { echo "$p"; return; }
  done
  echo "run_layer_bench: no $name in $bin" >&2
  exit 2
}
server=$(find_bin decode_server)
echo_bin=$(find_bin echo_server)
# The shapes and the server flags each backend is benchmarked with, as the end-to-end
# bench has them.
source "$here/../e2e/e2e_setup.sh"
BACKEND=${BACKEND:-cpu}
SHAPE=${SHAPE:-small}
e2e_shape "$SHAPE" || exit 2
CACHE=$((1 << 30))
if [[ $SHAPE == seed ]]; then CACHE=$((8 << 30)); fi
PY=${PYTHON:-python3}
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
shape=(--num_layers=1 --num_q_heads=$HQ --num_kv_heads=$HKV --head_dim=$D)
echo_port=$(port)
server_port=$(port)
metrics_port=$(port)
"$echo_bin" --listen=127.0.0.1:$echo_port "${shape[@]}" --max_batch_size=256 \
  >"$out/echo_server.log" 2>&1 &
echo_pid=$!
"$server" --listen=127.0.0.1:$server_port --metrics_listen=127.0.0.1:$metrics_port --backend="$BACKEND" "${shape[@]}" \
  --page_size=64 --cache_bytes=$CACHE --max_batch_size=256 --max_topk=$TOPK \
  --max_queue_delay_us=200 --cpu_threads="${CPU_THREADS:-0}" --allow_client_shm \
  $(e2e_default_flags "$BACKEND") ${SERVER_FLAGS:-} >"$out/decode_server.log" 2>&1 &
server_pid=$!
trap 'kill $echo_pid $server_pid 2>/dev/null || true' EXIT
for i in $(seq 1 300); do
  if "$PY" -c "import socket,sys; socket.create_connection(('127.0.0.1',$server_port),1); socket.create_connection(('127.0.0.1',$echo_port),1)" 2>/dev/null; then
    break
  fi
  kill -0 $server_pid 2>/dev/null || { echo "decode_server died:" >&2; tail -20 "$out/decode_server.log" >&2; exit 1; }
  sleep 0.2
done
"$PY" "$here/layer_bench.py" --server 127.0.0.1:$server_port --echo 127.0.0.1:$echo_port \
  --transports "${TRANSPORTS:-bytes,shm}" --batches "${BATCHES:-1,8,64,256}" \
  --in_flight "${IN_FLIGHT:-1,4}" --seconds "${SECONDS_PER_CASE:-3}" --topk $TOPK \
  --metrics 127.0.0.1:$metrics_port --json "$out/layer_bench_${BACKEND}_${SHAPE}${TAG:-}.json" |
  tee "$out/layer_bench_${BACKEND}_${SHAPE}${TAG:-}.txt"
rc=${PIPESTATUS[0]}
kill -0 $server_pid 2>/dev/null || { echo "run_layer_bench: decode_server died during the run" >&2; exit 1; }
exit "$rc"
