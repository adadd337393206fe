"""hypertrain from Python: HyperParallel's optimizer API (hypertrain.optim),
learning-rate schedulers (hypertrain.lr_scheduler) and the FP32 main-param
wrapper (hypertrain.mixed_precision) on PyTorch tensors, computed by
hypertrain's C kernels (the extension module hypertrain._C); HyperParallel's
set_gradient_scaling_factor on FSDP2 modules, and fully_shard and
init_device_mesh as seed 002 imports them from hyper_parallel (hypertrain.fsdp);
hyper_parallel.core.optimizer's names (hypertrain.core.optimizer); the C trainer
itself (hypertrain.train) and its checkpoints (hypertrain.load_checkpoint).

The trainer needs no PyTorch: without it, `import hypertrain` gives train,
CONFIGS and CORPUS, and the optimizers' names raise an ImportError saying so
(load_checkpoint reads into torch tensors)."""

from . import _preload  # noqa: F401  (the CPU checked, a wheel's bundled libraries loaded: before _C)
from .trainer import CONFIGS, CORPUS, load_checkpoint, train

_TORCH_NAMES = ["optim", "lr_scheduler", "fsdp", "core", "mixed_precision", "fully_shard", "init_device_mesh", "AdamW",
                "Muon", "ChainedOptimizer", "get_hyper_optimizer", "get_hyper_lr_scheduler",
                "Float16OptimizerWithFloat16Params"]
__all__ = _TORCH_NAMES + ["train", "load_checkpoint", "CONFIGS", "CORPUS"]

try:
    import torch  # noqa: F401
except ImportError as e:
    _NO_TORCH = e
else:
    _NO_TORCH = None
    from . import core, fsdp, lr_scheduler, mixed_precision, optim  # noqa: F401
    from .fsdp import fully_shard, init_device_mesh  # noqa: F401
    from .lr_scheduler import get_hyper_lr_scheduler  # noqa: F401
    from .mixed_precision import Float16OptimizerWithFloat16Params  # noqa: F401
    from .optim import AdamW, ChainedOptimizer, Muon, get_hyper_optimizer  # noqa: F401


def __getattr__(name):
    if name in _TORCH_NAMES and _NO_TORCH is not None:
        raise ImportError(f"hypertrain.{name} needs PyTorch, which this Python cannot import ({_NO_TORCH}): "
                          "pip install torch (hypertrain.train runs without it)")
    raise AttributeError(f"module 'hypertrain' has no attribute {name!r}")
