"""Speculative-decoding counters (vLLM's names) and the permanent acceptance gate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecMetrics:
    """Counts over verified blocks; a stop inside a block cuts what is counted at the stop."""

    num_drafts: int = 0  # verify steps of one request that carried at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_drafted:
            self.num_accepted_tokens_per_pos.extend([0] * (num_drafted - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """tau: mean tokens committed per verify step, 1 + accepted / drafts (1.0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length}


class AcceptanceGate:
    """Turns speculation off for good once the rolling acceptance rate falls below a threshold.

    One sample per speculating step: accepted / drafted over that step's requests. With at least
    ``window`` samples and their mean below ``threshold``, the gate closes and never reopens.
    A window of 0 or None, or no threshold, disables the gate.
    """

    def __init__(self, window: int | None, threshold: float | None):
        self.enabled = bool(window) and threshold is not None
        self.threshold = threshold or 0.0
        self.rates: deque[float] = deque(maxlen=window or 1)
        self.closed = False

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if not self.enabled or self.closed or num_drafted == 0:
            return
        self.rates.append(num_accepted / num_drafted)
        if len(self.rates) == self.rates.maxlen and sum(self.rates) / len(self.rates) < self.threshold:
            self.closed = True
