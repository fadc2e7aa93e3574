"""The executor's mask relay (services/mask_relay.py), tested from outside against a real grammar service.

The relay is a transport: the executor's fenced mask requests (C3), the same messages, carried by a helper process
that holds the per-step stream. These tests play the executor (a MaskRelay, as the executor's runner uses it) and
the scheduler (commits over a client of its own), and check that what comes back is what the stream itself
answers, that the fence is reached before the forward would end (C4), that a reply only ever answers its own
request, and that a stuck, killed or orphaned relay costs one step's masks and nothing else (no hang, no leak).

Each test's docstring names the line whose removal makes it fail, and how; each was checked once by removing it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.constraint import Constraint, ConstraintKind
from engine.grammar import ConstraintCompiler
from engine.grammar_calls import CommitEntry, DraftTree, MaskEntry, Refusal
from engine.model.tokenizer import Tokenizer
from services import mask_relay
from services.grammar_client import MASK_REPLY_MARGIN_S, GrammarClient, GrammarStreamError, RemoteGrammar
from services.mask_relay import RELAY_MARGIN_S, MaskRelay, RelayConfig, wants_relay
from tests.support.servers import GrammarThread

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
VALID_JSON = '{"a": 12}'
WAIT_S = 10.0  # every wait in these tests is bounded by this


@pytest.fixture(scope="module")
def served(compiler: ConstraintCompiler) -> Iterator[GrammarThread]:
    served = GrammarThread(compiler)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def target(served: GrammarThread) -> str:
    return f"127.0.0.1:{served.port}"


@pytest.fixture(scope="module")
def tokens(embedded_model_dir: Path) -> list[int]:
    return Tokenizer.from_dir(embedded_model_dir).encode(VALID_JSON)


@pytest.fixture
def scheduler(target: str) -> Iterator[GrammarClient]:
    """The scheduler's client (opens, commits, releases); every grammar a test opened must be released after it."""
    with GrammarClient(target, timeout_s=WAIT_S) as client:
        yield client
        state = client.get_state()
        assert (state.num_open, state.num_waiting) == (0, 0), "a grammar or a fenced wait outlived its test"


@pytest.fixture
def relay(target: str) -> Iterator[MaskRelay]:
    relay = MaskRelay.start(RelayConfig(target))
    yield relay
    pid = relay.pid
    relay.close()
    assert pid is not None and not _alive(pid), "close() left the relay process running"


def open_one(client: GrammarClient) -> str:
    rid = f"req-{uuid.uuid4().hex[:12]}"
    [opened] = client.open([(rid, Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA))])
    assert opened.ok, opened
    return rid


def bitmask(compiler: ConstraintCompiler, rows: int) -> torch.Tensor:
    return torch.zeros((rows, compiler.words_per_row), dtype=torch.int32)  # [R, W]


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: it is reaped by its parent, or is already gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_relayed_masks_are_the_streams_rows_and_refusals(
    relay: MaskRelay, scheduler: GrammarClient, target: str, compiler: ConstraintCompiler, tokens: list[int]
) -> None:
    """What the relay answers is what the executor's own stream answers, row for row: a chain draft, a tree, a stale
    ordinal (refused AHEAD, C3) and a future one whose commit never comes (refused at its deadline), in one batch.
    The relay must change nothing on the way; checked by one that drops the fence deadline (`deadline_ms = 0` on the
    parsed request in services/mask_relay_process.py): the future ordinal is then not refused within the executor's
    wait, and the call fails."""
    rid = open_one(scheduler)
    try:
        [done] = scheduler.stream_commit([CommitEntry(rid, 0, (tokens[0],))])
        assert done.result is not None and done.result.new_ordinal == 1
        entries = [
            MaskEntry(rid, 1, DraftTree.chain(tokens[1:4])),
            MaskEntry(rid, 1, DraftTree(tuple(tokens[1:4]), (-1, -1, 0))),
            MaskEntry(rid, 0),
            MaskEntry(rid, 5),
        ]
        starts = [0, 4, 8, 9]
        stream = RemoteGrammar.connect(target, WAIT_S, holds_session=False)  # the executor's path without a relay
        try:
            expected = bitmask(compiler, 10)
            expected_refusals = stream.fill_masks_into(entries, 0.05, expected, starts)
        finally:
            stream.close()
        out = bitmask(compiler, 10)
        refusals = relay.fill_masks_into(entries, 0.05, out, starts)
        assert refusals == expected_refusals
        assert sorted(refusals) == [2, 3] and refusals[2][0] is Refusal.AHEAD
        assert refusals[3][0] is Refusal.BEHIND_DEADLINE
        assert torch.equal(out, expected) and bool((out[:8] != 0).any())
    finally:
        assert scheduler.stream_release([rid]) == [None]


