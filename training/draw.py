"""The random draws every corpus generator shares, and the shapes of what they make.

A generator takes one :class:`Draw` (a document's own seeded ``random.Random``) and returns plain text or the chat
messages and tools the corpus renders with the chat template. Every draw goes through ``rng`` in program order, so
a generator's output depends only on its document's seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from training import banks

Message = dict[str, Any]
Tool = dict[str, Any]
Chat = tuple[list[Message], list[Tool]]
Made = str | Chat


class Draw:
    """A document's random source with the choices the generators share."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, items: Sequence[Any]) -> Any:
        return items[self.rng.randrange(len(items))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def some(self, items: Sequence[Any], low: int, high: int) -> list[Any]:
        return self.rng.sample(list(items), self.rng.randint(low, min(high, len(items))))

    def name(self) -> str:
        return str(self.pick(banks.NAMES))

    def city(self) -> str:
        if self.chance(0.7):
            return str(self.pick(banks.CITIES)[0])
        return str(self.pick(banks.OTHER_CITIES))

    def system(self, p: float) -> list[Message]:
        return [{"role": "system", "content": self.pick(banks.SYSTEM_PROMPTS)}] if self.chance(p) else []


def chat_turns(*turns: str) -> list[Message]:
    """User and assistant turns, alternating, from the user's first."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]


def dumps(value: Any) -> str:
    """JSON as every document writes it: json.dumps' separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)
