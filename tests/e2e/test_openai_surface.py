"""The OpenAI surface as SGLang users know it, through smg 1.13.0: what works, and every gap smg leaves, pinned.

One ``ordinal serve`` stack for the module, reached with the ``openai`` client (and plain HTTP for smg's own
``/generate`` and ``/workers``). Each gap of issue 19 has a test here:

- what is ours works end to end: integers in tool-call arguments come back unchanged (``--json-integer-range``
  safe, the default, keeps unbounded integers within +-(2^53 - 1); an id above 2^53 forced by the grammar comes back
  as it was generated);
- what smg drops or refuses is pinned as smg does it today (``test_smg_*``), next to the way around it that the README's
  "Known gateway limitations" names (the field over gRPC, the chat endpoint, ``/generate``), shown working. A pinned
  test that fails after an smg upgrade means smg fixed that gap: make the test check the fix and update the README.

The embedded model is random: greedy requests (``ignore_eos``, fixed lengths) make outputs comparable with a direct
``Generate`` to the scheduler; structured requests sample (smg's default temperature 1.0) with room for the model's
whitespace (``STRUCTURED_MAX``) and are checked against what any output of their grammar must be.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from engine.grammar.schema.integer_range import SAFE_INTEGER
from engine.model.tokenizer import Tokenizer
from tests.e2e.stack import ServeStack, free_port_block, gateway_stack, greedy_request
from tests.helpers import smg_request

MODEL = "tiny-surface"
TIMEOUT = 120.0
MAX_TOKENS = 6
STRUCTURED_MAX = 1024
PROMPT = "Once upon a time"
IGNORE_EOS = {"ignore_eos": True}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Look up order 42."}]
ABOVE_2_53 = 2**53 + 1  # the first integer a double cannot hold; still a 64-bit integer
BEYOND_64_BITS = 2**64 + 1


class Surface:
    """The stack as these tests see it: the OpenAI client, plain HTTP to smg, the scheduler's stub."""

    def __init__(self, stack: ServeStack, channel: grpc.Channel) -> None:
        self.client = OpenAI(base_url=stack.gateway, api_key="x", timeout=TIMEOUT, max_retries=0)
        self.base = stack.gateway.removesuffix("/v1")
        self.scheduler = pb_grpc.SglangSchedulerStub(channel)

    def http(self, path: str, body: Any = None) -> Any:
        """smg's answer to a GET (or, with ``body``, a JSON POST) of ``path``, parsed; a 4xx/5xx fails the test."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as error:
            raise AssertionError(f"{path}: HTTP {error.code}: {error.read()[:2000]!r}") from None

    def direct(self, request: pb.GenerateRequest) -> pb.GenerateComplete:
        (reply,) = list(self.scheduler.Generate(request, timeout=TIMEOUT))
        assert reply.HasField("complete"), reply
        return reply.complete


@pytest.fixture(scope="module")
def surface(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Surface]:
    log_dir = tmp_path_factory.mktemp("surface")
    with gateway_stack(log_dir, embedded_model_dir, MODEL, free_port_block(4)) as (stack, channel):
        yield Surface(stack, channel)


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(embedded_model_dir)


def _text(tokenizer: Tokenizer, ids: Any) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- large integers


def _tool(parameters: dict[str, Any]) -> list[ChatCompletionToolParam]:
    function = {"name": "lookup", "description": "Find an order", "parameters": parameters}
    return [{"type": "function", "function": function}]  # type: ignore[typeddict-item]


def _tool_call_arguments(surface: Surface, parameters: dict[str, Any], tool_choice: Any, stream: bool) -> list[str]:
    """The arguments of each tool call smg returns, as the client receives them (streamed: each call's fragments
    joined). "required" lets the model call the tool more than once."""
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=ASK, max_tokens=STRUCTURED_MAX, tools=_tool(parameters), tool_choice=tool_choice
    )
    if not stream:
        reply = surface.client.chat.completions.create(**kwargs)
        calls = reply.choices[0].message.tool_calls or []
        assert calls and all(c.function.name == "lookup" for c in calls), reply
        return [c.function.arguments for c in calls]
    fragments: dict[int, str] = {}
    for chunk in surface.client.chat.completions.create(stream=True, **kwargs):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function is not None and call.function.arguments:
                fragments[call.index] = fragments.get(call.index, "") + call.function.arguments
    assert fragments and sorted(fragments) == list(range(len(fragments))), fragments
    return [fragments[i] for i in sorted(fragments)]


ORDER = {
    "type": "object",
    # An id the schema leaves unbounded above; the minimum makes the grammar write 16 digits close to 2^53.
    "properties": {"id": {"type": "integer", "minimum": SAFE_INTEGER - 999}, "ref": {"const": ABOVE_2_53}},
    "required": ["id", "ref"],
    "additionalProperties": False,
}
CHOICES = {"named": {"type": "function", "function": {"name": "lookup"}}, "required": "required"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_tool_call_integers_come_back_unchanged(surface: Surface, choice: str, stream: bool) -> None:
    """An unbounded ``integer`` stays within +-(2^53 - 1) (``--json-integer-range safe``, the default), and an id
    above 2^53 that the grammar forces (a ``const``) comes back digit for digit, as an integer: smg keeps 64-bit
    integers. The arguments must be valid JSON whose integers are ints (a double would parse as a float).

    The range's enforcement is proven in tests/unit/test_integer_range.py (deterministic, fails without the bound);
    here the whole path: the grammar service started by ``ordinal serve``, smg's parsing, the client's JSON."""
    for arguments in _tool_call_arguments(surface, ORDER, CHOICES[choice], stream):
        values = json.loads(arguments)
        assert isinstance(values["id"], int) and SAFE_INTEGER - 999 <= values["id"] <= SAFE_INTEGER, arguments
        assert isinstance(values["ref"], int) and values["ref"] == ABOVE_2_53 and str(ABOVE_2_53) in arguments


def test_smg_turns_tool_call_integers_beyond_64_bits_into_doubles(surface: Surface) -> None:
    """Known gateway limitation (README): smg parses a tool call's arguments and writes them again, and an integer
    beyond 64 bits comes back as a double. The range keeps unbounded integers clear of it; an explicit one (here a
    ``const``) is the schema's choice. If this fails, smg keeps such integers now: update the README."""
    beyond = {"type": "object", "properties": {"id": {"const": BEYOND_64_BITS}}, "required": ["id"]}
    (arguments,) = _tool_call_arguments(surface, beyond, CHOICES["named"], stream=False)
    value = json.loads(arguments)["id"]
    assert isinstance(value, float) and value == float(BEYOND_64_BITS) and str(BEYOND_64_BITS) not in arguments


