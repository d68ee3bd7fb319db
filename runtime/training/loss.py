"""The DeepSpec loss: 0.1 CE + 0.9 L1(p_draft - p_target) + 1.0 BCE(confidence, 1 - L1/2), slot weights exp(-k/4).

The cross-entropy and the L1 over the vocabulary (``cross_entropy_and_l1``) keep no [slots, vocabulary] intermediate
for the backward (at 64 blocks of 8 slots over SmolLM2's 49,152 tokens, each such float32 tensor is 100 MB a
sequence): on a GPU one Triton kernel each way (``runtime.kernels.triton_loss``), elsewhere torch a chunk of rows at a
time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0  # slot k (0-based) weighs exp(-k / decay)


CHUNK_BYTES = 4 << 20  # bytes of [rows, V] float32 a chunk of the torch path works on: what a CPU's caches hold


class _CrossEntropyAndL1(torch.autograd.Function):
    """Per row of draft logits d [R, V] (float32), target logits t [R, V] and labels [R]: the cross-entropy
    ``logsumexp(d) - d[label]`` and ``L1 = sum |softmax(d) - softmax(t)|``, a chunk of rows at a time, both
    softmaxes recomputed in the backward instead of kept: no [R, V] intermediate is held for the backward, and a
    chunk's passes run over data its cache holds. Gradients: ``softmax(d) - onehot(label)`` for the cross-entropy,
    ``p (s - <s, p>)`` with ``p = softmax(d)``, ``s = sign(p - softmax(t))`` for the L1 (autograd's, through abs and
    softmax); the target and the labels get none."""

    @staticmethod
    def forward(ctx, draft: torch.Tensor, target: torch.Tensor, labels: torch.Tensor, rows: int):
        ctx.set_materialize_grads(False)
        ce, l1 = draft.new_empty(draft.shape[0]), draft.new_empty(draft.shape[0])
        for lo in range(0, draft.shape[0], rows):
            d, hi = draft[lo:lo + rows], lo + rows
            lse = torch.logsumexp(d, dim=-1)  # [rows]
            ce[lo:hi] = lse - d.gather(1, labels[lo:hi, None]).squeeze(1)
            l1[lo:hi] = (torch.exp(d - lse[:, None]) - torch.softmax(target[lo:hi], dim=-1)).abs().sum(-1)
        ctx.save_for_backward(draft, target, labels)
        ctx.rows = rows
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor | None, grad_l1: torch.Tensor | None):
        if grad_ce is None and grad_l1 is None:
            return None, None, None, None
        draft, target, labels = ctx.saved_tensors
        grad = torch.empty_like(draft)
        for lo in range(0, draft.shape[0], ctx.rows):
            hi = lo + ctx.rows
            p = torch.softmax(draft[lo:hi], dim=-1)  # [rows, V]
            g = None
            if grad_l1 is not None:
                s = torch.sign(p - torch.softmax(target[lo:hi], dim=-1))
                g = p * (s - (s * p).sum(-1, keepdim=True)) * grad_l1[lo:hi, None]
            if grad_ce is not None:
                g = p * grad_ce[lo:hi, None] if g is None else g.addcmul_(p, grad_ce[lo:hi, None])
                g.scatter_add_(1, labels[lo:hi, None], -grad_ce[lo:hi, None])
            grad[lo:hi] = g
        return grad, None, None, None


class _FusedCrossEntropyAndL1(torch.autograd.Function):
    """``_CrossEntropyAndL1`` in two Triton kernels (``runtime.kernels.triton_loss``): the forward keeps each row's two
    log-normalizers and ``<sign(p - q), p>`` ([R, 3]), the backward writes the gradient in one pass. The target logits
    may be in any float dtype (read as float32)."""

    @staticmethod
    def forward(ctx, draft: torch.Tensor, target: torch.Tensor, labels: torch.Tensor):
        from runtime.kernels import triton_loss

        ctx.set_materialize_grads(False)
        ce, l1, stats = triton_loss.cross_entropy_and_l1_forward(draft, target, labels)
        ctx.save_for_backward(draft, target, labels, stats)
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor | None, grad_l1: torch.Tensor | None):
        from runtime.kernels import triton_loss

        if grad_ce is None and grad_l1 is None:
            return None, None, None
        draft, target, labels, stats = ctx.saved_tensors
        zeros = torch.zeros(draft.shape[0], dtype=torch.float32, device=draft.device)
        grad = triton_loss.cross_entropy_and_l1_backward(draft, target, labels, stats,
                                                         zeros if grad_ce is None else grad_ce,
                                                         zeros if grad_l1 is None else grad_l1)
        return grad, None, None


def cross_entropy_and_l1(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits, target_logits [..., V]; labels [...] -> (cross-entropy, L1 between the softmaxes), each [...],
    in float32: on a GPU ``_FusedCrossEntropyAndL1`` (the target logits read in their own dtype), elsewhere
    ``_CrossEntropyAndL1``."""
    shape, vocab = labels.shape, draft_logits.shape[-1]
    draft = draft_logits.float().reshape(-1, vocab).contiguous()
    if draft.device.type == "cuda":
        target = target_logits.reshape(-1, vocab).contiguous()
        ce, l1 = _FusedCrossEntropyAndL1.apply(draft, target.detach(), labels.reshape(-1))
        return ce.view(shape), l1.view(shape)
    target = target_logits.float().reshape(-1, vocab).contiguous()
    rows = max(1, CHUNK_BYTES // (4 * vocab))
    ce, l1 = _CrossEntropyAndL1.apply(draft, target.detach(), labels.reshape(-1), rows)
    return ce.view(shape), l1.view(shape)


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                conf_logits: torch.Tensor | None, weights: LossWeights) -> tuple[torch.Tensor, dict]:
    """draft_logits, target_logits [N, A, B, V]; labels, mask [N, A, B]; conf_logits [N, A, B] or None.

    Returns the loss and detached 0-dim statistics, among them the teacher-forced greedy acceptance
    (1 + mean leading run of slots whose argmax equals the label, per block with at least one slot).
    """
    block = labels.shape[-1]
    slot_w = torch.exp(-torch.arange(block, device=labels.device, dtype=torch.float32) / weights.decay)
    w = slot_w * mask.float()  # [N, A, B]
    norm = w.sum().clamp_min(1e-6)
    ce, l1 = cross_entropy_and_l1(draft_logits, target_logits, labels)  # [N, A, B] each
    per_slot = weights.ce * ce + (weights.l1 * l1 if weights.l1 else 0.0)  # (weighed 0: a statistic, no backward)
    bce = torch.zeros_like(ce)
    if conf_logits is not None and weights.confidence:
        target_conf = (1 - 0.5 * l1).detach().clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(conf_logits, target_conf, reduction="none")
        per_slot = per_slot + weights.confidence * bce
    loss = (per_slot * w).sum() / norm
    with torch.no_grad():  # 0-dim tensors: reading them (float()) waits for the device, so callers do it rarely
        hits = ((draft_logits.argmax(-1) == labels) & mask).to(torch.int64).cumprod(-1).sum(-1)  # [N, A]
        blocks = mask[..., 0]  # [N, A] blocks with at least one supervised slot
        stats = {"loss": loss.detach(), "ce": (ce * w).sum() / norm, "l1": (l1 * w).sum() / norm,
                 "bce": (bce * w).sum() / norm,
                 "accept_len": 1 + (hits * blocks).sum() / blocks.sum().clamp_min(1)}
    return loss, stats
