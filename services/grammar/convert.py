"""Grammar protocol messages <-> engine grammar values, for both the service and its client.

Mask rows travel packed: each distinct row once per reply as little-endian int32 words, every entry naming its
rows by index, and a row that allows every token as the reference -1 with no data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.constraint import Constraint, ConstraintKind, JsonSchemaMode
from engine.errors import InvalidRequestError
from engine.grammar_calls import (
    CommitEntry,
    CommitOutcome,
    CommitResult,
    DraftTree,
    GrammarProtocolError,
    MaskEntry,
    MaskOutcome,
    MaskRefusals,
    Refusal,
    mask_buffer,
    mask_outcomes,
)
from protos import grammar_pb2 as pb

FULL_ROW_REF = -1  # a row with every bit set: sent as this reference only
_WORD = np.dtype("<i4")  # the wire's word: little-endian int32, whatever the host's byte order

REFUSAL_CODES: dict[Refusal, pb.EntryCode] = {
    Refusal.STALE_ORDINAL: pb.STALE_ORDINAL,
    Refusal.FUTURE_ORDINAL: pb.FUTURE_ORDINAL,
    Refusal.AHEAD: pb.AHEAD,
    Refusal.BEHIND: pb.BEHIND_DEADLINE,  # never final on the service side; mapped for completeness
    Refusal.BEHIND_DEADLINE: pb.BEHIND_DEADLINE,
    Refusal.RELEASED: pb.RELEASED,
    Refusal.UNKNOWN: pb.UNKNOWN,
    Refusal.REJECTED: pb.REJECTED,
    Refusal.TERMINATED: pb.TERMINATED,
    Refusal.ALREADY_OPEN: pb.ALREADY_EXISTS,
    Refusal.INVALID_ARGUMENT: pb.INVALID_ARGUMENT,
    Refusal.INTERNAL: pb.INTERNAL,
    Refusal.NO_SESSION: pb.NO_SESSION,
}  # Refusal.UNAVAILABLE is the client's own verdict on a call that failed: it never travels
CODE_REFUSALS: dict[pb.EntryCode, Refusal] = {code: r for r, code in REFUSAL_CODES.items() if r is not Refusal.BEHIND}

_KINDS: dict[ConstraintKind, pb.ConstraintKind] = {
    ConstraintKind.JSON_SCHEMA: pb.JSON_SCHEMA,
    ConstraintKind.REGEX: pb.REGEX,
    ConstraintKind.EBNF: pb.EBNF,
    ConstraintKind.STRUCTURAL_TAG: pb.STRUCTURAL_TAG,
}
_KINDS_BACK: dict[pb.ConstraintKind, ConstraintKind] = {v: k for k, v in _KINDS.items()}
_MODES: dict[JsonSchemaMode, pb.JsonSchemaMode] = {
    JsonSchemaMode.STRICT: pb.JSON_SCHEMA_STRICT,
    JsonSchemaMode.CHECKED: pb.JSON_SCHEMA_CHECKED,
    JsonSchemaMode.LOOSE: pb.JSON_SCHEMA_LOOSE,
}
_MODES_BACK: dict[pb.JsonSchemaMode, JsonSchemaMode] = {v: k for k, v in _MODES.items()}


def refusal_from_code(code: pb.EntryCode, what: str) -> Refusal:
    refusal = CODE_REFUSALS.get(code)
    if refusal is None:
        raise GrammarProtocolError(Refusal.INTERNAL, f"{what}: unexpected code {pb.EntryCode.Name(code)}")
    return refusal


# ---------------------------------------------------------------- constraints


def constraint_to_proto(constraint: Constraint) -> pb.Constraint:
    mode = constraint.json_schema_mode
    return pb.Constraint(
        kind=_KINDS[constraint.kind],
        text=constraint.text,
        json_schema_mode=_MODES[mode] if mode is not None else pb.JSON_SCHEMA_MODE_UNSPECIFIED,
    )


def constraint_from_proto(message: pb.Constraint) -> Constraint:
    """Raises InvalidRequestError for an unset kind, an empty text, an unknown mode or a mode on another kind."""
    kind = _KINDS_BACK.get(message.kind)
    if kind is None:
        raise InvalidRequestError("constraint.kind", f"must be one of {[k.name for k in _KINDS]}")
    mode = None
    if message.json_schema_mode != pb.JSON_SCHEMA_MODE_UNSPECIFIED:
        mode = _MODES_BACK.get(message.json_schema_mode)
        if mode is None:
            raise InvalidRequestError("constraint.json_schema_mode", f"unknown mode {message.json_schema_mode}")
    return Constraint(kind, message.text, mode)


# ---------------------------------------------------------------- commits


def commit_entry_to_proto(entry: CommitEntry) -> pb.CommitEntry:
    return pb.CommitEntry(request_id=entry.request_id, from_ordinal=entry.from_ordinal, tokens=entry.tokens)


def commit_entry_from_proto(message: pb.CommitEntry) -> CommitEntry:
    return CommitEntry(message.request_id, message.from_ordinal, tuple(message.tokens))


def commit_outcome_to_proto(outcome: CommitOutcome) -> pb.CommitResult:
    result = outcome.result
    if result is None:
        refusal = outcome.refusal or Refusal.INTERNAL
        return pb.CommitResult(code=REFUSAL_CODES[refusal], message=outcome.message)
    message = pb.CommitResult(
        code=pb.OK, accepted=result.accepted, terminated=result.terminated, new_ordinal=result.new_ordinal
    )
    if result.rejected_token is not None:
        message.rejected_token = result.rejected_token
    if result.violation is not None:
        message.violation = result.violation
    return message


def commit_outcome_from_proto(message: pb.CommitResult, request_id: str) -> CommitOutcome:
    if message.code != pb.OK:
        return CommitOutcome(None, refusal_from_code(message.code, request_id), message.message)
    rejected = message.rejected_token if message.HasField("rejected_token") else None
    violation = message.violation if message.HasField("violation") else None
    return CommitOutcome(CommitResult(message.accepted, message.terminated, rejected, message.new_ordinal, violation))


# ---------------------------------------------------------------- masks


def mask_entry_to_proto(entry: MaskEntry) -> pb.MaskEntry:
    message = pb.MaskEntry(request_id=entry.request_id, ordinal=entry.ordinal)
    if entry.draft is not None:
        message.draft.tokens.extend(entry.draft.tokens)
        message.draft.parents.extend(entry.draft.parents)
    return message


def mask_entry_from_proto(message: pb.MaskEntry) -> MaskEntry:
    """Raises GrammarProtocolError(INVALID_ARGUMENT) for a malformed draft tree."""
    draft = None
    if message.HasField("draft"):
        draft = DraftTree(tuple(message.draft.tokens), tuple(message.draft.parents))
    return MaskEntry(message.request_id, message.ordinal, draft)


MaskAnswer = range | tuple[Refusal, str]  # an entry's rows in the reply buffer, or its refusal (code, message)


def mask_answers(entries: Sequence[MaskEntry], starts: Sequence[int], refusals: MaskRefusals) -> list[MaskAnswer]:
    """Each entry's answer in a buffer where its rows start at ``starts[i]``: its refusal, or the range of its rows."""
    return [
        refusals.get(i) or range(start, start + entry.num_rows)
        for i, (entry, start) in enumerate(zip(entries, starts, strict=True))
    ]


