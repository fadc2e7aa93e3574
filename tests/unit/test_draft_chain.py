"""The native greedy draft chain (engine/model/draft_chain.c) against the model's own torch forward.

Every Llama family the loader reads (Llama 3 rope scaling, Qwen2 biases and a sliding window, Qwen3 q/k norms, Mistral
with one kv head), with float32 weights and with bf16-valued ones (the kernel's half-width panels): a batch of rows
with different catch-up runs, positions, scattered pages and depths gives the tokens the torch forward's argmax gives
depth by depth, logits equal to rounding, and the same K/V in the pool. The proposer drafts the same chains natively
as with ``ORDINAL_NATIVE=0`` over several steps of accepted and rejected drafts (its catch-up bookkeeping). Rows that
would write outside their pages or read past the model are refused before anything is written.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from engine.executor.draft_model import DraftModelProposer
from engine.executor.proposer import DraftRequest
from engine.executor.sampler import SamplingState
from engine.grammar_calls import DraftTree
from engine.kv.pool import KVPool
from engine.model.draft_chain import ChainRow, DraftChain
from engine.model.forward_batch import ForwardBatch, LogitsMode, SeqInput
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.native import (
    DRAFT_CHAIN_INCLUDES,
    DRAFT_CHAIN_SOURCE,
    NATIVE_ENV,
    DraftChainKernel,
    Toolchain,
    build_library,
    draft_chain_kernel,
)
from engine.sampling_params import SamplingParams
from tests.support.models import single_thread  # noqa: F401  (an autouse fixture)

PAGE_SIZE = 4
NUM_PAGES = 64
VOCAB = 300
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,  # 2 * 96 = 192 gate|up columns: six panels; q|k|v 128: four
    "vocab_size": VOCAB,  # not a multiple of 32: the lm_head's last panel is padded
}
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama3": (
        LlamaConfig,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "qwen2": (
        Qwen2Config,
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3": (Qwen3Config, {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral": (MistralConfig, {"sliding_window": 8, "num_key_value_heads": 1}),
}

pytestmark = pytest.mark.skipif(draft_chain_kernel() is None, reason="the native draft chain kernel is not built")


def _checkpoint(path: Path, family: str, bf16_values: bool) -> Path:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(4321)
    hf = AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra}))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = 0.15 * torch.randn_like(param)  # big enough that a wrong rope, norm or bias shows in the argmax
            param.copy_(noise + 1.0 if "norm" in name else noise)
            if bf16_values:
                param.copy_(param.to(torch.bfloat16).float())
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[(f, b) for f in sorted(FAMILIES) for b in (False, True)], ids=str)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    family, bf16_values = request.param
    path = _checkpoint(tmp_path_factory.mktemp(family), family, bf16_values)
    loaded, _ = load_model(path, torch.float32, torch.device("cpu"))
    return loaded


def _pool(model: LlamaForCausalLM) -> KVPool:
    c = model.config
    return KVPool(c.num_layers, NUM_PAGES, PAGE_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu")


def _torch_chain(model: LlamaForCausalLM, kv: KVPool, row: ChainRow) -> tuple[list[int], torch.Tensor]:
    """The reference: the model's forward over the feed, then one forward per chosen token but the last."""
    seq = SeqInput(tuple(row.feed), row.start_pos, row.pages, LogitsMode.LAST)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for depth in range(row.depth):
        logits = model(ForwardBatch.build([seq], PAGE_SIZE, "cpu"), kv)[0, :VOCAB]  # [V]
        if depth < row.ban_depth:
            logits[list(row.banned)] = float("-inf")
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        seq = SeqInput((tokens[-1],), row.start_pos + len(row.feed) + depth, row.pages, LogitsMode.LAST)
    return tokens, torch.stack(rows)


def _prefill(model: LlamaForCausalLM, pools: list[KVPool], prompts: list[list[int]], tables: list[list[int]]) -> None:
    for kv in pools:
        seqs = [SeqInput(p, 0, t, LogitsMode.LAST) for p, t in zip(prompts, tables, strict=True)]
        model(ForwardBatch.build(seqs, PAGE_SIZE, "cpu"), kv)


