"""Write ``runtime/training/demo_corpus.json.xz``: the demo's fixed training corpus.

The demo pair must come out the same on every machine, so its corpus ships with the package instead of
being read from whichever standard library the user's interpreter has. This script made the shipped file
from CPython 3.11.7's ``Lib/`` (the first 3 MiB of sources, sorted by path, as ``source_files`` selects
them), with the Python Software Foundation License that covers them. Rerun it only to change the corpus
(and bump ``runtime.training.demo.VERSION`` and ``CORPUS_SHA256`` with it).

    python scripts/make_demo_corpus.py
"""

from __future__ import annotations

import hashlib
import json
import lzma
import platform
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.training.demo_corpus import CORPUS_BYTES, CORPUS_PATH  # noqa: E402
from runtime.training.target_trainer import source_files  # noqa: E402


def main() -> None:
    base = Path(sysconfig.get_paths()["stdlib"])
    files = source_files(str(base), CORPUS_BYTES)
    record = {"source": f"CPython {platform.python_version()} Lib/, the first {len(files)} sources by path",
              "license": (base / "LICENSE.txt").read_text(encoding="utf-8"),
              "files": [[f.relative_to(base).as_posix(), f.read_text(encoding="utf-8", errors="replace")]
                        for f in files]}
    blob = lzma.compress(json.dumps(record, sort_keys=True).encode(), preset=9 | lzma.PRESET_EXTREME)
    CORPUS_PATH.write_bytes(blob)
    print(f"{CORPUS_PATH}: {len(files)} files, {len(blob)} bytes, sha256 {hashlib.sha256(blob).hexdigest()}")


if __name__ == "__main__":
    main()
