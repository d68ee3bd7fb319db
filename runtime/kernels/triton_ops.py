"""Fused elementwise kernels in Triton (CUDA): RMSNorm, residual add + RMSNorm, SiLU-and-mul, q/k norm + RoPE.

Each kernel does in one launch what the torch reference does in several, with the same arithmetic in float32
and one rounding to the output dtype at the end (the reference rounds after some intermediate steps, so bf16
results may differ in the last bit; fp32 results agree to rounding). Shapes and semantics are those of
``runtime.kernels.interface.KernelBackend``. Importing this module needs triton; the kernels need CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, x_row_stride, res_row_stride, d, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
                                       HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(d))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, res = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    d = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, summed, rows.stride(0), res.stride(0), d, eps,
                                       HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(d))
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, x_row_stride, BLOCK: tl.constexpr):
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
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, n, rows.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                         q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, cos_stride, num_q_heads,
                         num_k_heads, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    is_q = head < num_q_heads
    h = tl.where(is_q, head, head - num_q_heads)
    cols = tl.arange(0, HALF)
    if is_q:
        src = q_ptr + tok * q_tok_stride + h * q_head_stride
        w_ptr = qw_ptr
        dst = q_out_ptr + (tok * num_q_heads + h) * 2 * HALF
    else:
        src = k_ptr + tok * k_tok_stride + h * k_head_stride
        w_ptr = kw_ptr
        dst = k_out_ptr + (tok * num_k_heads + h) * 2 * HALF
    x1 = tl.load(src + cols).to(tl.float32)
    x2 = tl.load(src + HALF + cols).to(tl.float32)
    if NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = (x1 * inv).to(q_out_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + cols).to(tl.float32)
        x2 = (x2 * inv).to(q_out_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + HALF + cols).to(tl.float32)
        x1 = x1.to(q_out_ptr.dtype.element_ty).to(tl.float32)
        x2 = x2.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    cos1 = tl.load(cos_ptr + tok * cos_stride + cols).to(tl.float32)
    cos2 = tl.load(cos_ptr + tok * cos_stride + HALF + cols).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * cos_stride + cols).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * cos_stride + HALF + cols).to(tl.float32)
    tl.store(dst + cols, (x1 * cos1 - x2 * sin1).to(q_out_ptr.dtype.element_ty))
    tl.store(dst + HALF + cols, (x2 * cos2 + x1 * sin2).to(q_out_ptr.dtype.element_ty))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_q, dim = q.shape
    num_k = k.shape[1]
    half = dim // 2
    if dim % 2 or half & (half - 1):
        raise ValueError(f"qk_norm_rope (triton): head_dim must be twice a power of 2, got {dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rope (triton): q and k need a contiguous last dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope (triton): q and k are both normed or neither")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_weight is not None
    _qk_norm_rope_kernel[(tokens, num_q + num_k)](
        q, k, q_weight if norm else cos, k_weight if norm else cos, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), num_q, num_k, eps, HALF=half, NORM=norm)
    return q_out, k_out
