"""Speculative verification: which draft tokens the target keeps, and the token it samples after them.

One target forward gives a logits row for the pending token (row 0) and for every draft node (row 1 + i). Row j is
processed exactly as plain decoding would process it had the request already output the draft tokens on the path
to node j (bias, min_new_tokens, penalties, then temperature, top-k, top-p, min-p: ``Sampler``), giving the
target's distribution ``p`` at that node. Walking down from the root, each step emits one token:

* **Greedy**: the target's choice at the node (argmax, ties to the lowest id); when a child carries that token the
  walk descends into it (the token is "accepted"), otherwise the walk ends with it.
* **Sampled, deterministic drafts** (``q`` None: n-gram lookups, argmax drafts): the target samples at the node
  with the request's own generator, one Exp(1) draw per emitted token, exactly as plain decoding does; a child
  carrying the sampled token is descended into. The output is the very sequence plain decoding gives for the
  seed, whatever the draft.
* **Sampled with draft distributions** (``q`` [m, V], row i the distribution node i's token was drawn from,
  independently of its siblings; one-hot for a node chosen deterministically): the multi-draft rule. Children
  are tried in order: child c with token x is accepted with probability ``min(1, r(x) / q_c(x))``, starting with
  ``r = p``; on rejection ``r`` becomes ``max(r - q_c, 0)`` normalised. When no child is accepted the walk ends
  with a token drawn from the last ``r`` (for a chain: the residual ``max(p - q, 0)``); at a leaf it ends with a
  token drawn from ``p`` (the bonus token).

Every rule leaves the distribution of each emitted token exactly the target's (C6: speculation is lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.executor.sampler import Sampler, SamplingState, race
from engine.grammar_calls import DraftTree
from engine.step import TopLogprobs


@dataclass(frozen=True)
class VerifyItem:
    """One request's share of a verify: its state, the draft under its pending token, its logits rows' offset.

    Its ``1 + len(tree.tokens)`` logits rows start at ``row``: the pending token's, then node i's at ``row + 1 + i``.
    Every parent comes before its children (``tree.parents[i] < i``)."""

    state: SamplingState
    tree: DraftTree
    q: torch.Tensor | None  # [m, V] or None
    row: int


@dataclass(frozen=True)
class Verdict:
    """What verification kept: draft nodes ``path`` (root to leaf), then the emitted tokens (the path's tokens and
    the one sampled after them) with their log-probabilities under the raw model distribution when asked."""

    path: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None


@dataclass(frozen=True)
class _Tree:
    """An item's nodes as logits rows: row 0 the root, row 1 + i draft node i."""

    tokens: tuple[int, ...]  # [1 + m] the root's is unused
    children: tuple[tuple[int, ...], ...]  # rows under each row, in the draft's order
    ahead: tuple[tuple[int, ...], ...]  # draft tokens on the path to each row

    @classmethod
    def of(cls, tree: DraftTree) -> _Tree:
        n = 1 + len(tree.tokens)
        children: list[list[int]] = [[] for _ in range(n)]
        ahead: list[tuple[int, ...]] = [()] * n
        for i, parent in enumerate(tree.parents):
            children[parent + 1].append(i + 1)
            ahead[i + 1] = (*ahead[parent + 1], tree.tokens[i])
        return cls((-1, *tree.tokens), tuple(map(tuple, children)), tuple(ahead))

    def child_with(self, row: int, token: int) -> int | None:
        for child in self.children[row]:
            if self.tokens[child] == token:
                return child
        return None


