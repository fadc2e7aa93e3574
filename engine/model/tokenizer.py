"""The engine's tokenizer: a `tokenizers.Tokenizer` plus what the checkpoint folder says about it.

A Hugging Face checkpoint spreads tokenizer facts over several files: the vocabulary and merges in
``tokenizer.json``, the named special tokens and the chat template in ``tokenizer_config.json`` (or a
``chat_template.jinja`` beside it), and the end-of-sequence ids in ``generation_config.json`` and
``config.json``. :class:`Tokenizer` reads them all once so that the rest of the engine asks one object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import CheckpointError, InvalidRequestError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The named special tokens a chat template may refer to, as Hugging Face passes them to templates.
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenizer:
    """Encodes and decodes text for one checkpoint and renders its chat template.

    Build it with :meth:`from_dir`. ``eos_token_ids`` is the union of every end-of-sequence id the folder
    declares, because checkpoints disagree about where they put them (a chat model often ends turns with
    a different token than the one ``config.json`` names) and generation must stop at any of them.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        path: Path,
        named_special_tokens: Mapping[str, str],
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        pad_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._path = path
        self._named_special_tokens = dict(named_special_tokens)
        self._eos_token_ids = eos_token_ids
        self._bos_token_id = bos_token_id
        self._pad_token_id = pad_token_id
        self._chat_template = chat_template
        # Compiled once: templates are immutable and compiling costs far more than rendering.
        self._compiled_template = _compile_template(chat_template) if chat_template is not None else None
        self._special_token_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the checkpoint folder ``path``.

        Raises :class:`CheckpointError` if ``tokenizer.json`` is missing or a config file is not JSON.
        """
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file}: missing; a checkpoint needs a fast-tokenizer file")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises plain Exception on a malformed file
            raise CheckpointError(f"{tokenizer_file}: cannot be parsed: {error}") from error
        tokenizer_config = _read_optional_json(folder / TOKENIZER_CONFIG_FILE)
        generation_config = _read_optional_json(folder / GENERATION_CONFIG_FILE)
        model_config = _read_optional_json(folder / MODEL_CONFIG_FILE)
        named = _named_special_tokens(tokenizer_config)
        return cls(
            backend,
            path=folder,
            named_special_tokens=named,
            eos_token_ids=_eos_token_ids(backend, named, generation_config, model_config),
            bos_token_id=_first_known_id(backend, named.get("bos_token"), generation_config, model_config, "bos"),
            pad_token_id=_first_known_id(backend, named.get("pad_token"), generation_config, model_config, "pad"),
            chat_template=_chat_template(folder, tokenizer_config),
        )

    @property
    def path(self) -> Path:
        """The checkpoint folder this tokenizer was loaded from."""
        return self._path

    @property
    def vocab_size(self) -> int:
        """Number of token ids, counting added tokens (special tokens included)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (tokenizer_config ∪ generation_config ∪ config.json)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens flagged special: exactly those ``skip_special_tokens`` drops."""
        return self._special_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (an added token's content or a raw BPE token), or None."""
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings inside ``text`` always map to their single ids;
        ``add_special_tokens`` only controls what the checkpoint's post-processor adds (such as a BOS)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template, as Hugging Face would.

        ``tools`` are OpenAI tool definitions (``{"type": "function", "function": {...}}``), passed to the
        template as ``tools`` exactly as `transformers` and the smg gateway pass them; None (or empty) when the
        request has none. Raises ValueError if the checkpoint has no template, and :class:`InvalidRequestError`
        (field ``messages``) if the template rejects the conversation (templates call ``raise_exception``).
        """
        if self._compiled_template is None:
            raise ValueError(f"{self._path}: the checkpoint has no chat template (tokenizer_config.json)")
        variables: dict[str, Any] = dict(self._named_special_tokens)
        variables["messages"] = [dict(message) for message in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        variables["tools"] = [dict(tool) for tool in tools] if tools else None
        try:
            return str(self._compiled_template.render(**variables))
        except jinja2.TemplateError as error:
            raise InvalidRequestError("messages", f"the chat template rejected them: {error}") from error


def _raise_template_error(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes characters like '<'; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with the same settings and helpers Hugging Face provides,
    so that templates written for `transformers` render the same text here."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_template_error
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise CheckpointError(f"chat template does not compile: {error}") from error


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON: {error}") from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(loaded).__name__}")
    return loaded


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _named_special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    named: dict[str, str] = {}
    for key in _NAMED_SPECIAL_TOKENS:
        content = _token_content(tokenizer_config.get(key))
        if content is not None:
            named[key] = content
    return named


def _ids_of(value: object) -> set[int]:
    """An id field that may be absent, an int, or a list of ints (as in generation_config.json)."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {item for item in value if isinstance(item, int) and not isinstance(item, bool)}
    return set()


def _eos_token_ids(
    backend: tokenizers.Tokenizer,
    named: Mapping[str, str],
    generation_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
) -> frozenset[int]:
    ids = _ids_of(generation_config.get("eos_token_id")) | _ids_of(model_config.get("eos_token_id"))
    eos_token = named.get("eos_token")
    if eos_token is not None:
        token_id = backend.token_to_id(eos_token)
        if token_id is not None:
            ids.add(int(token_id))
    return frozenset(ids)


def _first_known_id(
    backend: tokenizers.Tokenizer,
    token: str | None,
    generation_config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    kind: str,
) -> int | None:
    """The tokenizer_config token wins (it is what the template and the post-processor use); the id
    fields of generation_config.json and config.json are fallbacks."""
    if token is not None:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    for config in (generation_config, model_config):
        value = config.get(f"{kind}_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The template from tokenizer_config.json (a string, or a list of named templates where
    "default" is the one to use), else from chat_template.jinja, which newer `transformers` writes."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                source = entry.get("template")
                return source if isinstance(source, str) else None
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return None
