"""Where dspark keeps what it builds once per machine (converted GGUF checkpoints): ``$DSPARK_CACHE``, default
``~/.cache/dspark``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark").expanduser()
