"""150 real-world JSON schemas (JSONSchemaBench, ``../shared/jsonschemabench``) through the split services.

One grammar service, one executor (masks from the grammar service) and one engine driving them over gRPC: every
schema is submitted at once (seeded sampling, temperature 0.7, up to 256 new tokens) so the batch runs together.

Each schema either compiles, or is refused: the grammar service answers Open with INVALID_ARGUMENT and the engine
ends the request with an INVALID_GRAMMAR finish carrying xgrammar's reason; every refused schema is also sent
through the scheduler's public gRPC API, which must answer INVALID_ARGUMENT with the same reason. Then:

- an output that finishes with "stop" is JSON that validates with ``jsonschema`` (the draft its ``$schema`` names,
  else 2020-12), with one documented exception: where the schema uses a feature xgrammar 0.2.9 does not enforce
  (see :func:`loose_features`), an invalid output is allowed only if a fresh ``xgrammar.GrammarMatcher`` of the
  schema accepts it and terminates, i.e. the engine followed the grammar exactly and the grammar is what is loose;
- an output cut by the length limit is accepted token by token by a fresh matcher;
- a request ended by the grammar refusing a token at commit (C13) is allowed only where a fresh matcher shows
  xgrammar itself disagreeing: its mask allows the token its ``accept_token`` refuses.

The counts are printed (always); the notes on each exception with ``-s``.
"""

from __future__ import annotations

import json
import re
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
from engine.engine import Engine
from engine.grammar import CompilerConfig, ConstraintCompiler, load_tokenizer_info
from engine.grammar.constraint import Constraint, ConstraintKind
from engine.model.tokenizer import Tokenizer
from engine.request import RequestOutput
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.stop import AbortCause, FinishReason
from services.executor.server import ExecutorThread
from services.grammar.server import GrammarThread
from services.grammar_client import GrammarClient, RemoteGrammar
from services.remote_runner import RemoteRunner
from services.scheduler.server import ThreadedServer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO.parent / "shared" / "jsonschemabench"
TIMEOUT = 600.0
MAX_NEW_TOKENS = 256
REFUSED_TOKEN = re.compile(r"refused token (\d+) at output position (\d+)")


@pytest.fixture(scope="module")
def files() -> list[Path]:
    """The schema files; the test is skipped (before any service starts) when the folder is absent."""
    if not BENCH.is_dir():
        pytest.skip(f"JSONSchemaBench schemas not found at {BENCH} (CI has them in ../shared relative to the repo)")
    files = sorted(BENCH.glob("*.json"))
    assert len(files) == 150, f"expected 150 schemas in {BENCH}, found {len(files)}"
    return files


# ---------------------------------------------------------------------------------------------------- xgrammar


def loose_features(schema: Any) -> set[str]:
    """The features of ``schema`` that xgrammar 0.2.9 compiles into a grammar looser than the schema.

    Each was checked with a fresh matcher accepting an instance the schema forbids:
    - a string with minLength/maxLength accepts raw control characters (invalid JSON): ``{"maxLength": 10}``
      accepts ``"a\\x02b"``;
    - with a pattern, minLength/maxLength are dropped: ``{"maxLength": 3, "pattern": "^[a-z]+$"}`` accepts 8 letters;
    - oneOf is anyOf: ``{"oneOf": [{"type": "integer"}, {"type": "number"}]}`` accepts ``5``;
    - keywords next to anyOf/oneOf/allOf are ignored: ``{"type": "object", "anyOf": [{"required": ["a"]}]}``
      accepts ``7``;
    - uniqueItems is ignored: ``[1,1]``; allOf with several entries is incomplete (xgrammar warns so).
    """
    found: set[str] = set()
    if isinstance(schema, list):
        for item in schema:
            found |= loose_features(item)
        return found
    if not isinstance(schema, dict):
        return found
    if {"minLength", "maxLength"} & schema.keys():
        found.add("length-bounded string (control characters)")
        if "pattern" in schema:
            found.add("length with pattern")
    if "oneOf" in schema:
        found.add("oneOf")
    combinators = {"anyOf", "oneOf", "allOf"} & schema.keys()
    if combinators and {"type", "properties", "required", "items", "enum"} & schema.keys():
        found.add("keywords next to " + "/".join(sorted(combinators)))
    if schema.get("uniqueItems"):
        found.add("uniqueItems")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.add("allOf with several entries")
    for value in schema.values():
        found |= loose_features(value)
    return found


