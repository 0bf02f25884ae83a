"""A private socket tried from another user's process: what `nobody` gets from it (as root only)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

NOBODY = 65534


@contextmanager
def open_to_everyone(path: str) -> Iterator[None]:
    """The socket 0666 and every folder above it searchable by others, for the test's span (as root)."""
    changed = [(p, os.stat(p).st_mode) for p in [path, *Path(path).parents] if str(p) != "/"]
    try:
        for p, mode in changed:
            os.chmod(p, stat.S_IMODE(mode) | (0o666 if str(p) == path else 0o001))
        yield
    finally:
        for p, mode in changed:
            os.chmod(p, stat.S_IMODE(mode))


def as_nobody(use: Callable[[], bytes]) -> bytes:
    """Run `use` (connect to the socket and try it: b"answered", or what it saw) in a forked child
    running as nobody: b"refused" when connecting raised PermissionError, b"hung up" for any other
    OSError."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        outcome = b"?"
        try:
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError:
                outcome = b"could not become nobody"
                raise
            outcome = use()
        except PermissionError:
            outcome = b"refused" if outcome == b"?" else outcome
        except OSError:
            outcome = b"hung up" if outcome == b"?" else outcome
        finally:
            os.write(writer, outcome)
            os._exit(0)
    os.close(writer)
    outcome = os.read(reader, 64)
    os.waitpid(pid, 0)
    return outcome
