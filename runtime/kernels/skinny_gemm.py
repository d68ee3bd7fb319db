"""A Triton GEMM for few rows: ``y [M, N] = x [M, K] @ W [N, K]^T`` at M <= 16 (decode and verify).

At one to sixteen rows a linear layer only streams its weight: every program reads a ``[BLOCK_N, K]`` strip of W
(contiguous along K, so the reads coalesce) through a pipelined loop and multiplies it with all M rows of x (padded
to 16 for the tensor-core ``dot``; more rows take a program per 16), accumulating in float32. ``split_k > 1`` cuts K
in that many slices, each program writing a float32 partial, and one torch sum over the slices adds them in a fixed
order: no atomics, so every config is deterministic, and a row's result never depends on the other rows (M may be
padded freely). Two operand prologues save the kernel before it: the SiLU-and-mul of an MLP's down projection
(``skinny_matmul(..., swiglu=True)``) and the residual add and RMSNorm before q/k/v or gate/up
(``skinny_norm_matmul``: each program first reduces its rows whole for their statistics, then normalizes every
slice it loads), both rounding as the separate kernels store, their operands loaded one iteration ahead (one run
measured both prologues 3-5x slower than the separate kernels with the loads in the iteration that used them).
Which config, if any, beats cuBLAS (or the separate kernels) for a weight shape and row count is measured on the
device (``runtime.models.small_gemm``), not assumed. It launches with programmatic dependent launch on sm_90
(``runtime.kernels.pdl``). Importing this module needs triton; the kernel needs CUDA tensors (or Triton's
interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.kernels.pdl import launch_options, wait_for_inputs

BLOCK_M = 16  # rows of x one program multiplies (the dot's M); more rows take more programs


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """One launch shape of the kernel."""

    block_n: int  # output columns (rows of W) per program
    block_k: int  # K per loop iteration
    split_k: int = 1  # K slices, each its own program (partials summed after)
    num_warps: int = 4
    num_stages: int = 4  # loads in flight per program (Triton's software pipelining)

    @property
    def label(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"

    def fits(self, n: int, k: int) -> bool:
        """Whether this config serves an ``[n, k]`` weight: K cut evenly into whole iterations; split partials
        (float32 [split, M, N]) only for moderate N."""
        return k % (self.block_k * self.split_k) == 0 and (self.split_k == 1 or n <= 32768)


# What the device chooses among (runtime.models.small_gemm measures each against cuBLAS per weight shape and row count).
CANDIDATES = (
    SkinnyConfig(16, 256, 1, 4, 4),
    SkinnyConfig(16, 512, 1, 4, 3),
    SkinnyConfig(32, 256, 1, 4, 4),
    SkinnyConfig(64, 128, 1, 4, 4),
    SkinnyConfig(16, 256, 2, 4, 4),
    SkinnyConfig(32, 256, 4, 4, 4),
)


@triton.jit
def _row_rstd(x_ptr, res_ptr, row0, M, K, stride_xm, stride_rm, eps, BLOCK_M: tl.constexpr, K_POW2: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr):
    """[BLOCK_M] float32: 1 / sqrt(mean(s^2) + eps) of rows row0.. of s = x (+ residual, the sum rounded to x's
    dtype), each whole row reduced at once as ``triton_ops``' RMSNorm kernel reduces it (0 for rows past M)."""
    local = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, K_POW2)
    col_ok = cols < K
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r in range(0, tl.minimum(BLOCK_M, M - row0)):
        s = tl.load(x_ptr + (row0 + r) * stride_xm + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + (row0 + r) * stride_rm + cols, mask=col_ok, other=0.0).to(tl.float32)
            s = s.to(x_ptr.dtype.element_ty).to(tl.float32)
        rstd = tl.where(local == r, tl.rsqrt(tl.sum(s * s, axis=0) / K + eps), rstd)
    return rstd


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, k_per_split, stride_xm, stride_wn, stride_om, stride_os, up_offset,
                   res_ptr, sum_ptr, nw_ptr, stride_rm, eps, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                   NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, K_POW2: tl.constexpr, PDL: tl.constexpr):
    """Program (column block, K slice, row block): out[rows, cols] (or the slice's float32 partial) of
    x @ W^T over the slice. SWIGLU: x = silu(gate) * up of a [M, 2K] x. NORM: x = rms_norm(x (+ residual)) * nw,
    rounded as ``triton_ops``' RMSNorm kernel rounds it, the whole-row statistics first; with a residual, the
    programs of the first column block also store the summed rows (the new residual stream) to sum_ptr."""
    wait_for_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K] (SWIGLU: the gate half's)
    w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    dtype = w_ptr.dtype.element_ty
    if NORM:
        rstd = _row_rstd(x_ptr, res_ptr, row0, M, K, stride_xm, stride_rm, eps, BLOCK_M, K_POW2, HAS_RESIDUAL)
        r_ptrs = res_ptr + rows[:, None] * stride_rm + ks[None, :]
        s_ptrs = sum_ptr + rows[:, None] * K + ks[None, :]
        nw_ptrs = nw_ptr + ks
        store_sum = rows[:, None] < tl.where(pid_n == 0, M, 0)  # the first column block's programs store the sum
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # a prologue's operands (gate/up; the stream, residual and norm weight) are loaded one iteration ahead: the
    # compiler's pipelining covers only loads the dot reads directly, and a load used in its own iteration would
    # stall every iteration for a memory latency
    if SWIGLU:
        gate_next = tl.load(x_ptrs, mask=row_ok, other=0.0)
        up_next = tl.load(x_ptrs + up_offset, mask=row_ok, other=0.0)
    if NORM:
        s_next = tl.load(x_ptrs, mask=row_ok, other=0.0)
        if HAS_RESIDUAL:
            r_next = tl.load(r_ptrs, mask=row_ok, other=0.0)
        nw_next = tl.load(nw_ptrs)
    for start in range(0, k_per_split, BLOCK_K):
        next_ks = ks + start + BLOCK_K < (pid_k + 1) * k_per_split  # [BLOCK_K]: the next iteration's, if any
        ahead = row_ok & next_ks[None, :]  # [BLOCK_M, BLOCK_K]
        if SWIGLU:  # x = silu(gate) * up, rounded as triton_ops.silu_and_mul rounds what it stores
            gate = gate_next.to(tl.float32)
            up = up_next.to(tl.float32)
            gate_next = tl.load(x_ptrs + BLOCK_K, mask=ahead, other=0.0)
            up_next = tl.load(x_ptrs + BLOCK_K + up_offset, mask=ahead, other=0.0)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (silu * up).to(dtype)
        elif NORM:  # x = (s * rstd) rounded, times the norm weight, rounded (triton_ops._rms_norm_kernel)
            s = s_next.to(tl.float32)
            s_next = tl.load(x_ptrs + BLOCK_K, mask=ahead, other=0.0)
            if HAS_RESIDUAL:
                s = (s + r_next.to(tl.float32)).to(x_ptr.dtype.element_ty)
                r_next = tl.load(r_ptrs + BLOCK_K, mask=ahead, other=0.0)
                tl.store(s_ptrs, s, mask=store_sum)
                s = s.to(tl.float32)
                r_ptrs += BLOCK_K
                s_ptrs += BLOCK_K
            nw = nw_next.to(tl.float32)
            nw_next = tl.load(nw_ptrs + BLOCK_K, mask=next_ks, other=0.0)
            normed = (s * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (normed * nw[None, :]).to(x_ptr.dtype.element_ty)
            nw_ptrs += BLOCK_K
        else:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
        w = tl.load(w_ptrs, mask=col_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


def _launch(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig, k: int, swiglu: bool = False,
            norm: tuple | None = None) -> torch.Tensor:
    """The kernel over x [M, K or 2K] -> [M, N] in x's dtype (split partials summed in a fixed order)."""
    m, n = x.shape[0], weight.shape[0]
    split = config.split_k
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        stride_os = 0
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        stride_os = out.stride(0)
    residual, summed, norm_weight, eps = norm if norm is not None else (None, None, x, 0.0)
    res = residual if residual is not None else x  # pointers the kernel never reads without them
    summed = summed if summed is not None else x
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, BLOCK_M))
    _skinny_kernel[grid](x, weight, out, m, n, k // split, x.stride(0), weight.stride(0), n, stride_os, k,
                         res, summed, norm_weight, res.stride(0), eps, k,
                         BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWIGLU=swiglu,
                         NORM=norm is not None, HAS_RESIDUAL=residual is not None,
                         K_POW2=triton.next_power_of_2(k) if norm is not None else 1,
                         num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return out if split == 1 else out.sum(dim=0).to(x.dtype)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ weight [N, K]^T -> [M, N] in x's dtype (meant for M <= 16: each block of
    16 rows streams the whole weight). ``swiglu``: x is [M, 2K], a gate half and an up half, and the product is
    ``silu_and_mul(x) @ weight^T``, the activation computed as the operand is loaded (bit for bit what
    ``triton_ops.silu_and_mul`` stores; no [M, K] intermediate, no launch of its own)."""
    m, k = x.shape
    k //= 2 if swiglu else 1
    n = weight.shape[0]
    if weight.shape[1] != k or (swiglu and x.shape[1] != 2 * k) or not config.fits(n, k):
        raise ValueError(f"skinny_matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit {config}"
                         f"{' (swiglu: x holds gate and up halves)' if swiglu else ''}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("skinny_matmul: the weight needs unit stride along K")
    return _launch(x, weight, config, k, swiglu=swiglu)


def skinny_norm_matmul(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, config: SkinnyConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm(h (+ residual)) * norm_weight @ weight^T`` and the summed residual stream (None without a
    residual), the RMSNorm (and the add) computed as the operand is loaded, with the roundings of
    ``triton_ops.rms_norm`` / ``add_rms_norm`` and each row's statistics reduced whole as they reduce them (bit for
    bit under Triton's interpreter; tests/gpu checks the device), with no [M, K] intermediate and no launch of its
    own. h, residual [M, K] (unit stride along K), norm_weight [K], weight [N, K]."""
    m, k = h.shape
    n = weight.shape[0]
    if weight.shape[1] != k or norm_weight.shape != (k,) or not config.fits(n, k) or weight.dtype != h.dtype \
            or (residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype)):
        raise ValueError(f"skinny_norm_matmul: h {tuple(h.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)} {weight.dtype} (h {h.dtype}) "
                         f"do not fit {config}")
    h = h if h.stride(1) == 1 else h.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if weight.stride(1) != 1 or not norm_weight.is_contiguous():
        raise ValueError("skinny_norm_matmul: the weights need unit stride along K")
    summed = torch.empty(m, k, dtype=h.dtype, device=h.device) if residual is not None else None
    out = _launch(h, weight, config, k, norm=(residual, summed, norm_weight, eps))
    return out, summed
