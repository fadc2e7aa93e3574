"""The model runner: executes step plans on the model and the physical KV pool, and samples.

It owns per-request buffers (sampling state and the last sampled token), indexed by the slot the scheduler
assigned. A plan entry whose input is not known to the scheduler yet (``input_ref``) is resolved here from
that buffer, so overlapped steps need no host round trip. Steps run strictly in launch order on one worker
thread; that order is what makes a reference to "the token this slot sampled last" well defined.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.errors import ProtocolError
from engine.grammar.backend import GrammarBackend
from engine.grammar.masks import MaskFetcher, PendingMasks, StepMasks
from engine.kv.pool import KVPool
from engine.model.embedded import ensure_embedded_model
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.tokenizer import Tokenizer
from engine.sampler import Sampler, SamplingState
from engine.step import SampledToken, StepEntry, StepPlan, StepResult


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about the executor's model (the executor reports it)."""

    model_path: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    page_size: int
    num_pages: int


class StepRunner(Protocol):
    """The executor as the scheduler's loop sees it: in process (:class:`ModelRunner`) or over gRPC.

    Steps run in launch order; a release is queued behind every step launched before it (C9)."""

    info: ModelInfo

    def launch(self, plan: StepPlan) -> Future[StepResult]: ...

    def release(self, slots: Sequence[int]) -> Future[None]: ...

    def shutdown(self) -> None: ...

    def healthy(self) -> bool:
        """True when the executor answers now (bounded wait)."""
        ...

    def take_loss(self) -> str | None:
        """Why the executor lost its state (KV, buffers) if no launched step has reported it yet; else None."""
        ...


@dataclass
class SlotBuffer:
    """The executor's per-request state, alive from a request's first entry until its slot is released."""

    request_id: str
    sampling: SamplingState
    last_token: int | None = None


