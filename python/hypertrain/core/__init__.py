"""HyperParallel's module layout (seed 002): hypertrain.core.optimizer is
hyper_parallel.core.optimizer, so the seed's imports run after one rename."""

from . import optimizer

__all__ = ["optimizer"]