def test_a_relayed_request_is_at_the_fence_before_its_result_is_asked(
    relay: MaskRelay, scheduler: GrammarClient, compiler: ConstraintCompiler, tokens: list[int]
) -> None:
    """C4 through the relay: start_masks hands the request to the relay at once, so the service waits at its fence
    while the executor runs its forward; the scheduler's commit (on another connection) answers it, and ``result``
    takes the reply. Enforced by the `_send_frame(sock, number, Frame.REQUEST, ...)` in MaskRelay.start_masks; a
    relay that sent the request only from ``result`` leaves nothing at the fence and the poll fails after WAIT_S."""
    rid = open_one(scheduler)
    try:
        out = bitmask(compiler, 1)
        wait = relay.start_masks([MaskEntry(rid, 1)], 3.0, out, [0])
        deadline = time.monotonic() + WAIT_S
        while scheduler.get_state().num_waiting < 1:
            assert time.monotonic() < deadline, "the relayed mask request never reached the fence"
            time.sleep(0.005)
        [done] = scheduler.stream_commit([CommitEntry(rid, 0, (tokens[0],))])
        assert done.result is not None and done.result.new_ordinal == 1
        assert wait.result() == {}
        direct = bitmask(compiler, 1)
        assert scheduler.stream_fill_masks_into([MaskEntry(rid, 1)], 1.0, direct, [0]) == {}
        assert torch.equal(out, direct)
    finally:
        assert scheduler.stream_release([rid]) == [None]


def test_a_reply_nobody_took_never_answers_the_next_request_through_the_relay(
    relay: MaskRelay, scheduler: GrammarClient, compiler: ConstraintCompiler
) -> None:
    """C3 across the relay: the reply to a request whose step gave it up (never taken) is dropped when the next
    request's reply is taken, never handed to it. Enforced by the numbering in MaskRelay.receive (`if got ==
    number: break`); a receive that returns the first frame it reads hands the second request the first one's
    refusal (ordinal 7 of a grammar at 0, no time to wait), and its row stays unwritten."""
    rid = open_one(scheduler)
    try:
        given_up, out = bitmask(compiler, 1), bitmask(compiler, 1)
        first = relay.start_masks([MaskEntry(rid, 7)], 0.0, given_up, [0])
        first.close()
        second = relay.start_masks([MaskEntry(rid, 0)], 0.0, out, [0])
        assert second.result() == {}
        direct = bitmask(compiler, 1)
        assert scheduler.stream_fill_masks_into([MaskEntry(rid, 0)], 0.0, direct, [0]) == {}
        assert torch.equal(out, direct) and bool((out != 0).any())
        assert bool((given_up == 0).all())  # the dropped reply wrote nothing
        with pytest.raises(GrammarStreamError, match="is gone"):
            first.result()  # taken out of order: said so, never answered from another reply
    finally:
        assert scheduler.stream_release([rid]) == [None]


