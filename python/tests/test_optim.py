"""hypertrain.optim and hypertrain.lr_scheduler against PyTorch's own optimizers
and closed forms (docs/NUMERICS.md): AdamW bit for bit against
torch.optim.AdamW(fused=True), Muon bit for bit against torch.optim.Muon around
Newton-Schulz and within 1e-6 of it with its Newton-Schulz in FP32 (as
tools/reference/make_muon_fixtures.py runs it), the
chained optimizer as its parts, state dicts across torch's optimizers and
hypertrain's, the schedules' lrs, and bad input."""

import math

import pytest
import torch

import hypertrain
from conftest import ns_fp32
from hypertrain import _C, optim
from hypertrain.lr_scheduler import get_hyper_lr_scheduler, scheduler_types

STEPS = 10


def grads_for(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * (0.1 + t) for s in shapes] for t in range(steps)]


def params_for(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.05 * torch.randn(s, generator=gen)) for s in shapes]


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


# ---------------------------------------------------------------- AdamW


def run_adamw(make, shapes, lrs, wd=0.01, betas=(0.9, 0.999), eps=1e-8):
    ps = params_for(shapes, 1)
    opt = make(ps, lr=lrs[0], betas=betas, eps=eps, weight_decay=wd)
    history = []
    for t, gs in enumerate(grads_for(shapes, len(lrs), 2)):
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        history.append([(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                        for p in ps])
    return ps, opt, history


def torch_vector_floats():
    """Floats in one of torch's CPU vectors (at::vec::Vectorized<float>::size())."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def test_adamw_bit_for_bit_against_torch_fused():
    """Every element where torch's fused CPU kernel takes its vectorized path (FP32 throughout): shapes whose
    element count is a multiple of 16 are that path alone."""
    shapes = [(64, 64), (48,), (4, 8, 3), (1024,)]
    lrs = [1e-3 * (1 + 0.1 * t) for t in range(STEPS)]
    for wd, betas in ((0.01, (0.9, 0.999)), (0.1, (0.9, 0.95))):
        _, _, ours = run_adamw(optim.AdamW, shapes, lrs, wd, betas)
        _, _, torch_h = run_adamw(lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw), shapes, lrs, wd, betas)
        for t in range(STEPS):
            for (p, m, v), (tp, tm, tv) in zip(ours[t], torch_h[t]):
                assert torch.equal(p, tp), f"step {t + 1}: param differs by {rel(p, tp):.3g}"
                assert torch.equal(m, tm) and torch.equal(v, tv), f"step {t + 1}: moments differ"


def test_adamw_against_torch_fused_tails():
    """torch's fused CPU kernel runs the last n mod V elements of each thread's chunk (V floats a vector)
    through a scalar loop whose coefficients are doubles, so exp_avg_sq there is a double computation rounded
    once (at::native's FusedAdamKernel.cpp). On one torch thread the chunk is the tensor: every other element
    is bit for bit, and those within 4 ulps of exp_avg_sq and of the param (measured: 2 ulps of exp_avg_sq,
    the param equal, over 10 steps on AVX2)."""
    torch.set_num_threads(1)
    V = torch_vector_floats()
    shapes = [(33,), (7, 5, 3), (1001,), (4099,)]
    lrs = [1e-3 * (1 + 0.1 * t) for t in range(STEPS)]
    _, _, ours = run_adamw(optim.AdamW, shapes, lrs)
    _, _, torch_h = run_adamw(lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw), shapes, lrs)
    for t in range(STEPS):
        for shape, mine, theirs in zip(shapes, ours[t], torch_h[t]):
            n = math.prod(shape)
            tail = n - n % V
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), mine, theirs):
                a, b = a.flatten(), b.flatten()
                assert torch.equal(a[:tail], b[:tail]), f"{shape} step {t + 1}: {name} differs in the vector part"
                ulps = (a[tail:].view(torch.int32) - b[tail:].view(torch.int32)).abs().max().item() if n > tail else 0
                assert ulps <= 4, f"{shape} step {t + 1}: {name}'s tail {ulps} ulps from torch's"


def test_adamw_state_dict_crosses_torch_both_ways():
    shapes = [(16, 8), (8,)]
    lrs = [2e-3] * 6
    for first, second in ((lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw), optim.AdamW),
                          (optim.AdamW, lambda ps, **kw: torch.optim.AdamW(ps, fused=True, **kw))):
        ps, opt, _ = run_adamw(first, shapes, lrs[:3])
        saved = opt.state_dict()
        ref_ps, ref_opt, _ = run_adamw(first, shapes, lrs[:3])
        cont = second([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=lrs[0])
        cont.load_state_dict(saved)
        cont_ps = [p for g in cont.param_groups for p in g["params"]]
        for t, gs in enumerate(grads_for(shapes, 6, 2)[3:]):
            for p, q, g in zip(cont_ps, ref_ps, gs):
                p.grad, q.grad = g.clone(), g.clone()
            cont.step()
            ref_opt.step()
        for p, q in zip(cont_ps, ref_ps):
            assert torch.equal(p, q), "a resumed AdamW parts from the run that went on"


# ---------------------------------------------------------------- Muon


@pytest.mark.parametrize("nesterov,adjust", [(True, "original"), (False, "match_rms_adamw"), (True, None)])
def test_muon_against_torch(torch_muon_fp32, nesterov, adjust):
    shapes = [(96, 32), (32, 96), (64, 64), (3, 24, 40)]
    ps = params_for(shapes, 3)
    ref = [p.detach().clone() for p in ps[:3]] + [p.detach()[e].clone() for e in range(3) for p in ps[3:]]
    ref = [torch.nn.Parameter(r) for r in ref]
    ours = optim.Muon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust)
    theirs = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                              adjust_lr_fn=adjust)
    for gs in grads_for(shapes, STEPS, 4):
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        for r, g in zip(ref, gs[:3] + [gs[3][e] for e in range(3)]):
            r.grad = g.clone()
        ours.step()
        theirs.step()
        got = [p.detach() for p in ps[:3]] + [ps[3].detach()[e] for e in range(3)]
        for a, b, name in zip(got, ref, ["tall", "wide", "square", "expert 0", "expert 1", "expert 2"]):
            assert rel(a, b) <= 1e-6, f"{name}: {rel(a, b):.3g} from torch.optim.Muon"
        mom = [ours.state[p]["momentum_buffer"] for p in ps[:3]]
        for a, b in zip(mom, ref[:3]):
            assert rel(a, theirs.state[b]["momentum_buffer"]) <= 1e-6


def test_muon_against_torch_large(torch_muon_fp32):
    """Matrices of 256 rows of X and more, where Newton-Schulz takes the symmetric products (S = X Xᵀ and
    S S panel by panel over their upper triangles): within 1e-6 of torch.optim.Muon's whole products."""
    shapes = [(600, 272), (272, 600), (300, 300)]
    ps = params_for(shapes, 8)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = optim.Muon(ps, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="original")
    theirs = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="original")
    for gs in grads_for(shapes, 4, 9):
        for p, r, g in zip(ps, ref, gs):
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        for a, b, shape in zip(ps, ref, shapes):
            assert rel(a.detach(), b.detach()) <= 1e-6, f"{shape}: {rel(a.detach(), b.detach()):.3g} from torch"


def _muon_run(opt, ps, grads):
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nesterov,adjust", [(True, None), (False, "match_rms_adamw"), (True, "spectral_unclamped")])
def test_muon_state_dict_crosses_torch_both_ways(torch_muon_fp32, tmp_path, nesterov, adjust):
    """A torch.optim.Muon state dict (saved and loaded through a file) loads into hypertrain's Muon, which goes on
    as torch's would; hypertrain's loads into torch.optim.Muon, which goes on as hypertrain's would (before: the
    first, a KeyError 'momentum_style' at the first step)."""
    shapes = [(24, 16), (16, 40)]
    grads = grads_for(shapes, 6, 21)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    for first, second in ((torch.optim.Muon, optim.Muon), (optim.Muon, torch.optim.Muon)):
        ps = params_for(shapes, 22)
        opt = first(ps, **kw)
        _muon_run(opt, ps, grads[:3])
        torch.save({"params": [p.detach() for p in ps], "optim": opt.state_dict()}, tmp_path / "muon.pt")
        _muon_run(opt, ps, grads[3:])  # the run that went on
        saved = torch.load(tmp_path / "muon.pt")
        qs = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
        cont = second(qs, lr=0.5, momentum=0.5)  # the state dict's groups replace these
        cont.load_state_dict(saved["optim"])
        _muon_run(cont, qs, grads[3:])
        for p, q, shape in zip(ps, qs, shapes):
            assert rel(q.detach(), p.detach()) <= 1e-6, \
                f"{first.__module__}.Muon -> {second.__module__}.Muon {shape}: {rel(q.detach(), p.detach()):.3g}"
            assert rel(cont.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"]) <= 1e-6


def test_muon_state_dict_group_the_kernels_cannot_run_is_refused():
    """A loaded group's keys are checked as the constructor checks them, naming the group and the key."""
    (p,) = params_for([(8, 4)], 23)
    for key, bad, match in (("momentum_style", "nesterov", r"group 0's 'momentum_style' is 'nesterov'"),
                            ("ns_dtype", "float16", r"group 0's 'ns_dtype' is 'float16'"),
                            ("adjust_lr_fn", "unknown", r"group 0's 'adjust_lr_fn' is 'unknown'"),
                            ("ns_steps", 0, r"ns_steps 0")):
        sd = optim.Muon([p], lr=0.02).state_dict()
        sd["param_groups"][0][key] = bad
        opt = optim.Muon([p], lr=0.02)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)


def test_muon_hyperparallel_style():
    """sum momentum, asym5, matched_adamw_rms 0.2 (get_hyper_optimizer's defaults) against the formulas."""
    shape, lr, wd, mu = (40, 24), 0.02, 0.1, 0.95
    (p,) = params_for([shape], 5)
    ref = p.detach().clone()
    opt = optim.get_hyper_optimizer(muon_params=[p], muon_kwargs={"lr": lr, "momentum": mu})
    B = torch.zeros(shape)
    coeffs = hypertrain._C.ns_schedule("asym5", 5)
    for (g,) in grads_for([shape], STEPS, 6):
        p.grad = g.clone()
        opt.step()
        B = mu * B + g
        u = g + mu * B
        ref = ref * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(shape)) * ns_fp32(u, coeffs, 1e-7)
        assert rel(p.detach(), ref) <= 1e-6


