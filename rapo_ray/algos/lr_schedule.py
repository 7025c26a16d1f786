"""The learner's learning-rate schedule: a linear warm-up, then constant, linear or cosine decay to a floor.

Shaped as the schedules verl, OpenRLHF and TRL users know (transformers' ``get_*_schedule_with_warmup``): the decay
starts after the warm-up and reaches ``min_ratio`` x lr at ``total`` steps. A small model trained for a few dozen RL
steps needs both ends: the warm-up keeps the first updates, made from a cold start's sharp policy, small; the floor
keeps the last steps learning.
"""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float = 0.0) -> float:
    """The multiplier of the peak learning rate at optimiser step ``step`` (0-based).

    Warm-up: (step + 1) / warmup for step < warmup. After it, with progress = (step - warmup) / (total - warmup)
    clipped to [0, 1]: constant 1; linear 1 - (1 - min_ratio) progress; cosine min_ratio + (1 - min_ratio)
    (1 + cos(pi progress)) / 2."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"learner.lr_schedule: {schedule!r} is not one of {LR_SCHEDULES}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"learner.lr_min_ratio ({min_ratio}) must be in [0, 1]")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
