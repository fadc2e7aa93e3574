"""Grammar ordering contracts on the engine's scheduler side (C1-C5), tested with real engine pieces.

A real :class:`ModelRunner` (embedded model, real xgrammar through :class:`LocalGrammar`), a real
:class:`Scheduler` and a real :class:`GrammarRegistry`; the test drives them by hand and plays the misbehaving
peer: a scheduler that skips the early commit, a step result from the wrong ordinal, a second writer, a mask
request for another version. The receiving side must refuse cleanly and never answer with wrong data.

Each test's docstring names the enforcement whose removal makes it fail; every one was checked once by making
that change on a throwaway copy of the repository and running the test.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.errors import ProtocolError
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause, FinishReason
from engine.grammar.backend import LocalGrammar
from engine.grammar.compiler import load_tokenizer_info
from engine.grammar.json_schema_compiler import DEFAULT_JSON_MAX_WHITESPACE
from engine.grammar.registry import GrammarRegistry
from engine.grammar_calls import CommitEntry, CommitOutcome, DraftTree, MaskEntry, MaskRefusals, Refusal
from engine.model.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.scheduler.request import Request, RequestOutput
from engine.scheduler.scheduler import CommitOutcome as SchedulerOutcome
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.stop import StopChecker
from engine.step import SampledRun, StepPlan, StepResult
from tests.support.grammar_doubles import DelegatingGrammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
VALID_JSON = '{"name": "ab", "age": 12}'
WAIT_S = 10.0  # every wait in these tests is bounded by this
FENCE_S = 5.0  # how long an overlapped executor waits at the fence: long enough that a wait would show


def _schema() -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({**SCHEMA, "required": ["name", "age"]}))


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


@pytest.fixture(scope="module")
def grammar(embedded_model_dir: Path) -> Iterator[LocalGrammar]:
    local = LocalGrammar(str(embedded_model_dir))
    yield local
    local.shutdown()


@pytest.fixture(scope="module")
def valid_tokens(tokenizer: Tokenizer) -> list[int]:
    """A complete output for the schema: its JSON text, then an end-of-sequence token."""
    return [*tokenizer.encode(VALID_JSON), min(tokenizer.eos_token_ids)]


@pytest.fixture(autouse=True)
def no_matcher_outlives_its_test(grammar: LocalGrammar) -> Iterator[None]:
    before = grammar.num_open  # not 0 only after an earlier test failed: judge each test on its own
    yield
    assert grammar.num_open == before and grammar.registry.num_waiting == 0


def _config(model_dir: Path, grammar_overlap: bool) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_dir),
        page_size=8,
        num_pages=64,
        max_running=4,
        chunk_size=64,
        grammar_overlap=grammar_overlap,
        grammar_wait_s=FENCE_S,
    )


def _request(rid: str, tokenizer: Tokenizer, constraint: Constraint | None, max_new: int = 16) -> Request:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    prompt = tuple(tokenizer.encode("Give me JSON about a person:"))
    checker = StopChecker(params, tokenizer.eos_token_ids, tokenizer)
    return Request(rid, prompt, params, checker, seed=0, constraint=constraint)


def _add_constrained(scheduler: Scheduler, grammar: LocalGrammar, req: Request) -> None:
    assert req.constraint is not None
    grammar.open(req.request_id, req.constraint)
    scheduler.add(req)


def _grammar_at(grammar: LocalGrammar, rid: str, ordinal: int) -> bool:
    """True when the grammar of ``rid`` answers a mask at exactly ``ordinal`` (it is at that version)."""
    return grammar.registry.poll_masks([MaskEntry(rid, ordinal)])[0].rows is not None


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def _plan(scheduler: Scheduler) -> StepPlan:
    plan = scheduler.plan()
    assert plan is not None
    return plan


def _released(grammar: LocalGrammar, outcome: SchedulerOutcome) -> SchedulerOutcome:
    """Release the matchers a scheduler event finished with, as the engine loop does."""
    if outcome.released_grammars:
        grammar.release(outcome.released_grammars)
    return outcome


def _commit(scheduler: Scheduler, grammar: LocalGrammar, result: StepResult) -> SchedulerOutcome:
    """Both phases of a commit with the grammar's commit between them, as `Engine._commit` does."""
    pending = scheduler.commit(result)
    answers = grammar.commit(pending.grammar) if pending.grammar else []
    return _released(grammar, scheduler.finish_commit(pending, answers))