def _hypertrain_ns(ns_dtype, ns_form):
    """torch.optim.Muon's _zeropower_via_newtonschulz computed by hypertrain's kernel: the result in torch's
    dtype (bf16 for torch's own bf16 iteration, whose values hypertrain's FP32 result holds exactly)."""
    def ns(grad, ns_coefficients, ns_steps, eps):
        G, out = grad.contiguous(), torch.empty(grad.shape)
        _C.newton_schulz(G.data_ptr(), out.data_ptr(), 1, G.shape[0], G.shape[1],
                         optim._schedule(tuple(ns_coefficients), ns_steps, None), eps, ns_dtype, ns_form)
        return out.bfloat16() if ns_form == "torch" else out
    return ns


@pytest.mark.parametrize("ns", [("float32", "standard"), ("bfloat16", "torch")])
@pytest.mark.parametrize("momentum,nesterov,adjust,wd", [(0.95, True, None, 0.1), (0.95, False, "match_rms_adamw", 0.1),
                                                          (0.3, True, "spectral_unclamped", 0.01),
                                                          (0.6, False, None, 0.0)])
def test_muon_is_torch_muon_bit_for_bit_around_newton_schulz(monkeypatch, ns, momentum, nesterov, adjust, wd):
    """Everything torch.optim.Muon computes outside Newton-Schulz, bit for bit: the momentum as torch's lerps
    (buf.lerp_(g, 1 - mu) and g.lerp(buf, mu), one FMA each, on either side of the weight 0.5), the decay and
    the update as its mul_ and add_ (one FMA). torch's Newton-Schulz is hypertrain's kernel here, so that the
    products' summation order (oneDNN's or torch's, machine- and version-dependent) is left out: params and
    momentum buffers equal every step for ten steps."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _hypertrain_ns(*ns))
    shapes = [(48, 160), (160, 48), (96, 96)]
    kw = dict(lr=0.02, weight_decay=wd, momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust)
    ps, ref = params_for(shapes, 42), params_for(shapes, 42)
    ours = optim.Muon(ps, ns_dtype=ns[0], ns_form=ns[1], **kw)
    theirs = torch.optim.Muon(ref, **kw)
    for t, gs in enumerate(grads_for(shapes, STEPS, 41)):
        for p, r, g in zip(ps, ref, gs):
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        for p, r, shape in zip(ps, ref, shapes):
            assert torch.equal(ours.state[p]["momentum_buffer"], theirs.state[r]["momentum_buffer"]), \
                f"{shape} step {t + 1}: the momentum buffer is not torch's"
            assert torch.equal(p, r), f"{shape} step {t + 1}: {rel(p.detach(), r.detach()):.3g} from torch's"


def test_muon_torch_form_is_stock_torch_muon():
    """ns_dtype='bfloat16', ns_form='torch': torch.optim.Muon's own bf16 Newton-Schulz (X, S, T held in bf16,
    each addmm rounded once). On its own, against torch's _zeropower_via_newtonschulz on wide, tall and square
    gradients: within the C suite's 0.02 (check_newton_schulz_torch_form). In the optimizer, ten steps against
    stock torch.optim.Muon: the momentum buffers bit for bit every step (they depend on the gradients alone), and
    the params apart only by what the Newton-Schulz products' summation order moves (oneDNN's against torch's
    kernels: an element rounded to bf16 from a sum near a tie can tip, and the iteration carries it). Everything
    else is torch's bit for bit (test_muon_is_torch_muon_bit_for_bit_around_newton_schulz), so (docs/NUMERICS.md,
    bf16 Newton-Schulz) a param is within sum_t lr scale max|O_t - O_torch,t| + 2 t ulp(max|p|) of torch's, the
    O_t measured here on the step's (identical) input; measured 7.7e-5 to 8.4e-4 of the largest entry after ten
    steps on this CPU, within 1e-3, and at least 3x nearer than the standard bf16 form (X in FP32, one residual
    product). A form the dtype cannot run is refused."""
    from torch.optim import _muon as torch_muon
    shapes = [(48, 160), (160, 48), (96, 96)]
    gen = torch.Generator().manual_seed(40)
    for shape in shapes:
        g = torch.randn(shape, generator=gen)
        theirs = torch_muon._zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        ours = _hypertrain_ns("bfloat16", "torch")(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        assert rel(ours, theirs) <= 0.02, (shape, rel(ours, theirs))
    grads = grads_for(shapes, STEPS, 41)
    lr, wd, mu = 0.02, 0.1, 0.95

    def run(make):
        ps = params_for(shapes, 42)
        opt = make(ps)
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        return ps, opt

    tps, theirs = run(lambda ps: torch.optim.Muon(ps, lr=lr, weight_decay=wd, momentum=mu))
    ops, ours = run(lambda ps: optim.Muon(ps, lr=lr, weight_decay=wd, momentum=mu, ns_dtype="bfloat16",
                                          ns_form="torch"))
    sps, _ = run(lambda ps: optim.Muon(ps, lr=lr, weight_decay=wd, momentum=mu, ns_dtype="bfloat16"))
    # the bound: each step's Newton-Schulz input is the same bits in both (the momentum is), so the outputs'
    # distance is measured on it; a param's distance then grows by lr scale |dO| a step and by the two roundings
    # of mul_ and add_ (an ulp each), and the decay only shrinks it
    bound = [0.0] * len(shapes)
    B = [torch.zeros(s) for s in shapes]
    for gs in grads:
        for i, (shape, g) in enumerate(zip(shapes, gs)):
            B[i].lerp_(g, 1 - mu)
            u = g.lerp(B[i], mu)
            d = (_hypertrain_ns("bfloat16", "torch")(u, (3.4445, -4.7750, 2.0315), 5, 1e-7).float() -
                 torch_muon._zeropower_via_newtonschulz(u, (3.4445, -4.7750, 2.0315), 5, 1e-7).float())
            bound[i] = (1 - lr * wd) * bound[i] + lr * math.sqrt(max(1, shape[0] / shape[1])) * d.abs().max().item()
    for i, (shape, a, b, c) in enumerate(zip(shapes, ops, tps, sps)):
        assert torch.equal(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"]), shape
        a, b, c = a.detach(), b.detach(), c.detach()
        ulp = torch.finfo(torch.float32).eps * b.abs().max().item()
        assert (a - b).abs().max().item() <= bound[i] + 2 * STEPS * ulp, (shape, (a - b).abs().max().item(), bound[i])
        assert rel(a, b) <= 1e-3 and rel(c, b) >= 3 * rel(a, b), (shape, rel(a, b), rel(c, b))
    (p,) = params_for([(8, 8)], 1)
    for form, dtype in (("torch", "float32"), ("gram", "bfloat16"), ("fast", "float32")):
        with pytest.raises(ValueError, match=f"ns_form '{form}' with ns_dtype '{dtype}'; expected 'standard'"):
            optim.Muon([p], ns_dtype=dtype, ns_form=form)


def test_muon_semantics_are_chosen_and_said(torch_muon_fp32, caplog):
    """get_hyper_optimizer(muon_semantics=): 'hyperparallel' (the default: summed momentum, asym5, 0.2 sqrt(max(A,
    B))) or 'torch' (torch.optim.Muon's, as hypertrain.optim.Muon): the same muon_kwargs mean either, so the factory
    says once which it used and with what values, a warning where the caller did not choose."""
    import logging
    shape = (40, 24)
    grads = grads_for([shape], STEPS, 31)
    kw = {"lr": 0.02, "momentum": 0.95}

    def run(make):
        (p,) = params_for([shape], 32)
        opt = make(p)
        for (g,) in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    optim._SAID.clear()
    with caplog.at_level(logging.INFO, logger="hypertrain"):
        default = run(lambda p: optim.get_hyper_optimizer(muon_params=[p], muon_kwargs=kw))
        hyper = run(lambda p: optim.get_hyper_optimizer(muon_params=[p], muon_kwargs=kw,
                                                        muon_semantics="hyperparallel"))
        as_torch = run(lambda p: optim.get_hyper_optimizer(muon_params=[p], muon_kwargs=kw, muon_semantics="torch"))
        run(lambda p: optim.get_hyper_optimizer(muon_params=[p], muon_kwargs=kw))  # said once: not again
    theirs = run(lambda p: torch.optim.Muon([p], **kw))
    direct = run(lambda p: optim.Muon([p], **kw))
    assert torch.equal(default, hyper), "the default is not muon_semantics='hyperparallel'"
    assert rel(as_torch, theirs) <= 1e-6 and torch.equal(as_torch, direct), "muon_semantics='torch' is not torch's"
    assert rel(hyper, theirs) > 1e-2, "the two semantics agree: the test cannot tell them apart"
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("hypertrain")]
    assert len(said) == 3, said
    (lvl0, m0), (lvl1, m1), (lvl2, m2) = said
    assert lvl0 == logging.WARNING and "HyperParallel's" in m0 and "muon_semantics='torch'" in m0, m0
    for part in ("lr=0.02", "momentum=0.95", "momentum_style='sum'", "ns_variant='asym5'", "matched_adamw_rms=0.2"):
        assert part in m0 and part in m1, (part, m0, m1)
    assert lvl1 == logging.INFO and lvl2 == logging.INFO and "torch.optim.Muon's" in m2 and \
        "momentum_style='ema'" in m2 and "adjust_lr_fn=None" in m2, m2
    (p,) = params_for([shape], 32)
    with pytest.raises(ValueError, match=r"muon_semantics 'keras'; expected 'hyperparallel' or 'torch'"):
        optim.get_hyper_optimizer(muon_params=[p], muon_semantics="keras")
    assert optim.muon_kwargs("torch", lr=0.02)["momentum_style"] == "ema"
    assert optim.muon_kwargs("hyperparallel", lr=0.05) == dict(optim.MUON_SEMANTICS["hyperparallel"], lr=0.05)


def test_newton_schulz_on_a_slice_is_not_the_slice():
    """Why tensor parallelism gathers a matrix whole before Newton-Schulz (docs/NUMERICS.md)."""
    gen = torch.Generator().manual_seed(7)
    G = torch.randn(64, 48, generator=gen)
    coeffs = hypertrain._C.ns_schedule("asym5", 5)
    whole, top = torch.empty_like(G), G[:32].contiguous()
    part = torch.empty_like(top)
    hypertrain._C.newton_schulz(G.data_ptr(), whole.data_ptr(), 1, 64, 48, coeffs, 1e-7, "float32")
    hypertrain._C.newton_schulz(top.data_ptr(), part.data_ptr(), 1, 32, 48, coeffs, 1e-7, "float32")
    assert rel(whole, ns_fp32(G, coeffs, 1e-7)) <= 1e-5
    assert rel(part, whole[:32]) > 1e-2


# ---------------------------------------------------------------- state the kernels take

# Each case replaces a state tensor of the second param, w1 (16, 8): the kernels read and write p.numel() floats
# of it in place, so a smaller one was a heap overflow, a larger one or a strided one a silently wrong update.
BAD_STATE = {
    "smaller": lambda: torch.zeros(4, 8),
    "larger": lambda: torch.zeros(32, 8),
    "float64": lambda: torch.zeros(16, 8, dtype=torch.float64),
    "bf16": lambda: torch.zeros(16, 8, dtype=torch.bfloat16),
    "not_contiguous": lambda: torch.zeros(8, 16).t(),
    "meta_device": lambda: torch.zeros(16, 8, device="meta"),
}
STATE_KEYS = {"AdamW": ("exp_avg", "exp_avg_sq"), "Muon": ("momentum_buffer",)}


def named_pair(seed=11, shapes=((8, 4), (16, 8))):
    return [(f"w{i}", p) for i, p in enumerate(params_for(list(shapes), seed))]


def stepped(kind, named):
    """An optimizer over named params (torch's param_names), stepped once so its state exists."""
    opt = getattr(optim, kind)(named, lr=0.01)
    for _, p in named:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
@pytest.mark.parametrize("case", list(BAD_STATE))
def test_a_state_tensor_the_kernel_cannot_take_is_refused_at_the_step(kind, case):
    for key in STATE_KEYS[kind]:
        named = named_pair()
        opt = stepped(kind, named)
        w1 = named[1][1]
        opt.state[w1][key] = BAD_STATE[case]()
        before = [p.detach().clone() for _, p in named]
        with pytest.raises(ValueError, match=rf"hypertrain.optim.{kind}: param 1 \(w1\)'s state '{key}' is .*"
                                             r"float32 \(16, 8\), contiguous"):
            opt.step()
        for (name, p), b in zip(named, before):  # refused before any param was written
            assert torch.equal(p, b), f"{case} {key}: {name} was stepped by a refused step"


def test_adamw_step_count_the_kernel_cannot_take_is_refused():
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor(-1.0), torch.tensor(1.5), torch.tensor(float("nan")), 3):
        named = named_pair()
        opt = stepped("AdamW", named)
        opt.state[named[1][1]]["step"] = bad
        with pytest.raises(ValueError, match=r"param 1 \(w1\)'s state 'step'"):
            opt.step()


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
def test_a_state_dict_of_another_model_is_refused(kind):
    """Two params each, the second (16, 8) in one model and (4, 8) or (32, 8) in the other: torch's
    load_state_dict checks the groups' sizes only, and casts the state to each param's dtype and device, so the
    shapes reached the kernels (smaller: written past its end; larger: a silently wrong update)."""
    for other in ((8, 4), (4, 8)), ((8, 4), (32, 8)):
        saved = stepped(kind, named_pair(shapes=other)).state_dict()
        named = named_pair()
        opt = stepped(kind, named)
        with pytest.raises(ValueError, match=rf"hypertrain.optim.{kind}.load_state_dict: param 1 \(w1\)'s state "
                                             rf"'{STATE_KEYS[kind][0]}' has shape \({other[1][0]}, 8\); the "
                                             r"param's is \(16, 8\)"):
            opt.load_state_dict(saved)
        for p in (p for _, p in named):
            p.grad = torch.ones_like(p)
        opt.step()  # the refused load left the optimizer as it was


def test_state_errors_name_the_models_params():
    """get_hyper_optimizer(model=) names a param by the model's name; so does the FP32 main-param wrapper."""
    model = Tiny()
    muon, adamw = split(model)
    opt = optim.get_hyper_optimizer(model=model, muon_params=muon, adamw_params=adamw)
    train(model, opt, 1)
    opt.optimizers[0].state[model.up_proj.weight]["momentum_buffer"] = torch.zeros(3)
    x = torch.randint(0, 50, (4, 8))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    with pytest.raises(ValueError, match=r"param 1 \(up_proj.weight\)'s state 'momentum_buffer' is "
                                         r"torch.float32 \(3,\)"):
        opt.step()
    opt.optimizers[0].state[model.up_proj.weight]["momentum_buffer"] = torch.zeros(32, 16)
    opt.optimizers[1].state[model.norm.weight]["exp_avg"] = torch.zeros(31)  # the chain's second optimizer
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param 2 \(norm.weight\)'s state 'exp_avg' is torch.float32 \(31,\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the chain's Muon stepped first"
    low = Tiny().to(torch.bfloat16)
    wrapped = optim.get_hyper_optimizer(model=low, muon_params=split(low)[0], adamw_params=split(low)[1],
                                        fp32_main_params=True)
    train(low, wrapped, 1)
    main = low.head.weight.main_param
    wrapped.inner.optimizers[1].state[main]["exp_avg_sq"] = torch.zeros(50, 16)
    torch.nn.functional.cross_entropy(low(x).flatten(0, 1).float(), x.flatten()).backward()
    with pytest.raises(ValueError, match=r"\(head.weight\)'s state 'exp_avg_sq' is torch.float32 \(50, 16\)"):
        wrapped.step()


# ---------------------------------------------------------------- chained


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.q_proj = torch.nn.Linear(16, 16)
        self.up_proj = torch.nn.Linear(16, 32, bias=False)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.up_proj(self.q_proj(self.embed(x))))))


