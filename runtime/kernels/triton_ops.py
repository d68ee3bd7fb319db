"""Fused kernels in Triton (CUDA): RMSNorm, residual add + RMSNorm, SiLU-and-mul, q/k norm + RoPE, the draft
block's attention, and a greedy Markov-head step.

Each kernel does in one launch what the torch reference does in several, with the same arithmetic in float32
and one rounding to the output dtype at the end (the reference rounds after some intermediate steps, so bf16
results may differ in the last bit; fp32 results agree to rounding). Shapes and semantics are those of
``runtime.kernels.interface.KernelBackend``. Every kernel launches with programmatic dependent launch on sm_90
(``runtime.kernels.pdl``: it waits for the kernel before it first thing, so its launch overlaps that kernel's
tail). Importing this module needs triton; the kernels need CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.pdl import launch_options, wait_for_inputs


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, x_row_stride, res_row_stride, d, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * d + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 and x.dim() == 2 else x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    d = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.stride(0), rows.stride(0), d, eps,
                                       HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(d), **launch_options(x))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, res = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    d = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, summed, rows.stride(0), res.stride(0), d, eps,
                                       HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(d), **launch_options(x))
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, x_row_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, n, rows.stride(0), BLOCK=block,
                                                                   **launch_options(x))
    return out.view(*x.shape[:-1], n)


# heads a q/k norm + RoPE program takes (one token's): one program per (token, head) was ~50k programs of 32-64
# elements at 512 tokens, 52 us a layer of the 3072 x 24 target's 64 x 8 verify (one run's profile: 19% of the step)
ROPE_HEADS = 16
ROPE_WARPS = None  # warps a program; None: one per 256 elements of its [HEADS, HALF] halves, 1 to 4


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                         slots_ptr, q_index_ptr, q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
                         v_tok_stride, v_head_stride, cos_stride, num_q_heads, num_k_heads, eps, HALF: tl.constexpr,
                         HEADS: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr, Q_INDEXED: tl.constexpr,
                         PDL: tl.constexpr):
    """One program per (token, block of HEADS heads of one kind): the q blocks first, then k, then (when STORE)
    v. q and k normed and rotated, q to row ``q_index[token]`` of q_out (Q_INDEXED) or to row ``token``; with
    STORE, k and v go to their cache slot ([slots, Hkv, D] rows of the flat cache), else k to k_out [T, Hkv, D].
    Each head's arithmetic is that of one head alone (its own norm)."""
    wait_for_inputs(PDL)
    tok = tl.program_id(0)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, HEADS)
    k_blocks = tl.cdiv(num_k_heads, HEADS)
    cols = tl.arange(0, HALF)[None, :]  # [1, HALF]
    dtype = q_out_ptr.dtype.element_ty
    if STORE:
        slot = tl.load(slots_ptr + tok)
    else:
        slot = tok
    if block >= q_blocks + k_blocks:  # v: copied to its cache slot as is
        h = ((block - q_blocks - k_blocks) * HEADS + tl.arange(0, HEADS))[:, None]  # [HEADS, 1]
        ok = h < num_k_heads
        src = v_ptr + tok * v_tok_stride + h * v_head_stride
        dst = v_out_ptr + (slot * num_k_heads + h) * 2 * HALF
        tl.store(dst + cols, tl.load(src + cols, mask=ok), mask=ok)
        tl.store(dst + HALF + cols, tl.load(src + HALF + cols, mask=ok), mask=ok)
    else:
        if block < q_blocks:
            h = (block * HEADS + tl.arange(0, HEADS))[:, None]
            ok = h < num_q_heads
            src = q_ptr + tok * q_tok_stride + h * q_head_stride
            w_ptr = qw_ptr
            if Q_INDEXED:
                row = tl.load(q_index_ptr + tok)
            else:
                row = tok
            dst = q_out_ptr + (row * num_q_heads + h) * 2 * HALF
        else:
            h = ((block - q_blocks) * HEADS + tl.arange(0, HEADS))[:, None]
            ok = h < num_k_heads
            src = k_ptr + tok * k_tok_stride + h * k_head_stride
            w_ptr = kw_ptr
            dst = k_out_ptr + (slot * num_k_heads + h) * 2 * HALF
        x1 = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)  # [HEADS, HALF]
        x2 = tl.load(src + HALF + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.load(w_ptr + cols).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + cols).to(tl.float32)
            x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        cos1 = tl.load(cos_ptr + tok * cos_stride + cols).to(tl.float32)
        cos2 = tl.load(cos_ptr + tok * cos_stride + HALF + cols).to(tl.float32)
        sin1 = tl.load(sin_ptr + tok * cos_stride + cols).to(tl.float32)
        sin2 = tl.load(sin_ptr + tok * cos_stride + HALF + cols).to(tl.float32)
        tl.store(dst + cols, (x1 * cos1 - x2 * sin1).to(dtype), mask=ok)
        tl.store(dst + HALF + cols, (x2 * cos2 + x1 * sin2).to(dtype), mask=ok)


