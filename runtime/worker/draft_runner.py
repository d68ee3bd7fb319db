"""``DraftRunner``: the drafter, its paged context cache and the vocabulary modules it drafts with.

It lives in TP rank 0's process (``drafter="colocated"``, reading captured states in place) or in its
own process (``"separate"``, fed over ``torch.distributed``). Either way it sees the same plain-data
batch, so positions, slots and page tables are rebuilt here rather than sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.kernels import KernelBackend, PagedAttentionMeta
from runtime.kernels.transfer import to_device
from runtime.models.drafter import DSparkDrafter
from runtime.sampling.noise import Stream, exponentials
from runtime.scheduling.kv_cache import scrub_pages
from runtime.scheduling.step_io import ScheduledRequest
from runtime.spec.wire import confidence_as_ints
from runtime.worker.step_tensors import uses_rejection


@dataclass(frozen=True, slots=True)
class DraftSampling:
    """Per-request drawing of drafts (requests verified by rejection sampling draw, the others take the argmax)."""

    drawn: torch.Tensor  # [S] bool
    temperature: torch.Tensor  # [S, 1]
    seeds: torch.Tensor  # [S]


@dataclass(frozen=True, slots=True)
class DraftOutput:
    tokens: torch.Tensor  # [S, K] drafts per sampled request
    lengths: torch.Tensor  # [S] proposed lengths after confidence truncation
    hidden: torch.Tensor  # [S, K, d] block states after the final norm (rebuild U_k = lm_head(h_k))
    low_rank: torch.Tensor | None  # [S, K, r] Markov features (z_k = U_k + W2 low_rank_k), None at rank 0
    confidence: torch.Tensor | None = None  # [S, K] the confidence head's c_k (None without a head)
    # [S, K + 1 (+ K)] int64: tokens, length (and the confidences as c * 2^24): what the step reads back of the block,
    # packed where it is drafted (inside the drafter's graph), so the read-back needs no conversion kernels
    block: torch.Tensor | None = None

    def rows(self, num: int) -> DraftOutput:
        """The first ``num`` requests' rows (a graph's output holds its padding rows too)."""
        cut = (lambda t: t[:num] if t is not None else None)
        return DraftOutput(self.tokens[:num], self.lengths[:num], self.hidden[:num], cut(self.low_rank),
                           cut(self.confidence), cut(self.block))


class DraftRunner:
    def __init__(self, drafter: DSparkDrafter, embed: nn.Module, lm_head: nn.Module, caches, kernels: KernelBackend,
                 use_rejection_sampling: bool, confidence_threshold: float | None, device: torch.device):
        self.drafter, self.embed, self.lm_head, self.caches = drafter, embed, lm_head, caches
        self.kernels, self.device = kernels, device
        self.use_rejection = use_rejection_sampling
        self.confidence_threshold = confidence_threshold
        self.graphs = None  # DraftGraphs, set by the worker when drafts are graphed

    def scrub(self, page_ids: list[int]) -> None:
        scrub_pages(self.caches, page_ids, self.device)

    def append_context(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.drafter.append_context(captured, positions, slots, self.caches)

    def draft(self, entries: list[ScheduledRequest], committed: torch.Tensor, accepted: torch.Tensor,
              page_table: torch.Tensor, k_next: int) -> DraftOutput:
        """Draft a block from each request's new anchor (its last committed token).

        committed [S, K+1], accepted [S]: the verification outcome; page_table [S, P] of the entries.
        """
        anchors = committed.gather(1, accepted[:, None]).squeeze(1)  # [S]: one kernel (gather_rows takes two)
        base = to_device([e.end_position - e.num_drafts for e in entries], self.device)
        anchor_pos = base + accepted  # = the drafter's context length
        drawn_rows = [uses_rejection(e, self.use_rejection) for e in entries]
        if self.graphs is not None and not any(drawn_rows) and self.graphs.serves(len(entries), k_next):
            return self.graphs.run(anchors, anchor_pos, page_table, k_next)
        sampling = None
        if any(drawn_rows):
            temperature = to_device([max(e.params.temperature, 1e-5) for e in entries], self.device)[:, None]
            sampling = DraftSampling(to_device(drawn_rows, self.device), temperature,
                                     to_device([e.seed for e in entries], self.device))
        return self.draft_block(anchors, anchor_pos, page_table, k_next, sampling)

    def draft_block(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, page_table: torch.Tensor, k_next: int,
                    sampling: DraftSampling | None = None) -> DraftOutput:
        """The block forward, Markov chain and confidence for anchors [S] at positions anchor_pos [S] (= each
        request's context length) with page_table [S, P]: device tensors only, so a CUDA graph can capture it
        (``sampling`` None: every draft is an argmax)."""
        num, dev = anchors.shape[0], self.device
        block_ids = torch.full((num, k_next), self.drafter.spec.mask_token_id, device=dev, dtype=torch.int64)
        block_ids[:, 0] = anchors
        page_size = self.caches[0][0].shape[1]
        meta = self.kernels.plan_attention(PagedAttentionMeta(
            query_start_loc=torch.arange(num + 1, device=dev) * k_next, seq_lens=anchor_pos, page_table=page_table,
            max_query_len=k_next, max_seq_len=page_table.shape[1] * page_size, causal=False,
            num_tokens=num * k_next, page_size=page_size, num_extra_keys=k_next,
            context_window=self.drafter.spec.context_window))
        positions = (anchor_pos[:, None] + torch.arange(k_next, device=dev)).view(-1)
        hidden = self.drafter.forward_block(self.embed(block_ids), positions, self.caches, meta)  # [S, K, d]
        base_logits = self.lm_head(hidden).float()  # [S, K, V]
        tokens, low_rank = self._markov_chain(base_logits, hidden, anchors, anchor_pos, sampling)
        lengths = torch.full((num,), k_next, device=dev, dtype=torch.int64)
        confidence = self.drafter.confidence(hidden, torch.cat([anchors[:, None], tokens[:, :-1]], dim=1))
        if confidence is not None and self.confidence_threshold is not None:
            lengths = (confidence >= self.confidence_threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
        parts = [tokens, lengths[:, None]] + ([confidence_as_ints(confidence)] if confidence is not None else [])
        return DraftOutput(tokens, lengths, hidden, low_rank, confidence, torch.cat(parts, dim=1))

    def _markov_chain(self, base_logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
                      anchor_pos: torch.Tensor, sampling: DraftSampling | None):
        """Left to right: z_k = U_k + W2 low_rank(x_{k-1}, h_k, s_{k-1}); x_k = argmax z_k, or a draw from
        softmax(z_k / T) for requests verified by rejection sampling (DeepSpec's factorization)."""
        num, k_next, vocab = base_logits.shape
        head = self.drafter.markov_head
        prev, state = anchors, head.initial_state(num, hidden) if head is not None else None
        tokens, low_ranks = [], []
        for k in range(k_next):
            z = base_logits[:, k]
            low_rank = None
            if head is not None:
                low_rank, state = head.low_rank(prev, hidden[:, k], state)
                low_ranks.append(low_rank)
            if head is not None and sampling is None:  # greedy drafting: product, add and argmax in one kernel
                token = self.kernels.markov_argmax(z, low_rank, head.markov_w2.weight)
            else:
                if head is not None:
                    z = z + head.markov_w2(low_rank).float()
                token = z.argmax(dim=-1)
                if sampling is not None:
                    q = torch.softmax(z / sampling.temperature, dim=-1)
                    noise = exponentials(sampling.seeds, anchor_pos + 1 + k, Stream.DRAFT, vocab)
                    token = torch.where(sampling.drawn, self.kernels.sample_exponential_race(q, noise), token)
            tokens.append(token)
            prev = token
        return torch.stack(tokens, dim=1), (torch.stack(low_ranks, dim=1) if low_ranks else None)