def _finish_all(scheduler: Scheduler, grammar: LocalGrammar, runner: ModelRunner, rids: Sequence[str]) -> None:
    """Abort what is left and give every slot back to the runner (nothing is in flight any more)."""
    slots: list[int] = []
    for rid in rids:
        slots.extend(_released(grammar, scheduler.abort(rid)).released_slots)
    if slots:
        runner.release(slots).result(WAIT_S)
    assert scheduler.idle and runner.num_buffers == 0


@pytest.fixture
def sync_pair(embedded_model_dir: Path, grammar: LocalGrammar) -> Iterator[tuple[Scheduler, ModelRunner]]:
    """Grammar-sync mode (``grammar_overlap=False``): the executor does not wait at the fence at all."""
    config = _config(embedded_model_dir, grammar_overlap=False)
    runner = ModelRunner.load(config, grammar)
    yield Scheduler(config), runner
    runner.shutdown()


@pytest.fixture
def overlap_pair(embedded_model_dir: Path, grammar: LocalGrammar) -> Iterator[tuple[Scheduler, ModelRunner]]:
    config = _config(embedded_model_dir, grammar_overlap=True)
    runner = ModelRunner.load(config, grammar)
    yield Scheduler(config), runner
    runner.shutdown()


# ------------------------------------------------------------------------------------------------ C4


def test_a_skipped_early_commit_is_refused_at_the_fence_at_once(
    sync_pair: tuple[Scheduler, ModelRunner], grammar: LocalGrammar, tokenizer: Tokenizer
) -> None:
    """C4/C3, seed 000: in grammar-sync mode a scheduler launches step N+1 without committing step N. The
    executor must not wait (it was told the scheduler commits early) and must not sample from the mask of the
    version before: N+1's constrained row comes back at once with an error naming the fence, and the scheduler
    ends that request with a grammar abort that keeps nothing of N+1.

    Fails if ``error=masks.errors.get(i)`` is removed from ``ModelRunner._sample`` (the row comes back as a token
    sampled without its mask), if ``EngineConfig.mask_wait_s`` ignores ``grammar_overlap`` (the executor waits the
    full 5 s fence deadline), or if the version check is removed from both places that make it, the fence's cheap
    ``behind`` filter in ``MaskFence._poll`` and ``if here < at_ordinal: return Refusal.BEHIND, ...`` in
    ``VersionedMatcher._mask_refusal`` (the mask for ordinal 1 is computed from ordinal 0 and the row is "fine";
    with either one left the other still refuses it, so removing one alone passes, and the locked check alone is
    caught by tests/unit/test_grammar_matcher.py's race with a hook): checked once each."""
    scheduler, runner = sync_pair
    req = _request("skip", tokenizer, _schema())
    _add_constrained(scheduler, grammar, req)
    p1 = _plan(scheduler)
    f1 = runner.launch(p1)
    p2 = _plan(scheduler)  # the misbehaviour: N is not committed before N+1 is launched
    assert p2.entries[0].constrained and p2.entries[0].ordinal == 0 and p2.entries[0].input_ref
    f2 = runner.launch(p2)
    r1 = f1.result(WAIT_S)
    seen_n = time.monotonic()
    r2 = f2.result(WAIT_S)
    assert time.monotonic() - seen_n < FENCE_S / 5  # no wait at the fence
    assert r1.runs[0].error is None
    refused = r2.runs[0]
    assert refused.ordinal == 1 and refused.error is not None
    assert "behind_deadline" in refused.error and "fence" in refused.error, refused.error
    assert _grammar_at(grammar, "skip", 0)  # nothing reached the grammar out of order

    first = _commit(scheduler, grammar, r1)
    assert [o.new_token_ids for o in first.outputs] == [r1.runs[0].token_ids]
    second = _commit(scheduler, grammar, r2)
    (end,) = second.outputs
    assert end.finish is not None and end.finish.reason is FinishReason.ABORT
    assert end.finish.cause is AbortCause.GRAMMAR and end.new_token_ids == () and end.output_ids == r1.runs[0].token_ids
    runner.release(second.released_slots).result(WAIT_S)
    _finish_all(scheduler, grammar, runner, [])


