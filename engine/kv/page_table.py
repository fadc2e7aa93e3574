"""The executor's page tables: every slot's pages in position order, rows of one persistent host array.

A step's batch takes its sequences' page tables with one gather from this array (engine/model/forward_batch.py,
``PageRows``) instead of copying every page id of every running request into a new array each step: at 128 streams
of 8k tokens that copy was 65k Python integers a step (1 ms of batch building), while a step changes a few pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class PageTable:
    """Row ``slot`` holds that slot's pages: ``write`` puts pages at a position of the row, nothing else changes it.

    Only a row's first ``len(page table)`` entries belong to the slot's request; what lies past them is left from an
    earlier request of the slot or an unfinished step, and a reader cuts it off (``ForwardBatch.build`` zeroes it).
    The array grows (rows for higher slots, columns for longer requests) as writes need it.
    """

    def __init__(self, num_slots: int = 8, width: int = 16) -> None:
        self._pages: npt.NDArray[np.int64] = np.zeros((max(num_slots, 1), max(width, 1)), dtype=np.int64)  # [N, W]

    @property
    def array(self) -> npt.NDArray[np.int64]:
        """[N, W] the rows; read-only by convention (a step gathers from it)."""
        return self._pages

    def write(self, slot: int, start: int, pages: Sequence[int]) -> None:
        """Pages ``start .. start + len(pages) - 1`` of ``slot``'s table."""
        if not pages:
            return
        if slot < 0 or start < 0 or min(pages) < 0:
            raise ValueError(f"slot {slot}: pages {list(pages)} at {start}: slots, positions and pages are >= 0")
        self._fit(slot + 1, start + len(pages))
        self._pages[slot, start : start + len(pages)] = pages

    def _fit(self, rows: int, width: int) -> None:
        have_rows, have_width = self._pages.shape
        if rows <= have_rows and width <= have_width:
            return
        # Doubling: a few copies over a server's life, each of a few hundred kB.
        new_rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        new_width = have_width if width <= have_width else max(width, 2 * have_width)
        grown = np.zeros((new_rows, new_width), dtype=np.int64)  # [N', W']
        grown[:have_rows, :have_width] = self._pages
        self._pages = grown
