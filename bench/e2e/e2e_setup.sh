# Sourced by run_e2e_bench.sh, profile_case.sh and work_ceiling.sh: where the binaries
# are, the shapes, the server flags each backend is benchmarked with, the cache size (so
# that the scripts run the same server), and the ports they start servers on.

# e2e_tools BIN: sets SERVER, ECHO and LOADGEN from a CMake build dir or a flat dir
# (a GPU bundle's bin/) holding decode_loadgen beside echo_server (and decode_server,
# which work_ceiling.sh does not need).
e2e_tools() {
  if [[ -x $1/decode_loadgen ]]; then
    SERVER=$1/decode_server ECHO=$1/echo_server LOADGEN=$1/decode_loadgen
  else
    SERVER=$1/server/decode_server ECHO=$1/bench/e2e/echo_server
    LOADGEN=$1/client/loadgen/decode_loadgen
  fi
}

# e2e_shape NAME: sets HQ, HKV, D and TOPK; fails on an unknown name.
# seed = 32/8 heads, D 128, top-K 512; small = 8/2 heads, D 64, top-K 64.
e2e_shape() {
  case $1 in
    seed) HQ=32 HKV=8 D=128 TOPK=512 ;;
    small) HQ=8 HKV=2 D=64 TOPK=64 ;;
    *) echo "unknown shape '$1' (seed | small)" >&2; return 1 ;;
  esac
}

# e2e_default_flags BACKEND: the decode_server flags the bench runs BACKEND with (each
# measured faster with its backend: bench/RESULTS.md).
e2e_default_flags() {
  local flags="--eager_batching"
  if [[ $1 == cpu ]]; then flags+=" --inline_idle_batches"; fi
  if [[ $1 == cuda ]]; then flags+=" --idle_spin_us=2000"; fi
  echo "$flags"
}

# e2e_cache_bytes LAYERS PREFILL [SEQUENCES] (after e2e_shape): room for the largest
# run, SEQUENCES (default 256) x (prefill + 256 new + 1) tokens, K and V in FP8, every
# layer, 2x slack.
e2e_cache_bytes() {
  echo $((${3:-256} * ($2 + 257) * HKV * D * 2 * $1 * 2))
}

# e2e_free_port: a TCP port free on 127.0.0.1 now.
e2e_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# e2e_wait_listening PID PORT LOG: waits (up to 60 s) until process PID listens on PORT;
# fails, printing LOG, when the process died first or never listened.
e2e_wait_listening() {
  for _ in $(seq 1 300); do
    kill -0 "$1" 2>/dev/null || { echo "$3: the process died at start-up:" >&2; cat "$3" >&2; return 1; }
    if python3 -c "import socket; socket.create_connection(('127.0.0.1',$2),1)" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "$3: not listening on port $2 after 60 s" >&2
  return 1
}
