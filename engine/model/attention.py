"""Paged causal attention over the KV pool: one SDPA call for all decodes, one per prefill chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class AttentionMasks:
    """The masks for one attention window, derived once per forward and shared by its layers."""

    decode: torch.Tensor | None  # [B, 1, 1, L] bool
    prefill: tuple[torch.Tensor | None, ...]  # per chunk [n, ctx] bool, None = plain causal

    @classmethod
    def for_window(cls, batch: ForwardBatch, window: int | None) -> AttentionMasks:
        """Full causal masks for ``window`` None; otherwise each query sees only its last ``window`` keys."""
        if window is None:
            decode = batch.decode.mask if batch.decode is not None else None
            return cls(decode, tuple(chunk.mask for chunk in batch.prefills))
        decode = batch.decode.window_mask(window) if batch.decode is not None else None
        device = batch.input_ids.device
        return cls(decode, tuple(chunk.window_mask(window, device) for chunk in batch.prefills))


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
    # Write first: a decode token's own key must be in the pool before the gather reads it.
    k_cache.index_copy_(0, batch.write_slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.write_slots, v.to(v_cache.dtype))
    out = torch.empty_like(q)  # [T, H, D]
    if batch.decode is not None and masks.decode is not None:
        rows = batch.decode.rows
        o = _decode(q.index_select(0, rows), k_cache, v_cache, batch.decode.kv_slots, masks.decode)
        out.index_copy_(0, rows, o)
    for chunk, mask in zip(batch.prefills, masks.prefill, strict=True):
        rows_slice = slice(chunk.row_start, chunk.row_end)
        if chunk.kv_slots is None:
            keys, values = k[rows_slice], v[rows_slice]  # [n, Hkv, D]
        else:
            keys = k_cache.index_select(0, chunk.kv_slots)  # [ctx, Hkv, D]
            values = v_cache.index_select(0, chunk.kv_slots)  # [ctx, Hkv, D]
        out[rows_slice] = _prefill(q[rows_slice], keys, values, mask)
    return out


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """All single-token queries at once. q: [B, H, D] -> [B, H, D].

    The query heads sharing one KV head are laid out as that head's query rows, so GQA needs no copy
    of the keys and works on every SDPA backend.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    # index_select on the flattened slots is several times faster on CPU than 2-D advanced indexing.
    flat = kv_slots.reshape(-1)  # [B * L]
    gathered_shape = (*kv_slots.shape, kv_heads, head_dim)
    keys = k_cache.index_select(0, flat).view(gathered_shape).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache.index_select(0, flat).view(gathered_shape).transpose(1, 2)  # [B, Hkv, L, D]
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)  # [B, Hkv, G, D]
    o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)  # [B, Hkv, G, D]
    return o.reshape(batch, heads, head_dim)  # [B, H, D]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One chunk. q: [n, H, D]; k, v: [ctx, Hkv, D]; mask [n, ctx] or None for causal. Returns [n, H, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=mask is None
    )  # [H, n, D]
    return o.transpose(0, 1)  # [n, H, D]
