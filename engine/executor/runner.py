"""The model runner: executes step plans on the model and the physical KV pool, and samples.

It owns per-request buffers (sampling state, page table, sequence length and the last produced token), indexed
by the slot the scheduler assigned: the persistent half of the step protocol (engine/step.py). A plan entry whose
input is not known to the scheduler yet (``input_ref``) is resolved here from that buffer, so overlapped steps need
no host round trip, and positions come from the buffer's sequence length. Steps run strictly in launch order on
one worker thread; that order is what makes a reference to "the token this slot produced last" well defined.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.errors import ProtocolError
from engine.executor.masks import DraftMasks, MaskFetcher, MaskRequest, PendingMasks, StepMasks
from engine.executor.proposer import NO_DRAFT, Draft, DraftGrammar, DraftRequest, Proposer
from engine.executor.proposers import load_proposer
from engine.executor.sampler import Sampler, SamplingState
from engine.executor.verify import Verdict, Verifier, VerifyItem
from engine.grammar_calls import MaskSource
from engine.kv.page_table import PageTable
from engine.kv.pool import KVPool
from engine.model.attention_backend import attention_backend
from engine.model.folder import model_dir
from engine.model.forward_batch import ForwardBatch, LogitsMode, PageRows, SeqInput
from engine.model.graphs import DecodeGraphs, GraphMode
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.panel_linear import pack_for_cpu
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
    tokens: list[int] = field(default_factory=list)  # prompt then outputs: what a proposer drafts from

    def produced(self, run: Sequence[int], ordinal: int) -> None:
        """The tokens of a run sampled at ``ordinal``: recorded, the last one pending."""
        for token in run:
            self.sampling.record(token)
        self.tokens.extend(run)
        self.pending, self.run_start = run[-1], ordinal


@dataclass(slots=True)  # not frozen: one per entry per step on the hot path (see engine/step.py)
class ResolvedEntry:
    """One entry checked against its slot, before anything of the slot changes."""

    entry: StepEntry
    buffer: SlotBuffer
    tokens: tuple[int, ...]  # the input run (without draft positions)
    start_pos: int
    pages: Sequence[int]  # the page table after this entry's new pages (the slot's own list when none are new)


@dataclass(frozen=True)
class StepDrafts:
    """The drafts of one step's entries (aligned with them; NO_DRAFT where none), and the time they took."""

    drafts: list[Draft]
    seconds: float = 0.0
    any: bool = False  # some entry has a draft (set by :meth:`ModelRunner._propose`)


