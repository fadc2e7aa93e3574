"""Draft proposers for speculative decoding: what a step verifies beside each request's pending token.

A proposer runs on the executor, which holds every request's tokens and KV. For each decode entry with draft
positions it returns a :class:`Draft`: a tree of candidate tokens under the request's pending token (a chain is a
tree), and, when the tokens were sampled, the distribution each was drawn from. The target model then verifies the
whole tree in one forward (engine/executor/verify.py); nothing a proposer does changes what is committed, only how
many tokens one step can produce.

The interface is what an EAGLE-style head (which drafts from the target's hidden states) would implement too: it
sees the same :class:`DraftRequest` and is told what was accepted afterwards (:meth:`Proposer.accepted`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.executor.sampler import SamplingState
from engine.grammar_calls import DraftTree


@dataclass(frozen=True)
class DraftGrammar:
    """Where a constrained request's grammar is for its draft: the request id it is open under and ``ordinal``, the
    ordinal of the token the pending token's logits row samples (as :class:`~engine.executor.masks.MaskRequest`
    names it). A proposer that drafts under the grammar asks for masks from that state (fenced, C3) with its draft
    so far as the path (pure traversal, C5); it never commits."""

    request_id: str
    ordinal: int


@dataclass(frozen=True)
class DraftRequest:
    """One request asking for a draft.

    ``tokens``: every token the request has, prompt then outputs, the last one being its pending token (sampled,
    its KV not written yet); the runner passes its own growing list, so a proposer reads it and never keeps or
    changes it. ``seq_len`` positions of the target's KV hold ``tokens[:seq_len]`` (so ``seq_len == len(tokens) -
    1``), in ``pages``. The draft may have at most ``max_nodes`` nodes, none deeper than ``max_depth`` (a node
    following the pending token directly has depth 1), and at most ``topk`` children per node (1: a chain).
    ``grammar``: set for a constrained request (None: unconstrained); a proposer may ignore it, the verify masks
    every node anyway."""

    slot: int
    tokens: Sequence[int]
    seq_len: int
    pages: Sequence[int]
    max_nodes: int
    max_depth: int
    topk: int
    sampling: SamplingState
    grammar: DraftGrammar | None = None

    @property
    def constrained(self) -> bool:
        return self.grammar is not None


@dataclass(frozen=True)
class Draft:
    """A tree of draft tokens under the pending token (``DraftTree``: parent -1 is the pending token itself).

    ``q`` [m, V]: the distribution node i's token was sampled from, when it was sampled; None when every token was
    chosen deterministically (a lookup, an argmax, a top-k): verification then treats each as a fixed candidate."""

    tree: DraftTree
    q: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.tree.tokens)

    @property
    def is_chain(self) -> bool:
        return self.tree.parents == tuple(range(-1, len(self.tree.parents) - 1))


NO_DRAFT = Draft(DraftTree((), ()))


class Proposer(Protocol):
    """Drafts for a step's speculative entries, in their order."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]: ...

    def accepted(self, slot: int, path: Sequence[int], seq_len: int) -> None:
        """Verification kept draft nodes ``path`` (root to leaf) of the slot's last draft; the slot now holds KV for
        ``seq_len`` positions. A proposer with state of its own (a draft model's KV) catches up from this."""
        ...

    def release(self, slot: int) -> None:
        """The slot's request is gone: forget what is kept for it."""
        ...

    @property
    def num_slots(self) -> int:
        """Slots the proposer keeps state for (zero once every request is released: what a leak check reads)."""
        ...
