"""The supervisor of ``ordinal serve`` restarting services: backoff, the cap on restarts per minute, readiness.

The restart arithmetic is checked on :class:`RestartHistory` with a fake clock. The supervisor itself runs real child
processes that play services (tiny ``python -c`` scripts, no torch): the one place a fake service is right, since the
test is about the supervisor. Each child appends to a log when it starts, so a test sees every restart, and says
READY like a service when the script lets it.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from services.supervisor import Child, RestartHistory, RestartPolicy, StopSignal, Supervisor

REPO = Path(__file__).resolve().parents[2]
POLICY = RestartPolicy(max_restarts=3, window_s=60.0, initial_backoff_s=0.2, max_backoff_s=10.0)
WAIT_S = 30.0


def test_backoff_doubles_per_exit_within_the_window_and_the_cap_gives_up() -> None:
    """Fails if the delay does not grow with the exits of the last window, or if the cap counts exits outside it."""
    history = RestartHistory(RestartPolicy(max_restarts=5, window_s=60.0, initial_backoff_s=0.5, max_backoff_s=10.0))
    assert [history.record_exit(t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert history.record_exit(5.0) is None  # a sixth exit within a minute: give up

    spaced = RestartHistory(RestartPolicy(max_restarts=2, window_s=60.0))
    # Exits a window apart never pile up: each one is the first of its window, restarted after the initial backoff.
    assert [spaced.record_exit(t) for t in (0.0, 61.0, 122.0, 183.0)] == [0.5, 0.5, 0.5, 0.5]
    assert spaced.record_exit(184.0) == 1.0 and spaced.record_exit(185.0) is None


def test_backoff_is_capped_and_restarts_can_be_off() -> None:
    history = RestartHistory(RestartPolicy(max_restarts=10, initial_backoff_s=1.0, max_backoff_s=5.0))
    assert [history.record_exit(float(t)) for t in range(6)] == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert RestartHistory(RestartPolicy(max_restarts=0)).record_exit(0.0) is None
    with pytest.raises(ValueError):
        RestartPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


# ---------------------------------------------------------------------------------------------- real children


def _service(log: Path, body: str) -> list[str]:
    """A fake service: logs its start (wall time), then runs ``body``."""
    head = f"""
        import signal, sys, time
        with open({str(log)!r}, "a") as f:
            f.write(f"{{time.time()}}\\n")
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    """
    return [sys.executable, "-c", textwrap.dedent(head) + textwrap.dedent(body)]


def _starts(log: Path) -> list[float]:
    return [float(line) for line in log.read_text().split()] if log.exists() else []


READY_THEN_SERVE = """
    print("FAKE_READY port=4242", flush=True)
    time.sleep(60)
"""


def test_a_child_that_keeps_dying_is_restarted_with_growing_backoff_then_given_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every death is reported with its exit code and last lines, and followed by a restart no sooner than its
    backoff (0.2, 0.4, 0.8 s); the fourth exit within the window passes the cap of three restarts: supervise says
    so and returns 1. Fails if restarts ignore the backoff or the cap."""
    log = tmp_path / "starts"
    dying = """
        print("FAKE_READY port=4242", flush=True)
        print("RuntimeError: boom", file=sys.stderr, flush=True)
        time.sleep(0.1)
        sys.exit(3)
    """
    with Supervisor(StopSignal(), stop_timeout=5) as sup:
        child = sup.launch("grammar", _service(log, dying))
        sup.wait_ready_line(child, "FAKE", timeout=WAIT_S)
        assert sup.supervise(POLICY, startup_timeout=WAIT_S) == 1
    err = capsys.readouterr().err
    starts = _starts(log)
    assert len(starts) == 4, err  # the first start and three restarts
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= 0.1 + backoff for gap, backoff in zip(gaps, (0.2, 0.4, 0.8), strict=True)), gaps
    assert err.count("exited with exit code 3") == 4 and err.count("| RuntimeError: boom") >= 4, err
    for delay, k in ((0.2, 1), (0.4, 2), (0.8, 3)):
        assert f"restarting grammar in {delay:.1f} s (exit {k} of at most 3 within 60 s)" in err, err
    assert "grammar exited more than 3 times within 60 s: giving up on it" in err


