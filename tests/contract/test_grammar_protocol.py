"""The grammar service's side of the grammar protocol, tested from outside.

A real grammar service (real xgrammar over the embedded model's tokenizer) is served on a loopback port; each
test plays a scheduler or an executor over real gRPC stubs, often a misbehaving one, and checks that the
service refuses what breaks a contract with a precise per-entry code and never answers with wrong data.

Each test's docstring names the enforcement line whose removal makes it fail, and how; every one of them was
checked once by deleting that line and running the test.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.constraint import Constraint, ConstraintKind
from engine.grammar import ConstraintCompiler
from engine.grammar_calls import (
    CommitEntry,
    DraftTree,
    GrammarProtocolError,
    GrammarUnavailableError,
    InvalidGrammarError,
    MaskEntry,
    Refusal,
)
from engine.model.tokenizer import Tokenizer
from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc
from services.grammar import convert
from services.grammar.server import SERVICE_NAME
from services.grammar_client import (
    CHANNEL_OPTIONS,
    MASK_REPLY_MARGIN_S,
    GrammarClient,
    GrammarStreamError,
    RemoteGrammar,
)
from tests.support.grammar_clients import AsyncGrammarClient
from tests.support.servers import GrammarThread

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
VALID_JSON = '{"a": 12}'
WAIT_S = 10.0  # every wait in these tests is bounded by this


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


@pytest.fixture(scope="module")
def server(embedded_model_dir: Path) -> Iterator[GrammarThread]:
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    served = GrammarThread(compiler)
    yield served
    served.stop()
    compiler.shutdown()


@pytest.fixture(scope="module")
def target(server: GrammarThread) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture
def stub(target: str) -> Iterator[pb_grpc.GrammarStub]:
    """A raw stub: the test is the peer. After each test every grammar it opened must be released (C9)."""
    with grpc.insecure_channel(target) as channel:
        grammar = pb_grpc.GrammarStub(channel)
        yield grammar
        state = grammar.GetState(pb.StateRequest(), timeout=WAIT_S)
        assert (state.num_open, state.num_waiting) == (0, 0), "a grammar or a fenced wait outlived its test"


@pytest.fixture
def tokens(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(VALID_JSON)


def new_id() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def open_one(stub: pb_grpc.GrammarStub, text: str = SCHEMA, kind: pb.ConstraintKind = pb.JSON_SCHEMA) -> str:
    rid = new_id()
    entry = pb.OpenEntry(request_id=rid, constraint=pb.Constraint(kind=kind, text=text))
    [result] = stub.Open(pb.OpenRequest(entries=[entry]), timeout=WAIT_S).results
    assert result.code == pb.OK, result.message
    return rid


def commit(stub: pb_grpc.GrammarStub, rid: str, from_ordinal: int, tokens: list[int]) -> pb.CommitResult:
    entry = pb.CommitEntry(request_id=rid, from_ordinal=from_ordinal, tokens=tokens)
    [result] = stub.Commit(pb.CommitRequest(entries=[entry]), timeout=WAIT_S).results
    return result


def masks(stub: pb_grpc.GrammarStub, entries: list[pb.MaskEntry], deadline_ms: int = 2000) -> pb.FillMasksReply:
    return stub.FillMasks(pb.FillMasksRequest(entries=entries, deadline_ms=deadline_ms), timeout=WAIT_S)


def mask_row(reply: pb.FillMasksReply, index: int = 0) -> bytes:
    [ref] = reply.results[index].row_refs
    return reply.rows[ref]


def release(stub: pb_grpc.GrammarStub, *rids: str) -> list[int]:
    return list(stub.Release(pb.ReleaseRequest(request_ids=list(rids)), timeout=WAIT_S).codes)


def wait_until_fenced(stub: pb_grpc.GrammarStub, count: int) -> None:
    """Poll the service's own counter until ``count`` mask entries wait at its fence (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while stub.GetState(pb.StateRequest(), timeout=WAIT_S).num_waiting < count:
        assert time.monotonic() < deadline, "the mask request never reached the fence"
        time.sleep(0.005)


# ---------------------------------------------------------------- C2: commits name their ordinal


def test_commit_from_a_stale_ordinal_is_refused(stub: pb_grpc.GrammarStub, tokens: list[int]) -> None:
    """C2. Enforced by `if from_ordinal < here:` in VersionedMatcher._check_commit; without it the replayed
    tokens are fed at ordinal 3 (the grammar refuses `a` after `{"a":`): code OK with a rejected_token."""
    rid = open_one(stub)
    assert commit(stub, rid, 0, tokens[:3]).new_ordinal == 3
    stale = commit(stub, rid, 1, tokens[1:3])
    assert stale.code == pb.STALE_ORDINAL and "ordinal 3" in stale.message
    assert commit(stub, rid, 3, tokens[3:]).new_ordinal == len(tokens)  # nothing moved
    assert release(stub, rid) == [pb.OK]


def test_commit_from_a_future_ordinal_is_refused(stub: pb_grpc.GrammarStub, tokens: list[int]) -> None:
    """C2. Enforced by `if from_ordinal > here:` in VersionedMatcher._check_commit; without it the tokens of
    ordinal 3 are fed at ordinal 1, the grammar refuses them and the code is OK with a rejected_token."""
    rid = open_one(stub)
    assert commit(stub, rid, 0, tokens[:1]).new_ordinal == 1
    gap = commit(stub, rid, 3, tokens[3:4])
    assert gap.code == pb.FUTURE_ORDINAL and "gap" in gap.message
    assert not gap.HasField("rejected_token")
    assert commit(stub, rid, 1, tokens[1:]).new_ordinal == len(tokens)
    assert release(stub, rid) == [pb.OK]


