#!/usr/bin/env bash
# One end-to-end case (small shape unless SHAPE says otherwise), with the server's costs
# per decode: a fresh decode_server (or echo_server) and decode_loadgen; after the prefill, 3 s of
# `perf stat` (or `perf record`) on the server process, CPU time and context switches
# of the load generator (all its threads),
# and voluntary / involuntary context switches per decode by thread name. Used for the
# "server overheads" figures in bench/RESULTS.md.
#
#   bash bench/e2e/profile_case.sh BUILD_DIR LOADGEN_FLAGS...
#   e.g. bash bench/e2e/profile_case.sh build --mode=stream --concurrency=16
# Knobs (environment): TARGET (server | echo), PERF (stat | record | none),
#   PERF_ARGS (perf record flags, default -g), DURATION_S (6), OUT (/tmp/sds_profile_case),
#   BACKEND (cpu | cuda, default cpu), SHAPE (small | seed, default small), SERVER_FLAGS
#   (default: the bench's for BACKEND), CPU_THREADS (0); shapes, flags and tools as
#   run_e2e_bench.sh has them (e2e_setup.sh).
# BIN is a build directory or a GPU bundle's bin/ (flat: decode_server, echo_server,
# decode_loadgen side by side).
set -euo pipefail
source "$(dirname "$0")/e2e_setup.sh"
BIN=$1
shift
TARGET=${TARGET:-server} PERF=${PERF:-stat} OUT=${OUT:-/tmp/sds_profile_case}
DURATION_S=${DURATION_S:-6} BACKEND=${BACKEND:-cpu}
mkdir -p "$OUT"
e2e_shape "${SHAPE:-small}" || exit 2
SHAPE_FLAGS=(--num_layers=2 --num_q_heads="$HQ" --num_kv_heads="$HKV" --head_dim="$D")
e2e_tools "$BIN"
CACHE_BYTES=$(e2e_cache_bytes 2 576)
PORT=$(e2e_free_port)
read -r -a EXTRA <<<"${SERVER_FLAGS-$(e2e_default_flags "$BACKEND")}"
if [[ $TARGET == server ]]; then
  "$SERVER" --listen=127.0.0.1:"$PORT" --metrics_listen=127.0.0.1:"$(e2e_free_port)" \
    --backend="$BACKEND" "${SHAPE_FLAGS[@]}" --page_size=64 --cache_bytes=$CACHE_BYTES \
    --max_batch_size=256 --max_queue_delay_us=200 --cpu_threads="${CPU_THREADS:-0}" "${EXTRA[@]}" \
    >"$OUT/server.log" 2>&1 &
else
  "$ECHO" --listen=127.0.0.1:"$PORT" "${SHAPE_FLAGS[@]}" --max_batch_size=256 \
    >"$OUT/server.log" 2>&1 &
fi
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
e2e_wait_listening "$SERVER_PID" "$PORT" "$OUT/server.log"
"$LOADGEN" --target=127.0.0.1:"$PORT" --prefill_len=576 --topk="$TOPK" \
  --duration_s="$DURATION_S" --warmup_s=1 --timeout_ms=10000 --label=case \
  --json_out="$OUT/loadgen.json" "$@" >"$OUT/loadgen.txt" 2>&1 &
LOADGEN_PID=$!
sleep 3  # prefill and warm-up

threads() {  # name voluntary involuntary, per thread of process $1 (default: the server)
  for t in /proc/"${1:-$SERVER_PID}"/task/*; do
    echo "$(tr ' ' _ <"$t/comm") $(awk '/^voluntary/{v=$2} /^nonvoluntary/{n=$2} END{print v, n}' "$t/status")"
  done
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
threads >"$OUT/threads0.txt"
threads "$LOADGEN_PID" >"$OUT/loadgen_threads0.txt"
LOADGEN_TICKS0=$(cpu_ticks "$LOADGEN_PID")
T0=$(date +%s.%N)
case $PERF in
  record) read -r -a record_args <<<"${PERF_ARGS:--g}"
    perf record "${record_args[@]}" -o "$OUT/perf.data" -p "$SERVER_PID" -- sleep 3 >/dev/null 2>&1 ;;
  stat) perf stat -e task-clock,context-switches -p "$SERVER_PID" -- sleep 3 2>"$OUT/perf_stat.txt" ;;
  *) sleep 3 ;;
esac
T1=$(date +%s.%N)
threads >"$OUT/threads1.txt"
threads "$LOADGEN_PID" >"$OUT/loadgen_threads1.txt"
LOADGEN_TICKS1=$(cpu_ticks "$LOADGEN_PID")
wait "$LOADGEN_PID" || { cat "$OUT/loadgen.txt" >&2; exit 1; }

python3 - "$OUT" "$T0" "$T1" "$LOADGEN_TICKS0" "$LOADGEN_TICKS1" "$PERF" <<'PY'
import json, re, sys
out, t0, t1, l0, l1, perf = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
r = json.load(open(f"{out}/loadgen.json"))
decodes = r["token_layers_per_s"] * (t1 - t0)
print(f"token-layers/s {r['token_layers_per_s']:.0f}, latency p50/p99 {r['latency_us']['p50']}/{r['latency_us']['p99']} us, "
      f"server queue p50 {r['server_queue_us']['p50']} us, compute p50 {r['server_compute_us']['p50']} us")
if perf == "stat":
    ms = float(re.search(r"([\d.,]+)\s+msec task-clock", open(f"{out}/perf_stat.txt").read()).group(1).replace(",", ""))
    print(f"server CPU per decode {ms * 1000 / decodes:.1f} us")
if l1 > l0:
    print(f"load generator CPU per decode {(l1 - l0) * 1e4 / decodes:.1f} us")
def read(path):
    sums = {}
    for line in open(path):
        if len(line.split()) != 3:
            continue  # a thread (or the process) gone while it was read
        name, v, n = line.split()
        a, b = sums.get(name, (0, 0))
        sums[name] = (a + int(v), b + int(n))
    return sums
a, b = read(f"{out}/threads0.txt"), read(f"{out}/threads1.txt")
rows = []
for name, (v, n) in sorted(b.items()):
    v0, n0 = a.get(name, (0, 0))
    if (v - v0) / decodes >= 0.005 or (n - n0) / decodes >= 0.005:
        rows.append(f"{name} {(v - v0) / decodes:.2f}/{(n - n0) / decodes:.2f}")
print("context switches per decode (voluntary/involuntary): " + ", ".join(rows))
c0, c1 = read(f"{out}/loadgen_threads0.txt"), read(f"{out}/loadgen_threads1.txt")
if c1:  # else it had ended before the second look (DURATION_S too short)
    switches = sum(v + n for v, n in c1.values()) - sum(v + n for v, n in c0.values())
    print(f"load generator context switches per decode {switches / decodes:.2f} (all its threads)")
PY
