"""The standalone DSpark drafter (DeepSpec layout): context injection and one-pass block drafting.

Context: ``H = hidden_norm(fc(concat(captured target layers)))`` for every committed token,
projected by each draft layer's own ``k_proj``/``v_proj`` (then ``k_norm`` and RoPE at the
token's own position; no input layernorm) into a paged cache that shares the target's page
table. Block: ``[anchor, MASK x (B-1)]`` embedded with the target's embedding at positions
``p..p+B-1``; its queries see every context key before the anchor plus the whole block
(bidirectional). The embedding and LM head are the target's: the runner passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.kernels import KernelBackend, PagedAttentionMeta
from runtime.models.heads import ConfidenceHead, MarkovHead
from runtime.models.layers import AttentionInputs, DecoderLayer, RMSNorm, RotaryEmbedding


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    """The drafter's resolved shape (from its checkpoint and the resolved DSparkDecodingConfig)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    context_window: int | None = None  # embedded flavour: the block sees only the last N context positions
    embedded: bool = False  # the target checkpoint's mtp.<s>.* stages (full target decoder blocks)
    sparse_stages: frozenset[int] = frozenset()  # embedded stages that are sparse MoE blocks


class DSparkDrafter(nn.Module):
    """Standalone (DeepSpec) layers are Qwen3 decoder blocks; an embedded drafter's stages are the target's own
    blocks (``qk_norm`` of its family, sparse MoE blocks at ``sparse_stages`` on ``moe_backend``)."""

    def __init__(self, config, spec: DrafterSpec, kernels: KernelBackend, qk_norm: bool = True,
                 sparse_stages: frozenset[int] = frozenset(), moe_backend: str | None = None):
        super().__init__()
        d = config.hidden_size
        self.spec = spec
        self.fc = nn.Linear(len(spec.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps, kernels)
        self.layers = nn.ModuleList(DecoderLayer(config, kernels, qk_norm, moe_backend if i in sparse_stages else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps, kernels)
        self.rotary = RotaryEmbedding(config, self.layers[0].self_attn.head_dim)
        self.markov_head = (MarkovHead(spec.markov_head_type or "vanilla", config.vocab_size, spec.markov_rank, d)
                            if spec.markov_rank > 0 else None)
        conf_dim = d + (spec.markov_rank if spec.confidence_head_with_markov else 0)
        self.confidence_head = ConfidenceHead(conf_dim) if spec.enable_confidence_head else None
        self.kernels = kernels

    def append_context(self, captured: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # captured: [N, m*d] target hidden states; positions, slots: [N]. Writes context K/V, returns nothing.
        ctx = self.hidden_norm(self.fc(captured.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(positions, ctx.dtype)
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.append_kv(ctx, cos, sin, cache, slots)

    def forward_block(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                      caches: list[tuple[torch.Tensor, torch.Tensor]], meta: PagedAttentionMeta) -> torch.Tensor:
        # block_embeds: [B, K, d]; positions: [B*K]; meta: non-causal over each request's context.
        # -> block hidden states after the final norm, [B, K, d]
        batch, block, d = block_embeds.shape
        h = block_embeds.reshape(batch * block, d).to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        inputs = AttentionInputs(cos=cos, sin=sin, meta=meta, block_size=block)
        residual = None
        for layer, cache in zip(self.layers, caches):
            h, residual = layer(h, residual, cache, inputs)
        return self.kernels.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0].view(batch, block, d)

    def fuse_projections(self) -> None:
        """Stack q/k/v and gate/up into single GEMMs (after weights load; serving only)."""
        for layer in self.layers:
            layer.fuse()

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        # hidden: [B, K, d]; prev_ids: [B, K] (x_{k-1}) -> [B, K] or None
        if self.confidence_head is None:
            return None
        features = hidden
        if self.spec.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.prev_embeddings(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)