def test_a_duplicate_commit_is_refused(stub: pb_grpc.GrammarStub, tokens: list[int]) -> None:
    """C2: the same step result committed twice (also twice in one batch) is a replay.
    Enforced by `if from_ordinal < here:` in VersionedMatcher._check_commit; without it the second copy is
    fed and refused by the grammar: code OK with a rejected_token, and the grammar is finished."""
    rid = open_one(stub)
    entry = pb.CommitEntry(request_id=rid, from_ordinal=0, tokens=tokens[:2])
    first, again = stub.Commit(pb.CommitRequest(entries=[entry, entry]), timeout=WAIT_S).results
    assert (first.code, first.accepted, first.new_ordinal) == (pb.OK, 2, 2)
    assert again.code == pb.STALE_ORDINAL
    replay = stub.Commit(pb.CommitRequest(entries=[entry]), timeout=WAIT_S).results[0]
    assert replay.code == pb.STALE_ORDINAL
    assert commit(stub, rid, 2, tokens[2:]).code == pb.OK
    assert release(stub, rid) == [pb.OK]


# ---------------------------------------------------------------- C3: the fence


def test_a_mask_at_a_past_ordinal_is_refused(stub: pb_grpc.GrammarStub, tokens: list[int]) -> None:
    """C3: the grammar moved on; an old mask would be stale. Enforced by `if here > at_ordinal:` in
    VersionedMatcher._mask_refusal; without it the mask of ordinal 2 is answered OK for a request of ordinal 1."""
    rid = open_one(stub)
    commit(stub, rid, 0, tokens[:2])
    reply = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1)])
    [result] = reply.results
    assert result.code == pb.AHEAD and not result.row_refs and not reply.rows
    assert "ordinal 2" in result.message
    assert release(stub, rid) == [pb.OK]


def test_mask_and_commit_after_release_are_refused(stub: pb_grpc.GrammarStub, tokens: list[int]) -> None:
    """Enforced by `if request_id in self._released: raise ... RELEASED` in GrammarRegistry._lookup; without
    it the released id is answered UNKNOWN (the grammar is gone either way, but the peer's bug is not named)."""
    rid = open_one(stub)
    assert release(stub, rid, rid, "never-opened") == [pb.OK, pb.RELEASED, pb.UNKNOWN]
    [result] = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=0)]).results
    assert result.code == pb.RELEASED and not result.row_refs
    assert commit(stub, rid, 0, tokens[:1]).code == pb.RELEASED


def test_a_mask_for_a_future_ordinal_is_answered_by_the_later_commit(
    stub: pb_grpc.GrammarStub, tokens: list[int]
) -> None:
    """C3, the overlapped order: the executor asks for ordinal 2 before the scheduler commits step N.
    Enforced by the wake-up `self._on_change()` in GrammarRegistry._bump (the service's fence awaits it);
    without it the fence sleeps to its 20 s deadline and the elapsed-time assertion fails."""
    rid = open_one(stub)
    commit(stub, rid, 0, tokens[:1])
    request = pb.FillMasksRequest(entries=[pb.MaskEntry(request_id=rid, ordinal=2)], deadline_ms=20_000)
    started = time.monotonic()
    pending = stub.FillMasks.future(request, timeout=30)
    wait_until_fenced(stub, 1)
    assert commit(stub, rid, 1, tokens[1:2]).new_ordinal == 2
    reply = pending.result(timeout=30)
    assert time.monotonic() - started < 10, "the commit did not release the fenced mask"
    assert reply.results[0].code == pb.OK
    fresh = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=2)])
    assert mask_row(reply) == mask_row(fresh), "the fenced mask is not the mask at ordinal 2"
    assert release(stub, rid) == [pb.OK]


def test_a_mask_for_an_ordinal_that_never_comes_fails_at_its_deadline(
    stub: pb_grpc.GrammarStub, target: str, tokens: list[int]
) -> None:
    """C3: a bounded wait, a clean per-entry failure, the rest of the batch answered, the service healthy.
    Enforced by `or fence.remaining_s() <= 0` in GrammarServicer._fence; without it the fence never gives
    up and the call fails with DEADLINE_EXCEEDED for the whole batch."""
    waiting, ready = open_one(stub), open_one(stub)
    request = [
        pb.MaskEntry(request_id=waiting, ordinal=5),
        pb.MaskEntry(request_id=ready, ordinal=0),
        pb.MaskEntry(request_id="nobody", ordinal=0),
    ]
    started = time.monotonic()
    late, answered, unknown = masks(stub, request, deadline_ms=300).results
    assert 0.3 <= time.monotonic() - started < WAIT_S
    assert late.code == pb.BEHIND_DEADLINE and "ordinal 5" in late.message and not late.row_refs
    assert answered.code == pb.OK and len(answered.row_refs) == 1
    assert unknown.code == pb.UNKNOWN
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert commit(stub, waiting, 0, tokens).code == pb.OK
    assert release(stub, waiting, ready) == [pb.OK, pb.OK]


def test_a_release_ends_a_fenced_wait_at_once(stub: pb_grpc.GrammarStub) -> None:
    """Enforced by `self._bump()` in GrammarRegistry.release; without it the fenced request sleeps until its
    20 s deadline (its last poll then finds the release) and the elapsed-time assertion fails."""
    rid = open_one(stub)
    started = time.monotonic()
    request = pb.FillMasksRequest(entries=[pb.MaskEntry(request_id=rid, ordinal=3)], deadline_ms=20_000)
    pending = stub.FillMasks.future(request, timeout=30)
    wait_until_fenced(stub, 1)
    assert release(stub, rid) == [pb.OK]
    [result] = pending.result(timeout=30).results
    assert result.code == pb.RELEASED
    assert time.monotonic() - started < 10, "the release did not end the fenced wait"


# ---------------------------------------------------------------- C6 and C13 over the wire


