"""The draft-model proposer: a smaller model sharing the target's tokenizer drafts each request's next tokens.

It keeps a KV pool of its own, addressed by the target's page ids (the same pages discipline: a request's draft
KV lives in the pages the scheduler gave the request, so it is freed with them, C9). Per slot it remembers which
tokens its KV holds, position by position (``fed``); before drafting it compares them with the request's real
tokens and feeds only what differs, so it catches up with whatever the verify accepted (or with a stretch where
the request was not drafted at all) without being told.

One propose call runs ``max depth`` draft forwards over every drafted request at once: the first feeds each
request's catch-up run (ending with its pending token), each later one the token chosen at the depth before. At
every depth the request's draft continues with one token (the spine) and, for a tree (``topk > 1``), gets the
next most likely tokens as siblings of it, leaves in the verify tree. A greedy or seeded request's spine is the
draft's argmax: the verify then reproduces plain decoding exactly (engine/executor/verify.py). With ``min_prob``
(``--speculative-draft-min-prob``) a draft ends after its first spine token the draft gives less than that probability
(that depth's siblings still drafted): past a token the draft is unsure of, its next ones are rarely accepted and each
costs a verify row, so deeper drafts pay where the draft is sure. Any other sampled
request's spine is drawn from the draft's own distribution (after the request's temperature, top-k, top-p,
min-p), which is returned as ``q`` for the rejection rule; siblings are chosen deterministically (one-hot ``q``).
At every depth where the request cannot emit eos or its stop ids (short of its min_new_tokens) the draft cannot
propose them either (native chain and torch forwards alike): the verify's row bans them, so such a draft token would
be rejected with everything after it, and a sampled spine's ``q`` is then renormalised over what is allowed.

Under the grammar (``--speculative-draft-grammar on``, a :class:`~engine.executor.masks.DraftMasks` given): each
constrained request's row is masked at every depth with its grammar's mask for the state after its committed
tokens, its pending token and the spine so far, fetched while that depth's forward runs. The spine and the siblings
are then chosen from the masked row, and a sampled spine's ``q`` is the masked, renormalised distribution, the one
its token was really drawn from, so the rejection rule stays lossless w.r.t. the constrained target. A depth whose
mask allows nothing (the grammar refuses the prefix or has ended) ends the draft there; a request whose mask could
not be had drafts nothing this step (its verify runs plain, still masked): a constrained request is never drafted
unmasked. Off (the default), the draft drafts unmasked and only the verify is masked: lossless too, since ``q`` is
what each token was drawn from, but drafts past the grammar's first refusal are wasted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.executor.masks import ALL_ALLOWED, DraftMasks, PendingDraftMasks
from engine.executor.proposer import NO_DRAFT, Draft, DraftGrammar, DraftRequest
from engine.executor.sampler import Sampler, race
from engine.grammar_calls import DraftTree
from engine.kv.pool import KVPool
from engine.model.draft_chain import ChainRow, DraftChain
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model_info import ModelInfo

# Separates a request's draft random stream from its own (the target's sampling) stream.
_DRAFT_STREAM = 0x5DEECE66D
# The native kernel runs a catch-up as one batched forward of its tokens, with plain C loops for matmuls; a long
# one (a request's first draft after a long prompt: a prefill, really) is left to the torch forward's GEMMs.
_CHAIN_MAX_FEED = 256
# And at most this many catch-up tokens in one native call (its scratch is per token: for a draft of hidden 768
# about 60 KB each); the rows past it take the torch forward.
_CHAIN_MAX_TOKENS = 1024


@dataclass
class _SlotDraft:
    """What the draft pool holds for one slot: ``fed[p]`` is the token whose KV sits at position p."""

    fed: list[int] = field(default_factory=list)
    valid: int = 0  # fed[:valid] is known to equal the request's tokens
    generator: torch.Generator | None = None


@dataclass
class _Growing:
    """One request's draft while it is built, depth by depth."""

    request: DraftRequest
    depth: int  # spine length to reach
    sampled: bool  # the spine is drawn (q matters), not the argmax
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor | int] = field(default_factory=list)  # a distribution [V], or a one-hot token
    spine: list[int] = field(default_factory=list)  # node index of the spine token at each depth
    siblings_left: int = 0
    ended: bool = False  # a depth's mask allowed nothing, or the draft was unsure of its last spine token: it ends
    unmasked: bool = False  # its grammar's mask could not be had: no draft this step

    @property
    def growing(self) -> bool:
        return not (self.ended or self.unmasked) and len(self.spine) < self.depth

    def spine_tokens(self) -> list[int]:
        return [self.tokens[node] for node in self.spine]

    def draft(self, vocab_size: int, device: torch.device) -> Draft:
        if self.unmasked or not self.tokens:
            return NO_DRAFT
        tree = DraftTree(tuple(self.tokens), tuple(self.parents))
        if not self.sampled:
            return Draft(tree)
        q = torch.zeros(len(self.tokens), vocab_size, dtype=torch.float32, device=device)  # [m, V]
        for i, row in enumerate(self.q_rows):
            if isinstance(row, int):
                q[i, row] = 1.0
            else:
                q[i] = row
        return Draft(tree, q)


