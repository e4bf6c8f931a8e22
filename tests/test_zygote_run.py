"""``rallypoint run``'s zygote: one process per group imports torch, rallypoint and
``--preload`` once, then forks the group's ranks and standbys, which the supervisor adopts
as a child subreaper (``_zygote.py``, ``_forks.py``).

The rules (where a rank comes from, when standbys are due with a zygote, when there is
one) are pure functions tested with tables; the rest runs ``python -m rallypoint run`` on
real processes: ranks forked from the zygote (the supervisor's children, the zygote's
command line, torch imported, their own session), a kill 1 s after the start and 1 s
after the restart that both come back warm; the zygote killed (said once, the ranks then
restart cold); a ``--preload`` that raises (said once, cold from the start); no process
left behind by the supervisor, stopped or killed. Every wait has a deadline; every
process is killed by pid at teardown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import Proc, wait_until
from supervisor_util import children_of, events, pid_alive, read_json, run_group, strays  # noqa: F401 - fixture
from rallypoint.supervisor.policy import (
    ZYGOTE_FAILED, ZYGOTE_OFF, ZYGOTE_READY, ZYGOTE_STARTING, rank_source, standby_start_due, zygote_wanted,
)  # fmt: skip

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote needs Linux")

# ----------------------------------------------------------------------- the rules


@pytest.mark.parametrize("standby, zygote, source", [
    ("ready", ZYGOTE_READY, "standby"),       # a ready standby is the fastest of all
    ("ready", ZYGOTE_FAILED, "standby"),
    ("importing", ZYGOTE_READY, "zygote"),    # a fork is ready at once; the importing standby is not
    ("importing", ZYGOTE_STARTING, "standby"),  # both importing: the standby started first
    ("importing", ZYGOTE_OFF, "standby"),
    ("none", ZYGOTE_READY, "zygote"),
    ("none", ZYGOTE_STARTING, "wait"),        # the first start: one import for the whole group
    ("none", ZYGOTE_FAILED, "cold"),          # the fallback
    ("none", ZYGOTE_OFF, "cold"),             # --no-standby, or not Linux
])  # fmt: skip
def test_rank_source(standby: str, zygote: str, source: str) -> None:
    assert rank_source(standby, zygote) == source


@pytest.mark.parametrize("now, started, reported, delay, zygote, due", [
    (100.0, 100.0, False, 10.0, ZYGOTE_READY, True),      # forked standbys cost no import: at once
    (100.0, 80.0, True, 10.0, ZYGOTE_STARTING, False),    # the zygote will fork them soon
    (100.0, 99.0, False, 10.0, ZYGOTE_FAILED, False),     # failed: the rules of cold standbys
    (100.0, 99.0, True, 10.0, ZYGOTE_FAILED, True),
    (100.0, 90.0, False, 10.0, ZYGOTE_OFF, True),
])  # fmt: skip
def test_standby_start_due_with_a_zygote(now, started, reported, delay, zygote, due) -> None:
    assert standby_start_due(now, started, reported, delay, zygote) is due


@pytest.mark.parametrize("standby, subreaper, linux, wanted", [
    (True, True, True, True), (False, True, True, False), (True, False, True, False), (True, True, False, False),
])  # fmt: skip
def test_zygote_wanted(standby: bool, subreaper: bool, linux: bool, wanted: bool) -> None:
    assert zygote_wanted(standby, subreaper, linux) is wanted


# ----------------------------------------------------------------------- under rallypoint run

WORKER = textwrap.dedent(
    """
    import gc, json, os, sys, time
    t = time.time()
    # The zygote's imports, frozen before it forked (a cold standby freezes its own; a
    # rank started as a new process has none).
    frozen = gc.get_freeze_count()
    warm = "torch" in sys.modules
    out, rank = sys.argv[1], os.environ["RANK"]
    inc = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rec = {"rank": int(rank), "inc": inc, "pid": os.getpid(), "ppid": os.getppid(), "t": t, "warm": warm,
           "sid": os.getsid(0), "pgid": os.getpgrp(), "main": __name__, "argv": sys.argv[1:],
           "stdin": os.path.realpath("/proc/self/fd/0"), "ready_env": os.environ.get("RALLYPOINT_STANDBY_READY"),
           "fd_env": os.environ.get("RALLYPOINT_ZYGOTE_FD"), "helper": "helper" in sys.modules,
           "frozen": frozen,
           "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\\0")}
    with open(os.path.join(out, f"start.{inc}.{rank}"), "w") as f:
        json.dump(rec, f)
    print("started", inc, rank, flush=True)
    while True:  # exit 7 when the test says so, 0 at the end
        if os.path.exists(os.path.join(out, f"crash.{inc}.{rank}")):
            sys.exit(7)
        if os.path.exists(os.path.join(out, "done")):
            sys.exit(0)
        time.sleep(0.02)
    """
)
ZYGOTE_MODULE = "rallypoint.supervisor._zygote"
FALLBACK = "ranks and standbys start cold from now on"


def _start(tmp_path: Path, procs, *flags: str) -> Proc:
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    return run_group(procs, "--nproc-per-node", "2", "--replica-group-id", "3", "--grace-period", "2",
                     "--restart-backoff", "0.1", *flags, str(tmp_path / "worker.py"), str(tmp_path), name="zygote")


def _started(tmp_path: Path, inc: int, sup: Proc, timeout: float = 90) -> list[dict]:
    def both() -> list[dict] | None:
        assert sup.popen.poll() is None, sup.stderr_text()[-4000:]
        recs = [read_json(tmp_path / f"start.{inc}.{r}") for r in range(2)]
        return recs if all(recs) else None  # type: ignore[return-value]

    return wait_until(both, timeout=timeout, what=f"both ranks of incarnation {inc}")  # type: ignore[no-any-return]


def _zygote_pid(sup: Proc) -> int:
    line = wait_until(lambda: re.search(r"the zygote \(pid (\d+)\) is ready", sup.stderr_text()), timeout=90,
                      what="the zygote to be ready")
    return int(line.group(1))


def _ready_standbys(sup: Proc, ranks: list[int], n: int = 2) -> list[int]:
    """The supervisor's ready standbys (the pids in the ready files of its scratch folder)."""
    def ready() -> list[int] | None:
        found = []
        for rundir in _rundirs(sup):
            for f in rundir.glob("standby.*.ready"):
                try:
                    pid = int(f.read_text())
                except (OSError, ValueError):
                    continue
                if pid not in ranks and pid in children_of(sup.pid) and pid_alive(pid):
                    found.append(pid)
        return sorted(found) if len(found) == n else None

    return wait_until(ready, timeout=60, interval=0.05, what=f"{n} ready standbys")  # type: ignore[no-any-return]


