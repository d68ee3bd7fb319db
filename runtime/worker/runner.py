"""``ModelRunner``: a target shard's device state (weights, KV pages, pending draft features).

One step (``execute``) on every TP rank: the target runs every scheduled token (prefill chunks and
``[anchor, d_1..d_k]`` blocks); rank 0 hands the captured states of ``target_layer_ids`` to the
drafter, which appends them to its context (rows past the accepted prefix are overwritten before
they are ever read: the context length is the target's); verification commits each request's
accepted prefix plus one target token; the drafter drafts the next block from the new anchor. Rank
0 returns everything to the host in one transfer. Other TP ranks join the collectives (all-reduce,
logit gathers, the broadcast of draft features) and return nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Generator, NamedTuple

import torch
from torch import nn

from configs import DSparkDecodingConfig
from runtime.kernels import AttentionGeometry, KernelBackend
from runtime.kernels.profiling import region
from runtime.kernels.transfer import PinnedReadBack, to_device
from runtime.models.parallel import SINGLE, ParallelContext
from runtime.models.target import TargetModel
from runtime.sampling.logprobs import LogprobSource, TokenLogprob
from runtime.sampling.noise import Stream, exponentials, uniform
from runtime.sampling.sampler import RowParams, apply_penalties, filtered_probs, occurrence_counts
from runtime.sampling.verify import (accept_by_rejection, commit_by_match, gather_rows, greedy_verdicts,
                                     residual_distribution)
from runtime.scheduling.kv_cache import KVCaches, scrub_pages
from runtime.scheduling.step_io import RequestStepResult, ScheduledBatch, ScheduledRequest
from runtime.spec.wire import CONFIDENCE_SCALE, confidence_from_ints
from runtime.worker.draft_channel import DraftChannel, Proposal, receive_features, send_features
from runtime.worker.graph_buffers import GraphOutputs
from runtime.worker.graphs import GraphedTargetForward
from runtime.worker.logit_constraints import ban_tokens, logit_bias_rows, mask_by_grammar
from runtime.worker.packed_verify import packed_verify, survivals
from runtime.worker.piecewise import PiecewiseTargetForward
from runtime.worker.prompt_logprobs import NON_FINITE_LOGITS, chunk_prompt_logprobs, with_prompt_logprobs
from runtime.worker.step_tensors import (StepTensors, build_step_tensors, build_uniform_step_tensors, greedy_only,
                                         padded_page_table, plain_greedy, sampled_entries, uses_rejection)
from runtime.worker.transfer import DeviceWait


def attention_geometry(target: TargetModel) -> AttentionGeometry:
    """This rank's attention shape (after tensor-parallel slicing)."""
    attn = target.model.layers[0].self_attn
    q_width = attn.q_size if attn.qkv_proj is not None else attn.q_proj.out_features
    return AttentionGeometry(q_width // attn.head_dim, attn.kv_width // attn.head_dim, attn.head_dim,
                             next(target.parameters()).dtype, attn.scale)


class Verified(NamedTuple):
    """A verification's outcome for the sampled entries of a step."""

    committed: torch.Tensor  # [S, K+1] committed tokens, the first accepted + 1 valid
    accepted: torch.Tensor  # [S] drafts accepted
    faulty: torch.Tensor  # [S] nonzero where the request's rows held NaN/inf (it fails alone)
    source: LogprobSource | None  # the entries that asked for logprobs (None when none did)
    packed: torch.Tensor | None = None  # [S, W + 2] committed (W >= K+1 columns), accepted, fault: as read back


