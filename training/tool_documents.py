"""Corpus documents of tool use, in the chat template's Hermes format: a call (content null), the tool's result and
the answer; the array smg's ``tool_choice: "required"`` constrains the output to; the bare arguments of a named
tool choice. The tools are :data:`training.banks.TOOLS`; their results are invented per document."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from training import banks
from training.chat_documents import greeting_exchange, qa
from training.draw import Chat, Draw, Tool, chat_turns, dumps


def _tool_definition(g: Draw, tool: tuple[Any, ...]) -> Tool:
    name, description, params = tool
    properties: dict[str, Any] = {}
    for pname, kind, pdesc, _ in params:
        prop: dict[str, Any] = {"type": _PARAM_TYPES.get(kind, "string")}
        if kind in _PARAM_ENUMS and g.chance(0.6):
            prop["enum"] = list(_PARAM_ENUMS[kind])
        if g.chance(0.4):
            prop["description"] = pdesc
        properties[pname] = prop
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    required = [pname for pname, _, _, needed in params if needed]
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name}
    if g.chance(0.85):
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


_PARAM_TYPES = {"number": "number", "small_int": "integer", "people": "integer", "bool": "boolean"}
_PARAM_ENUMS: dict[str, tuple[str, ...]] = {
    "unit": ("c", "f"),
    "zone": banks.TIME_ZONES,
    "currency": banks.CURRENCIES,
}


def _param_value(g: Draw, kind: str) -> Any:
    r = g.rng
    values: dict[str, Callable[[], Any]] = {
        "city": g.city,
        "unit": lambda: g.pick(("c", "f")),
        "zone": lambda: g.pick(banks.TIME_ZONES),
        "query": lambda: g.pick(banks.SEARCH_QUERIES),
        "small_int": lambda: r.randint(1, 10),
        "email": lambda: f"{g.name().lower()}@example.com",
        "subject": lambda: g.pick(("Lunch", "Meeting", "Hello", "Trip plans", "Report", "Birthday", "Dentist")),
        "text": lambda: g.pick(banks.SHORT_SENTENCES),
        "number": lambda: r.randint(1, 500) if r.random() < 0.7 else round(r.uniform(1, 500), 2),
        "currency": lambda: g.pick(banks.CURRENCIES),
        "symbol": lambda: g.pick(banks.SYMBOLS),
        "title": lambda: g.pick(banks.RESTAURANTS),
        "people": lambda: r.randint(1, 8),
        "time": lambda: f"{r.randint(6, 22):02d}:{g.pick(('00', '15', '30', '45'))}",
        "date": lambda: f"{r.randint(2025, 2026)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
        "country": lambda: g.pick(banks.CITIES)[1].removeprefix("the "),
        "ingredient": lambda: g.pick((*banks.VEGETABLES, *banks.FRUITS)),
        "bool": lambda: r.random() < 0.5,
        "song": lambda: g.pick(banks.SONGS),
        "room": lambda: g.pick(banks.ROOMS),
        "language": lambda: g.pick(banks.LANGUAGES),
    }
    return values[kind]()


def _arguments(g: Draw, tool: tuple[Any, ...]) -> dict[str, Any]:
    _, _, params = tool
    args: dict[str, Any] = {}
    for pname, kind, _, needed in params:
        if needed or g.chance(0.4):
            args[pname] = _param_value(g, kind)
    if tool[0] == "get_distance" and args["origin"] == args["destination"]:
        args["destination"] = "Paris" if args["origin"] != "Paris" else "Rome"
    return args


def _ask(g: Draw, name: str, a: dict[str, Any]) -> str:
    """How a user asks for what the tool ``name`` does with arguments ``a``."""
    unit_word = {"c": "Celsius", "f": "Fahrenheit"}
    asks: dict[str, Callable[[], str]] = {
        "get_weather": lambda: g.pick(
            (
                f"What is the weather in {a['city']}?",
                f"How warm is it in {a['city']} in {unit_word[a['unit']]}?",
                f"Is it raining in {a['city']}? Use {unit_word[a['unit']]}.",
                f"Weather in {a['city']}, please, in {unit_word[a['unit']]}.",
            )
        ),
        "get_time": lambda: g.pick((f"What time is it in {a['zone'].upper()}?", f"Tell me the {a['zone']} time.")),
        "search_web": lambda: g.pick((f"Search the web for {a['query']}.", f"Can you look up {a['query']}?")),
        "send_email": lambda: f"Send an email to {a['to']} with the subject {a['subject']} saying: {a['body']}",
        "convert_currency": lambda: f"Convert {a['amount']} {a['from_currency']} to {a['to_currency']}.",
        "add_numbers": lambda: g.pick((f"Add {a['a']} and {a['b']}.", f"What is {a['a']} plus {a['b']}?")),
        "get_stock_price": lambda: f"What is the price of {a['symbol']} stock?",
        "book_table": lambda: f"Book a table at {a['restaurant']} for {a['people']} at {a['time']}.",
        "set_alarm": lambda: g.pick((f"Set an alarm for {a['time']}.", f"Wake me up at {a['time']}.")),
        "translate_text": lambda: f"Translate this into {a['language']}: {a['text']}",
        "create_event": lambda: f"Put {a['title']} in my calendar on {a['date']}.",
        "get_population": lambda: f"How many people live in {a['country']}?",
        "find_recipe": lambda: f"Find me a recipe with {a['ingredient']}.",
        "play_music": lambda: f"Play {a['song']}.",
        "get_distance": lambda: f"How far is it from {a['origin']} to {a['destination']}?",
        "turn_on_light": lambda: g.pick((f"Turn on the light in the {a['room']}.", f"Lights on in the {a['room']}.")),
    }
    return asks[name]()


def _result(g: Draw, name: str, a: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The tool's (invented) result and the assistant's answer that reports it."""
    r = g.rng
    if name == "get_weather":
        temp, sky = r.randint(-5, 32), g.pick(banks.WEATHER)
        unit = "degrees Celsius" if a["unit"] == "c" else "degrees Fahrenheit"
        result = {"city": a["city"], "temperature": temp, "unit": a["unit"], "condition": sky}
        return result, f"It is {temp} {unit} and {sky} in {a['city']}."
    if name == "get_time":
        time = f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"
        return {"zone": a["zone"], "time": time}, f"It is {time} in {a['zone'].upper()}."
    if name == "search_web":
        title = g.pick(banks.TITLES)
        return {"results": [{"title": title, "url": "https://example.com/a"}]}, f"I found one page: {title}."
    if name == "send_email":
        return {"sent": True}, f"Done. The email to {a['to']} was sent."
    if name == "convert_currency":
        value = round(float(a["amount"]) * r.uniform(0.5, 1.5), 2)
        said = f"{a['amount']} {a['from_currency']} is {value} {a['to_currency']}."
        return {"amount": value, "currency": a["to_currency"]}, said
    if name == "add_numbers":
        total = a["a"] + a["b"]
        total = round(total, 2) if isinstance(total, float) else total
        return {"result": total}, f"{a['a']} plus {a['b']} is {total}."
    if name == "get_stock_price":
        price = round(r.uniform(5, 500), 2)
        return {"symbol": a["symbol"], "price": price}, f"{a['symbol']} is trading at {price}."
    if name == "book_table":
        return {"booked": True, "table": r.randint(1, 30)}, (
            f"Your table at {a['restaurant']} for {a['people']} at {a['time']} is booked."
        )
    if name == "set_alarm":
        return {"ok": True}, f"Your alarm is set for {a['time']}."
    if name == "translate_text":
        return {"translation": a["text"]}, f"Here is the text in {a['language']}: {a['text']}"
    if name == "create_event":
        return {"created": True}, f"I added {a['title']} to your calendar on {a['date']}."
    if name == "get_population":
        millions = r.randint(1, 300)
        return {"country": a["country"], "population": millions * 1_000_000}, (
            f"About {millions} million people live in {a['country']}."
        )
    if name == "find_recipe":
        dish = f"{a['ingredient']} soup"
        return {"recipe": dish, "minutes": r.randint(10, 60)}, f"You could make {dish}."
    if name == "play_music":
        return {"playing": a["song"]}, f"Now playing {a['song']}."
    if name == "get_distance":
        km = r.randint(20, 3000)
        return {"kilometres": km}, f"It is about {km} kilometres from {a['origin']} to {a['destination']}."
    return {"on": True}, f"The light in the {a['room']} is on."


