"""A step gate: an ``ordinal.executor.v1.Executor`` that sits between a scheduler and the real executor.

Test infrastructure for the scheduler-side contracts (C6-C10). Contract tests need to put an event (an abort, a
cancelled stream) at an exact point of a request's life, e.g. between "the final prefill chunk was launched" and
"its result was committed" (seed 004). The gate makes such a point a state a test can wait for instead of a race:

    scheduler (Engine + RemoteRunner) ──Session──▶ StepGate ──Session──▶ real executor (ModelRunner)

It is built from the same protos as the executor and is not a fake: every message is forwarded unchanged (the
very object read, so fields the gate does not know pass through too) to a real executor, and every reply comes
back unchanged. GetModelInfo and GetState are forwarded as they are. On the Session stream the gate can hold
**launches** (plans on their way to the executor) and **results** (replies on their way back) on command: a
test installs hold rules (a step id, a request id, or any predicate over the decoded step) and releases held
messages one at a time. A held message holds everything behind it on its stream, so the order of each stream
is never changed: the executor still executes in launch order and the scheduler still sees replies in order.

A test drives the gate through plain methods from its own thread; the gate serves on a loopback port from gRPC's
own threads. Every wait is bounded (:class:`GateTimeoutError`); nothing is timed with sleeps.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from engine.step import StepEntry, StepPlan, StepResult
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from services.executor import convert
from services.executor.convert import SESSION_METADATA_KEY

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 30.0
FORWARD_TIMEOUT_S = 30.0  # unary calls forwarded without a deadline of their own
_T = TypeVar("_T")


class GateTimeoutError(AssertionError):
    """A bounded wait on the gate ended without the state it waited for (the message says what it saw)."""


# ---------------------------------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class GateStep:
    """A step as the gate saw it: the plan decoded to the engine's values and, on the way back, its reply
    (``result``, or ``error`` when the executor answered a StepError)."""

    plan: StepPlan
    result: StepResult | None = None
    error: str | None = None

    @property
    def step_id(self) -> int:
        return self.plan.step_id

    def entry(self, request_id: str) -> StepEntry | None:
        """The entry of ``request_id`` in this step, or None when the step does not name it."""
        return next((e for e in self.plan.entries if e.request_id == request_id), None)

    def names(self, request_id: str) -> bool:
        return self.entry(request_id) is not None


@dataclass(frozen=True)
class TraceEvent:
    """One message the gate forwarded: ``kind`` is plan or release (towards the executor), result, released or
    error (towards the scheduler). ``step_id`` is 0 for releases; ``slots`` is empty for steps."""

    kind: str
    step_id: int = 0
    slots: tuple[int, ...] = ()


def _trace_event(message: Any) -> TraceEvent | None:
    if isinstance(message, pb.SessionRequest):
        kind = message.WhichOneof("kind")
        if kind == "plan":
            return TraceEvent("plan", message.plan.step_id)
        if kind == "release":
            return TraceEvent("release", slots=tuple(message.release.slots))
    elif isinstance(message, pb.SessionReply):
        kind = message.WhichOneof("kind")
        if kind == "result":
            return TraceEvent("result", message.result.step_id)
        if kind == "released":
            return TraceEvent("released", slots=tuple(message.released.slots))
        if kind == "error":
            return TraceEvent("error", message.error.step_id)
    return None


StepPredicate = Callable[[GateStep], bool]
StepSelector = StepPredicate | int | str  # a predicate, a step id, or a request id the step names


@dataclass(frozen=True)
class StepMatch:
    """A predicate over a :class:`GateStep` with a description (used in timeout messages)."""

    description: str
    test: Callable[[GateStep], bool]

    def __call__(self, step: GateStep) -> bool:
        return self.test(step)

    def __repr__(self) -> str:
        return self.description


def any_step() -> StepMatch:
    return StepMatch("any step", lambda s: True)


def step_id(sid: int) -> StepMatch:
    return StepMatch(f"step {sid}", lambda s: s.step_id == sid)


def naming(request_id: str) -> StepMatch:
    """A step with an entry for ``request_id``."""
    return StepMatch(f"a step naming {request_id}", lambda s: s.names(request_id))


def _entry_match(description: str, request_id: str, test: Callable[[StepEntry], bool]) -> StepMatch:
    def matches(step: GateStep) -> bool:
        entry = step.entry(request_id)
        return entry is not None and test(entry)

    return StepMatch(description, matches)


def middle_chunk(request_id: str) -> StepMatch:
    """A prefill chunk of ``request_id`` that samples nothing (C10)."""
    return _entry_match(f"a middle prefill chunk of {request_id}", request_id, lambda e: not e.sample)


def final_chunk(request_id: str) -> StepMatch:
    """The step holding ``request_id``'s last prefill chunk: its entry samples the first output token (ordinal 0)
    from prompt input (never a reference)."""
    return _entry_match(
        f"the final prefill chunk of {request_id}",
        request_id,
        lambda e: e.sample and e.ordinal == 0 and not e.input_ref,
    )


def decode(request_id: str, ordinal: int | None = None) -> StepMatch:
    """A decode step of ``request_id`` that samples output token ``ordinal`` (any decode when None).

    Plain decoding produces one token per step, so the decode sampling ordinal ``o`` is the one that builds on
    the run at ordinal ``o - 1`` (the entry names the run its pending input ends, engine/step.py)."""
    what = f"a decode step of {request_id}" + ("" if ordinal is None else f" at ordinal {ordinal}")
    return _entry_match(what, request_id, lambda e: e.input_ref and (ordinal is None or e.ordinal + 1 == ordinal))


def as_predicate(selector: StepSelector) -> StepPredicate:
    """A step id (int) or a request id (str) as a predicate; a predicate as itself."""
    if isinstance(selector, bool):
        raise TypeError("a step selector is a predicate, a step id or a request id, not a bool")
    if isinstance(selector, int):
        return step_id(selector)
    if isinstance(selector, str):
        return naming(selector)
    return selector


# ---------------------------------------------------------------------------------------------------- valves


class _End:
    """Closes a valve's stream, in order behind everything before it. ``status``: how the peer ended it."""

    def __init__(self, status: tuple[grpc.StatusCode, str] | None = None) -> None:
        self.status = status


