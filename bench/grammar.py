"""Constrained vs unconstrained decoding throughput, with the grammar's cost per step, in one run.

The in-process engine on one model (the embedded one by default) serves the same closed-loop workload four ways:
unconstrained; constrained with delayed sampling (``grammar_overlap``, the default: masks are fetched while the
forward runs), once in strict and once in checked JSON-schema mode (the default: every output is also validated when
its grammar terminates, and values are checked as they close where the schema has keywords left to the check);
constrained with early commit (``grammar_overlap=False``, checked). The schemas are those strict mode accepts (a
``--schemas`` folder is filtered to them), so that checked against strict measures what the output check costs
where both serve the same grammar. ``--streams`` requests are in flight at
all times: a new one is submitted whenever one finishes. A rate counts the output tokens streamed while all streams
are busy, from the first submit to the last: the drain after it runs below that concurrency and lasts as long as
the longest outputs, which differ between the modes. Constrained requests each follow one JSON schema, cycled
from a built-in set or from ``--schemas DIR`` (``*.json`` files, e.g. a JSONSchemaBench folder). The modes run
in interleaved rounds, so that load from outside the benchmark slows each of them alike; the table shows the best
and the median round, and the paired ratio: the median over rounds of a mode's rate against the unconstrained rate
of the same round, the steadiest of the three on a shared machine.

Per step with constrained rows it reports how long the scheduler's commit call to the grammar took (checked mode's
output check runs there; after the run the commits alone are replayed without a model, strict against checked, on
random walks through each schema's grammar), how long the executor waited for its masks after the forward (the
cost delayed sampling does not hide), how long after the opening of the step's mask fence (before the forward) all its
rows were written (by the commit that let them through, overlapped with the forward, or after it), and how
many bytes a FillMasks reply of the grammar service
would carry for that step (packed with ``services.grammar.convert.encode_masks``: distinct rows once, all-allowed
rows as a reference).

With ``--split`` the same comparison runs against the services as deployed: a grammar service, an executor and a
scheduler as their own processes (two such stacks: one with delayed sampling, one with ``--grammar-overlap off``),
driven through the scheduler's public gRPC API with ``json_schema`` constraints; CPU is that of every service
process.

    .venv/bin/python bench/grammar.py                       # 32 streams, prints one table with the ratio
    .venv/bin/python bench/grammar.py --schemas ../shared/jsonschemabench --rounds 3
    .venv/bin/python bench/grammar.py --split               # the same through the gRPC services
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
import torch
import xgrammar as xgr
from load import SpawnedStack, spawned_stack  # bench/load.py, beside this file
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.executor.masks import PendingMasks, StepMasks
from engine.executor.proposer import Draft
from engine.executor.runner import ModelRunner, ResolvedEntry
from engine.finish import FinishReason
from engine.grammar.backend import LocalGrammar
from engine.grammar.compiler import CompilerConfig, ConstraintCompiler, load_tokenizer_info
from engine.grammar.registry import FencedMasks, GrammarRegistry
from engine.grammar.schema import JsonSchemaPolicy
from engine.grammar_calls import (
    CommitEntry,
    CommitOutcome,
    GrammarLoss,
    InvalidGrammarError,
    MaskEntry,
    MaskRefusals,
    words_per_row,
)
from engine.model.embedded import ensure_embedded_model
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.scheduler.request import RequestOutput
from services.grammar.convert import MaskAnswer, encode_masks, mask_answers

BUILTIN_SCHEMAS: tuple[dict[str, object], ...] = (
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age", "email"],
    },
    {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            },
            "paid": {"type": "boolean"},
        },
        "required": ["order_id", "items", "paid"],
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather", "search", "calculator"]},
            "arguments": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
        "required": ["name", "arguments"],
    },
    {"type": "array", "items": {"type": "number"}, "minItems": 3},
)


# ---------------------------------------------------------------------------------------------- instrumentation


@dataclass
class GrammarCosts:
    """What the grammar cost per step: executor waits after the forward, fill_masks durations, reply sizes."""

    mask_waits_s: list[float] = field(default_factory=list)
    fill_calls_s: list[float] = field(default_factory=list)
    commit_calls_s: list[float] = field(default_factory=list)  # the scheduler's commit call, per step
    # Per step: (step bitmask, mask entries, their first rows, refusals); turned into replies only after the run.
    steps: list[tuple[torch.Tensor, Sequence[MaskEntry], Sequence[int], MaskRefusals]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_fill(
        self,
        seconds: float,
        out: torch.Tensor,
        entries: Sequence[MaskEntry],
        starts: Sequence[int],
        refusals: MaskRefusals,
    ) -> None:
        """Keep what a step's masks were, as they are: the executor may be waiting on this call (after the forward)."""
        with self.lock:
            self.fill_calls_s.append(seconds)
            self.steps.append((out, entries, starts, refusals))

    def replies(self) -> list[list[MaskAnswer]]:
        """Each recorded step's answers, as the grammar service would reply them."""
        return [mask_answers(entries, starts, refusals) for _, entries, starts, refusals in self.steps]

    def reply_bytes(self) -> list[int]:
        """Bytes of the FillMasks reply the grammar service would send for each recorded step (sized after the run,
        so that packing does not slow the run down)."""
        return [
            encode_masks(out, answers).ByteSize()
            for (out, _, _, _), answers in zip(self.steps, self.replies(), strict=True)
        ]


