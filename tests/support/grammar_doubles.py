"""Grammar backends for tests: a base that forwards every call to a real backend, which the tests' probes, fault
injectors and recorders subclass to change the one thing they are about.

Wrapping also keeps a shared :class:`~engine.grammar.backend.LocalGrammar` alive across engines: ``Engine.shutdown``
shuts down only a backend that is a LocalGrammar itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import torch

from engine.constraint import Constraint
from engine.grammar_calls import CommitEntry, CommitOutcome, GrammarBackend, GrammarLoss, MaskEntry, MaskRefusals

Inner = TypeVar("Inner", bound=GrammarBackend)


class DelegatingGrammar(Generic[Inner]):
    """A :class:`GrammarBackend` that forwards every call to ``inner``."""

    def __init__(self, inner: Inner) -> None:
        self.inner = inner

    def open(self, request_id: str, constraint: Constraint) -> int:
        return self.inner.open(request_id, constraint)

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        return self.inner.commit(entries)

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self.inner.fill_masks_into(entries, deadline_s, out, starts)

    def release(self, request_ids: Sequence[str]) -> None:
        self.inner.release(request_ids)

    @property
    def num_open(self) -> int:
        return self.inner.num_open

    def take_loss(self, verify: bool = False) -> GrammarLoss | None:
        return self.inner.take_loss(verify)

    def unavailable(self) -> str | None:
        return self.inner.unavailable()
