"""Learning-rate schedules: HyperParallel's get_hyper_lr_scheduler (cosine,
linear, constant) and MindFormers' schedules by their type names, each a
torch.optim.lr_scheduler.LRScheduler whose lr at every step is hypertrain's
(docs/NUMERICS.md, learning-rate schedules: ht_lr_at, the C trainer's own),
under the C trainer's lr_scheduler keys, defaults and checks (the config's
own code resolves them: one set of defaults for C and Python).
"""

import torch

from . import _C

# HyperParallel's names for MindFormers' warmup schedules (warmup from 0, linear).
_HYPER_TYPES = {"cosine": "CosineWithWarmUpLR", "linear": "LinearWithWarmUpLR", "constant": "ConstantWarmUpLR"}


def scheduler_types():
    """Every scheduler_type get_hyper_lr_scheduler takes (LearningRateWiseLayer wraps a schedule object per
    param group in MindFormers: not one of them)."""
    return list(_HYPER_TYPES) + [t for t in _C.lr_types() if t != "LearningRateWiseLayer"]


# The C trainer's lr_scheduler keys (docs/CONFIG.md) a schedule takes from Python, by those names.
CONFIG_KEYS = ("warmup_steps", "warmup_ratio", "warmup_lr_init", "lr_end", "num_cycles", "decay_steps", "decay_ratio",
               "power", "decay_start_steps", "decay_start_ratio", "eta_min", "t_max", "keep_steps", "lr_end1",
               "final_steps", "lr_end2", "t_0", "t_mult")


def _yaml_number(who, key, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{who}: {key} is {v!r}; expected a number")
    return str(v) if isinstance(v, int) else repr(float(v))


def resolve_schedule(schedule_type, total_steps, who="hypertrain.lr_scheduler", **keys):
    """The schedule the C trainer runs for lr_scheduler.type schedule_type over total_steps (training.steps) with
    these lr_scheduler keys and its defaults for the others (src/config/keys.c; num_cycles 1.0 for
    CosineWithRestartsAndWarmUpLR, 0.5 for the others; lr_end2 lr_end1; decay_start_ratio 0.8): its fields as
    ht_lr_schedule names them, the derived counts resolved. A schedule the trainer's config check refuses
    (ConstantWithCoolDownLR without decay_steps or decay_ratio, CosineAnnealingWarmRestarts without t_0, ...)
    raises ValueError with its sentence."""
    if "decay_start" in keys:  # ht_lr_schedule's name, taken before the config's
        keys["decay_start_steps"] = keys.pop("decay_start")
    unknown = sorted(set(keys) - set(CONFIG_KEYS))
    if unknown:
        raise TypeError(f"{who}: unknown schedule key(s) {unknown}; expected the trainer's lr_scheduler keys: "
                        f"{', '.join(CONFIG_KEYS)}")
    sets = [f"training.steps={_yaml_number(who, 'total_steps', total_steps)}", f"lr_scheduler.type={schedule_type}"]
    sets += [f"lr_scheduler.{k}={_yaml_number(who, k, v)}" for k, v in keys.items() if v is not None]
    try:
        fields = _C.lr_schedule(sets)
    except ValueError as e:
        raise ValueError(f"{who}: {e}") from None
    fields.pop("type")
    return fields


class HyperLRScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The lr of each param group at step s (0-based: the step about to be
    taken) is schedule(s) with that group's initial lr as its base lr: the C
    trainer's schedule (ht_lr_at) for lr_scheduler.type schedule_type over
    total_steps, with the trainer's lr_scheduler keys (CONFIG_KEYS) and its
    defaults for the others (resolve_schedule)."""

    def __init__(self, optimizer, schedule_type, total_steps=None, last_epoch=-1, **keys):
        if total_steps is None:
            raise ValueError("HyperLRScheduler: total_steps is needed (the training's steps)")
        self.schedule_type = schedule_type
        self.fields = resolve_schedule(schedule_type, total_steps, who="HyperLRScheduler", **keys)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [_C.lr_at(self.schedule_type, self.last_epoch, base_lr=float(b), **self.fields) for b in self.base_lrs]


def get_hyper_lr_scheduler(optimizer, scheduler_type="cosine", total_steps=None, warmup_steps=0, **keys):
    """HyperParallel's factory: scheduler_type "cosine" (linear warmup from 0,
    then a half cosine to lr_end, default 0), "linear" or "constant", or any of
    MindFormers' type names (scheduler_types()); total_steps the training's
    steps, warmup_steps the warmup's. Other keys are the C trainer's
    lr_scheduler keys (CONFIG_KEYS), with its defaults and its checks: the
    lrs are the trainer's, step for step."""
    kind = _HYPER_TYPES.get(scheduler_type, scheduler_type)
    if kind not in scheduler_types():
        raise ValueError(f"get_hyper_lr_scheduler: scheduler_type {scheduler_type!r} does not exist; expected one "
                         f"of {', '.join(scheduler_types())}")
    if total_steps is None or int(total_steps) < 1:
        raise ValueError(f"get_hyper_lr_scheduler: total_steps {total_steps}; expected the training's steps (>= 1)")
    if int(warmup_steps) < 0 or int(warmup_steps) > int(total_steps):
        raise ValueError(f"get_hyper_lr_scheduler: warmup_steps {warmup_steps}; expected 0 to total_steps "
                         f"({total_steps})")
    return HyperLRScheduler(optimizer, kind, total_steps=int(total_steps), warmup_steps=int(warmup_steps), **keys)
