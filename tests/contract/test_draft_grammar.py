"""The draft model drafting under the grammar (``--speculative-draft-grammar on``): real xgrammar, the real embedded
model as its own draft (a draft that knows nothing of the grammar: unmasked, its continuations of a prompt are free
text), and the executor's mask fetcher over the in-process grammar registry.

What is checked: every draft token of a constrained request is allowed by the grammar at its position (chains and
trees, greedy and sampled spines), where the same proposer without the option drafts tokens the grammar refuses; a
depth whose mask allows nothing ends the draft there; a request whose mask cannot be had drafts nothing (never
unmasked) while the rest of the batch drafts on; the first depth's mask waits at the fence for the pending token's
commit (C3); and the mask calls are pure traversal (C5): each grammar's committed state is unchanged after a
propose.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.constraint import Constraint, ConstraintKind
from engine.executor.draft_model import DraftModelProposer
from engine.executor.masks import DraftMasks, MaskFetcher
from engine.executor.proposer import Draft, DraftGrammar, DraftRequest
from engine.executor.sampler import SamplingState
from engine.grammar.backend import LocalGrammar
from engine.grammar.matcher import MatcherState, VersionedMatcher
from engine.grammar_calls import CommitEntry, GrammarBackend, MaskEntry, MaskRefusals
from engine.kv.pool import KVPool
from engine.model.loader import load_model
from engine.model.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from tests.support.grammar_doubles import DelegatingGrammar
from tests.support.models import single_thread  # noqa: F401  (an autouse fixture)

PAGE_SIZE = 8
PAGES_PER_SLOT = 32  # 256 positions: prompts of up to ~100 tokens, a draft of up to 9 nodes
WAIT_S = 5.0
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=64)
CONSTRAINTS = (
    Constraint(ConstraintKind.REGEX, "(ab|cd){2,5}x"),
    Constraint(
        ConstraintKind.JSON_SCHEMA,
        '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},'
        ' "required": ["a", "b"], "additionalProperties": false}',
    ),
    Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "array", "items": {"type": "string"}, "maxItems": 3}'),
)


@dataclass(frozen=True)
class Shape:
    """A draft's shape: depth and branching (topk 1: a chain)."""

    max_nodes: int
    max_depth: int
    topk: int


CHAIN = Shape(4, 4, 1)
TREE = Shape(9, 3, 3)


class Setup:
    """The embedded model (loaded once), its facts and a grammar registry in this process."""

    def __init__(self, model_dir: Path) -> None:
        tokenizer = Tokenizer.from_dir(model_dir)
        self.model, self.model_config = load_model(model_dir, torch.float32, "cpu")
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = tokenizer.eos_token_ids | frozenset(self.model_config.eos_token_ids)
        self.grammar = LocalGrammar(str(model_dir))

    def proposer(self, grammar: GrammarBackend | None = None) -> DraftModelProposer:
        """The embedded model drafting for itself over a fresh KV pool; under ``grammar``'s masks when given (fenced
        for up to WAIT_S, as in delayed-verify mode)."""
        c = self.model_config
        kv = KVPool(c.num_layers, 8 * PAGES_PER_SLOT, PAGE_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        masks = DraftMasks(MaskFetcher(grammar, self.vocab_size, WAIT_S)) if grammar is not None else None
        return DraftModelProposer(self.model, kv, self.vocab_size, c.max_position_embeddings, masks)


@pytest.fixture(scope="module")
def setup(embedded_model_dir: Path) -> Iterator[Setup]:
    s = Setup(embedded_model_dir)
    yield s
    s.grammar.shutdown()


@dataclass
class Constrained:
    """One constrained request: its grammar opened and its first output token (the pending one) committed."""

    request_id: str
    matcher: VersionedMatcher
    prompt: list[int]
    pending: int


def _open(setup: Setup, rid: str, constraint: Constraint, prompt: list[int], pending: int | None = None) -> Constrained:
    """Open ``constraint`` under ``rid`` and commit its pending token: the grammar's lowest allowed token at ordinal 0
    unless given (the target's sample, as far as the draft is concerned)."""
    matcher = setup.grammar.registry.open(rid, constraint, 30.0)
    if pending is None:
        pending = _allowed(_rows(setup, MaskEntry(rid, 0))[0])[0]
    (outcome,) = setup.grammar.commit([CommitEntry(rid, 0, (pending,))])
    assert outcome.result is not None and outcome.result.accepted == 1
    return Constrained(rid, matcher, prompt, pending)


def _rows(setup: Setup, entry: MaskEntry) -> torch.Tensor:
    """The grammar's masks for ``entry`` [R, W] (the authority the drafts are checked against)."""
    (outcome,) = setup.grammar.registry.fill_masks([entry], 1.0)
    assert outcome.rows is not None, outcome.message
    return outcome.rows.words


def _allowed(row: torch.Tensor) -> list[int]:
    """Token ids a mask row [W] allows."""
    bits = (row[:, None].to(torch.int64) >> torch.arange(32)) & 1  # [W, 32]
    return bits.flatten().nonzero().flatten().tolist()


def _request(
    setup: Setup,
    slot: int,
    c: Constrained | None,
    prompt: list[int],
    shape: Shape,
    params: SamplingParams,
    seed: int = 0,
) -> DraftRequest:
    """A decode's draft request for ``slot``: the prompt and the pending token, the grammar at ordinal 1 if any."""
    pending = c.pending if c is not None else prompt[-1]
    tokens = [*prompt, pending] if c is not None else prompt
    state = SamplingState(params, tuple(tokens[:-1]), setup.eos_token_ids, setup.vocab_size, "cpu", seed)
    state.record(tokens[-1])
    pages = range(slot * PAGES_PER_SLOT, (slot + 1) * PAGES_PER_SLOT)
    grammar = DraftGrammar(c.request_id, state.num_output) if c is not None else None
    return DraftRequest(
        slot, tokens, len(tokens) - 1, pages, shape.max_nodes, shape.max_depth, shape.topk, state, grammar
    )


def _refused_nodes(setup: Setup, c: Constrained, draft: Draft) -> list[int]:
    """The nodes of ``draft`` whose token the grammar refuses after its path (from the grammar's own masks)."""
    rows = _rows(setup, MaskEntry(c.request_id, 1, draft.tree))  # [1 + m, W]
    tree = draft.tree
    return [i for i, token in enumerate(tree.tokens) if token not in _allowed(rows[tree.parents[i] + 1])]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(rng.randint(8, 60))] for _ in range(n)]


