"""Aborts against every interleaving of launches and results: a hypothesis state machine over the gated split engine.

The gate holds every launch and every result; the machine submits greedy requests (chunked prompts, some sharing
prefixes so the prefix cache is hit, about 40% constrained by a grammar that terminates within a few tokens, their
masks fetched by the executor at the fence), aborts them (mid-stream, before their first token, twice, after they
finished, or ids nobody knows) and lets launches and results through one at a time, a few at a time or in bursts,
in whatever order hypothesis picks. After every step it checks:

- no token reaches a stream, and no commit reaches a request's grammar, from a result that passed the gate after
  the request's abort (C7); no step planned after the abort was recorded names the request (C8) (both bounds as in
  :class:`tests.contract.gated_stack.AbortMark`);
- every stream is a prefix of the request's solo greedy output, ends at most once, and a request that was not
  aborted (or whose abort came after its finish) ends exactly as its solo run did (tokens and finish reason);
- the scheduler's accounting holds: slots in use + free = total, reservations never exceed free + evictable pages
  (read from the snapshot the loop publishes), the prefix cache's invariants hold (the loop checks them itself after
  every scheduler event: ``EngineConfig.check_invariants``), executor buffers never exceed the slots;

and at the end of every example, after releasing everything and draining: each constrained request's grammar saw
exactly its streamed tokens, each commit from the ordinal the ones before it reached, starting at 0 (C1; a speculative
step commits its whole accepted run at once), and free KV pages, slots, reservations, executor buffers and open
matchers are back at their baseline (C9). The test then asserts that the examples reached
every kind of ending (finished, aborted mid-stream, aborted before any token, constrained or not), so a strategy
that stops producing the interesting orders fails instead of passing vacuously.

Each check was shown to fail by removing an enforcement on a throwaway copy: without `self._drain_inbox()` in
`Engine._commit` the machine finds a token streamed from a result released after the abort (C7); without
`if req.finishing: return None, 0` in `Scheduler._plan_running` it finds a step planned after an abort (C8); without
`if req.finishing: continue` in `Scheduler.commit` the engine loop crashes on a dropped result it commits anyway.
Hypothesis then reports the failure wrapped as flaky: the system under test is concurrent, so a replay may fail at
a later step than the original run; the assertion message is the real one.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.config import EngineConfig, SpecAlgorithm, SpeculativeConfig
from engine.constraint import Constraint, ConstraintKind
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause, FinishReason
from engine.grammar.backend import LocalGrammar
from engine.scheduler.engine import Engine
from tests.contract.gated_stack import (
    WAIT_S,
    AbortMark,
    Baseline,
    EngineEvents,
    GrammarProbe,
    Stream,
    assert_back_to,
    baseline,
    gated_engine,
    greedy,
    mark_abort,
    steps_naming,
)
from tests.support.gate import StepGate, any_step
from tests.support.servers import ExecutorThread

PAGE = 4
MAX_NEW = 5
MAX_REQUESTS = 8  # per example
PICK = st.integers(0, 63)  # which request of a pool, modulo its size
_rng = random.Random(12)
_SHARED = [_rng.randrange(10, 2000) for _ in range(12)]


def _tail(n: int) -> list[int]:
    return [_rng.randrange(10, 2000) for _ in range(n)]


# Chunk size 8: prompts of up to 20 tokens take up to three chunks; the first three share 8 or 12 tokens.
PROMPTS: tuple[tuple[int, ...], ...] = (
    tuple(_SHARED + _tail(3)),
    tuple(_SHARED + _tail(6)),
    tuple(_SHARED[:8] + _tail(2)),
    tuple(_tail(20)),
    tuple(_tail(5)),
    tuple(_tail(2)),
)
# None, or a grammar that terminates within a few tokens (the request then ends with a stop, C6).
CONSTRAINTS: tuple[Constraint | None, ...] = (
    None,
    Constraint(ConstraintKind.REGEX, "(yes|no|maybe)"),
    Constraint(ConstraintKind.REGEX, "[a-z]{8}-[0-9]{4}"),
)
MAX_NEWS = (2, MAX_NEW)
Key = tuple[int, int, int]  # prompt, max_new, constraint (indices into the tables above; max_new itself)


@dataclass(frozen=True)
class Solo:
    """A request's output when it runs alone, and how it ended."""

    tokens: tuple[int, ...]
    reason: FinishReason


@dataclass
class MachineStack:
    """What every example of the machine shares: one engine behind one gate (reused, so state that leaks from one
    example into the next is caught too), the solo outputs, and the drained baseline."""

    engine: Engine
    gate: StepGate
    grammar: GrammarProbe
    events: EngineEvents
    solo: dict[Key, Solo]
    base: Baseline
    examples: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)