def encode_masks(words: torch.Tensor, answers: Sequence[MaskAnswer]) -> pb.FillMasksReply:
    """Pack a batch's masks from ``words`` [N, W]: each distinct row once, all-allowed rows as the reference -1.

    Vectorised over the reply: every row is converted to wire words in one array, and rows are told apart by their
    bytes, so the cost per row is a slice and a dict lookup.
    """
    wire = np.ascontiguousarray(words.numpy(), dtype=_WORD)  # [N, W] little-endian
    full = (words == -1).all(dim=1).tolist()  # [N]: rows that allow every token travel as a reference
    index: dict[bytes, int] = {}
    results: list[pb.MaskResult] = []
    for answer in answers:
        if isinstance(answer, range):
            refs = [FULL_ROW_REF if full[r] else index.setdefault(wire[r].tobytes(), len(index)) for r in answer]
            results.append(pb.MaskResult(code=pb.OK, row_refs=refs))
        else:
            refusal, message = answer
            results.append(pb.MaskResult(code=REFUSAL_CODES[refusal], message=message))
    # dicts keep insertion order: row r is the r-th distinct row
    return pb.FillMasksReply(words_per_row=words.shape[1], rows=list(index), results=results)


def decode_masks_into(
    reply: pb.FillMasksReply, entries: Sequence[MaskEntry], out: torch.Tensor, starts: Sequence[int]
) -> MaskRefusals:
    """Unpack a FillMasks reply into ``out`` [N, W], a CPU tensor (entry i's rows from row ``starts[i]``),
    one copy per entry.

    Returns the refused entries by index; their rows are untouched. Raises GrammarProtocolError (INTERNAL) for a
    reply that does not fit the request: another count, width or a row reference out of range.
    """
    if len(reply.results) != len(entries):
        raise GrammarProtocolError(
            Refusal.INTERNAL, f"FillMasks answered {len(reply.results)} entries, {len(entries)} were asked"
        )
    width = reply.words_per_row
    if width != out.shape[1] or any(len(data) != width * _WORD.itemsize for data in reply.rows):
        raise GrammarProtocolError(Refusal.INTERNAL, f"FillMasks sent mask rows that are not {out.shape[1]} words long")
    rows = reply.rows
    full = b"\xff" * (width * _WORD.itemsize)  # the all-allowed row that the -1 reference stands for
    # Plain buffer copies, an entry's rows in one: right after the forward this code runs cold, and numpy's and torch's
    # indexing machinery cost 0.25 ms of the executor's core there (one entry of five rows), against 0.10 ms for this
    # (docs/speculative.md, "The mask exchange itself").
    target = out.numpy()  # [N, W], sharing out's memory
    refusals: MaskRefusals = {}
    for i, (result, entry, start) in enumerate(zip(reply.results, entries, starts, strict=True)):
        if result.code != pb.OK:
            refusals[i] = (refusal_from_code(result.code, entry.request_id), result.message)
            continue
        got = result.row_refs
        if len(got) != entry.num_rows or min(got) < FULL_ROW_REF or max(got) >= len(rows):
            message = f"{entry.request_id}: malformed mask row references {list(got)}"
            raise GrammarProtocolError(Refusal.INTERNAL, message)
        data = b"".join([rows[ref] if ref != FULL_ROW_REF else full for ref in got])
        target[start : start + len(got)] = np.frombuffer(data, dtype=_WORD).reshape(len(got), width)  # [R, W]
    return refusals


def decode_masks(reply: pb.FillMasksReply, entries: Sequence[MaskEntry]) -> list[MaskOutcome]:
    """Unpack a FillMasks reply into per-entry outcomes with int32 [R, W] mask tensors (views of one tensor)."""
    out, starts = mask_buffer(entries, reply.words_per_row)  # [N, W]
    return mask_outcomes(entries, out, starts, decode_masks_into(reply, entries, out, starts))
