"""The FP32 main-param wrapper (seed 000's checks) on a bf16 transformers Qwen2:
each low-precision param has its own FP32 main param, gradients reach it as
float32 main_grads accumulated over micro batches, the model params are the
bf16 of their main params after every step, the updates match a hand-written
FP32 master-weight loop around torch's own optimizers (AdamW bit for bit, Muon
within 1e-6), updates too small for bf16 survive, a save and load continues
exactly, a float32 model gets no copies, and the seed's checkpoint cases."""

import io
import warnings

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hypertrain import optim
from hypertrain.mixed_precision import KEY, Float16OptimizerWithFloat16Params

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen2(dtype, seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).to(dtype)


def groups(model):
    muon, adamw = [], []
    for name, p in model.named_parameters():
        (muon if any(k in name for k in MATRICES) and p.ndim == 2 else adamw).append(p)
    return muon, adamw


def batches(steps, micro, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 96, (2, 12), generator=gen) for _ in range(micro)] for _ in range(steps)]


def backward(model, micro_batches):
    for x in micro_batches:
        (model(input_ids=x, labels=x).loss / len(micro_batches)).backward()


def wrapped(model, muon=True, **kw):
    m, a = groups(model)
    return optim.get_hyper_optimizer(model=model, muon_params=m if muon else [], adamw_params=a if muon else m + a,
                                     muon_kwargs={"lr": 0.02, "momentum": 0.95},
                                     adamw_kwargs={"lr": 3e-3, "weight_decay": 0.1}, fp32_main_params=True, **kw)


def test_the_seeds_checks_on_a_bf16_model():
    model = qwen2(torch.bfloat16)
    opt = wrapped(model)
    low = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for _, p in low)
    stepped = {id(p) for o in opt.inner.optimizers for g in o.param_groups for p in g["params"]}
    shown = [p for g in opt.param_groups for p in g["params"]]  # the wrapper shows the model params (DCP's names)
    assert [id(p) for p in shown] == [id(p._hypertrain_model_param)
                                      for o in opt.inner.optimizers for g in o.param_groups for p in g["params"]]
    for name, p in low:  # every low-precision trainable param: its own FP32 main param, the one Muon or AdamW holds
        assert p.main_param is not p and p.main_param.dtype == torch.float32, name
        assert p.main_param.data_ptr() != p.data_ptr() and torch.equal(p.main_param, p.float()), name
        assert id(p.main_param) in stepped and id(p) not in stepped, f"{name}: the optimizer steps the bf16 param"
        assert opt.state[p]["main_param"] is p.main_param, f"{name}: the wrapper's state lacks its main param"
    assert [type(o).__name__ for o in opt.inner.optimizers] == ["Muon", "AdamW"]
    before = {n: p.main_param.clone() for n, p in low}
    for micro_batches in batches(3, 2):
        backward(model, micro_batches)
        for name, p in low:  # the FP32 gradient is p.grad itself (grad_dtype), and p.main_grad names it
            assert p.grad is p.main_grad, f"{name}: main_grad is not the param's grad"
            assert p.main_grad is not None and p.main_grad.dtype == torch.float32, f"{name}: a bf16 grad"
        opt.step()
        for name, p in low:  # the model params are the bf16 of their main params
            assert torch.equal(p, p.main_param.to(torch.bfloat16)), f"{name}: not bf16(main_param)"
        opt.zero_grad()
        assert all(p.grad is None and p.main_grad is None and p.main_param.grad is None for _, p in low)
    for name, p in low:  # both groups stepped their main params
        assert not torch.equal(p.main_param, before[name]), f"{name}: its main param never moved"


def master_loop(model, make_opts, steps_batches):
    """The reference: FP32 master copies of a bf16 model's params stepped by torch's optimizers, each micro
    batch's bf16 grads summed in FP32, the masters cast back (torch's own copy_, round to nearest even)."""
    names = [n for n, _ in model.named_parameters()]
    masters = {n: torch.nn.Parameter(p.detach().float()) for n, p in model.named_parameters()}
    opts = make_opts(masters)
    for micro_batches in steps_batches:
        acc = {n: torch.zeros_like(masters[n]) for n in names}
        for x in micro_batches:
            (model(input_ids=x, labels=x).loss / len(micro_batches)).backward()
            for n, p in model.named_parameters():
                acc[n] += p.grad.float()
                p.grad = None
        for n in names:
            masters[n].grad = acc[n]
        for o in opts:
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])
    return masters


