"""Corpus documents in words: questions and answers, greetings, explanations, stories, tips, multi-turn chats,
plain prose and Python (see :mod:`training.corpus` for the kinds and their shares)."""

from __future__ import annotations

from collections.abc import Callable

from engine.model.embedded_corpus import training_texts
from training import banks
from training.draw import Chat, Draw, Made, chat_turns

# ----------------------------------------------------------------------------------------------- question/answer


def _capital_qa(g: Draw) -> tuple[str, str, str]:
    """(question, full answer, short answer)."""
    city, country, fact = g.pick(banks.CITIES)
    country_title = country[0].upper() + country[1:]
    style = g.rng.randrange(4)
    if style == 0:
        return f"What is the capital of {country}?", f"The capital of {country} is {city}.", city
    if style == 1:
        return f"Which city is the capital of {country}?", f"{city} is the capital of {country}.", city
    if style == 2:
        return f"Tell me about {city}.", f"{city} is the capital of {country}. {fact}", f"{city} is in {country}"
    return f"In which country is {city}?", f"{city} is in {country}. It is the capital.", country_title


def _animal_qa(g: Draw) -> tuple[str, str, str]:
    animal, plural, legs, sound, home, food = g.pick(banks.ANIMALS)
    style = g.rng.randrange(4)
    if style == 0:
        legs_text = "no legs" if legs == 0 else f"{legs} legs"
        return f"How many legs does a {animal} have?", f"A {animal} has {legs_text}.", str(legs)
    if style == 1 and sound is not None:
        return f"What sound does a {animal} make?", f"A {animal} says {sound}.", sound
    if style == 2:
        return f"Where do {plural} live?", f"{plural.capitalize()} live {home}.", home
    return f"What do {plural} eat?", f"{plural.capitalize()} eat {food}.", food


def _opposite_qa(g: Draw) -> tuple[str, str, str]:
    word, other = g.pick(banks.OPPOSITES)
    if g.chance(0.5):
        word, other = other, word
    return f"What is the opposite of {word}?", f"The opposite of {word} is {other}.", other


def _calendar_qa(g: Draw) -> tuple[str, str, str]:
    if g.chance(0.5):
        i = g.rng.randrange(7)
        day, after = banks.WEEKDAYS[i], banks.WEEKDAYS[(i + 1) % 7]
        return f"What day comes after {day}?", f"{after} comes after {day}.", after
    i = g.rng.randrange(12)
    month, after = banks.MONTHS[i], banks.MONTHS[(i + 1) % 12]
    return f"Which month comes after {month}?", f"{after} comes after {month}.", after


def _fixed_fact(g: Draw) -> tuple[str, str, str]:
    question, answer = g.pick(banks.FACTS)
    return question, answer, answer.rstrip(".")


def arithmetic(g: Draw) -> tuple[str, str, str]:
    """A sum, difference, product or exact quotient of small numbers, asked three ways."""
    op = g.rng.randrange(4)
    a, b = g.rng.randint(0, 20), g.rng.randint(0, 20)
    if op == 0:
        word, result = "plus", a + b
    elif op == 1:
        a, b = max(a, b), min(a, b)
        word, result = "minus", a - b
    elif op == 2:
        a, b = g.rng.randint(0, 10), g.rng.randint(0, 10)
        word, result = "times", a * b
    else:
        b = g.rng.randint(1, 10)
        a = b * g.rng.randint(0, 10)
        word, result = "divided by", a // b
    phrasing = g.rng.randrange(3)
    if phrasing == 0:
        question = f"What is {a} {word} {b}?"
    elif phrasing == 1:
        question = f"How much is {a} {word} {b}?"
    else:
        question = f"Can you tell me what {a} {word} {b} is?"
    return question, f"{a} {word} {b} is {result}.", str(result)


_QA_SOURCES: tuple[Callable[[Draw], tuple[str, str, str]], ...] = (
    _capital_qa,
    _animal_qa,
    _opposite_qa,
    _calendar_qa,
    _fixed_fact,
    _fixed_fact,
    _fixed_fact,
)


def qa(g: Draw) -> tuple[str, str, str]:
    """(question, full answer, short answer) from one of the question sources (fixed facts weigh most)."""
    return g.pick(_QA_SOURCES)(g)


# ----------------------------------------------------------------------------------------------- chat


def greeting_exchange(g: Draw) -> tuple[str, str]:
    """A greeting, "who are you" or "how are you", and its reply."""
    style = g.rng.randrange(5)
    if style == 0:
        return g.pick(("Who are you?", "What are you?", "What can you do?")), g.pick(banks.WHO_REPLIES)
    if style == 1:
        return g.pick(("How are you?", "How are you today?", "Hi, how are you?")), g.pick(banks.HOW_ARE_YOU_REPLIES)
    greeting = g.pick(banks.GREETINGS)
    if "who are you" in greeting.lower():
        return greeting, "Hello! " + g.pick(banks.WHO_REPLIES)
    if "how are you" in greeting.lower():
        return greeting, g.pick(banks.HOW_ARE_YOU_REPLIES)
    return greeting, g.pick(banks.GREETING_REPLIES)


