"""The executor service: one :class:`~engine.executor.runner.ModelRunner` served as ``ordinal.executor.v1.Executor``.

The event loop only reads, converts and answers; every step and release runs on the runner's worker
thread. A session's messages are launched in arrival order as soon as they are read (launch returns a
future at once), and a second coroutine answers those futures in the same order, so step N+1 is already
queued behind step N while N runs: the scheduler's overlap survives the process boundary.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc

from engine.errors import InvalidRequestError, ProtocolError
from engine.executor.runner import ModelRunner
from engine.model_info import ModelInfo
from engine.step import StepPlan, StepResult, StepTiming
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from services.executor import convert
from services.executor.convert import SESSION_METADATA_KEY
from services.executor.metrics import ExecutorMetrics
from services.grpc_common import SERVICE_SERVER_OPTIONS, StartedServer, start_serving

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Executor"].full_name
SERVER_OPTIONS = SERVICE_SERVER_OPTIONS


@dataclass(frozen=True)
class _Pending:
    """A session message being executed: ``future`` resolves on the worker thread, ``reply`` maps its value."""

    step_id: int  # 0 for a release or a malformed message
    future: Future[Any]
    reply: Callable[[Any], pb.SessionReply]


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Serves one runner to at most one scheduler session at a time.

    When a session ends (the scheduler closed it, vanished, or the server stops), every per-request buffer
    is dropped, queued behind the steps the session launched: a new session starts from nothing.
    """

    def __init__(self, runner: ModelRunner, metrics: ExecutorMetrics | None = None) -> None:
        self.runner = runner
        self._metrics = metrics
        self.instance_id = uuid.uuid4().hex
        self._info = convert.model_info_to_proto(runner.info, self.instance_id)
        self._session_open = False
        self._resets: list[Future[None]] = []  # buffer drops of ended sessions, still queued on the worker
        self._steps = 0
        self._forward_cpu = 0.0
        self._masked_steps = 0
        self._mask_wait = 0.0
        self._busy = 0.0
        self._before_forward = 0.0
        self._forward = 0.0
        self._draft = 0.0

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self._info

    async def GetState(self, request: pb.StateRequest, context: grpc.aio.ServicerContext) -> pb.ExecutorState:
        self._resets = [f for f in self._resets if not f.done()]
        return pb.ExecutorState(
            buffers=self.runner.num_buffers,
            steps=self._steps,
            # An ended session counts as open until its buffers are gone, so "closed" implies "0 buffers".
            session_open=self._session_open or bool(self._resets),
            forward_cpu_seconds=self._forward_cpu,
            masked_steps=self._masked_steps,
            mask_wait_seconds=self._mask_wait,
            busy_seconds=self._busy,
            before_forward_seconds=self._before_forward,
            forward_seconds=self._forward,
            draft_seconds=self._draft,
            draft_slots=self.runner.proposer_slots,
        )

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionReply]:
        if self._session_open:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "another scheduler session is open on this executor; one executor serves one scheduler",
            )
        self._session_open = True  # set before any await: the loop runs one handler at a time until then
        try:
            await context.send_initial_metadata(((SESSION_METADATA_KEY, self.instance_id),))
            pending: asyncio.Queue[_Pending | None] = asyncio.Queue()
            reader = asyncio.create_task(self._read(request_iterator, pending))
            try:
                while (item := await pending.get()) is not None:
                    yield await self._answer(item)
            finally:
                reader.cancel()
        finally:
            self._end_session()

    # ---------------------------------------------------------------- session internals

    async def _read(self, requests: AsyncIterator[pb.SessionRequest], out: asyncio.Queue[_Pending | None]) -> None:
        """Launch each message as it arrives, without waiting for the ones before it to finish."""
        try:
            async for msg in requests:
                out.put_nowait(self._start(msg))
        except Exception:  # the stream broke: the answering side ends the session after the pending answers
            log.warning("executor session stream failed", exc_info=True)
        finally:
            out.put_nowait(None)

    def _start(self, msg: pb.SessionRequest) -> _Pending:
        kind = msg.WhichOneof("kind")
        if kind == "plan":
            try:
                plan = convert.plan_from_proto(msg.plan)
                _check_plan(plan, self.runner.info)
            except (InvalidRequestError, ProtocolError) as exc:
                return _Pending(msg.plan.step_id, _failed(ProtocolError(str(exc))), _step_reply)
            future = self.runner.launch(plan)
            if self._metrics is not None:
                self._metrics.track_step(plan, future)
            return _Pending(plan.step_id, future, _step_reply)
        if kind == "release":
            slots = tuple(msg.release.slots)
            return _Pending(0, self.runner.release(slots), lambda _: _release_reply(slots))
        return _Pending(0, _failed(ProtocolError("a session message must carry a plan or a release")), _step_reply)

    async def _answer(self, item: _Pending) -> pb.SessionReply:
        try:
            value = await asyncio.wrap_future(item.future)
        except ProtocolError as exc:
            return _error_reply(item.step_id, "protocol", str(exc))
        except Exception as exc:  # a failed forward: report it, keep the session (later steps still run)
            log.exception("executor step %d failed", item.step_id)
            return _error_reply(item.step_id, "internal", f"{type(exc).__name__}: {exc}")
        if isinstance(value, StepResult):
            self._count(value.timing)
        return item.reply(value)

    def _count(self, timing: StepTiming) -> None:
        """Where the answered steps' time went (GetState): bench/spec.py and bench/flag_ab.py read it per step."""
        self._steps += 1
        self._forward_cpu += timing.forward_cpu
        self._busy += timing.done
        self._before_forward += timing.forward_started
        self._forward += timing.forward_seconds
        self._draft += timing.draft_seconds
        if (waited := timing.mask_wait_seconds) is not None:
            self._masked_steps += 1
            self._mask_wait += waited

    def _end_session(self) -> None:
        self._session_open = False
        self._resets.append(self.runner.reset())


