#!/usr/bin/env bash
# Installs what the build, the tests and the demo need, and nothing when all is there.
# Debian packages (apt-get update once, only if something is missing) and the Python
# client's PyPI packages. Idempotent; safe to run on every `make`.
set -euo pipefail

DEB_PACKAGES=(
  cmake ninja-build g++ make pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libcivetweb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  prometheus gnuplot-nox curl clang-format clang-tidy python3-pip python3-venv python3-yaml
)

missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
# The client's runtime packages and what builds its wheel (setuptools, wheel, grpcio-tools;
# wheel for a setuptools older than 70.1); the Python tests install that wheel into a
# venv over these (tests/python/install_client.sh).
PY_PACKAGES=(grpcio grpcio-tools protobuf numpy ml_dtypes setuptools wheel)
if ! "$PY" -c 'import grpc, grpc_tools, numpy, google.protobuf, ml_dtypes, setuptools, wheel' \
  2>/dev/null; then
  echo "install_deps: installing Python packages (${PY_PACKAGES[*]})"
  "$PY" -m pip install -q --disable-pip-version-check "${PY_PACKAGES[@]}" \
    || "$PY" -m pip install -q --break-system-packages "${PY_PACKAGES[@]}"
fi
