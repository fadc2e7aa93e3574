"""The built-in training text for the embedded default model's byte-level BPE tokenizer.

The text is fixed and written here (no download) so that the trained tokenizer is identical on every
machine. It mixes English prose, Python code, JSON, numbers and punctuation so that common words, code
keywords and JSON punctuation each earn merges. Changing anything here changes the embedded model's
cache key (the spec hash covers this text), so a stale build is never reused.
"""

from __future__ import annotations

_PROSE = """\
The morning was quiet in the small town by the river. A baker opened the shop at six, and the smell of
fresh bread drifted down the street. Children walked to school with their bags over their shoulders, and
an old man sat on a bench to read the newspaper. Nobody was in a hurry; the day had only just begun.

When you write a letter to a friend, you do not need long words. Say what you mean, and say it plainly.
A good sentence has a subject, a verb, and often an object. The best writers revise their work many
times before they are happy with it. They read it aloud, they cut what is not needed, and they keep
what is clear.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Which planet is closest to the sun? Answer: Mercury is the closest planet to the sun.
Question: Who wrote the program? Answer: The team wrote it together over several months.

Science is a way of asking questions about the world and testing the answers. An experiment should be
repeatable: if another person follows the same steps, they should see the same result. Good notes make
that possible. Record the date, the time, the temperature, and every change you make along the way.

The weather today will be cloudy in the morning with some rain in the afternoon. Temperatures will stay
between twelve and eighteen degrees. Tomorrow should be warmer and mostly sunny, with a light wind from
the west. People who plan to travel this weekend should check the forecast again on Friday evening.

She opened the door and looked outside. "Is anyone there?" she asked. There was no answer, only the
sound of the wind in the trees. She waited for a moment, then closed the door and went back to her book.
It was a long story about a ship, a storm, and a captain who would not give up.

Learning a new language takes patience. At first every word is strange, and the grammar seems to have
more exceptions than rules. But after a few weeks, simple phrases start to feel natural. You can order
food, ask for directions, and greet your neighbours. The important thing is to practise a little every day.

A computer does exactly what it is told, which is both its strength and its weakness. If the instructions
are correct, the result is reliable and fast. If there is a mistake, the computer will repeat that
mistake millions of times without complaint. That is why programmers test their code carefully.

The history of the city goes back more than a thousand years. Merchants came from the north and the
south to trade wool, salt, and wine. The old market square is still there, and on Saturdays farmers sell
vegetables, cheese, and honey under the same stone arches that their ancestors used.

Thank you for your message. I am happy to help with your question. Here is a short summary of the main
points: first, the system accepts requests in order; second, each request has an identifier; third, the
response includes the generated text and the reason the generation stopped. Please let me know if you
have any other questions, and I will do my best to answer them.

User: Can you explain how a model generates text?
Assistant: A language model reads the prompt as a sequence of tokens. At each step it predicts a
probability for every token in its vocabulary, picks one, appends it, and repeats until it produces an
end token or reaches the maximum length. Sampling settings such as temperature, top-k and top-p control
how adventurous the choices are.

User: Why does the temperature matter?
Assistant: A low temperature makes the most likely token even more likely, so the output is steady and
predictable. A high temperature flattens the distribution, which gives more variety but also more errors.
A temperature of zero means the model always takes the single most likely token.

Once upon a time there was a fox who lived at the edge of a forest. Every evening he climbed the hill to
watch the lights of the village. One night he saw a lantern moving across the field, and he followed it
until he came to a little house with a garden full of apples. What happened next is another story.

Rules for the reading room: please keep your voice low, do not bring food or drinks, and return every
book to the desk when you are finished. The room opens at nine in the morning and closes at five in the
afternoon, except on public holidays, when it is closed all day.

The engine schedules work in small steps. Each step takes the waiting requests, decides which of them fit
in memory, runs the model once for all of them together, and then streams the new tokens back to the
clients. When a request finishes, its memory is released and another request can start. Keeping every
step short means that nobody waits long for the first token, even when the server is busy.

Gardening teaches patience too. Seeds planted in spring need water, light and good soil, and they will not
grow faster because you watch them. In summer the beans climb their poles, the tomatoes turn red, and the
bees move from flower to flower. By autumn the shelves are full of jars, and the garden rests until the
next year.
"""

