"""Tuning the draft on the target's own continuations (self-distillation), after its corpus training.

    python -m training.self_distill --teacher engine/model/weights/ordinal-embedded-tiny.safetensors \\
        --base .cache/train/draft/model.safetensors --out .cache/train/draft-tune

(``scripts/train-embedded`` runs it after the draft's corpus training.) The corpus teaches the draft the corpus'
text, but serving asks it for the target's: past a document's end (a request that bans eos until its
min_new_tokens, or ignores eos) and on text the corpus never had, that is the target's own invention, which the
draft predicted far worse (on bench/spec.py's prompts 72% agreement against 94% on held-out chats). This stage
writes such text and trains on it, as EAGLE's and Medusa's drafts are trained on the target's responses rather than
the dataset's: prompts cut at random points of the training documents (half as rendered, half as raw text without
the chat markers), each continued greedily by the target for ``new_tokens`` tokens, every other generation batch
with eos banned to the end (as min_new_tokens bans it) and the others up to their first eos. The draft then
minimises the KL divergence from the target's next-token distribution over those sequences, plus the same over
corpus rows (``corpus_weight``) so that it keeps what it had.

One thread, greedy generation in fixed batches, batches that depend only on the step: the same command gives the
same sequences and losses, which tests/unit/test_training.py checks for the first steps against the committed log.
Writes into ``--out``: ``model.safetensors`` (bf16, the file that ships) and ``train_log.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.model.embedded import DRAFT_SPEC, EmbeddedSpec, file_sha256, write_embedded_configs
from engine.model.tokenizer import Tokenizer
from training.corpus import Corpus, CorpusConfig
from training.data import IGNORE_INDEX, BatchConfig, DocumentTokens, training_batches
from training.train import THREADS, environment, load_model

CHAT_MARKERS = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class TuneRecipe:
    """How the draft is tuned. AdamW at ``peak_lr`` decaying along a cosine to ``final_lr_ratio`` of it."""

    prompts: int = 4096
    prompt_tokens: int = 160  # at most: the tokens before a cut point
    cut_within: int = 256  # cut points lie within a document's first tokens
    new_tokens: int = 128
    generate_batch: int = 32
    steps: int = 1500
    batch_size: int = 16
    peak_lr: float = 1e-3
    final_lr_ratio: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    corpus_weight: float = 1.0
    corpus_batch: BatchConfig = field(default_factory=lambda: BatchConfig(seq_len=384, batch_size=8, order_seed=7))
    seed: int = 0
    corpus: CorpusConfig = field(default_factory=CorpusConfig)

    def lr_at(self, step: int) -> float:
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, self.steps))))
        return self.peak_lr * (self.final_lr_ratio + (1.0 - self.final_lr_ratio) * cosine)


RECIPE = TuneRecipe()


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    raw: bool  # cut from the document's text without its chat markers


def prompts(corpus: Corpus, tokens: DocumentTokens, recipe: TuneRecipe) -> list[Prompt]:
    """The recipe's prompts, in order: each a document's tokens up to a random cut (at most ``prompt_tokens``)."""
    rng = random.Random(f"ordinal-self-distill:{recipe.seed}")
    train = recipe.corpus.train_indices
    out = []
    for _ in range(recipe.prompts):
        index = rng.choice(train)
        raw = rng.random() < 0.5
        if raw:
            text = corpus.document(index).text
            for marker in CHAT_MARKERS:
                text = text.replace(marker, "")
            ids = corpus.tokenizer.encode(text)
        else:
            ids = tokens[index]
        cut = rng.randint(4, max(5, min(len(ids), recipe.cut_within)))
        out.append(Prompt(ids[max(0, cut - recipe.prompt_tokens) : cut], raw))
    return out


@torch.no_grad()
def continue_batch(
    target: Any, batch: Sequence[Prompt], new_tokens: int, eos: Sequence[int], ban: bool
) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation: ``new_tokens`` tokens with eos banned (``ban``), or
    up to and with its first eos."""
    width = max(len(p.ids) for p in batch)
    pad = eos[0]
    ids = torch.tensor([[pad] * (width - len(p.ids)) + p.ids for p in batch])  # [B, W], padded on the left
    mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in batch])  # [B, W]
    extra = {"min_new_tokens": new_tokens} if ban else {}
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=list(eos),
        **extra,
    )  # [B, W + new]
    sequences = []
    for p, generated in zip(batch, out[:, width:].tolist(), strict=True):
        ends = [i for i, t in enumerate(generated) if t in eos]
        kept = generated if ban or not ends else generated[: ends[0] + 1]
        sequences.append([*p.ids, *map(int, kept)])
    return sequences


