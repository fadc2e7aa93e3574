"""The ``ordinal`` command line: flags, the engine-flag round trip, the probes and the process supervisor.

The supervisor tests run real child processes (tiny ``python -c`` scripts, no torch), so that READY detection,
death reports and the stop escalation are exercised on real pipes, signals and exit codes.
"""

from __future__ import annotations

import argparse
import http.server
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.config import EngineConfig, SpecAlgorithm, SpeculativeConfig
from services.flags import (
    DEFAULT_JSON_WHITESPACE,
    DEFAULT_METRICS_PORT,
    JSON_INTEGER_RANGES,
    JSON_SCHEMA_MODES,
    add_engine_args,
    engine_argv,
    engine_config,
    json_schema_argv,
    json_schema_mode,
)
from services.gateway import smg_argv
from services.launcher import Endpoints, _metrics_ports, build_parser, main
from services.supervisor import RestartPolicy, ServiceFailedError, StopRequestedError, StopSignal, Supervisor

REPO = Path(__file__).resolve().parents[2]


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


# ---------------------------------------------------------------------------------------------- flags


def test_engine_args_defaults_are_the_engine_config_defaults() -> None:
    args = _engine_parser().parse_args([])
    assert engine_config(args) == EngineConfig()
    assert args.metrics_port == 0 and args.log_level == "INFO"


def test_engine_argv_round_trips_every_engine_flag() -> None:
    flags = [
        "--model",
        "/m",
        "--device",
        "cuda:1",
        "--dtype",
        "bfloat16",
        "--page-size",
        "32",
        "--num-pages",
        "77",
        "--max-running",
        "5",
        "--chunk-size",
        "64",
        "--no-overlap",
        "--no-prefix-cache",
        "--grammar-overlap",
        "off",
        "--outage-timeout",
        "7.5",
        "--cpu-threads",
        "3",
        "--executor-cpus",
        "1,3-4",
        "--grammar-mask-relay",
        "on",
    ]
    parser = _engine_parser()
    args = parser.parse_args(flags)
    again = parser.parse_args(["--model", "/m", *engine_argv(args)])
    assert engine_config(again) == engine_config(args)
    # Process settings of the executor, not part of the engine config:
    assert (again.cpu_threads, again.executor_cpus, again.grammar_mask_relay) == (3, frozenset({1, 3, 4}), "on")
    unpinned = parser.parse_args(["--model", "/m"])
    assert parser.parse_args(["--model", "/m", *engine_argv(unpinned)]).executor_cpus is None
    assert engine_config(args) == EngineConfig(
        model_path="/m",
        device="cuda:1",
        dtype="bfloat16",
        page_size=32,
        num_pages=77,
        max_running=5,
        chunk_size=64,
        overlap=False,
        prefix_cache=False,
        grammar_overlap=False,
        outage_timeout_s=7.5,
    )


def test_speculative_flags_round_trip_the_draft_grammar_option_included() -> None:
    """The speculative flags reach the services as given: ``--speculative-draft-grammar on`` (off by default) too,
    which the executor needs (its draft model drafts under the grammar) and the scheduler reports."""
    parser = _engine_parser()
    assert engine_config(parser.parse_args([])).speculative.draft_grammar is False
    flags = ["--model", "/m", "--speculative-algorithm", "draft", "--speculative-draft-model-path", "/d"]
    flags += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-adaptive", "off"]
    flags += ["--speculative-draft-grammar", "on", "--speculative-draft-min-prob", "0.3"]
    flags += ["--speculative-disable-by-batch-size", "16"]
    args = parser.parse_args(flags)
    again = parser.parse_args(["--model", "/m", *engine_argv(args)])
    want = SpeculativeConfig(
        SpecAlgorithm.DRAFT,
        "/d",
        num_steps=3,
        topk=2,
        adaptive=False,
        draft_grammar=True,
        draft_min_prob=0.3,
        disable_by_batch_size=16,
    )
    assert engine_config(args).speculative == engine_config(again).speculative == want


