"""The one hash type state is named by, in the engine and the tierstore alike (docs/architecture.md, "The key").

A link of the chain hash over a prompt's tokens: 16 bytes of xxh3-128. Always `bytes` of that
length; never an int, never hex except in logs and file names.
"""

from __future__ import annotations

from typing import NewType

HASH_BYTES = 16
StateHash = NewType("StateHash", bytes)
