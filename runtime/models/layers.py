"""Building blocks shared by the targets and the drafter: norms, RoPE, MLP, paged attention.

Head counts are read from weight shapes, never from the config, so tensor parallelism can
shard ``q/k/v/gate/up`` by rows and ``o/down`` by columns (plus an all-reduce) after
construction without touching these modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels import KernelBackend, PagedAttentionMeta, torch_ref
from runtime.models.moe import SparseMoeBlock
from runtime.models.small_gemm import norm_stream, prenorm_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def rope_parameters(config) -> dict:
    """RoPE settings from a transformers config, v5 (``rope_parameters``) or v4 (``rope_theta``/``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}


class RotaryEmbedding(nn.Module):
    """cos/sin tables at arbitrary positions, with the checkpoint's rope type (transformers' initializers)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = rope_parameters(config)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
        elif rope_type in ("linear", "llama3", "yarn", "longrope"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        else:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, "
                             "yarn, longrope")
        # A plain attribute, not a buffer: Module.to(dtype) must not round it to bfloat16.
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [P, head_dim] (``cache``)

    def cache(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Serving: compute cos/sin of positions 0..``max_positions``-1 once, on ``device`` in ``dtype``, so a forward
        in that dtype gathers its rows (two kernels, contiguous as computed ones: the rope kernels read them as they
        are) instead of computing them (nine small kernels, ~10-15 us of a graphed step on an H200); the values are
        the same arithmetic's, element by element. ``max_positions`` must bound every position a step feeds (the
        worker passes what a request's page table can address)."""
        self._tables = self._compute(torch.arange(max_positions, device=device), dtype)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, head_dim], computed in float32 (or gathered from the cached tables)
        tables = self._tables
        if tables is not None and tables[0].dtype == dtype and tables[0].device == positions.device:
            return tables[0][positions], tables[1][positions]
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class MLP(nn.Module):
    """SwiGLU MLP. ``fuse()`` (serving, after weights load) stacks gate/up into one ``gate_up_proj`` GEMM."""

    def __init__(self, hidden: int, intermediate: int, kernels: KernelBackend, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None
        self.kernels = kernels

    def fuse(self) -> None:
        self.gate_up_proj = stack_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self._down(self.gate_up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_prenorm(self, h: torch.Tensor, residual: torch.Tensor,
                        norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(h + residual))`` and the residual stream after the add (fused gate/up only): the add and
        the norm inside the gate/up GEMM where measured faster (``small_gemm.prenorm_linear``)."""
        gate_up, residual = prenorm_linear(self.gate_up_proj, h, residual, norm.weight, norm.eps, self.kernels)
        return self._down(gate_up), residual

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> down_proj(silu(gate) * up) [T, d]."""
        fused = getattr(self.down_proj, "swiglu_forward", None)  # a measured small-batch GEMM may fuse the act
        if fused is not None:
            return fused(gate_up, self.kernels.silu_and_mul)
        return self.down_proj(self.kernels.silu_and_mul(gate_up))


def stack_linears(parts: list[nn.Module]) -> nn.Linear:
    """One Linear whose output rows are ``parts``' rows in order (each part already this rank's TP slice)."""
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))
    return fused.requires_grad_(False)


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    """What every attention layer of one forward needs besides its own hidden states."""

    cos: torch.Tensor  # [T, D]
    sin: torch.Tensor  # [T, D]
    meta: PagedAttentionMeta
    slots: torch.Tensor | None = None  # [T] cache slots for this forward's K/V (target forwards)
    block_size: int | None = None  # draft blocks: T = B * block_size queries whose own K/V stay out of the
    # cache and are seen, bidirectionally, as extra keys by every query of the same block
    # packed verification (runtime.worker.packed_verify): the forward's T rows are a subset of a uniform layout of
    # ``padded_rows`` rows (what ``meta`` is planned for); ``unpack`` [T] is each row's place in it
    unpack: torch.Tensor | None = None
    padded_rows: int = 0


