#!/usr/bin/env bash
# Bundles every binary the GPU run needs, with its non-libc shared libraries, into
# ./gpu_bundle/{bin,lib} (or $GPU_BUNDLE_OUT; ignored by git; carry it to the GPU machine,
# see DEVICE.md).
#   scripts/gpu_bundle.sh [BUILD_DIR ...]   (default: build-cuda, then build-cuda-priv)
#   scripts/gpu_bundle.sh --server [BUILD_DIR ...]   (default: build-e2e)
# --server (for scripts/gpu_server_run.sh) requires decode_server, echo_server,
# decode_loadgen and the integration tests instead of the GPU tests, strips their debug
# info (strip --strip-debug), and adds promtool xz-compressed (bin/promtool.xz, cached
# in ~/.cache/sds_gpu_bundle) when it is installed here; prometheus too (9 MB more)
# with GPU_BUNDLE_PROMETHEUS=1 (without it, the Prometheus scrape test skips there).
set -euo pipefail
cd "$(dirname "$0")/.."
server=0
if [[ ${1:-} == --server ]]; then
  server=1
  shift
fi
dirs=("$@")
if [[ ${#dirs[@]} -eq 0 ]]; then
  if [[ $server -eq 1 ]]; then dirs=(build-e2e); else dirs=(build-cuda build-cuda-priv); fi
fi
out=${GPU_BUNDLE_OUT:-gpu_bundle}  # another ignored /gpu_bundle*/ name keeps bundles apart
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
wanted=(sds_gpu_tests sds_gpu_bench decode_server sds_loadgen)
server_bins=(decode_server echo_server decode_loadgen itest_decode_test itest_errors_test
  itest_fork_release_test itest_drain_test itest_metrics_test itest_tenancy_test)
must=(sds_gpu_tests sds_gpu_bench)
if [[ $server -eq 1 ]]; then
  wanted+=("${server_bins[@]:1}")
  must=("${server_bins[@]}")
fi
for name in "${wanted[@]}"; do
  for d in "${dirs[@]}"; do
    [[ -d $d ]] || continue
    bin=$(find "$d" -type f -name "$name" -perm -u+x 2>/dev/null | head -1)
    if [[ -n $bin ]]; then
      cp -L "$bin" "$out/bin/"
      if [[ $server -eq 1 ]] && printf '%s\n' "${server_bins[@]}" | grep -qx "$name"; then
        strip --strip-debug "$out/bin/$name"
      fi
      ldd "$bin" | awk '/=> \//{print $3}' |
        grep -vE 'libc\.so|libm\.so|libpthread|libdl\.so|ld-linux|librt\.so' |
        xargs -r -I{} cp -Lu {} "$out/lib/"
      echo "bundled $bin"
      break
    fi
  done
done
for m in "${must[@]}"; do
  [[ -x $out/bin/$m ]] || { echo "gpu_bundle: $m not built" >&2; exit 1; }
done
if [[ $server -eq 1 ]]; then
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/sds_gpu_bundle
  mkdir -p "$cache"
  tools=(promtool)
  [[ ${GPU_BUNDLE_PROMETHEUS:-0} == 1 ]] && tools+=(prometheus)
  for tool in "${tools[@]}"; do
    src=$(command -v "$tool" || true)
    [[ -n $src ]] || { echo "gpu_bundle: no $tool here; its test will skip there"; continue; }
    if [[ ! -s $cache/$tool.xz || $src -nt $cache/$tool.xz ]]; then
      xz -T2 -6 -c "$src" >"$cache/$tool.xz.tmp" && mv "$cache/$tool.xz.tmp" "$cache/$tool.xz"
    fi
    cp "$cache/$tool.xz" "$out/bin/"
    echo "bundled $src (xz)"
  done
fi
du -sh "$out"