def test_with_the_early_commit_the_same_steps_succeed(
    sync_pair: tuple[Scheduler, ModelRunner], grammar: LocalGrammar, tokenizer: Tokenizer
) -> None:
    """C4 (the correct peer): commit N, then plan and launch N+1: its row is sampled under the mask at ordinal 1
    and the grammar accepts it. Fails if `Scheduler.commit` asks the grammar to commit nothing (the mask for
    ordinal 1 is refused): checked once by making its `grammar` list empty."""
    scheduler, runner = sync_pair
    req = _request("early", tokenizer, _schema())
    _add_constrained(scheduler, grammar, req)
    for ordinal in range(3):
        plan = _plan(scheduler)
        result = runner.launch(plan).result(WAIT_S)
        assert result.runs[0].ordinal == ordinal and result.runs[0].error is None
        out = _commit(scheduler, grammar, result)
        assert out.outputs[0].finish is None and _grammar_at(grammar, "early", ordinal + 1)
    assert len(req.output_ids) == 3
    _finish_all(scheduler, grammar, runner, ["early"])


def test_overlapped_the_skipped_commit_is_waited_for_at_the_fence(
    overlap_pair: tuple[Scheduler, ModelRunner], grammar: LocalGrammar, tokenizer: Tokenizer
) -> None:
    """C4/C3 with ``grammar_overlap``: N+1 is launched before N is committed (the normal overlap loop). The
    executor runs N+1's forward and waits at the fence for N's commit instead of sampling from a stale mask; the
    commit arrives from another thread and N+1 is then sampled under the mask at ordinal 1.

    Fails if the fence stops waiting (checked once by making ``GrammarRegistry.fill_masks`` return
    ``fence.outcomes()`` instead of calling ``wait_for_change``: N+1 never waits at the fence, its row errs
    BEHIND_DEADLINE), or if ``EngineConfig.mask_wait_s`` returns 0 (the same)."""
    scheduler, runner = overlap_pair
    req = _request("fenced", tokenizer, _schema())
    _add_constrained(scheduler, grammar, req)
    p1 = _plan(scheduler)
    f1 = runner.launch(p1)
    p2 = _plan(scheduler)
    f2 = runner.launch(p2)
    r1 = f1.result(WAIT_S)
    _wait_until(lambda: grammar.registry.num_waiting == 1, "step N+1's mask waits at the fence")
    assert not f2.done()  # sampling of N+1 is held back; nothing was sampled from the version before
    committed: list[RequestOutput] = []
    committer = threading.Thread(target=lambda: committed.extend(_commit(scheduler, grammar, r1).outputs))
    committer.start()
    r2 = f2.result(WAIT_S)
    committer.join(WAIT_S)
    assert [o.new_token_ids for o in committed] == [r1.runs[0].token_ids]
    assert r2.runs[0].ordinal == 1 and r2.runs[0].error is None
    out = _commit(scheduler, grammar, r2)
    assert out.outputs[0].finish is None  # the grammar accepted the token sampled under the fenced mask
    assert req.output_ids == [*r1.runs[0].token_ids, *r2.runs[0].token_ids]
    _finish_all(scheduler, grammar, runner, ["fenced"])


def test_the_fence_opens_before_the_forward_begins(
    overlap_pair: tuple[Scheduler, ModelRunner], grammar: LocalGrammar, tokenizer: Tokenizer
) -> None:
    """C4 from the step's own record: with delayed sampling the executor asks for a constrained step's fenced masks
    before its forward begins, so the wait for the previous step's commit overlaps the forward. Step N+1 is launched
    before N is committed (its mask then waits at the fence for N's commit); its StepTiming says the masks were
    asked before the forward started.

    Fails if `ModelRunner.execute` starts the masks after the forward (the overlap of the mask wait is lost):
    `masks_started` is then after `forward_done` (checked once by moving the call)."""
    scheduler, runner = overlap_pair
    req = _request("timed", tokenizer, _schema())
    _add_constrained(scheduler, grammar, req)
    f1 = runner.launch(_plan(scheduler))
    f2 = runner.launch(_plan(scheduler))
    r1 = f1.result(WAIT_S)
    _wait_until(lambda: grammar.registry.num_waiting == 1, "step N+1's mask waits at the fence")
    _commit(scheduler, grammar, r1)
    r2 = f2.result(WAIT_S)
    timing = r2.timing
    assert timing.masks_started is not None and r1.timing.masks_started is not None
    assert timing.masks_started <= timing.forward_started < timing.forward_done <= timing.done, timing
    assert timing.masks_ready is not None and timing.forward_done <= timing.masks_ready <= timing.done, timing
    assert timing.forward_cpu > 0
    _commit(scheduler, grammar, r2)
    _finish_all(scheduler, grammar, runner, ["timed"])


