"""HyperParallel's optimizer API (seed 002) on PyTorch tensors, computed by
hypertrain's C kernels: AdamW, Muon, ChainedOptimizer and get_hyper_optimizer.

Each optimizer is a torch.optim.Optimizer: param_groups, state_dict() and
load_state_dict() in torch's own layout (AdamW's state is torch.optim.AdamW's,
Muon's torch.optim.Muon's), so torch.save, torch's schedulers and checkpoints
written by torch's optimizers work with them. The arithmetic is hypertrain's
(docs/NUMERICS.md): AdamW rounds as torch's fused kernel, bit for bit; Muon's
Newton-Schulz runs in FP32 (or bf16 operands, ns_dtype="bfloat16"). The
kernels read the tensors where they are (contiguous, float32; on the CPU, or
on CUDA where hypertrain is built with its CUDA backend, queued on torch's
current stream): nothing is copied, and the GIL is released while they run. So every tensor a kernel
takes (the param, its gradient, each state tensor, the FP32 wrapper's model
copy) is checked at every step, before any is written, against the param's
(local) shape, dtype, device and layout, and a state dict's state shapes at
load_state_dict; an error names the param by index and by name where known.
bf16/f16 params take the FP32 main-param wrapper (hypertrain.mixed_precision).
"""

import logging
import math
import operator

import torch

from . import _C

# torch.optim.Muon's default coefficients (Keller Jordan's), applied ns_steps times.
_TORCH_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)


_LOW = (torch.bfloat16, torch.float16)
# The longest Newton-Schulz schedule the kernels take (include/hypertrain/optim.h, HT_NS_MAX_STEPS: 100);
# torch.optim.Muon's default is 5 iterations.
NS_MAX_STEPS = 100


def _label(index, name):
    """How an error names a param: its index over the optimizer's groups, and its name where known."""
    return f"param {index}" + (f" ({name})" if name else "")


def _param_name(opt, group, i, p):
    """p's name: torch's param_names (an optimizer built from named_parameters()), else the one
    get_hyper_optimizer or the FP32 main-param wrapper recorded from the model, else None."""
    names = group.get("param_names")
    if names is not None and i < len(names):
        return names[i]
    return getattr(opt, "_param_names", {}).get(id(p))


def _low_precision_error(who, label, dtype):
    return TypeError(f"{who}: {label} is {dtype}; these optimizers update float32 params. A bf16/f16 model "
                     "keeps FP32 main params: get_hyper_optimizer(..., fp32_main_params=True), or "
                     "hypertrain.Float16OptimizerWithFloat16Params(this optimizer, model) around it")


def _require_device(who, label, t):
    """t on a device the kernels run on: the CPU, or the CUDA device of hypertrain's CUDA backend (a build with
    cmake -DHT_CUDA=ON); else an error saying what is supported."""
    if t.device.type == "cpu":
        return
    if t.device.type == "cuda":
        device, why = _C.cuda_backend()
        if device is None:
            raise ValueError(f"{who}: {label} is on {t.device}, and {why}. hypertrain runs AdamW, Muon, the FP32 "
                             "main-param wrapper and clip_grad_norm_ on CPU tensors, and on CUDA tensors when built "
                             "with its CUDA backend (cmake -DHT_CUDA=ON) on a machine with a GPU")
        if (t.device.index if t.device.index is not None else device) != device:
            raise ValueError(f"{who}: {label} is on {t.device}; hypertrain's CUDA backend computes on cuda:{device} "
                             "(the process's current device when it started)")
        return
    raise ValueError(f"{who}: {label} is on {t.device}; hypertrain's optimizers run on CPU tensors and, with its "
                     "CUDA backend, CUDA tensors")


def _stream(t):
    """The kernels' `stream` argument for tensor t: None for a CPU tensor; for a CUDA tensor torch's current
    stream on its device, where the kernels queue their work, in order with torch's."""
    return None if t.device.type == "cpu" else torch.cuda.current_stream(t.device).cuda_stream


def _require_fp32(who, label, p, g):
    """p and its gradient g as the kernels read them, or an error naming the param."""
    _require_device(who, label, p)
    if not p.is_floating_point():
        raise TypeError(f"{who}: {label} has dtype {p.dtype}; expected a floating-point param")
    if p.dtype in _LOW:
        raise _low_precision_error(who, label, p.dtype)
    if p.dtype != torch.float32:
        raise TypeError(f"{who}: {label} has dtype {p.dtype}; these optimizers update float32 params")
    if g.dtype != torch.float32 or g.device != p.device or g.shape != p.shape:
        raise TypeError(f"{who}: {label}'s gradient is {g.dtype} {tuple(g.shape)} on {g.device}; expected "
                        f"float32 {tuple(p.shape)} on {p.device}")
    if not p.is_contiguous() or not g.is_contiguous():
        raise ValueError(f"{who}: {label} or its gradient is not contiguous")


