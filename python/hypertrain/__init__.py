"""hypertrain from Python: HyperParallel's optimizer API (hypertrain.optim) and
learning-rate schedulers (hypertrain.lr_scheduler) on PyTorch tensors, computed
by hypertrain's C kernels (the extension module hypertrain._C)."""

from . import lr_scheduler, mixed_precision, optim
from .lr_scheduler import get_hyper_lr_scheduler
from .mixed_precision import Float16OptimizerWithFloat16Params
from .optim import AdamW, ChainedOptimizer, Muon, get_hyper_optimizer

__all__ = ["optim", "lr_scheduler", "AdamW", "Muon", "ChainedOptimizer", "get_hyper_optimizer",
           "get_hyper_lr_scheduler", "Float16OptimizerWithFloat16Params"]