class TimedGrammar:
    """A grammar backend that forwards to a :class:`LocalGrammar` and times each step's masks (see ``_TimedFence``)."""

    def __init__(self, inner: LocalGrammar, costs: GrammarCosts) -> None:
        self.inner = inner
        self.costs = costs

    def open(self, request_id: str, constraint: Constraint) -> int:
        return self.inner.open(request_id, constraint)

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        started = time.perf_counter()
        outcomes = self.inner.commit(entries)
        with self.costs.lock:
            self.costs.commit_calls_s.append(time.perf_counter() - started)
        return outcomes

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        started = time.perf_counter()
        refusals = self.inner.fill_masks_into(entries, deadline_s, out, starts)
        self.costs.record_fill(time.perf_counter() - started, out, entries, starts, refusals)
        return refusals

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> _TimedFence:
        return _TimedFence(self.inner.start_masks(entries, deadline_s, out, starts), entries, out, starts, self.costs)

    def release(self, request_ids: Sequence[str]) -> None:
        self.inner.release(request_ids)

    @property
    def num_open(self) -> int:
        return self.inner.num_open

    def take_loss(self, verify: bool = False) -> GrammarLoss | None:
        return self.inner.take_loss(verify)

    def unavailable(self) -> str | None:
        return self.inner.unavailable()


class _TimedFence:
    """A step's open mask fence; once answered it records when its rows were all written (from its opening)."""

    def __init__(
        self,
        inner: FencedMasks,
        entries: Sequence[MaskEntry],
        out: torch.Tensor,
        starts: Sequence[int],
        costs: GrammarCosts,
    ) -> None:
        self._inner, self._entries, self._out, self._starts, self._costs = inner, entries, out, starts, costs

    def result(self) -> MaskRefusals:
        refusals = self._inner.result()
        written = self._inner.written_after_s
        if written is not None:
            self._costs.record_fill(written, self._out, self._entries, self._starts, refusals)
        return refusals

    def close(self) -> None:
        self._inner.close()


class _TimedPendingMasks(PendingMasks):
    """A step's pending masks whose ``result`` (called right after the forward) records how long it blocked."""

    def __init__(self, inner: PendingMasks, costs: GrammarCosts) -> None:  # delegates; the base state is unused
        self._inner = inner
        self._costs = costs

    def close(self) -> None:
        self._inner.close()

    def result(self, device: torch.device) -> StepMasks:
        started = time.perf_counter()
        masks = self._inner.result(device)
        with self._costs.lock:
            self._costs.mask_waits_s.append(time.perf_counter() - started)
        return masks


class TimedRunner(ModelRunner):
    """The model runner, measuring the executor's wait for masks after each forward (instrumentation only)."""

    costs: GrammarCosts

    def _start_masks(
        self, sampling: list[ResolvedEntry], drafts: list[Draft], first_row: list[int]
    ) -> PendingMasks | None:
        pending = super()._start_masks(sampling, drafts, first_row)
        return _TimedPendingMasks(pending, self.costs) if pending is not None else None


# ---------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    params: SamplingParams
    constraint: Constraint | None


