"""The store's Match socket: Match without gRPC, for an engine on this host.

A Match is on every claim's path, and a gRPC round trip is most of it, the more so once
the caller has been idle a few milliseconds (the threads of both ends' gRPC are woken one
after another): framed on a Unix socket a Match takes 0.04 ms against 0.6-0.9 ms over
gRPC back to back, 0.7-1.1 ms against 1.6-2.4 ms right after a 150 MiB copy (bench.tiers).
So Match is also served here: the same request and reply as the RPC, framed
(common/frames.py; the frames are tierstore.proto's LocalMatchCall and
LocalMatchReply), answered by the same store call with the same checks, leases and
status codes, and traced as the RPC is (a SERVER span continuing the caller's trace).

The socket lies beside the gRPC one, in the same private folder, is 0600, and takes a
connection only from a process of the store's own user (SO_PEERCRED). Each
connection has a thread of its own (at most MAX_CONNECTIONS; an engine keeps one);
a frame that does not parse or is over the bound ends that connection only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import grpc

from common.frames import FrameError, recv_message, same_user, send_frame
from common.status_codes import code_of
from common.tracing import server_call_span, set_rpc_status
from ignis.v1 import tierstore_pb2
from tierstore.errors import TierStoreError, Unavailable
from tierstore.server import INTERNAL_DETAILS, match_args, match_response, refusal_code
from tierstore.store import TierStore

log = logging.getLogger("ignis.tierstore")
MATCH_METHOD = "/ignis.v1.TierStore/Match"
MAX_CONNECTIONS = 32
ACCEPT_RETRY_SECONDS = 0.1
CLOSE_WAIT_SECONDS = 2.0  # close() waits this long for the threads to leave (a Match in flight finishes)


class MatchSocket:
    def __init__(self, store: TierStore, path: Path) -> None:
        self.store = store
        self.path = path
        self._listener: socket.socket | None = None
        self._connections: dict[socket.socket, threading.Thread] = {}  # each with the thread serving it
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Bind and listen (OSError if it cannot); the caller holds the folder's socket lock, so a
        file left at the path is a dead store's."""
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            listener.listen(MAX_CONNECTIONS)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), name="ignis-match-accept",
                                          daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Stop taking connections, hang up on the open ones and wait for their threads, so that no
        Match runs on a store being closed."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
            listener.close()
            self.path.unlink(missing_ok=True)
        with self._lock:
            connections, self._connections = self._connections, {}
        for conn in connections:
            _shut(conn)  # wakes its thread's recv; the thread closes it
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        for thread in [*connections.values(), *([self._acceptor] if self._acceptor is not None else [])]:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._listener is not listener:  # closed
                    return
                # Out of descriptors (EMFILE) or the like: connects wait in the backlog meanwhile.
                log.warning("match socket: accept failed (%s); retrying", exc)
                time.sleep(ACCEPT_RETRY_SECONDS)
                continue
            with self._lock:
                admitted = self._listener is listener and len(self._connections) < MAX_CONNECTIONS \
                    and same_user(conn)
                if admitted:
                    thread = self._connections[conn] = threading.Thread(target=self._serve, args=(conn,),
                                                                         name="ignis-match", daemon=True)
                    thread.start()
            if not admitted:  # another user's, or over MAX_CONNECTIONS
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while (call := recv_message(conn, tierstore_pb2.LocalMatchCall.FromString)) is not None:
                send_frame(conn, self.answer(call).SerializeToString())
        except (OSError, FrameError) as exc:  # the client's mistake or its going: this connection ends
            log.debug("match socket connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            _hang_up(conn)

    def answer(self, call: tierstore_pb2.LocalMatchCall) -> tierstore_pb2.LocalMatchReply:
        """The reply Match would give over gRPC, as a frame."""
        with server_call_span(MATCH_METHOD, call.trace_context) as span:
            reply = self._answer(call.request)
            set_rpc_status(span, code_of(reply.code), server=True)
            return reply

    def _answer(self, request: tierstore_pb2.MatchRequest) -> tierstore_pb2.LocalMatchReply:
        try:
            found = self.store.match_anchored(*match_args(request))
        except TierStoreError as exc:
            tier = exc.tier if isinstance(exc, Unavailable) else ""
            return tierstore_pb2.LocalMatchReply(code=refusal_code(exc).value[0], details=str(exc), tier_fault=tier)
        except Exception:  # a bug: say so with INTERNAL, as the RPC does
            log.exception("Match on the match socket failed")
            return tierstore_pb2.LocalMatchReply(code=grpc.StatusCode.INTERNAL.value[0], details=INTERNAL_DETAILS)
        return tierstore_pb2.LocalMatchReply(code=0, response=match_response(self.store, found))


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:  # the peer went first, or the thread has closed it already
        pass


def _hang_up(conn: socket.socket) -> None:
    _shut(conn)
    conn.close()
