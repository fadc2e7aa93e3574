"""The ``SglangScheduler`` servicer: SGLang's public gRPC API over the in-process :class:`Engine`.

It only translates and delegates; every behaviour lives in ``engine/``. Nothing here blocks the event loop:
``Engine.submit`` and ``Engine.abort`` are cheap, outputs arrive from the engine's loop thread through
``loop.call_soon_threadsafe``, and the calls that may wait (the executor health probe, reading the tokenizer
files) run in worker threads.

Status mapping (what the smg gateway turns into HTTP): bad input → INVALID_ARGUMENT naming the proto field,
before anything is allocated; a constraint xgrammar cannot compile → INVALID_ARGUMENT with xgrammar's reason
(before any chunk: the engine refuses it before any forward); missing features (and a constraint on a server
without a grammar service) → UNIMPLEMENTED; the executor lost mid-request → UNAVAILABLE (the gateway retries);
any other abort (an ``Abort`` RPC, shutdown, a token the grammar refused at commit) → a ``GenerateComplete``
whose finish_reason is ``"abort"`` (the proto has no field for the reason; it is logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.engine import Engine, OutputSink
from engine.errors import InvalidRequestError
from engine.model.embedded import EMBEDDED_MODEL_NAME
from engine.request import RequestOutput, TokenLogprob
from engine.runner import ModelInfo
from engine.stop import AbortCause, FinishReason
from services.scheduler import convert
from services.scheduler.convert import GenerateSpec, ModelLimits, ServedModel, ServerState
from services.scheduler.tokenizer_zip import build_tokenizer_zip, tokenizer_chunks

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name

_Outputs = asyncio.Queue[tuple[int, RequestOutput]]


class ExecutorLostError(Exception):
    """A sample ended because the executor went away: the RPC ends with UNAVAILABLE, not with a Complete."""


class InvalidGrammarError(Exception):
    """A sample's constraint did not compile: the RPC ends with INVALID_ARGUMENT (``details``), not a Complete."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self.details = details


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    """Serves one engine. Public request ids map to engine ids (``<id>-<i>`` per sample when n > 1)."""

    def __init__(
        self, engine: Engine, model: ServedModel, executor: str | None = None, grammar: str | None = None
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
        self._inflight: dict[str, tuple[str, ...]] = {}  # public request id -> engine ids; event loop only
        self._tokenizer_zip: bytes | None = None

    # ------------------------------------------------------------------------------------ generation

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Written with context.write rather than as an async generator, so that a cancelled RPC raises
        # CancelledError right here and the engine requests are aborted at once, not when a generator is collected.
        self._last_receive = time.time()
        spec = await self._convert(request, context)
        if spec.request_id in self._inflight:
            await _refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: a request with id {spec.request_id!r} is already in flight",
            )
        outputs: _Outputs = asyncio.Queue()
        ids = await self._submit(spec, outputs, context)
        self._inflight[spec.request_id] = ids
        samples = _Samples(spec)
        try:
            while not samples.done:
                index, out = await outputs.get()
                for response in samples.responses(index, out):
                    await context.write(response)
        except ExecutorLostError as exc:
            await _refuse(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except InvalidGrammarError as exc:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc.details)
        finally:
            # Samples are left unfinished when the client cancelled the RPC (CancelledError) or when one sample
            # lost the executor: nobody will read the others, so stop them.
            del self._inflight[spec.request_id]
            for index in samples.unfinished():
                self._engine.abort(ids[index], "the RPC ended before this sample finished (client cancelled)")

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
        loop = asyncio.get_running_loop()
        submitted: list[str] = []
        try:
            for index, engine_id in enumerate(spec.engine_ids()):
                sink = _sink(loop, outputs, index)
                self._engine.submit(spec.prompt_ids, spec.params, sink, engine_id, constraint=spec.constraint)
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
        """Abort every sample of a request in flight; its stream then ends with finish_reason "abort"."""
        ids = self._inflight.get(request.request_id)
        if ids is None:
            return pb.AbortResponse(success=False, message=f"no request with id {request.request_id!r} is in flight")
        reason = request.reason or "aborted by an Abort RPC"
        live = [self._engine.abort(engine_id, reason) for engine_id in ids]
        if not any(live):
            return pb.AbortResponse(success=False, message=f"request {request.request_id!r} already finished")
        return pb.AbortResponse(success=True, message=f"request {request.request_id!r} aborted")

    # ------------------------------------------------------------------------------------ health and info

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        healthy, message = await executor_health(self._engine)
        return pb.HealthCheckResponse(healthy=healthy, message=message)

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


class _Samples:
    """Turns the engine outputs of one RPC's samples into responses, and knows which samples are still open."""

    def __init__(self, spec: GenerateSpec) -> None:
        self._spec = spec
        self._streamed = [0] * spec.n  # output tokens sent in chunks, per sample
        self._logprobs: list[list[TokenLogprob]] = [[] for _ in range(spec.n)]
        self._open = set(range(spec.n))

    @property
    def done(self) -> bool:
        return not self._open

    def unfinished(self) -> list[int]:
        return sorted(self._open)

    def responses(self, index: int, out: RequestOutput) -> list[pb.GenerateResponse]:
        spec = self._spec
        finish = out.finish
        if finish is not None:
            self._open.discard(index)
            if finish.reason is FinishReason.ABORT and finish.cause is AbortCause.EXECUTOR:
                raise ExecutorLostError(finish.message or "the executor is unavailable")
            if finish.reason is FinishReason.ABORT and finish.cause is AbortCause.INVALID_GRAMMAR:
                raise InvalidGrammarError(convert.invalid_grammar_details(spec.constraint_field, finish.message))
        wants_logprobs = spec.params.logprobs
        if wants_logprobs:
            self._logprobs[index].extend(out.logprobs)
        messages: list[pb.GenerateResponse] = []
        # The last token travels in a chunk too: a streaming client reads text from chunks only.
        if spec.stream and out.new_token_ids:
            self._streamed[index] += len(out.new_token_ids)
            messages.append(convert.chunk_response(spec.request_id, index, out, self._streamed[index], wants_logprobs))
        if finish is not None:
            if finish.reason is FinishReason.ABORT:
                log.info("request %s sample %d aborted: %s", spec.request_id, index, finish.message)
            logprobs = self._logprobs[index] if wants_logprobs else None
            messages.append(convert.complete_response(spec.request_id, index, out, logprobs))
        return messages


def _sink(loop: asyncio.AbstractEventLoop, outputs: _Outputs, index: int) -> OutputSink:
    """An engine sink (called on the engine's loop thread) that hands outputs to the RPC's event loop."""

    def deliver(out: RequestOutput) -> None:
        # A closed event loop raises RuntimeError: the server is gone and nobody reads this stream any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(outputs.put_nowait, (index, out))

    return deliver


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it always raises


async def _unimplemented(context: grpc.aio.ServicerContext, rpc: str, why: str) -> NoReturn:
    await _refuse(context, grpc.StatusCode.UNIMPLEMENTED, f"{rpc} is not implemented by this server: {why}")


async def executor_health(engine: Engine) -> tuple[bool, str]:
    """Ask the executor whether it answers (off the event loop: the probe may wait on the network)."""
    try:
        healthy = await asyncio.to_thread(engine.runner.healthy)
    except Exception as exc:  # a failing probe means unhealthy, never a failed health RPC
        return False, f"executor health probe failed: {exc}"
    return healthy, "executor answers" if healthy else "executor does not answer"


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
