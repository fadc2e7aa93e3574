"""The attention backend interface: how a forward attends its queries to the paged KV pool.

A backend turns a step's ForwardBatch into a plan once per forward and attention window (masks, block tables,
whatever its kernels need); every layer then calls the plan's ``attend``, which stores the layer's new K/V in the
pool and attends each query to its sequence's keys through the page tables. Two backends exist:

- ``torch`` (``engine/model/attention.py``): the reference. The native C kernel for CPU float32 decodes, SDPA over
  gathered pages elsewhere. Runs on every device and dtype; every CPU test checks it against transformers.
- ``flex`` (``engine/model/flex_attention.py``): torch's FlexAttention with paged block masks. Reads K/V in place
  through block tables built from the page tables (decode, prefill chunks, sliding windows, speculative trees),
  compiled by Triton on CUDA. Needs no wheel beyond torch; on CPU it runs eagerly (slow, for tests only).

``--attention-backend auto`` (the default) picks ``flex`` on CUDA when FlexAttention imports and ``torch``
everywhere else.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from engine.config import AttentionBackendKind
from engine.model.attention import TorchAttention
from engine.model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


class AttentionPlan(Protocol):
    """One forward's attention for one window, shared by every layer with that window."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Store k, v ([T, Hkv, D]) in the pool (k_cache, v_cache: [slots, Hkv, D]) at the batch's write slots,
        then attend q [T, H, D] to each query's keys. Returns [T, H, D]. Query head h reads KV head
        h // (H // Hkv)."""
        ...


class AttentionBackend(Protocol):
    """Builds the per-forward attention plans. Plans must be built from device tensors only when the decode
    forward is captured into a CUDA graph (the plan is built inside the captured region)."""

    name: str

    def plan(self, batch: ForwardBatch, window: int | None) -> AttentionPlan: ...


def attention_backend(kind: AttentionBackendKind, device: torch.device, page_size: int = 16) -> AttentionBackend:
    """The backend ``kind`` names for ``device``; AUTO is flex on CUDA (when it can serve) and torch elsewhere.

    Asking for flex where it cannot serve (FlexAttention missing from this torch; on CUDA a page size that is not a
    multiple of 16, its kernels' smallest key tile) is an error saying why, at startup; AUTO falls back to the
    reference and says so in the log."""
    if kind is AttentionBackendKind.TORCH or (kind is AttentionBackendKind.AUTO and device.type != "cuda"):
        return TorchAttention()
    from engine.model.flex_attention import FlexAttentionBackend, flex_unavailable

    compiled = device.type == "cuda"
    reason = flex_unavailable()
    if reason is None and compiled and page_size % 16:
        reason = f"on CUDA it needs a page size that is a multiple of 16, got --page-size {page_size}"
    if reason is None:
        return FlexAttentionBackend(compiled)
    if kind is AttentionBackendKind.FLEX:
        raise ValueError(f"--attention-backend flex: {reason}")
    log.warning("attention backend: FlexAttention cannot serve (%s); using the torch reference", reason)
    return TorchAttention()
