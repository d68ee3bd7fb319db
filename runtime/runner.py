"""``ModelRunner``: the one owner of device state (models, KV pages, draft distributions).

One step (``execute``): the target runs every scheduled token (prefill chunks and ``[anchor, d_1..d_k]``
blocks) capturing ``target_layer_ids``; the drafter appends the captured states to its context (all
fed rows are written; rows past the accepted prefix are overwritten before they are ever read, the
context length being the target's); verification commits each request's accepted prefix plus one
target token; the drafter drafts the next block from the new anchor. Everything returns to the host
in one transfer at the end.
"""

from __future__ import annotations

import torch

from configs import DSparkDecodingConfig
from runtime.kernels import KernelBackend, PagedAttentionMeta
from runtime.models.drafter import DSparkDrafter
from runtime.models.target import TargetModel
from runtime.noise import Stream, exponentials, uniform
from runtime.sampler import RowParams, apply_penalties, filtered_probs, occurrence_counts
from runtime.step_io import RequestStepResult, ScheduledBatch, ScheduledRequest
from runtime.verify import accept_by_rejection, commit_by_match, gather_rows, residual_distribution

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_caches(model: torch.nn.Module, num_pages: int, page_size: int, dtype: torch.dtype,
                    device: torch.device) -> KVCaches:
    """One (k, v) pair [num_pages, page_size, Hkv, D] per attention layer of ``model``."""
    caches = []
    for layer in model.layers if hasattr(model, "layers") else model.model.layers:
        attn = layer.self_attn
        shape = (num_pages, page_size, attn.k_proj.out_features // attn.head_dim, attn.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
    return caches


class ModelRunner:
    def __init__(self, target: TargetModel, drafter: DSparkDrafter | None, spec: DSparkDecodingConfig | None,
                 kernels: KernelBackend, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.target, self.drafter, self.kernels = target, drafter, kernels
        self.page_size, self.device = page_size, device
        self.vocab_size = target.config.vocab_size
        self.target_caches = allocate_caches(target, num_pages, page_size, dtype, device)
        self.drafter_caches = allocate_caches(drafter, num_pages, page_size, dtype, device) if drafter else []
        self.use_rejection = bool(spec and spec.use_rejection_sampling)
        self.confidence_threshold = spec.confidence_threshold if spec else None
        self.mask_token_id = drafter.spec.mask_token_id if drafter else 0
        self.draft_probs: dict[str, torch.Tensor] = {}  # request id -> q [k, V] the pending drafts came from

    @staticmethod
    def bytes_per_page(target: TargetModel, drafter: DSparkDrafter | None, page_size: int, dtype: torch.dtype) -> int:
        layers = list(target.model.layers) + (list(drafter.layers) if drafter else [])
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(2 * page_size * layer.self_attn.k_proj.out_features * itemsize for layer in layers)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        for request_id in batch.released_request_ids:
            self.draft_probs.pop(request_id, None)
        reqs = batch.requests
        if not reqs:
            return []
        tensors = self._step_tensors(reqs)
        hidden, captured = self.target(tensors["input_ids"], tensors["positions"], self.target_caches,
                                       tensors["meta"], tensors["slots"])
        drafting = self.drafter is not None and batch.maintain_draft_context
        if drafting and captured is not None:
            self.drafter.append_context(captured, tensors["positions"], tensors["slots"], self.drafter_caches)
        sampled = [i for i, r in enumerate(reqs) if r.sample]
        if not sampled:
            return [RequestStepResult(r.request_id, [], 0, []) for r in reqs]
        entries = [reqs[i] for i in sampled]
        committed, accepted = self._verify(entries, hidden, tensors["query_start_loc_cpu"], sampled)
        k_next = batch.num_next_drafts if drafting else 0
        drafts, lengths = self._draft(entries, committed, accepted, tensors["page_table"][sampled], k_next)
        host = torch.cat([committed, accepted[:, None], drafts, lengths[:, None]], dim=1).tolist()
        results = {r.request_id: RequestStepResult(r.request_id, [], 0, []) for r in reqs}
        width = committed.shape[1]
        for entry, row in zip(entries, host):
            a = row[width]
            results[entry.request_id] = RequestStepResult(
                entry.request_id, row[:a + 1], a, row[width + 1: width + 1 + row[-1]])
        return list(results.values())

    # ---- the target forward -----------------------------------------------------------------

    def _step_tensors(self, reqs: list[ScheduledRequest]) -> dict:
        dev = self.device
        lens = [len(r.token_ids) for r in reqs]
        starts = torch.tensor([r.start_position for r in reqs], device=dev)
        qsl_cpu = [0]
        for n in lens:
            qsl_cpu.append(qsl_cpu[-1] + n)
        qsl = torch.tensor(qsl_cpu, device=dev)
        req_of_token = torch.repeat_interleave(torch.arange(len(reqs), device=dev), torch.tensor(lens, device=dev))
        positions = starts[req_of_token] + torch.arange(qsl_cpu[-1], device=dev) - qsl[req_of_token]
        max_pages = max(len(r.page_ids) for r in reqs)
        page_table = torch.tensor([r.page_ids + [0] * (max_pages - len(r.page_ids)) for r in reqs], device=dev)
        slots = page_table[req_of_token, positions // self.page_size] * self.page_size + positions % self.page_size
        meta = PagedAttentionMeta(query_start_loc=qsl, seq_lens=starts + torch.tensor(lens, device=dev),
                                  page_table=page_table, max_query_len=max(lens),
                                  max_seq_len=max(r.end_position for r in reqs), causal=True)
        input_ids = torch.tensor([t for r in reqs for t in r.token_ids], device=dev)
        return {"input_ids": input_ids, "positions": positions, "slots": slots, "meta": meta,
                "page_table": page_table, "query_start_loc_cpu": qsl_cpu}

    # ---- verification ------------------------------------------------------------------------

    def _verify(self, entries: list[ScheduledRequest], hidden: torch.Tensor, qsl: list[int],
                batch_index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> committed tokens [S, K+1] (the first ``accepted + 1`` valid) and accepted [S]."""
        dev, vocab = self.device, self.vocab_size
        k_max = max(e.num_drafts for e in entries)
        rows, produced_at = [], []
        for e, b in zip(entries, batch_index):
            first = qsl[b + 1] - 1 - e.num_drafts  # the row of the anchor (or the last prefill token)
            rows.append([first + min(r, e.num_drafts) for r in range(k_max + 1)])
            produced_at.append([e.end_position - e.num_drafts + r for r in range(k_max + 1)])
        rows_t = torch.tensor(rows, device=dev)  # [S, K+1]
        positions = torch.tensor(produced_at, device=dev)  # [S, K+1]: position of the token each row decides
        drafts = torch.tensor([e.token_ids[1:] + [0] * (k_max - e.num_drafts) if e.num_drafts else [0] * k_max
                               for e in entries], device=dev, dtype=torch.int64)  # [S, K]
        num_drafts = torch.tensor([e.num_drafts for e in entries], device=dev)
        seeds = torch.tensor([e.seed for e in entries], device=dev)
        logits = self.target.compute_logits(hidden[rows_t.view(-1)]).view(len(entries), k_max + 1, vocab)
        row_params = RowParams.build([e.params for e in entries for _ in range(k_max + 1)], vocab, dev)
        if any(e.penalty_history is not None for e in entries):
            logits = self._penalize(logits, entries, drafts, row_params)
        probs = filtered_probs(logits.view(-1, vocab), row_params).view_as(logits)  # [S, K+1, V]
        seed_rows = seeds[:, None].expand_as(positions).reshape(-1)
        noise = exponentials(seed_rows, positions.reshape(-1), Stream.TARGET, vocab)
        target_tokens = self.kernels.sample_exponential_race(probs.view(-1, vocab), noise).view_as(positions)
        committed_match, accepted = commit_by_match(drafts, num_drafts, target_tokens)
        by_rejection = [self.use_rejection and not e.params.greedy and e.num_drafts > 0 for e in entries]
        if not any(by_rejection):
            return committed_match, accepted
        rejection_rows = torch.tensor(by_rejection, device=dev)
        q = torch.zeros(len(entries), k_max, vocab, device=dev)
        for i, e in enumerate(entries):
            if by_rejection[i]:
                q[i, :e.num_drafts] = self.draft_probs[e.request_id][:e.num_drafts]
        u = uniform(seed_rows.view_as(positions)[:, :k_max].reshape(-1), positions[:, :k_max].reshape(-1),
                    Stream.ACCEPT).view(len(entries), k_max)
        accepted_rej = accept_by_rejection(drafts, num_drafts, probs, q, u)
        accepted = torch.where(rejection_rows, accepted_rej, accepted)
        at = gather_rows(positions, accepted)
        residual = residual_distribution(gather_rows(probs, accepted), gather_rows(
            torch.cat([q, q.new_zeros(len(entries), 1, vocab)], dim=1), accepted))
        resampled = self.kernels.sample_exponential_race(residual, exponentials(seeds, at, Stream.RESIDUAL, vocab))
        rejected = accepted < num_drafts
        next_token = torch.where(rejected, resampled, gather_rows(target_tokens, accepted))
        committed = torch.cat([drafts, drafts.new_zeros(len(entries), 1)], dim=1)
        committed = committed.scatter(1, accepted[:, None], next_token[:, None])
        return torch.where(rejection_rows[:, None], committed, committed_match), accepted

    def _penalize(self, logits: torch.Tensor, entries: list[ScheduledRequest], drafts: torch.Tensor,
                  row_params: RowParams) -> torch.Tensor:
        """Penalties with counts that, at row r, include drafts d_1..d_r (the prefix of what row r decides)."""
        vocab = self.vocab_size
        counts, seen = occurrence_counts([e.penalty_history for e in entries], vocab, self.device)  # [S, V]
        in_block = torch.arange(drafts.shape[1], device=self.device)[None, :] < torch.tensor(
            [e.num_drafts for e in entries], device=self.device)[:, None]
        draft_hits = torch.nn.functional.one_hot(drafts, vocab).float() * in_block[..., None]  # [S, K, V]
        prefix = logits.new_zeros(logits.shape)  # [S, K+1, V]
        prefix[:, 1:] = draft_hits.cumsum(dim=1)
        row_counts = counts[:, None] + prefix
        row_seen = seen[:, None] | (prefix > 0)
        flat = apply_penalties(logits.view(-1, vocab), row_counts.view(-1, vocab), row_seen.view(-1, vocab), row_params)
        return flat.view_as(logits)

    # ---- drafting -----------------------------------------------------------------------------

    def _draft(self, entries: list[ScheduledRequest], committed: torch.Tensor, accepted: torch.Tensor,
               page_table: torch.Tensor, k_next: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft the next block from each new anchor -> tokens [S, k_next], proposed lengths [S]."""
        num = len(entries)
        if k_next == 0:
            return committed.new_zeros(num, 0), committed.new_zeros(num)
        dev, vocab = self.device, self.vocab_size
        anchors = gather_rows(committed, accepted)  # [S]
        base = torch.tensor([e.end_position - e.num_drafts for e in entries], device=dev)
        anchor_pos = base + accepted  # the anchor's position = the drafter's context length
        block_ids = torch.full((num, k_next), self.mask_token_id, device=dev, dtype=torch.int64)
        block_ids[:, 0] = anchors
        positions = (anchor_pos[:, None] + torch.arange(k_next, device=dev)).view(-1)
        meta = PagedAttentionMeta(query_start_loc=torch.arange(num + 1, device=dev) * k_next, seq_lens=anchor_pos,
                                  page_table=page_table, max_query_len=k_next,
                                  max_seq_len=max(e.end_position for e in entries), causal=False)
        embeds = self.target.model.embed_tokens(block_ids)
        hidden = self.drafter.forward_block(embeds, positions, self.drafter_caches, meta)  # [S, K, d]
        base_logits = self.target.compute_logits(hidden.view(num * k_next, -1)).view(num, k_next, vocab)
        sampled_rows = [self.use_rejection and not e.params.greedy for e in entries]
        tokens, q = self._markov_chain(base_logits, hidden, anchors, anchor_pos, entries, sampled_rows)
        lengths = torch.full((num,), k_next, device=dev, dtype=torch.int64)
        confidence = self.drafter.confidence(hidden, torch.cat([anchors[:, None], tokens[:, :-1]], dim=1))
        if confidence is not None and self.confidence_threshold is not None:
            lengths = (confidence >= self.confidence_threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
        for i, e in enumerate(entries):
            if sampled_rows[i]:
                self.draft_probs[e.request_id] = q[i]
            else:
                self.draft_probs.pop(e.request_id, None)
        return tokens, lengths

    def _markov_chain(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                      anchor_pos: torch.Tensor, entries: list[ScheduledRequest],
                      sampled_rows: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left to right: z_k = U_k (+ Markov(x_{k-1})); x_k = argmax z_k, or a draw from softmax(z_k / T)
        for rows verified by rejection sampling. -> tokens [S, K], q [S, K, V] (sampled rows) or None."""
        num, k_next, vocab = base_logits.shape
        head = self.drafter.markov_head
        sampling = any(sampled_rows)
        sampled = torch.tensor(sampled_rows, device=self.device)
        temperature = torch.tensor([max(e.params.temperature, 1e-5) for e in entries], device=self.device)[:, None]
        seeds = torch.tensor([e.seed for e in entries], device=self.device)
        prev, state = anchors, head.initial_state(num, hidden) if head is not None else None
        tokens, qs = [], []
        for k in range(k_next):
            z = base_logits[:, k]
            if head is not None:
                z, state = head.step(z, prev, hidden[:, k], state)
            token = z.argmax(dim=-1)
            if sampling:
                q = torch.softmax(z / temperature, dim=-1)
                drawn = self.kernels.sample_exponential_race(q, exponentials(seeds, anchor_pos + 1 + k, Stream.DRAFT, vocab))
                token = torch.where(sampled, drawn, token)
                qs.append(q)
            tokens.append(token)
            prev = token
        return torch.stack(tokens, dim=1), (torch.stack(qs, dim=1) if sampling else None)
