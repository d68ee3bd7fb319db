"""Confidences on the wire: a step's confidences cross its one int64 device-to-host transfer as integers."""

from __future__ import annotations

import torch


CONFIDENCE_SCALE = 1 << 24  # confidences cross the step's one int64 device-to-host transfer as c * 2^24


def confidence_as_ints(confidence: torch.Tensor) -> torch.Tensor:
    """[S, K] confidences -> int64 (c * 2^24, rounded), to ride in the step's integer transfer."""
    return (confidence.float() * CONFIDENCE_SCALE).round().to(torch.int64)


def confidence_from_ints(values: list[int]) -> list[float]:
    """The inverse of ``confidence_as_ints`` on the host."""
    return [c / CONFIDENCE_SCALE for c in values]
