"""Typed errors the engine raises; the services map each to one precise gRPC status."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request is malformed; raised before anything is allocated for it.

    ``field`` names the offending input so that a person can fix it (mapped to INVALID_ARGUMENT).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CheckpointError(ValueError):
    """A model folder cannot be loaded: missing file, unsupported architecture, shape mismatch."""


class ProtocolError(RuntimeError):
    """A peer broke a protocol contract (wrong ordinal, stale step, released slot)."""


class ExecutorUnavailableError(RuntimeError):
    """The executor cannot be reached or its session ended: every KV page and buffer it held is lost."""