@dataclass
class Tally:
    """One mode's measurements over every round."""

    name: str
    rates: list[float] = field(default_factory=list)  # output tokens/s of each round, in its steady window
    cpu_s: float = 0.0  # this process's CPU time (every thread) over all rounds: what outside load cannot inflate
    output_tokens: int = 0
    requests: int = 0
    finished_by_stop: int = 0

    @property
    def best(self) -> float:
        """The fastest round: the one least slowed down by whatever else runs on the machine."""
        return max(self.rates)

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def paired_ratio(self, base: Tally) -> float:
        """Median over rounds of this round's rate / the base mode's rate in the same round. Rounds run back to
        back, so a slow spell of the machine hits both sides of a pair: steadier than ratios of best or median."""
        return statistics.median(mine / theirs for mine, theirs in zip(self.rates, base.rates, strict=True))

    def paired_interval(self, base: Tally) -> tuple[float, float, float]:
        """Mean of the per-round ratios against ``base`` and its 95% interval (normal approximation): whether a
        target lies inside it says whether the rounds could tell the two apart on this machine."""
        ratios = [mine / theirs for mine, theirs in zip(self.rates, base.rates, strict=True)]
        mean = statistics.mean(ratios)
        half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
        return mean, mean - half, mean + half

    @property
    def cpu_ms_per_token(self) -> float:
        return 1e3 * self.cpu_s / self.output_tokens