def test_tokens_after_termination_are_not_accepted(
    stub: pb_grpc.GrammarStub, tokens: list[int], tokenizer: Tokenizer
) -> None:
    """C6. Enforced by the `break` after `self._state = MatcherState.TERMINATED` in VersionedMatcher._feed;
    without it the token after eos is fed: xgrammar refuses it, the result names a rejected_token and is no
    longer `terminated`."""
    rid = open_one(stub)
    eos = min(tokenizer.eos_token_ids)
    done = commit(stub, rid, 0, [*tokens, eos, *tokens[:2]])
    assert (done.code, done.accepted, done.terminated) == (pb.OK, len(tokens) + 1, True)
    assert not done.HasField("rejected_token") and done.new_ordinal == len(tokens) + 1
    [result] = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=done.new_ordinal)]).results
    assert result.code == pb.TERMINATED
    assert release(stub, rid) == [pb.OK]


def test_a_refused_token_is_reported_and_the_grammar_answers_nothing_more(
    stub: pb_grpc.GrammarStub, tokens: list[int], tokenizer: Tokenizer
) -> None:
    """C13. Enforced by the rejection branch of VersionedMatcher._feed (`rejected = int(token)` and the state
    REJECTED); without `self._state = MatcherState.REJECTED` the next commit is accepted instead of REJECTED."""
    rid = open_one(stub)
    bad = tokenizer.encode("x")[0]
    result = commit(stub, rid, 0, [tokens[0], bad, tokens[1]])
    assert (result.code, result.accepted, result.rejected_token, result.new_ordinal) == (pb.OK, 1, bad, 1)
    assert commit(stub, rid, 1, tokens[1:2]).code == pb.REJECTED
    [mask] = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1)]).results
    assert mask.code == pb.REJECTED
    assert release(stub, rid) == [pb.OK]


# ---------------------------------------------------------------- Open


def test_a_bad_grammar_is_invalid_argument_with_xgrammars_reason(stub: pb_grpc.GrammarStub) -> None:
    """Enforced by `except (RuntimeError, ValueError, TypeError)` in ConstraintCompiler._compile (the mapping
    to InvalidGrammarError); without it xgrammar's error surfaces as INTERNAL without the grammar's reason."""
    taken = open_one(stub)
    good = new_id()
    entries = [
        pb.OpenEntry(request_id=new_id(), constraint=pb.Constraint(kind=pb.JSON_SCHEMA, text='{"type": "foo"}')),
        pb.OpenEntry(request_id=new_id(), constraint=pb.Constraint(kind=pb.REGEX, text="[a-")),
        pb.OpenEntry(request_id=good, constraint=pb.Constraint(kind=pb.EBNF, text='root ::= "yes" | "no"')),
        pb.OpenEntry(request_id=taken, constraint=pb.Constraint(kind=pb.REGEX, text="a+")),
        pb.OpenEntry(request_id=new_id(), constraint=pb.Constraint(text="a+")),  # kind unset
    ]
    schema, regex, ok, duplicate, no_kind = stub.Open(pb.OpenRequest(entries=entries), timeout=WAIT_S).results
    assert schema.code == pb.INVALID_ARGUMENT and 'Unsupported type "foo"' in schema.message
    assert regex.code == pb.INVALID_ARGUMENT and "Unclosed '['" in regex.message
    assert ok.code == pb.OK
    assert duplicate.code == pb.ALREADY_EXISTS
    assert no_kind.code == pb.INVALID_ARGUMENT and "kind" in no_kind.message
    assert release(stub, taken, good) == [pb.OK, pb.OK]


# ---------------------------------------------------------------- draft trees and the client


def test_draft_tree_masks_over_the_wire(stub: pb_grpc.GrammarStub, tokens: list[int]) -> None:
    """C5 through the service: the tree's rows, then the committed state answers as before. A malformed tree
    fails its entry only. Enforced by `_check_acyclic(self.parents)` in DraftTree.__post_init__; without it the
    cyclic tree (never reachable from the root) is answered OK with all-zero rows instead of INVALID_ARGUMENT."""
    rid = open_one(stub)
    commit(stub, rid, 0, tokens[:1])
    before = mask_row(masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1)]))
    tree = pb.DraftTree(tokens=tokens[1:4], parents=[-1, 0, 1])
    cyclic = pb.DraftTree(tokens=tokens[1:3], parents=[1, 0])
    reply = masks(
        stub,
        [pb.MaskEntry(request_id=rid, ordinal=1, draft=tree), pb.MaskEntry(request_id=rid, ordinal=1, draft=cyclic)],
    )
    good, bad = reply.results
    assert good.code == pb.OK and len(good.row_refs) == 4
    assert reply.rows[good.row_refs[0]] == before
    assert bad.code == pb.INVALID_ARGUMENT and "ancestor" in bad.message
    assert mask_row(masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1)])) == before
    assert commit(stub, rid, 1, tokens[1:]).code == pb.OK
    assert release(stub, rid) == [pb.OK]


def test_draft_masks_at_a_stale_or_future_ordinal_are_never_answered_from_another_state(
    stub: pb_grpc.GrammarStub, tokens: list[int]
) -> None:
    """C3 for speculation: a draft's masks are answered only at the ordinal the executor's step builds on. A stale
    draft (the grammar moved on) is refused AHEAD with no rows; a future one waits at the fence, fails at its
    deadline with no rows, and once the commit reaches its ordinal is answered with the rows of that state.
    Enforced by `self._check_mask(at_ordinal)` in VersionedMatcher.fill_draft_masks; without it the stale draft is
    answered OK from ordinal 2's state (the first assertion fails)."""
    rid = open_one(stub)
    commit(stub, rid, 0, tokens[:2])
    chain = pb.DraftTree(tokens=tokens[2:4], parents=[-1, 0])
    stale = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1, draft=chain)])
    assert stale.results[0].code == pb.AHEAD and not stale.results[0].row_refs and not stale.rows
    future = pb.DraftTree(tokens=tokens[3:5], parents=[-1, 0])
    late = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=3, draft=future)], deadline_ms=200)
    assert late.results[0].code == pb.BEHIND_DEADLINE and not late.results[0].row_refs and not late.rows
    assert commit(stub, rid, 2, tokens[2:3]).new_ordinal == 3
    answered = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=3, draft=future)])
    plain = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=3)])
    assert answered.results[0].code == pb.OK and len(answered.results[0].row_refs) == 3
    assert answered.rows[answered.results[0].row_refs[0]] == mask_row(plain), "row 0 is not the mask at ordinal 3"
    assert release(stub, rid) == [pb.OK]


