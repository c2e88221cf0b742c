#!/usr/bin/env bash
# Installs the Python client the way a user does, for the Python tests: builds its wheel
# (no network: the build uses this Python's setuptools and grpcio-tools), checks the build
# wrote nothing into the source folder, and installs the wheel into a fresh venv.
#
#   install_client.sh PYTHON PACKAGE_DIR OUT_DIR    -> OUT_DIR/dist/*.whl, OUT_DIR/venv
#
# The venv sees the system site-packages: that is where scripts/install_deps.sh put
# grpcio, protobuf, numpy and ml_dtypes, and the only place they come from offline. pip
# installs the wheel with --no-index, so it still checks the wheel's requirements
# (protobuf of the generated code's major version, grpcio, ...) against them.
set -euo pipefail
py=$1 pkg=$2 out=$3

listing() { find "$pkg" -printf '%P %s %T@\n' | sort; }
before=$(listing)
rm -rf "$out/dist" "$out/venv"
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
  "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$out/dist" "$pkg"
if [[ "$(listing)" != "$before" ]]; then
  echo "install_client: building the wheel changed the source folder $pkg:" >&2
  diff <(echo "$before") <(listing) >&2 || true
  exit 1
fi
wheels=("$out"/dist/sparse_decode_client-*.whl)

if ! "$py" -m venv --system-site-packages "$out/venv"; then
  echo "install_client: '$py -m venv' failed (Debian's python3 needs python3-venv:" \
    "scripts/install_deps.sh installs it)" >&2
  exit 1
fi
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
  "$out/venv/bin/python" -m pip install -q --no-index "${wheels[@]}"
where=$("$out/venv/bin/python" -c 'import sparse_decode_client as m; print(m.__file__)')
case "$where" in
  "$out/venv/"*) echo "install_client: ${wheels[*]##*/} installed in $out/venv" ;;
  *) echo "install_client: the venv imports sparse_decode_client from $where" >&2; exit 1 ;;
esac
