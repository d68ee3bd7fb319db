"""Continuous batching with chunked prefill and recompute preemption. Pure Python, no torch.

Each step: running requests first, oldest first (a decoding request feeds its anchor and drafts,
a partly prefilled one its next chunk), then waiting requests in arrival order while the token
budget, ``max_num_seqs`` and free pages allow. When a running request needs a page and none is
free, the newest running request is preempted: its pages are released and it returns to the
front of the queue to recompute its prompt and output later (nothing is lost; the output is
unchanged because sampling noise is keyed by position, see ``runtime.noise``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.pages import PageAllocator
from runtime.sequence import Sequence, Status
from runtime.step_io import ScheduledRequest


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits, pages: PageAllocator):
        self.limits = limits
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[str] = []
        self._scrub: list[int] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, scrub: bool = False) -> None:
        """Mark finished, free its pages; the runner is told to drop its state next step. ``scrub``: the pages
        may hold NaN/inf (a faulted request); the runner zeroes them before anyone reuses them, because attention
        multiplies even masked-out cache slots by zero weights, and 0 * NaN is NaN."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if scrub:
            self._scrub.extend(seq.page_ids)
        self.pages.release(seq.page_ids)
        self._released.append(seq.request_id)

    def take_released(self) -> tuple[list[str], list[int]]:
        """(request ids whose runner state to drop, pages to zero) since the last call."""
        released, self._released = self._released, []
        scrub, self._scrub = self._scrub, []
        return released, scrub

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            tokens, num_drafts, sample = self._plan(seq, budget)
            end_position = seq.num_computed + len(tokens)
            while not self.pages.can_grow(seq.page_ids, end_position):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.pages.grow(seq.page_ids, end_position)
            scheduled.append(self._entry(seq, tokens, num_drafts, sample))
            budget -= len(tokens)
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            tokens, num_drafts, sample = self._plan(seq, budget)
            end_position = seq.num_computed + len(tokens)
            if not self.pages.can_grow(seq.page_ids, end_position):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.pages.grow(seq.page_ids, end_position)
            scheduled.append(self._entry(seq, tokens, num_drafts, sample))
            budget -= len(tokens)
        return scheduled

    def _plan(self, seq: Sequence, budget: int) -> tuple[list[int], int, bool]:
        """What ``seq`` feeds this step within ``budget``: (tokens, drafts among them, whether it samples)."""
        if seq.is_decoding:
            room = min(budget - 1, self.limits.max_model_len - seq.num_tokens - 1,
                       seq.params.max_tokens - len(seq.output_token_ids) - 1)
            drafts = seq.draft_ids[:max(room, 0)]
            return [seq.last_token, *drafts], len(drafts), True
        end = min(seq.num_tokens, seq.num_computed + budget)
        return seq.token_slice(seq.num_computed, end), 0, end == seq.num_tokens

    @staticmethod
    def _entry(seq: Sequence, tokens: list[int], num_drafts: int, sample: bool) -> ScheduledRequest:
        """The step's plain-data entry for ``seq``, once its pages cover the tokens (a snapshot of them)."""
        history = ((seq.prompt_token_ids, seq.output_token_ids) if sample and seq.params.uses_penalties else None)
        return ScheduledRequest(request_id=seq.request_id, token_ids=tokens, start_position=seq.num_computed,
                                page_ids=list(seq.page_ids), num_drafts=num_drafts, sample=sample, params=seq.params,
                                seed=seq.seed, penalty_history=history)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pages.release(seq.page_ids)
        seq.status, seq.num_computed, seq.draft_ids = Status.WAITING, 0, []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._released.append(seq.request_id)
