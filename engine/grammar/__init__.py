"""Grammar-constrained decoding with xgrammar, as a versioned commit protocol (contracts C2, C3, C5, C6, C13).

:class:`Constraint` names a grammar; :class:`ConstraintCompiler` compiles it (cached, off the caller's thread,
bounded); :class:`VersionedMatcher` is one request's grammar state at its ordinal; :class:`GrammarRegistry`
holds every open matcher and fences mask requests to the exact version they name. :class:`JsonSchemaPolicy`
rewrites a JSON schema into a form xgrammar enforces exactly; what it cannot make exact is refused
(:class:`JsonSchemaMode` STRICT) or checked on the output (CHECKED, a :class:`Violation` ends the request).
"""

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.grammar.compiler import (
    CompiledConstraint,
    CompilerConfig,
    CompileStats,
    ConstraintCompiler,
    load_tokenizer_info,
)
from engine.grammar.enforcement import Enforcement, EnforcementObserver
from engine.grammar.matcher import MatcherState, VersionedMatcher
from engine.grammar.registry import GrammarRegistry, MaskFence
from engine.grammar.schema import JsonSchemaPolicy, PolicyOutcome, Unenforced, UnenforcedSchemaError
from engine.grammar.schema.integer_range import IntegerRange
from engine.grammar.violation import Violation
from engine.grammar_calls import (
    CommitEntry,
    CommitOutcome,
    CommitResult,
    DraftTree,
    GrammarProtocolError,
    GrammarTimeoutError,
    InvalidGrammarError,
    MaskEntry,
    MaskOutcome,
    MaskRefusals,
    MaskRows,
    Refusal,
    mask_buffer,
    mask_outcomes,
    words_per_row,
)

__all__ = [
    "CommitEntry",
    "CommitOutcome",
    "CommitResult",
    "CompileStats",
    "CompiledConstraint",
    "CompilerConfig",
    "Constraint",
    "ConstraintCompiler",
    "ConstraintKind",
    "DraftTree",
    "Enforcement",
    "EnforcementObserver",
    "GrammarProtocolError",
    "GrammarRegistry",
    "GrammarTimeoutError",
    "IntegerRange",
    "InvalidGrammarError",
    "JsonSchemaMode",
    "JsonSchemaPolicy",
    "MaskEntry",
    "MaskFence",
    "MaskOutcome",
    "MaskRefusals",
    "MaskRows",
    "MatcherState",
    "PolicyOutcome",
    "Refusal",
    "Unenforced",
    "UnenforcedSchemaError",
    "VersionedMatcher",
    "Violation",
    "load_tokenizer_info",
    "mask_buffer",
    "mask_outcomes",
    "words_per_row",
]
