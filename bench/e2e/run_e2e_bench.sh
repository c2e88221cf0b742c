#!/usr/bin/env bash
# End-to-end benchmark: decode_loadgen against decode_server and against echo_server
# (gRPC alone, same-size answers, no compute: the ceiling), both up in the same run.
# Shapes (SHAPES): seed = 32/8 heads, D 128, top-K 512; small = 8/2 heads, D 64,
# top-K 64 (so that on a small CPU host the attention maths is not the limit).
# Cases per shape: 1, 16 and 256 concurrent streams, DecodeBatch of 64 and 256.
# Prints throughput and p99 as ratios to the echo ceiling, and for the stream cases the
# server's own p99 of sds_stream_answer_send_seconds over the case (its /metrics scraped
# before and after; warm-up included); fails on an empty or crashed run, on a case that
# did not write its JSON (or its PNGs, when gnuplot is there), and on a failed scrape.
#
#   bash bench/e2e/run_e2e_bench.sh [BIN_DIR]
# BIN_DIR: a CMake build dir (default build) or a flat dir holding decode_server,
#   echo_server and decode_loadgen (e.g. gpu_bundle/bin).
# Knobs (environment): BACKEND (cpu | cuda), SHAPES ("small seed"), LAYERS (2),
#   PREFILL (576), DURATION_S (5), WARMUP_S (1), CPU_THREADS (0 = all),
#   STREAMS ("1 16 256"), BATCHES ("64 256"), BATCH_CONCURRENCY (1: DecodeBatch calls in
#   flight at once; above 1 the cases are named <shape>_batch<B>x<C>), CHANNELS (1: the
#   load generator's gRPC channels, i.e. TCP connections, for the echo and the server
#   alike), STREAM_API (auto: the load generator's --stream_api, sync or callback),
#   OUT_DIR,
#   TIMEOUT_MS, QUEUE_DELAY_US (200), ROUNDS (1: each case's echo and server runs, taken
#   in turn echo, server, echo, server...; with 2 or more the table gives each ratio's
#   median over the rounds and its range, and whether the medians meet issue #5's goals
#   (throughput >= 0.8x the echo's, p99 <= 2x); a case's files are named <case>_r<N>),
#   SERVER_FLAGS (extra decode_server flags; default "--eager_batching", plus
#   "--inline_idle_batches" with BACKEND=cpu, "--idle_spin_us=2000" with BACKEND=cuda
#   (each measured faster with its backend: bench/RESULTS.md); "" for none).
# OUT_DIR (default BIN_DIR/e2e_bench) is kept across runs: each case's files from an
# earlier run are deleted before the case runs, so only this run's results are read.
set -euo pipefail
source "$(dirname "$0")/e2e_setup.sh"

BIN=${1:-build}
BACKEND=${BACKEND:-cpu}
SHAPES=${SHAPES:-"small seed"}
LAYERS=${LAYERS:-2}
PREFILL=${PREFILL:-576}
DURATION_S=${DURATION_S:-5}
WARMUP_S=${WARMUP_S:-1}
CPU_THREADS=${CPU_THREADS:-0}
STREAMS=${STREAMS:-"1 16 256"}
BATCHES=${BATCHES:-"64 256"}
BATCH_CONCURRENCY=${BATCH_CONCURRENCY:-1}
[[ $BATCH_CONCURRENCY =~ ^[1-9][0-9]*$ ]] || { echo "run_e2e_bench: BATCH_CONCURRENCY must be a positive integer" >&2; exit 2; }
CHANNELS=${CHANNELS:-1}
STREAM_API=${STREAM_API:-auto}
ROUNDS=${ROUNDS:-1}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "run_e2e_bench: ROUNDS must be a positive integer" >&2; exit 2; }
TIMEOUT_MS=${TIMEOUT_MS:-10000}
QUEUE_DELAY_US=${QUEUE_DELAY_US:-200}
read -r -a EXTRA <<<"${SERVER_FLAGS-$(e2e_default_flags "$BACKEND")}"
OUT_DIR=${OUT_DIR:-$BIN/e2e_bench}

