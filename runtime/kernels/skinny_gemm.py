"""A Triton GEMM for few rows: ``y [M, N] = x [M, K] @ W [N, K]^T`` at M <= 16 (decode and verify).

At one to sixteen rows a linear layer only streams its weight: every program reads a ``[BLOCK_N, K]`` strip of W
(contiguous along K, so the reads coalesce) through a pipelined loop and multiplies it with all M rows of x
(padded to 16 for the tensor-core ``dot``; more rows take a program per 16), accumulating in float32. ``split_k > 1`` cuts K in that many slices,
each program writing a float32 partial, and one torch sum over the slices adds them in a fixed order: no
atomics, so every config is deterministic, and a row's result never depends on the other rows (M may be padded
freely). Which config, if any, beats cuBLAS for a weight shape and row count is measured on the device
(``runtime.small_gemm``), not assumed. It launches with programmatic dependent launch on sm_90
(``runtime.kernels.pdl``). Importing this module needs triton; the kernel needs CUDA tensors (or
Triton's interpreter).
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


# What the device chooses among (runtime.small_gemm measures each against cuBLAS per weight shape and row count).
CANDIDATES = (
    SkinnyConfig(16, 256, 1, 4, 4),
    SkinnyConfig(16, 512, 1, 4, 3),
    SkinnyConfig(32, 256, 1, 4, 4),
    SkinnyConfig(64, 128, 1, 4, 4),
    SkinnyConfig(16, 256, 2, 4, 4),
    SkinnyConfig(32, 256, 4, 4, 4),
)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, k_per_split, stride_xm, stride_wn, stride_om, stride_os, up_offset,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]  # [BLOCK_M, BLOCK_K] (SWIGLU: the gate half's)
    w_ptrs = w_ptr + cols[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        if SWIGLU:  # x = silu(gate) * up, rounded as triton_ops.silu_and_mul rounds what it stores
            gate = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + up_offset, mask=row_ok, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(w_ptr.dtype.element_ty).to(tl.float32)
            x = (silu * up).to(w_ptr.dtype.element_ty)
        else:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
        w = tl.load(w_ptrs, mask=col_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (cols[None, :] < N))


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
    split = config.split_k
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        stride_os = 0
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        stride_os = out.stride(0)
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, BLOCK_M))
    _skinny_kernel[grid](x, weight, out, m, n, k // split, x.stride(0), weight.stride(0), n, stride_os, k,
                         BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWIGLU=swiglu,
                         num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(x))
    return out if split == 1 else out.sum(dim=0).to(x.dtype)
