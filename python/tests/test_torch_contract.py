"""ChainedOptimizer (and Muon, AdamW, the FP32 main-param wrapper) against the
contract of torch's own optimizers, measured against torch's classes: torch's
schedulers (OneCycleLR, CyclicLR, CosineAnnealingLR, LambdaLR, SequentialLR,
ReduceLROnPlateau, ...) run on the chain give each group the lr (and momentum)
they give torch.optim.Muon's and torch.optim.AdamW's groups alone, and the params
follow torch's (AdamW bit for bit, Muon within 1e-6 with its Newton-Schulz in
FP32); add_param_group by shape or by the optimizer named; the groups live
after a sub-optimizer's load_state_dict; defaults; hooks; pickling and deepcopy."""

import copy
import io
import pickle

import pytest
import torch
from torch.optim import lr_scheduler as sched

from hypertrain import Float16OptimizerWithFloat16Params, optim

STEPS = 8
MUON_SHAPES = [(32, 16), (16, 48)]
ADAMW_SHAPES = [(64,), (16, 16)]  # multiples of 16 elements: torch's fused AdamW's vector path throughout
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW_KW = dict(lr=3e-3, weight_decay=0.01)


def params(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]


def grads(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def chain_and_torch():
    """The chain (torch's Muon semantics) and torch's own Muon and AdamW on copies of the same params, two
    groups each (the second group's lr halved)."""
    mp, ap = params(MUON_SHAPES, 1), params(ADAMW_SHAPES, 2)
    tm, ta = [torch.nn.Parameter(p.detach().clone()) for p in mp], [torch.nn.Parameter(p.detach().clone()) for p in ap]

    def groups(ps, lr):
        return [{"params": ps[:1]}, {"params": ps[1:], "lr": lr / 2}]

    chain = optim.get_hyper_optimizer(muon_params=groups(mp, MUON_KW["lr"]), adamw_params=groups(ap, ADAMW_KW["lr"]),
                                      muon_kwargs=MUON_KW, adamw_kwargs=ADAMW_KW, muon_semantics="torch")
    theirs = [torch.optim.Muon(groups(tm, MUON_KW["lr"]), **MUON_KW),
              torch.optim.AdamW(groups(ta, ADAMW_KW["lr"]), fused=True, **ADAMW_KW)]
    return chain, mp + ap, theirs, tm + ta


SCHEDULERS = {
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=1e-3, max_lr=0.03, step_size_up=3, base_momentum=0.85,
                                         max_momentum=0.95),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-4),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 0.8 ** s),
    "SequentialLR": lambda o: sched.SequentialLR(o, [sched.LinearLR(o, start_factor=0.1, total_iters=3),
                                                     sched.CosineAnnealingLR(o, T_max=STEPS - 3)], milestones=[3]),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "StepLR": lambda o: sched.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3),
}
PLATEAU = [1.0, 1.0, 0.9, 0.9, 0.9, 0.5, 0.6, 0.7]  # ReduceLROnPlateau's metric: flat, better, flat, worse


def hyper_view(group):
    """What a scheduler may have set on a group: lr and its momentum (AdamW's beta1)."""
    momentum = group["betas"][0] if "betas" in group else group["momentum"]
    return group["lr"], momentum


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_torch_schedulers_on_the_chain_are_torch_optimizers(torch_muon_fp32, name):
    chain, ours, theirs, ref = chain_and_torch()
    make = SCHEDULERS[name]
    s_chain = make(chain)
    s_theirs = [make(o) for o in theirs]
    ref_groups = [g for o in theirs for g in o.param_groups]
    start = [hyper_view(g) for g in chain.param_groups]
    for t, gs in enumerate(grads(MUON_SHAPES + ADAMW_SHAPES, 3)):
        for a, b in zip(chain.param_groups, ref_groups):
            assert hyper_view(a) == hyper_view(b), f"{name} step {t}: group {hyper_view(a)}, torch's {hyper_view(b)}"
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        chain.step()
        for o in theirs:
            o.step()
        if name == "ReduceLROnPlateau":
            s_chain.step(PLATEAU[t])
            for s in s_theirs:
                s.step(PLATEAU[t])
        else:
            s_chain.step()
            for s in s_theirs:
                s.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            if i < len(MUON_SHAPES):
                assert rel(p.detach(), q.detach()) <= 1e-6, f"{name} step {t}: Muon param {i}: {rel(p, q):.3g}"
            else:
                assert torch.equal(p, q), f"{name} step {t}: AdamW param {i} parts from torch.optim.AdamW"
    assert [hyper_view(g) for g in chain.param_groups] != start, "the schedule changed nothing: the test is blind"
    assert s_chain.get_last_lr() == [lr for s in s_theirs for lr in s.get_last_lr()]


