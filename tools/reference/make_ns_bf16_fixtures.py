#!/usr/bin/env python3
"""Write tests/fixtures/optim/muon_ns_bf16.safetensors: what torch.optim.Muon's
own bf16 Newton-Schulz makes of a few gradient-sized matrices, next to the
float64 result of the same iteration, so that hypertrain's bf16 Newton-Schulz
(ns_dtype bfloat16) can be held to "at least as accurate as torch".

For each case <m> (shapes 48x160, 160x48, 96x96; a Gaussian matrix and a
rank-4-plus-noise one, like a gradient):

  input.<m>    F32 (r, c)  the matrix G
  f64.<m>      F32 (r, c)  the iteration in float64, rounded to float32
  torch.<m>    F32 (r, c)  torch's bf16 iteration (the bf16 values, widened)

The iteration is docs/NUMERICS.md's with the asym5 schedule (5 steps), eps 1e-7:
a tall G is transposed, X = G / max(||G||, eps), then per step
A = X Xᵀ, B = b A + c A A, X = a X + B X. torch's version is the one in
torch/optim/_muon.py (_zeropower_via_newtonschulz): X held in bf16, the two
updates as torch.addmm on bf16 tensors (FP32 accumulation, one rounding each),
looped here over the five asym5 triples (torch's takes one triple).

Every run with the same library versions writes the same bytes (fixed seed,
one metadata key). Usage: python3 tools/reference/make_ns_bf16_fixtures.py [OUT]
"""

import sys

import torch
from safetensors.torch import save_file

ASYM5 = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
         (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
EPS = 1e-7


def ns_float64(g):
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), EPS)
    for a, b, c in ASYM5:
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).float().contiguous()


def ns_torch_bf16(g):
    x = g.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=EPS))
    for a, b, c in ASYM5:
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return (x.T if tall else x).float().contiguous()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/optim/muon_ns_bf16.safetensors"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for r, c in [(48, 160), (160, 48), (96, 96)]:
        for kind in ("gauss", "lowrank"):
            if kind == "gauss":
                g = torch.randn(r, c, generator=gen)
            else:
                g = torch.randn(r, 4, generator=gen) @ torch.randn(4, c, generator=gen) + 0.05 * torch.randn(
                    r, c, generator=gen)
            name = f"{kind}_{r}x{c}"
            tensors[f"input.{name}"] = g.contiguous()
            tensors[f"f64.{name}"] = ns_float64(g)
            tensors[f"torch.{name}"] = ns_torch_bf16(g)
    save_file(tensors, out, metadata={"about": f"asym5 Newton-Schulz, torch {torch.__version__}"})
    for k in sorted(tensors):
        if k.startswith("torch."):
            m = k[6:]
            ref = tensors["f64." + m]
            e = ((tensors[k] - ref).abs().max() / ref.abs().max()).item()
            print(f"{m}: torch bf16 {e:.3g} from float64")


if __name__ == "__main__":
    main()
