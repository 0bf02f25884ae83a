"""The gRPC scaffolding every ignis service shares: health, reflection, a bound port."""

from __future__ import annotations

from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# gRPC sets SO_REUSEPORT by default, so a second server on a port already in use
# binds "successfully" and steals half the connections. One port, one server.
MAX_MESSAGE_BYTES = 64 << 20  # the largest message our servers take
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]


def build_server(
    register: Callable[[grpc.aio.Server], None], service_name: str, address: str | Sequence[str], what: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build (not start) a server with `register`ed services plus health and reflection on
    `address` (``host:port``, port 0 picks a free one, or ``unix:/path``; several may be
    given); returns (server, port, health), port being the first TCP port bound (0: none).

    An address that cannot be bound (a port in use, a folder that does not exist) is an
    OSError naming it.
    """
    server = grpc.aio.server(interceptors=list(interceptors) or None, options=SERVER_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    tcp_port = 0
    for one in [address] if isinstance(address, str) else address:
        try:
            port = server.add_insecure_port(one)
        except RuntimeError as exc:  # grpcio raises this when the bind fails
            raise OSError(f"cannot bind the {what} to {one}: the address is in use or unavailable ({exc})") from None
        if port == 0 and not one.startswith("unix:"):
            raise OSError(f"cannot bind the {what} to {one}")
        if not one.startswith("unix:") and not tcp_port:
            tcp_port = port
    return server, tcp_port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service_name: str, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        await health_servicer.set(name, status)
