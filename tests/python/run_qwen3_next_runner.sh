#!/usr/bin/env bash
# Runs client/python/examples/qwen3_next_runner.py --check against a decode_server started
# here with the runner's own shape flags, on a free loopback port; exits with the
# runner's status. Needs torch and transformers (>= 4.57, Qwen3-Next) in PYTHON's
# environment, with sparse_decode_client installed: not part of CI.
#
#   run_qwen3_next_runner.sh DECODE_SERVER PYTHON [RUNNER ARGS...]
#
# Runner args (--batch, --steps, --topk, --device, --head-dim, --scale-mode, ...) go to
# --print-server-flags too, so the server always matches the model. SERVER_ARGS adds
# decode_server flags (default --backend=cpu; e.g. SERVER_ARGS=--backend=cuda).
set -euo pipefail
server=$1 py=$2
shift 2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
runner="$here/../../client/python/examples/qwen3_next_runner.py"

free_port() {
  "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

flags=$("$py" "$runner" --print-server-flags "$@")
port=$(free_port)
log=$(mktemp -t qwen3_next_server.XXXXXX.log)
# shellcheck disable=SC2086  # SERVER_ARGS and flags are lists of flags
"$server" ${SERVER_ARGS:---backend=cpu} --listen="127.0.0.1:$port" --metrics_listen= $flags \
  >"$log" 2>&1 &
pid=$!
# shellcheck disable=SC2317  # run by the EXIT trap
stop() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
trap stop EXIT

echo "run_qwen3_next_runner: decode_server (pid $pid) on 127.0.0.1:$port: ${SERVER_ARGS:---backend=cpu} $flags"
status=0
# The runner waits for the server itself (wait_until_ready).
"$py" "$runner" --server "127.0.0.1:$port" --check "$@" || status=$?
if ! kill -0 "$pid" 2>/dev/null; then
  echo "run_qwen3_next_runner: decode_server exited before the runner was done" >&2
  [[ $status -ne 0 ]] || status=1
fi
if [[ $status -ne 0 ]]; then
  echo "run_qwen3_next_runner: exit $status; decode_server's log ($log) ends:" >&2
  tail -n 30 "$log" >&2
else
  rm -f "$log"
fi
exit "$status"
