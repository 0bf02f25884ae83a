"""When a memory-mapped file must not be touched: the one rule both the tierstore (its arena)
and the engine (its mapping of that arena) apply before copying through a mapping."""

from __future__ import annotations

import os


def file_fault(fd: int, size: int) -> str | None:
    """Why the open file `fd`, mapped for `size` bytes, must not be touched, or None. Truncated: a
    copy into the missing pages would be SIGBUS. Deleted: whoever maps it by path gets another file."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        return f"cannot stat it ({exc})"
    if st.st_size < size:
        return f"truncated to {st.st_size} of {size} bytes"
    if st.st_nlink == 0:
        return "deleted"
    return None
