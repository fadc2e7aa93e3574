"""Constrained decoding in the in-process engine on the embedded model (contracts C4, C6, C9, C13).

Real forward, sampler, scheduler and xgrammar matchers throughout. The only test double is a delegating grammar
backend: it forwards every call to the real :class:`LocalGrammar` and, in one test, answers the masks of one chosen
request with "everything allowed" (mask supply is not what that test is about; what the commit does with a token
the grammar refuses is).
"""

from __future__ import annotations

import json
import random
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause, FinishReason
from engine.grammar.backend import LocalGrammar
from engine.grammar.compiler import load_tokenizer_info
from engine.grammar.json_schema_compiler import DEFAULT_JSON_MAX_WHITESPACE
from engine.grammar.registry import FencedMasks
from engine.grammar_calls import MaskEntry, MaskRefusals, words_per_row
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.scheduler.request import RequestOutput
from tests.support.grammar_doubles import DelegatingGrammar

SCHEMAS: tuple[dict[str, object], ...] = (
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "string", "maxLength": 6},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
)
REGEXES: tuple[str, ...] = ("[a-z]{3}-[0-9]{2}", "(cat|dog|bird)")
MAX_NEW = 24
TIMEOUT_S = 60.0


class FencingGrammar(DelegatingGrammar[LocalGrammar]):
    """Also forwards ``start_masks``: the executor opens each step's fence in the registry before its forward and the
    commits fill it (the path of an engine on a plain LocalGrammar). Without it the executor fetches the masks with
    ``fill_masks_into`` on its fetch thread."""

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> FencedMasks:
        return self.inner.start_masks(entries, deadline_s, out, starts)


class AllowAllFor(DelegatingGrammar[LocalGrammar]):
    """Answers every mask of ``request_id`` with an all-allowed row instead of asking the grammar, so the sampler
    may pick a token that the real grammar then refuses at commit."""

    def __init__(self, inner: LocalGrammar, request_id: str) -> None:
        super().__init__(inner)
        self.request_id = request_id
        self.words = words_per_row(inner.registry.compiler.vocab_size)

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        mine = [i for i, e in enumerate(entries) if e.request_id == self.request_id]
        others = [i for i, e in enumerate(entries) if e.request_id != self.request_id]
        for i in mine:
            out[starts[i]] = -1  # [W]: every token allowed
        if not others:
            return {}
        refused = self.inner.fill_masks_into([entries[i] for i in others], deadline_s, out, [starts[i] for i in others])
        return {others[k]: refusal for k, refusal in refused.items()}


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    constraint: Constraint | None


@dataclass
class Stream:
    """Everything the engine sent for one request, in order."""

    outputs: list[RequestOutput] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def sink(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if out.finished:
            self.done.set()

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]

    @property
    def streamed_ids(self) -> list[int]:
        return [t for out in self.outputs for t in out.new_token_ids]


def _constraints() -> list[Constraint]:
    kinds = [Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(s)) for s in SCHEMAS]
    return kinds + [Constraint(ConstraintKind.REGEX, r) for r in REGEXES]


