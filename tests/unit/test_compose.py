"""docker-compose.yml and the Dockerfile, checked without Docker.

Each service's command must parse with the parser that will actually read it (the launcher's for ``ordinal``
subcommands; the service module's own for ``ordinal grammar`` / ``ordinal executor`` / ``ordinal scheduler``, which
exec it), the ports must agree across services, healthchecks and publications, and startup must be ordered by
health: grammar, executor, scheduler, gateway. Every service is restarted when it dies, as ``ordinal serve`` restarts
its children.
"""

from __future__ import annotations

import argparse
import importlib
import re
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from engine.model.embedded import DRAFT_SPEC, EmbeddedSpec
from services.flags import engine_config
from services.launcher import build_parser
from services.supervisor import RestartPolicy

REPO = Path(__file__).resolve().parents[2]
ORDER = ("grammar", "executor", "scheduler", "gateway")
PASSTHROUGH = ("grammar", "executor", "scheduler")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    svcs = compose["services"]
    assert set(svcs) == set(ORDER)
    return svcs


def parsed(service: dict[str, Any]) -> argparse.Namespace:
    """Parse a service's command with the parser that reads it at run time."""
    command = service["command"]
    assert isinstance(command, list) and command[0] == "ordinal", "commands use the launcher (exec form)"
    sub = command[1]
    if sub in PASSTHROUGH:
        # `ordinal executor ARGS` execs `python -m services.executor ARGS`: that module's parser reads ARGS.
        module = importlib.import_module(f"services.{sub}.__main__")
        parser: argparse.ArgumentParser = module.build_parser()
        return parser.parse_args(command[2:])
    return build_parser().parse_args(command[1:])


def port_of(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)


def published(service: dict[str, Any]) -> dict[int, int]:
    """Container port -> host port."""
    out = {}
    for spec in service.get("ports", []):
        *_, host, container = str(spec).split(":")  # [IP:]HOST:CONTAINER
        out[int(container)] = int(host)
    return out


def test_every_command_parses(services: dict[str, dict[str, Any]]) -> None:
    for name in ORDER:
        assert services[name]["command"][1] == name
        parsed(services[name])  # argparse exits (SystemExit) on an unknown flag or a bad value


def test_ports_agree(services: dict[str, dict[str, Any]]) -> None:
    grammar, executor, scheduler, gateway = (parsed(services[n]) for n in ORDER)
    assert port_of(scheduler.executor) == ("executor", executor.port)
    # Both talk to the one grammar service: the scheduler commits to the matchers the executor reads masks from.
    assert port_of(executor.grammar) == port_of(scheduler.grammar) == ("grammar", grammar.port)
    url = urlsplit(gateway.worker_url)
    assert (url.scheme, url.hostname, url.port) == ("grpc", "scheduler", scheduler.port)
    assert published(services["scheduler"]) == {scheduler.port: 30000}
    assert published(services["gateway"]) == {gateway.port: 8000}
    assert "ports" not in services["executor"], "the executor is internal"
    assert "ports" not in services["grammar"], "the grammar service is internal"
    metrics = [executor.metrics_port, scheduler.metrics_port, gateway.metrics_port, grammar.metrics_port]
    assert all(metrics) and len(set(metrics)) == 4
    assert len({grammar.port, executor.port, scheduler.port, gateway.port}) == 4
    for args in (grammar, executor, scheduler, gateway):
        assert args.host == "0.0.0.0", "inside a container a service must listen beyond loopback"


def test_executor_and_scheduler_agree_on_the_engine(services: dict[str, dict[str, Any]]) -> None:
    executor, scheduler, grammar = (parsed(services[n]) for n in ("executor", "scheduler", "grammar"))
    a, b = engine_config(executor), engine_config(scheduler)
    # grammar_overlap: the scheduler commits early exactly when the executor does not wait at the mask fence.
    assert (a.page_size, a.num_pages, a.model_path, a.grammar_overlap) == (
        b.page_size,
        b.num_pages,
        b.model_path,
        b.grammar_overlap,
    )
    assert grammar.model == a.model_path, "the grammar service masks the executor's vocabulary"


