"""Metrics: the engine's timeline hooks, and the Prometheus exporters scraped after real generations."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.errors import ProtocolError
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause, Finish, FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.scheduler.metrics import RequestFinished, RequestTimeline, StepCommitted
from engine.scheduler.request import RequestOutput
from engine.step import NewRequest, SampledRun, StepEntry, StepPlan, StepResult, StepTiming
from services.executor.metrics import ExecutorMetrics
from services.metrics import serve_metrics
from services.scheduler.metrics import SchedulerMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry's text exposition, keyed by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# ---------------------------------------------------------------------------------------------- timeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """An EngineObserver that keeps every call, to check what the timeline reports."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self.calls.append(("added", (request_id, num_prompt_tokens)))

    def first_token(self, request_id: str, num_tokens: int, seconds: float) -> None:
        self.calls.append(("first", (request_id, num_tokens, seconds)))

    def output_tokens(self, request_id: str, num_tokens: int, seconds: float) -> None:
        self.calls.append(("tokens", (request_id, num_tokens, seconds)))

    def request_finished(self, event: RequestFinished) -> None:
        self.calls.append(("finished", event))

    def step_committed(self, event: StepCommitted) -> None:
        self.calls.append(("step", event))


def _out(rid: str, new: tuple[int, ...], n: int, finish: Finish | None = None) -> RequestOutput:
    return RequestOutput(rid, new, "", n, 5, 0, finish=finish, output_ids=None if finish is None else tuple(range(n)))


def _entry(rid: str, ordinal: int, n: int) -> StepEntry:
    """A prefill of ``n`` tokens (``ordinal`` 0) or a decode building on the run at ``ordinal``."""
    if ordinal:
        return StepEntry(rid, 0, ordinal, input_ref=True)
    return StepEntry(rid, 0, 0, input_ids=tuple(range(n)))


def test_timeline_reports_ttft_inter_token_and_latency() -> None:
    clock, rec = FakeClock(), Recorder()
    timeline = RequestTimeline(rec, clock)
    timeline.added("a", 5)
    clock.now += 0.5
    timeline.output(_out("a", (7,), 1))
    clock.now += 0.25
    timeline.output(_out("a", (8, 9), 3))
    clock.now += 0.25
    timeline.output(_out("a", (), 3, Finish(FinishReason.STOP, matched_token=2)))
    assert rec.calls[:3] == [("added", ("a", 5)), ("first", ("a", 1, 0.5)), ("tokens", ("a", 2, 0.25))]
    kind, event = rec.calls[3]
    assert kind == "finished" and isinstance(event, RequestFinished)
    assert (event.reason, event.abort_cause, event.num_output_tokens, event.latency_seconds) == (
        FinishReason.STOP,
        None,
        3,
        1.0,
    )
    timeline.output(_out("a", (1,), 4))  # unknown (already finished) requests are ignored
    assert len(rec.calls) == 4


def test_timeline_abort_before_first_token_reports_no_ttft() -> None:
    clock, rec = FakeClock(), Recorder()
    timeline = RequestTimeline(rec, clock)
    timeline.added("a", 5)
    clock.now += 2.0
    timeline.output(_out("a", (), 0, Finish(FinishReason.ABORT, message="x", cause=AbortCause.CLIENT)))
    assert [k for k, _ in rec.calls] == ["added", "finished"]
    event = rec.calls[1][1]
    assert isinstance(event, RequestFinished) and event.abort_cause is AbortCause.CLIENT
    assert event.latency_seconds == 2.0


