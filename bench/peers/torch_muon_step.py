#!/usr/bin/env python3
"""PyTorch peer for hypertrain's Muon-step benchmark (bench/bench_muon.c):
--params matrices of --size x --size, bf16 model params with FP32 master
copies. One step = torch.optim.Muon.step() on the FP32 masters (grads set in
FP32, as main_grad is) + the cast back of every master into its bf16 model
param. Muon: lr 0.02, momentum 0.95, nesterov, weight decay 0.1, 5 iterations,
adjust_lr_fn "match_rms_adamw" (hypertrain runs asym5 coefficients, torch its
legacy triple: same cost).

--ns bf16: torch's stock Newton-Schulz (operands and products in bf16).
--ns fp32: the FP32 Newton-Schulz of tools/reference/make_muon_fixtures.py
           monkeypatched in (what hypertrain's default F32 path computes).
Prints one JSON line: ms/step (best and mean of --steps timed steps after
--warmup untimed ones) and the Newton-Schulz GFLOP/s that implies.

Usage: python3 bench/peers/torch_muon_step.py [--threads 2] [--params 48]
           [--size 1024] [--steps 2] [--warmup 1] [--ns bf16|fp32]
"""

import argparse
import json
import time

import torch
import torch.optim._muon as torch_muon


def ns_fp32(grad, ns_coefficients, ns_steps, eps):
    a, b, c = ns_coefficients
    X = grad.to(torch.float32, copy=True)
    tall = grad.size(0) > grad.size(1)
    if tall:
        X = X.T
    X = X * float(1.0 / (X.double().norm().item() + eps))
    for _ in range(ns_steps):
        S = X @ X.T
        T = torch.addmm(S, S, S, beta=b, alpha=c)
        X = torch.addmm(X, T, X, beta=a)
    return X.T if tall else X


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--params", type=int, default=48)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ns", choices=["bf16", "fp32"], default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ns == "fp32":
        torch_muon._zeropower_via_newtonschulz = ns_fp32

    gen = torch.Generator().manual_seed(0)
    n = args.size
    model = [(0.02 * torch.randn(n, n, generator=gen)).to(torch.bfloat16) for _ in range(args.params)]
    master = [p.float() for p in model]
    for p in master:
        p.grad = torch.randn(n, n, generator=gen)
    opt = torch.optim.Muon(master, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                           adjust_lr_fn="match_rms_adamw")

    def step():
        opt.step()
        for m, p in zip(model, master):
            m.copy_(p)  # the cast back to bf16 (round to nearest even)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    flops = args.params * 5 * 3 * 2.0 * n**3  # S = X Xᵀ, S S, T X per iteration
    print(json.dumps({
        "engine": "pytorch", "torch": torch.__version__, "ns": args.ns, "threads": args.threads,
        "params": args.params, "size": n, "ms_per_step_best": round(min(times) * 1e3, 1),
        "ms_per_step_mean": round(sum(times) / len(times) * 1e3, 1),
        "ns_gflops_step": round(flops / min(times) * 1e-9, 1),
    }))


if __name__ == "__main__":
    main()
