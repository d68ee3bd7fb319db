"""All checkpoint I/O: Hugging Face configs, safetensors (single file or sharded), weight-name aliases."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig

from configs import DSparkDecodingConfig
from configs.checkpoint import MTP_KEY, draft_metadata, read_model_config
from runtime.kernels import KernelBackend
from runtime.models.drafter import DrafterSpec, DSparkDrafter
from runtime.models.parallel import SINGLE, ParallelContext, apply_tensor_parallel, slice_for
from runtime.models.target import TARGET_FAMILIES, TargetModel, check_target_config, validate_capture_layers

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
EMBEDDED_STAGE = re.compile(r"^mtp\.(\d+)\.(.+)$")
# Embedded layout: stage 0's projection of the captured states, under the standalone drafter's names.
EMBEDDED_STAGE0 = {"main_proj.weight": "fc.weight", "main_norm.weight": "hidden_norm.weight"}
EMBEDDED_LAST_STAGE = ("norm.weight", "markov_head.", "confidence_head.", "markov_w1.", "markov_w2.",
                       "confidence_proj.")
DEFAULT_CONTEXT_WINDOW = 128  # embedded drafters' rolling window when config.json names none


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
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{what}: {index} names shard files that are not there: {missing[:4]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{what}: no safetensors weights in {path}")
    return files


class CheckpointReader:
    """Lazy access to a checkpoint's tensors by name, whole or as a slice along one dim."""

    def __init__(self, path: str | Path, what: str):
        self.what = what
        self._files: dict[str, object] = {}
        self._where: dict[str, str] = {}
        for file in safetensors_files(Path(path), what):
            handle = safe_open(str(file), framework="pt")
            self._files[str(file)] = handle
            for name in handle.keys():
                self._where[name] = str(file)

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> list[int]:
        return list(self._files[self._where[name]].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int = 0) -> torch.Tensor:
        tensor = self._files[self._where[name]].get_slice(name)
        if dim is None:
            return tensor[:]
        index = [slice(None)] * len(tensor.get_shape())
        index[dim] = slice(start, end)
        return tensor[tuple(index)]


def load_parameters(module: nn.Module, reader: CheckpointReader, source: dict[str, str], what: str) -> None:
    """Fill every parameter of ``module`` from ``reader``; ``source`` maps parameter -> checkpoint name.

    Sharded parameters (see ``runtime.models.parallel``) read only their slice. Missing tensors, wrong
    shapes and checkpoint tensors nothing reads are errors naming the tensor.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    missing = sorted(n for n in params if source.get(n) not in reader.names())
    unused = sorted(reader.names() - set(source.values()))
    if missing or unused:
        raise CheckpointError(f"{what}: tensors do not match the model: missing {missing[:8]}, "
                              f"unexpected {unused[:8]}")
    with torch.no_grad():
        for name, param in tqdm(params.items(), desc=f"loading {what}", unit="tensor", disable=None, leave=False):
            part = slice_for(param, lambda dim, a, b, n=source[name]: reader.read(n, dim, a, b))
            if tuple(part.shape) != tuple(param.shape):
                raise CheckpointError(f"{what}: tensor {source[name]} has shape {list(part.shape)}, expected "
                                      f"{list(param.shape)}" + (" (this rank's slice)" if hasattr(param, "shard_dim")
                                                                 and param.shard_dim is not None else ""))
            param.copy_(part)


def load_target(path: str, kernels: KernelBackend, dtype: torch.dtype, device: torch.device,
                parallel: ParallelContext = SINGLE, load_format: str = "auto",
                moe_backend: str | None = None) -> TargetModel:
    """Build the target (its MoE layers on ``moe_backend``, resolved for this rank), shard it for ``parallel``,
    and read this rank's slice of every weight (``dummy``: random weights, nothing read but config.json)."""
    config = load_hf_config(path, "model")
    try:
        with torch.device(device):
            model = apply_tensor_parallel(TargetModel(config, kernels, moe_backend), parallel).to(dtype)
    except ValueError as exc:
        raise CheckpointError(f"model {path}: {exc}") from exc
    if load_format == "dummy":
        return init_dummy(model).eval()
    reader = CheckpointReader(path, "model")
    source = {name: name for name, _ in model.named_parameters(remove_duplicate=False)}
    if getattr(config, "tie_word_embeddings", False):
        source["lm_head.weight"] = "model.embed_tokens.weight"
    # rotary caches of old checkpoints, and an embedded drafter's mtp.<s>.* stages (the drafter loads those)
    ignored = {n for n in reader.names() if n.endswith("rotary_emb.inv_freq") or MTP_KEY.match(n)}
    if ignored:
        source.update({f"<ignored>{n}": n for n in ignored})
    load_parameters(model, reader, source, f"model {path}")
    return model.eval()


