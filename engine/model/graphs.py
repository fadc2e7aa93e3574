"""CUDA graphs for decode steps: static input buffers per batch-size bucket, padding, capture and replay.

Eager launch of a large model's decode forward costs milliseconds of CPU per step (hundreds of kernels, each a
Python call and a launch); a CUDA graph replays the whole forward with one launch. A graph fixes every shape and
every address, so a step is run through **static buffers**: the step's inputs are copied into buffers sized for its
**shape class** (query rows padded up to a batch-size bucket, page-table width padded up to a power of two) and the
forward reads only those buffers. Captured or not, a step takes exactly this path (load the buffers, run the
forward over them, slice the real rows off the output); on CUDA with graphs on the forward is replayed from the
graph captured for its class, elsewhere (CPU, ``--no-cuda-graph``) it runs eagerly over the same buffers.

Which steps qualify: every query is a decode query (``DecodeGroup.covers_batch``: single tokens and short chains
after cached context, a speculative verify's chain included) and every row gets logits (true of every decode and
verify step). Prefill chunks and draft trees run eagerly and unpadded. Padding rows read page 0 for one key (a
harmless read) and write their K/V into the pool's scratch page, which no page table names, so they never touch a
request's KV; their logits are sliced off.

Invalidation: a class is keyed by its row bucket; a step whose page tables are wider than the class's captured
width drops that class's graph and buffers and builds them again at the new (power-of-two) width, so a bucket is
recaptured at most log2(max pages per sequence) times over a server's life. The graph's output is overwritten by
the next replay: the caller consumes it (samples) before the next forward, which the runner's single worker thread
guarantees.
"""

from __future__ import annotations

import dataclasses
import enum
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.config import CudaGraphConfig
from engine.kv.pool import KVPool
from engine.model.forward_batch import DecodeGroup, ForwardBatch


class Forward(Protocol):
    """The model, as the graph runner calls it (LlamaForCausalLM)."""

    def __call__(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor: ...  # float32 logits [R, V]

    def check(self, batch: ForwardBatch, kv: KVPool) -> None: ...  # host-side bounds, raises ValueError


class GraphMode(enum.Enum):
    """Whether decode steps go through the graph runner, and whether it captures."""

    OFF = "off"  # the model directly, every step as built (CPU; --no-cuda-graph)
    STATIC = "static"  # the static buffers and padding, run eagerly (tests of the bookkeeping on CPU)
    CAPTURE = "capture"  # the static buffers, captured once per shape class and replayed (CUDA)

    @classmethod
    def of(cls, config: CudaGraphConfig, device: torch.device) -> GraphMode:
        """CAPTURE on CUDA unless --no-cuda-graph; OFF elsewhere."""
        return cls.CAPTURE if config.enabled and device.type == "cuda" else cls.OFF


class Launch(enum.Enum):
    """How a step's forward ran."""

    EAGER = "eager"  # not graph-shaped (prefill, a tree, too many rows): the model on the batch as built
    STATIC = "static"  # through the static buffers, run eagerly (CPU, --no-cuda-graph)
    REPLAY = "replay"  # through the static buffers, replayed from a captured CUDA graph


@dataclass(frozen=True)
class ShapeClass:
    """The padded shape a graph is captured for: query rows and page-table width."""

    rows: int
    page_width: int


@dataclass
class GraphStats:
    """What the graph runner did, for tests and metrics."""

    eager: int = 0
    static: int = 0
    replays: int = 0
    captures: int = 0
    invalidations: int = 0


class StaticDecodeBatch:
    """The static buffers of one shape class and the ForwardBatch that reads them.

    Rows past the step's real ones are padding: token 0 at position 0, one key (slot 0 of page 0, only read),
    written to ``scratch_slot``."""

    def __init__(self, shape: ShapeClass, page_size: int, scratch_slot: int, device: torch.device) -> None:
        rows, width = shape.rows, shape.page_width
        self.shape = shape
        self._scratch_slot = scratch_slot
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)  # [Rb]
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # [Rb]
        self.write_slots = torch.full((rows,), scratch_slot, dtype=torch.long, device=device)  # [Rb]
        self.page_tables = torch.zeros(rows, width, dtype=torch.long, device=device)  # [Rb, Wb]
        self.kv_lens = torch.ones(rows, dtype=torch.long, device=device)  # [Rb]
        arange = torch.arange(rows, dtype=torch.long, device=device)  # [Rb]
        group = DecodeGroup(arange, self.page_tables, self.kv_lens, page_size, covers_batch=True)
        self.batch = ForwardBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            write_slots=self.write_slots,
            logits_rows=arange,
            decode=group,
            prefills=(),
            page_size=page_size,
            max_position=0,
            max_page=0,
        )

    def load(self, batch: ForwardBatch) -> ForwardBatch:
        """Copy ``batch`` into the buffers, padding the rest; the returned batch reads the buffers and carries
        ``batch``'s host-side bounds (for the model's checks)."""
        group = batch.decode
        assert group is not None
        n, width = batch.num_tokens, int(group.page_tables.shape[1])
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.write_slots[:n].copy_(batch.write_slots)
        self.kv_lens[:n].copy_(group.kv_lens)
        self.page_tables[:n, :width].copy_(group.page_tables)
        # Rows past n may hold an earlier step's values: padding again.
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.write_slots[n:].fill_(self._scratch_slot)
        self.kv_lens[n:].fill_(1)
        self.page_tables[n:].zero_()
        self.page_tables[:n, width:].zero_()
        return dataclasses.replace(self.batch, max_position=batch.max_position, max_page=batch.max_page)


