"""Speculative decoding through the OpenAI API: the real ``openai`` client → smg → scheduler → executor.

One ``ordinal serve`` stack with speculation on (the embedded model drafting for itself: every draft accepted, so
steps deliver runs of several tokens). Chat and streaming chat must give exactly the greedy text plain decoding
gives (an in-process engine without speculation, on the same templated prompt), and ``usage`` must count every
token when several arrive per step; the scheduler's GenerateComplete reports the speculative counts, GetLoads and
GetServerInfo the acceptance, Prometheus the counters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.config import EngineConfig
from engine.model.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler.engine import Engine
from tests.e2e.stack import ServeStack, free_port_block, greedy_request, prometheus_samples, start_serve

MODEL = "tiny-spec"
TIMEOUT = 60.0
MAX_TOKENS = 37  # not a multiple of the run length: the last run is cut by max_tokens
STEPS = 4
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story about a fox."}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeStack, str]]:
    metrics = free_port_block(3)
    flags = ["--port", "0", "--executor-port", "0", "--grammar-port", "0", "--gateway-port", "0"]
    flags += ["--metrics-port", str(metrics), "--served-model-name", MODEL, "--num-pages", "512"]
    flags += ["--speculative-algorithm", "draft", "--speculative-draft-model-path", str(embedded_model_dir)]
    flags += ["--speculative-num-steps", str(STEPS), "--speculative-adaptive", "off"]
    served = start_serve(tmp_path_factory.mktemp("spec-gateway") / "serve.stderr", embedded_model_dir, *flags)
    try:
        yield served, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        code = served.stop()
    assert code == 0, served.stderr()[-4000:]


@pytest.fixture(scope="module")
def plain_text(embedded_model_dir: Path) -> tuple[list[int], str]:
    """The templated prompt's ids and its greedy text without speculation (in process)."""
    tokenizer = Tokenizer.from_dir(embedded_model_dir)
    ids = tokenizer.encode(tokenizer.apply_chat_template([dict(m) for m in MESSAGES]))  # type: ignore[misc]
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    with Engine(EngineConfig(model_path=str(embedded_model_dir))) as engine:
        (out,) = engine.generate_batch([ids], [params])
    return ids, tokenizer.decode(list(out.output_ids or ()), skip_special_tokens=True)


def _client(stack: tuple[ServeStack, str]) -> OpenAI:
    return OpenAI(base_url=stack[0].gateway, api_key="x", timeout=TIMEOUT, max_retries=0)


def test_chat_with_speculation_gives_plain_decodings_text_and_usage(
    stack: tuple[ServeStack, str], plain_text: tuple[list[int], str]
) -> None:
    ids, text = plain_text
    reply = _client(stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=IGNORE_EOS
    )
    (choice,) = reply.choices
    assert choice.message.content == text and choice.finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), MAX_TOKENS)


def test_streamed_chat_with_speculation_gives_plain_decodings_text_and_usage(
    stack: tuple[ServeStack, str], plain_text: tuple[list[int], str]
) -> None:
    ids, text = plain_text
    chunks = list(
        _client(stack).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body=IGNORE_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *deltas, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == text
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), MAX_TOKENS)


def test_the_scheduler_reports_the_speculation(
    stack: tuple[ServeStack, str], plain_text: tuple[list[int], str]
) -> None:
    """GenerateComplete's spec fields (every draft accepted: the target drafts for itself), chunks of several tokens
    with cumulative counts, GetLoads' speculative section, GetServerInfo and the Prometheus counters."""
    ids, _ = plain_text
    with grpc.insecure_channel(stack[0].scheduler) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        replies = list(stub.Generate(greedy_request(ids, MAX_TOKENS, stream=True), timeout=TIMEOUT))
        chunks = [r.chunk for r in replies if r.HasField("chunk")]
        complete = replies[-1].complete
        assert max(len(c.token_ids) for c in chunks) > 1  # several tokens arrived in one step
        assert [c.completion_tokens for c in chunks] == list(itertools.accumulate(len(c.token_ids) for c in chunks))
        assert complete.completion_tokens == MAX_TOKENS
        assert 0 < complete.spec_accepted_tokens == complete.spec_draft_tokens
        load = stub.GetLoads(pb.GetLoadsRequest(include=["spec"]), timeout=TIMEOUT).loads[0]
        assert load.HasField("speculative") and load.speculative.accept_rate == 1.0
        assert load.speculative.accept_length > 2.0
        info = MessageToDict(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT))
        assert info["serverArgs"]["speculative_algorithm"] == "DRAFT"
        assert info["serverArgs"]["speculative_num_draft_tokens"] == STEPS + 1
        assert info["serverArgs"]["speculative_draft_min_prob"] == pytest.approx(0.6)  # the default bar
        assert info["schedulerInfo"]["spec_accepted_tokens"] > 0
    samples = prometheus_samples(stack[1])
    assert samples["ordinal_spec_accepted_tokens_total"] == samples["ordinal_spec_draft_tokens_total"] > 0
