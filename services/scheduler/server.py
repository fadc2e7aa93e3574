"""Building and running the scheduler's grpc.aio server: ``SglangScheduler``, grpc.health.v1 and reflection.

grpc.health.v1 reports SERVING, for the server ("") and for ``SglangScheduler``, only while the executor answers:
a monitor task probes it every ``HEALTH_REFRESH_S`` seconds (off the event loop) and once before serving starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from services.grpc_common import add_health_and_reflection
from services.scheduler.servicer import (
    SERVICE_NAME,
    SchedulerServicer,
    ServedEngine,
    ServicerOptions,
    executor_health,
    served_model,
)

log = logging.getLogger(__name__)

HEALTH_REFRESH_S = 2.0

_T = TypeVar("_T")


class ExecutorHealthMonitor:
    """Keeps grpc.health.v1 statuses in step with the executor's health probe."""

    def __init__(
        self, engine: ServedEngine, health_servicer: health.aio.HealthServicer, services: Sequence[str]
    ) -> None:
        self._engine = engine
        self._health = health_servicer
        self._services = ("", *services)

    async def refresh(self) -> bool:
        healthy, _ = await executor_health(self._engine)
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self._services:
            await self._health.set(service, status)
        return healthy

    async def run(self, interval: float = HEALTH_REFRESH_S) -> None:
        """Refresh every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.refresh()


class SchedulerServer:
    """The scheduler's gRPC server around one engine. Start and stop it on one event loop."""

    def __init__(
        self,
        engine: ServedEngine,
        served_model_name: str | None = None,
        executor: str | None = None,
        grammar: str | None = None,
        options: ServicerOptions | None = None,
    ) -> None:
        self.engine = engine
        model = served_model(engine.info, served_model_name)
        self.servicer = SchedulerServicer(engine, model, executor, grammar, options)
        self._health: health.aio.HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task[None] | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        server = grpc.aio.server()
        pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, server)
        health_servicer = add_health_and_reflection(server, [SERVICE_NAME])
        assert isinstance(health_servicer, health.aio.HealthServicer)  # an aio server gets the asyncio servicer
        self._health = health_servicer
        monitor = ExecutorHealthMonitor(self.engine, health_servicer, [SERVICE_NAME])
        await monitor.refresh()  # the first health answer already reflects the executor
        bound = server.add_insecure_port(_address(host, port))
        if bound == 0:
            raise OSError(f"cannot bind {_address(host, port)}")
        await server.start()
        self._server = server
        self._health_task = asyncio.create_task(monitor.run(), name="executor-health")
        log.info("scheduler serving on %s", _address(host, bound))
        return bound

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting RPCs, let those in flight finish for ``grace`` seconds, then cancel them (which aborts
        their engine requests). The engine itself is the caller's to shut down."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._server is not None:
            await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 address
    return f"{host}:{port}"
