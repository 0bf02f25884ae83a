"""Engines found by DNS: a name (a Kubernetes headless Service) that resolves to several addresses.

`--engine-dns NAME:PORT` is resolved off the event loop (getaddrinfo blocks) at
start and every `--dns-refresh` seconds; each A/AAAA record is one engine at
PORT. The resolver is a plain function, so tests can give a real one of their
own. A lookup that fails or finds nothing keeps the last answer: a DNS blip must
not take every engine away (an engine that is really gone is marked down by its
health watch instead).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger("ignis.gateway")

# (host, port) -> engine addresses ("10.0.0.7:50051", "[fd00::7]:50051"); may raise OSError.
Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True, slots=True)
class DnsName:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> DnsName:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"engine DNS name {text!r} is not NAME:PORT")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    """Every TCP address `host` resolves to (A and AAAA records), in the resolver's order, once each."""
    found: list[str] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip, at = str(sockaddr[0]), int(sockaddr[1])
        address = f"[{ip}]:{at}" if family == socket.AF_INET6 else f"{ip}:{at}"
        if address not in found:
            found.append(address)
    return found


class Discovery:
    """The addresses behind some DNS names, as of the last lookup that answered."""

    def __init__(self, names: Sequence[DnsName], resolver: Resolver = getaddrinfo_resolver) -> None:
        self.names = list(names)
        self.resolver = resolver
        self._last: dict[DnsName, list[str]] = {}

    async def addresses(self) -> list[str]:
        """Look every name up again (on worker threads); a name whose lookup fails keeps its last answer."""
        answers = await asyncio.gather(*(asyncio.to_thread(self.resolver, n.host, n.port) for n in self.names),
                                       return_exceptions=True)
        for name, answer in zip(self.names, answers):
            if isinstance(answer, BaseException):
                if not isinstance(answer, (OSError, UnicodeError)):
                    raise answer
                log.warning("engine DNS name %s did not resolve (%s); keeping %d known address(es)", name,
                            answer, len(self._last.get(name, [])))
            elif not answer:
                log.warning("engine DNS name %s resolved to nothing; keeping %d known address(es)", name,
                            len(self._last.get(name, [])))
            else:
                if answer != self._last.get(name):
                    log.info("engine DNS name %s resolves to %s", name, ", ".join(answer))
                self._last[name] = list(answer)
        return list(dict.fromkeys(a for n in self.names for a in self._last.get(n, [])))
