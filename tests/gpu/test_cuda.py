"""The executor on CUDA: bf16 parity with transformers, FlexAttention against the reference, CUDA-graph replay against
the eager forward, the sampler's grammar masks on the device, and greedy parity of the engine.

Every test is marked ``gpu`` and skipped without CUDA (tests/conftest.py); ``bash scripts/gpu-check`` runs them on a
device. They import only what a device machine has (torch, transformers, tokenizers, safetensors).

The bf16 tolerance: bf16 keeps 8 significant bits (a relative rounding error of 2^-9, about 0.2% per operation),
and a forward rounds a few dozen times along any path, so logits are compared with an error bound of 3% of the
largest logit magnitude against float32 transformers, and greedy tokens wherever float32's top-two gap exceeds
that bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.config import AttentionBackendKind, CudaGraphConfig, EngineConfig
from engine.executor.runner import ModelRunner
from engine.executor.sampler import Sampler, SamplingState
from engine.kv.pool import KVPool
from engine.model.attention import TorchAttention
from engine.model.attention_backend import attention_backend
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.graphs import DecodeGraphs, Launch
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model, random_model
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 3e-2  # of the largest |logit| (see the module docstring)
PAGE_SIZE = 16  # the flex kernels' smallest key tile
NUM_PAGES = 64
PROMPT_LEN = 40
DECODE_STEPS = 16
VOCAB = 512
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else 0.05 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("llama-cuda")
    model.save_pretrained(path)
    return path


def pool(model: LlamaForCausalLM, dtype: torch.dtype, scratch: bool = False) -> KVPool:
    cfg = model.config
    return KVPool(cfg.num_layers, NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, CUDA, scratch)


def error(ours: torch.Tensor, truth: torch.Tensor) -> float:
    return float((ours.float() - truth.float()).abs().max() / truth.float().abs().max())


@pytest.mark.parametrize("backend", ["flex", "torch"])
def test_bf16_forward_matches_float32_transformers_within_the_bf16_tolerance(checkpoint: Path, backend: str) -> None:
    """Prefill and 16 greedy decode steps in bf16 on CUDA through the paged pool, against float32 transformers:
    logits within the tolerance at every step, and the same greedy token wherever float32's choice is clear."""
    truth_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(CUDA).eval()
    chosen = attention_backend(AttentionBackendKind(backend), CUDA)
    model, _ = load_model(checkpoint, torch.bfloat16, CUDA, chosen)
    kv = pool(model, torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    pages = list(range(3, 3 + NUM_PAGES // 4))
    seq = SeqInput(tokens, 0, pages, LogitsMode.LAST)
    for step in range(DECODE_STEPS + 1):
        ours = model(ForwardBatch.build([seq], PAGE_SIZE, CUDA), kv)[0]  # [V]
        with torch.no_grad():
            truth = truth_model(torch.tensor([tokens], device=CUDA)).logits[0, -1].float()  # [V]
        assert error(ours, truth) <= BF16_TOLERANCE, f"step {step}"
        top2 = truth.topk(2).values
        if float(top2[0] - top2[1]) > BF16_TOLERANCE * float(truth.abs().max()):
            assert int(ours.argmax()) == int(truth.argmax()), f"step {step}: greedy token differs"
        tokens.append(int(truth.argmax()))
        seq = SeqInput(tokens[-1:], len(tokens) - 1, pages, LogitsMode.LAST)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_attention_equals_the_reference_on_every_kind_of_query(dtype: torch.dtype) -> None:
    """The compiled Triton kernels (which, unlike eager FlexAttention, visit only the listed pages): decodes, a verify
    chain, a fresh prefill, chunks after context (short: the decoding kernel; 140 tokens: the prefill kernel with its
    key tile cut to the page) and a draft tree, with and without a window."""
    gen = torch.Generator().manual_seed(2)
    pages = torch.randperm(NUM_PAGES, generator=gen).tolist()
    seqs = [
        SeqInput([1], 40, pages[0:3], LogitsMode.LAST),
        SeqInput([1], 5, pages[3:4], LogitsMode.LAST),
        SeqInput([1, 2, 3], 20, pages[4:6], LogitsMode.ALL),
        SeqInput([1] * 150, 0, pages[6:16], LogitsMode.ALL),
        SeqInput([1] * 30, 33, pages[16:21], LogitsMode.ALL),
        SeqInput([1] * 5, 17, pages[21:23], LogitsMode.ALL, (-1, 0, 0, 1, 2)),
        SeqInput([1] * 140, 20, pages[23:33], LogitsMode.ALL),  # long enough for the prefill kernel over pages
    ]
    batch = ForwardBatch.build(seqs, PAGE_SIZE, CUDA)
    heads, kv_heads, dim = 8, 2, 64
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen).to(CUDA, dtype)
    k, v = (torch.randn(batch.num_tokens, kv_heads, dim, generator=gen).to(CUDA, dtype) for _ in range(2))
    cache = [torch.randn(NUM_PAGES * PAGE_SIZE, kv_heads, dim, generator=gen).to(CUDA, dtype) for _ in range(2)]
    flex = attention_backend(AttentionBackendKind.FLEX, CUDA)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for window in (None, 24):
        want = TorchAttention().plan(batch, window).attend(q, k, v, *(c.clone() for c in cache))
        got = flex.plan(batch, window).attend(q, k, v, *(c.clone() for c in cache))
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_cuda_graph_replay_equals_the_eager_forward(checkpoint: Path) -> None:
    """Three sequences decode 12 steps through a captured graph (bucket 4) and, separately, eagerly as built: the same
    logits, one capture, then replays; a sequence crossing into a new page keeps the captured width (4 pages)."""
    model, _ = load_model(checkpoint, torch.bfloat16, CUDA, attention_backend(AttentionBackendKind.FLEX, CUDA))
    eager_kv, graph_kv = pool(model, torch.bfloat16, True), pool(model, torch.bfloat16, True)
    graphs = DecodeGraphs(model, graph_kv, CudaGraphConfig(batch_sizes=(1, 2, 4, 8)), 16, capture=True)
    lengths = [14, 30, 45]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    prefill = [SeqInput(list(range(1, n + 1)), 0, t, LogitsMode.LAST) for n, t in zip(lengths, tables, strict=True)]
    for kv in (eager_kv, graph_kv):
        model(ForwardBatch.build(prefill, PAGE_SIZE, CUDA), kv)
    for step in range(12):
        seqs = [SeqInput([7 + step], n + step, t, LogitsMode.LAST) for n, t in zip(lengths, tables, strict=True)]
        batch = ForwardBatch.build(seqs, PAGE_SIZE, CUDA)
        want = model(batch, eager_kv)
        got = graphs.forward(batch)
        assert graphs.last_launch is Launch.REPLAY
        assert error(got, want) <= 1e-2, f"step {step}"
    assert graphs.stats.captures == 1 and graphs.stats.replays == 12


def test_grammar_bitmask_on_the_device_gives_the_cpu_sampler_tokens() -> None:
    """Greedy rows under a bitmask on CUDA (the torch path) choose what the CPU sampler (its C kernel) chooses."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, VOCAB // 32), generator=gen, dtype=torch.int32)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    tokens = []
    for device in (torch.device("cpu"), CUDA):
        states = [SamplingState(params, [1, 2], frozenset({0}), VOCAB, device, i) for i in range(5)]
        out = Sampler(VOCAB, device).sample(logits.to(device), states, bitmask.to(device))
        tokens.append(out.token_ids)
    assert tokens[0] == tokens[1]


def test_the_engine_on_cuda_gives_the_cpu_greedy_outputs(embedded_model_dir: Path) -> None:
    """The embedded model served in process on CUDA (flex attention, CUDA graphs, overlap) and on CPU: the same greedy
    tokens for a batch of prompts, and the CUDA run replayed graphs."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 2048, (n,), generator=gen).tolist() for n in (4, 9, 17, 25, 33, 40, 12, 6)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * len(prompts)
    outputs = []
    for device in ("cpu", "cuda"):
        config = EngineConfig(model_path=str(embedded_model_dir), device=device, num_pages=512, max_running=8)
        runner = ModelRunner.load(config)
        with Engine(config, runner=runner) as engine:
            outs = engine.generate_batch(prompts, params, timeout=120)
            outputs.append([list(o.output_ids or ()) for o in outs])
        if device == "cuda":
            assert runner.graphs is not None and runner.graphs.stats.replays > 0
    assert outputs[0] == outputs[1]


def test_random_llama3_8b_layer_shapes_run_in_bf16() -> None:
    """One layer of the bench's Llama-3-8B shape (head_dim 128, GQA 32/8) through flex attention and a graph."""
    from bench.gpu import LLAMA3_8B

    config = ModelConfig.from_hf({**LLAMA3_8B, "num_hidden_layers": 1, "vocab_size": 1024})
    model = random_model(config, torch.bfloat16, CUDA, attention=attention_backend(AttentionBackendKind.AUTO, CUDA))
    kv = pool(model, torch.bfloat16, True)
    graphs = DecodeGraphs(model, kv, CudaGraphConfig(batch_sizes=(2,)), 8, capture=True)
    model(ForwardBatch.build([SeqInput(list(range(20)), 0, [0, 1], LogitsMode.LAST)] * 1, PAGE_SIZE, CUDA), kv)
    batch = ForwardBatch.build([SeqInput([5], 20, [0, 1], LogitsMode.LAST)], PAGE_SIZE, CUDA)
    logits = graphs.forward(batch)
    assert logits.shape == (1, 1024) and torch.isfinite(logits).all()