def _toolbox(g: Draw, count: int) -> tuple[list[tuple[Any, ...]], list[Tool]]:
    chosen = g.some(banks.TOOLS, count, count)
    return chosen, [_tool_definition(g, tool) for tool in chosen]


def gen_tool_call(g: Draw) -> Chat:
    """A Hermes-format tool conversation: the call (content null), the tool's result, the answer."""
    chosen, tools = _toolbox(g, g.rng.randint(1, 3))
    messages = g.system(0.3)
    if g.chance(0.12):  # nothing to call: answer in words
        question, answer = g.pick((lambda g: qa(g)[:2], greeting_exchange))(g)
        return [*messages, *chat_turns(question, answer)], tools
    calls = chosen[: 2 if len(chosen) > 1 and g.chance(0.15) else 1]
    args = [_arguments(g, tool) for tool in calls]
    asks = [_ask(g, tool[0], a) for tool, a in zip(calls, args, strict=True)]
    messages.append({"role": "user", "content": " ".join(asks)})
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": tool[0], "arguments": a}}
        for i, (tool, a) in enumerate(zip(calls, args, strict=True))
    ]
    messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
    answers = []
    for i, (tool, a) in enumerate(zip(calls, args, strict=True)):
        result, answer = _result(g, tool[0], a)
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": dumps(result)})
        answers.append(answer)
    messages.append({"role": "assistant", "content": " ".join(answers)})
    if g.chance(0.2):
        messages += chat_turns(g.pick(banks.THANKS), g.pick(banks.THANKS_REPLIES))
    return messages, tools


def gen_tool_required(g: Draw) -> Chat:
    """What smg's tool_choice "required" constrains the output to: ``[{"name": ..., "parameters": {...}}]``."""
    chosen, tools = _toolbox(g, g.rng.randint(1, 3))
    calls = chosen[: 2 if len(chosen) > 1 and g.chance(0.1) else 1]
    args = [_arguments(g, tool) for tool in calls]
    asks = [_ask(g, tool[0], a) for tool, a in zip(calls, args, strict=True)]
    output = [{"name": tool[0], "parameters": a} for tool, a in zip(calls, args, strict=True)]
    return [*g.system(0.3), *chat_turns(" ".join(asks), dumps(output))], tools


def gen_tool_arguments(g: Draw) -> Chat:
    """A named tool_choice: smg constrains the output to that function's parameters, so the reply is the arguments."""
    chosen, tools = _toolbox(g, g.rng.randint(1, 3))
    tool = chosen[0]
    args = _arguments(g, tool)
    return [*g.system(0.2), *chat_turns(_ask(g, tool[0], args), dumps(args))], tools
