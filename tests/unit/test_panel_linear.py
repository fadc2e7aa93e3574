"""The native panel matmul (engine/model/panel_matmul.c) behind the target's linear layers on CPU.

Its product equals torch's linear to rounding for every shape a layer can have (outputs not a multiple of the
32-column panel, odd input widths, biases, any row count); each row's result is bit for bit the same in any batch and
with any thread count (batch invariance), so that at the model level a verify's logits for a chain equal plain
decoding's exactly, and a request's logits do not depend on what it is batched with. Packing replaces every linear of
a model and keeps its outputs; the runner packs CPU float32 targets only, and ``ORDINAL_NATIVE=0`` keeps torch's.
Arguments that do not fit are refused before C reads anything.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import EngineConfig
from engine.executor.runner import ModelRunner
from engine.kv.pool import KVPool
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.loader import random_model
from engine.model.native import NATIVE_ENV, PanelLinearKernel, panel_linear_kernel
from engine.model.panel_linear import PanelLinear, pack_for_cpu, pack_linears, padded_bias, panels
from tests.support.models import single_thread, tiny_llama  # noqa: F401  (single_thread: an autouse fixture)

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def kernel() -> PanelLinearKernel:
    loaded = panel_linear_kernel()
    if loaded is None:
        pytest.skip("no C compiler: the native panel matmul cannot be built here")
    return loaded


def _weights(out: int, width: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=g)  # [out, in]
    return weight, (torch.randn(out, generator=g) if bias else None)


@pytest.mark.parametrize("out", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("width", [1, 7, 64, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_equals_torchs_linear(kernel: PanelLinearKernel, out: int, width: int, bias: bool) -> None:
    weight, b = _weights(out, width, bias)
    packed, packed_bias = panels(weight, torch.float32), None if b is None else padded_bias(b)
    for rows in (1, 2, 5, 6, 7, 13, 64):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))  # [N, in]
        ours = kernel(x, packed, out, packed_bias)  # [N, out]
        ref = F.linear(x, weight, b)  # [N, out]
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * width**0.5)


def test_bf16_panels_of_bf16_valued_weights_give_the_float32_panels_result(kernel: PanelLinearKernel) -> None:
    weight = _weights(70, 96, False)[0].to(torch.bfloat16).float()  # [out, in], every value a bf16 value
    x = torch.randn(9, 96)  # [N, in]
    half = kernel(x, panels(weight, torch.bfloat16), 70, None)
    assert torch.equal(half, kernel(x, panels(weight, torch.float32), 70, None))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_the_same_alone_in_any_batch_and_with_any_thread_count(
    kernel: PanelLinearKernel, threads: int
) -> None:
    """Batch invariance: row r's output is bit for bit the same whether it is computed alone, as row r of a batch of
    any size (so in any tile and at any place in it), or with two threads instead of one (the product is large
    enough to run in parallel). Fails if a tile's summation order depends on its row count, as the draft kernel's
    earlier split sums did (4 partial sums for a lone row, 1 for a tile of 4): checked by adding a lone row's
    partial sums in another order, which fails both thread counts and the model-level test below."""
    weight, b = _weights(512, 256, True)  # 37 rows x 256 x 512 multiply-adds: past the kernel's parallel threshold
    packed, packed_bias = panels(weight, torch.float32), padded_bias(b)  # type: ignore[arg-type]
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(3))  # [N, in]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernel(x[r : r + 1], packed, 512, packed_bias) for r in range(37)])  # [N, out]
        for rows in (2, 5, 6, 7, 12, 13, 37):
            assert torch.equal(kernel(x[:rows], packed, 512, packed_bias), alone[:rows]), f"a batch of {rows}"
        shifted = kernel(x[3:], packed, 512, packed_bias)  # every row at another place in its tile
        assert torch.equal(shifted, alone[3:])
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel(x, packed, 512, packed_bias), alone)
    finally:
        torch.set_num_threads(before)


def test_arguments_that_do_not_fit_are_refused(kernel: PanelLinearKernel) -> None:
    weight, b = _weights(40, 16, True)
    packed, packed_bias = panels(weight, torch.float32), padded_bias(b)  # type: ignore[arg-type]
    x = torch.randn(3, 16)
    bad_calls = {
        "x of another width": lambda: kernel(torch.randn(3, 17), packed, 40, packed_bias),
        "x in float64": lambda: kernel(x.double(), packed, 40, packed_bias),
        "x of one dimension": lambda: kernel(x[0], packed, 40, packed_bias),
        "too few panels for the outputs": lambda: kernel(x, packed, 70, None),
        "panels not contiguous": lambda: kernel(x, packed.transpose(0, 1), 40, packed_bias),
        "panels in float16": lambda: kernel(x, packed.half(), 40, packed_bias),
        "a bias not padded": lambda: kernel(x, packed, 40, b),
        "no outputs": lambda: kernel(x, packed[:0], 0, None),
    }
    for what, call in bad_calls.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(what)


def _model_and_pool() -> tuple[nn.Module, KVPool]:
    config = tiny_llama(hidden_size=64, intermediate_size=96, vocab_size=300, max_position_embeddings=128)
    model = random_model(config, torch.float32, "cpu", std=0.1)
    return model, KVPool(config.num_layers, 64, PAGE_SIZE, config.num_kv_heads, config.head_dim, torch.float32, "cpu")


def _forward(model: nn.Module, kv: KVPool, seqs: list[SeqInput]) -> torch.Tensor:
    return model(ForwardBatch.build(seqs, PAGE_SIZE, "cpu"), kv)  # type: ignore[no-any-return]


def test_a_packed_model_gives_the_unpacked_models_logits(kernel: PanelLinearKernel) -> None:
    model, kv = _model_and_pool()
    prompt, pages = list(range(3, 30)), list(range(1, 12))
    with torch.inference_mode():
        before = _forward(model, kv, [SeqInput(prompt, 0, pages, LogitsMode.ALL)])  # [T, V]
        assert pack_linears(model, kernel) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        after = _forward(model, kv, [SeqInput(prompt, 0, pages, LogitsMode.ALL)])
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_a_verify_gives_plain_decodings_logits_bit_for_bit(kernel: PanelLinearKernel) -> None:
    """With packed linears, the logits a chain verify computes for each node are exactly those plain decoding
    computes token by token, and a request's decode logits do not change when other requests share its step: so a
    greedy verify accepts exactly what plain greedy decoding would write, never flipping a near tie. Fails with the
    model's torch linears (their sums depend on the row count: the logits differ by ~1e-6), or if the kernel's
    summation order depended on the tile (both checked)."""
    model, _ = _model_and_pool()
    pack_linears(model, kernel)
    prompt, chain = list(range(3, 30)), [7, 9, 11, 13, 15]
    pages = [list(range(1 + 12 * s, 13 + 12 * s)) for s in range(3)]
    with torch.inference_mode():
        _, kv = _model_and_pool()
        for s in range(3):
            _forward(model, kv, [SeqInput(prompt[s:], 0, pages[s], LogitsMode.NONE)])
        plain = [
            _forward(model, kv, [SeqInput([t], len(prompt) + j, pages[0], LogitsMode.LAST)])[0]
            for j, t in enumerate(chain)
        ]
        _, kv = _model_and_pool()
        for s in range(3):
            _forward(model, kv, [SeqInput(prompt[s:], 0, pages[s], LogitsMode.NONE)])
        others = [SeqInput([5], len(prompt) - s, pages[s], LogitsMode.LAST) for s in (1, 2)]
        verify = _forward(model, kv, [others[0], SeqInput(chain, len(prompt), pages[0], LogitsMode.ALL), others[1]])
    for j in range(len(chain)):
        assert torch.equal(verify[1 + j], plain[j]), f"node {j}"


def test_the_runner_packs_cpu_float32_targets_only(kernel: PanelLinearKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner.load(EngineConfig(num_pages=64))
    try:
        assert isinstance(runner._model.lm_head, PanelLinear)
    finally:
        runner.shutdown()
    model, _ = _model_and_pool()
    assert not pack_for_cpu(model, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert not pack_for_cpu(model, torch.float32, torch.device("cpu"))
    assert isinstance(model.lm_head, nn.Linear)
    runner = ModelRunner.load(EngineConfig(num_pages=64))
    try:
        assert isinstance(runner._model.lm_head, nn.Linear)
    finally:
        runner.shutdown()
