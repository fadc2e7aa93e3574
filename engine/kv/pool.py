"""The physical paged KV cache: one flat slot array per layer for K and for V."""

from __future__ import annotations

import torch


class KVPool:
    """Preallocated K/V storage for every layer, addressed by page.

    Each layer's K (and V) is ``[num_pages * page_size, num_kv_heads, head_dim]``. Token position p of a
    request whose page table is T lives at flat slot ``T[p // page_size] * page_size + p % page_size``.
    The pool is zero-filled: attention gathers padded rows from arbitrary slots and masks them out, and
    masking only neutralises finite values (NaN garbage from ``torch.empty`` would poison softmax).

    ``scratch_page`` adds one page past the ``num_pages`` addressable ones, which no page table can name: the rows
    a CUDA-graph batch is padded with write their K/V there (engine/model/graphs.py), so padding never touches a
    request's KV.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scratch_page: bool = False,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"KVPool {name} must be positive, got {value}")
        self._num_layers = num_layers
        self._num_pages = num_pages
        self._page_size = page_size
        self._scratch_slot = num_pages * page_size if scratch_page else None
        physical_pages = num_pages + 1 if scratch_page else num_pages
        # One allocation; k(layer) / v(layer) are contiguous views into it.
        self._buffer = torch.zeros(
            (num_layers, 2, physical_pages * page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )  # [layers, K|V, slots, Hkv, D]

    def k(self, layer: int) -> torch.Tensor:
        """Keys of ``layer``: ``[num_pages * page_size, num_kv_heads, head_dim]``."""
        return self._buffer[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        """Values of ``layer``: ``[num_pages * page_size, num_kv_heads, head_dim]``."""
        return self._buffer[layer, 1]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of flat slots ``src`` [N] to slots ``dst`` [N] in every layer (a verified draft tree's
        accepted path compacted into place, C11). All sources are read before any destination is written."""
        rows = self._buffer.index_select(2, src)  # [layers, 2, N, Hkv, D]
        self._buffer.index_copy_(2, dst, rows)

    @property
    def scratch_slot(self) -> int | None:
        """The first slot of the scratch page (None without one): written by padding rows, read by nobody."""
        return self._scratch_slot

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the whole pool (all layers, K and V)."""
        return self._buffer.numel() * self._buffer.element_size()

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers, K and V: what sizing the pool from free memory needs."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * element_size
