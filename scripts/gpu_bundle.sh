#!/usr/bin/env bash
# Bundles every binary the GPU run needs, with its non-libc shared libraries, into
# ./gpu_bundle/{bin,lib} (ignored by git; carry it to the GPU machine, see DEVICE.md).
#   scripts/gpu_bundle.sh [BUILD_DIR ...]   (default: build-cuda, then build-cuda-priv)
set -euo pipefail
cd "$(dirname "$0")/.."
dirs=("$@")
[[ ${#dirs[@]} -eq 0 ]] && dirs=(build-cuda build-cuda-priv)
out=gpu_bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
wanted=(sds_gpu_tests sds_gpu_bench decode_server sds_loadgen)
for name in "${wanted[@]}"; do
  for d in "${dirs[@]}"; do
    [[ -d $d ]] || continue
    bin=$(find "$d" -type f -name "$name" -perm -u+x 2>/dev/null | head -1)
    if [[ -n $bin ]]; then
      cp -L "$bin" "$out/bin/"
      ldd "$bin" | awk '/=> \//{print $3}' |
        grep -vE 'libc\.so|libm\.so|libpthread|libdl\.so|ld-linux|librt\.so' |
        xargs -r -I{} cp -Lu {} "$out/lib/"
      echo "bundled $bin"
      break
    fi
  done
done
for must in sds_gpu_tests sds_gpu_bench; do
  [[ -x $out/bin/$must ]] || { echo "gpu_bundle: $must not built" >&2; exit 1; }
done
du -sh "$out"