def split(model):
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim == 2 and "proj" in name else adamw).append(p)
    return muon, adamw


def train(model, opt, steps, sched=None):
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 8), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()


def test_chained_optimizer_is_its_parts():
    torch.manual_seed(0)
    a = Tiny()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    muon, adamw = split(a)
    chained = optim.get_hyper_optimizer(model=a, muon_params=muon, adamw_params=adamw,
                                        muon_kwargs={"lr": 0.02, "momentum": 0.95},
                                        adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1})
    assert [type(o).__name__ for o in chained.optimizers] == ["Muon", "AdamW"]
    muon_b, adamw_b = split(b)
    parts = [optim.Muon(muon_b, lr=0.02, momentum=0.95, weight_decay=0.1, momentum_style="sum",
                        ns_variant="asym5", matched_adamw_rms=0.2),
             optim.AdamW(adamw_b, lr=3e-4, weight_decay=0.1)]
    train(a, chained, 3)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randint(0, 50, (4, 8), generator=gen)
        torch.nn.functional.cross_entropy(b(x).flatten(0, 1), x.flatten()).backward()
        for o in parts:
            o.step()
            o.zero_grad()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: the chained optimizer parts from Muon and AdamW stepped alone"


def test_chained_state_dict_resumes_exactly(tmp_path):
    torch.manual_seed(1)
    model = Tiny()
    muon, adamw = split(model)
    make = lambda m: optim.get_hyper_optimizer(model=m, muon_params=split(m)[0], adamw_params=split(m)[1])
    opt = make(model)
    train(model, opt, 2)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    train(model, opt, 2)
    resumed = Tiny()
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(saved["model"])
    ropt = make(resumed)
    ropt.load_state_dict(saved["optim"])
    train(resumed, ropt, 2)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), f"{name}: the resumed run parts from the one that went on"