def test_chains_match_the_torch_forward(model: LlamaForCausalLM) -> None:
    """Three rows in one call: catch-ups of 1, 3 and 6 tokens after prompts of 9, 14 and 5, depths 4, 1 and 5, pages
    scattered over the pool. Tokens equal, logits within 1e-4 of the largest, and the pool's K/V (every layer) equal
    to the torch path's to rounding; positions past the sliding windows (6 and 8) are reached. Fails if the kernel's
    rope, norms, biases, GQA grouping, window or pool writes differ from the model's."""
    chain = DraftChain.build(model, _pool(model), VOCAB)
    assert chain is not None
    kv_native = chain_pool = chain._kv  # the pool the chain was built over
    kv_torch = _pool(model)
    shuffled = random.Random(3).sample(range(NUM_PAGES), NUM_PAGES)
    tables = [shuffled[0:8], shuffled[8:16], shuffled[16:24]]
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 5)]
    _prefill(model, [kv_native, kv_torch], prompts, tables)
    rows = [
        ChainRow([rng.randrange(VOCAB) for _ in range(n)], len(p), t, depth)
        for p, t, n, depth in zip(prompts, tables, (1, 3, 6), (4, 1, 5), strict=True)
    ]
    result = chain.run(rows, keep_logits=True)
    assert result.logits is not None
    for b, row in enumerate(rows):
        tokens, logits = _torch_chain(model, kv_torch, row)
        assert result.tokens[b] == tokens
        scale = float(logits.abs().max())
        assert float((result.logits[b, : row.depth] - logits).abs().max()) <= 1e-4 * scale
    assert torch.allclose(chain_pool._buffer, kv_torch._buffer, atol=1e-5, rtol=1e-4)
    assert chain._bf16 == bool(torch.equal(model.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float()))


def test_a_chain_ends_after_its_first_token_the_draft_is_unsure_of(model: LlamaForCausalLM) -> None:
    """``min_prob``: three rows of depth 6 run once to their depth (the reference, with its logits), then with a bar
    among their tokens' probabilities: each row is the reference's first tokens, up to and including
    the first whose softmax probability is below the bar (some rows end early, some run to their depth); with a bar
    no token reaches, every chain is its first token alone (and the kernel stops after one forward). Fails if the
    kernel ignores ``min_prob``, ends a chain before its unsure token or after it, or checks the probability of
    another token than the chosen one."""
    chain = DraftChain.build(model, _pool(model), VOCAB)
    assert chain is not None
    tables = [list(range(b * 8, b * 8 + 8)) for b in range(3)]
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 5)]
    _prefill(model, [chain._kv], prompts, tables)
    rows = [ChainRow([rng.randrange(VOCAB)], len(p), t, 6) for p, t in zip(prompts, tables, strict=True)]
    full = chain.run(rows, keep_logits=True)
    assert full.logits is not None
    probs = full.logits.softmax(dim=-1).max(dim=-1).values  # [B, 6]: each chain token's probability
    # The bar: between the likeliest first token and the next probability below it, so one chain goes on past its
    # first token and some chain ends early; no token sits on it (the kernel's sums round otherwise than torch's).
    top = float(probs[:, 0].max())
    bar = (top + float(probs[probs < top].max())) / 2
    short = chain.run(rows, min_prob=bar)
    lengths = []
    for b, tokens in enumerate(full.tokens):
        unsure = [t for t in range(6) if float(probs[b, t]) < bar]
        lengths.append(unsure[0] + 1 if unsure else 6)
        assert short.tokens[b] == tokens[: lengths[-1]], b
    assert min(lengths) < 6 and max(lengths) > 1, lengths  # the case is not trivial
    assert chain.run(rows, min_prob=0.999).tokens == [tokens[:1] for tokens in full.tokens]


def test_a_chain_never_chooses_what_its_request_cannot_emit(model: LlamaForCausalLM) -> None:
    """``banned`` at the first ``ban_depth`` tokens (eos and stop ids short of min_new_tokens). Four rows of depth 5
    are run unbanned; then row 0 bans its own first and third tokens for two depths, one later row bans the token it
    chose at a depth k for the k - 1 depths before (a token it had not chosen before k: so nothing changes before k,
    and at k the ban has just run out), the others ban nothing. Each row equals the torch reference that sets those
    logits to -inf at those depths, tokens and logits; row 0's first token changed, the later row's chain did not.
    Fails if the kernel ignores the ban, applies it one depth too many (the later row's token at k changes) or too
    few, or to another row's chain."""
    chain = DraftChain.build(model, _pool(model), VOCAB)
    assert chain is not None
    kv_torch = _pool(model)
    tables = [list(range(b * 8, b * 8 + 8)) for b in range(4)]
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 5, 11)]
    _prefill(model, [chain._kv, kv_torch], prompts, tables)
    rows = [ChainRow([rng.randrange(VOCAB)], len(p), t, 5) for p, t in zip(prompts, tables, strict=True)]
    unbanned = chain.run(rows).tokens
    rows[0] = replace(rows[0], banned=(unbanned[0][0], unbanned[0][2]), ban_depth=2)
    # (row, depth index): a token the row chooses first at that depth (random models often repeat one token).
    later, k = next((b, k) for b in range(1, 4) for k in range(1, 5) if unbanned[b][k] not in unbanned[b][:k])
    rows[later] = replace(rows[later], banned=(unbanned[later][k],), ban_depth=k)
    result = chain.run(rows, keep_logits=True)
    assert result.logits is not None
    for b, row in enumerate(rows):
        tokens, logits = _torch_chain(model, kv_torch, row)
        assert result.tokens[b] == tokens, b
        finite = logits.isfinite()
        assert torch.equal(result.logits[b].isfinite(), finite), b
        scale = float(logits[finite].abs().max())
        assert float((result.logits[b][finite] - logits[finite]).abs().max()) <= 1e-4 * scale, b
    assert result.tokens[0][0] != unbanned[0][0] and unbanned[0][0] not in result.tokens[0][:2]
    assert result.tokens[1:] == unbanned[1:]


