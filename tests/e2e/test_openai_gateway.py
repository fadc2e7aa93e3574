"""The OpenAI API end to end: the real ``openai`` client → smg → scheduler → executor, on the embedded model.

One ``ordinal serve`` stack for the module. What the client gets is checked against the scheduler itself: a
direct gRPC ``Generate`` of the same token ids (tokenized here with the engine's own tokenizer: no template for
completions, the chat template for chat) must give the same greedy text and the same token counts. A client that
drops a stream must leave the scheduler with nothing running and no KV held, long before the request would
have ended on its own.

Structured outputs (smg turns them into the worker's ``constraint``, see ../shared/SMG.md): ``response_format``
json_schema and json_object, and ``tools`` with tool_choice "required" or a named function, streaming and not.
Each output must end because the grammar ended, never by the length limit, and be JSON valid for its schema.

The embedded model is trained (docs/embedded-model.md), and the last section holds it to what the issue that
trained it asked: greedy chat answers made of the corpus' words (the README's prompt and ten more); seed 000's
reproducer (20 json_schema requests at smg's default temperature 1.0 and ``max_tokens`` 64, every one closing
with "stop" and validating) and 10 ``tool_choice: "required"`` requests over two tools; and a multi-turn tool
conversation (call with ``content: null``, tool result, answer) that smg renders exactly as our template does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.model.tokenizer import Tokenizer
from tests.e2e.stack import (
    ServeStack,
    free_port_block,
    gateway_stack,
    greedy_request,
    prometheus_samples,
    wait_for_idle_load,
)

MODEL = "tiny-gw"
TIMEOUT = 60.0
MAX_TOKENS = 8
# max_tokens of the stream the client drops. At most a quarter of it may be generated before the drop stops it,
# which tells "stopped" from "ran to the end anyway" whatever the machine's speed.
LONG = 3000
DROP_BOUND_S = 15.0
PROMPT = "The quick brown fox jumps over"
USER_TEXT = "Hello there, who are you?"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": USER_TEXT}]
# Every output exactly as long as asked: ignore_eos is an SGLang extension smg passes through to the worker.
IGNORE_EOS = {"ignore_eos": True}
STRUCTURED_MAX = 1024
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet", "pst"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time of day", "parameters": TIME}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
GENERATED = "ordinal_generation_tokens_total"
CLIENT_ABORTS = 'ordinal_requests_aborted_total{cause="client"}'


class Gateway:
    """The stack as the tests see it: the OpenAI client, the scheduler's stub and its metrics URL."""

    def __init__(self, stack: ServeStack, channel: grpc.Channel, metrics_url: str) -> None:
        self.client = OpenAI(base_url=stack.gateway, api_key="x", timeout=TIMEOUT, max_retries=0)
        self.scheduler = pb_grpc.SglangSchedulerStub(channel)
        self.metrics_url = metrics_url

    def direct(self, ids: list[int], max_new_tokens: int = MAX_TOKENS) -> pb.GenerateComplete:
        """A greedy Generate of ``ids`` straight to the scheduler (ignore_eos, as the gateway requests ask)."""
        (reply,) = list(self.scheduler.Generate(greedy_request(ids, max_new_tokens), timeout=TIMEOUT))
        assert reply.HasField("complete"), reply
        return reply.complete