def _mixed_batch(vocab: int, ignore_eos: bool = False) -> list[Job]:
    """16 constrained (8 grammars, greedy and seeded) + 16 unconstrained requests, prompts of 4-40 tokens."""
    rng = random.Random(11)
    grammars = _constraints()
    jobs = []
    for i in range(32):
        prompt = tuple(rng.randrange(10, vocab) for _ in range(rng.randint(4, 40)))
        greedy = i % 2 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else 0.9, seed=None if greedy else 1000 + i, max_new_tokens=MAX_NEW
        )
        if ignore_eos and i < 16 and i % 4 == 1:
            params = replace(params, ignore_eos=True)  # only grammar termination can end these
        constraint = grammars[(i // 2) % len(grammars)] if i < 16 else None
        jobs.append(Job(f"job-{i}", prompt, params, constraint))
    return jobs


def _run(engine: Engine, jobs: Sequence[Job]) -> dict[str, Stream]:
    streams = {job.request_id: Stream() for job in jobs}
    for job in jobs:
        engine.submit(job.prompt, job.params, streams[job.request_id].sink, job.request_id, job.constraint)
    for rid, stream in streams.items():
        assert stream.done.wait(TIMEOUT_S), f"{rid} did not finish"
    _assert_drained(engine)
    return streams


def _assert_drained(engine: Engine) -> None:
    """C9: after the engine drains, matchers, KV pages, slots and executor buffers are back at their baseline."""
    assert engine.wait_idle(TIMEOUT_S)
    assert engine.grammar is not None and engine.grammar.num_open == 0
    s = engine.stats()
    assert s.free_pages + s.evictable_pages == s.total_pages, s
    assert s.reserved_pages == 0 and s.free_slots == s.total_slots and s.inflight_steps == 0, s
    assert isinstance(engine.runner, ModelRunner) and engine.runner.num_buffers == 0


def _summary(streams: dict[str, Stream]) -> dict[str, tuple[str, str | None, tuple[int, ...]]]:
    out = {}
    for rid, stream in streams.items():
        finish = stream.final.finish
        assert finish is not None and stream.final.output_ids is not None
        out[rid] = (finish.reason.value, finish.cause.value if finish.cause else None, stream.final.output_ids)
    return out


@pytest.fixture(scope="module")
def base_config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=1024, max_running=64, chunk_size=64)


@pytest.fixture(scope="module")
def local_grammar(embedded_model_dir: Path) -> Iterator[LocalGrammar]:
    grammar = LocalGrammar(str(embedded_model_dir))
    yield grammar
    grammar.shutdown()


@pytest.fixture(scope="module")
def engine(base_config: EngineConfig, local_grammar: LocalGrammar) -> Iterator[Engine]:
    with Engine(base_config, grammar=FencingGrammar(local_grammar)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine: Engine) -> dict[str, tuple[str, str | None, tuple[int, ...]]]:
    """The mixed batch on the default engine (overlap, grammar overlap): the outputs every variant must match."""
    got = _summary(_run(engine, _mixed_batch(engine.info.vocab_size)))
    constrained = [got[f"job-{i}"] for i in range(16)]
    assert all(cause is None for _, cause, _ in got.values()), got  # nothing aborted
    assert sum(reason == "stop" for reason, _, _ in constrained) >= 10  # most grammars complete within MAX_NEW
    return got


@pytest.mark.parametrize(
    ("change", "backend"),
    [
        ({"grammar_overlap": False}, FencingGrammar),
        ({"overlap": False}, FencingGrammar),
        ({"overlap": False, "grammar_overlap": False}, FencingGrammar),
        ({}, DelegatingGrammar),
    ],
    ids=["early-commit", "overlap-off", "both-off", "fetch-thread"],
)
def test_outputs_do_not_depend_on_overlap(
    base_config: EngineConfig, local_grammar: LocalGrammar, reference: dict, change: dict, backend: type
) -> None:
    """C4: overlapped constrained decoding (delayed sampling behind the fence), early commit and the plain loop
    give token-for-token the same outputs and finishes, for greedy and seeded requests, with or without grammar,
    whether the executor's fence is filled by the commits or waited on by its fetch thread (early commit always
    takes the fetch thread: a fence that cannot wait is computed while the forward runs)."""
    with Engine(replace(base_config, **change), grammar=backend(local_grammar)) as other:
        assert _summary(_run(other, _mixed_batch(other.info.vocab_size))) == reference


def test_a_failed_forward_closes_its_mask_fence(base_config: EngineConfig, local_grammar: LocalGrammar) -> None:
    """The executor opens a step's mask fence before the forward. When the forward raises, the runner closes the
    fence: the step's constrained requests end with an executor abort and the registry holds no fence afterwards.
    (Without ``pending.close()`` in ``ModelRunner.execute`` the failed step's fence stays registered, and every
    later commit polls it.)"""
    with Engine(base_config, grammar=FencingGrammar(local_grammar)) as failing:
        assert isinstance(failing.runner, ModelRunner)
        model = failing.runner._model

        def broken(*args: object) -> object:
            raise RuntimeError("injected forward failure")

        failing.runner._model = broken  # type: ignore[assignment]
        jobs = [job for job in _mixed_batch(failing.info.vocab_size) if job.constraint is not None][:4]
        streams = _run(failing, jobs)
        failing.runner._model = model
    assert all(s.final.finish is not None and s.final.finish.reason is FinishReason.ABORT for s in streams.values())
    assert not local_grammar.registry._fences and local_grammar.registry.num_waiting == 0


class FreshMatcher:
    """An xgrammar matcher built here from the constraint, independent of the engine's registry and compiler."""

    def __init__(self, compiler: xgr.GrammarCompiler, constraint: Constraint) -> None:
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            grammar = compiler.compile_json_schema(constraint.text, max_whitespace_cnt=DEFAULT_JSON_MAX_WHITESPACE)
        else:
            grammar = compiler.compile_regex(constraint.text)
        self.matcher = xgr.GrammarMatcher(grammar)

    def terminates_exactly_at_end(self, tokens: Sequence[int]) -> bool:
        """Every token is accepted, the grammar is not complete before the last one, and is after it."""
        for i, token in enumerate(tokens):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return False
            if self.matcher.is_terminated() != (i == len(tokens) - 1):
                return False
        return True


def test_nothing_after_termination_reaches_the_stream(engine: Engine, embedded_model_dir: Path) -> None:
    """C6: a constrained request that ends with "stop" streams exactly its final output ids, the last of which is the
    token that completed the grammar; its text is valid for the grammar. With ``ignore_eos`` only the grammar's
    termination can end a request, so the scheduler's own C6 path (not the stop checker) is exercised too."""
    jobs = _mixed_batch(engine.info.vocab_size, ignore_eos=True)[:16]
    streams = _run(engine, jobs)
    compiler = xgr.GrammarCompiler(load_tokenizer_info(embedded_model_dir))
    stopped = 0
    stopped_by_grammar_alone = []
    for job in jobs:
        stream = streams[job.request_id]
        finish, final_ids = stream.final.finish, stream.final.output_ids
        assert finish is not None and final_ids is not None and job.constraint is not None
        assert [o.finish is not None for o in stream.outputs] == [False] * (len(stream.outputs) - 1) + [True]
        assert stream.streamed_ids == list(final_ids)  # nothing streamed that the final output does not hold
        if finish.reason is not FinishReason.STOP:
            assert finish.reason is FinishReason.LENGTH and len(final_ids) == MAX_NEW
            continue
        stopped += 1
        stopped_by_grammar_alone.append(job.params.ignore_eos)
        assert finish.matched_token == final_ids[-1] and final_ids[-1] in engine.info.eos_token_ids
        assert FreshMatcher(compiler, job.constraint).terminates_exactly_at_end(final_ids)
        text = engine.tokenizer.decode(list(final_ids), skip_special_tokens=True)
        assert "".join(o.text_delta for o in stream.outputs) == text
        if job.constraint.kind is ConstraintKind.JSON_SCHEMA:
            jsonschema.validate(json.loads(text), json.loads(job.constraint.text))
        else:
            assert re.fullmatch(job.constraint.text, text), text
    assert stopped >= 10
    assert sum(stopped_by_grammar_alone) >= 3


def test_a_refused_token_aborts_only_its_request(
    base_config: EngineConfig, local_grammar: LocalGrammar, reference: dict
) -> None:
    """C13: the grammar refuses a committed token of one request (its masks were all-allowed, so the sampler picked
    freely): that request ends with an abort naming the grammar and keeps none of the refused token; the other 31
    finish exactly as in a normal run."""
    victim = "job-14"  # greedy, regex (cat|dog|bird)
    backend = AllowAllFor(local_grammar, victim)
    with Engine(base_config, grammar=backend) as other:
        streams = _run(other, _mixed_batch(other.info.vocab_size))
    got = _summary(streams)
    finish = streams[victim].final.finish
    assert finish is not None and finish.reason is FinishReason.ABORT and finish.cause is AbortCause.GRAMMAR
    assert finish.message is not None and "grammar refused token" in finish.message
    assert "(constraint: regex '(cat|dog|bird)')" in finish.message  # C13: the abort names the grammar
    assert streams[victim].streamed_ids == [] and streams[victim].final.output_ids == ()
    del got[victim]
    assert got == {rid: v for rid, v in reference.items() if rid != victim}


def test_no_matcher_left_open_after_aborts_and_bad_grammars(engine: Engine) -> None:
    """C9 for grammar state: aborts at random points of constrained requests (while compiling, before the first
    token, mid-decode, racing the finish) and an invalid constraint leave no matcher open once the engine drains."""
    rng = random.Random(5)
    vocab = engine.info.vocab_size
    long_object = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[-1]))  # whitespace keeps it going
    grammars = [*_constraints(), long_object, long_object]
    streams: dict[str, Stream] = {}
    for i in range(24):
        rid = f"abort-{i}"
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(4, 40))]
        after = rng.randrange(0, 12)  # abort once this many outputs were streamed (-> immediately below)
        stream = Stream()
        streams[rid] = stream

        def sink(out: RequestOutput, stream: Stream = stream, after: int = after) -> None:
            stream.sink(out)
            if len(stream.outputs) == after and not out.finished:
                engine.abort(out.request_id, "test abort")

        params = SamplingParams(temperature=0.8, seed=i, max_new_tokens=40)
        engine.submit(prompt, params, sink, rid, grammars[i % len(grammars)])
        if after == 0:
            engine.abort(rid, "test abort")  # while its grammar compiles, or just queued
    bad = Stream()
    engine.submit(
        [11, 12, 13], SamplingParams(max_new_tokens=4), bad.sink, "bad", Constraint(ConstraintKind.REGEX, "(")
    )
    for rid, stream in [*streams.items(), ("bad", bad)]:
        assert stream.done.wait(TIMEOUT_S), rid
    finish = bad.final.finish
    assert finish is not None and finish.cause is AbortCause.INVALID_GRAMMAR and bad.streamed_ids == []
    ends = [(s.final.finish.reason, len(s.streamed_ids)) for s in streams.values() if s.final.finish is not None]
    aborted_after = [n for reason, n in ends if reason is FinishReason.ABORT]
    assert 0 in aborted_after and max(aborted_after) > 0  # aborted before the first token and mid-decode
    assert len(aborted_after) < len(ends)  # and some finished before their abort point
    _assert_drained(engine)
    registry = engine.grammar.inner.registry if isinstance(engine.grammar, DelegatingGrammar) else None
    assert registry is not None and registry.num_waiting == 0


