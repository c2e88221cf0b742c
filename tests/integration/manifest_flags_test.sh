#!/usr/bin/env bash
# The decode-server args of every Kubernetes Deployment under deploy/k8s are flags this
# decode_server accepts (`--check_flags`: validated as a start would, nothing allocated),
# and the check can fail: the same args with a bad value are refused with exit code 2.
#   manifest_flags_test.sh DECODE_SERVER REPO_ROOT
set -euo pipefail
server=$1
root=$2
fail() { echo "manifest_flags_test: $*" >&2; exit 1; }
mapfile -t manifests < <(grep -rl -- '- --listen=' "$root/deploy/k8s" | sort)
[[ ${#manifests[@]} -ge 2 ]] || fail "expected the base and GPU deployments, found ${#manifests[@]}"
for manifest in "${manifests[@]}"; do
  # The container's args: list items that are flags (`- --name[=value]`).
  mapfile -t args < <(sed -nE 's/^[[:space:]]+- (--[a-z_]+(=[^[:space:]#]*)?)[[:space:]]*$/\1/p' "$manifest")
  [[ ${#args[@]} -ge 5 ]] || fail "$manifest: only ${#args[@]} args found"
  out=$("$server" --check_flags "${args[@]}" 2>&1) || fail "$manifest: refused: $out"
  echo "ok: ${manifest#"$root"/} (${#args[@]} args): $out"
  for bad in --page_size=3 --cpu_prewake_us=-1 --cpu_prewake_us=10001; do
    rc=0
    "$server" --check_flags "${args[@]}" "$bad" >/dev/null 2>&1 || rc=$?
    [[ $rc -eq 2 ]] || fail "$manifest: $bad gave exit code $rc, not 2"
  done
done
