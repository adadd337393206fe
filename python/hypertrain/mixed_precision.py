"""The FP32 main-param wrapper of the AutoModels Trainer (seed 000,
fp32_main_params): a bf16/f16 model keeps an FP32 main param per low-precision
param, gradients accumulate in FP32, the optimizers update the main params,
and the step writes them back to the model's dtype.

    optimizer = get_hyper_optimizer(model=model, muon_params=..., adamw_params=..., fp32_main_params=True)
    # or: Float16OptimizerWithFloat16Params(any_optimizer_over_model_params, model)

- A bf16/f16 param p gets p.main_param, an FP32 Parameter with p's values; it
  replaces p in the optimizer's groups (and takes over any state p had). A
  float32 param is its own main param (p.main_param is p): no copy.
- The wrapper sets each low-precision param's grad_dtype to float32, so
  autograd (and FSDP2's reduction) delivers and accumulates p.grad in FP32
  over micro batches: no low-precision gradient is ever formed. p.grad IS the
  main gradient, so torch's own loop works unchanged: model.zero_grad() clears
  it, torch.nn.utils.clip_grad_norm_(model.parameters(), ...) reads and scales
  it. p.main_grad (Megatron's and HyperParallel's name) is the same tensor: a
  hook sets it after each backward's accumulation, and the step sets it again;
  after a model.zero_grad() it names the old tensor until the next backward,
  so code between the two reads p.grad. A PyTorch without Tensor.grad_dtype
  is refused at construction.
- step(): the main params' gradients are the live p.grad (no copy; a param
  whose grad is None is skipped, as torch skips it); the inner optimizer
  steps; hypertrain's AdamW and Muon write the rounded model params in the
  same pass (round to nearest even: the model param equals
  main_param.to(model dtype)), any other optimizer's params are copied back.
- Under fully_shard (FSDP2's DTensor params) each main param is a DTensor
  of the model param's placements, this rank's rows in FP32, and FSDP2
  reduces the gradients in FP32 straight into p.grad (it reads grad_dtype at
  the first forward: wrap before it). A state dict's main params may be
  DTensors of the same placements or whole tensors (a run on another layout):
  each rank keeps its rows.
- zero_grad() clears grad and main_grad.
- The wrapper's param_groups are the inner optimizer's groups (the same
  keys, read and written there: a scheduler's lr reaches the optimizer that
  steps) showing the model params where the groups hold main params, and its
  state is keyed by the model params: a low-precision param's state is its
  main param's plus "main_param", the FP32 main param itself. So torch's
  distributed checkpoint helpers (get_optimizer_state_dict,
  set_optimizer_state_dict), which match an optimizer's params to the model's
  parameter names, take the wrapper as they take torch's optimizers, and each
  main param travels in its param's state, resharded as the moments are.
- state_dict() is the inner optimizer's, each low-precision param's state
  with its "main_param", plus _mixed_precision_optimizer.fp32_from_fp16_params,
  {param name: FP32 main param} over every low-precision trainable param
  (empty for a float32 model; the same tensors as the state's: torch.save
  writes each once). DCP keeps only "state" and "param_groups". Before the
  first step the state is created as the first step creates it (hypertrain's
  AdamW and Muon: step 0 and zeros, the same updates as no state; another
  optimizer: one step on zero FP32 gradients with lr 0, DCP's way), so that a
  fresh optimizer's state dict has every entry a checkpoint fills.
  load_state_dict() restores the main params exactly, from
  _mixed_precision_optimizer where the state dict has it, else from the
  state's "main_param" entries; a state dict with neither loads with a
  warning and main params refreshed from the model params; one with some of
  them missing is an error naming them.
"""

from collections.abc import MutableMapping

import warnings

import torch

from .optim import AdamW, Muon, _closure_loss, _Delegating, _keep_local, _local, _MergedState, _require_device

_LOW = (torch.bfloat16, torch.float16)
KEY = "_mixed_precision_optimizer"


def _main_grad_is_grad(p):
    """post-accumulate-grad hook (autograd's, and FSDP2's after its reduction): p.main_grad names p.grad, the FP32
    gradient accumulated so far (grad_dtype float32)."""
    p.main_grad = p.grad


def _has_grad_dtype(p):
    return hasattr(p, "grad_dtype")