class ModelRunner:
    def __init__(self, target: TargetModel, spec: DSparkDecodingConfig | None, kernels: KernelBackend,
                 caches: KVCaches, page_size: int, device: torch.device, parallel: ParallelContext = SINGLE,
                 channel: DraftChannel | None = None, draft_w2: nn.Module | None = None,
                 graphs: GraphedTargetForward | None = None, logprobs_mode: str = "raw",
                 piecewise: PiecewiseTargetForward | None = None):
        self.target, self.kernels, self.caches, self.graphs = target, kernels, caches, graphs
        # the steps no whole-step graph serves, when built (one GPU); ``use_piecewise`` False runs them eagerly
        # (what the bench's --mixed-eager compares against, on the same engine)
        self.piecewise, self.use_piecewise = piecewise, piecewise is not None
        self.logprobs_mode = logprobs_mode  # "raw" or "processed" (configs.LLMConfig.logprobs_mode)
        self.geometry = attention_geometry(target)
        self.page_size, self.device, self.parallel = page_size, device, parallel
        self.channel = channel  # rank 0 only
        self.has_drafter = spec is not None
        self._rows_read = PinnedReadBack()  # a step's read-back rows when the next step runs ahead of it
        self.use_rejection = bool(spec and spec.use_rejection_sampling)
        self.draft_w2 = draft_w2  # Markov W2 [V, r], to rebuild draft logits (None: rank 0 head or no rejection)
        self.vocab_size = target.config.vocab_size
        self.hidden_size = target.config.hidden_size
        self.markov_rank = int(spec.markov_rank or 0) if spec else 0
        self.dtype = next(target.parameters()).dtype
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # request -> (h [K, d], low [K, r])

    @property
    def is_leader(self) -> bool:
        return self.parallel.rank == 0

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> Generator[DeviceWait, None, list[RequestStepResult]]:
        """Run one step: a generator that yields at each point where the host is about to wait for the device (its
        caller may work there: ``runtime.engine.host_work``) and returns the step's results (rank 0's; [] on others)."""
        for request_id in batch.released_request_ids:
            self.pending.pop(request_id, None)
        scrub_pages(self.caches, batch.scrub_page_ids, self.device)
        if self.channel is not None:
            self.channel.scrub(batch.scrub_page_ids)
        reqs = batch.requests
        if not reqs:
            return []
        if batch.packed is not None:  # confidence scheduling's packed layout: the device picks the drafts verified
            return (yield from self._execute_packed(batch))
        if self._decodes_greedy(batch):  # a graphed plain greedy decode step, read back through pinned memory
            with region("dspark.forward"):
                verdicts = yield from self.graphs.decode_greedy(reqs, batch.run_ahead,
                                                     append_context=self.has_drafter and batch.maintain_draft_context)
            return self._verdict_results(reqs, reqs, verdicts)
        q_len = self.graphs.tokens_per_request(reqs) if self.graphs is not None else None
        if self.graphs is not None and (q_len is None or batch.scrub_page_ids):
            self.graphs.drop_ahead()  # (a graphed step takes or drops a verify launched ahead: graphs.run)
        drafting = self.has_drafter and batch.maintain_draft_context
        graphed, appended = None, False  # appended: a piecewise forward appended the drafter's context
        with region("dspark.forward"):
            if q_len is not None:
                graphed = self.graphs.run(reqs, q_len, append_context=drafting)
                hidden, captured = graphed.hidden, graphed.captured
                t = graphed.step_tensors(reqs, self.page_size, self.device, with_page_table=drafting)
            else:
                t = build_step_tensors(reqs, self.page_size, self.device, self.kernels, self.geometry)
                if self.use_piecewise and self.piecewise.serves(t.row_ends[-1]):
                    pieces = self.piecewise.forward(t, append_context=drafting)
                    hidden, captured, appended = pieces.hidden, pieces.captured, pieces.context_appended
                else:
                    hidden, captured = self.target(t.input_ids, t.positions, self.caches, t.meta, t.slots)
        if drafting and self.is_leader and not appended and not (graphed is not None and graphed.context_appended):
            with region("dspark.context"):
                self.channel.send_context(captured, t)
        # (the prefill chunks that asked for them)
        prompt_logprobs = chunk_prompt_logprobs(self.target, reqs, hidden, t.row_ends, self.device, self.is_leader)
        results = yield from self._verify_and_draft(batch, reqs, hidden, t, graphed, drafting)
        return with_prompt_logprobs(results, prompt_logprobs) if prompt_logprobs else results

    def _verify_and_draft(self, batch: ScheduledBatch, reqs: list[ScheduledRequest], hidden: torch.Tensor,
                          t: StepTensors, graphed: GraphOutputs | None,
                          drafting: bool) -> Generator[DeviceWait, None, list[RequestStepResult]]:
        """After the step's forward: verify (or decode) what it sampled, draft the next blocks, read back."""
        sampled = sampled_entries(reqs)
        if not sampled:
            return [RequestStepResult(r.request_id, [], 0, []) for r in reqs] if self.is_leader else []
        entries = [reqs[i] for i in sampled]
        k_next = batch.num_next_drafts if drafting else 0
        if not k_next and all(plain_greedy(e) for e in entries):  # greedy decoding, nothing to verify or draft
            with region("dspark.verify"):
                verdicts = self._greedy_verdicts(entries, hidden, t.row_ends, sampled, graphed)
            if not self.is_leader:
                return []
            with region("dspark.results"):
                yield None  # (the host waits for the verdicts next)
                return self._verdict_results(reqs, entries, verdicts.tolist())  # the step's one transfer
        with region("dspark.verify"):
            verified = self._verify(entries, hidden, t.row_ends, sampled, graphed)
        # a list index would copy it to the device synchronously: decode steps sample every request anyway
        table = t.page_table if len(sampled) == len(reqs) or not k_next else t.page_table[
            to_device(sampled, self.device)]
        return (yield from self._draft_and_finish(batch, reqs, entries, verified, table, graphed is not None))

    def _execute_packed(self, batch: ScheduledBatch) -> Generator[DeviceWait, None, list[RequestStepResult]]:
        """A packed verify step (``runtime.worker.packed_verify``; every request a greedy block, ``batch.packed``): the
        blocks are fed as a uniform step (shorter ones padded to the longest), the ``budget`` drafts of highest
        survival over the step verified, the target run on those rows only; each result says how many of its drafts
        were verified."""
        if self.parallel.is_parallel:
            raise RuntimeError("a packed verify step runs on one rank (tensor parallelism verifies whole blocks)")
        reqs, plan = batch.requests, batch.packed
        drafting = self.has_drafter and batch.maintain_draft_context
        # blocks of different lengths (one cut at its token limit) are fed padded to the longest: a [S, Q] grid
        longest = max(r.num_drafts for r in reqs)
        ragged = any(r.num_drafts != longest for r in reqs)  # (each request feeds its last token and its drafts)
        dev, num, q_len = self.device, len(reqs), longest + 1
        graphed = self.graphs is not None and self.graphs.packs(num, plan.columns)  # a packed graph of this bucket
        appended = False
        if graphed:  # (it takes the packed step launched ahead, if this is it)
            q_len = self.graphs.q_lens[-1]  # its blocks: K + 1 rows a request (a shorter block's padded)
            with region("dspark.forward"):
                out = self.graphs.run_packed(reqs, plan.confidences, plan.slope, plan.bias,
                                             plan.history, plan.columns, append_context=drafting)
            ids, positions, slots = (x[:num * q_len] for x in self.graphs.inputs)
            t = StepTensors(ids, positions, slots, None, padded_page_table(reqs, dev) if drafting else None,
                            [(b + 1) * q_len for b in range(num)])
            appended = out.context_appended
        else:
            if self.graphs is not None:
                self.graphs.drop_ahead()
            with region("dspark.forward"):
                if not ragged:
                    t = build_step_tensors(reqs, self.page_size, dev, self.kernels, self.geometry)
                else:  # the graph's layout, its padding rows on the scratch page (the one past the allocator's)
                    t = build_uniform_step_tensors(reqs, q_len, self.page_size, self.caches[0][0].shape[0] - 1, dev,
                                                   self.kernels, self.geometry)
                survival = survivals(torch.tensor(plan.confidences, dtype=torch.float32, device=dev),
                                     torch.tensor(plan.slope, dtype=torch.float32, device=dev),
                                     torch.tensor(plan.bias, dtype=torch.float32, device=dev),
                                     torch.tensor(plan.history, dtype=torch.int64, device=dev))  # [S, K]
                out = packed_verify(self.target, self.caches, t.meta, t.input_ids, t.positions, t.slots, survival,
                                    plan.budget, self.target.compute_top_argmax)
        if drafting and self.is_leader and not appended:
            with region("dspark.context"):
                captured, fed = out.captured, t
                if ragged:  # the grid's padding: the drafter gets the fed
                    # rows alone, as it lays a step out itself (a separate drafter: ``DraftServer``)
                    real = to_device([b * q_len + j for b, r in enumerate(reqs) for j in range(len(r.token_ids))],
                                     dev)  # [sum fed]
                    captured, fed = captured[real], dataclasses.replace(t, input_ids=t.input_ids[real],
                                                                        positions=t.positions[real],
                                                                        slots=t.slots[real])
                self.channel.send_context(captured, fed)
        rows = out.block_verdict  # [S, Q + 2]: committed candidates, accepted, fault flag
        # the committed candidates up to the longest block fed (what a separate drafter receives them as)
        verified = Verified(rows[:, :longest + 1], rows[:, q_len], rows[:, q_len + 1], None, rows)
        counts = out.lengths  # [S] drafts each request verified, at most those it fed: where a block is shorter than
        # the grid, the selection may take its padding once every proposed draft is in (``runtime.worker.packed_verify``)
        if ragged:  # (read back, and a step launched ahead ranks by them)
            counts = torch.minimum(counts, to_device([r.num_drafts for r in reqs], dev))
        return (yield from self._draft_and_finish(batch, reqs, reqs, verified, t.page_table, graphed, counts))

    def _draft_and_finish(self, batch: ScheduledBatch, reqs: list[ScheduledRequest], entries: list[ScheduledRequest],
                          verified: Verified, table: torch.Tensor | None, graphed: bool,
                          verified_counts: torch.Tensor | None = None
                          ) -> Generator[DeviceWait, None, list[RequestStepResult]]:
        """After a verification (of ``entries``, the step's sampled requests): draft the next block; on a single
        rank's graphed step, plan the next verify's attention while the drafter drafts and, when the engine expects
        that step (``batch.run_ahead``), launch it before this one is read back (a packed verify's packed graph if
        ``batch.next_packed``); then read the step back in one transfer. ``verified_counts`` [S] (a packed step):
        the drafts each request verified, read back with the rest (``RequestStepResult.num_verified``)."""
        drafting = self.has_drafter and batch.maintain_draft_context
        k_next = batch.num_next_drafts if drafting else 0
        # plan the next verify step's attention while the drafter drafts (a single rank's graphed decode step)
        plan_next = graphed and k_next and len(entries) == len(reqs) and not self.parallel.is_parallel
        if plan_next:
            self.graphs.read_accepted(verified.accepted)
        with region("dspark.draft"):
            proposal = self._propose(entries, verified.committed, verified.accepted, table, k_next) if k_next \
                else None
        ahead, n = batch.next_packed, batch.next_verify_len
        accepted_host = None
        if plan_next:
            with region("dspark.plan_next"):
                # a device wait (the caller's host work): here while the device still verifies and drafts, unless
                # the next step is to be launched ahead (then after that launch: nothing delays it)
                if not batch.run_ahead:
                    yield None
                accepted_host = self.graphs.plan_next_verify(n + 1 if n else None, ahead.columns if ahead else 0)
        if not self.is_leader:
            return []
        if accepted_host is not None and batch.run_ahead and self._verifies_blocks_ahead(verified, proposal, n):
            with region("dspark.run_ahead"):
                # this step's rows read back through pinned memory first: the next replay reuses their buffers
                self._rows_read.queue(self._read_back_rows(verified, proposal, verified_counts))
                launched = self.graphs.launch_verify_ahead(
                    accepted_host, verified.committed, verified.accepted, proposal.tokens[:, :n], drafting, ahead,
                    self._block_confidence(proposal) if ahead is not None else None, verified_counts)
            with region("dspark.results"):
                yield None
                host = self._rows_read.wait().tolist()
                results = self._results(reqs, entries, verified, proposal, host=host)
                self._note_verified(results, host, verified_counts)
            if launched:  # what each request feeds next: its last committed token, then n drafts of the new block
                k = proposal.tokens.shape[1]
                self.graphs.set_ahead_tokens([
                    (r.token_ids[-1], *r.next_draft_ids[:n]) if r.error is None and len(r.next_draft_ids) == k
                    else None for r in results])
            return results
        with region("dspark.results"):
            # the rows' copy queued first (pinned, behind the step's last kernel), the device wait while it computes
            rows = self._read_back_rows(verified, proposal, verified_counts)  # [S, W]
            if rows.is_cuda:
                self._rows_read.queue(rows)
            # (its callable says once the rows landed: then the next step waits for this one's, nothing runs ahead)
            yield self._rows_read.landed if rows.is_cuda else None
            logprobs = verified.source.top(verified.committed) if verified.source is not None else None
            host = (self._rows_read.wait() if rows.is_cuda else rows).tolist()
            # a faulted request's pages, and the graphs' scratch page its padding rows may have filled with NaN, are
            # zeroed on every rank before the next step: the engine names them in that step's scrub list
            results = self._results(reqs, entries, verified, proposal, logprobs, host=host)
            self._note_verified(results, host, verified_counts)
            return results

    def _read_back_rows(self, verified: Verified, proposal: Proposal | None,
                        verified_counts: torch.Tensor | None) -> torch.Tensor:
        """``_packed``'s rows [S, W], then (a packed step) each request's verified drafts as a last column."""
        rows = self._packed(verified, proposal)[0]
        return rows if verified_counts is None else torch.cat([rows, verified_counts[:, None].to(rows.dtype)], dim=1)

    @staticmethod
    def _note_verified(results: list[RequestStepResult], host: list[list[int]] | None,
                       verified_counts: torch.Tensor | None) -> None:
        """A packed step: each result says how many of its drafts the device verified (the rows' last column)."""
        if verified_counts is not None:
            for result, row in zip(results, host):
                result.num_verified = row[-1]

    @staticmethod
    def _block_confidence(proposal: Proposal) -> torch.Tensor:
        """[S, K] float32 on the device: the block's confidences as the host reads them back (the drafter packs them
        as integers, ``confidence_as_ints``), so a packed step launched ahead ranks what the host would."""
        k = proposal.tokens.shape[1]
        return proposal.block[:, k + 1:2 * k + 1].to(torch.float32) / CONFIDENCE_SCALE

    def _decodes_greedy(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` is a plain greedy decode step a one-token graph serves (no drafts to make, no faulted
        pages to scrub first; a drafter's context, if kept, appended by a captured context graph):
        ``GraphedTargetForward.decode_greedy`` runs it (and may launch the next one ahead). Under tensor parallelism
        every rank must choose alike from the batch alone, since the steps they replay and launch ahead carry
        collectives that pair up across ranks: a step keeping a drafter's context (rank 0's alone) takes the general
        path there."""
        reqs = batch.requests
        if self.graphs is None or batch.scrub_page_ids or batch.num_next_drafts or len(reqs) > self.graphs.buckets[-1] \
                or not all(len(r.token_ids) == 1 and r.sample and plain_greedy(r) for r in reqs):
            return False
        return not (batch.maintain_draft_context and (
            self.parallel.is_parallel or (self.has_drafter and not self.graphs.appends_context(len(reqs)))))

    def _greedy_verdicts(self, entries: list[ScheduledRequest], hidden: torch.Tensor, row_ends: list[int],
                         batch_index: list[int], graphed: GraphOutputs | None) -> torch.Tensor:
        """-> [S] each entry's greedy token (the argmax of its last row's logits), -1 where that row's max logit is
        NaN or infinite (the request faulted): what plain greedy decoding (no drafts, logprobs or penalties) reads
        back, one int a request. A one-token graph computed the verdicts of all its rows; otherwise the entries'
        rows are picked (under tensor parallelism every rank computes the max and argmax together)."""
        if graphed is not None and graphed.verdict is not None:
            return self._entry_rows(graphed.verdict, batch_index)
        rows = to_device([row_ends[b] - 1 for b in batch_index], self.device)
        top, argmax = (graphed.top[rows], graphed.argmax[rows]) if graphed is not None else \
            self.target.compute_top_argmax(hidden[rows])
        return greedy_verdicts(top, argmax)

    def _entry_rows(self, per_request: torch.Tensor, batch_index: list[int]) -> torch.Tensor:
        """The entries' rows of a graph output with one row per request of the step ([R, ...], batch order)."""
        if len(batch_index) == per_request.shape[0]:  # every request of the step samples: rows 0..S-1
            return per_request
        return per_request[to_device(batch_index, self.device)]

    @staticmethod
    def _verdict_results(reqs: list[ScheduledRequest], entries: list[ScheduledRequest],
                         verdicts: list[int]) -> list[RequestStepResult]:
        """In batch order: each entry's token, or its fault; a request that only prefilled a chunk commits nothing."""
        results = [RequestStepResult(e.request_id, [v], 0, []) if v >= 0 else
                   RequestStepResult(e.request_id, [], 0, [], NON_FINITE_LOGITS) for e, v in zip(entries, verdicts)]
        if len(entries) == len(reqs):  # every request sampled (decode steps): already in batch order
            return results
        sampled = {r.request_id: r for r in results}
        return [sampled.get(r.request_id) or RequestStepResult(r.request_id, [], 0, []) for r in reqs]

    def _verifies_blocks_ahead(self, verified: Verified, proposal: Proposal | None, n: int) -> bool:
        """Whether the next verify (``n`` drafts of the block drafted now) may be launched before this step is read
        back: a graph verified this step (greedy, no logprobs), and the block was drafted here, in this process,
        in full (no confidence threshold trims it) and at least ``n`` long."""
        runner = getattr(self.channel, "runner", None)
        return n > 0 and verified.packed is not None and verified.source is None and proposal is not None \
            and proposal.tokens is not None and proposal.tokens.shape[1] >= n \
            and runner is not None and runner.confidence_threshold is None

    @staticmethod
    def _packed(verified: Verified, proposal: Proposal | None) -> tuple[torch.Tensor, int, int]:
        """The step's read-back rows [S, W] on the device: committed tokens (``width`` columns, the first
        accepted + 1 valid), accepted, fault flag, then the next block (drafts, length and confidences as c * 2^24,
        packed by the drafter: ``DraftOutput.block``) -> (rows, width, drafts per block)."""
        committed, accepted, faulty = verified.committed, verified.accepted, verified.faulty
        head = verified.packed if verified.packed is not None else torch.cat(
            [committed, accepted[:, None], faulty[:, None].to(committed.dtype)], dim=1)  # [S, width + 2]
        if proposal is None or proposal.tokens is None:
            return head, head.shape[1] - 2, 0
        return torch.cat([head, proposal.block], dim=1), head.shape[1] - 2, proposal.tokens.shape[1]

    @staticmethod
    def _results(reqs, entries, verified: Verified, proposal: Proposal | None,
                 logprobs: dict[int, list[list[TokenLogprob]]] | None = None,
                 host: list[list[int]] | None = None) -> list[RequestStepResult]:
        """The step's one device-to-host transfer (``_packed``'s rows; ``host``: already read back) -> results in
        batch order."""
        if host is None:
            host = ModelRunner._packed(verified, proposal)[0].tolist()
        width = (verified.packed.shape[1] - 2) if verified.packed is not None else verified.committed.shape[1]
        k = proposal.tokens.shape[1] if proposal is not None and proposal.tokens is not None else 0
        sampled = {}
        for i, (entry, row) in enumerate(zip(entries, host)):
            a, bad = row[width], row[width + 1]
            if bad:  # this request's rows hold NaN/inf: it fails alone, nothing of it is committed
                sampled[entry.request_id] = RequestStepResult(entry.request_id, [], 0, [], NON_FINITE_LOGITS)
                continue
            drafts, confidence = [], None
            if k:
                length = row[width + 2 + k]
                drafts = row[width + 2: width + 2 + length]
                if len(row) > width + 3 + k:
                    confidence = confidence_from_ints(row[width + 3 + k: width + 3 + k + length])
            token_logprobs = logprobs[i][:a + 1] if logprobs is not None and i in logprobs else None
            sampled[entry.request_id] = RequestStepResult(entry.request_id, row[:a + 1], a, drafts,
                                                          logprobs=token_logprobs, next_draft_confidence=confidence)
        # in batch order; a request that only prefilled a chunk commits nothing
        return [sampled.get(r.request_id) or RequestStepResult(r.request_id, [], 0, []) for r in reqs]

    # ---- drafting -----------------------------------------------------------------------------

    def _propose(self, entries, committed, accepted, page_table, k_next) -> Proposal | None:
        """Rank 0 asks the drafter for the next block; every rank keeps the features of rejection-sampled
        requests (broadcast over the TP group) to rebuild their draft probabilities next step."""
        rejection_rows = [i for i, e in enumerate(entries) if uses_rejection(e, self.use_rejection)]
        proposal = None
        if self.is_leader:
            proposal = self.channel.propose(entries, committed, accepted, page_table, k_next, rejection_rows)
            features = proposal.features
            if self.parallel.is_parallel:
                send_features(features, group=self.parallel.group)
        else:
            features = receive_features(len(rejection_rows), k_next, self.hidden_size, self.markov_rank, self.dtype,
                                        self.device, group=self.parallel.group)
        for e in entries:
            self.pending.pop(e.request_id, None)
        for j, i in enumerate(rejection_rows):
            low = features.low_rank[j] if features.low_rank is not None else None
            self.pending[entries[i].request_id] = (features.hidden[j], low)
        return proposal

    def _draft_probs(self, entries: list[ScheduledRequest], by_rejection: list[bool], k_max: int) -> torch.Tensor:
        """q [S, K, V]: softmax(z / T) rebuilt from pending features, z = lm_head(h) + W2 low_rank."""
        q = torch.zeros(len(entries), k_max, self.vocab_size, device=self.device)
        for i, e in enumerate(entries):
            if not by_rejection[i]:
                continue
            h, low = self.pending[e.request_id]
            z = self.target.compute_logits(h[:e.num_drafts])
            if low is not None:
                z = z + self.draft_w2(low[:e.num_drafts]).float()
            q[i, :e.num_drafts] = torch.softmax(z / e.params.temperature, dim=-1)
        return q

    # ---- verification ------------------------------------------------------------------------

    def _logits(self, entries: list[ScheduledRequest], hidden: torch.Tensor, row_ends: list[int],
                batch_index: list[int], k_max: int, num_drafts: torch.Tensor, graphed: GraphOutputs | None,
                need_logits: bool = True):
        """-> (logits [S, K+1, V] or None, (top, argmax) [S, K+1] or None): the target's rows for each entry's
        anchor (or last prefill token) and drafts; rows past a short block repeat its last. A graphed step already
        computed them (logits in the model dtype, max and argmax): a full block's rows are the graph's as they lie,
        a ragged step's are gathered from it (no LM head of their own). Without ``need_logits`` (greedy, no
        logprobs, no penalties: the same answer on every TP rank) only the max and argmax are computed, per vocab
        slice under tensor parallelism (no logits gathered)."""
        num, dev, shape = len(entries), self.device, (len(entries), k_max + 1)
        if graphed is not None and num * (k_max + 1) == graphed.top.shape[0] \
                and all(e.num_drafts == k_max for e in entries):
            flat = None  # every request verifies a full block: the graph's rows as they lie
        else:
            offsets = torch.arange(k_max + 1, device=dev)  # [K+1]
            first = to_device([row_ends[b] - 1 - e.num_drafts for e, b in zip(entries, batch_index)], dev)
            flat = (first[:, None] + torch.minimum(offsets[None, :], num_drafts[:, None])).view(-1)  # [S*(K+1)]
        if graphed is not None:  # the graph computed every row (padding too): pick the entries' rows
            pick = (lambda t: t) if flat is None else (lambda t: t[flat])
            top_argmax = (pick(graphed.top).view(shape), pick(graphed.argmax).view(shape))
            if graphed.logits is not None:
                return pick(graphed.logits).view(*shape, -1), top_argmax
            if not need_logits:
                return None, top_argmax
            # tensor parallelism: the graph reduced only max/argmax; this step's logits come from its states
            return self.target.compute_logits(pick(hidden)).view(*shape, -1), top_argmax
        if not need_logits:
            top, argmax = self.target.compute_top_argmax(hidden[flat])
            return None, (top.view(shape), argmax.view(shape))
        return self.target.compute_logits(hidden[flat]).view(*shape, -1), None

    def _verify(self, entries: list[ScheduledRequest], hidden: torch.Tensor, row_ends: list[int],
                batch_index: list[int], graphed: GraphOutputs | None = None) -> Verified:
        """-> ``Verified``: committed tokens [S, K+1] (the first ``accepted + 1`` valid), accepted [S], faulty [S]
        (the requests whose (penalized) logits hold NaN or +inf), the ``LogprobSource`` of the entries that asked for
        logprobs (None when none did), and where a graph verified the block, its rows as they lie. Rows are independent,
        so a faulty request never changes another's tokens; the caller fails it alone. Row r of a request is the
        distribution of its r-th committed token, the one plain decoding would have computed for it, so logprobs do not
        depend on speculation."""
        dev, vocab = self.device, self.vocab_size
        num_drafts_list = [e.num_drafts for e in entries]
        k_max = max(num_drafts_list)
        if graphed is not None and graphed.block_verdict is not None and all(
                greedy_only(e) and len(e.token_ids) == e.num_drafts + 1 for e in entries):
            # greedy blocks of anchor + drafts: the graph verified them (runtime.sampling.verify.block_verdicts)
            rows, q_len = self._entry_rows(graphed.block_verdict, batch_index), graphed.q_len
            # the rows already lie as the read-back wants them: committed (q_len columns), accepted, fault flag
            return Verified(rows[:, :k_max + 1], rows[:, q_len], rows[:, q_len + 1], None, rows)
        offsets = torch.arange(k_max + 1, device=dev)  # [K+1]
        num_drafts = to_device(num_drafts_list, dev)  # [S]
        penalized = any(e.penalty_history is not None for e in entries)
        # rows the request's own parameters change: logit bias, allowed tokens, min_tokens' and bad words' bans, a
        # grammar's masks
        biased = any(e.params.logit_bias or e.banned is not None or e.token_mask is not None
                     or e.params.allowed_token_ids is not None or e.row_bans is not None for e in entries)
        greedy = all(e.params.greedy for e in entries)
        need_logits = penalized or biased or not greedy or any(e.params.logprobs is not None for e in entries)
        logits, top_argmax = self._logits(entries, hidden, row_ends, batch_index, k_max, num_drafts, graphed,
                                          need_logits)
        wanted = [i for i, e in enumerate(entries) if e.params.logprobs is not None] if self.is_leader else []
        source = LogprobSource(wanted, [entries[i].params.logprobs for i in wanted]) if wanted else None
        if source is not None and self.logprobs_mode == "raw":
            source.set_logits(logits)
        drafts = to_device([e.token_ids[len(e.token_ids) - e.num_drafts:] + [0] * (k_max - e.num_drafts)
                            for e in entries], dev, torch.int64).view(len(entries), k_max)  # [S, K]
        row_params = RowParams.build([e.params for e in entries for _ in range(k_max + 1)], vocab, dev) \
            if penalized or not greedy else None
        if penalized or biased or not greedy:
            logits = logits.float()
        if biased:  # (before penalties, as vLLM's logits processors)
            logits = logits + logit_bias_rows(entries, vocab, dev)[:, None, :]
            logits = mask_by_grammar(ban_tokens(logits, entries), entries)
            top_argmax = None
        if penalized:
            logits = self._penalize(logits, entries, drafts, row_params)
            top_argmax = None
        # [S, K+1]: NaN propagates into the max, so the one pass that finds the argmax finds faults too
        top, argmax = top_argmax if top_argmax is not None else logits.max(dim=-1)
        faulty = ~torch.isfinite(top).all(dim=1)
        if greedy:  # the argmax fast path: no distributions, no noise, no per-row parameters
            if source is not None and self.logprobs_mode == "processed":
                source.set_logits(logits)
            return Verified(*commit_by_match(drafts, num_drafts, argmax), faulty, source)
        anchor_pos = to_device([e.end_position - e.num_drafts for e in entries], dev)
        positions = anchor_pos[:, None] + offsets[None, :]  # [S, K+1]: position of the token each row decides
        seeds = to_device([e.seed for e in entries], dev)
        by_rejection = [uses_rejection(e, self.use_rejection) and e.num_drafts > 0 for e in entries]
        q = self._draft_probs(entries, by_rejection, k_max) if any(by_rejection) else None
        probs = filtered_probs(logits.view(-1, vocab), row_params).view_as(logits)  # [S, K+1, V]
        if source is not None and self.logprobs_mode == "processed":
            greedy_rows = to_device([e.params.greedy for e in entries], dev)
            source.set_processed(logits, probs, greedy_rows)
        seed_rows = seeds[:, None].expand_as(positions)
        noise = exponentials(seed_rows.reshape(-1), positions.reshape(-1), Stream.TARGET, vocab)
        target_tokens = self.kernels.sample_exponential_race(probs.view(-1, vocab), noise).view_as(positions)
        committed, accepted = commit_by_match(drafts, num_drafts, target_tokens)
        if q is None:
            return Verified(committed, accepted, faulty, source)
        rejection = to_device(by_rejection, dev)
        by_rule, accepted_by_rule = self._rejection_sample(drafts, num_drafts, probs, q, target_tokens, seeds,
                                                           positions)
        return Verified(torch.where(rejection[:, None], by_rule, committed),
                        torch.where(rejection, accepted_by_rule, accepted), faulty, source)

    def _rejection_sample(self, drafts, num_drafts, probs, q, target_tokens, seeds, positions):
        """Leviathan verification of every row -> (committed [S, K+1], accepted [S]): accepted drafts, then a
        draw from norm(max(0, p - q)) at the first rejection, or the bonus from p when all pass."""
        num, k_max = drafts.shape
        seed_rows = seeds[:, None].expand(num, k_max)
        u = uniform(seed_rows.reshape(-1), positions[:, :k_max].reshape(-1), Stream.ACCEPT).view(num, k_max)
        accepted = accept_by_rejection(drafts, num_drafts, probs, q, u)
        q_padded = torch.cat([q, q.new_zeros(num, 1, q.shape[-1])], dim=1)
        residual = residual_distribution(gather_rows(probs, accepted), gather_rows(q_padded, accepted))
        resampled = self.kernels.sample_exponential_race(
            residual, exponentials(seeds, gather_rows(positions, accepted), Stream.RESIDUAL, q.shape[-1]))
        next_token = torch.where(accepted < num_drafts, resampled, gather_rows(target_tokens, accepted))
        committed = torch.cat([drafts, drafts.new_zeros(num, 1)], dim=1)
        return committed.scatter(1, accepted[:, None], next_token[:, None]), accepted

    def _penalize(self, logits: torch.Tensor, entries: list[ScheduledRequest], drafts: torch.Tensor,
                  row_params: RowParams) -> torch.Tensor:
        """Penalties with counts that, at row r, include drafts d_1..d_r (the prefix of what row r decides)."""
        vocab = self.vocab_size
        counts, seen = occurrence_counts([e.penalty_history for e in entries], vocab, self.device)  # [S, V]
        in_block = torch.arange(drafts.shape[1], device=self.device)[None, :] < to_device(
            [e.num_drafts for e in entries], self.device)[:, None]
        draft_hits = torch.nn.functional.one_hot(drafts, vocab).float() * in_block[..., None]  # [S, K, V]
        prefix = logits.new_zeros(logits.shape)  # [S, K+1, V]
        prefix[:, 1:] = draft_hits.cumsum(dim=1)
        row_counts = counts[:, None] + prefix
        row_seen = seen[:, None] | (prefix > 0)
        flat = apply_penalties(logits.view(-1, vocab), row_counts.view(-1, vocab), row_seen.view(-1, vocab),
                               row_params)
        return flat.view_as(logits)
