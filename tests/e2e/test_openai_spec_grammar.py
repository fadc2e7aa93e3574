"""Seed 000's reproducer, adapted: structured outputs through smg with speculation on, many at once.

The seed: forced tool calls with EAGLE failed with "Tokens not accepted" because the verify mask was built from a
grammar state one step old. Here one ``ordinal serve`` stack runs n-gram speculation (chains of 4, adaptive off, so
every decode step drafts) with the grammar under overlap (delayed verify: each step's forward starts before its
draft masks exist), the executor pinned to a core of its own (``--executor-cpus``) and its masks carried by its mask
relay process on the others (``--grammar-mask-relay`` auto). The real ``openai`` client sends, 20 at a time, chat
requests with the seed's json_schema and ``max_tokens`` 64, then forced tool calls (``tool_choice: "required"`` over
two tools), half streamed. Every answer must end with "stop" / "tool_calls", parse, and validate against its schema;
the executor's counters must show drafts accepted under the grammar. A mask from another grammar state would let a
token through that the grammar's commit then refuses (the request ends as an abort) or yield JSON that does not
validate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.e2e.stack import ServeStack, alive, free_port_block, prometheus_samples, start_serve

MODEL = "tiny-spec-grammar"
TIMEOUT = 120.0
CONCURRENCY = 20
ANSWER: dict[str, Any] = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIME: dict[str, Any] = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTIONS = [
    "What is the capital of France?",
    "Name a color of the sky.",
    "What do cats like to eat?",
    "How many days are in a week?",
    "What is two plus three?",
    "Say hello to a friend.",
    "What is the opposite of hot?",
    "Which animal barks?",
    "What season comes after winter?",
    "Give me a short greeting.",
]
ASKS = ["What is the weather in {}?", "What time is it in {}?", "Tell me the weather and the time in {}."]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Rome", "Delhi"]


@pytest.fixture(scope="module")
def stack(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeStack, str]]:
    metrics = free_port_block(3)
    flags = ["--port", "0", "--executor-port", "0", "--grammar-port", "0", "--gateway-port", "0"]
    flags += ["--metrics-port", str(metrics), "--served-model-name", MODEL, "--num-pages", "1024"]
    flags += ["--speculative-algorithm", "ngram", "--speculative-num-steps", "4", "--speculative-adaptive", "off"]
    # The executor pinned apart, as a CPU deployment runs it; its masks then come through its relay process (auto),
    # on the cores of the others. With one core the relay is asked for outright.
    cores = sorted(os.sched_getaffinity(0))
    executor, rest = {cores[-1]}, set(cores[:-1])
    flags += ["--executor-cpus", str(cores[-1])] if rest else ["--grammar-mask-relay", "on"]
    served = start_serve(tmp_path_factory.mktemp("spec-grammar") / "serve.stderr", embedded_model_dir, *flags)
    relays: list[int] = []
    try:
        relays = _children(served.pids["executor"], "services.mask_relay_process")
        assert len(relays) == 1, "the executor did not start its mask relay"
        if rest:
            assert os.sched_getaffinity(served.pids["executor"]) == executor
            assert os.sched_getaffinity(served.pids["scheduler"]) == rest
            assert os.sched_getaffinity(relays[0]) == rest
        yield served, f"http://127.0.0.1:{metrics + 1}/metrics"  # the executor's
    finally:
        code = served.stop()
    assert code == 0, served.stderr()[-4000:]
    assert not any(alive(pid) for pid in relays), "the mask relay outlived the stack"


def _children(parent: int, module: str) -> list[int]:
    """The pids of ``parent``'s child processes running ``python -m module``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and module.encode() in cmdline:
            found.append(int(entry.name))
    return found


def _client(stack: tuple[ServeStack, str]) -> OpenAI:
    return OpenAI(base_url=stack[0].gateway, api_key="x", timeout=TIMEOUT, max_retries=0)


def _json_chat(client: OpenAI, question: str) -> tuple[str | None, str]:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"{question} Respond in JSON with key 'answer'."}
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
    )
    return reply.choices[0].finish_reason, reply.choices[0].message.content or ""


def _tool_call(client: OpenAI, ask: str, stream: bool) -> tuple[str | None, list[tuple[str, str]]]:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": ask}]
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=messages, max_tokens=128, temperature=0.0, tools=TOOLS, tool_choice="required"
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        calls = reply.choices[0].message.tool_calls or []
        return reply.choices[0].finish_reason, [(c.function.name, c.function.arguments) for c in calls]
    finish, parts = None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for call in choice.delta.tool_calls or []:
            name, arguments = parts.get(call.index, ("", ""))
            fn = call.function
            parts[call.index] = (name + (fn.name or "" if fn else ""), arguments + (fn.arguments or "" if fn else ""))
    return finish, [parts[i] for i in sorted(parts)]


def test_json_schema_chats_all_finish_and_validate(stack: tuple[ServeStack, str]) -> None:
    client = _client(stack)
    before = prometheus_samples(stack[1]).get("ordinal_executor_spec_accepted_tokens_total", 0.0)
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else " Be brief.") for i in range(20)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(pool.map(lambda q: _json_chat(client, q), questions))
    for question, (finish, content) in zip(questions, replies, strict=True):
        assert finish == "stop", (question, finish, content)
        jsonschema.validate(json.loads(content), ANSWER)
    after = prometheus_samples(stack[1]).get("ordinal_executor_spec_accepted_tokens_total", 0.0)
    assert after > before, "no draft token was accepted under the grammar"


def test_forced_tool_calls_all_parse_and_validate(stack: tuple[ServeStack, str]) -> None:
    client = _client(stack)
    asks = [ASKS[i % len(ASKS)].format(CITIES[i % len(CITIES)]) for i in range(20)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(pool.map(lambda i: _tool_call(client, asks[i], stream=i % 2 == 1), range(len(asks))))
    for ask, (finish, calls) in zip(asks, replies, strict=True):
        assert finish == "tool_calls" and calls, (ask, finish, calls)
        for name, arguments in calls:
            assert name in SCHEMAS, (ask, name)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
