"""Data parallelism for the trainers, inside an initialized ``torch.distributed`` group (Ray Train's workers,
or ``torchrun``): every rank draws its own batches, gradients are averaged before each optimizer step, all
ranks stop at the same step, rank 0 writes. Outside a group every function is the single-process identity."""

from __future__ import annotations

import torch
import torch.distributed as dist

STATS_FILE = "train_stats.json"  # a trainer's final statistics, written by rank 0 into its output directory


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def agreed_max(value: float, world: int, device: torch.device) -> float:
    """The largest of every rank's ``value`` (so all ranks take the same decision from it)."""
    if world == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def everyone_agrees(flag: bool, world: int, device: torch.device) -> bool:
    """True on every rank if it is true on any (so all ranks stop at the same step)."""
    return agreed_max(float(flag), world, device) > 0


def average_gradients(module: torch.nn.Module, world: int) -> None:
    if world == 1:
        return
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
