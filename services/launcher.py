"""The ``ordinal`` command.

``ordinal serve`` starts the whole stack on this machine, each service as its own process: the grammar service
(compiled grammars and one matcher per constrained request), the executor (model, KV pool, forward; it fetches
grammar masks from the grammar service), the scheduler (SGLang's public ``SglangScheduler`` gRPC API, pointed at
the executor and the grammar service) and, unless ``--no-gateway``, the ``smg`` gateway (an OpenAI-compatible HTTP
API in front of the scheduler). It starts them in that order, each once the one before is ready, prints the
endpoints and a curl example, and stops everything on Ctrl-C or SIGTERM. A service that dies is reported (name,
exit code, last lines of its stderr) and the launcher exits non-zero.

The other subcommands run one piece each: ``grammar``, ``executor``, ``scheduler`` and ``gateway`` (what
docker-compose runs in its containers), ``healthcheck`` (a grpc.health.v1 or HTTP probe) and ``generate`` (the
in-process engine on one prompt, no services: the quickest check that a model loads and generates).

``add_engine_args`` / ``engine_config`` are shared with the services, so that every process takes the same
engine flags spelled the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # engine modules import torch (seconds): only the subcommands that run an engine load them
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from engine.scheduler.engine import Engine

SAMPLE_PROMPT = "Write a JSON object that describes a small cat."
DEFAULT_PORT = 30000
DEFAULT_EXECUTOR_PORT = 30001
DEFAULT_GRAMMAR_PORT = 30002
DEFAULT_GATEWAY_PORT = 8000
DEFAULT_METRICS_PORT = 29000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # logging's names; lower case is accepted too
JSON_SCHEMA_MODES = ("strict", "checked", "loose")  # engine.grammar.JsonSchemaMode's values (no engine import here)
DEFAULT_JSON_SCHEMA_MODE = "checked"
READY_LINE = re.compile(r"^(?P<service>[A-Z]+)_READY port=(?P<port>\d+)\s*$")
TAIL_LINES = 40


# ==================================================================================================== engine flags


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags of every process that builds an engine (serve, generate, executor, scheduler)."""
    _add_model_args(parser)
    _add_engine_tuning_args(parser)
    obs = parser.add_argument_group("observability")
    obs.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port at /metrics (0 = off)"
    )
    obs.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="logging verbosity")


def add_json_schema_args(parser: argparse.ArgumentParser) -> None:
    """``--json-schema`` (and its older spelling ``--loose-json-schema``): how the grammar reads JSON schemas."""
    group = parser.add_argument_group("JSON schemas")
    group.add_argument(
        "--json-schema",
        choices=JSON_SCHEMA_MODES,
        default=None,
        help=f"how JSON schemas are served when a request does not say (default: {DEFAULT_JSON_SCHEMA_MODE}). "
        "strict: only schemas the grammar enforces exactly, others refused naming keyword and place; checked: every "
        "schema xgrammar compiles, the keywords it cannot enforce checked on the output (a violation aborts the "
        "request, naming keyword, place and value); loose: as given, some keywords enforced loosely (SGLang's way)",
    )
    group.add_argument("--loose-json-schema", action="store_true", help="the same as --json-schema loose")


def json_schema_mode(args: argparse.Namespace) -> str:
    """The mode ``--json-schema`` / ``--loose-json-schema`` chose (a value of engine.grammar.JsonSchemaMode)."""
    if args.loose_json_schema:
        if args.json_schema not in (None, "loose"):
            raise SystemExit(f"--loose-json-schema contradicts --json-schema {args.json_schema}")
        return "loose"
    return str(args.json_schema or DEFAULT_JSON_SCHEMA_MODE)


def _engine_defaults() -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig()


def _add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    defaults = _engine_defaults()
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="HF checkpoint folder (config.json, *.safetensors, tokenizer.json, tokenizer_config.json); "
        "default: the embedded tiny model, built locally on first use",
    )
    group.add_argument("--device", default=defaults.device, help="cpu, cuda or cuda:N")
    group.add_argument(
        "--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"], help="weights and KV cache dtype"
    )
    return group


