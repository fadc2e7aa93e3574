"""Sampler: processing order, masks, penalties, seeded reproducibility and distribution checks (CPU)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from engine.executor.sampler import Sampler, SamplingState
from engine.sampling_params import SamplingParams

V = 50  # deliberately not a multiple of 32
EOS = 49
NO_EOS: frozenset[int] = frozenset()


def state(
    params: SamplingParams,
    *,
    prompt: Sequence[int] = (),
    eos: frozenset[int] = frozenset({EOS}),
    vocab: int = V,
    default_seed: int = 0,
) -> SamplingState:
    return SamplingState(params, prompt, eos, vocab, "cpu", default_seed)


def random_logits(rows: int, cols: int = V, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * 3.0  # [rows, cols]


def pack_bitmask(allowed: Sequence[set[int]], vocab: int) -> torch.Tensor:
    """xgrammar layout: int32 [B, ceil(V/32)], bit j of word i set <=> token i*32+j allowed."""
    words = -(-vocab // 32)
    out = torch.zeros(len(allowed), words, dtype=torch.int32)  # [B, W]
    for row, ids in enumerate(allowed):
        for word in range(words):
            value = sum(1 << (t - word * 32) for t in ids if word * 32 <= t < (word + 1) * 32)
            # Reinterpret as signed int32: bit 31 makes the word negative, as xgrammar produces.
            out[row, word] = value - (1 << 32) if value >= 1 << 31 else value
    return out


def run_steps(sampler: Sampler, states: Sequence[SamplingState], steps: int, row_seed: int) -> list[list[int]]:
    """Sample ``steps`` tokens for every row (row r sees logits seeded by row_seed + r) and record them."""
    out: list[list[int]] = [[] for _ in states]
    for step in range(steps):
        logits = torch.cat([random_logits(1, seed=row_seed * 1000 + step * 31 + r) for r in range(len(states))])
        result = sampler.sample(logits, states)
        for r, (s, token) in enumerate(zip(states, result.token_ids, strict=True)):
            s.record(token)
            out[r].append(token)
    return out


# ---- greedy and its limits ----


def test_greedy_is_argmax() -> None:
    logits = random_logits(6)
    out = Sampler(V, "cpu").sample(logits, [state(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 12]] = 5.0
    assert Sampler(V, "cpu").sample(logits, [state(SamplingParams(temperature=0.0))]).token_ids == [3]


def test_tiny_temperature_matches_greedy() -> None:
    logits = random_logits(8, seed=1)
    states = [state(SamplingParams(temperature=1e-4, seed=i)) for i in range(8)]
    assert Sampler(V, "cpu").sample(logits, states).token_ids == torch.argmax(logits, dim=-1).tolist()


def test_top_k_one_matches_greedy() -> None:
    logits = random_logits(8, seed=2)
    states = [state(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(8)]
    assert Sampler(V, "cpu").sample(logits, states).token_ids == torch.argmax(logits, dim=-1).tolist()


def test_tiny_top_p_matches_greedy() -> None:
    logits = random_logits(8, seed=3)
    states = [state(SamplingParams(temperature=1.5, top_p=1e-6, seed=i)) for i in range(8)]
    assert Sampler(V, "cpu").sample(logits, states).token_ids == torch.argmax(logits, dim=-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.zeros(400, V)
    logits[:, [5, 9, 30]] = torch.tensor([2.0, 1.9, 1.8])
    states = [state(SamplingParams(top_k=2), default_seed=i) for i in range(400)]
    assert set(Sampler(V, "cpu").sample(logits, states).token_ids) == {5, 9}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((400, V), -1e4)
    logits[:, :4] = probs.log()
    # The mass before token 2 is 0.8 > 0.75, so the nucleus is {0, 1}.
    states = [state(SamplingParams(top_p=0.75), default_seed=i) for i in range(400)]
    assert set(Sampler(V, "cpu").sample(logits, states).token_ids) == {0, 1}


def test_min_p_drops_tokens_below_the_scaled_max() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((400, V), -1e4)
    logits[:, :4] = probs.log()
    # Threshold 0.5 * 0.5 = 0.25: tokens 0 and 1 survive.
    states = [state(SamplingParams(min_p=0.5), default_seed=i) for i in range(400)]
    assert set(Sampler(V, "cpu").sample(logits, states).token_ids) == {0, 1}


# ---- logit processing ----


def test_logit_bias_forces_a_token() -> None:
    logits = random_logits(2, seed=4)
    bias = SamplingParams.logit_bias_from({17: 100.0})
    states = [state(SamplingParams(temperature=0.0, logit_bias=bias)), state(SamplingParams(logit_bias=bias))]
    assert Sampler(V, "cpu").sample(logits, states).token_ids == [17, 17]


def test_penalties_change_logits_exactly() -> None:
    vocab = 8
    raw = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 4.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s = state(params, prompt=[0, 1], vocab=vocab)
    for token in (2, 2, 3):
        s.record(token)
    processed = Sampler(vocab, "cpu").process_logits(raw, [s])
    # Repetition over prompt+output {0,1,2,3}: positive / 2, negative * 2. Then output tokens:
    # id 2 (count 2): 0.5 - 0.5*2 - 0.25; id 3 (count 1): -2 - 0.5*1 - 0.25.
    expected = torch.tensor([[1.0, -4.0, -0.75, -2.75, 0.5, 3.0, 0.0, 4.0]])
    torch.testing.assert_close(processed, expected)


def test_repetition_penalty_alone_and_no_penalty_state_without_penalties() -> None:
    raw = torch.tensor([[2.0, -2.0, 1.0, 6.0]])
    s = state(SamplingParams(repetition_penalty=4.0), prompt=[1], vocab=4)
    s.record(3)
    processed = Sampler(4, "cpu").process_logits(raw, [s])
    torch.testing.assert_close(processed, torch.tensor([[2.0, -8.0, 1.0, 1.5]]))
    assert state(SamplingParams()).penalties is None


def test_penalties_steer_greedy_away_from_repeats() -> None:
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 6] = 0.8
    s = state(SamplingParams(temperature=0.0, presence_penalty=0.5))
    sampler = Sampler(V, "cpu")
    first = sampler.sample(logits, [s]).token_ids[0]
    s.record(first)
    assert (first, sampler.sample(logits, [s]).token_ids[0]) == (4, 6)


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS] = 9.0
    logits[0, 20] = 8.0  # a stop token id
    logits[0, 11] = 7.0
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(20,), ignore_eos=ignore_eos)
        s = state(params)
        sampler = Sampler(V, "cpu")
        tokens = []
        for _ in range(3):
            tokens.append(sampler.sample(logits, [s]).token_ids[0])
            s.record(tokens[-1])
        assert tokens == [11, 11, EOS]


def test_process_logits_does_not_touch_the_input() -> None:
    logits = random_logits(1, seed=5)
    before = logits.clone()
    s = state(SamplingParams(logit_bias=((3, 5.0),), repetition_penalty=1.5), prompt=[1, 2])
    Sampler(V, "cpu").sample(logits, [s])
    assert torch.equal(logits, before)


# ---- grammar bitmask and padded vocab ----


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bitmask_allows_only_its_ids_with_padded_vocab(temperature: float) -> None:
    allowed = {3, 31, 32, 33, 48}  # 31: the sign bit of word 0; 48: in the last, partial word
    rows = 64
    padded = 64  # V' > V: columns 50..63 are padding and must never be chosen
    logits = random_logits(rows, padded, seed=6)
    logits[:, V:] = 1e4
    states = [state(SamplingParams(temperature=temperature), default_seed=i) for i in range(rows)]
    bitmask = pack_bitmask([allowed] * rows, V)
    tokens = Sampler(V, "cpu").sample(logits, states, bitmask).token_ids
    assert set(tokens) <= allowed
    if temperature > 0:
        assert len(set(tokens)) > 1


def test_bitmask_per_row() -> None:
    logits = torch.zeros(3, V)
    logits[:, 10] = 10.0
    bitmask = pack_bitmask([set(range(V)), {1}, {40}], V)
    states = [state(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler(V, "cpu").sample(logits, states, bitmask).token_ids == [10, 1, 40]


def test_bitmask_sets_exactly_the_disallowed_logits_to_minus_inf() -> None:
    """Bit for bit against the definition, over random words (sign bits included) and a partial last word: an
    allowed logit keeps its value, even +inf or -inf, and a disallowed one becomes -inf."""
    gen = torch.Generator().manual_seed(11)
    rows = 8
    allowed = [{t for t in range(V) if torch.rand(1, generator=gen).item() < 0.4} for _ in range(rows)]
    logits = random_logits(rows, seed=12)
    logits[0, 3], logits[1, 7] = float("inf"), float("-inf")
    states = [state(SamplingParams()) for _ in range(rows)]
    got = Sampler(V, "cpu").process_logits(logits, states, pack_bitmask(allowed, V))  # [B, V]
    expected = logits.clone()
    for row, ids in enumerate(allowed):
        expected[row, [t for t in range(V) if t not in ids]] = float("-inf")
    assert torch.equal(got, expected)


def test_nothing_allowed_returns_eos_or_zero() -> None:
    logits = random_logits(4, seed=7)
    states = [
        state(SamplingParams(temperature=0.0)),
        state(SamplingParams(), eos=frozenset({44, 42})),
        state(SamplingParams(), eos=NO_EOS),
        state(SamplingParams(temperature=0.0)),
    ]
    bitmask = pack_bitmask([set(), set(), set(), {5}], V)
    assert Sampler(V, "cpu").sample(logits, states, bitmask).token_ids == [EOS, 42, 0, 5]


def test_padded_vocab_never_sampled_without_mask() -> None:
    logits = torch.zeros(200, 64)
    logits[:, V:] = 50.0
    states = [state(SamplingParams(), default_seed=i) for i in range(100)]
    states += [state(SamplingParams(temperature=0.0)) for _ in range(100)]
    assert max(Sampler(V, "cpu").sample(logits, states).token_ids) < V


# ---- reproducibility ----


def seeded_params() -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=1234)


def others() -> list[SamplingState]:
    """Seven rows of assorted kinds, none seeded like the row under test."""
    return [
        state(SamplingParams(temperature=0.0)),
        state(SamplingParams(temperature=1.3, seed=99)),
        state(SamplingParams(min_p=0.2), default_seed=5),
        state(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4), prompt=[1, 2, 3], default_seed=6),
        state(SamplingParams(temperature=0.0, logit_bias=((7, 2.0),))),
        state(SamplingParams(top_p=0.5, seed=7)),
        state(SamplingParams(top_k=3, min_new_tokens=3), default_seed=8),
    ]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    sampler = Sampler(V, "cpu")
    steps = 6

    def run_at(index: int, batch: list[SamplingState]) -> list[int]:
        mine = state(seeded_params(), default_seed=index)  # the seed wins over default_seed
        batch.insert(index, mine)
        tokens: list[int] = []
        for step in range(steps):
            row = random_logits(1, seed=100 + step)  # [1, V]: the row under test sees the same logits
            logits = random_logits(len(batch), seed=200 + step)  # [B, V]
            logits[index] = row[0]
            out = sampler.sample(logits, batch)
            for s, token in zip(batch, out.token_ids, strict=True):
                s.record(token)
            tokens.append(out.token_ids[index])
        return tokens

    alone = run_at(0, [])
    assert run_at(0, others()) == alone
    assert run_at(5, others()) == alone
    assert len(set(alone)) > 1  # really sampled, not a constant


def test_unseeded_rows_follow_default_seed() -> None:
    sampler = Sampler(V, "cpu")
    flat = SamplingParams(temperature=5.0)
    first = run_steps(sampler, [state(flat, default_seed=7)], 12, row_seed=1)
    again = run_steps(sampler, [state(flat, default_seed=7)], 12, row_seed=1)
    other = run_steps(sampler, [state(flat, default_seed=8)], 12, row_seed=1)
    assert first == again
    assert first != other


def test_seed_overrides_default_seed_and_large_seeds_work() -> None:
    sampler = Sampler(V, "cpu")
    params = SamplingParams(temperature=5.0, seed=2**70 + 3)
    a = run_steps(sampler, [state(params, default_seed=1)], 8, row_seed=2)
    b = run_steps(sampler, [state(params, default_seed=2)], 8, row_seed=2)
    assert a == b


# ---- logprobs ----


def test_logprobs_come_from_raw_logits() -> None:
    logits = random_logits(3, 64, seed=8)  # padded: log_softmax is over the real vocab only
    states = [
        state(SamplingParams(logprobs=True, top_logprobs=4, logit_bias=((0, 30.0),))),
        state(SamplingParams(temperature=0.0)),
        state(SamplingParams(top_logprobs=2, repetition_penalty=2.0), prompt=[1]),
    ]
    out = Sampler(V, "cpu").sample(logits, states)
    expected = torch.log_softmax(logits[:, :V], dim=-1)  # [3, V]
    assert out.token_ids[0] == 0  # the bias decided the token ...
    assert out.logprobs is not None and out.top_logprobs is not None
    for r, token in enumerate(out.token_ids):
        # ... but the logprob is the raw one, for asking and non-asking rows alike
        assert math.isclose(out.logprobs[r], expected[r, token].item(), rel_tol=1e-5, abs_tol=1e-6)
    assert [len(t) for t in out.top_logprobs] == [4, 0, 2]
    for r, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = expected[r].topk(len(top))
        assert [t for t, _ in top] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_values)


# ---- distribution ----


def test_temperature_one_matches_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 4000
    logits = probs.log().expand(rows, 4).contiguous()  # [rows, 4]
    states = [state(SamplingParams(), eos=NO_EOS, vocab=4, default_seed=1000 + i) for i in range(rows)]
    counts = Counter(Sampler(4, "cpu").sample(logits, states).token_ids)
    freqs = torch.tensor([counts[t] / rows for t in range(4)])
    # Standard error is at most sqrt(0.24 / 4000) ~= 0.008; allow about 4 of them.
    assert torch.all((freqs - probs).abs() < 0.03), freqs


def test_temperature_flattens_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    rows = 2000
    logits = probs.log().expand(rows, 4).contiguous()  # [rows, 4]
    states = [state(SamplingParams(temperature=100.0), eos=NO_EOS, vocab=4, default_seed=i) for i in range(rows)]
    counts = Counter(Sampler(4, "cpu").sample(logits, states).token_ids)
    assert all(abs(counts[t] / rows - 0.25) < 0.04 for t in range(4)), counts