def sequences(target: Any, ordered: Sequence[Prompt], recipe: TuneRecipe, eos: Sequence[int]) -> list[list[int]]:
    """Every prompt continued, in generation batches of ``generate_batch``; every other batch bans eos."""
    out: list[list[int]] = []
    for start in range(0, len(ordered), recipe.generate_batch):
        ban = (start // recipe.generate_batch) % 2 == 0
        out += continue_batch(target, ordered[start : start + recipe.generate_batch], recipe.new_tokens, eos, ban)
    return out


def step_batches(pool: Sequence[list[int]], recipe: TuneRecipe) -> Iterator[list[list[int]]]:
    """``batch_size`` sequences per step: the pool in generation order first, then in a seeded order per epoch."""
    epoch = 0
    while True:
        order = list(range(len(pool)))
        if epoch:
            random.Random(f"ordinal-self-distill-order:{recipe.seed}:{epoch}").shuffle(order)
        for start in range(0, len(order) - recipe.batch_size + 1, recipe.batch_size):
            yield [pool[i] for i in order[start : start + recipe.batch_size]]
        epoch += 1


def kl_from(teacher: Any, student: Any, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions at the positions ``keep`` [B, T-1]."""
    with torch.no_grad():
        t = teacher(input_ids=input_ids).logits[:, :-1][keep]  # [N, V]
    s = student(input_ids=input_ids).logits[:, :-1][keep]  # [N, V]
    return F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), log_target=True, reduction="batchmean")


def padded(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded on the right [B, T], and which positions predict a real token [B, T-1]."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[*r, *[pad] * (width - len(r))] for r in rows])  # [B, T]
    keep = torch.tensor([[i < len(r) - 1 for i in range(width - 1)] for r in rows])  # [B, T-1]
    return ids, keep


@dataclass
class TuneLog:
    recipe: dict[str, Any]
    environment: dict[str, Any]
    base_sha256: str
    teacher_sha256: str
    first_batch_sha256: str = ""  # the first generation batch's token ids (the test regenerates it)
    generated_tokens: int = 0
    generate_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    weights_sha256: str = ""


class Tuner:
    def __init__(self, recipe: TuneRecipe, out: Path, teacher: Path, base: Path) -> None:
        torch.set_num_threads(THREADS)
        torch.use_deterministic_algorithms(True)
        self.recipe, self.out = recipe, out
        write_embedded_configs(out / "teacher", EmbeddedSpec())
        write_embedded_configs(out / "model", DRAFT_SPEC)
        tokenizer = Tokenizer.from_dir(out / "model")
        self.corpus = Corpus(tokenizer, recipe.corpus)
        self.tokens = DocumentTokens(self.corpus)
        self.eos = sorted(tokenizer.eos_token_ids)
        self.teacher = load_model(EmbeddedSpec(), out / "teacher", teacher)
        self.model = load_model(DRAFT_SPEC, out / "model", base)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=recipe.peak_lr, betas=recipe.betas, weight_decay=0.0
        )
        raw = dataclasses.asdict(recipe)
        self.log = TuneLog(raw, environment(), file_sha256(base), file_sha256(teacher))

    def generate(self, limit: int | None = None) -> list[list[int]]:
        started = time.perf_counter()
        ordered = prompts(self.corpus, self.tokens, self.recipe)[:limit]
        pool = sequences(self.teacher, ordered, self.recipe, self.eos)
        self.log.first_batch_sha256 = batch_sha256(pool[: self.recipe.generate_batch])
        self.log.generated_tokens = sum(map(len, pool))
        self.log.generate_s = time.perf_counter() - started
        print(f"generated {len(pool)} sequences, {self.log.generated_tokens} tokens, {self.log.generate_s:.0f} s")
        return pool

    def run(self, pool: Sequence[list[int]], stop_after: int | None = None, print_every: int = 10) -> TuneLog:
        corpus_batches = training_batches(self.tokens, self.recipe.corpus_batch)
        last = self.recipe.steps if stop_after is None else min(stop_after, self.recipe.steps)
        started = time.perf_counter()
        for step, rows in zip(range(last), step_batches(pool, self.recipe), strict=False):
            for group in self.optimizer.param_groups:
                group["lr"] = self.recipe.lr_at(step)
            ids, keep = padded(rows, self.tokens.pad_id)
            loss = kl_from(self.teacher, self.model, ids, keep)
            if self.recipe.corpus_weight > 0:
                batch = next(corpus_batches)
                corpus_keep = batch.labels[:, 1:] != IGNORE_INDEX  # [B, T-1]
                loss = loss + self.recipe.corpus_weight * kl_from(
                    self.teacher, self.model, batch.input_ids, corpus_keep
                )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.grad_clip)
            self.optimizer.step()
            self.log.losses.append(float(loss.item()))
            self.log.wall_s = time.perf_counter() - started
            if (step + 1) % print_every == 0 or step + 1 == last:
                print(f"step {step + 1} loss {self.log.losses[-1]:.4f} {self.log.wall_s:.0f}s", flush=True)
        return self.log

    def save(self) -> Path:
        state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in self.model.state_dict().items()}
        path = self.out / "model.safetensors"
        save_file(state, str(path), metadata={"format": "pt"})
        self.log.weights_sha256 = file_sha256(path)
        (self.out / "train_log.json").write_text(json.dumps(dataclasses.asdict(self.log), indent=1) + "\n")
        return path


def batch_sha256(rows: Sequence[list[int]]) -> str:
    return hashlib.sha256(json.dumps([list(r) for r in rows]).encode("utf-8")).hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.self_distill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, required=True, help="the target's model.safetensors")
    parser.add_argument("--base", type=Path, required=True, help="the draft's corpus-trained model.safetensors")
    parser.add_argument("--out", type=Path, required=True, help="folder for the weights and the log")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (on the first prompts only)")
    parser.add_argument("--print-every", type=int, default=10)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tuner = Tuner(RECIPE, args.out, args.teacher, args.base)
    if args.stop_after is not None:
        # Only the sequences the first steps read: the first ones in generation order.
        needed = -(-args.stop_after * RECIPE.batch_size // RECIPE.generate_batch) * RECIPE.generate_batch
        log = tuner.run(tuner.generate(limit=needed), args.stop_after, args.print_every)
        print(json.dumps({"first_batch_sha256": log.first_batch_sha256, "losses": log.losses}))
        return 0
    log = tuner.run(tuner.generate(), None, args.print_every)
    path = tuner.save()
    print(f"wrote {path} (sha256 {log.weights_sha256}) after {log.generate_s + log.wall_s:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
