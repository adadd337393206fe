#!/usr/bin/env python3
"""The optimizer step from Python on Qwen2.5-0.5B's tensors (issue 23): hypertrain.optim
against torch.optim, side by side (bench/run_py_optim.sh runs each in its own process).

The tensors: Qwen2.5-0.5B's shapes (24 layers of q (896, 896), k and v (128, 896),
o (896, 896), gate and up (4864, 896), down (896, 4864), q/k/v biases, two norms;
the embedding (151936, 896), tied; the final norm), float32, random values and
gradients, 494M values. --opt:
  hypertrain_adamw / torch_adamw: AdamW on every tensor (torch: fused=True)
  hypertrain_muon / torch_muon: Muon on the layers' 168 matrices, Newton-Schulz in
      --ns-dtype (torch.optim.Muon computes it in bf16; --ns-dtype float32 replaces its
      Newton-Schulz by the same iteration in float32, the one hypertrain runs by default)
One line: seconds a step (the mean of --steps after one untimed), the peak RSS
and what the tensors alone take (params + grads), in MiB.

--layers N steps N of the 24 layers' tensors (Muon: torch's bf16 Newton-Schulz on a CPU
without native bf16 takes minutes a step on all 24).

Usage: python3 bench/peers/py_optim_step.py --opt OPT [--threads 2] [--steps 3] [--layers 24]
           [--ns-dtype float32|bfloat16]
"""

import argparse
import resource
import time

import torch

LAYERS, C, KV, F, V = 24, 896, 128, 4864, 151936


def tensors(muon_only, layers):
    shapes = []
    for _ in range(layers):
        shapes += [(C, C), (KV, C), (KV, C), (C, C), (F, C), (F, C), (C, F)]
        if not muon_only:
            shapes += [(C,), (KV,), (KV,), (C,), (C,)]
    if not muon_only:
        shapes += [(V, C), (C,)]
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(0.02 * torch.randn(s, generator=gen))
        p.grad = 0.001 * torch.randn(s, generator=gen)
        params.append(p)
    return params


def torch_ns_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz iteration, in float32 instead of bf16."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opt", required=True, choices=["hypertrain_adamw", "torch_adamw", "hypertrain_muon", "torch_muon"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="Newton-Schulz's dtype (torch_muon: bfloat16 is torch's own)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers whose tensors are stepped")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = tensors(args.opt.endswith("muon"), args.layers)
    base_mib = sum(2 * p.numel() * 4 for p in params) / 2**20
    if args.opt == "torch_adamw":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    elif args.opt == "torch_muon":
        if args.ns_dtype == "float32":
            import torch.optim._muon as torch_muon
            torch_muon._zeropower_via_newtonschulz = torch_ns_float32
        opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    else:
        import hypertrain.optim as hopt
        if args.opt == "hypertrain_adamw":
            opt = hopt.AdamW(params, lr=1e-3, weight_decay=0.01)
        else:
            opt = hopt.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw",
                            ns_dtype=args.ns_dtype)
    opt.step()  # the state allocated, every kernel warm
    t0 = time.perf_counter()
    for _ in range(args.steps):
        opt.step()
    dt = (time.perf_counter() - t0) / args.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra = f" ns_dtype={args.ns_dtype}" if args.opt.endswith("muon") else ""
    print(f"py_optim {args.opt}{extra} threads={args.threads} layers={args.layers} tensors={len(params)} "
          f"values={sum(p.numel() for p in params)} step_s={dt:.3f} peak_rss_mib={peak:.0f} "
          f"params_and_grads_mib={base_mib:.0f} torch={torch.__version__.split('+')[0]}", flush=True)


if __name__ == "__main__":
    main()
