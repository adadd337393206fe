#!/usr/bin/env bash
# Installs the Debian packages hypertrain builds and runs with, when any is
# missing. Idempotent: a machine that has them all is left untouched.
set -euo pipefail

packages=(
  build-essential cmake pkg-config clang clang-format
  libdnnl-dev        # GEMM: oneDNN picks its own kernels (AVX-512, AMX)
  libyaml-dev        # the configuration file
  libopenmpi-dev openmpi-bin
  libcmocka-dev      # the test suite
  libomp-dev         # OpenMP for clang builds
  fortunes           # the default corpus: English text under /usr/share/games/fortunes
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