def test_an_empty_group_creates_no_optimizer():
    model = Tiny()
    opt = optim.get_hyper_optimizer(model=model, muon_params=[], adamw_params=list(model.parameters()))
    assert [type(o).__name__ for o in opt.optimizers] == ["AdamW"]


# ---------------------------------------------------------------- schedules


def test_hyper_lr_scheduler_cosine_closed_form():
    model = Tiny()
    muon, adamw = split(model)
    opt = optim.get_hyper_optimizer(muon_params=muon, adamw_params=adamw, muon_kwargs={"lr": 0.02},
                                    adamw_kwargs={"lr": 3e-4})
    T, W = 20, 5
    sched = get_hyper_lr_scheduler(opt, scheduler_type="cosine", total_steps=T, warmup_steps=W)
    for s in range(T):
        for group, eta in zip(opt.param_groups, [0.02] * len(opt.optimizers[0].param_groups) + [3e-4]):
            want = eta * s / W if s < W else eta * 0.5 * (1 + math.cos(math.pi * (s - W) / (T - W)))
            assert abs(group["lr"] - want) <= 1e-12 * eta, f"step {s}: lr {group['lr']}, expected {want}"
        opt.step()
        sched.step()


def test_mindformers_schedules_by_name():
    for name in scheduler_types():
        opt = optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
        extra = {"CosineAnnealingWarmRestarts": {"t_0": 4},  # neither has a default (the trainer's rules)
                 "ConstantWithCoolDownLR": {"decay_steps": 4}}.get(name, {})
        sched = get_hyper_lr_scheduler(opt, scheduler_type=name, total_steps=10, warmup_steps=2, **extra)
        lrs = []
        for _ in range(10):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert all(0 <= lr <= 1e-3 + 1e-15 for lr in lrs), f"{name}: {lrs}"
        if not name.startswith("CosineAnnealing"):  # warmup from 0 over 2 steps; the two others have none
            assert lrs[0] == 0 and abs(lrs[1] - 5e-4) <= 1e-15, f"{name} does not warm up: {lrs}"
        else:
            assert lrs[0] == 1e-3 and lrs[1] < lrs[0], f"{name}: {lrs}"