class DraftModelProposer:
    """Drafts with a small model over its own paged KV pool (same page ids as the target's); with ``masks``, drafts
    constrained requests under their grammars."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        vocab_size: int,
        max_context: int,
        masks: DraftMasks | None = None,
        min_prob: float = 0.0,
    ) -> None:
        self._model = model
        self._masks = masks
        self._min_prob = min_prob  # a draft ends after a spine token the draft gives less (SpeculativeConfig)
        self._kv = kv
        self._vocab_size = vocab_size
        self._max_context = max_context
        self._device = kv.device
        self._sampler = Sampler(vocab_size, kv.device)
        self._slots: dict[int, _SlotDraft] = {}
        # The native kernel (engine/model/draft_chain.py): whole greedy chains, else one depth at a time; None: torch.
        self._chain = DraftChain.build(model, kv, vocab_size)

    @classmethod
    def load(
        cls, path: Path, config: EngineConfig, info: ModelInfo, masks: DraftMasks | None = None, min_prob: float = 0.0
    ) -> DraftModelProposer:
        device = torch.device(config.device)
        model, model_config = load_model(path, config.torch_dtype, device)
        if model_config.vocab_size != info.vocab_size:
            raise ValueError(
                f"draft model {path} has a vocabulary of {model_config.vocab_size} tokens, the target "
                f"{info.model_path} one of {info.vocab_size}: a draft must share the target's tokenizer"
            )
        kv = KVPool(
            model_config.num_layers,
            config.num_pages,
            config.page_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            config.torch_dtype,
            device,
        )
        return cls(model, kv, info.vocab_size, model_config.max_position_embeddings, masks, min_prob)

    # ------------------------------------------------------------ Proposer

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        growing = [self._start(r) for r in requests]
        live = [g for g in growing if g is not None]
        if live:
            self._draft(live)
        return [g.draft(self._vocab_size, self._device) if g is not None else NO_DRAFT for g in growing]

    def accepted(self, slot: int, path: Sequence[int], seq_len: int) -> None:
        return None  # the next propose compares what the pool holds with the request's tokens

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    # ------------------------------------------------------------ drafting

    def _start(self, r: DraftRequest) -> _Growing | None:
        depth = min(r.max_depth, r.max_nodes)
        if depth < 1 or r.seq_len + depth > self._max_context:
            return None
        params = r.sampling.params
        sampled = not params.greedy and params.seed is None
        return _Growing(r, depth, sampled, siblings_left=r.max_nodes - depth if r.topk > 1 else 0)

    def _draft(self, live: list[_Growing]) -> None:
        seqs = [self._catch_up(g.request) for g in live]
        chained, budget = [], _CHAIN_MAX_TOKENS
        for i, (g, seq) in enumerate(zip(live, seqs, strict=True)):
            if self._chains(g, seq) and len(seq.token_ids) <= budget:
                chained.append(i)
                budget -= len(seq.token_ids)
        if chained:
            self._draft_chains([live[i] for i in chained], [seqs[i] for i in chained])
            rest = sorted(set(range(len(live))) - set(chained))
            live, seqs = [live[i] for i in rest], [seqs[i] for i in rest]
        if live:
            self._draft_forwards(live, seqs)

    def _chains(self, g: _Growing, seq: SeqInput) -> bool:
        """Whether ``g`` is drafted by the native chain: a greedy (or seeded) chain, no grammar masks to draft under,
        a short catch-up."""
        unmasked = self._masks is None or g.request.grammar is None
        chain = g.request.topk <= 1 or g.siblings_left == 0
        short = len(seq.token_ids) <= _CHAIN_MAX_FEED
        return self._chain is not None and not g.sampled and unmasked and chain and short

    def _draft_chains(self, live: list[_Growing], seqs: list[SeqInput]) -> None:
        """Greedy chains in one native call: the same spines the forwards below would choose, to rounding."""
        assert self._chain is not None
        pairs = zip(live, seqs, strict=True)
        rows = [
            ChainRow(seq.token_ids, seq.start_pos, g.request.pages, g.depth, *self._banned(g.request))
            for g, seq in pairs
        ]
        chosen = self._chain.run(rows, min_prob=self._min_prob).tokens
        for g, tokens in zip(live, chosen, strict=True):
            self._slots[g.request.slot].fed.extend(tokens[:-1])  # the chain fed all but its last token
            for token in tokens:
                self._grow(g, token, token, ())

    @staticmethod
    def _banned(r: DraftRequest) -> tuple[tuple[int, ...], int]:
        """The ids ``r``'s draft must not propose, and at how many of its first depths (min_new_tokens)."""
        left = r.sampling.min_new_left()
        return (r.sampling.min_new_banned_ids, left) if left > 0 else ((), 0)

    def _draft_forwards(self, live: list[_Growing], seqs: list[SeqInput]) -> None:
        """Every other draft (sampled spines, trees, drafts under the grammar), one batched forward per depth and the
        choice between them here."""
        for d in range(1, max(g.depth for g in live) + 1):
            asking, pending = self._start_masks(live)
            try:
                logits = self._forward(seqs)  # [B, >= V]
            except BaseException:
                if pending is not None:
                    pending.close()  # an open fence would be filled by later commits into a buffer nobody reads
                raise
            bitmask = self._take_masks(live, asking, pending)
            self._choose(live, logits, bitmask)
            still = [g for g in live if g.growing]
            if not still:
                return
            seqs = [self._feed(g, d) for g in still]
            live = still

    def _forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """One depth's logits [B, >= V]: a depth-1 native chain where it can run (its logits kept, its argmax unused),
        else the model's torch forward (a long catch-up, or no native kernel)."""
        short = all(len(seq.token_ids) <= _CHAIN_MAX_FEED for seq in seqs)
        if self._chain is not None and short and sum(len(seq.token_ids) for seq in seqs) <= _CHAIN_MAX_TOKENS:
            rows = [ChainRow(seq.token_ids, seq.start_pos, seq.page_table, 1) for seq in seqs]
            logits = self._chain.run(rows, keep_logits=True).logits
            assert logits is not None
            return logits[:, 0]  # [B, V]
        return self._model(ForwardBatch.build(seqs, self._kv.page_size, self._device), self._kv)  # [B, Vm]

    def _start_masks(self, live: list[_Growing]) -> tuple[list[int], PendingDraftMasks | None]:
        """This depth's masks for the constrained requests of ``live`` (their indices), asked before the forward."""
        if self._masks is None:
            return [], None
        asking: list[int] = []
        positions: list[tuple[DraftGrammar, list[int]]] = []
        for i, g in enumerate(live):
            if g.request.grammar is not None:
                asking.append(i)
                positions.append((g.request.grammar, g.spine_tokens()))
        return (asking, self._masks.start(positions)) if asking else ([], None)

    def _take_masks(
        self, live: list[_Growing], asking: list[int], pending: PendingDraftMasks | None
    ) -> torch.Tensor | None:
        """The depth's bitmask [B, W] over ``live`` (rows of unconstrained requests allow everything); a request whose
        mask could not be had is marked to draft nothing."""
        if pending is None:
            return None
        rows, answered = pending.result(self._device)  # [P, W]
        assert rows is not None
        for i, ok in zip(asking, answered, strict=True):
            live[i].unmasked = live[i].unmasked or not ok
        bitmask = torch.full((len(live), rows.shape[1]), ALL_ALLOWED, dtype=torch.int32, device=rows.device)  # [B, W]
        bitmask[torch.tensor(asking, dtype=torch.long, device=rows.device)] = rows
        return bitmask

    def _catch_up(self, r: DraftRequest) -> SeqInput:
        """The first forward's run for ``r``: from the first position whose draft KV is not the request's token,
        through its pending token (always fed: its logits give the first draft)."""
        state = self._slots.setdefault(r.slot, _SlotDraft())
        v, tokens = state.valid, r.tokens
        end = min(len(state.fed), r.seq_len)
        while v < end and state.fed[v] == tokens[v]:
            v += 1
        v = min(v, r.seq_len)
        del state.fed[v:]
        state.fed.extend(tokens[v : r.seq_len + 1])
        state.valid = r.seq_len + 1
        if state.generator is None:
            state.generator = torch.Generator(device=self._device)
            state.generator.manual_seed(r.sampling.generator.initial_seed() ^ _DRAFT_STREAM)
        return SeqInput(tokens[v : r.seq_len + 1], v, r.pages, LogitsMode.LAST)

    def _feed(self, g: _Growing, depth: int) -> SeqInput:
        """The run for depth ``depth + 1``: the spine token chosen at ``depth``, written after the ones before."""
        token = g.tokens[g.spine[-1]]
        state = self._slots[g.request.slot]
        state.fed.append(token)  # speculative: the next propose keeps it only if the verify accepted it
        return SeqInput((token,), g.request.seq_len + depth, g.request.pages, LogitsMode.LAST)

    def _choose(self, live: list[_Growing], logits: torch.Tensor, bitmask: torch.Tensor | None) -> None:
        raw = logits[:, : self._vocab_size].float()  # [B, V]
        states = [g.request.sampling for g in live]
        banning = any(len(g.spine) < s.min_new_left() for g, s in zip(live, states, strict=True))
        masked = bitmask is not None or banning
        if masked:
            raw = raw.clone(memory_format=torch.contiguous_format)  # [B, V]
        if bitmask is not None:
            self._sampler.apply_bitmask(raw, bitmask)  # banned tokens -inf: never a spine, a sibling or mass in q
        if banning:  # what the request cannot emit at this depth, as the verify's row for it bans
            self._sampler.apply_min_new(raw, states, [g.spine_tokens() for g in live])
        best = raw.max(dim=-1)
        spine = best.indices  # [B]
        # A row that allows nothing (the grammar refuses the prefix or has ended, or allows only what is banned) ends
        # that draft: no node is drafted from it. Rows with nothing banned always have a finite maximum.
        open_rows = (best.values > float("-inf")).tolist() if masked else [True] * len(live)
        for g, is_open in zip(live, open_rows, strict=True):
            g.ended = g.ended or not is_open
        drafting = [g.growing for g in live]
        sampled = [i for i, g in enumerate(live) if g.sampled and drafting[i]]
        probs: torch.Tensor | None = None
        if sampled:
            rows = torch.tensor(sampled, dtype=torch.long, device=raw.device)  # [S]
            probs = self._sampler.probabilities(raw.index_select(0, rows), [live[i].request.sampling for i in sampled])
            probs = probs / probs.sum(dim=-1, keepdim=True)  # [S, V]
            generators = [self._slots[live[i].request.slot].generator for i in sampled]
            noise = torch.stack([self._sampler.noise(gen) for gen in generators if gen is not None])  # [S, V]
            spine[rows] = race(probs, noise)
        ranked = self._ranked(raw, max(g.request.topk for g in live), masked)
        unsure = self._unsure(raw, spine, sampled, probs)
        spine_ids = spine.tolist()
        row_of = {i: k for k, i in enumerate(sampled)}
        for i, g in enumerate(live):
            if not drafting[i]:
                continue
            q_row: torch.Tensor | int = spine_ids[i]
            if probs is not None and i in row_of:
                q_row = probs[row_of[i]]
            self._grow(g, spine_ids[i], q_row, ranked[i] if ranked is not None else ())
            g.ended = g.ended or unsure[i]  # this depth (its siblings too) is drafted, the next ones are not

    def _unsure(
        self, raw: torch.Tensor, spine: torch.Tensor, sampled: list[int], probs: torch.Tensor | None
    ) -> list[bool]:
        """Per row of ``raw`` [B, V], whether the draft gives its spine token ``spine`` [B] less than ``min_prob``:
        under its own logits (an argmax spine), or the distribution it was drawn from (rows ``sampled``, ``probs``)."""
        if self._min_prob <= 0.0:
            return [False] * raw.shape[0]
        p = raw.softmax(dim=-1).gather(1, spine.unsqueeze(1)).squeeze(1)  # [B]
        if probs is not None:
            rows = torch.tensor(sampled, dtype=torch.long, device=raw.device)  # [S]
            p[rows] = probs.gather(1, spine[rows].unsqueeze(1)).squeeze(1)
        return (p < self._min_prob).tolist()

    def _ranked(self, x: torch.Tensor, width: int, masked: bool) -> list[list[int]] | None:
        """Per row of ``x`` [B, V] its ``width + 1`` most likely tokens, best first, without banned ones (-inf) when
        ``masked``; None for chains (no siblings are drafted)."""
        if width <= 1:
            return None
        top = x.topk(min(width + 1, self._vocab_size), dim=-1)  # [B, w+1]
        if not masked:
            return top.indices.tolist()
        allowed = (top.values > float("-inf")).tolist()
        return [
            [t for t, ok in zip(ids, oks, strict=True) if ok]
            for ids, oks in zip(top.indices.tolist(), allowed, strict=True)
        ]

    @staticmethod
    def _grow(g: _Growing, token: int, q_row: torch.Tensor | int, ranked: Sequence[int]) -> None:
        parent = g.spine[-1] if g.spine else -1
        g.spine.append(len(g.tokens))
        g.tokens.append(token)
        g.parents.append(parent)
        g.q_rows.append(q_row)
        room = min(g.request.topk - 1, g.siblings_left)
        for sibling in (t for t in ranked if t != token):
            if room <= 0:
                break
            g.tokens.append(sibling)
            g.parents.append(parent)
            g.q_rows.append(sibling)
            g.siblings_left -= 1
            room -= 1
