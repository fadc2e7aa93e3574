"""The ``SglangScheduler`` servicer: SGLang's public gRPC API over the in-process :class:`Engine`.

It only translates and delegates; every behaviour lives in ``engine/``. Nothing here blocks the event loop:
``Engine.submit``, ``Engine.abort`` and ``Engine.stats`` never wait for the engine's loop (which may itself be
waiting for the executor or the grammar service), outputs arrive from the engine's loop thread through
``loop.call_soon_threadsafe``, and the calls that may wait (the executor health probe, reading the tokenizer
files) run in worker threads.

Abort is final the moment it answers. ``Generate`` and ``Abort`` are separate RPCs, so this servicer orders them
itself: an Abort for an id not in flight leaves a tombstone (bounded, :mod:`engine.tombstones`) that ends a later
``Generate`` with that id at once; an Abort of a stream in flight stops the stream's relay from writing anything the
engine produced, committed or not, and ends it with a Complete (finish reason abort) counting what the client
received, written before the Abort answers. See :meth:`SchedulerServicer.Abort` for what each answer means.

Status mapping (what the smg gateway turns into HTTP): bad input → INVALID_ARGUMENT naming the proto field,
before anything is allocated; a constraint xgrammar cannot compile → INVALID_ARGUMENT with xgrammar's reason
(before any chunk: the engine refuses it before any forward); missing features (and a constraint on a server
without a grammar service) → UNIMPLEMENTED; the executor lost mid-request, or the grammar service lost for a
constrained request (or either one not back within the outage timeout) → UNAVAILABLE naming the service (the gateway
retries); any other abort (an ``Abort`` RPC, shutdown, a token the grammar refused at commit) → a ``GenerateComplete``
whose finish_reason is ``"abort"`` (the proto has no field for the reason; it is logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.constraint import Constraint
from engine.errors import InvalidRequestError
from engine.finish import AbortCause, Finish, FinishReason
from engine.model.embedded import EMBEDDED_MODEL_NAME
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import OutputSink
from engine.scheduler.request import RequestOutput, TokenLogprob
from engine.scheduler.scheduler import SchedulerStats
from engine.scheduler.tombstones import TombstoneBounds, Tombstones
from services.scheduler import convert
from services.scheduler.convert import GenerateSpec, ModelLimits, ServedModel, ServerState
from services.scheduler.mailbox import Inbox, Mailbox
from services.scheduler.tokenizer_zip import build_tokenizer_zip, tokenizer_chunks

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name

_Outputs = Inbox[tuple[int, RequestOutput] | None]  # None: wake up, an Abort RPC won

ABORT_FLUSH_S = 1.0  # how long an Abort answer waits for its stream's final messages to be written


class ExecutorProbe(Protocol):
    def healthy(self) -> bool: ...


class GrammarProbe(Protocol):
    def unavailable(self) -> str | None: ...


class ServedEngine(Protocol):
    """What the servicer needs of an engine: an in-process :class:`~engine.scheduler.engine.Engine`, or the front
    end's handle on its engine process (services/scheduler/engine_proxy.py). ``submit`` and ``abort`` never wait;
    ``sink`` is called with each output, on whatever thread the engine delivers on."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def runner(self) -> ExecutorProbe: ...

    @property
    def grammar(self) -> GrammarProbe | None: ...

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
        request_id: str | None = None,
        constraint: Constraint | None = None,
        with_text: bool = True,
    ) -> str: ...

    def abort(self, request_id: str, message: str = ..., cause: AbortCause = ...) -> bool: ...

    def stats(self) -> SchedulerStats: ...


class ServiceLostError(Exception):
    """A sample ended because a service it needed (the executor, the grammar service) went away: the RPC ends with
    UNAVAILABLE, not with a Complete."""


