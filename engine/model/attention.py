"""The torch reference attention backend: paged causal attention over the KV pool, one call for all decodes, one
SDPA call per prefill chunk.

Decodes on CPU float32 run the native paged kernel (``engine/model/native.py``); other devices and dtypes
gather whole pages and call SDPA. It runs everywhere and is what every CPU test checks against transformers; the
interface it implements is in ``engine/model/attention_backend.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.forward_batch import DecodeGroup, ForwardBatch
from engine.model.native import paged_decode_kernel


@dataclass(frozen=True, eq=False)
class AttentionMasks:
    """The window and masks for one attention window, derived once per forward and shared by its layers."""

    window: int | None  # None = full causal
    decode: torch.Tensor | None  # [B, 1, 1, L] bool for the torch decode path
    prefill: tuple[torch.Tensor | None, ...]  # per chunk [n, ctx] bool, None = plain causal

    @classmethod
    def for_window(cls, batch: ForwardBatch, window: int | None) -> AttentionMasks:
        """Full causal masks for ``window`` None; otherwise each query sees only its last ``window`` keys."""
        # The decode mask is a few microseconds of work; the native kernel ignores it and applies the window itself.
        decode = batch.decode.mask(window) if batch.decode is not None else None
        if window is None:
            return cls(window, decode, tuple(chunk.mask for chunk in batch.prefills))
        device = batch.input_ids.device
        return cls(window, decode, tuple(chunk.window_mask(window, device) for chunk in batch.prefills))


@dataclass(frozen=True, eq=False)
class TorchAttentionPlan:
    """The reference backend's plan for one forward and one window: the batch and its masks."""

    batch: ForwardBatch
    masks: AttentionMasks

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        return paged_attention(q, k, v, k_cache, v_cache, self.batch, self.masks)


class TorchAttention:
    """The reference backend: today's paged attention, unchanged numerics, on every device and dtype."""

    name = "torch"

    def plan(self, batch: ForwardBatch, window: int | None) -> TorchAttentionPlan:
        return TorchAttentionPlan(batch, AttentionMasks.for_window(batch, window))


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write this step's K/V ([T, Hkv, D]) into the pool at ``slots`` [T], before any attention reads it."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    masks: AttentionMasks,
) -> torch.Tensor:
    """Store this step's K/V in the pool, then attend every query to its sequence's cached keys.

    q: [T, H, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [slots, Hkv, D]. Returns [T, H, D].
    Query head h reads KV head h // (H // Hkv), as transformers' repeat_kv does.
    """
    # Write first: a decode token's own key must be in the pool before attention reads it.
    store_kv(k, v, k_cache, v_cache, batch.write_slots)
    group = batch.decode
    if group is not None and group.covers_batch:
        return decode_attention(q, k_cache, v_cache, group, masks.window, masks.decode)
    out = torch.empty_like(q)  # [T, H, D]
    if group is not None:
        o = decode_attention(q.index_select(0, group.rows), k_cache, v_cache, group, masks.window, masks.decode)
        out.index_copy_(0, group.rows, o)
    for chunk, mask in zip(batch.prefills, masks.prefill, strict=True):
        rows_slice = slice(chunk.row_start, chunk.row_end)
        if chunk.pages is None:
            keys, values = k[rows_slice], v[rows_slice]  # [n, Hkv, D]
        else:
            ctx = chunk.context_len
            keys = gather_pages(k_cache, chunk.pages, batch.page_size)[:ctx]  # [ctx, Hkv, D]
            values = gather_pages(v_cache, chunk.pages, batch.page_size)[:ctx]  # [ctx, Hkv, D]
        out[rows_slice] = _prefill(q[rows_slice], keys, values, mask)
    return out


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Copy whole pages out of a pool. cache: [slots, Hkv, D]; pages: [...] -> [..., len * page_size, Hkv, D].

    One contiguous page is one index_select row: far fewer, larger copies than gathering token rows.
    """
    slots, kv_heads, head_dim = cache.shape
    page_rows = cache.view(slots // page_size, page_size * kv_heads * head_dim)  # [pages, ps * Hkv * D]
    picked = page_rows.index_select(0, pages.reshape(-1))  # [N, ps * Hkv * D]
    return picked.view(*pages.shape[:-1], pages.shape[-1] * page_size, kv_heads, head_dim)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    window: int | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """All decode queries at once (single tokens, and runs of them as ``group.runs`` says). q: [B, H, D] -> [B, H, D].

    CPU float32 runs the native paged kernel (reads K/V in place); everything else, or ``ORDINAL_NATIVE=0``,
    gathers pages and calls SDPA with ``mask`` ([B, 1, 1, P * page_size], built for ``window``).
    """
    if q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32:
        kernel = paged_decode_kernel()
        if kernel is not None:
            scale = 1.0 / math.sqrt(q.shape[-1])  # SDPA's default, which the torch path uses
            tables, lens, size = group.page_tables, group.kv_lens, group.page_size
            return kernel(q, k_cache, v_cache, tables, lens, size, window or 0, scale, group.runs)
    if mask is None:
        mask = group.mask(window)
    return _decode_torch(q, k_cache, v_cache, group, mask)


def _decode_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, mask: torch.Tensor
) -> torch.Tensor:
    """SDPA over whole gathered pages. q: [B, H, D] -> [B, H, D].

    The query heads sharing one KV head are laid out as that head's query rows, so GQA needs no copy
    of the keys and works on every SDPA backend.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    # Made contiguous per head: CPU SDPA on the strided transpose costs more than this copy.
    keys = gather_pages(k_cache, group.page_tables, group.page_size).transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    values = gather_pages(v_cache, group.page_tables, group.page_size).transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)  # [B, Hkv, G, D]
    return o.reshape(batch, heads, head_dim)  # [B, H, D]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One chunk. q: [n, H, D]; k, v: [ctx, Hkv, D]; mask [n, ctx] or None for causal. Returns [n, H, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
    # 4-D inputs (a batch of one): CPU SDPA only takes its fused flash kernel for 4-D, and the math fallback
    # it uses for 3-D inputs is about 5x slower on prompt-sized chunks.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
    )  # [1, H, n, D]
    return o[0].transpose(0, 1)  # [n, H, D]
