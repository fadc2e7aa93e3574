"""Measuring the trained models: held-out loss, the draft's greedy agreement with the target, and sample answers.

    python -m training.evaluate --target engine/model/weights/ordinal-embedded-tiny.safetensors \\
        --draft engine/model/weights/ordinal-embedded-draft.safetensors

Held-out prompts are the corpus' held-out chat documents without their last assistant turn (rendered with the
generation prompt, tools included). On each, the target continues greedily (up to ``--new-tokens`` tokens, to its
end of turn); the draft then reads the same prompt and continuation once, and *agreement* is the share of
continuation positions where the draft's most likely next token is the target's. That is the acceptance rate
greedy speculative decoding would see token by token; ``tokens_per_verify`` replays a chain draft of
``--draft-len`` tokens along those agreements (accepted tokens plus the target's own token per verify step).
Everything runs in fp32 from the shipped bf16 files, as the engine serves them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.embedded import DRAFT_SPEC, EmbeddedSpec, write_embedded_configs
from engine.model.tokenizer import Tokenizer
from training.corpus import Corpus, CorpusConfig, words_of
from training.data import BatchConfig, DocumentTokens, held_out_batches
from training.train import THREADS, cross_entropy, load_model, next_token_logits

# The readable-answer prompts: the README's and ten more (tests/e2e/test_embedded_quality.py asks the same).
CHAT_PROMPTS = (
    "Hello!",
    "Hi",
    "Who are you?",
    "How are you today?",
    "What is the capital of France?",
    "What is 7 plus 5?",
    "Tell me a story about a fox.",
    "Give me three tips for sleeping well.",
    "Explain the water cycle.",
    "What do bees make?",
    "Write a Python function that reverses a string.",
)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    kind: str


def held_out_prompts(corpus: Corpus, limit: int) -> list[Prompt]:
    """Held-out chat documents up to their last assistant turn, rendered with the generation prompt."""
    prompts = []
    for doc in corpus.documents(corpus.config.held_out_indices):
        messages = list(doc.messages)
        if not messages or messages[-1]["role"] != "assistant":
            continue
        text = corpus.tokenizer.apply_chat_template(messages[:-1], tools=list(doc.tools) or None)
        prompts.append(Prompt(corpus.tokenizer.encode(text), doc.kind.value))
        if len(prompts) == limit:
            break
    return prompts


@torch.no_grad()
def greedy(model: Any, ids: list[int], new_tokens: int, stop: frozenset[int]) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=sorted(stop),
        pad_token_id=sorted(stop)[0],
    )
    generated = out[0, len(ids) :].tolist()
    return [int(t) for t in generated]


@torch.no_grad()
def agreements(draft: Any, prompt: list[int], continuation: list[int]) -> list[bool]:
    ids = torch.tensor([prompt + continuation])  # [1, P + C]
    logits = draft(input_ids=ids).logits[0]  # [P + C, V]
    guesses = logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)].argmax(dim=-1)  # [C]
    return [bool(g == t) for g, t in zip(guesses.tolist(), continuation, strict=True)]


def tokens_per_verify(agreed: Sequence[bool], draft_len: int) -> float:
    """Tokens gained per target forward by a greedy chain draft of ``draft_len`` along these agreements."""
    position, steps = 0, 0
    while position < len(agreed):
        accepted = 0
        while accepted < draft_len and position + accepted < len(agreed) and agreed[position + accepted]:
            accepted += 1
        position += accepted + 1  # the accepted tokens and the target's own next token
        steps += 1
    return len(agreed) / max(1, steps)


def held_out_ce(model: Any, tokens: DocumentTokens, batches: int) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in held_out_batches(tokens, BatchConfig(), batches):
            n = batch.num_tokens - batch.input_ids.shape[0]
            total += float(cross_entropy(next_token_logits(model, batch.input_ids), batch).item()) * n
            count += n
    return total / max(1, count)


def readable_share(answer: str, vocabulary: frozenset[str]) -> float:
    words = words_of(answer)
    return sum(word in vocabulary for word in words) / len(words) if words else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True, help="the target's safetensors")
    parser.add_argument("--draft", type=Path, help="the draft's safetensors (agreement is measured when given)")
    parser.add_argument("--prompts", type=int, default=200, help="held-out prompts for the agreement")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/train/eval"))
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)
    write_embedded_configs(args.work_dir / "target", EmbeddedSpec())
    tokenizer = Tokenizer.from_dir(args.work_dir / "target")
    corpus = Corpus(tokenizer, CorpusConfig())
    tokens = DocumentTokens(corpus)
    target = load_model(EmbeddedSpec(), args.work_dir / "target", args.target)
    stop = tokenizer.eos_token_ids
    report: dict[str, Any] = {"target_held_out_ce": held_out_ce(target, tokens, 4)}
    vocabulary = corpus.vocabulary()
    answers = {}
    for text in CHAT_PROMPTS:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        answer = tokenizer.decode(greedy(target, ids, 64, stop), skip_special_tokens=True)
        answers[text] = {"answer": answer, "corpus_words": round(readable_share(answer, vocabulary), 3)}
    report["chat"] = answers
    if args.draft is not None:
        write_embedded_configs(args.work_dir / "draft", DRAFT_SPEC)
        draft = load_model(DRAFT_SPEC, args.work_dir / "draft", args.draft)
        report["draft_held_out_ce"] = held_out_ce(draft, tokens, 4)
        agreed: list[bool] = []
        per_prompt_tpv = []
        for prompt in held_out_prompts(corpus, args.prompts):
            continuation = greedy(target, prompt.ids, args.new_tokens, stop)
            these = agreements(draft, prompt.ids, continuation)
            agreed += these
            per_prompt_tpv.append(tokens_per_verify(these, args.draft_len))
        report["agreement"] = {
            "prompts": len(per_prompt_tpv),
            "tokens": len(agreed),
            "greedy_agreement": round(sum(agreed) / max(1, len(agreed)), 4),
            f"tokens_per_verify_k{args.draft_len}": round(sum(per_prompt_tpv) / max(1, len(per_prompt_tpv)), 3),
        }
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
