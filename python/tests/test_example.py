"""The README's example (python/examples/seed_002.py, seed 002's own code adapted to run) trains."""

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
