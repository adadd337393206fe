"""The README's examples train: python/examples/seed_002.py (seed 002's own code adapted to run) and
python/examples/seed_002_fsdp.py (its sharded-optimizer block as written, under torchrun); seed 002's
imports run with hypertrain for hyper_parallel."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "seed_002.py")


def test_seed_example_trains():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, EXAMPLE, "20"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 0.3, f"the loss did not fall: {losses}"


FSDP_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "seed_002_fsdp.py")


def test_seed_imports_run_after_one_rename():
    """Seed 002's imports, hyper_parallel renamed hypertrain."""
    from hypertrain import fully_shard, init_device_mesh  # noqa: F401
    from hypertrain.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer
    import hypertrain
    assert get_hyper_optimizer is hypertrain.optim.get_hyper_optimizer
    assert get_hyper_lr_scheduler is hypertrain.lr_scheduler.get_hyper_lr_scheduler


def test_seed_fsdp_block_trains_under_torchrun():
    """python/examples/seed_002_fsdp.py: the seed's sharded-optimizer block as written (the rename; its "..." the
    seed's own kwargs) on 2 gloo ranks: the groups listed before fully_shard reach the sharded params, each rank
    holds its rows of Muon's state, and the loss falls."""
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          FSDP_EXAMPLE, "20"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 20
    assert losses[-1] < losses[0] - 0.3, f"the loss did not fall: {losses}"
    assert "q_proj.weight is a DTensor of (64, 64), its Muon momentum_buffer (32, 64) on rank 0 of 2" in out.stdout, \
        out.stdout