def test_a_killed_child_is_restarted_with_its_command_line_and_a_stop_still_stops_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other child keeps running (same pid) while the killed one comes back in its place in the stop order;
    ``on_ready`` hears of it once it says READY; a stop signal ends supervise with 0 and stops both, restarted one
    last, as the reverse start order says."""
    stop = StopSignal()
    logs = {name: tmp_path / name for name in ("grammar", "executor")}
    back: list[Child] = []
    with Supervisor(stop, stop_timeout=5) as sup:
        children = {name: sup.launch(name, _service(log, READY_THEN_SERVE)) for name, log in logs.items()}
        for child in children.values():
            sup.wait_ready_line(child, "FAKE", timeout=WAIT_S)
        survivor = children["executor"].pid
        children["grammar"].proc.send_signal(signal.SIGKILL)

        def stop_once_back(child: Child) -> None:
            back.append(child)
            stop.requested.set()

        assert sup.supervise(POLICY, startup_timeout=WAIT_S, on_ready=stop_once_back) == 0
        assert [c.name for c in back] == ["grammar"] and back[0].pid != children["grammar"].pid
        assert back[0].argv == children["grammar"].argv
        assert sup.pids() == {"grammar": back[0].pid, "executor": survivor}
    assert back[0].exited() == 0 and children["executor"].exited() == 0  # SIGTERM: a clean stop
    assert len(_starts(logs["grammar"])) == 2 and len(_starts(logs["executor"])) == 1
    err = capsys.readouterr().err
    assert "exited with exit code -9 (killed by SIGKILL)" in err and "grammar is back (pid" in err
    assert err.index("executor stopped") < err.index("grammar stopped"), "reverse start order"


def test_a_restart_that_never_gets_ready_is_killed_and_counts_against_the_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the first instance says READY; each restart hangs without it, is killed at the startup timeout, and that
    death counts like any other, until the cap."""
    log = tmp_path / "starts"
    first_only = f"""
        if len(open({str(log)!r}).read().split()) == 1:
            print("FAKE_READY port=4242", flush=True)
            time.sleep(0.2)
            sys.exit(1)
        time.sleep(60)
    """
    policy = RestartPolicy(max_restarts=2, window_s=60.0, initial_backoff_s=0.1, max_backoff_s=1.0)
    started = time.monotonic()
    with Supervisor(StopSignal(), stop_timeout=5) as sup:
        child = sup.launch("executor", _service(log, first_only))
        sup.wait_ready_line(child, "FAKE", timeout=WAIT_S)
        assert sup.supervise(policy, startup_timeout=1.0) == 1
    assert time.monotonic() - started < WAIT_S
    assert len(_starts(log)) == 3
    err = capsys.readouterr().err
    assert err.count("was not ready 1 s after its restart: killing it") == 2, err


def test_a_stop_during_a_backoff_stops_cleanly(tmp_path: Path) -> None:
    stop = StopSignal()
    log = tmp_path / "starts"
    with Supervisor(stop, stop_timeout=5) as sup:
        child = sup.launch("grammar", _service(log, READY_THEN_SERVE))
        sup.wait_ready_line(child, "FAKE", timeout=WAIT_S)
        child.proc.send_signal(signal.SIGKILL)
        threading.Timer(0.6, stop.requested.set).start()  # within the 5 s backoff below
        policy = RestartPolicy(max_restarts=3, initial_backoff_s=5.0, max_backoff_s=5.0)
        assert sup.supervise(policy, startup_timeout=WAIT_S) == 0
    assert len(_starts(log)) == 1, "nothing restarted once the stop came"


# ---------------------------------------------------------------------------------------------- dying with us

_LAUNCHER = """
import sys, time
from services.supervisor import StopSignal, Supervisor
sup = Supervisor(StopSignal(), stop_timeout=5)
serve = "import time; print('FAKE_READY port=1', flush=True); time.sleep(60)"
child = sup.launch("grammar", [sys.executable, "-c", serve])
sup.wait_ready_line(child, "FAKE", timeout=30)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_children_die_with_a_launcher_killed_outright() -> None:
    """A launcher SIGKILLed (no chance to stop anything) still takes its children with it: the kernel sends each one
    SIGTERM (the parent-death signal services/parent_death.py sets before exec'ing the service). Fails if that
    setting is removed: the child lives on, orphaned."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    child = 0
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        launcher.kill()
        launcher.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while _running(child):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if child and _running(child):  # only when the test failed: never leave the orphan behind
            os.kill(child, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_is_not_run(tmp_path: Path) -> None:
    """The parent died before the setting took effect (the wrapper is told its parent is pid 1; its real parent is
    this process): nothing is exec'd. Run as its own process: called in the test's process, the setting would stay on
    pytest, and where pytest's parent is pid 1 (a detached run) the wrapper would exec the command in its place."""
    marker = tmp_path / "ran"
    command = [sys.executable, "-m", "services.parent_death", "1", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1, done.stderr
    assert not marker.exists()


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False