def test_a_negative_speculation_batch_bound_is_refused_at_start() -> None:
    """--speculative-disable-by-batch-size takes a count of requests, 0 (the default) for no bound."""
    parser = _engine_parser()
    args = parser.parse_args(["--model", "/m", "--speculative-algorithm", "ngram"])
    assert engine_config(args).speculative.disable_by_batch_size == 0
    args = parser.parse_args(
        ["--model", "/m", "--speculative-algorithm", "ngram", "--speculative-disable-by-batch-size", "-1"]
    )
    with pytest.raises(SystemExit, match="disable_by_batch_size must be >= 0 \\(0: never\\), got -1"):
        engine_config(args)


def test_the_draft_depth_defaults_per_algorithm_and_the_draft_bar_is_checked() -> None:
    """Without --speculative-num-steps a draft model drafts up to 6 tokens (its chains end where it is unsure, at the
    default bar of 0.6) and n-gram lookup 4; a given depth is kept, and passed on to the other service as resolved.
    A bar outside [0, 1) is refused at start, naming the flag's value."""
    parser = _engine_parser()
    for algorithm, depth in (("draft", 6), ("ngram", 4)):
        args = parser.parse_args(["--model", "/m", "--speculative-algorithm", algorithm])
        spec = engine_config(args).speculative
        assert (spec.num_steps, spec.draft_min_prob) == (depth, 0.6)
        again = parser.parse_args(["--model", "/m", *engine_argv(args)])
        assert engine_config(again).speculative == spec
    for bar in ("1.0", "-0.1"):
        args = parser.parse_args(
            ["--model", "/m", "--speculative-algorithm", "draft", "--speculative-draft-min-prob", bar]
        )
        with pytest.raises(SystemExit, match=f"draft_min_prob must be in \\[0, 1\\), got {float(bar)}"):
            engine_config(args)


