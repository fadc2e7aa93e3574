"""Compiling constraints into xgrammar grammars: once per distinct constraint, off the caller's thread, bounded.

Compiling a JSON schema against a 100k+ vocabulary can take from milliseconds to seconds, so it never runs on
the caller's thread (in the services that would be the event loop): :meth:`ConstraintCompiler.submit` hands it
to a small pool and returns a future; :meth:`ConstraintCompiler.compile` waits for it up to a deadline. Results
are cached by :attr:`Constraint.cache_key` and in-flight compiles are shared, so a burst of requests with the
same schema (a tool list, ``json_object``) compiles it once. A grammar xgrammar refuses is cached as well: its
refusal is as deterministic as a success, and recompiling it per request would only cost time.

A JSON schema is compiled in its mode (the request's, else the config's; :mod:`engine.grammar.json_schema_compiler`):
xgrammar 0.2.9 compiles some keywords into a grammar looser than the schema, so strict mode rewrites the schema into
a form xgrammar enforces exactly or refuses it, checked mode compiles the closest such form and checks the rest on
the output, loose mode compiles it as given. The constraint's text stays as the request gave it; only what xgrammar
compiles is rewritten; integers a schema leaves unbounded are bounded to +-(2^53 - 1) unless the config's
``json_integer_range`` is UNBOUNDED. Every JSON grammar bounds the whitespace between tokens
(``CompilerConfig.json_max_whitespace``, 8 characters in a row by default), so that a model unsure of the next
token cannot fill ``max_tokens`` with newlines. One compiler has one config, so the cache key (the constraint's,
mode included) needs nothing more.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from pathlib import Path

import xgrammar as xgr

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.grammar.enforcement import Enforcement
from engine.grammar.json_schema_compiler import DEFAULT_JSON_MAX_WHITESPACE, JsonSchemaCompiler
from engine.grammar.schema import JsonSchemaPolicy, UnenforcedSchemaError
from engine.grammar.schema.integer_range import IntegerRange
from engine.grammar.schema_check import SchemaCheck, SchemaCheckError
from engine.grammar_calls import GrammarTimeoutError, InvalidGrammarError, words_per_row
from engine.model.folder import model_vocab_size

# xgrammar prefixes its messages with a log header ("[12:00:00] /project/cpp/x.cc:123: ") and sometimes the
# failed check's expression; neither helps the person who wrote the grammar.
_LOG_HEADER = re.compile(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def load_tokenizer_info(model_dir: str | Path) -> xgr.TokenizerInfo:
    """xgrammar's view of the served model's tokenizer, sized to the model's vocabulary.

    The stop tokens are every end-of-sequence id the checkpoint declares (the engine stops at any of them), so
    a completed grammar allows exactly those.
    """
    import transformers  # deferred: importing it costs seconds and only this loader needs it

    from engine.model.tokenizer import Tokenizer

    folder = Path(model_dir)
    vocab_size = model_vocab_size(folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    stop_ids = sorted(i for i in Tokenizer.from_dir(folder).eos_token_ids if i < vocab_size)
    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None)


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one vocabulary: what a matcher is built from."""

    constraint: Constraint
    grammar: xgr.CompiledGrammar
    compile_s: float  # wall time of the compile that produced it (a cache hit reports the original)
    check: SchemaCheck | None = None  # checked mode: what every output is checked against
    enforcement: Enforcement | None = None  # JSON schemas: what the grammar enforces and what it does not

    @property
    def vocab_size(self) -> int:
        return int(self.grammar.tokenizer_info.vocab_size)


@dataclass(frozen=True)
class CompilerConfig:
    """How much compiling may run at once, how many compiled grammars are kept, and how JSON schemas are read."""

    workers: int = 2  # constraints compiled concurrently
    threads_per_compile: int = 2  # xgrammar's own threads inside one compile
    cache_entries: int = 512
    # How a JSON schema is served when the request does not say (JsonSchemaMode): CHECKED by default, since it
    # accepts every schema xgrammar compiles (but for $refs to other documents) and never lets an invalid output
    # finish with "stop"; STRICT refuses what xgrammar cannot enforce exactly; LOOSE is SGLang's behaviour.
    json_schema_mode: JsonSchemaMode = JsonSchemaMode.CHECKED
    json_schema_policy: JsonSchemaPolicy = field(default_factory=JsonSchemaPolicy)
    # What an integer a JSON schema leaves unbounded may be: SAFE keeps it within +-(2^53 - 1), exact for every client
    # that reads numbers as doubles (see engine.grammar.schema.integer_range); UNBOUNDED compiles schemas as given.
    json_integer_range: IntegerRange = IntegerRange.SAFE
    # Whitespace characters a JSON grammar allows in a row between tokens (json_schema, json_object, tool calls);
    # None: any number, xgrammar's own default (see engine.grammar.json_schema_compiler).
    json_max_whitespace: int | None = DEFAULT_JSON_MAX_WHITESPACE

    def __post_init__(self) -> None:
        if self.workers < 1 or self.threads_per_compile < 1 or self.cache_entries < 1:
            raise ValueError("CompilerConfig values must be >= 1")
        if self.json_max_whitespace is not None and self.json_max_whitespace < 1:
            raise ValueError(
                f"json_max_whitespace must be >= 1, or None for unbounded whitespace; got {self.json_max_whitespace}"
            )


