"""Whether a checkpoint name is a Hugging Face Hub id (``org/name`` or ``name``) rather than a local path."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def is_hub_id(name: str) -> bool:
    """True when ``name`` is not an existing local path and has the shape of a Hub repository id."""
    return not Path(name).expanduser().exists() and REPO_ID.match(name) is not None and ".." not in name