def load_schemas(folder: Path | None, model: Path) -> list[Constraint]:
    """The built-in schemas, or those of ``folder`` that strict mode accepts and xgrammar compiles (both modes serve
    them alike)."""
    texts = [json.dumps(s) for s in BUILTIN_SCHEMAS]
    if folder is not None:
        texts = [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.json"))]
        policy = JsonSchemaPolicy()
        texts = [t for t in texts if policy.apply(json.loads(t)).accepted]
        compiler = ConstraintCompiler.from_model_dir(model, CompilerConfig(json_schema_mode=JsonSchemaMode.STRICT))
        try:
            texts = [t for t in texts if _compiles(compiler, Constraint(ConstraintKind.JSON_SCHEMA, t))]
        finally:
            compiler.shutdown()
        if not texts:
            raise SystemExit(f"no *.json schema in {folder} that strict mode accepts")
    return [Constraint(ConstraintKind.JSON_SCHEMA, text) for text in texts]


def _compiles(compiler: ConstraintCompiler, constraint: Constraint) -> bool:
    try:
        compiler.compile(constraint, timeout_s=600)
    except InvalidGrammarError:
        return False
    return True


def make_jobs(n: int, vocab: int, max_new: int, seed: int) -> list[Job]:
    """Prompts of 16-64 random tokens; seeded sampling so both runs see comparable (not identical) outputs."""
    rng = random.Random(seed)
    return [
        Job(
            tuple(rng.randrange(10, vocab) for _ in range(rng.randint(16, 64))),
            SamplingParams(temperature=0.8, seed=seed * 100_003 + i, max_new_tokens=max_new),
            None,
        )
        for i in range(n)
    ]


def constrain(jobs: list[Job], schemas: Sequence[Constraint]) -> list[Job]:
    return [replace(job, constraint=schemas[i % len(schemas)]) for i, job in enumerate(jobs)]


class SteadyWindow:
    """Output tokens streamed, and the time, while all ``streams`` requests are in flight: from the first submit
    until the last job is submitted (:meth:`close`).

    The drain after the last submit runs below the concurrency asked, and its length is set by the longest outputs
    still running: constrained outputs end earlier and more unevenly (a grammar can terminate), so counting the
    drain would charge the grammar for a tail that is a property of the workload. Tokens are counted as they stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._tokens = 0
        self._closed: tuple[float, int] | None = None  # (seconds, tokens) at the last submit

    def add(self, tokens: int) -> None:
        with self._lock:
            self._tokens += tokens

    def close(self) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = (time.perf_counter() - self._started, self._tokens)

    @property
    def rate(self) -> float:
        """Output tokens per second over the window (closed at the last submit, or now)."""
        self.close()
        assert self._closed is not None
        seconds, tokens = self._closed
        return tokens / seconds


def closed_loop(
    engine: Engine, jobs: Sequence[Job], streams: int, timeout_s: float
) -> tuple[SteadyWindow, list[RequestOutput]]:
    """Keep ``streams`` requests in flight until every job ran; returns the steady window and the final outputs."""
    finished: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    window = SteadyWindow()

    def sink(out: RequestOutput) -> None:
        window.add(len(out.new_token_ids))
        if out.finished:
            finished.put(out)

    pending = list(reversed(jobs))
    finals: list[RequestOutput] = []
    for _ in range(min(streams, len(pending))):
        job = pending.pop()
        engine.submit(job.prompt, job.params, sink, constraint=job.constraint)
    while len(finals) < len(jobs):
        finals.append(finished.get(timeout=timeout_s))
        if pending:
            job = pending.pop()
            engine.submit(job.prompt, job.params, sink, constraint=job.constraint)
            if not pending:
                window.close()
    return window, finals


class Mode:
    """One way of serving the workload: an engine of its own, with its grammar costs recorded."""

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        constrained: bool,
        json_schema_mode: JsonSchemaMode = JsonSchemaMode.CHECKED,
    ) -> None:
        self.constrained = constrained
        self.tally = Tally(name)
        self.costs = GrammarCosts()
        compiler = CompilerConfig(json_schema_mode=json_schema_mode)
        self._grammar = LocalGrammar(str(config.model_path), config=compiler)
        backend = TimedGrammar(self._grammar, self.costs)
        runner = TimedRunner.load(config, backend)
        assert isinstance(runner, TimedRunner)
        runner.costs = self.costs
        self.words = words_per_row(runner.info.vocab_size)
        self.engine = Engine(config, runner=runner, grammar=backend)

    def jobs(self, jobs: list[Job], schemas: Sequence[Constraint]) -> list[Job]:
        return constrain(jobs, schemas) if self.constrained else jobs

    def warm_up(self, jobs: list[Job], streams: int) -> None:
        """Compile every schema and warm the caches; what it costs is not counted."""
        closed_loop(self.engine, jobs, streams, timeout_s=600)
        if not self.engine.wait_idle(60):
            raise RuntimeError(f"{self.tally.name}: the engine did not drain after the warmup")
        self.costs.mask_waits_s.clear()
        self.costs.fill_calls_s.clear()
        self.costs.commit_calls_s.clear()
        self.costs.steps.clear()

    def run_round(self, jobs: list[Job], streams: int) -> None:
        cpu_started = time.process_time()
        window, finals = closed_loop(self.engine, jobs, streams, timeout_s=600)
        self.tally.cpu_s += time.process_time() - cpu_started
        aborted = [o.finish for o in finals if o.finish is not None and o.finish.reason is FinishReason.ABORT]
        if aborted:
            raise RuntimeError(f"{self.tally.name}: {len(aborted)} requests aborted, e.g. {aborted[0]}")
        if not self.engine.wait_idle(60) or self._grammar.num_open != 0:
            raise RuntimeError(f"{self.tally.name}: the engine did not drain, or matchers were left open")
        tokens = sum(o.num_output_tokens for o in finals)
        self.tally.rates.append(window.rate)
        self.tally.output_tokens += tokens
        self.tally.requests += len(finals)
        self.tally.finished_by_stop += sum(
            o.finish is not None and o.finish.reason is FinishReason.STOP for o in finals
        )

    def close(self) -> None:
        self.engine.shutdown()
        self._grammar.shutdown()


# ---------------------------------------------------------------------------------------------- commit replay

REPLAY_REPEATS = 20


@dataclass(frozen=True)
class Walk:
    """An output that follows a schema's grammar; ``stopped``: it ends with the stop token that terminates it."""

    constraint: Constraint
    ids: list[int]
    stopped: bool


def grammar_walks(model: Path, schemas: Sequence[Constraint], count: int, max_tokens: int, seed: int) -> list[Walk]:
    """Outputs that follow each schema's grammar: random walks through a fresh matcher (the allowed tokens of each
    step's mask, whitespace avoided so that the walk moves on, a stop token taken when allowed half the time)."""
    info = load_tokenizer_info(model)
    compiler = ConstraintCompiler(info, CompilerConfig(json_schema_mode=JsonSchemaMode.STRICT))
    rng = random.Random(seed)
    vocab = compiler.vocab_size
    pieces = info.decoded_vocab
    walks = []
    try:
        for i in range(count):
            constraint = schemas[i % len(schemas)]
            matcher = xgr.GrammarMatcher(compiler.compile(constraint, timeout_s=600).grammar)
            stops = set(matcher.stop_token_ids)
            mask = xgr.allocate_token_bitmask(1, vocab)  # [1, W] int32
            ids: list[int] = []
            while len(ids) < max_tokens and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask)
                words = mask[0].numpy().view(np.uint32)  # [W]
                bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1  # [W, 32]
                allowed = [t for t in np.flatnonzero(bits.reshape(-1)).tolist() if t < vocab]
                ending = [t for t in allowed if t in stops]
                moving = [t for t in allowed if t not in stops and pieces[t].strip()] or allowed
                token = rng.choice(ending) if ending and rng.random() < 0.5 else rng.choice(moving)
                assert matcher.accept_token(token)
                ids.append(token)
            walks.append(Walk(constraint, ids, matcher.is_terminated()))
    finally:
        compiler.shutdown()
    return walks