def _rope_grid(tokens: int, num_q: int, num_k: int, half: int, with_v: bool) -> tuple[tuple[int, int], dict]:
    """-> (the grid, the launch's HEADS and num_warps): ``ROPE_HEADS`` heads a program (fewer where the model has
    fewer), ``ROPE_WARPS`` warps (benchmarks/rope_kernel.py sets both to time other layouts)."""
    heads = min(ROPE_HEADS, triton.next_power_of_2(max(num_q, num_k)))
    blocks = triton.cdiv(num_q, heads) + triton.cdiv(num_k, heads) * (2 if with_v else 1)
    warps = ROPE_WARPS or max(1, min(4, heads * half // 256))
    return (tokens, blocks), {"HEADS": heads, "num_warps": warps}


def _check_heads(q: torch.Tensor, k: torch.Tensor, q_weight, k_weight) -> int:
    dim = q.shape[-1]
    half = dim // 2
    if dim % 2 or half & (half - 1):
        raise ValueError(f"qk_norm_rope (triton): head_dim must be twice a power of 2, got {dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rope (triton): q and k need a contiguous last dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope (triton): q and k are both normed or neither")
    return half


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_q, _ = q.shape
    num_k = k.shape[1]
    half = _check_heads(q, k, q_weight, k_weight)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_weight is not None
    grid, block = _rope_grid(tokens, num_q, num_k, half, with_v=False)
    _qk_norm_rope_kernel[grid](
        q, k, k, q_weight if norm else cos, k_weight if norm else cos, cos, sin, q_out, k_out, k_out, cos, cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, cos.stride(0), num_q, num_k, eps, HALF=half,
        NORM=norm, STORE=False, Q_INDEXED=False, **block, **launch_options(q))
    return q_out, k_out


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                   k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   q_index: torch.Tensor | None = None, q_rows: int = 0) -> torch.Tensor:
    tokens, num_q, _ = q.shape
    num_k = k.shape[1]
    half = _check_heads(q, k, q_weight, k_weight)
    if v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_cache (triton): v needs a contiguous last dim and the caches must be contiguous")
    if q_index is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:  # rows no token is written to stay zero (a packed verify's rows not fed)
        q_out = torch.zeros((q_rows, *q.shape[1:]), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_weight is not None
    grid, block = _rope_grid(tokens, num_q, num_k, half, with_v=True)
    _qk_norm_rope_kernel[grid](
        q, k, v, q_weight if norm else cos, k_weight if norm else cos, cos, sin, q_out, k_cache, v_cache, slots,
        slots if q_index is None else q_index, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), cos.stride(0), num_q, num_k, eps, HALF=half, NORM=norm, STORE=True,
        Q_INDEXED=q_index is not None, **block, **launch_options(q))
    return q_out


def rope_and_cache_kv(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``rope_and_cache``'s kernel with no q blocks: k normed and rotated, it and v written to their cache slots."""
    tokens, num_k, _ = k.shape
    half = _check_heads(k, k, k_weight, k_weight)
    if v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_and_cache_kv (triton): v needs a contiguous last dim and the caches must be "
                         "contiguous")
    if tokens == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = k_weight is not None
    grid, block = _rope_grid(tokens, 0, num_k, half, with_v=True)
    # (q's arguments stand in for a q of no heads; q_out's dtype, the cache's, is what k is rounded to)
    _qk_norm_rope_kernel[grid](
        k, k, v, k_weight if norm else cos, k_weight if norm else cos, cos, sin, k_cache, k_cache, v_cache, slots,
        slots, k.stride(0), k.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), 0,
        num_k, eps, HALF=half, NORM=norm, STORE=True, Q_INDEXED=False, **block, **launch_options(k))


