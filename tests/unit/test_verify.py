"""Speculative verification is lossless (C6): on a six-token vocabulary, over thousands of seeded trials, the tokens
a verify emits follow the target's distribution exactly, first position and later ones, for chains and trees,
sampled drafts (the min(1, p/q) rule and its residual) and deterministic ones, under temperature and top-p.

Each check is a chi-square test of the empirical counts against the target's processed distribution at a stated
significance (p-value above 0.001; the trials are seeded, so the outcome is fixed). Each configuration also checks
that the same counts reject the draft's distribution (p-value below 1e-6): the test has the power to see a verify
that merely passes the draft through. Greedy verification, penalties along a tree path and logprobs are checked
exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from engine.executor.sampler import Sampler, SamplingState
from engine.executor.verify import Verdict, Verifier, VerifyItem
from engine.grammar_calls import DraftTree
from engine.sampling_params import SamplingParams
from tests.support.models import single_thread  # noqa: F401  (an autouse fixture)

V = 6
TRIALS = 6000
SIGNIFICANCE = 1e-3
# Target logits: at the root, and at a node by its token (depth 1) or by its two tokens (depth 2).
ROOT = torch.tensor([1.2, 0.3, -0.4, 0.9, -1.0, 0.1])
DEPTH1 = torch.randn(V, V, generator=torch.Generator().manual_seed(1))  # [token, V]
DEPTH2 = torch.randn(V, V, V, generator=torch.Generator().manual_seed(2))  # [token1, token2, V]
# The draft's logits, deliberately unlike the target's.
DRAFT_ROOT = torch.tensor([-0.5, 1.5, 0.2, -0.3, 0.8, -1.2])
DRAFT_DEPTH1 = torch.randn(V, V, generator=torch.Generator().manual_seed(3))

PARAMS = {
    "temperature 1": SamplingParams(temperature=1.0, max_new_tokens=16),
    "temperature 0.7, top-p 0.8": SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=16),
}


def _state(params: SamplingParams, seed: int) -> SamplingState:
    return SamplingState(params, (0,), frozenset(), V, "cpu", seed)


def _target(sampler: Sampler, state: SamplingState, logits: torch.Tensor) -> torch.Tensor:
    """The target's distribution for ``logits`` [V] under the request's parameters, normalised [V]."""
    p = sampler.probabilities(sampler.process_logits(logits[None], [state]), [state])[0]
    return p / p.sum()


def _chi2_pvalue(counts: Counter[int], probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against ``probs`` [V]; a token of probability 0 that occurs gives 0."""
    total = sum(counts.values())
    stat, cells = 0.0, 0
    for token in range(V):
        expected = float(probs[token]) * total
        if expected == 0.0:
            if counts[token]:
                return 0.0
            continue
        stat += (counts[token] - expected) ** 2 / expected
        cells += 1
    df = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, torch.tensor(stat / 2, dtype=torch.float64)))


Drafter = Callable[[torch.Generator, Sampler, SamplingState], tuple[DraftTree, torch.Tensor | None]]


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _chain2(gen: torch.Generator, sampler: Sampler, state: SamplingState) -> tuple[DraftTree, torch.Tensor | None]:
    """Two tokens, each drawn from the draft's distribution after the one before."""
    q0 = _target(sampler, state, DRAFT_ROOT)
    d1 = _sample(q0, gen)
    q1 = _target(sampler, state, DRAFT_DEPTH1[d1])
    d2 = _sample(q1, gen)
    return DraftTree((d1, d2), (-1, 0)), torch.stack((q0, q1))


def _tree_iid(gen: torch.Generator, sampler: Sampler, state: SamplingState) -> tuple[DraftTree, torch.Tensor | None]:
    """Two siblings drawn independently from the draft at the root, a drawn child under the first."""
    q0 = _target(sampler, state, DRAFT_ROOT)
    a, b = _sample(q0, gen), _sample(q0, gen)
    qa = _target(sampler, state, DRAFT_DEPTH1[a])
    return DraftTree((a, b, _sample(qa, gen)), (-1, -1, 0)), torch.stack((q0, q0, qa))


def _tree_mixed(gen: torch.Generator, sampler: Sampler, state: SamplingState) -> tuple[DraftTree, torch.Tensor | None]:
    """The draft model's shape: a drawn spine token and a deterministic sibling (one-hot q), as drafted."""
    q0 = _target(sampler, state, DRAFT_ROOT)
    spine = _sample(q0, gen)
    sibling = next(t for t in DRAFT_ROOT.argsort(descending=True).tolist() if t != spine)
    return DraftTree((spine, sibling), (-1, -1)), torch.stack(
        (q0, torch.nn.functional.one_hot(torch.tensor(sibling), V))
    )