@dataclass
class _Item:
    message: Any  # a proto message, or _End
    step: GateStep | None  # None: not a step (a release, its answer, the end); never held by a rule
    held: bool = False
    released: bool = False


@dataclass
class _Rules:
    predicates: list[StepPredicate] = field(default_factory=list)


class _Valve:
    """One direction of a session: a FIFO whose head leaves at once unless a hold rule stops it.

    The hold decision is made when a step reaches the head and sticks until the test releases it; everything
    behind a held head waits, so order is preserved. All state is guarded by the gate's condition, and
    ``deliver`` only puts into a queue, so it is called with the condition held.
    """

    def __init__(
        self, cond: threading.Condition, rules: _Rules, deliver: Callable[[Any], None], trace: list[TraceEvent]
    ) -> None:
        self._cond = cond
        self._rules = rules
        self._deliver = deliver
        self._trace = trace
        self._queue: deque[_Item] = deque()
        self.passed: list[GateStep] = []  # steps forwarded through this valve, in order
        self.errors: list[BaseException] = []

    def put(self, message: Any, step: GateStep | None) -> None:
        with self._cond:
            self._queue.append(_Item(message, step))
            self._pump()
            self._cond.notify_all()

    @property
    def held(self) -> GateStep | None:
        """The step held at the head, if any (callers hold the condition)."""
        head = self._queue[0] if self._queue else None
        return head.step if head is not None and head.held and not head.released else None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def release_head(self) -> GateStep:
        head = self._queue[0]
        assert head.held and head.step is not None
        head.released = True
        self._pump()
        self._cond.notify_all()
        return head.step

    def release_everything(self) -> None:
        for item in self._queue:
            item.released = True
        self._pump()
        self._cond.notify_all()

    def _pump(self) -> None:
        while self._queue:
            head = self._queue[0]
            if head.held and not head.released:
                return
            if head.step is not None and not head.released and self._stops(head.step):
                head.held = True
                return
            self._queue.popleft()
            if head.step is not None:
                self.passed.append(head.step)
            if (event := _trace_event(head.message)) is not None:
                self._trace.append(event)
            self._deliver(head.message)

    def _stops(self, step: GateStep) -> bool:
        try:
            return any(rule(step) for rule in self._rules.predicates)
        except Exception as exc:  # a broken predicate must not let the step slip through unnoticed
            self.errors.append(exc)
            return True