def _require_state(who, label, key, t, pl):
    """State tensor t (a DTensor: its local shard) as a kernel reads and writes it in place: pl's shape (the
    param's local rows), float32, contiguous, on the CPU; anything else would be read or written past its
    end, or silently in the wrong places. Returns the local tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {label}'s state {key!r} is a {type(t).__name__}, not a tensor")
    tl = _local(t)
    if tl.shape != pl.shape or tl.dtype != torch.float32 or tl.device != pl.device or not tl.is_contiguous():
        layout = "contiguous" if tl.is_contiguous() else "not contiguous"
        raise ValueError(f"{who}: {label}'s state {key!r} is {tl.dtype} {tuple(tl.shape)} ({layout}) on "
                         f"{tl.device}; the kernel takes it as float32 {tuple(pl.shape)}, contiguous, on "
                         f"{pl.device}, as the param (a state dict of another model or layout?)")
    return tl


def _require_step(who, label, s):
    """AdamW's step count: a one-element tensor holding a whole number >= 0 (torch's float32 layout; on the
    param's device where torch's fused CUDA AdamW keeps it)."""
    if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.is_complex():
        what = f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"{who}: {label}'s state 'step' is {what}; expected a one-element tensor (torch's "
                         "float32 step count)")
    v = float(s.item())
    if not (math.isfinite(v) and v >= 0 and v == int(v)):
        raise ValueError(f"{who}: {label}'s state 'step' is {v}; expected a whole number >= 0")


def _check_loaded_state(who, opt, state_dict, keys):
    """At load_state_dict: each saved state tensor a kernel takes has its param's (local) shape; torch's
    load_state_dict checks the groups' sizes only, and casts the dtype and device itself. The step checks
    everything again (state can change after a load)."""
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
        return  # torch's load_state_dict says what is wrong
    saved = [i for g in state_dict["param_groups"] for i in g.get("params", [])]
    groups = [(g, i, p) for g in opt.param_groups for i, p in enumerate(g["params"])]
    if len(saved) != len(groups):
        return
    for index, (sid, (group, i, p)) in enumerate(zip(saved, groups)):
        st = state_dict["state"].get(sid)
        if not isinstance(st, dict):
            continue
        label = _label(index, _param_name(opt, group, i, p))
        for key in keys:
            if key not in st:
                continue
            v = st[key]
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{who}.load_state_dict: {label}'s state {key!r} is a {type(v).__name__}, not a "
                                "tensor")
            if _local(v).shape != _local(p).shape:
                raise ValueError(f"{who}.load_state_dict: {label}'s state {key!r} has shape "
                                 f"{tuple(_local(v).shape)}; the param's is {tuple(_local(p).shape)} (a state dict "
                                 "of another model?)")


def _check_params(who, groups, first=0):
    """At construction (and add_param_group): every param a floating-point tensor on a device the kernels run
    on (_require_device); first: the index of the groups' first param over the optimizer's groups."""
    for i, p in enumerate((q for g in groups for q in g["params"]), first):
        if not p.is_floating_point():
            raise TypeError(f"{who}: param {i} has dtype {p.dtype}; expected a floating-point param")
        _require_device(who, f"param {i}", p)


def _float(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _closure_loss(closure):
    """torch.optim's closure convention: the loss it returns, computed with gradients enabled (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _local(t):
    """A DTensor's local shard (FSDP2's Shard(0) params, their grads and state), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _model_copy(who, label, p, pl):
    """The low-precision model param whose FP32 main param p is (the FP32
    main-param wrapper's), as the kernels' (pointer, dtype name) arguments: the
    step writes it, rounded to nearest even, in the same pass; (None, None)
    where p is its own model param. Checked as the state is: the kernel writes
    pl.numel() elements of it."""
    model = getattr(p, "_hypertrain_model_param", None)
    if model is None:
        return None, None
    ml = _local(model)
    if ml.shape != pl.shape or ml.dtype not in _LOW or ml.device != pl.device or not ml.is_contiguous():
        raise ValueError(f"{who}: {label}'s model param is {ml.dtype} {tuple(ml.shape)} on {ml.device}"
                         f"{'' if ml.is_contiguous() else ' (not contiguous)'}; the step writes it as bf16/f16 "
                         f"{tuple(pl.shape)}, contiguous, on {pl.device} (was the model param replaced after "
                         "wrapping?)")
    return ml.data_ptr(), str(model.dtype).removeprefix("torch.")


class _Leaf(torch.optim.Optimizer):
    """What AdamW and Muon share beyond torch.optim.Optimizer: pickling and deepcopy keep the attributes
    step() reads (torch's __getstate__ keeps defaults, state and param_groups only), the params' names by
    their place (errors name them; the params are new objects in a copy), and a group added later is checked
    as the constructor checks its params."""

    _KEPT = ()

    def __getstate__(self):
        state = super().__getstate__()
        for key in self._KEPT:
            if key in self.__dict__:
                state[key] = self.__dict__[key]
        names = self.__dict__.get("_param_names")
        if names is not None:
            state["_param_names_by_place"] = [names.get(id(p)) for g in self.param_groups for p in g["params"]]
        return state

    def __setstate__(self, state):
        state = dict(state)
        by_place = state.pop("_param_names_by_place", None)
        super().__setstate__(state)
        if by_place is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._param_names = {id(p): n for p, n in zip(params, by_place) if n is not None}

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    def _first_index(self):
        """The index of the last group's first param over the groups (errors' param numbers)."""
        return sum(len(g["params"]) for g in self.param_groups[:-1])

    def _check_group(self, group):
        _check_params(f"hypertrain.optim.{type(self).__name__}", [group], self._first_index())


class AdamW(_Leaf):
    """torch.optim.AdamW's arguments, with torch's meaning; MindFormers' names too
    (learning_rate, beta1, beta2). One fused pass a param: decoupled weight decay,
    the moments, the bias-corrected step, rounded as torch's fused=True kernel;
    the param groups say fused=True, so a state dict loaded into
    torch.optim.AdamW goes on with that kernel. foreach=True, fused=False,
    amsgrad, maximize, capturable and differentiable are not supported."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None, **aliases):
        lr = aliases.pop("learning_rate", lr)
        b1, b2 = betas
        b1, b2 = aliases.pop("beta1", b1), aliases.pop("beta2", b2)
        if aliases:
            raise TypeError(f"hypertrain.optim.AdamW: unexpected keyword argument(s) {sorted(aliases)}")
        for flag, name in ((amsgrad, "amsgrad=True"), (maximize, "maximize=True"), (capturable, "capturable=True"),
                           (differentiable, "differentiable=True"), (foreach, "foreach=True (torch's rounding "
                                                                              "of the foreach path)"),
                           (fused is False, "fused=False (the pass is the fused kernel's)")):
            if flag:
                raise ValueError(f"hypertrain.optim.AdamW: {name} is not supported")
        if not _float(lr) >= 0.0:
            raise ValueError(f"hypertrain.optim.AdamW: invalid learning rate {lr}")
        if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
            raise ValueError(f"hypertrain.optim.AdamW: invalid betas {(b1, b2)}; each in [0, 1)")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"hypertrain.optim.AdamW: invalid eps {eps} or weight_decay {weight_decay}")
        defaults = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=True)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        self._run(self._plan())
        return loss

    @torch.no_grad()
    def _plan(self):
        """The step's work, every tensor a kernel takes checked (the state created where there is none), before
        any is written."""
        who, work, index = "hypertrain.optim.AdamW", [], -1
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                index += 1
                label = _label(index, _param_name(self, group, i, p))
                if p.dtype in _LOW:  # built over a bf16/f16 model's params, and no FP32 wrapper swapped them
                    raise _low_precision_error(who, label, p.dtype)
                if p.grad is None:
                    continue
                pl, gl = _local(p), _local(p.grad)  # FSDP2: this rank's rows, stepped where they are
                _require_fp32(who, label, pl, gl)
                state = self._state_of(p)
                _require_step(who, label, state["step"])
                m = _require_state(who, label, "exp_avg", state["exp_avg"], pl)
                v = _require_state(who, label, "exp_avg_sq", state["exp_avg_sq"], pl)
                work.append((group, state, pl, gl, m, v, _model_copy(who, label, p, pl)))
        return work

    def _state_of(self, p):
        """p's state, created where it has none as torch.optim.AdamW creates it at p's first step: a float32
        step tensor 0 and the two moments zero (the same updates as no state)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def _run(self, work):
        for group, state, pl, gl, m, v, model in work:
            b1, b2 = group["betas"]
            state["step"] += 1
            if pl.numel():
                _C.adamw(pl.data_ptr(), gl.data_ptr(), m.data_ptr(), v.data_ptr(), pl.numel(),
                         int(state["step"].item()), _float(group["lr"]), b1, b2, group["eps"],
                         group["weight_decay"], *model, stream=_stream(pl))

    def load_state_dict(self, state_dict):
        _check_loaded_state("hypertrain.optim.AdamW", self, state_dict, ("exp_avg", "exp_avg_sq"))
        super().load_state_dict(state_dict)


def _ns_steps(ns_steps):
    """ns_steps as an int, bounded before anything is sized by it."""
    try:
        n = None if isinstance(ns_steps, bool) else operator.index(ns_steps)
    except TypeError:
        n = None
    if n is None or not 1 <= n <= NS_MAX_STEPS:
        raise ValueError(f"hypertrain.optim.Muon: ns_steps {ns_steps!r}; expected an integer from 1 to "
                         f"{NS_MAX_STEPS} (the longest Newton-Schulz schedule the kernels take; torch's default "
                         "is 5)")
    return n


def _schedule(ns_coefficients, ns_steps, ns_variant):
    """The Newton-Schulz triples, one per iteration: a named variant's, a triple
    repeated ns_steps times (torch's), or a list of triples as given (at most
    NS_MAX_STEPS of them, each three finite numbers)."""
    ns_steps = _ns_steps(ns_steps)
    if ns_variant is not None:
        return _C.ns_schedule(str(ns_variant), ns_steps)
    c = list(ns_coefficients)
    if len(c) == 3 and all(isinstance(x, (int, float)) for x in c):
        c = [c] * ns_steps
    if len(c) > NS_MAX_STEPS:
        raise ValueError(f"hypertrain.optim.Muon: {len(c)} coefficient triples; at most {NS_MAX_STEPS} (the longest "
                         "Newton-Schulz schedule the kernels take)")
    triples = []
    for i, t in enumerate(c):
        try:
            triple = tuple(float(x) for x in t)
        except (TypeError, ValueError):
            triple = ()
        if len(triple) != 3 or not all(math.isfinite(x) for x in triple):
            raise ValueError(f"hypertrain.optim.Muon: ns_coefficients[{i}] is {t!r}; expected (a, b, c), three "
                             "finite numbers")
        triples.append(triple)
    if len(triples) < ns_steps:
        raise ValueError(f"hypertrain.optim.Muon: {len(triples)} coefficient triples for ns_steps {ns_steps}")
    return triples


_ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")  # torch.optim.Muon's


def _muon_derived(prefix, g, saved=False):
    """A Muon group's keys the step reads that its arguments imply, the arguments checked: momentum_style,
    ns_variant, ns_dtype and matched_adamw_rms (torch's meaning where absent, as in torch.optim.Muon's state
    dicts: 'ema', None, 'float32', adjust_lr_fn's scale) and the Newton-Schulz schedule. prefix names the group
    in errors; saved: g is a state dict's group (a key is named as the group's, not as an argument)."""
    def name(key, value):
        return f"{prefix}{key!r} is {value!r}" if saved else f"{prefix}{key} {value!r}"

    style = g.get("momentum_style", "ema")
    if style not in ("ema", "sum"):
        raise ValueError(f"{name('momentum_style', style)}; expected 'ema' (torch's) or 'sum' (HyperParallel's)")
    ns_dtype = g.get("ns_dtype", "float32")
    if ns_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{name('ns_dtype', ns_dtype)}; expected 'float32' or 'bfloat16'")
    ns_form = g.get("ns_form", "standard")
    if (ns_form, ns_dtype) not in (("standard", "float32"), ("standard", "bfloat16"), ("gram", "float32"),
                                   ("torch", "bfloat16")):
        raise ValueError(f"{name('ns_form', ns_form)} with ns_dtype {ns_dtype!r}; expected 'standard', 'gram' "
                         "(with float32: the Gram form) or 'torch' (with bfloat16: torch.optim.Muon's roundings)")
    adjust = g.get("adjust_lr_fn")
    if adjust not in _ADJUST_LR_FNS:
        raise ValueError(f"{name('adjust_lr_fn', adjust)}; expected None, 'original', 'match_rms_adamw' or "
                         "'spectral_unclamped' (torch.optim.Muon's)")
    rms = {None: 0.0, "original": 0.0, "match_rms_adamw": 0.2, "spectral_unclamped": 0.0}[adjust]
    given = g.get("matched_adamw_rms")
    if given is not None:
        if not float(given) >= 0.0:
            raise ValueError(f"{name('matched_adamw_rms', given)}; expected >= 0")
        if adjust is not None and float(given) != rms and not saved:
            raise ValueError(f"{prefix}adjust_lr_fn {adjust!r} and matched_adamw_rms {given} disagree")
        rms = float(given)
    if adjust == "spectral_unclamped" and rms != 0.0:
        raise ValueError(f"{prefix}adjust_lr_fn 'spectral_unclamped' and matched_adamw_rms {rms} disagree")
    schedule = _schedule(g.get("ns_coefficients", _TORCH_NS_COEFFICIENTS), g.get("ns_steps", 5),
                         g.get("ns_variant"))
    return dict(momentum_style=style, ns_variant=g.get("ns_variant"), ns_dtype=ns_dtype, ns_form=ns_form,
                matched_adamw_rms=rms, schedule=schedule)


def _update_scale(group, A, B):
    """The update's scale for an (A, B) matrix (docs/NUMERICS.md, Muon; torch.optim.Muon's _adjust_lr)."""
    if group.get("adjust_lr_fn") == "spectral_unclamped":
        return math.sqrt(A / B)
    rms = group["matched_adamw_rms"]
    return rms * math.sqrt(max(A, B)) if rms > 0 else math.sqrt(max(1.0, A / B))


class _MuonGroup(dict):
    """A Muon param group. Its "betas" is (momentum, 0.0): torch's OneCycleLR and CyclicLR write "betas" on every
    group of an optimizer whose defaults hold betas (a chain of Muon and AdamW does), and here that writing is
    momentum's, as they cycle torch.optim.Muon's momentum on Muon alone. Not a key of its own: the state
    dict holds momentum."""

    def __getitem__(self, key):
        if key == "betas" and not dict.__contains__(self, "betas"):
            return (dict.__getitem__(self, "momentum"), 0.0)
        return dict.__getitem__(self, key)

    def __setitem__(self, key, value):
        if key == "betas":
            key, value = "momentum", value[0]
        dict.__setitem__(self, key, value)


class Muon(_Leaf):
    """torch.optim.Muon's arguments, with torch's meaning and rounding (momentum as torch's lerps, the decay and
    update as its mul_ and add_, bit for bit as docs/NUMERICS.md's Muon says, ns_coefficients applied ns_steps times, adjust_lr_fn None/"original",
    "match_rms_adamw" or "spectral_unclamped"), and HyperParallel's and MindFormers' names:
    momentum_style ("ema", torch's, or "sum": B <- mu B + g), ns_variant
    ("legacy", "asym5", "polar_express", "deepseek_v4"), matched_adamw_rms (the
    update scale rms * sqrt(max(A, B)); 0: sqrt(max(1, A / B))), ns_eps,
    learning_rate, ns_dtype ("float32" or "bfloat16"), ns_form ("standard"; "gram" with float32, the
    Gram form; "torch" with bfloat16, torch.optim.Muon's own bf16 roundings: docs/NUMERICS.md). A param (A, B) is one
    matrix; (E, A, B) is E matrices, each orthogonalized on its own with the
    scale of an (A, B) one. A torch.optim.Muon state dict loads (its groups
    take torch's meaning) and this one's loads into torch.optim.Muon, which
    goes on as this one does where the groups have torch's meaning
    (momentum_style "ema", no ns_variant, matched_adamw_rms as adjust_lr_fn's)."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=_TORCH_NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 momentum_style="ema", ns_variant=None, matched_adamw_rms=None, ns_dtype="float32",
                 ns_form="standard", comm_strategy="allgather", **aliases):
        lr = aliases.pop("learning_rate", lr)
        eps = aliases.pop("ns_eps", eps)
        if aliases:
            raise TypeError(f"hypertrain.optim.Muon: unexpected keyword argument(s) {sorted(aliases)}")
        if not _float(lr) >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"hypertrain.optim.Muon: invalid learning rate {lr} or weight_decay {weight_decay}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"hypertrain.optim.Muon: momentum {momentum}; expected [0, 1)")
        if not eps > 0.0:
            raise ValueError(f"hypertrain.optim.Muon: eps {eps}; expected > 0 (a zero matrix would divide by zero)")
        if comm_strategy not in ("allgather", "deredundancy"):
            raise ValueError(f"hypertrain.optim.Muon: comm_strategy {comm_strategy!r}; expected 'allgather' or "
                             "'deredundancy'")
        self.comm_strategy = comm_strategy
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        momentum_style=momentum_style, ns_variant=ns_variant, matched_adamw_rms=matched_adamw_rms,
                        ns_dtype=ns_dtype, ns_form=ns_form)
        defaults.update(_muon_derived("hypertrain.optim.Muon: ", defaults))
        super().__init__(params, defaults)

    _KEPT = ("comm_strategy",)

    def add_param_group(self, param_group):
        if isinstance(param_group, dict) and not isinstance(param_group, _MuonGroup):
            param_group = _MuonGroup(param_group)
        super().add_param_group(param_group)

    def _check_group(self, group):
        first = self._first_index()
        _check_params("hypertrain.optim.Muon", [group], first)
        for i, p in enumerate(group["params"]):
            if p.ndim not in (2, 3):
                raise ValueError(f"hypertrain.optim.Muon: param {first + i} has shape {tuple(p.shape)}; Muon takes "
                                 "matrices (A, B) and stacks of them (E, A, B): give it to AdamW")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        self._run(self._plan())
        return loss

    @torch.no_grad()
    def _plan(self):
        """The step's work, every tensor a kernel takes checked (the state created where there is none), before
        any is written or any collective starts."""
        who, work, index = "hypertrain.optim.Muon", [], -1
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                index += 1
                label = _label(index, _param_name(self, group, i, p))
                if p.dtype in _LOW:  # built over a bf16/f16 model's params, and no FP32 wrapper swapped them
                    raise _low_precision_error(who, label, p.dtype)
                if p.grad is None:
                    continue
                pl, gl = _local(p), _local(p.grad)
                _require_fp32(who, label, pl, gl)
                state = self._state_of(p)
                buf = _require_state(who, label, "momentum_buffer", state["momentum_buffer"], pl)
                model = _model_copy(who, label, p, pl)
                if p.numel():  # a matrix with no elements has no update (torch's is empty too)
                    work.append((group, p, pl, gl, buf, model))
        return work

    def _state_of(self, p):
        """p's state, created where it has none as torch.optim.Muon creates it at p's first step: the momentum
        buffer zero."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def _run(self, work):
        owners = _owners([p for _, p, *_ in work if hasattr(p, "to_local")]) \
            if self.comm_strategy == "deredundancy" else {}
        for group, p, pl, gl, buf, model in work:
            lr, mu = _float(group["lr"]), float(group["momentum"])
            ema = group["momentum_style"] == "ema"
            gw = 1.0 - mu if ema else 1.0
            arith = "torch" if ema else "plain"  # ema: torch.optim.Muon's lerps and add_ (docs/NUMERICS.md, Muon)
            nesterov = bool(group["nesterov"])
            n = pl.numel()
            A, B = p.shape[-2], p.shape[-1]  # the whole matrix's (a DTensor's global shape)
            update, stream = torch.empty_like(pl), _stream(pl)
            if n:
                _C.muon_momentum(buf.data_ptr(), gl.data_ptr(), update.data_ptr(), n, mu, gw, nesterov, arith, stream)
            source = update if nesterov else buf
            if pl is not p and self.comm_strategy == "deredundancy":
                update = _owner_newton_schulz(p, source, owners[id(p)], group)
            elif pl is not p:  # FSDP2: Newton-Schulz needs the whole matrix (the seed's allgather strategy)
                whole = _gather(p, source)
                _C.newton_schulz(whole.data_ptr(), whole.data_ptr(), whole.numel() // (A * B), A, B,
                                 group["schedule"], group["eps"], group["ns_dtype"], group["ns_form"], stream)
                update = _keep_local(p, whole)
            else:
                _C.newton_schulz(source.data_ptr(), update.data_ptr(), n // (A * B), A, B, group["schedule"],
                                 group["eps"], group["ns_dtype"], group["ns_form"], stream)
            scale = _update_scale(group, A, B)
            if n:
                _C.muon_apply(pl.data_ptr(), update.data_ptr(), n, 1.0 - lr * group["weight_decay"], lr * scale,
                              *model, arith, stream=stream)

    def load_state_dict(self, state_dict):
        """torch.optim.Muon's state dicts too: their groups lack hypertrain's keys, which take torch's meaning
        (momentum_style 'ema', the ns_coefficients triple ns_steps times, the update scale of adjust_lr_fn)."""
        _check_loaded_state("hypertrain.optim.Muon", self, state_dict, ("momentum_buffer",))
        derived = []
        if isinstance(state_dict, dict) and isinstance(state_dict.get("param_groups"), list):
            for i, g in enumerate(state_dict["param_groups"]):  # checked before anything is replaced
                derived.append(_muon_derived(f"hypertrain.optim.Muon.load_state_dict: group {i}'s ", g, saved=True))
        super().load_state_dict(state_dict)
        self.param_groups[:] = [_MuonGroup(g) for g in self.param_groups]
        for group, d in zip(self.param_groups, derived):
            group.update(d)


def _gather(p, local):
    """The whole matrix of DTensor param p's placements from this rank's `local` shard of it (an
    all-gather over p's mesh through torch.distributed; uneven shards included), contiguous float32."""
    from torch.distributed.tensor import DTensor
    whole = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return whole.full_tensor().contiguous()


def _keep_local(p, whole):
    """This rank's shard of `whole` in DTensor param p's layout (a slice: no communication)."""
    from torch.distributed.tensor import DTensor, Replicate
    rep = DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return rep.redistribute(p.device_mesh, p.placements).to_local().contiguous()


def _shard_dim(p):
    """The one mesh dim that shards DTensor p by rows (FSDP2's Shard(0); HSDP's other dims replicate)."""
    dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if len(dims) != 1 or not p.placements[dims[0]].is_shard(0):
        raise NotImplementedError(f"hypertrain.optim.Muon: comm_strategy 'deredundancy' on placements "
                                  f"{p.placements}; it takes one Shard(0) dim, any others Replicate (FSDP2, "
                                  "HSDP): use 'allgather'")
    return dims[0]


def _owners(params):
    """deredundancy's owners (docs/NUMERICS.md, Distributed Muon): each sharded matrix, largest Newton-Schulz
    cost first (ties by order), to the least-loaded rank of its shard group (ties: the lower rank), as an
    index in that group: under HSDP each replica's rank of that index owns it for its replica."""
    flops = []
    for i, p in enumerate(params):
        A, B = p.shape[-2], p.shape[-1]
        r, c = min(A, B), max(A, B)
        flops.append((-(p.numel() // (A * B)) * (4 * r * r * c + 2 * r ** 3), i))
    load, owners = {}, {}
    for _, i in sorted(flops):
        p = params[i]
        d = _shard_dim(p)
        size = p.device_mesh.size(d)
        loads = load.setdefault((tuple(p.device_mesh.mesh.flatten().tolist()), d), [0] * size)  # by ranks:
        # each fully_shard call may hold its own mesh object of the same ranks
        owner = min(range(size), key=lambda r: (loads[r], r))
        loads[owner] -= flops[i][0]
        owners[id(p)] = owner
    return owners


def _owner_newton_schulz(p, local, owner, group):
    """deredundancy: the owner gathers the whole matrix over its shard group, orthogonalizes it and scatters
    each rank its rows; the same bits as every rank doing it (allgather)."""
    import torch.distributed as dist
    mesh, d = p.device_mesh, _shard_dim(p)
    pg, me, size = mesh.get_group(d), mesh.get_local_rank(d), mesh.size(d)
    rows = [len(c) for c in torch.arange(p.shape[0]).chunk(size)] + [0] * size  # torch.chunk's split, as FSDP2
    rows = rows[:size]
    pad = max(rows)
    tail = tuple(p.shape[1:])
    if rows[me] != local.shape[0]:
        raise RuntimeError(f"hypertrain.optim.Muon: rank {me} holds {local.shape[0]} of {p.shape[0]} rows; "
                           f"deredundancy expects torch.chunk's {rows[me]}")
    send = torch.zeros((pad,) + tail, dtype=torch.float32, device=local.device)
    send[:local.shape[0]] = local
    dst = dist.get_global_rank(pg, owner)
    parts = [torch.empty_like(send) for _ in range(size)] if me == owner else None
    dist.gather(send, parts, dst=dst, group=pg)
    out = torch.empty_like(send)
    if me == owner:
        whole = torch.cat([part[:n] for part, n in zip(parts, rows)]).contiguous()
        A, B = p.shape[-2], p.shape[-1]
        _C.newton_schulz(whole.data_ptr(), whole.data_ptr(), whole.numel() // (A * B), A, B, group["schedule"],
                         group["eps"], group["ns_dtype"], group["ns_form"], _stream(whole))
        at, pieces = 0, []
        for n in rows:
            piece = torch.zeros_like(send)
            piece[:n] = whole[at:at + n]
            pieces.append(piece)
            at += n
        dist.scatter(out, pieces, src=dst, group=pg)
    else:
        dist.scatter(out, None, src=dst, group=pg)
    return out[:local.shape[0]].contiguous()


class _MergedState(dict):
    """Several optimizers' states as one mapping (their params are disjoint)."""


# torch.optim.Optimizer's hooks; like torch's own optimizers, a pickled or copied one has none.
_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
               "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
               "_optimizer_load_state_dict_post_hooks")


class _Delegating(torch.optim.Optimizer):
    """An optimizer whose param groups and state are other optimizers' (the
    same dicts, so a scheduler or a state dict reaches them all): the base of
    ChainedOptimizer and of the FP32 main-param wrapper. param_groups, state and
    defaults are views, read from the optimizers at each use: a group a
    sub-optimizer gains or replaces (its add_param_group, its load_state_dict)
    is the chain's at once. defaults are the sub-optimizers' together (the first
    optimizer's value where two hold a key): "momentum" with a Muon, "betas"
    with an AdamW, as torch's schedulers look for them."""

    _UNPICKLED = ()  # attributes a pickled copy rebuilds itself (__setstate__)

    def _adopt(self, optimizers):
        self.optimizers = list(optimizers)
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        self._building = True
        super().__init__(params, {})
        self._building = False

    @property
    def param_groups(self):
        return [g for o in self.__dict__.get("optimizers", []) for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value):  # torch.optim.Optimizer.__init__ assigns one; the sub-optimizers hold them
        pass

    @property
    def defaults(self):
        merged = {}
        for o in reversed(self.__dict__.get("optimizers", [])):
            merged.update(o.defaults)
        return merged

    @defaults.setter
    def defaults(self, value):
        pass

    @property
    def state(self):
        merged = _MergedState()
        for o in self.__dict__.get("optimizers", []):
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ assigns one; the sub-optimizers hold the state
        pass

    def add_param_group(self, param_group):
        if getattr(self, "_building", False):  # torch.optim.Optimizer.__init__'s own calls: the groups are there
            return None
        raise NotImplementedError(f"hypertrain.optim.{type(self).__name__}.add_param_group")

    def __getstate__(self):
        """Everything but the hooks and what a scheduler patched in (torch's optimizers pickle without them)."""
        return {k: v for k, v in self.__dict__.items()
                if k not in _HOOK_DICTS and k not in ("step", "_opt_called") and k not in self._UNPICKLED}

    def __setstate__(self, state):
        torch.optim.Optimizer.__setstate__(self, state)

    def _state_dict_hooks(self, state_dict=None):
        """torch.optim.Optimizer.state_dict's hooks around an overriding state_dict: the pre hooks (state_dict
        None), else the post hooks, any returning a replacement."""
        if state_dict is None:
            for hook in self._optimizer_state_dict_pre_hooks.values():
                hook(self)
            return None
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, state_dict)
            state_dict = state_dict if out is None else out
        return state_dict

    def _load_state_dict_hooks(self, state_dict=None, post=False):
        """torch.optim.Optimizer.load_state_dict's hooks around an overriding load_state_dict."""
        if post:
            for hook in self._optimizer_load_state_dict_post_hooks.values():
                hook(self)
            return None
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            state_dict = state_dict if out is None else out
        return state_dict


def _kind(o):
    return type(o).__name__


class ChainedOptimizer(_Delegating):
    """Several optimizers stepped as one (HyperParallel's Muon + AdamW), with
    torch.optim.Optimizer's contract: step() (its hooks too), zero_grad(),
    param_groups (every sub-optimizer's groups, the same dicts, so torch's
    schedulers, OneCycleLR and ReduceLROnPlateau included, reach them all),
    defaults, add_param_group (to the optimizer named, else by the params'
    shapes), state_dict() in torch's layout over all the groups in order and
    load_state_dict() handing each optimizer its groups (both with their hooks),
    and pickling and deepcopy (a copy steps as the original)."""

    def __init__(self, optimizers):
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError("hypertrain.optim.ChainedOptimizer: no optimizers")
        seen = set()
        for o in optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) in seen:
                        raise ValueError("hypertrain.optim.ChainedOptimizer: a param is in two of the optimizers")
                    seen.add(id(p))
        self._adopt(optimizers)

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for o in self.optimizers:  # every optimizer's tensors checked before the first one writes
            if isinstance(o, (AdamW, Muon)):
                o._plan()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def _route(self, param_group, optimizer):
        """The sub-optimizer a new group goes to: `optimizer` (one of them, its index, or its class name), else by
        the params' shapes: matrices and stacks of them (2-D, 3-D) to the chain's Muon, the others to its AdamW."""
        who = "hypertrain.optim.ChainedOptimizer.add_param_group"
        kinds = ", ".join(f"{i}: {_kind(o)}" for i, o in enumerate(self.optimizers))
        if optimizer is not None:
            if isinstance(optimizer, torch.optim.Optimizer):
                if not any(optimizer is o for o in self.optimizers):
                    raise ValueError(f"{who}: optimizer= is not one of the chain's ({kinds})")
                return optimizer
            if isinstance(optimizer, int) and not isinstance(optimizer, bool):
                if not 0 <= optimizer < len(self.optimizers):
                    raise ValueError(f"{who}: optimizer={optimizer}; the chain has {kinds}")
                return self.optimizers[optimizer]
            named = [o for o in self.optimizers if _kind(o).lower() == str(optimizer).lower()]
            if len(named) != 1:
                raise ValueError(f"{who}: optimizer={optimizer!r} names {len(named)} of the chain's optimizers "
                                 f"({kinds}); give one of them, or its index")
            return named[0]
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        if not params:
            raise ValueError(f"{who}: the group has no params")
        tensors = [q[1] if isinstance(q, tuple) else q for q in params]
        names = [q[0] if isinstance(q, tuple) else None for q in params]
        matrix = [isinstance(t, torch.Tensor) and t.ndim in (2, 3) for t in tensors]
        if any(matrix) and not all(matrix):
            i = matrix.index(not matrix[0])
            raise ValueError(f"{who}: the group mixes matrices and other shapes (param {i}"
                             f"{' (' + names[i] + ')' if names[i] else ''} has shape {tuple(tensors[i].shape)}, "
                             f"param 0 {tuple(tensors[0].shape)}): give each kind its own group, or name the "
                             "optimizer (optimizer=)")
        want = Muon if matrix[0] else AdamW
        fits = [o for o in self.optimizers if isinstance(o, want)]
        if len(fits) != 1:
            raise ValueError(f"{who}: params of shape {tuple(tensors[0].shape)} go to a {want.__name__} by their "
                             f"shape, and the chain has {len(fits)} ({kinds}): name the optimizer (optimizer=)")
        return fits[0]

    def add_param_group(self, param_group, optimizer=None):
        """torch's add_param_group, to `optimizer` (a sub-optimizer, its index or its class name) or by shape
        (2-D and 3-D params to Muon, the others to AdamW); the group takes that optimizer's defaults and is the
        chain's next group from then on. Returns the optimizer that took it."""
        if getattr(self, "_building", False):
            return None
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        target = self._route(param_group, optimizer)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for i, q in enumerate(params):
            t = q[1] if isinstance(q, tuple) else q
            if id(t) in known:
                raise ValueError(f"hypertrain.optim.ChainedOptimizer.add_param_group: param {i} of the group is "
                                 "already one of the chain's")
        target.add_param_group(param_group)
        return target

    def load_state_dict(self, state_dict):
        state_dict = self._load_state_dict_hooks(state_dict)
        groups, state, at = state_dict["param_groups"], state_dict["state"], 0
        if len(groups) != len(self.param_groups):
            raise ValueError(f"hypertrain.optim.ChainedOptimizer: the state dict has {len(groups)} param groups; "
                             f"this optimizer has {len(self.param_groups)}")
        for o in self.optimizers:
            mine = groups[at:at + len(o.param_groups)]
            ids = [i for g in mine for i in g["params"]]
            o.load_state_dict({"state": {i: state[i] for i in ids if i in state}, "param_groups": mine})
            at += len(o.param_groups)
        self._load_state_dict_hooks(post=True)


def _named(model):
    return {id(p): name for name, p in model.named_parameters()} if model is not None else {}


def _flatten(params):
    out = []
    for x in params or []:
        out.extend(x["params"] if isinstance(x, dict) else [x])
    return out


# What Muon's keyword arguments mean under each semantics: the values a key not given takes.
# HyperParallel's (docs/NUMERICS.md's defaults): sum momentum, Nesterov, asym5, matched AdamW RMS 0.2.
# torch's: torch.optim.Muon's (hypertrain.optim.Muon's own defaults).
MUON_SEMANTICS = {
    "hyperparallel": dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, momentum_style="sum",
                          ns_variant="asym5", ns_steps=5, eps=1e-7, matched_adamw_rms=0.2),
    "torch": dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, momentum_style="ema",
                  ns_coefficients=_TORCH_NS_COEFFICIENTS, ns_steps=5, eps=1e-7, adjust_lr_fn=None),
}
_SEMANTICS_NAMES = {"hyperparallel": "HyperParallel's", "torch": "torch.optim.Muon's"}
_SAID = set()  # the semantics lines get_hyper_optimizer has logged (each once a process)
_log = logging.getLogger("hypertrain")


def muon_kwargs(semantics, **given):
    """Muon's keyword arguments under `semantics` ("hyperparallel" or "torch", MUON_SEMANTICS): its values,
    then the ones given (ns_coefficients given drops the semantics' ns_variant, adjust_lr_fn its
    matched_adamw_rms, and the reverse). hypertrain.optim.Muon(params, **muon_kwargs("hyperparallel", lr=0.02))
    is get_hyper_optimizer's Muon."""
    if semantics not in MUON_SEMANTICS:
        raise ValueError(f"muon_semantics {semantics!r}; expected 'hyperparallel' or 'torch'")
    kw = dict(MUON_SEMANTICS[semantics])
    for mine, theirs in (("ns_coefficients", "ns_variant"), ("ns_variant", "ns_coefficients"),
                         ("adjust_lr_fn", "matched_adamw_rms"), ("matched_adamw_rms", "adjust_lr_fn")):
        if mine in given:
            kw.pop(theirs, None)
    kw.update(given)
    return kw


_muon_kwargs = muon_kwargs  # get_hyper_optimizer's argument of that name hides it there


def _say_semantics(semantics, chosen, kw):
    """Once a process for each distinct line: which Muon semantics get_hyper_optimizer used, with the values."""
    values = ", ".join(f"{k}={v!r}" for k, v in kw.items() if k != "comm_strategy")
    line = f"get_hyper_optimizer: Muon with {_SEMANTICS_NAMES[semantics]} semantics ({values})"
    if not chosen:
        other = "torch" if semantics == "hyperparallel" else "hyperparallel"
        line += (f"; muon_semantics='{semantics}' is the default: the same muon_kwargs under "
                 f"muon_semantics='{other}' ({_SEMANTICS_NAMES[other]}, as hypertrain.optim.Muon) mean another "
                 "update; pass muon_semantics= to choose")
    if line in _SAID:
        return
    _SAID.add(line)
    _log.log(logging.INFO if chosen else logging.WARNING, line)


def get_hyper_optimizer(model=None, muon_params=None, adamw_params=None, muon_kwargs=None, adamw_kwargs=None,
                        fp32_main_params=False, muon_semantics=None):
    """HyperParallel's factory: Muon on muon_params, AdamW on adamw_params (each a
    list of tensors or of param-group dicts), chained. An empty group creates no
    optimizer. muon_kwargs and adamw_kwargs pass to Muon and AdamW: over the Muon
    defaults of muon_semantics (MUON_SEMANTICS; None: "hyperparallel",
    HyperParallel's: lr 0.02, momentum 0.95 summed, Nesterov, asym5,
    matched_adamw_rms 0.2, weight decay 0.1; "torch": torch.optim.Muon's, as
    hypertrain.optim.Muon), torch's AdamW's. The semantics and the values used are
    logged once (logger "hypertrain": a warning where muon_semantics was not
    given). With model=, a param listed as it was before hypertrain.fully_shard
    replaced it (the seed groups, then shards) is the sharded param of its name.
    fp32_main_params:
    the AutoModels Trainer's FP32 main-param wrapper around the chain
    (hypertrain.mixed_precision; needs model=, whose names key the main params)."""
    from .fsdp import sharded_params  # params listed before hypertrain.fully_shard: the sharded ones of their names
    muon_params = sharded_params(model, list(muon_params or []))
    adamw_params = sharded_params(model, list(adamw_params or []))
    if fp32_main_params and model is None:
        raise ValueError("get_hyper_optimizer: fp32_main_params=True needs model= (the state dict keys the FP32 "
                         "main params by parameter name)")
    names = _named(model)
    if not fp32_main_params:  # the one place that knows no FP32 wrapper will swap the params
        for p in _flatten(muon_params) + _flatten(adamw_params):
            if isinstance(p, torch.Tensor) and p.dtype in _LOW:
                raise TypeError(f"get_hyper_optimizer: param {names.get(id(p), '(unnamed)')} is {p.dtype}; Muon "
                                "and AdamW update float32 params: pass fp32_main_params=True (and model=) for FP32 "
                                "main params, or wrap the optimizer in "
                                "hypertrain.Float16OptimizerWithFloat16Params(optimizer, model)")
    muon_ids = {id(p) for p in _flatten(muon_params)}
    for p in _flatten(adamw_params):
        if id(p) in muon_ids:
            raise ValueError(f"get_hyper_optimizer: param {names.get(id(p), '(unnamed)')} is in both muon_params "
                             "and adamw_params")
    semantics = "hyperparallel" if muon_semantics is None else muon_semantics
    if semantics not in MUON_SEMANTICS:
        raise ValueError(f"get_hyper_optimizer: muon_semantics {muon_semantics!r}; expected 'hyperparallel' or "
                         "'torch'")
    optimizers = []
    if muon_params:
        kw = _muon_kwargs(semantics, **dict(muon_kwargs or {}))
        optimizers.append(Muon(muon_params, **kw))
        _say_semantics(semantics, muon_semantics is not None, kw)
    if adamw_params:
        optimizers.append(AdamW(adamw_params, **dict(adamw_kwargs or {})))
    if not optimizers:
        raise ValueError("get_hyper_optimizer: muon_params and adamw_params are both empty")
    for o in optimizers:  # errors name the params by the model's names
        o._param_names = names
    chained = ChainedOptimizer(optimizers)
    if not fp32_main_params:
        return chained
    from .mixed_precision import Float16OptimizerWithFloat16Params
    return Float16OptimizerWithFloat16Params(chained, model)


def _shard_groups(g):
    """The process groups a DTensor's local sum of squares is summed over: its mesh's dims that shard it
    (a Replicate dim holds the same values on each of its ranks)."""
    mesh = g.device_mesh
    return [mesh.get_group(d) for d, pl in enumerate(g.placements) if pl.is_shard()]


def _grad_of(p):
    """The gradient clip_grad_norm_ reads: a low-precision param's under the FP32 main-param wrapper is its
    live .grad (FP32; its main_grad the same tensor, or an old one after a model.zero_grad()); any other
    param's is its main_grad where it has one (Megatron's convention), else its grad."""
    main = getattr(p, "main_param", None)
    if main is not None and main is not p:
        return p.grad
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """torch.nn.utils.clip_grad_norm_ (the 2-norm) over each param's gradient: its main_grad where it has one,
    else its grad (under the FP32 main-param wrapper, a bf16/f16 param's FP32 grad: _grad_of). A DTensor
    gradient (FSDP2's shards) counts its local shard, the sums of squares reduced over the mesh dims that shard
    it, as the seed's clip_grad does, so every rank gets the whole model's norm. The sums of squares are double
    (hypertrain's kernel on float32 gradients), the norm their root rounded to float32; the scale is torch's:
    grads times the float32 max_norm / (norm + 1e-6) where that is < 1.
    Returns the total norm, a float32 tensor."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if float(norm_type) != 2.0:
        raise ValueError(f"hypertrain.optim.clip_grad_norm_: norm_type {norm_type}; only the 2-norm is supported")
    grads = []
    for p in parameters:
        g = _grad_of(p)
        if g is not None:
            grads.append(g)
    local, by_groups = 0.0, {}
    for g in grads:
        t = g.to_local() if hasattr(g, "to_local") else g
        if t.dtype == torch.float32 and t.device.type in ("cpu", "cuda") and t.is_contiguous():
            _require_device("hypertrain.optim.clip_grad_norm_", "a gradient", t)
            s = _C.sum_squares(t.data_ptr(), t.numel(), _stream(t))
        else:
            s = float(t.double().square().sum())
        if hasattr(g, "to_local"):
            key = tuple(_shard_groups(g))
            by_groups[key] = by_groups.get(key, 0.0) + s
        else:
            local += s
    total = local
    if by_groups:
        import torch.distributed as dist
        for key, s in by_groups.items():
            t = torch.tensor([s], dtype=torch.float64)
            for pg in key:
                dist.all_reduce(t, group=pg)
            total += float(t)
    norm = torch.tensor(math.sqrt(total), dtype=torch.float32)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"hypertrain.optim.clip_grad_norm_: the total norm is {norm.item()}")
    coef = max_norm / (norm + 1e-6)  # float32, as torch's
    if coef.item() < 1.0:
        for g in grads:
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
    return norm