def _tree_fixed(gen: torch.Generator, sampler: Sampler, state: SamplingState) -> tuple[DraftTree, torch.Tensor | None]:
    """Deterministic candidates (n-gram-like): the draft's top two at the root, the top one under each."""
    a, b = DRAFT_ROOT.argsort(descending=True)[:2].tolist()
    return DraftTree((a, b, int(DRAFT_DEPTH1[a].argmax()), int(DRAFT_DEPTH1[b].argmax())), (-1, -1, 0, 1)), None


GRAMMAR_BANNED = (0, 3)  # the root's two most likely tokens: what a grammar mask bans at every row below


def _masked(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [V] with the grammar's banned tokens at -inf, as the mask applies before temperature and top-p."""
    out = logits.clone()
    out[list(GRAMMAR_BANNED)] = float("-inf")
    return out


def _chain2_under_mask(
    gen: torch.Generator, sampler: Sampler, state: SamplingState
) -> tuple[DraftTree, torch.Tensor | None]:
    """The draft model drafting under the grammar (``--speculative-draft-grammar on``): each token drawn from the
    draft's distribution masked by the row's grammar mask and renormalised, which is then its ``q``."""
    q0 = _target(sampler, state, _masked(DRAFT_ROOT))
    d1 = _sample(q0, gen)
    q1 = _target(sampler, state, _masked(DRAFT_DEPTH1[d1]))
    d2 = _sample(q1, gen)
    return DraftTree((d1, d2), (-1, 0)), torch.stack((q0, q1))


DRAFTERS: dict[str, Drafter] = {
    "chain, sampled": _chain2,
    "tree, independent siblings": _tree_iid,
    "tree, drawn spine and fixed sibling": _tree_mixed,
    "tree, fixed candidates": _tree_fixed,
}


def _node_logits(tree: DraftTree) -> torch.Tensor:
    """[1 + m, V] the target's logits at the root and at each node of ``tree`` (by the tokens of its path)."""
    rows = [ROOT]
    for i, parent in enumerate(tree.parents):
        token = tree.tokens[i]
        rows.append(DEPTH1[token] if parent < 0 else DEPTH2[tree.tokens[parent], token])
    return torch.stack(rows)


def _run_trials(
    params: SamplingParams, drafter: Drafter, banned: tuple[int, ...] = ()
) -> tuple[list[Verdict], list[DraftTree]]:
    """``banned``: tokens every row's grammar mask bans (a constrained request's draft)."""
    sampler = Sampler(V, "cpu")
    draft_gen = torch.Generator().manual_seed(99)
    items, rows, trees, offset = [], [], [], 0
    for trial in range(TRIALS):
        state = _state(params, seed=trial)
        tree, q = drafter(draft_gen, sampler, state)
        logits = _node_logits(tree)
        items.append(VerifyItem(state, tree, q, offset))
        rows.append(logits)
        trees.append(tree)
        offset += logits.shape[0]
    bitmask = None
    if banned:
        word = sum(1 << t for t in range(V) if t not in banned)
        bitmask = torch.full((offset, 1), word, dtype=torch.int32)  # [N, 1]: one word covers the six tokens
    return Verifier(sampler).verify(torch.cat(rows), items, bitmask), trees


@pytest.mark.parametrize("params_name", sorted(PARAMS))
@pytest.mark.parametrize("drafter_name", sorted(DRAFTERS))
def test_emitted_tokens_follow_the_target_distribution(params_name: str, drafter_name: str) -> None:
    """Fails if the verify keeps a draft token more often than min(1, p/q) allows, resamples from anything but the
    residual, draws the bonus from anything but p, or skips the processing (temperature, top-p) of any row."""
    params = PARAMS[params_name]
    verdicts, _ = _run_trials(params, DRAFTERS[drafter_name])
    sampler, state = Sampler(V, "cpu"), _state(params, 0)
    first = Counter(v.token_ids[0] for v in verdicts)
    p_root = _target(sampler, state, ROOT)
    assert _chi2_pvalue(first, p_root) > SIGNIFICANCE, (first, p_root)
    assert _chi2_pvalue(first, _target(sampler, state, DRAFT_ROOT)) < 1e-6  # the counts can tell p from q
    # The second position: given the first token t was kept, the next one follows the target at node t.
    kept = Counter(v.token_ids[0] for v in verdicts if len(v.token_ids) > 1)
    t = kept.most_common(1)[0][0]
    second = Counter(v.token_ids[1] for v in verdicts if len(v.token_ids) > 1 and v.token_ids[0] == t)
    assert sum(second.values()) > 300
    assert _chi2_pvalue(second, _target(sampler, state, DEPTH1[t])) > SIGNIFICANCE, (t, second)


def test_a_chain_of_target_tokens_is_accepted_whole_and_greedy_follows_the_argmax() -> None:
    """Greedy: the walk accepts a child exactly when it is the target's argmax at its parent, and ends with the
    argmax at the last accepted node (the bonus token). Fails if a greedy row is sampled or ties go elsewhere."""
    sampler = Sampler(V, "cpu")
    state = _state(SamplingParams(temperature=0.0, max_new_tokens=16), 0)
    a = int(ROOT.argmax())
    b = int(DEPTH1[a].argmax())
    tree = DraftTree(((a + 1) % V, a, b), (-1, -1, 1))  # a wrong first child, the right second, its right child
    (verdict,) = Verifier(sampler).verify(_node_logits(tree), [VerifyItem(state, tree, None, 0)])
    assert verdict.path == (1, 2)
    assert verdict.token_ids == (a, b, int(DEPTH2[a, b].argmax()))


def test_penalties_and_min_new_tokens_count_the_draft_tokens_on_the_path() -> None:
    """A node's row is processed as if the request had already output the draft tokens above it: with a huge
    presence penalty the target never repeats a token of its path, and min_new_tokens counts the path. Fails if
    ``ahead`` is not passed to the logits processing (the penalised token would be chosen again)."""
    sampler = Sampler(V, "cpu")
    logits = torch.zeros(3, V)
    logits[:, 2] = 5.0  # token 2 everywhere, unless penalised
    params = SamplingParams(temperature=0.0, presence_penalty=100.0, max_new_tokens=16)
    state = _state(params, 0)
    tree = DraftTree((2, 3), (-1, 0))
    (verdict,) = Verifier(sampler).verify(logits, [VerifyItem(state, tree, None, 0)])
    assert verdict.token_ids[0] == 2 and verdict.token_ids[1] != 2  # node 0's row saw token 2 already output
    min_new = SamplingParams(temperature=0.0, min_new_tokens=2, max_new_tokens=16)
    eos_state = SamplingState(min_new, (0,), frozenset({5}), V, "cpu", 0)
    eos = torch.zeros(3, V)
    eos[:, 5] = 5.0  # eos is the argmax everywhere, once allowed; else token 0 (the lowest of the ties)
    (early,) = Verifier(sampler).verify(eos, [VerifyItem(eos_state, DraftTree((0, 0), (-1, 0)), None, 0)])
    assert early.token_ids == (0, 0, 5)  # ordinals 0 and 1 are below min_new_tokens: eos banned; ordinal 2 not


def test_logprobs_come_from_the_raw_rows_of_the_path() -> None:
    sampler = Sampler(V, "cpu")
    state = _state(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, max_new_tokens=16), 0)
    a = int(ROOT.argmax())
    tree = DraftTree((a,), (-1,))
    logits = _node_logits(tree)
    (verdict,) = Verifier(sampler).verify(logits, [VerifyItem(state, tree, None, 0)])
    assert verdict.path == (0,) and verdict.logprobs is not None and verdict.top_logprobs is not None
    want = torch.log_softmax(logits, dim=-1)
    for row, (token, lp) in enumerate(zip(verdict.token_ids, verdict.logprobs, strict=True)):
        assert abs(lp - float(want[row, token])) < 1e-6
        assert verdict.top_logprobs[row][0][0] == int(want[row].argmax())


