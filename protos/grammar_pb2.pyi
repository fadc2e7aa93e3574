from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EntryCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENTRY_CODE_UNSPECIFIED: _ClassVar[EntryCode]
    OK: _ClassVar[EntryCode]
    STALE_ORDINAL: _ClassVar[EntryCode]
    FUTURE_ORDINAL: _ClassVar[EntryCode]
    AHEAD: _ClassVar[EntryCode]
    BEHIND_DEADLINE: _ClassVar[EntryCode]
    RELEASED: _ClassVar[EntryCode]
    UNKNOWN: _ClassVar[EntryCode]
    REJECTED: _ClassVar[EntryCode]
    TERMINATED: _ClassVar[EntryCode]
    INVALID_ARGUMENT: _ClassVar[EntryCode]
    ALREADY_EXISTS: _ClassVar[EntryCode]
    DEADLINE_EXCEEDED: _ClassVar[EntryCode]
    INTERNAL: _ClassVar[EntryCode]
    NO_SESSION: _ClassVar[EntryCode]

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKind]
    JSON_SCHEMA: _ClassVar[ConstraintKind]
    REGEX: _ClassVar[ConstraintKind]
    EBNF: _ClassVar[ConstraintKind]
    STRUCTURAL_TAG: _ClassVar[ConstraintKind]

class JsonSchemaMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JSON_SCHEMA_MODE_UNSPECIFIED: _ClassVar[JsonSchemaMode]
    JSON_SCHEMA_STRICT: _ClassVar[JsonSchemaMode]
    JSON_SCHEMA_CHECKED: _ClassVar[JsonSchemaMode]
    JSON_SCHEMA_LOOSE: _ClassVar[JsonSchemaMode]
ENTRY_CODE_UNSPECIFIED: EntryCode
OK: EntryCode
STALE_ORDINAL: EntryCode
FUTURE_ORDINAL: EntryCode
AHEAD: EntryCode
BEHIND_DEADLINE: EntryCode
RELEASED: EntryCode
UNKNOWN: EntryCode
REJECTED: EntryCode
TERMINATED: EntryCode
INVALID_ARGUMENT: EntryCode
ALREADY_EXISTS: EntryCode
DEADLINE_EXCEEDED: EntryCode
INTERNAL: EntryCode
NO_SESSION: EntryCode
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKind
JSON_SCHEMA: ConstraintKind
REGEX: ConstraintKind
EBNF: ConstraintKind
STRUCTURAL_TAG: ConstraintKind
JSON_SCHEMA_MODE_UNSPECIFIED: JsonSchemaMode
JSON_SCHEMA_STRICT: JsonSchemaMode
JSON_SCHEMA_CHECKED: JsonSchemaMode
JSON_SCHEMA_LOOSE: JsonSchemaMode

class Constraint(_message.Message):
    __slots__ = ("kind", "text", "json_schema_mode")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_MODE_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKind
    text: str
    json_schema_mode: JsonSchemaMode
    def __init__(self, kind: _Optional[_Union[ConstraintKind, str]] = ..., text: _Optional[str] = ..., json_schema_mode: _Optional[_Union[JsonSchemaMode, str]] = ...) -> None: ...

