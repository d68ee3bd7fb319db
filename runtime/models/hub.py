"""Checkpoint names for ``model``, ``tokenizer`` and ``speculative_model``, resolved to local directories.

A name that is an existing local path is used as is, except a GGUF file (or a folder holding one and no
config.json), which is converted once into a cached Hugging Face directory (``runtime.models.gguf_checkpoint``). A known
name (``runtime.models.named_models``: ``smollm2``, ``smollm2-dspark``) is the checkpoint it names. Otherwise, a name shaped
like a Hub repository id
(``org/name`` or ``name``) is fetched with ``huggingface_hub.snapshot_download`` at the configured revision, into
(and from) the Hub's own cache: ``HF_HOME`` / ``HF_HUB_CACHE`` choose where, and ``HF_HUB_OFFLINE=1`` uses only
what the cache holds. Anything else, or an id the Hub (or the offline cache) does not have, is an error naming
the field and the id. Resolution runs once where a replica is built (the driver of ``cluster.LLM``, ``dspark
serve`` on the head node, ``runtime.LLM`` in process); the actors only ever see local paths.
"""

from __future__ import annotations

from pathlib import Path

from configs import DSparkDecodingConfig, LLMConfig
from configs.hub_ids import is_hub_id
from runtime.models.gguf_checkpoint import converted_dir, is_gguf
from runtime.models.named_models import NAMED_CHECKPOINTS, named_checkpoint

WEIGHT_AND_CONFIG_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


__all__ = ["HubResolutionError", "is_hub_id", "resolve_checkpoint", "resolve_hub_ids"]


class HubResolutionError(ValueError):
    """A checkpoint name that is neither a local directory nor a resolvable Hub id."""


def resolve_checkpoint(name: str, field: str, revision: str | None = None) -> str:
    """``name`` as a local directory: itself when it exists (a GGUF file: its converted directory), else the
    checkpoint a known name names, else the Hub snapshot of that id at ``revision``."""
    path = Path(name).expanduser()
    if not path.exists():
        path = Path(named_checkpoint(name, field) or name)
    if path.exists():
        return converted_dir(path, field) if is_gguf(path) else str(path)
    if not is_hub_id(name):
        raise HubResolutionError(f"{field}: {name!r} is neither a local directory or file, a known name "
                                 f"({', '.join(NAMED_CHECKPOINTS)}) nor a Hugging Face Hub id ('org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError

    try:
        return snapshot_download(repo_id=name, revision=revision, allow_patterns=WEIGHT_AND_CONFIG_FILES)
    except LocalEntryNotFoundError as exc:
        raise HubResolutionError(f"{field}: Hub id {name!r} (revision {revision or 'main'}) is not in the local "
                                 f"Hugging Face cache and cannot be downloaded (offline or unreachable: "
                                 f"HF_HUB_OFFLINE, HF_HOME); {exc}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as exc:
        raise HubResolutionError(f"{field}: Hub id {name!r} (revision {revision or 'main'}) cannot be resolved: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None


def resolve_hub_ids(config: LLMConfig, labels: dict[str, str] | None = None) -> LLMConfig:
    """``config`` with its model, tokenizer and drafter names as local directories (unchanged when all are local).

    A drafter given by Hub id is validated again once local, so the fields its checkpoint fills (block size,
    Markov head, capture layers) are read from it. Errors name the field, or its ``labels`` entry (a CLI flag)."""
    label = (labels or {}).get
    model = resolve_checkpoint(config.model, label("model", "model"), config.revision)
    tokenizer = resolve_checkpoint(config.tokenizer, label("tokenizer", "tokenizer"), config.tokenizer_revision) \
        if config.tokenizer is not None else None
    spec = config.speculative_config
    if spec is not None and spec.speculative_model is not None:
        drafter = resolve_checkpoint(str(spec.speculative_model), label("speculative_model", "speculative_model"),
                                     spec.revision)
        if drafter != str(spec.speculative_model):
            spec = DSparkDecodingConfig(**{**spec.model_dump(exclude_unset=True), "speculative_model": drafter})
    if (model, tokenizer, spec) == (config.model, config.tokenizer, config.speculative_config):
        return config
    return config.model_copy(update={"model": model, "tokenizer": tokenizer, "speculative_config": spec})