class Attention(nn.Module):
    """GQA attention over a paged cache; ``qk_norm`` gives Qwen3's per-head q/k RMSNorm.

    ``fuse()`` (serving, after weights load and TP slicing) stacks q/k/v into one ``qkv_proj`` GEMM; the
    unfused modules (``q_proj``/``k_proj``/``v_proj``) are what checkpoints, tensor parallelism and training see.
    """

    def __init__(self, config, kernels: KernelBackend, qk_norm: bool):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels) if qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.kernels = kernels
        self.qkv_proj: nn.Linear | None = None
        self.q_size = self.kv_size = 0  # this rank's q and k (= v) widths, set by fuse()

    @property
    def kv_width(self) -> int:
        """Output width of this rank's k (= v) projection."""
        return self.kv_size if self.qkv_proj is not None else self.k_proj.out_features

    def fuse(self) -> None:
        self.q_size, self.kv_size = self.q_proj.out_features, self.k_proj.out_features
        self.qkv_proj = stack_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> q [T, Hq, D], k, v [T, Hkv, D] as projected (views of one fused GEMM's output)."""
        if self.qkv_proj is not None:
            return self._split(self.qkv_proj(x))
        t, d = x.shape[0], self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [T, q + 2 kv] -> q [T, Hq, D], k, v [T, Hkv, D] (views)."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> k, v [T, Hkv, D] as projected (no q is computed; views of one GEMM's output when fused)."""
        if self.qkv_proj is not None:
            kv = F.linear(x, self.qkv_proj.weight[self.q_size:],
                          self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None)
            k, v = kv.split(self.kv_size, dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        return k.reshape(x.shape[0], -1, self.head_dim), v.reshape(x.shape[0], -1, self.head_dim)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: x [T, d] -> (k, v) [T, Hkv, D], k normed and rotated at its own positions."""
        k, v = self._kv(x)
        if self.k_norm is not None:
            k = self.kernels.rms_norm(k, self.k_norm.weight, self.eps)
        return torch_ref.apply_rope(k, cos, sin), v

    def append_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                  slots: torch.Tensor) -> None:
        """x [T, d] at tables cos, sin [T, D] -> k (normed, rotated) and v written at ``slots`` [T] of ``cache``: the
        projection and one kernel (``rope_and_cache_kv``)."""
        k, v = self._kv(x)
        self.kernels.rope_and_cache_kv(k, v, self._weights()[1], self.eps, cos, sin, cache[0], cache[1], slots)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training only (unfused): x [T, d] -> q [T, Hq, D] normed and rotated."""
        q = self.q_proj(x).view(x.shape[0], -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return torch_ref.apply_rope(q, cos, sin)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                inputs: AttentionInputs) -> torch.Tensor:
        # x: [T, d] -> [T, d]
        return self.attend(*self._qkv(x), cache, inputs)

    def forward_prenorm(self, h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                        cache: tuple[torch.Tensor, torch.Tensor],
                        inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(h + residual))`` and the residual stream after the add (fused q/k/v only): the add and
        the norm inside the q/k/v GEMM where measured faster (``small_gemm.prenorm_linear``)."""
        qkv, residual = prenorm_linear(self.qkv_proj, h, residual, norm.weight, norm.eps, self.kernels)
        return self.attend(*self._split(qkv), cache, inputs), residual

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
               inputs: AttentionInputs) -> torch.Tensor:
        """Projected q [T, Hq, D], k, v [T, Hkv, D] -> the attention block's output [T, d] (norms, RoPE, the
        cache write, attention, o_proj)."""
        rows = q.shape[0]
        if inputs.block_size is None:  # k and v go to the cache in the same kernel that rotates them
            # packed rows: the kernel writes each fed row's q into the uniform layout the plan is for (rows not fed
            # zero: they attend to nothing needed), and attention's output is read back at the fed rows
            q = self.kernels.rope_and_cache(q, k, v, *self._weights(), self.eps, inputs.cos, inputs.sin, cache[0],
                                            cache[1], inputs.slots, inputs.unpack, inputs.padded_rows)
            out = self.kernels.paged_attention(q, cache[0], cache[1], inputs.meta, self.scale)
            if inputs.unpack is not None:
                out = out[inputs.unpack]
        else:
            q, k = self.kernels.qk_norm_rope(q, k, *self._weights(), self.eps, inputs.cos, inputs.sin)
            shape = (-1, inputs.block_size, *k.shape[1:])  # [B, block, Hkv, D]
            out = self.kernels.paged_attention(q, cache[0], cache[1], inputs.meta, self.scale,
                                               k.view(shape), v.view(shape))
        return self.o_proj(out.reshape(rows, -1))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block (Qwen3 / Llama) on a residual stream.

    ``forward(h, residual)`` takes the previous block's output ``h`` and the stream before it (``residual`` None
    for the first block, where ``h`` is the embedding) and returns ``(mlp_out, residual)``; the block's output
    hidden state (HF ``hidden_states[l + 1]``) is ``residual + mlp_out``. Each residual add is fused with the norm
    that follows it (``kernels.add_rms_norm``), and with fused projections both may run inside the GEMM that reads
    the norm's output (``small_gemm.prenorm_linear``: where measured faster, the same values).
    """

    def __init__(self, config, kernels: KernelBackend, qk_norm: bool, sparse_moe_backend: str | None = None):
        super().__init__()
        self.self_attn = Attention(config, kernels, qk_norm)
        if sparse_moe_backend is not None:  # an MoE layer (runtime.models.moe.sparse_layer_ids) and its expert kernel
            self.mlp = SparseMoeBlock(config, sparse_moe_backend)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, kernels,
                           bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.kernels = kernels

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cache: tuple[torch.Tensor, torch.Tensor],
                inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if self.self_attn.qkv_proj is not None:  # fused: the norm may run inside the q/k/v GEMM
            a, residual = self.self_attn.forward_prenorm(h, residual, norm, cache, inputs)
        else:
            x, residual = norm_stream(self.kernels, h, residual, norm.weight, norm.eps)
            a = self.self_attn(x, cache, inputs)
        if isinstance(self.mlp, MLP) and self.mlp.gate_up_proj is not None:  # and inside the gate/up GEMM
            return self.mlp.forward_prenorm(a, residual, post)
        x, residual = norm_stream(self.kernels, a, residual, post.weight, post.eps)
        return self.mlp(x), residual