class OpenEntry(_message.Message):
    __slots__ = ("request_id", "constraint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    constraint: Constraint
    def __init__(self, request_id: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("entries", "deadline_ms", "session")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[OpenEntry]
    deadline_ms: int
    session: str
    def __init__(self, entries: _Optional[_Iterable[_Union[OpenEntry, _Mapping]]] = ..., deadline_ms: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class OpenResult(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: EntryCode
    message: str
    def __init__(self, code: _Optional[_Union[EntryCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class OpenReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[OpenResult]
    def __init__(self, results: _Optional[_Iterable[_Union[OpenResult, _Mapping]]] = ...) -> None: ...

class CommitEntry(_message.Message):
    __slots__ = ("request_id", "from_ordinal", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_ordinal: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., from_ordinal: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CommitEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[CommitEntry, _Mapping]]] = ...) -> None: ...

class CommitResult(_message.Message):
    __slots__ = ("code", "message", "accepted", "terminated", "rejected_token", "new_ordinal", "violation")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEW_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    code: EntryCode
    message: str
    accepted: int
    terminated: bool
    rejected_token: int
    new_ordinal: int
    violation: str
    def __init__(self, code: _Optional[_Union[EntryCode, str]] = ..., message: _Optional[str] = ..., accepted: _Optional[int] = ..., terminated: _Optional[bool] = ..., rejected_token: _Optional[int] = ..., new_ordinal: _Optional[int] = ..., violation: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CommitResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CommitResult, _Mapping]]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class MaskEntry(_message.Message):
    __slots__ = ("request_id", "ordinal", "draft")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ordinal: int
    draft: DraftTree
    def __init__(self, request_id: _Optional[str] = ..., ordinal: _Optional[int] = ..., draft: _Optional[_Union[DraftTree, _Mapping]] = ...) -> None: ...

class FillMasksRequest(_message.Message):
    __slots__ = ("entries", "deadline_ms")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[MaskEntry]
    deadline_ms: int
    def __init__(self, entries: _Optional[_Iterable[_Union[MaskEntry, _Mapping]]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class MaskResult(_message.Message):
    __slots__ = ("code", "message", "row_refs")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROW_REFS_FIELD_NUMBER: _ClassVar[int]
    code: EntryCode
    message: str
    row_refs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, code: _Optional[_Union[EntryCode, str]] = ..., message: _Optional[str] = ..., row_refs: _Optional[_Iterable[int]] = ...) -> None: ...

class FillMasksReply(_message.Message):
    __slots__ = ("words_per_row", "rows", "results")
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    words_per_row: int
    rows: _containers.RepeatedScalarFieldContainer[bytes]
    results: _containers.RepeatedCompositeFieldContainer[MaskResult]
    def __init__(self, words_per_row: _Optional[int] = ..., rows: _Optional[_Iterable[bytes]] = ..., results: _Optional[_Iterable[_Union[MaskResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("codes",)
    CODES_FIELD_NUMBER: _ClassVar[int]
    codes: _containers.RepeatedScalarFieldContainer[EntryCode]
    def __init__(self, codes: _Optional[_Iterable[_Union[EntryCode, str]]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class GrammarState(_message.Message):
    __slots__ = ("num_open", "vocab_size", "words_per_row", "compile_cache_hits", "compile_cache_misses", "compile_cache_entries", "num_waiting", "num_sessions", "instance_id", "session_held")
    NUM_OPEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_HELD_FIELD_NUMBER: _ClassVar[int]
    num_open: int
    vocab_size: int
    words_per_row: int
    compile_cache_hits: int
    compile_cache_misses: int
    compile_cache_entries: int
    num_waiting: int
    num_sessions: int
    instance_id: str
    session_held: bool
    def __init__(self, num_open: _Optional[int] = ..., vocab_size: _Optional[int] = ..., words_per_row: _Optional[int] = ..., compile_cache_hits: _Optional[int] = ..., compile_cache_misses: _Optional[int] = ..., compile_cache_entries: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_sessions: _Optional[int] = ..., instance_id: _Optional[str] = ..., session_held: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class SessionGrant(_message.Message):
    __slots__ = ("session", "instance_id", "vocab_size")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    session: str
    instance_id: str
    vocab_size: int
    def __init__(self, session: _Optional[str] = ..., instance_id: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("commit", "fill_masks", "release")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    FILL_MASKS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    commit: CommitRequest
    fill_masks: FillMasksRequest
    release: ReleaseRequest
    def __init__(self, commit: _Optional[_Union[CommitRequest, _Mapping]] = ..., fill_masks: _Optional[_Union[FillMasksRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class StreamReply(_message.Message):
    __slots__ = ("commit", "fill_masks", "release")
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    FILL_MASKS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    commit: CommitReply
    fill_masks: FillMasksReply
    release: ReleaseReply
    def __init__(self, commit: _Optional[_Union[CommitReply, _Mapping]] = ..., fill_masks: _Optional[_Union[FillMasksReply, _Mapping]] = ..., release: _Optional[_Union[ReleaseReply, _Mapping]] = ...) -> None: ...