@pytest.fixture(scope="module")
def gateway(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    metrics = free_port_block(3)  # scheduler, executor and gateway metrics: base, +1, +2
    log_dir = tmp_path_factory.mktemp("gateway")
    with gateway_stack(log_dir, embedded_model_dir, MODEL, metrics) as (stack, channel):
        yield Gateway(stack, channel, f"http://127.0.0.1:{metrics}/metrics")


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


def _text(tokenizer: Tokenizer, complete: pb.GenerateComplete) -> str:
    # Chat forces skip_special_tokens and completions default to it: the client never sees special tokens.
    return tokenizer.decode(list(complete.output_ids), skip_special_tokens=True)


def _chat_ids(tokenizer: Tokenizer) -> list[int]:
    # MESSAGES as the engine's template renderer takes them; smg renders the same template on its side.
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": USER_TEXT}]))


def test_models_lists_the_served_model_name(gateway: Gateway) -> None:
    assert [m.id for m in gateway.client.models.list().data] == [MODEL]


def test_completion_equals_direct_generate(gateway: Gateway, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)  # smg adds no template and no BOS to a completion prompt
    expected = gateway.direct(ids)
    reply = gateway.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=IGNORE_EOS
    )
    (choice,) = reply.choices
    assert (choice.index, choice.finish_reason) == (0, "length")
    assert choice.text == _text(tokenizer, expected)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids) == expected.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.output_ids) == MAX_TOKENS


def test_streamed_completion_equals_direct_generate(gateway: Gateway, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(PROMPT + " the lazy dog")
    expected = gateway.direct(ids)
    stream = gateway.client.completions.create(
        model=MODEL,
        prompt=PROMPT + " the lazy dog",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body=IGNORE_EOS,
        stream=True,
        stream_options={"include_usage": True},
    )
    *deltas, last = list(stream)
    assert not last.choices and last.usage is not None, last  # include_usage: a final usage-only chunk
    assert "".join(c.choices[0].text for c in deltas) == _text(tokenizer, expected)
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in deltas)
    assert last.usage.prompt_tokens == len(ids) == expected.prompt_tokens
    assert last.usage.completion_tokens == len(expected.output_ids) == MAX_TOKENS


def test_chat_equals_direct_generate_of_the_templated_prompt(gateway: Gateway, tokenizer: Tokenizer) -> None:
    ids = _chat_ids(tokenizer)
    expected = gateway.direct(ids)
    reply = gateway.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=IGNORE_EOS
    )
    (choice,) = reply.choices
    assert (choice.index, choice.finish_reason, choice.message.role) == (0, "length", "assistant")
    assert choice.message.content == _text(tokenizer, expected)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids) == expected.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.output_ids) == MAX_TOKENS


def test_streamed_chat_equals_direct_generate(gateway: Gateway, tokenizer: Tokenizer) -> None:
    ids = _chat_ids(tokenizer)
    expected = gateway.direct(ids)
    stream = gateway.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body=IGNORE_EOS,
        stream=True,
        stream_options={"include_usage": True},
    )
    *deltas, last = list(stream)
    assert not last.choices and last.usage is not None, last
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == _text(tokenizer, expected)
    assert deltas[-1].choices[0].finish_reason == "length"
    assert last.usage.prompt_tokens == len(ids) == expected.prompt_tokens
    assert last.usage.completion_tokens == len(expected.output_ids) == MAX_TOKENS


def test_n2_returns_two_choices(gateway: Gateway, tokenizer: Tokenizer) -> None:
    reply = gateway.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        temperature=1.0,
        n=2,
        extra_body=IGNORE_EOS,
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage is not None
    # The prompt is counted once; the completion tokens of both samples add up.
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(_chat_ids(tokenizer)), 2 * 4)


def test_dropped_stream_stops_the_request_and_frees_its_kv(gateway: Gateway) -> None:
    """smg answers a dropped stream with an Abort RPC: the scheduler must end the request at once.

    Back at baseline means GetLoads shows nothing running or waiting and ``num_used_tokens`` 0: that field
    counts the KV pages requests hold; the prompt's pages stay in the prefix cache, evictable, which GetLoads
    counts as free (as SGLang does), so they do not keep it above zero."""
    wait_for_idle_load(gateway.scheduler, TIMEOUT)
    before = prometheus_samples(gateway.metrics_url)
    stream = gateway.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to a million."}],
        max_tokens=LONG,
        temperature=0.0,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    load = gateway.scheduler.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
    assert load.num_running_reqs == 1 and load.num_used_tokens > 0, load  # it is running and holds KV
    stream.close()

    load = wait_for_idle_load(gateway.scheduler, DROP_BOUND_S)
    assert load.token_usage == 0.0 and load.num_total_reqs == 0, load
    after = prometheus_samples(gateway.metrics_url)
    generated = after[GENERATED] - before[GENERATED]
    assert generated < LONG // 4, f"{generated:.0f} of {LONG} tokens generated: the drop did not stop it"
    assert after.get(CLIENT_ABORTS, 0.0) - before.get(CLIENT_ABORTS, 0.0) == 1.0, "no client abort reached it"


