"""``python -m services.parent_death PARENT_PID COMMAND...``: run COMMAND so that it dies with its parent.

On Linux the kernel sends the process SIGTERM when the thread that started it exits, even by SIGKILL (the
parent-death signal of ``prctl``), so no service outlives ``ordinal serve``. The setting is made here, in the child
itself, and survives the ``exec`` of COMMAND (same pid, same process group). It is not made in a pre-exec hook of
``subprocess``: the launcher has threads (one per child output stream), and a child forked from a threaded process
that runs Python code before its exec can deadlock there (Python's documentation warns of exactly this), hanging
silently instead of starting. If the parent is already gone when the setting takes effect, COMMAND is not run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m services.parent_death PARENT_PID COMMAND...", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), list(argv[1:])
    if sys.platform.startswith("linux"):
        # Without prctl the launcher still stops its children on a signal; only its own SIGKILL would leave them.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the setting: nobody would stop this service
            return 1
    os.execvp(command[0], command)
    return 127  # unreachable: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
