"""Constrained decoding through the split services: grammar service + executor + scheduler, real gRPC on loopback.

Each stack is three servers in this process on their own ports: the grammar service (``GrammarThread``), the
executor (``ExecutorThread`` over a ``ModelRunner`` whose mask fetcher is a ``RemoteGrammar``) and the scheduler
(``ThreadedServer`` over an ``Engine`` with a ``RemoteRunner`` and a ``RemoteGrammar``). Clients speak only the
public ``SglangScheduler`` API. Checked: outputs follow their grammar (a JSON schema's output validates with
``jsonschema``, a regex's matches it), grammar-overlap on and off give token-identical outputs for a mixed batch,
every matcher is released after drain, an invalid grammar is INVALID_ARGUMENT with xgrammar's reason before any
chunk, and a constrained row whose mask cannot be had ends that request alone (``SampledRun.error`` crosses the
executor protocol) while the other requests finish.

The public proto carries no seed: a request's sampling seed is the engine's per-submit counter. The on/off
comparison therefore submits its requests one at a time (each after the previous one streamed its first token), so
that both stacks give every request the same seed.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import xgrammar as xgr
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig, SpecAlgorithm, SpeculativeConfig
from engine.constraint import Constraint, ConstraintKind
from engine.executor.runner import ModelRunner
from engine.finish import AbortCause
from engine.grammar import CompilerConfig, ConstraintCompiler, load_tokenizer_info
from engine.grammar.json_schema_compiler import DEFAULT_JSON_MAX_WHITESPACE
from engine.grammar_calls import InvalidGrammarError
from engine.model.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from engine.step import SampledRun, StepEntry, StepPlan, StepResult, StepTiming
from protos import executor_pb2, executor_pb2_grpc
from services.executor import convert as executor_convert
from services.grammar_client import GrammarClient
from services.remote_runner import RemoteRunner
from tests.e2e.split import TIMEOUT, Stack, split_stack
from tests.e2e.stack import wait_for_idle_load
from tests.support.servers import ExecutorThread, GrammarThread, ThreadedServer

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)"
YES_NO = 'root ::= "yes" | "no" | "maybe"'


@pytest.fixture(scope="module")
def config(embedded_model_dir: Path) -> EngineConfig:
    return EngineConfig(model_path=str(embedded_model_dir), page_size=8, num_pages=512, max_running=40, chunk_size=64)


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


@contextmanager
def grammar_service(model_dir: str) -> Iterator[str]:
    compiler = ConstraintCompiler.from_model_dir(model_dir, CompilerConfig(workers=2))
    server = GrammarThread(compiler)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop()
        compiler.shutdown()


@pytest.fixture(scope="module")
def grammar(config: EngineConfig) -> Iterator[str]:
    with grammar_service(str(config.model_path)) as target:
        yield target


@pytest.fixture(scope="module")
def stack(config: EngineConfig, grammar: str) -> Iterator[Stack]:
    with split_stack(config, grammar) as running:
        yield running


# ---------------------------------------------------------------------------------------------------- helpers


def request(
    ids: list[int],
    *,
    rid: str = "",
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    stream: bool = False,
    n: int = 1,
    **constraint: str,
) -> pb.GenerateRequest:
    params = pb.SamplingParams(
        temperature=temperature,
        top_p=1.0,
        top_k=-1,
        repetition_penalty=1.0,
        n=n,
        max_new_tokens=max_new_tokens,
        **constraint,
    )
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=params, stream=stream
    )


def completes(stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest) -> list[pb.GenerateComplete]:
    """Every Complete of the RPC (one per sample), by index; chunks must add up to each Complete's output."""
    streamed: dict[int, list[int]] = {}
    done: dict[int, pb.GenerateComplete] = {}
    for reply in stub.Generate(req, timeout=TIMEOUT):
        if reply.HasField("chunk"):
            streamed.setdefault(reply.chunk.index, []).extend(reply.chunk.token_ids)
        else:
            done[reply.complete.index] = reply.complete
    if req.stream:
        assert {i: list(c.output_ids) for i, c in done.items()} == streamed
    return [done[i] for i in sorted(done)]


