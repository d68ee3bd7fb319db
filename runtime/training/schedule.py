"""The trainers' learning-rate schedule: linear warmup, then a cosine to 0."""

from __future__ import annotations

import math


def warmup_cosine(step: int, steps: int, warmup_steps: int, time_fraction: float = 0.0) -> float:
    """The learning-rate multiplier of optimizer step ``step`` (0-based) of a run of at most ``steps``: linear
    over the first ``warmup_steps``, then a cosine to 0 at ``steps``. With ``time_fraction`` (the share of a
    time limit used so far) the run's progress is the larger of its step and time fractions, so a run stopped by
    its time limit before ``steps`` has still warmed up and annealed to 0 by then."""
    done = max(step / steps, time_fraction)
    warmed = max(step + 1, time_fraction * steps) / warmup_steps
    return min(warmed, 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))
