"""The native paged decode kernel against the torch path and a plain per-sequence reference."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model.attention import AttentionMasks, decode_attention, paged_attention
from engine.model.forward_batch import DecodeGroup, ForwardBatch, LogitsMode, SeqInput
from engine.model.native import (
    NATIVE_ENV,
    PAGED_DECODE_SOURCE,
    PagedDecodeKernel,
    Toolchain,
    build_library,
    load_paged_decode,
    paged_decode_kernel,
)

NUM_PAGES = 64
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def toolchain() -> Toolchain:
    found = Toolchain.find()
    if found is None:
        pytest.skip("no C compiler (cc/gcc) on PATH: the native kernel cannot be built")
    return found


@pytest.fixture(scope="module")
def kernel(toolchain: Toolchain, tmp_path_factory: pytest.TempPathFactory) -> PagedDecodeKernel:
    loaded = load_paged_decode(toolchain, tmp_path_factory.mktemp("kernels"))
    if loaded is None:
        pytest.skip("the native kernel failed to compile or load with this compiler (see the logged warning)")
    return loaded


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny problems on a shared machine: extra threads only add waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def decode_group(lens: list[int], page_size: int, seed: int) -> DecodeGroup:
    """Decodes of the given key counts, on disjoint shuffled pages of the pool."""
    perm = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, used = [], 0
    for n in lens:
        pages = -(-n // page_size)
        seqs.append(SeqInput([1], n - 1, perm[used : used + pages], LogitsMode.LAST))
        used += pages
    assert used <= NUM_PAGES
    group = ForwardBatch.build(seqs, page_size, "cpu").decode
    assert group is not None
    return group


def random_case(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup]:
    gen = torch.Generator().manual_seed(seed)
    slots = NUM_PAGES * page_size
    # Scaled so that softmax is neither flat nor one-hot.
    q = 2 * torch.randn(len(lens), heads, head_dim, generator=gen)  # [B, H, D]
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)  # [slots, Hkv, D]
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)  # [slots, Hkv, D]
    return q, k_pool, v_pool, decode_group(lens, page_size, seed)


def naive_reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: DecodeGroup, window: int | None
) -> torch.Tensor:
    """Per sequence and head, in float64: slots from the page table, then softmax(q k^T / sqrt(D)) v."""
    batch, heads, head_dim = q.shape
    ratio = heads // k_pool.shape[1]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(group.kv_lens[b])
        pages = group.page_tables[b].tolist()
        positions = [p for p in range(n) if window is None or (n - 1) - p < window]
        slots = torch.tensor([pages[p // group.page_size] * group.page_size + p % group.page_size for p in positions])
        keys, values = k_pool[slots].double(), v_pool[slots].double()  # [n, Hkv, D]
        for h in range(heads):
            scores = keys[:, h // ratio] @ q[b, h].double() / math.sqrt(head_dim)  # [n]
            out[b, h] = torch.softmax(scores, dim=0) @ values[:, h // ratio]  # [D]
    return out


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


def torch_path(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    group: DecodeGroup,
    window: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setenv(NATIVE_ENV, "0")
        return decode_attention(q, k_pool, v_pool, group, window, None)


LENS = [1, 2, 15, 16, 17, 40, 63, 5]


@pytest.mark.parametrize("window", [None, 1, 6, 32, 1000])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)])
def test_kernel_matches_torch_path_and_naive_reference(
    kernel: PagedDecodeKernel,
    monkeypatch: pytest.MonkeyPatch,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None,
) -> None:
    seed = heads * 1000 + kv_heads * 100 + head_dim + (window or 0)
    q, k_pool, v_pool, group = random_case(LENS, heads, kv_heads, head_dim, page_size=8, seed=seed)
    native = kernel(q, k_pool, v_pool, group.page_tables, group.kv_lens, 8, window or 0, 1 / math.sqrt(head_dim))
    reference = naive_reference(q, k_pool, v_pool, group, window)
    assert native.shape == q.shape and native.dtype == torch.float32
    assert rel_err(native, reference) <= TOLERANCE
    assert rel_err(torch_path(q, k_pool, v_pool, group, window, monkeypatch), reference) <= TOLERANCE


@pytest.mark.parametrize("head_dim", [32, 48])  # 48 takes the kernel's generic (non-specialised) head_dim branch
def test_decode_attention_dispatches_to_the_kernel_by_default(
    kernel: PagedDecodeKernel, monkeypatch: pytest.MonkeyPatch, head_dim: int
) -> None:
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    q, k_pool, v_pool, group = random_case([3, 30, 1], 6, 3, head_dim, page_size=4, seed=head_dim)
    assert paged_decode_kernel() is not None
    ours = decode_attention(q, k_pool, v_pool, group, 5, None)
    assert rel_err(ours, naive_reference(q, k_pool, v_pool, group, 5)) <= TOLERANCE
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert paged_decode_kernel() is None


def test_result_does_not_depend_on_thread_count(kernel: PagedDecodeKernel) -> None:
    """Each (sequence, head) is computed by one thread in one order, whatever the split of the work."""
    lens = [1, 40, 17, 33, 2, 16]
    q, k_pool, v_pool, group = random_case(lens, 8, 4, 32, page_size=16, seed=11)
    args = (group.page_tables, group.kv_lens, 16, 0, 0.125)
    one = kernel(q, k_pool, v_pool, *args)
    torch.set_num_threads(2)  # fewer than 4 sequences per thread: the kernel now splits by kv head as well
    assert torch.equal(kernel(q, k_pool, v_pool, *args), one)


def test_nan_in_a_query_stays_in_its_own_rows(kernel: PagedDecodeKernel) -> None:
    q, k_pool, v_pool, group = random_case([9, 9], 4, 2, 32, page_size=4, seed=5)
    q[1, 3, 0] = float("nan")
    out = kernel(q, k_pool, v_pool, group.page_tables, group.kv_lens, 4, 0, 0.2)
    assert out[1, 3].isnan().all()
    # Head 2 shares kv head 1 with head 3 (and so its scratch and its pass over the keys): it stays finite.
    assert not out[1, :3].isnan().any() and not out[0].isnan().any()


def test_kernel_rejects_a_wrong_layout(kernel: PagedDecodeKernel) -> None:
    q, k_pool, v_pool, group = random_case([5, 8], 4, 2, 32, page_size=4, seed=1)
    with pytest.raises(ValueError, match=r"k_pool must be a CPU torch\.float32"):
        kernel(q, k_pool.double(), v_pool, group.page_tables, group.kv_lens, 4, 0, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        kernel(q[:, :3], k_pool, v_pool, group.page_tables, group.kv_lens, 4, 0, 1.0)
    with pytest.raises(ValueError, match="page_tables must be contiguous"):
        kernel(q, k_pool, v_pool, group.page_tables.t(), group.kv_lens, 4, 0, 1.0)
    with pytest.raises(ValueError, match="runs must be a 1-D CPU int64"):
        kernel(q, k_pool, v_pool, group.page_tables, group.kv_lens, 4, 0, 1.0, torch.tensor([0, 1, 2]).int())


def test_mixed_batch_native_equals_torch_path(kernel: PagedDecodeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through paged_attention: decodes scattered between prefill rows are gathered and put back in place."""
    page_size, kv_heads, head_dim, heads = 4, 2, 32, 4
    gen = torch.Generator().manual_seed(9)
    seqs = [
        SeqInput([1], 12, [3, 9, 1, 20], LogitsMode.LAST),
        SeqInput([1, 2, 3, 4, 5], 6, [7, 30, 2], LogitsMode.ALL),
        SeqInput([1], 0, [11], LogitsMode.LAST),
        SeqInput([1, 2, 3], 0, [40], LogitsMode.LAST),
        SeqInput([1], 25, [41, 42, 43, 44, 45, 46, 47], LogitsMode.LAST),
    ]
    batch = ForwardBatch.build(seqs, page_size, "cpu")
    tokens = batch.num_tokens
    q = torch.randn(tokens, heads, head_dim, generator=gen)  # [T, H, D]
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)  # [T, Hkv, D]
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)  # [T, Hkv, D]
    pools = torch.randn(2, NUM_PAGES * page_size, kv_heads, head_dim, generator=gen)  # [K|V, slots, Hkv, D]
    outs = []
    for native in ("1", "0"):
        monkeypatch.setenv(NATIVE_ENV, native)
        k_pool, v_pool = pools[0].clone(), pools[1].clone()
        for window in (None, 3):
            masks = AttentionMasks.for_window(batch, window)
            outs.append(paged_attention(q, k, v, k_pool, v_pool, batch, masks))
    assert rel_err(outs[0], outs[2]) <= TOLERANCE and rel_err(outs[1], outs[3]) <= TOLERANCE
    assert rel_err(outs[0], outs[1]) > 1e-3  # the window matters for the long decodes