_CODE = '''\
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Request:
    """One generation request with its identifier and prompt."""

    request_id: str
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    stop: tuple[str, ...] = ()


def read_config(path: Path) -> dict[str, Any]:
    """Return the parsed JSON object stored at ``path``."""
    with open(path, "r", encoding="utf-8") as handle:
        return json.load(handle)


def count_words(lines: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        for word in line.split():
            word = word.strip(".,;:!?").lower()
            if not word:
                continue
            counts[word] = counts.get(word, 0) + 1
    return counts


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value

    def reset(self) -> None:
        self.value = 0


def fibonacci(n: int) -> list[int]:
    if n <= 0:
        return []
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


def find_first(items: list[int], target: int) -> Optional[int]:
    for index, item in enumerate(items):
        if item == target:
            return index
    return None


def main() -> None:
    config = read_config(Path(os.environ.get("CONFIG", "config.json")))
    print(f"loaded {len(config)} keys")
    for key, value in sorted(config.items()):
        print(key, "=", value)
    try:
        numbers = fibonacci(int(config.get("count", 10)))
    except (TypeError, ValueError) as error:
        raise SystemExit(f"bad count: {error}")
    else:
        print("sum:", sum(numbers))
    finally:
        print("done")


if __name__ == "__main__":
    main()
'''

_JSON = """\
{"id": "req-0001", "object": "text_completion", "created": 1700000000, "model": "tiny"}
{"name": "Alice", "age": 30, "email": "alice@example.com", "active": true, "tags": ["admin", "user"]}
{"name": "Bob", "age": 25, "email": null, "active": false, "tags": []}
{"role": "user", "content": "Hello, how are you?"}
{"role": "assistant", "content": "I am fine, thank you. How can I help you today?"}
{"role": "system", "content": "You are a helpful assistant."}
{"choices": [{"index": 0, "text": "Paris", "finish_reason": "stop", "logprobs": null}]}
{"usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}
{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
 "required": ["city"]}
{"error": {"code": 400, "message": "max_tokens must be positive", "field": "max_tokens"}}
[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
[{"x": 0.5, "y": -1.25}, {"x": 3.75, "y": 2.0}, {"x": -0.125, "y": 10.5}]
{"temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_new_tokens": 128, "seed": 42, "stream": true}
{
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 256,
  "num_attention_heads": 8,
  "vocab_size": 2048,
  "items": [
    {"key": "alpha", "value": 1},
    {"key": "beta", "value": 2},
    {"key": "gamma", "value": 3}
  ]
}
"""

_NUMBERS_AND_PUNCTUATION = """\
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 64 75 100 128 256 512 1000 1024 2048 4096
3.14159 2.71828 1.41421 0.5 0.25 0.125 -1 -2 -10 1e-5 1e6 99.9% 50% $12.50 $100 #1 #42 @home
2024-01-15 2025-06-30 12:30 09:45:10 +1 (555) 010-9999 v1.2.3 192.168.0.1
1 + 1 = 2; 2 * 3 = 6; 10 / 4 = 2.5; 7 - 9 = -2; 2 ** 10 = 1024; 17 % 5 = 2; x <= y; a >= b; i != j
Hello, world! Yes? No. Well... maybe; perhaps: (a) first, [b] second, {c} third. "quoted" 'single' `code`
a & b | c ^ d ~e <tag> </tag> path/to/file.txt C:\\temp\\file.log user_name snake_case CamelCase kebab-case
-- == => -> :: ** ++ // /* */ <!-- --> ... ??? !!! ,,, ;;
Café, naïve, résumé, jalapeño, Zürich, São Paulo, Ελλάδα, Москва, 東京,
😀 👍 🚀 — “quotes” ‘apostrophes’ … €5 £3 ¥100
"""


def _counting_lines() -> str:
    """Return short arithmetic facts, generated deterministically, so that numbers get merges."""
    lines = [f"{a} + {b} = {a + b}" for a in range(0, 40, 3) for b in range(0, 40, 7)]
    lines += [f"item {i}: price {i * 3}.{i % 10}9, quantity {i % 12 + 1}" for i in range(60)]
    return "\n".join(lines) + "\n"


def training_texts() -> tuple[str, ...]:
    """Return the corpus as a fixed tuple of documents, in a fixed order."""
    return (_PROSE, _CODE, _JSON, _NUMBERS_AND_PUNCTUATION, _counting_lines())