def test_timeline_step_time_under_overlap_counts_from_previous_commit() -> None:
    clock, rec = FakeClock(), Recorder()
    timeline = RequestTimeline(rec, clock)
    step1 = StepPlan(1, (_entry("a", 0, 6),))
    step2 = StepPlan(2, (_entry("a", 1, 1), _entry("b", 0, 3)))
    timeline.step_launched(step1)
    clock.now += 0.01
    timeline.step_launched(step2)  # overlap: step 2 launched before step 1 commits
    clock.now += 0.02
    timeline.step_committed(step1, StepResult(1, (SampledRun("a", 0, (4,)),), StepTiming(done=0.02)))
    clock.now += 0.04
    runs = (SampledRun("a", 1, (4,)), SampledRun("b", 0, (4,)))
    timeline.step_committed(step2, StepResult(2, runs, StepTiming(done=0.03)))
    events = [e for k, e in rec.calls if k == "step"]
    assert all(isinstance(e, StepCommitted) for e in events)
    first, second = events
    assert isinstance(first, StepCommitted) and isinstance(second, StepCommitted)
    assert first.seconds == pytest.approx(0.03) and second.seconds == pytest.approx(0.04)
    assert (second.num_requests, second.num_tokens, second.num_prefill_tokens, second.num_samples) == (2, 4, 3, 2)
    assert second.forward_seconds == 0.03


class Broken(Recorder):
    def first_token(self, request_id: str, num_tokens: int, seconds: float) -> None:
        raise RuntimeError("exporter bug")


def test_timeline_survives_a_failing_observer(caplog: pytest.LogCaptureFixture) -> None:
    rec = Broken()
    timeline = RequestTimeline(rec, FakeClock())
    timeline.added("a", 5)
    timeline.output(_out("a", (7,), 1))  # first_token raises: logged, not propagated to the engine loop
    timeline.output(_out("a", (), 1, Finish(FinishReason.LENGTH)))
    assert [k for k, _ in rec.calls] == ["added", "finished"]
    assert "exporter bug" in caplog.text


# ---------------------------------------------------------------------------------------------- scheduler


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=256, max_running=8, chunk_size=64)


@pytest.fixture(scope="module")
def served(config: EngineConfig) -> Iterator[tuple[Engine, SchedulerMetrics]]:
    metrics = SchedulerMetrics()
    with Engine(config, observer=metrics) as engine:
        metrics.watch(engine.stats)
        yield engine, metrics


