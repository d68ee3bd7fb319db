"""Verification of a draft block against the target (pure functions over padded tensors).

Shapes: B requests, K = the longest block in the batch, V vocabulary. Row ``r`` of the target
distributions predicts the token after input ``r`` (input 0 is the anchor, input ``r`` draft ``r``).
A request with ``k < K`` drafts has padding past ``k`` that never counts.
"""

from __future__ import annotations

import torch


def accept_by_match(drafts: torch.Tensor, num_drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Accept drafts while each equals the target's own token at its position.

    drafts [B, K], num_drafts [B], target_tokens [B, K+1] (argmax, or the target's own sample) ->
    accepted [B]. The committed tokens are ``target_tokens[:, :accepted+1]``: accepted drafts equal
    the target's tokens, and the next one is the correction or the bonus.
    """
    k = drafts.shape[1]
    in_block = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (drafts == target_tokens[:, :k]) & in_block
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_verdicts(top: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """Plain greedy decoding's answer per row: max logit [R] and its argmax [R] -> the argmax, or -1 where the max is
    NaN or infinite (the row's logits are broken: its request fails alone). int64 [R]."""
    return torch.where(torch.isfinite(top), argmax, -1)


def block_verdicts(input_ids: torch.Tensor, positions: torch.Tensor, top: torch.Tensor, argmax: torch.Tensor,
                   q_len: int) -> torch.Tensor:
    """Greedy verification of a uniform step on the device (what a verify graph computes after its LM head): B
    requests of ``q_len`` fed rows each, ``[anchor, d_1..d_k]`` then padding that repeats the last position.

    input_ids, positions [B*Q]; top (max logit), argmax [B*Q] -> int64 [B, Q + 2]: each row's argmax (the committed
    candidates), the accepted draft count (``accept_by_match`` with the drafts read from the fed tokens, their
    number from the positions), and 1 where a verified row (anchor and drafts) has a NaN or infinite max logit.
    The same answer as ``commit_by_match`` and the runner's fault check on those rows, for requests whose fed
    tokens are their anchor and drafts (not a prefill chunk)."""
    ids, pos = input_ids.view(-1, q_len), positions.view(-1, q_len)
    arg = argmax.view(-1, q_len).to(torch.int64)
    num_drafts = (pos[:, 1:] > pos[:, :-1]).sum(dim=1)  # [B]: padding repeats the last real position
    accepted = accept_by_match(ids[:, 1:], num_drafts, arg)
    verified = torch.arange(q_len, device=ids.device)[None, :] <= num_drafts[:, None]
    faulty = (~torch.isfinite(top.view(-1, q_len)) & verified).any(dim=1)
    return torch.cat([arg, accepted[:, None], faulty[:, None].to(torch.int64)], dim=1)


def commit_by_match(drafts: torch.Tensor, num_drafts: torch.Tensor,
                    target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy / exact-match verification -> (committed [B, K+1], accepted [B]); see ``accept_by_match``."""
    return target_tokens, accept_by_match(drafts, num_drafts, target_tokens)


def accept_by_rejection(drafts: torch.Tensor, num_drafts: torch.Tensor, target_probs: torch.Tensor,
                        draft_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Leviathan et al.: accept draft ``j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``, in order.

    drafts [B, K], num_drafts [B], target_probs p [B, K+1, V], draft_probs q [B, K, V] (the
    distributions the drafts were drawn from), uniforms [B, K] in (0, 1) -> accepted [B].
    """
    k = drafts.shape[1]
    p = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, K]
    q = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    in_block = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    accept = (uniforms * q < p) & in_block
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` per row [R, V]; ``p`` itself where the residual has no mass (p == q)."""
    residual = (target_probs - draft_probs).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 1e-8, residual, target_probs)
    return residual / residual.sum(-1, keepdim=True)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...], index [B] -> x[b, index[b]] as [B, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), index]