# ------------------------------------------------------------------------------------------------ C3, C5


@pytest.fixture
def registry(grammar: LocalGrammar) -> GrammarRegistry:
    return grammar.registry


@pytest.fixture(scope="module")
def fresh(embedded_model_dir: Path) -> Callable[[Sequence[int]], torch.Tensor]:
    """The reference: the schema's mask after ``tokens`` from a matcher built here, outside the registry."""
    compiled = xgr.GrammarCompiler(load_tokenizer_info(embedded_model_dir)).compile_json_schema(
        _schema().text,
        max_whitespace_cnt=DEFAULT_JSON_MAX_WHITESPACE,  # as the registry's compiler does
    )

    def mask_after(tokens: Sequence[int]) -> torch.Tensor:
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokens:
            assert matcher.accept_token(token)
        row = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # [1, W]
        matcher.fill_next_token_bitmask(row)
        return row[0]

    return mask_after


def test_a_mask_is_only_answered_at_its_own_version(
    registry: GrammarRegistry, valid_tokens: list[int], fresh: Callable[[Sequence[int]], torch.Tensor]
) -> None:
    """C3: after committing k tokens, a mask for ordinal k - 1 (ahead: the peer's view is stale) is refused at
    once, one for k + 1 (behind) fails at its deadline, one for k equals the reference mask after those k tokens.

    Fails if ``if here > at_ordinal: return Refusal.AHEAD, ...`` is removed from ``VersionedMatcher._mask_refusal``
    (the mask for k - 1 is answered from version k): checked once."""
    k = 3
    registry.open("versions", _schema(), WAIT_S)
    (done,) = registry.commit([CommitEntry("versions", 0, tuple(valid_tokens[:k]))])
    assert done.result is not None and done.result.new_ordinal == k
    started = time.monotonic()
    ahead, behind, here = registry.fill_masks(
        [MaskEntry("versions", k - 1), MaskEntry("versions", k + 1), MaskEntry("versions", k)], 0.2
    )
    assert ahead.rows is None and ahead.refusal is Refusal.AHEAD
    assert behind.rows is None and behind.refusal is Refusal.BEHIND_DEADLINE
    assert here.rows is not None and torch.equal(here.rows.words[0], fresh(valid_tokens[:k]))
    (alone,) = registry.fill_masks([MaskEntry("versions", k - 1)], FENCE_S)
    assert alone.refusal is Refusal.AHEAD and time.monotonic() - started < FENCE_S / 2  # ahead never waits
    registry.release(["versions"])
    (gone,) = registry.fill_masks([MaskEntry("versions", k)], FENCE_S)
    assert gone.refusal is Refusal.RELEASED


