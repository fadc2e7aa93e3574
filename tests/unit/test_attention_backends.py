"""The attention backends: selection, and the FlexAttention backend's paged block masks against the reference.

FlexAttention runs on CPU eagerly (it materialises the scores through ``mask_mod`` and visits every key, ignoring
the block tables), so on CPU two things are checked separately: the output, which tests the masks (causality,
windows, trees, the physical-to-logical page map), and the block tables, which must list every page a query can
see (the compiled kernel on CUDA visits only those; tests/gpu/test_cuda.py runs it).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.config import AttentionBackendKind, CudaGraphConfig, EngineConfig
from engine.kv.pool import KVPool
from engine.model.attention import TorchAttention
from engine.model.attention_backend import attention_backend
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.loader import random_model
from services.flags import add_engine_args, engine_argv, engine_config
from tests.support.models import tiny_llama

flex = pytest.importorskip("engine.model.flex_attention")
if flex.flex_unavailable() is not None:
    pytest.skip(f"FlexAttention unavailable: {flex.flex_unavailable()}", allow_module_level=True)

PAGE_SIZE = 4
NUM_PAGES = 24
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


@pytest.fixture(scope="module", autouse=True)
def quiet_eager_flex() -> Iterator[None]:
    """Eager FlexAttention warns that it is unfused: on CPU that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def mixed_batch() -> ForwardBatch:
    """Every kind of query in one step over shuffled pages: two decodes, a verify chain after context (decode
    queries), a fresh prefill, a chunk after cached context, and a draft tree."""
    pages = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(2)).tolist()
    seqs = [
        SeqInput([1], 9, pages[0:3], LogitsMode.LAST),
        SeqInput([1], 2, pages[3:4], LogitsMode.LAST),
        SeqInput([1, 2, 3], 6, pages[4:7], LogitsMode.ALL),
        SeqInput([1] * 7, 0, pages[7:9], LogitsMode.ALL),
        SeqInput([1] * 10, 5, pages[9:13], LogitsMode.ALL),
        SeqInput([1] * 5, 8, pages[13:17], LogitsMode.ALL, (-1, 0, 0, 1, 2)),
    ]
    return ForwardBatch.build(seqs, PAGE_SIZE, "cpu")


def qkv(tokens: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(4)
    pool = NUM_PAGES * PAGE_SIZE
    return (
        torch.randn(tokens, HEADS, HEAD_DIM, generator=gen),  # q
        torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen),  # k
        torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen),  # v
        torch.randn(pool, KV_HEADS, HEAD_DIM, generator=gen),  # k_cache
        torch.randn(pool, KV_HEADS, HEAD_DIM, generator=gen),  # v_cache
    )


