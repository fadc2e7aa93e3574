"""Our paged Llama-family model against transformers on tiny random checkpoints of each family."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from engine.kv.pool import KVPool
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.native import panel_linear_kernel
from engine.model.panel_linear import pack_linears
from tests.support.models import single_thread  # noqa: F401  (an autouse fixture)

PAGE_SIZE = 4
NUM_PAGES = 40
PROMPT_LEN = 23
DECODE_STEPS = 16
VOCAB = 300
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the 39-token test sequences cross every frequency band of the scaling.
    "original_max_position_embeddings": 16,
}
# Every family, with GQA, tied and untied embeddings, and sliding windows short enough to matter.
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama3": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": (
        Qwen2Config,
        # Layer 0 full attention, layer 1 a 6-token window: per-layer windows as transformers decides.
        {
            "tie_word_embeddings": True,
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
        },
    ),
    "qwen3": (Qwen3Config, {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral": (MistralConfig, {"sliding_window": 8, "num_key_value_heads": 1}),
}


@dataclass(frozen=True)
class Checkpoint:
    """A saved tiny model, its transformers twin, and a prompt."""

    name: str
    path: Path
    reference: PreTrainedModel
    prompt: list[int]


def _randomize(model: torch.nn.Module) -> None:
    """Weights big enough that a wrong rope, mask or bias shows (HF's 0.02 init makes logits flat)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.1 * torch.randn_like(param)
            param.copy_(noise + 1.0 if "norm" in name else noise)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    config_cls, extra = FAMILIES[request.param]
    torch.manual_seed(1234)
    hf_model = AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra}))
    _randomize(hf_model)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    return Checkpoint(request.param, path, reference.eval(), prompt)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def reference_logits(ckpt: Checkpoint, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.reference(torch.tensor([token_ids])).logits[0].float()  # [len, V]


def new_pool(model: LlamaForCausalLM, device: str = "cpu", dtype: torch.dtype = torch.float32) -> KVPool:
    cfg = model.config
    return KVPool(cfg.num_layers, NUM_PAGES, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, device)


def step(model: LlamaForCausalLM, kv: KVPool, seqs: list[SeqInput]) -> torch.Tensor:
    return model(ForwardBatch.build(seqs, PAGE_SIZE, kv.device), kv)


def shuffled_pages(seed: int, count: int = 10) -> list[int]:
    """A non-contiguous, out-of-order page table."""
    return torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def check_prefill_then_greedy_decode(ckpt: Checkpoint, device: str, packed: bool = False) -> None:
    model, _ = load_model(ckpt.path, torch.float32, device)
    if packed:  # the linears as the executor runs them on a CPU (engine/model/panel_linear.py)
        kernel = panel_linear_kernel()
        if kernel is None:
            pytest.skip("no C compiler: the native panel matmul cannot be built here")
        pack_linears(model, kernel)
    kv = new_pool(model, device)
    pages = shuffled_pages(0)
    tokens = list(ckpt.prompt)
    ours = step(model, kv, [SeqInput(tokens, 0, pages, LogitsMode.ALL)])
    ref = reference_logits(ckpt, tokens)
    assert ours.shape == (PROMPT_LEN, VOCAB) and ours.dtype == torch.float32
    assert rel_err(ours.cpu(), ref) <= 1e-4
    for _ in range(DECODE_STEPS):
        tokens.append(int(ref[-1].argmax()))
        ours = step(model, kv, [SeqInput(tokens[-1:], len(tokens) - 1, pages, LogitsMode.LAST)])
        ref = reference_logits(ckpt, tokens)
        assert ours.shape == (1, VOCAB)
        assert rel_err(ours[0].cpu(), ref[-1]) <= 1e-4, f"decode position {len(tokens) - 1}"


def test_prefill_and_greedy_decode_match_transformers(ckpt: Checkpoint) -> None:
    check_prefill_then_greedy_decode(ckpt, "cpu")


def test_packed_linears_match_transformers(ckpt: Checkpoint) -> None:
    """The executor's CPU model, its linears on the native panel matmul (biases, tied embeddings, every family)."""
    check_prefill_then_greedy_decode(ckpt, "cpu", packed=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_and_greedy_decode_match_transformers_on_cuda(ckpt: Checkpoint) -> None:
    check_prefill_then_greedy_decode(ckpt, "cuda")


def test_chunked_prefill_matches_single_prefill(ckpt: Checkpoint) -> None:
    model, _ = load_model(ckpt.path, torch.float32, "cpu")
    pages = shuffled_pages(1)
    whole = step(model, new_pool(model), [SeqInput(ckpt.prompt, 0, pages, LogitsMode.ALL)])
    kv = new_pool(model)
    chunks = []
    for start in range(0, PROMPT_LEN, 7):
        chunk = ckpt.prompt[start : start + 7]
        chunks.append(step(model, kv, [SeqInput(chunk, start, pages, LogitsMode.ALL)]))
    assert rel_err(torch.cat(chunks), whole) <= 1e-5


def test_mixed_batch_matches_each_sequence_alone(ckpt: Checkpoint) -> None:
    """Fresh prefill, two decodes of different lengths (padding) and a mid-prompt chunk in one step."""
    model, _ = load_model(ckpt.path, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (10, 16, 6, 19)]
    pages = shuffled_pages(2, 24)
    tables = [pages[0:3], pages[3:8], pages[8:11], pages[11:16]]
    history = [0, 15, 5, 7]  # tokens already cached before the mixed step
    modes = [LogitsMode.ALL, LogitsMode.LAST, LogitsMode.LAST, LogitsMode.ALL]
    seqs = [
        SeqInput(prompt[start:], start, table, mode)
        for prompt, start, table, mode in zip(prompts, history, tables, modes, strict=True)
    ]

    def fill_history(kv: KVPool) -> None:
        for prompt, start, table in zip(prompts, history, tables, strict=True):
            if start:
                step(model, kv, [SeqInput(prompt[:start], 0, table, LogitsMode.NONE)])

    kv_mixed, kv_alone = new_pool(model), new_pool(model)
    fill_history(kv_mixed)
    fill_history(kv_alone)
    mixed = step(model, kv_mixed, seqs)
    alone = [step(model, kv_alone, [seq]) for seq in seqs]
    assert mixed.shape[0] == sum(a.shape[0] for a in alone) == 10 + 1 + 1 + 12
    assert rel_err(mixed, torch.cat(alone)) <= 1e-5
    # And the batch is right, not merely self-consistent: check the mid-prompt chunk against HF.
    chunk_rows = mixed[-12:]
    assert rel_err(chunk_rows, reference_logits(ckpt, prompts[3])[7:]) <= 1e-4


def test_sharded_checkpoint_loads_and_matches(ckpt: Checkpoint, tmp_path: Path) -> None:
    ckpt.reference.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    ours = step(model, new_pool(model), [SeqInput(ckpt.prompt, 0, shuffled_pages(4), LogitsMode.ALL)])
    assert rel_err(ours, reference_logits(ckpt, ckpt.prompt)) <= 1e-4


def test_bfloat16_load_is_finite_and_close_to_float32(ckpt: Checkpoint) -> None:
    model16, _ = load_model(ckpt.path, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    kv = new_pool(model16, dtype=torch.bfloat16)
    pages = shuffled_pages(5)
    prefill = step(model16, kv, [SeqInput(ckpt.prompt, 0, pages, LogitsMode.LAST)])
    decode = step(model16, kv, [SeqInput([5], PROMPT_LEN, pages, LogitsMode.LAST)])
    ref = reference_logits(ckpt, [*ckpt.prompt, 5])
    for ours, want in ((prefill[0], ref[-2]), (decode[0], ref[-1])):
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
        assert rel_err(ours, want) <= 5e-2


def test_tied_embeddings_share_one_tensor(ckpt: Checkpoint) -> None:
    model, config = load_model(ckpt.path, torch.float32, "cpu")
    shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert shared == config.tie_word_embeddings == ckpt.reference.config.tie_word_embeddings


def test_logits_modes_give_rows_in_sequence_order(ckpt: Checkpoint) -> None:
    model, _ = load_model(ckpt.path, torch.float32, "cpu")
    a, b = ckpt.prompt[:9], ckpt.prompt[9:]
    pages = shuffled_pages(6, 11)
    seqs = [
        SeqInput(a, 0, pages[0:3], LogitsMode.LAST),
        SeqInput(b, 0, pages[3:7], LogitsMode.NONE),
        SeqInput(b, 0, pages[7:11], LogitsMode.ALL),
    ]
    batch = ForwardBatch.build(seqs, PAGE_SIZE, "cpu")
    assert batch.num_logits_rows == 1 + 0 + len(b)
    logits = model(batch, new_pool(model))
    assert rel_err(logits[0], reference_logits(ckpt, a)[-1]) <= 1e-4
    assert rel_err(logits[1:], reference_logits(ckpt, b)) <= 1e-4


def test_kv_pool_layout_and_size() -> None:
    pool = KVPool(3, 5, 4, 2, 8, torch.bfloat16, "cpu")
    assert pool.k(1).shape == pool.v(1).shape == (20, 2, 8)
    assert pool.nbytes == 5 * KVPool.bytes_per_page(3, 4, 2, 8, torch.bfloat16) == 3 * 2 * 20 * 2 * 8 * 2
    pool.k(1)[7].fill_(1.0)
    assert pool.k(1).sum() == 16 and pool.v(1).sum() == pool.k(0).sum() == pool.k(2).sum() == 0


def test_write_slots_follow_the_page_table() -> None:
    batch = ForwardBatch.build(
        [SeqInput([1, 2, 3], 3, [9, 2], LogitsMode.LAST), SeqInput([4], 0, [5], LogitsMode.NONE)], 4, "cpu"
    )
    # positions 3, 4, 5 -> page 9 slot 3, page 2 slots 0 and 1; position 0 -> page 5 slot 0.
    assert batch.write_slots.tolist() == [39, 8, 9, 20]
    assert batch.positions.tolist() == [3, 4, 5, 0]
    assert batch.logits_rows.tolist() == [2] and batch.num_logits_rows == 1


def test_short_page_table_is_rejected() -> None:
    seq = SeqInput(list(range(5)), 4, [0, 1], LogitsMode.LAST)
    with pytest.raises(ValueError, match=r"seq 0: page_table has 2 pages .* need 3 pages"):
        ForwardBatch.build([seq], PAGE_SIZE, "cpu")


def test_tree_run_gives_each_node_the_logits_of_its_own_path(ckpt: Checkpoint) -> None:
    """A draft tree verified in one run (positions by depth, ancestors-only mask over the paged context) gives
    every node the logits transformers computes for the chain context + path to that node. Fails if the tree mask,
    the depth positions or the windowed tree mask (qwen2, mistral) is removed: a node then sees its siblings or a
    wrong rotation, and its logits differ from the reference."""
    model, _ = load_model(ckpt.path, torch.float32, "cpu")
    kv = new_pool(model)
    pages = shuffled_pages(8, 12)
    context = ckpt.prompt[:15]
    step(model, kv, [SeqInput(context, 0, pages, LogitsMode.NONE)])
    # Root 0, two children (1, 2), a grandchild under each (3 under 2, 4 under 1), a great-grandchild (5 under 3).
    tokens = [11, 21, 22, 31, 32, 41]
    parents = (-1, 0, 0, 2, 1, 3)
    ours = step(model, kv, [SeqInput(tokens, len(context), pages, LogitsMode.ALL, tree_parents=parents)])
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        chain = [*context, *(tokens[j] for j in reversed(path))]
        assert rel_err(ours[node], reference_logits(ckpt, chain)[-1]) <= 1e-4, f"node {node}"
