"""What a client subcommand (``status``, ``goodput``, ``kill``, ``inject``) needs around
its calls: ``--timeout`` as one budget for the whole command (connecting included), and
a quiet exit when the reader of its output goes away (``rallypoint status | head -1``).

Apart from :mod:`rallypoint.cli` so that module stays the commands' frame.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

#: No step of a command gets less than this, so a spent budget still makes one quick
#: attempt (and fails with the attempt's own message) rather than a zero-length one.
MIN_STEP_S = 0.05
#: The exit status of a command whose stdout was closed by its reader: 128 + SIGPIPE, what
#: the shell reports for ``cat`` or ``git log`` in the same place (``cat big | head -1``).
CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE


class Budget:
    """``--timeout`` seconds from now, handed out step by step: the connect gets what is
    left, the call gets what the connect left, so the command ends within about
    ``seconds`` (torchft's clients, and ours before, gave the connect its own 5 s)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._deadline = clock() + seconds

    def left(self) -> float:
        """Seconds left, at least :data:`MIN_STEP_S`."""
        return max(MIN_STEP_S, self._deadline - self._clock())

    def share(self, parts: int) -> float:
        """Seconds for the next of ``parts`` steps still to come: an even share of what
        is left (an HA set's members, so a dead first one cannot spend it all)."""
        return max(MIN_STEP_S, (self._deadline - self._clock()) / max(1, parts))


def closed_pipe() -> int:
    """After a BrokenPipeError on stdout: point stdout at /dev/null (so the interpreter's
    final flush does not fail again and print a traceback) and return
    :data:`CLOSED_PIPE_EXIT`. Nothing goes to stderr: the reader chose to stop reading."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout with no file descriptor (a test's capture)
        pass
    return CLOSED_PIPE_EXIT