def test_adamw_bit_for_bit_against_a_torch_master_loop():
    data = batches(4, 2)
    model = qwen2(torch.bfloat16)
    ref = qwen2(torch.bfloat16)
    opt = wrapped(model, muon=False)
    for micro_batches in data:
        backward(model, micro_batches)
        opt.step()
        opt.zero_grad()
    masters = master_loop(ref, lambda ms: [torch.optim.AdamW(list(ms.values()), lr=3e-3, weight_decay=0.1,
                                                             fused=True)], data)
    for name, p in model.named_parameters():
        # torch's fused kernel takes its vector path on tensors whose chunks are whole vectors; its scalar
        # tail computes in double (test_optim: within 4 ulps): the biases of 32 and 16 are whole vectors
        assert torch.equal(p.main_param, masters[name]), f"{name}: main param parts from torch's master loop"
        assert torch.equal(p, dict(ref.named_parameters())[name]), name


def test_torchs_own_loop_is_the_fp32_master_loop():
    """torch's usual loop around the wrapper, never its zero_grad: model.zero_grad(), two micro batches'
    backward, torch.nn.utils.clip_grad_norm_(model.parameters()), step. The FP32 gradients are the params' .grad
    (grad_dtype float32), so torch's zero_grad clears them and torch's clip reads and scales them. Against the
    hand-written FP32 master loop with the same optimizers on the masters: bitwise, every step (the same
    operations on the same values in the same order: each micro batch's bf16 gradient cast to FP32 and summed
    in FP32, torch's clip over the same FP32 tensors, the same kernels)."""
    data = batches(4, 2)
    model = qwen2(torch.bfloat16)
    opt = wrapped(model)
    ref = qwen2(torch.bfloat16)
    names = [n for n, _ in ref.named_parameters()]
    masters = {n: torch.nn.Parameter(p.detach().float()) for n, p in ref.named_parameters()}
    m, a = groups(ref)
    muon_ids = {id(p) for p in m}
    ref_opt = optim.get_hyper_optimizer(
        muon_params=[masters[n] for n, p in ref.named_parameters() if id(p) in muon_ids],
        adamw_params=[masters[n] for n, p in ref.named_parameters() if id(p) not in muon_ids],
        muon_kwargs={"lr": 0.02, "momentum": 0.95}, adamw_kwargs={"lr": 3e-3, "weight_decay": 0.1})
    max_norm = 0.5
    for step, micro_batches in enumerate(data):
        model.zero_grad()
        losses = []
        for x in micro_batches:
            loss = model(input_ids=x, labels=x).loss / len(micro_batches)
            loss.backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        opt.step()

        acc = {n: torch.zeros_like(masters[n]) for n in names}
        ref_losses = []
        for x in micro_batches:
            loss = ref(input_ids=x, labels=x).loss / len(micro_batches)
            loss.backward()
            ref_losses.append(loss.item())
            for n, p in ref.named_parameters():
                acc[n] += p.grad.float()
                p.grad = None
        for n in names:
            masters[n].grad = acc[n]
        ref_norm = torch.nn.utils.clip_grad_norm_([masters[n] for n in names], max_norm).item()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(masters[n])

        assert ref_norm > max_norm, f"step {step + 1}: the norm {ref_norm} does not clip: the case tests less"
        assert losses == ref_losses, f"step {step + 1}: losses {losses}, the FP32 master loop's {ref_losses}"
        assert norm == ref_norm, f"step {step + 1}: torch's clip over the model read {norm}, the masters' {ref_norm}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.main_param, masters[name]), f"step {step + 1}: {name}'s main param parts"
            assert torch.equal(p, q), f"step {step + 1}: {name} parts from the FP32 master loop's"