def _rundirs(sup: Proc) -> list[Path]:
    out = []
    for pid in children_of(sup.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rallypoint.supervisor._store_host" in argv and len(argv) > 5:
            out.append(Path(argv[5].decode()))
    return out


def _forked_alike(rec: dict, sup: Proc, zygote: int) -> None:
    """A rank forked from the zygote, as the issue asks: the supervisor's child (not the
    zygote's), in a session of its own, the zygote's command line (forked, never exec'd),
    torch imported before the script, and otherwise what a cold rank sees."""
    assert rec["ppid"] == sup.pid and rec["ppid"] != zygote, rec
    assert rec["sid"] == rec["pgid"] == rec["pid"], rec
    assert ZYGOTE_MODULE in rec["cmdline"], rec
    assert (rec["warm"], rec["helper"], rec["main"], rec["stdin"], rec["ready_env"], rec["fd_env"]) == (
        True, True, "__main__", "/dev/null", None, None), rec
    # torch's objects sit in the GC's permanent generation: the rank's collections skip them
    assert rec["frozen"] > 50_000, rec


@pytest.mark.slow
def test_kills_soon_after_a_start_and_a_restart_come_back_warm_from_the_zygote(procs, tmp_path: Path,
                                                                             strays) -> None:
    """The first start's ranks are forked from the zygote (one import for the group).
    SIGKILL to rank 1 about 1 s after they started, and again about 1 s after the restart:
    each restart takes ranks forked from the zygote (standbys it forked right away, or a
    fork at the restart), never an importing or a cold process; the new ranks are the
    supervisor's children; every process is gone at the end and the exit is 0."""
    sup = _start(tmp_path, procs, "--preload", "helper")
    zygote = _zygote_pid(sup)
    strays.append(zygote)
    seen: list[int] = []
    timings = []
    for inc in range(3):
        recs = _started(tmp_path, inc, sup)
        pids = [r["pid"] for r in recs]
        strays.extend(pids)
        seen += pids
        for r in recs:
            assert r["argv"] == [str(tmp_path)]
            _forked_alike(r, sup, zygote)
        if inc == 2:
            break
        time.sleep(max(0.0, max(r["t"] for r in recs) + 1.0 - time.time()))
        killed = time.time()
        os.kill(pids[1], signal.SIGKILL)
        nxt = _started(tmp_path, inc + 1, sup)
        timings.append(round(max(r["t"] for r in nxt) - killed, 3))
        restart = events(sup, "restart")[inc]
        assert (restart["rank"], restart["signal"], restart["importing_ranks"]) == (1, "SIGKILL", []), restart
        assert sorted(restart["warm_ranks"] + restart["forked_ranks"]) == [0, 1], restart
    seen += _ready_standbys(sup, seen)
    strays.extend(seen)
    (tmp_path / "done").write_text("")
    assert sup.wait(30) == 0, sup.stderr_text()[-4000:]
    wait_until(lambda: not [p for p in [*seen, zygote] if pid_alive(p)], timeout=15, what="every process to exit")
    assert FALLBACK not in sup.stderr_text()
    print("kill -> new ranks started (s):", json.dumps(timings))


@pytest.mark.slow
def test_a_killed_zygote_is_said_once_and_the_ranks_restart_cold(procs, tmp_path: Path, strays) -> None:
    """SIGKILL to the zygote, then to the standbys it forked: the supervisor says once that
    it starts cold from now on; a crash then restarts both ranks as new processes (no
    torch imported, ``_rank``'s command line), and the group finishes with 0."""
    sup = _start(tmp_path, procs, "--standby-delay", "120")  # no cold standbys during the test
    zygote = _zygote_pid(sup)
    strays.append(zygote)
    ranks = [r["pid"] for r in _started(tmp_path, 0, sup)]
    standbys = _ready_standbys(sup, ranks)
    strays.extend([*ranks, *standbys])
    os.kill(zygote, signal.SIGKILL)
    wait_until(lambda: FALLBACK in sup.stderr_text(), timeout=30, what="the supervisor to say it starts cold")
    for pid in standbys:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: sup.stderr_text().count("exited (signal SIGKILL) after it was ready") == 2, timeout=30,
               what="the supervisor to see its standbys die")
    (tmp_path / "crash.0.1").write_text("")
    second = _started(tmp_path, 1, sup)
    strays.extend(r["pid"] for r in second)
    for r in second:
        assert not r["warm"] and ZYGOTE_MODULE not in r["cmdline"] and "rallypoint.supervisor._rank" in r["cmdline"], r
        assert r["ppid"] == sup.pid, r
    (restart,) = events(sup, "restart")
    assert (restart["warm_ranks"], restart["forked_ranks"], restart["importing_ranks"]) == ([], [], []), restart
    (tmp_path / "done").write_text("")
    assert sup.wait(30) == 0, sup.stderr_text()[-4000:]
    err = sup.stderr_text()
    assert err.count(FALLBACK) == 1, err[-4000:]
    assert f"the zygote (pid {zygote}) exited (signal SIGKILL); {FALLBACK}" in err, err[-4000:]


