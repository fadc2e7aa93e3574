"""Training the embedded model (``target``) and its draft (``draft``) on the generated corpus, on CPU, reproducibly.

    python -m training.train target --out .cache/train/target
    python -m training.train draft --teacher .cache/train/target/model.safetensors --out .cache/train/draft

(``scripts/train-embedded`` runs both as the model card says.) The model is `transformers`' ``LlamaForCausalLM``
built from the embedded spec's config.json (:func:`engine.model.embedded.write_embedded_configs`), so the trained
state dict has the Hugging Face names the engine loads. One thread (``torch.set_num_threads(1)``), a seeded
initialisation, deterministic algorithms and batches that depend only on the step (:mod:`training.data`): the same
command gives the same losses step for step, which ``tests/unit/test_training.py`` checks for the first steps
against the committed log.

The target minimises next-token cross-entropy. The draft is distilled from the target: its loss mixes the
cross-entropy with the KL divergence from the target's next-token distribution (``distill_weight``), which is what
raises the share of tokens on which its greedy choice agrees with the target's.

Writes into ``--out``: ``model.safetensors`` (bf16, the file that ships), ``train_log.json`` (the recipe, versions,
every step's loss, held-out losses, wall time) and ``checkpoint.pt`` (for ``--resume`` after an interruption).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.model.embedded import DRAFT_SPEC, EmbeddedSpec, file_sha256, write_embedded_configs
from engine.model.tokenizer import Tokenizer
from training.corpus import Corpus, CorpusConfig
from training.data import IGNORE_INDEX, Batch, BatchConfig, DocumentTokens, held_out_batches, training_batches

THREADS = 1


class Role(enum.Enum):
    TARGET = "target"
    DRAFT = "draft"


@dataclass(frozen=True)
class Recipe:
    """How one model is trained. AdamW, linear warmup, cosine decay to ``final_lr_ratio`` of the peak."""

    role: Role
    steps: int
    peak_lr: float
    warmup_steps: int
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    init_seed: int = 0
    distill_weight: float = 0.0  # share of the KL-to-teacher term in the loss (the draft's), the rest is CE
    batch: BatchConfig = field(default_factory=BatchConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 100

    @property
    def spec(self) -> EmbeddedSpec:
        return EmbeddedSpec() if self.role is Role.TARGET else DRAFT_SPEC

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.peak_lr * (self.final_lr_ratio + (1.0 - self.final_lr_ratio) * cosine)


# The recipes that produced the shipped files (docs/embedded-model.md gives the draft's agreement). The draft's ran
# at 600 of its planned 2000 steps until 2026-12-07, when it was run as planned.
RECIPES = {
    Role.TARGET: Recipe(Role.TARGET, steps=2200, peak_lr=2e-3, warmup_steps=100),
    Role.DRAFT: Recipe(Role.DRAFT, steps=2000, peak_lr=3e-3, warmup_steps=100, distill_weight=0.8),
}


@dataclass
class TrainLog:
    """What a run records (train_log.json): enough to compare runs and to write the model card."""

    recipe: dict[str, Any]
    environment: dict[str, Any]
    losses: list[float] = field(default_factory=list)  # per step: the loss minimised
    cross_entropy: list[float] = field(default_factory=list)  # per step: next-token CE on the batch
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step", "held_out_ce"}
    tokens_seen: int = 0
    wall_s: float = 0.0
    corpus: dict[str, Any] = field(default_factory=dict)
    weights_sha256: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


def environment() -> dict[str, Any]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": THREADS,
        "machine": platform.machine(),
    }


def build_model(spec: EmbeddedSpec, config_dir: Path, seed: int) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` (fp32) of ``spec``'s shape, from its written config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(str(config_dir))
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()  # fp32, whatever dtype config.json records for the shipped file
    model.train()
    return model


def load_model(spec: EmbeddedSpec, config_dir: Path, weights: Path) -> Any:
    """``spec``'s model with the weights of a safetensors file (cast to fp32, as the engine serves them)."""
    model = build_model(spec, config_dir, seed=0)
    state = {name: tensor.to(torch.float32) for name, tensor in load_file(str(weights)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights}: missing {missing}, unexpected {unexpected}")
    model.eval()
    return model


def next_token_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits[:, :-1]  # [B, T-1, V]: position t predicts token t+1


def cross_entropy(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    targets = batch.labels[:, 1:]  # [B, T-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def distillation(student: torch.Tensor, teacher: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions over the positions the loss counts."""
    keep = (batch.labels[:, 1:] != IGNORE_INDEX).reshape(-1)  # [B*(T-1)]
    vocab = student.shape[-1]
    s = F.log_softmax(student.reshape(-1, vocab)[keep], dim=-1)  # [N, V]
    t = F.log_softmax(teacher.reshape(-1, vocab)[keep], dim=-1)  # [N, V]
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


class Trainer:
    """One training run of ``recipe`` in ``out`` (see the module docstring for what it writes)."""

    def __init__(self, recipe: Recipe, out: Path, teacher: Path | None = None) -> None:
        if (recipe.role is Role.DRAFT) != (teacher is not None):
            raise ValueError("the draft is trained with --teacher (the target's weights); the target without")
        torch.set_num_threads(THREADS)
        torch.use_deterministic_algorithms(True)
        self.recipe = recipe
        self.out = out
        self.config_dir = out / "model"
        write_embedded_configs(self.config_dir, recipe.spec)
        tokenizer = Tokenizer.from_dir(self.config_dir)
        self.corpus = Corpus(tokenizer, recipe.corpus)
        self.tokens = DocumentTokens(self.corpus)
        self.model = build_model(recipe.spec, self.config_dir, recipe.init_seed)
        self.teacher = None
        if teacher is not None:
            write_embedded_configs(out / "teacher", EmbeddedSpec())
            self.teacher = load_model(EmbeddedSpec(), out / "teacher", teacher)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=recipe.peak_lr,
            betas=recipe.betas,
        )
        self.log = TrainLog(recipe=_jsonable(recipe), environment=environment())
        self.step = 0

    def run(self, stop_after: int | None = None, resume: bool = False, print_every: int = 10) -> TrainLog:
        if resume:
            self._load_checkpoint()
        batches = training_batches(self.tokens, self.recipe.batch)
        for _ in range(self.step):  # the data order depends only on the step: skip what was trained
            next(batches)
        held_out = held_out_batches(self.tokens, self.recipe.batch, self.recipe.eval_batches)
        last = self.recipe.steps if stop_after is None else min(self.recipe.steps, stop_after)
        started = time.perf_counter() - self.log.wall_s
        while self.step < last:
            batch = next(batches)
            loss, ce = self._train_step(batch)
            self.log.losses.append(loss)
            self.log.cross_entropy.append(ce)
            self.log.tokens_seen += batch.num_tokens
            self.step += 1
            self.log.wall_s = time.perf_counter() - started
            if self.step % print_every == 0 or self.step == last:
                print(f"step {self.step} loss {loss:.4f} ce {ce:.4f} lr {self.recipe.lr_at(self.step - 1):.2e} "
                      f"{self.log.wall_s:.0f}s", flush=True)  # fmt: skip
            if self.step % self.recipe.eval_every == 0 or self.step == self.recipe.steps:
                self.log.evals.append({"step": self.step, "held_out_ce": self.evaluate(held_out)})
                print(f"step {self.step} held-out ce {self.log.evals[-1]['held_out_ce']:.4f}", flush=True)
            if self.step % self.recipe.checkpoint_every == 0 and stop_after is None:
                self._save_checkpoint()
        return self.log

    def _train_step(self, batch: Batch) -> tuple[float, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = self.recipe.lr_at(self.step)
        logits = next_token_logits(self.model, batch.input_ids)  # [B, T-1, V]
        ce = cross_entropy(logits, batch)
        loss = ce
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = next_token_logits(self.teacher, batch.input_ids)  # [B, T-1, V]
            kl = distillation(logits, teacher_logits, batch)
            weight = self.recipe.distill_weight
            loss = weight * kl + (1.0 - weight) * ce
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.grad_clip)
        self.optimizer.step()
        return float(loss.item()), float(ce.item())

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        self.model.eval()
        total, count = 0.0, 0
        for batch in batches:
            n = batch.num_tokens - batch.input_ids.shape[0]  # the first token of each row is never predicted
            total += float(cross_entropy(next_token_logits(self.model, batch.input_ids), batch).item()) * n
            count += n
        self.model.train()
        return total / max(1, count)

    def save(self) -> Path:
        """Write the shipped form of the weights (bf16 safetensors) and the log; returns the weights' path."""
        state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in self.model.state_dict().items()}
        path = self.out / "model.safetensors"
        save_file(state, str(path), metadata={"format": "pt"})
        self.log.weights_sha256 = file_sha256(path)
        (self.out / "train_log.json").write_text(self.log.to_json(), encoding="utf-8")
        return path

    def describe_corpus(self) -> None:
        data = self.corpus.text().encode("utf-8")
        train_tokens = sum(len(self.tokens[i]) for i in self.corpus.config.train_indices)
        self.log.corpus = {
            "documents": self.corpus.config.num_documents,
            "held_out_documents": self.corpus.config.held_out,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "train_tokens": train_tokens,
        }

    def _save_checkpoint(self) -> None:
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "log": dataclasses.asdict(self.log),
        }
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "checkpoint.pt")

    def _load_checkpoint(self) -> None:
        path = self.out / "checkpoint.pt"
        if not path.is_file():
            return
        state = torch.load(path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.log = TrainLog(**state["log"])
        print(f"resumed at step {self.step}", flush=True)


def _jsonable(recipe: Recipe) -> dict[str, Any]:
    raw = dataclasses.asdict(recipe)
    raw["role"] = recipe.role.value
    return raw


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=[role.value for role in Role])
    parser.add_argument("--out", type=Path, required=True, help="folder for the weights, the log and checkpoints")
    parser.add_argument("--teacher", type=Path, help="the target's model.safetensors (draft only)")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps (the schedule stays the recipe's)")
    parser.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument("--steps", type=int, help="a shorter schedule, for trying the recipe (not for shipping)")
    parser.add_argument("--peak-lr", type=float, help="another peak learning rate, for trying the recipe")
    args = parser.parse_args(argv)
    recipe = RECIPES[Role(args.role)]
    if args.steps is not None:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    if args.peak_lr is not None:
        recipe = dataclasses.replace(recipe, peak_lr=args.peak_lr)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(recipe, args.out, args.teacher)
    log = trainer.run(args.stop_after, args.resume, args.print_every)
    if args.stop_after is not None:
        print(json.dumps({"losses": log.losses}))
        return 0
    trainer.describe_corpus()
    path = trainer.save()
    print(f"wrote {path} (sha256 {trainer.log.weights_sha256}) after {log.wall_s:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
