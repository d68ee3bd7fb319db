"""Decoder-only targets over a paged KV cache, with hidden-state capture: dense ``qwen3`` and ``llama``, and
``qwen3_moe`` (sparse MoE blocks on the layers its config names, ``runtime.models.moe``).

Module names mirror Hugging Face (``model.layers.<i>.self_attn.q_proj`` ...), so a checkpoint's
state dict loads as is and tensor parallelism can find layers by name.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels import KernelBackend, PagedAttentionMeta
from runtime.models.layers import AttentionInputs, DecoderLayer, RMSNorm, RotaryEmbedding
from runtime.models.moe import sparse_layer_ids

# model_type -> per-family switches
TARGET_FAMILIES: dict[str, dict] = {
    "qwen3": {"qk_norm": True},
    "llama": {"qk_norm": False},
    "qwen3_moe": {"qk_norm": True},
}


def check_target_config(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in TARGET_FAMILIES:
        raise ValueError(f"target model_type {model_type!r} is not supported; supported: {sorted(TARGET_FAMILIES)}")
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(f"target layer_types {sorted(kinds)}: only full_attention layers are supported")


def validate_capture_layers(layer_ids, num_layers: int) -> None:
    last = num_layers - 1
    for layer in layer_ids:
        if not -1 <= layer < last:
            raise ValueError(f"target_layer_ids {list(layer_ids)}: id {layer} is out of range; a {num_layers}-layer "
                             f"target allows -1..{last - 1} (the last layer {last} is refused: its HF hidden state "
                             "is final-normed)")


class DecoderStack(nn.Module):
    def __init__(self, config, kernels: KernelBackend, qk_norm: bool, moe_backend: str | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        sparse = set(sparse_layer_ids(config))
        if sparse and moe_backend is None:
            raise ValueError(f"{config.model_type}: its MoE layers need a resolved moe_backend")
        self.layers = nn.ModuleList(DecoderLayer(config, kernels, qk_norm, moe_backend if i in sparse else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)


class TargetModel(nn.Module):
    """A causal LM whose forward also returns the captured outputs of ``capture_layer_ids``.

    Layer id ``l`` is the output of decoder layer ``l`` (HF ``hidden_states[l + 1]``), ``-1``
    the embedding output; the last layer cannot be captured (HF returns it final-normed).
    """

    def __init__(self, config, kernels: KernelBackend, moe_backend: str | None = None):
        super().__init__()
        check_target_config(config)
        self.config = config
        self.model = DecoderStack(config, kernels, moe_backend=moe_backend, **TARGET_FAMILIES[config.model_type])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = self.model.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(config, head_dim)
        self.capture_layer_ids: tuple[int, ...] = ()

    @property
    def has_moe_layers(self) -> bool:
        return bool(sparse_layer_ids(self.config))

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def set_capture(self, layer_ids: list[int] | tuple[int, ...]) -> None:
        validate_capture_layers(layer_ids, self.num_layers)
        self.capture_layer_ids = tuple(layer_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: PagedAttentionMeta, slots: torch.Tensor, unpack: torch.Tensor | None = None,
                padded_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        # input_ids, positions, slots: [T] -> hidden [T, d] (final-normed), captured [T, m*d] or None
        # (``unpack`` [T]: packed rows of a uniform layout of ``padded_rows`` that ``meta`` is planned for)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        inputs = AttentionInputs(cos=cos, sin=sin, meta=meta, slots=slots, unpack=unpack, padded_rows=padded_rows)
        captured = [h] if -1 in self.capture_layer_ids else []
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, caches[i], inputs)
            if i in self.capture_layer_ids:
                captured.append(residual + h)
        norm = self.model.norm
        return norm.kernels.add_rms_norm(h, residual, norm.weight, norm.eps)[0], \
            (torch.cat(captured, dim=-1) if captured else None)

    def fuse_projections(self) -> None:
        """Stack q/k/v and gate/up into single GEMMs (after weights load; serving only)."""
        for layer in self.model.layers:
            layer.fuse()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [R, d] -> [R, V] in float32
        return self.lm_head(hidden).float()

    def compute_top_argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [R, d] -> (max logit [R] float32, argmax [R]): what greedy verification reads; under tensor
        parallelism reduced per vocab slice (no logits gathered)."""
        top_argmax = getattr(self.lm_head, "top_argmax", None)
        if top_argmax is not None:
            return top_argmax(hidden)
        return self.compute_logits(hidden).max(dim=-1)
