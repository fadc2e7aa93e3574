"""Speculative decoding: tokens per second and acceptance length with and without it, side by side in one run.

For each proposer (the draft model, n-gram lookup), each kind of prompt (ones that repeat themselves, n-gram's home
ground, and ones that do not) and each concurrency (1, 8, 32 streams), the same greedy requests run through the
services as users run them (executor and scheduler processes, loopback gRPC, streams from this process), six ways:

    plain          no speculation, overlap on (the default serving mode): the baseline
    spec           speculation, overlap off (the scheduler commits step N before launching N+1)
    spec+overlap   speculation overlapped (the next verify's draft starts from the previous one's accepted tokens
                   on the executor before the scheduler has committed them)
    fixed          spec+overlap with the adaptive rule off (every decode drafts the full depth): what "never
                   slower" protects against
    again          plain once more, on a stack of its own (A/A: again / plain): how far two identical servers
                   measured in turn differ in this run, the resolution of every ratio in its row
    ov again       spec+overlap once more, on a stack of its own (ov A/A: ov again / spec+overlap): the adaptive
                   rule's choices follow its timings, so two identical stacks can take different paths (up to 4%
                   apart at 32 streams over 16 rounds). The ±2se beside ov/plain sees only the rounds of one stack.

The modes' stacks are all up at once and take turns: each workload is cut into ``--rounds`` segments and every
segment runs on every mode before the next (in a rotating order), so that the machine's drift (10% within minutes
on a shared machine) falls on every mode alike instead of on whichever ran last.

In a segment each stream sends ``--per-stream`` requests, one after another, as the clients of a serving benchmark
at a fixed concurrency do (SGLang's bench_serving --max-concurrency): a request that ends early frees its slot for
the stream's next. ``--per-stream 1`` makes every segment at 32 streams one synchronized batch of 32 that must
wait for its slowest request; speculation, whose requests end at different steps (a verify keeps 1.6 to 5.5 tokens
depending on the request), is at its worst there (docs/speculative.md, twenty-third session).

Printed: output tokens per second of wall time for each, the acceptance length (tokens per verify: accepted drafts
plus the sampled one), and the ratios spec+overlap / plain and spec+overlap / spec; beside spec+overlap / plain, two
standard errors of the mean of its per-round ratios (±2se). Each round's two halves ran in the same minute, so at 32
streams, where every round holds every prompt, this is how far the host's drift leaves the ratio uncertain. At one
stream a round is one request, and the spread is mostly the prompts' own (their acceptance differs). Targets (issue
15): >= 2x at one stream with the draft model, >= 1.0x at 32 streams (never slower), overlapped >= 1.1x non-overlapped.

Then, under grammar (issue 16), with a grammar service in every stack, the repeating prompts at 1 and 32 streams:

    spec           unconstrained speculation, overlapped (the reference)
    grammar        constrained, no speculation
    delayed        constrained speculation, grammar overlap on: each step's forward starts before its draft masks
                   exist and only the verify waits for them (C4)
    early          constrained speculation, grammar overlap off: the scheduler commits before each constrained step
    masked         (draft model only) delayed, the draft model drafting under the grammar (--speculative-draft-grammar
                   on: a fenced mask per draft depth): its tokens per second and acceptance length

The constraint is a regex that bans the characters `<`, `>` and `|`: every step needs a real mask (row 0 and every
draft node), the model's own continuation is allowed, so the ratio delayed / spec is the cost of the grammar work
alone (target >= 0.9) and delayed / early is what overlapping it buys (target >= 1.1). EOS is banned until max_new in
every row (min_new_tokens), so constrained and free requests write the same text but where it would hold a banned
character. Last, the mask work itself: a chain draft's masks traversed in process (xgrammar's traverse_draft_tree
over the compiled regex and a JSON schema), time per node p50 / p99. Under each constrained row, where a step's time
went in each mode (StepShare, from the executor's GetState): the wall time per executor step, the step's own time
on the executor, of it the time before the forward (and of that, drafting), in it, and waiting for masks past it.

    .venv/bin/python bench/spec.py [--streams 1 8 32] [--max-new 96] [--algorithms draft ngram] [--per-stream 4]
        [--target PATH] [--draft PATH] [--steps 4] [--topk 1] [--grammar-streams 1 32] [--no-grammar]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import grpc
import torch
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import Cores, Job, SpawnedStack, run_grpc, spawned_stack
from engine.config import DEFAULT_NUM_STEPS, EngineConfig, SpecAlgorithm
from engine.constraint import Constraint, ConstraintKind
from engine.executor.proposers import draft_dir
from engine.grammar import ConstraintCompiler
from engine.grammar.matcher import VersionedMatcher
from engine.grammar_calls import DraftTree
from engine.model.folder import model_dir
from engine.model.tokenizer import Tokenizer
from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc

# Prompts whose continuation repeats what they hold (lists, code, a passage to copy), and ones that do not.
_REPEATING = (
    "Copy this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, kiwis. "
    "apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, kiwis. apples, pears, plums,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\ndef",
    '{"name": "Ada", "city": "Paris"}\n{"name": "Bob", "city": "Rome"}\n{"name": "Cy", "city": "Oslo"}\n{"name":',
    "one two three four five one two three four five one two three four five one two three",
)
_PEOPLE = [("Ada", "Paris"), ("Bob", "Rome"), ("Cy", "Oslo"), ("Dee", "Lima"), ("Eve", "Kyiv")] * 4
GRAMMAR_REGEX = "[^<>|]*"  # bans three characters: a real mask every step, the model's text allowed
_TRAVERSAL_SCHEMA = (
    '{"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, '
    '"city": {"type": "string"}}, "required": ["name", "city"]}}'
)
_TRAVERSAL_JSON = "[" + ", ".join(f'{{"name": "{n}", "city": "{c}"}}' for n, c in _PEOPLE) + "]"
_FRESH = (
    "Tell me about the weather in the mountains in spring.",
    "Write a short note to a friend about a trip to the sea.",
    "What is the best way to learn to cook simple meals?",
    "Describe a quiet library on a rainy afternoon.",
)


@dataclass(frozen=True)
class Run:
    tokens_per_s: float
    accept_length: float
    step: StepShare | None = None  # where a step's time went
    per_round: tuple[float, ...] = ()  # tokens per second in each round (each segment of the workload)

    def resolution(self, base: Run) -> float:
        """Two standard errors of the mean of this run's per-round ratios to ``base`` (0: fewer than two rounds). Each
        ratio's two halves ran in the same minute of the host; where rounds hold different prompts (one stream: one
        request a round), the spread is also the prompts'."""
        ratios = [a / b for a, b in zip(self.per_round, base.per_round, strict=True) if b > 0]
        return 2 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0