class _ModelGroup(MutableMapping):
    """A param group of the inner optimizer as the wrapper shows it: "params" the model params (each
    low-precision one where the group holds its FP32 main param), every other key the group's own, read and
    written there."""

    def __init__(self, group):
        self.group = group

    def __getitem__(self, key):
        if key == "params":
            return [getattr(p, "_hypertrain_model_param", p) for p in self.group["params"]]
        return self.group[key]

    def __setitem__(self, key, value):
        if key == "params":
            raise TypeError("Float16OptimizerWithFloat16Params: a param group's params are set by the wrapper "
                            "(add params with add_param_group)")
        self.group[key] = value

    def __delitem__(self, key):
        del self.group[key]

    def __iter__(self):
        return iter(self.group)

    def __len__(self):
        return len(self.group)

    def __contains__(self, key):
        return key in self.group

    def __repr__(self):
        return repr(dict(self.items()))


class _ParamState(MutableMapping):
    """A low-precision param's optimizer state as the wrapper shows it: the leaf optimizer's state of its main
    param, and "main_param", the FP32 main param itself (copy into it to change it)."""

    def __init__(self, leaf, main):
        self.leaf, self.main = leaf, main

    def _own(self):
        return self.leaf.state.get(self.main, {})

    def __getitem__(self, key):
        return self.main if key == "main_param" else self._own()[key]

    def __setitem__(self, key, value):
        if key == "main_param":
            raise TypeError("Float16OptimizerWithFloat16Params: state 'main_param' is the FP32 main param "
                            "itself; copy into it (state[p]['main_param'].copy_(...))")
        self.leaf.state[self.main][key] = value

    def __delitem__(self, key):
        if key == "main_param":
            raise TypeError("Float16OptimizerWithFloat16Params: state 'main_param' cannot be deleted")
        del self.leaf.state[self.main][key]

    def __iter__(self):
        return iter(["main_param", *self._own()])

    def __len__(self):
        return 1 + len(self._own())

    def __repr__(self):
        return repr(dict(self.items()))


