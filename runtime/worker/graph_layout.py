"""The host side of graphed steps (``runtime.worker.graphs``): which graph serves a step, how its requests are laid out in
that graph's input buffers and attention layout, and the layout of the step expected to follow it (planned or
launched ahead), with the records of steps launched ahead and how a scheduled step is matched to one.

Host work only (numpy and plain data): the graphs themselves need CUDA, their layout is checked on the CPU
(``tests/runtime/test_graph_layout.py``, ``tests/runtime/test_run_ahead.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.kernels.interface import HostLayout
from runtime.scheduling.step_io import ScheduledRequest

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Padding a ragged step to a graph pays while the step stays memory-bound: up to this many tokens in all, or up to
# PAD_RATIO times the real tokens (an eager step launches every kernel from the host, ~10x a graph's replay time
# on small batches; a padded token costs at most its share of compute).
PAD_FREE_TOKENS = 128
PAD_RATIO = 1.5
# Tokens per request of the prefill graphs (each within PAD_RATIO of the next: a chunk pads by at most 1.5x), and
# the most tokens one of them holds (batch x Q): a graph's LM head computes every row, so larger ones run eagerly.
PREFILL_Q_LENS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_GRAPH_TOKENS = 512


def worth_padding(real_tokens: int, padded_tokens: int) -> bool:
    """Whether a step of ``real_tokens`` fed tokens should replay a graph of ``padded_tokens``."""
    return padded_tokens <= max(PAD_FREE_TOKENS, PAD_RATIO * real_tokens)


VECTORIZE_FROM = 16  # requests from which numpy lays a step out faster than a loop over its tokens


def graph_inputs(reqs: list[ScheduledRequest], batch: int, q_len: int, page_size: int, scratch_page: int,
                 vectorized: bool | None = None) -> tuple[np.ndarray, HostLayout]:
    """-> ([3, batch * q_len] token ids, positions, slots; the attention layout) of a step whose requests are each
    padded to ``q_len`` tokens and whose batch is padded to ``batch`` requests.

    A request's padding tokens (token 0 at its last position) follow its real ones and write the scratch page; its
    key range grows by as many keys, the pages past its own being the scratch page. Causal attention keeps those
    keys from every real row (row i sees the keys up to its own position), so real rows are unchanged. Padding
    requests feed token 0 at positions 0..Q-1 into the scratch page. From ``VECTORIZE_FROM`` requests on (or as
    ``vectorized`` says) the per-token arithmetic runs in numpy; below, a loop over the tokens is cheaper than
    numpy's per-call cost (measured on the host: 0.014 vs 0.039 ms at 1 request, 0.25 vs 0.15 ms at 64)."""
    ps, num, pad = page_size, len(reqs), batch - len(reqs)
    kv_lens = [r.start_position + q_len for r in reqs]  # each request's keys, its padding included
    pages = [r.page_ids[:-(-kv // ps)] + [scratch_page] * max(0, -(-kv // ps) - len(r.page_ids))
             for r, kv in zip(reqs, kv_lens)]
    layout = HostLayout([q_len] * batch, kv_lens + [q_len] * pad, pages + [[scratch_page] * -(-q_len // ps)] * pad)
    if not (num >= VECTORIZE_FROM if vectorized is None else vectorized):
        ids, positions, slots = [], [], []
        for r in reqs:
            short = q_len - len(r.token_ids)
            ids += r.token_ids + [0] * short
            for pos in range(r.start_position, r.end_position):
                positions.append(pos)
                slots.append(r.page_ids[pos // ps] * ps + pos % ps)
            positions += [r.end_position - 1] * short
            slots += [scratch_page * ps + i % ps for i in range(short)]
        ids += [0] * (pad * q_len)
        positions += list(range(q_len)) * pad
        slots += [scratch_page * ps + i % ps for i in range(q_len)] * pad
        return np.array([ids, positions, slots], dtype=np.int64), layout
    col = np.arange(q_len)  # [Q]
    starts = np.fromiter((r.start_position for r in reqs), np.int64, num)  # [B']
    fed = np.fromiter((len(r.token_ids) for r in reqs), np.int64, num)
    span = (q_len - 1) // ps + 2  # pages a run of q_len positions can touch
    under = np.array([(r.page_ids[r.start_position // ps:r.start_position // ps + span] + [scratch_page] * span)[:span]
                      for r in reqs], dtype=np.int64).reshape(num, span)  # [B', span] the pages under the step
    position = starts[:, None] + col[None, :]  # [B', Q]
    real = col[None, :] < fed[:, None]
    page = np.take_along_axis(under, np.minimum(position // ps - (starts // ps)[:, None], span - 1), axis=1)
    inputs = np.zeros((3, batch, q_len), dtype=np.int64)
    if (fed == q_len).all():  # the usual step: every request feeds a full block
        inputs[0, :num] = [r.token_ids for r in reqs]
    else:
        for i, r in enumerate(reqs):
            inputs[0, i, :len(r.token_ids)] = r.token_ids
    inputs[1, :num] = np.where(real, position, (starts + fed - 1)[:, None])
    inputs[2, :num] = np.where(real, page * ps + position % ps,
                               scratch_page * ps + (col[None, :] - fed[:, None]) % ps)
    inputs[1, num:] = col
    inputs[2, num:] = scratch_page * ps + col % ps
    return inputs.reshape(3, batch * q_len), layout


def graphed_q_len(fed: list[int], q_lens: list[int], max_batch: int, prefill_q_lens: list[int] | tuple = (),
                  prefill_tokens: int = 0) -> int | None:
    """Q if a graph serves a step whose requests feed ``fed`` tokens each (a bucket up to ``max_batch`` holds them,
    Q is the smallest captured length that holds the longest: one of ``q_lens``, captured at every bucket, or of
    ``prefill_q_lens`` where the bucket x Q is at most ``prefill_tokens``; and padding the others to Q is
    ``worth_padding``), else None (the step runs eagerly). Such a step feeds len(fed) x Q tokens to the model."""
    if not fed or len(fed) > max_batch:
        return None
    longest = max(fed)
    q_len = next((q for q in sorted(q_lens) if q >= longest), None)
    if q_len is None and prefill_q_lens:
        bucket = bucket_of(batch_buckets(max_batch), len(fed))
        q_len = next((q for q in sorted(prefill_q_lens) if q >= longest and bucket * q <= prefill_tokens), None)
    if q_len is None or not worth_padding(sum(fed), q_len * len(fed)):
        return None
    return q_len


def next_decode_layout(layout: HostLayout, page_ids: list[list[int]], page_size: int) -> HostLayout | None:
    """The attention layout of the decode step after a one-token step of ``layout`` whose first ``len(page_ids)``
    requests (the real ones; their page lists as the scheduler holds them) each decode one token more, or None when
    a request's pages do not cover its next key yet. Padding requests keep their layout."""
    real = len(page_ids)
    kv = [k + 1 for k in layout.kv_lens[:real]]
    pages = []
    for k, own in zip(kv, page_ids):
        need = -(-k // page_size)
        if need > len(own):
            return None
        pages.append(own[:need])
    return HostLayout(layout.qo_lens, kv + layout.kv_lens[real:], pages + layout.page_ids[real:])


def next_anchor_position(r: ScheduledRequest, accepted: int) -> int:
    """Where the token ``r``'s step commits last sits (the next step's anchor): after its ``accepted`` drafts, or
    after its chunk for a prefill."""
    return r.end_position - r.num_drafts + accepted


def next_verify_layout(reqs: list[ScheduledRequest], accepted: list[int], q_len: int, next_q_len: int, batch: int,
                       page_size: int, scratch_page: int) -> HostLayout | None:
    """The attention layout ``graph_inputs`` will give the verify step after a ``q_len``-token step of ``reqs``
    (padded to ``batch`` requests) that accepted ``accepted`` drafts each, if every request then verifies a block
    of ``next_q_len`` tokens from the position of its last committed token (``next_anchor_position``), on the
    pages it holds now (the scheduler allots them a block ahead, ``Scheduler.lookahead``); None when a count is not
    a valid one (a faulted row)."""
    kv, pages = [], []
    for r, a in zip(reqs, accepted):
        if not 0 <= a <= r.num_drafts or len(r.token_ids) > q_len:
            return None
        k = next_anchor_position(r, a) + next_q_len
        need = -(-k // page_size)
        pages.append(r.page_ids[:need] + [scratch_page] * max(0, need - len(r.page_ids)))
        kv.append(k)
    pad = batch - len(reqs)
    return HostLayout([next_q_len] * batch, kv + [next_q_len] * pad,
                      pages + [[scratch_page] * -(-next_q_len // page_size)] * pad)


def faster_lengths(times: dict[tuple[int, int], float], by: float) -> dict[tuple[int, int], int]:
    """{(batch, Q): a graph's replay ms} -> {(batch, Q): the longer Q' at that batch whose graph replays fastest},
    where that one is more than ``by`` (a fraction) faster than Q's own; lengths no longer graph beats are left out."""
    faster = {}
    for (batch, q_len), ms in times.items():
        longer = [(other_ms, q) for (b, q), other_ms in times.items() if b == batch and q > q_len]
        if longer and min(longer)[0] < (1 - by) * ms:
            faster[(batch, q_len)] = min(longer)[1]
    return faster


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: the defaults below ``max_batch``, then ``max_batch``."""
    return [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]


def bucket_of(buckets: list[int], num: int) -> int | None:
    """The bucket (ascending ``buckets``) whose graphs serve a step of ``num`` requests: the smallest holding them;
    None when none does."""
    return next((b for b in buckets if b >= num), None)



@dataclass
class LaunchedDecode:
    """A plain greedy decode step launched before the engine scheduled it (``GraphedTargetForward.decode_greedy``)."""

    request_ids: tuple[str, ...]
    positions: tuple[int, ...]  # each request's position in it (where its one token sits)
    layout: HostLayout  # its attention layout (pages as the scheduler allotted them a token ahead)
    inputs: np.ndarray  # [3, batch] its host inputs (the ids row is stale: the ids were copied on the device)
    slot: int  # its read-back row in the pinned buffer
    appended: bool = False  # the drafter's context append followed it
    tokens: tuple[int, ...] = ()  # the tokens it feeds: the verdicts of the step before it, once read back

    def matches(self, reqs: list[ScheduledRequest], appended: bool = False) -> bool:
        """Whether ``reqs`` is exactly this step: the same requests in order, each feeding its token at its
        position on the same pages, its drafter context appended as ``appended`` says."""
        if not len(reqs) == len(self.request_ids) == len(self.tokens) or appended != self.appended:
            return False  # (tokens: set once the step before is read)
        for r, rid, pos, token, pages in zip(reqs, self.request_ids, self.positions, self.tokens,
                                             self.layout.page_ids):
            if r.request_id != rid or r.start_position != pos or r.token_ids != [token] \
                    or r.page_ids[:len(pages)] != pages:
                return False
        return True


@dataclass
class LaunchedVerify:
    """A DSpark verify step launched before the engine scheduled it (``GraphedTargetForward.launch_verify_ahead``):
    each request verifying a full block from the position after its last committed token."""

    request_ids: tuple[str, ...]
    starts: tuple[int, ...]  # each request's first position in it (its anchor's)
    q_len: int
    layout: HostLayout  # its attention layout (each request's pages under it first)
    appended: bool  # the drafter's context graph was replayed after it
    tokens: tuple[tuple[int, ...] | None, ...] = ()  # what each request feeds (anchor, drafts), once read back
    columns: int = 0  # a packed verify of these columns (runtime.worker.packed_verify; 0: the uniform graph)
    fed: int = 0  # the tokens each request feeds (anchor and drafts), padded to q_len where a longer graph serves
    # them (GraphedTargetForward.served_by); 0: q_len

    def __post_init__(self):
        self.fed = self.fed or self.q_len

    def matches(self, reqs: list[ScheduledRequest], append_context: bool) -> bool:
        """Whether ``reqs`` is exactly this step: the same requests in order, each feeding the tokens it was fed
        (its anchor and drafts) at the same positions on the same pages, and the same context append."""
        if not len(reqs) == len(self.request_ids) == len(self.tokens) or append_context != self.appended:
            return False
        for r, rid, start, tokens, pages in zip(reqs, self.request_ids, self.starts, self.tokens,
                                                self.layout.page_ids):
            if r.request_id != rid or r.start_position != start or tokens is None or tuple(r.token_ids) != tokens \
                    or r.num_drafts != self.fed - 1 or r.page_ids[:len(pages)] != pages:
                return False
        return True