# ---------------------------------------------------------------------------------------------- completions logprobs


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_smg_drops_completion_logprobs_the_scheduler_returns(
    surface: Surface, tokenizer: Tokenizer, stream: bool
) -> None:
    """Known gateway limitation: smg asks the scheduler for logprobs (``return_logprob``, ``top_logprobs_num``) and
    the scheduler returns them, but smg's completions response carries ``logprobs: null``. The way around it: chat's
    ``logprobs``/``top_logprobs`` (next test), or ``Generate`` over gRPC (shown here)."""
    ids = tokenizer.encode(PROMPT)
    request = smg_request(ids, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    request.return_logprob, request.top_logprobs_num = True, 2
    expected = surface.direct(request)
    assert len(expected.output_logprobs.token_logprobs) == MAX_TOKENS
    assert all(len(top.values) == 2 for top in expected.output_logprobs.top_logprobs)

    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, extra_body=IGNORE_EOS
    )
    if stream:
        chunks = [c for c in surface.client.completions.create(stream=True, **kwargs) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == _text(tokenizer, expected.output_ids)
        assert all(c.choices[0].logprobs is None for c in chunks), chunks
    else:
        (choice,) = surface.client.completions.create(**kwargs).choices
        assert choice.text == _text(tokenizer, expected.output_ids)
        assert choice.logprobs is None, choice


def test_chat_logprobs_carry_the_top_alternatives(surface: Surface) -> None:
    reply = surface.client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, top_logprobs=2,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == MAX_TOKENS
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in logprobs.content)