@triton.jit
def _attend_tile(q, k, v, key_ok, m_i, l_i, acc, scale):
    """One online-softmax step: q [M, D] against the key tile k, v [N, D] (columns where key_ok) -> (m, l, acc)."""
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _splits_of(ctx_len, window, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """(first visible key, key tiles, context splits, tiles per split) of one request: a split per SPLIT_TILES tiles
    of its visible context, at least one, at most MAX_SPLITS (a request's own numbers: never its batch's)."""
    first = tl.where(window > 0, tl.maximum(ctx_len - window, 0), 0)  # window 0: the whole context
    tiles = tl.cdiv(ctx_len - first, BLOCK_N)
    splits = tl.minimum(tl.maximum(tl.cdiv(tiles, SPLIT_TILES), 1), MAX_SPLITS)
    return first, tiles, splits, tl.cdiv(tiles, splits)


@triton.jit
def _block_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, ctx_lens_ptr, xk_ptr, xv_ptr, out_ptr,
                            part_ptr, lse_ptr, scale, page_size, page_table_stride, num_q_heads, num_kv_heads, window,
                            BLOCK: tl.constexpr, GROUP: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                            BLOCK_N: tl.constexpr, X: tl.constexpr, SPLIT_TILES: tl.constexpr,
                            MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (request b, kv head h, split): the BLOCK x GROUP query rows of its draft block attend to the
    request's first ctx_lens[b] cached keys (paged; only the last ``window`` of them when window > 0), split s taking
    the s-th of the request's equal runs of whole key tiles (``_splits_of``; programs past its count return at
    once), and its last split also the block's own BLOCK keys (bidirectional), with an online softmax over key tiles
    of BLOCK_N. Row r is (block slot r // GROUP, q head h * GROUP + r % GROUP). A request of one split writes its
    output; one of more writes each split's normalized partial output and log-sum-exp (float32) for
    ``_merge_splits_kernel``."""
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + b)
    first, tiles, splits, per_split = _splits_of(ctx_len, window, BLOCK_N, SPLIT_TILES, MAX_SPLITS)
    if split >= splits:
        return
    rows = tl.arange(0, M)
    dims = tl.arange(0, D)
    slot = rows // GROUP
    row_ok = rows < BLOCK * GROUP
    q_head = h * GROUP + rows % GROUP
    q_row = (b * BLOCK + slot) * num_q_heads + q_head  # [M] rows of q / out as [B*K*Hq, D]
    q_off = q_row[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, D], dtype=tl.float32)
    begin = first + split * per_split * BLOCK_N
    end = tl.minimum(begin + per_split * BLOCK_N, ctx_len)
    cols = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        pos = start + cols
        key_ok = pos < end
        page = tl.load(page_table_ptr + b * page_table_stride + pos // page_size, mask=key_ok, other=0)
        kv_off = ((page * page_size + pos % page_size) * num_kv_heads + h)[:, None] * D + dims[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=key_ok[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, key_ok, m_i, l_i, acc, scale)
    if split == splits - 1:
        xcols = tl.arange(0, X)
        x_ok = xcols < BLOCK
        x_off = ((b * BLOCK + xcols) * num_kv_heads + h)[:, None] * D + dims[None, :]
        k = tl.load(xk_ptr + x_off, mask=x_ok[:, None], other=0.0)
        v = tl.load(xv_ptr + x_off, mask=x_ok[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, x_ok, m_i, l_i, acc, scale)
    if splits == 1:
        tl.store(out_ptr + q_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # a split left without keys (capped counts can leave one): output 0, log-sum-exp -inf (weight 0)
        seen = l_i > 0
        safe = tl.where(seen, l_i, 1.0)
        rows_total = tl.num_programs(0) * BLOCK * num_q_heads
        tl.store(part_ptr + (split * rows_total + q_row)[:, None] * D + dims[None, :],
                 tl.where(seen[:, None], acc / safe[:, None], 0.0), mask=row_ok[:, None])
        tl.store(lse_ptr + split * rows_total + q_row, tl.where(seen, m_i + tl.log(safe), float("-inf")),
                 mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, ctx_lens_ptr, rows_total, rows_per_request, window,
                         BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr,
                         S: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    """One program per output row of a request of several splits (others return at once: the attention kernel
    wrote them): its splits' partial outputs [D] weighted by exp(their log-sum-exp - the largest), in split order."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    _, _, splits, _ = _splits_of(tl.load(ctx_lens_ptr + row // rows_per_request), window, BLOCK_N, SPLIT_TILES,
                                 MAX_SPLITS)
    if splits == 1:
        return
    ids = tl.arange(0, S)
    dims = tl.arange(0, D)
    split_ok = ids < splits
    lse = tl.load(lse_ptr + ids * rows_total + row, mask=split_ok, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))  # [S], 0 past the request's splits
    part = tl.load(part_ptr + (ids * rows_total + row)[:, None] * D + dims[None, :], mask=split_ok[:, None],
                   other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * D + dims, out.to(out_ptr.dtype.element_ty))


