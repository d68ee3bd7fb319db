"""The TRITON MoE backend: the routed experts as two tiled GEMMs that gather their own rows (CUDA, triton).

``fused_experts`` has the contract of ``runtime.kernels.moe.experts_vanilla``. The routing's (token, choice)
pairs are grouped by expert into tiles of ``block_m`` rows (``tile_pairs_by_expert``, or one Triton program for
the few pairs of a decode or verify step; a decode token's pairs get one tile each and no layout at all); each
program of ``_expert_gemm_kernel`` takes one tile and ``BLOCK_N`` output columns, loads its rows of A by index
(the token's hidden state for the gate/up projection, the pair's activation for the down projection), multiplies
by its expert's weight slice in float32 and stores each row at its pair's index, so nothing is permuted or
scattered outside the kernels. The down projection scales each row by its routing weight before the one
rounding; the k choices of a token are then summed. Tiles past the routing's last exit at once, so the grid is
fixed by the shapes and a CUDA graph can capture the whole forward. Both kernels launch with programmatic
dependent launch on sm_90 (``runtime.kernels.pdl``).

Arithmetic differs from VANILLA only in rounding: VANILLA rounds each expert's output to the model dtype before
weighting and accumulates in expert order; here the weighting happens in float32 and the sum over choices in
torch's (float32-accumulating) sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.moe import ExpertTiles, tile_pairs_by_expert
from runtime.kernels.pdl import launch_options, wait_for_inputs
from runtime.kernels.triton_ops import silu_and_mul

BLOCK_N = 64
BLOCK_K = 64
SMALL_TILE_PAIRS = 256  # up to this many (token, choice) pairs, tiles of 16 rows (decode and verify steps)
# Up to this many pairs (a decode token or two), each pair is its own tile: no layout kernels; an expert chosen by
# two tokens is read twice, which costs less than the dozen small kernels that build the layout.
ONE_PAIR_TILES_UP_TO = 16


@triton.jit
def _expert_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, pairs_ptr, tile_expert_ptr, ids_ptr, n_out, k_in, num_pairs,
                        num_experts, a_row_divisor, stride_a, stride_be, stride_bn, stride_c, WEIGHTED: tl.constexpr,
                        ONE_PAIR_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """C[pair, n] = (w[pair] *) sum_k A[pair // a_row_divisor, k] * B[expert, n, k] for the tile's pairs."""
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    if ONE_PAIR_PER_TILE:  # tile i is pair i alone (its other rows padding): no layout to build
        expert = tl.load(ids_ptr + tile)
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, tile, num_pairs)
    else:
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= num_experts:  # a tile past the routing's last
            return
        pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]; num_pairs marks padding
    valid = pair < num_pairs
    a_row = tl.where(valid, pair // a_row_divisor, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_a + ks[None, :]  # [BM, BK]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = ks < k_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc=acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if WEIGHTED:
        acc = acc * tl.load(w_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _tile_layout_kernel(ids_ptr, pairs_ptr, tile_expert_ptr, n, num_tiles, num_experts, BLOCK_M: tl.constexpr,
                        N_POW2: tl.constexpr, TILES_POW2: tl.constexpr, PDL: tl.constexpr):
    """One program writes ``tile_pairs_by_expert``'s layout of n <= N_POW2 pairs: quadratic in n, for the few
    pairs of decode and verify steps (one launch instead of a dozen)."""
    wait_for_inputs(PDL)
    i = tl.arange(0, N_POW2)
    ok = i < n
    e = tl.load(ids_ptr + i, mask=ok, other=num_experts).to(tl.int32)  # [N] expert of pair i
    same = (e[:, None] == e[None, :]) & ok[None, :]  # [N, N] pair j (column) shares pair i's (row) expert
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)  # place in its expert's group
    count = tl.sum(same.to(tl.int32), axis=1)  # its expert's pairs
    first = ok & (rank == 0)  # one pair stands for each expert used
    tiles_of = (count + BLOCK_M - 1) // BLOCK_M  # [N] its expert's tiles
    below = (e[None, :] < e[:, None]) & first[None, :]  # [N, N] column j stands for an expert below row i's
    start = tl.sum(tl.where(below, tiles_of[None, :], 0), axis=1)  # [N] first tile of pair i's expert
    t = tl.arange(0, TILES_POW2)
    owns = first[None, :] & (start[None, :] <= t[:, None]) & (t[:, None] < start[None, :] + tiles_of[None, :])
    tile_expert = tl.sum(tl.where(owns, e[None, :], 0), axis=1)  # [T] the expert whose tiles hold tile t
    used = tl.sum(owns.to(tl.int32), axis=1) > 0
    tl.store(tile_expert_ptr + t, tl.where(used, tile_expert, num_experts), mask=t < num_tiles)
    rows = tl.arange(0, BLOCK_M)
    for tile in range(0, num_tiles):  # every row the sentinel first ...
        tl.store(pairs_ptr + tile * BLOCK_M + rows, tl.full((BLOCK_M,), 0, tl.int32) + n)
    tl.debug_barrier()
    tl.store(pairs_ptr + start * BLOCK_M + rank, i, mask=ok)  # ... then each pair in its place


FUSED_LAYOUT_UP_TO = 128  # pairs whose layout one program builds (beyond, torch's sort-based build)


def tile_layout(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """``tile_pairs_by_expert`` (same tensors) in one Triton launch for up to ``FUSED_LAYOUT_UP_TO`` pairs."""
    n = ids.numel()
    if n > FUSED_LAYOUT_UP_TO:
        return tile_pairs_by_expert(ids, num_experts, block_m)
    num_tiles = -(-n // block_m) + min(n, num_experts)
    pairs = torch.empty(num_tiles * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=ids.device)
    _tile_layout_kernel[(1,)](ids.reshape(-1), pairs, tile_expert, n, num_tiles, num_experts, BLOCK_M=block_m,
                              N_POW2=max(16, triton.next_power_of_2(n)),
                              TILES_POW2=max(16, triton.next_power_of_2(num_tiles)), num_warps=4,
                              **launch_options(ids))
    return ExpertTiles(pairs, tile_expert, block_m)


def _expert_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 tiles: ExpertTiles | None, a_row_divisor: int, weighted: bool) -> torch.Tensor:
    """out [P, N] rows of the pairs in ``tiles`` (None: one pair per tile, its expert ``ids[p]``); a [rows, K],
    b [E, N, K] (last dims contiguous), ids [P] the expert of each pair."""
    num_experts, n_out, k_in = b.shape
    num_tiles = ids.numel() if tiles is None else tiles.tile_expert.numel()
    grid = (num_tiles, triton.cdiv(n_out, BLOCK_N))
    pairs, tile_expert = (ids, ids) if tiles is None else (tiles.pairs, tiles.tile_expert)  # unused when None
    _expert_gemm_kernel[grid](a, b, out, weights, pairs, tile_expert, ids, n_out, k_in, out.shape[0], num_experts,
                              a_row_divisor, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
                              WEIGHTED=weighted, ONE_PAIR_PER_TILE=tiles is None,
                              BLOCK_M=16 if tiles is None else tiles.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                              num_warps=4, **launch_options(a))
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k] -> [T, H] (x's dtype)."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"TRITON MoE: {name} needs a contiguous last dimension (strides {t.stride()})")
    tokens, k = ids.shape
    pairs = tokens * k
    flat = ids.reshape(-1).contiguous()  # [P] the expert of pair t*k+j
    tiles = None if pairs <= ONE_PAIR_TILES_UP_TO else tile_layout(
        ids, w13.shape[0], 16 if pairs <= SMALL_TILE_PAIRS else 64)
    weights = weights.reshape(-1).contiguous()  # [P] pair t*k+j's weight
    gate_up = _expert_gemm(x, w13, x.new_empty(pairs, w13.shape[1]), weights, flat, tiles, k, weighted=False)
    act = silu_and_mul(gate_up)  # [P, I]
    down = _expert_gemm(act, w2, x.new_empty(pairs, w2.shape[1]), weights, flat, tiles, 1, weighted=True)  # [P, H]
    return down.view(tokens, k, -1).sum(dim=1)