def test_a_step_after_model_zero_grad_moves_nothing():
    """model.zero_grad() clears the FP32 gradients (p.grad): the step that follows has none to apply, as
    torch's optimizers skip a param without a grad (before: main_grad kept the cleared gradient and the step
    applied it again)."""
    model = qwen2(torch.bfloat16)
    opt = wrapped(model, muon=False)
    backward(model, batches(1, 1)[0])
    opt.step()
    backward(model, batches(1, 1, seed=6)[0])
    model.zero_grad()
    before = {n: (p.detach().clone(), p.main_param.detach().clone()) for n, p in model.named_parameters()}
    opt.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name][0]) and torch.equal(p.main_param, before[name][1]), \
            f"{name}: a step after model.zero_grad() moved it"


def test_a_torch_without_grad_dtype_is_refused(monkeypatch):
    from hypertrain import mixed_precision
    monkeypatch.setattr(mixed_precision, "_has_grad_dtype", lambda p: False)
    model = qwen2(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"has no Tensor.grad_dtype.*q_proj.weight's gradient.*model.zero_grad"):
        wrapped(model, muon=False)


def test_muon_against_torch_on_the_same_main_grads(torch_muon_fp32):
    """Muon + AdamW through the wrapper against torch.optim.Muon + torch.optim.AdamW(fused=True) stepping FP32
    masters with the same main_grads, and against the same in float64 (the exact answer). The bf16 forward
    cannot be shared: a main param 1e-7 away rounds a few bf16 weights the other way (10 of 26k after one
    step, measured) and this small model's next gradients part by 1e-2. Bound: ours within max(1e-6, 2x
    torch's own float32 distance) of the float64 run, per tensor. Measured over 3 steps: torch's float32 run
    is up to 1.5e-6 from float64 (Newton-Schulz's five products at coefficients near 3.4 amplify float32
    rounding), ours up to 1.46e-6 and never more than 1.3x torch's distance; ours to torch float32 1.1e-6."""
    model = qwen2(torch.bfloat16)
    m, a = groups(model)
    opt = Float16OptimizerWithFloat16Params(
        optim.ChainedOptimizer([optim.Muon(m, lr=0.02, weight_decay=0.1, momentum=0.95),
                                optim.AdamW(a, lr=3e-3, weight_decay=0.1)]), model)
    names = [n for n, _ in model.named_parameters()]
    muon_names = {n for n, p in model.named_parameters() if any(k in n for k in MATRICES) and p.ndim == 2}
    refs = []
    for dtype in (torch.float32, torch.float64):
        ms = {n: torch.nn.Parameter(p.detach().to(dtype)) for n, p in model.named_parameters()}
        refs.append((dtype, ms, [torch.optim.Muon([ms[n] for n in names if n in muon_names], lr=0.02,
                                                  weight_decay=0.1, momentum=0.95),
                                 torch.optim.AdamW([ms[n] for n in names if n not in muon_names], lr=3e-3,
                                                   weight_decay=0.1, fused=True)]))

    def rel(x, y):
        return (x.double() - y.double()).abs().max().item() / y.double().abs().max().item()

    for step, micro_batches in enumerate(batches(3, 1)):
        backward(model, micro_batches)
        for dtype, ms, _ in refs:
            for n, p in model.named_parameters():
                ms[n].grad = p.main_grad.to(dtype)
        opt.step()
        opt.zero_grad()
        for _, _, opts in refs:
            for o in opts:
                o.step()
                o.zero_grad()
        (_, f32, _), (_, f64, _) = refs
        for name, p in model.named_parameters():
            floor = rel(f32[name], f64[name])
            d = rel(p.main_param, f64[name])
            if name not in muon_names:
                assert torch.equal(p.main_param, f32[name]), f"step {step + 1}: {name} parts from torch's AdamW"
            assert d <= max(1e-6, 2 * floor), f"step {step + 1}: {name} {d:.3g} from float64, torch {floor:.3g}"
            assert torch.equal(p, p.main_param.to(torch.bfloat16)), name


