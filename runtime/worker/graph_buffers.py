"""What a captured CUDA graph of the target holds (its persistent output buffers) and what one replay returns
(views of those buffers for the step's real rows), and the timing of a replay."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.scheduling.step_io import ScheduledRequest
from runtime.worker.step_tensors import StepTensors, padded_page_table


@dataclass
class GraphOutputs:
    """One replay's results for its T real rows (views of the graph's buffers, valid until its next replay)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, d] final-normed states
    captured: torch.Tensor | None  # [T, m*d]
    logits: torch.Tensor | None  # [T, V] in the model dtype (None under tensor parallelism: computed on demand)
    top: torch.Tensor  # [T] max logit (NaN when the row has one)
    argmax: torch.Tensor  # [T]
    context_appended: bool  # the drafter's context graph ran: the captured states are in its cache
    q_len: int  # Q: request b's i-th fed token is row b*Q + i (rows past its real tokens are padding)
    verdict: torch.Tensor | None = None  # [T] one-token graphs: greedy_verdicts(top, argmax) (-1: a broken row)
    block_verdict: torch.Tensor | None = None  # [requests, Q+2] verify graphs: block_verdicts (greedy verification)

    def step_tensors(self, reqs: list[ScheduledRequest], page_size: int, device: torch.device,
                     with_page_table: bool) -> StepTensors:
        """The step's tensors for verification and drafting: the graph's inputs (padding rows included), the page
        table if asked for."""
        table = padded_page_table(reqs, device) if with_page_table else None
        row_ends = [b * self.q_len + len(r.token_ids) for b, r in enumerate(reqs)]
        return StepTensors(self.input_ids, self.positions, self.slots, None, table, row_ends)


@dataclass
class CapturedGraph:
    """A captured verify or decode graph of B requests x Q tokens and its persistent output buffers."""

    graph: torch.cuda.CUDAGraph
    wrapper: object  # the FlashInfer wrapper whose buffers the graph reads
    hidden: torch.Tensor  # [B*Q, d] final-normed states
    captured: torch.Tensor | None  # [B*Q, m*d]
    logits: torch.Tensor | None  # [B*Q, V] model dtype (None under tensor parallelism: not gathered)
    top: torch.Tensor  # [B*Q]
    argmax: torch.Tensor  # [B*Q]
    context: torch.cuda.CUDAGraph | None  # appends captured [B*Q, m*d] at the step's positions and slots
    verdict: torch.Tensor | None  # [B] Q = 1: the greedy token of each row, -1 where the row's logits are broken
    block_verdict: torch.Tensor | None  # [B, Q+2] Q > 1: each request's greedy verification (block_verdicts)


@dataclass
class CapturedPackedGraph:
    """A packed verify graph (``runtime.worker.packed_verify``) of B requests x Q = K+1 tokens fed, ``columns`` x B drafts
    verified: B x (columns + 1) rows through the target."""

    graph: torch.cuda.CUDAGraph
    wrapper: object  # the FlashInfer wrapper (planned for the uniform B x Q layout)
    lengths: torch.Tensor  # [B] drafts each request verified
    captured: torch.Tensor | None  # [B*Q, m*d] (0 on rows not fed)
    block_verdict: torch.Tensor  # [B, Q+2]
    context: torch.cuda.CUDAGraph | None


@dataclass
class PackedGraphOutputs:
    """One packed replay's results for its S real requests (views of the graph's buffers)."""

    lengths: torch.Tensor  # [S]
    block_verdict: torch.Tensor  # [S, Q+2]
    captured: torch.Tensor | None  # [S*Q, m*d]
    context_appended: bool


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    """Device time of one replay of ``graph``, the median of ``repeats``, milliseconds."""
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]