def lrs_of(name, T=20, **keys):
    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    sched = get_hyper_lr_scheduler(opt, scheduler_type=name, total_steps=T, **keys)
    out = []
    for _ in range(T):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_that_would_be_degenerate_have_the_trainers_defaults_or_are_refused():
    """The C trainer's defaults and rules (src/config/keys.c, validate.c), through its own config code: restarts
    cycle whole by default (num_cycles 1.0, MindFormers' and seed 004's: the last step near lr_end, not 0.54 of the
    base lr); ConstantWithCoolDownLR without decay_steps or decay_ratio and CosineAnnealingWarmRestarts without t_0
    are errors naming the key (before: 0 after warmup, and a constant lr); lr_end2 not given is lr_end1."""
    restarts = lrs_of("CosineWithRestartsAndWarmUpLR", warmup_steps=2)
    assert restarts[-1] < 0.02 * 1e-3, f"CosineWithRestartsAndWarmUpLR ends at {restarts[-1] / 1e-3:.3g} x base"
    assert restarts == lrs_of("CosineWithRestartsAndWarmUpLR", warmup_steps=2, num_cycles=1.0)
    assert lrs_of("CosineWithRestartsAndWarmUpLR", warmup_steps=2, num_cycles=0.5)[-1] > 0.5e-3  # given: kept
    assert lrs_of("CosineWithWarmUpLR", warmup_steps=2) == lrs_of("CosineWithWarmUpLR", warmup_steps=2,
                                                                  num_cycles=0.5)
    with pytest.raises(ValueError, match=r"ConstantWithCoolDownLR needs the length of its cosine phase: set "
                                         r"lr_scheduler.decay_steps or lr_scheduler.decay_ratio"):
        lrs_of("ConstantWithCoolDownLR", warmup_steps=2)
    with pytest.raises(ValueError, match=r"lr_scheduler.t_0 \(default\): expected an integer >= 1 for "
                                         r"CosineAnnealingWarmRestarts"):
        lrs_of("CosineAnnealingWarmRestarts")
    cool = lrs_of("ConstantWithCoolDownLR", warmup_steps=2, keep_steps=3, decay_steps=5, final_steps=2, lr_end1=1e-5)
    assert cool[2:5] == [1e-3] * 3 and cool[-1] == 1e-5, cool  # lr_end2 not given: lr_end1
    wsd = lrs_of("WarmUpStableDecayLR", warmup_steps=2)  # decay_start_ratio 0.8: stable to step 16
    assert wsd[2:17] == [1e-3] * 15 and wsd[17] < 1e-3, wsd
    for bad, match in (({"num_cycles": 0}, r"lr_scheduler.num_cycles \(--set\): expected a number > 0"),
                       ({"power": -1.0}, r"lr_scheduler.power"),
                       ({"decay_ratio": 1.5}, r"lr_scheduler.decay_ratio")):
        with pytest.raises(ValueError, match=match):
            lrs_of("CosineWithWarmUpLR", **bad)
    with pytest.raises(TypeError, match=r"unknown schedule key\(s\) \['num_cycle'\]"):
        lrs_of("CosineWithWarmUpLR", num_cycle=1.0)