# The grammar leaves exactly one output for each (whitespace aside, which the bias below rules out): [1, 1], whose
# items are not unique, and [1, 2], whose are. uniqueItems is the checked keyword: xgrammar cannot enforce it.
FORCED_DUPLICATE = {
    "type": "array",
    "prefixItems": [{"const": 1}, {"const": 1}],
    "items": False,
    "minItems": 2,
    "uniqueItems": True,
}
FORCED_UNIQUE = {
    "type": "array",
    "prefixItems": [{"const": 1}, {"const": 2}],
    "items": False,
    "minItems": 2,
    "uniqueItems": True,
}


def test_checked_mode_aborts_a_violating_output_naming_the_keyword_and_stops_a_valid_one(
    engine: Engine, embedded_model_dir: Path
) -> None:
    """Checked JSON-schema mode (the default) end to end: an output that violates a checked keyword ends with an
    abort (cause GRAMMAR) whose message names keyword, place and value, and keeps nothing of the token that completed
    the offending value; an output that satisfies it ends with "stop" and validates; a plain request next to them
    finishes as usual. Fails if the output check is removed: the first output would end with "stop" on ``[1, 1]``."""
    info = load_tokenizer_info(embedded_model_dir)
    no_whitespace = SamplingParams.logit_bias_from(
        {i: -100.0 for i, piece in enumerate(info.decoded_vocab) if piece and not piece.strip()}
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=32, logit_bias=no_whitespace)
    prompt = tuple(engine.tokenizer.encode("Reply with JSON."))
    jobs = [
        Job("duplicate", prompt, params, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(FORCED_DUPLICATE))),
        Job("unique", prompt, params, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(FORCED_UNIQUE))),
        # ignore_eos: the trained model may end its answer within 8 tokens; this one runs to its length limit
        Job("plain", prompt, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True), None),
    ]
    streams = _run(engine, jobs)
    duplicate = streams["duplicate"].final
    assert duplicate.finish is not None and duplicate.finish.reason is FinishReason.ABORT
    assert duplicate.finish.cause is AbortCause.GRAMMAR and duplicate.finish.message is not None
    assert "the output violates uniqueItems at / of the JSON schema (checked on the output)" in duplicate.finish.message
    assert "[1, 1] has non-unique elements" in duplicate.finish.message
    kept = engine.tokenizer.decode(list(duplicate.output_ids or ()), skip_special_tokens=True)
    assert kept.replace(" ", "") == "[1,1"  # the "]" that completed the duplicate pair was refused
    unique = streams["unique"].final
    assert unique.finish is not None and unique.finish.reason is FinishReason.STOP
    text = engine.tokenizer.decode(list(unique.output_ids or ()), skip_special_tokens=True)
    jsonschema.validate(json.loads(text), FORCED_UNIQUE)
    plain = streams["plain"].final.finish
    assert plain is not None and plain.reason is FinishReason.LENGTH
