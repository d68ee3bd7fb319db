"""A request's verify history: what its last verify with drafts did (none yet, rejected after j accepted
drafts, or all accepted), the class the survival fit keeps a bias for (``runtime.spec.confidence``, point 5)."""

from __future__ import annotations

import numpy as np


# a request's verify history (point 5 of the module doc): what its last verify with drafts did
HISTORY_NONE = 0  # no verify with drafts yet


def history_classes(max_draft_len: int) -> list[str]:
    """The verify-history classes of an engine drafting up to K drafts, in index order (2K + 1): ``none``, then
    ``rejected_at_j`` (its last verify accepted j drafts and rejected the next), then ``accepted_n`` (it accepted
    all n drafts it verified: it survives at least n)."""
    k = max_draft_len
    return ["none"] + [f"rejected_at_{j}" for j in range(k)] + [f"accepted_{n}" for n in range(1, k + 1)]


def next_history(history: int, verified: int, accepted: int, max_draft_len: int) -> int:
    """A request's class after a verify of ``verified`` drafts of which it accepted ``accepted`` (-1: unknown):
    unchanged where it verified none (or the outcome is unknown); ``rejected_at_{accepted}`` where it rejected one,
    else ``accepted_{verified}``. The device applies the same rule to a packed step it launches ahead
    (``runtime.worker.packed_verify.history_after``)."""
    if verified <= 0 or accepted < 0:
        return history
    if accepted < verified:
        return 1 + min(accepted, max_draft_len - 1)
    return max_draft_len + min(verified, max_draft_len)


def history_rows(history, num: int, classes: int) -> np.ndarray:
    """[S] int64 classes, each below ``classes`` (None: every request ``HISTORY_NONE``)."""
    if history is None:
        return np.zeros(num, dtype=np.int64)
    rows = np.asarray(history, dtype=np.int64).reshape(-1)
    if rows.shape[0] != num or (rows.size and (rows.min() < 0 or rows.max() >= classes)):
        raise bad_history(history, num, classes)
    return rows


def history_list(history, num: int, classes: int) -> list[int]:
    """``history_rows`` in plain Python (a small step: no numpy calls, see the module doc)."""
    if history is None:
        return [HISTORY_NONE] * num
    rows = list(history)
    if len(rows) != num or any(not 0 <= h < classes for h in rows):
        raise bad_history(history, num, classes)
    return rows


def bad_history(history, num: int, classes: int) -> ValueError:
    return ValueError(f"confidence scheduling: {num} verify-history classes in 0..{classes - 1} expected, got "
                      f"{history!r}")