def test_updates_below_bf16_resolution_survive():
    """AdamW's first steps move each element by about lr: at lr 1e-5 that is under half a bf16 ulp of the
    weights (~0.02: ulp 2^-13), so torch.optim.AdamW on the bf16 params themselves loses every one, while the
    main params take them all and the bf16 params follow once they add up."""
    data = batches(6, 1)
    direct = qwen2(torch.bfloat16)
    start = {n: p.detach().clone() for n, p in direct.named_parameters()}
    plain = torch.optim.AdamW(direct.parameters(), lr=1e-5, weight_decay=0.0)
    model = qwen2(torch.bfloat16)
    opt = Float16OptimizerWithFloat16Params(optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0), model)
    for micro_batches in data:
        backward(direct, micro_batches)
        plain.step()
        plain.zero_grad()
        backward(model, micro_batches)
        opt.step()
        opt.zero_grad()
    w = dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    big = w.main_param.abs() > 0.01
    lost = (dict(direct.named_parameters())["model.layers.0.mlp.down_proj.weight"] == start[
        "model.layers.0.mlp.down_proj.weight"])[big].float().mean().item()
    moved = (w.main_param != start["model.layers.0.mlp.down_proj.weight"].float())[big].float().mean().item()
    assert lost > 0.9, f"bf16 AdamW kept {1 - lost:.0%} of its updates: the case does not test the loss"
    assert moved > 0.99, f"only {moved:.0%} of the main params moved"


def test_save_and_load_continue_exactly(tmp_path):
    data = batches(4, 2)
    model = qwen2(torch.bfloat16)
    opt = wrapped(model)
    for micro_batches in data[:2]:
        backward(model, micro_batches)
        opt.step()
        opt.zero_grad()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    for micro_batches in data[2:]:
        backward(model, micro_batches)
        opt.step()
        opt.zero_grad()
    saved = torch.load(tmp_path / "ckpt.pt")
    mains = saved["optim"][KEY]["fp32_from_fp16_params"]
    names = [n for n, _ in model.named_parameters()]
    assert sorted(mains) == sorted(names) and all(t.dtype == torch.float32 for t in mains.values())
    tails = sum(int((t != t.to(torch.bfloat16).float()).any()) for t in mains.values())
    assert tails == len(mains), "a saved main param holds no more than its bf16 (the FP32 tail is not saved)"
    resumed = qwen2(torch.bfloat16, seed=7)
    resumed.load_state_dict(saved["model"])
    ropt = wrapped(resumed)
    ropt.load_state_dict(saved["optim"])
    for name, p in resumed.named_parameters():
        assert torch.equal(p.main_param, mains[name]), f"{name}: the loaded main param is not the saved one"
    for micro_batches in data[2:]:
        backward(resumed, micro_batches)
        ropt.step()
        ropt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p.main_param, q.main_param) and torch.equal(p, q), f"{name}: the resumed run parts"


def test_a_float32_model_is_its_own_main_params():
    model = qwen2(torch.float32)
    opt = wrapped(model)
    for _, p in model.named_parameters():
        assert p.main_param is p
    ids = {id(p) for p in model.parameters()}
    assert all(id(p) in ids for g in opt.param_groups for p in g["params"]), "a copy of a float32 param"
    backward(model, batches(1, 1)[0])
    opt.step()
    sd = opt.state_dict()
    assert sd[KEY]["fp32_from_fp16_params"] == {}
    again = wrapped(qwen2(torch.float32))
    again.load_state_dict(io_roundtrip(sd))