def test_rows_outside_their_pages_or_the_model_are_refused_before_anything_is_written(
    model: LlamaForCausalLM,
) -> None:
    """Each bad row, alone or after a good one, raises ValueError and leaves the pool as it was. Fails if a check is
    removed (the kernel would write outside the row's pages, or read past the rope tables or the vocabulary)."""
    kv = _pool(model)
    chain = DraftChain.build(model, kv, VOCAB)
    assert chain is not None
    good = ChainRow([1, 2], 4, [0, 1], 3)  # writes positions 4..6: pages 0 and 1
    max_pos = model.model.rotary_emb.max_positions
    bad = {
        "too few pages": ChainRow([1, 2], 4, [0], 3),
        "page outside the pool": ChainRow([1], 0, [NUM_PAGES], 1),
        "negative page": ChainRow([1], 0, [-1], 1),
        "depth 0": ChainRow([1], 0, [0], 0),
        "no feed": ChainRow([], 0, [0], 1),
        "past the positions": ChainRow([1], max_pos - 1, list(range(NUM_PAGES)), 2),
        "token outside the vocabulary": ChainRow([model.config.vocab_size], 0, [0], 1),
        "banned id outside the vocabulary": ChainRow([1], 0, [0], 1, banned=(VOCAB,), ban_depth=1),
    }
    before = kv._buffer.clone()
    for name, row in bad.items():
        for rows in ([row], [good, row]):
            with pytest.raises(ValueError, match="chain row"):
                chain.run(rows)
            assert torch.equal(kv._buffer, before), name
    with pytest.raises(ValueError, match="at least one row"):
        chain.run([])


# Per slot: (temperature, topk). Two greedy chains (the native chain), a greedy tree and a sampled chain (drafted a
# depth at a time: the native forward's logits, or torch's, chosen from in Python).
_KINDS = ((0.0, 1), (0.0, 1), (0.0, 2), (1.0, 1))


def _request(
    slot: int,
    tokens: list[int],
    depth: int,
    pages: range,
    temperature: float = 0.0,
    topk: int = 1,
    eos: frozenset[int] = frozenset(),
    banned_depths: int = 0,
) -> DraftRequest:
    """A request with one output so far; with ``banned_depths`` its min_new_tokens bans ``eos`` that many more."""
    params = SamplingParams(temperature=temperature, min_new_tokens=1 + banned_depths if banned_depths else 0)
    state = SamplingState(params, tuple(tokens[:-1]), eos, VOCAB, "cpu", 0)
    state.record(tokens[-1])
    nodes = depth * topk  # a tree: up to topk - 1 siblings beside each spine token
    return DraftRequest(slot, tokens, len(tokens) - 1, pages, nodes, depth, topk, state)