@pytest.fixture(scope="module", params=["plain", "speculative"])
def stack(request: pytest.FixtureRequest, embedded_model_dir: Path) -> Iterator[MachineStack]:
    # Speculative: the target drafts for itself, so every decode step returns a run of up to three tokens (fewer where
    # the draft, unsure of a token, ends its chain there: the default draft_min_prob).
    spec = SpeculativeConfig(SpecAlgorithm.DRAFT, str(embedded_model_dir), num_steps=2, adaptive=False)
    config = EngineConfig(
        model_path=str(embedded_model_dir),
        page_size=PAGE,
        num_pages=96,
        max_running=3,
        chunk_size=8,
        grammar_wait_s=WAIT_S,
        check_invariants=True,  # the prefix cache's invariants, checked by the loop after every scheduler event
        speculative=spec if request.param == "speculative" else SpeculativeConfig(),
    )
    local = LocalGrammar(str(embedded_model_dir))  # one registry: the scheduler commits, the executor fetches masks
    runner = ModelRunner.load(config, local)
    server = ExecutorThread(runner)
    grammar = GrammarProbe(local)
    events = EngineEvents()
    try:
        with gated_engine(f"127.0.0.1:{server.port}", config, grammar=grammar, observer=events) as (engine, gate):
            yield MachineStack(engine, gate, grammar, events, _solo_table(engine), baseline(engine, gate))
    finally:
        server.stop()
        runner.shutdown()
        local.shutdown()


def _solo_table(engine: Engine) -> dict[Key, Solo]:
    """Every (prompt, max_new, constraint) the machine can submit, run alone."""
    table = {}
    for key in itertools.product(range(len(PROMPTS)), MAX_NEWS, range(len(CONSTRAINTS))):
        prompt, max_new, constraint = key
        (out,) = engine.generate_batch([PROMPTS[prompt]], [greedy(max_new)], WAIT_S, [CONSTRAINTS[constraint]])
        assert out.finish is not None and out.finish.reason is not FinishReason.ABORT, out
        table[key] = Solo(tuple(out.output_ids or ()), out.finish.reason)
    return table