@dataclass(frozen=True)
class CompileStats:
    """Cache counters: a hit is a submit answered by an existing (finished or in-flight) compile."""

    hits: int
    misses: int
    entries: int


class ConstraintCompiler:
    """Compiles constraints for one tokenizer, with a bounded cache keyed by :attr:`Constraint.cache_key`."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, config: CompilerConfig = CompilerConfig()) -> None:
        self._config = config
        # xgrammar's own cache is off: ours is keyed by constraint, bounded, and shares in-flight compiles.
        self._xgr = xgr.GrammarCompiler(tokenizer_info, max_threads=config.threads_per_compile, cache_enabled=False)
        self._json_schemas = JsonSchemaCompiler(
            self._xgr,
            tokenizer_info.decoded_vocab,
            config.json_schema_policy,
            config.json_schema_mode,
            config.json_integer_range,
            config.json_max_whitespace,
        )
        self._vocab_size = int(tokenizer_info.vocab_size)
        self._pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[CompiledConstraint]] = OrderedDict()
        self._hits = 0
        self._misses = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: CompilerConfig = CompilerConfig()) -> ConstraintCompiler:
        return cls(load_tokenizer_info(model_dir), config)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def words_per_row(self) -> int:
        return words_per_row(self._vocab_size)

    def submit(self, constraint: Constraint) -> Future[CompiledConstraint]:
        """The compile of ``constraint``: a cached or in-flight one if any, else a new one on the pool.

        The future fails with :class:`InvalidGrammarError` when xgrammar refuses the grammar.
        """
        key = constraint.cache_key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return cached
            self._misses += 1
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            self._evict_locked()
        future.add_done_callback(lambda done: self._forget_if_unexpected(key, done))
        return future

    def compile(self, constraint: Constraint, timeout_s: float) -> CompiledConstraint:
        """Compile (or fetch) ``constraint``, waiting at most ``timeout_s`` seconds.

        Raises :class:`InvalidGrammarError` for a grammar xgrammar refuses and :class:`GrammarTimeoutError` when
        the deadline passes first.
        """
        future = self.submit(constraint)
        try:
            return future.result(timeout=max(0.0, timeout_s))
        except FutureTimeoutError:
            raise GrammarTimeoutError(
                f"compiling {constraint.describe()} took longer than {timeout_s:.3f}s; it goes on in the background"
            ) from None

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(hits=self._hits, misses=self._misses, entries=len(self._cache))

    def shutdown(self) -> None:
        """Stop compiling: queued compiles are cancelled, a running one finishes on its own thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- internals

    def _compile(self, constraint: Constraint) -> CompiledConstraint:
        start = time.perf_counter()
        try:
            if constraint.kind is ConstraintKind.JSON_SCHEMA:
                compiled = self._json_schemas.compile(constraint.text, constraint.json_schema_mode)
                grammar, check, enforcement = compiled.grammar, compiled.check, compiled.enforcement
            else:
                grammar, check, enforcement = self._compile_xgrammar(constraint), None, None
        except (UnenforcedSchemaError, SchemaCheckError) as error:  # the policy's refusal, in its final words
            raise InvalidGrammarError(constraint.kind, str(error)) from None
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's refusals, whatever the language
            raise InvalidGrammarError(constraint.kind, clean_reason(str(error))) from None
        return CompiledConstraint(constraint, grammar, time.perf_counter() - start, check, enforcement)

    def _compile_xgrammar(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind, text = constraint.kind, constraint.text
        if kind is ConstraintKind.REGEX:
            return self._xgr.compile_regex(text)
        if kind is ConstraintKind.EBNF:
            return self._xgr.compile_grammar(text)
        return self._xgr.compile_structural_tag(text)

    def _evict_locked(self) -> None:
        """Drop the least recently used finished compiles beyond the cap; in-flight ones are never dropped."""
        excess = len(self._cache) - self._config.cache_entries
        if excess <= 0:
            return
        for key in [k for k, f in self._cache.items() if f.done()][:excess]:
            del self._cache[key]

    def _forget_if_unexpected(self, key: str, future: Future[CompiledConstraint]) -> None:
        """Only successes and grammar refusals are cached; any other failure may not happen again."""
        if future.cancelled() or not isinstance(future.exception(), InvalidGrammarError | type(None)):
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]


def clean_reason(message: str) -> str:
    """xgrammar's message without its log header and check expression, on one line."""
    lines = [_CHECK_FAILED.sub("", _LOG_HEADER.sub("", line.strip())) for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line) or "xgrammar refused the grammar"