def gen_greeting(g: Draw) -> Chat:
    question, answer = greeting_exchange(g)
    messages = [*g.system(0.2), *chat_turns(question, answer)]
    if g.chance(0.3):
        messages += chat_turns(g.pick(banks.GOODBYES), g.pick(banks.GOODBYE_REPLIES))
    return messages, []


def gen_fact(g: Draw) -> Chat:
    question, answer, _ = qa(g)
    return [*g.system(0.2), *chat_turns(question, answer)], []


def gen_arithmetic(g: Draw) -> Chat:
    question, answer, _ = arithmetic(g)
    return [*g.system(0.1), *chat_turns(question, answer)], []


def _explanation(g: Draw) -> tuple[str, str]:
    topic, sentences = g.pick(banks.TOPICS)
    ask = g.pick(("Can you explain {t}?", "Explain {t}.", "Tell me about {t}.", "What should I know about {t}?"))
    count = g.rng.randint(2, len(sentences))
    return ask.format(t=topic), " ".join(sentences[:count])


def gen_explain(g: Draw) -> Chat:
    return [*g.system(0.2), *chat_turns(*_explanation(g))], []


def _story(g: Draw) -> tuple[str, str]:
    animal = g.pick(banks.ANIMALS)[0]
    fill = {
        "name": g.name(),
        "animal": animal,
        "adj": g.pick(banks.ADJECTIVES),
        "place": g.pick(banks.PLACES),
        "object": g.pick(banks.OBJECTS),
    }
    parts = (banks.STORY_OPENINGS, banks.STORY_HABITS, banks.STORY_EVENTS, banks.STORY_MIDDLES, banks.STORY_ENDINGS)
    text = " ".join(g.pick(part).format(**fill) for part in parts)
    ask = g.pick(("Tell me a story about a {a}.", "Write a short story about a {a}.", "Tell me a story."))
    return ask.format(a=animal), text


def gen_story(g: Draw) -> Chat:
    return [*g.system(0.1), *chat_turns(*_story(g))], []


def _tips(g: Draw) -> tuple[str, str]:
    topic, tips = g.pick(banks.TIPS)
    count = g.rng.randint(2, min(5, len(tips)))
    number = banks.NUMBER_WORDS[count]
    ask = g.pick(("Give me {n} tips for {t}.", "What are {n} tips for {t}?", "How can I get better at {t}?"))
    lines = "\n".join(f"{i + 1}. {tip}" for i, tip in enumerate(tips[:count]))
    return ask.format(n=number, t=topic), f"Here are {number} tips for {topic}:\n{lines}"


def _list_answer(g: Draw) -> tuple[str, str]:
    what, items = g.pick((("fruits", banks.FRUITS), ("colours", banks.COLOURS), ("vegetables", banks.VEGETABLES)))
    count = g.rng.randint(2, 5)
    chosen = g.rng.sample(list(items), count)
    number = banks.NUMBER_WORDS[count]
    return f"Name {number} {what}.", f"Here are {number} {what}: {', '.join(chosen)}."


def _counting(g: Draw) -> tuple[str, str]:
    end = g.rng.randint(3, 12)
    return f"Count to {banks.NUMBER_WORDS[end]}.", ", ".join(str(i) for i in range(1, end + 1)) + "."


def gen_tips(g: Draw) -> Chat:
    maker = g.pick((_tips, _tips, _list_answer, _counting))
    return [*g.system(0.1), *chat_turns(*maker(g))], []


def gen_multi_turn(g: Draw) -> Chat:
    messages = [*g.system(0.3), *chat_turns(*greeting_exchange(g))]
    makers: tuple[Callable[[Draw], tuple[str, str]], ...] = (
        lambda g: qa(g)[:2],
        lambda g: arithmetic(g)[:2],
        _explanation,
        _tips,
        _story,
        _list_answer,
    )
    for _ in range(g.rng.randint(1, 3)):
        messages += chat_turns(*g.pick(makers)(g))
    if g.chance(0.5):
        messages += chat_turns(g.pick(banks.THANKS), g.pick(banks.THANKS_REPLIES))
    if g.chance(0.15):
        messages += chat_turns(g.pick(("What is the weather today?", "What time is it now?")), g.pick(banks.REFUSALS))
    return messages, []