def test_chain_defaults_are_its_optimizers():
    chain, *_ = chain_and_torch()
    d = chain.defaults
    assert d["momentum"] == 0.95 and d["betas"] == (0.9, 0.999) and d["lr"] == MUON_KW["lr"], d


def test_add_param_group_by_shape_or_by_the_optimizer_named(torch_muon_fp32, tmp_path):
    """The new group goes to the chain's Muon (2-D, 3-D params) or AdamW (the others), or to the optimizer named;
    it takes that optimizer's defaults, steps as torch's optimizers step a group added to them, is in the state
    dict, and a fresh chain with the same groups resumes from it exactly (before: NotImplementedError)."""
    chain, ours, theirs, ref = chain_and_torch()
    extra = params([(24, 16), (48,), (16, 8)], 4)
    extra_ref = [torch.nn.Parameter(p.detach().clone()) for p in extra]
    assert chain.add_param_group({"params": [extra[0]], "lr": 0.01}) is chain.optimizers[0]
    assert chain.add_param_group({"params": [extra[1]]}) is chain.optimizers[1]
    assert chain.add_param_group({"params": [extra[2]], "lr": 1e-3}, optimizer="AdamW") is chain.optimizers[1]
    theirs[0].add_param_group({"params": [extra_ref[0]], "lr": 0.01})
    theirs[1].add_param_group({"params": [extra_ref[1]]})
    theirs[1].add_param_group({"params": [extra_ref[2]], "lr": 1e-3})
    assert len(chain.param_groups) == 7 and chain.param_groups[2]["params"] == [extra[0]]
    assert chain.param_groups[2]["momentum"] == 0.95 and chain.param_groups[5]["lr"] == ADAMW_KW["lr"]
    ours, ref = ours[:2] + extra[:1] + ours[2:] + extra[1:], ref[:2] + extra_ref[:1] + ref[2:] + extra_ref[1:]
    shapes = [tuple(p.shape) for p in ours]
    s_chain, s_theirs = sched.StepLR(chain, 2, 0.5), [sched.StepLR(o, 2, 0.5) for o in theirs]
    for t, gs in enumerate(grads(shapes, 5)):
        if t == 4:
            buf = io.BytesIO()
            torch.save({"params": [p.detach() for p in ours], "optim": chain.state_dict(),
                        "sched": s_chain.state_dict()}, buf)
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        chain.step()
        s_chain.step()
        for o, s in zip(theirs, s_theirs):
            o.step()
            s.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            close = rel(p.detach(), q.detach()) <= 1e-6 if p.ndim >= 2 and i < 3 else torch.equal(p, q)
            assert close, f"step {t}: param {i} {tuple(p.shape)} parts from torch's optimizers"
    buf.seek(0)
    saved = torch.load(buf)
    assert len(saved["optim"]["param_groups"]) == 7
    again = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    fresh = optim.get_hyper_optimizer(muon_params=[{"params": again[:1]}, {"params": again[1:2]}],
                                      adamw_params=[{"params": again[3:4]}, {"params": again[4:5]}],
                                      muon_kwargs=MUON_KW, adamw_kwargs=ADAMW_KW, muon_semantics="torch")
    fresh.add_param_group({"params": [again[2]]})
    fresh.add_param_group({"params": [again[5]]})
    fresh.add_param_group({"params": [again[6]]}, optimizer=1)
    fresh.load_state_dict(saved["optim"])
    s_fresh = sched.StepLR(fresh, 2, 0.5)
    s_fresh.load_state_dict(saved["sched"])
    for t, gs in enumerate(grads(shapes, 5)[4:]):
        for p, g in zip(again, gs):
            p.grad = g.clone()
        fresh.step()
        s_fresh.step()
    for i, (p, q) in enumerate(zip(again, ours)):
        assert torch.equal(p, q), f"param {i}: the resumed chain parts from the one that went on"
    with pytest.raises(ValueError, match=r"mixes matrices and other shapes \(param 1 has shape \(4,\)"):
        chain.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))]})
    with pytest.raises(ValueError, match=r"param 0 of the group is already one of the chain's"):
        chain.add_param_group({"params": [extra[1]]})
    with pytest.raises(ValueError, match=r"optimizer='SGD' names 0 of the chain's optimizers \(0: Muon, 1: AdamW\)"):
        chain.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]}, optimizer="SGD")
    with pytest.raises(ValueError, match=r"Muon: param 3 has shape \(4,\); Muon takes matrices"):
        chain.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]}, optimizer="Muon")
    assert len(chain.param_groups) == 7, "a refused group stayed"
    only_adamw = optim.get_hyper_optimizer(adamw_params=params([(8,)], 6))
    with pytest.raises(ValueError, match=r"go to a Muon by their shape, and the chain has 0 \(0: AdamW\): name the "
                                         r"optimizer"):
        only_adamw.add_param_group({"params": params([(8, 8)], 7)})


