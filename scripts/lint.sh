#!/usr/bin/env bash
# clang-format check on every source, clang-tidy on the host code.
set -euo pipefail
BUILD=${1:-build}
mapfile -t sources < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
clang-format --dry-run --Werror "${sources[@]}"
mapfile -t host_sources < <(git ls-files '*.cc' | grep -vE '^tests/python/')
clang-tidy -p "$BUILD" --quiet "${host_sources[@]}" 2>/dev/null | { grep -E 'error:' || true; } > "$BUILD/clang-tidy.txt"
if [[ -s "$BUILD/clang-tidy.txt" ]]; then
  cat "$BUILD/clang-tidy.txt"
  echo "lint: clang-tidy reported errors" >&2
  exit 1
fi
echo "lint: clean (${#sources[@]} files formatted, ${#host_sources[@]} tidied)"
