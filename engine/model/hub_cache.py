"""`--model org/name`: a checkpoint already in the local Hugging Face cache, never downloaded.

The engine loads from a directory; a repo id is looked up with huggingface_hub's own cache
layout (`HF_HOME` / `HF_HUB_CACHE`), `local_files_only`, so a machine without the network
serves what it has and says plainly what it lacks.
"""

from __future__ import annotations

import re
from pathlib import Path

# A Hub repo id: "name" or "org/name" of letters, digits and -_. (no path separators beyond one).
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.startswith((".", "~")) and ".." not in model


def cached_checkpoint(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` in the local cache; ValueError saying how to get it if absent."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise ValueError(
            f"{repo_id!r} is neither a checkpoint directory nor in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); ignis does not download weights: fetch it first "
            f"(`huggingface-cli download {repo_id}`) or pass its directory") from exc
