#!/usr/bin/env python3
"""Write the Muon reference fixtures (docs/NUMERICS.md, Muon) under tests/fixtures/optim/.

muon_steps.safetensors: 10 optimizer steps on four parameters
  square (64, 64), wide (32, 96), tall (96, 32), experts (3, 24, 40)
  init.<p>           BF16 (shape)       initial params (bf16 values, so the same
                                        numbers start the F32 runs and the bf16 run)
  grad.<p>           F16  (10, shape)   main_grad of each step (F16-representable
                                        values: not bf16-representable, so a grad
                                        wrongly rounded to bf16 shows)
  lr                 F32  (10,)         the lr of each step (F32 values: the reference
                                        runs on these same numbers)
  <run>.sample.<p>   F32  (10, n/32)    params after step t = 1..10 at the flat
                                        indices i with i % 32 == (7 t) % 32
  <run>.final.<p>    F32  (shape)       params after step 10, every element
  momentum_<style>.sample.<p>  F32 (10, n/32)  momentum buffer, same indices
  Runs:
  (a) torch_original: torch.optim.Muon, adjust_lr_fn "original", nesterov on
      torch_rms_plain: torch.optim.Muon, adjust_lr_fn "match_rms_adamw", nesterov off
      Both: momentum style ema (torch's), legacy coefficients, 5 iterations,
      FP32 params. torch's _zeropower_via_newtonschulz runs in bf16 and divides
      by norm.clamp(min=eps); it is monkeypatched with ns_fp32 below, which
      follows docs/NUMERICS.md exactly in FP32 (X / (||X||_F + eps), the norm in
      double). torch.optim.Muon takes 2-D params only, so `experts` is a
      per-matrix loop of torch.optim.Muon: its E = 3 slices are E separate
      (24, 40) params of the same optimizer (init and each step's grad sliced
      from init.experts and grad.experts), so their scale is torch's own for
      the (24, 40) shape; the fixture's experts tensors stack the slices.
  (b) master_sum: a Megatron-style mixed-precision step written here: bf16
      model params, FP32 master copies updated by the `sum`-momentum Muon
      (B <- mu B + g; u = g + mu B), asym5, matched_adamw_rms 0.2, weight
      decay, then cast back to bf16 every step:
      master_sum.sample/final.<p> (F32) and model_bf16.sample/final.<p>
      (BF16, the model params: bf16 of the master).
  momentum_ema (runs a) and momentum_sum (run b): the buffers do not depend
  on nesterov or the params, so one per style.
  Hyperparameters: lr as stored, weight decay 0.1, momentum 0.95, ns_eps 1e-7.

muon_ns.safetensors: Newton-Schulz alone, float64 NumPy, on three matrices
  input.<m>        F32 (shape)  m = wide (16, 24), tall (24, 16), square (20, 20)
                                (square has singular values spread over 1e-3..1)
  <sched>.coeffs   I64 (K, 3)   the expanded schedule: float64 bit patterns (the
                                hypertrain safetensors reader has no F64)
  <sched>.<m>      F32 (shape)  NS(input.<m>) in float64, rounded to F32
  Schedules: legacy (ns_steps 5), asym5 (ns_steps 5), polar_express (ns_steps
  7: the last triple repeats), deepseek_v4 (K = 10), custom ([3.0, -3.2, 1.2]
  with ns_steps 4), segmented ([[[4.0848, -6.8946, 2.9270], 2],
  [[2.0, -1.5, 0.5], 3]]).

Deterministic (fixed seeds, one torch thread): rerunning writes identical bytes.
Usage: python3 tools/reference/make_muon_fixtures.py [OUT_DIR]
"""

import math
import os
import sys

import numpy as np
import torch
import torch.optim._muon as torch_muon
from safetensors.torch import save_file

STEPS = 10
STRIDE = 32
SHAPES = {"square": (64, 64), "wide": (32, 96), "tall": (96, 32), "experts": (3, 24, 40)}
WD, MU, EPS = 0.1, 0.95, 1e-7
# Varies, so the step must take the lr it is given; F32 values, stored exactly.
LR = [float(np.float32(0.02 * (1.0 - 0.05 * t))) for t in range(STEPS)]

