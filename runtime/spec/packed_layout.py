"""The packed layout's choice of drafts (``runtime.worker.packed_verify`` runs it on the device): the drafts of highest
survival over a step, and how long a block to draft for a packed step."""

from __future__ import annotations

import numpy as np


def packed_draft_len(survival: np.ndarray, sizes: list[int], columns: int, max_draft_len: int) -> int | None:
    """How long a block the engine drafts for a packed step of ``columns`` columns, chosen (as ``columns``) before
    that block exists: from this step's ``survival`` [S, k] of blocks of ``sizes`` [S] drafts, the drafts the device
    would pick at those columns (``top_drafts``: the top ``S x columns`` survivals, as ``select_lengths`` ranks
    them), one past the longest share a request took; None (the whole block) for ``columns`` of whole blocks. A draft
    past the block proposes nothing (confidence 0, survival 0): the device never picks one while ``columns`` is
    shorter than the block, which it is (the longest share is at least the mean, ``columns``). So the block grows
    by one a step while some request takes all of it, and shrinks as soon as none does: on a pair whose acceptance
    falls along the block (0.55 / 0.17 / 0.15 ... at 64 requests) the packed steps stop drafting the
    positions no verify reaches, which cost the drafter as much as the ones it does (a block of 7 at 64 requests:
    0.9 ms of the drafter's beside a 6.7-ms trimmed step on an H200)."""
    num, k = survival.shape
    if columns >= max_draft_len or num == 0 or k == 0:
        return None
    if columns <= 0:
        return 1  # (nothing verified next step: the first draft keeps that position's confidence in view)
    proposed = np.arange(k)[None, :] < np.asarray(sizes)[:, None]  # [S, k]
    shares = top_drafts(survival, proposed, min(num * columns, int(proposed.sum())))
    return min(max_draft_len, int(shares.max()) + 1)


def top_drafts(survival: np.ndarray, proposed: np.ndarray, budget: int) -> np.ndarray:
    """The lengths [S] that verify the ``budget`` proposed drafts of highest survival (ties: the earlier position,
    then the earlier request), each request's a prefix of its block."""
    survival, proposed = np.asarray(survival, dtype=np.float64), np.asarray(proposed, dtype=bool)
    num = survival.shape[0]
    # position-major order (all first drafts, then all second drafts, ...), then a stable sort by survival
    values = np.where(proposed, survival, -1.0).T.reshape(-1)
    order = np.argsort(-values, kind="stable")[:budget]
    return np.bincount(order % num, minlength=num).astype(np.int64)