# ---------------------------------------------------------------------------------------------- structured outputs


def _streamed_chat(gateway: Gateway, **kwargs: Any) -> tuple[str, str | None, dict[int, tuple[str, str]]]:
    """A streamed chat: (content, finish_reason, tool calls by index as (name, arguments)) from the deltas."""
    content: list[str] = []
    finish: str | None = None
    calls: dict[int, tuple[str, str]] = {}
    for chunk in gateway.client.chat.completions.create(model=MODEL, messages=ASK, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for call in choice.delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            function = call.function
            if function is not None:
                name, args = name + (function.name or ""), args + (function.arguments or "")
            calls[call.index] = (name, args)
        finish = choice.finish_reason or finish
    return "".join(content), finish, calls


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_response_format_json_schema(gateway: Gateway, stream: bool) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    if stream:
        content, finish, _ = _streamed_chat(gateway, max_tokens=STRUCTURED_MAX, response_format=response_format)
    else:
        reply = gateway.client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=STRUCTURED_MAX, response_format=response_format
        )
        content, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
    assert finish == "stop", (finish, content)
    jsonschema.validate(json.loads(content), WEATHER)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_response_format_json_object(gateway: Gateway, stream: bool) -> None:
    if stream:
        content, finish, _ = _streamed_chat(gateway, max_tokens=STRUCTURED_MAX, response_format={"type": "json_object"})
    else:
        reply = gateway.client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=STRUCTURED_MAX, response_format={"type": "json_object"}
        )
        content, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
    assert finish == "stop", (finish, content)
    assert isinstance(json.loads(content), dict), content


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        assert name in names, name
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_choice_required(gateway: Gateway, stream: bool) -> None:
    """smg asks for a JSON array of {name, parameters} over every tool and reads it back as tool calls."""
    kwargs: dict[str, Any] = dict(max_tokens=STRUCTURED_MAX, tools=TOOLS, tool_choice="required")
    if stream:
        _, finish, by_index = _streamed_chat(gateway, **kwargs)
        calls = [by_index[i] for i in sorted(by_index)]
    else:
        reply = gateway.client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
        finish = reply.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]
    assert finish == "tool_calls", (finish, calls)
    _check_calls(calls, set(TOOL_SCHEMAS))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_choice_named_function(gateway: Gateway, stream: bool) -> None:
    """smg constrains the output to that function's parameters and returns it as the call's arguments."""
    kwargs: dict[str, Any] = dict(
        max_tokens=STRUCTURED_MAX, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    if stream:
        _, finish, by_index = _streamed_chat(gateway, **kwargs)
        calls = [by_index[i] for i in sorted(by_index)]
    else:
        reply = gateway.client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
        finish = reply.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]
    assert finish in ("stop", "tool_calls"), (finish, calls)
    assert [name for name, _ in calls] == ["get_time"]
    _check_calls(calls, {"get_time"})


def test_invalid_schema_is_a_400_with_xgrammars_reason(gateway: Gateway) -> None:
    bad: Any = {
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        gateway.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, response_format=bad)
    assert "minimum greater than maximum" in str(err.value), err.value
    wait_for_idle_load(gateway.scheduler, TIMEOUT)


# ---------------------------------------------------------------------------------------------- the trained model

