"""The grammar service as the engine sees it: in process (:class:`LocalGrammar`) or over gRPC.

The scheduler opens a grammar per constrained request, commits each step's tokens (one batched call per step,
from the ordinal it starts at: C2) and releases it; the executor asks for fenced masks at an ordinal (C3), also
one batched call per step. Both sides talk to the same grammar state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from engine.grammar.compiler import CompilerConfig, ConstraintCompiler
from engine.grammar.constraint import Constraint
from engine.grammar.enforcement import EnforcementObserver
from engine.grammar.registry import (
    CommitEntry,
    CommitOutcome,
    FencedMasks,
    GrammarRegistry,
    MaskEntry,
    MaskRefusals,
)

DEFAULT_COMPILE_TIMEOUT_S = 30.0


class GrammarBackend(Protocol):
    def open(self, request_id: str, constraint: Constraint) -> None:
        """Compile (cached) and open a matcher at ordinal 0. Raises InvalidGrammarError (the grammar is bad:
        INVALID_ARGUMENT with xgrammar's reason), GrammarTimeoutError or GrammarProtocolError."""
        ...

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]: ...

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        """Fenced masks (C3) written into ``out`` [N, W] (entry i's rows from row ``starts[i]``); returns the
        refused entries by index. Raises only when the whole call fails (the service is unreachable)."""
        ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    @property
    def num_open(self) -> int: ...


class MaskWait(Protocol):
    """A mask batch asked for and not answered yet."""

    def result(self) -> MaskRefusals:
        """Block until answered (see :meth:`GrammarBackend.fill_masks_into`); raises only if the whole call failed."""
        ...

    def close(self) -> None:
        """The answer is not wanted any more (the step failed): stop writing into the buffer, free what it holds."""
        ...


@runtime_checkable
class FencingBackend(Protocol):
    """A backend that can open a step's mask fence now and answer it later, without a thread waiting at it."""

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskWait: ...


class LocalGrammar:
    """The grammar registry in this process (tests, benchmarks, a single-process engine).

    Built from a model folder lazily, on the first constrained request, so that an engine that never sees one
    never loads a tokenizer for xgrammar. ``config`` chooses, among others, the default JSON-schema mode;
    ``observer`` is told how JSON schemas are enforced (metrics)."""

    def __init__(
        self,
        model_dir: str,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        config: CompilerConfig | None = None,
        observer: EnforcementObserver | None = None,
    ) -> None:
        self._model_dir = model_dir
        self._compile_timeout_s = compile_timeout_s
        self._config = config if config is not None else CompilerConfig()
        self._observer = observer
        self._lock = threading.Lock()
        self._registry: GrammarRegistry | None = None

    @property
    def registry(self) -> GrammarRegistry:
        with self._lock:
            if self._registry is None:
                compiler = ConstraintCompiler.from_model_dir(self._model_dir, self._config)
                self._registry = GrammarRegistry(compiler, observer=self._observer)
            return self._registry

    def open(self, request_id: str, constraint: Constraint) -> None:
        self.registry.open(request_id, constraint, self._compile_timeout_s)

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        return self.registry.commit(entries)

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self.registry.fill_masks_into(entries, deadline_s, out, starts)

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> FencedMasks:
        """Open the fence now; the commits that arrive meanwhile fill it (:meth:`GrammarRegistry.start_masks`)."""
        return self.registry.start_masks(entries, deadline_s, out, starts)

    def release(self, request_ids: Sequence[str]) -> None:
        self.registry.release(request_ids)

    @property
    def num_open(self) -> int:
        with self._lock:
            return self._registry.num_open if self._registry is not None else 0

    def shutdown(self) -> None:
        with self._lock:
            if self._registry is not None:
                self._registry.compiler.shutdown()
