"""Open connections per client address, for --max-connections-per-client (gateway/http_protocol.py).

One peer must not take the whole connection budget: a client holding --max-connections half-sent
request heads would otherwise lock every other client out until the header timeout. The tally is
by the peer's IP address as the socket reports it (behind a proxy, the proxy's address: there the
limit is 0, off, or as large as the proxy needs).
"""

from __future__ import annotations


class ClientConnections:
    """How many connections each client address holds; an address holding none is not kept."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no limit (nothing is tallied)
        self._open: dict[str, int] = {}

    def take(self, address: str) -> bool:
        """Count one more connection of `address`; False (nothing counted) when it holds `limit` already."""
        held = self._open.get(address, 0)
        if held >= self.limit:
            return False
        self._open[address] = held + 1
        return True

    def give_back(self, address: str) -> None:
        """One connection of `address` closed (each `take` that returned True has exactly one of these)."""
        held = self._open.get(address, 0)
        if held <= 0:
            raise RuntimeError(f"a connection of {address} given back twice: this is a bug")
        if held == 1:
            del self._open[address]
        else:
            self._open[address] = held - 1

    def held(self, address: str) -> int:
        return self._open.get(address, 0)

    def check_integrity(self, open_connections: int) -> None:
        """The tally never counts more connections than are open, nor an address at zero."""
        if any(n <= 0 for n in self._open.values()) or sum(self._open.values()) > open_connections:
            raise RuntimeError(f"client tally {self._open} against {open_connections} open: this is a bug")