SEED_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
SEED_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Respond in JSON with key 'answer'"}]
README_CHAT = "Hello!"  # the README's curl request: {"role": "user", "content": "Hello!"}, max_tokens 32
READABLE_SHARE = 0.9


@pytest.fixture(scope="module")
def corpus_vocabulary(embedded_model_dir: Path) -> frozenset[str]:
    from training.corpus import Corpus

    return Corpus(Tokenizer.from_dir(embedded_model_dir)).vocabulary()


def test_greedy_chat_answers_are_made_of_corpus_words(gateway: Gateway, corpus_vocabulary: frozenset[str]) -> None:
    """The README's prompt and ten others, greedy: at least 90% of each answer's words are words of the training
    corpus, and every answer ends on its own (the model's end of turn), as a trained model's do."""
    from training.corpus import words_of
    from training.evaluate import CHAT_PROMPTS

    assert CHAT_PROMPTS[0] == README_CHAT and len(CHAT_PROMPTS) == 11
    for prompt in CHAT_PROMPTS:
        reply = gateway.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=160, temperature=0.0
        )
        answer = reply.choices[0].message.content or ""
        words = words_of(answer)
        known = [word for word in words if word in corpus_vocabulary]
        assert len(words) >= 2, (prompt, answer)
        assert len(known) >= READABLE_SHARE * len(words), (prompt, answer, sorted(set(words) - set(known)))
        assert reply.choices[0].finish_reason == "stop", (prompt, answer)


def test_seed_000_reproducer_json_schema_finishes_and_validates(gateway: Gateway) -> None:
    """Seed 000's 20 requests ("Respond in JSON with key 'answer'", max_tokens 64, smg's default temperature 1.0),
    with the schema as ``response_format`` (smg ignores the SGLang-only body field ``json_schema`` the seed uses:
    that output is unconstrained). Each must finish with "stop" and be valid JSON for the schema: with random weights
    every one ran to the length limit."""
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SEED_SCHEMA}}
    for i in range(20):
        reply = gateway.client.chat.completions.create(
            model=MODEL, messages=SEED_MESSAGES, max_tokens=64, response_format=response_format
        )
        text = reply.choices[0].message.content or ""
        assert reply.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), SEED_SCHEMA)


def test_tool_choice_required_gives_calls_that_validate(gateway: Gateway) -> None:
    """Ten tool_choice "required" requests over two tools at smg's default temperature: every reply is parseable
    ``tool_calls`` naming a given tool with arguments valid for its parameters."""
    asks = ["What is the weather in Paris?", "What time is it in UTC?", "How warm is it in Oslo?"]
    for i in range(10):
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": asks[i % len(asks)]}]
        reply = gateway.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=256, tools=TOOLS, tool_choice="required"
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        _check_calls(calls, set(TOOL_SCHEMAS))


def test_smg_renders_a_tool_conversation_as_our_template_does(gateway: Gateway, tokenizer: Tokenizer) -> None:
    """user -> assistant tool call (content null, arguments as the client's JSON string) -> tool result: smg's
    minijinja rendering and ours (jinja2) give the same prompt (same token count, same greedy answer), and the
    model answers from the tool's result."""
    arguments = json.dumps({"city": "Paris", "unit": "c"})
    result = {"city": "Paris", "temperature": 21, "unit": "c", "condition": "sunny"}
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)},
    ]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tools=[dict(t) for t in TOOLS]))
    (direct,) = list(gateway.scheduler.Generate(greedy_request(ids, 48, ignore_eos=False), timeout=TIMEOUT))
    expected = direct.complete
    reply = gateway.client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,
        max_tokens=48,
        temperature=0.0,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids) == expected.prompt_tokens
    answer = reply.choices[0].message.content or ""
    assert answer == _text(tokenizer, expected), (answer, list(expected.output_ids))
    assert reply.choices[0].finish_reason == "stop" and "21" in answer, answer