def chain_case(
    runs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, page_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup]:
    """Verify-like runs of ``(cached, n)``: n queries after ``cached`` keys, query j seeing ``cached + j + 1``, on
    disjoint shuffled pages, as ForwardBatch groups them."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES, generator=gen).tolist()
    seqs, used = [], 0
    for cached, n in runs:
        pages = -(-(cached + n) // page_size)
        seqs.append(SeqInput([1] * n, cached, perm[used : used + pages], LogitsMode.ALL))
        used += pages
    assert used <= NUM_PAGES
    group = ForwardBatch.build(seqs, page_size, "cpu").decode
    assert group is not None and group.covers_batch
    q = 2 * torch.randn(sum(n for _, n in runs), heads, head_dim, generator=gen)  # [B, H, D]
    k_pool = torch.randn(NUM_PAGES * page_size, kv_heads, head_dim, generator=gen)  # [slots, Hkv, D]
    v_pool = torch.randn(NUM_PAGES * page_size, kv_heads, head_dim, generator=gen)  # [slots, Hkv, D]
    return q, k_pool, v_pool, group


# A decode, runs too short for the lanes worker at two query heads a kv head (2), runs that take it (3, 7, 8), and
# runs starting anywhere in a page.
CHAINS = [(5, 1), (9, 2), (13, 3), (40, 7), (2, 8), (16, 7), (31, 4)]


@pytest.mark.parametrize("window", [None, 1, 5, 20])
@pytest.mark.parametrize("head_dim", [32, 64, 40])  # 40: the generic head_dim branch (a multiple of 8)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2), (16, 2)])
def test_runs_match_the_naive_reference(
    kernel: PagedDecodeKernel, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """A verify's chains attended as runs (query j of a run seeing one key more than query j - 1) equal the naive
    per-query reference, whichever worker a run takes: one query head a kv head (a run of 8 fills 8 lanes) to eight
    (a run of 7 fills 56 rows: four groups of lanes). Fails if the lanes worker lets a query see a key past its own
    (``key <= hi``: a relative error of 0.69), or reads every query of a run with its first's length (0.88). Each
    query's result is the per-query kernel's bit for bit (a verify's node gets its decode's logits): a single query's
    dot product parts added in sequence instead of pairwise, or its exponentials summed in vector order instead of
    key_order_sum's, fails 36 of the 48 cases (tests/unit/test_panel_linear.py's bit-for-bit verify as well)."""
    seed = heads * 1000 + kv_heads * 100 + head_dim + (window or 0)
    q, k_pool, v_pool, group = chain_case(CHAINS, heads, kv_heads, head_dim, page_size=8, seed=seed)
    assert group.runs is not None and group.runs.tolist() == [0, 1, 3, 6, 13, 21, 28, 32]
    args = (group.page_tables, group.kv_lens, 8, window or 0, 1 / math.sqrt(head_dim))
    ours = kernel(q, k_pool, v_pool, *args, group.runs)
    assert rel_err(ours, naive_reference(q, k_pool, v_pool, group, window)) <= TOLERANCE
    # The same queries one by one, bit for bit: a verify's node must get what a decode of its token gets.
    assert torch.equal(ours, kernel(q, k_pool, v_pool, *args))


def test_runs_do_not_depend_on_thread_count(kernel: PagedDecodeKernel) -> None:
    q, k_pool, v_pool, group = chain_case(CHAINS, 8, 4, 32, page_size=16, seed=12)
    args = (group.page_tables, group.kv_lens, 16, 0, 0.125, group.runs)
    one = kernel(q, k_pool, v_pool, *args)
    torch.set_num_threads(2)
    assert torch.equal(kernel(q, k_pool, v_pool, *args), one)


def test_nan_in_a_run_stays_in_its_own_lane(kernel: PagedDecodeKernel) -> None:
    """A run's rows share every vector of the lanes worker: a NaN query poisons its own (query, head) only."""
    q, k_pool, v_pool, group = chain_case([(20, 7)], 8, 2, 32, page_size=4, seed=6)
    q[4, 5, 0] = float("nan")  # query 4 of the run, head 5 (kv head 1's second)
    out = kernel(q, k_pool, v_pool, group.page_tables, group.kv_lens, 4, 0, 0.2, group.runs)
    assert out[4, 5].isnan().all()
    nan = out.isnan().any(dim=-1)  # [B, H]
    nan[4, 5] = False
    assert not nan.any()