def io_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def test_the_seeds_checkpoint_cases():
    model = qwen2(torch.bfloat16)
    opt = wrapped(model)
    backward(model, batches(1, 1)[0])
    opt.step()
    opt.zero_grad()
    full = io_roundtrip(opt.state_dict())
    # an ordinary optimizer checkpoint (no main param anywhere): loads, with a warning
    plain = {"state": {i: {k: v for k, v in st.items() if k != "main_param"} for i, st in full["state"].items()},
             "param_groups": full["param_groups"]}
    other_model = qwen2(torch.bfloat16, seed=3)
    other = wrapped(other_model)
    stale = {name: main.clone() for name, _, main in other.pairs}
    other_model.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="FP32 main params start from the model"):
        other.load_state_dict(plain)
    for name, p, main in other.pairs:  # refreshed from the loaded model params
        assert torch.equal(main, p.float()) and not torch.equal(main, stale[name]), name
    assert torch.equal(other.inner.optimizers[1].state[other.pairs[-1][2]]["exp_avg"],
                       opt.inner.optimizers[1].state[opt.pairs[-1][2]]["exp_avg"]), "AdamW's state not restored"
    partial = dict(full)
    partial[KEY] = {"fp32_from_fp16_params": dict(list(full[KEY]["fp32_from_fp16_params"].items())[2:])}
    missing = list(full[KEY]["fp32_from_fp16_params"])[:2]
    with pytest.raises(ValueError, match=f"lacks 2 of the .*{missing[0]}, {missing[1]}"):
        wrapped(qwen2(torch.bfloat16)).load_state_dict(partial)
    # DCP keeps "state" and "param_groups" only: the main params in their params' state restore exactly
    dcp_kept = {k: v for k, v in full.items() if k != KEY}
    again_model = qwen2(torch.bfloat16, seed=3)
    again_model.load_state_dict(model.state_dict())
    again = wrapped(again_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(dcp_kept)
    for (name, p, main), (_, _, want) in zip(again.pairs, opt.pairs):
        assert torch.equal(main, want), f"{name}: the main param in the state is not restored"
    names = [name for name, _, _ in opt.pairs]
    partial = {"state": {i: dict(st) for i, st in full["state"].items()}, "param_groups": full["param_groups"]}
    for i in list(partial["state"])[:2]:
        del partial["state"][i]["main_param"]
    with pytest.raises(ValueError, match=f"state \\(its 'main_param' entries\\) lacks 2 of the .*{names[0]}, "
                                         f"{names[1]}"):
        wrapped(qwen2(torch.bfloat16)).load_state_dict(partial)


def test_bad_input():
    model = qwen2(torch.bfloat16)
    with pytest.raises(ValueError, match="needs model="):
        optim.get_hyper_optimizer(muon_params=groups(model)[0], fp32_main_params=True)
    d = torch.nn.Linear(4, 4).to(torch.float64)
    with pytest.raises(TypeError, match="has dtype torch.float64; expected float16, bfloat16 or float32"):
        Float16OptimizerWithFloat16Params(torch.optim.SGD(d.parameters(), lr=0.1), d)


def test_clip_grad_norm_reads_the_main_grads():
    """The norm over main_grads (the bf16 params' FP32 grads) against torch.nn.utils.clip_grad_norm_ over
    the same FP32 gradients: torch sums float32 norms, hypertrain squares in double, so the norms agree within
    float32 rounding (2 ulps); the gradients are scaled as torch scales them, by the float32
    max_norm / (norm + 1e-6), bit for bit."""
    model = qwen2(torch.bfloat16)
    wrapped(model)
    backward(model, batches(1, 2)[0])
    raw = [p.main_grad.clone() for p in model.parameters()]
    copies = [torch.nn.Parameter(r.clone()) for r in raw]
    for c in copies:
        c.grad = c.detach().clone()
    want = torch.nn.utils.clip_grad_norm_(copies, max_norm=0.05)
    got = optim.clip_grad_norm_(model.parameters(), max_norm=0.05)
    assert want.item() > 0.05, "the case does not clip"
    assert abs(got.item() - want.item()) <= 2 * torch.finfo(torch.float32).eps * want.item()
    coef = 0.05 / (got + 1e-6)
    for (name, p), r in zip(model.named_parameters(), raw):
        assert p.grad is p.main_grad and torch.equal(p.main_grad, r * coef), f"{name}: not scaled as torch scales"


def dcp_round_trip(model, opt, fresh_model, fresh_opt, path):
    """torch's distributed checkpoint in one process: dcp.save of get_model_state_dict and
    get_optimizer_state_dict, then a fresh model's and optimizer's state dicts as the layout, dcp.load into them,
    set_model_state_dict and set_optimizer_state_dict (a warning is an error: main params refreshed from the
    model would warn)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        sd = {"model": get_model_state_dict(fresh_model), "optim": get_optimizer_state_dict(fresh_model, fresh_opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(fresh_model, sd["model"])
        warnings.simplefilter("error")
        set_optimizer_state_dict(fresh_model, fresh_opt, sd["optim"])
    return sd["optim"]


@pytest.mark.parametrize("what", ["bf16 wrapper", "float32 wrapper", "chain"])
def test_torchs_dcp_state_dict_helpers(what, tmp_path):
    """get_optimizer_state_dict / set_optimizer_state_dict (torch.distributed.checkpoint.state_dict) on the
    wrapper and the chain: the state keyed by the model's parameter names, each bf16 param's FP32 main param in
    its state, and a fresh model and optimizer loaded through dcp go on bit for bit (before: KeyError: 0 on the
    wrapper, whose groups held the main params, and its main params dropped with _mixed_precision_optimizer)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dtype = torch.float32 if what != "bf16 wrapper" else torch.bfloat16
    data = batches(4, 2)

    def build(seed):
        model = qwen2(dtype, seed)
        if what == "chain":
            m, a = groups(model)
            return model, optim.get_hyper_optimizer(model=model, muon_params=m, adamw_params=a,
                                                    muon_kwargs={"lr": 0.02, "momentum": 0.95},
                                                    adamw_kwargs={"lr": 3e-3, "weight_decay": 0.1})
        return model, wrapped(model)

    model, opt = build(0)
    fresh_model, fresh_opt = build(3)
    layout = get_optimizer_state_dict(fresh_model, fresh_opt)  # a fresh optimizer's: every entry a load fills
    names = [n for n, _ in model.named_parameters()]
    assert sorted(layout["state"]) == sorted(names), "not keyed by the model's parameter names"
    for name, st in layout["state"].items():
        want = {"momentum_buffer"} if "proj" in name and "bias" not in name else {"step", "exp_avg", "exp_avg_sq"}
        if what == "bf16 wrapper":
            want.add("main_param")
        assert set(st) == want, f"{name}: a fresh optimizer's state dict holds {sorted(st)}"
    for micro_batches in data[:2]:
        backward(model, micro_batches)
        opt.step()
        opt.zero_grad()
    osd = dcp_round_trip(model, opt, fresh_model, fresh_opt, tmp_path / "dcp")
    if what == "bf16 wrapper":
        for name, p in model.named_parameters():
            t = osd["state"][name]["main_param"]
            assert t.dtype == torch.float32 and torch.equal(t, p.main_param), name
        assert all(torch.equal(q.main_param, p.main_param) for p, q in zip(model.parameters(),
                                                                          fresh_model.parameters()))
    for micro_batches in data[2:]:
        for m, o in ((model, opt), (fresh_model, fresh_opt)):
            backward(m, micro_batches)
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(p, q), f"{name}: the run resumed through dcp parts from the one that went on"
        if what == "bf16 wrapper":
            assert torch.equal(p.main_param, q.main_param), f"{name}: its main param parts"


def test_the_wrappers_groups_and_state_are_the_optimizers():
    """The wrapper's param_groups show the model params and are Muon's and AdamW's groups otherwise (a
    scheduler's lr reaches them); its state is keyed by the model params, a write reaching the optimizer."""
    model = qwen2(torch.bfloat16)
    opt = wrapped(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for o in opt.inner.optimizers for g in o.param_groups] == [0.01, 1.5e-3]
    opt.param_groups[1]["weight_decay"] = 0.25
    assert opt.inner.optimizers[1].param_groups[0]["weight_decay"] == 0.25
    assert opt.param_groups[0]["betas"] == (0.95, 0.0) and "initial_lr" in opt.param_groups[0]
    with pytest.raises(TypeError, match="params are set by the wrapper"):
        opt.param_groups[0]["params"] = []
    backward(model, batches(1, 1)[0])
    opt.step()
    sched.step()
    p = next(q for n, q in model.named_parameters() if n.endswith("norm.weight"))
    assert set(opt.state[p]) == {"main_param", "step", "exp_avg", "exp_avg_sq"}
    opt.state[p]["exp_avg"] = torch.ones_like(p.main_param)
    assert torch.equal(opt.inner.optimizers[1].state[p.main_param]["exp_avg"], torch.ones_like(p.main_param))
    with pytest.raises(TypeError, match="copy into it"):
        opt.state[p]["main_param"] = p.main_param.clone()
