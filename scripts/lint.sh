#!/usr/bin/env bash
# clang-format check on every source, clang-tidy (checks in .clang-tidy) on the host code.
# Fails on any formatting difference and on any clang-tidy error.
set -euo pipefail
BUILD=${1:-build}
mapfile -t sources < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
clang-format --dry-run --Werror "${sources[@]}"
echo "lint: clang-format clean (${#sources[@]} files)"

mapfile -t host_sources < <(git ls-files '*.cc')
report="$BUILD/clang-tidy.txt"
# clang-tidy exits non-zero on errors; collect everything, then judge the report.
printf '%s\n' "${host_sources[@]}" \
  | xargs -P "$(nproc)" -n 4 clang-tidy -p "$BUILD" --quiet >"$report" 2>&1 || true
if grep -E '(error|warning): ' "$report" | grep -vE 'warnings? generated' >"$report.findings"; then
  sort -u "$report.findings"
  echo "lint: clang-tidy findings above (full log: $report)" >&2
  exit 1
fi
echo "lint: clang-tidy clean (${#host_sources[@]} files)"