def test_speculative_algorithm_takes_sglangs_spellings_and_refuses_heads_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SGLang's names work as they do there (upper case; STANDALONE is its draft-model algorithm); an algorithm ordinal
    does not build (EAGLE) is refused at start, saying what is available, as is a misspelling."""
    parser = _engine_parser()
    for given, algorithm in (("NGRAM", SpecAlgorithm.NGRAM), ("STANDALONE", SpecAlgorithm.DRAFT)):
        args = parser.parse_args(["--model", "/m", "--speculative-algorithm", given])
        assert engine_config(args).speculative.algorithm is algorithm
        assert engine_argv(args)[engine_argv(args).index("--speculative-algorithm") + 1] == algorithm.value
    for given, says in (("EAGLE3", "heads that read the target's hidden states"), ("ngrams", "is not one of draft")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--model", "/m", "--speculative-algorithm", given])
        assert says in capsys.readouterr().err


def test_drafting_under_the_grammar_without_a_draft_model_is_refused() -> None:
    """--speculative-draft-grammar on applies to the draft model only: with n-gram (or no speculation) it would do
    nothing, so it is refused at start with the flag to add, not silently ignored."""
    parser = _engine_parser()
    for algorithm in (["--speculative-algorithm", "ngram"], []):
        args = parser.parse_args(["--model", "/m", *algorithm, "--speculative-draft-grammar", "on"])
        with pytest.raises(SystemExit, match="--speculative-algorithm draft"):
            engine_config(args)


def test_grammar_overlap_sets_the_mask_wait() -> None:
    """on: the executor waits at the fence (mask_wait_s > 0); off: it never waits, the scheduler commits early."""
    parser = _engine_parser()
    on, off = (engine_config(parser.parse_args(["--grammar-overlap", v])) for v in ("on", "off"))
    assert on.grammar_overlap and on.mask_wait_s == on.grammar_wait_s > 0
    assert not off.grammar_overlap and off.mask_wait_s == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--grammar-overlap", "maybe"])


def test_serve_defaults_are_the_documented_interface() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.executor_port, args.gateway_port) == ("127.0.0.1", 30000, 30001, 8000)
    assert (args.grammar_port, args.grammar_overlap) == (30002, "on")
    assert args.no_gateway is False and args.model is None and args.served_model_name is None
    assert args.metrics_port == DEFAULT_METRICS_PORT and args.log_level == "INFO"
    assert json_schema_mode(args) == "checked" and args.json_whitespace == DEFAULT_JSON_WHITESPACE
    assert engine_config(args) == EngineConfig()


def test_serve_flags_parse() -> None:
    argv = "serve --model /x --host 0.0.0.0 --port 1 --gateway-port 2 --executor-port 3 --no-gateway --page-size 8 "
    argv += "--num-pages 9 --chunk-size 10 --no-overlap --metrics-port 4 --served-model-name m --log-level debug "
    argv += "--grammar-port 5 --grammar-overlap off --json-schema strict"
    args = build_parser().parse_args(argv.split())
    assert args.grammar_port == 5 and engine_config(args).grammar_overlap is False
    assert json_schema_mode(args) == "strict"
    assert (args.host, args.port, args.gateway_port, args.executor_port, args.metrics_port) == ("0.0.0.0", 1, 2, 3, 4)
    assert args.no_gateway and args.no_overlap and args.served_model_name == "m" and args.log_level == "DEBUG"
    assert engine_config(args).page_size == 8 and engine_config(args).num_pages == 9
    assert engine_config(args).chunk_size == 10


def test_every_flag_has_help() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("serve", "gateway", "healthcheck", "generate"):
        for action in subparsers.choices[name]._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"ordinal {name} {action.option_strings[0]} has no help"


def test_metrics_ports_from_the_base() -> None:
    args = build_parser().parse_args(["serve", "--metrics-port", "9100"])
    assert _metrics_ports(args) == {"scheduler": 9100, "executor": 9101, "gateway": 9102, "grammar": 9103}
    args = build_parser().parse_args(["serve", "--metrics-port", "0"])
    assert set(_metrics_ports(args).values()) == {0}


def test_smg_argv_is_the_documented_command() -> None:
    argv = smg_argv(
        "/v/bin/smg",
        host="127.0.0.1",
        port=8000,
        worker_url="grpc://127.0.0.1:30000",
        model_dir=Path("/models/m"),
        metrics_port=29002,
        log_level="WARNING",
    )
    assert argv[:2] == ["/v/bin/smg", "launch"]
    pairs = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "8000"
    assert pairs["--worker-urls"] == "grpc://127.0.0.1:30000" and pairs["--model-path"] == "/models/m"
    assert pairs["--backend"] == "sglang" and pairs["--prometheus-port"] == "29002"
    assert pairs["--log-level"] == "warn"


def test_ready_line_names_endpoints_and_pids() -> None:
    pids = {"grammar": 9, "executor": 10, "scheduler": 11}
    ep = Endpoints("127.0.0.1", 1, 2, 4, "http://127.0.0.1:3/v1", "m", {}, pids)
    assert ep.ready_line() == (
        "ORDINAL_READY scheduler=127.0.0.1:1 executor=127.0.0.1:2 grammar=127.0.0.1:4 gateway=http://127.0.0.1:3/v1 "
        "grammar_pid=9 executor_pid=10 scheduler_pid=11"
    )


# ---------------------------------------------------------------------------------------------- probes


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def test_healthcheck_grpc(health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]) -> None:
    target, servicer = health_server
    assert main(["healthcheck", target]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["healthcheck", target]) == 1
    assert main(["healthcheck", target, "--service", "no.such.Service", "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert "SERVING" in out and "NOT_SERVING" in out and "NOT_FOUND" in out


def test_healthcheck_unreachable_is_bounded() -> None:
    started = time.monotonic()
    assert main(["healthcheck", "127.0.0.1:1", "--timeout", "2"]) == 1
    assert time.monotonic() - started < 10


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/ok" else 503)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_healthcheck_http() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["healthcheck", f"{base}/ok"]) == 0
        assert main(["healthcheck", f"{base}/readiness"]) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_does_not_import_torch() -> None:
    code = (
        "import sys; from services.launcher import main; main(['healthcheck', '127.0.0.1:1', '--timeout', '1']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=60)


# ---------------------------------------------------------------------------------------------- supervisor


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


READY_THEN_WAIT = """
    import signal, sys, time
    print("FAKE_READY port=4242", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    time.sleep(60)
"""


def _stop_logger(name: str, log: Path) -> list[str]:
    body = f"""
        import signal, sys, time
        def stop(*_):
            with open({str(log)!r}, "a") as f:
                f.write({name!r} + "\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        print("FAKE_READY port=4242", flush=True)
        time.sleep(60)
    """
    return _script(body)


def test_supervisor_reads_the_ready_port_and_stops_in_reverse_order(tmp_path: Path) -> None:
    log = tmp_path / "stops"
    with Supervisor(StopSignal(), stop_timeout=10) as sup:
        children = []
        for name in ("executor", "scheduler", "gateway"):
            children.append(sup.launch(name, _stop_logger(name, log)))
            assert sup.wait_ready_line(children[-1], "FAKE", timeout=30) == 4242
        assert list(sup.pids()) == ["executor", "scheduler", "gateway"]
    assert [c.exited() for c in children] == [0, 0, 0]
    assert log.read_text().split() == ["gateway", "scheduler", "executor"]


def test_supervisor_reports_a_child_that_dies_while_starting() -> None:
    body = """
        import sys
        print("loading the model", file=sys.stderr)
        print("RuntimeError: out of memory", file=sys.stderr)
        sys.exit(3)
    """
    with Supervisor(StopSignal(), stop_timeout=5) as sup:
        child = sup.launch("executor", _script(body))
        with pytest.raises(ServiceFailedError) as err:
            sup.wait_ready_line(child, "EXECUTOR", timeout=30)
    message = str(err.value)
    assert "executor" in message and "exit code 3" in message and "RuntimeError: out of memory" in message


def test_supervisor_startup_wait_is_bounded() -> None:
    with Supervisor(StopSignal(), stop_timeout=5) as sup:
        child = sup.launch("slow", _script("import time; time.sleep(60)"))
        started = time.monotonic()
        with pytest.raises(ServiceFailedError, match="not ready after"):
            sup.wait_ready_line(child, "SLOW", timeout=0.5)
        assert time.monotonic() - started < 5
    assert child.exited() is not None


def test_supervisor_with_restarts_off_stops_at_the_first_death_and_reports_its_signal() -> None:
    with Supervisor(StopSignal(), stop_timeout=5) as sup:
        child = sup.launch("executor", _script(READY_THEN_WAIT))
        sup.wait_ready_line(child, "FAKE", timeout=30)
        assert child.proc is not None
        child.proc.kill()
        assert sup.supervise(RestartPolicy(max_restarts=0), startup_timeout=30) == 1
    assert sup.pids() == {"executor": child.pid}, "not restarted"
    assert "killed by SIGKILL" in child.death_report()


def test_supervisor_kills_a_child_that_ignores_sigterm() -> None:
    body = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("STUBBORN_READY port=1", flush=True)
        time.sleep(60)
    """
    sup = Supervisor(StopSignal(), stop_timeout=0.5)
    child = sup.launch("stubborn", _script(body))
    sup.wait_ready_line(child, "STUBBORN", timeout=30)
    started = time.monotonic()
    sup.stop_all()
    assert child.exited() == -9 and time.monotonic() - started < 10


def test_supervisor_stop_signal_interrupts_startup() -> None:
    stop = StopSignal()
    with Supervisor(stop, stop_timeout=5) as sup:
        child = sup.launch("slow", _script("import time; time.sleep(60)"))
        threading.Timer(0.3, stop.requested.set).start()
        with pytest.raises(StopRequestedError):
            sup.wait_ready_line(child, "SLOW", timeout=30)
    assert child.exited() is not None


# ---------------------------------------------------------------------------------------------- passthrough


def test_executor_subcommand_execs_the_service_module() -> None:
    cmd = [sys.executable, "-m", "services.launcher", "executor", "--help"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python -m services.executor" in done.stdout and "--page-size" in done.stdout
    assert "--grammar HOST:PORT" in done.stdout and "--grammar-overlap" in done.stdout


def test_grammar_service_checks_json_schemas_unless_told_otherwise() -> None:
    from engine.constraint import JsonSchemaMode
    from services.grammar.__main__ import build_parser as grammar_parser

    assert set(JSON_SCHEMA_MODES) == {m.value for m in JsonSchemaMode}
    parse = grammar_parser().parse_args
    assert json_schema_mode(parse([])) == "checked"
    assert json_schema_mode(parse(["--json-schema", "strict"])) == "strict"
    assert json_schema_mode(parse(["--loose-json-schema"])) == "loose"  # the flag of earlier versions
    with pytest.raises(SystemExit):
        json_schema_mode(parse(["--loose-json-schema", "--json-schema", "strict"]))
    with pytest.raises(SystemExit):
        parse(["--json-schema", "lenient"])


def test_json_integer_range_is_safe_unless_told_otherwise() -> None:
    """The grammar service, the in-process scheduler and ``ordinal serve`` take ``--json-integer-range``; serve passes
    it on to the grammar service it starts."""
    from engine.grammar import CompilerConfig, IntegerRange
    from services.grammar.__main__ import build_parser as grammar_parser
    from services.scheduler.__main__ import build_parser as scheduler_parser

    assert tuple(r.value for r in IntegerRange) == JSON_INTEGER_RANGES
    assert IntegerRange(JSON_INTEGER_RANGES[0]) is CompilerConfig().json_integer_range is IntegerRange.SAFE
    parsers = ((grammar_parser(), []), (scheduler_parser(), []), (build_parser(), ["serve"]))
    for parser, prefix in parsers:
        assert parser.parse_args(prefix).json_integer_range == "safe"
        assert parser.parse_args([*prefix, "--json-integer-range", "unbounded"]).json_integer_range == "unbounded"
        with pytest.raises(SystemExit):
            parser.parse_args([*prefix, "--json-integer-range", "int64"])
    serve = build_parser().parse_args(["serve", "--json-integer-range", "unbounded", "--json-schema", "strict"])
    passed = grammar_parser().parse_args(json_schema_argv(serve))
    assert (passed.json_integer_range, json_schema_mode(passed)) == ("unbounded", "strict")


def test_json_whitespace_is_bounded_unless_told_unbounded() -> None:
    """The grammar service (and the scheduler's in-process registry) bound JSON whitespace to the engine's default
    unless ``--json-whitespace unbounded``; ``ordinal serve`` spells its value back for the grammar service and
    refuses a bad one while parsing, before anything starts."""
    from engine.grammar import CompilerConfig
    from services.grammar.__main__ import build_parser as grammar_parser
    from services.scheduler.__main__ import build_parser as scheduler_parser

    assert CompilerConfig().json_max_whitespace == DEFAULT_JSON_WHITESPACE == 8
    parse = grammar_parser().parse_args
    assert parse([]).json_whitespace == DEFAULT_JSON_WHITESPACE
    assert parse(["--json-whitespace", "unbounded"]).json_whitespace is None
    assert parse(["--json-whitespace", "3"]).json_whitespace == 3
    assert scheduler_parser().parse_args(["--json-whitespace", "unbounded"]).json_whitespace is None
    for flags, expected in ((["--json-whitespace", "unbounded"], None), (["--json-whitespace", "2"], 2), ([], 8)):
        argv = json_schema_argv(build_parser().parse_args(["serve", "--json-schema", "strict", *flags]))
        assert argv[:2] == ["--json-schema", "strict"]
        assert parse(argv).json_whitespace == expected and json_schema_mode(parse(argv)) == "strict"
    for bad in ("0", "-1", "many", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--json-whitespace", bad])


def test_grammar_subcommand_execs_the_service_module() -> None:
    cmd = [sys.executable, "-m", "services.launcher", "grammar", "--help"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python -m services.grammar" in done.stdout and "--fence-deadline-ms" in done.stdout
    assert "--json-schema" in done.stdout and "--metrics-port" in done.stdout


def test_the_gateway_is_a_dependency_and_its_absence_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`pip install .` brings smg (a main dependency: `ordinal serve` starts it by default); where it is missing
    anyway, `ordinal serve` says how to install it or run without it, before starting anything."""
    import tomllib

    from services import gateway

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("smg==") for d in deps), deps
    monkeypatch.setattr(gateway.sys, "executable", str(tmp_path / "python"))  # no smg beside it
    monkeypatch.setenv("PATH", str(tmp_path))  # nor on PATH
    with pytest.raises(
        SystemExit, match=r"smg gateway is not installed \(pip install smg==1.13.0\), or use --no-gateway"
    ):
        gateway.find_smg()


def test_serve_refuses_a_bad_engine_flag_before_starting_any_service(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad engine flag (a negative --speculative-disable-by-batch-size, a page size of 0) ends `ordinal serve` with
    the flag's message at once: no service is started (it used to start the grammar service and fail in the
    executor)."""
    argv = ["serve", "--no-gateway", "--speculative-algorithm", "ngram", "--speculative-disable-by-batch-size", "-1"]
    with pytest.raises(SystemExit, match="disable_by_batch_size must be >= 0"):
        main(argv)
    with pytest.raises(SystemExit, match="ordinal serve: page_size must be >= 1, got 0"):
        main(["serve", "--no-gateway", "--page-size", "0"])
    captured = capsys.readouterr()
    assert "starting" not in captured.out + captured.err


def test_the_executor_leaves_a_core_to_the_others_on_a_cpu_device() -> None:
    """--cpu-threads 0 on CPU: every core the process may use but one (at least one); as asked otherwise; torch's
    default (None) on CUDA; a negative count is refused."""
    from services.executor.__main__ import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(0, "cpu") == max(1, cores - 1)
    assert cpu_threads(3, "cpu") == 3
    assert cpu_threads(0, "cuda:0") is None
    with pytest.raises(SystemExit, match="--cpu-threads"):
        cpu_threads(-1, "cpu")


def test_executor_cores_parse_as_taskset_spells_them_and_bad_ones_are_named() -> None:
    """--executor-cpus: ``1``, ``1,3``, ``2-5``, ``0,2-3``; anything else is a usage error naming the value."""
    from services.flags import parse_cpus

    assert parse_cpus("1") == frozenset({1})
    assert parse_cpus("0,2-3") == frozenset({0, 2, 3})
    assert parse_cpus("2-5") == frozenset({2, 3, 4, 5})
    for bad in ("", "a", "3-1", "1,,2", "-1", "1-"):
        with pytest.raises(argparse.ArgumentTypeError, match="taskset"):
            parse_cpus(bad)


@pytest.mark.parametrize(
    ("cores", "message"),
    [("4096", "may run on cores"), ("ALL", "leaves no core for the scheduler")],
)
def test_serve_refuses_executor_cores_it_cannot_give_before_starting_anything(cores: str, message: str) -> None:
    """``ordinal serve --executor-cpus``: cores the launcher may not use, or all of its cores (none would be left for
    the other services), are refused with exit code 2-style usage text before any service starts."""
    if cores == "ALL":
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    argv = [sys.executable, "-m", "services.launcher", "serve", "--no-gateway", "--executor-cpus", cores]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert "ready" not in done.stdout.lower()
