"""Training blocks (DeepSpec): random anchors on supervised tokens, every non-anchor slot MASK.

For a sequence of length L and anchors a_1 < ... < a_A, block i holds slots a_i .. a_i+B-1: slot j is
fed MASK (the anchor token at j = 0) and predicts the token at a_i + 1 + j. Its queries see the context
keys strictly before a_i and every slot of their own block (bidirectional).
"""

from __future__ import annotations

import torch


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [N, L] -> anchors [N, A] (sorted, 0 where unused) and keep [N, A].

    A position is a candidate when it and the next token are both supervised.
    """
    n, length = loss_mask.shape
    valid = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)  # [N, L-1]
    scores = torch.rand(valid.shape, generator=generator, device=loss_mask.device)
    scores = torch.where(valid, scores, torch.full_like(scores, 2.0))
    picked = scores.argsort(dim=1)[:, :num_anchors]  # [N, A'] random valid candidates first
    keep = valid.gather(1, picked)
    anchors = torch.where(keep, picked, torch.full_like(picked, length))
    anchors, order = anchors.sort(dim=1)
    keep = keep.gather(1, order)
    if anchors.shape[1] < num_anchors:
        pad = num_anchors - anchors.shape[1]
        anchors = torch.cat([anchors, anchors.new_full((n, pad), length)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(n, pad)], dim=1)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> block token ids [N, A*B] ([anchor, MASK...] per block) and their positions [N, A*B]."""
    n, a = anchors.shape
    ids = torch.full((n, a, block), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = torch.where(keep, input_ids.gather(1, anchors), torch.full_like(anchors, mask_token_id))
    positions = anchors[..., None] + torch.arange(block, device=anchors.device)
    return ids.view(n, a * block), positions.view(n, a * block)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                 block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> labels [N, A, B] (token at anchor+1+j), the target-logit index of each slot [N, A, B] (anchor+j),
    and the evaluation mask [N, A, B]: a contiguous supervised prefix inside the sequence."""
    length = input_ids.shape[1]
    label_at = anchors[..., None] + 1 + torch.arange(block, device=anchors.device)  # [N, A, B]
    inside = label_at < length
    safe = label_at.clamp(max=length - 1)
    labels = input_ids[:, None, :].expand(-1, anchors.shape[1], -1).gather(2, safe)
    supervised = loss_mask[:, None, :].expand(-1, anchors.shape[1], -1).gather(2, safe) > 0
    mask = (inside & supervised & keep[..., None]).to(torch.int64).cumprod(dim=-1).bool()
    return labels, safe - 1, mask


def attention_mask(anchors: torch.Tensor, keep: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """-> [N, 1, A*B, L + A*B] bool: context keys before the block's anchor, and the block's own slots."""
    n, a = anchors.shape
    key_pos = torch.arange(length, device=anchors.device)
    ctx = key_pos[None, None, :] < anchors[..., None]  # [N, A, L]
    ctx = ctx[:, :, None, :].expand(n, a, block, length).reshape(n, a * block, length)
    ctx = ctx & keep.repeat_interleave(block, dim=1)[..., None]  # unused blocks see only their own slots
    block_of = torch.arange(a * block, device=anchors.device) // block
    own = (block_of[:, None] == block_of[None, :])[None].expand(n, -1, -1)  # [N, AB, AB]
    return torch.cat([ctx, own], dim=2)[:, None]
