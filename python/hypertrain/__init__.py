"""hypertrain from Python: HyperParallel's optimizer API (hypertrain.optim),
learning-rate schedulers (hypertrain.lr_scheduler) and the FP32 main-param
wrapper (hypertrain.mixed_precision) on PyTorch tensors, computed by
hypertrain's C kernels (the extension module hypertrain._C); HyperParallel's
set_gradient_scaling_factor on FSDP2 modules (hypertrain.fsdp); the C trainer
itself (hypertrain.train) and its checkpoints (hypertrain.load_checkpoint)."""

from . import fsdp, lr_scheduler, mixed_precision, optim
from .lr_scheduler import get_hyper_lr_scheduler
from .mixed_precision import Float16OptimizerWithFloat16Params
from .optim import AdamW, ChainedOptimizer, Muon, get_hyper_optimizer
from .trainer import load_checkpoint, train

__all__ = ["optim", "lr_scheduler", "fsdp", "AdamW", "Muon", "ChainedOptimizer", "get_hyper_optimizer",
           "get_hyper_lr_scheduler", "Float16OptimizerWithFloat16Params", "train", "load_checkpoint"]
