#!/usr/bin/env python3
"""PyTorch peer for bench/bench_adamw.c: one AdamW step on 48 tensors of
1024x1024 (50.3M params) in the Megatron mixed-precision layout: bf16 model
params, FP32 master copies that torch.optim.AdamW updates from FP32 grads,
then the copy of every master back into its bf16 param (round to nearest
even), on CPU.

Runs each torch.optim.AdamW implementation (--impl all: the single-tensor
default on CPU, foreach=True, fused=True) and prints one JSON line per
implementation plus one for the fastest, with ns/param over --steps timed
steps (median) after --warmup untimed ones; a step = optimizer.step() + the
copy back.

Usage: python3 bench/peers/torch_adamw_step.py [--threads 2] [--steps 5]
           [--warmup 2] [--tensors 48] [--rows 1024] [--impl all|single|foreach|fused]
"""

import argparse
import json
import statistics
import time

import torch


def run(impl, args):
    torch.manual_seed(0)
    shape = (args.rows, 1024)
    model = [(torch.rand(shape) * 0.5 - 0.25).to(torch.bfloat16) for _ in range(args.tensors)]
    master = [torch.nn.Parameter(m.float()) for m in model]
    for p in master:
        p.grad = torch.randn(shape) * 1e-2
    kw = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    opt = torch.optim.AdamW(master, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    times = []
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.step()
        with torch.no_grad():
            for m, p in zip(model, master):
                m.copy_(p)
        dt = time.perf_counter() - t0
        if s >= args.warmup:
            times.append(dt)
    n = sum(p.numel() for p in master)
    med = statistics.median(times)
    return {"engine": "pytorch", "impl": impl, "params": n, "threads": torch.get_num_threads(), "steps": args.steps,
            "ms_per_step": round(med * 1e3, 2), "ns_per_param": round(med * 1e9 / n, 3),
            "best_ns_per_param": round(min(times) * 1e9 / n, 3), "torch": torch.__version__}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--impl", default="all", choices=["all", "single", "foreach", "fused"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    impls = ["single", "foreach", "fused"] if args.impl == "all" else [args.impl]
    results = [run(i, args) for i in impls]
    for r in results:
        print(json.dumps(r))
    best = min(results, key=lambda r: r["ns_per_param"])
    print(json.dumps(dict(best, impl="fastest:" + best["impl"])))


if __name__ == "__main__":
    main()