@pytest.mark.parametrize("window", [None, 3])
def test_flex_attention_equals_the_reference_on_every_kind_of_query(window: int | None) -> None:
    """Decodes, a chain, a fresh prefill, a chunk after context and a tree, with and without a sliding window, GQA,
    pages out of order: the same output as the torch reference, and the same pool afterwards."""
    batch = mixed_batch()
    q, k, v, k_cache, v_cache = qkv(batch.num_tokens)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = TorchAttention().plan(batch, window).attend(q, k, v, ref_k, ref_v)
    got = flex.FlexAttentionBackend(compiled=False).plan(batch, window).attend(q, k, v, k_cache, v_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def visible_blocks(mask: Any, batch_rows: int, q_len: int, kv_len: int) -> list[list[set[int]]]:
    """Per batch row and query block, the key blocks holding a key ``mask_mod`` lets some query of it see."""
    from torch.nn.attention.flex_attention import create_mask

    q_block, kv_block = mask.BLOCK_SIZE
    dense = create_mask(mask.mask_mod, batch_rows, 1, q_len, kv_len, device="cpu")[:, 0]  # [B, Q, KV]
    out = []
    for row in dense:
        blocks = []
        for start in range(0, q_len, q_block):
            keys = row[start : start + q_block].any(dim=0).nonzero().flatten()
            blocks.append({int(key) // kv_block for key in keys})
        out.append(blocks)
    return out


def listed_blocks(mask: Any) -> list[list[set[int]]]:
    counts, indices = mask.kv_num_blocks[:, 0], mask.kv_indices[:, 0]  # [B, QB], [B, QB, K]
    return [[set(indices[b, j, : counts[b, j]].tolist()) for j in range(counts.shape[1])] for b in range(len(counts))]


@pytest.mark.parametrize("window", [None, 3])
def test_block_tables_list_every_page_a_query_sees(window: int | None) -> None:
    """The compiled kernel visits only the blocks (pages) in a query block's table: every key a query may see must
    be in a listed page. Fails if decode_block_mask counts a sequence's pages with floor division (the last, partly
    filled page, which holds the query's own key, is left out) or chunk_block_mask lists fewer pages."""
    batch = mixed_batch()
    slots = NUM_PAGES * PAGE_SIZE
    group = batch.decode
    assert group is not None
    decode = flex.decode_block_mask(group, window, slots)
    for seen, listed in zip(visible_blocks(decode, len(group.kv_lens), 1, slots), listed_blocks(decode), strict=True):
        assert seen[0] and seen[0] <= listed[0], (seen, listed)
    for chunk in batch.prefills:
        keys = slots if chunk.pages is not None else chunk.num_tokens
        mask = flex.chunk_block_mask(chunk, window, keys, PAGE_SIZE, torch.device("cpu"))
        seen, listed = visible_blocks(mask, 1, chunk.num_tokens, keys)[0], listed_blocks(mask)[0]
        assert all(v <= lst for v, lst in zip(seen, listed, strict=True)), (chunk, seen, listed)
        assert all(v for v in seen)  # every query block sees something: the check is not vacuous


def test_the_model_with_flex_attention_gives_the_reference_logits() -> None:
    """A tiny random model: prefill, then two decode steps, through each backend into its own pool."""
    config = tiny_llama(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=64)
    logits = []
    for backend in (TorchAttention(), flex.FlexAttentionBackend(compiled=False)):
        model = random_model(config, torch.float32, "cpu", seed=9, std=0.2, attention=backend)
        kv = KVPool(config.num_layers, NUM_PAGES, PAGE_SIZE, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
        pages = [5, 2, 7, 1]
        steps = [SeqInput(list(range(3, 14)), 0, pages, LogitsMode.LAST)]
        steps += [SeqInput([20 + i], 11 + i, pages, LogitsMode.LAST) for i in range(2)]
        logits.append(torch.cat([model(ForwardBatch.build([s], PAGE_SIZE, "cpu"), kv) for s in steps]))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_backend_selection_defaults_by_device() -> None:
    cpu = torch.device("cpu")
    assert isinstance(attention_backend(AttentionBackendKind.AUTO, cpu), TorchAttention)
    assert isinstance(attention_backend(AttentionBackendKind.TORCH, cpu), TorchAttention)
    chosen = attention_backend(AttentionBackendKind.FLEX, cpu, page_size=4)
    assert isinstance(chosen, flex.FlexAttentionBackend) and not chosen.compiled  # eager on CPU, any page size
    # On CUDA (decided before anything touches a device): the kernels need pages of a multiple of 16 tokens.
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="multiple of 16, got --page-size 8"):
        attention_backend(AttentionBackendKind.FLEX, cuda, page_size=8)
    assert isinstance(attention_backend(AttentionBackendKind.AUTO, cuda, page_size=8), TorchAttention)


def test_kernel_flags_reach_the_config_and_the_child_command_lines() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--attention-backend", "flex", "--no-cuda-graph", "--cuda-graph-max-bs", "32"])
    config = engine_config(args)
    assert config.attention_backend is AttentionBackendKind.FLEX
    assert config.cuda_graph == CudaGraphConfig(False, (1, 2, 4, 8, 12, 16, 24, 32))
    assert engine_config(parser.parse_args(engine_argv(args))) == config
    with pytest.raises(SystemExit):
        engine_config(parser.parse_args(["--cuda-graph-max-bs", "0"]))
