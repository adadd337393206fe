#!/usr/bin/env python3
"""Write tests/fixtures/optim/: what hypertrain's optimizer layer is checked against.

  adamw_fp32.safetensors   10 steps of torch.optim.AdamW (two groups: decay
                           0.05 for matrices, 0 for names matching *bias* /
                           *norm*) on a 64x64, a 32x96, a 96x32, a (3,24,40)
                           and two (64,) tensors.
      init.<name>          F32 the parameters before step 1
      p.<t>.<name>         F32 param after step t = 1..10, every 32nd flat
      m.<t>.<name>             element (index 0, 32, 64, ...) to keep the file
      v.<t>.<name>             small; t = 10 holds the whole tensor
  adamw_bf16.safetensors   Megatron-style mixed precision: bf16 model params,
                           FP32 master copies (the widened bf16) updated by
                           torch AdamW, the master cast back to bf16 after
                           every step.
      init.<name>          BF16 the model params before step 1
      bf16.<t>.<name>      BF16 model params after step t (whole tensor)
      master.<t>.<name>    F32 the master after step t (every 32nd element;
                           t = 10 whole)
  clip.safetensors         torch.nn.utils.clip_grad_norm_ on three gradients,
                           once with the norm above max_norm and once below.
      <case>.grad.<i>      F32 gradients before clipping
      <case>.clipped.<i>   F32 what clip_grad_norm_ left in them
      <case>.norm_torch    F32 [1] the norm clip_grad_norm_ returned (float32)
      metadata <case>.norm_f64, <case>.max_norm: the norm accumulated in
                           float64, and max_norm (repr strings: F64 tensors
                           are not in hypertrain's safetensors reader)
  lr_schedules.json        every schedule of docs/NUMERICS.md on several parameter
                           sets -> expected lr at many steps, from the
                           independent implementation below (written from
                           docs/NUMERICS.md's table, not from src/optim/lr.c).

Gradients are not stored: step t's gradient of tensor k is a counter-based
hash (grad_values below) that tests/test_optim.c regenerates bit for bit.
Every value is an integer below 2^24 times a power of two, so exact in FP32.
This keeps the fixtures at ~0.4 MB instead of ~1 MB.

Deterministic (fixed seeds). Usage: python3 tools/reference/make_optim_fixtures.py [OUT_DIR]
"""

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file

STEPS = 10
SAMPLE = 32  # per-step snapshots keep every 32nd flat element
LR, BETAS, EPS, WD = 3e-3, (0.85, 0.99), 1e-6, 0.05

FP32_PARAMS = [  # (name, shape); tensor id = position
    ("model.layers.0.mlp.up_proj.weight", (64, 64)),
    ("model.layers.0.mlp.down_proj.weight", (32, 96)),
    ("model.layers.1.self_attn.o_proj.weight", (96, 32)),
    ("model.layers.1.mlp.experts.weight", (3, 24, 40)),
    ("model.layers.0.self_attn.q_proj.bias", (64,)),
    ("model.norm.weight", (64,)),
]
BF16_PARAMS = [
    ("model.layers.0.mlp.gate_proj.weight", (64, 64)),
    ("model.layers.0.input_layernorm.weight", (64,)),
]


def no_decay(name):
    return "bias" in name or "norm" in name


def splitmix64(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)).astype(np.uint64)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)).astype(np.uint64)
    return x ^ (x >> np.uint64(31))


def grad_values(tensor_id, step, n):
    """(n,) float32: key = id << 48 | step << 32 | i; h = splitmix64(key);
    g = (int(h >> 40) - 2^23) * 2^-(23 + (h & 7))   (|g| < 1, 8 magnitude octaves)."""
    i = np.arange(n, dtype=np.uint64)
    key = (np.uint64(tensor_id) << np.uint64(48)) | (np.uint64(step) << np.uint64(32)) | i
    with np.errstate(over="ignore"):
        h = splitmix64(key)
    k = (h >> np.uint64(40)).astype(np.int64) - (1 << 23)
    e = (h & np.uint64(7)).astype(np.int64)
    return (k.astype(np.float64) * np.ldexp(1.0, -(23 + e))).astype(np.float32)


def snapshot(out, key, t, x):
    flat = np.ascontiguousarray(x.detach().reshape(-1).numpy() if torch.is_tensor(x) else x.reshape(-1))
    out[key] = flat.copy() if t == STEPS else flat[::SAMPLE].copy()


