"""The grammar service's calls as values, shared by every side: commits, masks, refusals, draft trees, the errors of
an open, and the protocol a grammar backend speaks (in process, :class:`~engine.grammar.backend.LocalGrammar`; over
gRPC, ``services.grammar_client.RemoteGrammar``).

The scheduler commits each step's tokens (one batched call, from the ordinal it starts at: C2) and releases; the
executor asks for fenced masks at an ordinal (C3), one batched call per step, with a draft tree for speculative
verify (C5). Nothing here needs xgrammar: the scheduler side and the executor side import these values without
loading the grammar engine (``engine/grammar/``), which implements them.

Masks travel in xgrammar's layout: one bit per token id, packed into int32 words, ``words_per_row`` per row.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from engine.constraint import Constraint, ConstraintKind
from engine.errors import InvalidRequestError, ProtocolError

BITS_PER_WORD = 32


class InvalidGrammarError(InvalidRequestError):
    """xgrammar cannot compile a constraint: the grammar is malformed or uses something it does not support.

    ``reason`` is xgrammar's own message (without its log header), so that the client can fix the grammar.
    Being an :class:`InvalidRequestError`, services map it to INVALID_ARGUMENT.
    """

    def __init__(self, kind: ConstraintKind, reason: str) -> None:
        super().__init__(f"constraint.{kind.value}", f"invalid grammar: {reason}")
        self.kind = kind
        self.reason = reason


class GrammarTimeoutError(RuntimeError):
    """A compile did not finish within its deadline. It keeps running and its result is cached for later."""


class GrammarUnavailableError(RuntimeError):
    """The grammar service cannot be used now: it does not answer, or the session a grammar would live in ended.

    Raised by :meth:`GrammarBackend.open` (the engine retries until the request's outage deadline, then ends it
    with UNAVAILABLE, naming the grammar service)."""


@dataclass(frozen=True)
class GrammarLoss:
    """The grammar service lost every grammar opened in a session up to ``session`` (a counter the backend keeps:
    each new session with the service gets the next number): it restarted, or the session's call ended. The
    requests whose grammars lived there cannot go on; ``reason`` says why, for their message."""

    session: int
    reason: str


def words_per_row(vocab_size: int) -> int:
    """Width of one mask row in xgrammar's layout: one bit per token id, packed into int32 words."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


class Refusal(enum.Enum):
    """Why a grammar call was refused. Each but UNAVAILABLE maps to one per-entry code of the grammar protocol."""

    STALE_ORDINAL = "stale_ordinal"  # commit from an ordinal already passed: a replay (C2)
    FUTURE_ORDINAL = "future_ordinal"  # commit from an ordinal not reached: a gap (C2)
    AHEAD = "ahead"  # mask for an ordinal the matcher has already passed (C3)
    BEHIND = "behind"  # mask for an ordinal not reached yet; the registry's fence waits on it (C3)
    BEHIND_DEADLINE = "behind_deadline"  # ...and the commit reaching it did not come in time (C3)
    RELEASED = "released"  # the matcher was released; nothing more is answered
    UNKNOWN = "unknown"  # no matcher was ever opened under this id (or its release is long forgotten)
    REJECTED = "rejected"  # the matcher refused a token earlier and is finished (C13)
    TERMINATED = "terminated"  # mask asked of a grammar that has terminated: no next token exists (C6)
    ALREADY_OPEN = "already_open"  # open under an id that is open
    INVALID_ARGUMENT = "invalid_argument"  # a malformed call: empty id, bad draft tree, wrong buffer
    INTERNAL = "internal"  # xgrammar failed unexpectedly on this entry; the others are unaffected
    NO_SESSION = "no_session"  # open in a session that is not held (it ended: its grammars were released, C9)
    # Client side only, never answered by the service: the call did not reach it or got no answer, so the state of
    # every grammar of the session is unknown and the session is ended (its grammars are released with it).
    UNAVAILABLE = "unavailable"


MASKS_UNAVAILABLE = "grammar masks unavailable"  # how a row's error begins when the service could not be asked


def masks_unavailable(reason: str) -> str:
    """A sampling row's error when its fenced masks could not be had from the service at all (not a refusal)."""
    return f"{MASKS_UNAVAILABLE}: {reason}"


def mask_refused(code: Refusal, message: str) -> str:
    """A sampling row's error when the service refused its mask request."""
    return f"grammar mask refused ({code.value}): {message}"


def is_service_unavailable(row_error: str) -> bool:
    """Whether a sampling row's error says the grammar service, not the request's grammar, failed: the request then
    ends UNAVAILABLE (worth retrying), as when the scheduler finds its grammar session lost."""
    return row_error.startswith((MASKS_UNAVAILABLE, f"grammar mask refused ({Refusal.UNAVAILABLE.value})"))


