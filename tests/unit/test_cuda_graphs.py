"""The CUDA-graph bookkeeping on CPU: buckets, padding, static buffers, invalidation, and the same code path eager.

On CPU the graph runner runs in STATIC mode: every graph-shaped step goes through the static buffers of its shape
class, padded to its bucket, and the forward runs eagerly over them; on CUDA the same buffers are captured once
and replayed (tests/gpu/test_cuda.py). What is checked here is what capture depends on: that padding changes no
real row's logits, never touches a request's KV, and that a shape change rebuilds the class.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CudaGraphConfig, EngineConfig, SpecAlgorithm, SpeculativeConfig
from engine.executor.runner import ModelRunner
from engine.kv.pool import KVPool
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.graphs import DecodeGraphs, GraphMode, Launch, ShapeClass
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import random_model
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from tests.helpers import length_outputs, random_prompts
from tests.support.models import single_thread, tiny_llama  # noqa: F401 (single_thread: an autouse fixture)

PAGE_SIZE = 4
NUM_PAGES = 32
SIZES = CudaGraphConfig(batch_sizes=(1, 2, 4, 8))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return random_model(tiny_llama(), torch.float32, "cpu", seed=5, std=0.2)


def pool(model: LlamaForCausalLM) -> KVPool:
    cfg = model.config
    kv = KVPool(cfg.num_layers, NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu", True)
    return kv


def filled_pools(model: LlamaForCausalLM) -> tuple[KVPool, KVPool]:
    """Two pools with the same random history in every addressable slot."""
    a, b = pool(model), pool(model)
    history = torch.randn(a.k(0).shape, generator=torch.Generator().manual_seed(1))
    for layer in range(model.config.num_layers):
        for tensor in (a.k(layer), a.v(layer), b.k(layer), b.v(layer)):
            tensor[: NUM_PAGES * PAGE_SIZE].copy_(history[: NUM_PAGES * PAGE_SIZE])
    return a, b


def addressable(kv: KVPool) -> torch.Tensor:
    """Every layer's K and V in the slots a page table can name (the scratch page left out)."""
    layers = [t for i in range(kv.num_layers) for t in (kv.k(i), kv.v(i))]
    return torch.stack(layers)[:, : NUM_PAGES * PAGE_SIZE]  # [2 * layers, slots, Hkv, D]