def test_a_stuck_relay_fails_its_step_at_the_deadline_and_the_next_request_starts_a_new_one(
    relay: MaskRelay, scheduler: GrammarClient, compiler: ConstraintCompiler
) -> None:
    """A relay that stops answering (SIGSTOP: a stalled process) costs the step waiting on it its masks, at the fence
    deadline plus MASK_REPLY_MARGIN_S and RELAY_MARGIN_S, never a hang; it is killed, and the next request
    starts a new relay that answers. Enforced by `raise self._drop("the mask relay did not answer in time")` in
    MaskRelay.receive: without the drop the stuck relay stays, and the next request's reply never comes either
    (it fails too)."""
    rid = open_one(scheduler)
    stuck = relay.pid
    assert stuck is not None
    try:
        out = bitmask(compiler, 1)
        assert relay.fill_masks_into([MaskEntry(rid, 0)], 0.0, out, [0]) == {}  # the relay is up and answering
        os.kill(stuck, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(GrammarStreamError, match="did not answer in time"):
            relay.fill_masks_into([MaskEntry(rid, 0)], 0.2, out, [0])
        took = time.monotonic() - started
        waited = 0.2 + MASK_REPLY_MARGIN_S + RELAY_MARGIN_S
        assert waited - 0.1 <= took < waited + 2.0, took
        assert _wait_gone(stuck), "the stuck relay was left running"
        again = bitmask(compiler, 1)
        assert relay.fill_masks_into([MaskEntry(rid, 0)], 0.0, again, [0]) == {}
        assert relay.pid not in (None, stuck) and torch.equal(again, out)
    finally:
        if _alive(stuck):
            os.kill(stuck, signal.SIGKILL)
        assert scheduler.stream_release([rid]) == [None]


def test_a_late_service_fails_the_step_through_the_relay_and_the_relay_stays(
    relay: MaskRelay, scheduler: GrammarClient, served: GrammarThread, compiler: ConstraintCompiler
) -> None:
    """A grammar service that does not answer in time (its loop frozen) costs the step its masks with the relay's
    own stream's message, and the relay, healthy, stays: the executor waits RELAY_MARGIN_S longer than the relay's
    stream does, counted from before the send, so the relay's failed answer comes first. Fails with RELAY_MARGIN_S
    = 0 at the deadline's check (and, in most runs, at the relay's pid: the two deadlines then lie a fraction of a
    millisecond apart, and the executor, passing its own first, kills a relay that did nothing wrong)."""
    rid = open_one(scheduler)
    try:
        out = bitmask(compiler, 1)
        assert relay.fill_masks_into([MaskEntry(rid, 0)], 0.0, out, [0]) == {}
        before = relay.pid
        thaw = served.freeze()
        try:
            wait = relay.start_masks([MaskEntry(rid, 0)], 0.2, out, [0])
            assert wait.deadline - time.monotonic() > 0.2 + MASK_REPLY_MARGIN_S + 0.5  # the margin over the relay's
            with pytest.raises(GrammarStreamError, match="did not answer within"):
                wait.result()
        finally:
            thaw.set()
        assert relay.pid == before
        assert relay.fill_masks_into([MaskEntry(rid, 0)], 0.0, out, [0]) == {}  # a new stream, the same relay
        assert relay.pid == before
    finally:
        assert scheduler.stream_release([rid]) == [None]


def test_a_killed_relay_fails_the_waiting_step_at_once_and_is_replaced(
    relay: MaskRelay, scheduler: GrammarClient, compiler: ConstraintCompiler
) -> None:
    """A relay that dies (SIGKILL) while a step waits for its reply fails that step at once (the end of its socket),
    not at the deadline; the next request starts a new relay. Enforced by the EOFError branch of MaskRelay.receive
    (`raise self._drop(f"the mask relay exited ...")`); without it the end of the stream is not seen as the relay's
    death and the wait raises something else."""
    rid = open_one(scheduler)
    try:
        out = bitmask(compiler, 1)
        wait = relay.start_masks([MaskEntry(rid, 1)], 5.0, out, [0])  # waits at the fence: no commit comes
        dead = relay.pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(GrammarStreamError, match="exited"):
            wait.result()
        assert time.monotonic() - started < 2.0
        assert relay.fill_masks_into([MaskEntry(rid, 0)], 0.0, out, [0]) == {}
        assert relay.pid not in (None, dead)
    finally:
        assert scheduler.stream_release([rid]) == [None]


def test_the_relay_ends_with_its_executor_even_by_sigkill(target: str) -> None:
    """No relay outlives the process that started it: an executor killed with SIGKILL (no cleanup of its own runs)
    takes its relay with it within a second. Two things end it, each enough alone: the end of its socket (relay()
    returns on EOFError) and the parent-death signal it is started under (services.parent_death, for a relay that
    is stuck rather than reading); so this test guards the outcome, and removing either alone does not fail it
    (checked: started without parent_death, the relay still ends at the end of its socket)."""
    code = (
        "import sys, time\n"
        "from services.mask_relay import MaskRelay, RelayConfig\n"
        f"relay = MaskRelay.start(RelayConfig({target!r}))\n"
        "print(relay.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert _alive(pid)
        owner.kill()
        owner.wait(WAIT_S)
        assert _wait_gone(pid, 1.0), "the relay outlived its executor"
    finally:
        owner.kill()


def test_auto_runs_the_relay_only_for_a_cpu_executor_pinned_apart_from_its_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--grammar-mask-relay auto``: on for a CPU executor pinned to fewer cores than the process that started it
    (bench/spec.py pins it so), the relay then on the parent's other cores; off where the whole stack shares one set
    of cores (``taskset -c 1 ordinal serve``: a relay would only add a process to them), where the parent is not
    visible (a container's first process), and on CUDA; on and off as said. Fails if relay_cpus took every core of
    the machine outside the executor's (the taskset case would then put a relay on a core the user did not give)."""
    affinity = {0: {1}, 4242: {0, 1}}  # this process (pid 0 = self), its parent
    monkeypatch.setattr(mask_relay.os, "getppid", lambda: 4242)
    monkeypatch.setattr(mask_relay.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(mask_relay.os, "sched_getaffinity", lambda pid: affinity[pid])
    assert mask_relay.relay_cpus() == frozenset({0})
    assert wants_relay("auto", "cpu") and not wants_relay("auto", "cuda")
    assert not wants_relay("off", "cpu") and wants_relay("on", "cuda")
    affinity[4242] = {1}  # the whole stack on core 1
    assert mask_relay.relay_cpus() is None
    assert not wants_relay("auto", "cpu") and wants_relay("on", "cpu")
    monkeypatch.setattr(mask_relay.os, "getppid", lambda: 0)
    assert mask_relay.relay_cpus() is None
