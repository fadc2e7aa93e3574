"""Corpus documents of JSON: answers under a named key (seed 000's request and its neighbours), objects that follow
a schema given in the prompt, and records for "Reply with JSON."."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from training import banks
from training.chat_documents import arithmetic, greeting_exchange, qa
from training.draw import Chat, Draw, chat_turns, dumps


def _value(g: Draw, kind: str) -> Any:
    """A plausible value of a field kind (see banks.RECORD_FIELDS)."""
    r = g.rng
    simple: dict[str, Callable[[], Any]] = {
        "name": g.name,
        "surname": lambda: g.pick(banks.SURNAMES),
        "city": g.city,
        "country": lambda: g.pick(banks.CITIES)[1].removeprefix("the "),
        "age": lambda: r.randint(1, 90),
        "id": lambda: r.randint(1, 9999),
        "email": lambda: f"{g.name().lower()}@example.com",
        "title": lambda: g.pick(banks.TITLES),
        "sentence": lambda: g.pick(banks.SHORT_SENTENCES) if g.chance(0.7) else qa(g)[1],
        "price": lambda: round(r.uniform(0.5, 200), 2),
        "small_int": lambda: r.randint(1, 20),
        "score": lambda: r.randint(0, 100),
        "bool": lambda: r.random() < 0.5,
        "tags": lambda: g.some(banks.CATEGORIES, 0, 3),
        "status": lambda: g.pick(banks.STATUSES),
        "colour": lambda: g.pick(banks.COLOURS),
        "date": lambda: f"{r.randint(2020, 2026)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
        "year": lambda: r.randint(1990, 2026),
        "rating": lambda: r.randint(1, 5),
        "url": lambda: f"https://example.com/{g.pick(banks.CATEGORIES)}",
        "phone": lambda: f"555-{r.randint(0, 9999):04d}",
        "language": lambda: g.pick(banks.LANGUAGES),
        "category": lambda: g.pick(banks.CATEGORIES),
        "priority": lambda: g.pick(banks.PRIORITIES),
        "street": lambda: f"{r.randint(1, 99)} {g.pick(banks.STREETS)}",
        "zip": lambda: f"{r.randint(10000, 99999)}",
        "code": lambda: f"{g.pick('ABCDEFGH')}{g.pick('KLMNPRST')}{r.randint(10, 99)}",
        "version": lambda: f"{r.randint(0, 3)}.{r.randint(0, 9)}.{r.randint(0, 9)}",
        "temperature": lambda: r.randint(-10, 35),
        "unit": lambda: g.pick(("c", "f")),
        "username": lambda: f"{g.name().lower()}{r.randint(1, 99)}",
        "animal": lambda: g.pick(banks.ANIMALS)[0],
        "fruit": lambda: g.pick(banks.FRUITS),
        "answer": lambda: _short_answer(g),
    }
    return simple[kind]()


def _short_answer(g: Draw) -> str:
    return str(qa(g)[2]) if g.chance(0.5) else _reply(g)


def _reply(g: Draw) -> str:
    """A reply to a request for JSON that asks nothing: a few short strings, so that the value closes at once
    (seed 000's reproducer samples at temperature 1.0 with 64 tokens for the whole object)."""
    return str(g.pick(("yes", "ok", "Hello!", "Sure.", "Ready.", "Done.", "I am here to help.", "All good.")))


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def _record(g: Draw, low: int = 1, high: int = 5, depth: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A random object and a schema it follows (keys in schema order, as xgrammar's strict mode wants)."""
    fields = g.some(banks.RECORD_FIELDS, low, high)
    instance: dict[str, Any] = {}
    properties: dict[str, Any] = {}
    for key, kind in fields:
        if key in instance:
            continue
        if depth == 0 and g.chance(0.08):
            nested, nested_schema = _record(g, 1, 3, depth + 1)
            instance[key], properties[key] = nested, nested_schema
            continue
        value = _value(g, kind)
        instance[key] = value
        prop: dict[str, Any] = {"type": _json_type(value)}
        if isinstance(value, list):
            prop["items"] = {"type": "string"}
        elif isinstance(value, str) and kind in ("status", "priority", "unit", "colour") and g.chance(0.5):
            options = {"status": banks.STATUSES, "priority": banks.PRIORITIES, "unit": ("c", "f")}
            prop["enum"] = list(options.get(kind, banks.COLOURS))
        properties[key] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [key for key in properties if g.chance(0.7)]
    if required:
        schema["required"] = required
    return instance, schema


def gen_json_answer(g: Draw) -> Chat:
    """Seed 000's request ("Respond in JSON with key 'answer'") and its neighbours. Asked nothing, the value is a
    short reply; asked a question or greeted, it is the short answer or the whole reply. Every value ends where its
    text ends, so that a long value sampled at temperature 1.0 still closes instead of running on."""
    source = g.rng.randrange(10)
    if source < 4:
        question, full, short = qa(g)
    elif source < 6:
        question, full, short = arithmetic(g)
    else:
        question, full = greeting_exchange(g)
        short = full
    answer = short if g.chance(0.5) else full
    key = "answer" if g.chance(0.8) else g.pick(("result", "reply", "text", "value", "city", "name"))
    style = g.rng.randrange(7)
    if style in (0, 6):
        prompt, answer = f"Respond in JSON with key '{key}'", _reply(g)
    elif style == 1:
        prompt = f"Respond in JSON with key '{key}'. {question}"
    elif style == 2:
        prompt = f"{question} Respond in JSON with key '{key}'."
    elif style == 3:
        prompt = f'Answer in JSON with the key "{key}": {question}'
    elif style == 4:
        prompt = f"Reply with a JSON object that has an '{key}' field. {question}"
    else:
        prompt, key = f"{question} Give the answer as JSON.", "answer"
    if key in ("city", "name"):
        answer = _value(g, key)
    elif key == "value":
        answer = _value(g, g.pick(("name", "sentence", "title")))
    return [*g.system(0.2), *chat_turns(prompt, dumps({key: answer}))], []


def gen_json_schema(g: Draw) -> Chat:
    instance, schema = _record(g)
    intro = g.pick(
        (
            "Return JSON that matches this schema: {s}",
            "Answer with a JSON object following this JSON schema:\n{s}",
            "Produce JSON for the schema {s}",
            "Fill in this schema with example values: {s}",
        )
    ).format(s=dumps(schema))
    if g.chance(0.4):
        messages = [{"role": "system", "content": intro}, *chat_turns(g.pick(("Go.", "Reply with JSON.", "Now.")), "")]
    else:
        messages = [*g.system(0.2), *chat_turns(intro, "")]
    messages[-1]["content"] = dumps(instance)
    return messages, []


def gen_json_record(g: Draw) -> Chat:
    instance, _ = _record(g)
    ask = g.pick(
        (
            "Reply with JSON.",
            "Reply with JSON.",
            "Give me a JSON object.",
            "Return a JSON object with some example data.",
            "Respond with valid JSON only.",
            "Output an example record as JSON.",
        )
    )
    if g.chance(0.15):
        instance = {"items": [_record(g, 1, 3)[0] for _ in range(g.rng.randint(1, 3))]}
    return [*g.system(0.2), *chat_turns(ask, dumps(instance))], []
