"""All checkpoint I/O: Hugging Face configs, safetensors (single file or sharded), weight-name aliases."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from configs import DSparkDecodingConfig
from configs.checkpoint import draft_metadata, read_model_config
from runtime.kernels import KernelBackend
from runtime.models.drafter import DrafterSpec, DSparkDrafter
from runtime.models.target import TargetModel

# Drafter tensors we never load: the target's embedding and LM head are used instead.
DRAFTER_SHARED_PREFIXES = ("embed_tokens.", "lm_head.")
# TensorRT-LLM spellings of DeepSpec tensor names.
DRAFTER_KEY_ALIASES = {
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "confidence_proj.weight": "confidence_head.proj.weight",
    "confidence_proj.bias": "confidence_head.proj.bias",
}
DRAFTER_ARCHITECTURE_HINTS = ("DSpark", "DFlash")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file, tensor or field."""


def load_hf_config(path: str | Path, what: str):
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{what}: {path} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{what}: cannot read {path / 'config.json'}: {exc}") from exc


def safetensors_files(path: Path, what: str) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{what}: no safetensors weights in {path}")
    return files


def iter_tensors(path: str | Path, what: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(Path(path), what):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def load_state(module: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """Copy ``tensors`` into ``module``; every parameter must be present with its exact shape."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{what}: tensors do not match the model: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{what}: tensor {name} has shape {list(tensor.shape)}, expected "
                                  f"{list(expected[name].shape)}")
    module.load_state_dict(tensors, strict=True)


def load_target(path: str, kernels: KernelBackend, dtype: torch.dtype, device: torch.device) -> TargetModel:
    config = load_hf_config(path, "model")
    try:
        with torch.device(device):
            model = TargetModel(config, kernels).to(dtype)
    except ValueError as exc:
        raise CheckpointError(f"model {path}: {exc}") from exc
    tensors = dict(iter_tensors(path, "model"))
    if getattr(config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    load_state(model, tensors, f"model {path}")
    return model.eval()


def drafter_spec(spec_config: DSparkDecodingConfig) -> DrafterSpec:
    """The drafter's shape: resolved config fields plus the head switches of its config.json."""
    path = Path(str(spec_config.speculative_model))
    raw = read_model_config(path)
    if raw is None:
        raise CheckpointError(f"speculative_model: {path} has no config.json")
    architectures = " ".join(raw.get("architectures") or [])
    found = draft_metadata(raw)
    if not (any(h in architectures for h in DRAFTER_ARCHITECTURE_HINTS) or "target_layer_ids" in found):
        raise CheckpointError(f"speculative_model: {path} is not a DSpark/DFlash drafter (architectures "
                              f"{raw.get('architectures')!r}, no target_layer_ids); expected the DeepSpec layout")
    if not spec_config.is_resolved:
        missing = [f for f in ("max_draft_len", "mask_token_id", "target_layer_ids")
                   if getattr(spec_config, f) is None]
        raise CheckpointError(f"speculative_config: {missing} are neither set nor in {path / 'config.json'}")
    rank = int(spec_config.markov_rank or 0)
    with_markov = bool(found.get("confidence_head_with_markov", False))
    if with_markov and rank == 0:
        raise CheckpointError(f"speculative_model: {path}: confidence_head_with_markov needs markov_rank > 0")
    return DrafterSpec(block_size=int(spec_config.max_draft_len), mask_token_id=int(spec_config.mask_token_id),
                       target_layer_ids=tuple(spec_config.target_layer_ids), markov_rank=rank,
                       markov_head_type=spec_config.markov_head_type,
                       enable_confidence_head=bool(found.get("enable_confidence_head", False)),
                       confidence_head_with_markov=with_markov)


def drafter_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in iter_tensors(path, "speculative_model"):
        name = name.removeprefix("model.")
        if name.startswith(DRAFTER_SHARED_PREFIXES):
            continue
        tensors[DRAFTER_KEY_ALIASES.get(name, name)] = tensor
    return tensors


def load_drafter(spec_config: DSparkDecodingConfig, target: TargetModel, kernels: KernelBackend,
                 dtype: torch.dtype, device: torch.device) -> DSparkDrafter:
    if spec_config.draft_is_embedded_in_target:
        raise CheckpointError("speculative_model: drafts embedded in the target (mtp.* layers) are not supported "
                              "by this engine yet; use a standalone DeepSpec drafter checkpoint")
    path = str(spec_config.speculative_model)
    spec = drafter_spec(spec_config)
    config = load_hf_config(path, "speculative_model")
    for field in ("vocab_size", "hidden_size"):
        if getattr(config, field) != getattr(target.config, field):
            raise CheckpointError(f"speculative_model: {field} {getattr(config, field)} does not match the target's "
                                  f"{getattr(target.config, field)}")
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        raise CheckpointError(f"speculative_model: layer_types {config.layer_types}: only full_attention is supported")
    if not 0 <= spec.mask_token_id < target.config.vocab_size:
        raise CheckpointError(f"speculative_config.mask_token_id {spec.mask_token_id} is outside the target "
                              f"vocabulary (0..{target.config.vocab_size - 1})")
    target.set_capture(spec.target_layer_ids)
    with torch.device(device):
        drafter = DSparkDrafter(config, spec, kernels).to(dtype)
    if spec_config.load_format != "dummy":
        load_state(drafter, drafter_tensors(path), f"speculative_model {path}")
    return drafter.eval()
