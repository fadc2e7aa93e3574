"""What the engine does while a service it depends on is lost: the executor, or the grammar service.

**The executor.** Its loss ends every admitted request (their KV is gone: :meth:`Scheduler.executor_lost`). From
then on nothing is planned until the executor answers again (a restarted one on the same address; the runner
reconnects at the next launch): queued requests, and requests that arrive meanwhile, wait for it, each at most
``outage_timeout_s`` counted from the later of its arrival and the loss, then end UNAVAILABLE.

**The grammar service.** A remote grammar backend opens grammars in numbered sessions; a session that ends takes its
grammars with it (:class:`~engine.grammar_calls.GrammarLoss`). The engine then ends every request whose grammar lived
in a lost session, queued or running, with an abort caused by the grammar service (UNAVAILABLE, naming it); the
requests without a grammar are not touched. A new constrained request whose grammar cannot be opened because the
service is unavailable retries until ``outage_timeout_s`` after its submission, then ends UNAVAILABLE.
"""

from __future__ import annotations

import time

from engine.grammar_calls import GrammarBackend, GrammarLoss
from engine.step import StepRunner

PROBE_INTERVAL_S = 0.25  # between two health probes of a lost executor that answered "no" at once


class ExecutorOutage:
    """Whether the executor is lost, since when, and when the engine may plan again."""

    def __init__(self, runner: StepRunner, timeout_s: float) -> None:
        self._runner = runner
        self._timeout_s = timeout_s
        self._down_since: float | None = None

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def lost(self) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()

    def back(self) -> bool:
        """Probe the executor (bounded); True once it answers, which ends the outage."""
        started = time.monotonic()
        if self._runner.healthy():
            self._down_since = None
            return True
        time.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - started)))  # a "no" at once is not a busy loop
        return False

    def expiry(self) -> float | None:
        """Queued requests that arrived before this moment (monotonic) have waited their outage timeout out; None
        while nobody has (the outage is younger than the timeout)."""
        if self._down_since is None:
            return None
        cutoff = time.monotonic() - self._timeout_s
        return cutoff if self._down_since < cutoff else None


class GrammarSessions:
    """The grammar sessions the engine has seen end: a request whose grammar lives in one cannot go on."""

    def __init__(self, grammar: GrammarBackend | None) -> None:
        self._grammar = grammar
        self._lost_upto = 0  # every session numbered up to this one ended; 0: none (in process: the only session)

    def take_loss(self, verify: bool = False) -> GrammarLoss | None:
        """The backend's newest session loss not handled yet (see :meth:`GrammarBackend.take_loss`)."""
        if self._grammar is None:
            return None
        loss = self._grammar.take_loss(verify)
        if loss is not None:
            self._lost_upto = max(self._lost_upto, loss.session)
        return loss

    def lost(self, session: int) -> bool:
        """Whether the grammars of ``session`` are gone (session 0, the in-process one, never ends)."""
        return 0 < session <= self._lost_upto