e2e_tools "$BIN"
for bin in "$LOADGEN" "$ECHO" "$SERVER"; do
  [[ -x $bin ]] || { echo "run_e2e_bench: $bin not built" >&2; exit 1; }
done
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/summary.md"
# Plots need gnuplot; without it (the GPU host) each case writes the plots' data and
# gnuplot script only, to render elsewhere (`gnuplot <case>_plots.gp`), saying so.
PLOT=1
if ! command -v gnuplot >/dev/null; then
  PLOT=0
  echo "run_e2e_bench: WARNING: no gnuplot: plot data and scripts only, no PNGs this run" >&2
fi

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_port() {  # pid port name
  e2e_wait_listening "$1" "$2" "$OUT_DIR/$3.log" || { echo "run_e2e_bench: $3 did not start" >&2; exit 1; }
}

# The server's /metrics text into a file (fails the run when the server does not answer).
scrape() {  # port file
  python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(
    "http://127.0.0.1:" + sys.argv[1] + "/metrics", timeout=10).read().decode())' "$1" >"$2"
}

run() {  # name target pid extra-flags...
  local name=$1 target=$2 pid=$3; shift 3
  echo "== $name" >&2
  # An earlier run's files must not pass for this run's.
  rm -f "$OUT_DIR/$name.json" "$OUT_DIR/$name.txt" "$OUT_DIR/${name}_latency_time.png" \
    "$OUT_DIR/${name}_latency_dist.png" "$OUT_DIR/${name}"_*.dat "$OUT_DIR/${name}_plots.gp" \
    "$OUT_DIR/${name}"_metrics_*.txt
  # The server's histograms before and after the case (answer send time per stream case).
  if [[ $name == server_* ]]; then scrape "$METRICS_PORT" "$OUT_DIR/${name}_metrics_before.txt"; fi
  local plot=(--plot_prefix="$OUT_DIR/$name")
  if ((!PLOT)); then plot+=(--plot_render=false); fi
  if ! "$LOADGEN" --target="$target" --prefill_len="$PREFILL" --topk="$TOPK" \
      --duration_s="$DURATION_S" --warmup_s="$WARMUP_S" --timeout_ms="$TIMEOUT_MS" \
      --channels="$CHANNELS" --stream_api="$STREAM_API" --label="$name" \
      --json_out="$OUT_DIR/$name.json" "${plot[@]}" "$@" \
      >"$OUT_DIR/$name.txt" 2>&1; then
    cat "$OUT_DIR/$name.txt" >&2
    echo "run_e2e_bench: FAILED: $name (empty run, errors or outputs not written)" >&2; exit 1
  fi
  kill -0 "$pid" 2>/dev/null || { echo "run_e2e_bench: FAILED: server died during $name" >&2; exit 1; }
  if [[ $name == server_* ]]; then scrape "$METRICS_PORT" "$OUT_DIR/${name}_metrics_after.txt"; fi
  local want=("$OUT_DIR/$name.json")
  if ((PLOT)); then
    want+=("$OUT_DIR/${name}_latency_time.png" "$OUT_DIR/${name}_latency_dist.png")
  else
    want+=("$OUT_DIR/${name}_plots.gp" "$OUT_DIR/${name}_latency_dist.dat")
  fi
  for f in "${want[@]}"; do
    [[ -s $f ]] || { echo "run_e2e_bench: FAILED: $name did not write $f" >&2; exit 1; }
  done
  sed -n '1,20p' "$OUT_DIR/$name.txt" >&2
}