@dataclass(frozen=True)
class StepShare:
    """Per executor step, in ms: the run's wall time (``period``; at one stream the step's own time plus the
    executor's idle gap before the next), the step's time on the executor (``busy``), and of it the time before
    the forward (``before``: the batch, the draft, asking for masks), in the forward, and waiting for masks past
    the forward (``mask_wait``, per constrained step)."""

    period: float
    busy: float
    before: float
    draft: float  # of ``before``, the proposer's
    forward: float
    mask_wait: float

    def describe(self) -> str:
        times = (self.period, self.busy, self.before, self.draft, self.forward, self.mask_wait)
        return " ".join(f"{t:5.2f}" for t in times)


@dataclass(frozen=True)
class _Counts:
    """Counters read before and after a segment; the difference is the segment's."""

    tokens: float = 0.0
    wall: float = 0.0
    verifies: float = 0.0  # the scheduler's
    accepted: float = 0.0
    steps: float = 0.0  # the executor's (GetState)
    busy: float = 0.0
    before: float = 0.0
    draft: float = 0.0
    forward: float = 0.0
    masked: float = 0.0
    mask_wait: float = 0.0

    def __add__(self, other: _Counts) -> _Counts:
        return _Counts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: _Counts) -> _Counts:
        return _Counts(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def run(self) -> Run:
        accept = (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0
        ms = 1e3 / self.steps
        wait = 1e3 * self.mask_wait / self.masked if self.masked else 0.0
        step = StepShare(self.wall * ms, self.busy * ms, self.before * ms, self.draft * ms, self.forward * ms, wait)
        return Run(self.tokens / self.wall, accept, step)


@dataclass(frozen=True)
class Row:
    algorithm: str
    prompts: str
    streams: int
    plain: Run
    spec: Run
    overlapped: Run
    fixed: Run
    again: Run  # plain once more, on a stack of its own: plain again / plain is this run's noise floor
    overlapped_again: Run  # spec+overlap once more, on a stack of its own: the adaptive rule's own A/A


def prompts(tokenizer: Tokenizer, kind: str, n: int, max_new: int) -> list[Job]:
    texts = _REPEATING if kind == "repeating" else _FRESH
    # EOS is banned until max_new (min_new_tokens): every request, constrained or not, writes max_new tokens of text.
    # ignore_eos alone would let free requests run on past EOS into chat-template tokens (which n-gram lookup predicts
    # well) while a grammar, which ignore_eos does not override (as in SGLang), ends a constrained one at its EOS.
    return [
        Job(tokenizer.encode(texts[i % len(texts)] + " " * (i % 3)), max_new, min_new_tokens=max_new) for i in range(n)
    ]


def _counts(stack: SpawnedStack) -> _Counts:
    """The scheduler's verify steps and accepted tokens; the executor's steps and where their time went."""
    with grpc.insecure_channel(stack.target) as channel:
        info = pb_grpc.SglangSchedulerStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    with grpc.insecure_channel(stack.executor) as channel:
        s = epb_grpc.ExecutorStub(channel).GetState(epb.StateRequest(), timeout=30)
    fields = info.scheduler_info.fields
    verifies, accepted = fields["spec_verify_steps"].number_value, fields["spec_accepted_tokens"].number_value
    timing = (s.busy_seconds, s.before_forward_seconds, s.draft_seconds, s.forward_seconds)
    masks = (s.masked_steps, s.mask_wait_seconds)
    return _Counts(0.0, 0.0, verifies, accepted, float(s.steps), *map(float, (*timing, *masks)))


@dataclass(frozen=True)
class Mode:
    """One way of serving the bench compares: the flags its stack starts with, and the jobs it runs."""

    flags: list[str]
    constrained: bool = False  # the jobs carry the grammar's regex
    grammar_flags: tuple[str, ...] = ()  # for the grammar service (in a constrained comparison)


def interleaved(
    target: Path,
    modes: dict[str, Mode],
    workloads: dict[tuple[str, int], list[Job]],
    cores: Cores | None,
    rounds: int,
    grammar: bool = False,
) -> dict[str, dict[tuple[str, int], Run]]:
    """Every workload on every mode, the modes' stacks all up at once (an idle stack costs nothing) and measured in
    turn: each workload is cut into ``rounds`` segments, and each segment runs on every mode before the next, in an
    order that rotates. The machine's speed drifts by 10% from one minute to the next; measured one mode after the
    other, that drift was all a ratio near 1.0 showed, measured in turn it falls on every mode alike.
    Per mode and workload: output tokens over wall time summed over the segments, the acceptance length, and each
    segment's tokens per second (``Run.resolution``)."""
    names = list(modes)
    with contextlib.ExitStack() as stacks:
        up = {
            name: stacks.enter_context(
                spawned_stack(target, mode.flags, grammar, cores, grammar_args=mode.grammar_flags)
            )
            for name, mode in modes.items()
        }
        runs: dict[str, dict[tuple[str, int], Run]] = {name: {} for name in names}
        for key, jobs in workloads.items():
            streams = key[1]
            segments: dict[str, list[_Counts]] = {name: [] for name in names}
            segment = -(-len(jobs) // rounds)
            for r in range(rounds):
                part = jobs[r * segment : (r + 1) * segment]
                if not part:
                    break
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    mode_jobs = [replace(j, regex=GRAMMAR_REGEX) for j in part] if modes[name].constrained else part
                    segments[name].append(_measure(up[name], mode_jobs, streams, warm=r == 0))
            for name in names:
                total = sum(segments[name], _Counts())
                per_round = tuple(c.tokens / c.wall for c in segments[name])
                runs[name][key] = replace(total.run(), per_round=per_round)
    return runs


def _measure(stack: SpawnedStack, jobs: list[Job], streams: int, warm: bool) -> _Counts:
    if warm:  # a warm-up batch, untimed and outside the counts
        asyncio.run(run_grpc(stack.target, streams, jobs[:streams], warm=False))
    before = _counts(stack)
    report = asyncio.run(run_grpc(stack.target, streams, jobs, warm=False))
    timed = _Counts(sum(t.tokens for t in report.timings), report.wall)
    return timed + (_counts(stack) - before)


def mode_flags(
    algorithm: str | None, draft: Path | None, overlap: bool, adaptive: bool, args: argparse.Namespace
) -> list[str]:
    flags = [
        "--num-pages",
        "8192",
        "--no-prefix-cache",
        "--max-running",
        str(max(args.streams)),
        "--log-level",
        "WARNING",
    ]
    if not overlap:
        flags.append("--no-overlap")
    if algorithm is not None:
        flags += ["--speculative-algorithm", algorithm]
        if args.steps:
            flags += ["--speculative-num-steps", str(args.steps)]
        flags += ["--speculative-eagle-topk", str(args.topk), "--speculative-adaptive", "on" if adaptive else "off"]
        if draft is not None:
            flags += ["--speculative-draft-model-path", str(draft)]
        if args.draft_min_prob is not None:
            flags += ["--speculative-draft-min-prob", str(args.draft_min_prob)]
    return flags


def bench(args: argparse.Namespace) -> list[Row]:
    target = model_dir(EngineConfig(model_path=args.target))
    tokenizer = Tokenizer.from_dir(target)
    workloads = {
        (kind, streams): prompts(tokenizer, kind, requests(streams, args), args.max_new)
        for kind in ("repeating", "fresh")
        for streams in args.streams
    }
    rows = []
    for algorithm in args.algorithms:
        draft = _draft(algorithm, args)
        modes = {
            "plain": Mode(mode_flags(None, None, True, True, args)),
            "spec": Mode(mode_flags(algorithm, draft, False, True, args)),
            "overlapped": Mode(mode_flags(algorithm, draft, True, True, args)),
            "fixed": Mode(mode_flags(algorithm, draft, True, False, args)),
            "again": Mode(mode_flags(None, None, True, True, args)),
            "overlapped_again": Mode(mode_flags(algorithm, draft, True, True, args)),
        }
        runs = interleaved(target, modes, workloads, args.cores, args.rounds)
        for key in workloads:
            rows.append(Row(algorithm, key[0], key[1], *(runs[name][key] for name in modes)))
            _print_row(rows[-1])
    return rows


@dataclass(frozen=True)
class GrammarRow:
    algorithm: str
    streams: int
    spec: Run
    grammar: Run
    delayed: Run
    early: Run
    masked: Run | None = None  # delayed, the draft model drafting under the grammar (--speculative-draft-grammar on)


def bench_grammar(args: argparse.Namespace, tokenizer: Tokenizer) -> list[GrammarRow]:
    """The constrained comparison (see the module docstring), every mode in a stack of its own."""
    target = model_dir(EngineConfig(model_path=args.target))
    free = {
        ("repeating", streams): prompts(tokenizer, "repeating", requests(streams, args), args.max_new)
        for streams in args.grammar_streams
    }
    rows = []
    for algorithm in args.algorithms:
        draft = _draft(algorithm, args)
        on = mode_flags(algorithm, draft, True, True, args)
        modes = {
            "spec": Mode(on),
            "grammar": Mode(mode_flags(None, None, True, True, args), constrained=True),
            "delayed": Mode([*on, "--grammar-overlap", "on"], constrained=True),
            "early": Mode([*on, "--grammar-overlap", "off"], constrained=True),
        }
        if algorithm == "draft":
            under = [*on, "--grammar-overlap", "on", "--speculative-draft-grammar", "on"]
            modes["masked"] = Mode(under, constrained=True)
        runs = interleaved(target, modes, free, args.cores, args.rounds, grammar=True)
        for key in free:
            row = GrammarRow(algorithm, key[1], *(runs[name][key] for name in ("spec", "grammar", "delayed", "early")))
            rows.append(replace(row, masked=runs["masked"][key] if "masked" in runs else None))
            _print_grammar_row(rows[-1])
    return rows


def requests(streams: int, args: argparse.Namespace) -> int:
    """Requests per workload: every round ``per_stream`` a stream at least, ``min_requests`` in all at least."""
    return max(streams * args.per_stream * args.rounds, args.min_requests)


def _draft(algorithm: str, args: argparse.Namespace) -> Path | None:
    if algorithm != "draft":
        return None
    return Path(args.draft) if args.draft else draft_dir(EngineConfig(model_path=args.target))


_GRAMMAR_HEADER = (
    f"{'proposer':>8} {'streams':>7} | {'spec':>7} {'grammar':>7} {'delayed':>7} {'early':>7} tok/s | "
    f"{'acc len':>7} {'early':>6} | {'delayed/spec':>12} {'delayed/early':>13} {'delayed/grammar':>15} | "
    f"{'masked':>7} {'acc len':>7}"
)


def _print_grammar_row(r: GrammarRow) -> None:
    print(
        f"{r.algorithm:>8} {r.streams:>7} | {r.spec.tokens_per_s:7.0f} {r.grammar.tokens_per_s:7.0f} "
        f"{r.delayed.tokens_per_s:7.0f} {r.early.tokens_per_s:7.0f}       | {r.delayed.accept_length:7.2f} "
        f"{r.early.accept_length:6.2f} | {r.delayed.tokens_per_s / r.spec.tokens_per_s:11.2f}x "
        f"{r.delayed.tokens_per_s / r.early.tokens_per_s:12.2f}x "
        f"{r.delayed.tokens_per_s / r.grammar.tokens_per_s:14.2f}x | "
        + (f"{r.masked.tokens_per_s:7.0f} {r.masked.accept_length:7.2f}" if r.masked is not None else f"{'-':>7}"),
        flush=True,
    )
    shares = {name: getattr(r, name).step for name in ("spec", "grammar", "delayed", "early")}
    print(
        f"{'':>16} ms per step (period, executor, before forward, of it drafting, forward, mask wait): "
        + " | ".join(f"{name} {share.describe()}" for name, share in shares.items() if share is not None),
        flush=True,
    )


@torch.no_grad()
def draft_ceiling(args: argparse.Namespace, tokenizer: Tokenizer) -> None:
    """What the draft model can give at best on the bench's prompts, whatever the engine's costs: the target's greedy
    continuation of each distinct prompt (EOS banned, as in the bench), the share of its positions where the draft's
    most likely next token is the target's (top-1; top-2 in brackets), and the tokens per verify a greedy chain of
    each depth gets replayed along those agreements (training/evaluate.py's replay). The fixed column above measures
    the last depth's in the engine. Then the deepest chain's tokens per verify over each quarter of the output: a
    request's acceptance moves along its output (on this bench it rises from about 2.7 tokens a verify over the first
    quarter to 5 or more later on the fresh prompts), so a rule that measures a batch at its start reads its weakest
    phase (docs/speculative.md, twentieth session)."""
    from transformers import AutoModelForCausalLM  # only here: the rest of the bench runs without it
    from transformers.utils import logging as hf_logging

    from training.evaluate import tokens_per_verify

    hf_logging.disable_progress_bar()
    target_dir, draft = model_dir(EngineConfig(model_path=args.target)), _draft("draft", args)
    assert draft is not None
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    drafter = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    depths = range(1, (args.steps or DEFAULT_NUM_STEPS[SpecAlgorithm.DRAFT]) + 1)
    print("\ndraft model's ceiling (top-1 agreement with the target's greedy text; tokens per verify of a chain):")
    for kind in ("repeating", "fresh"):
        jobs = prompts(tokenizer, kind, len(_REPEATING if kind == "repeating" else _FRESH) * 3, args.max_new)
        top1 = top2 = positions = 0
        tokens = dict.fromkeys(depths, 0.0)
        steps = dict.fromkeys(depths, 0.0)
        quarter_tokens, quarter_steps = [0] * 4, [0.0] * 4  # the deepest chain's, over each quarter of the output
        for job in jobs:
            ids = torch.tensor([job.prompt])  # [1, P]
            out = target.generate(ids, max_new_tokens=args.max_new, min_new_tokens=args.max_new, do_sample=False)
            text = out[0, ids.shape[1] :]  # [C]
            logits = drafter(input_ids=out).logits[0, ids.shape[1] - 1 : -1]  # [C, V]
            ranks = (logits > logits.gather(1, text[:, None])).sum(dim=-1)  # [C]: 0 = the draft's argmax
            agreed = (ranks == 0).tolist()
            top1, top2, positions = top1 + sum(agreed), top2 + int((ranks <= 1).sum()), positions + len(agreed)
            for d in depths:
                gained = tokens_per_verify(agreed, d)
                tokens[d] += len(agreed)
                steps[d] += len(agreed) / gained
            for q, part in enumerate(_quarters(agreed)):
                if part:
                    quarter_tokens[q] += len(part)
                    quarter_steps[q] += len(part) / tokens_per_verify(part, depths[-1])
        replay = " ".join(f"d{d} {tokens[d] / steps[d]:.2f}" for d in depths)
        print(f"  {kind:>9}: top-1 {top1 / positions:.0%} (top-2 {top2 / positions:.0%}); {replay}", flush=True)
        per_quarter = " ".join(f"{t / v:.2f}" for t, v in zip(quarter_tokens, quarter_steps, strict=True) if v)
        print(f"  {'':>9}  d{depths[-1]} by quarter of the output: {per_quarter}", flush=True)


def _quarters(agreed: list[bool]) -> list[list[bool]]:
    """``agreed`` cut into four consecutive parts of (nearly) equal length."""
    n = len(agreed)
    return [agreed[q * n // 4 : (q + 1) * n // 4] for q in range(4)]


def traversal_per_node(target: Path, tokenizer: Tokenizer, depth: int) -> None:
    """Time xgrammar's draft-tree traversal (what the grammar service runs per constrained entry and step) along a
    real output, a chain of ``depth`` draft tokens at each position; print the time per mask row p50 / p99."""
    compiler = ConstraintCompiler.from_model_dir(target)
    texts = {
        "regex": (Constraint(ConstraintKind.REGEX, GRAMMAR_REGEX), " ".join(_REPEATING)),
        "json_schema": (
            Constraint(ConstraintKind.JSON_SCHEMA, _TRAVERSAL_SCHEMA),
            _TRAVERSAL_JSON,
        ),
    }
    print(f"\ndraft mask traversal, chains of {depth} nodes ({depth + 1} rows), per row:")
    try:
        for name, (constraint, text) in texts.items():
            compiled = compiler.compile(constraint, 60.0)
            tokens = tokenizer.encode(text)
            matcher = VersionedMatcher(compiled)
            out = torch.empty((depth + 1, matcher.words_per_row), dtype=torch.int32)  # [R, W]
            per_row: list[float] = []
            for at in range(len(tokens) - depth):
                tree = DraftTree.chain(tokens[at : at + depth])
                started = time.perf_counter()
                matcher.fill_draft_masks(at, tree, out)
                per_row.append((time.perf_counter() - started) / tree.num_rows)
                matcher.commit(at, tokens[at : at + 1])
            qs = statistics.quantiles(per_row, n=100, method="inclusive")
            print(f"  {name:>11}: p50 {qs[49] * 1e6:6.1f} us, p99 {qs[98] * 1e6:6.1f} us over {len(per_row)} steps")
    finally:
        compiler.shutdown()


_HEADER = (
    f"{'proposer':>8} {'prompts':>9} {'streams':>7} | {'plain':>7} {'spec':>7} {'spec+ov':>7} {'fixed':>7} tok/s | "
    f"{'acc len':>7} {'fixed':>6} | {'ov/plain':>8} {'±2se':>5} {'ov/spec':>7} {'fixed/plain':>11} | {'A/A':>5} "
    f"{'ov A/A':>6}"
)


def _print_row(r: Row) -> None:
    print(
        f"{r.algorithm:>8} {r.prompts:>9} {r.streams:>7} | {r.plain.tokens_per_s:7.0f} {r.spec.tokens_per_s:7.0f} "
        f"{r.overlapped.tokens_per_s:7.0f} {r.fixed.tokens_per_s:7.0f}       | {r.overlapped.accept_length:7.2f} "
        f"{r.fixed.accept_length:6.2f} | {r.overlapped.tokens_per_s / r.plain.tokens_per_s:7.2f}x "
        f"{r.overlapped.resolution(r.plain):5.2f} "
        f"{r.overlapped.tokens_per_s / r.spec.tokens_per_s:6.2f}x {r.fixed.tokens_per_s / r.plain.tokens_per_s:10.2f}x "
        f"| {r.again.tokens_per_s / r.plain.tokens_per_s:4.2f}x "
        f"{r.overlapped_again.tokens_per_s / r.overlapped.tokens_per_s:5.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--algorithms", nargs="+", default=["draft", "ngram"], choices=["draft", "ngram"])
    parser.add_argument("--target", default=None, help="target checkpoint (default: the embedded model)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: the embedded draft)")
    parser.add_argument("--steps", type=int, default=0, help="--speculative-num-steps (default: the algorithm's)")
    parser.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk")
    parser.add_argument(
        "--draft-min-prob", type=float, default=None, help="--speculative-draft-min-prob (default: the engine's)"
    )
    parser.add_argument(
        "--rounds", type=int, default=8, help="segments of each workload, each run on every mode in turn"
    )
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument(
        "--per-stream", type=int, default=4, help="requests each stream sends in a round, one after another"
    )
    parser.add_argument("--grammar-streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--no-grammar", action="store_true", help="skip the constrained comparison")
    parser.add_argument("--only-grammar", action="store_true", help="only the constrained comparison")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave every process on every core (default: the executor on its own)"
    )
    args = parser.parse_args()
    args.cores = None if args.no_pin else Cores.split()
    if args.cores is not None:
        os.sched_setaffinity(0, args.cores.rest)  # before any thread of this process starts: they all inherit it
    print(f"target {args.target or 'embedded'}, draft {args.draft or 'embedded draft'}, greedy, {args.max_new} tokens")
    print(f"{args.rounds} rounds, {args.per_stream} requests a stream a round")
    print(args.cores.describe() if args.cores is not None else "no core pinning")
    if not args.only_grammar:
        print(_HEADER, flush=True)
        bench(args)
        if "draft" in args.algorithms:
            draft_ceiling(args, Tokenizer.from_dir(model_dir(EngineConfig(model_path=args.target))))
    if not args.no_grammar:
        target = model_dir(EngineConfig(model_path=args.target))
        tokenizer = Tokenizer.from_dir(target)
        print(f"\nunder grammar (regex {GRAMMAR_REGEX!r}), repeating prompts")
        print(_GRAMMAR_HEADER, flush=True)
        bench_grammar(args, tokenizer)
        traversal_per_node(target, tokenizer, args.steps or DEFAULT_NUM_STEPS[SpecAlgorithm.DRAFT])


if __name__ == "__main__":
    main()