class InvalidGrammarError(Exception):
    """A sample's constraint did not compile: the RPC ends with INVALID_ARGUMENT (``details``), not a Complete."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self.details = details


@dataclass(frozen=True)
class ServicerOptions:
    """``tombstones`` bounds the ids remembered for early and late aborts (see :mod:`engine.tombstones`).
    ``before_write`` is a test hook: awaited with the public request id before each message of a Generate stream is
    written (the moment an Abort RPC may win over outputs the engine already committed)."""

    tombstones: TombstoneBounds = field(default_factory=TombstoneBounds)
    before_write: Callable[[str], Awaitable[None]] | None = None


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """Serves one engine. Public request ids map to engine ids (``<id>-<i>`` per sample when n > 1)."""

    def __init__(
        self,
        engine: ServedEngine,
        model: ServedModel,
        executor: str | None = None,
        grammar: str | None = None,
        options: ServicerOptions | None = None,
    ) -> None:
        """``executor`` / ``grammar``: the services' addresses, for GetServerInfo (None: in process)."""
        self._engine = engine
        self._model = model
        self._executor = executor
        self._grammar = grammar if grammar is not None else ("in-process" if engine.grammar is not None else None)
        config = engine.config
        self._limits = ModelLimits(
            vocab_size=model.info.vocab_size,
            max_context=model.info.max_context,
            pool_tokens=config.num_pages * config.page_size,
            max_running=config.max_running,
        )
        self._version = ordinal_version()
        self._start_time = time.time()
        self._last_receive = 0.0
        self._inflight: dict[str, _Rpc] = {}  # public request id -> its RPC; event loop only
        options = options if options is not None else ServicerOptions()
        self._before_write = options.before_write
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}
        self._tombstones = Tombstones(options.tombstones)  # aborted before they arrived
        self._finished = Tombstones(options.tombstones)  # ended recently: a late Abort says so, leaving no tombstone
        self._tokenizer_zip: bytes | None = None

    # ------------------------------------------------------------------------------------ generation

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Written with context.write rather than as an async generator, so that a cancelled RPC raises
        # CancelledError right here and the engine requests are aborted at once, not when a generator is collected.
        self._last_receive = time.time()
        spec = await self._convert(request, context)
        # From here to the registration below nothing awaits, so an Abort RPC either ran before (and left a
        # tombstone) or runs after (and finds the RPC registered): there is no moment in between.
        early = self._tombstones.pop(spec.request_id)
        if early is not None:
            await self._end_before_start(spec, early, context)
            return
        if spec.request_id in self._inflight:
            await _refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: a request with id {spec.request_id!r} is already in flight",
            )
        rpc = _Rpc(_Samples(spec))
        self._inflight[spec.request_id] = rpc
        try:
            rpc.engine_ids = await self._submit(spec, rpc.outputs, context)
            await self._relay(rpc, context)
        except ServiceLostError as exc:
            await _refuse(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except InvalidGrammarError as exc:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc.details)
        finally:
            # Samples are left unfinished when the client cancelled the RPC (CancelledError), when one sample lost
            # the executor, or when an Abort RPC won: nobody will read the others, so stop them.
            del self._inflight[spec.request_id]
            self._finished.add(spec.request_id, rpc.samples.summary())
            rpc.closed.set()
            for index in rpc.samples.unfinished():
                self._engine.abort(rpc.engine_ids[index], "the RPC ended before this sample finished")

    async def _relay(self, rpc: _Rpc, context: grpc.aio.ServicerContext) -> None:
        """Write each sample's outputs until every sample is complete or an Abort RPC wins.

        Once ``rpc.aborted`` is set (by :meth:`Abort`, between two awaits of this coroutine) nothing more of the
        engine's outputs is written, even what the engine committed before the abort reached it: only a Complete
        with finish reason abort per open sample, counting the tokens this stream carried."""
        samples = rpc.samples
        hook = self._before_write  # None but in tests: then no coroutine per message just to read rpc.aborted
        while not samples.done and rpc.aborted is None:
            batch = await _delivered(rpc.outputs)
            for index, out in batch:
                samples.check_fatal(out)
                if samples.spec.stream and out.new_token_ids:
                    if (rpc.aborted is not None) if hook is None else not await self._may_write(rpc):
                        break
                    await context.write(samples.chunk(index, out))
                else:
                    samples.received(index, out)
                if out.finish is not None:
                    if (rpc.aborted is not None) if hook is None else not await self._may_write(rpc):
                        break
                    await context.write(samples.complete(index, out))
        if rpc.aborted is not None:
            for index in samples.unfinished():
                await context.write(samples.aborted(index))

    async def _may_write(self, rpc: _Rpc) -> bool:
        """Whether the relay may write the engine's next message: not once an Abort RPC won. Called only with the
        test hook set; without it the relay reads ``rpc.aborted`` itself (no coroutine per message)."""
        if self._before_write is not None:
            await self._before_write(rpc.samples.spec.request_id)
        return rpc.aborted is None

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The mailbox of the event loop serving this RPC (one per loop; a servicer normally sees one)."""
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = Mailbox(loop)
        return mailbox

    @property
    def num_tombstones(self) -> int:
        """Aborts remembered for requests that have not arrived (bounded by ``ServicerOptions.tombstones``)."""
        return len(self._tombstones)

    async def _end_before_start(self, spec: GenerateSpec, reason: str, context: grpc.aio.ServicerContext) -> None:
        """A request whose abort arrived first: every sample ends at once with finish reason abort, before anything
        is allocated or any forward runs."""
        log.info("request %s was aborted before it arrived (%s): ending it at once", spec.request_id, reason)
        samples = _Samples(spec)
        for index in samples.unfinished():
            await context.write(samples.aborted(index))
        self._finished.add(spec.request_id, samples.summary())

    async def _convert(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerateSpec:
        try:
            spec = convert.generate_spec(request, self._limits)
        except InvalidRequestError as exc:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, convert.invalid_details(exc))
        except convert.UnsupportedRequestError as exc:
            await _refuse(context, grpc.StatusCode.UNIMPLEMENTED, str(exc))
        if spec.constraint is not None and self._engine.grammar is None:
            await _refuse(
                context,
                grpc.StatusCode.UNIMPLEMENTED,
                f"sampling_params.{spec.constraint_field}: constrained decoding needs a grammar service; "
                "start the scheduler (and its executor) with --grammar HOST:PORT",
            )
        return spec

    async def _submit(
        self, spec: GenerateSpec, outputs: _Outputs, context: grpc.aio.ServicerContext
    ) -> tuple[str, ...]:
        """Submit every sample, or none: a refused sample aborts the ones already submitted."""
        mailbox = self._mailbox(asyncio.get_running_loop())
        submitted: list[str] = []
        try:
            for index, engine_id in enumerate(spec.engine_ids()):
                sink = _sink(mailbox, outputs, index)
                # Token ids are all this API streams: no text is decoded unless stop strings need it.
                self._engine.submit(
                    spec.prompt_ids, spec.params, sink, engine_id, constraint=spec.constraint, with_text=False
                )
                submitted.append(engine_id)
        except InvalidRequestError as exc:
            self._abort_all(submitted, "another sample of the request was refused")
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, convert.invalid_details(exc))
        except RuntimeError as exc:  # the engine is shutting down
            self._abort_all(submitted, "the server is shutting down")
            await _refuse(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        return tuple(submitted)

    def _abort_all(self, engine_ids: list[str], message: str) -> None:
        for engine_id in engine_ids:
            self._engine.abort(engine_id, message)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """End a request's stream with finish reason abort, whatever the engine is doing; never waits for it.

        The answer says whether more tokens can come. ``success`` true: the request was in flight; its stream
        carried the tokens the message counts and then carries nothing but a Complete with finish reason abort,
        already written when this answers. ``success`` false: there is nothing to abort, and nothing more will come
        either: the request already finished (its stream is complete), or no request with this id has arrived yet,
        in which case the abort is remembered (a tombstone) and a ``Generate`` with this id arriving within
        ``ttl_s`` seconds ends at once with finish reason abort."""
        rid = request.request_id
        reason = request.reason or "aborted by an Abort RPC"
        rpc = self._inflight.get(rid)
        if rpc is None:
            ended = self._finished.get(rid)
            if ended is not None:
                return pb.AbortResponse(success=False, message=f"request {rid!r} already finished ({ended})")
            self._tombstones.add(rid, reason)
            return pb.AbortResponse(
                success=False,
                message=f"no request with id {rid!r} is in flight; the abort is remembered: a Generate with this id "
                f"arriving within {self._tombstones.bounds.ttl_s:g} s ends at once with finish reason abort",
            )
        if rpc.aborted is None:
            if rpc.samples.done:  # every Complete is already on its way: the request ended normally
                return pb.AbortResponse(success=False, message=f"request {rid!r} already finished")
            rpc.abort(reason)
            for engine_id in rpc.engine_ids:
                self._engine.abort(engine_id, reason)
        # Answer once the stream's final messages are written, so that they travel before this answer; bounded,
        # for a client that stopped reading its stream.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rpc.closed.wait(), ABORT_FLUSH_S)
        return pb.AbortResponse(
            success=True,
            message=f"request {rid!r} aborted after {rpc.samples.num_streamed} streamed tokens; nothing follows but "
            "its final message (finish reason abort)",
        )

    # ------------------------------------------------------------------------------------ health and info

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        """Healthy while the executor answers; the message also says what is degraded: a grammar service that is
        unavailable costs only constrained requests, so it does not make the worker unhealthy."""
        (healthy, executor), grammar = await asyncio.gather(executor_health(self._engine), grammar_health(self._engine))
        return pb.HealthCheckResponse(healthy=healthy, message=f"{executor}; {grammar}")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return convert.model_info_response(self._model)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        state = ServerState(self._version, self._start_time, self._last_receive, self._executor, self._grammar)
        stats = self._engine.stats()
        return convert.server_info_response(self._engine.config, self._model, stats, state, time.time())

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await _refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank: {request.dp_rank} does not exist (only 0)"
            )
        stats = self._engine.stats()
        return convert.loads_response(stats, self._engine.config, list(request.include), self._version, time.time())

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        data = self._tokenizer_zip
        if data is None:
            folder = Path(self._model.info.model_path)
            try:
                data = await asyncio.to_thread(build_tokenizer_zip, folder)
            except OSError as exc:
                await _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, f"cannot serve the tokenizer: {exc}")
            self._tokenizer_zip = data  # the files do not change while the server runs
        for chunk in tokenizer_chunks(data):
            yield chunk

    # ------------------------------------------------------------------------------------ not served

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "Embed", "this server serves generation models only")

    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "FlushCache", "the prefix cache cannot be flushed on demand yet")

    async def StartProfile(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "StartProfile", "profiling is not available")

    async def StopProfile(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "StopProfile", "profiling is not available")

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "SubscribeKvEvents", "KV cache events are not published; poll GetLoads")

    async def LoadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "LoadLoRAAdapter", "LoRA adapters are not supported")

    async def UnloadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "UnloadLoRAAdapter", "LoRA adapters are not supported")

    async def ListLoadedLoRAAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
        await _unimplemented(context, "ListLoadedLoRAAdapters", "LoRA adapters are not supported")


@dataclass(eq=False)
class _Rpc:
    """One Generate RPC as the event loop sees it. ``aborted``: the reason, once an Abort RPC won; from then on the
    relay writes nothing of the engine's outputs. ``closed`` is set when the RPC's handler is done."""

    samples: _Samples
    engine_ids: tuple[str, ...] = ()
    outputs: _Outputs = field(default_factory=Inbox)
    aborted: str | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def abort(self, reason: str) -> None:
        self.aborted = reason
        self.outputs.put(None)  # wakes the relay if it waits for an output


class _Samples:
    """The messages of one RPC's samples, and what each sample's client has received so far.

    Counts move when a message is built, which the relay does right before writing it: a message not written
    because an abort won counts nothing."""

    def __init__(self, spec: GenerateSpec) -> None:
        self.spec = spec
        self._tokens: list[list[int]] = [[] for _ in range(spec.n)]  # received by the client (or to be, in a Complete)
        self._logprobs: list[list[TokenLogprob]] = [[] for _ in range(spec.n)]
        self._open = set(range(spec.n))
        self._finishes: list[str] = []

    @property
    def done(self) -> bool:
        return not self._open

    @property
    def num_streamed(self) -> int:
        return sum(len(t) for t in self._tokens)

    def unfinished(self) -> list[int]:
        return sorted(self._open)

    def summary(self) -> str:
        return ", ".join(self._finishes) or "no sample finished"

    def check_fatal(self, out: RequestOutput) -> None:
        """Raise for a finish that ends the RPC with a status instead of a Complete."""
        finish = out.finish
        if finish is None or finish.reason is not FinishReason.ABORT:
            return
        if finish.cause is AbortCause.EXECUTOR:
            raise ServiceLostError(finish.message or "the executor is unavailable")
        if finish.cause is AbortCause.GRAMMAR_SERVICE:
            raise ServiceLostError(finish.message or "the grammar service is unavailable")
        if finish.cause is AbortCause.INVALID_GRAMMAR:
            raise InvalidGrammarError(convert.invalid_grammar_details(self.spec.constraint_field, finish.message))

    def received(self, index: int, out: RequestOutput) -> None:
        """Record ``out``'s tokens without streaming them (a non-streaming RPC returns them in its Complete)."""
        self._tokens[index].extend(out.new_token_ids)
        if self.spec.params.logprobs:
            self._logprobs[index].extend(out.logprobs)

    def chunk(self, index: int, out: RequestOutput) -> pb.GenerateResponse:
        self.received(index, out)
        wants = self.spec.params.logprobs
        return convert.chunk_response(self.spec.request_id, index, out, len(self._tokens[index]), wants)

    def complete(self, index: int, out: RequestOutput) -> pb.GenerateResponse:
        assert out.finish is not None
        self._close(index, out.finish.reason.value)
        if out.finish.reason is FinishReason.ABORT:
            log.info("request %s sample %d aborted: %s", self.spec.request_id, index, out.finish.message)
        logprobs = self._logprobs[index] if self.spec.params.logprobs else None
        return convert.complete_response(self.spec.request_id, index, out, logprobs)

    def aborted(self, index: int) -> pb.GenerateResponse:
        """The Complete of a sample an Abort RPC ended: exactly the tokens its client received, finish reason
        abort (the engine may have committed more, or finished the sample, after the abort won here)."""
        self._close(index, FinishReason.ABORT.value)
        tokens = tuple(self._tokens[index])
        out = RequestOutput(
            self.spec.request_id,
            (),
            "",
            len(tokens),
            len(self.spec.prompt_ids),
            0,
            finish=Finish(FinishReason.ABORT, message="aborted by an Abort RPC", cause=AbortCause.CLIENT),
            output_ids=tokens,
        )
        logprobs = self._logprobs[index] if self.spec.params.logprobs else None
        return convert.complete_response(self.spec.request_id, index, out, logprobs)

    def _close(self, index: int, reason: str) -> None:
        self._open.discard(index)
        self._finishes.append(reason if self.spec.n == 1 else f"sample {index}: {reason}")


