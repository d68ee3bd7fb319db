"""The demo's training corpus, shipped with the package so every machine trains on the same bytes.

``demo_corpus.json.xz`` holds 3 MiB of CPython 3.11.7 standard-library sources (made by
``scripts/make_demo_corpus.py``; Python Software Foundation License, included in the file and written
next to the sources). Its SHA-256 is pinned here: a changed or truncated file is an error, never a
silently different demo.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("demo_corpus.json.xz")
CORPUS_BYTES = 3 << 20  # how much of the standard library the corpus takes (see scripts/make_demo_corpus.py)
CORPUS_SHA256 = "f705dc15b6ed366df0c8618ea7ccc15f35a8719aafd7408c84f7bc946ee66bc6"


def unpack_corpus(dest: Path) -> Path:
    """Write the corpus's sources (and its LICENSE.txt) under ``dest`` once; returns ``dest``.

    The folder appears complete or not at all (written beside it, then renamed)."""
    if (dest / "LICENSE.txt").is_file():
        return dest
    blob = CORPUS_PATH.read_bytes()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"demo corpus: {CORPUS_PATH} has sha256 {digest}, expected {CORPUS_SHA256} "
                         f"(a damaged install: reinstall dspark)")
    record = json.loads(lzma.decompress(blob))
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for relative, text in record["files"]:
        path = partial / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    (partial / "LICENSE.txt").write_bytes(f"{record['source']}\n\n{record['license']}".encode("utf-8"))
    partial.rename(dest)
    return dest
