"""CUDA graphs of the target's decode and verify forwards, one per (batch bucket, tokens per request).

A step whose requests feed at most ``Q`` tokens each (``Q = 1`` plain decoding, ``Q = K + 1`` a verify of K
drafts; a prefill chunk is the same computation) replays a graph captured for ``B >= len(requests)`` requests
of Q tokens. Shorter requests (a block trimmed at ``max_tokens``, a short prefill chunk) are padded to Q where
that costs little (``runtime.worker.graph_layout``: ``worth_padding``, ``graph_inputs``): the padding tokens come after the request's real ones, so causal attention
keeps them out of every real row; they write their keys into the scratch page and their outputs are dropped.
The graph is a pure function of persistent buffers: one host-to-device copy writes the step's token ids,
positions and cache slots, FlashInfer's plan writes the page table into the wrapper's own buffers, one replay runs
embedding -> layers -> final norm (and the captured layers) -> LM head -> max and argmax of every row (what greedy
verification needs; sampling reads the logits; under tensor parallelism the all-reduces run inside the graph, the
max/argmax are reduced per vocab slice, and a step that needs logits computes them from the hidden states). With
a colocated drafter, a second graph per bucket (replayed right after, skipped once speculation is off for good)
appends the step's captured states to the drafter's context cache: eagerly those dozen small kernels cost the host
more than the whole target graph on a small model.
Padding requests (up to the bucket) feed token 0 at positions 0..Q-1 into the scratch page no request owns, so
they never touch a real request's cache, and their outputs are dropped. Masked keys still enter the kernels'
arithmetic (weight 0), so a NaN in the scratch page would spread: the runner zeroes it after a step in which a
request faulted. Prefill chunks longer than a verify block are graphed too at small batches (``PREFILL_Q_LENS``,
captured for the buckets whose batch x Q stays within ``PREFILL_GRAPH_TOKENS``): a request's first token then
costs a replay, not an eager forward that launches every kernel from the host (9.3 ms for a 64-token prompt on a
0.8B target at one request on an H200). Other steps (longer prefill chunks, larger batches of them, mixes too
ragged to pad) run eagerly.

Engines plan ahead (``plan_ahead``): right after a one-token step is launched, FlashInfer is planned for the step
in which every request decodes one more token (pages are allotted a token ahead, ``Scheduler.lookahead``) while the
GPU runs; that step's plan is skipped when it comes with exactly that layout.

A DSpark engine plans its next verify step while the drafter drafts (``read_accepted``, ``plan_next_verify``):
the verification's accepted counts are copied into pinned memory before the draft is launched, the host waits for
them alone, and plans the step in which every request verifies a block as long from its next position (the
scheduler allots pages a block ahead); that step's plan is then skipped when it comes with exactly that layout.

With a drafter the next verify goes further too (``launch_verify_ahead``, when the engine expects the same requests
to verify the blocks drafted now, whole or cut to the confidence scheduler's cap already chosen:
``ScheduledBatch.run_ahead``, ``next_verify_len``): once the accepted counts are read and the next step
planned, and this step's rows are queued for read-back through pinned memory (the replay reuses their buffers),
the next verify is launched right behind the draft, its anchors (each request's last committed token) and drafts
copied on the device from this step's verification and draft, its positions and slots from the accepted counts;
its context append follows. The host then reads this step back, commits and schedules while the GPU verifies;
``run`` takes that step when the engine schedules exactly it (the same requests, each feeding the anchor and
drafts it was fed, at the same positions on the same pages), else drops it (it wrote only cache slots past every
request's committed tokens, in both caches, which later steps write again before any reads them).

Confidence scheduling's packed layout (``runtime.worker.packed_verify``; single rank) adds a packed graph per batch bucket
from ``PACKED_MIN_BATCH`` and per number of columns c = 1..K-1 (``run_packed``): the step's blocks are fed as a
uniform K+1-token step (a block drafted shorter padded with drafts that propose nothing), and the graph ranks the
block's confidences (persistent buffers the host, or a launch ahead, fills), picks the B x c drafts of highest
survival and runs the target's GEMMs on those rows only. Its attention is
planned in the uniform layout under its own key, so a packed step is planned while the drafter drafts and launched
ahead (``launch_verify_ahead`` with ``packed``: the confidences copied on the device from the block just drafted,
as the host reads them back) like a uniform verify; ``run_packed`` takes it when the engine schedules exactly it at
those columns, and a uniform step never takes a packed one (nor the reverse).

A verify step's device time is not monotone in its tokens (the GEMMs' tiling), so on a single rank the verify
graphs are timed once captured, and a step of Q tokens a request replays a longer graph where that one is faster
(``served_by``, ``served_length``; padded as any shorter request is, launched and planned ahead at that length).

Plain greedy decode steps launch the next one ahead too (``decode_greedy``, whose docstring says how).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator

import numpy as np
import torch

from runtime.kernels import AttentionGeometry, HostLayout, PagedAttentionMeta
from runtime.kernels.transfer import PinnedReadBack
from runtime.models.target import TargetModel
from runtime.sampling.verify import block_verdicts, greedy_verdicts
from runtime.scheduling.kv_cache import KVCaches
from runtime.scheduling.step_io import PackedAhead, ScheduledRequest
from runtime.spec.history import history_classes
from runtime.worker.graph_buffers import CapturedGraph, CapturedPackedGraph, GraphOutputs, PackedGraphOutputs, replay_ms
from runtime.worker.graph_layout import (LaunchedDecode, LaunchedVerify, batch_buckets, bucket_of, faster_lengths,
                                         graph_inputs, graphed_q_len, next_anchor_position, next_decode_layout,
                                         next_verify_layout)
from runtime.worker.packed_verify import history_after, packed_verify, survivals
from runtime.worker.transfer import DeviceWait

log = logging.getLogger(__name__)
PACKED_MIN_BATCH = 16  # packed graphs from this batch bucket up (below, a step's cost hardly depends on its tokens)
FASTER_BY = 0.03  # a longer verify graph serves a step where it replays at least this much faster (timing noise)
TIMED_REPLAYS = 5  # replays timed per verify graph at capture (the median), after one untimed


# A colocated drafter's context append: captured [N, m*d], positions [N], slots [N] -> writes its cache.
ContextAppend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class GraphedTargetForward:
    def __init__(self, target: TargetModel, caches: KVCaches, backend, geometry: AttentionGeometry, page_size: int,
                 scratch_page: int, max_batch: int, pages_per_seq: int, q_lens: list[int], device: torch.device,
                 append_context: ContextAppend | None = None, plan_ahead: bool = False,
                 prefill_q_lens: list[int] | tuple = (), prefill_tokens: int = 0,
                 packed_columns: list[int] | tuple = (), time_lengths: bool = False):
        self.target, self.caches, self.backend, self.geometry = target, caches, backend, geometry
        # plan_ahead: after a one-token step is launched, FlashInfer is planned for the step that follows if every
        # request decodes one token more, and while the drafter drafts for the next verify step (pages are
        # allotted ahead, Scheduler.lookahead); that step then skips its plan, which ran while the GPU was busy
        self.plan_ahead = plan_ahead
        # launch steady greedy decode steps (decode_greedy) and full-block verify steps (launch_verify_ahead) ahead;
        # off: plan ahead only
        self.run_ahead = plan_ahead
        self.planned: dict[tuple[int, int], HostLayout] = {}  # per graph: the layout its wrapper is planned for
        self.plans_skipped = 0  # steps whose plan was made ahead
        self._plan_copied = torch.cuda.Event()  # recorded after each plan's host-to-device copies
        self.append_context = append_context
        self.page_size, self.scratch_page, self.device = page_size, scratch_page, device
        self.buckets = batch_buckets(max_batch)
        self.pages_per_seq = pages_per_seq
        self.q_lens = sorted(set(q_lens))
        # prefill chunk graphs: lengths past the verify blocks, at the buckets whose batch x Q fits prefill_tokens
        self.prefill_q_lens = sorted(q for q in set(prefill_q_lens) if q > self.q_lens[-1])
        self.prefill_tokens = prefill_tokens
        shapes = [(batch, q_len) for q_len in self.q_lens for batch in reversed(self.buckets)]
        shapes += [(batch, q_len) for q_len in self.prefill_q_lens for batch in reversed(self.buckets)
                   if batch * q_len <= prefill_tokens]
        width = max(batch * q_len for batch, q_len in shapes)
        self.inputs = torch.zeros(3, width, dtype=torch.int64, device=device)  # ids, positions, slots
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # unused by FlashInfer's plan
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        # run-ahead of plain greedy decode steps (decode_greedy): the pinned read-back rows (two: the step being
        # read and the one launched ahead), their events, the step launched ahead and how often it paid
        self._verdict_reads = [PinnedReadBack(max_batch), PinnedReadBack(max_batch)]
        self._next_slot = 0
        self._ahead: LaunchedDecode | None = None
        self.steps_run_ahead = 0  # steps whose graph had been launched before the engine scheduled them
        self.steps_ahead_dropped = 0  # steps launched ahead that the engine then scheduled otherwise
        # planning the next verify step while the drafter drafts (read_accepted, plan_next_verify): the last
        # replay's requests and layout, and its accepted counts read back through pinned memory
        self._last_run: tuple[list[ScheduledRequest], HostLayout, int, int] | None = None
        self._accepted_read = PinnedReadBack(max_batch)
        self._accepted_pending = 0
        self._ahead_verify: LaunchedVerify | None = None  # a verify step launched ahead (launch_verify_ahead)
        self.replays = 0  # steps served by a graph (padded ones included); the rest of the steps ran eagerly
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        for batch, q_len in shapes:  # per length the largest batch first: smaller graphs reuse its pool memory
            self.graphs[(batch, q_len)] = self._capture(batch, q_len)
        # packed verify graphs (confidence scheduling's packed layout): Q = K+1 at the buckets from PACKED_MIN_BATCH,
        # for every number of columns below whole blocks; the block's confidences and the survival fit they are
        # ranked by live in persistent buffers the host fills before each replay
        self.packed_columns = sorted(c for c in set(packed_columns) if 0 < c < self.q_lens[-1] - 1)
        k = self.q_lens[-1] - 1
        self.packed_confidence = torch.zeros(max_batch, max(k, 1), dtype=torch.float32, device=device)
        self.packed_slope = torch.ones(max(k, 1), dtype=torch.float32, device=device)  # [K] the survival fit's
        self.packed_bias = torch.zeros(len(history_classes(max(k, 1))), max(k, 1), dtype=torch.float32,
                                       device=device)  # [H, K]
        self.packed_history = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [B] each request's class
        self.packed_graphs: dict[tuple[int, int], CapturedPackedGraph] = {}
        # the fewest requests whose bucket has packed graphs (0: none)
        self.packed_from = next((1 + max([b for b in self.buckets if b < batch], default=0)
                                 for batch in self.buckets if batch >= PACKED_MIN_BATCH), 0) \
            if self.packed_columns else 0
        if not self.packed_from:  # no bucket large enough: nothing is packed
            self.packed_columns = []
        self.packed_replays = 0  # packed graph replays (steps launched ahead and dropped included)
        self.packed_run_ahead = 0  # packed steps taken from a launch ahead
        for batch in reversed(self.buckets):
            if batch >= PACKED_MIN_BATCH:
                for columns in self.packed_columns:
                    self.packed_graphs[(batch, columns)] = self._capture_packed(batch, columns)
        self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]  # the device memory they took
        # (batch, Q) -> the longer verify graph that serves steps of Q tokens a request at that bucket, where it
        # replays faster (time_lengths: a single rank; under tensor parallelism every rank must replay the same
        # graph, and each would time its own)
        self.served_by: dict[tuple[int, int], int] = self._faster_lengths() if time_lengths else {}
        self.capture_seconds = time.perf_counter() - start
        log.info("dspark: captured %d CUDA graphs (batch %s x tokens %s; prefill chunks of %s up to %d tokens; "
                 "%d packed of columns %s) in %.1f s, %.0f MiB", len(self.graphs), self.buckets, self.q_lens,
                 self.prefill_q_lens, prefill_tokens, len(self.packed_graphs), self.packed_columns,
                 self.capture_seconds, self.capture_bytes / 2**20)

    def tokens_per_request(self, reqs: list[ScheduledRequest]) -> int | None:
        """Q if a graph serves this step (see ``graphed_q_len``; a longer verify graph where it replays faster,
        ``served_length``), else None."""
        q_len = graphed_q_len([len(r.token_ids) for r in reqs], self.q_lens, self.buckets[-1], self.prefill_q_lens,
                              self.prefill_tokens)
        return self.served_length(len(reqs), q_len) if q_len is not None and self.served_by else q_len

    def served_length(self, num: int, q_len: int) -> int:
        """The tokens a request of the graph serving a step of ``num`` requests feeding up to ``q_len`` tokens each:
        ``q_len``, or a longer verify length whose graph replays faster at that bucket (``_faster_lengths``)."""
        batch = bucket_of(self.buckets, num)
        return self.served_by.get((batch, q_len), q_len)

    def _faster_lengths(self) -> dict[tuple[int, int], int]:
        """Time each verify graph (2 to K + 1 tokens a request) at the buckets from ``PACKED_MIN_BATCH`` and map a
        length to a longer one whose graph replays at least ``FASTER_BY`` faster. A verify step's time is not
        monotone in its tokens: the GEMMs' tiling makes some row counts dearer than larger ones (an H200, a
        2.7B target at 64 requests: 7 tokens a request 7.95 ms, 8 tokens 6.63; 5 tokens 6.10, 6 tokens 5.56); a
        step of 7 then feeds its blocks padded to 8 (``graph_inputs``: padding rows are dropped), for its results
        unchanged. Each graph replays its capture-time inputs (padding rows on the scratch page: the GEMM-bound
        floor, where the tiling shows; attention over a served step's context adds alike to both)."""
        times: dict[tuple[int, int], float] = {}
        verify = [q for q in self.q_lens if q > 1]
        for batch in self.buckets:
            if batch >= PACKED_MIN_BATCH and len(verify) > 1:
                for q_len in verify:
                    self._write_inputs([], batch, q_len)  # its capture-time inputs: padding rows on the scratch page
                    graph = self.graphs[(batch, q_len)].graph
                    graph.replay()  # one untimed
                    times[(batch, q_len)] = replay_ms(graph, TIMED_REPLAYS)
        faster = faster_lengths(times, FASTER_BY)
        if faster:
            log.info("dspark: verify steps served by a longer graph that replays faster (batch, tokens -> tokens): %s",
                     ", ".join(f"{b} x {q} -> {to}" for (b, q), to in sorted(faster.items())))
        return faster

    def run(self, reqs: list[ScheduledRequest], q_len: int, append_context: bool = False) -> GraphOutputs:
        """Replay the graph of ``len(reqs)`` requests (padded to a bucket) x ``q_len`` tokens, then, if asked and
        captured, the drafter's context graph (padding rows write the scratch page of its cache too)."""
        ahead, self._ahead_verify = self._ahead_verify, None
        self.drop_ahead()
        batch = bucket_of(self.buckets, len(reqs))
        g = self.graphs[(batch, q_len)]
        appended = append_context and g.context is not None
        if ahead is not None and not ahead.columns and ahead.q_len == q_len and ahead.matches(reqs, appended):
            self.steps_run_ahead += 1  # launched (and its context appended) while the step before it drafted
            self._last_run = (reqs, ahead.layout, batch, q_len)
        else:
            if ahead is not None:
                self.steps_ahead_dropped += 1
            layout = self._write_inputs(reqs, batch, q_len)
            self._plan_and_replay(g, layout, batch, q_len)
            self._last_run = (reqs, layout, batch, q_len)
            if appended:
                g.context.replay()
            if self.plan_ahead and q_len == 1:  # while the GPU runs this step (the plan's copies queue behind it)
                upcoming = next_decode_layout(layout, [r.page_ids for r in reqs], self.page_size)
                if upcoming is not None:
                    self._plan(upcoming, batch, q_len)
        rows = len(reqs) * q_len
        ids, positions, slots = (t[:rows] for t in self.inputs)
        return GraphOutputs(ids, positions, slots, g.hidden[:rows], g.captured[:rows] if g.captured is not None
                            else None, g.logits[:rows] if g.logits is not None else None, g.top[:rows],
                            g.argmax[:rows], appended, q_len, g.verdict[:rows] if g.verdict is not None else None,
                            g.block_verdict[:len(reqs)] if g.block_verdict is not None else None)

    def packs(self, num: int, columns: int) -> bool:
        """Whether a packed graph serves a packed verify of ``num`` requests at ``columns``."""
        batch = bucket_of(self.buckets, num)
        return batch is not None and (batch, columns) in self.packed_graphs

    def run_packed(self, reqs: list[ScheduledRequest], confidences: list[list[float]],
                   slope: list[float], bias: list[list[float]], history: list[int], columns: int,
                   append_context: bool = False) -> PackedGraphOutputs:
        """Replay the packed graph of ``len(reqs)`` requests (padded to a bucket) verifying ``columns`` x bucket
        drafts of their blocks (``reqs`` each feed an anchor and a block of K' <= K drafts, padded to K), ranked by
        ``confidences`` [S][K'] under the survival fit given; then, if asked and captured, the drafter's context
        append. Or taken from the packed step launched ahead (``launch_verify_ahead``) when ``reqs`` is exactly that
        step: it ranked the block's confidences as drafted on the device, under the survival fit of the step
        before."""
        ahead, self._ahead_verify = self._ahead_verify, None
        self.drop_ahead()
        batch = bucket_of(self.buckets, len(reqs))
        q_len = self.q_lens[-1]
        g = self.packed_graphs[(batch, columns)]
        appended = append_context and g.context is not None
        if ahead is not None and ahead.columns == columns and ahead.q_len == q_len and ahead.matches(reqs, appended):
            self.steps_run_ahead += 1
            self.packed_run_ahead += 1
            self._last_run = (reqs, ahead.layout, batch, q_len)
        else:
            if ahead is not None:
                self.steps_ahead_dropped += 1
            layout = self._write_inputs(reqs, batch, q_len)
            self._write_ranking(torch.tensor(confidences, dtype=torch.float32), slope, bias,
                                torch.tensor(history, dtype=torch.int64), batch)
            self._plan_and_replay(g, layout, batch, q_len, columns)
            if appended:
                g.context.replay()
            self._last_run = (reqs, layout, batch, q_len)
        num = len(reqs)
        return PackedGraphOutputs(g.lengths[:num], g.block_verdict[:num],
                                  g.captured[:num * q_len] if g.captured is not None else None, appended)

    def read_accepted(self, accepted: torch.Tensor) -> None:
        """Queue the copy of the last replay's verification, ``accepted`` [len(reqs)] drafts per request, into
        pinned memory, with an event: called right after the verification is queued and before the draft is
        launched, so that ``plan_next_verify`` can read it while the drafter runs."""
        self._accepted_read.queue(accepted)
        self._accepted_pending = accepted.shape[0]

    def plan_next_verify(self, next_q_len: int | None = None, columns: int = 0) -> list[int] | None:
        """While the drafter drafts: wait for the accepted counts ``read_accepted`` queued (the verification is
        done, the draft still runs), then plan the verify step in which the last replay's requests each verify a
        block of ``next_q_len`` tokens (the engine's prediction; else as long as this one) from their next position
        (``next_verify_layout``), if a graph of that length is captured (the packed graph of ``columns``, if given: a
        packed verify of those blocks). When the engine schedules
        exactly that step, its plan (~0.2 ms of host time a step on the Qwen3-8B shape) was made while the GPU
        drafted; any other step plans as usual. -> the accepted counts when it planned, else None."""
        num, self._accepted_pending = self._accepted_pending, 0
        if not self.plan_ahead or self._last_run is None or num == 0:
            return None
        reqs, _, batch, q_len = self._last_run
        if num != len(reqs):
            return None
        next_q_len = self.served_by.get((batch, next_q_len), next_q_len) if next_q_len else q_len
        if columns:  # a packed graph feeds K + 1 rows a request, a shorter block padded
            next_q_len = self.q_lens[-1]
        if (batch, columns) not in self.packed_graphs if columns else (batch, next_q_len) not in self.graphs:
            return None
        accepted = self._accepted_read.wait().tolist()
        upcoming = next_verify_layout(reqs, accepted, q_len, next_q_len, batch, self.page_size, self.scratch_page)
        if upcoming is None:
            return None
        self._plan(upcoming, batch, next_q_len, columns)
        return accepted

    def launch_verify_ahead(self, accepted: list[int], committed: torch.Tensor, accepted_device: torch.Tensor,
                            drafts: torch.Tensor, append_context: bool, packed: PackedAhead | None = None,
                            confidence: torch.Tensor | None = None,
                            verified_counts: torch.Tensor | None = None) -> bool:
        """Launch, right behind the draft, the verify step in which every request of the last replay verifies
        ``drafts`` [S, N] (device: the block just drafted, or its first N drafts) from its next position, its
        anchor the token this step committed last (``committed`` [S, K+1] at ``accepted_device`` [S], device;
        ``accepted`` the same counts
        read back by ``plan_next_verify``, which planned it), if each request's pages cover it. The step's inputs
        are written on the device; its context append follows when ``append_context``. The caller has already
        queued the read-back of this step (the replay reuses its output buffers) and, once it has read back,
        says what each request feeds (``set_ahead_tokens``). ``packed``: the step is a packed verify of those
        columns (its packed graph), the block's ``confidence`` [S, K] (device, as the host reads them back) ranked
        under the survival fit given, each request's verify-history class ``packed.history`` updated
        by this step's verdicts (``next_history``: the drafts it verified, ``verified_counts`` [S] on the device
        for a packed step, else its block, and how many it accepted). -> whether it was launched."""
        if not self.run_ahead or self._last_run is None:
            return False
        reqs, _, batch, _ = self._last_run
        num, ps = len(reqs), self.page_size
        fed = drafts.shape[1] + 1  # anchor and drafts; the graph's length may be longer (served_by: padded)
        columns = packed.columns if packed is not None else 0
        # (a packed graph feeds K + 1 rows a request: a shorter block is padded, its padding proposing nothing)
        q_len = self.q_lens[-1] if columns else self.served_by.get((batch, fed), fed)
        if drafts.shape[0] != num or len(accepted) != num or (batch, q_len) not in self.graphs \
                or (columns and ((batch, columns) not in self.packed_graphs or confidence is None)):
            return False
        upcoming = [ScheduledRequest(r.request_id, [0] * fed, next_anchor_position(r, a), r.page_ids, fed - 1,
                                     True, r.params, r.seed) for r, a in zip(reqs, accepted)]
        # its pages must cover the block (and a uniform step's padding; a packed step's padding writes the scratch page
        # and is never fed)
        covered = fed if columns else q_len
        if any(-(-(r.start_position + covered) // ps) > len(r.page_ids) for r in upcoming):
            return False
        g = self.packed_graphs[(batch, columns)] if columns else self.graphs[(batch, q_len)]
        inputs, layout = graph_inputs(upcoming, batch, q_len, ps, self.scratch_page)
        self.inputs[:, :batch * q_len].copy_(torch.from_numpy(inputs), non_blocking=True)
        ids = self.inputs[0, :num * q_len].view(num, q_len)  # [S, Q]: anchor, then the drafts (then padding)
        ids[:, :1].copy_(committed.gather(1, accepted_device[:, None]))
        ids[:, 1:fed].copy_(drafts)
        if columns:
            before = torch.tensor(packed.history, dtype=torch.int64).to(accepted_device.device, non_blocking=True)
            verified = verified_counts if verified_counts is not None else torch.tensor(
                [r.num_drafts for r in reqs], dtype=torch.int64).to(accepted_device.device, non_blocking=True)
            self._write_ranking(confidence, packed.slope, packed.bias,
                                history_after(before, verified, accepted_device, self.q_lens[-1] - 1), batch)
        self._plan_and_replay(g, layout, batch, q_len, columns)  # planned by plan_next_verify: the plan is skipped
        appended = append_context and g.context is not None
        if appended:
            g.context.replay()
        self._ahead_verify = LaunchedVerify(tuple(r.request_id for r in upcoming),
                                            tuple(r.start_position for r in upcoming), q_len, layout, appended,
                                            columns=columns, fed=fed)
        return True

    def _write_ranking(self, confidence: torch.Tensor, slope: list[float], bias: list[list[float]],
                       history: torch.Tensor, batch: int) -> None:
        """A packed step's ranking into its graph's persistent buffers: ``confidence`` [S, K] (host or device),
        padding requests up to ``batch`` proposing nothing (0), the survival fit (``slope`` [K], ``bias`` [H][K]) and
        each request's verify-history class ``history`` [S] (host or device)."""
        num, k = confidence.shape  # k < K where a draft_len_schedule drafts shorter blocks: the rest propose nothing
        self.packed_confidence[:batch].zero_()
        self.packed_confidence[:num, :k].copy_(confidence, non_blocking=True)
        self.packed_slope[:k].copy_(torch.tensor(slope[:k], dtype=torch.float32), non_blocking=True)
        self.packed_bias[:, :k].copy_(torch.tensor([row[:k] for row in bias], dtype=torch.float32), non_blocking=True)
        self.packed_history[:batch].zero_()
        self.packed_history[:num].copy_(history, non_blocking=True)

    def set_ahead_tokens(self, tokens: list[tuple[int, ...] | None]) -> None:
        """What each request of the verify step launched ahead feeds (its anchor, then its drafts), as this step
        read them back; None for a request that will not feed a full block (it faulted)."""
        if self._ahead_verify is not None:
            self._ahead_verify.tokens = tuple(tokens)

    def appends_context(self, num: int) -> bool:
        """Whether a one-token step of ``num`` requests can append the drafter's context in its graph (a colocated
        drafter's context graph was captured at its bucket): ``decode_greedy(append_context=True)``."""
        batch = bucket_of(self.buckets, num)
        return batch is not None and (batch, 1) in self.graphs and self.graphs[(batch, 1)].context is not None

    def decode_greedy(self, reqs: list[ScheduledRequest], run_ahead: bool,
                      append_context: bool = False) -> Generator[DeviceWait, None, list[int]]:
        """A plain greedy decode step (a generator: it yields where the host is about to wait for the device) (one token per request): its verdicts [len(reqs)] (each request's greedy token,
        -1 where its row broke), read back through pinned memory; replayed now, or taken from the step launched
        ahead when ``reqs`` is exactly that step. ``run_ahead`` (the engine expects the next step to be these
        requests decoding one token more; the scheduler allots pages a token ahead): launch that step before
        waiting for this one: this step's verdicts are copied into pinned memory (an event marks them) and on the
        device into the next step's input ids, the next step launched, and only then does the host wait, for these
        verdicts alone (a ``.tolist()`` would queue behind the step launched ahead: ``benchmarks/graph_launch.py
        --readback``). A step launched ahead that the engine does not schedule exactly is dropped: it wrote only cache
        slots no later step has used yet, and every later step runs after it in stream order. ``append_context`` (a
        drafter whose schedule drafts nothing at this concurrency, its context kept for when it drafts again;
        ``appends_context``): the drafter's context graph follows each replay, the one launched ahead too."""
        batch = bucket_of(self.buckets, len(reqs))
        g = self.graphs[(batch, 1)]
        if append_context and g.context is None:
            raise RuntimeError(f"no drafter context graph was captured for {batch} requests x 1 token")
        if self._ahead_verify is not None:  # a verify launched ahead, then speculation stopped: not this step
            self.steps_ahead_dropped += 1
            self._ahead_verify = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.matches(reqs, append_context):
            self.steps_ahead_dropped += 1
            ahead = None
        if ahead is None:
            inputs, layout = graph_inputs(reqs, batch, 1, self.page_size, self.scratch_page)
            self.inputs[:, :batch].copy_(torch.from_numpy(inputs), non_blocking=True)
            self._plan_and_replay(g, layout, batch, 1)
            slot = self._read_back(g, len(reqs))
            if append_context:  # (behind the read-back's copy: the host need not wait for it)
                g.context.replay()
        else:
            self.steps_run_ahead += 1
            inputs, layout, slot = ahead.inputs, ahead.layout, ahead.slot
        if run_ahead and self.run_ahead and self.plan_ahead:
            self._launch_ahead(reqs, batch, g, inputs, layout, append_context)
        elif self.plan_ahead:  # plan the step after, in case it is these requests one token on
            upcoming = next_decode_layout(layout, [r.page_ids for r in reqs], self.page_size)
            if upcoming is not None:
                self._plan(upcoming, batch, 1)
        yield None
        verdicts = self._verdict_reads[slot].wait().tolist()  # this step's only: the one launched ahead still runs
        if self._ahead is not None:
            self._ahead.tokens = tuple(verdicts)
        return verdicts

    def _read_back(self, g: CapturedGraph, num: int) -> int:
        """Queue the copy of a replay's first ``num`` verdicts into a pinned row (right behind the replay, before
        anything launched after it) and the event that marks it. -> the row."""
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        self._verdict_reads[slot].queue(g.verdict[:num])
        return slot

    def _launch_ahead(self, reqs: list[ScheduledRequest], batch: int, g: CapturedGraph, inputs: np.ndarray,
                      layout: HostLayout, append_context: bool = False) -> None:
        """Launch the step in which every request of ``reqs`` decodes the token the step just launched decides
        (read on the device; a broken row's -1 becomes token 0, and that request fails, so the step is dropped),
        and its drafter context append if ``append_context``, if the scheduler's pages already cover it."""
        num, ps = len(reqs), self.page_size
        upcoming = next_decode_layout(layout, [r.page_ids for r in reqs], ps)
        if upcoming is None:
            return
        nxt = inputs.copy()
        positions = inputs[1, :num] + 1
        pages = np.fromiter((upcoming.page_ids[i][p // ps] for i, p in enumerate(positions.tolist())), np.int64, num)
        nxt[1, :num] = positions
        nxt[2, :num] = pages * ps + positions % ps
        self.inputs[1:, :batch].copy_(torch.from_numpy(nxt[1:]), non_blocking=True)
        torch.clamp(g.verdict[:num], min=0, out=self.inputs[0, :num])
        self._plan_and_replay(g, upcoming, batch, 1)
        slot = self._read_back(g, num)
        if append_context:
            g.context.replay()
        self._ahead = LaunchedDecode(tuple(r.request_id for r in reqs), tuple(positions.tolist()), upcoming, nxt,
                                     slot, append_context)

    def _plan_and_replay(self, g: CapturedGraph | CapturedPackedGraph, layout: HostLayout, batch: int, q_len: int,
                         columns: int = 0) -> None:
        """Plan the (batch, q_len) graph's wrapper (the packed graph's of ``columns``, if given) for ``layout``
        unless it already is (planned ahead), then replay the graph (its inputs already written)."""
        if self.planned.get(self._key(batch, q_len, columns)) == layout:
            self.plans_skipped += 1
        else:
            self._plan(layout, batch, q_len, columns)
        g.graph.replay()
        self.replays += 1
        if columns:
            self.packed_replays += 1

    def drop_ahead(self) -> None:
        """Any other step (graphed or eager): a step launched ahead is no longer the next one."""
        for name in ("_ahead", "_ahead_verify"):
            if getattr(self, name) is not None:
                self.steps_ahead_dropped += 1
                setattr(self, name, None)

    # ---- building -----------------------------------------------------------------------------

    def _write_inputs(self, reqs: list[ScheduledRequest], batch: int, q_len: int) -> HostLayout:
        """Copy the step's token ids, positions and slots (``graph_inputs``) into the graph's input buffer with one
        non-blocking copy from pageable memory (``runtime.kernels.transfer`` says why not pinned); returns the attention
        layout to plan."""
        inputs, layout = graph_inputs(reqs, batch, q_len, self.page_size, self.scratch_page)
        self.inputs[:, :batch * q_len].copy_(torch.from_numpy(inputs), non_blocking=True)
        return layout

    @staticmethod
    def _key(batch: int, q_len: int, columns: int = 0) -> tuple:
        """The graph a plan is for: (batch, q_len), or a packed graph's ("packed", batch, columns)."""
        return ("packed", batch, columns) if columns else (batch, q_len)

    def _plan(self, layout: HostLayout, batch: int, q_len: int, columns: int = 0) -> None:
        """Plan the (batch, q_len) graph's wrapper (the packed graph's of ``columns``, if given: its attention is in
        the same uniform layout) for ``layout``. FlashInfer stages a plan in a pinned host buffer
        and copies it on the stream (and the graph wrapper stages its page table in pinned memory): the previous
        plan's copies must have run before those buffers are written again. They have, unless that plan was made
        ahead right after a launch: its copies queue behind that step's graph, and this waits for the graph, which
        the step's read-back waits for anyway."""
        self._plan_copied.synchronize()  # (returns at once before its first record)
        g = self.packed_graphs[(batch, columns)] if columns else self.graphs[(batch, q_len)]
        self.backend.plan_attention(self._meta(layout, batch, q_len), g.wrapper)
        self._plan_copied.record()
        self.planned[self._key(batch, q_len, columns)] = layout

    def _max_pages(self, batch: int, q_len: int) -> int:
        """The page-table entries a step of ``batch`` requests of ``q_len`` tokens can hold: each request's own pages
        and, past them, the scratch pages its padding reaches (``graph_inputs``: a request padded to ``q_len``
        tokens near the end of its context, or a padding request, addresses up to ``q_len`` more positions)."""
        return batch * (self.pages_per_seq + -(-q_len // self.page_size))

    def _meta(self, layout: HostLayout, batch: int, q_len: int) -> PagedAttentionMeta:
        # Only the host layout and geometry matter to FlashInfer; the device fields are placeholders.
        seq_lens = self.seq_lens[:batch]
        return PagedAttentionMeta(query_start_loc=seq_lens, seq_lens=seq_lens, page_table=seq_lens[:, None],
                                  max_query_len=q_len, max_seq_len=0, causal=True, num_tokens=batch * q_len,
                                  page_size=self.page_size, host=layout, geometry=self.geometry)

    def _head(self, hidden: torch.Tensor):
        """-> (logits [T, V] or None, (top, argmax) [T]): one rank's logits and their max/argmax; under tensor
        parallelism only the max/argmax, reduced per vocab slice (gathering every row's logits inside each replay
        would move R x V values a step; a step that needs logits computes them from ``hidden``)."""
        top_argmax = getattr(self.target.lm_head, "top_argmax", None)
        if top_argmax is not None:
            return None, top_argmax(hidden)
        logits = self.target.lm_head(hidden)
        return logits, logits.max(dim=-1)

    def _capture_packed(self, batch: int, columns: int) -> CapturedPackedGraph:
        q_len = self.q_lens[-1]
        wrapper = self.backend.graph_wrapper(self.device, batch, self._max_pages(batch, q_len), q_len)
        layout = self._write_inputs([], batch, q_len)
        meta = self.backend.plan_attention(self._meta(layout, batch, q_len), wrapper)
        ids, positions, slots = (t[:batch * q_len] for t in self.inputs)
        confidence = self.packed_confidence[:batch]

        def body():
            survival = survivals(confidence, self.packed_slope, self.packed_bias,
                                 self.packed_history[:batch])
            return packed_verify(self.target, self.caches, meta, ids, positions, slots, survival, batch * columns,
                                 lambda hidden: self._head(hidden)[1])

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up outside the graph (every slot a padding row's: the scratch page)
            for _ in range(2):
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body()
        context = None
        if self.append_context is not None and out.captured is not None:
            context = torch.cuda.CUDAGraph()
            with torch.cuda.graph(context, pool=self.pool):
                self.append_context(out.captured, positions, slots)
        return CapturedPackedGraph(graph, wrapper, out.lengths, out.captured, out.block_verdict, context)

    def _capture(self, batch: int, q_len: int) -> CapturedGraph:
        wrapper = self.backend.graph_wrapper(self.device, batch, self._max_pages(batch, q_len), q_len)
        layout = self._write_inputs([], batch, q_len)
        meta = self.backend.plan_attention(self._meta(layout, batch, q_len), wrapper)
        ids, positions, slots = (t[:batch * q_len] for t in self.inputs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up outside the graph (lazy inits, Triton compilation, NCCL)
            for _ in range(2):
                self._head(self.target(ids, positions, self.caches, meta, slots)[0])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, captured = self.target(ids, positions, self.caches, meta, slots)
            logits, (top, argmax) = self._head(hidden)
            # plain greedy decoding reads only this back (runtime.worker.runner): one int a request, no verify kernels;
            # a greedy verify its block's verification, computed here rather than by a dozen eager kernels after
            verdict = greedy_verdicts(top, argmax) if q_len == 1 else None
            block_verdict = block_verdicts(ids, positions, top, argmax, q_len) if q_len > 1 else None
        context = None
        if self.append_context is not None and captured is not None:
            with torch.cuda.stream(stream):  # warm-up writes only the scratch page: every slot is a padding row's
                self.append_context(captured, positions, slots)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            context = torch.cuda.CUDAGraph()
            with torch.cuda.graph(context, pool=self.pool):
                self.append_context(captured, positions, slots)
        return CapturedGraph(graph, wrapper, hidden, captured, logits, top, argmax, context, verdict, block_verdict)