class Float16OptimizerWithFloat16Params(_Delegating):
    """FP32 main params for a low-precision model's params, around an optimizer
    built over the model's own params (a ChainedOptimizer, hypertrain's AdamW or
    Muon, or any torch.optim.Optimizer); model names them in the state dict."""

    def __init__(self, optimizer, model):
        if model is None:
            raise ValueError("Float16OptimizerWithFloat16Params: model= is needed (the state dict keys the FP32 "
                             "main params by parameter name)")
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.inner = optimizer
        self.pairs = []  # (name, model param, main param) of every low-precision param
        self.fp32_params = []  # the float32 params, their own main params
        self._hooks = []
        leaves = getattr(optimizer, "optimizers", [optimizer])
        for leaf in leaves:
            for group in leaf.param_groups:
                self._wrap_group(leaf, group)
        self.fused_writeback = all(isinstance(leaf, (AdamW, Muon)) for leaf in leaves)
        self._adopt([optimizer])

    def _leaves(self):
        return getattr(self.inner, "optimizers", [self.inner])

    def _model_groups(self):
        return [_ModelGroup(g) for o in self.__dict__.get("optimizers", []) for g in o.param_groups]

    param_groups = property(_model_groups, _Delegating.param_groups.fset)

    def _model_state(self):
        merged = _MergedState()
        if "optimizers" not in self.__dict__:
            return merged
        for leaf in self._leaves():
            for group in leaf.param_groups:
                for q in group["params"]:
                    model = getattr(q, "_hypertrain_model_param", None)
                    if model is not None:
                        merged[model] = _ParamState(leaf, q)
                    elif q in leaf.state:
                        merged[q] = leaf.state[q]
        return merged

    state = property(_model_state, _Delegating.state.fset)

    def _wrap_group(self, leaf, group):
        """Each low-precision param of `group` (one of leaf's) replaced by its FP32 main param, its grad_dtype
        float32 and its main_grad hook set; a float32 one its own main param."""
        known = leaf.__dict__.setdefault("_param_names", {})  # errors name the main params
        if not isinstance(known, dict):
            known = leaf._param_names = {}
        for i, p in enumerate(group["params"]):
            name = self._names.get(id(p))
            if name is None:
                raise ValueError("Float16OptimizerWithFloat16Params: an optimizer param is not one of the "
                                 "model's parameters")
            known[id(p)] = name
            if p.dtype == torch.float32:
                p.main_param = p
                self.fp32_params.append(p)
                continue
            if p.dtype not in _LOW:
                raise TypeError(f"Float16OptimizerWithFloat16Params: param {name} has dtype {p.dtype}; "
                                "expected float16, bfloat16 or float32")
            local = _local(p)
            _require_device("Float16OptimizerWithFloat16Params", f"param {name}", local)
            if not local.is_contiguous():
                raise ValueError(f"Float16OptimizerWithFloat16Params: param {name} must be a contiguous tensor")
            if not _has_grad_dtype(p):
                raise RuntimeError(f"Float16OptimizerWithFloat16Params: this PyTorch ({torch.__version__}) "
                                   "has no Tensor.grad_dtype, which the wrapper needs: autograd must "
                                   f"accumulate {name}'s gradient in FP32 as its .grad, where "
                                   "model.zero_grad() and torch.nn.utils.clip_grad_norm_ see it; upgrade "
                                   "PyTorch")
            main = torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad)
            main._hypertrain_model_param = p  # hypertrain's kernels write p in the step's pass
            early, p.grad = p.grad, None  # a gradient from before the wrapping: kept, in FP32
            p.grad_dtype = torch.float32  # autograd, and FSDP2's reduction, deliver FP32 gradients
            if early is not None:
                p.grad = early.to(torch.float32)
            p.main_param, p.main_grad = main, p.grad
            group["params"][i] = main
            known[id(main)] = name
            if p in leaf.state:
                leaf.state[main] = leaf.state.pop(p)
            self.pairs.append((name, p, main))
            self._hooks.append(p.register_post_accumulate_grad_hook(_main_grad_is_grad))

    def add_param_group(self, param_group, optimizer=None):
        """The inner optimizer's add_param_group (a chain's: to `optimizer`, else by shape), the group's
        low-precision params then given FP32 main params as the constructor gives them."""
        if getattr(self, "_building", False):
            return None
        if hasattr(self.inner, "optimizers"):
            leaf = self.inner.add_param_group(param_group, optimizer=optimizer)
        else:
            if optimizer is not None and optimizer is not self.inner:
                raise ValueError("Float16OptimizerWithFloat16Params.add_param_group: optimizer= names a "
                                 "sub-optimizer of a chain; this wrapper holds one optimizer")
            self.inner.add_param_group(param_group)
            leaf = self.inner
        self._wrap_group(leaf, leaf.param_groups[-1])
        self.fused_writeback = self.fused_writeback and isinstance(leaf, (AdamW, Muon))
        return leaf

    _UNPICKLED = ("_hooks",)

    def __setstate__(self, state):
        """A pickled or copied wrapper: its model params (copies, in a copy) are linked to their main params
        and take FP32 gradients and the main_grad hook again, which neither pickling nor deepcopy carries."""
        super().__setstate__(state)
        self._hooks = []
        for _, p, main in self.pairs:  # tensors' Python attributes do not survive deepcopy or pickle
            p.grad_dtype = torch.float32
            main._hypertrain_model_param = p
            p.main_param, p.main_grad = main, p.grad
            self._hooks.append(p.register_post_accumulate_grad_hook(_main_grad_is_grad))
        for p in self.fp32_params:
            p.main_param = p
        self._names = {}  # by the leaves' names, which pickling keeps by place
        for leaf in getattr(self.inner, "optimizers", [self.inner]):
            self._names.update(getattr(leaf, "_param_names", {}))
        self._names.update({id(p): name for name, p, _ in self.pairs})

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for _, p, main in self.pairs:  # the live FP32 gradients: p.grad (None after a model.zero_grad(): skipped)
            p.main_grad = main.grad = p.grad
        for p in self.fp32_params:
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
        try:
            self.inner.step()
        finally:
            for _, _, main in self.pairs:  # the gradients stay the model params'; no second holder
                main.grad = None
        if not self.fused_writeback:
            self.copy_main_params_to_model_params()
        return loss

    @torch.no_grad()
    def copy_main_params_to_model_params(self):
        for _, p, main in self.pairs:
            p.copy_(main)

    @torch.no_grad()
    def reload_model_params(self):
        """The main params from the model params (loses what only FP32 holds: for a state dict without them)."""
        for _, p, main in self.pairs:
            main.copy_(p)

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)
        for _, p, _ in self.pairs:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()
            p.main_grad = p.grad

    @torch.no_grad()
    def _create_state(self):
        """Where the optimizers hold no state yet, each param's as its first step creates it (the module
        docstring says why and how)."""
        leaves = self._leaves()
        if any(st for o in leaves for st in o.state.values()):
            return
        for o in leaves:
            params = [q for g in o.param_groups for q in g["params"] if q.requires_grad]
            if isinstance(o, (AdamW, Muon)):
                for q in params:
                    o._state_of(q)
                continue
            lrs, grads = [g["lr"] for g in o.param_groups], [q.grad for q in params]
            for g in o.param_groups:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
            for q in params:
                q.grad = torch.zeros_like(q, dtype=torch.float32)
            try:
                o.step()
            finally:
                for g, lr in zip(o.param_groups, lrs):
                    g["lr"] = lr
                for q, g in zip(params, grads):
                    q.grad = g

    def state_dict(self):
        self._state_dict_hooks()
        self._create_state()
        sd = self.inner.state_dict()
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        mains = [q for g in self.inner.param_groups for q in g["params"]]
        for i, main in zip(ids, mains):  # each main param in its param's state, where DCP keeps it
            if getattr(main, "_hypertrain_model_param", None) is not None:
                sd["state"][i] = dict(sd["state"].get(i, {}), main_param=main.detach())
        sd[KEY] = {"fp32_from_fp16_params": {name: main.detach() for name, _, main in self.pairs}}
        return self._state_dict_hooks(sd)

    def _saved_in_state(self, state_dict):
        """The main params in the state dict's per-param state ({name: tensor}), and the state dict without
        them (the inner optimizer's); None where no state holds one."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            return None, state_dict
        ids = [i for g in groups for i in g.get("params", [])]
        models = [p for g in self.param_groups for p in g["params"]]
        if len(ids) != len(models):
            return None, state_dict  # the inner optimizer's load_state_dict says what is wrong
        low = {id(p): name for name, p, _ in self.pairs}
        saved, state = {}, dict(state)
        for i, p in zip(ids, models):
            st = state.get(i)
            if not isinstance(st, dict) or "main_param" not in st:
                continue
            if id(p) not in low:
                raise ValueError(f"Float16OptimizerWithFloat16Params: the state dict's state of "
                                 f"{self._names.get(id(p), f'param {i}')} has a main_param; that param is "
                                 f"{p.dtype} here, its own main param")
            st = dict(st)
            saved[low[id(p)]] = st.pop("main_param")
            state[i] = st
        if not saved:
            return None, state_dict
        return saved, dict(state_dict, state=state)

    def _check_saved(self, saved, where):
        missing = [name for name, _, _ in self.pairs if name not in saved]
        if missing:
            raise ValueError(f"Float16OptimizerWithFloat16Params: the state dict's {where} lacks {len(missing)} "
                             f"of the {len(self.pairs)} low-precision params: {', '.join(missing)} (a damaged "
                             "checkpoint: not filled in from the model)")
        extra = sorted(set(saved) - {name for name, _, _ in self.pairs})
        if extra:
            raise ValueError(f"Float16OptimizerWithFloat16Params: {where} has params this model does not hold in "
                             f"low precision: {', '.join(extra)}")
        for name, p, main in self.pairs:
            t = saved[name]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != main.shape:
                raise ValueError(f"Float16OptimizerWithFloat16Params: main param {name} in the state dict is "
                                 f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}; expected "
                                 f"torch.float32 {tuple(main.shape)}")

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        state_dict = dict(self._load_state_dict_hooks(state_dict))
        mixed = state_dict.pop(KEY, None)
        in_state, state_dict = self._saved_in_state(state_dict)
        saved = None
        if mixed is not None:
            saved = mixed.get("fp32_from_fp16_params", {}) if isinstance(mixed, dict) else None
            if not isinstance(saved, dict):
                raise ValueError(f"Float16OptimizerWithFloat16Params: {KEY}.fp32_from_fp16_params is not a mapping")
            self._check_saved(saved, f"{KEY}.fp32_from_fp16_params")
        elif in_state is not None:  # a DCP state dict: the main params in their params' state
            saved = in_state
            self._check_saved(saved, "state (its 'main_param' entries)")
        self.inner.load_state_dict(state_dict)
        if saved is None and self.pairs:
            warnings.warn("Float16OptimizerWithFloat16Params: the state dict has no "
                          f"{KEY}.fp32_from_fp16_params and no 'main_param' in its state; the FP32 main params "
                          f"start from the model's {self.pairs[0][1].dtype} params (their FP32 tails are lost)",
                          stacklevel=2)
            self.reload_model_params()
        elif saved is not None:
            for name, p, main in self.pairs:
                t = saved[name]
                if hasattr(main, "to_local") and not hasattr(t, "to_local"):  # a whole tensor: this rank's rows
                    t = _keep_local(main, t)
                _local(main).copy_(_local(t))
        self._load_state_dict_hooks(post=True)
