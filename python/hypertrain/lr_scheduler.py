"""Learning-rate schedules: HyperParallel's get_hyper_lr_scheduler (cosine,
linear, constant) and MindFormers' ten schedules by their type names, each a
torch.optim.lr_scheduler.LRScheduler whose lr at every step is hypertrain's
(docs/NUMERICS.md, learning-rate schedules: ht_lr_at, the C trainer's own).
"""

import torch

from . import _C

# HyperParallel's names for MindFormers' warmup schedules (warmup from 0, linear).
_HYPER_TYPES = {"cosine": "CosineWithWarmUpLR", "linear": "LinearWithWarmUpLR", "constant": "ConstantWarmUpLR"}


def scheduler_types():
    """Every scheduler_type get_hyper_lr_scheduler takes (LearningRateWiseLayer wraps a schedule object per
    param group in MindFormers: not one of them)."""
    return list(_HYPER_TYPES) + [t for t in _C.lr_types() if t != "LearningRateWiseLayer"]


class HyperLRScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The lr of each param group at step s (0-based: the step about to be
    taken) is schedule(s) with that group's initial lr as its base lr; the
    schedule's fields are ht_lr_schedule's (warmup_steps, total_steps, lr_end,
    warmup_lr_init, num_cycles, decay_steps, power, decay_start, eta_min, t_max,
    keep_steps, final_steps, lr_end1, lr_end2, t_0, t_mult, lr_scale, wrapped)."""

    def __init__(self, optimizer, schedule_type, last_epoch=-1, **fields):
        self.schedule_type = schedule_type
        self.fields = fields
        _C.lr_at(schedule_type, 0, base_lr=1.0, **fields)  # an unknown field or type fails here, not at a step
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [_C.lr_at(self.schedule_type, self.last_epoch, base_lr=float(b), **self.fields) for b in self.base_lrs]


def get_hyper_lr_scheduler(optimizer, scheduler_type="cosine", total_steps=None, warmup_steps=0, **fields):
    """HyperParallel's factory: scheduler_type "cosine" (linear warmup from 0,
    then a half cosine to lr_end, default 0), "linear" or "constant", or any of
    MindFormers' type names (scheduler_types()); total_steps the training's
    steps, warmup_steps the warmup's. Other fields as HyperLRScheduler's."""
    kind = _HYPER_TYPES.get(scheduler_type, scheduler_type)
    if kind not in scheduler_types():
        raise ValueError(f"get_hyper_lr_scheduler: scheduler_type {scheduler_type!r} does not exist; expected one "
                         f"of {', '.join(scheduler_types())}")
    if total_steps is None or int(total_steps) < 1:
        raise ValueError(f"get_hyper_lr_scheduler: total_steps {total_steps}; expected the training's steps (>= 1)")
    if int(warmup_steps) < 0 or int(warmup_steps) > int(total_steps):
        raise ValueError(f"get_hyper_lr_scheduler: warmup_steps {warmup_steps}; expected 0 to total_steps "
                         f"({total_steps})")
    return HyperLRScheduler(optimizer, kind, total_steps=int(total_steps), warmup_steps=int(warmup_steps), **fields)
