#!/usr/bin/env bash
# clang-format check on every source, clang-tidy (checks in .clang-tidy) on the host code
# that BUILD compiles. Fails on any formatting difference and on any clang-tidy error.
#   scripts/lint.sh [BUILD]    (BUILD: a configured build dir with the proto headers
#                               generated; `make lint` does both)
# clang-tidy needs each file's compile command, so it runs only on the tracked *.cc
# files that are in BUILD/compile_commands.json and lists the ones it skipped: in a
# CPU-only build the CUDA-side files (server/cuda/, bench/gpu/) are not compiled and
# their CUDA headers may be absent; a CUDA build lints them.
set -euo pipefail
BUILD=$(realpath -m "${1:-build}")
root=$(git rev-parse --show-toplevel)
cd "$root"
mapfile -t sources < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
clang-format --dry-run --Werror "${sources[@]}"
echo "lint: clang-format clean (${#sources[@]} files)"

db="$BUILD/compile_commands.json"
if [[ ! -f "$db" ]]; then
  echo "lint: $db not found: configure $BUILD first (make lint does)" >&2
  exit 1
fi
mapfile -t tracked < <(git ls-files '*.cc')
# Absolute paths of the files the build compiles (compile_commands.json "file" entries,
# relative ones resolved against their "directory").
mapfile -t compiled < <(python3 - "$db" <<'PY'
import json, os, sys
for entry in json.load(open(sys.argv[1])):
    path = entry["file"]
    if not os.path.isabs(path):
        path = os.path.join(entry.get("directory", ""), path)
    print(os.path.realpath(path))
PY
)
declare -A in_db=()
for f in "${compiled[@]}"; do in_db["$f"]=1; done
host_sources=()
skipped=()
for f in "${tracked[@]}"; do
  if [[ -n "${in_db[$(realpath -m "$root/$f")]:-}" ]]; then
    host_sources+=("$f")
  else
    skipped+=("$f")
  fi
done
if ((${#skipped[@]})); then
  echo "lint: clang-tidy skips ${#skipped[@]} tracked .cc files not compiled in $BUILD" \
    "(not in $db):"
  printf '  %s\n' "${skipped[@]}"
fi
if ((${#host_sources[@]} == 0)); then
  echo "lint: no tracked .cc file is in $db: is $BUILD a build of this checkout?" >&2
  exit 1
fi

report="$BUILD/clang-tidy.txt"
# clang-tidy exits non-zero on errors; collect everything, then judge the report.
printf '%s\n' "${host_sources[@]}" \
  | xargs -P "$(nproc)" -n 4 clang-tidy -p "$BUILD" --quiet >"$report" 2>&1 || true
if grep -E '(error|warning): ' "$report" | grep -vE 'warnings? generated' >"$report.findings"; then
  sort -u "$report.findings"
  echo "lint: clang-tidy findings above (full log: $report)" >&2
  exit 1
fi
echo "lint: clang-tidy clean (${#host_sources[@]} files in $db)"
