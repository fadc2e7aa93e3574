"""Which session owns which grammar: what a grammar service must release when a scheduler goes away (C9).

A scheduler holds a session with the grammar service for as long as it runs (the ``Session`` call of the grammar
protocol) and opens its grammars in it. When the session ends, because the scheduler closed it, died or lost its
connection, every grammar it owns is released, so nothing a dead scheduler opened outlives it. A grammar opened in
no session (the empty id) is released only by an explicit release.

Not thread-safe: :class:`~engine.grammar.registry.GrammarRegistry` uses it under its own lock.
"""

from __future__ import annotations

from engine.grammar_calls import GrammarProtocolError, Refusal

NO_SESSION = ""  # a grammar opened in no session: released only by an explicit release


class SessionTable:
    """Held sessions and the request ids of the grammars each one owns."""

    def __init__(self) -> None:
        self._owned: dict[str, set[str]] = {}  # session -> request ids of its open grammars
        self._owner: dict[str, str] = {}  # request id -> its session

    def __len__(self) -> int:
        return len(self._owned)

    def held(self, session: str) -> bool:
        return session in self._owned

    def hold(self, session: str) -> None:
        """Start ``session``; refused when the id is empty (INVALID_ARGUMENT) or held already (ALREADY_OPEN)."""
        if session == NO_SESSION:
            raise GrammarProtocolError(Refusal.INVALID_ARGUMENT, "a session id must not be empty")
        if session in self._owned:
            raise GrammarProtocolError(Refusal.ALREADY_OPEN, f"session {session} is held already")
        self._owned[session] = set()

    def check_held(self, session: str) -> None:
        """Refuse an open in ``session`` when it is not held (NO_SESSION); the empty id always passes."""
        if session != NO_SESSION and session not in self._owned:
            raise GrammarProtocolError(
                Refusal.NO_SESSION, f"session {session} is not held: it ended, and its grammars were released"
            )

    def own(self, session: str, request_id: str) -> None:
        """``request_id``'s grammar belongs to ``session`` (checked to be held, or the empty id)."""
        self.check_held(session)
        if session != NO_SESSION:
            self._owned[session].add(request_id)
            self._owner[request_id] = session

    def disown(self, request_id: str) -> None:
        """``request_id``'s grammar was released: its session no longer owns it."""
        session = self._owner.pop(request_id, None)
        if session is not None:
            self._owned[session].discard(request_id)

    def end(self, session: str) -> list[str]:
        """End ``session`` (unknown: nothing); the request ids of the grammars it owned, for the caller to release."""
        owned = self._owned.pop(session, set())
        for request_id in owned:
            del self._owner[request_id]
        return sorted(owned)
