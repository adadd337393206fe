"""CUDA tensors (docs/DESIGN.md, The Python package). Without the CUDA backend they are refused, saying what is
supported. Built over the emulated CUDA backend (target hypertrain_python_emu, which scripts/test-python.sh
builds where the CUDA toolkit's headers are), AdamW, Muon, the FP32 wrapper's model copies and
clip_grad_norm_ run on tensors that say cuda:0 and live in the emulator's device memory, through the kernel
table, against the CPU's steps (cuda_emu_worker.py). On a GPU: scripts/device-check-python.sh."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hypertrain
from fake_cuda import on_device
from hypertrain import _C, optim

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(_C.cuda_backend()[0] is not None, reason="this hypertrain has a CUDA backend")
def test_cuda_tensors_without_the_backend_are_refused_saying_what_is_supported():
    """AdamW, Muon (and so the FP32 wrapper, built over them) and clip_grad_norm_ name the tensor, why there
    is no CUDA backend, and what runs where."""
    p = on_device(torch.zeros(4, 4))
    supported = ", and this build has no CUDA backend \\(cmake -DHT_CUDA=ON, make build-cuda\\). hypertrain runs " \
                "AdamW, Muon, the FP32 main-param wrapper and clip_grad_norm_ on CPU tensors, and on CUDA tensors " \
                "when built with its CUDA backend"
    for make in (optim.AdamW, optim.Muon):
        with pytest.raises(ValueError, match=f"hypertrain.optim.{make.__name__}: param 0 is on cuda:0" + supported):
            make([p])
    p.grad = on_device(torch.ones(4, 4))
    with pytest.raises(ValueError, match="clip_grad_norm_: a gradient is on cuda:0" + supported):
        optim.clip_grad_norm_([p], 1.0)


def test_optimizers_on_cuda_tensors_of_the_emulated_device(tmp_path):
    emu = os.environ.get("HT_PYTHON_EMU")
    if not emu or not glob.glob(os.path.join(emu, "_C*.so")):
        pytest.skip("no hypertrain._C over the emulated CUDA backend (HT_PYTHON_EMU; scripts/test-python.sh builds "
                    "it where the CUDA toolkit's headers are)")
    pkg = tmp_path / "hypertrain"
    shutil.copytree(os.path.dirname(hypertrain.__file__), pkg,
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    for so in glob.glob(os.path.join(emu, "_C*.so")):
        shutil.copy(so, pkg)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{HERE}", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "cuda_emu_worker.py")], env=env, capture_output=True,
                       text=True, timeout=600)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every kernel call took the tensors' stream" in r.stdout