def test_a_sub_optimizers_load_state_dict_leaves_the_chain_live():
    """torch's load_state_dict makes new group dicts: the chain's groups are those (before: the old ones, which
    a scheduler then set to no effect)."""
    chain, ours, *_ = chain_and_torch()
    other, *_ = chain_and_torch()
    chain.optimizers[1].load_state_dict(other.optimizers[1].state_dict())
    assert chain.param_groups[2] is chain.optimizers[1].param_groups[0]
    s = sched.LambdaLR(chain, lambda step: 0.5)
    s.step()
    assert chain.optimizers[1].param_groups[0]["lr"] == ADAMW_KW["lr"] * 0.5
    chain.optimizers[1].add_param_group({"params": params([(8,)], 8)})
    assert len(chain.param_groups) == 5 and len(chain.state_dict()["param_groups"]) == 5


def test_hooks_run_on_the_chain_and_the_wrapper():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).to(torch.bfloat16)
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim < 2]
    wrapped = optim.get_hyper_optimizer(model=model, muon_params=mats, adamw_params=vecs, fp32_main_params=True,
                                        muon_semantics="hyperparallel")
    chain = optim.get_hyper_optimizer(muon_params=params([(8, 8)], 9), adamw_params=params([(8,)], 10),
                                      muon_semantics="torch")
    for opt in (chain, wrapped):
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append("step pre"))
        opt.register_step_post_hook(lambda o, a, k: seen.append("step post"))
        opt.register_state_dict_pre_hook(lambda o: seen.append("sd pre"))
        opt.register_state_dict_post_hook(lambda o, sd: dict(sd, marked=True))
        opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "marked"})
        opt.register_load_state_dict_post_hook(lambda o: seen.append("load post"))
        if opt is wrapped:
            x = torch.randn(4, 16).to(torch.bfloat16)
            model(x).float().square().mean().backward()
        else:
            for p in (q for g in opt.param_groups for q in g["params"]):
                p.grad = torch.ones_like(p)
        opt.step()
        sd = opt.state_dict()
        assert sd["marked"] is True
        opt.load_state_dict(sd)  # the pre hook took "marked" away, else the load would refuse it or keep it
        assert seen == ["step pre", "step post", "sd pre", "load post"], (type(opt).__name__, seen)


def _bf16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).to(torch.bfloat16)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("what", ["Muon", "AdamW", "chain", "wrapper"])
def test_a_copied_optimizer_steps_as_the_original(what, how):
    """deepcopy, pickle and torch.save of an optimizer (with its params, as torch's are copied): the copy steps
    its own params as the original steps its own (before: AttributeError or KeyError at the copy's step)."""
    if what == "wrapper":
        model = _bf16_model()
        mats = [p for p in model.parameters() if p.ndim == 2]
        vecs = [p for p in model.parameters() if p.ndim < 2]
        opt = optim.get_hyper_optimizer(model=model, muon_params=mats, adamw_params=vecs, fp32_main_params=True,
                                        muon_semantics="hyperparallel")
        x = torch.randn(4, 16).to(torch.bfloat16)

        def backward(m):
            m.zero_grad()
            m(x).float().square().mean().backward()

        backward(model)
        opt.step()
        pair = (model, opt)
    else:
        ps = params([(12, 8), (8, 12)], 11) if what != "AdamW" else params([(32,), (16, 16)], 11)
        if what == "Muon":
            opt = optim.Muon(ps, lr=0.02)
        elif what == "AdamW":
            opt = optim.AdamW(ps, lr=1e-3)
        else:
            opt = optim.get_hyper_optimizer(muon_params=ps[:1], adamw_params=ps[1:], muon_semantics="torch")
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        pair = (ps, opt)
    if how == "deepcopy":
        twin = copy.deepcopy(pair)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(pair))
    else:
        buf = io.BytesIO()
        torch.save(pair, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    for (held, o) in (pair, twin):
        if what == "wrapper":
            backward(held)
        else:
            for p in held:
                p.grad = torch.full_like(p, 0.5)
        o.step()
    a = list(pair[0].parameters()) if what == "wrapper" else pair[0]
    b = list(twin[0].parameters()) if what == "wrapper" else twin[0]
    assert all(p is not q for p, q in zip(a, b)), "the copy shares the original's params"
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"{what} {how}: param {i} of the copy parts from the original's"
    if what == "wrapper":
        for p, q in zip(a, b):
            assert torch.equal(p.main_param, q.main_param) and q.main_param is not p.main_param