async def aio_completes(stub: pb_grpc.SglangSchedulerStub, req: pb.GenerateRequest) -> list[pb.GenerateComplete]:
    """:func:`completes` on a grpc.aio stub."""
    done: dict[int, pb.GenerateComplete] = {}
    async for reply in stub.Generate(req, timeout=TIMEOUT):
        if reply.HasField("complete"):
            done[reply.complete.index] = reply.complete
    return [done[i] for i in sorted(done)]


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def text_of(tokenizer: Tokenizer, complete: pb.GenerateComplete) -> str:
    return tokenizer.decode(list(complete.output_ids), skip_special_tokens=True)


def grammar_open(target: str) -> int:
    with GrammarClient(target) as client:
        return client.get_state().num_open


def assert_drained(stack: Stack) -> None:
    """Nothing running or holding KV, no executor buffer, and every grammar released (C9 baseline)."""
    wait_for_idle_load(stack.stub, TIMEOUT)
    assert stack.engine.wait_idle(TIMEOUT)
    assert grammar_open(stack.grammar) == 0


# ---------------------------------------------------------------------------------------------------- outputs


def test_json_schema_outputs_validate(stack: Stack, tokenizer: Tokenizer) -> None:
    """Sampled at temperature 1: a schema with bounded sizes lets any model (even a random one) reach the grammar's end,
    so every sample finishes with "stop" and must then be valid JSON for the schema."""
    ids = chat_ids(tokenizer, "The weather, as JSON.")
    for stream in (False, True):
        req = request(ids, max_new_tokens=400, n=4, stream=stream, json_schema=json.dumps(WEATHER))
        done = completes(stack.stub, req)
        assert [c.finish_reason for c in done] == ["stop"] * 4, done
        for complete in done:
            jsonschema.validate(json.loads(text_of(tokenizer, complete)), WEATHER)
            assert complete.matched_token_id in tokenizer.eos_token_ids  # the grammar's end is an end token
    assert_drained(stack)


def executor_state(stack: Stack) -> executor_pb2.ExecutorState:
    with grpc.insecure_channel(stack.executor) as channel:
        return executor_pb2_grpc.ExecutorStub(channel).GetState(executor_pb2.StateRequest(), timeout=TIMEOUT)


def test_regex_and_ebnf_outputs_match(stack: Stack, tokenizer: Tokenizer) -> None:
    """The outputs match their grammar; and the executor counts the steps that waited for masks, and how long
    (GetState: a step with a constrained row is a masked step, one without is not), within its steps' time."""
    ids = chat_ids(tokenizer, "An address, please.")
    assert stack.engine.wait_idle(TIMEOUT)
    before = executor_state(stack)
    for complete in completes(stack.stub, request(ids, max_new_tokens=64, n=3, regex=EMAIL)):
        assert complete.finish_reason == "stop" and re.fullmatch(EMAIL, text_of(tokenizer, complete)), complete
    for complete in completes(stack.stub, request(ids, max_new_tokens=16, n=3, ebnf_grammar=YES_NO)):
        assert complete.finish_reason == "stop" and text_of(tokenizer, complete) in {"yes", "no", "maybe"}
    assert stack.engine.wait_idle(TIMEOUT)  # an overlapped step of a finished request may still be answered
    masked = executor_state(stack)
    assert 0 < masked.masked_steps - before.masked_steps <= masked.steps - before.steps
    assert masked.mask_wait_seconds >= before.mask_wait_seconds
    completes(stack.stub, request(ids, max_new_tokens=8))
    assert stack.engine.wait_idle(TIMEOUT)
    free = executor_state(stack)
    assert free.steps > masked.steps and free.masked_steps == masked.masked_steps
    # Each step's phases nest in its time on the executor: before the forward, the forward, the wait for masks.
    assert free.busy_seconds >= free.before_forward_seconds + free.forward_seconds + free.mask_wait_seconds > 0
    assert_drained(stack)