class ModelRunner:
    """Runs one step at a time. :meth:`launch` queues a step on the worker thread and returns at once."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        info: ModelInfo,
        device: torch.device,
        masks: MaskFetcher | None = None,
    ) -> None:
        self.info = info
        self._masks = masks
        self._model = model
        self._kv = kv
        self._vocab_size = info.vocab_size
        self._eos = info.eos_token_ids
        self._device = device
        self._sampler = Sampler(info.vocab_size, device)
        self._slots: dict[int, SlotBuffer] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-runner")

    @classmethod
    def load(cls, config: EngineConfig, grammar: GrammarBackend | None = None) -> ModelRunner:
        """Load the model (the embedded default when ``config.model_path`` is None) and size the KV pool.

        ``grammar``: where constrained entries get their fenced masks (None: constrained entries are refused)."""
        device = torch.device(config.device)
        path = model_dir(config)
        tokenizer = Tokenizer.from_dir(path)
        model, model_config = load_model(path, config.torch_dtype, device)
        info = ModelInfo(
            model_path=str(path),
            vocab_size=model_config.vocab_size,
            max_context=model_config.max_position_embeddings,
            eos_token_ids=tokenizer.eos_token_ids | frozenset(model_config.eos_token_ids),
            bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            page_size=config.page_size,
            num_pages=config.num_pages,
        )
        kv = KVPool(
            model_config.num_layers,
            config.num_pages,
            config.page_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            config.torch_dtype,
            device,
        )
        masks = MaskFetcher(grammar, info.vocab_size, config.mask_wait_s) if grammar is not None else None
        return cls(model, kv, info, device, masks)

    # ------------------------------------------------------------ asynchronous interface

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        return self._worker.submit(self.execute, plan)

    def release(self, slots: Sequence[int]) -> Future[None]:
        """Free per-request buffers. Queued behind every launched step, so no in-flight step loses its buffer."""
        return self._worker.submit(self._release, tuple(slots))

    def reset(self) -> Future[None]:
        """Drop every per-request buffer (their scheduler is gone). Queued behind every launched step."""
        return self._worker.submit(self._slots.clear)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self._masks is not None:
            self._masks.shutdown()

    def healthy(self) -> bool:
        return not self._worker._shutdown

    def take_loss(self) -> str | None:
        return None  # in process, the executor's state lives and dies with the engine

    @property
    def num_buffers(self) -> int:
        return len(self._slots)

    # ------------------------------------------------------------ execution (worker thread)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        buffers = [self._buffer_for(entry) for entry in plan.entries]
        seqs = [self._seq_input(entry, buf) for entry, buf in zip(plan.entries, buffers, strict=True)]
        sampling = [(e, b) for e, b in zip(plan.entries, buffers, strict=True) if e.sample]
        self._check_ordinals(sampling)
        # C4, delayed sampling: the fenced masks are fetched while the forward runs; only sampling waits.
        pending = self._start_masks([e for e, _ in sampling])
        try:
            batch = ForwardBatch.build(seqs, self._kv.page_size, self._device)
            logits = self._model(batch, self._kv)  # [num sampling entries, V]
        except BaseException:
            if pending is not None:
                pending.close()  # an open fence would be filled by every later commit, into a buffer nobody reads
            raise
        masks = pending.result(self._device) if pending is not None else StepMasks(None, {})
        samples: tuple[SampledToken, ...] = ()
        if sampling:
            samples = self._sample(logits, sampling, masks)
        return StepResult(plan.step_id, samples, time.perf_counter() - started)

    def _start_masks(self, sampling: list[StepEntry]) -> PendingMasks | None:
        if self._masks is None:
            if any(e.constrained for e in sampling):
                raise ProtocolError("a constrained entry reached an executor started without a grammar service")
            return None
        return self._masks.start(sampling)

    def _buffer_for(self, entry: StepEntry) -> SlotBuffer:
        buf = self._slots.get(entry.slot)
        if entry.new is not None:
            if buf is not None:
                raise ProtocolError(f"slot {entry.slot} still holds request {buf.request_id}")
            state = SamplingState(
                entry.new.params,
                entry.new.prompt_ids,
                self._eos,
                self._vocab_size,
                self._device,
                entry.new.seed,
            )
            buf = SlotBuffer(entry.request_id, state)
            self._slots[entry.slot] = buf
            return buf
        if buf is None or buf.request_id != entry.request_id:
            raise ProtocolError(f"slot {entry.slot} does not hold request {entry.request_id}")
        return buf

    @staticmethod
    def _seq_input(entry: StepEntry, buf: SlotBuffer) -> SeqInput:
        if entry.input_ref:
            if buf.last_token is None:
                raise ProtocolError(f"request {entry.request_id}: input reference before any sample")
            tokens: Sequence[int] = (buf.last_token,)
        else:
            tokens = entry.input_ids
        mode = LogitsMode.LAST if entry.sample else LogitsMode.NONE
        return SeqInput(tokens, entry.start_pos, entry.page_table, mode)

    @staticmethod
    def _check_ordinals(rows: list[tuple[StepEntry, SlotBuffer]]) -> None:
        for entry, buf in rows:
            if buf.sampling.num_output != entry.ordinal:
                raise ProtocolError(
                    f"request {entry.request_id}: plan samples ordinal {entry.ordinal}, "
                    f"executor has sampled {buf.sampling.num_output}"
                )

    def _sample(
        self, logits: torch.Tensor, rows: list[tuple[StepEntry, SlotBuffer]], masks: StepMasks
    ) -> tuple[SampledToken, ...]:
        out = self._sampler.sample(logits, [buf.sampling for _, buf in rows], masks.bitmask)
        samples = []
        for i, (entry, buf) in enumerate(rows):
            token = out.token_ids[i]
            buf.sampling.record(token)
            buf.last_token = token
            samples.append(
                SampledToken(
                    request_id=entry.request_id,
                    ordinal=entry.ordinal,
                    token_id=token,
                    logprob=out.logprobs[i] if out.logprobs is not None else None,
                    top_logprobs=tuple(out.top_logprobs[i]) if out.top_logprobs is not None else None,
                    error=masks.errors.get(i),
                )
            )
        return tuple(samples)

    def _release(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            if self._slots.pop(slot, None) is None:
                raise ProtocolError(f"release of slot {slot}, which holds no request")


def model_dir(config: EngineConfig) -> Path:
    """The model folder ``config`` names: its ``model_path``, or the embedded default (built on first use)."""
    if config.model_path:
        return Path(config.model_path)
    return ensure_embedded_model(Path(config.cache_dir) if config.cache_dir else None)
