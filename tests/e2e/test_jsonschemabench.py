"""150 real-world JSON schemas (JSONSchemaBench, ``../shared/jsonschemabench``) through the split services.

One grammar service, one executor (masks from the grammar service) and one engine driving them over gRPC: every
schema is submitted at once (seeded sampling, temperature 0.7, up to 256 new tokens) so the batch runs together.

Each schema either compiles, or is refused: the grammar service answers Open with INVALID_ARGUMENT and the engine
ends the request with an INVALID_GRAMMAR finish carrying the reason (the JSON-schema policy's, naming the keywords
xgrammar would not enforce, or xgrammar's own); every refused schema is also sent through the scheduler's public gRPC
API, which must answer INVALID_ARGUMENT with the same reason. Then:

- an output that finishes with "stop" is JSON that validates with ``jsonschema`` (the draft its ``$schema`` names,
  else 2020-12): no exception, since the policy (engine/grammar/schema/) rewrites or refuses whatever xgrammar
  would enforce loosely;
- an output cut by the length limit is accepted token by token by a fresh matcher of the compiled schema;
- no request ends with the grammar refusing a token at commit (C13): that happened only where xgrammar's mask
  allowed a token its own matcher refused (Github_hard--o79409, a class of ~500 Unicode ranges repeated {1,200}),
  and the policy now writes such counts in chunks that xgrammar handles consistently.

The counts are printed (always); the reason of each refused schema with ``-s``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import xgrammar as xgr
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.grammar import CompilerConfig, ConstraintCompiler, JsonSchemaPolicy, load_tokenizer_info
from engine.grammar.constraint import Constraint, ConstraintKind
from engine.model.tokenizer import Tokenizer
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stop import AbortCause, FinishReason
from services.grammar.server import GrammarThread
from services.grammar_client import GrammarClient
from tests.e2e.split import Stack, split_stack

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO.parent / "shared" / "jsonschemabench"
TIMEOUT = 600.0
POLICY = JsonSchemaPolicy()
MAX_NEW_TOKENS = 256


@pytest.fixture(scope="module")
def files() -> list[Path]:
    """The schema files; the test is skipped (before any service starts) when the folder is absent."""
    if not BENCH.is_dir():
        pytest.skip(f"JSONSchemaBench schemas not found at {BENCH} (CI has them in ../shared relative to the repo)")
    files = sorted(BENCH.glob("*.json"))
    assert len(files) == 150, f"expected 150 schemas in {BENCH}, found {len(files)}"
    return files


# ---------------------------------------------------------------------------------------------------- xgrammar


class FreshMatchers:
    """Our own xgrammar compiler (not the service's), for matchers that judge the outputs independently. They
    compile what the service compiles: the policy's rewrite of the schema."""

    def __init__(self, model_dir: str) -> None:
        info = load_tokenizer_info(model_dir)
        self._compiler = xgr.GrammarCompiler(info)

    def matcher(self, schema_text: str) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self._compiler.compile_json_schema(POLICY.prepare(schema_text)))

    def accepts(self, schema_text: str, ids: list[int]) -> tuple[bool, bool]:
        """(every token accepted in order, the matcher terminated afterwards)."""
        matcher = self.matcher(schema_text)
        return all(matcher.accept_token(t) for t in ids), matcher.is_terminated()


# ---------------------------------------------------------------------------------------------------- the stack


@pytest.fixture(scope="module")
def split(files: list[Path], embedded_model_dir: Path) -> Iterator[Stack]:
    config = EngineConfig(
        model_path=str(embedded_model_dir), page_size=16, num_pages=4096, max_running=160, chunk_size=512
    )
    compiler = ConstraintCompiler.from_model_dir(str(embedded_model_dir), CompilerConfig(workers=2))
    grammar = GrammarThread(compiler)
    try:
        with split_stack(config, f"127.0.0.1:{grammar.port}") as stack:
            yield stack
    finally:
        grammar.stop()
        compiler.shutdown()


# ---------------------------------------------------------------------------------------------------- the test


def refused_by_public_api(stub: pb_grpc.SglangSchedulerStub, schema_text: str) -> str:
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=pb.SamplingParams(
            temperature=0.7, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1, max_new_tokens=4, json_schema=schema_text
        ),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.details() or ""