def test_a_tree_with_terminating_and_refused_nodes_leaves_the_committed_state_unchanged(
    stub: pb_grpc.GrammarStub, tokens: list[int], tokenizer: Tokenizer
) -> None:
    """C5 through the service: the traversal of a tree that ends the grammar on one branch (the stop token) and
    is refused on another leaves the committed state as it was: the plain mask is the same before and after,
    and the real continuation then commits and terminates. Rows after the stop token and under the refused node
    allow nothing. Enforced by the rollback inside xgrammar's `traverse_draft_tree` (VersionedMatcher never feeds
    draft tokens); a traversal that leaves a node fed (checked with `self._matcher.accept_token(int(tokens[1]))`
    added after the walk in fill_draft_masks) changes the plain mask: the before/after comparison fails."""
    rid = open_one(stub)
    last = len(tokens) - 1
    commit(stub, rid, 0, tokens[:last])
    eos, bad = min(tokenizer.eos_token_ids), tokenizer.encode("x")[0]
    # node 0: the closing token; 1: the stop token under it; 2: a token after the stop; 3: a refused sibling of
    # node 0; 4: a node under the refused one.
    tree = pb.DraftTree(tokens=[tokens[last], eos, tokens[0], bad, tokens[0]], parents=[-1, 0, 1, -1, 3])
    before = mask_row(masks(stub, [pb.MaskEntry(request_id=rid, ordinal=last)]))
    reply = masks(stub, [pb.MaskEntry(request_id=rid, ordinal=last, draft=tree)])
    [result] = reply.results
    assert result.code == pb.OK and len(result.row_refs) == 6
    rows = [reply.rows[ref] for ref in result.row_refs]
    assert rows[0] == before
    after_close = torch.frombuffer(bytearray(rows[1]), dtype=torch.int32)
    assert (int(after_close[eos // 32]) >> (eos % 32)) & 1, "the stop token is allowed after the closing token"
    for node in (2, 3, 4, 5):
        assert not any(rows[node]), f"row {node} allows a token, but nothing can follow it"
    assert mask_row(masks(stub, [pb.MaskEntry(request_id=rid, ordinal=last)])) == before
    done = commit(stub, rid, last, [tokens[last], eos])
    assert (done.code, done.terminated) == (pb.OK, True)
    assert release(stub, rid) == [pb.OK]


def test_client_returns_engine_values(target: str, tokens: list[int]) -> None:
    """The sync and async clients: typed per-entry results, masks as int32 [R, W] tensors. Enforced (for the
    typed Open error) by the INVALID_ARGUMENT branch of grammar_client._open_outcome; without it the bad grammar
    comes back as a GrammarProtocolError, not an InvalidGrammarError."""
    schema = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    rid, other = new_id(), new_id()
    with GrammarClient(target) as client:
        opened = client.open([(rid, schema), (other, Constraint(ConstraintKind.REGEX, "(("))])
        assert opened[0].ok and isinstance(opened[1].error, InvalidGrammarError)
        assert "parenthesis" in opened[1].error.reason
        [stale, done] = client.commit([CommitEntry(rid, 1, (tokens[0],)), CommitEntry(rid, 0, (tokens[0],))])
        assert stale.refusal is Refusal.FUTURE_ORDINAL and done.result is not None and done.result.new_ordinal == 1
        state = client.get_state()
        [row, tree] = client.fill_masks([MaskEntry(rid, 1), MaskEntry(rid, 1, DraftTree.chain(tokens[1:3]))], 2.0)
        assert row.rows is not None and row.rows.words.shape == (1, state.words_per_row)
        assert row.rows.words.dtype == torch.int32
        assert tree.rows is not None and torch.equal(tree.rows.words[0], row.rows.words[0])
        assert client.release([rid]) == [None]


@pytest.mark.asyncio
async def test_the_async_client_answers_the_same_values(target: str, tokens: list[int]) -> None:
    """The asyncio client over one grpc.aio channel: concurrent calls answered each on its own, as the sync
    client's are (a mask at a passed ordinal AHEAD, at the current one its rows)."""
    schema = Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)
    rid = new_id()
    async with AsyncGrammarClient(target) as client:
        (opened,) = await client.open([(rid, schema)])
        assert opened.ok
        (done,) = await client.commit([CommitEntry(rid, 0, (tokens[0],))])
        assert done.result is not None and done.result.new_ordinal == 1
        [ahead, current], state = await asyncio.gather(
            client.fill_masks([MaskEntry(rid, 0), MaskEntry(rid, 1)], 1.0), client.get_state()
        )
        assert ahead.refusal is Refusal.AHEAD and current.rows is not None
        assert current.rows.words.shape == (1, state.words_per_row)
        assert await client.release([rid]) == [None]


# ---------------------------------------------------------------- C9 across a scheduler's death: sessions

# A scheduler in another process: it holds a session, opens two grammars in it, says so, and waits to be killed.
_SCHEDULER_SCRIPT = """
import sys, time, grpc
from protos import grammar_pb2 as pb, grammar_pb2_grpc as pb_grpc
stub = pb_grpc.GrammarStub(grpc.insecure_channel(sys.argv[1]))
held = stub.Session(pb.SessionRequest(session="doomed"))
next(held)
constraint = pb.Constraint(kind=pb.JSON_SCHEMA, text=sys.argv[2])
entries = [pb.OpenEntry(request_id=f"doomed-{i}", constraint=constraint) for i in range(2)]
results = stub.Open(pb.OpenRequest(entries=entries, session="doomed"), timeout=30).results
assert all(r.code == pb.OK for r in results), results
print("OPENED", flush=True)
time.sleep(60)
"""


def _python(args: list[str], stderr: int = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """A Python process of the repository (a service, a scheduler played by a script), its stdout a text pipe."""
    command, env = [sys.executable, *args], {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def _state(stub: pb_grpc.GrammarStub, session: str = "") -> pb.GrammarState:
    return stub.GetState(pb.StateRequest(session=session), timeout=WAIT_S)


def test_a_killed_schedulers_grammars_are_released_with_its_session(target: str, stub: pb_grpc.GrammarStub) -> None:
    """C9 across a scheduler's death. A scheduler process holding a session opens two grammars in it and is
    SIGKILLed (no release, no goodbye): its connection closes, the Session call ends, and the service releases both,
    while a grammar opened in no session stays until released. Enforced by `self.registry.end_session(session)` in
    the finally of GrammarServicer.Session; without it both grammars stay open (num_open stays 3)."""
    unowned = open_one(stub)
    script = _python(["-c", _SCHEDULER_SCRIPT, target, SCHEMA], stderr=subprocess.PIPE)
    try:
        assert script.stdout is not None
        ready, _, _ = select.select([script.stdout], [], [], 60)
        assert ready and script.stdout.readline().strip() == "OPENED", script.stderr.read() if script.stderr else ""
        held = _state(stub, "doomed")
        assert (held.num_open, held.num_sessions, held.session_held) == (3, 1, True), held
        script.send_signal(signal.SIGKILL)
        script.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while _state(stub).num_open != 1:
            assert time.monotonic() < deadline, "the dead scheduler's grammars were never released"
            time.sleep(0.02)
        after = _state(stub, "doomed")
        assert (after.num_sessions, after.session_held) == (0, False), after
        assert [r.code for r in masks(stub, [pb.MaskEntry(request_id="doomed-0", ordinal=0)]).results] == [pb.RELEASED]
    finally:
        if script.poll() is None:
            script.kill()
            script.wait(WAIT_S)
        release(stub, unowned)


def test_an_open_in_a_session_that_is_not_held_is_refused(stub: pb_grpc.GrammarStub) -> None:
    """An Open naming a session that is not held (it ended, or this instance never granted it: a restart) opens
    nothing, NO_SESSION per entry, so a grammar can never outlive the session it was meant for. Enforced by
    `self._sessions.check_held(session)` in GrammarRegistry.check_can_open (and again, under the lock, in attach);
    without them the grammar opens (OK) and nothing would ever release it."""
    entry = pb.OpenEntry(request_id=new_id(), constraint=pb.Constraint(kind=pb.JSON_SCHEMA, text=SCHEMA))
    [result] = stub.Open(pb.OpenRequest(entries=[entry], session="never-held"), timeout=WAIT_S).results
    assert result.code == pb.NO_SESSION and "never-held" in result.message, result
    assert _state(stub).num_open == 0


def test_a_session_held_twice_is_refused_and_the_first_keeps_holding(target: str, stub: pb_grpc.GrammarStub) -> None:
    """Two schedulers cannot share a session id: the second Session call is refused ALREADY_EXISTS and the first
    still owns its grammars; an empty id is INVALID_ARGUMENT. Ending the first call releases them."""
    with grpc.insecure_channel(target) as first_channel, grpc.insecure_channel(target) as second_channel:
        first = pb_grpc.GrammarStub(first_channel).Session(pb.SessionRequest(session="twice"))
        grant = next(first)
        assert grant.session == "twice" and grant.instance_id and grant.vocab_size > 0
        rid = new_id()
        entry = pb.OpenEntry(request_id=rid, constraint=pb.Constraint(kind=pb.JSON_SCHEMA, text=SCHEMA))
        assert stub.Open(pb.OpenRequest(entries=[entry], session="twice"), timeout=WAIT_S).results[0].code == pb.OK
        for session, code in (("twice", grpc.StatusCode.ALREADY_EXISTS), ("", grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as refused:
                next(pb_grpc.GrammarStub(second_channel).Session(pb.SessionRequest(session=session), timeout=WAIT_S))
            assert refused.value.code() is code, refused.value
        assert _state(stub, "twice").session_held and _state(stub).num_open == 1
        first.cancel()
        deadline = time.monotonic() + WAIT_S
        while _state(stub).num_open:
            assert time.monotonic() < deadline, "the cancelled session's grammar was never released"
            time.sleep(0.02)


def test_a_session_that_ends_while_its_grammar_compiles_never_gets_it(server: GrammarThread) -> None:
    """The race an Open can lose: its session ends between the check before compiling and the attach after it. The
    attach checks again, under the registry's lock that end_session takes, and refuses (NO_SESSION): the matcher is
    never opened. Fails if `self._sessions.own(session, request_id)` in GrammarRegistry.attach stops checking."""
    registry = server.registry
    registry.hold_session("racing")
    registry.check_can_open("late", "racing")
    compiled = registry.compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA), WAIT_S)
    assert registry.end_session("racing") == []
    with pytest.raises(GrammarProtocolError) as refused:
        registry.attach("late", compiled, "racing")
    assert refused.value.code is Refusal.NO_SESSION and registry.num_open == 0


# ---------------------------------------------------------------- the per-step stream


def test_the_stream_answers_each_call_like_its_unary_twin_in_order(
    stub: pb_grpc.GrammarStub, tokens: list[int]
) -> None:
    """C2, C3 over the Stream RPC: a misbehaving peer's stale commit, mask at a past ordinal and mask after release
    are refused with the same codes as on the unary calls, and every reply is of its request's kind, in order.
    Enforced by the `call == "fill_masks"` branch of GrammarServicer.Stream; without it the first mask message ends
    the stream with INVALID_ARGUMENT."""
    rid, twin = open_one(stub), open_one(stub)
    assert commit(stub, twin, 0, tokens[:2]).new_ordinal == 2
    calls = [
        pb.StreamRequest(commit=pb.CommitRequest(entries=[pb.CommitEntry(request_id=rid, tokens=tokens[:2])])),
        pb.StreamRequest(
            commit=pb.CommitRequest(entries=[pb.CommitEntry(request_id=rid, from_ordinal=1, tokens=tokens[1:2])])
        ),
        pb.StreamRequest(fill_masks=pb.FillMasksRequest(entries=[pb.MaskEntry(request_id=rid, ordinal=1)])),
        pb.StreamRequest(fill_masks=pb.FillMasksRequest(entries=[pb.MaskEntry(request_id=rid, ordinal=2)])),
        pb.StreamRequest(release=pb.ReleaseRequest(request_ids=[rid])),
        pb.StreamRequest(fill_masks=pb.FillMasksRequest(entries=[pb.MaskEntry(request_id=rid, ordinal=2)])),
    ]
    replies = list(stub.Stream(iter(calls), timeout=WAIT_S))
    assert [r.WhichOneof("reply") for r in replies] == [c.WhichOneof("call") for c in calls]
    done, stale, past, current, released, after = replies
    assert done.commit.results[0].code == pb.OK and done.commit.results[0].new_ordinal == 2
    assert stale.commit.results[0].code == pb.STALE_ORDINAL
    assert past.fill_masks.results[0].code == pb.AHEAD
    assert mask_row(current.fill_masks) == mask_row(masks(stub, [pb.MaskEntry(request_id=twin, ordinal=2)]))
    assert list(released.release.codes) == [pb.OK]
    assert after.fill_masks.results[0].code == pb.RELEASED
    assert release(stub, twin) == [pb.OK]


def test_a_stream_message_without_a_call_ends_the_stream_with_invalid_argument(stub: pb_grpc.GrammarStub) -> None:
    """Enforced by the `context.abort(INVALID_ARGUMENT, ...)` of GrammarServicer.Stream; without it the empty
    message is skipped and the stream ends OK with no reply."""
    with pytest.raises(grpc.RpcError) as failed:
        list(stub.Stream(iter([pb.StreamRequest()]), timeout=WAIT_S))
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "one of commit, fill_masks, release" in (failed.value.details() or "")


def test_a_commit_reaches_a_mask_waiting_on_the_clients_other_stream(
    stub: pb_grpc.GrammarStub, target: str, tokens: list[int]
) -> None:
    """C3 through one client: a mask waiting at the fence on the mask stream is answered by a commit sent
    afterwards on the commit stream. Enforced by GrammarClient keeping two streams (`self._mask_stream`); with
    one stream for both, the commit queues behind the waiting mask, which ends BEHIND_DEADLINE."""
    rid = open_one(stub)
    out = torch.zeros((1, row_words(stub)), dtype=torch.int32)  # [1, W]
    with GrammarClient(target, timeout_s=WAIT_S) as client, ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(client.stream_fill_masks_into, [MaskEntry(rid, 1)], 3.0, out, [0])
        wait_until_fenced(stub, 1)
        [done] = client.stream_commit([CommitEntry(rid, 0, (tokens[0],))])
        assert done.result is not None and done.result.new_ordinal == 1
        assert waiting.result(WAIT_S) == {}
        assert out[0].numpy().astype("<i4").tobytes() == mask_row(
            masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1)])
        )
        assert client.stream_release([rid]) == [None]


def test_a_started_mask_request_is_at_the_fence_before_its_result_is_asked(
    stub: pb_grpc.GrammarStub, target: str, tokens: list[int]
) -> None:
    """C4 from the executor's side: RemoteGrammar.start_masks sends the request from the caller's thread at once, so
    the service waits at its fence (and computes the rows) while the caller runs its forward; only ``result`` takes
    the reply. Enforced by GrammarClient.stream_start_masks sending in `self._mask_stream.send(...)`; a wait that
    sent its request only in ``result`` leaves nothing at the fence and the poll fails after WAIT_S."""
    rid = open_one(stub)
    out = torch.zeros((1, row_words(stub)), dtype=torch.int32)  # [1, W]
    masks_client = RemoteGrammar.connect(target, WAIT_S, holds_session=False)  # the executor's client
    try:
        with GrammarClient(target, timeout_s=WAIT_S) as client:
            wait = masks_client.start_masks([MaskEntry(rid, 1)], 3.0, out, [0])
            wait_until_fenced(stub, 1)  # no thread of the caller's is waiting: the request is out
            [done] = client.stream_commit([CommitEntry(rid, 0, (tokens[0],))])
            assert done.result is not None and done.result.new_ordinal == 1
            assert wait.result() == {}
            assert out[0].numpy().astype("<i4").tobytes() == mask_row(
                masks(stub, [pb.MaskEntry(request_id=rid, ordinal=1)])
            )
            assert client.stream_release([rid]) == [None]
    finally:
        masks_client.close()


def test_a_reply_nobody_took_never_answers_the_next_request(stub: pb_grpc.GrammarStub, target: str) -> None:
    """C3 on a pipelined stream: the reply of a mask request whose step gave it up (closed, never taken) is dropped
    when the next request's reply is taken, never handed to it. Enforced by the numbering in _CallStream.receive
    (services/grammar_stream.py, `if self._taken - 1 == number`); a receive that returns the first reply off the
    queue hands the second request the first one's refusal (ordinal 7 of a grammar at 0, with no time to wait), and
    its row stays unwritten."""
    rid = open_one(stub)
    masks_client = RemoteGrammar.connect(target, WAIT_S, holds_session=False)
    try:
        given_up = torch.zeros((1, row_words(stub)), dtype=torch.int32)  # [1, W]
        out = torch.zeros((1, row_words(stub)), dtype=torch.int32)  # [1, W]
        first = masks_client.start_masks([MaskEntry(rid, 7)], 0.0, given_up, [0])
        first.close()
        second = masks_client.start_masks([MaskEntry(rid, 0)], 0.0, out, [0])
        assert second.result() == {}
        assert out[0].numpy().astype("<i4").tobytes() == mask_row(
            masks(stub, [pb.MaskEntry(request_id=rid, ordinal=0)])
        )
        assert bool((given_up == 0).all())  # the dropped reply wrote nothing
        with pytest.raises(GrammarStreamError, match="dropped"):
            first.result()  # taken out of order: said so, never answered from another reply
    finally:
        masks_client.close()
        assert release(stub, rid) == [pb.OK]


def test_a_lost_service_fails_the_stream_calls_and_remote_grammar_ends_only_constrained_work(
    embedded_model_dir: Path,
) -> None:
    """A stream whose service is gone raises GrammarStreamError (not a hang); RemoteGrammar turns a failed commit
    into an UNAVAILABLE answer per entry and a failed release into a log line, reports the end of the session its
    grammar lived in once (take_loss), and refuses a new open as unavailable (the engine retries it)."""
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    served = GrammarThread(compiler)
    client = GrammarClient(f"127.0.0.1:{served.port}", timeout_s=WAIT_S)
    remote = RemoteGrammar(client)
    try:
        assert remote.open("gone", Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA)) == 1  # in the first session
        assert remote.take_loss() is None and remote.unavailable() is None
        assert client.stream_release(["never"]) == [Refusal.UNKNOWN]  # the commit stream is open
        served.stop()
        with pytest.raises(GrammarStreamError):
            client.stream_commit([CommitEntry("gone", 0, (1,))])
        [lost] = remote.commit([CommitEntry("gone", 0, (1,))])
        assert lost.refusal is Refusal.UNAVAILABLE and "unavailable" in lost.message
        remote.release(["gone"])  # logged, not raised
        loss = remote.take_loss()
        assert loss is not None and loss.session == 1 and "ended" in loss.reason, loss
        assert remote.take_loss() is None  # reported once
        with pytest.raises(GrammarUnavailableError):
            remote.open("next", Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA))
        assert remote.unavailable() is not None
    finally:
        remote.close()
        compiler.shutdown()


