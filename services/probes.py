"""Readiness and health probes: grpc.health.v1 for a gRPC service, HTTP for the gateway (``ordinal healthcheck``)."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request


def grpc_health_status(target: str, service: str = "", timeout: float = 5.0) -> str:
    """grpc.health.v1 ``Check`` of ``service`` at ``target``: the status name, or why there is none."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"unreachable ({exc.code().name}: {exc.details()})"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def http_status(url: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    """The HTTP status of ``GET url`` and the body (None and b"" when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, ValueError):
        return None, b""


def listed_models(url: str) -> list[str]:
    status, body = http_status(url, timeout=2.0)
    if status != 200:
        return []
    try:
        data = json.loads(body).get("data", [])
    except (ValueError, AttributeError):
        return []
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def healthcheck(args: argparse.Namespace) -> int:
    target: str = args.target
    if target.startswith(("http://", "https://")):
        status, _ = http_status(target, timeout=args.timeout)
        print(f"{target}: HTTP {status if status is not None else 'no answer'}")
        return 0 if status == 200 else 1
    state = grpc_health_status(target, service=args.service, timeout=args.timeout)
    print(f"{target}: {state}")
    return 0 if state == "SERVING" else 1
