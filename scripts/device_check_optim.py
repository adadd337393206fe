"""hypertrain's optimizers on CUDA tensors against torch's own on the same GPU (scripts/device-check.sh
--python runs it with hypertrain._C built -DHT_CUDA=ON): the same steps' results (AdamW bit for bit against
fused AdamW; Muon against torch.optim.Muon as docs/NUMERICS.md bounds it; the FP32 wrapper's bf16 copies the
rounding of their main params; clip_grad_norm_ against torch's), each on a side stream too, and the time of a
step of each on a Qwen2.5-0.5B layer's matrices. One line a check on stdout; exit 1 after any failure."""

import math
import sys
import time

import torch

import hypertrain
from hypertrain import optim

dev = torch.device("cuda")
failed = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failed.append(what)


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def tensors(shapes, seed, scale=0.05):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [(scale * torch.randn(s, generator=gen)).to(dev) for s in shapes]


def steps(make, shapes, n, stream=None):
    ps = [torch.nn.Parameter(t) for t in tensors(shapes, 1)]
    gs = [tensors(shapes, 2 + t, 1.0) for t in range(n)]
    opt = make(ps)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # the tensors were made on the default stream
    with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream()):
        for t in range(n):
            for p, g in zip(ps, gs[t]):
                p.grad = g
            opt.step()
    torch.cuda.synchronize()
    return ps, opt


def timed(make, shapes, n=10):
    ps = [torch.nn.Parameter(t) for t in tensors(shapes, 1)]
    gs = tensors(shapes, 2, 1.0)
    opt = make(ps)
    for p, g in zip(ps, gs):
        p.grad = g
    opt.step()  # the state made, the plans cached
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, hypertrain CUDA backend: "
      f"{hypertrain._C.cuda_backend()}", flush=True)
small = [(64, 64), (48,), (33,), (24, 40)]
side = torch.cuda.Stream()

# AdamW: bit for bit against torch's fused CUDA AdamW, on the default and a side stream
for stream in (None, side):
    ours, _ = steps(lambda ps: optim.AdamW(ps, lr=1e-3), small, 5, stream)
    theirs, _ = steps(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), small, 5, stream)
    check(all(torch.equal(a, b) for a, b in zip(ours, theirs)),
          f"AdamW == torch fused AdamW, 5 steps ({'side' if stream else 'default'} stream): "
          f"{max(rel(a.detach(), b.detach()) for a, b in zip(ours, theirs)):.3g}")

# Muon: torch.optim.Muon (2-D params only), FP32 and its own bf16 iteration
mats = [(96, 32), (32, 96), (64, 64)]
for kw, bound in ((dict(), 1e-5), (dict(ns_dtype="bfloat16", ns_form="torch"), 1e-2)):
    for stream in (None, side):
        ours, oo = steps(lambda ps: optim.Muon(ps, lr=0.02, **kw), mats, 5, stream)
        theirs, to = steps(lambda ps: torch.optim.Muon(ps, lr=0.02), mats, 5, stream)
        mom = all(torch.equal(oo.state[a]["momentum_buffer"], to.state[b]["momentum_buffer"])
                  for a, b in zip(ours, theirs))
        worst = max(rel(a.detach(), b.detach()) for a, b in zip(ours, theirs))
        check(mom, f"Muon {kw or 'fp32'}: momentum buffers == torch.optim.Muon's ({'side' if stream else 'default'})")
        check(worst <= bound, f"Muon {kw or 'fp32'}: params {worst:.3g} from torch.optim.Muon's (<= {bound}; "
                              f"{'side' if stream else 'default'} stream)")

# the FP32 wrapper on a bf16 model: each bf16 param the rounding of its main param after every step
model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 48)).to(dev, torch.bfloat16)
wrapped = hypertrain.Float16OptimizerWithFloat16Params(
    optim.get_hyper_optimizer(model=model, muon_params=[model[0].weight, model[1].weight],
                              adamw_params=[model[1].bias], muon_semantics="torch"), model)
x = torch.randn(16, 64, device=dev, dtype=torch.bfloat16)
for _ in range(3):
    model(x).float().square().mean().backward()
    optim.clip_grad_norm_(model.parameters(), 1.0)
    wrapped.step()
    wrapped.zero_grad()
torch.cuda.synchronize()
copies = all(torch.equal(p.data, p.main_param.data.to(torch.bfloat16)) for p in model.parameters())
check(copies, "FP32 wrapper (bf16 model, Muon + AdamW, clipping): every bf16 param the rounding of its main param")

# clip_grad_norm_ against torch's
gs = tensors([(512, 512), (1000,), (7, 9)], 9, 1.0)
ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
qs = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
for p, q, g in zip(ps, qs, gs):
    p.grad, q.grad = g.clone(), g.clone()
n1, n2 = optim.clip_grad_norm_(ps, 1.0), torch.nn.utils.clip_grad_norm_(qs, 1.0)
check(abs(n1.item() - n2.item()) <= 1e-6 * n2.item() and all(rel(p.grad, q.grad) <= 1e-6 for p, q in zip(ps, qs)),
      f"clip_grad_norm_: {n1.item():.7g} against torch's {n2.item():.7g}")

# speed: a Qwen2.5-0.5B layer's matrices (q, k, v, o, gate, up, down)
layer = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)]
print("ms a step on one Qwen2.5-0.5B layer's matrices (10 steps after one):", flush=True)
for name, make in (("hypertrain AdamW", lambda ps: optim.AdamW(ps, lr=1e-3)),
                   ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
                   ("hypertrain Muon fp32", lambda ps: optim.Muon(ps, lr=0.02)),
                   ("hypertrain Muon bf16 torch form", lambda ps: optim.Muon(ps, lr=0.02, ns_dtype="bfloat16",
                                                                             ns_form="torch")),
                   ("torch.optim.Muon", lambda ps: torch.optim.Muon(ps, lr=0.02))):
    print(f"  {name:32s} {timed(make, layer):8.3f}", flush=True)
hypertrain._C.cuda_synchronize(torch.cuda.current_stream().cuda_stream)
print(f"{len(failed)} failed" if failed else "all passed", flush=True)
sys.exit(1 if failed else 0)
