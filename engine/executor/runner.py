"""The model runner: executes step plans on the model and the physical KV pool, and samples.

It owns per-request buffers (sampling state, page table, sequence length and the last produced token), indexed
by the slot the scheduler assigned: the persistent half of the step protocol (engine/step.py). A plan entry whose
input is not known to the scheduler yet (``input_ref``) is resolved here from that buffer, so overlapped steps need
no host round trip, and positions come from the buffer's sequence length. Steps run strictly in launch order on
one worker thread; that order is what makes a reference to "the token this slot produced last" well defined.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import ProtocolError
from engine.executor.masks import MaskFetcher, PendingMasks, StepMasks
from engine.executor.sampler import Sampler, SamplingState
from engine.grammar_calls import GrammarBackend
from engine.kv.pool import KVPool
from engine.model.folder import model_dir
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.tokenizer import Tokenizer
from engine.model_info import ModelInfo
from engine.step import SampledRun, StepEntry, StepPlan, StepResult, StepTiming


@dataclass
class SlotBuffer:
    """The executor's per-request state, alive from a request's first entry until its slot is released.

    The persistent half of a step: the request's page table, how many of its KV positions hold accepted tokens
    (``seq_len``: a run is written right after them, C11), its last produced token whose KV no step has written
    yet (``pending``, the input of the next decode) and the ordinal its last run began at (``run_start``, what
    the next decode must name: C2)."""

    request_id: str
    sampling: SamplingState
    prompt: tuple[int, ...]
    pages: list[int]
    seq_len: int
    pending: int | None = None
    run_start: int = 0


@dataclass(frozen=True)
class ResolvedEntry:
    """One entry checked against its slot, before anything of the slot changes."""

    entry: StepEntry
    buffer: SlotBuffer
    tokens: tuple[int, ...]  # the input run
    start_pos: int
    pages: Sequence[int]  # the page table after this entry's new pages (the slot's own list when none are new)


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
        # Every entry is checked against its slot before any slot's state moves; only new requests are registered
        # first, even when the step is then refused or fails: the scheduler ends the step's requests and releases
        # their slots, which must exist.
        resolved = self._resolve(plan)
        sampling = [r for r in resolved if r.entry.sample]
        # C4, delayed sampling: the fenced masks are fetched while the forward runs; only sampling waits.
        masks_started = time.perf_counter() - started
        pending = self._start_masks(sampling)
        try:
            seqs = [SeqInput(r.tokens, r.start_pos, r.pages, _logits_mode(r.entry)) for r in resolved]
            batch = ForwardBatch.build(seqs, self._kv.page_size, self._device)
            forward_started = time.perf_counter() - started
            cpu = time.thread_time()
            logits = self._model(batch, self._kv)  # [num sampling entries, V]
        except BaseException:
            if pending is not None:
                pending.close()  # an open fence would be filled by every later commit, into a buffer nobody reads
            raise
        forward_cpu = time.thread_time() - cpu
        forward_done = time.perf_counter() - started
        masks = pending.result(self._device) if pending is not None else StepMasks(None, {})
        runs = self._sample(logits, sampling, masks) if sampling else ()
        self._advance(resolved)
        timing = StepTiming(
            masks_started if pending is not None else None,
            forward_started,
            forward_done,
            time.perf_counter() - started,
            forward_cpu,
        )
        return StepResult(plan.step_id, runs, timing)

    def _resolve(self, plan: StepPlan) -> list[ResolvedEntry]:
        if len({entry.slot for entry in plan.entries}) != len(plan.entries):
            raise ProtocolError(f"step {plan.step_id} names a slot twice")
        for entry in plan.entries:
            if entry.new is not None:
                self._register(entry)
        return [self._resolve_entry(entry) for entry in plan.entries]

    def _register(self, entry: StepEntry) -> None:
        held = self._slots.get(entry.slot)
        if held is not None:
            raise ProtocolError(f"slot {entry.slot} still holds request {held.request_id}")
        self._slots[entry.slot] = self._new_buffer(entry)

    def _resolve_entry(self, entry: StepEntry) -> ResolvedEntry:
        # Once per request per step: messages are built on the error paths only.
        buf = self._slots.get(entry.slot)
        if buf is None or buf.request_id != entry.request_id:
            raise ProtocolError(f"slot {entry.slot} does not hold request {entry.request_id}")
        if entry.num_draft:
            raise ProtocolError(
                f"request {entry.request_id}: {entry.num_draft} draft positions, but this executor has no draft "
                "proposer"
            )
        tokens = self._input_run(entry, buf)
        pages: Sequence[int] = (*buf.pages, *entry.new_pages) if entry.new_pages else buf.pages
        end = buf.seq_len + len(tokens)
        if len(pages) * self._kv.page_size < end:
            raise ProtocolError(f"request {entry.request_id}: {len(pages)} pages do not cover positions [0, {end})")
        return ResolvedEntry(entry, buf, tokens, buf.seq_len, pages)

    def _new_buffer(self, entry: StepEntry) -> SlotBuffer:
        new = entry.new
        assert new is not None
        if not 0 <= new.cached_len < len(new.prompt_ids):
            raise ProtocolError(
                f"request {entry.request_id}: cached_len {new.cached_len} must leave at least one of the "
                f"{len(new.prompt_ids)} prompt tokens to prefill"
            )
        state = SamplingState(new.params, new.prompt_ids, self._eos, self._vocab_size, self._device, new.seed)
        return SlotBuffer(entry.request_id, state, new.prompt_ids, [], new.cached_len)

    @staticmethod
    def _input_run(entry: StepEntry, buf: SlotBuffer) -> tuple[int, ...]:
        """The entry's input tokens, after checking that it builds on exactly the slot's state (C2)."""
        if entry.input_ref:
            if buf.pending is not None and entry.ordinal == buf.run_start and entry.sample:
                return (buf.pending,)  # a decode: the common case, decided first
            who = f"request {entry.request_id}"
            if buf.pending is None:
                raise ProtocolError(f"{who}: input reference before any sample")
            if entry.ordinal != buf.run_start:
                raise ProtocolError(
                    f"{who}: plan builds on the run at ordinal {entry.ordinal}, the executor's last run began at "
                    f"ordinal {buf.run_start}"
                )
            raise ProtocolError(f"{who}: a decode must sample")
        who = f"request {entry.request_id}"
        if buf.pending is not None:
            raise ProtocolError(
                f"{who}: literal input, but the slot's last token (run at ordinal {buf.run_start}) is still to be "
                "fed: a decode must reference it"
            )
        if entry.ordinal != 0 or not entry.input_ids:
            raise ProtocolError(f"{who}: a prefill chunk builds on ordinal 0 and carries prompt ids")
        end = buf.seq_len + len(entry.input_ids)
        if entry.sample != (end == len(buf.prompt)):
            raise ProtocolError(f"{who}: only the chunk that ends the prompt samples (C10)")
        expected = buf.prompt[buf.seq_len : end]
        if entry.input_ids != expected:
            raise ProtocolError(
                f"{who}: the chunk of {len(entry.input_ids)} tokens is not the prompt's continuation at position "
                f"{buf.seq_len} (C10: chunks in order, each once)"
            )
        return entry.input_ids

    def _start_masks(self, sampling: list[ResolvedEntry]) -> PendingMasks | None:
        rows = [(i, r.entry.request_id, r.buffer.sampling.num_output) for i, r in enumerate(sampling)]
        constrained = [row for row, r in zip(rows, sampling, strict=True) if r.entry.constrained]
        if self._masks is None:
            if constrained:
                raise ProtocolError("a constrained entry reached an executor started without a grammar service")
            return None
        return self._masks.start(constrained, len(sampling))

    def _sample(self, logits: torch.Tensor, rows: list[ResolvedEntry], masks: StepMasks) -> tuple[SampledRun, ...]:
        out = self._sampler.sample(logits, [r.buffer.sampling for r in rows], masks.bitmask)
        logprobs, tops, errors = out.logprobs, out.top_logprobs, masks.errors
        runs = []
        for i, r in enumerate(rows):  # once per sampled request per step: kept lean
            buf, token = r.buffer, out.token_ids[i]
            ordinal = buf.sampling.num_output
            buf.sampling.record(token)
            buf.pending, buf.run_start = token, ordinal
            runs.append(
                SampledRun(
                    r.entry.request_id,
                    ordinal,
                    (token,),
                    0,
                    0,
                    (logprobs[i],) if logprobs is not None else None,
                    (tuple(tops[i]),) if tops is not None else None,
                    errors.get(i) if errors else None,
                )
            )
        return tuple(runs)

    def _advance(self, resolved: list[ResolvedEntry]) -> None:
        """The step's KV is written: each slot's accepted positions grow by its run (C11), its pages are kept."""
        for r in resolved:
            buf = r.buffer
            if r.entry.new_pages:
                buf.pages.extend(r.entry.new_pages)
            buf.seq_len += len(r.tokens)

    def _release(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            if self._slots.pop(slot, None) is None:
                raise ProtocolError(f"release of slot {slot}, which holds no request")


def _logits_mode(entry: StepEntry) -> LogitsMode:
    return LogitsMode.LAST if entry.sample else LogitsMode.NONE
