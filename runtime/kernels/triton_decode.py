"""Split-KV paged attention for decode and verify steps in one Triton launch (the merge of the splits included).

A graphed decode step at small batch runs FlashInfer's attention as two kernels a layer, the split-KV pass and
the merge of its partial results (Qwen3-8B shape, batch 1, 548 keys: 9.2 + 2.2 us a layer on an H200 for 2.2 MB of
keys, ~0.41 ms of a 5.2 ms step). Here one launch does both: program (b, h, s) attends query rows of request b
and kv head h (its ``GROUP`` q heads x ``Q`` query tokens) to the s-th of ``SPLITS`` slices of the request's keys
(online softmax over tiles), writes a partial output and log-sum-exp, and the last program of (b, h) to finish
(an atomic ticket) merges the ``SPLITS`` partials in split order and writes the output, then resets its ticket for
the next launch. The merge order is fixed, so the result does not depend on which program merges: deterministic.

The page table is FlashInfer's (``kv_indptr`` [B+1], ``kv_indices``, ``kv_last_page_len`` [B], int32), so a
graph's decode wrapper buffers serve both kernels; every length is read on the device (CUDA-graph safe). Query
token i of a request with L keys sees keys 0..L - Q + i (its own block causally, as the prefill kernel's causal
mask aligned to the last key). Importing this module needs triton; the kernel needs CUDA tensors (or Triton's
interpreter: the CPU tests run it there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 32  # keys per inner step


@triton.jit
def _split_kv_kernel(q_ptr, k_ptr, v_ptr, indptr_ptr, indices_ptr, last_ptr, part_o_ptr, part_lse_ptr, ticket_ptr,
                     out_ptr, scale, num_q_heads, num_kv_heads,
                     PAGE: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, Q: tl.constexpr, M: tl.constexpr,
                     SPLITS: tl.constexpr, TILE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    rows = tl.arange(0, M)  # row r: query token r // GROUP, q head h * GROUP + r % GROUP
    dims = tl.arange(0, D)
    token = rows // GROUP
    row_ok = rows < Q * GROUP
    q_off = ((b * Q + token) * num_q_heads + h * GROUP + rows % GROUP)[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    first_page = tl.load(indptr_ptr + b)
    kv_len = (tl.load(indptr_ptr + b + 1) - first_page - 1) * PAGE + tl.load(last_ptr + b)
    per_split = tl.cdiv(tl.cdiv(kv_len, SPLITS), TILE) * TILE  # whole tiles per slice
    start = s * per_split
    end = tl.minimum(start + per_split, kv_len)
    limit = kv_len - Q + token  # [M] the last key each row sees
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, D], dtype=tl.float32)
    cols = tl.arange(0, TILE)
    for k0 in range(start, end, TILE):
        pos = k0 + cols
        key_ok = pos < end
        page = tl.load(indices_ptr + first_page + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        kv_off = ((page * PAGE + pos % PAGE) * num_kv_heads + h)[:, None] * D + dims[None, :]
        k = tl.load(k_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(key_ok[None, :] & (pos[None, :] <= limit[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        slot = (b * num_kv_heads + h) * SPLITS
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # [M]
        tl.store(part_lse_ptr + (slot + s) * M + rows, lse, mask=row_ok)  # real rows only: the merge reads these
        tl.store(part_o_ptr + ((slot + s) * M + rows)[:, None] * D + dims[None, :],
                 acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=row_ok[:, None])
        tl.debug_barrier()  # every thread's partial stored before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + b * num_kv_heads + h, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the last of (b, h): merge every slice, in slice order
            tl.debug_barrier()
            m = tl.full([M], float("-inf"), dtype=tl.float32)
            for j in range(SPLITS):
                m = tl.maximum(m, tl.load(part_lse_ptr + (slot + j) * M + rows, mask=row_ok, other=float("-inf"),
                                          cache_modifier=".cg"))
            m = tl.where(m == float("-inf"), 0.0, m)
            den = tl.zeros([M], dtype=tl.float32)
            num = tl.zeros([M, D], dtype=tl.float32)
            for j in range(SPLITS):
                w = tl.exp(tl.load(part_lse_ptr + (slot + j) * M + rows, mask=row_ok, other=float("-inf"),
                                   cache_modifier=".cg") - m)
                o = tl.load(part_o_ptr + ((slot + j) * M + rows)[:, None] * D + dims[None, :], mask=row_ok[:, None],
                            other=0.0, cache_modifier=".cg")
                den += w
                num += w[:, None] * o
            out = num / tl.where(den > 0, den, 1.0)[:, None]
            tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.atomic_xchg(ticket_ptr + b * num_kv_heads + h, 0, sem="relaxed", scope="gpu")  # for the next launch


class SplitKVDecode:
    """The kernel's persistent state for ``batch`` requests of ``q_len`` query tokens over ``num_kv_heads`` kv heads,
    ``splits`` slices each: partial outputs, log-sum-exps and merge tickets (device buffers a graph replays)."""

    def __init__(self, batch: int, q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, splits: int,
                 device: torch.device):
        if num_q_heads % num_kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"split-KV decode: q heads ({num_q_heads}) a multiple of kv heads ({num_kv_heads}), "
                             f"head_dim ({head_dim}) a power of 2 >= 16")
        if splits < 1:
            raise ValueError(f"split-KV decode: splits must be >= 1, got {splits}")
        self.batch, self.q_len, self.splits = batch, q_len, splits
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.rows = max(16, triton.next_power_of_2(q_len * self.group))  # the dot's M
        slots = batch * num_kv_heads * splits
        self.part_o = torch.empty(slots * self.rows * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(slots * self.rows, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
            kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, scale: float) -> torch.Tensor:
        """q [batch * q_len, Hq, D]; caches [P, page, Hkv, D]; FlashInfer's page table of the batch -> [.., Hq, D]."""
        if q.shape != (self.batch * self.q_len, self.num_q_heads, self.head_dim):
            raise ValueError(f"split-KV decode: q {tuple(q.shape)}, expected "
                             f"{(self.batch * self.q_len, self.num_q_heads, self.head_dim)}")
        q = q.contiguous()
        out = torch.empty_like(q)
        _split_kv_kernel[(self.batch, self.num_kv_heads, self.splits)](
            q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, self.part_o, self.part_lse, self.tickets,
            out, scale, self.num_q_heads, self.num_kv_heads, PAGE=k_cache.shape[1], D=self.head_dim,
            GROUP=self.group, Q=self.q_len, M=self.rows, SPLITS=self.splits, TILE=TILE)
        return out


def default_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Slices per (request, kv head) for about two programs per SM, at most 32."""
    return max(1, min(32, -(-2 * num_sms // (batch * num_kv_heads))))