ALL=()
for shape in $SHAPES; do
  e2e_shape "$shape" || exit 2
  SHAPE=(--num_layers="$LAYERS" --num_q_heads="$HQ" --num_kv_heads="$HKV" --head_dim="$D")
  ECHO_PORT=$(e2e_free_port)
  "$ECHO" --listen=127.0.0.1:$ECHO_PORT "${SHAPE[@]}" --max_batch_size=256 \
    >"$OUT_DIR/echo_server_$shape.log" 2>&1 &
  ECHO_PID=$!; PIDS+=("$ECHO_PID")
  SERVER_PORT=$(e2e_free_port)
  METRICS_PORT=$(e2e_free_port)
  # Sequences of the largest case: 256 streams, or BATCH_CONCURRENCY calls of the largest batch.
  max_sequences=256
  for b in $BATCHES; do
    if ((b * BATCH_CONCURRENCY > max_sequences)); then max_sequences=$((b * BATCH_CONCURRENCY)); fi
  done
  CACHE_BYTES=$(e2e_cache_bytes "$LAYERS" "$PREFILL" "$max_sequences")
  "$SERVER" --listen=127.0.0.1:$SERVER_PORT --metrics_listen=127.0.0.1:$METRICS_PORT \
    --backend="$BACKEND" "${SHAPE[@]}" --page_size=64 --cache_bytes=$CACHE_BYTES \
    --max_batch_size=256 --max_queue_delay_us="$QUEUE_DELAY_US" --cpu_threads="$CPU_THREADS" \
    "${EXTRA[@]}" \
    >"$OUT_DIR/decode_server_$shape.log" 2>&1 &
  SERVER_PID=$!; PIDS+=("$SERVER_PID")
  wait_port "$ECHO_PID" "$ECHO_PORT" "echo_server_$shape"
  wait_port "$SERVER_PID" "$SERVER_PORT" "decode_server_$shape"

  CASES=()
  for n in $STREAMS; do CASES+=("${shape}_stream$n:--mode=stream --concurrency=$n"); done
  batch_suffix=""
  if ((BATCH_CONCURRENCY > 1)); then batch_suffix=x$BATCH_CONCURRENCY; fi
  for b in $BATCHES; do
    CASES+=("${shape}_batch$b$batch_suffix:--mode=batch --batch_size=$b --concurrency=$BATCH_CONCURRENCY")
  done
  for c in "${CASES[@]}"; do
    name=${c%%:*}; read -r -a flags <<<"${c#*:}"
    for r in $(seq 1 "$ROUNDS"); do  # echo, server, echo, server...: drift hits both
      tag=$name
      if ((ROUNDS > 1)); then tag=${name}_r$r; fi
      run "echo_$tag" 127.0.0.1:$ECHO_PORT "$ECHO_PID" "${flags[@]}"
      run "server_$tag" 127.0.0.1:$SERVER_PORT "$SERVER_PID" "${flags[@]}"
    done
    ALL+=("$name")
  done
  kill "$ECHO_PID" "$SERVER_PID" 2>/dev/null || true
  wait "$ECHO_PID" "$SERVER_PID" 2>/dev/null || true
done

python3 - "$OUT_DIR" "$BACKEND ($CHANNELS gRPC connection(s) per load generator, --stream_api=$STREAM_API)" "$ROUNDS" "${ALL[@]}" <<'PY' | tee "$OUT_DIR/summary.md"
import json, re, statistics, sys
out, backend, rounds, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]

def buckets(path, family):
    """Cumulative (le, count) of one histogram in a /metrics text; [] when absent."""
    text = open(path).read()
    return [(float(m.group(1)), int(m.group(2)))
            for m in re.finditer(family + r'_bucket\{le="([^"]+)"\} (\d+)', text)]

def send_p99_us(n):
    """p99 of sds_stream_answer_send_seconds over the case (after - before scrape), linear
    inside its bucket as Prometheus' histogram_quantile; "-" without observations."""
    fam = "sds_stream_answer_send_seconds"
    after = buckets(f"{out}/server_{n}_metrics_after.txt", fam)
    before = dict(buckets(f"{out}/server_{n}_metrics_before.txt", fam))
    delta = [(le, c - before.get(le, 0)) for le, c in after]
    if not delta or delta[-1][1] <= 0:
        return "-"
    rank, lo, prev = 0.99 * delta[-1][1], 0.0, 0
    for le, c in delta:
        if c >= rank:
            if le == float("inf"):
                return f">{lo * 1e6:.0f}"
            return f"{(lo + (le - lo) * (rank - prev) / max(c - prev, 1)) * 1e6:.0f}"
        lo, prev = le, c
    return "-"

