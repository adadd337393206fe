#!/usr/bin/env python3
"""PyTorch peer for bench/run_ns_forms.sh: Newton-Schulz of one (rows, cols)
matrix as torch.optim.Muon computes it (torch.optim._muon._zeropower_via_newtonschulz:
bf16, five iterations of (3.4445, -4.7750, 2.0315)), fastest of --rounds
after one untimed call. Prints one JSON line.
Usage: torch_ns.py --rows R --cols C [--rounds 5] [--threads 2]"""
import argparse
import json
import time

import torch
from torch.optim import _muon


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--cols", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.randn(a.rows, a.cols, generator=torch.Generator().manual_seed(0))
    coeffs = (3.4445, -4.7750, 2.0315)
    _muon._zeropower_via_newtonschulz(g, coeffs, 5, 1e-7)
    best = float("inf")
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        _muon._zeropower_via_newtonschulz(g, coeffs, 5, 1e-7)
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"engine": "pytorch", "torch": torch.__version__, "rows": a.rows, "cols": a.cols,
                      "bf16_ns_ms": round(best * 1e3, 2)}))


if __name__ == "__main__":
    main()