def _state_of(matchers: Sequence[VersionedMatcher]) -> list[tuple[int, MatcherState]]:
    return [(m.ordinal, m.state) for m in matchers]


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_draft_token_of_a_constrained_request_is_allowed_by_its_grammar(
    setup: Setup, shape: Shape, params: SamplingParams
) -> None:
    """Three constrained requests (a regex, two JSON schemas) and an unconstrained one in one propose. Without the
    option the draft model drafts tokens the grammar refuses; with it, none: every node's token is allowed by the
    mask after its path (spine and siblings), a sampled node's ``q`` is zero on every banned token and sums to 1,
    and the unconstrained request drafts as before (all its nodes). The grammars' committed state (ordinal, state)
    and their mask at it are unchanged (C5). Fails if the draft's rows are not masked (checked by passing
    ``bitmask=None`` to ``_choose``: nodes refused) or with the wrong state's row (checked by reading each chain's
    first row, the mask before the spine, in place of its last: refused nodes); a mask call that fed the draft into
    the matcher would move its ordinal."""
    tag = f"{shape.topk}-{params.greedy}"
    prompts = _prompts(4, seed=shape.max_nodes)
    opened = [_open(setup, f"allowed-{tag}-{i}", c, prompts[i]) for i, c in enumerate(CONSTRAINTS)]
    before = _state_of([c.matcher for c in opened])
    masks_before = [_rows(setup, MaskEntry(c.request_id, 1)) for c in opened]
    try:
        drafts = {}
        for option in (False, True):
            proposer = setup.proposer(setup.grammar if option else None)
            requests = [_request(setup, i, c, c.prompt, shape, params, seed=i) for i, c in enumerate(opened)]
            requests.append(_request(setup, 3, None, prompts[3], shape, params, seed=3))
            drafts[option] = proposer.propose(requests)
        unmasked = [_refused_nodes(setup, c, d) for c, d in zip(opened, drafts[False], strict=False)]
        assert any(unmasked), "without the option the draft model must draft something the grammar refuses"
        for c, draft in zip(opened, drafts[True], strict=False):
            assert draft.num_nodes > 0, c.request_id
            assert _refused_nodes(setup, c, draft) == [], c.request_id
            if draft.q is not None:
                rows = _rows(setup, MaskEntry(c.request_id, 1, draft.tree))
                for i, parent in enumerate(draft.tree.parents):
                    banned = torch.ones(setup.vocab_size, dtype=torch.bool)
                    banned[_allowed(rows[parent + 1])] = False
                    assert float(draft.q[i][banned].sum()) == 0.0 and abs(float(draft.q[i].sum()) - 1.0) < 1e-5
        assert drafts[True][3].num_nodes == drafts[False][3].num_nodes == shape.max_nodes  # unconstrained: as ever
        assert (params.greedy and drafts[True][3].tree == drafts[False][3].tree) or not params.greedy
        assert _state_of([c.matcher for c in opened]) == before  # pure traversal (C5)
        for c, mask in zip(opened, masks_before, strict=True):
            assert torch.equal(_rows(setup, MaskEntry(c.request_id, 1)), mask)
    finally:
        setup.grammar.release([c.request_id for c in opened])


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_drafting_stops_at_a_depth_whose_mask_allows_nothing(setup: Setup, shape: Shape) -> None:
    """A grammar of one digit, its pending token that digit: at depth 1 only the stop tokens are allowed, after one
    the grammar has ended and allows nothing. The draft is stop tokens at depth 1 (a tree's siblings only among
    them, nothing else being allowed) and no node is drafted from the all-banned row after them; unmasked, the draft
    model drafts to full depth. Fails if an all-banned row is drafted from (checked by dropping the ``ended`` check
    in ``_Growing.growing``: the draft then goes on after the stop token)."""
    digit = Constraint(ConstraintKind.REGEX, "[0-9]")
    (prompt,) = _prompts(1, seed=7)
    c = _open(setup, f"ends-{shape.topk}", digit, prompt)
    try:
        (masked,) = setup.proposer(setup.grammar).propose([_request(setup, 0, c, prompt, shape, GREEDY)])
        (free,) = setup.proposer().propose([_request(setup, 0, c, prompt, shape, GREEDY)])
        stops = _allowed(_rows(setup, MaskEntry(c.request_id, 1))[0])
        assert stops and set(stops) <= setup.eos_token_ids
        tree = masked.tree
        assert set(tree.parents) == {-1} and set(tree.tokens) <= set(stops)  # depth 1 only: stop tokens
        assert len(tree.tokens) == min(shape.topk, len(stops))  # siblings only among what the mask allows
        assert len(free.tree.tokens) == shape.max_nodes
    finally:
        setup.grammar.release([c.request_id])


