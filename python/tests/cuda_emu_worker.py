"""The optimizers on CUDA tensors, run by test_cuda_tensors.py in a process whose hypertrain._C is built over
the emulated CUDA backend (tests/emu/, target hypertrain_python_emu): the tensors say cuda:0 (fake_cuda.FakeCuda)
and their memory is the emulator's device memory, so every kernel runs the CUDA backend's code through the
kernel table. Each check against the same steps on CPU tensors; prints one line per check, exits non-zero on
the first failure."""

import ctypes
import math
import sys

import torch

from hypertrain import _C, optim
from fake_cuda import FakeCuda, on_device

lib = ctypes.CDLL(_C.__file__)  # the emulator's cudaMalloc, linked into this _C


def alloc(n):
    p = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) == 0
    return p.value


FakeCuda.alloc = alloc
streams = []


def stream_of(t):  # torch.cuda has no device here: a made-up stream, recorded (the emulator runs every stream)
    if t.device.type == "cpu":
        return None
    streams.append(7)
    return 7


optim._stream = stream_of
device, why = _C.cuda_backend()
assert device == 0, why


def grads(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * (0.1 + t) for s in shapes] for t in range(steps)]


def params(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [0.05 * torch.randn(s, generator=gen) for s in shapes]


def run(make, shapes, cuda, steps=4, copy=None):
    ps = params(shapes, 1)
    models = [p.bfloat16() for p in ps] if copy else None
    if cuda:
        ps = [on_device(p) for p in ps]
        models = [on_device(m) for m in models] if copy else None
    if copy:
        for p, m in zip(ps, models):
            p._hypertrain_model_param = m  # as the FP32 main-param wrapper marks its main params
    opt = make(ps)
    for gs in grads(shapes, steps, 2):
        for p, g in zip(ps, gs):
            p.grad = on_device(g) if cuda else g.clone()
        opt.step()
    host = lambda t: t.inner.clone() if isinstance(t, FakeCuda) else t.detach().clone()
    _C.cuda_synchronize(7)
    return [host(p) for p in ps], [{k: host(v) for k, v in opt.state[p].items()} for p in ps], \
        [host(m) for m in models] if copy else None


def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                              b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


# AdamW: the device's steps round as the CPU's (docs/DESIGN.md): every param, moment and bf16 copy the same bits
shapes = [(64, 64), (48,), (33,), (5, 7, 3)]
for copy in (False, True):
    cpu = run(lambda ps: optim.AdamW(ps, lr=1e-3, weight_decay=0.01), shapes, False, copy=copy)
    dev = run(lambda ps: optim.AdamW(ps, lr=1e-3, weight_decay=0.01), shapes, True, copy=copy)
    for i in range(len(shapes)):
        assert same(cpu[0][i], dev[0][i]), f"AdamW param {i}"
        assert same(cpu[1][i]["exp_avg"], dev[1][i]["exp_avg"]) and same(cpu[1][i]["exp_avg_sq"],
                                                                         dev[1][i]["exp_avg_sq"])
        assert not copy or same(cpu[2][i], dev[2][i]), f"AdamW bf16 copy {i}"
    print(f"AdamW{' with bf16 model copies' if copy else ''} on the emulated device: the CPU's bits")

# Muon: torch's momentum (its lerps) the same bits, the summed one within test_kernels' 1e-6; Newton-Schulz's products on the emulated cuBLASLt sum
# in another order than oneDNN: O within test_kernels' 1e-3 of the largest entry (1.5 at most: NS's singular
# values stay below it), so a param within steps x lr x scale x 1.5e-3, its bf16 copy within an ulp of that
shapes = [(48, 20), (24, 40), (2, 24, 40)]
for kw in (dict(), dict(momentum_style="sum", ns_variant="asym5", matched_adamw_rms=0.2),
           dict(ns_dtype="bfloat16", ns_form="torch")):
    for copy in (False, True):
        make = lambda ps: optim.Muon(ps, lr=0.02, **kw)
        cpu, dev = run(make, shapes, False, copy=copy), run(make, shapes, True, copy=copy)
        worst = 0.0
        for i, s in enumerate(shapes):
            a, b = cpu[1][i]["momentum_buffer"], dev[1][i]["momentum_buffer"]
            if kw.get("momentum_style") == "sum":  # the plain form: each compiler contracts it its own way
                assert (a - b).abs().max().item() <= 1e-6 * a.abs().max().item(), f"Muon {kw} momentum {i}"
            else:  # torch's lerps: one FMA each, everywhere
                assert same(a, b), f"Muon {kw} momentum {i}"
            scale = 0.2 * math.sqrt(max(s[-2:])) if kw.get("momentum_style") == "sum" else \
                math.sqrt(max(1, s[-2] / s[-1]))
            tol = 1e-1 if kw.get("ns_dtype") == "bfloat16" else 1e-3  # test_kernels' NS bounds
            bound = 4 * 0.02 * scale * 1.5 * tol
            d = (cpu[0][i] - dev[0][i]).abs().max().item()
            worst = max(worst, d)
            assert d <= bound, f"Muon {kw} param {i}: {d:.3g} from the CPU's (bound {bound:.3g})"
        print(f"Muon {kw or 'torch semantics'}{' with bf16 model copies' if copy else ''} on the emulated device: "
              f"momentum as the CPU's, params {worst:.3g} from the CPU's, within Newton-Schulz's bound")

# Muon's steps after the first allocate no device memory: Newton-Schulz takes the stream's workspace, kept by the
# backend (the first step grows it to the largest matrix; a step in bf16 asks no more than one in FP32)
shapes = [(48, 20), (24, 40), (2, 24, 40), (96, 80)]
ps = [on_device(p) for p in params(shapes, 1)]
opt = optim.Muon(ps, lr=0.02)
for t, gs in enumerate(grads(shapes, 3, 2)):
    for p, g in zip(ps, gs):
        p.grad = on_device(g)
    before = _C.cuda_allocations()
    opt.step()
    _C.cuda_synchronize(7)
    made = _C.cuda_allocations() - before
    assert made > 0 if t == 0 else made == 0, f"Muon step {t + 1} allocated {made} device blocks"
print("Muon's steps after the first allocate no device memory")

# clip_grad_norm_: the sum of squares on the device (double, its own order), the scale torch's
gs = grads([(64, 64), (33,), (5, 7)], 1, 3)[0]
ref, dev = [g.clone() for g in gs], [on_device(g) for g in gs]
holders_cpu, holders_dev = [torch.zeros(g.shape) for g in gs], [on_device(torch.zeros(g.shape)) for g in gs]
for h, g in zip(holders_cpu + holders_dev, ref + dev):
    h.grad = g
nc = optim.clip_grad_norm_(holders_cpu, 1.0)
nd = optim.clip_grad_norm_(holders_dev, 1.0)
assert abs(nc.item() - nd.item()) <= 1e-6 * nc.item(), (nc.item(), nd.item())  # a float32 ulp or two
for a, b in zip(ref, dev):
    assert (a - b.inner).abs().max().item() <= 1e-6 * a.abs().max().item()
print(f"clip_grad_norm_ on the emulated device: norm {nd.item():.6g}, the CPU's {nc.item():.6g}")
assert streams and set(streams) == {7}, "the kernels were not given the tensors' stream"
print("every kernel call took the tensors' stream")
sys.exit(0)