def test_smg_refuses_logprobs_false_on_completions(surface: Surface) -> None:
    """Known gateway limitation: smg reads completions' ``logprobs`` as a count only; ``false`` is a 400. The way
    around it: leave ``logprobs`` out."""
    with pytest.raises(openai.BadRequestError) as refused:
        surface.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"logprobs": False})
    assert "logprobs" in str(refused.value), refused.value


# ---------------------------------------------------------------------------------------------- prompts as token ids


def test_smg_refuses_token_id_prompts_and_generate_takes_them(surface: Surface, tokenizer: Tokenizer) -> None:
    """Known gateway limitation: ``/v1/completions`` with ``prompt`` as token ids (one list or several) is a 400 from
    smg. The way around it: smg's ``/generate`` with ``input_ids`` (shown: the scheduler's greedy output for those
    ids), or ``Generate`` over gRPC."""
    ids = tokenizer.encode(PROMPT)
    for prompt in (ids, [ids, ids[:2]]):
        with pytest.raises(openai.BadRequestError) as refused:
            surface.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert "prompt" in str(refused.value), refused.value

    expected = surface.direct(greedy_request(ids, MAX_TOKENS))
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    (out,) = surface.http("/generate", {"model": MODEL, "input_ids": ids, "sampling_params": sampling})
    assert out["output_ids"] == list(expected.output_ids) and out["meta_info"]["prompt_tokens"] == len(ids)


# ---------------------------------------------------------------------------------------------- max_tokens


def test_smg_leaves_max_tokens_to_the_worker_when_a_completion_gives_none(
    surface: Surface, tokenizer: Tokenizer
) -> None:
    """Known gateway limitation: without ``max_tokens`` smg sends no ``max_new_tokens``, so a completion runs as far
    as the worker allows (here: to the end of the 4096-token context), not OpenAI's default of 16. The way around it:
    give ``max_tokens``. The prompt leaves about 40 positions, so the two readings differ."""
    context = 4096
    ids = tokenizer.encode(" ".join(f"w{i % 97}" for i in range(context)))
    prompt = tokenizer.decode(ids[: context - 40])
    prompt_tokens = len(tokenizer.encode(prompt))  # as smg tokenizes it (the same tokenizer.json)
    assert context - prompt_tokens > 16, prompt_tokens
    reply = surface.client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, extra_body=IGNORE_EOS)
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", context - prompt_tokens)


# ---------------------------------------------------------------------------------------------- constraints


ONE_WORD = {"const": "ordinal"}


def test_smg_ignores_response_format_on_completions_and_json_schema_constrains(
    surface: Surface, tokenizer: Tokenizer
) -> None:
    """Known gateway limitation: smg does not turn completions' ``response_format`` into a constraint (the output is
    the unconstrained greedy one, 200). The way around it: the ``json_schema`` body field (a schema as a string; also
    ``regex``, ``ebnf``), which smg forwards, or the chat endpoint's ``response_format``."""
    response_format = {"type": "json_schema", "json_schema": {"name": "word", "schema": ONE_WORD}}
    expected = surface.direct(greedy_request(tokenizer.encode(PROMPT), MAX_TOKENS))
    reply = surface.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"response_format": response_format, **IGNORE_EOS},
    )  # fmt: skip
    assert reply.choices[0].text == _text(tokenizer, expected.output_ids)

    reply = surface.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=64, extra_body={"json_schema": json.dumps(ONE_WORD)}
    )
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == ('"ordinal"', "stop")


