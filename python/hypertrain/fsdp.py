"""What HyperParallel's fully_shard modules have that PyTorch's FSDP2 modules
lack, on PyTorch's own fully_shard.

set_gradient_scaling_factor(module, factor): a factor multiplying the
gradients of the params that module's fully_shard call manages, after their
reduce-scatter (and, under HSDP, their all-reduce) and before they are written
into the sharded params' .grad, as HyperParallel's HSDPModule does (seed 002:
model.set_gradient_scaling_factor(scale_factor=0.5)). None turns it off. It is
applied through FSDP2's all-reduce hook (FSDPModule.set_all_reduce_hook), on the
reduced gradients in their reduce dtype: a hook already set there runs first,
then the scaling. Like FSDP2's own set_gradient_divide_factor it concerns the
module's own params, not its children's: call it on every fully_shard module
whose gradients are to be scaled.

Importing hypertrain installs it as FSDPModule.set_gradient_scaling_factor
where PyTorch has none.

fully_shard and init_device_mesh, as seed 002 imports them from hyper_parallel:
PyTorch's, with two of HyperParallel's meanings. init_device_mesh("npu", ...)
on a PyTorch without an Ascend backend is a CPU mesh (hypertrain's optimizers
run on CPU tensors), said once in the log. fully_shard records the names of
the params it replaces, so that get_hyper_optimizer(model=...) given the
params of before the sharding (the seed groups them, then shards) takes the
sharded params of the same names.
"""

import logging

import torch

_log = logging.getLogger("hypertrain")
PRESHARD_NAMES = "_hypertrain_preshard_names"  # on a fully_shard module: {id(param before): its name there}


def _check_factor(factor):
    if factor is None:
        return None
    if isinstance(factor, bool):
        raise ValueError(f"set_gradient_scaling_factor: the factor must be None, a float, an int or a 1-element "
                         f"tensor, not the bool {factor}")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"set_gradient_scaling_factor: a tensor factor must have one element, not shape "
                             f"{tuple(factor.shape)}")
        return factor.detach()
    if not isinstance(factor, (int, float)):
        raise ValueError(f"set_gradient_scaling_factor: the factor must be None, a float, an int or a 1-element "
                         f"tensor, not {type(factor).__name__}")
    return float(factor)


class _Scaling:
    """An FSDP2 all-reduce hook: the hook that was there (if any), then the reduced gradients times factor."""

    def __init__(self, inner, factor):
        self.inner, self.factor = inner, factor

    def __call__(self, reduce_output):
        if self.inner is not None:
            self.inner(reduce_output)
        reduce_output.mul_(self.factor)


def set_gradient_scaling_factor(module, factor=None, *, scale_factor=None):
    """Multiply module's reduced gradients by factor (None: no scaling); scale_factor= is the seed's name."""
    from torch.distributed.fsdp import FSDPModule

    if scale_factor is not None:
        if factor is not None:
            raise TypeError("set_gradient_scaling_factor: give factor or scale_factor, not both")
        factor = scale_factor
    factor = _check_factor(factor)
    if not isinstance(module, FSDPModule):
        raise TypeError(f"set_gradient_scaling_factor: {type(module).__name__} is not a fully_shard module")
    groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", None)
    if groups is None or any(not hasattr(g, "_all_reduce_hook") for g in groups):
        raise RuntimeError(f"set_gradient_scaling_factor: this PyTorch ({torch.__version__}) has no FSDP2 "
                           "all-reduce hook to apply the factor through")
    for group in groups:
        hook = group._all_reduce_hook
        inner = hook.inner if isinstance(hook, _Scaling) else hook
        group._all_reduce_hook = inner if factor is None else _Scaling(inner, factor)


def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, **kwargs):
    """torch.distributed.device_mesh.init_device_mesh; "npu" where PyTorch has no Ascend backend (torch.npu) is
    "cpu", said once (logger "hypertrain")."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    if device_type == "npu" and not hasattr(torch, "npu"):
        if not getattr(init_device_mesh, "_said", False):
            init_device_mesh._said = True
            _log.warning("init_device_mesh: no Ascend NPU backend in this PyTorch; the \"npu\" mesh is a CPU mesh "
                         "(hypertrain's optimizers run on CPU tensors)")
        device_type = "cpu"
    return torch_init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names, **kwargs)


def fully_shard(module, *args, **kwargs):
    """torch.distributed.fsdp.fully_shard, the names of the params it replaces recorded on the module (for
    get_hyper_optimizer given the params of before the sharding)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    modules = module if isinstance(module, (list, tuple)) else [module]
    before = [{id(p): n for n, p in m.named_parameters()} for m in modules]
    out = torch_fully_shard(module, *args, **kwargs)
    for m, names in zip(modules, before):
        recorded = getattr(m, PRESHARD_NAMES, {})
        recorded.update(names)
        object.__setattr__(m, PRESHARD_NAMES, recorded)
    return out


def sharded_params(model, params):
    """params (tensors or param-group dicts) with each param that a fully_shard call on model or one of its
    submodules replaced taken as the model's param of the same name now (the same global shape, checked)."""
    if model is None:
        return params
    now = {id(p) for p in model.parameters()}
    renamed = {}
    for prefix, m in model.named_modules():
        for old, name in getattr(m, PRESHARD_NAMES, {}).items():
            renamed.setdefault(old, f"{prefix}.{name}" if prefix else name)

    def current(p):
        if not isinstance(p, torch.Tensor) or id(p) in now or id(p) not in renamed:
            return p
        q = model.get_parameter(renamed[id(p)])
        if tuple(q.shape) != tuple(p.shape):
            raise ValueError(f"get_hyper_optimizer: param {renamed[id(p)]} was {tuple(p.shape)} before fully_shard "
                             f"and is {tuple(q.shape)} now")
        return q

    out = []
    for x in params:
        if isinstance(x, dict):
            x = dict(x, params=[current(p) for p in ([x["params"]] if isinstance(x["params"], torch.Tensor)
                                                      else x["params"])])
            out.append(x)
        else:
            out.append(current(x))
    return out


def _install():
    """FSDPModule.set_gradient_scaling_factor, where PyTorch has no such method."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_gradient_scaling_factor"):
        FSDPModule.set_gradient_scaling_factor = set_gradient_scaling_factor


_install()
