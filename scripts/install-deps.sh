#!/usr/bin/env bash
# Installs the Debian packages hypertrain builds, tests and trains with, when
# any is missing. Idempotent: a machine that has them all is left untouched.
# Recommends are not installed, so every package the build needs is named here.
set -euo pipefail

packages=(
  build-essential    # gcc, make and the C library headers
  cmake              # the build
  pkg-config         # finds libyaml and cmocka for CMake
  clang              # the second compiler the test suite builds with
  clang-format       # the formatting check of the test suite
  libomp-dev         # OpenMP for the clang build (gcc brings its own)
  libclang-rt-14-dev # libFuzzer and the sanitizers' runtime for clang: the fuzz targets
  libdnnl-dev        # GEMM: oneDNN matmul (f32, and bf16 where the CPU has it)
  libyaml-dev        # the configuration file
  libxxhash-dev      # XXH64, the content hash of checkpoint files
  libopenmpi-dev     # MPI headers and library
  openmpi-bin        # mpirun
  libcmocka-dev      # the test framework
  qemu-user          # the test suite runs the binary on emulated older CPUs
  procps             # pgrep and pkill: the MPI tests kill one rank of their own run
  fortunes           # the default corpus: English text under /usr/share/games/fortunes
  python3-dev        # the Python package's extension module (pip install ./python): CPython's headers
  python3-venv       # the virtual environment Debian's Python installs packages into (PEP 668)
  python3-setuptools # the package's build backend, from Debian (nothing fetched to build it)
  python3-wheel      # setuptools' bdist_wheel, which pip builds the package with
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