class GrammarProtocolError(ProtocolError):
    """A grammar call broke the protocol; ``code`` says how, the message says exactly what was expected."""

    def __init__(self, code: Refusal, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class CommitResult:
    """What a commit did. ``accepted`` tokens from the front were fed; the rest were not.

    ``terminated``: the grammar accepted a stop token (tokens after it were not fed, C6). ``rejected_token``:
    the first token the grammar refused; the matcher is finished and the request must be aborted (C13).
    ``violation`` (checked mode): why it was refused when the grammar took it but the output check did not: the
    output violates a keyword of its JSON schema (keyword, places and value), the words for the abort.
    """

    accepted: int
    terminated: bool
    rejected_token: int | None
    new_ordinal: int
    violation: str | None = None


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens to verify, as a tree under the committed state (the root, which has no token here).

    ``parents[i]`` is the index of node i's parent, or -1 when node i follows the committed state directly;
    any order is accepted as long as it is a tree. Masks for a tree come as ``len(tokens) + 1`` rows: row 0
    for the committed state itself, row i + 1 for the state after the path to node i. A chain of k drafts is
    ``DraftTree.chain(tokens)``.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        # Accept any int sequences (lists, tensors' tolist()) but keep the value hashable and immutable.
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        if len(self.tokens) != len(self.parents):
            raise invalid_argument(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        if any(t < 0 for t in self.tokens):
            raise invalid_argument("draft tree: token ids must be >= 0")
        n = len(self.parents)
        if any(not -1 <= p < n for p in self.parents):
            raise invalid_argument(f"draft tree: parents must be -1 or a node index in [0, {n})")
        _check_acyclic(self.parents)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A linear draft: each token follows the one before it."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_links(cls, tokens: Sequence[int], next_token: Sequence[int], next_sibling: Sequence[int]) -> DraftTree:
        """Convert the first-child / next-sibling layout (SGLang's and xgrammar's) where node 0 is the root.

        ``tokens[0]`` (the root's token, already committed) is ignored; node j > 0 becomes node j - 1, so row j
        of the masks still belongs to node j.
        """
        tokens, next_token, next_sibling = ([int(v) for v in seq] for seq in (tokens, next_token, next_sibling))
        n = len(tokens)
        if n == 0 or len(next_token) != n or len(next_sibling) != n:
            raise invalid_argument("draft links: tokens, next_token and next_sibling must have the same length >= 1")
        if next_sibling[0] != -1:
            raise invalid_argument("draft links: the root (node 0) cannot have siblings")
        parent = [-2] * n  # -2: not reached (yet)
        parent[0] = -1
        stack = [(next_token[0], 0)]  # (first node of a sibling list, their parent)
        while stack:
            node, up = stack.pop()
            while node != -1:
                if not 0 < node < n or parent[node] != -2:
                    raise invalid_argument(f"draft links: node {node} is out of range or reached twice")
                parent[node] = up
                stack.append((next_token[node], node))
                node = next_sibling[node]
        missing = [j for j in range(1, n) if parent[j] == -2]
        if missing:
            raise invalid_argument(f"draft links: nodes {missing} are not reachable from the root")
        return cls(tuple(tokens[1:]), tuple(parent[j] - 1 if parent[j] > 0 else -1 for j in range(1, n)))

    @property
    def num_rows(self) -> int:
        return len(self.tokens) + 1

    def links(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xgrammar's layout with a synthetic root at index 0: (next_token, next_sibling, tokens), int64 [N+1]."""
        rows = self.num_rows
        next_token = [-1] * rows
        next_sibling = [-1] * rows
        last_child = [-1] * rows
        for i, p in enumerate(self.parents):
            node, up = i + 1, p + 1  # shift: the root takes index 0
            if last_child[up] == -1:
                next_token[up] = node
            else:
                next_sibling[last_child[up]] = node
            last_child[up] = node
        tokens = [0, *self.tokens]  # the root's token is never fed
        return _int64(next_token), _int64(next_sibling), _int64(tokens)


@dataclass(frozen=True)
class CommitEntry:
    """Tokens committed for one request in one step, starting from ordinal ``from_ordinal``."""

    request_id: str
    from_ordinal: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class CommitOutcome:
    """Either ``result`` (the commit happened) or ``refusal`` with a message (nothing changed)."""

    result: CommitResult | None
    refusal: Refusal | None = None
    message: str = ""


@dataclass(frozen=True)
class MaskEntry:
    """A mask request: one row at ``ordinal``, or the rows of ``draft`` over the state at ``ordinal``."""

    request_id: str
    ordinal: int
    draft: DraftTree | None = None

    @property
    def num_rows(self) -> int:
        return 1 if self.draft is None else self.draft.num_rows


@dataclass(frozen=True)
class MaskRows:
    """Computed masks of one entry: ``words`` in xgrammar layout, and which rows allow every token."""

    words: torch.Tensor  # [R, W] int32: bit j of word i set <=> token 32*i + j allowed
    full: tuple[bool, ...]  # per row: every bit set


@dataclass(frozen=True)
class MaskOutcome:
    """Either ``rows`` or ``refusal`` with a message. BEHIND is transient: the fence keeps waiting on it."""

    rows: MaskRows | None
    refusal: Refusal | None = None
    message: str = ""


# A mask batch's refusals, by entry index: (code, message). An entry not in it had its rows written.
MaskRefusals = dict[int, tuple[Refusal, str]]


def mask_buffer(entries: Sequence[MaskEntry], words_per_row: int) -> tuple[torch.Tensor, list[int]]:
    """A zeroed int32 buffer [N, W] for every entry's rows one after another, and each entry's first row."""
    starts: list[int] = []
    total = 0
    for entry in entries:
        starts.append(total)
        total += entry.num_rows
    return torch.zeros((total, words_per_row), dtype=torch.int32), starts


def mask_outcomes(
    entries: Sequence[MaskEntry], out: torch.Tensor, starts: Sequence[int], refusals: MaskRefusals
) -> list[MaskOutcome]:
    """Per-entry outcomes of a batch answered into ``out`` [N, W] (entry i's rows from ``starts[i]``)."""
    full = (out == -1).all(dim=1).tolist()  # [N]
    outcomes: list[MaskOutcome] = []
    for i, (entry, start) in enumerate(zip(entries, starts, strict=True)):
        refused = refusals.get(i)
        if refused is not None:
            outcomes.append(MaskOutcome(None, *refused))
        else:
            stop = start + entry.num_rows
            outcomes.append(MaskOutcome(MaskRows(out[start:stop], tuple(full[start:stop]))))
    return outcomes


class MaskSource(Protocol):
    """Where the executor's fenced masks come from: the grammar service, or a relay to it (services/mask_relay.py)."""

    def fill_masks_into(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskRefusals:
        """Fenced masks (C3) written into ``out`` [N, W] (entry i's rows from row ``starts[i]``); returns the
        refused entries by index. Raises only when the whole call fails (the service is unreachable)."""
        ...


class GrammarBackend(MaskSource, Protocol):
    """The grammar service as the engine sees it. A remote one holds a **session** for the grammars it opens: they
    live as long as the session, and a session that ends (the service restarted, a call on it failed) takes them
    all with it. Sessions are numbered in order; an in-process backend has one, 0, that never ends."""

    def open(self, request_id: str, constraint: Constraint) -> int:
        """Compile (cached) and open a matcher at ordinal 0; the number of the session it lives in. Raises
        InvalidGrammarError (the grammar is bad: INVALID_ARGUMENT with xgrammar's reason), GrammarTimeoutError,
        GrammarProtocolError, or GrammarUnavailableError (the service cannot be used now: worth a retry)."""
        ...

    def commit(self, entries: Sequence[CommitEntry]) -> list[CommitOutcome]:
        """One step's commits, answered per entry. When the call itself fails every entry is refused UNAVAILABLE
        and the session ends (a :class:`GrammarLoss` to take)."""
        ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    @property
    def num_open(self) -> int: ...

    def take_loss(self, verify: bool = False) -> GrammarLoss | None:
        """The newest session loss not taken yet, once; None when every session so far is alive or was reported.
        ``verify``: first ask the service whether the current session still holds (bounded; the engine asks so
        when a mask could not be had, to tell a lost service from a refusal of one request)."""
        ...

    def unavailable(self) -> str | None:
        """None when grammars can be opened now; else why not (bounded: it may try to reach the service)."""
        ...


class MaskWait(Protocol):
    """A mask batch asked for and not answered yet."""

    def result(self) -> MaskRefusals:
        """Block until answered (see :meth:`GrammarBackend.fill_masks_into`); raises only if the whole call failed."""
        ...

    def close(self) -> None:
        """The answer is not wanted any more (the step failed): stop writing into the buffer, free what it holds."""
        ...


@runtime_checkable
class FencingBackend(Protocol):
    """A backend that can open a step's mask fence now and answer it later, without a thread waiting at it."""

    computes_meanwhile: bool
    """True where the rows are computed elsewhere while the caller goes on (the remote service, in its process): a
    fence that may not wait (early commit) is started the same way. False: the rows are computed on the caller's
    thread, by the commits that fill the fence or at the result."""

    def start_masks(
        self, entries: Sequence[MaskEntry], deadline_s: float, out: torch.Tensor, starts: Sequence[int]
    ) -> MaskWait: ...


def _int64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)  # [N+1]


def _check_acyclic(parents: Sequence[int]) -> None:
    """Every node's parent chain must end at the root (-1); a cycle would make the traversal loop forever."""
    done = [False] * len(parents)
    for start in range(len(parents)):
        path: set[int] = set()
        node = start
        while node != -1 and not done[node]:
            if node in path:
                raise invalid_argument(f"draft tree: node {node} is its own ancestor")
            path.add(node)
            node = parents[node]
        for visited in path:
            done[visited] = True


def invalid_argument(message: str) -> GrammarProtocolError:
    """A refusal of a malformed call (an empty id, a bad draft tree, a wrong buffer)."""
    return GrammarProtocolError(Refusal.INVALID_ARGUMENT, message)