def test_scheduler_metrics_after_real_requests(served: tuple[Engine, SchedulerMetrics]) -> None:
    engine, metrics = served
    prompt = list(range(20, 60))  # 40 tokens: 4 full pages can be matched when it is sent again
    lengths = [3, 5, 8]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate_batch([prompt, [*prompt, 7, 8], list(range(70, 85))], params)
    assert engine.wait_idle(30)
    again = engine.generate_batch([prompt], [params[0]])  # after the first finished: a prefix cache hit
    assert engine.wait_idle(30)
    assert all(o.finish is not None and o.finish.reason is FinishReason.LENGTH for o in [*outs, *again])

    s = scrape(metrics.registry)
    stats = engine.stats()
    generated = sum(lengths) + lengths[0]
    assert value(s, "ordinal_requests_total") == 4
    assert value(s, "ordinal_prompt_tokens_total") == 40 + 42 + 15 + 40
    assert value(s, "ordinal_generation_tokens_total") == generated
    assert value(s, "ordinal_requests_finished_total", reason="length") == 4
    assert value(s, "ordinal_time_to_first_token_seconds_count") == 4
    assert value(s, "ordinal_time_per_output_token_seconds_count") == generated - 4
    assert value(s, "ordinal_request_latency_seconds_count") == 4
    ttft_sum = value(s, "ordinal_time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= value(s, "ordinal_request_latency_seconds_sum")
    assert value(s, "ordinal_step_seconds_count") == stats.steps  # idle: every planned step was committed
    assert value(s, "ordinal_step_seconds_sum") > 0
    assert value(s, "ordinal_step_tokens_sum") == stats.prefill_tokens + generated - 4
    assert value(s, "ordinal_step_prefill_tokens_total") == stats.prefill_tokens
    # gauges, read from engine.stats() at scrape time
    assert value(s, "ordinal_requests_waiting") == 0 and value(s, "ordinal_requests_running") == 0
    assert value(s, "ordinal_kv_pages", state="used") == 0
    free, evictable = value(s, "ordinal_kv_pages", state="free"), value(s, "ordinal_kv_pages", state="evictable")
    assert free + evictable == value(s, "ordinal_kv_pages_capacity") == 256 and evictable > 0
    assert value(s, "ordinal_prefix_cache_hit_tokens_total") == stats.cached_prompt_tokens >= 32
    hit_rate = value(s, "ordinal_prefix_cache_hit_rate")
    assert hit_rate == pytest.approx(stats.cached_prompt_tokens / (stats.cached_prompt_tokens + stats.prefill_tokens))
    assert 0 < hit_rate < 1


def test_scheduler_metrics_count_aborts_by_cause(served: tuple[Engine, SchedulerMetrics]) -> None:
    engine, metrics = served
    before = scrape(metrics.registry).get(("ordinal_requests_aborted_total", (("cause", "client"),)), 0.0)
    done: Future[RequestOutput] = Future()

    def sink(out: RequestOutput) -> None:
        if not out.finished:
            engine.abort(rid)  # on the first token: the abort wins before the next commit (C7)
        elif not done.done():
            done.set_result(out)

    rid = engine.submit(list(range(30, 40)), SamplingParams(max_new_tokens=64, ignore_eos=True), sink)
    out = done.result(timeout=30)
    assert out.finish is not None and out.finish.reason is FinishReason.ABORT
    assert engine.wait_idle(30)
    s = scrape(metrics.registry)
    assert value(s, "ordinal_requests_aborted_total", cause="client") == before + 1
    assert value(s, "ordinal_requests_finished_total", reason="abort") >= 1


def test_registries_are_per_instance() -> None:
    a, b = SchedulerMetrics(), SchedulerMetrics()  # the same names twice in one process: no collision
    a.request_added("r", 3)
    assert value(scrape(a.registry), "ordinal_requests_total") == 1
    assert value(scrape(b.registry), "ordinal_requests_total") == 0


# ---------------------------------------------------------------------------------------------- executor


def test_executor_metrics_with_a_real_runner(config: EngineConfig) -> None:
    runner = ModelRunner.load(config)
    try:
        metrics = ExecutorMetrics()
        metrics.watch_buffers(lambda: runner.num_buffers)
        prompt = tuple(range(40, 52))
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        entry = StepEntry("r", 0, 0, input_ids=prompt, new_pages=(0, 1), new=NewRequest(prompt, params, 1))
        plan = StepPlan(1, (entry,))
        future = runner.launch(plan)
        metrics.track_step(plan, future)
        result = _after_callbacks(future)
        s = scrape(metrics.registry)
        assert value(s, "ordinal_executor_buffers_alive") == 1
        assert value(s, "ordinal_executor_step_seconds_count") == 1
        assert result.timing.done >= result.timing.forward_seconds > 0
        assert value(s, "ordinal_executor_step_seconds_sum") == pytest.approx(result.timing.done)
        assert value(s, "ordinal_executor_tokens_total") == 12 and value(s, "ordinal_executor_samples_total") == 1
        runner.release([0]).result(timeout=10)
        assert value(scrape(metrics.registry), "ordinal_executor_buffers_alive") == 0
        bad = StepPlan(2, (replace(entry, new=None),))  # names a released slot: the step fails
        failed = runner.launch(bad)
        metrics.track_step(bad, failed)
        with pytest.raises(ProtocolError):
            _after_callbacks(failed)
        assert value(scrape(metrics.registry), "ordinal_executor_step_seconds_count") == 1
    finally:
        runner.shutdown()


def test_executor_metrics_count_the_wait_for_masks_of_constrained_steps_only() -> None:
    """A step whose timing has ``masks_ready`` (a constrained row) observes its wait past the forward; one without
    observes nothing."""
    metrics = ExecutorMetrics()
    plan = StepPlan(1, (StepEntry("r", 0, 1, input_ref=True),))
    for timing in (StepTiming(0.0, 0.001, 0.004, 0.0052, 0.003, masks_ready=0.0047), StepTiming(None, 0.001, 0.004)):
        future: Future[StepResult] = Future()
        metrics.track_step(plan, future)
        future.set_result(StepResult(1, (SampledRun("r", 1, (7,)),), timing))
    s = scrape(metrics.registry)
    assert value(s, "ordinal_executor_step_seconds_count") == 2
    assert value(s, "ordinal_executor_mask_wait_seconds_count") == 1
    assert value(s, "ordinal_executor_mask_wait_seconds_sum") == pytest.approx(0.0007)


def _after_callbacks(future: Future[StepResult]) -> StepResult:
    """The future's result, once every callback registered before this call has run (they run in order)."""
    ran = threading.Event()
    future.add_done_callback(lambda _: ran.set())
    assert ran.wait(30)
    return future.result()


# ---------------------------------------------------------------------------------------------- http


def test_serve_metrics_over_http_and_port_zero_disables() -> None:
    assert serve_metrics(0, CollectorRegistry()) is None
    metrics = SchedulerMetrics()
    metrics.request_added("r", 2)
    server = serve_metrics(_free_port(), metrics.registry, host="127.0.0.1")
    assert server is not None
    try:
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            body = resp.read().decode()
        assert "ordinal_requests_total 1.0" in body
    finally:
        server.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------- grammar


def test_grammar_metrics_count_keywords_by_enforcer_and_violations(embedded_model_dir: Path) -> None:
    """A real registry in checked mode reporting to GrammarMetrics: each opened JSON-schema request counts its mode
    and its keywords, by whether the grammar enforces them or the output check does; a violation found at commit
    counts its keyword. A strict request's keywords are all the grammar's."""
    from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
    from engine.grammar import CompilerConfig, ConstraintCompiler, GrammarRegistry
    from engine.grammar_calls import CommitEntry
    from engine.model.tokenizer import Tokenizer
    from services.grammar.metrics import GrammarMetrics

    metrics = GrammarMetrics()
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir, CompilerConfig(workers=1))
    registry = GrammarRegistry(compiler, observer=metrics)
    schema = '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'
    try:
        registry.open("checked", Constraint(ConstraintKind.JSON_SCHEMA, schema), timeout_s=60)
        registry.open(
            "strict", Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}', JsonSchemaMode.STRICT), 60
        )
        registry.open("regex", Constraint(ConstraintKind.REGEX, "[a-z]+"), timeout_s=60)  # not a JSON schema
        tokens = Tokenizer.from_dir(embedded_model_dir).encode("[1, 1]")
        refused = [registry.commit([CommitEntry("checked", i, (t,))])[0] for i, t in enumerate(tokens)]
        assert refused[-1].result is not None and refused[-1].result.violation is not None
        registry.release(["checked", "strict", "regex"])
    finally:
        compiler.shutdown()
    samples = scrape(metrics.registry)
    assert value(samples, "ordinal_json_schema_requests_total", mode="checked") == 1
    assert value(samples, "ordinal_json_schema_requests_total", mode="strict") == 1
    assert value(samples, "ordinal_json_schema_keywords_total", keyword="uniqueItems", enforced_by="check") == 1
    assert value(samples, "ordinal_json_schema_keywords_total", keyword="items", enforced_by="grammar") == 1
    assert value(samples, "ordinal_json_schema_keywords_total", keyword="type", enforced_by="grammar") == 2
    assert value(samples, "ordinal_json_schema_violations_total", keyword="uniqueItems") == 1
    assert (
        "ordinal_json_schema_keywords_total",
        (("enforced_by", "grammar"), ("keyword", "uniqueItems")),
    ) not in samples
