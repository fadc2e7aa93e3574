"""The native grammar bitmask kernel against the sampler's torch path, bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.executor.sampler import Sampler, SamplingState
from engine.model.native import TokenBitmaskKernel, token_bitmask_kernel
from engine.sampling_params import SamplingParams

VOCAB = 2050  # not a multiple of 32: the last word has bits past the vocabulary
WORDS = -(-VOCAB // 32)


@pytest.fixture(scope="module")
def kernel() -> TokenBitmaskKernel:
    loaded = token_bitmask_kernel()
    if loaded is None:
        pytest.skip("the native bitmask kernel is off (ORDINAL_NATIVE=0) or could not be built (see the warning)")
    return loaded


def random_words(rows: int, words: int, seed: int) -> torch.Tensor:
    """[rows, words] int32: random rows, then one allowing everything, one allowing nothing, one allowing one token."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int32)  # [R, W]
    out[0] = -1
    out[1] = 0
    out[2] = 0
    out[2, 3] = 1 << 5  # only token 101
    return out


def test_native_bitmask_equals_the_torch_path(kernel: TokenBitmaskKernel) -> None:
    """The sampler's two paths give the same logits, for extra words and padded logits columns too.

    Fails if the kernel bans a token whose bit is set, misses one that is clear, or reads a row at the wrong stride
    (the bitmask has two words more than needed, the logits six columns more than the vocabulary)."""
    rows = 7
    words = random_words(rows, WORDS + 2, seed=1)  # [R, W + 2]
    logits = torch.randn(rows, VOCAB + 6, generator=torch.Generator().manual_seed(2))  # [R, V + 6]
    states = [SamplingState(SamplingParams(temperature=0.7), (), frozenset(), VOCAB, "cpu", i) for i in range(rows)]
    native = Sampler(VOCAB, "cpu").process_logits(logits, states, words)  # [R, V]
    reference = Sampler(VOCAB, "cpu", native=False).process_logits(logits, states, words)  # [R, V]
    assert torch.equal(native, reference)
    assert torch.isinf(native[1]).all() and torch.isfinite(native[0]).all()
    assert torch.isfinite(native[2]).nonzero().flatten().tolist() == [101]


def test_bits_past_the_vocabulary_and_columns_past_it_are_left_alone(kernel: TokenBitmaskKernel) -> None:
    logits = torch.zeros(2, VOCAB + 6)  # [2, V + 6]
    kernel(logits, torch.zeros(2, WORDS, dtype=torch.int32), VOCAB)
    assert torch.isinf(logits[:, :VOCAB]).all()
    assert (logits[:, VOCAB:] == 0).all()


@pytest.mark.parametrize(
    ("logits", "words", "match"),
    [
        (torch.zeros(2, VOCAB, dtype=torch.float64), torch.zeros(2, WORDS, dtype=torch.int32), "logits must be"),
        (torch.zeros(2, VOCAB), torch.zeros(2, WORDS, dtype=torch.int64), "bitmask must be"),
        (torch.zeros(2, VOCAB), torch.zeros(2, WORDS - 1, dtype=torch.int32), "bitmask must be"),
        (torch.zeros(2, VOCAB - 1), torch.zeros(2, WORDS, dtype=torch.int32), "logits must be"),
        (torch.zeros(VOCAB, 2).t(), torch.zeros(2, WORDS, dtype=torch.int32), "logits must be"),
        (torch.zeros(3, VOCAB), torch.zeros(2, WORDS, dtype=torch.int32), "2 rows for 3 rows"),
    ],
)
def test_a_layout_the_kernel_cannot_read_is_refused_before_any_write(
    kernel: TokenBitmaskKernel, logits: torch.Tensor, words: torch.Tensor, match: str
) -> None:
    before = logits.clone()
    with pytest.raises(ValueError, match=match):
        kernel(logits, words, VOCAB)
    assert torch.equal(logits, before)