class _Entry:
    """One shape class: its static buffers and, once captured, its graph and output buffer."""

    def __init__(self, static: StaticDecodeBatch) -> None:
        self.static = static
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None  # [Rb, V] written by every replay


class DecodeGraphs:
    """Runs the model's forward, through static buffers and CUDA graphs where a step is graph-shaped.

    ``capture`` False (CPU, ``--no-cuda-graph``, tests) runs the same bookkeeping with eager forwards over the
    static buffers. ``max_page_width``: the widest page table a sequence can have (context / page size)."""

    def __init__(
        self, forward: Forward, kv: KVPool, config: CudaGraphConfig, max_page_width: int, capture: bool
    ) -> None:
        if kv.scratch_slot is None:
            raise ValueError("DecodeGraphs needs a KV pool with a scratch page (KVPool(..., scratch_page=True))")
        if capture and kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV pool is on {kv.device}")
        self._forward = forward
        self._kv = kv
        self._sizes = config.batch_sizes
        self._max_width = max(1, max_page_width)
        self._capture = capture
        self._entries: dict[int, _Entry] = {}
        self._pool: Any = None  # one memory pool shared by every graph (torch's opaque handle)
        self.stats = GraphStats()
        self.last_launch = Launch.EAGER

    def bucket(self, rows: int) -> int | None:
        """The smallest batch size that holds ``rows`` query rows (None: more than the largest)."""
        i = bisect_left(self._sizes, rows)
        return self._sizes[i] if i < len(self._sizes) else None

    def page_width(self, width: int) -> int:
        """The page-table width a class is built at: the next power of two, capped at the longest sequence."""
        return min(max(self._max_width, width), 1 << max(0, width - 1).bit_length())

    def shape_class(self, batch: ForwardBatch) -> ShapeClass | None:
        """The class a step runs in, or None when it is not graph-shaped."""
        group = batch.decode
        if group is None or not group.covers_batch or batch.num_logits_rows != batch.num_tokens:
            return None
        rows = self.bucket(batch.num_tokens)
        if rows is None:
            return None
        return ShapeClass(rows, self.page_width(int(group.page_tables.shape[1])))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits [R, V]; from a replay they live in the graph's output until the next forward."""
        shape = self.shape_class(batch)
        if shape is None:
            self.stats.eager += 1
            self.last_launch = Launch.EAGER
            return self._forward(batch, self._kv)
        entry = self._entry(shape)
        static = entry.static.load(batch)
        if not self._capture:
            self.stats.static += 1
            self.last_launch = Launch.STATIC
            return self._forward(static, self._kv)[: batch.num_tokens]
        if entry.graph is None:
            self._capture_entry(entry, static)
        assert entry.graph is not None and entry.output is not None
        self._forward.check(batch, self._kv)  # a replay runs no Python: the model's checks run here
        entry.graph.replay()
        self.stats.replays += 1
        self.last_launch = Launch.REPLAY
        return entry.output[: batch.num_tokens]

    @property
    def classes(self) -> tuple[ShapeClass, ...]:
        """The shape classes that hold buffers now."""
        return tuple(entry.static.shape for entry in self._entries.values())

    def _entry(self, shape: ShapeClass) -> _Entry:
        entry = self._entries.get(shape.rows)
        if entry is not None and entry.static.shape.page_width >= shape.page_width:
            return entry
        if entry is not None:  # the shape class changed: the old graph reads buffers too narrow for this step
            self.stats.invalidations += 1
            del self._entries[shape.rows]
        scratch = self._kv.scratch_slot
        assert scratch is not None
        entry = _Entry(StaticDecodeBatch(shape, self._kv.page_size, scratch, self._kv.device))
        self._entries[shape.rows] = entry
        return entry

    def _capture_entry(self, entry: _Entry, static: ForwardBatch) -> None:
        """Warm up on a side stream (allocator, cuBLAS handles, compiled kernels), then capture. Both run on the
        buffers just loaded; the real rows' KV writes are the same values the replay writes again."""
        side = torch.cuda.Stream(device=self._kv.device)
        side.wait_stream(torch.cuda.current_stream(self._kv.device))
        with torch.cuda.stream(side):
            self._forward(static, self._kv)
        torch.cuda.current_stream(self._kv.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this (the runner's) thread is captured; another thread's CUDA work is no error.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            entry.output = self._forward(static, self._kv)
        entry.graph = graph
        self.stats.captures += 1