def make_adamw_fp32(out_dir):
    gen = torch.Generator().manual_seed(1234)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.5) for _, shape in FP32_PARAMS]
    out = {f"init.{n}": p.detach().numpy().copy() for (n, _), p in zip(FP32_PARAMS, params)}
    decay = [p for (n, _), p in zip(FP32_PARAMS, params) if not no_decay(n)]
    plain = [p for (n, _), p in zip(FP32_PARAMS, params) if no_decay(n)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    for t in range(1, STEPS + 1):
        for k, ((n, shape), p) in enumerate(zip(FP32_PARAMS, params)):
            p.grad = torch.from_numpy(grad_values(k, t, p.numel()).reshape(shape))
        opt.step()
        for (n, _), p in zip(FP32_PARAMS, params):
            st = opt.state[p]
            snapshot(out, f"p.{t}.{n}", t, p)
            snapshot(out, f"m.{t}.{n}", t, st["exp_avg"])
            snapshot(out, f"v.{t}.{n}", t, st["exp_avg_sq"])
    meta = {"lr": repr(LR), "beta1": repr(BETAS[0]), "beta2": repr(BETAS[1]), "eps": repr(EPS),
            "weight_decay": repr(WD), "steps": str(STEPS), "sample": str(SAMPLE), "torch": torch.__version__}
    save_file(out, os.path.join(out_dir, "adamw_fp32.safetensors"), metadata=meta)


def make_adamw_bf16(out_dir):
    gen = torch.Generator().manual_seed(5678)
    model = [(torch.randn(shape, generator=gen) * 0.5).to(torch.bfloat16) for _, shape in BF16_PARAMS]
    master = [torch.nn.Parameter(m.float()) for m in model]  # Megatron: fp32_from_float16 groups
    out = {}
    for (n, _), m in zip(BF16_PARAMS, model):
        out[f"init.{n}"] = m.clone()
    decay = [p for (n, _), p in zip(BF16_PARAMS, master) if not no_decay(n)]
    plain = [p for (n, _), p in zip(BF16_PARAMS, master) if no_decay(n)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    for t in range(1, STEPS + 1):
        for k, ((n, shape), p) in enumerate(zip(BF16_PARAMS, master)):
            p.grad = torch.from_numpy(grad_values(100 + k, t, p.numel()).reshape(shape))
        opt.step()
        for (n, _), m, p in zip(BF16_PARAMS, model, master):
            m.copy_(p.detach())  # the cast back: round to nearest even
            out[f"bf16.{t}.{n}"] = m.clone()
            snapshot(out, f"master.{t}.{n}", t, p)
            out[f"master.{t}.{n}"] = torch.from_numpy(out[f"master.{t}.{n}"])
    save_torch_file(out, os.path.join(out_dir, "adamw_bf16.safetensors"), metadata={"torch": torch.__version__})


def make_clip(out_dir):
    gen = torch.Generator().manual_seed(91)
    shapes = [(40, 30), (77,), (5, 5, 5)]
    out, meta = {}, {"torch": torch.__version__}
    for case, max_norm in (("above", 1.5), ("below", 1e3)):
        grads = [torch.randn(s, generator=gen) * 0.3 for s in shapes]
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        f64 = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        for i, (p, g) in enumerate(zip(ps, grads)):
            out[f"{case}.grad.{i}"] = g.numpy().copy()
            out[f"{case}.clipped.{i}"] = p.grad.numpy().copy()
        out[f"{case}.norm_torch"] = np.array([float(norm)], dtype=np.float32)
        meta[f"{case}.norm_f64"] = repr(f64)
        meta[f"{case}.max_norm"] = repr(max_norm)
    save_file(out, os.path.join(out_dir, "clip.safetensors"), metadata=meta)


# ---------------------------------------------------------------- LR schedules, from docs/NUMERICS.md's table


def lr_reference(c, s):
    """The lr of 0-based step s, term by term as docs/NUMERICS.md writes it."""
    kind, eta, T, W = c["type"], c["base_lr"], c["total_steps"], c["warmup_steps"]
    end = c["lr_end"]
    if kind == "CosineAnnealingLR":
        return c["eta_min"] + (eta - c["eta_min"]) * 0.5 * (1 + math.cos(math.pi * s / c["t_max"]))
    if s < W:
        return c["warmup_lr_init"] + (eta - c["warmup_lr_init"]) * s / W
    if kind == "ConstantWarmUpLR":
        return eta
    if kind == "LinearWithWarmUpLR":
        return eta * max(0.0, (T - s) / max(1, T - W))
    if kind in ("CosineWithWarmUpLR", "CosineWithRestartsAndWarmUpLR"):
        D = c["decay_steps"] or T
        if s >= D:
            return end
        p = (s - W) / max(1, D - W)
        if kind == "CosineWithWarmUpLR":
            return end + (eta - end) * max(0.0, 0.5 * (1 + math.cos(2 * math.pi * c["num_cycles"] * p)))
        return end + (eta - end) * 0.5 * (1 + math.cos(math.pi * ((c["num_cycles"] * p) % 1.0)))
    if kind == "PolynomialWithWarmUpLR":
        assert eta > end
        if s > T:
            return end
        D = c["decay_steps"] or (T - W)
        return end + (eta - end) * (1 - (s - W) / D) ** c["power"]
    if kind == "WarmUpStableDecayLR":
        S = c["decay_start"]
        if s < S:
            return eta
        return eta - (eta - end) * min(1.0, (s - S) / (T - S))
    raise ValueError(kind)


def lr_case(kind, T, base_lr=1e-3, warmup_steps=0, warmup_ratio=None, warmup_lr_init=0.0, lr_end=0.0,
            num_cycles=0.5, decay_steps=0, power=1.0, decay_start_steps=None, decay_start_ratio=0.8, eta_min=0.0,
            t_max=None):
    W = math.floor(T * warmup_ratio) if warmup_ratio is not None else warmup_steps  # warmup_ratio wins
    S = decay_start_steps if decay_start_steps is not None else math.floor(T * decay_start_ratio)
    c = {"type": kind, "base_lr": base_lr, "warmup_lr_init": warmup_lr_init, "lr_end": lr_end, "total_steps": T,
         "warmup_steps": W, "num_cycles": num_cycles, "decay_steps": decay_steps, "power": power,
         "decay_start": S, "eta_min": eta_min, "t_max": t_max if t_max is not None else T}
    if warmup_ratio is not None:
        c["warmup_ratio"] = warmup_ratio
    D = decay_steps or T
    picks = {0, 1, W - 1, W, W + 1, (W + T) // 2, T // 3, T - 1, T, T + 1, T + 5, D - 1, D, D + 1, S - 1, S, S + 1,
             c["t_max"] // 2, c["t_max"]}
    picks |= set(range(0, T + 6, max(1, T // 16)))
    steps = sorted(s for s in picks if s >= 0)
    c["steps"] = steps
    c["lr"] = [lr_reference(c, s) for s in steps]
    return c


def make_lr(out_dir):
    cases = [
        lr_case("ConstantWarmUpLR", 100, warmup_steps=10),
        lr_case("ConstantWarmUpLR", 100, warmup_ratio=0.05, warmup_lr_init=1e-5),
        lr_case("LinearWithWarmUpLR", 100, warmup_steps=10),
        lr_case("LinearWithWarmUpLR", 1000, warmup_ratio=0.03, base_lr=6e-4),
        lr_case("LinearWithWarmUpLR", 50, warmup_steps=0),
        lr_case("CosineWithWarmUpLR", 100, warmup_steps=10, num_cycles=0.5),
        lr_case("CosineWithWarmUpLR", 100, warmup_steps=10, num_cycles=1.0, lr_end=1e-5),
        lr_case("CosineWithWarmUpLR", 200, warmup_ratio=0.1, num_cycles=0.5, decay_steps=150, lr_end=2e-5),
        lr_case("CosineWithWarmUpLR", 64, warmup_steps=0, num_cycles=0.75, lr_end=1e-4),
        lr_case("CosineWithRestartsAndWarmUpLR", 100, warmup_steps=10, num_cycles=1.0),
        lr_case("CosineWithRestartsAndWarmUpLR", 120, warmup_steps=8, num_cycles=3.0, lr_end=1e-5),
        lr_case("CosineWithRestartsAndWarmUpLR", 200, warmup_ratio=0.05, num_cycles=2.0, decay_steps=160,
                lr_end=5e-6),
        lr_case("CosineWithRestartsAndWarmUpLR", 100, warmup_steps=10, num_cycles=0.5),
        lr_case("PolynomialWithWarmUpLR", 100, warmup_steps=10, power=1.0),
        lr_case("PolynomialWithWarmUpLR", 100, warmup_steps=10, power=2.0, lr_end=1e-5),
        lr_case("PolynomialWithWarmUpLR", 200, warmup_ratio=0.1, power=2.0, lr_end=1e-5, decay_steps=120),
        lr_case("PolynomialWithWarmUpLR", 200, warmup_steps=20, power=1.0, lr_end=5e-5, decay_steps=150),
        lr_case("WarmUpStableDecayLR", 100, warmup_steps=10, decay_start_ratio=0.8),
        lr_case("WarmUpStableDecayLR", 100, warmup_steps=5, decay_start_steps=60, lr_end=1e-5),
        lr_case("WarmUpStableDecayLR", 300, warmup_ratio=0.02, decay_start_ratio=0.9, lr_end=3e-5, base_lr=2e-3),
        lr_case("CosineAnnealingLR", 100, t_max=100, eta_min=0.0),
        lr_case("CosineAnnealingLR", 100, t_max=40, eta_min=1e-5, warmup_steps=10),
        lr_case("CosineAnnealingLR", 80, eta_min=2e-4, base_lr=0.02),
    ]
    with open(os.path.join(out_dir, "lr_schedules.json"), "w") as f:
        json.dump({"source": "tools/reference/make_optim_fixtures.py (docs/NUMERICS.md, learning-rate schedules)",
                   "cases": cases}, f, indent=None, separators=(",", ":"))
        f.write("\n")


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "optim")
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    make_adamw_fp32(out_dir)
    make_adamw_bf16(out_dir)
    make_clip(out_dir)
    make_lr(out_dir)
    for f in sorted(os.listdir(out_dir)):
        print(f"{f}: {os.path.getsize(os.path.join(out_dir, f))} bytes")


if __name__ == "__main__":
    main()