WORD_TAG = {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": ONE_WORD}, "end": "</n>"}
STRUCTURAL_TAG = {"type": "structural_tag", "format": WORD_TAG}


def test_smg_refuses_structural_tag_and_grpc_serves_it(surface: Surface, tokenizer: Tokenizer) -> None:
    """Known gateway limitation: smg refuses ``response_format`` of type ``structural_tag`` (400, unknown variant)
    and forwards no structural tag from ``/generate``. The way around it: the ``structural_tag`` constraint of
    ``Generate`` over gRPC (shown: xgrammar's tag format, the output exactly the tag)."""
    with pytest.raises(openai.BadRequestError) as refused:
        surface.client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, extra_body={"response_format": STRUCTURAL_TAG}
        )
    assert "structural_tag" in str(refused.value), refused.value

    request = smg_request(tokenizer.encode(PROMPT), max_new_tokens=64, structural_tag=json.dumps(STRUCTURAL_TAG))
    out = surface.direct(request)
    assert (out.finish_reason, _text(tokenizer, out.output_ids)) == ("stop", '<n>"ordinal"</n>')


# ---------------------------------------------------------------------------------------------- sampling fields


def test_smg_drops_logit_bias_and_grpc_applies_it(surface: Surface, tokenizer: Tokenizer) -> None:
    """Known gateway limitation: smg forwards no ``logit_bias``, on completions or chat, so neither a bias nor an
    out-of-vocabulary key has any effect (200, the unbiased output). The way around it: ``SamplingParams.logit_bias``
    over gRPC, which the scheduler applies and whose keys it checks (shown)."""
    token = tokenizer.encode(" the")[-1]
    ids = tokenizer.encode(PROMPT)
    unbiased = surface.direct(greedy_request(ids, MAX_TOKENS))
    assert list(unbiased.output_ids) != [token] * MAX_TOKENS
    for bias in ({str(token): 100}, {"99999": 5}):
        reply = surface.client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=bias, extra_body=IGNORE_EOS
        )
        assert reply.choices[0].text == _text(tokenizer, unbiased.output_ids), bias
    chat = surface.client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, temperature=0.0, logit_bias={str(token): 100},
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert chat.choices[0].message.content != tokenizer.decode([token] * MAX_TOKENS)

    biased = surface.direct(smg_request(ids, max_new_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={str(token): 100}))
    assert list(biased.output_ids) == [token] * MAX_TOKENS
    with pytest.raises(grpc.RpcError) as refused:
        surface.direct(smg_request(ids, max_new_tokens=MAX_TOKENS, logit_bias={"99999": 5}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.logit_bias" in refused.value.details()


def test_smg_drops_stop_regex(surface: Surface, tokenizer: Tokenizer) -> None:
    """Known gateway limitation: smg forwards no ``stop_regex`` (and SglangScheduler's proto has no field for it): a
    regex that matches any character stops nothing. The way around it: literal ``stop`` strings (shown: the greedy
    output's second token as the stop string ends it before that token)."""
    ids = tokenizer.encode(PROMPT)
    expected = surface.direct(greedy_request(ids, MAX_TOKENS))
    reply = surface.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"stop_regex": ["[\\s\\S]"], **IGNORE_EOS},
    )  # fmt: skip
    assert (reply.choices[0].finish_reason, reply.choices[0].text) == ("length", _text(tokenizer, expected.output_ids))

    first = _text(tokenizer, expected.output_ids[:1])
    stop = _text(tokenizer, expected.output_ids[1:2])
    assert stop and stop not in first, (first, stop)
    reply = surface.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], extra_body=IGNORE_EOS
    )
    assert (reply.choices[0].finish_reason, reply.choices[0].text) == ("stop", first)


# ---------------------------------------------------------------------------------------------- the model card


