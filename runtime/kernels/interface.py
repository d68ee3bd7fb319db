"""The kernel contract: attention metadata and the ops every backend implements.

A backend is a ``KernelBackend``: plain functions over tensors, no state. The pure-torch
reference (``torch_ref``) defines the semantics; other backends must match it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class HostLayout:
    """The host's copy of a forward's attention layout (plain lists), for backends that plan on the host."""

    qo_lens: list[int]  # [B] query tokens per request
    kv_lens: list[int]  # [B] cached keys each request's queries see (equal to seq_lens)
    page_ids: list[list[int]]  # per request, pages covering kv_lens


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """What a backend needs to plan attention besides the layout: this rank's head counts, dtype and scale."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float


@dataclass(frozen=True, slots=True)
class PagedAttentionMeta:
    """Where the queries of one forward sit in the paged KV cache.

    Requests are laid out back to back in the flat token dimension. Request ``b`` has
    ``query_start_loc[b+1] - query_start_loc[b]`` query tokens, which are the *last* tokens
    of its ``seq_lens[b]`` cached keys (their K/V are written before attention runs).
    """

    query_start_loc: torch.Tensor  # [B+1] int64, cumulative query counts
    seq_lens: torch.Tensor  # [B] int64, cached keys visible to each request
    page_table: torch.Tensor  # [B, max_pages] int64, page ids (padding: any valid id)
    max_query_len: int  # host int: max query tokens of one request
    max_seq_len: int  # host int: upper bound of seq_lens
    causal: bool  # True: query i sees keys up to its own position; False: every visible key
    num_tokens: int  # host int: query tokens in the flat dimension (T)
    page_size: int  # tokens per KV page
    num_extra_keys: int = 0  # per-request extra keys every query sees (the draft block's own K/V)
    context_window: int | None = None  # with extra keys: only the last N cached keys are visible (None: all)
    plan: object | None = None  # backend-specific precomputation, from ``plan_attention`` (once per forward)
    host: HostLayout | None = None  # the layout on the host, when it is known there (target forwards)
    geometry: AttentionGeometry | None = None  # lets ``plan_attention`` plan fully up front (CUDA graphs)


class KernelBackend(Protocol):
    name: str

    def plan_attention(self, meta: PagedAttentionMeta) -> PagedAttentionMeta:
        """Precompute what every layer of one forward shares (indices, masks, kernel plans); call once per
        forward and pass the returned meta to each layer's ``paged_attention``."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` [T, Hkv, D] at flat slots [T] of caches [P, S, Hkv, D]."""

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: PagedAttentionMeta, scale: float, extra_k: torch.Tensor | None = None,
                        extra_v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over each request's cached keys, plus optional per-request
        extra keys/values [B, X, Hkv, D] that every query of the request sees (the draft block's own
        K/V, never cached). Returns [T, Hq, D]."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in float32, returned in x's dtype."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x) for x, residual [T, d]: the pre-norm block's residual add fused
        with the next norm."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2n] (gate, up halves) -> silu(gate) * up [T, n]."""

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm (weights None: no norm, Llama) then rotary embedding of q [T, Hq, D] and k [T, Hkv, D]
        (views may be strided, e.g. slices of a fused qkv projection) at tables cos, sin [T, D]. Returns
        contiguous (q, k) of the same shapes."""

    def rope_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       q_index: torch.Tensor | None = None, q_rows: int = 0) -> torch.Tensor:
        """``qk_norm_rope`` then ``write_kv`` of the rotated k and of v at ``slots``; returns the rotated q [T, Hq,
        D], or with ``q_index`` [T] (distinct rows) a [q_rows, Hq, D] tensor holding row t's q at row
        ``q_index[t]`` and zeros elsewhere (a packed verify's queries in the uniform layout attention is planned
        for, ``runtime.worker.packed_verify``)."""

    def rope_and_cache_kv(self, k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor | None, eps: float,
                          cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor) -> None:
        """``rope_and_cache`` without queries: k [T, Hkv, D] normed (``k_weight`` None: no norm) and rotated at
        tables cos, sin [T, D], it and v [T, Hkv, D] written at ``slots`` [T] (a drafter's context append: one
        kernel where the norm, the rotation and the two writes took nine)."""

    def sample_exponential_race(self, probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
        """Categorical sample per row of probs [R, V] given Exp(1) noise [R, V]: argmax(p / E)."""

    def markov_argmax(self, base: torch.Tensor, low_rank: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One greedy step of the Markov head: argmax over V of base [S, V] (float32; rows may be strided) plus
        ``low_rank`` [S, r] @ ``weight`` [V, r]^T rounded to the weight's dtype (what ``nn.Linear`` returns), the
        first index on ties -> [S] int64 token ids."""
