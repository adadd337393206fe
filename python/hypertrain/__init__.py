"""hypertrain from Python: HyperParallel's optimizer API (hypertrain.optim),
learning-rate schedulers (hypertrain.lr_scheduler) and the FP32 main-param
wrapper (hypertrain.mixed_precision) on PyTorch tensors, computed by
hypertrain's C kernels (the extension module hypertrain._C); HyperParallel's
set_gradient_scaling_factor on FSDP2 modules, and fully_shard and
init_device_mesh as seed 002 imports them from hyper_parallel (hypertrain.fsdp);
hyper_parallel.core.optimizer's names (hypertrain.core.optimizer); the C trainer
itself (hypertrain.train) and its checkpoints (hypertrain.load_checkpoint)."""

from . import core, fsdp, lr_scheduler, mixed_precision, optim
from .fsdp import fully_shard, init_device_mesh
from .lr_scheduler import get_hyper_lr_scheduler
from .mixed_precision import Float16OptimizerWithFloat16Params
from .optim import AdamW, ChainedOptimizer, Muon, get_hyper_optimizer
from .trainer import load_checkpoint, train

__all__ = ["optim", "lr_scheduler", "fsdp", "core", "fully_shard", "init_device_mesh", "AdamW", "Muon",
           "ChainedOptimizer", "get_hyper_optimizer", "get_hyper_lr_scheduler", "Float16OptimizerWithFloat16Params",
           "train", "load_checkpoint"]
