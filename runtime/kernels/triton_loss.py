"""The drafter's training loss over the vocabulary in Triton (CUDA): per row, the cross-entropy of the draft logits
against a label and the L1 between the draft's and the target's softmaxes, and the gradient of both with respect to
the draft logits.

What ``runtime.training.loss._CrossEntropyAndL1`` computes in torch a chunk of rows at a time (its reference) in two
kernels, one program a row reading it in tiles of ``BLOCK_V``:

- forward: a pass for each softmax's log-normalizer (online max and sum), a pass for ``L1 = sum |p - q|`` and
  ``<s, p>`` (``p``, ``q`` the draft's and target's softmaxes, ``s = sign(p - q)``), the label's logit once;
- backward: one pass writing ``p (g_l1 (s - <s, p>) + g_ce) - g_ce onehot(label)``, the reference's gradient.

So a step reads each [rows, V] logits tensor three times and writes one gradient, where the torch reference runs a
dozen element-wise passes and keeps float32 copies. The target logits are read in their own dtype (a bfloat16 LM
head's output needs no float32 copy); all arithmetic is float32. Importing this module needs triton; the kernels
need CUDA tensors (or Triton's CPU interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # logits of a row a tile: 16 KB of float32, 8 a thread at 16 warps
NUM_WARPS = 16


@triton.jit
def _tile(d_row, t_row, offs, mask, lse_d, lse_t):
    """A tile of a row: the draft's softmax p, p - q (q the target's) and sign(p - q), in float32."""
    p = tl.exp(tl.load(d_row + offs, mask=mask, other=float("-inf")).to(tl.float32) - lse_d)
    q = tl.exp(tl.load(t_row + offs, mask=mask, other=float("-inf")).to(tl.float32) - lse_t)
    diff = p - q
    return p, diff, tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))


@triton.jit
def _ce_l1_forward_kernel(d_ptr, t_ptr, labels_ptr, ce_ptr, l1_ptr, stats_ptr, vocab, d_stride, t_stride,
                          BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d_row, t_row = d_ptr + row * d_stride, t_ptr + row * t_stride
    cols = tl.arange(0, BLOCK_V)
    max_d = float("-inf")
    max_t = float("-inf")
    sum_d = 0.0
    sum_t = 0.0
    for start in range(0, vocab, BLOCK_V):  # the log-normalizers, online
        offs = start + cols
        mask = offs < vocab
        x = tl.load(d_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        y = tl.load(t_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        new_d = tl.maximum(max_d, tl.max(x, axis=0))
        new_t = tl.maximum(max_t, tl.max(y, axis=0))
        sum_d = sum_d * tl.exp(max_d - new_d) + tl.sum(tl.exp(x - new_d), axis=0)
        sum_t = sum_t * tl.exp(max_t - new_t) + tl.sum(tl.exp(y - new_t), axis=0)
        max_d = new_d
        max_t = new_t
    lse_d = max_d + tl.log(sum_d)
    lse_t = max_t + tl.log(sum_t)
    l1 = 0.0
    sp = 0.0
    for start in range(0, vocab, BLOCK_V):  # L1 and <sign(p - q), p>
        offs = start + cols
        mask = offs < vocab
        p, diff, sign = _tile(d_row, t_row, offs, mask, lse_d, lse_t)
        l1 += tl.sum(tl.abs(diff), axis=0)
        sp += tl.sum(sign * p, axis=0)
    label = tl.load(labels_ptr + row)
    tl.store(ce_ptr + row, lse_d - tl.load(d_row + label).to(tl.float32))
    tl.store(l1_ptr + row, l1)
    tl.store(stats_ptr + row * 3, lse_d)
    tl.store(stats_ptr + row * 3 + 1, lse_t)
    tl.store(stats_ptr + row * 3 + 2, sp)


@triton.jit
def _ce_l1_backward_kernel(d_ptr, t_ptr, labels_ptr, stats_ptr, grad_ce_ptr, grad_l1_ptr, grad_ptr, vocab, d_stride,
                           t_stride, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d_row, t_row, g_row = d_ptr + row * d_stride, t_ptr + row * t_stride, grad_ptr + row * vocab
    lse_d = tl.load(stats_ptr + row * 3)
    lse_t = tl.load(stats_ptr + row * 3 + 1)
    sp = tl.load(stats_ptr + row * 3 + 2)
    g_ce = tl.load(grad_ce_ptr + row)
    g_l1 = tl.load(grad_l1_ptr + row)
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        mask = offs < vocab
        p, _, sign = _tile(d_row, t_row, offs, mask, lse_d, lse_t)
        grad = p * (g_l1 * (sign - sp) + g_ce)
        grad = tl.where(offs == label, grad - g_ce, grad)
        tl.store(g_row + offs, grad, mask=mask)


def _check(draft: torch.Tensor, target: torch.Tensor, labels: torch.Tensor) -> None:
    rows, vocab = draft.shape
    if draft.dtype != torch.float32 or draft.stride(1) != 1 or target.shape != draft.shape or target.stride(1) != 1 \
            or labels.shape != (rows,):
        raise ValueError(f"cross_entropy_and_l1 (triton): draft [R, V] float32 and target [R, V] (unit stride "
                         f"along V), labels [R]; got {tuple(draft.shape)} {draft.dtype}, {tuple(target.shape)} "
                         f"{target.dtype}, {tuple(labels.shape)}")


def cross_entropy_and_l1_forward(draft: torch.Tensor, target: torch.Tensor,
                                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft [R, V] float32, target [R, V] (any float dtype), labels [R] (valid ids) -> (cross-entropy [R], L1 [R],
    stats [R, 3]: each row's two log-normalizers and ``<sign(p - q), p>``, which the backward takes)."""
    _check(draft, target, labels)
    rows, vocab = draft.shape
    ce = torch.empty(rows, dtype=torch.float32, device=draft.device)
    l1 = torch.empty_like(ce)
    stats = torch.empty(rows, 3, dtype=torch.float32, device=draft.device)
    if rows:
        _ce_l1_forward_kernel[(rows,)](draft, target, labels, ce, l1, stats, vocab, draft.stride(0), target.stride(0),
                                       BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return ce, l1, stats


def cross_entropy_and_l1_backward(draft: torch.Tensor, target: torch.Tensor, labels: torch.Tensor,
                                  stats: torch.Tensor, grad_ce: torch.Tensor, grad_l1: torch.Tensor) -> torch.Tensor:
    """The gradient [R, V] float32 of ``sum(grad_ce * ce + grad_l1 * l1)`` with respect to the draft logits (grad_ce,
    grad_l1 [R] float32; stats from ``cross_entropy_and_l1_forward`` on the same tensors)."""
    _check(draft, target, labels)
    rows, vocab = draft.shape
    grad = torch.empty(rows, vocab, dtype=torch.float32, device=draft.device)
    if rows:
        _ce_l1_backward_kernel[(rows,)](draft, target, labels, stats, grad_ce.float().contiguous(),
                                        grad_l1.float().contiguous(), grad, vocab, draft.stride(0), target.stride(0),
                                        BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return grad
