"""GGUF files as target checkpoints: converted once into a cached Hugging Face directory the loader reads.

A ``.gguf`` file (or a directory holding exactly one ``.gguf`` and no ``config.json``) becomes a folder under
``$DSPARK_CACHE/gguf/`` (default ``~/.cache/dspark/gguf``) with ``config.json``, the tokenizer and chat template
that the file carries, and ``model.safetensors``: every tensor dequantized by transformers' GGUF reader (which also
undoes llama.cpp's rotary permutation of the query and key projections) and stored in float32, in which every GGUF
quantization's values are exact; the engine casts to its own dtype when it loads, as for any checkpoint. The second
start reads the folder and skips the conversion. A folder is reused only while the file's size and modification
time are the ones it was made from, and is written under a temporary name and renamed into place, so two processes
converting at once leave one whole folder.

Architectures and quantization types are checked from the file's metadata before anything is dequantized: one the
engine cannot serve is an error naming it and the allowed values.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from runtime.scheduling.cache import cache_root

FORMAT_VERSION = 1
# GGUF ``general.architecture`` -> the transformers model_type the engine serves it as
SERVABLE_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
TIED_HEAD = "lm_head.weight"


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and what is wrong."""


def is_gguf(path: Path) -> bool:
    """A ``.gguf`` file, or a directory without ``config.json`` that holds ``.gguf`` files."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def gguf_file(path: Path, field: str) -> Path:
    """The one GGUF file ``path`` names (itself, or the only one in its directory)."""
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        raise GGUFError(f"{field}: {path} holds {len(found)} .gguf files ({[f.name for f in found]}); name one file")
    return found[0]


def converted_dir(path: str | Path, field: str = "model") -> str:
    """The cached Hugging Face directory of the GGUF checkpoint at ``path``, converting it first when needed."""
    source = gguf_file(Path(path).expanduser().resolve(), field)
    stat = source.stat()
    stamp = {"source": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": FORMAT_VERSION}
    root = cache_root() / "gguf"
    out = root / f"{source.stem}-{hashlib.sha256(str(source).encode()).hexdigest()[:12]}"
    if _stamp(out) == stamp:
        return str(out)
    check_servable(source, field)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=root))
    work.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as any other
    try:
        convert(source, work)
        (work / "gguf-source.json").write_text(json.dumps(stamp, indent=2))
        if out.exists() and _stamp(out) != stamp:
            shutil.rmtree(out, ignore_errors=True)  # made from an older file or version
        try:
            os.rename(work, out)
        except OSError:
            if _stamp(out) != stamp:  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(out)


def _stamp(out: Path) -> dict | None:
    try:
        return json.loads((out / "gguf-source.json").read_text())
    except (OSError, ValueError):
        return None


def check_servable(source: Path, field: str) -> None:
    """Raise ``GGUFError`` unless the file's architecture is served here and every tensor type dequantizes."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise GGUFError(f"{field}: {source} is a GGUF file, which needs the 'gguf' package: pip install "
                        "'gguf>=0.10' (or dspark's extra: pip install 'dspark[gguf]')") from None
    try:
        reader = GGUFReader(str(source))
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{field}: {source} is not a readable GGUF file: {exc}") from None
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if arch not in SERVABLE_ARCHITECTURES:
        raise GGUFError(f"{field}: {source.name} has architecture {arch!r}; GGUF architectures served: "
                        f"{', '.join(SERVABLE_ARCHITECTURES)}")
    first_of_type = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    for qtype, tensor in first_of_type.items():
        try:
            dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise GGUFError(f"{field}: {source.name} stores {tensor.name} as {qtype.name}, a quantization type "
                            "the gguf package cannot dequantize; convert the file to another type (F32, F16, BF16, "
                            "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, or a K-quant)") from None


def convert(source: Path, out: Path) -> None:
    """Write ``source`` as a Hugging Face directory into ``out``: config, tokenizer, float32 safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(source.parent), source.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):  # only its parameter names: they map the file's tensor names to transformers'
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop(TIED_HEAD, None)  # the embedding is the head; the loader ties them
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
