#!/usr/bin/env bash
# The Python package's tests (python/tests, pytest) against PyTorch, as ctest's
# python_package: builds hypertrain._C with the project's CMake into
# build/python (-DHT_PYTHON=ON, target hypertrain_python), stages the package
# beside it (build/python/pkg) and runs pytest there. Where torch or pytest is
# not importable one line says the tests were skipped and why (exit 0): the
# fresh-machine check has no torch.
# usage: [PYTHON=python3] scripts/test-python.sh [PYTEST_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c 'import torch, pytest' 2> /dev/null; then
  echo "python package tests: skipped (torch or pytest is not importable by $py; pip install torch pytest)"
  exit 0
fi
mkdir -p build/python
cmake -S . -B build/python -DCMAKE_BUILD_TYPE=Release -DHT_PYTHON=ON -DPython3_EXECUTABLE="$(command -v "$py")" \
  > build/python/configure.log || { cat build/python/configure.log; exit 1; }
cmake --build build/python --target hypertrain_python -j"$(nproc)" > build/python/build.log ||
  { tail -40 build/python/build.log; exit 1; }
# hypertrain._C over the emulated CUDA backend, where the CUDA toolkit's headers are (test_cuda_tensors.py);
# grep reads the whole list: with -q it would stop at the match, cmake fail on the closed pipe, and pipefail
# take the target for absent
if cmake --build build/python --target help 2> /dev/null | grep '^\.\.\. hypertrain_python_emu$' > /dev/null; then
  cmake --build build/python --target hypertrain_python_emu -j"$(nproc)" >> build/python/build.log ||
    { tail -40 build/python/build.log; exit 1; }
  export HT_PYTHON_EMU=$PWD/build/python/emu
fi
stage=build/python/pkg/hypertrain
rm -rf "$stage"
mkdir -p "$stage"
cp -r python/hypertrain/. "$stage"/
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
cp build/python/_C*.so "$stage"/
# the package data python/setup.py puts in a wheel: the configs and the default corpus's regular files
mkdir -p "$stage/configs" "$stage/data/fortunes"
cp configs/*.yaml "$stage/configs"/
find "${HT_CORPUS:-/usr/share/games/fortunes}" -maxdepth 1 -type f -exec cp {} "$stage/data/fortunes"/ \;
cd build/python
PYTHONPATH=$PWD/pkg OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} exec "$py" -m pytest -q -p no:cacheprovider ../../python/tests "$@"
