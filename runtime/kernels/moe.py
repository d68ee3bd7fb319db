"""MoE expert kernels: the routed tokens through their experts, weighted and summed per token.

Every backend computes, for tokens x [T, H] routed to experts ``ids`` [T, k] with weights [T, k],

    out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]

from the stacked expert weights ``w13`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``w2`` [E, H, I] (this rank's slice of I under tensor parallelism; the caller all-reduces). Routing is the
model's (``runtime.models.moe``); backends differ only in how they run the experts:

- ``VANILLA``: a loop over the experts some token chose, in expert order (transformers' loop, the reference).
- ``DENSEGEMM``: the (token, choice) pairs sorted by expert, then two grouped GEMMs over all experts
  (``torch.nn.functional.grouped_mm``: an empty group costs nothing) and one scatter-add. Every shape is fixed
  by T and k and nothing is read back to the host, so a CUDA graph can capture it.
- ``TRITON``: the pairs tiled by expert (a decode token's pairs one tile each; up to 128 pairs the tiles laid
  out by one Triton program, beyond that by ``tile_pairs_by_expert``; static shapes), then one Triton GEMM kernel
  per projection that gathers its tile's token rows itself and writes each pair's row in place (the routing weight
  folded into the down projection), and a sum over the k choices (``runtime.kernels.triton_moe``; CUDA only,
  graph safe).

Which backends a device can run, and what ``AUTO`` resolves to, is ``runtime.worker.devices.resolve_moe_backend``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ExpertKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def experts_vanilla(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k] (x's dtype), ids [T, k] -> [T, H]."""
    out = torch.zeros_like(x)
    hit = torch.zeros(w13.shape[0], dtype=torch.bool, device=x.device)
    hit[ids.reshape(-1)] = True
    for e in hit.nonzero().flatten().tolist():  # data-dependent: one host sync, then the chosen experts in order
        token, choice = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, choice, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` [N, K] in groups ending at ``offs`` [E] times ``b`` [E, K, M] -> [N, M]."""
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10, private before
    return grouped(a, b, offs=offs)


def experts_grouped_gemm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``experts_vanilla``; static shapes, no host synchronization."""
    num_experts, k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)  # [T*k] the expert of each (token, choice) pair
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside a group
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)  # [E] end of each expert's group
    token = order // k  # [T*k] the token of each sorted pair
    gate, up = _grouped_mm(x[token], w13.transpose(1, 2), offs).chunk(2, dim=-1)  # [T*k, I] each
    y = _grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs)  # [T*k, H]
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


@dataclass(frozen=True)
class ExpertTiles:
    """The (token, choice) pairs of a routing, grouped by expert into tiles of ``block_m`` rows.

    Invariants: ``pairs`` lists every pair index ``t * k + j`` exactly once; expert e's pairs fill consecutive whole
    tiles (in token order), the rest of its last tile holds the sentinel ``T * k``; ``tile_expert[i]`` is the expert
    of tile i, or E for the tiles past the last used one. The sizes depend on T, k, E and ``block_m`` only
    (enough tiles for any routing), so the layout is built on the device without a host synchronization."""

    pairs: torch.Tensor  # [num_tiles * block_m] int32
    tile_expert: torch.Tensor  # [num_tiles] int32
    block_m: int


def tile_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """ids [T, k] -> ``ExpertTiles``. At most ceil(T*k / block_m) + min(T*k, E) tiles are ever used (each used
    expert wastes less than one tile), which is what is allocated."""
    n = ids.numel()
    flat = ids.reshape(-1).to(torch.int64)  # [n]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m  # [E] tiles per expert
    tile_end = torch.cumsum(tiles, 0)  # [E]
    num_tiles = -(-n // block_m) + min(n, num_experts)
    order = torch.argsort(flat, stable=True)  # [n] pairs by expert, token order inside a group
    expert = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]  # place in its group
    dest = (tile_end - tiles)[expert] * block_m + rank  # [n]
    pairs = torch.full((num_tiles * block_m,), n, dtype=torch.int32, device=ids.device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    tile_expert = torch.searchsorted(tile_end, torch.arange(num_tiles, device=ids.device), right=True)
    return ExpertTiles(pairs, tile_expert.to(torch.int32), block_m)


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``experts_vanilla``: the Triton kernels (imported on first use; needs triton and CUDA)."""
    from runtime.kernels.triton_moe import fused_experts

    return fused_experts(x, w13, w2, weights, ids)


EXPERT_KERNELS: dict[str, ExpertKernel] = {"VANILLA": experts_vanilla, "DENSEGEMM": experts_grouped_gemm,
                                           "TRITON": experts_triton}
GRAPH_SAFE = frozenset({"DENSEGEMM", "TRITON"})  # backends a CUDA graph can capture (no host synchronization)