def test_draft_tree_masks_leave_the_committed_state_unchanged(
    registry: GrammarRegistry, valid_tokens: list[int], fresh: Callable[[Sequence[int]], torch.Tensor]
) -> None:
    """C5: masks for a draft tree (a valid chain of 3 and a refused sibling) are each the reference mask after
    their path, and afterwards the committed version is exactly as before: same ordinal, same mask, and the next
    real commit from it is accepted.

    Fails if the traversal does not roll back: checked once by replacing ``traverse_draft_tree`` in
    ``VersionedMatcher.fill_draft_masks`` with a loop that fills each row and accepts the chain's tokens without
    rollback (the committed mask then differs, and the commit is refused)."""
    k = 2
    registry.open("draft", _schema(), WAIT_S)
    registry.commit([CommitEntry("draft", 0, tuple(valid_tokens[:k]))])
    (before,) = registry.poll_masks([MaskEntry("draft", k)])
    assert before.rows is not None
    chain = valid_tokens[k : k + 3]
    refused = min(tokens_outside(before.rows.words[0]))
    tree = DraftTree((*chain, refused), (-1, 0, 1, -1))
    (drafted,) = registry.fill_masks([MaskEntry("draft", k, tree)], 0.0)
    assert drafted.rows is not None
    rows = drafted.rows.words  # [5, W]: committed state, then after each node's path
    for i in range(len(chain)):
        assert torch.equal(rows[i + 1], fresh(valid_tokens[: k + i + 1])), i
    assert not rows[4].any()  # a refused node has no continuation
    (after,) = registry.poll_masks([MaskEntry("draft", k)])
    assert after.rows is not None and torch.equal(after.rows.words, before.rows.words)
    assert torch.equal(rows[0], before.rows.words[0])
    (commit,) = registry.commit([CommitEntry("draft", k, (chain[0],))])
    assert commit.result is not None and commit.result.accepted == 1 and commit.result.new_ordinal == k + 1
    registry.release(["draft"])


def tokens_outside(row: torch.Tensor) -> list[int]:
    """Token ids whose bit is clear in a mask row (int32 words, xgrammar layout)."""
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return torch.nonzero(bits.flatten() == 0).flatten().tolist()


# ------------------------------------------------------------------------------------------------ C1, C2


def _forged(plan: StepPlan, tokens: dict[str, int], ordinal_shift: dict[str, int]) -> StepResult:
    """One token per sampling entry at the ordinal it is due (plain decoding), shifted where the test says."""
    runs = tuple(
        SampledRun(e.request_id, e.ordinal + e.input_ref + ordinal_shift.get(e.request_id, 0), (tokens[e.request_id],))
        for e in plan.entries
        if e.sample
    )
    return StepResult(plan.step_id, runs)


def test_a_result_from_the_wrong_ordinal_never_reaches_the_grammar(
    embedded_model_dir: Path, grammar: LocalGrammar, tokenizer: Tokenizer, valid_tokens: list[int]
) -> None:
    """C1/C2 at the scheduler: a step result whose run begins at ordinal 1 where 0 is due (a gap as the executor
    sees it) is refused before anything moves: the commit raises in its first phase, before any grammar entry is
    made, so both requests' grammars stay at ordinal 0 and no output is appended.

    Fails if the ordinal check in `Scheduler.commit` (`if run.ordinal != len(req.output_ids)`) is removed: the
    forged token is then committed to the grammar and appended as if it were due (grammar at 1): checked once."""
    scheduler = Scheduler(_config(embedded_model_dir, grammar_overlap=True))
    a, b = _request("forged-a", tokenizer, _schema()), _request("forged-b", tokenizer, _schema())
    _add_constrained(scheduler, grammar, a)
    _add_constrained(scheduler, grammar, b)
    p1 = _plan(scheduler)
    first = valid_tokens[0]
    with pytest.raises(ProtocolError, match="C2"):
        _commit(scheduler, grammar, _forged(p1, {"forged-a": first, "forged-b": first}, {"forged-a": 1}))
    assert _grammar_at(grammar, "forged-a", 0) and _grammar_at(grammar, "forged-b", 0)
    assert a.output_ids == [] and b.output_ids == []
    grammar.release(["forged-a", "forged-b"])


