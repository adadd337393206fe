"""hypertrain.optim under PyTorch's fully_shard (FSDP2, DTensor Shard(0) params, gloo) on 2, 3 and 4
ranks against one process (fsdp_worker.py, one torchrun per rank count): AdamW steps each rank's rows,
Muon gathers each matrix whole for Newton-Schulz (the seed's allgather strategy) and keeps its rows,
or (deredundancy) has each matrix's owner do it and scatter the rows, bit for bit the same;
clip_grad_norm_ reduces the norm over the mesh; uneven shards included. The FP32 main-param wrapper on a
bf16 model: FP32 reduced gradients as main_grads, against one process running each rank's rows as a
micro-batch, and its state dict resumed sharded or from whole tensors; set_gradient_scaling_factor; a state
tensor of the whole matrix in a sharded optimizer refused at the step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fully_shard_against_one_process(ranks):
    worker = Path(__file__).with_name("fsdp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        str(worker)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"torchrun on {ranks} ranks failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for line in (f"fully_shard on {ranks} ranks:", *(["fully_shard on 4 ranks (HSDP 2 x 2):"] if ranks == 4 else []),
                 "fp32 main params under fully_shard",
                 f"gradient scaling factor on {ranks} ranks", f"state layout on {ranks} ranks"):
        assert line in r.stdout, r.stdout
