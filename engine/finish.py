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
    """Who ended an aborted request; the services map each to a status (EXECUTOR, GRAMMAR_SERVICE: UNAVAILABLE)."""

    CLIENT = "client"
    EXECUTOR = "executor"  # the executor was lost (its KV with it) or did not come back in time
    GRAMMAR = "grammar"  # the grammar refused a token at commit (C13) or its mask never came (C3)
    # The grammar service was lost (the session the request's grammar lived in ended) or did not come back in time.
    GRAMMAR_SERVICE = "grammar_service"
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
