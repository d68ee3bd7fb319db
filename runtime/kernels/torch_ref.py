"""Pure-torch reference kernels: the semantics every other backend must match, and the CPU path.

No host synchronization: every index is derived on the device from host-known sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from runtime.kernels.interface import PagedAttentionMeta

# cuDNN's SDPA re-plans for every new sequence length (milliseconds of host time per call): keep it out.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True, slots=True)
class TorchAttentionPlan:
    padded_index: torch.Tensor  # [T] row of each query in the padded [B * Lq] layout
    key_slots: torch.Tensor  # [B, Lk] flat cache slot of each request's k-th cached key
    allowed: torch.Tensor  # [B, 1, Lq, Lk + X] attention mask (True = attend)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    # k_cache, v_cache: [P, S, Hkv, D]; slots: [T]; k, v: [T, Hkv, D]
    num_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def plan_attention(meta: PagedAttentionMeta) -> PagedAttentionMeta:
    dev = meta.seq_lens.device
    batch, lq, lk = meta.seq_lens.shape[0], meta.max_query_len, meta.max_seq_len
    qsl = meta.query_start_loc
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    num_tokens = meta.num_tokens
    request = torch.repeat_interleave(torch.arange(batch, device=dev), q_lens, output_size=num_tokens)
    padded_index = request * lq + torch.arange(num_tokens, device=dev) - qsl[request]
    page_size = meta.page_size
    pos = torch.arange(lk, device=dev)
    key_slots = meta.page_table[:, pos // page_size] * page_size + pos % page_size
    allowed = (pos[None, None, :] < meta.seq_lens[:, None, None]).expand(batch, lq, lk)  # [B, Lq, Lk]
    if meta.context_window is not None:  # a rolling window over the context: its last N keys only
        allowed = allowed & (pos[None, None, :] >= meta.seq_lens[:, None, None] - meta.context_window)
    if meta.causal:
        q_pos = meta.seq_lens[:, None] - q_lens[:, None] + torch.arange(lq, device=dev)
        allowed = allowed & (pos[None, None, :] <= q_pos[:, :, None])
    if meta.num_extra_keys:
        allowed = torch.cat([allowed, allowed.new_ones(batch, lq, meta.num_extra_keys)], dim=2)
    q_valid = torch.zeros(batch * lq, dtype=torch.bool, device=dev).index_fill_(0, padded_index, True)
    allowed = allowed | ~q_valid.view(batch, lq, 1)  # padding rows see everything; they are dropped
    plan = TorchAttentionPlan(padded_index, key_slots, allowed[:, None])
    return dataclasses.replace(meta, plan=plan)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMeta,
                    scale: float, extra_k: torch.Tensor | None = None,
                    extra_v: torch.Tensor | None = None) -> torch.Tensor:
    # q: [T, Hq, D] -> [T, Hq, D]
    plan: TorchAttentionPlan = meta.plan if meta.plan is not None else plan_attention(meta).plan
    batch, lq = meta.seq_lens.shape[0], meta.max_query_len
    heads, dim = q.shape[1:]
    qp = q.new_zeros(batch * lq, heads, dim).index_copy_(0, plan.padded_index, q).view(batch, lq, heads, dim)
    k = k_cache.view(-1, *k_cache.shape[2:])[plan.key_slots]  # [B, Lk, Hkv, D]
    v = v_cache.view(-1, *v_cache.shape[2:])[plan.key_slots]
    if extra_k is not None:
        k = torch.cat([k, extra_k.to(k.dtype)], dim=1)
        v = torch.cat([v, extra_v.to(v.dtype)], dim=1)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=plan.allowed, scale=scale,
                                             enable_gqa=qp.shape[2] != k.shape[2])  # [B, Hq, Lq, D]
    return out.transpose(1, 2).reshape(batch * lq, heads, dim)[plan.padded_index]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D] (rotate-half convention)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None:
        q = rms_norm(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm(k, k_weight, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                   k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   q_index: torch.Tensor | None = None, q_rows: int = 0) -> torch.Tensor:
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
    write_kv(k_cache, v_cache, slots, k, v)
    if q_index is None:
        return q
    return q.new_zeros((q_rows, *q.shape[1:])).index_copy_(0, q_index, q)


def rope_and_cache_kv(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    if k_weight is not None:
        k = rms_norm(k, k_weight, eps)
    write_kv(k_cache, v_cache, slots, apply_rope(k, cos, sin), v)


def sample_exponential_race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    # probs, exponentials: [R, V] -> [R]; argmax(p_i / E_i) is an exact categorical draw.
    return (probs / exponentials).argmax(dim=-1)


def markov_argmax(base: torch.Tensor, low_rank: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(base [S, V] + (low_rank [S, r] @ weight [V, r]^T in the weight's dtype)).argmax(-1) -> [S]."""
    return (base + F.linear(low_rank, weight).float()).argmax(dim=-1)


class TorchReference:
    """The ``torch`` backend: always registered, runs on any device."""

    name = "torch"
    write_kv = staticmethod(write_kv)
    plan_attention = staticmethod(plan_attention)
    paged_attention = staticmethod(paged_attention)
    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    qk_norm_rope = staticmethod(qk_norm_rope)
    rope_and_cache = staticmethod(rope_and_cache)
    rope_and_cache_kv = staticmethod(rope_and_cache_kv)
    sample_exponential_race = staticmethod(sample_exponential_race)
    markov_argmax = staticmethod(markov_argmax)