def test_a_mask_of_a_service_that_stops_answering_fails_at_its_deadline(embedded_model_dir: Path) -> None:
    """C3 from the executor's side of a dead service: its mask call waits for a reply at most the fence deadline plus
    MASK_REPLY_MARGIN_S, then fails (the step's constrained rows end, each with its request's abort), never at the
    call's 30 s timeout, however silent the service. Enforced by `wait_s = (deadline_s ...) + MASK_REPLY_MARGIN_S` in
    GrammarClient._mask_request; with the former `self._timeout_s + deadline_s` the call takes 30.5 s."""
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    served = GrammarThread(compiler)
    target = f"127.0.0.1:{served.port}"
    masks_client = RemoteGrammar.connect(target, WAIT_S, holds_session=False)  # the executor's client
    out = torch.zeros((1, compiler.words_per_row), dtype=torch.int32)  # [1, W]
    try:
        with GrammarClient(target, timeout_s=WAIT_S) as client:
            [opened] = client.open([("silent", Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA))])
            assert opened.ok
            assert masks_client.fill_masks_into([MaskEntry("silent", 0)], 0.5, out, [0]) == {}  # the stream is up
            thaw = served.freeze()
            try:
                started = time.monotonic()
                with pytest.raises(GrammarStreamError, match=r"did not answer within 2\.5 s"):
                    masks_client.fill_masks_into([MaskEntry("silent", 0)], 0.5, out, [0])
                took = time.monotonic() - started
            finally:
                thaw.set()
            assert 0.5 + MASK_REPLY_MARGIN_S - 0.1 <= took < 0.5 + MASK_REPLY_MARGIN_S + 2.0, took
            assert client.release(["silent"]) == [None]
    finally:
        masks_client.close()
        served.stop()
        compiler.shutdown()


