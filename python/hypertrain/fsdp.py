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
"""

import torch


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


def _install():
    """FSDPModule.set_gradient_scaling_factor, where PyTorch has no such method."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_gradient_scaling_factor"):
        FSDPModule.set_gradient_scaling_factor = set_gradient_scaling_factor


_install()
