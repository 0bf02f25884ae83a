"""The gRPC scaffolding every ignis service shares: health, reflection, a bound port."""

from __future__ import annotations

from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


def build_server(
    register: Callable[[grpc.aio.Server], None], service_name: str, address: str, what: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build (not start) a server with `register`ed services plus health and reflection on
    `address` (port 0 picks a free one); returns (server, port, health)."""
    server = grpc.aio.server(interceptors=list(interceptors) or None,
                             options=[("grpc.max_receive_message_length", 64 << 20)])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the {what} to {address}")
    return server, port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, service_name: str, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        await health_servicer.set(name, status)