def test_server_info_names_the_grammar_service(stack: Stack) -> None:
    info = stack.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    args = dict(info.server_args.items())
    assert (args["grammar_backend"], args["grammar"]) == ("xgrammar", stack.grammar)


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
        ("json_schema", '{"type": "strin"}'),
        ("regex", "(ab"),
        ("ebnf_grammar", "root ::= undefined_rule"),
    ],
)
def test_invalid_grammar_is_invalid_argument_with_xgrammars_reason(
    stack: Stack, config: EngineConfig, field: str, text: str
) -> None:
    reason = xgrammar_refusal(config, field, text)
    before = stack.engine.stats()
    with pytest.raises(grpc.RpcError) as err:
        # stream=True: the refusal must come before any chunk (no forward ever runs for it).
        list(stack.stub.Generate(request([5, 6, 7], stream=True, n=2, **{field: text}), timeout=TIMEOUT))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
    details = err.value.details() or ""
    assert details.startswith(f"sampling_params.{field}: invalid grammar: ") and reason in details, details
    after = stack.engine.stats()
    assert (after.steps, after.prefill_tokens) == (before.steps, before.prefill_tokens)
    assert grammar_open(stack.grammar) == 0


def xgrammar_refusal(config: EngineConfig, field: str, text: str) -> str:
    """xgrammar's own reason for refusing ``text``, from a compiler of our own (not the service's)."""
    compiler = ConstraintCompiler(load_tokenizer_info(str(config.model_path)), CompilerConfig(workers=1))
    try:
        compiler.compile(Constraint.from_public_field(field, text), TIMEOUT)
    except InvalidGrammarError as exc:
        return exc.reason
    finally:
        compiler.shutdown()
    raise AssertionError(f"xgrammar compiled {text!r}")


def test_empty_grammar_names_the_field(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(request([5, 6, 7], regex=""), timeout=TIMEOUT))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("sampling_params.regex: ")


# ---------------------------------------------------------------------------------------------------- checked mode

# The grammar leaves exactly one output, [1, 1] (whitespace aside, which the bias rules out), whose items are not
# unique: uniqueItems is the keyword xgrammar cannot enforce, so checked mode checks it on the output.
DUPLICATE_PAIR = {
    "type": "array",
    "prefixItems": [{"const": 1}, {"const": 1}],
    "items": False,
    "minItems": 2,
    "uniqueItems": True,
}


def no_whitespace(tokenizer: Tokenizer) -> dict[str, float]:
    """A logit bias that rules out every whitespace-only token (the public API keys token ids as strings)."""
    pieces = {i: tokenizer.decode([i]) for i in range(tokenizer.vocab_size)}
    return {str(i): -100.0 for i, piece in pieces.items() if piece and not piece.strip()}


