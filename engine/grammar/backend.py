"""The grammar service as the engine sees it: in process (:class:`LocalGrammar`) or over gRPC.

The scheduler opens a grammar per constrained request, commits each step's tokens (one batched call per step,
from the ordinal it starts at: C2) and releases it; the executor asks for fenced masks at an ordinal (C3), also
one batched call per step. Both sides talk to the same grammar state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from engine.constraint import Constraint
from engine.grammar.compiler import CompilerConfig, ConstraintCompiler
from engine.grammar.enforcement import EnforcementObserver
from engine.grammar.registry import FencedMasks, GrammarRegistry
from engine.grammar_calls import CommitEntry, CommitOutcome, GrammarLoss, MaskEntry, MaskRefusals

DEFAULT_COMPILE_TIMEOUT_S = 30.0


class LocalGrammar:
    """The grammar registry in this process (tests, benchmarks, a single-process engine).

    Built from a model folder lazily, on the first constrained request, so that an engine that never sees one
    never loads a tokenizer for xgrammar. ``config`` chooses, among others, the default JSON-schema mode;
    ``observer`` is told how JSON schemas are enforced (metrics). Its grammars live as long as the engine: one
    session (0) that never ends."""

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

    def open(self, request_id: str, constraint: Constraint) -> int:
        self.registry.open(request_id, constraint, self._compile_timeout_s)
        return 0

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        return self.registry.commit(entries)

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        return self.registry.fill_masks_into(entries, deadline_s, out, starts)

    computes_meanwhile = False  # FencingBackend: rows are computed on the commit's or the caller's thread

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

    def take_loss(self, verify: bool = False) -> GrammarLoss | None:
        return None  # in process, the grammars live and die with the engine

    def unavailable(self) -> str | None:
        return None

    def shutdown(self) -> None:
        with self._lock:
            if self._registry is not None:
                self._registry.compiler.shutdown()
