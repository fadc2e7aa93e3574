"""What every ordinal gRPC server registers besides its own services: grpc.health.v1 and server reflection."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

T = TypeVar("T")

# The internal services' channels (scheduler to executor, scheduler and executor to the grammar service). Keepalive
# finds a peer that vanished without closing the connection (an idle session call would never notice); a short
# reconnect backoff and DNS re-resolution reach a restarted peer within a second (under compose, at a new address);
# steps and mask replies can be large.
SERVICE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.dns_min_time_between_resolutions_ms", 1_000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
# Their servers: a session whose peer vanished ends (and releases what it held) once keepalive says so; the clients
# ping every few seconds, so the servers must tolerate that.
SERVICE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


def add_health_and_reflection(
    server: grpc.Server | grpc.aio.Server, service_names: Sequence[str]
) -> health.HealthServicer | health.aio.HealthServicer:
    """Register the health service and reflection (listing ``service_names``, health and reflection itself).

    Returns the health servicer (the asyncio one for a ``grpc.aio`` server): the caller sets each service's
    status, e.g. SERVING once its model is loaded. Until then a check of a named service answers NOT_FOUND.
    """
    servicer = health.aio.HealthServicer() if isinstance(server, grpc.aio.Server) else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return servicer


async def start_serving(
    register: Callable[[grpc.aio.Server], None],
    service_name: str,
    host: str,
    port: int,
    options: Sequence[tuple[str, int]] = (),
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a ``grpc.aio`` server with ``register``'s servicer, health and reflection on ``host:port`` (0 picks a
    free port); ``service_name`` is SERVING once it listens. Returns the server, the bound port and the health
    servicer (for graceful shutdown)."""
    server = grpc.aio.server(options=list(options))
    register(server)
    health_servicer = add_health_and_reflection(server, [service_name])
    assert isinstance(health_servicer, health.aio.HealthServicer)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


class StartedServer:
    """A started ``grpc.aio`` server: its bound port and health service. :meth:`stop` says NOT_SERVING first."""

    def __init__(self, server: grpc.aio.Server, port: int, health: health.aio.HealthServicer) -> None:
        self.server = server
        self.port = port
        self.health = health

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def outbox_messages(outbox: queue.SimpleQueue[T | None]) -> Iterator[T]:
    """The request iterator of a client stream: every message put into ``outbox``, until a None ends the stream."""
    while (message := outbox.get()) is not None:
        yield message
