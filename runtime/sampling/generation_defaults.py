"""The model's default sampling parameters: what its ``generation_config.json`` sets (vLLM's ``--generation-config
auto``, its default since 0.8): a request that leaves one of these unset samples as the model's authors chose.

Only the keys the file sets count (a file written by ``save_pretrained`` holds only what differs from transformers'
defaults): ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as the
default ``max_tokens``. ``do_sample`` is not read (vLLM neither): a model whose file sets a temperature samples at it.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.sampling.sampling_params import SamplingParams

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def model_sampling_defaults(model_dir: str | Path) -> dict:
    """The SamplingParams fields ``model_dir``'s generation_config.json sets ({} without the file); raises
    ``ValueError`` naming the file and the field where a value is not one SamplingParams accepts."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc}); fix it or set generation_config: none") from None
    defaults = {field: data[key] for key, field in KEYS.items() if isinstance(data, dict) and data.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}; fix it or set generation_config: none (the engine's own defaults)") from None
    return defaults