def test_a_mask_stream_waits_for_its_channel_to_reconnect_within_the_masks_deadline(embedded_model_dir: Path) -> None:
    """After an outage the executor's channel to the grammar service (its own, or its mask relay's) may still be
    between reconnect attempts when the scheduler, on another channel, has already reached the restarted service and
    sends constrained work: the mask stream opened then waits for its channel, within the mask's reply deadline, and
    gets its rows. Here the executor's channel is held in a 5 s backoff by a connect refused while the service is down.
    Enforced by ``wait_for_ready=True`` in mask_stream_slot (services/grammar_stream.py); without it the mask call
    fails at once with GrammarStreamError "grammar stream failed: UNAVAILABLE: failed to connect ..." (the flake
    the relay's restart test in tests/e2e/test_grammar_failure.py showed once in three CI runs)."""
    compiler = ConstraintCompiler.from_model_dir(embedded_model_dir)
    gone = GrammarThread(compiler)
    port = gone.port
    gone.stop()
    target = f"127.0.0.1:{port}"
    backoff = tuple(o for o in CHANNEL_OPTIONS if "reconnect_backoff" not in o[0]) + tuple(
        (f"grpc.{name}_reconnect_backoff_ms", 5_000) for name in ("initial", "min", "max")
    )
    masks_client = GrammarClient(target, timeout_s=WAIT_S, options=backoff)  # the executor's channel
    served: GrammarThread | None = None
    out = torch.zeros((1, compiler.words_per_row), dtype=torch.int32)  # [1, W]
    try:
        refused = time.monotonic()
        with pytest.raises(grpc.FutureTimeoutError):
            masks_client.wait_ready(0.3)  # the connect is refused: the channel waits 5 s before the next attempt
        served = GrammarThread(compiler, port=port)
        with GrammarClient(target, timeout_s=WAIT_S) as client:  # the scheduler's channel: connects at once
            [opened] = client.open([("back", Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA))])
            assert opened.ok
            assert time.monotonic() - refused < 4.0  # the mask goes out inside the executor channel's backoff
            assert masks_client.stream_fill_masks_into([MaskEntry("back", 0)], 8.0, out, [0]) == {}
            assert bool((out != 0).any())
            assert client.release(["back"]) == [None]
    finally:
        masks_client.close()
        if served is not None:
            served.stop()
        compiler.shutdown()