class ModelRunner:
    """Runs one step at a time. :meth:`launch` queues a step on the worker thread and returns at once."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        info: ModelInfo,
        device: torch.device,
        masks: MaskFetcher | None = None,
        proposer: Proposer | None = None,
        spec: SpeculativeConfig | None = None,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.info = info
        self._graphs = graphs  # decode steps through static buffers and CUDA graphs (None: the model directly)
        self._masks = masks
        self._model = model
        self._kv = kv
        self._vocab_size = info.vocab_size
        self._eos = info.eos_token_ids
        self._device = device
        self._sampler = Sampler(info.vocab_size, device)
        self._verifier = Verifier(self._sampler)
        self._proposer = proposer
        self._spec = spec if spec is not None else SpeculativeConfig()
        self._slots: dict[int, SlotBuffer] = {}
        self._page_table = PageTable()  # every slot's pages, mirrored for batch building (SlotBuffer.pages rules)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-runner")

    @classmethod
    def load(
        cls, config: EngineConfig, grammar: MaskSource | None = None, graph_mode: GraphMode | None = None
    ) -> ModelRunner:
        """Load the model (the embedded default when ``config.model_path`` is None) and size the KV pool.

        ``grammar``: where constrained entries get their fenced masks (None: constrained entries are refused).
        ``graph_mode``: decode steps through CUDA graphs (None: as ``config.cuda_graph`` and the device decide)."""
        device = torch.device(config.device)
        path = model_dir(config)
        tokenizer = Tokenizer.from_dir(path)
        attention = attention_backend(config.attention_backend, device, config.page_size)
        model, model_config = load_model(path, config.torch_dtype, device, attention)
        pack_for_cpu(model, config.torch_dtype, device)  # the native panel matmul for its linears, where it applies
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
        if graph_mode is None:
            graph_mode = GraphMode.of(config.cuda_graph, device)
        use_graphs = graph_mode is not GraphMode.OFF
        kv = KVPool(
            model_config.num_layers,
            config.num_pages,
            config.page_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            config.torch_dtype,
            device,
            scratch_page=use_graphs,
        )
        masks = MaskFetcher(grammar, info.vocab_size, config.mask_wait_s) if grammar is not None else None
        draft_masks = DraftMasks(masks) if masks is not None and config.speculative.draft_grammar else None
        proposer = load_proposer(config, info, device, draft_masks)
        widest = -(-info.max_context // config.page_size)
        capture = graph_mode is GraphMode.CAPTURE
        graphs = DecodeGraphs(model, kv, config.cuda_graph, widest, capture) if use_graphs else None
        return cls(model, kv, info, device, masks, proposer, config.speculative, graphs)

    # ------------------------------------------------------------ asynchronous interface

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        return self._worker.submit(self.execute, plan)

    def release(self, slots: Sequence[int]) -> Future[None]:
        """Free per-request buffers. Queued behind every launched step, so no in-flight step loses its buffer."""
        return self._worker.submit(self._release, tuple(slots))

    def reset(self) -> Future[None]:
        """Drop every per-request buffer (their scheduler is gone). Queued behind every launched step."""
        return self._worker.submit(self._reset)

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

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode graph runner (None: every step runs the model as built)."""
        return self._graphs

    @property
    def proposer_slots(self) -> int:
        """Slots the speculative proposer keeps state for (0 without one)."""
        return self._proposer.num_slots if self._proposer is not None else 0

    # ------------------------------------------------------------ execution (worker thread)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        # Every entry is checked against its slot before any slot's state moves; only new requests are registered
        # first, even when the step is then refused or fails: the scheduler ends the step's requests and releases
        # their slots, which must exist.
        resolved = self._resolve(plan)
        drafts = self._propose(resolved)
        sampling = [i for i, r in enumerate(resolved) if r.entry.sample]
        if drafts.any:
            first_row = list(itertools.accumulate((1 + drafts.drafts[i].num_nodes for i in sampling), initial=0))
        else:
            first_row = list(range(len(sampling) + 1))  # one logits row per sampling entry
        # C4, delayed sampling (delayed verify): the fenced masks, a draft's included, are fetched while the forward
        # runs; only sampling waits.
        masks_started = time.perf_counter() - started
        pending = self._start_masks([resolved[i] for i in sampling], [drafts.drafts[i] for i in sampling], first_row)
        try:
            seqs = [_seq_input(r, d) for r, d in zip(resolved, drafts.drafts, strict=True)]
            rows = np.fromiter((r.entry.slot for r in resolved), dtype=np.int64, count=len(resolved))  # [S]
            batch = ForwardBatch.build(seqs, self._kv.page_size, self._device, PageRows(self._page_table.array, rows))
            forward_started = time.perf_counter() - started
            cpu = time.thread_time()
            logits = self._forward(batch)  # [logits rows: 1 per sampling entry, 1 + m per draft of m, V]
        except BaseException:
            if pending is not None:
                pending.close()  # an open fence would be filled by every later commit, into a buffer nobody reads
            raise
        forward_cpu = time.thread_time() - cpu
        forward_done = time.perf_counter() - started
        masks = pending.result(self._device) if pending is not None else StepMasks(None, {})
        masks_ready = time.perf_counter() - started
        runs, kept = self._sample(logits, resolved, sampling, first_row, drafts, masks)
        self._advance(resolved, kept)
        timing = StepTiming(
            masks_started if pending is not None else None,
            forward_started,
            forward_done,
            time.perf_counter() - started,
            forward_cpu,
            drafts.seconds,
            masks_ready if pending is not None else None,
        )
        return StepResult(plan.step_id, runs, timing)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self._graphs is not None:
            return self._graphs.forward(batch)
        return self._model(batch, self._kv)

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
        if entry.num_draft and (self._proposer is None or not entry.input_ref):
            raise ProtocolError(
                f"request {entry.request_id}: {entry.num_draft} draft positions, but "
                + ("this executor has no draft proposer" if self._proposer is None else "only a decode has drafts")
            )
        tokens = self._input_run(entry, buf)
        pages: Sequence[int] = buf.pages
        if entry.new_pages:
            pages = (*buf.pages, *entry.new_pages)
            # Past the slot's own pages, so nothing of its state moves yet: a refused step's entry writes them again.
            self._page_table.write(entry.slot, len(buf.pages), entry.new_pages)
        end = buf.seq_len + len(tokens) + entry.num_draft
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
        return SlotBuffer(entry.request_id, state, new.prompt_ids, [], new.cached_len, tokens=list(new.prompt_ids))

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

    def _propose(self, resolved: list[ResolvedEntry]) -> StepDrafts:
        """Drafts for the entries with draft positions, in one call to the proposer (it batches across requests).
        A constrained entry's draft is verified under a mask for each of its nodes (C3, C5)."""
        wanted = [i for i, r in enumerate(resolved) if r.entry.num_draft]
        drafts = [NO_DRAFT] * len(resolved)
        if not wanted or self._proposer is None:
            return StepDrafts(drafts)
        started = time.perf_counter()
        requests = [self._draft_request(resolved[i]) for i in wanted]
        for i, request, draft in zip(wanted, requests, self._proposer.propose(requests), strict=True):
            _check_draft(draft, request)
            drafts[i] = draft
        return StepDrafts(drafts, time.perf_counter() - started, any(d.num_nodes for d in drafts))

    def _draft_request(self, r: ResolvedEntry) -> DraftRequest:
        """A constrained entry's request names its grammar at the ordinal its verify masks are asked at (C3)."""
        buf, nodes = r.buffer, r.entry.num_draft
        depth = min(self._spec.num_steps, nodes)
        grammar = DraftGrammar(r.entry.request_id, buf.sampling.num_output) if r.entry.constrained else None
        return DraftRequest(
            r.entry.slot, buf.tokens, buf.seq_len, r.pages, nodes, depth, self._spec.topk, buf.sampling, grammar
        )

    def _start_masks(
        self, sampling: list[ResolvedEntry], drafts: list[Draft], first_row: list[int]
    ) -> PendingMasks | None:
        constrained = [
            MaskRequest(row, r.entry.request_id, r.buffer.sampling.num_output, d.tree if d.num_nodes else None)
            for r, d, row in zip(sampling, drafts, first_row, strict=False)
            if r.entry.constrained
        ]
        if self._masks is None:
            if constrained:
                raise ProtocolError("a constrained entry reached an executor started without a grammar service")
            return None
        return self._masks.start(constrained, first_row[-1])

    def _sample(
        self,
        logits: torch.Tensor,
        resolved: list[ResolvedEntry],
        sampling: list[int],
        first_row: list[int],
        drafts: StepDrafts,
        masks: StepMasks,
    ) -> tuple[tuple[SampledRun, ...], list[int]]:
        """Sample every sampling entry (verify those with a draft): the runs, and how many input positions of each
        entry hold KV to keep."""
        kept = [len(r.tokens) for r in resolved]
        if not sampling:
            return (), kept
        if not drafts.any:  # plain decoding, the common case: one row per sampling entry
            return self._sample_plain(logits, [resolved[i] for i in sampling], masks), kept
        plain = [k for k, i in enumerate(sampling) if not drafts.drafts[i].num_nodes]
        speculative = [k for k, i in enumerate(sampling) if drafts.drafts[i].num_nodes]
        by_entry: dict[int, SampledRun] = {}
        paths: dict[int, tuple[int, ...]] = {}
        if plain:
            rows = torch.tensor([first_row[k] for k in plain], dtype=torch.long, device=logits.device)  # [P]
            entries = [resolved[sampling[k]] for k in plain]
            plain_masks = masks.rows([first_row[k] for k in plain])
            plain_runs = self._sample_plain(logits.index_select(0, rows), entries, plain_masks)
            by_entry.update(zip((sampling[k] for k in plain), plain_runs, strict=True))
        unmasked = [k for k in speculative if first_row[k] in masks.errors]
        for k in unmasked:  # no fenced masks for its draft (C3): that request ends, the others go on
            by_entry[sampling[k]] = SampledRun(
                resolved[sampling[k]].entry.request_id, 0, (), error=masks.errors[first_row[k]]
            )
        speculative = [k for k in speculative if first_row[k] not in masks.errors]
        items = [_verify_item(resolved[sampling[k]], drafts.drafts[sampling[k]], first_row[k]) for k in speculative]
        verdicts = self._verifier.verify(logits, items, masks.bitmask)
        for k, verdict in zip(speculative, verdicts, strict=True):
            i = sampling[k]
            by_entry[i] = self._verified_run(resolved[i], drafts.drafts[i], verdict)
            kept[i] = 1 + len(verdict.path)
            paths[i] = verdict.path
        self._compact(resolved, drafts, paths)
        return tuple(by_entry[i] for i in sampling), kept

    def _sample_plain(
        self, logits: torch.Tensor, rows: list[ResolvedEntry], masks: StepMasks
    ) -> tuple[SampledRun, ...]:
        out = self._sampler.sample(logits, [r.buffer.sampling for r in rows], masks.bitmask)
        logprobs, tops, errors = out.logprobs, out.top_logprobs, masks.errors
        runs = []
        for i, r in enumerate(rows):  # once per sampled request per step: kept lean
            buf, token = r.buffer, out.token_ids[i]
            ordinal = buf.sampling.num_output
            buf.produced((token,), ordinal)
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

    def _verified_run(self, r: ResolvedEntry, draft: Draft, verdict: Verdict) -> SampledRun:
        buf = r.buffer
        ordinal = buf.sampling.num_output
        buf.produced(verdict.token_ids, ordinal)
        if self._proposer is not None:
            self._proposer.accepted(r.entry.slot, verdict.path, buf.seq_len + 1 + len(verdict.path))
        return SampledRun(
            r.entry.request_id,
            ordinal,
            verdict.token_ids,
            draft.num_nodes,
            len(verdict.path),
            verdict.logprobs,
            verdict.top_logprobs,
        )

    def _compact(self, resolved: list[ResolvedEntry], drafts: StepDrafts, paths: dict[int, tuple[int, ...]]) -> None:
        """C11 for trees: the accepted path's KV moves to the positions right after the pending token, where the next
        step reads it; a chain's accepted prefix is there already. Rejected nodes' KV is left past the slot's
        sequence length, where nothing reads it and the next run overwrites it."""
        src: list[int] = []
        dst: list[int] = []
        page_size = self._kv.page_size
        for i, path in paths.items():
            r = resolved[i]
            for depth, node in enumerate(path, start=1):
                if node + 1 != depth:  # node i sits at position seq_len + 1 + i; depth d belongs at seq_len + d
                    src.append(_slot(r.pages, r.start_pos + 1 + node, page_size))
                    dst.append(_slot(r.pages, r.start_pos + depth, page_size))
        if src:
            device = self._kv.device
            self._kv.move(torch.tensor(src, device=device), torch.tensor(dst, device=device))

    def _advance(self, resolved: list[ResolvedEntry], kept: list[int]) -> None:
        """The step's KV is written: each slot's accepted positions grow by what it kept of its run (C11): the whole
        input, or for a verified draft the pending token and the accepted nodes. Its pages are kept."""
        for r, count in zip(resolved, kept, strict=True):
            buf = r.buffer
            if r.entry.new_pages:
                buf.pages.extend(r.entry.new_pages)
            buf.seq_len += count

    def _reset(self) -> None:
        self._release(tuple(self._slots))  # read on the worker: every step queued before is in

    def _release(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            if self._slots.pop(slot, None) is None:
                raise ProtocolError(f"release of slot {slot}, which holds no request")
            if self._proposer is not None:
                self._proposer.release(slot)


def _logits_mode(entry: StepEntry) -> LogitsMode:
    return LogitsMode.LAST if entry.sample else LogitsMode.NONE


def _seq_input(r: ResolvedEntry, draft: Draft) -> SeqInput:
    """The forward's share of one entry: its input run, or for a draft the pending token and the draft's nodes, with
    a logits row for each (the verify reads them all) and, for a tree, each node's parent."""
    if not draft.num_nodes:
        return SeqInput(r.tokens, r.start_pos, r.pages, _logits_mode(r.entry))
    tree = draft.tree
    parents = None if draft.is_chain else (-1, *(p + 1 for p in tree.parents))
    return SeqInput((*r.tokens, *tree.tokens), r.start_pos, r.pages, LogitsMode.ALL, parents)


def _verify_item(r: ResolvedEntry, draft: Draft, row: int) -> VerifyItem:
    return VerifyItem(r.buffer.sampling, draft.tree, draft.q, row)


def _check_draft(draft: Draft, request: DraftRequest) -> None:
    """A proposer's draft must fit the positions the entry was given; parents come before their children."""
    tree = draft.tree
    if draft.num_nodes > request.max_nodes or any(p >= i for i, p in enumerate(tree.parents)):
        raise RuntimeError(
            f"proposer drafted {draft.num_nodes} nodes (parents {tree.parents}) for slot {request.slot}, which has "
            f"{request.max_nodes} draft positions and needs every parent before its children"
        )


def _slot(pages: Sequence[int], position: int, page_size: int) -> int:
    return pages[position // page_size] * page_size + position % page_size
