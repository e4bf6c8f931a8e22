"""The supervisor's decisions, as pure functions over plain data (no clock reads, no
processes): how a group incarnation ended, whether it made progress, whether and when to
restart it, and the crash-loop rule. ``tests/test_supervisor.py`` calls them with tables.

Vocabulary: an *incarnation* is one start of all the group's ranks (numbered from 0, the
``TORCHELASTIC_RESTART_COUNT`` its ranks see). The group is the unit of failure: one rank
that fails ends the incarnation, and the next one starts every rank afresh.

The hang watchdog's rules are here too (``hung_ranks``, ``progress_change_time``,
``watch_wait``, ``poll_period``): the shell polls each rank's progress file and passes in
monotonic timestamps; a hung rank ends its incarnation with the cause ``hang`` and then
follows the same restart rules as a crash.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

RUNNING, DONE, FAILED = "running", "done", "failed"


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts``: how many consecutive restarts without progress are allowed before
    the supervisor gives up (a crash loop: a bad host, a broken script). ``backoff_s``: the
    wait before the first such restart (a restart after progress waits for nothing), doubled for each further one and capped at
    ``backoff_cap_s``. ``min_healthy_s``: for scripts that never report a committed step
    (no ``Manager``), an incarnation that lived this long counts as progress."""

    max_restarts: int = 5
    backoff_s: float = 0.5
    backoff_cap_s: float = 30.0
    min_healthy_s: float = 60.0


@dataclass(frozen=True)
class Decision:
    """What to do after a failed incarnation. ``streak``: consecutive failed incarnations
    without progress, this one included (0 when it made progress)."""

    restart: bool
    backoff_s: float
    streak: int
    reason: str


