"""Structured requests' token masks computed off the engine's thread, so that a grammar slow to mask delays only
its own request.

Each structured request has at most one mask job at a time on a small thread pool: the rows of its next step
(``GrammarBackend.row_masks``) for the tokens it has committed and the drafts it holds. xgrammar releases the GIL
while it fills a mask, so the jobs run beside the engine's own work. The engine asks for the jobs as soon as a step
has committed (``prepare``), waits a bounded time before it schedules the next step (``not_ready``) and passes over
the requests whose rows are not ready yet: they join a later step, the others go on.

Invariant: while a request's job runs, the job alone touches the request's matcher. The engine schedules a request
(and so commits tokens to its matcher) only once its rows are ready, and a new job starts only when the last one is
done.
"""

from __future__ import annotations

import concurrent.futures as futures
from typing import Iterable

import numpy as np

from runtime.scheduling.sequence import Sequence

# The longest a step waits for rows still being computed: a grammar whose rows take longer makes its request sit out
# steps (it runs about every other step of the others), never the others wait on it.
STEP_WAIT_S = 0.001
# While only requests whose rows are being computed could run, a step waits for the first of them up to this long
# (then returns with nothing done, so that the engine's loop can take new requests and aborts).
IDLE_WAIT_S = 0.05
# Mask jobs running at once: requests with slow grammars each hold one worker; the others still find a free one.
WORKERS = 8


def _key(seq: Sequence) -> tuple[int, tuple[int, ...]]:
    """What a request's rows depend on: its committed length and the drafts it holds."""
    return seq.num_tokens, tuple(seq.draft_ids)


def _fits(key: tuple[int, tuple[int, ...]], seq: Sequence) -> bool:
    """Whether rows computed for ``key`` serve ``seq`` now: the same committed tokens, and its drafts a prefix of
    those the rows were computed for (a step verifying fewer drafts takes the first rows: row r depends only on the
    first r drafts)."""
    committed, drafts = key
    return committed == seq.num_tokens and drafts[:len(seq.draft_ids)] == tuple(seq.draft_ids)


class GrammarMaskJobs:
    """The mask jobs of an engine's structured requests (see the module docstring). Engine thread only."""

    def __init__(self, backend, workers: int = WORKERS):
        """``backend``: a ``GrammarBackend`` (``row_masks(matcher, drafts)`` -> [1 + len(drafts), words] int32)."""
        self.backend = backend
        self._pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="dspark-grammar-masks")
        # request id -> (the key its rows are computed for, the job)
        self._jobs: dict[str, tuple[tuple[int, tuple[int, ...]], futures.Future]] = {}

    def prepare(self, seq: Sequence) -> None:
        """Start computing ``seq``'s next rows unless a job already serves its state or is still running (a running
        job owns the matcher: its successor starts once it is done, at the next ``prepare`` or ``not_ready``)."""
        job = self._jobs.get(seq.request_id)
        if job is not None and (not job[1].done() or _fits(job[0], seq)):
            return
        drafts = list(seq.draft_ids)
        self._jobs[seq.request_id] = (_key(seq), self._pool.submit(self.backend.row_masks, seq.grammar, drafts))

    def not_ready(self, seqs: list[Sequence], wait_s: float, first: bool = False) -> set[str]:
        """The ids of ``seqs`` whose rows for their present state are not ready after waiting at most ``wait_s``
        (``first``: only until one of them is ready). Starts the jobs that are missing."""
        waiting = {}
        for seq in seqs:
            self.prepare(seq)
            key, job = self._jobs[seq.request_id]
            if not job.done() or not _fits(key, seq):
                waiting[seq.request_id] = job
        if waiting and wait_s > 0:
            futures.wait(waiting.values(), timeout=wait_s,
                         return_when=futures.FIRST_COMPLETED if first else futures.ALL_COMPLETED)
        late = set()
        for seq in seqs:
            if seq.request_id in waiting:
                self.prepare(seq)  # (a stale job that has ended: its successor starts now)
                key, job = self._jobs[seq.request_id]
                if not job.done() or not _fits(key, seq):
                    late.add(seq.request_id)
        return late

    def take(self, seq: Sequence, num_drafts: int) -> np.ndarray:
        """[1 + num_drafts, words] int32: ``seq``'s rows for a step feeding its first ``num_drafts`` drafts (ready:
        ``not_ready`` did not name it). Raises what the job raised."""
        key, job = self._jobs[seq.request_id]
        if not job.done() or not _fits(key, seq):
            raise RuntimeError(f"request {seq.request_id!r} was scheduled before its grammar's token masks were ready")
        return job.result()[:1 + num_drafts]

    def keep_only(self, live: Iterable[str]) -> None:
        """Forget the jobs of requests that are gone (a running one ends on its own; its rows are dropped)."""
        live = set(live)
        for request_id in [r for r in self._jobs if r not in live]:
            del self._jobs[request_id]