def test_a_second_writer_makes_the_commit_stale_and_only_that_request_ends(
    embedded_model_dir: Path, grammar: LocalGrammar, tokenizer: Tokenizer, valid_tokens: list[int]
) -> None:
    """C1/C2/C13: a peer other than the scheduler advances one request's grammar (a double advance). The
    scheduler's commit of that step then starts from an ordinal the grammar has passed and is refused
    (STALE_ORDINAL); the request ends with a grammar abort keeping nothing of the step, the grammar is not advanced
    twice, and the other request in the same step commits normally.

    Fails if ``if from_ordinal < here: raise ... STALE_ORDINAL`` is removed from ``VersionedMatcher._check_commit``
    (the token is fed twice and the request goes on): checked once."""
    scheduler = Scheduler(_config(embedded_model_dir, grammar_overlap=True))
    a, b = _request("twice-a", tokenizer, _schema()), _request("twice-b", tokenizer, _schema())
    _add_constrained(scheduler, grammar, a)
    _add_constrained(scheduler, grammar, b)
    p1 = _plan(scheduler)
    first = valid_tokens[0]
    (intruder,) = grammar.commit([CommitEntry("twice-a", 0, (first,))])  # not the scheduler: breaks C1
    assert intruder.result is not None and intruder.result.new_ordinal == 1
    out = _commit(scheduler, grammar, _forged(p1, {"twice-a": first, "twice-b": first}, {}))
    by_id = {o.request_id: o for o in out.outputs}
    ended = by_id["twice-a"]
    assert ended.finish is not None and ended.finish.cause is AbortCause.GRAMMAR
    assert ended.finish.message is not None and "stale_ordinal" in ended.finish.message
    assert ended.new_token_ids == () and a.output_ids == []
    assert by_id["twice-b"].new_token_ids == (first,) and by_id["twice-b"].finish is None
    assert _grammar_at(grammar, "twice-b", 1)
    assert out.released_slots == [a.slot]
    _released(grammar, scheduler.abort("twice-b"))
    assert grammar.num_open == 0


# ------------------------------------------------------------------------------------------------ seed 000


@dataclass(frozen=True)
class Event:
    """One grammar call as the backend saw it: a mask asked, a mask answered (``ok``: with rows), a commit."""

    kind: str
    request_id: str
    ordinal: int
    ok: bool = True


class RecordingGrammar(DelegatingGrammar[LocalGrammar]):
    """Forwards to a real :class:`LocalGrammar` and records every mask and commit call, in order.

    With ``hold_commits`` it also plays seed 000's timing on every step: the commit of step N waits until step
    N+1's mask request for the same requests has been made and is waiting at the fence (or was answered), so that
    "N pending while N+1's mask is prepared" happens at each step, not only when the threads happen to race."""

    def __init__(self, inner: LocalGrammar, hold_commits: bool) -> None:
        super().__init__(inner)
        self.hold_commits = hold_commits
        self.events: list[Event] = []
        self.holds_timed_out = 0
        self._lock = threading.Lock()

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        self._record([Event("mask", e.request_id, e.ordinal) for e in entries])
        refusals = self.inner.fill_masks_into(entries, deadline_s, out, starts)
        self._record([Event("answer", e.request_id, e.ordinal, i not in refusals) for i, e in enumerate(entries)])
        return refusals

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        if self.hold_commits:
            self._hold_until_next_masks_wait(entries)
        self._record([Event("commit", e.request_id, e.from_ordinal) for e in entries])  # before it can take effect
        return self.inner.commit(entries)

    def _record(self, events: list[Event]) -> None:
        with self._lock:
            self.events.extend(events)

    def _seen(self, kind: str) -> set[tuple[str, int]]:
        with self._lock:
            return {(e.request_id, e.ordinal) for e in self.events if e.kind == kind}

    def _hold_until_next_masks_wait(self, entries: Sequence[CommitEntry]) -> None:
        wanted = {(e.request_id, e.from_ordinal + len(e.tokens)) for e in entries}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if wanted <= self._seen("mask") and (self.inner.registry.num_waiting > 0 or wanted <= self._seen("answer")):
                return
            time.sleep(0.001)
        self.holds_timed_out += 1


SEED_GRAMMARS = (
    Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "string", "enum": ["yes", "no", "maybe"]})),
    Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "integer", "minimum": 0, "maximum": 99999})),
    Constraint(ConstraintKind.REGEX, "[a-z]{4}-[0-9]{3}"),
    Constraint(ConstraintKind.REGEX, "(cat|dog|bird)s?"),
)


