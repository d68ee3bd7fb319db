"""Packed verification: each request verifies the drafts the confidence scheduler's budget gives it, chosen on the
device from this block's confidences, and the target runs on those rows only.

Why: a CUDA graph pads every request of a step to one length, so a step costs its batch x (longest + 1) tokens
whatever the others verify, and the best single cap is whole blocks at high load on the trained pairs measured
(``benchmarks/schedule_bounds.py``: earlier runs at 256 requests, 1.00x; an oracle that fed each request only the
drafts it accepts, 1.19x and 1.05x). A per-request choice needs the GEMMs to run on the verified rows alone, as
TensorRT-LLM's ragged mode and the DSpark paper's production scheduler (section 5.3) do.

The layout (every shape static, so a graph can hold it): a step of B requests (a graph's batch bucket) feeds the full
blocks as a uniform step does (``ids``, ``positions``, ``slots`` [B*Q], Q = K + 1: anchor then drafts), and the
scheduler's budget is ``B x c`` drafts (c "columns", chosen from an earlier step's confidences). On the device:

1. ``survivals``: each draft's believed survival (the cumulative product of its block's confidences, each through
   the online survival fit of its position and its request's verify-history class, which starts at the offline
   calibration), non-increasing along a block: what ``ConfidenceScheduler`` computes on the host;
2. ``select_lengths``: the ``B x c`` drafts of highest survival over the whole step (ties: the earlier position,
   then the earlier request), so each request's share is a prefix of its block: its length L_b;
3. ``pack_index``: the T = B + B x c rows fed (each request's anchor and its L_b drafts), as indices into the
   uniform layout; the target runs on those rows: embedding, RoPE and the KV write per fed row, GEMMs on T rows,
   and attention in the uniform layout its plan is for (queries scattered there, outputs gathered back; rows not
   fed attend to keys no fed row reads);
4. greedy verification in the uniform layout (``block_verdicts``): the head's max / argmax scattered back (rows
   not fed: max 0, argmax -1), and positions past each request's length repeating its last verified position, so
   the accepted count never passes its verified drafts.

Lossless as the production scheduler: the capacity (c) comes from an earlier step, the selection from this block's
confidences and each request's history (its verifications before this step), and a draft's confidence depends only
on its prefix (``c_k = sigma(w [h_k; W1 x_{k-1}])``), never on the draft token being verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.sampling.verify import block_verdicts


def survivals(confidence: torch.Tensor, slope: torch.Tensor, bias: torch.Tensor,
              history: torch.Tensor) -> torch.Tensor:
    """confidence [B, K] (0 where nothing was proposed), slope [K] and bias [H, K] (the survival fit, per position
    and verify-history class), history [B] int64 (each request's class) -> the believed survival [B, K]: the
    cumulative product of ``sigmoid(slope_k logit(c_k) + bias_{h,k})``, in [0, 1] and non-increasing along each row
    (``SurvivalCorrection.survival``, on the device)."""
    c = confidence.clamp(1e-9, 1 - 1e-9)
    factor = ((1.0 - c) / c) ** slope * torch.exp(-bias.index_select(0, history))  # [B, K]
    return torch.cumprod(torch.where(confidence > 0, 1.0 / (1.0 + factor), 0.0), dim=1)


def history_after(before: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor,
                  max_draft_len: int) -> torch.Tensor:
    """Each request's verify-history class after a verification (``next_history`` on the device): before [S] int64,
    verified [S] drafts it verified, accepted [S] of them accepted -> [S] int64, unchanged where it verified none."""
    k = max_draft_len
    verdict = torch.where(accepted < verified, 1 + accepted.clamp(max=k - 1), k + verified.clamp(max=k))
    return torch.where(verified > 0, verdict, before)


def select_lengths(survival: torch.Tensor, budget: int) -> torch.Tensor:
    """survival [B, K] (non-increasing along each row) -> lengths [B] int64: how many drafts of each block are among
    the ``budget`` of highest survival over the step (ties: the earlier position, then the earlier request), so each
    is a prefix of its block; ``budget`` <= B x K, and the lengths sum to it."""
    batch = survival.shape[0]
    values = survival.t().reshape(-1)  # position-major: every first draft, then every second draft, ...
    chosen = torch.sort(values, descending=True, stable=True).indices[:budget]  # [budget]
    lengths = torch.zeros(batch, dtype=torch.int64, device=survival.device)
    return lengths.scatter_add_(0, chosen % batch, torch.ones_like(chosen))


def pack_index(lengths: torch.Tensor, q_len: int, rows: int) -> torch.Tensor:
    """lengths [B] (summing to ``rows - B``) -> [rows] int64: the fed rows (each request's anchor and its first
    ``lengths[b]`` drafts, in request order) as indices into the uniform layout of B x ``q_len`` rows."""
    counts = lengths + 1  # [B]
    request = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), counts,
                                      output_size=rows)  # [rows]
    starts = torch.cumsum(counts, dim=0) - counts  # [B] each request's first packed row
    return request * q_len + torch.arange(rows, device=lengths.device) - starts[request]


def verify_positions(positions: torch.Tensor, lengths: torch.Tensor, q_len: int) -> torch.Tensor:
    """positions [B*Q] of the full blocks -> [B*Q] with every row past a request's length repeating its last verified
    position (``block_verdicts`` counts a request's drafts from its rising positions)."""
    grid = positions.view(-1, q_len)  # [B, Q]
    last = grid.gather(1, lengths[:, None])  # [B, 1]
    past = torch.arange(q_len, device=positions.device)[None, :] > lengths[:, None]
    return torch.where(past, last, grid).reshape(-1)


@dataclass
class PackedVerify:
    """One packed verify's outputs, in the uniform layout (B x Q rows) unless said."""

    lengths: torch.Tensor  # [B] drafts each request verified
    index: torch.Tensor  # [T] the fed rows
    hidden: torch.Tensor  # [T, d] final-normed states of the fed rows
    captured: torch.Tensor | None  # [B*Q, m*d] captured states (0 on rows not fed)
    top: torch.Tensor  # [B*Q] max logit (0 on rows not fed)
    argmax: torch.Tensor  # [B*Q] (-1 on rows not fed)
    block_verdict: torch.Tensor  # [B, Q+2] block_verdicts: committed candidates, accepted, fault flag


Head = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # hidden [T, d] -> (max logit, argmax) [T]


def packed_verify(target, caches, meta, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  survival: torch.Tensor, budget: int, head: Head) -> PackedVerify:
    """Greedy verification of the ``budget`` drafts of highest ``survival`` [B, K] over full blocks fed as a uniform
    step (``ids``, ``positions``, ``slots`` [B*Q]; ``meta`` planned for it), the target run on the fed rows only
    (see the module doc). Static shapes throughout: what a graph of (B, Q, budget) captures."""
    padded = ids.shape[0]
    q_len = survival.shape[1] + 1
    lengths = select_lengths(survival, budget)
    index = pack_index(lengths, q_len, survival.shape[0] + budget)
    hidden, captured = target(ids[index], positions[index], caches, meta, slots[index], unpack=index,
                              padded_rows=padded)
    top, argmax = head(hidden)
    top_full = top.new_zeros(padded).index_copy_(0, index, top)
    argmax_full = torch.full((padded,), -1, dtype=argmax.dtype, device=argmax.device).index_copy_(0, index, argmax)
    captured_full = None
    if captured is not None:
        captured_full = captured.new_zeros((padded, captured.shape[1])).index_copy_(0, index, captured)
    verdict = block_verdicts(ids, verify_positions(positions, lengths, q_len), top_full, argmax_full, q_len)
    return PackedVerify(lengths, index, hidden, captured_full, top_full, argmax_full, verdict)