def replay_commits(model: Path, walks: Sequence[Walk], repeats: int) -> dict[str, float]:
    """Microseconds per committed token, per JSON-schema mode: each walk opened, committed one token per call (as
    the scheduler commits a step) and released, in both modes alternately, ``repeats`` times; only the commit calls
    are timed. No model runs: this is the commit's own cost, the output check included, without the noise of a
    forward next to it."""
    modes = (JsonSchemaMode.STRICT, JsonSchemaMode.CHECKED)
    compilers = {m: ConstraintCompiler.from_model_dir(model, CompilerConfig(json_schema_mode=m)) for m in modes}
    registries = {m: GrammarRegistry(compilers[m]) for m in modes}
    spent = dict.fromkeys(modes, 0.0)
    tokens = 0
    try:
        for walk in walks:  # compile outside the timing
            for mode in modes:
                compilers[mode].compile(walk.constraint, timeout_s=600)
        for repeat in range(repeats):
            for mode in modes:
                registry = registries[mode]
                for i, walk in enumerate(walks):
                    rid = f"replay-{repeat}-{i}"
                    registry.open(rid, walk.constraint, timeout_s=600)
                    started = time.perf_counter()
                    for ordinal, token in enumerate(walk.ids):
                        registry.commit([CommitEntry(rid, ordinal, (token,))])
                    spent[mode] += time.perf_counter() - started
                    registry.release([rid])
            tokens += sum(len(walk.ids) for walk in walks)
    finally:
        for compiler in compilers.values():
            compiler.shutdown()
    return {mode.value: 1e6 * spent[mode] / tokens for mode in modes}


def print_replay(per_token_us: dict[str, float], walks: Sequence[Walk], repeats: int) -> None:
    strict, checked = per_token_us["strict"], per_token_us["checked"]
    stopped = sum(walk.stopped for walk in walks)
    print(
        f"\ncommit replay ({len(walks)} grammar walks, {stopped} ending at a stop token, {repeats} repeats, no model): "
        f"strict {strict:.2f} us/token, checked {checked:.2f} us/token ({checked / strict:.2f}x)"
    )


# ---------------------------------------------------------------------------------------------- split services


def process_cpu_s(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


async def grpc_closed_loop(target: str, jobs: Sequence[Job], streams: int) -> tuple[SteadyWindow, int, int]:
    """``streams`` concurrent Generate streams through the scheduler's public API until every job ran.

    Returns (the steady window, output tokens, requests finished by stop)."""
    pending = list(reversed(jobs))
    tokens = stops = 0
    window = SteadyWindow()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)

        async def worker() -> None:
            nonlocal tokens, stops
            while pending:
                job = pending.pop()
                if not pending and len(jobs) > streams:
                    window.close()
                params = pb.SamplingParams(
                    temperature=job.params.temperature, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1,
                    max_new_tokens=job.params.max_new_tokens,
                )  # fmt: skip
                if job.constraint is not None:
                    params.json_schema = job.constraint.text
                request = pb.GenerateRequest(
                    tokenized=pb.TokenizedInput(input_ids=list(job.prompt)), sampling_params=params, stream=True
                )
                async for response in stub.Generate(request, timeout=600):
                    if response.HasField("chunk"):
                        tokens += len(response.chunk.token_ids)
                        window.add(len(response.chunk.token_ids))
                    elif response.HasField("complete"):
                        stops += response.complete.finish_reason == "stop"
                    else:
                        raise RuntimeError(f"request failed: {response}")

        await asyncio.gather(*(worker() for _ in range(streams)))
    return window, tokens, stops


