"""Continuous batching with chunked prefill, prefix caching and recompute preemption. Pure Python, no torch.

Each step: running requests first, oldest first (a decoding request feeds its anchor and drafts,
a partly prefilled one its next chunk), then waiting requests in arrival order while the token
budget, ``max_num_seqs`` and free pages allow. When a running request needs a page and none is
free, the newest running request is preempted: its pages are released and it returns to the
front of the queue to recompute its prompt and output later (nothing is lost; the output is
unchanged because sampling noise is keyed by position, see ``runtime.sampling.noise``). With prefix caching, a request
admitted from the queue first takes the cached pages of its longest computed prefix (whole pages, leaving at least
its last token to compute, whose logits it needs) and computes from there; the pages a request fills are
registered as they fill, so the next request with the same prefix (a shared system prompt, a preempted
request's own tokens) skips them. A request that asked for prompt logprobs takes only the pages whose rows'
logprobs it already recorded (none, unless it was preempted), since the cache keeps no logits; its prefill chunks
name the rows whose logprobs are still missing (``ScheduledRequest.prompt_rows``).

With ``mixed_prefill`` off (``LLMConfig.enable_mixed_prefill``) a step never feeds prefill chunks beside decoding
requests: while prompts are to be computed (a running request's next chunk, an arrival that may be admitted) the step
is a **prefill step** (those alone), else a **decode step** (the decoding requests alone, each its anchor and
drafts); while requests decode, a prefill step is followed by a decode step, so decoding advances at least every
other step. Each kind fits a CUDA graph (decode and verify graphs at every batch bucket, prefill graphs up to
``PREFILL_GRAPH_TOKENS``), where a mixed step pads poorly and runs eagerly (a 2.7B target at 64 requests:
13.7-19.9 ms against 8.2 for the graphed verify step of the same requests).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.sampling.bad_words import row_bans
from runtime.scheduling.pages import PageAllocator, page_key
from runtime.scheduling.sequence import Sequence, Status
from runtime.scheduling.step_io import ScheduledRequest


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    mixed_prefill: bool = True  # a step may feed prefill chunks beside decodes (False: apart, see the module doc)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, pages: PageAllocator):
        self.limits = limits
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[str] = []
        self._scrub: list[int] = []
        self.num_preemptions = 0
        # tokens past a step's own that a scheduled request's pages also cover when pages are free (never at the
        # price of a preemption): 1 lets the runner plan the next decode step's attention before it is scheduled,
        # max_draft_len + 1 the next verify step's (runtime.worker.graphs: plan_next_verify)
        self.lookahead = 0
        self._prefilled_last = False  # prefill apart: the last step was a prefill step
        self.eos_token_ids: frozenset[int] = frozenset()  # (the engine's) banned below min_tokens unless ignore_eos

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def may_admit(self) -> bool:
        """Whether the next ``schedule`` may admit a waiting request: one waits and the running ones leave room
        (``max_num_seqs``; the token budget and free pages may still keep it out)."""
        return bool(self.waiting) and len(self.running) < self.limits.max_num_seqs

    def expected_admissions(self, budget: int) -> tuple[int, int]:
        """(requests, tokens): what the next ``schedule`` is expected to admit from the queue with ``budget`` tokens
        left beside the running requests' (arrival order, up to ``max_num_seqs``, each its prompt's uncomputed rest
        cut at the budget, a sample waiting for its prompt's first passed over, as ``schedule`` does). An estimate
        that prices a step before it is scheduled (confidence scheduling): free pages are not consulted, and a
        prompt whose prefix the cache holds feeds less than counted."""
        requests = tokens = 0
        room = self.limits.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if budget <= 0 or requests >= room:
                break
            if self._waits_for_prefill(seq):
                continue
            fed = min(seq.num_tokens - seq.num_computed, budget)
            requests, tokens, budget = requests + 1, tokens + fed, budget - fed
        return requests, tokens

    def finish(self, seq: Sequence, reason: str, scrub: bool = False) -> None:
        """Mark finished, free its pages; the runner is told to drop its state next step. ``scrub``: the pages
        may hold NaN/inf (a faulted request); the runner zeroes them before anyone reuses them, because attention
        multiplies even masked-out cache slots by zero weights, and 0 * NaN is NaN."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if scrub:  # its own pages only: a prefix it shares came from healthy requests, and others read it
            own = self.pages.exclusive(seq.page_ids)
            self.pages.forget(own)
            self._scrub.extend(own)
        else:
            self.cache_computed(seq)
        self.pages.release(seq.page_ids)
        self._released.append(seq.request_id)

    def scrub(self, page_ids: list[int]) -> None:
        """Have the runner zero ``page_ids`` before the next step (pages outside the allocator's, such as the
        graphs' scratch page)."""
        self._scrub.extend(page_ids)

    def take_released(self) -> tuple[list[str], list[int]]:
        """(request ids whose runner state to drop, pages to zero) since the last call."""
        released, self._released = self._released, []
        scrub, self._scrub = self._scrub, []
        return released, scrub

    def next_step_kind(self, group: int | None = None, admit: bool = True) -> str:
        """What the next ``schedule`` (with the same arguments) feeds: ``"mixed"`` (prefill chunks and decodes
        together, the default), or with prefill apart ``"prefill"`` (prompts to compute: a running request's next
        chunk, or an arrival ``admit`` lets in while the batch has room; not right after a prefill step while others
        decode) or ``"decode"``. A prefill step that can admit nobody after all (no free pages) decodes instead."""
        if self.limits.mixed_prefill:
            return "mixed"
        running = [s for s in self.running if group is None or s.group == group]
        decoding = any(s.is_decoding for s in running)
        if decoding and self._prefilled_last:
            return "decode"
        prefilling = any(not s.is_decoding for s in running)
        arriving = admit and self.may_admit() and any(not self._waits_for_prefill(s) for s in self.waiting)
        return "prefill" if prefilling or arriving else "decode"

    def schedule(self, group: int | None = None, admit: bool = True, kind: str | None = None,
                 skip: frozenset[str] = frozenset()) -> list[ScheduledRequest]:
        """This step's entries. ``group`` (pipelined drafting): only the requests of that group (0 or 1), a waiting
        request joining the group with fewer requests when it is first considered (it is admitted in its group's
        steps); the limits still count both groups. ``admit`` False: no waiting request joins this step (the step
        was launched ahead as the running requests' decode; they join the next). With prefill apart, the step is
        of ``next_step_kind`` (``kind``: as the caller read it with the same arguments just before). ``skip``: ids of
        requests, running or waiting, this step passes over (their grammar's token masks are not ready)."""
        kind = kind or self.next_step_kind(group, admit)
        scheduled = self._schedule(group, admit and kind != "decode", kind, skip)
        if kind == "prefill" and not scheduled:  # nobody could be admitted: decode instead
            kind, scheduled = "decode", self._schedule(group, False, "decode", skip)
        self._prefilled_last = kind == "prefill"
        return scheduled

    def _schedule(self, group: int | None, admit: bool, kind: str, skip: frozenset[str]) -> list[ScheduledRequest]:
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        sizes = self._group_sizes() if group is not None else None
        page_size, lookahead = self.pages.page_size, self.lookahead
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING or (group is not None and seq.group != group):
                continue  # preempted earlier in this loop, or the other group's turn
            if kind != "mixed" and seq.is_decoding != (kind == "decode"):
                continue  # prefill apart: not this kind of step
            if seq.request_id in skip:
                continue
            tokens, num_drafts, sample = self._plan(seq, budget)
            end_position = seq.num_computed + len(tokens)
            held = len(seq.page_ids) * page_size
            if end_position > held:  # new pages (most steps of a decoding request need none)
                while not self.pages.can_grow(seq.page_ids, end_position):
                    victim = max(self.running, key=lambda s: s.arrival)
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status is not Status.RUNNING:
                    continue
                self.pages.grow(seq.page_ids, end_position)
            if lookahead and end_position + lookahead > held \
                    and self.pages.can_grow(seq.page_ids, end_position + lookahead):
                self.pages.grow(seq.page_ids, end_position + lookahead)
            scheduled.append(self._entry(seq, tokens, num_drafts, sample))
            budget -= len(tokens)
        # arrival order; a sample waiting for its prompt's first is passed over
        for seq in list(self.waiting) if admit else ():
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if self._waits_for_prefill(seq) or seq.request_id in skip:
                continue
            if group is not None:
                if seq.group is None:  # joins the smaller group (ties: this step's)
                    seq.group = group if sizes[group] <= sizes[1 - group] else 1 - group
                    sizes[seq.group] += 1
                if seq.group != group:
                    continue
            cached = self._match(seq)
            seq.num_computed = len(cached) * self.pages.page_size
            tokens, num_drafts, sample = self._plan(seq, budget)
            end_position = seq.num_computed + len(tokens)
            new_pages = self.pages.pages_for(end_position) - len(cached)
            if new_pages > self.pages.num_free - self.pages.cost(cached):
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            seq.follows = None
            self.pages.take(cached)
            self.pages.num_queried_tokens += seq.num_tokens if self.pages.caching else 0
            self.pages.num_hit_tokens += seq.num_computed
            if not seq.num_preemptions:  # (a readmission finds its own pages: not the client's cached prompt)
                seq.num_cached_tokens = seq.num_computed
            seq.page_ids, seq.num_registered_pages = cached, len(cached)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.pages.grow(seq.page_ids, end_position)
            scheduled.append(self._entry(seq, tokens, num_drafts, sample))
            budget -= len(tokens)
        return scheduled

    def join_groups(self) -> None:
        """Pipelined drafting resumes: every running request without a group (admitted while the steps were not
        pipelined) joins the smaller group, in arrival order."""
        sizes = self._group_sizes()
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.group is None:
                seq.group = 0 if sizes[0] <= sizes[1] else 1
                sizes[seq.group] += 1

    def _group_sizes(self) -> list[int]:
        """Requests of each group, running or waiting with a group."""
        sizes = [0, 0]
        for seq in self.running:
            if seq.group is not None:
                sizes[seq.group] += 1
        for seq in self.waiting:
            if seq.group is not None:
                sizes[seq.group] += 1
        return sizes

    def draft_room(self, seq: Sequence) -> int:
        """The most drafts a decoding ``seq``'s limits let a step verify: its committed tokens plus the drafts and
        the one token the target adds stay within ``max_tokens`` and the model's length (a step's token budget may
        cut more, ``_plan``); may be below 0."""
        return min(self.limits.max_model_len - seq.num_tokens, seq.params.max_tokens - len(seq.output_token_ids)) - 1

    def _plan(self, seq: Sequence, budget: int) -> tuple[list[int], int, bool]:
        """What ``seq`` feeds this step within ``budget``: (tokens, drafts among them, whether it samples)."""
        num_tokens = seq.num_tokens
        if seq.num_computed == num_tokens - 1:  # decoding (Sequence.is_decoding)
            drafts = seq.draft_ids
            if drafts:
                drafts = drafts[:max(min(budget - 1, self.draft_room(seq)), 0)]
            return [seq.last_token, *drafts], len(drafts), True
        end = min(num_tokens, seq.num_computed + budget)
        return seq.token_slice(seq.num_computed, end), 0, end == num_tokens

    def _entry(self, seq: Sequence, tokens: list[int], num_drafts: int, sample: bool) -> ScheduledRequest:
        """The step's plain-data entry for ``seq``, once its pages cover the tokens. ``page_ids`` is the request's
        own list, not a copy (O(pages) a request a step): the scheduler only appends to it while scheduling a later
        step, and a step's entries are read only during that step (a Ray executor pickles them anyway)."""
        history = ((seq.prompt_token_ids, seq.output_token_ids) if sample and seq.params.uses_penalties else None)
        rows = prompt_rows(seq, len(tokens)) if seq.prompt_logprobs is not None and not num_drafts else None
        banned = None
        if sample and len(seq.output_token_ids) < seq.params.min_tokens:
            ids = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)
            if ids:  # rows 0..num_drafts decide output tokens len(output) + row
                banned = (seq.params.min_tokens - len(seq.output_token_ids), tuple(sorted(ids)))
        # rows 0..num_drafts decide output tokens; row j's context is the output and the first j drafts
        bans = row_bans(seq.output_token_ids, tokens[1:] if num_drafts else [], seq.bad_words, num_drafts + 1) \
            if sample and seq.bad_words else None
        return ScheduledRequest(seq.request_id, tokens, seq.num_computed, seq.page_ids, num_drafts, sample,
                                seq.params, seq.seed, history, rows, banned, row_bans=bans)

    def _waits_for_prefill(self, seq: Sequence) -> bool:
        """True while the sample ``seq`` follows is still computing their shared prompt (with prefix caching,
        ``seq`` then starts from its pages); never when caching is off or that sample is gone."""
        leader = seq.follows
        if leader is None or not self.pages.caching or leader.status is Status.FINISHED \
                or seq.prompt_logprobs is not None:  # its prompt's rows are computed anyway (prompt_logprobs)
            return False
        return leader.status is Status.WAITING or leader.num_computed < len(leader.prompt_token_ids) - 1

    # ---- prefix cache -------------------------------------------------------------------------

    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """The prefix-cache keys of ``seq``'s first ``count`` full pages (computed once, chained)."""
        ps = self.pages.page_size
        while len(seq.page_keys) < count:
            i = len(seq.page_keys)
            seq.page_keys.append(page_key(seq.page_keys[-1] if i else None, seq.token_slice(i * ps, (i + 1) * ps)))
        return seq.page_keys[:count]

    def _match(self, seq: Sequence) -> list[int]:
        """The cached pages ``seq`` can start from: whole pages of its tokens, its last token left to compute."""
        if not self.pages.caching:
            return []
        count = (seq.num_tokens - 1) // self.pages.page_size
        if seq.prompt_logprobs is not None:  # only pages whose rows' prompt logprobs are recorded (a preempted one's)
            count = min(count, (len(seq.prompt_logprobs) - 1) // self.pages.page_size)
        return self.pages.match(self._keys(seq, count))

    def cache_computed(self, seq: Sequence) -> None:
        """Register the pages ``seq`` has filled with computed tokens since the last call."""
        if not self.pages.caching:
            return
        full = min(seq.num_computed // self.pages.page_size, len(seq.page_ids))
        if full <= seq.num_registered_pages:
            return
        keys = self._keys(seq, full)
        for i in range(seq.num_registered_pages, full):
            self.pages.register(seq.page_ids[i], keys[i])
        seq.num_registered_pages = full

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache_computed(seq)  # what it computed stays cached: readmitted, it resumes from there if still there
        self.pages.release(seq.page_ids)
        seq.num_registered_pages = 0
        seq.status, seq.num_computed, seq.draft_ids = Status.WAITING, 0, []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._released.append(seq.request_id)


def prompt_rows(seq: Sequence, fed: int) -> tuple[int, list[int]] | None:
    """A prefill chunk of ``fed`` tokens from ``seq.num_computed`` of a request that asked for prompt logprobs ->
    (the first of its rows whose logprob is not yet recorded, the prompt tokens that row and the next ones predict),
    or None when the chunk has none: row i (position p + i) predicts prompt token p + i + 1, up to the prompt's
    last token."""
    start, prompt = seq.num_computed, seq.prompt_token_ids
    first = max(start, len(seq.prompt_logprobs) - 1)  # rows before it: already recorded (a recomputed chunk)
    end = min(start + fed, len(prompt) - 1)
    if first >= end:
        return None
    return first - start, prompt[first + 1:end + 1]
