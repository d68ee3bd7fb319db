"""Tensor parallelism as a transform applied to a built model (gpt-fast style).

``apply_tensor_parallel`` swaps the target's linears for sharded ones before weights load:
``q/k/v/gate/up`` are column-parallel (output rows split), ``o/down`` row-parallel (input columns
split, then an all-reduce), the embedding and LM head vocab-parallel (the LM head all-gathers
logits, so every rank sees full rows; greedy verification needs only each row's max and argmax, which the
ranks reduce from their slices, ``ParallelLMHead.top_argmax``). Each parameter records how it is sliced from the full
checkpoint tensor (``shard_dim``), so a rank reads only its own slice.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.models.small_gemm import GemmChoice, linear, swiglu_linear


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in its tensor-parallel group."""

    rank: int
    world_size: int
    group: object | None = None  # torch.distributed ProcessGroup of the TP ranks (None when world_size == 1)
    # the one-shot all-reduce the ranks agreed on (runtime.worker.all_reduce.choose_reducer), None: NCCL's
    reducer: object | None = None

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the TP ranks: ``x`` itself, summed in place (NCCL's all-reduce), or a new tensor
        (the one-shot reducer, for the messages it serves): use the result."""
        if not self.is_parallel:
            return x
        if self.reducer is not None and self.reducer.serves(x):
            return self.reducer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order: [W, *x.shape]."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in rank order."""
        if not self.is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext(rank=0, world_size=1)


def shard_range(total: int, ctx: ParallelContext) -> tuple[int, int]:
    """[start, end) of this rank's even share of ``total`` (ceil division; the last share may be short)."""
    size = -(-total // ctx.world_size)
    start = min(ctx.rank * size, total)
    return start, min(start + size, total)


def mark_shard(param: nn.Parameter, dim: int | None, start: int, end: int, padded: int | None = None) -> None:
    """Record how ``param`` is cut from the checkpoint tensor: rows/cols [start, end) of ``dim``."""
    param.shard_dim, param.shard_range, param.shard_padded = dim, (start, end), padded


class ColumnParallelLinear(nn.Module):
    """Output rows [start, end) of ``full``: this rank's even share, or ``rows`` when given (a replicated slice)."""

    def __init__(self, full: nn.Linear, ctx: ParallelContext, rows: tuple[int, int] | None = None):
        super().__init__()
        start, end = rows if rows is not None else shard_range(full.out_features, ctx)
        self.in_features, self.out_features = full.in_features, end - start
        self.weight = nn.Parameter(torch.empty(end - start, full.in_features))
        mark_shard(self.weight, 0, start, end)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(torch.empty(end - start))
            mark_shard(self.bias, 0, start, end)

    small_gemm: GemmChoice | None = None  # runtime.models.small_gemm.install_small_gemms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_gemm)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, ctx: ParallelContext):
        super().__init__()
        start, end = shard_range(full.in_features, ctx)
        self.ctx = ctx
        self.in_features, self.out_features = end - start, full.out_features
        self.weight = nn.Parameter(torch.empty(full.out_features, end - start))
        mark_shard(self.weight, 1, start, end)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(torch.empty(full.out_features))
            mark_shard(self.bias, None, 0, full.out_features)

    small_gemm: GemmChoice | None = None  # runtime.models.small_gemm.install_small_gemms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(linear(x, self.weight, None, self.small_gemm))
        return y + self.bias if self.bias is not None else y

    def swiglu_forward(self, gate_up: torch.Tensor, silu_and_mul) -> torch.Tensor:
        """``forward(silu_and_mul(gate_up))`` (this rank's slice of the intermediate), the activation fused into
        the GEMM where measured faster (``runtime.models.small_gemm.swiglu_linear``)."""
        y = self.ctx.all_reduce(swiglu_linear(gate_up, self.weight, None, self.small_gemm, silu_and_mul))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.vocab_size = full.num_embeddings
        self.shard = -(-full.num_embeddings // ctx.world_size)
        self.start, end = shard_range(full.num_embeddings, ctx)
        self.weight = nn.Parameter(torch.empty(self.shard, full.embedding_dim))
        mark_shard(self.weight, 0, self.start, end, padded=self.shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside[..., None].to(self.weight.dtype)
        return self.ctx.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocab-parallel LM head: each rank computes its slice of the logits, then they are gathered."""

    def __init__(self, full: nn.Linear, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.vocab_size = full.out_features
        shard = -(-full.out_features // ctx.world_size)
        start, end = shard_range(full.out_features, ctx)
        self.weight = nn.Parameter(torch.empty(shard, full.in_features))
        mark_shard(self.weight, 0, start, end, padded=shard)

    small_gemm: GemmChoice | None = None  # runtime.models.small_gemm.install_small_gemms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_gather_last(linear(x, self.weight, None, self.small_gemm))[..., :self.vocab_size]

    def top_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, d] -> (max logit [R] float32, its token [R]) without gathering the logits: each rank reduces its
        vocab slice, then only R (max, index) pairs cross. Equal to ``forward(x).float().max(-1)``: the same
        slice GEMMs, ties to the lowest token (the lower rank), NaN propagated to ``max``."""
        local = linear(x, self.weight, None, self.small_gemm).float()  # [R, V/W]
        start = self.ctx.rank * local.shape[-1]
        if start + local.shape[-1] > self.vocab_size:  # the last shard's padding rows are no tokens
            local[..., max(self.vocab_size - start, 0):] = float("-inf")
        top, index = local.max(dim=-1)
        tops, indices = self.ctx.gather_stack(top), self.ctx.gather_stack(index + start)  # [W, R] each
        best = tops.argmax(dim=0)  # [R] the first rank holding the max (NaN counts as the max)
        return tops.max(dim=0).values, indices.gather(0, best[None, :])[0]


def apply_tensor_parallel(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Shard a ``TargetModel`` in place (parameters left uninitialized: load weights next)."""
    if not ctx.is_parallel:
        return model
    config = model.config
    kv_rows = kv_head_rows(config, model.model.layers[0].self_attn.head_dim, ctx)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj, ctx)
        for proj in ("k_proj", "v_proj"):
            setattr(attn, proj, ColumnParallelLinear(getattr(attn, proj), ctx, kv_rows))
        attn.o_proj = RowParallelLinear(attn.o_proj, ctx)
        if hasattr(mlp, "experts"):  # a sparse MoE block: slice every expert, one all-reduce for the block
            shard_experts(mlp, ctx)
            continue
        mlp.gate_proj, mlp.up_proj = ColumnParallelLinear(mlp.gate_proj, ctx), ColumnParallelLinear(mlp.up_proj, ctx)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, ctx)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, ctx)
    model.lm_head = ParallelLMHead(model.lm_head, ctx)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def kv_head_rows(config, head_dim: int, ctx: ParallelContext) -> tuple[int, int]:
    """Rows of k_proj/v_proj this rank holds. The query heads split evenly; the key/value heads too when there are
    at least as many as ranks, else each is replicated on the ``world / kv_heads`` ranks whose query heads read
    it (rank r holds head ``r // (world / kv_heads)``), so attention stays local to every rank."""
    world, heads, kv = ctx.world_size, config.num_attention_heads, config.num_key_value_heads
    if heads % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the target's num_attention_heads ({heads})")
    if kv >= world:
        if kv % world:
            raise ValueError(f"tensor_parallel_size={world} must divide the target's num_key_value_heads ({kv}), "
                             "or be a multiple of it (key/value heads are then replicated)")
        return shard_range(kv * head_dim, ctx)
    if world % kv:
        raise ValueError(f"tensor_parallel_size={world} must be a multiple of the target's num_key_value_heads "
                         f"({kv}) to replicate them, or divide it")
    head = ctx.rank // (world // kv)
    return head * head_dim, (head + 1) * head_dim


def shard_experts(block: nn.Module, ctx: ParallelContext) -> None:
    """Tensor parallelism of a sparse MoE block (``runtime.models.moe.SparseMoeBlock``) by slicing every expert's
    intermediate dimension: this rank holds rows [a, b) of each expert's gate/up and columns [a, b) of its down,
    the router stays whole, and the block all-reduces its weighted sum once. Every rank does the same work for
    every token whatever the routing (expert parallelism would leave ranks idle when a small batch wakes few
    experts, and needs an all-to-all), and the sum is the one-GPU sum split in ``ctx.world_size`` parts."""
    intermediate = block.experts[0].down_proj.in_features
    if intermediate % ctx.world_size:
        raise ValueError(f"tensor_parallel_size={ctx.world_size} must divide the target's moe_intermediate_size "
                         f"({intermediate})")
    start, end = shard_range(intermediate, ctx)
    for expert in block.experts:
        for name in ("gate_proj", "up_proj"):
            part = ColumnParallelLinear(getattr(expert, name), ctx)
            setattr(expert, name, part)
        down = expert.down_proj
        down.weight = nn.Parameter(torch.empty(down.out_features, end - start))
        mark_shard(down.weight, 1, start, end)
        down.in_features = end - start
    block.parallel = ctx


def slice_for(param: torch.Tensor, read_slice) -> torch.Tensor:
    """This rank's part of a checkpoint tensor. ``read_slice(dim, start, end)`` reads rows/cols lazily
    (safetensors ``get_slice``); unsharded parameters read everything (dim None)."""
    dim = getattr(param, "shard_dim", None)
    if dim is None:
        return read_slice(None, 0, 0)
    start, end = param.shard_range
    part = read_slice(dim, start, end)
    padded = getattr(param, "shard_padded", None)
    if padded is not None and part.shape[dim] < padded:
        pad = list(part.shape)
        pad[dim] = padded - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def init_distributed(backend: str, init_method: str, world_size: int, rank: int,
                     timeout_s: float) -> None:
    """Join the replica's process group; fails after ``timeout_s`` if a peer never shows up."""
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s))