class SplitMode:
    """One way of serving the workload through a spawned stack of services."""

    def __init__(self, name: str, stack: SpawnedStack, constrained: bool) -> None:
        self.tally = Tally(name)
        self.stack = stack
        self.constrained = constrained

    def jobs(self, jobs: list[Job], schemas: Sequence[Constraint]) -> list[Job]:
        return constrain(jobs, schemas) if self.constrained else jobs

    def run_round(self, jobs: list[Job], streams: int) -> None:
        cpu_started = process_cpu_s(self.stack.pids)
        window, tokens, stops = asyncio.run(grpc_closed_loop(self.stack.target, jobs, streams))
        self.tally.cpu_s += process_cpu_s(self.stack.pids) - cpu_started
        self.tally.rates.append(window.rate)
        self.tally.output_tokens += tokens
        self.tally.requests += len(jobs)
        self.tally.finished_by_stop += stops


def run_split(
    args: argparse.Namespace, path: Path, schemas: Sequence[Constraint], jobs: list[Job], warm: list[Job]
) -> None:
    flags = ["--num-pages", "8192", "--max-running", str(max(64, args.streams)), "--chunk-size", "1024"]
    with (
        spawned_stack(path, flags, grammar=True) as overlapped,
        spawned_stack(path, [*flags, "--grammar-overlap", "off"], grammar=True) as early,
    ):
        modes = [
            SplitMode("unconstrained", overlapped, constrained=False),
            SplitMode("constrained, delayed sampling", overlapped, constrained=True),
            SplitMode("constrained, early commit", early, constrained=True),
        ]
        for mode in modes:  # compiles every schema, warms the caches; not counted
            asyncio.run(grpc_closed_loop(mode.stack.target, mode.jobs(warm, schemas), args.streams))
        for _ in range(args.rounds):
            for mode in modes:
                mode.run_round(mode.jobs(jobs, schemas), args.streams)
    print_rates([m.tally for m in modes])
    print(
        f"\n{args.rounds} interleaved rounds per mode at {args.streams} streams through the gRPC services "
        "(grammar service, executor, scheduler: separate processes); ratio: vs unconstrained (paired: median of "
        "per-round ratios). CPU: every service process."
    )
    print_intervals([m.tally for m in modes])


# ---------------------------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


RATE_HEADER = (
    f"{'mode':<31}{'tok/s best':>11}{'ratio':>7}{'tok/s med':>10}{'ratio':>7}{'paired':>8}{'CPU ms/tok':>11}"
    f"{'ratio':>7}{'out/req':>8}{'stop%':>6}"
)


def rate_cells(t: Tally, base: Tally) -> str:
    return (
        f"{t.name:<31}{t.best:>11.1f}{t.best / base.best:>6.2f}x{t.median:>10.1f}{t.median / base.median:>6.2f}x"
        f"{t.paired_ratio(base):>7.2f}x"
        f"{t.cpu_ms_per_token:>11.2f}{t.cpu_ms_per_token / base.cpu_ms_per_token:>6.2f}x"
        f"{t.output_tokens / t.requests:>8.1f}{100 * t.finished_by_stop / t.requests:>5.0f}%"
    )


def print_rates(tallies: Sequence[Tally]) -> None:
    print(RATE_HEADER)
    print("-" * len(RATE_HEADER))
    for t in tallies:
        print(rate_cells(t, tallies[0]))


def print_intervals(tallies: Sequence[Tally], base: Tally | None = None) -> None:
    """One line per mode: the mean per-round ratio against ``base`` (the first mode), with its 95% interval."""
    base = tallies[0] if base is None else base
    print()
    for t in tallies:
        if t is base:
            continue
        mean, low, high = t.paired_interval(base)
        print(
            f"{t.name} vs {base.name}: per-round ratio mean {mean:.3f}, 95% interval {low:.3f}-{high:.3f} "
            f"({len(t.rates)} rounds)"
        )