# ---------------------------------------------------------------------------------------------------- sessions


class _GateSession:
    """One scheduler session relayed to one executor session, message by message."""

    def __init__(self, gate: StepGate, stub: pb_grpc.ExecutorStub, context: grpc.ServicerContext) -> None:
        self._gate = gate
        self._context = context
        self._outbox: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[pb.SessionReply | _End] = queue.SimpleQueue()
        self.plans: dict[int, StepPlan] = {}  # this session's plans by step id, to pair replies with them
        self.launches = _Valve(gate.cond, gate.launch_rules, self._send_down, gate.trace_events)
        self.results = _Valve(gate.cond, gate.result_rules, self._replies.put, gate.trace_events)
        self._down = stub.Session(iter(self._outbox.get, None))

    def _send_down(self, message: Any) -> None:
        self._outbox.put(None if isinstance(message, _End) else message)

    def open(self) -> bool:
        """Relay the executor's answer to the session: its metadata when accepted, its status when refused."""
        metadata = tuple(self._down.initial_metadata() or ())
        if SESSION_METADATA_KEY not in dict(metadata):
            try:
                for _ in self._down:  # a refused session ends without a reply: read its status
                    pass
                code, details = grpc.StatusCode.UNAVAILABLE, "the executor ended the session before accepting it"
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
            self._context.abort(code, details)
            return False
        self._context.send_initial_metadata(metadata)
        self._context.add_callback(self._ended)
        return True

    def serve(self, upstream: Iterator[pb.SessionRequest]) -> Iterator[pb.SessionReply]:
        threading.Thread(target=self._read_up, args=(upstream,), name="gate-up", daemon=True).start()
        threading.Thread(target=self._read_down, name="gate-down", daemon=True).start()
        while not isinstance(item := self._replies.get(), _End):
            yield item
        if item.status is not None and item.status[0] is not grpc.StatusCode.CANCELLED:
            self._context.abort(*item.status)

    def _read_up(self, upstream: Iterator[pb.SessionRequest]) -> None:
        try:
            for msg in upstream:
                self.launches.put(msg, self._gate.launched(self, msg))
        except Exception as exc:  # the scheduler cancelled or vanished: the executor session ends too
            log.info("gate: scheduler side of the session ended: %r", exc)
        self.launches.put(_End(), None)  # a half-close reaches the executor behind everything held before it

    def _read_down(self) -> None:
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            for reply in self._down:
                self.results.put(reply, self._gate.answered(self, reply))
        except grpc.RpcError as exc:
            status = (exc.code(), exc.details() or "")
        self.results.put(_End(status), None)

    def _ended(self) -> None:
        """The scheduler's RPC is over (closed, cancelled or failed): stop the executor side and the relay."""
        self._down.cancel()
        self._replies.put(_End())


