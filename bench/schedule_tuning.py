"""``draft_len_schedule`` from measurement: at each measured concurrency, the draft length with the most tokens/s.

Tokens per second at concurrency ``c`` with draft length ``k`` (``k = 0``: autoregressive) is
``c * tau(c, k) / step_ms(c, k)``: ``step_ms`` measured by ``dspark bench``, ``tau`` the tokens a request commits
per step, measured on a trained pair or, for random-weight shapes, projected from a trained pair's per-position
acceptance (``1 + a_1 + ... + a_k``, ``a_i`` the share of blocks whose first i drafts were accepted).

A length other than ``max_draft_len`` (the untuned engine's) is chosen at a concurrency only where it measures more
than ``MARGIN`` (2%) faster: candidates are timed in rounds a few percent apart, and a closer win is noise (one run
chose 5 drafts at 256 requests on a 0.5% margin, and in the sweep that schedule lost 6% to 7 drafts).

The schedule is written in the engine's own format (``DSparkDecodingConfig.draft_len_schedule``: keys are
batch-size upper bounds, above the largest key 0): each measured concurrency maps to its best length, equal
neighbours merge into the larger key, and trailing zeros are dropped (0 is the default above the last key). The
smallest key must map to ``max_draft_len`` (the engine's rule). When the best length at the smallest concurrency
is another one, ``schedule_from`` refuses, and ``accepted_schedule`` gives the best schedule the engine accepts:
``max_draft_len`` there, the best lengths elsewhere, with the finding (what that costs at that concurrency, and
that a drafter trained for the shorter block would serve it better) for the record.
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.02  # how much faster than max_draft_len another length must measure to enter the schedule


def projected_tau(acceptance_per_position: list[float], k: int) -> float:
    """Tokens a request commits per step when drafting ``k`` tokens: 1 + the first k acceptance rates."""
    if k > len(acceptance_per_position):
        raise ValueError(f"acceptance is known for {len(acceptance_per_position)} positions, not {k}")
    return 1.0 + sum(acceptance_per_position[:k])


@dataclass(frozen=True)
class Candidate:
    concurrency: int
    draft_len: int
    step_ms: float
    tau: float

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.concurrency * self.tau / self.step_ms


def best_draft_lengths(candidates: list[Candidate], margin: float = MARGIN) -> dict[int, Candidate]:
    """Per concurrency, the candidate with the most tokens/s (ties: the shorter draft); but the longest length
    measured there (``max_draft_len``, the untuned engine's) stays unless another beats it by more than ``margin``
    (see the module docstring)."""
    best: dict[int, Candidate] = {}
    for c in sorted(candidates, key=lambda c: (c.concurrency, c.draft_len)):
        if c.concurrency not in best or c.tokens_per_s > best[c.concurrency].tokens_per_s:
            best[c.concurrency] = c
    for concurrency, fastest in best.items():
        default = max((c for c in candidates if c.concurrency == concurrency), key=lambda c: c.draft_len)
        if fastest.tokens_per_s <= (1 + margin) * default.tokens_per_s:
            best[concurrency] = default
    return best


def schedule_from(best: dict[int, int], max_draft_len: int) -> dict[int, int]:
    """{concurrency: best draft length} -> the engine's ``draft_len_schedule`` (see the module docstring)."""
    keys = sorted(best)
    if not keys:
        raise ValueError("no measured concurrency to tune from")
    if best[keys[0]] != max_draft_len:
        raise ValueError(f"at concurrency {keys[0]} the fastest draft length is {best[keys[0]]}, not max_draft_len="
                         f"{max_draft_len}: the engine's schedule must start at max_draft_len, so serve this pair "
                         f"with max_draft_len={best[keys[0]]} (a drafter trained for that block) instead")
    merged = {k: best[k] for i, k in enumerate(keys) if i + 1 == len(keys) or best[keys[i + 1]] != best[k]}
    while len(merged) > 1 and merged[max(merged)] == 0:
        del merged[max(merged)]
    return merged


def accepted_schedule(best: dict[int, Candidate], candidates: list[Candidate],
                      max_draft_len: int) -> tuple[dict[int, int], str | None]:
    """The best ``draft_len_schedule`` the engine accepts -> (schedule, None), or, when the fastest length at the
    smallest concurrency is not ``max_draft_len``, (the schedule with ``max_draft_len`` there, the finding: the
    tokens/s that costs at that concurrency, from ``candidates``)."""
    lengths = {c: b.draft_len for c, b in best.items()}
    first = min(lengths)
    if lengths[first] == max_draft_len:
        return schedule_from(lengths, max_draft_len), None
    forced = next((c for c in candidates if c.concurrency == first and c.draft_len == max_draft_len), None)
    cost = f" ({forced.tokens_per_s / best[first].tokens_per_s:.2f}x its tokens/s)" if forced is not None else ""
    better = "decoding without a drafter" if lengths[first] == 0 else \
        f"a drafter trained for a block of {lengths[first]}"
    finding = (f"at concurrency {first} the fastest draft length is {lengths[first]}, but a schedule starts at "
               f"max_draft_len={max_draft_len}, which this schedule uses there{cost}; {better} would serve that "
               f"load better")
    return schedule_from({**lengths, first: max_draft_len}, max_draft_len), finding