def client_cpu(results):
    """The load generator's CPU per token-layer (all its threads), the median over
    `results`; "-" when none reported it."""
    values = [r["client_cpu_us_per_token_layer"] for r in results
              if r.get("client_cpu_us_per_token_layer") is not None]
    return f"{statistics.median(values):.1f}" if values else "-"

def load(tag):
    """The echo and server results of one round; exits on an empty or failing run."""
    pair = [json.load(open(f"{out}/{who}_{tag}.json")) for who in ("echo", "server")]
    for r in pair:
        if r["calls_ok"] == 0 or r["errors_total"]:
            sys.exit(f"empty or failing run: {r['label']}")
    return pair

print(f"backend: {backend}; shapes: small = 8/2 heads D64 top-K 64, seed = 32/8 heads D128 top-K 512")
if rounds == 1:
    print("| case | echo tok-layers/s | server tok-layers/s | throughput / echo | echo p99 us | server p99 us | p99 / echo | server queue p99 us | server compute p99 us | server answer send p99 us | load generator CPU us per decode (echo / server runs) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        e, s = load(n)
        print(f"| {n} | {e['token_layers_per_s']:.0f} | {s['token_layers_per_s']:.0f} | "
              f"{s['token_layers_per_s'] / e['token_layers_per_s']:.3f} | {e['latency_us']['p99']} | "
              f"{s['latency_us']['p99']} | {s['latency_us']['p99'] / max(e['latency_us']['p99'], 1):.1f} | "
              f"{s['server_queue_us']['p99']} | {s['server_compute_us']['p99']} | {send_p99_us(n)} | "
              f"{client_cpu([e])} / {client_cpu([s])} |")
    sys.exit(0)

def spread(values, fmt):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

def goals(throughput, p99):
    """Issue #5's goals on the medians: throughput >= 0.8x the echo's, p99 <= 2x."""
    missed = [what for what, ok in (("throughput", statistics.median(throughput) >= 0.8),
                                    ("p99", statistics.median(p99) <= 2.0)) if not ok]
    return "met" if not missed else "missed: " + ", ".join(missed)

print(f"{rounds} rounds per case (echo and server in turn); median (min-max) over the rounds, "
      "each round's ratio taken against the echo run just before it; goals: median "
      "throughput >= 0.8x the echo's and median p99 <= 2x")
print("| case | throughput / echo | p99 / echo | goals | echo tok-layers/s | server tok-layers/s | echo p99 us | server p99 us | server queue p99 us | server compute p99 us | load generator CPU us per decode (echo / server runs, medians) |")
print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
for n in names:
    runs = [load(f"{n}_r{r}") for r in range(1, rounds + 1)]
    col = lambda f: [f(e, s) for e, s in runs]
    throughput = col(lambda e, s: s['token_layers_per_s'] / e['token_layers_per_s'])
    p99 = col(lambda e, s: s['latency_us']['p99'] / max(e['latency_us']['p99'], 1))
    print(f"| {n} | {spread(throughput, '{:.3f}')} | {spread(p99, '{:.1f}')} | {goals(throughput, p99)} | "
          f"{spread(col(lambda e, s: e['token_layers_per_s']), '{:.0f}')} | "
          f"{spread(col(lambda e, s: s['token_layers_per_s']), '{:.0f}')} | "
          f"{spread(col(lambda e, s: e['latency_us']['p99']), '{:.0f}')} | "
          f"{spread(col(lambda e, s: s['latency_us']['p99']), '{:.0f}')} | "
          f"{spread(col(lambda e, s: s['server_queue_us']['p99']), '{:.0f}')} | "
          f"{spread(col(lambda e, s: s['server_compute_us']['p99']), '{:.0f}')} | "
          f"{client_cpu([e for e, _ in runs])} / {client_cpu([s for _, s in runs])} |")
PY
if ((PLOT)); then
  echo "run_e2e_bench: results in $OUT_DIR (JSON, tables, PNG plots)" >&2
else
  echo "run_e2e_bench: results in $OUT_DIR (JSON, tables, plot data: gnuplot <case>_plots.gp)" >&2
fi