class AbortMachine(RuleBasedStateMachine):
    stack: ClassVar[MachineStack]

    def __init__(self) -> None:
        super().__init__()
        self.s = type(self).stack
        self.s.examples += 1
        self.prefix = f"x{self.s.examples}"
        self.streams: dict[str, Stream] = {}
        self.key: dict[str, Key] = {}
        self.marks: dict[str, AbortMark] = {}
        self._hold()

    def _hold(self) -> None:
        self.s.gate.hold_launches(any_step())
        self.s.gate.hold_results(any_step())

    # ------------------------------------------------------------------------------------ rules
    # Draws never depend on timing (which requests streamed or finished by now), only their mapping onto requests
    # does, so that hypothesis replays a failing example with the same data.

    @precondition(lambda self: len(self.streams) < MAX_REQUESTS)
    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        max_new=st.sampled_from(MAX_NEWS),
        constraint=st.sampled_from([0, 0, 0, 1, 2]),  # about 40% constrained
    )
    def submit(self, prompt: int, max_new: int, constraint: int) -> None:
        rid = f"{self.prefix}-{len(self.streams)}"
        stream = Stream(rid)
        self.s.engine.submit(PROMPTS[prompt], greedy(max_new), stream.sink, rid, CONSTRAINTS[constraint])
        self.streams[rid], self.key[rid] = stream, (prompt, max_new, constraint)

    @initialize(prompts=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=2, max_size=4))
    def start(self, prompts: list[int]) -> None:
        for i, prompt in enumerate(prompts):
            # Whatever the draws, every example starts with an unconstrained and two constrained requests with room
            # to stream (the first grammar can end them by a stop, the second by length), and a short one.
            self.submit(prompt, MAX_NEW if i < len(CONSTRAINTS) else 2, i % len(CONSTRAINTS))

    @rule(kind=st.sampled_from(["mid-stream", "mid-stream", "no token yet", "finished", "unknown"]), pick=PICK)
    def abort(self, kind: str, pick: int) -> None:
        """Abort a request that has streamed tokens, one that has not yet, one that finished, or an unknown id
        (falling back to any request when there is none of the kind drawn)."""
        if kind == "unknown":
            assert not self.s.engine.abort(f"{self.prefix}-nobody")
            return
        pools = {
            "mid-stream": [r for r, s in self.streams.items() if not s.finished and s.tokens],
            "no token yet": [r for r, s in self.streams.items() if not s.finished and not s.tokens],
            "finished": [r for r, s in self.streams.items() if s.finished],
        }
        pool = sorted(pools[kind] or self.streams)
        rid = pool[pick % len(pool)]
        mark = mark_abort(self.s.engine, self.s.gate, rid)
        if mark.live:
            self.marks.setdefault(rid, mark)  # the first abort that found it live binds (a second one is a no-op)
        else:
            assert self.streams[rid].finished, f"abort({rid}) found it gone before it finished"

    @rule(pick=PICK)
    def abort_in_flight(self, pick: int) -> None:
        """The same, for a live request (aborts are the point of the machine: they get two rules' weight)."""
        streaming = any(s.tokens for s in self.streams.values() if not s.finished)
        self.abort("mid-stream" if streaming else "no token yet", pick)

    @rule()
    def release_result(self) -> None:
        """Let the next result through, if a step is running or done at the executor (its reply will come)."""
        trace = self.s.gate.trace()
        sent = sum(ev.kind == "plan" for ev in trace)
        answered = sum(ev.kind in ("result", "error") for ev in trace)
        if sent > answered:
            step = self.s.gate.release_next_result(WAIT_S)
            # Not needed for the checks (they hold in any order); it keeps the rules in step with the engine, so
            # that "a request that streamed tokens" means the same thing when an example is replayed.
            self.s.events.wait_committed(step.step_id)

    @rule()
    def release_launch(self) -> None:
        """Let the next launch through, if the scheduler planned a step the executor has not been sent."""
        sent = sum(ev.kind == "plan" for ev in self.s.gate.trace())
        if self.s.engine.stats().steps > sent:
            self.s.gate.release_next_launch(WAIT_S)

    @rule(steps=st.integers(1, 4))
    def advance(self, steps: int) -> None:
        """A few steps in launch-then-result order, so that requests get far enough to be aborted mid-stream."""
        for _ in range(steps):
            self.release_launch()
            self.release_result()

    @rule()
    def burst(self) -> None:
        """Everything held or queued goes now; holding resumes for what comes after."""
        self.s.gate.release_all()
        self._hold()

    # ------------------------------------------------------------------------------------ invariants

    @invariant()
    def aborts_are_honoured(self) -> None:
        for rid, mark in self.marks.items():
            tokens = self.streams[rid].tokens
            assert len(tokens) <= mark.max_tokens, f"C7: {rid} streamed {tokens} after its abort ({mark})"
            late = [s for s in steps_naming(self.s.gate, rid) if s > mark.last_planned + 1]
            assert not late, f"C8: {rid} planned into steps {late} after its abort ({mark})"
            grammar = [o for o, _ in self.s.grammar.committed(rid) if o >= mark.max_tokens]
            assert not grammar, f"C7: {rid}'s grammar got commits from ordinals {grammar} after its abort ({mark})"

    @invariant()
    def streams_follow_their_solo_outputs(self) -> None:
        for rid, stream in self.streams.items():
            with stream.cond:
                outputs = list(stream.outputs)
            tokens = tuple(t for out in outputs for t in out.new_token_ids)
            solo = self.s.solo[self.key[rid]]
            assert tokens == solo.tokens[: len(tokens)], f"{rid}: streamed {tokens}, solo {solo}"
            finishes = [i for i, out in enumerate(outputs) if out.finished]
            assert finishes in ([], [len(outputs) - 1]), f"{rid}: output after its finish or two finishes: {outputs}"
            if not finishes:
                continue
            finish = outputs[-1].finish
            assert finish is not None
            if finish.reason is FinishReason.ABORT:
                assert rid in self.marks and finish.cause is AbortCause.CLIENT, (rid, finish)
            else:  # not aborted, or aborted after its finish was committed: exactly the solo run
                assert (finish.reason, tokens) == (solo.reason, solo.tokens), (rid, finish, tokens, solo)

    @invariant()
    def accounting_holds(self) -> None:
        s = self.s.engine.stats()  # one consistent snapshot, published by the loop thread
        assert s.free_slots + s.num_running == s.total_slots, s
        assert 0 <= s.reserved_pages <= s.free_pages + s.evictable_pages, s
        assert s.free_pages + s.evictable_pages + s.used_pages == s.total_pages, s
        assert self.s.gate.executor_state().buffers <= s.total_slots

    # ------------------------------------------------------------------------------------ end of an example

    def teardown(self) -> None:
        self.s.gate.release_all()
        for stream in self.streams.values():
            stream.wait_final()
        self.streams_follow_their_solo_outputs()
        self.aborts_are_honoured()
        for rid, stream in self.streams.items():
            finish = stream.outputs[-1].finish
            assert finish is not None
            committed = self.s.grammar.committed(rid)
            if CONSTRAINTS[self.key[rid][2]] is not None:  # C1: the grammar moved exactly with the output
                reached = list(itertools.accumulate((len(toks) for _, toks in committed[:-1]), initial=0))
                assert [o for o, _ in committed] == reached[: len(committed)], committed
                assert [t for _, toks in committed for t in toks] == stream.tokens, (rid, committed, stream.tokens)
            else:
                assert committed == [], committed
            constrained = "constrained " if CONSTRAINTS[self.key[rid][2]] is not None else ""
            self.s.outcomes[constrained + _outcome(finish.reason, len(stream.tokens))] += 1
        assert_back_to(self.s.base, self.s.engine, self.s.gate)


def _outcome(reason: FinishReason, tokens: int) -> str:
    if reason is not FinishReason.ABORT:
        return reason.value
    return "abort before any token" if tokens == 0 else "abort mid-stream"


def test_abort_interleavings(stack: MachineStack) -> None:
    AbortMachine.stack = stack
    run_state_machine_as_test(
        AbortMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # The machine must reach the interesting orders, not only submit-and-finish: a weaker strategy fails here.
    print(f"abort interleavings: {stack.examples} examples, outcomes {dict(stack.outcomes)}")
    wanted = (
        "length",
        "abort mid-stream",
        "abort before any token",
        "constrained stop",
        "constrained abort mid-stream",
    )
    assert all(stack.outcomes[k] >= 3 for k in wanted), stack.outcomes
