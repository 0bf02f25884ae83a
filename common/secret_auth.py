"""Who may call a service: a peer on its Unix socket, or a TCP caller holding the shared secret.

The engine and the tierstore are trust boundaries (the engine holds every client's
prompts and stored conversations, the tierstore every tenant's KV bytes), guarded alike:

- On one host a service listens on a Unix socket, mode 0600 in a folder only its user
  may enter (0700): the kernel checks who connects (``private_dir``, ``SocketLock``).
- Over TCP (only when configured) every call but a health check must carry
  ``authorization: Bearer <secret>``, the secret read from the service's
  ``secret_file`` setting (created 0600 with a random secret when missing); the
  comparison is constant-time. Anything else is UNAUTHENTICATED. TCP is plaintext
  gRPC: use it on a private network (the compose network), not across one you do
  not trust.

common/bearer.py is the client half (it adds the header).
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import secrets
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from common.bearer import read_secret
from common.private_files import open_to_others


AUTH_KEY = "authorization"
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # container healthchecks probe over TCP without the secret
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its NUL


class AccessError(OSError):
    """A socket, folder or secret file that cannot be made private: the service does not start."""


# ------------------------------------------------------------ files only we can read

def private_dir(path: Path, *, fix: bool, follow_symlinks: bool = True, what: str = "tierstore") -> None:
    """Makes ``path`` (and missing parents) a folder of ours, mode 0700.

    An existing folder of another user is refused (it could swap what we put in it);
    one open to others is chmodded to 0700 when ``fix`` (ours to own: the runtime dir,
    the disk tier), else refused with what to do. ``what``: the service, for messages.
    """
    if not path.exists():
        path.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask
    # A symlink to a folder of ours is that folder (a kv-disk on another drive); but a socket
    # folder in a shared /tmp must be the folder itself: another user may own and repoint a link.
    st = os.stat(path) if follow_symlinks else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise AccessError(f"{path} is a symbolic link: the socket folder must be a folder of its own")
    if not stat.S_ISDIR(st.st_mode):
        raise AccessError(f"{path} is not a folder")
    if st.st_uid != os.getuid():
        raise AccessError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                          f"another user could replace what the {what} keeps there; use a folder of your own")
    if st.st_mode & 0o077:
        if not fix:
            raise AccessError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                              f"`chmod 700 {path}`, or use a folder only you can enter")
        os.chmod(path, 0o700)
        logging.getLogger(f"ignis.{what}").info("made %s private (mode 0700)", path)


def load_secret(path: str | os.PathLike[str], *, create: bool, setting: str = "tierstore.secret_file") -> bytes:
    """The shared secret in ``path`` (surrounding whitespace stripped).

    With ``create`` (the serving side), a missing file is written with a new random
    secret, mode 0600; clients only read it. A secret shorter than 16 bytes is
    refused; one others may read is used with a warning. ``setting``: its name, for messages.
    """
    file = Path(path)
    log = logging.getLogger(f"ignis.{setting.partition('.')[0]}")
    if create and not file.exists():
        if not file.parent.exists():
            private_dir(file.parent, fix=False)
        try:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: read theirs
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32) + "\n")
            log.info("generated a new shared secret in %s", file)
    try:
        secret = read_secret(file)
        st = os.stat(file)
    except OSError as exc:
        raise AccessError(f"cannot read {setting} {file}: {exc.strerror or exc}") from None
    except ValueError as exc:  # too short, or another user's file (who would have chosen the secret)
        raise AccessError(str(exc)) from None
    if open_to_others(st):  # a root-owned file its group may read is a Kubernetes Secret's mount: fine
        log.warning("%s is readable by other users (mode %04o): chmod 600 it", file, stat.S_IMODE(st.st_mode))
    return secret


class SocketLock:
    """Held while a service serves a socket path: a second one on the same path is refused, not
    silently given the path (gRPC unlinks an existing socket file when it binds)."""

    def __init__(self, socket_path: Path, what: str = "tierstore") -> None:
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise AccessError(f"the socket path {socket_path} is {len(os.fsencode(socket_path))} bytes; "
                              f"Unix sockets allow {MAX_SOCKET_PATH}: set a shorter {what}.socket")
        self.path = socket_path
        self._fd = os.open(f"{socket_path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise AccessError(f"another {what} serves {socket_path}; stop it or set another {what}.socket") \
                from None

    def bound(self) -> None:
        """After the bind: the socket is 0600 whatever the umask was."""
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        """Removes the socket (not the lock file: a starting service may hold it open)."""
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


class Listeners(NamedTuple):
    addresses: list[str]  # to bind: ``unix:/path`` first, then ``host:port``
    lock: SocketLock | None  # held while serving the socket
    secret: bytes | None  # what TCP calls must carry; None: no TCP


def listeners(what: str, socket: str, default_socket: str, host: str, port: int | None,
              secret_file: str) -> Listeners:
    """Where service ``what`` (``tierstore``, ``engine``: its settings section too) listens: its
    Unix socket ``socket`` when set (its folder made private if it is the runtime dir, the folder
    of ``default_socket``; a folder someone chose must already be), and ``host:port`` when a
    port is given, which needs ``secret_file`` (created with a random secret if missing).

    OSError (AccessError) when they cannot be private.
    """
    addresses: list[str] = []
    lock = secret = None
    if socket:
        path = Path(socket)
        private_dir(path.parent, fix=str(path.parent) == os.path.dirname(default_socket), follow_symlinks=False,
                    what=what)
        lock = SocketLock(path, what)
        addresses.append(f"unix:{path}")
    if port is not None:
        if not secret_file:
            if lock is not None:
                lock.close()
            raise OSError(f"--port (TCP) needs a shared secret: set {what}.secret_file (--secret-file); "
                          "it is created with a random secret if missing")
        try:
            secret = load_secret(secret_file, create=True, setting=f"{what}.secret_file")
        except OSError:
            if lock is not None:
                lock.close()
            raise
        addresses.append(f"{host}:{port}")
    if not addresses:
        raise OSError(f"nothing to serve on: {what}.socket is empty and no --port is given")
    return Listeners(addresses, lock, secret)


# ------------------------------------------------------------ the check on every call

class SecretAuth(grpc.aio.ServerInterceptor):
    """Lets a call through when it came over the Unix socket or carries the secret; else UNAUTHENTICATED."""

    def __init__(self, secret: bytes | None, what: str = "tierstore") -> None:
        self._expected = b"Bearer " + secret if secret else None  # None: TCP calls are all refused
        self._refusal = f"the {what} takes calls over its Unix socket, or over TCP with `authorization: Bearer <secret>`"

    def _has_secret(self, metadata: Any) -> bool:
        if self._expected is None:
            return False
        for key, value in metadata or ():
            if key == AUTH_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(OPEN_METHODS) or self._has_secret(details.invocation_metadata):
            return handler
        return _unix_only(handler, self._refusal)


def _refused(context: grpc.aio.ServicerContext) -> bool:
    """The peer of a call over the Unix socket is ``unix:``: the socket's mode let it in."""
    return not context.peer().startswith("unix:")


def _unix_only(handler: Any, refusal: str) -> Any:
    """``handler`` with a check of the peer first: the call had no (valid) secret."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if _refused(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            return await handler.unary_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream is not None:
        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if _refused(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            async for reply in handler.unary_stream(request, context):
                yield reply
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    if handler.stream_unary is not None:
        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            if _refused(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            return await handler.stream_unary(requests, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)

    async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if _refused(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        async for reply in handler.stream_stream(requests, context):
            yield reply
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
