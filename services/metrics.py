"""Prometheus plumbing shared by the ordinal services: bucket bounds and the ``/metrics`` endpoint.

Each service owns one :class:`~prometheus_client.CollectorRegistry` (nothing is registered in the library's
global registry, so two services, or two tests, in one process never collide) and exposes it with
:func:`serve_metrics` on its ``--metrics-port``. The metrics themselves live with their service, so that no service
loads another's engine side: :mod:`services.scheduler.metrics`, :mod:`services.executor.metrics`,
:mod:`services.grammar.metrics`.

Names follow Prometheus conventions: base units (seconds), ``_total`` only on counters. Tokens per second is
``rate(ordinal_generation_tokens_total[1m])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

# Bucket bounds in seconds. Wide on purpose: the same binary serves a tiny CPU model (sub-millisecond steps) and
# large GPU models behind long queues (tens of seconds to the first token).
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A step's wait for its fenced masks past the forward: tenths of a millisecond when the grammar keeps up.
MASK_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint. ``close`` stops it."""

    host: str
    port: int
    _server: WSGIServer

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> MetricsServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread; ``port`` 0 disables it (None)."""
    if port == 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, server.server_port, server)
