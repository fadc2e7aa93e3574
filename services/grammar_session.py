"""A scheduler's session with the grammar service: the ``Session`` call that its grammars live in.

The call is opened with a fresh id, answered once (the grant: which service instance, which vocabulary) and then
stays open for as long as the scheduler keeps it. The service releases every grammar opened in the session when the
call ends, so the two sides agree on one rule: the session ended, its grammars are gone. A thread watches the call
and reports its end (the service died or restarted, the connection was lost) unless the owner closed it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import grpc

from protos import grammar_pb2 as pb
from protos import grammar_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0


class HeldSession:
    """One session on one grammar service instance; ``number`` orders it among its owner's sessions.

    ``on_end(session, reason)`` is called once, from the watching thread, when the call ends without the owner having
    closed it; :attr:`alive` turns false only after that, so an owner that sees a dead session has been told why.
    """

    def __init__(self, stub: pb_grpc.GrammarStub, number: int, on_end: Callable[[HeldSession, str], None]) -> None:
        self.session_id = uuid.uuid4().hex
        self.number = number
        self.grant: pb.SessionGrant | None = None
        self._on_end = on_end
        self._answered = threading.Event()  # granted or ended
        self._ended = threading.Event()
        self._end_reason = "the session was never granted"
        self._closing = False
        self._call = stub.Session(pb.SessionRequest(session=self.session_id))
        self._watcher = threading.Thread(target=self._watch, name="ordinal-grammar-session", daemon=True)
        self._watcher.start()

    @property
    def alive(self) -> bool:
        return self.grant is not None and not self._ended.is_set()

    @property
    def end_reason(self) -> str:
        return self._end_reason

    def wait_granted(self, timeout_s: float) -> pb.SessionGrant | None:
        """The grant, once the service answered; None when it refused or did not answer within ``timeout_s`` (the
        call is then cancelled and :attr:`end_reason` says why)."""
        if not self._answered.wait(timeout_s):
            self._end_reason = f"the grammar service did not grant a session within {timeout_s:.1f} s"
            self.close()
        return self.grant if self.alive else None

    def cancel(self) -> None:
        """End the call: the service releases every grammar of the session. The end is reported as usual."""
        self._call.cancel()

    def close(self) -> None:
        """End the call without reporting it (the owner is done with it)."""
        self._closing = True
        self._call.cancel()
        self._watcher.join(CLOSE_TIMEOUT_S)

    def _watch(self) -> None:
        try:
            for grant in self._call:
                if self.grant is None:
                    self.grant = grant
                    self._answered.set()
            reason = "the grammar service ended the session (it is stopping)"
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            reason = f"the session's call failed ({code.name if code is not None else 'error'}: {details})"
        if self.grant is not None or not self._closing:
            self._end_reason = reason
        if self.grant is not None and not self._closing:
            self._on_end(self, reason)  # before the session reads as dead: see the class docstring
        self._ended.set()
        self._answered.set()