async def _delivered(outputs: _Outputs) -> list[tuple[int, RequestOutput]]:
    """The outputs delivered so far: one at least (waiting for it), and every one queued behind it, merged into
    one output per sample. A stream that keeps up gets each token at once; one that fell behind (its writes
    waited) gets the tokens it missed in one chunk instead of one message each. Empty when an abort woke it."""
    items = await outputs.take_all()
    if len(items) == 1:  # a stream that keeps up: its one output of this step
        return [items[0]] if items[0] is not None else []
    merged: dict[int, RequestOutput] = {}
    for item in items:
        if item is None:
            return []  # an Abort RPC won: nothing more of the engine's is written
        index, out = item
        before = merged.get(index)
        merged[index] = out if before is None else _merge(before, out)
    return list(merged.items())


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one sample as one (the later one's counts, finish and final ids)."""
    return replace(
        then,
        new_token_ids=first.new_token_ids + then.new_token_ids,
        text_delta=first.text_delta + then.text_delta,
        logprobs=first.logprobs + then.logprobs,
    )


def _sink(mailbox: Mailbox, outputs: _Outputs, index: int) -> OutputSink:
    """An engine sink (called on the engine's loop thread) that hands outputs to the RPC's event loop."""

    def deliver(out: RequestOutput) -> None:
        mailbox.post(outputs, (index, out))

    return deliver


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it always raises


async def _unimplemented(context: grpc.aio.ServicerContext, rpc: str, why: str) -> NoReturn:
    await _refuse(context, grpc.StatusCode.UNIMPLEMENTED, f"{rpc} is not implemented by this server: {why}")


async def executor_health(engine: ServedEngine) -> tuple[bool, str]:
    """Ask the executor whether it answers (off the event loop: the probe may wait on the network)."""
    try:
        healthy = await asyncio.to_thread(engine.runner.healthy)
    except Exception as exc:  # a failing probe means unhealthy, never a failed health RPC
        return False, f"executor health probe failed: {exc}"
    return healthy, "executor answers" if healthy else "executor does not answer"


async def grammar_health(engine: ServedEngine) -> str:
    """What the grammar service's state means for requests (off the event loop: the probe may wait on the network)."""
    if engine.grammar is None:
        return "no grammar service: constrained requests are refused"
    try:
        problem = await asyncio.to_thread(engine.grammar.unavailable)
    except Exception as exc:
        problem = f"its health probe failed: {exc}"
    if problem is None:
        return "grammar service answers"
    return f"degraded: constrained requests fail with UNAVAILABLE until the grammar service is back ({problem})"


def served_model(info: ModelInfo, name: str | None = None) -> ServedModel:
    """Describe the executor's model; ``name`` defaults to the embedded model's name or the folder name."""
    folder = Path(info.model_path)
    config = _read_json(folder / "config.json")
    architectures = config.get("architectures")
    return ServedModel(
        name=name or default_served_model_name(info),
        info=info,
        model_type=str(config.get("model_type") or ""),
        architectures=tuple(str(a) for a in architectures) if isinstance(architectures, list) else (),
    )


def default_served_model_name(info: ModelInfo) -> str:
    folder = Path(info.model_path).name
    # The embedded model lives in a versioned cache folder (<name>-v<format>-<hash>); clients want its name.
    return EMBEDDED_MODEL_NAME if folder.startswith(f"{EMBEDDED_MODEL_NAME}-v") else folder


def ordinal_version() -> str:
    try:
        return f"ordinal {metadata.version('ordinal')}"
    except metadata.PackageNotFoundError:
        return "ordinal (not installed)"


def _read_json(path: Path) -> dict[str, Any]:
    """Best effort: the folder may live only on the executor's machine."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
