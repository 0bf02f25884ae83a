"""Who may call the tierstore: a peer on its Unix socket, or a TCP caller holding the shared secret.

The tierstore hands out every tenant's KV bytes, so it is a trust boundary: a Unix socket
(0600 in a 0700 folder) by default, TCP only with ``tierstore.secret_file``, every TCP call
but a health check carrying ``authorization: Bearer <secret>``. The engine guards its own
port the same way: the implementation is common/secret_auth.py, shared by both.
"""

from __future__ import annotations

from common.secret_auth import (AUTH_KEY, MAX_SOCKET_PATH, OPEN_METHODS, AccessError, SecretAuth, SocketLock,
                                load_secret, private_dir)

__all__ = ["AUTH_KEY", "MAX_SOCKET_PATH", "OPEN_METHODS", "AccessError", "SecretAuth", "SocketLock", "load_secret",
           "private_dir"]