# ---------------------------------------------------------------- bad input


def test_bad_input():
    model = Tiny()
    p = model.q_proj.weight
    with pytest.raises(ValueError, match="q_proj.weight is in both"):
        optim.get_hyper_optimizer(model=model, muon_params=[p], adamw_params=[p])
    with pytest.raises(ValueError, match="does not exist; expected one of cosine, linear, constant"):
        get_hyper_lr_scheduler(optim.AdamW([p]), scheduler_type="cosine_annealing_typo", total_steps=10)
    with pytest.raises(ValueError, match="Muon takes matrices"):
        optim.Muon([model.q_proj.bias])
    with pytest.raises(TypeError, match="expected a floating-point param"):
        optim.AdamW([torch.zeros(4, 4, dtype=torch.int32)])
    d = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    d.grad = torch.zeros_like(d)
    with pytest.raises(TypeError, match="these optimizers update float32 params"):
        optim.AdamW([d]).step()
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        optim.AdamW([p], amsgrad=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        optim.Muon([p], lrr=0.1)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="run on CPU tensors"):
            optim.AdamW([torch.nn.Parameter(torch.zeros(4, 4, device="cuda"))])


def test_muon_steps_over_a_zero_size_matrix():
    """A matrix with no elements ((0, B), (A, 0), (0, A, B) experts) has no update, as torch's Muon's is empty;
    the others step as they would alone (before: ZeroDivisionError in numel // (A * B))."""
    empty = [torch.nn.Parameter(torch.zeros(s)) for s in ((0, 4), (4, 0), (0, 3, 4))]
    (p,) = params_for([(8, 4)], 12)
    (q,) = params_for([(8, 4)], 12)
    ours, alone = optim.Muon(empty + [p], lr=0.02), optim.Muon([q], lr=0.02)
    for (g,) in grads_for([(8, 4)], 3, 13):
        for e in empty:
            e.grad = torch.zeros_like(e)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        alone.step()
    assert torch.equal(p, q), "a zero-size matrix beside it changed a param's update"
    assert all(e.numel() == 0 and ours.state[e]["momentum_buffer"].shape == e.shape for e in empty)