class FailingMasks(DelegatingGrammar[LocalGrammar]):
    """The grammar service unreachable for mask calls from call ``fail_from`` on (1: every call)."""

    def __init__(self, inner: LocalGrammar, fail_from: int) -> None:
        super().__init__(inner)
        self.fail_from = fail_from
        self.calls = 0

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        self.calls += 1
        if self.calls >= self.fail_from:
            raise ConnectionError("grammar service unreachable")
        return super().fill_masks_into(entries, deadline_s, out, starts)


def test_a_request_whose_mask_cannot_be_had_drafts_nothing_and_the_others_draft_on(setup: Setup) -> None:
    """In one batch: a constrained request whose grammar is not open (its mask is refused UNKNOWN) drafts nothing,
    the constrained request beside it drafts under its grammar, the unconstrained one drafts in full. With every
    mask call failing (the grammar service unreachable), or only the second depth's, no constrained request drafts
    (not even the node drafted under the first depth's mask), the unconstrained one still does in full. Fails if a
    request whose mask could not be had keeps a draft: checked by dropping the ``unmasked`` check in
    ``_Growing.draft`` (the second depth's failure then leaves the first depth's node)."""
    prompts = _prompts(3, seed=3)
    c = _open(setup, "refused-open", CONSTRAINTS[0], prompts[0])
    ghost = Constrained("refused-never-opened", c.matcher, prompts[1], c.pending)
    try:
        backends = [
            (setup.grammar, True),
            (FailingMasks(setup.grammar, 1), False),
            (FailingMasks(setup.grammar, 2), False),
        ]
        for backend, drafting in backends:
            requests = [
                _request(setup, 0, c, prompts[0], CHAIN, GREEDY),
                _request(setup, 1, ghost, prompts[1], CHAIN, GREEDY),
                _request(setup, 2, None, prompts[2], CHAIN, GREEDY),
            ]
            mine, other, free = setup.proposer(backend).propose(requests)
            assert (mine.num_nodes > 0) is drafting and _refused_nodes(setup, c, mine) == []
            assert other.num_nodes == 0 and free.num_nodes == CHAIN.max_nodes
    finally:
        setup.grammar.release([c.request_id])


def test_the_first_depth_waits_at_the_fence_for_the_pending_tokens_commit(setup: Setup) -> None:
    """Delayed verify: the executor drafts step N + 1 before the scheduler has committed step N's token. The first
    depth's mask is fenced at the pending token's ordinal (C3): the propose waits for that commit (made here 0.3 s
    later, from another thread) and then drafts from the state after it, every node allowed. Fails if the draft's
    mask call does not wait at the fence (checked with WAIT_S = 0: refused BEHIND_DEADLINE, nothing is drafted)."""
    (prompt,) = _prompts(1, seed=5)
    rid = "fenced"
    matcher = setup.grammar.registry.open(rid, CONSTRAINTS[1], 30.0)
    pending = _allowed(_rows(setup, MaskEntry(rid, 0))[0])[0]
    c = Constrained(rid, matcher, prompt, pending)
    committed = threading.Event()

    def commit_later() -> None:
        time.sleep(0.3)
        committed.set()
        (outcome,) = setup.grammar.commit([CommitEntry(rid, 0, (pending,))])  # through the registry: fills the fence
        assert outcome.result is not None and outcome.result.accepted == 1

    committer = threading.Thread(target=commit_later)
    try:
        proposer = setup.proposer(setup.grammar)
        committer.start()
        (draft,) = proposer.propose([_request(setup, 0, c, prompt, CHAIN, GREEDY)])
        assert committed.is_set() and draft.num_nodes > 0 and _refused_nodes(setup, c, draft) == []
    finally:
        committer.join(timeout=10)
        setup.grammar.release([rid])
