"""From target logits to the distribution a request samples from, row by row (pure functions).

The same functions serve plain decoding and verification, so a verified block sees exactly the
distributions plain decoding would: penalties (with occurrence counts that include the drafts
before each row), then temperature, then top-k / top-p / min-p, each judged on the tempered
distribution, then renormalization. Greedy rows (``SamplingParams.greedy``: temperature below 1e-5)
are one-hot at the argmax of the penalized logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels.transfer import to_device
from runtime.sampling.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RowParams:
    """Per-row sampling settings as tensors, all [R]."""

    temperature: torch.Tensor  # float32, 0 for greedy rows
    top_k: torch.Tensor  # int64, vocab size when disabled
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    repetition: torch.Tensor  # float32
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32

    @staticmethod
    def build(params: list[SamplingParams], vocab_size: int, device: torch.device) -> RowParams:
        def col(values, dtype=torch.float32):
            return to_device(values, device, dtype)

        return RowParams(
            temperature=col([0.0 if p.greedy else p.temperature for p in params]),
            top_k=col([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64),
            top_p=col([p.top_p for p in params]),
            min_p=col([p.min_p for p in params]),
            repetition=col([p.repetition_penalty for p in params]),
            presence=col([p.presence_penalty for p in params]),
            frequency=col([p.frequency_penalty for p in params]),
        )


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, seen: torch.Tensor,
                    rows: RowParams) -> torch.Tensor:
    # logits, output_counts: [R, V] float; seen: [R, V] bool (prompt or output) -> [R, V]
    rep = rows.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - rows.frequency[:, None] * output_counts - rows.presence[:, None] * (output_counts > 0)


def filtered_probs(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """[R, V] float32 logits -> [R, V] probabilities each row samples from."""
    greedy = rows.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep_sorted = (rank < rows.top_k[:, None]) & (sorted_probs.cumsum(-1) - sorted_probs < rows.top_p[:, None])
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    keep &= probs >= rows.min_p[:, None] * sorted_probs[:, :1]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def occurrence_counts(histories: list[tuple[list[int], list[int]] | None], vocab_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: output-token counts [N, V] float32 and the seen mask (prompt or output) [N, V]."""
    counts = torch.zeros(len(histories), vocab_size, device=device)
    seen = torch.zeros(len(histories), vocab_size, dtype=torch.bool, device=device)
    for i, history in enumerate(histories):
        if history is None:
            continue
        prompt, output = history
        if output:
            counts[i].index_add_(0, to_device(output, device), torch.ones(len(output), device=device))
        if prompt:
            seen[i, to_device(prompt, device)] = True
    return counts, seen | (counts > 0)