def init_dummy(model: nn.Module, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Random weights for shape benchmarks: matrices N(0, std), norm weights 1 (so activations stay finite)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                param.normal_(0.0, std, generator=generator)
    return model


def embedded_sources(names: set[str], what: str) -> tuple[int, frozenset[int], dict[str, str]]:
    """An embedded drafter's layout from its checkpoint names -> (stage count, sparse stages, parameter ->
    checkpoint name). ``mtp.<s>.<layer name>`` are stage s's decoder block; stage 0 also holds ``main_proj`` /
    ``main_norm`` (the standalone ``fc`` / ``hidden_norm``), the last stage ``norm`` and the heads."""
    by_stage: dict[int, list[tuple[str, str]]] = {}
    for name in names:
        match = EMBEDDED_STAGE.match(name)
        if match:
            by_stage.setdefault(int(match.group(1)), []).append((match.group(2), name))
    if not by_stage:
        raise CheckpointError(f"{what}: no mtp.<s>.* tensors, so no embedded drafter")
    stages = max(by_stage) + 1
    if len(by_stage) != stages:
        raise CheckpointError(f"{what}: embedded stages {sorted(by_stage)} are not 0..{stages - 1}")
    source = {}
    for stage, items in by_stage.items():
        for rest, name in items:
            if stage == 0 and rest in EMBEDDED_STAGE0:
                source[EMBEDDED_STAGE0[rest]] = name
            elif stage == stages - 1 and rest.startswith(EMBEDDED_LAST_STAGE):
                source[DRAFTER_KEY_ALIASES.get(rest, rest)] = name
            else:
                source[f"layers.{stage}.{rest}"] = name
    sparse = frozenset(s for s, items in by_stage.items() if any(r.startswith("mlp.experts.") for r, _ in items))
    return stages, sparse, source


def embedded_drafter_spec(spec_config: DSparkDecodingConfig, raw: dict, found: dict) -> DrafterSpec:
    """The embedded drafter's shape: the dspark_* keys of the target's config.json, the stage layout and head
    switches from its mtp.<s>.* tensors, the rolling window from ``dspark_window_size``/``window_size``."""
    path = str(spec_config.speculative_model)
    reader = CheckpointReader(path, "speculative_model")
    stages, sparse, source = embedded_sources(reader.names(), f"speculative_model {path}")
    rank = int(spec_config.markov_rank or 0)
    confidence = source.get("confidence_head.proj.weight")
    with_markov = found.get("confidence_head_with_markov")
    if with_markov is None and confidence is not None:  # [1, d + r] reads the Markov embedding too
        with_markov = reader.shape(confidence)[1] > raw["hidden_size"]
    window = raw.get("dspark_window_size", raw.get("window_size", DEFAULT_CONTEXT_WINDOW))
    if not isinstance(window, int) or window < 1:
        raise CheckpointError(f"speculative_model: {path}: dspark_window_size must be a positive integer, got "
                              f"{window!r}")
    return DrafterSpec(block_size=int(spec_config.max_draft_len), mask_token_id=int(spec_config.mask_token_id),
                       target_layer_ids=tuple(spec_config.target_layer_ids), markov_rank=rank,
                       markov_head_type=spec_config.markov_head_type,
                       enable_confidence_head=bool(found.get("enable_confidence_head", confidence is not None)),
                       confidence_head_with_markov=bool(with_markov), context_window=window, embedded=True,
                       sparse_stages=sparse)


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
    if spec_config.draft_is_embedded_in_target:
        return embedded_drafter_spec(spec_config, raw, found)
    rank = int(spec_config.markov_rank or 0)
    with_markov = bool(found.get("confidence_head_with_markov", False))
    if with_markov and rank == 0:
        raise CheckpointError(f"speculative_model: {path}: confidence_head_with_markov needs markov_rank > 0")
    return DrafterSpec(block_size=int(spec_config.max_draft_len), mask_token_id=int(spec_config.mask_token_id),
                       target_layer_ids=tuple(spec_config.target_layer_ids), markov_rank=rank,
                       markov_head_type=spec_config.markov_head_type,
                       enable_confidence_head=bool(found.get("enable_confidence_head", False)),
                       confidence_head_with_markov=with_markov)


def drafter_sources(module: nn.Module, reader: CheckpointReader) -> dict[str, str]:
    """Parameter -> checkpoint name for a DeepSpec drafter (TensorRT-LLM aliases and a ``model.`` prefix
    accepted); the checkpoint's embedding and LM head copies map to nothing and are skipped."""
    by_param = {}
    for name in reader.names():
        plain = name.removeprefix("model.")
        if plain.startswith(DRAFTER_SHARED_PREFIXES):
            by_param[f"<ignored>{name}"] = name
            continue
        by_param[DRAFTER_KEY_ALIASES.get(plain, plain)] = name
    return by_param


def load_embedded_drafter(spec_config: DSparkDecodingConfig, target_config, kernels: KernelBackend,
                          dtype: torch.dtype, device: torch.device, spec: DrafterSpec,
                          moe_backend: str | None) -> DSparkDrafter:
    """The drafter embedded in a target checkpoint: its mtp.<s>.* stages are blocks of the target's family (the
    target's config with one layer per stage), loaded under the standalone drafter's module names."""
    path = str(spec_config.speculative_model)
    what = f"speculative_model {path}"
    config = copy.deepcopy(load_hf_config(path, "speculative_model"))
    check_target_config(config)
    for field in ("vocab_size", "hidden_size"):
        if getattr(config, field) != getattr(target_config, field):
            raise CheckpointError(f"speculative_model: the embedded drafter's {field} {getattr(config, field)} does "
                                  f"not match the target's {getattr(target_config, field)}")
    reader = CheckpointReader(path, "speculative_model")
    stages, _, source = embedded_sources(reader.names(), what)
    config.num_hidden_layers = stages
    validate_capture_layers(spec.target_layer_ids, target_config.num_hidden_layers)
    with torch.device(device):
        drafter = DSparkDrafter(config, spec, kernels, qk_norm=TARGET_FAMILIES[config.model_type]["qk_norm"],
                                sparse_stages=spec.sparse_stages, moe_backend=moe_backend).to(dtype)
    if spec_config.load_format == "dummy":
        return init_dummy(drafter).eval()
    others = {f"<ignored>{n}": n for n in reader.names() if not MTP_KEY.match(n)}  # the target's own tensors
    load_parameters(drafter, reader, {**source, **others}, what)
    return drafter.eval()


def load_drafter(spec_config: DSparkDecodingConfig, target_config, kernels: KernelBackend, dtype: torch.dtype,
                 device: torch.device, spec: DrafterSpec | None = None,
                 moe_backend: str | None = None) -> DSparkDrafter:
    """The drafter: standalone (DeepSpec layout) or embedded in the target (``mtp.<s>.*``), as the probe said;
    checked against the target's config (vocabulary, width, layers). ``spec`` is ``drafter_spec(spec_config)``
    when the caller already read it; ``moe_backend`` runs an embedded drafter's MoE stages."""
    spec = spec or drafter_spec(spec_config)
    if spec.embedded:
        return load_embedded_drafter(spec_config, target_config, kernels, dtype, device, spec, moe_backend)
    path = str(spec_config.speculative_model)
    config = load_hf_config(path, "speculative_model")
    for field in ("vocab_size", "hidden_size"):
        if getattr(config, field) != getattr(target_config, field):
            raise CheckpointError(f"speculative_model: {field} {getattr(config, field)} does not match the target's "
                                  f"{getattr(target_config, field)}")
    if set(getattr(config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        raise CheckpointError(f"speculative_model: layer_types {config.layer_types}: only full_attention is supported")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        raise CheckpointError(f"speculative_config.mask_token_id {spec.mask_token_id} is outside the target "
                              f"vocabulary (0..{target_config.vocab_size - 1})")
    validate_capture_layers(spec.target_layer_ids, target_config.num_hidden_layers)
    with torch.device(device):
        drafter = DSparkDrafter(config, spec, kernels).to(dtype)
    if spec_config.load_format == "dummy":
        return init_dummy(drafter).eval()
    reader = CheckpointReader(path, "speculative_model")
    load_parameters(drafter, reader, drafter_sources(drafter, reader), f"speculative_model {path}")
    return drafter.eval()


class VocabModules(nn.Module):
    """Full copies of the target's embedding and LM head, for a drafter that cannot share the target's
    (a separate process, or rank 0 of a vocab-parallel target)."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def load_vocab_modules(path: str, config, dtype: torch.dtype, device: torch.device,
                       load_format: str = "auto") -> VocabModules:
    """The target's embedding and LM head alone (a drafter process without the whole target). ``dummy``: random,
    the embedding equal to a dummy target's (the same seeded first draw), the head not (shape benchmarks only)."""
    with torch.device(device):
        vocab = VocabModules(config).to(dtype)
    if load_format == "dummy":
        return init_dummy(vocab).eval()
    reader = CheckpointReader(path, "model")
    head = "model.embed_tokens.weight" if getattr(config, "tie_word_embeddings", False) else "lm_head.weight"
    with torch.no_grad():
        vocab.embed_tokens.weight.copy_(reader.read("model.embed_tokens.weight"))
        vocab.lm_head.weight.copy_(reader.read(head))
    return vocab.eval()


def load_markov_w2(spec_config: DSparkDecodingConfig, vocab_size: int, dtype: torch.dtype,
                   device: torch.device) -> nn.Linear:
    """The drafter's Markov ``W2`` alone (for target ranks that rebuild draft probabilities). A ``dummy`` drafter's
    is random, the same on every rank (shape benchmarks: greedy, so never read)."""
    if spec_config.load_format == "dummy":
        with torch.device(device):
            return init_dummy(nn.Linear(int(spec_config.markov_rank), vocab_size, bias=False).to(dtype)).eval()
    reader = CheckpointReader(str(spec_config.speculative_model), "speculative_model")
    name = next((n for n in ("markov_head.markov_w2.weight", "markov_w2.weight", "model.markov_head.markov_w2.weight")
                 if n in reader.names()), None)
    if name is None:
        raise CheckpointError("speculative_model: no markov_head.markov_w2.weight although markov_rank > 0")
    with torch.device(device):
        w2 = nn.Linear(int(spec_config.markov_rank), vocab_size, bias=False).to(dtype)
    with torch.no_grad():
        w2.weight.copy_(reader.read(name))
    return w2.eval()
