"""What stays unenforced: the walk's signal that a rewrite is impossible, and the record of the place it names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Keywords whose refusal even the output check cannot take over: a $ref that does not resolve inside the schema names
# a schema nobody here can read (no document is fetched).
UNCHECKABLE = frozenset({"$ref"})


class Refused(Exception):
    """A rewrite is impossible: the keyword (and why) that stays unenforced.

    ``drop``: the keys of the node being visited that checked mode removes from the grammar (and checks on the
    output instead) so that the rest of the node can still be enforced; by default the keyword itself.
    """

    def __init__(self, keyword: str, detail: str = "", drop: Sequence[str] | None = None) -> None:
        super().__init__(keyword)
        self.keyword = keyword
        self.detail = detail
        self.drop = tuple(drop) if drop is not None else (keyword,)


@dataclass(frozen=True)
class Unenforced:
    """A keyword xgrammar would not enforce and no rewrite could make it.

    In strict mode the schema is refused for it; in checked mode the output is checked for it. ``covers`` says what
    the output check takes over: the schema locations under ``pointer`` (``"uniqueItems"``, ``"allOf/1"``) whose
    keywords the grammar does not enforce; empty means the whole node at ``pointer``.
    """

    keyword: str
    pointer: str  # JSON pointer of the schema node holding the keyword ("" is the root)
    detail: str = ""
    covers: tuple[str, ...] = ()

    def describe(self) -> str:
        where = self.pointer or "/"
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.keyword} at {where}{detail}"

    def covers_location(self, location: str) -> bool:
        """Whether the schema location ``location`` (a JSON pointer to a keyword) lies in what this record covers."""
        if not self.covers:
            return location == self.pointer or location.startswith(self.pointer + "/")
        return any(
            location == f"{self.pointer}/{c}" or location.startswith(f"{self.pointer}/{c}/") for c in self.covers
        )
