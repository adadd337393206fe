#!/usr/bin/env bash
# The Python package installs from this clone with the documented command
# (pip install ./python), here into a fresh virtual environment (Debian's
# Python refuses pip outside one: PEP 668), and its extension module loads and
# computes. torch is not installed (--no-deps: its wheels are several GB; the
# fresh-machine check stays without it), so the module is loaded by file, not
# through the package's __init__ (which imports torch).
# usage: [PYTHON=/usr/bin/python3] scripts/python-install-check.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
venv=${1:-$(mktemp -d)/venv}
"$py" -m venv --system-site-packages "$venv"
# setuptools from the system (python3-setuptools): no build dependency is fetched
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation ./python
cd /
HT_VENV=$venv "$venv/bin/python" - <<'PY'
import ctypes, glob, importlib.machinery, importlib.util, math, os, struct

spec = importlib.util.find_spec("hypertrain")  # finds the installed package without importing it
where = spec.submodule_search_locations[0]
assert os.path.realpath(where).startswith(os.path.realpath(os.environ["HT_VENV"])), f"found {where}, not the venv's"
so = glob.glob(os.path.join(where, "_C*.so"))
assert so, f"no extension module in {where}"
loader = importlib.machinery.ExtensionFileLoader("hypertrain._C", so[0])
C = importlib.util.module_from_spec(importlib.util.spec_from_loader("hypertrain._C", loader))
loader.exec_module(C)
x = (1.5, -2.0, 0.25)
buf = bytearray(struct.pack("3f", *x))
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert C.sum_squares(addr, 3) == sum(v * v for v in x)
assert "CosineWithWarmUpLR" in C.lr_types()
lr = C.lr_at("CosineWithWarmUpLR", 5, base_lr=1.0, warmup_steps=0, total_steps=10)
assert abs(lr - 0.5 * (1 + math.cos(math.pi * 0.5))) < 1e-12, lr
print(f"python package: installed in {where}; hypertrain._C loads and computes (sum of squares, schedules)")
PY