@pytest.mark.slow
def test_a_failing_preload_falls_back_to_cold_ranks_at_once(procs, tmp_path: Path, strays) -> None:
    """``--preload broken`` (a module beside the script that raises): the zygote says why
    and exits; the supervisor says once that it starts cold, the first ranks are new
    processes, and a restart works."""
    (tmp_path / "broken.py").write_text("raise RuntimeError('broken on purpose')\n")
    sup = _start(tmp_path, procs, "--preload", "broken", "--standby-delay", "120")
    first = _started(tmp_path, 0, sup)
    strays.extend(r["pid"] for r in first)
    assert [r["warm"] for r in first] == [False, False]
    assert all(ZYGOTE_MODULE not in r["cmdline"] for r in first)
    err = sup.stderr_text()
    assert "zygote: cannot preload 'broken': RuntimeError: broken on purpose" in err, err[-4000:]
    assert "could not get ready" in err and err.count(FALLBACK) == 1, err[-4000:]
    (tmp_path / "crash.0.0").write_text("")
    strays.extend(r["pid"] for r in _started(tmp_path, 1, sup))
    (tmp_path / "done").write_text("")
    assert sup.wait(30) == 0, sup.stderr_text()[-4000:]
    assert sup.stderr_text().count(FALLBACK) == 1


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 143)])
def test_nothing_outlives_the_supervisor(procs, tmp_path: Path, strays, sig: int, code: int) -> None:
    """SIGKILL (``PR_SET_PDEATHSIG``, set once re-parented, and the lifeline) or SIGTERM (a
    graceful stop) to the supervisor: the zygote, the forked ranks and the forked standbys
    are all gone, none of them left a zombie of the supervisor behind."""
    sup = _start(tmp_path, procs)
    zygote = _zygote_pid(sup)
    ranks = [r["pid"] for r in _started(tmp_path, 0, sup)]
    standbys = _ready_standbys(sup, ranks)
    every = [zygote, *ranks, *standbys]
    strays.extend(every)
    assert set(every) <= set(children_of(sup.pid))
    sup.kill(sig)
    assert sup.wait(30) == code, sup.stderr_text()[-3000:]
    wait_until(lambda: not [p for p in every if pid_alive(p)], timeout=15, what="every process to exit")
