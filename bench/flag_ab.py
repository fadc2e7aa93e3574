"""One service flag A/B: the same four ways of serving with a flag's value A and value B, side by side in one run.

Four ways of serving, each twice (the service's flags ``--a`` and ``--b``), all eight stacks up at once and measured
in turn (bench/spec.py's rounds, which spread the machine's drift over every stack alike), the repeating prompts,
greedy:

    plain      no speculation
    grammar    constrained (bench/spec.py's regex), no speculation
    spec       n-gram speculation, overlapped
    delayed    constrained n-gram speculation, grammar overlap on

Printed per mode and concurrency: tokens per second with A and with B and their ratio B / A, the constrained modes'
time per step (bench/spec.py's StepShare, from the executor's GetState): its period (the run's wall time per
executor step), the step's own time on the executor (the period less it is the executor's idle gap, waiting for the
scheduler's next launch), of that the time before the forward, in it and, in the constrained modes, waiting for
masks past it; then the constrained
modes' share of their unconstrained twin (grammar / plain, delayed / spec: issue 16's >= 0.9 target) with each.
Each stack gets a grammar service, so every mode's processes are the same but for the flag.

    .venv/bin/python bench/flag_ab.py --service executor --a="--no-prefix-cache" --b="--chunk-size 256"
    .venv/bin/python bench/flag_ab.py --service grammar --a="--workers 1" --b="--workers 4"
        [--streams 1 32] [--max-new 96] [--rounds 3] [--min-requests 12]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import Cores
from bench.spec import Mode, Run, interleaved, mode_flags, prompts, requests
from engine.config import EngineConfig
from engine.model.folder import model_dir
from engine.model.tokenizer import Tokenizer

SHAPES = ("plain", "grammar", "spec", "delayed")


def _shapes(args: argparse.Namespace) -> dict[str, Mode]:
    plain = mode_flags(None, None, True, True, args)
    spec = mode_flags("ngram", None, True, True, args)
    return {
        "plain": Mode(plain),
        "grammar": Mode(plain, constrained=True),
        "spec": Mode(spec),
        "delayed": Mode([*spec, "--grammar-overlap", "on"], constrained=True),
    }


def _modes(args: argparse.Namespace) -> dict[str, Mode]:
    """Each shape with A and with B: the flag goes to the executor and scheduler (engine flags) or the grammar."""
    modes = {}
    for name, mode in _shapes(args).items():
        for side, flag in (("a", args.a), ("b", args.b)):
            extra = shlex.split(flag)
            if args.service == "grammar":
                modes[f"{name}@{side}"] = Mode(mode.flags, mode.constrained, tuple(extra))
            else:
                modes[f"{name}@{side}"] = Mode([*mode.flags, *extra], mode.constrained)
    return modes


Runs = dict[str, dict[tuple[str, int], Run]]


def _times(run: Run) -> str:
    return run.step.describe() if run.step is not None else ""


def _print(runs: Runs, workloads: list[tuple[str, int]], args: argparse.Namespace) -> None:
    print(f"A: {args.service} {args.a}\nB: {args.service} {args.b}")
    print(
        f"{'mode':>8} {'streams':>7} | {'A':>7} {'B':>7} tok/s | {'B/A':>6} | ms per step (A / B): period, on the "
        "executor, before its forward, drafting, forward, mask wait"
    )
    for key in workloads:
        for name in SHAPES:
            a, b = runs[f"{name}@a"][key], runs[f"{name}@b"][key]
            print(
                f"{name:>8} {key[1]:>7} | {a.tokens_per_s:7.0f} {b.tokens_per_s:7.0f}       | "
                f"{b.tokens_per_s / a.tokens_per_s:5.2f}x | {_times(a)} / {_times(b)}"
            )
    print(f"\n{'constrained / unconstrained (target >= 0.9)':>43} | {'A':>7} {'B':>7}")
    for key in workloads:
        for constrained, free in (("grammar", "plain"), ("delayed", "spec")):
            shares = [
                runs[f"{constrained}@{side}"][key].tokens_per_s / runs[f"{free}@{side}"][key].tokens_per_s
                for side in ("a", "b")
            ]
            label = f"{constrained}/{free} at {key[1]} streams"
            print(f"{label:>43} | {shares[0]:6.2f}x {shares[1]:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--service", choices=["executor", "grammar"], required=True, help="whose flag it is")
    parser.add_argument("--a", required=True, help="flag A, as on a command line")
    parser.add_argument("--b", required=True, help="flag B, as on a command line")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=12)
    args = parser.parse_args()
    args.steps, args.topk, args.draft_min_prob = 4, 1, None  # bench/spec.py's n-gram defaults
    cores = Cores.split()
    if cores is not None:
        os.sched_setaffinity(0, cores.rest)
    target = model_dir(EngineConfig())
    tokenizer = Tokenizer.from_dir(target)
    workloads = {
        ("repeating", streams): prompts(tokenizer, "repeating", requests(streams, args), args.max_new)
        for streams in args.streams
    }
    runs = interleaved(target, _modes(args), workloads, cores, args.rounds, grammar=True)
    print(cores.describe() if cores is not None else "no core pinning")
    _print(runs, list(workloads), args)


if __name__ == "__main__":
    main()
