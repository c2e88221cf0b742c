#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang, ASan and UBSan, and runs each
# for SECONDS from its checked-in corpus (tests/fuzz/corpus/<target>).
#   scripts/fuzz.sh [SECONDS] [TARGET...]   (default 60 s each; all three targets)
# Env: BUILD (default build-fuzz), JOBS (default 2), FUZZ_ARGS (more libFuzzer flags).
# New inputs go to BUILD/fuzz-corpus/<target>, never into the checked-in corpus, and a
# crash to BUILD/fuzz-artifacts/<target>/crash-*: rerun one with
#   BUILD/tests/fuzz/fuzz_<target> BUILD/fuzz-artifacts/<target>/crash-...
# Exit status: non-zero when a target found a crash, a leak or a failed check.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
SECONDS_EACH=${1:-60}
shift || true
TARGETS=("$@")
[[ ${#TARGETS[@]} -gt 0 ]] || TARGETS=(wire_decode validate service)
BUILD=$(realpath -m "${BUILD:-build-fuzz}")
JOBS=${JOBS:-2}

# -O1 keeps the build and the run fast without hiding much from the sanitizers; no
# NDEBUG, so the server's assert()s run too. fuzzer-no-link on every target lets the
# fuzzer see coverage in the server's libraries, not only in the fuzz targets.
nice -n 10 cmake -S . -B "$BUILD" -G Ninja \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
  "-DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined" \
  -DSDS_WITH_CUDA=OFF -DSDS_SANITIZE=address,undefined -DSDS_FUZZ=ON >/dev/null
nice -n 10 cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]/#/fuzz_}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for target in "${TARGETS[@]}"; do
  work="$BUILD/fuzz-corpus/$target"
  artifacts="$BUILD/fuzz-artifacts/$target"
  mkdir -p "$work" "$artifacts"
  log="$BUILD/fuzz-$target.log"
  echo "fuzz: $target for ${SECONDS_EACH}s (log $log)"
  # -timeout: one input running 25 s is a hang (the service target's calls have a 20 s
  # deadline). -rss_limit_mb: an input that makes the server hold gigabytes is a
  # finding (issue 27 B1), not something to swap over.
  # shellcheck disable=SC2086
  if ! "$BUILD/tests/fuzz/fuzz_$target" -max_total_time="$SECONDS_EACH" -timeout=25 \
      -rss_limit_mb=3072 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      ${FUZZ_ARGS:-} "$work" "tests/fuzz/corpus/$target" >"$log" 2>&1; then
    status=1
    echo "fuzz: $target FAILED; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    ls -l "$artifacts" >&2
  fi
  # The summary libFuzzer prints: coverage, features, corpus, execs/s.
  grep -E '^#[0-9]+.*(INITED|DONE)' "$log" | tail -n 2 || true
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
    "$log" || true
done
exit "$status"