@pytest.mark.parametrize("min_prob", [0.0, 0.06], ids=["full-depth", "min-prob"])
def test_the_proposer_drafts_the_same_chains_natively_and_on_torch(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, min_prob: float
) -> None:
    """Two proposers over the same model, one native, one with ``ORDINAL_NATIVE=0``, drive two greedy chains, a
    greedy tree and a sampled chain (the last two drafted a depth at a time: siblings from the ranked row, a spine
    drawn from the draft's distribution, from native logits or torch's, never the native argmax) through eight steps
    in which a random prefix of each draft is accepted (so each catch-up feeds a different run: the accepted tokens,
    a correction, or a whole prompt the first time). Every step's drafts are equal, as are the pools' K/V, and so is
    every catch-up (start and length). Fails if the native path's bookkeeping of what the draft KV holds (``fed``)
    differs from the torch path's (without it each catch-up re-feeds the accepted drafts), if a depth-at-a-time
    forward's logits differ from torch's, or if the proposer sends a sampled request to the native argmax. With
    ``min_prob`` (about these random models' median token probability) every draft ends after its first spine token
    the draft gives less, natively or not (the tree's siblings at that depth drafted too): fails if either path ends
    its drafts elsewhere, or (the native path) keeps the wrong tokens of what the draft KV holds."""
    c = model.config
    draft_pages = NUM_PAGES // 4

    def proposer() -> DraftModelProposer:
        kv = KVPool(c.num_layers, NUM_PAGES, PAGE_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        return DraftModelProposer(model, kv, VOCAB, c.max_position_embeddings, min_prob=min_prob)

    native = proposer()
    monkeypatch.setenv(NATIVE_ENV, "0")
    plain = proposer()
    monkeypatch.delenv(NATIVE_ENV)
    assert native._chain is not None and plain._chain is None
    ended = 0  # drafts with fewer spine tokens than their depth
    fed: dict[str, list[tuple[int, int]]] = {"native": [], "plain": []}  # each catch-up's (start, length)
    for name, p in (("native", native), ("plain", plain)):
        catch_up = p._catch_up

        def spy(r: DraftRequest, catch_up: Any = catch_up, log: list[tuple[int, int]] = fed[name]) -> SeqInput:
            seq: SeqInput = catch_up(r)
            log.append((seq.start_pos, len(seq.token_ids)))
            return seq

        monkeypatch.setattr(p, "_catch_up", spy)
    rng = random.Random(11)
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    for step in range(8):
        depths = [rng.randint(1, 4) for _ in histories]
        requests = [
            _request(slot, h, d, range(slot * draft_pages, (slot + 1) * draft_pages), *_KINDS[slot])
            for slot, (h, d) in enumerate(zip(histories, depths, strict=True))
        ]
        drafts = native.propose(requests)
        assert [d.tree for d in drafts] == [d.tree for d in plain.propose(requests)], f"step {step}"
        ended += sum(_depth(d.tree) < r.max_depth for d, r in zip(drafts, requests, strict=True))
        for history, draft in zip(histories, drafts, strict=True):
            kept = rng.randint(0, len(draft.tree.tokens))
            history.extend([*draft.tree.tokens[:kept], rng.randrange(VOCAB)])  # accepted, then a new pending
    assert torch.allclose(native._kv._buffer, plain._kv._buffer, atol=1e-5, rtol=1e-4)
    assert fed["native"] == fed["plain"]  # the same catch-ups: only what the draft KV does not hold yet
    assert (ended > 0) == (min_prob > 0), ended


def test_no_draft_proposes_what_min_new_tokens_bans(model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests (two greedy chains, a greedy tree, a sampled chain) drafted five deep with nothing banned; then,
    on fresh proposers native and torch, the same requests short of their min_new_tokens by two tokens, with "eos"
    the tokens the unbanned drafts chose first. No draft holds a banned token at depths 1 and 2 (spines and siblings),
    the sampled chain's q gives them no mass there, every first token changed, and the native and torch drafts are
    equal. Fails if either path drafts without the ban (the verify would reject such a token and all after it), if
    the ban runs to the wrong depth on one path only, or if a sampled spine's q keeps mass on a banned token (the
    rejection rule would then be computed against a distribution the token was not drawn from)."""
    c = model.config
    draft_pages = NUM_PAGES // 4

    def proposer() -> DraftModelProposer:
        kv = KVPool(c.num_layers, NUM_PAGES, PAGE_SIZE, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        return DraftModelProposer(model, kv, VOCAB, c.max_position_embeddings)

    rng = random.Random(13)
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(4)]

    def requests(eos: frozenset[int] = frozenset(), banned_depths: int = 0) -> list[DraftRequest]:
        pages = [range(slot * draft_pages, (slot + 1) * draft_pages) for slot in range(4)]
        return [
            _request(slot, h, 5, pages[slot], *_KINDS[slot], eos=eos, banned_depths=banned_depths)
            for slot, h in enumerate(histories)
        ]

    free = proposer().propose(requests())
    eos = frozenset(d.tree.tokens[0] for d in free)
    native = proposer().propose(requests(eos, 2))
    monkeypatch.setenv(NATIVE_ENV, "0")
    plain = proposer().propose(requests(eos, 2))
    assert [d.tree for d in native] == [d.tree for d in plain]
    for before, after in zip(free, native, strict=True):
        depths = _depths(after.tree)
        assert not [t for t, d in zip(after.tree.tokens, depths, strict=True) if d <= 2 and t in eos], after.tree
        assert after.tree.tokens[0] != before.tree.tokens[0]
        assert max(depths) > 2  # the ban does not end the drafts: past depth 2 anything goes
    q = native[3].q
    assert q is not None
    spine_depths = _depths(native[3].tree)
    assert float(q[[n for n, d in enumerate(spine_depths) if d <= 2]][:, sorted(eos)].sum()) == 0.0


def _depths(tree: DraftTree) -> list[int]:
    depths: list[int] = []
    for parent in tree.parents:  # parents come before their children
        depths.append(1 + (depths[parent] if parent >= 0 else 0))
    return depths


def _depth(tree: DraftTree) -> int:
    return max(_depths(tree), default=0)


@pytest.mark.parametrize("changed", [path.name for path in DRAFT_CHAIN_INCLUDES])
def test_the_build_is_named_by_the_sources_it_includes_too(tmp_path: Path, changed: str) -> None:
    """draft_chain.c includes paged_decode.c (the attention) and panel_matmul.c (the matmuls): a change to an
    included file alone is a new build (another cached library), so a process never loads a chain compiled against
    an older attention or matmul. Fails if the includes are left out of the library's name."""
    toolchain = Toolchain.find()
    assert toolchain is not None  # the kernel was built (module skip above), so a compiler exists
    sources = tmp_path / "src"
    sources.mkdir()
    source = Path(shutil.copy(DRAFT_CHAIN_SOURCE, sources))
    included = tuple(Path(shutil.copy(path, sources)) for path in DRAFT_CHAIN_INCLUDES)
    first = build_library("draft_chain", source, toolchain, tmp_path / "cache", included)
    target = sources / changed
    target.write_text(target.read_text() + "\n/* a changed kernel */\n")
    second = build_library("draft_chain", source, toolchain, tmp_path / "cache", included)
    assert second != first and first.is_file() and second.is_file()
    DraftChainKernel.load(second)  # and it loads, its entry point declared


def test_catch_ups_past_the_native_budget_take_the_torch_forward(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six first drafts of 200-token prompts in one propose: the chain call takes five (its scratch is per catch-up
    token, capped at 1024 a call), the sixth is drafted a depth at a time, and the drafts equal a torch-only
    proposer's. Fails if the budget is removed (one native call of 1200 catch-up tokens)."""
    c = model.config

    def proposer() -> DraftModelProposer:
        kv = KVPool(c.num_layers, 128, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        return DraftModelProposer(model, kv, VOCAB, c.max_position_embeddings)

    native = proposer()
    monkeypatch.setenv(NATIVE_ENV, "0")
    plain = proposer()
    monkeypatch.delenv(NATIVE_ENV)
    chain = native._chain
    assert chain is not None
    calls: list[int] = []
    run = chain.run

    def spy(rows: list[ChainRow], keep_logits: bool = False, min_prob: float = 0.0) -> Any:
        calls.append(sum(len(row.feed) for row in rows))
        return run(rows, keep_logits, min_prob)

    monkeypatch.setattr(chain, "run", spy)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(6)]
    requests = [_request(slot, p, 4, range(slot * 16, (slot + 1) * 16)) for slot, p in enumerate(prompts)]
    assert [d.tree for d in native.propose(requests)] == [d.tree for d in plain.propose(requests)]
    assert calls == [5 * 200, 200, 1, 1, 1]


def test_threads_change_nothing_but_the_time(model: LlamaForCausalLM) -> None:
    """The same rows (a 150-token catch-up, big enough for the parallel matmuls, beside two short ones: parallel
    attention rows) with one thread and with two: the same tokens, logits and pool bit for bit, since each output
    is summed by one thread in one order whatever the count. Fails if a thread's share of the panels leaves one out
    (its columns keep what the scratch held)."""
    shuffled = random.Random(9).sample(range(NUM_PAGES), NUM_PAGES)
    rng = random.Random(4)
    rows = [
        ChainRow([rng.randrange(VOCAB) for _ in range(150)], 0, shuffled[0:40], 4),
        ChainRow([rng.randrange(VOCAB) for _ in range(3)], 0, shuffled[40:42], 3),
        ChainRow([rng.randrange(VOCAB) for _ in range(5)], 0, shuffled[42:45], 2),
    ]
    results, pools = [], []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            kv = _pool(model)
            chain = DraftChain.build(model, kv, VOCAB)
            assert chain is not None
            results.append(chain.run(rows, keep_logits=True))
            pools.append(kv._buffer)
    finally:
        torch.set_num_threads(before)
    one, two = results
    assert one.tokens == two.tokens
    assert one.logits is not None and two.logits is not None and torch.equal(one.logits, two.logits)
    assert torch.equal(pools[0], pools[1])