def test_checked_violation_crosses_the_grammar_service_and_the_mode_is_chosen_per_request(
    stack: Stack, tokenizer: Tokenizer
) -> None:
    """Checked mode (the service's default) through the grammar service: the violation comes back in the commit's
    result over gRPC and the engine ends the request with an abort naming keyword, place and value; the public API
    answers finish_reason "abort". ``custom_params {"json_schema_mode": ...}`` chooses the mode per request: strict
    refuses the schema (INVALID_ARGUMENT naming the keyword and checked mode as the way out), loose lets the invalid
    output stop (SGLang's behaviour), an unknown mode is refused naming the field."""
    ids = chat_ids(tokenizer, "Two ones, as JSON.")
    bias = no_whitespace(tokenizer)
    schema = json.dumps(DUPLICATE_PAIR)
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=16,
        logit_bias=SamplingParams.logit_bias_from({int(k): v for k, v in bias.items()}),
    )
    (out,) = stack.engine.generate_batch([ids], [params], TIMEOUT, [Constraint(ConstraintKind.JSON_SCHEMA, schema)])
    assert out.finish is not None and out.finish.cause is AbortCause.GRAMMAR and out.finish.message is not None
    assert "violates uniqueItems at / of the JSON schema (checked on the output)" in out.finish.message

    def ask(mode: str | None) -> pb.GenerateRequest:
        req = request(ids, temperature=0.0, max_new_tokens=16, json_schema=schema)
        req.sampling_params.logit_bias.update(bias)
        if mode is not None:
            req.sampling_params.custom_params.update({"json_schema_mode": mode})
        return req

    assert [c.finish_reason for c in completes(stack.stub, ask(None))] == ["abort"]
    assert [c.finish_reason for c in completes(stack.stub, ask("checked"))] == ["abort"]
    (loose,) = completes(stack.stub, ask("loose"))
    assert loose.finish_reason == "stop" and json.loads(text_of(tokenizer, loose)) == [1, 1]
    for mode, expected in (
        ("strict", "uniqueItems at /"),
        ("lenient", "sampling_params.custom_params.json_schema_mode"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            completes(stack.stub, ask(mode))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and expected in (err.value.details() or "")
    assert "choose checked mode" in (err.value.details() or "") or mode == "lenient"
    assert_drained(stack)


# ---------------------------------------------------------------------------------------------------- overlap


def mixed_batch(tokenizer: Tokenizer) -> list[pb.GenerateRequest]:
    """16 constrained (JSON schemas, regex, EBNF) and 16 unconstrained requests, greedy and sampled, interleaved."""
    rng = random.Random(11)
    constraints: list[dict[str, str]] = [
        {"json_schema": json.dumps(WEATHER)},
        {"json_schema": json.dumps(ANSWER)},
        {"json_schema": '{"type": "object"}'},
        {"regex": EMAIL},
        {"ebnf_grammar": YES_NO},
        {"json_schema": json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 3})},
    ]
    requests = []
    for i in range(32):
        words = " ".join(
            rng.choice(["json", "cat", "tool", "weather", "list", "yes"]) for _ in range(rng.randint(1, 9))
        )
        ids = chat_ids(tokenizer, words)
        temperature = 0.0 if i % 4 < 2 else 0.8
        constraint = constraints[(i // 2) % len(constraints)] if i % 2 == 0 else {}
        requests.append(
            request(ids, rid=f"r{i}", max_new_tokens=24 + i % 7 * 6, temperature=temperature, stream=True, **constraint)
        )
    return requests


async def run_in_submit_order(target: str, requests: list[pb.GenerateRequest]) -> list[Any]:
    """Run every request concurrently on one grpc.aio channel, but submit request k+1 only after request k
    streamed its first message."""
    results: list[Any] = [None] * len(requests)

    async def run(stub: pb_grpc.SglangSchedulerStub, i: int, first: asyncio.Event) -> None:
        streamed: list[int] = []
        try:
            async for reply in stub.Generate(requests[i], timeout=TIMEOUT):
                first.set()
                if reply.HasField("chunk"):
                    streamed.extend(reply.chunk.token_ids)
                else:
                    results[i] = (reply.complete.finish_reason, list(reply.complete.output_ids), streamed)
        except grpc.aio.AioRpcError as exc:
            results[i] = exc
        finally:
            first.set()

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        tasks = []
        for i in range(len(requests)):
            first = asyncio.Event()
            tasks.append(asyncio.create_task(run(stub, i, first)))
            await asyncio.wait_for(first.wait(), TIMEOUT)
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    return results


@pytest.mark.asyncio
async def test_grammar_overlap_on_and_off_give_identical_outputs(
    config: EngineConfig, grammar: str, tokenizer: Tokenizer
) -> None:
    """C4: delayed sampling behind the fence (on) and early commit with no fence wait (off) are the same tokens, and
    so are delayed sampling's with the executor's masks carried by a mask relay process (``--grammar-mask-relay``).

    Each mode runs on a fresh executor and scheduler (the seed counter starts at 0 in both) against the same
    grammar service, which must hold no matcher once each batch drained."""
    requests = mixed_batch(tokenizer)
    outputs = {}
    for mode, relay in ((True, False), (False, False), (True, True)):
        with split_stack(replace(config, grammar_overlap=mode), grammar, relay=relay) as stack:
            outputs[mode, relay] = await run_in_submit_order(stack.target, requests)
            assert_drained(stack)
    on, off = outputs[True, False], outputs[False, False]
    assert outputs[True, True] == on, "the relayed masks gave other tokens"
    assert all(isinstance(r, tuple) and r[0] in ("stop", "length") for r in on), on
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a == b, f"request {i} ({requests[i].sampling_params.WhichOneof('constraint')}): {a} != {b}"
        assert a[1] == a[2], "the chunks carry exactly the Complete's tokens"
    constrained = [r for req, r in zip(requests, on, strict=True) if req.sampling_params.WhichOneof("constraint")]
    # Both ends are compared: constrained requests that reach their grammar's end, and ones cut by the length limit.
    assert {r[0] for r in constrained} == {"stop", "length"}, constrained
    for req, (finish, out_ids, _) in zip(requests, on, strict=True):
        field = req.sampling_params.WhichOneof("constraint")
        if field is not None:
            assert grammar_accepts(config, field, getattr(req.sampling_params, field), out_ids, finish == "stop")


@pytest.mark.asyncio
async def test_the_draft_model_drafting_under_the_grammar_over_grpc_gives_the_grammar_alone_output(
    config: EngineConfig, grammar: str, tokenizer: Tokenizer
) -> None:
    """``--speculative-draft-grammar on`` through the split services: the executor's draft model (the target as its
    own draft) gets a fenced mask per draft depth from the grammar service over gRPC, in delayed-verify mode (the
    first depth waits at the fence for the scheduler's commit, which comes over another connection). The mixed
    batch finishes; its greedy requests give the tokens of the grammar alone, the sampled ones (rejection rule
    against a masked q) follow their grammar; every matcher is released. Drafting under the grammar with the target
    as draft, every draft token is kept (the masked draft is the masked target). Fails if the option does not reach
    the executor's draft model (unmasked, the self-draft proposes tokens the grammar refuses: 466 of 651 kept on
    this batch), if the draft's fence wait blocked the commit it waits for (the batch times out), or if a draft
    mask call committed (the grammar would refuse the verified tokens and abort requests)."""
    requests = mixed_batch(tokenizer)
    spec = SpeculativeConfig(
        SpecAlgorithm.DRAFT,
        draft_model_path=config.model_path,
        num_steps=3,
        adaptive=False,
        draft_grammar=True,
        draft_min_prob=0,  # every depth drafted: the unmasked mutant's refused tokens show at every depth
    )
    outputs = {}
    for label, speculative in (("plain", SpeculativeConfig()), ("spec", spec)):
        with split_stack(replace(config, speculative=speculative), grammar) as stack:
            outputs[label] = await run_in_submit_order(stack.target, requests)
            assert_drained(stack)
            counts = stack.engine.stats().spec
    greedy = [i for i, r in enumerate(requests) if r.sampling_params.temperature == 0.0]
    assert [outputs["spec"][i] for i in greedy] == [outputs["plain"][i] for i in greedy]
    assert all(isinstance(r, tuple) and r[0] in ("stop", "length") for r in outputs["spec"]), outputs["spec"]
    for req, (finish, out_ids, _) in zip(requests, outputs["spec"], strict=True):
        field = req.sampling_params.WhichOneof("constraint")
        if field is not None:
            assert grammar_accepts(config, field, getattr(req.sampling_params, field), out_ids, finish == "stop")
    assert counts.draft_tokens > 0 and counts.accepted_tokens == counts.draft_tokens


def grammar_accepts(config: EngineConfig, field: str, text: str, ids: list[int], terminated: bool) -> bool:
    """A fresh xgrammar matcher accepts ``ids`` token by token (and is then terminated when the output stopped)."""
    info = load_tokenizer_info(str(config.model_path))
    compiler = xgr.GrammarCompiler(info)
    kind = Constraint.from_public_field(field, text).kind
    if kind is ConstraintKind.JSON_SCHEMA:
        compiled = compiler.compile_json_schema(text, max_whitespace_cnt=DEFAULT_JSON_MAX_WHITESPACE)
    elif kind is ConstraintKind.REGEX:
        compiled = compiler.compile_regex(text)
    else:
        compiled = compiler.compile_grammar(text)
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated() == terminated


# ---------------------------------------------------------------------------------------------------- failures


@pytest.mark.asyncio
async def test_missing_mask_ends_only_that_request(config: EngineConfig, grammar: str, tokenizer: Tokenizer) -> None:
    """The executor asks another grammar service, where the request's grammar is not open: its mask is refused
    (UNKNOWN), the row comes back with ``SampledRun.error`` over the executor protocol, and the scheduler ends
    that request alone with a grammar abort ("abort" Complete). An unconstrained request running beside it, on
    the same channel, finishes."""
    with grammar_service(str(config.model_path)) as other, split_stack(config, grammar, executor_grammar=other) as s:
        ids = chat_ids(tokenizer, "JSON please")
        async with grpc.aio.insecure_channel(s.target) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            free, constrained = await asyncio.gather(
                aio_completes(stub, request(ids, max_new_tokens=40, temperature=0.0)),
                aio_completes(stub, request(ids, max_new_tokens=40, json_schema=json.dumps(WEATHER))),
            )
        (done,) = constrained
        assert done.finish_reason == "abort" and not done.output_ids, done
        # It ends normally: at the model's end of turn (the embedded model is trained) or at its 40 tokens.
        assert [c.finish_reason for c in free] in (["stop"], ["length"]), free
        assert 0 < len(free[0].output_ids) <= 40
        # The public proto has no place for the reason; the engine's finish shows it is the executor's refusal.
        (out,) = s.engine.generate_batch(
            [ids], [SamplingParams(max_new_tokens=8)], TIMEOUT, [Constraint(ConstraintKind.REGEX, EMAIL)]
        )
        assert out.finish is not None and out.finish.cause is AbortCause.GRAMMAR, out.finish
        assert "grammar mask refused (unknown)" in (out.finish.message or ""), out.finish
        assert_drained(s)


def test_constraint_without_a_grammar_service_is_unimplemented(config: EngineConfig, grammar: str) -> None:
    """A scheduler on a remote executor and no grammar service cannot constrain: it says so, nothing runs."""
    runner = ModelRunner.load(config)
    executor = ExecutorThread(runner)
    target = f"127.0.0.1:{executor.port}"
    engine = Engine(config, RemoteRunner.connect(target, timeout=TIMEOUT))
    try:
        with (
            ThreadedServer(engine, executor=target) as server,
            grpc.insecure_channel(f"127.0.0.1:{server.start()}") as channel,
        ):
            stub = pb_grpc.SglangSchedulerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request([5, 6], regex="a+"), timeout=TIMEOUT))
            assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
            assert "--grammar" in (err.value.details() or "")
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
            assert dict(info.server_args.items())["grammar_backend"] == "none"
    finally:
        engine.shutdown()
        executor.stop()
        runner.shutdown()


# ---------------------------------------------------------------------------------------------------- protocol


def test_constrained_and_error_cross_the_executor_protocol() -> None:
    entry = StepEntry("a", 1, 3, input_ref=True, new_pages=(0, 1), constrained=True)
    plan = StepPlan(5, (entry, replace(entry, request_id="b", constrained=False)))
    wire = executor_pb2.StepPlan.FromString(executor_convert.plan_to_proto(plan).SerializeToString())
    assert executor_convert.plan_from_proto(wire) == plan
    runs = (SampledRun("a", 4, (), error="grammar mask refused (unknown): a"), SampledRun("b", 4, (9,)))
    result = StepResult(5, runs, StepTiming(0.001, 0.002, 0.5, 0.6, 0.4, masks_ready=0.55))
    wire_result = executor_pb2.StepResult.FromString(executor_convert.result_to_proto(result).SerializeToString())
    assert executor_convert.result_from_proto(wire_result) == result
    assert not executor_pb2.RunExtra().HasField("error")  # unset is not "": presence carries it
    assert not executor_pb2.StepTiming().HasField("masks_started")
    assert not executor_pb2.StepTiming().HasField("masks_ready")