def _check_plan(plan: StepPlan, info: ModelInfo) -> None:
    """Refuse values no scheduler may send before they reach the model, where they would be internal errors."""
    for entry in plan.entries:
        if entry.new is None and not entry.input_ids and entry.input_ref:
            continue  # a decode: its pages are checked below, all at once
        who = f"request {entry.request_id}"
        if entry.new is not None:
            entry.new.params.validate(info.vocab_size)
            _check_ids(entry.new.prompt_ids, info.vocab_size, f"{who}: prompt token")
        _check_ids(entry.input_ids, info.vocab_size, f"{who}: input token")
        if entry.input_ref and entry.input_ids:
            raise ProtocolError(f"{who}: a decode's input is its reference alone")
        if entry.num_tokens == 0:
            raise ProtocolError(f"{who}: an entry needs at least one input token")
    pages = [page for entry in plan.entries for page in entry.new_pages]
    if pages and max(pages) >= info.num_pages:
        bad = next(e for e in plan.entries if any(p >= info.num_pages for p in e.new_pages))
        _check_ids(bad.new_pages, info.num_pages, f"request {bad.request_id}: page")


def _check_ids(ids: tuple[int, ...], bound: int, what: str) -> None:
    bad = next((i for i in ids if i >= bound), None)
    if bad is not None:
        raise ProtocolError(f"{what} {bad} is outside [0, {bound})")


def _failed(exc: Exception) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


def _step_reply(result: StepResult) -> pb.SessionReply:
    return pb.SessionReply(result=convert.result_to_proto(result))


def _release_reply(slots: tuple[int, ...]) -> pb.SessionReply:
    return pb.SessionReply(released=pb.ReleaseDone(slots=slots))


def _error_reply(step_id: int, code: str, message: str) -> pb.SessionReply:
    return pb.SessionReply(error=pb.StepError(step_id=step_id, code=code, message=message))


# ---------------------------------------------------------------- serving


class ExecutorServer(StartedServer):
    """A started executor server. Stopping cancels an open session, which drops its buffers."""

    def __init__(self, server: grpc.aio.Server, port: int, servicer: ExecutorServicer, health: Any) -> None:
        super().__init__(server, port, health)
        self.servicer = servicer


async def start_executor(
    runner: ModelRunner, host: str = "127.0.0.1", port: int = 0, metrics: ExecutorMetrics | None = None
) -> ExecutorServer:
    """Serve ``runner`` (already loaded) on ``host:port`` (0 picks a free port) until stopped."""
    servicer = ExecutorServicer(runner, metrics)
    server, bound, health = await start_serving(
        lambda s: pb_grpc.add_ExecutorServicer_to_server(servicer, s), SERVICE_NAME, host, port, SERVER_OPTIONS
    )
    return ExecutorServer(server, bound, servicer, health)