class _GateServicer(pb_grpc.ExecutorServicer):
    def __init__(self, gate: StepGate, stub: pb_grpc.ExecutorStub) -> None:
        self._gate = gate
        self._stub = stub

    def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        return _forward(self._stub.GetModelInfo, request, context)

    def GetState(self, request: pb.StateRequest, context: grpc.ServicerContext) -> pb.ExecutorState:
        return _forward(self._stub.GetState, request, context)

    def Session(
        self, request_iterator: Iterator[pb.SessionRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionReply]:
        session = _GateSession(self._gate, self._stub, context)
        if not session.open():
            return
        self._gate.session_started(session)
        yield from session.serve(request_iterator)


def _forward(method: Callable[..., _T], request: Any, context: grpc.ServicerContext) -> _T:
    remaining = context.time_remaining()
    timeout = FORWARD_TIMEOUT_S if remaining is None else min(remaining, FORWARD_TIMEOUT_S)
    try:
        return method(request, timeout=timeout, wait_for_ready=True)
    except grpc.RpcError as exc:
        context.abort(exc.code(), exc.details() or "")
        raise AssertionError("context.abort returned") from exc  # it always raises


# ---------------------------------------------------------------------------------------------------- the gate


class StepGate:
    """The gate server plus its control API (see the module docstring). Use as a context manager or call
    :meth:`stop`.

    Hold rules apply to the session open at the time (a reconnected scheduler gets a new session under the same
    rules); the launch and result records span every session. A rule is checked when a step reaches the head of
    its stream; a held step stays held until released, even if the rule is removed meanwhile.
    """

    def __init__(
        self, executor_target: str, host: str = "127.0.0.1", port: int = 0, wait_s: float = DEFAULT_WAIT_S
    ) -> None:
        self.wait_s = wait_s
        self.cond = threading.Condition()
        self.launch_rules = _Rules()
        self.result_rules = _Rules()
        self._launched: list[StepPlan] = []
        self._answered: list[GateStep] = []
        self.trace_events: list[TraceEvent] = []  # every message forwarded, both directions, in forwarding order
        self._sessions: list[_GateSession] = []
        self._channel = grpc.insecure_channel(executor_target)
        self._stub = pb_grpc.ExecutorStub(self._channel)
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="gate-rpc"))
        pb_grpc.add_ExecutorServicer_to_server(_GateServicer(self, self._stub), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"the gate cannot listen on {host}:{port}")
        self.target = f"{host}:{self.port}"
        self._server.start()

    # ------------------------------------------------------------------------------------ holding

    def hold_launches(self, selector: StepSelector) -> None:
        """Hold every later launch matching ``selector`` (and with it everything sent after it)."""
        with self.cond:
            self.launch_rules.predicates.append(as_predicate(selector))

    def hold_results(self, selector: StepSelector) -> None:
        """Hold every later reply to a step matching ``selector`` (and every reply after it)."""
        with self.cond:
            self.result_rules.predicates.append(as_predicate(selector))

    def stop_holding(self) -> None:
        """Remove every hold rule. Steps held now stay held until released."""
        with self.cond:
            self.launch_rules.predicates.clear()
            self.result_rules.predicates.clear()

    def release_next_launch(self, timeout: float | None = None) -> GateStep:
        """Let the launch held at the head go (waiting, bounded, until one is held); returns it."""
        return self._release_next("launch", timeout)

    def release_next_result(self, timeout: float | None = None) -> GateStep:
        """Let the reply held at the head go (waiting, bounded, until one is held); returns its step."""
        return self._release_next("result", timeout)

    def release_all(self) -> None:
        """Remove every rule and let everything held or queued go, in order."""
        with self.cond:
            self.stop_holding()
            for session in self._sessions:
                session.launches.release_everything()
                session.results.release_everything()

    def held_launch(self) -> GateStep | None:
        with self.cond:
            return self._valve("launch").held if self._sessions else None

    def held_result(self) -> GateStep | None:
        with self.cond:
            return self._valve("result").held if self._sessions else None

    # ------------------------------------------------------------------------------------ waiting

    def wait_for_launch(self, selector: StepSelector, timeout: float | None = None) -> StepPlan:
        """The first plan matching ``selector`` that reached the gate (held or forwarded)."""
        pred = as_predicate(selector)
        return self._wait(lambda: next((p for p in self._launched if pred(GateStep(p))), None), timeout, pred)

    def wait_for_launch_held(self, selector: StepSelector, timeout: float | None = None) -> GateStep:
        """Wait until the launch held at the head matches ``selector``."""
        return self._wait_held("launch", as_predicate(selector), timeout)

    def wait_for_result(self, selector: StepSelector, timeout: float | None = None) -> GateStep:
        """The first reply from the executor to a step matching ``selector`` (held or forwarded)."""
        pred = as_predicate(selector)
        return self._wait(lambda: next((s for s in self._answered if pred(s)), None), timeout, pred)

    def wait_for_result_held(self, selector: StepSelector, timeout: float | None = None) -> GateStep:
        """Wait until the reply held at the head belongs to a step matching ``selector``."""
        return self._wait_held("result", as_predicate(selector), timeout)

    # ------------------------------------------------------------------------------------ records

    def launched_steps(self) -> list[StepPlan]:
        """Every plan that reached the gate, in arrival order (held ones included)."""
        with self.cond:
            return list(self._launched)

    def returned_steps(self) -> list[GateStep]:
        """Every step whose reply the gate forwarded to the scheduler, in order."""
        with self.cond:
            return [s for session in self._sessions for s in session.results.passed]

    def trace(self) -> list[TraceEvent]:
        """Every message the gate forwarded, both directions, in the order it forwarded them (one global order:
        a reply the scheduler acted on precedes what the scheduler sent because of it)."""
        with self.cond:
            return list(self.trace_events)

    def executor_state(self, timeout: float = 10.0) -> pb.ExecutorState:
        """The real executor's GetState (not through the gate)."""
        return self._stub.GetState(pb.StateRequest(), timeout=timeout)

    # ------------------------------------------------------------------------------------ lifecycle

    def stop(self, grace: float = 1.0) -> None:
        self.release_all()
        self._server.stop(grace).wait(grace + 5.0)
        self._channel.close()

    def __enter__(self) -> StepGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ called by sessions

    def session_started(self, session: _GateSession) -> None:
        with self.cond:
            self._sessions.append(session)
            self.cond.notify_all()

    def launched(self, session: _GateSession, msg: pb.SessionRequest) -> GateStep | None:
        """Record a message from the scheduler; a plan is returned as a step (subject to hold rules)."""
        if msg.WhichOneof("kind") != "plan":
            return None
        try:
            plan = convert.plan_from_proto(msg.plan)
        except Exception:  # a plan the engine's values cannot express is forwarded as is, never held
            log.warning("gate: cannot decode plan %d", msg.plan.step_id, exc_info=True)
            return None
        with self.cond:
            session.plans[plan.step_id] = plan
            self._launched.append(plan)
        return GateStep(plan)

    def answered(self, session: _GateSession, reply: pb.SessionReply) -> GateStep | None:
        """Record a reply from the executor; the reply to a known plan is returned as a step."""
        kind = reply.WhichOneof("kind")
        with self.cond:
            if kind == "result":
                plan = session.plans.get(reply.result.step_id)
                step = None if plan is None else GateStep(plan, result=convert.result_from_proto(reply.result))
            elif kind == "error":
                plan = session.plans.get(reply.error.step_id)
                message = f"{reply.error.code}: {reply.error.message}"
                step = None if plan is None else GateStep(plan, error=message)
            else:
                step = None
            if step is not None:
                self._answered.append(step)
        return step

    # ------------------------------------------------------------------------------------ internals

    def _valve(self, direction: str) -> _Valve:
        session = self._sessions[-1]
        valve = session.launches if direction == "launch" else session.results
        if valve.errors:
            raise valve.errors[0]
        return valve

    def _release_next(self, direction: str, timeout: float | None) -> GateStep:
        with self.cond:
            self._wait_locked(
                lambda: self._sessions and self._valve(direction).held is not None, timeout, f"a held {direction}"
            )
            return self._valve(direction).release_head()

    def _wait_held(self, direction: str, pred: StepPredicate, timeout: float | None) -> GateStep:
        def held() -> GateStep | None:
            step = self._valve(direction).held if self._sessions else None
            return step if step is not None and pred(step) else None

        return self._wait(held, timeout, f"{pred!r} held at the {direction} head")

    def _wait(self, probe: Callable[[], _T | None], timeout: float | None, what: object) -> _T:
        with self.cond:
            return self._wait_locked(probe, timeout, what)

    def _wait_locked(self, probe: Callable[[], Any], timeout: float | None, what: object) -> Any:
        limit = self.wait_s if timeout is None else timeout
        value = self.cond.wait_for(probe, limit)
        if not value:
            raise GateTimeoutError(f"gate: not within {limit:.1f} s: {what}; {self._describe()}")
        return value

    def _describe(self) -> str:
        if not self._sessions:
            return "no session was ever opened"
        session = self._sessions[-1]
        last = self._launched[-1].step_id if self._launched else None
        return (
            f"last launched step {last}; launch head held: {session.launches.held} ({session.launches.queued} "
            f"queued); result head held: {session.results.held} ({session.results.queued} queued)"
        )


def entries_of(steps: Iterable[StepPlan], request_id: str) -> list[tuple[int, StepEntry]]:
    """(step id, entry) for every step in ``steps`` that names ``request_id``."""
    return [(p.step_id, e) for p in steps for e in p.entries if e.request_id == request_id]
