"""torch's distributed checkpoint (DCP) with the FP32 main-param wrapper
under fully_shard (dcp_worker.py, torchrun, gloo): saved on 4 ranks with
get_model_state_dict / get_optimizer_state_dict and dcp.save, resumed there
bitwise (and from the wrapper's plain state_dict()), loaded on 2 ranks and
on 1 (with and without fully_shard) with set_model_state_dict /
set_optimizer_state_dict: the optimizer state and every FP32 main param
bitwise the saved ones, and the next steps within docs/NUMERICS.md's floor
rule of the run that went on."""

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("dcp_worker.py")


def torchrun(ranks, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        str(WORKER), *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"torchrun on {ranks} ranks {args} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_dcp_saved_on_4_ranks_loads_on_2_and_1(tmp_path):
    out = torchrun(4, "save", str(tmp_path))
    assert "saved on 4 ranks: resumed there from DCP and from the plain state_dict bitwise" in out, out
    print(out)
    for ranks in (2, 1):
        out = torchrun(ranks, "load", str(tmp_path))
        assert f"loaded on {ranks} ranks (fully_shard): the state bitwise the saved one" in out, out
        if ranks == 1:
            assert "loaded on 1 ranks (no fully_shard)" in out, out
        print(out)
