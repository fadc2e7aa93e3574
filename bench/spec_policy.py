"""The "never slower" rule's own CPU per step: what planning a step's depth (SpecPolicy.batch_depth) and recording its
verifies (observe_request, once per request) cost the scheduler, by batch size.

The rule reads every request's acceptance record at every draft position on every step, so its cost grows with the
batch. It runs in the scheduler's loop, beside planning, commit and streaming (issue 14's budget: 3 ms of scheduler CPU
a step at 128 streams). From five decodes a batch's drafting is judged by measured steps (batch_verdict), which reads
no acceptance record; the model plans the rest (and a large batch before its first probe). Both are timed: ``plan
ms`` as the rule runs, ``model ms`` with the verdict off (every batch planned by the model, as before it). No services:
the policy alone, in process, after a seeded warm-up that fits its cost model and the verdict's costs (plain decoding
winning at every size, as at large batches) and gives every request five verifies. Best of five timings of 20 plans
each.

    .venv/bin/python bench/spec_policy.py [--batches 8 32 128 256] [--depth 6]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import SpecAlgorithm, SpeculativeConfig
from engine.scheduler.batch_verdict import PlannedBatch, VerdictConfig
from engine.scheduler.spec_policy import RequestSpec, SpecPolicy, SpecPolicyConfig

MODEL_ONLY = SpecPolicyConfig(verdict=VerdictConfig(from_requests=sys.maxsize))  # no batch judged by measure


def warmed(batch: int, depth: int, config: SpecPolicyConfig) -> tuple[SpecPolicy, list[RequestSpec]]:
    """A policy whose cost model (and the measured verdict) has seen 100 steps of this batch (plain ones, probes and
    explorations) and requests with five verifies each."""
    policy = SpecPolicy(SpeculativeConfig(SpecAlgorithm.DRAFT, num_steps=depth), config)
    rng = random.Random(7)
    reqs = [RequestSpec(length=100, fed=100, left=1000) for _ in range(batch)]  # drafts caught up: a probe is cheap
    for _ in range(100):
        chosen = policy.batch_depth(reqs)
        drafted = sum(1 for r in reqs if policy.request_depth(r, chosen))
        tokens = batch + chosen * drafted
        draft = (0.3 + 0.05 * chosen * drafted) * 1e-3 if drafted else 0.0
        seconds, planned = (2.0 + 0.5 * tokens) * 1e-3 + draft, PlannedBatch(batch, drafted, chosen)
        policy.observe_step(tokens, chosen, drafted, seconds, draft, policy.take_catch_up(), planned)
    for _ in range(5):
        for r in reqs:
            policy.observe_request(r, depth, rng.randint(0, depth))
        policy.tick()  # a step's verifies are in
    for r in reqs:
        r.length += 50  # 50 tokens decoded plainly since their drafts last read: the rule weighs their catch-up
    return policy, reqs


def best_ms(run: Callable[[], object], repeats: int = 20) -> float:
    """The fastest of five timings of ``repeats`` calls, in ms a call."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        best = min(best, (time.perf_counter() - started) / repeats * 1e3)
    return best


def _observe_all(policy: SpecPolicy, reqs: list[RequestSpec]) -> None:
    for req in reqs:
        policy.observe_request(req, 0, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--depth", type=int, default=6, help="the draft depth (--speculative-num-steps)")
    args = parser.parse_args()
    print(f"{'batch':>6} | {'plan ms':>8} {'verifies ms':>11} {'total ms/step':>13} | {'model ms':>8}")
    for batch in args.batches:
        policy, reqs = warmed(batch, args.depth, SpecPolicyConfig())
        plan = best_ms(partial(policy.batch_depth, reqs))
        verifies = best_ms(partial(_observe_all, policy, reqs))
        model, model_reqs = warmed(batch, args.depth, MODEL_ONLY)
        model_plan = best_ms(partial(model.batch_depth, model_reqs))
        print(f"{batch:>6} | {plan:8.3f} {verifies:11.3f} {plan + verifies:13.3f} | {model_plan:8.3f}", flush=True)


if __name__ == "__main__":
    main()