def test_smg_model_card_lacks_max_model_len_and_workers_has_it(surface: Surface) -> None:
    """Known gateway limitation: smg's ``/v1/models`` card has only id, object, created and owned_by (no
    ``max_model_len``, no ``root``) although GetModelInfo reports both. The way around it: smg's ``/workers`` (the
    worker's ``context_length`` and ``model_path``), or GetModelInfo over gRPC."""
    card = surface.http("/v1/models")["data"]
    assert [set(c) for c in card] == [{"id", "object", "created", "owned_by"}], card
    info = surface.scheduler.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    (worker,) = surface.http("/workers")["workers"]
    (model,) = worker["models"]
    assert (model["id"], model["context_length"]) == (MODEL, info.max_context_length)
    assert worker["labels"]["model_path"] == info.model_path


# ---------------------------------------------------------------------------------------------- a tool conversation


def _template_renders_tools(model_dir: Path) -> bool:
    """Whether the served chat template renders tool definitions, assistant tool calls and tool results."""
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template") or ""
    return all(word in template for word in ("tools", "tool_calls", "'tool'"))


def _chat_turn(surface: Surface, stream: bool, **kwargs: Any) -> tuple[str | None, str | None, list[Any], int]:
    """One chat turn: (content, finish_reason, tool calls as (id, name, arguments), prompt tokens)."""
    if not stream:
        reply = surface.client.chat.completions.create(model=MODEL, **kwargs)
        choice = reply.choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert reply.usage is not None
        return choice.message.content, choice.finish_reason, calls, reply.usage.prompt_tokens
    content: list[str] = []
    finish: str | None = None
    parts: dict[int, list[str]] = {}
    prompt_tokens = 0
    for chunk in surface.client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                part = parts.setdefault(call.index, ["", "", ""])
                part[0] += call.id or ""
                if call.function is not None:
                    part[1] += call.function.name or ""
                    part[2] += call.function.arguments or ""
    return "".join(content), finish, [tuple(parts[i]) for i in sorted(parts)], prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_three_turn_tool_conversation(
    surface: Surface, embedded_model_dir: Path, tokenizer: Tokenizer, stream: bool
) -> None:
    """user -> assistant tool call -> tool result -> assistant answer, through smg and the openai client.

    Needs a served chat template that renders tools, an assistant's ``tool_calls`` (with ``content: null``) and
    ``tool`` messages (the embedded model's Hermes / Qwen2.5-style template of issue 13); with a template that joins
    ``content`` as a string, smg refuses the second request with 400 "Failed to apply chat template"."""
    if not _template_renders_tools(embedded_model_dir):
        pytest.skip("the served model's chat template renders no tools, tool calls or tool results (issue 13's does)")
    tools = _tool(ORDER)
    _, finish, calls, _ = _chat_turn(
        surface, stream, messages=ASK, tools=tools, tool_choice="required", max_tokens=STRUCTURED_MAX
    )
    assert finish == "tool_calls" and calls, (finish, calls)
    call_id, name, arguments = calls[0]
    assert name == "lookup" and call_id, calls
    result = '{"status": "shipped", "eta_days": 2}'
    messages: list[ChatCompletionMessageParam] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]
    content, finish, calls, prompt = _chat_turn(
        surface, stream, messages=messages, tools=tools, tool_choice="none", max_tokens=16, extra_body=IGNORE_EOS
    )
    assert finish == "length" and isinstance(content, str) and not calls, (finish, content, calls)
    # The tool call and its result were rendered into the prompt of the answer (beside the bare question; a token or
    # two of the result may merge with the template's text around it).
    *_, bare = _chat_turn(surface, False, messages=ASK, tools=tools, tool_choice="none", max_tokens=1)
    assert prompt >= bare + len(tokenizer.encode(arguments)) + len(tokenizer.encode(result)) - 4, (prompt, bare)
