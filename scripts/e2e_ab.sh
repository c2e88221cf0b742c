#!/usr/bin/env bash
# A/B/B/A of two decode_server binaries in the end-to-end bench, in one run (same echo
# server, load generator and machine state), for decisions that must beat the spread of
# two runs of the same binary:
#   bash scripts/e2e_ab.sh BIN SERVER_A SERVER_B
# BIN holds echo_server and decode_loadgen (a build dir's layout or a bundle's bin/); the
# bench's knobs (SHAPES, BACKEND, DURATION_S, STREAMS, BATCHES, ...) pass through.
# Prints every case's row of each run's summary table, prefixed with the run's label.
# Fails when a run fails or its summary has no case rows. Both servers get the bench's
# default flags (BACKEND=cuda adds --idle_spin_us, which servers before ab9a7c1 refuse:
# pass SERVER_FLAGS="--eager_batching" to compare with one of those).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -eq 3 ]] || { echo "usage: $0 BIN SERVER_A SERVER_B" >&2; exit 2; }
BIN=$1
work=$(mktemp -d /tmp/e2e_ab.XXXXXX)
for label in A B; do
  mkdir -p "$work/$label"
  for tool in echo_server decode_loadgen; do
    src=$BIN/$tool
    [[ -x $src ]] || src=$(find "$BIN" -type f -name "$tool" -perm -u+x | head -1)
    [[ -n $src && -x $src ]] || { echo "e2e_ab: no $tool under $BIN" >&2; exit 1; }
    cp "$src" "$work/$label/"
  done
done
cp "$2" "$work/A/decode_server"
cp "$3" "$work/B/decode_server"
run=0
for label in A B B A; do
  run=$((run + 1))
  out=$work/out_$run
  # One round per run (the A B B A order is the repetition; the rows parsed below are
  # the single-round table's).
  if ! OUT_DIR=$out ROUNDS=1 bash bench/e2e/run_e2e_bench.sh "$work/$label" >"$work/run_$run.log" 2>&1; then
    tail -n 30 "$work/run_$run.log" >&2
    echo "e2e_ab: run $run ($label) failed" >&2
    exit 1
  fi
  rows=$(grep -E '^\| [a-z0-9]+_(stream|batch)[0-9]+(x[0-9]+)? ' "$out/summary.md" || true)
  [[ -n $rows ]] || { echo "e2e_ab: run $run ($label) printed no case rows" >&2; exit 1; }
  [[ $run -eq 1 ]] && grep -E '^\| case ' "$out/summary.md" | sed 's/^/    /'
  sed "s/^/$label$run /" <<<"$rows"
  sed "s/^/$run /" <<<"$rows" >>"$work/rows.txt"
done
# Per case, server token-layers/s of runs A1 B2 B3 A4: B higher / lower only when every B
# run is beyond every A run by more than the larger same-binary spread, else "within
# spread".
echo "verdict (server token-layers/s, A1 B2 B3 A4):"
awk -F'|' -f scripts/ab_verdict.awk -f <(cat <<'AWK'
{ split($1, r, " "); c = $2; gsub(/ /, "", c); v[c, r[1]] = $4 + 0; got[c, r[1]] = 1
  if (!(c in seen)) { seen[c] = 1; order[++n] = c } }
END {
  for (i = 1; i <= n; ++i) {
    c = order[i]; a1 = v[c, 1]; b1 = v[c, 2]; b2 = v[c, 3]; a2 = v[c, 4]
    if (!got[c, 1] || !got[c, 2] || !got[c, 3] || !got[c, 4]) { printf "  %-18s not in every run\n", c; continue }
    printf "  %-18s %9d %9d %9d %9d  %s\n", c, a1, b1, b2, a2, ab_verdict(a1, b1, b2, a2, 1, "B higher", "B lower")
  }
}
AWK
) "$work/rows.txt"
echo "e2e_ab: logs and JSON in $work"