def _seed_000_workload(
    model_dir: Path, grammar: LocalGrammar, tokenizer: Tokenizer, grammar_overlap: bool
) -> tuple[dict[str, RequestOutput], RecordingGrammar]:
    """8 constrained requests (greedy and seeded, grammars that complete within a few tokens) and 4 unconstrained
    ones through the overlapped engine; returns the constrained requests' final outputs and the recording."""
    backend = RecordingGrammar(grammar, hold_commits=grammar_overlap)
    config = EngineConfig(
        model_path=str(model_dir), page_size=8, num_pages=256, max_running=16, grammar_overlap=grammar_overlap
    )
    prompts = [tokenizer.encode(f"Request {i}: answer in the format asked.") for i in range(12)]
    constraints = [SEED_GRAMMARS[i % len(SEED_GRAMMARS)] if i < 8 else None for i in range(12)]
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_new_tokens=32) for i in range(12)]
    with Engine(config, grammar=backend) as engine:
        outs = engine.generate_batch(prompts, params, timeout=WAIT_S * 6, constraints=constraints)
        assert engine.wait_idle(WAIT_S) and engine.grammar is not None and engine.grammar.num_open == 0
    assert backend.holds_timed_out == 0
    return {out.request_id: out for out, c in zip(outs, constraints, strict=True) if c is not None}, backend


@pytest.mark.parametrize("grammar_overlap", [True, False], ids=["delayed-sampling", "early-commit"])
def test_seed_000_the_grammar_never_falls_behind_the_decode_loop(
    embedded_model_dir: Path, grammar: LocalGrammar, tokenizer: Tokenizer, grammar_overlap: bool
) -> None:
    """Seed 000 as a regression test: the overlapped decode loop with constrained requests (and unconstrained ones
    in the same steps). For every request and step, the mask used for step N+1 was answered at ordinal v + 1, after
    step N's commit reached v + 1; commits advance one ordinal per token, never skipped or repeated, up to the
    final output. With delayed sampling, N+1's mask request is made while N is pending (held so at every step);
    with early commit, N is committed before N+1's mask is even asked.

    Delayed sampling fails if the version check is removed from both places that make it, the fence's ``behind``
    filter in ``MaskFence._poll`` and ``if here < at_ordinal: return Refusal.BEHIND, ...`` in
    ``VersionedMatcher._mask_refusal`` (N+1's mask is answered from version v, before N's commit: the seed's stale
    verify mask, which lets the sampler pick tokens the grammar then refuses, "Tokens not accepted" aborts; one of
    the two alone is not enough, the other refuses); early commit fails if the ``while inflight: self._commit(...)``
    early commit is removed from ``Engine._loop`` (the seed's missing guard: masks are refused behind the fence and
    requests abort): checked once each."""
    outs, backend = _seed_000_workload(embedded_model_dir, grammar, tokenizer, grammar_overlap)
    position = {event: i for i, event in enumerate(backend.events)}
    for rid, out in outs.items():
        assert out.finish is not None and out.finish.reason is FinishReason.STOP, out.finish
        n = len(out.output_ids or ())
        mine = [e for e in backend.events if e.request_id == rid]
        assert [e.ordinal for e in mine if e.kind == "commit"] == list(range(n))  # C1/C2: one advance per token
        assert [e.ordinal for e in mine if e.kind == "answer" and e.ok] == list(range(n))  # step N+1 at v + 1
        for v in range(1, n):
            commit = position[Event("commit", rid, v - 1)]
            assert commit < position[Event("answer", rid, v)], f"{rid}: mask at {v} answered before commit {v - 1}"
            if grammar_overlap:
                assert position[Event("mask", rid, v)] < commit  # the seed's situation: N pending at N+1's mask
            else:
                assert commit < position[Event("mask", rid, v)]  # early commit: N is in before N+1 asks
        # Refused at most once: the mask of the step that was planned before the grammar completed.
        assert [e.ordinal for e in mine if e.kind == "answer" and not e.ok] in ([], [n])


def test_early_commit_launches_no_step_for_a_request_it_finished(
    embedded_model_dir: Path, grammar: LocalGrammar, tokenizer: Tokenizer
) -> None:
    """C4 early commit with C8: in grammar-sync mode step N is committed before N+1 is launched, so when N's commit
    finishes a request (its grammar completed) N+1 must not carry it: no forward row and no mask request for a
    finished request, hence no refused mask at all. Fails if `Engine._loop` does the early commit after planning
    (N+1 planned before N's commit, launched after it): each completed constrained request then costs one wasted
    row whose mask is refused (TERMINATED or RELEASED). Checked once that way (it was the engine's first version)."""
    _, backend = _seed_000_workload(embedded_model_dir, grammar, tokenizer, grammar_overlap=False)
    refused = [e for e in backend.events if e.kind == "answer" and not e.ok]
    assert refused == []
