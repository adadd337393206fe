#!/usr/bin/env bash
# The Python package as a user gets it: a wheel built from this clone with the
# README's command (pip wheel ./python), which must leave the source tree as it
# was, then installed into a fresh virtual environment that sees nothing of
# this machine's Python (no system site packages: no torch), where, from
# another directory, `import hypertrain` loads no MPI, the extension module
# holds no AVX-512 code of its own (compiled for x86-64-v3; oneDNN picks its
# kernels at run time) and computes, and the README's train() example runs the
# packaged default config on the packaged corpus, quiet. Where this machine's
# Python has torch, the wheel is also installed beside it (--system-site-packages)
# and an optimizer steps a torch tensor. Debian's Python refuses pip outside a
# virtual environment (PEP 668); setuptools and wheel come from Debian
# (python3-setuptools, python3-wheel: nothing is fetched to build).
# usage: [PYTHON=/usr/bin/python3] scripts/python-install-check.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
work=${1:-$(mktemp -d)}
mkdir -p "$work"

# pip from the venv; setuptools and wheel (bdist_wheel) from the system: the venv's own setuptools (ensurepip's)
# would hide them
"$py" -m venv --system-site-packages "$work/build-venv"
"$work/build-venv/bin/python" -m pip uninstall -q -y setuptools
before=$(git status --porcelain --ignored 2>/dev/null || true)
"$work/build-venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation ./python -w "$work/wheels"
after=$(git status --porcelain --ignored 2>/dev/null || true)
if [ "$before" != "$after" ]; then
  echo "python package: building the wheel wrote into the source tree:"
  diff <(echo "$before") <(echo "$after") || true
  exit 1
fi
wheel=$(ls "$work"/wheels/hypertrain-*.whl)

"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"
cd "$work"
HT_WHEEL=$wheel "$work/venv/bin/python" - <<'PY'
import ctypes, glob, os, struct, subprocess, sys, tempfile

import hypertrain
from hypertrain import _C

assert "torch" not in sys.modules, "import hypertrain imported torch"
maps = open("/proc/self/maps").read()
assert "libmpi" not in maps, "import hypertrain loaded MPI"
so = glob.glob(os.path.join(os.path.dirname(hypertrain.__file__), "_C*.so"))[0]
code = subprocess.run(["objdump", "-d", so], check=True, capture_output=True, text=True).stdout
assert "%zmm" not in code, f"{so} holds AVX-512 instructions: not built for x86-64-v3"
x = (1.5, -2.0, 0.25)
buf = bytearray(struct.pack("3f", *x))
assert _C.sum_squares(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 3) == sum(v * v for v in x)
try:
    hypertrain.optim
    raise AssertionError("hypertrain.optim without torch did not say torch is missing")
except ImportError as e:
    assert "needs PyTorch" in str(e), e
out = tempfile.mkdtemp()
r = hypertrain.train(overrides={"training.steps": 2, "checkpoint.output_dir": out}, quiet=True)
assert r.final["step"] == 2 and 0 < r.final["loss"] < 6, r.final
print(f"python package: the wheel {os.path.basename(os.environ['HT_WHEEL'])} "
      f"({os.path.getsize(os.environ['HT_WHEEL']) >> 20} MiB) installs in a venv without torch; import "
      f"loads no MPI, _C has no AVX-512 code, train() ran the packaged default config 2 steps, loss "
      f"{r.final['loss']:.4f}")
PY
# quiet=True: no info lines (warnings and errors only)
"$work/venv/bin/python" -c "import hypertrain, tempfile; hypertrain.train(overrides={'training.steps': 1, \
'checkpoint.output_dir': tempfile.mkdtemp()}, quiet=True)" 2> "$work/quiet.log"
if grep -q '^\[hypertrain info\]' "$work/quiet.log"; then
  echo "python package: train(quiet=True) logged info lines:"
  grep '^\[hypertrain info\]' "$work/quiet.log" | head -5
  exit 1
fi

if "$py" -c "import torch" 2> /dev/null; then
  "$py" -m venv --system-site-packages "$work/torch-venv"
  "$work/torch-venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"
  "$work/torch-venv/bin/python" - <<'PY'
import torch

import hypertrain

p = torch.nn.Parameter(torch.ones(4, 4))
opt = hypertrain.get_hyper_optimizer(muon_params=[p], muon_semantics="torch", muon_kwargs={"lr": 0.1})
p.grad = torch.eye(4)
opt.step()
assert not torch.equal(p.detach(), torch.ones(4, 4))
print("python package: the wheel beside torch: get_hyper_optimizer's Muon steps a tensor")
PY
fi
