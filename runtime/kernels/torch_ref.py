"""Pure-torch reference kernels: the semantics every other backend must match, and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.interface import PagedAttentionMeta


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    # k_cache, v_cache: [P, S, Hkv, D]; slots: [T]; k, v: [T, Hkv, D]
    num_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """[P, S, H, D] cache -> [B, length, H, D]: each request's first ``length`` cached tokens."""
    page_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    slots = page_table[:, pos // page_size] * page_size + pos % page_size  # [B, length]
    return cache.view(-1, *cache.shape[2:])[slots]


def pad_queries(q: torch.Tensor, meta: PagedAttentionMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat q [T, H, D] -> padded [B, Lq, H, D], the validity mask [B, Lq], and flat row index [B, Lq]."""
    starts = meta.query_start_loc[:-1]
    q_lens = meta.query_start_loc[1:] - starts  # [B]
    offs = torch.arange(meta.max_query_len, device=q.device)
    valid = offs[None, :] < q_lens[:, None]  # [B, Lq]
    rows = (starts[:, None] + offs[None, :]).clamp(max=max(q.shape[0] - 1, 0))
    return q[rows], valid, rows


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMeta,
                    scale: float, extra_k: torch.Tensor | None = None,
                    extra_v: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, Hq, D] -> [T, Hq, D]
    qp, q_valid, rows = pad_queries(q, meta)  # [B, Lq, Hq, D]
    k = gather_pages(k_cache, meta.page_table, meta.max_seq_len)  # [B, Lk, Hkv, D]
    v = gather_pages(v_cache, meta.page_table, meta.max_seq_len)
    key_pos = torch.arange(meta.max_seq_len, device=q.device)
    allowed = (key_pos[None, None, :] < meta.seq_lens[:, None, None])  # [B, 1, Lk]
    if meta.causal:
        q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        q_pos = meta.seq_lens[:, None] - q_lens[:, None] + torch.arange(meta.max_query_len, device=q.device)
        allowed = allowed & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Lq, Lk]
    allowed = allowed.expand(-1, meta.max_query_len, -1)
    if extra_k is not None:
        k = torch.cat([k, extra_k.to(k.dtype)], dim=1)
        v = torch.cat([v, extra_v.to(v.dtype)], dim=1)
        allowed = torch.cat([allowed, allowed.new_ones(*allowed.shape[:2], extra_k.shape[1])], dim=2)
    # Padding query rows would see no key (NaN); let them see everything, they are dropped below.
    allowed = allowed | ~q_valid[:, :, None]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=allowed[:, None], scale=scale, enable_gqa=qp.shape[2] != k.shape[2])  # [B, Hq, Lq, D]
    out = out.transpose(1, 2)  # [B, Lq, Hq, D]
    result = torch.empty_like(q)
    result[rows[q_valid]] = out[q_valid]
    return result


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def sample_exponential_race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    # probs, exponentials: [R, V] -> [R]; argmax(p_i / E_i) is an exact categorical draw.
    return (probs / exponentials).argmax(dim=-1)


class TorchReference:
    """The ``torch`` backend: always registered, runs on any device."""

    name = "torch"
    write_kv = staticmethod(write_kv)
    paged_attention = staticmethod(paged_attention)
    rms_norm = staticmethod(rms_norm)
    sample_exponential_race = staticmethod(sample_exponential_race)
