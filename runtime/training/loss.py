"""The DeepSpec loss: 0.1 CE + 0.9 L1(p_draft - p_target) + 1.0 BCE(confidence, 1 - L1/2), slot weights exp(-k/4)."""

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
    ce = F.cross_entropy(draft_logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    with torch.set_grad_enabled(torch.is_grad_enabled() and weights.l1 != 0):  # (weighed 0: a statistic, no backward)
        p_draft = torch.softmax(draft_logits.float(), dim=-1)
        p_target = torch.softmax(target_logits.float(), dim=-1)
        l1 = (p_draft - p_target).abs().sum(-1)
    per_slot = weights.ce * ce + weights.l1 * l1
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
