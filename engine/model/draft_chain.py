"""A draft model's greedy chains in one native call: the CPU counterpart of a captured multi-step draft graph.

A small draft model's forward over a few rows costs a CPU almost nothing in arithmetic and about half a
millisecond in eager op dispatch; a chain of depth k pays that k times, plus the Python between the depths. The
:class:`DraftChain` runs the whole chain (every row's catch-up tokens, then k - 1 argmax-chosen tokens, each one's
K/V written into the draft's paged pool before its attention) in ``draft_chain.c``, which releases the GIL for it.

It holds the model's weights repacked once, transposed and fused (q|k|v, gate|up) as the kernel reads them, so it
costs a second copy of the draft's weights (a draft is small by definition). It exists only for what the kernel
computes exactly as engine/model/llama.py does: CPU, float32, the native kernel available (``ORDINAL_NATIVE`` not
0). Everything else, and every draft that is not a greedy chain, stays on the model's torch forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.pool import KVPool
from engine.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model.native import DraftChainKernel, draft_chain_kernel
from engine.model.panel_linear import padded_bias, panels

# The per-layer fields of draft_chain.c's layer rows, in its order (L_IN_NORM .. L_WINDOW).
_LAYER_FIELDS = 15


def _bf16_exact(weight: torch.Tensor) -> bool:
    return bool(torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight))


@dataclass(frozen=True)
class ChainRow:
    """One request's chain: ``feed`` (its catch-up tokens, the last being its pending token) written at positions
    ``start_pos ..``, then ``depth`` argmax tokens chosen, the first from the last feed token's logits. ``pages``
    must cover every position written, ``start_pos + len(feed) + depth - 2`` the last. The first ``ban_depth``
    tokens are never one of ``banned`` (what the request cannot emit there: eos and stop ids before its
    min_new_tokens)."""

    feed: Sequence[int]
    start_pos: int
    pages: Sequence[int]
    depth: int
    banned: Sequence[int] = ()
    ban_depth: int = 0

    @property
    def last_position(self) -> int:
        return self.start_pos + len(self.feed) + self.depth - 2


@dataclass(frozen=True)
class ChainResult:
    """Each row's chosen tokens (``depth`` of them, fewer where a ``min_prob`` ended the chain), and with
    ``keep_logits`` the rows they were chosen from."""

    tokens: list[list[int]]
    logits: torch.Tensor | None  # [B, max depth, V]


class DraftChain:
    """Greedy chains of one model over its KV pool (:meth:`build` returns None where the kernel cannot run it)."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, vocab_size: int, kernel: DraftChainKernel) -> None:
        config = model.config
        if not 0 < vocab_size <= config.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} must be within the model's {config.vocab_size} logits")
        self._kernel = kernel
        self._kv = kv
        self._vocab_size = vocab_size
        self._max_positions = model.model.rotary_emb.max_positions
        self._embed = model.model.embed_tokens.weight.detach().contiguous()  # [Vm, hidden]
        # bf16 panels where that loses nothing (a bf16 checkpoint loaded as float32): half the bytes to stream.
        self._bf16 = all(_bf16_exact(lin.weight) for lin in model.modules() if isinstance(lin, torch.nn.Linear))
        self._panel_dtype = torch.bfloat16 if self._bf16 else torch.float32
        self._lm_head = panels(model.lm_head.weight.detach(), self._panel_dtype)  # [Vm / 32, hidden, 32]
        self._final_norm = model.model.norm.weight.detach().contiguous()  # [hidden]
        self._cos = model.model.rotary_emb.cos.contiguous()  # [P, D/2]
        self._sin = model.model.rotary_emb.sin.contiguous()  # [P, D/2]
        self._eps = float(config.rms_norm_eps)
        self._packed: list[torch.Tensor] = []  # keeps every tensor the layer rows point at alive
        layers = [layer for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)]
        rows = [self._layer_row(i, layer, kv, config.layer_window(i)) for i, layer in enumerate(layers)]
        self._layers = torch.tensor(rows, dtype=torch.int64)  # [L, fields]
        self._dims = (
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.num_layers,
            config.vocab_size,
            vocab_size,
            kv.page_size,
            int(self._bf16),
        )

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv: KVPool, vocab_size: int) -> DraftChain | None:
        """The chain runner for ``model`` over ``kv``, or None where the torch forward must run instead: not a CPU
        float32 model and pool, or no native kernel (``ORDINAL_NATIVE=0``, no compiler)."""
        weight = model.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or kv.dtype != torch.float32:
            return None
        if kv.device.type != "cpu" or model.config.head_dim % 2 != 0:
            return None
        kernel = draft_chain_kernel()
        return None if kernel is None else cls(model, kv, vocab_size, kernel)

    def run(self, rows: Sequence[ChainRow], keep_logits: bool = False, min_prob: float = 0.0) -> ChainResult:
        """Every row's chain, the draft KV of each fed position written; with ``min_prob`` a chain ends after its
        first token the draft gives less than that probability (its other tokens' KV is then not written). Raises
        ValueError, before anything is written, for a row that is empty, has depth < 1, runs past the model's
        positions or its pages, or names a page outside the pool."""
        self._check(rows)
        batch, max_depth = len(rows), max(row.depth for row in rows)
        pages_per_seq = max(-(-(row.last_position + 1) // self._kv.page_size) for row in rows)
        offsets = [0]
        for row in rows:
            offsets.append(offsets[-1] + len(row.feed))
        feed = torch.tensor([t for row in rows for t in row.feed], dtype=torch.int64)  # [N]
        tables = torch.zeros(batch, pages_per_seq, dtype=torch.int64)  # [B, P]
        for b, row in enumerate(rows):
            used = row.pages[:pages_per_seq]
            tables[b, : len(used)] = torch.tensor(used, dtype=torch.int64)
        ban_offsets = [0]
        for row in rows:
            ban_offsets.append(ban_offsets[-1] + len(row.banned))
        banned = torch.tensor([t for row in rows for t in row.banned] or [0], dtype=torch.int64)  # [K or 1]
        ints = torch.tensor(
            [
                *offsets,
                *(row.start_pos for row in rows),
                *(row.depth for row in rows),
                *ban_offsets,
                *(row.ban_depth for row in rows),
                *self._dims,
                pages_per_seq,
                torch.get_num_threads(),  # the kernel's OpenMP threads, as the paged decode kernel takes them
            ],
            dtype=torch.int64,
        )  # [B + 1 | B | B | B + 1 | B | dims, P, threads]
        out = torch.zeros(batch, max_depth, dtype=torch.int64)  # [B, K]
        lengths = torch.zeros(batch, dtype=torch.int64)  # [B]: each chain's tokens, its depth or fewer
        logits = torch.zeros(batch, max_depth, self._vocab_size) if keep_logits else None  # [B, K, V], 0 past a depth
        base = ints.data_ptr()
        step = ints.element_size()
        status = self._kernel.library.ordinal_draft_chain(
            self._embed.data_ptr(),
            self._lm_head.data_ptr(),
            self._final_norm.data_ptr(),
            self._cos.data_ptr(),
            self._sin.data_ptr(),
            self._layers.data_ptr(),
            base + step * (5 * batch + 2),  # dims
            self._eps,
            batch,
            feed.data_ptr(),
            base,  # feed offsets
            base + step * (batch + 1),  # start positions
            tables.data_ptr(),
            base + step * (2 * batch + 1),  # depths
            max_depth,
            min_prob,
            base + step * (3 * batch + 1),  # ban offsets
            banned.data_ptr(),
            base + step * (4 * batch + 2),  # ban depths
            out.data_ptr(),
            lengths.data_ptr(),
            logits.data_ptr() if logits is not None else None,
        )
        if status != 0:
            raise MemoryError("draft chain kernel could not allocate its scratch buffers")
        tokens = out.tolist()
        return ChainResult([tokens[b][:length] for b, length in enumerate(lengths.tolist())], logits)

    def _check(self, rows: Sequence[ChainRow]) -> None:
        # The kernel indexes the pool and the rope tables with these: a bad one would be a silent stray write in C.
        if not rows:
            raise ValueError("a draft chain needs at least one row")
        page_size, num_pages = self._kv.page_size, self._kv.num_pages
        for b, row in enumerate(rows):
            if not row.feed or row.depth < 1 or row.start_pos < 0:
                raise ValueError(f"chain row {b}: needs feed tokens, depth >= 1 and start_pos >= 0")
            if row.last_position >= self._max_positions:
                raise ValueError(f"chain row {b}: position {row.last_position} exceeds {self._max_positions}")
            needed = row.last_position // page_size + 1
            if len(row.pages) < needed:
                raise ValueError(f"chain row {b}: {len(row.pages)} pages for positions 0..{row.last_position}")
            if any(not 0 <= p < num_pages for p in row.pages[:needed]):
                raise ValueError(f"chain row {b}: a page id outside the pool of {num_pages} pages")
            if any(not 0 <= t < self._embed.shape[0] for t in row.feed):
                raise ValueError(f"chain row {b}: a token id outside the vocabulary of {self._embed.shape[0]}")
            if any(not 0 <= t < self._vocab_size for t in row.banned) or row.ban_depth < 0:
                raise ValueError(f"chain row {b}: banned ids must be within the vocabulary of {self._vocab_size}")

    def _layer_row(self, index: int, layer: LlamaDecoderLayer, kv: KVPool, window: int | None) -> list[int]:
        attn, mlp = layer.self_attn, layer.mlp

        def keep(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            t = t.detach().contiguous()
            self._packed.append(t)
            return t.data_ptr()

        def fused(*linears: torch.nn.Linear) -> tuple[int, int]:
            # The outs stacked (q | k | v, gate | up): one matrix, one pass over the input.
            weight = panels(torch.cat([lin.weight for lin in linears], dim=0), self._panel_dtype)
            biases = [lin.bias for lin in linears]
            if any(b is None for b in biases):
                return keep(weight), 0
            return keep(weight), keep(padded_bias(torch.cat([b for b in biases if b is not None])))

        q_norm, k_norm = attn.q_norm, attn.k_norm
        norms = (q_norm.weight, k_norm.weight) if q_norm is not None and k_norm is not None else (None, None)
        qkv, qkv_bias = fused(attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up, gate_up_bias = fused(mlp.gate_proj, mlp.up_proj)
        row = [
            keep(layer.input_layernorm.weight),
            qkv,
            qkv_bias,
            keep(norms[0]),
            keep(norms[1]),
            keep(panels(attn.o_proj.weight, self._panel_dtype)),
            keep(None if attn.o_proj.bias is None else padded_bias(attn.o_proj.bias)),
            keep(layer.post_attention_layernorm.weight),
            gate_up,
            gate_up_bias,
            keep(panels(mlp.down_proj.weight, self._panel_dtype)),
            keep(None if mlp.down_proj.bias is None else padded_bias(mlp.down_proj.bias)),
            kv.k(index).data_ptr(),
            kv.v(index).data_ptr(),
            window or 0,
        ]
        assert len(row) == _LAYER_FIELDS
        return row