class Verifier:
    """Verifies a step's speculative entries together: one logits processing pass over all their rows."""

    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler
        self._vocab_size = sampler.vocab_size

    def verify(
        self, logits: torch.Tensor, items: Sequence[VerifyItem], bitmask: torch.Tensor | None = None
    ) -> list[Verdict]:
        """``logits`` [N, >= V]: rows as the items' ``row`` say. ``bitmask`` [N, W] (constrained requests): each row's
        grammar mask, a node's being the grammar's state after the path to it (all bits set for unconstrained rows);
        it applies to p at every node, the bonus token's included."""
        trees = [_Tree.of(item.tree) for item in items]
        raw = logits[:, : self._vocab_size].float()  # [N, V]
        x = self._processed(raw, items, trees, bitmask)  # [N, V]
        greedy = x.max(dim=-1).indices.tolist()  # [N] ties to the lowest id, as plain decoding
        dead = (x.amax(dim=-1) == float("-inf")).tolist()  # [N] rows where nothing is allowed
        probs = self._probabilities(x, items, trees)
        verdicts = []
        for item, tree in zip(items, trees, strict=True):
            if item.state.params.greedy:
                rows, tokens = self._walk_greedy(item, tree, greedy, dead)
            else:
                rows, tokens = self._walk_sampled(item, tree, probs[item.row], dead)
            verdicts.append(self._verdict(raw, item, tree, rows, tokens))
        return verdicts

    def _probabilities(
        self, x: torch.Tensor, items: Sequence[VerifyItem], trees: Sequence[_Tree]
    ) -> dict[int, torch.Tensor]:
        """Each sampled item's rows as distributions [1 + m, V], keyed by its first row: one call for all of them."""
        sampled = [
            (item, len(tree.tokens)) for item, tree in zip(items, trees, strict=True) if not item.state.params.greedy
        ]
        if not sampled:
            return {}
        rows = torch.cat([torch.arange(item.row, item.row + n) for item, n in sampled]).to(x.device)  # [S]
        states = [item.state for item, n in sampled for _ in range(n)]
        probs = self._sampler.probabilities(x.index_select(0, rows), states)  # [S, V]
        return dict(zip((item.row for item, _ in sampled), probs.split([n for _, n in sampled]), strict=True))

    def _processed(
        self, raw: torch.Tensor, items: Sequence[VerifyItem], trees: Sequence[_Tree], bitmask: torch.Tensor | None
    ) -> torch.Tensor:
        """The rows of ``raw`` [N, V] the items use, processed; rows no item uses (plain entries') stay unprocessed."""
        used = [item.row + j for item, tree in zip(items, trees, strict=True) for j in range(len(tree.tokens))]
        states = [item.state for item, tree in zip(items, trees, strict=True) for _ in tree.tokens]
        ahead = [a for tree in trees for a in tree.ahead]
        if bitmask is None and all(
            s.plain_greedy and not s.min_new_active_after(len(a)) for s, a in zip(states, ahead, strict=True)
        ):
            return raw  # nothing to apply: the raw argmax is the choice
        picked = torch.tensor(used, dtype=torch.long, device=raw.device)  # [U]
        rows_mask = bitmask.index_select(0, picked.to(bitmask.device)) if bitmask is not None else None  # [U, W]
        x = raw.clone()  # [N, V]
        x[picked] = self._sampler.process_logits(raw.index_select(0, picked), states, rows_mask, ahead)  # [U, V]
        return x

    @staticmethod
    def _walk_greedy(item: VerifyItem, tree: _Tree, greedy: list[int], dead: list[bool]) -> tuple[list[int], list[int]]:
        rows, tokens, node = [0], [], 0
        while True:
            token = item.state.fallback_token if dead[item.row + node] else greedy[item.row + node]
            tokens.append(token)
            child = tree.child_with(node, token)
            if child is None:
                return rows, tokens
            rows.append(child)
            node = child

    def _walk_sampled(
        self, item: VerifyItem, tree: _Tree, probs: torch.Tensor, dead: list[bool]
    ) -> tuple[list[int], list[int]]:
        """``probs`` [1 + m, V]: the item's rows as distributions."""
        generator = item.state.generator
        rows, tokens, node = [0], [], 0
        while True:
            if dead[item.row + node]:
                self._sampler.noise(generator)  # plain decoding draws for a dead row too: the seed's stream stays
                tokens.append(item.state.fallback_token)
                return rows, tokens
            if item.q is None or not tree.children[node]:
                token = int(race(probs[node], self._sampler.noise(generator)))
                child = tree.child_with(node, token) if item.q is None else None
            else:
                token, child = self._multi_draft(probs[node], item.q, tree, node, generator)
            if child is None:
                tokens.append(token)
                return rows, tokens
            tokens.append(tree.tokens[child])
            rows.append(child)
            node = child

    def _multi_draft(
        self, p: torch.Tensor, q: torch.Tensor, tree: _Tree, node: int, generator: torch.Generator
    ) -> tuple[int, int | None]:
        """The multi-draft rule at one node: (the accepted child's token, its row), or (a residual draw, None)."""
        r = p / p.sum()  # [V]
        for child in tree.children[node]:
            token, q_c = tree.tokens[child], q[child - 1]  # q_c [V]
            u = float(torch.rand((), generator=generator, device=r.device))
            if u * float(q_c[token]) < float(r[token]):  # u < r(x) / q_c(x), without dividing by a zero q
                return token, child
            residual = (r - q_c).clamp_min_(0.0)  # [V]
            total = float(residual.sum())
            if total <= 0.0:
                break  # r == q_c: the rejection had probability zero; keep r (only rounding gets here)
            r = residual / total  # [V]
        return int(race(r, self._sampler.noise(generator))), None

    def _verdict(self, raw: torch.Tensor, item: VerifyItem, tree: _Tree, rows: list[int], tokens: list[int]) -> Verdict:
        path = tuple(row - 1 for row in rows[1:])
        if not item.state.wants_logprobs:
            return Verdict(path, tuple(tokens))
        picked = torch.tensor([item.row + r for r in rows], dtype=torch.long, device=raw.device)  # [a + 1]
        lp = torch.log_softmax(raw.index_select(0, picked), dim=-1)  # [a + 1, V]
        chosen = torch.tensor(tokens, dtype=torch.long, device=raw.device)[:, None]  # [a + 1, 1]
        logprobs = tuple(lp.gather(1, chosen)[:, 0].tolist())
        k = item.state.params.top_logprobs
        if k == 0:
            return Verdict(path, tuple(tokens), logprobs)
        values, ids = lp.topk(min(k, self._vocab_size), dim=-1)  # [a + 1, k]
        tops = tuple(tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
        return Verdict(path, tuple(tokens), logprobs, tops)
