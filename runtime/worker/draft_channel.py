"""How TP rank 0 reaches the drafter: in process (colocated) or over ``torch.distributed`` (separate).

The separate protocol, per step, all shapes derived from the plain-data batch both sides hold:
  rank 0 -> drafter  captured target states of every fed token          [T, m*d]   (when the context is kept)
  rank 0 -> drafter  committed tokens [S, K+1] and accepted counts [S]             (when a block is drafted)
  drafter -> rank 0  block states [R, K', d] and Markov features [R, K', r] of the R requests verified by
                     rejection sampling, from which the target rebuilds their draft probabilities
The payload is O(batch x K x hidden); no vocabulary-sized tensor crosses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from runtime.kernels.transfer import to_device
from runtime.scheduling.step_io import ScheduledRequest
from runtime.worker.draft_runner import DraftRunner
from runtime.worker.step_tensors import StepTensors


@dataclass(frozen=True, slots=True)
class DraftFeatures:
    """What the target needs to rebuild q for the drafts of rejection-sampled requests."""

    hidden: torch.Tensor  # [R, K, d]
    low_rank: torch.Tensor | None  # [R, K, r]


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: torch.Tensor | None  # [S, K] (None when the drafter returns them to the driver itself)
    lengths: torch.Tensor | None  # [S]
    features: DraftFeatures | None  # for the rejection-sampled entries, in entry order
    confidence: torch.Tensor | None = None  # [S, K] the confidence head's c_k (None without one)
    block: torch.Tensor | None = None  # [S, K + 1 (+ K)] int64 read-back row (runtime.worker.draft_runner.DraftOutput)


class DraftChannel(Protocol):
    def scrub(self, page_ids: list[int]) -> None: ...

    def send_context(self, captured: torch.Tensor, tensors: StepTensors) -> None: ...

    def propose(self, entries: list[ScheduledRequest], committed: torch.Tensor, accepted: torch.Tensor,
                page_table: torch.Tensor, k_next: int, rejection_rows: list[int]) -> Proposal: ...


class LocalDraftChannel:
    """The drafter in this process: captured states are read in place, nothing is copied."""

    def __init__(self, runner: DraftRunner):
        self.runner = runner

    def scrub(self, page_ids: list[int]) -> None:
        self.runner.scrub(page_ids)

    def send_context(self, captured: torch.Tensor, tensors: StepTensors) -> None:
        self.runner.append_context(captured, tensors.positions, tensors.slots)

    def propose(self, entries, committed, accepted, page_table, k_next, rejection_rows) -> Proposal:
        out = self.runner.draft(entries, committed, accepted, page_table, k_next)
        features = None
        if rejection_rows:
            rows = to_device(rejection_rows, out.hidden.device)
            features = DraftFeatures(out.hidden[rows], out.low_rank[rows] if out.low_rank is not None else None)
        return Proposal(out.tokens, out.lengths, features, out.confidence, out.block)


class RemoteDraftChannel:
    """Rank 0's end of the link to a drafter process (rank ``drafter_rank`` of the replica's group)."""

    def __init__(self, drafter_rank: int, hidden_size: int, markov_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.peer, self.hidden_size, self.markov_rank = drafter_rank, hidden_size, markov_rank
        self.dtype, self.device = dtype, device

    def scrub(self, page_ids: list[int]) -> None:
        """Nothing to do here: the drafter process gets the same batch and scrubs its own context cache."""

    def send_context(self, captured: torch.Tensor, tensors: StepTensors) -> None:
        dist.send(captured.contiguous(), dst=self.peer)

    def propose(self, entries, committed, accepted, page_table, k_next, rejection_rows) -> Proposal:
        dist.send(committed.contiguous(), dst=self.peer)
        dist.send(accepted.contiguous(), dst=self.peer)
        return Proposal(None, None, receive_features(len(rejection_rows), k_next, self.hidden_size, self.markov_rank,
                                                     self.dtype, self.device, src=self.peer))


def receive_features(rows: int, k: int, hidden: int, rank: int, dtype: torch.dtype, device: torch.device,
                     src: int | None = None, group=None) -> DraftFeatures | None:
    """Receive (``src`` set) or take part in a broadcast from TP rank 0 (``group`` set) of draft features."""
    if rows == 0:
        return None
    h = torch.empty(rows, k, hidden, dtype=dtype, device=device)
    low = torch.empty(rows, k, rank, dtype=dtype, device=device) if rank else None
    for t in (h, low):
        if t is None:
            continue
        if src is not None:
            dist.recv(t, src=src)
        else:
            dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return DraftFeatures(h, low)


def send_features(features: DraftFeatures | None, dst: int | None = None, group=None) -> None:
    """Send to ``dst``, or broadcast from TP rank 0 over ``group``."""
    if features is None:
        return
    for t in (features.hidden, features.low_rank):
        if t is None:
            continue
        if dst is not None:
            dist.send(t.contiguous(), dst=dst)
        else:
            dist.broadcast(t.contiguous(), src=dist.get_global_rank(group, 0), group=group)