def _add_engine_tuning_args(parser: argparse.ArgumentParser) -> None:
    defaults = _engine_defaults()
    kv = parser.add_argument_group("KV cache (executor and scheduler must agree)")
    kv.add_argument("--page-size", type=int, default=defaults.page_size, help="tokens per KV page")
    kv.add_argument("--num-pages", type=int, default=defaults.num_pages, help="KV pages in the pool")
    kv.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--max-running", type=int, default=defaults.max_running, help="requests admitted at once")
    sched.add_argument("--chunk-size", type=int, default=defaults.chunk_size, help="max prefill tokens per step")
    sched.add_argument("--no-overlap", action="store_true", help="commit step N before launching N+1")
    sched.add_argument(
        "--grammar-overlap",
        choices=["on", "off"],
        default="on" if defaults.grammar_overlap else "off",
        help="on: constrained requests stay overlapped (the executor waits for each step's fenced grammar masks "
        "while the forward runs); off: the scheduler commits before launching a constrained step and the executor "
        "never waits (executor and scheduler must agree)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from engine.config import EngineConfig

    return EngineConfig(
        model_path=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_running=args.max_running,
        chunk_size=args.chunk_size,
        overlap=not args.no_overlap,
        prefix_cache=not args.no_prefix_cache,
        grammar_overlap=args.grammar_overlap == "on",
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` spelled back as a command line (``--model`` and observability excluded)."""
    argv = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--page-size",
        str(args.page_size),
        "--num-pages",
        str(args.num_pages),
        "--max-running",
        str(args.max_running),
        "--chunk-size",
        str(args.chunk_size),
        "--grammar-overlap",
        args.grammar_overlap,
    ]
    if args.no_overlap:
        argv.append("--no-overlap")
    if args.no_prefix_cache:
        argv.append("--no-prefix-cache")
    return argv


# ==================================================================================================== the parser

_SERVE_EPILOG = """\
ports: the scheduler's gRPC API is --port; the executor listens on --executor-port and the grammar service on
--grammar-port (both internal: only the scheduler and the executor talk to them); the gateway's OpenAI API is
--gateway-port. Metrics: scheduler on --metrics-port, executor on --metrics-port + 1, gateway on --metrics-port + 2,
grammar service on --metrics-port + 3 (0 turns ordinal's metrics off). A port of 0 for --port, --executor-port or
--grammar-port lets the service pick a free one (printed once it is ready).

examples:
  ordinal serve                                    # embedded tiny model, gateway on http://127.0.0.1:8000/v1
  ordinal serve --model ~/models/Qwen2.5-0.5B-Instruct --device cuda --dtype bfloat16
  ordinal serve --no-gateway --port 31000          # only the gRPC services
"""

# Subcommands that hand their whole command line to another program.
_PASSTHROUGH = {
    "grammar": "the grammar service alone (same flags as `python -m services.grammar`)",
    "executor": "the executor service alone (same flags as `python -m services.executor`)",
    "scheduler": "the scheduler service alone (same flags as `python -m services.scheduler`)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ordinal",
        description="ordinal: an LLM serving engine split into gRPC services. Start with `ordinal serve`.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve_parser(sub)
    for name, text in _PASSTHROUGH.items():
        sub.add_parser(name, help=text, description=text, add_help=False)
    _add_gateway_parser(sub)
    _add_healthcheck_parser(sub)
    _add_generate_parser(sub)
    return parser


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="start grammar service, executor, scheduler and gateway on this machine and wait until all are ready",
        description="Start the whole stack on this machine: the grammar service, the executor, the scheduler and\n"
        "(unless --no-gateway) the smg gateway, each as its own process. Prints the endpoints once all are ready;\n"
        "Ctrl-C stops them.",
        epilog=_SERVE_EPILOG,
        formatter_class=_HelpFormatter,
    )
    net = serve.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address every service binds (0.0.0.0: all interfaces)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="the scheduler's public gRPC port")
    net.add_argument("--executor-port", type=int, default=DEFAULT_EXECUTOR_PORT, help="the executor's gRPC port")
    net.add_argument("--grammar-port", type=int, default=DEFAULT_GRAMMAR_PORT, help="the grammar service's gRPC port")
    net.add_argument("--gateway-port", type=int, default=DEFAULT_GATEWAY_PORT, help="the OpenAI HTTP API port")
    net.add_argument("--no-gateway", action="store_true", help="do not start the smg gateway (gRPC only)")
    _add_model_args(serve).add_argument(
        "--served-model-name", default=None, help="model id clients use (default: chosen by the scheduler)"
    )
    _add_engine_tuning_args(serve)
    add_json_schema_args(serve)
    obs = serve.add_argument_group("observability and process control")
    obs.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help="base Prometheus port: scheduler +0, executor +1, gateway +2, grammar +3 (0 = ordinal's metrics off)",
    )
    obs.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="log level of every service"
    )
    obs.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds each service may take to become ready"
    )
    obs.add_argument(
        "--stop-timeout", type=float, default=15.0, help="seconds each service gets to exit before it is killed"
    )


def _add_gateway_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gw = sub.add_parser(
        "gateway",
        help="the smg gateway alone, in front of a running scheduler",
        description="Run the smg gateway (OpenAI-compatible HTTP) in front of a scheduler. The tokenizer and chat\n"
        "template come from --model (default: the embedded model, built if missing).",
        formatter_class=_HelpFormatter,
    )
    gw.add_argument("--host", default="127.0.0.1", help="address to bind")
    gw.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="HTTP port")
    gw.add_argument(
        "--worker-url", default=f"grpc://127.0.0.1:{DEFAULT_PORT}", help="the scheduler, as grpc://HOST:PORT"
    )
    gw.add_argument("--model", default=None, metavar="PATH", help="folder with tokenizer.json + tokenizer_config.json")
    gw.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT + 2, help="Prometheus port (>= 1)")
    gw.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="logging verbosity")


_HEALTHCHECK_HELP = "exit 0 if a service is healthy: grpc.health.v1 for HOST:PORT, HTTP 200 for a URL"
_HEALTHCHECK_DESCRIPTION = (
    "Probe a service once. HOST:PORT asks grpc.health.v1 (SERVING → exit 0); an http(s):// URL must answer 200.\n"
    "Any other answer, or none within --timeout, exits 1."
)


def build_healthcheck_parser() -> argparse.ArgumentParser:
    """``ordinal healthcheck`` alone: containers run it every few seconds, so it must not import torch."""
    hc = argparse.ArgumentParser(
        prog="ordinal healthcheck", description=_HEALTHCHECK_DESCRIPTION, formatter_class=_HelpFormatter
    )
    _fill_healthcheck_parser(hc)
    return hc


def _add_healthcheck_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    hc = sub.add_parser(
        "healthcheck", help=_HEALTHCHECK_HELP, description=_HEALTHCHECK_DESCRIPTION, formatter_class=_HelpFormatter
    )
    _fill_healthcheck_parser(hc)


def _fill_healthcheck_parser(hc: argparse.ArgumentParser) -> None:
    hc.add_argument("target", help="HOST:PORT (gRPC) or http://HOST:PORT/PATH")
    hc.add_argument("--service", default="", help="grpc.health.v1 service name ('' = the whole server)")
    hc.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")


def _add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser(
        "generate",
        help="load the model in this process and stream one completion (no services)",
        formatter_class=_HelpFormatter,
    )
    _add_model_args(gen)
    _add_engine_tuning_args(gen)
    gen.add_argument("--prompt", default=SAMPLE_PROMPT, help="the prompt to complete (chat template applied)")
    gen.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs printed as written; a flag's default shown when it says something."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "%(default)" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


# ==================================================================================================== entry point


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in _PASSTHROUGH:
        _exec_module(f"services.{args_list[0]}", args_list[1:])
    if args_list and args_list[0] == "healthcheck":
        return healthcheck(build_healthcheck_parser().parse_args(args_list[1:]))
    args = build_parser().parse_args(args_list)
    if args.command == "serve":
        return serve(args)
    if args.command == "gateway":
        return gateway(args)
    if args.command == "healthcheck":
        return healthcheck(args)
    if args.command == "generate":
        return generate(args)
    return 2


def _exec_module(module: str, argv: Sequence[str]) -> NoReturn:
    """Replace this process with ``python -m module``: in a container it stays PID 1 and receives SIGTERM."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


# ==================================================================================================== serve


@dataclass(frozen=True)
class Endpoints:
    """Where the stack listens once it is ready."""

    host: str
    scheduler_port: int
    executor_port: int
    grammar_port: int
    gateway_url: str | None
    model_id: str | None
    metrics: dict[str, str]
    pids: dict[str, int]

    def ready_line(self) -> str:
        """One machine-readable line (scripts and tests wait for it)."""
        parts = [
            f"scheduler={_hostport(self.host, self.scheduler_port)}",
            f"executor={_hostport(self.host, self.executor_port)}",
            f"grammar={_hostport(self.host, self.grammar_port)}",
        ]
        if self.gateway_url:
            parts.append(f"gateway={self.gateway_url}")
        parts += [f"{name}_pid={pid}" for name, pid in self.pids.items()]
        return "ORDINAL_READY " + " ".join(parts)


def serve(args: argparse.Namespace) -> int:
    """Start grammar, executor, scheduler and gateway; block until a signal or a service dies. The exit code."""
    _check_ports(args)
    smg = None if args.no_gateway else find_smg()  # before anything starts: a missing gateway is a usage error
    model_dir = _model_dir(args.model)
    stop = _install_stop_handlers()
    with Supervisor(stop, args.stop_timeout) as sup:
        try:
            endpoints = _start_stack(sup, args, model_dir, smg)
        except ServiceFailedError as exc:
            _say(str(exc))
            return 1
        except StopRequestedError:
            _say("stopping before every service was ready")
            return 0
        print(_banner(endpoints, model_dir), flush=True)
        print(endpoints.ready_line(), flush=True)
        dead = sup.wait_until_stopped_or_dead()
        if dead:
            for child in dead:
                _say(child.death_report())
            _say("stopping the other services")
            return 1
        _say("stopping (signal received)")
        return 0


def _check_ports(args: argparse.Namespace) -> None:
    for flag in ("port", "executor_port", "grammar_port", "gateway_port", "metrics_port"):
        value = getattr(args, flag)
        if not 0 <= value <= 65535:
            raise SystemExit(f"ordinal serve: --{flag.replace('_', '-')} must be in [0, 65535], got {value}")
    if args.metrics_port > 65532:
        raise SystemExit("ordinal serve: --metrics-port needs four ports: use at most 65532")


def _model_dir(model: str | None) -> Path:
    """The model folder every process gets explicitly: built once here so the children find it cached."""
    if model is not None:
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise SystemExit(f"ordinal: --model {model}: no such folder")
        return path
    from engine.model.embedded import ensure_embedded_model

    _say("preparing the embedded default model (built once, then cached) ...")
    return ensure_embedded_model()


def _metrics_ports(args: argparse.Namespace) -> dict[str, int]:
    base = args.metrics_port
    if base == 0:
        return {"scheduler": 0, "executor": 0, "gateway": 0, "grammar": 0}
    return {"scheduler": base, "executor": base + 1, "gateway": base + 2, "grammar": base + 3}


def _start_stack(sup: Supervisor, args: argparse.Namespace, model_dir: Path, smg: str | None) -> Endpoints:
    """Grammar, executor, scheduler, gateway: each started only once the one before it is ready."""
    local = _connect_host(args.host)
    metrics = _metrics_ports(args)
    model = ["--host", args.host, "--model", str(model_dir), "--log-level", args.log_level]
    common = [*model, *engine_argv(args)]

    grammar_argv = [*model, "--port", str(args.grammar_port), "--json-schema", json_schema_mode(args)]
    grammar_argv += ["--metrics-port", str(metrics["grammar"])]
    grammar_port = _start_grpc_service(sup, "grammar", grammar_argv, local, args.startup_timeout)
    grammar = ["--grammar", _hostport(local, grammar_port)]

    executor_argv = [*common, *grammar, "--port", str(args.executor_port), "--metrics-port", str(metrics["executor"])]
    executor_port = _start_grpc_service(sup, "executor", executor_argv, local, args.startup_timeout)

    scheduler_argv = [*common, *grammar, "--port", str(args.port), "--executor", _hostport(local, executor_port)]
    scheduler_argv += ["--metrics-port", str(metrics["scheduler"])]
    if args.served_model_name:
        scheduler_argv += ["--served-model-name", args.served_model_name]
    scheduler_port = _start_grpc_service(sup, "scheduler", scheduler_argv, local, args.startup_timeout)

    gateway_url = model_id = None
    if smg is not None:
        gateway_port = args.gateway_port or _free_port(local)
        argv = smg_argv(
            smg,
            host=args.host,
            port=gateway_port,
            worker_url=f"grpc://{_hostport(local, scheduler_port)}",
            model_dir=model_dir,
            metrics_port=metrics["gateway"] or _free_port(local),  # smg always serves metrics somewhere
            log_level=args.log_level,
        )
        gateway = sup.launch("gateway", argv)
        gateway_url = f"http://{_hostport(local, gateway_port)}/v1"
        model_id = sup.wait_gateway_models(gateway, gateway_url, args.startup_timeout)
    return Endpoints(
        host=local,
        scheduler_port=scheduler_port,
        executor_port=executor_port,
        grammar_port=grammar_port,
        gateway_url=gateway_url,
        model_id=model_id,
        metrics={name: f"http://{_hostport(local, port)}/metrics" for name, port in metrics.items() if port},
        pids=sup.pids(),
    )


def _start_grpc_service(sup: Supervisor, name: str, argv: list[str], local: str, timeout: float) -> int:
    """Start ``python -m services.<name>``; ready = its READY line, then SERVING from grpc.health.v1. Its port."""
    child = sup.launch(name, [*_python_module(f"services.{name}"), *argv])
    port = sup.wait_ready_line(child, name.upper(), timeout)
    sup.wait_grpc_serving(child, _hostport(local, port), timeout)
    return port


def _python_module(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_host(host: str) -> str:
    """Where a local client reaches a server bound to ``host`` (a wildcard bind is reached on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _banner(ep: Endpoints, model_dir: Path) -> str:
    lines = ["", f"ordinal is serving {ep.model_id or model_dir.name}  (model folder: {model_dir})", ""]
    scheduler, executor = _hostport(ep.host, ep.scheduler_port), _hostport(ep.host, ep.executor_port)
    grammar = _hostport(ep.host, ep.grammar_port)
    lines.append(f"  scheduler  gRPC SglangScheduler  {scheduler}   (pid {ep.pids['scheduler']})")
    lines.append(f"  executor   gRPC (internal)       {executor}   (pid {ep.pids['executor']})")
    lines.append(f"  grammar    gRPC (internal)       {grammar}   (pid {ep.pids['grammar']})")
    if ep.gateway_url:
        lines.append(f"  gateway    OpenAI HTTP API       {ep.gateway_url}   (pid {ep.pids['gateway']})")
    for name, url in ep.metrics.items():
        lines.append(f"  metrics    {name:<21}{url}")
    lines.append("")
    if ep.gateway_url:
        body = {"model": ep.model_id, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
        lines.append("Try it:")
        lines.append(f"  curl {ep.gateway_url}/chat/completions -H 'Content-Type: application/json' \\")
        lines.append(f"    -d '{json.dumps(body)}'")
    else:
        lines.append(f"Gateway off: clients speak SGLang's SglangScheduler gRPC API at {scheduler}.")
    lines += ["", "Ctrl-C (or SIGTERM) stops every service.", ""]
    return "\n".join(lines)


def _say(message: str) -> None:
    print(f"ordinal: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- signals


@dataclass
class StopSignal:
    """Set by SIGINT/SIGTERM. A second signal while stopping asks for ``force`` (kill without waiting)."""

    requested: threading.Event = field(default_factory=threading.Event)
    force: threading.Event = field(default_factory=threading.Event)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            self.force.set()
        self.requested.set()


def _install_stop_handlers() -> StopSignal:
    stop = StopSignal()
    signal.signal(signal.SIGINT, stop.handle)
    signal.signal(signal.SIGTERM, stop.handle)
    return stop


class StopRequestedError(Exception):
    """A stop signal arrived while services were starting."""


class ServiceFailedError(Exception):
    """A service died or did not become ready; the message says which and why."""


# ---------------------------------------------------------------------------------------------------- children


@dataclass
class Child:
    """One service process: its command line, its output tails and, once it said so, its READY port."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[str]
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    stdout_tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready_port: int | None = None
    ready_service: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal), else None."""
        return self.proc.poll()

    def death_report(self) -> str:
        code = self.exited()
        how = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how += f" (killed by {signal.Signals(-code).name})"
        tail = list(self.stderr_tail) or list(self.stdout_tail)
        lines = [f"{self.name} (pid {self.pid}) exited with {how}"]
        if tail:
            lines.append(f"last lines of {self.name}'s output:")
            lines += [f"  | {line}" for line in tail]
        return "\n".join(lines)


class Supervisor:
    """Starts services in order, waits for each to be ready, watches them, and stops them in reverse order.

    Every child runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which then stops the
    children in order) and, on Linux, is sent SIGTERM if the launcher itself dies without cleaning up.
    """

    POLL_S = 0.1

    def __init__(self, stop: StopSignal, stop_timeout: float) -> None:
        self._stop = stop
        self._stop_timeout = stop_timeout
        self._children: list[Child] = []
        self._out_lock = threading.Lock()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def launch(self, name: str, argv: Sequence[str]) -> Child:
        """Start a child in its own session, with readers forwarding its output; stopped in reverse order."""
        if self._stop.requested.is_set():
            raise StopRequestedError
        _say(f"starting {name}: {' '.join(argv)}")
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        child = Child(name, list(argv), proc)
        self._children.append(child)
        assert proc.stdout is not None and proc.stderr is not None
        for stream, tail, watch in ((proc.stdout, child.stdout_tail, True), (proc.stderr, child.stderr_tail, False)):
            reader = threading.Thread(
                target=self._pump, args=(child, stream, tail, watch), name=f"ordinal-{name}-out", daemon=True
            )
            reader.start()
            child.readers.append(reader)
        return child

    def _pump(self, child: Child, stream: IO[str], tail: deque[str], watch_ready: bool) -> None:
        """Forward a child's output to our stderr, prefixed with its name; keep the last lines; spot READY."""
        for raw in stream:
            line = raw.rstrip("\n")
            tail.append(line)
            if watch_ready and not child.ready.is_set():
                match = READY_LINE.match(line)
                if match:
                    child.ready_service, child.ready_port = match["service"], int(match["port"])
                    child.ready.set()
            with self._out_lock:
                sys.stderr.write(f"{child.name:>9} | {line}\n")
                sys.stderr.flush()

    # ------------------------------------------------------------ readiness (every wait bounded)

    def _waiting(self, child: Child, timeout: float, what: str) -> Iterator[None]:
        """Yield every POLL_S until the caller is satisfied; raise if the child dies, a stop arrives or time is up."""
        deadline = time.monotonic() + timeout
        while True:
            if self._stop.requested.is_set():
                raise StopRequestedError
            if child.exited() is not None:
                self._drain(child)
                raise ServiceFailedError(f"{child.name} failed while starting: {child.death_report()}")
            if time.monotonic() > deadline:
                raise ServiceFailedError(f"{child.name} was not ready after {timeout:.0f} s: no {what}")
            yield
            self._stop.requested.wait(self.POLL_S)

    def wait_ready_line(self, child: Child, service: str, timeout: float) -> int:
        for _ in self._waiting(child, timeout, f"{service}_READY line on its stdout"):
            if child.ready.is_set():
                if child.ready_service != service or child.ready_port is None:
                    raise ServiceFailedError(f"{child.name} announced {child.ready_service}_READY, not {service}")
                return child.ready_port
        raise AssertionError("unreachable")

    def wait_grpc_serving(self, child: Child, target: str, timeout: float) -> None:
        for _ in self._waiting(child, timeout, f"SERVING from grpc.health.v1 at {target}"):
            if grpc_health_status(target, timeout=2.0) == "SERVING":
                return

    def wait_gateway_models(self, child: Child, base_url: str, timeout: float) -> str:
        """Poll ``GET /v1/models`` until the gateway lists a model (its workers are registered); return its id."""
        for _ in self._waiting(child, timeout, f"model listed at {base_url}/models"):
            model_ids = _listed_models(f"{base_url}/models")
            if model_ids:
                return model_ids[0]
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ running and stopping

    def pids(self) -> dict[str, int]:
        return {c.name: c.pid for c in self._children}

    def wait_until_stopped_or_dead(self) -> list[Child]:
        """Block until a stop signal (returns []) or until a child exits (returns every child that has)."""
        while not self._stop.requested.wait(self.POLL_S * 2):
            dead = [c for c in self._children if c.exited() is not None]
            if dead:
                for child in dead:
                    self._drain(child)
                return dead
        return []

    def stop_all(self) -> None:
        """SIGTERM each live child's process group in reverse start order; SIGKILL after the stop timeout."""
        for child in reversed(self._children):
            if child.exited() is None:
                self._stop_one(child)
            self._drain(child)

    def _stop_one(self, child: Child) -> None:
        started = time.monotonic()
        _signal_group(child.proc, signal.SIGTERM)
        deadline = started + self._stop_timeout
        while child.proc.poll() is None and time.monotonic() < deadline and not self._stop.force.is_set():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=self.POLL_S)
        if child.proc.poll() is None:
            _say(f"{child.name} is still running {time.monotonic() - started:.1f} s after SIGTERM: killing it")
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait(timeout=self._stop_timeout)
        _say(f"{child.name} stopped (exit code {child.proc.returncode}, {time.monotonic() - started:.1f} s)")

    @staticmethod
    def _drain(child: Child) -> None:
        """Let the readers forward what the child wrote before it exited (bounded: the pipes are closing)."""
        for reader in child.readers:
            reader.join(timeout=2.0)


def _signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    if proc.poll() is None:  # never signal a reaped pid: its group id may belong to someone else by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _parent_death_signal() -> Callable[[], None] | None:
    """On Linux, a pre-exec hook that has the kernel send SIGTERM to the child if the launcher dies (even by
    SIGKILL), so that no service outlives it. The libc function is resolved here, before the fork: the hook
    itself only makes one system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return hook


# ==================================================================================================== probes


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


def _listed_models(url: str) -> list[str]:
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


# ==================================================================================================== gateway


def find_smg() -> str:
    """The ``smg`` executable: next to this Python first (the same venv), then on PATH."""
    beside = Path(sys.executable).parent / "smg"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise SystemExit("ordinal: the smg gateway is not installed (pip install smg==1.13.0), or use --no-gateway")
    return found


def smg_argv(
    smg: str,
    *,
    host: str,
    port: int,
    worker_url: str,
    model_dir: Path,
    metrics_port: int,
    log_level: str,
) -> list[str]:
    """The smg command line that serves the OpenAI API in front of one SglangScheduler worker."""
    return [
        smg,
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        worker_url,
        "--model-path",
        str(model_dir),  # tokenizer.json + tokenizer_config.json (chat template) are read from here
        "--backend",
        "sglang",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        {"WARNING": "warn"}.get(log_level, log_level.lower()),
        # In-flight HTTP requests get this long to finish on SIGTERM (smg's default is 180 s).
        "--shutdown-grace-period-secs",
        "5",
    ]


def gateway(args: argparse.Namespace) -> int:
    """Replace this process with smg, configured for one scheduler."""
    if args.metrics_port < 1:
        raise SystemExit("ordinal gateway: --metrics-port must be >= 1 (smg always serves metrics)")
    argv = smg_argv(
        find_smg(),
        host=args.host,
        port=args.port,
        worker_url=args.worker_url,
        model_dir=_model_dir(args.model),
        metrics_port=args.metrics_port,
        log_level=args.log_level,
    )
    sys.stdout.flush()
    os.execv(argv[0], argv)


# ==================================================================================================== generate


async def _stream_sample(engine: Engine, prompt: str, params: SamplingParams) -> None:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if tok.chat_template else prompt
    ids = tok.encode(text)
    started = time.perf_counter()
    print(f"prompt ({len(ids)} tokens): {prompt}")
    print("completion: ", end="", flush=True)
    async for out in engine.generate(ids, params):
        print(out.text_delta, end="", flush=True)
        if out.finish is not None:
            n = out.num_output_tokens
            elapsed = time.perf_counter() - started
            print(f"\n[{n} tokens, finish: {out.finish.reason.value}, {n / elapsed:.1f} tokens/s]")


def generate(args: argparse.Namespace) -> int:
    """Load the model in this process and stream a completion of ``--prompt``."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler.engine import Engine

    config = engine_config(args)
    print(f"loading {config.model_path or 'the embedded default model'} on {config.device} ...", flush=True)
    with Engine(config) as engine:
        print(f"model: {engine.info.model_path} (vocab {engine.info.vocab_size})")
        params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        asyncio.run(_stream_sample(engine, args.prompt, params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