def test_muon_bounds_ns_steps_at_construction():
    """ns_steps and a coefficient list are bounded by the kernels' longest schedule (100) before anything is sized
    by them (before: ns_steps 10**9 built a list of 10**9 triples, gigabytes, before any check)."""
    (p,) = params_for([(8, 4)], 1)
    for bad in (10 ** 9, 101, 0, -5, 2.5, True, "5"):
        with pytest.raises(ValueError, match=rf"ns_steps {bad!r}; expected an integer from 1 to 100"):
            optim.Muon([p], ns_steps=bad)
        with pytest.raises(ValueError, match=rf"ns_steps {bad!r}; expected an integer from 1 to 100"):
            optim.Muon([p], ns_steps=bad, ns_variant="legacy")
    optim.Muon([p], ns_steps=100)
    with pytest.raises(ValueError, match="101 coefficient triples; at most 100"):
        optim.Muon([p], ns_coefficients=[(3.4445, -4.775, 2.0315)] * 101)
    for bad in ([(1.0, 2.0)] * 5, [(1.0, float("nan"), 2.0)] * 5, [1.0, 2.0, "x"]):
        with pytest.raises(ValueError, match=r"ns_coefficients\[\d\] is .*; expected \(a, b, c\)"):
            optim.Muon([p], ns_coefficients=bad)