def test_plain_decodes_have_no_runs() -> None:
    """Single-token decodes keep the one-query path (runs None): the lanes worker would leave most lanes idle."""
    _, _, _, group = random_case([3, 30, 1], 4, 2, 32, page_size=4, seed=2)
    assert group.runs is None


def test_build_is_cached_by_source_compiler_and_flags(toolchain: Toolchain, tmp_path: Path) -> None:
    first = build_library("paged_decode", PAGED_DECODE_SOURCE, toolchain, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_library("paged_decode", PAGED_DECODE_SOURCE, toolchain, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp file left behind
    source = PAGED_DECODE_SOURCE.read_bytes()
    other_flags = Toolchain(toolchain.compiler, toolchain.identity, (*toolchain.flags, "-g"))
    assert other_flags.library_name("paged_decode", source) != first.name
    assert toolchain.library_name("paged_decode", source + b"\n") != first.name


def test_failed_compile_warns_and_falls_back(
    toolchain: Toolchain, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = Toolchain(toolchain.compiler, toolchain.identity, (*toolchain.flags, "-no-such-flag-xyz"))
    with caplog.at_level(logging.WARNING, logger="engine.model.native"):
        assert load_paged_decode(broken, tmp_path) is None
    assert "unavailable" in caplog.text and "no-such-flag-xyz" in caplog.text
    assert list(tmp_path.iterdir()) == []  # the failed temp output is removed


def test_forward_batch_indices_for_a_mixed_batch() -> None:
    """The page-level indices attention reads: decode tables, lengths and rows (a short run after cached context is
    one decode query per token, each seeing the positions up to its own); chunk pages; logits rows."""
    seqs = [
        SeqInput([7], 5, [4, 9], LogitsMode.LAST),  # decode at position 5: pages 4, 9
        SeqInput([1, 2, 3], 2, [6, 2], LogitsMode.ALL),  # a short run writing positions 2..4: three decode queries
        SeqInput([8], 0, [3], LogitsMode.LAST),  # decode at position 0
        SeqInput([5, 6], 0, [1], LogitsMode.NONE),  # fresh prefill: no gather
        SeqInput(list(range(20, 29)), 3, [0, 5, 7], LogitsMode.LAST),  # a chunk longer than MAX_DECODE_RUN
    ]
    batch = ForwardBatch.build(seqs, 4, "cpu")
    assert batch.input_ids.tolist() == [7, 1, 2, 3, 8, 5, 6, *range(20, 29)]
    assert batch.positions.tolist() == [5, 2, 3, 4, 0, 0, 1, *range(3, 12)]
    assert batch.write_slots.tolist()[:7] == [37, 26, 27, 8, 12, 4, 5]
    assert batch.logits_rows.tolist() == [0, 1, 2, 3, 4, 15]
    group = batch.decode
    assert group is not None and not group.covers_batch
    assert group.rows.tolist() == [0, 1, 2, 3, 4] and group.kv_lens.tolist() == [6, 3, 4, 5, 1]
    assert group.page_tables.tolist() == [[4, 9], [6, 2], [6, 2], [6, 2], [3, 0]] and group.padded_len == 8
    assert group.mask(None)[:, 0, 0].tolist()[0] == [True] * 6 + [False] * 2
    assert group.mask(None)[:, 0, 0].tolist()[4] == [True] + [False] * 7
    assert group.mask(2)[0, 0, 0].tolist() == [False] * 4 + [True] * 2 + [False] * 2
    fresh, chunk = batch.prefills
    assert fresh.pages is None and fresh.mask is None
    assert chunk.pages is not None and chunk.pages.tolist() == [0, 5, 7] and chunk.context_len == 12
    assert (batch.max_position, batch.max_page) == (11, 9)


def test_forward_batch_all_decodes_cover_the_batch() -> None:
    group = ForwardBatch.build([SeqInput([1], 3, [5], LogitsMode.LAST)] * 3, 4, "cpu").decode
    assert group is not None and group.covers_batch and group.rows.tolist() == [0, 1, 2]


def test_forward_batch_rejects_a_negative_page() -> None:
    seqs = [SeqInput([1], 0, [2], LogitsMode.LAST), SeqInput([1, 2], 3, [0, -1, 5], LogitsMode.LAST)]
    with pytest.raises(ValueError, match=r"seq 1: page_table contains a negative page id: \[0, -1\]"):
        ForwardBatch.build(seqs, 4, "cpu")
