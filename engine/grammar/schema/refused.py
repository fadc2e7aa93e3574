"""What stays unenforced: the walk's signal that a rewrite is impossible, and the record of the place it names."""

from __future__ import annotations

from dataclasses import dataclass


class Refused(Exception):
    """A rewrite is impossible: the keyword (and why) that stays unenforced."""

    def __init__(self, keyword: str, detail: str = "") -> None:
        super().__init__(keyword)
        self.keyword = keyword
        self.detail = detail


@dataclass(frozen=True)
class Unenforced:
    """A keyword xgrammar would not enforce and no rewrite could make it: the schema is refused for it."""

    keyword: str
    pointer: str  # JSON pointer of the schema node holding the keyword ("" is the root)
    detail: str = ""

    def describe(self) -> str:
        where = self.pointer or "/"
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.keyword} at {where}{detail}"
