"""What the smg gateway sees of the scheduler when one of the services is lost, and when it is back.

A real smg in front of the scheduler's gRPC server (an in-process engine), with smg's health probe every second and
a threshold of one (its defaults, 60 s and 3, would make this test take minutes; ``ordinal serve`` keeps them, since a
restarted service is back in seconds and a scheduler queue absorbs that). The executor's loss is played by a runner
switched off (the test is about the scheduler's answers, not the executor): the scheduler's HealthCheck turns false,
and smg marks the worker unhealthy, then healthy again when the executor answers. Then the scheduler itself goes
away (its server stopped: connections refused) and comes back on the same port: smg marks the worker unhealthy,
then healthy, and serves a chat completion through it again.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import OpenAI

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.scheduler.engine import Engine
from services.gateway import find_smg, smg_argv
from tests.e2e.stack import free_ports, wait_for
from tests.support.runners import LosableRunner
from tests.support.servers import ThreadedServer

pytestmark = pytest.mark.slow  # a gateway and three health transitions: about ten seconds

MODEL = "tiny-health"
HEALTH_BOUND_S = 30.0  # probes every second, one failure or success to flip: seconds, with room for a loaded CPU
FAST_HEALTH = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
FAST_HEALTH += ["--health-success-threshold", "1", "--health-check-timeout-secs", "2"]


def _worker_health(base: str) -> bool | None:
    """smg's view of its one worker: healthy or not (None: smg does not answer, or lists no worker)."""
    try:
        with urllib.request.urlopen(f"{base}/workers", timeout=5) as resp:
            workers = json.loads(resp.read())["workers"]
    except (OSError, ValueError, KeyError):
        return None
    return bool(workers[0]["is_healthy"]) if workers else None


@contextmanager
def gateway(model_dir: Path, worker: int, log_path: Path) -> Iterator[str]:
    """smg on a free port in front of the worker on ``worker`` (serving already: smg registers it at start); its base
    URL."""
    http, metrics = free_ports(2)
    argv = smg_argv(
        find_smg(),
        host="127.0.0.1",
        port=http,
        worker_url=f"grpc://127.0.0.1:{worker}",
        model_dir=model_dir,
        metrics_port=metrics,
        log_level="WARNING",
    )
    with log_path.open("w") as log:
        proc = subprocess.Popen([*argv, *FAST_HEALTH], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{http}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def test_smg_sees_the_worker_unhealthy_while_a_service_is_lost_and_healthy_again(
    embedded_model_dir: Path, tmp_path: Path
) -> None:
    config = EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=256, max_running=4)
    runner = LosableRunner(ModelRunner.load(config))
    with Engine(config, runner) as engine:
        server = ThreadedServer(engine, served_model_name=MODEL)
        port = server.start()
        with gateway(embedded_model_dir, port, tmp_path / "smg.log") as base:
            try:
                wait_for(lambda: _worker_health(base) is True, HEALTH_BOUND_S, "smg: the worker registered, healthy")

                runner.lost = True  # the executor is gone: the scheduler's HealthCheck says so
                wait_for(lambda: _worker_health(base) is False, HEALTH_BOUND_S, "smg: worker unhealthy, executor lost")
                runner.come_back()
                wait_for(lambda: _worker_health(base) is True, HEALTH_BOUND_S, "smg: worker healthy, executor back")
            finally:
                server.stop()

            # The scheduler itself gone: nothing answers on its port.
            wait_for(lambda: _worker_health(base) is False, HEALTH_BOUND_S, "smg: worker unhealthy, scheduler gone")
            with ThreadedServer(engine, served_model_name=MODEL) as again:
                again.start(port=port)
                wait_for(lambda: _worker_health(base) is True, HEALTH_BOUND_S, "smg: worker healthy, scheduler back")
                client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0.0
                )
                assert reply.choices[0].finish_reason == "length" and reply.usage is not None, reply