def validation_error(schema: Any, text: str) -> str | None:
    """Why ``text`` is not a JSON instance of ``schema`` (strict JSON: no raw control characters), or None."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator(schema).iter_errors(instance))
    return None if error is None else f"{error.message[:200]} (at {list(error.absolute_path)})"


def test_every_schema_compiles_or_is_refused_and_outputs_follow_it(
    files: list[Path], split: Stack, embedded_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [f.read_text(encoding="utf-8") for f in files]
    tokenizer = Tokenizer.from_dir(embedded_model_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Reply with JSON."}]))
    params = [SamplingParams(temperature=0.7, seed=i, max_new_tokens=MAX_NEW_TOKENS) for i in range(len(files))]
    constraints: list[Constraint | None] = [Constraint(ConstraintKind.JSON_SCHEMA, t) for t in texts]
    outs = split.engine.generate_batch([prompt] * len(files), params, TIMEOUT, constraints)

    fresh = FreshMatchers(str(embedded_model_dir))
    counts: Counter[str] = Counter()
    refused_for: Counter[str] = Counter()
    rewrites: Counter[str] = Counter()
    problems: list[str] = []
    for path, text, out in zip(files, texts, outs, strict=True):
        verdict = judge(split, fresh, tokenizer, text, out)
        counts[verdict.kind] += 1
        outcome = POLICY.apply(json.loads(text))
        if verdict.kind == "refused":
            refused_for.update({u.keyword for u in outcome.unenforced} or {"xgrammar"})
        else:
            rewrites.update(name for name, _ in outcome.rewrites)
        if verdict.problem:
            problems.append(f"{path.name}: {verdict.problem}")
        elif verdict.note:
            print(f"  {path.name}: {verdict.note}")
    assert split.engine.wait_idle(60)
    with GrammarClient(split.grammar) as client:
        assert client.get_state().num_open == 0, "every grammar is released after drain"
    compiled = len(files) - counts["refused"]
    summary = (
        f"JSONSchemaBench: {len(files)} schemas, compiled {compiled}, refused {counts['refused']}; "
        f"stop-valid {counts['stop-valid']}, length-accepted {counts['length-accepted']}\n"
        f"  refused for (schemas per keyword): {dict(refused_for.most_common())}\n"
        f"  rewritten by the policy (schemas per rewrite): {dict(rewrites.most_common())}"
    )
    with capsys.disabled():  # the counts belong in every log, not only a failing one
        print(f"\n{summary}")
    assert not problems, "\n".join(problems)
    assert counts["refused"] <= 20, refused_for  # the policy refuses little: the rest compiles, and exactly
    assert counts["stop-valid"] >= 30 and counts["length-accepted"] >= 30, counts  # both paths really ran


@dataclass(frozen=True)
class Verdict:
    kind: str
    problem: str | None = None
    note: str | None = None


def judge(split: Stack, fresh: FreshMatchers, tokenizer: Tokenizer, text: str, out: RequestOutput) -> Verdict:
    finish = out.finish
    assert finish is not None
    ids = list(out.output_ids or ())
    if finish.reason is FinishReason.ABORT and finish.cause is AbortCause.INVALID_GRAMMAR:
        return judge_refused(split, text, finish.message or "")
    if finish.reason is FinishReason.STOP:
        return judge_stop(fresh, text, ids, tokenizer.decode(ids, skip_special_tokens=True))
    if finish.reason is FinishReason.LENGTH:
        accepted, _ = fresh.accepts(text, ids)
        return Verdict("length-accepted" if accepted else "length", None if accepted else "cut output not accepted")
    return Verdict("other", f"unexpected finish {finish}")


def judge_refused(split: Stack, text: str, message: str) -> Verdict:
    reason = message.split("invalid grammar: ", 1)[-1]
    details = refused_by_public_api(split.stub, text)
    if details != f"sampling_params.json_schema: invalid grammar: {reason}":
        return Verdict("refused", f"the public API said {details!r}, the engine {message!r}")
    return Verdict("refused", note=f"refused: {reason}")


def judge_stop(fresh: FreshMatchers, text: str, ids: list[int], output: str) -> Verdict:
    schema = json.loads(text)
    error = validation_error(schema, output)
    if error is None:
        return Verdict("stop-valid")
    accepted, terminated = fresh.accepts(text, ids)
    return Verdict(
        "stop-invalid",
        f"{error}; output {output[:120]!r}; fresh matcher of the rewritten schema accepted={accepted} "
        f"terminated={terminated}",
    )