def print_table(modes: Sequence[Mode], streams: int) -> None:
    base = modes[0].tally
    header = RATE_HEADER + f"{'commit p50/p99 ms':>19}{'wait p50/p99 ms':>17}{'fill p50/p99 ms':>17}"
    header += f"{'reply B/step p50/max':>22}"
    print(header)
    print("-" * len(header))
    for mode in modes:
        c = mode.costs
        commits = waits = fills = reply = "-"
        if c.mask_waits_s:
            commits = f"{percentile(c.commit_calls_s, 0.5) * 1e3:.3f}/{percentile(c.commit_calls_s, 0.99) * 1e3:.3f}"
            waits = f"{percentile(c.mask_waits_s, 0.5) * 1e3:.2f}/{percentile(c.mask_waits_s, 0.99) * 1e3:.2f}"
            fills = f"{percentile(c.fill_calls_s, 0.5) * 1e3:.2f}/{percentile(c.fill_calls_s, 0.99) * 1e3:.2f}"
            sizes = c.reply_bytes()
            reply = f"{statistics.median(sizes):.0f}/{max(sizes)}"
        print(f"{rate_cells(mode.tally, base)}{commits:>19}{waits:>17}{fills:>17}{reply:>22}")
    rows = [len(answers) for answers in modes[1].costs.replies()]
    print(
        f"\n{len(base.rates)} interleaved rounds per mode at {streams} streams; tok/s: output tokens while all "
        f"{streams} streams are busy (first to last submit); ratio: vs unconstrained (paired: "
        "median of per-round ratios). CPU: this process, all threads (grammar work competes with a CPU forward for "
        "the same cores). commit: the scheduler's grammar commit call of a step (checked mode's output check runs "
        "there); wait: the executor blocked on masks after the forward; fill: from the opening of a step's "
        "mask fence (before its forward) until all its rows were written, by the commit that let them through or "
        "after the forward. Constrained rows per mask step: median "
        f"{statistics.median(rows):.0f}, max {max(rows)}; a mask row is {modes[0].words} int32 words "
        f"({modes[0].words * 4} B) for this vocabulary."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF folder; default: the embedded model")
    parser.add_argument("--streams", type=int, default=32, help="requests in flight at all times")
    parser.add_argument("--requests", type=int, default=96, help="requests per mode and round")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--schemas", type=Path, default=None, help="a folder of *.json schemas to cycle through")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per mode, interleaved; default 24 in process, 9 with --split (one round's ratio varies by about "
        "+-0.07 on a shared 2-core machine; 24 rounds, about 6 minutes there, narrow the mean's 95%% interval to "
        "about +-0.03)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", action="store_true", help="through the gRPC services, each its own process")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 9 if args.split else 24
    path = args.model or ensure_embedded_model()
    base = EngineConfig(model_path=str(path), num_pages=8192, max_running=max(64, args.streams), chunk_size=1024)
    from engine.model.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(path).vocab_size
    schemas = load_schemas(args.schemas, path)
    jobs = make_jobs(args.requests, vocab, args.max_new, args.seed)
    warm = make_jobs(len(schemas), vocab, 4, args.seed + 1)
    print(
        f"{args.requests} requests per mode and round, {args.streams} streams, up to {args.max_new} tokens each, "
        f"{len(schemas)} schemas, torch threads {torch.get_num_threads()}\n"
    )
    if args.split:
        run_split(args, path, schemas, jobs, warm)
        return
    modes = [
        Mode("unconstrained", base, constrained=False),
        Mode("constrained, strict", base, constrained=True, json_schema_mode=JsonSchemaMode.STRICT),
        Mode("constrained, checked", base, constrained=True),
        Mode("constrained, early commit", replace(base, grammar_overlap=False), constrained=True),
    ]
    try:
        for mode in modes:
            mode.warm_up(mode.jobs(warm, schemas), args.streams)
        for _ in range(args.rounds):  # interleaved, so that load from outside hits every mode alike
            for mode in modes:
                mode.run_round(mode.jobs(jobs, schemas), args.streams)
    finally:
        for mode in modes:
            mode.close()
    print_table(modes, args.streams)
    print_intervals([mode.tally for mode in modes])
    print_intervals([modes[1].tally, modes[2].tally])  # checked against strict: the output check's cost
    # Long enough walks that most end at a stop token, where checked mode validates the whole output.
    walks = grammar_walks(path, schemas, max(args.requests, len(schemas)), 256, args.seed)
    print_replay(replay_commits(path, walks, REPLAY_REPEATS), walks, REPLAY_REPEATS)


if __name__ == "__main__":
    main()
