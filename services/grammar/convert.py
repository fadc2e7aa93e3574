"""Grammar protocol messages <-> engine grammar values, for both the service and its client.

Mask rows travel packed: each distinct row once per reply as little-endian int32 words, every entry naming its
rows by index, and a row that allows every token as the reference -1 with no data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.grammar import (
    CommitEntry,
    CommitOutcome,
    CommitResult,
    Constraint,
    ConstraintKind,
    DraftTree,
    GrammarProtocolError,
    MaskEntry,
    MaskOutcome,
    MaskRows,
    Refusal,
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
}
CODE_REFUSALS: dict[pb.EntryCode, Refusal] = {code: r for r, code in REFUSAL_CODES.items() if r is not Refusal.BEHIND}

_KINDS: dict[ConstraintKind, pb.ConstraintKind] = {
    ConstraintKind.JSON_SCHEMA: pb.JSON_SCHEMA,
    ConstraintKind.REGEX: pb.REGEX,
    ConstraintKind.EBNF: pb.EBNF,
    ConstraintKind.STRUCTURAL_TAG: pb.STRUCTURAL_TAG,
}
_KINDS_BACK: dict[pb.ConstraintKind, ConstraintKind] = {v: k for k, v in _KINDS.items()}


def refusal_from_code(code: pb.EntryCode, what: str) -> Refusal:
    refusal = CODE_REFUSALS.get(code)
    if refusal is None:
        raise GrammarProtocolError(Refusal.INTERNAL, f"{what}: unexpected code {pb.EntryCode.Name(code)}")
    return refusal


# ---------------------------------------------------------------- constraints


def constraint_to_proto(constraint: Constraint) -> pb.Constraint:
    return pb.Constraint(kind=_KINDS[constraint.kind], text=constraint.text)


def constraint_from_proto(message: pb.Constraint) -> Constraint:
    """Raises InvalidRequestError for an unset kind or an empty text."""
    kind = _KINDS_BACK.get(message.kind)
    if kind is None:
        raise InvalidRequestError("constraint.kind", f"must be one of {[k.name for k in _KINDS]}")
    return Constraint(kind, message.text)


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
    return message


def commit_outcome_from_proto(message: pb.CommitResult, request_id: str) -> CommitOutcome:
    if message.code != pb.OK:
        return CommitOutcome(None, refusal_from_code(message.code, request_id), message.message)
    rejected = message.rejected_token if message.HasField("rejected_token") else None
    return CommitOutcome(CommitResult(message.accepted, message.terminated, rejected, message.new_ordinal))


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


def encode_masks(outcomes: Sequence[MaskOutcome], words_per_row: int) -> pb.FillMasksReply:
    """Pack mask outcomes: each distinct row once, all-allowed rows as the reference -1."""
    reply = pb.FillMasksReply(words_per_row=words_per_row)
    index: dict[bytes, int] = {}
    for outcome in outcomes:
        if outcome.rows is None:
            refusal = outcome.refusal or Refusal.INTERNAL
            reply.results.append(pb.MaskResult(code=REFUSAL_CODES[refusal], message=outcome.message))
            continue
        refs = [_row_ref(row, full, index) for row, full in zip(outcome.rows.words, outcome.rows.full, strict=True)]
        reply.results.append(pb.MaskResult(code=pb.OK, row_refs=refs))
    reply.rows.extend(index)  # dicts keep insertion order: row r is the r-th distinct row
    return reply


def _row_ref(row: torch.Tensor, full: bool, index: dict[bytes, int]) -> int:
    if full:
        return FULL_ROW_REF
    data = row.numpy().astype(_WORD, copy=False).tobytes()  # [W] words
    return index.setdefault(data, len(index))


def decode_masks(reply: pb.FillMasksReply, entries: Sequence[MaskEntry]) -> list[MaskOutcome]:
    """Unpack a FillMasks reply into per-entry outcomes with int32 [R, W] mask tensors."""
    if len(reply.results) != len(entries):
        raise GrammarProtocolError(
            Refusal.INTERNAL, f"FillMasks answered {len(reply.results)} entries, {len(entries)} were asked"
        )
    width = reply.words_per_row
    if any(len(data) != width * _WORD.itemsize for data in reply.rows):
        raise GrammarProtocolError(Refusal.INTERNAL, f"FillMasks sent a mask row that is not {width} words long")
    rows = [torch.from_numpy(np.frombuffer(data, dtype=_WORD).astype(np.int32)) for data in reply.rows]  # [W] each
    return [_decode_one(result, entry, rows, width) for result, entry in zip(reply.results, entries, strict=True)]


def _decode_one(result: pb.MaskResult, entry: MaskEntry, rows: list[torch.Tensor], width: int) -> MaskOutcome:
    if result.code != pb.OK:
        return MaskOutcome(None, refusal_from_code(result.code, entry.request_id), result.message)
    refs = list(result.row_refs)
    if len(refs) != entry.num_rows or any(not FULL_ROW_REF <= r < len(rows) for r in refs):
        raise GrammarProtocolError(Refusal.INTERNAL, f"{entry.request_id}: malformed mask row references {refs}")
    words = torch.full((len(refs), width), -1, dtype=torch.int32)  # [R, W]: all allowed unless a row says less
    for i, ref in enumerate(refs):
        if ref != FULL_ROW_REF:
            words[i] = rows[ref]
    return MaskOutcome(MaskRows(words, tuple(ref == FULL_ROW_REF for ref in refs)))