@pytest.mark.parametrize("drafter_name", ["chain, sampled", "tree, fixed candidates"])
def test_under_a_grammar_mask_the_emitted_tokens_follow_the_masked_target(drafter_name: str) -> None:
    """Every node's mask applies to p, the bonus token's included: no banned token is ever emitted (even where the
    draft proposes it) and the first token follows the masked, renormalised target. Fails if the verify ignores the
    bitmask (banned tokens appear) or applies it to some rows only."""
    banned = (0, 3)  # the root's two most likely tokens
    verdicts, _ = _run_trials(PARAMS["temperature 1"], DRAFTERS[drafter_name], banned)
    assert not any(t in banned for v in verdicts for t in v.token_ids)
    sampler, state = Sampler(V, "cpu"), _state(PARAMS["temperature 1"], 0)
    p = _target(sampler, state, ROOT)
    p[list(banned)] = 0.0
    assert _chi2_pvalue(Counter(v.token_ids[0] for v in verdicts), p / p.sum()) > SIGNIFICANCE


@pytest.mark.parametrize("params_name", sorted(PARAMS))
def test_a_draft_sampled_under_the_mask_stays_lossless(params_name: str) -> None:
    """The draft model drafting under the grammar: q is the masked, renormalised draft distribution (zero on what the
    grammar bans), p the masked target; the rule min(1, p/q) and the residual max(p - q, 0) then give the masked
    target, first position and after a kept token. Fails if the draft under the mask reported its unmasked q (the
    acceptance ratio p/q is then off wherever the mask moved mass, and the first position no longer follows p)."""
    params = PARAMS[params_name]
    verdicts, _ = _run_trials(params, _chain2_under_mask, GRAMMAR_BANNED)
    assert not any(t in GRAMMAR_BANNED for v in verdicts for t in v.token_ids)
    sampler, state = Sampler(V, "cpu"), _state(params, 0)
    first = Counter(v.token_ids[0] for v in verdicts)
    assert _chi2_pvalue(first, _target(sampler, state, _masked(ROOT))) > SIGNIFICANCE, first
    assert _chi2_pvalue(first, _target(sampler, state, _masked(DRAFT_ROOT))) < 1e-6  # the counts can tell p from q
    kept = Counter(v.token_ids[0] for v in verdicts if len(v.token_ids) > 1)
    t = kept.most_common(1)[0][0]
    second = Counter(v.token_ids[1] for v in verdicts if len(v.token_ids) > 1 and v.token_ids[0] == t)
    assert sum(second.values()) > 300
    want = _target(sampler, state, _masked(DEPTH1[t]))
    assert _chi2_pvalue(second, want) > SIGNIFICANCE, (t, second)


