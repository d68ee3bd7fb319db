"""Checkpoint metadata: the drafter's DSpark keys and the embedded-draft probe.

Reads JSON only (``config.json`` and weight index files), never tensors, so it is
cheap enough to run while a config is validated. Callers memoize the results on
the config object; nothing here caches.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MTP_KEY = re.compile(r"^mtp\.\d+\.")
WEIGHT_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
EMBEDDED_MODEL_TYPE = "deepseek_v4"

# Config field -> key names a checkpoint may use for it, in the order they are
# tried inside each namespace (nested ``dspark_config`` / ``dflash_config`` dicts,
# then TensorRT-LLM's top-level ``dspark_<key>``, then DeepSpec's plain ``<key>``).
DRAFT_KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "block_size": ("block_size",),
    "mask_token_id": ("mask_token_id", "noise_token_id"),
    "target_layer_ids": ("target_layer_ids",),
    "markov_rank": ("markov_rank",),
    "markov_head_type": ("markov_head_type",),
    "num_target_layers": ("num_target_layers",),
    "enable_confidence_head": ("enable_confidence_head", "use_confidence_head"),
    "confidence_head_with_markov": ("confidence_head_with_markov",),
}
NESTED_SECTIONS = ("dspark_config", "dflash_config")


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object; raises ``OSError`` or ``ValueError`` (bad JSON or not an object)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_model_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json`` of a checkpoint directory, or None when there is none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_model: cannot parse {path}: {exc}") from exc


def lookup_draft_key(hf_config: dict[str, Any], field: str) -> Any:
    """The checkpoint's value for a DSpark field, or None.

    Precedence: ``dspark_config`` dict, ``dflash_config`` dict, top-level
    ``dspark_<key>``, top-level ``<key>`` (DeepSpec layout).
    """
    aliases = DRAFT_KEY_ALIASES[field]
    for section in NESTED_SECTIONS:
        nested = hf_config.get(section)
        if isinstance(nested, dict):
            for key in aliases:
                if nested.get(key) is not None:
                    return nested[key]
    for prefix in ("dspark_", ""):
        for key in aliases:
            if hf_config.get(prefix + key) is not None:
                return hf_config[prefix + key]
    return None


def draft_metadata(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Every DSpark field the checkpoint sets, keyed by config field name."""
    found = {field: lookup_draft_key(hf_config, field) for field in DRAFT_KEY_ALIASES}
    return {field: value for field, value in found.items() if value is not None}


def probe_draft_is_embedded(speculative_model: str | Path | None) -> bool:
    """True when the draft lives in the checkpoint's ``mtp.<n>.*`` namespace.

    Rules (TensorRT-LLM's, which the DESIGN fixes): no model -> False. Try each
    weight index in turn; a missing file moves to the next one; a parsed
    ``weight_map`` decides both ways (any key matching ``^mtp\\.\\d+\\.``); an
    index that does not parse stops the search. Only then does ``config.json``
    ``model_type == "deepseek_v4"`` decide.
    """
    if speculative_model is None:
        return False
    root = Path(speculative_model)
    for name in WEIGHT_INDEX_FILES:
        index_path = root / name
        if not index_path.is_file():
            continue
        try:
            weight_map = read_json(index_path)["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError):
            break
        return any(MTP_KEY.match(key) for key in weight_map)
    try:
        hf_config = read_json(root / "config.json")
    except (OSError, ValueError):
        return False
    return hf_config.get("model_type") == EMBEDDED_MODEL_TYPE