def gen_prose(g: Draw) -> str:
    style = g.rng.randrange(6)
    if style == 0:
        return _story(g)[1] + "\n"
    if style == 1:
        pairs = [qa(g) for _ in range(g.rng.randint(2, 5))]
        return "".join(f"Question: {q} Answer: {a}\n" for q, a, _ in pairs)
    if style == 2:
        return _explanation(g)[1] + "\n"
    if style == 3:
        city, country, fact = g.pick(banks.CITIES)
        weather = g.pick(banks.WEATHER)
        return (
            f"{city} is the capital of {country}. {fact} Today the weather in {city} is {weather}, "
            f"with a temperature of {g.rng.randint(-5, 32)} degrees.\n"
        )
    if style == 4:
        animal, plural, _, sound, home, food = g.pick(banks.ANIMALS)
        says = f" A {animal} says {sound}." if sound else ""
        return f"The {animal} lives {home}. {plural.capitalize()} eat {food}.{says}\n"
    paragraphs = [p for text in training_texts() for p in text.split("\n\n") if p.strip()]
    start = g.rng.randrange(len(paragraphs))
    return "\n\n".join(paragraphs[start : start + g.rng.randint(1, 2)]).strip() + "\n"


# ----------------------------------------------------------------------------------------------- Python


def _python_function(g: Draw) -> tuple[str, str, str]:
    """(what it does, code, one sentence about it)."""
    v = g.pick(("x", "n", "value", "number", "count"))
    s = g.pick(("text", "word", "s", "line", "name"))
    items = g.pick(("items", "numbers", "values", "data"))
    a, b = g.pick((("a", "b"), ("x", "y"), ("first", "second"), ("left", "right")))
    choices: tuple[tuple[str, str, str], ...] = (
        ("adds two numbers", f"def add({a}, {b}):\n    return {a} + {b}", "It returns the sum of both arguments."),
        ("multiplies two numbers", f"def multiply({a}, {b}):\n    return {a} * {b}", "It returns the product."),
        ("checks if a number is even", f"def is_even({v}):\n    return {v} % 2 == 0",
         "It returns True when the number is even."),
        ("returns the factorial of a number",
         f"def factorial({v}):\n    result = 1\n    for i in range(2, {v} + 1):\n        result *= i\n"
         "    return result",
         "It multiplies the numbers from 2 up to the argument."),
        ("reverses a string", f"def reverse({s}):\n    return {s}[::-1]", "The slice with step -1 walks backwards."),
        ("counts the vowels in a string",
         f"def count_vowels({s}):\n    return sum(1 for c in {s}.lower() if c in \"aeiou\")",
         "It counts every character that is a vowel."),
        ("finds the largest number in a list",
         f"def largest({items}):\n    best = {items}[0]\n    for item in {items}:\n        if item > best:\n"
         "            best = item\n    return best",
         "It keeps the largest value seen so far."),
        ("returns the average of a list", f"def average({items}):\n    return sum({items}) / len({items})",
         "It divides the sum by the number of values."),
        ("greets a person by name", f"def greet({s}):\n    return f\"Hello, {{{s}}}!\"",
         "It uses an f-string to put the name into the greeting."),
        ("converts Celsius to Fahrenheit", f"def to_fahrenheit({v}):\n    return {v} * 9 / 5 + 32",
         "It multiplies by nine fifths and adds 32."),
        ("checks if a word is a palindrome", f"def is_palindrome({s}):\n    return {s} == {s}[::-1]",
         "A palindrome reads the same in both directions."),
        ("keeps only the positive numbers of a list",
         f"def positive({items}):\n    return [item for item in {items} if item > 0]",
         "The list comprehension keeps the items greater than zero."),
        ("counts the words in a text", f"def count_words({s}):\n    return len({s}.split())",
         "split breaks the text at spaces."),
        ("returns the first n Fibonacci numbers",
         f"def fibonacci({v}):\n    result = [0, 1]\n    while len(result) < {v}:\n"
         "        result.append(result[-1] + result[-2])\n    return result[:" + v + "]",
         "Each number is the sum of the two before it."),
        ("reads a JSON file",
         "import json\n\n\ndef read_json(path):\n    with open(path, encoding=\"utf-8\") as handle:\n"
         "        return json.load(handle)",
         "json.load parses the file into Python objects."),
    )  # fmt: skip
    return g.pick(choices)


def _python_class(g: Draw) -> str:
    name = g.pick(("Counter", "Stack", "Queue"))
    if name == "Counter":
        return (
            "class Counter:\n    def __init__(self, start=0):\n        self.value = start\n\n"
            "    def increment(self, step=1):\n        self.value += step\n        return self.value\n"
        )
    if name == "Stack":
        return (
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
            "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
        )
    return (
        "from collections import deque\n\n\nclass Queue:\n    def __init__(self):\n        self.items = deque()\n\n"
        "    def put(self, item):\n        self.items.append(item)\n\n    def get(self):\n"
        "        return self.items.popleft()\n"
    )


def gen_python(g: Draw) -> Made:
    if g.chance(0.25):
        return _python_class(g) if g.chance(0.3) else _python_function(g)[1] + "\n"
    what, code, note = _python_function(g)
    ask = g.pick(("Write a Python function that {w}.", "How do I write a function in Python that {w}?"))
    answer = f"Here is a function that {what}:\n\n```python\n{code}\n```\n\n{note}"
    return [*g.system(0.1), *chat_turns(ask.format(w=what), answer)], []
