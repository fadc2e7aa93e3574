"""How a request ends: the reason, who ended an aborted one, and what matched."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    """Why a request produced no more tokens."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class AbortCause(enum.Enum):
    """Who ended an aborted request; the services map each to a status (EXECUTOR → UNAVAILABLE, ...)."""

    CLIENT = "client"
    EXECUTOR = "executor"
    GRAMMAR = "grammar"  # the grammar refused a token at commit (C13) or its mask never came (C3)
    INVALID_GRAMMAR = "invalid_grammar"  # the constraint does not compile: the request is refused (INVALID_ARGUMENT)
    SHUTDOWN = "shutdown"
    INTERNAL = "internal"


@dataclass(frozen=True)
class Finish:
    """A request's end: a stop token (``matched_token``), a stop string (``matched_stop``) or a limit.

    An ABORT names its ``cause`` and carries a ``message`` a person can act on."""

    reason: FinishReason
    matched_token: int | None = None
    matched_stop: str | None = None
    message: str | None = None
    cause: AbortCause | None = None