def test_startup_is_ordered_by_health(services: dict[str, dict[str, Any]]) -> None:
    assert "depends_on" not in services["grammar"]
    assert services["executor"]["depends_on"] == {"grammar": {"condition": "service_healthy"}}
    assert services["scheduler"]["depends_on"] == {"executor": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {"scheduler": {"condition": "service_healthy"}}


def test_every_service_is_restarted_when_it_dies_as_the_launcher_restarts_it(
    services: dict[str, dict[str, Any]],
) -> None:
    """Docker's ``on-failure:N``: a container that exits non-zero (killed, crashed) is restarted with a doubling delay,
    at most N failed times in a row, the launcher's cap (``ordinal serve --max-restarts``); a clean stop (exit 0) is
    not undone. Fails if a service has no restart policy, or one that would restart a stopped service or never stop
    retrying."""
    serve = build_parser().parse_args(["serve"])
    assert serve.max_restarts == RestartPolicy().max_restarts > 0
    for name in ORDER:
        policy = services[name].get("restart")
        assert policy == f"on-failure:{serve.max_restarts}", (name, policy)
        assert "restart_policy" not in services[name].get("deploy", {}), "one policy per service, not two"


def test_healthchecks_probe_each_service_on_its_port(services: dict[str, dict[str, Any]]) -> None:
    for name in ORDER:
        check = services[name]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "ordinal", "healthcheck"], name
        build_parser().parse_args(check[2:])
        args = parsed(services[name])
        target = check[3]
        if name == "gateway":
            url = urlsplit(target)
            assert (url.scheme, url.hostname, url.port) == ("http", "127.0.0.1", args.port)
        else:
            assert port_of(target) == ("127.0.0.1", args.port)


def test_all_services_share_the_model_cache(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    mounts = {name: svc["volumes"] for name, svc in services.items()}
    assert len({tuple(m) for m in mounts.values()}) == 1
    volume, _, path = mounts["executor"][0].partition(":")
    assert volume in compose["volumes"]
    for svc in services.values():
        assert svc["environment"]["ORDINAL_CACHE_DIR"] == path
        assert svc["image"] == services["executor"]["image"], "one image for every service"


def test_gpu_reservation_is_documented_on_the_executor() -> None:
    text = (REPO / "docker-compose.yml").read_text()
    executor_block = text.split("\n  executor:\n", 1)[1].split("\n  scheduler:\n", 1)[0]
    commented = [
        line.strip().lstrip("#").strip() for line in executor_block.splitlines() if line.strip().startswith("#")
    ]
    for needed in ("deploy:", "resources:", "reservations:", "devices:", "- driver: nvidia"):
        assert needed in commented, needed


# ---------------------------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in logical.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def test_dockerfile_installs_torch_before_the_project() -> None:
    steps = dockerfile_instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = [args for inst, args in steps if inst == "RUN"]
    torch = next(i for i, r in enumerate(runs) if "pip install" in r and "torch==2.13.0" in r)
    project = next(i for i, r in enumerate(runs) if re.search(r"pip install .*(?<![\w/.-])\.(?![\w/.-])", r))
    assert torch < project
    assert "constraints.txt" in runs[project] and "smg==" in runs[project]
    copies = [i for i, (inst, _) in enumerate(steps) if inst == "COPY"]
    torch_step = steps.index(("RUN", runs[torch]))
    assert all(i > torch_step for i in copies), "torch is installed before any source is copied (layer cache)"


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    ignored = {
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"
    }
    assert {".venv", ".git"} <= ignored
    sources = [src for inst, args in dockerfile_instructions() if inst == "COPY" for src in args.split()[:-1]]
    assert sources
    for src in sources:
        assert src not in ignored and (REPO / src).exists(), src


def test_the_embedded_weights_reach_the_image() -> None:
    """The image serves the embedded model with no download: ``COPY engine`` carries the shipped weights (no
    .dockerignore pattern matches them) and ``pip install .`` installs them (setuptools' package-data names them;
    a non-editable install has no source tree to read them from)."""
    tomllib = pytest.importorskip("tomllib")
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and line[0] != "#"
    ]
    copied = {src for inst, args in dockerfile_instructions() if inst == "COPY" for src in args.split()[:-1]}
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for spec in (EmbeddedSpec(), DRAFT_SPEC):
        path = spec.weights_path.relative_to(REPO)
        assert spec.weights_path.is_file() and path.parts[0] in copied, path
        prefixes = [Path(*path.parts[: i + 1]).as_posix() for i in range(len(path.parts))]
        assert not [p for p in patterns for prefix in prefixes if fnmatch(prefix, p.removeprefix("**/"))], path
        inside = path.relative_to(path.parts[0]).as_posix()
        assert any(fnmatch(inside, pattern) for pattern in package_data[path.parts[0]]), (inside, package_data)