LEGACY = [(3.4445, -4.7750, 2.0315)]
ASYM5 = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
         (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def schedule(variant, ns_steps, custom=None):
    """The per-iteration triples (docs/NUMERICS.md, coefficient schedules)."""
    if variant == "legacy":
        return LEGACY * ns_steps
    if variant == "asym5":
        assert ns_steps <= 5
        return ASYM5[:ns_steps]
    if variant == "polar_express":
        return [POLAR_EXPRESS[min(k, 4)] for k in range(ns_steps)]
    if variant == "deepseek_v4":
        return LEGACY * 8 + [(2.0, -1.5, 0.5)] * 2
    if variant == "custom":
        return [tuple(custom)] * ns_steps
    if variant == "segmented":
        return [tuple(abc) for abc, n in custom for _ in range(n)]
    raise ValueError(variant)


def ns_fp32(G, coeffs, eps):
    """docs/NUMERICS.md's Newton-Schulz in FP32 torch ops: X / (||X||_F + eps) with
    the norm accumulated in double, then S = X Xᵀ, T = b S + c S S, X = a X + T X."""
    X = G.to(torch.float32, copy=True)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X * float(1.0 / (X.double().norm().item() + eps))
    for a, b, c in coeffs:
        S = X @ X.T
        T = torch.addmm(S, S, S, beta=b, alpha=c)
        X = torch.addmm(X, T, X, beta=a)
    return X.T.contiguous() if tall else X


def torch_zeropower_fp32(grad, ns_coefficients, ns_steps, eps):
    """Drop-in for torch.optim._muon._zeropower_via_newtonschulz, in FP32."""
    return ns_fp32(grad, [tuple(ns_coefficients)] * ns_steps, eps)


def ns_float64(G, coeffs, eps):
    X = np.asarray(G, dtype=np.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (np.sqrt(np.sum(X * X)) + eps)
    for a, b, c in coeffs:
        S = X @ X.T
        T = b * S + c * (S @ S)
        X = a * X + T @ X
    return X.T if tall else X


def adjust(shape, fn):
    A, B = shape[-2:]
    return 0.2 * math.sqrt(max(A, B)) if fn == "match_rms_adamw" else math.sqrt(max(1, A / B))


def sample(t, x):
    """Elements of flat x checked after step t (1-based)."""
    flat = x.reshape(-1)
    return flat[(7 * t) % STRIDE::STRIDE].clone()


def run_torch(init, grads, adjust_lr_fn, nesterov):
    """(a): torch.optim.Muon on every matrix: the 2-D params as they are, the
    3-D one as E separate 2-D params, one per slice, stacked back for the fixture."""
    params = {k: v.float().clone() for k, v in init.items() if v.ndim == 2}
    slices = {k: [v[e].float().clone() for e in range(v.shape[0])] for k, v in init.items() if v.ndim == 3}
    opt = torch.optim.Muon(list(params.values()) + [s for ss in slices.values() for s in ss], lr=LR[0],
                           weight_decay=WD, momentum=MU, nesterov=nesterov, eps=EPS, ns_steps=5,
                           adjust_lr_fn=adjust_lr_fn)
    samples = {k: [] for k in init}
    momentum = {k: [] for k in init}
    for t in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = LR[t]
        for k, p in params.items():
            p.grad = grads[k][t].float().clone()
        for k, ss in slices.items():
            for e, s in enumerate(ss):
                s.grad = grads[k][t][e].float().clone()
        opt.step()
        for k in init:
            if k in params:
                p, buf = params[k], opt.state[params[k]]["momentum_buffer"]
            else:
                p = torch.stack(slices[k])
                buf = torch.stack([opt.state[s]["momentum_buffer"] for s in slices[k]])
            samples[k].append(sample(t + 1, p))
            momentum[k].append(sample(t + 1, buf))
    final = dict(params)
    final.update({k: torch.stack(ss) for k, ss in slices.items()})
    return final, samples, momentum


def run_master_bf16(init, grads):
    """(b): bf16 model params, FP32 masters, sum-momentum Muon (asym5, matched rms 0.2)."""
    model = {k: v.clone() for k, v in init.items()}  # bf16
    master = {k: v.float() for k, v in model.items()}
    bufs = {k: torch.zeros_like(v) for k, v in master.items()}
    coeffs = schedule("asym5", 5)
    samples, model_samples, momentum = ({k: [] for k in init} for _ in range(3))
    for t in range(STEPS):
        for k in master:
            p, B = master[k], bufs[k]
            g = grads[k][t].float()
            B.mul_(MU).add_(g)
            u = g + MU * B
            scale = adjust(p.shape, "match_rms_adamw")
            mats = [(p, u)] if p.ndim == 2 else [(p[e], u[e]) for e in range(p.shape[0])]
            for pm, um in mats:
                O = ns_fp32(um, coeffs, EPS)
                pm.mul_(1 - LR[t] * WD)
                pm.add_(O, alpha=-LR[t] * scale)
            model[k] = p.to(torch.bfloat16)
            samples[k].append(sample(t + 1, p))
            model_samples[k].append(sample(t + 1, model[k]))
            momentum[k].append(sample(t + 1, B))
    return master, model, samples, model_samples, momentum


def make_steps(path):
    gen = torch.Generator().manual_seed(1234)
    init = {k: (0.05 * torch.randn(s, generator=gen)).to(torch.bfloat16) for k, s in SHAPES.items()}
    # Per-step scales so the momentum mixes grads of different sizes.
    grads = {k: torch.stack([(0.1 * (1 + 0.3 * t) * torch.randn(s, generator=gen)).to(torch.float16)
                             for t in range(STEPS)]) for k, s in SHAPES.items()}
    out = {"lr": torch.tensor(LR, dtype=torch.float32)}
    for k in SHAPES:
        out[f"init.{k}"] = init[k]
        out[f"grad.{k}"] = grads[k]

    saved = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = torch_zeropower_fp32
    try:
        for run, fn, nesterov in (("torch_original", "original", True), ("torch_rms_plain", "match_rms_adamw", False)):
            final, samples, momentum = run_torch(init, grads, fn, nesterov)
            for k in SHAPES:
                out[f"{run}.sample.{k}"] = torch.stack(samples[k])
                out[f"{run}.final.{k}"] = final[k].contiguous()
                out[f"momentum_ema.sample.{k}"] = torch.stack(momentum[k])  # the same for both runs
    finally:
        torch_muon._zeropower_via_newtonschulz = saved

    master, model, samples, model_samples, momentum = run_master_bf16(init, grads)
    for k in SHAPES:
        out[f"master_sum.sample.{k}"] = torch.stack(samples[k])
        out[f"master_sum.final.{k}"] = master[k].contiguous()
        out[f"model_bf16.sample.{k}"] = torch.stack(model_samples[k])
        out[f"model_bf16.final.{k}"] = model[k].contiguous()
        out[f"momentum_sum.sample.{k}"] = torch.stack(momentum[k])
    # One metadata key: safetensors writes several in a random (hash) order.
    save_file(out, path, metadata={"about": f"lr: tensor lr; weight_decay {WD}; momentum {MU}; ns_eps {EPS}; "
                                            f"samples: flat i % {STRIDE} == (7 t) % {STRIDE} after step t"})


def make_ns(path):
    rng = np.random.default_rng(99)
    mats = {"wide": rng.standard_normal((16, 24)), "tall": rng.standard_normal((24, 16))}
    # square: singular values spread from 1e-3 to 1, as a gradient's are.
    U, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    V, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    mats["square"] = (U * np.logspace(0, -3, 20)) @ V.T
    mats = {k: v.astype(np.float32) for k, v in mats.items()}
    scheds = {
        "legacy": schedule("legacy", 5),
        "asym5": schedule("asym5", 5),
        "polar_express": schedule("polar_express", 7),
        "deepseek_v4": schedule("deepseek_v4", 5),
        "custom": schedule("custom", 4, [3.0, -3.2, 1.2]),
        "segmented": schedule("segmented", 5, [[[4.0848, -6.8946, 2.9270], 2], [[2.0, -1.5, 0.5], 3]]),
    }
    out = {f"input.{k}": torch.from_numpy(v) for k, v in mats.items()}
    for name, coeffs in scheds.items():
        out[f"{name}.coeffs"] = torch.tensor(coeffs, dtype=torch.float64).view(torch.int64)
        for k, v in mats.items():
            out[f"{name}.{k}"] = torch.from_numpy(np.ascontiguousarray(ns_float64(v, coeffs, EPS), dtype=np.float32))
    save_file(out, path, metadata={"ns_eps": str(EPS)})


def main():
    torch.set_num_threads(1)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "optim")
    os.makedirs(out_dir, exist_ok=True)
    make_steps(os.path.join(out_dir, "muon_steps.safetensors"))
    make_ns(os.path.join(out_dir, "muon_ns.safetensors"))
    for name in ("muon_steps.safetensors", "muon_ns.safetensors"):
        print(f"{name}: {os.path.getsize(os.path.join(out_dir, name))} bytes")


if __name__ == "__main__":
    main()
