#!/usr/bin/env bash
# CI's sanitizer stage (after `make test` and `make lint`), from a clean tree:
#  1. the unit and integration suites (ctest) built with gcc and
#     -DSDS_SANITIZE=address,undefined in build-asan: no CUDA, no benchmarks; every test
#     but the `gpu` label (there is no CUDA build here);
#  2. the libFuzzer targets (scripts/fuzz.sh) for FUZZ_SECONDS each in build-fuzz;
#  3. ThreadSanitizer over unit_server_tests but ServiceTest (scripts/tsan_unit_server.sh)
#     in build-tsan.
#   scripts/ci_sanitizers.sh      Env: FUZZ_SECONDS (default 45), JOBS (default nproc)
# Prints how long each step took.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
FUZZ_SECONDS=${FUZZ_SECONDS:-45}
JOBS=${JOBS:-$(nproc)}
ASAN_BUILD=$(realpath -m "${ASAN_BUILD:-build-asan}")
start=$(date +%s)
step() { echo "ci_sanitizers: $1 done after $(($(date +%s) - start)) s"; }

# -O1 -g1 and no NDEBUG: a third less compile time than RelWithDebInfo's -O2 -g, and
# the code's assert()s run too.
cmake -S . -B "$ASAN_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DSDS_WITH_CUDA=OFF \
  -DSDS_SANITIZE=address,undefined >/dev/null
# Every executable but the benchmarks (bench_*: no test runs them), read from the build
# graph so that a new test is built without a change here.
mapfile -t suite_targets < <(ninja -C "$ASAN_BUILD" -t targets all |
  sed -n 's/^[^:]*: CXX_EXECUTABLE_LINKER__\(.*\)_RelWithDebInfo$/\1/p' | grep -v '^bench_' | sort -u)
# gtest_discover_tests runs each test binary while building: it needs the options too.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
echo "ci_sanitizers: building ${#suite_targets[@]} executables: ${suite_targets[*]}"
cmake --build "$ASAN_BUILD" -j "$JOBS" --target "${suite_targets[@]}"
step "ASan+UBSan build"
(cd "$ASAN_BUILD" && ctest --output-on-failure -j "$JOBS" -LE gpu)
step "ASan+UBSan ctest"

JOBS=$JOBS bash scripts/fuzz.sh "$FUZZ_SECONDS"
step "fuzzing (${FUZZ_SECONDS} s per target)"

JOBS=$JOBS bash scripts/tsan_unit_server.sh
step "ThreadSanitizer"
