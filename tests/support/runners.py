"""A step runner that can lose its executor on command, for tests about what the scheduler does then (not about
the executor): the real in-process runner behind a switch."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine.errors import ExecutorUnavailableError
from engine.executor.runner import ModelRunner
from engine.model_info import ModelInfo
from engine.step import StepPlan, StepResult

RESET_TIMEOUT_S = 30.0


class LosableRunner:
    """The real in-process runner, plus a switch that makes it behave like an executor whose session ended:
    every later step fails with ExecutorUnavailableError and the health probe says no."""

    def __init__(self, inner: ModelRunner) -> None:
        self._inner = inner
        self.info: ModelInfo = inner.info
        self.lost = False

    def launch(self, plan: StepPlan) -> Future[StepResult]:
        if not self.lost:
            return self._inner.launch(plan)
        failed: Future[StepResult] = Future()
        failed.set_exception(ExecutorUnavailableError("executor session ended (test)"))
        return failed

    def release(self, slots: Any) -> Future[None]:
        return self._inner.release(slots)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def healthy(self) -> bool:
        return not self.lost and self._inner.healthy()

    def take_loss(self) -> str | None:
        return None  # the loss is reported through the failing launches

    def come_back(self) -> None:
        """An executor answering again, with nothing of the lost session (as a restarted one)."""
        self._inner.reset().result(RESET_TIMEOUT_S)
        self.lost = False