BLOCK_ATTENTION_KEYS = 128  # cached keys per tile of the block attention (BLOCK_N; benchmarks/block_attention.py)
BLOCK_ATTENTION_SPLIT_TILES = 16  # a context split per this many tiles (2048 keys) of a request's visible context
BLOCK_ATTENTION_MAX_SPLITS = 8  # at most this many splits a request


def block_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    ctx_lens: torch.Tensor, extra_k: torch.Tensor, extra_v: torch.Tensor,
                    scale: float, window: int | None = None, max_context: int | None = None,
                    block_n: int = BLOCK_ATTENTION_KEYS, split_tiles: int = BLOCK_ATTENTION_SPLIT_TILES,
                    max_splits: int = BLOCK_ATTENTION_MAX_SPLITS) -> torch.Tensor:
    """Draft-block attention: q [B*K, Hq, D] over each request's ctx_lens[b] cached keys (page_table [B, P]; the
    last ``window`` only, if given) plus the block's own keys extra_k/extra_v [B, K, Hkv, D]; every length is read
    on the device (CUDA-graph safe). Keys are read in tiles of ``block_n``; a request's visible context is cut into
    a split per ``split_tiles`` tiles (at most ``max_splits``), each its own program, merged by their log-sum-exp
    in a second kernel, so that a long context at few requests keeps many SMs reading (one request over 8192 keys:
    8 programs walking 64 tiles each otherwise). The count is the request's own (its context length): its result
    never depends on the batch. ``max_context`` (an upper bound of every context, e.g. the page table's capacity;
    None: no bound) only sizes the launch: no more splits are launched than any request can use."""
    batch, block, num_kv, dim = extra_k.shape
    num_q = q.shape[1]
    group = num_q // num_kv
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"block_attention (triton): head_dim must be a power of 2 >= 16, got {dim}")
    q, extra_k, extra_v = q.contiguous(), extra_k.contiguous(), extra_v.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    visible = max_context if window is None or max_context is None else min(max_context, window)
    if visible is not None:
        max_splits = max(1, min(max_splits, triton.cdiv(triton.cdiv(visible, block_n), split_tiles)))
    rows_total = batch * block * num_q
    part = lse = out  # unused with one split
    if max_splits > 1:
        part = torch.empty(max_splits, rows_total, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(max_splits, rows_total, dtype=torch.float32, device=q.device)
    _block_attention_kernel[(batch, num_kv, max_splits)](
        q, k_cache, v_cache, page_table, ctx_lens, extra_k, extra_v, out, part, lse, scale, k_cache.shape[1],
        page_table.stride(0), num_q, num_kv, window or 0, BLOCK=block, GROUP=group,
        M=max(16, triton.next_power_of_2(block * group)), D=dim, BLOCK_N=block_n,
        X=max(16, triton.next_power_of_2(block)), SPLIT_TILES=split_tiles, MAX_SPLITS=max_splits,
        **launch_options(q))
    if max_splits > 1:
        _merge_splits_kernel[(rows_total,)](part, lse, out, ctx_lens, rows_total, block * num_q, window or 0,
                                            BLOCK_N=block_n, SPLIT_TILES=split_tiles, MAX_SPLITS=max_splits,
                                            S=max(2, triton.next_power_of_2(max_splits)), D=dim,
                                            **launch_options(q))
    return out


MARKOV_BLOCK_V = 256  # vocabulary columns per program of the Markov step
MARKOV_BLOCK_S = 16  # request rows per program (the dot's M): the weight is read once per 16 requests
_INT64_MIN = -(1 << 63)


@triton.jit
def _markov_argmax_kernel(base_ptr, low_rank_ptr, w_ptr, best_ptr, num, vocab, rank, base_stride, low_rank_stride,
                          BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, row block): z = base[rows, tile] + round(low_rank[rows] @ w[tile]^T) over BLOCK_V columns
    and BLOCK_S rows; each row's max over the tile and its first argmax, packed into one int64 ordered by
    (value, -index), go to best[row] by atomic max."""
    wait_for_inputs(PDL)
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    rows = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BS]
    col_ok = cols < vocab
    row_ok = rows < num
    acc = tl.zeros((BLOCK_S, BLOCK_V), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        u = tl.load(low_rank_ptr + rows[:, None] * low_rank_stride + rs[None, :], mask=row_ok[:, None] & r_ok[None, :],
                    other=0.0)  # [BS, BR]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * rank + rs[:, None], mask=r_ok[:, None] & col_ok[None, :],
                    other=0.0)  # [BR, BV]
        acc = tl.dot(u.to(w.dtype), w, acc)
    product = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # the Linear's output, in the weight's dtype
    z = tl.load(base_ptr + rows[:, None].to(tl.int64) * base_stride + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0) + product
    z = tl.where(col_ok[None, :], z, float("-inf"))
    top = tl.max(z, axis=1)  # [BS]
    first = tl.min(tl.where(z == top[:, None], cols[None, :], vocab), axis=1)
    first = tl.where(first < vocab, first, tl.program_id(0) * BLOCK_V)  # NaN rows: any valid id (garbage drafts)
    bits = top.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # the bits' signed order is the floats' order
    packed = key.to(tl.int64) * 4294967296 + (4294967295 - first.to(tl.int64))  # (value, 2^32 - 1 - index)
    tl.atomic_max(best_ptr + rows, packed, mask=row_ok)


def markov_argmax(base: torch.Tensor, low_rank: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch_ref.markov_argmax`` in one kernel (plus a fill and the unpacking): base [S, V] float32 (unit stride
    along V; rows may be strided), low_rank [S, r], weight [V, r]. Each program reads BLOCK_V rows of the weight
    once for up to 16 requests (a tensor-core dot over r in float32, rounded to the weight's dtype as the Linear's
    output is): the tokens equal the reference's except where two columns tie within that rounding, which for
    draft tokens costs acceptance, never correctness."""
    num, vocab = base.shape
    rank = weight.shape[1]
    if base.dtype != torch.float32 or base.stride(1) != 1 or weight.shape[0] != vocab or low_rank.shape != (num, rank):
        raise ValueError(f"markov_argmax (triton): base [S, V] float32, low_rank [S, r], weight [V, r]; got "
                         f"{tuple(base.shape)} {base.dtype}, {tuple(low_rank.shape)}, {tuple(weight.shape)}")
    weight = weight if weight.is_contiguous() else weight.contiguous()
    low_rank = low_rank if low_rank.stride(1) == 1 else low_rank.contiguous()
    best = torch.full((num,), _INT64_MIN, dtype=torch.int64, device=base.device)
    if num == 0:
        return best
    grid = (triton.cdiv(vocab, MARKOV_BLOCK_V), triton.cdiv(num, MARKOV_BLOCK_S))
    _markov_argmax_kernel[grid](base, low_rank, weight, best, num, vocab, rank, base.stride(0), low_rank.stride(0),
                                BLOCK_S=MARKOV_BLOCK_S, BLOCK_V=MARKOV_BLOCK_V,
                                BLOCK_R=min(64, max(16, triton.next_power_of_2(rank))), num_warps=4,
                                **launch_options(base))
    return 4294967295 - (best & 4294967295)
