#!/usr/bin/env bash
# The ceiling of a server whose only cost beyond gRPC's is W microseconds of CPU per
# decode request: decode_loadgen against `echo_server --work_us=W` for each W (0: the
# plain echo, the end-to-end bench's ceiling), each W in turn per round, and each W's
# median rate as a ratio to W=0's. On a host that the load generator shares with the
# server (the 2-core VM), every microsecond a server computes comes out of the same
# cores, so this is the best ratio to the echo that a server doing that much work per
# request can reach there. Set W to the attention kernel's CPU per request (bench/cpu:
# BM_CpuDecodeSmall's us_per_batch x threads / batch, a lower bound: in the server its
# random reads also evict gRPC's cache lines; on the 2-core VM it cost ~8-9 us per decode
# in place against 5.7-6.6 in the bench, bench/RESULTS.md session 19) and set the result
# beside run_e2e_bench.sh's server / echo: the difference is the server's own overhead.
#
#   bash bench/e2e/work_ceiling.sh [BIN_DIR]
# BIN_DIR: a CMake build dir (default build) or a flat dir holding echo_server and
#   decode_loadgen.
# Knobs (environment): SHAPE (small | seed, default small), WORK_US ("0 3 6 9"; must
#   start with 0), CASES ("stream256 batch64": stream<N> = N concurrent streams,
#   batch<B> = one DecodeBatch of B requests at a time), ROUNDS (2), DURATION_S (3),
#   WARMUP_S (1), PREFILL (576), LAYERS (2), OUT_DIR (BIN_DIR/work_ceiling).
# Fails on a run that fails, writes no JSON or measures no calls.
set -euo pipefail
source "$(dirname "$0")/e2e_setup.sh"

BIN=${1:-build}
SHAPE_NAME=${SHAPE:-small}
WORK_US=${WORK_US:-"0 3 6 9"}
CASES=${CASES:-"stream256 batch64"}
ROUNDS=${ROUNDS:-2}
DURATION_S=${DURATION_S:-3}
WARMUP_S=${WARMUP_S:-1}
PREFILL=${PREFILL:-576}
LAYERS=${LAYERS:-2}
OUT_DIR=${OUT_DIR:-$BIN/work_ceiling}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "work_ceiling: ROUNDS must be a positive integer" >&2; exit 2; }
read -r -a WORKS <<<"$WORK_US"
[[ ${#WORKS[@]} -ge 2 && ${WORKS[0]} == 0 ]] ||
  { echo "work_ceiling: WORK_US must start with 0 (the plain echo) and hold another value" >&2; exit 2; }
e2e_shape "$SHAPE_NAME" || exit 2
e2e_tools "$BIN"
for bin in "$ECHO" "$LOADGEN"; do
  [[ -x $bin ]] || { echo "work_ceiling: $bin not built" >&2; exit 1; }
done
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/*.json "$OUT_DIR"/*.txt "$OUT_DIR"/*.log

ECHO_PID=""
cleanup() { if [[ -n $ECHO_PID ]]; then kill "$ECHO_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT

case_flags() {  # stream<N> | batch<B>
  case $1 in
    stream[0-9]*) echo "--mode=stream --concurrency=${1#stream}" ;;
    batch[0-9]*) echo "--mode=batch --batch_size=${1#batch} --concurrency=1" ;;
    *) echo "work_ceiling: unknown case '$1' (stream<N> | batch<B>)" >&2; return 1 ;;
  esac
}
for c in $CASES; do case_flags "$c" >/dev/null || exit 2; done

for r in $(seq 1 "$ROUNDS"); do
  for w in "${WORKS[@]}"; do
    port=$(e2e_free_port)
    "$ECHO" --listen=127.0.0.1:"$port" --num_layers="$LAYERS" --num_q_heads="$HQ" \
      --num_kv_heads="$HKV" --head_dim="$D" --max_batch_size=256 --work_us="$w" \
      >"$OUT_DIR/echo_w${w}_r$r.log" 2>&1 &
    ECHO_PID=$!
    e2e_wait_listening "$ECHO_PID" "$port" "$OUT_DIR/echo_w${w}_r$r.log"
    for c in $CASES; do
      read -r -a flags <<<"$(case_flags "$c")"
      name=${c}_w${w}_r$r
      echo "== $name" >&2
      if ! "$LOADGEN" --target=127.0.0.1:"$port" --prefill_len="$PREFILL" --topk="$TOPK" \
          --duration_s="$DURATION_S" --warmup_s="$WARMUP_S" --timeout_ms=10000 \
          --label="$name" --json_out="$OUT_DIR/$name.json" "${flags[@]}" \
          >"$OUT_DIR/$name.txt" 2>&1; then
        cat "$OUT_DIR/$name.txt" >&2
        echo "work_ceiling: FAILED: $name" >&2; exit 1
      fi
      [[ -s $OUT_DIR/$name.json ]] || { echo "work_ceiling: FAILED: $name wrote no JSON" >&2; exit 1; }
    done
    kill "$ECHO_PID" 2>/dev/null || true
    wait "$ECHO_PID" 2>/dev/null || true
    ECHO_PID=""
  done
done

python3 - "$OUT_DIR" "$ROUNDS" "$SHAPE_NAME" "$CASES" "${WORKS[@]}" <<'PY' | tee "$OUT_DIR/summary.md"
import json, statistics, sys
out, rounds, shape, cases, works = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(), sys.argv[5:]
print(f"echo_server --work_us=W, shape {shape}, {rounds} round(s): token-layers/s per round, "
      "median, the median as a ratio to W=0's, and the load generator's CPU per decode "
      "(median; it rises as the rate falls: fewer answers per read and per wake-up)")
print()
print("| case | W us | token-layers/s per round | median | ratio to W=0 | load generator CPU us per decode |")
print("|---|---|---|---|---|---|")
for c in cases:
    base = None
    for w in works:
        rates, cpu = [], []
        for r in range(1, rounds + 1):
            d = json.load(open(f"{out}/{c}_w{w}_r{r}.json"))
            if d.get("calls_ok", 0) <= 0 or d.get("token_layers_per_s", 0) <= 0:
                sys.exit(f"work_ceiling: {c}_w{w}_r{r} measured no calls")
            rates.append(d["token_layers_per_s"])
            if d.get("client_cpu_us_per_token_layer") is not None:
                cpu.append(d["client_cpu_us_per_token_layer"])
        median = statistics.median(rates)
        if base is None:
            base = median
        client = f"{statistics.median(cpu):.1f}" if cpu else "-"
        print(f"| {c} | {w} | {' / '.join(f'{x:.0f}' for x in rates)} | {median:.0f} | "
              f"{median / base:.3f} | {client} |")
PY