def row_words(stub: pb_grpc.GrammarStub) -> int:
    return stub.GetState(pb.StateRequest(), timeout=WAIT_S).words_per_row


def test_mask_rows_are_deduplicated_and_full_rows_travel_as_flags() -> None:
    """The packing: equal rows are sent once, rows allowing everything as the reference -1 without data.
    Enforced by `FULL_ROW_REF if full[r]` in convert.encode_masks; without it the full row travels as data
    (two rows, references [0, 1])."""
    width = 4
    row = torch.tensor([1, 2, 3, -(2**31)], dtype=torch.int32)  # [W]
    full = torch.full((width,), -1, dtype=torch.int32)  # [W]
    words = torch.stack([row, full, row.clone()])  # [3, W]: a two-row tree, then a single row equal to the first
    reply = convert.encode_masks(words, [range(0, 2), (Refusal.AHEAD, "ahead"), range(2, 3)])
    assert len(reply.rows) == 1 and len(reply.rows[0]) == width * 4
    assert [list(r.row_refs) for r in reply.results] == [[0, -1], [], [0]]
    entries = [MaskEntry("a", 0, DraftTree.chain([7])), MaskEntry("b", 0), MaskEntry("c", 0)]
    decoded = convert.decode_masks(pb.FillMasksReply.FromString(reply.SerializeToString()), entries)
    assert decoded[0].rows is not None and torch.equal(decoded[0].rows.words, torch.stack([row, full]))
    assert decoded[0].rows.full == (False, True)
    assert decoded[1].refusal is Refusal.AHEAD
    assert decoded[2].rows is not None and torch.equal(decoded[2].rows.words[0], row)