def describe_exit(returncode: int) -> str:
    """``exit code 3`` / ``signal SIGKILL`` (Popen reports a signal as ``-signum``)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def group_state(returncodes: Sequence[int | None]) -> str:
    """``done`` when every rank exited 0, ``failed`` as soon as one exited otherwise
    (non-zero or by a signal), else ``running`` (``None``: still running)."""
    if any(rc is not None and rc != 0 for rc in returncodes):
        return FAILED
    if all(rc == 0 for rc in returncodes):
        return DONE
    return RUNNING


def made_progress(committed: bool, uptime_s: float, reports_seen: bool, policy: RestartPolicy) -> bool:
    """Did an incarnation make progress? A committed step (the ``Manager`` reports each
    one) always counts. Uptime counts only for scripts that never reported a step in any
    incarnation (``reports_seen`` false): for a script that does report, hours spent
    without a commit (a host that cannot join, a stuck rendezvous) are no progress."""
    if committed:
        return True
    return not reports_seen and uptime_s >= policy.min_healthy_s


def backoff(policy: RestartPolicy, streak: int) -> float:
    """The wait before a restart: none after an incarnation that made progress (``streak``
    0: the group was healthy, and every second it is away is lost goodput), ``backoff_s``
    after the first one that did not, doubling per further one, capped."""
    if streak <= 0:
        return 0.0
    return min(policy.backoff_cap_s, policy.backoff_s * (2.0 ** min(streak - 1, 60)))


STANDBY_DEATHS_MAX = 3  # standbys that died in a row before one became ready: stop making them


def standby_refill_delay(deaths_in_a_row: int) -> float | None:
    """The wait before replacing a warm standby that died while it waited (the OOM killer,
    someone's ``kill``, a ``--preload`` module that raises): 0.5 s, doubling, at most 30 s;
    ``None`` after ``STANDBY_DEATHS_MAX`` deaths in a row with none ready in between, since
    then the standbys cannot start on this host and the ranks start cold (as without
    standbys) instead of a standby being restarted forever."""
    if deaths_in_a_row >= STANDBY_DEATHS_MAX:
        return None
    return min(30.0, 0.5 * 2.0 ** max(0, deaths_in_a_row - 1))


ZYGOTE_OFF, ZYGOTE_STARTING, ZYGOTE_READY, ZYGOTE_FAILED = "off", "starting", "ready", "failed"


def standby_start_due(now: float, started: float, all_reported: bool, delay_s: float,
                      zygote: str = ZYGOTE_OFF) -> bool:
    """Start the next incarnation's warm standbys now? With the group's zygote ready, at
    once: a standby forked from it costs no import, so it takes no CPU from the group.
    While the zygote imports, not yet (it will fork them). Otherwise (no zygote, or it
    failed) once every rank of the running incarnation has committed a step (its imports,
    first quorum and heal are done, so the standbys' imports no longer compete with them
    for the CPU), or ``delay_s`` after it started (a script without a Manager never
    reports)."""
    if zygote == ZYGOTE_READY:
        return True
    if zygote == ZYGOTE_STARTING:
        return False
    return all_reported or now - started >= delay_s


def zygote_wanted(standby: bool, subreaper: bool, linux: bool) -> bool:
    """Start a zygote for the group? Only with standbys on (``--no-standby`` keeps every
    rank a new process, as before) and where the supervisor can adopt the zygote's
    children (Linux, ``PR_SET_CHILD_SUBREAPER`` set)."""
    return standby and subreaper and linux


def rank_source(standby: str, zygote: str) -> str:
    """Where a rank of a new incarnation comes from. ``standby``: its standby's state,
    ``ready``, ``importing`` or ``none``; ``zygote``: ``ZYGOTE_*``. The answer:

    - ``standby``: its ready standby (the fastest: already forked or imported), or an
      importing one when there is no ready zygote to fork from (it has a head start);
    - ``zygote``: a child forked from the ready zygote (imports done; a fork);
    - ``wait``: wait for the zygote still importing (further along than a new process
      would be, and a group's first start then costs one import instead of one per rank);
    - ``cold``: a new process (no zygote, or it failed)."""
    if standby == "ready":
        return "standby"
    if zygote == ZYGOTE_READY:
        return "zygote"
    if standby == "importing":
        return "standby"
    if zygote == ZYGOTE_STARTING:
        return "wait"
    return "cold"


def after_failure(policy: RestartPolicy, streak_before: int, progressed: bool) -> Decision:
    """The restart rule. A failed incarnation that made progress resets the streak and is
    restarted; one that did not extends it, and once the streak exceeds ``max_restarts``
    (that many restarts in a row brought nothing) the supervisor gives up. So
    ``max_restarts`` 0 restarts only after incarnations that made progress."""
    streak = 0 if progressed else streak_before + 1
    if streak > policy.max_restarts:
        return Decision(
            restart=False, backoff_s=0.0, streak=streak,
            reason=(f"crash loop: {streak} incarnation(s) in a row failed without progress (no committed step; "
                    f"--max-restarts {policy.max_restarts})"),
        )
    return Decision(
        restart=True, backoff_s=backoff(policy, streak), streak=streak,
        reason="made progress" if progressed else f"no progress: restart {streak} of at most {policy.max_restarts} in a row",
    )


def first_failure(exits: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The ``(rank, returncode)`` that ended an incarnation: the first non-zero exit in the
    order the supervisor saw them (later ones are usually the group being stopped)."""
    for rank, rc in exits:
        if rc != 0:
            return rank, rc
    return None


POLL_MAX_S = 0.5  # the longest wait between two looks at the progress files


def poll_period(hang_timeout_s: float) -> float | None:
    """How often the watchdog looks at the progress files: a tenth of the timeout, at most
    ``POLL_MAX_S`` and at least 0.05 s; ``None`` when the watchdog is off (timeout 0)."""
    if hang_timeout_s <= 0:
        return None
    return min(POLL_MAX_S, max(0.05, hang_timeout_s / 10))


def progress_change_time(now: float, previous_poll: float, age_s: float) -> float:
    """When a progress file that changed since the poll at ``previous_poll`` changed: ``now``
    minus the file's age (``age_s``, from its mtime on the wall clock), clamped to the time
    since that poll, so that a wall clock that jumps cannot move it outside what was seen."""
    return now - min(max(age_s, 0.0), max(now - previous_poll, 0.0))


def parse_progress(text: bytes) -> tuple[int | None, bool]:
    """A progress file's content (``rallypoint.manager._progress``): ``(step, finished)``;
    ``<step>`` after a commit, ``<step> done`` once the Manager shut down (no more commits
    are coming: the watchdog stops timing the rank). Anything else: ``(None, False)``."""
    parts = text.split()
    try:
        step = int(parts[0]) if parts else None
    except ValueError:
        return None, False
    return step, len(parts) == 2 and parts[1] == b"done"


def hung_ranks(now: float, last_change: Sequence[float | None], timeout_s: float) -> list[int]:
    """The ranks with no progress for ``timeout_s`` seconds at ``now``, the longest silent
    first (ties: the lower rank). ``last_change[r]`` is when rank ``r``'s progress last
    changed, ``None`` before its first report in this incarnation: its clock has not
    started (imports, the first quorum and the first heal are not timed). ``timeout_s`` 0
    turns the watchdog off."""
    if timeout_s <= 0:
        return []
    late = [(t, r) for r, t in enumerate(last_change) if t is not None and now - t >= timeout_s]
    return [r for _, r in sorted(late)]


def watch_wait(now: float, last_change: Sequence[float | None], timeout_s: float) -> float | None:
    """How long the main loop may sleep before it must look at the progress files again:
    the poll period, or less when a rank's deadline comes sooner; ``None`` (no deadline)
    with the watchdog off."""
    period = poll_period(timeout_s)
    if period is None:
        return None
    deadlines = [t + timeout_s - now for t in last_change if t is not None]
    return max(0.0, min([period, *deadlines]))


def stop_exit_code(signum: int) -> int:
    """The supervisor's exit code after a requested stop (SIGTERM/SIGINT): ``128 + signum``
    as a shell reports a process killed by that signal (143, 130), so a scheduler can tell
    "stopped" from "finished" (0)."""
    return 128 + signum


__all__ = [
    "DONE", "FAILED", "POLL_MAX_S", "RUNNING", "STANDBY_DEATHS_MAX", "Decision", "RestartPolicy", "after_failure",
    "backoff",
    "describe_exit", "first_failure", "group_state", "hung_ranks", "made_progress", "parse_progress", "poll_period",
    "progress_change_time", "rank_source", "standby_refill_delay", "standby_start_due", "stop_exit_code",
    "watch_wait", "zygote_wanted", "ZYGOTE_FAILED", "ZYGOTE_OFF", "ZYGOTE_READY", "ZYGOTE_STARTING",
]
