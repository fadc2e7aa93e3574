"""The ``ordinal`` command.

``ordinal serve`` starts the whole stack on this machine, each service as its own process: the grammar service
(compiled grammars and one matcher per constrained request), the executor (model, KV pool, forward; it fetches
grammar masks from the grammar service), the scheduler (SGLang's public ``SglangScheduler`` gRPC API, pointed at
the executor and the grammar service) and, unless ``--no-gateway``, the ``smg`` gateway (an OpenAI-compatible HTTP
API in front of the scheduler). It starts them in that order, each once the one before is ready, prints the
endpoints and a curl example, and stops everything on Ctrl-C or SIGTERM. A service that dies is reported (name,
exit code, last lines of its stderr) and restarted on the same port after a backoff, while the others keep serving;
one that keeps dying (more than ``--max-restarts`` exits within a minute) stops everything and the launcher exits
non-zero.

The other subcommands run one piece each: ``grammar``, ``executor``, ``scheduler`` and ``gateway`` (what
docker-compose runs in its containers), ``healthcheck`` (a grpc.health.v1 or HTTP probe) and ``generate`` (the
in-process engine on one prompt, no services: the quickest check that a model loads and generates).

``add_engine_args`` / ``engine_config`` are shared with the services, so that every process takes the same
engine flags spelled the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from services.flags import (
    DEFAULT_EXECUTOR_PORT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_GRAMMAR_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    LOG_LEVELS,
    add_engine_tuning_args,
    add_json_schema_args,
    add_model_args,
    cpus_text,
    engine_argv,
    engine_config,
    json_schema_argv,
    model_folder,
)
from services.gateway import find_smg, gateway, smg_argv
from services.probes import healthcheck, listed_models
from services.supervisor import (
    Child,
    RestartPolicy,
    ServiceFailedError,
    StopRequestedError,
    Supervisor,
    install_stop_handlers,
    say,
)

if TYPE_CHECKING:  # engine modules import torch (seconds): only the subcommands that run an engine load them
    from engine.sampling_params import SamplingParams
    from engine.scheduler.engine import Engine

SAMPLE_PROMPT = "Write a JSON object that describes a small cat."


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

a service that exits is restarted on its port; see docs/architecture.md ("When a service is lost") for what its
loss does to requests.
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
    add_model_args(serve).add_argument(
        "--served-model-name", default=None, help="model id clients use (default: chosen by the scheduler)"
    )
    add_engine_tuning_args(serve)
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
    obs.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy().max_restarts,
        help="a service that exits is restarted (after 0.5 s, doubling up to 10 s); more than this many exits of one "
        "service within a minute stops everything (0: never restart, stop at the first exit)",
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
    add_model_args(gen)
    add_engine_tuning_args(gen)
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
    try:  # a bad engine flag is a usage error here, before any service starts (each checks it again)
        engine_config(args)
    except ValueError as error:
        raise SystemExit(f"ordinal serve: {error}") from error
    _pin_apart(args.executor_cpus)
    smg = None if args.no_gateway else find_smg()  # before anything starts: a missing gateway is a usage error
    model_dir = model_folder(args.model)
    stop = install_stop_handlers()
    with Supervisor(stop, args.stop_timeout) as sup:
        try:
            endpoints = _start_stack(sup, args, model_dir, smg)
        except ServiceFailedError as exc:
            say(str(exc))
            return 1
        except StopRequestedError:
            say("stopping before every service was ready")
            return 0
        print(_banner(endpoints, model_dir), flush=True)
        print(endpoints.ready_line(), flush=True)
        policy = RestartPolicy(max_restarts=args.max_restarts)
        if sup.supervise(policy, args.startup_timeout, on_ready=_announce_restart) != 0:
            return 1
        say("stopping (signal received)")
        return 0


def _announce_restart(child: Child) -> None:
    """One machine-readable line per restarted service that serves again (scripts and tests read it)."""
    print(f"ORDINAL_RESTARTED service={child.name} pid={child.pid}", flush=True)


def _check_ports(args: argparse.Namespace) -> None:
    for flag in ("port", "executor_port", "grammar_port", "gateway_port", "metrics_port"):
        value = getattr(args, flag)
        if not 0 <= value <= 65535:
            raise SystemExit(f"ordinal serve: --{flag.replace('_', '-')} must be in [0, 65535], got {value}")
    if args.metrics_port > 65532:
        raise SystemExit("ordinal serve: --metrics-port needs four ports: use at most 65532")
    if args.max_restarts < 0:
        raise SystemExit(f"ordinal serve: --max-restarts must be >= 0, got {args.max_restarts}")


def _pin_apart(executor: frozenset[int] | None) -> None:
    """``--executor-cpus``: this launcher, and so every service it starts but the executor (which pins itself to
    ``executor``), on the rest of its cores. Refused when those cores are not this launcher's, or leave none."""
    if executor is None:
        return
    own = frozenset(os.sched_getaffinity(0))
    cores = cpus_text(executor)
    if not executor <= own:
        raise SystemExit(f"ordinal serve: --executor-cpus {cores}: this process may run on cores {sorted(own)} only")
    rest = own - executor
    if not rest:
        raise SystemExit(
            f"ordinal serve: --executor-cpus {cores} leaves no core for the scheduler, the grammar service and the "
            f"gateway (this process may run on {sorted(own)})"
        )
    os.sched_setaffinity(0, rest)


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

    grammar_argv = [*model, "--port", str(args.grammar_port), *json_schema_argv(args)]
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
        gateway_url = f"http://{_hostport(local, gateway_port)}/v1"
        gateway = sup.launch("gateway", argv, is_ready=lambda _: bool(listed_models(f"{gateway_url}/models")))
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
    """Start ``python -m services.<name>``; ready = its READY line, then SERVING from grpc.health.v1. Its port, which
    a restart reuses (the other services and the clients know it)."""
    child = sup.launch(name, [*_python_module(f"services.{name}"), *argv])
    port = sup.wait_ready_line(child, name.upper(), timeout)
    sup.wait_grpc_serving(child, _hostport(local, port), timeout)
    child.argv = pinned_port(child.argv, port)
    return port


def pinned_port(argv: list[str], port: int) -> list[str]:
    """``argv`` with the value of its ``--port`` flag set to ``port`` (a service started on port 0 keeps the port it
    chose across restarts)."""
    i = argv.index("--port")
    return [*argv[: i + 1], str(port), *argv[i + 2 :]]


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