def test_a_reply_decodes_into_the_rows_the_caller_names() -> None:
    """The executor's path: rows land in its step bitmask at the sampling rows it names, in one copy; a refused
    entry's rows and every other row keep what they held."""
    width = 4
    row = torch.tensor([5, 0, 0, 1], dtype=torch.int32)  # [W]
    words = torch.stack([row, torch.full((width,), -1, dtype=torch.int32)])  # [2, W]
    reply = convert.encode_masks(words, [range(0, 1), (Refusal.BEHIND_DEADLINE, "late"), range(1, 2)])
    step = torch.full((6, width), 7, dtype=torch.int32)  # [B, W]: 7 marks rows nobody may write
    entries = [MaskEntry("a", 3), MaskEntry("b", 3), MaskEntry("c", 3)]
    refusals = convert.decode_masks_into(reply, entries, step, [4, 0, 1])
    assert refusals == {1: (Refusal.BEHIND_DEADLINE, "late")}
    assert torch.equal(step[4], row) and bool((step[1] == -1).all())
    assert bool((step[[0, 2, 3, 5]] == 7).all())
    with pytest.raises(GrammarProtocolError, match="not 5 words long"):
        convert.decode_masks_into(reply, entries, torch.zeros((6, 5), dtype=torch.int32), [4, 0, 1])


def test_a_reply_that_does_not_fit_its_request_is_refused_and_writes_none_of_its_rows() -> None:
    """A row reference past the reply's rows, below -1, or a count of references other than the entry's rows is the
    peer's fault (INTERNAL), never a mask: the check in decode_masks_into runs before the entry's rows are copied, so
    without it a reference past the rows raises an IndexError and a short list writes too few rows."""
    width = 2
    row = np.array([3, 1], dtype="<i4").tobytes()
    chain = MaskEntry("a", 0, DraftTree.chain((5, 6)))  # three rows

    def reply(refs: list[int]) -> pb.FillMasksReply:
        return pb.FillMasksReply(words_per_row=width, rows=[row], results=[pb.MaskResult(code=pb.OK, row_refs=refs)])

    step = torch.full((3, width), 7, dtype=torch.int32)  # [B, W]
    assert convert.decode_masks_into(reply([0, -1, 0]), [chain], step, [0]) == {}
    assert step.tolist() == [[3, 1], [-1, -1], [3, 1]]
    for refs in ([0, 1, 0], [0, -2, 0], [0, 0]):
        step.fill_(7)
        with pytest.raises(GrammarProtocolError, match="malformed mask row references"):
            convert.decode_masks_into(reply(refs), [chain], step, [0])
        assert bool((step == 7).all())


# ---------------------------------------------------------------- the process


def test_the_service_process_serves_and_stops_on_sigterm(embedded_model_dir: Path) -> None:
    """`python -m services.grammar` prints its ready line with the bound port, serves, and exits 0 on SIGTERM.
    Enforced by `loop.add_signal_handler(sig, stop.set)` in services.grammar.__main__.serve; without it SIGTERM
    kills the process (return code -15)."""
    process = _python(["-m", "services.grammar", "--port", "0", "--model", str(embedded_model_dir)])
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "no ready line within 60 s"
        line = process.stdout.readline().strip()
        assert line.startswith("GRAMMAR_READY port="), line
        port = int(line.split("=", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            state = pb_grpc.GrammarStub(channel).GetState(pb.StateRequest(), timeout=WAIT_S)
        assert state.num_open == 0 and state.words_per_row == (state.vocab_size + 31) // 32
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)
