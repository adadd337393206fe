"""hyper_parallel.core.optimizer's names (seed 002) from hypertrain: the
chained Muon + AdamW factory, the learning-rate scheduler factory, and the
optimizers themselves (hypertrain.optim, hypertrain.lr_scheduler)."""

from ..lr_scheduler import get_hyper_lr_scheduler
from ..optim import AdamW, ChainedOptimizer, Muon, get_hyper_optimizer

__all__ = ["AdamW", "Muon", "ChainedOptimizer", "get_hyper_optimizer", "get_hyper_lr_scheduler"]