def test_low_precision_params_are_refused_with_the_wrappers_name():
    """bf16/f16 params: get_hyper_optimizer without fp32_main_params refuses them at construction (it knows no
    wrapper will swap them); AdamW and Muon built directly take them, since Float16OptimizerWithFloat16Params
    (optimizer, model) is built around such an optimizer, and refuse them at step() if no wrapper swapped them.
    Both errors name the way to FP32 main params (before: 'not supported from Python yet', at the step only)."""
    model = Tiny().to(torch.bfloat16)
    muon, adamw = split(model)
    with pytest.raises(TypeError, match=r"param q_proj.weight is torch.bfloat16; .*fp32_main_params=True.*"
                                        r"Float16OptimizerWithFloat16Params"):
        optim.get_hyper_optimizer(model=model, muon_params=muon, adamw_params=adamw)
    with pytest.raises(TypeError, match=r"param (embed|q_proj).* is torch.bfloat16"):
        optim.get_hyper_optimizer(model=model, adamw_params=[{"params": adamw}, {"params": muon}])
    for make in (lambda: optim.AdamW(adamw, lr=1e-3), lambda: optim.Muon(muon, lr=0.02),
                 lambda: optim.AdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))])):
        opt = make()
        with pytest.raises(TypeError, match=r"param 0.* is torch.(bfloat16|float16); these optimizers update float32 "
                                            r"params.*fp32_main_params=True.*Float16OptimizerWithFloat16Params"):
            opt.step()
    wrapped = optim.get_hyper_optimizer(model=model, muon_params=muon, adamw_params=adamw, fp32_main_params=True)
    train(model, wrapped, 2)  # the wrapper's own path: the inner optimizers were built over the bf16 params
    from hypertrain import Float16OptimizerWithFloat16Params
    other = Tiny().to(torch.float16)
    direct = Float16OptimizerWithFloat16Params(optim.AdamW(other.parameters(), lr=1e-3), other)
    before = other.head.weight.detach().clone()
    train(other, direct, 2)
    assert not torch.equal(other.head.weight, before), "the wrapped direct AdamW did not step"
