"""The link between the scheduler's front end and its engine process: the messages, and how they are framed.

The scheduler service runs as two processes (services/scheduler/__main__.py): the front end serves the public gRPC
API and writes every stream's chunks; the engine process runs the engine's loop (planning, the executor and grammar
calls, the commit). Writing a gRPC message costs the writer tens of microseconds of CPU; at 128 streams that is
several milliseconds per step, which in one process would be taken from the step loop. Here it is not: the engine
process sends one :class:`Outputs` message per commit, whatever the number of streams, and the front end fans it out.

Both processes run the same code version (one is started by the other), so a message is a pickled frozen value,
framed by its length (4 bytes, big-endian) on a Unix socket pair. Front end to engine: :class:`Submit`,
:class:`Abort`, :class:`Probe`, :class:`Shutdown`; engine to front end: :class:`Ready` (once), :class:`Outputs`,
:class:`ProbeAnswer`. The engine process never sends anything the front end did not cause, except outputs and stats.
"""

from __future__ import annotations

import enum
import pickle
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine.config import EngineConfig
from engine.constraint import Constraint
from engine.finish import AbortCause
from engine.model_info import ModelInfo
from engine.sampling_params import SamplingParams
from engine.scheduler.request import RequestOutput
from engine.scheduler.scheduler import SchedulerStats

_LENGTH = struct.Struct(">I")
MAX_MESSAGE_BYTES = 1 << 30  # a frame longer than this is a broken link, not a message


class ProbeKind(enum.Enum):
    """What a :class:`Probe` asks the engine process (each may wait on the network there)."""

    EXECUTOR_HEALTHY = "executor_healthy"  # StepRunner.healthy(): bool
    GRAMMAR_UNAVAILABLE = "grammar_unavailable"  # GrammarBackend.unavailable(): str | None


@dataclass(frozen=True)
class Submit:
    """Engine.submit, already validated by the front end (the same check the engine makes)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    constraint: Constraint | None
    with_text: bool


@dataclass(frozen=True)
class Abort:
    request_id: str
    message: str
    cause: AbortCause


@dataclass(frozen=True)
class Probe:
    probe_id: int
    kind: ProbeKind


@dataclass(frozen=True)
class Shutdown:
    """Shut the engine down and exit (its requests end with finish reason abort first)."""


@dataclass(frozen=True)
class Ready:
    """The engine is up: what the front end needs to serve (model facts, the pool, whether constraints can be)."""

    info: ModelInfo
    config: EngineConfig
    has_grammar: bool
    stats: SchedulerStats


_OutputRow = tuple[Any, ...]  # a RequestOutput's fields, in declaration order


@dataclass(frozen=True)
class Outputs:
    """One burst of the engine's sink calls (a commit's outputs), in order; ``stats`` when they changed since the
    last message (published before any of these outputs, as in one process).

    The outputs travel as plain tuples of their fields: pickle spends about ten times as long on a slotted
    dataclass (its reduce protocol, per object) as on the tuple of its fields, 204 vs 19 us for 128 outputs here."""

    rows: tuple[_OutputRow, ...]
    stats: SchedulerStats | None

    @classmethod
    def of(cls, outputs: Sequence[RequestOutput], stats: SchedulerStats | None) -> Outputs:
        return cls(tuple(_row(o) for o in outputs), stats)

    def outputs(self) -> list[RequestOutput]:
        return [RequestOutput(*row) for row in self.rows]


def _row(o: RequestOutput) -> _OutputRow:
    return (
        o.request_id, o.new_token_ids, o.text_delta, o.num_output_tokens, o.num_prompt_tokens, o.num_cached_tokens,
        o.logprobs, o.finish, o.output_ids, o.spec_draft_tokens, o.spec_accepted_tokens, o.spec_verify_steps,
    )  # fmt: skip


@dataclass(frozen=True)
class ProbeAnswer:
    probe_id: int
    value: bool | str | None
    error: str | None = None


ToEngine = Submit | Abort | Probe | Shutdown
FromEngine = Ready | Outputs | ProbeAnswer


# _row lists the fields by hand (a getattr loop costs more than the pickling it saves): keep it in step.
assert [f.name for f in fields(RequestOutput)] == [
    "request_id", "new_token_ids", "text_delta", "num_output_tokens", "num_prompt_tokens", "num_cached_tokens",
    "logprobs", "finish", "output_ids", "spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps",
], "RequestOutput's fields changed: update engine_link._row"  # fmt: skip


def frame(message: ToEngine | FromEngine) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def length_of(header: bytes) -> int:
    """The payload length a 4-byte header announces; ValueError for one no message has."""
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"a frame of {length} bytes: the engine link is broken")
    return length


def decode(payload: bytes) -> ToEngine | FromEngine:
    message: ToEngine | FromEngine = pickle.loads(payload)
    return message


HEADER_BYTES = _LENGTH.size


def receive(sock: socket.socket) -> ToEngine | FromEngine | None:
    """The next message from a blocking socket; None once the other side closed it."""
    header = _read_exactly(sock, HEADER_BYTES)
    if header is None:
        return None
    payload = _read_exactly(sock, length_of(header))
    if payload is None:
        return None
    return decode(payload)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
