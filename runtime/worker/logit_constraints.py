"""A request's own constraints on its rows' logits, applied in one batched write each for the step: logit bias
and allowed tokens, banned tokens (stop tokens before ``min_tokens``, the tokens that would complete a bad word),
and a structured output's grammar masks."""

from __future__ import annotations

import numpy as np
import torch

from runtime.kernels.transfer import to_device
from runtime.sampling.grammar import unpack_masks
from runtime.scheduling.step_io import ScheduledRequest


def logit_bias_rows(entries: list[ScheduledRequest], vocab: int, device: torch.device) -> torch.Tensor:
    """[S, V] float32: each entry's ``SamplingParams.logit_bias`` at its tokens, 0 elsewhere; with
    ``allowed_token_ids``, -inf at every token not listed."""
    rows, tokens, values = [], [], []
    for i, e in enumerate(entries):
        for token, value in e.params.logit_bias:
            rows.append(i)
            tokens.append(token)
            values.append(value)
    bias = torch.zeros(len(entries), vocab, device=device)
    if rows:
        bias[to_device(rows, device, torch.int64), to_device(tokens, device, torch.int64)] = to_device(
            values, device, torch.float32)
    limited = [(i, e.params.allowed_token_ids) for i, e in enumerate(entries) if e.params.allowed_token_ids]
    if limited:
        keep = torch.zeros(len(entries), vocab, dtype=torch.bool, device=device)
        at = ([i for i, ids in limited for _ in ids], [t for _, ids in limited for t in ids])
        keep[tuple(to_device(x, device, torch.int64) for x in at)] = True
        listed = to_device([i for i, _ in limited], device, torch.int64)
        bias[listed] = bias[listed].masked_fill(~keep[listed], float("-inf"))
    return bias


def ban_tokens(logits: torch.Tensor, entries: list[ScheduledRequest]) -> torch.Tensor:
    """logits [S, K+1, V] float32 with -inf at each entry's banned tokens: the stop tokens in its first banned rows
    (``ScheduledRequest.banned``: min_tokens not reached) and the tokens that would complete a bad word at each row
    (``ScheduledRequest.row_bans``)."""
    at = ([], [], [])  # (entry, row, token) of every banned logit: one index_put for the step, not one per entry
    for i, e in enumerate(entries):
        if e.banned is not None:
            rows, ids = e.banned
            for r in range(min(rows, logits.shape[1])):
                at[0].extend([i] * len(ids))
                at[1].extend([r] * len(ids))
                at[2].extend(ids)
        if e.row_bans is not None:
            for r, ids in enumerate(e.row_bans[:logits.shape[1]]):
                at[0].extend([i] * len(ids))
                at[1].extend([r] * len(ids))
                at[2].extend(ids)
    if at[0]:
        logits[tuple(to_device(x, logits.device, torch.int64) for x in at)] = float("-inf")
    return logits


def mask_by_grammar(logits: torch.Tensor, entries: list[ScheduledRequest]) -> torch.Tensor:
    """logits [S, K+1, V] float32 with -inf where each structured entry's grammar refuses a token, at the rows its
    ``token_mask`` covers (``runtime.sampling.grammar``): one host-to-device copy and one masked write for the step."""
    owners, rows, words = [], [], []
    for i, e in enumerate(entries):
        if e.token_mask is not None:
            n = min(len(e.token_mask), logits.shape[1])
            owners.extend([i] * n)
            rows.extend(range(n))
            words.append(e.token_mask[:n])
    if not owners:
        return logits
    allowed = unpack_masks(torch.from_numpy(np.concatenate(words)).to(logits.device), logits.shape[-1])  # [R, V]
    at = (to_device(owners, logits.device, torch.int64), to_device(rows, logits.device, torch.int64))
    logits[at] = logits[at].masked_fill(~allowed, float("-inf"))
    return logits