class FreshMatchers:
    """Our own xgrammar compiler (not the service's), for matchers that judge the outputs independently."""

    def __init__(self, model_dir: str) -> None:
        info = load_tokenizer_info(model_dir)
        self._vocab_size = int(info.vocab_size)
        self._compiler = xgr.GrammarCompiler(info)

    def matcher(self, schema_text: str) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self._compiler.compile_json_schema(schema_text))

    def accepts(self, schema_text: str, ids: list[int]) -> tuple[bool, bool]:
        """(every token accepted in order, the matcher terminated afterwards)."""
        matcher = self.matcher(schema_text)
        return all(matcher.accept_token(t) for t in ids), matcher.is_terminated()

    def mask_allows_what_accept_refuses(self, schema_text: str, ids: list[int], token: int) -> bool:
        matcher = self.matcher(schema_text)
        if not all(matcher.accept_token(t) for t in ids):
            return False
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)  # [1, W] int32
        matcher.fill_next_token_bitmask(mask)
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        return allowed and not matcher.accept_token(token)


# ---------------------------------------------------------------------------------------------------- the stack


@dataclass
class Split:
    engine: Engine
    grammar: str
    stub: pb_grpc.SglangSchedulerStub


@pytest.fixture(scope="module")
def split(files: list[Path], embedded_model_dir: Path) -> Iterator[Split]:
    model = str(embedded_model_dir)
    config = EngineConfig(model_path=model, page_size=16, num_pages=4096, max_running=160, chunk_size=512)
    vocab = int(json.loads((embedded_model_dir / "config.json").read_text())["vocab_size"])
    compiler = ConstraintCompiler.from_model_dir(model, CompilerConfig(workers=2))
    grammar = GrammarThread(compiler)
    target = f"127.0.0.1:{grammar.port}"
    masks = RemoteGrammar.connect(target, 60, vocab_size=vocab)
    runner = ModelRunner.load(config, masks)
    executor = ExecutorThread(runner)
    commits = RemoteGrammar.connect(target, 60, vocab_size=vocab)
    engine = Engine(config, RemoteRunner.connect(f"127.0.0.1:{executor.port}", timeout=60), grammar=commits)
    server = ThreadedServer(engine, executor=f"127.0.0.1:{executor.port}", grammar=target)
    try:
        port = server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Split(engine, target, pb_grpc.SglangSchedulerStub(channel))
    finally:
        server.stop()
        engine.shutdown()
        commits.close()
        executor.stop()
        runner.shutdown()
        masks.close()
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
    files: list[Path], split: Split, embedded_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [f.read_text(encoding="utf-8") for f in files]
    tokenizer = Tokenizer.from_dir(embedded_model_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Reply with JSON."}]))
    params = [SamplingParams(temperature=0.7, seed=i, max_new_tokens=MAX_NEW_TOKENS) for i in range(len(files))]
    constraints: list[Constraint | None] = [Constraint(ConstraintKind.JSON_SCHEMA, t) for t in texts]
    outs = split.engine.generate_batch([prompt] * len(files), params, TIMEOUT, constraints)

    fresh = FreshMatchers(str(embedded_model_dir))
    counts: Counter[str] = Counter()
    problems: list[str] = []
    for path, text, out in zip(files, texts, outs, strict=True):
        verdict = judge(split, fresh, tokenizer, text, out)
        counts[verdict.kind] += 1
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
        f"stop-valid {counts['stop-valid']}, stop-invalid-by-xgrammar-looseness {counts['stop-loose']}, "
        f"length-accepted {counts['length-accepted']}, grammar-abort-by-xgrammar-disagreement "
        f"{counts['grammar-abort']}"
    )
    with capsys.disabled():  # the counts belong in every log, not only a failing one
        print(f"\n{summary}")
    assert not problems, "\n".join(problems)
    assert counts["stop-valid"] >= 30 and counts["length-accepted"] >= 30, counts  # both paths really ran


@dataclass(frozen=True)
class Verdict:
    kind: str
    problem: str | None = None
    note: str | None = None


def judge(split: Split, fresh: FreshMatchers, tokenizer: Tokenizer, text: str, out: RequestOutput) -> Verdict:
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
    if finish.cause is AbortCause.GRAMMAR and (match := REFUSED_TOKEN.search(finish.message or "")):
        token, position = int(match[1]), int(match[2])
        if position == len(ids) and fresh.mask_allows_what_accept_refuses(text, ids, token):
            return Verdict("grammar-abort", note=f"xgrammar's mask allows token {token} its matcher refuses")
    return Verdict("other", f"unexpected finish {finish}")


def judge_refused(split: Split, text: str, message: str) -> Verdict:
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
    features = loose_features(schema)
    accepted, terminated = fresh.accepts(text, ids)
    if features and accepted and terminated:
        return Verdict("stop-loose", note=f"invalid ({error}); xgrammar does not enforce {sorted(features)}")
    return Verdict(
        "stop-invalid",
        f"{error}; output {output[:120]!r}; fresh matcher accepted={accepted} terminated={terminated}; "
        f"loose features {sorted(features)}",
    )