def decodes(lengths: list[int], first_page: int = 0) -> list[SeqInput]:
    """One decode per sequence, sequence s at position lengths[s], on its own run of pages."""
    seqs, page = [], first_page
    for i, pos in enumerate(lengths):
        pages = list(range(page, page + pos // PAGE_SIZE + 1))
        page += len(pages)
        seqs.append(SeqInput([3 + i], pos, pages, LogitsMode.LAST))
    return seqs


def graphs(model: LlamaForCausalLM, kv: KVPool, max_width: int = 8) -> DecodeGraphs:
    return DecodeGraphs(model, kv, SIZES, max_width, capture=False)


def test_batch_sizes_are_bucketed_and_page_widths_padded(model: LlamaForCausalLM) -> None:
    runner = graphs(model, pool(model), max_width=6)
    assert [runner.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert [runner.page_width(w) for w in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]  # powers of two, capped
    assert CudaGraphConfig.up_to(100).batch_sizes[-3:] == (80, 96, 100)
    with pytest.raises(ValueError, match="ascending"):
        CudaGraphConfig(batch_sizes=(4, 2))
    with pytest.raises(ValueError, match="scratch page"):
        DecodeGraphs(model, KVPool(2, 4, 4, 2, 8, torch.float32, "cpu"), SIZES, 4, capture=False)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, pool(model), SIZES, 4, capture=True)


def test_padded_step_equals_the_step_as_built_and_padding_writes_only_the_scratch_page(
    model: LlamaForCausalLM,
) -> None:
    """Three decodes (padded to 4 rows, page tables 1..3 pages wide padded to 4) give the logits and the KV of the
    unpadded forward; the padding row's K/V lands in the scratch page. Fails if StaticDecodeBatch.load stops
    pointing padding rows at the scratch slot (they would write page 0, a request's KV)."""
    plain_kv, graph_kv = filled_pools(model)
    runner = graphs(model, graph_kv)
    batch = ForwardBatch.build(decodes([2, 9, 5]), PAGE_SIZE, "cpu")
    want = model(batch, plain_kv)
    got = runner.forward(batch)
    assert runner.last_launch is Launch.STATIC and runner.classes == (ShapeClass(4, 4),)
    assert got.shape == want.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(addressable(graph_kv), addressable(plain_kv), rtol=1e-5, atol=1e-5)
    scratch = graph_kv.k(0)[NUM_PAGES * PAGE_SIZE :]
    assert scratch.abs().sum() > 0  # the padding row wrote there


def test_rows_left_from_a_larger_step_are_padding_again(model: LlamaForCausalLM) -> None:
    """Four decodes, then two in the same class on pages the first step's last two sequences had (released and
    reused): the buffers' rows 2-3 still hold the first step's inputs and must be reset, or the second step would
    run them again and write K/V computed over the new requests' context into their pages. Fails if the ``[n:]``
    resets in StaticDecodeBatch.load are removed (layer 1's K/V of page 5 differs)."""
    plain_kv, graph_kv = filled_pools(model)
    only_four = DecodeGraphs(model, graph_kv, CudaGraphConfig(batch_sizes=(4,)), 8, capture=False)
    # Step 1's sequence 2 sits at position 5 of pages [4, 5]; step 2's first sequence writes position 4 there.
    for seqs in (decodes([2, 9, 5, 6]), decodes([4, 7], first_page=4)):
        batch = ForwardBatch.build(seqs, PAGE_SIZE, "cpu")
        torch.testing.assert_close(only_four.forward(batch), model(batch, plain_kv), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(addressable(graph_kv), addressable(plain_kv), rtol=1e-5, atol=1e-5)
    assert only_four.stats.static == 2 and only_four.classes == (ShapeClass(4, 4),)


def test_only_decode_shaped_steps_use_the_buffers(model: LlamaForCausalLM) -> None:
    """A verify chain after cached context is graph-shaped (a logits row per token); a fresh prefill, a draft tree,
    and more rows than the largest size run as built."""
    runner = graphs(model, pool(model))
    chain = ForwardBatch.build([SeqInput([1, 2, 3], 6, [0, 1, 2], LogitsMode.ALL)], PAGE_SIZE, "cpu")
    assert runner.shape_class(chain) == ShapeClass(4, 4)
    tree = SeqInput([1, 2, 3], 6, [0, 1, 2], LogitsMode.ALL, (-1, 0, 0))
    prefill = SeqInput([1, 2, 3], 0, [0], LogitsMode.LAST)
    too_many = decodes([1] * 9)
    for seqs in ([tree], [prefill], too_many, [*decodes([4]), prefill]):
        batch = ForwardBatch.build(seqs, PAGE_SIZE, "cpu")
        assert runner.shape_class(batch) is None
        runner.forward(batch)
        assert runner.last_launch is Launch.EAGER
    assert runner.stats.static == 0 and runner.stats.eager == 4


def test_a_wider_page_table_invalidates_its_class_and_a_narrower_one_reuses_it(model: LlamaForCausalLM) -> None:
    """The class of 2 rows is built 2 pages wide, rebuilt 4 wide when a sequence needs 3 pages (a captured graph
    would read too narrow a table), then reused by narrower steps with the same buffers."""
    runner = graphs(model, pool(model))
    runner.forward(ForwardBatch.build(decodes([1, 6]), PAGE_SIZE, "cpu"))
    assert runner.classes == (ShapeClass(2, 2),)
    runner.forward(ForwardBatch.build(decodes([9, 2]), PAGE_SIZE, "cpu"))
    assert runner.classes == (ShapeClass(2, 4),) and runner.stats.invalidations == 1
    buffers = runner.forward(ForwardBatch.build(decodes([1, 2]), PAGE_SIZE, "cpu"))
    assert buffers.shape[0] == 2 and runner.classes == (ShapeClass(2, 4),) and runner.stats.invalidations == 1
    runner.forward(ForwardBatch.build(decodes([1]), PAGE_SIZE, "cpu"))
    assert set(runner.classes) == {ShapeClass(2, 4), ShapeClass(1, 1)}


def test_the_engine_through_the_static_buffers_gives_the_same_greedy_outputs(embedded_model_dir: object) -> None:
    """The whole engine (overlap on, n-gram speculation, so plain decodes and verify chains) with every decode step
    through the graph runner's buffers: the same greedy tokens as without it, and the buffers were used."""
    spec = SpeculativeConfig(algorithm=SpecAlgorithm.NGRAM, num_steps=3, adaptive=False)
    config = EngineConfig(model_path=str(embedded_model_dir), num_pages=256, max_running=8, speculative=spec)
    prompts = random_prompts(6, 4, 24, 2048, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    outputs = []
    for mode in (GraphMode.OFF, GraphMode.STATIC):
        runner = ModelRunner.load(config, graph_mode=mode)
        with Engine(config, runner=runner) as engine:
            outputs.append(length_outputs(engine, prompts, [params] * len(prompts)))
        if mode is GraphMode.STATIC:
            assert runner.graphs is not None and runner.graphs.stats.static > 0
    assert outputs[0] == outputs[1]