def test_greedy_under_a_mask_takes_the_best_allowed_token() -> None:
    sampler = Sampler(V, "cpu")
    state = _state(SamplingParams(temperature=0.0, max_new_tokens=16), 0)
    a = int(ROOT.argmax())
    tree = DraftTree((a,), (-1,))  # the raw argmax, which the mask bans
    word = sum(1 << t for t in range(V) if t != a)
    bitmask = torch.full((2, 1), word, dtype=torch.int32)
    (verdict,) = Verifier(sampler).verify(_node_logits(tree), [VerifyItem(state, tree, None, 0)], bitmask)
    allowed = ROOT.clone()
    allowed[a] = float("-inf")
    assert verdict.path == () and verdict.token_ids == (int(allowed.argmax()),)


def test_draft_runs_trimmed_to_different_lengths_each_get_their_own_mask_rows() -> None:
    """One batch of greedy requests whose drafts were trimmed to different lengths (4, 1 and 2 nodes): each row of
    the bitmask allows exactly one token, different per request and node, so every emitted token shows whose row
    it was verified with; a plain entry's row sits after each. Fails if an item reads another item's rows (vLLM's
    mask-rows-after-trimming fault): checked with `bitmask[: len(used)]` (rows taken as packed per verified node, not
    per logits row) in place of the index_select in Verifier._processed: items two and three emit (0,), (0, 5)."""
    sampler = Sampler(V, "cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    # (draft chain, the one token each row allows: the root's row, then one per node) and what must come out.
    cases = [
        ((1, 2, 3, 4), (1, 2, 3, 5, 0), (1, 2, 3, 5)),  # node 3's token 4 is banned: three accepted, then 5
        ((2,), (2, 0), (2, 0)),  # the whole run accepted, the bonus token masked too
        ((0, 0), (4, 1, 1), (4,)),  # the first draft token is banned: nothing accepted
    ]
    items, rows, words, offset = [], [], [], 0
    for i, (draft, allowed, _) in enumerate(cases):
        tree = DraftTree.chain(draft)
        items.append(VerifyItem(_state(greedy, i), tree, None, offset))
        rows.append(torch.randn(tree.num_rows, V, generator=torch.Generator().manual_seed(i)))  # [1 + m, V]
        words += [1 << token for token in allowed]
        rows.append(torch.randn(1, V, generator=torch.Generator().manual_seed(10 + i)))  # [1, V] a plain entry's row
        words.append(-1)  # between the items, as plain entries sit in a mixed batch
        offset += tree.num_rows + 1
    bitmask = torch.tensor(words, dtype=torch.int32)[:, None]  # [N, 1]
    verdicts = Verifier(sampler).verify(torch.cat(rows), items, bitmask)
    assert [v.token_ids for v in verdicts] == [want for _, _, want in cases]
    assert [len(v.path) for v in verdicts] == [3, 1, 0]
